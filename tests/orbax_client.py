"""An Orbax (JAX) training loop's checkpointing, as a child process of a test: JAX runs
threads and asyncio loops of its own, which stay out of the pytest process this way.

    python orbax_client.py save DIR FIRST LAST [--keep N]   async saves of steps FIRST..LAST
    python orbax_client.py check DIR [--keep N]             only the checks below

Both first restore every step Orbax lists and compare it with the state `state(step)` saves,
leaf by leaf (exit 1 with the first difference), and `save` checks again after its saves.
The output is one JSON line: {"before": [...], "steps": [...]}, Orbax's all_steps() before
and after. The managers use step_prefix="step" (`step_N` directories) and remove unfinished
temporary directories of a save cut short (cleanup_tmp_directories).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no probing for accelerators

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402


def state(step: int) -> dict[str, Any]:
    """A train state for `step`: jax arrays of three dtypes, a numpy array and a scalar."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(step))
    return {"params": {"w": jax.random.normal(k1, (256, 512)),
                       "b": jax.numpy.arange(512, dtype=jax.numpy.bfloat16) * step},
            "opt": {"mu": jax.random.uniform(k2, (256, 512)),
                    "count": jax.numpy.int32(step)},
            "rng": np.arange(64, dtype=np.uint32) + step}


def manager(d: Path, keep: int) -> Any:
    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, step_prefix="step",
                                        enable_async_checkpointing=True,
                                        cleanup_tmp_directories=True)
    return ocp.CheckpointManager(d, options=opts)


def check(mgr: Any, step: int) -> str | None:
    """None if step `step` restores to exactly state(step), else the first difference."""
    got = mgr.restore(step, args=ocp.args.StandardRestore(state(0)))
    flat_got = dict(jax.tree_util.tree_flatten_with_path(got)[0])
    flat_want = dict(jax.tree_util.tree_flatten_with_path(state(step))[0])
    if flat_got.keys() != flat_want.keys():
        return f"step {step}: leaves {sorted(map(str, flat_got))}"
    for path, w in flat_want.items():
        g, w = np.asarray(flat_got[path]), np.asarray(w)
        name = jax.tree_util.keystr(path)
        if g.dtype != w.dtype or g.shape != w.shape:
            return f"step {step} {name}: {g.dtype}{g.shape} != {w.dtype}{w.shape}"
        if not np.array_equal(g, w):
            return f"step {step} {name}: values differ"
    return None


def check_all(mgr: Any) -> None:
    for step in mgr.all_steps():
        diff = check(mgr, step)
        if diff is not None:
            sys.exit(diff)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["save", "check"])
    p.add_argument("dir", type=Path)
    p.add_argument("first", type=int, nargs="?")
    p.add_argument("last", type=int, nargs="?")
    p.add_argument("--keep", type=int, default=2)
    a = p.parse_args()
    mgr = manager(a.dir, a.keep)
    before = list(mgr.all_steps())
    if a.cmd == "save":
        check_all(mgr)
        for step in range(a.first, a.last + 1):
            if not mgr.save(step, args=ocp.args.StandardSave(state(step))):
                sys.exit(f"step {step} not saved")
        mgr.wait_until_finished()
    check_all(mgr)
    print(json.dumps({"before": before, "steps": list(mgr.all_steps())}))
    mgr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
