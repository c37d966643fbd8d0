"""The time a loop's changes cost is known although no step ran without them: each changed module is timed alone,
after the measured step, with the change and without."""

from __future__ import annotations

import torch
from torch import nn

from lightning_memopt import MemOpt
from lightning_memopt.engine.costing import CallCounter
from lightning_memopt.techniques.base import Switchable
from tests.helpers import Wrapped, trainer


def test_predict_with_chunking_reports_the_time_it_cost() -> None:
    memopt = MemOpt(chunk_size=2)
    trainer(memopt).predict(Wrapped("latte"))
    report = memopt.report
    assert report.step_time_s is not None and report.baseline_step_time_s is not None
    assert report.time_overhead is not None and "memopt/time_overhead" in report.metrics()


SEEN: list[tuple[int, bool, tuple[int, ...]]] = []  # outside the module: timing puts its attributes back


class Slow(nn.Module):
    """A module whose change makes each call do the work four times over."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(256, 256)
        self.repeats = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN.append((self.repeats, self.training, tuple(x.shape)))
        for _ in range(self.repeats):
            y = self.linear(x)
        return y


def test_the_cost_is_the_calls_times_the_difference_and_the_module_is_left_changed() -> None:
    module = Slow()
    unit = Switchable(
        "slow", module, "forward", lambda: setattr(module, "repeats", 40), lambda: setattr(module, "repeats", 1)
    )
    unit.on()
    counter = CallCounter([unit])
    with counter:
        for _ in range(3):
            module(torch.ones(64, 256))
    SEEN.clear()
    added = counter.seconds_added()
    assert counter.calls == {"slow": 3} and isinstance(added, float)
    # timed alone, at the shapes the step gave it, in eval mode: twice changed, twice not; then left changed
    assert SEEN == [(40, False, (64, 256))] * 2 + [(1, False, (64, 256))] * 2
    assert module.repeats == 40 and module.training
