"""A Lightning step run dry: ``training_step`` with its backward pass, or ``predict_step``, on fake tensors.

Weights, buffers, gradients, optimizer state and the batch are fake copies (see :mod:`lightning_memopt.dryrun`), the
step's logging and its optimizers are stand-ins, and the peak is counted exactly as the real step's is. Nothing of the
run reaches the user's model, batch, optimizers, generators or logs. A step that cannot be traced gives no figure and a
note naming the op that stopped it; it never raises.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_memopt.collectives import unsharded_parameters
from lightning_memopt.compat import (
    closure_loss,
    ddp_bucket_bytes,
    distributed_initialized,
    local_tensors,
    log_reduction,
    logging_levels,
    map_tensors,
    step_args,
    steps_optimizer,
    tensors_in,
    zeroes_grads,
)
from lightning_memopt.dryrun import Sandbox, failure_note
from lightning_memopt.handles import AttributeOverride, HandleGroup
from lightning_memopt.memory import CPUProbe, trackers_paused
from lightning_memopt.reads import Replay
from lightning_memopt.timeline import OPTIMIZER_STEP, span

Stage = Literal["fit", "predict", "validate", "test"]
#: The step each stage runs.
STEPS: dict[str, str] = {
    "fit": "training_step",
    "predict": "predict_step",
    "validate": "validation_step",
    "test": "test_step",
}


def step_each(optimizers: list[Any]) -> None:
    """How a dry run steps the optimizers at the end of an accumulation window: each one's ``step()``, as Lightning."""
    for optimizer in optimizers:
        optimizer.step()


#: Runs ``step`` (a function) as an optimizer step of ``optimizers``, counted as one: ``stepping(optimizers, step)``.
Stepping = Callable[[list[Any], Callable[[], Any]], Any]


def backward_as_is(optimizers: list[Any], stepping: Stepping) -> contextlib.AbstractContextManager[Any]:
    """What a dry run enters around the backward pass of an automatic step: nothing, as Lightning."""
    return contextlib.nullcontext()


def twins_as_is(pairs: list[tuple[Any, Any]]) -> contextlib.AbstractContextManager[Any]:
    """What a dry run enters once it has made the optimizers' twins (``(twin, optimizer)`` pairs): nothing."""
    return contextlib.nullcontext()


