"""Garbage collection: free segments whose data nobody references any more, on both tiers.

A segment is garbage when all the data it ever held is dead (overwritten, truncated, or its
files deleted: by `rm -rf` or by retention; a segment of metadata records only holds none)
in the live index *and* in the published view, the newest manifest of no other node names
it (our own manifests are built from the published view), and it has stayed that way for a
grace period
(other nodes may have imported its ranges and not refreshed yet). Then its object on SHARED
is deleted (one unlink per object, never per file) and so is its local file.

Deleting log segments must not break replay: before the first deletion beyond it, the index is
snapshotted (an LMDB copy of a committed state, NVME/snapshot/), and a full replay starts from
the newest snapshot instead of the first segment.

Mostly-dead segments are compacted: their live extents are copied forward as new WRITE
records (flagged RELOC: they change no times), which leaves the old segment all dead.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable

import trio

from ckptfs import layout, sched
from ckptfs import segment as fmt
from ckptfs.index import VSEG_BIT, Index, SegState, read_applied
from ckptfs.remote import newest_manifests
from ckptfs.shared import ANSWER_TIMEOUT, SharedStore

log = logging.getLogger(__name__)

SNAPSHOT_DIR = "snapshot"
PUB_SNAPSHOT_DIR = "published-snapshot"  # the published view's, taken with the index's
# on a store: SHARED or the cold tier (the names a node's NVMe-less mount numbers after)
STORED = (SegState.PUBLISHED, SegState.EVICTED, SegState.COLD)
DEAD_STATES = (*STORED, SegState.DROPPED)
# objects of this node from before its NVMe was lost are looked for every this many passes
# (a scan of every extent of the index and of the published view)
OLD_OBJECTS_EVERY = 8


@dataclass
class GcStats:
    runs: int = 0
    segments_deleted: int = 0
    objects_deleted: int = 0
    bytes_freed_local: int = 0
    bytes_freed_shared: int = 0
    compacted_segments: int = 0
    compacted_bytes: int = 0
    snapshots: int = 0


@sched.in_background
def take_snapshot(index: Index, nvme: str, name: str = SNAPSHOT_DIR) -> None:
    """Copy the committed index to NVME/<name> atomically (blocking)."""
    tmp = os.path.join(nvme, name + ".tmp")
    dest = os.path.join(nvme, name)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    index.env.copy(tmp, compact=True)
    layout.fsync_file(os.path.join(tmp, "data.mdb"))
    layout.fsync_dir(tmp)  # data.mdb's name in it, before the rename makes it the snapshot
    old = dest + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(dest):
        os.rename(dest, old)
    os.rename(tmp, dest)
    layout.fsync_dir(nvme)
    shutil.rmtree(old, ignore_errors=True)


def restore_snapshot(nvme: str, index_dir: str, name: str = SNAPSHOT_DIR) -> bool:
    """Replace the index with the snapshot (for a full replay); False if there is none."""
    src = os.path.join(nvme, name, "data.mdb")
    if not os.path.exists(src):
        return False
    shutil.rmtree(index_dir, ignore_errors=True)
    layout.makedirs_durable(index_dir)
    shutil.copyfile(src, os.path.join(index_dir, "data.mdb"))
    layout.fsync_file(os.path.join(index_dir, "data.mdb"))
    layout.fsync_dir(index_dir)
    return True


class Collector:
    def __init__(self, nvme: str, node: str, index: Index, drain: Any, store: SharedStore,
                 seg_path: Callable[[int], str], forget: Callable[[int], None],
                 commit: Callable[[], Any], grace: float = 60.0, interval: float = 15.0,
                 compact_below: float = 0.25):
        self.nvme = nvme
        self.node = node
        self.index = index
        self.drain = drain
        self.store = store
        self.seg_path = seg_path
        self.forget = forget
        self.commit = commit
        self.grace = grace
        self.interval = interval
        self.compact_below = compact_below
        self.first_dead: dict[int, float] = {}
        # this node's objects from before its NVMe was lost: since when unused, and deleted
        self.old_first_dead: dict[int, float] = {}
        self.old_deleted: set[int] = set()
        # node -> (seq of its newest manifest, this node's segment ids that it references)
        self._refs: dict[str, tuple[int, set[str]]] = {}
        self.cold: Any = None  # the cold tier's store, if any
        # told the size of each local segment file GC removes (cache.LocalCache.removed)
        self.local_freed: Callable[[int], None] = lambda size: None
        self.stats = GcStats()
        self.snapshot_seg = self._snapshot_seg()
        self.pub_snapshot_seg = self._snapshot_seg(PUB_SNAPSHOT_DIR)
        # why the last pass could not look at every dead segment ("" = it could); `ckptfs gc`
        # reports it as an error instead of "0 segments freed"
        self.skipped = ""

    def _snapshot_seg(self, name: str = SNAPSHOT_DIR) -> int:
        path = os.path.join(self.nvme, name)
        if not os.path.exists(os.path.join(path, "data.mdb")):
            return 0
        applied = read_applied(path)
        return applied[0] if applied else 0

    async def run(self) -> None:
        while True:
            await trio.sleep(self.interval)
            try:
                await self.collect()
            except Exception:
                log.exception("garbage collection failed; will try again")

    def dead_segments(self) -> list[tuple[int, int, int]]:
        """(seg, state, size) of segments with no live data, strictly behind the view, but
        never the highest-numbered object on a store: its name is this node's high-water
        mark. A node whose NVMe is lost numbers its segments after the objects it finds
        (daemon.py); were the top one deleted, the new NVMe would publish a different object
        under its name, and another node that cached records of the old one by (object,
        position) could serve them for the new one."""
        pub_seg = self.drain.pub.applied[0]
        out = []
        top = 0
        for seg, i in self.index.iter_segments():
            if seg & VSEG_BIT:  # another node's object, imported
                break
            if i.state in STORED:
                top = seg
            if seg < pub_seg and i.live == 0 and i.state in DEAD_STATES:
                out.append((seg, i.state, i.size))
        return [r for r in out if r[0] != top]

    def dead_beyond_view(self) -> bool:
        """Whether a sealed segment that held data is all dead in the live index but not yet
        behind the published view (so not yet something dead_segments can give)."""
        pub_seg = self.drain.pub.applied[0]
        for seg, i in self.index.iter_segments():
            if seg & VSEG_BIT:
                break
            if seg >= pub_seg and i.state != SegState.ACTIVE and i.data > 0 and i.live == 0:
                return True
        return False

    async def collect(self, force: bool = False) -> int:
        self.stats.runs += 1
        self.skipped = ""
        if force:  # `ckptfs gc`: a SHARED that is gone is an error, not "nothing to free"
            try:
                # a stat: a thread blocked in it on a hung NAS can be left behind
                with trio.fail_after(ANSWER_TIMEOUT if ANSWER_TIMEOUT > 0 else float("inf")):
                    await trio.to_thread.run_sync(self.store.check, abandon_on_cancel=True)
            except OSError as e:
                self.skipped = f"the shared store cannot be used: {e}"
                return 0
            except trio.TooSlowError:
                self.skipped = (f"the shared store does not answer (no reply in "
                                f"{ANSWER_TIMEOUT:.0f} s)")
                return 0
        # Other nodes and `export` read the newest manifest, not the published view: an
        # object stays until a manifest without it is on SHARED, and its grace starts then.
        if not await self._view_published(force):
            return 0
        old = await self._collect_old(force)
        dead = self.dead_segments()
        if not dead:
            return old
        pub_live = await self.drain.in_pub(lambda: {s: i.live for s, i in
                                                    self.drain.pub.iter_segments()})
        if not await self._view_published(force):  # the view moved on meanwhile
            return 0
        now = time.monotonic()
        dead = [r for r in dead if pub_live.get(r[0], 0) == 0]
        for seg, _st, _size in dead:
            self.first_dead.setdefault(seg, now)
        # the grace lets other nodes that imported a published segment's ranges refresh; a
        # DROPPED one was never in a manifest (its data died before its upload), and its
        # local file may be what a writer waits for on a full NVMe
        ripe = [(seg, st, size) for seg, st, size in dead
                if force or st == SegState.DROPPED or now - self.first_dead[seg] >= self.grace]
        if not ripe:
            return old
        refs = await self._others_refs()
        if refs is None:
            return old
        ripe = [r for r in ripe if fmt.segment_name(r[0])[:16] not in refs]
        if not ripe:
            return old
        # replay must never need what we are about to delete
        if max(seg for seg, _s, _z in ripe) >= self.snapshot_seg:
            await self.commit()
            await trio.to_thread.run_sync(take_snapshot, self.index, self.nvme)
            # what the snapshot holds, not what the index holds by now: requests (and the
            # index's commits) went on while it was copied, and replay from the snapshot
            # needs every segment from its own position on
            self.snapshot_seg = await trio.to_thread.run_sync(self._snapshot_seg)
            self.stats.snapshots += 1
        # the same for the published view: a damaged one is rebuilt from its snapshot and
        # the published segments after it (`ckptfs replay`), which must all be there
        if max(seg for seg, _s, _z in ripe) >= self.pub_snapshot_seg:
            def snap() -> None:
                self.drain.pub.commit()
                take_snapshot(self.drain.pub, self.nvme, PUB_SNAPSHOT_DIR)

            await self.drain.in_pub(snap)
            self.pub_snapshot_seg = await trio.to_thread.run_sync(self._snapshot_seg,
                                                                  PUB_SNAPSHOT_DIR)
        ripe = [r for r in ripe if r[0] < min(self.snapshot_seg, self.pub_snapshot_seg)]
        if not ripe:
            return old
        # The published view applied these segments, but a power loss can undo its last
        # commit; it would then apply the segments after it again, without the deleted ones,
        # and publish manifests that miss their records (a rename or unlink undone on SHARED)
        await self.drain.in_pub(self.drain.pub.commit_durable)
        for seg, state, size in ripe:
            if state == SegState.COLD and self.cold is not None:
                await trio.to_thread.run_sync(self.cold.delete_object, self.node, seg)
                self.stats.objects_deleted += 1
            elif state != SegState.DROPPED:
                await trio.to_thread.run_sync(self.store.delete_object, self.node, seg)
                self.stats.objects_deleted += 1
                self.stats.bytes_freed_shared += size
            self.forget(seg)
            if state not in (SegState.EVICTED, SegState.COLD):
                try:
                    os.unlink(self.seg_path(seg))
                    self.stats.bytes_freed_local += size
                except FileNotFoundError:
                    pass
                self.local_freed(size)  # the cache counted it as on NVMe
            self.index.drop_segment(seg)
            self.first_dead.pop(seg, None)
            self.stats.segments_deleted += 1
            log.info("gc: deleted segment %s (%d bytes, all data dead)",
                     fmt.segment_name(seg), size)
        segs = [seg for seg, _s, _z in ripe]
        self.index.drop_chunks(set(segs))
        await self.drain.in_pub(lambda: [self.drain.pub.drop_segment(s) for s in segs])
        await self.commit()
        return len(ripe) + old

    async def _others_refs(self) -> set[str] | None:
        try:
            return await trio.to_thread.run_sync(self._referenced_elsewhere)
        except OSError as e:
            self.skipped = f"cannot list the nodes' manifests on SHARED: {e}"
            log.warning("gc: skipped, %s", self.skipped)
            return None

    async def _collect_old(self, force: bool) -> int:
        """Delete objects this node published before its NVMe was lost once nothing uses them.

        This NVME's first mount imported them (IMPORT records naming them: no segment of
        this log stands for them, so dead_segments never sees them). One goes when no extent
        names it in the index or in the published view (whose manifest is on SHARED: the
        caller checked), nor does another node's newest manifest, for the grace period; and
        never the highest-numbered object on the stores (dead_segments says why). Replay does
        not need them: an IMPORT record is replayed with its file's later deletion."""
        old = {seg: vseg for vseg, node, seg in self.index.iter_objrefs()
               if node == self.node and seg not in self.old_deleted}
        if not old or not (force or self.stats.runs % OLD_OBJECTS_EVERY == 1):
            return 0
        live = await trio.to_thread.run_sync(self.index.named_vsegs)

        def published() -> set[int]:
            pub = self.drain.pub
            refs = (pub.objref(v) for v in pub.named_vsegs())
            return {ref[1] for ref in refs if ref is not None and ref[0] == self.node}

        in_view = await self.drain.in_pub(published)
        stored = [seg for seg, i in self.index.iter_segments()
                  if not seg & VSEG_BIT and i.state in STORED]
        top = max([*stored, *old])
        unused = {seg for seg, vseg in old.items()
                  if vseg not in live and seg not in in_view and seg != top}
        now = time.monotonic()
        for seg in set(self.old_first_dead) - unused:  # named again (an import), or deleted
            del self.old_first_dead[seg]
        for seg in unused:
            self.old_first_dead.setdefault(seg, now)
        ripe = sorted(seg for seg in unused
                      if force or now - self.old_first_dead[seg] >= self.grace)
        if not ripe:
            return 0
        refs = await self._others_refs()
        if refs is None:
            return 0
        n = 0
        for seg in ripe:
            if fmt.segment_name(seg)[:16] in refs:
                continue
            await trio.to_thread.run_sync(self.store.delete_object, self.node, seg)
            if self.cold is not None:  # it may have been moved there before the loss
                await trio.to_thread.run_sync(self.cold.delete_object, self.node, seg)
            self.old_deleted.add(seg)
            self.old_first_dead.pop(seg, None)
            self.stats.objects_deleted += 1
            n += 1
            log.info("gc: deleted object %s/%s (published before this NVME directory, no "
                     "longer used)", self.node, fmt.segment_name(seg)[:16])
        return n

    async def _view_published(self, force: bool) -> bool:
        """Whether the newest manifest covers the whole published view (`force`, for
        `ckptfs gc`: have one published first, waiting up to 30 s)."""
        if self.drain.manifest_seq >= self.drain.published_seq:
            return True
        if not force:
            return False

        started = time.time()

        async def unless_failing(_info: dict) -> None:
            # a publish that failed again since we began waiting (its retries back off to
            # 10 s) is an outage, which the rest of 30 s will not end: say so now
            st = self.drain.stats
            if st.last_error and (st.last_error_time or 0) > started:
                raise RuntimeError(f"the drain fails: {st.last_error}")

        try:
            await self.drain.wait_seq(self.drain.published_seq, 30.0, unless_failing)
        except Exception as e:  # noqa: BLE001 - a timeout or a failing store: no GC now
            self.skipped = f"no manifest on SHARED covers what is published yet ({e})"
            log.warning("gc: %s", self.skipped)
            return False
        if self.drain.manifest_seq < self.drain.published_seq:
            self.skipped = "no manifest on SHARED covers what is published yet"
            return False
        return True

    def _referenced_elsewhere(self) -> set[str] | None:
        """Segment ids (hex) of this node that other nodes' manifests reference; None if a
        manifest could not be read (what it references is unknown: delete nothing).

        Runs every pass on every node, over every node's manifest: a manifest is parsed once
        per new sequence number and only what it references here is kept, so a pass costs
        nothing while the others publish nothing, and memory for one manifest at a time."""
        errors: list[str] = []
        seen = {node: seq for node, (seq, _refs) in self._refs.items()}
        current: set[str] = set()
        for node, seq, m in newest_manifests(self.store, seen, errors, current, entries=False,
                                             skip=self.node):
            current.add(node)
            refs: set[str] = set()
            for obj in m.objects:
                onode, seg = obj.rsplit("/", 1)
                if onode == self.node:
                    refs.add(seg)
            self._refs[node] = (seq, refs)
        for node in set(self._refs) - current:  # its manifests are gone
            del self._refs[node]
        if errors:
            self.skipped = f"another node's manifest is unreadable: {errors[0]}"
            log.warning("gc: skipped, %s", self.skipped)
            return None
        out: set[str] = set()
        for _seq, refs in self._refs.values():
            out |= refs
        return out

    def compaction_candidates(self) -> list[int]:
        out = []
        for seg, i in self.index.iter_segments():
            if not self.drain.in_view(seg, i.size):
                break
            if i.state in (SegState.PUBLISHED, SegState.EVICTED) and i.data > 0 \
                    and 0 < i.live < self.compact_below * i.data:
                out.append(seg)
        return out

    async def compact(self, ns: Any, max_bytes: int = 256 << 20) -> int:
        """Copy live extents out of mostly-dead segments (RELOC records); returns bytes."""
        cands = set(self.compaction_candidates())
        if not cands:
            return 0
        moves = [(ino, e) for ino, e in self.index.iter_all_extents() if e.seg in cands]
        moved = 0
        for ino, e in moves:
            data = bytes(await trio.to_thread.run_sync(sched.in_background(ns.reader.read_extent),
                                                     e, 0, e.length))
            # the file may have changed while we read: move only what is still there (a big
            # write still on its way to the disk counts: join() applies it first)
            ns.log.join()
            cur = self.index.extents_in(ino, e.start, e.end)
            if len(cur) != 1 or cur[0] != e:
                continue
            ns.record(fmt.RecType.RELOC, ino, e.start, data)
            moved += e.length
            if moved >= max_bytes:
                break
        if moved:
            self.stats.compacted_segments += len(cands)
            self.stats.compacted_bytes += moved
            log.info("gc: compacted %d mostly-dead segments (%d live bytes moved)", len(cands),
                     moved)
        return moved

    def status(self) -> dict[str, Any]:
        return dict(self.stats.__dict__, pending_dead=len(self.first_dead),
                    snapshot_segment=self.snapshot_seg)

