"""Targeted POSIX edge cases through a real mount, and the file patterns checkpoint writers use
(torch.save's zip, torch.distributed.checkpoint's metadata rename, HF Trainer's dir rename)."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import json
import mmap
import os
import random
import shutil
import stat
import struct
import subprocess
import sys
import textwrap
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from mounting import MakeMount, Mount, check_errno, run_cli, wait_for

# -- names and paths ---------------------------------------------------------------------------


def test_name_of_255_bytes_works_and_256_is_enametoolong(mount: Mount) -> None:
    d = mount.mnt
    ok = "n" * 255
    ok_utf8 = "é" * 127 + "x"  # 255 bytes in UTF-8
    assert len(ok_utf8.encode()) == 255
    for name in (ok, ok_utf8):
        (d / name).write_bytes(name.encode())
        assert (d / name).read_bytes() == name.encode()
        os.mkdir(d / (name[:-1] + "D"))
        os.symlink(name, d / (name[:-1] + "L"))
        assert os.readlink(d / (name[:-1] + "L")) == name
    os.rename(d / ok, d / ("m" * 255))
    assert sorted(os.listdir(d)) == sorted(
        ["m" * 255, ok_utf8, ok[:-1] + "D", ok[:-1] + "L", ok_utf8[:-1] + "D", ok_utf8[:-1] + "L"]
    )

    long_names = ["n" * 256, "é" * 128]
    for bad in long_names:
        assert len(bad.encode()) == 256
        p = d / bad
        calls = {
            "create": lambda p=p: os.open(p, os.O_CREAT | os.O_WRONLY, 0o644),
            "mkdir": lambda p=p: os.mkdir(p),
            "symlink": lambda p=p: os.symlink("x", p),
            "rename": lambda p=p: os.rename(d / ("m" * 255), p),
            "stat": lambda p=p: os.stat(p),
        }
        for what, call in calls.items():
            with pytest.raises(OSError) as exc:
                call()
            assert exc.value.errno == errno.ENAMETOOLONG, (what, exc.value)
    assert os.statvfs(d).f_namemax == 255

    mount.remount()
    assert (d / ("m" * 255)).read_bytes() == ok.encode()
    assert (d / ok_utf8).read_bytes() == ok_utf8.encode()
    assert os.readlink(d / (ok_utf8[:-1] + "L")) == ok_utf8


def test_long_symlink_target_round_trips(mount: Mount) -> None:
    target = "/".join(["t" * 200] * 20)  # 4019 bytes
    os.symlink(target, mount.mnt / "long")
    assert os.readlink(mount.mnt / "long") == target
    assert os.lstat(mount.mnt / "long").st_size == len(target)
    mount.remount()
    assert os.readlink(mount.mnt / "long") == target


@pytest.mark.timeout(120)
def test_readdir_lists_dot_and_dotdot_with_their_inodes_and_pages_exactly(mount: Mount) -> None:
    """`ls -a` sees "." and ".." (with the directory's and its parent's inode numbers, also
    after the directory moved) and every entry of a directory too big for one readdir call
    exactly once."""

    def ls_ai(p: Path) -> dict[str, int]:
        out = subprocess.run(["ls", "-ai1", str(p)], capture_output=True, text=True, check=True)
        pairs = [line.split(None, 1) for line in out.stdout.splitlines()]
        names = [n for _i, n in pairs]
        assert len(names) == len(set(names)), "an entry was listed twice"
        return {n: int(i) for i, n in pairs}

    top = mount.mnt / "a"
    sub = top / "b"
    sub.mkdir(parents=True)
    names = [f"entry-{i:04d}-{'x' * 40}" for i in range(600)]  # > one 4 KiB readdir buffer
    for n in names:
        (sub / n).write_bytes(b"")
    seen = ls_ai(sub)
    assert set(seen) == {".", ".."} | set(names)
    assert seen["."] == os.stat(sub).st_ino
    assert seen[".."] == os.stat(top).st_ino
    root = ls_ai(mount.mnt)
    assert root["."] == os.stat(mount.mnt).st_ino and ".." in root  # ".." is outside the mount
    (mount.mnt / "c").mkdir()
    os.rename(sub, mount.mnt / "c" / "b")
    moved = ls_ai(mount.mnt / "c" / "b")
    assert moved[".."] == os.stat(mount.mnt / "c").st_ino
    assert sorted(os.listdir(mount.mnt / "c" / "b")) == sorted(names)  # Python hides the dots


def test_readdir_while_renaming_each_entry_ends_and_a_rewind_sees_new_entries(
        mount: Mount) -> None:
    """xfstests generic/736: rename every entry away and back while reading the directory.
    Each rename puts the entry at the end of the listing; the listing must still end."""
    d = mount.mnt / "ren"
    d.mkdir()
    n = 3000
    for i in range(n):
        (d / str(i)).touch()
    seen = 0
    with os.scandir(d) as it:
        for e in it:
            seen += 1
            assert seen <= 3 * n, "readdir does not end"
            os.rename(d / e.name, d / "TEMP")
            os.rename(d / "TEMP", d / e.name)
    assert seen >= n
    assert sorted(os.listdir(d), key=int) == [str(i) for i in range(n)]
    # One open directory, listed twice: CPython's listdir(fd) rewinds it after each listing,
    # and a rewound stream shows entries created since it was opened.
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert len(os.listdir(fd)) == n
        (d / "new").touch()
        assert "new" in os.listdir(fd)
    finally:
        os.close(fd)


def test_deep_nesting_beyond_path_max(mount: Mount) -> None:
    """A tree whose full paths exceed PATH_MAX (4096) several times over, built and read back
    with dir_fd-relative calls and with chdir."""
    levels = 60
    name = "d" * 200  # 60 * 201 bytes: a 12 KiB path
    payload = b"at the bottom\n" * 100

    def descend(root: Path, depth: int) -> int:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        for _ in range(depth):
            nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return fd

    fd = os.open(mount.mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(levels):
            os.mkdir(name, dir_fd=fd)
            nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        f = os.open("bottom", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd)
        os.write(f, payload)
        os.close(f)
    finally:
        os.close(fd)

    full = os.path.join(mount.mnt, *([name] * levels), "bottom")
    assert len(full) > 2 * 4096
    with pytest.raises(OSError) as exc:
        os.stat(full)
    check_errno(exc.value, errno.ENAMETOOLONG)

    # chdir level by level (each step is a short relative path), then a relative open.
    cwd = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.chdir(mount.mnt)
        for _ in range(levels):
            os.chdir(name)
        with open("bottom", "rb") as fh:
            assert fh.read() == payload
        with open("second", "wb") as fh:
            fh.write(b"written via chdir")
    finally:
        os.fchdir(cwd)  # a cwd inside the mount would keep it busy
        os.close(cwd)

    mount.remount()
    fd = descend(mount.mnt, levels)
    try:
        assert sorted(os.listdir(fd)) == ["bottom", "second"]
        f = os.open("bottom", os.O_RDONLY, dir_fd=fd)
        assert os.read(f, 1 << 20) == payload
        os.close(f)
        assert os.stat("second", dir_fd=fd).st_size == len(b"written via chdir")
    finally:
        os.close(fd)

    # Tear it down bottom-up, also with dir_fd calls.
    fds = [os.open(mount.mnt, os.O_RDONLY | os.O_DIRECTORY)]
    for _ in range(levels):
        fds.append(os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1]))
    os.unlink("bottom", dir_fd=fds[-1])
    os.unlink("second", dir_fd=fds[-1])
    for i in range(levels, 0, -1):
        os.close(fds[i])
        os.rmdir(name, dir_fd=fds[i - 1])
    os.close(fds[0])
    assert os.listdir(mount.mnt) == []


# -- concurrency -------------------------------------------------------------------------------

MKDIR_CHILD = textwrap.dedent(
    """
    import errno, json, os, random, sys
    root, seed = sys.argv[1], int(sys.argv[2])
    paths = json.loads(sys.stdin.readline())
    sys.stdin.readline()  # the start signal: all children race from here
    random.Random(seed).shuffle(paths)
    errors = []
    for p in paths:
        # mkdir -p: every prefix, EEXIST is fine.
        parts = p.split("/")
        for i in range(1, len(parts) + 1):
            try:
                os.mkdir(os.path.join(root, *parts[:i]), 0o755)
            except FileExistsError:
                pass
            except OSError as e:
                errors.append([p, "/".join(parts[:i]), errno.errorcode.get(e.errno, e.errno)])
    print(json.dumps(errors))
    """
)


@pytest.mark.timeout(120)
def test_mkdir_p_same_tree_from_16_processes(mount: Mount) -> None:
    leaves = [f"a{i}/b{j}/c{k}/d" for i in range(3) for j in range(3) for k in range(3)]
    expected = set()
    for leaf in leaves:
        parts = leaf.split("/")
        expected |= {"/".join(parts[:i]) for i in range(1, len(parts) + 1)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MKDIR_CHILD, str(mount.mnt), str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed in range(16)
    ]
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(json.dumps(leaves) + "\n")
        p.stdin.flush()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.close()
    errors = []
    for p in procs:
        assert p.stdout is not None
        out = p.stdout.read()
        p.stdout.close()
        assert p.wait(timeout=100) == 0
        errors += json.loads(out)
    assert errors == [], f"mkdir errors other than EEXIST: {errors[:10]}"

    def check() -> None:
        found = set()
        for dirpath, dirnames, filenames in os.walk(mount.mnt):
            assert len(dirnames) == len(set(dirnames)), f"duplicate entries in {dirpath}"
            assert filenames == []
            rel = os.path.relpath(dirpath, mount.mnt)
            found |= {os.path.normpath(os.path.join(rel, d)) for d in dirnames}
            assert os.stat(dirpath).st_nlink == 2 + len(dirnames), dirpath
        assert found == expected

    check()
    mount.remount()
    check()


def test_concurrent_writers_to_distinct_files(mount: Mount) -> None:
    blobs = {f"f{i}": random.Random(i).randbytes(300_000 + i) for i in range(8)}

    def write(name: str) -> None:
        with open(mount.mnt / name, "wb") as f:
            data = blobs[name]
            step = 4096 * 3 + 1  # unaligned writes
            f.writelines(data[off : off + step] for off in range(0, len(data), step))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(write, blobs))
    for name, data in blobs.items():
        assert (mount.mnt / name).read_bytes() == data
    mount.remount()
    for name, data in blobs.items():
        assert (mount.mnt / name).read_bytes() == data


# -- unsupported or optional features: a clean answer either way -------------------------------


def test_hard_links_share_the_file_and_survive_unlink_remount_kill_and_export(
        mount: Mount, tmp_path: Path) -> None:
    m = mount.mnt / "t"  # a checkpoint directory: export takes one
    (m / "d").mkdir(parents=True)
    (m / "a").write_bytes(b"content")
    os.link(m / "a", m / "d" / "b")
    sa, sb = os.stat(m / "a"), os.stat(m / "d" / "b")
    assert sa.st_ino == sb.st_ino and sa.st_nlink == sb.st_nlink == 2
    with open(m / "d" / "b", "r+b") as f:  # a write through one name is seen through the other
        f.write(b"CON")
    assert (m / "a").read_bytes() == b"CONtent"
    for src, dst, err in ((m / "d", m / "dlink", errno.EPERM), (m / "a", m / "d" / "b",
                                                                   errno.EEXIST)):
        with pytest.raises(OSError) as exc:
            os.link(src, dst)
        check_errno(exc.value, err)
    os.link(m / "a", m / "c")
    os.unlink(m / "a")
    assert os.stat(m / "c").st_nlink == 2 and (m / "c").read_bytes() == b"CONtent"
    os.rename(m / "c", m / "d" / "b")  # onto another name of the same file: nothing changes
    assert (m / "c").exists() and os.stat(m / "d" / "b").st_nlink == 2
    mount.remount()
    assert os.stat(m / "c").st_nlink == 2 and (m / "d" / "b").read_bytes() == b"CONtent"
    os.link(m / "c", m / "e")
    mount.kill()  # the link returned to us, so it must survive a SIGKILL
    mount.remount()
    assert os.stat(m / "e").st_nlink == 3 and (m / "e").read_bytes() == b"CONtent"
    assert run_cli("wait", m, "--timeout", "60", timeout=90).rc == 0
    out = tmp_path / "out"
    assert run_cli("export", mount.shared, "t", out).rc == 0
    assert {p: (out / p).read_bytes() for p in ("c", "d/b", "e")} == dict.fromkeys(
        ("c", "d/b", "e"), b"CONtent")
    for p in ("c", "d/b", "e"):
        os.unlink(m / p)
    assert sorted(os.listdir(m)) == ["d"] and os.listdir(m / "d") == []


def test_a_file_grown_by_tiny_appends_is_defragmented_and_reads_back_everywhere(
        mount: Mount, tmp_path: Path) -> None:
    """A log written line by line, unbuffered: one record per write. The daemon merges the
    small extents (status counts it) and the file still reads back right through the mount,
    after a SIGKILL and a remount, and from SHARED alone (export)."""
    d = mount.mnt / "run"
    d.mkdir()
    lines = [f"step {i} loss {1 / (i + 1):.6f}\n".encode() for i in range(3000)]
    with open(d / "train.log", "ab", buffering=0) as f:
        for line in lines:
            f.write(line)
    want = b"".join(lines)

    def defrag() -> dict:
        return json.loads(run_cli("status", mount.mnt, "--json").out)["defrag"]

    st = wait_for(lambda: (s := defrag())["extents_merged"] >= 2900 and s, 30,
                  "the daemon to merge the log's extents")
    assert st["records"] <= 20, st  # one merged record per up to 256 lines
    assert (d / "train.log").read_bytes() == want
    mount.kill()
    mount.remount()
    assert (d / "train.log").read_bytes() == want
    rng = random.Random(5)
    for rnd in range(3):  # SIGKILL wherever the merging is: any prefix of the log reads the same
        more = [f"round {rnd} line {i}\n".encode() for i in range(1500)]
        with open(d / "train.log", "ab", buffering=0) as f:
            for line in more:
                f.write(line)
        want += b"".join(more)
        time.sleep(rng.uniform(0.5, 1.5))
        mount.kill()
        mount.remount()
        assert (d / "train.log").read_bytes() == want
    assert run_cli("wait", d, "--timeout", "60", timeout=90).rc == 0
    out = tmp_path / "out"
    assert run_cli("export", mount.shared, "run", out).rc == 0
    assert (out / "train.log").read_bytes() == want


def test_o_direct_works_with_aligned_buffers_or_is_einval(mount: Mount) -> None:
    path = mount.mnt / "direct"
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o644)
    except OSError as e:
        check_errno(e, errno.EINVAL)
        assert not path.exists() or path.stat().st_size == 0
        return
    size = 1 << 20
    data = random.Random(7).randbytes(size)
    buf = mmap.mmap(-1, size)  # page aligned
    buf[:] = data
    try:
        assert os.pwrite(fd, buf, 0) == size
        head = memoryview(buf)[: 8 * 4096]  # a slice of the mmap stays aligned; bytes would not
        assert os.pwrite(fd, head, 3 * size) == 8 * 4096  # leaves a hole
        back = mmap.mmap(-1, size)
        assert os.preadv(fd, [back], 0) == size
        assert bytes(back) == data
        assert os.preadv(fd, [back], 2 * size) == size
        assert bytes(back) == bytes(size)  # the hole reads as zeros
        # A shared mapping of the O_DIRECT descriptor works as on ext4 (fsx -Z maps it)
        with mmap.mmap(fd, 8192, mmap.MAP_SHARED, offset=size) as m:
            assert m[:] == bytes(8192)
            m[:5] = b"mmap!"
            m.flush()
        assert os.preadv(fd, [back], size) == size and bytes(back[:5]) == b"mmap!"
        os.fsync(fd)
    finally:
        head.release()
        os.close(fd)
    expected = data + b"mmap!" + bytes(2 * size - 5) + data[: 8 * 4096]
    assert path.read_bytes() == expected
    mount.remount()
    assert path.read_bytes() == expected


RENAME_NOREPLACE, RENAME_EXCHANGE, RENAME_WHITEOUT = 1, 2, 4


def _renameat2(src: Path, dst: Path, flags: int) -> int:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fn = libc.renameat2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    AT_FDCWD = -100
    if fn(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags) == 0:
        return 0
    return ctypes.get_errno()


def test_renameat2_noreplace_and_exchange_work_and_whiteout_is_einval(mount: Mount) -> None:
    d = mount.mnt
    (d / "a").write_bytes(b"A")
    (d / "b").write_bytes(b"B")
    (d / "dir").mkdir()
    (d / "dir" / "inner").write_bytes(b"I")
    assert _renameat2(d / "a", d / "b", RENAME_NOREPLACE) == errno.EEXIST
    assert _renameat2(d / "a", d / "c", RENAME_NOREPLACE) == 0
    assert _renameat2(d / "c", d / "dir", RENAME_EXCHANGE) == 0  # a file and a directory swap
    assert (d / "dir").read_bytes() == b"A" and (d / "c" / "inner").read_bytes() == b"I"
    assert _renameat2(d / "b", d / "nothing", RENAME_EXCHANGE) == errno.ENOENT
    # Whiteouts (overlayfs) are not supported: a clean EINVAL, and nothing moved. Taken as a
    # plain rename, it would leave no whiteout, and an rmdir that must fail would succeed.
    (d / "c" / "wh").write_bytes(b"W")
    assert _renameat2(d / "c" / "wh", d / "wh2", RENAME_WHITEOUT) == errno.EINVAL
    assert (d / "c" / "wh").read_bytes() == b"W" and not (d / "wh2").exists()
    mount.remount()
    assert sorted(os.listdir(d)) == ["b", "c", "dir"]
    assert sorted(os.listdir(d / "c")) == ["inner", "wh"]
    assert (d / "dir").read_bytes() == b"A"


def _libc_fallocate():  # type: ignore[no-untyped-def]
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fn = libc.fallocate
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    fn.restype = ctypes.c_int

    def fallocate(fd: int, mode: int, off: int, length: int) -> int:
        if fn(fd, mode, off, length) == 0:
            return 0
        return ctypes.get_errno()

    return fallocate


FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02


def test_fallocate_works_or_is_eopnotsupp(mount: Mount) -> None:
    fallocate = _libc_fallocate()
    path = mount.mnt / "falloc"
    head = b"h" * 10_000
    path.write_bytes(head)
    fd = os.open(path, os.O_RDWR)
    try:
        err = fallocate(fd, 0, 0, 1 << 20)
        assert err in (0, errno.EOPNOTSUPP), errno.errorcode.get(err, err)
        if err == 0:
            assert os.fstat(fd).st_size == 1 << 20
            assert os.pread(fd, 1 << 20, 0) == head + bytes((1 << 20) - len(head))
        else:
            assert os.fstat(fd).st_size == len(head)
        before = os.pread(fd, 1 << 21, 0)
        err = fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 4096, 4096)
        assert err in (0, errno.EOPNOTSUPP), errno.errorcode.get(err, err)
        after = os.pread(fd, 1 << 21, 0)
        if err == 0:
            assert after == before[:4096] + bytes(4096) + before[8192:]
        else:
            assert after == before
        size_now = os.fstat(fd).st_size
    finally:
        os.close(fd)
    # glibc's posix_fallocate falls back to writing zeros, so it must work either way.
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, 3 << 20)
        assert os.fstat(fd).st_size == 3 << 20
    finally:
        os.close(fd)
    content = path.read_bytes()
    assert content[:size_now] == after[:size_now]
    assert content[size_now:] == bytes((3 << 20) - size_now)


def test_mmap_read_equals_content(mount: Mount) -> None:
    data = random.Random(3).randbytes(3 * 1024 * 1024 + 123)
    path = mount.mnt / "mapped"
    path.write_bytes(data)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        assert len(mm) == len(data)
        assert mm[:] == data
        assert mm[len(data) - 5000 :] == data[-5000:]
    mount.remount()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
        assert mm[:] == data  # MAP_PRIVATE


# -- metadata ----------------------------------------------------------------------------------


def test_statfs_reports_nvme_free_space(mount: Mount) -> None:
    through = os.statvfs(mount.mnt)
    nvme = os.statvfs(mount.nvme)
    assert through.f_bsize > 0 and through.f_frsize > 0
    free_mount = through.f_bavail * through.f_frsize
    free_nvme = nvme.f_bavail * nvme.f_frsize
    # The daemon may hold back a reserve; within 5% (or 1 GiB) of the NVME's own figure.
    slack = max(free_nvme // 20, 1 << 30)
    assert abs(free_mount - free_nvme) <= slack, (free_mount, free_nvme)
    total_mount = through.f_blocks * through.f_frsize
    assert total_mount >= free_mount > 0


def test_chmod_chown_utime_ns_precision(mount: Mount) -> None:
    p = mount.mnt / "meta"
    p.write_bytes(b"x")
    d = mount.mnt / "dir"
    d.mkdir()
    os.symlink("meta", mount.mnt / "link")
    for mode in (0o000, 0o600, 0o644, 0o755, 0o777, 0o4755, 0o2755, 0o1777):
        os.chmod(p, mode)
        assert stat.S_IMODE(os.stat(p).st_mode) == mode, oct(mode)
    os.chmod(d, 0o1777)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o1777
    os.chown(p, 1000, 1001)
    st = os.stat(p)
    assert (st.st_uid, st.st_gid) == (1000, 1001)
    os.chown(mount.mnt / "link", 1002, 1003, follow_symlinks=False)
    st = os.lstat(mount.mnt / "link")
    assert (st.st_uid, st.st_gid) == (1002, 1003)
    assert (os.stat(p).st_uid, os.stat(p).st_gid) == (1000, 1001)

    times = {
        p: (1_234_567_890_123_456_789, 1_600_000_000_987_654_321),
        d: (1_000_000_000_000_000_001, 1_999_999_999_999_999_999),
    }
    for path, ns in times.items():
        os.utime(path, ns=ns)
    link_ns = (1_500_000_000_000_000_007, 1_500_000_000_000_000_009)
    os.utime(mount.mnt / "link", ns=link_ns, follow_symlinks=False)
    before = time.time_ns()
    (mount.mnt / "touched").write_bytes(b"")
    os.utime(mount.mnt / "touched")  # now

    def check() -> None:
        for path, (_, mtime) in times.items():
            assert os.stat(path).st_mtime_ns == mtime, path
        assert os.lstat(mount.mnt / "link").st_mtime_ns == link_ns[1]
        assert os.stat(p).st_mtime_ns == times[p][1]  # the link's utime left its target alone
        touched = os.stat(mount.mnt / "touched").st_mtime_ns
        assert before - 2_000_000_000 <= touched <= time.time_ns() + 2_000_000_000
        st = os.stat(p)
        assert (st.st_uid, st.st_gid) == (1000, 1001)

    check()
    mount.remount()
    check()
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o1777
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o1777


def test_xattrs_round_trip_move_ctime_and_survive_sigkill(mount: Mount) -> None:
    f = mount.mnt / "x"
    f.write_bytes(b"data")
    c0 = os.stat(f).st_ctime_ns
    time.sleep(0.01)
    os.setxattr(f, "user.a", b"1")
    os.setxattr(f, "user.b", b"\x00" * 65536)  # the largest value
    c1 = os.stat(f).st_ctime_ns
    assert c1 > c0, "setxattr must change ctime"
    assert os.getxattr(f, "user.a") == b"1"
    assert sorted(os.listxattr(f)) == ["user.a", "user.b"]
    with pytest.raises(OSError) as exc:
        os.getxattr(f, "user.none")
    check_errno(exc.value, errno.ENODATA)
    with pytest.raises(OSError) as exc:
        os.setxattr(f, "user.big", b"v" * 65537)
    check_errno(exc.value, errno.E2BIG)
    with pytest.raises(OSError) as exc:
        os.setxattr(f, "user." + "n" * 251, b"v")  # a 256-byte name
    check_errno(exc.value, errno.ERANGE)
    with pytest.raises(OSError) as exc:
        os.setxattr(f, "user.a", b"2", os.XATTR_CREATE)
    check_errno(exc.value, errno.EEXIST)
    time.sleep(0.01)
    os.removexattr(f, "user.b")
    assert os.stat(f).st_ctime_ns > c1, "removexattr must change ctime"
    os.setxattr(f, "user.a", b"acknowledged")
    mount.kill()  # an acknowledged xattr change survives a SIGKILL of the daemon
    mount.remount()
    assert os.listxattr(f) == ["user.a"]
    assert os.getxattr(f, "user.a") == b"acknowledged"


def test_cp_a_into_the_mount_keeps_modes_and_acls_are_not_stored(mount: Mount,
                                                                   tmp_path: Path) -> None:
    """cp -a creates files 0600 and directories 0700, then copies the source's ACL; if the
    filesystem stored system.posix_acl_* as plain xattrs, the modes would stay 0600/0700."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    modes = {"sub": 0o755, "sub/run.sh": 0o755, "sub/data.bin": 0o644, "secret": 0o600,
             "shared": 0o664}
    for name, mode in modes.items():
        p = src / name
        if not p.exists():
            p.write_bytes(name.encode() * 100)
        os.chmod(p, mode)
    subprocess.run(["cp", "-a", str(src), str(mount.mnt / "copy")], check=True)
    for name, mode in modes.items():
        got = os.stat(mount.mnt / "copy" / name)
        assert stat.S_IMODE(got.st_mode) == mode, (name, oct(got.st_mode))
        assert not [n for n in os.listxattr(mount.mnt / "copy" / name)
                    if n.startswith("system.posix_acl")]
    target = mount.mnt / "copy" / "secret"
    # a minimal access ACL (user::rw- group::r-- other::r--) in the kernel's xattr encoding
    acl = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, 0xFFFFFFFF)
                                          for tag, perm in ((0x01, 6), (0x04, 4), (0x20, 4)))
    with pytest.raises(OSError) as exc:
        os.setxattr(target, "system.posix_acl_access", acl)
    check_errno(exc.value, errno.EOPNOTSUPP)
    with pytest.raises(OSError) as exc:  # the kernel turns the EOPNOTSUPP into "no ACL"
        os.getxattr(target, "system.posix_acl_access")
    check_errno(exc.value, errno.EOPNOTSUPP, errno.ENODATA)
    os.setxattr(target, "user.kept", b"v")  # other xattrs still work
    assert os.getxattr(target, "user.kept") == b"v"


