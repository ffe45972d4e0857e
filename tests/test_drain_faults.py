"""Shared-store trouble during a drain: SHARED read-only, removed, or full. Writes keep landing
on NVMe, `status` names the problem, `wait` times out with one line, and once the store is
repaired the drain finishes by itself and everything verifies. And a daemon SIGKILLed in the
middle of an upload: the remount cleans the half-written temp object and publishes each
segment exactly once.

The faults are real ones for root (who ignores permission bits): a read-only bind mount, the
directory renamed away, a full tmpfs. Each is undone in a `finally`."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mounting import MakeMount, Mount, ckptfs_cmd, is_mounted, wait_for
from test_shared_support import (
    assert_fsck_clean,
    assert_one_line_error,
    assert_tree,
    batch_dirs,
    blob,
    cli,
    control,
    drop_caches,
    export_files,
    fsck,
    ls_json,
    manifests,
    node_args,
    objects,
    start_node,
    status,
    store_root,
    temp_files,
    tree_diff,
    wait_published,
    wait_status,
    write_tree,
)

import ckptfs
from ckptfs import manifest
from ckptfs.layout import fsync_file

# Retries back off up to 30 s (ckptfs/drain.py); a short fault keeps the next retry close.
RECOVER_WITHIN = 60.0
REPO = Path(__file__).resolve().parent.parent


def run(*cmd: str) -> None:
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, f"{' '.join(cmd)}: {res.stderr.strip()}"


def _umount(target: Path) -> None:
    res = subprocess.run(["umount", str(target)], check=False, capture_output=True, text=True,
                         timeout=30)
    if res.returncode != 0:
        subprocess.run(["umount", "-l", str(target)], check=False, capture_output=True,
                       timeout=30)


@contextlib.contextmanager
def read_only(shared: Path) -> Iterator[str]:
    """SHARED/ckptfs becomes a read-only bind mount of itself: every create is EROFS."""
    target = store_root(shared)
    run("mount", "--bind", "-o", "ro", str(target), str(target))
    try:
        yield "EROFS"
    finally:
        _umount(target)


@contextlib.contextmanager
def removed(shared: Path) -> Iterator[str]:
    """SHARED/ckptfs vanishes (an unmounted or wiped NAS) and comes back."""
    target = store_root(shared)
    away = shared / "ckptfs.away"
    os.rename(target, away)
    try:
        yield "ENOENT"
    finally:
        if target.exists():
            # something recreated the layout while it was gone: keep it for the assertion
            os.rename(target, shared / "ckptfs.recreated")
        os.rename(away, target)


@contextlib.contextmanager
def full(shared: Path) -> Iterator[str]:
    """The node's object directory is a full tmpfs: every write is ENOSPC."""
    target = store_root(shared) / "objects" / "n0"
    target.mkdir(parents=True, exist_ok=True)
    run("mount", "-t", "tmpfs", "-o", "size=256k,mode=0755", "tmpfs", str(target))
    try:
        fd = os.open(target / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * 4096)
        finally:
            os.close(fd)
        assert os.statvfs(target).f_bavail == 0, "the tmpfs is not full"
        yield "ENOSPC"
    finally:
        _umount(target)


FAULTS = {"read-only": read_only, "removed": removed, "full": full}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_drain_survives_shared_store_fault(make_mount: MakeMount, tmp_path: Path,
                                          fault: str) -> None:
    m = start_node(make_mount, "a", "n0")
    before = {f"step_1/__{r}_0.distcp": blob(f"p{r}", 900_000 + r) for r in range(4)}
    write_tree(m.mnt, before)
    wait_published(m.mnt / "step_1")
    published_before = {p.name for p in objects(m.shared, "n0")}

    during = {f"step_2/__{r}_0.distcp": blob(f"d{r}", 2_000_000 + r) for r in range(5)}
    later = {f"step_2/__{r}_1.distcp": blob(f"l{r}", 700_000 + r) for r in range(3)}
    with contextlib.ExitStack() as stack:  # the background wait, killed if the test fails
        with FAULTS[fault](m.shared) as why:
            # training writes keep landing on NVMe, fsync included
            write_tree(m.mnt, during)
            fsync_file(str(m.mnt / "step_2/__0_0.distcp"))
            t0 = time.monotonic()
            res = cli("wait", m.mnt / "step_2", "--timeout", "3", check=False, timeout=60)
            took = time.monotonic() - t0
            line = assert_one_line_error(res, f"wait during a {fault} store")
            assert "timed out" in line, line
            assert took < 20, f"wait --timeout 3 took {took:.1f}s"
            with pytest.raises(TimeoutError):  # the Python API says the same
                ckptfs.wait(m.mnt / "step_2", timeout=1)
            st = wait_status(m, lambda s: s["last_error"], 15, "status to report the fault")
            assert why in st["last_error"], (
                f"last_error {st['last_error']!r} does not say {why!r}")
            assert st["bytes_pending_upload"] > 0, st
            write_tree(m.mnt, later)  # still writable after the failed wait
            assert_tree({**before, **during, **later}, m.mnt, f"the mount during a {fault} store")
            # a wait with no timeout says why it is still waiting, and returns once repaired;
            # the drain's failure started before this wait did, and counts from there
            wait_status(m, lambda s: s["failing_for_s"] >= 4, 30, "4 s of drain failure")
            waiter = stack.enter_context(subprocess.Popen(
                ckptfs_cmd("wait", m.mnt / "step_2"), stdin=subprocess.DEVNULL, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env={**os.environ, "CKPTFS_WAIT_NOTICE_AFTER": "4"}))
            stack.callback(lambda: waiter.poll() is None and waiter.kill())
            assert waiter.stderr is not None
            ready, _, _ = select.select([waiter.stderr], [], [], 3.5)
            notice = waiter.stderr.readline() if ready else ""
            assert "still waiting" in notice and why in notice, (
                f"wait during a {fault} store printed {notice!r} within 3.5 s, not why it is "
                "still waiting")
            said = re.search(r"failing for (\d+) s", notice)
            assert said and int(said[1]) >= 4, notice
        # each failure is in the log once, however many streams retry it how often
        said = re.findall(r"ERROR ckptfs\.drain: drain: (.*) \(will retry\)",
                          m.log_path.read_text())
        assert said and len(said) == len(set(said)), "\n".join(said)
        recreated = m.shared / "ckptfs.recreated"
        assert not recreated.exists(), (
            "the daemon recreated SHARED/ckptfs while it was gone: "
            f"{sorted(str(p.relative_to(m.shared)) for p in recreated.rglob('*'))}")
        if fault == "full":
            assert not (store_root(m.shared) / "objects/n0/filler").exists()

        # repaired: no one asks, the drain finishes by itself
        log_seq = status(m)["log_seq"]
        wait_status(m, lambda s: s["last_error"] is None and s["bytes_pending_upload"] == 0
                    and s["published_seq"] >= log_seq, RECOVER_WITHIN,
                    f"the drain to finish by itself after the {fault} store was repaired")
        out, err = waiter.communicate(timeout=60)
        assert waiter.returncode == 0 and "published" in out, (waiter.returncode, out, err)
        wait_published(m.mnt, timeout=30)
        assert temp_files(m.shared) == [], temp_files(m.shared)
        assert published_before <= {p.name for p in objects(m.shared, "n0")}

        expected = {**before, **during, **later}
        got = export_files(m.shared, "step_2", tmp_path / "out2")
        want = {k.split("/", 1)[1]: v for k, v in expected.items() if k.startswith("step_2/")}
        assert not tree_diff(want, got), tree_diff(want, got)
        assert {e["path"] for e in ls_json(m.shared) if e["type"] == "f"} == set(expected)
        assert_fsck_clean(m.shared)


