"""Real training frameworks, unchanged, on a ckptfs mount: the Hugging Face `transformers`
Trainer, PyTorch Lightning and DeepSpeed (its ranks in child processes: script mode, at the
end), each training a tiny model defined here (no downloads), and Orbax's CheckpointManager
saving a JAX train state (in child processes: orbax_client.py).

Each scenario is run twice in this process: once on a plain local directory (the reference)
and once on ckptfs, then compared exactly: which checkpoints exist after the framework's
rotation deleted the old ones, which one a resume picks, the step it continues from, and
every tensor it saved. Between save and resume the checkpoint crosses to a second node (its
own empty NVME, same SHARED), goes out through `ckptfs export`, or survives a SIGKILL of
the daemon.

Needs `transformers` (with `accelerate`), `pytorch_lightning`, `deepspeed`, and `jax` with
`orbax-checkpoint` (the `torch` and `jax` extras); each test skips when its framework is
missing.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mounting import MakeMount, wait_for
from test_shared_support import cli, node_args, start_node, status, wait_published

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.torch,
    # the frameworks' own warnings about their use of torch, not about this test
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"
                               ":FutureWarning"),
    # Lightning's advice, expected here: resuming into the directory holding the checkpoint,
    # a DataLoader without worker processes
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
]

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the hub
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def assert_same(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    """Two flat {name: tensor} maps hold exactly the same tensors."""
    assert set(got) == set(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, \
            f"{where}.{k}: {g.dtype}{tuple(g.shape)} != {w.dtype}{tuple(w.shape)}"
        assert torch.equal(g, w), f"{where}.{k}: tensor values differ"


def flat_tensors(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Every tensor in a nested dict/list, keyed by its path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat_tensors(v, f"{prefix}.{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flat_tensors(v, f"{prefix}[{i}]"))
    return out


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def release_mappings() -> None:
    """safetensors and torch.load(mmap) map checkpoint files: drop the last references before
    the fixture unmounts, or the unmount would be busy."""
    gc.collect()


# -- Hugging Face transformers Trainer ----------------------------------------------------------

HF_SAVE_STEPS = 2


def hf_train(output_dir: Path, max_steps: int, resume: bool = False) -> Any:
    """Train a 2-layer GPT-2 (vocab 128) on random tokens, checkpointing every
    HF_SAVE_STEPS steps and keeping 2 checkpoints. Returns the Trainer's state."""
    pytest.importorskip("accelerate")  # the Trainer needs it
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()

    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(0)
            self.x = torch.randint(0, 128, (64, 16), generator=g)

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": self.x[i], "labels": self.x[i]}

    transformers.set_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=max_steps, save_steps=HF_SAVE_STEPS,
        save_total_limit=2, per_device_train_batch_size=4, logging_steps=1, report_to=[],
        use_cpu=True, dataloader_num_workers=0, seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=True if resume else None)
    state = trainer.state
    del trainer, model
    release_mappings()
    return state


def hf_weights(ckpt: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return {k: v.clone() for k, v in load_file(ckpt / "model.safetensors").items()}


def hf_optimizer(ckpt: Path) -> dict[str, Any]:
    return flat_tensors(torch.load(ckpt / "optimizer.pt", weights_only=True))


def hf_check_same(got: Path, want: Path) -> None:
    """A checkpoint-N dir holds the same files, weights, optimizer state and trainer state as
    the reference run's."""
    assert names(got) == names(want), f"{got.name}: {names(got)} != reference {names(want)}"
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth",
            "trainer_state.json"} <= set(names(got)), names(got)
    assert_same(hf_weights(got), hf_weights(want), f"{got.name}/model.safetensors")
    assert_same(hf_optimizer(got), hf_optimizer(want), f"{got.name}/optimizer.pt")
    got_state = json.loads((got / "trainer_state.json").read_text())
    want_state = json.loads((want / "trainer_state.json").read_text())
    assert got_state["global_step"] == want_state["global_step"]
    assert [h["step"] for h in got_state["log_history"]] == \
        [h["step"] for h in want_state["log_history"]]
    release_mappings()


