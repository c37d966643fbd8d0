"""Measuring one batch: the baseline from a dry run without MemOpt's changes, the real step's peak and time from a
probe, the time checkpointed blocks spend recomputing, and, with ``verify``, a comparison with a real run without
the changes.

Only ``verify`` runs the user's step a second time for real, because it must compare real numbers. That run sees a
deep copy of the batch; every buffer of the LightningModule, the instance attributes of its modules and the objects
they hold, torchmetrics states and every random state it can find are put back afterwards; its logging is off and,
under DDP, it does not synchronise gradients. Plain Python side effects elsewhere (a global counter, a file written)
and generators it cannot reach do see the second call.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torchmetrics import Metric

from lightning_memopt.compat import closure_loss, map_tensors, metric_state, step_args, tensors_in
from lightning_memopt.dryrun import kept_as_is
from lightning_memopt.engine.changes import Changes
from lightning_memopt.engine.costing import CallCounter
from lightning_memopt.engine.report import Figures
from lightning_memopt.engine.step import (
    STEPS,
    DryRun,
    Stage,
    StepContext,
    dry_run_step,
    optimizer_state,
    state_shapes,
)
from lightning_memopt.memory import CPUPeakTracker, CPUProbe, PeakProbe, probe_for
from lightning_memopt.reads import PLACEHOLDERS, Recorder, Replay
from lightning_memopt.units import fmt_bytes, fmt_sizes
from lightning_memopt.verify import (
    OutputRecorder,
    VerificationError,
    first_difference,
    flat_tensors,
    worst_gradient,
    worst_tensor,
)

#: What verify compared, in the summary's words.
VERIFIED_WORDS = {"the gradient of": "every gradient", "the buffer": "every buffer"}
#: Strategies whose gradients are sharded over ranks: ``verify`` does not compare gradients under them.
SHARDED_STRATEGIES = ("FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy")


@dataclass
class Guess:
    """The peak that dry runs predicted for the settings in force where they gave placeholders for values the step
    read (``None``: they failed on them): checked against the measured step."""

    peak: int | None

    def missed(self, measurement: Measurement) -> str | None:
        """Why the choice is made again from the measured step's reads (its real peak is more than 1% off the
        prediction, or the dry runs failed), or ``None`` where it stands or nothing was recorded to replay."""
        real = measurement.figures.peak_bytes
        if real is None or measurement.again is None:
            return None
        if self.peak is not None and abs(real - self.peak) <= 0.01 * self.peak:
            return None
        if self.peak is None:
            return f"the real step peaked at {fmt_bytes(real)} where dry runs on placeholders failed"
        real_words, predicted = fmt_sizes(real, self.peak)
        return f"the real step peaked at {real_words} where dry runs on placeholders predicted {predicted}"


def live_by_kind(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> dict[str, list[torch.Tensor]]:
    """What is on the device before a step and stays through it, by kind: the weights (parameters and buffers), the
    gradients, the optimizers' state and the batch."""
    return {
        "weights": [*pl_module.parameters(), *pl_module.buffers()],
        "gradients": [p.grad for p in pl_module.parameters() if p.grad is not None],
        "optimizer": optimizer_state(trainer.optimizers),
        "batch": tensors_in(batch),
    }


class RealKinds:
    """Says what the bytes of a real step that a :class:`~lightning_memopt.memory.CPUProbe` counts are, as a dry run
    says it of its own: each gradient accumulated into a parameter's ``.grad`` is a gradient from then on, what an
    automatic optimizer step allocates is ``other`` (:meth:`optimizer_step`, from ``on_before_optimizer_step``) and the
    state it leaves is the optimizer's (:meth:`close`, before the probe stops). Does nothing for another probe."""

    def __init__(self, probe: PeakProbe, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: Stage) -> None:
        self.tracker = probe.tracker if isinstance(probe, CPUProbe) else None
        self.optimizers = list(trainer.optimizers)
        self.automatic = pl_module.automatic_optimization
        self._hooks = []
        if self.tracker is not None and stage == "fit":
            self._hooks = self.tracker.gradients_of(pl_module.parameters())

    def optimizer_step(self) -> None:
        """The optimizer step starts (with manual optimization the step goes on after it, so nothing changes)."""
        if self.tracker is not None and self.automatic:
            self.tracker.kind = "other"

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.tracker is not None:
            self.tracker.rekind(optimizer_state(self.optimizers), "optimizer")
            self.tracker = None


