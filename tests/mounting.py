"""Real mounts for tests: start `ckptfs mount --foreground` in a subprocess, wait for it with a
bounded poll, and always take it down again.

Teardown order matters (the STYLE.md "Tests" section): a clean `fusermount3 -u` first; when that
fails (busy, dead daemon, stale ENOTCONN mount) `fusermount3 -uz` plus SIGKILL of the daemon we
started. The failure path is exercised by tests/test_mounting.py, because a cleanup path that
never runs is a cleanup path that does not work.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

FSTYPE = "fuse.ckptfs"
FUSERMOUNT = "fusermount3"

# How long a daemon gets to come up or go away. Generous: CI has 2 cores and runs other tests.
START_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0

# Every daemon process this test run started and has not yet seen exit; the session finalizer
# in conftest.py kills what is left (by pid, only ours).
LIVE_DAEMONS: dict[int, subprocess.Popen[bytes]] = {}

T = TypeVar("T")


def ckptfs_cmd(*args: str | os.PathLike[str]) -> list[str]:
    """The CLI as a subprocess command line, through the interpreter running the tests."""
    return [sys.executable, "-m", "ckptfs", *(os.fspath(a) for a in args)]


def wait_for(cond: Callable[[], T], timeout: float, what: str, interval: float = 0.005) -> T:
    """Poll `cond` until it returns something truthy; fail with `what` after `timeout` seconds.

    The interval backs off from 5 ms to 100 ms so short waits stay short and long ones stay cheap.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)
        interval = min(interval * 2, 0.1)


