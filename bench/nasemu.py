"""The NAS emulator (native/nasemu/nasemu.c) from Python: build on first use, mount, count, unmount.

    with NasEmu(backing, mnt, meta_latency_us=1000, meta_ops_per_sec=3000) as nas:
        ...                      # use `mnt` like a NAS mount
        nas.stats()              # the emulator's counters (dict), diff two with stats_delta()

The binary is compiled into native/nasemu/build/ under a name carrying a hash of the source, so an
edited nasemu.c is rebuilt and nothing needs installing. Defaults and their source: bench/README.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from bench.mounts import unmount, wait_for_mount

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "native" / "nasemu" / "nasemu.c"
BUILD_DIR = REPO / "native" / "nasemu" / "build"
FSTYPE = "fuse.nasemu"
STATS_FILE = ".nasemu-stats"

# A mid-range NAS as the seed article describes it: thousands of creates/s on the metadata server,
# ~1 ms per metadata round trip, 2 GB/s of bandwidth (bench/README.md).
DEFAULT_META_LATENCY_US = 1000
DEFAULT_META_OPS_PER_SEC = 3000
DEFAULT_BANDWIDTH_MBPS = 2000

# Operations that change the namespace; fsync and setattr are metadata too but change no names.
NAMESPACE_OPS = ("create", "mknod", "mkdir", "symlink", "link", "rename", "unlink", "rmdir")
SETATTR_OPS = ("chmod", "chown", "truncate", "utimens")


def build(force: bool = False) -> Path:
    """Compile nasemu.c if this version of it has not been built yet; return the binary's path."""
    src = SOURCE.read_bytes()
    cflags = subprocess.run(
        ["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True, text=True, check=True
    ).stdout.split()
    digest = hashlib.sha256(src + " ".join(cflags).encode()).hexdigest()[:12]
    binary = BUILD_DIR / f"nasemu-{digest}"
    if binary.exists() and not force:
        return binary
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=BUILD_DIR, prefix=".nasemu-")
    os.close(fd)
    cc = os.environ.get("CC", "cc")
    cmd = [cc, "-O2", "-Wall", "-o", tmp, str(SOURCE), *cflags]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building nasemu failed: {' '.join(cmd)}\n{r.stderr}")
    os.chmod(tmp, 0o755)
    os.replace(tmp, binary)  # atomic: a concurrent build never sees a half-written binary
    return binary


class NasEmu:
    """Mount the emulator over `backing_dir` at `mountpoint` for the duration of a with-block."""

    def __init__(
        self,
        backing_dir: str | os.PathLike,
        mountpoint: str | os.PathLike,
        meta_latency_us: int = DEFAULT_META_LATENCY_US,
        meta_ops_per_sec: int = DEFAULT_META_OPS_PER_SEC,
        bandwidth_mbps: int = DEFAULT_BANDWIDTH_MBPS,
        meta_burst: int = 32,
        threads: int = 64,
        direct_io: str = "writes",
        log_path: str | os.PathLike | None = None,
        mount_timeout: float = 15.0,
        read_ahead_kb: int = 1024,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.backing_dir = Path(backing_dir)
        self.mountpoint = Path(mountpoint)
        self.config = {
            "meta_latency_us": int(meta_latency_us),
            "meta_ops_per_sec": int(meta_ops_per_sec),
            "bandwidth_mbps": int(bandwidth_mbps),
            "meta_burst": int(meta_burst),
            "threads": int(threads),
            "direct_io": direct_io,
        }
        if direct_io not in ("none", "writes", "all"):
            raise ValueError(f"direct_io must be none, writes or all, not {direct_io!r}")
        self.read_ahead_kb = read_ahead_kb
        self.extra_args = tuple(extra_args)
        self.log_path = Path(log_path) if log_path else None
        self.mount_timeout = mount_timeout
        self.proc: subprocess.Popen | None = None
        self._log = None

    def command(self, binary: Path) -> list[str]:
        c = self.config
        cmd = [
            str(binary), str(self.backing_dir), str(self.mountpoint), "-f",
            "--meta-latency-us", str(c["meta_latency_us"]),
            "--meta-ops-per-sec", str(c["meta_ops_per_sec"]),
            "--meta-burst", str(c["meta_burst"]),
            "--bandwidth-mbps", str(c["bandwidth_mbps"]),
            "--threads", str(c["threads"]),
        ]  # fmt: skip
        if c["direct_io"] == "all":
            cmd.append("--direct-io")
        elif c["direct_io"] == "writes":
            cmd.append("--direct-io-writes")
        return cmd + list(self.extra_args)

    def __enter__(self) -> NasEmu:
        binary = build()
        self.backing_dir.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self._log = out if self.log_path else None
        self.proc = subprocess.Popen(
            self.command(binary), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
            start_new_session=True,  # a Ctrl-C in the terminal must not kill it before we unmount
        )  # fmt: skip
        try:
            wait_for_mount(self.mountpoint, FSTYPE, self.proc, self.mount_timeout, self.log_path)
        except BaseException:
            self.close()
            raise
        if self.read_ahead_kb:
            set_read_ahead(self.mountpoint, self.read_ahead_kb)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> bool:
        """Unmount (fusermount3 -u; on failure -uz and kill). Safe to call twice."""
        clean = True
        if self.proc is not None:
            clean = unmount(self.mountpoint, self.proc)
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        return clean

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def pause_writes(self) -> None:
        """Hold every data write on the emulated NAS until resume_writes() (SIGUSR1)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGUSR1)

    def resume_writes(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGUSR2)

    def fail_fsyncs(self, fail: bool = True) -> None:
        """Every fsync and fsyncdir fails with EIO (SIGRTMIN) until fail_fsyncs(False)
        (SIGRTMIN+1): a disk whose writeback failed."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGRTMIN if fail else signal.SIGRTMIN + 1)

    def stats(self) -> dict:
        """A snapshot of the emulator's counters (read through the hidden control file)."""
        with open(self.mountpoint / STATS_FILE, "rb") as f:
            return json.loads(f.read())


def set_read_ahead(mountpoint: Path, kb: int) -> bool:
    """1 MiB read requests instead of FUSE's 128 KiB, as an NFS client with rsize=1M would get
    (PERF-NOTES: ~2x cold reads); ckptfs raises its own mount's the same way."""
    st = os.stat(mountpoint)
    path = f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(kb))
        return True
    except OSError:
        return False


