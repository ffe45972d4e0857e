"""The local NVMe directory fills up: writers get ENOSPC (after --enospc-timeout), nothing that
was acknowledged before is lost or damaged, and the log replays cleanly after a SIGKILL.

NVME is a small tmpfs (which takes O_DIRECT, so big writes go the direct way and small ones the
buffered way, both into a full filesystem), SHARED a full one (nothing can be drained, so
nothing can be evicted to make room). Both are unmounted in a `finally`, after the mount.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from mounting import MakeMount, Mount, check_errno, run_cli


def sh(*cmd: str) -> None:
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, f"{' '.join(cmd)}: {res.stderr.strip()}"


def umount(target: Path) -> None:
    if subprocess.run(["umount", str(target)], check=False, capture_output=True,
                      timeout=30).returncode != 0:
        subprocess.run(["umount", "-l", str(target)], check=False, capture_output=True,
                       timeout=30)


@contextlib.contextmanager
def on_small_disks(m: Mount, nvme: str, shared: str) -> Iterator[Mount]:
    """`m` (not started) with NVME and SHARED on tmpfs filesystems of these sizes, all of it
    torn down afterwards whatever happens."""
    sh("mount", "-t", "tmpfs", "-o", f"size={nvme},mode=0755", "tmpfs", str(m.nvme))
    sh("mount", "-t", "tmpfs", "-o", f"size={shared},mode=0755", "tmpfs", str(m.shared))
    try:
        yield m
    finally:
        m.teardown()
        umount(m.nvme)
        umount(m.shared)


def write_until_full(mnt: Path, rnd: random.Random) -> tuple[dict[str, bytes], OSError]:
    """Files of 1 MiB (direct appends) and 3 KiB (buffered), each fsync'd, until one step
    fails. Returns the files whose write, fsync and close all returned, and the error."""
    done: dict[str, bytes] = {}
    for i in range(10_000):
        name = f"f{i:05d}"
        data = rnd.randbytes((1 << 20) if i % 3 else 3000)
        try:
            fd = os.open(mnt / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            return done, e
        done[name] = data
    raise AssertionError("wrote 10,000 files into a 48 MiB NVME without running out of space")


def test_full_nvme_gives_enospc_and_keeps_everything_acknowledged(make_mount: MakeMount
                                                                  ) -> None:
    m = make_mount(start=False, extra_args=("--enospc-timeout", "1"), segment_size="4M")
    sh("mount", "-t", "tmpfs", "-o", "size=48m,mode=0755", "tmpfs", str(m.nvme))
    sh("mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(m.shared))
    try:
        m.start()
        done, err = write_until_full(m.mnt, random.Random(11))
        check_errno(err, errno.ENOSPC)
        assert len(done) >= 20, f"only {len(done)} files before ENOSPC"
        print(f"{len(done)} files before ENOSPC ({err})")
        assert sum(len(d) == 1 << 20 for d in done.values()) >= 10
        for name, data in done.items():
            assert (m.mnt / name).read_bytes() == data, f"{name} differs before the kill"
        m.kill()
        m.clean_stale()
        # room for the mount's own bookkeeping at start; the log itself is unchanged
        m.start()
        for name, data in done.items():
            assert (m.mnt / name).read_bytes() == data, f"{name} differs after the SIGKILL"
        st = run_cli("status", m.mnt, "--json")
        assert st.rc == 0, st
        assert json.loads(st.out)["corrupt_reads"] == 0
        m.unmount()
    finally:
        m.teardown()
        umount(m.nvme)
        umount(m.shared)


def test_a_tiny_nvme_makes_writers_wait_before_enospc(make_mount: MakeMount) -> None:
    """On an 8 MiB NVME the free space kept back must still cover what is written between two
    measurements: a writer that fills the disk waits --enospc-timeout for room (the drain
    cannot make any), then gets ckptfs's ENOSPC, not the filesystem's at once."""
    import time

    m = make_mount(start=False, extra_args=("--enospc-timeout", "2"), segment_size="1M")
    sh("mount", "-t", "tmpfs", "-o", "size=8m,mode=0755", "tmpfs", str(m.nvme))
    sh("mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(m.shared))
    try:
        m.start()
        t0 = time.monotonic()
        _done, err = write_until_full(m.mnt, random.Random(5))
        check_errno(err, errno.ENOSPC)
        st = json.loads(run_cli("status", m.mnt, "--json").out)
        assert st["cache"]["enospc_errors"] >= 1, st["cache"]
        assert time.monotonic() - t0 >= 2, "ENOSPC without the wait"
        m.unmount()
    finally:
        m.teardown()
        umount(m.nvme)
        umount(m.shared)


def test_an_open_with_o_trunc_that_fails_on_a_full_nvme_is_not_counted_as_open(
        tmp_path: Path) -> None:
    """open(O_TRUNC) appends a SETATTR; when that fails (the log's disk is full) the open
    fails and no RELEASE follows. It used to be counted as open all the same, so once the
    file was unlinked its inode and extents stayed until the next mount. The log is on a real
    1 MiB tmpfs, filled up by the namespace's own writes; a filler file frees room after."""
    from ckptfs.errors import FsError
    from ckptfs.index import ROOT_INO, Index
    from ckptfs.log import SegmentLog
    from ckptfs.namespace import Namespace
    from ckptfs.reads import Reader
    from ckptfs.recovery import replay

    disk = tmp_path / "nvme"
    disk.mkdir()
    sh("mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(disk))
    index = None
    try:
        filler = disk / "filler"
        filler.write_bytes(b"f" * (128 << 10))
        index = Index(str(tmp_path / "index"))
        log = SegmentLog(str(disk / "segments"), "t0", 256 << 10)
        replay(index, log)
        ns = Namespace(index, log, Reader(log.path))
        index.ensure_root(0, 0, 0o755, 1)
        a = ns.create(ROOT_INO, b"a", 0o644, 0, 0)
        ns.write(a.ino, 0, b"a" * 3000)
        ns.release(a.ino)
        b = ns.create(ROOT_INO, b"b", 0o644, 0, 0)
        off = 0
        for n in (3000, 100, 1):  # until not even the smallest record fits
            with pytest.raises(OSError) as full:
                for _ in range(1000):
                    ns.write(b.ino, off, b"b" * n)
                    off += n
            check_errno(full.value, errno.ENOSPC)
        with pytest.raises((OSError, FsError)) as failed:
            ns.open(a.ino, os.O_WRONLY | os.O_TRUNC)
        assert getattr(failed.value, "errno", None) == errno.ENOSPC, failed.value
        assert a.ino not in ns.opens, "a failed open is counted as open"
        filler.unlink()
        ns.unlink(ROOT_INO, b"a", want_dir=False)
        ns.forget(a.ino, 1)  # the kernel's lookup from the create
        assert index.get_inode(a.ino) is None, "unlinked, never open, but not purged"
        log.close()
    finally:
        if index is not None:
            index.close()
        umount(disk)


def test_deleting_unpublished_files_on_a_full_nvme_makes_room_within_seconds(
        make_mount: MakeMount) -> None:
    """NVME and SHARED both full: deleting the files frees their segments once the drain
    drops them (their data died before upload) and GC deletes them. GC used to wait its grace
    (60 s) for those too, after a sleep of up to 15 s, though a segment that was never
    published has no other node to wait for: writers got ENOSPC for over a minute."""
    import time

    with on_small_disks(make_mount(start=False, extra_args=("--enospc-timeout", "1"),
                                   segment_size="4M"), "48m", "2m") as m:
        m.start()
        done, err = write_until_full(m.mnt, random.Random(3))
        check_errno(err, errno.ENOSPC)
        for name in [*done, *(p.name for p in m.mnt.iterdir() if p.name not in done)]:
            os.unlink(m.mnt / name)
        t0 = time.monotonic()
        data = random.Random(4).randbytes(8 << 20)
        while True:
            try:
                with open(m.mnt / "after", "wb") as f:
                    f.write(data)
                    os.fsync(f.fileno())
                break
            except OSError as e:
                check_errno(e, errno.ENOSPC)
                assert time.monotonic() - t0 < 25, "no room 25 s after deleting everything"
                time.sleep(0.5)
        print(f"room for 8 MiB {time.monotonic() - t0:.1f} s after the deletes")
        assert (m.mnt / "after").read_bytes() == data
        m.unmount()
