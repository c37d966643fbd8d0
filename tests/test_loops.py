"""Sampling in validation_step and test_step: the same chunking, decode slicing and tuning as predict, swapped in when
each loop starts and out when it ends, with fit's checkpointing left on for the training steps; figures logged under
keys that name the loop."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_memopt import MemOpt, PeakMemory
from tests.helpers import LOOP_ARGS, Diffusion, Wrapped, fingerprint


def logged(tmp_path: Path) -> dict[str, float]:
    (path,) = tmp_path.glob("**/metrics.csv")
    return {k: float(v) for row in csv.DictReader(path.open()) for k, v in row.items() if k.startswith("memopt/") and v}


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_sampling_in_validation_during_fit_peaks_lower_with_identical_samples(tmp_path) -> None:
    plain, plain_probe = Diffusion(), PeakMemory()
    pl.Trainer(**LOOP_ARGS, callbacks=[plain_probe]).fit(plain)
    model, probe, memopt = Diffusion(), PeakMemory(), MemOpt()
    before = [fingerprint(model.transformer), fingerprint(model.vae)]
    pl.Trainer(**{**LOOP_ARGS, "logger": CSVLogger(tmp_path)}, callbacks=[memopt, probe]).fit(model)
    assert max(probe.loop_peaks["validate"]) < 0.6 * min(plain_probe.loop_peaks["validate"])
    for a, b in zip(model.samples["validate"], plain.samples["validate"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    fit, validate = memopt.reports["fit"], memopt.reports["validate"]
    assert fit.applied[0].technique == "checkpointing" and fit.peak_bytes < fit.baseline_peak_bytes
    assert validate.decoding == "vae sliced" and validate.baseline_part == "VAE decode"
    assert validate.baseline_peak_bytes == plain_probe.loop_peaks["validate"][0]
    assert validate.peak_bytes == probe.loop_peaks["validate"][0]
    metrics = logged(tmp_path)
    assert metrics["memopt/validate/peak_bytes"] == validate.peak_bytes
    assert metrics["memopt/validate/saved_fraction"] == validate.saved_fraction > 0.4
    assert metrics["memopt/peak_bytes"] == fit.peak_bytes  # the training figures keep their keys
    assert [fingerprint(model.transformer), fingerprint(model.vae)] == before


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_every_validation_epoch_runs_with_the_loop_settings_and_training_without_them() -> None:
    model, probe = Diffusion(), PeakMemory()
    memopt = MemOpt()
    pl.Trainer(**{**LOOP_ARGS, "max_epochs": 2, "num_sanity_val_steps": 2}, callbacks=[memopt, probe]).fit(model)
    peaks = probe.loop_peaks["validate"]
    assert len(peaks) == 2 + 2 * 2 and max(peaks) == min(peaks)  # the sanity check and both epochs, chosen once
    assert not model.vae.use_slicing and memopt.reports["validate"].batch_idx == 0


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_validate_and_test_on_their_own(tmp_path) -> None:
    plain = Diffusion()
    plain_probe = PeakMemory()
    trainer = pl.Trainer(**LOOP_ARGS, callbacks=[plain_probe])
    trainer.validate(plain)
    trainer.test(plain)
    budget = min(peak for peaks in plain_probe.loop_peaks.values() for peak in peaks) - 1  # not met as it is
    model, probe, memopt = Diffusion(), PeakMemory(), MemOpt(memory_budget=budget)
    trainer = pl.Trainer(**{**LOOP_ARGS, "logger": CSVLogger(tmp_path)}, callbacks=[memopt, probe])
    trainer.validate(model)
    assert memopt.report is memopt.reports["validate"] and memopt.report.budget_bytes == budget
    trainer.test(model)
    assert memopt.report.stage == "test" and set(memopt.reports) == {"test"}
    for stage in ("validate", "test"):
        assert max(probe.loop_peaks[stage]) < min(plain_probe.loop_peaks[stage])
        for a, b in zip(model.samples[stage], plain.samples[stage], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert "memopt/test/peak_bytes" in logged(tmp_path)
    assert not model.vae.use_slicing


def test_a_validation_batch_that_runs_out_of_memory_is_retried() -> None:
    """No budget, int chunk size: the decode is not sliced up front, and a decode that runs out of memory is
    retried with it sliced, on the batch as the dataloader gave it."""
    plain = Diffusion()
    pl.Trainer(**LOOP_ARGS).validate(plain)
    model = Diffusion()

    def too_big(module, args):
        if args[0].shape[0] > 1:  # a decode of more than one sample at a time
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model.vae.decoder.register_forward_pre_hook(too_big)
    pl.Trainer(**LOOP_ARGS, callbacks=[MemOpt(chunk_size=64, measure=False)]).validate(model)
    assert len(model.samples["validate"]) == len(plain.samples["validate"]) == 2
    for a, b in zip(model.samples["validate"], plain.samples["validate"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not model.vae.use_slicing


class UNetWithValidation(Wrapped):
    """A DDPM UNet, which has no feed-forward layer to chunk, with a validation loop."""

    def validation_step(self, batch, batch_idx):
        return self.case.forward(self.net, batch)

    def val_dataloader(self):
        return self.train_dataloader()


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_strict_during_fit_is_about_the_training_steps() -> None:
    with pytest.raises(RuntimeError, match="no blocks MemOpt can use for chunking"):
        pl.Trainer(**LOOP_ARGS, callbacks=[MemOpt(strict=True)]).validate(UNetWithValidation("unet2d"))
    memopt = MemOpt(strict=True)
    pl.Trainer(**LOOP_ARGS, callbacks=[memopt]).fit(UNetWithValidation("unet2d"))  # checkpointed; validation as it is
    assert memopt.reports["fit"].applied and not memopt.reports["validate"].applied
