"""The filesystem core: POSIX operations as log records applied to the index.

Every mutation follows one pattern: validate against the index, append a record to the log
(from then on it survives a SIGKILL), apply the same record to the index. Replay applies the
same records with the same code, so what a crash leaves behind is what was acknowledged.

No FUSE here: fs.py translates; this module is testable without a mount.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import stat
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import xxhash

from ckptfs import knobs
from ckptfs import segment as fmt
from ckptfs.errors import FsError
from ckptfs.index import ROOT_INO, VSEG_BIT, Extent, Index, Inode, SegState
from ckptfs.log import SegmentLog
from ckptfs.reads import REMOTE_CACHE_BYTES, Reader
from ckptfs.segment import Record, RecType

log = logging.getLogger(__name__)
XATTR_NAMESPACES = (b"user.", b"trusted.", b"security.")  # system.* ACLs: fs.py
XATTR_LIST_MAX = 65536  # the most listxattr(2) returns
CAPS_XATTR = b"security.capability"  # file capabilities: a write removes them
TIME_NS_MIN, TIME_NS_MAX = -(1 << 63), (1 << 63) - 1  # what a record holds (1677 to 2262)

NAME_MAX = 255
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2  # renameat2(2) flags
DEDUP_MIN = 64 << 10  # smaller writes are not worth a chunk-table entry
# Defragmenting: every write is its own record and extent, so a file grown by small appends
# (a training log, a metrics .jsonl, TensorBoard events, `print(..., flush=True)`) would
# keep one extent per write: an index row each, a manifest entry each, a read that gathers
# thousands of pieces. After DEFRAG_AFTER writes smaller than SMALL_WRITE to a file, runs of
# its adjacent small local extents are copied into single RELOC records (as compaction does).
# Below a page only: a record's 56-byte header and its index row are then a large share of
# it, while re-copying bigger pieces would cost more log and drain bandwidth than it saves
# (Python's buffered files write st_blksize = 1 MiB chunks here anyway).
SMALL_WRITE = 4 << 10
DEFRAG_AFTER = 256
DEFRAG_TRACKED = 8192  # files whose small writes are counted at once (memory bound)
# A file read sequentially has its next local records asked of the disk this far ahead: its
# records sit between other files' in the segments, which the kernel's readahead of a segment
# cannot know, so without this every record is a synchronous disk read on the trio thread.
READ_AHEAD = knobs.number("CKPTFS_READ_AHEAD", 8 << 20, "bytes")
READ_AHEAD_FIRST = 1 << 20  # the local window a newly sequential file starts with, doubling
# ... and its records on the shared store this far ahead (into the reader's bounded cache),
# at least: a file read alone asks for up to REMOTE_READ_AHEAD_MAX; the files read from the
# store at once share REMOTE_READ_AHEAD_BUDGET (half the reader's cache: more, and records
# fetched ahead are evicted before they are read, then fetched again)
REMOTE_READ_AHEAD = knobs.number("CKPTFS_REMOTE_READ_AHEAD", 2 << 20, "bytes")
REMOTE_READ_AHEAD_MAX = 16 << 20
REMOTE_READ_AHEAD_BUDGET = REMOTE_CACHE_BYTES // 2
REMOTE_STREAM_IDLE = 1.0  # s: a file not read from the store for this long no longer counts
READ_AHEAD_TRACKED = 4096  # files whose read position is remembered at once
DEFRAG_RUN_EXTENTS = 256  # per merged record (so < 1 MiB); one step: ~5 ms of the trio thread


def check_name(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise FsError(errno.ENAMETOOLONG)
    if not name or b"/" in name or b"\0" in name or name in (b".", b".."):
        raise FsError(errno.EINVAL)


@dataclass
class OpCounts:
    counts: dict[str, int] = field(default_factory=dict)

    def bump(self, op: str) -> None:
        self.counts[op] = self.counts.get(op, 0) + 1


class Namespace:
    def __init__(self, index: Index, seglog: SegmentLog, reader: Reader):
        self.index = index
        self.log = seglog
        self.reader = reader
        self.lookups: dict[int, int] = {}  # kernel lookup counts
        # directory -> its parent, for readdir's "..": the kernel looks a directory up (by its
        # parent) before it can open it, so lookups, mkdir and rename keep this complete
        self.dir_parent: dict[int, int] = {}
        # the other nodes whose last manifest lists a directory path (set by the daemon from
        # the refresher): a directory removed or renamed away here goes on them too
        self.listed_by: Callable[[str], list[str]] = lambda path: []
        self.opens: dict[int, int] = {}  # open file handles per inode
        self.ops = OpCounts()
        self.last_write_ns = 0
        self.cache = None  # LocalCache, set by the daemon
        self._active_seg = 0
        self.dedup = True
        self.dedup_hits = 0
        self.dedup_bytes = 0
        # per inode since its last defrag: [small writes, lowest offset one of them wrote]
        self.small_writes: dict[int, list[int]] = {}
        self.defrag_due: set[int] = set()
        # ino -> (where its last read ended, local and remote records asked for up to,
        # the local window)
        self.read_ahead: dict[int, tuple[int, int, int, int]] = {}
        # ino -> when it last read from the store (monotonic), oldest first
        self._remote_streams: OrderedDict[int, float] = OrderedDict()
        self.defrag_records = 0
        self.defrag_extents = 0
    # --- plumbing -------------------------------------------------------------------------

    def record(self, rtype: int, ino: int, offset: int, payload: bytes | memoryview = b"",
               time_ns: int | None = None) -> tuple[int, int]:
        """Append a record and apply it: the one way anything changes. (segment, position)"""
        res = self.log.append(rtype, ino, offset, payload, time_ns)
        assert res is not None
        seg, rec = res
        self._apply(seg, rec)
        return seg, rec.pos

    def record_later(self, rtype: int, ino: int, offset: int, payload: bytes | memoryview,
                     then: Callable[[int, int], None] | None = None) -> None:
        """record() for a big data record whose device write may complete after this returns
        (SegmentLog.append(later=...)): the record is applied, and then(segment, position)
        called, once it is written; until then the index does not know it, as if the write
        had not happened yet. The caller settles `log.submitted` before replying."""
        def written(seg: int, rec: Record) -> None:
            self._apply(seg, rec)
            if then is not None:
                then(seg, rec.pos)

        res = self.log.append(rtype, ino, offset, payload, later=written)
        if res is not None:
            written(*res)

    def _apply(self, seg: int, rec: Record) -> None:
        if seg != self._active_seg:
            if self.index.get_segment(seg) is None:
                self.index.set_segment(seg, SegState.ACTIVE)
            self._active_seg = seg
        self.index.apply(seg, rec)
        if self.log.should_seal():
            try:
                self.seal("size")
            except OSError as e:
                # the operation is in the log and applied: it succeeded. The seal did not
                # happen at all (SegmentLog.seal), and the next append tries again
                log.warning("sealing the full segment failed (retried at the next append): %s",
                            e)

    def seal(self, reason: str) -> int | None:
        """Seal the active segment; returns its id (or None if it was empty)."""
        seg_id = self.log.seg_id if self.log.has_records() else None
        res = self.log.seal(reason)
        if res is None:
            return None
        seg, rec = res
        self.index.apply(seg, rec)
        self.index.set_segment(seg, SegState.SEALED, size=rec.pos + rec.size + fmt.FOOTER_SIZE,
                               sealed_ns=time.time_ns())
        return seg_id

    def inode(self, ino: int) -> Inode:
        node = self.index.get_inode(ino)
        if node is None:
            raise FsError(errno.ENOENT)
        return node

    def _dir(self, ino: int) -> Inode:
        node = self.inode(ino)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        return node

    # --- lookups and reference counts -----------------------------------------------------

    def lookup(self, parent: int, name: bytes, count: bool = True) -> Inode:
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        self._dir(parent)
        if name == b".":
            child = parent
        else:
            found = self.index.lookup(parent, name)
            if found is None:
                raise FsError(errno.ENOENT)
            child = found
        node = self.inode(child)
        if count:
            self.lookups[child] = self.lookups.get(child, 0) + 1
        if node.is_dir and child != parent:
            self.dir_parent[child] = parent
        return node

    def forget(self, ino: int, n: int) -> None:
        left = self.lookups.get(ino, 0) - n
        if left > 0:
            self.lookups[ino] = left
            return
        self.lookups.pop(ino, None)
        self.dir_parent.pop(ino, None)
        self._maybe_purge(ino)

    def _maybe_purge(self, ino: int) -> None:
        if ino == ROOT_INO or self.lookups.get(ino) or self.opens.get(ino):
            return
        node = self.index.get_inode(ino)
        if node is not None and node.nlink == 0:
            self.record(RecType.PURGE, ino, 0)
            self.small_writes.pop(ino, None)

    def purge_orphans(self) -> int:
        """At mount: inodes unlinked while open before a crash are dead now."""
        dead = self.index.orphans()
        for ino in dead:
            self.record(RecType.PURGE, ino, 0)
        return len(dead)

    # --- namespace operations -------------------------------------------------------------

    def make_node(self, parent: int, name: bytes, mode: int, uid: int, gid: int, rdev: int = 0,
                  target: bytes = b"", kernel: bool = False) -> Inode:
        """Create an inode and its entry; kernel=True when the reply hands it to the kernel."""
        check_name(name)
        pnode = self._dir(parent)
        if self.index.lookup(parent, name) is not None:
            raise FsError(errno.EEXIST)
        if pnode.mode & stat.S_ISGID:
            gid = pnode.gid  # as on ext4: a setgid directory passes its group on
        ino = self.index.next_ino
        self.index.next_ino += 1
        self.record(RecType.CREATE, ino, 0, fmt.create_body(parent, mode, uid, gid, rdev, name,
                                                              target))
        if kernel:
            self.lookups[ino] = self.lookups.get(ino, 0) + 1
        return self.inode(ino)

    def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        self.ops.bump("create")
        node = self.make_node(parent, name, stat.S_IFREG | (mode & 0o7777), uid, gid,
                              kernel=True)
        self.opens[node.ino] = self.opens.get(node.ino, 0) + 1
        return node

    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int, gid: int) -> Inode:
        self.ops.bump("mknod")
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)
                or stat.S_ISCHR(mode) or stat.S_ISBLK(mode)):
            raise FsError(errno.EINVAL)
        return self.make_node(parent, name, mode, uid, gid, rdev, kernel=True)

    def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        self.ops.bump("mkdir")
        # setgid directories pass the bit on to subdirectories, as on ext4
        if self._dir(parent).mode & stat.S_ISGID:
            mode |= stat.S_ISGID
        node = self.make_node(parent, name, stat.S_IFDIR | (mode & 0o7777), uid, gid,
                              kernel=True)
        self.dir_parent[node.ino] = parent
        return node

    def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        self.ops.bump("symlink")
        if len(target) > 4095:
            raise FsError(errno.ENAMETOOLONG)
        return self.make_node(parent, name, stat.S_IFLNK | 0o777, uid, gid, target=target,
                              kernel=True)

    def readlink(self, ino: int) -> bytes:
        node = self.inode(ino)
        if not stat.S_ISLNK(node.mode):
            raise FsError(errno.EINVAL)
        return node.target

    def link(self, ino: int, parent: int, name: bytes) -> Inode:
        """A hard link: one more name for an existing file (not a directory)."""
        self.ops.bump("link")
        check_name(name)
        self._dir(parent)
        node = self.inode(ino)
        if node.is_dir:
            raise FsError(errno.EPERM)
        if self.index.lookup(parent, name) is not None:
            raise FsError(errno.EEXIST)
        self.record(RecType.LINK, ino, 0, fmt.link_body(parent, name))
        self.lookups[ino] = self.lookups.get(ino, 0) + 1  # the reply is a new entry
        return self.inode(ino)

    def unlink(self, parent: int, name: bytes, want_dir: bool, propagate: bool = True) -> None:
        """propagate=False for a refresh's removals: the entry's node removed it first."""
        self.ops.bump("rmdir" if want_dir else "unlink")
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        self._dir(parent)
        child = self.index.lookup(parent, name)
        if child is None:
            raise FsError(errno.ENOENT)
        node = self.inode(child)
        if want_dir:
            if not node.is_dir:
                raise FsError(errno.ENOTDIR)
            if not self.index.dir_is_empty(child):
                raise FsError(errno.ENOTEMPTY)
        elif node.is_dir:
            raise FsError(errno.EISDIR)
        gone: list[dict] = []
        if propagate and node.nlink <= 1 + node.is_dir:
            gone = self._tombstone(child, node)
            if node.is_dir:
                gone += self._tombstone_dir(self._path(parent, name))
        self.record(RecType.UNLINK, parent, 0, name)
        self._maybe_purge(child)
        self.record_gone(gone)

    def waited(self, ino: int) -> None:
        """A WAITED record: `ckptfs wait` of directory `ino` begins now (it changes nothing in
        the namespace; the node's manifest says so, for other nodes' `wait --all-nodes`)."""
        self.record(RecType.WAITED, ino, 0)

    def record_gone(self, gone: list[dict]) -> None:
        """GONE records for these bodies. A delete or rename writes its tombstones once it is
        in the log itself: a failed rename must not have other nodes delete what is still
        there."""
        for body in gone:
            self.record(RecType.GONE, 0, 0, json.dumps(body, separators=(",", ":")).encode())

    def _tombstone(self, ino: int, node: Inode) -> list[dict]:
        """The GONE record's body when `ino` is another node's (made or imported here for
        it, and not changed here since): that node removes its version too, and the
        manifests hide it meanwhile (remote.py: Refresher._apply_tombstones; export.py:
        merged_view)."""
        origin = self.index.origin(ino)
        if origin is None or "path" not in origin or origin["node"] == self.log.node_id:
            return []
        return [{"path": origin["path"], "node": origin["node"],
                 "mtime_ns": origin["mtime_ns"], "size": origin.get("size", 0),
                 "dir": int(node.is_dir)}]

    def _tombstone_dir(self, path: str | None) -> list[dict]:
        """GONE bodies for a directory path removed here that other nodes list: each removes
        its own once it is empty (HF's tmp-checkpoint-N, made by every node)."""
        if path is None:
            return []
        return [{"path": path, "node": node, "mtime_ns": 0, "size": 0, "dir": 1}
                for node in self.listed_by(path)]

    def _path(self, parent: int, name: bytes) -> str | None:
        """The path of `name` in directory `parent`, from the directories' parents the
        lookups saw (None if one is unknown)."""
        parts = [name]
        d = parent
        seen: set[int] = set()
        while d != ROOT_INO:
            up = self.dir_parent.get(d)
            if up is None or d in seen:  # unknown, or a cycle (never from the kernel's VFS)
                return None
            seen.add(d)
            for _c, n, child in self.index.readdir(up, 0):
                if child == d:
                    parts.append(n)
                    break
            else:
                return None
            d = up
        return "/".join(os.fsdecode(p) for p in reversed(parts))

    def _tombstone_tree(self, ino: int, node: Inode, path: str | None) -> list[dict]:
        """_tombstone for `ino` and, for a directory, everything under it (a rename moves the
        entries away from the paths their nodes have them at), and _tombstone_dir for the
        directories other nodes list."""
        gone = self._tombstone(ino, node)
        if not node.is_dir:
            return gone
        gone += self._tombstone_dir(path)
        if not self.index.txn.stat(self.index.origins)["entries"]:
            return gone  # nothing here came from other nodes
        stack = [(ino, path)]
        while stack:
            d, dpath = stack.pop()
            for _c, n, child in list(self.index.readdir(d, 0)):
                c = self.index.get_inode(child)
                if c is None:
                    continue
                gone += self._tombstone(child, c)
                if c.is_dir:
                    cpath = f"{dpath}/{os.fsdecode(n)}" if dpath is not None else None
                    gone += self._tombstone_dir(cpath)
                    stack.append((child, cpath))
        return gone

    def rename(self, op: int, old: bytes, np_: int, new: bytes, flags: int) -> None:
        self.ops.bump("rename")
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE):
            # RENAME_WHITEOUT (overlayfs' upper layer) and anything newer: not supported, as
            # on most filesystems. Taking it as a plain rename would leave no whiteout behind
            # and let an rmdir succeed that must fail.
            raise FsError(errno.EINVAL)
        check_name(new)
        self._dir(op)
        self._dir(np_)
        src = self.index.lookup(op, old)
        if src is None:
            raise FsError(errno.ENOENT)
        snode = self.inode(src)
        dst = self.index.lookup(np_, new)
        if flags & RENAME_NOREPLACE and dst is not None:
            raise FsError(errno.EEXIST)
        if flags & RENAME_EXCHANGE:
            if dst is None:
                raise FsError(errno.ENOENT)
        elif dst is not None and dst != src:
            dnode = self.inode(dst)
            if snode.is_dir and not dnode.is_dir:
                raise FsError(errno.ENOTDIR)
            if not snode.is_dir and dnode.is_dir:
                raise FsError(errno.EISDIR)
            if dnode.is_dir and not self.index.dir_is_empty(dst):
                raise FsError(errno.ENOTEMPTY)
        if dst == src:
            return
        gone = self._tombstone_tree(src, snode, self._path(op, old) if snode.is_dir else None)
        if dst is not None:
            dnode = self.inode(dst)
            if flags & RENAME_EXCHANGE:
                gone += self._tombstone_tree(dst, dnode,
                                             self._path(np_, new) if dnode.is_dir else None)
            elif dnode.nlink <= 1 + dnode.is_dir:
                gone += self._tombstone(dst, dnode)
        self.record(RecType.RENAME, 0, 0, fmt.rename_body(op, old, np_, new, flags))
        if snode.is_dir:
            self.dir_parent[src] = np_
        if flags & RENAME_EXCHANGE and dst is not None and dst in self.dir_parent:
            self.dir_parent[dst] = op
        if dst is not None and not flags & RENAME_EXCHANGE:
            self._maybe_purge(dst)
        self.record_gone(gone)

    def setattr(self, ino: int, mode: int | None = None, uid: int | None = None,
                gid: int | None = None, size: int | None = None, atime_ns: int | None = None,
                mtime_ns: int | None = None) -> Inode:
        self.ops.bump("setattr")
        node = self.inode(ino)
        mask = 0
        if mode is not None:
            mask |= fmt.SET_MODE
        if uid is not None:
            mask |= fmt.SET_UID
        if gid is not None:
            mask |= fmt.SET_GID
        if size is not None:
            if node.is_dir:
                raise FsError(errno.EISDIR)
            if not stat.S_ISREG(node.mode):
                raise FsError(errno.EINVAL)
            if size < 0 or size > (1 << 62):
                raise FsError(errno.EFBIG)
            mask |= fmt.SET_SIZE
            if mtime_ns is None:  # truncate moves mtime as on ext4
                mtime_ns = time.time_ns()
        if atime_ns is not None:
            mask |= fmt.SET_ATIME
            atime_ns = min(max(atime_ns, TIME_NS_MIN), TIME_NS_MAX)
        if mtime_ns is not None:
            mask |= fmt.SET_MTIME
            mtime_ns = min(max(mtime_ns, TIME_NS_MIN), TIME_NS_MAX)
        if mask:
            self.record(RecType.SETATTR, ino, 0, fmt.setattr_body(
                mask, mode or 0, uid or 0, gid or 0, size or 0, atime_ns or 0, mtime_ns or 0))
        return self.inode(ino)

    # --- files ----------------------------------------------------------------------------

    def open(self, ino: int, flags: int) -> Inode:
        node = self.inode(ino)
        if node.is_dir and flags & os.O_ACCMODE != os.O_RDONLY:
            raise FsError(errno.EISDIR)
        if flags & os.O_TRUNC and stat.S_ISREG(node.mode):
            # as on Linux: also when the file is empty (its mtime and ctime move), and also
            # O_RDONLY (the kernel checked write permission for O_TRUNC). Before the open is
            # counted: if it fails (ENOSPC, EIO) no RELEASE comes to uncount it, and an open
            # count that never drops keeps an unlinked file's extents until the next mount.
            node = self.setattr(ino, size=0)
        self.opens[ino] = self.opens.get(ino, 0) + 1
        return node

    def release(self, ino: int) -> None:
        left = self.opens.get(ino, 0) - 1
        if left > 0:
            self.opens[ino] = left
        else:
            self.opens.pop(ino, None)
            self._maybe_purge(ino)

    def write(self, ino: int, off: int, data: bytes | memoryview) -> int:
        n = len(data)
        if off + n > (1 << 62):
            raise FsError(errno.EFBIG)
        if self.dedup and n >= DEDUP_MIN:
            digest = xxhash.xxh3_128_digest(data)
            hit = self.index.chunk(digest)
            if hit is not None and hit[2] == n and self._chunk_alive(hit[0]):
                # the incremental drain: these bytes are already in an earlier record (and
                # published, or about to be, before this one): reference them
                self.record_later(RecType.REF, ino, off, fmt.REF_BODY.pack(hit[0], hit[1], n))
                self.dedup_hits += 1
                self.dedup_bytes += n
            else:
                self.record_later(RecType.WRITE, ino, off, data,
                                  lambda seg, pos: self.index.put_chunk(digest, seg, pos, n))
        else:
            self.record_later(RecType.WRITE, ino, off, data)
        if n < SMALL_WRITE:
            sw = self.small_writes.get(ino)
            if sw is None:
                if len(self.small_writes) >= DEFRAG_TRACKED:
                    self._forget_small_writes()
                sw = self.small_writes[ino] = [0, off]
            sw[0] += 1
            sw[1] = min(sw[1], off)
            if sw[0] >= DEFRAG_AFTER:
                self.defrag_due.add(ino)
        self.last_write_ns = time.time_ns()
        return n

    def drop_setid(self, ino: int) -> bool:
        """A write by an unprivileged process clears setuid, and setgid where it means
        something (group execute set), as the kernel's should_remove_suid() does. True if
        the mode changed."""
        mode = self.inode(ino).mode
        kill = mode & stat.S_ISUID
        if mode & stat.S_ISGID and mode & stat.S_IXGRP:
            kill |= stat.S_ISGID
        if kill and stat.S_ISREG(mode):
            self.setattr(ino, mode=mode & ~kill)
            return True
        return False

    def drop_caps(self, ino: int) -> bool:
        """A write removes the file's file capabilities (security.capability), whoever
        writes, as the kernel's file_remove_privs() does before a cached write. True if the
        file had them."""
        if self.index.get_xattr(ino, CAPS_XATTR) is None:
            return False
        self.removexattr(ino, CAPS_XATTR)
        return True

    def _forget_small_writes(self) -> None:
        """Bound the per-file counters (a storm of files with one small write each would
        grow them forever): keep the half with the most small writes."""
        keep = sorted(self.small_writes.items(), key=lambda kv: kv[1][0],
                      reverse=True)[:DEFRAG_TRACKED // 2]
        self.small_writes = dict(keep)

    def defrag_step(self, ino: int, start: int) -> int | None:
        """Look at up to DEFRAG_RUN_EXTENTS extents of `ino` from file offset `start` on and
        merge their first run of at least two adjacent small local extents into one RELOC
        record. Returns the offset to go on from, or None when the file has no more extents.

        Synchronous from reading the extents to appending the record, so no request can
        change the file in between: the record holds exactly the bytes the extents held.
        Extents on the shared store only are left alone (reading them here would block).
        """
        self.log.join()  # a big write on its way to the disk is part of the file already
        node = self.index.get_inode(ino)
        if node is None or not stat.S_ISREG(node.mode):
            return None
        batch = list(itertools.islice(self.index.iter_extents(ino, start), DEFRAG_RUN_EXTENTS))
        if not batch:
            return None
        run: list[Extent] = []
        for e in batch:
            if e.length >= SMALL_WRITE or not self.reader.is_local(e):
                if len(run) >= 2:
                    break
                run = []
                continue
            if run and e.start != run[-1].end:
                if len(run) >= 2:
                    break
                run = []
            run.append(e)
        if len(run) < 2:  # nothing to merge here: go on after this batch
            return batch[-1].end if len(batch) == DEFRAG_RUN_EXTENTS else None
        off, end = run[0].start, run[-1].end
        data = self.reader.read(run, off, end - off, node.size)
        self.record(RecType.RELOC, ino, off, data)
        self.defrag_records += 1
        self.defrag_extents += len(run)
        return end

    def defrag(self, ino: int) -> None:
        """The whole file in one go (the daemon yields between steps instead)."""
        pos: int | None = 0
        while pos is not None:
            pos = self.defrag_step(ino, pos)

    def _chunk_alive(self, seg: int) -> bool:
        info = self.index.get_segment(seg)
        # a segment with no live data left may be on its way out (GC): never point into it
        return (info is not None and info.live > 0
                and info.state not in (SegState.DROPPED, SegState.COLD))

    def read_plan(self, ino: int, off: int, size: int) -> tuple[list[Extent], int, bool]:
        """(extents, file size, all local?) for a read; resolves shared object names."""
        node = self.inode(ino)
        end = min(off + size, node.size)
        if off >= end:
            return [], node.size, True
        exts = self.index.extents_in(ino, off, end)
        local = True
        touch = self.cache.touch if self.cache is not None else None
        for e in exts:
            if touch is not None:
                touch(e.seg)
            if not self.reader.is_local(e):
                local = False
                if e.seg & VSEG_BIT and e.seg not in self.reader.objrefs:
                    self._resolve(ino, e)
        if READ_AHEAD > 0:
            self._read_ahead(ino, off, end, node.size, local)
        return exts, node.size, local

    def _resolve(self, ino: int, e: Extent) -> None:
        """Tell the reader which node's object a vseg id of e stands for."""
        ref = self.index.objref(e.seg)
        if ref is None:
            raise FsError(errno.EIO, f"extent of inode {ino} names an unknown object")
        self.reader.objrefs[e.seg] = ref

    def remote_window(self, ino: int) -> int:
        """How far ahead to fetch a file read sequentially from the shared store: the budget
        shared by the files read from it within the last REMOTE_STREAM_IDLE seconds, at least
        REMOTE_READ_AHEAD, at most REMOTE_READ_AHEAD_MAX. (One process restoring one big file
        from S3 had 2 MiB, two GETs, in flight.)"""
        now = time.monotonic()
        streams = self._remote_streams  # oldest first: O(1) a call, however many files
        streams[ino] = now
        streams.move_to_end(ino)
        while now - next(iter(streams.values())) > REMOTE_STREAM_IDLE:
            streams.popitem(last=False)
        return max(REMOTE_READ_AHEAD, min(REMOTE_READ_AHEAD_MAX,
                                          REMOTE_READ_AHEAD_BUDGET // len(streams)))

    def _read_ahead(self, ino: int, off: int, end: int, size: int, local: bool) -> None:
        """Ask for the records of the next bytes of a file read sequentially (from its start,
        or on from where the last read ended, give or take the reordering of the kernel's
        own readahead requests, a few requests' worth): up to READ_AHEAD bytes of local
        records (a window that starts at READ_AHEAD_FIRST and doubles, so a read that only
        happens to land near the last one costs little disk), remote_window() of records on
        the shared store (`local`: this read found none there), each half a window at a
        time. Random reads ask for nothing."""
        last, asked, asked_remote, win = self.read_ahead.get(ino, (0, 0, 0, READ_AHEAD_FIRST))
        if off == 0:  # a new pass over the file: where its records are may have changed
            asked = asked_remote = 0
        elif abs(off - last) > min(READ_AHEAD // 4, max(4 * (end - off), 64 << 10)):
            # A jump: wait and see whether it goes on. One that lands in what was asked for
            # already keeps that asked for: the kernel's readahead requests for a file that
            # is also being written (the page cache answering some reads, stale pages read
            # again) hop back and forth by a few pages, and asking for the same window again
            # after each hop cost 500 extents per read.
            keep = off <= asked <= off + 2 * READ_AHEAD
            keep_remote = off <= asked_remote <= off + 2 * READ_AHEAD
            self.read_ahead[ino] = (end, asked if keep else end,
                                    asked_remote if keep_remote else end,
                                    win if keep else READ_AHEAD_FIRST)
            return
        win = min(win, READ_AHEAD)
        # grown with what the file has read so far, so that files starting together do not
        # ask for more than their share before they know of each other
        rwin = REMOTE_READ_AHEAD if local else max(
            REMOTE_READ_AHEAD, min(self.remote_window(ino), end // 2))
        on_disk = (max(asked, end), min(end + win, size))
        remote = (max(asked_remote, end), min(end + rwin, size))
        if end + win // 2 <= asked or on_disk[0] >= on_disk[1]:
            on_disk = (0, 0)
        else:
            win = min(2 * win, READ_AHEAD)
        if end + rwin // 2 <= asked_remote or remote[0] >= remote[1]:
            remote = (0, 0)
        if len(self.read_ahead) >= READ_AHEAD_TRACKED and ino not in self.read_ahead:
            self.read_ahead.clear()
        self.read_ahead[ino] = (end, max(asked, on_disk[1]), max(asked_remote, remote[1]), win)
        if on_disk[1] or remote[1]:
            lo = min(r[0] for r in (on_disk, remote) if r[1])
            hi = max(on_disk[1], remote[1])
            exts = self.index.extents_in(ino, lo, hi)
            for e in exts:
                if e.seg & VSEG_BIT and e.seg not in self.reader.objrefs:
                    self._resolve(ino, e)
            self.reader.read_ahead(exts, on_disk, remote)

    def read(self, ino: int, off: int, size: int) -> bytes:
        """Synchronous read (local or not): for tests and tools, not the FUSE loop."""
        exts, fsize, _local = self.read_plan(ino, off, size)
        return bytes(self.reader.read(exts, off, size, fsize))

    async def fsync(self) -> None:
        self.ops.bump("fsync")
        await self.log.sync()

    # --- directories ----------------------------------------------------------------------

    def readdir(self, ino: int, after: int, upto: int | None = None
                ) -> Iterator[tuple[int, bytes, Inode]]:
        """Entries of `ino` with a cookie above `after` (and not above `upto`), lazily: a
        READDIR reply holds a few dozen of them, however big the directory."""
        for cookie, name, child in self.index.readdir(ino, after):
            if upto is not None and cookie > upto:
                return
            node = self.index.get_inode(child)
            if node is not None:
                yield cookie, name, node

    # --- xattrs ---------------------------------------------------------------------------

    def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        self.inode(ino)
        if len(name) > 255:
            raise FsError(errno.ERANGE)
        if len(value) > 65536:
            raise FsError(errno.E2BIG)
        prefix = next((p for p in XATTR_NAMESPACES if name.startswith(p)), None)
        if prefix is None:
            raise FsError(errno.EOPNOTSUPP)  # as ext4: no such namespace
        if len(name) == len(prefix):
            raise FsError(errno.EINVAL)  # "user." names nothing
        if self.index.get_xattr(ino, name) is None and sum(
                len(n) + 1 for n in self.index.list_xattrs(ino)) + len(name) + 1 > XATTR_LIST_MAX:
            raise FsError(errno.ENOSPC)  # listxattr(2) could not return the names any more
        self.record(RecType.XATTR, ino, 0, fmt.xattr_body(name, value))

    def removexattr(self, ino: int, name: bytes) -> None:
        if self.index.get_xattr(ino, name) is None:
            raise FsError(errno.ENODATA)
        self.record(RecType.XATTR, ino, 0, fmt.xattr_body(name, None))
