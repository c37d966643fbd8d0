"""verify on a batch that holds a tensor the deep-copy protocol refuses: a non-leaf tensor (one computed from a tensor
that requires grad, as a collate function or a transform can leave it), in a collection or in an object's attribute
(a KV cache the first step filled, as diffusers' WanAnimate test batch holds)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_memopt import MemOpt
from tests.helpers import trainer


class Cache:
    """An object of the user's holding a tensor, as a KV cache does."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class NonLeafBatch(pl.LightningModule):
    """A two-block encoder whose batches are non-leaf tensors, or objects holding one."""

    def __init__(self, held: bool = False) -> None:
        super().__init__()
        self.held = held
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.losses: list[float] = []

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        generator = torch.Generator().manual_seed(0)
        leaves = [torch.randn(2, 8, 16, generator=generator, requires_grad=True) for _ in range(2)]
        batches = [leaf * 1.0 for leaf in leaves]  # computed from a leaf that requires grad: not a leaf itself
        assert all(not b.is_leaf for b in batches)
        held = [{"cache": Cache(b)} for b in batches] if self.held else batches
        return torch.utils.data.DataLoader(held, batch_size=None, collate_fn=lambda b: b)

    def training_step(self, batch: torch.Tensor | dict[str, Cache], batch_idx: int) -> torch.Tensor:
        tensor = batch["cache"].tensor if isinstance(batch, dict) else batch
        loss = self.encoder(tensor).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("held", [False, True], ids=["in the batch", "in an object's attribute"])
def test_verify_copies_a_batch_holding_a_non_leaf_tensor(held: bool) -> None:
    """``copy.deepcopy`` raises on a non-leaf tensor ("Only Tensors created explicitly by the user (graph leaves)
    support the deepcopy protocol"); verify's run gets a detached copy of it, finds no difference, and the losses are
    those of a plain run. Held in an object, it crashed verify before."""
    runs = []
    for callbacks in ([], [MemOpt(verify=True)]):
        torch.manual_seed(0)
        model = NonLeafBatch(held)
        trainer(*callbacks).fit(model)
        runs.append((model, callbacks))
    (plain, _), (model, (memopt,)) = runs
    assert memopt.report.batch_idx == 1 and memopt.report.applied
    assert not any(note.startswith("verify") for note in memopt.report.notes)
    assert model.losses == plain.losses
