"""Record and segment format: the one place that defines the bytes of the log.

A segment file is a 64-byte header followed by records. Every record is a fixed 56-byte header,
then a payload, padded to a multiple of 8 bytes:

    magic u32 | type u8 | flags u8 | reserved u16 | length u32 (payload bytes, unpadded) |
    reserved u32 | ino u64 | offset u64 | time_ns i64 | seq u64 | csum u64

`csum` is xxh3_64 over the first 48 header bytes followed by the payload. A sealed segment ends
with a SEAL record whose payload is a table of every record in the segment (so the segment is
self-describing: a reader can verify and index it without scanning), followed by a 32-byte
footer. The published object on the shared store is the sealed segment file byte for byte.

A torn record at the tail of the newest segment is the end of the log; a bad checksum anywhere
else is corruption (`CorruptRecord`, naming segment and offset). docs/format.md is the prose
version of this module.
"""

from __future__ import annotations

import bisect
import functools
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterator

import xxhash

SEGMENT_MAGIC = b"CKPTSEG1"
SEGMENT_VERSION = 2  # 2: may contain PAD records (version 1 segments are read as before)
READABLE_VERSIONS = (1, 2)
# magic, version u32, reserved u32, segment id u64, created time_ns i64, node id (16 bytes,
# NUL padded), header csum u64 (xxh3_64 of the preceding 48 bytes), reserved 8 bytes.
SEGMENT_HEADER = struct.Struct("<8sIIQq16sQ8x")
SEGMENT_HEADER_SIZE = SEGMENT_HEADER.size  # 64
assert SEGMENT_HEADER_SIZE == 64

RECORD_MAGIC = 0x31524B43  # b"CKR1" little-endian
RECORD_HEADER = struct.Struct("<IBBHIIQQqQ")  # without the trailing csum
RECORD_HEADER_SIZE = RECORD_HEADER.size + 8  # 56
assert RECORD_HEADER_SIZE == 56
CSUM = struct.Struct("<Q")
MAX_PAYLOAD = 16 << 20  # a sanity bound for readers; writers never exceed ~1 MiB + names
# A segment is sealed once it holds this many records, whatever its size, so that its SEAL
# record stays under MAX_PAYLOAD (14 MiB of rows) and the active segment's rows in memory
# stay small. Segments written before this bound may hold a bigger SEAL record: a scan
# takes a SEAL record of any length that fits in its file.
MAX_SEAL_ROWS = 1 << 18
# No write reaches past the kernel's largest file offset (MAX_LFS_FILESIZE): a data record
# header that says otherwise is damaged, and is never applied
MAX_FILE_SIZE = (1 << 63) - 1

# Footer of a sealed segment: magic, offset of the SEAL record, record count, footer csum.
FOOTER_MAGIC = b"CKPTEND1"
FOOTER = struct.Struct("<8sQQQ")
FOOTER_SIZE = FOOTER.size  # 32


class RecType:
    WRITE = 1  # ino, offset; payload = data
    CREATE = 2  # new inode + directory entry; payload = CreateBody + name (+ symlink target)
    UNLINK = 3  # ino = parent; payload = name (file or empty dir; rmdir is UNLINK of a dir)
    RENAME = 4  # payload = RenameBody + old name + new name
    SETATTR = 5  # ino; payload = SetattrBody (mask says which fields)
    SEAL = 6  # payload = table of the segment's records
    PURGE = 7  # ino: an unlinked inode's last reference went away; its data is dead
    XATTR = 8  # ino; payload = name len u16, flag u8 (0 = remove), name, value
    IMPORT = 9  # ino; payload = JSON: a file's content as ranges of published objects
    RELOC = 10  # like WRITE, but moves data (compaction): changes no times, same bytes
    REF = 11  # ino, offset; payload = REF_BODY: data identical to an earlier WRITE record's
    TIER = 12  # payload = JSON {"seg": id, "tier": "cold"}: a published segment moved tiers
    LINK = 13  # ino: a new directory entry for an existing file (hard link); payload = LinkBody
    PAD = 14  # payload = zeros: fills the log up to a 4 KiB boundary around direct writes;
    #           readers skip it; ino, offset, time and seq are 0; never in a SEAL table
    GONE = 15  # payload = JSON {"path", "node", "mtime_ns", "size", "dir"}: another node's
    #            entry was deleted or renamed away here (a tombstone this node publishes),
    #            or {"path", "node", "drop": 1}: that tombstone is done with
    WAITED = 16  # ino = a directory; payload empty: `ckptfs wait` for it began at time_ns, so
    #              all this node wrote under it before then is in this or earlier records


    NAMES = {1: "WRITE", 2: "CREATE", 3: "UNLINK", 4: "RENAME", 5: "SETATTR", 6: "SEAL",
             7: "PURGE", 8: "XATTR", 9: "IMPORT", 10: "RELOC", 11: "REF", 12: "TIER",
             13: "LINK", 14: "PAD", 15: "GONE", 16: "WAITED"}


