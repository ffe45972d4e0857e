"""Other nodes' files at scale: what a node pays to import them, at mount and while mounted.

    python -m bench.import_scale [--files 100000] [--more 50000] [--reads 20000]

Node A (a ckptfs mount) gets `--files` small files in step_1/ from 8 processes and waits
until they are published. Then, on the same SHARED:

1. Node B mounts from an empty NVMe directory: the import of A's namespace happens before
   the mount serves anything. Reported: the time `ckptfs mount` took, B's peak RSS
   (VmHWM) and private memory (RssAnon) right after, and again after reading `--reads` of
   the files (their first reads fetch the records from SHARED).
2. While B is mounted, A gets `--more` files in step_2/ and publishes them; B imports them
   at its next refresh. Meanwhile a probe opens and reads one of B's own files every 10 ms:
   reported are the slowest probe and how many took over 100 ms (a refresh that held the
   trio thread stalled the mount for its whole import; it now yields every 5 ms).

The daemon's RSS target (<= 300 MiB) was set for checkpoint bytes; this shows where file
counts take it (docs/operations.md, "Memory"). Needs /dev/fuse; everything runs under
--workdir and is unmounted and removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench.ckptfs_target import proc_usage
from bench.mounts import unmount

CKPTFS = [sys.executable, "-m", "ckptfs"]


def _write_files(args: tuple[str, int, int]) -> int:
    d, rank, n = args
    for i in range(rank, n, 8):
        with open(os.path.join(d, f"__{rank}_{i}.distcp"), "wb") as f:
            f.write(b"%d" % i * 100)
    return rank


def make_files(d: Path, n: int) -> float:
    d.mkdir(parents=True, exist_ok=True)
    t = time.monotonic()
    with ProcessPoolExecutor(8) as ex:
        list(ex.map(_write_files, [(str(d), r, n) for r in range(8)]))
    return time.monotonic() - t


def ckptfs(*args: str | Path, timeout: float = 3600) -> str:
    res = subprocess.run([*CKPTFS, *map(str, args)], capture_output=True, text=True,
                         timeout=timeout, stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        raise SystemExit(f"ckptfs {' '.join(map(str, args))}: {res.stderr.strip()}")
    return res.stdout


def daemon_pid(mnt: Path) -> int:
    return int(json.loads(ckptfs("status", mnt, "--json"))["pid"])


def count(d: Path) -> int:
    return len(os.listdir(d)) if d.exists() else 0


def memory(pid: int) -> tuple[int, int]:
    """(VmHWM, RssAnon) in MiB."""
    u = proc_usage(pid)
    if u is None or u["rss_anon_bytes"] is None:
        raise RuntimeError(f"process {pid} is gone")
    return u["rss_peak_bytes"] >> 20, u["rss_anon_bytes"] >> 20


def probe(path: Path, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        with open(path, "rb") as f:
            f.read()
        out.append(time.perf_counter() - t)
        time.sleep(0.01)


def run(work: Path, files: int, more: int, reads: int) -> None:
    shared = work / "shared"
    a = {"nvme": work / "nvme-a", "mnt": work / "mnt-a"}
    b = {"nvme": work / "nvme-b", "mnt": work / "mnt-b"}
    for p in (shared, *a.values(), *b.values()):
        p.mkdir(parents=True)
    mounted: list[Path] = []
    try:
        ckptfs("mount", a["nvme"], shared, a["mnt"], "--node-id", "bench-a")
        mounted.append(a["mnt"])
        took = make_files(a["mnt"] / "step_1", files)
        ckptfs("wait", a["mnt"])
        print(f"node A: {files:,} files written in {took:.1f} s and published")

        t = time.monotonic()
        ckptfs("mount", b["nvme"], shared, b["mnt"], "--node-id", "bench-b",
               "--refresh-interval", "1")
        mount_s = time.monotonic() - t
        mounted.append(b["mnt"])
        pid = daemon_pid(b["mnt"])
        hwm0, anon0 = memory(pid)
        names = sorted(os.listdir(b["mnt"] / "step_1"))[:reads]
        t = time.monotonic()
        for name in names:
            (b["mnt"] / "step_1" / name).read_bytes()
        read_s = time.monotonic() - t
        hwm1, anon1 = memory(pid)

        (b["mnt"] / "probe").write_bytes(b"hello")
        lat: list[float] = []
        stop = threading.Event()
        th = threading.Thread(target=probe, args=(b["mnt"] / "probe", stop, lat))
        th.start()
        try:
            make_files(a["mnt"] / "step_2", more)
            ckptfs("wait", a["mnt"])
            deadline = time.monotonic() + 600
            while count(b["mnt"] / "step_2") < more:
                if time.monotonic() > deadline:
                    raise SystemExit("node B did not import step_2 within 600 s")
                time.sleep(0.5)
            time.sleep(2)  # the refresh's last steps (removals, invalidations)
        finally:
            stop.set()
            th.join()
        hwm2, anon2 = memory(pid)
        slow = sorted(lat)[-5:]
        print(f"\n| other node's files | B: mount (import) | B: peak RSS / private after mount"
              f" | after reading {len(names):,} | after importing {more:,} more |")
        print("|---|---|---|---|---|")
        print(f"| {files:,} | {mount_s:.1f} s | {hwm0} / {anon0} MiB | {hwm1} / {anon1} MiB "
              f"({read_s:.1f} s) | {hwm2} / {anon2} MiB |")
        print(f"\nB's probe during the import of {more:,} more files: {len(lat)} reads, "
              f"slowest {max(lat):.2f} s, {sum(x > 0.1 for x in lat)} over 100 ms "
              f"(slowest five: {', '.join(f'{x:.2f}' for x in slow)})")
    finally:
        for mnt in reversed(mounted):
            try:
                ckptfs("umount", mnt, timeout=900)
            except (SystemExit, subprocess.TimeoutExpired):
                unmount(mnt)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=100_000, help="node A's files in step_1/")
    ap.add_argument("--more", type=int, default=50_000,
                    help="files node A adds while B is mounted (B's refresh imports them)")
    ap.add_argument("--reads", type=int, default=20_000, help="files node B reads back")
    ap.add_argument("--workdir", default=tempfile.gettempdir(), help="where to put it all")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckptfs-import-scale-", dir=a.workdir))
    try:
        run(work, a.files, a.more, a.reads)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
