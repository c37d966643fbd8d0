"""MemOpt during fit: gradient checkpointing, each block's mode (none, selective or full recomputation) chosen by dry
runs before the first batch, and the one measured batch."""

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
from lightning_memopt.engine.recompute import MODES, RecomputeChoice, choose_modes
from lightning_memopt.engine.report import MemOptReport
from lightning_memopt.engine.step import StepContext


class FitSession:
    """Owns checkpointing for one fit: the changes, the choice of blocks under a budget, and the measured batch.

    Args:
        changes: The checkpointing applied to the models.
        report: Where the figures go.
        budget: With ``checkpointing="auto"``, the peak to stay under, in bytes (``None``: within 5% of the peak with
            every block fully checkpointed).
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
        self.auto = config.checkpointing == "auto"
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
        if not self.chosen:  # once, at the first batch: the modes, or at least what they recompute
            self.chosen = True
            checkpointing = self.changes["checkpointing"]
            if (self.auto and checkpointing.switches) or (self.measure and checkpointing.models):
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
        why = f"{missed}: the blocks' modes are chosen again from dry runs that replay the values it read"
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

    # each block's mode ----------------------------------------------------------------------------------------------

    def _choose(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        reads: dict[Any, list[Any]] | None = None,
    ) -> None:
        """Each block's mode with ``checkpointing="auto"``, from dry runs of the first batch as a later step would run
        it (last step's gradients and the optimizer state alive), before it runs (or of a batch that ran, replaying
        its ``reads``); otherwise one dry run counts what the blocks recompute."""
        checkpointing = self.changes["checkpointing"]
        seen = shapes(batch)
        resumed = reads is None and self.state.get("shapes") == seen and checkpointing.load(self.state)
        if resumed:
            rank_zero_info(f"MemOpt: reusing the checkpointing choice of the run resumed: {checkpointing.describe()}")
        choose = self.auto and bool(checkpointing.switches) and not resumed
        context = StepContext.of(trainer, "fit")
        choice = choose_modes(
            context, pl_module, self.changes, batch, batch_idx, self.budget, choose=choose, reads=reads
        )
        self.report.tuning_s = (self.report.tuning_s or 0.0) + choice.seconds
        self.report.note(*choice.notes)
        if choose:
            self._agree(trainer, pl_module, choice)
        self.state = {**checkpointing.state(), "shapes": seen}
        self.report.checkpointed = checkpointing.describe()
        self.report.recompute_flops = choice.recompute_flops
        self.report.recompute_fraction = choice.recompute_fraction
        if choose:
            target = f"a budget of {self.budget} bytes" if self.budget is not None else "no budget"
            rank_zero_info(f"MemOpt: checkpointing {self.report.checkpointed} for {target}")
            for note in choice.notes:
                rank_zero_warn(f"MemOpt: {note}.")

    def _agree(self, trainer: pl.Trainer, pl_module: pl.LightningModule, choice: RecomputeChoice) -> None:
        """Every rank chooses from its own first batch: each block takes the most recomputing mode any rank chose.
        A choice made on placeholders is checked against the real step later."""
        checkpointing = self.changes["checkpointing"]
        ranks = torch.tensor([float(MODES.index(m)) for m in checkpointing.modes], device=pl_module.device)
        ranks = trainer.strategy.reduce(ranks, reduce_op="max") if len(ranks) else ranks
        checkpointing.set([MODES[int(r)] for r in ranks.tolist()])
        self.guess = Guess(choice.peak_bytes) if choice.placeholders else None
        if choice.peak_bytes is None:
            rank_zero_warn(
                "MemOpt: checkpointing='auto' could not choose the blocks' modes (the dry run could not trace the"
                " step, see the summary's notes); every block is checkpointed."
            )
