"""One process writing one big file alone (rank 0 saving the whole model, `cp`, `dd`), with a
probe of the mount meanwhile:

    python -m bench.alone [--gib 2] [--rounds 2] [--workdir DIR]

In turns, each round: ckptfs as it is; ckptfs with `CKPTFS_BUFFERED_WRITES=0` (every big
record written by the log's writer thread with O_DIRECT, as before 2026-12-07); and a plain
directory on the disk that holds NVME. The writer is a process of its own that writes
`--gib` GiB of fresh bytes in 1 MiB `write()`s from a page-aligned buffer, then fsyncs. The
probe, in this process, `stat`s and lists the target every 10 ms and times each: what other
processes see while the writer has the request thread to itself (architecture.md section 2,
"Big records through the page cache"). "records buffered" is how many of the file's records
went through the page cache (`ckptfs status`). SHARED is a local directory. Needs root
(drop_caches) and `/dev/fuse`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.ckptfs_target import CkptfsMount
from bench.mounts import drop_caches

WRITER = r"""
import json, mmap, os, struct, sys, time
path, mib = sys.argv[1], int(sys.argv[2])
buf = mmap.mmap(-1, 1 << 20)
buf.write(os.urandom(1 << 20))
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
t0 = time.perf_counter()
for i in range(mib):
    struct.pack_into("<QQ", buf, 0, i, os.getpid())  # (no MiB repeats another)
    os.write(fd, buf)
t1 = time.perf_counter()
os.fsync(fd)
t2 = time.perf_counter()
os.close(fd)
print(json.dumps({"write_s": t1 - t0, "fsync_s": t2 - t1}))
"""


def run_one(target: Path, mib: int) -> dict[str, float]:
    """The writer against `target`, the probe alongside; figures of one round."""
    lat: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            os.stat(target)
            os.listdir(target)
            lat.append(time.perf_counter() - t)
            stop.wait(0.01)

    drop_caches()
    th = threading.Thread(target=probe, daemon=True)
    th.start()
    try:
        out = subprocess.run([sys.executable, "-c", WRITER, str(target / "alone.bin"), str(mib)],
                             check=True, capture_output=True, text=True, timeout=3600).stdout
    finally:
        stop.set()
        th.join()
    (target / "alone.bin").unlink()
    got = json.loads(out)
    lat.sort()
    gb = mib * (1 << 20) / 1e9
    return {"write GB/s": gb / got["write_s"], "fsync s": got["fsync_s"],
            "GB/s with fsync": gb / (got["write_s"] + got["fsync_s"]),
            "probe p50 ms": lat[len(lat) // 2] * 1e3,
            "probe p99 ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3,
            "probe max ms": lat[-1] * 1e3}


def _status(mnt: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "ckptfs", "status", str(mnt), "--json"],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    return json.loads(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="size of the file written (GiB)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=None,
                    help="where NVME, SHARED, the mounts and the plain directory go "
                         "(default: a new directory under /tmp)")
    a = ap.parse_args()
    if a.gib <= 0 or a.rounds < 1:
        ap.error("--gib must be above 0 and --rounds at least 1")
    mib = max(1, int(a.gib * 1024))
    work = Path(tempfile.mkdtemp(prefix="ckptfs-alone-", dir=a.workdir))
    knob = "CKPTFS_BUFFERED_WRITES"
    targets = {"ckptfs": "", "ckptfs, BUFFERED_WRITES=0": "0", "plain directory": None}
    res: dict[str, list[dict[str, float]]] = {t: [] for t in targets}
    saved = os.environ.get(knob)
    try:
        for rnd in range(a.rounds):
            order = list(targets) if rnd % 2 == 0 else list(targets)[::-1]
            for name in order:
                value = targets[name]
                if value is None:
                    plain = work / "plain"
                    plain.mkdir(exist_ok=True)
                    res[name].append(run_one(plain, mib))
                    continue
                os.environ.pop(knob, None)
                if value:
                    os.environ[knob] = value  # (the daemon's environment)
                d = work / f"m{rnd}-{len(res[name])}-{value or 'default'}"
                (d / "shared").mkdir(parents=True)
                with CkptfsMount(d / "nvme", d / "shared", d / "mnt", [], d / "ckptfs.log") as m:
                    row = run_one(m.mountpoint, mib)
                    row["records buffered"] = float(
                        _status(m.mountpoint)["log_records_buffered"])
                    res[name].append(row)
                shutil.rmtree(d, ignore_errors=True)
    finally:
        os.environ.pop(knob, None)
        if saved is not None:
            os.environ[knob] = saved
        shutil.rmtree(work, ignore_errors=True)
    print(f"\none writer, {mib} MiB in 1 MiB write()s then fsync, {a.rounds} rounds "
          "(the median of the rounds; every round in brackets)")
    keys = list(res["ckptfs"][0])  # (the plain directory has no "records buffered")
    print("| target | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for name, rows in res.items():
        cells = []
        for k in keys:
            vals = [r[k] for r in rows if k in r]
            cells.append(f"{statistics.median(vals):.2f} ({', '.join(f'{v:.2f}' for v in vals)})"
                         if vals else "-")
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
