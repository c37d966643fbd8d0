"""Whole-block counting: how ``checkpointing="auto"`` chose before selective recomputation, kept as the baseline the
planner (:mod:`lightning_memopt.techniques.checkpointing.planner`) is compared with in the benchmarks and tests.

It checkpoints whole blocks only, spread evenly over the model, and searches how many from dry runs: none, every one,
then the counts :class:`CheckpointTuner` asks for from the saving per block it saw.
"""

from __future__ import annotations

import math
from typing import Any

from lightning_memopt.engine.changes import Changes
from lightning_memopt.engine.stage import planning_for
from lightning_memopt.engine.step import StepContext, dry_run_step
from lightning_memopt.techniques.checkpointing import Checkpointing
from lightning_memopt.techniques.checkpointing.planner import RecomputeChoice, choose_modes
from lightning_memopt.tuning import spread


class CheckpointTuner:
    """Chooses how many of a model's blocks to checkpoint so that the training peak meets a budget.

    Each checkpointed block is taken to save the same share of the difference between the peak with no block
    checkpointed and the peak with all of them; the blocks chosen are spread evenly (every n-th). A measured step
    that is still over the budget moves to more blocks, from the saving per block it showed.

    Example:
        >>> tuner = CheckpointTuner(blocks=8, budget=700)
        >>> tuner.observe(none_peak=1000, peak=200)  # all 8 checkpointed: 100 saved per block
        True
        >>> tuner.count, tuner.enabled
        (3, [1, 4, 6])
        >>> tuner.observe(none_peak=1000, peak=720)  # 3 blocks saved only 280: choose from 93 a block
        True
        >>> tuner.count
        4
        >>> tuner.observe(none_peak=1000, peak=650)
        False
    """

    def __init__(self, blocks: int, budget: int, max_steps: int = 4) -> None:
        self.blocks = blocks
        self.budget = budget
        self.count = blocks
        self.steps = 0
        self.max_steps = max_steps
        self.notes: list[str] = []

    @property
    def enabled(self) -> list[int]:
        return spread(self.blocks, self.count)

    def observe(self, none_peak: int, peak: int) -> bool:
        """Take a measured step (with ``count`` blocks checkpointed). True when another step should be measured."""
        self.steps += 1
        if peak <= self.budget and self.count < self.blocks and self.steps > 1:
            return False  # a reduced count that meets the budget
        per_block = (none_peak - peak) / max(self.count, 1)
        if self.count == self.blocks and peak > self.budget:
            self.notes.append(f"the budget of {self.budget} bytes is not met even with every block checkpointed")
            return False
        if per_block <= 0 or none_peak <= self.budget:
            self.count = 0 if none_peak <= self.budget else self.blocks
            return self.count < self.blocks and self.steps < self.max_steps
        needed = min(self.blocks, math.ceil((none_peak - self.budget) / per_block))
        if peak > self.budget:
            needed = max(needed, self.count + 1)
        self.count = needed
        return self.count < self.blocks and self.steps < self.max_steps


def whole_block_counting(
    context: StepContext, pl_module: Any, changes: Changes, batch: Any, budget: int, device: Any = "cpu"
) -> tuple[int, RecomputeChoice]:
    """The count whole-block counting chooses for ``budget``, left in force, and a dry run's figures with it (peak and
    recompute FLOPs, counted as the planner counts them)."""
    checkpointing = changes.technique(Checkpointing)
    blocks = len(checkpointing.switches)
    tuner = CheckpointTuner(blocks, budget)

    def peak(count: int) -> int | None:
        checkpointing.enable(count)
        return dry_run_step(context, pl_module, batch, 0, "fit", steady=True, device=device).peak_bytes

    none, every = peak(0), peak(blocks)
    if none is not None and every is not None:
        more = tuner.observe(none, every)
        while more:
            found = peak(tuner.count)
            more = found is not None and tuner.observe(none, found)
    checkpointing.enable(tuner.count)
    return tuner.count, choose_modes(
        planning_for(context, pl_module, changes, batch, device=device), checkpointing, budget, choose=False
    )
