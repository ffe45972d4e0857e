"""The drain turns a metadata storm into a few big objects: thousands of small checkpoint files
written through the mount by several processes become O(segments) files and namespace
operations on SHARED, and `export`, `ls` and `fsck` see every byte. `ckptfs umount` drains
before it unmounts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mounting import MakeMount
from test_shared_support import (
    SEGMENT_BYTES,
    assert_fsck_clean,
    assert_tree,
    blob,
    cli,
    export_files,
    ls_json,
    objects,
    reap_after_cli_umount,
    start_node,
    status,
    store_files,
    storm_paths,
    storm_size,
    temp_files,
    tree_diff,
    wait_published,
    write_tree,
)

WRITER = Path(__file__).with_name("test_shared_support.py")
# Namespace operations the store charges a round trip for; each must be O(segments).
METADATA_OPS = ("create", "rename", "fsync", "fsync_dir", "mkdir", "unlink")


def run_storm(mnt: Path, tmp_path: Path, ranks: int, steps: list[int],
              per_rank: int) -> dict[str, bytes]:
    """`ranks` writer processes, each writing per_rank files into every step directory;
    rank 0 also writes each step's .metadata by temp + rename. Returns what must be there."""
    expected: dict[str, bytes] = {}
    procs = []
    for s in steps:
        (mnt / f"step_{s}").mkdir()
    for rank in range(ranks):
        files = storm_paths(rank, steps, per_rank)
        renamed = [f"step_{s}/.metadata" for s in steps] if rank == 0 else []
        spec = tmp_path / f"spec-{rank}.json"
        spec.write_text(json.dumps({"files": files, "renamed": renamed}))
        for rel in files + renamed:
            expected[rel] = blob(rel, storm_size(rel))
        procs.append(subprocess.Popen([sys.executable, str(WRITER), "write", str(mnt),
                                       str(spec)], stderr=subprocess.PIPE))
    try:
        for p in procs:
            _, err = p.communicate(timeout=240)
            assert p.returncode == 0, f"storm writer failed:\n{err.decode()}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return expected


def check_storm(make_mount: MakeMount, tmp_path: Path, ranks: int, steps: list[int],
                per_rank: int) -> None:
    m = start_node(make_mount, "a", "n0")
    expected = run_storm(m.mnt, tmp_path, ranks, steps, per_rank)
    n = len(expected)
    for s in steps:
        wait_published(m.mnt / f"step_{s}", timeout=120)

    st = status(m)
    assert st["last_error"] is None, st["last_error"]
    assert st["bytes_pending_upload"] == 0, st
    segs = st["segments_uploaded"]
    data = sum(len(b) for b in expected.values())
    assert segs >= data // SEGMENT_BYTES, f"{segs} objects cannot hold {data} bytes"

    # The count of files on SHARED is the count of objects plus a few manifests, not N.
    on_shared = store_files(m.shared)
    objs = objects(m.shared, "n0")
    assert len(objs) == segs, f"{len(objs)} object files but {segs} segments uploaded"
    assert temp_files(m.shared) == [], temp_files(m.shared)
    assert len(on_shared) <= segs + 4, (
        f"{len(on_shared)} files on SHARED for {segs} segments: "
        f"{[str(p.relative_to(m.shared)) for p in on_shared[:20]]}")
    assert len(on_shared) <= n // 50, f"{len(on_shared)} files on SHARED for {n} files written"
    # A few dozen-ish segments at most for this much data (idle and wait seals add some).
    assert segs <= data // SEGMENT_BYTES + 2 + 2 * len(steps) + 10, (
        f"{segs} objects for {data} bytes of {SEGMENT_BYTES}-byte segments")

    ops = st["shared_ops"]
    budget = 2 * (segs + st["manifests_published"]) + 6
    for op in METADATA_OPS:
        assert ops.get(op, 0) <= budget, (
            f"{ops.get(op)} {op} ops on SHARED for {segs} segments and "
            f"{st['manifests_published']} manifests ({n} files): {ops}")
    assert sum(ops.values()) < n // 10, f"shared ops {ops} are O(files) for {n} files"

    # ls lists every file with its size, from the node that wrote it.
    listed = {e["path"]: e for e in ls_json(m.shared)}
    files = {p: e for p, e in listed.items() if e["type"] == "f"}
    assert set(files) == set(expected), (
        f"ls: missing {sorted(set(expected) - set(files))[:5]}, "
        f"extra {sorted(set(files) - set(expected))[:5]}")
    wrong = [p for p, e in files.items() if e["size"] != len(expected[p]) or e["node"] != "n0"]
    assert not wrong, [(p, files[p], len(expected[p])) for p in wrong[:5]]
    assert {f"step_{s}" for s in steps} <= {p for p, e in listed.items() if e["type"] == "d"}

    # export reproduces every file byte for byte, with nothing extra.
    for s in steps:
        dest = tmp_path / "export" / f"step_{s}"
        got = export_files(m.shared, f"step_{s}", dest)
        want = {rel.split("/", 1)[1]: b for rel, b in expected.items()
                if rel.startswith(f"step_{s}/")}
        diff = tree_diff(want, got)
        assert not diff, f"export of step_{s} differs:\n  " + "\n  ".join(diff)

    rep = assert_fsck_clean(m.shared)
    assert rep["files"] == n, rep
    # and the mount itself still reads them all
    assert_tree(expected, m.mnt, "the mount")


