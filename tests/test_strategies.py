"""MemOpt under the strategies that own part of the step (issue 45, items 4 and 7): DeepSpeed (its engine steps the
optimizer; ZeRO partitions gradients, state and, at stage 3, parameters), FSDPStrategy (FSDP1: flat parameters) and
ModelParallelStrategy with fully_shard (FSDP2: DTensor parameters). A technique that cannot stay exact, or cannot work,
under one of them stands down with a warning naming the strategy and the setting.

FSDPStrategy and DeepSpeedStrategy need a GPU in Lightning: here the strategy objects are built and each technique's
``refuses`` is asked (DeepSpeedStrategy with the ``deepspeed`` module stubbed, which is all its constructor imports).
FSDP2 runs on two CPU processes (gloo), marked slow."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

from lightning_memopt.compat import strategy_refuses
from lightning_memopt.engine.step import StepContext
from lightning_memopt.techniques.free_gradients import FreeGradients
from lightning_memopt.techniques.state8bit import OptimizerState8bit
from lightning_memopt.techniques.stepping import OptimizerInBackward
from lightning_memopt.techniques.weights.technique import Weights8bit

TECHNIQUES = {
    "free_gradients": FreeGradients,
    "optimizer_in_backward": OptimizerInBackward,
    "optimizer_state_8bit": OptimizerState8bit,
    "weights_8bit": Weights8bit,
}


def deepspeed_strategy(monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> Any:
    """Lightning's DeepSpeedStrategy as its constructor builds it (its config from ``kwargs``), without deepspeed."""
    import lightning.pytorch.strategies.deepspeed as module

    stub = types.ModuleType("deepspeed")
    stub.utils = types.SimpleNamespace(logging=types.SimpleNamespace(logger=types.SimpleNamespace(setLevel=print)))
    monkeypatch.setitem(sys.modules, "deepspeed", stub)
    monkeypatch.setattr(module, "_DEEPSPEED_AVAILABLE", True)
    monkeypatch.setattr(module, "_DEEPSPEED_GREATER_EQUAL_0_16", True)
    return module.DeepSpeedStrategy(**kwargs)


def refusals(strategy: Any) -> dict[str, str | None]:
    """Each technique's ``refuses`` under ``strategy``."""
    return {name: cls.refuses(StepContext(strategy=strategy)) for name, cls in TECHNIQUES.items()}


@pytest.mark.parametrize("stage", [2, 3])
def test_under_deepspeed_the_optimizer_techniques_and_8_bit_weights_stand_down(monkeypatch, stage: int) -> None:
    strategy = deepspeed_strategy(monkeypatch, stage=stage)
    assert strategy.config["zero_optimization"]["stage"] == stage  # the real object, its config as Lightning makes it
    said = refusals(strategy)
    for name, why in said.items():
        assert why is not None and why.startswith(f"{name} left off under DeepSpeedStrategy: "), why
        assert why.endswith(f"pass {name}=False to silence this."), why
    assert "DeepSpeed owns the optimizer step" in said["optimizer_in_backward"]
    assert "ZeRO stage 3 partitions them" in said["weights_8bit"]


def test_under_fsdp1_free_gradients_stays_and_the_flat_parameters_keep_the_others_off() -> None:
    """Freeing the original parameters' gradients after the step is ``zero_grad(set_to_none=True)`` under FSDP1, which
    frees the flat gradient itself before the next forward pass: free_gradients stays."""
    for strategy in (FSDPStrategy(), FSDPStrategy(use_orig_params=False)):
        said = refusals(strategy)
        assert said["free_gradients"] is None
        for name in ("optimizer_in_backward", "optimizer_state_8bit", "weights_8bit"):
            assert said[name] is not None and said[name].startswith(f"{name} left off under FSDPStrategy: ")
        assert "reduce-scatters their gradients after the backward pass" in said["optimizer_in_backward"]


def test_a_subclass_is_named_by_its_own_name() -> None:
    class MyFSDP(FSDPStrategy):
        pass

    assert strategy_refuses("weights_8bit", MyFSDP()).startswith("weights_8bit left off under MyFSDP: FSDP keeps")
    assert strategy_refuses("chunked_loss", MyFSDP()) is None  # a technique on the model alone composes


def test_other_strategies_and_fsdp2_without_dtensors_refuse_nothing() -> None:
    module = Plain()
    parallel = ModelParallelStrategy()
    parallel.connect(module)  # configure_model did not shard it
    for strategy in (None, SingleDeviceStrategy("cpu"), DDPStrategy(), parallel):
        assert refusals(strategy) == dict.fromkeys(TECHNIQUES), strategy


class Plain(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))


def test_under_fsdp2_the_8_bit_techniques_stand_down_where_the_parameters_are_dtensors() -> None:
    """On a fake process group of 2 ranks: once fully_shard has made the parameters DTensors, the 8-bit state and
    weights stand down, naming ModelParallelStrategy; free_gradients and the step in the backward pass are left to
    their own checks."""
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        module = Plain()
        fully_shard(module.net)
        parallel = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        parallel.connect(module)
        said = refusals(parallel)
    finally:
        torch.distributed.destroy_process_group()
    assert said["free_gradients"] is None and said["optimizer_in_backward"] is None
    assert said["optimizer_state_8bit"].startswith(
        "optimizer_state_8bit left off under ModelParallelStrategy: the parameters are DTensor shards (fully_shard)"
    )
    assert said["weights_8bit"].startswith("weights_8bit left off under ModelParallelStrategy: the weights are DTensor")


