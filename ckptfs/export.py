"""Reading the shared store with no mount and no local state: the merged view, ls, export.

What a fresh node sees: every node's newest valid manifest, merged by path with the conflict
rule of remote.py (newest mtime wins, ties to the larger node id), data read from the objects
and verified record by record. Paths from manifests are validated (manifest.parse) and
`export` additionally refuses anything that would resolve outside DEST.
"""

from __future__ import annotations

import bisect
import itertools
import os
import re
import shutil
import stat
import threading
from array import array
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from ckptfs import manifest
from ckptfs import segment as fmt
from ckptfs.remote import fetch_manifests
from ckptfs.shared import ANSWER_TIMEOUT, SharedError, SharedStore, answers, bounded, open_store


class ExportError(Exception):
    pass


class Resolver:
    """Where each object is: on the shared store, or on its node's cold tier (the manifests
    say which). Reads try the tier the newest manifest names first, then the other one."""

    def __init__(self, store: SharedStore, manifests: dict[str, manifest.Manifest]):
        self.store = store
        self.tiers: dict[str, str] = {}
        self.cold_urls: dict[str, str] = {}
        self._cold: dict[str, SharedStore] = {}
        self._lock = threading.Lock()  # export reads on several threads
        for node, m in manifests.items():
            if m.cold:
                self.cold_urls[node] = m.cold
            for obj in m.objects:
                if obj.rsplit("/", 1)[0] == node or obj not in self.tiers:
                    self.tiers[obj] = m.tier(obj)

    def cold(self, node: str) -> SharedStore | None:
        url = self.cold_urls.get(node)
        if url is None:
            return None
        with self._lock:
            if node not in self._cold:
                self._cold[node] = open_store(url)
            return self._cold[node]

    def _stores(self, node: str, seg: int) -> list[SharedStore]:
        cold = self.cold(node)
        order = [self.store] if cold is None else (
            [cold, self.store] if self.tiers.get(manifest.obj_name(node, seg)) == "cold"
            else [self.store, cold])
        return order

    def _try(self, node: str, seg: int, fn: str, *args: int) -> object:
        err: Exception | None = None
        for st in self._stores(node, seg):
            try:
                return getattr(st, fn)(node, seg, *args)
            except (OSError, SharedError) as e:
                err = e
        assert err is not None
        raise err

    def read_range(self, node: str, seg: int, offset: int, length: int) -> bytes:
        return self._try(node, seg, "read_range", offset, length)  # type: ignore[return-value]

    def object_size(self, node: str, seg: int) -> int:
        return self._try(node, seg, "object_size")  # type: ignore[return-value]


@dataclass
class View:
    entries: dict[str, tuple[str, manifest.Entry]]  # path -> (node, entry)
    manifests: dict[str, manifest.Manifest]
    errors: list[str]
    resolver: Resolver | None = None


def merged_view(store: SharedStore) -> View:
    if not store.exists():
        raise ExportError(f"{store.base} holds no ckptfs shared store (no {store.root})")
    errors: list[str] = []
    found = fetch_manifests(store, {}, errors)
    # versions another node deleted (or renamed away): hidden until their node drops them
    tombs: dict[tuple[str, str], list[tuple[int, int, bool]]] = {}
    for node, m in found.items():
        for path, owner, mtime_ns, size, is_dir in m.gone:
            if owner != node:
                tombs.setdefault((path, owner), []).append((mtime_ns, size, is_dir))
    entries: dict[str, tuple[str, manifest.Entry]] = {}
    for node, m in sorted(found.items()):
        for e in m.entries:
            gone = tombs.get((e.path, node))
            if gone and any(manifest.deleted_version(e, *t) for t in gone):
                continue
            cur = entries.get(e.path)
            if cur is None or (e.mtime_ns, node) > (cur[1].mtime_ns, cur[0]):
                entries[e.path] = (node, e)
    # a path whose winner is not a directory hides everything below it
    hidden: set[str] = set()
    for path in sorted(entries):  # a parent sorts before its children
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        if parent and (parent in hidden or (parent in entries
                                            and entries[parent][1].type != "d")):
            hidden.add(path)
            del entries[path]
    return View(entries, found, errors, Resolver(store, found))


def select(view: View, prefix: str) -> Iterator[tuple[str, str, manifest.Entry]]:
    """(relative path under prefix, node, entry), sorted by path."""
    prefix = prefix.strip("/")
    for path in sorted(view.entries):
        if prefix and path != prefix and not path.startswith(prefix + "/"):
            continue
        node, e = view.entries[path]
        rel = path[len(prefix):].lstrip("/") if prefix else path
        yield rel, node, e


