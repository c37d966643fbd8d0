"""FSDP2 on two real CPU ranks (gloo, Lightning's ModelParallelStrategy, ``fully_shard`` in ``configure_model``)
against what one process says of them: ``estimate(..., strategy=ModelParallelStrategy(2, 1))``, each rank's real peak
on an independent meter (tests/test_meter.py's, which shares no code with MemOpt's), a budget planned by dry runs of
the sharded step, and the optimizer step in the backward pass on the sharded gradients."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_memopt import estimate
from tests import zoo

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fsdp2")]  # two processes each: run by CI with -m slow

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json
import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor

sys.path.insert(0, {root!r})
from tests.test_meter import Meter
from tests.test_fsdp2 import MODELS, batches


class LocalMeter(Meter):
    \"\"\"The meter on what this rank holds: a DTensor's local shard.\"\"\"

    def add(self, tensors):
        flat = torch.utils._pytree.tree_flatten(tensors)[0]
        super().add([t._local_tensor if isinstance(t, DTensor) else t for t in flat])


class Metered(pl.Callback):
    def __init__(self):
        self.peaks, self.losses = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.meter = LocalMeter()
        self.meter.add([*pl_module.parameters(), *pl_module.buffers(), batch])
        self.meter.add([p.grad for p in pl_module.parameters() if p.grad is not None])
        self.meter.add([list(s.values()) for o in trainer.optimizers for s in o.state.values()])
        self.meter.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.meter.__exit__(None, None, None)
        self.peaks.append(self.meter.peak)
        self.losses.append(float(outputs["loss"]))


def fit(options):
    from lightning_memopt import MemOpt

    torch.manual_seed(0)
    model, meter = MODELS[os.environ["FSDP2_MODEL"]](), Metered()
    memopt = MemOpt(**options) if options is not None else None
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, callbacks=[c for c in (memopt, meter) if c],
    )
    trainer.fit(model, batches(trainer.global_rank))
    weights = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    out = dict(peaks=meter.peaks, losses=meter.losses)
    if memopt is not None:
        report = memopt.report
        out.update(
            report_peak=report.peak_bytes, baseline=report.baseline_peak_bytes, notes=report.notes,
            applied=[a.technique for a in report.applied],
        )
    return trainer.global_rank, out, [w.detach().clone() for w in weights]


if __name__ == "__main__":
    runs = json.loads(sys.argv[1])
    results = {{}}
    for name, options in runs.items():
        rank, out, weights = fit(options)
        results[name] = out
        torch.save(weights, f"weights-{{name}}-{{rank}}.pt")
    with open(f"results-{{rank}}.json", "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()
"""


class Model(pl.LightningModule):
    """A tiny Llama, each decoder layer and the whole model sharded by ``fully_shard``, with AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.model = zoo.llama(layers=3, hidden=64, vocab_size=256, max_position_embeddings=128)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        for layer in self.model.model.layers:
            fully_shard(layer, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class MixedLlama(Model):
    """A held-out Llama: grouped-query attention, 4 layers of width 96, parameters gathered in bf16 with gradients
    reduced in float32 (``MixedPrecisionPolicy``), and the layers kept gathered between the forward and the backward
    pass (``reshard_after_forward=False``)."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        self.model = zoo.llama(
            layers=4, hidden=96, vocab_size=256, intermediate_size=200, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128,
        )  # fmt: skip

    def configure_model(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        fully_shard(self.model, mesh=mesh, mp_policy=policy)


MODELS = {"llama": Model, "mixed_llama": MixedLlama}


def batches(rank: int) -> torch.utils.data.DataLoader:
    """Each rank's own batches of 2 sequences of 96 tokens, in order."""
    ids = torch.randint(0, 256, (12, 96), generator=torch.Generator().manual_seed(rank))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)


