"""Dry runs on fake tensors: the same peak as the real step, to the byte, for every test model at fit and at predict;
nothing of the user's model, batch, optimizer or random state touched; a step that cannot be traced gives a note."""

from __future__ import annotations

import random

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn

from lightning_memopt.compat import FakeTensor, _get_current_dispatch_mode_stack
from lightning_memopt.dryrun import DryRunError, Sandbox, failure_note
from lightning_memopt.engine.measure import live_tensors
from lightning_memopt.engine.step import StepContext, dry_run_step
from lightning_memopt.memory import CPUPeakTracker, probe_for
from tests.helpers import CASES, Wrapped, heavy, trainer

GENERATOR = np.random.default_rng(7)  # a module-level generator, as a script might hold one


class DryThenReal(pl.Callback):
    """On batch ``index``: a dry run of the step, then the real step under exact accounting."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.pairs: list[tuple[int | None, int, str | None]] = []
        self._dry = None
        self._probe = None

    def _start(self, trainer, pl_module, batch, batch_idx, stage) -> None:
        if batch_idx == self.index:
            self._dry = dry_run_step(StepContext.of(trainer, stage), pl_module, batch, batch_idx, stage)
            self._probe = probe_for(pl_module.device)
            self._probe.start(live_tensors(trainer, pl_module, batch))

    def _stop(self) -> None:
        if self._probe is not None:
            self.pairs.append((self._dry.peak_bytes, self._probe.stop()[0], self._dry.note))
            self._probe = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start(trainer, pl_module, batch, batch_idx, "fit")

    def on_after_backward(self, trainer, pl_module):
        self._stop()

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._start(trainer, pl_module, batch, batch_idx, "predict")

    def on_predict_batch_end(self, *args):
        self._stop()


#: The heavier cases, in CI's slow run: the default run keeps one of each library and each kind of block.
SLOW = ("svd_unet", "unet2d_condition_lora", "unet2d_condition", "deep_encoder", "flux", "wan", "llama_long")


@pytest.mark.parametrize("case", heavy(sorted(CASES), *SLOW))
def test_dry_run_peak_equals_the_real_step_to_the_byte(case: str) -> None:
    """At fit on the second batch (last step's gradients alive until zero_grad) and at predict on the first."""
    fit, predict = DryThenReal(1), DryThenReal(0)
    model = Wrapped(case)
    trainer(fit, batches=2).fit(model)
    trainer(predict, batches=1).predict(model)
    assert len(fit.pairs) == len(predict.pairs) == 1
    for dry, real, note in fit.pairs + predict.pairs:
        assert note is None and dry == real > 0


def test_dry_run_of_a_checkpointed_step_equals_the_real_one() -> None:
    model = Wrapped("unet2d")
    model.net.enable_gradient_checkpointing()
    probe = DryThenReal(1)
    trainer(probe, batches=2).fit(model)
    plain = DryThenReal(1)
    trainer(plain, batches=2).fit(Wrapped("unet2d"))
    (dry, real, _), (plain_dry, _, _) = probe.pairs[0], plain.pairs[0]
    assert dry == real < plain_dry


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_sandbox_leaves_weights_buffers_attributes_and_random_states_as_they_were() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model.generator = torch.Generator().manual_seed(3)
    model.numpy_rng = np.random.default_rng(5)
    model.counter = 0
    before = _state(model)
    states = (
        model.generator.get_state(),
        model.numpy_rng.bit_generator.state,
        GENERATOR.bit_generator.state,
        torch.get_rng_state(),
        random.getstate(),
        np.random.get_state()[1].copy(),
    )

    def step(x):
        noise = torch.randn(x.shape, generator=model.generator)
        model.numpy_rng.normal(size=3), GENERATOR.normal(size=3), random.random(), np.random.rand()
        model.counter += 1
        model.cache = x
        return model(x + noise).sum()

    step.__globals__["GENERATOR"] = GENERATOR
    params = [id(p) for p in model.parameters()]
    with Sandbox(model, functions=[step]) as box:
        loss = step(box.fake(torch.randn(8, 4)))
        loss.backward()
    assert [id(p) for p in model.parameters()] == params and all(p.grad is None for p in model.parameters())
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name  # BatchNorm's running statistics did not move
    assert model.counter == 0 and not hasattr(model, "cache")
    assert torch.equal(model.generator.get_state(), states[0])
    assert model.numpy_rng.bit_generator.state == states[1] and GENERATOR.bit_generator.state == states[2]
    assert torch.equal(torch.get_rng_state(), states[3]) and random.getstate() == states[4]
    assert (np.random.get_state()[1] == states[5]).all()
    assert _get_current_dispatch_mode_stack() == []


def test_a_sandbox_refuses_to_write_into_a_real_tensor() -> None:
    outside = torch.zeros(3)
    with pytest.raises(DryRunError, match="would write into a real tensor"), Sandbox(nn.Linear(2, 2)):
        outside.add_(1)
    assert torch.equal(outside, torch.zeros(3)) and _get_current_dispatch_mode_stack() == []


def test_real_constants_outside_the_model_keep_their_values() -> None:
    """A sampling loop over a scheduler's timestep table branches on real values: they stay real."""
    table = torch.tensor([999, 500, 10])
    model = nn.Linear(2, 2)
    with Sandbox(model) as box:
        seen = [bool(t - 20 >= 0) for t in table]
        out = model(box.fake(torch.zeros(1, 2))) * table[0]
    assert seen == [True, True, False] and out.shape == (1, 2)


class ItemInStep(Wrapped):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses_seen = getattr(self, "losses_seen", []) + [loss.item()]
        return loss


def test_a_step_that_reads_a_value_is_dry_run_with_a_placeholder() -> None:
    model = ItemInStep("torch_encoder")
    probe = DryThenReal(0)
    trainer(probe, batches=1).fit(model)
    ((dry, real, note),) = probe.pairs
    assert note is None and dry == real > 0  # `.item()` got a placeholder: the memory is the same
    assert len(model.losses_seen) == 1  # the real step ran once; the dry run's attribute was put back


def test_an_op_without_a_fake_implementation_gives_a_note_naming_it() -> None:
    @torch.library.custom_op("memopt_test::opaque", mutates_args=())
    def opaque(x: torch.Tensor) -> torch.Tensor:  # no fake rule registered
        return x.clone()

    with Sandbox(nn.Identity()) as box, pytest.raises(Exception) as error:
        opaque(box.fake(torch.zeros(2)))
    assert "memopt_test.opaque" in failure_note(error.value) or "memopt_test::opaque" in failure_note(error.value)


def test_the_tracker_counts_fake_tensors_like_real_ones() -> None:
    real = torch.zeros(10)
    with Sandbox(nn.Identity()) as box, CPUPeakTracker() as tracker:
        x = torch.empty(100)  # 400 bytes, fake: no memory
        y = box.fake(real) * 2  # 40
        del x
    assert (tracker.peak, tracker.current) == (440, 40) and type(y).__name__ == "FakeTensor"


def test_positions_are_real_and_a_large_product_of_real_tensors_is_fake() -> None:
    """A row of 131,072 positions is made for real (code reads it, as transformers does to find packed sequences);
    a mask built from it for every pair of positions would be 16 GiB here, and is made fake instead."""
    with Sandbox(nn.Identity()):
        positions = torch.arange(131_072)
        mask = positions[:, None] >= positions[None, :]
        small = torch.arange(8)[:, None] >= torch.arange(8)[None, :]
        assert not isinstance(positions, FakeTensor) and bool((positions.diff() == 1).all())
        assert isinstance(mask, FakeTensor) and mask.shape == (131_072, 131_072)
        assert not isinstance(small, FakeTensor) and int(small.sum()) == 36
