"""Choosing every block's chunking from a dry run, before a batch runs. Pure torch.

While a step runs on fake tensors (see :mod:`lightning_memopt.dryrun`), a :class:`ChunkRecorder` notes for each
chunked block the bytes live when it starts, and runs the block alone again on the same fake inputs at several chunk
settings to get its own peak at each. The step's peak for any settings is then
``max(rest, max over blocks of (live at start + the block's own peak))``, where ``rest`` is the peak outside every
block. :func:`plan_chunks` chooses from that; a second dry run with the choice checks it.

Replaying a block alone costs one call of it per setting, so each block kind is replayed at three settings only:
unchunked, its coarsest chunking, and its finest up to ``max_slices`` slices; the peaks of the others are predicted with
the model ``a + k / slices`` through the two chunked ones, and a dry run with the choice checks any prediction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_memopt.memory import CPUPeakTracker, CPUProbe
from lightning_memopt.techniques.chunking.core import ChunkUnit, Setting, candidates
from lightning_memopt.tuning import fit
from lightning_memopt.units import fmt_sizes


@dataclass
class BlockModel:
    """One chunked block in a dry run.

    Attributes:
        base: The bytes live when the block starts (the largest over its calls).
        own: The block's own peak above ``base``, per setting replayed.
        options: Every setting the block can take, coarsest (unchunked) first.
        inside: The block's peak in the dry run (``base`` included), at the settings it ran with.
    """

    base: int = 0
    own: dict[Setting, int] = field(default_factory=dict)
    options: list[Setting] = field(default_factory=list)
    inside: int = 0

    def peak(self, setting: Setting) -> int:
        """The step's peak while this block runs with ``setting``: measured, or predicted as ``a + k / slices``
        through the two finest settings measured."""
        if setting in self.own:
            return self.base + self.own[setting]
        finest = sorted(self.own.items(), key=lambda item: item[0].slices)[-2:]
        model = fit([(s.slices, p) for s, p in finest])
        if model is None:
            return self.base + min(self.own.values(), default=0)
        a, k = model
        return self.base + max(0, int(a + k / setting.slices))


def _shapes(value: Any) -> tuple[Any, ...]:
    leaves = value.values() if isinstance(value, dict) else value
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__ for t in leaves)


class ChunkRecorder:
    """Records every chunked block's :class:`BlockModel` while a dry run runs, on the probe that counts it.

    Args:
        chunking: The :class:`~lightning_memopt.techniques.chunking.Chunking` technique whose blocks are recorded
            (each unit with its ``module``); replays set a block's setting through it.
        probe: The running probe of the dry run.
        replay: Run each block alone at several settings (off: only record where each block starts and peaks).
        max_slices: Replay settings up to this many slices; finer ones are predicted.
        cache: Replayed figures per block kind and input shapes, shared by the dry runs of one choice.
    """

    def __init__(
        self,
        chunking: Any,
        probe: CPUProbe,
        replay: bool = True,
        max_slices: int = 16,
        cache: dict[tuple[Any, ...], tuple[dict[Setting, int], list[Setting]]] | None = None,
    ) -> None:
        self.chunking = chunking
        self.units = {id(u.module): u for u in chunking.units if u.module is not None}
        self.probe = probe
        self.replay = replay
        self.max_slices = max_slices
        self.blocks: dict[str, BlockModel] = {u.name: BlockModel() for u in self.units.values()}
        self.rest = 0
        self._replaying = False
        self._cache = cache if cache is not None else {}
        self._handles: list[Any] = []

    def __enter__(self) -> ChunkRecorder:
        for unit in self.units.values():
            assert unit.module is not None
            # first, before the block's own chunking hook: a replay leaves the library's chunk setting at its last
            # setting, and that hook must set it back for the call itself
            self._handles.append(unit.module.register_forward_pre_hook(self._enter, with_kwargs=True, prepend=True))
            self._handles.append(unit.module.register_forward_hook(self._leave))
        return self

    def __exit__(self, *args: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if args[0] is None:
            self.rest = max(self.rest, self.probe.segment())

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._replaying:
            return
        unit = self.units[id(module)]
        self.rest = max(self.rest, self.probe.segment())
        block = self.blocks[unit.name]
        block.base = max(block.base, self.probe.tracker.current)
        if self.replay and not block.own:
            self._replay(unit, module, args, kwargs, block)

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._replaying:
            block = self.blocks[self.units[id(module)].name]
            block.inside = max(block.inside, self.probe.segment())

    def _replay(self, unit: ChunkUnit, module: nn.Module, args: Any, kwargs: dict[str, Any], block: BlockModel) -> None:
        try:
            unit.lengths = {d: int(n) for d, n in unit.lengths_of(args, kwargs).items()}
        except (IndexError, KeyError, AttributeError, TypeError):
            unit.lengths = {}
        key = (type(module), unit.dims, unit.dim, tuple(sorted(unit.lengths.items())), _shapes(args), _shapes(kwargs))
        if key not in self._cache:
            options = [Setting(unit.dim, None, 1), *candidates(unit)]
            self._cache[key] = (self._measure(unit, module, args, kwargs, options), options)
        own, block.options = self._cache[key]
        block.own = dict(own)

    def _measure(
        self, unit: ChunkUnit, module: nn.Module, args: Any, kwargs: dict[str, Any], options: list[Setting]
    ) -> dict[Setting, int]:
        """The block's own peak unchunked, at its coarsest chunking, and at its finest up to ``max_slices`` slices."""
        outer = self.probe.tracker
        own: dict[Setting, int] = {}
        fine = [s for s in options[2:] if s.slices <= self.max_slices][-1:]
        self._replaying, outer.paused = True, True
        try:
            for setting in [*options[:2], *fine]:
                with self.chunking.trying(unit, setting), CPUPeakTracker(outer) as tracker:
                    module(*args, **kwargs)  # the output is dropped at once, as the next layer would drop its input
                own[setting] = tracker.peak
        finally:
            self._replaying, outer.paused = False, False
        return own


