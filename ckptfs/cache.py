"""Local space: NVMe is a cache of what is published, never the place data is lost.

Usage is the larger of the NVMe filesystem's used fraction and ckptfs's own segment bytes
over `--cache-size` (if set). Above the high watermark, published segments are evicted
(their local file deleted; reads go to the shared object) least recently used first, and
segments holding the newest checkpoint last, until usage is below the low watermark.

When usage is at the hard limit (the filesystem nearly full, or cache-size reached) and
nothing is evictable, writers wait (backpressure) while the drain publishes, which makes
segments evictable. Only if that takes longer than `--enospc-timeout` does a write fail
with ENOSPC; records already written are untouched either way.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable

import trio

from ckptfs import segment as fmt
from ckptfs.errors import FsError
from ckptfs.index import Index, SegState
from ckptfs.reads import Reader

log = logging.getLogger(__name__)

HEADROOM = 64 << 20  # keep this much (at most 1/16 of it) free on NVMe for log and index
CHECK_EVERY = 32 << 20  # bytes written between two measurements on the write path


@dataclass
class CacheConfig:
    high: float = 0.85
    low: float = 0.70
    cache_size: int = 0  # bytes of segments kept locally; 0 = bounded by the filesystem only
    enospc_timeout: float = 60.0


class LocalCache:
    def __init__(self, nvme: str, index: Index, reader: Reader, seg_path: Callable[[int], str],
                 active_bytes: Callable[[], int], cfg: CacheConfig,
                 protected: Callable[[], set[int]] | None = None):
        self.nvme = nvme
        self.index = index
        self.reader = reader
        self.seg_path = seg_path
        self.active_bytes = active_bytes
        self.cfg = cfg
        self.protected = protected or (lambda: set())
        self.last_access: dict[int, float] = {}
        self.evictions = 0
        self.evicted_bytes = 0
        self.waiting_writers = 0
        self.enospc_errors = 0
        self.state = "ok"
        self._space = trio.Event()
        self._since_check = 0
        total = shutil.disk_usage(nvme).total
        # measure often enough that the headroom cannot be overrun between two measurements
        self._check_every = max(1 << 20, min(CHECK_EVERY, total // 64))
        self.local_bytes = self._count_local()

    def _count_local(self) -> int:
        return sum(i.size for _s, i in self.index.iter_segments()
                   if i.state not in (SegState.EVICTED, SegState.ACTIVE, SegState.COLD))

    # --- measuring ------------------------------------------------------------------------

    def usage(self) -> tuple[float, bool]:
        """(usage fraction against the watermarks, at the hard limit?)."""
        du = shutil.disk_usage(self.nvme)
        fs_frac = (du.total - du.free) / du.total if du.total else 0.0
        # the headroom must outlast what is written between two measurements, and one more
        # write (a small disk's 1/16 would not: writes would get a real ENOSPC, not the wait)
        hard = du.free < max(min(HEADROOM, du.total // 16), self._check_every + (2 << 20))
        frac = fs_frac
        if self.cfg.cache_size:
            mine = self.local_bytes + self.active_bytes()
            frac = max(frac, mine / self.cfg.cache_size)
            hard = hard or mine >= self.cfg.cache_size
        return frac, hard

    def touch(self, seg: int) -> None:
        self.last_access[seg] = time.monotonic()

    def sealed(self, size: int) -> None:
        self.local_bytes += size

    def removed(self, size: int) -> None:
        """GC deleted a segment this cache counted as local (published or dropped)."""
        self.local_bytes -= size

    # --- evicting -------------------------------------------------------------------------

    def candidates(self) -> list[tuple[int, int]]:
        prot = self.protected()
        out = []
        for seg, i in self.index.iter_segments():
            if i.state == SegState.PUBLISHED:
                # LRU: last read, else when sealed; protected (newest checkpoint) last
                key = self.last_access.get(seg,
                                           i.sealed_ns / 1e9 - time.time() + time.monotonic())
                out.append((1 if seg in prot else 0, key, seg, i.size))
        out.sort()
        return [(seg, size) for _p, _k, seg, size in out]

    def evict(self, seg: int, size: int) -> None:
        """Drop the local copy of a published segment (the index keeps pointing at it)."""
        self.index.set_segment(seg, SegState.EVICTED)
        self.reader.forget(seg)
        try:
            os.unlink(self.seg_path(seg))
        except FileNotFoundError:
            pass
        self.local_bytes -= size
        self.evictions += 1
        self.evicted_bytes += size
        log.info("evicted segment %s (%d bytes) from local disk", fmt.segment_name(seg), size)

    def evict_to(self, target: float) -> int:
        n = 0
        for seg, size in self.candidates():
            frac, hard = self.usage()
            if frac <= target and not hard:
                break
            self.evict(seg, size)
            n += 1
        return n

    def evict_all(self) -> int:
        n = 0
        for seg, size in self.candidates():
            self.evict(seg, size)
            n += 1
        return n

    async def run(self, kick: Callable[[], Any]) -> None:
        while True:
            await trio.sleep(0.5)
            self.check(kick)

    def check(self, kick: Callable[[], Any] | None = None) -> None:
        frac, hard = self.usage()
        if frac >= self.cfg.high or hard:
            self.evict_to(self.cfg.low)
            frac, hard = self.usage()
            if hard:
                if self.state != "full":
                    log.warning("local disk full (%.0f%% used) and nothing is published yet "
                                "to evict: writers wait for the drain", frac * 100)
                self.state = "full"
                if kick is not None:
                    kick()
                return
        if self.state == "full":
            log.info("local space available again")
        self.state = "ok"
        ev, self._space = self._space, trio.Event()
        ev.set()

    # --- backpressure -----------------------------------------------------------------------

    def admit(self, nbytes: int) -> bool:
        """Fast check on the write path: may nbytes be appended now? Re-measures (and evicts)
        when the cache-size cap would be crossed or every CHECK_EVERY bytes."""
        self._since_check += nbytes
        over_cap = bool(self.cfg.cache_size) and (
            self.local_bytes + self.active_bytes() + nbytes > self.cfg.cache_size)
        if over_cap or self._since_check >= self._check_every:
            self._since_check = 0
            self.check()
        return self.state != "full"

    async def reserve(self, nbytes: int) -> None:
        """Called before appending nbytes: wait while the local tier is full."""
        if self.state != "full":
            return
        self.waiting_writers += 1
        try:
            with trio.move_on_after(self.cfg.enospc_timeout):
                while self.state == "full":
                    self.check()
                    if self.state != "full":
                        return
                    with trio.move_on_after(0.5):
                        await self._space.wait()
                return
            self.enospc_errors += 1
            log.error("write failed with ENOSPC: local disk full for %.0fs and the shared store "
                      "did not take data in that time", self.cfg.enospc_timeout)
            raise FsError(errno.ENOSPC)
        finally:
            self.waiting_writers -= 1

    def status(self) -> dict[str, Any]:
        frac, hard = self.usage()
        return {"state": self.state, "usage": round(frac, 4), "hard_limit": hard,
                "high_watermark": self.cfg.high, "low_watermark": self.cfg.low,
                "cache_size": self.cfg.cache_size, "counted_bytes": self.local_bytes,
                "evictions": self.evictions,
                "evicted_bytes": self.evicted_bytes, "waiting_writers": self.waiting_writers,
                "enospc_errors": self.enospc_errors}