def _launch(tmp_path: Path, runs: dict[str, dict | None], model: str = "llama") -> tuple[list[dict], dict[str, list]]:
    """Fit each of ``runs`` (MemOpt's options, ``None``: without MemOpt) on two CPU ranks, one after another in one
    launch, the model of :data:`MODELS` named ``model``. Returns each rank's results and, by run, the gathered weights
    (asserted equal on both ranks)."""
    tmp_path.mkdir(exist_ok=True)
    script = tmp_path / "fsdp2_fit.py"
    script.write_text(textwrap.dedent(SCRIPT.format(root=str(ROOT))))
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "LIGHTNING_MEMOPT_CACHE_DIR": "", "FSDP2_MODEL": model}
    args = [sys.executable, str(script), json.dumps(runs)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"results-{rank}.json").read_text()) for rank in (0, 1)]
    weights = {}
    for name in runs:
        zero, one = (torch.load(tmp_path / f"weights-{name}-{rank}.pt") for rank in (0, 1))
        assert all(torch.equal(a, b) for a, b in zip(zero, one, strict=True))
        weights[name] = zero
    return ranks, weights


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_one_process_estimates_each_rank_and_plans_a_budget_that_two_real_ranks_meet(tmp_path) -> None:
    model, batch = Model(), next(iter(batches(0)))
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    plain, memopt = (estimate(model, batch, "fit", strategy=strategy, **o).memopt for o in ({"enabled": False}, {}))
    ranks, weights = _launch(
        tmp_path / "one", {"plain": None, "memopt": {}, "in_backward": {"optimizer_in_backward": True}}
    )
    for rank in ranks:
        # batch 0 has no optimizer state yet; the estimate is of a later step: each batch from the second
        assert rank["plain"]["peaks"][1:] == [plain.bytes] * 2, (rank["plain"]["peaks"], plain.bytes)
        assert rank["memopt"]["peaks"][1:] == [memopt.bytes] * 2, (rank["memopt"]["peaks"], memopt.bytes)
        assert rank["memopt"]["baseline"] == plain.bytes and rank["memopt"]["notes"] == []
        assert rank["memopt"]["losses"] == rank["plain"]["losses"]
        assert "optimizer_in_backward" in rank["in_backward"]["applied"]
        assert rank["in_backward"]["losses"] == rank["plain"]["losses"]
    assert _equal(weights["memopt"], weights["plain"]) and _equal(weights["in_backward"], weights["plain"])

    lowest = estimate(model, batch, "fit", strategy=strategy, optimizer_in_backward=True).memopt.bytes
    budget = (lowest + plain.bytes) // 2  # halfway between MemOpt's lowest per-rank peak and plain's
    budgeted, again = _launch(tmp_path / "budget", {"auto": {"checkpointing": "auto", "memory_budget": budget}})
    for rank, first in zip(budgeted, ranks, strict=True):
        auto = rank["auto"]
        assert auto["notes"] == [] and auto["baseline"] == plain.bytes, auto
        assert max(auto["peaks"]) <= budget < plain.bytes, (auto["peaks"], budget)  # from the first batch
        assert auto["losses"] == first["plain"]["losses"]
    assert _equal(again["auto"], weights["plain"])


def test_a_held_out_mixed_precision_llama_is_estimated_per_rank_to_the_byte(tmp_path) -> None:
    """Issue 60, item 7: a model of other shapes and another FSDP2 setup than the test above (bf16 gathers, layers kept
    gathered after the forward pass). Each rank's real peak, over two launches, against one process's estimate: the
    real peaks are the same in both launches (the spread between runs is nothing on this meter), and the estimate is
    that figure."""
    model, batch = MixedLlama(), next(iter(batches(0)))
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    plain, memopt = (estimate(model, batch, "fit", strategy=strategy, **o).memopt for o in ({"enabled": False}, {}))
    launches = [_launch(tmp_path / str(i), {"plain": None, "memopt": {}}, "mixed_llama")[0] for i in range(2)]
    for rank in (rank for ranks in launches for rank in ranks):
        assert rank["plain"]["peaks"][1:] == [plain.bytes] * 2, (rank["plain"]["peaks"], plain.bytes)
        assert rank["memopt"]["peaks"][1:] == [memopt.bytes] * 2, (rank["memopt"]["peaks"], memopt.bytes)
        assert rank["memopt"]["baseline"] == plain.bytes and rank["memopt"]["losses"] == rank["plain"]["losses"]