def test_a_silent_shared_store_is_reported_and_never_holds_a_command_or_the_daemon(
        make_mount: MakeMount, tmp_path: Path) -> None:
    """A NAS that hangs (an NFS hard mount whose server is gone) fails nothing: calls into it
    just block. Stood in for by the NAS emulator stopped with SIGSTOP. Writes and fsyncs go
    on; `wait` says the store does not answer and times out with that reason; `status`
    counts the silence; the unmount's daemon exits anyway; `mount`, `ls` and `export` give
    one line instead of hanging. Once the store answers again, the remount publishes what
    it owed."""
    sys.path.insert(0, str(REPO))
    from bench.nasemu import NasEmu

    m = make_mount("a", node_args("n0"), start=False)
    m.env = {**os.environ, "CKPTFS_EXIT_GRACE": "2"}
    quick = {"CKPTFS_SHARED_TIMEOUT": "2", "CKPTFS_WAIT_NOTICE_AFTER": "2"}
    first = {"step_1/a": blob("a", 3_000_000)}
    second = {"step_2/b": blob("b", 3_000_000)}
    with NasEmu(tmp_path / "backing", m.shared, meta_latency_us=0, meta_ops_per_sec=0,
                bandwidth_mbps=0, log_path=tmp_path / "nasemu.log") as nas:
        assert nas.pid is not None
        try:
            m.start()
            write_tree(m.mnt, first)
            wait_published(m.mnt / "step_1")
            os.kill(nas.pid, signal.SIGSTOP)
            write_tree(m.mnt, second)  # lands on NVMe, fsync included
            fsync_file(str(m.mnt / "step_2/b"))
            assert_tree({**first, **second}, m.mnt, "the mount while SHARED is silent")

            res = cli("wait", m.mnt / "step_2", "--timeout", "5", check=False, env=quick)
            line = assert_one_line_error(res, "wait on a silent store")
            assert "timed out" in line and "has not answered" in line, line
            assert "still waiting, the shared store has not answered" in res.stderr, res.stderr
            st = status(m)
            # the oldest call waiting on the store: step_2's upload, or a refresh's listing
            # of the other nodes' manifests that went out first on a loaded machine
            assert st["shared_stalled_s"] >= 4, st
            assert st["shared_stalled_on"] in ("upload", "listing"), st
            assert "no answer for" in cli("status", m.mnt).stdout

            t0 = time.monotonic()
            m.unmount(timeout=30)  # asserts a clean exit (0) of the daemon
            took = time.monotonic() - t0
            assert took < 15, f"the daemon took {took:.1f} s to exit without the store"
            assert "exiting without it" in m.log_path.read_text(), m.log_tail()

            (tmp_path / "nvme2").mkdir()
            (tmp_path / "shared2").mkdir()
            for args in (("mount", m.nvme, m.shared, m.mnt), ("ls", m.shared),
                         ("export", m.shared, "step_1", tmp_path / "out"),
                         # the silent store as another mount's cold tier
                         ("mount", tmp_path / "nvme2", tmp_path / "shared2", m.mnt,
                          "--keep-shared", "1", "--cold", m.shared)):
                t0 = time.monotonic()
                res = cli(*args, check=False, env=quick, timeout=60)
                line = assert_one_line_error(res, f"{args[0]} on a silent store")
                assert "does not answer" in line, line
                assert time.monotonic() - t0 < 20, f"{args[0]} took too long to give up"
            assert not (tmp_path / "out").exists()
            assert not is_mounted(m.mnt, None)
        finally:
            os.kill(nas.pid, signal.SIGCONT)
        m.start()
        wait_published(m.mnt / "step_2")
        m.unmount()
        assert export_files(m.shared, "step_2", tmp_path / "out") == {"b": second["step_2/b"]}


def test_a_store_whose_fsync_fails_is_retried_from_scratch_and_nothing_is_lost(
        make_mount: MakeMount, tmp_path: Path) -> None:
    """The NAS's fsync fails with EIO (its disk failed a writeback): an object or a manifest
    whose fsync failed may be missing bytes, so it is never renamed into place; the drain
    reports EIO and retries with a fresh temp copy. Once the NAS is healthy, everything is
    published once, whole, and verifies."""
    sys.path.insert(0, str(REPO))
    from bench.nasemu import NasEmu

    m = make_mount("a", node_args("n0"), start=False)
    first = {"step_1/__0_0.distcp": blob("e1", 400_000)}
    second = {f"step_2/__{r}_0.distcp": blob(f"e2{r}", 900_000 + r) for r in range(3)}
    with NasEmu(tmp_path / "backing", m.shared, meta_latency_us=0, meta_ops_per_sec=0,
                bandwidth_mbps=0, log_path=tmp_path / "nasemu.log") as nas:
        try:
            m.start()
            write_tree(m.mnt, first)
            wait_published(m.mnt / "step_1")
            published = {p.name for p in objects(m.shared, "n0")}
            nas.fail_fsyncs()
            write_tree(m.mnt, second)
            fsync_file(str(m.mnt / "step_2/__0_0.distcp"))  # the local fsync is not the NAS's
            res = cli("wait", m.mnt / "step_2", "--timeout", "3", check=False)
            line = assert_one_line_error(res, "wait while the NAS's fsync fails")
            assert "timed out" in line and "Input/output error" in line, line
            st = wait_status(m, lambda s: s["last_error"], 15, "the fsync failure")
            assert "EIO" in st["last_error"], st
            assert {p.name for p in objects(m.shared, "n0")} == published, (
                "an object whose fsync failed was renamed into place")
        finally:
            nas.fail_fsyncs(False)
        wait_published(m.mnt / "step_2", timeout=RECOVER_WITHIN)
        assert status(m)["last_error"] is None
        assert temp_files(m.shared) == [], temp_files(m.shared)
        got = export_files(m.shared, "step_2", tmp_path / "out")
        assert not tree_diff({k.split("/", 1)[1]: v for k, v in second.items()}, got)
        assert_fsck_clean(m.shared)
        m.unmount()


