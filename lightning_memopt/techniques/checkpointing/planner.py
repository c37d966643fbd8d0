"""Choosing each checkpointed block's mode at fit (``"none"``, ``"selective"``, ``"attention"``, ``"full"`` or
``"whole"``, see :data:`~lightning_memopt.techniques.checkpointing.selective.MODES`) for the fewest recompute FLOPs
that meet a memory budget, from dry runs.

**The cost table.** Dry runs of a later step, one with every block in each mode (``"attention"`` only where a
``"full"`` block recomputes fused attention; elsewhere it keeps what ``"full"`` does), give for each block and mode:
the bytes its forward pass leaves alive for the backward pass, the peak while its backward pass runs (from the moment
the gradient of its output is computed until the next block's backward pass starts), and the FLOPs it recomputes
(:class:`~lightning_memopt.techniques.checkpointing.selective.FlopCount`). The peak before any block's backward pass
is noted too.

**The peak of a mix** is modelled from the table. While block ``j``'s backward pass runs, the blocks before it still
hold what their forward passes kept: the peak there is block ``j``'s window, as measured with every block in ``j``'s
mode, less what the blocks before it kept in that run, plus what they keep in the mix. Before the backward pass, every
block holds what it kept. This model makes position matter (a block's saving lowers only the windows after it) and is
exact for the uniform runs it was measured on.

**The choice** is the mix with the fewest recompute FLOPs whose modelled peak meets the target, found by dynamic
programming over the blocks in order (each partial mix kept only if no other has both fewer bytes kept and fewer
FLOPs). A dry run with the mix checks it. A mix over the target is chosen again for a target lowered by the miss; one
well under it, for a target raised by the room left, since a cheaper mix may fit (:data:`CHECKS` dry runs at most,
the cheapest mix that met the target kept).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_memopt.compat import in_backward, tensors_in
from lightning_memopt.memory import CPUProbe
from lightning_memopt.techniques.base import Planning
from lightning_memopt.techniques.checkpointing.selective import MODES, FlopCount

#: Without a budget, ``checkpointing="auto"`` takes the cheapest mix within this fraction above the peak with every
#: block fully checkpointed.
AUTO_SLACK = 0.05
#: Dry runs that check a mix chosen from the table, at most.
CHECKS = 4


class BlockRecorder:
    """A dry run's watch (see :attr:`~lightning_memopt.techniques.base.Planning.run`): per checkpoint unit, the bytes
    its forward pass leaves alive (less those of units inside it) and the peak of its backward window; the peak before
    any window; and FLOPs (:class:`FlopCount`), the recomputed ones per unit."""

    def __init__(self, units: list[Any], probe: CPUProbe) -> None:
        self.units = units
        self.probe = probe
        self.kept = [0] * len(units)
        self.window: list[int | None] = [None] * len(units)
        self.order: list[int] = []  # units in the order their windows started
        self.forward: list[int | None] = [None] * len(units)  # the peak while each outermost unit's forward runs
        self.ahead = 0  # the peak before any unit's forward pass
        self.before = 0  # the peak after one, before the first window, outside the units' forward passes
        self.flops = FlopCount()
        self._owner: dict[int, int] = {}  # id(module): the innermost unit holding it
        for index in sorted(range(len(units)), key=lambda i: -sum(1 for _ in units[i].module.modules())):
            for module in units[index].module.modules():
                self._owner[id(module)] = index
        self._running: list[list[int]] = []  # [unit, live bytes at its start, bytes kept by units inside it]
        self._current: int | None = None  # the unit whose window runs
        self._handles: list[Any] = []

    @property
    def recomputed(self) -> list[int]:
        """FLOPs each unit recomputed."""
        by_unit = [0] * len(self.units)
        for key, count in self.flops.by_block.items():
            owner = self._owner.get(key)
            if owner is not None:
                by_unit[owner] += count
        return by_unit

    def _pre(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if torch.is_grad_enabled() and not in_backward():
                if not self._running:
                    self._close()
                self._running.append([index, self.probe.tracker.current, 0])

        return hook

    def _post(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self._running or self._running[-1][0] != index:
                return
            _, start, inner = self._running.pop()
            kept = self.probe.tracker.current - start
            self.kept[index] += kept - inner
            if self._running:
                self._running[-1][2] += kept
            else:
                self.forward[index] = max(self.forward[index] or 0, self.probe.segment())
            grad = next((t for t in tensors_in(output) if t.requires_grad and t.grad_fn is not None), None)
            if grad is not None:
                grad.register_hook(lambda g: self._start(index))

        return hook

    def _start(self, index: int) -> None:
        if self.window[index] is not None or index == self._current:
            return
        self._close()
        self._current = index
        self.order.append(index)
        self.window[index] = 0

    def _close(self) -> None:
        peak = self.probe.segment()
        if self._current is None and not any(p is not None for p in self.forward):
            self.ahead = max(self.ahead, peak)
        elif self._current is None:
            self.before = max(self.before, peak)
        else:
            self.window[self._current] = max(self.window[self._current] or 0, peak)

    @contextlib.contextmanager
    def watching(self) -> Iterator[BlockRecorder]:
        for index, unit in enumerate(self.units):
            self._handles.append(unit.module.register_forward_pre_hook(self._pre(index)))
            self._handles.append(unit.module.register_forward_hook(self._post(index), always_call=True))
        try:
            with self.flops:
                yield self
            self._close()
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []


@dataclass
class Run:
    """One dry run's figures for the table (``peak`` ``None``: it could not be traced)."""

    peak: int | None
    kept: list[int] = field(default_factory=list)
    window: list[int | None] = field(default_factory=list)
    forward: list[int | None] = field(default_factory=list)
    order: list[int] = field(default_factory=list)
    ahead: int = 0
    before: int = 0
    recomputed: list[int] = field(default_factory=list)
    recomputed_total: int = 0
    forward_flops: int = 0
    recomputed_attention: int = 0  # the recomputed FLOPs in fused attention kernels
    placeholders: int = 0  # values read out of fake tensors that got a placeholder

    @classmethod
    def of(cls, dry: Any) -> Run:
        """The figures of a dry run watched by a :class:`BlockRecorder`."""
        recorder: BlockRecorder | None = dry.watched
        if dry.peak_bytes is None or recorder is None:
            return cls(None, placeholders=dry.placeholders)
        flops = recorder.flops
        return cls(
            dry.peak_bytes,
            recorder.kept,
            recorder.window,
            recorder.forward,
            recorder.order,
            recorder.ahead,
            recorder.before,
            recorder.recomputed,
            flops.recomputed,
            flops.forward,
            flops.recomputed_attention,
            dry.placeholders,
        )

    def rest(self) -> list[int]:
        """The units without a backward window (nothing of theirs needs gradients)."""
        return [i for i in range(len(self.kept)) if i not in self.order]

    def outside(self) -> int:
        """The peak that no unit with a window holds (that of units without one taken with every unit's bytes kept
        alive), less all the units kept."""
        forward = [self.forward[i] or 0 for i in self.rest()]
        return max([self.ahead, *forward, 0 if self.order else self.before]) - sum(self.kept)

    def own(self, unit: int, earlier: list[int]) -> int | None:
        """The peak while ``unit`` runs forward or backward, less what the ``earlier`` units kept; the last unit to run
        forward (the first backward) also holds the peak between the units' forward passes and before the backward
        pass (every unit's bytes alive)."""
        between = self.before if self.order and unit == self.order[0] else None
        peaks = [p for p in (self.window[unit], self.forward[unit], between) if p is not None]
        if not peaks:
            return None
        return max(peaks) - sum(self.kept[i] for i in earlier)


