"""VAE decode slicing and tiling at predict: slicing where the decode holds the peak (identical outputs), tiling only
under a budget that needs it (its difference reported), both undone at the end, and the order of techniques under
one budget."""

from __future__ import annotations

import functools
import logging
import warnings

import lightning.pytorch as pl
import pytest
import torch

from lightning_memopt import MemOpt, PeakMemory
from tests import zoo
from tests.helpers import DecodeLatents, fingerprint, trainer


def vae_decode() -> DecodeLatents:
    """The tiny VAE decoding 8 latents of 24x24, 4 a batch."""
    torch.manual_seed(0)
    return DecodeLatents(zoo.vae(), torch.randn(8, 4, 24, 24, generator=torch.Generator().manual_seed(0)), batch_size=4)


def run(
    memopt: MemOpt | None, model: pl.LightningModule | None = None, peaks: bool = True
) -> tuple[list[torch.Tensor], list[int]]:
    """The outputs and, with ``peaks``, each batch's exact peak (``PeakMemory``; without it, no exact accounting)."""
    probe = PeakMemory()
    callbacks = [*([memopt] if memopt else []), *([probe] if peaks else [])]
    outputs = trainer(*callbacks).predict(model or vae_decode())
    return outputs, probe.peaks


@functools.cache
def reference() -> tuple[list[torch.Tensor], int]:
    outputs, peaks = run(None)
    return outputs, max(peaks)


@functools.cache
def sliced_peaks() -> tuple[int, ...]:
    """The peaks of a run under ``MemOpt()``, which slices the decode: computed once."""
    return tuple(run(MemOpt())[1])


def test_slicing_lowers_a_decode_peak_with_identical_outputs() -> None:
    plain, plain_peak = reference()
    model = vae_decode()
    before = fingerprint(model.vae)
    memopt = MemOpt()
    outputs, peaks = run(memopt, model)
    for a, b in zip(outputs, plain, strict=True):  # the same decode, per sample: CPU kernels round differently
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert max(peaks) < 0.5 * plain_peak
    report = memopt.report
    assert report.decoding == "vae sliced" and report.peak_part == report.baseline_part == "VAE decode"
    assert report.baseline_peak_bytes == plain_peak and report.peak_bytes == peaks[0]
    assert report.tiling_max_abs_diff is None and "tiled" not in report.decoding
    assert fingerprint(model.vae) == before and not model.vae.use_slicing and not model.vae.use_tiling


def test_tiling_only_under_a_budget_that_needs_it_and_its_difference_is_reported() -> None:
    plain, plain_peak = reference()
    budget = max(sliced_peaks()) - 1  # slicing alone cannot meet it
    model = vae_decode()
    memopt = MemOpt(memory_budget=budget)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs, peaks = run(memopt, model)
    assert max(peaks) <= budget
    assert sum("VAE tiling is on for vae" in str(w.message) for w in caught) == 1
    report = memopt.report
    assert report.decoding == "vae tiled"
    largest = float((outputs[0][:1] - plain[0][:1]).abs().max())  # the first sample of the measured batch
    assert largest > 1e-3
    torch.testing.assert_close(report.tiling_max_abs_diff, largest, rtol=1e-3, atol=1e-6)
    assert report.metrics()["memopt/tiling_max_abs_diff"] == report.tiling_max_abs_diff
    assert not model.vae.use_slicing and not model.vae.use_tiling


