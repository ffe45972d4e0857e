"""The control channel: a unix socket (/run/ckptfs/<hash of NVME>.sock, or under the temp
dir when /run is not writable) speaking one JSON object per line.

The CLI finds it through the mount itself: `getxattr(MOUNTPOINT, "user.ckptfs.control")`
returns the socket path, so `ckptfs status /ckpt/step_5` works from any path in the mount.
Requests: {"op": "status"}, {"op": "wait", "path": "rel/path", "timeout": s},
{"op": "sync"}, {"op": "drain", "timeout": s}. Replies: {"ok": true, ...} or
{"ok": false, "error": "one line"}. Progress messages ({"progress": {...}}) may precede the
final reply of long requests.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
from typing import Any, Callable, Iterator

import trio

log = logging.getLogger(__name__)

MAX_LINE = 1 << 20


async def serve(daemon: Any, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    path = daemon.control_path
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(64)
    listener = trio.SocketListener(sock)
    task_status.started()
    await trio.serve_listeners(lambda s: _handle(daemon, s), [listener])


async def _handle(daemon: Any, stream: trio.SocketStream) -> None:
    buf = b""
    async with stream:
        try:
            while b"\n" not in buf:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    return
                buf += chunk
                if len(buf) > MAX_LINE:
                    return
            req = json.loads(buf.split(b"\n", 1)[0])

            async def progress(info: dict) -> None:
                await stream.send_all((json.dumps({"progress": info}) + "\n").encode())

            try:
                reply = await daemon.handle_request(req, progress)
                reply = {"ok": True, **reply}
            except Exception as e:  # a bad request must not take the daemon down
                if not isinstance(e, (ValueError, KeyError, OSError, TimeoutError)):
                    log.exception("control request %r failed", req)
                reply = {"ok": False, "error": str(e) or type(e).__name__}
            await stream.send_all((json.dumps(reply) + "\n").encode())
        except (trio.BrokenResourceError, trio.ClosedResourceError, ValueError):
            return


# --- client side (used by the CLI and the Python API; plain blocking sockets) -------------

class ControlError(Exception):
    pass


def find_socket(path: str) -> tuple[str, str]:
    """(socket path, path relative to the mount root) for any path inside a ckptfs mount."""
    p = os.path.realpath(path)
    probe = p
    dead = denied = None  # the topmost path of a mount whose daemon is gone; the first denied
    while True:
        try:
            sock = os.getxattr(probe, "user.ckptfs.control")
            break
        except OSError as e:
            if e.errno == errno.ENOTCONN:
                dead = probe
            elif e.errno == errno.EACCES and denied is None:
                denied = probe
        parent = os.path.dirname(probe)
        if parent == probe:
            if dead is not None:
                raise ControlError(f"{dead} is a dead ckptfs mount (its daemon is gone): mount "
                                   f"it again with `ckptfs mount` (nothing that returned is "
                                   f"lost; docs/troubleshooting.md)")
            if denied is not None:
                raise ControlError(f"{path}: permission denied at {denied}; ask as the user "
                                   f"who mounted it (or root)")
            raise ControlError(f"{path} is not inside a ckptfs mount")
        probe = parent
    # walk up to the mount root: the xattr is served only there, so probe is the root
    rel = os.path.relpath(p, probe)
    return sock.decode(), ("" if rel == "." else rel)


def request(sock_path: str, req: dict, on_progress: Callable[[dict], None] | None = None,
            timeout: float | None = None) -> dict:
    for msg in stream_request(sock_path, req, timeout):
        if "progress" in msg:
            if on_progress is not None:
                on_progress(msg["progress"])
            continue
        if not msg.get("ok"):
            raise ControlError(msg.get("error", "request failed"))
        return msg
    raise ControlError("the daemon closed the control connection")


def stream_request(sock_path: str, req: dict, timeout: float | None = None) -> Iterator[dict]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(sock_path)
    except OSError as e:
        raise ControlError(f"cannot reach the ckptfs daemon at {sock_path}: {e.strerror}") from None
    with s:
        s.sendall((json.dumps(req) + "\n").encode())
        f = s.makefile("rb")
        for line in f:
            yield json.loads(line)
