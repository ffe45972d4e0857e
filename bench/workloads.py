"""Rank processes: checkpoint writers and restore readers, started together with a barrier.

Each rank is a real process (multiprocessing, spawn). A rank prepares everything it can before the
barrier (its data buffer, the checksums it will expect), then the timed part runs from the moment
the barrier releases to the moment the rank's last write+fsync (or read) returned; the parent takes
min(start)..max(end) over ranks, so the figure is what a training job would see.

File contents are deterministic (seeded per rank), so readers verify every byte by xxh3 against
what the writer wrote without the writer shipping anything.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue as queue_mod
import random
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import xxhash

MiB = 1 << 20
BUF_SIZE = 16 * MiB  # per-rank random source, sliced at varying offsets


@dataclass(frozen=True)
class FileSpec:
    name: str
    size: int
    seed: int  # picks the byte stream; same seed + size = same content


# ---------------------------------------------------------------- plans


def storm_plan(
    ranks: int, files: int, min_bytes: int, max_bytes: int, seed: int = 1
) -> list[list[FileSpec]]:
    """`files` DCP-style shards over `ranks` ranks, sizes uniform in [min, max] (4 KiB aligned)."""
    rng = random.Random(seed)
    plan: list[list[FileSpec]] = [[] for _ in range(ranks)]
    for k in range(files):
        rank = k % ranks
        i = len(plan[rank])
        size = rng.randint(min_bytes, max_bytes) & ~4095 or 4096
        plan[rank].append(FileSpec(f"__{rank}_{i}.distcp", size, seed * 1_000_003 + k))
    return plan


def big_plan(ranks: int, size: int, seed: int = 2) -> list[list[FileSpec]]:
    return [[FileSpec(f"__{r}_0.distcp", size, seed * 1_000_003 + r)] for r in range(ranks)]


def plan_bytes(plan: list[list[FileSpec]]) -> int:
    return sum(f.size for rank in plan for f in rank)


METADATA_NAME = ".metadata"
METADATA_SIZE = 256 * 1024  # DCP's .metadata is a pickle of the plan: small


# ---------------------------------------------------------------- content


def chunks(spec: FileSpec, buf: bytes, chunk: int) -> Iterator[memoryview]:
    """The file's bytes as memoryview slices of the shared buffer, at offsets picked by its seed."""
    view = memoryview(buf)
    off = (spec.seed * 2654435761) % (BUF_SIZE - chunk) & ~4095
    left = spec.size
    k = 0
    while left > 0:
        n = min(chunk, left)
        start = (off + k * 1_048_573 * 4096) % (BUF_SIZE - n)
        yield view[start : start + n]
        left -= n
        k += 1


def expected_hash(spec: FileSpec, buf: bytes, chunk: int) -> int:
    h = xxhash.xxh3_64()
    for c in chunks(spec, buf, chunk):
        h.update(c)
    return h.intdigest()


# ---------------------------------------------------------------- rank bodies (run in children)


