"""What MemOpt reports is what happened: a baseline no dry run can give is unknown (no saving is claimed), a closure
optimizer's step is dry-run as the optimizer runs it, and a fit resumed mid-epoch is measured."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_memopt import MemOpt, PeakMemory
from tests.helpers import TRAINER_ARGS, Batch, Wrapped, trainer


@torch.library.custom_op("memopt_test::opaque2", mutates_args=())
def opaque2(x: torch.Tensor) -> torch.Tensor:
    """An op without a fake rule: no dry run can trace a step that calls it."""
    return x.clone()


def _backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    return grad


opaque2.register_autograd(_backward)


class Opaque(Wrapped):
    """A tiny ``nn.TransformerEncoder`` whose step calls :func:`opaque2` on its output."""

    def __init__(self) -> None:
        super().__init__("torch_encoder")

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return opaque2(self.net(batch["x"])).pow(2).mean()


def logged(tmp_path: Path) -> dict[str, float]:
    (path,) = tmp_path.glob("**/metrics.csv")
    rows = list(csv.DictReader(path.open()))
    return {k: float(v) for row in rows for k, v in row.items() if k.startswith("memopt/") and v != ""}


def test_a_baseline_no_dry_run_can_give_is_unknown_and_no_saving_is_claimed(tmp_path) -> None:
    memopt, probe = MemOpt(), PeakMemory()
    trainer_ = trainer(memopt, probe)
    trainer_.loggers = [CSVLogger(tmp_path)]
    trainer_.fit(Opaque())
    report = memopt.report
    assert report is not None and report.batch_idx == 1
    assert any("opaque2" in n for n in report.notes)  # the dry run failed, and says where
    assert report.peak_bytes == probe.peaks[1]  # the real peak is measured
    assert report.baseline_peak_bytes is None and report.saved_bytes is None and report.saved_fraction is None
    assert any("no saving is claimed" in n for n in report.notes)
    metrics = logged(tmp_path)
    assert "memopt/peak_bytes" in metrics
    assert not {"memopt/saved_bytes", "memopt/saved_fraction", "memopt/baseline_peak_bytes"} & set(metrics)
    assert report.settings()["memopt/fit/baseline"].startswith("unknown")


class ClosureOptimized(Wrapped):
    """The tiny encoder stepped by LBFGS, whose step calls Lightning's closure (forward and backward) several times."""

    def __init__(self, max_iter: int = 4) -> None:
        super().__init__("torch_encoder")
        self.max_iter = max_iter

    def on_after_backward(self) -> None:  # Wrapped's copy of every gradient would be alive across the evaluations
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=self.max_iter)


def test_a_closure_optimizer_is_dry_run_through_its_closure_and_the_saving_is_the_real_one() -> None:
    """LBFGS's step evaluates the closure up to ``max_iter`` times, and its history grows every step: the dry run
    steps the optimizer's twin through a fake closure, from the state as it was before the real step (it failed on
    the missing closure before, and a baseline reconstructed from the real step claimed a saving that the real peaks
    did not show)."""
    plain = PeakMemory()
    trainer(plain, batches=3).fit(ClosureOptimized())
    memopt = MemOpt()  # its own probe measures the real step (a PeakMemory after it would nest modes out of order)
    trainer(memopt, batches=3).fit(ClosureOptimized())
    report = memopt.report
    assert report is not None and report.batch_idx == 1
    assert not any("dry run failed" in n for n in report.notes), report.notes
    assert report.peak_bytes is not None and report.saved_bytes is not None
    real_saving = plain.peaks[1] - report.peak_bytes
    assert abs(report.saved_bytes - real_saving) <= 0.01 * plain.peaks[1], (report.saved_bytes, real_saving)
    # the history LBFGS keeps (lists of tensors) is counted as the optimizer's state, and it grows
    assert report.figures.peak_by_kind["optimizer"] > 4 * sum(p.numel() * 4 for p in ClosureOptimized().parameters())


def test_an_ordinary_step_has_a_known_baseline(tmp_path) -> None:
    memopt = MemOpt()
    trainer_ = trainer(memopt)
    trainer_.loggers = [CSVLogger(tmp_path)]
    trainer_.fit(Wrapped("torch_encoder"))
    report = memopt.report
    assert report is not None and report.baseline_peak_bytes is not None
    assert not any("no saving is claimed" in n for n in report.notes)
    assert logged(tmp_path)["memopt/saved_bytes"] == report.saved_bytes


def test_a_fit_resumed_mid_epoch_measures_the_first_batches_that_run(tmp_path) -> None:
    """A step checkpoint resumes the epoch at batch 2: the batch chosen for measuring was 1, so nothing was measured
    and the summary was a table of "unknown"."""
    steps = ModelCheckpoint(tmp_path, "{step}", every_n_train_steps=2, save_top_k=-1)
    pl.Trainer(**{**TRAINER_ARGS, "enable_checkpointing": True}, limit_train_batches=4, callbacks=[steps]).fit(
        Wrapped("torch_encoder")
    )
    path = tmp_path / "step=2.ckpt"
    memopt, probe = MemOpt(), PeakMemory()
    resumed = pl.Trainer(**TRAINER_ARGS, limit_train_batches=4, callbacks=[memopt, probe])
    resumed.fit(Wrapped("torch_encoder"), ckpt_path=path)
    assert resumed.global_step == 4  # batches 2 and 3 ran
    report = memopt.report
    assert report is not None and report.batch_idx == 3  # the first of the second optimizer step after the resume
    assert report.peak_bytes == probe.peaks[1] and report.saved_bytes is not None and report.saved_bytes > 0
    assert not any("no batch was measured" in n for n in report.notes)
