"""Real training clients, unchanged, on a ckptfs mount.

PyTorch Distributed Checkpoint with 4 gloo ranks (save and async_save; load back, load again
after the local copies are evicted so reads come from SHARED, load from a second node),
torch.save / torch.load (also mmap), a training loop resuming from `latest` after the daemon
was SIGKILLed mid-save, safetensors, numpy, and the Hugging Face and DeepSpeed
checkpoint layouts reproduced with torch alone (the frameworks themselves are not needed to
produce their file patterns). Every load is compared tensor by tensor, exactly.

The ranks are real processes: this file run as a script (`python test_clients.py rank R N
INIT`) is one rank of a pool that imports torch once and then executes commands the test
sends on its stdin, so a test pays for collectives, not for four torch imports.
"""

from __future__ import annotations

import json
import os
import queue
import random
import subprocess
import sys
import threading
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mounting import STOP_TIMEOUT, MakeMount, Mount
from test_shared_support import cli, control, drop_caches, start_node, status, wait_published

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

WORLD = 4
SEED = 1234
COMMAND_TIMEOUT = 120.0
REPLY = "@@ckptfs-rank@@ "  # marks the pool's reply lines among anything else on stdout


# -- the training state every process can recompute bit for bit ----------------------------


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(2048, 128)  # 1 MiB: files of several FUSE writes
        self.fc1 = torch.nn.Linear(128, 256)
        self.norm = torch.nn.LayerNorm(256)
        self.fc2 = torch.nn.Linear(256, 128)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, idx: Any) -> Any:
        self.calls += 1
        return self.fc2(torch.relu(self.norm(self.fc1(self.embed(idx)))))


def build(steps: int, seed: int = SEED) -> tuple[Any, Any, Any]:
    """(model, AdamW, scheduler) after `steps` training steps: identical in every process
    (one thread, so no reduction order differs)."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        idx = torch.randint(0, 2048, (64,), generator=g)
        loss = model(idx).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return model, opt, sched


def sharded_full(world: int = WORLD) -> Any:
    """The tensor the ranks hold as a row-sharded DTensor (each rank writes its own rows)."""
    g = torch.Generator().manual_seed(SEED + 7)
    return torch.randn(world * 256, 256, generator=g)


def assert_same(got: Any, want: Any, where: str = "state") -> int:
    """Exact equality of nested dicts/lists/tensors; returns how many tensors it compared."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}, not a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, (
            f"{where}: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}")
        assert torch.equal(got, want), f"{where}: tensor values differ"
        return 1
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: {type(got).__name__}, not a dict"
        assert set(got) == set(want), f"{where}: keys {sorted(map(str, got))} != " \
                                      f"{sorted(map(str, want))}"
        return sum(assert_same(got[k], want[k], f"{where}.{k}") for k in want)
    if isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        return sum(assert_same(a, b, f"{where}[{i}]")
                   for i, (a, b) in enumerate(zip(got, want, strict=True)))
    assert got == want, f"{where}: {got!r} != {want!r}"
    return 0


# -- the rank side (runs in the pool's processes) -------------------------------------------


