"""Other nodes' published files in this mount: read manifests, import what changed.

Every node publishes its namespace as manifests on SHARED. A refresh reads the newest
manifest of each node (one listdir per node and one read per new manifest: no per-file NAS
traffic) and makes this node's namespace agree with it through ordinary log records: CREATE
for new paths and IMPORT records that point a file at ranges of published objects. Imports
are therefore crash-safe and replayed like everything else.

Conflict rule (one path published by several nodes, or written here and elsewhere): whole
files only, never mixed bytes; the version with the newest mtime wins, ties broken by the
larger node id. A file open here is never replaced under its reader/writer; it is looked at
again on the next refresh. A file imported from node X that X no longer publishes is removed.

Refreshes run at mount, every `interval` seconds, and on `ckptfs status --refresh`. A lookup
miss does not trigger one: a create storm is a storm of lookup misses, and turning each into
NAS round trips is what ckptfs exists to avoid.

A refresh while mounted serves other requests between its imports: one manifest of a
100,000-file checkpoint takes seconds to import, and the mount must not stall meanwhile (a
training job on this node may be writing its own checkpoint). The files of a manifest
appear one after the other then; its commit markers (the retention's `markers`, such as
`.metadata`) are imported last, so a checkpoint whose marker is here has all its files.
"""

from __future__ import annotations

import fnmatch
import itertools
import json
import logging
import os
import stat
import time
from typing import Any, Callable, Iterator

import trio

from ckptfs import manifest
from ckptfs.errors import FsError
from ckptfs.index import ROOT_INO, Inode
from ckptfs.namespace import Namespace
from ckptfs.segment import SET_MTIME, RecType, setattr_body
from ckptfs.shared import SharedStore

log = logging.getLogger(__name__)


def newest_manifests(store: SharedStore, seen: dict[str, int],
                     errors: list[str] | None = None, unchanged: set[str] | None = None,
                     entries: bool = True, skip: str | None = None
                     ) -> Iterator[tuple[str, int, manifest.Manifest]]:
    """(node, seq, manifest): the newest valid manifest of each node whose newest differs from
    `seen`, one at a time (blocking), so a caller that keeps only a summary of each holds one
    parsed manifest at a time. Nodes whose newest valid one is the one in `seen` are added to
    `unchanged`. `entries=False`: their objects tables only (manifest.parse). Node `skip`
    (a daemon's own, which it wrote itself) is not read at all."""
    for node in store.nodes():
        if node == skip:
            continue
        seqs = store.list_manifests(node)
        for seq in reversed(seqs):  # newest first; fall back past a corrupt one
            if seen.get(node) == seq:
                if unchanged is not None:
                    unchanged.add(node)
                break
            try:
                m = manifest.parse(store.get_manifest(node, seq),
                                   f"{node}/{seq:016x}.manifest", entries)
                if m.node != node:
                    raise manifest.ManifestError(f"{node}/{seq:016x}.manifest: claims to be "
                                                 f"from node {m.node!r}")
            except (OSError, manifest.ManifestError) as e:
                msg = str(e)
                if errors is not None:
                    errors.append(msg)  # the caller reports it
                else:
                    log.error("ignoring manifest: %s", msg)
                continue
            yield node, seq, m
            break


def fetch_manifests(store: SharedStore, seen: dict[str, int],
                    errors: list[str] | None = None, skip: str | None = None
                    ) -> dict[str, manifest.Manifest]:
    """Newest valid manifest of each node whose newest differs from `seen` (blocking)."""
    return {node: m for node, _seq, m in newest_manifests(store, seen, errors, skip=skip)}


def winner(a: tuple[int, str], b: tuple[int, str]) -> bool:
    """True if version a = (mtime_ns, node) beats b under the conflict rule."""
    return a > b


YIELD_AFTER = 0.005  # a refresh gives other requests a turn after this many seconds of work
MOUNT_COMMIT_STEPS = 20_000  # the import at mount commits the index every so many steps
#                              (a step is about one file)


def marker_test(patterns: tuple[str, ...]) -> Callable[[str], bool]:
    """Whether a path's last component is a commit marker (glob patterns, as retention's)."""
    def is_marker(path: str) -> bool:
        name = path.rsplit("/", 1)[-1]
        return any(fnmatch.fnmatchcase(name, g) for g in patterns)

    return is_marker