SMALL_RECORD = 256 << 10  # records at most this big are read through a Window
WINDOW = 4 << 20  # at most this much in one read of small records
GAP = 1 << 20  # bytes nobody asked for read rather than another request (a GET's worth)
READS_IN_FLIGHT = 8  # bigger records of a file read at once (GETs on S3, reads on a NAS)
# (and as many small ones that are read alone, between them)


class Window:
    """read_range for reads that go through objects in order (export sorts its files so): a
    small record is read together with the small records after it in its object that the
    export will ask for next (`plan`), up to WINDOW bytes and skipping at most GAP bytes
    between two of them, and those come out of the same read. A checkpoint's small files
    lie side by side in a segment, so a run of them costs one GET on S3 (one read on a NAS)
    instead of one each, and small files far apart cost no more than they did. Bigger
    records, and small ones that nothing planned lies close to, are read on their own,
    READS_IN_FLIGHT of a file's at once (begin): one GET at a time moved ~100 MB/s from S3.
    Memory: one window, and READS_IN_FLIGHT records."""

    def __init__(self, src: SharedStore | Resolver,
                 plan: dict[tuple[str, int], list[tuple[int, int]]] | None = None):
        self.src = src
        # (node, seg) -> the (start, end) of each small record to be read, by start
        self.plan = {k: (array("q", (a for a, _b in v)), array("q", (b for _a, b in v)))
                     for k, v in (plan or {}).items()}
        self.key: tuple[str, int] | None = None
        self.start = 0
        self.data = b""
        self._pool: ThreadPoolExecutor | None = None

    @staticmethod
    def plan_for(entries: Iterable[manifest.Entry]
                 ) -> dict[tuple[str, int], list[tuple[int, int]]]:
        spans: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for e in entries:
            for _off, _length, obj, pos, _skip, rec_len in e.extents:
                n = fmt.RECORD_HEADER_SIZE + rec_len
                if n <= SMALL_RECORD:
                    spans.setdefault(manifest.split_obj(obj), []).append((pos, pos + n))
        for v in spans.values():
            v.sort()
        return spans

    def _extent(self, key: tuple[str, int], offset: int, end: int) -> int:
        """Where a read for the small record [offset, end) stops: after the planned records
        that follow it closely enough."""
        planned = self.plan.get(key)
        if planned is None:
            return end
        starts, ends = planned
        i = bisect.bisect_left(starts, offset)
        while i < len(starts) and starts[i] - end <= GAP and ends[i] - offset <= WINDOW:
            end = max(end, ends[i])
            i += 1
        return end

    def begin(self, node: str, seg: int, offset: int, length: int) -> Callable[[], bytes]:
        """Start a read; the returned call gives its bytes (or raises its error). A small
        record is read now, through the window, unless nothing planned lies close enough to
        share its read: then it is read on the pool like a big one. (A file written in 1 MiB
        writes from a buffer not aligned to a page is a chain of big records and few-byte
        ones, far apart: read one at a time, each few-byte record stopped the export for a
        whole request, ~1 MiB per round trip to S3.)"""
        if length <= SMALL_RECORD and not self._lone(node, seg, offset, length):
            try:
                data = self.read_range(node, seg, offset, length)
            except (OSError, SharedError) as e:
                err = e

                def fail() -> bytes:
                    raise err
                return fail
            return lambda: data
        if self._pool is None:
            # big records, and as many small ones read alone between them
            self._pool = ThreadPoolExecutor(2 * READS_IN_FLIGHT, "ckptfs-export")
        return self._pool.submit(self.src.read_range, node, seg, offset, length).result

    def _lone(self, node: str, seg: int, offset: int, length: int) -> bool:
        """A small record outside the current window that no planned record would join (an
        export; without a plan, a reader of one small file, it is simply read now)."""
        if not self.plan:
            return False
        i = offset - self.start
        if (node, seg) == self.key and 0 <= i and i + length <= len(self.data):
            return False
        return self._extent((node, seg), offset, offset + length) == offset + length

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def read_range(self, node: str, seg: int, offset: int, length: int) -> bytes:
        if length > SMALL_RECORD:
            return self.src.read_range(node, seg, offset, length)
        i = offset - self.start
        if (node, seg) != self.key or i < 0 or i + length > len(self.data):
            self.key = None  # a failed read leaves no window behind
            end = self._extent((node, seg), offset, offset + length)
            self.data = self.src.read_range(node, seg, offset, end - offset)
            self.key, self.start, i = (node, seg), offset, 0
        return self.data[i:i + length]


