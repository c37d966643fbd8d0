"""The seams a technique that changes the optimizer step needs (issue 32, item 4): it sees the Trainer's facts before it
is applied and when it may refuse, and it may replace how the dry runs step the optimizers."""

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