def _dcp_state(steps: int, seed: int, mesh: Any) -> tuple[dict, Any, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import Shard, distribute_tensor

    model, opt, _sched = build(steps, seed)
    msd, osd = get_state_dict(model, opt)
    full = sharded_full() if seed == SEED else torch.zeros(WORLD * 256, 256)
    state = {"model": msd, "optim": osd, "sharded": distribute_tensor(full, mesh, [Shard(0)]),
             "extra": {"step": steps, "tokens": torch.tensor(steps * 64)}}
    return state, model, opt


def rank_dcp_save(mesh: Any, root: str) -> dict:
    """step_2 with dcp.save; step_4 with dcp.async_save while 'training' goes on."""
    import torch.distributed.checkpoint as dcp

    state, _, _ = _dcp_state(2, SEED, mesh)
    dcp.save(state, checkpoint_id=os.path.join(root, "step_2"))
    state, _, _ = _dcp_state(4, SEED, mesh)
    fut = dcp.async_save(state, checkpoint_id=os.path.join(root, "step_4"))
    fut = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse or a plain Future
    fut.result(timeout=COMMAND_TIMEOUT)
    return {}


def rank_dcp_load(mesh: Any, root: str) -> dict:
    """Load both checkpoints into freshly built (differently seeded) state and compare."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    compared = 0
    for steps in (2, 4):
        state, model, opt = _dcp_state(0, SEED + 99, mesh)  # the destination: wrong values
        dcp.load(state, checkpoint_id=os.path.join(root, f"step_{steps}"))
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        want, _, _ = _dcp_state(steps, SEED, mesh)
        got_msd, got_osd = get_state_dict(model, opt)
        compared += assert_same(got_msd, want["model"], f"step_{steps}.model")
        compared += assert_same(got_osd, want["optim"], f"step_{steps}.optim")
        compared += assert_same(state["sharded"].to_local(), want["sharded"].to_local(),
                                f"step_{steps}.sharded")
        compared += assert_same(state["extra"], want["extra"], f"step_{steps}.extra")
    return {"tensors": compared}


def _flat(tensors: list) -> Any:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def _partition(flat: Any, rank: int, world: int) -> Any:
    """ZeRO's partitioning: the flat group padded to a multiple of world, equal slices."""
    per = -(-flat.numel() // world)
    padded = torch.cat([flat, flat.new_zeros(per * world - flat.numel())])
    return padded[rank * per:(rank + 1) * per].clone()


def ds_expected(steps: int) -> tuple[dict, Any, Any, Any]:
    """What a DeepSpeed ZeRO-2 run holds after `steps`: model state, the fp32 flat group and
    Adam's moments, flattened in parameter order."""
    model, opt, sched = build(steps)
    params = list(model.parameters())
    exp_avg = _flat([opt.state[p]["exp_avg"] for p in params])
    exp_avg_sq = _flat([opt.state[p]["exp_avg_sq"] for p in params])
    model_states = {
        "module": model.state_dict(),
        "buffer_names": [n for n, _ in model.named_buffers()],
        "optimizer": None,
        "param_shapes": [OrderedDict((n, p.shape) for n, p in model.named_parameters())],
        "lr_scheduler": sched.state_dict(),
        "global_steps": steps,
        "global_samples": steps * 64,
        "dp_world_size": WORLD,
        "mp_world_size": 1,
        "ds_version": "0.14.0",
    }
    return model_states, _flat(params), exp_avg, exp_avg_sq


def rank_ds_save(mesh: Any, root: str, steps: int) -> dict:
    """DeepSpeed's layout: every rank its optimizer partition, rank 0 the model states, and
    `latest` only once every rank is done (after a barrier, as DeepSpeed does)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model_states, fp32, exp_avg, exp_avg_sq = ds_expected(steps)
    tag = f"global_step{steps}"
    ckpt = os.path.join(root, tag)
    os.makedirs(ckpt, exist_ok=True)
    optim = {
        "optimizer_state_dict": {
            "zero_stage": 2,
            "loss_scaler": None,
            "partition_count": WORLD,
            "base_optimizer_state": {
                "state": {0: {"step": torch.tensor(float(steps)),
                              "exp_avg": _partition(exp_avg, rank, WORLD),
                              "exp_avg_sq": _partition(exp_avg_sq, rank, WORLD)}},
                "param_groups": [{"lr": 1e-2, "params": [0]}],
            },
            "single_partition_of_fp32_groups": [_partition(fp32, rank, WORLD)],
        },
        "ds_config": {"zero_optimization": {"stage": 2}},
        "ds_version": "0.14.0",
    }
    torch.save(optim, os.path.join(ckpt, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
    if rank == 0:
        torch.save(model_states, os.path.join(ckpt, "mp_rank_00_model_states.pt"))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(root, "latest"), "w") as f:
            f.write(tag)
    dist.barrier()
    return {}


RANK_COMMANDS: dict[str, Callable[..., dict]] = {
    "dcp_save": rank_dcp_save, "dcp_load": rank_dcp_load, "ds_save": rank_ds_save}


def rank_main(rank: int, world: int, init_file: str) -> int:
    import torch.distributed as dist
    from torch.distributed.tensor import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    print(REPLY + json.dumps({"ok": True, "ready": rank}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        try:
            reply = {"ok": True, **RANK_COMMANDS[cmd["op"]](mesh, **cmd["args"])}
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # noqa: BLE001 (DCP's CheckpointException is a BaseException)
            reply = {"ok": False, "error": traceback.format_exc()}
        print(REPLY + json.dumps(reply), flush=True)
    dist.destroy_process_group()
    return 0


# -- the test side: a pool of ranks ---------------------------------------------------------


class RankPool:
    """WORLD processes in one gloo group (file:// rendezvous, loopback only), each running
    `rank_main`; `run(op, **args)` has every rank execute op and returns their replies."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.log = workdir / "ranks.log"
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                   PYTHONWARNINGS="ignore")
        self.procs: list[subprocess.Popen[str]] = []
        self.replies: list[queue.Queue[dict]] = []
        self.readers: list[threading.Thread] = []
        self.broken = False
        with open(self.log, "w") as log:
            for r in range(WORLD):
                p = subprocess.Popen([sys.executable, __file__, "rank", str(r), str(WORLD),
                                      str(workdir / "rendezvous")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                     text=True, env=env, cwd=workdir)
                q: queue.Queue[dict] = queue.Queue()
                t = threading.Thread(target=self._read, args=(p, q), daemon=True)
                t.start()
                self.readers.append(t)
                self.procs.append(p)
                self.replies.append(q)
        self._collect("start")

    @staticmethod
    def _read(p: subprocess.Popen[str], q: queue.Queue[dict]) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            if line.startswith(REPLY):
                q.put(json.loads(line[len(REPLY):]))
        q.put({"ok": False, "error": f"rank process exited ({p.wait()})"})

    def _collect(self, what: str) -> list[dict]:
        out = []
        for r, q in enumerate(self.replies):
            try:
                reply = q.get(timeout=COMMAND_TIMEOUT)
            except queue.Empty:
                reply = {"ok": False, "error": f"no reply within {COMMAND_TIMEOUT:.0f}s"}
            if not reply["ok"]:
                self.broken = True
                self.close()
                pytest.fail(f"rank {r} failed in {what}:\n{reply['error']}\n"
                            f"--- ranks' stderr ---\n{self.log_tail()}", pytrace=False)
            out.append(reply)
        return out

    def run(self, op: str, **args: Any) -> list[dict]:
        assert not self.broken, "the rank pool broke in an earlier test"
        line = json.dumps({"op": op, "args": args}) + "\n"
        for r, p in enumerate(self.procs):
            assert p.stdin is not None
            try:
                p.stdin.write(line)
                p.stdin.flush()
            except OSError as e:  # the rank is gone
                self.broken = True
                self.close()
                pytest.fail(f"cannot send {op} to rank {r}: {e}\n--- ranks' stderr ---\n"
                            f"{self.log_tail()}", pytrace=False)
        return self._collect(op)

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        """Ask every rank to exit; kill whatever does not (they may be stuck in a collective
        with a rank that failed). Must run before the mounts they write to are torn down."""
        for p in self.procs:
            try:
                if p.poll() is None and p.stdin is not None:
                    p.stdin.write(json.dumps({"op": "exit"}) + "\n")
                    p.stdin.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(0 if self.broken else 20)
            except subprocess.TimeoutExpired:
                pass
            if p.poll() is None:
                p.kill()
                p.wait(STOP_TIMEOUT)
        for p, t in zip(self.procs, self.readers, strict=True):
            t.join(STOP_TIMEOUT)  # it ends at EOF, which the exit above brought
            if p.stdout is not None:
                p.stdout.close()


class _PoolHolder:
    """One pool for the whole module (four torch imports cost ~10 s on 2 cores); a test that
    broke it gets the next test a fresh one."""

    def __init__(self, base: Path):
        self.base = base
        self.pool: RankPool | None = None
        self.started = 0

    def get(self) -> RankPool:
        if self.pool is None or self.pool.broken:
            if self.pool is not None:
                self.pool.close()
            self.started += 1
            d = self.base / f"pool-{self.started}"
            d.mkdir()
            self.pool = RankPool(d)
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


@pytest.fixture(scope="module")
def _rank_pools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_PoolHolder]:
    holder = _PoolHolder(tmp_path_factory.mktemp("ranks"))
    try:
        yield holder
    finally:
        holder.close()


@pytest.fixture
def ranks(_rank_pools: _PoolHolder) -> RankPool:
    """The ranks hold no file open between commands, so the pool may outlive each test's
    mounts; a command that fails or hangs kills the pool before the mounts are torn down."""
    return _rank_pools.get()


def distcp_files(step_dir: Path) -> list[str]:
    return sorted(p.name for p in step_dir.iterdir())


# -- PyTorch Distributed Checkpoint ----------------------------------------------------------


def test_dcp_four_ranks_save_async_save_load_evicted_and_from_second_node(
        make_mount: MakeMount, ranks: RankPool) -> None:
    a = start_node(make_mount, "a", "n1", segment_size="1M")  # several segments per checkpoint
    ranks.run("dcp_save", root=str(a.mnt))
    for step in ("step_2", "step_4"):
        names = distcp_files(a.mnt / step)
        assert ".metadata" in names and all(f"__{r}_0.distcp" in names for r in range(WORLD)), \
            f"{step}: every rank should have written its shard file: {names}"

    # 1. straight back, from the local log
    (reply, *_) = ranks.run("dcp_load", root=str(a.mnt))
    assert reply["tensors"] > 20

    # 2. durable, then local copies evicted and the page cache dropped: reads go to SHARED
    for step in ("step_2", "step_4"):
        wait_published(a.mnt / step)
    evicted = control(a, {"op": "evict", "all": True})["evicted"]
    assert evicted, "nothing was evicted"
    try:
        drop_caches()
    except OSError as e:
        pytest.skip(f"cannot drop the page cache here ({e}): reads would not reach SHARED")
    before = status(a)
    assert before["segments"].get("evicted"), before["segments"]
    ranks.run("dcp_load", root=str(a.mnt))
    after = status(a)
    assert after["shared_bytes_read"] > before["shared_bytes_read"], \
        "the load after eviction did not read from SHARED"
    assert after["corrupt_reads"] == 0

    # 3. another node (its own NVME) on the same SHARED, once it has read the manifests
    b = start_node(make_mount, "b", "n2", shared=a.shared)
    cli("status", b.mnt, "--refresh")
    ranks.run("dcp_load", root=str(b.mnt))
    assert status(b)["shared_bytes_read"] > 0


# -- single-process clients -----------------------------------------------------------------


def mixed_objects() -> dict[str, Any]:
    model, opt, sched = build(3)
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "bf16": torch.randn(33, 7, generator=torch.Generator().manual_seed(5)).bfloat16(),
        "int8": torch.arange(-128, 128, dtype=torch.int8),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "transposed": base.t(),  # non-contiguous
        "row": base[1],  # a view sharing storage with `base`
        "base": base,
        "meta": {"epoch": 3, "name": "ckpt", "lrs": [0.1, 0.01]},
    }


@pytest.mark.parametrize("legacy", [False, True], ids=["zipfile", "legacy-format"])
def test_torch_save_load_and_mmap(mount: Mount, legacy: bool) -> None:
    obj = mixed_objects()
    path = mount.mnt / "obj.pt"
    torch.save(obj, path, _use_new_zipfile_serialization=not legacy)
    assert_same(torch.load(path, weights_only=True), obj)
    if not legacy:  # mmap needs the zipfile format
        loaded = torch.load(path, mmap=True, weights_only=True)
        assert_same(loaded, obj)
        loaded_row = loaded["row"]
        assert loaded_row.untyped_storage().data_ptr() == \
            loaded["base"].untyped_storage().data_ptr(), "views no longer share storage"
    with open(path, "rb") as f:  # from an open file object, as many loaders do
        assert_same(torch.load(f, weights_only=True), obj)


def test_safetensors_save_load(mount: Mount) -> None:
    pytest.importorskip("safetensors")
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model, _opt, _sched = build(2)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors["bf16"] = torch.randn(100, 3, generator=torch.Generator().manual_seed(9)).bfloat16()
    path = mount.mnt / "model.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    assert_same(load_file(path), tensors)  # mmaps the file
    with safe_open(path, framework="pt") as f:  # lazy, slice by slice
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(tensors)
        assert_same(f.get_slice("embed.weight")[100:300], tensors["embed.weight"][100:300])


# A training loop that checkpoints every step the way most do: torch.save to a temporary
# name, rename, then point `latest` at it (tmp + replace). No fsync anywhere. It prints each
# step once all of that returned.
TRAINER = r"""
import os, sys, torch
root, step = sys.argv[1], int(sys.argv[2])

def state(step):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(512, 1024, generator=g), "step": torch.tensor(step)}

while True:
    d = os.path.join(root, f"step_{step}")
    os.makedirs(d, exist_ok=True)
    torch.save(state(step), os.path.join(d, "model.pt.tmp"))
    os.rename(os.path.join(d, "model.pt.tmp"), os.path.join(d, "model.pt"))
    with open(os.path.join(root, "latest.tmp"), "w") as f:
        f.write(str(step))
    os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    print(step, flush=True)
    step += 1
"""


def trainer_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(512, 1024, generator=g), "step": torch.tensor(step)}


