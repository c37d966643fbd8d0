"""Sample videos with a diffusers pipeline in ``predict_step``: MemOpt chunks the transformer and slices the VAE decode.

A ``LattePipeline`` (a ``LatteTransformer3DModel``, an SD-style ``AutoencoderKL``, a T5 text encoder and its
tokenizer, all built from small configs: untrained, so the videos are noise; the point is the memory) is called in
``predict_step`` as you would call it anywhere: from a prompt, with a generator seeded from the batch, and with its
default output type, so each video comes back as a list of PIL images. The models live on the LightningModule
(``self.transformer``, ``self.vae``, ``self.text_encoder``), so ``MemOpt()`` finds them.

Before the first batch runs, MemOpt dry-runs the whole ``predict_step`` (prompt encoding, the denoising loop and the
decode) on fake tensors: nothing is computed on the weights and no memory is allocated for them. Where the step reads
values out of tensors (the seed, the caption mask's length, the pixels handed to PIL), the dry run takes placeholders,
and after the measured batch the values that batch read. From these dry runs MemOpt chooses each block's chunking and
whether the VAE decodes one frame at a time, prints a summary with the peak with and without its changes, and logs the
figures under ``memopt/`` to a CSV file. A second run without MemOpt checks that the frames are unchanged.

    python examples/sample_pipeline.py          # 4 prompts, 8 denoising steps each
    python examples/sample_pipeline.py --quick  # 2 prompts, 2 denoising steps each
"""

from __future__ import annotations

import argparse
import string
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from diffusers import AutoencoderKL, DDIMScheduler, LattePipeline, LatteTransformer3DModel
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from transformers import T5Config, T5EncoderModel, T5Tokenizer

from lightning_memopt import MemOpt

warnings.filterwarnings("ignore", ".*does not have many workers.*")

PROMPTS = ["a red cat on a wall", "waves at night", "a city in the rain", "an old tree in the wind"]


def tiny_tokenizer() -> T5Tokenizer:
    """A T5 tokenizer over single letters, built in memory (``T5Tokenizer.from_pretrained`` in real use)."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    return T5Tokenizer(vocab=pieces + [(c, -1.0) for c in string.ascii_lowercase], extra_ids=0)


class VideoSampler(pl.LightningModule):
    """Text to video with ``LattePipeline``: one prompt a batch, 4 frames of 32x32 each."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.transformer = LatteTransformer3DModel(
            num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2, sample_size=8,
            patch_size=2, cross_attention_dim=32, caption_channels=32, norm_type="ada_norm_single", video_length=4,
        )  # fmt: skip
        self.vae = AutoencoderKL(
            latent_channels=4, block_out_channels=(16, 32, 32), down_block_types=("DownEncoderBlock2D",) * 3,
            up_block_types=("UpDecoderBlock2D",) * 3, layers_per_block=1, norm_num_groups=8, sample_size=32,
        )  # fmt: skip
        self.text_encoder = T5EncoderModel(
            T5Config(vocab_size=32, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, dropout_rate=0.0)
        )
        self.pipe = LattePipeline(
            tokenizer=tiny_tokenizer(),
            text_encoder=self.text_encoder,
            vae=self.vae,
            transformer=self.transformer,
            scheduler=DDIMScheduler(num_train_timesteps=1000),
        )
        self.pipe.set_progress_bar_config(disable=True)

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[list[Any]]:
        generator = torch.Generator().manual_seed(int(batch["seed"][0]))
        return self.pipe(
            batch["prompt"][0],
            num_inference_steps=self.steps,
            video_length=4,
            height=32,
            width=32,
            generator=generator,
            clean_caption=False,  # True needs beautifulsoup4 and ftfy
        ).frames  # the default output type: a list of PIL images per video

    def predict_dataloader(self) -> DataLoader:
        return DataLoader([{"prompt": p, "seed": i} for i, p in enumerate(PROMPTS)], batch_size=1)


def as_arrays(batches: list[list[list[Any]]]) -> list[np.ndarray]:
    return [np.asarray(frame, dtype=np.int16) for videos in batches for video in videos for frame in video]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 prompts of 2 denoising steps (seconds)")
    args = parser.parse_args()
    steps, prompts = (2, 2) if args.quick else (8, len(PROMPTS))

    pl.seed_everything(0)
    model, memopt = VideoSampler(steps), MemOpt()
    trainer = pl.Trainer(
        accelerator="cpu",
        logger=CSVLogger(save_dir="lightning_logs", name="sample_pipeline"),
        limit_predict_batches=prompts,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[memopt],
    )
    videos = trainer.predict(model)  # MemOpt prints its summary when predict ends

    # the same prompts without MemOpt: the frames must not change (the sliced decode is the same computation per
    # frame, equal up to float rounding, so a pixel may differ by one level of 255)
    plain = pl.Trainer(
        accelerator="cpu", logger=False, limit_predict_batches=prompts, enable_progress_bar=False,
        enable_model_summary=False,
    ).predict(model)  # fmt: skip
    ours, theirs = as_arrays(videos), as_arrays(plain)
    if len(ours) != len(theirs) or any(np.abs(a - b).max() > 1 for a, b in zip(ours, theirs, strict=True)):
        raise SystemExit("check failed: the frames differ from a run without MemOpt")

    report = memopt.report
    print(f"\nsampled {len(videos)} videos of {len(videos[0][0])} frames, {videos[0][0][0].size} PIL images each")
    print(f"logs (the memopt/ keys): {Path(trainer.logger.log_dir).resolve() / 'metrics.csv'}")
    if report is None or report.baseline_peak_bytes is None or report.peak_bytes is None:
        raise SystemExit(f"check failed: MemOpt measured nothing ({report and report.notes})")
    print(f"chosen by dry runs in {report.tuning_s:.2f} s: {report.chunk_settings}; decode: {report.decoding}")
    print(
        f"peak {report.peak_bytes / 2**20:.2f} MiB, without MemOpt {report.baseline_peak_bytes / 2**20:.2f} MiB"
        f" ({report.saved_fraction:.1%} saved; the peak is in {report.peak_part}, without MemOpt in"
        f" {report.baseline_part}); frames unchanged"
    )
    if report.saved_fraction is None or report.saved_fraction <= 0:
        raise SystemExit("check failed: MemOpt saved nothing")


if __name__ == "__main__":
    main()
