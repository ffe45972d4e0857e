"""The daemon's place in the CPU scheduler.

Every rank that saves a checkpoint waits on the daemon for each request (lookup, create,
write, fsync, release), and a storm has more runnable ranks than there are CPUs. At the
scheduler's default the request thread is preempted by the ranks it serves about twice per
file and then waits a rank's whole slice with the next request in its queue (bench/README.md,
2026-12-07, afternoon). So the daemon raises its own priority before it starts its threads,
which inherit it: a few nice levels above the one it started with. It can also ask for a
slice of its own (`CKPTFS_SLICE_US`; Linux 6.12+ reads `sched_attr.sched_runtime` of a normal
task as the slice it asks for): a short one gets a woken request thread a CPU sooner, but
preempts it more often while it is busy, which helped one storm and slowed another, so the
default keeps the kernel's.

Background work (the drain's copies, the cold tier's, GC's snapshot and compaction reads) is
not something the application waits for: it runs at the daemon's starting priority, inside
`background()`.

Raising needs CAP_SYS_NICE (root has it). Without it the daemon runs as it was started, and
says so once in its log.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import platform
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ckptfs import knobs

log = logging.getLogger("ckptfs.sched")

PRIORITY = knobs.number("CKPTFS_PRIORITY", 10, "nice levels")
SLICE_US = knobs.number("CKPTFS_SLICE_US", 0, "microseconds")

# sched_setattr(2) has no wrapper in glibc or Python; numbers by architecture
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274, "ppc64le": 355, "s390x": 345}
_SCHED_OTHER = 0
_ATTR = struct.Struct("IIQiIQQQII")  # struct sched_attr, SCHED_ATTR_SIZE_VER1 (56 bytes)

F = TypeVar("F", bound=Callable[..., Any])

_base_nice: int | None = None  # the nice the daemon started with, once it raised its own


def _sched_setattr(nice: int, slice_ns: int) -> bool:
    """Set this thread's nice and slice in one call; False where the kernel or the
    architecture cannot (the caller then sets the nice alone)."""
    nr = _SCHED_SETATTR.get(platform.machine())
    if nr is None:
        return False
    attr = ctypes.create_string_buffer(
        _ATTR.pack(_ATTR.size, _SCHED_OTHER, 0, nice, 0, slice_ns, 0, 0, 0, 0))
    try:
        return _libc().syscall(nr, 0, attr, 0) == 0
    except (OSError, AttributeError):
        return False


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _set(nice: int, slice_us: int) -> None:
    """This thread (Linux's setpriority and sched_setattr act on one thread) to `nice`, with
    `slice_us` as its slice (0: the kernel's default)."""
    if not _sched_setattr(nice, slice_us * 1000):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def raise_priority() -> bool:
    """Raise the calling thread (and so every thread it starts later) above the priority it
    started with. Call before starting threads. False if turned off or not permitted."""
    global _base_nice
    if not PRIORITY or _base_nice is not None:
        return False
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    want = max(base - int(PRIORITY), -20)
    try:
        _set(want, int(SLICE_US))
    except OSError as e:
        log.info("running at the priority it was started with (nice %d): raising it needs "
                 "CAP_SYS_NICE (%s); CKPTFS_PRIORITY=0 stops trying", base, e.strerror)
        return False
    _base_nice = base
    log.debug("request threads at nice %d (started at %d), slice %d us", want, base,
              int(SLICE_US))
    return True


@contextlib.contextmanager
def background() -> Iterator[None]:
    """Run the body at the priority the daemon started with (and the kernel's default slice),
    then return to the raised one. Nothing to do where the daemon did not raise its own."""
    base = _base_nice
    if base is None:
        yield
        return
    tid = threading.get_native_id()
    was = os.getpriority(os.PRIO_PROCESS, tid)
    if was >= base:  # this thread is not raised (a nested call, a thread started lowered)
        yield
        return
    try:
        _set(base, 0)
    except OSError as e:  # lowering needs no privilege; anything else: run as it is
        log.debug("could not lower thread %d to nice %d: %s", tid, base, e)
        yield
        return
    try:
        yield
    finally:
        try:
            _set(was, int(SLICE_US))
        except OSError as e:
            log.debug("could not raise thread %d back to nice %d: %s", tid, was, e)


def status() -> dict[str, Any]:
    """The calling thread's place (the request thread's, from the trio thread)."""
    tid = threading.get_native_id()
    nice = os.getpriority(os.PRIO_PROCESS, tid)
    slice_us = None
    try:
        with open(f"/proc/self/task/{tid}/sched") as f:
            for line in f:
                if line.startswith("se.slice"):
                    slice_us = int(float(line.split(":")[1])) // 1000
    except (OSError, ValueError, IndexError):
        pass
    return {"raised": _base_nice is not None, "nice": nice,
            "started_nice": nice if _base_nice is None else _base_nice, "slice_us": slice_us}


def in_background(fn: F) -> F:
    """`fn` run inside `background()` (for functions handed to worker threads)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with background():
            return fn(*args, **kwargs)
    return wrapper  # type: ignore[return-value]
