"""The cold tier (`--cold URL`): checkpoints that retention would delete from the shared tier
move to large, slow storage instead, and stay readable through the mount and by `export`.

A segment moves when every live byte in it belongs to checkpoints in the cold band (older than
the newest `--keep-shared` complete ones, newer than `--keep-shared + --keep-cold`). A move is
copy, verify, record, then delete:

1. copy the object to the cold store (from the local file, or downloaded from the shared tier
   if it was evicted) and read the copy back, verifying every record's checksum;
2. append a TIER record to the log; applying it marks the segment COLD (in the live index now,
   in the published view when the record drains, and so in the next manifest, which names
   the cold store and the object's tier);
3. once that manifest is published, delete the shared-tier copy and the local file.

A crash before 2 leaves an extra copy on the cold store that nothing names yet: the next move
keeps it if it verifies whole, and replaces it otherwise (published objects are never
replaced, but this one is not published until its TIER record is). A crash between 2 and 3
leaves the shared copy, which the next mount deletes.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import trio

from ckptfs import sched
from ckptfs import segment as fmt
from ckptfs.index import SegState
from ckptfs.segment import RecType
from ckptfs.shared import SharedError

log = logging.getLogger(__name__)


@dataclass
class ColdStats:
    segments_moved: int = 0
    bytes_moved: int = 0
    last_error: str | None = None


class ColdTier:
    def __init__(self, daemon: Any, cold: Any, url: str):
        self.d = daemon
        self.cold = cold
        self.url = url
        self.pending: set[int] = set()
        self.stats = ColdStats()
        self._kick = trio.Event()

    def want(self, segs: set[int]) -> None:
        idx = self.d.index
        new = {s for s in segs if (i := idx.get_segment(s)) is not None
               and i.state in (SegState.PUBLISHED, SegState.EVICTED)} - self.pending
        if new:
            self.pending |= new
            self._kick.set()

    async def run(self) -> None:
        for name in os.listdir(self.d.cfg.nvme):  # downloads a crash interrupted
            if name.startswith(".cold-"):
                try:
                    os.unlink(os.path.join(self.d.cfg.nvme, name))
                except OSError as e:
                    log.warning("cannot remove %s: %s", name, e)
        try:
            n = await trio.to_thread.run_sync(self.cold.clean_temp, self.d.cfg.node_id)
            if n:
                log.info("removed %d unfinished uploads on the cold tier", n)
        except OSError as e:
            log.warning("cannot clean the cold tier's unfinished uploads: %s", e)
        await self._finish_interrupted()
        while True:
            await self._kick.wait()
            self._kick = trio.Event()
            try:
                await self.move_pending()
            except (OSError, SharedError) as e:  # a failing cold store: a line per new error
                if str(e) != self.stats.last_error:
                    log.error("moving segments to the cold tier failed (%s); will retry "
                              "every 5 s", e)
                self.stats.last_error = str(e)
                await trio.sleep(5)
                self._kick.set()
            except Exception as e:  # a fault of ours: the whole story, but keep the mount
                self.stats.last_error = str(e)
                log.exception("moving segments to the cold tier failed; will retry")
                await trio.sleep(5)
                self._kick.set()

    async def _finish_interrupted(self) -> None:
        """Shared copies of COLD segments left by a crash between record and delete."""
        cold = [s for s, i in self.d.index.iter_segments() if i.state == SegState.COLD]
        for seg in cold:
            path = self.d.seglog.path(seg)
            if os.path.exists(path):
                os.unlink(path)
        if cold:
            await trio.to_thread.run_sync(self._delete_shared, cold)

    def _delete_shared(self, segs: list[int]) -> None:
        for seg in segs:
            self.d.store.delete_object(self.d.cfg.node_id, seg)  # a missing one is fine

    @sched.in_background
    def _copy(self, seg: int, size: int, local: bool) -> None:
        """Worker thread: copy one object to the cold store and verify the copy."""
        node = self.d.cfg.node_id
        src = self.d.seglog.path(seg)
        tmp = None
        try:
            if not local:
                tmp = os.path.join(self.d.cfg.nvme, f".cold-{fmt.segment_name(seg)}")
                with open(tmp, "wb") as f:
                    for chunk in self.d.store.iter_object(node, seg):
                        f.write(chunk)
                src = tmp
            try:
                self.cold.put_object(node, seg, src)
            except FileExistsError:
                # left by a move that stopped before its TIER record (a crash, or a copy that
                # did not verify): nothing names it yet
                if self._verify(node, seg, size):
                    log.info("segment %s: keeping the whole copy an earlier move left on the "
                             "cold tier", fmt.segment_name(seg))
                    return
                log.warning("segment %s: replacing the damaged copy an earlier move left on "
                            "the cold tier", fmt.segment_name(seg))
                self.cold.delete_object(node, seg)
                self.cold.put_object(node, seg, src)
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
        copy = fmt.SealedSegment(f"cold {node}/{fmt.segment_name(seg)}", size,
                                 lambda o, n: self.cold.read_range(node, seg, o, n))
        for _rec in copy.records(data_payloads=True):  # raises CorruptRecord on a bad copy
            pass

    def _verify(self, node: str, seg: int, size: int) -> bool:
        """Whether the cold store's copy of seg is whole: its size, and every record's
        checksum."""
        try:
            if self.cold.object_size(node, seg) != size:
                return False
            copy = fmt.SealedSegment(f"cold {node}/{fmt.segment_name(seg)}", size,
                                     lambda o, n: self.cold.read_range(node, seg, o, n))
            for _rec in copy.records(data_payloads=True):
                pass
        except (OSError, fmt.CorruptRecord):
            return False
        return True

    async def move_pending(self) -> None:
        moved: list[tuple[int, int, bool]] = []
        for seg in sorted(self.pending):
            info = self.d.index.get_segment(seg)
            if info is None or info.state not in (SegState.PUBLISHED, SegState.EVICTED):
                self.pending.discard(seg)
                continue
            local = info.state == SegState.PUBLISHED and os.path.exists(self.d.seglog.path(seg))
            await trio.to_thread.run_sync(self._copy, seg, info.size, local)
            # the copy is verified: from now on the cold tier is where this segment lives
            self.d.ns.record(RecType.TIER, 0, 0,
                             json.dumps({"seg": seg, "tier": "cold"}).encode())
            self.d.reader.cold_segs.add(seg)
            self.d.reader.forget(seg)
            moved.append((seg, info.size, local))
            self.pending.discard(seg)
            self.stats.segments_moved += 1
            self.stats.bytes_moved += info.size
            log.info("moved segment %s (%d bytes) to the cold tier %s", fmt.segment_name(seg),
                     info.size, self.url)
        if not moved:
            return
        for seg, size, local in moved:
            if local:
                try:
                    os.unlink(self.d.seglog.path(seg))
                    self.d.cache.local_bytes -= size
                except FileNotFoundError:
                    pass
        # readers learn the new tier from the next manifest; only then is the old copy gone
        target = self.d.seglog.seq
        self.d.ns.seal("tier")
        await self.d.drain.wait_seq(target, None)
        await trio.to_thread.run_sync(self._delete_shared, [s for s, _z, _l in moved])
        self.stats.last_error = None

    def status(self) -> dict[str, Any]:
        return {"url": self.url, "pending": len(self.pending), **self.stats.__dict__}


class Tiered:
    """The shared and cold tiers of one node read as one store (for replay): a segment is on
    one of them."""

    def __init__(self, shared: Any, cold: Any):
        self.shared = shared
        self.cold = cold

    def list_objects(self, node: str) -> list[int]:
        return sorted(set(self.shared.list_objects(node)) | set(self.cold.list_objects(node)))

    def _first(self, fn: str, *args: Any) -> Any:
        try:
            return getattr(self.shared, fn)(*args)
        except Exception:  # noqa: BLE001 - not on the shared tier: the cold one then
            return getattr(self.cold, fn)(*args)

    def object_size(self, node: str, seg: int) -> int:
        return self._first("object_size", node, seg)

    def read_range(self, node: str, seg: int, offset: int, length: int) -> bytes:
        return self._first("read_range", node, seg, offset, length)