FSDP2_SCRIPT = """
import os
import sys
import warnings
import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from lightning_memopt import MemOpt


class Encoder(pl.LightningModule):
    def __init__(self, frozen):
        super().__init__()
        layer = nn.TransformerEncoderLayer(64, 2, 128, dropout=0.0, batch_first=True)
        self.net = nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(64, 64))
        self.net[0].requires_grad_(not frozen)  # frozen: layers the 8-bit weights could store at fit

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        for block in self.net[0].layers:
            fully_shard(block, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=0.01)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(16, 24, 64, generator=torch.Generator().manual_seed(1)))
        return torch.utils.data.DataLoader(data, batch_size=2)


if __name__ == "__main__":
    use, frozen = sys.argv[1], sys.argv[2] == "frozen"
    options = {"state": {"optimizer_state_8bit": True}, "weights": {"weights_8bit": True}}.get(use)
    memopt = MemOpt(lossy=True, **options) if options else None
    torch.manual_seed(0)
    model = Encoder(frozen)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_epochs=1, limit_train_batches=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[memopt] if memopt else [],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    weights = [p.full_tensor().detach() for p in model.parameters()]  # every rank takes part in the all-gathers
    state = sorted({str(v.dtype) for s in trainer.optimizers[0].state.values() for k, v in s.items() if "exp" in k})
    if trainer.global_rank == 0:
        torch.save(weights, f"weights-{use}-{sys.argv[2]}.pt")
        said = [str(w.message) for w in caught if str(w.message).startswith("MemOpt")]
        applied = [a.technique for a in memopt.applied] if memopt else []
        print(repr({"said": said, "applied": applied, "state": state, "step": trainer.global_step}), flush=True)
    torch.distributed.destroy_process_group()  # or gloo's threads may abort the interpreter's shutdown
"""


def _fit_fsdp2(tmp_path: Path, use: str, frozen: str) -> dict[str, Any]:
    """One fit on two CPU processes under FSDP2; what rank 0 printed (its weights saved beside the script)."""
    script = tmp_path / "fsdp2_fit.py"
    script.write_text(textwrap.dedent(FSDP2_SCRIPT))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    args = [sys.executable, str(script), use, frozen]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("{")]
    return ast.literal_eval(line)


@pytest.mark.slow  # subprocesses
@pytest.mark.parametrize(
    ("use", "frozen", "setting"),
    [("state", "trained", "optimizer_state_8bit"), ("weights", "frozen", "weights_8bit")],
)
def test_under_fsdp2_the_8_bit_techniques_stand_down_and_training_goes_on_as_plain_fsdp2(
    tmp_path: Path, use: str, frozen: str, setting: str
) -> None:
    """bitsandbytes' quantization takes plain tensors, and fully_shard makes every parameter a DTensor shard: MemOpt
    says so, naming ModelParallelStrategy, and the fit's weights are plain FSDP2's, bit for bit (the moments stay in
    float32)."""
    plain = _fit_fsdp2(tmp_path, "none", frozen)
    tried = _fit_fsdp2(tmp_path, use, frozen)
    (warning,) = [w for w in tried["said"] if setting in w]
    assert warning.startswith(f"MemOpt: {setting} left off under ModelParallelStrategy: the "), warning
    assert "DTensor shards (fully_shard)" in warning and warning.endswith(f"pass {setting}=False to silence this.")
    assert setting not in tried["applied"] and {"checkpointing", "free_gradients"} <= set(tried["applied"])  # the rest
    assert tried["step"] == plain["step"] == 3 and tried["state"] == plain["state"] == ["torch.float32"]
    given = torch.load(tmp_path / f"weights-none-{frozen}.pt")
    for p, q in zip(given, torch.load(tmp_path / f"weights-{use}-{frozen}.pt"), strict=True):
        assert torch.equal(p, q)


class DeepSpeedStrategy(SingleDeviceStrategy):
    """Named as DeepSpeed's, on one CPU: what MemOpt reads of a strategy is its class names."""


@pytest.mark.parametrize(
    ("options", "warned"),
    [
        ({}, {"free_gradients"}),  # the "auto" ones cannot act without a budget (and lossy=True): no word of them
        ({"optimizer_in_backward": True}, {"free_gradients", "optimizer_in_backward"}),
        ({"memory_budget": 10**9, "lossy": True}, set(TECHNIQUES)),
    ],
)
def test_only_what_the_options_may_put_in_force_is_warned_of(options: dict, warned: set[str], recwarn) -> None:
    from lightning_memopt import MemOpt
    from tests.helpers import TRAINER_ARGS, Wrapped

    strategy = DeepSpeedStrategy(torch.device("cpu"))
    trainer = pl.Trainer(**{**TRAINER_ARGS, "max_steps": 1}, strategy=strategy, callbacks=[MemOpt(**options)])
    trainer.fit(Wrapped("llama"))
    messages = [str(w.message) for w in recwarn.list]
    said = {name for name in TECHNIQUES if any(f"{name} left off under DeepSpeedStrategy" in m for m in messages)}
    assert said == warned