def object_order(e: manifest.Entry) -> tuple[str, int]:
    """Where a file's data starts in the objects (files without data first)."""
    if e.type != "f" or not e.extents:
        return "", 0
    _off, _length, obj, pos, _skip, _rec_len = next(iter(e.extents))
    return obj, pos


def read_file(reader: Window, e: manifest.Entry) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) pieces of a file's data, each verified against its record checksum;
    the reads of the next records are under way while one is checked."""
    pending: deque[tuple[list, Callable[[], bytes]]] = deque()
    extents = iter(e.extents)
    big = 0  # records over SMALL_RECORD in `pending`: READS_IN_FLIGHT at most (memory)
    while True:
        while big < READS_IN_FLIGHT and len(pending) < 2 * READS_IN_FLIGHT \
                and (x := next(extents, None)) is not None:
            node, seg = manifest.split_obj(x[2])
            pending.append((x, reader.begin(node, seg, x[3], fmt.RECORD_HEADER_SIZE + x[5])))
            big += fmt.RECORD_HEADER_SIZE + x[5] > SMALL_RECORD
        if not pending:
            return
        (off, length, obj, pos, skip, rec_len), get = pending.popleft()
        big -= fmt.RECORD_HEADER_SIZE + rec_len > SMALL_RECORD
        try:
            whole = get()
        except (OSError, SharedError) as err:
            raise ExportError(f"{e.path}: cannot read object {obj}: {err}") from None
        hdr = fmt.decode_header(whole) if len(whole) >= fmt.RECORD_HEADER_SIZE else None
        if hdr is None or hdr[0] not in fmt.DATA_TYPES or hdr[1] != rec_len \
                or not fmt.verify_record(whole):
            raise ExportError(f"{e.path}: checksum mismatch in object {obj} at offset {pos}")
        start = fmt.RECORD_HEADER_SIZE + skip
        yield off, whole[start:start + length]


def _safe_join(dest: str, rel: str) -> str:
    out = os.path.normpath(os.path.join(dest, rel))
    if out != dest and not out.startswith(dest + os.sep):
        raise ExportError(f"refusing to write outside {dest}: {rel!r}")
    return out


def _ensure_dir(dest: str, path: str) -> None:
    """mkdir -p of `path` inside `dest`, where the published tree wins: a file or a symlink
    standing where it has a directory (an earlier export, before the path changed kind) is
    replaced. A symlink is never followed, so nothing is written outside DEST through one."""
    rel = os.path.relpath(path, dest)
    cur = dest
    for comp in [] if rel == "." else rel.split(os.sep):
        cur = os.path.join(cur, comp)
        if os.path.islink(cur) or (os.path.lexists(cur) and not os.path.isdir(cur)):
            os.unlink(cur)
        if not os.path.isdir(cur):
            os.mkdir(cur)


def _temp_beside(parent: str) -> tuple[str, int]:
    """A new file in `parent` for one exported file: (path, descriptor). A short name of its
    own (the longest legal file name leaves no room to add to it), never one that exists:
    that may be a file of the export itself, or the user's."""
    for n in itertools.count():
        tmp = os.path.join(parent, f".ckptfs-export.{os.getpid()}.{n}")
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                                0o600)
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


TEMP_NAME = re.compile(r"\.ckptfs-export\.(\d+)\.\d+\Z")


