"""The Python API for training code: no shelling out.

    import ckptfs
    ckptfs.wait("/ckpt/step_1000", timeout=600)   # published on the shared store
    ckptfs.status("/ckpt")["bytes_pending_upload"]
"""

from __future__ import annotations

import os
from typing import Callable

from ckptfs import control


class CkptfsError(Exception):
    pass


def wait(path: str | os.PathLike, timeout: float | None = None,
         on_progress: Callable[[dict], None] | None = None) -> int:
    """Block until everything under `path` written before the call is published on the shared
    store. Returns the published log sequence number; raises TimeoutError or CkptfsError."""
    try:
        sock, rel = control.find_socket(os.fspath(path))
        reply = control.request(sock, {"op": "wait", "path": rel, "timeout": timeout},
                                on_progress=on_progress,
                                timeout=None if timeout is None else timeout + 30)
    except control.ControlError as e:
        if str(e).startswith("timed out"):
            raise TimeoutError(str(e)) from None
        raise CkptfsError(str(e)) from None
    return int(reply["published_seq"])


def status(path: str | os.PathLike, refresh: bool = False) -> dict:
    """The daemon's status (the same fields as `ckptfs status --json`)."""
    try:
        sock, _ = control.find_socket(os.fspath(path))
        return control.request(sock, {"op": "status", "refresh": refresh}, timeout=60)["status"]
    except control.ControlError as e:
        raise CkptfsError(str(e)) from None
