"""Manifests: a node's published namespace as one immutable, checksummed object.

    b"CKPTMAN1" | xxh3_64 of the compressed body (u64 LE) | zlib(JSON body)

The body (docs/format.md):

    {"format": "ckptfs-manifest", "version": 1, "node": "n0", "seq": <log seq it reflects>,
     "created_ns": ..., "objects": {"n0/0000000000000003": {"size": ..}, ...},
     "entries": [{"path": "step_1/__0_0.distcp", "type": "f", "mode": .., "uid": .., "gid": ..,
                  "size": .., "mtime_ns": ..,
                  "extents": [[file_off, length, "n0/0000000000000003", record_pos, skip,
                               record_payload_len], ...]},
                 {"path": "step_1", "type": "d", ...}, {"path": "l", "type": "l", "target": ..}]}

An extent is `length` bytes starting `skip` bytes into the payload of the record at
`record_pos` of the object; the record's checksum covers its whole payload, so readers
verify what they read. Paths are relative, '/'-separated, never contain '.', '..', empty
components or NUL. Manifests are untrusted input: `parse` validates all of it.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Iterator

import xxhash

from ckptfs import segment as fmt
from ckptfs.index import ROOT_INO, VSEG_BIT, Index
from ckptfs.shared import NODE_RE

MAGIC = b"CKPTMAN1"
MAX_MANIFEST = 1 << 31
MAX_PATH = 64 * 1024


class ManifestError(Exception):
    pass


class NotYet(Exception):
    """The view still names data that was never uploaded (a dropped segment whose deletion the
    view has not reached yet): no manifest can describe it now."""


class Extents(Sequence):
    """A file's extents, six integers each in one array, the object as an index into the
    manifest's names; read as lists [file_offset, length, object, record_pos, skip,
    record_payload_len]."""

    __slots__ = ("_a", "_names")

    def __init__(self, a: array, names: list[str]) -> None:
        self._a, self._names = a, names

    def __len__(self) -> int:
        return len(self._a) // 6

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return list(self)[i]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        a, j = self._a, 6 * i
        return [a[j], a[j + 1], self._names[a[j + 2]], a[j + 3], a[j + 4], a[j + 5]]

    def __iter__(self) -> Iterator[list]:
        a, names = self._a, self._names
        for j in range(0, len(a), 6):
            yield [a[j], a[j + 1], names[a[j + 2]], a[j + 3], a[j + 4], a[j + 5]]

    def __eq__(self, other: object) -> bool:
        return list(self) == (list(other) if isinstance(other, Sequence) else other)

    def __repr__(self) -> str:
        return f"Extents({list(self)!r})"


@dataclass(slots=True)
class Entry:
    path: str
    type: str  # "f", "d", "l"
    mode: int
    uid: int
    gid: int
    size: int
    mtime_ns: int
    target: str = ""
    # [file_offset, length, object, record_pos, skip, record_payload_len] each
    extents: "Extents" = field(default_factory=lambda: Extents(array("q"), []))


@dataclass
class Manifest:
    node: str
    seq: int
    created_ns: int
    objects: dict[str, dict]
    entries: list[Entry]
    cold: str = ""  # the node's cold tier, where objects with "tier": "cold" are
    # other nodes' entries deleted or renamed away on this node: (path, node, mtime_ns, size,
    # is a directory); that node removes its version, readers hide it meanwhile
    gone: list[tuple[str, str, int, int, bool]] = field(default_factory=list)
    # (directory path, "" for the root; time_ns): this node's `ckptfs wait` of it began then,
    # and what the node wrote under it before that is in this manifest
    waited: list[tuple[str, int]] = field(default_factory=list)

    def tier(self, obj: str) -> str:
        info = self.objects.get(obj)
        return info.get("tier", "shared") if isinstance(info, dict) else "shared"

    def files(self) -> Iterator[Entry]:
        return (e for e in self.entries if e.type == "f")


def deleted_version(e: Entry, mtime_ns: int, size: int, is_dir: bool) -> bool:
    """Is `e` the version a tombstone (mtime, size, is a directory) names? A directory
    whatever its version; a symlink by its mtime; a file by its mtime and size."""
    if e.type == "d" or is_dir:
        return e.type == "d" and is_dir
    return e.mtime_ns == mtime_ns and (e.type != "f" or e.size == size)


def obj_name(node: str, seg: int) -> str:
    return f"{node}/{seg:016x}"


def split_obj(obj: str) -> tuple[str, int]:
    node, seg = obj.rsplit("/", 1)
    return node, int(seg, 16)


def walk(index: Index, skip_foreign_of: str | None = None,
         dir_paths: dict[int, str] | None = None) -> Iterator[tuple[str, Any]]:
    """(relative path, inode) for everything reachable from the root, depth first; a
    directory always comes before what is in it.

    With skip_foreign_of=NODE, what a refresh imported from other nodes is left out: files
    (not modified here since) and symlinks are those nodes' to publish, and a directory made
    for another node's entries comes only with the first thing of this node's under it. So
    a directory or symlink that its node deletes is not published again from here.

    dir_paths: for each directory inode in it, set to the directory's path when the walk
    reaches it, given out or not."""
    # a stack entry: (directory inode, its path + "/", the chain of directories above it
    # not given out yet: [path, inode, given out?] from the root down)
    stack: list[tuple[int, str, list[list]]] = [(ROOT_INO, "", [])]
    while stack:
        dino, prefix, held = stack.pop()
        for _cookie, name, child in index.readdir(dino, 0):
            node = index.get_inode(child)
            if node is None:
                continue
            path = prefix + os.fsdecode(name)
            foreign = False
            if skip_foreign_of is not None:
                origin = index.origin(child)
                foreign = origin is not None and origin.get("node") != skip_foreign_of
            if node.is_dir:
                if dir_paths is not None and child in dir_paths:
                    dir_paths[child] = path
                if foreign:
                    stack.append((child, path + "/", [*held, [path, node, False]]))
                    continue
            elif foreign:
                continue
            for h in held:
                if not h[2]:
                    h[2] = True
                    yield h[0], h[1]
            if node.is_dir:
                yield path, node
                stack.append((child, path + "/", []))
            else:
                yield path, node


class _Writer:
    """The compressed JSON text of a manifest, produced piece by piece: memory stays bounded
    by the compressed output, whatever the namespace's size."""

    FLUSH = 1 << 16

    def __init__(self) -> None:
        self.comp = zlib.compressobj(3)
        self.out: list[bytes] = []
        self.pending: list[str] = []
        self.n = 0

    def add(self, text: str) -> None:
        self.pending.append(text)
        self.n += len(text)
        if self.n >= self.FLUSH:
            self._push()

    def _push(self) -> None:
        self.out.append(self.comp.compress("".join(self.pending).encode()))
        self.pending.clear()
        self.n = 0

    def finish(self) -> bytes:
        self._push()
        self.out.append(self.comp.flush())
        return b"".join(self.out)