def _remove_stale_temps(parent: str) -> None:
    """Remove the temporary files of exports into `parent` that were killed (SIGKILL, a
    reboot) before they could: those whose process is gone. A live export's stay."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        m = TEMP_NAME.match(name)
        if m is None or int(m[1]) == os.getpid():
            continue
        try:
            os.kill(int(m[1]), 0)
            continue  # alive (or some other process has its number now): leave it
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue
        try:
            os.unlink(os.path.join(parent, name))
        except OSError:
            pass


def export(store: SharedStore, prefix: str, dest: str,
           progress: Callable[[int, int], None] | None = None,
           warn: Callable[[str], None] | None = None,
           unmarked: Callable[[list[str]], None] | None = None) -> tuple[int, int]:
    """Write the files under `prefix` as plain files into dest; returns (files, bytes).

    `unmarked` is told the checkpoints (default --retain patterns) in or around `prefix`
    whose commit marker is not published: they may be incomplete."""
    view = merged_view(store)
    for err in view.errors:
        if warn is not None:
            warn(err)
    items = list(select(view, prefix))
    if not items:
        raise ExportError(f"nothing published under {prefix!r}")
    if unmarked is not None:
        from ckptfs.retention import DEFAULT_MARKERS, DEFAULT_RETAIN

        p = prefix.strip("/")
        cps = checkpoints(view, DEFAULT_RETAIN, DEFAULT_MARKERS, 0,
                          top_marker_targets(store, view, DEFAULT_RETAIN))
        names = [c.name for c in cps if not c.marker and (
            not p or c.name == p or c.name.startswith(p + "/") or p.startswith(c.name + "/"))]
        if names:
            unmarked(names)
    dest = os.path.realpath(dest)
    os.makedirs(dest, exist_ok=True)
    total = sum(e.size for _r, _n, e in items if e.type == "f")
    # directories and symlinks in path order, then the files in the order their data lies in
    # the objects, which lets a Window serve runs of small files from one read
    items.sort(key=lambda it: (it[2].type == "f", object_order(it[2])))
    reader = Window(view.resolver or store,
                    Window.plan_for(e for _r, _n, e in items if e.type == "f"))
    try:
        return _export(items, dest, reader, total, progress)
    finally:
        reader.close()


def _export(items: list[tuple[str, str, manifest.Entry]], dest: str, reader: Window, total: int,
            progress: Callable[[int, int], None] | None) -> tuple[int, int]:
    done = files = 0
    dirs: list[tuple[str, int]] = []  # their mtimes are set last: writing in them moves them
    swept: set[str] = set()  # directories cleared of killed exports' temporary files
    for rel, _node, e in items:
        if not rel:
            if e.type == "d":
                continue  # the prefix directory itself is DEST
            rel = os.path.basename(e.path)  # the prefix names a single file
        target = _safe_join(dest, rel)
        parent = os.path.dirname(target)
        _ensure_dir(dest, target if e.type == "d" else parent)
        # never follow a symlink placed inside DEST out of it (_ensure_dir replaced ours)
        if os.path.realpath(parent) != parent:
            raise ExportError(f"refusing to write through a symlink: {rel!r}")
        if e.type == "d":
            os.chmod(target, (e.mode & 0o777) | stat.S_IRWXU)
            dirs.append((target, e.mtime_ns))
            continue
        if os.path.lexists(target) and (os.path.islink(target) or not os.path.isfile(target)):
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)  # a directory where the published tree has a file
            else:
                os.unlink(target)
        if e.type == "l":
            os.symlink(e.target, target)
            os.utime(target, ns=(e.mtime_ns, e.mtime_ns), follow_symlinks=False)
            continue
        # written beside its name and renamed onto it once whole: a failed export (a damaged
        # record, a full disk) never leaves a partial file, nor truncates a good earlier copy
        if parent not in swept:
            swept.add(parent)
            _remove_stale_temps(parent)
        tmp, fd = _temp_beside(parent)
        try:
            try:
                for off, data in read_file(reader, e):
                    os.pwrite(fd, data, off)
                    done += len(data)
                    if progress is not None:
                        progress(done, total)
                os.ftruncate(fd, e.size)
                os.fchmod(fd, e.mode & 0o777)  # never setuid/setgid bits from another machine
            finally:
                os.close(fd)
            os.utime(tmp, ns=(e.mtime_ns, e.mtime_ns))
            os.rename(tmp, target)
        except BaseException as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if isinstance(exc, OSError) and not isinstance(exc, ExportError) \
                    and exc.filename is None:
                raise ExportError(f"{rel}: {os.strerror(exc.errno or 0)}") from None
            raise
        files += 1
    for target, mtime_ns in reversed(dirs):  # children before their parents
        os.utime(target, ns=(mtime_ns, mtime_ns), follow_symlinks=False)
    return files, done


def check_store(path: str) -> SharedStore:
    if not path.startswith("s3://"):
        answers(path)  # a hung NAS: one line after ANSWER_TIMEOUT, not a hang
    store = open_store(path)
    try:  # an endpoint that takes the connection and never answers: the same line
        bounded(store.verify, ANSWER_TIMEOUT if ANSWER_TIMEOUT > 0 else None)
    except TimeoutError:
        raise SharedError(f"{path} does not answer: no reply to a check of the store in "
                          f"{ANSWER_TIMEOUT:.0f} s (is the server or its network down? "
                          f"CKPTFS_SHARED_TIMEOUT sets how long to wait)") from None
    except OSError as e:
        raise SharedError(f"cannot read {path}: {e}") from None
    return store


@dataclass
class CheckpointSummary:
    name: str
    files: int
    bytes: int
    nodes: list[str]
    marker: bool
    complete: bool
    tiers: list[str]
    # nodes whose newest manifest says their `ckptfs wait` of it (or of a directory above it)
    # began: all they wrote under it before then is published (`wait --all-nodes`)
    waited: list[str] = field(default_factory=list)


def checkpoints(view: View, retain: tuple[str, ...], markers: tuple[str, ...],
                nodes_required: int = 0,
                named: set[str] | frozenset[str] = frozenset()) -> list[CheckpointSummary]:
    """Checkpoint directories of the merged view (retention.py's rule: at any of the first
    MAX_DEPTH levels, not inside another), with completeness.

    Complete = a commit marker is published (inside the directory, or a `latest` beside it
    naming it) and, with nodes_required=N, the files under it hold data of at least N nodes
    (the nodes whose objects their extents name; an empty file counts its owner)."""
    import fnmatch

    from ckptfs.retention import checkpoint_of

    out: dict[str, CheckpointSummary] = {}
    first: dict[str, int] = {}  # checkpoint -> the oldest mtime of a file or symlink in it
    newest: dict[tuple[str, str], int] = {}  # (checkpoint, node) -> that node's newest there
    for path, (node, e) in sorted(view.entries.items()):
        top = checkpoint_of(path, retain, e.type == "d")
        if top is None:
            continue
        c = out.setdefault(top, CheckpointSummary(top, 0, 0, [], False, False, []))
        if e.type != "d":  # a directory's mtime moves with what any node creates in it
            first[top] = min(first.get(top, e.mtime_ns), e.mtime_ns)
            newest[top, node] = max(newest.get((top, node), e.mtime_ns), e.mtime_ns)
        if e.type == "f":
            c.files += 1
            c.bytes += e.size
            for x in e.extents:
                t = view.resolver.tiers.get(x[2], "shared") if view.resolver else "shared"
                if t not in c.tiers:
                    c.tiers.append(t)
            # the nodes whose bytes it holds: a file another node renamed into place (HF's
            # tmp-checkpoint-N) is that node's entry now, but still the writer's data
            for w in {x[2].split("/", 1)[0] for x in e.extents} or (node,):
                if w not in c.nodes:
                    c.nodes.append(w)
            rest = path[len(top) + 1:]
            if path != top and "/" not in rest and \
                    any(fnmatch.fnmatchcase(rest, g) for g in markers):
                c.marker = True  # a direct child, as the mount's retention counts it
    for name in named:
        if name in out:
            out[name].marker = True
    # a node's wait of the checkpoint or of a directory above it counts if it began once the
    # checkpoint had files (an older wait of a directory above it covers none of them) and
    # after the last change of the node's own files in it
    for node, m in sorted(view.manifests.items()):
        for c in out.values():
            lo = max(first.get(c.name, 0), newest.get((c.name, node), 0))
            if any((p == "" or c.name == p or c.name.startswith(p + "/")) and t >= lo
                   for p, t in m.waited):
                c.waited.append(node)
    for c in out.values():
        c.complete = c.marker and len(c.nodes) >= max(1, nodes_required)
    return sorted(out.values(), key=lambda c: _natural(c.name))


def top_marker_targets(store: SharedStore, view: View,
                       retain: tuple[str, ...] = ()) -> set[str]:
    """Checkpoint paths that marker files beside them (DeepSpeed's `latest`) point at: those
    at the top, and those in the directories above MAX_DEPTH outside any checkpoint."""
    from ckptfs.retention import MAX_DEPTH, TOP_MARKERS, checkpoint_of, named_by

    out: set[str] = set()
    for path, (_node, e) in view.entries.items():
        parent, _, name = path.rpartition("/")
        if name not in TOP_MARKERS or e.type != "f" or e.size > 4096 \
                or path.count("/") >= MAX_DEPTH or checkpoint_of(path, retain, False):
            continue
        try:
            data = b"".join(d for _o, d in read_file(Window(view.resolver or store), e))
        except (OSError, ExportError):
            continue
        target = named_by(data.decode(errors="replace"))
        out.add(f"{parent}/{target}" if parent else target)
    return out


def _natural(name: str) -> tuple:
    import re

    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))
