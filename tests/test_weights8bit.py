"""Weights kept in 8 bits (issue 34, where results may change): only with ``lossy=True``; the dry runs count the
stored bytes and each layer's copy in its own type to the byte; a budget below the exact floor is met with
``lossy=True`` alone, and what it would reach is said without it; trainable parameters, LoRA adapters, norms and
embeddings keep their type; the weights come back exactly, and a checkpoint saved meanwhile holds the originals."""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_memopt import MemOpt, PeakMemory, estimate
from lightning_memopt.techniques.weights import Host, StoredWeight
from tests import zoo
from tests.helpers import TRAINER_ARGS, Wrapped, heavy

LOSSY = {"weights_8bit": True, "lossy": True}


class Latte(Wrapped):
    """Latte at predict, wide enough (64) that its attention and feed-forward layers are stored."""

    def __init__(self) -> None:
        super().__init__("latte")
        torch.manual_seed(0)
        self.transformer = zoo.latte(attention_head_dim=32, cross_attention_dim=64)


class LoRALlama(Wrapped):
    """A Llama (hidden 64) with LoRA adapters on q_proj and v_proj at fit: its frozen layers are stored."""

    def __init__(self) -> None:
        from peft import LoraConfig, get_peft_model

        super().__init__("peft_llama")
        torch.manual_seed(0)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        self.model = get_peft_model(zoo.llama(hidden=64), config)


def run(model: Wrapped, stage: str, *callbacks: pl.Callback, batches: int = 2) -> Any:
    trainer = pl.Trainer(
        **TRAINER_ARGS, limit_train_batches=batches, limit_predict_batches=batches, callbacks=list(callbacks)
    )
    return trainer.fit(model) if stage == "fit" else trainer.predict(model)


def first_batch(model: Wrapped, stage: str) -> Any:
    return next(iter(model.train_dataloader() if stage == "fit" else model.predict_dataloader()))


def test_it_changes_results_so_it_needs_lossy() -> None:
    with pytest.raises(ValueError, match=r"`weights_8bit=True` keeps the weights in 8 bits.*pass lossy=True"):
        MemOpt(weights_8bit=True)
    with pytest.raises(ValueError, match=r"`weights_8bit='nf4'` keeps the weights in 4 bits \(NF4\).*lossy=True"):
        MemOpt(weights_8bit="nf4")
    with pytest.raises(ValueError, match=r"`weights_8bit` must be True, False, 'auto' or 'nf4', got 'int8'"):
        MemOpt(weights_8bit="int8", lossy=True)


@pytest.mark.parametrize("layer", [nn.Linear(256, 64), nn.Conv2d(16, 32, 3, padding=1)], ids=["linear", "conv"])
def test_a_stored_layer_computes_near_its_own_and_comes_back_exactly(layer: nn.Module) -> None:
    layer.requires_grad_(False)
    given = copy.deepcopy(layer)
    x = torch.randn(2, 256) if isinstance(layer, nn.Linear) else torch.randn(2, 16, 8, 8)
    stored_x, given_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    host, unit = Host(), StoredWeight("layer", layer)
    unit.store(host)
    weight = layer.weight
    layer(stored_x).square().sum().backward()
    given(given_x).square().sum().backward()
    assert 0 < unit.difference < 0.01  # a stored weight's largest difference, relative to the largest
    difference = (stored_x.grad - given_x.grad).abs().max() / given_x.grad.abs().max()
    assert 0 < difference < 0.02
    assert weight.untyped_storage().nbytes() == 4 and weight.isnan().all()  # one NaN: no silent use of it
    assert os.listdir(host.directory) == ["0.bin"]  # the original, off the device in a file on CPU
    assert torch.equal(layer.state_dict()["weight"], given.weight)  # a state dict holds the original
    assert torch.equal(copy.deepcopy(layer).weight, given.weight)  # so does a copy
    unit.restore()
    host.close()
    assert layer.weight is weight and torch.equal(weight, given.weight) and weight.dtype == given.weight.dtype
    assert not list(layer.buffers()) and "forward" not in layer.__dict__ and host.directory is None


@pytest.mark.parametrize("stage", heavy(["fit", "predict"], "fit"))
def test_the_dry_runs_count_the_stored_weights_to_the_byte(stage: str) -> None:
    """The real CPU peak of each step equals ``estimate()``'s, and storing the frozen weights lowers it."""
    make = LoRALlama if stage == "fit" else Latte
    options = {**LOSSY, "chunking": False}  # chunking's choice among equal peaks follows the measured speeds
    probe = PeakMemory()
    run(make(), stage, MemOpt(measure=False, **options), probe)
    exact = estimate(make(), first_batch(make(), stage), stage, chunking=False)
    result = estimate(make(), first_batch(make(), stage), stage, **options)
    assert set(probe.peaks) == {result.memopt.bytes} and result.memopt.bytes < exact.memopt.bytes
    assert result.memopt.by_kind["weights"] < 0.5 * exact.memopt.by_kind["weights"]