def live_tensors(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> list[torch.Tensor]:
    """What is on the device before a step and stays through it: weights, buffers, gradients, optimizer state, batch."""
    return [t for tensors in live_by_kind(trainer, pl_module, batch).values() for t in tensors]


def baseline(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    changes: Changes,
    batch: Any,
    batch_idx: int,
    stage: Stage,
    loader: int | None = None,
    reads: Replay | None = None,
    states: list[dict[Any, Any]] | None = None,
) -> DryRun:
    """The step of this batch on fake tensors, without MemOpt's changes (replaying ``reads``, a real step's, from the
    optimizers' ``states`` before it). Where a change freed the last step's gradients, they are counted as the step
    without it would hold them."""
    freed = [p for t in changes.techniques for p in t.gradients_freed()] if stage == "fit" else []
    with changes.off():  # the techniques' seams as they are when off (an 8-bit state seen in full)
        context = changes.step_context(StepContext.of(trainer, stage))
        return dry_run_step(
            context, pl_module, batch, batch_idx, stage, loader, reads=reads, freed=freed, states=states
        )


class _LoopStep:
    """What differs in a loop's step without gradients: its output is compared, and every batch is measured."""

    what = "the output"

    def verify_skipped(self, pl_module: pl.LightningModule) -> str | None:
        """Why ``verify`` cannot run this step a second time (``None``: it can)."""
        return None

    def expected(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, output: Any, grads: dict[Any, Any]
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        """After verify's run of the step without the changes, inside it: what its result is compared on, and the
        gradients it gave by name (``grads``: every parameter's gradient before it, put back afterwards)."""
        return output, {}

    def share(
        self, trainer: pl.Trainer, expected: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], str | None]:
        """After verify's run, on every rank: the expected gradients as the whole job's step gives them, and a note
        where some cannot be compared."""
        return expected, None

    def compared(self, output: Any) -> Any:
        return output

    def measured(self, output: Any, automatic: bool) -> bool:
        """Whether the batch was measured in full."""
        return True


class _TrainingStep(_LoopStep):
    """A training step: its loss and every gradient are compared, and a step that returned no loss is not a
    measurement."""

    what = "the loss"

    def verify_skipped(self, pl_module: pl.LightningModule) -> str | None:
        if not pl_module.automatic_optimization:
            return "verify was skipped: under manual optimization the step updates the weights"
        return None

    def expected(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, output: Any, grads: dict[Any, Any]
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        loss = closure_loss(output, trainer.accumulate_grad_batches)[0]
        if loss is None:
            return None, {}
        for p in grads:
            p.grad = None  # as Lightning's zero_grad
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        expected = {n: p.grad.detach().cpu() for n, p in pl_module.named_parameters() if p.grad is not None}
        return loss, expected  # Lightning's outputs hold the loss divided as here

    def share(
        self, trainer: pl.Trainer, expected: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], str | None]:
        """DDP averages the real step's gradients over ranks: average the expected ones the same way."""
        strategy = trainer.strategy
        if type(strategy).__name__ in SHARDED_STRATEGIES:
            return {}, f"verify compared no gradients: {type(strategy).__name__} shards them"
        if trainer.world_size > 1 and strategy.reduce_boolean_decision(bool(expected), all=True):
            device = strategy.root_device
            expected = {n: strategy.reduce(g.to(device), reduce_op="mean").cpu() for n, g in expected.items()}
        return expected, None

    def compared(self, output: Any) -> Any:
        return output.get("loss") if isinstance(output, Mapping) else output

    def measured(self, output: Any, automatic: bool) -> bool:
        skipped = output is None or (isinstance(output, Mapping) and output.get("loss") is None)
        return not (automatic and skipped)


class Measurement:
    """Measures one batch of a stage. The stage calls these methods from its hooks, in order.

    What runs around the real step (the probe, the timers, the counters and recorders) is entered on one
    ``ExitStack``, closed when the step ends or fails; what differs between a training step and a loop's step is one
    object chosen by the stage.

    Args:
        stage: ``fit``, ``predict``, ``validate`` or ``test``.
        changes: MemOpt's changes, set aside for the baseline and for ``verify``'s run.
        verify: Compare results with and without the changes and raise :class:`VerificationError` on a difference.
        tolerance: The relative tolerance of ``verify``.
    """

    def __init__(self, stage: Stage, changes: Changes, verify: bool, tolerance: float) -> None:
        self.stage = stage
        self.changes = changes
        self.verify = verify
        self.tolerance = tolerance
        self.step = _TrainingStep() if stage == "fit" else _LoopStep()
        self.figures = Figures()
        self.batch_idx = -1
        self.automatic = True
        self._running = contextlib.ExitStack()  # what runs around the real step
        self._probe: PeakProbe | None = None
        self._peak: tuple[int | None, float] = (None, 0.0)
        self._timers: list[Any] = []
        self._recorders: list[OutputRecorder] = []
        self._expected: dict[str, torch.Tensor] = {}
        self._expected_buffers: dict[str, torch.Tensor] = {}
        self._expected_output: dict[str, torch.Tensor] = {}
        self._worst_gradient: tuple[str, float, float] | None = None
        self._gradients_compared = False
        self._verified: dict[str, float] = {}  # what verify compared, and its largest relative difference
        self._verify_s = 0.0  # time spent comparing during the step, left out of the step's time
        self._recorder: Recorder | None = None
        self._kinds: RealKinds | None = None
        self._counter: CallCounter | None = None
        self.counted: CallCounter | None = None  # the changed modules' calls in the step, to time at the loop's end
        self.again: tuple[Any, ...] | None = None  # what a dry run of this batch needs, kept when it read values
        self._states: list[dict[Any, Any]] | None = None  # the optimizers' state before the step, for that dry run
        self.recorded: dict[Any, list[Any]] = {}  # what the real step read out of its tensors, when recorded
        self.baseline_run: DryRun | None = None  # the baseline's dry run

    @property
    def changed(self) -> bool:
        """Whether the step ran with any change in force: a checkpointed or a chunked block."""
        return self.changes.changed

    def start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int | None,
        dry: DryRun | None = None,
    ) -> None:
        """Before the real step: the baseline (``dry``, or a dry run now), ``verify``'s run, then the probe."""
        self.batch_idx = self.figures.batch_idx = batch_idx
        self.automatic = pl_module.automatic_optimization
        if not self.changed:
            self.figures.added_s = 0.0  # nothing changed: nothing added to the step's time
        if dry is None:
            dry = baseline(trainer, pl_module, self.changes, batch, batch_idx, self.stage)
        self.baseline_run = dry
        self.figures.baseline_peak_bytes, self.figures.dry_run_s = dry.peak_bytes, dry.seconds
        self.figures.baseline_by_kind = dict(dry.at_peak)
        self.figures.notes += [n for n in (dry.note, *dry.remarks) if n]
        if self.verify:
            self._verify_run(trainer, pl_module, batch, batch_idx, dataloader_idx)
        if dry.placeholders and self.stage == "fit":  # a dry run after the step starts from the state before it
            self._states = state_shapes(trainer.optimizers)
        sync = torch.cuda.synchronize if pl_module.device.type == "cuda" else lambda: None
        techniques = self.changes.techniques
        running = self._running
        self._timers = [timer for t in techniques if (timer := t.timer(sync)) is not None]  # timed in the step
        for timer in self._timers:
            running.callback(timer.remove)
        switchables = [s for t in techniques for s in t.switchables()]  # timed alone when the loop ends
        if switchables:
            around = CPUPeakTracker if pl_module.device.type == "cpu" else contextlib.nullcontext  # as the step ran
            self._counter = running.enter_context(CallCounter(switchables, sync, around))
        self._probe = probe_for(pl_module.device)
        self._probe.start(live_by_kind(trainer, pl_module, batch))
        running.callback(self._stop_probe)
        self._kinds = RealKinds(self._probe, trainer, pl_module, self.stage)
        running.callback(self._kinds.close)  # before the probe stops
        if dry.placeholders:  # the baseline stood in for values it could not know: record the real step's
            self.again = (trainer, pl_module, map_tensors(batch, lambda t: t), batch_idx, dataloader_idx)
            self._recorder = running.enter_context(Recorder())

    def so_far(self) -> int | None:
        """The step's peak so far, while it runs."""
        return self._probe.so_far() if self._probe is not None else None

    def _stop_probe(self) -> None:
        if self._probe is not None:
            probe, self._probe = self._probe, None
            with contextlib.suppress(RuntimeError):  # a probe a failed run left in a bad state: its figures are lost
                self._peak = probe.stop()
                self.figures.peak_by_kind = dict(probe.at_peak) if isinstance(probe, CPUProbe) else {}

    def _verify_run(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int | None
    ) -> None:
        skipped = self.step.verify_skipped(pl_module)
        if skipped is not None:
            self.figures.notes.append(skipped)
            return
        name = STEPS[self.stage]
        recorder = OutputRecorder({f.name: f.module for f in self.changes.found})
        grads = {p: p.grad for p in pl_module.parameters()}
        try:
            # watched as the real step will be (on a CPU, the exact probe: a Python dispatch mode, under which torch may
            # pick another kernel for an op, a linear in inference mode, whose rounding would then be taken for the
            # changes')
            watched = CPUPeakTracker() if pl_module.device.type == "cpu" else contextlib.nullcontext()
            with self.changes.off(), _side_effects_undone(trainer, pl_module, name), watched:
                args = step_args(pl_module, name, copy_batch(batch), batch_idx, dataloader_idx)
                output = getattr(trainer.strategy, name)(*args)
                recorder.stop()
                compared, self._expected = self.step.expected(trainer, pl_module, output, grads)
                # the buffers as the step leaves them (normalisation statistics), before they are put back
                self._expected_buffers = {n: b.detach().clone().cpu() for n, b in pl_module.named_buffers()}
        finally:
            recorder.stop()
            for p, grad in grads.items():
                p.grad = grad
        self._expected_output = {k: v.detach().cpu() for k, v in flat_tensors(compared).items()}
        self._recorders = [recorder, OutputRecorder({f.name: f.module for f in self.changes.found})]
        self._expected, note = self.step.share(trainer, self._expected)
        if note is not None:
            self.figures.notes.append(note)

    def before_backward(self) -> None:
        """Checkpointing runs forward again in the backward pass: stop recording outputs here."""
        for recorder in self._recorders:
            recorder.stop()

    def time_changes(self) -> None:
        """What the loop's changes added to the measured step's time, from each changed module timed alone."""
        counted, self.counted = self.counted, None
        if counted is None:
            return
        try:
            self.figures.added_s = counted.seconds_added()
        except Exception as error:  # out of memory running a block unchunked, say: the time stays unknown
            self.figures.notes.append(f"the time without the changes could not be measured ({type(error).__name__})")

    def _replay_baseline(self) -> None:
        """The baseline again, from a dry run that replays what the real step read instead of placeholders."""
        assert self.again is not None
        trainer, pl_module, batch, batch_idx, loader = self.again
        replay = Replay(self.recorded)
        dry = baseline(trainer, pl_module, self.changes, batch, batch_idx, self.stage, loader, replay, self._states)
        self.figures.dry_run_s += dry.seconds
        if dry.peak_bytes is None:
            return
        self.figures.baseline_peak_bytes, self.figures.baseline_by_kind = dry.peak_bytes, dict(dry.at_peak)
        self.figures.notes = [n for n in self.figures.notes if not n.startswith(PLACEHOLDERS)]
        self.figures.notes += [n for n in dry.remarks if n not in self.figures.notes]
        self.figures.notes.append(
            f"the baseline replays the {dry.replayed} values the real step read out of its tensors (a dry run after it)"
        )

    def abort(self) -> None:
        """The run failed mid-batch: stop measuring, so that nothing stays hooked in."""
        try:
            self._running.close()
        finally:
            self.counted, self.again, self._timers = None, None, []
            self.before_backward()

    def before_optimizer_step(self, pl_module: pl.LightningModule) -> None:
        """Lightning clips gradients right after this hook: compare the real step's gradients here, unclipped like
        the expected ones. The comparison allocates nothing the probe counts, and its time is left out."""
        if self._kinds is not None:
            self._kinds.optimizer_step()
        if not (self.verify and self._expected) or self._probe is None:
            return
        sync = torch.cuda.synchronize if pl_module.device.type == "cuda" else lambda: None
        sync()
        started = time.perf_counter()
        self._worst_gradient = self._compare_gradients(pl_module)
        self._gradients_compared = True
        self._verify_s += time.perf_counter() - started

    def _compare_gradients(self, pl_module: pl.LightningModule) -> tuple[str, float, float] | None:
        grads = {n: p.grad for n, p in pl_module.named_parameters() if p.requires_grad}
        return worst_gradient(self._expected, grads)

    def stop(self, pl_module: pl.LightningModule) -> None:
        """After the real step (the optimizer's step included): stop measuring, check gradients (those compared
        before the optimizer's step, else the gradients now: no step ran in this batch)."""
        if self._probe is None:
            return
        if self._timers:
            self.figures.added_s = sum(timer.seconds for timer in self._timers)
        self._running.close()  # the recorder, the probe, the counters and the timers, last entered first
        peak, seconds = self._peak
        self.figures.peak_bytes, self.figures.step_time_s = peak, seconds - self._verify_s
        self.counted, self._counter, self._timers = self._counter, None, []
        if self._recorder is not None:
            self.recorded, self._recorder = dict(self._recorder.recorded), None
        if self.again is not None:
            self._replay_baseline()
        if self.figures.baseline_peak_bytes is None and peak is not None:
            self.figures.notes.append(
                "the peak without MemOpt's changes is unknown (no dry run could trace the step): no saving is claimed"
            )
        self.before_backward()
        if self.verify and self._expected:
            worst = self._worst_gradient if self._gradients_compared else self._compare_gradients(pl_module)
            self._check("the gradient of", worst)
        if self.verify and self._expected_buffers:
            buffers = dict(pl_module.named_buffers())
            self._check("the buffer", worst_tensor(self._expected_buffers.items(), buffers))

    def finish(self, output: Any) -> bool:
        """After the real step: check its loss or output. Returns whether the batch was measured in full (a training
        step that returned ``None`` was skipped: another batch is measured)."""
        if not self.step.measured(output, self.automatic):
            return False
        if self.verify and self._expected_output:
            what = self.step.what
            self._check(what, worst_tensor(self._expected_output.items(), flat_tensors(self.step.compared(output))))
        if self._verified:
            self.figures.verify_max_rel_diff = max(self._verified.values())
            kinds = sorted(self._verified, key=lambda what: what in VERIFIED_WORDS)  # the loss or output first
            words = [VERIFIED_WORDS.get(what, what) for what in kinds]
            compared = " and ".join([", ".join(words[:-1]), words[-1]] if len(words) > 1 else words)
            self.figures.verified = (
                f"verify: {compared} equal to a run without MemOpt's changes within {self.tolerance:g} (largest"
                f" relative difference {self.figures.verify_max_rel_diff:.2g})"
            )
        self._recorders = []
        return True

    def _check(self, what: str, worst: tuple[str, float, float] | None) -> None:
        if worst is None:
            return
        self._verified[what] = max(self._verified.get(what, 0.0), worst[2])
        if worst[2] <= self.tolerance:
            return
        name, diff, rel = worst
        subject = f"{what} `{name}`" if what.startswith(("the gradient", "the buffer")) else what
        message = (
            f"MemOpt verify: on {self.stage} batch {self.batch_idx}, {subject} differs with MemOpt's changes by"
            f" {diff:.3g} (relative {rel:.3g}, tolerance {self.tolerance:g})."
        )
        if what.startswith(("the gradient", "the buffer")):
            kind = "parameter" if what.startswith("the gradient") else "buffer"
            message += f" That {kind} belongs to module `{name.rpartition('.')[0] or name}`."
        if len(self._recorders) == 2:
            first = first_difference(self._recorders[0], self._recorders[1], self.tolerance)
            if first is not None:
                message += f" The first module whose forward output differs is `{first[0]}` (relative {first[1]:.3g})."
        raise VerificationError(message)


