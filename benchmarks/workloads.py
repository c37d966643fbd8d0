"""The benchmark workloads: models built from configs (never downloaded; the zoo of ``tests/zoo.py``, sized here),
synthetic batches, and the native switches.

Each workload is sized per suite (``smoke``, ``quick``, ``full``) so that activations, not weights, dominate the peak.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tests import zoo  # the scripts run as modules from the repository root, where `tests` is a package

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Workload:
    """A model under an attribute of the LightningModule, its batches, its step and its native memory switch.

    ``sizes[suite]`` holds the keyword arguments of ``build`` and ``sample``: ``batch`` and the geometry.
    ``step`` and ``native`` get the model, or the pipeline where ``pipeline`` builds one.
    """

    name: str
    stage: str  # "fit" or "predict"
    attr: str
    build: Callable[[dict[str, int]], nn.Module]
    sample: Callable[[torch.Generator, dict[str, int]], Batch]
    step: Callable[[Any, Batch], Any]  # the loss (fit) or the prediction (predict)
    native: Callable[[Any], Callable[[], None]]  # switches the library's own technique on, returns the undo
    native_label: str
    sizes: dict[str, dict[str, int]]
    #: Builds a diffusers pipeline around the model (its other models made here), or None. Where there is one, the
    #: step and the native switch get the pipeline instead of the model, and its other models become attributes of
    #: the LightningModule next to the model, so MemOpt finds them.
    pipeline: Callable[[nn.Module, dict[str, int]], Any] | None = None


# training ----------------------------------------------------------------------------------------------------------


def _ddpm_loss(model: nn.Module, b: Batch) -> torch.Tensor:
    """DDPM noise prediction: noise the images at random timesteps, predict the noise."""
    alpha = torch.cos(b["t"].float() / 1000 * torch.pi / 2).view(-1, *[1] * (b["x"].dim() - 1))
    noisy = alpha * b["x"] + (1 - alpha**2).sqrt() * b["noise"]
    kwargs = {"encoder_hidden_states": b["c"]} if "c" in b else {}
    return nn.functional.mse_loss(model(noisy, b["t"], **kwargs).sample, b["noise"])


def _unet2d(s: dict[str, int]) -> nn.Module:
    ch = s["channels"]
    return zoo.unet2d(sample_size=s["res"], layers_per_block=s["layers"], block_out_channels=(ch, 2 * ch, 2 * ch))


def _unet2d_condition_lora(s: dict[str, int]) -> nn.Module:
    from peft import LoraConfig

    ch = s["channels"]
    unet = zoo.unet2d_condition(
        sample_size=s["res"], layers_per_block=s["layers"], block_out_channels=(ch, 2 * ch), cross_attention_dim=32
    )
    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=8, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    return unet


def _llama(s: dict[str, int]) -> nn.Module:
    return zoo.llama(
        s["layers"],
        s["hidden"],
        vocab_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=s["seq"],
    )


def _gradient_checkpointing(model: nn.Module) -> Callable[[], None]:
    model.enable_gradient_checkpointing()
    return model.disable_gradient_checkpointing


def _activation_checkpointing(model: nn.Module) -> Callable[[], None]:
    model.activation_checkpointing_enable()
    return model.activation_checkpointing_disable


# predict -----------------------------------------------------------------------------------------------------------


def _latte(s: dict[str, int]) -> nn.Module:
    return zoo.latte(
        attention_head_dim=s["head_dim"],
        num_layers=s["layers"],
        sample_size=s["res"],
        cross_attention_dim=2 * s["head_dim"],
        video_length=s["frames"],
    )


def _vae(s: dict[str, int]) -> nn.Module:
    """An SD-style ``AutoencoderKL`` with 2 levels (x2 upsampling)."""
    return zoo.vae(sample_size=2 * s["res"])


def _latte_pipeline(transformer: nn.Module, s: dict[str, int]) -> Any:
    from diffusers import DDIMScheduler, LattePipeline

    pipe = LattePipeline(
        tokenizer=None,
        text_encoder=None,
        vae=_vae(s),
        transformer=transformer,
        scheduler=DDIMScheduler(num_train_timesteps=1000),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _latte_sample(pipe: Any, b: Batch) -> Any:
    """One denoising step through ``LattePipeline`` from the batch's latents and caption embeddings (no guidance),
    the VAE decode of every frame, and the pipeline's default output type: a list of PIL images per video."""
    _, _, frames, res, _ = b["x"].shape
    return pipe(
        prompt_embeds=b["c"],
        negative_prompt=None,
        mask_feature=False,  # its mask for given embeddings is shaped for one prompt only
        latents=b["x"],
        num_inference_steps=1,
        guidance_scale=1.0,
        video_length=frames,
        height=res * pipe.vae_scale_factor,
        width=res * pipe.vae_scale_factor,
    ).frames


