"""Local copies of published segments are a cache: evicted (on request or by the watermarks),
reads come from the objects on SHARED and equal what was written, across remounts and an
offline replay that has to fetch evicted segments from SHARED."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import threading
import time
from pathlib import Path

from mounting import MakeMount
from test_shared_support import (
    assert_fsck_clean,
    assert_one_line_error,
    assert_tree,
    blob,
    cli,
    control,
    drop_caches,
    export_files,
    start_node,
    status,
    wait_published,
    write_tree,
)


def local_segments(nvme: Path) -> list[Path]:
    return sorted(p for p in (nvme / "segments").iterdir() if p.name.endswith(".seg"))


def test_evicted_segments_are_read_back_from_shared(make_mount: MakeMount) -> None:
    m = start_node(make_mount, "a", "n0")
    expected = {f"step_1/__{r}_0.distcp": blob(f"e{r}", 1_500_000 + 4099 * r) for r in range(6)}
    expected["step_1/big.bin"] = blob("ebig", 10 << 20)  # crosses segment boundaries
    expected["step_1/tiny"] = b"x"
    expected["step_1/empty"] = b""
    write_tree(m.mnt, expected)
    # holes and overwrites make extents that start inside records
    with open(m.mnt / "step_1/sparse.bin", "wb") as f:
        f.seek(3_000_000)
        f.write(b"end")
        f.seek(1000)
        f.write(b"middle" * 1000)
    sparse = bytearray(3_000_003)
    sparse[1000:7000] = b"middle" * 1000
    sparse[-3:] = b"end"
    expected["step_1/sparse.bin"] = bytes(sparse)
    assert_tree(expected, m.mnt, "the mount before eviction")  # reads verify the local copy
    wait_published(m.mnt / "step_1")

    before = status(m)
    n = control(m, {"op": "evict", "all": True})["evicted"]
    assert n == before["segments"].get("published", 0) and n >= 4, (n, before["segments"])
    assert local_segments(m.nvme) == [], local_segments(m.nvme)
    drop_caches()
    assert_tree(expected, m.mnt, "reads after evicting every local segment")
    st = status(m)
    assert st["shared_bytes_read"] >= sum(map(len, expected.values())) // 2, st
    assert st["segments"].get("evicted") == n, st["segments"]
    assert st["cache"]["evictions"] == n and st["corrupt_reads"] == 0

    # a remount starts with nothing local and still reads everything from SHARED
    m.remount()
    drop_caches()
    assert_tree(expected, m.mnt, "reads after a remount with every segment evicted")

    # offline: a full replay has to take the evicted segments from SHARED
    m.unmount()
    res = cli("replay", m.nvme, "--shared", m.shared, "--json")
    rep = json.loads(res.stdout)
    assert rep["corruption"] == [], rep
    assert rep["files"] == len(expected), rep
    m.start()
    assert_tree(expected, m.mnt, "reads after an offline replay and a remount")
    assert_fsck_clean(m.shared)


def test_replay_without_shared_flag_rebuilds_evicted_segments_or_says_why(
        make_mount: MakeMount) -> None:
    m = start_node(make_mount, "a", "n0")
    expected = {"f.bin": blob("f", 5 << 20)}
    write_tree(m.mnt, expected)
    wait_published(m.mnt)
    assert control(m, {"op": "evict", "all": True})["evicted"] >= 1
    m.unmount()
    res = cli("replay", m.nvme, "--json", check=False)
    assert "Traceback" not in res.stderr, res.stderr
    # Either it finds SHARED by itself and rebuilds everything, or it fails saying why; an
    # empty namespace reported as a success is neither.
    if res.returncode == 0:
        rep = json.loads(res.stdout)
        assert rep["files"] == len(expected) and rep["corruption"] == [], (
            f"replay without --shared of evicted segments reported success with: {rep}")
    else:
        assert_one_line_error(res, "replay without --shared")
    # whatever replay did, the next mount (which has SHARED) must still have the data
    m.start()
    assert_tree(expected, m.mnt, "a mount after `ckptfs replay NVME` without --shared")


def test_watermark_eviction_keeps_local_bytes_under_cache_size(make_mount: MakeMount) -> None:
    m = start_node(make_mount, "a", "n0", extra=["--cache-size", "16M"])
    expected = {}
    for i in range(16):  # 64 MiB in 4 MiB segments: four times the cache
        rel = f"step_{i // 4}/__{i % 4}_0.distcp"
        expected[rel] = blob(f"w{i}", 4 << 20)
        write_tree(m.mnt, {rel: expected[rel]})
    wait_published(m.mnt, timeout=120)
    st = status(m)
    assert st["cache"]["evictions"] > 0, st["cache"]
    # Watermark eviction runs in the background: give it a bounded moment to get under.
    from test_shared_support import wait_status

    st = wait_status(m, lambda s: s["local_bytes_used"] <= 16 << 20, 10,
                     "local bytes to fall under --cache-size")
    assert st["cache"]["enospc_errors"] == 0, st["cache"]
    drop_caches()
    assert_tree(expected, m.mnt, "reads with a 16M local cache for 64M of data")
    assert status(m)["shared_bytes_read"] > 0
    assert_fsck_clean(m.shared)


def test_a_manifest_follows_published_data_without_anyone_waiting(
        make_mount: MakeMount) -> None:
    """Nobody runs `ckptfs wait`: once the writers are quiet, the published data gets a
    manifest by itself (the publisher used to go back to sleep after its one look, with a
    manifest owed, until the next seal or wait)."""
    m = make_mount(extra_args=["--seal-idle", "0.5"])
    d = m.mnt / "step_1"
    d.mkdir()
    (d / "shard").write_bytes(b"s" * 100_000)
    written = status(m)["log_seq"]
    deadline = time.monotonic() + 20  # < the 30 s after which a manifest is due anyway
    while time.monotonic() < deadline:
        st = status(m)
        if st["published_seq"] >= written:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"no manifest covers the data 20 s later, nobody waiting: "
                             f"published_seq {st['published_seq']}, log_seq {written}, "
                             f"segments {st['segments']}")
    assert any((m.shared / "ckptfs" / "manifests").rglob("*.manifest"))


def test_a_failed_export_leaves_an_earlier_copy_whole_and_no_partial_file(
        make_mount: MakeMount, tmp_path: Path) -> None:
    """Exporting again into the same DEST after the object was damaged: the export fails
    with one line and the good copy from before is untouched (it was truncated in place),
    with no temp file beside it."""
    m = start_node(make_mount, "a", "n0")
    data = blob("x", 3 << 20)
    write_tree(m.mnt, {"step_1/shard": data})
    wait_published(m.mnt)
    m.unmount()
    dest = tmp_path / "out"
    assert cli("export", m.shared, "step_1", dest).returncode == 0
    assert (dest / "shard").read_bytes() == data
    obj = max((m.shared / "ckptfs" / "objects" / "n0").rglob("*.seg"),
              key=lambda p: p.stat().st_size)
    with open(obj, "r+b") as f:  # a byte in the middle of the shard's data
        f.seek(obj.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    res = cli("export", m.shared, "step_1", dest, check=False)
    assert "checksum" in assert_one_line_error(res, "export of a damaged object")
    assert (dest / "shard").read_bytes() == data
    assert sorted(p.name for p in dest.iterdir()) == ["shard"]


def test_export_warns_of_a_checkpoint_without_its_commit_marker(make_mount: MakeMount,
                                                                tmp_path: Path) -> None:
    """`ls` calls a checkpoint without a published marker incomplete; `export` of it said
    nothing (after a crash it can hold a shard published in part). Now it warns, after the
    export; one with its marker exports silently."""
    m = start_node(make_mount, "a", "n0")
    write_tree(m.mnt, {"step_1/__0_0.distcp": b"1", "step_2/__0_0.distcp": b"2",
                       "step_2/.metadata": b"m"})
    wait_published(m.mnt)
    res = cli("export", m.shared, "step_1", tmp_path / "one")
    assert "warning: no commit marker published for step_1: may be incomplete" in res.stderr, \
        res.stderr
    assert (tmp_path / "one/__0_0.distcp").read_bytes() == b"1"
    res = cli("export", m.shared, "step_2", tmp_path / "two")
    assert res.stderr == "", res.stderr
    res = cli("export", m.shared, "", tmp_path / "all")
    assert "for step_1:" in res.stderr and "step_2" not in res.stderr, res.stderr


def test_export_again_after_paths_changed_kind_mirrors_the_published_tree(
        make_mount: MakeMount, tmp_path: Path) -> None:
    """A file that became a directory and a directory that became a file (or a symlink)
    between two exports into the same DEST: the second export replaces them, as it replaces
    changed files, instead of failing with "File exists"."""
    m = start_node(make_mount, "a", "n0")
    write_tree(m.mnt, {"step_1/a": b"file a", "step_1/b/x": b"in dir b", "step_1/c/y": b"y"})
    wait_published(m.mnt)
    dest = tmp_path / "out"
    cli("export", m.shared, "step_1", dest)
    os.unlink(m.mnt / "step_1/a")
    write_tree(m.mnt, {"step_1/a/inner": b"a is a directory now"})
    os.unlink(m.mnt / "step_1/b/x")
    os.rmdir(m.mnt / "step_1/b")
    write_tree(m.mnt, {"step_1/b": b"b is a file now"})
    os.unlink(m.mnt / "step_1/c/y")
    os.rmdir(m.mnt / "step_1/c")
    os.symlink("a/inner", m.mnt / "step_1/c")
    wait_published(m.mnt)
    cli("export", m.shared, "step_1", dest)
    assert (dest / "a/inner").read_bytes() == b"a is a directory now"
    assert (dest / "b").read_bytes() == b"b is a file now"
    assert os.readlink(dest / "c") == "a/inner"


def test_export_of_the_longest_names_and_of_names_like_its_temporary_files(
        make_mount: MakeMount, tmp_path: Path) -> None:
    """A 255-byte name exports (a temporary name made longer than the file's would not
    exist), and a published file whose name looks like an export's temporary file is
    exported as itself, neither overwritten nor taken for one."""
    m = start_node(make_mount, "a", "n0")
    files = {"d/" + "L" * 255: b"longest name", "d/a": b"file a",
             "d/.a.ckptfs-export": b"looks temporary", "d/.ckptfs-export.1.0": b"also"}
    write_tree(m.mnt, files)
    wait_published(m.mnt)
    got = export_files(m.shared, "d", tmp_path / "out")
    assert got == {k[2:]: v for k, v in files.items()}, sorted(got)


def test_export_removes_the_temporary_files_of_a_killed_export(make_mount: MakeMount,
                                                               tmp_path: Path) -> None:
    """A SIGKILLed export leaves its `.ckptfs-export.PID.N` file beside a name; the next
    export into the same directory removes it. One of a live process stays."""
    m = start_node(make_mount, "a", "n0")
    write_tree(m.mnt, {"step_1/sub/shard": b"data", "step_1/top": b"t"})
    wait_published(m.mnt)
    gone = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    dest = tmp_path / "out"
    (dest / "sub").mkdir(parents=True)
    dead = dest / "sub" / f".ckptfs-export.{dead_pid}.0"
    live = dest / "sub" / f".ckptfs-export.{os.getpid()}.3"
    dead.write_bytes(b"half a shard")
    live.write_bytes(b"being written")
    cli("export", m.shared, "step_1", dest)
    assert sorted(p.name for p in (dest / "sub").iterdir()) == sorted(["shard", live.name])
    assert (dest / "sub" / "shard").read_bytes() == b"data"


def test_export_of_small_files_far_apart_reads_only_them(make_mount: MakeMount,
                                                         tmp_path: Path) -> None:
    """Export reads a run of small records in one read, but small files lying far apart in
    an object (written between big ones) are read on their own, not each with the next
    4 MiB of the object."""
    from ckptfs.export import export
    from ckptfs.shared import SharedStore

    m = start_node(make_mount, "a", "n0", segment_size="64M")
    small = {}
    for i in range(20):
        small[f"small/{i}"] = blob(f"s{i}", 4096)
        write_tree(m.mnt, {f"small/{i}": small[f"small/{i}"],
                           f"big/{i}": blob(f"b{i}", 3 << 20)})
    wait_published(m.mnt)
    store = SharedStore(str(m.shared))
    n, nbytes = export(store, "small", str(tmp_path / "out"))
    assert (n, nbytes) == (20, 20 * 4096)
    assert {f"small/{p.name}": p.read_bytes() for p in (tmp_path / "out").iterdir()} == small
    assert store.bytes_read < 2 * 20 * 4096, store.bytes_read  # was 20 x 4 MiB


def test_export_reads_the_few_byte_records_of_a_chain_alongside_the_big_ones(
        make_mount: MakeMount, tmp_path: Path) -> None:
    """A file written 1 MiB at a time from a buffer not aligned to a page (a `bytes` slice, a
    tensor's storage) is a chain of records of 1 MiB less a few bytes and of those few bytes.
    Export read each few-byte record at once and alone, so each stopped it for a whole
    request while the big ones waited behind (~1 MiB per round trip to S3): now those go on
    the pool with the big ones. A store 20 ms away counts the small reads in flight."""
    from ckptfs.export import export
    from ckptfs.shared import SharedStore

    class FarStore(SharedStore):
        def __init__(self, root: str) -> None:
            super().__init__(root)
            self.lock = threading.Lock()
            self.small_now = self.small_most = self.small_reads = 0

        def read_range(self, node: str, seg: int, offset: int, length: int) -> bytes:
            small = length < 4096
            with self.lock:
                if small:
                    self.small_reads += 1
                    self.small_now += 1
                    self.small_most = max(self.small_most, self.small_now)
            try:
                time.sleep(0.02)
                return super().read_range(node, seg, offset, length)
            finally:
                if small:
                    with self.lock:
                        self.small_now -= 1

    m = start_node(make_mount, "a", "n0")
    data = blob("chain", 16 << 20)
    # 8 bytes past a page: each 1 MiB spans 257 pages. (A fresh `bytes` slice each time was
    # not enough: its memory is wherever malloc puts it, the same chunk for every slice,
    # and once, in the CI's test process, no write was split.)
    src = mmap.mmap(-1, len(data) + 4096)
    src[8:8 + len(data)] = data
    fd = os.open(m.mnt / "shard.distcp", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        with memoryview(src) as view:
            for off in range(0, len(data), 1 << 20):
                os.write(fd, view[8 + off:8 + off + (1 << 20)])
        os.fsync(fd)
    finally:
        os.close(fd)
        src.close()
    wait_published(m.mnt)
    store = FarStore(str(m.shared))
    assert export(store, "shard.distcp", str(tmp_path / "out"))[1] == len(data)
    assert (tmp_path / "out" / "shard.distcp").read_bytes() == data
    assert store.small_reads == 16, store.small_reads  # the chain: one few-byte record per MiB
    assert store.small_most >= 2, store.small_most  # was 1: read one at a time, in line
