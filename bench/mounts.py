"""Mounts and child processes the benchmark starts, and the one way it tears them down.

Everything here is bounded: mount waits poll /proc/mounts with a deadline, unmounts try
`fusermount3 -u`, then `-uz` plus killing the daemon, and never wait forever.
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import time
from pathlib import Path


def _unescape(field: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as octal (\040 etc.)
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and len(field[i + 1 : i + 4]) == 3 and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_type(mountpoint: str | os.PathLike) -> str | None:
    """The filesystem type mounted exactly at `mountpoint` (topmost), or None."""
    target = os.path.realpath(mountpoint)
    found = None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and _unescape(parts[1]) == target:
                    found = parts[2]
    except OSError:
        return None
    return found


def fuse_mounts_under(prefix: str | os.PathLike) -> list[str]:
    """FUSE mountpoints at or below `prefix`, deepest first (the order to unmount them in)."""
    prefix = os.path.realpath(prefix)
    hits = []
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[2].startswith("fuse"):
                mp = _unescape(parts[1])
                if mp == prefix or mp.startswith(prefix + "/"):
                    hits.append(mp)
    return sorted(set(hits), key=len, reverse=True)


def wait_for_mount(
    mountpoint: str | os.PathLike,
    fstype: str,
    proc: subprocess.Popen | None,
    timeout: float,
    log_path: Path | None = None,
) -> None:
    """Poll until `fstype` is mounted at `mountpoint`; raise if the daemon dies or time runs out."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while time.monotonic() < deadline:
        if mount_type(mountpoint) == fstype:
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"{fstype} daemon exited with {proc.returncode} before mounting {mountpoint}"
                + _log_tail(log_path)
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
    raise TimeoutError(
        f"{fstype} not mounted at {mountpoint} after {timeout:.0f}s" + _log_tail(log_path)
    )


def _log_tail(log_path: Path | None, n: int = 20) -> str:
    if log_path is None:
        return ""
    try:
        lines = Path(log_path).read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return ""
    return "\n  log tail:\n    " + "\n    ".join(lines) if lines else ""


def kill_process(proc: subprocess.Popen | None, grace: float = 5.0) -> None:
    """SIGTERM, wait `grace` seconds, then SIGKILL; only this process (by pid)."""
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGCONT)  # a stopped process only acts on SIGTERM once continued
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    except ProcessLookupError:
        pass


def unmount(
    mountpoint: str | os.PathLike,
    proc: subprocess.Popen | None = None,
    timeout: float = 30.0,
    command: list[str] | None = None,
) -> bool:
    """Unmount cleanly if possible; otherwise lazily unmount and kill the daemon.

    `command` replaces `fusermount3 -u MNT` as the clean way (e.g. `ckptfs umount MNT`).
    Returns True when the clean path worked.
    """
    mountpoint = str(mountpoint)
    clean = False
    if mount_type(mountpoint) is not None:
        cmd = command or ["fusermount3", "-u", mountpoint]
        try:
            r = subprocess.run(cmd, check=False, capture_output=True, timeout=timeout)
            clean = r.returncode == 0
        except subprocess.TimeoutExpired:
            clean = False
    else:
        clean = True
    if proc is not None and proc.poll() is None:
        try:
            proc.wait(timeout=timeout if clean else 2.0)
        except subprocess.TimeoutExpired:
            clean = False
    if mount_type(mountpoint) is not None or (proc is not None and proc.poll() is None):
        clean = False
        subprocess.run(
            ["fusermount3", "-uz", mountpoint], check=False, capture_output=True, timeout=10
        )
        kill_process(proc)
    return clean


def drop_caches() -> bool:
    """Write back dirty pages and drop the page cache; False if not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _disk_counters(dev: str) -> tuple[int, ...] | None:
    """(sectors read, written, discarded) of the block device `dev`."""
    try:
        with open("/proc/diskstats") as f:
            for line in f:
                v = line.split()
                if v[2] == dev:
                    return (int(v[5]), int(v[9]), int(v[16]) if len(v) > 16 else 0)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _disk_of(path: str | os.PathLike) -> str | None:
    """The whole block device under `path` (vda for /dev/vda1), or None (tmpfs, unknown)."""
    try:
        dev = os.stat(path).st_dev
        real = os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    except OSError:
        return None
    name = os.path.basename(real)
    if os.path.exists(os.path.join(real, "partition")):
        name = os.path.basename(os.path.dirname(real))
    return name if os.path.exists(f"/sys/block/{name}") else None


NOISE_SECTORS = 512  # per 0.1 s: 2.5 MB/s of other work does not keep settle_disk waiting


def settle_disk(path: str | os.PathLike, quiet: float = 1.0, limit: float = 30.0) -> dict:
    """Wait until the disk under `path` has done no I/O for `quiet` seconds (at most `limit`).

    Work a target leaves behind goes on after it returns: the writeback of what it wrote, and
    on a filesystem mounted with `discard` (this VM's root) the discards of every file it
    deleted, issued at the journal's commits. The next target must not pay for them. (In the
    runs of 2026-12-08 the disk was idle by then each time: a guard; bench/README.md.)"""
    t0 = time.monotonic()
    dev = _disk_of(path)
    last = _disk_counters(dev) if dev else None
    if last is None:
        return {"device": dev, "seconds": 0.0, "idle": None}
    since = t0
    while True:
        time.sleep(0.1)
        now = time.monotonic()
        cur = _disk_counters(dev)
        if cur is None:
            return {"device": dev, "seconds": round(now - t0, 3), "idle": None}
        if sum(cur) - sum(last) > NOISE_SECTORS:  # a journal commit or a log line: quiet
            since = now
        last = cur
        if now - since >= quiet:
            return {"device": dev, "seconds": round(now - t0, 3), "idle": True}
        if now - t0 >= limit:
            return {"device": dev, "seconds": round(now - t0, 3), "idle": False}


def _mem_free() -> int:
    """MemFree from /proc/meminfo in bytes (0 if unreadable: then nothing is warmed)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemFree:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


MADV_POPULATE_WRITE = 23  # Linux 5.14; Python 3.11's mmap module does not name it


def warm_memory(nbytes: int) -> dict:
    """Fault in `nbytes` of fresh memory and give it back, so that the page cache a restore
    fills next takes pages the hypervisor backs already.

    On this VM the guest reports free memory to the host (virtio-balloon free page
    reporting): the first write to a page the host took back runs at ~0.38 GiB/s, to a page
    freed recently at ~2.2 GiB/s (bench/README.md, "the hypervisor's free pages"). A restore
    straight after a save finds only such cold free pages, while one after a page-cache drop
    reuses the pages just dropped; without this step the hot restore through a FUSE mount
    measured the hypervisor, not the mount. Done for every target alike."""
    t0 = time.monotonic()
    # never into swap or the OOM killer: at most 80% of the free memory (a scaled-up run)
    nbytes = min(nbytes, int(_mem_free() * 0.8))
    if nbytes <= 0:
        return {"bytes": 0, "seconds": 0.0}
    m = mmap.mmap(-1, nbytes)
    try:
        try:
            m.madvise(MADV_POPULATE_WRITE)
        except OSError:  # an older kernel: touch every page instead
            for off in range(0, nbytes, mmap.PAGESIZE):
                m[off] = 1
    finally:
        m.close()
    return {"bytes": nbytes, "seconds": round(time.monotonic() - t0, 3)}
