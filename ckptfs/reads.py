"""The read path: a file range -> extents -> bytes from a local segment or a shared object.

Every record is verified against its checksum the first time a read touches it (the whole
record is read once, then served from the page cache); a mismatch is EIO for that extent and a
log line naming segment and offset, never wrong bytes.

A small record on the shared store is fetched with the small records that follow it, up to
REMOTE_WINDOW bytes: every whole data record in that range is verified and kept in a bounded
cache, so a file written in small writes, or small files whose records interleave in one
segment, cost about one request per window, not one per record. A record of REMOTE_ALONE
bytes or more is fetched alone, and a window stops before one: the fetch first reads the
record and a little past it (WINDOW_PEEK at most), and reads on to REMOTE_WINDOW only if the
records seen there are small (at once, if the last window of that segment found only small
records). A 1 MiB write from a buffer that does not start on a page arrives as two records,
1 MiB less a few bytes and those few bytes; a blind 1 MiB window after each small one read
the next big record too, which its own reader was fetching already: 1.8x the bytes of 8 such
files restored at once. The head of a small record a window ends inside is kept for that
record's fetch, which reads the rest. A fetch in flight is waited for, not repeated; a read
whose records are all in the cache is served without a thread hop.

A file read sequentially has its next records asked for ahead (read_ahead, called by the
namespace): local ones read into the page cache by the kernel, remote ones fetched into the
cache by prefetch threads (docs/architecture.md section 4).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any, Callable, Protocol

from ckptfs import segment as fmt
from ckptfs.errors import CorruptData, FsError
from ckptfs.fdcache import FdCache
from ckptfs.index import VSEG_BIT, Extent
from ckptfs.shared import SharedError

log = logging.getLogger(__name__)

HDR = fmt.RECORD_HEADER_SIZE
REMOTE_CACHE_BYTES = 32 << 20  # whole verified records recently fetched from the shared store
REMOTE_WINDOW = 1 << 20  # a remote miss reads up to this much of the object, forward...
REMOTE_ALONE = 256 << 10  # ...unless its record is this big: then that record alone
# what a window reads past its record before it knows what follows: four times the record,
# at least 4 KiB, at most 64 KiB
WINDOW_PEEK = 64 << 10
PARTIAL_BYTES = 8 << 20  # heads of records that windows ended inside, kept for their fetch
MAX_RUN = 4 << 20  # largest single local read that fetches a run of adjacent records
# shared-store fetches ahead of sequential reads, at once at most (a store's `fetches_ahead`
# says otherwise: S3, where each is a round trip over the network)
PREFETCH_THREADS = 4


class _NotCached(Exception):
    """read_cached: a record it needs is neither in memory (remote) nor in the page cache
    (local): answering would wait for a device or the network."""


# Reading local records without waiting: preadv2(RWF_NOWAIT) fails or comes back short when
# the pages are not in the page cache. Linux 4.14+ on ext4, XFS, btrfs; a filesystem without
# it (EOPNOTSUPP) gets the blocking read on the trio thread, as before.
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


def _small_run_goes_on(data: memoryview, p: int) -> bool:
    """Whether the records from `p` on in `data` (a window's first read; p: the end of its
    first record) are small data records up to its end, so that reading on would bring more
    of them; False at a big record, at anything but a data record (the seal table, the
    footer), and at a damaged header."""
    while p + HDR <= len(data):
        h = fmt.decode_header(data[p:p + HDR])
        if h is None or h[0] not in fmt.DATA_TYPES or HDR + h[1] >= REMOTE_ALONE:
            return False
        p += fmt.record_size(h[1])
    return True


class RemoteSource(Protocol):
    """Where a segment that is not on local disk can be read from (the shared store)."""

    def read_range(self, node: str, seg: int, offset: int, length: int) -> bytes: ...


class Reader:
    """Thread-safe: local reads run on the trio thread, shared-store reads on worker threads.

    Extents name local segments by id, or published objects of any node by a vseg id (top
    bit set) that `objrefs` maps to (node, segment id); the trio thread fills `objrefs` from
    the index before a read needs it, so worker threads never touch the index.
    """

    def __init__(self, seg_path: Callable[[int], str], node: str = "",
                 remote: RemoteSource | None = None, max_fds: int = 128,
                 max_verified: int = 1 << 17):
        self.seg_path = seg_path
        self.node = node
        self.remote = remote
        self.objrefs: dict[int, tuple[str, int]] = {}
        self.evicted: set[int] = set()  # local segment ids whose file is gone (published)
        self.cold = None  # the cold tier's store (--cold), for segments in cold_segs
        self.cold_segs: set[int] = set()
        self.cold_by_node: dict[str, Any] = {}  # other nodes' cold stores, from manifests
        self._lock = threading.Lock()
        self._fds = FdCache(max_fds)
        self._verified: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._remote_cache: OrderedDict[tuple[int, int], memoryview] = OrderedDict()
        self._remote_bytes = 0
        # the first bytes of a record a window ended inside, not verified yet: its fetch
        # reads only the rest
        self._partial: OrderedDict[tuple[int, int], memoryview] = OrderedDict()
        self._partial_bytes = 0
        self._inflight: dict[tuple[int, int, int], threading.Event] = {}  # (seg, start, end)
        # segment -> whether its last window found nothing but small records after its first
        self._small_runs: dict[int, bool] = {}
        self._scratch = bytearray(HDR + (1 << 20) + 8)
        self._nowait = _RWF_NOWAIT  # 0 once the local filesystem turned it down
        self.nowait_misses = 0  # cached-only reads that found pages missing (went to a thread)
        self.max_verified = max_verified
        self.corrupt_reads = 0
        self.healed_reads = 0  # damaged on local disk, served from SHARED's copy
        # (segment, record position) of damaged records: found by replay, or by a read
        self.bad: set[tuple[int, int]] = set()
        self._prefetcher: ThreadPoolExecutor | None = None
        # records asked for ahead of sequential reads: local (readahead), remote (fetched),
        # remote fetches that failed (the read that wants the record fetches it again)
        self.ahead = {"local": 0, "remote": 0, "remote_failed": 0}

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True, cancel_futures=True)
            self._prefetcher = None
        self._fds.close()

    def forget(self, seg: int) -> None:
        """The local file of `seg` is going away (evicted): from now on its bytes come from
        the shared store and are verified there."""
        with self._lock:
            self.evicted.add(seg)
            for key in [k for k in self._verified if k[0] == seg]:
                del self._verified[key]
        self._fds.drop(seg)  # after `evicted` has it: no borrow opens it again

    def is_local(self, e: Extent) -> bool:
        return not e.seg & VSEG_BIT and e.seg not in self.evicted

    def _local(self, seg: int) -> AbstractContextManager[int | None]:
        """The open local segment file of `seg` for the length of a with block, or None if
        it is not on local disk."""
        def opener() -> int | None:
            if seg & VSEG_BIT or seg in self.evicted:
                return None
            try:
                return os.open(self.seg_path(seg), os.O_RDONLY)
            except FileNotFoundError:
                return None

        return self._fds.borrow(seg, opener)

    def _local_range(self, seg: int, length: int, offset: int, scratch: bool = False,
                     cached_only: bool = False) -> bytes | memoryview | None:
        """`length` bytes at `offset` of seg's local file, into the trio thread's scratch
        buffer if `scratch` (no allocation and no page faults per request; valid until the
        next such read, enough for a read answered inline: pyfuse3 replies before another
        request runs); None if the segment is not on local disk. `cached_only`: from the
        page cache only, else _NotCached (the caller retries on a thread)."""
        with self._local(seg) as fd:
            if fd is None:
                if cached_only:
                    raise _NotCached  # the shared store, then: not on the trio thread
                return None
            if scratch or cached_only:
                view = self._scratch_view(length) if scratch else memoryview(bytearray(length))
                return view[:self._preadv(fd, view, offset, cached_only)]
            return os.pread(fd, length, offset)

    def _preadv(self, fd: int, view: memoryview, offset: int, cached_only: bool) -> int:
        """preadv into `view`; with `cached_only`, all of it from the page cache or
        _NotCached (a short read is a miss too: the rest is not cached)."""
        if not (cached_only and self._nowait):
            return os.preadv(fd, [view], offset)
        try:
            n = os.preadv(fd, [view], offset, self._nowait)
        except BlockingIOError:
            n = -1
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            log.info("the local filesystem cannot read without waiting (%s): local reads "
                     "block the request thread", e)
            self._nowait = 0
            return os.preadv(fd, [view], offset)
        if n < len(view):
            self.nowait_misses += 1  # the trio thread's alone: no lock
            raise _NotCached
        return n

    def _pread(self, seg: int, length: int, offset: int, cached_only: bool = False) -> bytes:
        data = self._local_range(seg, length, offset, cached_only=cached_only)
        if data is not None:
            return data
        if self.remote is None:
            raise FsError(errno.EIO, f"segment {fmt.segment_name(seg)} is not on local disk")
        node, sid = self.objrefs[seg] if seg & VSEG_BIT else (self.node, seg)
        try:
            if seg in self.cold_segs and self.cold is not None:
                data = self.cold.read_range(node, sid, offset, length)
            else:
                try:
                    data = self.remote.read_range(node, sid, offset, length)
                except (OSError, SharedError):
                    # moved to its node's cold tier since we learned where it was?
                    alt = self.cold_by_node.get(node)
                    if alt is None:
                        raise
                    data = alt.read_range(node, sid, offset, length)
        except SharedError as e:
            raise FsError(errno.EIO, str(e)) from None
        except OSError as e:
            log.error("reading %s/%s from the shared store failed: %s", node,
                      fmt.segment_name(sid), e)
            raise FsError(errno.EIO, str(e)) from None
        return data

    def _pread_scratch(self, seg: int, length: int, offset: int,
                       cached_only: bool = False) -> bytes | memoryview:
        """Like _pread, but a local read lands in the scratch buffer (_local_range)."""
        data = self._local_range(seg, length, offset, True, cached_only)
        return data if data is not None else self._pread(seg, length, offset)

    def _scratch_view(self, n: int) -> memoryview:
        if len(self._scratch) < n:  # replaced, never resized: a view of the old one may live on
            self._scratch = bytearray(max(n, 2 * len(self._scratch)))
        return memoryview(self._scratch)[:n]

    def read_ahead(self, extents: list[Extent], local: tuple[int, int],
                 remote: tuple[int, int]) -> None:
        """Start reading records ahead of the reads that will want them, without waiting:
        those of extents in the file range `local` that are on local disk into the page cache
        (readahead), those of extents in the range `remote` that are on the shared store
        into the remote cache, fetched on the prefetch threads (an error there is left to
        the read itself)."""
        spans: list[list[int]] = []  # [seg, start, end]: adjacent records asked for at once
        for e in extents:
            if self.is_local(e):
                if e.end <= local[0] or e.start >= local[1]:
                    continue
                a, b = e.rec_pos, e.rec_pos + fmt.record_size(e.rec_len)
                if spans and spans[-1][0] == e.seg and spans[-1][1] <= a <= spans[-1][2]:
                    spans[-1][2] = max(spans[-1][2], b)
                else:
                    spans.append([e.seg, a, b])
            elif self.remote is not None and remote[0] < e.end and e.start < remote[1]:
                with self._lock:
                    if (e.seg, e.rec_pos) in self._remote_cache or any(
                            s == e.seg and a <= e.rec_pos < b for s, a, b in self._inflight):
                        continue
                    if self._prefetcher is None:
                        self._prefetcher = ThreadPoolExecutor(
                            getattr(self.remote, "fetches_ahead", PREFETCH_THREADS),
                            "ckptfs-prefetch")
                self._prefetcher.submit(self._prefetch_remote, e)
        if not hasattr(os, "posix_fadvise"):
            return
        for seg, a, b in spans:
            with self._local(seg) as fd:
                if fd is not None:
                    os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_WILLNEED)
                    self.ahead["local"] += 1

    def _prefetch_remote(self, e: Extent) -> None:
        try:
            ok = self._remote_record(e, report=False) is not None  # damaged: the read says so
        except Exception as err:
            log.debug("fetching ahead %s failed: %s", e, err)
            ok = False
        with self._lock:
            self.ahead["remote" if ok else "remote_failed"] += 1

    def read_extent(self, e: Extent, rel: int, n: int, cached_only: bool = False,
                    scratch: bool = False) -> bytes | memoryview:
        """n bytes starting `rel` bytes into extent e.

        A local record is verified the first time it is read and then served by range from
        the page cache. A record on the shared store is fetched whole and verified on every
        fetch (nothing vouches for bytes that come over the network twice); the last few
        fetched records are kept in memory so neighbouring reads do not fetch them again.
        """
        key = (e.seg, e.rec_pos)
        start = HDR + e.skip + rel
        if self.is_local(e):
            with self._lock:
                known = key in self._verified
                if known:
                    self._verified.move_to_end(key)
            pread = self._pread_scratch if scratch else self._pread
            if known:  # verified before: read just the range, from this local file only
                data = self._local_range(e.seg, n, e.rec_pos + start, scratch, cached_only)
                if data is not None and len(data) == n:
                    return data
                if data is None and not self.is_local(e):
                    # evicted since we looked: from the store then, verified there (a
                    # verification of the local copy vouches for nothing else)
                    rec = self._remote_record(e, cached_only)
                    assert rec is not None
                    return rec[start:start + n]
        else:
            rec = self._remote_record(e, cached_only)
            assert rec is not None  # report=True raises instead
            return rec[start:start + n]
        whole = pread(e.seg, HDR + e.rec_len, e.rec_pos, cached_only)
        if not fmt.verify_data_record(whole, e.rec_len):
            healed = self._published_copy(e, cached_only)
            if healed is None:
                self._corrupt(e)
            return healed[start:start + n]
        self._remember(e, whole)
        return memoryview(whole)[start:start + n]

    def shared_copy(self, e: Extent) -> memoryview | None:
        """(Blocking) the record of this node's extent `e` from its segment's object on SHARED
        if it is there and verifies, whatever the segment's state says (a full replay calls
        every segment SEALED until the drain finds its object); else None."""
        if e.seg & VSEG_BIT or self.remote is None:
            return None
        try:
            data = self.remote.read_range(self.node, e.seg, e.rec_pos, HDR + e.rec_len)
        except (OSError, SharedError):  # not published (yet), or on the cold tier
            return None
        return memoryview(data) if fmt.verify_data_record(data, e.rec_len) else None

    def _published_copy(self, e: Extent, cached_only: bool) -> memoryview | None:
        """A record damaged on local disk, from this node's object on SHARED if it was
        published before the damage (verified there); None if it is not there, or damaged
        there too. Read again each time (the local copy stays damaged; a rewrite of the
        file, or the segment's eviction, ends it)."""
        if e.seg & VSEG_BIT or self.remote is None:
            return None
        if cached_only:
            raise _NotCached  # the shared store: not on the trio thread
        data = self.shared_copy(e)
        if data is None:
            return None
        with self._lock:
            self.healed_reads += 1
        log.warning("segment %s record at offset %d is damaged on local disk: served from "
                    "the shared store's copy", fmt.segment_name(e.seg), e.rec_pos)
        return data

    def _corrupt(self, e: Extent) -> None:
        with self._lock:
            self.corrupt_reads += 1
            self.bad.add((e.seg, e.rec_pos))
        name = (f"{self.objrefs[e.seg][0]}/{fmt.segment_name(self.objrefs[e.seg][1])}"
                if e.seg & VSEG_BIT and e.seg in self.objrefs else fmt.segment_name(e.seg))
        where = f"segment {name} record at offset {e.rec_pos}"
        log.error("checksum mismatch reading %s: returning EIO", where)
        raise CorruptData(where)

    def _remote_record(self, e: Extent, cached_only: bool = False,
                       report: bool = True) -> memoryview | None:
        """The whole verified record of a remote extent: from the cache, from a window being
        fetched by another thread, or from a window fetched now."""
        key = (e.seg, e.rec_pos)
        need = HDR + e.rec_len
        waited = False
        while True:
            with self._lock:
                whole = self._remote_cache.get(key)
                if whole is not None:
                    self._remote_cache.move_to_end(key)
                    return whole
                if cached_only:
                    raise _NotCached
                pending = None
                if not waited:  # once only: that window may have failed or been evicted
                    for (seg, a, b), ev in self._inflight.items():
                        # a window stops before a big record: only its own fetch brings it
                        if (seg == e.seg and a <= e.rec_pos and e.rec_pos + need <= b
                                and (a == e.rec_pos or need < REMOTE_ALONE)):
                            pending = ev
                            break
                if pending is None:
                    size = need if need >= REMOTE_ALONE else REMOTE_WINDOW
                    span = (e.seg, e.rec_pos, e.rec_pos + size)
                    # the same fetch started since by a reader that waited with us: a new
                    # one, so wait for it too (never replace its entry: its waiters would
                    # never be woken)
                    pending = self._inflight.get(span)
                    if pending is None:
                        done = self._inflight[span] = threading.Event()
                        head = self._partial.pop(key, None)
                        if head is not None:
                            self._partial_bytes -= len(head)
            if pending is None:
                break
            pending.wait()
            waited = True
        try:
            whole = self._fetch_window(e, span[2] - span[1], head)
            if whole is None and head is not None:  # the head may be what is wrong
                whole = self._fetch_window(e, span[2] - span[1])
        finally:
            try:
                with self._lock:
                    if self._inflight.get(span) is done:
                        del self._inflight[span]
            finally:
                done.set()
        if whole is None and report:
            self._corrupt(e)
        return whole

    def _fetch_window(self, e: Extent, length: int,
                      head: memoryview | None = None) -> memoryview | None:
        """Read e's record and, if `length` is more than that, the small records after it, up
        to `length` bytes of e's object from e's record on (`head`, if given, holds the first
        bytes of e's record already: then the record alone); cache every whole data record
        that verifies, and the head of a small data record the window ends inside; return e's
        record (None if it does not verify)."""
        need = HDR + e.rec_len
        window = length > need  # a small record: the small ones after it too
        # a window reads the whole of itself at once where the last window of this segment
        # found small records all the way (small files restored in order: one request each)
        n = need if not window else length if self._small_runs.get(e.seg) else min(
            length, fmt.record_size(e.rec_len) + min(WINDOW_PEEK, max(4096, 4 * need)))
        at = 0 if head is None else len(head)
        data = memoryview(self._pread(e.seg, n - at, e.rec_pos + at))
        if head is not None:
            data = memoryview(b"".join((head, data)))
        if window:
            more = _small_run_goes_on(data, fmt.record_size(e.rec_len))
            if more and len(data) == n < length:
                rest = self._pread(e.seg, length - n, e.rec_pos + n)
                data = memoryview(b"".join((data, rest)))
                more = _small_run_goes_on(data, fmt.record_size(e.rec_len))
            if len(self._small_runs) >= 4096:
                self._small_runs.clear()
            self._small_runs[e.seg] = more
        first = None
        p = 0
        while p + HDR <= len(data):
            h = fmt.decode_header(data[p:p + HDR])
            if h is None:
                break  # the seal table or the footer: no more records
            rtype, rlen = h[0], h[1]
            end = p + HDR + rlen
            if p == 0 and (rlen != e.rec_len or rtype not in fmt.DATA_TYPES):
                break
            if end > len(data):
                if rtype in fmt.DATA_TYPES and 0 < p and HDR + rlen < REMOTE_ALONE:
                    # a copy: a view would pin the window (a big record's head is not kept:
                    # its own fetch, which reads it whole, may be under way already)
                    self._keep_partial((e.seg, e.rec_pos + p), memoryview(bytes(data[p:])))
                break
            if p == 0 or rtype in fmt.DATA_TYPES:
                whole = data[p:end]
                if not fmt.verify_record(whole):
                    break  # never step over a damaged header: its length may be wrong too
                if 2 * len(whole) < len(data):
                    # a copy: a view of a small record would keep the whole window alive while
                    # the cache counts only the record (a reader of the small records between
                    # big ones would pin a window each, unbounded by REMOTE_CACHE_BYTES)
                    whole = memoryview(bytes(whole))
                if p == 0:
                    first = whole
                self._cache_remote((e.seg, e.rec_pos + p), whole)
            p += fmt.record_size(rlen)
        return first

    def _cache_remote(self, key: tuple[int, int], whole: memoryview) -> None:
        with self._lock:
            if key in self._remote_cache:
                return
            self._remote_cache[key] = whole
            self._remote_bytes += len(whole)
            while self._remote_bytes > REMOTE_CACHE_BYTES:
                _k, old = self._remote_cache.popitem(last=False)
                self._remote_bytes -= len(old)

    def _keep_partial(self, key: tuple[int, int], head: memoryview) -> None:
        with self._lock:
            if key in self._partial or key in self._remote_cache:
                return
            self._partial[key] = head
            self._partial_bytes += len(head)
            while self._partial_bytes > PARTIAL_BYTES:
                _k, old = self._partial.popitem(last=False)
                self._partial_bytes -= len(old)

    def _remember(self, e: Extent, whole: bytes | memoryview) -> None:
        """A local record just verified: remember that, not its bytes (bounded LRU)."""
        key = (e.seg, e.rec_pos)
        with self._lock:
            self._verified[key] = None
            if len(self._verified) > self.max_verified:
                self._verified.popitem(last=False)

    def read(self, extents: list[Extent], off: int, size: int, file_size: int,
             cached_only: bool = False, scratch: bool = False) -> bytes | bytearray | memoryview:
        """The bytes of [off, off+size) clipped to file_size. scratch=True (the trio thread
        answering inline only) may return a view of a buffer the next such call reuses."""
        end = min(off + size, file_size)
        if off >= end:
            return b""
        pieces = [(max(e.start, off), min(e.end, end), e) for e in extents]
        pieces = [p for p in pieces if p[0] < p[1]]
        if len(pieces) == 1 and pieces[0][0] == off and pieces[0][1] == end:
            s, t, e = pieces[0]
            return self.read_extent(e, s - e.start, t - s, cached_only, scratch)
        self._fetch_runs([e for _s, _t, e in pieces if self.is_local(e)], cached_only)
        if scratch:
            return self._assemble(pieces, off, end, cached_only)
        at = off
        for s, t, _e in pieces:
            if s != at:
                break
            at = t
        if at == end:  # no holes: one copy of the pieces, no zero-fill
            return b"".join([self.read_extent(e, s - e.start, t - s, cached_only)
                             for s, t, e in pieces])
        buf = bytearray(end - off)  # holes read as zeros
        for s, t, e in pieces:
            buf[s - off:t - off] = self.read_extent(e, s - e.start, t - s, cached_only)
        return buf

    def read_cached(self, extents: list[Extent], off: int, size: int,
                    file_size: int) -> bytes | bytearray | memoryview | None:
        """`read` if it needs no device and no network, else None: every remote record it
        needs is in memory already (a window fetched for a neighbour brought it in) and every
        local byte in the page cache. The trio thread answers such a read inline and hands
        the others to a worker thread, so a disk read never holds up other requests. Like
        read(scratch=True), the result may be a view of the reused scratch buffer."""
        try:
            return self.read(extents, off, size, file_size, cached_only=True, scratch=True)
        except _NotCached:
            return None

    def _assemble(self, pieces: list[tuple[int, int, Extent]], off: int, end: int,
                  cached_only: bool) -> memoryview:
        """A read of several extents, built in the scratch buffer: verified local pieces are
        read straight into place, others copied in, holes zeroed; nothing allocated."""
        out = self._scratch_view(end - off)
        at = off
        for s, t, e in pieces:
            if s > at:
                out[at - off:s - off] = bytes(s - at)
            dst = out[s - off:t - off]
            done = False
            if self.is_local(e):
                with self._lock:
                    known = (e.seg, e.rec_pos) in self._verified
                if known:
                    pos = e.rec_pos + HDR + e.skip + (s - e.start)
                    with self._local(e.seg) as fd:
                        done = (fd is not None
                                and self._preadv(fd, dst, pos, cached_only) == t - s)
            if not done:
                dst[:] = self.read_extent(e, s - e.start, t - s, cached_only)
            at = t
        if at < end:
            out[at - off:] = bytes(end - at)
        return out

    def _fetch_runs(self, extents: list[Extent], cached_only: bool = False) -> None:
        """Local records that are adjacent in one segment (a file written sequentially in small
        writes) and not verified yet are read with one read instead of one per record,
        verified one by one and marked, so read_extent serves them by range."""
        todo = []
        with self._lock:
            for e in extents:
                if (e.seg, e.rec_pos) not in self._verified:
                    todo.append(e)
        todo.sort(key=lambda e: (e.seg, e.rec_pos))
        i = 0
        while i < len(todo):
            run = [todo[i]]
            while i + len(run) < len(todo):
                nxt, last = todo[i + len(run)], run[-1]
                if nxt.seg != last.seg or nxt.rec_pos != last.rec_pos + fmt.record_size(
                        last.rec_len) or nxt.rec_pos + HDR + nxt.rec_len - run[0].rec_pos > \
                        MAX_RUN:
                    break
                run.append(nxt)
            i += len(run)
            if len(run) < 2:
                continue  # read_extent does single records
            first, last = run[0], run[-1]
            blob = memoryview(self._pread(first.seg, last.rec_pos + HDR + last.rec_len
                                          - first.rec_pos, first.rec_pos, cached_only))
            for e in run:
                rel = e.rec_pos - first.rec_pos
                whole = blob[rel:rel + HDR + e.rec_len]
                if len(whole) != HDR + e.rec_len or not fmt.verify_data_record(whole, e.rec_len):
                    continue  # read_extent reads it again alone and reports it
                self._remember(e, whole)
