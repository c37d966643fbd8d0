"""MemOpt during predict: feed-forward chunking, each block's setting chosen by dry runs before a batch runs, out of
memory rescue, and the one measured batch."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_memopt.callbacks.changes import Changes
from lightning_memopt.callbacks.dry_step import DryRun, StepContext, dry_run_step
from lightning_memopt.callbacks.measure import Measurement, record
from lightning_memopt.callbacks.report import MemOptReport, publish
from lightning_memopt.callbacks.schedule import Schedule, shapes
from lightning_memopt.compat import _disable_current_modes, map_tensors
from lightning_memopt.memory import PeakProbe, free_memory, is_oom, probe_for
from lightning_memopt.planning import ChunkRecorder, apply_settings, plan_chunks, tighten
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


def signature(batch_shapes: list[list[int]]) -> Shapes:
    return tuple(tuple(s) for s in batch_shapes)


@dataclass
class ChunkChoice:
    """What :func:`choose_chunks` did: the dry run without chunking, the peak of the check with the settings chosen
    (in force on the units afterwards), the time the dry runs took, and notes."""

    unchunked: DryRun
    checked: int | None
    seconds: float
    notes: list[str]


def choose_chunks(
    context: StepContext,
    pl_module: pl.LightningModule,
    changes: Changes,
    batch: Any,
    batch_idx: int = 0,
    loader: int | None = None,
    budget: int | None = None,
    device: Any = "cpu",
) -> ChunkChoice:
    """Choose every chunked block's setting from dry runs of ``batch``: one without chunking that replays each block
    alone at several settings (:class:`~lightning_memopt.planning.ChunkRecorder`), then, where the choice rests on a
    predicted figure, up to three with the choice, tightening blocks still over the target. The settings chosen are
    left in force on ``changes.units``; where the step cannot be traced they are left as they were."""
    units = changes.units

    def run(replay: bool) -> DryRun:
        def watch(probe: Any) -> ChunkRecorder:
            return ChunkRecorder(units, probe, replay=replay)

        return dry_run_step(context, pl_module, batch, batch_idx, "predict", loader, watch=watch, device=device)

    with changes.undone():
        dry = run(replay=True)
    if dry.peak_bytes is None:
        return ChunkChoice(dry, None, dry.seconds, [])
    recorder, seconds = dry.watched, dry.seconds
    plan = plan_chunks(recorder.blocks, recorder.rest, budget)
    settings, checked = plan.settings, None
    apply_settings(units, settings)
    # a choice made from measured figures only needs no check, nor one with no target (every block at its finest)
    for _ in range(3 if not plan.exact and plan.target is not None else 0):
        check = run(replay=False)
        seconds, checked = seconds + check.seconds, check.peak_bytes
        if checked is None or plan.target is None or checked <= plan.target:
            break
        for name, block in check.watched.blocks.items():
            recorder.blocks[name].inside = block.inside
        tightened = tighten(recorder.blocks, settings, plan.target)
        if tightened is None:
            what = "budget" if budget is not None else "target"
            plan.notes.append(f"the {what} of {plan.target} bytes was not reached: the peak is {checked} bytes")
            break
        settings = tightened
        apply_settings(units, settings)
    return ChunkChoice(dry, checked if not plan.exact else plan.expected, seconds, plan.notes)


class PredictSession:
    """Owns chunking for one predict run: the units' settings, when to choose them again, rescue and measurement.

    Settings are chosen from dry runs of a batch before it runs (``chunk_size="auto"``): on the first batch, and again
    when a batch holds a longer tensor than any batch they were chosen for. No collective runs: memory follows from
    shapes, so ranks with the same shapes choose the same settings, and a rank with longer inputs chooses its own.

    Args:
        changes: The chunking applied to the models.
        report: Where the figures go.
        budget: The peak to stay under, in bytes, or ``None``.
        tune: Choose settings by dry runs (``chunk_size="auto"``); otherwise only rescue batches that run out of
            memory.
        measure: Measure the first batch.
        verify: Compare outputs with and without chunking on the measured batch.
        tolerance: The relative tolerance of ``verify``.
        cache: Settings chosen already, per batch shapes (a resumed run's, from ``state_dict``); filled as it goes.
    """

    def __init__(
        self,
        changes: Changes,
        report: MemOptReport,
        budget: int | None,
        tune: bool,
        measure: bool,
        verify: bool,
        tolerance: float,
        cache: dict[Shapes, dict[str, Setting]],
    ) -> None:
        self.changes = changes
        self.report = report
        self.budget = budget
        self.tune = tune
        self.verify = verify
        self.tolerance = tolerance
        self.cache = cache
        self.schedule = Schedule(0) if measure else None
        self.measurement: Measurement | None = None
        self.planned: list[list[int]] | None = None  # the largest shapes settings were chosen for
        self.watch: PeakProbe | None = None
        if tune:
            apply_settings(changes.units, {u.name: Setting(u.dim, None, 1) for u in changes.units})

    # hooks ----------------------------------------------------------------------------------------------------------

    def batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int
    ) -> None:
        dry = None
        loader = dataloader_idx if len(trainer.num_predict_batches) > 1 else None  # as Lightning passes it
        if self.tune and self._longer(shapes(batch)):
            dry = self._choose(trainer, pl_module, batch, batch_idx, loader)
        if self.schedule is not None and dataloader_idx == 0 and self.schedule.due(batch_idx):
            self.measurement = Measurement("predict", self.changes, self.verify, self.tolerance)
            self.measurement.start(trainer, pl_module, batch, batch_idx, loader, dry)
        elif self.budget is not None and pl_module.device.type != "cpu":  # on CPU the dry run is exact
            self.watch = probe_for(pl_module.device)
            self.watch.start([])

    def batch_end(self, pl_module: pl.LightningModule, outputs: Any) -> None:
        peak = None
        if self.measurement is not None:
            measurement, self.measurement = self.measurement, None
            measurement.stop(pl_module)
            if measurement.finish(outputs):
                assert self.schedule is not None
                self.schedule.done = True
                record(self.report, measurement)
                peak = measurement.figures.peak_bytes
        if self.watch is not None:
            peak, self.watch = self.watch.stop()[0], None
        if self.budget is not None and peak is not None and peak > self.budget:
            self._finer(f"a batch peaked at {peak} bytes, over the budget of {self.budget} bytes; the next runs")

    def end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Every rank reaches the end of predict, also one with fewer batches: the figures are gathered here."""
        self.abort()
        if self.schedule is not None and not self.schedule.done:
            self.report.notes.append("no batch was measured: the run ended before the batch chosen for it")
        self.report.chunk_settings = describe({u.name: current(u) for u in self.changes.units})
        if self.schedule is None:  # measure=False: nothing is gathered or logged, as at fit
            return
        publish(trainer, self.report, pl_module.device, self.budget, f"chunked: {self.report.chunk_settings}")

    def abort(self) -> None:
        if self.measurement is not None:
            self.measurement.abort()
            self.measurement = None
        if self.watch is not None:
            self.watch.stop()
            self.watch = None

    # choosing settings ----------------------------------------------------------------------------------------------

    def _longer(self, seen: list[list[int]]) -> bool:
        """Whether this batch holds a tensor longer, along any dim, than the batches the settings were chosen for."""
        planned = self.planned
        if planned is None or [len(s) for s in seen] != [len(s) for s in planned]:
            return True
        return any(n > m for new, old in zip(seen, planned, strict=True) for n, m in zip(new, old, strict=True))

    def _choose(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, loader: int | None
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
        if key in self.cache:
            apply_settings(units, self.cache[key])
            rank_zero_info(f"MemOpt: reusing chunk settings chosen for these shapes: {describe(self.cache[key])}")
            return None
        context = StepContext.of(trainer, "predict")
        choice = choose_chunks(context, pl_module, self.changes, batch, batch_idx, loader, self.budget)
        dry = choice.unchunked
        if dry.peak_bytes is None:
            rank_zero_warn(
                f"MemOpt: chunk settings could not be chosen: {dry.note}. Chunking stays as it is"
                f" ({describe({u.name: current(u) for u in units})}); a batch that runs out of memory is still retried"
                " finer. Pass an int `chunk_size` to choose yourself."
            )
            self.report.notes.append(f"chunk settings could not be chosen: {dry.note}")
            return dry
        self.cache[key] = {u.name: current(u) for u in units}
        self.report.tuning_s = (self.report.tuning_s or 0.0) + choice.seconds
        for note in choice.notes:
            if note not in self.report.notes and self.budget is not None and "budget" in note:
                rank_zero_warn(f"MemOpt: {note}.")
        self.report.notes += [n for n in choice.notes if n not in self.report.notes]
        when = "" if first else "longer inputs: "
        rank_zero_info(
            f"MemOpt: {when}chunk settings chosen by dry runs in {choice.seconds:.2f} s: {describe(self.cache[key])}"
        )
        return dry

    def _finer(self, why: str) -> bool:
        """Every block one step finer. False when none can be."""
        tightened = False
        for unit in self.changes.units:
            step = finer(unit, current(unit))
            if step is not None:
                unit.set(step.dim, step.size)
                tightened = True
        if tightened:
            settings = describe({u.name: current(u) for u in self.changes.units})
            rank_zero_info(f"MemOpt: {why} with every block one step finer: {settings}")
        return tightened

    def rescue(self, pl_module: pl.LightningModule) -> AttributeOverride:
        """Wrap ``predict_step`` so that a batch that runs out of memory is retried with finer chunking, in place: the
        predictions hold every batch once, in order. The error is raised, with a clear message, only when no block can
        be chunked more finely."""
        original: Callable[..., Any] = pl_module.predict_step

        @functools.wraps(original)  # Lightning reads the step's signature to know whether it takes batch_idx
        def predict_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
            given = host_copy(batch)  # a retry sees the batch as the dataloader gave it, not as the step left it
            while True:
                try:
                    return original(batch, *args, **kwargs)
                except Exception as error:
                    if not is_oom(error):
                        raise
                    free_memory(pl_module.device)
                    if self.measurement is not None:  # measure a later batch instead
                        self.abort()
                        assert self.schedule is not None
                        self.schedule.retry(1)
                    if not self._finer("a batch ran out of memory; retrying it"):
                        settings = describe({u.name: current(u) for u in self.changes.units})
                        raise RuntimeError(
                            "MemOpt: a predict batch ran out of memory even with every block chunked as finely as it"
                            f" can be ({settings}). Lower the batch size or the input size. ({error})"
                        ) from error
                    batch = given()

        return AttributeOverride(pl_module, "predict_step", predict_step)