DATA_TYPES = frozenset({RecType.WRITE, RecType.RELOC})


# CREATE: parent u64, mode u32, uid u32, gid u32, rdev u32, name_len u16, target_len u16,
#         then name, then symlink target. (ino and time_ns are in the record header.)
CREATE_BODY = struct.Struct("<QIIIIHH")
# RENAME: old parent u64, new parent u64, flags u32, old name len u16, new name len u16
RENAME_BODY = struct.Struct("<QQIHH")
# REF: segment id u64, record position u64, length u32 (the whole payload of that record)
REF_BODY = struct.Struct("<QQI")
# SETATTR: mask u32, mode u32, uid u32, gid u32, size u64, atime_ns i64, mtime_ns i64, ctime i64
SETATTR_BODY = struct.Struct("<IIIIQqqq")
SET_MODE, SET_UID, SET_GID, SET_SIZE, SET_ATIME, SET_MTIME, SET_CTIME = (1, 2, 4, 8, 16, 32, 64)
# One row of the SEAL table: record offset u64, type u8, pad, length u32, ino u64, file offset u64,
# time_ns i64, seq u64, csum u64.
SEAL_ROW = struct.Struct("<QB3xIQQqQQ")


class CorruptRecord(Exception):
    """A record failed its checksum or is malformed somewhere other than the log's tail."""

    def __init__(self, path: str, offset: int, why: str):
        super().__init__(f"{path}: corrupt record at offset {offset}: {why}")
        self.path = path
        self.offset = offset
        self.why = why


@dataclass(slots=True)
class Record:
    type: int
    ino: int
    offset: int
    time_ns: int
    seq: int
    payload: bytes | memoryview
    pos: int = 0  # offset of the record header in its segment
    length: int = 0  # payload length
    csum: int = 0

    @property
    def size(self) -> int:
        return record_size(self.length)


def pad8(n: int) -> int:
    return (n + 7) & ~7


def record_size(payload_len: int) -> int:
    return RECORD_HEADER_SIZE + pad8(payload_len)


def encode_header(rtype: int, ino: int, offset: int, time_ns: int, seq: int,
                  payload: bytes | memoryview) -> bytes:
    """The 56-byte header of a record; the caller writes header, payload and padding."""
    head = RECORD_HEADER.pack(RECORD_MAGIC, rtype, 0, 0, len(payload), 0, ino, offset, time_ns,
                              seq)
    h = xxhash.xxh3_64(head)
    h.update(payload)
    return head + CSUM.pack(h.intdigest())


ZEROS = bytes(8192)
_ZEROS = ZEROS[:8]


def pad_gap(pos: int, align: int) -> int:
    """Bytes of PAD record needed from `pos` (8-aligned) to the next multiple of `align`:
    0 if already there, else at least a record header (so one more `align` if the gap is
    shorter than that)."""
    gap = -pos % align
    if gap and gap < RECORD_HEADER_SIZE:
        gap += align
    return gap


def pad_body(gap: int) -> memoryview:
    """The zero payload of a PAD record `gap` bytes long in all."""
    return memoryview(ZEROS)[:gap - RECORD_HEADER_SIZE]


@functools.cache
def pad_header(gap: int) -> bytes:
    """The header of a PAD record `gap` bytes long in all (the same every time: its fields
    are zero and its payload zeros). Fewer than ALIGN + 56 sizes are ever asked for."""
    return encode_header(RecType.PAD, 0, 0, 0, 0, pad_body(gap))


