"""One stage's pipeline, written once for every technique: resolve the budget, apply, plan before the first batch (or
a longer one), agree over ranks, measure one batch, rescue a batch that runs out of memory, report, undo.

:class:`~lightning_memopt.MemOpt` opens one :class:`Stage` when fit starts and one when each predict, validation or
test loop starts, calls it from the Trainer's hooks and closes it when the run or the loop ends;
:func:`~lightning_memopt.estimate` drives the same object without a Trainer. The stage never names a technique: it
calls the methods of :class:`~lightning_memopt.techniques.base.Technique` on every technique of the stage, in the
registry's order.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_memopt.adapters import FoundModel, find_models
from lightning_memopt.engine.changes import Changes
from lightning_memopt.engine.config import MemOptConfig
from lightning_memopt.engine.measure import Guess, Measurement, live_by_kind
from lightning_memopt.engine.report import MemOptReport
from lightning_memopt.engine.schedule import Schedule, Shapes, host_copy, shapes, signature
from lightning_memopt.engine.step import STEPS, DryRun, StepContext, dry_run_step
from lightning_memopt.engine.step import Stage as StageName
from lightning_memopt.handles import AttributeOverride, run_all
from lightning_memopt.memory import PeakProbe, free_memory, is_oom, probe_for
from lightning_memopt.plans import keep, owner_of, path, recall
from lightning_memopt.progress import dry_run
from lightning_memopt.progress import planning as progress
from lightning_memopt.reads import Replay
from lightning_memopt.techniques import techniques_for
from lightning_memopt.techniques.base import Plan, Planning, overrides
from lightning_memopt.techniques.planner import choose
from lightning_memopt.timing import keep_unseen
from lightning_memopt.tuning import budget_for
from lightning_memopt.units import fmt_sizes

#: The stages whose step can run again after it ran out of memory: no gradients, no optimizer step.
RETRIED = ("predict", "validate", "test")


def _said(chosen: Any) -> Plan:
    """What the stage's planner chose, as a plan the report and the user get."""
    notes = [*chosen.notes, *_planner_words(chosen)]
    said = Plan(chosen.seconds, notes, peak_bytes=chosen.peak_bytes, placeholders=chosen.placeholders)
    said.predicted_s, said.calibration_s, said.ranked = chosen.predicted_s, chosen.speed.seconds, chosen.ranked
    said.baseline, said.part, said.part_without = chosen.baseline, chosen.part, chosen.part_without
    said.warnings = [f"{note}." for note in notes]
    return said


def _planner_words(chosen: Any) -> list[str]:
    """What the planner's search found that the user should hear (an ``Outcome``'s ``left_out``, ``lossy_reach``
    and ``least``), in words."""
    words = [f"{settings} could not be dry-run together ({note}): left out" for settings, note in chosen.left_out]
    if chosen.lossy_reach is not None:
        where, reach = chosen.lossy_reach
        words.append(
            f"the budget of {fmt_sizes(chosen.target)[0]} is met only by settings that change results ({where}: "
            f"{fmt_sizes(reach)[0]}); pass lossy=True to allow them"
        )
    if chosen.least is not None:
        budget, least = fmt_sizes(chosen.target, chosen.least)
        words.append(f"the budget of {budget} is not met even with the settings that hold the least memory ({least})")
    return words


#: The figures of a baseline's dry run kept with a plan between runs.
KEPT_FIGURES = ("peak_bytes", "seconds", "note", "live_bytes", "remarks", "at_peak", "elsewhere_peak", "kept_peak")


def reduce_nothing(values: list[float]) -> list[float]:
    """One process: the maximum over ranks of each number is the number."""
    return values