@dataclass
class Table:
    """Per mode, the run with every unit in that mode; and the runs that checked mixes, with their modes. Each run
    gives, per unit, its peak less what the units before it kept (:meth:`Run.own`); where runs differ, the highest is
    taken, so a mix found over the target makes the next choice more careful."""

    runs: dict[str, Run]
    checked: list[tuple[list[str], Run]] = field(default_factory=list)

    @property
    def order(self) -> list[int]:
        """The units with a backward window, in forward order (the reverse of their windows)."""
        return list(reversed(self.runs["none"].order))

    def _own(self, unit: int, mode: str, earlier: list[int]) -> int | None:
        samples = [self.runs[mode], *(run for modes, run in self.checked if modes[unit] == mode)]
        values = [value for run in samples if (value := run.own(unit, earlier)) is not None]
        return max(values) if values else None

    def _outside(self) -> int:
        return max(run.outside() for run in [*self.runs.values(), *(run for _, run in self.checked)])

    def peak(self, modes: list[str]) -> int:
        """The modelled peak of a mix (see the module's docstring)."""
        kept = [self.runs[m].kept[i] for i, m in enumerate(modes)]
        order, rest = self.order, self.runs["none"].rest()
        peak = self._outside() + sum(kept)
        for position, unit in enumerate(order):
            earlier = order[:position] + rest  # they still hold what they kept
            own = self._own(unit, modes[unit], earlier)
            if own is not None:
                peak = max(peak, own + sum(kept[i] for i in earlier))
        return peak

    def cheapest(self, target: int, allowed: list[tuple[str, ...]]) -> list[str] | None:
        """The mix with the fewest recompute FLOPs whose modelled peak is within ``target`` (``None``: none is),
        ``allowed`` giving each unit's modes. Units are taken in forward order; a partial mix is dropped when another
        has kept no more bytes for no more FLOPs. Units without a backward window stay ``"none"``."""
        runs, order, rest = self.runs, self.order, self.runs["none"].rest()
        # a partial mix: (bytes kept by the units so far, FLOPs, modes by unit)
        front: list[tuple[int, int, dict[int, str]]] = [(sum(runs["none"].kept[i] for i in rest), 0, {})]
        for position, unit in enumerate(order):
            earlier = order[:position] + rest
            grown = []
            for mode in allowed[unit]:
                run, own = runs[mode], self._own(unit, mode, earlier)
                for kept, flops, modes in front:
                    if own is None or own + kept <= target:
                        grown.append((kept + run.kept[unit], flops + run.recomputed[unit], {**modes, unit: mode}))
            grown.sort(key=lambda p: (p[0], p[1]))
            front = []
            for partial in grown:
                if not front or partial[1] < front[-1][1]:
                    front.append(partial)
        outside = self._outside()
        feasible = [p for p in front if outside + p[0] <= target]
        if not feasible:
            return None
        modes = min(feasible, key=lambda p: p[1])[2]
        return [modes.get(i, "none") for i in range(len(allowed))]


