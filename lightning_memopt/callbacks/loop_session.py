"""MemOpt in a loop without gradients (predict, validate, test): feed-forward chunking and VAE decode slicing and
tiling, each setting chosen by dry runs before a batch runs, out of memory rescue, and the one measured batch."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_memopt.callbacks.publish import publish
from lightning_memopt.callbacks.schedule import Schedule, Shapes, host_copy, shapes, signature
from lightning_memopt.engine.changes import Changes
from lightning_memopt.engine.config import MemOptConfig
from lightning_memopt.engine.measure import Guess, Measurement
from lightning_memopt.engine.planner import choose_chunks
from lightning_memopt.engine.report import MemOptReport
from lightning_memopt.engine.step import STEPS, DryRun, Stage, StepContext
from lightning_memopt.handles import AttributeOverride
from lightning_memopt.memory import PeakProbe, free_memory, is_oom, probe_for
from lightning_memopt.techniques.chunking import Setting, describe
from lightning_memopt.techniques.decoding import TilingCheck


class LoopSession:
    """Owns chunking and decoding for one predict, validation or test loop: the settings, when to choose them again,
    rescue and measurement.

    Settings are chosen from dry runs of a batch before it runs (``chunk_size="auto"``): on the first batch, and again
    when a batch holds a longer tensor than any batch they were chosen for. No collective runs: memory follows from
    shapes, so ranks with the same shapes choose the same settings, and a rank with longer inputs chooses its own.

    Args:
        stage: ``predict``, ``validate`` or ``test``.
        changes: The chunking applied to the models.
        report: Where the figures go.
        budget: The peak to stay under, in bytes, or ``None``.
        tune: Choose settings by dry runs (``chunk_size="auto"``); otherwise only rescue batches that run out of
            memory.
        measure: Measure the first batch.
        config: MemOpt's options: ``verify`` outputs with and without the changes on the measured batch, within
            ``verify_tolerance``.
        cache: What was chosen already, per batch shapes (a resumed run's, from ``state_dict``); filled as it goes.
    """

    def __init__(
        self,
        stage: Stage,
        changes: Changes,
        report: MemOptReport,
        budget: int | None,
        tune: bool,
        measure: bool,
        config: MemOptConfig,
        cache: dict[Shapes, dict[str, Any]],
    ) -> None:
        self.stage = stage
        self.changes = changes
        self.chunking, self.decoding = changes["chunking"], changes["decoding"]
        self.report = report  # this session is the one writer of its report
        report.applied, report.budget_bytes = changes.applied, budget
        self.budget = budget
        self.tune = tune
        self.verify = config.verify
        self.tolerance = config.verify_tolerance
        self.cache = cache
        self.schedule = Schedule(0) if measure else None
        self.measurement: Measurement | None = None
        self.tiling: TilingCheck | None = None
        self.planned: list[list[int]] | None = None  # the largest shapes settings were chosen for
        self.guess: Guess | None = None  # where the settings were chosen from dry runs that gave placeholders
        self.measured_batch: Measurement | None = None  # measured, its changed blocks not yet timed
        self.watch: PeakProbe | None = None
        if tune:
            self.chunking.set({u.name: Setting(u.dim, None, 1) for u in self.chunking.units})

    @property
    def tiling_allowed(self) -> bool:
        """Tiling changes outputs: never under ``verify``, which promises they do not change."""
        return not self.verify

    @property
    def measuring(self) -> bool:
        """Whether this loop measures a batch (``measure``, and not measured in an earlier loop of the fit)."""
        return self.schedule is not None

    @property
    def measured(self) -> bool:
        return self.schedule is not None and self.schedule.done

    # hooks ----------------------------------------------------------------------------------------------------------

    def batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int
    ) -> None:
        dry = None
        loader = dataloader_idx if len(_batch_counts(trainer, self.stage)) > 1 else None  # as Lightning passes it
        if self.tune and self._longer(shapes(batch)):
            dry = self._choose(trainer, pl_module, batch, batch_idx, loader)
        if self.tiling is None and "tiled" in self.decoding.in_force().values():
            self.tiling = TilingCheck(self.decoding.units)  # the first tiled batch: keeps its first sample
        if self.schedule is not None and dataloader_idx == 0 and self.schedule.due(batch_idx):
            self.measurement = Measurement(self.stage, self.changes, self.verify, self.tolerance)
            self.measurement.start(trainer, pl_module, batch, batch_idx, loader, dry)
        elif self.budget is not None and pl_module.device.type != "cpu":  # on CPU the dry run is exact
            self.watch = probe_for(pl_module.device)
            self.watch.start([])

    def batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        peak = None
        if (measurement := self._take_measurement()) is not None:
            measurement.stop(pl_module)
            if measurement.finish(outputs):
                assert self.schedule is not None
                self.schedule.done = True
                self.report.embed(measurement.figures)
                peak = measurement.figures.peak_bytes
                self._check_guess(trainer, pl_module, measurement)
                self.measured_batch = measurement
        if self.tiling is not None:
            self.tiling.stop()  # what it kept is decoded again untiled when the loop ends, outside every batch
        if self.watch is not None:
            peak, self.watch = self.watch.stop()[0], None
        if self.budget is not None and peak is not None and peak > self.budget:
            self._finer(f"a batch peaked at {peak} bytes, over the budget of {self.budget} bytes; the next runs")

    def end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Every rank reaches the end of the loop, also one with fewer batches: the figures are gathered here."""
        if self.tiling is not None:
            self._tiling_difference(self.tiling)
        if self.measured_batch is not None:  # the changed blocks timed alone, outside every batch
            self.measured_batch.time_changes()
            self.report.embed(self.measured_batch.figures)
            self.measured_batch = None
        self.abort()
        if self.schedule is not None and not self.schedule.done:
            self.report.note("no batch was measured: the run ended before the batch chosen for it")
        self.report.chunk_settings = describe(self.chunking.in_force())
        self.report.decoding = self.decoding.describe()
        if self.schedule is None:  # measure=False: nothing is gathered or logged, as at fit
            return
        publish(trainer, self.report, pl_module.device, self.budget, f"chunked: {self.report.chunk_settings}")

    def _check_guess(self, trainer: pl.Trainer, pl_module: pl.LightningModule, measurement: Measurement) -> None:
        """Settings chosen from dry runs on placeholders are checked against the real step's peak: more than 1% off,
        they are chosen again from dry runs that replay what the real step read (no user step runs again)."""
        guess, self.guess = self.guess, None
        missed = guess.missed(measurement) if guess is not None else None
        if missed is None:
            return
        _, _, batch, batch_idx, loader = measurement.again
        self.cache.pop(signature(shapes(batch)), None)
        self.planned = None
        why = f"{missed}: chunk settings chosen again from dry runs that replay the values it read"
        self.report.note(why)
        rank_zero_info(f"MemOpt: {why}.")
        self._choose(trainer, pl_module, batch, batch_idx, loader, measurement.recorded)

    def _take_measurement(self) -> Measurement | None:
        """The batch being measured, no longer the session's: it ended, or it failed."""
        measurement, self.measurement = self.measurement, None
        return measurement

    def abort(self) -> None:
        if (measurement := self._take_measurement()) is not None:
            measurement.abort()
        if self.watch is not None:
            self.watch.stop()
            self.watch = None
        if self.tiling is not None:
            self.tiling.stop()
            self.tiling = None

    # choosing settings ----------------------------------------------------------------------------------------------

    def _longer(self, seen: list[list[int]]) -> bool:
        """Whether this batch holds a tensor longer, along any dim, than the batches the settings were chosen for."""
        planned = self.planned
        if planned is None or [len(s) for s in seen] != [len(s) for s in planned]:
            return True
        return any(n > m for new, old in zip(seen, planned, strict=True) for n, m in zip(new, old, strict=True))

    def _choose(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        loader: int | None,
        reads: dict[Any, list[Any]] | None = None,
    ) -> DryRun | None:
        """Choose every block's setting from dry runs of this batch. Returns the dry run without chunking (the
        baseline of this batch), or ``None`` where settings chosen before for these shapes are reused."""
        seen = shapes(batch)
        first, planned = self.planned is None, self.planned or []
        if [len(s) for s in seen] == [len(s) for s in planned]:  # the same tensors: the longest of each dim
            self.planned = [[max(a, b) for a, b in zip(n, o, strict=True)] for n, o in zip(seen, planned, strict=True)]
        else:  # another kind of batch (another dataloader): plan for it
            self.planned = seen
        key = signature(seen)
        chosen = self.cache.get(key)
        if chosen is not None and self.changes.load(chosen):
            rank_zero_info(f"MemOpt: reusing chunk settings chosen for these shapes: {self._settings()}")
            return None
        context = StepContext.of(trainer, self.stage)
        choice = choose_chunks(
            context,
            pl_module,
            self.changes,
            batch,
            batch_idx,
            loader,
            self.budget,
            stage=self.stage,
            tiling=self.tiling_allowed,
            reads=reads,
        )
        dry = choice.unchunked
        self.guess = Guess(choice.peak_bytes) if dry.placeholders else None
        if dry.peak_bytes is None:
            rank_zero_warn(
                f"MemOpt: chunk settings could not be chosen: {dry.note}. Chunking stays as it is"
                f" ({describe(self.chunking.in_force())}); a batch that runs out of memory is still retried"
                " finer. Pass an int `chunk_size` to choose yourself."
            )
            note = f"chunk settings could not be chosen: {dry.note}"
            self.report.note(note)
            self.cache[key] = self.changes.state()  # not tried again for these shapes
            return dry
        self.cache[key] = self.changes.state()
        self.report.peak_part, self.report.baseline_part = choice.part, choice.part_without
        self.report.weights_bytes = dry.live_bytes.get("weights")
        self._warn_tiling()
        self.report.tuning_s = (self.report.tuning_s or 0.0) + choice.seconds
        for note in self.report.note(*choice.notes):
            if self.budget is not None and "budget" in note:
                rank_zero_warn(f"MemOpt: {note}.")
        when = "" if first else "longer inputs: "
        rank_zero_info(f"MemOpt: {when}chunk settings chosen by dry runs in {choice.seconds:.2f} s: {self._settings()}")
        return dry

    def _settings(self) -> str:
        """The chunk settings and decode modes in force, for a message."""
        decodes = "".join(f"; {name} decodes {mode}" for name, mode in self.decoding.in_force().items())
        return describe(self.chunking.in_force()) + decodes

    def _finer(self, why: str) -> bool:
        """One step cheaper in memory, cheapest first: slice the VAE decodes that are not, else every chunked block
        one step finer, else tile the VAE decodes (outputs change). False when nothing is left."""
        what = self.decoding.finer(lossy=False)  # slicing the decodes first: their outputs do not change
        if what is None and self.chunking.finer():
            what = "with every block one step finer"
        if what is None:
            what = self.decoding.finer(lossy=self.tiling_allowed)
        if what is not None:
            rank_zero_info(f"MemOpt: {why} {what}: {self._settings()}")
            self._warn_tiling()
        return what is not None

    def _warn_tiling(self) -> None:
        tiled = [name for name, mode in self.decoding.in_force().items() if mode == "tiled"]
        why = f"the budget of {self.budget} bytes cannot be met" if self.budget else "a batch runs out of memory"
        if tiled and not self.report.tiled:
            self.report.tiled = True
            rank_zero_warn(
                f"MemOpt: VAE tiling is on for {', '.join(tiled)}, because {why} otherwise. Tiling changes the"
                " decoded outputs at the tile seams; the largest difference it made on the first sample it tiled is"
                " measured when the loop ends and logged as `memopt/tiling_max_abs_diff`."
            )

    def _tiling_difference(self, check: TilingCheck) -> None:
        differences = check.differences()
        known = [d for d in differences.values() if d is not None]
        if known:
            self.report.tiling_max_abs_diff = max(known)
        if len(known) < len(differences):
            self.report.note("the difference VAE tiling made could not be measured: decoding untiled failed")

    def rescue(self, pl_module: pl.LightningModule) -> AttributeOverride:
        """Wrap the loop's step so that a batch that runs out of memory is retried one step cheaper in memory, in
        place: the outputs hold every batch once, in order. The error is raised, with a clear message, only when
        nothing is left to make cheaper."""
        name = STEPS[self.stage]
        given_step: Callable[..., Any] = getattr(pl_module, name)

        def rescued(original: Callable[..., Any]) -> Callable[..., Any]:
            # Lightning reads the step's signature to know whether it takes batch_idx
            return functools.wraps(given_step)(functools.partial(self._rescued, pl_module, original))

        return AttributeOverride.wrap(pl_module, name, rescued)

    def _rescued(
        self, pl_module: pl.LightningModule, original: Callable[..., Any], batch: Any, *args: Any, **kwargs: Any
    ) -> Any:
        """One call of the loop's step, retried one step cheaper in memory while it runs out of memory."""
        given = host_copy(batch)  # a retry sees the batch as the dataloader gave it, not as the step left it
        while True:
            try:
                return original(batch, *args, **kwargs)
            except Exception as error:
                if not is_oom(error):
                    raise
                free_memory(pl_module.device)
                if (measurement := self._take_measurement()) is not None:  # measure a later batch instead
                    measurement.abort()
                    assert self.schedule is not None
                    self.schedule.retry(1)
                if not self._finer("a batch ran out of memory; retrying it"):
                    settings = describe(self.chunking.in_force())
                    raise RuntimeError(
                        f"MemOpt: a {self.stage} batch ran out of memory even with every block chunked as finely"
                        f" as it can be ({settings}). Lower the batch size or the input size. ({error})"
                    ) from error
                batch = given()


def _batch_counts(trainer: pl.Trainer, stage: str) -> list[Any]:
    """The loop's number of batches per dataloader, as Lightning keeps it."""
    counts = {"predict": "num_predict_batches", "validate": "num_val_batches", "test": "num_test_batches"}
    return list(getattr(trainer, counts[stage]))