def test_mount_comes_up_while_the_store_refuses_its_cleanup(make_mount: MakeMount,
                                                            tmp_path: Path) -> None:
    """A crash left a temp object on SHARED and SHARED is read-only when the node mounts
    again: the mount still comes up and takes writes and fsyncs (they land on NVMe), status
    says why nothing drains, and once the store is writable the leftover is removed and
    everything is published."""
    m = start_node(make_mount, "a", "n0")
    first = {"step_1/__0_0.distcp": blob("one", 400_000)}
    write_tree(m.mnt, first)
    wait_published(m.mnt / "step_1")
    m.unmount()
    leftover = store_root(m.shared) / "objects" / "n0" / ".tmp.00000000000000ff.seg.1"
    leftover.write_bytes(b"half an upload")
    later = {f"step_2/__{r}_0.distcp": blob(f"two{r}", 600_000 + r) for r in range(3)}
    with read_only(m.shared):
        t0 = time.monotonic()
        m.start()
        assert time.monotonic() - t0 < 30, "the mount waited for the shared store"
        write_tree(m.mnt, later)
        fsync_file(str(m.mnt / "step_2/__0_0.distcp"))
        st = wait_status(m, lambda s: s["last_error"], 15, "status to report the cleanup")
        assert "clean temp files" in st["last_error"] and "EROFS" in st["last_error"], st
        assert st["drain_ready"] is False, st
        res = cli("wait", m.mnt / "step_2", "--timeout", "2", check=False, timeout=60)
        assert "timed out" in assert_one_line_error(res, "wait while SHARED is read-only")
    wait_published(m.mnt / "step_2", timeout=RECOVER_WITHIN)
    assert not leftover.exists()
    assert status(m)["last_error"] is None and status(m)["drain_ready"] is True
    got = export_files(m.shared, "step_2", tmp_path / "out")
    assert not tree_diff({k.split("/", 1)[1]: v for k, v in later.items()}, got)
    assert_tree({**first, **later}, m.mnt, "the mount after the store came back")


# -- a backlog is published in batches ----------------------------------------------------------


def test_backlog_is_published_in_batch_directories(make_mount: MakeMount,
                                                   tmp_path: Path) -> None:
    """Segments that waited together (here: while SHARED was away) are published together, as
    batch directories of at most --publish-batch objects: one mkdir, one create per object and
    one rename per batch. Everything in them reads back from a fresh node and through export;
    a crash's half-made batch directory is removed at the next mount; GC takes a batch's
    directory with its last object."""
    m = start_node(make_mount, "a", "n0", extra=["--publish-batch", "4", "--gc-grace", "0"],
                   segment_size="1M")
    first = {"step_1/__0_0.distcp": blob("f", 300_000)}
    write_tree(m.mnt, first)
    wait_published(m.mnt / "step_1")
    before = status(m)
    files = {f"step_2/__{r}_0.distcp": blob(f"b{r}", 700_000 + 1000 * r) for r in range(16)}
    with removed(m.shared):
        write_tree(m.mnt, files)
        wait_status(m, lambda s: s["last_error"] and s["segments"].get("sealed", 0)
                    + s["segments"].get("uploading", 0) >= 8, 30,
                    "a backlog of sealed segments while SHARED is away")
    wait_published(m.mnt / "step_2", timeout=120)
    st = status(m)
    new_segs = st["segments_uploaded"] - before["segments_uploaded"]
    assert new_segs >= 8, st

    batches = batch_dirs(m.shared, "n0")
    assert batches, f"no batch directory for a backlog of {new_segs} segments"
    assert st["batches_published"] == len(batches), (st["batches_published"], batches)
    in_batches = 0
    for d in batches:
        ids = sorted(int(p.name[:16], 16) for p in d.glob("*.seg"))
        assert 2 <= len(ids) <= 4, f"{d.name}: {len(ids)} objects (--publish-batch 4)"
        assert d.name == f"b{ids[0]:016x}-{ids[-1]:016x}", (d.name, ids)
        in_batches += len(ids)
    objs = objects(m.shared, "n0")
    assert len(objs) == st["segments_uploaded"], (len(objs), st["segments_uploaded"])
    singles = len(objs) - in_batches
    # every publish is exactly one rename (object, batch or manifest); a batch costs one mkdir
    # and one create per object
    ops = st["shared_ops"]
    assert ops["rename"] == singles + len(batches) + st["manifests_published"], ops
    assert ops["create"] == len(objs) + st["manifests_published"], ops
    # + objects/, objects/n0, manifests/ and manifests/n0 (the first node on this SHARED)
    assert ops["mkdir"] == len(batches) + 4, ops
    # the backlog's objects: one create each, plus a mkdir and a rename per batch, plus a
    # rename per object published alone (every attempt failed at the store check, before any
    # namespace operation, while SHARED was away)
    new_singles = singles - 1  # step_1's segment was published alone before
    manifests_ops = 2 * (st["manifests_published"] - before["manifests_published"])
    namespace = sum(ops.get(k, 0) - before["shared_ops"].get(k, 0)
                    for k in ("create", "rename", "mkdir")) - manifests_ops
    assert namespace == new_segs + 2 * len(batches) + new_singles, (
        f"{namespace} namespace ops for {new_segs} objects, {len(batches)} batches, "
        f"{new_singles} alone: {ops}\n{m.log_tail()}")
    assert namespace < 1.7 * new_segs, (
        f"{namespace} namespace ops for {new_segs} segments: not much better than one by one")
    assert temp_files(m.shared) == [], temp_files(m.shared)

    expected = {**first, **files}
    b = start_node(make_mount, "b", "n1", shared=m.shared)
    assert_tree(expected, b.mnt, "a fresh node reading objects from batch directories")
    b.unmount()
    got = export_files(m.shared, "step_2", tmp_path / "out")
    want = {k.split("/", 1)[1]: v for k, v in files.items()}
    assert not tree_diff(want, got), tree_diff(want, got)
    assert_fsck_clean(m.shared)

    # a batch directory half-made when the daemon died is removed by the next mount
    half = store_root(m.shared) / "objects" / "n0" / ".tmp.bffffffffffff0000-ffffffffffff0001.1"
    half.mkdir()
    (half / "ffffffffffff0000.seg").write_bytes(b"x" * 1000)
    m.unmount()
    m.start()
    wait_for(lambda: not half.exists(), 30, "the half-made batch directory to be removed")
    assert_tree(expected, m.mnt, "the remount")

    # GC deletes the objects of a deleted checkpoint and the directories they leave empty
    import shutil

    shutil.rmtree(m.mnt / "step_2")
    wait_published(m.mnt)
    control(m, {"op": "gc"})
    wait_for(lambda: not batch_dirs(m.shared, "n0"), 30,
             "the emptied batch directories to be removed by GC")
    assert_tree(first, m.mnt, "the mount after GC")


