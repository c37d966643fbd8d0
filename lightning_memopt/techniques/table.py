"""The stage's planner: it chooses the settings of every technique's knobs (:class:`~lightning_memopt.techniques.
base.Knob`) under one budget, from one cost table, for the least work, without knowing which technique a knob is.

**Rows.** Knobs on one module form one row; its settings are every combination of theirs (a technique whose knob
changes what another technique's module keeps, such as a feed-forward's chunking inside a checkpointed block, puts its
knob on that module). A row on a module inside another row's module (a checkpointed attention inside a checkpointed
block) is a row of its own: what it keeps is counted apart from the outer one's. Rows are taken in the order their
modules run forward.

**The cost table.** Dry runs of a later step (last step's gradients and the optimizer state alive) give, for each row
and setting: the bytes its forward pass leaves alive for the backward pass (less those freed as it returns, before
anything else runs: its inputs, where it keeps copies on the host), the peak while its backward pass runs
(from the moment the gradient of its output is computed until the next row's backward pass starts) or while its
forward runs, the FLOPs it recomputes (all read from the run's :class:`~lightning_memopt.timeline.Timeline`), and
its cost: its predicted time (every op of its forward pass and of its backward window) plus what its knobs add
(:attr:`~lightning_memopt.techniques.base.Knob.cost`). The first run has every row at its first setting; then
one run per setting any row has, every row that has it (and finds it worth a run) at it, the others at their
reference. The peak before any row's backward pass is noted too. A row of a module that runs without gradients (a
loop's block, a VAE decode) may instead be filled by replays (:attr:`~lightning_memopt.techniques.base.Knob.replay`):
in the first run the module runs alone again at each setting, and the row's figures at a setting are the first run's
moved by what the replay changed; under a budget, a run without replays comes first, and where the step meets the
budget as it is, it is the whole table.

**The peak of a mix** is modelled from the table. While row ``j``'s backward pass runs, the rows before it still hold
what their forward passes kept: the peak there is row ``j``'s window, as measured in the run that gave ``j``'s
setting, less what the rows before it kept in that run, plus what they keep in the mix. Before the backward pass,
every row holds what it kept. A row without a backward window holds its forward peak at its setting, with every other
row's bytes kept alive. This model makes position matter (a row's saving lowers only the windows after it) and is
exact for the runs it was measured on.

**The choice** is the mix with the least cost whose modelled peak meets the target (the budget or, without one,
:data:`SLACK` above the peak with every knob at its reference), found by dynamic programming over the rows in order
(each partial mix kept only if no other has both fewer bytes kept and less cost). A dry run with the mix checks it. A
mix over the target is chosen again for a target lowered by the miss; one well under it, for a target raised by the
room left, since a cheaper mix may fit (:data:`CHECKS` dry runs at most). Of every mix dry-run (the table's runs
and the checks), the one with the least predicted step time that met the target is kept: the table shares a step's
time out per row only roughly. The ops a mix routes through a selective policy's Python dispatch mode are priced
once more (:data:`DOUBT`) in that ranking: their cost moves most with the host. Where no mix meets the target,
the run with the lowest peak is kept.

**Knobs of the whole step** (no module: the optimizer step in the backward pass, the optimizer state or the weights in
8 bits) are not rows. Each of their settings is measured alone, every row at its first setting: what it saves on the
step's peak and adds to its predicted time (a dry run each, or the knob's ``estimate``). A mix of them moves every
modelled peak down by the sum of their savings, and adds their seconds; the rows' cheapest mix is found for each mix of
them, and the cheapest of all is checked by a dry run with everything in force. Settings that change results
(``Knob.lossy``) are chosen only where the stage allows them (``lossy=True``): a step knob's compete on predicted time
with the mixes that keep results; a replayed row's are replayed and tried only where no mix that keeps results meets
the budget.

The cost is time: each row's predicted time (:mod:`~lightning_memopt.timing`) in the run that measured its setting,
and a checked mix's the whole step's predicted time, plus what the knobs' ``cost`` adds (seconds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from lightning_memopt.compat import in_backward, tensors_in
from lightning_memopt.flops import op_seconds
from lightning_memopt.handles import AttributeOverride, HandleGroup
from lightning_memopt.memory import CPUPeakTracker, CPUProbe
from lightning_memopt.techniques.base import Knob, Planning
from lightning_memopt.timeline import Timeline
from lightning_memopt.timing import Speed, speed
from lightning_memopt.units import fmt_sizes

#: Without a budget, the planner takes the cheapest mix within this fraction above the peak with every knob at its
#: reference setting.
SLACK = 0.05
#: Dry runs that check a mix chosen from the table, at most.
CHECKS = 4
#: The mixes dry-run are ranked by their predicted time plus this many times more the price of the ops they route
#: through a selective policy's Python dispatch mode (``Speed.policy_op_s`` each): the part of the time model most at
#: the mercy of the host, so a mix with more of them must be predicted faster by more than they cost.
DOUBT = 1.0


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
        #: per replayed unit, per setting, the first (the one in force) first: its own peak (above the bytes alive when
        #: it starts) and its predicted seconds, run alone
        self.alone: list[dict[Hashable, tuple[int, float]]] = [{} for _ in units]
        self._owner: dict[int, int] = {}  # id(module): the innermost unit holding it
        for index in sorted(range(len(units)), key=lambda i: -sum(1 for _ in units[i].module.modules())):
            for module in units[index].module.modules():
                self._owner[id(module)] = index
        self._running: list[int] = []  # the units running forward now
        self._opened: set[int] = set()  # the units whose backward window has opened
        self._handles = HandleGroup()
        self._replaying = False
        self._replayed: dict[tuple[Any, ...], tuple[Any, dict[Hashable, tuple[int, float]]]] = {}

    def _begin(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._replaying or in_backward() or not (torch.is_grad_enabled() or self.without_grad):
            return
        self.calls[index] += 1
        if self.replay is not None and getattr(self.units[index], "replays", False) and not self.alone[index]:
            self._replay(index, args, kwargs)
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
            found, alone, saved = row.discover(args, kwargs), {}, row.get()
            lossy = self.replay == "lossy"
            tried = [found[0][0], *(s for s in found[0][1:] if row.lossy(s) == lossy)]
            outer = self.probe.tracker
            call = row.module if row.method == "forward" else getattr(row.module, row.method)  # with its hooks
            self._replaying, outer.paused = True, True
            try:
                for position, setting in enumerate(tried):
                    row.set(setting)
                    seconds = [0.0]
                    with CPUPeakTracker(outer) as tracker:
                        if self.speed is not None:
                            tracker.on_op = functools.partial(_price, self.speed, seconds)
                        call(*args, **kwargs)  # the output is dropped at once, as the next call would drop its input
                    if position > 0 and tracker.peak >= min(peak for peak, _ in alone.values()):
                        break  # it holds no less than a setting before it: those after it would only cost more
                    alone[setting] = (tracker.peak, seconds[0])
                    if lossy and self.budget is not None and outer.current + tracker.peak <= self.budget:
                        break  # it meets the budget alone: those after it would only cost more
                    if not lossy and self.budget is None and setting == found[1]:
                        break  # without a budget, those after the reference hold less than it only for more time
                if found[1] not in alone and not lossy:  # the reference was cut: the lowest replayed
                    found = (found[0], min(alone, key=lambda s: alone[s][0]))
            finally:
                row.set(saved)
                self._replaying, outer.paused = False, False
            self._replayed[key] = (found, alone)
        found, self.alone[index] = self._replayed[key]
        if self.replay == "exact":
            row.found = found

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


def _price(speed: Speed, total: list[float], *op: Any) -> None:
    total[0] += op_seconds(speed, *op)


def _shapes(value: Any) -> tuple[Any, ...]:
    """The shapes and types of a call's arguments, to know a call like another."""
    leaves = value.values() if isinstance(value, dict) else value
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__ for t in leaves)


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
    attention: list[int] = field(default_factory=list)  # the same per unit
    placeholders: int = 0  # values read out of fake tensors that got a placeholder
    seconds: list[float] = field(default_factory=list)  # per unit, predicted (see BlockRecorder)
    predicted_s: float | None = None  # the whole step's predicted time
    policed: int = 0  # ops run through a selective policy's Python dispatch mode
    calls: list[int] = field(default_factory=list)  # per unit, its calls
    alone: list[dict[Hashable, tuple[int, float]]] = field(default_factory=list)
    part: str | None = None  # the part of the model holding the peak, where a timeline was kept

    @classmethod
    def of(cls, dry: Any) -> Run:
        """The figures of a dry run watched by a :class:`BlockRecorder`."""
        recorder: BlockRecorder | None = dry.watched
        if dry.peak_bytes is None or recorder is None:
            return cls(None, placeholders=dry.placeholders)
        timeline = recorder.timeline
        return cls(
            dry.peak_bytes,
            recorder.kept,
            recorder.window,
            recorder.forward,
            recorder.order,
            recorder.ahead,
            recorder.before,
            recorder.recomputed,
            sum(timeline.recomputed().values()),
            timeline.forward_flops(),
            sum(timeline.recomputed_attention().values()),
            recorder.attention,
            dry.placeholders,
            recorder.seconds,
            timeline.seconds() if timeline.speed is not None else None,
            timeline.policed,
            recorder.calls,
            recorder.alone,
            timeline.part,
        )

    def replayed(self, unit: int, setting: Hashable) -> Run:
        """This run as it would have been with ``unit`` (replayed) at ``setting``: its forward peak and its time moved
        by what running it alone at ``setting`` rather than at its setting here (the first it replayed) changed, in each
        of its calls."""
        here = next(iter(self.alone[unit]))
        (peak, seconds), (peak_here, seconds_here) = self.alone[unit][setting], self.alone[unit][here]
        forward, times = list(self.forward), list(self.seconds)
        if forward[unit] is not None:
            forward[unit] += peak - peak_here
        times[unit] += self.calls[unit] * (seconds - seconds_here)
        predicted = None if self.predicted_s is None else self.predicted_s + times[unit] - self.seconds[unit]
        return dataclasses.replace(self, forward=forward, seconds=times, predicted_s=predicted)

    def rest(self) -> list[int]:
        """The units without a backward window (nothing of theirs needs gradients)."""
        return [i for i in range(len(self.kept)) if i not in self.order]

    def outside(self) -> int:
        """The peak outside every unit (before any, and, without windows, between them and after), less all the
        units kept."""
        return max(self.ahead, 0 if self.order else self.before) - sum(self.kept)

    def own(self, unit: int, earlier: list[int]) -> int | None:
        """The peak while ``unit`` runs forward or backward, less what the ``earlier`` units kept; the last unit to run
        forward (the first backward) also holds the peak between the units' forward passes and before the backward
        pass (every unit's bytes alive)."""
        between = self.before if self.order and unit == self.order[0] else None
        peaks = [p for p in (self.window[unit], self.forward[unit], between) if p is not None]
        if not peaks:
            return None
        return max(peaks) - sum(self.kept[i] for i in earlier)


