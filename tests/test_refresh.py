"""Importing another node's manifest while mounted, in steps (ckptfs/remote.py).

A refresh serves other requests between its steps, so each step must leave the index usable
by them: no LMDB cursor open across a step (an index commit in between closes it), commit
markers last (a checkpoint whose marker is here has all its files), and a file removed here
meanwhile is not removed a second time. No mount: the Refresher runs on a real index and log,
and the test plays the requests that would run between steps.
"""

from __future__ import annotations

from array import array
from pathlib import Path

import pytest
from test_format import close, make

from ckptfs.index import ROOT_INO
from ckptfs.manifest import Entry, Extents, Manifest, walk
from ckptfs.namespace import Namespace
from ckptfs.remote import Refresher

NAMES = ["other/0000000000000001"]


def manifest(seq: int, paths: list[str]) -> Manifest:
    entries = [Entry("step_1", "d", 0o755, 0, 0, 0, 1)]
    for i, p in enumerate(paths):
        ext = Extents(array("q", [0, 100 + i, 0, 64 + 200 * i, 0, 100 + i]), NAMES)
        entries.append(Entry(p, "f", 0o644, 0, 0, 100 + i, 1000 + seq, extents=ext))
    return Manifest("other", seq, 0, {NAMES[0]: {"size": 1 << 30}}, entries)


def exists(ns: Namespace, path: str) -> bool:
    parent = ROOT_INO
    for comp in path.split("/"):
        child = ns.index.lookup(parent, comp.encode())
        if child is None:
            return False
        parent = child
    return True


