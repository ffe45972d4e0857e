"""A file read sequentially has its next records asked for ahead of the reads that want them
(ckptfs/namespace.py, _read_ahead): local records into the page cache, records on SHARED into
the reader's cache, on the node that wrote them and on a fresh node. Reads return exact bytes
either way, and a damaged record ahead is EIO for the read that reaches it, never wrong bytes
for it or the reads before it."""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from mounting import MakeMount
from test_shared_support import (
    blob,
    control,
    decode_manifest,
    drop_caches,
    manifests,
    start_node,
    status,
    store_root,
    wait_published,
)

MiB = 1 << 20


def write_files(mnt: Path, files: dict[str, bytes]) -> None:
    """Writes 1 MiB at a time, round robin over the files, so their records interleave in
    the segments the way several ranks' do; from memory 8 bytes past a page, as a `bytes`
    object's or a tensor's usually is, so each write is a record of 1 MiB less 8 bytes and
    one of 8 bytes. (From a fresh `bytes` slice each time, that was up to malloc.)"""
    fds = {rel: os.open(mnt / rel, os.O_CREAT | os.O_WRONLY, 0o644) for rel in files}
    buf = mmap.mmap(-1, MiB + 4096)
    try:
        with memoryview(buf) as view:
            for off in range(0, max(map(len, files.values())), MiB):
                for rel, data in files.items():
                    if off < len(data):
                        n = min(MiB, len(data) - off)
                        view[8:8 + n] = data[off:off + n]
                        os.pwrite(fds[rel], view[8:8 + n], off)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        buf.close()
        for fd in fds.values():
            os.close(fd)


def read_chunks(path: Path) -> list[bytes]:
    out = []
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(MiB):
            out.append(chunk)
    return out


def assert_sequential_reads(mnt: Path, files: dict[str, bytes], what: str) -> None:
    for rel, data in files.items():
        got = b"".join(read_chunks(mnt / rel))
        assert got == data, f"{what}: {rel} read back {len(got)} bytes, differing from the source"


def test_sequential_reads_ask_ahead_locally_from_shared_and_on_a_fresh_node(
        make_mount: MakeMount) -> None:
    a = start_node(make_mount, "a", "n0")
    (a.mnt / "step_1").mkdir()
    files = {f"step_1/rank{r}.bin": blob(f"ra{r}", 6 * MiB + 4099 * r) for r in range(3)}
    write_files(a.mnt, files)

    drop_caches()
    misses = status(a)["read_misses"]
    assert_sequential_reads(a.mnt, files, "local records")
    ahead = status(a)["read_ahead"]
    assert ahead["local"] >= 3 * 3, ahead  # each file's records past the first few reads
    # records written around the page cache, then the page cache dropped: the first read
    # waited for the disk on a worker thread, not on the request thread (later ones may find
    # their pages read already, by read-ahead or by the kernel's readahead of the segment)
    assert status(a)["read_misses"] >= misses + 1, status(a)["read_misses"]

    wait_published(a.mnt / "step_1")
    assert control(a, {"op": "evict", "all": True})["evicted"] >= 1
    drop_caches()
    assert_sequential_reads(a.mnt, files, "records on SHARED after eviction")
    st = status(a)
    assert st["read_ahead"]["remote"] >= 3 * 2, st["read_ahead"]
    assert st["read_ahead"]["remote_failed"] == 0 and st["corrupt_reads"] == 0, st
    a.unmount()

    # a fresh node names n0's objects by ids of its own (vsegs): read-ahead must resolve them
    b = start_node(make_mount, "b", "n1", shared=a.shared)
    drop_caches()
    assert_sequential_reads(b.mnt, files, "a fresh node")
    st = status(b)
    assert st["read_ahead"]["remote"] >= 3 * 2, st["read_ahead"]
    assert st["read_ahead"]["remote_failed"] == 0 and st["corrupt_reads"] == 0, st


def test_a_damaged_record_ahead_is_eio_where_it_is_and_nowhere_else(
        make_mount: MakeMount) -> None:
    a = start_node(make_mount, "a", "n0")
    data = blob("damaged", 8 * MiB)
    write_files(a.mnt, {"f.bin": data})
    wait_published(a.mnt)
    body = decode_manifest(manifests(a.shared, "n0")[-1].read_bytes())
    entry = next(e for e in body["entries"] if e["path"] == "f.bin")
    bad = 5
    ext = next(x for x in entry["extents"] if x[0] <= bad * MiB < x[0] + x[1])
    off, length, obj, pos, skip, _rec_len = ext
    from ckptfs import segment as fmt

    node, seg = obj.rsplit("/", 1)
    with open(store_root(a.shared) / "objects" / node / f"{seg}.seg", "r+b") as f:
        at = pos + fmt.RECORD_HEADER_SIZE + skip + (bad * MiB - off) + 100
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))
    assert control(a, {"op": "evict", "all": True})["evicted"] >= 1
    drop_caches()

    got = []
    with open(a.mnt / "f.bin", "rb", buffering=0) as f:
        with pytest.raises(OSError) as exc:
            while chunk := f.read(MiB):
                got.append(chunk)
        assert exc.value.errno == errno.EIO, exc.value
        # the records after the damaged one are unharmed
        after = (bad + 2) * MiB
        assert os.pread(f.fileno(), MiB, after) == data[after:after + MiB]
    # every read before the damaged record returned exact bytes; the first to reach it failed
    assert len(got) == off // MiB, (len(got), ext)
    assert b"".join(got) == data[:len(got) * MiB]
    st = status(a)
    assert st["corrupt_reads"] >= 1, st
    assert a.alive, a.log_tail()


