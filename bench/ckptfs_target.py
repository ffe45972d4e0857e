"""Driving ckptfs through its CLI only, the way an operator would, plus watching its daemon.

The contract the benchmark codes against (commands missing from the CLI yield "n/a", never a
made-up number):
    python -m ckptfs mount NVME SHARED MNT --foreground    (daemon; mounted = fuse.ckptfs at MNT)
    python -m ckptfs wait MNT/step_N                       (returns once durable on SHARED)
    python -m ckptfs status MNT --json
    python -m ckptfs evict MNT/step_N --all                (drop the local copies)
    python -m ckptfs umount MNT
    python -m ckptfs replay NVME --json                    (after unmount)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.mounts import unmount, wait_for_mount

REPO = Path(__file__).resolve().parent.parent
FSTYPE = "fuse.ckptfs"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    return env


def ckptfs_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ckptfs", *args]


def run_cli(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        ckptfs_cmd(*args),
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=_env(),
        stdin=subprocess.DEVNULL,
    )


def source_fingerprint() -> dict:
    """Which ckptfs was measured: the git commit plus a hash of the working tree's ckptfs/*.py
    (the filesystem changes under the benchmark while it is being developed)."""
    import hashlib

    h = hashlib.sha256()
    files = sorted((REPO / "ckptfs").glob("*.py"))
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                check=False,
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.TimeoutExpired):
        commit = None
    return {"git_head": commit, "ckptfs_py_sha256": h.hexdigest()[:16], "files": len(files)}


_cli_cache: dict[str, bool] = {}


def cli_has(command: str) -> bool:
    """Whether `python -m ckptfs COMMAND --help` works (asked once per command per run)."""
    if command not in _cli_cache:
        try:
            _cli_cache[command] = run_cli(command, "--help", timeout=30).returncode == 0
        except (subprocess.TimeoutExpired, OSError):
            _cli_cache[command] = False
    return _cli_cache[command]


def proc_usage(pid: int) -> dict | None:
    """Peak RSS (VmHWM), current RSS, its private (RssAnon) and file-backed (RssFile) parts
    and CPU seconds of one process, from /proc."""
    try:
        with open(f"/proc/{pid}/status") as f:
            st = {k: v.strip() for k, _, v in (line.partition(":") for line in f)}
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    kib = lambda k: int(st[k].split()[0]) * 1024 if k in st else None
    return {
        "rss_peak_bytes": kib("VmHWM"),
        "rss_bytes": kib("VmRSS"),
        "rss_anon_bytes": kib("RssAnon"),
        "rss_file_bytes": kib("RssFile"),
        "cpu_s": (int(fields[11]) + int(fields[12])) / CLK_TCK,  # utime + stime
        "threads": int(st.get("Threads", "0")),
    }


class CkptfsMount:
    """`python -m ckptfs mount ... --foreground` as a child; unmounted on exit no matter what."""

    def __init__(
        self,
        nvme: Path,
        shared: Path,
        mountpoint: Path,
        extra_args: list[str],
        log_path: Path,
        mount_timeout: float = 60.0,
        umount_timeout: float = 600.0,
    ):
        self.nvme, self.shared, self.mountpoint = Path(nvme), Path(shared), Path(mountpoint)
        self.extra_args = list(extra_args)
        self.log_path = Path(log_path)
        self.mount_timeout = mount_timeout
        self.umount_timeout = umount_timeout
        self.proc: subprocess.Popen | None = None
        self.usage: dict | None = None  # last sample, kept after the daemon exits
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()
        self.umount_s: float | None = None
        self.umount_clean: bool | None = None
        self.umount_note = ""

    def __enter__(self) -> CkptfsMount:
        for d in (self.nvme, self.mountpoint):
            d.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                ckptfs_cmd(
                    "mount",
                    str(self.nvme),
                    str(self.shared),
                    str(self.mountpoint),
                    "--foreground",
                    *self.extra_args,
                ),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=REPO,
                env=_env(),
                start_new_session=True,
            )
        finally:
            log.close()
        try:
            wait_for_mount(self.mountpoint, FSTYPE, self.proc, self.mount_timeout, self.log_path)
        except BaseException:
            self.close()
            raise
        self._sampler = threading.Thread(target=self._sample, daemon=True, name="rss-sampler")
        self._sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _sample(self) -> None:
        # VmHWM only grows, so the last sample before exit is the daemon's peak.
        while not self._stop.is_set() and self.proc is not None:
            u = proc_usage(self.proc.pid)
            if u is None:
                break
            self._keep(u)
            self._stop.wait(0.2)

    def _keep(self, u: dict) -> None:
        # an exiting process loses its memory lines from /proc/PID/status: keep the best seen
        old = self.usage or {}
        if u.get("rss_peak_bytes") is None:
            u = {
                **u,
                "rss_peak_bytes": old.get("rss_peak_bytes"),
                "rss_bytes": old.get("rss_bytes"),
            }
        elif old.get("rss_peak_bytes"):
            u["rss_peak_bytes"] = max(u["rss_peak_bytes"], old["rss_peak_bytes"])
        self.usage = u

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def status(self) -> tuple[dict | None, str]:
        if not cli_has("status"):
            return None, "ckptfs has no status command"
        try:
            r = run_cli("status", str(self.mountpoint), "--json", timeout=60)
        except subprocess.TimeoutExpired:
            return None, "status timed out"
        if r.returncode != 0:
            return None, f"status failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
        try:
            return json.loads(r.stdout), ""
        except ValueError:
            return None, "status printed no JSON"

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until the daemon's start-up work on SHARED (temp files of a crash removed, this
        node's directories made: `drain_ready` in its status) is done, so that a checkpoint's
        count of operations on SHARED holds the checkpoint's alone. A slow disk used to put
        those directories inside the first checkpoint's window."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st, _why = self.status()
            if st is None or st.get("drain_ready", True):
                return
            time.sleep(0.05)

    def wait_durable(self, path: Path, timeout: float) -> tuple[float | None, str]:
        """Seconds until `ckptfs wait PATH` returned (None + reason if it cannot be measured)."""
        if not cli_has("wait"):
            return None, "ckptfs has no wait command"
        t0 = time.monotonic()
        try:
            r = run_cli("wait", str(path), timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"wait did not return within {timeout:.0f}s"
        dt = time.monotonic() - t0
        if r.returncode != 0:
            return None, f"wait failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
        return dt, ""

    def evict(self, path: Path, timeout: float) -> tuple[bool, str]:
        if not cli_has("evict"):
            return False, "ckptfs has no evict command"
        try:
            r = run_cli("evict", str(path), "--all", timeout=timeout)
        except subprocess.TimeoutExpired:
            return False, f"evict did not return within {timeout:.0f}s"
        if r.returncode != 0:
            return False, f"evict failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
        return True, ""

    def close(self) -> None:
        """`ckptfs umount` (drains first); on failure fusermount3 -uz and kill the daemon."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            u = proc_usage(self.proc.pid)
            if u is not None:
                self._keep(u)
        cmd = ckptfs_cmd("umount", str(self.mountpoint)) if cli_has("umount") else None
        t0 = time.monotonic()
        try:
            self.umount_clean = unmount(
                self.mountpoint, self.proc, timeout=self.umount_timeout, command=cmd
            )
        finally:
            self.umount_s = time.monotonic() - t0
            self._stop.set()
            if self._sampler is not None:
                self._sampler.join(timeout=2)
            if self.proc.returncode not in (0, None):
                self.umount_note = f"daemon exited with {self.proc.returncode}"
            self.proc = None