def test_a_checkpoint_published_in_several_batches_costs_one_manifest(
        make_mount: MakeMount, tmp_path: Path) -> None:
    """A manifest is a create, a rename and an unlink on SHARED: one per checkpoint, written
    once its last batch is published, not one at its first batch too (which every checkpoint
    after a pause longer than the manifest interval used to get)."""
    m = start_node(make_mount, "a", "n0", extra=["--upload-streams", "1", "--publish-batch",
                                                 "2", "--upload-limit", "8"],
                   segment_size="1M")
    before = status(m)["manifests_published"]
    ck = {f"ck/__{r}_0.distcp": blob(f"b{r}", (1 << 20) + 4096 * r) for r in range(8)}
    write_tree(m.mnt, ck)
    wait_published(m.mnt / "ck")
    st = status(m)
    assert st["batches_published"] >= 3, st  # the test needs several batches in a row
    assert st["manifests_published"] - before == 1, st
    got = export_files(m.shared, "ck", tmp_path / "out")
    assert not tree_diff({k[3:]: v for k, v in ck.items()}, got)


# -- SIGKILL during an upload ------------------------------------------------------------------


def object_digests(shared: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in objects(shared, "n0")}


def partial_temp(shared: Path) -> list[Path]:
    return [p for p in temp_files(shared) if p.stat().st_size > 0]


def kill_during_upload(m: Mount, expected: dict[str, bytes]) -> None:
    """Write `expected`, SIGKILL the daemon once a temp object is half-written."""
    write_tree(m.mnt, expected)
    for rel in expected:
        fsync_file(str(m.mnt / rel))
    wait_for(lambda: partial_temp(m.shared), 30, "a half-written temp object on SHARED",
             interval=0.01)
    m.kill()


def check_after_kill(m: Mount, tmp_path: Path, expected: dict[str, bytes]) -> None:
    wait_published(m.mnt, timeout=120)
    assert temp_files(m.shared) == [], f"temp objects left: {temp_files(m.shared)}"
    st = status(m)
    assert set(st["segments"]) <= {"published", "evicted", "dropped"}, st["segments"]
    digests = object_digests(m.shared)
    dup = len(digests) - len(set(digests.values()))
    assert dup == 0, f"{dup} objects hold the same bytes under two names: {digests}"
    data = sum(map(len, expected.values()))
    on_shared = sum(p.stat().st_size for p in objects(m.shared, "n0"))
    assert on_shared < data * 1.1 + (1 << 20), (
        f"{on_shared} bytes of objects for {data} bytes of data: something was published twice")
    listed = [e["path"] for e in ls_json(m.shared) if e["type"] == "f"]
    assert sorted(listed) == sorted(expected), listed
    got = export_files(m.shared, "ck", tmp_path / f"out{m.starts}")
    assert not tree_diff({k[3:]: v for k, v in expected.items()}, got)
    assert_tree(expected, m.mnt, "the mount after SIGKILL during an upload")
    assert_fsck_clean(m.shared)


def without_upload_limit(m: Mount) -> None:
    i = m.extra_args.index("--upload-limit")
    del m.extra_args[i:i + 2]


def test_sigkill_during_upload_then_remount_publishes_once(make_mount: MakeMount,
                                                           tmp_path: Path) -> None:
    # 16M segments copied in 8M chunks at 4 MB/s: a temp object stays half-written for ~2s.
    m = start_node(make_mount, "a", "n0", extra=["--upload-limit", "4"], segment_size="16M")
    expected = {"ck/big.bin": blob("k", 24 << 20),
                **{f"ck/small{i}": blob(f"s{i}", 10_000 * i + 1) for i in range(10)}}
    kill_during_upload(m, expected)
    left = temp_files(m.shared)
    assert left, "the kill left no temp object: the test did not hit an upload"
    without_upload_limit(m)
    m.remount()
    check_after_kill(m, tmp_path, expected)


def test_unmount_during_an_upload_exits_at_once_and_publishes_after_the_next_mount(
        make_mount: MakeMount, tmp_path: Path) -> None:
    """An unmount while a slow upload is in flight (`ckptfs umount --no-drain`, a service
    stop): the daemon exits within seconds instead of finishing the upload first (at 1 MB/s
    that would be 16 s per segment); what was not published stays on NVMe, and the next mount
    publishes it once."""
    m = start_node(make_mount, "a", "n0", extra=["--upload-limit", "1"], segment_size="16M")
    expected = {"ck/big.bin": blob("u", 24 << 20),
                **{f"ck/small{i}": blob(f"u{i}", 10_000 * i + 1) for i in range(10)}}
    write_tree(m.mnt, expected)
    for rel in expected:
        fsync_file(str(m.mnt / rel))
    wait_for(lambda: partial_temp(m.shared), 30, "an upload in flight", interval=0.01)
    m.unmount(timeout=10)  # fails unless the daemon exits 0 within 10 s
    assert "not yet on SHARED" in m.log_tail(), m.log_tail()
    without_upload_limit(m)
    m.start()
    check_after_kill(m, tmp_path, expected)


@pytest.mark.slow
def test_sigkill_at_random_moments_of_the_drain(make_mount: MakeMount, tmp_path: Path) -> None:
    rng = random.Random(int(os.environ.get("CKPTFS_DRAIN_KILL_SEED", "1")))
    m = start_node(make_mount, "a", "n0", extra=["--upload-limit", "20"], segment_size="4M")
    expected: dict[str, bytes] = {}
    for rnd in range(int(os.environ.get("CKPTFS_DRAIN_KILL_ROUNDS", "8"))):
        batch = {f"ck/r{rnd}_{i}.bin": blob(f"{rnd}.{i}", rng.randint(1, 3 << 20))
                 for i in range(rng.randint(1, 6))}
        write_tree(m.mnt, batch)
        expected.update(batch)
        time.sleep(rng.uniform(0, 1.5))  # a random moment of sealing/uploading/publishing
        m.kill()
        m.remount()
        assert_tree(expected, m.mnt, f"the mount after kill {rnd}")
    without_upload_limit(m)
    m.remount()
    check_after_kill(m, tmp_path, expected)


@contextlib.contextmanager
def immutable(d: Path) -> Iterator[None]:
    """No new names in directory d (`chattr +i`): what is there stays readable."""
    run("chattr", "+i", str(d))
    try:
        yield
    finally:
        run("chattr", "-i", str(d))


def test_the_object_of_a_dropped_segment_is_removed_once_the_store_lets_it(
        make_mount: MakeMount) -> None:
    """A segment whose upload failed may have its object on SHARED (an attempt that failed
    after the rename). If its data dies before the next attempt, it is dropped and that object
    removed; GC never looks for objects of dropped segments, so a removal that fails used to
    leave the object for good. Now it is retried with the batch. Here the objects are planted
    (what a late failure leaves) and SHARED's object directory is immutable: uploads and
    removals fail until it is writable again."""
    m = start_node(make_mount, "a", "n0", segment_size="1M")
    objdir = store_root(m.shared) / "objects" / "n0"
    objdir.mkdir(parents=True, exist_ok=True)
    planted = [objdir / f"{seg:016x}.seg" for seg in (1, 2)]
    for p in planted:
        p.write_bytes(b"left by an attempt that failed late")
    with immutable(objdir):
        write_tree(m.mnt, {"a.bin": blob("a", 4_500_000)})
        # (a segment may take two 1 MiB records: it is sealed once past --segment-size)
        wait_for(lambda: planted[1].name in (status(m)["last_error"] or ""), 30,
                 "the uploads of both segments to fail")
        os.unlink(m.mnt / "a.bin")
        time.sleep(3)  # a retry or two meets the dead segments
        assert all(p.exists() for p in planted)
    write_tree(m.mnt, {"b.bin": b"b"})
    wait_published(m.mnt)
    wait_for(lambda: not any(p.exists() for p in planted), RECOVER_WITHIN,
             "the dropped segments' objects to be removed")
    assert status(m)["segments"].get("dropped", 0) >= 2, status(m)["segments"]
    m.unmount()
    assert_fsck_clean(m.shared)


def test_gc_keeps_what_the_newest_manifest_names_until_a_newer_one_is_out(
        make_mount: MakeMount) -> None:
    """A deleted checkpoint's objects stay on SHARED while the newest manifest there still
    names them (another node, or `export`, reads that manifest, not this node's view): with
    new manifests refused, `ckptfs gc` deletes nothing and says why in one line; once a
    manifest without them is out, it deletes them, and SHARED stays consistent throughout."""
    m = start_node(make_mount, "a", "n0", extra=["--gc-grace", "0"], segment_size="1M")
    write_tree(m.mnt, {f"step_1/__{r}_0.distcp": blob(f"s{r}", 900_000) for r in range(3)})
    wait_published(m.mnt)
    before = {p.name for p in objects(m.shared, "n0")}
    with immutable(m.shared / "ckptfs" / "manifests" / "n0"):
        for r in range(3):
            os.unlink(m.mnt / f"step_1/__{r}_0.distcp")
        os.rmdir(m.mnt / "step_1")
        write_tree(m.mnt, {"step_2/x": blob("x", 900_000)})
        wait_for(lambda: status(m)["bytes_pending_upload"] == 0
                 and status(m)["segments"].get("published", 0) > len(before), 30,
                 "the deletion to be published (its objects; its manifest is refused)")
        res = cli("gc", m.mnt, check=False)
        assert "no manifest" in assert_one_line_error(res, "gc while manifests are refused")
        assert before <= {p.name for p in objects(m.shared, "n0")}
        rc, report, err = fsck(m.shared)
        assert rc == 0, (report, err)
    res = cli("gc", m.mnt)
    freed = int(res.stdout.split(" segments freed")[0].rsplit(" ", 1)[-1])
    assert freed > 0, res.stdout
    assert not before <= {p.name for p in objects(m.shared, "n0")}, "nothing was deleted"
    rc, report, err = fsck(m.shared)
    assert rc == 0, (report, err)
    assert (m.mnt / "step_2/x").read_bytes() == blob("x", 900_000)


def test_gc_keeps_the_top_object_so_a_new_nvme_never_reuses_an_object_name(
        make_mount: MakeMount) -> None:
    """Every object but the newest segment's is dead, and the newest segment was dropped (its
    data died before upload): gc deletes the dead objects but not the highest-numbered one,
    whose name is the node's high-water mark. A new NVME for the node numbers its segments
    after the objects it finds; with the top one deleted too it started again from 1 and
    published other bytes under old names (another node may still cache records of the old
    objects by name and position)."""
    m = start_node(make_mount, "a", "n0", extra=["--gc-grace", "0"], segment_size="1M")
    write_tree(m.mnt, {"a.bin": blob("a", 2_500_000)})
    wait_published(m.mnt)
    first = {int(p.name[:16], 16) for p in objects(m.shared, "n0")}
    assert len(first) >= 2, first
    os.unlink(m.mnt / "a.bin")
    write_tree(m.mnt, {"t.bin": blob("t", 100_000)})
    os.unlink(m.mnt / "t.bin")
    write_tree(m.mnt, {"empty": b""})
    wait_published(m.mnt)
    assert status(m)["segments"].get("dropped", 0) >= 1, status(m)["segments"]
    cli("gc", m.mnt)
    left = {int(p.name[:16], 16) for p in objects(m.shared, "n0")}
    assert left, "gc deleted every object of the node"
    assert max(left) >= max(first), (left, first)
    assert not first <= left, "gc deleted nothing"
    m.unmount()
    shutil.rmtree(m.nvme)
    m.nvme.mkdir()
    m.start()
    write_tree(m.mnt, {"b.bin": blob("b", 1_500_000)})
    wait_published(m.mnt)
    new = {int(p.name[:16], 16) for p in objects(m.shared, "n0")} - left
    assert new and min(new) > max(first), (sorted(new), sorted(first))
    assert (m.mnt / "b.bin").read_bytes() == blob("b", 1_500_000)
    assert not (m.mnt / "a.bin").exists()
    m.unmount()
    assert_fsck_clean(m.shared)