class Figures(NamedTuple):
    """What one row's module did in a dry run: the bytes it kept for the backward pass, the FLOPs it recomputed, and
    those of them in fused attention kernels."""

    kept: int
    recomputed: int
    attention: int


@dataclass
class Row:
    """The knobs on one module; a setting is one value per knob, in their order."""

    module: nn.Module
    knobs: list[Knob] = field(default_factory=list)
    found: tuple[list[tuple[Hashable, ...]], tuple[Hashable, ...]] | None = None  # what a replay found (see replay)

    @property
    def settings(self) -> list[tuple[Hashable, ...]]:
        if self.found is not None:
            return self.found[0]
        return list(itertools.product(*(k.settings for k in self.knobs)))

    @property
    def reference(self) -> tuple[Hashable, ...]:
        return self.found[1] if self.found is not None else tuple(k.reference for k in self.knobs)

    @property
    def method(self) -> str:
        return self.knobs[0].method

    @property
    def replays(self) -> bool:
        """Whether its knob is filled by replays (it is then the row's only knob)."""
        return self.knobs[0].replay is not None

    def discover(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[tuple[Hashable, ...]], Any]:
        """Its knob's settings and reference for a call's inputs (see ``Knob.replay``), as the row's."""
        assert self.knobs[0].replay is not None
        settings, reference = self.knobs[0].replay(args, kwargs)
        return [(s,) for s in settings], (reference,)

    def lossy(self, setting: tuple[Hashable, ...]) -> bool:
        return any(knob.lossy(value) for knob, value in zip(self.knobs, setting, strict=True))

    def get(self) -> tuple[Hashable, ...]:
        return tuple(k.get() for k in self.knobs)

    def set(self, setting: tuple[Hashable, ...]) -> None:
        for knob, value in zip(self.knobs, setting, strict=True):
            knob.set(value)

    def cost(self, setting: tuple[Hashable, ...]) -> float:
        return sum(knob.cost(value) for knob, value in zip(self.knobs, setting, strict=True))

    def worth(self, setting: tuple[Hashable, ...], tried: dict[tuple[Hashable, ...], Figures]) -> bool:
        """Whether every knob finds its value worth a run, from the row's figures at the settings tried."""
        for index, (knob, value) in enumerate(zip(self.knobs, setting, strict=True)):

            def seen(earlier: Hashable, index: int = index) -> Figures | None:
                return next((f for s, f in tried.items() if s[index] == earlier), None)

            if not knob.worth(value, seen):
                return False
        return True


