"""pyfuse3 Operations, thin: translate FUSE requests to the core and errors to FUSEError.

No request, however odd, may kill the daemon: an unexpected exception becomes EIO for that
request plus a logged traceback, and the mount stays alive.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import time
from typing import Any, Callable

import pyfuse3
import trio

from ckptfs.errors import FsError, to_errno
from ckptfs.index import Inode
from ckptfs.namespace import CAPS_XATTR, Namespace

log = logging.getLogger(__name__)

O_DIRECT = getattr(os, "O_DIRECT", 0)
# A file handle is the inode number plus what kind of open it came from.
FH_UNCACHED = 1 << 62  # writes bypass the page cache (direct_io or O_DIRECT)
FH_UNPRIV = 1 << 61  # direct_io opened by a process other than root
FH_CAPS = 1 << 60  # direct_io of a file that had file capabilities at open
FH_INO = (1 << 56) - 1
ENTRY_TIMEOUT = 5.0
ATTR_TIMEOUT = 5.0
CONTROL_XATTRS = (b"user.ckptfs.control", b"user.ckptfs.pid")
# Without FUSE ACL support the kernel passes these to us as plain xattrs. Stored as such they
# would change nothing (the mode bits stay what they were) yet look like ACLs: `cp -a` sets the
# ACL that stands for the source's mode instead of chmod-ing, and its 0700/0600 creation modes
# would stick. EOPNOTSUPP, as on a filesystem mounted without ACLs, makes tools use chmod.
ACL_PREFIX = b"system.posix_acl_"
# No SELinux labels either (the kernel labels a FUSE mount by policy, not by xattr). `ls -l`
# asks for one per file, a round trip to us each, unless the first answer is EOPNOTSUPP:
# coreutils then takes the whole filesystem for one without labels (100,000 files: 10.5 s
# with ENODATA, 0.7-1.1 s with EOPNOTSUPP).
UNSUPPORTED_XATTRS = (ACL_PREFIX, b"security.selinux")


def fuse_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except (FsError, OSError) as e:
            err = to_errno(e)
            if err == errno.EIO:
                log.error("%s: %s", fn.__name__, e)
            raise pyfuse3.FUSEError(err) from None
        except Exception:
            log.exception("unexpected error in %s; answering EIO", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


def unqueued(fn: Callable[..., Any]) -> Callable[..., Any]:
    """For a handler that appends a record the log does not queue (SegmentLog.unqueue): first
    wait for the data writes queued before it, serving other requests meanwhile."""
    @functools.wraps(fn)
    async def wrapper(self: Operations, *args: Any, **kwargs: Any) -> Any:
        await self.ns.log.unqueue()
        return await fn(self, *args, **kwargs)

    return wrapper


def creates(fn: Callable[..., Any]) -> Callable[..., Any]:
    """unqueued() for a handler that appends a CREATE record (create, mkdir, mknod,
    symlink): its record may go ahead of the queued data writes the log's writer thread has
    not started (SegmentLog.ahead)."""
    @functools.wraps(fn)
    async def wrapper(self: Operations, *args: Any, **kwargs: Any) -> Any:
        # (the record's size, about: its name and a symlink's target are the bytes given)
        need = 256 + sum(len(a) for a in args if isinstance(a, bytes))
        async with self.ns.log.ahead(need):
            return await fn(self, *args, **kwargs)

    return wrapper


def entry(node: Inode) -> pyfuse3.EntryAttributes:
    a = pyfuse3.EntryAttributes()
    a.st_ino = node.ino
    a.generation = 0
    a.entry_timeout = ENTRY_TIMEOUT
    a.attr_timeout = ATTR_TIMEOUT
    a.st_mode = node.mode
    a.st_nlink = node.nlink
    a.st_uid = node.uid
    a.st_gid = node.gid
    a.st_rdev = node.rdev
    a.st_size = node.size
    a.st_blksize = 1 << 20
    a.st_blocks = (node.size + 511) // 512
    a.st_atime_ns = node.atime_ns
    a.st_mtime_ns = node.mtime_ns
    a.st_ctime_ns = node.ctime_ns
    return a


async def _read_only(*_args: Any, **_kwargs: Any) -> Any:
    raise pyfuse3.FUSEError(errno.EROFS)


class Operations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False  # acknowledged data must be in our log, not the kernel's
    enable_acl = False

    def __init__(self, ns: Namespace, statfs_path: str, control: dict[bytes, bytes],
                 on_fsync: Callable[[float], None] | None = None, read_only: bool = False):
        super().__init__()
        self.ns = ns
        self.read_only = read_only
        if read_only:
            # a --read-only mount is mounted `ro`, and the kernel refuses these itself; but
            # `mount -o remount,rw` flips that flag without asking us, and what would be
            # written then could never be published (no drain runs) while `wait` says it is
            for name in ("setattr", "mknod", "mkdir", "symlink", "unlink", "rmdir", "rename",
                         "link", "create", "write", "setxattr", "removexattr"):
                setattr(self, name, _read_only)
        self.statfs_path = statfs_path
        self.control = control
        self.on_fsync = on_fsync
        self.remote_limiter = trio.CapacityLimiter(8)
        # local reads that missed the page cache: enough to keep the disk's queue busy
        self.local_limiter = trio.CapacityLimiter(8)
        self.direct_writes = True
        # inodes written around the page cache since their last cached open, and how many
        # such writers each has open now
        self.written_direct: set[int] = set()
        self.uncached_writers: dict[int, int] = {}
        self.dir_handles: dict[int, tuple[int, int]] = {}  # fh -> (ino, last cookie then)
        self.next_dir_fh = 0

    # --- lookups --------------------------------------------------------------------------

    @fuse_errors
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
        return entry(self.ns.lookup(parent_inode, name))

    async def forget(self, inode_list: Any) -> None:
        for ino, n in inode_list:
            try:
                self.ns.forget(ino, n)
                if ino not in self.ns.lookups:
                    # the kernel dropped its inode, and any pages it cached with it: a later
                    # cached open starts from an empty cache. (Kept until the inode was
                    # deleted instead, it stayed for every file written once and never
                    # opened again: 2,000 inode numbers per checkpoint for as long as the
                    # daemon ran.)
                    self.written_direct.discard(ino)
            except Exception:  # forget has no reply; never let it escape
                log.exception("forget(%d) failed", ino)

    @fuse_errors
    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return entry(self.ns.inode(inode))

    @fuse_errors
    @unqueued
    async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any,
                      ctx: Any) -> pyfuse3.EntryAttributes:
        node = self.ns.setattr(
            inode,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            size=attr.st_size if fields.update_size else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
        )
        return entry(node)

    @fuse_errors
    async def access(self, inode: int, mode: int, ctx: Any) -> bool:
        """access(2) and chdir, asked only where the kernel does not check permissions
        itself (Daemon.kernel_permissions: a mount by root without allow_other, which the
        kernel lets no one but root use). As the kernel would: root may do anything but
        execute a file that no one may execute."""
        node = self.ns.inode(inode)
        if ctx.uid != 0:
            return False  # (not reached: the kernel refuses other callers first)
        return not (mode & os.X_OK and not node.is_dir and not node.mode & 0o111)

    @fuse_errors
    async def readlink(self, inode: int, ctx: Any) -> bytes:
        return self.ns.readlink(inode)

    # --- namespace ------------------------------------------------------------------------

    @fuse_errors
    @creates
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: Any) -> pyfuse3.EntryAttributes:
        return entry(self.ns.mknod(parent_inode, name, mode, rdev, ctx.uid, ctx.gid))

    @fuse_errors
    @creates
    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: Any) -> pyfuse3.EntryAttributes:
        return entry(self.ns.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid))

    @fuse_errors
    @creates
    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: Any) -> pyfuse3.EntryAttributes:
        return entry(self.ns.symlink(parent_inode, name, target, ctx.uid, ctx.gid))

    @fuse_errors
    @unqueued
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        self.ns.unlink(parent_inode, name, want_dir=False)

    @fuse_errors
    @unqueued
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        self.ns.unlink(parent_inode, name, want_dir=True)

    @fuse_errors
    @unqueued
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: Any) -> None:
        self.ns.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    @fuse_errors
    @unqueued
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: Any) -> pyfuse3.EntryAttributes:
        return entry(self.ns.link(inode, new_parent_inode, new_name))

    # --- files ----------------------------------------------------------------------------

    def _fileinfo(self, ino: int, flags: int, uid: int, new: bool = False) -> pyfuse3.FileInfo:
        """Write-only opens (how checkpoints are written) bypass the page cache: the kernel
        hands our buffers over in max_write requests instead of copying them through its cache
        first (about 2x for a storm of files: PERF-NOTES). Everything else keeps the page
        cache, so mmap and repeated reads work. O_DIRECT needs no FUSE direct_io: the kernel
        then sends its reads and writes straight to us itself, and, unlike under direct_io, a
        MAP_SHARED mmap of the same descriptor still works (as fsx -Z expects).

        A cached open drops the pages the kernel may hold if the file was written around the
        cache since the last cached open, or still has such a writer open (xfstests
        generic/451: buffered readers racing direct writers). The handle is the inode number
        plus flag bits (FH_*), so that write and release know what kind of open it was."""
        fh = ino
        writes = flags & os.O_ACCMODE != os.O_RDONLY
        direct = self.direct_writes and flags & os.O_ACCMODE == os.O_WRONLY
        fi = pyfuse3.FileInfo()
        fi.direct_io = direct
        if direct or (writes and flags & O_DIRECT):
            fh |= FH_UNCACHED
            self.uncached_writers[ino] = self.uncached_writers.get(ino, 0) + 1
            self.written_direct.add(ino)
            fi.keep_cache = True
            if direct and uid != 0:
                # The kernel strips setuid/setgid before a cached or O_DIRECT write by an
                # unprivileged process, but leaves it to us under direct_io.
                fh |= FH_UNPRIV
            if direct and not new and self.ns.index.get_xattr(ino, CAPS_XATTR) is not None:
                # the same for file capabilities, which any writer removes (xfstests
                # generic/093: `echo x >> f` left them)
                fh |= FH_CAPS
        else:
            fi.keep_cache = ino not in self.written_direct
            if not self.uncached_writers.get(ino):
                self.written_direct.discard(ino)
        fi.fh = fh
        return fi

    @fuse_errors
    @creates
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: Any) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        node = self.ns.create(parent_inode, name, mode, ctx.uid, ctx.gid)
        return self._fileinfo(node.ino, flags, ctx.uid, new=True), entry(node)

    @fuse_errors
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        if self.read_only and (flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC):
            raise FsError(errno.EROFS, "read-only mount")
        if flags & os.O_TRUNC:
            await self.ns.log.unqueue()  # a SETATTR record (see unqueued)
        self.ns.open(inode, flags)
        return self._fileinfo(inode, flags, ctx.uid)

    @fuse_errors
    async def read(self, fh: int, off: int, size: int) -> bytes:
        exts, fsize, local = self.ns.read_plan(fh & FH_INO, off, size)
        # from the page cache or the remote cache: inline, a thread hop would cost more than
        # it saves; anything else waits on a worker thread while other requests go on
        data = self.ns.reader.read_cached(exts, off, size, fsize)
        if data is not None:
            return data
        return await trio.to_thread.run_sync(self.ns.reader.read, exts, off, size, fsize,
                                             limiter=self.local_limiter if local
                                             else self.remote_limiter)

    @fuse_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        cache = self.ns.cache
        if cache is not None and not cache.admit(len(buf)):
            await cache.reserve(len(buf))  # backpressure: wait for the drain to make room
        ino = fh & FH_INO
        caps = bool(fh & FH_CAPS) and self.ns.drop_caps(ino)
        if (fh & FH_UNPRIV and self.ns.drop_setid(ino)) or caps:
            # What file_remove_privs() does for a cached write: file capabilities go whoever
            # writes, setuid/setgid for an unprivileged writer (the opener stands in for the
            # writer, whom a write request does not name). The kernel caches the mode and a
            # direct write marks only size and times stale: drop its copy now, before the
            # reply (attributes only, which takes no page or inode locks).
            try:
                pyfuse3.invalidate_inode(ino, True)
            except OSError:
                pass  # the kernel does not know the inode (anymore): nothing cached
        await self.ns.log.room(len(buf))
        n = self.ns.write(ino, off, buf)
        job = self.ns.log.submitted
        while job is not None:
            # this write's record is queued for the log's writer thread: serve other requests
            # meanwhile, answer once it is on the disk (and in the index)
            if not await self.ns.log.settle(job):
                break
            n = self.ns.write(ino, off, buf)  # not written (see settle): once more
            job = self.ns.log.submitted
        return n

    # No flush(): every write is in the log before it is acknowledged, so a close has nothing
    # to hand over. The base class answers ENOSYS, after which the kernel stops sending FLUSH
    # at all: one round trip less per close (7.3 -> 6.3 requests per file in a storm).

    @fuse_errors
    async def release(self, fh: int) -> None:
        ino = fh & FH_INO
        if fh & FH_UNCACHED:
            left = self.uncached_writers.pop(ino, 1) - 1
            if left > 0:
                self.uncached_writers[ino] = left
        self.ns.release(ino)

    @fuse_errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        t0 = time.monotonic()
        await self.ns.fsync()
        if self.on_fsync is not None:
            self.on_fsync(time.monotonic() - t0)

    # --- directories ----------------------------------------------------------------------

    @fuse_errors
    async def opendir(self, inode: int, ctx: Any) -> int:
        """A directory handle remembers the highest cookie the directory had when it was
        opened, and readdir on it stops there. A rename gives the entry a new, higher cookie
        (the end of the listing), so without that bound a loop renaming each entry it reads
        (away and back) would meet every entry again, forever (xfstests generic/736). POSIX
        leaves entries added after opendir unspecified; every entry there at opendir is
        listed unless removed or renamed before the listing reaches it. A rewind (offset 0)
        takes a fresh bound, as POSIX wants of rewinddir(3)."""
        node = self.ns.inode(inode)
        if not stat.S_ISDIR(node.mode):
            raise FsError(errno.ENOTDIR)
        self.next_dir_fh += 1
        self.dir_handles[self.next_dir_fh] = (inode, self.ns.index.last_cookie(inode))
        return self.next_dir_fh

    @fuse_errors
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        ino, upto = self.dir_handles[fh]
        if start_id == 0:  # (re)starting, rewinddir(3) included: the directory as it is now
            upto = self.ns.index.last_cookie(ino)
            self.dir_handles[fh] = (ino, upto)
        # offsets: 1 after ".", 2 after "..", then each entry's cookie + 2
        if start_id < 2:
            dots = [(1, b".", ino), (2, b"..", self.ns.dir_parent.get(ino, ino))][start_id:]
            for off, name, child in dots:
                # the kernel takes no lookup reference for these two
                if not pyfuse3.readdir_reply(token, name, entry(self.ns.inode(child)), off):
                    return
        for cookie, name, node in self.ns.readdir(ino, max(start_id - 2, 0), upto):
            if not pyfuse3.readdir_reply(token, name, entry(node), cookie + 2):
                return
            self.ns.lookups[node.ino] = self.ns.lookups.get(node.ino, 0) + 1
            if node.is_dir:  # the kernel knows it now without a lookup: its ".." is us
                self.ns.dir_parent[node.ino] = ino

    @fuse_errors
    async def releasedir(self, fh: int) -> None:
        self.dir_handles.pop(fh, None)

    @fuse_errors
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        await self.ns.fsync()

    @fuse_errors
    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        st = os.statvfs(self.statfs_path)
        s = pyfuse3.StatvfsData()
        s.f_bsize = st.f_bsize
        s.f_frsize = st.f_frsize
        s.f_blocks = st.f_blocks
        s.f_bfree = st.f_bfree
        s.f_bavail = st.f_bavail
        s.f_files = st.f_files
        s.f_ffree = st.f_ffree
        s.f_favail = st.f_favail
        s.f_namemax = 255
        return s

    # --- xattrs (plus the control channel on the root) -----------------------------------

    @fuse_errors
    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        if inode == pyfuse3.ROOT_INODE and name in self.control:
            return self.control[name]
        if name.startswith(UNSUPPORTED_XATTRS):
            raise FsError(errno.EOPNOTSUPP)
        self.ns.inode(inode)
        value = self.ns.index.get_xattr(inode, name)
        if value is None:
            raise FsError(pyfuse3.ENOATTR)
        return value

    @fuse_errors
    @unqueued
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        if name in CONTROL_XATTRS:
            raise FsError(errno.EPERM)
        if name.startswith(UNSUPPORTED_XATTRS):
            raise FsError(errno.EOPNOTSUPP)
        self.ns.setxattr(inode, name, value)

    @fuse_errors
    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        self.ns.inode(inode)
        return [n for n in self.ns.index.list_xattrs(inode)
                if not n.startswith(UNSUPPORTED_XATTRS)]

    @fuse_errors
    @unqueued
    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        self.ns.inode(inode)
        self.ns.removexattr(inode, name)