def _write_file(path: str, spec: FileSpec, buf: bytes, chunk: int, fsync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        for c in chunks(spec, buf, chunk):
            while c:
                n = os.write(fd, c)
                c = c[n:]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def writer_rank(
    rank: int,
    barrier: Any,
    done: Any,
    out: Any,
    directory: str,
    files: list[FileSpec],
    chunk: int,
    fsync: bool,
    write_metadata: bool,
    buf_seed: int,
) -> dict:
    """Write this rank's shards; rank 0 then writes .metadata the way DCP does (tmp + rename)."""
    buf = make_buffer(buf_seed + rank)
    lat = []
    barrier.wait(timeout=120)
    t0 = time.monotonic()
    for spec in files:
        s = time.monotonic()
        _write_file(os.path.join(directory, spec.name), spec, buf, chunk, fsync)
        lat.append(time.monotonic() - s)
    t_shards = time.monotonic()
    if write_metadata:
        done.wait(timeout=600)  # DCP: rank 0 writes the metadata after every rank's shards
        if rank == 0:
            meta = FileSpec(METADATA_NAME, METADATA_SIZE, 7)
            tmp = os.path.join(directory, METADATA_NAME + ".tmp")
            _write_file(tmp, meta, buf, chunk, fsync)
            os.rename(tmp, os.path.join(directory, METADATA_NAME))
    t1 = time.monotonic()
    return {
        "t0": t0,
        "t1": t1,
        "t_shards": t_shards,
        "files": len(files),
        "bytes": sum(f.size for f in files),
        "file_latency": lat,
    }


def reader_rank(
    rank: int,
    barrier: Any,
    done: Any,
    out: Any,
    directory: str,
    files: list[FileSpec],
    chunk: int,
    verify: bool,
    read_metadata: bool,
    buf_seed: int,
) -> dict:
    """Read this rank's shards back (rank 0 reads .metadata first) and check every byte."""
    buf = make_buffer(buf_seed + rank)
    want = {f.name: expected_hash(f, buf, chunk) for f in files} if verify else {}
    if read_metadata and rank == 0 and verify:
        meta_spec = FileSpec(METADATA_NAME, METADATA_SIZE, 7)
        want[METADATA_NAME] = expected_hash(meta_spec, buf, chunk)
    del buf
    rbuf = bytearray(4 * MiB)
    rview = memoryview(rbuf)
    bad: list[str] = []
    total = 0
    order = [FileSpec(METADATA_NAME, METADATA_SIZE, 7)] if read_metadata and rank == 0 else []
    order += files
    barrier.wait(timeout=120)
    t0 = time.monotonic()
    for spec in order:
        h = xxhash.xxh3_64() if verify else None
        n_file = 0
        with open(os.path.join(directory, spec.name), "rb", buffering=0) as f:
            while True:
                n = f.readinto(rbuf)
                if not n:
                    break
                n_file += n
                if h is not None:
                    h.update(rview[:n])
        total += n_file
        if verify and (n_file != spec.size or h.intdigest() != want[spec.name]):
            bad.append(
                f"{spec.name}: {n_file} bytes read, {spec.size} expected"
                if n_file != spec.size
                else f"{spec.name}: content differs"
            )
    t1 = time.monotonic()
    return {
        "t0": t0,
        "t1": t1,
        "files": len(order),
        "bytes": total,
        "mismatches": bad[:20],
        "mismatch_count": len(bad),
    }


def path_reader_rank(rank: int, barrier: Any, done: Any, out: Any, paths: list[str]) -> dict:
    """Read arbitrary files (a shared store's objects) start to end, no checking."""
    rbuf = bytearray(4 * MiB)
    total = 0
    barrier.wait(timeout=120)
    t0 = time.monotonic()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(rbuf):
                total += n
    t1 = time.monotonic()
    return {"t0": t0, "t1": t1, "files": len(paths), "bytes": total}


_BUFFERS: dict[int, bytes] = {}


BUFFERS_KEPT = 4  # a run of many checkpoints (bench.steady) uses a seed per checkpoint


def make_buffer(seed: int) -> bytes:
    """The rank's random source, made once per process (cached across phases: the restore
    after a save reads with the same seed; only the newest few are kept)."""
    if seed not in _BUFFERS:
        while len(_BUFFERS) >= BUFFERS_KEPT:
            del _BUFFERS[next(iter(_BUFFERS))]
        _BUFFERS[seed] = random.Random(seed).randbytes(BUF_SIZE)
    return _BUFFERS[seed]


FUNCS: dict[str, Callable[..., dict]] = {}


def _worker(rank: int, barrier: Any, done: Any, tasks: Any, out: Any) -> None:
    """A rank process: runs one phase per task, every phase released by the shared barrier."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when ranks stop
    while True:
        task = tasks.get()
        if task is None:
            return
        phase, name, args = task
        try:
            if name is None:  # this rank sits the phase out but still meets the barriers
                barrier.wait(timeout=120)
                if args:  # the phase uses the second barrier too
                    done.wait(timeout=600)
                t = time.monotonic()
                res = {"idle": True, "t0": t, "t1": t, "bytes": 0, "files": 0}
            else:
                res = FUNCS[name](rank, barrier, done, out, *args)
        except BaseException as e:  # noqa: BLE001 (report it; never hang the parent)
            for b in (barrier, done):
                with contextlib.suppress(Exception):
                    b.abort()  # wake the other ranks: this phase has failed
            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
            if isinstance(e, KeyboardInterrupt):
                out.put({**res, "rank": rank, "phase": phase})
                return
        out.put({**res, "rank": rank, "phase": phase})


class RankError(RuntimeError):
    pass


class RankPool:
    """`ranks` spawned processes kept for the whole run, so each phase costs a barrier, not 8
    interpreter start-ups (1.6 s on this 2-core machine)."""

    def __init__(self, ranks: int):
        ctx = mp.get_context("spawn")
        self.n = ranks
        self.barrier, self.done, self.out = ctx.Barrier(ranks), ctx.Barrier(ranks), ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(ranks)]
        self.procs = [
            ctx.Process(
                target=_worker,
                name=f"rank{r}",
                daemon=True,
                args=(r, self.barrier, self.done, self.tasks[r], self.out),
            )
            for r in range(ranks)
        ]
        self.phase = 0
        for p in self.procs:
            p.start()

    def run(
        self, name: str, per_rank_args: list[tuple], timeout: float, uses_done: bool = False
    ) -> list[dict]:
        self.phase += 1
        for r in range(self.n):
            if r < len(per_rank_args):
                self.tasks[r].put((self.phase, name, per_rank_args[r]))
            else:
                self.tasks[r].put((self.phase, None, uses_done))
        results: dict[int, dict] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankError(
                    f"{name}: {self.n - len(results)} of {self.n} ranks did not finish "
                    f"within {timeout:.0f}s"
                )
            try:
                r = self.out.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [p for p in self.procs if not p.is_alive()]
                if dead:
                    raise RankError(
                        f"{name}: rank process {dead[0].name} died (exit code {dead[0].exitcode})"
                    ) from None
                continue
            if r.get("phase") == self.phase:
                results[r["rank"]] = r
        errors = [r for r in results.values() if "error" in r]
        if errors:
            self.barrier.reset()
            self.done.reset()
            e = min(errors, key=lambda r: "BrokenBarrier" in r["error"])  # the root cause first
            raise RankError(f"{name} rank {e['rank']}: {e['error']}\n{e.get('traceback', '')}")
        return [results[r] for r in range(self.n) if not results[r].get("idle")]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for q in self.tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=3)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=3)
            if p.is_alive():
                p.kill()
                p.join(timeout=3)


_POOL: RankPool | None = None


def shutdown_pool() -> None:
    global _POOL
    if _POOL is not None:
        _POOL.close()
        _POOL = None


def run_ranks(
    fn: Callable[..., dict], per_rank_args: list[tuple], timeout: float, uses_done: bool = False
) -> dict:
    """Run fn on len(per_rank_args) ranks released by one barrier; bounded by timeout.

    Returns {"seconds": max(t1)-min(t0), "bytes": sum, "ranks": [...]}. Raises RankError if a rank
    failed or the deadline passed (then the pool is torn down and rebuilt on next use).
    """
    global _POOL
    FUNCS.setdefault(fn.__name__, fn)
    if _POOL is None or _POOL.n < len(per_rank_args) or not _POOL.alive():
        shutdown_pool()
        _POOL = RankPool(len(per_rank_args))
    try:
        results = _POOL.run(fn.__name__, per_rank_args, timeout, uses_done)
    except BaseException:
        shutdown_pool()  # ranks may be stuck in a hung mount: never reuse them
        raise
    t0 = min(r["t0"] for r in results)
    t1 = max(r["t1"] for r in results)
    return {
        "seconds": t1 - t0,
        "bytes": sum(r["bytes"] for r in results),
        "files": sum(r["files"] for r in results),
        "t0": t0,
        "t1": t1,
        "ranks": results,
    }


FUNCS.update({f.__name__: f for f in (writer_rank, reader_rank, path_reader_rank)})


def write_checkpoint(
    directory: str,
    plan: list[list[FileSpec]],
    chunk: int,
    fsync: bool,
    metadata: bool,
    buf_seed: int,
    timeout: float,
) -> dict:
    os.makedirs(directory, exist_ok=True)
    args = [(directory, plan[r], chunk, fsync, metadata, buf_seed) for r in range(len(plan))]
    res = run_ranks(writer_rank, args, timeout, uses_done=metadata)
    lat = sorted(x for r in res["ranks"] for x in r.pop("file_latency"))
    if lat:
        res["file_latency_ms"] = {
            "p50": round(1000 * lat[len(lat) // 2], 3),
            "p99": round(1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3),
            "max": round(1000 * lat[-1], 3),
        }
    if metadata:
        res["bytes"] += METADATA_SIZE
        res["files"] += 1
    return res


def read_checkpoint(
    directory: str,
    plan: list[list[FileSpec]],
    chunk: int,
    verify: bool,
    metadata: bool,
    buf_seed: int,
    timeout: float,
) -> dict:
    args = [(directory, plan[r], chunk, verify, metadata, buf_seed) for r in range(len(plan))]
    res = run_ranks(reader_rank, args, timeout)
    res["mismatch_count"] = sum(r["mismatch_count"] for r in res["ranks"])
    res["mismatches"] = [m for r in res["ranks"] for m in r["mismatches"]][:20]
    return res


def read_paths(paths_with_sizes: list[tuple[str, int]], ranks: int, timeout: float) -> dict:
    """Read files spread over `ranks` readers, biggest first to balance the bytes."""
    buckets: list[list[str]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for p, size in sorted(paths_with_sizes, key=lambda x: -x[1]):
        i = load.index(min(load))
        buckets[i].append(p)
        load[i] += size
    args = [(b,) for b in buckets if b] or [([],)]
    return run_ranks(path_reader_rank, args, timeout)