def hf_checkpoints(d: Path) -> list[str]:
    return sorted((n for n in names(d) if n.startswith("checkpoint-")),
                  key=lambda n: int(n.split("-")[1]))


def test_hf_trainer_rotation_resume_on_second_node_and_export(make_mount: MakeMount,
                                                              tmp_path: Path) -> None:
    """Trainer with output_dir the mount itself: 6 steps on node a, a checkpoint every 2,
    save_total_limit=2 (checkpoint-2 is deleted). After `ckptfs wait`, node b (empty NVME,
    same SHARED) sees the same last checkpoint, resumes from it to step 10 (rotation now
    deletes node a's checkpoints), and the result equals the same save/resume sequence on a
    local directory, tensor for tensor. `ckptfs ls` counts the checkpoints complete (their
    trainer_state.json marker), and `ckptfs export` gives directories `from_pretrained`
    loads."""
    transformers = pytest.importorskip("transformers")
    from transformers.trainer_utils import get_last_checkpoint

    ref = tmp_path / "ref"
    assert hf_train(ref, 6).global_step == 6
    assert hf_checkpoints(ref) == ["checkpoint-4", "checkpoint-6"]
    assert hf_train(ref, 10, resume=True).global_step == 10
    assert hf_checkpoints(ref) == ["checkpoint-8", "checkpoint-10"]

    a = start_node(make_mount, "a", "n0")
    state = hf_train(a.mnt, 6)
    assert state.global_step == 6
    assert names(a.mnt) == ["checkpoint-4", "checkpoint-6"], \
        "rotation did not delete checkpoint-2 (or something else is there)"
    assert not (a.mnt / "checkpoint-2").exists()
    wait_published(a.mnt)

    b = start_node(make_mount, "b", "n1", shared=a.shared)
    cli("status", b.mnt, "--refresh")
    assert hf_checkpoints(b.mnt) == ["checkpoint-4", "checkpoint-6"]
    last_a, last_b = get_last_checkpoint(str(a.mnt)), get_last_checkpoint(str(b.mnt))
    assert last_a is not None and last_b is not None
    assert Path(last_a).name == Path(last_b).name == "checkpoint-6"
    for f in names(a.mnt / "checkpoint-6"):
        assert (b.mnt / "checkpoint-6" / f).read_bytes() == \
            (a.mnt / "checkpoint-6" / f).read_bytes(), f"node b reads other bytes for {f}"

    # resume on node b: it continues at step 7 and ends where the reference ended
    state = hf_train(b.mnt, 10, resume=True)
    assert state.global_step == 10
    steps = [h["step"] for h in state.log_history if "loss" in h]
    assert steps == list(range(1, 11)), f"log history after resume: {steps}"
    assert hf_checkpoints(b.mnt) == ["checkpoint-8", "checkpoint-10"], \
        "rotation on node b did not delete node a's checkpoints"
    for ckpt in ("checkpoint-8", "checkpoint-10"):
        hf_check_same(b.mnt / ckpt, ref / ckpt)

    # node a sees node b's work once it is published
    wait_published(b.mnt)
    status(a, refresh=True)
    assert hf_checkpoints(a.mnt) == ["checkpoint-8", "checkpoint-10"]
    assert Path(get_last_checkpoint(str(a.mnt)) or "").name == "checkpoint-10"
    table = {c["name"]: c for c in json.loads(cli("ls", a.shared, "--json").stdout)}
    assert sorted(table) == ["checkpoint-10", "checkpoint-8"], table
    assert all(c["complete"] for c in table.values()), table

    # out of SHARED with no mount, and loadable by the library
    out = tmp_path / "exported"
    for ckpt in ("checkpoint-8", "checkpoint-10"):
        cli("export", a.shared, ckpt, out / ckpt)
        hf_check_same(out / ckpt, ref / ckpt)
    model = transformers.GPT2LMHeadModel.from_pretrained(out / "checkpoint-10")
    want = hf_weights(ref / "checkpoint-10")
    got = {k: v for k, v in model.state_dict().items() if k in want}
    assert_same(got, want, "from_pretrained(export)")
    del model, got
    release_mappings()


