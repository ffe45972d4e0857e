"""Read-path figures: restores through the mount vs reading the same bytes straight, same run:

    python -m bench.readpath [--mib 256] [--ranks 8] [--rounds 2] [--nas]

8 rank processes write one file each through a ckptfs mount (1 MiB writes, unique data, fsync),
`ckptfs wait`, then in alternating rounds, page cache dropped before each read:
1. local restore: each rank reads its file through the mount (records in local segments);
   baseline: the same number of readers read the log segment files straight;
2. shared restore: after `ckptfs evict --all` each rank reads its file through the mount (every
   byte fetched from SHARED and verified); baseline: the same readers read SHARED's objects.
3. random 4 KiB reads: each rank writes a second file in 4 KiB writes (through the mount, and
   into a plain directory on the same disk), then reads --random-reads random 4 KiB blocks of
   it with POSIX_FADV_RANDOM, page cache dropped; IOPS through the mount vs the plain file
   (a database-like or mmap-like reader; before 2026-12-06 a cold random read blocked every
   other request of the daemon, bench/README.md).
With --nas, SHARED is the NAS emulator at zero latency over a local directory, as in
`python -m bench`, so the shared case pays the same two FUSE hops there. Prints GB/s of each,
the ratio, and the daemon's CPU seconds per GB read (the part this benchmark exists for: the
daemon's cost, which the noisy disk does not hide).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GB = 1e9


def _writer(path: str, rank: int, mib: int) -> None:
    chunk = bytearray(os.urandom(1 << 20))
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    for k in range(mib):
        chunk[:8] = (rank << 32 | k).to_bytes(8, "little")  # every record unique: no dedup
        os.write(fd, chunk)
    os.fsync(fd)
    os.close(fd)


def _small_writer(path: str, rank: int, mib: int) -> None:
    chunk = bytearray(random.Random(rank).randbytes(4096))
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    for k in range(mib * 256):
        chunk[:8] = (rank << 32 | k).to_bytes(8, "little")
        os.write(fd, chunk)
    os.fsync(fd)
    os.close(fd)


def _random_reader(paths: list[str], reads: int) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no kernel readahead
        blocks = os.fstat(fd).st_size // 4096
        rnd = random.Random(os.path.basename(p))  # the same offsets through ckptfs and plain
        for _ in range(reads):
            k = rnd.randrange(blocks)
            if len(os.pread(fd, 4096, k * 4096)) != 4096:
                raise RuntimeError(f"short read of {p} at block {k}")
        os.close(fd)


def _reader(paths: list[str]) -> None:
    buf = bytearray(1 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def _parallel(fn: object, args: list[tuple]) -> float:
    ctx = mp.get_context("fork")
    ps = [ctx.Process(target=fn, args=a) for a in args]  # type: ignore[arg-type]
    t0 = time.monotonic()
    for p in ps:
        p.start()
    for p in ps:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"a reader/writer failed (exit code {p.exitcode})")
    return time.monotonic() - t0


def _drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _split(paths: list[str], n: int) -> list[tuple[list[str]]]:
    out: list[list[str]] = [[] for _ in range(n)]
    for i, p in enumerate(sorted(paths)):
        out[i % n].append(p)
    return [(b,) for b in out if b]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB per rank's file")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pyspy", metavar="PREFIX",
                    help="profile the daemon with py-spy (installed separately) during the "
                         "restores through ckptfs: PREFIX-local.txt, PREFIX-shared.txt "
                         "(collapsed stacks, --idle off, --gil off)")
    ap.add_argument("--random-mib", type=int, default=32,
                    help="MiB per rank's file of 4 KiB records for the random reads")
    ap.add_argument("--random-reads", type=int, default=2000,
                    help="random 4 KiB reads per rank (0: skip them)")
    ap.add_argument("--nas", action="store_true",
                    help="SHARED is the NAS emulator (latencies at zero, its bandwidth cap "
                         "kept) over a local directory, as in `python -m bench`, not the "
                         "directory itself")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckptfs-readpath-"))
    nvme, shared, mnt, plain = (work / n for n in ("nvme", "shared", "mnt", "plain"))
    for p in (nvme, shared, mnt, plain):
        p.mkdir()
    try:
        with contextlib.ExitStack() as stack:  # the emulator is unmounted before the rmtree
            if a.nas:
                from bench.nasemu import NasEmu

                shared = work / "nas"
                stack.enter_context(NasEmu(work / "shared", shared, meta_latency_us=0,
                                           meta_ops_per_sec=0, log_path=work / "nasemu.log"))
            return _run(a, nvme, shared, mnt, plain)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(a: argparse.Namespace, nvme: Path, shared: Path, mnt: Path, plain: Path) -> int:
    ck = [sys.executable, "-m", "ckptfs"]
    out = subprocess.run(ck + ["mount", str(nvme), str(shared), str(mnt), "--node-id", "rp"],
                         check=True, capture_output=True, text=True).stdout
    pid = int(re.search(r"pid (\d+)", out).group(1))  # type: ignore[union-attr]
    files = [str(mnt / f"rank{r}.bin") for r in range(a.ranks)]
    nbytes = a.ranks * a.mib << 20
    res: dict[str, list[tuple[float, float]]] = {}

    def measure(name: str, paths: list[str], daemon: bool) -> None:
        _drop_caches()
        spy = None
        if a.pyspy and daemon:
            spy = subprocess.Popen(["py-spy", "record", "-p", str(pid), "-r", "250",
                                    "--format", "raw", "--nonblocking", "-o",
                                    f"{a.pyspy}-{name.split()[0]}.txt"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        c0 = _cpu(pid)
        dt = _parallel(_reader, _split(paths, a.ranks))
        cpu = _cpu(pid) - c0 if daemon else 0.0
        if spy is not None:
            spy.send_signal(2)
            spy.wait(timeout=60)
        size = sum(os.path.getsize(p) for p in paths)
        res.setdefault(name, []).append((size / dt / GB, cpu / (size / GB)))

    try:
        _parallel(_writer, [(f, r, a.mib) for r, f in enumerate(files)])
        subprocess.run(ck + ["wait", str(mnt)], check=True, stdout=subprocess.DEVNULL)
        segs = [str(p) for p in (nvme / "segments").iterdir()]
        for i in range(a.rounds):
            order = [("local via ckptfs", files, True), ("log segments straight", segs, False)]
            for name, paths, daemon in order if i % 2 == 0 else order[::-1]:
                measure(name, paths, daemon)
        # random 4 KiB reads of local 4 KiB records vs a plain file on the same disk
        # (--random-reads 0 skips them)
        small = [mnt / f"small{r}.bin" for r in range(a.ranks)]
        small_plain = [plain / f"small{r}.bin" for r in range(a.ranks)]
        for paths in (small, small_plain) if a.random_reads > 0 else ():
            _parallel(_small_writer, [(str(f), r, a.random_mib) for r, f in enumerate(paths)])
        rand: dict[str, list[tuple[float, float]]] = {}
        for i in range(a.rounds if a.random_reads > 0 else 0):
            order = [("ckptfs", small, True), ("plain", small_plain, False)]
            for name, paths, daemon in order if i % 2 == 0 else order[::-1]:
                _drop_caches()
                c0 = _cpu(pid)
                dt = _parallel(_random_reader, [([str(p)], a.random_reads) for p in paths])
                n = len(paths) * a.random_reads
                cpu_ms = (_cpu(pid) - c0) * 1000 / (n / 1000) if daemon else 0.0
                rand.setdefault(name, []).append((n / dt, cpu_ms))
        subprocess.run(ck + ["evict", str(mnt), "--all"], check=True, stdout=subprocess.DEVNULL)
        objs = [str(p) for p in shared.rglob("*.seg")]
        for i in range(a.rounds):
            order = [("shared via ckptfs", files, True), ("shared objects straight", objs, False)]
            for name, paths, daemon in order if i % 2 == 0 else order[::-1]:
                measure(name, paths, daemon)
        print(f"{a.ranks} readers, {nbytes / GB:.2f} GB; best of {a.rounds} alternating rounds; "
              f"load average {os.getloadavg()[0]:.1f} (2 cores)")
        print("| restore | through ckptfs GB/s | straight GB/s | ratio | daemon CPU s per GB |")
        print("|---|---|---|---|---|")
        for mine, base in (("local via ckptfs", "log segments straight"),
                           ("shared via ckptfs", "shared objects straight")):
            m = max(g for g, _ in res[mine])
            b = max(g for g, _ in res[base])
            cpu = min(c for _, c in res[mine])
            print(f"| {mine.split()[0]} | {m:.3f} | {b:.3f} | {m / b:.2f} | {cpu:.2f} |")
        if not rand:
            return 0
        print()
        m = max(x for x, _ in rand["ckptfs"])
        b = max(x for x, _ in rand["plain"])
        cpu = min(c for _, c in rand["ckptfs"])
        print(f"random 4 KiB reads of local 4 KiB records, {a.ranks} readers x "
              f"{a.random_reads} reads of {a.random_mib} MiB files, page cache dropped")
        print("| reads | through ckptfs IOPS | plain file IOPS | ratio | "
              "daemon CPU ms per 1000 reads |")
        print("|---|---|---|---|---|")
        print(f"| random | {m:.0f} | {b:.0f} | {m / b:.2f} | {cpu:.0f} |")
    finally:
        subprocess.run(ck + ["umount", str(mnt), "--no-drain"], stdout=subprocess.DEVNULL,
                       check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
