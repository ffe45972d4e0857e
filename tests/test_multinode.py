"""Several nodes on one SHARED: two live mounts read each other's published files, a shared
directory shows the union, a conflicting path resolves to one whole version by the documented
rule (ckptfs/remote.py: newest mtime wins, ties to the larger node id), deletes and renames
propagate, an open file is not swapped under its reader (and is updated once closed), and a
fresh node, or the same node after losing its NVMe, sees everything that was published."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from mounting import MakeMount, Mount, wait_for
from test_shared_support import (
    REFRESH,
    SEGMENT,
    assert_files,
    assert_fsck_clean,
    assert_tree,
    blob,
    cli,
    export_files,
    ls_json,
    manifests,
    node_args,
    objects,
    start_node,
    status,
    wait_published,
    walk_mount,
    write_tree,
)

import ckptfs
from ckptfs import manifest

# A change published on one node is seen by the other within a few refresh intervals.
SEEN_WITHIN = 10 * REFRESH + 5


def two_nodes(make_mount: MakeMount) -> tuple[Mount, Mount]:
    a = start_node(make_mount, "a", "n0")
    b = start_node(make_mount, "b", "n1", shared=a.shared)
    return a, b


def readable_everywhere(m: Mount, expected: dict[str, bytes]) -> bool:
    """True once every expected file reads back exactly through m."""
    for rel, data in expected.items():
        try:
            got = (m.mnt / rel).read_bytes()
        except FileNotFoundError:
            return False
        if got != data:
            return False
    return True


def test_a_node_never_reads_its_own_manifests_back(make_mount: MakeMount) -> None:
    """Refreshes and GC passes read the other nodes' new manifests. This node wrote its own,
    and reading each new one back parsed its whole namespace once per checkpoint (a 65 MiB
    peak of the daemon's memory at 200,000 files, for nothing)."""
    a = start_node(make_mount, "a", "n0")
    opens = status(a)["shared_ops"].get("open", 0)
    for step in range(3):
        write_tree(a.mnt, {f"step_{step}/f": blob(f"s{step}", 5000)})
        wait_published(a.mnt / f"step_{step}")
        status(a, refresh=True)
        cli("gc", a.mnt)
    assert manifests(a.shared, "n0"), "nothing published: the test tests nothing"
    st = status(a)
    assert st["shared_ops"].get("open", 0) == opens, st["shared_ops"]
    assert "n0" not in st["remote"]["nodes_seen"], st["remote"]


def test_two_mounts_read_each_others_files(make_mount: MakeMount) -> None:
    a, b = two_nodes(make_mount)
    mine_a = {f"from_a/f{i}.bin": blob(f"a{i}", 1000 + 70_000 * i) for i in range(6)}
    mine_a["from_a/big.bin"] = blob("abig", 6 << 20)  # spans two objects
    mine_b = {f"from_b/sub/g{i}.bin": blob(f"b{i}", 333 * i + 1) for i in range(20)}
    write_tree(a.mnt, mine_a)
    write_tree(b.mnt, mine_b)
    wait_published(a.mnt / "from_a")
    ckptfs.wait(b.mnt / "from_b", timeout=60)  # the Python API, as training code calls it
    assert ckptfs.status(b.mnt)["bytes_pending_upload"] == 0

    # B finds A's files on its own within the documented refresh interval...
    wait_for(lambda: readable_everywhere(b, mine_a), SEEN_WITHIN,
             "n1 to see n0's published files via the periodic refresh")
    # ...and A at once after `status --refresh`.
    st = status(a, refresh=True)
    assert st["remote"]["nodes_seen"].get("n1") is not None, st["remote"]
    assert_files(mine_b, a.mnt, "n0's view of n1's files")
    assert_files(mine_a, b.mnt, "n1's view of n0's files")
    for m in (a, b):
        assert walk_mount(m.mnt) == set(mine_a) | set(mine_b), walk_mount(m.mnt)
    assert st["last_error"] is None

    # Both write their own names into one directory: both see the union.
    step_a = {f"step_1/__0_{i}.distcp": blob(f"sa{i}", 50_000 + i) for i in range(5)}
    step_b = {f"step_1/__1_{i}.distcp": blob(f"sb{i}", 40_000 + i) for i in range(5)}
    write_tree(a.mnt, step_a)
    write_tree(b.mnt, step_b)
    wait_published(a.mnt / "step_1")
    wait_published(b.mnt / "step_1")
    for m in (a, b):
        status(m, refresh=True)
    union = {**step_a, **step_b}
    for m in (a, b):
        assert sorted(os.listdir(m.mnt / "step_1")) == sorted(p.split("/")[1] for p in union), \
            f"{m.root.name} lists {sorted(os.listdir(m.mnt / 'step_1'))}"
        assert_files(union, m.mnt, f"{m.root.name}'s view of step_1")
    assert len(ls_json(a.shared, "step_1")) == len(union) + 1  # the directory itself

    # Reads of the other node's data come from its objects on SHARED.
    assert status(a)["shared_bytes_read"] > 0 and status(b)["shared_bytes_read"] > 0
    assert_fsck_clean(a.shared)


def test_conflicting_writes_resolve_to_one_whole_version(make_mount: MakeMount,
                                                          tmp_path: Path) -> None:
    a, b = two_nodes(make_mount)
    t = time.time_ns() - 3600 * 10**9
    versions = {
        # path: (n0's bytes, n0's mtime, n1's bytes, n1's mtime, the winner by the rule)
        "c/newer_on_n0.bin": (blob("x0", 700_000), t + 10**9, blob("x1", 500_000), t, "n0"),
        "c/newer_on_n1.bin": (blob("y0", 300_000), t, blob("y1", 450_000), t + 5, "n1"),
        "c/tie.bin": (blob("z0", 200_000), t, blob("z1", 210_000), t, "n1"),
        "c/same_size_tie.bin": (blob("w0", 65_536), t, blob("w1", 65_536), t, "n1"),
    }
    for path, (da, ma, db, mb, _w) in versions.items():
        for m, data, mtime in ((a, da, ma), (b, db, mb)):
            p = m.mnt / path
            p.parent.mkdir(exist_ok=True)
            p.write_bytes(data)
            os.utime(p, ns=(mtime, mtime))
            assert os.stat(p).st_mtime_ns == mtime
    wait_published(a.mnt / "c")
    wait_published(b.mnt / "c")
    # Two rounds: each node imports the other's newest manifest; nothing may flip back.
    for _ in range(2):
        for m in (a, b):
            status(m, refresh=True)

    out = export_files(a.shared, "c", tmp_path / "export")
    listed = {e["path"]: e for e in ls_json(a.shared, "c")}
    problems = []
    for path, (da, ma, db, mb, winner) in versions.items():
        want, want_mtime = (da, ma) if winner == "n0" else (db, mb)
        seen = {"n0 mount": (a.mnt / path).read_bytes(), "n1 mount": (b.mnt / path).read_bytes(),
                "export": out.get(path.split("/", 1)[1], b"")}
        for where, got in seen.items():
            if got != want:
                which = {da: "n0's version", db: "n1's version"}.get(
                    got, f"neither version (mixed or other: {len(got)} bytes, sha "
                         f"{hashlib.sha256(got).hexdigest()[:12]})")
                problems.append(f"{path}: {where} has {which}, the rule says {winner}'s")
        for m in (a, b):
            st = os.stat(m.mnt / path)
            if (st.st_size, st.st_mtime_ns) != (len(want), want_mtime):
                problems.append(f"{path}: {m.root.name} stat says size {st.st_size} mtime "
                                f"{st.st_mtime_ns}, winner has {len(want)} / {want_mtime}")
        if listed[path]["node"] != winner:
            problems.append(f"{path}: ls says node {listed[path]['node']}, rule says {winner}")
    assert not problems, "\n".join(problems) + "\n--- n0 ---\n" + a.log_tail() \
        + "\n--- n1 ---\n" + b.log_tail()


def test_conflict_is_resolved_after_a_later_rewrite(make_mount: MakeMount) -> None:
    """A newer local write beats an older imported version, and the other node then takes it."""
    a, b = two_nodes(make_mount)
    write_tree(a.mnt, {"d/f.bin": blob("first", 100_000)})
    wait_published(a.mnt / "d")
    status(b, refresh=True)
    assert (b.mnt / "d/f.bin").read_bytes() == blob("first", 100_000)
    # n1 rewrites the imported file: its version is newer, so it wins everywhere.
    time.sleep(0.01)  # a distinct mtime_ns even on a coarse clock
    (b.mnt / "d/f.bin").write_bytes(blob("second", 80_000))
    wait_published(b.mnt / "d")
    status(a, refresh=True)
    assert (a.mnt / "d/f.bin").read_bytes() == blob("second", 80_000)
    assert (b.mnt / "d/f.bin").read_bytes() == blob("second", 80_000)
    assert [e["node"] for e in ls_json(a.shared, "d/f.bin")] == ["n1"]


# -- fresh nodes ---------------------------------------------------------------------------------


def published_by_n0(make_mount: MakeMount) -> tuple[Mount, dict[str, bytes]]:
    a = start_node(make_mount, "a", "n0")
    expected = {f"step_{s}/__{r}_0.distcp": blob(f"{s}.{r}", 100_000 * r + 17)
                for s in (1, 2) for r in range(4)}
    expected["step_2/model.safetensors"] = blob("model", 9 << 20)
    expected["notes/readme.txt"] = b"hello\n"
    write_tree(a.mnt, expected)
    os.symlink("step_2", a.mnt / "latest")
    wait_published(a.mnt)
    a.unmount()
    return a, expected


def test_fresh_node_with_empty_nvme_reads_everything(make_mount: MakeMount) -> None:
    a, expected = published_by_n0(make_mount)
    c = start_node(make_mount, "c", "n2", shared=a.shared)
    assert_tree(expected, c.mnt, "a fresh node n2")
    assert os.readlink(c.mnt / "latest") == "step_2"
    assert (c.mnt / "latest/model.safetensors").read_bytes() == expected["step_2/model.safetensors"]
    assert status(c)["shared_bytes_read"] > 0


def test_same_node_with_lost_nvme_keeps_old_files_and_objects(make_mount: MakeMount,
                                                              tmp_path: Path) -> None:
    a, expected = published_by_n0(make_mount)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in objects(a.shared, "n0")}
    old_manifests = [p.name for p in manifests(a.shared, "n0")]

    # n0 again, on an empty NVME: its published files are all there...
    d = start_node(make_mount, "d", "n0", shared=a.shared)
    assert_files(expected, d.mnt, "n0 remounted with an empty NVME")
    # ...and what it writes now neither overwrites old objects nor hides old files.
    new = {f"step_3/__{r}_0.distcp": blob(f"3.{r}", 2_000_000 + r) for r in range(4)}
    new["step_1/__0_0.distcp"] = blob("rewritten", 12345)  # an old path, new content
    write_tree(d.mnt, new)
    os.unlink(d.mnt / "notes/readme.txt")  # an old file deleted after the loss
    del expected["notes/readme.txt"]
    wait_published(d.mnt)
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in objects(a.shared, "n0")}
    clobbered = [n for n, h in before.items() if after.get(n) != h]
    assert not clobbered, f"old objects changed or vanished: {clobbered}"
    assert len(after) > len(before), "the new writes published no new objects"
    new_manifests = [p.name for p in manifests(a.shared, "n0")]
    assert max(new_manifests) > max(old_manifests), (old_manifests, new_manifests)

    want = {**expected, **new}
    status(d, refresh=True)
    assert_files(want, d.mnt, "n0 after new writes")
    got = export_files(a.shared, "step_1", tmp_path / "s1")
    assert got == {k.split("/", 1)[1]: v for k, v in want.items() if k.startswith("step_1/")}
    listed = {e["path"] for e in ls_json(a.shared) if e["type"] == "f"}
    assert listed == set(want), (f"no longer published: {sorted(set(want) - listed)}, "
                                 f"should be gone: {sorted(listed - set(want))}")
    assert_fsck_clean(a.shared)

    # a third node sees the old and the new files together
    d.unmount()
    e = start_node(make_mount, "e", "n9", shared=a.shared)
    assert_files(want, e.mnt, "a fresh node after n0 lost its NVMe and wrote again")
    assert not (e.mnt / "notes/readme.txt").exists()
    assert cli("fsck", a.shared, "--deep").returncode == 0


