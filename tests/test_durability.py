"""Every name ckptfs creates on NVMe or SHARED is made durable in its directory.

By POSIX a new directory entry survives a power loss only once its parent directory is
fsync'd; ext4 happens to commit it with any later fsync, other filesystems (and a strict
crash model) do not. An outside audit with a crash-recording filesystem found three such
names never fsync'd in their directory: LMDB's data.mdb in NVME/index (and the published
view's), data.mdb in the index snapshot being made, and SHARED/ckptfs with its objects/ and
manifests/. Losing the index and its snapshot after GC deleted old segments lost fsync'd
files; losing SHARED/ckptfs lost everything `wait` had returned for.

These run the real code on real directories and watch `os.fsync`: after each step, every
directory the step created must have had its parent fsync'd (and LMDB's file, its own)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptfs import layout
from ckptfs.gc import take_snapshot
from ckptfs.index import Index
from ckptfs.log import SegmentLog
from ckptfs.shared import SharedStore


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The paths os.fsync was called on, in order."""
    seen: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    yield seen


def test_the_index_and_its_file_are_durable_in_nvme(tmp_path: Path, fsynced: list[str]
                                                     ) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    idx = Index(str(nvme / "index"))
    try:
        assert str(nvme) in fsynced, "NVME not fsync'd after index/ was created in it"
        assert str(nvme / "index") in fsynced, "index/ not fsync'd after data.mdb was made"
    finally:
        idx.close()


def test_the_segments_directory_is_durable_in_nvme(tmp_path: Path, fsynced: list[str]
                                                   ) -> None:
    (tmp_path / "nvme").mkdir()
    log = SegmentLog(str(tmp_path / "nvme" / "segments"), "n0", 1 << 20)
    try:
        assert str(tmp_path / "nvme") in fsynced
    finally:
        log.close()


def test_a_snapshot_names_its_file_before_it_is_renamed_into_place(tmp_path: Path,
                                                                    fsynced: list[str]) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    idx = Index(str(nvme / "index"))
    try:
        idx.commit()
        fsynced.clear()
        take_snapshot(idx, str(nvme))
    finally:
        idx.close()
    tmp = str(nvme / "snapshot.tmp")
    assert tmp in fsynced, f"snapshot.tmp/ not fsync'd before its rename: {fsynced}"
    assert fsynced.index(tmp) > fsynced.index(tmp + "/data.mdb")
    assert fsynced[-1] == str(nvme), "NVME not fsync'd after the rename"
    assert (nvme / "snapshot" / "data.mdb").exists()


@pytest.mark.parametrize("depth", [0, 2])
def test_the_shared_store_and_a_nodes_directories_are_durable(tmp_path: Path,
                                                              fsynced: list[str],
                                                              depth: int) -> None:
    """SHARED itself may be new too (a subdirectory of the NAS the mount created)."""
    shared = tmp_path / "nas"
    shared.mkdir()
    for i in range(depth):
        shared = shared / f"d{i}"
    layout.makedirs_durable(str(shared))
    store = SharedStore(str(shared))
    store.init()
    store.prepare("n0")
    root = shared / layout.SHARED_ROOT
    made_here = [p for p in (shared, *shared.parents) if tmp_path / "nas" in p.parents]
    for made in (root, root / "objects", root / "objects" / "n0", root / "manifests",
                 root / "manifests" / "n0", *made_here):
        assert made.is_dir()
        assert str(made.parent) in fsynced, f"{made.parent} not fsync'd after {made.name}"