class Refresher:
    def __init__(self, ns: Namespace, store: SharedStore, node: str, fresh_nvme: bool,
                 interval: float = 5.0, markers: tuple[str, ...] = ()):
        self.ns = ns
        self.is_marker = marker_test(markers)
        self._lock = trio.Lock()  # one refresh at a time (the timer's, a status --refresh)
        self.store = store
        self.node = node
        self.fresh_nvme = fresh_nvme  # a new NVME directory for a node that published before
        self.interval = interval
        self.seen: dict[str, int] = {}
        self.imported = 0
        self.removed = 0
        self.errors: list[str] = []
        self.invalidate: list[int] = []  # inodes whose content or target changed
        self.gone: list[tuple[int, bytes, int]] = []  # (parent, name, inode) removed
        self.deferred = False
        self._dir_mtime: dict[str, int] = {}
        # the directories each other node's last imported manifest has (or needs for its
        # entries): a directory made here for one node stays while any of them lists it
        self.listed: dict[str, set[str]] = {}
        # the tombstones in each other node's last manifest: (path, owner) -> (mtime_ns,
        # size, is a directory): the owner's version of path that node deleted
        self.tombs: dict[str, dict[tuple[str, str], tuple[int, int, bool]]] = {}

    async def run(self) -> None:
        while True:
            await trio.sleep(self.interval)
            try:
                await self.refresh()
            except Exception:  # a refresh must never take the mount down
                log.exception("refresh from the shared store failed")

    async def refresh(self) -> int:
        async with self._lock:
            return await self._refresh()

    async def _refresh(self) -> int:
        errors: list[str] = []
        try:
            # not our own: this node wrote it, and parsing it (once per checkpoint) would
            # cost the whole namespace's worth of memory for nothing (~65 MiB at 200,000 files)
            found = await trio.to_thread.run_sync(fetch_manifests, self.store, dict(self.seen),
                                                  errors, self.node)
        except OSError as e:
            log.warning("cannot read manifests from the shared store: %s", e)
            return 0
        for msg in errors:
            if msg not in self.errors:
                log.error("ignoring manifest: %s", msg)
        self.errors = errors[-10:]
        n = 0
        turn = time.monotonic()
        for n in self._apply_all(found):
            if time.monotonic() - turn >= YIELD_AFTER:
                await trio.sleep(0)  # serve the requests that queued up meanwhile
                turn = time.monotonic()
        import pyfuse3

        for ino in self.invalidate:
            try:
                await trio.to_thread.run_sync(pyfuse3.invalidate_inode, ino, False)
            except Exception:
                pass
        for parent, name, ino in self.gone:
            # the kernel would otherwise still show the name for up to ENTRY_TIMEOUT
            pyfuse3.invalidate_entry_async(parent, name, deleted=ino, ignore_enoent=True)
        self.invalidate.clear()
        self.gone.clear()
        return n

    def import_at_mount(self, found: dict[str, manifest.Manifest]) -> int:
        """Import other nodes' manifests, all at once (at mount, before serving). Our own is
        imported only at the first mount of a new NVME directory (the node lost its disk,
        or moved): its published namespace must not vanish. An NVME directory with a log
        never imports its own manifest: its log is newer than anything it published."""
        n = 0
        for i, n in enumerate(self._apply_all(found, at_mount=True)):
            if i % MOUNT_COMMIT_STEPS == MOUNT_COMMIT_STEPS - 1:
                # an LMDB write transaction holds every page it dirtied until it commits:
                # commit (the log first, write-ahead) every so many files of a big import
                self.ns.log.sync_now()
                self.ns.index.commit()
        self.invalidate.clear()  # the kernel knows nothing yet
        self.gone.clear()
        return n

    def _apply_all(self, found: dict[str, manifest.Manifest],
                   at_mount: bool = False) -> Iterator[int]:
        """Import manifests one entry at a time: yields the changes so far after each (and
        once at the end), so that a caller may serve requests in between."""
        n = 0
        for node, m in found.items():  # all of them first: no import of a deleted version
            if node != self.node:
                self.tombs[node] = {(p, x): (mt, sz, d) for p, x, mt, sz, d in m.gone}
        for node, m in sorted(found.items()):
            if m.cold and node not in self.ns.reader.cold_by_node:
                from ckptfs.shared import open_store

                try:  # where that node's cold objects are, for reads of its files
                    self.ns.reader.cold_by_node[node] = open_store(m.cold)
                except Exception as e:  # noqa: BLE001 - untrusted input; reads will say EIO
                    log.warning("node %s names a cold tier %s we cannot open: %s", node,
                                m.cold, e)
            if node == self.node:
                if at_mount and self.fresh_nvme:
                    log.info("new NVME directory for node %s: importing its published "
                             "namespace (manifest %016x)", node, m.seq)
                    for changed in self._apply(node, m):
                        yield n + changed
                    n += changed
                    self.ns.record_gone([  # its tombstones still to be done
                        {"path": path, "node": owner, "mtime_ns": mtime_ns, "size": size,
                         "dir": int(is_dir)} for path, owner, mtime_ns, size, is_dir in m.gone])
                self.seen[node] = m.seq
                continue
            self.deferred = False
            for changed in self._apply(node, m):
                yield n + changed
            n += changed
            if not self.deferred:  # a file skipped because it was open: look again next time
                self.seen[node] = m.seq
        yield n

    # --- applying one node's manifest ----------------------------------------------------

    def _apply(self, node: str, m: manifest.Manifest) -> Iterator[int]:
        """Import one manifest, one entry at a time (yields the changes so far), commit
        markers last."""
        changed = 0
        present: set[str] = set()
        self._dir_mtime = {e.path: e.mtime_ns for e in m.entries if e.type == "d"}
        ordered: list[manifest.Entry] = []
        markers: list[manifest.Entry] = []
        for e in m.entries:
            (markers if e.type == "f" and self.is_marker(e.path) else ordered).append(e)
        dirs = set(self._dir_mtime)  # the directories it lists or needs (self.listed)
        before = {path: d[1].mtime_ns for path in self._dir_mtime
                  if (d := self._dir_here(path)) is not None}
        for e in ordered + markers:
            present.add(e.path)
            cut = e.path.rfind("/")
            while cut > 0 and e.path[:cut] not in dirs:
                dirs.add(e.path[:cut])
                cut = e.path.rfind("/", 0, cut)
            try:
                changed += self._apply_entry(node, e)
            except FsError as err:
                log.warning("cannot import %s from node %s: %s", e.path, node, err)
            yield changed
        if node != self.node:
            self.listed[node] = dirs
            for removed in self._remove_vanished(node, present):
                yield changed + removed
            changed += removed
            changed += self._apply_tombstones(node)
            self._drop_tombstones(node, m)
            yield changed
        self._restore_dir_mtimes(before)
        if changed:
            log.info("imported %d changes from node %s (manifest %016x)", changed, node, m.seq)
        self.imported += changed
        yield changed

    def _dir_here(self, path: str) -> tuple[int, Inode] | None:
        """(inode number, inode) of the directory at path here, if there is one."""
        where = self._lookup_parent(path)
        ino = self.ns.index.lookup(*where) if where is not None else None
        node = self.ns.index.get_inode(ino) if ino is not None else None
        return (ino, node) if ino is not None and node is not None and node.is_dir else None

    def _restore_dir_mtimes(self, before: dict[str, int]) -> None:
        """A directory's mtime is the newer of the manifest's and this node's own, as it
        was before the import added or removed entries in it (each of which moves it to
        now): `ls -t` on a reader orders checkpoint directories as on their writer."""
        for path, remote in self._dir_mtime.items():
            if (d := self._dir_here(path)) is None:
                continue
            ino, node = d
            want = max(remote, before.get(path, remote))
            if node.mtime_ns != want:
                self.ns.record(RecType.SETATTR, ino, 0, setattr_body(SET_MTIME, mtime_ns=want))
                self.invalidate.append(ino)

    def _parent(self, path: str, node_id: str = "", mtime_ns: int = 0) -> tuple[int, bytes]:
        """(parent inode, name) for path, creating missing directories.

        A file standing where the path needs a directory gives way when the remote version
        wins under the conflict rule (and is not open): the same outcome as the merged view
        of `ls` and `export`, which drops everything below a path whose winner is a file."""
        parts = [os.fsencode(p) for p in path.split("/")]
        parent = ROOT_INO
        for i, comp in enumerate(parts[:-1]):
            child = self.ns.index.lookup(parent, comp)
            if child is not None:
                node = self.ns.index.get_inode(child)
                if node is not None and not node.is_dir:
                    origin = self.ns.index.origin(child)
                    mine = (node.mtime_ns, origin["node"] if origin else self.node)
                    if node_id and winner((mtime_ns, node_id), mine) \
                            and not self.ns.opens.get(child):
                        self.ns.unlink(parent, comp, want_dir=False, propagate=False)
                        child = None
                    else:
                        raise FsError(20, f"{path}: a parent is a newer file here")
            if child is None:
                parent = self.ns.make_node(parent, comp, stat.S_IFDIR | 0o755, 0, 0).ino
                if node_id:
                    self._mark(parent, node_id, mtime_ns,
                               "/".join(os.fsdecode(p) for p in parts[:i + 1]))
                continue
            parent = child
        return parent, parts[-1]

    def listed_by(self, path: str) -> list[str]:
        """The other nodes whose last manifest lists directory `path` (or needs it)."""
        return [node for node, dirs in self.listed.items() if path in dirs]

    def _deleted(self, owner: str, e: manifest.Entry) -> bool:
        """Did another node (or this one) delete `owner`'s version of entry e?"""
        mine = self.ns.index.gone_get(e.path, owner)
        if mine is not None and manifest.deleted_version(e, *mine):
            return True
        return any((t := tombs.get((e.path, owner))) is not None
                   and manifest.deleted_version(e, *t)
                   for y, tombs in self.tombs.items() if y != owner and tombs)

    def _apply_tombstones(self, node: str) -> int:
        """Remove the versions `node`'s manifest says it deleted: this node's own (then it
        publishes them no more) and copies of a third node's. Directories after the rest,
        once empty; and a directory emptied by these removals, once no node lists it (HF's
        tmp-checkpoint-N, renamed by one node, made by each)."""
        idx = self.ns.index
        n = 0
        emptied: set[str] = set()
        items = sorted(self.tombs.get(node, {}).items(),
                       key=lambda kv: (kv[1][2], -kv[0][0].count("/")))
        for (path, owner), (mtime_ns, size, is_dir) in items:
            where = self._lookup_parent(path)
            cur = idx.lookup(*where) if where is not None else None
            if cur is None:
                continue
            ino = idx.get_inode(cur)
            origin = idx.origin(cur)
            if ino is None or ino.is_dir != is_dir:
                continue
            mine = origin is None or origin.get("node") == self.node
            if is_dir:  # a directory path removed there that this node lists: once empty
                if owner != self.node or not idx.dir_is_empty(cur):
                    continue
            elif owner != (self.node if mine else origin.get("node")):
                continue
            elif ino.mtime_ns != mtime_ns or (stat.S_ISREG(ino.mode) and ino.size != size) \
                    or (not mine and origin.get("mtime_ns") != mtime_ns):
                continue  # another version than the one deleted there
            if self.ns.opens.get(cur):
                self.deferred = True
                continue
            if not self._remove(where, cur, is_dir):
                continue
            n += 1
            if "/" in path:
                emptied.add(path.rsplit("/", 1)[0])
        for d in sorted(emptied, key=lambda p: -p.count("/")):
            while d and not any(d in ds for y, ds in self.listed.items()):
                where = self._lookup_parent(d)
                cur = idx.lookup(*where) if where is not None else None
                if cur is None or not idx.dir_is_empty(cur) or not self._remove(where, cur, True):
                    break
                n += 1
                d = d.rsplit("/", 1)[0] if "/" in d else ""
        return n

    def _remove(self, where: tuple[int, bytes], ino: int, is_dir: bool) -> bool:
        """A refresh's removal: no tombstone (its node removed it first), and the kernel
        forgets the name at once (after the refresh)."""
        try:
            self.ns.unlink(*where, want_dir=is_dir, propagate=False)
        except FsError:
            return False
        self.removed += 1
        self.gone.append((*where, ino))
        return True

    def _drop_tombstones(self, node: str, m: manifest.Manifest) -> None:
        """This node's tombstones for `node` that its manifest no longer needs: it does not
        list that version any more (it removed it, or has another)."""
        mine = [g for g in self.ns.index.iter_gone() if g[1] == node]
        if not mine:
            return
        listed = {e.path: e for e in m.entries}
        self.ns.record_gone([{"path": path, "node": owner, "drop": 1}
                             for path, owner, mtime_ns, size, is_dir in mine
                             if (e := listed.get(path)) is None
                             or not manifest.deleted_version(e, mtime_ns, size, is_dir)])

    def _apply_entry(self, node: str, e: manifest.Entry) -> int:
        if self._deleted(node, e):
            # deleted here or elsewhere: not brought back (_apply_tombstones). Our own
            # entries too (a new NVME directory importing the node's last manifest): another
            # node may have deleted them while this one was down
            return 0
        parent, name = self._parent(e.path, node, self._dir_mtime.get(e.path.rsplit("/", 1)[0],
                                                                      e.mtime_ns))
        idx = self.ns.index
        cur = idx.lookup(parent, name)
        if e.type == "d":
            if cur is None:
                ino = self.ns.make_node(parent, name, stat.S_IFDIR | e.mode, e.uid, e.gid).ino
                self._mark(ino, node, e.mtime_ns, e.path)
                return 1
            return 0
        if e.type == "l":
            return self._apply_symlink(node, e, parent, name, cur)
        if cur is None:
            ino = self.ns.make_node(parent, name, stat.S_IFREG | e.mode, e.uid, e.gid).ino
            self._import(ino, node, e)
            return 1
        local = idx.get_inode(cur)
        if local is None or not stat.S_ISREG(local.mode):
            return 0
        origin = idx.origin(cur)
        if origin is not None and origin.get("node") == node:
            # the same version, unless its bytes moved (compaction, defragmentation: same
            # mtime and size, other objects; the old ones get deleted)
            if origin.get("mtime_ns") == e.mtime_ns and origin.get("size") == e.size \
                    and origin.get("ext") == idx.extents_digest(e.extents):
                return 0
        else:
            mine = (local.mtime_ns, origin["node"] if origin else self.node)
            if not winner((e.mtime_ns, node), mine):
                return 0
        if self.ns.opens.get(cur):
            self.deferred = True
            return 0  # never swap a file under an open handle; next refresh looks again
        if local.nlink > 1:  # a hard link here: the newer version replaces this name only
            self.ns.unlink(parent, name, want_dir=False, propagate=False)
            ino = self.ns.make_node(parent, name, stat.S_IFREG | e.mode, e.uid, e.gid).ino
            self._import(ino, node, e)
            return 1
        self._import(cur, node, e)
        self.invalidate.append(cur)
        return 1

    def _apply_symlink(self, node: str, e: manifest.Entry, parent: int, name: bytes,
                       cur: int | None) -> int:
        """A symlink follows its node's manifests, as a file does (a `last` link moved to
        each new checkpoint), and the conflict rule decides against another version here.
        A new target replaces the old one in place (the same inode)."""
        idx = self.ns.index
        if cur is None:
            ino = self.ns.make_node(parent, name, stat.S_IFLNK | 0o777, e.uid, e.gid,
                                    target=os.fsencode(e.target)).ino
            self._mark(ino, node, e.mtime_ns, e.path)
            return 1
        local = idx.get_inode(cur)
        if local is None or not stat.S_ISLNK(local.mode):
            return 0  # a directory or file here is never replaced by a remote symlink
        origin = idx.origin(cur)
        if origin is not None and origin.get("node") == node:
            if origin.get("mtime_ns") == e.mtime_ns and local.target == os.fsencode(e.target):
                return 0
        elif not winner((e.mtime_ns, node), (local.mtime_ns,
                                              origin["node"] if origin else self.node)):
            return 0
        self._mark(cur, node, e.mtime_ns, e.path, e.target)
        self.invalidate.append(cur)
        return 1

    def _mark(self, ino: int, node: str, mtime_ns: int, path: str,
              target: str | None = None) -> None:
        """IMPORT for a directory or symlink made (or updated) for `node`: it follows that
        node's manifests from now on (index.py: _apply_import)."""
        body: dict[str, Any] = {"origin": node, "size": 0, "mtime_ns": mtime_ns,
                                "extents": [], "path": path}
        if target is not None:
            body["target"] = target
        self.ns.record(RecType.IMPORT, ino, 0, json.dumps(body, separators=(",", ":")).encode())

    def _import(self, ino: int, node: str, e: manifest.Entry) -> None:
        body = {"origin": node, "size": e.size, "mtime_ns": e.mtime_ns,
                "extents": [list(x) for x in e.extents], "path": e.path}
        self.ns.record(RecType.IMPORT, ino, 0, json.dumps(body, separators=(",", ":")).encode())

    def _remove_vanished(self, node: str, present: set[str]) -> Iterator[int]:
        """Remove what was imported from `node` that its manifest no longer has: files and
        symlinks, then directories that are empty by then. Yields the count so far between
        batches of the walk, after each entry it looks at again, and at the end."""
        n = 0
        vanished: list[tuple[str, int, bool]] = []
        dirs: list[tuple[str, int, bool]] = []
        for found in self._walk():
            if found is None:
                yield n  # between two batches of a directory's entries
            elif found[0] not in present:
                (dirs if found[2] else vanished).append(found)
        # directories after the files and symlinks, the deepest first: each after what was in it
        dirs.sort(key=lambda v: -v[0].count("/"))
        for path, ino_nr, is_dir in vanished + dirs:
            yield n
            origin = self.ns.index.origin(ino_nr)
            if origin is None or origin.get("node") == self.node:
                continue  # this node's own
            if is_dir:
                # made for `node`, or for a node that dropped it before it was empty here
                if any(path in d for d in self.listed.values()):
                    continue
            elif origin.get("node") != node:
                continue
            if self.ns.opens.get(ino_nr):
                self.deferred = True  # removed once closed: look again next refresh
                continue
            where = self._lookup_parent(path)
            if where is None or self.ns.index.lookup(*where) != ino_nr:
                continue  # renamed, replaced or removed here meanwhile
            if is_dir and not self.ns.index.dir_is_empty(ino_nr):
                continue  # something else is in it: it stays
            if self._remove(where, ino_nr, is_dir):
                n += 1
        yield n

    def _walk(self, batch: int = 1000) -> Iterator[tuple[str, int, bool] | None]:
        """(path, inode number, is a directory) of everything, and None between batches of
        directory entries, where the caller may let other requests run: a commit of the
        index then closes LMDB cursors, so none is open across a None (each batch is read
        whole and the next one resumes after its last cookie)."""
        idx = self.ns.index
        stack: list[tuple[int, str]] = [(ROOT_INO, "")]
        while stack:
            dino, prefix = stack.pop()
            after = 0
            while True:
                entries = idx.readdir(dino, after)
                try:
                    chunk = list(itertools.islice(entries, batch))
                finally:
                    entries.close()  # its cursor
                for cookie, name, child in chunk:
                    after = cookie
                    node = idx.get_inode(child)
                    if node is None:
                        continue
                    path = prefix + os.fsdecode(name)
                    if node.is_dir:
                        stack.append((child, path + "/"))
                    yield path, child, node.is_dir
                yield None
                if len(chunk) < batch:
                    break

    def _lookup_parent(self, path: str) -> tuple[int, bytes] | None:
        """(parent inode, name) of an existing path, or None."""
        parts = [os.fsencode(p) for p in path.split("/")]
        parent: int | None = ROOT_INO
        for comp in parts[:-1]:
            parent = self.ns.index.lookup(parent, comp)
            if parent is None:
                return None
        return parent, parts[-1]

    def status(self) -> dict[str, Any]:
        # our own manifest is read at mount only, so its sequence here would be stale
        seen = {node: seq for node, seq in self.seen.items() if node != self.node}
        return {"nodes_seen": seen, "imported": self.imported,
                "removed": self.removed, "manifest_errors": self.errors}
