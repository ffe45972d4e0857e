"""Recovery through a real mount: `ckptfs replay` after a SIGKILL, a deleted index rebuilt from
the log, a flipped byte in a sealed segment (reported by replay, EIO through the mount, never
wrong bytes), and a torn tail (end of log, not corruption).

The tests find where file data sits in a segment by searching for the (random, incompressible)
bytes written, so they depend on nothing of the record format beyond "data is stored as is".
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from mounting import MakeMount, Mount, Result, run_cli

CHUNK = 64  # bytes searched for: long enough to be unique in random data


def write_files(root: Path, files: dict[str, bytes], fsync: bool = True) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        with open(root / rel, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())


def tree(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir",)
            else:
                out[rel] = p.read_bytes()
    return out


def segments(nvme: Path) -> list[Path]:
    return sorted((nvme / "segments").glob("*.seg"))


def replay_json(nvme: Path) -> tuple[Result, dict[str, Any]]:
    res = run_cli("replay", nvme, "--json", timeout=120)
    assert "Traceback" not in res.out + res.err, str(res)
    try:
        report = json.loads(res.out)
    except ValueError:
        pytest.fail(f"replay --json did not print JSON: {res}")
    for key in ("segments", "records", "files", "corruption"):
        assert key in report, f"replay report lacks {key!r}: {report}"
    return res, report


def rng_files(seed: int, sizes: dict[str, int]) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {name: rng.randbytes(n) for name, n in sizes.items()}


def find(haystack: bytes, needle: bytes) -> int:
    at = haystack.find(needle)
    assert haystack.find(needle, at + 1) == -1 or at == -1, "chunk not unique"
    return at


# -- SIGKILL, replay, remount ------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_replay_after_sigkill_reports_and_remount_shows_everything(make_mount: MakeMount
                                                                   ) -> None:
    m = make_mount(segment_size="1M")
    files = rng_files(1, {f"ckpt/shard-{i}": 300_000 + i * 1000 for i in range(10)})
    files["ckpt/small"] = b"tiny"
    write_files(m.mnt, files, fsync=False)  # acknowledged, not fsynced: must survive a kill
    os.symlink("ckpt/small", m.mnt / "latest")
    os.rename(m.mnt / "ckpt/shard-9", m.mnt / "ckpt/shard-9.renamed")
    files["ckpt/shard-9.renamed"] = files.pop("ckpt/shard-9")
    os.unlink(m.mnt / "ckpt/shard-8")
    files.pop("ckpt/shard-8")
    os.mkdir(m.mnt / "empty")
    expected = tree(m.mnt)
    m.kill()
    m.clean_stale()

    res, report = replay_json(m.nvme)
    assert res.rc == 0, str(res)
    assert report["corruption"] in ([], None, 0), report
    assert report["files"] == len(files) + 1, f"{len(files)} files and a symlink: {report}"
    assert report["segments"] >= 2, f"3 MB through 1 MiB segments: {report}"
    assert report["records"] >= len(files), report
    text = run_cli("replay", m.nvme, timeout=120)
    assert text.rc == 0 and "segment" in text.out, str(text)

    m.start()
    assert tree(m.mnt) == expected


@pytest.mark.timeout(120)
def test_deleted_index_is_rebuilt_from_the_log(make_mount: MakeMount) -> None:
    m = make_mount(segment_size="1M")
    first = rng_files(2, {f"a/f{i}": 200_000 + i for i in range(8)})
    write_files(m.mnt, first)
    os.symlink("a/f0", m.mnt / "link")
    os.chmod(m.mnt / "a/f1", 0o600)
    os.utime(m.mnt / "a/f2", ns=(1_600_000_000_111_111_111, 1_600_000_000_222_222_222))
    expected = tree(m.mnt)
    m.unmount()
    shutil.rmtree(m.nvme / "index")
    m.start()
    assert tree(m.mnt) == expected
    assert os.stat(m.mnt / "a/f1").st_mode & 0o777 == 0o600
    assert os.stat(m.mnt / "a/f2").st_mtime_ns == 1_600_000_000_222_222_222

    # Again after a SIGKILL, with more data on top.
    second = rng_files(3, {f"b/g{i}": 150_000 for i in range(6)})
    write_files(m.mnt, second, fsync=False)
    os.rename(m.mnt / "a", m.mnt / "a-old")
    expected = tree(m.mnt)
    m.kill()
    m.clean_stale()
    shutil.rmtree(m.nvme / "index")
    m.start()
    assert tree(m.mnt) == expected


def test_a_rebuild_missing_the_first_segments_says_so(make_mount: MakeMount) -> None:
    """Segments GC deleted are covered by the index snapshot. With the index and that
    snapshot lost too, a rebuild from the segments left silently dropped the files whose
    directories were made in the deleted ones (an fsync'd file gone, no corruption
    reported): a segment missing before the first one left is now reported like one
    missing in the middle."""
    m = make_mount(segment_size="1M")
    write_files(m.mnt, rng_files(4, {f"a/f{i}": 300_000 for i in range(8)}))
    m.unmount()
    first = segments(m.nvme)[0]
    assert len(segments(m.nvme)) >= 2
    first.unlink()  # as GC deletes a segment: here and on SHARED
    (published,) = [p for p in (m.shared / "ckptfs" / "objects").rglob(first.stem + "*")]
    published.unlink()
    shutil.rmtree(m.nvme / "index")
    res, report = replay_json(m.nvme)
    assert res.rc == 1, str(res)
    missing = f"segment {first.name} is missing"
    assert any(missing in c for c in report["corruption"]), report["corruption"]


# -- corruption --------------------------------------------------------------------------------


def corrupt_sealed_segment(m: Mount, files: dict[str, bytes], also_shared: bool
                           ) -> tuple[str, int, Path, int]:
    """Flip one byte of file data in the middle of the oldest (sealed) segment. Returns
    (file name, offset in that file, segment path, offset in the segment)."""
    segs = segments(m.nvme)
    assert len(segs) >= 3, f"expected several 1 MiB segments, found {segs}"
    seg = segs[0]
    blob = seg.read_bytes()
    for name, data in files.items():
        for file_off in range(len(data) // 4, 3 * len(data) // 4, 4096):
            at = find(blob, data[file_off : file_off + CHUNK])
            if at != -1 and len(blob) // 8 < at < 7 * len(blob) // 8:
                break
        else:
            continue
        break
    else:
        pytest.fail(f"no file data found in the middle of {seg.name}: stored transformed?")
    flip_seg = at + CHUNK // 2
    flip_file = file_off + CHUNK // 2
    with open(seg, "r+b") as f:
        f.seek(flip_seg)
        b = f.read(1)
        f.seek(flip_seg)
        f.write(bytes([b[0] ^ 0x5A]))
    if also_shared:
        needle = data[file_off : file_off + CHUNK]
        for p in m.shared.rglob("*"):
            if p.is_file():
                content = p.read_bytes()
                i = content.find(needle)
                while i != -1:
                    with open(p, "r+b") as f:
                        f.seek(i + CHUNK // 2)
                        f.write(bytes([content[i + CHUNK // 2] ^ 0x5A]))
                    i = content.find(needle, i + 1)
    return name, flip_file, seg, flip_seg


def intact_copy_in(root: Path, needle: bytes) -> bool:
    return any(p.is_file() and needle in p.read_bytes() for p in root.rglob("*"))


def read_blocks(path: Path, size: int, block: int = 4096) -> list[bytes | int]:
    """Each block's bytes, or the errno its read failed with."""
    out: list[bytes | int] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        for off in range(0, size, block):
            try:
                out.append(os.pread(fd, block, off))
            except OSError as e:
                out.append(e.errno or -1)
    finally:
        os.close(fd)
    return out