def test_a_budget_slicing_meets_does_not_tile() -> None:
    plain, plain_peak = reference()
    memopt = MemOpt(memory_budget=plain_peak - 1)
    outputs, peaks = run(memopt)
    assert memopt.report.decoding == "vae sliced" and max(peaks) < plain_peak
    for a, b in zip(outputs, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_users_own_slicing_and_tiling_are_kept() -> None:
    model = vae_decode()
    model.vae.enable_tiling()
    memopt = MemOpt()
    run(memopt, model, peaks=False)
    assert model.vae.use_tiling and not model.vae.use_slicing


class Sampler(pl.LightningModule):
    """One denoising step of a Latte-style transformer, then the VAE decode of every frame."""

    def __init__(self, tiles: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.transformer, self.vae = zoo.latte(), zoo.vae()
        if not tiles:  # latents never exceed a tile: tiling does nothing
            self.vae.tile_latent_min_size = 10**6

    def predict_step(self, batch, batch_idx):
        x, c = batch["x"], batch["c"]
        noise = self.transformer(x, timestep=torch.ones(len(x)).long(), encoder_hidden_states=c).sample[:, :4]
        return self.vae.decode((x - noise).transpose(1, 2).flatten(0, 1)).sample  # the frames as a batch of images

    def predict_dataloader(self):
        g = torch.Generator().manual_seed(0)
        items = [{"x": torch.randn(4, 3, 24, 24, generator=g), "c": torch.randn(5, 16, generator=g)} for _ in range(4)]
        return torch.utils.data.DataLoader(items, batch_size=2)


@functools.cache
def sampler_reference() -> tuple[list[torch.Tensor], list[int]]:
    """The outputs and peaks of :class:`Sampler` without MemOpt: computed once."""
    return run(None, Sampler())


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_one_budget_over_every_technique_cheapest_first() -> None:
    """Slicing and coarse chunking meet a budget they can meet; tiling comes only for one they cannot."""
    plain, plain_peaks = sampler_reference()
    _, lowest = run(MemOpt(memory_budget=1, measure=False), Sampler(tiles=False))  # the lowest without tiling
    reachable = (max(plain_peaks) + max(lowest)) // 2
    memopt = MemOpt(memory_budget=reachable)
    outputs, peaks = run(memopt, Sampler())
    assert max(peaks) <= reachable and memopt.report.decoding == "vae sliced"
    assert "size 1," not in memopt.report.chunk_settings  # coarse chunking was enough
    for a, b in zip(outputs, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    tight = max(lowest) - 1  # below every peak reached without tiling
    memopt = MemOpt(memory_budget=tight)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        _, peaks = run(memopt, Sampler())
    assert max(peaks) <= tight and memopt.report.decoding == "vae tiled"


def test_without_a_budget_the_decode_is_sliced_where_it_holds_the_peak() -> None:
    plain, plain_peaks = sampler_reference()
    memopt = MemOpt()
    outputs, peaks = run(memopt, Sampler())
    assert memopt.report.baseline_part == "VAE decode" and memopt.report.decoding == "vae sliced"
    assert max(peaks) < 0.5 * max(plain_peaks) and memopt.report.tiling_max_abs_diff is None
    for a, b in zip(outputs, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_budget_the_step_meets_as_it_is_changes_nothing() -> None:
    plain, plain_peak = reference()
    memopt = MemOpt(memory_budget=plain_peak)
    outputs, peaks = run(memopt)
    assert memopt.report.decoding == "vae plain" and max(peaks) == plain_peak
    for a, b in zip(outputs, plain, strict=True):
        assert torch.equal(a, b)


def test_verify_never_tiles() -> None:
    """Tiling changes the outputs, which verify promises not to: under verify a budget that needs it is missed, and
    said so, with the decode sliced."""
    memopt = MemOpt(memory_budget=max(sliced_peaks()) - 1, verify=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs, peaks = run(memopt)
    assert memopt.report.decoding == "vae sliced"
    assert any("over the budget" in str(w.message) for w in caught)


def test_a_resumed_run_reuses_the_decode_mode(caplog) -> None:
    first = MemOpt()
    run(first)
    resumed = MemOpt()
    resumed.load_state_dict(first.state_dict())
    with caplog.at_level(logging.INFO):
        outputs, peaks = run(resumed)
    assert resumed.report.decoding == "vae sliced" and resumed.report.tuning_s is None
    assert any("reusing the settings chosen for these shapes" in r.message for r in caplog.records)
