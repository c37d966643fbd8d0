"""Steps that log, gather and step optimizers by hand, as Lightning's docs show: every form of each call is dry-run
exactly (the baseline figure equals the plain step's real peak), the logged values equal a plain run's, and a plan
is made under a budget. The stand-ins bind Lightning's own signatures, so a form that Lightning accepts cannot fail
in a dry run; the suite runs with ``LIGHTNING_MEMOPT_STRICT=1`` (conftest), so one that did would fail its test."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.data import DataLoader

from lightning_memopt import MemOpt, PeakMemory, estimate
from lightning_memopt.engine import step as step_module
from tests.corpus import MemoryLogger
from tests.helpers import TRAINER_ARGS, Synthetic, Wrapped

Log = Callable[[pl.LightningModule, torch.Tensor, str], None]

#: Each form of a logging call: what Lightning's docs and users write. ``v`` is a scalar read from the batch, logged
#: before the forward pass, so that what Lightning keeps of it is alive at the step's peak.
FORMS: dict[str, Log] = {
    "keywords": lambda m, v, k: m.log(k + "v", v, on_step=True, on_epoch=True),
    "positional": lambda m, v, k: m.log(k + "v", v, False, None, True, True),
    "every_option": lambda m, v, k: m.log(
        k,
        v,
        prog_bar=True,
        logger=True,
        on_step=True,
        on_epoch=True,
        reduce_fx="max",
        enable_graph=False,
        sync_dist=True,
        sync_dist_group=None,
        add_dataloader_idx=False,
        batch_size=4,
        metric_attribute=None,
        rank_zero_only=False,
    ),
    "on_epoch_sum": lambda m, v, k: m.log(k + "v", v, on_step=False, on_epoch=True, reduce_fx="sum"),
    "min": lambda m, v, k: m.log(k + "v", v, on_epoch=True, reduce_fx=torch.min),
    "number": lambda m, v, k: m.log(k + "n", 3.5, on_step=True, on_epoch=True, batch_size=4),
    "half": lambda m, v, k: m.log(k + "h", v.half(), on_step=True, on_epoch=True),
    "log_dict": lambda m, v, k: m.log_dict({k + "a": v, k + "b": v * 2}, True, None, True, True, "min", batch_size=4),
    "log_dict_keywords": lambda m, v, k: m.log_dict({k: v}, prog_bar=True, on_step=True, on_epoch=True, sync_dist=True),
    "metric": lambda m, v, k: (m.mean(v), m.log(k, m.mean, on_step=True, on_epoch=True)),
    "metric_keywords": lambda m, v, k: (m.mean2.update(v), m.log(name=k, value=m.mean2, on_epoch=True)),
    "all_gather": lambda m, v, k: m.log(k + "g", _same_shape(m.all_gather(v, sync_grads=False), v), on_step=True),
}


def _same_shape(gathered: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """On one process Lightning's ``all_gather`` gives the tensor back as it is; a stand-in that stacked it broke
    user code that relies on the shape."""
    if gathered.shape != value.shape:
        raise AssertionError(f"all_gather on one process gave shape {tuple(gathered.shape)}, not {tuple(value.shape)}")
    return gathered


class Logs(Wrapped):
    """The plain torch encoder of the core cases, its step logging in the given forms, in training and validation."""

    def __init__(self, *forms: str) -> None:
        super().__init__("torch_encoder")
        import torchmetrics

        self.forms = forms
        self.mean, self.mean2 = torchmetrics.MeanMetric(), torchmetrics.MeanMetric()
        self.val_mean = torchmetrics.MeanMetric()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        value = batch["x"].mean()
        for form in self.forms:
            FORMS[form](self, value, form)
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        out = self.case.forward(self.net, batch)
        self.val_mean.update(out.pow(2).mean())
        self.log("val_mean", self.val_mean, on_epoch=True, prog_bar=True)
        self.log_dict({"val_abs": out.abs().mean()}, on_step=False, on_epoch=True, batch_size=len(out))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Synthetic(self.case.sample, 4), batch_size=2)


def _fit(model: pl.LightningModule, *callbacks: pl.Callback, **kwargs: Any) -> MemoryLogger:
    logger = MemoryLogger()
    args = {**TRAINER_ARGS, "limit_train_batches": 3, "limit_val_batches": 1, "num_sanity_val_steps": 0}
    pl.Trainer(**{**args, "logger": logger, "log_every_n_steps": 1, **kwargs}, callbacks=list(callbacks)).fit(model)
    return logger


def _assert_exact_and_unchanged(*forms: str) -> MemOpt:
    """A fit with MemOpt logs a baseline figure equal to the plain step's real peak, and the same user values."""
    probe = PeakMemory()
    plain = _fit(Logs(*forms), probe)
    memopt = MemOpt()
    ours = _fit(Logs(*forms), memopt)
    report = memopt.reports["fit"]
    assert report.baseline_peak_bytes == probe.peaks[report.batch_idx], report.notes
    assert not [n for n in report.notes if "dry run failed" in n], report.notes
    logged = ours.values("memopt/")
    assert {"memopt/baseline_peak_bytes", "memopt/saved_bytes", "memopt/saved_fraction"} <= logged.keys()
    assert report.saved_bytes is not None and report.saved_bytes > 0
    validate = memopt.reports.get("validate")
    assert validate is None or validate.baseline_peak_bytes is not None, validate and validate.notes
    assert ours.user_values().keys() == plain.user_values().keys()
    for key, values in ours.user_values().items():
        assert values == pytest.approx(plain.user_values()[key], rel=1e-6), key
    return memopt