def test_deletes_and_renames_propagate(make_mount: MakeMount, tmp_path: Path) -> None:
    a, b = two_nodes(make_mount)
    write_tree(a.mnt, {"gone.bin": b"to be deleted", "tmp-checkpoint-1/f.bin": blob("r", 70_000),
                       "keep.bin": b"stays"})
    wait_published(a.mnt)
    status(b, refresh=True)
    assert walk_mount(b.mnt) == {"gone.bin", "tmp-checkpoint-1/f.bin", "keep.bin"}
    os.unlink(a.mnt / "gone.bin")
    os.rename(a.mnt / "tmp-checkpoint-1", a.mnt / "checkpoint-1")  # HF Trainer's pattern
    wait_published(a.mnt)
    status(b, refresh=True)
    assert walk_mount(b.mnt) == {"checkpoint-1/f.bin", "keep.bin"}, walk_mount(b.mnt)
    assert (b.mnt / "checkpoint-1/f.bin").read_bytes() == blob("r", 70_000)
    listed = {e["path"] for e in ls_json(a.shared) if e["type"] == "f"}
    assert listed == {"checkpoint-1/f.bin", "keep.bin"}, listed


def test_deleted_directories_and_moved_symlinks_reach_every_node(make_mount: MakeMount,
                                                                tmp_path: Path) -> None:
    """A checkpoint directory its node deletes goes everywhere, and stays gone: the other
    node used to keep it, empty, publish it again, and so bring it back to the node that
    deleted it (every checkpoint retention removed). A `last` symlink moved to each new
    checkpoint (Lightning's save_last="link") follows on the other node, and goes when
    removed."""
    a, b = two_nodes(make_mount)
    write_tree(a.mnt, {"step_1/x": b"1", "step_2/y": b"2"})
    os.symlink("step_1", a.mnt / "last")
    wait_published(a.mnt)
    status(b, refresh=True)
    assert os.readlink(b.mnt / "last") == "step_1"
    os.symlink("step_2", a.mnt / "last.tmp")
    os.replace(a.mnt / "last.tmp", a.mnt / "last")
    shutil.rmtree(a.mnt / "step_1")
    wait_published(a.mnt)
    status(b, refresh=True)
    assert os.readlink(b.mnt / "last") == "step_2", "the symlink did not follow its node"
    assert sorted(os.listdir(b.mnt)) == ["last", "step_2"], sorted(os.listdir(b.mnt))
    write_tree(b.mnt, {"b.txt": b"n1 publishes again"})
    wait_published(b.mnt)
    status(a, refresh=True)
    assert sorted(os.listdir(a.mnt)) == ["b.txt", "last", "step_2"], sorted(os.listdir(a.mnt))
    os.unlink(a.mnt / "last")
    wait_published(a.mnt)
    status(b, refresh=True)
    assert not os.path.lexists(b.mnt / "last"), "a symlink its node removed is still here"
    listed = sorted(e["path"] for e in ls_json(a.shared))
    assert listed == ["b.txt", "step_2", "step_2/y"], listed
    assert set(export_files(a.shared, "", tmp_path / "out")) == {"b.txt", "step_2/y"}