def _json(v: Any) -> str:
    return json.dumps(v, separators=(",", ":"))


def build(index: Index, node: str, seq: int, objects: dict[str, dict], created_ns: int,
          unavailable: set[int] | frozenset[int] = frozenset(), cold: str = "") -> bytes:
    """Serialize the (published view) index as node's manifest.

    Streamed: entries (and a file's extents) are written as the index is walked, and the
    objects table, which only the walk finds, after them. Memory is about 3x the compressed
    output (~33 MiB for a million extents), not the ~400 MiB of a JSON body built whole first
    (`python -m bench.manifest_scale`)."""
    w = _Writer()
    head = {"format": "ckptfs-manifest", "version": 1, "node": node, "seq": seq,
            "created_ns": created_ns, "cold": cold}
    w.add(_json(head)[:-1] + ',"entries":[')
    used: set[str] = set()
    names: dict[int, str] = {}  # this node's segment -> object name
    sep = ""
    waited = dict(index.iter_waited())
    dir_paths = {ino: "" for ino in waited} if waited else None
    for path, ino in walk(index, skip_foreign_of=node, dir_paths=dir_paths):
        e: dict[str, Any] = {"path": path, "mode": ino.mode & 0o7777, "uid": ino.uid,
                             "gid": ino.gid, "size": ino.size, "mtime_ns": ino.mtime_ns}
        if ino.is_dir:
            e["type"] = "d"
        elif stat.S_ISLNK(ino.mode):
            e["type"] = "l"
            e["target"] = os.fsdecode(ino.target)
        elif stat.S_ISREG(ino.mode):
            e["type"] = "f"
        else:
            continue  # fifos, sockets, devices are not checkpoint data
        if e["type"] != "f":
            w.add(sep + _json(e))
            sep = ","
            continue
        w.add(sep + _json(e)[:-1] + ',"extents":[')
        sep = ","
        xsep = ""
        for x in index.iter_extents(ino.ino):
            if x.seg & VSEG_BIT:
                ref = index.objref(x.seg)
                if ref is None:
                    raise ManifestError(f"{path}: extent refers to unknown object {x.seg}")
                obj = obj_name(*ref)
            else:
                obj = names.get(x.seg)
                if obj is None:
                    if x.seg in unavailable:
                        raise NotYet(f"{path} still names dropped segment {x.seg}")
                    obj = names[x.seg] = obj_name(node, x.seg)
            used.add(obj)
            w.add(f'{xsep}[{x.start},{x.length},"{obj}",{x.rec_pos},{x.skip},{x.rec_len}]')
            xsep = ","
        w.add("]}")
    gone = [list(g) for g in index.iter_gone()]
    # directories whose `ckptfs wait` began at t: everything this node wrote under them
    # before t is in this manifest (the root's path is "", reached without a walk)
    reached = {ino: p for ino, p in (dir_paths or {}).items() if p or ino == ROOT_INO}
    waits = sorted([reached[ino], t] for ino, t in waited.items() if ino in reached)
    w.add('],"gone":' + _json(gone) + ',"waited":' + _json(waits) + ',"objects":'
          + _json({o: objects.get(o, {}) for o in sorted(used)}) + "}")
    raw = w.finish()
    return MAGIC + struct.pack("<Q", xxhash.xxh3_64_intdigest(raw)) + raw


