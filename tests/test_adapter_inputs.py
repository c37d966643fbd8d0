"""PEFT's LoRA adapters in float32 on a bfloat16 base keep their input in bfloat16 for the backward pass, not PEFT's
float32 copy of it (issue 48: at 131,072 tokens of Llama-3-8B each copy is 2 GiB, four per layer): the same adapter
weights to the bit after several AdamW steps, the bytes saved those copies' to the byte, the layers given back as
they were; a layer with dropout is left as PEFT runs it, with one warning, and a base in float32 is not touched."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt import MemOpt, PeakMemory, estimate
from lightning_memopt.techniques.adapter_inputs import UpcastLinear
from tests import zoo
from tests.helpers import TRAINER_ARGS

TOKENS, HIDDEN, LAYERS = 16, 64, 2
ONLY = {"checkpointing": False, "chunked_loss": False, "chunking": False}  # this technique and free_gradients


class LoRA(pl.LightningModule):
    """A 2-layer Llama of width 64, its base in ``base`` type, LoRA (float32) on the attention's four projections."""

    def __init__(self, base: torch.dtype = torch.bfloat16, dropout: float = 0.0) -> None:
        from peft import LoraConfig, get_peft_model

        super().__init__()
        torch.manual_seed(0)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets, init_lora_weights=False)
        self.model = get_peft_model(zoo.llama(layers=LAYERS, hidden=HIDDEN).to(base), config)

    def training_step(self, batch: Any) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        ids = torch.randint(0, 128, (6, TOKENS), generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(ids), batch_size=2)


def fit(model: LoRA, *callbacks: pl.Callback) -> dict[str, torch.Tensor]:
    pl.Trainer(**TRAINER_ARGS, max_steps=3, callbacks=list(callbacks)).fit(model)
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_the_adapters_train_to_the_same_bits_and_save_their_float32_copies() -> None:
    plain = fit(LoRA())
    model, memopt, probe = LoRA(), MemOpt(**ONLY), PeakMemory()
    given = {n: p.detach().clone() for n, p in model.named_parameters()}
    layer = model.model.base_model.model.model.layers[0].self_attn.q_proj
    ours = fit(model, memopt, probe)
    assert plain.keys() == ours.keys() and all(torch.equal(plain[n], ours[n]) for n in plain)
    # per layer: the four float32 copies of a batch's hidden states (2 x 16 x 64) go; o_proj keeps its bfloat16 input
    copy32, input16 = 2 * TOKENS * HIDDEN * 4, 2 * TOKENS * HIDDEN * 2
    assert memopt.report.adapter_inputs_saved_bytes == LAYERS * (4 * copy32 - input16)
    applied = [(a.technique, a.blocks, a.unit) for a in memopt.report.applied]
    assert ("adapter_inputs", 4 * LAYERS, "layer") in applied
    # the dry runs count it: the real peak of a step with AdamW's state (the second on) is estimate()'s
    batch = next(iter(LoRA().train_dataloader()))
    assert set(probe.peaks[1:]) == {estimate(LoRA(), batch, "fit", **ONLY).memopt.bytes}
    # given back as it was
    assert layer.__dict__["cast_input_dtype_enabled"] is True and "forward" not in layer.lora_A["default"].__dict__
    assert all(torch.equal(p, given[n]) for n, p in model.named_parameters() if not p.requires_grad)


def test_an_adapter_with_dropout_is_left_as_peft_runs_it_with_one_warning() -> None:
    with pytest.warns(
        UserWarning, match=r"8 LoRA layers \(.*q_proj, \.\.\.\) keep a copy .*adapter 'default' has dropout"
    ):
        memopt = MemOpt(**ONLY)
        fit(LoRA(dropout=0.1), memopt)
    assert "adapter_inputs" not in [a.technique for a in memopt.report.applied]
    assert memopt.report.adapter_inputs_saved_bytes is None


def test_a_float32_base_has_no_wider_copy_and_is_not_touched(recwarn: pytest.WarningsRecorder) -> None:
    memopt = MemOpt(**ONLY)
    fit(LoRA(base=torch.float32), memopt)
    assert "adapter_inputs" not in [a.technique for a in memopt.report.applied]
    assert not [w for w in recwarn if "LoRA layer" in str(w.message)]


@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16])
def test_the_product_gives_the_gradients_of_the_cast_then_the_product_to_the_bit(narrow: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8).to(narrow)
    layer = torch.nn.Linear(8, 4)
    theirs, ours = (x.clone().requires_grad_(), copy.deepcopy(layer)), (x.clone().requires_grad_(), layer)
    F.linear(theirs[0].to(torch.float32), theirs[1].weight, theirs[1].bias).square().sum().backward()
    UpcastLinear.apply(ours[0], ours[1].weight, ours[1].bias).square().sum().backward()
    assert ours[0].grad.dtype == narrow and torch.equal(ours[0].grad, theirs[0].grad)
    assert torch.equal(ours[1].weight.grad, theirs[1].weight.grad) and torch.equal(
        ours[1].bias.grad, theirs[1].bias.grad
    )
