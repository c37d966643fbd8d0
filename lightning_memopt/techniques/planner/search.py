"""The planner's search, the only part that runs dry runs: the rows of knobs, the cost table measured
(:func:`_measure`), the mixes checked, and :func:`choose`, which puts the settings in force."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_memopt.memory import CPUProbe
from lightning_memopt.techniques.base import Knob, Planning
from lightning_memopt.techniques.planner.measured import BlockRecorder
from lightning_memopt.techniques.planner.model import Figures, Run, Table
from lightning_memopt.timing import Speed, speed
from lightning_memopt.units import Recomputed

#: Without a budget, the planner takes the cheapest mix within this fraction above the peak with every knob at its
#: reference setting.
SLACK = 0.05
#: Dry runs that check a mix chosen from the table, at most.
CHECKS = 4
#: A check of a mix whose dry run is further than this fraction from the peak the table modelled shows the table's
#: figures off (rows measured alone may not see what the step around them does): they are measured again in the
#: whole step where no mix met the target.
MISS = 0.01
#: The mixes dry-run are ranked by their predicted time plus this many times more the price of the ops they route
#: through a selective policy's Python dispatch mode (``Speed.policy_op_s`` each): the part of the time model most at
#: the mercy of the host, so a mix with more of them must be predicted faster by more than they cost.
DOUBT = 1.0


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

    @property
    def alone_at_fit(self) -> bool:
        """Whether, at fit, its settings are measured by running its module alone, forward and backward, in the
        table's first dry run (each kind of module once), rather than by a dry run of the whole step per setting:
        where it has settings to choose among, none of them changing results."""
        return not self.replays and len(self.settings) > 1 and not any(map(self.lossy, self.settings))

    def discover(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[tuple[Hashable, ...]], Any]:
        """Its knob's settings and reference for a call's inputs (see ``Knob.replay``), as the row's."""
        assert self.knobs[0].replay is not None
        settings, reference = self.knobs[0].replay(args, kwargs)
        return [(s,) for s in settings], (reference,)

    def lossy(self, setting: tuple[Hashable, ...]) -> bool:
        return any(knob.lossy(value) for knob, value in zip(self.knobs, setting, strict=True))

    def shown_alone(self, setting: tuple[Hashable, ...]) -> bool:
        """Whether running the module alone shows what ``setting`` does (every knob's :attr:`Knob.alone`)."""
        return all(knob.alone(value) for knob, value in zip(self.knobs, setting, strict=True))

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