def test_a_delete_or_rename_of_another_nodes_files_reaches_that_node(
        make_mount: MakeMount, tmp_path: Path) -> None:
    """As on one shared filesystem: n1 deletes a file n0 wrote, and renames a tmp-checkpoint
    both wrote into: n0's file goes on n0 too (a tombstone in n1's manifest), n0's shard
    leaves the old name for the new one everywhere, and nothing comes back when n0 publishes
    again. A version n0 rewrote after n1's copy was deleted stays. Tombstones go from n1's
    manifest once n0 no longer lists what they name."""
    a, b = two_nodes(make_mount)
    write_tree(a.mnt, {"step_1/x": b"x", "step_1/y": b"old y",
                       "tmp-checkpoint-5/shard0": b"s0"})
    os.symlink("step_1", a.mnt / "latest")
    write_tree(b.mnt, {"tmp-checkpoint-5/shard1": b"s1"})
    for m in (a, b):
        wait_published(m.mnt)
    for m in (a, b):
        status(m, refresh=True)
    assert (b.mnt / "tmp-checkpoint-5/shard0").read_bytes() == b"s0"
    write_tree(a.mnt, {"step_1/y": b"new y"})  # n1 has not seen this one yet
    os.unlink(b.mnt / "step_1/x")
    os.unlink(b.mnt / "step_1/y")
    os.unlink(b.mnt / "latest")
    os.rename(b.mnt / "tmp-checkpoint-5", b.mnt / "checkpoint-5")
    wait_published(a.mnt)
    wait_published(b.mnt)
    status(a, refresh=True)
    assert walk_mount(a.mnt) == {"step_1/y", "checkpoint-5/shard0", "checkpoint-5/shard1"}, \
        walk_mount(a.mnt)
    assert sorted(os.listdir(a.mnt)) == ["checkpoint-5", "step_1"], sorted(os.listdir(a.mnt))
    assert (a.mnt / "step_1/y").read_bytes() == b"new y"
    wait_published(a.mnt)
    status(b, refresh=True)
    want = {"step_1/y": b"new y", "checkpoint-5/shard0": b"s0", "checkpoint-5/shard1": b"s1"}
    assert_tree(want, b.mnt, "n1 after n0 published again")
    assert sorted(os.listdir(b.mnt)) == ["checkpoint-5", "step_1"], sorted(os.listdir(b.mnt))
    assert export_files(a.shared, "", tmp_path / "out") == want
    wait_published(b.mnt)  # n1's manifest after it saw n0 drop the deleted versions
    newest = manifest.parse(manifests(a.shared, "n1")[-1].read_bytes())
    assert newest.gone == [], newest.gone
    assert_fsck_clean(a.shared)


def test_open_file_is_not_swapped_under_its_reader(make_mount: MakeMount) -> None:
    a, b = two_nodes(make_mount)
    v1, v2 = blob("v1", 1 << 20), blob("v2", 1 << 20)
    write_tree(a.mnt, {"f.bin": v1})
    wait_published(a.mnt)
    status(b, refresh=True)
    with open(b.mnt / "f.bin", "rb") as f:
        assert f.read(1000) == v1[:1000]
        time.sleep(0.01)
        (a.mnt / "f.bin").write_bytes(v2)
        wait_published(a.mnt)
        status(b, refresh=True)
        rest = f.read()
        assert v1[1000:] == rest, "an open file's content changed under its reader " + (
            "to the new version" if rest == v2[1000:] else "to mixed bytes")
    # closed: "it is looked at again on the next refresh" (ckptfs/remote.py)
    status(b, refresh=True)
    try:
        wait_for(lambda: (b.mnt / "f.bin").read_bytes() == v2, SEEN_WITHIN,
                 "n1 to take n0's new version once the file is closed")
    except TimeoutError as e:
        got = (b.mnt / "f.bin").read_bytes()
        which = "the old version" if got == v1 else "neither version"
        raise AssertionError(f"{e}: n1 still reads {which}; n1 status remote: "
                             f"{status(b)['remote']}\n{b.log_tail(10)}") from None


