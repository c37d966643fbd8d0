"""verify on a batch that holds a tensor the deep-copy protocol refuses: a non-leaf tensor (one computed from a tensor
that requires grad, as a collate function or a transform can leave it)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_memopt import MemOpt
from tests.helpers import trainer


class NonLeafBatch(pl.LightningModule):
    """A two-block encoder whose batches are non-leaf tensors."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.losses: list[float] = []

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        generator = torch.Generator().manual_seed(0)
        leaves = [torch.randn(2, 8, 16, generator=generator, requires_grad=True) for _ in range(2)]
        batches = [leaf * 1.0 for leaf in leaves]  # computed from a leaf that requires grad: not a leaf itself
        assert all(not b.is_leaf for b in batches)
        return torch.utils.data.DataLoader(batches, batch_size=None)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.encoder(batch).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_verify_copies_a_batch_holding_a_non_leaf_tensor() -> None:
    """``copy.deepcopy`` raises on a non-leaf tensor ("Only Tensors created explicitly by the user (graph leaves)
    support the deepcopy protocol"); verify's run gets a detached copy of it, finds no difference, and the losses are
    those of a plain run."""
    runs = []
    for callbacks in ([], [MemOpt(verify=True)]):
        torch.manual_seed(0)
        model = NonLeafBatch()
        trainer(*callbacks).fit(model)
        runs.append((model, callbacks))
    (plain, _), (model, (memopt,)) = runs
    assert memopt.report.batch_idx == 1 and memopt.report.applied
    assert not any(note.startswith("verify") for note in memopt.report.notes)
    assert model.losses == plain.losses
