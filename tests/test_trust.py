"""Trust (issue 15): ``verify`` under gradient clipping, spectral norm under generic checkpointing, copies of a model
taken during fit, and what a sliced VAE decode leaves behind or changes."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_memopt import MemOpt
from lightning_memopt.verify import VerificationError
from tests.helpers import TRAINER_ARGS, DecodeLatents, Wrapped, heavy, scaled_model

# verify with gradient clipping ---------------------------------------------------------------------------------------


def clipping_trainer(algorithm: str, *callbacks: pl.Callback) -> pl.Trainer:
    return pl.Trainer(
        **TRAINER_ARGS,
        limit_train_batches=2,
        gradient_clip_val=0.05,
        gradient_clip_algorithm=algorithm,
        callbacks=list(callbacks),
    )


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_verify_passes_under_gradient_clipping(algorithm: str) -> None:
    """verify compared the loss and every gradient, unclipped on both sides, and found them equal; the weights after
    the clipped steps are a plain run's."""
    models, memopt = [], MemOpt(verify=True)
    for callbacks in ([], [memopt]):
        model = Wrapped("llama")
        clipping_trainer(algorithm, *callbacks).fit(model)
        models.append(model)
    assert memopt.report.figures.verified.startswith("verify: the loss, every gradient and every buffer equal")
    assert memopt.report.figures.verify_max_rel_diff <= memopt.verify_tolerance
    plain, measured = models
    for (name, a), b in zip(plain.state_dict().items(), measured.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_verify_catches_a_real_difference_under_gradient_clipping(algorithm: str) -> None:
    model = Wrapped("torch_encoder")
    model.encoder = scaled_model(broken=True)
    with pytest.raises(VerificationError, match=r"the gradient of `encoder\.blocks\."):
        clipping_trainer(algorithm, MemOpt(verify=True)).fit(model)
    good = Wrapped("torch_encoder")
    good.encoder = scaled_model(broken=False)
    memopt = MemOpt(verify=True)
    clipping_trainer(algorithm, memopt).fit(good)  # its checkpointed path right: verify finds no difference
    assert [(a.model, a.method) for a in memopt.applied if a.technique == "checkpointing"] == [
        ("encoder (Scaled)", "enable_gradient_checkpointing()")
    ]
    assert memopt.report.batch_idx == 1 and not any(note.startswith("verify") for note in memopt.report.notes)
    assert len(good.losses) == 2 and not good.encoder.gradient_checkpointing


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_verify_under_clipping_counts_nothing_of_its_comparison_in_the_peak() -> None:
    peaks = []
    for verify in (False, True):
        memopt = MemOpt(verify=verify)
        clipping_trainer("norm", memopt).fit(Wrapped("llama"))
        peaks.append(memopt.reports["fit"].peak_bytes)
    assert peaks[0] is not None and peaks[0] == peaks[1]


# spectral norm under generic checkpointing ---------------------------------------------------------------------------


class SpectralBlock(nn.Module):
    def __init__(self, parametrized: bool) -> None:
        super().__init__()
        norm = nn.utils.parametrizations.spectral_norm if parametrized else nn.utils.spectral_norm
        self.proj = norm(nn.Linear(32, 32))
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.proj(x))