def _unescape_mount_field(field: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as \ooo octal.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def proc_mounts() -> list[tuple[str, str, str, str]]:
    """(source, mountpoint, fstype, options) for every line of /proc/mounts."""
    rows = []
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 4:
                rows.append(
                    (
                        _unescape_mount_field(parts[0]),
                        _unescape_mount_field(parts[1]),
                        parts[2],
                        parts[3],
                    )
                )
    return rows


def mount_entry(mnt: str | os.PathLike[str]) -> tuple[str, str, str, str] | None:
    """The last (topmost) /proc/mounts row for exactly this mountpoint, or None."""
    target = os.path.realpath(mnt)
    found = None
    for row in proc_mounts():
        if row[1] == target:
            found = row
    return found


def is_mounted(mnt: str | os.PathLike[str], fstype: str | None = FSTYPE) -> bool:
    row = mount_entry(mnt)
    return row is not None and (fstype is None or row[2] == fstype)


def fuse_mounts_under(root: str | os.PathLike[str]) -> list[str]:
    """Mountpoints of any FUSE filesystem at or below `root`."""
    base = os.path.realpath(root)
    return [
        row[1]
        for row in proc_mounts()
        if row[2].startswith("fuse") and (row[1] == base or row[1].startswith(base + os.sep))
    ]


def fusermount(mnt: str | os.PathLike[str], *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [FUSERMOUNT, *flags, os.fspath(mnt)],
        capture_output=True,
        text=True,
        timeout=STOP_TIMEOUT,
        check=False,
    )


def lazy_unmount_all_under(root: str | os.PathLike[str]) -> list[str]:
    """`fusermount3 -uz` every FUSE mount below `root`, deepest first. Returns what it unmounted."""
    done = []
    # Deepest first so a mount inside a mount is released before its parent.
    for mnt in sorted(set(fuse_mounts_under(root)), key=len, reverse=True):
        fusermount(mnt, "-uz")
        done.append(mnt)
    return done


def stat_errno(path: str | os.PathLike[str]) -> int:
    """0 if `stat(path)` works, else its errno."""
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno or -1
    return 0


def listdir_errno(path: str | os.PathLike[str]) -> int:
    """0 if `listdir(path)` works, else its errno. Unlike stat, which the kernel may answer
    from cached attributes, opendir always reaches the daemon: a dead mount says ENOTCONN."""
    try:
        os.listdir(path)
    except OSError as exc:
        return exc.errno or -1
    return 0


def pids_with_arg(needle: str) -> list[int]:
    """Processes whose command line contains `needle` (a test's unique tmp path), except us."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(needle.encode() in a for a in argv):
            pids.append(int(entry))
    return pids


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # A zombie has exited already; state is the field after the parenthesised comm.
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Mount:
    """One ckptfs daemon run in the foreground, with its NVME, SHARED and MNT directories.

    `root` is a directory private to the test; the three directories live inside it. Daemon
    output goes to `root/daemon-<n>.log`, which failure messages quote.
    """

    def __init__(
        self,
        root: Path,
        extra_args: Sequence[str] = (),
        *,
        segment_size: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.root = Path(root)
        self.nvme = self.root / "nvme"
        self.shared = self.root / "shared"
        self.mnt = self.root / "mnt"
        for d in (self.nvme, self.shared, self.mnt):
            d.mkdir(parents=True, exist_ok=True)
        self.extra_args = list(extra_args)
        if segment_size is not None:
            self.extra_args += ["--segment-size", segment_size]
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.killed = False  # the current/last daemon was SIGKILLed on purpose
        self.log_path: Path | None = None

    # -- starting ---------------------------------------------------------------------------

    def command(self) -> list[str]:
        return ckptfs_cmd("mount", self.nvme, self.shared, self.mnt, "--foreground",
                          *self.extra_args)

    def start(self, timeout: float = START_TIMEOUT) -> None:
        assert self.proc is None or self.proc.poll() is not None, "daemon already running"
        assert not is_mounted(self.mnt, None), f"{self.mnt} is still mounted"
        self.starts += 1
        self.killed = False
        self.log_path = self.root / f"daemon-{self.starts}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        LIVE_DAEMONS[self.proc.pid] = self.proc
        try:
            wait_for(self._up, timeout, f"ckptfs to mount at {self.mnt}")
        except BaseException:
            self.teardown()
            raise

    def _up(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"ckptfs daemon exited with {self.proc.returncode} before mounting:\n"
                + self.log_tail()
            )
        # /proc/mounts first: stat() on a not-yet-mounted dir would succeed on the host fs.
        return is_mounted(self.mnt) and stat_errno(self.mnt) == 0

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no daemon log)"
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:]) or "(daemon log empty)"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- stopping ---------------------------------------------------------------------------

    def _reap(self, timeout: float) -> int | None:
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        LIVE_DAEMONS.pop(self.proc.pid, None)
        return rc

    def unmount(self, timeout: float = STOP_TIMEOUT) -> None:
        """Clean unmount: `fusermount3 -u`, then the daemon must exit 0 on its own."""
        assert self.proc is not None, "never started"
        assert self.alive, f"daemon already exited with {self.proc.returncode}:\n{self.log_tail()}"
        res = fusermount(self.mnt, "-u")
        if res.returncode != 0:
            raise AssertionError(f"fusermount3 -u {self.mnt} failed: {res.stderr.strip()}")
        rc = self._reap(timeout)
        if rc is None:
            raise AssertionError(
                f"daemon did not exit within {timeout}s after unmount:\n{self.log_tail()}"
            )
        if rc != 0:
            raise AssertionError(f"daemon exited {rc} after a clean unmount:\n{self.log_tail()}")
        assert not is_mounted(self.mnt, None), f"{self.mnt} still mounted after unmount"

    def kill(self) -> None:
        """SIGKILL the daemon and reap it. The mount stays behind, dead (ENOTCONN)."""
        assert self.proc is not None and self.alive, "daemon not running"
        self.killed = True
        self.proc.send_signal(signal.SIGKILL)
        rc = self._reap(STOP_TIMEOUT)
        assert rc is not None, "SIGKILLed daemon did not exit"

    def clean_stale(self) -> None:
        """Release a dead mount left by a killed daemon."""
        assert not self.alive, "daemon still running"
        if is_mounted(self.mnt, None):
            res = fusermount(self.mnt, "-uz")
            assert res.returncode == 0, f"fusermount3 -uz failed: {res.stderr.strip()}"
        wait_for(lambda: not is_mounted(self.mnt, None), STOP_TIMEOUT, "stale mount to go")

    def remount(self) -> None:
        """Unmount (cleanly if the daemon lives, else drop the stale mount) and start again."""
        if self.alive:
            self.unmount()
        else:
            self.clean_stale()
        self.start()

    def teardown(self) -> list[str]:
        """Take everything down, whatever state it is in. Returns the problems it met.

        Never raises for a cleanup step (a failure of the test must not be masked by a
        failure of its cleanup); the caller decides what the problems mean.
        """
        problems: list[str] = []
        if self.proc is not None and self.alive:
            res = fusermount(self.mnt, "-u")
            if res.returncode != 0:
                problems.append(f"fusermount3 -u failed: {res.stderr.strip()}")
            else:
                rc = self._reap(STOP_TIMEOUT)
                if rc is None:
                    problems.append("daemon did not exit after fusermount3 -u")
                elif rc != 0:
                    problems.append(f"daemon exited {rc} after a clean unmount")
        if self.proc is not None and self.alive:
            # The failure path: detach the mount and kill the daemon we started.
            fusermount(self.mnt, "-uz")
            self.proc.send_signal(signal.SIGKILL)
            if self._reap(STOP_TIMEOUT) is None:
                problems.append(f"daemon pid {self.proc.pid} survived SIGKILL")
        elif self.proc is not None:
            LIVE_DAEMONS.pop(self.proc.pid, None)
        if is_mounted(self.mnt, None):
            # A dead daemon (killed, crashed) leaves an ENOTCONN mount behind.
            if not self.killed:
                problems.append(f"stale mount left at {self.mnt} by a daemon that died")
            fusermount(self.mnt, "-uz")
        for leftover in lazy_unmount_all_under(self.root):
            problems.append(f"leftover fuse mount at {leftover}")
        return problems


MakeMount = Callable[..., Mount]

CONSOLE_SCRIPT = Path(sys.executable).with_name("ckptfs")


@dataclass
class Result:
    rc: int
    out: str
    err: str

    def __str__(self) -> str:
        return f"exit {self.rc}\n--- stdout ---\n{self.out}--- stderr ---\n{self.err}"


def run_cli(*args: str | os.PathLike[str], console: bool = False, timeout: float = 60
            ) -> Result:
    """Run the CLI to completion. Output goes to files, not pipes, so a daemon that keeps our
    stdout/stderr open cannot hang this call (test_daemonized_mount_... checks that apart)."""
    cmd = ([str(CONSOLE_SCRIPT), *(os.fspath(a) for a in args)] if console
           else ckptfs_cmd(*args))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        rc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                            timeout=timeout, check=False).returncode
        out.seek(0)
        err.seek(0)
        return Result(rc, out.read().decode(errors="replace"), err.read().decode(errors="replace"))


def check_errno(exc: OSError, *allowed: int) -> None:
    assert exc.errno in allowed, (
        f"expected errno in {[errno.errorcode[e] for e in allowed]}, "
        f"got {errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc}"
    )


def iter_files(root: Path) -> Iterator[Path]:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            yield Path(dirpath) / name
