"""The log's writer thread (SegmentLog.append(later=...)): data records queued while the trio
thread goes on, applied in log order, and a failed write that takes the queue behind it back.
Real files, a real LMDB index, a real tmpfs for the full-disk case; no FUSE."""

from __future__ import annotations

import errno
import os
import random
import subprocess
from pathlib import Path

import pytest
import trio
import trio.testing

from ckptfs import log as logmod
from ckptfs.errors import FsError
from ckptfs.index import ROOT_INO
from test_format import make, reopen  # index, log and namespace in a directory


@pytest.fixture(autouse=True)
def direct_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Most tests here are about the writer thread's queue, which big data records take
    while the disk is behind (and with CKPTFS_BUFFERED_WRITES=0): they run with BUFFERED
    off. The tests of the buffered way, at the end, turn it on."""
    monkeypatch.setattr(logmod, "BUFFERED", False)


@pytest.mark.parametrize("unit", ["device", "4k", "refused"])
def test_queued_writes_apply_in_log_order_and_replay_the_same(tmp_path: Path,
                                                               unit: str) -> None:
    """Overlapping writes to the same ranges, big (direct) and small (buffered), several in
    the queue at once, metadata operations in between (which wait for the queue): reads see
    the writes in the order they were made, before and after a replay from the log alone.
    Big payloads are written from their own memory, placed for the device's alignment (or
    for 4 KiB); a device that refuses that ("refused": 8-byte pieces) gets them staged."""
    seg = 16 << 20
    index, log, ns = make(tmp_path, seg)
    if unit == "4k":
        log.dio_unit = logmod.ALIGN
    elif unit == "refused":
        if log.dio_unit <= 8:
            pytest.skip("this disk takes O_DIRECT writes of any 8-byte aligned memory")
        log.dio_unit = 8
    rnd = random.Random(3)
    want: dict[int, bytearray] = {}
    queued_max = creates_in_slots = 0

    async def main() -> None:
        nonlocal queued_max, creates_in_slots
        log.token = trio.lowlevel.current_trio_token()
        pending = []
        files = [ns.create(ROOT_INO, f"f{i}".encode(), 0o644, 0, 0).ino for i in range(3)]
        for ino in files:
            want[ino] = bytearray()
        for step in range(300):
            ino = rnd.choice(files)
            n = rnd.choice([1 << 20, 300 << 10, logmod.DIRECT_MIN, 100, 3000, 70000])
            off = rnd.randrange(0, 2 << 20)
            data = rnd.randbytes(n)
            ns.write(ino, off, data)
            while unit == "refused" and log.zero_copy_min and log.submitted is not None:
                # until the first refusal: that write is taken back for its writer to append
                # again, as Operations.write does (one at a time meanwhile, to keep order)
                if not await log.settle(log.submitted):
                    break
                ns.write(ino, off, data)
            buf = want[ino]
            if len(buf) < off + n:
                buf.extend(bytes(off + n - len(buf)))
            buf[off:off + n] = data
            if log.submitted is not None:
                pending.append(log.submitted)
            queued_max = max(queued_max, len(log.queued))
            if step % 37 == 36:
                # creates while a big write is queued and not started: into the slot in
                # front of it (SegmentLog._into_slot), one after the other; a symlink too
                # long for what is left of the slot ahead of the write (_ahead: the writer
                # is paused)
                log.join()
                log._pause()
                big = rnd.randbytes(1 << 20)
                ns.write(ino, 1 << 20, big)
                queued = log.submitted
                w = want[ino]
                w.extend(bytes(max(0, (2 << 20) - len(w))))
                w[1 << 20:2 << 20] = big
                slots, ahead = log.stats.records_in_slots, log.stats.records_ahead
                ns.create(ROOT_INO, f"m{step}".encode(), 0o644, 0, 0)
                ns.create(ROOT_INO, f"n{step}".encode(), 0o644, 0, 0)
                ns.symlink(ROOT_INO, f"s{step}".encode(), b"t" * 3900, 0, 0)
                if queued is not None:  # (else the segment was sealed: written at once)
                    pending.append(queued)
                    assert log.stats.records_in_slots == slots + 2
                    assert log.stats.records_ahead == ahead + 3
                    creates_in_slots += 1
                log._resume()
                # any other metadata operation: the queue is written first
                ns.setattr(ino, mode=0o600 if step % 2 else 0o644)
                assert not log.queued
            if rnd.random() < 0.3:
                for job in pending:
                    assert await log.settle(job) is False
                pending.clear()
        for job in pending:
            assert await log.settle(job) is False
        await log.sync()

    trio.run(main)
    log.token = None
    assert queued_max >= 4, "the test never had several writes queued"
    assert log.stats.records_in_slots == 2 * creates_in_slots >= 8
    assert log.stats.direct_records > 50
    if unit == "refused":
        assert log.stats.zero_copy_records == 0 and log.zero_copy_min == 0
    else:
        assert log.stats.zero_copy_records == log.stats.direct_records
    assert len(log.existing()) > 1  # crossed segment boundaries while queueing
    for ino, buf in want.items():
        assert ns.read(ino, 0, 4 << 20) == bytes(buf)
    log.close()
    index.close()
    index2, log2, ns2 = reopen(tmp_path, seg)
    for ino, buf in want.items():
        assert ns2.read(ino, 0, 4 << 20) == bytes(buf)
    log2.close()
    index2.close()


def sh(*cmd: str) -> None:
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, f"{' '.join(cmd)}: {res.stderr.strip()}"


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    d = tmp_path / "nvme"
    d.mkdir()
    sh("mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(d))
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False, capture_output=True, timeout=30)


def test_a_failed_queued_write_takes_back_the_queue_behind_it(small_tmpfs: Path) -> None:
    """The disk fills while writes are queued: the write that hit ENOSPC reports it, the ones
    queued behind it are never written and come back for a retry, the tail returns to where
    the failed one started, and the log holds exactly the writes that succeeded."""
    seg = 64 << 20
    index, log, ns = make(small_tmpfs, seg)
    f = ns.create(ROOT_INO, b"f", 0o644, 0, 0).ino
    trio.run(log.sync)
    with open(small_tmpfs / "filler", "wb") as fh:  # leave ~5 MiB
        free = os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize
        fh.write(bytes(free - (5 << 20)))
    chunks = [random.Random(i).randbytes(1 << 20) for i in range(8)]
    outcome: list[str] = []
    outcome_sync: list[int] = []
    tails: list[int] = []

    async def main() -> None:
        log.token = trio.lowlevel.current_trio_token()
        jobs = []
        for i, data in enumerate(chunks):
            try:
                ns.write(f, i << 20, data)
            except OSError as e:
                # the writer thread ran ahead and failed already: this append found out,
                # took the queue back and tried its own record the synchronous way
                assert e.errno == errno.ENOSPC
                outcome_sync.append(i)
                break
            assert log.submitted is not None, "not queued"
            jobs.append((log.submitted, log.submitted.pos))
        assert len(jobs) >= 3
        for job, pos in jobs:
            try:
                retry = await log.settle(job)
            except OSError as e:
                assert e.errno == errno.ENOSPC
                outcome.append("ENOSPC")
                tails.append(pos)
                continue
            outcome.append("retry" if retry else "ok")

    trio.run(main)
    log.token = None  # that trio run is over: appends are synchronous again
    assert "ENOSPC" in outcome or outcome_sync, outcome
    first_bad = outcome.index("ENOSPC") if "ENOSPC" in outcome else len(outcome)
    assert outcome[:first_bad] == ["ok"] * first_bad and first_bad >= 2, outcome
    assert outcome[first_bad + 1:] == ["retry"] * (len(outcome[first_bad + 1:])), outcome
    if tails:  # the failed job's position (a PAD may precede it): nothing after it remains
        assert log.tail <= tails[0]
    assert not log.queued
    # nothing of the failed write stays past the tail (sealed, it would sit after the footer)
    assert os.path.getsize(log.path(log.seg_id)) == log.tail
    assert index.get_inode(f).size == first_bad << 20
    for i in range(first_bad):
        assert ns.read(f, i << 20, 1 << 20) == chunks[i]
    # room again: appends go on from the tail; the log replays to exactly the same file
    os.unlink(small_tmpfs / "filler")
    ns.write(f, 20 << 20, b"after")
    trio.run(log.sync)
    log.close()
    index.close()
    index2, log2, ns2 = reopen(small_tmpfs, seg)
    node = index2.get_inode(f)
    assert node is not None and node.size == (20 << 20) + 5
    for i in range(first_bad):
        assert ns2.read(f, i << 20, 1 << 20) == chunks[i]
    assert ns2.read(f, first_bad << 20, 1 << 20) == bytes(1 << 20)  # a hole, as never written
    log2.close()
    index2.close()


def fill(d: Path) -> Path:
    """Fill the filesystem of `d` to the last byte; returns the filler."""
    p = d / "filler"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for block in (1 << 16, 512, 1):
            try:
                while os.write(fd, bytes(block)) > 0:
                    pass
            except OSError as e:
                assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return p


def test_a_full_disk_as_a_segment_starts_leaves_no_headerless_segment(tmp_path: Path) -> None:
    """The disk is full when a new segment file gets its header: the append fails with
    ENOSPC and leaves no file behind. Once there is room, what is appended and fsynced is in
    a proper segment and replays (it went into a headerless file that replay skipped)."""
    segs = tmp_path / "segments"
    segs.mkdir()
    sh("mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(segs))
    try:
        index, log, ns = make(tmp_path, 1 << 20)
        a = ns.create(ROOT_INO, b"before", 0o644, 0, 0).ino
        ns.write(a, 0, b"A" * 5000)
        ns.seal("idle")  # the next append starts a segment
        trio.run(log.sync)
        filler = fill(segs)
        with pytest.raises(OSError) as e:
            ns.create(ROOT_INO, b"refused", 0o644, 0, 0)
        assert e.value.errno == errno.ENOSPC
        assert len(log.existing()) == 1, "a segment file without a header was left"
        filler.unlink()
        b = ns.create(ROOT_INO, b"acked", 0o644, 0, 0).ino
        ns.write(b, 0, b"B" * 3000)
        trio.run(log.sync)
        log.close()
        index.close()
        index2, log2, ns2 = reopen(tmp_path, 1 << 20)
        assert index2.lookup(ROOT_INO, b"refused") is None
        got = index2.lookup(ROOT_INO, b"acked")
        assert got is not None and ns2.read(got, 0, 3000) == b"B" * 3000
        assert ns2.read(index2.lookup(ROOT_INO, b"before"), 0, 5000) == b"A" * 5000
        log2.close()
        index2.close()
    finally:
        subprocess.run(["umount", "-l", str(segs)], check=False, capture_output=True, timeout=30)


def test_unaligned_writes_never_run_out_of_staging_buffers(tmp_path: Path) -> None:
    """A 1 MiB write from a buffer that does not start on a page arrives as 1 MiB minus a few
    bytes (a direct record) and the few bytes (a PAD and a small buffered record queued
    behind it). The queue's depth counts the PADs and small records, which hold no staging
    buffer: bounded by depth alone, the queue took a direct record with every buffer in use
    (IndexError, EIO to the writer; 35 of 576 writes from 48 threads on a mount)."""
    index, log, ns = make(tmp_path, 1 << 30)
    want = bytearray()

    async def main() -> None:
        log.token = trio.lowlevel.current_trio_token()
        ns.dedup = False
        ino = ns.create(ROOT_INO, b"f", 0o644, 0, 0).ino
        pending = []
        off = 0
        for i in range(40):
            for n in ((1 << 20) - 16, 16):
                await log.room(n)  # what Operations.write does first
                data = bytes([i % 251 + 1]) * n
                ns.write(ino, off, data)  # nobody settles yet: the queue fills
                want.extend(data)
                off += n
                if log.submitted is not None:
                    pending.append(log.submitted)
                assert len(log.queued) <= logmod.PIPELINE_DEPTH + 1
        for job in pending:
            assert await log.settle(job) is False
        assert ns.read(ino, 0, len(want)) == want

    trio.run(main)
    log.token = None
    log.close()
    index.close()
    index, log, ns = reopen(tmp_path, 1 << 30)
    ino = ns.lookup(ROOT_INO, b"f").ino
    assert ns.read(ino, 0, len(want)) == want
    index.close()


def test_a_seal_while_making_room_in_the_queue_opens_a_new_segment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Making room in a full queue applies its oldest record, which can fill the segment's
    SEAL table and seal it. The record being appended used to be queued anyway, for the
    closed segment's descriptor (-1): EBADF. It goes to a new segment instead."""
    from ckptfs import segment as fmt

    index, log, ns = make(tmp_path, 256 << 20)
    results: list[bool] = []

    async def main() -> None:
        log.token = trio.lowlevel.current_trio_token()
        ino = ns.create(ROOT_INO, b"f", 0o644, 0, 0).ino
        # the first queued write, once applied, fills the SEAL table
        monkeypatch.setattr(fmt, "MAX_SEAL_ROWS", len(log.rows) // fmt.SEAL_ROW.size + 1)
        jobs = []
        for i in range(logmod.PIPELINE_DEPTH + 1):
            ns.write(ino, i << 20, bytes([i + 1]) * (1 << 20))
            jobs.append(log.submitted)
        for job in jobs:
            if job is not None:
                results.append(await log.settle(job))
        for i in range(logmod.PIPELINE_DEPTH + 1):
            assert ns.read(ino, i << 20, 1 << 20) == bytes([i + 1]) * (1 << 20)

    trio.run(main)
    assert results and not any(results)
    assert log.stats.seals["size"] >= 1
    log.token = None
    log.close()
    index.close()


def test_a_failed_pad_fails_the_write_behind_it_instead_of_retrying_forever(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PAD before a direct record fails (a filesystem with blocks under 4 KiB out of space,
    a quota, EIO): the data record behind it used to be marked for a retry, which queued a
    new PAD at the same place, which failed the same way, without end. The writer now gets
    the PAD's error, and the log takes a later append."""
    index, log, ns = make(tmp_path, 256 << 20)
    real = os.pwritev
    failing = True

    def pwritev(fd: int, bufs: list, pos: int) -> int:
        size = sum(len(b) for b in bufs)
        if failing and fd == log.fd and pos % 4096 and size == 4096 - pos % 4096:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bufs, pos)

    monkeypatch.setattr(logmod.os, "pwritev", pwritev)
    attempts = 0

    async def main() -> None:
        nonlocal attempts, failing
        log.token = trio.lowlevel.current_trio_token()
        ino = ns.create(ROOT_INO, b"f", 0o644, 0, 0).ino
        ns.write(ino, 0, b"x" * 100)  # the tail is off a boundary now
        buf = b"y" * (1 << 20)
        with pytest.raises(OSError) as e:
            while attempts < 20:  # what Operations.write does, bounded here
                attempts += 1
                ns.write(ino, 100, buf)
                job = log.submitted
                if job is None or not await log.settle(job):
                    break
        assert e.value.errno == errno.ENOSPC
        failing = False
        ns.write(ino, 100, buf)
        if log.submitted is not None:
            assert await log.settle(log.submitted) is False
        assert ns.read(ino, 0, 100 + len(buf)) == b"x" * 100 + buf

    trio.run(main)
    assert attempts == 1
    log.token = None
    log.close()
    index.close()


def test_writes_arriving_while_a_create_waits_for_the_queue_go_into_the_log_after_it(
        tmp_path: Path) -> None:
    """The kernel serves a create under its directory's exclusive lock, so every other create
    in that directory waits for it: a create (any record the log does not queue) waits only
    for the data writes queued before it, and writes that arrive meanwhile wait for it
    (SegmentLog.unqueue / room) instead of queueing ahead of its record."""
    index, log, ns = make(tmp_path, 64 << 20)
    order: list[str] = []
    rnd = random.Random(5)
    late = rnd.randbytes(1 << 20)

    async def main() -> None:
        log.token = trio.lowlevel.current_trio_token()
        f = ns.create(ROOT_INO, b"data", 0o644, 0, 0).ino
        for i in range(6):
            ns.write(f, i << 20, rnd.randbytes(1 << 20))  # queued for the writer thread
        assert len(log.queued) >= 2, "nothing queued: the test would prove nothing"
        waiting = trio.Event()

        async def creator() -> None:
            waiting.set()
            await log.unqueue()
            ns.create(ROOT_INO, b"new", 0o644, 0, 0)
            order.append("create")

        async def writer() -> None:
            await waiting.wait()
            await log.room(len(late))
            ns.write(f, 8 << 20, late)
            order.append("write")
            if log.submitted is not None:
                assert await log.settle(log.submitted) is False

        async with trio.open_nursery() as n:
            n.start_soon(creator)
            n.start_soon(writer)
        await log.sync()

    trio.run(main)
    log.token = None
    assert order == ["create", "write"]
    assert ns.read(ns.lookup(ROOT_INO, b"data").ino, 8 << 20, 1 << 20) == late
    log.close()
    index.close()
    index2, log2, ns2 = reopen(tmp_path, 64 << 20)  # the log alone says the same
    assert ns2.lookup(ROOT_INO, b"new") is not None
    assert ns2.read(ns2.lookup(ROOT_INO, b"data").ino, 8 << 20, 1 << 20) == late
    log2.close()
    index2.close()


def test_a_join_whose_write_another_request_applied_does_not_wait_for_the_writes_queued_since(
        tmp_path: Path) -> None:
    """Two requests wait in join_async() for the same write (the fsyncs of a group commit);
    the first to resume applies it. The other must then not apply the writes queued since:
    it would wait for them on the trio thread, blocking (the storm's fsyncs did, py-spy:
    8% of the trio thread's samples in a threading wait, bench/README.md 2026-12-07,
    evening), and every other request with it."""
    index, log, ns = make(tmp_path, 64 << 20)
    rnd = random.Random(11)
    seen: dict[str, bool] = {}
    later: list[logmod.LogWrite] = []

    async def main() -> None:
        log.token = trio.lowlevel.current_trio_token()
        f = ns.create(ROOT_INO, b"data", 0o644, 0, 0).ino
        log._pause()  # the writer starts nothing until told
        ns.write(f, 0, rnd.randbytes(1 << 20))
        first = log.submitted
        assert first is not None and not first.started

        async def joiner() -> None:
            await log.join_async(rounds=1)
            seen["later written"] = later[0].done

        async with trio.open_nursery() as n:
            n.start_soon(joiner)
            await trio.testing.wait_all_tasks_blocked()  # the joiner waits for `first`
            # another request applies it meanwhile, and a write is queued behind it that
            # the writer does not start (before the joiner resumes: no await in between)
            log._resume()
            first.wait_sync()
            log._finish(first)
            log._pause()
            ns.write(f, 1 << 20, rnd.randbytes(1 << 20))
            assert log.submitted is not None
            later.append(log.submitted)
        log._resume()
        assert await log.settle(later[0]) is False
        await log.sync()

    trio.run(main)
    log.token = None
    assert seen == {"later written": False}
    log.close()
    index.close()


def records_in_log_order(log: logmod.SegmentLog) -> list:
    from ckptfs import segment as fmt
    out = []
    for seg in log.existing():
        out += [r for r in fmt.scan_segment(log.path(seg)) if r.type != fmt.RecType.PAD]
    return out


def test_a_create_goes_into_the_log_ahead_of_the_writes_the_writer_has_not_started(
        tmp_path: Path) -> None:
    """A create (SegmentLog.ahead) waits only for the data write the writer thread is
    writing: its record takes the place of the first queued write not started, those move
    down the log, and the log, its sequence numbers and a replay of it agree with what the
    mount answered."""
    from ckptfs import segment as fmt
    index, log, ns = make(tmp_path, 64 << 20)
    rnd = random.Random(7)
    datas = [rnd.randbytes(n) for n in (1 << 20, 300 << 10, 5000, 1 << 20)]

    async def main() -> None:
        log.token = trio.lowlevel.current_trio_token()
        f = ns.create(ROOT_INO, b"data", 0o644, 0, 0).ino
        ns.write(f, 0, rnd.randbytes(1 << 20))  # the writer starts on this one at once
        first = log.submitted
        assert first is not None
        await first.wait()
        log._pause()  # (what ahead() does) so that the next writes are queued, not started
        jobs, off = [], 1 << 20
        for d in datas:
            ns.write(f, off, d)
            assert log.submitted is not None
            jobs.append(log.submitted)
            off += len(d)
        assert not any(j.started for j in jobs)
        async with log.ahead():
            ns.mkdir(ROOT_INO, b"step_1", 0o755, 0, 0)
        async with log.ahead():  # a second one goes after the first, still ahead of them
            ns.create(ROOT_INO, b"new", 0o644, 0, 0)
        assert log.stats.records_ahead == 2
        log._resume()  # (ahead() has not paused the writer: the records went into a slot)
        for j in jobs:
            assert await log.settle(j) is False
        await log.sync()

    trio.run(main)
    log.token = None
    want = b"".join(datas)
    f = ns.lookup(ROOT_INO, b"data").ino
    assert ns.read(f, 1 << 20, len(want)) == want
    recs = records_in_log_order(log)
    seqs = [r.seq for r in recs if r.type != fmt.RecType.SEAL]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    kinds = [(r.type, r.offset) for r in recs if r.ino == f or r.type == fmt.RecType.CREATE]
    creates = [i for i, (t, _o) in enumerate(kinds) if t == fmt.RecType.CREATE]
    queued_writes = [i for i, (t, o) in enumerate(kinds)
                     if t == fmt.RecType.WRITE and o >= 1 << 20]
    assert len(creates) == 3 and creates[1:] == [creates[1], creates[1] + 1]
    assert creates[2] < min(queued_writes), kinds  # ahead of every write queued before them
    log.close()
    index.close()
    index2, log2, ns2 = reopen(tmp_path, 64 << 20)  # the log alone says the same
    assert ns2.lookup(ROOT_INO, b"new") is not None
    assert ns2.lookup(ROOT_INO, b"step_1").is_dir
    assert ns2.read(ns2.lookup(ROOT_INO, b"data").ino, 1 << 20, len(want)) == want
    log2.close()
    index2.close()


def killed(body: str, tmp_path: Path) -> None:
    """Run `body` (the inside of an async main() that ends in a SIGKILL of its own process)
    in a fresh interpreter, with a log, index and namespace in tmp_path and trio's token set
    for the log's writer thread."""
    script = PROLOGUE + body + "\ntrio.run(main)\n"
    tests = Path(__file__).parent
    res = subprocess.run([os.sys.executable, "-c", script, str(tmp_path), str(tests)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == -9, res.stderr


PROLOGUE = r"""
import os, signal, sys, trio
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from ckptfs import log as logmod
from ckptfs.index import ROOT_INO
from test_format import make

logmod.BUFFERED = False  # (the writer thread's queue: see direct_writes)
index, log, ns = make(Path(sys.argv[1]), 64 << 20)

async def main():
    log.token = trio.lowlevel.current_trio_token()
"""

KILLED_AHEAD = r"""    f = ns.create(ROOT_INO, b"data", 0o644, 0, 0).ino
    await log.sync()
    log._pause()
    for i in range(4):
        ns.write(f, i << 20, os.urandom(1 << 20))  # queued, never written
    async with log.ahead():  # into the slot in front of the first of them
        ns.create(ROOT_INO, b"new", 0o644, 0, 0)
    async with log.ahead():  # and after it
        ns.create(ROOT_INO, b"new2", 0o644, 0, 0)
    async with log.ahead(4000):  # too long for the rest of the slot: ahead of them
        ns.symlink(ROOT_INO, b"link", b"t" * 3900, 0, 0)
    assert (log.stats.records_in_slots, log.stats.records_ahead) == (2, 3), log.stats
    # the creates returned to the application: a SIGKILL must not lose them
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_create_written_ahead_of_unwritten_writes_survives_a_sigkill(tmp_path: Path) -> None:
    """The process dies with the create's record in the log and the writes it went ahead of
    never written (they were not acknowledged): replay keeps the create and stops at the end
    of what was written, with no corruption."""
    killed(KILLED_AHEAD, tmp_path)
    index, log, ns = reopen(tmp_path, 64 << 20)
    assert ns.lookup(ROOT_INO, b"new") is not None
    assert ns.lookup(ROOT_INO, b"new2") is not None
    assert ns.lookup(ROOT_INO, b"link") is not None
    assert ns.inode(ns.lookup(ROOT_INO, b"data").ino).size == 0
    log.close()
    index.close()


@pytest.mark.parametrize("owner", ["write", "pad"])
@pytest.mark.parametrize("create", [True, False])
@pytest.mark.parametrize("rider", [True, False])
def test_a_write_that_fails_behind_a_slot_leaves_no_hole_and_keeps_the_create_in_it(
        tmp_path: Path, create: bool, owner: str, rider: bool) -> None:
    """The write that owns a slot fails after a create's record went into the slot, or with
    the slot still free: the direct write itself ("write": EINVAL, O_DIRECT refuses memory
    off the device's alignment) or the PAD that aligns it ("pad": EBADF). The tail goes
    back to just after the create's record, or to the slot itself, so nothing acknowledged
    sits after a hole, and the data is appended again. A small write that rode in the slot
    (SegmentLog._ride) is kept if the create took it along into the slot, and appended
    again if not (it was never written)."""
    from ckptfs import segment as fmt
    index, log, ns = make(tmp_path, 64 << 20)
    rnd = random.Random(13)
    data = rnd.randbytes(1 << 20)
    small = rnd.randbytes(700)
    ro = os.open(tmp_path / "ro", os.O_RDONLY | os.O_CREAT, 0o644)

    async def main() -> None:
        log.token = trio.lowlevel.current_trio_token()
        f = ns.create(ROOT_INO, b"data", 0o644, 0, 0).ino
        other = ns.create(ROOT_INO, b"other", 0o644, 0, 0).ino if rider else 0
        if owner == "write":  # a direct write first: the tail is then aligned
            ns.write(f, 1 << 20, rnd.randbytes(1 << 20))
            assert log.submitted is not None and await log.settle(log.submitted) is False
        await log.sync()
        log._pause()
        ns.write(f, 0, data)
        job = log.submitted
        assert job is not None and not job.started
        first = log.queued[0]
        assert (first is job) == (owner == "write") and job.slot >= 0
        slot = job.slot  # (in front of the PAD that aligns the write, if there is one)
        if rider:
            ns.write(other, 0, small)
            riding = log.submitted
            assert riding is not None and riding.owner is job and not riding.done
        if create:
            async with log.ahead():
                ns.create(ROOT_INO, b"new", 0o644, 0, 0)
            assert log.stats.records_in_slots == 1
            if rider:  # written along with the create, in front of it, and applied
                assert riding.done and log.stats.records_riding == 1
                assert ns.read(other, 0, 1000) == small
        if owner == "write":
            # memory one byte off the device's alignment: EINVAL, nothing written
            job.bufs = [memoryview(bytearray(job.nbytes + 1))[1:]]
        else:
            first.fd = ro  # EBADF: the PAD fails, and with it the write it was queued for
        log._resume()
        try:
            again = await log.settle(job)  # taken back: its request appends it again
        except OSError as e:
            assert owner == "pad" and e.errno == errno.EBADF
            again = True
        assert log.tail == slot + (logmod.SLOT if create else 0)
        if rider:
            assert await log.settle(riding) is (not create)
            if not create:  # never written: its request appends it again
                assert log.stats.records_riding == 0
                ns.write(other, 0, small)
                if log.submitted is not None:
                    assert await log.settle(log.submitted) is False
        if again:
            ns.write(f, 0, data)
            if log.submitted is not None:
                assert await log.settle(log.submitted) is False
        await log.sync()

    trio.run(main)
    os.close(ro)
    log.token = None
    recs = records_in_log_order(log)
    assert [r.type for r in recs if r.type == fmt.RecType.CREATE] == (
        [fmt.RecType.CREATE] * (1 + create + rider))
    seqs = [r.seq for r in recs if r.type != fmt.RecType.SEAL]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    f = ns.lookup(ROOT_INO, b"data").ino
    assert ns.read(f, 0, 1 << 20) == data
    log.close()
    index.close()
    index2, log2, ns2 = reopen(tmp_path, 64 << 20)  # the log alone says the same
    if create:
        assert ns2.lookup(ROOT_INO, b"new") is not None
    if rider:
        assert ns2.read(ns2.lookup(ROOT_INO, b"other").ino, 0, 1000) == small
    assert ns2.read(ns2.lookup(ROOT_INO, b"data").ino, 0, 1 << 20) == data
    log2.close()
    index2.close()


def test_a_create_that_cannot_be_written_into_a_slot_leaves_it_to_the_writer(
        small_tmpfs: Path) -> None:
    """The disk is full when a create's record is to go into a slot: the create fails with
    ENOSPC (a part of its record may be in the slot), and the slot goes back to the writer,
    which fills it with a PAD once it writes the write behind it (room again by then): no
    hole, no trace of the create, and a replay sees every write."""
    index, log, ns = make(small_tmpfs, 16 << 20)
    data = random.Random(17).randbytes(1 << 20)
    filler = small_tmpfs / "filler"

    async def main() -> None:
        log.token = trio.lowlevel.current_trio_token()
        f = ns.create(ROOT_INO, b"data", 0o644, 0, 0).ino
        await log.sync()
        log._pause()
        ns.write(f, 0, data)
        job = log.submitted
        assert job is not None and not job.started
        with open(filler, "wb") as fh:  # every block taken
            try:
                while True:
                    fh.write(bytes(1 << 16))
                    fh.flush()
            except OSError as e:
                assert e.errno == errno.ENOSPC
        with pytest.raises(OSError) as err:
            async with log.ahead():
                ns.create(ROOT_INO, b"new", 0o644, 0, 0)
        assert err.value.errno == errno.ENOSPC
        assert log.stats.records_in_slots == 0
        os.unlink(filler)
        log._resume()
        assert await log.settle(job) is False
        await log.sync()

    trio.run(main)
    log.token = None
    log.close()
    index.close()
    index2, log2, ns2 = reopen(small_tmpfs, 16 << 20)  # no hole: the write is there
    assert ns2.read(ns2.lookup(ROOT_INO, b"data").ino, 0, 1 << 20) == data
    with pytest.raises(FsError):  # nor the failed create (a part of it was written)
        ns2.lookup(ROOT_INO, b"new")
    log2.close()
    index2.close()


def test_small_writes_ride_in_the_slot_of_the_first_write_not_written(tmp_path: Path) -> None:
    """Small data records that arrive while big ones are queued (the few bytes an unaligned
    1 MiB write() leaves for a second request) ride in the slot in front of the first queued
    write (SegmentLog._ride), not behind the last: each waits for that one write only. The
    writer thread writes them there once it has written that write; they are applied just
    before it, the log's order and numbers agree, and a replay says the same. A create
    into that slot takes the riders along (writes their records in front of its own); a
    create too long for the slot goes ahead of the queued writes, numbered above a rider
    that came after the first create."""
    from ckptfs import segment as fmt
    index, log, ns = make(tmp_path, 64 << 20)
    rnd = random.Random(23)
    bigs = [rnd.randbytes(1 << 20) for _ in range(3)]
    smalls = [rnd.randbytes(n) for n in (40, 1000, 3, 77)]

    async def main() -> None:
        log.token = trio.lowlevel.current_trio_token()
        f = ns.create(ROOT_INO, b"big", 0o644, 0, 0).ino
        g = ns.create(ROOT_INO, b"small", 0o644, 0, 0).ino
        await log.sync()
        log._pause()  # (so that the big writes stay queued, none started)
        jobs = []
        for i, d in enumerate(bigs):
            ns.write(f, i << 20, d)
            assert log.submitted is not None
            jobs.append(log.submitted)
        riders, off = [], 0
        for d in smalls[:3]:
            ns.write(g, off, d)
            off += len(d)
            r = log.submitted
            assert r is not None and r.owner is jobs[0] and not r.done
            riders.append(r)
        assert ns.inode(g).size == 0  # not applied before the write it rides with
        async with log.ahead():
            ns.create(ROOT_INO, b"c1", 0o644, 0, 0)
        assert all(r.done for r in riders) and ns.inode(g).size == 1043  # taken along
        ns.write(g, off, smalls[3])  # rides behind the create
        assert log.submitted is not None and log.submitted.owner is jobs[0]
        riders.append(log.submitted)
        async with log.ahead(4000):  # no room left in the slot: ahead of the queued writes
            ns.symlink(ROOT_INO, b"link", b"t" * 3900, 0, 0)
        assert (log.stats.records_in_slots, log.stats.records_ahead) == (1, 2)
        log._resume()
        for r in riders:
            assert await log.settle(r) is False and r.done
        assert jobs[0].done
        for j in jobs:
            assert await log.settle(j) is False
        await log.sync()

    trio.run(main)
    log.token = None
    assert log.stats.records_riding == 4
    f, g = ns.lookup(ROOT_INO, b"big").ino, ns.lookup(ROOT_INO, b"small").ino
    assert ns.read(f, 0, 3 << 20) == b"".join(bigs)
    assert ns.read(g, 0, 2000) == b"".join(smalls)
    recs = records_in_log_order(log)
    seqs = [r.seq for r in recs if r.type != fmt.RecType.SEAL]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    c1, link = ns.lookup(ROOT_INO, b"c1").ino, ns.lookup(ROOT_INO, b"link").ino
    order = [(r.ino, r.offset) for r in recs[2:] if r.type in (fmt.RecType.WRITE,
                                                                fmt.RecType.CREATE)]
    assert order == [(g, 0), (g, 40), (g, 1040), (c1, 0), (g, 1043), (link, 0),
                     (f, 0), (f, 1 << 20), (f, 2 << 20)], order
    log.close()
    index.close()
    index2, log2, ns2 = reopen(tmp_path, 64 << 20)  # the log alone says the same
    assert ns2.read(ns2.lookup(ROOT_INO, b"big").ino, 0, 3 << 20) == b"".join(bigs)
    assert ns2.read(ns2.lookup(ROOT_INO, b"small").ino, 0, 2000) == b"".join(smalls)
    assert ns2.lookup(ROOT_INO, b"link") is not None and ns2.lookup(ROOT_INO, b"c1")
    log2.close()
    index2.close()


KILLED_RIDING = r"""    f = ns.create(ROOT_INO, b"data", 0o644, 0, 0).ino
    g = ns.create(ROOT_INO, b"small", 0o644, 0, 0).ino
    await log.sync()
    log._pause()
    for i in range(4):
        ns.write(f, i << 20, os.urandom(1 << 20))  # queued, never written
    ns.write(g, 0, b"taken along")  # rides in the first one's slot
    assert log.submitted.owner is not None
    async with log.ahead():  # into that slot: writes the rider's record with its own
        ns.create(ROOT_INO, b"new", 0o644, 0, 0)
    assert log.stats.records_riding == 1 and log.stats.records_in_slots == 1, log.stats
    ns.write(g, 100, b"never acknowledged")  # rides again, behind the create
    assert log.submitted.owner is not None and not log.submitted.done
    # the create returned to the application: a SIGKILL must not lose it, nor the bytes
    # written in front of it
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_create_that_takes_riders_along_survives_a_sigkill_with_them(tmp_path: Path) -> None:
    """A create that goes into a slot where small writes ride writes their records with its
    own, in front of it: after a SIGKILL (the writes the slot belongs to never written) a
    replay has the create and those writes, not the rider that came after the create (it
    was never written, nor acknowledged), and nothing corrupt."""
    killed(KILLED_RIDING, tmp_path)
    index, log, ns = reopen(tmp_path, 64 << 20)
    assert ns.lookup(ROOT_INO, b"new") is not None
    g = ns.lookup(ROOT_INO, b"small").ino
    assert ns.inode(g).size == len(b"taken along")
    assert ns.read(g, 0, 200) == b"taken along"
    assert ns.inode(ns.lookup(ROOT_INO, b"data").ino).size == 0
    log.close()
    index.close()


def test_written_riders_and_their_writes_are_freed_without_the_cycle_collector(
        tmp_path: Path) -> None:
    """A rider refers to the write whose slot it rides in, which holds the write's payload
    (1 MiB): once both are written and applied nothing may refer back, or each pair would
    wait for Python's cycle collector, and a save of big shards from unaligned buffers (a
    rider per MiB) held ~180 MiB more in the daemon (227-244 MiB peak against 57)."""
    import gc
    index, log, ns = make(tmp_path, 64 << 20)
    rnd = random.Random(29)

    async def main() -> None:
        log.token = trio.lowlevel.current_trio_token()
        f = ns.create(ROOT_INO, b"big", 0o644, 0, 0).ino
        g = ns.create(ROOT_INO, b"small", 0o644, 0, 0).ino
        await log.sync()
        for i in range(40):
            log._pause()
            ns.write(f, i << 20, rnd.randbytes(1 << 20))  # (no two alike: none deduplicated)
            job = log.submitted
            ns.write(g, i * 10, b"0123456789")  # rides in front of it
            rider = log.submitted
            assert job is not None and rider is not None and rider.owner is job
            log._resume()
            assert await log.settle(rider) is False and await log.settle(job) is False
        await log.sync()

    gc.collect()
    gc.disable()
    try:
        trio.run(main)
        log.token = None
        log.submitted = None
        alive = [o for o in gc.get_objects() if type(o) is logmod.LogWrite]
    finally:
        gc.enable()
    assert log.stats.records_riding == 40
    assert len(alive) <= 2, f"{len(alive)} log writes still referenced"  # (the writer's last)
    assert ns.read(ns.lookup(ROOT_INO, b"small").ino, 0, 400) == b"0123456789" * 40
    log.close()
    index.close()


@pytest.mark.parametrize("riders", [True, False])
def test_a_deduplicated_write_waits_for_no_queue_on_the_trio_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, riders: bool) -> None:
    """A write whose bytes an earlier record holds becomes a 20-byte REF record (the
    incremental drain). With data writes queued it used to wait for all of them, blocking
    the trio thread; it now rides in the slot of the first of them like any small data
    record (or, riders off, queues behind them), and is applied in log order: reads and a
    replay see it."""
    from ckptfs import segment as fmt
    monkeypatch.setattr(logmod, "RIDERS", riders)
    index, log, ns = make(tmp_path, 64 << 20)
    rnd = random.Random(31)
    same = rnd.randbytes(1 << 20)
    fresh = rnd.randbytes(1 << 20)

    async def main() -> None:
        log.token = trio.lowlevel.current_trio_token()
        f = ns.create(ROOT_INO, b"old", 0o644, 0, 0).ino
        g = ns.create(ROOT_INO, b"new", 0o644, 0, 0).ino
        ns.write(f, 0, same)
        assert log.submitted is not None and await log.settle(log.submitted) is False
        await log.sync()
        log._pause()  # (the next write stays queued)
        ns.write(g, 0, fresh)
        big = log.submitted
        ns.write(g, 1 << 20, same)  # the same bytes as "old": a REF
        ref = log.submitted
        assert big is not None and ref is not None and ref.rtype == fmt.RecType.REF
        assert not big.started and not ref.done and ns.dedup_hits == 1
        if riders:
            assert ref.owner is big
        else:
            assert list(log.queued)[-1] is ref
        assert ns.inode(g).size == 0  # neither applied yet
        log._resume()
        assert await log.settle(ref) is False and await log.settle(big) is False
        await log.sync()

    trio.run(main)
    log.token = None
    g = ns.lookup(ROOT_INO, b"new").ino
    assert ns.read(g, 0, 2 << 20) == fresh + same
    log.close()
    index.close()
    index2, log2, ns2 = reopen(tmp_path, 64 << 20)  # the log alone says the same
    assert ns2.read(ns2.lookup(ROOT_INO, b"new").ino, 0, 2 << 20) == fresh + same
    log2.close()
    index2.close()


def test_a_seal_by_a_riders_row_keeps_the_write_it_rode_with_in_the_table(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A segment is sealed at MAX_SEAL_ROWS records: if applying a rider makes it full, the
    seal comes in the middle of applying the rider and its write. The SEAL table must list
    that write too (it lies before the SEAL in the segment), not leave it to the next
    segment's table: a replay from the log alone then has both."""
    from ckptfs import segment as fmt
    index, log, ns = make(tmp_path, 64 << 20)
    big = random.Random(37).randbytes(1 << 20)

    async def main() -> None:
        log.token = trio.lowlevel.current_trio_token()
        f = ns.create(ROOT_INO, b"big", 0o644, 0, 0).ino
        g = ns.create(ROOT_INO, b"small", 0o644, 0, 0).ino
        await log.sync()
        rows = len(log.rows) // fmt.SEAL_ROW.size
        log._pause()
        ns.write(f, 0, big)
        job = log.submitted
        ns.write(g, 0, b"rider")
        rider = log.submitted
        assert job is not None and rider is not None and rider.owner is job
        monkeypatch.setattr(fmt, "MAX_SEAL_ROWS", rows + 1)  # full with the rider's row
        log._resume()
        assert await log.settle(rider) is False and await log.settle(job) is False
        assert log.stats.seals["size"] == 1
        assert not log.rows  # (no row of the sealed segment's carried into the next one's)
        monkeypatch.undo()
        await log.sync()

    trio.run(main)
    log.token = None
    path = log.path(log.existing()[0])
    with open(path, "rb") as fh:
        table = fmt.SealedSegment(path, os.path.getsize(path),
                                  lambda o, n: os.pread(fh.fileno(), n, o)).rows
    f = ns.lookup(ROOT_INO, b"big").ino
    assert [row[2] for row in table if row[3] == f and row[1] == fmt.RecType.WRITE] == [1 << 20]
    log.close()
    index.close()
    index2, log2, ns2 = reopen(tmp_path, 64 << 20)  # the log alone, sealed segment first
    assert ns2.read(ns2.lookup(ROOT_INO, b"big").ino, 0, 1 << 20) == big
    assert ns2.read(ns2.lookup(ROOT_INO, b"small").ino, 0, 10) == b"rider"
    log2.close()
    index2.close()


def test_a_record_that_goes_through_the_page_cache_is_written_at_once_when_nothing_is_queued(
        tmp_path: Path) -> None:
    """A data record under DIRECT_MIN goes through the page cache, a buffered `pwritev` of
    microseconds: with nothing queued the trio thread writes and applies it itself, rather
    than hand it to the writer thread and back (which cost one writer of 64 KiB `write()`s
    a third of its speed: bench/README.md, 2026-12-07, night). Behind a queued write it
    queues, so the log's order holds; a direct record is queued either way."""
    index, log, ns = make(tmp_path, 64 << 20)
    rnd = random.Random(5)
    under = rnd.randbytes(logmod.DIRECT_MIN - 4096)  # (above the 64 KiB bound of before)
    direct = rnd.randbytes(logmod.DIRECT_MIN)
    assert logmod.DIRECT_MIN > len(under) > 64 << 10

    async def main() -> None:
        log.token = trio.lowlevel.current_trio_token()
        f = ns.create(ROOT_INO, b"f", 0o644, 0, 0).ino
        await log.sync()
        ns.write(f, 0, under)
        assert log.submitted is None and not log.queued  # written and applied at once
        assert ns.inode(f).size == len(under)
        ns.write(f, len(under), direct)
        job = log.submitted
        assert job is not None and job.stage >= 0  # a direct record: the writer thread's
        ns.write(f, len(under) + len(direct), under)
        behind = log.submitted
        assert behind is not None and behind is not job and not behind.done  # queued behind
        for j in (job, behind):
            assert await log.settle(j) is False
        assert ns.inode(f).size == 2 * len(under) + len(direct)
        await log.sync()

    trio.run(main)
    log.close()
    index.close()
    index, log, ns = reopen(tmp_path, 64 << 20)  # (what the log alone says)
    assert ns.read(index.lookup(ROOT_INO, b"f"), 0, 1 << 20) == under + direct + under
    log.close()
    index.close()


def test_big_records_go_through_the_page_cache_unless_writes_are_queued(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With BUFFERED (the default), big data records of requests that can wait are written
    by the trio thread through the page cache and applied at once, files interleaved as
    ranks write them, none handed to the writer thread for an O_DIRECT write (a storm saved
    in 8.6-9.2 s instead of 11.3-14.0: bench/README.md, 2026-12-07, midnight). While writes are
    queued (the disk was behind, below), the next record queues behind them rather than
    overtake them: acknowledged before they are written, a SIGKILL could leave it behind a
    hole that replay stops at. Replay reads the same bytes back."""
    monkeypatch.setattr(logmod, "BUFFERED", True)
    # the pause is set by hand below: not by other tests' dirty pages on the machine (the
    # kick looks at the whole machine's writeback backlog every 8 MiB)
    monkeypatch.setattr(logmod, "_writeback_backlog", lambda: 0)
    index, log, ns = make(tmp_path, 64 << 20)
    rnd = random.Random(9)
    big = [rnd.randbytes(1 << 20) for _ in range(12)]  # (none repeats)

    async def main() -> None:
        log.token = trio.lowlevel.current_trio_token()
        f = ns.create(ROOT_INO, b"f", 0o644, 0, 0).ino
        g = ns.create(ROOT_INO, b"g", 0o644, 0, 0).ino
        await log.sync()

        async def write(ino: int, off: int, data: bytes) -> bool:
            """True if written and applied at once (not queued)."""
            ns.write(ino, off, data)
            job = log.submitted
            if job is None:
                return True
            assert await log.settle(job) is False
            return False

        direct, buffered = log.stats.direct_records, log.stats.records_buffered
        got = [await write((f, g)[i % 2], (i // 2) << 20, big[i]) for i in range(6)]
        assert got == [True] * 6
        assert log.stats.direct_records == direct
        assert log.stats.records_buffered == buffered + 6
        # the disk is behind: the next one goes to the writer thread...
        log._direct_until = float("inf")
        ns.write(f, 3 << 20, big[6])
        first = log.submitted
        assert first is not None and not first.done
        # ...and one after the pause, while that is queued, queues behind it
        log._direct_until = 0.0
        ns.write(g, 3 << 20, big[7])
        second = log.submitted
        assert second is not None and second is not first
        for job in (first, second):
            assert await log.settle(job) is False
        assert log.stats.direct_records == direct + 2
        assert [await write(f, (4 + i) << 20, big[8 + i]) for i in range(4)] == [True] * 4
        await log.sync()
        assert ns.inode(f).size == 8 << 20 and ns.inode(g).size == 4 << 20

    trio.run(main)
    log.close()
    index.close()
    index, log, ns = reopen(tmp_path, 64 << 20)  # (what the log alone says)
    f, g = index.lookup(ROOT_INO, b"f"), index.lookup(ROOT_INO, b"g")
    assert ns.read(f, 0, 16 << 20) == b"".join([*big[0:6:2], big[6], *big[8:]])
    assert ns.read(g, 0, 16 << 20) == b"".join([*big[1:6:2], big[7]])
    log.close()
    index.close()


@pytest.mark.parametrize("backlog", [0, 1 << 40])
def test_buffered_records_go_back_to_the_writer_thread_while_the_disk_is_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backlog: int) -> None:
    """Every KICK bytes appended through the page cache, their writeback is started (the
    whole range since the last kick, so nothing is left for the kernel's own flushing) and
    the machine's writeback backlog looked at: past WRITEBACK_BACKLOG the kernel would make
    the trio thread wait for the disk (every request with it), so the next big records go to
    the writer thread for DIRECT_PAUSE seconds. 6 GiB written by one process with a probe of
    the mount: probe max 113-141 ms without this, 14-15 ms with it (bench/README.md,
    2026-12-07, night)."""
    monkeypatch.setattr(logmod, "BUFFERED", True)
    monkeypatch.setattr(logmod, "_writeback_backlog", lambda: backlog)
    monkeypatch.setattr(logmod, "DIRECT_PAUSE", 3600.0)
    kicks: list[tuple[int, int]] = []
    real_fadvise = os.posix_fadvise

    def fadvise(fd: int, off: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_DONTNEED:
            kicks.append((off, length))
        real_fadvise(fd, off, length, advice)

    monkeypatch.setattr(logmod.os, "posix_fadvise", fadvise)
    index, log, ns = make(tmp_path, 256 << 20)
    rnd = random.Random(11)
    kick = -(-logmod.KICK // (1 << 20))  # 1 MiB records (and their headers) to a kick
    n = 2 * kick + 4

    async def main() -> list[bool]:
        log.token = trio.lowlevel.current_trio_token()
        f = ns.create(ROOT_INO, b"f", 0o644, 0, 0).ino
        g = ns.create(ROOT_INO, b"g", 0o644, 0, 0).ino
        await log.sync()
        at_once = []
        for i in range(n):
            ns.write((f, g)[i % 2], (i // 2) << 20, rnd.randbytes(1 << 20))
            job = log.submitted
            at_once.append(job is None)
            if job is not None:
                assert await log.settle(job) is False
        await log.sync()
        return at_once

    at_once = trio.run(main)
    want = kick if backlog else n  # (the kick comes after the kick-th record)
    assert at_once == [True] * want + [False] * (n - want)
    assert log.stats.records_buffered == want
    # the kicks cover the log from its first record on, each where the last one ended
    assert kicks and kicks[0][0] == logmod.fmt.SEGMENT_HEADER_SIZE, kicks
    assert all(a + la == b for (a, la), (b, _) in zip(kicks, kicks[1:])), kicks
    assert len(kicks) == (1 if backlog else 2), kicks
    log.close()
    index.close()


def test_a_burst_of_writes_shows_in_the_write_rate_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The drain's "yield" policy holds uploads back while the application writes fast
    (Drain._writes_busy, from SegmentLog.write_rate). The rate must show a save from its
    first megabytes: a big save seals its first 256 MiB segment within the first half
    second, and its upload then competed with the save (bench/README.md, 2026-12-08)."""
    monkeypatch.setattr(logmod, "BUFFERED", True)  # the default way, records applied at once
    monkeypatch.setattr(logmod, "_writeback_backlog", lambda: 0)  # (whatever else runs)
    index, log, ns = make(tmp_path, 64 << 20)

    async def main() -> None:
        log.token = trio.lowlevel.current_trio_token()
        ino = ns.create(ROOT_INO, b"f", 0o644, 0, 0).ino
        await trio.sleep(2 * logmod.RATE_WINDOW + 0.05)  # quiet: no rate
        assert log.write_rate() == 0.0
        data = random.Random(7).randbytes(1 << 20)
        for i in range(16):
            ns.write(ino, i << 20, data[i:] + data[:i])  # (no two alike: none deduplicated)
        assert log.submitted is None  # every record appended already
        # 16 MiB appended: at least 16 MiB per window's length, however long that took
        assert log.write_rate() >= (16 << 20) / logmod.RATE_WINDOW * 0.99
        await trio.sleep(2 * logmod.RATE_WINDOW + 0.05)
        assert log.write_rate() == 0.0  # and it ends when the writes do
        await log.sync()

    trio.run(main)
    log.close()
    index.close()
