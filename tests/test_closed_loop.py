"""The closed loop (issue 46, item 1): a step that takes memory its dry run cannot see (as cuBLAS's and cuDNN's
workspaces on a GPU) is noticed on the first batch it runs, charged to the plan, and the settings are chosen again, so
that the budget holds from the second batch; results stay plain's, and the report says what the step took beyond its
dry run. The peaks are read by the tests' own meter (tests/test_meter.py), not MemOpt's."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.data import DataLoader

from lightning_memopt import MemOpt, estimate, timing
from tests.helpers import TRAINER_ARGS
from tests.test_meter import Metered

pytestmark = pytest.mark.slow  # five-step fits planned by dry runs, 90 s: run by CI with -m slow

WIDTH, SEQUENCE, BATCH = 64, 64, 4


class Workspace(torch.autograd.Function):
    """The identity; its backward pass takes scratch memory a fake tensor never holds, as a GPU kernel's workspace."""

    nbytes = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if not isinstance(grad, FakeTensor) and Workspace.nbytes:
            scratch = torch.empty(Workspace.nbytes, dtype=torch.uint8)
            scratch.fill_(0)  # taken and given back within the call
            del scratch
        return grad


class Layer(nn.TransformerEncoderLayer):
    def forward(self, src: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return Workspace.apply(super().forward(src, *args, **kwargs))


class Encoder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layer = Layer(WIDTH, nhead=4, dim_feedforward=4 * WIDTH, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
        self.batch = torch.randn(BATCH, SEQUENCE, WIDTH)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.encoder(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        torch.manual_seed(1)
        return DataLoader(torch.randn(5 * BATCH, SEQUENCE, WIDTH), batch_size=BATCH)


def fit(memopt: MemOpt | None, model: Encoder | None = None) -> tuple[Encoder, Metered, list[float]]:
    model, meter = model or Encoder(), Metered()
    losses: list[float] = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
            losses.append(float(outputs["loss"]))

    callbacks = [c for c in (memopt, meter, Losses()) if c is not None]
    pl.Trainer(**TRAINER_ARGS, max_steps=5, callbacks=callbacks).fit(model)
    return model, meter, losses


@pytest.fixture
def workspace(monkeypatch) -> int:
    """A budget halfway between the peak with every layer checkpointed and without MemOpt, and a workspace of half
    that gap: the plan for the budget alone runs over it once the workspace is taken, a finer one does not."""
    model = Encoder()
    plain = estimate(model, model.batch, stage="fit", checkpointing=False).plain.bytes
    finest = estimate(model, model.batch, stage="fit", checkpointing=True).memopt.bytes
    monkeypatch.setattr(Workspace, "nbytes", (plain - finest) // 2)
    return finest + (plain - finest) // 2


def test_a_step_taking_memory_its_dry_run_cannot_see_meets_the_budget_from_the_second_batch(workspace) -> None:
    budget = workspace
    memopt = MemOpt(checkpointing="auto", memory_budget=budget)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model, meter, losses = fit(memopt)
    plain_model, plain_meter, plain_losses = fit(None)
    assert all(peak <= budget for peak in meter.peaks[1:]), (meter.peaks, budget)
    assert max(plain_meter.peaks[1:]) > budget  # the budget needs MemOpt
    report = memopt.report
    assert report.unseen_bytes is not None and 0 < report.unseen_bytes <= Workspace.nbytes
    assert any("more than its dry run" in note and "chosen again" in note for note in report.notes)
    # where: the workspace is taken in the backward pass, which is where the step that took it peaked
    assert report.unseen_where == "the backward pass"
    assert any("its peak in the backward pass" in note for note in report.notes)
    assert report.peak_bytes <= budget and report.metrics()["memopt/unseen_bytes"] == report.unseen_bytes
    assert not [w for w in said if "over the budget" in str(w.message)]
    assert losses == plain_losses  # results unchanged
    for mine, theirs in zip(model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    # what the step took beyond the dry runs is kept for the next run of this model on these shapes (and of no other),
    # which plans for it from its first batch and says so
    assert list(timing._UNSEEN.values()) == [report.unseen_bytes] and timing.unseen_bytes("cpu") == 0
    again = MemOpt(checkpointing="auto", memory_budget=budget)
    _, meter, _ = fit(again)
    assert all(peak <= budget for peak in meter.peaks), (meter.peaks, budget)
    assert not [note for note in again.report.notes if "chosen again" in note]
    assert any("planned for the budget less" in note and "this model" in note for note in again.report.notes)


def test_what_one_models_step_took_beyond_its_dry_run_is_not_charged_to_another(workspace, monkeypatch) -> None:
    """The bytes were kept per device: one model's workspace was charged to every later plan of any model on it."""
    fit(MemOpt(checkpointing="auto", memory_budget=workspace))
    assert sum(timing._UNSEEN.values()) > 0  # charged to the encoder
    monkeypatch.setattr(Workspace, "nbytes", 0)
    other = Encoder()
    other.encoder.layers = other.encoder.layers[:3]  # another model
    other.encoder.num_layers = 3
    memopt = MemOpt(checkpointing="auto", memory_budget=workspace)
    fit(memopt, other)
    assert not [note for note in memopt.report.notes if "planned for the budget less" in note], memopt.report.notes
    assert memopt.report.planned_peak_bytes == memopt.report.peak_bytes  # planned for the budget itself: exact


def test_without_scratch_the_loop_changes_nothing() -> None:
    """On CPU the dry run is exact: the first batch is set against it, nothing is charged, nothing planned again."""
    model = Encoder()
    plain = estimate(model, model.batch, stage="fit", checkpointing=False).plain.bytes
    finest = estimate(model, model.batch, stage="fit", checkpointing=True).memopt.bytes
    budget = finest + (plain - finest) // 2
    memopt = MemOpt(checkpointing="auto", memory_budget=budget)
    _, meter, _ = fit(memopt)
    assert memopt.report.unseen_bytes == 0 and memopt.report.planned_peak_bytes == memopt.report.peak_bytes
    assert all(peak <= budget for peak in meter.peaks)
    assert timing.unseen_bytes("cpu") == 0
