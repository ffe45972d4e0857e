"""Descriptors kept open between reads (ckptfs/fdcache.py), and the two readers that keep
them: objects on SHARED and local segments. A descriptor must never be closed under a
read that has looked it up: its number would go to the next open, and the read would
return another file's bytes. Real files, real threads."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

from ckptfs import segment as fmt
from ckptfs.fdcache import FdCache
from ckptfs.shared import SharedStore


def target(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except FileNotFoundError:
        return None


def run_threads(fn, n: int) -> None:
    """fn(0) ... fn(n - 1), each on its own thread, all at once; returns when all ended."""
    threads = [threading.Thread(target=fn, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def random_reads(read, content: dict[int, bytes], size: int, between=None) -> int:
    """8 threads x 1,500 reads of 512 bytes at random places of random objects of `content`
    (ids 1-40) through read(id, offset), which returns the bytes or None (gone); thread 0
    calls between(rnd) every 100 reads. Asserts that no read raised and that every read got
    its object's bytes; returns how many found theirs gone."""
    wrong: list[tuple[int, int]] = []
    errors: list[BaseException] = []
    gone = [0]

    def work(k: int) -> None:
        rnd = random.Random(k)
        try:
            for i in range(1500):
                seg = rnd.randrange(1, 41)
                if between is not None and k == 0 and i % 100 == 99:
                    between(rnd)
                off = rnd.randrange(0, size - 512)
                got = read(seg, off)
                if got is None:
                    gone[0] += 1
                elif got != content[seg][off:off + 512]:
                    wrong.append((seg, off))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    run_threads(work, 8)
    assert not errors, errors[:3]
    assert not wrong, f"{len(wrong)} reads returned another object's bytes: {wrong[:5]}"
    return gone[0]


def opener(path: Path):
    return lambda: os.open(path, os.O_RDONLY)


def test_a_borrowed_descriptor_outlives_its_eviction_and_no_longer(tmp_path: Path) -> None:
    a, b, c = (tmp_path / n for n in "abc")
    for p in (a, b, c):
        p.write_bytes(p.name.encode() * 10)
    cache = FdCache(1)
    with cache.borrow("a", opener(a)) as fa:
        assert fa is not None
        with cache.borrow("b", opener(b)) as fb:  # over the limit: "a" is evicted...
            assert len(cache) == 1
            assert target(fa) == str(a)  # ...but stays open while borrowed
            assert os.pread(fa, 1, 0) == b"a"
        assert target(fb) == str(b)  # still cached: not borrowed, not evicted
    assert target(fa) != str(a)  # the last borrower closed it
    with cache.borrow("b", opener(b)) as again:
        assert again == fb  # cached: the same descriptor
        cache.drop("b")  # its file is going away: closed once this borrow ends
        assert target(fb) == str(b)
    assert target(fb) != str(b)
    with cache.borrow("c", opener(c)) as fc:
        cache.close()
        assert target(fc) == str(c)
    assert target(fc) != str(c)
    assert len(cache) == 0


def test_an_opener_that_declines_caches_nothing(tmp_path: Path) -> None:
    cache = FdCache(4)
    with cache.borrow("x", lambda: None) as fd:
        assert fd is None
    assert len(cache) == 0


def test_threads_reading_many_objects_through_few_descriptors_get_their_bytes(
        tmp_path: Path) -> None:
    """8 threads read 40 objects at random through a store that may keep 3 open: every
    read returns the bytes of the object it named (each object's bytes are its own)."""
    store = SharedStore(str(tmp_path))
    store._read_fds.limit = 3
    size = 64 << 10
    content = {}
    for seg in range(1, 41):
        path = Path(store.object_path("n0", seg))
        path.parent.mkdir(parents=True, exist_ok=True)
        content[seg] = random.Random(seg).randbytes(size)
        path.write_bytes(content[seg])
    assert random_reads(lambda seg, off: store.read_range("n0", seg, off, 512), content,
                        size) == 0
    assert len(store._read_fds) <= 3
    store.close()
    open_objects = [fd for fd in os.listdir("/proc/self/fd")
                    if (t := target(int(fd))) and t.startswith(str(tmp_path))]
    assert not open_objects, "close() left descriptors of objects open"


def test_deleting_an_object_closes_its_descriptor(tmp_path: Path) -> None:
    store = SharedStore(str(tmp_path))
    path = Path(store.object_path("n0", 7))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"x" * 100)
    assert store.read_range("n0", 7, 0, 10) == b"x" * 10
    assert len(store._read_fds) == 1
    store.delete_object("n0", 7)
    assert len(store._read_fds) == 0
    assert not any(target(int(fd)) == str(path) for fd in os.listdir("/proc/self/fd"))
    assert fmt.segment_name(7) not in os.listdir(path.parent)


def test_threads_reading_many_local_segments_through_few_descriptors_get_their_bytes(
        tmp_path: Path) -> None:
    """The same for local segment files (ckptfs/reads.py), with segments evicted meanwhile:
    a read gets its segment's bytes, or finds it gone, never another segment's bytes."""
    from ckptfs.errors import FsError
    from ckptfs.reads import Reader

    size = 64 << 10
    content = {}
    for seg in range(1, 41):
        content[seg] = random.Random(seg).randbytes(size)
        (tmp_path / f"{seg}.seg").write_bytes(content[seg])
    reader = Reader(lambda seg: str(tmp_path / f"{seg}.seg"), max_fds=3)

    def read(seg: int, off: int) -> bytes | None:
        try:
            return reader._pread(seg, 512, off)
        except FsError:  # evicted, and no shared store here
            return None

    def evict(rnd: random.Random) -> None:
        reader.forget(rnd.randrange(1, 41))  # its descriptor goes

    assert random_reads(read, content, size, evict) > 0 and reader.evicted
    reader.close()
    assert not any((t := target(int(fd))) and t.startswith(str(tmp_path))
                   for fd in os.listdir("/proc/self/fd"))
