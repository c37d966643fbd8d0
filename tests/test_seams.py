"""The seams a technique that changes the optimizer step needs (issue 32, item 4): it sees the Trainer's facts before it
is applied and when it may refuse, and it may replace how the dry runs step the optimizers and what they enter around
the backward pass."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_memopt import MemOpt, estimate
from lightning_memopt.handles import AttributeOverride
from lightning_memopt.techniques import Change, Technique, register_technique, unregister_technique
from tests.helpers import TRAINER_ARGS, Wrapped


class Stepper(Technique):
    """Marks each model; refuses gradient clipping by norm; steps the dry runs' optimizers itself, counting them."""

    name, stages = "stepper", ("fit",)
    seen: list[Any] = []  # the context each instance got before apply
    stepped: list[list[str]] = []  # per dry-run optimizer step, the optimizers' class names

    def __init__(self) -> None:
        self.handles: list[AttributeOverride] = []

    @classmethod
    def refuses(cls, context: Any) -> str | None:
        if context.gradient_clip_val and context.gradient_clip_algorithm == "norm":
            return f"stepper cannot step each parameter alone under gradient_clip_val={context.gradient_clip_val}"
        return None

    def apply(self, found: Any, config: Any) -> Change:
        Stepper.seen.append(self.context)
        self.handles.append(AttributeOverride(found.module, "stepped_by_memopt", True))
        return Change("a mark", 1, self.handles[-1])

    def remove(self) -> None:
        self.handles = []

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        yield

    @property
    def changed(self) -> bool:
        return bool(self.handles)

    def optimizer_step(self, default: Callable[[list[Any]], None]) -> Callable[[list[Any]], None]:
        def step(optimizers: list[Any]) -> None:
            Stepper.stepped.append([type(o).__name__ for o in optimizers])
            default(optimizers)

        return step


@pytest.fixture
def stepper() -> Iterator[type[Stepper]]:
    Stepper.seen, Stepper.stepped = [], []
    register_technique(Stepper)
    yield Stepper
    unregister_technique(Stepper)


def test_a_technique_sees_the_trainers_facts_and_steps_the_dry_runs_optimizers(stepper: type[Stepper]) -> None:
    model = Wrapped("torch_encoder")
    trainer = pl.Trainer(**TRAINER_ARGS, limit_train_batches=2, accumulate_grad_batches=1, callbacks=[MemOpt()])
    trainer.fit(model)
    (context,) = stepper.seen
    assert [type(o) for o in context.optimizers] == [type(model.configure_optimizers())]
    assert context.strategy is trainer.strategy and context.precision_name == "32-true"
    assert context.accumulate_grad_batches == 1 and context.gradient_clip_val is None
    assert stepper.stepped and all(names == ["SGD"] for names in stepper.stepped)  # the twins, through its step
    assert "stepped_by_memopt" not in model.encoder.__dict__  # undone


def test_a_technique_refuses_a_setting_by_name(stepper: type[Stepper]) -> None:
    model = Wrapped("torch_encoder")
    trainer = pl.Trainer(**TRAINER_ARGS, limit_train_batches=2, gradient_clip_val=1.0, callbacks=[MemOpt()])
    with pytest.warns(UserWarning, match=r"stepper cannot step each parameter alone under gradient_clip_val=1.0"):
        trainer.fit(model)
    assert not stepper.seen and not stepper.stepped  # never applied


def test_estimate_steps_the_optimizers_as_the_technique_does(stepper: type[Stepper]) -> None:
    model = Wrapped("torch_encoder")
    batch = next(iter(model.train_dataloader()))
    stepper.stepped = []
    result = estimate(model, batch, stage="fit")
    assert result.memopt.bytes < result.plain.bytes and stepper.stepped  # its step ran in the estimate's dry runs
    assert isinstance(stepper.seen[0].optimizers[0], torch.optim.Optimizer)


class InBackward(Technique):
    """Steps each parameter of the dry runs' optimizers as soon as its gradient is accumulated, then frees it; nothing
    at the end of the step. On the dry runs only: enough to see the seam count it."""

    name, stages = "in_backward", ("fit",)
    steps = 0

    def apply(self, found: Any, config: Any) -> Change:
        self.handle = AttributeOverride(found.module, "stepped_in_backward", True)
        return Change("a mark", 1, self.handle)

    def remove(self) -> None:
        pass

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        yield

    @property
    def changed(self) -> bool:
        return True

    def optimizer_step(self, default: Callable[[list[Any]], None]) -> Callable[[list[Any]], None]:
        return lambda optimizers: None  # stepped already, in the backward pass

    def around_backward(self, default: Callable[..., Any]) -> Callable[..., Any]:
        @contextlib.contextmanager
        def backward(optimizers: list[Any], stepping: Callable[..., Any]) -> Iterator[None]:
            def step(param: torch.Tensor) -> None:
                stepping(optimizers, lambda: [o.step() for o in optimizers])  # SGD steps the parameters with a grad
                param.grad = None
                InBackward.steps += 1

            params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
            hooks = [p.register_post_accumulate_grad_hook(step) for p in params]
            try:
                yield
            finally:
                for hook in hooks:
                    hook.remove()

        return backward


def test_a_technique_may_step_the_optimizers_inside_the_dry_runs_backward_pass() -> None:
    """The gradients never exist at once in the backward pass: its peak is lower. (The forward pass keeps the last
    step's gradients of a steady step, which Lightning frees only before the backward pass: the same in both runs.)"""
    model = Wrapped("torch_encoder")
    batch = next(iter(model.train_dataloader()))
    InBackward.steps = 0
    register_technique(InBackward)
    try:
        off = dict(checkpointing=False, chunked_loss=False, chunking=False, free_gradients=False)
        result = estimate(model, batch, stage="fit", optimizer_in_backward=False, **off)
    finally:
        unregister_technique(InBackward)
    params = [p for p in model.parameters() if p.requires_grad]
    assert InBackward.steps == len(params)  # once per parameter, in the run with the technique
    assert result.memopt.phases["backward"] < result.plain.phases["backward"]
    assert result.memopt.phases["forward"] == result.plain.phases["forward"] == result.plain.bytes
    assert "optimizer step" in result.plain.phases and "optimizer step" not in result.memopt.phases
