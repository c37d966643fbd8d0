"""Sample videos from a Latte-style transformer under a memory budget: MemOpt tunes feed-forward chunking per block.

A diffusers ``LatteTransformer3DModel`` built from a config (untrained, so the videos are noise-like; the point is
the memory) denoises random latents with a short ``DDIMScheduler`` loop in each predict batch, conditioned on random
caption embeddings, so nothing is downloaded. Before the first batch runs, ``MemOpt(memory_budget=...)`` dry-runs
the whole sampling loop on fake tensors (no real memory, no computation on the model's weights), runs each block alone
at several chunk settings, and picks for each block the coarsest chunking that keeps the peak under the budget; a second
dry run checks the choice. The first batch then runs chunked: its peak is measured for real, the dry run without
chunking gives the baseline, and the figures go to ``memopt/`` keys in a CSV file.

    python examples/sample_latte.py          # 8 batches of 2 videos, 8 denoising steps each
    python examples/sample_latte.py --quick  # 5 batches, 2 denoising steps each

The budget, 5 MiB, lies between the peak with every block at its finest chunking (about 3.8 MiB, exact CPU bytes) and
the peak without chunking (about 7.1 MiB): on a GPU, give your own, such as ``"12GiB"`` or ``0.8`` of the device.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from diffusers import DDIMScheduler, LatteTransformer3DModel
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt import MemOpt

warnings.filterwarnings("ignore", ".*does not have many workers.*")

BUDGET = "5MiB"


class VideoSampler(pl.LightningModule):
    """A DDIM loop over a Latte-style transformer: each predict batch turns noise latents into video latents."""

    def __init__(self, videos: int, steps: int) -> None:
        super().__init__()
        self.videos = videos
        self.transformer = LatteTransformer3DModel(
            num_attention_heads=2,
            attention_head_dim=32,
            in_channels=4,
            out_channels=8,  # the noise prediction and a learned variance
            num_layers=2,
            sample_size=16,
            patch_size=2,
            cross_attention_dim=64,  # captions are projected to the inner dim (heads x head dim)
            caption_channels=32,
            norm_type="ada_norm_single",
            video_length=8,
        )
        self.scheduler = DDIMScheduler(num_train_timesteps=1000)
        self.scheduler.set_timesteps(steps)

    @torch.no_grad()
    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        latents, captions = batch
        for t in self.scheduler.timesteps:
            timestep = t.expand(len(latents)).to(latents.device)
            out = self.transformer(latents, timestep=timestep, encoder_hidden_states=captions).sample
            latents = self.scheduler.step(out[:, :4], t, latents).prev_sample
        return latents

    def predict_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        latents = torch.randn(self.videos, 4, 8, 16, 16, generator=g)  # videos, channels, frames, height, width
        captions = torch.randn(self.videos, 6, 32, generator=g)  # 6 caption tokens each
        return DataLoader(TensorDataset(latents, captions), batch_size=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="5 batches of 2 denoising steps (a few seconds)")
    args = parser.parse_args()

    pl.seed_everything(0)
    memopt = MemOpt(memory_budget=BUDGET)
    trainer = pl.Trainer(
        accelerator="cpu",
        logger=CSVLogger(save_dir="lightning_logs", name="latte"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[memopt],
    )
    videos = trainer.predict(VideoSampler(videos=10 if args.quick else 16, steps=2 if args.quick else 8))

    report = memopt.report
    print(f"\nsampled {sum(len(v) for v in videos)} video latents of shape {tuple(videos[0].shape[1:])}")
    print(f"logs (the memopt/ keys): {Path(trainer.logger.log_dir).resolve() / 'metrics.csv'}")
    if report is None or report.saved_fraction is None or report.saved_fraction <= 0:
        raise SystemExit(f"check failed: chunking saved nothing ({report})")
    print(f"chunk settings chosen by dry runs in {report.tuning_s:.2f} s: {report.chunk_settings}")
    print(
        f"peak {report.peak_bytes / 2**20:.2f} MiB (budget {report.budget_bytes / 2**20:.2f} MiB, without chunking"
        f" {report.baseline_peak_bytes / 2**20:.2f} MiB, {report.saved_fraction:.1%} saved)"
    )
    if report.peak_bytes > report.budget_bytes:
        raise SystemExit("check failed: the measured peak is over the budget")


if __name__ == "__main__":
    main()
