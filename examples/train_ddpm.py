"""Train a small DDPM UNet with MemOpt: gradient checkpointing on at fit, its saving measured and logged.

A diffusers ``UNet2DModel`` built from a config learns to predict the noise that a ``DDPMScheduler`` adds to
generated images of coloured squares and discs, so nothing is downloaded. ``MemOpt()`` switches on the UNet's own
gradient checkpointing when fit starts, measures one batch (without it by a dry run on fake tensors, with it for real;
exact CPU byte counts), prints a summary and logs the figures under ``memopt/`` keys next to ``train_loss`` in a CSV
file.

    python examples/train_ddpm.py          # 256 images, 2 epochs
    python examples/train_ddpm.py --quick  # 32 images, 1 epoch
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from diffusers import DDPMScheduler, UNet2DModel
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt import MemOpt

warnings.filterwarnings("ignore", ".*does not have many workers.*")


def shapes(n: int, size: int = 32, seed: int = 0) -> torch.Tensor:
    """``n`` RGB images in [-1, 1], each a coloured square or disc on a dark background."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, size), torch.linspace(-1, 1, size), indexing="ij")
    cx, cy = (torch.rand(2, n, 1, 1, generator=g) * 1.2 - 0.6).unbind(0)
    radius = torch.rand(n, 1, 1, generator=g) * 0.3 + 0.15
    disc = (xx - cx) ** 2 + (yy - cy) ** 2 < radius**2
    square = torch.maximum((xx - cx).abs(), (yy - cy).abs()) < radius
    is_disc = torch.rand(n, 1, 1, generator=g) < 0.5
    mask = torch.where(is_disc, disc, square).float()
    colour = torch.rand(n, 3, 1, 1, generator=g)
    return mask[:, None] * colour * 2 - 1


class DDPM(pl.LightningModule):
    """Noise prediction: the UNet sees a noised image and its timestep and predicts the noise."""

    def __init__(self, images: int, timesteps: int = 1000) -> None:
        super().__init__()
        self.images = images
        self.unet = UNet2DModel(
            sample_size=32,
            block_out_channels=(32, 64, 64),
            down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
            layers_per_block=1,
            norm_num_groups=8,
        )
        self.scheduler = DDPMScheduler(num_train_timesteps=timesteps)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        images = batch[0]
        noise = torch.randn_like(images)
        t = torch.randint(0, self.scheduler.config.num_train_timesteps, (len(images),), device=images.device)
        loss = nn.functional.mse_loss(self.unet(self.scheduler.add_noise(images, noise, t), t).sample, noise)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.unet.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(shapes(self.images)), batch_size=8, shuffle=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer images and one epoch (a few seconds)")
    args = parser.parse_args()

    pl.seed_everything(0)
    memopt = MemOpt()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1 if args.quick else 2,
        logger=CSVLogger(save_dir="lightning_logs", name="ddpm"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[memopt],
    )
    trainer.fit(DDPM(images=32 if args.quick else 256))

    report = memopt.report
    print(f"\nfinal train_loss: {trainer.callback_metrics['train_loss'].item():.4f}")
    print(f"logs (train_loss and the memopt/ keys): {Path(trainer.logger.log_dir).resolve() / 'metrics.csv'}")
    if report is None or report.saved_fraction is None or report.saved_fraction <= 0:
        raise SystemExit(f"check failed: gradient checkpointing saved nothing ({report})")
    print(f"gradient checkpointing saved {report.saved_fraction:.1%} of the training peak")


if __name__ == "__main__":
    main()