@dataclass
class Hooks:
    """What a stage needs of the world around it: how to build the dry runs' context, agree over ranks, and send a
    report out (a Trainer's; :func:`~lightning_memopt.estimate` has none)."""

    context: Callable[[], StepContext] = StepContext
    reduce_max: Callable[[list[float]], list[float]] = reduce_nothing
    publish: Callable[[MemOptReport, int | None, str], None] | None = None
    warn: Callable[[str], None] = rank_zero_warn
    say: Callable[[str], None] = rank_zero_info
    #: Figures one rank knows to the loggers, no collective; ``None``: the step after the measured one is not timed
    #: against the time model's prediction (several processes, or no Trainer).
    log: Callable[[dict[str, float]], None] | None = None
    device: Any = "cpu"  # the device a model on the meta device pretends to be on
    target: Any = None  # the device planned for, where the dry runs stand in for it on ``device`` (an estimate's)
    #: What real steps of this stage's model on the device took beyond their dry runs' predictions before, given what
    #: they belong to (:func:`~lightning_memopt.plans.owner_of`; a Trainer's run reads it from
    #: :func:`~lightning_memopt.timing.unseen_bytes`; an estimate charges nothing).
    unseen: Callable[[str], int] = lambda owner: 0
    #: The key a plan for a batch is kept under between runs (:mod:`~lightning_memopt.plans`), given the batch and the
    #: stage's target; ``None``: plans are not kept.
    plan_key: Callable[[Any, int | None], str | None] = lambda batch, target: None


