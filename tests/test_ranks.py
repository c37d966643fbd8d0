"""One rank of several, from one process: ``estimate(..., strategy=...)`` under FSDP2 and DDP on a fake process group
(nothing is launched or sent). The comparison with real ranks is in tests/test_fsdp2.py (slow: two processes)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

from lightning_memopt import estimate
from tests import zoo

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


class Sharded(pl.LightningModule):
    """A tiny Llama whose decoder layers and whole model ``configure_model`` shards with ``fully_shard``."""

    def __init__(self, shard: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = zoo.llama(layers=2, hidden=32, vocab_size=256)
        self.shard = shard

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if self.shard:
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


#: MemOpt with nothing on at fit: an estimate of the plain step alone
NOTHING = dict(checkpointing=False, chunked_loss=False, chunking=False, free_gradients=False)
BATCH = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))


def test_fsdp2_per_rank_holds_a_shard_of_the_weights_gradients_and_state_and_the_module_is_left_as_given() -> None:
    """Each rank holds 1/N of the weights, of a later step's gradients and of AdamW's two moments (every shape here
    divides by 2 and 4); the backward pass reaches the unsharded parameters FSDP2 gathers, so the checkpointed blocks
    are recomputed and the gradients reduce-scattered into the shards. The module given is not sharded."""
    module = Sharded()
    full = _bytes(module.parameters())
    for ranks in (4,):  # two ranks: against real ones, in tests/test_fsdp2.py
        result = estimate(module, BATCH, "fit", strategy=ModelParallelStrategy(ranks, 1))
        assert result.notes == [] and result.ranks == ranks and result.strategy == "ModelParallelStrategy"
        alive = result.plain.live  # from the step's start: the weights, a later step's gradients and AdamW's state
        assert alive["weights"] == full // ranks + _bytes(module.buffers())  # the rotary buffers: whole on each rank
        assert alive["gradients"] == full // ranks
        steps = 4 * len(list(module.parameters()))  # a float32 step count per parameter
        assert alive["optimizer"] == 2 * full // ranks + steps  # two moments
        assert result.recompute_flops and result.memopt.bytes < result.plain.bytes
        assert f"per rank of {ranks} under ModelParallelStrategy" in str(result)
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in module.parameters())
    assert not dist.is_initialized()


@pytest.mark.slow  # dry runs under FSDP2 with and without the step in the backward pass: 4 s
def test_the_optimizer_step_in_the_backward_pass_is_dry_run_under_fsdp2() -> None:
    module = Sharded()
    options = dict(strategy=ModelParallelStrategy(2, 1), checkpointing=False, chunked_loss=False, chunking=False)
    plain = estimate(module, BATCH, "fit", **options)
    stepped = estimate(module, BATCH, "fit", **options, optimizer_in_backward=True)
    assert "optimizer step in the backward pass" in stepped.how, stepped.notes
    # each sharded gradient is stepped and freed as FSDP2 reduce-scatters it: none is left for the step after
    assert stepped.memopt.phases["optimizer step"] < plain.memopt.phases["optimizer step"]


def test_ddp_per_rank_adds_its_buckets_a_copy_of_every_gradient() -> None:
    module = Sharded(shard=False)
    one = estimate(module, BATCH, "fit", **NOTHING)
    two = estimate(module, BATCH, "fit", strategy="ddp", devices=2, **NOTHING)
    views = estimate(module, BATCH, "fit", strategy=DDPStrategy(gradient_as_bucket_view=True), devices=2, **NOTHING)
    assert two.plain.live["buckets"] == _bytes(module.parameters())
    assert two.plain.bytes == one.plain.bytes + _bytes(module.parameters())
    assert views.plain.bytes == one.plain.bytes


@pytest.mark.parametrize(
    ("strategy", "devices", "error"),
    [
        ("ddp", None, r"`strategy='ddp'` needs `devices`"),
        (None, 2, r"`devices=2` needs a strategy for several ranks"),
        ("fsdp", 2, r"`strategy` must be None, 'ddp', a DDPStrategy or a ModelParallelStrategy, got 'fsdp'"),
        (FSDPStrategy(), 2, r"FSDPStrategy and DeepSpeedStrategy need a GPU in Lightning"),
        (ModelParallelStrategy(2, 1), 4, r"\(data_parallel_size=2, tensor_parallel_size=1\) needs 2 devices"),
        ("ddp", 0, r"`devices` must be a number of ranks, 1 or more, got 0"),
    ],
)
def test_a_strategy_estimate_cannot_stand_in_for_is_an_error_naming_it(strategy, devices, error) -> None:
    with pytest.raises(ValueError, match=error):
        estimate(Sharded(), BATCH, "fit", strategy=strategy, devices=devices)


def test_a_module_that_parallelizes_nothing_is_an_error_and_no_process_group_is_left() -> None:
    with pytest.raises(ValueError, match=r"Sharded.configure_model parallelized nothing under a device mesh of 2"):
        estimate(Sharded(shard=False), BATCH, "fit", strategy=ModelParallelStrategy(2, 1))
    assert not dist.is_initialized()


@pytest.mark.slow  # two FSDP2 estimates: 2 s
def test_a_module_on_the_meta_device_is_estimated_as_the_real_one_under_fsdp2() -> None:
    """A model of any size is built on the meta device: ``fully_shard`` shards it there, into meta DTensors."""
    options = dict(strategy=ModelParallelStrategy(4, 1), **NOTHING)
    with torch.device("meta"):
        meta = Sharded()
    assert estimate(meta, BATCH, "fit", **options).plain == estimate(Sharded(), BATCH, "fit", **options).plain


class WithData(Sharded):
    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(BATCH, batch_size=2)


@pytest.mark.slow  # the CLI's estimate under FSDP2: 4 s
def test_the_cli_estimate_takes_the_strategy_and_devices_from_the_config(tmp_path, capsys) -> None:
    import json

    from lightning_memopt.cli import main

    strategy = "{class_path: lightning.pytorch.strategies.ModelParallelStrategy, init_args: {data_parallel_size: 4}}"
    for name, trainer, expected in [
        ("fsdp2", f"{{strategy: {strategy}, devices: 4}}", dict(strategy=ModelParallelStrategy(4, 1))),
        ("ddp", "{strategy: ddp, devices: 2}", dict(strategy="ddp", devices=2)),
        ("auto", "{devices: 2}", dict(strategy="ddp", devices=2)),  # as the Trainer: "auto" on 2 devices is DDP
    ]:
        config = tmp_path / f"{name}.yaml"
        config.write_text(f"model:\n  class_path: tests.test_ranks.WithData\ntrainer: {trainer}\n")
        assert (
            main(["estimate", "--config", str(config), "--json", "true", *[f"--memopt.{k}=false" for k in NOTHING]])
            == 0
        )
        printed = json.loads(capsys.readouterr().out)
        direct = estimate(WithData(), BATCH, "fit", **expected, **NOTHING)
        assert (printed["ranks"], printed["plain"]["peak_bytes"]) == (direct.ranks, direct.plain.bytes), name