def test_storm_of_small_files_becomes_few_objects(make_mount: MakeMount, tmp_path: Path) -> None:
    # 4 writer processes x 3 steps x 250 files + 3 .metadata = 3,003 files, ~25 MB.
    check_storm(make_mount, tmp_path, ranks=4, steps=[1, 2, 3], per_rank=250)


@pytest.mark.slow
def test_storm_of_ten_thousand_files(make_mount: MakeMount, tmp_path: Path) -> None:
    check_storm(make_mount, tmp_path, ranks=8, steps=[1, 2, 3, 4, 5], per_rank=250)


def test_umount_drains_before_unmounting(make_mount: MakeMount, tmp_path: Path) -> None:
    a = start_node(make_mount, "a", "n0", extra=["--seal-idle", "60"])
    expected = {f"step_7/__{r}_0.distcp": blob(f"u{r}", 300_000 + r * 1000) for r in range(8)}
    expected["step_7/.metadata"] = b"meta" * 100
    expected["big.bin"] = blob("big", 9 << 20)  # spans segments
    write_tree(a.mnt, expected)
    # no wait: umount itself must publish everything before it unmounts
    res = cli("umount", a.mnt)
    assert "unmounted" in res.stdout, res.stdout
    assert reap_after_cli_umount(a) == 0, a.log_tail()
    assert temp_files(a.shared) == []

    b = start_node(make_mount, "b", "n1", shared=a.shared)
    assert_tree(expected, b.mnt, "a fresh node after ckptfs umount of n0")
    got = export_files(a.shared, "step_7", tmp_path / "out")
    want = {k.split("/", 1)[1]: v for k, v in expected.items() if k.startswith("step_7/")}
    assert not tree_diff(want, got), tree_diff(want, got)
    assert_fsck_clean(a.shared)
    assert os.path.exists(b.mnt / "big.bin")


def test_ranks_that_each_wait_for_their_own_shard_share_the_seals(make_mount: MakeMount) -> None:
    """Every rank writing its shard and then `wait`ing for it: each wait sealed the active
    segment as soon as it came, and the next rank's shard was in a new one (64 ranks: 26-41
    objects on SHARED for one checkpoint). Waits that arrive within CKPTFS_WAIT_COALESCE
    (0.05 s; a generous 1 s here, so that a loaded machine cannot spread them out) share one
    seal, and each still returns only once its own shard is published."""
    import threading

    import ckptfs
    from ckptfs.export import export
    from ckptfs.shared import SharedStore

    m = start_node(make_mount, "a", "n0")
    m.unmount()
    m.env = {**os.environ, "CKPTFS_WAIT_COALESCE": "1"}
    m.start()
    before = status(m)["seals"]["wait"]
    ranks = 32
    (m.mnt / "step_1").mkdir()
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            p = m.mnt / "step_1" / f"__{r}_0.distcp"
            with open(p, "wb") as f:
                f.write(blob(f"r{r}", 100_000 + r))
                os.fsync(f.fileno())
            ckptfs.wait(p, timeout=60)
            # published: a node with no local state reads it back whole
            got = export(SharedStore(str(m.shared)), f"step_1/__{r}_0.distcp",
                         str(m.root / f"out{r}"))
            assert got == (1, 100_000 + r), got
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    seals = status(m)["seals"]["wait"] - before
    assert 1 <= seals <= 4, f"{ranks} waits made {seals} seals"