def test_file_against_directory_conflict_agrees_everywhere(make_mount: MakeMount,
                                                           tmp_path: Path) -> None:
    """n0 publishes ck/x as a file, n1 as a directory: whichever wins, both mounts, `ls` and
    `export` must show the same tree (the documented rule covers whole files only)."""
    a, b = two_nodes(make_mount)
    (a.mnt / "ck").mkdir()
    (a.mnt / "ck/x").write_bytes(b"a file on n0")
    (a.mnt / "ck/other_a").write_bytes(b"a")
    time.sleep(0.01)
    (b.mnt / "ck").mkdir()
    (b.mnt / "ck/x").mkdir()
    (b.mnt / "ck/x/y").write_bytes(b"a file in a directory on n1")
    (b.mnt / "ck/other_b").write_bytes(b"b")
    wait_published(a.mnt)
    wait_published(b.mnt)
    for _ in range(2):
        for m in (a, b):
            status(m, refresh=True)
    views = {
        "n0 mount": walk_mount(a.mnt / "ck"),
        "n1 mount": walk_mount(b.mnt / "ck"),
        "ls": {e["path"][3:] for e in ls_json(a.shared, "ck") if e["type"] == "f"},
        "export": set(export_files(a.shared, "ck", tmp_path / "out")),
    }
    assert len({frozenset(v) for v in views.values()}) == 1, f"views disagree: {views}"
    assert {"other_a", "other_b"} <= views["export"]


def test_a_new_nvme_does_not_mount_blind_when_shared_cannot_be_read(
        make_mount: MakeMount) -> None:
    """n0 lost its NVMe, and SHARED cannot be read at its first mount on a new one: the mount
    is refused with one line (numbering segments from 1 replaced published objects; adopting
    an empty namespace let its manifests replace the real ones). Once SHARED reads again, the
    same directory mounts and everything is there."""
    import pytest

    a, expected = published_by_n0(make_mount)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in objects(a.shared, "n0")}
    objs = a.shared / "ckptfs" / "objects" / "n0"
    objs.rename(objs.with_name("n0.away"))
    objs.write_bytes(b"")  # listing it fails (ENOTDIR) as a failing NAS would
    d = make_mount("d", node_args("n0"), segment_size=SEGMENT, start=False)
    d.shared = a.shared
    with pytest.raises(RuntimeError, match="cannot list this node's objects"):
        d.start()
    objs.unlink()
    objs.with_name("n0.away").rename(objs)
    mans = sorted((a.shared / "ckptfs" / "manifests" / "n0").glob("*.manifest"))
    for p in mans:  # reading them fails (EISDIR)
        p.rename(p.with_name(p.name + ".away"))
        p.mkdir()
    with pytest.raises(RuntimeError, match="manifests"):
        d.start()
    for p in mans:
        p.rmdir()
        p.with_name(p.name + ".away").rename(p)
    d.start()
    assert_files(expected, d.mnt, "n0 on its new NVMe once SHARED reads again")
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in objects(a.shared, "n0")}
    assert all(after.get(n) == h for n, h in before.items()), "a published object changed"


def test_a_second_nvme_cannot_publish_as_a_node_a_live_daemon_publishes_as(
        make_mount: MakeMount) -> None:
    """Two NVME directories on one machine under one node id (the hostname, by default)
    would number and name their objects alike; the second mount is refused with one line
    naming the first, and nothing of the first's is touched."""
    import pytest

    a = start_node(make_mount, "a", "n0")
    write_tree(a.mnt, {"step_1/x": blob("x", 300_000)})
    wait_published(a.mnt)
    b = make_mount("b", node_args("n0"), segment_size=SEGMENT, start=False)
    b.shared = a.shared
    with pytest.raises(RuntimeError, match="node id 'n0' is in use"):
        b.start()
    assert (a.mnt / "step_1" / "x").read_bytes() == blob("x", 300_000)
    b2 = make_mount("b2", node_args("n1"), segment_size=SEGMENT, start=False)
    b2.shared = a.shared
    b2.start()  # its own id: fine
    assert_files({"step_1/x": blob("x", 300_000)}, b2.mnt, "n1 next to n0")


def test_retention_never_takes_a_checkpoint_brought_back_by_another_node_for_the_newest(
        make_mount: MakeMount) -> None:
    """Node a keeps 2 checkpoints, node b keeps all of them. b writes each checkpoint's
    commit marker (DCP's rank 0 on b). Once a deletes step_1 and step_2, b's manifest
    still lists them and a imports them again; they must count as the old checkpoints they
    are (their marker's time on b), not as the newest (the order of their new names here),
    or a's retention deletes step_3 and step_4, whose files only a has."""
    a = start_node(make_mount, "a", "n0", extra=["--keep-shared", "2"])
    b = start_node(make_mount, "b", "n1", shared=a.shared)
    mine = {}
    for step in range(1, 5):
        rel = f"step_{step}/__0_0.distcp"
        mine[rel] = blob(rel, 200_000)
        write_tree(a.mnt, {rel: mine[rel]})
        wait_published(a.mnt)
        status(b, refresh=True)
        write_tree(b.mnt, {f"step_{step}/.metadata": f"meta {step}".encode()})
        wait_published(b.mnt)
        status(a, refresh=True)
        time.sleep(0.05)  # distinct completion times, as checkpoints minutes apart have
    wait_for(lambda: "step_1" not in os.listdir(a.mnt) and "step_2" not in os.listdir(a.mnt),
             30, "a's retention to delete step_1 and step_2")
    # b still publishes them: a imports them again, and runs retention again, many times
    deadline = time.monotonic() + 8 * REFRESH + 6
    while time.monotonic() < deadline:
        status(a, refresh=True)
        assert {"step_3", "step_4"} <= set(os.listdir(a.mnt)), os.listdir(a.mnt)
        time.sleep(0.5)
    newest = {k: v for k, v in mine.items() if k.startswith(("step_3", "step_4"))}
    assert_files(newest, a.mnt, "a's newest checkpoints")
    wait_published(a.mnt)
    status(b, refresh=True)
    assert_files(newest, b.mnt, "a's newest checkpoints, seen from b")


