"""Real training frameworks, unchanged, on a ckptfs mount: the Hugging Face `transformers`
Trainer and PyTorch Lightning, each training a tiny model defined here (no downloads).

Each scenario is run twice in this process: once on a plain local directory (the reference)
and once on ckptfs, then compared exactly: which checkpoints exist after the framework's
rotation deleted the old ones, which one a resume picks, the step it continues from, and
every tensor it saved. Between save and resume the checkpoint crosses to a second node (its
own empty NVME, same SHARED), goes out through `ckptfs export`, or survives a SIGKILL of
the daemon.

Needs `transformers` (with `accelerate`) and `pytorch_lightning`; each test skips when its
framework is missing.
"""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from mounting import MakeMount
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

def orbax_state(step: int) -> dict[str, Any]:
    """A train state for `step`: jax arrays of three dtypes, a numpy array and a scalar."""
    jax = pytest.importorskip("jax")
    import numpy as np

    key = jax.random.PRNGKey(step)
    k1, k2 = jax.random.split(key)
    return {"params": {"w": jax.random.normal(k1, (256, 512)),
                       "b": jax.numpy.arange(512, dtype=jax.numpy.bfloat16) * step},
            "opt": {"mu": jax.random.uniform(k2, (256, 512)),
                    "count": jax.numpy.int32(step)},
            "rng": np.arange(64, dtype=np.uint32) + step}


def orbax_manager(d: Path, max_to_keep: int = 2, **options: Any) -> Any:
    """A CheckpointManager as a JAX training loop makes one: async saves, `step_N` names
    (step_prefix; without it Orbax names steps by number alone, which --retain cannot tell
    from other directories), the newest `max_to_keep` kept."""
    pytest.importorskip("jax")
    ocp = pytest.importorskip("orbax.checkpoint")
    opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, step_prefix="step",
                                        enable_async_checkpointing=True, **options)
    return ocp.CheckpointManager(d, options=opts)


def orbax_save(mgr: Any, steps: range) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    for step in steps:
        assert mgr.save(step, args=ocp.args.StandardSave(orbax_state(step)))
    mgr.wait_until_finished()


def orbax_check(mgr: Any, step: int, where: str) -> None:
    """Step `step` restores to exactly the state saved for it."""
    import numpy as np
    ocp = pytest.importorskip("orbax.checkpoint")
    jax = pytest.importorskip("jax")

    got = mgr.restore(step, args=ocp.args.StandardRestore(orbax_state(0)))
    want = orbax_state(step)
    flat_got = dict(jax.tree_util.tree_flatten_with_path(got)[0])
    flat_want = dict(jax.tree_util.tree_flatten_with_path(want)[0])
    assert flat_got.keys() == flat_want.keys(), f"{where} step {step}: other leaves"
    for path, w in flat_want.items():
        g = np.asarray(flat_got[path])
        w = np.asarray(w)
        name = jax.tree_util.keystr(path)
        assert g.dtype == w.dtype and g.shape == w.shape, f"{where} step {step} {name}"
        assert np.array_equal(g, w), f"{where} step {step} {name}: values differ"


@pytest.fixture
def jax_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """JAX on the CPU, without probing for accelerators."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    pytest.importorskip("jax")
    pytest.importorskip("orbax.checkpoint")


def test_orbax_rotation_second_node_and_export(make_mount: MakeMount, tmp_path: Path,
                                               jax_cpu: None) -> None:
    """Orbax's CheckpointManager with async saves on node a: 4 steps, the newest 2 kept, each
    step written into a temporary directory and renamed into place. The mount leaves the
    same names as a local directory; after `ckptfs wait`, `ckptfs ls` counts both steps
    complete (Orbax's commit_success.txt), node b (empty NVME, same SHARED) restores them,
    goes on to step 6 (its rotation deletes node a's steps), and `ckptfs export` gives a
    directory Orbax restores from."""
    ref = tmp_path / "ref"
    mgr = orbax_manager(ref)
    orbax_save(mgr, range(1, 5))
    assert mgr.all_steps() == [3, 4]
    mgr.close()

    a = start_node(make_mount, "a", "n0")
    run = a.mnt / "run"
    mgr = orbax_manager(run)
    orbax_save(mgr, range(1, 5))
    assert mgr.all_steps() == [3, 4]
    assert names(run) == names(ref) == ["step_3", "step_4"]
    for step in (3, 4):
        assert names(run / f"step_{step}") == names(ref / f"step_{step}")
        orbax_check(mgr, step, "node a")
    mgr.close()
    wait_published(a.mnt)
    table = {c["name"]: c for c in json.loads(cli("ls", a.shared, "--json").stdout)}
    assert sorted(table) == ["run/step_3", "run/step_4"], table
    assert all(c["complete"] for c in table.values()), table

    b = start_node(make_mount, "b", "n1", shared=a.shared)
    cli("status", b.mnt, "--refresh")
    mgr = orbax_manager(b.mnt / "run")
    assert mgr.all_steps() == [3, 4] and mgr.latest_step() == 4
    for step in (3, 4):
        orbax_check(mgr, step, "node b")
    orbax_save(mgr, range(5, 7))
    assert mgr.all_steps() == [5, 6]
    mgr.close()
    wait_published(b.mnt)
    status(a, refresh=True)
    assert names(run) == ["step_5", "step_6"], "node a still lists node b's rotated steps"

    out = tmp_path / "exported"
    cli("export", a.shared, "run", out)
    mgr = orbax_manager(out)
    assert mgr.all_steps() == [5, 6]
    for step in (5, 6):
        orbax_check(mgr, step, "export")
    mgr.close()


def test_orbax_async_save_cut_by_daemon_sigkill(make_mount: MakeMount, jax_cpu: None) -> None:
    """Steps 1-3 saved and waited for; step 4's async save is under way in Orbax's background
    thread when the daemon is SIGKILLed. After the remount on the same NVME, Orbax lists
    steps 1-3 at least (step 4 only if its rename had returned), every step it lists
    restores exactly, and training goes on to save step 5."""
    import threading

    m = make_mount()
    run = m.mnt / "run"
    mgr = orbax_manager(run, max_to_keep=5)
    orbax_save(mgr, range(1, 4))
    ocp = pytest.importorskip("orbax.checkpoint")

    def kill_once_under_way() -> None:
        """SIGKILL as soon as step 4's temporary directory exists."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if any(n.startswith("step_4.") for n in os.listdir(run)):
                break
            time.sleep(0.001)
        m.kill()

    killer = threading.Thread(target=kill_once_under_way)
    killer.start()
    try:
        mgr.save(4, args=ocp.args.StandardSave(orbax_state(4)))
        mgr.wait_until_finished()
    except Exception:  # noqa: BLE001  the mount went away under the save: expected
        pass
    finally:
        killer.join()
        try:
            mgr.close()
        except Exception:  # noqa: BLE001
            pass
    m.clean_stale()
    m.start()
    # Orbax removes its unfinished temporary directories when asked to
    mgr = orbax_manager(run, max_to_keep=5, cleanup_tmp_directories=True)
    steps = mgr.all_steps()
    assert steps[:3] == [1, 2, 3] and set(steps) <= {1, 2, 3, 4}, steps
    for step in steps:
        orbax_check(mgr, step, "after SIGKILL")
    orbax_save(mgr, range(5, 6))
    assert mgr.latest_step() == 5
    orbax_check(mgr, 5, "after resume")
    mgr.close()
    assert not any(".orbax-checkpoint-tmp" in n for n in names(run)), names(run)
