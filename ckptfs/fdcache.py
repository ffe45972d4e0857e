"""Open read descriptors kept between reads, shared by threads.

A cache of descriptors has a trap: closing one (to stay under the limit, or because its file
went away) while another thread has looked it up but not yet entered its `pread` lets the
next `open` anywhere in the process get the same number, and that `pread` then reads another
file. Here a thread borrows a descriptor for the length of its read; one evicted or dropped
while borrowed is closed by its last borrower, never under a read.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager


class _Entry:
    __slots__ = ("fd", "users", "retired")

    def __init__(self, fd: int):
        self.fd = fd
        self.users = 0
        self.retired = False


class FdCache:
    """At most `limit` descriptors by key; the least recently used one goes first."""

    def __init__(self, limit: int):
        self.limit = limit
        self._lock = threading.Lock()
        self._open: OrderedDict[Hashable, _Entry] = OrderedDict()

    @contextmanager
    def borrow(self, key: Hashable, opener: Callable[[], int | None]) -> Iterator[int | None]:
        """The descriptor of `key`, opened by `opener()` if it is not open yet (under this
        cache's lock, so a `drop` of the key cannot slip in between); None if the opener
        returned None. Valid until the with block ends."""
        with self._lock:
            ent = self._open.get(key)
            if ent is not None:
                self._open.move_to_end(key)
            else:
                fd = opener()
                if fd is not None:
                    ent = self._open[key] = _Entry(fd)
                    while len(self._open) > self.limit:
                        self._retire(self._open.popitem(last=False)[1])
            if ent is not None:
                ent.users += 1
        if ent is None:
            yield None
            return
        try:
            yield ent.fd
        finally:
            with self._lock:
                ent.users -= 1
                if ent.retired and not ent.users:
                    os.close(ent.fd)

    def drop(self, key: Hashable) -> None:
        """Close the descriptor of `key` (once its borrowers are done): its file is going."""
        with self._lock:
            ent = self._open.pop(key, None)
            if ent is not None:
                self._retire(ent)

    def close(self) -> None:
        with self._lock:
            for ent in self._open.values():
                self._retire(ent)
            self._open.clear()

    def __len__(self) -> int:
        return len(self._open)

    @staticmethod
    def _retire(ent: _Entry) -> None:
        if ent.users:
            ent.retired = True
        else:
            os.close(ent.fd)