@dataclass
class StepContext:
    """What the Trainer is, for the dry runs and for the techniques (each gets it as ``context`` before it is applied,
    and in ``refuses``): the optimizers, gradient accumulation, gradient clipping, the number of processes and
    learning-rate schedulers, the precision (its name, and the plugin's context for the step: autocast under mixed
    precision), the strategy, how a dry run steps the optimizers (``optimizer_step``) and what it enters around the
    backward pass (``backward``, given the optimizers and how to run a step of them as one: to step them inside it),
    and what it enters once it has made the optimizers' twins (``twins``, given ``(twin, optimizer)`` pairs: to keep
    their state as the technique keeps the optimizers'), which a technique that changes the optimizer step may replace
    (see :meth:`~lightning_memopt.techniques.base.Technique.optimizer_step`).

    In a predict, validation or test loop the optimizers the Trainer holds are there too (during fit, or after a fit on
    the same Trainer): their state, and the last step's gradients, stay alive through the loop's step and are
    counted.

    ``automatic`` is the LightningModule's ``automatic_optimization``; ``readers`` names the user's hooks that run
    between the backward pass and the optimizer step, where they may read the gradients (``on_after_backward``,
    ``on_before_optimizer_step``, ``configure_gradient_clipping`` and ``optimizer_step`` of the LightningModule and of
    callbacks other than Lightning's and MemOpt's), and ``zero_grad_readers`` those that run between the optimizer step
    and the next zeroing of the gradients (``on_before_zero_grad``). ``gradients_kept()`` says whether the last step's
    gradients are alive when a step starts (a technique that frees them after the optimizer step replaces it)."""

    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    accumulate_grad_batches: int = 1
    world_size: int = 1
    schedulers: int = 0
    precision: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    gradient_buckets: int = 0  # bytes of DDP's buckets, which the backward pass copies gradients into
    precision_name: str = "32-true"
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str | None = None
    strategy: Any = None
    optimizer_step: Callable[[list[Any]], None] = step_each
    backward: Callable[[list[Any], Stepping], contextlib.AbstractContextManager[Any]] = backward_as_is
    twins: Callable[[list[tuple[Any, Any]]], contextlib.AbstractContextManager[Any]] = twins_as_is
    automatic: bool = True
    readers: tuple[str, ...] = ()
    zero_grad_readers: tuple[str, ...] = ()
    gradients_kept: Callable[[], bool] = lambda: True

    @classmethod
    def of(cls, trainer: pl.Trainer, stage: Stage) -> StepContext:
        plugin = trainer.precision_plugin
        contexts = {
            "fit": plugin.train_step_context,
            "predict": plugin.predict_step_context,
            "validate": plugin.val_step_context,
            "test": plugin.test_step_context,
        }
        return cls(
            optimizers=list(trainer.optimizers),
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            world_size=trainer.world_size,
            schedulers=len(trainer.lr_scheduler_configs),
            precision=contexts[stage],
            gradient_buckets=ddp_bucket_bytes(trainer.strategy.model) if stage == "fit" else 0,
            precision_name=str(trainer.precision),
            gradient_clip_val=trainer.gradient_clip_val,
            # Lightning clips by norm where a value is given without an algorithm
            gradient_clip_algorithm=trainer.gradient_clip_algorithm or ("norm" if trainer.gradient_clip_val else None),
            strategy=trainer.strategy,
            automatic=trainer.lightning_module.automatic_optimization,
            readers=hooks_defined([trainer.lightning_module, *trainer.callbacks], GRADIENT_HOOKS),
            zero_grad_readers=hooks_defined([trainer.lightning_module, *trainer.callbacks], ("on_before_zero_grad",)),
        )


#: The hooks that run between the backward pass and the optimizer step of automatic optimization.
GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping", "optimizer_step")


def hooks_defined(owners: list[Any], hooks: tuple[str, ...]) -> tuple[str, ...]:
    """``Class.hook`` for each of ``hooks`` that one of ``owners`` (a LightningModule, callbacks) defines, other than
    Lightning's own and MemOpt's."""
    found = []
    for owner in owners:
        for hook in hooks:
            method = getattr(type(owner), hook, None)
            where = getattr(method, "__module__", None) or ""
            if method is not None and not where.startswith(("lightning.", "pytorch_lightning.", "lightning_memopt.")):
                found.append(f"{type(owner).__name__}.{hook}")
    return tuple(found)


@dataclass
class DryRun:
    """What a dry run gave: the peak in bytes (``None``: it could not be traced, ``note`` says why), its cost, what
    the ``watch`` given to :func:`dry_run_step` recorded, and the bytes alive from the start, by kind (``weights``,
    ``batch``, and at fit ``gradients`` and ``optimizer`` state), and at the peak (``at_peak``, by
    :data:`~lightning_memopt.memory.KINDS`, summing to ``peak_bytes``; ``elsewhere_peak``: the peak bytes on each
    other device, such as the host in a dry run of an accelerator's step)."""

    peak_bytes: int | None
    seconds: float
    note: str | None = None
    watched: Any = None
    live_bytes: dict[str, int] = field(default_factory=dict)  # alive from the start: weights, batch, ...
    remarks: list[str] = field(default_factory=list)  # what the figure leaves out
    placeholders: int = 0  # values read out of fake tensors that got a placeholder (no real step's to replay)
    replayed: int = 0  # values read out of fake tensors that a real step's reads answered
    at_peak: dict[str, int] = field(default_factory=dict)  # alive at the peak, by kind
    elsewhere_peak: dict[str, int] = field(default_factory=dict)  # the peak on other devices, by device type
    kept_peak: int | None = None  # the peak with the last step's gradients a technique freed early kept, as Lightning


