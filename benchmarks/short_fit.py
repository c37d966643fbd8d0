"""A short fit, as a user's script runs it: 20 AdamW steps of a small encoder (4 layers of width 256, 16 sequences
of 128 tokens), with or without ``MemOpt()``, one process each. Timed from outside, the two in alternation, by a
whole-command timer: the second run of the MemOpt script reuses the plan and the baseline kept by the first
(``LIGHTNING_MEMOPT_CACHE_DIR``), which is what a user's second run of the same script costs.

    python -m benchmarks.short_fit            # plain
    python -m benchmarks.short_fit --memopt   # with MemOpt()

Nothing is asserted; docs/results.md has the ratio it measured.
"""

from __future__ import annotations

import argparse
import warnings

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Encoder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.encoder(batch[0]).pow(2).mean()
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        data = torch.randn(20 * 16, 128, 256, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(data), batch_size=16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memopt", action="store_true", help="fit with MemOpt()")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    callbacks = []
    if args.memopt:
        from lightning_memopt import MemOpt

        callbacks.append(MemOpt())
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(Encoder())


if __name__ == "__main__":
    main()