@dataclass
class RecomputeChoice:
    """What :func:`choose_modes` did (the modes chosen are in force afterwards): the peak the dry run with them gave
    (``None``: it could not be traced), the FLOPs they recompute and the forward pass's, the time the dry runs took,
    notes, and whether a dry run gave placeholders for values the step read."""

    peak_bytes: int | None = None
    recompute_flops: int | None = None
    forward_flops: int | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    placeholders: bool = False

    @property
    def recompute_fraction(self) -> float | None:
        if self.recompute_flops is None or not self.forward_flops:
            return None
        return self.recompute_flops / self.forward_flops


def choose_modes(planning: Planning, checkpointing: Any, budget: int | None, choose: bool = True) -> RecomputeChoice:
    """Put each block's mode of ``checkpointing`` (the :class:`~lightning_memopt.techniques.checkpointing.Checkpointing`
    of the stage) in force from dry runs of the batch as a later step would run it.

    With ``choose`` off, the modes in force are kept and one dry run counts their recompute FLOPs. Otherwise the
    mix with the fewest recompute FLOPs is chosen whose peak meets ``budget`` or, without one, is within
    :data:`AUTO_SLACK` of the peak with every block ``"full"`` (the model's own switch); where no mix meets it, every
    block takes the mode of the lowest uniform peak (``"full"`` or ``"whole"``)."""
    units = checkpointing.switches
    choice = RecomputeChoice()

    def run(modes: list[str] | None) -> Run:
        if modes is not None:
            checkpointing.set(modes)
        dry = planning.run(lambda probe: BlockRecorder(units, probe).watching(), steady=True)
        choice.seconds += dry.seconds
        if dry.note:
            choice.notes.append(dry.note)
        choice.placeholders |= bool(dry.placeholders)
        return Run.of(dry)

    if not choose or not units:
        found = run(None)
        _count(choice, found)
        return choice
    settled = list(checkpointing.modes)
    allowed = [u.modes for u in units]
    runs: dict[str, Run] = {}
    # "attention" last: the "full" run says whether any block recomputes fused attention, which it would keep
    for mode in sorted((m for m in MODES if any(m in a for a in allowed)), key=lambda m: m == "attention"):
        if mode == "attention" and not runs["full"].recomputed_attention:
            continue  # no block recomputes fused attention: an "attention" block keeps what a "full" one does
        runs[mode] = run([mode if mode in a else "full" for a in allowed])
    checkpointing.set(settled)
    if any(r.peak is None for r in runs.values()):
        return choice
    allowed = offered(allowed, runs)
    target = budget if budget is not None else int(runs["full"].peak * (1 + AUTO_SLACK))
    table = Table(runs)
    best: tuple[int, list[str], Run] | None = None  # the feasible mix checked with the fewest FLOPs
    aim, tried = target, set()
    for _ in range(CHECKS):
        modes = table.cheapest(aim, allowed)
        if modes is None or tuple(modes) in tried:
            break
        tried.add(tuple(modes))
        checked = run(modes)
        if checked.peak is None:
            break
        table.checked.append((modes, checked))
        if checked.peak > target:  # the model was low: aim lower by the miss
            aim -= checked.peak - target
            continue
        if best is None or checked.recomputed_total < best[0]:
            best = (checked.recomputed_total, modes, checked)
        if not checked.recomputed_total or target - checked.peak <= 0.005 * target:
            break
        aim += target - checked.peak  # the model was high: a cheaper mix may fit the room left
    if best is not None:
        checkpointing.set(best[1])
        _count(choice, best[2], runs["none"].forward_flops)
        return choice
    lowest = min(("full", "whole"), key=lambda m: runs[m].peak if m in runs else float("inf"))
    checkpointing.set([lowest if lowest in a else "full" for a in allowed])
    _count(choice, runs[lowest], runs["none"].forward_flops)
    if runs[lowest].peak > target:
        choice.notes.append(f"the budget of {target} bytes is not met even with every block checkpointed")
    return choice


def offered(allowed: list[tuple[str, ...]], runs: dict[str, Run]) -> list[tuple[str, ...]]:
    """Each unit's modes (``allowed``) that have a uniform run, ``"attention"`` only where it recomputes less than
    ``"full"``: a unit that runs no fused attention keeps and recomputes the same in both."""
    return [
        tuple(
            m for m in modes if m in runs and (m != "attention" or runs[m].recomputed[i] < runs["full"].recomputed[i])
        )
        for i, modes in enumerate(allowed)
    ]


def _count(choice: RecomputeChoice, run: Run, forward: int | None = None) -> None:
    choice.peak_bytes = run.peak
    if run.peak is not None:
        choice.recompute_flops = run.recomputed_total
        choice.forward_flops = forward if forward is not None else run.forward_flops
