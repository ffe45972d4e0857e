"""Real training clients' save times through ckptfs vs the same save into a plain directory on
the disk that holds NVME (the physical limit), alternating rounds in one run:

    python -m bench.clients [--gib 1] [--rounds 3] [--clients orbax,dcp,torch]

- orbax: Orbax's CheckpointManager (async) saves a JAX state of `--gib` GiB in 32 MiB arrays;
  "blocked" is the time `save()` holds the training loop, "saved" the time until
  `wait_until_finished()` returned (the save is on disk, or in ckptfs's log).
- dcp: torch.distributed.checkpoint.save of a state dict of `--gib` GiB in 32 MiB tensors, one
  process (DCP's default FileSystemWriter: one file per process plus `.metadata`, fsynced).
- torch: torch.save of the same state dict to one file, then os.fsync.

Each round saves a new step of every client into the mount and into the plain directory, in
turns (the order flips every round), and drops the page cache before each save. Each step's
weights are new (every value moved, as a training step does): a save that repeated the
last one's bytes would be stored by ckptfs as references to them. SHARED is a
local directory: the drain runs during the rounds as it does during training. Prints seconds
per save and the ratio ckptfs / plain directory (the median of the rounds); a client whose
library is missing is skipped. Needs root (drop_caches) and `/dev/fuse`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.ckptfs_target import CkptfsMount
from bench.mounts import drop_caches

CHUNK = 32 << 20  # bytes per array / tensor


def orbax_client(gib: float) -> Callable[[Path, int], dict[str, float]] | None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        import jax
        import numpy as np
        import orbax.checkpoint as ocp
    except ImportError:
        return None
    rng = np.random.default_rng(0)
    state = {f"a{i}": jax.numpy.asarray(rng.standard_normal(CHUNK // 4, dtype=np.float32))
             for i in range(max(1, int(gib * (1 << 30)) // CHUNK))}
    managers: dict[Path, Any] = {}
    last = [0]

    def save(d: Path, step: int) -> dict[str, float]:
        nonlocal state
        if step != last[0]:  # a training step: new weights (no save repeats the last one's)
            state = {k: (v + 1.0).block_until_ready() for k, v in state.items()}
            last[0] = step
        mgr = managers.get(d)
        if mgr is None:
            opts = ocp.CheckpointManagerOptions(max_to_keep=2, step_prefix="step")
            mgr = managers[d] = ocp.CheckpointManager(d / "orbax", options=opts)
        t0 = time.perf_counter()
        mgr.save(step, args=ocp.args.StandardSave(state))
        t1 = time.perf_counter()
        mgr.wait_until_finished()
        return {"blocked": t1 - t0, "saved": time.perf_counter() - t0}

    save.close = lambda: [m.close() for m in managers.values()]  # type: ignore[attr-defined]
    return save


def _torch_state(gib: float) -> Any:
    try:
        import torch
    except ImportError:
        return None
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(CHUNK // 4, generator=g)
            for i in range(max(1, int(gib * (1 << 30)) // CHUNK))}


def _train_step(state: Any, step: int, last: list[int]) -> None:
    """New weights for a new step, in place: a save never repeats the last one's bytes (which
    ckptfs would store as references to them, and so flatter itself)."""
    if step != last[0]:
        for t in state.values():
            t.add_(1.0)
        last[0] = step


def dcp_client(gib: float) -> Callable[[Path, int], dict[str, float]] | None:
    state = _torch_state(gib)
    if state is None:
        return None
    import torch.distributed.checkpoint as dcp
    last = [0]

    def save(d: Path, step: int) -> dict[str, float]:
        _train_step(state, step, last)
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=str(d / "dcp" / f"step_{step}"))
        return {"saved": time.perf_counter() - t0}

    return save


def torch_client(gib: float) -> Callable[[Path, int], dict[str, float]] | None:
    state = _torch_state(gib)
    if state is None:
        return None
    import torch
    last = [0]

    def save(d: Path, step: int) -> dict[str, float]:
        _train_step(state, step, last)
        path = d / "torch" / f"step_{step}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        return {"saved": time.perf_counter() - t0}

    return save


CLIENTS = {"orbax": orbax_client, "dcp": dcp_client, "torch": torch_client}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size per save (GiB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", default="orbax,dcp,torch",
                    help="comma-separated, of: " + ", ".join(CLIENTS))
    ap.add_argument("--workdir", type=Path, default=None,
                    help="where NVME, SHARED, the mount and the plain directory go "
                         "(default: a new directory under /tmp)")
    a = ap.parse_args()
    wanted = [c for c in a.clients.split(",") if c]
    unknown = set(wanted) - set(CLIENTS)
    if unknown:
        ap.error(f"unknown client(s): {', '.join(sorted(unknown))}")
    work = Path(tempfile.mkdtemp(prefix="ckptfs-clients-", dir=a.workdir))
    try:
        return _run(a, wanted, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(a: argparse.Namespace, wanted: list[str], work: Path) -> int:
    plain, shared = work / "plain", work / "shared"
    plain.mkdir()
    shared.mkdir()
    clients = {}
    for name in wanted:
        save = CLIENTS[name](a.gib)
        if save is None:
            print(f"{name}: its library is not installed, skipped")
        else:
            clients[name] = save
    if not clients:
        print("no client to run", file=sys.stderr)
        return 1
    times: dict[tuple[str, str, str], list[float]] = {}
    with CkptfsMount(work / "nvme", shared, work / "mnt", ["--node-id", "clients"],
                     work / "ckptfs.log") as m:
        targets = {"ckptfs": m.mountpoint, "plain": plain}
        for rnd in range(a.rounds):
            order = list(targets) if rnd % 2 == 0 else list(targets)[::-1]
            for name, save in clients.items():
                for target in order:
                    drop_caches()  # not root: the rounds still alternate
                    for k, v in save(targets[target], rnd + 1).items():
                        times.setdefault((name, k, target), []).append(v)
        for save in clients.values():
            getattr(save, "close", lambda: None)()
    print(f"\n{a.gib:g} GiB per save, {a.rounds} rounds (seconds per round; ratio of the "
          f"medians, ckptfs / plain directory)")
    print(f"{'client':<8} {'time':<8} {'ckptfs':<24} {'plain directory':<24} ratio")
    for (name, kind, target), vals in sorted(times.items()):
        if target != "ckptfs":
            continue
        base = times[(name, kind, "plain")]
        ratio = statistics.median(vals) / statistics.median(base)
        fmt = " ".join(f"{v:.2f}" for v in vals)
        fmt_base = " ".join(f"{v:.2f}" for v in base)
        print(f"{name:<8} {kind:<8} {fmt:<24} {fmt_base:<24} {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