def encode_record(rtype: int, ino: int, offset: int, time_ns: int, seq: int,
                  payload: bytes | memoryview) -> list[bytes | memoryview]:
    """Header, payload and padding as a list for os.pwritev (no copy of the payload)."""
    parts: list[bytes | memoryview] = [encode_header(rtype, ino, offset, time_ns, seq, payload)]
    if payload:
        parts.append(payload)
    pad = pad8(len(payload)) - len(payload)
    if pad:
        parts.append(_ZEROS[:pad])
    return parts


def decode_header(buf: bytes | memoryview) -> tuple[int, int, int, int, int, int, int] | None:
    """(type, length, ino, offset, time_ns, seq, csum), or None if the magic is wrong."""
    (magic, rtype, _flags, _res, length, _res2, ino, offset, time_ns,
     seq) = RECORD_HEADER.unpack_from(buf)
    if magic != RECORD_MAGIC:
        return None
    (csum,) = CSUM.unpack_from(buf, RECORD_HEADER.size)
    return rtype, length, ino, offset, time_ns, seq, csum


def record_checksum(header: bytes | memoryview, payload: bytes | memoryview) -> int:
    h = xxhash.xxh3_64(bytes(header[: RECORD_HEADER.size]))
    h.update(payload)
    return h.intdigest()


def verify_record(buf: bytes | memoryview) -> bool:
    """buf holds one whole record starting at 0 (header + payload)."""
    hdr = decode_header(buf)
    if hdr is None:
        return False
    length, csum = hdr[1], hdr[6]
    if RECORD_HEADER_SIZE + length > len(buf):
        return False
    return record_checksum(buf[:RECORD_HEADER.size],
                           memoryview(buf)[RECORD_HEADER_SIZE:RECORD_HEADER_SIZE + length]) == csum


def verify_data_record(buf: bytes | memoryview, length: int) -> bool:
    """verify_record, for the record an extent names: also a data record of exactly the
    payload length the index has for it. A valid record of another kind or size at that
    position (an index that got ahead of its log, a segment file swapped under it) is EIO,
    not someone else's bytes."""
    hdr = decode_header(buf)
    return (hdr is not None and hdr[0] in DATA_TYPES and hdr[1] == length
            and verify_record(buf))


def segment_header(seg_id: int, node_id: str, created_ns: int, dir_id: int = 0) -> bytes:
    node = node_id.encode()[:16]
    head = struct.pack("<8sIIQq16s", SEGMENT_MAGIC, SEGMENT_VERSION, 0, seg_id, created_ns, node)
    return head + CSUM.pack(xxhash.xxh3_64_intdigest(head)) + struct.pack("<Q", dir_id)


def segment_dir_id(buf: bytes) -> int:
    """The NVME directory a segment header says wrote it (its identity's created_ns); 0 if
    unknown (segments of versions before it was recorded)."""
    return struct.unpack_from("<Q", buf, 56)[0] if len(buf) >= SEGMENT_HEADER_SIZE else 0


def parse_segment_header(buf: bytes, path: str) -> tuple[int, int, str]:
    """(segment id, created time_ns, node id) or CorruptRecord."""
    if len(buf) < SEGMENT_HEADER_SIZE:
        raise CorruptRecord(path, 0, "short segment header")
    magic, version, _r, seg_id, created, node, csum = SEGMENT_HEADER.unpack_from(buf)
    if magic != SEGMENT_MAGIC:
        raise CorruptRecord(path, 0, "not a ckptfs segment (bad magic)")
    if xxhash.xxh3_64_intdigest(buf[:48]) != csum:
        raise CorruptRecord(path, 0, "segment header checksum mismatch")
    if version not in READABLE_VERSIONS:
        raise CorruptRecord(path, 0, f"unsupported segment version {version}")
    return seg_id, created, node.rstrip(b"\0").decode(errors="replace")


def segment_name(seg_id: int) -> str:
    return f"{seg_id:016x}.seg"


# --- bodies of metadata records -------------------------------------------------------------

def create_body(parent: int, mode: int, uid: int, gid: int, rdev: int, name: bytes,
                target: bytes = b"") -> bytes:
    return CREATE_BODY.pack(parent, mode, uid, gid, rdev, len(name), len(target)) + name + target


