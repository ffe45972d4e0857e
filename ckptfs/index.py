"""The LMDB index: its schema (documented here and in docs/format.md) and the one function that
applies a log record to it.

The log is the source of truth. The index is derived from it by `apply()`, which the live
write path and replay both call, so a replayed index is the live index by construction. The
index is committed in batches; `meta/applied` says up to which log position it reflects, and
a mount replays the log beyond it.

Databases (keys big-endian so that LMDB's byte order is numeric order):

    meta       b"applied" -> seg u64, pos u64, seq u64   (log position the index reflects)
               b"next_ino" -> u64
               b"next_objref" -> u64                      (next vseg id to hand out)
    inodes     ino u64 -> INODE struct (+ symlink target bytes)
    dirents    parent u64 + name -> child ino u64, cookie u64
    cookies    parent u64 + cookie u64 -> name       (readdir order and resumable offsets)
    extents    ino u64 + file offset u64 -> EXTENT struct
    segments   seg u64 -> SEGMENT struct (state, size, dead data bytes, sealed time,
               data bytes): live data = data - dead
    xattrs     ino u64 + name -> value
    objrefs    vseg u64 -> b"node/segment-id-hex" (published objects that imported files use;
               vseg ids have the top bit set so they never collide with local segment ids)
    objids     b"node/segment-id-hex" -> vseg u64
    origins    ino u64 -> JSON {"node", "mtime_ns", "size", "ext"}: the file was imported from
               that node's manifest and not modified here since; {"node", "mtime_ns"} for a
               directory or symlink a refresh made for that node
    chunks     xxh3-128 of a WRITE payload -> seg u64, record position u64, length u32: a
               cache for the incremental drain (not derived from the log; losing it only
               loses deduplication)

LMDB runs with metasync off: a power loss can undo the last index commit but never breaks the
index, and the log replay redoes what it undid.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from dataclasses import dataclass
from typing import Iterator

import lmdb
import xxhash

from ckptfs import layout
from ckptfs import segment as fmt
from ckptfs.segment import Record, RecType

U64 = struct.Struct(">Q")
KEY2 = struct.Struct(">QQ")
# mode, uid, gid, nlink, rdev, pad, size, atime_ns, mtime_ns, ctime_ns
INODE = struct.Struct("<IIIIIIQqqq")
# segment id, record position, skip into payload, length, payload length of the record
EXTENT = struct.Struct("<QQIII")
DIRENT = struct.Struct("<QQ")
# state u8, pad, size u64, dead bytes u64, sealed time_ns i64, data bytes u64
SEGMENT = struct.Struct("<B7xQQqQ")
APPLIED = struct.Struct("<QQQ")
CHUNK = struct.Struct("<QQI")

ROOT_INO = 1
VSEG_BIT = 1 << 63
WAITED_KEY = b"waited/"  # + u64 directory inode in `meta`: when its last `ckptfs wait` began
MAX_WAITED = 64  # directories remembered so; older ones are forgotten
BAD_KEY = b"bad/"  # + u64 segment + u64 position in `meta`: a record replay found damaged


def read_applied(path: str) -> tuple[int, int, int] | None:
    """The log position an index (or a snapshot of one) reflects, without opening it for
    writing."""
    try:
        env = lmdb.open(path, readonly=True, max_dbs=16, lock=False)
    except lmdb.Error:
        return None
    try:
        meta = env.open_db(b"meta", create=False)
        with env.begin(db=meta) as txn:
            raw = txn.get(b"applied")
        return APPLIED.unpack(raw) if raw else None
    except lmdb.Error:
        return None
    finally:
        env.close()


class IndexCommitError(Exception):
    """LMDB refused a commit; the index is back at its last committed state."""


class SegState:
    ACTIVE = 0
    SEALED = 1
    UPLOADING = 2
    PUBLISHED = 3
    EVICTED = 4  # published and the local copy is gone
    DROPPED = 5  # all its data died before upload (superseded): never uploaded, kept locally
    COLD = 6  # moved to the cold tier: only there (not local, not on the shared tier)
    NAMES = {0: "active", 1: "sealed", 2: "uploading", 3: "published", 4: "evicted",
             5: "dropped", 6: "cold"}


@dataclass(slots=True)
class SegInfo:
    state: int
    size: int
    dead: int
    sealed_ns: int
    data: int

    @property
    def live(self) -> int:
        return max(0, self.data - self.dead)


@dataclass(slots=True)
class Inode:
    ino: int
    mode: int
    uid: int
    gid: int
    nlink: int
    rdev: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    target: bytes = b""

    def pack(self) -> bytes:
        return INODE.pack(self.mode, self.uid, self.gid, self.nlink, self.rdev, 0, self.size,
                          self.atime_ns, self.mtime_ns, self.ctime_ns) + self.target

    @classmethod
    def unpack(cls, ino: int, buf: bytes) -> "Inode":
        mode, uid, gid, nlink, rdev, _p, size, a, m, c = INODE.unpack_from(buf)
        return cls(ino, mode, uid, gid, nlink, rdev, size, a, m, c, bytes(buf[INODE.size:]))

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)


@dataclass(slots=True)
class Extent:
    start: int  # file offset
    seg: int
    rec_pos: int
    skip: int  # offset of this extent's first byte inside the record payload
    length: int
    rec_len: int  # the whole record payload length (to verify its checksum)

    @property
    def end(self) -> int:
        return self.start + self.length


def k_ino(ino: int) -> bytes:
    return U64.pack(ino)


def k_dirent(parent: int, name: bytes) -> bytes:
    return U64.pack(parent) + name


def k_ext(ino: int, off: int) -> bytes:
    return KEY2.pack(ino, off)


class Index:
    """The index and its open write transaction. Single-threaded: the trio thread owns it."""

    def __init__(self, path: str, map_size: int = 1 << 36):
        layout.makedirs_durable(path)
        new = not os.path.exists(os.path.join(path, "data.mdb"))
        self.env = lmdb.open(path, map_size=map_size, max_dbs=16, metasync=False, sync=True,
                             writemap=False, readahead=False, lock=True)
        if new:  # LMDB syncs data.mdb at each commit, never the name LMDB gave it
            layout.fsync_dir(path)
        self.meta = self.env.open_db(b"meta")
        self.inodes = self.env.open_db(b"inodes")
        self.dirents = self.env.open_db(b"dirents")
        self.cookies = self.env.open_db(b"cookies")
        self.extents = self.env.open_db(b"extents")
        self.segments = self.env.open_db(b"segments")
        self.xattrs = self.env.open_db(b"xattrs")
        self.objrefs = self.env.open_db(b"objrefs")
        self.objids = self.env.open_db(b"objids")
        self.origins = self.env.open_db(b"origins")
        self.chunks = self.env.open_db(b"chunks")
        self.gone = self.env.open_db(b"gone")
        self.txn = self.env.begin(write=True)
        self._dead: dict[int, int] = {}  # per segment, not yet in the segments db
        self._data: dict[int, int] = {}
        self._load_meta()

    # --- transactions -------------------------------------------------------------------

    def commit(self) -> None:
        """Make everything applied so far durable in LMDB and start a new transaction.

        If LMDB cannot commit (a full disk), the transaction and every change since the last
        commit are gone from the index, not from the log: the index goes back to its last
        committed state and IndexCommitError tells the caller to re-apply the log from there.
        """
        try:
            self._flush_dead()
            self.txn.put(b"applied", APPLIED.pack(*self.applied), db=self.meta)
            self.txn.put(b"next_ino", U64.pack(self.next_ino), db=self.meta)
            self.txn.commit()
        except lmdb.Error as e:
            try:
                self.txn.abort()
            except lmdb.Error:
                pass
            self.txn = self.env.begin(write=True)
            self._load_meta()
            raise IndexCommitError(f"index commit failed ({e}); re-applying the log") from None
        self.txn = self.env.begin(write=True)
        self.dirty = 0

    def commit_durable(self) -> None:
        """commit(), and make that commit survive a power loss: without metasync LMDB can
        lose its last commit, which replay normally redoes from the log. Needed before
        deleting anything only this commit says is no longer needed."""
        self.commit()
        self.env.sync(True)

    def _load_meta(self) -> None:
        raw = self.txn.get(b"applied", db=self.meta)
        self.applied = APPLIED.unpack(raw) if raw else (0, 0, 0)
        raw = self.txn.get(b"next_ino", db=self.meta)
        self.next_ino = U64.unpack(raw)[0] if raw else ROOT_INO + 1
        self._dead.clear()
        self._data.clear()
        self.dirty = 0

    def close(self, commit: bool = True) -> None:
        if commit:
            self.commit()
        self.txn.abort()
        self.txn = None  # type: ignore[assignment]
        try:
            self.env.sync(True)
        except lmdb.Error:
            pass  # the log is the truth; the next mount replays past the last good commit
        self.env.close()

    def wipe(self) -> None:
        """Forget everything (replay from the start of the log rebuilds it)."""
        for db in (self.meta, self.inodes, self.dirents, self.cookies, self.extents,
                   self.segments, self.xattrs, self.objrefs, self.objids, self.origins,
                   self.chunks, self.gone):
            self.txn.drop(db, delete=False)
        self.applied = (0, 0, 0)
        self.next_ino = ROOT_INO + 1
        self._dead.clear()
        self._data.clear()

    # --- inodes ---------------------------------------------------------------------------

    def get_inode(self, ino: int) -> Inode | None:
        raw = self.txn.get(k_ino(ino), db=self.inodes)
        return Inode.unpack(ino, raw) if raw is not None else None

    def put_inode(self, ino: Inode) -> None:
        self.txn.put(k_ino(ino.ino), ino.pack(), db=self.inodes)

    def ensure_root(self, uid: int, gid: int, mode: int, now: int) -> None:
        if self.get_inode(ROOT_INO) is None:
            self.put_inode(Inode(ROOT_INO, stat.S_IFDIR | mode, uid, gid, 2, 0, 0, now, now, now))

    def iter_inodes(self) -> Iterator[Inode]:
        with self.txn.cursor(db=self.inodes) as c:
            for k, v in c:
                yield Inode.unpack(U64.unpack(k)[0], v)

    # --- directory entries --------------------------------------------------------------

    def lookup(self, parent: int, name: bytes) -> int | None:
        raw = self.txn.get(k_dirent(parent, name), db=self.dirents)
        return DIRENT.unpack(raw)[0] if raw is not None else None

    def _link(self, parent: int, name: bytes, child: int, cookie: int) -> None:
        self.txn.put(k_dirent(parent, name), DIRENT.pack(child, cookie), db=self.dirents)
        self.txn.put(KEY2.pack(parent, cookie), name, db=self.cookies)

    def _repoint(self, parent: int, name: bytes, child: int) -> None:
        key = k_dirent(parent, name)
        _, cookie = DIRENT.unpack(self.txn.get(key, db=self.dirents))
        self.txn.put(key, DIRENT.pack(child, cookie), db=self.dirents)

    def _unlink_entry(self, parent: int, name: bytes) -> int | None:
        key = k_dirent(parent, name)
        raw = self.txn.get(key, db=self.dirents)
        if raw is None:
            return None
        child, cookie = DIRENT.unpack(raw)
        self.txn.delete(key, db=self.dirents)
        self.txn.delete(KEY2.pack(parent, cookie), db=self.cookies)
        return child

    def readdir(self, parent: int, after_cookie: int) -> Iterator[tuple[int, bytes, int]]:
        """(cookie, name, child ino) in cookie order, strictly after `after_cookie`."""
        with self.txn.cursor(db=self.cookies) as c:
            if not c.set_range(KEY2.pack(parent, after_cookie + 1)):
                return
            for k, name in c:
                p, cookie = KEY2.unpack(k)
                if p != parent:
                    return
                child = self.lookup(parent, bytes(name))
                if child is not None:
                    yield cookie, bytes(name), child

    def last_cookie(self, parent: int) -> int:
        """The highest cookie in `parent` (0 if it is empty)."""
        with self.txn.cursor(db=self.cookies) as c:
            if c.set_range(KEY2.pack(parent + 1, 0)):
                if not c.prev():
                    return 0
            elif not c.last():
                return 0
            p, cookie = KEY2.unpack(c.key())
            return cookie if p == parent else 0

    def dir_is_empty(self, ino: int) -> bool:
        with self.txn.cursor(db=self.cookies) as c:
            if not c.set_range(KEY2.pack(ino, 0)):
                return True
            return KEY2.unpack(c.key())[0] != ino

    # --- extents --------------------------------------------------------------------------

    def _ext(self, k: bytes, v: bytes) -> Extent:
        _ino, start = KEY2.unpack(k)
        seg, pos, skip, length, rec_len = EXTENT.unpack(v)
        return Extent(start, seg, pos, skip, length, rec_len)

    def _put_ext(self, ino: int, e: Extent) -> None:
        self.txn.put(k_ext(ino, e.start), EXTENT.pack(e.seg, e.rec_pos, e.skip, e.length,
                                                      e.rec_len), db=self.extents)

    def extents_in(self, ino: int, off: int, end: int) -> list[Extent]:
        """Extents overlapping [off, end), in order (not clipped)."""
        out: list[Extent] = []
        with self.txn.cursor(db=self.extents) as c:
            found = c.set_range(k_ext(ino, off))
            # the extent starting before `off` may still cover it
            if (c.prev() if found else c.last()):
                k, v = c.item()
                if KEY2.unpack(k)[0] == ino:
                    e = self._ext(k, v)
                    if e.end > off:
                        out.append(e)
            if not c.set_range(k_ext(ino, off)):
                return out
            for k, v in c:
                i, start = KEY2.unpack(k)
                if i != ino or start >= end:
                    break
                out.append(self._ext(k, v))
        return out

    def iter_all_extents(self) -> Iterator[tuple[int, Extent]]:
        with self.txn.cursor(db=self.extents) as c:
            for k, v in c:
                yield KEY2.unpack(k)[0], self._ext(k, v)

    def iter_extents(self, ino: int, start: int = 0) -> Iterator[Extent]:
        """ino's extents in file order, from the first one starting at or after `start`."""
        with self.txn.cursor(db=self.extents) as c:
            if not c.set_range(k_ext(ino, start)):
                return
            for k, v in c:
                if KEY2.unpack(k)[0] != ino:
                    return
                yield self._ext(k, v)

    def _punch(self, ino: int, off: int, end: int) -> None:
        """Remove [off, end) from the extent map, splitting extents at the edges."""
        for e in self.extents_in(ino, off, end):
            self.txn.delete(k_ext(ino, e.start), db=self.extents)
            cut_from, cut_to = max(e.start, off), min(e.end, end)
            self._dead[e.seg] = self._dead.get(e.seg, 0) + (cut_to - cut_from)
            if e.start < off:
                self._put_ext(ino, Extent(e.start, e.seg, e.rec_pos, e.skip, off - e.start,
                                          e.rec_len))
            if e.end > end:
                d = end - e.start
                self._put_ext(ino, Extent(end, e.seg, e.rec_pos, e.skip + d, e.length - d,
                                          e.rec_len))

    def _drop_extents(self, ino: int) -> None:
        for e in list(self.iter_extents(ino)):
            self._dead[e.seg] = self._dead.get(e.seg, 0) + e.length
            self.txn.delete(k_ext(ino, e.start), db=self.extents)

    # --- segments -------------------------------------------------------------------------

    def get_segment(self, seg: int) -> SegInfo | None:
        self._flush_dead()
        raw = self.txn.get(U64.pack(seg), db=self.segments)
        return SegInfo(*SEGMENT.unpack(raw)) if raw is not None else None

    def _put_segment(self, seg: int, i: SegInfo) -> None:
        self.txn.put(U64.pack(seg), SEGMENT.pack(i.state, i.size, i.dead, i.sealed_ns, i.data),
                     db=self.segments)

    def set_segment(self, seg: int, state: int, size: int | None = None,
                    sealed_ns: int | None = None) -> None:
        cur = self.get_segment(seg) or SegInfo(SegState.ACTIVE, 0, 0, 0, 0)
        cur.state = state
        if size is not None:
            cur.size = size
        if sealed_ns is not None:
            cur.sealed_ns = sealed_ns
        self._put_segment(seg, cur)
        # a change for the next commit even without a log record (the drain's intent before
        # an upload, PUBLISHED, EVICTED): a commit skipped because none came would lose it,
        # and after a crash in an idle period published segments would go out again
        self.dirty += 1

    def drop_segment(self, seg: int) -> None:
        self.txn.delete(U64.pack(seg), db=self.segments)
        self.dirty += 1

    def iter_segments(self) -> Iterator[tuple[int, SegInfo]]:
        self._flush_dead()
        with self.txn.cursor(db=self.segments) as c:
            for k, v in c:
                yield U64.unpack(k)[0], SegInfo(*SEGMENT.unpack(v))

    def _flush_dead(self) -> None:
        if not self._dead and not self._data:
            return
        dead, data = self._dead, self._data
        self._dead, self._data = {}, {}
        for seg in set(dead) | set(data):
            raw = self.txn.get(U64.pack(seg), db=self.segments)
            if raw is None:
                if seg & VSEG_BIT:
                    continue
                cur = SegInfo(SegState.ACTIVE, 0, 0, 0, 0)
            else:
                cur = SegInfo(*SEGMENT.unpack(raw))
            cur.dead += dead.get(seg, 0)
            cur.data += data.get(seg, 0)
            self._put_segment(seg, cur)

    # --- xattrs ---------------------------------------------------------------------------

    def get_xattr(self, ino: int, name: bytes) -> bytes | None:
        return self.txn.get(k_ino(ino) + name, db=self.xattrs)

    def list_xattrs(self, ino: int) -> list[bytes]:
        out = []
        prefix = k_ino(ino)
        with self.txn.cursor(db=self.xattrs) as c:
            if c.set_range(prefix):
                for k in c.iternext(values=False):
                    if not k.startswith(prefix):
                        break
                    out.append(bytes(k[8:]))
        return out

    # --- applying the log ---------------------------------------------------------------

    def apply(self, seg: int, rec: Record) -> None:
        """Apply one record. Deterministic: the same records give the same index."""
        t = rec.type
        if t == RecType.WRITE or t == RecType.RELOC or t == RecType.REF:
            self._apply_write(seg, rec)
        elif t == RecType.CREATE:
            self._apply_create(rec)
        elif t == RecType.UNLINK:
            self._apply_unlink(rec)
        elif t == RecType.RENAME:
            self._apply_rename(rec)
        elif t == RecType.SETATTR:
            self._apply_setattr(rec)
        elif t == RecType.PURGE:
            self.purge(rec.ino)
        elif t == RecType.IMPORT:
            self._apply_import(rec)
        elif t == RecType.LINK:
            self._apply_link(rec)
        elif t == RecType.GONE:
            body = json.loads(bytes(rec.payload))
            key = os.fsencode(body["path"]) + b"\0" + body["node"].encode()
            if body.get("drop"):
                self.txn.delete(key, db=self.gone)
            else:
                self.txn.put(key, json.dumps([body["mtime_ns"], body["size"],
                                              int(body.get("dir", 0))]).encode(), db=self.gone)
        elif t == RecType.WAITED:
            self._apply_waited(rec)
        elif t == RecType.TIER:
            body = json.loads(bytes(rec.payload))
            info = self.get_segment(int(body["seg"]))
            if info is not None and body.get("tier") == "cold":
                self.set_segment(int(body["seg"]), SegState.COLD)
        elif t == RecType.XATTR:
            name, value = fmt.parse_xattr(rec.payload)
            key = k_ino(rec.ino) + name
            if value is None:
                self.txn.delete(key, db=self.xattrs)
            else:
                self.txn.put(key, value, db=self.xattrs)
            node = self.get_inode(rec.ino)
            if node is not None:  # an xattr change is an inode change (xfstests generic/728)
                node.ctime_ns = rec.time_ns
                self.put_inode(node)
        # SEAL changes nothing in the namespace
        self.applied = (seg, rec.pos + rec.size, rec.seq)
        self.dirty += 1

    def _apply_write(self, seg: int, rec: Record) -> None:
        ino = self.get_inode(rec.ino)
        if ino is None:  # written after unlink, then purged: the data is dead
            self._data[seg] = self._data.get(seg, 0) + rec.length
            self._dead[seg] = self._dead.get(seg, 0) + rec.length
            return
        reloc = rec.type == RecType.RELOC
        if not reloc:
            self._clear_origin(rec.ino)  # modified here: the file is this node's now
        off, n = rec.offset, rec.length
        ext_seg, ext_pos = seg, rec.pos
        if rec.type == RecType.REF:
            # the bytes are those of an earlier record: point there, and count this reference
            # as data of that segment so it stays alive while the reference does
            ext_seg, ext_pos, n = fmt.REF_BODY.unpack_from(rec.payload)
        grew = False
        if n:
            self._data[ext_seg] = self._data.get(ext_seg, 0) + n
            self._punch(rec.ino, off, off + n)
            self._put_ext(rec.ino, Extent(off, ext_seg, ext_pos, 0, n, n))
            if off + n > ino.size:
                ino.size = off + n
                grew = True
        if reloc:
            # compaction moved bytes; nothing about the file changed, unless the write that
            # put them there was lost (a damaged segment): then they still count for the size
            if grew:
                self.put_inode(ino)
            return
        ino.mtime_ns = ino.ctime_ns = rec.time_ns
        self.put_inode(ino)

    def _apply_import(self, rec: Record) -> None:
        ino = self.get_inode(rec.ino)
        if ino is None:
            return
        body = json.loads(bytes(rec.payload))
        if not stat.S_ISREG(ino.mode):
            # a directory or symlink a refresh made for that node: it follows that node's
            # manifests (removed when they drop it) and is not published again from here
            # unless this node has something of its own under it. A symlink's new version
            # (another target) replaces the target in place.
            if stat.S_ISLNK(ino.mode) and "target" in body:
                ino.target = os.fsencode(body["target"])
                ino.size = len(ino.target)
            ino.mtime_ns = body["mtime_ns"]
            ino.ctime_ns = rec.time_ns
            self.put_inode(ino)
            origin = {"node": body["origin"], "mtime_ns": body["mtime_ns"]}
            if "path" in body:
                origin["path"] = body["path"]
            self.txn.put(k_ino(rec.ino), json.dumps(origin).encode(), db=self.origins)
            return
        self._drop_extents(rec.ino)
        for off, length, obj, pos, skip, rec_len in body["extents"]:
            self._put_ext(rec.ino, Extent(off, self.objref_id(obj), pos, skip, length, rec_len))
        ino.size = body["size"]
        ino.mtime_ns = body["mtime_ns"]
        ino.ctime_ns = rec.time_ns
        self.put_inode(ino)
        origin = {"node": body["origin"], "mtime_ns": body["mtime_ns"], "size": body["size"],
                  "ext": self.extents_digest(body["extents"])}
        if "path" in body:
            origin["path"] = body["path"]
        self.txn.put(k_ino(rec.ino), json.dumps(origin).encode(), db=self.origins)

    def chunk(self, digest: bytes) -> tuple[int, int, int] | None:
        raw = self.txn.get(digest, db=self.chunks)
        return CHUNK.unpack(raw) if raw is not None else None

    def put_chunk(self, digest: bytes, seg: int, pos: int, length: int) -> None:
        self.txn.put(digest, CHUNK.pack(seg, pos, length), db=self.chunks)

    def drop_chunks(self, segs: set[int]) -> int:
        """Forget the dedup rows of records in `segs` (deleted segments), and of any other
        segment that has no row left (an index from before this): nothing else ever removes
        one, and a row for every write of 64 KiB or more ever made would grow the index
        without end. One scan of the table; returns how many rows went."""
        if not segs:
            return 0
        alive: dict[int, bool] = {}

        def dead(seg: int) -> bool:
            if seg not in alive:
                alive[seg] = seg not in segs and self.get_segment(seg) is not None
            return not alive[seg]

        with self.txn.cursor(db=self.chunks) as c:
            gone = [bytes(k) for k, v in c if dead(CHUNK.unpack(v)[0])]
        for k in gone:
            self.txn.delete(k, db=self.chunks)
        return len(gone)

    def objref_id(self, obj: str) -> int:
        """The vseg id standing for published object "node/segid" (allocated on first use)."""
        key = obj.encode()
        raw = self.txn.get(key, db=self.objids)
        if raw is not None:
            return U64.unpack(raw)[0]
        raw = self.txn.get(b"next_objref", db=self.meta)
        vseg = U64.unpack(raw)[0] if raw else VSEG_BIT
        self.txn.put(b"next_objref", U64.pack(vseg + 1), db=self.meta)
        self.txn.put(key, U64.pack(vseg), db=self.objids)
        self.txn.put(U64.pack(vseg), key, db=self.objrefs)
        return vseg

    def iter_objrefs(self) -> Iterator[tuple[int, str, int]]:
        """(vseg id, node, segment id) of every published object an import named."""
        with self.txn.cursor(db=self.objrefs) as c:
            for k, v in c:
                node, seg = bytes(v).decode().rsplit("/", 1)
                yield U64.unpack(k)[0], node, int(seg, 16)

    def named_vsegs(self) -> set[int]:
        """The vseg ids some extent names, as of the last commit: read in a transaction of its
        own, so any thread may call it while another one writes (a full scan of `extents`)."""
        out: set[int] = set()
        with self.env.begin(db=self.extents, buffers=True) as txn:
            for v in txn.cursor().iternext(keys=False):
                seg = int.from_bytes(v[:8], "little")  # EXTENT's first field
                if seg & VSEG_BIT:
                    out.add(seg)
        return out

    def objref(self, vseg: int) -> tuple[str, int] | None:
        raw = self.txn.get(U64.pack(vseg), db=self.objrefs)
        if raw is None:
            return None
        node, seg = bytes(raw).decode().rsplit("/", 1)
        return node, int(seg, 16)

    @staticmethod
    def extents_digest(extents: list) -> str:
        """Of an imported file's extents (the manifest's lists), to see them change."""
        raw = json.dumps([list(x) for x in extents], separators=(",", ":")).encode()
        return xxhash.xxh3_64_hexdigest(raw)

    def origin(self, ino: int) -> dict | None:
        raw = self.txn.get(k_ino(ino), db=self.origins)
        return json.loads(bytes(raw)) if raw is not None else None

    def gone_get(self, path: str, node: str) -> tuple[int, int, bool] | None:
        raw = self.txn.get(os.fsencode(path) + b"\0" + node.encode(), db=self.gone)
        if raw is None:
            return None
        m, size, d = json.loads(bytes(raw))
        return m, size, bool(d)

    def iter_gone(self) -> Iterator[tuple[str, str, int, int, bool]]:
        """(path, node, mtime_ns, size, is a directory): the other nodes' entries deleted or
        renamed away here, which this node's manifest tells them about."""
        with self.txn.cursor(db=self.gone) as cur:
            for k, v in cur:
                path, node = bytes(k).split(b"\0", 1)
                m, size, d = json.loads(bytes(v))
                yield os.fsdecode(path), node.decode(), m, size, bool(d)

    # `ckptfs wait` of a directory: when it began (WAITED records), kept in `meta` under
    # WAITED_KEY + inode; the manifest names them by path (other nodes' `wait --all-nodes`)

    def _apply_waited(self, rec: Record) -> None:
        self.txn.put(WAITED_KEY + U64.pack(rec.ino), U64.pack(rec.time_ns), db=self.meta)
        have = [(t, ino) for ino, t in self.iter_waited()]
        # deterministic, and bounded: those of directories that are gone, then the oldest
        stale = [(t, ino) for t, ino in have
                 if ino != ROOT_INO and self.get_inode(ino) is None]
        keep = sorted(set(have) - set(stale))
        stale += keep[:max(0, len(keep) - MAX_WAITED)]
        for _t, ino in stale:
            self.txn.delete(WAITED_KEY + U64.pack(ino), db=self.meta)

    def mark_bad(self, seg: int, pos: int) -> None:
        """Replay found the record at (seg, pos) damaged: remembered in `meta` under
        BAD_KEY, so a wait of a file that still names it says so after any later mount."""
        self.txn.put(BAD_KEY + U64.pack(seg) + U64.pack(pos), b"", db=self.meta)
        self.dirty += 1

    def iter_bad(self) -> Iterator[tuple[int, int]]:
        with self.txn.cursor(db=self.meta) as cur:
            if cur.set_range(BAD_KEY):
                for k in cur.iternext(values=False):
                    if not k.startswith(BAD_KEY):
                        break
                    n = len(BAD_KEY)
                    yield U64.unpack(k[n:n + 8])[0], U64.unpack(k[n + 8:n + 16])[0]

    def iter_waited(self) -> Iterator[tuple[int, int]]:
        """(directory inode, time_ns its last `ckptfs wait` began)."""
        with self.txn.cursor(db=self.meta) as cur:
            if cur.set_range(WAITED_KEY):
                for k, v in cur:
                    if not k.startswith(WAITED_KEY):
                        break
                    yield U64.unpack(k[len(WAITED_KEY):])[0], U64.unpack(v)[0]

    def _clear_origin(self, ino: int) -> None:
        self.txn.delete(k_ino(ino), db=self.origins)

    def _take_over(self, ino: int) -> None:
        """A renamed file, or every file under a renamed directory, is this node's from now
        on (see _apply_rename)."""
        if not self.txn.stat(self.origins)["entries"]:
            return  # nothing imported: nothing to walk (a renamed checkpoint of 10k files)
        node = self.get_inode(ino)
        if node is None:
            return
        self._clear_origin(ino)
        if not node.is_dir:
            return
        stack = [ino]
        while stack:
            d = stack.pop()
            children = [child for _c, _n, child in self.readdir(d, 0)]
            for child in children:
                c = self.get_inode(child)
                if c is None:
                    continue
                self._clear_origin(child)
                if c.is_dir:
                    stack.append(child)

    def _touch_dir(self, ino: int, now: int, nlink_delta: int = 0) -> None:
        d = self.get_inode(ino)
        if d is not None:
            d.mtime_ns = d.ctime_ns = now
            d.nlink += nlink_delta
            self.put_inode(d)

    def _apply_create(self, rec: Record) -> None:
        parent, mode, uid, gid, rdev, name, target = fmt.parse_create(rec.payload)
        is_dir = stat.S_ISDIR(mode)
        now = rec.time_ns
        self.put_inode(Inode(rec.ino, mode, uid, gid, 2 if is_dir else 1, rdev,
                             len(target) if stat.S_ISLNK(mode) else 0, now, now, now, target))
        self._link(parent, name, rec.ino, rec.seq)
        self._touch_dir(parent, now, 1 if is_dir else 0)
        if rec.ino >= self.next_ino:
            self.next_ino = rec.ino + 1

    def _apply_link(self, rec: Record) -> None:
        parent, name = fmt.parse_link(rec.payload)
        c = self.get_inode(rec.ino)
        if c is None or c.is_dir or self.lookup(parent, name) is not None:
            return  # checked before it was logged; replay of a damaged log stays harmless
        self._link(parent, name, rec.ino, rec.seq)
        c.nlink += 1
        c.ctime_ns = rec.time_ns
        self.put_inode(c)
        self._touch_dir(parent, rec.time_ns)

    def _drop_link(self, child: int, now: int) -> bool:
        """One directory entry of `child` went away; True if the child was a directory."""
        c = self.get_inode(child)
        if c is None:
            return False
        c.nlink = 0 if c.is_dir else max(0, c.nlink - 1)
        c.ctime_ns = now
        self.put_inode(c)
        return c.is_dir

    def _apply_unlink(self, rec: Record) -> None:
        name = bytes(rec.payload)
        child = self._unlink_entry(rec.ino, name)
        if child is None:
            return
        was_dir = self._drop_link(child, rec.time_ns)
        self._touch_dir(rec.ino, rec.time_ns, -1 if was_dir else 0)

    def _apply_rename(self, rec: Record) -> None:
        op, old, np_, new, flags = fmt.parse_rename(rec.payload)
        now = rec.time_ns
        src = self.lookup(op, old)
        if src is None:
            return
        src_ino = self.get_inode(src)
        src_dir = src_ino is not None and src_ino.is_dir
        dst = self.lookup(np_, new)
        if flags & 2:  # RENAME_EXCHANGE
            if dst is None:
                return
            dst_dir = bool((d := self.get_inode(dst)) and d.is_dir)
            # The names stay and swap what they point to, each keeping its readdir cookie
            # (two fresh links would both get rec.seq: in one directory, one would hide the
            # other from readdir).
            self._repoint(op, old, dst)
            self._repoint(np_, new, src)
            for moved in (src, dst):  # as ext4: both inodes changed (their parent, at least)
                if (m := self.get_inode(moved)) is not None:
                    m.ctime_ns = now
                    self.put_inode(m)
                    self._take_over(moved)  # see below
            if op != np_ and src_dir != dst_dir:
                delta = 1 if dst_dir else -1
                self._touch_dir(op, now, delta)
                self._touch_dir(np_, now, -delta)
            else:
                self._touch_dir(op, now)
                self._touch_dir(np_, now)
            return
        if dst is not None and dst == src:
            return
        self._unlink_entry(op, old)
        dst_was_dir = False
        if dst is not None:
            # the name stays and points to the renamed inode, keeping its readdir cookie: a
            # fresh one would be past the bound of a listing in progress, which would then
            # miss a name that never stopped existing (`os.replace(tmp, latest)`)
            dst_was_dir = self._drop_link(dst, now)
            self._repoint(np_, new, src)
        else:
            self._link(np_, new, src, rec.seq)
        if src_ino is not None:
            src_ino.ctime_ns = now
            self.put_inode(src_ino)
            # another node's file renamed here (or one under a directory renamed here: HF's
            # tmp-checkpoint-N -> checkpoint-N, with other nodes' shards in it) is this
            # node's from now on: it publishes the file under the new name, with extents in
            # the other node's objects. The old name got a tombstone (GONE, written by the
            # namespace before this record), so that node removes its version: a move. Left
            # that node's, the new name would be in no manifest (`wait` would say
            # published) and be removed here once that node's next manifest does not list
            # it. (Not for a hard link or a chmod: the file would stay this node's under its
            # old name too, and the other node's deletes would no longer reach it.)
            self._take_over(src)
        if op == np_:
            self._touch_dir(op, now, -1 if dst_was_dir else 0)
        else:
            self._touch_dir(op, now, -1 if src_dir else 0)
            self._touch_dir(np_, now, (1 if src_dir else 0) - (1 if dst_was_dir else 0))

    def _apply_setattr(self, rec: Record) -> None:
        ino = self.get_inode(rec.ino)
        if ino is None:
            return
        mask, mode, uid, gid, size, a, m, c = fmt.SETATTR_BODY.unpack_from(rec.payload)
        if mask & fmt.SET_MODE:
            ino.mode = (ino.mode & ~0o7777) | (mode & 0o7777)
        if mask & fmt.SET_UID:
            ino.uid = uid
        if mask & fmt.SET_GID:
            ino.gid = gid
        if mask & fmt.SET_SIZE:
            self._clear_origin(rec.ino)
            if size < ino.size:
                self._punch(rec.ino, size, max(ino.size, size) + (1 << 62))
            ino.size = size
        if mask & fmt.SET_ATIME:
            ino.atime_ns = a
        if mask & fmt.SET_MTIME:
            ino.mtime_ns = m
        ino.ctime_ns = c if mask & fmt.SET_CTIME else rec.time_ns
        self.put_inode(ino)

    def purge(self, ino: int) -> None:
        """Drop an inode nobody can reach any more, with its data and xattrs."""
        self._drop_extents(ino)
        self._clear_origin(ino)
        self.txn.delete(k_ino(ino), db=self.inodes)
        for name in self.list_xattrs(ino):
            self.txn.delete(k_ino(ino) + name, db=self.xattrs)

    def orphans(self) -> list[int]:
        """Inodes with no directory entry left (unlinked while open before a crash)."""
        return [i.ino for i in self.iter_inodes() if i.nlink == 0 and i.ino != ROOT_INO]