def rows_of(knobs: list[Knob]) -> list[Row]:
    """The table's rows: one per module that has knobs, with every knob on it, in the order the knobs came."""
    rows: dict[int, Row] = {}
    for knob in knobs:
        row = rows.setdefault(id(knob.module), Row(knob.module))
        if row.knobs and (knob.replay is not None or row.replays):
            raise ValueError(f"the knob {knob.name!r} is filled by replays and must be alone on its module")
        row.knobs.append(knob)
    return list(rows.values())


class Option(NamedTuple):
    """One setting of one row, for :func:`solve`: the setting, the bytes its forward pass keeps for the backward pass,
    its own peak (while its backward window runs, or its forward pass for a row without one) less what the rows that
    still hold their bytes then keep in the run that measured it (``None``: no figure, it fits anywhere), and its
    cost."""

    setting: Hashable
    kept: int
    own: int | None
    cost: float


#: The solver's resolution: of the partial choices whose bytes kept fall in one bucket of this fraction of the target,
#: only the cheapest is kept, so a row's partial choices are at most about its inverse (a bounded solve: a few
#: hundredths of a second for 100 rows of four settings; ``benchmarks/solver.py``). A choice found this way may cost
#: a little more than the least, never more bytes than the target.
RESOLUTION = 1 / 256
#: :func:`solve_many` solves at most this many targets, each mix's target taken down to the nearest of as many levels
#: from the lowest target to the highest (a mix may so be given less room than it has, never more).
LEVELS = 32


def solve(
    rows: list[list[Option]], rest: list[list[Option]], rest_kept: list[int], outside: int, target: int
) -> tuple[float, list[Hashable], list[Hashable]] | None:
    """The least-cost choice of one option per row whose modelled peak is within ``target``: its cost, the settings
    of ``rows`` and those of ``rest``; ``None`` where none is. Pure: no dry run, no module.

    ``rows`` have a backward window and come in forward order: the rows before one still hold what they kept while its
    backward pass runs, so an option fits where its ``own`` and what they keep (and ``rest_kept``, the bytes the rows
    of ``rest`` keep at their first option) are within ``target``. Each partial choice is dropped where another keeps
    no more bytes for no more cost, or keeps bytes in the same bucket (:data:`RESOLUTION` of the target) for less
    (dynamic programming over the rows). A whole choice fits where ``outside`` (the peak outside every row, less all
    rows' bytes kept) and every row's bytes kept are within ``target``. Then each row of ``rest`` (without a backward
    window) takes its cheapest option whose ``own`` and every other row's bytes kept are within ``target`` (its first
    where it has no figure).

    Examples:
        >>> block = [Option("none", 100, 150, 1.0), Option("full", 10, 60, 2.0)]  # checkpointing one block
        >>> solve([block, block], [], [], outside=50, target=400)  # everything fits: nothing recomputed
        (2.0, ['none', 'none'], [])
        >>> solve([block, block], [], [], outside=50, target=240)  # the second's window, 150, and the first's 100: over
        (3.0, ['full', 'none'], [])
        >>> solve([block, block], [], [], outside=50, target=100)  # the second's window, 60, and the first's 10
        (4.0, ['full', 'full'], [])
        >>> solve([block, block], [], [], outside=50, target=60) is None
        True
    """
    quantum = max(1, int(target * RESOLUTION))
    # a partial choice: (bytes kept, cost, its settings as a chain (setting, the chain before))
    front: list[tuple[int, float, Any]] = [(sum(rest_kept), 0.0, None)]
    for options in rows:
        buckets: dict[int, tuple[int, float, Any]] = {}
        for option in options:
            for kept, cost, chain in front:
                if option.own is not None and option.own + kept > target:
                    continue
                grown = (kept + option.kept, cost + option.cost, (option.setting, chain))
                bucket = grown[0] // quantum
                held = buckets.get(bucket)
                if held is None or (grown[1], grown[0]) < (held[1], held[0]):
                    buckets[bucket] = grown
        front = []
        for partial in sorted(buckets.values(), key=lambda p: (p[0], p[1])):
            if not front or partial[1] < front[-1][1]:
                front.append(partial)
    best = None
    for kept, cost, chain in front:
        picks = [_fits(options, kept - first, target) for options, first in zip(rest, rest_kept, strict=True)]
        if outside + kept > target or any(pick is None for pick in picks):
            continue
        total = cost + sum(pick.cost for pick in picks)  # type: ignore[union-attr]
        if best is None or total < best[0]:
            best = (total, _unchain(chain), [pick.setting for pick in picks])  # type: ignore[union-attr]
    return best