@pytest.mark.timeout(120)
def test_wait_fails_for_a_checkpoint_with_data_known_to_be_damaged(make_mount: MakeMount
                                                                  ) -> None:
    """A record damaged on NVMe and on SHARED (replay reports it; its range reads EIO): `wait`
    said "published" for a directory with that file, which no node can read whole. Now it
    names the damaged files and fails, also after later mounts (the index keeps what replay
    found); a wait for undamaged files still succeeds."""
    m = make_mount(segment_size="1M")
    files = rng_files(5, {f"d/f{i}": 500_000 + 17 * i for i in range(8)})
    files["other/ok"] = b"fine" * 1000
    write_files(m.mnt, files)
    m.unmount()
    name, _file_off, _seg, _seg_off = corrupt_sealed_segment(
        m, {k: v for k, v in files.items() if k.startswith("d/")}, also_shared=True)
    assert run_cli("replay", m.nvme, timeout=120).rc == 1  # finds it (and the index keeps it)
    m.start()
    res = run_cli("wait", m.mnt / "d", timeout=120)
    assert res.rc == 1 and "damaged on this node" in res.err and name in res.err, str(res)
    assert len(res.err.strip().splitlines()) == 1, str(res)
    assert run_cli("wait", m.mnt / "other", timeout=120).rc == 0
    others = [k for k in files if k.startswith("d/") and k != name]
    assert run_cli("wait", m.mnt / others[0], timeout=120).rc == 0
    st = run_cli("status", m.mnt, timeout=60)
    assert "DAMAGED" in st.out and "1 records" in st.out, str(st)
    m.remount()
    assert run_cli("wait", m.mnt / "d", timeout=120).rc == 1
    # an overwrite of the damaged file ends it
    (m.mnt / name).write_bytes(files[name])
    assert run_cli("wait", m.mnt / "d", timeout=120).rc == 0