def test_renaming_another_nodes_file_moves_it_everywhere(
        make_mount: MakeMount, tmp_path: Path) -> None:
    """n1 renames a file it imported from n0: the file becomes n1's under the new name, so
    `wait` on n1 means published (SHARED and `export` have it), and n0's version under the
    old name goes on n0 too (n1's manifest says n1 moved it away). A chmod of another of
    n0's files does not take it over: n0's delete of it still reaches n1."""
    a, b = two_nodes(make_mount)
    f, k = blob("f", 70_000), blob("k", 500)
    write_tree(a.mnt, {"step_1/f": f, "step_1/k": k})
    wait_published(a.mnt)
    status(b, refresh=True)
    os.rename(b.mnt / "step_1/f", b.mnt / "step_1/g")
    os.chmod(b.mnt / "step_1/k", 0o644)  # the mode it has: a chmod -R
    wait_published(b.mnt / "step_1")
    listed = {e["path"] for e in ls_json(a.shared) if e["type"] == "f"}
    assert listed == {"step_1/g", "step_1/k"}, sorted(listed)
    assert export_files(a.shared, "step_1", tmp_path / "out")["g"] == f
    status(a, refresh=True)
    assert walk_mount(a.mnt) == {"step_1/g", "step_1/k"}, walk_mount(a.mnt)
    os.unlink(a.mnt / "step_1/k")
    write_tree(a.mnt, {"other": b"n0 publishes again"})
    wait_published(a.mnt / "other")
    status(b, refresh=True)
    assert wait_for(lambda: walk_mount(b.mnt) == {"step_1/g", "other"}, SEEN_WITHIN,
                    "n1 to see n0's delete of k, and f not back")
    assert (b.mnt / "step_1/g").read_bytes() == f
    assert (a.mnt / "step_1/g").read_bytes() == f  # n0 sees n1's file
    assert "step_1/k" not in {e["path"] for e in ls_json(a.shared)}
    assert_fsck_clean(a.shared)


def test_renaming_a_directory_with_another_nodes_files_keeps_them_under_the_new_name(
        make_mount: MakeMount, tmp_path: Path) -> None:
    """HF's pattern across nodes: every node writes its shards into tmp-checkpoint-5, then
    node 0 renames it to checkpoint-5. The other node's shards under the renamed directory
    become node 0's (moved, as a renamed file is): checkpoint-5 is whole on SHARED, in
    `export`, and on node 0 after the other node publishes again."""
    a, b = two_nodes(make_mount)
    mine, theirs = blob("s0", 300_000), blob("s1", 300_000)
    write_tree(b.mnt, {"tmp-checkpoint-5/shard1": theirs})
    wait_published(b.mnt)
    write_tree(a.mnt, {"tmp-checkpoint-5/shard0": mine})
    status(a, refresh=True)
    assert (a.mnt / "tmp-checkpoint-5/shard1").read_bytes() == theirs
    write_tree(a.mnt, {"tmp-checkpoint-5/trainer_state.json": b"{}"})
    os.rename(a.mnt / "tmp-checkpoint-5", a.mnt / "checkpoint-5")
    wait_published(a.mnt / "checkpoint-5")
    want = {"shard0": mine, "shard1": theirs, "trainer_state.json": b"{}"}
    assert export_files(a.shared, "checkpoint-5", tmp_path / "out") == want
    write_tree(b.mnt, {"other": b"n1 publishes again"})
    wait_published(b.mnt / "other")
    status(a, refresh=True)
    assert {p.name: p.read_bytes() for p in (a.mnt / "checkpoint-5").iterdir()} == want
    assert_fsck_clean(a.shared)


def test_gc_follows_the_other_nodes_newest_manifests(make_mount: MakeMount) -> None:
    """GC keeps this node's objects that another node's newest manifest names. It parses each
    node's manifest once per new sequence number and keeps what it referenced: here n0's GC
    has read n1's manifest before n1 took over n0's file (a rename: n1's now, its extents stay
    in n0's object). n0 then deletes its own name of the file, so nothing of n0's needs the
    object any more; its GC must read n1's newer manifest and keep the object, which n1 reads.
    Once n1 deletes its copy too, n0's GC deletes the object."""
    a = start_node(make_mount, "a", "n0", extra=("--gc-grace", "0"))
    b = start_node(make_mount, "b", "n1", shared=a.shared)
    write_tree(b.mnt, {"n1-was-here": b"x"})
    wait_published(b.mnt)
    f = blob("f", 3 << 20)
    write_tree(a.mnt, {"step_1/f": f})
    wait_published(a.mnt)
    before = {p.name for p in objects(a.shared, "n0")}
    write_tree(a.mnt, {"scratch": b"s"})
    wait_published(a.mnt)
    os.unlink(a.mnt / "scratch")
    write_tree(a.mnt, {"scratch2": b"s"})
    wait_published(a.mnt)
    # deletes scratch's segment: it read n1's manifest, which names nothing of n0's yet
    assert "; 0 segments freed" not in cli("gc", a.mnt).stdout
    status(b, refresh=True)
    assert wait_for(lambda: readable_everywhere(b, {"step_1/f": f}), SEEN_WITHIN, "n1 sees f")
    os.rename(b.mnt / "step_1/f", b.mnt / "step_1/g")
    wait_published(b.mnt)
    newest = manifest.parse(manifests(a.shared, "n1")[-1].read_bytes())
    named = {o.rsplit("/", 1)[1] for o in newest.objects if o.startswith("n0/")}
    assert named, "n1's copy names no object of n0's: the test needs it to"
    # n0's name of the file goes: this unlink, or n0's refresh of n1's rename if it came
    # first (a rename reaches every node, and the old name goes with it)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(a.mnt / "step_1/f")
    write_tree(a.mnt, {"later": blob("later", 5000)})
    wait_published(a.mnt)
    cli("gc", a.mnt)
    left = {p.name for p in objects(a.shared, "n0")}
    assert {f"{s}.seg" for s in named} <= left, "GC deleted an object n1's manifest names"
    cli("evict", "--all", b.mnt)
    assert (b.mnt / "step_1/g").read_bytes() == f
    os.unlink(b.mnt / "step_1/g")
    wait_published(b.mnt)
    res = cli("gc", a.mnt)
    gone = before - {p.name for p in objects(a.shared, "n0")}
    assert {f"{s}.seg" for s in named} <= gone, (res.stdout, sorted(gone))


