"""Fine-tune a small Stable Diffusion-style UNet with MemOpt: a text encoder and a VAE frozen, the UNet trained.

The step a Stable Diffusion fine-tune runs, on models built from configs and generated data, so nothing is
downloaded: a frozen ``CLIPTextModel`` encodes each image's caption (token ids naming its shape and colour), a frozen
``AutoencoderKL`` encodes the image to latents inside ``training_step``, a ``DDPMScheduler`` noises them, and a
``UNet2DConditionModel`` learns to predict the noise, with AdamW. ``MemOpt()`` switches on the UNet's own gradient
checkpointing when fit starts (the frozen text encoder and VAE are left alone: they keep nothing for the backward
pass), measures one batch (without it by a dry run on fake tensors, with it for real; exact CPU byte counts), prints a
summary and logs the figures under ``memopt/`` keys next to ``train_loss`` in a CSV file.

    python examples/finetune_sd.py          # 256 images of 64x64, batch 8, 2 epochs
    python examples/finetune_sd.py --quick  # 16 images of 32x32, batch 4, 1 epoch
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import CLIPTextConfig, CLIPTextModel

from lightning_memopt import MemOpt
from lightning_memopt.units import fmt_bytes

warnings.filterwarnings("ignore", ".*does not have many workers.*")

#: Caption tokens: 0 begins a caption, 1 ends it, then the words (a shape, then a colour).
WORDS = {"square": 2, "disc": 3, "red": 4, "green": 5, "blue": 6}
COLOURS = torch.tensor([[1.0, 0.1, 0.1], [0.1, 1.0, 0.1], [0.1, 0.1, 1.0]])


def captioned_shapes(n: int, size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` RGB images in [-1, 1], each a red, green or blue square or disc, and their captions as token ids."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, size), torch.linspace(-1, 1, size), indexing="ij")
    cx, cy = (torch.rand(2, n, 1, 1, generator=g) * 1.0 - 0.5).unbind(0)
    radius = torch.rand(n, 1, 1, generator=g) * 0.3 + 0.2
    is_disc = torch.rand(n, generator=g) < 0.5
    colour = torch.randint(0, 3, (n,), generator=g)
    disc = (xx - cx) ** 2 + (yy - cy) ** 2 < radius**2
    square = torch.maximum((xx - cx).abs(), (yy - cy).abs()) < radius
    mask = torch.where(is_disc[:, None, None], disc, square).float()
    images = mask[:, None] * COLOURS[colour][:, :, None, None] * 2 - 1
    shape_ids = torch.where(is_disc, WORDS["disc"], WORDS["square"])
    captions = torch.stack([torch.zeros(n, dtype=torch.long), shape_ids, colour + WORDS["red"], torch.ones(n).long()])
    return images, captions.T.contiguous()


class StableDiffusionFineTune(pl.LightningModule):
    """Text-to-image noise prediction in a VAE's latent space, as Stable Diffusion is fine-tuned."""

    def __init__(self, images: int, size: int, batch_size: int) -> None:
        super().__init__()
        self.images, self.size, self.batch_size = images, size, batch_size
        text = CLIPTextConfig(
            vocab_size=len(WORDS) + 2,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=8,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
        self.text_encoder = CLIPTextModel(text).requires_grad_(False)
        self.vae = AutoencoderKL(
            block_out_channels=(16, 32),
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            latent_channels=4,
            layers_per_block=1,
            norm_num_groups=8,
            sample_size=size,
        ).requires_grad_(False)
        self.unet = UNet2DConditionModel(
            sample_size=size // 2,
            in_channels=4,
            out_channels=4,
            block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32,
            attention_head_dim=8,
            layers_per_block=1,
            norm_num_groups=8,
        )
        self.scheduler = DDPMScheduler(num_train_timesteps=1000)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, captions = batch
        latents = self.vae.encode(images).latent_dist.sample() * self.vae.config.scaling_factor
        text = self.text_encoder(captions).last_hidden_state
        noise = torch.randn_like(latents)
        t = torch.randint(0, self.scheduler.config.num_train_timesteps, (len(latents),), device=latents.device)
        noisy = self.scheduler.add_noise(latents, noise, t)
        loss = nn.functional.mse_loss(self.unet(noisy, t, encoder_hidden_states=text).sample, noise)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.unet.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        data = TensorDataset(*captioned_shapes(self.images, self.size))
        return DataLoader(data, batch_size=self.batch_size, shuffle=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer, smaller images and one epoch (seconds)")
    args = parser.parse_args()

    pl.seed_everything(0)
    module = StableDiffusionFineTune(16, 32, 4) if args.quick else StableDiffusionFineTune(256, 64, 8)
    memopt = MemOpt()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1 if args.quick else 2,
        logger=CSVLogger(save_dir="lightning_logs", name="finetune_sd"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[memopt],
    )
    trainer.fit(module)

    report = memopt.report
    print(f"\nfinal train_loss: {trainer.callback_metrics['train_loss'].item():.4f}")
    print(f"logs (train_loss and the memopt/ keys): {Path(trainer.logger.log_dir).resolve() / 'metrics.csv'}")
    if report is None or report.saved_fraction is None or report.saved_fraction <= 0:
        raise SystemExit(f"check failed: MemOpt saved nothing ({report})")
    without, with_ = report.baseline_peak_bytes, report.peak_bytes
    print(
        f"training peak: {fmt_bytes(without)} ({without:,} B) without MemOpt, {fmt_bytes(with_)} ({with_:,} B) with"
        f" it; saved {fmt_bytes(report.saved_bytes)}, {report.saved_fraction:.1%}"
    )


if __name__ == "__main__":
    main()
