r"""A LightningCLI script that knows nothing of lightning_memopt: MemOpt comes in through flags or the YAML config.

    python examples/cli/train.py fit --config examples/cli/config.yaml
    python examples/cli/train.py fit --trainer.callbacks+=lightning_memopt.MemOpt \
        --trainer.callbacks.checkpointing=auto --trainer.callbacks.memory_budget=12MiB
    python examples/cli/train.py fit --config examples/cli/config.yaml --print_config

The model is a small transformer encoder on generated sequences, so nothing is downloaded.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class SequenceModel(pl.LightningModule):
    """Regresses each position of a random sequence through a stack of transformer layers.

    Args:
        layers: How many encoder layers.
        width: The model width.
        length: The sequence length.
    """

    def __init__(self, layers: int = 4, width: int = 64, length: int = 128) -> None:
        super().__init__()
        self.save_hyperparameters()
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.head(self.encoder(x)).squeeze(-1), y)
        self.log("train_loss", loss)
        return loss

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.head(self.encoder(batch[0]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def _data(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, self.hparams.length, self.hparams.width, generator=g)
        return DataLoader(TensorDataset(x, x.mean(-1)), batch_size=8)

    def train_dataloader(self) -> DataLoader:
        return self._data()

    def predict_dataloader(self) -> DataLoader:
        return self._data()


if __name__ == "__main__":
    # a short run by default (Lightning's own default is 1000 epochs); flags and the config override it
    LightningCLI(SequenceModel, trainer_defaults={"max_epochs": 1, "limit_train_batches": 4})
