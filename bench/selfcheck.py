"""Self-check of the NAS emulator: `python -m bench.selfcheck` (a few seconds, exit 0 = pass).

Mounts nasemu over a temp dir, exercises every operation a checkpoint writer and ckptfs's drain use,
checks the counters, that 200 creates at 1 ms latency take >= 0.2 s, that the metadata rate cap
holds,that the unmount leaves nothing behind, and that the failure path (-uz + kill) works.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench.mounts import mount_type, unmount
from bench.nasemu import FSTYPE, NasEmu, stats_delta

FAILS: list[str] = []


def check(cond: bool, what: str) -> None:
    print(("ok    " if cond else "FAIL  ") + what, flush=True)
    if not cond:
        FAILS.append(what)


def exercise(mnt: Path, backing: Path, nas: NasEmu) -> None:
    before = nas.stats()
    (mnt / "step_1").mkdir()
    p = mnt / "step_1" / "__0_0.distcp.tmp"
    data = os.urandom(3 * 1024 * 1024 + 17)
    fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    os.write(fd, data)
    os.fsync(fd)
    os.close(fd)
    os.rename(p, mnt / "step_1" / "__0_0.distcp")
    dfd = os.open(mnt / "step_1", os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(dfd)
    os.close(dfd)
    check((mnt / "step_1" / "__0_0.distcp").read_bytes() == data, "write, fsync, rename, read back")
    check(
        (backing / "step_1" / "__0_0.distcp").read_bytes() == data, "bytes land in the backing dir"
    )
    # O_DIRECT is the client's business (an NFS server never sees it): the emulator must not
    # pass it on to the backing filesystem, which would refuse its unaligned buffers
    fd = os.open(mnt / "step_1" / "__0_0.distcp", os.O_RDONLY | os.O_DIRECT)
    try:
        got = os.pread(fd, 5000, 4096)
    finally:
        os.close(fd)
    check(got == data[4096:9096], "an O_DIRECT read")
    os.truncate(mnt / "step_1" / "__0_0.distcp", 1000)
    check(os.stat(mnt / "step_1" / "__0_0.distcp").st_size == 1000, "truncate")
    os.chmod(mnt / "step_1" / "__0_0.distcp", 0o600)
    os.utime(mnt / "step_1" / "__0_0.distcp", (1_000_000, 2_000_000))
    st = os.stat(mnt / "step_1" / "__0_0.distcp")
    check(st.st_mode & 0o777 == 0o600 and int(st.st_mtime) == 2_000_000, "chmod, utimens")
    os.symlink("step_1", mnt / "latest")
    check(os.readlink(mnt / "latest") == "step_1", "symlink, readlink")
    check(sorted(os.listdir(mnt)) == ["latest", "step_1"], "readdir (stats file hidden)")
    sv = os.statvfs(mnt)
    check(sv.f_blocks > 0, "statfs")
    # unlink while open still reads (hard_remove + nullpath_ok)
    with open(mnt / "step_1" / "__0_0.distcp", "rb") as f:
        os.unlink(mnt / "step_1" / "__0_0.distcp")
        check(len(f.read()) == 1000, "read an unlinked open file")
    os.unlink(mnt / "latest")
    os.rmdir(mnt / "step_1")
    check(os.listdir(mnt) == [], "unlink, rmdir")
    d = stats_delta(before, nas.stats())
    ops = d["ops"]
    check(
        ops.get("create") == 1 and ops.get("rename") == 1 and ops.get("mkdir") == 1
        and ops.get("fsync") == 1 and ops.get("fsyncdir") == 1 and ops.get("symlink") == 1
        and ops.get("unlink") == 2 and ops.get("rmdir") == 1,
        f"per-op counters ({ops})",
    )  # fmt: skip
    check(d["bytes_written"] == len(data), "bytes_written counter")


def timed_creates(mnt: Path, n: int) -> float:
    (mnt / "c").mkdir()
    t0 = time.monotonic()
    for i in range(n):
        os.close(os.open(mnt / "c" / f"f{i}", os.O_CREAT | os.O_WRONLY, 0o644))
    return time.monotonic() - t0


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="nasemu-selfcheck-"))
    try:
        backing, mnt = root / "backing", root / "mnt"
        with NasEmu(backing, mnt, meta_latency_us=1000, meta_ops_per_sec=0) as nas:
            check(mount_type(mnt) == FSTYPE, f"mounted as {FSTYPE}")
            exercise(mnt, backing, nas)
            dt = timed_creates(mnt, 200)
            check(dt >= 0.2, f"200 creates at 1 ms latency took {dt:.3f} s (>= 0.2 s)")
        check(mount_type(mnt) is None, "unmounted on exit")
        shutil.rmtree(backing)

        with NasEmu(backing, mnt, meta_latency_us=0, meta_ops_per_sec=500, meta_burst=1) as nas:
            dt = timed_creates(mnt, 200)  # mkdir + 200 creates at 500/s
            check(0.35 <= dt <= 1.5, f"200 creates at 500 ops/s cap took {dt:.3f} s (~0.4 s)")
        shutil.rmtree(backing)

        with NasEmu(backing, mnt, meta_latency_us=0, meta_ops_per_sec=0, bandwidth_mbps=100) as nas:
            t0 = time.monotonic()
            (mnt / "big").write_bytes(b"\0" * (80 * 1024 * 1024))
            dt = time.monotonic() - t0
            # 16 MiB pass at once (the burst), the other 64 MiB at 100 MB/s
            check(0.55 <= dt <= 2.5, f"80 MiB at a 100 MB/s cap took {dt:.3f} s (~0.67 s)")

        with NasEmu(backing, mnt, meta_latency_us=0, meta_ops_per_sec=0) as nas:
            import threading

            nas.pause_writes()
            time.sleep(0.05)  # the signal is asynchronous
            t = threading.Thread(target=(mnt / "held").write_bytes, args=(b"x" * 4096,))
            t.start()
            t.join(0.3)
            held = t.is_alive()
            nas.resume_writes()
            t.join(5)
            check(
                held and not t.is_alive() and (mnt / "held").stat().st_size == 4096,
                "SIGUSR1 holds writes, SIGUSR2 releases them",
            )
        shutil.rmtree(backing)

        # the failure path: a daemon that is stopped cannot answer fusermount3 -u cleanly
        nas = NasEmu(backing, mnt, meta_latency_us=0).__enter__()
        assert nas.proc is not None
        os.kill(nas.proc.pid, signal.SIGSTOP)
        proc = nas.proc
        nas.proc = None
        t0 = time.monotonic()
        clean = unmount(mnt, proc, timeout=2.0)
        check(
            mount_type(mnt) is None and proc.poll() is not None,
            f"stuck daemon: lazy unmount + kill in {time.monotonic() - t0:.1f}s (clean={clean})",
        )
        nas.close()
    finally:
        for m in (root / "mnt",):
            if mount_type(m) is not None:
                unmount(m)
        shutil.rmtree(root, ignore_errors=True)
    print("selfcheck: " + ("PASS" if not FAILS else f"FAIL ({len(FAILS)}): " + "; ".join(FAILS)))
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
