"""The record format, the log reader, the index and replay, without FUSE."""

from __future__ import annotations

import errno
import os
import random
import shutil
import stat
from pathlib import Path

import pytest
import trio

from ckptfs import segment as fmt
from ckptfs.errors import FsError
from ckptfs.index import ROOT_INO, Index, SegState
from ckptfs.log import SegmentLog
from ckptfs.manifest import ManifestError, build, parse
from ckptfs.namespace import Namespace
from ckptfs.reads import Reader
from ckptfs.recovery import replay
from ckptfs.segment import RecType


def make(tmp_path: Path, seg_size: int = 1 << 20) -> tuple[Index, SegmentLog, Namespace]:
    index = Index(str(tmp_path / "index"))
    log = SegmentLog(str(tmp_path / "segments"), "t0", seg_size)
    replay(index, log)
    ns = Namespace(index, log, Reader(log.path))
    index.ensure_root(0, 0, 0o755, 1)
    return index, log, ns


def reopen(root: Path, seg_size: int) -> tuple[Index, SegmentLog, Namespace]:
    """The index thrown away: what the log alone says (it must replay without corruption)."""
    shutil.rmtree(root / "index")
    index = Index(str(root / "index"))
    log = SegmentLog(str(root / "segments"), "t0", seg_size)
    rep = replay(index, log)
    assert not rep.corruption, rep.corruption
    return index, log, Namespace(index, log, Reader(log.path))


def close(index: Index, log: SegmentLog) -> None:
    log.close()
    index.close()


def test_record_roundtrip_and_checksum_covers_header_and_payload() -> None:
    parts = fmt.encode_record(RecType.WRITE, 7, 4096, 123, 9, b"hello")
    buf = b"".join(bytes(p) for p in parts)
    assert len(buf) == fmt.record_size(5) == 56 + 8
    assert fmt.verify_record(buf)
    hdr = fmt.decode_header(buf)
    assert hdr is not None and hdr[:6] == (RecType.WRITE, 5, 7, 4096, 123, 9)
    for i in (0, 8, 20, 50, 57):  # magic, header fields, payload
        bad = bytearray(buf)
        bad[i] ^= 1
        assert not fmt.verify_record(bytes(bad)), f"flip at {i} not detected"


def test_torn_tail_is_end_of_log_but_corruption_elsewhere_is_reported(tmp_path: Path) -> None:
    index, log, ns = make(tmp_path)
    f = ns.create(ROOT_INO, b"f", 0o644, 0, 0)
    for i in range(10):
        ns.write(f.ino, i * 1000, bytes([i]) * 1000)
    path = log.path(log.seg_id)
    end = log.tail
    close(index, log)
    # a torn record at the tail: the scan ends quietly before it
    with open(path, "r+b") as fh:
        fh.seek(end)
        fh.write(b"\x43\x4b\x52\x31" + b"\xff" * 30)
    res = fmt.ScanResult()
    recs = list(fmt.scan_segment(path, newest=True, result=res))
    assert res.torn_tail and not res.corruption and res.end == end
    assert sum(r.type == RecType.WRITE for r in recs) == 10
    # a bit flip in the middle of a data payload: reported with its offset, rest still read
    mid = recs[5]
    with open(path, "r+b") as fh:
        fh.seek(mid.pos + fmt.RECORD_HEADER_SIZE + 10)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0x40]))
    res = fmt.ScanResult()
    recs2 = list(fmt.scan_segment(path, newest=False, result=res))
    assert res.corruption and res.corruption[0].offset == mid.pos
    assert str(path) in str(res.corruption[0])
    assert len(recs2) == len(recs)  # the damaged data record keeps its frame


def test_replay_rebuilds_exactly_what_was_applied(tmp_path: Path) -> None:
    index, log, ns = make(tmp_path, seg_size=64 << 10)
    d = ns.mkdir(ROOT_INO, b"step_1", 0o755, 0, 0)
    files = {}
    for i in range(20):
        node = ns.create(d.ino, f"f{i}".encode(), 0o600, 1000, 1000)
        data = os.urandom(5000 + i * 777)
        ns.write(node.ino, 0, data)
        ns.release(node.ino)
        files[node.ino] = data
    ns.rename(d.ino, b"f0", d.ino, b"renamed", 0)
    ns.unlink(d.ino, b"f1", want_dir=False)
    ns.setattr(list(files)[2], size=10)
    trio.run(log.sync)
    state = {(i.ino, i.size, i.mode, i.nlink) for i in index.iter_inodes()}
    extents = {(ino, e.start, e.length) for ino in files for e in index.iter_extents(ino)}
    seg_count = len(log.existing())
    assert seg_count > 2  # the test covers several segments
    close(index, log)
    # throw the index away: the log alone rebuilds it
    shutil.rmtree(tmp_path / "index")
    index2 = Index(str(tmp_path / "index"))
    log2 = SegmentLog(str(tmp_path / "segments"), "t0", 64 << 10)
    rep = replay(index2, log2)
    assert not rep.corruption
    assert {(i.ino, i.size, i.mode, i.nlink) for i in index2.iter_inodes()} == state
    assert {(ino, e.start, e.length) for ino in files for e in index2.iter_extents(ino)} == \
        extents
    ns2 = Namespace(index2, log2, Reader(log2.path))
    assert ns2.read(list(files)[3], 0, 1 << 20) == files[list(files)[3]]
    assert index2.lookup(d.ino, b"renamed") is not None
    assert index2.lookup(d.ino, b"f1") is None
    close(index2, log2)