def test_training_resumes_from_latest_after_the_daemon_is_killed_mid_save(
        make_mount: MakeMount, tmp_path: Path) -> None:
    """The daemon is SIGKILLed while a real torch training loop checkpoints (2 MiB per step,
    no fsync). After the remount, `latest` names at least the last step the loop reported
    (every operation that returned survives), and every `model.pt` there loads to exactly
    the state of its step: the rename made it whole or not at all. Training resumes from
    `latest`, three times over."""
    m = make_mount(segment_size="4M")
    rnd = random.Random(7)
    start, done = 1, 0
    for r in range(3):
        err = tmp_path / f"trainer-{r}.err"
        with open(err, "w") as errf, subprocess.Popen(
                [sys.executable, "-c", TRAINER, str(m.mnt), str(start)],
                stdout=subprocess.PIPE, stderr=errf, text=True) as proc:
            try:
                want = start + rnd.randint(1, 4)
                reported = start - 1
                assert proc.stdout is not None
                for line in proc.stdout:
                    reported = int(line)
                    if reported >= want:
                        break
                assert reported >= want, f"trainer stopped early: {err.read_text()[-2000:]}"
                m.kill()  # mid-save, as the trainer keeps going
                proc.wait(timeout=60)
            finally:
                if proc.poll() is None:
                    proc.kill()
        m.clean_stale()
        m.start()
        latest = int((m.mnt / "latest").read_text())
        assert latest >= reported, f"latest says {latest}, the trainer had reported {reported}"
        for step in range(1, latest + 2):
            path = m.mnt / f"step_{step}" / "model.pt"
            if step <= latest:
                assert path.exists(), f"step_{step}/model.pt was renamed into place, then lost"
            if path.exists():
                got = torch.load(path, weights_only=True)
                want_state = trainer_state(step)
                assert torch.equal(got["w"], want_state["w"]) and int(got["step"]) == step, \
                    f"step_{step}/model.pt loads to other data"
        done += latest - start + 1
        start = latest + 1  # resume
    assert done >= 6


