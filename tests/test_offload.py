"""Host offload (issue 48). (a) The optimizer's state in host memory: ``optimizer_in_backward="host"`` steps each
parameter in host memory as its gradient arrives, so the device holds no optimizer state. (b) The inputs a checkpointed
block keeps for its recomputation in host memory: the ``"offload"`` mode (``checkpointing="offload"``, or the planner's
choice on an accelerator). On this CPU-only machine the host is the device: forced, the weights, state and schedule
equal a plain run's bit for bit and the real peak equals the estimate's; for a CUDA device, the estimate counts the
bytes on the host; the planner offers both only on an accelerator, and there chooses them where the budget needs it."""

from __future__ import annotations

import weakref
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_memopt import MemOpt, PeakMemory, estimate
from lightning_memopt.techniques.checkpointing import CheckpointUnit, apply_checkpointing
from lightning_memopt.techniques.stepping import to_devices
from tests import zoo
from tests.helpers import heavy
from tests.test_stepping import Tuned, assert_same_training, fit


def batch_of(model: Any) -> Any:
    return next(iter(model.train_dataloader()))


def test_forced_it_gives_plain_adamws_weights_state_and_schedule_and_puts_the_state_back() -> None:
    plain, stepped = Tuned(), Tuned()
    fit(plain, batches=4)
    memopt = MemOpt(optimizer_in_backward="host")
    run = fit(stepped, memopt, batches=4)
    assert memopt.report.optimizer_in_backward.endswith("its state on the host")
    assert_same_training(plain, stepped)
    assert stepped.losses == plain.losses
    lrs = [c.scheduler.get_last_lr() for c in (run.lr_scheduler_configs[0], plain.trainer.lr_scheduler_configs[0])]
    assert lrs[0] == lrs[1]
    optimizer = run.optimizers[0]
    assert {id(p) for p in optimizer.state} == {id(p) for g in optimizer.param_groups for p in g["params"]}


def test_forced_its_real_cpu_peak_equals_the_estimate() -> None:
    probe = PeakMemory()
    fit(Tuned(), MemOpt(measure=False, optimizer_in_backward="host"), probe)
    model = Tuned()
    result = estimate(model, batch_of(model), "fit", optimizer_in_backward="host")
    assert probe.peaks[1] == probe.peaks[2] == result.memopt.bytes


@pytest.mark.slow  # two estimates for a CUDA stand-in: 4 s
def test_for_a_cuda_device_the_state_is_counted_on_the_host() -> None:
    model = Tuned()
    state = 2 * sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)  # AdamW's two moments, fp32
    on_device = estimate(model, batch_of(model), "fit", device="cuda", optimizer_in_backward=True)
    on_host = estimate(model, batch_of(model), "fit", device="cuda", optimizer_in_backward="host")
    assert on_device.memopt.by_kind["optimizer"] >= state
    assert on_host.memopt.by_kind["optimizer"] < 1024  # the step counts alone
    assert on_host.memopt.elsewhere["host"] >= state
    assert on_host.memopt.bytes <= on_device.memopt.bytes - state // 2


@pytest.mark.slow  # five estimates for a CUDA stand-in: 10 s
def test_the_planner_chooses_it_on_an_accelerator_where_the_budget_needs_it_and_never_on_a_cpu() -> None:
    model = Tuned()
    exact = estimate(model, batch_of(model), "fit", device="cuda", optimizer_in_backward=True).memopt.bytes
    host = estimate(model, batch_of(model), "fit", device="cuda", optimizer_in_backward="host").memopt.bytes
    budget = (exact + host) // 2
    planned = estimate(model, batch_of(model), "fit", device="cuda", memory_budget=budget)
    assert "state on the host" in planned.how and planned.memopt.bytes <= budget
    cpu = estimate(model, batch_of(model), "fit", memory_budget=budget)  # the host is the device: nothing to offer
    assert "host" not in cpu.how


def test_the_state_goes_back_to_each_parameters_device_and_step_counts_stay() -> None:
    """What the stage's end does to an optimizer whose state was kept on the host (here a parameter on the meta device
    stands for an accelerator's)."""
    w = torch.nn.Parameter(torch.ones(4, device="meta"))
    adam = torch.optim.Adam([w])
    adam.state[w] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}
    to_devices(adam)
    assert adam.state[w]["exp_avg"].is_meta and adam.state[w]["exp_avg_sq"].is_meta
    assert adam.state[w]["step"].device.type == "cpu"  # a step count stays where the optimizer keeps it


# offload (b): the inputs a checkpointed block keeps for its recomputation, in host memory ----------------------------


class Dropping(Tuned):
    """A fine-tune whose blocks draw dropout masks: the recomputation must draw the same ones."""

    def __init__(self, case: str) -> None:
        super().__init__(case)
        torch.manual_seed(1)
        if case == "llama":  # transformers' own switch calls MemOpt's checkpoint function
            self.model = zoo.llama(attention_dropout=0.2)
        else:  # MemOpt's generic wrapper
            layer = nn.TransformerEncoderLayer(32, 2, 128, dropout=0.2, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)


