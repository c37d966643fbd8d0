"""With MemOpt() and its defaults, ordinary user code gives the same results as without MemOpt: the measurement runs
no user step a second time. Each case here changed results or crashed when it did."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_memopt import MemOpt, PeakMemory
from lightning_memopt.compat import _get_current_dispatch_mode_stack
from lightning_memopt.memory import KINDS
from tests import zoo
from tests.helpers import TRAINER_ARGS, Wrapped, heavy, trainer


class UserCode(pl.LightningModule):
    """An encoder trained on {"x", "target"} batches; ``habit`` is what its steps do that a second run would repeat."""

    def __init__(self, habit: str, accumulate_loss: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.habit = habit
        self.encoder = zoo.torch_encoder()
        self.head = nn.utils.parametrizations.spectral_norm(nn.Linear(32, 32))  # _u, _v advance every training step
        self.generator = torch.Generator().manual_seed(1)
        self.rng = np.random.default_rng(2)
        self.seen = 0
        self.history: dict[str, list[torch.Tensor]] = {"outputs": []}  # Lightning's pattern for keeping outputs

    def _forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.habit == "pop":
            batch["y"] = batch.pop("target")
        elif self.habit == "assign":
            batch["x"] = batch["x"] * 2 + 1
        elif self.habit == "in_place":
            batch["x"].sub_(0.5).mul_(3)
        elif self.habit == "generator":
            batch["x"] = batch["x"] + torch.randn(batch["x"].shape, generator=self.generator)
        elif self.habit == "numpy":
            batch["x"] = batch["x"] + torch.from_numpy(self.rng.normal(size=batch["x"].shape)).float()
        self.seen += 1
        out = self.head(self.encoder(batch["x"]))
        if self.habit == "append":
            self.history["outputs"].append(out.detach())
        return out

    def training_step(self, batch, batch_idx):
        out = self._forward(batch)
        target = batch["y"] if self.habit == "pop" else batch["target"]
        return (out - target).pow(2).mean()

    def predict_step(self, batch, batch_idx):
        return self._forward(batch)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def _loader(self):
        g = torch.Generator().manual_seed(3)
        items = [{"x": torch.randn(16, 32, generator=g), "target": torch.randn(16, 32, generator=g)} for _ in range(8)]
        return torch.utils.data.DataLoader(items, batch_size=2)

    train_dataloader = predict_dataloader = _loader


HABITS = ["pop", "assign", "in_place", "generator", "numpy", "append"]


def fit_and_predict(habit: str, memopt: MemOpt | None, **trainer_args) -> tuple[UserCode, list[torch.Tensor]]:
    model = UserCode(habit)
    callbacks = [memopt] if memopt is not None else []
    args = {**TRAINER_ARGS, "limit_train_batches": 4, "limit_predict_batches": 3, **trainer_args}
    pl.Trainer(**args, callbacks=callbacks).fit(model)
    if memopt is not None:
        assert memopt.report is not None and memopt.report.baseline_peak_bytes is not None  # fit was measured
    outputs = pl.Trainer(**args, callbacks=callbacks).predict(model)
    return model, outputs


def assert_same(a: UserCode, b: UserCode, out_a: list[torch.Tensor], out_b: list[torch.Tensor]) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)  # weights, spectral norm's _u and _v
    for x, y in zip(out_a, out_b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert torch.equal(a.generator.get_state(), b.generator.get_state())
    assert a.rng.bit_generator.state == b.rng.bit_generator.state
    assert a.seen == b.seen == 4 + 3  # each step ran once
    assert len(a.history["outputs"]) == len(b.history["outputs"]) == (7 if a.habit == "append" else 0)
    for x, y in zip(a.history["outputs"], b.history["outputs"], strict=True):  # real tensors, none from a dry run
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("habit", heavy(HABITS, "pop", "generator", "numpy"))
def test_results_are_those_of_a_run_without_memopt(habit: str) -> None:
    plain, plain_out = fit_and_predict(habit, None)
    model, out = fit_and_predict(habit, MemOpt())
    assert_same(plain, model, plain_out, out)


def test_verify_with_gradient_accumulation_reports_no_false_difference() -> None:
    plain, plain_out = fit_and_predict("generator", None, accumulate_grad_batches=2)
    model, out = fit_and_predict("generator", MemOpt(verify=True), accumulate_grad_batches=2)
    assert_same(plain, model, plain_out, out)  # verify's own run is put back, generator included


class InterruptOnce(UserCode):
    def __init__(self, call: int) -> None:
        super().__init__("generator")
        self.call, self.calls = call, 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        if self.calls == self.call:
            raise KeyboardInterrupt
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("call", [1, 2], ids=["in the dry run", "in the measured step"])
def test_ctrl_c_leaves_no_tracker_behind(call: int) -> None:
    """The measured batch is batch 1: its dry run is the second call of training_step and the real step the third;
    batch 0 has no dry run (``call=1`` interrupts the real batch 0 before anything is measured)."""
    model = InterruptOnce(call=call + 1)
    with pytest.raises(SystemExit):  # Lightning turns Ctrl+C into a graceful exit
        pl.Trainer(**{**TRAINER_ARGS, "limit_train_batches": 4}, callbacks=[MemOpt()]).fit(model)
    assert _get_current_dispatch_mode_stack() == []
    assert all("forward" not in layer.__dict__ for layer in model.encoder.layers)  # restored


class Manual(Wrapped):
    def __init__(self) -> None:
        super().__init__("deep_encoder", samples=8)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        optimizer.step()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        pass  # the step returns nothing

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def logged(tmp_path: Path) -> dict[str, float]:
    (path,) = tmp_path.glob("**/metrics.csv")
    rows = list(csv.DictReader(path.open()))
    return {k: float(v) for row in rows for k, v in row.items() if k.startswith("memopt/") and v != ""}


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_manual_optimization_is_measured_to_the_byte_and_logged(tmp_path) -> None:
    plain, probe = Manual(), PeakMemory()
    trainer(probe, batches=3).fit(plain)
    memopt, model = MemOpt(), Manual()
    trainer_ = trainer(memopt, batches=3)
    trainer_.loggers = [CSVLogger(tmp_path)]
    trainer_.fit(model)
    report = memopt.report
    assert report.batch_idx == 1 and report.baseline_peak_bytes == probe.peaks[1]  # optimizer step included
    assert 0 < report.peak_bytes < report.baseline_peak_bytes
    metrics = logged(tmp_path)
    assert {"memopt/peak_bytes", "memopt/baseline_peak_bytes", "memopt/saved_fraction", "memopt/time_overhead"} <= set(
        metrics
    )
    for (name, a), b in zip(plain.state_dict().items(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)


def test_gradient_accumulation_baseline_equals_the_real_step() -> None:
    probe = PeakMemory()
    pl.Trainer(**{**TRAINER_ARGS, "limit_train_batches": 4, "accumulate_grad_batches": 2}, callbacks=[probe]).fit(
        Wrapped("llama", samples=8)
    )
    memopt = MemOpt()
    pl.Trainer(**{**TRAINER_ARGS, "limit_train_batches": 4, "accumulate_grad_batches": 2}, callbacks=[memopt]).fit(
        Wrapped("llama", samples=8)
    )
    assert memopt.report.batch_idx == 2  # the first batch of the second optimizer step
    assert memopt.report.baseline_peak_bytes == probe.peaks[2]


@pytest.mark.parametrize("batches", [1, 3])
def test_short_predict_runs_log_every_figure(batches: int, tmp_path) -> None:
    plain = PeakMemory()
    trainer(plain, batches=batches).predict(Wrapped("latte", samples=2 * batches))
    memopt, probe = MemOpt(), PeakMemory()
    trainer_ = trainer(memopt, probe, batches=batches)
    trainer_.loggers = [CSVLogger(tmp_path)]
    trainer_.predict(Wrapped("latte", samples=2 * batches))
    metrics = logged(tmp_path)
    keys = {"peak_bytes", "baseline_peak_bytes", "saved_bytes", "saved_fraction", "step_time_s", "tuning_s"}
    keys |= {"baseline_step_time_s", "time_overhead"}  # chunked blocks timed alone when the loop ends
    keys |= {f"{run}peak_{kind}_bytes" for run in ("", "baseline_") for kind in KINDS}  # what held each peak
    keys |= {"predicted_step_s", "calibration_s"}  # the planner's time model, as at fit
    keys |= {"real_step_s", "prediction_error"} if batches > 1 else set()  # set against a later batch's time
    keys |= {"planned_peak_bytes", "unseen_bytes"}  # the plan's dry run, and what the real step took beyond it
    assert {f"memopt/{k}" for k in keys} | {"memopt/dry_run_s", "memopt/baseline_exact"} == set(metrics)
    assert metrics["memopt/planned_peak_bytes"] == metrics["memopt/peak_bytes"] and metrics["memopt/unseen_bytes"] == 0
    assert metrics["memopt/baseline_peak_bytes"] == plain.peaks[0]  # the dry run, exact
    assert metrics["memopt/peak_bytes"] == probe.peaks[0] < plain.peaks[0]  # chunked from the first batch on
    assert memopt.report.batch_idx == 0 and "measured on batch 0" in str(memopt.report)
