"""A disk under NVME whose flushes fail.

After a failed fdatasync, Linux may drop the pages it could not write (ext4 marks them clean),
and the next fdatasync of the same file succeeds: a program that retries its fsync is told its
data is durable when it is gone ("fsyncgate"). So ckptfs's log stops at the first failed flush:
the fsync that met it and every later write and fsync fail with EIO, and the next mount replays
what reached the disk. Here NVME is the NAS emulator with its fault switch (every fsync fails
with EIO until switched off): the device comes back, and a log that retried would say success.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest
from mounting import MakeMount
from test_shared_support import blob, cli, status

REPO = Path(__file__).resolve().parent.parent


def write_file(path: Path, data: bytes, sync: bool = True) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def test_after_a_failed_flush_no_write_or_fsync_succeeds_until_a_remount(
        make_mount: MakeMount, tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO))
    from bench.nasemu import NasEmu

    m = make_mount("a", start=False)
    with NasEmu(tmp_path / "disk", m.nvme, meta_latency_us=0, meta_ops_per_sec=0,
                bandwidth_mbps=0, direct_io="none", log_path=tmp_path / "nasemu.log") as disk:
        try:
            m.start()
            a, b, c = blob("a", 300_000), blob("b", 200_000), blob("c", 100_000)
            write_file(m.mnt / "a", a)

            disk.fail_fsyncs()
            fd = os.open(m.mnt / "b", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, b)
                with pytest.raises(OSError) as failed:
                    os.fsync(fd)
                assert failed.value.errno == errno.EIO, failed.value
                disk.fail_fsyncs(False)  # the device answers again: a retry would "succeed"
                with pytest.raises(OSError) as again:
                    os.fsync(fd)
                assert again.value.errno == errno.EIO, (
                    "a second fsync after a failed one reported success")
            finally:
                os.close(fd)
            with pytest.raises(OSError) as later:
                write_file(m.mnt / "c", c)
            assert later.value.errno == errno.EIO, later.value
            assert (m.mnt / "a").read_bytes() == a  # reads go on
            st = status(m)
            assert st["log_error"], st
            assert "LOG FAILED" in cli("status", m.mnt).stdout
            m.unmount()  # exits 0, without committing the index past the log

            m.start()  # replays what reached the disk
            assert (m.mnt / "a").read_bytes() == a
            got_b = (m.mnt / "b").read_bytes() if (m.mnt / "b").exists() else b""
            assert b.startswith(got_b), "b came back with bytes it never had"
            assert not (m.mnt / "c").exists()
            assert status(m)["log_error"] is None
            write_file(m.mnt / "d", blob("d", 50_000))  # a new mount writes again
            assert (m.mnt / "d").read_bytes() == blob("d", 50_000)
            m.unmount()
        finally:
            disk.fail_fsyncs(False)
            if m.alive:
                m.teardown()