def _chunk_and_slice(pipe: Any) -> Callable[[], None]:
    """The native switches of a pipeline: ``set_chunk_feed_forward(chunk_size=1, dim=1)`` on every block of its
    transformer, and ``vae.enable_slicing()``."""
    undo_chunking = _chunk_every_block(pipe.transformer)
    pipe.vae.enable_slicing()

    def undo() -> None:
        pipe.vae.disable_slicing()
        undo_chunking()

    return undo


def _svd_unet(s: dict[str, int]) -> nn.Module:
    ch = s["channels"]
    return zoo.svd_unet(sample_size=s["res"], block_out_channels=(ch, 2 * ch), num_frames=s["frames"])


def _chunk_every_block(model: nn.Module) -> Callable[[], None]:
    """``set_chunk_feed_forward(chunk_size=1, dim=1)`` on every block that has it, by keyword (Latte has no
    model-level switch; SVD's temporal blocks take ``dim`` as a keyword and fix it to 1 themselves)."""
    blocks = [m for m in model.modules() if callable(getattr(m, "set_chunk_feed_forward", None))]
    saved = [(b, b.__dict__.get("_chunk_size"), b.__dict__.get("_chunk_dim")) for b in blocks]
    for block in blocks:
        block.set_chunk_feed_forward(chunk_size=1, dim=1)

    def undo() -> None:
        for block, size, dim in saved:
            block._chunk_size, block._chunk_dim = size, dim

    return undo