def test_wait_succeeds_when_shared_has_a_good_copy_of_a_damaged_local_record(
        make_mount: MakeMount) -> None:
    """Damaged on NVMe only, after it was published: the checkpoint is whole on SHARED, so a
    wait says so, and reads are served from SHARED's copy."""
    m = make_mount(segment_size="1M")
    files = rng_files(7, {f"d/f{i}": 500_000 + 17 * i for i in range(8)})
    write_files(m.mnt, files)
    m.unmount()
    corrupt_sealed_segment(m, files, also_shared=False)
    assert run_cli("replay", m.nvme, timeout=120).rc == 1
    m.start()
    res = run_cli("wait", m.mnt / "d", timeout=120)
    assert res.rc == 0, str(res)
    # and reads are served from that copy (they were EIO)
    for rel, data in files.items():
        assert (m.mnt / rel).read_bytes() == data, rel
    # the replay's SEALED segments were not uploaded again: one object per name (a second
    # copy, of the damaged local file, went into a new batch directory, and was read)
    names = [p.name for p in (m.shared / "ckptfs" / "objects").rglob("*.seg")]
    assert sorted(names) == sorted(set(names)), sorted(names)
    st = json.loads(run_cli("status", m.mnt, "--json").out)
    assert st["healed_reads"] >= 1 and st["corrupt_reads"] == 0, st


