"""MemOpt in one line, measured: a small DDPM UNet trained and a Latte-style video transformer sampled, on CPU.

Every model is built from a config and the data is generated, so nothing is downloaded. MemOpt measures one batch
of each run: its peak without the changes from a dry run on fake tensors, with them from the real step (exact CPU
byte counts), and prints a summary. ``verify=True`` checks the loss and every gradient of the measured training batch
against a second, sandboxed run without the changes, and the sampling run is compared with one without MemOpt.

    python examples/demo.py
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import torch
from diffusers import DDPMScheduler, LatteTransformer3DModel, UNet2DModel
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt import MemOpt

warnings.filterwarnings("ignore", ".*does not have many workers.*")


def blobs(n: int, size: int = 32, seed: int = 0) -> torch.Tensor:
    """``n`` RGB images of soft coloured blobs in [-1, 1]."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, size), torch.linspace(-1, 1, size), indexing="ij")
    centre = torch.rand(n, 2, 1, 1, generator=g) * 1.2 - 0.6
    radius = torch.rand(n, 1, 1, generator=g) * 0.3 + 0.2
    mask = torch.exp(-(((xx - centre[:, 0]) ** 2 + (yy - centre[:, 1]) ** 2) / radius**2))
    colour = torch.rand(n, 3, 1, 1, generator=g)
    return (mask[:, None] * colour) * 2 - 1


class DDPM(pl.LightningModule):
    """Noise prediction with a small UNet2DModel."""

    def __init__(self) -> None:
        super().__init__()
        self.unet = UNet2DModel(
            sample_size=32,
            block_out_channels=(32, 64),
            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            layers_per_block=1,
            norm_num_groups=8,
        )
        self.scheduler = DDPMScheduler(num_train_timesteps=100)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        images = batch[0]
        g = torch.Generator().manual_seed(batch_idx)  # the same noise in both runs
        noise = torch.randn(images.shape, generator=g)
        t = torch.randint(0, 100, (len(images),), generator=g)
        return nn.functional.mse_loss(self.unet(self.scheduler.add_noise(images, noise, t), t).sample, noise)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.unet.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(blobs(32)), batch_size=8)


class VideoSampler(pl.LightningModule):
    """One denoising step of a Latte-style video transformer per predict batch."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = LatteTransformer3DModel(
            num_attention_heads=2,
            attention_head_dim=32,
            in_channels=4,
            out_channels=8,
            num_layers=2,
            sample_size=16,
            patch_size=2,
            cross_attention_dim=64,  # captions are projected to the inner dim (heads x head dim)
            caption_channels=32,
            norm_type="ada_norm_single",
            video_length=8,
        )

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        latents, captions = batch
        t = torch.full((len(latents),), 10, dtype=torch.long)
        return self.transformer(latents, timestep=t, encoder_hidden_states=captions).sample

    def predict_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        latents = torch.randn(12, 4, 8, 16, 16, generator=g)  # batch, channels, frames, height, width
        captions = torch.randn(12, 6, 32, generator=g)
        return DataLoader(TensorDataset(latents, captions), batch_size=2)


def trainer(*callbacks: pl.Callback) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )


def main() -> None:
    # verify=True: on the measured batch, the loss and every gradient are compared with and without MemOpt's changes
    memopt = MemOpt(verify=True)
    torch.manual_seed(0)
    model = DDPM()
    trainer(memopt).fit(model)
    fit_report = memopt.report
    restored = not model.unet.is_gradient_checkpointing

    outputs = {}
    for label, callbacks in (("plain", []), ("memopt", [memopt])):
        torch.manual_seed(0)
        outputs[label] = trainer(*callbacks).predict(VideoSampler())
    predict_report = memopt.report
    diff = max((a - b).abs().max().item() for a, b in zip(outputs["plain"], outputs["memopt"], strict=True))

    print()
    for name, report in (("fit: DDPM UNet2DModel", fit_report), ("predict: Latte-style transformer", predict_report)):
        assert report is not None and report.saved_fraction is not None
        print(
            f"{name:<34} peak {report.baseline_peak_bytes / 2**20:7.2f} MiB -> {report.peak_bytes / 2**20:7.2f} MiB"
            f" ({report.saved_fraction:.1%} saved)"
        )
    print("loss and every gradient equal with and without MemOpt on the measured batch: True (verify=True passed)")
    print(f"predictions equal to a run without MemOpt: max difference {diff:.1e}")
    print(f"models restored after the run: {restored}")
    print("peaks are exact CPU byte counts of everything live during the step, measured by MemOpt itself")
    if not (restored and diff < 1e-4 and fit_report.saved_fraction > 0):
        raise SystemExit("demo check failed")


if __name__ == "__main__":
    main()
