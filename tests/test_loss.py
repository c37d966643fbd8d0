"""The loss of causal language models computed in chunks at fit (``MemOpt(chunked_loss=True)``, the default): the
same loss and gradients as the model's own for every family it takes, the logits readable, bad input treated as the
model treats it, and the real step's peak far below checkpointing's alone, exact against its dry run."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_memopt import MemOpt, estimate
from lightning_memopt.adapters import find_models
from lightning_memopt.engine.changes import Changes
from lightning_memopt.engine.config import MemOptConfig
from lightning_memopt.techniques.loss import ChunkedLoss, chunked_cross_entropy
from lightning_memopt.techniques.loss.core import chunk_tokens
from tests import zoo
from tests.helpers import TRAINER_ARGS

VOCAB = 512


def own_loss(logits: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels, logits.shape[-1], **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_the_chunked_loss_is_the_models_own(dtype: torch.dtype, bias: bool) -> None:
    """37 tokens in chunks of 8 (the last one short), some labels ignored, against transformers' ForCausalLMLoss on
    the whole logits: the loss in float32 both ways, equal; the gradients equal in float32, and in bf16 within the
    rounding of one bf16 matrix product (the chunked one sums in float32)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 37, 16, generator=generator).to(dtype).requires_grad_()
    weight = torch.randn(1000, 16, generator=generator).to(dtype).requires_grad_()
    head_bias = torch.randn(1000, generator=generator).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, 1000, (2, 37), generator=generator)
    labels[0, :5] = -100
    inputs = [t for t in (hidden, weight, head_bias) if t is not None]
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(50)}):
        theirs = own_loss(F.linear(hidden, weight, head_bias), labels, **kwargs)
        mine = chunked_cross_entropy(hidden, weight, head_bias, labels, chunk=8, **kwargs)
        assert mine.dtype == theirs.dtype == torch.float32
        assert torch.allclose(mine, theirs, rtol=1e-6, atol=0)
        for a, b in zip(torch.autograd.grad(theirs, inputs), torch.autograd.grad(mine, inputs), strict=True):
            limit = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: 2 ** -7 of the largest gradient
            assert (a.float() - b.float()).abs().max() <= limit * a.float().abs().max()


def test_labels_all_ignored_give_what_the_models_own_loss_gives() -> None:
    hidden, weight = torch.randn(1, 6, 8), torch.randn(40, 8)
    labels = torch.full((1, 6), -100)
    assert own_loss(F.linear(hidden, weight), labels).isnan()  # a mean over nothing
    assert chunked_cross_entropy(hidden, weight, None, labels).isnan()
    n = torch.tensor(3)
    assert own_loss(F.linear(hidden, weight), labels, num_items_in_batch=n) == 0
    assert chunked_cross_entropy(hidden, weight, None, labels, num_items_in_batch=n) == 0


def test_a_chunk_holds_about_as_many_logits_as_there_are_hidden_values() -> None:
    assert chunk_tokens(4096, 4096, 128_256) == 128  # 32 chunks: each 128 x 128,256 logits
    assert chunk_tokens(100, 16, 4096) == 4  # at most 32 chunks
    assert chunk_tokens(10, 64, 32) == 10  # a vocabulary narrower than the width: one chunk


def holder(model: nn.Module) -> nn.Module:
    """A module holding ``model`` as its attribute ``lm``, as a LightningModule holds its models."""
    root = nn.Module()
    root.lm = model
    return root


def applied(model: nn.Module, **options: Any) -> Changes:
    config = MemOptConfig(checkpointing=False, chunking=False, **options)
    changes = Changes("fit", find_models(holder(model), None), config, print)
    changes.apply(quiet=True)
    return changes