def test_hf_trainer_checkpoint_survives_daemon_sigkill(make_mount: MakeMount,
                                                        tmp_path: Path) -> None:
    """The daemon is SIGKILLed as soon as `Trainer.train` returned (its last save done, no
    `ckptfs wait`). After the remount on the same NVME the rotated set of checkpoints is
    there, exactly as saved, and training resumes from the last one."""
    pytest.importorskip("transformers")
    from transformers.trainer_utils import get_last_checkpoint

    ref = tmp_path / "ref"
    hf_train(ref, 6)

    m = make_mount()
    assert hf_train(m.mnt, 6).global_step == 6
    m.kill()
    m.clean_stale()
    m.start()
    assert hf_checkpoints(m.mnt) == ["checkpoint-4", "checkpoint-6"]
    assert Path(get_last_checkpoint(str(m.mnt)) or "").name == "checkpoint-6"
    for ckpt in ("checkpoint-4", "checkpoint-6"):
        hf_check_same(m.mnt / ckpt, ref / ckpt)
    assert hf_train(m.mnt, 8, resume=True).global_step == 8
    assert hf_checkpoints(m.mnt) == ["checkpoint-6", "checkpoint-8"]


# -- PyTorch Lightning ----------------------------------------------------------------------------

PL_EVERY = 3


def pl_train(dirpath: Path, max_steps: int, save_last: bool | str, resume: bool = False) -> int:
    """Fit a small MLP, ModelCheckpoint every PL_EVERY steps keeping the 2 highest steps plus
    last.ckpt (a symlink to the newest when save_last="link"). Returns the global step."""
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.callbacks import ModelCheckpoint

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                           torch.nn.Linear(64, 1))

        def training_step(self, batch: Any, _idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(192, 32, generator=g)  # 12 batches: resume at an epoch boundary
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16, shuffle=True,
        generator=torch.Generator().manual_seed(1))
    ckpt = ModelCheckpoint(dirpath=dirpath, filename="{step}", monitor="step", mode="max",
                           save_top_k=2, save_last=save_last, every_n_train_steps=PL_EVERY)
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[ckpt], accelerator="cpu", devices=1,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=dirpath)
    trainer.fit(Regressor(), data, ckpt_path="last" if resume else None)
    step = trainer.global_step
    del trainer, ckpt
    release_mappings()
    return step


def pl_load(path: Path) -> dict[str, Any]:
    ck = torch.load(path, weights_only=False, map_location="cpu")
    return {"global_step": ck["global_step"], "state_dict": dict(ck["state_dict"]),
            "optim": flat_tensors(ck["optimizer_states"])}


def pl_check_same(got: Path, want: Path) -> None:
    g, w = pl_load(got), pl_load(want)
    assert g["global_step"] == w["global_step"], f"{got.name}: step {g['global_step']}"
    assert_same(g["state_dict"], w["state_dict"], f"{got.name}.state_dict")
    assert_same(g["optim"], w["optim"], f"{got.name}.optimizer_states")


def pl_listing(d: Path) -> dict[str, str | None]:
    """{name: symlink target or None}."""
    return {p.name: os.readlink(p) if p.is_symlink() else None for p in sorted(d.iterdir())}


