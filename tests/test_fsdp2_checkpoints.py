"""Checkpoints under FSDP2 (``fully_shard`` per decoder layer, ModelParallelStrategy) with MemOpt, full and distributed
(``save_distributed_checkpoint``): they hold what a run without MemOpt saves, under the same names, and resume
without MemOpt (and, the reverse, a plain one with MemOpt) to the weights of a run that never used it, to the bit.

Two real CPU processes (gloo) per launch; each launch runs several fits in turn, each with a Trainer of its own. The
runs without MemOpt are made before ``lightning_memopt`` is first imported in their process (the script checks it):
nothing it could leave behind reaches them. Every checkpoint is taken twice: by a ModelCheckpoint at step 2, while
MemOpt's changes are in force, and by ``trainer.save_checkpoint`` after the fit, when they are undone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.slow,  # subprocesses: run by CI with `python -m pytest -m slow`
    pytest.mark.xdist_group("fsdp2_checkpoints"),  # on one worker: the launches of each layout are shared
]

SCRIPT = """
import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from transformers import LlamaConfig, LlamaForCausalLM


class TinyLlama(pl.LightningModule):
    def __init__(self):
        super().__init__()
        config = LlamaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=64,
        )
        self.llama = LlamaForCausalLM(config)
        self.saves = []  # at each checkpoint taken: whether the model was checkpointing its layers then

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.llama.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.llama, mesh=mesh)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.llama(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        # 8 sequences, 2 per batch on each of 2 ranks: an epoch is 2 steps, the same batches in the same order each
        # epoch (Lightning's own sampler would shuffle the training data: use_distributed_sampler=False)
        ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
        data = TensorDataset(ids)
        sampler = DistributedSampler(data, num_replicas=2, rank=self.global_rank, shuffle=False)
        return DataLoader(data, batch_size=2, sampler=sampler)

    def on_save_checkpoint(self, checkpoint):
        self.saves.append(self.llama.is_gradient_checkpointing)


def fit(out, name, steps, memopt, resume, save):
    if not memopt:
        assert "lightning_memopt" not in sys.modules, "a run without MemOpt after MemOpt was imported"
    callbacks = []
    if save:  # at step 2, inside the fit: MemOpt's changes are in force
        callbacks.append(ModelCheckpoint(dirpath=out, filename=name + "-during", every_n_train_steps=2))
    if memopt:
        from lightning_memopt import MemOpt

        callbacks.append(MemOpt(checkpointing=True, free_gradients=True))
    torch.manual_seed(0)
    model = TinyLlama()
    distributed = sys.argv[2] == "distributed"
    strategy = ModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=distributed
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=save,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False, callbacks=callbacks,
    )
    trainer.fit(model, ckpt_path=os.path.join(out, resume) if resume else None)
    if save:  # after the fit: MemOpt has undone its changes
        trainer.save_checkpoint(os.path.join(out, name + "-after.ckpt"))
    weights = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # every rank gathers
    torch.save(weights, os.path.join(out, f"{name}.weights.{trainer.global_rank}.pt"))
    line = f"RANK {trainer.global_rank} {name} {trainer.global_step} {'/'.join(map(str, model.saves)) or '-'}"
    os.write(1, (line + "\\n").encode())  # one write: the ranks' lines do not mix


if __name__ == "__main__":
    for run in sys.argv[3:]:  # name:steps:memopt|plain:checkpoint to resume from:save|-
        name, steps, use, resume, save = run.split(":")
        fit(sys.argv[1], name, int(steps), use == "memopt", resume, save == "save")
    # or gloo's threads may still hold tensors while the interpreter shuts down: "terminate called without an
    # active exception", SIGABRT (pytorch/pytorch#190489), seen once in 4 launches that saved distributed checkpoints
    torch.distributed.destroy_process_group()