@dataclass
class Stage:
    """One run of a stage: its changes to the models, its report, its settings per batch shapes, and the batch it
    measures.

    Args:
        stage: ``fit``, ``predict``, ``validate`` or ``test``.
        changes: The stage's techniques, applied (see :func:`open_stage`).
        config: MemOpt's options.
        budget: The peak to stay under, in bytes (``None``: each technique's own target).
        report: Where the figures go; this stage is its one writer.
        measure: Measure one batch.
        cache: The settings chosen per batch shapes, each technique's ``state()`` (a resumed run's, from
            ``state_dict``); filled as it goes.
        hooks: The Trainer's context, collectives and loggers, or none.
    """

    stage: StageName
    changes: Changes
    config: MemOptConfig
    budget: int | None
    report: MemOptReport
    measure: bool = True
    cache: dict[Shapes, dict[str, Any]] = field(default_factory=dict)
    hooks: Hooks = field(default_factory=Hooks)
    schedule: Schedule | None = None
    measurement: Measurement | None = None
    guess: Guess | None = None  # where settings were chosen from dry runs that gave placeholders
    planned: list[list[int]] | None = None  # the longest shapes the settings were chosen for
    measured_batch: Measurement | None = None  # measured, its changes not yet timed (at the stage's end)
    watch: PeakProbe | None = None
    #: Bytes the real step took beyond its dry run's prediction, charged to the plan: planned for a budget this much
    #: lower (carried from earlier runs on the device until this stage's batches are observed).
    unseen: int = 0
    _settled: bool = False  # a batch met the budget, or nothing more can be done: batches no longer watched for it
    _first_predicted: int | None = None  # a fit's first step (no optimizer state yet): its dry run's peak
    _time_next: bool = False  # time the next batch, to set the time model's prediction against
    _started: float | None = None
    _stored: str | None = None  # the key the plan in force is kept under between runs

    @classmethod
    def open(
        cls,
        stage: StageName,
        module: Any,
        config: MemOptConfig,
        report: MemOptReport,
        hooks: Hooks,
        skipped: Callable[[str], None],
        warn: Callable[[str], None],
        quiet: bool = False,
        measure: bool = True,
        cache: dict[Shapes, dict[str, Any]] | None = None,
        device: Any = None,
    ) -> Stage | None:
        """Apply the stage's techniques to the models in ``module`` and return the stage that drives them; undo it all
        with :meth:`close`. ``None`` where no technique of the stage is on (or each refuses this Trainer, said through
        ``warn``), or none changed anything and nothing is to be measured.

        Args:
            skipped: Called with a sentence when a model has nothing the techniques can use.
            warn: Called with what a technique refuses, or why ``memory_budget`` chooses nothing of it.
            quiet: Say nothing of what is applied (a loop opened again in one fit).
            device: The device the budget is a fraction of (by default the module's).
        """
        context = hooks.context()
        classes = [t for t in techniques_for(stage) if t.enabled_by(config)]
        refused = []
        for technique in classes:
            if (why := technique.refuses(context)) is not None:
                if technique.may_act(config):  # one these options never put in force stands down quietly
                    warn(why)
                refused.append(technique)
        if len(refused) == len(classes):
            return None
        models = find_models(module, config.models)
        changes = open_stage(stage, models, config, skipped, quiet, tuple(refused), context)
        if not models:
            skipped(f"{type(module).__name__} contains no model MemOpt can use for {changes.lead}")
        if changes.nothing and not measure:
            changes.remove()
            return None
        budget, resolved = budget_for(config.memory_budget, device if device is not None else module.device)
        for why in budget_warnings(config, changes, budget):
            warn(why)
        budget = stage_budget(config, changes, budget)
        opened = cls(stage, changes, config, budget, report, measure, cache if cache is not None else {}, hooks)
        report.note(resolved)
        if stage in RETRIED and not changes.nothing:
            changes.add_handle(opened.rescue(module))
        return opened

    def close(self, completed: bool = True) -> None:
        """The stage ends (:meth:`end`, or where the run failed :meth:`abort`) and every change comes off, also when
        the first raises (its error is raised after)."""
        run_all([self.end if completed else self.abort, self.changes.remove])

    def __post_init__(self) -> None:
        self.report.set_up, self.report.budget_bytes = self.changes.applied, self.budget
        self.report.in_force = [t.name for t in self.techniques if t.changed]
        self._replans = any(t.replans_longer for t in self.techniques)
        # a change timed alone is timed when the stage ends, and the figures go out then; else with the measured batch
        self._timed_alone = any(t.timed_alone for t in self.techniques)
        # the techniques with something to do around each batch: the others cost no call on a batch not measured
        self._around = [t for t in self.techniques if overrides(t, "batch_start") or overrides(t, "batch_end")]
        self.unseen = 0  # charged when the first batch is planned: what a step of this model and shapes took before
        self._owner: str | None = None  # what the bytes beyond a dry run belong to (plans.owner_of)
        self._settled = self.budget is None
        self._marks: dict[str, int] = {}  # a watched fit step's peak so far as each phase ends

    def _plan_key(self, module: Any, batch: Any) -> str | None:
        """The key the plan for ``batch`` is kept under (``Hooks.plan_key``). At the first batch planned, what a real
        step of this model on these shapes took beyond its dry run before (on this device) is charged to the plan
        first, and said; a step of another model or shapes charges nothing."""
        if self._owner is None:
            self._owner = owner_of(self.stage, module, batch)
            self.unseen = self.hooks.unseen(self._owner) if self.budget is not None else 0
            if self.unseen:
                self.report.note(
                    f"planned for the budget less {fmt_sizes(self.unseen)[0]}, what a real step of this model on these"
                    " shapes took beyond its dry run before on this device"
                )
        return self.hooks.plan_key(batch, self.target)

    @property
    def target(self) -> int | None:
        """The peak the dry runs plan for: the budget less what real steps took beyond their dry runs."""
        return None if self.budget is None else max(self.budget - self.unseen, 0)

    @property
    def techniques(self) -> list[Any]:
        return self.changes.techniques

    @property
    def measured(self) -> bool:
        return self.schedule is not None and self.schedule.done

    # planning -------------------------------------------------------------------------------------------------------

    def _longer(self, seen: list[list[int]]) -> bool:
        """Whether this batch holds a tensor longer, along any dim, than the batches the settings were chosen for."""
        planned = self.planned
        if planned is None or [len(s) for s in seen] != [len(s) for s in planned]:
            return True
        return any(n > m for new, old in zip(seen, planned, strict=True) for n, m in zip(new, old, strict=True))

    def plan(
        self,
        module: Any,
        batch: Any,
        batch_idx: int = 0,
        loader: int | None = None,
        reads: dict[Any, list[Any]] | None = None,
    ) -> DryRun | None:
        """Each technique's settings from dry runs of ``batch`` before it runs (or of a batch that ran, replaying
        its ``reads``): settings chosen before for these shapes are reused, then the ranks agree. Returns the dry
        run without any change where a planner made one (the measured batch's baseline)."""
        seen = shapes(batch)
        first, planned = self.planned is None, self.planned or []
        if [len(s) for s in seen] == [len(s) for s in planned]:  # the same tensors: the longest of each dim
            self.planned = [[max(a, b) for a, b in zip(n, o, strict=True)] for n, o in zip(seen, planned, strict=True)]
        else:  # another kind of batch (another dataloader): plan for it
            self.planned = seen
        key, stored = signature(seen), self._plan_key(module, batch)
        resumed = reads is None and self._reuse(key, stored)
        planning = self._planning(
            module,
            batch,
            batch_idx,
            loader,
            budget=self.target,
            choose=not resumed,
            measure=self.measure,
            lossy=self.config.may_change_results,
            reads=reads,
            longer=not first,
        )
        planners = [t for t in self.techniques if first or reads is not None or t.replans_longer]
        plans = []
        with progress(self.stage):
            knobs = [k for t in planners for k in t.knobs(planning)]
            if knobs:  # chosen together, under the stage's budget, before each technique says what it got
                chosen = choose(planning, knobs, self.target)
                planning = dataclasses.replace(planning, chosen=chosen)
                plans.append(_said(chosen))
            plans += [p for t in planners if (p := t.plan(planning)) is not None]
        predicted = [p.peak_bytes for p in plans if p.peak_bytes is not None]
        if predicted:  # the step's peak with the settings now in force, as the dry runs count it
            self.report.planned_peak_bytes = predicted[-1]
        for technique in self.techniques:  # every rank reaches this point, with the same techniques
            technique.agree(self.hooks.reduce_max)
        self.cache[key] = self.changes.state()
        if first:  # what each technique does, now that its settings are chosen
            for line in self.changes.announce():
                self.hooks.say(line)
        if plans:  # a new choice: only its own dry runs' placeholders are checked against the real step
            self.guess = None
        for plan in plans:
            self._said(plan)
        if not resumed and stored is not None and self.guess is None:  # kept where no value the step read was guessed
            report = self.report
            keep(stored, settings=self.cache[key], planned_peak_bytes=report.planned_peak_bytes, baselines={},
                 predicted_step_s=report.predicted_step_s)  # fmt: skip
            self._stored = stored
        self._write_sections()
        return next((p.baseline for p in reversed(plans) if p.baseline is not None), None)

    def _reuse(self, key: Shapes, stored: str | None) -> bool:
        """Put in force the settings chosen before for these shapes in this run (or a resumed one's), else those a
        run before kept under ``stored`` (:mod:`~lightning_memopt.plans`); whether there were such and they fit."""
        chosen = self.cache.get(key)
        kept = recall(stored) if chosen is None else None
        settings = chosen if chosen is not None else (kept or {}).get("settings")
        if settings is None or not self.changes.load(settings):
            return False
        if chosen is not None:
            self.hooks.say(f"MemOpt: reusing the settings chosen for these shapes: {self.changes.describe()}")
            return True
        assert kept is not None
        self.hooks.say(f"MemOpt: reusing the plan from {kept['when']} ({path()}): {self.changes.describe()}")
        self.report.planned_peak_bytes = kept.get("planned_peak_bytes")
        self.report.predicted_step_s = kept.get("predicted_step_s")
        self._stored = stored
        return True

    def _said(self, plan: Plan) -> None:
        """A plan's figures into the report, and its lines to the user."""
        report = self.report
        report.tuning_s = (report.tuning_s or 0.0) + plan.seconds
        if plan.predicted_s is not None:
            report.predicted_step_s = plan.predicted_s
            report.calibration_s = (report.calibration_s or 0.0) + (plan.calibration_s or 0.0)
            report.time_ranked = plan.ranked
        added = report.note(*plan.notes)
        if plan.placeholders:
            self.guess = Guess(plan.peak_bytes)
        if plan.baseline is not None and plan.part_without is not None:
            report.peak_part, report.baseline_part = plan.part, plan.part_without
            report.weights_bytes = plan.baseline.live_bytes.get("weights")
        for warning in [*plan.warnings, *(f"{n}." for n in plan.loud if n in added), *self._notices()]:
            self.hooks.warn(f"MemOpt: {warning}")
        for line in plan.said:
            self.hooks.say(f"MemOpt: {line() if callable(line) else line}")

    def _notices(self) -> list[str]:
        return [n for t in self.techniques for n in t.notices(self.target)]

    def _write_sections(self) -> None:
        self.report.sections = {t.name: t.section() for t in self.techniques}
        self.report.in_force = [t.name for t in self.techniques if t.changed]
        self.report.note(*(n for s in self.report.sections.values() for n in s.notes))

    # the batches ----------------------------------------------------------------------------------------------------

    def batch_start(
        self,
        trainer: Any,
        module: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
        loader: int | None = None,
    ) -> None:
        """Before a batch: settings chosen (the first batch, or longer inputs), the batch measured where due, else
        on an accelerator its peak watched against the budget."""
        dry = None
        if self.planned is None or (self._replans and self._longer(shapes(batch))):
            dry = self.plan(module, batch, batch_idx, loader)
        if self.measure and self.schedule is None:  # batch counts are known from the first batch on
            self.schedule = Schedule.for_stage(trainer, self.stage, module.automatic_optimization, batch_idx)
        for technique in self._around:
            technique.batch_start()
        if self._time_next and dry is None:  # the step after the measured one, timed for the time model
            self._time_next = False
            self._started = _clock(module)
        if (
            not self._settled
            and self.report.planned_peak_bytes is not None
            and self.stage == "fit"
            and not _steady(trainer)
        ):
            # the first step creates the optimizer's state: its dry run, to set the real one against
            self._first_predicted = self._planning(module, batch, batch_idx, loader).run().peak_bytes
        self._marks = {}  # this batch's own
        if self.schedule is not None and dataloader_idx == 0 and self.schedule.due(batch_idx):
            self.measurement = Measurement(self.stage, self.changes, self.config.verify, self.config.verify_tolerance)
            remembered = self._baseline(batch_idx) if dry is None else None
            self.measurement.start(trainer, module, batch, batch_idx, loader, dry or remembered)
            if remembered is None:
                self._keep_baseline(batch_idx, self.measurement.baseline_run)
        elif not self._settled or (self.budget is not None and self.stage in RETRIED and module.device.type != "cpu"):
            self.watch = probe_for(module.device)  # each batch against the budget until one meets it
            self.watch.start(live_by_kind(trainer, module, batch) if module.device.type == "cpu" else [])

    def _baseline(self, batch_idx: int) -> DryRun | None:
        """The baseline's dry run of a batch like this one, kept with the plan reused (``None``: none is)."""
        kept = (recall(self._stored) or {}).get("baselines", {}).get(str(batch_idx))
        if kept is None:
            return None
        if "reads" in kept:  # the step reads values out of its tensors: its baseline is a dry run after it only
            return DryRun(None, 0.0, placeholders=kept["reads"])
        self.hooks.say("MemOpt: the baseline's figures are those kept with the plan, not dry-run again")
        return DryRun(**kept)

    def _keep_baseline(self, batch_idx: int, dry: DryRun | None) -> None:
        """Keep the baseline's figures with the plan, where its dry run stood in for nothing the step read; where it
        did, that it did: the next run's baseline is then only the dry run after the step that replays the values
        the step read (a dry run before it, on placeholders, would be replaced by it)."""
        if self._stored is None or dry is None or dry.peak_bytes is None or dry.replayed:
            return
        figures = {"reads": dry.placeholders} if dry.placeholders else {f: getattr(dry, f) for f in KEPT_FIGURES}
        baselines = (recall(self._stored) or {}).get("baselines", {})
        keep(self._stored, baselines={**baselines, str(batch_idx): figures})

    def before_backward(self) -> None:
        if not self._settled:  # a settled stage costs no call here
            self._mark("forward")
        if self.measurement is not None:
            self.measurement.before_backward()

    def before_optimizer_step(self, module: Any) -> None:
        if not self._settled:
            self._mark("backward")
        if self.measurement is not None:  # before Lightning clips the gradients
            self.measurement.before_optimizer_step(module)

    def _mark(self, phase: str) -> None:
        """The peak so far of a step whose peak the closed loop will read, as ``phase`` ends: where a step that took
        more than its dry run took it."""
        so_far = self.watch.so_far() if self.watch is not None else None
        if so_far is None and self.measurement is not None:
            so_far = self.measurement.so_far()
        if so_far is not None:
            self._marks.setdefault(phase, so_far)  # the first backward of several accumulated: its forward's peak

    def _where(self, peak: int) -> str | None:
        """The phase of this batch's step in which it reached ``peak`` (at fit; a loop's step has one phase)."""
        marks, self._marks = self._marks, {}
        for phase, name in (("forward", "the forward pass"), ("backward", "the backward pass")):
            if marks.get(phase, -1) >= peak:
                return name
        return "the optimizer step" if "backward" in marks else None

    def batch_end(self, trainer: Any, module: Any, outputs: Any) -> None:
        peak = None
        measurement, self.measurement = self.measurement, None
        if measurement is not None:
            measurement.stop(module)  # the whole step, the optimizer's included
            assert self.schedule is not None
            if not measurement.finish(outputs):
                self.schedule.retry(trainer.accumulate_grad_batches)
            else:
                self.schedule.done = True
                self.report.embed(measurement.figures)
                peak = measurement.figures.peak_bytes
                planned = self.report.planned_peak_bytes
                if self._settled and peak is not None and planned is not None:  # said, not acted on, without a budget
                    self.report.unseen_bytes = max(peak - planned, 0, self.report.unseen_bytes or 0)
                self._check_guess(module, measurement)
                self.measured_batch = measurement
                self._time_next = self.report.predicted_step_s is not None and self.hooks.log is not None
                if not self._timed_alone:  # nothing left to time: out now, at a batch every rank measures
                    self._publish()
        if self._started is not None:
            seconds, self._started = _clock(module) - self._started, None
            figures = self.report.timed(seconds)
            if self.hooks.log is not None:
                self.hooks.log(figures)
        for technique in self._around:
            technique.batch_end()
        if self.watch is not None:
            peak, self.watch = self.watch.stop()[0], None
        if peak is not None and not self._settled and self._close_loop(peak):
            return  # chosen again for the next batch
        if self.budget is not None and peak is not None and peak > self.budget and self.stage in RETRIED:
            peaked, budget = fmt_sizes(peak, self.budget)
            self.finer(f"a batch peaked at {peaked}, over the budget of {budget}; the next runs")

    def _planning(self, module: Any, batch: Any, batch_idx: int, loader: int | None, **options: Any) -> Planning:
        """What the planners get to plan this stage's step on ``batch`` (:func:`planning_for`)."""
        context = self.changes.step_context(self.hooks.context())
        return planning_for(
            context,
            module,
            self.changes,
            batch,
            batch_idx,
            self.stage,
            loader,
            device=self.hooks.device,
            target=self.hooks.target,
            **options,
        )

    def _close_loop(self, peak: int) -> bool:
        """A real batch's ``peak`` against its dry run's prediction (the first step's at fit, else the plan's): what
        it took beyond that is charged to the plan, and where that puts the budget out of reach, the settings are
        chosen again for the next batch (True). Batches are watched until a later step's meets the budget or charging
        more would change nothing; what the stage saw carries over to the next stage and run on the device. At fit
        every rank takes the same decision, on the largest figures over ranks; in a loop each rank its own, with no
        collective (a rank may have more batches, or longer ones)."""
        assert self.budget is not None
        first, self._first_predicted = self._first_predicted, None
        predicted = first if first is not None else self.report.planned_peak_bytes
        if predicted is None:  # no dry run could count the step: nothing to set the real one against
            self._settled = True
            return False
        where = self._where(peak)  # this rank's
        figures = [float(peak - predicted), float(peak)]
        if self.stage == "fit":  # the ranks plan together at fit; in a loop each rank plans for its own inputs
            figures = self.hooks.reduce_max(figures)
        gap, peak = (int(v) for v in figures)
        seen = self.report.unseen_bytes = max(gap, 0, self.report.unseen_bytes or 0)
        if gap <= self.unseen:  # nothing new: the plan already holds room for it
            if first is None:  # a later step's peak, as the plan counts it: the loop is closed
                self._settled = True
                keep_unseen(self.report.device, seen, self._owner or "")
            return False
        self.unseen = gap
        keep_unseen(self.report.device, gap, self._owner or "")
        took, dry = fmt_sizes(peak, predicted)
        self.report.unseen_where = where
        at = f", its peak in {where}" if where is not None else ""
        why = (
            f"a real {self.stage} step took {fmt_sizes(gap)[0]} more than its dry run ({took} against {dry}{at}):"
            " memory the dry run cannot see, such as a kernel's workspace"
        )
        if (self.report.planned_peak_bytes or 0) + gap <= self.budget:
            why += "; the settings in force leave room for it under the budget"
            self.report.note(why)
            self.hooks.say(f"MemOpt: {why}.")
            return False
        self.report.note(f"{why}; charged to the plan, chosen again for the budget less that")
        self.hooks.say(f"MemOpt: {why}; the settings are chosen again for the next batch, for the budget less that.")
        self.cache.clear()
        self.planned = None  # the next batch plans again, for the budget less what was charged
        return True

    def _check_guess(self, module: Any, measurement: Measurement) -> None:
        """Settings chosen from dry runs on placeholders are checked against the real step's peak: more than 1% off,
        they are chosen again from dry runs that replay what the real step read (no user step runs again)."""
        guess, self.guess = self.guess, None
        missed = guess.missed(measurement) if guess is not None else None
        if missed is None:
            return
        _, _, batch, batch_idx, loader = measurement.again
        self.cache.pop(signature(shapes(batch)), None)
        self.planned = None
        why = f"{missed}: settings chosen again from dry runs that replay the values it read"
        self.report.note(why)
        self.hooks.say(f"MemOpt: {why}.")
        self.plan(module, batch, batch_idx, loader, measurement.recorded)

    def _take_measurement(self) -> Measurement | None:
        """The batch being measured, no longer the stage's: it ended, or it failed."""
        measurement, self.measurement = self.measurement, None
        return measurement

    def end(self) -> None:
        """The stage ends; every rank reaches this point, also one with fewer batches: what the changes cost is
        timed, outside every batch, and the figures are gathered and sent out."""
        for technique in self.techniques:
            technique.end()
        if self.measured_batch is not None:  # the changed modules timed alone, outside every batch
            self.measured_batch.time_changes()
            self.report.embed(self.measured_batch.figures)
            self.measured_batch = None
        self.abort()
        if self.schedule is not None and not self.schedule.done:
            self.report.note("no batch was measured: the run ended before the batch chosen for it")
        if self.measure and self._timed_alone:  # measure=False: nothing is gathered or logged
            self._publish()
        else:
            self._write_sections()

    def _publish(self) -> None:
        self._write_sections()
        if self.hooks.publish is not None:
            self.hooks.publish(self.report, self.budget, self.changes.describe() or "nothing in force")

    def abort(self) -> None:
        """Stop measuring, so that nothing stays hooked in (the run failed, or it ended): every part, even when one
        raises (the first error is raised after)."""
        measurement, watch, self.watch = self._take_measurement(), self.watch, None
        steps = [measurement.abort] if measurement is not None else []
        steps += [watch.stop] if watch is not None else []
        run_all([*steps, *(t.abort for t in self.techniques)])

    # rescue ---------------------------------------------------------------------------------------------------------

    def finer(self, why: str) -> bool:
        """One step cheaper in memory, cheapest first: each technique's steps that change no output, in their
        ``rescue_order``, then (not under ``verify``) those that do. False when nothing is left."""
        order = sorted(self.techniques, key=lambda t: t.rescue_order)
        for lossy in (False, True) if self.config.may_change_results else (False,):
            for technique in order:
                what = technique.finer(lossy)
                if what is not None:
                    self.hooks.say(f"MemOpt: {why} {what}: {self.changes.describe()}")
                    for notice in self._notices():
                        self.hooks.warn(f"MemOpt: {notice}")
                    return True
        return False

    def rescue(self, module: Any) -> AttributeOverride:
        """Wrap the stage's step so that a batch that runs out of memory is retried one step cheaper in memory, in
        place: the outputs hold every batch once, in order. The error is raised, with a clear message, only when
        nothing is left to make cheaper."""
        name = STEPS[self.stage]
        given_step: Callable[..., Any] = getattr(module, name)

        def rescued(original: Callable[..., Any]) -> Callable[..., Any]:
            # Lightning reads the step's signature to know whether it takes batch_idx
            return functools.wraps(given_step)(functools.partial(self._rescued, module, original))

        return AttributeOverride.wrap(module, name, rescued)

    def _rescued(self, module: Any, original: Callable[..., Any], batch: Any, *args: Any, **kwargs: Any) -> Any:
        """One call of the stage's step, retried one step cheaper in memory while it runs out of memory."""
        given = host_copy(batch)  # a retry sees the batch as the dataloader gave it, not as the step left it
        while True:
            try:
                return original(batch, *args, **kwargs)
            except Exception as error:
                if not is_oom(error):
                    raise
                free_memory(module.device)
                if (measurement := self._take_measurement()) is not None:  # measure a later batch instead
                    measurement.abort()
                    assert self.schedule is not None
                    self.schedule.retry(1)
                if not self.finer("a batch ran out of memory; retrying it"):
                    raise RuntimeError(
                        f"MemOpt: a {self.stage} batch ran out of memory even with every setting as cheap in memory"
                        f" as it goes ({self.changes.describe()}). Lower the batch size or the input size. ({error})"
                    ) from error
                batch = given()


