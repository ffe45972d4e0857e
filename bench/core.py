"""Core write-path figures, through the mount vs straight to NVMe's filesystem, same run:

    python -m bench.core [--gib 2] [--files 400] [--rounds 3]

1. one large sequential file (1 MiB writes, fsync at the end): MB/s;
2. creates of 1 MiB files from 8 processes (create, write, close; no fsync): files/s;
3. fsyncs/s with 8 concurrent writers (4 KiB write + fsync in a loop).
Rounds alternate between the two targets; the best of each is printed, with the ratio.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def seq_write(path: str, nbytes: int) -> float:
    buf = os.urandom(1 << 20)
    t0 = time.monotonic()
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    done = 0
    while done < nbytes:
        done += os.write(fd, buf)
    os.fsync(fd)
    os.close(fd)
    dt = time.monotonic() - t0
    os.unlink(path)
    return nbytes / dt / 1e6


def _creator(d: str, rank: int, n: int, go: "mp.synchronize.Event") -> None:
    buf = os.urandom(1 << 20)
    go.wait()
    for i in range(n):
        fd = os.open(f"{d}/f_{rank}_{i}", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        os.write(fd, buf)
        os.close(fd)


def _fsyncer(d: str, rank: int, seconds: float, go: "mp.synchronize.Event", q: "mp.Queue") -> None:
    fd = os.open(f"{d}/s_{rank}", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    block = os.urandom(4096)
    go.wait()
    n = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        os.write(fd, block)
        os.fsync(fd)
        n += 1
    os.close(fd)
    q.put(n)


def creates(d: str, files: int, procs: int = 8) -> float:
    os.makedirs(d, exist_ok=True)
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    ps = [ctx.Process(target=_creator, args=(d, r, files // procs, go)) for r in range(procs)]
    for p in ps:
        p.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    go.set()
    for p in ps:
        p.join()
    dt = time.monotonic() - t0
    shutil.rmtree(d)
    return files // procs * procs / dt


def fsyncs(d: str, seconds: float = 3.0, procs: int = 8) -> float:
    os.makedirs(d, exist_ok=True)
    ctx = mp.get_context("spawn")
    go, q = ctx.Event(), ctx.Queue()
    ps = [ctx.Process(target=_fsyncer, args=(d, r, seconds, go, q)) for r in range(procs)]
    for p in ps:
        p.start()
    time.sleep(0.5)
    go.set()
    total = sum(q.get() for _ in ps)
    for p in ps:
        p.join()
    shutil.rmtree(d)
    return total / seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--files", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckptfs-core-"))
    nvme, shared, mnt, raw = (work / n for n in ("nvme", "shared", "mnt", "raw"))
    for p in (nvme, shared, mnt, raw):
        p.mkdir()
    ck = [sys.executable, "-m", "ckptfs"]
    subprocess.run(ck + ["mount", str(nvme), str(shared), str(mnt), "--node-id", "core"],
                   check=True, stdout=subprocess.DEVNULL)
    best: dict[tuple[str, str], float] = {}
    try:
        for _ in range(a.rounds):
            for name, root in (("nvme", raw), ("ckptfs", mnt)):
                for what, fn in (("seq MB/s", lambda r=root: seq_write(f"{r}/big",
                                                                          int(a.gib * 2**30))),
                                 ("creates/s", lambda r=root: creates(f"{r}/c", a.files)),
                                 ("fsyncs/s", lambda r=root: fsyncs(f"{r}/s"))):
                    v = fn()
                    best[(name, what)] = max(best.get((name, what), 0.0), v)
        print(f"load average {os.getloadavg()[0]:.1f} (2 cores)")
        print("| figure | NVMe filesystem | through ckptfs | ratio |\n|---|---|---|---|")
        for what in ("seq MB/s", "creates/s", "fsyncs/s"):
            n, c = best[("nvme", what)], best[("ckptfs", what)]
            print(f"| {what} | {n:,.0f} | {c:,.0f} | {c / n:.2f} |")
    finally:
        subprocess.run(ck + ["umount", str(mnt), "--no-drain"], stdout=subprocess.DEVNULL)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
