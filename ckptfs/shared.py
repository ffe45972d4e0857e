"""The shared store: layout, atomic publish of objects and manifests, reading them back.

Layout under SHARED/ckptfs/ (docs/format.md has the byte formats):

    FORMAT                                   {"format": "ckptfs-shared", "version": 1}
    objects/<node>/<segment id:016x>.seg     a sealed segment, byte for byte (immutable)
    objects/<node>/b<first:016x>-<last:016x>/<segment id:016x>.seg
                                             segments published together (a *batch*): the
                                             directory is written under a temporary name and
                                             renamed into place, so k segments cost k + 2
                                             namespace operations instead of 2k
    manifests/<node>/<pub seq:016x>.manifest  the node's published namespace (immutable)
    .tmp files                               in-flight publishes; removed on the owner's mount

Everything on SHARED is written once under a temporary name (a file, or a batch's directory),
fsync'd, renamed into place and the parent directory fsync'd: a reader sees a whole object (or a
whole batch) or none. Every namespace operation ckptfs
issues here is counted (`ops`), because those are what a NAS charges a round trip for.

Anything read from SHARED is untrusted: other machines wrote it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable, Iterator, TypeVar

from ckptfs import knobs, layout
from ckptfs import segment as fmt
from ckptfs.fdcache import FdCache

NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
OBJ_RE = re.compile(r"^([0-9a-f]{16})\.seg$")
MAN_RE = re.compile(r"^([0-9a-f]{16})\.manifest$")
BATCH_RE = re.compile(r"^b([0-9a-f]{16})-([0-9a-f]{16})$")
COPY_CHUNK = 16 << 20
PUBLISH_BATCH = 16  # default --publish-batch: segments per batch directory
# a shared store that has not answered for this long (s) while a command that cannot go on
# without it waits (the mount's first look at it, ls, export, fsck) is reported as an error
ANSWER_TIMEOUT = knobs.number("CKPTFS_SHARED_TIMEOUT", 30.0, "seconds")
READ_CHUNK = 1 << 20  # manifests are read this much at a time (each chunk is an answer)


class SharedError(Exception):
    """The shared store failed or holds something invalid; the message is one line."""


def check_node_id(node: str) -> str:
    if not NODE_RE.match(node):
        raise SharedError(f"invalid node id {node!r} (letters, digits, . _ -; max 64)")
    return node


class Watch:
    """Calls into the shared store that are waiting for it, and when it last answered.

    A NAS that fails returns errors, and the drain reports them. A NAS that hangs (an NFS
    hard mount whose server is gone, a stuck parallel-filesystem client) returns nothing:
    the calls block, and a slow store and a dead one would look alike. `stalled()` tells
    them apart: how long the store has gone without answering anything (no call ended, no
    chunk of an upload went through) while at least one call waits. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[int, tuple[str, float]] = {}  # key -> (what, started)
        self._next = 0
        self._ours = 0  # waits of ckptfs's own inside calls (see ours())
        self.answered = time.monotonic()

    @contextlib.contextmanager
    def ours(self) -> Iterator[None]:
        """A wait of ckptfs's own inside a call (the upload rate limit, a pause while the
        application writes): the store owes nothing meanwhile, so it is no stall."""
        with self._lock:
            self._ours += 1
        try:
            yield
        finally:
            with self._lock:
                self._ours -= 1
                self.answered = time.monotonic()

    @contextlib.contextmanager
    def call(self, what: str) -> Iterator[None]:
        now = time.monotonic()
        with self._lock:
            key = self._next
            self._next += 1
            if not self._calls:
                self.answered = now  # idle until now: nothing was owed before this call
            self._calls[key] = (what, now)
        try:
            yield
        finally:
            with self._lock:
                del self._calls[key]
                self.answered = time.monotonic()

    def progress(self) -> None:
        """Part of a long call went through (a chunk of an upload or a read)."""
        self.answered = time.monotonic()

    def stalled(self) -> tuple[float, str]:
        """(seconds without an answer, what the oldest waiting call is), or (0.0, "") when
        no call waits."""
        with self._lock:
            if not self._calls or self._ours:
                return 0.0, ""
            what = min(self._calls.values(), key=lambda c: c[1])[0]
            return max(0.0, time.monotonic() - self.answered), what