def test_any_name_linux_allows_is_published_and_exported_byte_for_byte(
        make_mount: MakeMount, tmp_path: Path) -> None:
    """Names are bytes: not valid UTF-8, quotes, backslashes, newlines, control characters.
    The manifest (JSON) carries them as format.md section 6.2 says, `export` writes the same
    bytes back, and another node sees them."""
    a, b = two_nodes(make_mount)
    names = [b"caf\xe9", b'quote"d', b"back\\slash", b"new\nline", b"tab\there", b"\x01ctl",
             "ünï ☃".encode(), b"\xff\xfe", b"end\\"]
    root = os.fsencode(a.mnt / "step_1")
    os.mkdir(root)
    want = {}
    for i, name in enumerate(names):
        data = blob(f"n{i}", 1000 + i)
        with open(os.path.join(root, name), "wb") as fh:
            fh.write(data)
        want[name] = data
    os.symlink(b'target "with\\ odd\xe9 bytes', os.path.join(root, b"link\xe9"))
    wait_published(a.mnt)
    out = tmp_path / "out"
    res = cli("export", a.shared, "step_1", out)
    assert res.returncode == 0, res
    got = {n: Path(os.fsdecode(os.path.join(os.fsencode(out), n))).read_bytes()
           for n in os.listdir(os.fsencode(out)) if n != b"link\xe9"}
    assert got == want
    assert os.readlink(os.path.join(os.fsencode(out), b"link\xe9")) == \
        b'target "with\\ odd\xe9 bytes'
    status(b, refresh=True)
    broot = os.fsencode(b.mnt / "step_1")
    assert wait_for(lambda: os.path.isdir(broot) and set(os.listdir(broot)) >= set(names),
                    SEEN_WITHIN, "n1 sees every name")
    for name, data in want.items():
        with open(os.path.join(broot, name), "rb") as fh:
            assert fh.read() == data, name


def assert_erofs(mnt: Path, what: str) -> None:
    """Every kind of change to `mnt` (which holds step_1/.metadata) fails with EROFS."""
    meta = mnt / "step_1/.metadata"
    for attempt in (lambda: (mnt / "new").write_bytes(b"x"), lambda: meta.write_bytes(b"x"),
                    lambda: os.truncate(meta, 0), lambda: (mnt / "d").mkdir(),
                    lambda: meta.unlink(), lambda: os.rename(mnt / "step_1", mnt / "step_9"),
                    lambda: os.chmod(meta, 0o600)):
        try:
            attempt()
        except OSError as e:
            assert e.errno == errno.EROFS, (what, e)
        else:
            raise AssertionError(f"a change succeeded on {what}")


def test_a_read_only_node_reads_what_others_publish_from_a_read_only_store(
        make_mount: MakeMount, tmp_path: Path) -> None:
    """An evaluation node that only reads checkpoints, on SHARED mounted read-only: it sees
    what the writer published and what it publishes next, the kernel refuses its writes
    (EROFS), `wait` has nothing to wait for, GC deletes nothing, and unmounting does not wait
    for a drain that could never publish (it used to, forever, retrying EROFS). A read-only
    mount under a node id that publishes is refused before it takes the NVME directory."""
    a = start_node(make_mount, "a", "n0")
    first = {"step_1/__0_0.distcp": blob("ro1", 700_000), "step_1/.metadata": b"m1"}
    write_tree(a.mnt, first)
    wait_published(a.mnt / "step_1")
    view = tmp_path / "shared-ro"
    view.mkdir()
    subprocess.run(["mount", "--bind", "-o", "ro", str(a.shared), str(view)], check=True,
                   timeout=30)
    try:
        refused = make_mount("w", node_args("n0", "--read-only"), start=False)
        res = cli("mount", refused.nvme, view, refused.mnt, "--read-only", "--node-id", "n0",
                  check=False)
        assert res.returncode == 1 and "needs a node id of its own" in res.stderr, res.stderr
        assert not (refused.nvme / "ckptfs.json").exists(), "the refused mount took NVME"

        r = make_mount("r", node_args("reader", "--read-only"), start=False)
        r.shared = view
        r.start()
        assert_tree(first, r.mnt, "the read-only node")
        assert_erofs(r.mnt, "a --read-only mount")
        # made writable behind its back (the kernel flips the flag without asking the
        # daemon): the daemon refuses writes itself, for it could never publish them
        subprocess.run(["mount", "-i", "-o", "remount,rw", str(r.mnt)], check=True, timeout=30)
        assert_erofs(r.mnt, "a --read-only mount remounted rw")
        assert_tree(first, r.mnt, "the read-only node after the refused writes")
        t0 = time.monotonic()
        wait_published(r.mnt / "step_1", timeout=10)
        assert time.monotonic() - t0 < 5, "wait on a read-only mount waited"
        gc = cli("gc", r.mnt, check=False)
        assert "deletes nothing" in gc.stderr, gc.stderr
        st = status(r)
        assert st["read_only"] and st["bytes_pending_upload"] == 0, st

        second = {"step_2/__0_0.distcp": blob("ro2", 300_000)}
        write_tree(a.mnt, second)
        wait_published(a.mnt / "step_2")
        wait_for(lambda: readable_everywhere(r, second), SEEN_WITHIN,
                 "the read-only node to see the writer's next checkpoint")
        assert_tree({**first, **second}, r.mnt, "the read-only node after a refresh")
        t0 = time.monotonic()
        res = cli("umount", r.mnt, timeout=60)
        assert time.monotonic() - t0 < 10, f"umount took {time.monotonic() - t0:.1f} s"
        assert not [p for p in view.rglob("*") if "reader" in p.name], \
            "the read-only node put something on SHARED"
    finally:
        subprocess.run(["umount", "-l", str(view)], check=False, timeout=30)


def test_wait_all_nodes_returns_once_every_node_published_and_the_marker_is_out(
        make_mount: MakeMount) -> None:
    """`wait --all-nodes N`: a checkpoint counts as saved on SHARED only when N nodes have
    published their own wait of it and its commit marker is published (read from SHARED as
    any node would). Before that it times out saying how far it got."""
    a, b = two_nodes(make_mount)
    write_tree(a.mnt, {"step_1/__0_0.distcp": blob("w0", 200_000)})
    write_tree(a.mnt, {"step_1/.metadata": b"meta"})  # rank 0's marker, last on its node
    res = cli("wait", a.mnt / "step_1", "--all-nodes", "2", "--timeout", "4", check=False)
    assert res.returncode == 1 and "1/2 nodes' waits published, marker yes" in res.stderr, \
        res.stderr
    write_tree(b.mnt, {"step_1/__1_0.distcp": blob("w1", 200_000)})
    wait_published(b.mnt / "step_1")
    cli("wait", a.mnt / "step_1", "--all-nodes", "2", "--timeout", "30")
    res = cli("wait", b.mnt / "step_1", "--all-nodes", "3", "--timeout", "3", check=False)
    assert res.returncode == 1 and "2/3 nodes' waits published" in res.stderr, res.stderr


