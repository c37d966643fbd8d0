"""MemOpt during fit: gradient checkpointing, how many blocks to checkpoint under a budget (chosen by dry runs before
the first batch), and the one measured batch."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_memopt.callbacks.publish import publish
from lightning_memopt.callbacks.schedule import Schedule, shapes
from lightning_memopt.engine.changes import Changes
from lightning_memopt.engine.config import MemOptConfig
from lightning_memopt.engine.measure import Guess, Measurement
from lightning_memopt.engine.planner import choose_count
from lightning_memopt.engine.report import MemOptReport
from lightning_memopt.engine.step import StepContext
from lightning_memopt.tuning import CheckpointTuner


class FitSession:
    """Owns checkpointing for one fit: the changes, the choice of blocks under a budget, and the measured batch.

    Args:
        changes: The checkpointing applied to the models.
        report: Where the figures go.
        budget: With ``checkpointing="auto"``, the peak to stay under, in bytes; ``None`` checkpoints every block.
        config: MemOpt's options: ``measure`` one batch (see :class:`~lightning_memopt.callbacks.schedule.Schedule`),
            ``verify`` results with and without checkpointing on it, within ``verify_tolerance``.
        resumed: The choice a resumed run saved (``state_dict``), reused when the blocks and batch shapes match.
    """

    def __init__(
        self,
        changes: Changes,
        report: MemOptReport,
        budget: int | None,
        config: MemOptConfig,
        resumed: dict[str, Any],
    ) -> None:
        self.changes = changes
        self.report = report  # this session is the one writer of its report
        report.applied, report.budget_bytes = changes.applied, budget
        self.budget = budget
        self.measure = config.measure
        self.schedule: Schedule | None = None
        self.chosen = False
        self.verify = config.verify
        self.tolerance = config.verify_tolerance
        self.state = dict(resumed)
        self.measurement: Measurement | None = None
        self.guess: Guess | None = None  # where the count was chosen from dry runs that gave placeholders

    # hooks ----------------------------------------------------------------------------------------------------------

    def batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.budget is not None and self.changes["checkpointing"].switches and not self.chosen:
            self.chosen = True
            self._choose(trainer, pl_module, batch, batch_idx)
        if self.measure and self.schedule is None:  # batch counts are known from the first batch on
            automatic = pl_module.automatic_optimization
            self.schedule = Schedule.for_fit(trainer.num_training_batches, trainer.accumulate_grad_batches, automatic)
        if self.schedule is not None and self.schedule.due(batch_idx):
            self.measurement = Measurement("fit", self.changes, self.verify, self.tolerance)
            self.measurement.start(trainer, pl_module, batch, batch_idx, None)

    def before_backward(self) -> None:
        if self.measurement is not None:
            self.measurement.before_backward()

    def batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        measurement = self.measurement
        if measurement is None:
            return
        measurement.stop(pl_module)  # the whole step, the optimizer's included
        self.measurement = None
        assert self.schedule is not None
        if not measurement.finish(outputs):
            self.schedule.retry(trainer.accumulate_grad_batches)
            return
        self.schedule.done = True
        self.report.embed(measurement.figures)
        self._check_guess(trainer, pl_module, measurement)
        publish(trainer, self.report, pl_module.device, self.budget, f"{self.report.checkpointed} checkpointed")

    def _check_guess(self, trainer: pl.Trainer, pl_module: pl.LightningModule, measurement: Measurement) -> None:
        """A count chosen from dry runs on placeholders is checked against the real step's peak: more than 1% off, it
        is chosen again from dry runs that replay what the real step read (for the steps after this one)."""
        guess, self.guess = self.guess, None
        missed = guess.missed(measurement) if guess is not None else None
        if missed is None:
            return
        why = f"{missed}: the blocks to checkpoint are chosen again from dry runs that replay the values it read"
        self.report.note(why)
        rank_zero_info(f"MemOpt: {why}.")
        _, _, batch, batch_idx, _ = measurement.again
        self._choose(trainer, pl_module, batch, batch_idx, measurement.recorded)

    def end(self) -> dict[str, Any]:
        """Fit ended: say so if no batch was measured. Returns the checkpointing choice, for ``state_dict``."""
        if self.schedule is not None and not self.schedule.done:
            self.report.note("no batch was measured: the run ended before the batch chosen for it")
        return self.state

    def abort(self) -> None:
        if self.measurement is not None:
            self.measurement.abort()
            self.measurement = None

    # checkpointing="auto" -------------------------------------------------------------------------------------------

    def _choose(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        reads: dict[Any, list[Any]] | None = None,
    ) -> None:
        """How many blocks to checkpoint, from dry runs of the first batch as a later step would run it (last step's
        gradients and the optimizer state alive), before it runs (or of a batch that ran, replaying its ``reads``)."""
        assert self.budget is not None
        checkpointing = self.changes["checkpointing"]
        seen = shapes(batch)
        tuner = CheckpointTuner(len(checkpointing.switches), self.budget)
        if reads is None and self.state.get("shapes") == seen and checkpointing.load(self.state):
            tuner.count = checkpointing.state()["count"]  # resumed: chosen already
            rank_zero_info(f"MemOpt: reusing the checkpointing choice of the run resumed: {tuner.count} blocks")
        else:
            self._search(trainer, pl_module, batch, batch_idx, tuner, reads)
        count = tuner.count  # every rank chooses from its own first batch: all take the largest count
        count = int(trainer.strategy.reduce(torch.tensor(float(count), device=pl_module.device), reduce_op="max"))
        checkpointing.enable(count)
        self.state = {**checkpointing.state(), "shapes": seen}
        self.report.checkpointed = checkpointing.describe()
        self.report.note(*tuner.notes)
        rank_zero_info(f"MemOpt: checkpointing {self.report.checkpointed} for a budget of {self.budget} bytes")
        for note in tuner.notes:  # the budget cannot be met
            rank_zero_warn(f"MemOpt: {note}.")

    def _search(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        tuner: CheckpointTuner,
        reads: dict[Any, list[Any]] | None = None,
    ) -> None:
        context = StepContext.of(trainer, "fit")
        seconds, notes, guessed = choose_count(context, pl_module, self.changes, batch, batch_idx, tuner, reads=reads)
        self.guess = Guess(guessed.get(tuner.count)) if guessed else None
        self.report.note(*notes)
        self.report.tuning_s = (self.report.tuning_s or 0.0) + seconds
        if notes and tuner.steps == 0:
            rank_zero_warn(
                "MemOpt: checkpointing='auto' could not choose blocks for the budget (the dry run could not trace the"
                " step, see the summary's notes); every block is checkpointed."
            )
