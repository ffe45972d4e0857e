"""The drain: sealed segments -> published objects on SHARED -> a manifest per node.

Per segment, states are recorded in the index before each step:

    SEALED --(commit UPLOADING)--> copy to SHARED as temp, fsync, rename, fsync dir
           --> PUBLISHED

Segments waiting together are published together (up to `batch_max`, their objects copied
side by side on the upload streams): a temp directory holding one object per segment,
fsync'd, renamed into place as `objects/<node>/b<first>-<last>/`. A storm's backlog of k
segments then costs k + 2 namespace operations on SHARED instead of 2k.

A crash at any point resumes on the next mount: UPLOADING and SEALED segments are uploaded
again (an object already complete under its final name is recognised and kept), this node's
temp files on SHARED are removed. Object names are deterministic (node/segment id), so nothing
is ever published twice under two names.

The *published view* is a second index (NVME/published) built by applying, in log order, the
records of the contiguous prefix of published segments. It is exactly the namespace as of the
last published record, so the manifest made from it never names bytes that are not on SHARED.
`wait` returns once the published view has reached the log position of the call.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import trio

from ckptfs import knobs, manifest, sched
from ckptfs import segment as fmt
from ckptfs.index import Index, SegState
from ckptfs.shared import (
    PUBLISH_BATCH,
    RateLimiter,
    SharedError,
    SharedStore,
    describe_oserror,
    describe_stall,
)

log = logging.getLogger(__name__)

PUBLISHED_DIR = "published"
MAX_BACKOFF = 10.0
REPEAT_LOG_EVERY = 600.0  # a failure that goes on is logged again this often
MANIFEST_RECHECK = 0.5  # s between looks at an owed manifest (writers quiet? interval over?)
# The published view commits after this many records, even inside a segment: an LMDB write
# transaction holds every page it dirtied in memory until it commits (a batch of segments
# importing 350,000 files held ~150 MB)
VIEW_COMMIT_RECORDS = knobs.number("CKPTFS_VIEW_COMMIT_RECORDS", 50000, "records", 1)


@dataclass
class DrainStats:
    segments_uploaded: int = 0
    bytes_uploaded: int = 0
    manifests_published: int = 0
    segments_dropped: int = 0
    batches: int = 0  # publishes of several segments at once (a batch directory)
    upload_seconds: float = 0.0
    retries: int = 0
    last_error: str | None = None
    last_error_time: float | None = None
    failing_since: float | None = None  # monotonic time of the first error since the last success
    recent: list[tuple[float, int]] = field(default_factory=list)  # (time, bytes) for rate

    def rate(self, window: float = 10.0) -> float:
        now = time.monotonic()
        self.recent = [(t, n) for t, n in self.recent if now - t <= window]
        return sum(n for _, n in self.recent) / window


class Drain:
    def __init__(self, nvme: str, node: str, index: Index, store: SharedStore,
                 seg_path: Callable[[int], str], commit: Callable[[], Any],
                 streams: int = 2, limit_mb_s: float = 0.0, batch_max: int = PUBLISH_BATCH):
        self.node = node
        self.index = index
        self.store = store
        self.seg_path = seg_path
        self.commit = commit  # async: commit the live index (write-ahead safe)
        self.streams = max(1, streams)
        # workers publishing at once: one can publish a segment sealed while the other's
        # batch uploads. More would split a backlog into more batches (two namespace
        # operations each) without more bandwidth: a batch copies its objects on up to
        # `streams` streams itself (SharedStore.put_objects)
        self.workers = min(2, self.streams)
        # queued segments are published up to batch_max at a time, as one batch directory
        # (k + 2 namespace operations on SHARED instead of 2k); 1 = one object at a time
        self.batch_max = max(1, batch_max)
        self._holding = 0  # workers holding a segment, not uploading yet
        self._busy = 0  # workers uploading
        self.limiter = RateLimiter(limit_mb_s * 1e6)
        # LMDB write transactions belong to the thread that began them: the published view
        # lives on one dedicated thread
        self._pub_thread = concurrent.futures.ThreadPoolExecutor(1, "ckptfs-pubview")
        self.pub: Index = self._pub_thread.submit(
            Index, os.path.join(nvme, PUBLISHED_DIR)).result()
        self.stats = DrainStats()
        self._said: dict[str, float] = {}  # failure -> when it was last logged (_error)
        self.published_seq = self.pub.applied[2]
        self.manifest_seq = self.published_seq
        self._changed = trio.Event()
        self._ready = trio.Event()  # set once leftovers on SHARED are cleaned up
        self._kick = trio.Event()
        self._send, self._recv = trio.open_memory_channel[int](float("inf"))
        self._queued: set[int] = set()
        self._thread_limiter = trio.CapacityLimiter(self.streams)
        self.in_flight: dict[int, int] = {}  # seg -> bytes copied so far
        self.dropped: set[int] = {s for s, i in index.iter_segments()
                                  if i.state == SegState.DROPPED}
        self.waiters = 0
        # (seconds the shared store has not answered while calls wait, what waits): the
        # daemon counts its cold tier's store in too
        self.stalled: Callable[[], tuple[float, str]] = store.watch.stalled
        self._targets: list[int] = []  # log positions waiters need published
        self.cold_url = ""
        # this node's objects that its newest manifest at mount marked cold (daemon.py): an
        # imported one keeps that tier, as no segment of this log stands for it
        self.own_cold: dict[str, dict] = {}
        self.cold = None  # the cold tier's store
        self._cold_segs: set[int] = set()
        # the "yield" policy: while the application writes fast, uploads wait (the save gets
        # the machine first), unless someone waits for the drain or local space runs short
        self.policy = "yield"
        self.write_rate: Callable[[], float] = lambda: 0.0
        self.under_pressure: Callable[[], bool] = lambda: False
        self.busy_rate = 16e6
        self.max_yield = 30.0
        self.yielding = False
        self.yield_seconds = 0.0
        self.manifest_interval = 30.0
        # no manifest before the published view reaches this log sequence: a new NVME
        # directory's import of its node's namespace (a manifest of the view before it would
        # say the node publishes nothing, and other nodes would drop its files)
        self.manifest_floor = 0
        # when the published view first got ahead of the last manifest (None: it is not)
        self._unmanifested_since: float | None = None

    # --- entry points -------------------------------------------------------------------

    async def in_pub(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the published view's thread (LMDB write txns are thread-bound)."""
        fut = self._pub_thread.submit(fn)
        return await trio.to_thread.run_sync(fut.result)

    def kick(self) -> None:
        self._kick.set()

    def enqueue(self, seg: int) -> None:
        if seg not in self._queued and seg not in self.in_flight:
            self._queued.add(seg)
            self._send.send_nowait(seg)

    def pending(self) -> list[tuple[int, int]]:
        """(seg, size) of segments not yet published, in order."""
        return [(seg, i.size) for seg, i in self.index.iter_segments()
                if i.state in (SegState.SEALED, SegState.UPLOADING)]

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        for seg, _size in self.pending():
            self.enqueue(seg)
        async with trio.open_nursery() as nursery:
            # started at once: a shared store that fails now must not hold up the mount
            # (writes land on NVMe regardless); uploads and manifests wait for _startup
            nursery.start_soon(self._startup)
            for _ in range(self.workers):
                nursery.start_soon(self._worker, self._recv.clone())
            nursery.start_soon(self._publisher)
            nursery.start_soon(self._yield_policy)
            self._kick.set()
            task_status.started()

    @property
    def ready(self) -> bool:
        """The start-up work on SHARED is done (_startup); uploads and manifests wait for it."""
        return self._ready.is_set()

    async def _startup(self) -> None:
        """Remove this node's temp files (a crash's leftovers: nothing of ours is in flight
        yet) and create its directories, so a checkpoint's publishes start with neither."""
        removed = await self._retrying("clean temp files", self.store.clean_temp, self.node)
        if removed:
            log.info("removed %d half-written temp files on SHARED", removed)
        try:
            await trio.to_thread.run_sync(self.store.prepare, self.node)
        except OSError as e:  # the first upload tries again, and reports
            log.debug("preparing this node's directories on SHARED: %s", e)
        if self.stats.last_error and self.stats.last_error.startswith("clean temp files"):
            self.stats.last_error = self.stats.failing_since = None
        self._ready.set()

    async def wait_seq(self, seq: int, timeout: float | None,
                       progress: Callable[[dict], Any] | None = None) -> None:
        """Until the published view (and its manifest) reaches log sequence number `seq`."""
        deadline = None if timeout is None else trio.current_time() + timeout
        total = None
        self.waiters += 1
        self._targets.append(seq)
        self._kick.set()
        try:
            await self._wait_loop(seq, deadline, progress, total)
        finally:
            self.waiters -= 1
            self._targets.remove(seq)

    async def _wait_loop(self, seq: int, deadline: float | None,
                         progress: Callable[[dict], Any] | None, total: int | None) -> None:
        while self.manifest_seq < seq:
            if progress is not None:
                pend = max(0, sum(size for _s, size in self.pending())
                           - sum(self.in_flight.values()))
                total = max(total or 0, pend)
                st = self.stats
                stall_for, stall_on = self.stalled()
                await progress({"done": total - pend, "total": total, "error": st.last_error,
                                "error_for": (time.monotonic() - st.failing_since
                                              if st.failing_since is not None else 0.0),
                                "stall_for": stall_for, "stall_on": stall_on})
            ev = self._changed
            with trio.move_on_at(deadline if deadline is not None else float("inf")):
                with trio.move_on_after(1.0):
                    await ev.wait()
                continue
            stall_for, stall_on = self.stalled()
            raise TimeoutError(f"timed out; {len(self.pending())} segments still pending"
                               + (f"; last error: {self.stats.last_error}"
                                  if self.stats.last_error else "")
                               + (f"; {describe_stall(stall_for, stall_on)}"
                                  if stall_for >= 1 else ""))

    # --- uploading --------------------------------------------------------------------------

    def stop_uploads(self) -> None:
        """The daemon is exiting: uploads in flight give up at their next chunk instead of
        holding the exit until they finish (or forever, if they were paused for writers)."""
        self.limiter.stop.set()
        self.limiter.hold.clear()

    async def _yield_policy(self) -> None:
        try:
            await self._yield_loop()
        finally:  # never leave uploads paused behind us
            self.limiter.hold.clear()

    async def _yield_loop(self) -> None:
        since = 0.0
        while True:
            await trio.sleep(0.1)
            now = time.monotonic()
            busy = self._writes_busy()
            if busy and not self.yielding:
                since = now
            if busy and now - since > self.max_yield:
                busy = False  # never starve the drain for long: let it run a while
                if now - since > self.max_yield + 5:
                    since = now
            if self.yielding:
                self.yield_seconds += 0.1
            self.yielding = busy
            if busy:
                self.limiter.hold.set()
            else:
                self.limiter.hold.clear()

    def _writes_busy(self) -> bool:
        """The application writes fast enough for the "yield" policy to hold uploads back."""
        return (self.policy == "yield" and not self.waiters and not self.under_pressure()
                and self.write_rate() >= self.busy_rate)

    async def _retrying(self, what: str, fn: Callable, *args: Any, pub: bool = False) -> Any:
        delay = 0.5
        while True:
            try:
                if pub:
                    fut = self._pub_thread.submit(fn, *args)
                    return await trio.to_thread.run_sync(fut.result)
                return await trio.to_thread.run_sync(fn, *args, limiter=self._thread_limiter)
            except (OSError, fmt.CorruptRecord, manifest.ManifestError) as e:
                msg = describe_oserror(e) if isinstance(e, OSError) else str(e)
                self._error(f"{what}: {msg}")
                self.stats.retries += 1
                await trio.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF)

    def _error(self, msg: str) -> None:
        """Each distinct failure is logged once until the drain recovers, then again every
        REPEAT_LOG_EVERY seconds while it lasts (streams that fail differently, e.g. each on
        its own segment, would otherwise log in turns at every retry)."""
        now = time.monotonic()
        said = self._said.get(msg)
        if said is None or now - said >= REPEAT_LOG_EVERY:
            if len(self._said) >= 256:
                self._said.clear()
            self._said[msg] = now
            log.error("drain: %s%s (will retry)", "still failing: " if said else "", msg)
        if self.stats.failing_since is None:
            self.stats.failing_since = time.monotonic()
        self.stats.last_error = msg
        self.stats.last_error_time = time.time()

    async def _worker(self, recv: trio.MemoryReceiveChannel[int]) -> None:
        await self._ready.wait()
        async with recv:
            async for seg in recv:
                self._holding += 1
                try:
                    if not self.yielding and self._writes_busy():
                        # a save just started: give the policy's next tick (0.1 s) the say
                        await trio.sleep(0.15)
                    while self.yielding:
                        await trio.sleep(0.1)
                    batch = [seg] + self._take_more(recv)
                finally:
                    self._holding -= 1
                self._busy += 1
                try:
                    await self._upload(batch, recv)
                finally:
                    self._busy -= 1
                for s in batch:
                    self._queued.discard(s)
                self._kick.set()

    def _take_more(self, recv: trio.MemoryReceiveChannel[int], have: int = 1) -> list[int]:
        """More queued segments to publish with the `have` this worker holds, as one batch:
        everything queued, at most batch_max. A batch's objects are copied side by side on
        up to `streams` streams (SharedStore._put_batch), so splitting a backlog among the
        workers would gain no bandwidth and cost two namespace operations per extra batch."""
        limit = self.batch_max
        more: list[int] = []
        while have + len(more) < limit:
            try:
                more.append(recv.receive_nowait())
            except trio.WouldBlock:
                break
        return more

    async def _upload(self, batch: list[int],
                      recv: trio.MemoryReceiveChannel[int] | None = None) -> None:
        """Publish the segments of `batch` (in place: segments taken from `recv` while the
        store fails are added to it, so a backlog built up during an outage goes out in
        batches too)."""
        todo: list[tuple[int, int]] = []  # (seg, size)
        maybe_there: set[int] = set()  # an attempt may have published these before a crash

        async def admit(segs: list[int]) -> None:
            intent = False
            for seg in segs:
                st = self.index.get_segment(seg)
                if st is None or st.state not in (SegState.SEALED, SegState.UPLOADING):
                    continue
                todo.append((seg, st.size))
                if st.state == SegState.SEALED:
                    self.index.set_segment(seg, SegState.UPLOADING)
                    intent = True
                else:
                    maybe_there.add(seg)
            if intent:
                await self.commit()  # intent before the side effect

        await admit(batch)
        if not todo:
            return
        t0 = time.monotonic()

        lock = threading.Lock()  # S3 parts of one object report from several threads

        def progress(seg: int, n: int) -> None:
            with lock:
                self.in_flight[seg] = self.in_flight.get(seg, 0) + n

        @sched.in_background
        def upload(items: list[tuple[int, int]]) -> int:
            for seg, _size in items:
                self.in_flight[seg] = 0
            self.store.check()
            # published before a crash (the name is final): keep it, if it is this segment
            # (not another NVME directory's under the same name: then the put says EEXIST)
            rest = [(seg, size) for seg, size in items
                    if not (seg in maybe_there and self.store.object_ok(
                        self.node, seg, size, self._local_head(seg)))]
            if not rest:
                return 0
            sizes = self.store.put_objects(self.node, [(seg, self.seg_path(seg))
                                                       for seg, _size in rest],
                                           self.limiter, progress)
            for (seg, size), n in zip(rest, sizes):
                if n != size:
                    raise OSError(5, f"segment {fmt.segment_name(seg)} changed size during "
                                     "upload")
            return sum(sizes)

        delay = 0.5
        while True:
            while self.yielding:
                await trio.sleep(0.1)
            undeleted = False
            for seg, size in list(todo):
                info = self.index.get_segment(seg)
                if info is not None and info.data > 0 and info.live == 0:
                    # superseded (checked before every attempt: a retention pass may have
                    # deleted its checkpoint while the store was failing): everything it holds
                    # is dead, so no object is made; its records stay on NVMe for replay and
                    # the view
                    if seg in maybe_there:
                        # an attempt before a crash (or one that failed late) may have
                        # published it: GC never looks for objects of DROPPED segments, so
                        # the delete is retried with the batch until it is done
                        try:
                            await trio.to_thread.run_sync(self.store.delete_object, self.node,
                                                          seg, limiter=self._thread_limiter)
                        except (OSError, SharedError) as e:
                            self._error(f"removing the object of dropped segment "
                                        f"{fmt.segment_name(seg)}: {e}")
                            undeleted = True
                            continue
                    todo.remove((seg, size))
                    self.in_flight.pop(seg, None)
                    self.index.set_segment(seg, SegState.DROPPED)
                    self.stats.segments_dropped += 1
                    log.info("dropped segment %s from the drain (%d bytes, all data "
                             "superseded)", fmt.segment_name(seg), size)
            if not todo:
                return
            if undeleted:  # the store fails: back off as for a failed upload, then again
                self.stats.retries += 1
                await trio.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF)
                continue
            try:
                n = await trio.to_thread.run_sync(upload, list(todo),
                                                  limiter=self._thread_limiter)
                break
            except OSError as e:
                if self.limiter.stop.is_set():
                    await trio.sleep_forever()  # stopping: cancelled right here, no retry
                names = ", ".join(fmt.segment_name(seg) for seg, _size in todo)
                self._error(f"upload {names}: {describe_oserror(e)}")
                self.stats.retries += 1
                maybe_there.update(seg for seg, _size in todo)
                await trio.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF)
                if recv is not None and len(todo) < self.batch_max:
                    more = self._take_more(recv, have=len(todo))
                    batch.extend(more)
                    await admit(more)
                    todo.sort()
        dt = time.monotonic() - t0
        for seg, _size in todo:
            self.in_flight.pop(seg, None)
            self.index.set_segment(seg, SegState.PUBLISHED)
        self.stats.segments_uploaded += len(todo)
        self.stats.bytes_uploaded += n
        self.stats.upload_seconds += dt
        self.stats.recent.append((time.monotonic(), n))
        if len(todo) > 1:
            self.stats.batches += 1
        if self.stats.last_error:
            log.info("drain recovered")
            self.stats.last_error = self.stats.failing_since = None
            self._said.clear()
        what = (f"segment {fmt.segment_name(todo[0][0])}" if len(todo) == 1 else
                f"{len(todo)} segments {fmt.segment_name(todo[0][0])}.."
                f"{fmt.segment_name(todo[-1][0])} as one batch")
        log.info("published %s (%d bytes, %.2fs, %.0f MB/s)", what, n, dt,
                 n / dt / 1e6 if dt > 0 else 0)

    # --- the published view and its manifest ----------------------------------------------

    def index_state(self, seg: int) -> int:
        """(Thread-safe) whether seg lives on the cold tier, as far as the trio side told us."""
        return SegState.COLD if seg in self._cold_segs else SegState.PUBLISHED

    def in_view(self, seg: int, size: int) -> bool:
        """(Thread-safe) whether the published view has applied all of segment `seg`; it may
        have committed part of one (VIEW_COMMIT_RECORDS)."""
        done_seg, done_pos, _seq = self.pub.applied
        return seg < done_seg or (seg == done_seg and done_pos >= size)

    def _ready_segments(self) -> list[tuple[int, int, bool]]:
        """Published segments after the published view, up to the first one that is not."""
        out = []
        for seg, i in self.index.iter_segments():
            if self.in_view(seg, i.size):
                continue
            if i.state not in (SegState.PUBLISHED, SegState.EVICTED, SegState.DROPPED,
                               SegState.COLD):
                break
            if i.state == SegState.COLD:
                self._cold_segs.add(seg)
            out.append((seg, i.size, i.state == SegState.DROPPED))
        return out

    async def _publisher(self) -> None:
        await self._ready.wait()
        while True:
            if self.manifest_seq < self.published_seq:
                # a manifest is owed: look again now and then, for nothing kicks us when the
                # writers go quiet or the interval runs out
                with trio.move_on_after(MANIFEST_RECHECK):
                    await self._kick.wait()
            else:
                await self._kick.wait()
            self._kick = trio.Event()
            ready = self._ready_segments()
            # a manifest is O(files) to build and 3 namespace operations on SHARED: make one
            # when someone waits, when the drain and the writers are idle (nothing queued or
            # uploading, log idle), or once published data has waited manifest_interval for
            # one; not after every segment, nor at a checkpoint's first batch
            now = time.monotonic()
            if ready and self._unmanifested_since is None:
                self._unmanifested_since = now
            quiet = not self._queued and not self.in_flight and self.write_rate() == 0.0
            since = self._unmanifested_since
            want = bool(quiet or (since is not None and now - since >= self.manifest_interval))
            # a waiter needs a manifest once the view covers what it waits for, not before
            need = min(self._targets) if self._targets else None
            if not ready and (self.manifest_seq >= self.published_seq
                              or not (want or (need is not None
                                               and self.published_seq >= need))):
                continue
            await self._retrying("publish manifest", self._advance, ready, want, need,
                                 pub=True)
            if self.manifest_seq >= self.published_seq:
                self._unmanifested_since = None
            ev, self._changed = self._changed, trio.Event()
            ev.set()
            if self.manifest_seq < self.published_seq:
                self._kick.set()  # come back for the manifest
                await trio.sleep(0.2)

    def _published_already(self, data: bytes) -> bool:
        """Whether this node's manifest of the same sequence on SHARED says what `data` says
        (it may differ in its creation time only)."""
        try:
            have = manifest.parse(self.store.get_manifest(self.node, self.published_seq),
                                  f"{self.node}/{self.published_seq:016x}.manifest")
        except (OSError, manifest.ManifestError):
            return False
        mine = manifest.parse(data, "the manifest to publish")
        return (have.node, have.objects, have.entries, have.cold) == \
            (mine.node, mine.objects, mine.entries, mine.cold)

    def _local_head(self, seg: int) -> bytes:
        """The local segment file's header (b"" if it cannot be read)."""
        try:
            with open(self.seg_path(seg), "rb") as f:
                return f.read(fmt.SEGMENT_HEADER_SIZE)
        except OSError:
            return b""

    def _open_sealed(self, seg: int, size: int) -> fmt.SealedSegment:
        path = self.seg_path(seg)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # evicted (it is published): read it from the store
            fd = -1
        if fd >= 0:
            try:
                return fmt.SealedSegment(path, size, lambda o, n: os.pread(fd, n, o)), fd
            except BaseException:
                os.close(fd)
                raise
        name = f"{self.node}/{fmt.segment_name(seg)}"
        src = self.cold if self.cold is not None and self.index_state(seg) == SegState.COLD \
            else self.store
        return fmt.SealedSegment(name, size, lambda o, n: src.read_range(
            self.node, seg, o, n)), -1

    def _advance(self, ready: list[tuple[int, int, bool]], want_manifest: bool,
                 need: int | None = None) -> None:
        """Published-view thread: apply newly published segments, publish the manifest (if
        wanted, or if the view now covers `need`, the oldest position a waiter waits for)."""
        uncommitted = 0
        for seg, size, dropped in ready:
            # A retry of this call (an attempt failed after applying some of `ready`, e.g.
            # the manifest's put), or a restart after a commit inside a segment, must not
            # apply a record twice: a CREATE of a.tmp applied again after its RENAME to a
            # would bring a.tmp back into the view.
            if self.in_view(seg, size):
                continue
            done_seg, done_pos, _seq = self.pub.applied
            if dropped:
                self.dropped.add(seg)
            if self.pub.get_segment(seg) is None:
                self.pub.set_segment(seg, SegState.PUBLISHED, size=size)
            sealed, fd = self._open_sealed(seg, size)
            try:
                for rec in sealed.records():
                    if seg == done_seg and rec.pos < done_pos:
                        continue  # applied by the attempt that failed part-way through
                    self.pub.apply(seg, rec)
                    uncommitted += 1
                    if uncommitted >= VIEW_COMMIT_RECORDS:
                        self.pub.commit()  # `applied` is this record's end (Index.apply)
                        uncommitted = 0
            finally:
                if fd >= 0:
                    os.close(fd)
            self.pub.set_segment(seg, SegState.PUBLISHED, size=size)
            self.pub.applied = (seg, size, sealed.seal_seq)
            self.published_seq = sealed.seal_seq
        if need is not None and self.published_seq >= need:
            want_manifest = True
        if not want_manifest or self.published_seq <= self.manifest_seq:
            return
        if self.published_seq < self.manifest_floor:
            log.debug("manifest deferred: the import of this node's namespace is not "
                      "published yet")
            self.pub.commit()
            return
        objects = {manifest.obj_name(self.node, s):
                   ({"size": i.size, "tier": "cold"} if i.state == SegState.COLD
                    else {"size": i.size})
                   for s, i in self.pub.iter_segments() if s not in self.dropped}
        for name, info in self.own_cold.items():
            if name not in objects:  # not this log's own segment (that one says for itself)
                objects[name] = info
        try:
            data = manifest.build(self.pub, self.node, self.published_seq, objects,
                                  time.time_ns(), self.dropped, self.cold_url)
        except manifest.NotYet as e:
            log.debug("manifest deferred: %s", e)
            self.pub.commit()
            return
        self.store.check()  # never publish into a shared filesystem that is not mounted
        try:
            self.store.put_manifest(self.node, self.published_seq, data)
        except FileExistsError:
            # put before a crash that came before the view's commit below: the view is
            # applied again up to the same position, and its manifest is already out
            if not self._published_already(data):
                raise
            log.info("manifest %016x was published before a restart", self.published_seq)
        # published: a retry after a failure below must not put this manifest again (a
        # published object is never replaced)
        self.manifest_seq = self.published_seq
        self.stats.manifests_published += 1
        log.info("published manifest %016x (%d bytes)", self.published_seq, len(data))
        self.pub.commit()
        try:
            self.store.prune_manifests(self.node, keep=2)
        except OSError as e:  # the next manifest prunes them
            log.warning("removing old manifests from SHARED failed: %s", describe_oserror(e))

    def close(self) -> None:
        self._pub_thread.submit(self.pub.close, True).result()
        self._pub_thread.shutdown()
