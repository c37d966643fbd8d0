"""Train a video diffusion model and sample in ``validation_step``: MemOpt checkpoints the training steps and, in each
validation loop, chunks the transformer's feed-forward layers and slices the VAE decode where it holds the peak.

A Latte-style ``LatteTransformer3DModel`` learns to predict noise on random video latents; every validation batch
samples a few denoising steps and decodes every frame with an SD-style ``AutoencoderKL`` (both built from small
configs, untrained, so nothing is downloaded; the point is the memory). ``MemOpt()`` measures one training batch and
the first validation batch (the sanity check), each without its changes by a dry run on fake tensors and with them for
real (exact CPU bytes), prints a summary of each and logs them: the training figures under ``memopt/``, the
validation ones under ``memopt/validate/``. A plain run of the same validation checks that the samples are unchanged.

    python examples/sample_in_validation.py          # 3 epochs of 8 training and 2 validation batches
    python examples/sample_in_validation.py --quick  # 1 epoch of 2 and 2
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from diffusers import AutoencoderKL, LatteTransformer3DModel
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_memopt import MemOpt

warnings.filterwarnings("ignore", ".*does not have many workers.*")


class VideoDiffusion(pl.LightningModule):
    """Noise prediction on video latents (4 channels, 4 frames, 24x24), sampling in ``validation_step``."""

    def __init__(self, steps: int = 3) -> None:
        super().__init__()
        self.steps = steps
        self.transformer = LatteTransformer3DModel(
            num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2, sample_size=24,
            patch_size=2, cross_attention_dim=32, caption_channels=32, norm_type="ada_norm_single", video_length=4,
        )  # fmt: skip
        self.vae = AutoencoderKL(
            latent_channels=4, block_out_channels=(16, 32), down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, norm_num_groups=8, sample_size=48,
        )  # fmt: skip
        self.vae.requires_grad_(False)
        self.samples: list[torch.Tensor] = []

    def denoise(self, latents: torch.Tensor, captions: torch.Tensor, t: int) -> torch.Tensor:
        timestep = torch.full((len(latents),), t)
        return self.transformer(latents, timestep=timestep, encoder_hidden_states=captions).sample[:, :4]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        noise = torch.randn_like(batch["latents"])
        loss = torch.nn.functional.mse_loss(self.denoise(batch["latents"] + noise, batch["captions"], 500), noise)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        latents = batch["latents"]
        for t in range(900, 0, -(900 // self.steps)):  # plain ints: a dry run cannot read values from tensors
            latents = latents - 0.2 * self.denoise(latents, batch["captions"], t)
        frames = self.vae.decode(latents.transpose(1, 2).flatten(0, 1)).sample  # every frame of every video
        self.samples.append(frames)
        self.log("sample_mean", frames.mean())
        return frames

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.transformer.parameters(), lr=1e-4)

    def _data(self, n: int, seed: int) -> DataLoader:
        g = torch.Generator().manual_seed(seed)
        items = [
            {"latents": torch.randn(4, 4, 24, 24, generator=g), "captions": torch.randn(6, 32, generator=g)}
            for _ in range(n)
        ]
        return DataLoader(items, batch_size=2)

    def train_dataloader(self) -> DataLoader:
        return self._data(16, seed=0)

    def val_dataloader(self) -> DataLoader:
        return self._data(4, seed=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one short epoch (seconds)")
    args = parser.parse_args()

    pl.seed_everything(0)
    model, memopt = VideoDiffusion(), MemOpt()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1 if args.quick else 3,
        limit_train_batches=2 if args.quick else 8,
        logger=CSVLogger(save_dir="lightning_logs", name="sample_in_validation"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[memopt],
    )
    trainer.fit(model)

    # the same validation without MemOpt: the samples must not change
    ours = model.samples[-2:]
    model.samples = []
    pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False).validate(model)
    for a, b in zip(ours, model.samples, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    fit, validate = memopt.reports["fit"], memopt.reports["validate"]
    print(f"\nlogs (memopt/ and memopt/validate/ keys): {Path(trainer.logger.log_dir).resolve() / 'metrics.csv'}")
    for report in (fit, validate):
        if report.saved_fraction is None or report.saved_fraction <= 0:
            raise SystemExit(f"check failed: MemOpt saved nothing at {report.stage} ({report})")
    print(f"training steps: checkpointing saved {fit.saved_fraction:.1%} of the peak")
    print(
        f"validation sampling: {validate.saved_fraction:.1%} of the peak saved ({validate.decoding};"
        f" {validate.chunk_settings}); peak in {validate.peak_part}, without MemOpt in {validate.baseline_part};"
        " samples unchanged"
    )


if __name__ == "__main__":
    main()