def test_replay_takes_the_records_of_an_evicted_segment_the_index_saw_active(
        tmp_path: Path) -> None:
    """The index's last durable commit saw segment X still active, `applied` inside it; X was
    then sealed, published and evicted, and a power loss undid the index commits after that
    (LMDB without metasync keeps all but the last; the eviction's unlink was durable). Replay
    takes X's records from `applied` on from its object on SHARED. It used to skip X (an
    active segment's size in the index is 0, so `applied` looked past its end), losing every
    change in X after that commit."""
    from ckptfs.shared import SharedStore

    index, log, ns = make(tmp_path, seg_size=1 << 20)
    a = ns.create(ROOT_INO, b"before", 0o644, 0, 0)
    ns.write(a.ino, 0, b"a" * 1000)
    ns.release(a.ino)
    trio.run(log.sync)
    index.commit()
    seg = log.seg_id
    assert index.applied[0] == seg and index.get_segment(seg).state == SegState.ACTIVE
    b = ns.create(ROOT_INO, b"after", 0o644, 0, 0)
    ns.write(b.ino, 0, b"b" * 3000)
    ns.release(b.ino)
    ns.rename(ROOT_INO, b"before", ROOT_INO, b"renamed", 0)
    assert ns.seal("size") == seg
    trio.run(log.sync)
    store = SharedStore(str(tmp_path / "shared"))
    store.put_objects("t0", [(seg, log.path(seg))])
    os.unlink(log.path(seg))  # evicted
    log.close()
    index.close(commit=False)  # the commits since the first are lost

    index2 = Index(str(tmp_path / "index"))
    log2 = SegmentLog(str(tmp_path / "segments"), "t0", 1 << 20)
    rep = replay(index2, log2, store=store, node="t0", first_seg=1)
    assert not rep.corruption, rep.corruption
    assert rep.segments_replayed == 1
    ns2 = Namespace(index2, log2, Reader(log2.path, "t0", store))
    after = index2.lookup(ROOT_INO, b"after")
    assert after is not None and ns2.read(after, 0, 1 << 20) == b"b" * 3000
    assert index2.lookup(ROOT_INO, b"before") is None
    renamed = index2.lookup(ROOT_INO, b"renamed")
    assert renamed is not None and ns2.read(renamed, 0, 1 << 20) == b"a" * 1000
    assert index2.get_segment(seg).state == SegState.EVICTED
    close(index2, log2)


def test_newest_segments_whose_header_never_reached_the_disk_are_an_empty_tail(
        tmp_path: Path) -> None:
    """After a power loss the newest segments can have their size on disk (an O_DIRECT record
    in them, a journal commit) but zeros where their buffered header was: nothing in them was
    ever fsync'd. Replay removes them like a segment created with no header at all, instead of
    reporting corruption and leaving files no index names. A headerless segment with a good
    one after it is corruption, and stays."""
    def build(root: Path) -> tuple[str, str]:
        index, log, ns = make(root, seg_size=1 << 20)
        f = ns.create(ROOT_INO, b"kept", 0o644, 0, 0)
        ns.write(f.ino, 0, b"k" * 1000)
        ns.release(f.ino)
        assert ns.seal("size") is not None
        trio.run(log.sync)
        paths = []
        for name in (b"lost1", b"lost2"):
            g = ns.create(ROOT_INO, name, 0o644, 0, 0)
            ns.write(g.ino, 0, b"l" * 200_000)
            paths.append(log.path(log.seg_id))
            if name == b"lost1":
                assert ns.seal("size") is not None
        close(index, log)
        return paths[0], paths[1]

    def zero_header(path: str) -> None:
        with open(path, "r+b") as fh:
            fh.write(bytes(fmt.SEGMENT_HEADER_SIZE))

    b, c = build(tmp_path / "both")
    zero_header(b)
    zero_header(c)
    index2, log2, _ns2 = reopen(tmp_path / "both", 1 << 20)
    assert not os.path.exists(b) and not os.path.exists(c)
    assert index2.lookup(ROOT_INO, b"kept") is not None
    assert index2.lookup(ROOT_INO, b"lost1") is None and index2.lookup(ROOT_INO, b"lost2") is None
    close(index2, log2)

    b, c = build(tmp_path / "middle")
    zero_header(b)
    shutil.rmtree(tmp_path / "middle" / "index")
    index3 = Index(str(tmp_path / "middle" / "index"))
    log3 = SegmentLog(str(tmp_path / "middle" / "segments"), "t0", 1 << 20)
    rep = replay(index3, log3)
    assert any("bad magic" in c for c in rep.corruption), rep.corruption
    assert os.path.exists(b) and os.path.exists(c)
    close(index3, log3)


def test_extent_map_overwrites_holes_and_truncate(tmp_path: Path) -> None:
    index, log, ns = make(tmp_path)
    f = ns.create(ROOT_INO, b"f", 0o644, 0, 0).ino
    model = bytearray()

    def write(off: int, data: bytes) -> None:
        ns.write(f, off, data)
        if off > len(model):
            model.extend(bytes(off - len(model)))
        model[off:off + len(data)] = data

    write(0, b"a" * 100)
    write(50, b"b" * 20)  # split in the middle
    write(200, b"c" * 10)  # a hole
    write(0, b"d" * 60)  # covers the head and part of the split
    ns.setattr(f, size=205)
    del model[205:]
    assert ns.read(f, 0, 1000) == bytes(model)
    ns.setattr(f, size=300)
    model.extend(bytes(95))
    assert ns.read(f, 0, 1000) == bytes(model)
    assert ns.read(f, 55, 10) == bytes(model[55:65])
    close(index, log)


def test_relocated_bytes_past_the_size_count_for_it_without_touching_times(
        tmp_path: Path) -> None:
    """A RELOC record (compaction) changes no times. If the write that put its bytes there
    was lost (a damaged segment), its bytes still count for the file's size, also after a
    replay: the size is stored, not only computed."""
    index, log, ns = make(tmp_path)
    f = ns.create(ROOT_INO, b"f", 0o644, 0, 0).ino
    ns.write(f, 0, b"a" * 100)
    before = index.get_inode(f)
    assert before is not None
    ns.record(RecType.RELOC, f, 100, b"r" * 50)  # bytes whose WRITE the index never saw
    for _ in range(2):
        node = index.get_inode(f)
        assert node is not None and node.size == 150
        assert (node.mtime_ns, node.ctime_ns) == (before.mtime_ns, before.ctime_ns)
        assert ns.read(f, 0, 1000) == b"a" * 100 + b"r" * 50
        trio.run(log.sync)
        close(index, log)
        index, log, ns = reopen(tmp_path, 1 << 20)
    close(index, log)