@pytest.mark.parametrize("case", ["llama", "torch_encoder"])
def test_forced_checkpoint_inputs_on_the_host_give_plain_weights_bit_for_bit(case: str) -> None:
    plain, offloaded = Dropping(case), Dropping(case)
    torch.manual_seed(5)
    fit(plain, batches=3)
    memopt = MemOpt(checkpointing="offload")
    torch.manual_seed(5)
    fit(offloaded, memopt, batches=3)
    blocks = int(memopt.report.checkpointed.split(" of ")[0])
    assert memopt.report.checkpointed.endswith(" offload)") and blocks > 0
    assert offloaded.losses == plain.losses
    assert_same_training(plain, offloaded)


def test_a_block_in_offload_mode_keeps_no_reference_to_its_input_and_gives_the_same_gradients() -> None:
    def run(mode: str) -> tuple[bool, list[torch.Tensor]]:
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.GELU(), nn.Linear(8, 8))
        unit = CheckpointUnit("block", block, native=False)
        handle = apply_checkpointing([block], units=[unit])
        unit.offer("cpu")
        unit.mode = mode
        x = torch.randn(4, 8, requires_grad=True)
        hidden = x * 2
        kept = weakref.ref(hidden)
        out = block(hidden)
        del hidden
        alive = kept() is not None
        out.pow(2).sum().backward()
        handle.remove()
        assert unit.offload.moved == (4 * 8 * 4 if mode == "offload" else 0)
        return alive, [x.grad, *(p.grad for p in block.parameters())]

    (full_alive, full), (offload_alive, offloaded) = run("full"), run("offload")
    assert full_alive and not offload_alive  # full keeps the input on the device; offload only its copy on the host
    assert all(torch.equal(a, b) for a, b in zip(full, offloaded, strict=True))


def test_forced_checkpoint_offload_has_a_real_cpu_peak_equal_to_the_estimate() -> None:
    probe = PeakMemory()
    fit(Tuned(), MemOpt(measure=False, checkpointing="offload"), probe)
    model = Tuned()
    result = estimate(model, batch_of(model), "fit", checkpointing="offload")
    assert "offload" in result.how
    assert probe.peaks[1] == probe.peaks[2] == result.memopt.bytes


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


class Stack(pl.LightningModule):
    """Eight residual blocks on 1,024 tokens of width 16: each block's input (64 KiB) is most of what a checkpointed
    block keeps, and the weights are tiny."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*(Residual() for _ in range(8)))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.blocks(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.slow  # estimates for a CUDA stand-in under budgets: 6 s
def test_for_a_cuda_device_the_checkpoint_inputs_are_counted_on_the_host_and_chosen_where_the_budget_needs_it() -> None:
    model, batch = Stack(), torch.randn(4, 256, 16)
    full = estimate(model, batch, "fit", device="cuda", checkpointing=True, optimizer_in_backward=False)
    offloaded = estimate(model, batch, "fit", device="cuda", checkpointing="offload", optimizer_in_backward=False)
    assert offloaded.memopt.elsewhere["host"] == 7 * 4 * 256 * 16 * 4  # every block's input but the batch's
    assert "host" not in full.memopt.elsewhere
    assert offloaded.memopt.bytes < full.memopt.bytes
    budget = (full.memopt.bytes + offloaded.memopt.bytes) // 2
    options = dict(checkpointing="auto", memory_budget=budget, optimizer_in_backward=False)
    planned = estimate(model, batch, "fit", device="cuda", **options)
    assert "offload" in planned.how and planned.memopt.bytes <= budget
    assert "8 offload" not in planned.how  # as few as the budget needs: each costs its bytes over the link
    cpu = estimate(model, batch, "fit", **options)  # the host is the device: never offered
    assert "offload" not in cpu.how
    unbudgeted = estimate(model, batch, "fit", device="cuda", checkpointing="auto", optimizer_in_backward=False)
    assert "offload" not in unbudgeted.how  # only where a budget needs it


def test_a_checkpoint_saved_with_blocks_offloaded_is_not_loaded_where_that_mode_is_not_offered() -> None:
    from lightning_memopt.techniques.checkpointing import Checkpointing

    technique = Checkpointing()
    technique.switches = [CheckpointUnit("block", nn.Linear(2, 2), native=False)]
    assert technique.load({"switches": ["block"], "modes": ["offload"]}) is False  # on a CPU: not offered
    assert technique.switches[0].mode == "full"
    technique.switches[0].offer("cpu")
    assert technique.load({"switches": ["block"], "modes": ["offload"]}) is True
    assert technique.switches[0].mode == "offload"


@pytest.mark.parametrize("stepping", heavy(["auto", "host"], "auto"))  # each an estimate under a budget: 3-4 s
def test_the_state_in_8_bits_is_never_tried_with_the_state_on_the_host(stepping: str) -> None:
    """The two cannot go together (the host keeps the state in full): the planner tried the mix under a budget out of
    reach and noted that it 'could not be dry-run together (the dry run failed with KeyError: 'exp_avg')', or, with the
    host forced, the 8-bit state alone, noting the KeyError; now it never tries them, and says no failure."""
    model = Tuned()
    result = estimate(
        model, batch_of(model), "fit", device="cuda", memory_budget=1, lossy=True, optimizer_in_backward=stepping
    )
    assert not [n for n in result.notes if "dry run failed" in n or "dry-run together" in n], result.notes
    assert "state on the host" in result.how and "8 bits" not in result.how
