"""Batches: when to measure (one batch a run, chosen so that the figures describe a typical step), their shapes, a
host copy to retry one, and what was chosen for each kind of batch."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from lightning_memopt.compat import _disable_current_modes, map_tensors, tensors_in

Shapes = tuple[tuple[int, ...], ...]


def shapes(batch: Any) -> list[list[int]]:
    """The shapes of the tensors in a batch, in order: what a step's memory depends on.

    Examples:
        >>> import torch
        >>> shapes({"x": torch.zeros(2, 3), "label": 1, "y": [torch.zeros(4)]})
        [[2, 3], [4]]
    """
    return [list(t.shape) for t in tensors_in(batch)]


class Schedule:
    """Which batch is measured, and whether it has been. The batches are counted from the first one that runs, whatever
    its index: a fit resumed mid-epoch from a step checkpoint starts past batch 0.

    Examples:
        >>> schedule = Schedule.for_fit(batches=10, accumulate=2, automatic=True)
        >>> schedule.target, schedule.due(2)
        (2, True)
        >>> schedule.retry(2); schedule.target  # that step returned None: the next window's first batch
        4
        >>> Schedule.for_fit(batches=10, accumulate=1, automatic=True, first=6).target  # resumed at batch 6
        7
    """

    def __init__(self, target: int) -> None:
        self.target = target
        self.done = False

    @classmethod
    def for_fit(cls, batches: float, accumulate: int, automatic: bool, first: int = 0) -> Schedule:
        """The first batch of the second optimizer step from the ``first`` batch run, where last step's gradients and
        the optimizer state are alive as in every later step; the first batch if the epoch has no such step."""
        step = accumulate if automatic else 1
        target = first + step - first % step  # the start of the next window: the first may be partial
        return cls(target if (math.isinf(batches) or batches > target) else first)

    @classmethod
    def for_stage(cls, trainer: Any, stage: str, automatic: bool, first: int = 0) -> Schedule:
        """At fit :meth:`for_fit`; in a loop its ``first`` batch."""
        if stage != "fit":
            return cls(first)
        return cls.for_fit(trainer.num_training_batches, trainer.accumulate_grad_batches, automatic, first)

    def due(self, batch_idx: int) -> bool:
        return not self.done and batch_idx >= self.target

    def retry(self, step: int) -> None:
        """The batch could not be measured in full: measure a later one."""
        self.target += step


def host_copy(batch: Any) -> Callable[[], Any]:
    """Keep a copy of a batch in host memory, outside any probe (MemOpt's own, to retry the batch; not the step's),
    and return what makes a fresh copy of it on the devices it came from.

    Examples:
        >>> import torch
        >>> batch = {"x": torch.ones(2)}
        >>> again = host_copy(batch)
        >>> batch["x"].mul_(3)[0].item(), again()["x"][0].item()
        (3.0, 1.0)
    """
    devices: list[Any] = []

    def keep(tensor: Any) -> Any:
        devices.append(tensor.device)
        return tensor.detach().to("cpu", copy=True)

    with _disable_current_modes():
        copied = map_tensors(batch, keep)

    def fresh() -> Any:
        where = iter(devices)
        return map_tensors(copied, lambda t: t.to(next(where), copy=True))

    return fresh


def signature(batch_shapes: list[list[int]]) -> Shapes:
    return tuple(tuple(s) for s in batch_shapes)
