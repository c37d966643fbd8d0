"""Frozen weights in 4 bits (NF4, issue 48): a further setting of the weights' knob after 8 bits, only with
``lossy=True``: a stored layer computes near its own and comes back exactly, the dry runs count the 4-bit weights to
the byte, outputs stay near plain's with the difference reported, and a budget that 8 bits on every layer cannot meet
is met by storing the largest layers in 4 bits."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_memopt import MemOpt, PeakMemory, estimate
from lightning_memopt.techniques.weights import Host, StoredWeight
from tests.test_weights8bit import Latte, LoRALlama, first_batch, run

NF4 = {"weights_8bit": "nf4", "lossy": True}


@pytest.mark.parametrize("layer", [nn.Linear(256, 64), nn.Conv2d(16, 32, 3, padding=1)], ids=["linear", "conv"])
def test_a_layer_stored_in_4_bits_computes_near_its_own_and_comes_back_exactly(layer: nn.Module) -> None:
    layer.requires_grad_(False)
    given = copy.deepcopy(layer)
    torch.manual_seed(0)
    x = torch.randn(2, 256) if isinstance(layer, nn.Linear) else torch.randn(2, 16, 8, 8)
    host, unit = Host(), StoredWeight("layer", layer)
    unit.store(host, bits=4)
    codes = layer._buffers["_memopt_codes"]
    assert codes.numel() == layer.weight.numel() // 2  # two codes to a byte
    assert 0.01 < unit.difference < 0.2  # coarser than 8 bits' (under 0.01)
    difference = (layer(x) - given(x)).abs().max() / given(x).abs().max()
    assert 0 < difference < 0.2  # NF4's levels suit normal weights; these are uniform (PyTorch's default init)
    assert unit.saving_at(4) > unit.saving_at(8) > 0
    unit.restore()
    host.close()
    assert torch.equal(layer.weight, given.weight) and not list(layer.buffers())


@pytest.mark.parametrize("stage", ["fit", pytest.param("predict", marks=pytest.mark.slow)])
def test_the_dry_runs_count_the_4_bit_weights_to_the_byte(stage: str) -> None:
    make = LoRALlama if stage == "fit" else Latte
    options = {**NF4, "chunking": False}
    probe = PeakMemory()
    run(make(), stage, MemOpt(measure=False, **options), probe)
    eight = estimate(make(), first_batch(make(), stage), stage, chunking=False, weights_8bit=True, lossy=True)
    four = estimate(make(), first_batch(make(), stage), stage, **options)
    assert set(probe.peaks) == {four.memopt.bytes}
    assert four.memopt.by_kind["weights"] < eight.memopt.by_kind["weights"]


def test_outputs_stay_near_plain_the_difference_is_reported_and_the_weights_come_back() -> None:
    model = Latte()
    given = {n: p.detach().clone() for n, p in model.named_parameters()}
    plain = torch.cat(run(Latte(), "predict", MemOpt(measure=False, chunking=False)))
    memopt = MemOpt(chunking=False, **NF4)
    kept = r"the weights of \d+ layers are kept in 4 bits \(NF4\), which changes results"
    with pytest.warns(UserWarning, match=kept):
        small = torch.cat(run(model, "predict", memopt))
    difference = ((small - plain).abs().max() / plain.abs().max()).item()
    assert 0 < difference < 0.2
    assert 0.01 < memopt.report.weights_8bit_difference < 0.2
    assert "in 4 bits (NF4)" in memopt.report.sections["weights_8bit"].settings["weights_8bit"]
    assert all(torch.equal(p, given[n]) for n, p in model.named_parameters())


@pytest.mark.slow  # a planner's choice under budgets, with and without lossy: 3 s
def test_a_budget_8_bits_cannot_meet_is_met_in_4_bits_with_lossy_and_never_without() -> None:
    batch = first_batch(Latte(), "predict")
    eight = estimate(Latte(), batch, "predict", chunking=False, weights_8bit=True, lossy=True).memopt.bytes
    four = estimate(Latte(), batch, "predict", chunking=False, **NF4).memopt.bytes
    budget = (eight + four) // 2
    planned = estimate(Latte(), batch, "predict", chunking=False, memory_budget=budget, lossy=True)
    assert planned.memopt.bytes <= budget and "in 4 bits (NF4)" in planned.how
    exact = estimate(Latte(), batch, "predict", chunking=False, memory_budget=budget)
    assert "4 bits" not in exact.how and "8 bits" not in exact.how
