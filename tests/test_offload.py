"""The optimizer's state in host memory (issue 48, offload (a)): ``optimizer_in_backward="host"`` steps each
parameter in host memory as its gradient arrives, so the device holds no optimizer state. On this CPU-only machine the
host is the device: forced, the weights, state and schedule equal a plain run's bit for bit and the real peak equals
the estimate's; for a CUDA device, the estimate counts the state on the host; the planner offers it only on an
accelerator, and there chooses it where the budget needs it."""

from __future__ import annotations

from typing import Any

import torch

from lightning_memopt import MemOpt, PeakMemory, estimate
from lightning_memopt.techniques.stepping import to_devices
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


def test_for_a_cuda_device_the_state_is_counted_on_the_host() -> None:
    model = Tuned()
    state = 2 * sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)  # AdamW's two moments, fp32
    on_device = estimate(model, batch_of(model), "fit", device="cuda", optimizer_in_backward=True)
    on_host = estimate(model, batch_of(model), "fit", device="cuda", optimizer_in_backward="host")
    assert on_device.memopt.by_kind["optimizer"] >= state
    assert on_host.memopt.by_kind["optimizer"] < 1024  # the step counts alone
    assert on_host.memopt.elsewhere["host"] >= state
    assert on_host.memopt.bytes <= on_device.memopt.bytes - state // 2


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