def copy_batch(batch: Any) -> Any:
    """A deep copy of ``batch`` for verify's run. A tensor computed from one that requires grad (not a leaf) refuses the
    deep-copy protocol: wherever the copy reaches it (in a collection, or an object's attribute such as a KV cache the
    first step filled), it is copied detached, still requiring grad where it did, so that the run's backward pass ends
    at the copy and leaves the graph it came from to the real step.

    Examples:
        >>> leaf = torch.ones(2, requires_grad=True)
        >>> copied = copy_batch({"x": leaf * 2, "n": [1]})
        >>> copied["x"].is_leaf, copied["x"].requires_grad, copied["x"].tolist(), copied["n"]
        (True, True, [2.0, 2.0], [1])
    """
    given = torch.Tensor.__deepcopy__

    def deepcopy(tensor: torch.Tensor, memo: dict[int, Any]) -> torch.Tensor:
        if tensor.is_leaf:
            return given(tensor, memo)
        copied = memo[id(tensor)] = tensor.detach().clone().requires_grad_(tensor.requires_grad)
        return copied

    torch.Tensor.__deepcopy__ = deepcopy  # type: ignore[method-assign]  # for this copy only: put back below
    try:
        return copy.deepcopy(batch)
    finally:
        torch.Tensor.__deepcopy__ = given  # type: ignore[method-assign]


@contextlib.contextmanager
def _side_effects_undone(trainer: pl.Trainer, pl_module: pl.LightningModule, name: str) -> Iterator[None]:
    """Run the step for real, leaving no trace: buffers, module attributes, torchmetrics states and random states are
    put back, logging is off, and DDP does not synchronise gradients."""
    buffers = [(b, b.detach().clone()) for b in pl_module.buffers()]
    metrics = [(m, metric_state(m)) for m in pl_module.modules() if isinstance(m, Metric)]
    no_sync = getattr(trainer.strategy.model, "no_sync", None)
    step = getattr(type(pl_module), name)
    try:
        with (
            kept_as_is(pl_module, trainer.optimizers, [step]),  # every random state too, on every device
            no_sync() if callable(no_sync) else contextlib.nullcontext(),
        ):
            pl_module.__dict__["log"] = pl_module.__dict__["log_dict"] = lambda *args, **kwargs: None
            yield
    finally:
        for metric, state in metrics:
            metric.__dict__.update(state)
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
