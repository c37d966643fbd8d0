"""What the planner's dry runs measure: :class:`BlockRecorder`, the watch that marks each unit's forward pass and
backward window on a dry run's timeline and reads, per unit, the bytes it keeps, its peaks, its predicted time and the
FLOPs it recomputes (the only part of the planner that runs a module: a replayed unit, alone)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from lightning_memopt.compat import in_backward, tensors_in
from lightning_memopt.flops import SPENDING, attention, flops, in_recomputation, op_seconds, policed_now
from lightning_memopt.handles import AttributeOverride, HandleGroup
from lightning_memopt.memory import CPUPeakTracker, CPUProbe
from lightning_memopt.techniques.planner.model import Alone, Figures
from lightning_memopt.timeline import Timeline
from lightning_memopt.timing import Speed


class BlockRecorder:
    """A dry run's watch (see :attr:`~lightning_memopt.techniques.base.Planning.run`): it marks on the run's
    :class:`~lightning_memopt.timeline.Timeline` (:attr:`timeline`) where each unit's forward pass starts and ends and
    where its backward window opens (a unit is a :class:`Row` of the table: its ``module``, the ``method`` watched),
    and reads from it afterwards, per unit, the bytes its forward pass leaves alive (less those of units inside it),
    the peak while it runs forward (outermost units) and of its backward window, its predicted time (its forward
    pass's ops and its window's, its recomputation's where another's window is open) and the FLOPs it recomputes; and
    the peak before any window. ``without_grad``: forward passes without gradients are watched too (a loop's step).
    ``replay``: a unit whose row is filled by replays (``row.replays``) runs alone again on its first call's inputs
    (each kind of module and inputs once), counted apart (:attr:`alone`), at each of its settings that keep results
    exact (``"exact"``; without a ``budget`` up to its reference: those after it hold less only for more time, and
    cannot be chosen) or at its first and those that change results (``"lossy"``, up to the first whose peak in the
    step, the bytes alive when it started and its own, meets the ``budget``); the settings found go to the row
    (``row.found``). ``root`` names the modules on the timeline (the part holding the peak)."""

    def __init__(
        self,
        units: list[Any],
        probe: CPUProbe,
        speed: Speed | None = None,
        without_grad: bool = False,
        replay: str | None = None,
        budget: int | None = None,
        root: nn.Module | None = None,
    ) -> None:
        self.units = units
        self.probe = probe
        self.speed = speed
        self.without_grad = without_grad
        self.replay = replay
        self.budget = budget
        self.timeline = Timeline(probe, root if root is not None else nn.Module(), speed)
        self.calls = [0] * len(units)
        #: per replayed unit, per setting, the first (the one in force) first: its figures run alone
        self.alone: list[dict[Hashable, Alone]] = [{} for _ in units]
        self._owner: dict[int, int] = {}  # id(module): the innermost unit holding it
        for index in sorted(range(len(units)), key=lambda i: -sum(1 for _ in units[i].module.modules())):
            for module in units[index].module.modules():
                self._owner[id(module)] = index
        self._running: list[int] = []  # the units running forward now
        self._opened: set[int] = set()  # the units whose backward window has opened
        self._handles = HandleGroup()
        self._replaying = False
        self._replayed: dict[tuple[Any, ...], tuple[Any, dict[Hashable, Alone]]] = {}
        # a sharded model's module does not run alone (its hooks gather and free its parameters around the step's calls)
        self._sharded = _sharded(root)

    def _begin(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._replaying or in_backward() or not (torch.is_grad_enabled() or self.without_grad):
            return
        self.calls[index] += 1
        if self.replay is not None and getattr(self.units[index], "replays", False) and not self.alone[index]:
            self._replay(index, args, kwargs)
        elif self.replay == "exact" and getattr(self.units[index], "alone_at_fit", False) and not self.alone[index]:
            if not self._sharded:
                self._replay_with_backward(index, args, kwargs)
        self.timeline.mark(("begin", index))
        self._running.append(index)

    def _end(self, index: int, output: Any) -> None:
        if self._replaying or not self._running or self._running[-1] != index:
            return
        self._running.pop()
        self.timeline.mark(("end", index))
        grad = next((t for t in tensors_in(output) if t.requires_grad and t.grad_fn is not None), None)
        if grad is not None:
            grad.register_hook(lambda g: self._open(index))

    def _open(self, index: int) -> None:
        if index not in self._opened:
            self._opened.add(index)
            self.timeline.mark(("window", index))

    def _replay(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Run the unit alone at each setting its knob gives for these inputs, not counted in the step."""
        row = self.units[index]
        key = (type(row.module), row.method, row.settings[0], _shapes(args), _shapes(kwargs))
        if key not in self._replayed:
            found, alone = row.discover(args, kwargs), {}
            lossy = self.replay == "lossy"
            tried = [found[0][0], *(s for s in found[0][1:] if row.lossy(s) == lossy)]
            outer = self.probe.tracker
            call = row.module if row.method == "forward" else getattr(row.module, row.method)  # with its hooks
            with self._apart(row):
                for position, setting in enumerate(tried):
                    row.set(setting)
                    tally = _Tally(self.speed)
                    with CPUPeakTracker(outer) as tracker:
                        tracker.on_op = tally.op
                        call(*args, **kwargs)  # the output is dropped at once, as the next call would drop its input
                    if position > 0 and tracker.peak >= min(a.peak for a in alone.values()):
                        break  # it holds no less than a setting before it: those after it would only cost more
                    alone[setting] = Alone(tracker.peak, tally.seconds)
                    if lossy and self.budget is not None and outer.current + tracker.peak <= self.budget:
                        break  # it meets the budget alone: those after it would only cost more
                    if not lossy and self.budget is None and setting == found[1]:
                        break  # without a budget, those after the reference hold less than it only for more time
                if found[1] not in alone and not lossy:  # the reference was cut: the lowest replayed
                    found = (found[0], min(alone, key=lambda s: alone[s].peak))
            self._replayed[key] = (found, alone)
        found, self.alone[index] = self._replayed[key]
        if self.replay == "exact":
            row.found = found

    @contextlib.contextmanager
    def _apart(self, row: Any) -> Iterator[None]:
        """While a unit runs alone: the step's tracker paused, this recorder's hooks and the step's timelines (a
        recomputation's set-up, priced by the run alone) left out; the row's setting put back after."""
        saved, outer, spending = row.get(), self.probe.tracker, SPENDING[:]
        self._replaying, outer.paused, SPENDING[:] = True, True, []
        try:
            yield
        finally:
            row.set(saved)
            self._replaying, outer.paused, SPENDING[:] = False, False, spending

    def _replay_with_backward(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """At fit, run the unit alone, forward and backward, at each of its settings, on its first call's inputs cut
        from the step's graph (each kind of module, parameters and inputs once: its twins share the figures), not
        counted in the step."""
        row = self.units[index]
        params = tuple((tuple(p.shape), p.dtype, p.requires_grad) for p in row.module.parameters())
        key = ("fit", type(row.module), row.method, tuple(row.settings), params, _shapes(args), _shapes(kwargs))
        if key not in self._replayed:
            alone: dict[Hashable, Alone] = {}
            tried: dict[Hashable, Figures] = {}
            with self._apart(row):
                # a setting whose effect running alone does not show is measured in the whole step (Knob.alone); one
                # its knobs find not worth a run, from the figures of those run before it, not at all (as there)
                for i, setting in enumerate(row.settings):
                    if i > 0 and not (row.shown_alone(setting) and row.worth(setting, tried)):
                        continue
                    row.set(setting)
                    ran = alone[setting] = self._alone(row, args, kwargs, self.probe.tracker)
                    tried[setting] = Figures(ran.kept, ran.recomputed, ran.attention)
            self._replayed[key] = (None, alone)
        self.alone[index] = self._replayed[key][1]

    def _alone(self, row: Any, args: tuple[Any, ...], kwargs: dict[str, Any], outer: CPUPeakTracker) -> Alone:
        """One run of the unit alone, forward and backward. Each input that requires gradients is a new tensor of
        its own (from a scalar leaf, which alone the graph holds), let go of once the call returns, so that it counts
        in the bytes kept only where the unit holds it. What the step around the unit frees (an input a mode sends to
        the host, still held by the step here) is not seen: the whole-step runs measure that."""
        tally = _Tally(self.speed)
        call = row.module if row.method == "forward" else getattr(row.module, row.method)  # with its hooks
        with CPUPeakTracker(outer) as tracker:
            tracker.on_op = tally.op
            if self.speed is not None:
                SPENDING.append(tally)
            leaves: list[torch.Tensor] = []
            made = [_fresh((args, kwargs), leaves)]
            output = call(*made[0][0], **made[0][1])
            made.clear()  # the inputs held no longer, but by the unit
            peak, kept = tracker.peak, tracker.current
            tracker.restart_peak()
            outputs = [t for t in tensors_in(output) if t.requires_grad]
            wrt = leaves + [p for p in row.module.parameters() if p.requires_grad]
            if outputs and wrt:
                grads = [torch.ones_like(t) for t in outputs]
                torch.autograd.grad(outputs, wrt, grads, allow_unused=True)
            window = tracker.peak
            del output, outputs
            SPENDING[:] = [s for s in SPENDING if s is not tally]
        return Alone(peak, tally.seconds, kept, window, tally.recomputed, tally.attention, tally.policed)

    def _watch(self, index: int, inner: Callable[..., Any]) -> Callable[..., Any]:
        def watched(*args: Any, **kwargs: Any) -> Any:
            self._begin(index, args, kwargs)
            output = inner(*args, **kwargs)
            self._end(index, output)
            return output

        return watched

    @contextlib.contextmanager
    def watching(self) -> Iterator[BlockRecorder]:
        """Watch while open; the figures are read from the timeline when it closes."""
        for index, unit in enumerate(self.units):
            if getattr(unit, "method", "forward") != "forward":
                self._handles.add(
                    AttributeOverride.wrap(unit.module, unit.method, functools.partial(self._watch, index))
                )
                continue
            pre = functools.partial(lambda i, module, args, kwargs: self._begin(i, args, kwargs), index)
            post = functools.partial(lambda i, module, args, output: self._end(i, output), index)
            # a replayed unit's first, before the module's own hooks: a replay may leave a library's setting changed,
            # for its hook to set back for the call itself
            first = getattr(unit, "replays", False)
            self._handles.add(unit.module.register_forward_pre_hook(pre, with_kwargs=True, prepend=first))
            self._handles.add(unit.module.register_forward_hook(post, always_call=True))
        try:
            with self.timeline:
                yield self
                self.timeline.mark("stop")
            self._read()
        finally:
            self._handles.remove()
            self._handles = HandleGroup()

    def _read(self) -> None:
        """The figures, from the marks on the timeline (``("begin", unit)``, ``("end", unit)``, ``("window", unit)``,
        ``"stop"``): a stretch ends where an outermost unit's forward pass starts or ends, where a window opens and at
        the stop; its peak goes to the unit running forward (``forward``), else to the window open (``window``), else
        to ``ahead`` (before any forward pass) or ``before`` (before any window)."""
        timeline, n = self.timeline, len(self.units)
        self.kept, self.window, self.forward = [0] * n, [None] * n, [None] * n
        self.order: list[int] = []  # units in the order their windows opened
        self.ahead = self.before = 0
        self.seconds = [0.0] * n  # each unit's predicted time
        running: list[list[int]] = []  # [unit, the moment it began, bytes kept by units inside it]
        current: int | None = None  # the unit whose window is open
        cut = 0  # the moment the stretch began
        ends = [moment for moment, _ in timeline.marks[1:]] + [len(timeline)]
        for (moment, label), following in zip(timeline.marks, ends, strict=True):
            kind, index = label if isinstance(label, tuple) else (label, None)
            if kind in ("window", "stop") or (kind == "begin" and not running):
                peak, cut = timeline.peak_between(cut, moment), moment
                if current is not None:
                    self.window[current] = max(self.window[current] or 0, peak)
                elif any(p is not None for p in self.forward):
                    self.before = max(self.before, peak)
                else:
                    self.ahead = max(self.ahead, peak)
            if kind == "begin":
                running.append([index, moment, 0])
            elif kind == "end":
                index, began, inner = running.pop()
                kept = timeline.bytes_at(moment) - timeline.bytes_at(began)
                self.kept[index] += kept - inner
                if running:
                    running[-1][2] += kept
                else:
                    peak, cut = timeline.peak_between(cut, moment), moment
                    self.forward[index] = max(self.forward[index] or 0, peak)
                    # its inputs let go of as it returns (it kept copies elsewhere): freed by its setting
                    self.kept[index] += min(0, timeline.bytes_at(following) - timeline.bytes_at(moment))
            elif kind == "window":
                current = index
                self.order.append(index)
                self.window[index] = self.window[index] or 0
            # the ops up to the next mark: forward ones to the unit running, backward ones to the window open, a
            # recomputation to the unit whose segment runs again
            forward = running[-1][0] if running else None
            for phase, block, seconds in timeline.moments(moment + 1, following):
                unit = self._owner.get(id(block), current) if phase in ("backward", "recomputation") else forward
                if unit is not None:
                    self.seconds[unit] += seconds
        self.recomputed = self._by_unit(timeline.recomputed())
        self.attention = self._by_unit(timeline.recomputed_attention())

    def _by_unit(self, by_block: dict[Any, int]) -> list[int]:
        by_unit = [0] * len(self.units)
        for block, count in by_block.items():
            owner = self._owner.get(id(block))
            if owner is not None:
                by_unit[owner] += count
        return by_unit


class _Tally:
    """What the ops of a unit run alone add up to: predicted seconds (with each recomputation's set-up), FLOPs
    recomputed, those in fused attention kernels, and ops through a selective policy."""

    def __init__(self, speed: Speed | None) -> None:
        self.speed = speed
        self.seconds = 0.0
        self.recomputed = self.attention = self.policed = 0

    def spend(self, seconds: float) -> None:
        self.seconds += seconds

    def op(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        count = flops(func, args, kwargs, out)
        if in_recomputation():
            self.recomputed += count
            self.attention += count if attention(func) else 0
        self.policed += policed_now()
        if self.speed is not None:
            self.seconds += op_seconds(self.speed, func, args, kwargs, out, count)


def _sharded(root: nn.Module | None) -> bool:
    """Whether ``root`` holds a module sharded by FSDP2 or a parameter that is a tensor subclass (a DTensor)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        FSDPModule = ()  # noqa: N806
    modules = [] if root is None else list(root.modules())
    return any(
        isinstance(m, FSDPModule) or any(map(is_traceable_wrapper_subclass, m.parameters(recurse=False)))
        for m in modules
    )


def _fresh(call: Any, leaves: list[torch.Tensor]) -> Any:
    """A call's ``(args, kwargs)`` cut from the graph that made them: each tensor that requires gradients a new one,
    the old one plus a scalar leaf (put in ``leaves``), the others the same storages."""
    from torch.utils._pytree import tree_map

    def fresh(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if not t.requires_grad:
            return t.detach()
        leaves.append(torch.zeros((), dtype=t.dtype, device=t.device, requires_grad=True))
        return t.detach() + leaves[-1]

    return tree_map(fresh, call)


def _shapes(value: Any) -> tuple[Any, ...]:
    """The shapes, types and ``requires_grad`` of a call's arguments, to know a call like another (the first layer of
    a LoRA model gets an input that requires no gradient, the others one that does: they keep different bytes)."""
    leaves = value.values() if isinstance(value, dict) else value
    return tuple(
        (tuple(t.shape), t.dtype, t.requires_grad) if isinstance(t, torch.Tensor) else type(t).__name__ for t in leaves
    )