def parse_create(p: bytes | memoryview) -> tuple[int, int, int, int, int, bytes, bytes]:
    parent, mode, uid, gid, rdev, nlen, tlen = CREATE_BODY.unpack_from(p)
    o = CREATE_BODY.size
    return parent, mode, uid, gid, rdev, bytes(p[o:o + nlen]), bytes(p[o + nlen:o + nlen + tlen])


# LINK: parent u64, then the new name.
LINK_BODY = struct.Struct("<Q")


def link_body(parent: int, name: bytes) -> bytes:
    return LINK_BODY.pack(parent) + name


def parse_link(p: bytes | memoryview) -> tuple[int, bytes]:
    (parent,) = LINK_BODY.unpack_from(p)
    return parent, bytes(p[LINK_BODY.size:])


def rename_body(old_parent: int, old: bytes, new_parent: int, new: bytes, flags: int) -> bytes:
    return RENAME_BODY.pack(old_parent, new_parent, flags, len(old), len(new)) + old + new


def parse_rename(p: bytes | memoryview) -> tuple[int, bytes, int, bytes, int]:
    op, np_, flags, olen, nlen = RENAME_BODY.unpack_from(p)
    o = RENAME_BODY.size
    return op, bytes(p[o:o + olen]), np_, bytes(p[o + olen:o + olen + nlen]), flags


def setattr_body(mask: int, mode: int = 0, uid: int = 0, gid: int = 0, size: int = 0,
                 atime_ns: int = 0, mtime_ns: int = 0, ctime_ns: int = 0) -> bytes:
    return SETATTR_BODY.pack(mask, mode, uid, gid, size, atime_ns, mtime_ns, ctime_ns)


def xattr_body(name: bytes, value: bytes | None) -> bytes:
    flag = 0 if value is None else 1
    return struct.pack("<HB", len(name), flag) + name + (value or b"")


def parse_xattr(p: bytes | memoryview) -> tuple[bytes, bytes | None]:
    nlen, flag = struct.unpack_from("<HB", p)
    name = bytes(p[3:3 + nlen])
    return name, (bytes(p[3 + nlen:]) if flag else None)


# --- reading ----------------------------------------------------------------------------------

@dataclass
class ScanResult:
    records: int = 0
    end: int = SEGMENT_HEADER_SIZE  # offset just past the last good record
    sealed: bool = False
    torn_tail: bool = False  # a partial/invalid record at the end with nothing valid after it
    corruption: list[CorruptRecord] | None = None


def _find_next_valid(f: BinaryIO, start: int, file_size: int, path: str,
                     table: dict[int, tuple] | None = None) -> int | None:
    """Scan 8-byte aligned offsets after a bad record for a record that verifies. With a
    sealed segment's record table, only where a record of it starts (or its SEAL): a record
    found elsewhere is bytes inside a record, data that happens to hold records (a copied
    segment file, say), never to be applied."""
    pos = start + 8
    chunk = 4 << 20
    while pos + RECORD_HEADER_SIZE <= file_size:
        f.seek(pos)
        buf = f.read(min(chunk, file_size - pos))
        mv = memoryview(buf)
        magic = struct.pack("<I", RECORD_MAGIC)
        i = 0
        while True:
            j = buf.find(magic, i)
            if j < 0 or j + RECORD_HEADER_SIZE > len(buf):
                break
            if (pos + j) % 8 == 0:
                hdr = decode_header(mv[j:j + RECORD_HEADER_SIZE])
                if table is not None and hdr is not None and pos + j not in table \
                        and hdr[0] not in (RecType.SEAL, RecType.PAD):
                    hdr = None
                if hdr is not None and (hdr[1] <= MAX_PAYLOAD or hdr[0] == RecType.SEAL):
                    need = RECORD_HEADER_SIZE + hdr[1]
                    if pos + j + need <= file_size:
                        f.seek(pos + j)
                        whole = f.read(need)
                        if verify_record(whole):
                            return pos + j
            i = j + 1
        pos += max(len(buf) - RECORD_HEADER_SIZE, 8)
        pos = pad8(pos)
    return None