def test_the_weights_come_back_exactly_and_trained_ones_keep_their_type(tmp_path: Any) -> None:
    """During the fit the frozen layers hold codes and the LoRA adapters, norms and embeddings their own weights; a
    checkpoint saved then holds every original and loads without MemOpt; afterwards every parameter is the same
    object with the same values and type, and the temporary files are gone."""
    model = LoRALlama()
    given = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    seen: dict[str, Any] = {}

    class During(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
            if seen:
                return
            params = dict(module.named_parameters())
            seen["stored"] = [n for n, p in params.items() if p.untyped_storage().nbytes() < p.nbytes]
            seen["kept"] = {n: p.dtype for n, p in params.items() if p.requires_grad}
            seen["directory"] = next(t._host.directory for t in memopt._fit.techniques if t.name == "weights_8bit")
            trainer.save_checkpoint(tmp_path / "during.ckpt")

    memopt = MemOpt(**LOSSY)
    run(model, "fit", memopt, During())
    stored = seen["stored"]
    projections = ("k_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "base_layer")
    assert len(stored) == 14 and all(n.split(".")[-2] in projections for n in stored)  # 7 in each of 2 blocks
    assert not any("lora" in n or "norm" in n or "embed" in n or "lm_head" in n for n in stored)
    assert all(given[n][0].dtype == dtype for n, dtype in seen["kept"].items())
    # after the fit: the same objects, the frozen ones with their values, no buffer or file of MemOpt's left
    for name, param in model.named_parameters():
        assert param is given[name][0] and param.dtype == given[name][1].dtype
        if not param.requires_grad:
            assert torch.equal(param, given[name][1]), name
    assert not [n for n, _ in model.named_buffers() if "memopt" in n]
    assert seen["directory"] is not None and not os.path.exists(seen["directory"])
    checkpoint = torch.load(tmp_path / "during.ckpt", weights_only=False)["state_dict"]
    fresh = LoRALlama()
    fresh.load_state_dict(checkpoint)  # without MemOpt
    for name, param in fresh.named_parameters():
        if not param.requires_grad:
            assert torch.equal(param, given[name][1]) and param.dtype == given[name][1].dtype, name
    assert memopt.report.weights_8bit_difference is not None and 0 < memopt.report.weights_8bit_difference < 0.01


def test_outputs_at_predict_stay_near_the_plain_ones_and_the_report_says_how_far_the_weights_moved() -> None:
    plain = torch.cat(run(Latte(), "predict", MemOpt(measure=False, chunking=False)))
    memopt = MemOpt(chunking=False, **LOSSY)
    with pytest.warns(UserWarning, match=r"the weights of \d+ layers are kept in 8 bits, which changes results"):
        small = torch.cat(run(Latte(), "predict", memopt))
    difference = ((small - plain).abs().max() / plain.abs().max()).item()
    assert 0 < difference < 0.02
    assert memopt.report.weights_8bit_saved_bytes > 0 and "weights_8bit" in memopt.report.in_force


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_a_budget_below_the_exact_floor_is_met_with_lossy_alone_and_said_without() -> None:
    batch = first_batch(LoRALlama(), "fit")
    # the feed-forward's slices left out: under a budget its finer ones lower the exact floor below this one's
    exact = estimate(LoRALlama(), batch, "fit", checkpointing="auto", chunking=False).memopt.bytes
    small = estimate(LoRALlama(), batch, "fit", checkpointing="auto", chunking=False, **LOSSY).memopt.bytes
    budget = (exact + small) // 2
    probe = PeakMemory()
    with pytest.warns(UserWarning, match=r"keeping the weights of \d+ layers in 8 bits would reach at most \d+ B"):
        exact_only = MemOpt(memory_budget=budget, checkpointing="auto", chunking=False, measure=False)
        run(LoRALlama(), "fit", exact_only, probe)
    assert min(probe.peaks) > budget
    probe, memopt = PeakMemory(), MemOpt(memory_budget=budget, checkpointing="auto", chunking=False, lossy=True)
    run(LoRALlama(), "fit", memopt, probe)
    assert max(probe.peaks) <= budget < exact
    unit = memopt.report.sections["weights_8bit"].settings["weights_8bit"]
    stored, of = (int(w) for w in unit.split()[:3:2])
    assert 0 < stored < of  # the fewest layers that meet it, not every one


def test_without_a_budget_auto_is_not_a_technique_of_the_stage() -> None:
    """With chunking off and no budget, nothing MemOpt would do at predict: no warning that the model has no blocks
    for weights_8bit (it was one on the GPU, where the exact run of the test above said so)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(Latte(), "predict", MemOpt(measure=False, chunking=False), batches=1)
    assert not [str(w.message) for w in caught if "MemOpt" in str(w.message)]