class _Optimizer:
    """Stands in for a LightningOptimizer inside a dry run: a twin of the real optimizer over the fake parameters, so
    that a manual ``opt.step()`` allocates its state as the real one would, on fake tensors."""

    def __init__(self, twin: torch.optim.Optimizer | None, params: list[torch.Tensor], probe: CPUProbe) -> None:
        self.optimizer = twin
        self.params = params
        self.probe = probe

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups if self.optimizer is not None else [{"params": self.params}]

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        if self.optimizer is None:
            return closure() if closure is not None else None
        return _stepping(self.probe, [self.optimizer], lambda: self.optimizer.step(closure))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


def _twin(
    optimizer: torch.optim.Optimizer, box: Sandbox, state: dict[Any, Any] | None = None
) -> torch.optim.Optimizer | None:
    """The same optimizer class and hyperparameters over the fake parameters, with a fake copy of the state (or of
    ``state``, as :func:`state_shapes` kept it). ``None`` for an optimizer that cannot be built that way."""
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": box.fake(g["params"])}
        for g in optimizer.param_groups
    ]
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    try:
        twin = type(optimizer)(groups, **defaults)
    except Exception:
        return None
    for param, values in (optimizer.state if state is None else state).items():
        twin.state[box.fake(param)] = {k: _state_copy(box, v) for k, v in values.items()}
    return twin


def state_shapes(optimizers: list[Any]) -> list[dict[Any, dict[str, Any]]]:
    """The optimizers' state as it is now, without its values (meta tensors; a step count read with ``.item()`` as a
    copy; lists, such as LBFGS's history, copied): for a dry run of a step after it ran (``dry_run_step``'s
    ``states``), whose state may have grown since."""

    def shape(tensor: torch.Tensor) -> torch.Tensor:
        small = tensor.dim() == 0 and tensor.device.type == "cpu"
        return tensor.detach().clone() if small else tensor.detach().to("meta")

    return [{p: {k: map_tensors(v, shape) for k, v in s.items()} for p, s in o.state.items()} for o in optimizers]