@dataclass
class Outcome(Recomputed):
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
    #: for the stage to say: the step knobs' settings that could not be dry-run together (in words) and why; where
    #: only settings that change results meet the budget and the stage does not allow them, the techniques' names and
    #: the peak they reach; where no mix met the target, the lowest peak found
    left_out: list[tuple[str, str]] = field(default_factory=list)
    lossy_reach: tuple[str, int] | None = None
    least: int | None = None
    #: per knob of the whole step it put at a setting other than its first, by name: the bytes that setting saves on
    #: the step's peak as the planner models it (measured with every row at its first setting, or the knob's estimate)
    step_saved: dict[str, int] = field(default_factory=dict)

    def saved(self, knobs: list[Knob]) -> int | None:
        """The bytes the settings of ``knobs`` in force save, as the cost table models it: the modelled peak with
        those knobs at their first setting (the rest as they are), less the modelled peak as things are; ``None``
        where that is nothing, or the table has no figures for it."""
        saved = self.model(knobs) if self.model is not None and self.chose(knobs) else None
        return saved if saved else None  # nothing saved: no figure

    def chose(self, knobs: list[Knob]) -> bool:
        """Whether these knobs were among those it set (after a step it could trace)."""
        return self.peak_bytes is not None and any(k is mine for k in knobs for mine in self.knobs)


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
        if reference.peak is not None and references != [r.settings[0] for r in rows]:  # a check of the table too
            search.checks.append((table.peak(references), reference.peak))
    if table is None or reference is None or reference.peak is None or not search.measure_steps():
        search.put(settled)
        return outcome
    table.extra = lambda i, setting: rows[i].cost(setting)
    search.target = budget if budget is not None else int(reference.peak * (1 + SLACK))
    outcome.target, outcome.forward_flops = search.target, table.first.forward_flops
    fits = search.mixes(lossy=False)
    # the rows' figures from their modules run alone found no mix: the settings whose effect running alone does not
    # show measured in the whole step, and again; then, where the checks found the figures off, or the mix they model
    # lowest is off, every setting measured in the whole step, and again (where they agree, no mix of the rows meets
    # the target: the step knobs below may)
    if not fits and search.measure_unshown():
        fits = search.mixes(lossy=False)
    if not fits and search.missed() and search.measure_whole():
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
    outcome.step_saved = {
        k.name: search.step_figures[(i, s)][0]
        for i, (k, s) in enumerate(zip(steps, mix[1], strict=True))
        if s != k.settings[0] and (i, s) in search.step_figures
    }
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
        #: each check of a mix of the rows: the peak the table modelled for it, and the dry run's
        self.checks: list[tuple[int, int]] = []

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
            outcome.left_out.append((" with ".join(together), dry.note))
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

    def measure_unshown(self) -> bool:
        """The settings of the rows run alone whose effect that does not show (:meth:`Row.shown_alone`), measured by
        a dry run of the whole step each; whether there were any."""
        table = self.table
        assert table is not None
        which = [
            not row.replays and bool(table.first.alone[i]) and not all(map(row.shown_alone, row.settings))
            for i, row in enumerate(self.rows)
        ]
        return any(which) and _per_setting(self.rows, lambda settings: self.ran(settings), table, which)

    def measure_whole(self) -> bool:
        """The rows whose figures came from their module run alone at fit (:attr:`Row.alone_at_fit`) measured again
        by dry runs of the whole step, as the other rows are (what the bytes alive around a module do to its figures
        shows only there); whether there were any."""
        table, first = self.table, self.table.first if self.table is not None else None
        assert table is not None and first is not None
        again = [not row.replays and bool(first.alone[i]) for i, row in enumerate(self.rows)]
        if not any(again):
            return False
        table.measured = {  # those measured in the whole step already stay
            (i, s): r
            for (i, s), r in table.measured.items()
            if not again[i] or s == self.rows[i].settings[0] or not self.rows[i].shown_alone(s)
        }
        first.alone = [{} if again[i] else alone for i, alone in enumerate(first.alone)]
        return _per_setting(self.rows, lambda settings: self.ran(settings), table, again)

    def missed(self) -> bool:
        """Whether the table's model may be off: a check's dry run (the rows' references, a mix the table chose, and
        the mix it models lowest, run now) was more than :data:`MISS` away from the peak the table modelled for it."""
        if not self.checks or self._off():
            return True
        self.run_lowest_modelled()
        return self._off()

    def _off(self) -> bool:
        return any(abs(real - modelled) > MISS * real for modelled, real in self.checks)

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
            modelled = table.peak(mix[0]) if mix[1] == self.off else None
            checked = self.ran(*mix)
            if modelled is not None and checked.peak is not None:
                self.checks.append((modelled, checked.peak))
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
            where = ", ".join(dict.fromkeys(r.knobs[0].name for r in rows if any(map(r.lossy, r.settings))))
            outcome.lossy_reach = (where, would[2].peak)
        return []

    def run_lowest_modelled(self, levels: int = 32) -> None:
        """A dry run of the rows' mix the table models lowest (of those that keep results, unless the stage allows
        otherwise), where it models it below every run of the rows made so far: the start :meth:`lowest` tries the
        step knobs from. Found among ``levels`` targets up to the highest peak dry-run so far, with the least cost at
        the lowest target met."""
        table = self.table
        assert table is not None
        lossy = self.planning.lossy
        allowed = [
            [s for s in row.settings if (i, s) in table.measured and (lossy or not row.lossy(s))]
            for i, row in enumerate(self.rows)
        ]
        top = max((r.peak for _, r in self.runs if r.peak is not None), default=0)
        found = table.cheapest_many([top * k // levels for k in range(1, levels + 1)], allowed)
        mix = next((m for m in found if m is not None), None)
        lowest = min((r.peak for m, r in self.runs if m[1] == self.off and r.peak is not None), default=None)
        if mix is None or (lowest is not None and table.peak(mix) >= lowest):
            return  # a run made already is as low: the step knobs start from it
        ran = self.ran(mix)
        if ran.peak is not None:
            self.checks.append((table.peak(mix), ran.peak))

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
        if lowest[1].peak > self.target:  # a mix of the step knobs tried here may have met it
            self.outcome.least = lowest[1].peak
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
    """The cost table: a run with every row at its first setting, then one per setting any row not filled by replays
    has (see the module's docstring); ``None`` where a run could not be traced. Where rows are filled by replays and
    the step as it is may hold no more than ``enough`` (a loop's budget), a run without replays comes first, and is
    the table if it does."""
    if enough is not None and any(row.replays for row in rows):
        plain = run([row.settings[0] for row in rows])
        if plain.peak is None or plain.peak <= enough:
            return None if plain.peak is None else Table(plain, {(i, r.settings[0]): plain for i, r in enumerate(rows)})
    first = run([row.settings[0] for row in rows], "exact")
    if first.peak is None:
        return None
    measured = {(i, row.settings[0]): first for i, row in enumerate(rows)}
    for i, row in enumerate(rows):  # each setting replayed or run alone in the first run (where that shows it)
        measured.update({(i, s): first.replayed(i, s) for s in first.alone[i] if s != row.settings[0]})
    table = Table(first, measured)
    by_runs = [not row.replays and not first.alone[i] for i, row in enumerate(rows)]  # not filled by runs alone
    return table if _per_setting(rows, run, table, by_runs) else None


def _per_setting(rows: list[Row], run: Callable[..., Run], table: Table, which: list[bool]) -> bool:
    """Fill the table for the rows ``which`` marks by a dry run of the whole step per setting any of them has, each
    with every such row at it that finds it worth a run, the others at their reference; ``False`` where a run could
    not be traced."""
    first, measured = table.first, table.measured
    tried = [{row.settings[0]: _figures(first, i)} for i, row in enumerate(rows)]
    for setting in _distinct([row for i, row in enumerate(rows) if which[i]]):
        taken = [
            i
            for i, row in enumerate(rows)
            if which[i] and setting in row.settings and (i, setting) not in measured and row.worth(setting, tried[i])
        ]
        if not taken:
            continue
        ran = run([setting if i in taken else row.reference for i, row in enumerate(rows)])
        if ran.peak is None:
            return False
        for i in taken:
            measured[(i, setting)] = ran
            tried[i][setting] = _figures(ran, i)
    return True


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