@pytest.mark.parametrize("batch", [7, 1000])
def test_an_import_in_steps_keeps_no_cursor_open_and_brings_the_marker_last(
        tmp_path: Path, batch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    index, log, ns = make(tmp_path)
    ref = Refresher(ns, None, "me", fresh_nvme=False, markers=(".metadata", "*.done"))
    walk = ref._walk
    monkeypatch.setattr(ref, "_walk", lambda: walk(batch=batch))
    shards = [f"step_1/__{r}_{i}.distcp" for r in range(4) for i in range(25)]
    # the markers come first in the manifest's own (sorted) order
    first = manifest(1, ["step_1/.metadata", "step_1/a.done", *shards])
    steps = 0
    for _ in ref._apply_all({"other": first}):
        steps += 1
        index.commit()  # what a request served between two steps may do
        if exists(ns, "step_1/.metadata") or exists(ns, "step_1/a.done"):
            missing = [p for p in shards if not exists(ns, p)]
            assert not missing, f"a marker is in before {len(missing)} shards"
    assert steps > len(shards), f"{steps} steps for {len(shards)} files: not interleavable"
    assert all(exists(ns, p) for p in shards + ["step_1/.metadata", "step_1/a.done"])
    assert ref.seen == {"other": 1}

    # the next manifest drops half the shards; one of them is removed here meanwhile, one
    # is renamed here (a local file now, not the import), and another appears locally
    dropped = shards[::2]
    kept = shards[1::2]
    second = manifest(2, ["step_1/.metadata", *kept])
    d = index.lookup(ROOT_INO, b"step_1")
    assert d is not None
    renamed = dropped[1].split("/")[1].encode()
    for i, _ in enumerate(ref._apply_all({"other": second})):
        index.commit()
        if i == 3:
            ns.unlink(d, dropped[0].split("/")[1].encode(), want_dir=False)
            ns.rename(d, renamed, d, b"mine.distcp", 0)
            ns.create(d, b"local.distcp", 0o644, 0, 0)
    for p in dropped:
        assert not exists(ns, p), f"{p} is still here after its node dropped it"
    assert all(exists(ns, p) for p in kept), "a file the manifest keeps was removed"
    assert exists(ns, "step_1/local.distcp"), "a file written here was removed"
    assert ref.seen == {"other": 2}
    close(index, log)


def test_directories_and_symlinks_follow_their_node_and_are_not_published_again(
        tmp_path: Path) -> None:
    """What a refresh made for another node (directories, symlinks, files) goes when that
    node's manifest drops it, and a symlink takes that node's new target. None of it is in
    this node's manifest, except a directory holding something of this node's: otherwise a
    checkpoint directory its node deleted came back from every other node, empty, and a
    `last` symlink never moved."""
    index, log, ns = make(tmp_path)
    ref = Refresher(ns, None, "me", fresh_nvme=False)

    def other(seq: int, dirs: list[str], files: list[str], link: str | None) -> Manifest:
        m = manifest(seq, files)
        m.entries[1:1] = [Entry(d, "d", 0o755, 0, 0, 0, 1) for d in dirs]
        if link is not None:
            m.entries.append(Entry("last", "l", 0o777, 0, 0, len(link), 100 * seq, link))
        return m

    def published() -> set[str]:
        return {p for p, _ in walk(index, skip_foreign_of="me")}

    def apply(m: Manifest) -> None:
        for _ in ref._apply_all({"other": m}):
            index.commit()

    apply(other(1, ["step_2", "step_2/sub"], ["step_1/a", "step_2/sub/b"], "step_1"))
    assert all(exists(ns, p) for p in ("step_1/a", "step_2/sub/b", "last"))
    last = index.lookup(ROOT_INO, b"last")
    assert last is not None
    assert index.get_inode(last).target == b"step_1"
    # here: a file of this node's in an imported directory, a directory and a symlink of
    # its own
    step_1 = index.lookup(ROOT_INO, b"step_1")
    assert step_1 is not None
    ns.create(step_1, b"local", 0o644, 0, 0)
    ns.make_node(ROOT_INO, b"mine", 0o40755, 0, 0)
    ns.make_node(ROOT_INO, b"mylink", 0o120777, 0, 0, target=b"mine")
    assert published() == {"step_1", "step_1/local", "mine", "mylink"}, published()

    # its node moves `last` and deletes step_2, then all of step_1
    apply(other(2, ["step_3"], ["step_1/a", "step_3/c"], "step_3"))
    assert not exists(ns, "step_2"), "a directory its node deleted is still here"
    assert index.lookup(ROOT_INO, b"last") == last, "the symlink was not updated in place"
    assert index.get_inode(last).target == b"step_3"
    apply(other(3, [], ["step_3/c"], None))
    assert not exists(ns, "last") and not exists(ns, "step_1/a")
    assert exists(ns, "step_1/local"), "a directory holding a file of this node's went"
    assert exists(ns, "mine") and exists(ns, "mylink")
    assert published() == {"step_1", "step_1/local", "mine", "mylink"}, published()
    close(index, log)


def test_a_directory_two_nodes_wrote_into_goes_when_the_last_of_them_drops_it(
        tmp_path: Path) -> None:
    """Every node's ranks write into step_1 (DCP): made here for the node whose manifest came
    first, step_1 must stay while the other still has files in it, and go once neither
    lists it, in whichever order they drop it."""
    index, log, ns = make(tmp_path)
    ref = Refresher(ns, None, "me", fresh_nvme=False)

    def node(name: str, seq: int, files: list[str]) -> Manifest:
        m = manifest(seq, files)
        return Manifest(name, seq, 0, m.objects, m.entries if files else [])

    def apply(*ms: Manifest) -> None:
        for _ in ref._apply_all({m.node: m for m in ms}):
            index.commit()

    apply(node("a", 1, ["step_1/a0"]), node("b", 1, ["step_1/b0"]))
    assert exists(ns, "step_1/a0") and exists(ns, "step_1/b0")
    apply(node("a", 2, []))
    assert exists(ns, "step_1/b0") and not exists(ns, "step_1/a0")
    apply(node("b", 2, []))
    assert not exists(ns, "step_1"), "an emptied directory neither node lists is still here"
    close(index, log)