def scan_segment(path: str, start: int = SEGMENT_HEADER_SIZE, newest: bool = False,
                 read_payload_types: frozenset[int] = frozenset(
                     {RecType.CREATE, RecType.UNLINK, RecType.RENAME, RecType.SETATTR,
                      RecType.PURGE, RecType.XATTR, RecType.IMPORT, RecType.REF,
                      RecType.TIER, RecType.LINK, RecType.GONE}),
                 result: ScanResult | None = None,
                 table: dict[int, tuple] | None = None) -> Iterator[Record]:
    """Yield verified records from `start`. Data payloads are checksummed but not returned
    (payload is b"") unless their type is in read_payload_types.

    Corruption is collected in result.corruption (and the scan resumes at the next valid
    record); a torn tail of the newest segment ends the scan quietly (result.torn_tail).
    """
    res = result if result is not None else ScanResult()
    res.corruption = res.corruption or []
    size = os.path.getsize(path)
    starts: list[int] | None = None  # the table's record positions, sorted, once needed
    with open(path, "rb", buffering=0) as f:
        pos = start
        res.end = pos
        while pos < size:
            f.seek(pos)
            head = f.read(RECORD_HEADER_SIZE)
            bad: str | None = None
            hdr = decode_header(head) if len(head) == RECORD_HEADER_SIZE else None
            if len(head) < RECORD_HEADER_SIZE:
                bad = "short record header"
            elif hdr is None:
                bad = "bad record magic"
            elif (hdr[1] > MAX_PAYLOAD and hdr[0] != RecType.SEAL) \
                    or pos + RECORD_HEADER_SIZE + hdr[1] > size:
                bad = "record runs past end of segment"
            if bad is None and hdr is not None:
                rtype, length, ino, offset, time_ns, seq, csum = hdr
                h = xxhash.xxh3_64(head[:RECORD_HEADER.size])
                payload = f.read(length)
                h.update(payload)
                if len(payload) != length or h.intdigest() != csum:
                    bad = "checksum mismatch"
                elif rtype == RecType.PAD:
                    pos = res.end = pos + record_size(length)
                    continue
                else:
                    res.records += 1
                    rec = Record(rtype, ino, offset, time_ns, seq,
                                 payload if rtype in read_payload_types else b"", pos, length,
                                 csum)
                    nxt = pos + record_size(length)
                    res.end = nxt
                    yield rec
                    if rtype == RecType.SEAL:
                        res.sealed = True
                        return
                    pos = nxt
                    continue
            if table is not None:
                # A sealed segment: its verified SEAL table says which record starts here and
                # where it ends, whatever the damaged bytes say (a length field, a magic, the
                # record after it). A data record keeps its extent, from the table's copy of
                # its header, so its range reads as EIO and not as a hole of zeros; the scan
                # goes on at the end of its frame, so the next record is checked, and
                # reported, on its own.
                row = table.get(pos)
                if row is not None:
                    if row[1] in DATA_TYPES:
                        res.corruption.append(CorruptRecord(
                            path, pos, f"{bad or 'invalid record'} in a data record (its range "
                            "reads as EIO)"))
                        res.records += 1
                        yield Record(row[1], row[3], row[4], row[5], row[6], b"", pos, row[2],
                                     row[7])
                    else:
                        res.corruption.append(CorruptRecord(path, pos, bad or "invalid record"))
                    pos = pos + record_size(row[2])
                    continue
                # not a record of the table: a PAD (PADs have no rows); go on at the next
                # record the table has, if any (after the last, only PADs and the SEAL)
                if starts is None:
                    starts = sorted(table)
                i = bisect.bisect_right(starts, pos)
                if i < len(starts):
                    res.corruption.append(CorruptRecord(path, pos, bad or "invalid record"))
                    pos = starts[i]
                    continue
            # A bad record: torn tail or corruption? The next record is looked for after
            # this one's frame when its header is whole (its payload may hold anything,
            # records too), else from just after it
            frame = (pos + record_size(hdr[1])
                     if hdr is not None and bad != "record runs past end of segment" else None)
            nxt_valid = _find_next_valid(f, frame - 8 if frame else pos, size, path, table)
            if table is None and bad == "checksum mismatch" and hdr is not None \
                    and hdr[0] in DATA_TYPES and nxt_valid == pos + record_size(hdr[1]) \
                    and hdr[3] + hdr[1] <= MAX_FILE_SIZE:
                # no table (a sealed segment's table was handled above): a damaged data record
                # whose frame is intact keeps its extent in the index, from its own header,
                # so reads of exactly that range fail with EIO instead of silently reading a
                # hole; a header placing it past any possible file end is damaged, not applied
                rtype, length, ino, offset, time_ns, seq, csum = hdr
                res.corruption.append(CorruptRecord(
                    path, pos, "checksum mismatch in a data record (its range reads as EIO)"))
                res.records += 1
                yield Record(rtype, ino, offset, time_ns, seq, b"", pos, length, csum)
                pos = nxt_valid
                continue
            if nxt_valid is None:
                # only zeros/garbage after it
                if newest:
                    res.torn_tail = True
                    return
                res.corruption.append(CorruptRecord(path, pos, bad or "invalid record"))
                return
            if newest and table is None and (frame is None or nxt_valid != frame):
                # the active segment is written front to back: what verifies after a record
                # that is not even whole, or after bytes that are no record at all, is
                # nothing this log can vouch for (stale bytes of a failed write, or pages a
                # power loss kept while it lost earlier ones, never fsync'd: an fsync covers
                # every record before it). Replaying it would leave the lost records'
                # ranges as holes that read as zeros; the log ends here instead
                res.corruption.append(CorruptRecord(
                    path, pos, f"{bad or 'invalid record'}; the log is replayed up to here, "
                    f"not from {nxt_valid} on"))
                res.torn_tail = True
                return
            res.corruption.append(CorruptRecord(path, pos, bad or "invalid record"))
            pos = nxt_valid