def stats_delta(before: dict, after: dict) -> dict:
    """Counters that changed between two snapshots, with namespace/metadata totals."""
    ops = {k: after["ops"][k] - before["ops"].get(k, 0) for k in after["ops"]}
    d = {
        "ops": {k: v for k, v in ops.items() if v},
        "meta_ops": after["meta_ops"] - before["meta_ops"],
        "namespace_ops": sum(ops.get(k, 0) for k in NAMESPACE_OPS),
        "fsyncs": ops.get("fsync", 0) + ops.get("fsyncdir", 0),
        "setattrs": sum(ops.get(k, 0) for k in SETATTR_OPS),
        "bytes_written": after["bytes_written"] - before["bytes_written"],
        "bytes_read": after["bytes_read"] - before["bytes_read"],
        "meta_wait_s": round(after["meta_wait_s"] - before["meta_wait_s"], 6),
        "meta_latency_s": round(after["meta_latency_s"] - before["meta_latency_s"], 6),
        "bw_wait_s": round(after["bw_wait_s"] - before["bw_wait_s"], 6),
    }
    return d


def main() -> int:
    """`python -m bench.nasemu BACKING MNT [flags]`: mount in the foreground until Ctrl-C, SIGTERM
    or an unmount from outside."""
    import argparse
    import threading

    p = argparse.ArgumentParser(prog="python -m bench.nasemu", description=__doc__.splitlines()[0])
    p.add_argument("backing", nargs="?")
    p.add_argument("mountpoint", nargs="?")
    p.add_argument("--meta-latency-us", type=int, default=DEFAULT_META_LATENCY_US)
    p.add_argument("--meta-ops-per-sec", type=int, default=DEFAULT_META_OPS_PER_SEC)
    p.add_argument("--bandwidth-mbps", type=int, default=DEFAULT_BANDWIDTH_MBPS)
    p.add_argument("--build-only", action="store_true", help="compile and print the binary path")
    a = p.parse_args()
    if a.build_only:
        print(build())
        return 0
    if not (a.backing and a.mountpoint):
        p.error("BACKING and MOUNTPOINT are required (or --build-only)")
    if not shutil.which("fusermount3"):
        raise SystemExit("fusermount3 not found")
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with NasEmu(a.backing, a.mountpoint, a.meta_latency_us, a.meta_ops_per_sec,
                a.bandwidth_mbps) as emu:
        print(f"nasemu mounted at {a.mountpoint}; Ctrl-C to unmount", flush=True)
        # until Ctrl-C/SIGTERM, or until the emulator exits (unmounted from outside)
        while not stop.wait(0.5):
            if emu.proc is not None and emu.proc.poll() is not None:
                break
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
