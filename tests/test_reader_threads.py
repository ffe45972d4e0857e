"""Threads of the read path that want the same remote record (ckptfs/reads.py): kernel
requests that share a record, prefetch threads, a fetch that fails and is taken over.
A real Reader over a real shared store directory; the store's reads are held and failed
on cue, so the interleaving is exact, not left to timing."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path

from ckptfs import segment as fmt
from ckptfs.errors import FsError
from ckptfs.index import Extent
from ckptfs.reads import Reader
from ckptfs.segment import RecType
from ckptfs.shared import SharedStore


class HeldStore(SharedStore):
    """A shared store whose n-th read waits for `go[n]`; the first one then fails."""

    def __init__(self, root: str):
        super().__init__(root)
        self.calls = 0
        self.go: dict[int, threading.Event] = {}
        self.mu = threading.Lock()

    def gate(self, n: int) -> threading.Event:
        with self.mu:
            return self.go.setdefault(n, threading.Event())

    def read_range(self, node: str, seg: int, offset: int, length: int) -> bytes:
        with self.mu:
            n = self.calls
            self.calls += 1
        assert self.gate(n).wait(30), f"read {n} never released"
        if n == 0:
            raise OSError(5, "the NAS hiccuped")
        return super().read_range(node, seg, offset, length)


def wait_until(cond, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.01)


def test_readers_of_a_record_whose_fetch_failed_each_get_it_and_none_hangs(
        tmp_path: Path) -> None:
    """X's fetch of a big record fails while B and C wait for it; both then fetch it
    themselves, and D arrives meanwhile. Every reader gets the record's bytes; no entry of
    the in-flight table is overwritten (which lost a wake-up: D waited forever, and a
    reader got KeyError, i.e. EIO)."""
    payload = bytes(range(256)) * (300 << 2)  # 300 KiB: fetched alone, the span is the record
    rec = b"".join(bytes(p) for p in fmt.encode_record(RecType.WRITE, 5, 0, 1, 1, payload))
    store = HeldStore(str(tmp_path))
    obj = Path(store.object_path("n0", 7))
    obj.parent.mkdir(parents=True)
    obj.write_bytes(bytes(64) + rec)
    e = Extent(0, 7, 64, 0, len(payload), len(payload))
    reader = Reader(lambda s: str(tmp_path / "gone" / str(s)), "n0", store)
    reader.evicted.add(7)  # its local copy is gone: the bytes come from the store
    got: dict[str, object] = {}

    def read(name: str) -> None:
        try:
            rec = reader._remote_record(e, report=False) or b""
            got[name] = bytes(rec)[fmt.RECORD_HEADER_SIZE:]
        except BaseException as ex:  # noqa: BLE001 - compared below
            got[name] = ex

    threads = {}

    def start(name: str) -> None:
        threads[name] = threading.Thread(target=read, args=(name,), daemon=True)
        threads[name].start()

    start("X")
    wait_until(lambda: store.calls == 1, "X never fetched")
    start("B")
    start("C")
    time.sleep(0.2)  # B and C find X's fetch in flight and wait for it
    assert store.calls == 1
    store.gate(0).set()  # X fails; B and C wake up
    wait_until(lambda: store.calls >= 2, "nobody fetched after X failed")
    time.sleep(0.2)
    start("D")
    time.sleep(0.2)
    for n in range(1, 5):
        store.gate(n).set()
    for name, t in threads.items():
        t.join(10)
        assert not t.is_alive(), f"reader {name} hangs"
    assert isinstance(got["X"], FsError) and got["X"].errno == errno.EIO  # its own fetch failed
    for name in "BCD":
        assert got[name] == payload, f"{name}: {got[name]!r:.200}"
    assert not reader._inflight
    assert store.calls <= 3, "the retry of a failed fetch should be shared, not repeated"


def test_a_record_verified_locally_and_evicted_under_a_read_is_verified_again_from_the_store(
        tmp_path: Path) -> None:
    """A read that found a record local and verified, whose segment is evicted before it
    opens the file, reads the store's copy: that copy is verified too (a damaged one is
    EIO), never served on the strength of the local copy's check."""
    import pytest

    from ckptfs.errors import CorruptData

    payload = bytes(range(256)) * 64
    rec = b"".join(bytes(p) for p in fmt.encode_record(RecType.WRITE, 5, 0, 1, 1, payload))
    local = tmp_path / "seg7"
    local.write_bytes(bytes(64) + rec)
    store = SharedStore(str(tmp_path / "shared"))
    obj = Path(store.object_path("n0", 7))
    obj.parent.mkdir(parents=True)
    damaged = bytearray(bytes(64) + rec)
    damaged[64 + fmt.RECORD_HEADER_SIZE + 100] ^= 0xFF
    obj.write_bytes(bytes(damaged))

    class EvictedUnderTheRead(Reader):
        stale = 0  # is_local answers that many times as it did before the eviction

        def is_local(self, e: Extent) -> bool:
            if self.stale:
                self.stale -= 1
                return True
            return super().is_local(e)

    reader = EvictedUnderTheRead(lambda s: str(local), "n0", store)
    e = Extent(0, 7, 64, 0, len(payload), len(payload))
    assert bytes(reader.read_extent(e, 0, 100)) == payload[:100]  # verified, remembered
    reader.forget(7)
    local.unlink()
    reader._verified[(7, 64)] = None  # the read had seen it verified before the eviction
    reader.stale = 1
    with pytest.raises(CorruptData):
        reader.read_extent(e, 0, 100)
    assert reader.corrupt_reads == 1