def _check_path(p: Any) -> str:
    if not isinstance(p, str) or not p or len(p) > MAX_PATH:
        raise ManifestError(f"bad path {p!r}")
    for comp in p.split("/"):
        if comp in ("", ".", "..") or "\0" in comp or len(os.fsencode(comp)) > 255:
            raise ManifestError(f"bad path {p!r}")
    return p


LIMIT = 1 << 63  # of every integer in a manifest


def _int(v: Any, what: str, lo: int = 0, hi: int = LIMIT) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < hi:
        raise ManifestError(f"bad {what}: {v!r}")
    return v


class _Decoder:
    """Entries are converted as json decodes them (its object_hook runs on each JSON object
    once its members are decoded), into Entry objects with compact extents. The decoded body
    never exists whole: a million extents take ~48 MB, not ~400 MB of Python lists."""

    def __init__(self, entries: bool = True) -> None:
        self.names: list[str] = []  # object names the extents use, by index
        self.ids: dict[str, int] = {}
        self.used_by: list[str] = []  # a path that uses each, for the error message
        self.entries = entries

    def hook(self, d: dict) -> Any:
        if "path" not in d:
            return d
        return self.entry(d) if self.entries else None

    def entry(self, e: dict) -> "Entry":
        path = _check_path(e.get("path"))
        t = e.get("type")
        if t not in ("f", "d", "l"):
            raise ManifestError(f"{path}: bad type {t!r}")
        size = _int(e.get("size", 0), f"{path}: size")
        ent = Entry(path, t, _int(e.get("mode", 0o644), f"{path}: mode", 0, 0o10000),
                    _int(e.get("uid", 0), "uid", 0, 1 << 32),
                    _int(e.get("gid", 0), "gid", 0, 1 << 32), size,
                    _int(e.get("mtime_ns", 0), "mtime", -(1 << 63)))
        if t == "l":
            target = e.get("target")
            if not isinstance(target, str) or not target or len(target) > 4095 \
                    or "\0" in target:
                raise ManifestError(f"{path}: bad symlink target")
            ent.target = target
        if t != "f":
            return ent
        xs = e.get("extents", [])
        if not isinstance(xs, list):
            raise ManifestError(f"{path}: bad extents")
        a = array("q")
        ids, names = self.ids, self.names
        last_end = 0
        for x in xs:
            if not isinstance(x, list) or len(x) != 6:
                raise ManifestError(f"{path}: bad extent {x!r}")
            off, ln, obj, pos, skip, rec_len = x
            # the common case in one test (a million extents is a TiB of data)
            if not (type(off) is int and type(ln) is int and type(pos) is int
                    and type(skip) is int and type(rec_len) is int
                    and 0 <= off < LIMIT and 1 <= ln < LIMIT and 0 <= skip < LIMIT
                    and fmt.SEGMENT_HEADER_SIZE <= pos < LIMIT
                    and 1 <= rec_len <= fmt.MAX_PAYLOAD):
                _int(off, f"{path}: extent offset")
                _int(ln, f"{path}: extent length", 1)
                _int(pos, f"{path}: record position", fmt.SEGMENT_HEADER_SIZE)
                _int(skip, f"{path}: extent skip")
                _int(rec_len, f"{path}: record length", 1, fmt.MAX_PAYLOAD + 1)
            if not isinstance(obj, str):
                raise ManifestError(f"{path}: bad object name {obj!r}")
            oid = ids.get(obj)
            if oid is None:  # checked against the objects table once it is decoded
                oid = ids[obj] = len(names)
                names.append(obj)
                self.used_by.append(path)
            if off < last_end or off + ln > size or skip + ln > rec_len:
                raise ManifestError(f"{path}: extent out of range {x!r}")
            last_end = off + ln
            a.extend((off, ln, oid, pos, skip, rec_len))
        ent.extents = Extents(a, names)
        return ent


