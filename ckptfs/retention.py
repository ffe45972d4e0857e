"""Checkpoint awareness: which directories are checkpoints, which are complete, and how many
to keep on each tier.

A checkpoint is a directory whose name matches a `--retain` glob (default `step_*`, `step-*`,
`checkpoint-*`, `global_step*`, `iter_*`), at most MAX_DEPTH levels below the mount's root and not
inside another checkpoint: `/ckpt/step_100`, and also `/ckpt/<run>/checkpoint-100` (HF's
output_dir one level down) or `/ckpt/<team>/<run>/global_step100`. The checkpoints of one
directory (a run) form a group: counts, order and protection apply within each group, so
one run's new checkpoints never push out another run's. It is *complete* once it holds a
commit marker (a file whose name matches a `--marker` glob: DCP's `.metadata`, HF's
`trainer_state.json`, Orbax's `commit_success.txt`), or once a marker file beside it
(DeepSpeed's `latest`) names it, or named it at an earlier pass of this mount.
Order is the order in which the checkpoints completed: the newest modification time of the
directory's commit markers (for a marker imported from another node, the one it has there:
the manifest's). A checkpoint without a marker of its own (incomplete, or completed by a
marker beside it) counts from its directory's change time. Ties go to the order in which
the directories got their names.

Why not simply that order: a checkpoint deleted here that another node's manifest still
lists (that node keeps more) is imported again under a new name entry, the newest here; it
would then count as the newest checkpoint, and retention would delete the real newest ones,
whose files may exist nowhere else. Modification times, not change times: a `chmod a-w` of an
old checkpoint must not make it the newest. So a checkpoint copied in with its old times
(`cp -a`) counts from them, and a `touch` of a marker moves its checkpoint. An incomplete
checkpoint whose directory changed in the last IN_PROGRESS seconds is never deleted: it may be
being written, and a marker time from a node whose clock runs ahead could otherwise rank it
below the cutoff.

Markers need no special drain ordering: the published view is always a prefix of the log, so
a marker written after its shards can only be published together with or after them.

`--keep-shared M`: checkpoints older than the M-th newest *complete* one are deleted from the
namespace (and so from SHARED once GC finds their objects unreferenced). A segment whose data
is all dead before it was uploaded is dropped from the drain instead of uploaded (a superseded
checkpoint). `--keep-local N`: segments holding only data of checkpoints older than the N-th
newest are evicted from NVMe once published; the newest checkpoint's segments are evicted last.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from ckptfs.errors import FsError
from ckptfs.index import ROOT_INO, VSEG_BIT
from ckptfs.namespace import Namespace

log = logging.getLogger(__name__)

DEFAULT_RETAIN = ("step_*", "step-*", "checkpoint-*", "global_step*", "iter_*")
DEFAULT_MARKERS = (".metadata", "trainer_state.json", "commit_success.txt", "latest")
TOP_MARKERS = ("latest", "latest_checkpointed_iteration.txt")
REWALK = 30.0
IN_PROGRESS = 600.0  # seconds since its directory last changed: an incomplete one is kept
NO_CUTOFF = (-1, -1)  # below every checkpoint's order
MAX_DEPTH = 3  # a checkpoint directory is at most this many levels below the mount's root


def named_by(text: str) -> str:
    """The checkpoint a marker file beside it names: its content, reduced to a basename
    (DeepSpeed's `latest`: `global_step100`), or Megatron-LM's directory for an iteration
    number (`latest_checkpointed_iteration.txt`: `100` names `iter_0000100`)."""
    text = text.strip()
    if text.isdigit():
        return f"iter_{int(text):07d}"
    return os.path.basename(text.rstrip("/"))


def checkpoint_of(path: str, retain: tuple[str, ...], is_dir: bool) -> str | None:
    """The checkpoint directory that relative `path` is (is_dir) or lies in, by the rule of
    the module's docstring, or None. Shared by the mount's retention and `ckptfs ls`."""
    parts = path.split("/")
    for i, comp in enumerate(parts[:MAX_DEPTH]):
        if (is_dir or i < len(parts) - 1) and any(fnmatch.fnmatchcase(comp, g) for g in retain):
            return "/".join(parts[:i + 1])
    return None


@dataclass
class RetentionConfig:
    retain: tuple[str, ...] = DEFAULT_RETAIN
    markers: tuple[str, ...] = DEFAULT_MARKERS
    keep_local: int = 0  # 0 = no checkpoint-based eviction (watermarks still apply)
    keep_shared: int = 0  # 0 = keep everything
    cold: bool = False  # a cold tier is configured: the band after keep_shared moves there
    keep_cold: int = 0  # 0 = keep everything on the cold tier
    # --nodes N: a checkpoint counts as complete only once its files hold data of N nodes (this
    # node's own, and other nodes' imported from their published manifests)
    nodes: int = 0


@dataclass
class Checkpoint:
    name: str  # its path below the mount's root
    ino: int
    order: tuple[int, int]  # (completion or change time ns, directory cookie): see above
    parent: int = ROOT_INO  # the directory holding it: its group
    complete: bool = False
    segs: set[int] = field(default_factory=set)


def by_group(cps: list[Checkpoint]) -> list[list[Checkpoint]]:
    """The checkpoints of each directory, each list in the order of `cps`."""
    groups: dict[int, list[Checkpoint]] = {}
    for c in cps:
        groups.setdefault(c.parent, []).append(c)
    return list(groups.values())


class Retention:
    def __init__(self, ns: Namespace, cfg: RetentionConfig):
        self.ns = ns
        self.cfg = cfg
        self.deleted: list[str] = []
        self.protected: set[int] = set()  # segments of the newest checkpoint(s)
        self.cold_band: list[str] = []
        self._shape: tuple = ()
        self._walked = 0.0
        # checkpoints a marker beside them has named while mounted: DeepSpeed's `latest`
        # names only the newest, and the one it named before stays complete
        self._named: set[int] = set()
        self._listings: dict[int, tuple[int, list[tuple[int, str, int]]]] = {}
        self._texts: dict[int, tuple[tuple[int, int], str]] = {}  # marker ino -> text
        self._all_nodes: set[int] = set()  # checkpoints seen with files of cfg.nodes nodes
        self._fetching: set[int] = set()

    def _matches(self, name: str, globs: tuple[str, ...]) -> bool:
        return any(fnmatch.fnmatchcase(name, g) for g in globs)

    def checkpoints(self) -> list[Checkpoint]:
        """Checkpoint directories (see the module's docstring), oldest first."""
        idx = self.ns.index
        out: list[Checkpoint] = []
        dirs: list[tuple[int, str, int]] = [(ROOT_INO, "", 1)]
        seen: set[int] = set()
        markers: set[int] = set()  # the marker files this pass saw
        while dirs:
            dino, prefix, depth = dirs.pop()
            seen.add(dino)
            found: list[Checkpoint] = []
            named: set[str] = set()  # what a marker file beside them names
            for cookie, sname, child in self._listing(dino):
                node = idx.get_inode(child)
                if node is None:
                    continue
                if node.is_dir and self._matches(sname, self.cfg.retain):
                    found.append(Checkpoint(prefix + sname, child, (node.ctime_ns, cookie),
                                            dino))
                elif node.is_dir and depth < MAX_DEPTH:
                    dirs.append((child, prefix + sname + "/", depth + 1))
                elif stat.S_ISREG(node.mode) and sname in TOP_MARKERS and node.size < 4096:
                    text = self._marker_text(child, node)
                    markers.add(child)
                    if text is not None:
                        named.add(prefix + named_by(text))
            for c in found:
                done = self._marker_time(c.ino)
                if c.name in named:
                    self._named.add(c.ino)
                c.complete = (done is not None or c.ino in self._named) \
                    and self._enough_nodes(c.ino)
                if done is not None:
                    c.order = (done, c.order[1])
            out += found
        self._named &= {c.ino for c in out}
        self._all_nodes &= {c.ino for c in out}
        for gone in self._listings.keys() - seen:
            del self._listings[gone]
        for gone in self._texts.keys() - markers:
            del self._texts[gone]
        out.sort(key=lambda c: c.order)
        return out

    def _marker_text(self, ino: int, node: Any) -> str | None:
        """The text of a marker file that names a checkpoint (DeepSpeed's `latest`), read
        again only when it changed. A pass runs on the request thread: bytes that are not on
        NVMe (the file evicted, or another node's) are read only from memory, and fetched for
        the next pass by a thread of its own, so a store that does not answer never holds up
        the mount. None: not known yet, or unreadable."""
        key = (node.mtime_ns, node.size)
        hit = self._texts.get(ino)
        if hit is not None and hit[0] == key:
            return hit[1]
        try:
            exts, fsize, local = self.ns.read_plan(ino, 0, 4096)
            if local:
                data = self.ns.reader.read(exts, 0, 4096, fsize)
            else:
                data = self.ns.reader.read_cached(exts, 0, 4096, fsize)
                if data is None:
                    self._fetch(ino, exts, fsize)
                    return None
            text = bytes(data).decode(errors="replace")
        except (FsError, OSError):
            return None
        self._texts[ino] = (key, text)
        return text

    def _fetch(self, ino: int, exts: list, fsize: int) -> None:
        """Bring a marker's records into the reader's memory, off the request thread (one
        fetch per file at a time: a hung store keeps at most one thread per marker)."""
        if ino in self._fetching:
            return
        self._fetching.add(ino)

        def run() -> None:
            try:
                self.ns.reader.read(exts, 0, 4096, fsize)
            except Exception as e:  # EIO, a store gone: the next pass tries again
                log.debug("retention: reading marker inode %d: %s", ino, e)
            finally:
                self._fetching.discard(ino)

        threading.Thread(target=run, name="ckptfs-marker", daemon=True).start()

    def _listing(self, dino: int) -> list[tuple[int, str, int]]:
        """(cookie, name, inode) of the subdirectories and marker files in directory `dino`:
        what a pass looks at. Read again only when the directory's ctime moved (any entry
        added, removed or renamed, and any setattr, moves it; nothing sets it back): a pass
        every 2 s must not list a directory of 100,000 shards each time."""
        idx = self.ns.index
        node = idx.get_inode(dino)
        key = node.ctime_ns if node is not None else -1
        hit = self._listings.get(dino)
        if hit is not None and hit[0] == key:
            return hit[1]
        keep = []
        for cookie, name, child in idx.readdir(dino, 0):
            sname = os.fsdecode(name)
            c = idx.get_inode(child)
            if c is not None and (c.is_dir or (stat.S_ISREG(c.mode) and sname in TOP_MARKERS)):
                keep.append((cookie, sname, child))
        self._listings[dino] = (key, keep)
        return keep

    def _in_progress(self, c: Checkpoint, now_ns: int) -> bool:
        if c.complete:
            return False
        node = self.ns.index.get_inode(c.ino)
        return node is not None and now_ns - node.ctime_ns < IN_PROGRESS * 1e9

    def _enough_nodes(self, ino: int) -> bool:
        """With --nodes N (N > 1): whether checkpoint `ino`'s files hold data of N nodes. Without
        it a marker written here would let retention delete the checkpoint before while the
        other nodes' parts of this one are not on SHARED yet: were one of them to lose its
        NVMe then, no whole checkpoint would be left. Walked until it holds (files do not
        leave a checkpoint that has them all), then remembered."""
        if self.cfg.nodes <= 1 or ino in self._all_nodes:
            return True
        nodes: set[str] = set()
        for f in self._files_in(ino):
            nodes.add(self._writer(f))
            if len(nodes) >= self.cfg.nodes:
                self._all_nodes.add(ino)
                return True
        return False

    def _writer(self, f: int) -> str:
        """The node whose bytes file `f` holds, by its first extent: the node that wrote it,
        even after another node renamed it into place (HF's tmp-checkpoint-N, renamed by the
        node of rank 0, is that node's entry but every node's data). An empty file is its
        owner's."""
        idx = self.ns.index
        first = next(idx.iter_extents(f), None)
        if first is not None:
            if not first.seg & VSEG_BIT:
                return self.ns.log.node_id
            ref = idx.objref(first.seg)
            if ref is not None:
                return ref[0]
        origin = idx.origin(f)
        return origin["node"] if origin else self.ns.log.node_id

    def _marker_time(self, ino: int) -> int | None:
        """When the checkpoint in directory `ino` was completed: the newest time of its commit
        markers (see the module's docstring), or None if it has none."""
        idx = self.ns.index
        # literal names (the defaults) are one lookup each; only real globs scan the directory
        literal = [g for g in self.cfg.markers if not any(ch in g for ch in "*?[")]
        found = [child for g in literal
                 if (child := idx.lookup(ino, os.fsencode(g))) is not None]
        globs = tuple(g for g in self.cfg.markers if g not in literal)
        if globs:
            found += [child for _c, name, child in idx.readdir(ino, 0)
                      if self._matches(os.fsdecode(name), globs)]
        # an imported marker has the mtime it has on the node that wrote it (IMPORT sets it)
        return max((node.mtime_ns for child in found
                    if (node := idx.get_inode(child)) is not None), default=None)

    def _files_in(self, ino: int) -> Iterator[int]:
        """The regular files anywhere below directory `ino`."""
        idx = self.ns.index
        stack = [ino]
        while stack:
            for _c, _name, child in idx.readdir(stack.pop(), 0):
                node = idx.get_inode(child)
                if node is None:
                    continue
                if node.is_dir:
                    stack.append(child)
                elif stat.S_ISREG(node.mode):
                    yield child

    def _segments_of(self, ino: int) -> set[int]:
        return {e.seg for f in self._files_in(ino) for e in self.ns.index.iter_extents(f)
                if not e.seg & VSEG_BIT}

    # --- the pass ---------------------------------------------------------------------------

    def run_once(self) -> dict[str, Any]:
        """Apply keep-shared (deletes) and compute keep-local protection; returns what it did."""
        cps = self.checkpoints()
        deleted: list[Checkpoint] = []
        to_cold: set[int] = set()
        band: list[Checkpoint] = []
        self.cold_band = []
        if self.cfg.keep_shared:
            kept = []
            for group in by_group(cps):
                kept += self._keep(group, deleted, band)
            cps = sorted(kept, key=lambda c: c.order)
            self.cold_band = [c.name for c in band]
        evictable: set[int] = set()
        # walking a checkpoint's files costs O(files): only when the set of checkpoints (or
        # their completeness) changed, or every REWALK seconds
        # (not an incomplete checkpoint's time: it changes with every file written into it)
        shape = tuple((c.name, c.ino, c.complete, c.order if c.complete else None)
                      for c in cps)
        now = time.monotonic()
        if shape == self._shape and now - self._walked < REWALK:
            return self._result(deleted, evictable, to_cold)
        self._shape, self._walked = shape, now
        if band:
            to_cold = self._exclusive_segments(band)
        groups = by_group(cps)
        self.protected = set()
        for group in groups:  # each run's newest
            self.protected |= self._segments_of(group[-1].ino)
        if self.cfg.keep_local:
            keep_segs: set[int] = set()
            old: list[Checkpoint] = []
            for group in groups:
                for c in group[-self.cfg.keep_local:]:
                    keep_segs |= self._segments_of(c.ino)
                old += group[:-self.cfg.keep_local]
            for c in old:
                evictable |= self._segments_of(c.ino) - keep_segs
        return self._result(deleted, evictable, to_cold)

    @staticmethod
    def _result(deleted: list[Checkpoint], evictable: set[int],
                to_cold: set[int]) -> dict[str, Any]:
        """What a pass did: `deleted` the checkpoints' paths, `entries` their (directory
        inode, name) for the kernel to forget, `evictable` and `to_cold` segments."""
        return {"deleted": [c.name for c in deleted],
                "entries": [(c.parent, os.fsencode(c.name.rsplit("/", 1)[-1]))
                            for c in deleted],
                "evictable": evictable, "to_cold": to_cold}

    def _keep(self, group: list[Checkpoint], deleted: list[Checkpoint],
              band: list[Checkpoint]) -> list[Checkpoint]:
        """--keep-shared (and the cold tier's bands) within one directory's checkpoints:
        deletes what goes, adds what moves to the cold tier to `band`; returns the rest."""
        complete = [c for c in group if c.complete]
        keep = self.cfg.keep_shared
        if len(complete) <= keep:
            return group
        hot_cutoff = complete[-keep].order
        if self.cfg.cold and self.cfg.keep_cold:
            total = keep + self.cfg.keep_cold
            cutoff = complete[-total].order if len(complete) > total else NO_CUTOFF
        elif self.cfg.cold:
            cutoff = NO_CUTOFF  # keep every older checkpoint, on the cold tier
        else:
            cutoff = hot_cutoff
        now_ns = time.time_ns()
        kept = []
        for c in group:
            if c.order < cutoff and not self._in_progress(c, now_ns):
                self._delete(c)
                deleted.append(c)
            else:
                kept.append(c)
        if self.cfg.cold:
            band += [c for c in kept if c.order < hot_cutoff and not self._in_progress(c, now_ns)]
        return kept

    def _exclusive_segments(self, band: list[Checkpoint]) -> set[int]:
        """Segments whose live data all belongs to the checkpoints in `band`."""
        inos = {c.ino for c in band}
        inside: set[int] = set()
        outside: set[int] = set()
        dirs = [ROOT_INO]
        while dirs:
            for _cookie, _name, child in self.ns.index.readdir(dirs.pop(), 0):
                node = self.ns.index.get_inode(child)
                if child in inos:
                    inside |= self._segments_of(child)
                elif node is not None and node.is_dir:
                    dirs.append(child)
                else:
                    outside |= self._segments_of_entry(child)
        return inside - outside

    def _segments_of_entry(self, ino: int) -> set[int]:
        node = self.ns.index.get_inode(ino)
        if node is None:
            return set()
        if node.is_dir:
            return self._segments_of(ino)
        return {e.seg for e in self.ns.index.iter_extents(ino) if not e.seg & VSEG_BIT}

    def _delete(self, c: Checkpoint) -> None:
        """rm -rf through the namespace: ordinary UNLINK records, replayed like any other."""
        idx = self.ns.index

        def rm(parent: int, name: bytes, ino: int) -> None:
            node = idx.get_inode(ino)
            if node is not None and node.is_dir:
                for _c, cname, child in list(idx.readdir(ino, 0)):
                    rm(ino, cname, child)
                self.ns.unlink(parent, name, want_dir=True)
            else:
                self.ns.unlink(parent, name, want_dir=False)

        rm(c.parent, os.fsencode(c.name.rsplit("/", 1)[-1]), c.ino)
        self.deleted.append(c.name)
        del self.deleted[:-20]
        log.info("retention: deleted checkpoint %s (keep-shared %d)", c.name,
                 self.cfg.keep_shared)

    def status(self) -> dict[str, Any]:
        cps = self.checkpoints()
        return {"checkpoints": [{"name": c.name, "complete": c.complete,
                                 "tier": "cold" if c.name in self.cold_band else "shared"}
                                for c in cps],
                "keep_local": self.cfg.keep_local, "keep_shared": self.cfg.keep_shared,
                "recently_deleted": self.deleted[-5:]}
