"""The feed-forward chunked along the sequence at fit: the same loss and gradients, in a block that is checkpointed
and in one that is not, and less memory where the sequence holds several widths."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_memopt import estimate
from lightning_memopt.adapters import find_models
from lightning_memopt.engine.changes import Changes
from lightning_memopt.engine.config import MemOptConfig
from lightning_memopt.memory import CPUPeakTracker
from lightning_memopt.techniques import Checkpointing, FitChunking, fit_chunking
from lightning_memopt.techniques.fit_chunking import slices
from tests import zoo
from tests.test_loss import CausalLM, default_estimate, default_estimated, holder


def step(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    model.zero_grad(set_to_none=True)
    with CPUPeakTracker() as tracker:
        tracker.add(model.parameters())
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, tracker.peak


def wide_lm(hidden: int, intermediate: int, tokens: int) -> Any:
    """:class:`CausalLM` as a 2-layer Llama of width ``hidden`` through a feed-forward of ``intermediate``, one batch of
    ``tokens`` (vocabulary 64)."""
    model = CausalLM(vocab=64)
    model.model = zoo.causal_lm(
        "llama", vocab_size=64, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2
    )
    model.batch = torch.randint(0, 64, (1, tokens), generator=torch.Generator().manual_seed(1))
    return model


@pytest.mark.parametrize(("checkpointed", "setting"), [(False, "chunked"), (True, "chunked"), (True, "finer")])
def test_a_chunked_feed_forward_gives_the_same_loss_and_gradients_for_less_memory(
    checkpointed: bool, setting: str
) -> None:
    """A Llama of width 16 on 128 tokens: 8 slices a feed-forward (``"finer"``: 32)."""
    torch.manual_seed(0)
    model = zoo.causal_lm("llama", hidden_size=16, intermediate_size=256, num_hidden_layers=2, vocab_size=64)
    ids = torch.randint(0, 64, (2, 128), generator=torch.Generator().manual_seed(1))
    changes = Changes(
        "fit", find_models(holder(model), None), MemOptConfig(checkpointing=checkpointed, chunked_loss=False), print
    )
    changes.apply(quiet=True)
    chunking = changes.technique(FitChunking)
    assert len(chunking.units) == 2 and slices(128, 16) == 8 and slices(128, 16, "finer") == 32
    plain = step(model, ids)
    for unit in chunking.units:
        unit.setting = setting
    assert chunking.changed and chunking.chunked == 2  # in force, as the report and the stage read it
    chunked = step(model, ids)
    assert all(u.pieces[setting] == slices(128, 16, setting) for u in chunking.units)
    if checkpointed:
        assert all(u.mode == "full" for u in changes.technique(Checkpointing).switches)
    changes.remove()
    assert torch.allclose(chunked[0], plain[0], rtol=1e-6)
    assert all(torch.allclose(chunked[1][k], v, rtol=1e-5, atol=1e-7) for k, v in plain[1].items())
    # the intermediate (2 x 128 x 256 floats, three of them) lives one slice at a time
    assert chunked[2] < plain[2] - 2 * 128 * 256 * 4
    assert "forward" not in model.model.layers[0].mlp.__dict__


@pytest.mark.slow  # heavy: run by CI with -m slow
@default_estimated  # with tests/test_loss.py's test that reads the same estimate
def test_without_a_budget_the_feed_forward_stays_whole_where_chunking_lowers_nothing() -> None:
    """64 tokens of width 32: two slices, which lower no peak of this step."""
    result = default_estimate(False)  # of CausalLM()
    assert "feed-forward chunked at fit" not in result.how and result.memopt.bytes is not None


@pytest.mark.slow  # two estimates whose planner weighs every block's feed-forward: 11 s
def test_a_sequence_of_several_widths_gets_its_feed_forward_chunked_where_a_budget_needs_it() -> None:
    """512 tokens of width 16 through a wide feed-forward (1024): its intermediate holds the peak. Without a budget it
    stays whole (the slices' checkpoints cost time); under a budget below that peak it is chunked."""

    model = wide_lm(hidden=16, intermediate=1024, tokens=512)
    whole = estimate(model, model.batch, stage="fit", chunking=False)
    default = estimate(model, model.batch, stage="fit")  # each slice costs time: not without a budget that needs it
    assert "feed-forward chunked" not in default.how and default.memopt.bytes == whole.memopt.bytes
    # the optimizer step in the backward pass meets such a budget too, predicted faster here: left out to see the
    # feed-forward chunked
    chunked = estimate(
        model, model.batch, stage="fit", memory_budget=whole.memopt.bytes - 1, optimizer_in_backward=False
    )
    assert "feed-forward chunked at fit in" in chunked.how
    assert chunked.memopt.bytes < whole.memopt.bytes


@pytest.mark.slow  # two estimates whose planner weighs every block's feed-forward at three settings
def test_a_sequence_of_one_width_gets_finer_slices_where_a_budget_needs_them() -> None:
    """64 tokens of width 64: one slice by the width's rule, which lowers nothing; a budget below the whole
    feed-forward's peak gets finer slices (4 of 16 tokens); without a budget it stays whole."""

    model = wide_lm(hidden=64, intermediate=4096, tokens=64)
    whole = estimate(model, model.batch, stage="fit", chunking=False, optimizer_in_backward=False)
    default = estimate(model, model.batch, stage="fit", optimizer_in_backward=False)
    assert "feed-forward chunked" not in default.how and default.memopt.bytes == whole.memopt.bytes
    finer = estimate(  # every block checkpointed, as without a budget: the feed-forward's slices alone meet it
        model,
        model.batch,
        stage="fit",
        memory_budget=whole.memopt.bytes - 1,
        optimizer_in_backward=False,
        checkpointing=True,
    )
    assert "4x finer slices" in finer.how, finer.how
    assert finer.memopt.bytes <= whole.memopt.bytes - 1


def test_a_feed_forward_that_draws_dropout_masks_is_left_whole_with_a_warning() -> None:
    """Slices would draw other masks than the whole layer: GPT-2's MLP (dropout 0.1) is not chunked."""
    model = zoo.build(
        "GPT2LMHeadModel", dict(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=128), "GPT2Config"
    )
    with pytest.warns(UserWarning, match=r"feed-forward of 2 blocks is not chunked at fit: its dropout \(`dropout` "):
        changes = Changes("fit", find_models(holder(model), None), MemOptConfig(checkpointing=False), print)
        changes.apply()
    assert changes.technique(FitChunking).units == []
    changes.remove()


def test_a_blocks_norms_run_in_the_feed_forwards_slices_for_less_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 48: at 131,072 tokens of Llama-3-8B a float32 norm's backward pass held 10 GiB at once. A Llama of width 64
    on 512 tokens (8 slices), its feed-forward narrow (64): the same loss, gradients within the feed-forward's bounds,
    and a peak lower than with the feed-forward alone in slices by more than 1.5 float32 copies of the hidden states
    (measured: 1.9)."""

    def run(norms: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        torch.manual_seed(0)
        model = zoo.causal_lm("llama", hidden_size=64, intermediate_size=64, num_hidden_layers=2, vocab_size=64)
        ids = torch.randint(0, 64, (1, 512), generator=torch.Generator().manual_seed(1))
        with monkeypatch.context() as patched:
            if not norms:
                patched.setattr(fit_chunking, "find_token_norms", lambda block, skip: [])
            changes = Changes("fit", find_models(holder(model), None), MemOptConfig(), print)
            changes.apply(quiet=True)
        units = changes.technique(FitChunking).units
        assert [len(u.norms) for u in units] == ([2, 2] if norms else [0, 0])
        for unit in units:
            unit.setting = "chunked"
        result = step(model, ids)
        changes.remove()
        layer = model.model.layers[0]
        assert (
            "forward" not in layer.input_layernorm.__dict__ and "forward" not in layer.post_attention_layernorm.__dict__
        )
        return result

    sliced, alone = run(True), run(False)
    assert torch.equal(sliced[0], alone[0])
    assert all(torch.allclose(sliced[1][k], v, rtol=1e-5, atol=1e-7) for k, v in alone[1].items())
    assert sliced[2] < alone[2] - 1.5 * 512 * 64 * 4