def test_numpy_save_load(mount: Mount) -> None:
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(3)
    arrays = {"f32": rng.standard_normal((300, 257), dtype=np.float32),
              "i64": rng.integers(-10**12, 10**12, size=5000),
              "c128": rng.standard_normal(77) + 1j * rng.standard_normal(77)}
    for name, arr in arrays.items():
        np.save(mount.mnt / f"{name}.npy", arr)
        assert np.array_equal(np.load(mount.mnt / f"{name}.npy"), arr)
        mapped = np.load(mount.mnt / f"{name}.npy", mmap_mode="r")
        assert np.array_equal(mapped, arr)
        del mapped
    np.savez(mount.mnt / "all.npz", **arrays)
    with np.load(mount.mnt / "all.npz") as z:
        assert set(z.files) == set(arrays)
        for name, arr in arrays.items():
            assert np.array_equal(z[name], arr)


# -- Hugging Face Trainer layout --------------------------------------------------------------


def hf_rng_state() -> dict[str, Any]:
    import numpy as np

    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "cpu": torch.random.get_rng_state()}


def hf_check(ckpt: Path, model: Any, opt: Any, sched: Any, rng: dict, state: dict) -> None:
    from safetensors.torch import load_file

    assert sorted(p.name for p in ckpt.iterdir()) == [
        "model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt",
        "trainer_state.json"]
    weights = load_file(ckpt / "model.safetensors")
    assert_same(weights, model.state_dict())
    assert_same(torch.load(ckpt / "optimizer.pt", weights_only=True), opt.state_dict())
    assert_same(torch.load(ckpt / "scheduler.pt", weights_only=True), sched.state_dict())
    # our own file, holding numpy's RNG state: trusted, so the full unpickler
    got_rng = torch.load(ckpt / "rng_state.pth", weights_only=False)
    assert got_rng["python"] == rng["python"]
    assert got_rng["numpy"][0] == rng["numpy"][0]
    assert (got_rng["numpy"][1] == rng["numpy"][1]).all()
    assert got_rng["numpy"][2:] == rng["numpy"][2:]
    assert_same(got_rng["cpu"], rng["cpu"])
    assert json.loads((ckpt / "trainer_state.json").read_text()) == state
    # and resuming works: a fresh model/optimizer/scheduler takes the state
    fresh_model, fresh_opt, fresh_sched = build(0, seed=SEED + 5)
    fresh_model.load_state_dict(weights)
    fresh_opt.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
    fresh_sched.load_state_dict(torch.load(ckpt / "scheduler.pt", weights_only=True))
    assert_same(fresh_model.state_dict(), model.state_dict())
    assert_same(fresh_opt.state_dict(), opt.state_dict())
    assert_same(fresh_sched.state_dict(), sched.state_dict())