def test_a_restore_from_shared_reads_each_record_once(make_mount: MakeMount) -> None:
    """Shard-sized files written side by side, restored from SHARED: a big record is fetched
    alone, and the head of a record a window ended inside is kept for that record's fetch, so
    the bytes read from SHARED stay close to the bytes restored (with a 1 MiB window after
    every record, each window ended inside the next file's record, which was then fetched
    again whole: 1.45x in a storm of 256 KiB-1 MiB files, 1.51x here). What is left is the
    window after a file's small last record running over records already read. Small files
    still share windows: one fetch brings several."""
    a = start_node(make_mount, "a", "n0")
    (a.mnt / "step_1").mkdir()
    shards = {f"step_1/__{r}_{i}.distcp": blob(f"shard{r}.{i}", (300 + 97 * (4 * r + i)) << 10)
              for r in range(4) for i in range(4)}
    write_files(a.mnt, shards)  # 1 MiB records and the rest, ranks interleaved
    small = {f"step_1/small{i}": blob(f"small{i}", 5000 + 37 * i) for i in range(64)}
    for rel, data in small.items():
        (a.mnt / rel).write_bytes(data)
    wait_published(a.mnt / "step_1")
    assert control(a, {"op": "evict", "all": True})["evicted"] >= 1
    drop_caches()

    before = status(a)["shared_bytes_read"]
    assert_sequential_reads(a.mnt, shards, "shards restored from SHARED")
    restored = sum(map(len, shards.values()))
    fetched = status(a)["shared_bytes_read"] - before
    assert restored <= fetched <= restored * 1.10, (fetched, restored)

    before = status(a)["shared_bytes_read"]
    assert_sequential_reads(a.mnt, small, "small files restored from SHARED")
    fetched = status(a)["shared_bytes_read"] - before
    # 64 records of ~6 KiB: a handful of 1 MiB windows, not 64 fetches of their own
    assert fetched <= 3 * (1 << 20), fetched
    assert status(a)["corrupt_reads"] == 0


