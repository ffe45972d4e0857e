"""Retention's view of the namespace (ckptfs/retention.py), on a real index and log: which
directories are checkpoints, and that a pass every 2 s does not list big directories again
when nothing in them changed."""

from __future__ import annotations

import stat
from pathlib import Path

from test_format import close, make

from ckptfs.index import ROOT_INO
from ckptfs.retention import (DEFAULT_MARKERS, DEFAULT_RETAIN, Retention, RetentionConfig,
                              checkpoint_of, named_by)

DIR = stat.S_IFDIR | 0o755
FILE = stat.S_IFREG | 0o644


def test_which_paths_are_checkpoints() -> None:
    retain = ("step_*", "checkpoint-*")
    assert checkpoint_of("step_1/a.distcp", retain, False) == "step_1"
    assert checkpoint_of("run/checkpoint-5", retain, True) == "run/checkpoint-5"
    assert checkpoint_of("run/checkpoint-5/step_2/x", retain, False) == "run/checkpoint-5"
    assert checkpoint_of("a/b/step_3/x", retain, False) == "a/b/step_3"
    assert checkpoint_of("a/b/c/step_4/x", retain, False) is None  # deeper than MAX_DEPTH
    assert checkpoint_of("run/step_9", retain, False) is None  # a file, not a directory
    assert named_by(" global_step100/\n") == "global_step100"
    assert named_by("1000\n") == "iter_0001000"


def test_default_names_cover_the_frameworks() -> None:
    """The step directories the common frameworks make are checkpoints by default, and the
    names around them are not."""
    for path in ("step_100",            # DCP by hand, Orbax with step_prefix="step"
                 "step-100",            # torchtitan
                 "run/checkpoint-100",  # HF Trainer
                 "run/global_step100",  # DeepSpeed
                 "run/iter_0000100"):   # Megatron-LM
        assert checkpoint_of(path, DEFAULT_RETAIN, True) == path, path
    for path in ("100", "run", "2026-12-05/x", "latest", "run/last.ckpt"):
        assert checkpoint_of(path, DEFAULT_RETAIN, True) is None, path
    for marker in (".metadata", "trainer_state.json", "commit_success.txt", "latest"):
        assert marker in DEFAULT_MARKERS


def test_a_pass_lists_a_directory_again_only_after_it_changed(tmp_path: Path) -> None:
    index, log, ns = make(tmp_path)
    run = ns.make_node(ROOT_INO, b"run", DIR, 0, 0).ino
    flat = ns.make_node(run, b"shards", DIR, 0, 0).ino  # not a checkpoint: 2,000 files
    for i in range(2000):
        ns.make_node(flat, f"f{i}".encode(), FILE, 0, 0)
    for step in (1, 2):
        ck = ns.make_node(run, f"checkpoint-{step}".encode(), DIR, 0, 0).ino
        ns.make_node(ck, b"trainer_state.json", FILE, 0, 0)
    r = Retention(ns, RetentionConfig())
    listed: list[int] = []
    readdir = index.readdir

    def counting(ino: int, cookie: int):  # type: ignore[no-untyped-def]
        listed.append(ino)
        return readdir(ino, cookie)

    index.readdir = counting  # type: ignore[method-assign]
    assert [c.name for c in r.checkpoints()] == ["run/checkpoint-1", "run/checkpoint-2"]
    assert flat in listed and run in listed
    listed.clear()
    for _ in range(3):
        assert [c.name for c in r.checkpoints()] == ["run/checkpoint-1", "run/checkpoint-2"]
    assert flat not in listed and run not in listed, "unchanged directories listed again"
    ns.make_node(flat, b"more", FILE, 0, 0)
    ck = ns.make_node(run, b"checkpoint-3", DIR, 0, 0).ino
    ns.make_node(ck, b"trainer_state.json", FILE, 0, 0)
    cps = r.checkpoints()
    assert [c.name for c in cps] == [f"run/checkpoint-{s}" for s in (1, 2, 3)]
    assert all(c.complete for c in cps)
    assert listed.count(flat) == 1 and listed.count(run) == 1
    index.readdir = readdir  # type: ignore[method-assign]
    close(index, log)