def _state_copy(box: Sandbox, value: Any) -> Any:
    """A fake copy of a state tensor; step counts (0-dim, on CPU, read with ``.item()``) are small real copies."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.device.type == "cpu":
        return box.scratch(value)
    return box.fake(value)


class StandInError(RuntimeError):
    """One of MemOpt's stand-ins for the LightningModule's step-time methods failed on arguments that Lightning's own
    method accepts: a bug of MemOpt's. Under ``LIGHTNING_MEMOPT_STRICT=1`` (the test suite sets it) a dry run raises
    it rather than noting it."""


def strict() -> bool:
    """Whether a dry run raises a :class:`StandInError` (``LIGHTNING_MEMOPT_STRICT=1``) instead of noting it."""
    return os.environ.get("LIGHTNING_MEMOPT_STRICT", "") == "1"


def _stand_in(
    name: str, body: Callable[..., Any], checked: Callable[..., dict[str, Any]] | None = None
) -> Callable[..., Any]:
    """``LightningModule.<name>`` for a dry run: the call is bound to the real method's signature (so it accepts, and
    refuses, what the real one does: positional or keyword, every option), then ``body`` gets the bound arguments by
    name, defaults filled in (the real method's ``*args`` and ``**kwargs`` are not passed on: no body reads them).
    ``checked`` checks them first as Lightning does and gives what ``body`` gets instead: what it raises is the user's
    mistake, as the real call's would be. A failure inside ``body`` is MemOpt's: it is raised as a
    :class:`StandInError`."""
    signature = inspect.signature(getattr(pl.LightningModule, name))
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    named = [n for n, p in list(signature.parameters.items())[1:] if p.kind not in variadic]  # less self

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(None, *args, **kwargs)  # a TypeError here is the user's: the real method raises it too
        bound.apply_defaults()
        arguments = {n: bound.arguments[n] for n in named}
        if checked is not None:
            arguments = checked(**arguments)
        try:
            return body(**arguments)
        except Exception as error:
            why = f"{type(error).__name__}: {error}"
            raise StandInError(f"MemOpt's stand-in for self.{name}() failed: {why}") from error

    return call


class _Stand:
    """Lightning's step-time services as stand-ins on the LightningModule, each taking the arguments of the method it
    stands for: logging keeps what Lightning's keeps, optimizers are twins over fake parameters, ``manual_backward``
    runs backward into the fake parameters only. ``log_dict`` is Lightning's own, which calls ``log``."""

    def __init__(
        self,
        context: StepContext,
        pl_module: pl.LightningModule,
        box: Sandbox,
        twins: list[Any],
        probe: CPUProbe,
        stage: Stage = "fit",
    ) -> None:
        trainable = box.trainable()
        self.logged: list[torch.Tensor] = []  # what Lightning's logging keeps to the step's end
        wrapped = [_Optimizer(t, [box.fake(p) for g in o.param_groups for p in g["params"]], probe) for t, o in twins]
        schedulers = [SimpleNamespace(step=_nothing) for _ in range(context.schedulers)]
        gathered = context.world_size if distributed_initialized() else 0  # a single process gets the data back as is

        def backward(loss: torch.Tensor) -> None:
            torch.autograd.backward(loss, inputs=_backward_inputs(box, trainable))

        def gather(data: Any, group: Any, sync_grads: bool) -> Any:
            return map_tensors(data, lambda t: torch.stack([t] * gathered)) if gathered else data

        bodies: dict[str, Callable[..., Any]] = {
            "log": functools.partial(_log, self.logged),
            "print": _nothing,
            "optimizers": lambda use_pl_optimizer: wrapped[0] if len(wrapped) == 1 else wrapped,
            "lr_schedulers": lambda: (schedulers[0] if len(schedulers) == 1 else schedulers) or None,
            "manual_backward": backward,
            "toggle_optimizer": _nothing,
            "untoggle_optimizer": _nothing,
            "toggled_optimizer": lambda optimizer: contextlib.nullcontext(),
            "clip_gradients": _nothing,
            "all_gather": gather,
        }
        checks = {"log": functools.partial(_log_checked, STEPS[stage])}  # the user's call, as Lightning checks it
        self.overrides = {name: _stand_in(name, body, checks.get(name)) for name, body in bodies.items()}
        self.module = pl_module

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        handles = HandleGroup(AttributeOverride(self.module, n, v) for n, v in self.overrides.items())
        try:
            yield
        finally:
            handles.remove()


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _log_checked(
    fx: str, name: str, value: Any, on_step: bool | None, on_epoch: bool | None, reduce_fx: Any, **options: Any
) -> dict[str, Any]:
    """A ``self.log`` call in the step ``fx`` as Lightning checks it, and what :func:`_log` needs of it: Lightning's
    defaults of ``on_step`` and ``on_epoch`` for that step, its reduction of ``reduce_fx`` (it raises for a step that
    may not log, a value logged neither on step nor on epoch, an unknown reduction), and the value as a tensor of one
    element (a copy: a float one, made first, is freed on return; a ``torchmetrics.Metric`` as itself)."""
    on_step, on_epoch = logging_levels(fx, on_step, on_epoch)
    reduction = log_reduction(fx, name, on_step, on_epoch, reduce_fx)
    if isinstance(value, (torch.Tensor, int, float)):
        value = torch.tensor(float(value)) if not isinstance(value, torch.Tensor) else value.detach().clone()
        if value.numel() != 1:
            raise ValueError(f"`self.log({name}, {value})` was called, but the tensor must have a single element.")
    return {"value": value, "on_step": on_step, "on_epoch": on_epoch, "reduction": reduction}


def _log(kept: list[torch.Tensor], value: Any, on_step: bool, on_epoch: bool, reduction: str) -> None:
    """What a checked ``self.log`` call (:func:`_log_checked`) keeps alive through the rest of the step, as Lightning's
    result collection does: logged on step, a float copy until the key is logged again, at the next batch; logged on
    epoch, the running reduction replaced by a new one (and, for a mean, the running batch size). A metric is kept as
    itself: nothing new."""
    if not isinstance(value, torch.Tensor):  # a Metric: Lightning keeps a reference to it
        return
    if value.dtype not in (torch.float32, torch.float64):
        value = value.to(torch.get_default_dtype())
    if on_step:
        kept.append(value.clone())
        if not on_epoch:
            return
    if reduction == "mean":  # the running sum of value * batch size, and the running batch size
        kept.extend([value + value * 2, torch.empty((), dtype=torch.long)])  # a temporary, as Lightning's
    elif reduction in ("max", "min", "sum"):
        kept.append(torch.empty_like(value))


def _twins(optimizers: list[Any], box: Sandbox, states: list[dict[Any, Any]] | None) -> list[tuple[Any, Any]]:
    """Each optimizer's twin over the sandbox's fake parameters (``None`` where it could not be copied), with it."""
    given = states if states is not None else [None] * len(optimizers)
    return [(_twin(o, box, g), o) for o, g in zip(optimizers, given, strict=True)]


def _alive(
    context: StepContext,
    pl_module: pl.LightningModule,
    box: Sandbox,
    stage: Stage,
    steady: bool,
    twins: list[tuple[Any, Any]],
    freed: list[torch.Tensor] | None,
    fake_batch: Any,
) -> tuple[dict[str, list[torch.Tensor]], int]:
    """What is alive as the step starts, by kind (the weights, the batch; at fit the gradients, the optimizer state
    and DDP's buckets; around a loop what a fit left alive), and ``early``: the bytes of the gradients a technique
    freed after the last step, alive until Lightning zeroes them without it."""
    early = 0
    parts = {"weights": box.parameters(), "batch": tensors_in(fake_batch)}
    if stage == "fit":
        made: list[torch.Tensor] = []  # the fake parameters given a later step's gradient
        grads = _gradients(pl_module, box, steady, {id(box.fake(p)) for p in freed or ()}, made)
        dropped = {id(param.grad) for param in made}  # before a twin's first step frees them
        parts.update(gradients=grads, optimizer=_optimizer_state(twins, box, steady))
        if steady and not context.gradients_kept():  # freed after last step's optimizer step: not alive now
            parts["gradients"] = [g for g in grads if id(g) not in dropped]
            early = _nbytes([g for g in grads if id(g) in dropped])
            for param in made:
                param.grad = None
        del grads, made
        if context.gradient_buckets:  # the step runs without DDP's wrapper: its buckets stand in, alive
            parts["buckets"] = [torch.empty(context.gradient_buckets, dtype=torch.uint8)]
    else:  # what a fit left alive around a validation loop
        parts.update(
            gradients=_gradients(pl_module, box, False),
            optimizer=[box.fake(t) for t in optimizer_state(context.optimizers)],
        )
    return parts, early


def _run(
    context: StepContext,
    box: Sandbox,
    step: Callable[[], Any],
    stage: Stage,
    batch_idx: int,
    twins: list[tuple[Any, Any]],
    probe: CPUProbe,
) -> int | None:
    """The step as Lightning runs it: at fit with automatic optimization the backward pass and the optimizer step
    too (the peak when the gradients were zeroed is returned), else the step alone, its outputs kept to its end."""
    if stage == "fit" and box.module.automatic_optimization:
        return _automatic(context, box, step, batch_idx, twins, probe)
    outputs = step()
    del outputs  # alive to here, as Lightning keeps the outputs until the batch ends
    return None


def _counted(
    context: StepContext,
    pl_module: pl.LightningModule,
    box: Sandbox,
    stage: Stage,
    twins: list[tuple[Any, Any]],
    probe: CPUProbe,
    held: list[dict[str, list[torch.Tensor]]],
    run: Callable[[], int | None],
    watch: Callable[[CPUProbe], contextlib.AbstractContextManager[Any]] | None,
) -> tuple[int, Any, int | None]:
    """``run()``, the step, counted by ``probe`` from what is alive as it starts (``held``'s one item, from
    :func:`_alive`, taken out so that only the probe holds it), as Lightning runs the stage: the step's peak, what
    ``watch`` gave on entering, and what ``run`` returned (at fit, the peak when the step zeroed the gradients)."""
    parts = held.pop()
    buckets = parts.get("buckets")  # held to the end of the step, as DDP holds its own
    parts["gradients"] += parts.pop("buckets", [])  # DDP's buckets hold the gradients' copies
    stand = _Stand(context, pl_module, box, twins, probe, stage)
    grad = torch.enable_grad() if stage == "fit" else torch.no_grad()  # as Lightning runs each stage
    watched = zeroed = None
    with stand.applied(), context.precision(), grad:
        probe.start(parts)
        del parts
        # at fit, each gradient accumulated into a parameter's .grad counts as a gradient from then on
        hooks = probe.tracker.gradients_of(box.trainable()) if stage == "fit" else []
        try:
            with watch(probe) if watch is not None else contextlib.nullcontext() as watched:
                zeroed = run()
        finally:
            for hook in hooks:
                hook.remove()
            peak, _ = probe.stop()  # before the sandbox closes: its modes are below the probe's
            del buckets
    return peak, watched, zeroed


def dry_run_step(
    context: StepContext,
    pl_module: pl.LightningModule,
    batch: Any,
    batch_idx: int,
    stage: Stage,
    dataloader_idx: int | None = None,
    steady: bool = False,
    watch: Callable[[CPUProbe], contextlib.AbstractContextManager[Any]] | None = None,
    device: torch.device | str = "cpu",
    reads: Replay | None = None,
    freed: list[torch.Tensor] | None = None,
    states: list[dict[Any, Any]] | None = None,
) -> DryRun:
    """Run the step of ``stage`` on fake tensors and count its peak as the real step's is counted.

    At fit the span is the whole step: with automatic optimization the forward pass, the backward pass (last step's
    gradients alive until Lightning zeroes them between the two) and the optimizer step at the end of an accumulation
    window; with manual optimization the ``training_step``; in both the optimizers are twins over fake parameters
    (gradient clipping is not run). At predict, validate and test it is the whole step of that loop, without grad,
    with the gradients and optimizer state that exist alive (a validation loop during fit).

    Args:
        steady: Count the gradients and optimizer state of a later step even if they do not exist yet (the first
            batch, to choose settings that must hold for every step).
        watch: Entered around the step with the running probe, to record more (per-block peaks); what it gives on
            entering is returned as the result's ``watched``.
        device: The device that a model built on the meta device pretends to be on.
        reads: A real step's reads to replay (:class:`~lightning_memopt.reads.Replay`); without it, values read out
            of fake tensors get placeholders.
        freed: Parameters whose last gradients a technique freed early: counted alive, as without it.
        states: The optimizers' state to start from, one per optimizer (:func:`state_shapes`), instead of theirs now.
    """
    with trackers_paused():  # a probe of the real batch around it (PeakMemory's) does not count the fake step
        return _dry_run_step(
            context, pl_module, batch, batch_idx, stage, dataloader_idx, steady, watch, device, reads, freed, states
        )


def _dry_run_step(
    context: StepContext,
    pl_module: pl.LightningModule,
    batch: Any,
    batch_idx: int,
    stage: Stage,
    dataloader_idx: int | None,
    steady: bool,
    watch: Callable[[CPUProbe], contextlib.AbstractContextManager[Any]] | None,
    device: torch.device | str,
    reads: Replay | None,
    freed: list[torch.Tensor] | None,
    states: list[dict[Any, Any]] | None,
) -> DryRun:
    started = time.perf_counter()
    name = STEPS[stage]
    function = getattr(type(pl_module), name)  # the user's step itself, not a wrapper set on the instance (rescue)
    step = function.__get__(pl_module)
    optimizers = context.optimizers
    box = Sandbox(pl_module, objects=optimizers, functions=[function], device=device, reads=reads)
    probe = CPUProbe(torch.device(device).type)
    try:
        with box, contextlib.ExitStack() as stack:  # the stack closes first, the sandbox's modes still on
            fake_batch = box.batch(batch)
            twins = _twins(optimizers, box, states) if stage == "fit" else []
            stack.enter_context(context.twins([(t, o) for t, o in twins if t is not None]))
            parts, early = _alive(context, pl_module, box, stage, steady, twins, freed, fake_batch)
            live_bytes = {name: _nbytes(tensors) for name, tensors in parts.items()}
            held = [parts]  # handed over: nothing here holds what the step starts with
            del parts
            args = step_args(pl_module, name, fake_batch, batch_idx, dataloader_idx)
            run = functools.partial(_run, context, box, lambda: step(*args), stage, batch_idx, twins, probe)
            peak, watched, zeroed = _counted(context, pl_module, box, stage, twins, probe, held, run, watch)
    except Exception as error:  # placeholders may be why (a loss of zeros with no graph): the note says so
        if strict() and _caused_by_stand_in(error):
            raise
        return _failed(error, box, started)
    # the gradients freed early would have added their bytes to every figure up to the zeroing, and nothing after it
    kept_peak = max(zeroed + early, peak) if zeroed is not None else None
    return _counted_run(box, probe, started, peak, watched, live_bytes, twins, kept_peak)


def _caused_by_stand_in(error: BaseException | None) -> bool:
    """Whether ``error``, or an error it was raised from or while handling, is a :class:`StandInError`."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, StandInError):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _failed(error: Exception, box: Sandbox, started: float) -> DryRun:
    """A dry run that stopped on ``error``: unknown, with a note that names it and the placeholders it read."""
    note, placeholders = failure_note(error), sum(box.reads.placeholders.values())
    if placeholders:
        note += f" (after placeholders for values read out of tensors: {box.reads.ops()})"
    return DryRun(None, time.perf_counter() - started, note, placeholders=placeholders)


def _counted_run(
    box: Sandbox,
    probe: CPUProbe,
    started: float,
    peak: int,
    watched: Any,
    live_bytes: dict[str, int],
    twins: list[tuple[Any, Any]],
    kept_peak: int | None,
) -> DryRun:
    """A dry run that ran to its end: its figures and what limits them."""
    remarks = [
        f"{type(o).__name__} could not be copied onto fake tensors: its state and step are not counted"
        for t, o in twins
        if t is None
    ]
    remarks += [n for n in [box.reads.note()] if n]
    return DryRun(
        peak,
        time.perf_counter() - started,
        watched=watched,
        live_bytes=live_bytes,
        remarks=remarks,
        placeholders=sum(box.reads.placeholders.values()),
        replayed=box.reads.replayed,
        at_peak=probe.at_peak,
        elsewhere_peak=probe.elsewhere_peak,
        kept_peak=kept_peak,
    )


def _nbytes(tensors: list[torch.Tensor]) -> int:
    local = [inner for t in tensors for inner in local_tensors(t)]  # a DTensor holds its shard only
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in local}
    return sum(storages.values())


def _gradients(
    pl_module: nn.Module, box: Sandbox, steady: bool, freed: set[int] = frozenset(), made: list | None = None
) -> list[torch.Tensor]:
    """Last step's gradients, as fakes on the fake parameters: alive through the forward pass (those of the fake
    parameters in ``freed`` too, by id). The parameters given a gradient that did not exist go into ``made``."""
    grads = []
    for param in {id(p): p for p in pl_module.parameters()}.values():
        fake = box.fake(param)
        if param.grad is not None:
            fake.grad = box.fake(param.grad)
        elif (steady and param.requires_grad) or id(param) in freed:
            fake.grad = torch.empty_like(fake)
            if made is not None:
                made.append(fake)
        if fake.grad is not None:
            grads.append(fake.grad)
    return grads


def _optimizer_state(twins: list[tuple[Any, Any]], box: Sandbox, steady: bool) -> list[torch.Tensor]:
    """The optimizers' state as fakes; with ``steady`` and no state yet, the state a first step would create."""
    stepped = [twin for twin, _ in twins if twin is not None]
    for twin in stepped:
        if steady and not twin.state:
            with contextlib.suppress(Exception):
                twin.step()
    return optimizer_state(stepped)