def test_gc_deletes_what_a_node_published_before_its_nvme_was_lost_once_unused(
        make_mount: MakeMount, tmp_path: Path) -> None:
    """A new NVME directory for a node imports the node's published files: their objects are
    named by IMPORT records, not by segments of the new log, and GC, which looked only at
    its log's segments, never deleted them once those files were deleted (SHARED grew by
    every checkpoint a node had published before a lost NVMe). Now an object of before goes
    once no file names it; one still in use, and the node's highest-numbered, stay."""
    m = start_node(make_mount, "a", "n0", extra=["--gc-grace", "0"], segment_size="1M")
    write_tree(m.mnt, {"old.bin": blob("old", 2_500_000)})
    wait_published(m.mnt)
    write_tree(m.mnt, {"keep.bin": blob("keep", 50_000)})
    wait_published(m.mnt)
    first = {int(p.name[:16], 16) for p in objects(m.shared, "n0")}
    assert len(first) >= 3, first
    m.unmount()
    shutil.rmtree(m.nvme)
    m.nvme.mkdir()
    m.start()
    assert (m.mnt / "old.bin").read_bytes() == blob("old", 2_500_000)
    os.unlink(m.mnt / "old.bin")
    write_tree(m.mnt, {"new.bin": blob("new", 100_000)})
    wait_published(m.mnt)
    cli("gc", m.mnt)
    left = {int(p.name[:16], 16) for p in objects(m.shared, "n0")}
    gone = first - left
    assert len(gone) >= 2, f"old.bin's objects were not deleted: {sorted(first)} -> {sorted(left)}"
    assert max(first) in left, "the object keep.bin is in was deleted"
    assert status(m)["gc"]["objects_deleted"] == len(gone), status(m)["gc"]
    assert (m.mnt / "keep.bin").read_bytes() == blob("keep", 50_000)
    m.unmount()
    assert_fsck_clean(m.shared)
    got = export_files(m.shared, "", tmp_path / "out")
    assert got == {"keep.bin": blob("keep", 50_000), "new.bin": blob("new", 100_000)}, \
        sorted(got)


@pytest.mark.parametrize("collected", [False, True], ids=["fresh", "after-gc"])
def test_a_damaged_published_view_is_rebuilt_by_replay(make_mount: MakeMount, tmp_path: Path,
                                                      collected: bool) -> None:
    """NVME/published (what manifests are built from) damaged: the mount fails with one line
    naming `ckptfs replay`, which rebuilds the view: from its snapshot, taken by GC before it
    deletes segments the view was built from, or from nothing when none was deleted. Then
    the node publishes as before. (The mount died with `mount failed: lmdb.InvalidError` and
    replay left the view as it was.)"""
    m = start_node(make_mount, "a", "n0", extra=["--gc-grace", "0"], segment_size="1M")
    want = {"b.bin": blob("b", 100_000)}
    if collected:
        write_tree(m.mnt, {"a.bin": blob("a", 2_500_000)})
        wait_published(m.mnt)
        os.unlink(m.mnt / "a.bin")
    write_tree(m.mnt, want)
    wait_published(m.mnt)
    if collected:
        cli("gc", m.mnt)
        assert status(m)["gc"]["segments_deleted"] >= 2, status(m)["gc"]
        assert (m.nvme / "published-snapshot" / "data.mdb").exists()
    want["c.bin"] = blob("c", 300_000)
    write_tree(m.mnt, {"c.bin": want["c.bin"]})
    wait_published(m.mnt)
    m.unmount()
    with open(m.nvme / "published" / "data.mdb", "r+b") as f:
        f.write(os.urandom(8192))
    res = cli("mount", m.nvme, m.shared, m.mnt, *node_args("n0"), check=False)
    assert_one_line_error(res, "mount with a damaged published view")
    assert "published view" in res.stderr and "ckptfs replay" in res.stderr, res.stderr
    res = cli("replay", m.nvme)
    assert ("restored from its snapshot" if collected else "builds it again") in res.stdout, \
        res.stdout
    m.start()
    assert {n: (m.mnt / n).read_bytes() for n in want} == want
    want["d.bin"] = blob("d", 50_000)
    write_tree(m.mnt, {"d.bin": want["d.bin"]})
    wait_published(m.mnt)
    m.unmount()
    assert export_files(m.shared, "", tmp_path / "out") == want
    assert_fsck_clean(m.shared)


def test_an_old_nvme_directory_back_after_a_new_one_took_over_never_adopts_its_objects(
        make_mount: MakeMount, tmp_path: Path) -> None:
    """Node n0's NVMe is lost while segments were being uploaded; a new NVME directory takes
    over n0 and publishes segments of the same ids. Then the old directory comes back and is
    mounted (by mistake). Its uploads that may have completed before the crash used to be
    taken as published when an object of that name and size with a footer was there: the new
    directory's, so the old one's records pointed into other bytes (EIO after an eviction).
    Now the object must begin with the segment's own header: EEXIST, said in status, and the
    new directory's objects untouched."""
    m = start_node(make_mount, "a", "n0", extra=["--upload-limit", "0.05"],
                   segment_size="1M")
    write_tree(m.mnt, {f"step_2/{i}.bin": blob(f"old{i}", 1_500_000) for i in range(3)})
    # many records: the old log ends past the new directory's manifest (otherwise its mount
    # is refused outright: test_an_old_nvme_directory_whose_node_published_past_its_log...)
    write_tree(m.mnt, {f"small/{i}": b"s" for i in range(150)})
    wait_for(lambda: status(m).get("segments", {}).get("uploading", 0) > 0, 30,
             "an upload to be under way")
    m.kill()
    m.clean_stale()
    old = tmp_path / "old-nvme"
    m.nvme.rename(old)
    m.nvme.mkdir()
    m.extra_args.remove("--upload-limit")
    m.extra_args.remove("0.05")
    m.start()
    # more than the old directory wrote: its segment ids (and its tail's, sealed by the
    # recovery) all collide with the new directory's objects
    write_tree(m.mnt, {f"step_2/{i}.bin": blob(f"new{i}", 1_500_000) for i in range(4)})
    wait_published(m.mnt)
    m.unmount()
    published = {p.name: p.read_bytes() for p in objects(m.shared, "n0")}
    shutil.rmtree(m.nvme)
    old.rename(m.nvme)
    m.start()
    wait_for(lambda: "already exists" in (status(m).get("last_error") or ""), 60,
             "the old directory's drain to refuse the other directory's objects")
    after = {p.name: p.read_bytes() for p in objects(m.shared, "n0")}
    assert {n: after.get(n) for n in published} == published  # untouched
    # The old directory published only segments of ids the new one never used: two uploads
    # run at once, so the kill can come after segment 2's upload finished and before segment
    # 1's did; the new directory numbers its segments after 2, and the old one publishes its
    # own 1 when it comes back, an id nobody else used (a race of the kill with the uploads)
    assert status(m)["segments_uploaded"] == len(after.keys() - published.keys()), status(m)
    m.unmount(timeout=30)


