"""`ckptfs mount` and `ckptfs umount`: the mountpoint checked, the daemon started in the
background (or run in the foreground) and stopped after its drain; logging and the progress
bar the waiting commands share."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from ckptfs import knobs, layout
from ckptfs.errors import CliError
from ckptfs.shared import SharedError, answers, check_node_id, describe_stall

log = logging.getLogger("ckptfs")

MAX_SEGMENT = 64 << 30


def setup_logging(level: str, log_file: str | None) -> None:
    handler: logging.Handler
    handler = logging.FileHandler(log_file) if log_file else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()))
    logging.getLogger("pyfuse3").setLevel(logging.WARNING)


# --- mount / umount -----------------------------------------------------------------------

def _is_stale(path: str) -> bool:
    try:
        os.stat(path)
        return False
    except OSError as e:
        return e.errno == errno.ENOTCONN


def _fusermount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["fusermount3", *args], capture_output=True, text=True)


def probe_mount(mnt: str, timeout: float = 5.0) -> str:
    """"absent", "ok" (something answers), "dead" (ENOTCONN: the daemon is gone) or "hung"
    (no answer within timeout). Asks the daemon itself with a getxattr: the kernel may answer
    a stat from its cache for seconds after a daemon died, and a stat of a hung daemon's
    mount never returns, so the probe runs in a thread we can stop waiting for."""
    if layout.mount_type(mnt) is None:
        return "absent"
    result: list[str] = []

    def ask() -> None:
        try:
            os.getxattr(mnt, "user.ckptfs.pid")
            result.append("ok")
        except OSError as e:
            dead = (errno.ENOTCONN, errno.ECONNABORTED)
            result.append("dead" if e.errno in dead else "ok")

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    t.join(timeout)
    return result[0] if result else "hung"


def _daemon_pids(mnt: str) -> list[int]:
    """ckptfs daemons serving mnt, from /proc (for a daemon that no longer answers)."""
    want = layout.mount_path(mnt)
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "ckptfs" in " ".join(args[:4]) and "mount" in args and "--foreground" in args \
                and any(a and layout.mount_path(a) == want for a in args[-3:]):
            out.append(int(name))
    return out


def check_mountpoint(mnt: str) -> None:
    """Clean a stale mount left by a crash; refuse a live one."""
    state = probe_mount(mnt)
    if state == "hung":
        raise CliError(f"{mnt} is a mount whose daemon does not answer; "
                       f"`ckptfs umount {mnt}` detaches it")
    if state == "ok":
        raise CliError(f"{mnt} is already a mount point ({layout.mount_type(mnt)})")
    if state == "dead":
        log.warning("%s is a dead mount (ENOTCONN); cleaning it up", mnt)
        _fusermount("-uz", mnt)
        if _is_stale(mnt):
            raise CliError(f"{mnt} is a dead mount and could not be cleaned up "
                           f"(try: fusermount3 -uz {mnt})")
    if not os.path.isdir(mnt):
        raise CliError(f"MOUNTPOINT {mnt} is not a directory" if os.path.exists(mnt) else
                       f"MOUNTPOINT directory {mnt} does not exist")
    if os.path.ismount(mnt):
        raise CliError(f"{mnt} is already a mount point")


def _recorded_node(nvme: str) -> str | None:
    try:
        with open(os.path.join(nvme, layout.IDENTITY_FILE), "rb") as f:
            return str(json.loads(f.read())["node"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _daemon_publishing_as(node: str, shared: str, nvme: str) -> dict | None:
    """The status of another daemon on this machine that publishes to `shared` as `node`:
    two NVME directories under one node id would number and name objects alike."""
    from ckptfs import control

    own = layout.control_socket_path(nvme)  # this NVME's own daemon: its lock says the rest
    base = os.path.dirname(own)
    try:
        socks = [os.path.join(base, n) for n in os.listdir(base)
                 if n.endswith(".sock") and os.path.join(base, n) != own]
    except OSError:
        return None
    mine = os.path.realpath(nvme)
    for sock in socks:
        try:
            st = control.request(sock, {"op": "status"}, timeout=2)["status"]
        except (control.ControlError, OSError, ValueError, KeyError):
            continue  # a dead daemon's socket, or a hung one: not ours to judge
        other_shared = st.get("shared") or ""
        if not other_shared.startswith("s3://"):
            other_shared = os.path.realpath(other_shared)
        want = shared if shared.startswith("s3://") else os.path.realpath(shared)
        if st.get("node_id") == node and other_shared == want \
                and os.path.realpath(st.get("nvme") or "") != mine:
            return st
    return None


def _within(path: str, top: str) -> bool:
    """path is top or below it, symlinks resolved."""
    path, top = os.path.realpath(path), os.path.realpath(top)
    return path == top or path.startswith(top.rstrip(os.sep) + os.sep)


def _same_store(x: str, y: str) -> bool:
    """Two SHARED or cold-tier locations name the same store (symlinks resolved)."""
    if x.startswith("s3://") or y.startswith("s3://"):
        return x.rstrip("/") == y.rstrip("/")
    return os.path.realpath(x) == os.path.realpath(y)


def cmd_mount(a: argparse.Namespace) -> int:
    from ckptfs.cache import CacheConfig
    from ckptfs.daemon import MountConfig, run_foreground
    from ckptfs.retention import DEFAULT_MARKERS, DEFAULT_RETAIN, RetentionConfig

    for what, d in (("NVME", a.nvme), ("SHARED", a.shared), ("MOUNTPOINT", a.mountpoint),
                    ("--cold", a.cold or "")):
        try:  # recorded in ckptfs.json, the lock file, status and the options of the mount
            d.encode()
        except UnicodeEncodeError:
            raise CliError(f"{what} {d.encode(errors='surrogateescape')!r}: not a valid UTF-8 "
                           f"path, which ckptfs needs to record it; use another name") from None
    nvme, mnt = os.path.abspath(a.nvme), layout.mount_path(a.mountpoint)
    shared = a.shared if a.shared.startswith("s3://") else os.path.abspath(a.shared)
    if not os.path.isdir(nvme):
        raise CliError(f"NVME {nvme} is not a directory" if os.path.exists(nvme) else
                       f"NVME directory {nvme} does not exist")
    if not os.access(nvme, os.W_OK):
        why = ("a read-only filesystem" if os.statvfs(nvme).f_flag & os.ST_RDONLY
               else "permission denied")
        raise CliError(f"NVME directory {nvme} is not writable ({why})")
    if not shared.startswith("s3://"):
        try:  # a hung NAS answers nothing: say so instead of hanging with it
            answers(shared)
        except SharedError as e:
            raise CliError(f"SHARED {e}") from None
    check_mountpoint(mnt)
    a.mountpoint = mnt  # what the daemon mounts on, and what /proc/mounts will show
    if not 0 < a.low_watermark <= a.high_watermark <= 1:
        raise CliError("watermarks must satisfy 0 < --low-watermark <= --high-watermark <= 1")
    if a.upload_streams is None:
        # parallel copies fill a NAS better (measured: 4 streams drained ~20% faster than 2
        # into the emulated NAS, bench/README.md); on S3 each stream holds 64 MiB parts
        a.upload_streams = 2 if shared.startswith("s3://") else 4
    if a.upload_streams < 1:
        raise CliError("--upload-streams must be at least 1")
    if a.publish_batch < 1:
        raise CliError("--publish-batch must be at least 1")
    if a.segment_size < (1 << 20):
        raise CliError("--segment-size must be at least 1M")
    if a.segment_size > MAX_SEGMENT:
        raise CliError("--segment-size must be at most 64G: a segment is the unit of upload "
                       "and eviction, and nothing of it drains before it is sealed")
    if a.cache_size and a.segment_size > a.cache_size // 2:
        raise CliError(f"--segment-size ({a.segment_size:,} bytes) must be at most half of "
                       f"--cache-size ({a.cache_size:,} bytes): the segment being written "
                       f"cannot be evicted, nor one waiting for its upload")
    if a.node_id is not None:  # before anything is written into NVME under that name
        try:
            check_node_id(a.node_id)
        except SharedError as e:
            raise CliError(str(e)) from None
    if not 0 <= a.metrics_port <= 65535:
        raise CliError(f"--metrics-port must be a TCP port (0-65535), not {a.metrics_port}")
    node = a.node_id or _recorded_node(nvme) or socket.gethostname()
    other = _daemon_publishing_as(node, shared, nvme)
    if other is not None:
        raise CliError(f"node id {node!r} is in use on {shared} by the daemon of "
                       f"{other.get('nvme')} (pid {other.get('pid')}, mounted at "
                       f"{other.get('mountpoint')}): give this mount its own --node-id")
    cfg = MountConfig(nvme=nvme, shared=shared, mountpoint=mnt, segment_size=a.segment_size,
                      seal_idle=a.seal_idle, allow_other=a.allow_other,
                      default_permissions=a.default_permissions, fsname=a.fsname,
                      upload_streams=a.upload_streams, upload_limit=a.upload_limit,
                      publish_batch=a.publish_batch,
                      metrics_port=a.metrics_port, refresh_interval=a.refresh_interval,
                      cache=CacheConfig(a.high_watermark, a.low_watermark, a.cache_size,
                                        a.enospc_timeout),
                      retention=RetentionConfig(
                          tuple(a.retain) if a.retain else DEFAULT_RETAIN,
                          tuple(a.marker) if a.marker else DEFAULT_MARKERS,
                          a.keep_local, a.keep_shared, bool(a.cold), a.keep_cold,
                          nodes=a.nodes),
                      cold=(a.cold if not a.cold or a.cold.startswith("s3://")
                            else os.path.abspath(a.cold)) if a.cold else "",
                      gc_grace=a.gc_grace, nodes_required=a.nodes, dedup=not a.no_dedup,
                      drain_policy=a.drain_policy, read_only=a.read_only)
    if a.keep_local < 0 or a.keep_shared < 0 or a.keep_cold < 0:
        raise CliError("--keep-local, --keep-shared and --keep-cold must not be negative")
    if a.read_only and (a.keep_local or a.keep_shared or a.cold):
        raise CliError("--read-only deletes and moves nothing: --keep-local, --keep-shared "
                       "and --cold do not apply")
    if a.cold and not a.keep_shared:
        raise CliError("--cold needs --keep-shared M: checkpoints older than the newest M move "
                       "to the cold tier")
    if a.cold and not a.cold.startswith("s3://"):
        try:  # a cold tier on a hung NAS: one line, not a hang
            answers(a.cold)
        except SharedError as e:
            raise CliError(f"cold tier {e}") from None
    # after the probes: resolving a path on a hung NAS would hang
    stores = (("NVME", nvme), ("SHARED", shared), ("--cold", a.cold or ""))
    for what, d in stores:
        if d and not d.startswith("s3://") and _within(d, mnt):
            # the daemon would reach its own files through its own mount, and wait for itself
            raise CliError(f"{what} {d} is inside MOUNTPOINT {mnt}: the mount would hide it "
                           f"from the daemon; put it outside the mount point")
    if _within(mnt, nvme):  # NVME is ckptfs's own: its segments, index, lock, log
        raise CliError(f"MOUNTPOINT {mnt} is inside NVME {nvme}, ckptfs's own directory: the "
                       f"mount could hide the daemon's files from it; put it outside")
    for what, d in stores[1:]:
        if d and not d.startswith("s3://") and \
                _within(mnt, os.path.join(d, layout.SHARED_ROOT)):
            raise CliError(f"MOUNTPOINT {mnt} is inside {what}'s store "
                           f"{os.path.join(d, layout.SHARED_ROOT)}: the mount would hide it "
                           f"from the daemon; put it elsewhere")
    if a.cold and _same_store(a.cold, shared):
        # a move to the cold tier deletes the shared copy: here, the only one
        raise CliError(f"--cold {a.cold} is SHARED itself: the cold tier must be another "
                       f"store (moving a checkpoint there deletes its copy on SHARED)")
    if a.node_id:
        cfg.node_id = a.node_id
    try:
        hidden = len(os.listdir(mnt))
    except OSError:
        hidden = 0

    def warn_hidden() -> None:  # mounted over them, as mount(8) does; back at the unmount
        if hidden:
            print(f"ckptfs: warning: {mnt} is not empty: its {hidden} entries are hidden while "
                  f"ckptfs is mounted there (they are not in ckptfs, nor published)",
                  file=sys.stderr)

    if a.foreground:
        if a.ready_fd is None:  # not the daemon `mount` starts (that one says it)
            warn_hidden()
        setup_logging(a.log_level, a.log_file)
        ready_fd = a.ready_fd if a.ready_fd is not None else -1
        try:
            return run_foreground(cfg, ready_fd)
        except CliError as e:
            if ready_fd >= 0:
                os.write(ready_fd, f"error {e}\n".encode())
            raise
    res = _daemonize(a, mnt, nvme)
    warn_hidden()
    return res


def _daemonize(a: argparse.Namespace, mnt: str, nvme: str) -> int:
    r, w = os.pipe()
    argv = [sys.executable, "-m", "ckptfs", "mount", "--foreground", "--ready-fd", str(w)]
    argv += _forwarded_args(a)
    log_file = os.path.abspath(a.log_file) if a.log_file else os.path.join(nvme, "ckptfs.log")
    argv += ["--log-file", log_file]
    argv += [nvme, _abs_store(a.shared), a.mountpoint]
    with open(os.devnull, "rb") as devnull:  # in /, so as not to pin the caller's filesystem
        proc = subprocess.Popen(argv, stdin=devnull, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, pass_fds=(w,), start_new_session=True,
                                close_fds=True, cwd="/")
    os.close(w)
    with os.fdopen(r, "rb") as rf:
        msg = rf.read().decode(errors="replace").strip()
    if msg != "ok":
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
        if msg.startswith("error "):
            # why FUSE refused, in fusermount3's or libfuse's own words (on the daemon's stderr)
            why = [ln.strip() for ln in err.splitlines() if ln.startswith(("fusermount", "fuse:"))]
            raise CliError(msg[6:] + (f" ({why[-1]})" if why else ""))
        last = err.splitlines()[-1] if err else f"daemon exited with {proc.returncode}"
        last = last.removeprefix("ckptfs: error: ")
        raise CliError(f"mount failed: {last} (log: {log_file})")
    if proc.stderr:
        proc.stderr.close()
    deadline = time.monotonic() + 30
    while True:
        try:
            os.stat(mnt)
            if layout.mount_type(mnt) == layout.FSTYPE:
                break
        except OSError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            if proc.poll() is None:  # never leave a daemon (and its mount) behind an error
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            raise CliError(f"the daemon started but {mnt} did not become usable (log: {log_file})")
        time.sleep(0.02)
    print(f"mounted {mnt} (daemon pid {proc.pid}, log {log_file})")
    return 0


def _forwarded_args(a: argparse.Namespace) -> list[str]:
    out = ["--segment-size", str(a.segment_size), "--seal-idle", str(a.seal_idle),
           "--high-watermark", str(a.high_watermark), "--low-watermark", str(a.low_watermark),
           "--cache-size", str(a.cache_size), "--enospc-timeout", str(a.enospc_timeout),
           "--refresh-interval", str(a.refresh_interval),
           "--keep-local", str(a.keep_local), "--keep-shared", str(a.keep_shared),
           "--gc-grace", str(a.gc_grace), "--nodes", str(a.nodes),
           "--keep-cold", str(a.keep_cold), "--drain-policy", a.drain_policy,
           "--log-level", a.log_level, "--upload-streams", str(a.upload_streams),
           "--publish-batch", str(a.publish_batch),
           "--upload-limit", str(a.upload_limit), "--metrics-port", str(a.metrics_port)]
    if a.node_id:
        out += ["--node-id", a.node_id]
    for g in a.retain or []:
        out += ["--retain", g]
    for g in a.marker or []:
        out += ["--marker", g]
    if a.allow_other:
        out.append("--allow-other")
    if a.default_permissions:
        out.append("--default-permissions")
    if a.fsname != "ckptfs":
        out += ["--fsname", a.fsname]
    if a.no_dedup:
        out.append("--no-dedup")
    if a.read_only:
        out.append("--read-only")
    if a.cold:
        out += ["--cold", _abs_store(a.cold)]
    return out


def _abs_store(where: str) -> str:
    """A directory made absolute (the daemon runs in /); an s3:// URL as it is."""
    return where if where.startswith("s3://") else os.path.abspath(where)