def test_wait_all_nodes_does_not_count_a_node_whose_shard_is_published_in_part(
        make_mount: MakeMount, tmp_path: Path) -> None:
    """A node's manifest lists its log up to its last published segment, so it can list the
    first part of a shard whose tail is still in the node's unsealed segment. `wait
    --all-nodes` used to count such a node (it has files under the checkpoint) and return
    with the shard published in part; now a node counts once its own `wait` of the
    checkpoint is published (a WAITED record, written when that wait begins)."""
    a = start_node(make_mount, "a", "n0")
    # nothing of b's is sealed unless a wait asks for it
    b = start_node(make_mount, "b", "n1", shared=a.shared, extra=("--seal-idle", "3600"))
    write_tree(a.mnt, {"step_1/__0_0.distcp": blob("p0", 200_000),
                       "step_1/.metadata": b"meta"})
    head, tail = blob("p1", 300_000), blob("p1-tail", 100_000)
    write_tree(b.mnt, {"step_1/__1_0.distcp": head, "other/x": b"x"})
    wait_published(b.mnt / "other")  # seals b's log: step_1's head is published with it
    with open(b.mnt / "step_1/__1_0.distcp", "ab") as f:
        f.write(tail)
    res = cli("wait", a.mnt / "step_1", "--all-nodes", "2", "--timeout", "4", check=False)
    assert res.returncode == 1 and "1/2 nodes' waits published, marker yes" in res.stderr, \
        f"counted a node whose shard is published in part: {res.returncode} {res.stderr}"
    assert export_files(a.shared, "step_1", tmp_path / "early")["__1_0.distcp"] == head
    wait_published(b.mnt / "step_1")
    cli("wait", a.mnt / "step_1", "--all-nodes", "2", "--timeout", "30")
    got = export_files(a.shared, "step_1", tmp_path / "out")
    assert got["__1_0.distcp"] == head + tail
    assert got["__0_0.distcp"] == blob("p0", 200_000)
    # a wait with nothing logged since the last one of the same directory logs nothing (a
    # script that polls `ckptfs wait` makes no segment, object or manifest per call)
    wait_published(b.mnt / "step_1")
    st = status(b)
    wait_published(b.mnt / "step_1")
    assert (status(b)["log_seq"], status(b)["segments_uploaded"]) == \
        (st["log_seq"], st["segments_uploaded"])
    # a wait of a directory above a checkpoint vouches for it too...
    write_tree(a.mnt, {"step_2/__0_0.distcp": b"2"})
    wait_published(a.mnt)
    # ...but not for one that had no files yet when it began
    write_tree(b.mnt, {"step_3/__1_0.distcp": b"3", "step_3/.metadata": b"m"})
    wait_published(b.mnt / "step_3")
    res = cli("wait", b.mnt / "step_3", "--all-nodes", "2", "--timeout", "3", check=False)
    assert res.returncode == 1 and "1/2 nodes' waits published" in res.stderr, \
        f"counted a wait that began before the checkpoint existed: {res.stderr}"
    listed = {c["name"]: c["waited"] for c in json.loads(cli("ls", a.shared, "--json").stdout)}
    assert listed == {"step_1": ["n0", "n1"], "step_2": ["n0"], "step_3": ["n1"]}, listed


def test_directory_and_symlink_mtimes_reach_other_nodes_and_export(make_mount: MakeMount,
                                                                   tmp_path: Path) -> None:
    """`ls -t` on a reader, and on an export, orders checkpoint directories as on the node
    that wrote them. An import used to leave each directory with the time its entries were
    imported (every create moves its parent's mtime), so a fresh node's `ls -t` gave the
    order of the import, and an export the time of the export."""
    a = start_node(make_mount, "a", "n0")
    write_tree(a.mnt, {"step_10/x": b"10", "step_2/sub/y": b"2", "step_1/z": b"1"})
    os.symlink("step_10", a.mnt / "last")
    # step_1 oldest, step_2 next, step_10 newest; a name order that the time order is not
    when = {"step_1": 1_700_000_000_111_111_111, "step_2/sub": 1_700_000_050_000_000_001,
            "step_2": 1_700_000_100_222_222_222, "step_10": 1_700_000_200_333_333_333}
    for d, t in when.items():
        os.utime(a.mnt / d, ns=(t, t))
    os.utime(a.mnt / "last", ns=(1_700_000_300_000_000_000,) * 2, follow_symlinks=False)
    wait_published(a.mnt)

    def mtimes(root: Path) -> dict[str, int]:
        out = {d: os.stat(root / d).st_mtime_ns for d in when}
        out["last"] = os.lstat(root / "last").st_mtime_ns
        return out

    expected = mtimes(a.mnt)
    assert expected == {**when, "last": 1_700_000_300_000_000_000}, expected
    b = start_node(make_mount, "b", "n1", shared=a.shared)
    assert mtimes(b.mnt) == expected, "a fresh node's directories have other mtimes"
    export_files(a.shared, "", tmp_path / "out")
    assert mtimes(tmp_path / "out") == expected, "the export's directories have other mtimes"

    # a new file on the writer moves its directory there, and so on the reader (not to the
    # time of the reader's import)
    write_tree(a.mnt, {"step_1/late": b"later"})
    moved = os.stat(a.mnt / "step_1").st_mtime_ns
    assert moved > when["step_1"]
    wait_published(a.mnt)
    status(b, refresh=True)
    assert (b.mnt / "step_1/late").read_bytes() == b"later"
    assert os.stat(b.mnt / "step_1").st_mtime_ns == moved, "the reader's import moved it"
    # and what this node writes into that directory moves it here, as any write does
    write_tree(b.mnt, {"step_2/mine": b"n1's"})
    assert os.stat(b.mnt / "step_2").st_mtime_ns > when["step_2"]


def test_a_store_that_never_answers_for_another_nodes_latest_file_does_not_stop_the_mount(
        make_mount: MakeMount) -> None:
    """Retention reads DeepSpeed's `latest` (which names the complete checkpoint beside it)
    on every pass, on the request thread. On node B that file is A's, so its bytes are on
    SHARED; a store that does not answer for them (a FIFO in place of the object: opening it
    blocks) used to stop B's whole mount. Now the request thread reads only what is in
    memory and a thread of its own waits for the store."""
    import threading

    a = start_node(make_mount, "a", "n0")
    write_tree(a.mnt, {"run/global_step1/mp_rank_00_model_states.pt": blob("m", 300_000),
                       "run/latest": b"global_step1"})
    wait_published(a.mnt)
    holder = [p for p in objects(a.shared, "n0") if b"global_step1" in p.read_bytes()]
    assert len(holder) == 1, holder
    fifo = holder[0]
    away = fifo.with_name(fifo.name + ".away")
    fifo.rename(away)
    os.mkfifo(fifo)

    def unblock() -> None:  # give any reader of the FIFO an end of file
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no reader: nothing to unblock
            return
        os.close(fd)

    try:
        b = start_node(make_mount, "b", "n1", shared=a.shared)
        wait_for(lambda: (b.mnt / "run" / "latest").exists(), SEEN_WITHIN,
                 "B to see A's checkpoint")
        time.sleep(3)  # a retention pass or more has looked at `latest`
        done = threading.Event()

        def probe() -> None:
            os.stat(b.mnt)
            os.listdir(b.mnt / "run")
            (b.mnt / "mine").write_bytes(b"x")
            done.set()

        t = threading.Thread(target=probe, daemon=True)
        t.start()
        answered = done.wait(10)
        if not answered:
            unblock()  # let the daemon go on, so that the test can unmount it
        assert answered, "B's mount stopped answering while SHARED did not answer"
        unblock()
        t.join(10)
    finally:
        unblock()
        if fifo.exists() and not fifo.is_file():
            fifo.unlink()
            away.rename(fifo)