def _stepping(probe: CPUProbe, optimizers: list[Any], step: Callable[[], Any]) -> Any:
    """Run an optimizer step: what it allocates counts as ``other``, then the state it leaves as ``optimizer``."""
    with probe.tracker.allocating("other"), span(OPTIMIZER_STEP):
        result = step()
    probe.tracker.rekind(optimizer_state(optimizers), "optimizer")
    return result


def optimizer_state(optimizers: list[Any]) -> list[torch.Tensor]:
    """The tensors in the optimizers' state, also those in lists (LBFGS's history)."""
    return [t for o in optimizers for s in o.state.values() for t in tensors_in(list(s.values()))]


def _automatic(
    context: StepContext,
    box: Sandbox,
    training_step: Callable[[], Any],
    batch_idx: int,
    twins: list[tuple[Any, Any]],
    probe: CPUProbe,
) -> int | None:
    """What automatic optimization does with ``training_step``, as Lightning's closure: run it, scale the loss, zero
    the gradients at the start of an accumulation window, run the backward pass (into the fake parameters only), and
    step the optimizers (their twins, by ``context.optimizer_step``) at the end of one. An optimizer whose ``step``
    needs the closure (LBFGS) calls it again inside its step, as often as it does for real: each call runs the fake
    step once more. Returns the peak when the gradients were first zeroed (``None``: they were not)."""
    accumulate = context.accumulate_grad_batches
    trainable = box.trainable()
    stepped = [twin for twin, _ in twins if twin is not None]
    zeroed: list[int] = []
    result: list[torch.Tensor] = []  # the last call's loss and its detached copy, as Lightning's closure keeps them

    def closure() -> torch.Tensor | None:
        loss, kept = closure_loss(training_step(), accumulate)
        if loss is None:
            return None
        if zeroes_grads(batch_idx, accumulate):
            probe.tracker.fold()
            zeroed.append(probe.tracker.highest)
            for param in trainable:
                param.grad = None
        with context.backward(stepped, functools.partial(_stepping, probe)):
            torch.autograd.backward(loss, inputs=_backward_inputs(box, trainable))
        result[:] = [loss, kept]  # the previous call's let go only now
        return kept  # what Lightning's closure returns to the optimizer: the loss, detached

    first = closure()  # the optimizer's first call of the closure, made by Lightning's closure for every optimizer
    if first is None:
        return None
    if steps_optimizer(batch_idx, accumulate):
        closing = [t for t in stepped if takes_closure(t)]
        made = [first]  # a closure optimizer's first call gets the evaluation made above, its later calls new ones

        def step() -> None:
            for twin in closing:
                twin.step(lambda: made.pop() if made else closure())
            context.optimizer_step([t for t in stepped if t not in closing])

        _stepping(probe, stepped, step)
    return zeroed[0] if zeroed else None


def _backward_inputs(box: Sandbox, trainable: list[torch.Tensor]) -> list[torch.Tensor]:
    """What a dry run's backward pass computes gradients for: the fake trainable parameters and, under FSDP2, the
    unsharded parameters its all-gathers made, which the autograd graph reaches instead of the shards."""
    return trainable + unsharded_parameters(box.module)


def takes_closure(optimizer: Any) -> bool:
    """Whether ``optimizer.step`` needs the closure (LBFGS): it evaluates the step itself, maybe several times.

    Examples:
        >>> params = [torch.zeros(1, requires_grad=True)]
        >>> takes_closure(torch.optim.LBFGS(params)), takes_closure(torch.optim.SGD(params, lr=0.1))
        (True, False)
    """
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty
