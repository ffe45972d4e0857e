"""Replay: bring the index up to the end of the log after a crash, or rebuild it from scratch.

The index records the log position it reflects (`applied`). Replay scans every record beyond
it, verifies each checksum, and applies it with the same `Index.apply` the live path uses. A
torn record at the tail of the newest segment is the end of the log (it was never
acknowledged: see docs/architecture.md); a bad record anywhere else is corruption, reported
with segment and offset, and replay resumes at the next record that verifies.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ckptfs import segment as fmt
from ckptfs.index import VSEG_BIT, Index, SegState
from ckptfs.log import SegmentLog
from ckptfs.shared import SharedError

log = logging.getLogger(__name__)


@dataclass
class ReplayReport:
    full: bool = False
    from_snapshot: bool = False
    segments: int = 0
    segments_replayed: int = 0
    records: int = 0
    bytes_scanned: int = 0
    torn_tail: str | None = None
    recovered_tail: str | None = None
    corruption: list[str] = field(default_factory=list)
    # [segment, position] of each damaged record found (data records among them read EIO)
    bad_records: list[list[int]] = field(default_factory=list)
    orphans_purged: int = 0
    seconds: float = 0.0
    files: int = 0
    directories: int = 0
    file_bytes: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _finish_seal(path: str, end: int, seal: fmt.Record) -> None:
    foot = fmt.footer(seal.pos, seal.length // fmt.SEAL_ROW.size)
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, end)
        os.pwrite(fd, foot, end)
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _has_footer(path: str, size: int) -> bool:
    if size < fmt.SEGMENT_HEADER_SIZE + fmt.FOOTER_SIZE:
        return False
    with open(path, "rb") as f:
        f.seek(size - fmt.FOOTER_SIZE)
        foot = fmt.parse_footer(f.read(fmt.FOOTER_SIZE))
    return foot is not None


def _seal_table(path: str, size: int, newest: bool) -> dict[int, tuple] | None:
    """The record table of a sealed segment by record position (None if not sealed). Only
    the newest segment may be unsealed (the active one when the daemon stopped): in an older
    one a bad footer is damage, and the SEAL record is looked for before it."""
    try:
        with open(path, "rb") as f:
            sealed = fmt.SealedSegment(path, size, lambda o, n: os.pread(f.fileno(), n, o),
                                       header=False,  # checked by the caller
                                       find_seal=not newest)
            return {row[0]: row for row in sealed.rows}
    except (OSError, fmt.CorruptRecord):
        return None


def _replay_published(index: Index, store: Any, node: str, seg: int, start: int,
                      rep: ReplayReport) -> int:
    """Replay a segment whose local copy was evicted from its object on SHARED."""
    name = f"{node}/{fmt.segment_name(seg)}"
    last_seq = 0
    try:
        size = store.object_size(node, seg)
        sealed = fmt.SealedSegment(name, size, lambda o, n: store.read_range(node, seg, o, n))
        for rec in sealed.records():
            if rec.pos >= start:
                index.apply(seg, rec)
                rep.records += 1
                rep.bytes_scanned += rec.size
            last_seq = rec.seq
        index.applied = (seg, size, sealed.seal_seq)
        index.set_segment(seg, SegState.EVICTED, size=size, sealed_ns=time.time_ns())
        return sealed.seal_seq
    except (OSError, fmt.CorruptRecord, SharedError) as e:
        rep.corruption.append(f"{name}: cannot replay the published copy: {e}")
        log.error("%s", rep.corruption[-1])
        return last_seq


def _records_still_readable(head: bytes) -> bool:
    """Whether a segment whose header failed its check may still be scanned record by record:
    not when the header verifies but names another segment or a version this code cannot
    read (its records are not ours to read), nor when it is short (nothing follows it)."""
    if len(head) < fmt.SEGMENT_HEADER_SIZE:
        return False
    csum = fmt.SEGMENT_HEADER.unpack_from(head)[-1]
    if xxhash.xxh3_64_intdigest(head[:48]) == csum:
        return False  # an intact header that is not this segment's, or of a newer version
    return True  # damaged: its id, version or magic cannot be trusted, its records can


def _drop_headerless_tail(seglog: SegmentLog, local: list[int], a_seg: int,
                          rep: ReplayReport) -> list[int]:
    """Remove the newest segments whose header never reached the disk; returns the rest.

    A segment's header is a buffered write. After a power loss a new segment can be there with
    its size (an O_DIRECT record in it, a journal commit of another file) but zeros or nothing
    where the header was. No fsync covered it: a flush writes every unsynced segment, header
    included, before it returns, and an index commit flushes the log first, so no commit
    points into it either. Such segments at the end of the log are its torn tail, like a torn
    record; a headerless segment with a good one after it is corruption (reported by replay).
    """
    cut = len(local)
    while cut > 0 and local[cut - 1] > a_seg:
        try:
            with open(seglog.path(local[cut - 1]), "rb") as f:
                head = f.read(fmt.SEGMENT_HEADER_SIZE)
        except OSError:
            break
        if len(head) == fmt.SEGMENT_HEADER_SIZE and any(head):
            break
        cut -= 1
    for seg in local[cut:]:
        path = seglog.path(seg)
        os.unlink(path)
        rep.torn_tail = f"{path}: segment whose header never reached the disk removed"
        log.warning("%s", rep.torn_tail)
    return local[:cut]


def replay(index: Index, seglog: SegmentLog, full: bool = False, store: Any = None,
           node: str = "", first_seg: int | None = None, dir_id: int = 0) -> ReplayReport:
    """Apply the log beyond the index's last commit (or all of it with full=True).

    Segments of this NVMe directory (ids from first_seg on) that are not on local disk any
    more were evicted after publishing: they are replayed from their objects on SHARED.
    """
    t0 = time.monotonic()
    rep = ReplayReport(full=full)
    known = {s for s, _i in index.iter_segments() if not s & VSEG_BIT}
    if full:
        index.wipe()
    # the root exists before any record (its owner and mode are a SETATTR record of the
    # first mount), so directories created under it count in its nlink during replay too
    index.ensure_root(0, 0, 0o755, 0)
    a_seg, a_pos, a_seq = index.applied
    local = _drop_headerless_tail(seglog, seglog.existing(), a_seg, rep)
    local_set = set(local)
    remote: list[int] = []
    if store is not None and first_seg is not None:
        try:
            remote = [s for s in store.list_objects(node)
                      if s >= first_seg and s not in local_set]
        except OSError as e:
            log.warning("cannot list published segments on SHARED: %s", e)
        if dir_id:  # never another NVME directory's, mounted as this node since
            remote = [s for s in remote if s < a_seg or s in known
                      or _written_here(store, node, s, dir_id)]
    ids = sorted(local_set | set(remote))
    rep.segments = len(ids)
    seglog.seq = max(seglog.seq, a_seq)
    if ids:
        # segments are numbered without gaps: one missing from NVMe and from the stores
        # means records we cannot replay; say so instead of rebuilding a namespace without
        # them (garbage collection only deletes segments an index snapshot covers)
        # (from the first segment of this directory: one missing before the first left is
        # one a lost index snapshot covered, and the namespace without it is not whole)
        lo = max(a_seg, first_seg if first_seg is not None else ids[0])
        have = set(ids)
        for seg in range(lo, ids[-1]):
            if seg not in have:
                rep.corruption.append(
                    f"segment {fmt.segment_name(seg)} is missing (not on NVMe"
                    + (" nor on the shared store" if store is not None else
                       "; segments evicted after publishing are replayed only with --shared")
                    + ")")
    for seg in ids:
        if seg < a_seg:
            continue
        if seg not in local_set:
            st = index.get_segment(seg)
            # applied to its end already (a sealed segment's size is known). An index whose
            # last commit saw this segment still ACTIVE (size 0), committed before it was
            # sealed, published and evicted (a power loss undoes the commits after that),
            # still needs its records from `a_pos` on: from the object
            if (seg == a_seg and st is not None and st.state != SegState.ACTIVE
                    and st.size and a_pos >= st.size):
                continue
            start = a_pos if seg == a_seg else fmt.SEGMENT_HEADER_SIZE
            rep.segments_replayed += 1
            seglog.seq = max(seglog.seq, _replay_published(index, store, node, seg, start, rep))
            a_pos = fmt.SEGMENT_HEADER_SIZE
            continue
        path = seglog.path(seg)
        newest = seg == local[-1]
        start = a_pos if seg == a_seg else fmt.SEGMENT_HEADER_SIZE
        with open(path, "rb") as f:
            head = f.read(fmt.SEGMENT_HEADER_SIZE)
        try:
            sid, _created, _node = fmt.parse_segment_header(head, path)
            if sid != seg:
                raise fmt.CorruptRecord(path, 0, f"header names segment {sid:x}")
        except fmt.CorruptRecord as e:
            rep.corruption.append(str(e))
            log.error("%s", e)
            if not _records_still_readable(head):
                continue
            # Only the header is known to be damaged: each record carries its own checksum,
            # so the ones that verify are taken (the file's name says which segment this
            # is). Skipping them would turn the segment's data into holes that read as zeros.
        size = os.path.getsize(path)
        if seg == a_seg and start >= size - fmt.FOOTER_SIZE and _has_footer(path, size):
            # the index already has everything up to the SEAL record of a sealed segment
            st = index.get_segment(seg)
            if st is None or st.state == SegState.ACTIVE:
                index.set_segment(seg, SegState.SEALED, size=size, sealed_ns=time.time_ns())
            a_pos = fmt.SEGMENT_HEADER_SIZE
            continue
        if start >= size and seg == a_seg:
            st = index.get_segment(seg)
            if st is None or st.state != SegState.ACTIVE:
                continue
        rep.segments_replayed += 1
        scan = fmt.ScanResult()
        rows = bytearray()
        if start > fmt.SEGMENT_HEADER_SIZE and newest:
            # rows of the records the index already has (needed to seal this segment)
            pre = fmt.ScanResult()
            for rec in fmt.scan_segment(path, fmt.SEGMENT_HEADER_SIZE, newest, result=pre):
                if rec.pos >= start:
                    break
                rows += fmt.seal_row(rec)
        last_seq = a_seq
        if index.get_segment(seg) is None:
            index.set_segment(seg, SegState.ACTIVE)
        table = _seal_table(path, size, newest)
        last = None
        for rec in fmt.scan_segment(path, start, newest, result=scan, table=table):
            index.apply(seg, rec)
            rows += fmt.seal_row(rec)
            last_seq = rec.seq
            last = rec
        seglog.seq = max(seglog.seq, last_seq)
        rep.records += scan.records
        rep.bytes_scanned += scan.end - start
        for c in scan.corruption or []:
            rep.corruption.append(str(c))
            rep.bad_records.append([seg, c.offset])
            index.mark_bad(seg, c.offset)
            log.error("%s", c)
        if scan.torn_tail:
            rep.torn_tail = f"{path}: log ends at offset {scan.end} (torn record after it)"
            log.warning("%s", rep.torn_tail)
        if scan.sealed and last is not None and last.type == fmt.RecType.SEAL \
                and not _has_footer(path, size):
            # the daemon died between the SEAL record and the footer reaching the file (one
            # write, but not one page): finish the seal, so the segment can be read and drain
            _finish_seal(path, scan.end, last)
            size = os.path.getsize(path)
            rep.recovered_tail = f"{path}: footer written after its SEAL record"
        if scan.sealed:
            st = index.get_segment(seg)
            if st is None or st.state == SegState.ACTIVE:
                index.set_segment(seg, SegState.SEALED, size=size, sealed_ns=time.time_ns())
        else:
            # an unsealed segment (the daemon died while it was active): seal it now so that
            # new records go to a fresh file and this one can drain
            seglog.recover_tail(seg, scan, rows, last_seq)
            sealed_size = os.path.getsize(path)
            index.set_segment(seg, SegState.SEALED, size=sealed_size, sealed_ns=time.time_ns())
            # the SEAL record moves `applied` past the end of the segment
            index.applied = (seg, sealed_size, seglog.seq)
            rep.recovered_tail = f"{path}: sealed at {scan.end} during recovery"
        a_pos, a_seq = fmt.SEGMENT_HEADER_SIZE, last_seq
    # count what we have
    for node in index.iter_inodes():
        if node.is_dir:
            rep.directories += 1
        elif node.nlink:
            rep.files += 1
            rep.file_bytes += node.size
    rep.seconds = time.monotonic() - t0
    return rep


def _written_here(store: Any, node: str, seg: int, dir_id: int) -> bool:
    """Whether object node/seg was written by the NVME directory `dir_id` (or by a version
    that did not record it): a new NVME directory that took the node over numbers its
    segments after those it found, so an old directory mounted again finds them above its
    own, and must not take them for segments of its own that were evicted."""
    try:
        head = store.read_range(node, seg, 0, fmt.SEGMENT_HEADER_SIZE)
    except (OSError, SharedError):
        return True  # its replay reports what it cannot read
    other = fmt.segment_dir_id(head)
    if other and other != dir_id:
        log.warning("object %s/%s was written by another NVME directory of this node: not "
                    "replayed", node, fmt.segment_name(seg))
        return False
    return True


def repair_published_view(nvme: str) -> str:
    """Check that NVME/published (the published view, drain.py) opens; if it does not, put
    its snapshot in its place (gc.py takes one before deleting segments it was built from),
    or nothing when no segment was ever collected: the next mount's drain then applies the
    published segments after it again. Returns what was done ("" if nothing); ValueError
    with one line when it cannot be rebuilt."""
    import shutil

    import lmdb

    from ckptfs.drain import PUBLISHED_DIR
    from ckptfs.gc import PUB_SNAPSHOT_DIR, SNAPSHOT_DIR, restore_snapshot

    path = os.path.join(nvme, PUBLISHED_DIR)
    if not os.path.exists(path):
        return ""
    try:
        Index(path).close(commit=False)
        return ""
    except lmdb.Error as e:
        why = f"{type(e).__name__}: {e}"
    log.error("the published view %s cannot be read (%s)", path, why)
    if restore_snapshot(nvme, path, PUB_SNAPSHOT_DIR):
        return (f"the published view was damaged ({why}): restored from its snapshot; the "
                f"next mount applies the published segments after it")
    if os.path.exists(os.path.join(nvme, SNAPSHOT_DIR, "data.mdb")):
        raise ValueError(f"the published view {path} is damaged ({why}) and has no snapshot, "
                         f"while segments it was built from were collected: mount a new, "
                         f"empty NVME directory with this node's --node-id instead "
                         f"(troubleshooting.md, recipe 5)")
    shutil.rmtree(path)
    return (f"the published view was damaged ({why}): removed; the next mount builds it "
            f"again from the published segments")


def reconcile_states(index: Index, seglog: SegmentLog, store: Any, node: str,
                     rep: ReplayReport) -> None:
    """After a replay that started from an index snapshot, whose segment states are as old
    as the snapshot, or from an empty index (lost, or a full replay), which calls every
    sealed segment SEALED: a segment said SEALED, UPLOADING or PUBLISHED may have been
    published, evicted, or deleted by garbage collection since (GC deletes only dead segments
    that a snapshot covers). Make the states say what exists, or the drain would upload
    a published segment a second time (a second object of that name, in a new batch
    directory), or retry forever a segment that is nowhere."""
    local = set(seglog.existing())
    todo = [(seg, info) for seg, info in index.iter_segments()
            if not seg & VSEG_BIT and info.state in (SegState.SEALED, SegState.UPLOADING,
                                                     SegState.PUBLISHED)
            and not (info.state == SegState.PUBLISHED and seg in local)]
    if not todo:
        return
    shared = getattr(store, "shared", store)  # the shared tier of a Tiered store
    try:
        listed = set(shared.list_objects(node))
        if hasattr(shared, "check"):
            shared.check()
    except (OSError, SharedError) as e:
        # unreachable is not "missing": leave the states as they are
        rep.corruption.append(f"segment states not checked against the shared store: it "
                              f"cannot be read ({e}); replay again once it can")
        log.error("%s", rep.corruption[-1])
        return
    for seg, info in todo:
        here = seg in local
        head = b""
        if here:  # the object must be this segment's, not another NVME directory's
            try:
                with open(seglog.path(seg), "rb") as f:
                    head = f.read(fmt.SEGMENT_HEADER_SIZE)
            except OSError:
                pass
        there = seg in listed and shared.object_ok(node, seg, info.size, head)
        name = fmt.segment_name(seg)
        if there:
            index.set_segment(seg, SegState.PUBLISHED if here else SegState.EVICTED)
        elif here:
            continue  # not published yet: the drain uploads it
        elif info.live == 0:
            index.drop_segment(seg)
            log.info("segment %s: deleted by garbage collection after the snapshot", name)
        else:
            rep.corruption.append(f"segment {name} is missing (not on NVMe nor on the shared "
                                  f"store) but holds live data")
            log.error("%s", rep.corruption[-1])


def catch_up(index: Index, seglog: SegmentLog) -> int:
    """Re-apply the live log from the index's committed position to the current end (after a
    failed commit rolled the index back). Unlike replay, nothing is sealed: every record up to
    the log's tail was written by this daemon and is whole."""
    seg, pos, _ = index.applied
    n = 0
    for sid in seglog.existing():
        if sid < seg:
            continue
        path = seglog.path(sid)
        size = os.path.getsize(path)
        start = pos if sid == seg else fmt.SEGMENT_HEADER_SIZE
        if sid == seg and start >= size - fmt.FOOTER_SIZE and _has_footer(path, size):
            continue
        if index.get_segment(sid) is None:
            index.set_segment(sid, SegState.ACTIVE)
        scan = fmt.ScanResult()
        for rec in fmt.scan_segment(path, start, newest=True, result=scan):
            index.apply(sid, rec)
            n += 1
        info = index.get_segment(sid)
        if scan.sealed and info is not None and info.state == SegState.ACTIVE:
            index.set_segment(sid, SegState.SEALED, size=size, sealed_ns=time.time_ns())
    return n