def test_ranks_restoring_at_once_from_shared_read_each_record_once(
        make_mount: MakeMount) -> None:
    """8 ranks' files written 1 MiB at a time from buffers that do not start on a page (a
    `bytes` slice, as a tensor's storage): each write is two records, 1 MiB less a few bytes
    and those few bytes, ranks interleaved in the segments. Restored from SHARED by all ranks
    at once, a blind 1 MiB window after each few-byte record read the next rank's big record
    too, which that rank's own fetch was reading already: 1.8x the bytes restored (and as
    much more CPU in copies). A window now stops before a big record."""
    a = start_node(make_mount, "a", "n0")
    (a.mnt / "step_1").mkdir()
    files = {f"step_1/__{r}_0.distcp": blob(f"at-once{r}", 6 * MiB + 4096 * r) for r in range(8)}
    write_files(a.mnt, files)
    wait_published(a.mnt / "step_1")
    assert control(a, {"op": "evict", "all": True})["evicted"] >= 1
    drop_caches()

    before = status(a)["shared_bytes_read"]
    errors: list[str] = []

    def restore(rel: str, data: bytes) -> None:
        got = b"".join(read_chunks(a.mnt / rel))
        if got != data:
            errors.append(f"{rel}: {len(got)} bytes read back, differing from the source")

    threads = [threading.Thread(target=restore, args=item) for item in files.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    restored = sum(map(len, files.values()))
    fetched = status(a)["shared_bytes_read"] - before
    # (1.71x before the fix; 1.01-1.04x alone, and once 1.054x beside the rest of the suite
    # on two CPUs, where the readers run less in step; not looked into further)
    assert restored <= fetched <= restored * 1.10, (fetched / restored, fetched, restored)
    assert status(a)["corrupt_reads"] == 0


def test_a_file_read_alone_from_shared_is_fetched_further_ahead(make_mount: MakeMount) -> None:
    """One process restoring one big file from SHARED had 2 MiB, two fetches, in flight: ~50
    MB/s from an S3 endpoint 36 ms away. A file read alone now asks for up to 16 MiB ahead
    (half of what it has read, at most its share of half the reader's cache), so after 12 MiB
    read, records up to ~6 MiB past it are fetched."""
    a = start_node(make_mount, "a", "n0")
    data = blob("alone", 40 * MiB)
    buf = mmap.mmap(-1, MiB)  # page aligned: one 1 MiB record per write
    fd = os.open(a.mnt / "big.bin", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        for off in range(0, len(data), MiB):
            buf[:] = data[off:off + MiB]
            os.write(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)
    wait_published(a.mnt)
    assert control(a, {"op": "evict", "all": True})["evicted"] >= 1
    drop_caches()

    before = status(a)["shared_bytes_read"]
    fd = os.open(a.mnt / "big.bin", os.O_RDONLY)
    try:
        for off in range(0, 12 * MiB, MiB):
            assert os.pread(fd, MiB, off) == data[off:off + MiB], off
        fetched = settled(lambda: status(a)["shared_bytes_read"] - before)
    finally:
        os.close(fd)
    # 2 MiB ahead (and the kernel's own 1 MiB) stopped at 15 MiB; now 17 (a window of 6 MiB,
    # asked for half a window at a time)
    assert fetched >= 16 * MiB + MiB // 2, fetched / MiB
    assert fetched <= 24 * MiB, fetched / MiB


def settled(value: Callable[[], int], quiet: float = 0.5, limit: float = 10.0) -> int:
    """value() once it has not changed for `quiet` seconds (fetches ahead finishing)."""
    deadline = time.monotonic() + limit
    last = value()
    stable_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = value()
        if now != last:
            last, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since >= quiet:
            break
    return last


def test_random_reads_ask_for_nothing_ahead(make_mount: MakeMount) -> None:
    """Reads at scattered offsets (a database, an mmap'd checkpoint's page faults) are not a
    sequential pass: no read-ahead, which would read the disk for bytes nobody asked for.
    Consecutive offsets here are at least 1 MiB apart, which earlier code took for the
    reordering of the kernel's readahead requests and answered with 8 MiB of read-ahead
    (of 4 KiB records: 2,048 fadvise calls, tens of ms of the request thread each time).
    Then a sequential pass over the same file does ask ahead."""
    a = start_node(make_mount, "a", "n0")
    data = blob("random", 16 * MiB)
    path = a.mnt / "f.bin"
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        for off in range(0, len(data), 4096):  # 4 KiB records, as a small-block writer leaves
            os.pwrite(fd, data[off:off + 4096], off)
        os.fsync(fd)
    finally:
        os.close(fd)
    drop_caches()
    before = status(a)["read_ahead"]["local"]
    order = [3, 1, 7, 5, 9, 11, 2, 13, 15, 4, 10, 6, 14, 8, 12]  # steps of 1-12 MiB
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no kernel readahead either
        for k in order:
            off = k * MiB + 8192
            assert os.pread(fd, 4096, off) == data[off:off + 4096], k
    finally:
        os.close(fd)
    assert status(a)["read_ahead"]["local"] == before, status(a)["read_ahead"]

    assert_sequential_reads(a.mnt, {"f.bin": data}, "a sequential pass")
    assert status(a)["read_ahead"]["local"] > before, status(a)["read_ahead"]


def test_a_reader_that_hops_back_does_not_ask_again_for_what_it_asked(
        make_mount: MakeMount) -> None:
    """A sequential reader whose reads now and then jump back past the sequential slack (the
    kernel's readahead of a file that is also being written does this) keeps what was asked
    for ahead: each hop used to restart read-ahead and ask for the whole window again
    (`fio --rw=readwrite --bs=4k` at 4.4 MB/s instead of 10-13)."""
    a = start_node(make_mount, "a", "n0")
    data = blob("hops", 8 * MiB)
    path = a.mnt / "f.bin"
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        for off in range(0, len(data), 4096):  # 4 KiB records
            os.pwrite(fd, data[off:off + 4096], off)
        os.fsync(fd)
    finally:
        os.close(fd)
    buf = mmap.mmap(-1, 4096)  # O_DIRECT: every read reaches the daemon, page-aligned buffer
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        before = status(a)["read_ahead"]["local"]
        off, hops, reads = 0, 0, 0
        while off < 4 * MiB:
            assert os.preadv(fd, [buf], off) == 4096 and buf[:] == data[off:off + 4096], off
            off += 4096
            reads += 1
            if reads % 64 == 0:  # every 256 KiB read, back 128 KiB: past the 64 KiB slack
                off -= 128 << 10
                hops += 1
        asked = status(a)["read_ahead"]["local"] - before
    finally:
        os.close(fd)
    assert hops >= 30, hops
    # a handful of windows (1, 2, 4, 8 MiB, one fadvise per run of adjacent records), not
    # one more window per hop
    assert asked <= 12, (asked, hops)