def seal_row(rec: Record) -> bytes:
    return SEAL_ROW.pack(rec.pos, rec.type, rec.length, rec.ino, rec.offset, rec.time_ns,
                         rec.seq, rec.csum)


def parse_seal_table(p: bytes | memoryview) -> list[tuple[int, int, int, int, int, int, int, int]]:
    """rows: (pos, type, length, ino, offset, time_ns, seq, csum)."""
    n = len(p) // SEAL_ROW.size
    return [SEAL_ROW.unpack_from(p, i * SEAL_ROW.size) for i in range(n)]


class SealedSegment:
    """Random access to a sealed segment (local file or shared object) through its table.

    `read(offset, length)` is the only I/O; it is a local pread or a shared-store range read.
    """

    def __init__(self, name: str, size: int, read: "Callable[[int, int], bytes]",
                 header: bool = True, find_seal: bool = False):
        """`header=False`: the segment header is not checked (replay checks it itself, and
        reads a segment whose header is damaged through its table: the SEAL record and the
        footer verify on their own). `find_seal`: if the footer is damaged or cut off, look
        for the SEAL record that ends where the footer starts (replay, which needs the table
        to tell damaged records apart in a segment that was sealed)."""
        self.name = name
        self.size = size
        self._read = read
        if size < SEGMENT_HEADER_SIZE + RECORD_HEADER_SIZE + FOOTER_SIZE:
            raise CorruptRecord(name, 0, "too small to be a sealed segment")
        foot = parse_footer(read(size - FOOTER_SIZE, FOOTER_SIZE))
        table_end = size - FOOTER_SIZE  # where the SEAL record must end
        if foot is None and find_seal:
            foot = find_seal_record(read, size)
            table_end = size  # the footer may be cut off: find_seal_record checked the end
        if foot is None:
            raise CorruptRecord(name, size - FOOTER_SIZE, "missing or bad footer (not sealed)")
        self.seal_pos, self.nrecords = foot
        if self.seal_pos + RECORD_HEADER_SIZE > table_end:
            raise CorruptRecord(name, self.seal_pos, "footer points past the end")
        if header:
            self.seg_id, self.created_ns, self.node = parse_segment_header(
                read(0, SEGMENT_HEADER_SIZE), name)
        else:
            self.seg_id, self.created_ns, self.node = -1, 0, ""
        head = read(self.seal_pos, RECORD_HEADER_SIZE)
        hdr = decode_header(head)
        if hdr is None or hdr[0] != RecType.SEAL:
            raise CorruptRecord(name, self.seal_pos, "footer does not point at a SEAL record")
        length = hdr[1]
        if self.seal_pos + RECORD_HEADER_SIZE + length > table_end \
                or length != self.nrecords * SEAL_ROW.size:
            raise CorruptRecord(name, self.seal_pos, "SEAL record size mismatch")
        whole = head + read(self.seal_pos + RECORD_HEADER_SIZE, length)
        if not verify_record(whole):
            raise CorruptRecord(name, self.seal_pos, "SEAL record checksum mismatch")
        self.seal_seq = hdr[5]
        self.rows = parse_seal_table(memoryview(whole)[RECORD_HEADER_SIZE:])
        end = SEGMENT_HEADER_SIZE
        for row in self.rows:
            pos, _t, ln = row[0], row[1], row[2]
            if pos < end or pos + record_size(ln) > self.seal_pos or ln > MAX_PAYLOAD:
                raise CorruptRecord(name, pos, "record table entry out of range")
            end = pos + record_size(ln)

    def record(self, row: tuple, with_payload: bool) -> Record:
        """The record of a table row; its payload is read and verified if asked for."""
        pos, rtype, length, ino, offset, time_ns, seq, csum = row
        payload: bytes = b""
        if with_payload:
            whole = self._read(pos, RECORD_HEADER_SIZE + length)
            hdr = decode_header(whole) if len(whole) >= RECORD_HEADER_SIZE else None
            if hdr is None or hdr[6] != csum or not verify_record(whole):
                raise CorruptRecord(self.name, pos, "checksum mismatch")
            payload = whole[RECORD_HEADER_SIZE:]
        return Record(rtype, ino, offset, time_ns, seq, payload, pos, length, csum)

    def records(self, data_payloads: bool = False) -> Iterator[Record]:
        """Every record in order; metadata payloads always, data payloads if asked."""
        for row in self.rows:
            yield self.record(row, data_payloads or row[1] not in DATA_TYPES)


