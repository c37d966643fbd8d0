"""A loop run after a fit on the same Trainer: the optimizer state and the last step's gradients are still alive, and
the baseline counts them as the real step does (issue 31, item 1).

Before, a loop's dry run left out the optimizers of a Trainer whose fit had ended: on the plain torch encoder below the
baseline was 92,928 bytes against a real plain peak of 229,728, and the summary said ``saved -136,800``. The real
plain peak here comes from the independent meter of ``tests/test_meter.py``, run inside the step, with what is alive
from the start added as MemOpt adds it: weights, buffers, the batch, gradients and optimizer state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_memopt import MemOpt
from tests import zoo
from tests.helpers import TRAINER_ARGS, heavy
from tests.test_meter import Meter

Batch = dict[str, torch.Tensor]
LOOPS = ("predict", "validate", "test")


class Step(pl.LightningModule):
    """A model trained by ``loss`` and run by ``sample`` in every loop; the loops' real peaks metered in the step."""

    def __init__(self, make: Callable[[], nn.Module], loss: Callable[..., Any], sample: Callable[..., Any]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = make()
        self.loss, self.sample = loss, sample
        self.peaks: dict[str, int] = {}

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return self.loss(self.net, batch)

    def _metered(self, stage: str, batch: Batch) -> Any:
        with Meter() as meter:
            meter.add([*self.parameters(), *self.buffers(), batch])
            meter.add([p.grad for p in self.parameters() if p.grad is not None])
            meter.add([list(s.values()) for o in self.trainer.optimizers for s in o.state.values()])
            out = self.sample(self.net, batch)
        self.peaks[stage] = meter.peak
        return out

    def predict_step(self, batch: Batch, batch_idx: int) -> Any:
        return self._metered("predict", batch)

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._metered("validate", batch)

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._metered("test", batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


class Denoiser(nn.Module):
    """A UNet trained, and a frozen VAE that decodes its output in the loops, as a diffusion module samples."""

    def __init__(self) -> None:
        super().__init__()
        self.unet = zoo.unet2d(in_channels=4, out_channels=4)
        self.vae = zoo.vae().requires_grad_(False)


def _denoise(m: Denoiser, b: Batch) -> torch.Tensor:
    return m.unet(b["x"], 3).sample


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[..., Any], Callable[..., Any], Callable[..., Batch]]] = {
    "torch": (
        _encoder,
        lambda m, b: m(b["x"]).pow(2).mean(),
        lambda m, b: m(b["x"]),
        lambda g: {"x": torch.randn(4, 16, 32, generator=g)},
    ),
    "transformers": (
        zoo.lora_llama,
        lambda m, b: m(**b).loss,
        lambda m, b: m(input_ids=b["input_ids"]).logits,
        lambda g: {"input_ids": (ids := torch.randint(0, 128, (2, 32), generator=g)), "labels": ids.clone()},
    ),
    "diffusers": (
        Denoiser,
        lambda m, b: (_denoise(m, b) - b["x"]).pow(2).mean(),
        lambda m, b: m.vae.decode(_denoise(m, b)).sample,
        lambda g: {"x": torch.randn(2, 4, 16, 16, generator=g)},
    ),
}


def _run(case: str, *callbacks: pl.Callback) -> tuple[Step, pl.Trainer]:
    make, loss, sample, batch = CASES[case]
    data = [batch(torch.Generator().manual_seed(i)) for i in range(2)]
    model = Step(make, loss, sample)
    trainer = pl.Trainer(
        **TRAINER_ARGS, limit_train_batches=2, limit_predict_batches=1, limit_val_batches=1, limit_test_batches=1,
        num_sanity_val_steps=0, callbacks=list(callbacks),
    )  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=None))
    return model, trainer


def _loops(model: Step, trainer: pl.Trainer, batch: Batch, memopt: MemOpt | None = None) -> dict[str, Any]:
    """Each loop after the fit on the same Trainer; with MemOpt, each loop's report."""
    reports = {}
    for stage in LOOPS:
        getattr(trainer, stage)(model, DataLoader([batch], batch_size=None))
        reports[stage] = memopt.report if memopt is not None else None
    return reports


@pytest.mark.parametrize("case", heavy(list(CASES), "diffusers", "transformers"))
def test_a_loop_after_a_fit_counts_the_optimizer_state_and_gradients_the_trainer_holds(case: str) -> None:
    plain, plain_trainer = _run(case)
    memopt = MemOpt()
    changed, trainer = _run(case, memopt)
    assert trainer.optimizers and trainer.optimizers[0].state, "the fit left its optimizer state"
    batch = CASES[case][3](torch.Generator().manual_seed(5))
    _loops(plain, plain_trainer, batch)
    reports = _loops(changed, trainer, batch, memopt)
    for stage in LOOPS:
        report = reports[stage]
        assert report.baseline_peak_bytes == plain.peaks[stage], stage
        assert report.peak_bytes == changed.peaks[stage], stage
        assert report.saved_bytes >= 0, (stage, report.saved_bytes)