def test_an_old_nvme_directory_whose_node_published_past_its_log_is_refused(
        make_mount: MakeMount) -> None:
    """A node's NVME directory mounted again after a new one took the node over and published
    more: it came up with two `run` directories (its own, and the import's), and its drain
    looped on `duplicate path 'run'`, every wait timing out. Its log ends before the node's
    newest manifest, which only another directory can have published: refused, one line."""
    m = start_node(make_mount, "a", "n0")
    write_tree(m.mnt, {"run/step_1/a": b"1"})
    wait_published(m.mnt)
    m.unmount()
    old = m.nvme.with_name("old-nvme")
    m.nvme.rename(old)
    m.nvme.mkdir()
    m.start()
    write_tree(m.mnt, {f"run/step_2/{i}": b"2" for i in range(20)})
    wait_published(m.mnt)
    m.unmount()
    before = {p.name: p.read_bytes() for p in (m.shared / "ckptfs").rglob("*") if p.is_file()}
    res = cli("mount", old, m.shared, m.mnt, *node_args("n0"), check=False)
    line = assert_one_line_error(res, "an old NVME directory of a node taken over")
    assert "another NVME directory took the node over" in line, line
    after = {p.name: p.read_bytes() for p in (m.shared / "ckptfs").rglob("*") if p.is_file()}
    assert after == before
    m.start()  # the directory that took over mounts as before
    assert sorted(os.listdir(m.mnt / "run")) == ["step_1", "step_2"]


def test_segment_states_survive_a_sigkill_in_an_idle_period(make_mount: MakeMount) -> None:
    """What the drain records about segments (the intent to upload, PUBLISHED) reaches the
    index's disk copy even when no log record follows: after a SIGKILL in an idle period,
    nothing is uploaded again (a batch would go out twice, a copy of it left on SHARED
    that no manifest names) and SHARED stays consistent after the file is deleted and GC'd."""
    m = start_node(make_mount, "a", "n0", segment_size="1M")
    store = m.shared / "ckptfs"
    store.rename(m.shared / "away")  # a backlog of sealed segments builds up
    data = blob("a", 4_000_000)
    write_tree(m.mnt, {"a.bin": data})
    time.sleep(3)
    (m.shared / "away").rename(store)
    wait_published(m.mnt / "a.bin")
    before = sorted(p.relative_to(store) for p in store.rglob("*.seg"))
    time.sleep(4)  # idle: no log record
    m.kill()
    m.clean_stale()
    m.start()
    time.sleep(3)
    assert status(m)["segments_uploaded"] == 0, status(m)["segments"]
    assert sorted(p.relative_to(store) for p in store.rglob("*.seg")) == before
    assert (m.mnt / "a.bin").read_bytes() == data
    os.unlink(m.mnt / "a.bin")
    write_tree(m.mnt, {"b.bin": b"x"})
    wait_published(m.mnt / "b.bin")
    cli("gc", m.mnt)
    m.unmount()
    rc, report, err = fsck(m.shared)
    assert rc == 0, (report, err)