def test_no_selinux_labels_so_ls_l_asks_once_per_mount_not_once_per_file(mount: Mount) -> None:
    """`ls -l` reads security.selinux of every file unless the first read says the
    filesystem has no labels (EOPNOTSUPP); ENODATA cost a round trip to the daemon per
    file (100,000 files: 10.5 s, now 0.7-1.1 s). Other security.* names still work."""
    f = mount.mnt / "labelled"
    f.write_bytes(b"x")
    for call in (lambda: os.getxattr(f, "security.selinux"),
                 lambda: os.setxattr(f, "security.selinux", b"system_u:object_r:tmp_t:s0")):
        with pytest.raises(OSError) as exc:
            call()
        check_errno(exc.value, errno.EOPNOTSUPP)
    os.setxattr(f, "security.other", b"v")
    assert os.getxattr(f, "security.other") == b"v"
    assert os.listxattr(f) == ["security.other"]


def test_mtime_changes_on_write(mount: Mount) -> None:
    p = mount.mnt / "w"
    p.write_bytes(b"a")
    os.utime(p, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    with open(p, "r+b") as f:
        f.write(b"b")
    assert os.stat(p).st_mtime_ns > 1_000_000_000_000_000_000
    os.utime(p, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    os.truncate(p, 0)
    assert os.stat(p).st_mtime_ns > 1_000_000_000_000_000_000


OWNER_CHILD = textwrap.dedent(
    """
    import errno, json, os, sys
    path, uid, gid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)  # before dropping privileges: the
    os.setgroups([])                                    # pytest tmp dirs above are 0700
    os.setgid(gid)
    os.setuid(uid)
    out = {}
    def attempt(key, fn):
        try:
            out[key] = fn()
        except OSError as e:
            out[key] = errno.errorcode.get(e.errno, e.errno)
    def create():
        fd = os.open(f"file-{uid}", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=dfd)
        os.write(fd, b"by %d" % uid)
        os.close(fd)
        return "ok"
    attempt("create", create)
    attempt("mkdir", lambda: os.mkdir(f"dir-{uid}", 0o755, dir_fd=dfd) or "ok")
    def write_other():
        fd = os.open("file-1000", os.O_WRONLY | os.O_APPEND, dir_fd=dfd)
        os.close(fd)
        return "ok"
    attempt("write_other", write_other)
    def write_setid(name):
        fd = os.open(name, os.O_WRONLY, dir_fd=dfd)  # write-only: the direct-I/O path
        os.write(fd, b"x")
        os.close(fd)
        return "ok"
    attempt("write_setid", lambda: write_setid("setid"))
    attempt("write_setgid_noexec", lambda: write_setid("setgid-noexec"))
    attempt("unlink_root_file_in_sticky", lambda: os.unlink("rootfile", dir_fd=dfd) or "ok")
    print(json.dumps(out))
    """
)


def test_files_get_the_callers_uid_and_gid_and_writes_strip_setid(make_mount: MakeMount) -> None:
    m = make_mount(extra_args=["--allow-other"])
    shared = m.mnt / "open"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # world-writable and sticky, like /tmp
    (shared / "rootfile").write_bytes(b"root's")
    st = os.stat(shared / "rootfile")
    assert (st.st_uid, st.st_gid) == (0, 0)
    # Setuid/setgid files anyone may write: a write by another user strips the bits, as on
    # a local filesystem (setgid stays where group execute is off: a locking mark, not a
    # setgid), and root's own write keeps them.
    for name, mode in (("setid", 0o6777), ("setgid-noexec", 0o2666), ("root-setid", 0o4777)):
        (shared / name).write_bytes(b"")
        os.chmod(shared / name, mode)
    with open(shared / "root-setid", "wb") as f:
        f.write(b"root writes")
    assert stat.S_IMODE(os.stat(shared / "root-setid").st_mode) == 0o4777

    def as_user(uid: int, gid: int) -> dict[str, str]:
        res = subprocess.run(
            [sys.executable, "-c", OWNER_CHILD, str(shared), str(uid), str(gid)],
            capture_output=True, text=True, timeout=60, check=False,
        )
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)

    out = as_user(1000, 1000)
    assert out["create"] == "ok" and out["mkdir"] == "ok", out
    assert out["write_other"] == "ok"  # its own file
    assert out["unlink_root_file_in_sticky"] == "EPERM", out  # sticky dir, not the owner
    assert out["write_setid"] == out["write_setgid_noexec"] == "ok", out
    # coreutils' stat asks the kernel for the mode alone (statx mask): its cached copy must
    # have been dropped, not only the size and times a write makes stale
    mode_only = subprocess.run(["stat", "-c", "%a", str(shared / "setid")],
                               capture_output=True, text=True, check=True).stdout.strip()
    assert mode_only == "777"
    assert stat.S_IMODE(os.stat(shared / "setid").st_mode) == 0o777
    assert stat.S_IMODE(os.stat(shared / "setgid-noexec").st_mode) == 0o2666
    for name in ("file-1000", "dir-1000"):
        st = os.stat(shared / name)
        assert (st.st_uid, st.st_gid) == (1000, 1000), name
    assert (shared / "file-1000").read_bytes() == b"by 1000"

    out = as_user(1001, 1001)
    assert out["create"] == "ok", out
    # default_permissions: the kernel checks modes, so another user cannot write a 0644 file.
    assert out["write_other"] == "EACCES", out
    st = os.stat(shared / "file-1001")
    assert (st.st_uid, st.st_gid) == (1001, 1001)

    m.remount()
    for uid in (1000, 1001):
        st = os.stat(shared / f"file-{uid}")
        assert (st.st_uid, st.st_gid) == (uid, uid)
    assert stat.S_IMODE(os.stat(shared / "setid").st_mode) == 0o777
    assert stat.S_IMODE(os.stat(shared / "root-setid").st_mode) == 0o4777


# -- checkpoint writer patterns ----------------------------------------------------------------


def _zip_members() -> dict[str, bytes]:
    rng = random.Random(5)
    return {
        "archive/data.pkl": rng.randbytes(777),
        "archive/byteorder": b"little",
        "archive/data/0": rng.randbytes(5 * 1024 * 1024 + 3),
        "archive/data/1": b"",
        "archive/data/2": rng.randbytes(65_537),
        "archive/version": b"3\n",
    }


def test_torch_save_pattern_zip_with_seek_back(mount: Mount) -> None:
    """torch.save writes a stored zip through a seekable file: each member's local header is
    rewritten after its data (seek back, overwrite CRC and sizes, seek forward)."""
    members = _zip_members()

    def save(path: Path) -> None:
        with open(path, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as zf:
            for name, data in members.items():
                info = zipfile.ZipInfo(name, date_time=(2024, 1, 2, 3, 4, 6))
                with zf.open(info, "w", force_zip64=len(data) > 4 << 20) as w:
                    for off in range(0, len(data), 1 << 16):
                        w.write(data[off : off + (1 << 16)])

    path = mount.mnt / "model.pt"
    save(path)
    host_copy = mount.root / "model-host.pt"
    save(host_copy)

    def check() -> None:
        assert path.read_bytes() == host_copy.read_bytes()  # byte-identical to a host write
        with zipfile.ZipFile(path) as zf:
            assert zf.testzip() is None
            assert zf.namelist() == list(members)
            for name, data in members.items():
                assert zf.read(name) == data

    check()
    mount.remount()
    check()


def test_dcp_pattern_metadata_tmp_fsync_rename(mount: Mount) -> None:
    """torch.distributed.checkpoint: shards written in parallel, then `.metadata.tmp` written,
    fsynced and renamed over `.metadata`."""
    ckpt = mount.mnt / "step_100"
    ckpt.mkdir()
    shards = {f"__{r}_0.distcp": random.Random(r).randbytes(1_500_000 + r) for r in range(4)}

    def write_shard(name: str) -> None:
        with open(ckpt / name, "wb") as f:
            f.write(shards[name])
            f.flush()
            os.fsync(f.fileno())

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(write_shard, shards))
    for version in (1, 2):
        meta = json.dumps({"version": version, "shards": sorted(shards)}).encode() * 50
        tmp = ckpt / ".metadata.tmp"
        with open(tmp, "wb") as f:
            f.write(meta)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, ckpt / ".metadata")
        dfd = os.open(ckpt, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        assert (ckpt / ".metadata").read_bytes() == meta
        assert not tmp.exists()

    def check() -> None:
        assert sorted(os.listdir(ckpt)) == sorted([".metadata", *shards])
        assert (ckpt / ".metadata").read_bytes() == meta
        for name, data in shards.items():
            assert (ckpt / name).read_bytes() == data

    check()
    mount.remount()
    check()


def test_hf_pattern_tmp_checkpoint_dir_rename(mount: Mount) -> None:
    """HF Trainer: everything written under `tmp-checkpoint-5/`, then the directory renamed to
    `checkpoint-5/`; an older checkpoint rotated away with rmtree."""
    out = mount.mnt / "run"
    out.mkdir()
    rng = random.Random(9)

    def save(step: int) -> dict[str, bytes]:
        tmp = out / f"tmp-checkpoint-{step}"
        tmp.mkdir()
        files = {
            "model.safetensors": rng.randbytes(2_000_000),
            "config.json": json.dumps({"step": step}).encode(),
            "trainer_state.json": json.dumps({"global_step": step, "log": list(range(50))})
            .encode(),
            "rng_state.pth": rng.randbytes(14_000),
        }
        for name, data in files.items():
            with open(tmp / name, "wb") as f:
                f.write(data)
        with zipfile.ZipFile(tmp / "optimizer.pt", "w") as zf:
            zf.writestr("optimizer/data/0", rng.randbytes(300_000))
        files["optimizer.pt"] = (tmp / "optimizer.pt").read_bytes()
        os.rename(tmp, out / f"checkpoint-{step}")
        return files

    saved = {step: save(step) for step in (3, 5)}
    shutil.rmtree(out / "checkpoint-3")
    del saved[3]

    def check() -> None:
        assert os.listdir(out) == ["checkpoint-5"]
        d = out / "checkpoint-5"
        assert sorted(os.listdir(d)) == sorted(saved[5])
        for name, data in saved[5].items():
            assert (d / name).read_bytes() == data
        assert os.stat(d).st_nlink == 2

    check()
    mount.remount()
    check()
    digest = hashlib.sha256((out / "checkpoint-5" / "model.safetensors").read_bytes()).hexdigest()
    assert digest == hashlib.sha256(saved[5]["model.safetensors"]).hexdigest()


def _getdents(fd: int, size: int = 1024) -> list[str]:
    """One getdents64(2) call: the names of the next entries that fit in `size` bytes."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(size)
    n = libc.syscall(217, fd, buf, size)  # SYS_getdents64 on x86-64
    if n < 0:
        raise OSError(ctypes.get_errno(), "getdents64")
    raw, out, pos = buf.raw[:n], [], 0
    while pos < n:
        reclen = int.from_bytes(raw[pos + 16:pos + 18], "little")
        out.append(raw[pos + 19:pos + reclen].split(b"\0", 1)[0].decode())
        pos += reclen
    return out


def test_a_name_replaced_by_rename_stays_in_a_listing_in_progress(mount: Mount) -> None:
    """`os.replace("latest.tmp", "latest")` while another process lists the directory: as on
    ext4, `latest` is listed (it never stopped existing), once."""
    d = mount.mnt / "ckpt"
    d.mkdir()
    for i in range(50):
        (d / f"shard{i:04d}").touch()
    (d / "latest").write_text("1")
    for i in range(50, 100):
        (d / f"shard{i:04d}").touch()
    (d / "latest.tmp").write_text("2")
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        seen = _getdents(fd)
        assert "latest" not in seen  # the listing has not reached it yet
        os.replace(d / "latest.tmp", d / "latest")
        while batch := _getdents(fd):
            seen += batch
    finally:
        os.close(fd)
    assert seen.count("latest") == 1, seen
    assert "latest.tmp" not in seen
    assert (d / "latest").read_text() == "2"


def test_times_beyond_what_a_record_holds_are_clamped_not_eio(mount: Mount) -> None:
    f = mount.mnt / "t"
    f.touch()
    os.utime(f, ns=(2 ** 34 * 10 ** 9, -(2 ** 34) * 10 ** 9))  # year ~2514 and ~1425
    st = os.stat(f)
    assert st.st_atime_ns > 9 * 10 ** 18  # 2262, the last moment a record holds
    assert st.st_mtime_ns < -9 * 10 ** 18  # 1677
    os.utime(f, ns=(10 ** 18, 10 ** 18))
    assert os.stat(f).st_mtime_ns == 10 ** 18


def test_o_trunc_moves_an_empty_files_times_and_o_rdonly_o_trunc_truncates(
        mount: Mount) -> None:
    stamp = mount.mnt / "stamp"
    stamp.touch()
    os.utime(stamp, ns=(10 ** 18, 10 ** 18))
    os.close(os.open(stamp, os.O_WRONLY | os.O_TRUNC))  # `: > stamp`
    assert os.stat(stamp).st_mtime_ns > 10 ** 18
    f = mount.mnt / "ro"
    f.write_bytes(b"x" * 100)
    os.close(os.open(f, os.O_RDONLY | os.O_TRUNC))
    assert os.stat(f).st_size == 0


def test_dotdot_of_a_directory_known_from_a_listing_is_its_parent(mount: Mount) -> None:
    (mount.mnt / "d" / "sub").mkdir(parents=True)
    mount.remount()  # the daemon knows no parents; the kernel learns `sub` from a listing
    os.listdir(mount.mnt / "d")
    fd = os.open(mount.mnt / "d" / "sub", os.O_RDONLY | os.O_DIRECTORY)
    try:
        names = []
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(4096)
        n = libc.syscall(217, fd, buf, 4096)
        raw, pos = buf.raw[:n], 0
        while pos < n:
            ino = int.from_bytes(raw[pos:pos + 8], "little")
            reclen = int.from_bytes(raw[pos + 16:pos + 18], "little")
            names.append((raw[pos + 19:pos + reclen].split(b"\0", 1)[0], ino))
            pos += reclen
    finally:
        os.close(fd)
    assert dict(names)[b".."] == os.stat(mount.mnt / "d").st_ino


def test_rename_exchange_changes_both_inodes_ctime(mount: Mount) -> None:
    a, b = mount.mnt / "a", mount.mnt / "b"
    a.write_text("a")
    b.write_text("b")
    before = {p.name: os.stat(p).st_ctime_ns for p in (a, b)}
    time.sleep(0.05)
    libc = ctypes.CDLL(None, use_errno=True)
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    assert libc.renameat2(AT_FDCWD, bytes(a), AT_FDCWD, bytes(b), RENAME_EXCHANGE) == 0
    assert a.read_text() == "b" and b.read_text() == "a"
    # the inode that was "a" is now "b"
    assert os.stat(b).st_ctime_ns > before["a"]
    assert os.stat(a).st_ctime_ns > before["b"]


def test_xattr_names_outside_linux_namespaces_are_refused(mount: Mount) -> None:
    f = mount.mnt / "x"
    f.touch()
    with pytest.raises(OSError) as e:
        os.setxattr(f, "bogus.a", b"1")
    check_errno(e.value, errno.EOPNOTSUPP)
    with pytest.raises(OSError) as e:
        os.setxattr(f, "user.", b"1")
    check_errno(e.value, errno.EINVAL)
    os.setxattr(f, "user.ok", b"1")
    assert os.getxattr(f, "user.ok") == b"1"


def test_many_writers_of_unaligned_megabyte_buffers(mount: Mount) -> None:
    """48 threads, each writing 1 MiB at a time from a `bytes` buffer (which does not start on
    a page, so each write arrives as two requests of very different sizes): every write
    succeeds and reads back. On a loaded machine the log's queue used to take a direct record
    with every staging buffer in use (EIO for 35 of 576 writes, an IndexError in the daemon);
    whether the queue fills that far here depends on timing, so the deterministic check is
    test_log_pipeline.py's test_unaligned_writes_never_run_out_of_staging_buffers."""
    def writer(k: int) -> str:
        path = mount.mnt / f"big{k}"
        buf = random.Random(k).randbytes(1 << 20)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for j in range(6):
                assert os.pwrite(fd, buf, j << 20) == len(buf)
        finally:
            os.close(fd)
        return hashlib.sha256(buf * 6).hexdigest()

    with ThreadPoolExecutor(48) as pool:
        want = list(pool.map(writer, range(48)))
    for k in range(48):
        assert hashlib.sha256((mount.mnt / f"big{k}").read_bytes()).hexdigest() == want[k]
    assert "Traceback" not in mount.log_tail()


def test_a_write_removes_file_capabilities_whoever_writes(mount: Mount) -> None:
    """As the kernel's file_remove_privs() does before a cached write, any write (root's
    too) removes security.capability. Write-only opens bypass the kernel's cache (direct_io),
    where the kernel leaves that to the filesystem: `echo x >> f` kept them (xfstests
    generic/093)."""
    import struct

    caps = struct.pack("<IIIII", 0x02000001, 1, 0, 0, 0)  # VFS_CAP_REVISION_2, cap_chown=ep
    for name, flags in (("append", os.O_WRONLY | os.O_APPEND), ("wronly", os.O_WRONLY),
                        ("rdwr", os.O_RDWR)):
        path = mount.mnt / name
        path.write_bytes(b"data1\n")
        os.setxattr(path, "security.capability", caps)
        assert os.getxattr(path, "security.capability") == caps
        ctime = os.stat(path).st_ctime_ns
        fd = os.open(path, flags)
        try:
            os.pwrite(fd, b"x", 6) if not flags & os.O_APPEND else os.write(fd, b"x")
        finally:
            os.close(fd)
        with pytest.raises(OSError) as gone:
            os.getxattr(path, "security.capability")
        check_errno(gone.value, errno.ENODATA)
        assert os.stat(path).st_ctime_ns > ctime, name
        assert path.read_bytes() == b"data1\nx"
    # a write-only open that writes nothing keeps them
    path = mount.mnt / "untouched"
    path.write_bytes(b"d")
    os.setxattr(path, "security.capability", caps)
    os.close(os.open(path, os.O_WRONLY))
    assert os.getxattr(path, "security.capability") == caps


# -- what the daemon remembers per inode -------------------------------------------------------


def _tracked(mount: Mount) -> dict:
    res = run_cli("status", mount.mnt, "--json")
    assert res.rc == 0, res.err
    return json.loads(res.out)["inodes_tracked"]


def test_written_around_the_cache_then_read_cached_sees_new_bytes_and_is_not_remembered_forever(
        mount: Mount) -> None:
    d = mount.mnt / "step_1"
    d.mkdir()
    # A reader holds the file's old bytes in the page cache; a write-only open (FUSE direct_io)
    # then writes new ones around it. The next cached open must drop the stale pages.
    f = d / "shard"
    f.write_bytes(b"old" * 4096)
    keep = os.open(f, os.O_RDONLY)  # holds the inode (and its cache) in the kernel
    try:
        assert os.pread(keep, 12288, 0) == b"old" * 4096
        fd = os.open(f, os.O_WRONLY)
        os.pwrite(fd, b"new" * 4096, 0)
        os.close(fd)
        with open(f, "rb") as g:
            assert g.read() == b"new" * 4096
    finally:
        os.close(keep)
    # Files written once and never opened again (a checkpoint's shards): once the kernel
    # forgets their inodes, the daemon must forget them too, not keep one entry per file
    # for as long as it runs.
    for i in range(300):
        fd = os.open(d / f"__0_{i}.distcp", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"%d" % i * 1000)
        os.close(fd)
    assert _tracked(mount)["written_direct"] >= 300
    with open("/proc/sys/vm/drop_caches", "w") as dc:
        dc.write("2\n")  # dentries and inodes: the kernel sends FORGET for each
    t = wait_for(lambda: (lambda s: s if s["written_direct"] <= s["kernel"] + 1 and
                          s["kernel"] < 50 else None)(_tracked(mount)),
                 timeout=30, what="the daemon to forget the inodes the kernel forgot",
                 interval=0.2)
    assert t["open"] == 0 and t["open_direct"] == 0, t
    for i in (0, 17, 299):
        assert (d / f"__0_{i}.distcp").read_bytes() == b"%d" % i * 1000