def _steady(trainer: Any) -> bool:
    """Whether every optimizer has its state: a later step, as the plan's dry runs count it."""
    return all(optimizer.state for optimizer in getattr(trainer, "optimizers", []))


def _clock(module: Any) -> float:
    """Now, once the module's device has done what it was given."""
    if getattr(module, "device", None) is not None and module.device.type == "cuda":
        torch.cuda.synchronize(module.device)
    return time.perf_counter()


def planning_for(
    context: StepContext,
    module: Any,
    changes: Changes,
    batch: Any,
    batch_idx: int = 0,
    stage: StageName = "fit",
    loader: int | None = None,
    budget: int | None = None,
    choose: bool = True,
    measure: bool = True,
    lossy: bool = True,
    device: Any = "cpu",
    reads: dict[Any, list[Any]] | None = None,
    longer: bool = False,
    target: Any = None,
) -> Planning:
    """What a technique's planner gets (:class:`~lightning_memopt.techniques.base.Planning`) to plan ``changes`` for
    ``batch``: its dry runs run ``module``'s step of ``stage`` in ``context``, replaying ``reads`` where given."""

    def run(watch: Any = None, steady: bool = False, what: str = "the step with the settings in force") -> DryRun:
        dry_run(what)
        return dry_run_step(
            context,
            module,
            batch,
            batch_idx,
            stage,
            loader,
            steady=steady,
            watch=watch,
            device=device,
            reads=Replay(reads),
        )

    return Planning(
        stage=stage,
        budget=budget,
        choose=choose,
        measure=measure,
        lossy=lossy,
        run=run,
        off=changes.off,
        module=module,
        longer=longer,
        device=device,
        target=target if target is not None else device,
        changed=lambda: changes.changed,
        techniques=tuple(changes.techniques),
    )