def _unchain(chain: Any) -> list[Hashable]:
    settings = []
    while chain is not None:
        setting, chain = chain
        settings.append(setting)
    return settings[::-1]


def solve_many(
    rows: list[list[Option]], rest: list[list[Option]], rest_kept: list[int], outside: int, targets: list[int]
) -> list[tuple[float, list[Hashable], list[Hashable]] | None]:
    """:func:`solve` for each of ``targets`` (the targets of the whole step's mixes, each raised by what it saves).

    The least cost is the same or less for a larger target, and a choice that fits a target fits every larger one:
    where the choices for two targets cost the same, so does every target between them, and the lower one's choice is
    theirs. So the targets, each taken down to one of :data:`LEVELS` levels, are solved in order by halving, only where
    the costs at the ends differ: at most :data:`LEVELS` solves, however many targets.

    Examples:
        >>> block = [Option("none", 100, 150, 1.0), Option("full", 10, 60, 2.0)]
        >>> [s[0] if s else None for s in solve_many([block, block], [], [], 50, [60, 100, 240, 400])]
        [None, 4.0, 3.0, 2.0]
    """
    low, high = min(targets, default=0), max(targets, default=0)
    step = max(1, -(-(high - low) // LEVELS))
    level = {t: low + (t - low) // step * step for t in targets}
    order = sorted(set(level.values()))
    solved: dict[int, tuple[float, list[Hashable], list[Hashable]] | None] = {}

    def at(index: int) -> tuple[float, list[Hashable], list[Hashable]] | None:
        if order[index] not in solved:
            solved[order[index]] = solve(rows, rest, rest_kept, outside, order[index])
        return solved[order[index]]

    def fill(low: int, high: int) -> None:
        if high - low <= 1:
            return
        ends = at(low), at(high)
        if ends[1] is None or (ends[0] is not None and ends[0][0] == ends[1][0]):  # the same choice between
            for index in range(low + 1, high):
                solved[order[index]] = ends[0]
            return
        middle = (low + high) // 2
        at(middle)
        fill(low, middle)
        fill(middle, high)

    if order:
        at(0), at(len(order) - 1)
        fill(0, len(order) - 1)
    return [solved[level[t]] for t in targets]


def _fits(options: list[Option], others: int, target: int) -> Option | None:
    """The cheapest of a row's options (without a backward window) whose own peak with ``others`` bytes kept by the
    other rows is within ``target``; its first where it never ran forward; ``None`` where none is."""
    if options[0].own is None:
        return options[0]
    fits = [o for o in options if o.own is not None and o.own + others <= target]
    return min(fits, key=lambda o: o.cost, default=None)


def _no_cost(row: int, setting: Hashable) -> float:
    return 0.0


@dataclass
class Table:
    """The cost table: ``first``, the run with every row at its first setting; per row and setting, the run that
    measured it; and the runs that checked mixes, with their settings. Each run gives, per row, its peak less what
    the rows before it kept (:meth:`Run.own`); where runs differ, the highest is taken, so a mix found over the target
    makes the next choice more careful. ``extra`` gives the seconds a row's setting adds beyond its predicted time (its
    knobs' ``cost``)."""

    first: Run
    measured: dict[tuple[int, Hashable], Run]
    checked: list[tuple[list[Hashable], Run]] = field(default_factory=list)
    extra: Callable[[int, Hashable], float] = _no_cost

    @property
    def order(self) -> list[int]:
        """The rows with a backward window, in forward order (the reverse of their windows)."""
        return list(reversed(self.first.order))

    def kept(self, row: int, setting: Hashable) -> int:
        return self.measured[(row, setting)].kept[row]

    def cost(self, row: int, setting: Hashable) -> float:
        """The row's predicted time at ``setting`` (its forward pass and its backward window, recomputation
        included, in the run that measured it), and what its knobs add."""
        return self.measured[(row, setting)].seconds[row] + self.extra(row, setting)

    def _own(self, row: int, setting: Hashable, earlier: list[int]) -> int | None:
        samples = [self.measured[(row, setting)], *(run for settings, run in self.checked if settings[row] == setting)]
        values = [value for run in samples if (value := run.own(row, earlier)) is not None]
        return max(values) if values else None

    def _outside(self) -> int:
        runs = {id(run): run for run in [self.first, *self.measured.values(), *(run for _, run in self.checked)]}
        return max(run.outside() for run in runs.values())

    def peak(self, settings: list[Hashable]) -> int:
        """The modelled peak of a mix (see the module's docstring)."""
        kept = [self.kept(i, s) for i, s in enumerate(settings)]
        order, rest = self.order, self.first.rest()
        peak = self._outside() + sum(kept)
        for position, row in enumerate(order):
            earlier = order[:position] + rest  # they still hold what they kept
            own = self._own(row, settings[row], earlier)
            if own is not None:
                peak = max(peak, own + sum(kept[i] for i in earlier))
        for row in rest:
            own = self._own(row, settings[row], self._others(row))
            if own is not None:
                peak = max(peak, own + sum(kept) - kept[row])
        return peak

    def floor(self, allowed: list[list[Hashable]]) -> int:
        """The lowest peak the table models for rows without a backward window: each at its allowed setting with
        the lowest forward peak."""

        def own(row: int, setting: Hashable) -> int:
            value = self._own(row, setting, self._others(row))
            return value if value is not None else 0

        return self.peak([min(settings, key=functools.partial(own, i)) for i, settings in enumerate(allowed)])

    def _others(self, row: int) -> list[int]:
        """The rows but ``row``: a row without a backward window is taken with every other's bytes kept alive."""
        return [i for i in range(len(self.first.kept)) if i != row]

    def cheapest(self, target: int, allowed: list[list[Hashable]]) -> list[Hashable] | None:
        """The mix with the least cost whose modelled peak is within ``target`` (``None``: none is), ``allowed``
        giving each row's settings (the first of each is the one that changes nothing)."""
        return self.cheapest_many([target], allowed)[0]

    def cheapest_many(self, targets: list[int], allowed: list[list[Hashable]]) -> list[list[Hashable] | None]:
        """:meth:`cheapest` for each of ``targets``: the table's figures as :func:`solve_many`'s options, built once."""
        order, rest = self.order, self.first.rest()

        def options(row: int, earlier: list[int]) -> list[Option]:
            return [Option(s, self.kept(row, s), self._own(row, s, earlier), self.cost(row, s)) for s in allowed[row]]

        rows = [options(row, order[:position] + rest) for position, row in enumerate(order)]
        alone = [options(row, self._others(row)) for row in rest]
        found = []
        for solved in solve_many(rows, alone, [self.first.kept[row] for row in rest], self._outside(), targets):
            if solved is None:
                found.append(None)
                continue
            settings = dict(zip(order, solved[1], strict=True)) | dict(zip(rest, solved[2], strict=True))
            found.append([settings.get(i, allowed[i][0]) for i in range(len(allowed))])
        return found


@dataclass
class Outcome:
    """What :func:`choose` did (the settings chosen are in force afterwards): the knobs it set; the peak the dry run
    with its choice gave (``None``: the step could not be traced, and every knob is as it was), the FLOPs recomputed
    with it and the forward pass's, its cost (the step's predicted time with it, :mod:`~lightning_memopt.timing`, and
    what the knobs add; ``predicted_s`` the step's alone), whether it met the target, the time the dry runs took, the
    device's speeds, notes, and whether a dry run gave placeholders for values the step read."""

    knobs: list[Knob] = field(default_factory=list)
    peak_bytes: int | None = None
    recompute_flops: int | None = None
    forward_flops: int | None = None
    cost: float | None = None
    predicted_s: float | None = None
    speed: Speed | None = None
    target: int | None = None
    met: bool = False
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    placeholders: bool = False
    model: Callable[[list[Knob]], int | None] | None = None  # see saved()
    policed: int = 0  # ops the choice routes through a selective policy's dispatch mode (see fastest())
    ranked: bool = False  # the predicted time chose among several mixes that met the target
    baseline: Any = None  # a loop's first dry run, where nothing of the stage was in force (the step as given)
    part: str | None = None  # in a loop, the part of the model that holds the peak with the choice
    part_without: str | None = None  # and in the baseline

    def saved(self, knobs: list[Knob]) -> int | None:
        """The bytes the settings of ``knobs`` in force save, as the cost table models it: the modelled peak with
        those knobs at their first setting (the rest as they are), less the modelled peak as things are; ``None``
        where that is nothing, or the table has no figures for it."""
        saved = self.model(knobs) if self.model is not None and self.chose(knobs) else None
        return saved if saved else None  # nothing saved: no figure

    def chose(self, knobs: list[Knob]) -> bool:
        """Whether these knobs were among those it set (after a step it could trace)."""
        return self.peak_bytes is not None and any(k is mine for k in knobs for mine in self.knobs)

    @property
    def recompute_fraction(self) -> float | None:
        if self.recompute_flops is None or not self.forward_flops:
            return None
        return self.recompute_flops / self.forward_flops


def _distinct(rows: list[Row]) -> list[tuple[Hashable, ...]]:
    """Every setting any row has, each row's in its own order."""
    seen: dict[tuple[Hashable, ...], None] = {}
    for position in range(max((len(row.settings) for row in rows), default=0)):
        for row in rows:
            settings = row.settings
            if position < len(settings):
                seen.setdefault(settings[position], None)
    return list(seen)


def choose(planning: Planning, knobs: list[Knob], budget: int | None) -> Outcome:
    """Put every knob's setting in force from dry runs of the batch as a later step would run it: the mix with the
    least cost whose peak meets ``budget`` or, without one, is within :data:`SLACK` of the peak with every knob at its
    reference (see the module's docstring); settings that change results (``Knob.lossy``) only under ``budget``,
    where the stage allows them and they are faster than every mix that keeps results (a replayed row's: where no such
    mix meets it). Where the step cannot be traced, every knob stays as it was."""
    steps = [k for k in knobs if k.of_the_step]
    rows = rows_of([k for k in knobs if not k.of_the_step])
    search = _Search(planning, rows, steps, budget, Outcome(knobs=list(knobs), speed=speed(planning.device)))
    outcome = search.outcome
    settled = ([row.get() for row in rows], tuple(k.get() for k in steps))
    table = search.table = _measure(rows, search.run, budget if search.loops else None)
    reference = None
    if table is not None:
        # a row whose reference was not worth a run (it would change nothing) is taken at its first setting
        references = [r.reference if (i, r.reference) in table.measured else r.settings[0] for i, r in enumerate(rows)]
        reference = search.ran(references)
    if table is None or reference is None or reference.peak is None or not search.measure_steps():
        search.put(settled)
        return outcome
    table.extra = lambda i, setting: rows[i].cost(setting)
    search.target = budget if budget is not None else int(reference.peak * (1 + SLACK))
    outcome.target, outcome.forward_flops = search.target, table.first.forward_flops
    fits = search.mixes(lossy=False)
    if budget is not None and planning.lossy and search.lossy_steps():  # measured already: they compete on time
        fits += search.mixes(lossy=True)
    if not fits and budget is not None and any(r.lossy(s) for r in rows for s in r.settings):
        fits = search.lossy_mixes()
    best = fastest(fits, outcome.speed.policy_op_s)
    outcome.ranked = len({(tuple(s), t) for _, (s, t), _ in fits}) > 1
    if best is None:
        best = search.lowest()
    cost, mix, ran = best
    search.put(mix)
    outcome.model = lambda knobs: _saved(table, rows, knobs)
    outcome.peak_bytes, outcome.recompute_flops, outcome.cost = ran.peak, ran.recomputed_total, cost
    outcome.predicted_s, outcome.policed, outcome.part = ran.predicted_s, ran.policed, ran.part
    outcome.met = ran.peak is not None and ran.peak <= search.target
    return outcome


#: A mix: each row's setting, and each knob of the whole step's.
Mix = tuple[list[Hashable], tuple[Hashable, ...]]


class _Search:
    """One :func:`choose`: the rows and the knobs of the whole step (``steps``), every dry run made (a mix run is not
    run again), the cost table, what each step knob's settings save and add (:attr:`step_figures`) and the target,
    and the :class:`Outcome` it fills."""

    def __init__(
        self, planning: Planning, rows: list[Row], steps: list[Knob], budget: int | None, outcome: Outcome
    ) -> None:
        self.planning, self.rows, self.steps, self.budget, self.outcome = planning, rows, steps, budget, outcome
        self.runs: list[tuple[Mix, Run]] = []
        self.loops = planning.stage != "fit"  # a step without gradients: its forward passes are watched
        self.table: Table | None = None
        self.target = 0
        #: per step knob (by position), per setting: the bytes it saves on the step's peak and the seconds it adds
        self.step_figures: dict[tuple[int, Hashable], tuple[int, float]] = {}
        #: the step knobs' mixes a dry run could not trace (two settings that do not go together): never chosen, nor
        #: those with the same switches on (:meth:`_clashes`)
        self.broken: set[tuple[Hashable, ...]] = set()

    @property
    def off(self) -> tuple[Hashable, ...]:
        """Every step knob at its first setting."""
        return tuple(k.settings[0] for k in self.steps)

    def put(self, mix: Mix) -> None:
        for row, setting in zip(self.rows, mix[0], strict=True):
            row.set(setting)
        for knob, setting in zip(self.steps, mix[1], strict=True):
            knob.set(setting)

    def run(
        self, settings: list[Hashable], replay: str | None = None, steps: tuple[Hashable, ...] | None = None
    ) -> Run:
        """A dry run with ``settings`` in force and the step knobs at ``steps`` (their first settings where ``None``;
        ``replay``: which of the rows' replays it makes)."""
        outcome, planning = self.outcome, self.planning
        steps = self.off if steps is None else steps
        self.put((settings, steps))
        # a loop's first run, with nothing of the stage in force, is its step as the user gave it (a fit's is a later
        # step's, with last step's gradients)
        baseline = self.loops and outcome.baseline is None and not planning.changed()

        def watch(probe: CPUProbe) -> Any:
            return BlockRecorder(
                self.rows, probe, outcome.speed, self.loops, replay, self.budget, planning.module
            ).watching()

        dry = planning.run(watch, steady=True, what=_described(settings, self.steps, steps))
        outcome.seconds += dry.seconds
        together = [f"{k.name}={s!r}" for k, s in zip(self.steps, steps, strict=True) if s != k.settings[0]]
        if dry.note and dry.peak_bytes is None and len(together) > 1:  # the planner leaves that mix out, goes on
            outcome.notes.append(f"{' with '.join(together)} could not be dry-run together ({dry.note}): left out")
        elif dry.note:
            outcome.notes.append(dry.note)
        outcome.placeholders |= bool(dry.placeholders)
        ran = Run.of(dry)
        self.runs.append(((list(settings), steps), ran))
        if baseline:
            outcome.baseline, outcome.part_without = dry, ran.part
        return ran

    def ran(self, settings: list[Hashable], steps: tuple[Hashable, ...] | None = None) -> Run:
        """The run of a mix: one made already, or a new one."""
        mix = (settings, self.off if steps is None else steps)
        return next((r for m, r in self.runs if m == mix), None) or self.run(*mix[:1], steps=mix[1])

    def measure_steps(self) -> bool:
        """What each step knob's settings save on the step's peak and add to its time, each alone with every row at
        its first setting: from the knob's ``estimate``, else a dry run against the table's first (a setting whose run
        could not be traced has no figures, and is never chosen); ``False`` where the table's first has no peak."""
        assert self.table is not None
        first, plain = self.table.first, [row.settings[0] for row in self.rows]
        for k, knob in enumerate(self.steps):
            self.step_figures[(k, knob.settings[0])] = (0, 0.0)
            for setting in knob.settings[1:]:
                if knob.estimate is not None:
                    self.step_figures[(k, setting)] = knob.estimate(setting)
                    continue
                steps = tuple(setting if j == k else s for j, s in enumerate(self.off))
                ran = self.ran(plain, steps)
                if first.peak is None:
                    return False
                if ran.peak is None:
                    continue
                seconds = (ran.predicted_s or 0.0) - (first.predicted_s or 0.0)
                self.step_figures[(k, setting)] = (first.peak - ran.peak, seconds)
        return True

    def lossy_steps(self) -> bool:
        return any(k.lossy(s) for k in self.steps for s in k.settings)

    def step_mixes(self, lossy: bool) -> list[tuple[tuple[Hashable, ...], int, float]]:
        """Every mix of the step knobs' settings (those that change results where ``lossy``): its settings, the bytes
        it saves (the sum of each knob's alone) and the seconds it adds (with the knobs' ``cost``)."""
        mixes = []
        for steps in itertools.product(*(k.settings for k in self.steps)):
            if not lossy and any(k.lossy(s) for k, s in zip(self.steps, steps, strict=True)):
                continue
            named = {k.name: s for k, s in zip(self.steps, steps, strict=True)}
            if not all(k.goes_with(s, named) for k, s in zip(self.steps, steps, strict=True)):
                continue
            if any((k, s) not in self.step_figures for k, s in enumerate(steps)) or any(
                self._clashes(steps, broken) for broken in self.broken
            ):
                continue
            figures = [self.step_figures[(k, s)] for k, s in enumerate(steps)]
            seconds = sum(f[1] for f in figures) + sum(k.cost(s) for k, s in zip(self.steps, steps, strict=True))
            mixes.append((steps, sum(f[0] for f in figures), seconds))
        return mixes

    def _clashes(self, steps: tuple[Hashable, ...], broken: tuple[Hashable, ...]) -> bool:
        """Whether ``steps`` holds what made ``broken`` fail to trace: the same switches on (the knobs of three
        settings or fewer, which a failure is put on), whatever the knobs of more settings (how many layers) are."""
        switches = [k for k, knob in enumerate(self.steps) if len(knob.settings) <= 3]
        on = [k for k in switches if broken[k] != self.steps[k].settings[0]]
        if not on:
            return steps == broken
        return all(steps[k] == broken[k] for k in on)

    def total(self, mix: Mix, ran: Run) -> float:
        settings, steps = mix
        return (
            (ran.predicted_s or 0.0)
            + sum(row.cost(s) for row, s in zip(self.rows, settings, strict=True))
            + sum(knob.cost(s) for knob, s in zip(self.steps, steps, strict=True))
        )

    def keeps_results(self, mix: Mix) -> bool:
        settings, steps = mix
        return not any(map(Row.lossy, self.rows, settings)) and not any(
            k.lossy(s) for k, s in zip(self.steps, steps, strict=True)
        )

    def cheapest(self, aim: int, allowed: list[list[Hashable]], lossy: bool) -> Mix | None:
        """The mix the table and the step knobs' figures model cheapest within ``aim``: for each mix of the step
        knobs, the rows' cheapest within ``aim`` raised by what it saves, priced with what it adds."""
        table, best = self.table, None
        assert table is not None
        mixes = self.step_mixes(lossy)
        found = table.cheapest_many([aim + saved for _, saved, _ in mixes], allowed)
        for (steps, _, seconds), settings in zip(mixes, found, strict=True):
            if settings is not None:
                cost = sum(table.cost(i, s) for i, s in enumerate(settings)) + seconds
                if best is None or cost < best[0]:
                    best = (cost, (settings, steps))
        return None if best is None else best[1]

    def mixes(self, lossy: bool) -> list[tuple[float, Mix, Run]]:
        """Check the cheapest mixes the table models (those that change results where ``lossy``), and give every mix
        dry-run that met the target."""
        table, rows, target = self.table, self.rows, self.target
        assert table is not None
        allowed = [
            [s for s in row.settings if (i, s) in table.measured and (lossy or not row.lossy(s))]
            for i, row in enumerate(rows)
        ]
        allowed_first = ([settings[0] for settings in allowed], self.off)
        aim, tried = target, []
        for _ in range(CHECKS):
            mix = self.cheapest(aim, allowed, lossy)
            if mix is None and not tried and not table.order:  # none fits: the cheapest at the lowest modelled
                aim = table.floor(allowed)
                mix = self.cheapest(aim, allowed, lossy)
            if mix is None or mix in tried:
                break
            tried.append(mix)
            checked = self.ran(*mix)
            if checked.peak is None and mix[1] != self.off:  # those step settings do not go together: others may
                self.broken.add(mix[1])
                continue
            if checked.peak is None:
                break
            if mix[1] == self.off:  # a check with a step knob on is not the rows' own figures
                table.checked.append((mix[0], checked))
            if checked.peak > target:  # the model was low: aim lower by the miss
                aim -= checked.peak - target
                continue
            if mix == allowed_first or target - checked.peak <= 0.005 * target:  # nothing cheaper, or no room
                break
            aim += target - checked.peak  # the model was high: a cheaper mix may fit the room left
        # every dry run, checks included, is a mix: one the table modelled dearer may be the fastest that fits
        return [
            (self.total(m, ran), m, ran)
            for m, ran in self.runs
            if ran.peak is not None and ran.peak <= target and (lossy or self.keeps_results(m))
        ]

    def lossy_mixes(self) -> list[tuple[float, Mix, Run]]:
        """No mix that keeps results meets the budget: the rows' settings that change them are replayed (only now,
        and as far as needed) and checked; they are the choice where the stage allows them, else a note says what
        they would reach."""
        table, rows, outcome = self.table, self.rows, self.outcome
        assert table is not None
        lossy = self.run([row.settings[0] for row in rows], "lossy")
        if lossy.peak is not None:
            alone = enumerate(lossy.alone)
            table.measured.update(
                {(i, s): lossy.replayed(i, s) for i, found in alone for s in found if rows[i].lossy(s)}
            )
        changing = self.mixes(lossy=True)
        if self.planning.lossy:
            return changing
        if (would := fastest(changing, outcome.speed.policy_op_s)) is not None:  # said, not chosen (lossy=True)
            reach = fmt_sizes(would[2].peak)[0]
            where = ", ".join(dict.fromkeys(r.knobs[0].name for r in rows if any(map(r.lossy, r.settings))))
            outcome.notes.append(
                f"the budget of {fmt_sizes(self.target)[0]} is met only by settings that change results ({where}: "
                f"{reach}); pass lossy=True to allow them"
            )
        return []

    def lowest(self) -> tuple[float, Mix, Run]:
        """No mix met the target: the run with the lowest peak, of those that keep results unless the stage allows
        otherwise, and a note that says so. The step knobs are tried at what saves most with the rows as in the
        lowest run without them."""
        lossy = self.planning.lossy

        def kept() -> list[tuple[Mix, Run]]:
            return [r for r in self.runs if r[1].peak is not None and (lossy or self.keeps_results(r[0]))]

        lowest = min(kept(), key=lambda r: (r[1].peak, self.total(*r)))
        usable = sorted(self.step_mixes(lossy), key=lambda u: -u[1])
        tries = 0
        for steps, _, _ in usable:  # what saves most, or the next where a dry run cannot trace it
            if any(self._clashes(steps, broken) for broken in self.broken):
                continue
            if tries == CHECKS or steps == lowest[0][1] or self.ran(lowest[0][0], steps).peak is not None:
                break
            tries += 1
            self.broken.add(steps)
        lowest = min(kept(), key=lambda r: (r[1].peak, self.total(*r)))
        budget_words, least = fmt_sizes(self.target, lowest[1].peak)
        if lowest[1].peak > self.target:  # a mix of the step knobs tried here may have met it
            self.outcome.notes.append(
                f"the budget of {budget_words} is not met even with the settings that hold the least memory ({least})"
            )
        return (self.total(*lowest), *lowest)


def _described(settings: list[Hashable], steps: list[Knob], at: tuple[Hashable, ...]) -> str:
    """A mix in a few words, for the progress bar: how many rows at each setting, and the step knobs not off.

    Examples:
        >>> _described([], [], ())
        'the step as it is'
    """
    words = [f"{n} at {setting}" for setting, n in Counter(map(_setting, settings)).items()]
    words += [f"{k.name}={s!r}" for k, s in zip(steps, at, strict=True) if s != k.settings[0]]
    return ", ".join(words) or "the step as it is"


def _setting(setting: Hashable) -> str:
    return "/".join(map(str, setting)) if isinstance(setting, tuple) else str(setting)


def fastest(fits: list[tuple[float, Any, Run]], policy_op_s: float) -> tuple[float, Any, Run] | None:
    """Of ``(cost, settings, run)`` mixes that fit, the one with the least cost once the ops each routes through a
    selective policy are priced :data:`DOUBT` times more at ``policy_op_s`` each; ``None`` where there is none.

    Examples:
        >>> fits = [(1.00, "selective", Run(0, policed=900)), (1.01, "full", Run(0)), (1.05, "none", Run(0))]
        >>> fastest(fits, policy_op_s=1e-5)[1]  # 900 ops at 10 us: 9 ms, less than the 10 ms it is predicted to save
        'selective'
        >>> fastest(fits, policy_op_s=2e-5)[1]  # at 20 us, 18 ms: more than it saves
        'full'
    """
    return min(fits, key=lambda f: f[0] + DOUBT * f[2].policed * policy_op_s, default=None)


def _measure(rows: list[Row], run: Callable[..., Run], enough: int | None = None) -> Table | None:
    """The cost table: a run with every row at its first setting, then one per setting any row has (see the module's
    docstring); ``None`` where a run could not be traced. Where rows are filled by replays and the step as it is may
    hold no more than ``enough`` (a loop's budget), a run without replays comes first, and is the table if it does."""
    if enough is not None and any(row.replays for row in rows):
        plain = run([row.settings[0] for row in rows])
        if plain.peak is None or plain.peak <= enough:
            return None if plain.peak is None else Table(plain, {(i, r.settings[0]): plain for i, r in enumerate(rows)})
    first = run([row.settings[0] for row in rows], "exact")
    if first.peak is None:
        return None
    measured = {(i, row.settings[0]): first for i, row in enumerate(rows)}
    for i, row in enumerate(rows):  # a row filled by replays: each setting replayed in the first run
        measured.update({(i, s): first.replayed(i, s) for s in first.alone[i] if s != row.settings[0]})
    tried = [{row.settings[0]: _figures(first, i)} for i, row in enumerate(rows)]
    for setting in _distinct([row for row in rows if not row.replays]):
        taken = [
            i
            for i, row in enumerate(rows)
            if not row.replays
            and setting in row.settings
            and (i, setting) not in measured
            and row.worth(setting, tried[i])
        ]
        if not taken:
            continue
        ran = run([setting if i in taken else row.reference for i, row in enumerate(rows)])
        if ran.peak is None:
            return None
        for i in taken:
            measured[(i, setting)] = ran
            tried[i][setting] = _figures(ran, i)
    return Table(first, measured)


def _saved(table: Table, rows: list[Row], knobs: list[Knob]) -> int | None:
    """See :meth:`Outcome.saved`."""
    now = [row.get() for row in rows]
    off = [
        tuple(k.settings[0] if any(k is o for o in knobs) else v for k, v in zip(row.knobs, setting, strict=True))
        for row, setting in zip(rows, now, strict=True)
    ]
    if any((i, s) not in table.measured for settings in (now, off) for i, s in enumerate(settings)):
        return None
    return table.peak(off) - table.peak(now)


def _figures(run: Run, row: int) -> Figures:
    return Figures(run.kept[row], run.recomputed[row], run.attention[row] if run.attention else 0)
