"""The published view is advanced on its own thread and retried after a failure with the
same list of segments (drain.py: _retrying -> _advance). A retry must not apply a record
twice, nor put a manifest that is already published. Real log, index, store directory; the
store's failures are injected."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptfs import manifest
from ckptfs.drain import Drain
from ckptfs.index import ROOT_INO, SegState
from ckptfs.shared import SharedStore
from test_format import make


class FlakyStore(SharedStore):
    def __init__(self, root: str):
        super().__init__(root)
        self.fail_put = 0
        self.fail_prune = 0
        self.puts: list[int] = []

    def put_manifest(self, node: str, seq: int, data: bytes) -> str:
        if self.fail_put:
            self.fail_put -= 1
            raise OSError(5, "the NAS hiccuped")
        self.puts.append(seq)
        return super().put_manifest(node, seq, data)

    def prune_manifests(self, node: str, keep: int = 2) -> None:
        if self.fail_prune:
            self.fail_prune -= 1
            raise OSError(5, "the NAS hiccuped")
        super().prune_manifests(node, keep)


class FlakyOpen(Drain):
    fail_open: set[int] = set()

    def _open_sealed(self, seg: int, size: int):
        if seg in self.fail_open:
            self.fail_open.discard(seg)
            raise OSError(5, "cannot read the segment")
        return super()._open_sealed(seg, size)


def checkpoint_in_two_segments(tmp_path: Path):
    """Segment 1: .metadata.tmp written and renamed to .metadata (DCP's way); segment 2: a
    shard. Applying segment 1 twice brings .metadata.tmp back."""
    index, log, ns = make(tmp_path / "nvme")
    d = ns.mkdir(ROOT_INO, b"step_1", 0o755, 0, 0).ino
    f = ns.create(d, b".metadata.tmp", 0o644, 0, 0).ino
    ns.write(f, 0, b"m" * 1000)
    ns.release(f)
    ns.rename(d, b".metadata.tmp", d, b".metadata", 0)
    first = ns.seal("size")
    f = ns.create(d, b"__0_0.distcp", 0o644, 0, 0).ino
    ns.write(f, 0, b"s" * 5000)
    ns.release(f)
    second = ns.seal("size")
    for seg in (first, second):
        index.set_segment(seg, SegState.PUBLISHED)  # as the drain marks it once uploaded
    index.commit()
    return index, log, ns


def flaky_store(tmp_path: Path) -> FlakyStore:
    (tmp_path / "shared").mkdir()
    store = FlakyStore(str(tmp_path / "shared"))
    store.init()
    store.prepare("t0")
    return store


def advance_until_done(drain: Drain, attempts: int = 4) -> int:
    """What _retrying does: the same arguments again after a failure."""
    ready = drain._ready_segments()
    assert len(ready) == 2
    failures = 0
    for _ in range(attempts):
        try:
            drain._pub_thread.submit(drain._advance, ready, True).result()
            return failures
        except OSError:
            failures += 1
    raise AssertionError("never published")


def published_names(drain: Drain, store: SharedStore) -> list[str]:
    seq = store.list_manifests(drain.node)[-1]
    m = manifest.parse(store.get_manifest(drain.node, seq), "m")
    return sorted(e.path for e in m.entries)


@pytest.mark.parametrize("fault", ["put_manifest", "second_segment", "prune"])
def test_a_retried_publish_neither_repeats_records_nor_replaces_a_manifest(
        tmp_path: Path, fault: str) -> None:
    index, log, ns = checkpoint_in_two_segments(tmp_path)
    store = flaky_store(tmp_path)
    drain = FlakyOpen(str(tmp_path / "nvme"), "t0", index, store, log.path, None)
    drain.fail_open = set()
    if fault == "put_manifest":
        store.fail_put = 1
    elif fault == "second_segment":
        drain.fail_open = {drain._ready_segments()[1][0]}
    else:
        store.fail_prune = 1
    try:
        failures = advance_until_done(drain)
        assert failures == (0 if fault == "prune" else 1)
        names = published_names(drain, store)
        assert names == ["step_1", "step_1/.metadata", "step_1/__0_0.distcp"], names
        assert len(store.puts) == len(set(store.puts)) == 1, "a manifest was put twice"
        view = drain._pub_thread.submit(
            lambda: sorted(n for _k, n, _c in drain.pub.readdir(
                drain.pub.lookup(ROOT_INO, b"step_1"), 0))).result()
        assert view == [b".metadata", b"__0_0.distcp"], view
        assert os.listdir(store.manifest_dir("t0"))
    finally:
        drain.close()
        log.close()
        index.close()


def test_a_view_committed_inside_a_segment_resumes_there_after_a_crash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The view commits every VIEW_COMMIT_RECORDS records, inside a segment too (an LMDB
    write transaction holds its dirty pages until it commits). After a crash there, the next
    daemon must take that segment again from the record after the commit: not skip the rest
    of it (.metadata would never appear), nor apply its first records twice (.metadata.tmp
    would come back)."""
    import ckptfs.drain

    monkeypatch.setattr(ckptfs.drain, "VIEW_COMMIT_RECORDS", 2)
    index, log, ns = checkpoint_in_two_segments(tmp_path)
    store = flaky_store(tmp_path)
    drain = Drain(str(tmp_path / "nvme"), "t0", index, store, log.path, None)
    ready = drain._ready_segments()
    applied = 0
    real_apply = drain.pub.apply

    def crash_after_two(seg: int, rec) -> None:  # noqa: ANN001
        nonlocal applied
        if applied == 2:
            raise RuntimeError("SIGKILL")
        applied += 1
        real_apply(seg, rec)

    drain.pub.apply = crash_after_two  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        drain._pub_thread.submit(drain._advance, ready, True).result()
    first = ready[0][0]
    assert drain.pub.applied[0] == first and drain.pub.applied[1] < ready[0][1], (
        f"the crash was meant to come inside segment {first}: {drain.pub.applied}")
    drain._pub_thread.submit(drain.pub.close, False).result()  # what a SIGKILL leaves
    drain._pub_thread.shutdown()

    drain = Drain(str(tmp_path / "nvme"), "t0", index, store, log.path, None)
    try:
        again = drain._ready_segments()
        assert [s for s, _z, _d in again] == [s for s, _z, _d in ready], again
        drain._pub_thread.submit(drain._advance, again, True).result()
        names = published_names(drain, store)
        assert names == ["step_1", "step_1/.metadata", "step_1/__0_0.distcp"], names
    finally:
        drain.close()
        log.close()
        index.close()