def test_a_segment_is_sealed_at_max_seal_rows_and_bigger_seals_still_replay(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small records fill a segment's SEAL table long before its size: a segment is sealed
    at MAX_SEAL_ROWS records, so its SEAL record stays under MAX_PAYLOAD (a scan took a
    bigger one for a torn tail, or for damage). A segment sealed before that bound, with a
    bigger SEAL record, still replays clean."""
    monkeypatch.setattr(fmt, "MAX_SEAL_ROWS", 300)
    index, log, ns = make(tmp_path, 1 << 30)
    for i in range(1000):
        ns.create(ROOT_INO, b"f%d" % i, 0o644, 0, 0)
    sealed = [s for s, info in index.iter_segments() if info.state == SegState.SEALED]
    assert len(sealed) == 3, sealed
    for seg in sealed:
        seg_size = os.path.getsize(log.path(seg))
        with open(log.path(seg), "rb") as f:
            table = fmt.SealedSegment(str(seg), seg_size,
                                      lambda o, n: os.pread(f.fileno(), n, o)).rows
        assert 300 <= len(table) <= 301  # the SEAL itself is not a row; the size check
    # a segment written without the bound: its SEAL record is over MAX_PAYLOAD
    monkeypatch.setattr(fmt, "MAX_SEAL_ROWS", 1 << 30)
    for i in range(1000, 2000):
        ns.create(ROOT_INO, b"f%d" % i, 0o644, 0, 0)
    ns.seal("test")
    ns.create(ROOT_INO, b"last", 0o644, 0, 0)  # so the big one is not the newest
    trio.run(log.sync)
    close(index, log)
    monkeypatch.setattr(fmt, "MAX_PAYLOAD", 32 << 10)
    index, log, ns = reopen(tmp_path, 1 << 30)  # asserts no corruption
    assert index.lookup(ROOT_INO, b"f1999") is not None
    assert index.lookup(ROOT_INO, b"last") is not None
    close(index, log)


def sealed_with_five_writes(tmp_path: Path) -> tuple[Index, SegmentLog, Namespace, int]:
    """A log whose one sealed segment holds a file's CREATE and five 10-byte WRITEs."""
    index, log, ns = make(tmp_path)
    f = ns.create(ROOT_INO, b"f", 0o644, 0, 0).ino
    for i in range(5):
        ns.write(f, i * 10, b"x" * 10)
    seg = ns.seal("wait")
    assert seg is not None
    return index, log, ns, seg


def test_sealed_segment_table_matches_records(tmp_path: Path) -> None:
    index, log, ns, seg = sealed_with_five_writes(tmp_path)
    info = index.get_segment(seg)
    assert info is not None and info.state == SegState.SEALED
    path = log.path(seg)
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        sealed = fmt.SealedSegment(path, size, lambda o, n: os.pread(fh.fileno(), n, o))
        recs = list(sealed.records(data_payloads=True))
    scanned = [r for r in fmt.scan_segment(path) if r.type != RecType.SEAL]
    assert [(r.pos, r.type, r.seq) for r in recs] == [(r.pos, r.type, r.seq) for r in scanned]
    assert sum(r.type == RecType.WRITE for r in recs) == 5
    close(index, log)


def test_the_seal_table_is_found_past_a_damaged_or_cut_off_footer(tmp_path: Path) -> None:
    """Replay reads an older segment through its SEAL table, which the footer points at. A
    footer damaged, or cut short, must not hide the table (find_seal); a damaged SEAL record
    must not be taken for one."""
    index, log, ns, seg = sealed_with_five_writes(tmp_path)
    pristine = Path(log.path(seg)).read_bytes()
    close(index, log)
    seal_pos = fmt.parse_footer(pristine[-fmt.FOOTER_SIZE:])[0]

    def table(blob: bytes, find: bool) -> list[tuple]:
        return fmt.SealedSegment("s", len(blob), lambda o, n: blob[o:o + n],
                                 find_seal=find).rows

    rows = table(pristine, False)
    assert len(rows) == 6  # CREATE and five WRITEs
    flipped = bytearray(pristine)
    flipped[-20] ^= 1
    for damaged in (bytes(flipped), pristine[:-10], pristine[:-fmt.FOOTER_SIZE]):
        with pytest.raises(fmt.CorruptRecord):
            table(damaged, False)
        assert table(damaged, True) == rows
    bad_seal = bytearray(flipped)
    bad_seal[seal_pos + 60] ^= 1
    for damaged in (bytes(bad_seal), pristine[:seal_pos + 100]):
        with pytest.raises(fmt.CorruptRecord):
            table(damaged, True)


def test_manifest_roundtrip_and_hostile_input(tmp_path: Path) -> None:
    import json
    import struct
    import zlib

    import xxhash

    index, log, ns = make(tmp_path)
    d = ns.mkdir(ROOT_INO, b"step_1", 0o755, 0, 0)
    f = ns.create(d.ino, b"a.distcp", 0o644, 0, 0)
    ns.write(f.ino, 0, b"z" * 100)
    data = build(index, "n0", 5, {}, 1)
    m = parse(data)
    assert [(e.path, e.type) for e in m.entries] == [("step_1", "d"), ("step_1/a.distcp", "f")]
    assert stat.S_IMODE(m.entries[1].mode) == 0o644
    # GC's parse: the objects table alone, the same as a full parse's
    light = parse(data, entries=False)
    assert light.entries == [] and light.objects == m.objects and m.objects
    assert (light.node, light.seq) == (m.node, m.seq)

    def forge(body: dict) -> bytes:
        raw = zlib.compress(json.dumps(body).encode())
        return b"CKPTMAN1" + struct.pack("<Q", xxhash.xxh3_64_intdigest(raw)) + raw

    good = json.loads(zlib.decompress(data[16:]))
    for path in ("../x", "/abs", "a/../b", "a//b", "a\0b", ""):
        bad = dict(good, entries=[dict(good["entries"][1], path=path)])
        with pytest.raises(ManifestError):
            parse(forge(bad))
    bad_ext = dict(good["entries"][1], extents=[[0, 500, "n0/0000000000000001", 64, 0, 100]])
    with pytest.raises(ManifestError):
        parse(forge(dict(good, entries=[bad_ext])))
    for light_too in (False, True):  # checksum, objects table: checked by both parses
        with pytest.raises(ManifestError):
            parse(data[:-3], entries=light_too)  # truncated
        flipped = bytearray(data)
        flipped[-1] ^= 1
        with pytest.raises(ManifestError):
            parse(bytes(flipped), entries=light_too)
        with pytest.raises(ManifestError):
            parse(forge(dict(good, objects={"n0/x": {}})), entries=light_too)
    close(index, log)


def test_manifest_extents_round_trip_compact_and_are_checked_against_the_objects_table(
        tmp_path: Path) -> None:
    """build streams what parse reads back: every extent as the index has it, across several
    segments (the object of each, and where it starts inside a record after an overwrite).
    parse keeps extents compact (one array per file, object names shared) but they read as
    the lists the format describes. An extent naming an object the table lacks, and an
    objects-table entry that is not an object, are refused."""
    import json
    import struct
    import zlib

    import xxhash

    index, log, ns = make(tmp_path, seg_size=1 << 20)
    d = ns.mkdir(ROOT_INO, b"step_1", 0o755, 0, 0)
    files = {}
    for i, size in enumerate((0, 10, 300_000, 2_500_000)):
        f = ns.create(d.ino, f"f{i}".encode(), 0o644, 0, 0)
        data = random.Random(i).randbytes(size)
        for off in range(0, size, 1 << 20):
            ns.write(f.ino, off, data[off:off + (1 << 20)])
        ns.release(f.ino)
        files[f"step_1/f{i}"] = f.ino
    ns.write(files["step_1/f3"], 100_000, b"x" * 5000)  # an extent starting inside a record
    data = build(index, "n0", 9, {}, 1)
    m = parse(data)
    assert len(m.objects) >= 3, m.objects  # the files span several segments
    for e in m.files():
        want = [[x.start, x.length, f"n0/{x.seg:016x}", x.rec_pos, x.skip, x.rec_len]
                for x in index.iter_extents(files[e.path])]
        assert list(e.extents) == want, e.path
        assert len(e.extents) == len(want)
        if want:
            assert e.extents[0] == want[0] and e.extents[-1] == want[-1]
            assert e.extents[1:] == want[1:]
            assert all(x[2] in m.objects for x in e.extents)

    def forge(body: dict) -> bytes:
        raw = zlib.compress(json.dumps(body).encode())
        return b"CKPTMAN1" + struct.pack("<Q", xxhash.xxh3_64_intdigest(raw)) + raw

    good = json.loads(zlib.decompress(data[16:]))
    assert list(good)[-1] == "objects"  # written last: the walk finds them
    old_order = {k: good[k] for k in good if k != "entries"} | {"entries": good["entries"]}
    assert parse(forge(old_order)).entries == m.entries  # objects first, as versions before
    some = next(iter(good["objects"]))
    with pytest.raises(ManifestError, match="unlisted object"):
        parse(forge(dict(good, objects={o: i for o, i in good["objects"].items()
                                         if o != some})))
    with pytest.raises(ManifestError, match="bad entry"):
        parse(forge(dict(good, objects=dict(good["objects"], **{some: 5}))))
    close(index, log)


def test_group_commit_shares_flushes(tmp_path: Path) -> None:
    index, log, ns = make(tmp_path, seg_size=64 << 20)
    f = ns.create(ROOT_INO, b"f", 0o644, 0, 0).ino

    async def main() -> None:
        async def rank(i: int) -> None:
            ns.write(f, i * 4096, b"r" * 4096)
            await ns.fsync()

        async with trio.open_nursery() as n:
            for i in range(64):
                n.start_soon(rank, i)

    trio.run(main)
    assert log.stats.sync_calls == 64
    assert log.stats.flushes <= 3, log.stats.flushes
    close(index, log)


class _Object:
    """A published object's bytes as the shared store would serve them; counts range reads."""

    def __init__(self, data: bytes):
        self.data = data
        self.reads: list[tuple[int, int]] = []

    def read_range(self, node: str, seg: int, offset: int, length: int) -> bytes:
        self.reads.append((offset, length))
        return self.data[offset:offset + length]


def test_remote_reads_fetch_windows_verify_each_record_and_never_return_bad_bytes() -> None:
    from ckptfs.errors import CorruptData
    from ckptfs.index import Extent
    from ckptfs.reads import REMOTE_WINDOW

    # two files written side by side: their records interleave in one segment
    size = 96 << 10
    rng = __import__("random").Random(5)
    payload = {(ino, k): rng.randbytes(size) for ino in (1, 2) for k in range(12)}
    seg = bytearray(fmt.SEGMENT_HEADER_SIZE)
    exts: dict[int, list[Extent]] = {1: [], 2: []}
    for k in range(12):
        for ino in (1, 2):
            pos = len(seg)
            for p in fmt.encode_record(RecType.WRITE, ino, k * size, 0, len(seg), payload[ino, k]):
                seg += p
            exts[ino].append(Extent(k * size, 7, pos, 0, size, size))
    bad = exts[2][5]  # one of file 2's records is damaged on the store
    flip = bad.rec_pos + fmt.RECORD_HEADER_SIZE + 1000
    seg[flip] ^= 0x40
    obj = _Object(bytes(seg))
    r = Reader(lambda s: "/nonexistent", "n", obj)
    r.forget(7)  # not on local disk: every byte comes from the "shared store"

    whole1 = b"".join(payload[1, k] for k in range(12))
    assert bytes(r.read(exts[1], 0, 12 * size, 12 * size)) == whole1
    # one request per window, not one per record. A window that ends inside a record leaves
    # its head for the next, which reads on from there; the window holding the damaged record
    # stops parsing at it (never stepping over a bad header), so what follows it in that window
    # is fetched again: at most one window more than the object. The first window of the
    # object reads WINDOW_PEEK past its record before it reads on: one request more
    assert len(obj.reads) <= (len(seg) // REMOTE_WINDOW) + 3
    fetched = sum(min(o + n, len(seg)) - o for o, n in obj.reads)
    assert fetched <= len(seg) + REMOTE_WINDOW, obj.reads
    n_first = len(obj.reads)
    # file 2's healthy records came with those windows: read from memory, no new request
    assert bytes(r.read(exts[2][:5], 0, 5 * size, 12 * size)) == b"".join(
        payload[2, k] for k in range(5))
    assert len(obj.reads) == n_first
    # the damaged one is fetched again, fails again: EIO, never the flipped bytes
    with pytest.raises(CorruptData):
        r.read(exts[2][5:6], 5 * size, size, 12 * size)
    assert r.corrupt_reads == 1
    # reads that straddle records join the pieces exactly
    off = 3 * size - 1234
    got = r.read(exts[1], off, 5000, 12 * size)
    assert bytes(got) == whole1[off:off + 5000]
    # read_cached answers only from memory, and never asks the store
    r2 = Reader(lambda s: "/nonexistent", "n", obj)
    r2.forget(7)
    before = len(obj.reads)
    assert r2.read_cached(exts[2][:1], 0, size, 12 * size) is None
    assert len(obj.reads) == before
    r2.read(exts[1][:1], 0, size, 12 * size)
    assert bytes(r2.read_cached(exts[2][:1], 0, size, 12 * size)) == payload[2, 0]
    assert len(obj.reads) <= before + 2  # the window's look past its record, then the rest


def test_remote_cache_holds_no_more_memory_than_it_counts() -> None:
    """Small records between big ones on the shared store: each small read fetches a window
    of which the small record is a sliver. The cache used to keep a view of it, pinning the
    whole window while counting only the record (a reader of 300 such records held 300 MiB
    against a 32 MiB budget). Every cached record must pin at most twice what it counts."""
    from ckptfs.index import Extent
    from ckptfs.reads import REMOTE_WINDOW

    rng = __import__("random").Random(9)
    small, big = 4096, REMOTE_WINDOW + (REMOTE_WINDOW >> 2)
    seg = bytearray(fmt.SEGMENT_HEADER_SIZE)
    smalls: list[tuple[Extent, bytes]] = []
    for k in range(24):
        for ino, n in ((1, small), (2, big)):
            pos = len(seg)
            data = rng.randbytes(n)
            for p in fmt.encode_record(RecType.WRITE, ino, k * n, 0, pos, data):
                seg += p
            if ino == 1:
                smalls.append((Extent(k * n, 7, pos, 0, n, n), data))
    r = Reader(lambda s: "/nonexistent", "n", _Object(bytes(seg)))
    r.forget(7)
    for e, data in smalls:
        assert bytes(r.read([e], e.start, small, 24 * small)) == data
    cached = list(r._remote_cache.values())
    assert len(cached) >= 24
    counted = sum(len(v) for v in cached)
    pinned = sum(len(v.obj) for v in {id(v.obj): v for v in cached}.values())
    assert pinned <= 2 * counted, f"{pinned >> 20} MiB held for {counted >> 10} KiB counted"


def test_read_cached_serves_local_records_from_the_page_cache_only(tmp_path: Path) -> None:
    """The trio thread answers a read inline only if it needs no device: local bytes must be
    in the page cache (preadv2 RWF_NOWAIT), else read_cached says None and the read goes to a
    worker thread, so a cold disk read never stalls every other request."""
    from ckptfs.index import Extent

    if not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("no preadv2(RWF_NOWAIT) on this platform")
    seg = bytearray(fmt.SEGMENT_HEADER_SIZE)
    exts = []
    size = 256 << 10
    payloads = [random.Random(k).randbytes(size) for k in range(4)]
    for k, payload in enumerate(payloads):  # one file written in 4 adjacent records
        exts.append(Extent(k * size, 7, len(seg), 0, size, size))
        for part in fmt.encode_record(RecType.WRITE, 9, k * size, 0, len(seg), payload):
            seg += part
    path = tmp_path / "7.seg"
    path.write_bytes(bytes(seg))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        try:
            os.preadv(fd, [bytearray(4096)], len(seg) - 4096, os.RWF_NOWAIT)
            pytest.skip(f"{tmp_path} keeps its pages (or cannot read without waiting)")
        except BlockingIOError:
            pass
    finally:
        os.close(fd)
    r = Reader(lambda s: str(path))
    whole = b"".join(payloads)
    for off, n in ((0, 4 * size), (size + 100, 5000), (3 * size, size)):
        assert r.read_cached(exts, off, n, 4 * size) is None, (off, n)
    assert r.nowait_misses == 3 and r.corrupt_reads == 0
    assert bytes(r.read(exts, 0, 4 * size, 4 * size)) == whole  # blocking: reads the disk
    for off, n in ((0, 4 * size), (size + 100, 5000), (3 * size, size)):
        assert bytes(r.read_cached(exts, off, n, 4 * size)) == whole[off:off + n], (off, n)
    assert r.nowait_misses == 3


def test_read_cached_without_rwf_nowait_reads_inline() -> None:
    """A local filesystem without preadv2(RWF_NOWAIT) (tmpfs answers EOPNOTSUPP) gets the
    blocking read inline, the behaviour before RWF_NOWAIT was used: exact bytes, no miss."""
    import tempfile

    from ckptfs.index import Extent

    if not hasattr(os, "RWF_NOWAIT") or not os.path.isdir("/dev/shm"):
        pytest.skip("no preadv2(RWF_NOWAIT) or no /dev/shm here")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        path = Path(d) / "7.seg"
        payload = random.Random(7).randbytes(100_000)
        seg = bytearray(fmt.SEGMENT_HEADER_SIZE)
        ext = Extent(0, 7, len(seg), 0, len(payload), len(payload))
        for part in fmt.encode_record(RecType.WRITE, 9, 0, 0, len(seg), payload):
            seg += part
        path.write_bytes(bytes(seg))
        fd = os.open(path, os.O_RDONLY)
        try:
            os.preadv(fd, [bytearray(4096)], 0, os.RWF_NOWAIT)
            pytest.skip("/dev/shm reads without waiting here")
        except OSError as e:
            if e.errno != errno.EOPNOTSUPP:
                raise
        finally:
            os.close(fd)
        r = Reader(lambda s: str(path))
        for _ in range(2):  # the first turns RWF_NOWAIT off, the second reads without it
            assert bytes(r.read_cached([ext], 10, 50_000, len(payload))) == payload[10:50_010]
        assert r.nowait_misses == 0 and r.corrupt_reads == 0


def test_an_extent_never_reads_a_valid_record_other_than_its_own(tmp_path: Path) -> None:
    """An index that got ahead of its log (a device that lost flushed writes, a segment file
    swapped under it) can name a position where another valid record sits now. A checksum
    alone vouches for that record, not for the extent: its kind and length must be what the
    index recorded, or the read is EIO, never someone else's bytes."""
    from ckptfs.errors import CorruptData
    from ckptfs.index import Extent

    seg = bytearray(fmt.SEGMENT_HEADER_SIZE)
    at: dict[str, int] = {}
    for name, rtype, payload in (("short", RecType.WRITE, b"s" * 4000),
                                 ("meta", RecType.SETATTR, b"m" * 5000),
                                 ("own", RecType.WRITE, b"o" * 5000),
                                 ("tail", RecType.WRITE, b"t" * 3000)):
        at[name] = len(seg)
        for part in fmt.encode_record(rtype, 9, 0, 0, len(seg), payload):
            seg += part
    path = tmp_path / "7.seg"
    path.write_bytes(bytes(seg))
    for where in ("local", "remote"):
        if where == "local":
            r = Reader(lambda s: str(path))
        else:
            r = Reader(lambda s: "/nonexistent", "n", _Object(bytes(seg)))
            r.forget(7)
        own = Extent(0, 7, at["own"], 0, 5000, 5000)
        assert bytes(r.read([own], 0, 5000, 5000)) == b"o" * 5000
        for name in ("short", "meta"):  # the index says a 5000-byte WRITE is there
            with pytest.raises(CorruptData):
                r.read([Extent(0, 7, at[name], 0, 5000, 5000)], 0, 5000, 5000)
        assert r.corrupt_reads == 2, where


def test_batch_directories_with_overlapping_ranges_resolve_every_object(tmp_path: Path) -> None:
    """Two streams publish interleaved batches (b1-4 holds 1, 3, 4; b2-5 holds 2, 5), a third
    object goes alone: every id resolves to its own bytes, from this store object and from a
    fresh one (another node), and deleting the last object of a batch removes its directory."""
    from ckptfs.shared import SharedStore

    src = tmp_path / "src"
    src.mkdir()
    content = {seg: os.urandom(1000 + seg) for seg in range(1, 7)}
    for seg, data in content.items():
        (src / f"{seg}.seg").write_bytes(data)
    writer = SharedStore(str(tmp_path / "shared"))
    writer.init()
    assert writer.put_objects("n0", [(s, str(src / f"{s}.seg")) for s in (1, 3, 4)]) == [
        len(content[s]) for s in (1, 3, 4)]
    writer.put_objects("n0", [(s, str(src / f"{s}.seg")) for s in (2, 5)])
    writer.put_objects("n0", [(6, str(src / "6.seg"))])
    root = tmp_path / "shared" / "ckptfs" / "objects" / "n0"
    assert sorted(p.name for p in root.iterdir()) == [
        "0000000000000006.seg", "b0000000000000001-0000000000000004",
        "b0000000000000002-0000000000000005"]
    # mkdir: objects/, objects/n0 (each fsync'd in its parent), and two batch directories
    assert writer.ops["rename"] == 3 and writer.ops["create"] == 6 and writer.ops["mkdir"] == 4
    for store in (writer, SharedStore(str(tmp_path / "shared"))):
        for seg, data in content.items():
            assert store.read_range("n0", seg, 0, len(data)) == data, seg
            assert store.object_size("n0", seg) == len(data)
        assert store.list_objects("n0") == [1, 2, 3, 4, 5, 6]
    reader = SharedStore(str(tmp_path / "shared"))
    for seg in (2, 5):
        reader.delete_object("n0", seg)
    assert not (root / "b0000000000000002-0000000000000005").exists()
    assert reader.list_objects("n0") == [1, 3, 4, 6]
    reader.delete_object("n0", 3)
    assert (root / "b0000000000000001-0000000000000004").is_dir()
    assert SharedStore(str(tmp_path / "shared")).read_range("n0", 4, 0, 10) == content[4][:10]


def test_upload_paused_for_writers_gives_up_when_the_daemon_stops() -> None:
    """An upload paused for the application's writes (`hold`) or waiting out the rate limit
    leaves as soon as the daemon stops, instead of waiting for a resume that never comes."""
    import threading
    import time

    from ckptfs.shared import RateLimiter, UploadStopped

    for paused in (True, False):
        lim = RateLimiter(1.0 if not paused else 0.0)  # 1 B/s: the second take waits ~1e6 s
        if paused:
            lim.hold.set()
        else:
            lim.take(1 << 20)
        out: list[BaseException] = []

        def upload() -> None:
            try:
                lim.take(1 << 20)
            except BaseException as e:  # noqa: BLE001 - the test inspects it
                out.append(e)

        t = threading.Thread(target=upload, daemon=True)
        t.start()
        time.sleep(0.2)
        assert t.is_alive(), "the upload should be waiting"
        t0 = time.monotonic()
        lim.stop.set()
        t.join(5)
        assert not t.is_alive() and time.monotonic() - t0 < 1, "stop did not end the wait"
        assert len(out) == 1 and isinstance(out[0], UploadStopped), out


def test_defrag_merges_small_appends_into_few_records_and_replays_the_same(
        tmp_path: Path) -> None:
    from ckptfs import namespace as nsmod

    index, log, ns = make(tmp_path, seg_size=4 << 20)
    f = ns.create(ROOT_INO, b"log.jsonl", 0o644, 0, 0).ino
    g = ns.create(ROOT_INO, b"mixed", 0o644, 0, 0).ino
    model = bytearray()
    for i in range(3000):  # a log grown line by line
        line = f"{i} loss={i * 0.001:.4f}\n".encode()
        ns.write(f, len(model), line)
        model += line
    assert f in ns.defrag_due  # small writes past the threshold queue the file
    gm = bytearray(300_000)  # a hole, small writes, a big write, a hole, small writes
    for off in range(1000, 20_000, 100):
        ns.write(g, off, bytes([off % 251]) * 100)
        gm[off:off + 100] = bytes([off % 251]) * 100
    big = os.urandom(100_000)
    ns.write(g, 20_000, big)
    gm[20_000:120_000] = big
    for off in range(150_000, 300_000, 50):
        ns.write(g, off, bytes([off % 13 + 1]) * 50)
        gm[off:off + 50] = bytes([off % 13 + 1]) * 50
    mtime = index.get_inode(f).mtime_ns
    before_f = len(list(index.iter_extents(f)))
    assert before_f == 3000

    ns.defrag(f)
    ns.defrag(g)
    ext_f = list(index.iter_extents(f))
    per_run = nsmod.DEFRAG_RUN_EXTENTS
    runs = -(-3000 // per_run)
    # 3000 lines of ~20 bytes: one record per DEFRAG_RUN_EXTENTS lines, back to back
    assert [e.start for e in ext_f] == [0] + [e.end for e in ext_f[:-1]]
    assert len(ext_f) == runs, [(e.start, e.length) for e in ext_f]
    ext_g = [(e.start, e.length) for e in index.iter_extents(g)]
    # the holes stay holes, the big write is not copied, each run of small writes is merged
    assert ext_g[0] == (1000, 19_000) and ext_g[1] == (20_000, 100_000), ext_g
    assert ext_g[2][0] == 150_000 and sum(n for _s, n in ext_g[2:]) == 150_000
    assert len(ext_g) == 2 + runs, ext_g
    assert ns.read(f, 0, 1 << 20) == bytes(model)
    assert ns.read(g, 0, 1 << 20) == bytes(gm)
    assert index.get_inode(f).mtime_ns == mtime  # the content did not change: no times
    assert ns.defrag_records == 2 * runs + 1 and ns.defrag_extents == 3000 + 190 + 3000
    ns.defrag(f)
    assert ns.defrag_records == 2 * runs + 1  # nothing left to merge

    # the RELOC records replay into the same map
    close(index, log)
    import shutil

    shutil.rmtree(tmp_path / "index")
    index2 = Index(str(tmp_path / "index"))
    log2 = SegmentLog(str(tmp_path / "segments"), "t0", 4 << 20)
    assert not replay(index2, log2).corruption
    ns2 = Namespace(index2, log2, Reader(log2.path))
    assert [(e.start, e.length) for e in index2.iter_extents(f)] == \
        [(e.start, e.length) for e in ext_f]
    assert [(e.start, e.length) for e in index2.iter_extents(g)] == ext_g
    assert ns2.read(f, 0, 1 << 20) == bytes(model)
    assert ns2.read(g, 0, 1 << 20) == bytes(gm)
    # a damaged small record is never copied into a fresh checksum: the step fails (EIO)
    k = ns2.create(ROOT_INO, b"k", 0o644, 0, 0).ino
    for i in range(40):
        ns2.write(k, i * 10, bytes([65 + i % 26]) * 10)
    before = list(index2.iter_extents(k))
    bad = before[17]
    with open(log2.path(bad.seg), "r+b") as fh:
        fh.seek(bad.rec_pos + fmt.RECORD_HEADER_SIZE + bad.skip + 3)
        fh.write(b"\0")
    with pytest.raises(FsError) as exc:
        ns2.defrag(k)
    assert exc.value.errno == errno.EIO
    assert list(index2.iter_extents(k)) == before  # the run was not merged
    with pytest.raises(FsError):
        ns2.read(k, 170, 10)
    # the per-file counters stay bounded whatever the number of files
    hot = ns2.create(ROOT_INO, b"hot", 0o644, 0, 0).ino
    for i in range(5):
        ns2.write(hot, i, b"h")
    for i in range(nsmod.DEFRAG_TRACKED + 10):
        ino = ns2.create(ROOT_INO, f"c{i}".encode(), 0o644, 0, 0).ino
        ns2.write(ino, 0, b"one small write")
    assert len(ns2.small_writes) <= nsmod.DEFRAG_TRACKED
    assert ns2.small_writes[hot][0] == 5  # the busiest files are kept
    close(index2, log2)


def raw_records(path: str) -> list[tuple[int, int, int]]:
    """(position, type, length) of every record in a segment file, PAD records included,
    read straight from the bytes (not through scan_segment, which skips PAD)."""
    out = []
    with open(path, "rb") as fh:
        data = fh.read()
    pos = fmt.SEGMENT_HEADER_SIZE
    while pos + fmt.RECORD_HEADER_SIZE <= len(data):
        hdr = fmt.decode_header(data[pos:pos + fmt.RECORD_HEADER_SIZE])
        if hdr is None:
            break
        out.append((pos, hdr[0], hdr[1]))
        assert fmt.verify_record(data[pos:pos + fmt.RECORD_HEADER_SIZE + hdr[1]])
        if hdr[0] == RecType.SEAL:
            break
        pos += fmt.record_size(hdr[1])
    return out


@pytest.mark.parametrize("direct,copied", [(True, False), (True, True), (False, False)],
                         ids=["direct", "direct-copied", "buffered"])
def test_big_writes_go_around_the_page_cache_aligned_and_replay_the_same(
        tmp_path: Path, direct: bool, copied: bool) -> None:
    """Data records of DIRECT_MIN bytes and more are written with O_DIRECT on 4 KiB
    boundaries with PAD records around them, their payload from where it lies in memory
    (or copied whole into the staging buffer); small records stay buffered. Reads, the
    sealed table and a replay from the log alone see exactly the same files every way."""
    from ckptfs import log as logmod

    index, log, ns = make(tmp_path, seg_size=8 << 20)
    if not direct:
        log.direct_min = 0
    if copied:
        log.zero_copy_min = 0
    sizes = [300 << 10, 5000, logmod.DIRECT_MIN, logmod.DIRECT_MIN - 8, 1 << 20, 77,
             (1 << 20) + 13, 200 << 10, 4096]
    rnd = random.Random(5)
    files: dict[int, bytearray] = {}
    big = 0
    for i, n in enumerate(sizes * 3):
        node = ns.create(ROOT_INO, f"f{i}".encode(), 0o644, 0, 0)
        data = rnd.randbytes(n)
        ns.write(node.ino, 0, data)
        files[node.ino] = bytearray(data)
        if n >= logmod.DIRECT_MIN:
            big += 1
        if i % 4 == 0:  # an overwrite in the middle, small, of an earlier file
            ino = rnd.choice(list(files))
            off = rnd.randrange(len(files[ino]))
            patch = rnd.randbytes(100)
            ns.write(ino, off, patch)
            files[ino][off:off + 100] = patch
    assert log.stats.direct_records == (big if direct else 0)
    # the big payloads are `bytes`: written from where they lie, not copied
    assert log.stats.zero_copy_records == (big if direct and not copied else 0)
    for ino, want in files.items():
        assert ns.read(ino, 0, 2 << 20) == bytes(want)

    segs = log.existing()
    ns.seal("wait")
    pads = directs = 0
    for seg in segs:
        path = log.path(seg)
        raw = raw_records(path)
        scanned = [r for r in fmt.scan_segment(path)]
        assert [(r.pos, r.type) for r in scanned] == \
            [(p, t) for p, t, _n in raw if t != RecType.PAD]
        for i, (p, t, n) in enumerate(raw):
            end = p + fmt.record_size(n)
            if t == RecType.WRITE and n >= logmod.DIRECT_MIN and direct:
                # its write starts on a boundary: the record itself, or a PAD right before
                # it (which places a zero-copy payload as it lies in memory); and ends on one
                directs += 1
                start = p
                if p % logmod.ALIGN:
                    pp, pt, pn = raw[i - 1]
                    assert pt == RecType.PAD and pp + fmt.record_size(pn) == p, p
                    start = pp
                assert start % logmod.ALIGN == 0, f"direct write at {start} not aligned"
                if end % logmod.ALIGN:
                    np_, nt, nn = raw[i + 1]
                    assert nt == RecType.PAD and np_ == end, end
                    end = np_ + fmt.record_size(nn)
                assert end % logmod.ALIGN == 0, f"direct write ends at {end}, not aligned"
            elif t == RecType.PAD:
                pads += 1
                # a PAD fills up to a boundary, or from one up to a direct record
                nxt = raw[i + 1] if i + 1 < len(raw) else None
                assert end % logmod.ALIGN == 0 or (
                    p % logmod.ALIGN == 0 and nxt is not None and nxt[0] == end
                    and nxt[1] == RecType.WRITE and nxt[2] >= logmod.DIRECT_MIN), (p, n)
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            sealed = fmt.SealedSegment(path, size, lambda o, n: os.pread(fh.fileno(), n, o))
            assert [(r.pos, r.type) for r in sealed.records()] == \
                [(r.pos, r.type) for r in scanned if r.type != RecType.SEAL]
    assert directs == (big if direct else 0)
    assert (pads > 0) == direct
    state = {(i.ino, i.size) for i in index.iter_inodes()}
    close(index, log)

    index2, log2, ns2 = reopen(tmp_path, 8 << 20)
    assert {(i.ino, i.size) for i in index2.iter_inodes()} == state
    for ino, want in files.items():
        assert ns2.read(ino, 0, 2 << 20) == bytes(want)
    close(index2, log2)


def test_torn_direct_record_is_the_end_of_the_log(tmp_path: Path) -> None:
    """A direct write cut short by a crash (power loss: only part of it reached the disk)
    is a torn tail like any other: everything before it replays, nothing of it does."""
    index, log, ns = make(tmp_path, seg_size=64 << 20)
    a = ns.create(ROOT_INO, b"a", 0o644, 0, 0).ino
    first = os.urandom(600 << 10)
    ns.write(a, 0, first)
    b = ns.create(ROOT_INO, b"b", 0o644, 0, 0).ino
    ns.write(b, 0, os.urandom(700 << 10))
    path = log.path(log.seg_id)
    last = [r for r in fmt.scan_segment(path, newest=True) if r.type == RecType.WRITE][-1]
    trio.run(log.sync)
    log.close()
    index.close()
    with open(path, "r+b") as fh:  # the device kept the first 64 KiB of the last write
        fh.truncate(last.pos + (64 << 10))
    index2, log2, ns2 = reopen(tmp_path, 64 << 20)
    assert ns2.read(a, 0, 1 << 20) == first
    assert index2.get_inode(b) is not None and index2.get_inode(b).size == 0
    close(index2, log2)


def test_segment_versions_one_and_two_are_read_and_others_refused() -> None:
    import struct

    import xxhash

    def header(version: int) -> bytes:
        head = struct.pack("<8sIIQq16s", fmt.SEGMENT_MAGIC, version, 0, 7, 1, b"n")
        return head + fmt.CSUM.pack(xxhash.xxh3_64_intdigest(head)) + bytes(8)

    assert fmt.parse_segment_header(fmt.segment_header(7, "n", 1), "x")[0] == 7
    for v in (1, 2):
        assert fmt.parse_segment_header(header(v), "x")[0] == 7
    with pytest.raises(fmt.CorruptRecord, match="unsupported segment version 3"):
        fmt.parse_segment_header(header(3), "x")


@pytest.mark.parametrize("sealed", [True, False])
def test_records_inside_a_damaged_records_payload_are_never_applied(tmp_path: Path,
                                                                      sealed: bool) -> None:
    """A file's data may hold bytes that are valid records (a copied segment, say). When the
    header of the record carrying them is damaged, replay must not take them for the log's
    own records: in a sealed segment only its record table's positions count; in the active
    segment the scan stops there."""
    index, log, ns = make(tmp_path, seg_size=16 << 20)
    keep = ns.create(ROOT_INO, b"important", 0o644, 0, 0).ino
    ns.write(keep, 0, b"k" * 100)
    forged = b"".join(bytes(p) for p in fmt.encode_record(
        RecType.UNLINK, ROOT_INO, 0, 1, log.seq + 1000, b"important"))
    carrier = ns.create(ROOT_INO, b"copy", 0o644, 0, 0).ino
    ns.write(carrier, 0, forged + bytes(4000))
    ns.create(ROOT_INO, b"after", 0o644, 0, 0)
    pos = index.extents_in(carrier, 0, 1)[0].rec_pos
    seg = log.seg_id
    if sealed:
        ns.seal("idle")
    trio.run(log.sync)
    close(index, log)
    with open(log.path(seg), "r+b") as fh:  # the carrier's header: bad magic
        fh.seek(pos)
        fh.write(b"\0\0\0\0")
    index2, log2, ns2 = reopen_allowing_corruption(tmp_path, 16 << 20)
    assert index2.lookup(ROOT_INO, b"important") == keep, "a record inside data was applied"
    assert ns2.read(keep, 0, 100) == b"k" * 100
    # sealed: the table knows where the next record starts, so what follows is kept
    assert (index2.lookup(ROOT_INO, b"after") is not None) == sealed
    close(index2, log2)


def reopen_allowing_corruption(root: Path, seg_size: int) -> tuple[Index, SegmentLog, Namespace]:
    shutil.rmtree(root / "index")
    index = Index(str(root / "index"))
    log = SegmentLog(str(root / "segments"), "t0", seg_size)
    rep = replay(index, log)
    assert rep.corruption  # the damage is reported
    return index, log, Namespace(index, log, Reader(log.path))


def test_a_seal_torn_before_its_footer_is_finished_at_replay(tmp_path: Path) -> None:
    """The daemon died with a segment's SEAL record on disk but not its footer: replay
    writes the footer, so the segment reads as sealed (the drain can publish it) and nothing
    in it is lost."""
    index, log, ns = make(tmp_path, seg_size=16 << 20)
    f = ns.create(ROOT_INO, b"f", 0o644, 0, 0).ino
    ns.write(f, 0, b"x" * 3000)
    seg = ns.seal("idle")
    g = ns.create(ROOT_INO, b"g", 0o644, 0, 0).ino  # a newer segment
    trio.run(log.sync)
    close(index, log)
    path = log.path(seg)
    size = os.path.getsize(path)
    os.truncate(path, size - fmt.FOOTER_SIZE)
    index2, log2, ns2 = reopen(tmp_path, 16 << 20)
    assert os.path.getsize(path) == size
    with open(path, "rb") as fh:
        sealed = fmt.SealedSegment(path, size, lambda o, n: os.pread(fh.fileno(), n, o))
        assert len(list(sealed.records())) >= 2
    assert ns2.read(f, 0, 3000) == b"x" * 3000
    assert index2.lookup(ROOT_INO, b"g") == g
    close(index2, log2)
