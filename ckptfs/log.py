"""The segment log on NVMe: append records, group-commit fsyncs, seal full or idle segments.

Appends are synchronous writes on the trio thread: once a record is in the kernel (its page
cache, or on the device) it survives a SIGKILL of the daemon, which is the first half of the
promise. fsync() is the second half: `sync()` makes every record appended so far durable with
one fdatasync per segment touched, shared by every caller waiting at the same time (group commit).

Data records of a request that can wait for its reply go through the page cache too, written
by the trio thread (~0.2 ms a MiB), with their writeback started every few MiB so that an
fsync() finds little left to write (BUFFERED). While the machine's writeback backlog shows the
disk is behind, and with CKPTFS_BUFFERED_WRITES=0 always, big ones (DIRECT_MIN and up) are
queued for a writer thread instead, which writes them with O_DIRECT, starting and ending on a
4 KiB boundary (PAD records fill the gaps; docs/format.md): the payload's block-aligned middle
goes to the device straight from the request's `bytes`; only its ends, the header and the PADs
are copied, into a reused aligned staging buffer (the record is placed so that its payload has
the same offset within a device block in the file as in memory). Filesystems that refuse
O_DIRECT (tmpfs, some network filesystems) get buffered appends only.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import logging
import mmap
import os
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import trio

from ckptfs import knobs, layout
from ckptfs import segment as fmt
from ckptfs.segment import Record, RecType

log = logging.getLogger(__name__)

GROUP_YIELDS = knobs.number("CKPTFS_GROUP_YIELDS", 2, "yields")
RATE_WINDOW = 0.5
# WRITE/RELOC payloads this big go to the disk with O_DIRECT (0 = never)
DIRECT_MIN = knobs.number("CKPTFS_DIRECT_MIN", 128 << 10, "bytes")
ALIGN = 4096  # file offsets, lengths and buffer addresses of direct writes
# the daemon lets data records complete on the writer thread (0: the trio thread writes them)
PIPELINE = os.environ.get("CKPTFS_PIPELINE", "1") != "0"
PIPELINE_DEPTH = 8  # data records queued for the writer thread at most
# a data record queued for the writer thread takes the sequence number this far above the one
# before it: the numbers between are for creates written ahead of it (SegmentLog.ahead)
SEQ_ROOM = 64
# Room for creates' records, left unwritten in front of each direct data write queued for
# the writer thread (SegmentLog._into_slot); the writer fills one no create took with a PAD
# (CKPTFS_CREATE_SLOTS=0: none)
SLOT = ALIGN
CREATE_SLOTS = os.environ.get("CKPTFS_CREATE_SLOTS", "1") != "0"
# a slot is free, holds creates' records (and a PAD after them), holds what the writer wrote
# into it (a PAD, after riders' records if any), or is broken after its records (a failed write
# there: the write behind it fails too)
SLOT_FREE, SLOT_TAKEN, SLOT_PADDED, SLOT_BROKEN = 0, 1, 2, 3
# A small data record that arrives while data writes are queued rides in the slot of the first
# one not written yet: the writer thread writes it there with that write (SegmentLog._ride),
# rather than queueing it behind every queued write (CKPTFS_RIDERS=0: it queues)
RIDERS = os.environ.get("CKPTFS_RIDERS", "1") != "0"
# a data record smaller than this, with nothing queued, is written by the trio thread itself
# (as DIRECT_MIN: every record that goes through the page cache)
QUEUE_MIN = knobs.number("CKPTFS_QUEUE_MIN", 128 << 10, "bytes")
# Big data records of a request that can wait, with nothing queued, are written by the trio
# thread through the page cache (a buffered `pwritev`, ~0.2 ms a MiB) rather than handed to
# the writer thread for an O_DIRECT write (~0.7-1 ms a MiB, one at a time, holding ext4's
# inode lock, which every create and small append then waits for). A storm of 10,000 files
# from 8 ranks saved in 8.6-9.2 s this way against 11.3-14.0 s (architecture.md section 2).
# CKPTFS_BUFFERED_WRITES=0: they always go to the writer thread.
BUFFERED = os.environ.get("CKPTFS_BUFFERED_WRITES", "1") != "0"
KICK = 8 << 20  # bytes appended after which their writeback is started (_kick)
# no such record for DIRECT_PAUSE seconds once the machine's dirty pages and pages being
# written out pass this (looked at every KICK bytes): the disk is behind, and the kernel
# would make the trio thread wait for it, every request with it; the writer thread's direct
# writes wait instead
WRITEBACK_BACKLOG = knobs.number("CKPTFS_WRITEBACK_BACKLOG", 256 << 20, "bytes")
DIRECT_PAUSE = 0.1

_DIRECT_TYPES = frozenset({RecType.WRITE, RecType.RELOC})
# data records that may wait for the writer thread (append(later=...)): a REF (a write whose
# bytes an earlier record holds) is as small as a rider, and would otherwise wait for the queue
_LATER_TYPES = _DIRECT_TYPES | {RecType.REF}
# a direct record's payload this big is written from where it lies in memory, not copied
# (CKPTFS_ZERO_COPY=0: always copied into the staging buffer)
ZERO_COPY_MIN = 64 << 10 if os.environ.get("CKPTFS_ZERO_COPY", "1") != "0" else 0
_STAGE_TAIL = 3 * ALIGN  # where a zero-copy record's end is staged (its start goes below)


def _writeback_backlog() -> int:
    """Bytes of dirty pages and pages being written out, the whole machine's (0 unknown)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            info = f.read()
    except OSError:
        return 0
    total = 0
    for line in info.splitlines():
        if line.startswith((b"Dirty:", b"Writeback:")):
            total += int(line.split()[1]) << 10
    return total


def _bytes_data_offset() -> int | None:
    """How far past id(b) a bytes object's data starts (CPython: the object's address and
    header), checked against ctypes' view of it; None where that does not hold."""
    try:
        offset = sys.getsizeof(b"") - 1
        for b in (b"ckptfs" * 3, bytes(1000)):
            if ctypes.cast(ctypes.c_char_p(b), ctypes.c_void_p).value != id(b) + offset:
                return None
        return offset
    except (TypeError, ValueError):
        return None


_BYTES_DATA = _bytes_data_offset()


def _dio_unit(path: str) -> int:
    """The alignment an O_DIRECT write to the filesystem holding `path` needs of each piece's
    address and length: the larger of the device's logical block size and DMA alignment, from
    /sys/dev/block (512 for most disks). ALIGN, which every device accepts, where that cannot
    be read (a partition's queue is its disk's; a filesystem without a block device of its
    own has none)."""
    try:
        st_dev = os.stat(path).st_dev
        dev = f"/sys/dev/block/{os.major(st_dev)}:{os.minor(st_dev)}"
        queue = os.path.join(dev, "queue")
        if not os.path.isdir(queue):
            queue = os.path.join(dev, "..", "queue")
        with open(os.path.join(queue, "logical_block_size")) as f:
            block = int(f.read())
        with open(os.path.join(queue, "dma_alignment")) as f:
            dma = int(f.read()) + 1
    except (OSError, ValueError):
        return ALIGN
    unit = max(block, dma, 512)
    return unit if unit <= ALIGN and unit & (unit - 1) == 0 else ALIGN


class Cancelled(OSError):
    """An earlier queued write failed, so this one was not attempted."""