class SpectralStack(nn.Module):
    """Repeated blocks, each with a spectral-normed Linear: the generic technique checkpoints them."""

    def __init__(self, parametrized: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SpectralBlock(parametrized) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("parametrized", [True, False], ids=["parametrizations", "hook"])
def test_spectral_norm_under_generic_checkpointing_trains_as_without_memopt(parametrized: bool) -> None:
    states = []
    for callbacks in ([], [MemOpt()]):
        model = Wrapped("torch_encoder")
        torch.manual_seed(0)
        model.encoder = SpectralStack(parametrized)
        memopt_trainer = pl.Trainer(**TRAINER_ARGS, limit_train_batches=2, callbacks=list(callbacks))
        memopt_trainer.fit(model)
        if callbacks:
            assert callbacks[0].applied and callbacks[0].applied[0].blocks == 3
        states.append(model.state_dict())
    plain, measured = states
    assert any(name.endswith(("_u", "_v")) for name in plain)
    for (name, a), b in zip(plain.items(), measured.values(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)


# copies of a model taken during fit -----------------------------------------------------------------------------------


class CopyMidFit(pl.Callback):
    """Copies the model when the second batch starts, with MemOpt's changes in force, as EMA and best-model callbacks
    do."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if idx == 1:
            self.copy = copy.deepcopy(pl_module.net)


def attributes(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Every module's instance attributes: values for plain ones, the class for the rest."""
    plain = (bool, int, float, str, type(None))
    return {
        name: {
            k: v if isinstance(v, plain) else type(v).__name__
            for k, v in module.__dict__.items()
            if k not in ("_parameters", "_buffers", "_modules", "training")
        }
        for name, module in model.named_modules()
    }


@pytest.mark.parametrize("case", heavy(["unet2d", "llama", "torch_encoder"], "unet2d"))
def test_a_copy_taken_during_fit_looks_and_trains_like_the_users_model(case: str) -> None:
    from lightning_memopt.memory import CPUPeakTracker

    model, copier = Wrapped(case), CopyMidFit()
    pl.Trainer(**TRAINER_ARGS, limit_train_batches=2, callbacks=[MemOpt(), copier]).fit(model)
    fresh = Wrapped(case).net  # never under MemOpt
    assert attributes(copier.copy) == attributes(fresh)
    assert not any(m.__dict__.get("gradient_checkpointing") for m in copier.copy.modules())
    fresh.load_state_dict(copier.copy.state_dict())
    batch = next(iter(model.train_dataloader()))
    peaks, grads = [], []
    for net in (copier.copy, fresh):
        net.train()
        with CPUPeakTracker() as tracker:
            model.case.loss(model.case.forward(net, batch), batch).backward()
        peaks.append(tracker.peak)
        grads.append({n: p.grad for n, p in net.named_parameters() if p.grad is not None})
    assert peaks[0] == peaks[1]
    for (name, a), b in zip(grads[0].items(), grads[1].values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


# what a sliced VAE decode leaves behind, and what it changes ---------------------------------------------------------


def kvae() -> nn.Module:
    from diffusers import AutoencoderKLKVAE

    return AutoencoderKLKVAE(channels=32, ch_mult=(1, 2), num_enc_blocks=1, num_dec_blocks=1, z_channels=4)


def test_a_sliced_decode_leaves_the_autoencoder_as_a_plain_decode_does() -> None:
    latents = torch.randn(4, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    runs = []
    for callbacks in ([], [MemOpt()]):
        torch.manual_seed(0)
        model = DecodeLatents(kvae(), latents)
        outputs = pl.Trainer(**TRAINER_ARGS, callbacks=list(callbacks)).predict(model)
        if callbacks:
            assert callbacks[0].report.decoding == "vae sliced"
        runs.append((outputs, model.vae))
    (plain, plain_vae), (sliced, sliced_vae) = runs
    assert plain_vae.decoder.last_z_shape == sliced_vae.decoder.last_z_shape == torch.Size([2, 4, 16, 16])
    assert attributes(sliced_vae) == attributes(plain_vae)
    for a, b in zip(plain, sliced, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


#: Small video autoencoders whose sliced decodes differ from plain ones in float32, and the shape of their latents.
VIDEO_AUTOENCODERS = {
    "AutoencoderKLHunyuanVideo": (
        dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8, 8), norm_num_groups=4),
        (2, 4, 2, 4, 4),
    ),
    "AutoencoderKLMochi": (
        dict(
            in_channels=15,
            out_channels=3,
            latent_channels=4,
            encoder_block_out_channels=(32, 32, 32, 32),
            decoder_block_out_channels=(32, 32, 32, 32),
            layers_per_block=(1, 1, 1, 1, 1),
        ),
        (2, 4, 2, 4, 4),
    ),
}


@pytest.mark.parametrize("name", list(VIDEO_AUTOENCODERS))
def test_a_sliced_video_decode_differs_from_plain_only_by_rounding(name: str) -> None:
    """In float64 the sliced and plain decodes agree to about 1e-15: what float32 shows (about 1e-6 here) is the
    rounding of kernels run on one sample instead of a batch, not a different computation."""
    import diffusers

    from lightning_memopt.techniques.decoding import DecodeUnit

    kwargs, shape = VIDEO_AUTOENCODERS[name]
    torch.manual_seed(0)
    vae = getattr(diffusers, name)(**kwargs).eval()
    unit = DecodeUnit("vae", vae)
    for dtype, bound in ((torch.float64, 1e-12), (torch.float32, 1e-4)):
        vae.to(dtype)
        latents = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
        decoded = []
        for mode in ("plain", "sliced"):
            unit.set(mode)
            with torch.no_grad():
                decoded.append(vae.decode(latents).sample)
        plain, sliced = decoded
        relative = ((sliced - plain).abs().max() / plain.abs().max()).item()
        assert relative < bound, (dtype, relative)