def parse(data: bytes, where: str = "manifest", entries: bool = True) -> Manifest:
    """Validate and decode a manifest; ManifestError with one line on anything wrong.

    `entries=False`: the objects table alone (what GC needs to know which objects a node
    references), with `entries` empty. The entries are decoded and dropped one by one, not
    checked (350,000 files: 0.7 s and 140 MiB at the peak instead of 2.8 s and 219 MiB)."""
    try:
        if len(data) < 16 or data[:8] != MAGIC:
            raise ManifestError("not a ckptfs manifest (bad magic)")
        (csum,) = struct.unpack_from("<Q", data, 8)
        raw = data[16:]
        if xxhash.xxh3_64_intdigest(raw) != csum:
            raise ManifestError("checksum mismatch (truncated or corrupt)")
        d = zlib.decompressobj()
        text = d.decompress(raw, MAX_MANIFEST)
        if d.unconsumed_tail:
            raise ManifestError("too large")
        body_text = text.decode()  # UTF-8 (json.loads would keep the bytes alive meanwhile)
        del text
        dec = _Decoder(entries)
        body = json.loads(body_text, object_hook=dec.hook)
        del body_text
        if not isinstance(body, dict) or body.get("format") != "ckptfs-manifest":
            raise ManifestError("not a ckptfs manifest body")
        if body.get("version") != 1:
            raise ManifestError(f"unsupported manifest version {body.get('version')!r}")
        node = body.get("node")
        if not isinstance(node, str) or not NODE_RE.match(node):
            raise ManifestError(f"bad node id {node!r}")
        objects = body.get("objects")
        if not isinstance(objects, dict):
            raise ManifestError("bad objects table")
        for o, info in objects.items():
            _check_obj(o)
            if not isinstance(info, dict):
                raise ManifestError(f"object {o}: bad entry {info!r}")
            if info.get("tier", "shared") not in ("shared", "cold"):
                raise ManifestError(f"object {o}: bad tier {info.get('tier')!r}")
        for obj, path in zip(dec.names, dec.used_by):
            if obj not in objects:
                raise ManifestError(f"{path}: extent names unlisted object {obj!r}")
        cold = body.get("cold", "")
        if not isinstance(cold, str) or len(cold) > 4096 or "\0" in cold:
            raise ManifestError("bad cold tier location")
        listed = body.get("entries", [])
        if not isinstance(listed, list):
            raise ManifestError("bad entries")
        if not entries:
            listed = []
        kinds: dict[str, str] = {}
        for e in listed:
            if not isinstance(e, Entry):
                raise ManifestError("bad entry")
            if e.path in kinds:
                raise ManifestError(f"duplicate path {e.path!r}")
            kinds[e.path] = e.type
        for e in listed:
            parent = e.path.rsplit("/", 1)[0] if "/" in e.path else ""
            if parent in kinds and kinds[parent] != "d":
                what = "a symlink" if kinds[parent] == "l" else "a file"
                raise ManifestError(f"{e.path}: its parent {parent!r} is {what}, "
                                    f"not a directory")
        gone = body.get("gone", [])
        if not isinstance(gone, list):
            raise ManifestError("bad gone list")
        tombs: list[tuple[str, str, int, int, bool]] = []
        for g in gone:
            if not isinstance(g, list) or len(g) != 5 or not isinstance(g[1], str) \
                    or not NODE_RE.match(g[1]) or g[4] not in (0, 1, False, True):
                raise ManifestError(f"bad gone entry {g!r}")
            tombs.append((_check_path(g[0]), g[1], _int(g[2], "gone mtime", -(1 << 63)),
                          _int(g[3], "gone size"), bool(g[4])))
        waited = body.get("waited", [])
        if not isinstance(waited, list):
            raise ManifestError("bad waited list")
        waits: list[tuple[str, int]] = []
        for w in waited:
            if not isinstance(w, list) or len(w) != 2:
                raise ManifestError(f"bad waited entry {w!r}")
            waits.append((_check_path(w[0]) if w[0] != "" else "", _int(w[1], "waited time")))
        return Manifest(node, _int(body.get("seq", 0), "seq"),
                        _int(body.get("created_ns", 0), "created_ns"), objects, listed, cold,
                        tombs, waits)
    except ManifestError as e:
        raise ManifestError(f"{where}: {e}") from None
    except (ValueError, TypeError, zlib.error, struct.error, KeyError, OverflowError) as e:
        raise ManifestError(f"{where}: malformed ({e})") from None


def _check_obj(o: Any) -> None:
    if not isinstance(o, str) or "/" not in o:
        raise ManifestError(f"bad object name {o!r}")
    node, seg = o.rsplit("/", 1)
    if not NODE_RE.match(node) or len(seg) != 16 or any(c not in "0123456789abcdef" for c in seg):
        raise ManifestError(f"bad object name {o!r}")