def test_every_form_of_logging_at_once_is_dry_run_exactly_with_the_same_logged_values() -> None:
    memopt = _assert_exact_and_unchanged(*FORMS)
    assert memopt.reports["fit"].applied  # checkpointing planned from the dry run


@pytest.mark.slow  # each form alone: the default run has them all in one step above
@pytest.mark.parametrize("form", list(FORMS))
def test_each_form_of_logging_alone_is_dry_run_exactly(form: str) -> None:
    _assert_exact_and_unchanged(form)


def _batch() -> dict[str, torch.Tensor]:
    model = Logs()
    return torch.utils.data.default_collate([model.case.sample(torch.Generator().manual_seed(i)) for i in (4, 5)])


@pytest.mark.slow  # three estimates and two fits; the default run plans the same module without a budget above
def test_a_module_that_logs_on_step_plans_under_a_budget_and_its_estimate_is_the_real_peak() -> None:
    """``estimate()`` of the logging step equals its real peak; under a budget between the checkpointed and the plain
    peak the planner meets it with a plan of its own (not every block checkpointed, the fallback)."""
    everything = estimate(Logs(*FORMS), _batch(), checkpointing=True)
    assert everything.plain.bytes is not None and everything.memopt.bytes is not None, everything.notes
    probe = PeakMemory()
    _fit(Logs(*FORMS), probe, limit_val_batches=0)
    assert everything.plain.bytes == probe.peaks[1]  # batch 1: a later step's optimizer state, as the estimate's
    budget = (everything.memopt.bytes + everything.plain.bytes) // 2
    planned = estimate(Logs(*FORMS), _batch(), memory_budget=budget, checkpointing="auto")
    assert planned.memopt.bytes is not None and planned.memopt.bytes <= budget, planned.notes
    assert not [n for n in planned.notes if "could not" in n or "failed" in n], planned.notes
    memopt, probe = MemOpt(memory_budget=budget, checkpointing="auto"), PeakMemory()
    _fit(Logs(*FORMS), memopt, probe, limit_val_batches=0)
    # the metric's update read values, so MemOpt recorded the real step's reads while PeakMemory's probe, started
    # after it, ran: each left its own mode (MemOpt's recorder popped PeakMemory's probe and left itself behind)
    assert _get_current_dispatch_mode_stack() == []
    report = memopt.reports["fit"]
    assert report.peak_bytes == probe.peaks[report.batch_idx] <= budget
    assert report.planned_peak_bytes is not None and report.planned_peak_bytes <= budget, report.notes  # planned