"""

#: The fits of the first launch: 2 steps without and with MemOpt, each taking both checkpoints, and 4 without.
FITS = ["plain2:2:plain::save", "plain4:4:plain::-", "memopt2:2:memopt::save"]

#: The second launch: 2 more steps from each checkpoint, without MemOpt, then from the plain ones with it.
RESUMES = [
    f"{name}-{when}:4:{use}:{source}-{when}.ckpt:-"
    for use, sources in (("plain", ("memopt2", "plain2")), ("memopt", ("plain2",)))
    for when in ("during", "after")
    for source in sources
    for name in [f"{use}-from-{source}"]
]

#: Names that would mean a wrapper or MemOpt reached the saved state (checkpoint_wrapper's, FSDP1's, torch.compile's).
FORBIDDEN = ("_checkpoint_wrapped_module", "checkpoint_wrapper", "_fsdp_wrapped_module", "_orig_mod", "memopt")


def _launch(out: Path, layout: str, runs: list[str]) -> list[str]:
    script = out / "fsdp2_checkpoints.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    args = [sys.executable, str(script), str(out), layout, *runs]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, cwd=out)
    assert result.returncode == 0, result.stderr[-4000:]
    return sorted(line for line in result.stdout.splitlines() if line.startswith("RANK"))


@pytest.fixture(scope="module", params=["distributed", "full"])
def runs(request, tmp_path_factory) -> tuple[Path, str, dict[str, list[str]]]:
    """Both launches for one checkpoint layout. Returns the folder, the layout and each run's lines (one per rank:
    its global step and, at each checkpoint taken, whether the layers were being checkpointed then)."""
    out = tmp_path_factory.mktemp(request.param)
    lines = _launch(out, request.param, FITS) + _launch(out, request.param, RESUMES)
    by_run: dict[str, list[str]] = {}
    for line in lines:
        _, rank, name, *rest = line.split()
        by_run.setdefault(name, []).append(rank)
        by_run[name] += rest
    return out, request.param, by_run


def _load(path: Path, layout: str, scratch: Path) -> dict[str, Any]:
    """A checkpoint as one dict in the full layout's names: ``state_dict``, ``optimizer_states`` and the rest. Loaded
    with ``weights_only=True``: a class of MemOpt's (or any other non-tensor object) pickled into it fails here."""
    if layout == "full":
        return torch.load(path, map_location="cpu", weights_only=True)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    whole = scratch / f"{path.name}.pt"
    dcp_to_torch_save(path, whole)  # the shards of both ranks, gathered in this process
    sharded = torch.load(whole, weights_only=True)
    assert sharded.keys() == {"state_dict", "optimizer_0"}
    meta = torch.load(path / "meta.pt", weights_only=True)
    return {**meta, "state_dict": sharded["state_dict"], "optimizer_states": [sharded["optimizer_0"]]}


def _assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, set(a) ^ set(b))
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _names(value: Any) -> set[str]:
    """Every string in a checkpoint's structure, keys and values."""
    if isinstance(value, str):
        return {value}
    if isinstance(value, dict):
        return {n for key, v in value.items() for n in _names(key) | _names(v)}
    if isinstance(value, (list, tuple)):
        return {n for v in value for n in _names(v)}
    return set()


def _weights(out: Path, name: str) -> dict[str, torch.Tensor]:
    """A run's final weights, gathered whole (``full_tensor``); asserted alike on both ranks."""
    rank0, rank1 = (torch.load(out / f"{name}.weights.{r}.pt", weights_only=True) for r in (0, 1))
    _assert_same(rank0, rank1, f"{name}: rank 0 against rank 1")
    return rank0


