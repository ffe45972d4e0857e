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
from ckptfs.manifest import Entry, Extents, Manifest
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
    walk = ref._walk_files
    monkeypatch.setattr(ref, "_walk_files", lambda: walk(batch=batch))
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
