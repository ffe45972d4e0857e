"""The segment log on NVMe: append records, group-commit fsyncs, seal full or idle segments.

Appends are synchronous writes on the trio thread: once a record is in the kernel (its page
cache, or on the device) it survives a SIGKILL of the daemon, which is the first half of the
promise. fsync() is the second half: `sync()` makes every record appended so far durable with
one fdatasync per segment touched, shared by every caller waiting at the same time (group commit).

Big data records (DIRECT_MIN and up) bypass the page cache: the record is assembled in one
reused, aligned staging buffer and written with O_DIRECT, starting and ending on a 4 KiB
boundary (PAD records fill the gaps; docs/format.md). Copying checkpoint bytes into fresh page
cache pages cost this one thread more CPU than everything else on the write path together, and
the fdatasync behind an fsync() then had nothing left to write back. Small records stay
buffered: an O_DIRECT write waits for the device, which a create or a 4 KiB append should not.
Filesystems that refuse O_DIRECT (tmpfs, some network filesystems) get buffered appends only.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import time
from dataclasses import dataclass, field

import trio

from ckptfs import segment as fmt
from ckptfs.segment import RecType, Record

log = logging.getLogger(__name__)

GROUP_YIELDS = int(os.environ.get("CKPTFS_GROUP_YIELDS", "2"))
RATE_WINDOW = 0.5
# WRITE/RELOC payloads this big go to the disk with O_DIRECT (0 = never)
DIRECT_MIN = int(os.environ.get("CKPTFS_DIRECT_MIN", str(128 << 10)))
ALIGN = 4096  # file offsets, lengths and buffer addresses of direct writes
_DIRECT_TYPES = frozenset({RecType.WRITE, RecType.RELOC})


@dataclass
class LogStats:
    records: int = 0
    bytes_appended: int = 0
    data_bytes: int = 0
    flushes: int = 0
    sync_calls: int = 0
    direct_records: int = 0  # records written around the page cache
    pad_bytes: int = 0  # PAD records that align them
    seals: dict[str, int] = field(default_factory=lambda: {"size": 0, "idle": 0, "wait": 0,
                                                            "recovery": 0, "shutdown": 0})


class SegmentLog:
    def __init__(self, seg_dir: str, node_id: str, segment_size: int):
        self.dir = seg_dir
        self.node_id = node_id
        self.segment_size = segment_size
        os.makedirs(seg_dir, exist_ok=True)
        self.dir_fd = os.open(seg_dir, os.O_RDONLY | os.O_DIRECTORY)
        self.seg_id = 0  # active segment, 0 = none open
        self.fd = -1
        self.dfd = -1  # O_DIRECT descriptor of the active segment (-1: none / not supported)
        self.direct_min = DIRECT_MIN
        self._stage: mmap.mmap | None = None  # aligned buffer for direct records
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
        self.seg_id = max([self.seg_id, self.id_floor, *ids]) + 1
        path = self.path(self.seg_id)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        os.pwrite(self.fd, fmt.segment_header(self.seg_id, self.node_id, time.time_ns()), 0)
        self.tail = fmt.SEGMENT_HEADER_SIZE
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
        self._close_direct()
        for fd in self._unsynced:
            os.fdatasync(fd)
            os.close(fd)
        self._unsynced.clear()
        if self.fd >= 0:
            os.fdatasync(self.fd)
            os.close(self.fd)
            self.fd = -1
        os.fsync(self.dir_fd)
        os.close(self.dir_fd)

    # --- appending ------------------------------------------------------------------------

    def append(self, rtype: int, ino: int, offset: int, payload: bytes | memoryview = b"",
               time_ns: int | None = None) -> tuple[int, Record]:
        """Append one record; returns (segment id, record) for the index to apply."""
        if self.fd < 0:
            self._open_new()
        now = time.time_ns() if time_ns is None else time_ns
        self.seq += 1
        size = fmt.record_size(len(payload))
        placed = None
        if self.dfd >= 0 and len(payload) >= self.direct_min and rtype in _DIRECT_TYPES:
            placed = self._append_direct(rtype, ino, offset, now, payload, size)
        if placed is None:
            parts = fmt.encode_record(rtype, ino, offset, now, self.seq, payload)
            placed = (parts[0], self.tail)
            self._pwritev(parts, size)
        head, pos = placed
        csum = fmt.CSUM.unpack_from(head, fmt.RECORD_HEADER.size)[0]
        rec = Record(rtype, ino, offset, now, self.seq, payload, pos, len(payload), csum)
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
            st.data_bytes += len(payload)
        return self.seg_id, rec

    def _pwritev(self, parts: list, size: int) -> None:
        """Buffered append at the tail."""
        n = os.pwritev(self.fd, parts, self.tail)
        if n != size:  # ENOSPC mid-record: leave the tail where it was, never a torn record
            raise OSError(errno.ENOSPC, "short write to the log")
        self.tail += size

    def _pad(self, gap: int) -> None:
        """A buffered PAD record filling `gap` bytes (>= a record header) from the tail."""
        body = fmt.pad_body(gap)
        self._pwritev(fmt.encode_record(RecType.PAD, 0, 0, 0, 0, body), gap)
        self.stats.pad_bytes += gap

    def _append_direct(self, rtype: int, ino: int, offset: int, now: int,
                       payload: bytes | memoryview, size: int) -> tuple[bytes, int] | None:
        """Write one record with O_DIRECT from the staging buffer: (header, position), or
        None if it must go the buffered way after all (nothing of it was written then).

        The record starts on an ALIGN boundary (a buffered PAD before it fills the gap from
        the tail) and a PAD after it, in the same write, runs to the next boundary, so no
        direct write shares a page with buffered records: the kernel has no cached page to
        write back or invalidate first, and the next buffered append starts a fresh page.
        """
        gap = fmt.pad_gap(self.tail, ALIGN)
        if gap:
            self._pad(gap)
        trail = fmt.pad_gap(self.tail + size, ALIGN)
        total = size + trail
        if self._stage is None or len(self._stage) < total:
            if self._stage is not None:
                self._stage.close()
            self._stage = mmap.mmap(-1, max(total, (1 << 20) + 2 * ALIGN))
        stage = self._stage
        head = fmt.encode_header(rtype, ino, offset, now, self.seq, payload)
        n = len(payload)
        stage[:fmt.RECORD_HEADER_SIZE] = head
        stage[fmt.RECORD_HEADER_SIZE:fmt.RECORD_HEADER_SIZE + n] = payload
        stage[fmt.RECORD_HEADER_SIZE + n:size] = fmt.ZEROS[:size - fmt.RECORD_HEADER_SIZE - n]
        if trail:
            body = fmt.pad_body(trail)
            stage[size:size + fmt.RECORD_HEADER_SIZE] = fmt.encode_header(
                RecType.PAD, 0, 0, 0, 0, body)
            stage[size + fmt.RECORD_HEADER_SIZE:total] = body
        with memoryview(stage) as mv:
            try:
                done = os.pwritev(self.dfd, [mv[:total]], self.tail)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._no_direct(f"O_DIRECT write refused: {e.strerror}")
                return None
        if done != total:
            raise OSError(errno.ENOSPC, "short write to the log")
        pos = self.tail
        self.tail += total
        self.stats.direct_records += 1
        self.stats.pad_bytes += trail
        return head, pos

    def write_rate(self) -> float:
        """Bytes/s appended recently (0 once writes stopped for a window)."""
        if time.monotonic() - self.last_append > 2 * RATE_WINDOW:
            return 0.0
        return self.recent_rate

    def unsynced_bytes(self) -> int:
        """Log bytes appended but not yet flushed to the device."""
        if self.fd < 0:
            return 0 if not self._unsynced else -1  # a sealed segment awaits its flush
        if self.synced[0] == self.seg_id:
            return self.tail - self.synced[1]
        return self.tail - fmt.SEGMENT_HEADER_SIZE

    def should_seal(self) -> bool:
        return self.fd >= 0 and self.tail >= self.segment_size

    def has_records(self) -> bool:
        return self.fd >= 0 and self.tail > fmt.SEGMENT_HEADER_SIZE

    def seal(self, reason: str) -> tuple[int, Record] | None:
        """Close the active segment with its record table; the next append opens a new one.

        The SEAL record is returned so the index can note the log position; the fdatasync of
        the sealed file happens at the next flush (seal is on the write path and must not
        block it on the disk).
        """
        if not self.has_records():
            return None
        seg_id, rec = self.append(RecType.SEAL, 0, 0, bytes(self.rows))
        foot = fmt.footer(rec.pos, len(self.rows) // fmt.SEAL_ROW.size)
        os.pwrite(self.fd, foot, self.tail)
        self.tail += len(foot)
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
        goal = (self.seg_id, self.tail)
        if not self._unsynced and not self._dir_dirty and self.synced >= goal:
            return
        # group commit: let requests that are already in flight append before the device
        # flush starts, so one fdatasync covers them too
        for _ in range(GROUP_YIELDS):
            await trio.sleep(0)
        async with self._flush_lock:
            if self.synced >= goal and not self._unsynced and not self._dir_dirty:
                return  # a flush that started after our append covered us
            await self._flush()

    async def _flush(self) -> None:
        goal = (self.seg_id, self.tail)
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
        except BaseException:
            self._unsynced[:0] = sealed
            self._dir_dirty = self._dir_dirty or dir_dirty
            raise
        for sfd in sealed:
            os.close(sfd)
        self.stats.flushes += 1
        if goal > self.synced:
            self.synced = goal

    def sync_now(self) -> None:
        """Synchronous flush of whatever sync() has not covered yet (usually very little)."""
        goal = (self.seg_id, self.tail)
        for sfd in self._unsynced:
            os.fdatasync(sfd)
            os.close(sfd)
        self._unsynced.clear()
        if self.fd >= 0 and self.synced < goal:
            os.fdatasync(self.fd)
        if self._dir_dirty:
            os.fsync(self.dir_fd)
            self._dir_dirty = False
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