def replay(nvme: Path, timeout: float) -> dict:
    """Time `ckptfs replay NVME --json`; log bytes from its report, else from the segment files."""
    if not cli_has("replay"):
        return {"note": "ckptfs has no replay command"}
    t0 = time.monotonic()
    try:
        r = run_cli("replay", str(nvme), "--json", timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"note": f"replay did not finish within {timeout:.0f}s"}
    wall = time.monotonic() - t0
    out: dict = {"wall_s": round(wall, 3), "exit_code": r.returncode}
    try:
        rep = json.loads(r.stdout)
    except ValueError:
        rep = None
        out["note"] = "replay printed no JSON: " + (r.stderr.strip().splitlines() or ["?"])[-1]
    seg_bytes = (
        sum(p.stat().st_size for p in (nvme / "segments").glob("*") if p.is_file())
        if (nvme / "segments").is_dir()
        else None
    )
    out["segment_file_bytes"] = seg_bytes
    if isinstance(rep, dict):
        out["report"] = rep
        scanned = rep.get("bytes_scanned")
        inner = rep.get("seconds")
        log_bytes = scanned if isinstance(scanned, (int, float)) and scanned else seg_bytes
        out["log_bytes"] = log_bytes
        if log_bytes and wall:
            out["bytes_per_s_wall"] = log_bytes / wall  # includes Python start-up and imports
        if log_bytes and isinstance(inner, (int, float)) and inner > 0:
            out["bytes_per_s"] = log_bytes / inner
        if rep.get("corruption"):
            out["note"] = f"replay reported corruption: {rep['corruption'][:3]}"
    return out


def find_dir(root: Path, name: str, max_depth: int = 3) -> Path | None:
    """`name` directly under root, or the first directory called `name` a few levels down."""
    if (root / name).is_dir():
        return root / name
    frontier = [root]
    for _ in range(max_depth):
        nxt = []
        for d in frontier:
            try:
                for e in os.scandir(d):
                    if e.is_dir(follow_symlinks=False):
                        if e.name == name:
                            return Path(e.path)
                        nxt.append(Path(e.path))
            except OSError:
                pass
        frontier = nxt[:200]
    return None