@pytest.mark.parametrize("save_last", [True, "link"], ids=["last-copy", "last-link"])
def test_lightning_top_k_last_resume_on_second_node(make_mount: MakeMount, tmp_path: Path,
                                                    save_last: bool | str) -> None:
    """Lightning on node a: 12 steps, ModelCheckpoint every 3, top 2 by step plus last.ckpt.
    After `ckptfs wait` node a goes away and node b (empty NVME, same SHARED, the same mount
    path as a cluster would have) reads exactly what a saved, resumes with ckpt_path="last"
    to step 18, and leaves the same files and tensors as the same sequence on a local disk."""
    pytest.importorskip("pytorch_lightning")

    ref = tmp_path / "ref"
    assert pl_train(ref, 12, save_last) == 12
    ref_first = pl_listing(ref)
    assert set(ref_first) == {"last.ckpt", "step=9.ckpt", "step=12.ckpt"}, ref_first
    ref_saved = {n: pl_load(ref / n) for n in ref_first}
    assert pl_train(ref, 18, save_last, resume=True) == 18
    ref_final = pl_listing(ref)  # the resumed callback rotates out step=9 and step=12
    assert set(ref_final) == {"last.ckpt", "step=15.ckpt", "step=18.ckpt"}, ref_final

    a = start_node(make_mount, "a", "n0")
    d = a.mnt  # the mount is the checkpoint directory
    assert pl_train(d, 12, save_last) == 12
    assert pl_listing(d) == ref_first, "top-k rotation left other files than on a local disk"
    saved = {n: pl_load(d / n) for n in ref_first}
    for n, want in ref_saved.items():
        assert saved[n]["global_step"] == want["global_step"]
        assert_same(saved[n]["state_dict"], want["state_dict"], f"node a {n}")
        assert_same(saved[n]["optim"], want["optim"], f"node a {n} optimizer")
    wait_published(d)
    a.unmount()

    b = make_mount("b", node_args("n1"), start=False)
    b.shared, b.mnt = a.shared, a.mnt
    b.start()
    assert pl_listing(d) == ref_first
    for n, want in saved.items():
        got = pl_load(d / n)
        assert got["global_step"] == want["global_step"]
        assert_same(got["state_dict"], want["state_dict"], f"node b {n}")
        assert_same(got["optim"], want["optim"], f"node b {n} optimizer")
    assert pl_load(d / "last.ckpt")["global_step"] == 12

    assert pl_train(d, 18, save_last, resume=True) == 18
    assert pl_listing(d) == ref_final, "node b's rotation of node a's checkpoints differs"
    assert pl_load(d / "last.ckpt")["global_step"] == 18
    for n in ref_final:
        pl_check_same(d / n, ref / n)
    release_mappings()


# -- Orbax (JAX) ----------------------------------------------------------------------------------

ORBAX_CLIENT = Path(__file__).with_name("orbax_client.py")