def test_hugging_face_checkpoint_layout(make_mount: MakeMount) -> None:
    pytest.importorskip("safetensors")
    pytest.importorskip("numpy")
    from safetensors.torch import save_file

    m = make_mount()
    model, opt, sched = build(6)
    rng = hf_rng_state()
    state = {"global_step": 6, "epoch": 0.5, "log_history": [{"loss": 1.25, "step": 6}],
             "best_model_checkpoint": None}
    tmp = m.mnt / "tmp-checkpoint-6"
    tmp.mkdir()
    save_file(model.state_dict(), tmp / "model.safetensors", metadata={"format": "pt"})
    torch.save(opt.state_dict(), tmp / "optimizer.pt")
    torch.save(sched.state_dict(), tmp / "scheduler.pt")
    torch.save(rng, tmp / "rng_state.pth")
    final = m.mnt / "checkpoint-6"
    os.rename(tmp, final)
    fd = os.open(final, os.O_RDONLY)  # the Trainer fsyncs the renamed directory
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    (final / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    assert not tmp.exists()
    hf_check(final, model, opt, sched, rng, state)
    m.remount()
    hf_check(final, model, opt, sched, rng, state)


# -- DeepSpeed layout -------------------------------------------------------------------------


def ds_check(root: Path, steps: int) -> None:
    """Load a DeepSpeed-layout checkpoint the way its tools do (zero_to_fp32: `latest`, the
    model states, every rank's partition) and compare with what training held."""
    tag = (root / "latest").read_text()
    assert tag == f"global_step{steps}"
    ckpt = root / tag
    want_states, want_fp32, want_avg, want_avg_sq = ds_expected(steps)
    assert_same(torch.load(ckpt / "mp_rank_00_model_states.pt", weights_only=True),
                want_states, "model_states")
    parts = [torch.load(ckpt / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
                        weights_only=True)["optimizer_state_dict"] for r in range(WORLD)]
    n = want_fp32.numel()
    fp32 = torch.cat([p["single_partition_of_fp32_groups"][0] for p in parts])[:n]
    avg = torch.cat([p["base_optimizer_state"]["state"][0]["exp_avg"] for p in parts])[:n]
    avg_sq = torch.cat([p["base_optimizer_state"]["state"][0]["exp_avg_sq"] for p in parts])[:n]
    assert_same(fp32, want_fp32, "fp32 flat group")
    assert_same(avg, want_avg, "exp_avg")
    assert_same(avg_sq, want_avg_sq, "exp_avg_sq")


def test_deepspeed_checkpoint_layout_and_export(make_mount: MakeMount, ranks: RankPool,
                                                 tmp_path: Path) -> None:
    m = start_node(make_mount, "m", "n1")
    ranks.run("ds_save", root=str(m.mnt), steps=5)
    assert sorted(p.name for p in (m.mnt / "global_step5").iterdir()) == \
        ["mp_rank_00_model_states.pt"] + [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                                          for r in range(WORLD)]
    ds_check(m.mnt, 5)

    # durable, then out of SHARED as plain files with no mount involved
    wait_published(m.mnt / "global_step5")
    wait_published(m.mnt / "latest")
    out = tmp_path / "exported"
    cli("export", m.shared, "global_step5", out / "global_step5")
    cli("export", m.shared, "latest", out)
    ds_check(out, 5)


# -- script mode: one rank of the pool ------------------------------------------------------

if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "rank":
        sys.exit(rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
    sys.exit(f"usage: {sys.argv[0]} rank RANK WORLD RENDEZVOUS_FILE")