def _step_1_to_cold(make_mount: MakeMount, tmp_path: Path,
                    left: str = "") -> tuple[Mount, Path, bytes]:
    """n0 with step_1 moved to a cold directory (step_2 newest); with `left`, copies of
    step_1's objects ("whole" or "damaged") were put on the cold store before the move, as
    an interrupted move leaves them. (mount, cold directory, step_1/model.pt)"""
    cold = tmp_path / "cold"
    cold.mkdir()
    m = start_node(make_mount, "a", "n0", extra=["--keep-shared", "1", "--cold", str(cold)],
                   segment_size="1M")
    one = blob("1", 2_500_000)
    write_tree(m.mnt, {"step_1/model.pt": one, "step_1/.metadata": b"m"})
    wait_published(m.mnt / "step_1")
    if left:
        planted = cold / "ckptfs" / "objects" / "n0"
        planted.mkdir(parents=True, exist_ok=True)
        for p in objects(m.shared, "n0"):
            data = p.read_bytes()
            (planted / p.name).write_bytes(data if left == "whole" else data[: len(data) // 2])
    write_tree(m.mnt, {"step_2/model.pt": blob("2", 2_500_000), "step_2/.metadata": b"m"})
    wait_published(m.mnt / "step_2")

    def moved() -> dict | None:
        st = status(m)
        return st if st["segments"].get("cold") and not st["cold"]["pending"] else None

    st = wait_for(moved, 60, "step_1 to move to the cold tier")
    assert st["cold"]["segments_moved"] > 0 and st["cold"]["last_error"] is None, st["cold"]
    return m, cold, one


@pytest.mark.parametrize("left", ["whole", "damaged"])
def test_a_cold_copy_left_by_an_interrupted_move_is_kept_or_replaced(
        make_mount: MakeMount, tmp_path: Path, left: str) -> None:
    """A move to the cold tier that stopped after its copy and before its TIER record (a
    SIGKILL, or a copy that did not verify) leaves an object on the cold store that nothing
    names yet. The next move keeps it if it is whole and replaces it if not, instead of
    failing on it forever ("already exists") with every later move stuck behind it."""
    m, _cold, one = _step_1_to_cold(make_mount, tmp_path, left)
    cli("evict", m.mnt, "--all")
    drop_caches()
    assert (m.mnt / "step_1/model.pt").read_bytes() == one
    assert export_files(m.shared, "step_1", tmp_path / "out")["model.pt"] == one
    rc, report, err = fsck(m.shared)
    assert rc == 0, (report, err)


def test_a_new_nvme_for_a_node_with_cold_checkpoints_needs_cold(make_mount: MakeMount,
                                                                 tmp_path: Path) -> None:
    """A new NVME directory adopting a node whose manifest names a cold tier is refused
    without --cold (its files would point at objects it cannot read, and its manifests
    would stop saying where they are: fsck and export from SHARED would then fail).

    The refused attempt leaves a segment (the new root's owner) that publishes before the
    next attempt's import of the namespace: no manifest may go out before the import is
    published, or SHARED says for a while that the node publishes nothing."""
    m, cold, one = _step_1_to_cold(make_mount, tmp_path)
    m.unmount()
    d = make_mount("d", node_args("n0"), segment_size="1M", start=False)
    d.shared = m.shared
    with pytest.raises(RuntimeError, match=f"mounted with --cold {cold}"):
        d.start()
    other = tmp_path / "other-cold"
    other.mkdir()
    plain = list(d.extra_args)
    d.extra_args = [*plain, "--keep-shared", "1", "--cold", str(other)]
    with pytest.raises(RuntimeError, match=f"mounted with --cold {cold}"):
        d.start()  # a cold tier, but not the one its checkpoints are on
    d.extra_args = [*plain, "--keep-shared", "1", "--cold", str(cold)]
    d.start()
    assert (d.mnt / "step_1/model.pt").read_bytes() == one
    for _ in range(20):  # every manifest published meanwhile still lists the checkpoints
        assert {e["path"] for e in ls_json(m.shared)} >= {"step_1/model.pt", "step_2/model.pt"}
        time.sleep(0.1)
    # the new directory's manifests still say step_1's objects are cold (they said "shared",
    # and readers then tried SHARED first)
    write_tree(d.mnt, {"step_3/model.pt": b"3", "step_3/.metadata": b"m"})
    wait_published(d.mnt / "step_3")
    newest = manifest.parse(manifests(m.shared, "n0")[-1].read_bytes(), "the newest manifest")
    objs = {x[2] for e in newest.entries if e.path == "step_1/model.pt" for x in e.extents}
    assert objs and {newest.tier(o) for o in objs} == {"cold"}, (objs, newest.objects)
    d.unmount()
    assert export_files(m.shared, "step_1", tmp_path / "out")["model.pt"] == one
    rc, report, err = fsck(m.shared)
    assert rc == 0, (report, err)


def test_a_manifest_put_before_a_crash_that_lost_the_views_commit_is_not_put_again(
        make_mount: MakeMount, tmp_path: Path) -> None:
    """SIGKILL between a manifest's put and the commit of the published view it describes:
    the next mount applies the same segments again and arrives at the same manifest, which
    is on SHARED already. It counts as published (it was never replaced: a published
    manifest is immutable), instead of an "already exists" retried forever that stops all
    publishing."""
    m = start_node(make_mount, "a", "n0", segment_size="1M")
    write_tree(m.mnt, {"a": b"a"})
    wait_published(m.mnt / "a")
    m.unmount()
    before = tmp_path / "published.before"
    shutil.copytree(m.nvme / "published", before)  # the view as committed then
    m.start()
    write_tree(m.mnt, {"b": b"b"})
    wait_published(m.mnt / "b")
    m.kill()
    m.clean_stale()
    shutil.rmtree(m.nvme / "published")
    shutil.copytree(before, m.nvme / "published")  # what the crash window leaves
    m.start()
    write_tree(m.mnt, {"c": b"c"})
    wait_published(m.mnt / "c", timeout=30)
    assert {e["path"] for e in ls_json(m.shared)} == {"a", "b", "c"}
    m.unmount()
    rc, report, err = fsck(m.shared)
    assert rc == 0, (report, err)


def test_a_full_replay_from_an_old_snapshot_finds_segments_published_or_collected_since(
        make_mount: MakeMount) -> None:
    """GC's index snapshot remembers a segment as waiting for its upload; the segment is
    then published, dies and is deleted by GC. A full replay (`ckptfs replay NVME`) starts
    from that snapshot: the segment's state must follow what exists (published, evicted, or
    gone), or the drain retries a segment that is nowhere forever (`wait` never returns,
    `umount` hangs) or uploads a published one a second time."""
    m = make_mount("a", node_args("n0", "--gc-grace", "0"), segment_size="1M", start=False)
    m.env = {**os.environ, "CKPTFS_GC_INTERVAL": "2"}  # a periodic pass every 2 s, not 15
    m.start()
    time.sleep(2)  # the first segment (the root's owner) seals idle: dead once published
    write_tree(m.mnt, {"f1": b"x" * 1000})
    wait_published(m.mnt / "f1")
    fmt_file = m.shared / "ckptfs" / "FORMAT"
    fmt_file.rename(fmt_file.with_name("FORMAT.away"))  # uploads stall, as with a NAS gone
    try:
        (m.mnt / "d1").mkdir()  # a segment of metadata only, sealed, not uploaded
        time.sleep(2)
        write_tree(m.mnt, {"f2": b"z" * 1000})
        wait_for(lambda: status(m)["gc"]["snapshots"] >= 1, 60,
                 "the periodic GC pass to take its snapshot")
    finally:
        fmt_file.with_name("FORMAT.away").rename(fmt_file)
    wait_published(m.mnt / "f2")
    os.rmdir(m.mnt / "d1")
    write_tree(m.mnt, {"f3": b"y"})
    wait_published(m.mnt / "f3")
    cli("gc", m.mnt)
    m.unmount()
    store = m.shared / "ckptfs"
    store.rename(m.shared / "away")  # unreadable is not "missing": nothing is dropped
    try:
        res = cli("replay", m.nvme, check=False)
        assert res.returncode != 0 and "not checked" in res.stdout + res.stderr, res
    finally:
        (m.shared / "away").rename(store)
    res = cli("replay", m.nvme)
    assert "starting from the index snapshot" in res.stdout, res.stdout
    m.start()
    write_tree(m.mnt, {"f4": b"w" * 1000})
    wait_published(m.mnt / "f4", timeout=30)
    assert status(m)["segments_uploaded"] <= 2, status(m)["segments"]  # f4's, a recovery seal
    for name, data in (("f1", b"x" * 1000), ("f2", b"z" * 1000), ("f4", b"w" * 1000)):
        assert (m.mnt / name).read_bytes() == data
    m.unmount()
    rc, report, err = fsck(m.shared)
    assert rc == 0, (report, err)


def test_a_rate_limited_upload_is_not_a_silent_store(make_mount: MakeMount) -> None:
    """With --upload-limit, an upload waits for the limiter between chunks: that wait
    counted as the store not answering (`shared_stalled_s` climbed to the chunk's time at
    the limit), so a healthy store was reported silent (`the shared store has not answered
    for N s (an upload is waiting)`) by `wait`, `umount` and `status`."""
    # no refresh meanwhile: its listings are calls that end, which reset the stall's clock
    m = start_node(make_mount, "a", "n0", extra=["--upload-limit", "1", "--upload-streams",
                                                 "1"], segment_size="16M", refresh=60)
    write_tree(m.mnt, {"ck/big.bin": blob("r", 40 << 20)})
    stalls = []
    for _ in range(16):
        time.sleep(0.5)
        st = status(m)
        stalls.append(st["shared_stalled_s"])
    assert st["bytes_pending_upload"] > 0, "the drain finished: the test saw no limiter wait"
    assert max(stalls) < 1, stalls