def _daemon_pid(mnt: str) -> int | None:
    try:
        return int(os.getxattr(mnt, "user.ckptfs.pid"))
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


# seconds a live daemon has to answer `umount`'s probe before it is called hung
PROBE_TIMEOUT = 5.0


def cmd_umount(a: argparse.Namespace) -> int:
    mnt = layout.mount_path(a.mountpoint)
    if layout.mount_type(mnt) != layout.FSTYPE:
        raise CliError(f"{mnt} is not a ckptfs mount")
    state = probe_mount(mnt, timeout=PROBE_TIMEOUT)  # not --timeout: 0 would call it hung
    if state == "dead":
        _fusermount("-uz", mnt)
        print(f"{mnt} was a dead mount; cleaned up")
        return 0
    if state == "hung":
        pids = _daemon_pids(mnt)
        _fusermount("-uz", mnt)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        print(f"the daemon of {mnt} did not answer: detached the mount"
              + (f" and killed pid {', '.join(map(str, pids))}" if pids else "")
              + " (nothing acknowledged is lost: the next mount replays the log)")
        return 0
    pid = _daemon_pid(mnt)
    if not a.no_drain:
        _drain_before_umount(mnt, a.timeout)
    res = _fusermount("-u", mnt)
    if res.returncode != 0:
        msg = (res.stderr.strip().splitlines() or ["fusermount3 failed"])[-1]
        raise CliError(f"cannot unmount {mnt}: {msg}")
    if pid is not None:  # its exit waits EXIT_GRACE at most for a store that went silent
        deadline = time.monotonic() + max(a.timeout, 60.0)
        while _pid_alive(pid):
            if time.monotonic() > deadline:
                raise CliError(f"unmounted {mnt} but daemon pid {pid} is still running")
            time.sleep(0.02)
    print(f"unmounted {mnt}")
    return 0


