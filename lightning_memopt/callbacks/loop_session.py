"""MemOpt in a loop without gradients (predict, validate, test): feed-forward chunking and VAE decode slicing and
tiling, each setting chosen by dry runs before a batch runs, out of memory rescue, and the one measured batch."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_memopt.callbacks.changes import Changes
from lightning_memopt.callbacks.dry_step import STEPS, DryRun, Stage, StepContext, dry_run_step
from lightning_memopt.callbacks.measure import Guess, Measurement, record
from lightning_memopt.callbacks.report import MemOptReport, publish
from lightning_memopt.callbacks.schedule import Schedule, shapes
from lightning_memopt.compat import _disable_current_modes, map_tensors
from lightning_memopt.memory import PeakLocator, PeakProbe, free_memory, is_oom, probe_for
from lightning_memopt.planning import ChunkRecorder, apply_settings, plan_chunks, tighten
from lightning_memopt.reads import Replay
from lightning_memopt.techniques.decoding import TilingCheck
from lightning_memopt.techniques.handles import AttributeOverride
from lightning_memopt.tuning import Setting, current, describe, finer

Shapes = tuple[tuple[int, ...], ...]


def host_copy(batch: Any) -> Callable[[], Any]:
    """Keep a copy of a batch in host memory, outside any probe (MemOpt's own, to retry the batch; not the step's),
    and return what makes a fresh copy of it on the devices it came from.

    Example:
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


@dataclass
class Chosen:
    """What was chosen for one kind of batch: each chunked block's setting and each VAE decode's mode."""

    settings: dict[str, Setting]
    modes: dict[str, str] = field(default_factory=dict)


def signature(batch_shapes: list[list[int]]) -> Shapes:
    return tuple(tuple(s) for s in batch_shapes)


@dataclass
class ChunkChoice:
    """What :func:`choose_chunks` did (the settings chosen are in force on the units afterwards): the dry run without
    any change (the baseline), the time the dry runs took, notes, and the part of the model that holds the peak
    without the changes and with them (``feed-forward``, ``attention``, ``VAE decode``, ...)."""

    unchunked: DryRun
    seconds: float
    notes: list[str]
    part_without: str | None = None
    part: str | None = None
    peak_bytes: int | None = None  # the peak the check dry run gave with the choice


def choose_chunks(
    context: StepContext,
    pl_module: pl.LightningModule,
    changes: Changes,
    batch: Any,
    batch_idx: int = 0,
    loader: int | None = None,
    budget: int | None = None,
    device: Any = "cpu",
    stage: Stage = "predict",
    tiling: bool = True,
    reads: dict[Any, list[Any]] | None = None,
) -> ChunkChoice:
    """Choose every change of ``changes`` from dry runs of ``batch``, cheapest first:

    1. **VAE slicing** (identical outputs), where the decode holds the lowest peak chunking could reach without it
       (and, under a budget, only when the step does not meet it as it is): one dry run without any change replays
       each chunked block alone at several settings (:class:`~lightning_memopt.planning.ChunkRecorder`), one more
       with the decoders sliced.
    2. **Chunking**, each block's coarsest setting that meets the target (the budget, or without one the knee),
       checked by a dry run with the choice; blocks still over the target are tightened (three checks at most).
    3. **VAE tiling** (outputs change at the tile seams), only when a budget is still not met and ``tiling`` allows
       it; chunking is then chosen again with it.

    The settings chosen are left in force; where the step cannot be traced they are left as they were. ``reads``, a
    real step's (:class:`~lightning_memopt.reads.Recorder`), are replayed in every dry run."""
    units, decoders = changes.units, changes.decoders
    replays: dict[Any, Any] = {}  # each block kind is replayed once for all the dry runs

    def run(replay: bool) -> DryRun:
        @contextlib.contextmanager
        def watch(probe: Any) -> Iterator[tuple[ChunkRecorder, PeakLocator]]:
            with ChunkRecorder(units, probe, replay=replay, cache=replays) as recorder:
                with PeakLocator(probe, pl_module) as where:
                    yield recorder, where

        replay = Replay(reads)
        return dry_run_step(
            context, pl_module, batch, batch_idx, stage, loader, watch=watch, device=device, reads=replay
        )

    with changes.undone():
        dry = run(replay=True)
        sliced = None
        needed = budget is None or (dry.peak_bytes is not None and dry.peak_bytes > budget)  # nothing, if it fits
        if decoders and dry.peak_bytes is not None and needed:
            for decoder in decoders:
                decoder.set("sliced")
            sliced = run(replay=True)
    if dry.peak_bytes is None:
        return ChunkChoice(dry, dry.seconds, [])
    seconds = dry.seconds + (sliced.seconds if sliced is not None else 0.0)
    recorder = dry.watched[0]
    if sliced is not None and sliced.peak_bytes is not None:
        lower = _lowest(sliced.watched[0]) < _lowest(recorder)  # the decode holds the peak chunking cannot lower
        for decoder in decoders:
            decoder.set("sliced" if lower else "plain")
        recorder = sliced.watched[0] if lower else recorder
    checked, part, notes, spent = _chunk_and_check(run, units, recorder, budget)
    seconds += spent
    tileable = [d for d in decoders if d.can_tile and tiling]
    if budget is not None and checked is not None and checked > budget and tileable:
        for decoder in tileable:
            decoder.set("tiled")
        tiled = run(replay=True)
        seconds += tiled.seconds
        if tiled.peak_bytes is not None and _lowest(tiled.watched[0]) < _lowest(recorder):
            checked, part, more, spent = _chunk_and_check(run, units, tiled.watched[0], budget)
            seconds += spent
            notes = [n for n in notes if "budget" not in n] + more
        else:
            for decoder in tileable:
                decoder.set("sliced")
    return ChunkChoice(dry, seconds, notes, dry.watched[1].part, part, checked)


