"""Values a step reads out of its tensors do not end a dry run: placeholders before any real step, the real step's
values replayed after it, and the figures known and equal to an exact count of the real step."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_memopt import MemOpt, PeakMemory
from lightning_memopt.compat import FAKE_RULES
from lightning_memopt.dryrun import Sandbox
from lightning_memopt.engine.step import StepContext, dry_run_step
from lightning_memopt.memory import CPUPeakTracker
from lightning_memopt.reads import PLACEHOLDERS, Recorder, Replay
from tests.helpers import Wrapped, trainer


class ItemGuard(Wrapped):
    """`.item()` in the step: a guard and a float kept for a progress print."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if loss.item() > 1e6:
            raise RuntimeError("diverged")
        self.last = float(loss)
        return loss


class Masked(Wrapped):
    """A loss over the positions a boolean mask keeps: the mask's size depends on the data."""

    def training_step(self, batch, batch_idx):
        logits = self.case.forward(self.net, batch)
        ids = batch["ids"]
        valid = ids % 3 != 0
        return F.cross_entropy(logits[:-1][valid[1:]], ids[1:][valid[1:]])


class Routed(nn.Module):
    """A top-1 mixture of experts: each expert runs on the tokens routed to it (`nonzero`, counts read with
    `.tolist()`), as MoE layers do."""

    def __init__(self, width: int = 16, experts: int = 4, hidden: int = 64) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)) for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        counts = torch.bincount(choice, minlength=len(self.experts)).tolist()
        for index, expert in enumerate(self.experts):
            if counts[index] == 0:
                continue
            (rows,) = torch.nonzero(choice == index, as_tuple=True)
            out = out.index_add(0, rows, expert(x[rows]))
        return out


def test_placeholders_stand_in_for_every_kind_of_read() -> None:
    net = nn.Linear(4, 4)
    with Sandbox(net) as box:
        y = net(box.fake(torch.ones(3, 4)))
        values = (y[0, 0].item(), int(y[0, 0]), bool(y[0, 0] > 0), y.tolist())
        array = y.detach().numpy()
        shapes = (y.nonzero().shape, y[y > 0].shape, torch.unique(y).shape, torch.bincount(y.long()[0].abs()).shape)
        reads = box.reads
    assert values == (0.0, 0, False, [[0.0] * 4] * 3)
    assert isinstance(array, np.ndarray) and array.shape == (3, 4) and not array.any()
    assert shapes == ((12, 2), (12,), (12,), (2,))  # upper bounds: every element set (bincount of ones)
    assert dict(reads.placeholders) == {
        "aten._local_scalar_dense.default": 3 + 12,
        "Tensor.numpy": 1,
        "aten.nonzero.default": 1,
        "aten.index.Tensor": 1,
        "aten._unique2.default": 1,
        "aten.bincount.default": 1,
    }
    assert reads.replayed == 0
    assert PLACEHOLDERS in reads.note()


def test_a_real_steps_reads_replay_in_order_in_a_dry_run() -> None:
    moe = Routed()
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(0))
    with Recorder() as recorder, CPUPeakTracker() as real:
        real.add([*moe.parameters(), x])
        expected = moe(x)
    with Sandbox(moe, reads=Replay(recorder.recorded)) as box, CPUPeakTracker() as dry:
        dry.add([*box.parameters(), box.fake(x)])
        out = moe(box.fake(x))
        replay = box.reads
    assert out.shape == expected.shape and replay.replayed > 0 and not replay.placeholders
    assert dry.peak == real.peak  # every expert ran on the tokens the real step routed to it


def test_reads_in_a_checkpointed_recomputation_are_not_recorded() -> None:
    block = Routed()
    x = torch.randn(6, 16, requires_grad=True)
    with Recorder() as plain:
        block(x).sum().backward()
    with Recorder() as checkpointed:
        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum().backward()
    assert dict(checkpointed.recorded) == dict(plain.recorded)


@pytest.mark.parametrize("kind", [ItemGuard, Masked])
def test_a_fit_step_that_reads_values_gets_a_baseline_equal_to_the_real_plain_step(kind) -> None:
    case = "llama" if kind is Masked else "torch_encoder"
    memopt, model = MemOpt(), kind(case)
    trainer(memopt).fit(model)
    peaks = PeakMemory()
    trainer(peaks).fit(kind(case))
    report = memopt.report
    assert report.baseline_peak_bytes == peaks.peaks[1] > report.peak_bytes
    assert any("replays" in n for n in report.notes) and not any(PLACEHOLDERS in n for n in report.notes)