F = TypeVar("F", bound=Callable[..., Any])


def watched(what: str) -> Callable[[F], F]:
    """Decorate a store method that calls into the store: its calls count in `self.watch`."""
    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            with self.watch.call(what):
                return fn(self, *args, **kwargs)
        return wrapper  # type: ignore[return-value]
    return deco


R = TypeVar("R")


def bounded(fn: Callable[[], R], timeout: float | None) -> R:
    """fn() on a thread of its own, given `timeout` seconds (None: as long as it takes);
    its result, or its exception raised here. TimeoutError if it has not returned: then it
    is left behind, blocked (a silent NAS blocks a call in the kernel, where nothing can
    interrupt it). It is a daemon thread, and the process exits without it (NFS and FUSE
    waits end on a fatal signal)."""
    box: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # raised on the caller's thread
            box.append((False, e))

    t = threading.Thread(target=run, name="ckptfs-bounded", daemon=True)
    t.start()
    t.join(timeout)
    if not box:
        raise TimeoutError(f"no answer in {timeout:.0f} s")
    ok, value = box[0]
    if not ok:
        raise value
    return value


def answers(path: str, timeout: float = ANSWER_TIMEOUT) -> None:
    """Whether the directory `path` answers a listing within `timeout` seconds (0: wait as
    long as it takes). Raises SharedError with one line if it is missing, not a directory,
    or silent."""
    try:
        bounded(lambda: os.listdir(path), timeout if timeout > 0 else None)
    except TimeoutError:
        raise SharedError(f"{path} does not answer: no reply to a directory listing in "
                          f"{timeout:.0f} s (is the NAS or its network down? "
                          f"CKPTFS_SHARED_TIMEOUT sets how long to wait)") from None
    except FileNotFoundError:
        raise SharedError(f"directory {path} does not exist") from None
    except NotADirectoryError:
        raise SharedError(f"{path} is not a directory") from None
    except OSError as e:
        raise SharedError(f"{path}: {describe_oserror(e)}") from None


class UploadStopped(OSError):
    """The daemon is stopping: an upload gives up between two chunks (what it wrote is a
    temp file or directory, removed at the next mount; the segment stays on NVMe)."""


class RateLimiter:
    """A token bucket in bytes/s shared by all upload streams (0 = unlimited), which also
    pauses uploads (`hold`) and stops them (`stop`) between two chunks."""

    def __init__(self, bytes_per_s: float):
        self.rate = bytes_per_s
        self.lock = threading.Lock()
        self.next_free = time.monotonic()
        self.hold = threading.Event()  # set: uploads pause between chunks (writers go first)
        self.stop = threading.Event()  # set: uploads give up (the daemon is exiting)

    def take(self, n: int) -> None:
        while self.hold.is_set() and not self.stop.wait(0.05):
            pass
        if self.rate > 0:
            with self.lock:
                now = time.monotonic()
                start = max(now, self.next_free)
                self.next_free = start + n / self.rate
                delay = start - now
            if delay > 0:
                self.stop.wait(delay)
        if self.stop.is_set():
            raise UploadStopped(errno.ECANCELED, "the daemon is stopping")


def exists_error(what: str, node: str) -> FileExistsError:
    """A published object or manifest is never replaced: the error for a name that exists."""
    return FileExistsError(errno.EEXIST, f"{what} already exists on SHARED: is another NVME "
                                         f"directory mounted as node {node}?")