class ManualSteps(Wrapped):
    """Manual optimization with each of Lightning's helpers, in positional and keyword forms."""

    def __init__(self) -> None:
        super().__init__("torch_encoder")
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers(use_pl_optimizer=True)
        scheduler = self.lr_schedulers()
        self.toggle_optimizer(opt)
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss, retain_graph=False)
        self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad(set_to_none=True)
        self.untoggle_optimizer(optimizer=opt)
        with self.toggled_optimizer(opt):
            pass
        scheduler.step()
        self.print("step", batch_idx, sep=" ")
        self.log_dict(self.all_gather({"loss": loss.detach()}), on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1)]


def test_manual_optimization_helpers_in_every_form_are_dry_run() -> None:
    probe = PeakMemory()
    plain = _fit(ManualSteps(), probe)
    memopt = MemOpt()
    ours = _fit(ManualSteps(), memopt)
    report = memopt.reports["fit"]
    assert report.baseline_peak_bytes == probe.peaks[report.batch_idx], report.notes
    assert ours.user_values().keys() == plain.user_values().keys() != set()
    for key, values in ours.user_values().items():
        assert values == pytest.approx(plain.user_values()[key], rel=1e-6), key


def test_a_stand_in_that_fails_fails_the_test_in_strict_mode_and_is_noted_otherwise(monkeypatch) -> None:
    """A failure inside MemOpt's own stand-in is a bug of MemOpt's: with ``LIGHTNING_MEMOPT_STRICT=1`` the dry run
    raises it; without, it is a note that names the stand-in, and the run goes on."""

    def broken(*args: Any, **kwargs: Any) -> None:
        raise KeyError("a stand-in's own mistake")

    monkeypatch.setattr(step_module, "_log", broken)
    with pytest.raises(step_module.StandInError, match=r"stand-in for self.log\(\) failed: KeyError"):
        estimate(Logs("keywords"), _batch())
    monkeypatch.setenv("LIGHTNING_MEMOPT_STRICT", "0")
    result = estimate(Logs("keywords"), _batch())
    assert result.plain.bytes is None
    assert any("stand-in for self.log() failed" in n for n in result.notes), result.notes


#: Calls Lightning refuses: a misspelt option (the call's own TypeError), a value logged neither on step nor on
#: epoch and an unknown reduction (Lightning's MisconfigurationException), a tensor of two elements (its ValueError).
REFUSED = {
    "misspelt": (lambda m, v: m.log("v", v, on_stpe=True), "TypeError", "on_stpe"),
    "neither": (lambda m, v: m.log("v", v, on_step=False, on_epoch=False), "MisconfigurationException", "not useful"),
    "reduction": (lambda m, v: m.log("v", v, reduce_fx="median"), "MisconfigurationException", "reduce_fx"),
    "two_elements": (lambda m, v: m.log("v", v.expand(2)), "ValueError", "single element"),
}


@pytest.mark.parametrize("call", list(REFUSED))
def test_a_call_lightning_refuses_is_the_users_error_not_a_stand_ins(call: str) -> None:
    """A call Lightning refuses fails the dry run as it fails the real step, even in strict mode: the note names
    Lightning's error, not MemOpt's stand-in (Lightning's own checks raised inside the stand-in were MemOpt's)."""
    refused, error, words = REFUSED[call]

    class Refused(Logs):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            refused(self, batch["x"].mean())
            return super().training_step(batch, batch_idx)

    result = estimate(Refused(), _batch())
    assert result.plain.bytes is None
    assert any(error in n and words in n and "stand-in" not in n for n in result.notes), result.notes