class SeededSampler(Wrapped):
    """A seed read from the batch, as a reproducible sampler takes it."""

    def predict_step(self, batch, batch_idx):
        generator = torch.Generator().manual_seed(int(batch["seed"][0]))
        noise = torch.randn(batch["x"].shape, generator=generator)
        return self.case.forward(self.net, {**batch, "x": batch["x"] + noise})


def test_a_seed_from_the_batch_does_not_stop_choosing_chunks() -> None:
    model = SeededSampler("latte")
    sample = model.case.sample
    model.case = dataclasses.replace(
        model.case, sample=lambda g: {**sample(g), "seed": torch.randint(0, 99, (), generator=g)}
    )
    plain = trainer().predict(copy.deepcopy(model))
    memopt = MemOpt()
    outputs = trainer(memopt).predict(model)
    report = memopt.report
    assert report.baseline_peak_bytes is not None and report.peak_bytes < report.baseline_peak_bytes
    assert "off" not in report.chunk_settings and "could not" not in " ".join(report.notes)
    for a, b in zip(plain, outputs, strict=True):
        torch.testing.assert_close(a, b)


def test_grouped_mm_in_fp32_has_a_fake_rule_equal_to_the_real_op() -> None:
    a, b = torch.randn(12, 8), torch.randn(3, 8, 4)
    offs = torch.tensor([4, 8, 12], dtype=torch.int32)
    real = torch._grouped_mm(a, b, offs)
    with Sandbox(nn.Identity()) as box, CPUPeakTracker() as tracker:
        fake = torch._grouped_mm(box.fake(a), box.fake(b), box.fake(offs))
    assert (fake.shape, fake.dtype) == (real.shape, real.dtype)
    assert tracker.peak == real.untyped_storage().nbytes() and torch.ops.aten._grouped_mm.default in FAKE_RULES


def test_dry_run_step_counts_placeholders_and_replays() -> None:
    model = ItemGuard("torch_encoder")
    pl_trainer = trainer()
    pl_trainer.fit(model)
    batch = next(iter(model.train_dataloader()))
    dry = dry_run_step(StepContext.of(pl_trainer, "fit"), model, batch, 0, "fit")
    assert dry.peak_bytes is not None and dry.placeholders == 2 and dry.replayed == 0


class RoutedHead(Wrapped):
    """A sampler whose output goes through a mixture of experts: how much the experts hold depends on the routing."""

    def __init__(self) -> None:
        super().__init__("latte")
        self.moe = Routed(width=8, experts=2, hidden=2048)

    def predict_step(self, batch, batch_idx):
        out = self.case.forward(self.net, batch)
        return self.moe(out.reshape(-1, 8))


def test_settings_chosen_on_placeholders_are_chosen_again_when_the_real_step_disagrees() -> None:
    memopt, peaks = MemOpt(), PeakMemory()
    outputs = trainer(memopt).predict(RoutedHead())
    plain = trainer(peaks).predict(RoutedHead())
    report = memopt.report
    assert any("chosen again" in n for n in report.notes)
    assert report.baseline_peak_bytes == peaks.peaks[0]  # replayed after the real step: exact
    for a, b in zip(plain, outputs, strict=True):
        torch.testing.assert_close(a, b)


class RoutedEncoder(Wrapped):
    """Training through a mixture of experts after the encoder: what the experts hold depends on the routing."""

    def __init__(self) -> None:
        super().__init__("torch_encoder")
        self.moe = Routed(width=32, experts=2, hidden=4096)

    def training_step(self, batch, batch_idx):
        return self.moe(self.net(batch["x"]).reshape(-1, 32)).pow(2).mean()


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_a_checkpoint_count_chosen_on_placeholders_is_chosen_again_when_the_real_step_disagrees() -> None:
    plain = PeakMemory()
    trainer(plain).fit(RoutedEncoder())
    memopt = MemOpt(checkpointing="auto", memory_budget=plain.peaks[1] - 1)
    trainer(memopt).fit(RoutedEncoder())
    report = memopt.report
    assert any("chosen again" in n for n in report.notes)
    assert report.baseline_peak_bytes == plain.peaks[1]  # replayed after the real step: exact