def step(model: nn.Module, ids: torch.Tensor, labels: Any, read: bool = False) -> tuple[Any, ...]:
    """A training step's loss, gradients and (``read``) logits."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, out.logits.detach() if read else None


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)


@pytest.mark.parametrize("name", [n for n in zoo.CAUSAL_LMS if n != "gemma2"])
def test_every_family_gives_the_loss_gradients_and_logits_of_its_own_loss(name: str) -> None:
    torch.manual_seed(0)
    model = zoo.causal_lm(name).train()
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :3] = -100
    loss, grads, logits = step(model, ids, labels, read=True)
    changes = applied(model)
    (technique,) = [t for t in changes.techniques if isinstance(t, ChunkedLoss)]
    assert [u.setting for u in technique.units] == ["chunked"]
    chunked_loss, chunked_grads, chunked_logits = step(model, ids, labels, read=True)
    changes.remove()
    assert torch.allclose(chunked_loss, loss, rtol=1e-6) and close(chunked_grads, grads)
    assert torch.equal(chunked_logits, logits)  # read: computed then, from the same hidden states
    assert "forward" not in model.__dict__ and "_loss_function" not in model.__dict__  # undone
    assert "forward" not in model.get_output_embeddings().__dict__


def test_soft_capped_logits_are_left_to_the_model_with_a_warning_naming_it() -> None:
    model = zoo.causal_lm("gemma2")  # final_logit_softcapping=30.0
    with pytest.warns(UserWarning, match=r"Gemma2ForCausalLM.*soft-capped \(`final_logit_softcapping=30.0`\)"):
        changes = Changes("fit", find_models(holder(model), None), MemOptConfig(checkpointing=False), print)
        changes.apply()
    assert changes.applied == [] and "forward" not in model.__dict__
    changes.remove()
    uncapped = applied(zoo.causal_lm("gemma2", final_logit_softcapping=None))
    assert [a.technique for a in uncapped.applied] == ["loss"]
    uncapped.remove()


def test_a_lora_model_is_taken_through_its_wrapper() -> None:
    torch.manual_seed(0)
    model = zoo.lora_llama()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    loss, grads, _ = step(model, ids, ids)
    assert grads and all("lora" in n for n in grads)
    changes = applied(model)
    assert [a.technique for a in changes.applied] == ["loss"]
    chunked_loss, chunked_grads, _ = step(model, ids, ids)
    changes.remove()
    assert torch.allclose(chunked_loss, loss, rtol=1e-6) and close(chunked_grads, grads)


@pytest.mark.parametrize(
    "labels",
    [
        torch.zeros(2, 20, dtype=torch.long),  # fewer labels than tokens
        torch.zeros(2, 24, dtype=torch.int32),  # not torch.long
        torch.zeros(2, 24, dtype=torch.float32),
    ],
)
def test_bad_labels_give_the_models_own_error_or_result(labels: torch.Tensor) -> None:
    model = zoo.causal_lm("llama")
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))

    def outcome() -> Any:
        try:
            return model(input_ids=ids, labels=labels).loss.item()
        except Exception as error:  # noqa: BLE001 (the error is what is compared)
            return f"{type(error).__name__}: {error}"

    own = outcome()
    changes = applied(model)
    chunked = outcome()
    changes.remove()
    assert chunked == own


class CausalLM(pl.LightningModule):
    """A causal LM whose vocabulary (8192) is 256x its width (32), one batch of 2 x 64 tokens; its step reads the
    logits with ``read``."""

    def __init__(self, read: bool = False, vocab: int = 8192) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = zoo.causal_lm("llama", vocab_size=vocab, num_hidden_layers=2)
        self.batch = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(1))
        self.read = read

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        out = self.model(input_ids=batch, labels=batch)
        if self.read:
            self.log("accuracy", (out.logits.argmax(-1) == batch).float().mean())
        return out.loss

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader([self.batch] * 3, batch_size=None)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@functools.cache
def default_estimate(read: bool) -> Any:
    """``estimate`` of a fit step of :class:`CausalLM` with MemOpt's defaults (it changes nothing of the model):
    computed once per process, read by the tests here and in ``tests/test_fit_chunking.py``."""
    model = CausalLM(read)
    return estimate(model, model.batch, stage="fit")


#: The tests that read ``default_estimate()``, on one xdist worker.
default_estimated = pytest.mark.xdist_group("causal_lm_default_estimate")


def fit(model: pl.LightningModule, memopt: MemOpt) -> MemOpt:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(**{**TRAINER_ARGS, "max_epochs": 1, "limit_train_batches": 3}, callbacks=[memopt]).fit(model)
    return memopt


@pytest.mark.slow  # heavy: run by CI with -m slow
@pytest.mark.parametrize("read", [pytest.param(False, marks=default_estimated), True])
def test_the_real_peak_is_under_half_of_checkpointing_alone_and_exact_against_the_dry_run(read: bool) -> None:
    """``verify=True`` compares the loss and every gradient with a step without MemOpt; the step that reads the
    logits gets them, and the report says what reading them cost."""
    model = CausalLM(read)
    alone = estimate(model, model.batch, stage="fit", chunked_loss=False).memopt.bytes
    planned = default_estimate(read)  # of the same model, as built
    memopt = fit(model, MemOpt(verify=True))
    report = memopt.report
    assert report.loss == "in chunks" and report.peak_bytes == planned.memopt.bytes
    if read:
        assert report.logits_read_bytes == 2 * 64 * 8192 * 4  # float32 logits of the batch
        assert "logits read by the step: computed when read (4.00 MiB)" in str(report)
    else:
        assert report.peak_bytes < alone / 2 and report.logits_read_bytes is None
    assert "forward" not in model.model.__dict__ and "_loss_function" not in model.model.__dict__


def test_without_a_budget_the_loss_is_chunked_only_where_the_logits_hold_the_peak() -> None:
    """A vocabulary as narrow as the width: the logits hold no peak, and the loss is left as the model computes it."""
    model = CausalLM(vocab=32)
    result = estimate(model, model.batch, stage="fit")
    assert "loss: as the model computes it" in result.how


@pytest.mark.slow  # the planner weighs every block's mode with the loss: 20 s of dry runs
def test_under_a_budget_the_blocks_modes_and_the_loss_are_chosen_together() -> None:
    """A budget no mode of checkpointing reaches alone (its lowest peak is 3x the budget) but a chunked loss does,
    with room left: the loss is chunked and the blocks recompute less than every block in full would."""
    model = CausalLM()
    alone = estimate(model, model.batch, stage="fit", chunked_loss=False)  # every block checkpointed
    lowest = estimate(model, model.batch, stage="fit")  # and the loss chunked
    assert alone.memopt.bytes > 3 * lowest.memopt.bytes
    budget = 2 * lowest.memopt.bytes
    chosen = estimate(model, model.batch, stage="fit", checkpointing="auto", memory_budget=budget)
    assert chosen.memopt.bytes <= budget and "loss: in chunks" in chosen.how
    assert chosen.recompute_flops < lowest.recompute_flops
    assert chosen.saved_by["loss"] > alone.memopt.bytes - budget  # what reaching the budget took