class LogWrite:
    """One write of the log queued for the writer thread: a data record (direct, from a
    staging buffer, or buffered) or a PAD. See SegmentLog.append(later=...).

    `done` is set by the writer thread under `written`, a condition shared by the log's
    writes (not a threading.Event each: creating one cost 4% of the trio thread's time in a
    save of big shards, py-spy)."""

    __slots__ = ("rtype", "ino", "offset", "time_ns", "seq", "payload_len", "head", "pos",
                 "size", "lead", "trail", "bufs", "nbytes", "fd", "later", "stage", "done",
                 "started", "written", "event", "token", "error", "retry", "slot", "slot_fd",
                 "slot_state", "slot_used", "slot_seq", "riders", "owner", "payload")

    def __init__(self, fd: int, pos: int, bufs: list, nbytes: int,
                 token: trio.lowlevel.TrioToken, written: threading.Condition):
        self.fd, self.pos, self.bufs, self.nbytes, self.token = fd, pos, bufs, nbytes, token
        self.written = written
        self.rtype = RecType.PAD
        self.ino = self.offset = self.time_ns = self.seq = self.payload_len = 0
        self.head = b""
        self.size = nbytes
        self.lead = self.trail = 0  # PAD bytes before and after a direct record, in the write
        self.later: Callable[[int, Record], None] | None = None
        self.stage = -1  # staging buffer in use, or -1
        self.started = False  # the writer thread took it (its place is fixed from then on)
        self.done = False  # the writer thread finished with it (either way)
        self.event = trio.Event()  # the same, for trio tasks
        self.error: OSError | None = None
        self.retry = False  # not written: append it again (O_DIRECT refused, or cancelled)
        # SLOT bytes in front of it left for a create's record (-1: none), through which
        # buffered descriptor, and who took them (the trio thread or the writer, under _gate)
        self.slot = -1
        self.slot_fd = -1
        self.slot_state = SLOT_FREE
        # bytes of the records the trio thread wrote into it (creates', and riders' they took
        # along; a PAD fills the rest)
        self.slot_used = 0
        self.slot_seq = 0  # the highest sequence number of a record placed in it
        # small data records that ride in the slot, after the creates' records: the writer
        # thread writes them there once it has written this write (SegmentLog._ride)
        self.riders: list[LogWrite] = []
        self.owner: LogWrite | None = None  # a rider's: the write whose slot it rides in
        self.payload: bytes | memoryview = b""  # a REF's, which applying it needs

    @property
    def slot_ride(self) -> int:
        """Bytes of the slot its riders take, after the creates' records."""
        return sum(r.nbytes for r in self.riders)

    @property
    def zero_copy(self) -> bool:
        """A direct write that reads the payload where it lies (a staged one is one buffer)."""
        return self.stage >= 0 and len(self.bufs) > 1

    async def wait(self) -> None:
        if self.done:
            return
        if trio.lowlevel.current_trio_token() is self.token:
            await self.event.wait()
        else:  # queued under another trio run, which the writer thread wakes: not this one
            await trio.to_thread.run_sync(self.wait_sync)

    def wait_sync(self) -> None:
        """Block until the writer thread finished with it."""
        if not self.done:
            with self.written:
                self.written.wait_for(lambda: self.done)


@dataclass
class LogStats:
    records: int = 0
    bytes_appended: int = 0
    data_bytes: int = 0
    flushes: int = 0
    sync_calls: int = 0
    direct_records: int = 0  # records written around the page cache
    zero_copy_records: int = 0  # of those, written from the payload's own memory
    pad_bytes: int = 0  # PAD records that align them
    records_ahead: int = 0  # creates written ahead of queued data writes (SegmentLog.ahead)
    records_in_slots: int = 0  # of those, into the slot in front of one (SegmentLog._into_slot)
    records_riding: int = 0  # small data records written in such a slot (SegmentLog._ride)
    records_buffered: int = 0  # big data records the trio thread wrote buffered (BUFFERED)
    # every reason ns.seal() is given, so that each is reported from the start
    seals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("size", "idle", "wait", "space", "recovery", "tier", "shutdown"), 0))