def test_wait_fails_for_a_file_a_read_found_damaged(make_mount: MakeMount) -> None:
    """Damage no replay saw (the segment was applied before it happened), found by a read that
    got EIO: a wait of the file says so too."""
    m = make_mount(segment_size="1M")
    files = rng_files(6, {f"d/f{i}": 500_000 + 17 * i for i in range(8)})
    write_files(m.mnt, files)
    m.unmount()
    name, file_off, _seg, _seg_off = corrupt_sealed_segment(m, files, also_shared=True)
    m.start()
    assert run_cli("wait", m.mnt / "d", timeout=120).rc == 0  # nothing knows of it yet
    fd = os.open(m.mnt / name, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as err:
            os.pread(fd, 4096, file_off - file_off % 4096)
        assert err.value.errno == errno.EIO
    finally:
        os.close(fd)
    res = run_cli("wait", m.mnt / name, timeout=120)
    assert res.rc == 1 and "damaged on this node" in res.err, str(res)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("also_shared", [False, True], ids=["local-only", "local-and-shared"])
def test_flipped_byte_in_sealed_segment(make_mount: MakeMount, also_shared: bool) -> None:
    m = make_mount(segment_size="1M")
    files = rng_files(4, {f"f{i}": 500_000 + 17 * i for i in range(8)})
    write_files(m.mnt, files)
    m.unmount()
    name, file_off, seg, seg_off = corrupt_sealed_segment(m, files, also_shared)
    needle = files[name][file_off - CHUNK // 2 : file_off + CHUNK // 2]

    res, report = replay_json(m.nvme)
    assert res.rc == 1, f"replay must exit 1 on corruption: {res}"
    assert report["corruption"], report
    blob = json.dumps(report["corruption"])
    assert seg.name in blob, f"the report should name {seg.name}: {report['corruption']}"
    numbers = [int(x, 16) if x.startswith("0x") else int(x)
               for x in re.findall(r"\b(?:0x[0-9a-fA-F]+|\d+)\b", blob)]
    assert any(seg_off - (1 << 20) <= n <= seg_off for n in numbers), (
        f"the report should give the damaged record's offset (<= {seg_off}): {blob}")
    text = run_cli("replay", m.nvme, timeout=120)
    assert text.rc == 1, str(text)
    assert seg.name in text.out + text.err, str(text)

    m.start()
    data = files[name]
    size = os.stat(m.mnt / name).st_size
    assert size == len(data), (
        f"{name}, damaged at file offset {file_off} ({seg.name} offset {seg_off}), now has "
        f"size {size} instead of {len(data)}: the damaged record was dropped silently")
    blocks = read_blocks(m.mnt / name, len(data))
    damaged_block = file_off // 4096
    for i, got in enumerate(blocks):
        want = data[i * 4096 : (i + 1) * 4096]
        if isinstance(got, int):
            assert got == errno.EIO, f"{name} block {i}: {errno.errorcode.get(got, got)}"
        else:
            assert got == want, f"{name} block {i} ({i * 4096}): WRONG BYTES returned"
    # With an intact published copy in SHARED, serving it is fine; without one, EIO.
    healable = intact_copy_in(m.shared, needle)
    assert not (also_shared and healable)
    if not healable:
        assert blocks[damaged_block] == errno.EIO, (
            f"{name} block {damaged_block} is damaged everywhere, yet read returned data")
        with pytest.raises(OSError) as exc:
            (m.mnt / name).read_bytes()
        assert exc.value.errno == errno.EIO
    for other, content in files.items():
        if other != name:
            assert (m.mnt / other).read_bytes() == content, other
    # The filesystem stays usable: new writes and a clean unmount.
    (m.mnt / "after").write_bytes(b"fine")
    m.remount()
    assert (m.mnt / "after").read_bytes() == b"fine"


@pytest.mark.timeout(120)
def test_torn_tail_is_end_of_log(make_mount: MakeMount) -> None:
    m = make_mount(segment_size="1M")
    first = rng_files(5, {"a": 1_500_000})
    write_files(m.mnt, first)
    last = rng_files(6, {"b": 100_000})["b"]
    write_files(m.mnt, {"b": last})
    m.kill()
    m.clean_stale()
    newest = segments(m.nvme)[-1]
    blob = newest.read_bytes()
    at = find(blob, last[50_000 : 50_000 + CHUNK])
    if at == -1:
        pytest.skip(f"b's data is not in the newest segment {newest.name}")
    os.truncate(newest, at)  # cut in the middle of b's data record

    res, report = replay_json(m.nvme)
    assert res.rc == 0, f"a torn tail is the end of the log, not corruption: {res}"
    assert report["corruption"] in ([], None, 0), report
    m.start()
    assert (m.mnt / "a").read_bytes() == first["a"]
    if (m.mnt / "b").exists():
        try:
            got = (m.mnt / "b").read_bytes()
        except OSError as e:
            assert e.errno == errno.EIO
        else:
            assert got == last[: len(got)], "b after a torn tail must be a prefix, not zeros"


@pytest.mark.parametrize("hole_at", [256 << 10, (256 << 10) + 40_000, 700 << 10])
def test_a_page_lost_in_the_unsynced_tail_never_reads_as_zeros(make_mount: MakeMount,
                                                                hole_at: int) -> None:
    """A power loss can keep later pages of the log's unsynced tail and lose an earlier one.
    Replay took the record torn by the lost page for corruption and applied the records after
    it: the lost records' ranges read as zeros. Now the newest segment's log ends at such a
    hole: the file reads as a prefix of what was written (or EIO where a record kept its
    extent), never as wrong bytes."""
    m = make_mount(segment_size="4M")
    data = random.Random(7).randbytes(1 << 20)
    fd = os.open(m.mnt / "f.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    for off in range(0, len(data), 32 << 10):  # 32 KiB records, never fsync'd
        os.write(fd, data[off:off + (32 << 10)])
    os.close(fd)
    m.kill()
    m.clean_stale()
    newest = segments(m.nvme)[-1]
    with open(newest, "r+b") as f:  # the page that never reached the disk
        f.seek(hole_at & ~4095)
        f.write(bytes(4096))
    m.start()
    size = (m.mnt / "f.bin").stat().st_size
    fd = os.open(m.mnt / "f.bin", os.O_RDONLY)
    eio = 0
    try:
        for off in range(0, size, 4096):
            try:
                got = os.pread(fd, 4096, off)
            except OSError as e:
                assert e.errno == errno.EIO, e
                eio += 1
                continue
            assert got == data[off:off + len(got)], f"wrong bytes at {off} of {size}"
    finally:
        os.close(fd)
    assert size < len(data) or eio, "the file came back whole: the test hit no record"


def test_replay_through_the_console_script(make_mount: MakeMount) -> None:
    m = make_mount()
    (m.mnt / "x").write_bytes(b"x")
    m.unmount()
    res = run_cli("replay", m.nvme, "--json", console=True)
    assert res.rc == 0, str(res)
    assert json.loads(res.out)["files"] == 1