class SharedStore:
    """A POSIX directory as the shared tier. Methods block: call them from worker threads."""

    def __init__(self, shared: str, streams: int = 2):
        self.base = shared
        self.root = os.path.join(shared, layout.SHARED_ROOT)
        self.ops: dict[str, int] = {}
        self._ops_lock = threading.Lock()
        # object copies running at once, whatever the batches: a batch's objects are copied
        # side by side (one stream per object is latency-bound on a network filesystem)
        self.streams = max(1, streams)
        self._copy_slots = threading.BoundedSemaphore(self.streams)
        self.bytes_uploaded = 0
        self.bytes_read = 0
        self._known_dirs: set[str] = set()
        self._read_fds = FdCache(256)  # objects being read (a restore reads them again and again)
        self._where: dict[tuple[str, int], str] = {}  # objects found inside a batch directory
        # node -> ids of its objects this process listed or published: a batch directory's
        # rename cannot see a name that exists in another one (one name, two contents)
        self._listed: dict[str, set[int]] = {}
        self._listed_lock = threading.Lock()
        self.watch = Watch()

    def _op(self, name: str, n: int = 1) -> None:
        with self._ops_lock:
            self.ops[name] = self.ops.get(name, 0) + n

    # --- paths ----------------------------------------------------------------------------

    def node_objects(self, node: str) -> str:
        return os.path.join(self.root, "objects", node)

    def object_path(self, node: str, seg: int) -> str:
        """Where node's object `seg` is: directly under objects/<node>/, or inside one of its
        batch directories (found by listing, then remembered). The direct path when it is in
        neither, so a missing object fails with ENOENT on the name a user would look for."""
        where = self._where.get((node, seg))
        if where is not None:
            return where
        name = fmt.segment_name(seg)
        single = os.path.join(self.node_objects(node), name)
        self._op("stat")
        if os.path.exists(single):
            return single
        for first, last, dname in reversed(self._batches(node)):
            if first <= seg <= last:
                p = os.path.join(self.node_objects(node), dname, name)
                self._op("stat")
                if os.path.exists(p):
                    self._where[(node, seg)] = p
                    return p
        return single

    def _batches(self, node: str) -> list[tuple[int, int, str]]:
        """(first, last, directory name) of node's published batches, by first id."""
        self._op("listdir")
        try:
            names = os.listdir(self.node_objects(node))
        except FileNotFoundError:
            return []
        return sorted((int(m.group(1), 16), int(m.group(2), 16), n)
                      for n in names if (m := BATCH_RE.match(n)))

    def manifest_dir(self, node: str) -> str:
        return os.path.join(self.root, "manifests", node)

    def _ensure_dir(self, d: str) -> None:
        if d in self._known_dirs:
            return
        if not os.path.isdir(d):
            for _ in range(layout.makedirs_durable(d)):  # objects/ and objects/NODE, say
                self._op("mkdir")
                self._op("fsync_dir")
        self._known_dirs.add(d)

    @watched("directories")
    def prepare(self, node: str) -> None:
        """Create node's directories now (at mount), not during its first checkpoint."""
        self._ensure_dir(self.node_objects(node))
        self._ensure_dir(self.manifest_dir(node))

    @watched("format file")
    def init(self) -> None:
        """Create ckptfs's layout (idempotent); SharedError with one line if that fails."""
        from ckptfs.errors import CliError

        try:
            layout.init_shared(self.base)
        except CliError as e:
            raise SharedError(str(e)) from None

    @watched("format file")
    def exists(self) -> bool:
        return os.path.isdir(self.root)

    @watched("format file")
    def verify(self) -> None:
        """For readers (ls, export, fsck): SHARED holds a ckptfs store."""
        if not os.path.isdir(self.base):
            why = "not a directory" if os.path.exists(self.base) else "no such directory"
            raise SharedError(f"{self.base}: {why}")
        if not self.exists():
            raise SharedError(f"{self.base} holds no ckptfs shared store (no {self.root})")
        fmt_path = os.path.join(self.root, layout.SHARED_FORMAT_FILE)
        try:
            with open(fmt_path) as f:
                found = json.load(f)
        except FileNotFoundError:
            raise SharedError(f"{fmt_path} is missing: a ckptfs shared store has one (a "
                              f"damaged or partly copied store?)") from None
        except (OSError, ValueError) as e:
            raise SharedError(f"{fmt_path}: unreadable ckptfs format file ({e})") from None
        if not isinstance(found, dict) or found.get("format") != layout.SHARED_FORMAT["format"] \
                or not isinstance(found.get("version", 0), int) or found.get("version", 0) > 1:
            raise SharedError(f"{fmt_path}: not a ckptfs shared store this version can read "
                              f"({found})")

    @watched("layout check")
    def check(self) -> None:
        """Before publishing: the store's layout must still be there. A NAS that is not
        mounted any more looks like an empty directory; publishing into that would put
        objects where no other node looks."""
        self._op("stat")
        if not os.path.exists(os.path.join(self.root, layout.SHARED_FORMAT_FILE)):
            raise FileNotFoundError(errno.ENOENT, f"shared store layout {self.root}/FORMAT is "
                                                  f"missing (is the shared filesystem mounted?)")

    # --- writing --------------------------------------------------------------------------

    def put_object(self, node: str, seg: int, src: str, limiter: RateLimiter | None = None,
                   progress: Callable[[int], None] | None = None) -> tuple[int, str]:
        """Publish local segment file `src` as node's object `seg`; returns (size, "")."""
        sizes = self.put_objects(node, [(seg, src)], limiter,
                                 None if progress is None else lambda _s, n: progress(n))
        return sizes[0], ""

    @watched("upload")
    def put_objects(self, node: str, items: list[tuple[int, str]],
                    limiter: RateLimiter | None = None,
                    progress: Callable[[int, int], None] | None = None) -> list[int]:
        """Publish local segment files as node's objects [(seg, src), ...], all at once: one
        object as a file (temp, fsync, rename, fsync the directory: 2 namespace operations),
        several as a batch directory (mkdir temp, one create per object, fsync each object and
        the directory, rename, fsync the parent: k + 2). Returns the sizes, in order."""
        try:
            if len(items) == 1:
                return [self._put_single(node, *items[0], limiter, progress)]
            return self._put_batch(node, items, limiter, progress)
        except OSError:
            self._known_dirs.clear()  # the store may have lost our directories: look again
            raise

    def _copy_into(self, seg: int, src: str, dest: str, limiter: RateLimiter | None,
                   progress: Callable[[int, int], None] | None) -> int:
        """Create `dest` (must not exist), copy `src` into it, fsync it; at most `streams`
        copies run at once."""
        with self._copy_slots:
            return self._copy_one(seg, src, dest, limiter, progress)

    def _copy_one(self, seg: int, src: str, dest: str, limiter: RateLimiter | None,
                  progress: Callable[[int, int], None] | None) -> int:
        size = 0
        with open(src, "rb", buffering=0) as inp:
            total = os.fstat(inp.fileno()).st_size
            self._op("create")
            out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o444)
            try:
                # the kernel copies (sendfile): no trip through Python for the bytes; every
                # record in them is checksummed already and verified by whoever reads it
                while size < total:
                    want = min(COPY_CHUNK, total - size)
                    if limiter is not None:
                        with self.watch.ours():
                            limiter.take(want)
                    n = os.sendfile(out, inp.fileno(), size, want)
                    if n == 0:
                        raise OSError(5, f"{src} ended at {size} of {total} bytes")
                    size += n
                    with self._ops_lock:
                        self.bytes_uploaded += n
                    self.watch.progress()
                    if progress is not None:
                        progress(seg, n)
                self._op("fsync")
                os.fsync(out)  # the bytes must be on the store before the name is
            finally:
                os.close(out)
        return size

    def _check_new(self, node: str, segs: list[int]) -> None:
        """EEXIST if one of these objects was listed or published before (by this process):
        a batch directory's rename succeeds whatever other batches hold."""
        with self._listed_lock:
            known = self._listed.get(node, set())
            taken = [seg for seg in segs if seg in known]
        if taken:
            raise exists_error(f"object {node}/{fmt.segment_name(taken[0])}", node)

    def _note_published(self, node: str, segs: list[int]) -> None:
        with self._listed_lock:
            self._listed.setdefault(node, set()).update(segs)

    def _put_single(self, node: str, seg: int, src: str, limiter: RateLimiter | None,
                    progress: Callable[[int, int], None] | None) -> int:
        self._check_new(node, [seg])
        d = self.node_objects(node)
        self._ensure_dir(d)
        dest = os.path.join(d, fmt.segment_name(seg))
        tmp = os.path.join(d, f".tmp.{fmt.segment_name(seg)}.{os.getpid()}")
        try:
            size = self._copy_into(seg, src, tmp, limiter, progress)
        except BaseException:
            _remove(tmp)
            raise
        try:
            ops = layout.rename_noreplace(tmp, dest)  # a published object is never replaced
        except FileExistsError:
            _remove(tmp)
            raise exists_error(f"object {node}/{fmt.segment_name(seg)}", node) from None
        except BaseException:
            _remove(tmp)
            raise
        for op in ops:
            self._op(op)
        self._note_published(node, [seg])
        self._op("fsync_dir")
        layout.fsync_dir(d)  # ...and the name must be durable before we call it published
        return size

    def _put_batch(self, node: str, items: list[tuple[int, str]],
                   limiter: RateLimiter | None,
                   progress: Callable[[int, int], None] | None) -> list[int]:
        d = self.node_objects(node)
        self._ensure_dir(d)
        segs = [seg for seg, _src in items]
        self._check_new(node, segs)
        dname = f"b{min(segs):016x}-{max(segs):016x}"
        tmp = os.path.join(d, f".tmp.{dname}.{os.getpid()}")
        sizes = []
        try:
            _remove(tmp)  # a previous attempt of this process
            self._op("mkdir")
            os.mkdir(tmp, 0o755)
            sizes = self._copy_all(items, tmp, limiter, progress)
            self._op("fsync_dir")
            layout.fsync_dir(tmp)  # the objects' names inside it
        except BaseException:
            _remove(tmp)
            raise
        self._op("rename")
        try:
            os.rename(tmp, os.path.join(d, dname))  # fails (EEXIST/ENOTEMPTY), never replaces
        except BaseException:
            _remove(tmp)  # not left for the next mount to find: the retry copies again
            raise
        self._note_published(node, segs)
        self._op("fsync_dir")
        layout.fsync_dir(d)
        for seg in segs:
            self._where[(node, seg)] = os.path.join(d, dname, fmt.segment_name(seg))
        return sizes

    def _copy_all(self, items: list[tuple[int, str]], into: str, limiter: RateLimiter | None,
                  progress: Callable[[int, int], None] | None) -> list[int]:
        """Copy every segment of a batch into the directory `into`, up to `streams` side by
        side. Returns once every copy has ended (none still writes into `into`), raising the
        first error if any failed."""
        def one(item: tuple[int, str]) -> int:
            seg, src = item
            return self._copy_into(seg, src, os.path.join(into, fmt.segment_name(seg)),
                                   limiter, progress)

        if self.streams == 1 or len(items) == 1:
            return [one(item) for item in items]
        with ThreadPoolExecutor(min(self.streams, len(items)),
                                thread_name_prefix="ckptfs-copy") as pool:
            futures = [pool.submit(one, item) for item in items]
            wait(futures)
        return [f.result() for f in futures]

    @watched("object check")
    def object_ok(self, node: str, seg: int, size: int, head: bytes = b"") -> bool:
        """A published object of this size with a valid footer exists (crash after rename),
        and begins with `head` (the local segment's header: its node, id and creation time
        tell this segment from another NVME directory's of the same name). Its name is made
        durable before True is returned: the attempt that renamed it may have died before
        its directory fsync."""
        path = self.object_path(node, seg)
        try:
            self._op("stat")
            if os.path.getsize(path) != size:
                return False
            with open(path, "rb") as f:
                if head and f.read(len(head)) != head:
                    return False
                f.seek(size - fmt.FOOTER_SIZE)
                if fmt.parse_footer(f.read(fmt.FOOTER_SIZE)) is None:
                    return False
            d = os.path.dirname(path)
            while True:
                self._op("fsync_dir")
                layout.fsync_dir(d)
                if d == self.node_objects(node):
                    return True
                d = os.path.dirname(d)  # a batch directory: its rename is in the parent
        except OSError:
            return False

    @watched("manifest upload")
    def put_manifest(self, node: str, seq: int, data: bytes) -> str:
        d = self.manifest_dir(node)
        self._ensure_dir(d)
        dest = os.path.join(d, f"{seq:016x}.manifest")
        self._op("create")
        self._op("fsync")
        try:
            ops = layout.publish_bytes(dest, data, replace=False)
        except FileExistsError:
            raise exists_error(f"manifest {node}/{seq:016x}", node) from None
        except OSError:
            self._known_dirs.clear()
            raise
        for op in ops:
            self._op(op)
        self._op("fsync_dir")
        return dest

    @watched("object removal")
    def delete_object(self, node: str, seg: int) -> None:
        path = self.object_path(node, seg)
        # not held open: NFS would keep a deleted open file as .nfsXXXX, and its directory
        self._read_fds.drop((node, seg))
        self._op("unlink")
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self._where.pop((node, seg), None)
        with self._listed_lock:
            self._listed.get(node, set()).discard(seg)
        parent = os.path.dirname(path)
        if parent != self.node_objects(node):  # the last object of a batch takes its directory
            self._op("rmdir")
            try:
                os.rmdir(parent)
            except OSError:  # ENOTEMPTY: other objects of the batch are still live
                pass

    @watched("manifest removal")
    def prune_manifests(self, node: str, keep: int = 2) -> None:
        names = self.list_manifests(node)
        for seq in names[:-keep]:
            self._op("unlink")
            try:
                os.unlink(os.path.join(self.manifest_dir(node), f"{seq:016x}.manifest"))
            except FileNotFoundError:
                pass

    @watched("temp cleanup")
    def clean_temp(self, node: str) -> int:
        """Remove this node's half-written temporary files left by a crash."""
        n = 0
        for d in (self.node_objects(node), self.manifest_dir(node)):
            try:
                names = os.listdir(d)
            except FileNotFoundError:
                continue
            for name in names:
                if name.startswith(".tmp."):
                    _remove(os.path.join(d, name))  # a file, or a batch's directory
                    self._op("unlink")
                    n += 1
        return n

    # --- reading --------------------------------------------------------------------------

    @watched("listing")
    def nodes(self) -> list[str]:
        self._op("listdir")
        try:
            names = os.listdir(os.path.join(self.root, "manifests"))
        except FileNotFoundError:
            return []
        return sorted(n for n in names if NODE_RE.match(n))

    @watched("listing")
    def list_manifests(self, node: str) -> list[int]:
        self._op("listdir")
        try:
            names = os.listdir(self.manifest_dir(node))
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1), 16) for n in names if (m := MAN_RE.match(n)))

    @watched("listing")
    def _object_paths(self, node: str) -> dict[int, list[str]]:
        """Every path of each of node's objects: beside the batch directories and in them."""
        self._op("listdir")
        d = self.node_objects(node)
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            return {}
        out: dict[int, list[str]] = {}
        for n in names:
            if (m := OBJ_RE.match(n)):
                out.setdefault(int(m.group(1), 16), []).append(os.path.join(d, n))
            elif BATCH_RE.match(n):
                self._op("listdir")
                try:
                    inner = os.listdir(os.path.join(d, n))
                except (FileNotFoundError, NotADirectoryError):
                    continue
                for name in inner:
                    if (m := OBJ_RE.match(name)):
                        out.setdefault(int(m.group(1), 16), []).append(os.path.join(d, n, name))
        return out

    def list_objects(self, node: str) -> list[int]:
        """node's object ids, those in batch directories included."""
        paths = self._object_paths(node)
        top = self.node_objects(node)
        for seg, found in paths.items():
            batched = [p for p in found if os.path.dirname(p) != top]
            if batched:
                self._where[(node, seg)] = batched[-1]
        with self._listed_lock:
            self._listed[node] = set(paths)
        return sorted(paths)

    def duplicate_objects(self, node: str) -> dict[int, list[str]]:
        """node's object ids found in more than one place (beside the batch directories and
        in them, or in two batches), with their paths: an object name must have one content,
        and readers take whichever they list last."""
        return {seg: sorted(found) for seg, found in self._object_paths(node).items()
                if len(found) > 1}

    @watched("listing")
    def all_object_nodes(self) -> list[str]:
        try:
            names = os.listdir(os.path.join(self.root, "objects"))
        except FileNotFoundError:
            return []
        return sorted(n for n in names if NODE_RE.match(n))

    @watched("manifest read")
    def get_manifest(self, node: str, seq: int) -> bytes:
        self._op("open")
        with open(os.path.join(self.manifest_dir(node), f"{seq:016x}.manifest"), "rb",
                  buffering=0) as f:
            chunks = []
            while chunk := f.read(READ_CHUNK):  # a big manifest on a slow link is no stall
                chunks.append(chunk)
                self.watch.progress()
            return b"".join(chunks)

    @watched("object read")
    def read_range(self, node: str, seg: int, offset: int, length: int) -> bytes:
        def opener() -> int:
            path = self.object_path(node, seg)
            self._op("open")
            return os.open(path, os.O_RDONLY)

        with self._read_fds.borrow((node, seg), opener) as fd:
            assert fd is not None
            data = os.pread(fd, length, offset)
        with self._ops_lock:  # reads run on several threads
            self.bytes_read += len(data)
        return data

    @watched("object stat")
    def object_size(self, node: str, seg: int) -> int:
        try:
            return os.path.getsize(self.object_path(node, seg))
        except FileNotFoundError:
            raise SharedError(f"object {node}/{fmt.segment_name(seg)} is missing") from None

    def iter_object(self, node: str, seg: int) -> Iterator[bytes]:
        with open(self.object_path(node, seg), "rb", buffering=0) as f:
            while True:
                b = f.read(COPY_CHUNK)
                if not b:
                    return
                yield b

    def close(self) -> None:
        self._read_fds.close()


def _remove(path: str) -> None:
    """Remove a file or a directory tree; nothing if it is not there."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def open_store(location: str, streams: int = 4) -> "SharedStore":
    """The shared store at a directory path or an s3://bucket/prefix URL."""
    if location.startswith("s3://"):
        from ckptfs.s3 import S3Store

        return S3Store(location, streams=streams)  # type: ignore[return-value]
    return SharedStore(os.path.abspath(location), streams)


def describe_stall(seconds: float, what: str) -> str:
    """One phrase for Watch.stalled(), e.g. in a `wait` that timed out."""
    article = "an" if what[:1] in tuple("aeiou") else "a"
    return (f"the shared store has not answered for {seconds:.0f} s"
            + (f" ({article} {what} is waiting)" if what else ""))


def describe_oserror(e: OSError) -> str:
    name = errno.errorcode.get(e.errno or 0, "")
    where = f" {e.filename}" if e.filename else ""
    return f"{e.strerror or e}{where}" + (f" ({name})" if name else "")
