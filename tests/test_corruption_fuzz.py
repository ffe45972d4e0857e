"""Randomized corruption of log segments: EIO for the damaged extent, never wrong bytes.

The promise checked (docs/architecture.md section 9, docs/format.md sections 1.4 and 2): a
corrupted segment makes reads of the damaged extent fail with EIO and never returns other bytes,
zeros included, and `ckptfs replay` reports the corruption (segment and offset) instead of
crashing.

One source filesystem is built per module, through a real mount with 1 MiB segments: files of
every size class the write path treats differently (empty, tiny, around 4 KiB, just under and
over the 128 KiB O_DIRECT threshold, several MiB written 1 MiB at a time, small appends that the
defragmenter merges into RELOC records, a file with a hole and one with written zeros), plus
mkdir, rename of a file and of a directory, symlinks and an unlink. Every file is written once,
with random bytes, so no older version of a block exists that could be mistaken for the right
one. The source waits until everything is published, then unmounts cleanly.

Each iteration copies NVME and SHARED, damages one to three segments with a seeded RNG (bit
flips, random or zero overwrites, a cut off end) in the segment header, record headers,
payloads, PAD and SEAL records and footers, and checks two modes on two copies of the damage:

- (a) the index intact: a mount reads every file. The namespace is exactly the original, every
  4 KiB block is its original bytes or EIO, a block whose live record (per the source's index)
  was damaged is EIO when no intact copy exists, and every other block reads correctly.
- (b) the index deleted: `ckptfs replay NVME --shared SHARED --json` must not crash, must exit
  1 and name every segment whose checksummed bytes changed (0 and no corruption when none did),
  then a mount reads what is there. Paths that appear must be names the source used, of the
  same kind; a block is its original bytes or EIO, never zeros (unless it was written as
  zeros) or other bytes, except where replay cannot know what was there (below).

Both modes end with a new file written and read back and a clean unmount. Two scenarios: SHARED
holds intact published copies of every segment (a read may heal from it: serving the intact
copy is allowed), or SHARED's objects are removed, so the damaged local copy is the only one
(then a read of a damaged live record must fail).

What the promise is taken to allow (the assumptions; `classify` and `check_file` apply them):

- Mode (b) may lose namespace operations whose records were damaged: a file or directory
  whose CREATE was lost is missing (with everything below it), a lost RENAME leaves the old
  name, a lost UNLINK brings the file back under its old name with its original bytes. When no
  metadata record was damaged, the namespace must be exact in mode (b) too.
- A damaged data record in a sealed segment whose SEAL table is intact is always identified
  by the table, so its range reads as EIO, never as zeros. Zeros, and a size cut short by
  them, are allowed only for *lost* records: in a segment whose SEAL record is damaged or
  cut off (or, for the newest segment, its footer), the data records from the first damaged
  record on (without a table a damaged length field decides where the scan resumes); and all
  records of the newest segment when its header is damaged (a header of zeros there is taken
  for one that never reached the disk before a power loss: an empty tail, removed). An older
  segment whose header is damaged is still read record by record, through its table when it
  has one.
- A file never grows, except when a segment has neither a table nor an intact header for one
  of its damaged data records: replay then trusts that header's ino and offset (the frame
  looking intact), so EIO may appear anywhere and a size may be larger.
- The newest segment's SEAL record and footer are its tail: damage there is a torn tail, the
  end of the log, not corruption. The fuzzer damages either the newest segment's tail or its
  body, never both, and asserts no report for the former.
- Bytes no checksum covers (record padding, the reserved last 8 bytes of the segment header,
  the footer, which replay rewrites from its verified SEAL record) need not be reported.

The default run does DEFAULT_ITERS iterations per scenario with a fixed seed, plus focused
tests of what the fuzzer found. Run the long versions with
`pytest -m slow tests/test_corruption_fuzz.py`: CKPTFS_FUZZ_ITERS (default 200) iterations
per scenario from CKPTFS_FUZZ_SEED (default: random, printed); CKPTFS_FUZZ_START with
CKPTFS_FUZZ_ITERS=1 reruns one iteration. A failure names the seed, the iteration and the
exact damage applied (segment, byte range, bytes that changed, what was aimed at).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from mounting import MakeMount, Mount, run_cli, wait_for
from test_replay import read_blocks

from ckptfs import segment as fmt
from ckptfs.index import Index
from ckptfs.segment import RecType

KiB, MiB = 1 << 10, 1 << 20
BLOCK = 4096
DIRECT_MIN = 128 * KiB
# eviction would move reads of a local-only segment to a SHARED that lacks it: keep the
# segments local whatever the disk's fill level
MOUNT_ARGS = ("--high-watermark", "0.999", "--low-watermark", "0.998")

SCENARIOS = ["local-only", "shared-intact"]
DEFAULT_ITERS = 2  # per scenario in the default run (the long run: -m slow)
LONG_ITERS = int(os.environ.get("CKPTFS_FUZZ_ITERS", "200"))
LONG_START = int(os.environ.get("CKPTFS_FUZZ_START", "0"))


# -- the source filesystem ------------------------------------------------------------------


@dataclass
class Entity:
    """A file, directory or symlink the source made: every path it ever had, its content."""

    kind: str  # "f", "d" or "l"
    names: list[str]
    final: str | None  # None once unlinked
    data: bytes = b""
    target: str = ""
    ino: int = 0


@dataclass
class Rec:
    """One record of a pristine segment."""

    pos: int
    type: int
    length: int
    ino: int
    offset: int

    @property
    def checked_end(self) -> int:  # header + payload: what the checksum covers
        return self.pos + fmt.RECORD_HEADER_SIZE + self.length

    @property
    def frame_end(self) -> int:
        return self.pos + fmt.record_size(self.length)

    def describe(self) -> str:
        name = RecType.NAMES.get(self.type, str(self.type))
        extra = (f" ino {self.ino} file offset {self.offset} len {self.length}"
                 if self.type in fmt.DATA_TYPES else f" len {self.length}")
        return f"{name}@{self.pos}{extra}"


@dataclass
class SegLayout:
    name: str
    size: int
    recs: list[Rec]  # every record in order, PADs and the SEAL included
    seal_pos: int
    newest: bool


@dataclass
class Source:
    nvme: Path
    shared: Path
    entities: list[Entity]
    segs: dict[str, SegLayout]
    # ino -> live extents (file start, file end, segment name, record position), from the index
    live: dict[int, list[tuple[int, int, str, int]]]

    def by_path(self) -> dict[str, Entity]:
        return {n: e for e in self.entities for n in e.names}


class Builder:
    """Makes the source tree through the mount and remembers what it made."""

    def __init__(self, mnt: Path, rng: random.Random):
        self.mnt = mnt
        self.rng = rng
        self.entities: list[Entity] = []
        self.used: set[str] = set()

    def _name(self, rel: str) -> None:
        assert rel not in self.used, f"source reuses the name {rel}"
        self.used.add(rel)

    def mkdir(self, rel: str) -> None:
        parts = rel.split("/")
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            if sub not in self.used:
                self._name(sub)
                os.mkdir(self.mnt / sub)
                self.entities.append(Entity("d", [sub], sub))

    def file(self, rel: str, data: bytes, chunks: list[int] | None = None,
             at: list[int] | None = None) -> Entity:
        """Write `data` once: in writes of the given sizes (default: one write), or, with
        `at`, only the pieces starting at those offsets (chunks give their lengths), leaving
        holes between them."""
        parent = rel.rpartition("/")[0]
        if parent:
            self.mkdir(parent)
        self._name(rel)
        fd = os.open(self.mnt / rel, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            if at is not None:
                assert chunks is not None
                for off, n in zip(at, chunks):
                    assert os.pwrite(fd, data[off:off + n], off) == n
                assert at[-1] + chunks[-1] == len(data)
            else:
                off = 0
                for n in chunks or [len(data)]:
                    piece = data[off:off + n]
                    while piece:
                        w = os.write(fd, piece)
                        piece = piece[w:]
                    off += n
                assert off == len(data)
            os.fsync(fd)
            ino = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        ent = Entity("f", [rel], rel, data=data, ino=ino)
        self.entities.append(ent)
        return ent

    def random_file(self, rel: str, size: int, chunk: int | None = None) -> Entity:
        data = self.rng.randbytes(size)
        chunks = None if chunk is None else [min(chunk, size - o) for o in range(0, size, chunk)]
        return self.file(rel, data, chunks)

    def appends(self, rel: str, sizes: list[int]) -> Entity:
        data = self.rng.randbytes(sum(sizes))
        return self.file(rel, data, sizes)

    def symlink(self, rel: str, target: str) -> None:
        self._name(rel)
        os.symlink(target, self.mnt / rel)
        self.entities.append(Entity("l", [rel], rel, target=target))

    def rename(self, old: str, new: str) -> None:
        self._name(new)
        os.rename(self.mnt / old, self.mnt / new)
        for ent in self.entities:
            if ent.final is not None and (ent.final == old or ent.final.startswith(old + "/")):
                ent.final = new + ent.final[len(old):]
                if ent.final != new:
                    self._name(ent.final)  # a file below a renamed directory
                ent.names.append(ent.final)

    def unlink(self, rel: str) -> None:
        os.unlink(self.mnt / rel)
        for ent in self.entities:
            if ent.final == rel:
                ent.final = None

    def fsync_dirs(self) -> None:
        fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)  # fsync covers every record appended before it (architecture.md)
        finally:
            os.close(fd)


def populate(b: Builder) -> None:
    rng = b.rng
    # Every size class the write path treats differently, in an order that mixes them.
    sized = [("empty", 0, None), ("tiny/t1", 1, None), ("tiny/t7", 7, None),
             ("tiny/t100", 100, None), ("tiny/t1000", 1000, None), ("tiny/t4095", 4095, None),
             ("mid/m4096", 4096, None), ("mid/m5000", 5000, None), ("mid/m5003", 5003, None),
             ("mid/m65k", 64 * KiB + 11, None),
             ("edge/under-128k", DIRECT_MIN - 8, None), ("edge/just-under", DIRECT_MIN - 1, None),
             ("edge/at-128k", DIRECT_MIN, None), ("edge/over-128k", DIRECT_MIN + 1, None),
             ("edge/over-200k", 200_000, None),
             ("big/b1m", MiB, MiB), ("big/b2m", 2 * MiB + 123, MiB),
             ("big/b3m5", 3 * MiB + MiB // 2, MiB)]
    rng.shuffle(sized)
    half = len(sized) // 2
    for rel, size, chunk in sized[:half]:
        b.random_file(rel, size, chunk)
    # written zeros (must read as zeros or EIO) and a real hole (reads as zeros)
    zeros = rng.randbytes(BLOCK) + bytes(2 * BLOCK) + rng.randbytes(BLOCK + 77)
    b.file("holes/written-zeros", zeros)
    sparse = bytearray(300_000 + 5000)
    sparse[:5000] = rng.randbytes(5000)
    sparse[300_000:] = rng.randbytes(5000)
    b.file("holes/sparse", bytes(sparse), chunks=[5000, 5000], at=[0, 300_000])
    # namespace operations
    b.mkdir("emptydir")
    b.mkdir("deep/a/b/c")
    b.random_file("deep/a/b/c/leaf", 3000)
    b.random_file("ren/old-name", 20_000)
    b.random_file("olddir/x", 9000)
    b.random_file("olddir/y", 150_000)
    b.random_file("gone/victim", 70_000)
    b.random_file("gone/keeper", 3000)
    b.rename("ren/old-name", "ren/new-name")
    b.rename("olddir", "newdir")
    b.unlink("gone/victim")
    b.mkdir("links")
    b.symlink("links/to-big", "../big/b3m5")
    b.symlink("links/dangling", "no/such/target")
    b.fsync_dirs()
    for rel, size, chunk in sized[half:]:
        b.random_file(rel, size, chunk)
    # small appends: more than 256 writes under 4 KiB make the defragmenter merge them into
    # RELOC records; bigger appends stay one record each
    b.appends("logs/a-tiny", [rng.randint(1, 64) for _ in range(300)])
    b.appends("logs/a-mid", [rng.randint(2000, 3000) for _ in range(40)])
    b.appends("logs/a-4k", [rng.randint(4096, 9000) for _ in range(16)])


def status(mnt: Path) -> dict[str, Any]:
    res = run_cli("status", mnt, "--json")
    assert res.rc == 0, str(res)
    return json.loads(res.out)


def parse_layout(path: Path, newest: bool) -> SegLayout:
    blob = path.read_bytes()
    foot = fmt.parse_footer(blob[-fmt.FOOTER_SIZE:])
    assert foot is not None, f"source segment {path.name} is not sealed"
    seal_pos = foot[0]
    recs: list[Rec] = []
    pos = fmt.SEGMENT_HEADER_SIZE
    while True:
        hdr = fmt.decode_header(blob[pos:pos + fmt.RECORD_HEADER_SIZE])
        assert hdr is not None, f"source segment {path.name}: no record at {pos}"
        recs.append(Rec(pos, hdr[0], hdr[1], hdr[2], hdr[3]))
        if hdr[0] == RecType.SEAL:
            break
        pos += fmt.record_size(hdr[1])
    assert recs[-1].pos == seal_pos
    assert recs[-1].frame_end + fmt.FOOTER_SIZE == len(blob)
    return SegLayout(path.name, len(blob), recs, seal_pos, newest)


def live_extents(nvme: Path, scratch: Path, inos: set[int]
                 ) -> dict[int, list[tuple[int, int, str, int]]]:
    """Each file's extents as the source's index has them (read from a copy of it)."""
    shutil.copytree(nvme / "index", scratch)
    index = Index(str(scratch))
    try:
        return {ino: [(e.start, e.end, fmt.segment_name(e.seg), e.rec_pos)
                      for e in index.iter_extents(ino)] for ino in inos}
    finally:
        index.close(commit=False)
        shutil.rmtree(scratch)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Source]:
    root = tmp_path_factory.mktemp("fuzz-source")
    # Big records as the log writes them while the disk is behind: with O_DIRECT, between
    # PADs (format.md section 1.6), the layout the focused tests below damage ("the record
    # after it" is such a PAD). Through the page cache, the default, a big record is laid out
    # like the small ones the source has plenty of.
    m = Mount(root / "m", MOUNT_ARGS, segment_size="1M",
              env={**os.environ, "CKPTFS_BUFFERED_WRITES": "0"})
    b = Builder(m.mnt, random.Random(20261205))
    try:
        m.start()
        populate(b)
        # let the defragmenter merge the small appends now, so its RELOC records are part of
        # the source (it runs every second), then publish everything and unmount
        wait_for(lambda: status(m.mnt)["defrag"]["records"] >= 1, 30,
                 "the defragmenter to merge logs/a-tiny")
        res = run_cli("wait", m.mnt, "--timeout", "60", timeout=90)
        assert res.rc == 0, str(res)
        m.unmount()
    finally:
        problems = m.teardown()
    assert not problems, problems
    segs = sorted((m.nvme / "segments").glob("*.seg"))
    assert len(segs) >= 5, f"expected ~8 MiB in 1 MiB segments: {segs}"
    layouts = {p.name: parse_layout(p, p == segs[-1]) for p in segs}
    objects = sorted(p.name for p in (m.shared / "ckptfs" / "objects").rglob("*.seg"))
    assert objects == [p.name for p in segs], (
        f"`ckptfs wait` and a clean unmount should leave every segment published: "
        f"{objects} vs {[p.name for p in segs]}")
    live = live_extents(m.nvme, root / "index-copy", {e.ino for e in b.entities if e.ino})
    yield Source(m.nvme, m.shared, b.entities, layouts, live)


# -- damage ---------------------------------------------------------------------------------


@dataclass
class Damage:
    seg: str
    start: int
    end: int  # exclusive; for a cut, the old size
    kind: str  # "flip", "random", "zeros", "cut"
    region: str  # what was aimed at
    changed: list[tuple[int, int]] = field(default_factory=list)  # byte ranges really changed

    def __str__(self) -> str:
        ch = ",".join(f"{a}-{b}" for a, b in self.changed[:4]) or "nothing"
        return (f"{self.seg} {self.kind} [{self.start},{self.end}) aimed at {self.region}; "
                f"changed {ch}")


def _span(rng: random.Random) -> int:
    return rng.choice([1, 1, 2, 3, 8, 16, 56, 64, 200, 512, 1024, 4096])


def pick_range(rng: random.Random, lay: SegLayout, body_only: bool, tail_only: bool
               ) -> tuple[int, int, str]:
    """A byte range of the segment to damage and what it was aimed at."""
    data_recs = [r for r in lay.recs if r.type in fmt.DATA_TYPES]
    other = [r for r in lay.recs if r.type != RecType.SEAL]
    seal = lay.recs[-1]
    if tail_only:
        target = rng.choice(["seal", "seal", "footer", "tail"])
    else:
        choices = ["seghdr", "rechdr", "rechdr", "rechdr", "payload", "payload", "payload",
                   "anywhere", "anywhere"]
        if not body_only:
            choices += ["seal", "footer", "tail"]
        target = rng.choice(choices)
    n = _span(rng)
    if target == "seghdr":
        a = rng.randrange(fmt.SEGMENT_HEADER_SIZE)
        return a, a + min(n, 64), "segment header"
    if target in ("rechdr", "payload"):
        pool = data_recs if data_recs and rng.random() < 0.6 else other
        r = rng.choice(pool)
        if target == "payload" and r.length:
            a = r.pos + fmt.RECORD_HEADER_SIZE + rng.randrange(r.length)
            return a, a + n, f"payload of {r.describe()}"
        a = r.pos + rng.randrange(fmt.RECORD_HEADER_SIZE)
        return a, a + min(n, 16), f"header of {r.describe()}"
    if target == "seal":
        a = rng.randrange(seal.pos, seal.checked_end)
        return a, a + n, f"SEAL record@{seal.pos}"
    if target == "footer":
        a = lay.size - fmt.FOOTER_SIZE + rng.randrange(fmt.FOOTER_SIZE)
        return a, a + min(n, 8), "footer"
    if target == "tail":
        a = lay.size - rng.randint(1, min(600, lay.size - lay.seal_pos))
        return a, a + n, "the segment's tail"
    a = rng.randrange(lay.size)
    return a, a + n, "anywhere"


def damage_segment(rng: random.Random, path: Path, lay: SegLayout) -> list[Damage]:
    """Apply 1-3 random damages to one segment file. The newest segment is damaged either
    in its body (below its SEAL record) or in its tail (SEAL record, footer), never both: a
    damaged tail of the newest segment is a torn tail, legitimately the end of the log."""
    blob = bytearray(path.read_bytes())
    orig = bytes(blob)
    body_only = tail_only = False
    if lay.newest:
        tail_only = rng.random() < 0.3
        body_only = not tail_only
    out: list[Damage] = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        if not lay.newest and rng.random() < 0.06:
            cut = rng.randrange(lay.size - 4096, lay.size) if rng.random() < 0.7 \
                else rng.randrange(fmt.SEGMENT_HEADER_SIZE, lay.size)
            if cut < len(blob):
                out.append(Damage(lay.name, cut, len(blob), "cut",
                                  f"cut at {cut} of {lay.size}"))
                del blob[cut:]
            continue
        a, b, region = pick_range(rng, lay, body_only, tail_only)
        lo, hi = (lay.seal_pos, lay.size) if tail_only else (0, lay.seal_pos if body_only
                                                             else lay.size)
        a, b = max(a, lo), min(b, hi, len(blob))
        if a >= b:
            continue
        kind = rng.choice(["flip", "flip", "random", "zeros"])
        if kind == "flip":
            for _ in range(rng.randint(1, 8)):
                blob[rng.randrange(a, b)] ^= 1 << rng.randrange(8)
        elif kind == "random":
            blob[a:b] = rng.randbytes(b - a)
        else:
            blob[a:b] = bytes(b - a)
        out.append(Damage(lay.name, a, b, kind, region))
    path.write_bytes(bytes(blob))
    for d in out:
        if d.kind == "cut":
            d.changed = [(d.start, d.end)] if d.start < lay.size else []
            continue
        run: int | None = None
        for i in range(d.start, d.end):
            diff = i < len(blob) and blob[i] != orig[i]
            if diff and run is None:
                run = i
            if not diff and run is not None:
                d.changed.append((run, i))
                run = None
        if run is not None:
            d.changed.append((run, d.end))
    return out


@dataclass
class Effect:
    """What the damage did, in terms of the pristine layout."""

    detectable: set[str] = field(default_factory=set)  # segments replay must report
    # data records (segment, position) whose checksummed bytes changed: a read must fail
    changed: set[tuple[str, int]] = field(default_factory=set)
    # ino -> file ranges of those records (live or dead): reads there may fail with EIO
    risk: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    # ino -> file ranges of data records a full replay cannot identify, so they may become
    # holes (zeros) or fall past a shorter size. In a segment with no trustworthy SEAL table
    # (SEAL record damaged or cut off; the newest segment's footer too): every data record
    # from the first damaged record on, because without a table the scan resumes after a bad
    # record where its (possibly damaged) length says, never inside a frame it cannot trust
    # (format.md 1.4).
    # And every record of the newest segment when its header is damaged (a zeroed header
    # there is an empty tail after a power loss, removed).
    lost: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    headerless: set[str] = field(default_factory=set)  # segments whose header was damaged
    metadata_lost: bool = False  # a namespace record (or a segment holding one) was damaged
    # a data record's header and its segment's table both damaged: nothing says which file
    # and offset the record was for, yet its frame may look intact and be applied
    untrusted_headers: bool = False


def classify(src: Source, damages: list[Damage]) -> Effect:
    eff = Effect()
    by_seg: dict[str, list[tuple[int, int]]] = {}
    for d in damages:
        by_seg.setdefault(d.seg, []).extend(d.changed)

    def add(ranges: dict[int, list[tuple[int, int]]], r: Rec) -> None:
        ranges.setdefault(r.ino, []).append((r.offset, r.offset + r.length))

    for seg, ranges in by_seg.items():
        lay = src.segs[seg]
        seal = lay.recs[-1]
        if lay.newest:  # no footer, no table: it may be the active segment of a crash
            table_damaged = any(b > seal.pos for a, b in ranges)
        else:  # a bad footer is looked past (format.md 1.4): the SEAL record must be intact
            table_damaged = any(a < seal.frame_end and b > seal.pos for a, b in ranges)
        header_of_data = False
        if any(a < 56 for a, b in ranges):  # checksummed header bytes (56..63 are reserved)
            eff.detectable.add(seg)
            eff.headerless.add(seg)
        first_bad: int | None = None
        for r in lay.recs:
            if not any(r.pos < b and a < r.checked_end for a, b in ranges):
                continue
            if r.type == RecType.SEAL and lay.newest:
                continue  # the newest segment's tail: a torn tail, the end of the log
            eff.detectable.add(seg)
            first_bad = r.pos if first_bad is None else first_bad
            if r.type in fmt.DATA_TYPES:
                eff.changed.add((seg, r.pos))
                add(eff.risk, r)
                header_of_data = header_of_data or any(
                    r.pos < b and a < r.pos + 48 for a, b in ranges)
            elif r.type not in (RecType.PAD, RecType.SEAL):
                eff.metadata_lost = True
        if table_damaged and first_bad is not None:
            for r in lay.recs:
                if r.pos >= first_bad and r.type in fmt.DATA_TYPES:
                    add(eff.risk, r)
                    add(eff.lost, r)
                elif r.pos >= first_bad and r.type not in (RecType.PAD, RecType.SEAL):
                    eff.metadata_lost = True
        if seg in eff.headerless and lay.newest:
            # a newest segment whose header reads as zeros is taken for one whose header
            # never reached the disk before a power loss, which nothing fsync'd: replay
            # removes it as an empty tail, records and all (format.md 1.4)
            for r in lay.recs:
                if r.type in fmt.DATA_TYPES:
                    add(eff.risk, r)
                    add(eff.lost, r)
                elif r.type not in (RecType.PAD, RecType.SEAL):
                    eff.metadata_lost = True
        if table_damaged and header_of_data:
            eff.untrusted_headers = True
    return eff


# -- reading the mount back -----------------------------------------------------------------


def walk(mnt: Path) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """Every path below mnt: (kind, symlink target); and the errors met on the way (os.walk
    would skip a directory it cannot list without a word)."""
    out: dict[str, tuple[str, str]] = {}
    errors: list[str] = []

    def onerror(e: OSError) -> None:
        errors.append(f"listing {e.filename}: {errno.errorcode.get(e.errno or 0, e.errno)}")

    for dirpath, dirnames, filenames in os.walk(mnt, onerror=onerror):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(mnt))
            try:
                st = os.lstat(p)
                if stat.S_ISLNK(st.st_mode):
                    out[rel] = ("l", os.readlink(p))
                elif stat.S_ISDIR(st.st_mode):
                    out[rel] = ("d", "")
                else:
                    out[rel] = ("f", "")
            except OSError as e:
                errors.append(f"{rel}: listed, but {errno.errorcode.get(e.errno or 0, e.errno)} "
                              f"on lstat/readlink")
    return out, errors


def overlaps(ranges: list[tuple[int, int]], a: int, b: int) -> bool:
    return any(s < b and a < e for s, e in ranges)


def check_mount(src: Source, eff: Effect, mnt: Path, mode: str, scenario: str) -> list[str]:
    """Problems with what the mount shows (an empty list: the promise held)."""
    found, problems = walk(mnt)
    final = {e.final: e for e in src.entities if e.final is not None}
    history = src.by_path()
    exact = mode == "a" or not eff.metadata_lost
    if exact:
        want = {p: (e.kind, e.target) for p, e in final.items()}
        if found != want:
            missing = sorted(set(want) - set(found))
            extra = sorted(set(found) - set(want))
            changed = sorted(p for p in set(want) & set(found) if want[p] != found[p])
            problems.append(f"namespace differs from the source: missing {missing[:10]}, "
                            f"extra {extra[:10]}, changed {changed[:10]}")
    for rel, (kind, target) in sorted(found.items()):
        ent = history.get(rel)
        if ent is None:
            problems.append(f"{rel}: a path the source never made")
            continue
        if kind != ent.kind or (kind == "l" and target != ent.target):
            problems.append(f"{rel}: is {kind} {target!r}, the source made {ent.kind} "
                            f"{ent.target!r}")
            continue
        if kind == "f":
            try:
                problems += check_file(src, eff, mnt / rel, rel, ent, mode, scenario)
            except OSError as e:  # stat or open: never allowed to fail, EIO included
                problems.append(f"{rel}: {errno.errorcode.get(e.errno or 0, e.errno)} on "
                                f"stat or open")
    return problems


def check_file(src: Source, eff: Effect, path: Path, rel: str, ent: Entity, mode: str,
               scenario: str) -> list[str]:
    """One file against its original bytes, block by block (see the module docstring)."""
    data = ent.data
    size = os.stat(path).st_size
    risk = eff.risk.get(ent.ino, [])
    lost = eff.lost.get(ent.ino, []) if mode == "b" else []
    live = src.live.get(ent.ino, [])
    live_changed = [(s, e) for s, e, seg, pos in live if (seg, pos) in eff.changed]
    if size != len(data):
        if mode == "a":
            return [f"{rel}: size {size} instead of {len(data)} with the index intact"]
        if size > len(data) and not eff.untrusted_headers:
            return [f"{rel}: size {size} is larger than the {len(data)} bytes ever written"]
        kept = [e for s, e, seg, pos in live if not overlaps(lost, s, e)]
        if size < max(kept + [0]):
            return [f"{rel}: size {size}, but records replay can identify hold data up to "
                    f"{max(kept)}"]
        if size < len(data) and not overlaps(lost, size, len(data)):
            return [f"{rel}: size {size} instead of {len(data)}, and no lost record covers "
                    f"the bytes past it"]
    problems: list[str] = []
    for i, got in enumerate(read_blocks(path, len(data))):
        off = i * BLOCK
        want = data[off:off + BLOCK]
        where = f"{rel} block {i} (offset {off})"
        if isinstance(got, int):
            if got != errno.EIO:
                problems.append(f"{where}: {errno.errorcode.get(got, got)} instead of EIO")
            elif not overlaps(risk, off, off + BLOCK) and not (
                    mode == "b" and eff.untrusted_headers):
                problems.append(f"{where}: EIO, yet no record holding it was damaged")
            continue
        expect = max(0, min(BLOCK, size - off))
        if len(got) != expect:
            problems.append(f"{where}: read {len(got)} bytes, the size {size} says {expect}")
        bad = [j for j in range(len(got)) if j >= len(want) or got[j] != want[j]]
        if bad:
            a, b = off + bad[0], off + bad[-1] + 1
            zeros = all(got[j] == 0 for j in bad)
            # zeros may stand only where a lost record was, or past the original end of a
            # file that grew from an untrusted header
            if not (zeros and all(overlaps(lost, off + j, off + j + 1)
                                  or (eff.untrusted_headers and off + j >= len(data))
                                  for j in bad)):
                problems.append(
                    f"{where}: WRONG BYTES in [{a},{b}): "
                    f"{'zeros' if zeros else 'other bytes'} instead of the data written "
                    f"(damaged record there: {overlaps(risk, a, b)}, lost: {overlaps(lost, a, b)})")
            continue
        if (mode == "a" and scenario == "local-only" and got
                and overlaps(live_changed, off, off + BLOCK)):
            problems.append(f"{where}: its live record is damaged and no intact copy exists, "
                            f"yet the read returned data")
    return problems


# -- one iteration --------------------------------------------------------------------------


def copy_state(src: Source, m: Mount, scenario: str, damaged: dict[str, bytes]) -> None:
    shutil.copytree(src.nvme, m.nvme, dirs_exist_ok=True)
    shutil.copytree(src.shared, m.shared, dirs_exist_ok=True)
    for name, blob in damaged.items():
        (m.nvme / "segments" / name).write_bytes(blob)
    if scenario == "local-only":
        shutil.rmtree(m.shared / "ckptfs" / "objects")


def usable(m: Mount, tag: str, rng: random.Random) -> None:
    """A new file can be written and read back, and the mount unmounts cleanly."""
    data = rng.randbytes(300_000)
    p = m.mnt / f"fuzz-after-{tag}"
    with open(p, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    assert p.read_bytes() == data, f"{tag}: a file written after the damage reads back wrong"
    m.unmount()


def replay_report(m: Mount) -> tuple[int, dict[str, Any], str]:
    res = run_cli("replay", m.nvme, "--shared", m.shared, "--json", timeout=120)
    assert "Traceback" not in res.out + res.err, f"replay crashed: {res}"
    assert res.rc in (0, 1), f"replay exited {res.rc}: {res}"
    try:
        rep = json.loads(res.out)
    except ValueError:
        raise AssertionError(f"replay --json did not print JSON: {res}") from None
    assert isinstance(rep.get("corruption"), list), rep
    return res.rc, rep, str(res)


def random_damage(src: Source, rng: random.Random, tmp: Path
                  ) -> tuple[list[Damage], dict[str, bytes]]:
    """Damage one to three segments (copies in `tmp`): what was done, and the damaged bytes."""
    work = tmp / "damage"
    shutil.copytree(src.nvme / "segments", work)
    targets = sorted(rng.sample(sorted(src.segs), rng.choice([1, 1, 1, 2, 3])))
    damages: list[Damage] = []
    for name in targets:
        damages += damage_segment(rng, work / name, src.segs[name])
    damaged = {name: (work / name).read_bytes() for name in targets}
    shutil.rmtree(work)
    return damages, damaged


def run_iteration(make_mount: MakeMount, src: Source, scenario: str, seed: str, it: int,
                  tmp: Path) -> None:
    rng = random.Random(f"{seed}/{scenario}/{it}")
    damages, damaged = random_damage(src, rng, tmp)
    repro = (f"CKPTFS_FUZZ_SEED={seed} CKPTFS_FUZZ_START={it} CKPTFS_FUZZ_ITERS=1 "
             f"scenario {scenario}")
    check_damage(make_mount, src, scenario, damages, damaged, repro, f"it{it}", rng)


def checked(src: Source, eff: Effect, mnt: Path, mode: str, scenario: str, ctx: str
            ) -> list[str]:
    """check_mount, with the damage named even if the oracle itself fails."""
    try:
        return check_mount(src, eff, mnt, mode, scenario)
    except Exception as e:
        raise AssertionError(f"mode ({mode}): checking the mount failed: {e!r} {ctx}") from e


def check_damage(make_mount: MakeMount, src: Source, scenario: str, damages: list[Damage],
                 damaged: dict[str, bytes], repro: str, tag: str, rng: random.Random) -> None:
    """Both modes on two copies of the source with the segments `damaged` replaced."""
    eff = classify(src, damages)
    what = "\n  ".join(str(d) for d in damages) or "(no damage applied)"
    ctx = f"[{repro}] damage:\n  {what}"

    # (a) the index intact
    ma = make_mount(f"{tag}-a", MOUNT_ARGS, segment_size="1M", start=False)
    copy_state(src, ma, scenario, damaged)
    ma.start()
    problems = checked(src, eff, ma.mnt, "a", scenario, ctx)
    assert not problems, f"mode (a), index intact {ctx}\n" + "\n".join(problems[:25])
    usable(ma, f"{tag}-a", rng)
    shutil.rmtree(ma.root)

    # (b) the index deleted: replay from the log alone, then mount
    mb = make_mount(f"{tag}-b", MOUNT_ARGS, segment_size="1M", start=False)
    copy_state(src, mb, scenario, damaged)
    shutil.rmtree(mb.nvme / "index")
    rc, rep, text = replay_report(mb)
    blob = json.dumps(rep["corruption"])
    if eff.detectable:
        assert rc == 1 and rep["corruption"], (
            f"mode (b): replay must exit 1 and report corruption of "
            f"{sorted(eff.detectable)} {ctx}\n{text}")
        for seg in sorted(eff.detectable):
            assert seg in blob, f"mode (b): the report does not name {seg} {ctx}\n{text}"
    else:
        assert rc == 0 and not rep["corruption"], (
            f"mode (b): no checksummed byte changed, yet replay reports corruption {ctx}\n{text}")
    mb.start()
    problems = checked(src, eff, mb.mnt, "b", scenario, ctx)
    assert not problems, f"mode (b), index rebuilt by replay {ctx}\n" + "\n".join(problems[:25])
    usable(mb, f"{tag}-b", rng)
    shutil.rmtree(mb.root)


# -- the tests ------------------------------------------------------------------------------


def record_holding(src: Source, ent: Entity, file_off: int) -> tuple[SegLayout, Rec]:
    """The data record of `ent` holding file offset `file_off`, and its segment."""
    for lay in src.segs.values():
        for r in lay.recs:
            if (r.type in fmt.DATA_TYPES and r.ino == ent.ino
                    and r.offset <= file_off < r.offset + r.length):
                return lay, r
    raise AssertionError(f"no record of {ent.final} holds offset {file_off}")


def damaged_copy(make_mount: MakeMount, src: Source, name: str, lay: SegLayout,
                 flips: list[tuple[int, int]]) -> Mount:
    """A local-only copy of the source whose index is deleted and whose segment `lay` has
    the bytes at the given offsets XORed with the given masks; not started."""
    m = make_mount(name, MOUNT_ARGS, segment_size="1M", start=False)
    copy_state(src, m, "local-only", {})
    seg = m.nvme / "segments" / lay.name
    blob = bytearray(seg.read_bytes())
    for off, mask in flips:
        blob[off] ^= mask
    seg.write_bytes(bytes(blob))
    shutil.rmtree(m.nvme / "index")
    return m


@pytest.mark.parametrize("how", ["payload-and-next-record", "length-field", "magic",
                                 "length-field-and-footer"])
def test_damaged_data_record_keeps_its_extent(make_mount: MakeMount, source: Source,
                                              how: str) -> None:
    """A WRITE record in the middle of a file, in a sealed segment whose SEAL table is intact,
    damaged beyond its payload: also the record after it (the PAD of an O_DIRECT write), or
    its length field, or its magic. A full replay must still keep its extent (the table has
    its header) so the range reads as EIO. Found by the fuzzer: only payload-only damage was
    kept; the others dropped the record and the range read as zeros."""
    ent = source.by_path()["big/b3m5"]
    lay, rec = record_holding(source, ent, 3 * MiB // 2)
    nxt = lay.recs[lay.recs.index(rec) + 1]
    assert not lay.newest and rec.length > MiB // 2 and nxt.type != RecType.SEAL, (lay, rec)
    flips = {"payload-and-next-record": [(rec.pos + 56 + 1000, 0x01), (nxt.pos + 20, 0x01)],
             "length-field": [(rec.pos + 11, 0x10)],
             "magic": [(rec.pos, 0xFF)],
             # the table found by looking for the SEAL record before the damaged footer
             "length-field-and-footer": [(rec.pos + 11, 0x10), (lay.size - 20, 0x01)]}[how]
    m = damaged_copy(make_mount, source, f"focused-{how}", lay, flips)
    rc, rep, text = replay_report(m)
    assert rc == 1 and lay.name in json.dumps(rep["corruption"]), text
    m.start()
    path = m.mnt / "big/b3m5"
    assert os.stat(path).st_size == len(ent.data)
    damage = f"{how} of {rec.describe()} in {lay.name}"
    for i, got in enumerate(read_blocks(path, len(ent.data))):
        off = i * BLOCK
        if rec.offset < off + BLOCK and off < rec.offset + rec.length:
            assert got == errno.EIO, (
                f"big/b3m5 block {i} (offset {off}), {damage}: "
                f"{'zeros' if got == bytes(BLOCK) else got} instead of EIO")
        else:
            assert got == ent.data[off:off + BLOCK], f"big/b3m5 block {i}, {damage}"
    m.unmount()


def test_damaged_offset_without_a_table_is_not_applied(make_mount: MakeMount,
                                                       source: Source) -> None:
    """A sealed segment's SEAL record damaged (no table to trust) and, in it, the top byte of
    a WRITE record's file offset: the record's checksum fails, its frame is intact, and its
    own header is all that says where it goes. Found by the fuzzer: replay applied it at an
    offset near 2^64, the file's size no longer fit in st_size, and every readdir of its
    directory failed (EIO), hiding intact files. A header past the largest possible file
    offset is damaged: replay reports it and does not apply it."""
    ent = source.by_path()["big/b3m5"]
    lay, rec = record_holding(source, ent, 3 * MiB // 2)
    assert not lay.newest
    seal = lay.recs[-1]
    assert seal.type == RecType.SEAL
    m = damaged_copy(make_mount, source, "offset", lay,  # offset's top byte, SEAL's payload
                     [(rec.pos + 31, 0xC0), (seal.pos + 56 + 3, 0x01)])
    rc, rep, text = replay_report(m)
    assert rc == 1 and lay.name in json.dumps(rep["corruption"]), text
    m.start()
    names = sorted(os.listdir(m.mnt / "big"))
    assert names == ["b1m", "b2m", "b3m5"], names
    size = os.stat(m.mnt / "big/b3m5").st_size
    assert size == len(ent.data), f"big/b3m5 has size {size} instead of {len(ent.data)}"
    for other in ("big/b1m", "big/b2m"):
        assert (m.mnt / other).read_bytes() == source.by_path()[other].data, other
    m.unmount()


def test_damaged_segment_header_keeps_intact_records(make_mount: MakeMount,
                                                     source: Source) -> None:
    """One flipped bit in the creation time of a sealed segment's header (its id, magic and
    every record intact): a full replay reports the segment and still takes its records,
    which verify on their own. It used to skip the segment whole, so the 1 MiB of big/b3m5
    it holds became a hole, read as zeros instead of the data or EIO."""
    ent = source.by_path()["big/b3m5"]
    lay, rec = record_holding(source, ent, 3 * MiB // 2)
    assert not lay.newest
    m = damaged_copy(make_mount, source, "headerless", lay, [(26, 0x01)])
    rc, rep, text = replay_report(m)
    assert rc == 1 and lay.name in json.dumps(rep["corruption"]), text
    m.start()
    blocks = read_blocks(m.mnt / "big/b3m5", len(ent.data))
    m.unmount()
    first = rec.offset // BLOCK + 1
    got = blocks[first]
    assert got == errno.EIO or got == ent.data[first * BLOCK:(first + 1) * BLOCK], (
        f"big/b3m5 block {first}, header of {lay.name} damaged: "
        f"{'zeros' if got == bytes(BLOCK) else got!r} instead of the data or EIO")



def test_source_reads_back_undamaged(make_mount: MakeMount, source: Source,
                                     tmp_path: Path) -> None:
    """The oracle itself: without damage, both modes show the source exactly and replay
    reports nothing (else every failure below could be the fuzzer's own)."""
    ma = make_mount("clean", MOUNT_ARGS, segment_size="1M", start=False)
    copy_state(source, ma, "local-only", {})
    shutil.rmtree(ma.nvme / "index")
    rc, rep, text = replay_report(ma)
    assert rc == 0 and not rep["corruption"], text
    ma.start()
    problems = check_mount(source, Effect(), ma.mnt, "a", "local-only")
    assert not problems, "\n".join(problems[:25])
    ma.unmount()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_corruption_fuzz(make_mount: MakeMount, source: Source, tmp_path: Path,
                         scenario: str) -> None:
    """A few seeded iterations in the default run: damaged segments read as EIO or the
    original bytes, with the index intact and rebuilt by replay."""
    seed = "default"
    print(f"corruption fuzz: CKPTFS_FUZZ_SEED={seed}, {DEFAULT_ITERS} iterations, {scenario}")
    for it in range(DEFAULT_ITERS):
        run_iteration(make_mount, source, scenario, seed, it, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(LONG_ITERS * 2 * 30 + 300)
def test_corruption_fuzz_long(make_mount: MakeMount, source: Source, tmp_path: Path) -> None:
    """CKPTFS_FUZZ_ITERS iterations (default 200) per scenario from CKPTFS_FUZZ_SEED (random
    unless given; printed, and named in every failure)."""
    seed = os.environ.get("CKPTFS_FUZZ_SEED") or str(random.SystemRandom().randrange(10**9))
    print(f"corruption fuzz: CKPTFS_FUZZ_SEED={seed} CKPTFS_FUZZ_START={LONG_START} "
          f"CKPTFS_FUZZ_ITERS={LONG_ITERS}", flush=True)
    t0 = time.monotonic()
    for it in range(LONG_START, LONG_START + LONG_ITERS):
        for scenario in SCENARIOS:
            run_iteration(make_mount, source, scenario, seed, it, tmp_path)
    print(f"corruption fuzz: {LONG_ITERS} iterations x {len(SCENARIOS)} scenarios in "
          f"{time.monotonic() - t0:.0f}s, seed {seed}")



@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("where", ["payload", "magic"])
def test_every_metadata_record_damaged(make_mount: MakeMount, source: Source, tmp_path: Path,
                                       where: str) -> None:
    """Each CREATE, RENAME, UNLINK, SETATTR and PURGE record of the source damaged alone (a
    bit of its payload, or of its magic), both modes: the random damage rarely lands on these
    few small records, and a lost one changes the namespace a full replay builds (an UNLINK
    lost while its PURGE is intact, a RENAME of a directory lost, a directory's CREATE lost
    under the files in it)."""
    n = 0
    for lay in source.segs.values():
        for r in lay.recs:
            if r.type in fmt.DATA_TYPES or r.type in (RecType.PAD, RecType.SEAL):
                continue
            n += 1
            blob = bytearray((source.nvme / "segments" / lay.name).read_bytes())
            off = r.pos + fmt.RECORD_HEADER_SIZE + r.length // 2 if where == "payload" \
                and r.length else r.pos
            blob[off] ^= 0x01
            d = Damage(lay.name, off, off + 1, "flip", f"{where} of {r.describe()}",
                       [(off, off + 1)])
            check_damage(make_mount, source, "local-only", [d], {lay.name: bytes(blob)},
                         f"metadata sweep, {where}", f"md{n}", random.Random(n))
    assert n >= 40, f"only {n} metadata records in the source"