def test_a_new_nvme_does_not_bring_back_what_another_node_deleted_of_this_ones(
        make_mount: MakeMount, tmp_path: Path) -> None:
    """A deletes step_1, B's shard in it too (a tombstone for B's version), while B is down;
    B's NVMe is lost, and its new NVME directory imports B's own last manifest, which still
    lists the shard. The import used to skip the tombstone check for the node's own entries:
    the deleted shard came back on B (and into B's next manifest), while A and SHARED had
    it gone."""
    a, b = two_nodes(make_mount)
    write_tree(b.mnt, {"step_1/shard_b.bin": blob("b", 500_000)})
    wait_published(b.mnt)
    write_tree(a.mnt, {"step_1/shard_a.bin": blob("a", 500_000), "keep/x": b"x"})
    wait_published(a.mnt)
    wait_for(lambda: (a.mnt / "step_1" / "shard_b.bin").exists(), SEEN_WITHIN,
             "A to see B's shard")
    b.kill()
    b.clean_stale()
    shutil.rmtree(a.mnt / "step_1")
    wait_published(a.mnt)
    shutil.rmtree(b.nvme)
    b.nvme.mkdir()
    b.start()
    assert not (b.mnt / "step_1" / "shard_b.bin").exists(), "B brought back its deleted shard"
    assert (b.mnt / "keep" / "x").read_bytes() == b"x"
    write_tree(b.mnt, {"after.bin": b"b"})
    wait_published(b.mnt)
    time.sleep(2 * REFRESH + 1)
    assert not (a.mnt / "step_1").exists(), "the deleted checkpoint came back on A"
    assert set(export_files(a.shared, "", tmp_path / "out")) == {"keep/x", "after.bin"}


def test_with_nodes_n_retention_counts_a_checkpoint_complete_once_n_nodes_are_in_it(
        make_mount: MakeMount) -> None:
    """--nodes 2 --keep-shared 1 on A: A's marker of step_2 alone does not make step_2
    complete while B's part of it is not published (else A deleted step_1, on every node,
    with step_2 not whole anywhere). Once B's shard of step_2 is imported, step_1 goes."""
    a = start_node(make_mount, "a", "n0", extra=["--nodes", "2", "--keep-shared", "1"])
    # B seals (and so publishes) only when asked: its part of step_2 stays on B meanwhile
    b = start_node(make_mount, "b", "n1", shared=a.shared, extra=["--seal-idle", "600"])
    for step in (1, 2):
        write_tree(b.mnt, {f"step_{step}/__1_0.distcp": blob(f"b{step}", 200_000)})
        if step == 1:
            wait_published(b.mnt)
            wait_for(lambda: (a.mnt / "step_1" / "__1_0.distcp").exists(), SEEN_WITHIN,
                     "A to see B's part of step_1")
        write_tree(a.mnt, {f"step_{step}/__0_0.distcp": blob(f"a{step}", 200_000),
                           f"step_{step}/.metadata": b"m"})
    # B's part of step_2 is on B only (not published): A must keep step_1
    time.sleep(5)  # two retention passes and more
    assert (a.mnt / "step_1" / "__1_0.distcp").read_bytes() == blob("b1", 200_000)
    complete = {c["name"]: c["complete"] for c in status(a)["retention"]["checkpoints"]}
    assert complete == {"step_1": True, "step_2": False}, complete
    wait_published(b.mnt)
    wait_for(lambda: not (a.mnt / "step_1").exists(), SEEN_WITHIN + 5,
             "A's retention to delete step_1 once B's part of step_2 is in")
    assert (a.mnt / "step_2" / "__1_0.distcp").read_bytes() == blob("b2", 200_000)


def test_with_nodes_n_a_checkpoint_one_node_renamed_into_place_counts_every_writer(
        make_mount: MakeMount) -> None:
    """HF's multi-node pattern with --nodes 2: each node writes its shard into
    tmp-checkpoint-S, then node 0 renames it to checkpoint-S. The renamed directory is node
    0's (every file of it), but node 1's shard is still node 1's bytes: the checkpoint is
    complete (`ls --nodes 2`, retention), and --keep-shared 1 deletes checkpoint-1 once
    checkpoint-2 is in. Counting the nodes that own the entries, checkpoint-S looked 1/2
    complete for good and retention never deleted anything."""
    a = start_node(make_mount, "a", "n0", extra=["--nodes", "2", "--keep-shared", "1"])
    b = start_node(make_mount, "b", "n1", shared=a.shared)
    for step in (1, 2):
        theirs = blob(f"b{step}", 200_000)
        write_tree(b.mnt, {f"tmp-checkpoint-{step}/shard1": theirs})
        wait_published(b.mnt / f"tmp-checkpoint-{step}")
        status(a, refresh=True)
        assert (a.mnt / f"tmp-checkpoint-{step}/shard1").read_bytes() == theirs
        write_tree(a.mnt, {f"tmp-checkpoint-{step}/shard0": blob(f"a{step}", 200_000),
                           f"tmp-checkpoint-{step}/trainer_state.json": b"{}"})
        os.rename(a.mnt / f"tmp-checkpoint-{step}", a.mnt / f"checkpoint-{step}")
        wait_published(a.mnt / f"checkpoint-{step}")
        if step == 1:
            table = json.loads(cli("ls", a.shared, "--nodes", "2", "--json").stdout)
            c1 = {c["name"]: c for c in table}["checkpoint-1"]
            assert sorted(c1["nodes"]) == ["n0", "n1"] and c1["complete"], c1
    wait_for(lambda: not (a.mnt / "checkpoint-1").exists(), SEEN_WITHIN,
             "A's retention to delete checkpoint-1 once checkpoint-2 (n0 and n1) is in")
    assert (a.mnt / "checkpoint-2/shard1").read_bytes() == blob("b2", 200_000)
    assert_fsck_clean(a.shared)