def open_stage(
    stage: StageName,
    found: list[FoundModel],
    config: MemOptConfig,
    skipped: Callable[[str], None],
    quiet: bool = False,
    exclude: tuple[type, ...] = (),
    context: StepContext | None = None,
) -> Changes:
    """The stage's techniques (those registered for it whose option is on, less ``exclude``) applied to the models
    ``found``, each given the Trainer's ``context`` first; at fit only models with trainable parameters are changed.
    Says when a model has nothing they can use."""
    if stage == "fit":
        for model in found:
            if not any(p.requires_grad for p in model.module.parameters()) and not quiet:
                rank_zero_info(f"MemOpt: {model.label} has no trainable parameters; it is left as it is for fit.")
        found = [f for f in found if any(p.requires_grad for p in f.module.parameters())]
    changes = Changes(stage, found, config, skipped, exclude, context)
    for technique in changes.techniques:
        technique.validate(config, found)
    changes.apply(quiet=quiet)
    return changes


def stage_budget(config: MemOptConfig, changes: Changes, budget: int | None) -> int | None:
    """The budget the stage works to: ``None`` where no technique of it uses one with these options."""
    return budget if any(t.uses_budget(config) for t in changes.techniques) else None


def budget_warnings(config: MemOptConfig, changes: Changes, budget: int | None) -> list[str]:
    """Why a ``memory_budget`` given chooses nothing of some technique that changed a model, for warnings."""
    if budget is None or changes.nothing:
        return []
    return [why for t in changes.techniques if (why := t.budget_unused(config)) is not None]


def agree_over(strategy: Any, device: torch.device) -> Callable[[list[float]], list[float]]:
    """The maximum of each number over ranks, through a Lightning strategy."""

    def reduce_max(values: list[float]) -> list[float]:
        if not values:
            return values
        return strategy.reduce(torch.tensor(values, device=device), reduce_op="max").tolist()

    return reduce_max
