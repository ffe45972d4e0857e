"""Checkpoint-aware tiering on real mounts: watermarks, backpressure, ENOSPC, retention on both
tiers, commit markers published last, superseded checkpoints, the incremental drain, GC."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from ckptfs import control
from ckptfs.export import merged_view
from ckptfs.shared import SharedStore
from mounting import run_cli, wait_for


def req(mnt: Path, **kw: object) -> dict:
    sock, _ = control.find_socket(str(mnt))
    return control.request(sock, dict(kw), timeout=120)


def status(mnt: Path) -> dict:
    return req(mnt, op="status")["status"]


def write(path: Path, data: bytes, fsync: bool = True) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < len(data):  # a full disk may cut a write short before it fails
            done += os.write(fd, data[done:])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def wait(path: Path, timeout: float = 60) -> None:
    res = run_cli("wait", path, "--timeout", str(timeout), timeout=timeout + 30)
    assert res.rc == 0, str(res)


@contextlib.contextmanager
def shared_blocked(shared: Path) -> Iterator[None]:
    """Make the shared store refuse new objects (a full 64 KiB tmpfs over objects/): the drain
    fails and retries until the block is lifted."""
    objects = shared / "ckptfs" / "objects"
    objects.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "ckptfs-test-block",
                    str(objects)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(objects)], check=True)


def drop_caches() -> None:
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def test_watermark_eviction_and_read_back(make_mount) -> None:
    m = make_mount(extra_args=["--cache-size", "12M", "--high-watermark", "0.8",
                               "--low-watermark", "0.5", "--node-id", "n0"],
                   segment_size="2M")
    files = {}
    for i in range(16):
        data = os.urandom(1 << 20)
        write(m.mnt / "step_1" / f"f{i}", data)
        files[i] = data
    wait(m.mnt / "step_1")
    st = wait_for(lambda: (s := status(m.mnt))["cache"]["evictions"] > 0 and s, 20,
                  "watermark eviction")
    assert st["segments"].get("evicted", 0) > 0
    assert st["local_bytes_used"] <= 12 << 20
    drop_caches()
    for i, data in files.items():
        assert (m.mnt / "step_1" / f"f{i}").read_bytes() == data
    assert status(m.mnt)["shared_bytes_read"] > 0


def test_backpressure_waits_for_the_drain_then_succeeds(make_mount) -> None:
    m = make_mount(extra_args=["--cache-size", "6M", "--node-id", "n0", "--seal-idle", "0.5",
                               "--enospc-timeout", "60"], segment_size="1M")
    done = threading.Event()
    errors: list[BaseException] = []
    written = {}

    def writer() -> None:
        try:
            for i in range(40):
                data = os.urandom(512 << 10)
                write(m.mnt / "step_1" / f"f{i}", data, fsync=False)
                written[i] = data
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)
        finally:
            done.set()

    with shared_blocked(m.shared):
        t = threading.Thread(target=writer)
        t.start()
        wait_for(lambda: status(m.mnt)["cache"]["waiting_writers"] > 0, 30,
                 "a writer to wait for space")
        assert not done.is_set()
        st = status(m.mnt)
        assert st["cache"]["state"] == "full" and st["last_error"]
    # the shared store is back: the drain publishes, segments get evicted, the writer goes on
    t.join(120)
    assert done.is_set() and not errors, errors
    wait(m.mnt / "step_1")
    drop_caches()
    for i, data in written.items():
        assert (m.mnt / "step_1" / f"f{i}").read_bytes() == data


def test_enospc_only_when_both_tiers_are_exhausted_and_nothing_is_lost(make_mount) -> None:
    m = make_mount(extra_args=["--cache-size", "4M", "--node-id", "n0",
                               "--enospc-timeout", "2"], segment_size="1M")
    kept = os.urandom(1 << 20)
    write(m.mnt / "kept", kept)
    wait(m.mnt / "kept")
    got_enospc = False
    with shared_blocked(m.shared):
        for i in range(40):
            try:
                write(m.mnt / f"f{i}", os.urandom(512 << 10), fsync=False)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                got_enospc = True
                break
        assert got_enospc, "writes never failed although neither tier could take data"
        assert status(m.mnt)["cache"]["enospc_errors"] >= 1
    assert (m.mnt / "kept").read_bytes() == kept
    # everything acknowledged before the ENOSPC drains once the store is back
    wait(m.mnt)
    res = run_cli("fsck", m.shared, "--deep")
    assert res.rc == 0, str(res)
    m.unmount()
    m.start()
    assert (m.mnt / "kept").read_bytes() == kept


def test_retention_on_both_tiers_and_gc_keeps_every_live_file(make_mount) -> None:
    m = make_mount(extra_args=["--node-id", "n0", "--keep-shared", "2", "--keep-local", "1",
                               "--gc-grace", "0"], segment_size="1M")
    content = {}
    for step in range(1, 6):
        d = m.mnt / f"step_{step}"
        for r in range(3):
            data = os.urandom(300_000)
            write(d / f"__{r}_0.distcp", data)
            content[f"step_{step}/__{r}_0.distcp"] = data
        write(d / ".metadata", b"meta")
        content[f"step_{step}/.metadata"] = b"meta"
        wait(d)
    wait_for(lambda: sorted(os.listdir(m.mnt)) == ["step_4", "step_5"], 20,
             "retention to keep the newest two checkpoints")
    wait(m.mnt)
    res = req(m.mnt, op="gc")
    assert res["segments_freed"] > 0
    st = status(m.mnt)
    assert st["gc"]["objects_deleted"] > 0
    assert st["segments"].get("evicted", 0) > 0  # keep-local 1: step_4 left NVMe
    # no object of a deleted checkpoint is left referenced, and every live file reads back
    drop_caches()
    for rel, data in content.items():
        if rel.startswith(("step_4", "step_5")):
            assert (m.mnt / rel).read_bytes() == data
    view = merged_view(SharedStore(str(m.shared)))
    assert {p.split("/")[0] for p in view.entries} == {"step_4", "step_5"}
    res = run_cli("fsck", m.shared, "--deep")
    assert res.rc == 0 and "ok" in res.out, str(res)
    objects = SharedStore(str(m.shared)).list_objects("n0")
    assert len(objects) < st["segments_uploaded"]
    # a full replay (from the snapshot GC took) still rebuilds the namespace
    m.unmount()
    res = run_cli("replay", m.nvme, "--shared", m.shared)
    assert res.rc == 0, str(res)
    m.start()
    for rel, data in content.items():
        if rel.startswith(("step_4", "step_5")):
            assert (m.mnt / rel).read_bytes() == data


def _marker_invariant(shared: Path, stop: threading.Event, seen: list[str],
                      errors: list[str]) -> None:
    """Whenever a reader of SHARED sees step_1/.metadata, every shard must be there too."""
    store = SharedStore(str(shared))
    while not stop.is_set():
        try:
            view = merged_view(store)
        except Exception:  # noqa: BLE001 - the store may be half set up at first
            time.sleep(0.02)
            continue
        if "step_1/.metadata" in view.entries:
            seen.append("marker")
            shards = [p for p in view.entries if p.startswith("step_1/__")]
            if len(shards) != 8:
                errors.append(f"marker visible with {len(shards)} of 8 shards")
        time.sleep(0.01)


@pytest.mark.parametrize("fault", ["sigkill", "shared-outage"])
def test_commit_marker_is_never_published_before_its_shards(make_mount, fault: str) -> None:
    m = make_mount(extra_args=["--node-id", "n0", "--seal-idle", "0.3"], segment_size="1M")
    stop = threading.Event()
    seen: list[str] = []
    errors: list[str] = []
    watcher = threading.Thread(target=_marker_invariant, args=(m.shared, stop, seen, errors))
    watcher.start()
    try:
        shards = {f"__{r}_0.distcp": os.urandom(400_000) for r in range(8)}
        if fault == "sigkill":
            for name, data in shards.items():
                write(m.mnt / "step_1" / name, data)
            write(m.mnt / "step_1" / ".metadata", b"marker")
            m.kill()
            m.clean_stale()
            m.start()
        else:
            with shared_blocked(m.shared):
                for name, data in shards.items():
                    write(m.mnt / "step_1" / name, data)
                write(m.mnt / "step_1" / ".metadata", b"marker")
                time.sleep(1.0)  # the drain is failing meanwhile: let it try
                assert status(m.mnt)["last_error"]
        wait(m.mnt / "step_1")
        wait_for(lambda: seen, 10, "the marker to be published")
    finally:
        stop.set()
        watcher.join()
    assert not errors, errors
    view = merged_view(SharedStore(str(m.shared)))
    assert len([p for p in view.entries if p.startswith("step_1/__")]) == 8


def test_retention_orders_checkpoints_by_their_markers_mtime_and_keeps_one_being_written(
        make_mount) -> None:
    """Checkpoints count from their commit marker's modification time: a `chmod a-w` of an
    old checkpoint (its change time moves) does not make it the newest. An incomplete
    checkpoint that changed in the last minutes is never deleted, even when a marker from
    the future (a node whose clock runs ahead) puts it below the cutoff."""
    m = make_mount(extra_args=["--node-id", "n0", "--keep-shared", "2"], segment_size="1M")
    for name in ("step_9", "step_10"):
        write(m.mnt / name / "__0_0.distcp", b"x" * 1000)
        write(m.mnt / name / ".metadata", b"m")
    os.chmod(m.mnt / "step_9" / ".metadata", 0o444)
    write(m.mnt / "step_11" / "__0_0.distcp", b"x" * 1000)
    write(m.mnt / "step_11" / ".metadata", b"m")
    wait_for(lambda: sorted(os.listdir(m.mnt)) == ["step_10", "step_11"], 20,
             "retention to delete step_9, the oldest by its marker's mtime")
    future = time.time_ns() + 3600 * 10**9
    os.utime(m.mnt / "step_11" / ".metadata", ns=(future, future))
    write(m.mnt / "step_12" / "__0_0.distcp", b"x" * 1000)  # being written: no marker yet
    time.sleep(0.05)
    write(m.mnt / "step_13" / "__0_0.distcp", b"x" * 1000)
    write(m.mnt / "step_13" / ".metadata", b"m")
    # complete, by marker mtime: step_10 < step_13 < step_11 (the future); keep 2 puts the
    # cutoff at step_13, and step_12 (incomplete, older than step_13) below it
    res = req(m.mnt, op="gc")
    assert sorted(os.listdir(m.mnt)) == ["step_11", "step_12", "step_13"], res


def test_checkpoints_of_each_run_directory_are_kept_and_listed_per_run(make_mount) -> None:
    """HF's output_dir is usually a run directory below the mount (/ckpt/<run>/checkpoint-N),
    DeepSpeed's `latest` sits beside its global_stepN: checkpoints one or two levels down count
    as the top-level ones do, and --keep-shared keeps M of each run; a second run's newer
    checkpoints never push out the first run's. Deeper than MAX_DEPTH, or inside another
    checkpoint, a matching name is not a checkpoint. Retention used to see top-level
    directories only (none here), and `ckptfs ls` listed nothing."""
    m = make_mount(extra_args=["--node-id", "n0", "--keep-shared", "2"], segment_size="1M")
    for step in (1, 2, 3):  # run a: HF checkpoints, complete by trainer_state.json
        write(m.mnt / "a" / f"checkpoint-{step}" / "model.safetensors", b"a" * 1000)
        write(m.mnt / "a" / f"checkpoint-{step}" / "trainer_state.json", b"{}")
    write(m.mnt / "a" / "config.json", b"{}")  # not a checkpoint: stays
    b = m.mnt / "team" / "b"
    for step in (10, 20, 30):  # team/b: DCP-style, complete by .metadata
        write(b / f"global_step{step}" / "__0_0.distcp", b"b" * 1000)
        write(b / f"global_step{step}" / ".metadata", b"m")
    # not checkpoints: too deep, and a matching name inside a checkpoint
    write(m.mnt / "x" / "y" / "z" / "step_1" / "f", b"deep")
    write(b / "global_step30" / "step_5" / "g", b"inside")  # counts with global_step30
    expect_a = ["checkpoint-2", "checkpoint-3", "config.json"]
    wait_for(lambda: sorted(os.listdir(m.mnt / "a")) == expect_a, 20,
             "retention to keep the 2 newest checkpoints of run a")
    wait_for(lambda: sorted(os.listdir(b)) == ["global_step20", "global_step30"], 20,
             "retention to keep the 2 newest checkpoints of run b")
    # DeepSpeed: no marker inside, complete once the `latest` beside it names it
    write(b / "global_step40" / "mp_rank_00_model_states.pt", b"b" * 1000)
    write(b / "latest", b"global_step40")
    wait_for(lambda: sorted(os.listdir(b)) == ["global_step30", "global_step40", "latest"],
             20, "retention to count global_step40 complete by the `latest` beside it")

    def complete(name: str) -> bool:
        return any(c["name"] == f"team/b/{name}" and c["complete"]
                   for c in status(m.mnt)["retention"]["checkpoints"])

    # `latest` moves on: the checkpoints it named before stay complete (else, with only the
    # newest ever complete, --keep-shared never deleted a DeepSpeed checkpoint)
    write(b / "global_step50" / "mp_rank_00_model_states.pt", b"b" * 1000)
    write(b / "latest", b"global_step50")
    wait_for(lambda: sorted(os.listdir(b)) == ["global_step40", "global_step50", "latest"], 20,
             "retention to keep global_step40 and 50 (complete: 30, 40, 50)")
    assert complete("global_step40") and complete("global_step50")
    assert sorted(os.listdir(m.mnt / "a")) == expect_a, "run b's checkpoints pushed out run a's"
    assert (m.mnt / "x" / "y" / "z" / "step_1" / "f").read_bytes() == b"deep"
    names = [c["name"] for c in status(m.mnt)["retention"]["checkpoints"]]
    assert sorted(names) == ["a/checkpoint-2", "a/checkpoint-3", "team/b/global_step40",
                             "team/b/global_step50"], names
    wait(m.mnt)
    res = run_cli("ls", m.shared, "--json")
    assert res.rc == 0, str(res)
    table = {c["name"]: c["complete"] for c in json.loads(res.out)}
    # ls reads SHARED alone, without the mount's memory: the `latest` names global_step50
    assert table == {n: n != "team/b/global_step40" for n in names}, table


def test_megatron_checkpoints_complete_by_their_iteration_tracker(make_mount,
                                                                   monkeypatch) -> None:
    """Megatron-LM saves iter_0000100/ (mp_rank_*/model_optim_rng.pt, no marker inside) and
    then writes the iteration number, `100`, to latest_checkpointed_iteration.txt beside it."""
    m = make_mount(extra_args=["--node-id", "n0", "--keep-shared", "2"], segment_size="1M")
    run = m.mnt / "gpt"
    for it in (100, 200, 300):
        write(run / f"iter_{it:07d}" / "mp_rank_00" / "model_optim_rng.pt", b"m" * 1000)
        write(run / "latest_checkpointed_iteration.txt", str(it).encode())
        wait_for(lambda it=it: any(c["name"] == f"gpt/iter_{it:07d}" and c["complete"]
                                   for c in status(m.mnt)["retention"]["checkpoints"]), 20,
                 f"iter_{it:07d} to count complete by the tracker file")
    wait_for(lambda: sorted(os.listdir(run)) == [
        "iter_0000200", "iter_0000300", "latest_checkpointed_iteration.txt"], 20,
        "retention to keep the 2 newest iterations")
    wait(m.mnt)
    res = run_cli("ls", m.shared, "--json")
    assert res.rc == 0, str(res)
    assert {c["name"]: c["complete"] for c in json.loads(res.out)} == {
        "gpt/iter_0000200": False, "gpt/iter_0000300": True}, res.out
    # the table says why the older one has no marker, instead of calling it incomplete
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps at 80 columns without a terminal
    res = run_cli("ls", m.shared)
    assert res.rc == 0, str(res)
    rows = {line.split()[1]: line for line in res.out.splitlines() if "gpt/iter_" in line}
    assert "complete" in rows["gpt/iter_0000300"], res.out
    assert "no marker (the tracker names iter_0000300)" in rows["gpt/iter_0000200"], res.out


def test_superseded_checkpoint_is_dropped_from_the_drain(make_mount) -> None:
    m = make_mount(extra_args=["--node-id", "n0", "--keep-shared", "1", "--seal-idle", "0.3"],
                   segment_size="1M")
    with shared_blocked(m.shared):
        for step in (1, 2):
            for r in range(2):
                write(m.mnt / f"step_{step}" / f"__{r}_0.distcp", os.urandom(900_000))
            write(m.mnt / f"step_{step}" / ".metadata", b"m")
        wait_for(lambda: not (m.mnt / "step_1").exists(), 20, "retention to delete step_1")
        time.sleep(0.5)  # let step_2's writes seal
    wait(m.mnt)
    st = status(m.mnt)
    assert st["segments_dropped"] > 0, st["segments"]
    assert st["bytes_uploaded"] < 3 * 900_000, st["bytes_uploaded"]
    res = run_cli("fsck", m.shared, "--deep")
    assert res.rc == 0, str(res)
    view = merged_view(SharedStore(str(m.shared)))
    assert {p.split("/")[0] for p in view.entries} == {"step_2"}


def test_incremental_drain_uploads_only_changed_chunks(make_mount, tmp_path: Path) -> None:
    m = make_mount(extra_args=["--node-id", "n0"], segment_size="8M")
    frozen = os.urandom(8 << 20)
    trained = [os.urandom(8 << 20) for _ in range(2)]
    for step in (1, 2):
        write(m.mnt / f"step_{step}" / "embeddings.bin", frozen)
        write(m.mnt / f"step_{step}" / "optimizer.bin", trained[step - 1])
        wait(m.mnt / f"step_{step}")
        if step == 1:
            after_first = status(m.mnt)["bytes_uploaded"]
    second = status(m.mnt)["bytes_uploaded"] - after_first
    assert after_first >= 16 << 20
    # about half: the frozen half is referenced, not uploaded again
    assert (8 << 20) <= second < (8 << 20) * 1.1, (after_first, second)
    res = run_cli("export", m.shared, "step_2", tmp_path / "out")
    assert res.rc == 0, str(res)
    assert (tmp_path / "out" / "embeddings.bin").read_bytes() == frozen
    assert (tmp_path / "out" / "optimizer.bin").read_bytes() == trained[1]
    # GC must respect the shared reference: delete step_1, collect, step_2 still reads right
    import shutil

    shutil.rmtree(m.mnt / "step_1")
    wait(m.mnt)
    req(m.mnt, op="gc")
    req(m.mnt, op="evict", all=True)
    drop_caches()
    assert hashlib.sha256((m.mnt / "step_2" / "embeddings.bin").read_bytes()).digest() == \
        hashlib.sha256(frozen).digest()
    res = run_cli("fsck", m.shared, "--deep")
    assert res.rc == 0, str(res)


def test_gc_forgets_the_dedup_rows_of_the_segments_it_deletes(make_mount) -> None:
    """The incremental drain's `chunks` table got a row for every write of 64 KiB or more
    ever made and lost none: over a long run the index grew without end (an audit: 9,600
    rows for 963 live extents after 60 checkpoints). GC now drops the rows of the segments
    it deletes: with one checkpoint kept, about one row per write still on this node."""
    import lmdb

    m = make_mount(extra_args=["--node-id", "n0", "--keep-shared", "1", "--gc-grace", "0"],
                   segment_size="4M")
    for step in range(1, 7):
        for i in range(10):
            write(m.mnt / f"step_{step}" / f"f{i}", os.urandom(1 << 20))
        write(m.mnt / f"step_{step}" / ".metadata", b"m")
        wait(m.mnt / f"step_{step}")
    # retention's deletes must be published before GC may delete the segments they freed
    wait_for(lambda: sorted(p.name for p in m.mnt.iterdir()) == ["step_6"], 30,
             "retention to keep step_6 only")
    wait(m.mnt)
    req(m.mnt, op="gc")
    req(m.mnt, op="gc")
    env = lmdb.open(str(m.nvme / "index"), readonly=True, lock=False, max_dbs=64)
    try:
        with env.begin() as tx:
            rows = tx.stat(env.open_db(b"chunks", txn=tx, create=False))["entries"]
    finally:
        env.close()
    assert rows <= 2 * 10, f"{rows} dedup rows for one checkpoint of 10 writes of 1 MiB"


def test_a_really_full_nvme_loses_nothing(make_mount, tmp_path: Path) -> None:
    """NVME on a 96 MiB tmpfs with the shared store refusing data: the disk fills for real,
    writers wait and then get ENOSPC; nothing acknowledged is lost or damaged, and once the
    store is back everything drains and writing works again."""
    m = make_mount(extra_args=["--node-id", "n0", "--enospc-timeout", "2",
                               "--high-watermark", "0.6", "--low-watermark", "0.4"],
                   segment_size="4M", start=False)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m", "ckptfs-test-nvme", str(m.nvme)],
                   check=True)
    try:
        m.start()
        acked = {}
        full = False
        with shared_blocked(m.shared):
            for i in range(200):
                data = os.urandom(1 << 20)
                try:
                    write(m.mnt / "step_1" / f"f{i}", data, fsync=True)
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    full = True
                    break
                acked[i] = data
            assert full, "a 96 MiB NVMe never filled up"
            for i, data in acked.items():  # what was acknowledged reads back exactly
                assert (m.mnt / "step_1" / f"f{i}").read_bytes() == data
        wait(m.mnt, timeout=120)  # the store is back: everything drains
        write(m.mnt / "step_1" / "after", b"room again")
        drop_caches()
        for i, data in acked.items():
            assert (m.mnt / "step_1" / f"f{i}").read_bytes() == data
        m.unmount()
        m.start()
        for i, data in acked.items():
            assert (m.mnt / "step_1" / f"f{i}").read_bytes() == data
        assert run_cli("fsck", m.shared, "--deep").rc == 0
    finally:
        m.teardown()
        subprocess.run(["umount", "-l", str(m.nvme)], check=False)


def test_eviction_keeps_the_newest_checkpoint_while_space_allows(make_mount) -> None:
    # watermarks high enough that the host disk's own usage does not trigger eviction
    # 32 MiB of checkpoints against a 24M cache: evicting ~10 MB is enough, all of it step_1's
    m = make_mount(extra_args=["--node-id", "n0", "--cache-size", "24M",
                               "--high-watermark", "0.95", "--low-watermark", "0.9"],
                   segment_size="2M")
    for step in (1, 2):
        for i in range(8):
            write(m.mnt / f"step_{step}" / f"f{i}", os.urandom(2 << 20))
        write(m.mnt / f"step_{step}" / ".metadata", b"m")
        wait(m.mnt / f"step_{step}")
    st = wait_for(lambda: (s := status(m.mnt))["cache"]["evictions"] > 0 and s, 30,
                  "eviction above the high watermark")
    # the older checkpoint went first: the newest one's data is still local
    newest_local = True
    for i in range(8):
        before = status(m.mnt)["shared_bytes_read"]
        (m.mnt / "step_2" / f"f{i}").read_bytes()
        newest_local = newest_local and status(m.mnt)["shared_bytes_read"] == before
    assert newest_local, st["cache"]
    drop_caches()
    before = status(m.mnt)["shared_bytes_read"]
    for i in range(8):
        (m.mnt / "step_1" / f"f{i}").read_bytes()
    assert status(m.mnt)["shared_bytes_read"] > before  # step_1 came from SHARED


def test_upload_limit_caps_the_drain(make_mount) -> None:
    m = make_mount(extra_args=["--node-id", "n0", "--upload-limit", "10",
                               "--drain-policy", "always"], segment_size="4M")
    write(m.mnt / "step_1" / "big", os.urandom(24 << 20))
    t0 = time.monotonic()
    wait(m.mnt / "step_1", timeout=120)
    # 24 MiB at 10 MB/s cannot take less than ~2.5 s, however fast the disk
    assert time.monotonic() - t0 >= 2.0


def test_deleting_a_checkpoint_costs_object_deletes_not_file_deletes(make_mount) -> None:
    m = make_mount(extra_args=["--node-id", "n0", "--gc-grace", "0"], segment_size="2M")
    for i in range(300):
        write(m.mnt / "step_1" / f"__{i}.distcp", os.urandom(10_000), fsync=False)
    wait(m.mnt / "step_1")
    objects = len(SharedStore(str(m.shared)).list_objects("n0"))
    before = status(m.mnt)["shared_ops"].get("unlink", 0)
    import shutil

    shutil.rmtree(m.mnt / "step_1")
    wait(m.mnt)
    req(m.mnt, op="gc")
    unlinks = status(m.mnt)["shared_ops"].get("unlink", 0) - before
    assert 0 < unlinks <= objects + 4, (unlinks, objects)


def test_a_checkpoint_retention_deletes_below_the_root_is_gone_at_once(make_mount) -> None:
    """The kernel is told to forget a checkpoint retention deleted, by its directory and
    name. For run/step_1 it was asked for an entry "run/step_1" in the root, which is none,
    so a stat kept finding the deleted directory for the entry timeout (5 s)."""
    m = make_mount(extra_args=["--node-id", "n0", "--keep-shared", "1"], segment_size="1M")
    run = m.mnt / "run"
    write(run / "step_1" / "a.distcp", b"1" * 1000)
    write(run / "step_1" / ".metadata", b"m")
    write(run / "step_2" / "a.distcp", b"2" * 1000)
    write(run / "step_2" / ".metadata", b"m")
    deadline = time.monotonic() + 30
    while "run/step_1" not in status(m.mnt)["retention"]["recently_deleted"]:
        assert time.monotonic() < deadline, "retention did not delete run/step_1"
        try:
            os.stat(run / "step_1")  # the kernel keeps the entry for ENTRY_TIMEOUT
        except FileNotFoundError:
            pass
        time.sleep(0.1)
    wait_for(lambda: not os.path.exists(run / "step_1"), 1.5,
             "the kernel to forget run/step_1 (it kept the entry)")
    assert (run / "step_2" / "a.distcp").read_bytes() == b"2" * 1000


def test_gc_of_local_segments_lowers_what_the_cache_counts(make_mount) -> None:
    """With --cache-size, the cache counts the bytes of its segments on NVMe. GC deleting
    a local segment file did not take its bytes off: the count grew with every checkpoint
    retention deleted, until everything published was evicted at once and writers waited
    for room that was there."""
    cap = 24 << 20
    m = make_mount(extra_args=["--node-id", "n0", "--keep-shared", "1", "--gc-grace", "0",
                               "--cache-size", str(cap)], segment_size="1M")
    for step in range(1, 9):
        for r in range(3):
            write(m.mnt / f"step_{step}" / f"{r}.distcp", os.urandom(1_500_000))
        write(m.mnt / f"step_{step}" / ".metadata", b"m")
        wait(m.mnt)
        wait_for(lambda step=step: f"step_{step - 1}" not in os.listdir(m.mnt) or step == 1,
                 20, "retention to delete the checkpoint before")
        res = run_cli("gc", m.mnt)
        assert res.rc == 0, str(res)
    st = status(m.mnt)
    # sealed segments on NVMe: what `status` finds in the index, and what the cache counts
    assert st["cache"]["counted_bytes"] == st["local_bytes_used"], st
    assert st["local_bytes_used"] < cap // 2, st
