"""Trust (issue 15): ``verify`` under gradient clipping, spectral norm under generic checkpointing, copies of a model
taken during fit, and what a sliced VAE decode leaves behind or changes."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from helpers import TRAINER_ARGS, Wrapped
from lightning_memopt import MemOpt
from lightning_memopt.verify import VerificationError

# verify with gradient clipping ---------------------------------------------------------------------------------------


def clipping_trainer(algorithm: str, *callbacks: pl.Callback) -> pl.Trainer:
    return pl.Trainer(
        **TRAINER_ARGS,
        limit_train_batches=2,
        gradient_clip_val=0.05,
        gradient_clip_algorithm=algorithm,
        callbacks=list(callbacks),
    )


def dropped_scale_model(broken: bool) -> nn.Module:
    """A diffusers model whose checkpointed path drops the ``scale`` argument when ``broken``: a real difference."""
    from diffusers import ModelMixin

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            return x + scale * self.proj(x)

    class Scaled(ModelMixin):
        _supports_gradient_checkpointing = True

        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.gradient_checkpointing = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                if torch.is_grad_enabled() and self.gradient_checkpointing:
                    x = self._gradient_checkpointing_func(block, *((x,) if broken else (x, 0.5)))
                else:
                    x = block(x, 0.5)
            return x

    return Scaled()


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_verify_passes_under_gradient_clipping(algorithm: str) -> None:
    models = []
    for callbacks in ([], [MemOpt(verify=True)]):
        model = Wrapped("llama")
        clipping_trainer(algorithm, *callbacks).fit(model)
        models.append(model)
    plain, measured = models
    for (name, a), b in zip(plain.state_dict().items(), measured.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_verify_catches_a_real_difference_under_gradient_clipping(algorithm: str) -> None:
    model = Wrapped("torch_encoder")
    model.encoder = dropped_scale_model(broken=True)
    with pytest.raises(VerificationError, match=r"the gradient of `encoder\.blocks\."):
        clipping_trainer(algorithm, MemOpt(verify=True)).fit(model)
    good = Wrapped("torch_encoder")
    good.encoder = dropped_scale_model(broken=False)
    clipping_trainer(algorithm, MemOpt(verify=True)).fit(good)


def test_verify_under_clipping_counts_nothing_of_its_comparison_in_the_peak() -> None:
    peaks = []
    for verify in (False, True):
        memopt = MemOpt(verify=verify)
        clipping_trainer("norm", memopt).fit(Wrapped("llama"))
        peaks.append(memopt.reports["fit"].peak_bytes)
    assert peaks[0] is not None and peaks[0] == peaks[1]