def find_seal_record(read: "Callable[[int, int], bytes]", size: int,
                     chunk: int = 4 << 20) -> tuple[int, int] | None:
    """(position, record count) of the SEAL record of a segment whose footer is damaged or
    cut off, found from the end backwards: a verified SEAL record ending where its footer
    starts, or would have (the last FOOTER_SIZE bytes may be gone). None if there is none.
    Reads up to the last MAX_PAYLOAD bytes, so this is for damaged segments only."""
    magic = struct.pack("<I", RECORD_MAGIC)
    # no SEAL record starts before `floor`: its payload would be over MAX_PAYLOAD
    floor = max(SEGMENT_HEADER_SIZE, size - FOOTER_SIZE - RECORD_HEADER_SIZE - MAX_PAYLOAD)
    hi = size  # bytes [lo, hi) are searched next; a header that starts there may run past hi
    while hi > floor:
        lo = max(floor, hi - chunk)
        buf = read(lo, min(hi + RECORD_HEADER_SIZE, size) - lo)
        j = hi - lo
        while True:
            j = buf.rfind(magic, 0, j)
            if j < 0:
                break
            pos = lo + j
            hdr = decode_header(buf[j:j + RECORD_HEADER_SIZE]) if pos % 8 == 0 else None
            if hdr is not None and hdr[0] == RecType.SEAL and hdr[1] % SEAL_ROW.size == 0:
                end = pos + RECORD_HEADER_SIZE + hdr[1]
                if size - FOOTER_SIZE <= end <= size \
                        and verify_record(read(pos, RECORD_HEADER_SIZE + hdr[1])):
                    return pos, hdr[1] // SEAL_ROW.size
        hi = lo
    return None


def footer(seal_pos: int, nrecords: int) -> bytes:
    head = struct.pack("<8sQQ", FOOTER_MAGIC, seal_pos, nrecords)
    return head + CSUM.pack(xxhash.xxh3_64_intdigest(head))


def parse_footer(buf: bytes) -> tuple[int, int] | None:
    if len(buf) != FOOTER_SIZE:
        return None
    magic, seal_pos, n, csum = FOOTER.unpack(buf)
    if magic != FOOTER_MAGIC or xxhash.xxh3_64_intdigest(buf[:24]) != csum:
        return None
    return seal_pos, n