def _lowest(recorder: ChunkRecorder) -> int:
    """The lowest peak chunking reaches, from a dry run's figures."""
    return plan_chunks(recorder.blocks, recorder.rest, None).lowest


def _chunk_and_check(
    run: Callable[[bool], DryRun], units: list[Any], recorder: ChunkRecorder, budget: int | None
) -> tuple[int | None, str | None, list[str], float]:
    """Choose each block's chunking from ``recorder``'s figures, then check it by dry runs with the choice, tightening
    blocks still over the target. Returns the checked peak, the part holding it, notes and the seconds spent."""
    plan = plan_chunks(recorder.blocks, recorder.rest, budget)
    settings, checked, part, seconds = plan.settings, None, None, 0.0
    apply_settings(units, settings)
    for _ in range(3):
        check = run(False)
        seconds += check.seconds
        if check.peak_bytes is None:
            break
        checked, part = check.peak_bytes, check.watched[1].part
        if plan.target is None or checked <= plan.target:
            break
        for name, block in check.watched[0].blocks.items():
            recorder.blocks[name].inside = block.inside
        tightened = tighten(recorder.blocks, settings, plan.target)
        if tightened is None:
            what = "budget" if budget is not None and plan.target == budget else "target"
            plan.notes.append(f"the {what} of {plan.target} bytes was not reached: the peak is {checked} bytes")
            break
        settings = tightened
        apply_settings(units, settings)
    return checked, part, plan.notes, seconds


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
        verify: Compare outputs with and without chunking on the measured batch.
        tolerance: The relative tolerance of ``verify``.
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
        verify: bool,
        tolerance: float,
        cache: dict[Shapes, Chosen],
    ) -> None:
        self.stage = stage
        self.changes = changes
        self.report = report
        self.budget = budget
        self.tune = tune
        self.verify = verify
        self.tolerance = tolerance
        self.cache = cache
        self.schedule = Schedule(0) if measure else None
        self.measurement: Measurement | None = None
        self.tiling: TilingCheck | None = None
        self.planned: list[list[int]] | None = None  # the largest shapes settings were chosen for
        self.guess: Guess | None = None  # where the settings were chosen from dry runs that gave placeholders
        self.measured_batch: Measurement | None = None  # measured, its changed blocks not yet timed
        self.watch: PeakProbe | None = None
        if tune:
            apply_settings(changes.units, {u.name: Setting(u.dim, None, 1) for u in changes.units})

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
        if self.tiling is None and any(d.mode == "tiled" for d in self.changes.decoders):
            self.tiling = TilingCheck(self.changes.decoders)  # the first tiled batch: keeps its first sample
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
                record(self.report, measurement)
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
            record(self.report, self.measured_batch)
            self.measured_batch = None
        self.abort()
        if self.schedule is not None and not self.schedule.done:
            self.report.notes.append("no batch was measured: the run ended before the batch chosen for it")
        self.report.chunk_settings = describe({u.name: current(u) for u in self.changes.units})
        self.report.decoding = ", ".join(f"{d.name} {d.mode}" for d in self.changes.decoders) or None
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
        self.report.notes.append(why)
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
        units, key = self.changes.units, signature(seen)
        chosen = self.cache.get(key)
        if chosen is not None and all(d.name in chosen.modes for d in self.changes.decoders):
            apply_settings(units, chosen.settings)
            for decoder in self.changes.decoders:
                decoder.set(chosen.modes[decoder.name])
            rank_zero_info(f"MemOpt: reusing chunk settings chosen for these shapes: {describe(chosen.settings)}")
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
                f" ({describe({u.name: current(u) for u in units})}); a batch that runs out of memory is still retried"
                " finer. Pass an int `chunk_size` to choose yourself."
            )
            note = f"chunk settings could not be chosen: {dry.note}"
            self.report.notes += [note] if note not in self.report.notes else []
            self.cache[key] = self._in_force()  # not tried again for these shapes
            return dry
        self.cache[key] = chosen = self._in_force()
        self.report.peak_part, self.report.baseline_part = choice.part, choice.part_without
        self.report.weights_bytes = dry.live_bytes.get("weights")
        self._warn_tiling()
        self.report.tuning_s = (self.report.tuning_s or 0.0) + choice.seconds
        for note in choice.notes:
            if note not in self.report.notes and self.budget is not None and "budget" in note:
                rank_zero_warn(f"MemOpt: {note}.")
        self.report.notes += [n for n in choice.notes if n not in self.report.notes]
        when = "" if first else "longer inputs: "
        rank_zero_info(
            f"MemOpt: {when}chunk settings chosen by dry runs in {choice.seconds:.2f} s: {describe(chosen.settings)}"
            + "".join(f"; {d.name} decodes {d.mode}" for d in self.changes.decoders)
        )
        return dry

    def _in_force(self) -> Chosen:
        return Chosen({u.name: current(u) for u in self.changes.units}, {d.name: d.mode for d in self.changes.decoders})

    def _finer(self, why: str) -> bool:
        """One step cheaper in memory, cheapest first: slice the VAE decodes that are not, else every chunked block
        one step finer, else tile the VAE decodes (outputs change). False when nothing is left."""
        decoders = self.changes.decoders
        what = None
        if plain := [d for d in decoders if d.mode == "plain"]:
            for decoder in plain:
                decoder.set("sliced")
            what = "with the VAE decode sliced"
        else:
            for unit in self.changes.units:
                step = finer(unit, current(unit))
                if step is not None:
                    unit.set(step.dim, step.size)
                    what = "with every block one step finer"
        tileable = [d for d in decoders if d.mode == "sliced" and d.can_tile and self.tiling_allowed]
        if what is None and tileable:
            for decoder in tileable:
                decoder.set("tiled")
            what = "with the VAE decode tiled"
        if what is not None:
            settings = describe({u.name: current(u) for u in self.changes.units})
            decodes = "".join(f"; {d.name} decodes {d.mode}" for d in decoders)
            rank_zero_info(f"MemOpt: {why} {what}: {settings}{decodes}")
            self._warn_tiling()
        return what is not None

    def _warn_tiling(self) -> None:
        tiled = [d.name for d in self.changes.decoders if d.mode == "tiled"]
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
            self.report.notes.append("the difference VAE tiling made could not be measured: decoding untiled failed")

    def rescue(self, pl_module: pl.LightningModule) -> AttributeOverride:
        """Wrap the loop's step so that a batch that runs out of memory is retried one step cheaper in memory, in
        place: the outputs hold every batch once, in order. The error is raised, with a clear message, only when
        nothing is left to make cheaper."""
        name = STEPS[self.stage]
        original: Callable[..., Any] = getattr(pl_module, name)

        @functools.wraps(original)  # Lightning reads the step's signature to know whether it takes batch_idx
        def step(batch: Any, *args: Any, **kwargs: Any) -> Any:
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
                        settings = describe({u.name: current(u) for u in self.changes.units})
                        raise RuntimeError(
                            f"MemOpt: a {self.stage} batch ran out of memory even with every block chunked as finely"
                            f" as it can be ({settings}). Lower the batch size or the input size. ({error})"
                        ) from error
                    batch = given()

        return AttributeOverride(pl_module, name, step)


def _batch_counts(trainer: pl.Trainer, stage: str) -> list[Any]:
    """The loop's number of batches per dataloader, as Lightning keeps it."""
    counts = {"predict": "num_predict_batches", "validate": "num_val_batches", "test": "num_test_batches"}
    return list(getattr(trainer, counts[stage]))