class SegmentLog:
    def __init__(self, seg_dir: str, node_id: str, segment_size: int, dir_id: int = 0):
        self.dir = seg_dir
        self.node_id = node_id
        self.dir_id = dir_id  # written into segment headers (format.md section 1.1)
        self.segment_size = segment_size
        layout.makedirs_durable(seg_dir)
        self.dir_fd = os.open(seg_dir, os.O_RDONLY | os.O_DIRECTORY)
        self.seg_id = 0  # active segment, 0 = none open
        self.fd = -1
        self.dfd = -1  # O_DIRECT descriptor of the active segment (-1: none / not supported)
        self.direct_min = DIRECT_MIN
        self.zero_copy_min = ZERO_COPY_MIN if _BYTES_DATA is not None else 0
        # what the device asks of a direct write's memory and of its pieces' lengths
        self.dio_unit = _dio_unit(seg_dir)
        # aligned staging buffers for direct records, one per queued record at most
        self._stages: list[tuple[mmap.mmap, memoryview] | None] = [None] * (PIPELINE_DEPTH + 1)
        self._free_stages = list(range(PIPELINE_DEPTH + 1))
        # set by the daemon inside trio: data records may then be written by the writer
        # thread, in order, while the trio thread serves other requests (append(later=...))
        self.token: trio.lowlevel.TrioToken | None = None
        self.queued: collections.deque[LogWrite] = collections.deque()
        # requests in unqueue(): while any waits, data writes wait in room() (trio thread)
        self._holders = 0
        self._hold: trio.Event | None = None
        self.submitted: LogWrite | None = None  # the data record the last append queued
        self._halt = False  # a queued write failed: the writer skips the rest (Cancelled)
        self._jobs: queue.SimpleQueue[LogWrite | None] = queue.SimpleQueue()
        self._written = threading.Condition(threading.Lock())  # a LogWrite is done
        # requests in ahead(): while any waits, the writer thread starts no queued write
        self._pausers = 0
        self._paused = False
        self._gate = threading.Condition(threading.Lock())
        self._last_seq = 0  # seq of the last record placed in the log, queued ones aside
        self._kick_from = 0  # where the active segment's unstarted writeback begins (_kick)
        self._direct_until = 0.0  # (monotonic) no BUFFERED big record before then (_kick)
        self._writer: threading.Thread | None = None
        self.tail = 0
        self.seq = 0
        self.id_floor = 0  # segment ids at or below this are taken (on the shared store)
        self.rows = bytearray()  # SEAL table rows of the active segment
        self.last_append = 0.0
        self.recent_rate = 0.0  # bytes/s appended over the last full window
        self._win_start = 0.0
        self._win_bytes = 0
        self.stats = LogStats()
        # group commit: (seg, pos) made durable so far
        self.synced: tuple[int, int] = (0, 0)
        self._unsynced: list[int] = []  # sealed segments' fds awaiting fdatasync
        self._dir_dirty = False
        self._flush_lock = trio.Lock()
        self.on_seal = None  # callback(seg_id, size, reason), set by the owner
        # a flush (fdatasync/fsync) failed: see _broke(). Set once, never cleared while mounted
        self.broken: OSError | None = None

    # --- segment files ------------------------------------------------------------------

    def path(self, seg_id: int) -> str:
        return os.path.join(self.dir, fmt.segment_name(seg_id))

    def existing(self) -> list[int]:
        out = []
        for n in os.listdir(self.dir):
            if n.endswith(".seg") and len(n) == 20:
                try:
                    out.append(int(n[:16], 16))
                except ValueError:
                    pass
        return sorted(out)

    def _open_new(self) -> None:
        ids = self.existing()
        seg_id = max([self.seg_id, self.id_floor, *ids]) + 1
        path = self.path(seg_id)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        head = fmt.segment_header(seg_id, self.node_id, time.time_ns(), self.dir_id)
        try:
            if os.pwrite(fd, head, 0) != len(head):
                raise OSError(errno.ENOSPC, "short write of a segment header")
        except BaseException:
            # a full disk: no headerless file for the next append to write records into
            # (replay would skip all of it); the next append tries a new file again
            os.close(fd)
            try:
                os.unlink(path)
            except OSError:
                pass
            raise
        self.fd, self.seg_id = fd, seg_id
        self.tail = self._kick_from = fmt.SEGMENT_HEADER_SIZE
        self._open_direct(path)
        self.rows = bytearray()
        self._dir_dirty = True  # the new name must reach the disk before an fsync returns

    def _open_direct(self, path: str) -> None:
        if self.direct_min <= 0 or not hasattr(os, "O_DIRECT"):
            return
        try:
            self.dfd = os.open(path, os.O_WRONLY | os.O_DIRECT)
        except OSError as e:
            self._no_direct(f"cannot open {path} with O_DIRECT: {e.strerror}")

    def _no_direct(self, why: str) -> None:
        log.info("log appends stay in the page cache: %s", why)
        self.direct_min = 0
        self._close_direct()

    def _close_direct(self) -> None:
        if self.dfd >= 0:
            os.close(self.dfd)
            self.dfd = -1

    def close(self) -> None:
        self.join()
        if self._writer is not None:
            self._jobs.put(None)
            self._writer.join()
            self._writer = None
        self._close_direct()
        try:
            for fd in self._unsynced:
                os.fdatasync(fd)
            if self.fd >= 0:
                os.fdatasync(self.fd)
            os.fsync(self.dir_fd)
        except OSError as e:
            self._broke(e)  # the owner does not commit the index then
        for fd in self._unsynced:
            os.close(fd)
        self._unsynced.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        os.close(self.dir_fd)

    # --- a failed flush -------------------------------------------------------------------

    def _broke(self, e: OSError) -> None:
        """A flush of the log failed. After a failed fdatasync the kernel may have dropped
        the pages it could not write (ext4 marks them clean), and the next fdatasync of the
        same file reports success: acknowledged records could be gone while a later fsync()
        says all is well ("fsyncgate"). So the log stops: every later append and fsync fails
        with EIO, the index is no longer committed, and the next mount replays what
        actually reached the disk. Reads go on."""
        if self.broken is None:
            log.error("the log on NVMe failed to flush (%s): it takes no more writes; unmount "
                      "and mount again once the disk is sound (the mount replays what reached "
                      "it)", e)
            self.broken = e

    def _check(self) -> None:
        if self.broken is not None:
            raise OSError(errno.EIO, f"the log on NVMe failed to flush earlier "
                                     f"({self.broken.strerror or self.broken}); no more writes "
                                     f"until ckptfs is mounted again")

    # --- appending ------------------------------------------------------------------------

    def append(self, rtype: int, ino: int, offset: int, payload: bytes | memoryview = b"",
               time_ns: int | None = None,
               later: Callable[[int, Record], None] | None = None) -> tuple[int, Record] | None:
        """Append one record; returns (segment id, record) for the index to apply.

        `later` is for data records (WRITE) of a request that can wait for its reply: once the
        daemon set `token`, such a record is queued for the writer thread, which writes the
        log's queued records one after the other, in log order, while the trio thread serves
        other requests. append then returns None, `submitted` is the queued write, and
        `later(segment id, record)` runs once it is written: from join() or settle(), in log
        order. Every other append joins first (waits for the queue to be written and applies
        it), so records reach the index in log order, a record is never written behind one
        that is not, and a failed write leaves nothing after it (the queue behind it is
        cancelled and the tail goes back to where it started)."""
        self._check()
        now = time.time_ns() if time_ns is None else time_ns
        n = len(payload)
        size = fmt.record_size(n)
        self.submitted = None
        # through the page cache, by this thread (BUFFERED); never past queued writes, which
        # would leave it acknowledged behind records not written yet
        buffered = (later is not None and rtype in _LATER_TYPES and not self.queued
                    and self.token is not None and BUFFERED
                    and (n < QUEUE_MIN or time.monotonic() >= self._direct_until))
        if (RIDERS and later is not None and self.token is not None
                and rtype in _LATER_TYPES and self.queued and size < SLOT):
            rider = self._ride(rtype, ino, offset, now, payload, size, later)
            if rider is not None:
                self.submitted = rider
                return None
        if (later is not None and self.token is not None and rtype in _LATER_TYPES
                and (self.queued or n >= QUEUE_MIN) and not buffered and self._fits_queue(size)):
            while self._queue_full(n):
                self._finish(self.queued[0])  # the oldest: usually written already
            # finishing applied records, which may have sealed the segment (or taken back a
            # failed write): look again
            if not self._halt and self._fits_queue(size):
                self._queue_record(rtype, ino, offset, now, payload, size, later)
                return None
        if rtype == RecType.CREATE and later is None and self.queued:
            res = self._into_slot(ino, offset, now, payload, size)
            if res is None and self._paused:
                res = self._ahead(ino, offset, now, payload, size)
            if res is not None:
                return res
        self.join()
        if self.fd < 0:
            self._open_new()
        self.seq += 1
        placed = None
        if self.dfd >= 0 and n >= self.direct_min and rtype in _DIRECT_TYPES and not buffered:
            placed = self._append_direct(rtype, ino, offset, now, payload, size)
        if placed is None:
            parts = fmt.encode_record(rtype, ino, offset, now, self.seq, payload)
            placed = (parts[0], self.tail)
            self._pwritev(parts, size)
            if buffered:
                self._kick(n)
        head, pos = placed
        return self.seg_id, self._appended(rtype, ino, offset, now, self.seq, payload, n, head,
                                           pos, size)

    def _kick(self, n: int) -> None:
        """After a data record went through the page cache on the trio thread: every KICK
        bytes appended, the kernel is asked to start writing them out now
        (`POSIX_FADV_DONTNEED` starts the writeback of a range's dirty pages without waiting
        for it), and the machine's writeback backlog is looked at. Left to the kernel's own
        flushing, a long write piled up dirty pages until it throttled the trio thread, and
        every request with it; and an fsync() then had all of them to write."""
        if n >= QUEUE_MIN:  # (one the writer thread would have written with O_DIRECT)
            self.stats.records_buffered += 1
        if self.tail - self._kick_from < KICK:
            return
        try:
            os.posix_fadvise(self.fd, self._kick_from, self.tail - self._kick_from,
                             os.POSIX_FADV_DONTNEED)
        except OSError:
            pass  # (only advice: the next flush writes them in any case)
        self._kick_from = self.tail
        if _writeback_backlog() > WRITEBACK_BACKLOG:
            # the disk is behind: a buffered write could wait for it on the trio thread (the
            # kernel throttles whoever dirties pages), holding every request up; the writer
            # thread's direct writes take over for a while
            self._direct_until = time.monotonic() + DIRECT_PAUSE

    def _appended(self, rtype: int, ino: int, offset: int, now: int, seq: int,
                  payload: bytes | memoryview, length: int, head: bytes, pos: int,
                  size: int) -> Record:
        """Bookkeeping of a record that is in the segment file now."""
        csum = fmt.CSUM.unpack_from(head, fmt.RECORD_HEADER.size)[0]
        rec = Record(rtype, ino, offset, now, seq, payload, pos, length, csum)
        self._last_seq = seq
        if rtype != RecType.SEAL:
            self.rows += fmt.seal_row(rec)
        self.last_append = time.monotonic()
        st = self.stats
        st.records += 1
        st.bytes_appended += size
        now_m = self.last_append
        if now_m - self._win_start >= RATE_WINDOW:
            self.recent_rate = self._win_bytes / max(now_m - self._win_start, RATE_WINDOW)
            self._win_start, self._win_bytes = now_m, 0
        self._win_bytes += size
        if rtype == RecType.WRITE:
            st.data_bytes += length
        return rec

    def _pwritev(self, parts: list, size: int) -> None:
        """Buffered append at the tail."""
        try:
            n = os.pwritev(self.fd, parts, self.tail)
        except OSError:
            self._cut()
            raise
        if n != size:  # ENOSPC mid-record: leave the tail where it was, never a torn record
            self._cut()
            raise OSError(errno.ENOSPC, "short write to the log")
        self.tail += size

    def _cut(self) -> None:
        """After a failed or short write: drop whatever part of it reached the file past the
        tail. Left there, it would sit after the footer once the segment is sealed (the
        object's size would not be the segment's), or be taken by replay for records."""
        try:
            os.ftruncate(self.fd, self.tail)
        except OSError as e:  # the next append overwrites it anyway; sealing cuts again
            log.warning("cannot cut the log back to %d after a failed write: %s", self.tail, e)

    def _pad(self, gap: int) -> None:
        """A buffered PAD record filling `gap` bytes (>= a record header) from the tail."""
        self._pwritev([fmt.pad_header(gap), fmt.pad_body(gap)], gap)
        self.stats.pad_bytes += gap

    def _stage(self, k: int, rtype: int, ino: int, offset: int, now: int,
               payload: bytes | memoryview, size: int) -> tuple[bytes, int, int, list, int]:
        """Prepare a direct write of one record at the tail (on an ALIGN boundary) using
        staging buffer k: (header, PAD bytes before the record, PAD bytes after it, the
        buffers to write, their length).

        The write starts on a boundary (a PAD before it fills the gap from the last buffered
        record) and a PAD after the record, in the same write, runs to the next boundary, so
        no direct write shares a page with buffered records: the kernel has no cached page to
        write back or invalidate first, and the next buffered append starts a fresh page.

        A big `bytes` payload is not copied: a PAD at the start of the write (`lead`) places
        the record so that the payload's offset within a block (`dio_unit`) of the file is its
        address's within a block of memory. Its block-aligned middle is then written from
        where it lies, and only the header and its first and last few bytes are staged (a PAD,
        the header and the head of the payload; the tail of the payload and the PAD after
        it). Anything else (a memoryview, a small payload) is copied whole into the staging
        buffer.
        """
        head = fmt.encode_header(rtype, ino, offset, now, self.seq, payload)
        n = len(payload)
        h = fmt.RECORD_HEADER_SIZE
        addr = (id(payload) + _BYTES_DATA if type(payload) is bytes
                and n >= self.zero_copy_min > 0 else -1)
        if addr < 0 or addr % 8:  # (records start 8-aligned, as the payload must then)
            trail = fmt.pad_gap(size, ALIGN)
            total = size + trail
            stage = self._staging(k, total)
            stage[:h] = head
            stage[h:h + n] = payload
            stage[h + n:size] = fmt.ZEROS[:size - h - n]
            if trail:
                self._stage_pad(stage, size, trail)
            return head, 0, trail, [stage[:total]], total
        unit = self.dio_unit
        lead = fmt.pad_gap(h - addr, unit)  # the tail is aligned: payload at addr mod unit
        before = -addr % unit  # payload bytes before its first aligned address
        middle = (n - before) // unit * unit
        after = n - before - middle
        trail = fmt.pad_gap(lead + size, ALIGN)
        stage = self._staging(k, _STAGE_TAIL + ALIGN + size - n + trail)
        if lead:
            self._stage_pad(stage, 0, lead)
        first = lead + h + before  # a multiple of unit
        stage[lead:lead + h] = head
        stage[lead + h:first] = payload[:before]
        end = _STAGE_TAIL + after + (size - h - n)
        stage[_STAGE_TAIL:_STAGE_TAIL + after] = payload[n - after:]
        stage[_STAGE_TAIL + after:end] = fmt.ZEROS[:size - h - n]
        if trail:
            self._stage_pad(stage, end, trail)
        bufs = [stage[:first], memoryview(payload)[before:before + middle]]
        if end + trail > _STAGE_TAIL:
            bufs.append(stage[_STAGE_TAIL:end + trail])
        return head, lead, trail, bufs, lead + size + trail

    def _staging(self, k: int, total: int) -> memoryview:
        """Staging buffer k, at least `total` bytes long."""
        slot = self._stages[k]
        if slot is None or len(slot[0]) < total:
            if slot is not None:
                slot[1].release()
                slot[0].close()
            buf = mmap.mmap(-1, max(total, (1 << 20) + 2 * ALIGN))
            slot = self._stages[k] = (buf, memoryview(buf))
        return slot[1]

    @staticmethod
    def _stage_pad(stage: memoryview, at: int, gap: int) -> None:
        h = fmt.RECORD_HEADER_SIZE
        stage[at:at + h] = fmt.pad_header(gap)
        stage[at + h:at + gap] = fmt.pad_body(gap)

    def _append_direct(self, rtype: int, ino: int, offset: int, now: int,
                       payload: bytes | memoryview, size: int) -> tuple[bytes, int] | None:
        """Write one record with O_DIRECT, waiting for the device: (header, position), or
        None if it must go the buffered way after all (nothing of it was written then)."""
        gap = fmt.pad_gap(self.tail, ALIGN)
        if gap:
            self._pad(gap)
        head, lead, trail, bufs, nbytes = self._stage(0, rtype, ino, offset, now, payload, size)
        try:
            done = os.pwritev(self.dfd, bufs, self.tail)
        except OSError as e:
            if e.errno != errno.EINVAL:
                self._cut()
                raise
            self._refused(len(bufs) > 1, e)
            return None
        if done != nbytes:
            self._cut()
            raise OSError(errno.ENOSPC, "short write to the log")
        pos = self.tail + lead
        self.tail += nbytes
        self.stats.direct_records += 1
        self.stats.zero_copy_records += len(bufs) > 1
        self.stats.pad_bytes += lead + trail
        return head, pos

    def _refused(self, zero_copy: bool, e: OSError) -> None:
        """A direct write was refused (EINVAL). One from the payload's own memory: such
        writes stop and staged ones go on (the device wants more alignment than /sys/dev/block
        said, or something between it and the filesystem does); a staged one: direct writes
        stop."""
        if zero_copy and self.zero_copy_min:
            log.info("log appends copy every payload: an O_DIRECT write from its memory was "
                     "refused (%s)", e.strerror)
            self.zero_copy_min = 0
        else:
            self._no_direct(f"O_DIRECT write refused: {e.strerror}")

    # --- the writer thread ----------------------------------------------------------------

    def _fits_queue(self, size: int) -> bool:
        """A record of `size` bytes may be queued: a segment is open and has room for it with
        its PADs (the queue never crosses a segment's end)."""
        return self.fd >= 0 and self.tail + SLOT + size + 4 * ALIGN < self.segment_size

    def _queue_full(self, n: int) -> bool:
        """Queueing a record of n payload bytes must wait for the oldest queued write: the
        queue is at its depth, or the record would go the direct way and every staging buffer
        is in use (PADs and small buffered records count toward the depth but hold none, so
        the depth alone does not bound the buffers)."""
        if not self.queued:
            return False
        return (len(self.queued) >= PIPELINE_DEPTH
                or (not self._free_stages and self.dfd >= 0 and n >= self.direct_min))

    def _queue_record(self, rtype: int, ino: int, offset: int, now: int,
                      payload: bytes | memoryview, size: int,
                      later: Callable[[int, Record], None]) -> None:
        """Queue a data record at the tail for the writer thread (a PAD before it if it goes
        the direct way); the tail moves past it now."""
        assert self.token is not None
        n = len(payload)
        direct = self.dfd >= 0 and n >= self.direct_min
        slot = -1  # room for a create in front of it (and of its PAD), _into_slot
        if direct:
            if CREATE_SLOTS:
                slot = self.tail
                self.tail += SLOT
            gap = fmt.pad_gap(self.tail, ALIGN)
            if gap:
                pad = LogWrite(self.fd, self.tail, [fmt.pad_header(gap), fmt.pad_body(gap)],
                               gap, self.token, self._written)
                self._enqueue(pad)
        # room below its number for records written ahead of it (ahead())
        self.seq += SEQ_ROOM
        if direct:
            k = self._free_stages.pop()
            head, lead, trail, bufs, nbytes = self._stage(k, rtype, ino, offset, now, payload,
                                                          size)
            job = LogWrite(self.dfd, self.tail, bufs, nbytes, self.token, self._written)
            job.stage, job.lead, job.trail = k, lead, trail
        else:
            parts = fmt.encode_record(rtype, ino, offset, now, self.seq, payload)
            head = parts[0]
            job = LogWrite(self.fd, self.tail, parts, size, self.token, self._written)
        job.rtype, job.ino, job.offset, job.time_ns, job.seq = rtype, ino, offset, now, self.seq
        job.payload_len, job.head, job.size, job.later = n, head, size, later
        if rtype == RecType.REF:
            job.payload = payload
        if slot >= 0:
            job.slot, job.slot_fd = slot, self.fd
        self._enqueue(job)
        self.submitted = job

    def _enqueue(self, job: LogWrite) -> None:
        self.tail += job.nbytes
        self.queued.append(job)
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_jobs, name="ckptfs-log-writer",
                                            daemon=True)
            self._writer.start()
        self._jobs.put(job)

    def _write_jobs(self) -> None:
        """The writer thread: the queued writes one at a time, in order; after a failure the
        rest of the queue is cancelled (never written) until the trio thread has seen it."""
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._gate:
                while self._paused:
                    self._gate.wait()
                job.started = True
            if self._halt:
                job.error = Cancelled(errno.ECANCELED, "an earlier log write failed")
            else:
                try:
                    if os.pwritev(job.fd, job.bufs, job.pos) != job.nbytes:
                        job.error = OSError(errno.ENOSPC, "short write to the log")
                    if job.slot >= 0 and job.error is None:
                        self._fill_slot(job)
                except OSError as e:
                    job.error = e
                except Exception as e:  # a fault here: fail the write, never hang its waiter
                    log.exception("the log's writer thread failed")
                    job.error = OSError(errno.EIO, f"the log's writer thread failed: {e!r}")
                if job.error is not None:
                    self._halt = True
            with self._written:
                job.done = True
                self._written.notify_all()
            try:
                job.token.run_sync_soon(job.event.set)
            except trio.RunFinishedError:
                pass  # nobody waits in trio any more; _finish() uses `done`

    def _fill_slot(self, job: LogWrite) -> None:
        """The writer thread, once `job` is written: its riders' records into the slot in
        front of it, after the creates' records there, and a PAD to the slot's end; or only
        the PAD if no create took the slot and no record rides in it. Before `job` is done,
        so before anything after it is applied or acknowledged: a hole in the log ends it
        for replay."""
        with self._gate:
            if job.slot_state == SLOT_TAKEN and not job.riders:
                return
            if job.slot_state not in (SLOT_FREE, SLOT_TAKEN):
                return
            job.slot_state = SLOT_PADDED  # (no rider or create can join from here on)
            riders = list(job.riders)
            used = job.slot_used
        parts: list = [b for r in riders for b in r.bufs]
        gap = SLOT - used - sum(r.nbytes for r in riders)
        if gap:
            parts += [fmt.pad_header(gap), fmt.pad_body(gap)]
        if os.pwritev(job.slot_fd, parts, job.slot + used) != SLOT - used:
            raise OSError(errno.ENOSPC, "short write to the log")

    def _finish(self, upto: LogWrite) -> None:
        """Account and apply the queued writes up to `upto` in log order, waiting (blocking)
        for those not written yet. After a failed write, the rest of the queue is taken
        back: the tail returns to where the failed write started (nothing after it was
        written), and each of those records is marked for a retry by its writer."""
        while self.queued:
            job = self.queued[0]
            if not job.done:
                self._resume()  # (a pause of ahead() must not hold this thread up)
                job.wait_sync()
            self.queued.popleft()
            if job.stage >= 0:
                self._free_stages.append(job.stage)
            if job.error is not None:
                self._fail_queue(job)
                return
            if job.slot_state == SLOT_PADDED:  # (creates counted the PAD they left)
                self.stats.pad_bytes += -job.slot_ride if job.slot_used else SLOT - job.slot_ride
            # its riders, in front of it in the log, then it: every row first (a rider's
            # `later` may seal the segment, whose table must have this write's row too)
            riders, job.riders = job.riders, []  # (no cycle keeps the payload alive)
            seg = self.seg_id
            done = [(r, self._rider_row(r)) for r in riders]
            rec = None
            if job.rtype == RecType.PAD:
                self.stats.pad_bytes += job.nbytes
            else:
                if job.stage >= 0:
                    self.stats.direct_records += 1
                    self.stats.zero_copy_records += job.zero_copy
                    self.stats.pad_bytes += job.lead + job.trail
                rec = self._appended(job.rtype, job.ino, job.offset, job.time_ns, job.seq,
                                     job.payload, job.payload_len, job.head, job.pos + job.lead,
                                     job.size)
            for r, rrec in done:
                assert r.later is not None
                r.later(seg, rrec)
            if rec is not None:
                assert job.later is not None
                job.later(seg, rec)
            if job is upto:
                return

    def _fail_queue(self, failed: LogWrite) -> None:
        """`failed` (already off the queue) did not make it to the disk."""
        err = failed.error
        assert err is not None
        self._resume()  # the writer cancels the rest of the queue
        if err.errno == errno.EINVAL and failed.stage >= 0:
            self._refused(failed.zero_copy, err)
            failed.retry = True
        # A PAD has no request of its own to fail: its error is the record's it was queued
        # for (right behind it). Appended again instead, that record would queue behind a new
        # PAD at the same tail, which could fail the same way without end.
        owner = self.queued[0] if failed.rtype == RecType.PAD and self.queued else None
        # (riders of these writes are not done: their requests append them again, settle())
        failed.riders = []
        for job in self.queued:  # cancelled behind it: never written
            job.riders = []
            job.wait_sync()
            if job.stage >= 0:
                self._free_stages.append(job.stage)
            if job is owner and not failed.retry:
                job.error = OSError(err.errno, err.strerror)
            else:
                job.retry = True
        self.queued.clear()
        # back to where the failed write started, or, unless the slot in front of it is whole
        # with creates' records, to the end of those in it (a PAD the writer wrote into it
        # does not count: the write it was for failed)
        slotted = failed if failed.slot >= 0 else owner  # (a PAD is behind its record's slot)
        self.tail = (slotted.slot + slotted.slot_used if slotted is not None
                     and slotted.slot >= 0 and slotted.slot_state != SLOT_TAKEN
                     and slotted.slot < failed.pos else failed.pos)
        self._cut()  # the failed write may have written part of itself
        self._halt = False

    def join(self) -> None:
        """Finish every queued write (see _finish)."""
        if self.queued:
            self._finish(self.queued[-1])

    # --- creates ahead of queued data writes -------------------------------------------

    def _pause(self) -> None:
        with self._gate:
            self._paused = True

    def _resume(self) -> None:
        if self._paused:
            with self._gate:
                self._paused = False
                self._gate.notify_all()

    @contextlib.asynccontextmanager
    async def ahead(self, need: int = 512) -> AsyncIterator[None]:
        """Around a request that appends a CREATE record (create, mkdir, mknod, symlink).

        The kernel sends a create under its directory's exclusive lock, so every other create
        in that directory waits for this one's reply (bench/README.md, 2026-12-07,
        afternoon). Its record need not wait for the data writes queued before it: it goes
        into the slot in front of the first one not written yet, if that has room for
        `need` bytes (_into_slot: no wait at all). Otherwise it waits only for the one the
        writer thread is writing: the writer starts no other write meanwhile, and append()
        writes the record where the first write it has not started was to go, moving those
        writes down the log (_ahead). Writes that arrive meanwhile wait in room(), as for
        unqueue(). Where the record cannot go ahead, append() waits for the queue as
        before."""
        if not self.queued or self._slot_free(need):
            yield  # (into a slot: append() waits for no whole write)
            return
        with self._holding():
            self._pausers += 1
            self._pause()
            try:
                for job in list(self.queued):
                    if not job.started:
                        break
                    await job.wait()
                yield
            finally:
                self._pausers -= 1
                if not self._pausers:
                    self._resume()

    def _ahead(self, ino: int, offset: int, now: int, payload: bytes | memoryview,
               size: int) -> tuple[int, Record] | None:
        """Write a CREATE record ahead of the queued writes the paused writer thread has not
        started: at the place the first of them had, followed by a PAD to a multiple of
        ALIGN, every one of them moving down the log by that much (so their direct writes
        stay aligned, and no direct write shares a page with this buffered one). Its
        sequence number is one more than that of the record before it, below theirs
        (SEQ_ROOM). A SIGKILL before they are written leaves it in the log, followed by
        the end of the log (replay stops at the first record that is not there, which is
        one of theirs, never acknowledged). None if it cannot go ahead: append() then waits
        for the queue. The records before it are applied first, so the index and the SEAL
        table still take records in log order."""
        started = [job for job in self.queued if job.started]
        if not all(job.done for job in started):
            return None  # (a pause broken meanwhile: the writer went on)
        if started:
            # written: apply them first (which may seal the segment, joining the queue)
            self._finish(started[-1])
        if not self._paused or not self.queued or self.fd < 0 or self.queued[0].started:
            return None
        res = self._into_slot(ino, offset, now, payload, size)
        if res is not None:
            return res
        first = self.queued[0]
        owner = self._slot_after(0)
        if owner is not None and owner.riders and owner.slot_state == SLOT_FREE:
            return None  # (in front of them, it would take a number below theirs)
        limit = next((job.seq for job in self.queued if job.rtype != RecType.PAD), 0)
        # (the queued record's number less SEQ_ROOM was the log's highest when it was queued;
        # a record after the slot's takes a number above theirs)
        seq = max(self._last_seq, limit - SEQ_ROOM,
                  owner.slot_seq if owner is not None else 0) + 1
        delta = -(-size // ALIGN) * ALIGN
        if 0 < delta - size < fmt.RECORD_HEADER_SIZE:
            delta += ALIGN
        if seq >= limit or self.tail + delta + 4 * ALIGN >= self.segment_size:
            return None
        parts = fmt.encode_record(RecType.CREATE, ino, offset, now, seq, payload)
        gap = delta - size
        if gap:
            parts += [fmt.pad_header(gap), fmt.pad_body(gap)]
        # where the first of them starts: the slot in front of it, if no create's record is
        # in it (the record did not fit in it), which moves down with it
        pos = (owner.slot if owner is not None and owner.slot_state == SLOT_FREE
               and not owner.slot_used and owner.slot < first.pos else first.pos)
        # (a slot with creates' records is whole, a PAD after them, in front of which riders
        # not written yet will go)
        # nothing is being written: the writer is paused before the first of these
        if os.pwritev(self.fd, parts, pos) != delta:
            # (a short write: the place is the first queued write's, which overwrites it)
            raise OSError(errno.ENOSPC, "short write to the log")
        with self._gate:
            for job in self.queued:
                job.pos += delta
                if job.slot >= 0 and job.slot_state == SLOT_FREE:
                    job.slot += delta
        self.tail += delta
        self.stats.pad_bytes += gap
        self.stats.records_ahead += 1
        return self.seg_id, self._appended(RecType.CREATE, ino, offset, now, seq, payload,
                                           len(payload), parts[0], pos, size)

    def _slot_after(self, k: int) -> LogWrite | None:
        """The write owning the slot that is next in the log after queued[k - 1]: queued[k]'s,
        or the record's behind it if queued[k] is the PAD that aligns that record."""
        q = self.queued
        if k < len(q) and q[k].slot < 0 and q[k].rtype == RecType.PAD:
            k += 1
        return q[k] if k < len(q) and q[k].slot >= 0 else None

    def _slot_free(self, need: int) -> bool:
        """A create's record of up to `need` bytes can go into the log now without waiting
        for a whole write (_into_slot): the queued writes are all written, or the first slot
        after those that are has room for it."""
        k = next((i for i, job in enumerate(self.queued) if not job.done), None)
        if k is None:
            return True
        job = self._slot_after(k)
        return job is not None and job.slot_state in (SLOT_FREE, SLOT_TAKEN) and (
            SLOT - job.slot_used - job.slot_ride >= need + fmt.RECORD_HEADER_SIZE)

    def _slot_for(self, size: int) -> tuple[LogWrite, int] | None:
        """The slot a record of `size` bytes can go into now (_into_slot, _ride), and the
        record's sequence number: the slot in front of the first queued write not written
        yet (the writes before it are applied first, which may seal the segment or take
        back a failed write), unless the writer has filled it, the record and the PAD after
        it do not fit behind the slot's records, or no number is left between the slot's
        last record's and that write's (SEQ_ROOM)."""
        while self.queued and self.queued[0].done:
            self._finish(self.queued[0])
        if not self.queued or self.fd < 0:
            return None
        job = self._slot_after(0)
        if job is None or job.slot_state not in (SLOT_FREE, SLOT_TAKEN):
            return None
        gap = SLOT - job.slot_used - job.slot_ride - size
        if gap < 0 or 0 < gap < fmt.RECORD_HEADER_SIZE:
            return None
        limit = next((j.seq for j in self.queued if j.rtype != RecType.PAD), 0)
        seq = max(self._last_seq, limit - SEQ_ROOM, job.slot_seq) + 1
        return (job, seq) if seq < limit else None

    def _into_slot(self, ino: int, offset: int, now: int, payload: bytes | memoryview,
                   size: int) -> tuple[int, Record] | None:
        """Write a CREATE record into the slot in front of the first queued write not written
        yet, after the records already there, with a PAD to the slot's end (format.md
        section 1.6). Riders waiting there (_ride) go into the same write, in front of it,
        and are applied first: the writer would otherwise write them over it. The writer
        thread may be writing that write meanwhile: the create then waits only for the
        inode lock an extending O_DIRECT write holds. The writes before the slot are
        written: they are applied first, so the index and the SEAL table still take records
        in log order. Its sequence number is one more than the slot's last record's, below
        that write's (SEQ_ROOM). A SIGKILL leaves it in the log (it is
        in the page cache when the create returns), followed by that write or by the end of
        the log; if that write fails, the tail goes back to just after the slot's records
        (_fail_queue). None if there is no such slot, the writer has filled it, or the
        record does not fit in what is left of it: ahead() or the queue then."""
        found = self._slot_for(size) if CREATE_SLOTS else None
        if found is None:
            return None
        job, seq = found
        used = job.slot_used
        ride = job.slot_ride
        gap = SLOT - used - ride - size
        if job.riders and len(self.rows) + (len(job.riders) + 1) * fmt.SEAL_ROW.size >= (
                fmt.MAX_SEAL_ROWS * fmt.SEAL_ROW.size):
            return None  # (applying the riders must not seal the segment under the create)
        with self._gate:
            if job.slot_state not in (SLOT_FREE, SLOT_TAKEN):
                return None  # the writer has just written the PAD into it
            job.slot_state = SLOT_TAKEN
            riders, job.riders = job.riders, []  # this thread writes them now, not the writer
        job.slot_seq = seq
        # the riders' records and this one where the slot's PAD started, and a shorter PAD
        # after them (one write)
        cparts = fmt.encode_record(RecType.CREATE, ino, offset, now, seq, payload)
        parts = [b for r in riders for b in r.bufs] + cparts
        if gap:
            parts += [fmt.pad_header(gap), fmt.pad_body(gap)]
        at = job.slot + used
        try:
            if os.pwritev(self.fd, parts, at) != SLOT - used:
                raise OSError(errno.ENOSPC, "short write to the log")
        except OSError:
            self._unslot(job, riders)
            raise
        job.slot_used = used + ride + size
        self.stats.pad_bytes += gap - (SLOT - used if used else 0)
        self.stats.records_ahead += 1
        self.stats.records_in_slots += 1
        for r in riders:  # in front of it: applied first (the records before them are)
            rrec = self._rider_row(r)
            assert r.later is not None
            r.later(self.seg_id, rrec)
        return self.seg_id, self._appended(RecType.CREATE, ino, offset, now, seq, payload,
                                           len(payload), cparts[0], at + ride, size)

    def _unslot(self, job: LogWrite, riders: list[LogWrite]) -> None:
        """A create's record could not be written into `job`'s slot (a part of it may be
        there), nor the riders' it took along: what follows the records already in the
        slot must not stay broken in front of `job`. An empty slot the writer has not come
        to yet is left to it (it fills it with the riders' records and a PAD); otherwise
        this thread writes the riders' records and the PAD after the records in it (the
        writer may write the same riders' bytes there again: harmless), and if that fails
        too, `job` fails with the error (the tail goes back to just after those records,
        _fail_queue, and the riders are appended again)."""
        used = job.slot_used
        with self._gate:
            job.riders[:0] = riders  # back: _finish applies them (or settle() retries them)
            if not used and not job.started:
                job.slot_state = SLOT_FREE
                return
        gap = SLOT - used - sum(r.nbytes for r in riders)
        parts: list = [b for r in riders for b in r.bufs]
        if gap:
            parts += [fmt.pad_header(gap), fmt.pad_body(gap)]
        try:
            if os.pwritev(self.fd, parts, job.slot + used) != SLOT - used:
                raise OSError(errno.ENOSPC, "short write to the log")
        except OSError as e:
            with self._gate:  # (the writer never fills a broken slot, see _fill_slot)
                if job.error is None:
                    job.error = e
                job.slot_state = SLOT_BROKEN
            return
        if not used:
            job.slot_state = SLOT_PADDED

    def _ride(self, rtype: int, ino: int, offset: int, now: int, payload: bytes | memoryview,
              size: int, later: Callable[[int, Record], None]) -> LogWrite | None:
        """A small data record while data writes are queued: rather than queueing it behind
        all of them (its request would wait for every one), reserve its place in the slot in
        front of the first one not written yet, after the records there; the writer thread
        writes it there once it has written that write, before that write is done
        (_fill_slot), and _finish() applies it just before that write. Its request waits
        for that one write only. Its sequence number is one more than the slot's last
        record's, below that write's (SEQ_ROOM). None if there is no such slot, the writer
        has filled it already, or the record does not fit in what is left of it (the PAD
        after the slot's records must fit too): queued, then."""
        found = self._slot_for(size)
        if found is None:
            return None
        job, seq = found
        parts = fmt.encode_record(rtype, ino, offset, now, seq, payload)
        rider = LogWrite(job.slot_fd, job.slot + job.slot_used + job.slot_ride, parts, size,
                         job.token, self._written)
        rider.rtype, rider.ino, rider.offset, rider.time_ns, rider.seq = (rtype, ino, offset,
                                                                         now, seq)
        rider.payload_len, rider.head, rider.size, rider.later = len(payload), parts[0], size, later
        rider.owner = job
        if rtype == RecType.REF:
            rider.payload = payload
        with self._gate:
            if job.slot_state not in (SLOT_FREE, SLOT_TAKEN):
                return None  # the writer is filling it (or has)
            job.riders.append(rider)
        job.slot_seq = seq
        return rider

    def _rider_row(self, r: LogWrite) -> Record:
        """A rider's record is written (_fill_slot, or a create took it along): account it,
        in log order; its `later` applies it."""
        rec = self._appended(r.rtype, r.ino, r.offset, r.time_ns, r.seq, r.payload,
                             r.payload_len, r.head, r.pos, r.size)
        self.stats.records_riding += 1
        r.done = True
        return rec

    async def settle(self, job: LogWrite) -> bool:
        """For the request whose record is `job`: wait (serving other requests meanwhile)
        until it and everything queued before it are written and applied. True if it was not
        written and must be appended again (O_DIRECT refused, or an earlier write failed);
        raises its own write's error (ENOSPC, EIO), or that of the PAD queued for it. A rider
        (_ride) is written with the write in whose slot it rides, and applied just before
        it."""
        if job.owner is not None:
            if not job.done:
                try:
                    await self.settle(job.owner)
                except OSError:
                    pass  # that write's own failure
            # not applied: that write failed or was cancelled (the tail went back to where
            # the rider's record was to be, _fail_queue), so the rider is appended again
            return not job.done
        if job in self.queued:
            for earlier in list(self.queued):
                await earlier.wait()
                if earlier is job:
                    break
            if job in self.queued:
                self._finish(job)
        if job.retry:
            return True
        if job.error is not None:
            raise job.error
        return False

    async def join_async(self, rounds: int | None = None) -> None:
        """join(), waiting for the writer thread without blocking trio. With `rounds`: wait
        for what is queued now, then for what was queued meanwhile, `rounds` times at most,
        so that a stream of data writes cannot hold the caller forever; what is left is
        for the caller's join()."""
        n = 0
        while self.queued and (rounds is None or n < rounds):
            last = self.queued[-1]
            await last.wait()
            if last in self.queued:
                # (else another task applied it while we waited: _finish(last) would then
                # apply the writes queued since, blocking the trio thread on the writer)
                self._finish(last)
            n += 1

    async def unqueue(self) -> None:
        """Before a request appends a record that is not queued (a create, a rename, a
        setattr...): append() joins the queue first, which waits for the device on the trio
        thread and holds up every other request meanwhile (in a storm of creates and fsyncs
        from 8 processes, a fifth of the trio thread's time). Wait for the queue here, serving
        other requests; the join then finds little or nothing left to wait for."""
        if not self.queued:
            return
        # Data writes that arrive meanwhile wait (room()): they would queue behind us and
        # hold us up for another round, and the caller may be a create that the kernel
        # serves under its directory's lock, which every other create there waits for
        # (bench/README.md, 2026-12-07, afternoon). The caller appends right after this
        # returns, before those writers run again, so the log's order is theirs after it.
        with self._holding():
            await self.join_async(rounds=2)

    @contextlib.contextmanager
    def _holding(self) -> Iterator[None]:
        """While inside, data writes wait in room() (for unqueue() and ahead())."""
        if self._hold is None:
            self._hold = trio.Event()
        self._holders += 1
        try:
            yield
        finally:
            self._holders -= 1
            if not self._holders:
                self._hold.set()
                self._hold = None

    async def room(self, n: int) -> None:
        """Before a request appends a data record of n bytes that may be queued: wait while
        a request waits in unqueue(); with the queue full, append() waits for its oldest
        write on the trio thread. Wait for it here instead, serving other requests."""
        while self._hold is not None:
            await self._hold.wait()
        while self._queue_full(n):
            job = self.queued[0]
            await job.wait()
            if self.queued and self.queued[0] is job:
                self._finish(job)

    def write_rate(self) -> float:
        """Bytes/s appended recently (0 once writes stopped for a window). A burst shows at
        once: the window still filling counts its bytes as if it ended now (otherwise a save
        showed no rate for its first half second, in which a big save seals its first
        segments and the drain started uploading them; bench/README.md, 2026-12-08)."""
        now = time.monotonic()
        if now - self.last_append > 2 * RATE_WINDOW:
            return 0.0
        if now - self._win_start < RATE_WINDOW:
            return max(self.recent_rate, self._win_bytes / RATE_WINDOW)
        return self.recent_rate

    def unsynced_bytes(self) -> int:
        """Log bytes appended but not yet flushed to the device."""
        if self.fd < 0:
            return 0 if not self._unsynced else -1  # a sealed segment awaits its flush
        if self.synced[0] == self.seg_id:
            return self.tail - self.synced[1]
        return self.tail - fmt.SEGMENT_HEADER_SIZE

    def should_seal(self) -> bool:
        return self.fd >= 0 and (self.tail >= self.segment_size
                                 or len(self.rows) >= fmt.MAX_SEAL_ROWS * fmt.SEAL_ROW.size)

    def has_records(self) -> bool:
        return self.fd >= 0 and self.tail > fmt.SEGMENT_HEADER_SIZE

    def seal(self, reason: str) -> tuple[int, Record] | None:
        """Close the active segment with its record table; the next append opens a new one.

        The SEAL record is returned so the index can note the log position; the fdatasync of
        the sealed file happens at the next flush (seal is on the write path and must not
        block it on the disk).
        """
        self.join()
        if not self.has_records() or self.broken is not None:
            return None  # broken: the next mount seals it ("recovery")
        payload = bytes(self.rows)
        now = time.time_ns()
        self.seq += 1
        parts = fmt.encode_record(RecType.SEAL, 0, 0, now, self.seq, payload)
        rsize = fmt.record_size(len(payload))
        pos = self.tail
        foot = fmt.footer(pos, len(self.rows) // fmt.SEAL_ROW.size)
        # the SEAL record and the footer in one write: on a failure neither stays (records
        # appended after a SEAL would be past the end replay reads to)
        self._pwritev([*parts, foot], rsize + len(foot))
        rec = self._appended(RecType.SEAL, 0, 0, now, self.seq, payload, len(payload),
                             parts[0], pos, rsize)
        seg_id = self.seg_id
        size = self.tail
        self._unsynced.append(self.fd)
        self.fd = -1
        self._close_direct()
        self.rows = bytearray()
        self.stats.seals[reason] = self.stats.seals.get(reason, 0) + 1
        log.info("sealed segment %s (%d bytes, %s)", fmt.segment_name(seg_id), size, reason)
        if self.on_seal is not None:
            self.on_seal(seg_id, size, reason)
        return seg_id, rec

    # --- durability -----------------------------------------------------------------------

    async def sync(self) -> None:
        """Return once every record appended before the call is on stable storage."""
        self.stats.sync_calls += 1
        self._check()
        await self.join_async()  # records queued for the writer thread: the flush comes after
        goal = (self.seg_id, self.tail)
        if not self._unsynced and not self._dir_dirty and self.synced >= goal:
            return
        # group commit: let requests that are already in flight append before the device
        # flush starts, so one fdatasync covers them too
        for _ in range(GROUP_YIELDS):
            await trio.sleep(0)
        async with self._flush_lock:
            self._check()  # a flush failed while we waited for the lock
            if self.synced >= goal and not self._unsynced and not self._dir_dirty:
                return  # a flush that started after our append covered us
            await self._flush()

    async def _flush(self) -> None:
        await self.join_async()  # queued while we waited for the lock: flush after them too
        goal = (self.seg_id, self.tail)  # no await between the join and this
        sealed = list(self._unsynced)
        self._unsynced.clear()
        fd = self.fd
        dir_dirty = self._dir_dirty
        self._dir_dirty = False

        def work() -> None:
            for sfd in sealed:
                os.fdatasync(sfd)
            if fd >= 0:
                os.fdatasync(fd)
            if dir_dirty:
                os.fsync(self.dir_fd)

        try:
            await trio.to_thread.run_sync(work)
        except BaseException as e:
            self._unsynced[:0] = sealed
            self._dir_dirty = self._dir_dirty or dir_dirty
            if isinstance(e, OSError):
                self._broke(e)
                self._check()  # EIO with the reason, for this caller too
            raise
        for sfd in sealed:
            os.close(sfd)
        self.stats.flushes += 1
        if goal > self.synced:
            self.synced = goal

    def sync_now(self) -> None:
        """Synchronous flush of whatever sync() has not covered yet (usually very little)."""
        self._check()
        self.join()
        goal = (self.seg_id, self.tail)
        try:
            while self._unsynced:
                os.fdatasync(self._unsynced[0])
                os.close(self._unsynced.pop(0))
            if self.fd >= 0 and self.synced < goal:
                os.fdatasync(self.fd)
            if self._dir_dirty:
                os.fsync(self.dir_fd)
                self._dir_dirty = False
        except OSError as e:
            self._broke(e)
            self._check()
        self.synced = max(self.synced, goal)

    def recover_tail(self, seg_id: int, scan: fmt.ScanResult, rows: bytearray, seq: int) -> None:
        """After replay: close an unsealed newest segment so appends start on a clean file.

        The torn tail (if any) is cut off first, so garbage never sits between records.
        """
        path = self.path(seg_id)
        fd = os.open(path, os.O_RDWR)
        os.ftruncate(fd, scan.end)
        self.fd, self.seg_id, self.tail, self.rows = fd, seg_id, scan.end, rows
        self.seq = max(self.seq, seq)
        self.seal("recovery")
        # the sealed file is fdatasync'd by the first flush; do it now, we are starting up
        for sfd in self._unsynced:
            os.fdatasync(sfd)
            os.close(sfd)
        self._unsynced.clear()
        self.seg_id = seg_id