@dataclass
class ChunkPlan:
    """What :func:`plan_chunks` chose, and the peaks it expects (a dry run with the choice checks ``expected``)."""

    settings: dict[str, Setting]
    unchunked: int
    lowest: int
    expected: int
    target: int | None
    notes: list[str] = field(default_factory=list)


def _peak(blocks: dict[str, BlockModel], rest: int, settings: dict[str, Setting]) -> int:
    return max([rest, *(blocks[n].peak(s) for n, s in settings.items())])


def plan_chunks(blocks: dict[str, BlockModel], rest: int, budget: int | None, knee: float = 0.10) -> ChunkPlan:
    """Each block's coarsest setting that keeps the step's peak at the target.

    The target is ``budget`` when one is given. Without one it is the knee: the whole peak within ``knee`` (10%) of
    the lowest peak chunking reaches at the settings measured (a block's finer settings are predicted, and the
    prediction runs low where slices have costs of their own: a knee from it would chunk finer than it needs). Each
    block takes its coarsest setting that keeps the peak at the target, so no setting reaching the target makes fewer
    feed-forward calls; where the peak unchunked is already there, chunking stays off. Blocks that never ran keep no
    chunking.

    Examples:
        >>> block = BlockModel(base=100, own={Setting(1, None, 1): 400, Setting(1, 2, 2): 200, Setting(1, 1, 4): 100},
        ...                    options=[Setting(1, None, 1), Setting(1, 2, 2), Setting(1, 1, 4)])
        >>> plan = plan_chunks({"b": block}, rest=150, budget=350)
        >>> plan.settings["b"], plan.unchunked, plan.lowest, plan.expected
        (Setting(dim=1, size=2, slices=2), 500, 200, 300)
        >>> plan_chunks({"b": block}, rest=150, budget=None).settings["b"]  # 200 is lowest: 220 at most
        Setting(dim=1, size=1, slices=4)
    """
    ran = {n: b for n, b in blocks.items() if b.options and b.own}
    off = {n: b.options[0] for n, b in ran.items()}
    finest = {n: b.options[-1] for n, b in ran.items()}
    unchunked, lowest = _peak(ran, rest, off), _peak(ran, rest, finest)
    measured = _peak(ran, rest, {n: max(b.own, key=lambda s: s.slices) for n, b in ran.items()})
    notes: list[str] = []
    if budget is None and unchunked <= measured * (1 + knee):
        notes.append(
            f"chunking lowers the peak by {max(unchunked - measured, 0) / max(unchunked, 1):.1%} at most, and the peak"
            f" unchunked is within {knee:.0%} of the lowest: it is left off"
        )
        return ChunkPlan(off, unchunked, lowest, unchunked, None, notes)
    if budget is not None and budget < lowest:
        budget_words, lowest_words = fmt_sizes(budget, lowest)
        notes.append(
            f"the budget of {budget_words} is below the lowest peak chunking reaches ({lowest_words}): each block is"
            " chunked as finely as that peak needs"
        )
        budget = lowest
    target = budget if budget is not None else int(measured * (1 + knee))
    chosen = {n: next((s for s in b.options if b.peak(s) <= target), b.options[-1]) for n, b in ran.items()}
    return ChunkPlan(chosen, unchunked, lowest, _peak(ran, rest, chosen), target, notes)


def tighten(blocks: dict[str, BlockModel], settings: dict[str, Setting], target: int) -> dict[str, Setting] | None:
    """After a check over ``target``: one step finer for every block whose peak in the check was over it. ``None``
    when none of them can go finer."""
    changed = dict(settings)
    for name, block in blocks.items():
        if name in settings and block.inside > target:
            finer = [s for s in block.options if s.slices > settings[name].slices]
            if finer:
                changed[name] = finer[0]
    return changed if changed != settings else None
