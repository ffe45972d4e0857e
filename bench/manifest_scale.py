"""Memory and time to build a manifest, by namespace size, against building its body whole:

    python -m bench.manifest_scale [--files 1000] [--extents 64,1000]

A manifest describes a node's whole published namespace, extent by extent (one per log
record: a 512 GiB shard written in 1 MiB requests has 512 Ki of them). ckptfs streams the body
into the zlib stream as it walks the index (ckptfs/manifest.py: build). The baseline, in the
same process on the same index, builds the JSON body as one Python object first, then
serializes and compresses it: what build did before 2026-12-05. Reading a manifest (another
node's refresh, `export`, GC once per new manifest of each node) parses it whole; its cost is
shown next to them. Peaks are Python allocations
(tracemalloc), which both spend almost all their memory on. The daemon's RSS target
(<= 300 MiB whatever the checkpoint size) needs the streamed peak to stay flat.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import tempfile
import time
import tracemalloc
import zlib
from typing import Any, Callable

from ckptfs import manifest
from ckptfs.index import ROOT_INO, Extent, Index, Inode

MIB = 1 << 20


def populate(index: Index, files: int, extents: int) -> None:
    """`files` files of `extents` 1 MiB records each, in step_1/, one segment per file."""
    now = time.time_ns()
    index.ensure_root(0, 0, 0o755, now)
    d = ROOT_INO + 1
    index.put_inode(Inode(d, stat.S_IFDIR | 0o755, 0, 0, 2, 0, 0, now, now, now))
    index._link(ROOT_INO, b"step_1", d, 1)
    rec = MIB + 64  # record header + payload
    for f in range(files):
        ino = d + 1 + f
        index.put_inode(Inode(ino, stat.S_IFREG | 0o644, 0, 0, 1, 0, extents * MIB, now, now,
                              now))
        index._link(d, f"__{f % 8}_{f}.distcp".encode(), ino, f + 1)
        for i in range(extents):
            index._put_ext(ino, Extent(i * MIB, f + 1, 4096 + i * rec, 0, MIB, MIB))
    index.commit()


def build_whole(index: Index, node: str) -> bytes:
    """The baseline: the body as one Python object, then serialized and compressed."""
    entries: list[dict[str, Any]] = []
    used: set[str] = set()
    for path, ino in manifest.walk(index, skip_foreign_of=node):
        e: dict[str, Any] = {"path": path, "mode": ino.mode & 0o7777, "uid": ino.uid,
                             "gid": ino.gid, "size": ino.size, "mtime_ns": ino.mtime_ns,
                             "type": "d" if ino.is_dir else "f"}
        if not ino.is_dir:
            ext = []
            for x in index.iter_extents(ino.ino):
                obj = manifest.obj_name(node, x.seg)
                used.add(obj)
                ext.append([x.start, x.length, obj, x.rec_pos, x.skip, x.rec_len])
            e["extents"] = ext
        entries.append(e)
    body = {"format": "ckptfs-manifest", "version": 1, "node": node, "seq": 1,
            "created_ns": 0, "cold": "", "objects": {o: {} for o in sorted(used)},
            "entries": entries}
    return zlib.compress(json.dumps(body, separators=(",", ":")).encode(), 3)


def measure(fn: Callable[[], Any]) -> tuple[float, float, int]:
    """(peak MiB of Python allocations, seconds, output bytes if bytes): timed in a run of its
    own, since tracing allocations slows Python down several times."""
    t0 = time.monotonic()
    out = fn()
    dt = time.monotonic() - t0
    tracemalloc.start()
    fn()
    _cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak / MIB, dt, len(out) if isinstance(out, bytes) else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--extents", default="64,1000",
                    help="extents per file, comma-separated sizes to compare (default 64,1000)")
    a = ap.parse_args()
    sizes = [int(x) for x in a.extents.split(",")]
    print("| extents | manifest MB | streamed: peak MiB | streamed: s | whole body: peak MiB "
          "| whole body: s | peak whole / streamed | parse: peak MiB | parse: s |\n"
          "|---|---|---|---|---|---|---|---|---|")
    rows = []
    for per_file in sizes:
        with tempfile.TemporaryDirectory(prefix="ckptfs-manifest-") as tmp:
            index = Index(os.path.join(tmp, "index"))
            try:
                populate(index, a.files, per_file)
                data = manifest.build(index, "n0", 1, {}, 0)
                sp, st, n = measure(lambda: manifest.build(index, "n0", 1, {}, 0))
                wp, wt, _ = measure(lambda: build_whole(index, "n0"))
                pp, pt, _ = measure(lambda: manifest.parse(data))
            finally:
                index.close()
        rows.append((per_file * a.files, sp, n / MIB))
        print(f"| {per_file * a.files:,} | {n / 1e6:.1f} | {sp:.1f} | {st:.2f} | {wp:.1f} | "
              f"{wt:.2f} | {wp / sp:.1f} | {pp:.1f} | {pt:.2f} |")
    for n_ext, peak, mb in rows:
        print(f"\n{n_ext:,} extents: streamed build peak {peak / (mb or 1e-9):.1f}x the manifest's "
              f"compressed size" if mb else "", end="")
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