#: Sizes of both UNet training workloads, per suite.
UNET_SIZES = {
    "smoke": {"batch": 2, "res": 16, "channels": 16, "layers": 1},
    "quick": {"batch": 8, "res": 32, "channels": 16, "layers": 1},
    "full": {"batch": 16, "res": 64, "channels": 32, "layers": 2},
}

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload(
            "unet2d_ddpm",
            "fit",
            "unet",
            _unet2d,
            lambda g, s: {
                "x": torch.randn(3, s["res"], s["res"], generator=g),
                "noise": torch.randn(3, s["res"], s["res"], generator=g),
                "t": torch.randint(0, 1000, (), generator=g),
            },
            _ddpm_loss,
            _gradient_checkpointing,
            "enable_gradient_checkpointing()",
            UNET_SIZES,
        ),
        Workload(
            "unet2d_condition_lora",
            "fit",
            "unet",
            _unet2d_condition_lora,
            lambda g, s: {
                "x": torch.randn(4, s["res"], s["res"], generator=g),
                "noise": torch.randn(4, s["res"], s["res"], generator=g),
                "t": torch.randint(0, 1000, (), generator=g),
                "c": torch.randn(8, 32, generator=g),
            },
            _ddpm_loss,
            _gradient_checkpointing,
            "enable_gradient_checkpointing()",
            UNET_SIZES,
        ),
        Workload(
            "llama",
            "fit",
            "model",
            _llama,
            lambda g, s: {"ids": torch.randint(0, 256, (s["seq"],), generator=g)},
            lambda m, b: m(input_ids=b["ids"], labels=b["ids"]).loss,
            _activation_checkpointing,
            "activation_checkpointing_enable()",
            {
                "smoke": {"batch": 2, "seq": 32, "hidden": 32, "layers": 2},
                "quick": {"batch": 4, "seq": 256, "hidden": 64, "layers": 4},
                "full": {"batch": 8, "seq": 512, "hidden": 128, "layers": 8},
            },
        ),
        Workload(
            "latte",
            "predict",
            "transformer",
            _latte,
            lambda g, s: {
                "x": torch.randn(4, s["frames"], s["res"], s["res"], generator=g),
                "c": torch.randn(6, 16, generator=g),
            },
            _latte_sample,
            _chunk_and_slice,
            "set_chunk_feed_forward(chunk_size=1, dim=1) on every block, vae.enable_slicing()",
            {
                "smoke": {"batch": 2, "res": 8, "frames": 4, "head_dim": 8, "layers": 1},
                "quick": {"batch": 2, "res": 32, "frames": 8, "head_dim": 16, "layers": 2},
                "full": {"batch": 2, "res": 64, "frames": 16, "head_dim": 32, "layers": 4},
            },
            pipeline=_latte_pipeline,
        ),
        Workload(
            "svd_unet",
            "predict",
            "unet",
            _svd_unet,
            lambda g, s: {
                "x": torch.randn(s["frames"], 8, s["res"], s["res"], generator=g),
                "c": torch.randn(1, 16, generator=g),
                "a": torch.randn(3, generator=g),
            },
            lambda m, b: m(b["x"], 500, encoder_hidden_states=b["c"], added_time_ids=b["a"]).sample,
            _chunk_every_block,
            "set_chunk_feed_forward(chunk_size=1, dim=1) on every block",
            {
                "smoke": {"batch": 1, "res": 8, "frames": 2, "channels": 32},
                "quick": {"batch": 1, "res": 32, "frames": 8, "channels": 32},
                "full": {"batch": 2, "res": 64, "frames": 14, "channels": 64},
            },
        ),
    ]
}


class Synthetic(Dataset):
    """``n`` samples, each drawn from its own seed, so every run sees the same data."""

    def __init__(self, workload: Workload, size: dict[str, int], n: int) -> None:
        self.workload, self.size, self.n = workload, size, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Batch:
        return self.workload.sample(torch.Generator().manual_seed(i), self.size)


class Bench(pl.LightningModule):
    """One workload's model under its attribute; the same module is reused by every run of a workload.

    ``reset()`` puts the weights back before each run, so every configuration computes the same numbers.
    """

    def __init__(self, workload: Workload, suite: str) -> None:
        super().__init__()
        self.workload, self.size = workload, workload.sizes[suite]
        torch.manual_seed(0)
        setattr(self, workload.attr, workload.build(self.size))
        self.pipe = workload.pipeline(self.net, self.size) if workload.pipeline is not None else None
        for name, part in (self.pipe.components if self.pipe is not None else {}).items():
            if isinstance(part, nn.Module) and part is not self.net:
                setattr(self, name, part)  # the pipeline's other models, where MemOpt finds them
        self.batches = 1
        self._initial = {k: v.detach().clone() for k, v in self.state_dict().items()}

    @property
    def net(self) -> nn.Module:
        return getattr(self, self.workload.attr)

    @property
    def runner(self) -> Any:
        """What the step and the native switch get: the pipeline where there is one, else the model."""
        return self.pipe if self.pipe is not None else self.net

    def reset(self, batches: int) -> None:
        self.load_state_dict(self._initial)
        self.batches = batches

    @contextlib.contextmanager
    def native(self) -> Iterator[None]:
        undo = self.workload.native(self.runner)
        try:
            yield
        finally:
            undo()

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return self.workload.step(self.runner, batch)

    @torch.no_grad()
    def predict_step(self, batch: Batch, batch_idx: int) -> Any:
        return self.workload.step(self.runner, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    def _loader(self) -> DataLoader:
        batch = self.size["batch"]
        return DataLoader(Synthetic(self.workload, self.size, self.batches * batch), batch_size=batch)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def predict_dataloader(self) -> DataLoader:
        return self._loader()
