"""Names of things on disk (NVME and SHARED) and in /proc: one place for all of them."""

from __future__ import annotations

import json
import os
import re

SEGMENT_DIR = "segments"
INDEX_DIR = "index"
LOCK_FILE = "ckptfs.lock"
IDENTITY_FILE = "ckptfs.json"

SHARED_ROOT = "ckptfs"
SHARED_FORMAT_FILE = "FORMAT"
SHARED_FORMAT = {"format": "ckptfs-shared", "version": 1}
FSTYPE = "fuse.ckptfs"


def control_socket_path(nvme: str) -> str:
    """Where the daemon for NVME listens. Not under NVME: AF_UNIX paths are limited to 107
    bytes and NVME paths can be longer; the name is a hash of NVME's real path."""
    import tempfile

    import xxhash

    base = "/run/ckptfs" if os.access("/run", os.W_OK) else os.path.join(
        tempfile.gettempdir(), f"ckptfs-{os.getuid()}")
    os.makedirs(base, mode=0o700, exist_ok=True)
    name = xxhash.xxh3_64_hexdigest(os.fsencode(os.path.realpath(nvme)))
    return os.path.join(base, f"{name}.sock")


def rename_noreplace(src: str, dst: str) -> list[str]:
    """Rename `src` to `dst`, never replacing an existing `dst` (FileExistsError). Returns
    the namespace operations it issued: `renameat2(RENAME_NOREPLACE)` where the filesystem
    has it; else (NFS) a hard link, which fails on an existing name, and an unlink; else
    a look before a plain rename."""
    import ctypes
    import errno

    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is not None:
        at_fdcwd, noreplace = -100, 1
        if renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), noreplace) == 0:
            return ["rename"]
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(err, os.strerror(err), dst)
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), src)
    try:
        os.link(src, dst)
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
            raise
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst) from None
        os.rename(src, dst)
        return ["rename"]
    os.unlink(src)
    return ["link", "unlink"]


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(path: str) -> int:
    """os.makedirs(path, exist_ok=True), each directory it creates made durable in its
    parent (the parent fsync'd): by POSIX a new name is durable only once its directory is.
    ext4 happens to commit it with any later fsync; other filesystems need not (an index
    whose directory entry is lost is a rebuild from the log, one on SHARED a lost store).
    Returns how many directories it created."""
    missing: list[str] = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
        fsync_dir(os.path.dirname(d))
    return len(missing)


def publish_bytes(dest: str, data: bytes, replace: bool = True) -> list[str]:
    """Atomically create `dest`: temp file, fsync, rename, fsync the directory.

    Without the file fsync a crash can leave a renamed but empty file; without the directory
    fsync the rename itself can be lost (LevelDB's SetCurrentFile does the same).
    """
    d = os.path.dirname(dest)
    tmp = os.path.join(d, f".tmp.{os.path.basename(dest)}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.rename(tmp, dest)
            ops = ["rename"]
        else:
            ops = rename_noreplace(tmp, dest)
    except BaseException:
        try:  # a full or failing store: no temp file left behind
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(d)
    return ops


def init_shared(shared: str) -> str:
    """Create ckptfs's layout on SHARED (idempotent) and check the format of an existing one."""
    from ckptfs.errors import CliError

    root = os.path.join(shared, SHARED_ROOT)
    fmt_path = os.path.join(root, SHARED_FORMAT_FILE)
    try:
        with open(fmt_path) as f:
            found = json.load(f)
        if found.get("format") != SHARED_FORMAT["format"] or found.get("version", 0) > 1:
            raise CliError(f"{fmt_path}: not a ckptfs shared store this version can use "
                           f"({found})")
        return root
    except FileNotFoundError:
        pass
    except (ValueError, AttributeError):
        raise CliError(f"{fmt_path}: unreadable ckptfs format file") from None
    try:
        makedirs_durable(root)
        publish_bytes(fmt_path, (json.dumps(SHARED_FORMAT) + "\n").encode())
    except OSError as e:
        raise CliError(f"cannot create the ckptfs layout on SHARED {shared}: "
                       f"{e.strerror}") from None
    return root


def _mount_field(raw: bytes) -> str:
    """A field of /proc/mounts or mountinfo: the kernel writes the path's bytes as they are,
    except space, tab, newline and backslash as octal escapes (\\040 ...); as os.fsdecode
    gives it, so that it compares equal to a path Python made."""
    return os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), raw))


def mounts() -> list[tuple[str, str, str]]:
    """(source, mountpoint, fstype) from /proc/mounts, octal escapes decoded."""
    out = []
    with open("/proc/mounts", "rb") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3:
                out.append((_mount_field(parts[0]), _mount_field(parts[1]),
                            _mount_field(parts[2])))
    return out


def mount_path(path: str, _hops: int = 0,
               table: list[tuple[str, str, str]] | None = None) -> str:
    """The canonical path of a mount point without stat-ing it (a stat of a FUSE mount whose
    daemon hangs never returns): resolve the parent, keep the last component unless it is a
    symlink (an lstat of the link, never of a mount)."""
    path = os.path.abspath(path)
    path = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    table = mounts() if table is None else table
    if _hops < 40 and all(m != path for _s, m, _t in table) and os.path.islink(path):
        # a symlink to the mount point: follow it the same way (realpath would stat it)
        return mount_path(os.path.join(os.path.dirname(path), os.readlink(path)), _hops + 1,
                          table)
    return path


def mount_type(mountpoint: str) -> str | None:
    table = mounts()
    mp = mount_path(mountpoint, table=table)
    found = None
    for _src, m, t in table:
        if m == mp:
            found = t
    return found


def mount_device(mountpoint: str) -> str | None:
    """major:minor of the filesystem mounted at `mountpoint` (from mountinfo, no stat)."""
    mp = os.path.abspath(mountpoint)  # not realpath: it would stat the mount itself
    dev = None
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 4 and _mount_field(parts[4]) == mp:
                dev = parts[2].decode()
    return dev
