"""Sizing, after the seed article's three steps, and what ckptfs turns the numbers into.

1. Read checkpoint size, interval and the allowed save time off the training setup.
2. Required bandwidth = size / save budget; peak metadata ops ~ ranks x files per rank x
   (create + write/close + fsync) inside the budget; peaks run 2-3x the mean for bandwidth.
3. Compare with what the storage does (`ckptfs probe DIR` measures it).

With ckptfs the training-visible part lands on local NVMe (that is where the bandwidth and
the metadata ops must be met), and the shared store sees a few big objects per checkpoint,
spread over the whole interval instead of the save budget.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from ckptfs.shared import PUBLISH_BATCH

UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
         "ki": 1024, "mi": 1024 ** 2, "gi": 1024 ** 3, "ti": 1024 ** 4}


def parse_bytes(text: str) -> float:
    m = re.match(r"^\s*([\d.]+)\s*([kmgtKMGT]?i?)[bB]?(/s)?\s*$", text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 50GB, 2GiB, 700MB/s)")
    return float(m.group(1)) * UNITS[m.group(2).lower()]


def parse_seconds(text: str) -> float:
    m = re.match(r"^\s*([\d.]+)\s*(ms|s|m|min|h)?\s*$", text)
    if not m:
        raise ValueError(f"not a duration: {text!r} (examples: 30s, 10m, 1h)")
    return float(m.group(1)) * {"ms": 1e-3, "s": 1, None: 1, "m": 60, "min": 60,
                                "h": 3600}[m.group(2)]


@dataclass
class Plan:
    checkpoint_bytes: float
    interval_s: float
    budget_s: float
    ranks: int
    files_per_rank: int
    nodes: int
    # step 2: what the save needs, wherever it lands
    required_bandwidth: float
    peak_bandwidth: float
    files: int
    metadata_ops: int
    metadata_ops_per_s: float
    # what direct writes to the NAS would cost
    nas_metadata_seconds: float | None
    nas_data_seconds: float | None
    # with ckptfs
    nvme_bandwidth_per_node: float
    segments: int
    shared_ops: int
    shared_bandwidth: float
    local_capacity_per_node: float
    shared_capacity: float
    verdict: str


def publish_ops(k: int) -> int:
    """Metadata operations on SHARED to publish k segments at once: create and fsync each,
    then a rename and a directory fsync (a batch directory adds its mkdir and its own fsync)."""
    return 0 if k == 0 else 2 * k + (2 if k == 1 else 4)


def make_plan(size: float, interval: float, budget: float, ranks: int, files_per_rank: int,
              nodes: int = 1, segment_size: float = 256 * 2 ** 20, keep_local: int = 2,
              keep_shared: int = 5, nas_creates_per_s: float | None = None,
              nas_bandwidth: float | None = None,
              publish_batch: int = PUBLISH_BATCH) -> Plan:
    if min(size, interval, budget) <= 0 or ranks < 1 or files_per_rank < 1 or nodes < 1 \
            or publish_batch < 1:
        raise ValueError("sizes, times and counts must be positive")
    if segment_size < 2 ** 20:
        raise ValueError("--segment-size must be at least 1MiB (as at mount)")
    if keep_local < 0 or keep_shared < 0:
        raise ValueError("--keep-local and --keep-shared must not be negative")
    if (nas_creates_per_s is not None and nas_creates_per_s <= 0) or \
            (nas_bandwidth is not None and nas_bandwidth <= 0):
        raise ValueError("--nas-creates and --nas-bandwidth must be positive")
    if budget > interval:
        raise ValueError("the save budget cannot exceed the checkpoint interval")
    files = ranks * files_per_rank + 1  # + the commit marker
    ops = files * 3  # create, close/write, fsync: each a round trip on a NAS
    bw = size / budget
    per_node = math.ceil(size / nodes / segment_size)
    segments = nodes * per_node
    # a node's segments leave in batches of up to publish_batch, then its manifest (create,
    # fsync, rename, directory fsync)
    full, rest = divmod(per_node, publish_batch)
    shared_ops = nodes * (full * publish_ops(publish_batch) + publish_ops(rest) + 4)
    shared_bw = size / (interval - budget) if interval > budget else float("inf")
    nas_meta = ops / nas_creates_per_s if nas_creates_per_s else None
    nas_data = size / nas_bandwidth if nas_bandwidth else None
    verdict = []
    if nas_meta is not None and nas_data is not None:
        direct = max(nas_meta, nas_data)
        verdict.append(f"straight to the NAS a save takes about {direct:.0f}s "
                       f"(budget {budget:.0f}s): "
                       + ("metadata-bound" if nas_meta > nas_data else "bandwidth-bound"))
    if nas_bandwidth is not None and shared_bw > nas_bandwidth:
        verdict.append("the shared store cannot absorb one checkpoint per interval: "
                       "lengthen the interval or use incremental checkpoints")
    verdict.append(f"with ckptfs each node needs {bw / nodes / 1e9:.2f} GB/s of local NVMe "
                   f"write bandwidth and room for {keep_local + 1} checkpoints; the shared "
                   f"store sees ~{shared_ops} metadata operations per checkpoint instead of "
                   f"{ops}")
    return Plan(size, interval, budget, ranks, files_per_rank, nodes, bw, bw * 2.5, files, ops,
                ops / budget, nas_meta, nas_data, bw / nodes, segments, shared_ops, shared_bw,
                size / nodes * (keep_local + 1) * 1.2, size * keep_shared, "; ".join(verdict))


def as_dict(p: Plan) -> dict:
    return asdict(p)