@pytest.fixture
def orbax() -> None:
    """Skip unless JAX and Orbax are installed: found, not imported (they run in children)."""
    for module in ("jax", "orbax.checkpoint"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")


def orbax_run(cmd: str, d: Path, *args: object, keep: int = 2) -> subprocess.CompletedProcess[str]:
    """tests/orbax_client.py in a child process (JAX's threads stay out of pytest's)."""
    res = subprocess.run([sys.executable, str(ORBAX_CLIENT), cmd, str(d), *map(str, args),
                          "--keep", str(keep)], capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0, f"orbax {cmd} {d}: {res.stderr[-3000:]}"
    return res


def orbax_steps(res: subprocess.CompletedProcess[str], key: str = "steps") -> list[int]:
    """Orbax's steps after the run (or `key`="before": before it)."""
    return json.loads(res.stdout.strip().splitlines()[-1])[key]


def test_orbax_rotation_second_node_and_export(make_mount: MakeMount, tmp_path: Path,
                                               orbax: None) -> None:
    """Orbax's CheckpointManager with async saves on node a: 4 steps, the newest 2 kept, each
    step written into a temporary directory and renamed into place. The mount leaves the
    same names as a local directory, and every step restores exactly; after `ckptfs wait`,
    `ckptfs ls` counts both steps complete (Orbax's commit_success.txt), node b (empty NVME,
    same SHARED) restores them and goes on to step 6 (its rotation deletes node a's steps),
    node a then sees node b's, and `ckptfs export` gives a directory Orbax restores from."""
    ref = tmp_path / "ref"
    assert orbax_steps(orbax_run("save", ref, 1, 4)) == [3, 4]

    a = start_node(make_mount, "a", "n0")
    run = a.mnt / "run"
    assert orbax_steps(orbax_run("save", run, 1, 4)) == [3, 4]  # and restored them
    assert names(run) == names(ref) == ["step_3", "step_4"]
    for step in ("step_3", "step_4"):
        assert names(run / step) == names(ref / step)
    wait_published(a.mnt)
    table = {c["name"]: c for c in json.loads(cli("ls", a.shared, "--json").stdout)}
    assert sorted(table) == ["run/step_3", "run/step_4"], table
    assert all(c["complete"] for c in table.values()), table

    b = start_node(make_mount, "b", "n1", shared=a.shared)
    cli("status", b.mnt, "--refresh")
    res = orbax_run("save", b.mnt / "run", 5, 6)  # restores 3 and 4 first
    assert orbax_steps(res, "before") == [3, 4] and orbax_steps(res) == [5, 6]
    wait_published(b.mnt)
    status(a, refresh=True)
    assert names(run) == ["step_5", "step_6"], "node a still lists node b's rotated steps"

    out = tmp_path / "exported"
    cli("export", a.shared, "run", out)
    assert orbax_steps(orbax_run("check", out)) == [5, 6]


def test_orbax_async_save_cut_by_daemon_sigkill(make_mount: MakeMount, orbax: None) -> None:
    """Steps 1-3 saved and waited for; step 4's async save is under way (its temporary
    directory exists) when the daemon is SIGKILLed. After the remount on the same NVME,
    Orbax lists steps 1-3 (and 4 only if its rename had returned), every step it lists
    restores exactly, its cleanup removes the cut save's temporary directory, and training
    goes on to save step 5."""
    m = make_mount()
    run = m.mnt / "run"
    assert orbax_steps(orbax_run("save", run, 1, 3, keep=5)) == [1, 2, 3]
    cut = subprocess.Popen([sys.executable, str(ORBAX_CLIENT), "save", str(run), "4", "4",
                            "--keep", "5"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: any(n.startswith("step_4.") for n in os.listdir(run))
                 or cut.poll() is not None, 120, "step 4's save to begin")
        m.kill()
        # it fails or finishes with the mount gone under it; how Orbax handles that (it may
        # also never return) is not what this test is about: only what the remount finds
        with contextlib.suppress(subprocess.TimeoutExpired):
            cut.wait(timeout=30)
    finally:
        if cut.poll() is None:
            cut.kill()
            cut.wait()
    m.clean_stale()
    m.start()
    res = orbax_run("save", run, 5, 5, keep=5)  # restores what is listed first
    assert orbax_steps(res, "before") in ([1, 2, 3], [1, 2, 3, 4]), res.stdout
    assert orbax_steps(res)[-1] == 5
    assert not any(n.startswith("step_4.") for n in names(run)), names(run)


# -- DeepSpeed ------------------------------------------------------------------------------------

DS_WORLD = 2
DS_SAVE_EVERY = 2


def ds_rank_main(rank: int, world: int, rendezvous: str, save_dir: str, steps: int,
                 resume: bool) -> int:
    """One rank of a DeepSpeed job (script mode, at the end of this file): a ZeRO-2 engine on
    the CPU over gloo trains a small MLP up to step `steps`, `save_checkpoint(save_dir)` every
    DS_SAVE_EVERY steps. With `resume` it first `load_checkpoint(save_dir)`s (the tag
    `latest` names), from weights initialised with another seed, so every weight and
    optimizer value it goes on with must come from the checkpoint. Each step's batch depends
    on (rank, step) alone: a resumed run saves exactly the tensors of an uninterrupted one.
    Prints one JSON line: {"loaded": tag or null, "start": first step, "saved": [steps]}."""
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import deepspeed

    # The CPU accelerator JIT-compiles a shared-memory all-reduce kernel when the comm backend
    # starts (35 s of gcc at first use, then cached); only inference's all-reduce uses it,
    # training over gloo does not.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]
    torch.manual_seed(1 if resume else 0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": 2}, "steps_per_print": 1000}
    # a rendezvous file, not a TCP port another test could hold
    deepspeed.init_distributed(dist_backend="gloo", init_method=f"file://{rendezvous}",
                               rank=rank, world_size=world, auto_mpi_discovery=False)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    loaded = None
    if resume:
        path, client = engine.load_checkpoint(save_dir)
        if path is None or client is None or client["step"] != engine.global_steps:
            print(f"rank {rank}: load_checkpoint({save_dir}) gave {path}, {client}")
            return 1
        loaded = Path(path).parent.name
    start, saved = engine.global_steps, []
    while engine.global_steps < steps:
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(
            1000 * rank + engine.global_steps))
        loss = torch.nn.functional.mse_loss(engine(x), x.sum(1, keepdim=True))
        engine.backward(loss)
        engine.step()
        if engine.global_steps % DS_SAVE_EVERY == 0:
            engine.save_checkpoint(save_dir, client_state={"step": engine.global_steps})
            saved.append(engine.global_steps)
    print(json.dumps({"loaded": loaded, "start": start, "saved": saved}))
    return 0


def ds_run(save_dir: Path, steps: int, logs: Path, resume: bool = False) -> dict[str, Any]:
    """DS_WORLD ranks of `ds_rank_main` as child processes (DeepSpeed's process group and
    threads stay out of pytest's); a rank that fails takes the others down. Returns rank 0's
    JSON line, the same on every rank."""
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    procs: list[subprocess.Popen[bytes]] = []
    run = len(list(logs.glob("*-rank0.log")))
    rendezvous = logs / f"{run}-rendezvous"
    outs = [logs / f"{run}-rank{r}.log" for r in range(DS_WORLD)]
    try:
        for r in range(DS_WORLD):
            with open(outs[r], "wb") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "deepspeed", str(r), str(DS_WORLD), str(rendezvous),
                     str(save_dir), str(steps), "1" if resume else "0"],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                    cwd=logs))
        wait_for(lambda: all(p.poll() is not None for p in procs)
                 or any(p.poll() for p in procs), 240, f"DeepSpeed ranks on {save_dir}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    texts = [o.read_text(errors="replace") for o in outs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{texts[r][-3000:]}"
    results = [json.loads(t.strip().splitlines()[-1]) for t in texts]
    assert all(res == results[0] for res in results), results
    return results[0]


@pytest.fixture
def deepspeed_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed installed, its accelerator the CPU (for loading its checkpoint files here)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")


def ds_load(ckpt: Path) -> dict[str, Any]:
    """Every tensor of every file of a global_stepN directory, keyed by file and path, plus
    the step counters. The ZeRO optimizer files pickle DeepSpeed objects: not weights_only."""
    out: dict[str, Any] = {}
    for f in sorted(ckpt.iterdir()):
        ck = torch.load(f, weights_only=False, map_location="cpu")
        if "global_steps" in ck:
            out[f"{f.name}.steps"] = (ck["global_steps"], ck["step"])
        out.update(flat_tensors(ck, f.name))
    return out


def ds_check_same(got: Path, want: Path, step: int) -> None:
    """A global_stepN directory holds the same files and tensors as the reference's."""
    assert names(got) == names(want), f"{got}: {names(got)} != reference {names(want)}"
    assert names(got) == ["mp_rank_00_model_states.pt"] + [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(DS_WORLD)], names(got)
    g, w = ds_load(got), ds_load(want)
    steps = "mp_rank_00_model_states.pt.steps"
    assert g.pop(steps) == w.pop(steps) == (step, step), f"{got}: steps"
    assert_same(g, w, str(got))


def ds_fp32(d: Path) -> dict[str, Any]:
    """DeepSpeed's own consolidation of the ZeRO shards that `latest` names into fp32
    weights (what zero_to_fp32.py does)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return dict(get_fp32_state_dict_from_zero_checkpoint(str(d)))


def test_deepspeed_zero2_resume_on_second_node_and_export(make_mount: MakeMount,
                                                          tmp_path: Path,
                                                          deepspeed_cpu: None) -> None:
    """DeepSpeed itself, 2 ranks over gloo, ZeRO stage 2, `save_checkpoint` every 2 steps into
    /ckpt/run: the reference trains to step 6 in one go on a local directory. Node a trains
    to step 4; its global_step2 and global_step4 (model states and each rank's optimizer
    partition, DeepSpeed's `latest`, its zero_to_fp32.py) equal the reference's, tensor for
    tensor. After `ckptfs wait`, `ckptfs ls` counts global_step4 complete (named by `latest`;
    ls has no memory of the global_step2 an earlier `latest` named). Node b (empty NVME, same
    SHARED) `load_checkpoint`s global_step4 into a model initialised with another seed and
    trains on to step 6: its global_step6 equals the uninterrupted run's. Node a sees it,
    and `ckptfs export` gives a directory DeepSpeed's zero_to_fp32 consolidates."""
    logs = tmp_path / "ds-logs"
    ref = tmp_path / "ref" / "run"
    assert ds_run(ref, 6, logs) == {"loaded": None, "start": 0, "saved": [2, 4, 6]}
    top = ["global_step2", "global_step4", "global_step6", "latest", "zero_to_fp32.py",
           "zero_to_torch.py"]
    assert names(ref) == top, names(ref)

    a = start_node(make_mount, "a", "n0")
    run = a.mnt / "run"
    assert ds_run(run, 4, logs) == {"loaded": None, "start": 0, "saved": [2, 4]}
    assert names(run) == [n for n in top if n != "global_step6"], names(run)
    assert (run / "latest").read_text() == "global_step4"
    assert (run / "zero_to_fp32.py").read_bytes() == (ref / "zero_to_fp32.py").read_bytes()
    for step in (2, 4):
        ds_check_same(run / f"global_step{step}", ref / f"global_step{step}", step)
    wait_published(a.mnt)
    table = {c["name"]: c["complete"] for c in json.loads(cli("ls", a.shared, "--json").stdout)}
    assert table == {"run/global_step2": False, "run/global_step4": True}, table

    b = start_node(make_mount, "b", "n1", shared=a.shared)
    cli("status", b.mnt, "--refresh")
    run_b = b.mnt / "run"
    assert names(run_b) == names(run)
    assert ds_run(run_b, 6, logs, resume=True) == \
        {"loaded": "global_step4", "start": 4, "saved": [6]}
    assert names(run_b) == top, names(run_b)
    assert (run_b / "latest").read_text() == "global_step6"
    for step in (2, 4, 6):
        ds_check_same(run_b / f"global_step{step}", ref / f"global_step{step}", step)

    wait_published(b.mnt)
    status(a, refresh=True)
    assert names(run) == top, names(run)
    assert (run / "latest").read_text() == "global_step6"
    ds_check_same(run / "global_step6", ref / "global_step6", 6)
    table = {c["name"]: c["complete"] for c in json.loads(cli("ls", a.shared, "--json").stdout)}
    assert table == {"run/global_step2": False, "run/global_step4": False,
                     "run/global_step6": True}, table

    out = tmp_path / "exported"
    cli("export", a.shared, "run", out)
    assert names(out) == top, names(out)
    ds_check_same(out / "global_step6", ref / "global_step6", 6)
    assert_same(ds_fp32(out), ds_fp32(ref), "zero_to_fp32 of the export")
    release_mappings()


# -- script mode: one DeepSpeed rank ------------------------------------------------------------

if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "deepspeed":
        sys.exit(ds_rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5],
                              int(sys.argv[6]), sys.argv[7] == "1"))
    sys.exit(f"usage: {sys.argv[0]} deepspeed RANK WORLD RENDEZVOUS SAVE_DIR STEPS RESUME(0|1)")