@pytest.mark.parametrize("when", ["during", "after"])
def test_a_memopt_checkpoint_holds_what_a_plain_one_does(runs, when, tmp_path) -> None:
    """With MemOpt (checkpointing and free_gradients) the checkpoint holds the weights and AdamW's state of the run
    without it, to the bit, under the same names, with nothing of MemOpt's or of a wrapper's among them. Its only
    entry of MemOpt's is the callback's state under "callbacks": the settings it chose, as plain values."""
    out, layout, by_run = runs
    assert by_run["plain2"] == ["0", "2", "False/False", "1", "2", "False/False"]
    # the checkpoint at step 2 was taken with the layers checkpointed, the one after the fit without (undone)
    assert by_run["memopt2"] == ["0", "2", "True/False", "1", "2", "True/False"]
    plain = _load(out / f"plain2-{when}.ckpt", layout, tmp_path)
    memopt = _load(out / f"memopt2-{when}.ckpt", layout, tmp_path)

    _assert_same(memopt["state_dict"], plain["state_dict"], "state_dict")
    _assert_same(memopt["optimizer_states"], plain["optimizer_states"], "optimizer_states")
    _assert_same(memopt["state_dict"], _weights(out, "memopt2"), "state_dict against the run's weights")
    keys = set(memopt["state_dict"])
    assert len(keys) == 21 and all(k.startswith("llama.") for k in keys), sorted(keys)
    state = memopt["optimizer_states"][0]["state"]
    assert len(state) == 21 and all(v.keys() == {"step", "exp_avg", "exp_avg_sq"} for v in state.values())

    assert memopt.keys() == plain.keys()
    for key in memopt.keys() - {"state_dict", "optimizer_states", "callbacks"}:  # loops, epoch, global_step, ...
        _assert_same(memopt[key], plain[key], key)
    without_callbacks = {k: v for k, v in memopt.items() if k != "callbacks"}
    assert not {n for n in _names(without_callbacks) if any(f in n.lower() for f in FORBIDDEN)}

    extra = memopt["callbacks"].keys() - plain["callbacks"].keys()
    assert plain["callbacks"].keys() < memopt["callbacks"].keys() and len(extra) == 1
    (key,) = extra
    assert key.startswith("MemOpt{")
    entry = memopt["callbacks"][key]
    assert entry.keys() == {"version", "settings"} and entry["version"] == 1
    ((shapes, settings),) = entry["settings"]["fit"]  # one batch shape: what each technique chose for it
    assert shapes == [[2, 16]]
    checkpointing = {"switches": ["llama.model.layers.0", "llama.model.layers.1"], "modes": ["full", "full"]}
    chosen = dict(settings["checkpointing"])
    counted = chosen.pop("counted")  # the FLOPs a dry run counted with them: a resumed run need not count again
    assert chosen == checkpointing and all(isinstance(n, int) and n > 0 for n in counted)


@pytest.mark.parametrize("when", ["during", "after"])
def test_a_memopt_checkpoint_resumes_without_memopt_to_equal_weights(runs, when) -> None:
    """2 steps with MemOpt, 2 more without it from its checkpoint: the weights of the run whose first 2 steps ran
    without MemOpt too, and, from the checkpoint taken at step 2, those of 4 steps in one run.

    Not the latter from the checkpoint saved after the fit: Lightning itself resumes such a one (the fit stopped by
    max_steps on an epoch's last batch) with the batch count of the epoch it ended, so the next epoch ends after its
    first batch and the 4th step sees epoch 2's first batch, not epoch 1's second: with or without MemOpt alike."""
    out, _, by_run = runs
    resumed = _weights(out, f"plain-from-memopt2-{when}")
    assert by_run[f"plain-from-memopt2-{when}"] == ["0", "4", "-", "1", "4", "-"]
    _assert_same(resumed, _weights(out, f"plain-from-plain2-{when}"), "against the plain resumed run")
    if when == "during":
        _assert_same(resumed, _weights(out, "plain4"), "against 4 steps in one run")


@pytest.mark.parametrize("when", ["during", "after"])
def test_a_plain_checkpoint_resumes_with_memopt_to_equal_weights(runs, when) -> None:
    """The reverse: 2 steps without MemOpt, 2 more with it from the checkpoint: the weights of the run that resumed
    without it, and, from the checkpoint taken at step 2, those of 4 steps in one run."""
    out, _, by_run = runs
    resumed = _weights(out, f"memopt-from-plain2-{when}")
    assert by_run[f"memopt-from-plain2-{when}"] == ["0", "4", "-", "1", "4", "-"]
    _assert_same(resumed, _weights(out, f"plain-from-plain2-{when}"), "against the plain resumed run")
    if when == "during":
        _assert_same(resumed, _weights(out, "plain4"), "against 4 steps in one run")
        _assert_same(_weights(out, "plain-from-plain2-during"), _weights(out, "plain4"), "the plain resume")
