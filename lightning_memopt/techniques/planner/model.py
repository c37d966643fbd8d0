"""The planner's model, pure: the figures of the dry runs (:class:`Run`), the cost table built from them
(:class:`Table`) and the solver (:func:`solve`, :func:`solve_many`) over plain options. Nothing here runs a module or a
dry run."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class Alone(NamedTuple):
    """A unit run alone at one setting, on its first call's inputs: its forward pass's peak above the bytes alive
    when it started, and the seconds predicted for it; at fit, where its backward pass runs too, the bytes its forward
    pass left alive, its backward pass's peak (above the same), the FLOPs it recomputed, those in fused attention
    kernels, and the ops it routed through a selective policy."""

    peak: int
    seconds: float
    kept: int = 0
    window: int | None = None
    recomputed: int = 0
    attention: int = 0
    policed: int = 0


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
    alone: list[dict[Hashable, Alone]] = field(default_factory=list)
    part: str | None = None  # the part of the model holding the peak, where a timeline was kept

    @classmethod
    def of(cls, dry: Any) -> Run:
        """The figures of a dry run watched by a :class:`BlockRecorder`."""
        recorder: Any = dry.watched  # a BlockRecorder
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
        """This run as it would have been with ``unit`` (replayed) at ``setting``: each of its figures moved, in each
        of its calls, by what running it alone at ``setting`` rather than at its setting here (the first it replayed)
        changed; the peak between the forward and backward passes by what it keeps."""
        there, here = self.alone[unit][setting], next(iter(self.alone[unit].values()))
        calls = self.calls[unit]
        forward, window, kept, times = list(self.forward), list(self.window), list(self.kept), list(self.seconds)
        recomputed, attention = list(self.recomputed), list(self.attention)
        if forward[unit] is not None:
            forward[unit] += there.peak - here.peak
        if window[unit] is not None and there.window is not None and here.window is not None:
            window[unit] += there.window - here.window
        more = calls * (there.kept - here.kept)
        kept[unit] += more
        times[unit] += calls * (there.seconds - here.seconds)
        again = calls * (there.recomputed - here.recomputed)
        fused = calls * (there.attention - here.attention)
        recomputed[unit] += again
        if attention:
            attention[unit] += fused
        predicted = None if self.predicted_s is None else self.predicted_s + times[unit] - self.seconds[unit]
        return dataclasses.replace(
            self,
            forward=forward,
            window=window,
            kept=kept,
            before=self.before + more if self.order else self.before,
            seconds=times,
            predicted_s=predicted,
            recomputed=recomputed,
            recomputed_total=self.recomputed_total + again,
            attention=attention,
            recomputed_attention=self.recomputed_attention + fused,
            policed=self.policed + calls * (there.policed - here.policed),
        )

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