def _drain_before_umount(mnt: str, timeout: float) -> None:
    from ckptfs import control

    try:
        sock, _ = control.find_socket(mnt)
        with progress("draining before unmount") as update:
            control.request(sock, {"op": "drain", "timeout": timeout}, on_progress=update,
                            timeout=timeout + 5)
    except control.ControlError as e:
        if "unknown control request" in str(e):
            return
        raise CliError(f"drain before unmount failed: {e} (use --no-drain to skip)") from None


class progress:
    """A rich progress bar on a terminal, nothing otherwise; on a terminal or not, one line
    when the drain has been failing for a while (`wait` on a full or unreachable store would
    otherwise block without a word), or when the shared store has not answered for a while
    (a hung NAS fails nothing: its calls just block), and one when it works again."""

    notice_after = knobs.number("CKPTFS_WAIT_NOTICE_AFTER", 10.0, "seconds")

    def __init__(self, label: str):
        self.label = label
        self.bar: Any = None
        self.failing_since: float | None = None
        self.told: str | None = None  # the error last reported
        self.told_stall = False  # a silent store was reported, and has not answered since

    def _say(self, line: str) -> None:
        if self.bar is not None:
            self.bar.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=sys.stderr, flush=True)

    def _notice(self, error: str | None, error_for: float = 0.0) -> None:
        """`error_for`: how long the daemon's drain has been failing (a daemon from before
        it was reported: counted from this client's first sight of the error)."""
        now = time.monotonic()
        if not error:
            if self.told is not None:
                self._say(f"ckptfs: {self.label}: the drain works again")
            self.failing_since = self.told = None
            return
        if self.failing_since is None or error_for:
            self.failing_since = min(self.failing_since or now, now - error_for)
        if now - self.failing_since >= self.notice_after and error != self.told:
            self._say(f"ckptfs: {self.label}: still waiting, the drain has been failing for "
                      f"{now - self.failing_since:.0f} s and retries: {error}")
            self.told = error

    def _stall(self, seconds: float, what: str) -> None:
        if seconds >= self.notice_after and not self.told_stall:
            self._say(f"ckptfs: {self.label}: still waiting, "
                      f"{describe_stall(seconds, what)}")
            self.told_stall = True
        elif seconds < 1 and self.told_stall:
            self._say(f"ckptfs: {self.label}: the shared store answers again")
            self.told_stall = False

    def __enter__(self) -> Callable[[dict], None]:
        if sys.stderr.isatty():
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self.bar = Progress("[bold]{task.description}", BarColumn(), DownloadColumn(),
                                TransferSpeedColumn(), TimeRemainingColumn(), transient=True)
            self.bar.start()
            self.task = self.bar.add_task(self.label, total=None)

        def update(info: dict) -> None:
            if "error" in info:
                self._notice(info["error"], float(info.get("error_for") or 0.0))
            if "stall_for" in info:
                self._stall(float(info["stall_for"] or 0.0), str(info.get("stall_on") or ""))
            if self.bar is not None:
                self.bar.update(self.task, total=info.get("total") or None,
                                completed=info.get("done", 0))

        return update

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.stop()
