"""When to measure: one batch a run, chosen so that the figures describe a typical step."""

from __future__ import annotations

import math
from typing import Any

from lightning_memopt.compat import tensors_in


def shapes(batch: Any) -> list[list[int]]:
    """The shapes of the tensors in a batch, in order: what a step's memory depends on.

    Example:
        >>> import torch
        >>> shapes({"x": torch.zeros(2, 3), "label": 1, "y": [torch.zeros(4)]})
        [[2, 3], [4]]
    """
    return [list(t.shape) for t in tensors_in(batch)]


class Schedule:
    """Which batch is measured, and whether it has been.

    Example:
        >>> schedule = Schedule.for_fit(batches=10, accumulate=2, automatic=True)
        >>> schedule.target, schedule.due(2)
        (2, True)
        >>> schedule.retry(2); schedule.target  # that step returned None: the next window's first batch
        4
    """

    def __init__(self, target: int) -> None:
        self.target = target
        self.done = False

    @classmethod
    def for_fit(cls, batches: float, accumulate: int, automatic: bool) -> Schedule:
        """The first batch of the second optimizer step, where last step's gradients and the optimizer state are
        alive as in every later step; the first batch if there is no second step."""
        step = accumulate if automatic else 1
        return cls(step if (math.isinf(batches) or batches > step) else 0)

    def due(self, batch_idx: int) -> bool:
        return not self.done and batch_idx == self.target

    def retry(self, step: int) -> None:
        """The batch could not be measured in full: measure a later one."""
        self.target += step
