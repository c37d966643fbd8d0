"""Ordinary steps (issue 15): MemOpt's figures are known and the results are those of a run without it.

Each case of ``tests/corpus.py`` runs twice on a tiny Trainer, with ``MemOpt()`` and without. The figures must be
known (the baseline from a dry run, the peak from the real step), at predict the chunk settings and VAE decode modes
must have been chosen by dry runs, and the outputs (predict) or the weights and everything ``self.log`` received (fit)
must equal the plain run's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from lightning_memopt import MemOpt
from tests import corpus
from tests.helpers import TRAINER_ARGS

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")


def _as_arrays(out: Any) -> list[np.ndarray]:
    """A pipeline's output (PIL images, numpy arrays, tensors, nested in lists) as a flat list of arrays."""
    if isinstance(out, (list, tuple)):
        return [a for item in out for a in _as_arrays(item)]
    if isinstance(out, torch.Tensor):
        return [out.detach().float().numpy()]
    if isinstance(out, np.ndarray) and out.dtype == object:
        return [a for item in out for a in _as_arrays(item)]
    return [np.asarray(out)]


def _assert_same_outputs(ours: Any, plain: Any) -> None:
    a, b = _as_arrays(ours), _as_arrays(plain)
    assert len(a) == len(b) and a
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        if x.dtype == np.uint8:  # PIL images: a VAE decode sliced is equal up to float rounding, then quantized
            assert np.abs(x.astype(int) - y.astype(int)).max() <= 1
        else:
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def _trainer(*callbacks: pl.Callback, **kwargs: Any) -> pl.Trainer:
    args = {**TRAINER_ARGS, "limit_train_batches": 2, "limit_predict_batches": 2, "log_every_n_steps": 1, **kwargs}
    return pl.Trainer(**args, callbacks=list(callbacks))


def _predict(make: Callable[[], pl.LightningModule], *callbacks: pl.Callback) -> Any:
    return _trainer(*callbacks).predict(make())


def _figures_known(memopt: MemOpt) -> None:
    report = memopt.report
    assert report is not None
    assert report.baseline_peak_bytes is not None, report.notes
    assert report.peak_bytes is not None, report.notes
    assert not [n for n in report.notes if "could not" in n], report.notes


# predict: diffusers pipelines with their default output types ------------------------------------------------------

#: The samplers with a VAE: the decode is sliced where it holds the peak (it does in each of these). The dry runs
#: of a whole pipeline take from 5 s to a minute on 2 cores: they are in the slow set.
VAE_SAMPLERS = {
    "latte_embeds": pytest.param(corpus.LatteEmbedsSampler, marks=pytest.mark.slow),
    "stable_diffusion": pytest.param(corpus.StableDiffusionSampler, marks=pytest.mark.slow),
    "latte_prompt": pytest.param(corpus.LatteSampler, marks=pytest.mark.slow),
    "animatediff": pytest.param(corpus.AnimateDiffSampler, marks=pytest.mark.slow),
}


@pytest.mark.parametrize("make", list(VAE_SAMPLERS.values()), ids=list(VAE_SAMPLERS))
def test_pipeline_with_vae(make: Callable[[], pl.LightningModule]) -> None:
    memopt = MemOpt()
    ours = _predict(make, memopt)
    _figures_known(memopt)
    report = memopt.report
    assert report.tuning_s is not None and report.chunk_settings, report  # chosen by dry runs
    assert report.decoding.startswith("vae sliced"), report.decoding  # by 1, or by the k the knee chose
    _assert_same_outputs(ours, _predict(make))


def test_ddpm_pipeline() -> None:
    """``DDPMPipeline`` over a ``UNet2DModel``: nothing to chunk and no VAE, so MemOpt changes nothing at predict; the
    PIL images are unchanged and the run ends normally."""
    memopt = MemOpt()
    with pytest.warns(UserWarning, match="no blocks MemOpt can use for chunking"):
        ours = _predict(corpus.DDPMSampler, memopt)
    assert memopt.report is not None and not memopt.report.applied
    _assert_same_outputs(ours, _predict(corpus.DDPMSampler))


# fit: ordinary training steps --------------------------------------------------------------------------------------


def _fit(make: Callable[[], corpus.LM], *callbacks: pl.Callback, **kwargs: Any) -> tuple[corpus.LM, Any]:
    model, logger = make(), corpus.MemoryLogger()
    _trainer(*callbacks, logger=logger, **kwargs).fit(model)
    return model, logger


def _assert_same_fit(make: Callable[[], corpus.LM], atol: float = 1e-6, **kwargs: Any) -> MemOpt:
    memopt = MemOpt()
    ours, our_log = _fit(make, memopt, **kwargs)
    plain, plain_log = _fit(make, **kwargs)
    _figures_known(memopt)
    assert memopt.report.applied, "checkpointing was not switched on"
    logged = our_log.values("memopt/")
    assert "memopt/baseline_peak_bytes" in logged and "memopt/saved_bytes" in logged, sorted(logged)
    ours_logged, plain_logged = our_log.user_values(), plain_log.user_values()
    assert ours_logged and ours_logged.keys() == plain_logged.keys()
    for key, values in ours_logged.items():
        assert values == pytest.approx(plain_logged[key], rel=1e-5, abs=atol), key
    for (name, a), b in zip(ours.state_dict().items(), plain.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=atol, msg=lambda m, name=name: f"{name}: {m}")
    return memopt


FIT_CASES: dict[str, Any] = {
    "item_guard": corpus.ItemGuard,
    "boolean_mask": corpus.MaskedLoss,
    "torchmetrics_accuracy": corpus.WithAccuracy,
    "mixtral": lambda: corpus.LM("mixtral"),
    "qwen2_moe": pytest.param(lambda: corpus.LM("qwen2_moe"), marks=pytest.mark.slow),
    "mixtral_item_guard": pytest.param(lambda: corpus.ItemGuard("mixtral"), marks=pytest.mark.slow),
}


@pytest.mark.parametrize("make", list(FIT_CASES.values()), ids=list(FIT_CASES))
def test_fit_step(make: Callable[[], corpus.LM]) -> None:
    _assert_same_fit(make)


def test_torchmetrics_and_keywords_in_validation_too() -> None:
    """The validation loop of a module that logs a metric and keywords there has its baseline figure too."""
    memopt = _assert_same_fit(corpus.LoggedAsTheDocsShow)
    validate = memopt.reports["validate"]
    assert validate.baseline_peak_bytes is not None and validate.peak_bytes is not None, validate.notes


def test_manual_optimization_two_optimizers() -> None:
    memopt = _assert_same_fit(corpus.TwoOptimizers)
    assert memopt.report.batch_idx == 1


def test_bf16_mixed_clipping_accumulation() -> None:
    """bf16 autocast, gradient clipping and two batches a step: batch 2 (the second step's first) is measured."""
    memopt = _assert_same_fit(
        lambda: corpus.ItemGuard(batches=4),
        atol=1e-5,
        precision="bf16-mixed",
        gradient_clip_val=0.5,
        accumulate_grad_batches=2,
        limit_train_batches=4,
    )
    assert memopt.report.batch_idx == 2
