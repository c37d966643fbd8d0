"""The feed-forward chunking technique in loops without gradients, as the engine drives it: each model's library
switch or MemOpt's generic wrapper, one unit per block, and the family table that says which code applies it."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from torch import nn

from lightning_memopt.techniques.base import Change, Knob, Plan, Planning, Section, Switchable, Technique
from lightning_memopt.techniques.chunking.core import (
    ChunkConfig,
    ChunkUnit,
    Setting,
    candidates,
    current,
    describe,
    finer,
)
from lightning_memopt.techniques.chunking.generic import chunk as generic_chunk
from lightning_memopt.techniques.chunking.hf_diffusers import chunk as diffusers_chunk
from lightning_memopt.techniques.chunking.hf_transformers import chunk as transformers_chunk

#: A block's reference setting (the peak the planner stays near without a budget) is its finest with at most this many
#: slices (else its coarsest chunked one): finer ones save little more, and a dry run of the whole step with every
#: block at them would be slow.
REFERENCE_SLICES = 16

#: Per model family (an adapter's ``name``), the code that chunks its blocks; any other family gets the generic one.
FAMILIES: dict[str, Callable[[nn.Module, ChunkConfig, list[nn.Module]], Change | None]] = {
    "transformers": transformers_chunk,
    "diffusers": diffusers_chunk,
}


def chunk_config(config: Any) -> ChunkConfig:
    """The chunking the models get when a loop starts, from MemOpt's options (``"auto"`` starts from 2 until chosen).

    Examples:
        >>> from lightning_memopt.engine.config import MemOptConfig
        >>> chunk_config(MemOptConfig(chunk_size=8, chunk_dim=0)), chunk_config(MemOptConfig()).chunk_size
        (ChunkConfig(chunk_size=8, dim=0), 2)
    """
    return ChunkConfig(chunk_size=2 if config.chunk_size == "auto" else config.chunk_size, dim=config.chunk_dim)


class Chunking(Technique):
    """The feed-forward chunking technique in loops without gradients: each model's library switch
    (``set_chunk_feed_forward``, ``chunk_size_feed_forward``) or the generic wrapper, one :class:`ChunkUnit` per block.

    It is the only writer of the settings in force (:meth:`set`, :meth:`finer`, :meth:`off`). With
    ``chunk_size="auto"`` its units start unchunked and each is a knob of the stage's planner
    (:func:`~lightning_memopt.techniques.planner.choose`), chosen with the VAE decodes' modes under one budget, before
    the first batch and again for a batch with longer inputs.
    """

    name = "chunking"
    stages = ("predict", "validate", "test")
    option = "chunking"
    replans_longer = True
    timed_alone = True
    rescue_order = 1  # after slicing the VAE decodes, which changes no output
    reports = ("chunk_settings",)

    def __init__(self) -> None:
        self.units: list[ChunkUnit] = []
        self.auto = False
        self._knobs: list[Knob] = []
        self.seconds = 0.0  # the time its planner's dry runs took

    @classmethod
    def uses_budget(cls, config: Any) -> bool:
        return True

    @classmethod
    def budget_unused(cls, config: Any) -> str | None:
        if config.chunk_size == "auto":
            return None
        return (
            f"`memory_budget` does not choose the settings with `chunk_size={config.chunk_size}`: every block uses"
            " that size (and a batch that runs out of memory, or on an accelerator goes over the budget, makes the"
            " next one finer); pass `chunk_size='auto'` to choose settings that meet the budget."
        )

    def apply(self, found: Any, config: Any) -> Any:
        self.auto = config.chunk_size == "auto"
        chunk = FAMILIES.get(found.adapter.name, generic_chunk)
        change = chunk(found.module, chunk_config(config), found.skip)
        if change is None:
            return None
        for unit in change.units:
            unit.name = f"{found.name}.{unit.name}"
            if self.auto:  # unchunked until the planner chooses
                unit.set(unit.dim, None)
        self.units += change.units
        return change

    def remove(self) -> None:
        self.units = []

    def set(self, settings: dict[str, Setting]) -> None:
        """Set each unit named in ``settings`` to its setting."""
        for unit in self.units:
            if unit.name in settings:
                unit.set(settings[unit.name].dim, settings[unit.name].size)

    @contextlib.contextmanager
    def trying(self, unit: ChunkUnit, setting: Setting) -> Iterator[None]:
        """One unit at ``setting`` for a while (a replay at several settings), then back."""
        saved = current(unit)
        unit.set(setting.dim, setting.size)
        try:
            yield
        finally:
            unit.set(saved.dim, saved.size)

    def in_force(self) -> dict[str, Setting]:
        return {u.name: current(u) for u in self.units}

    def state(self) -> dict[str, list[Any]]:
        """The settings in force, as plain values for a checkpoint: ``[dim, size, slices]`` per block."""
        return {n: [s.dim, s.size, s.slices] for n, s in self.in_force().items()}

    def load(self, state: dict[str, list[Any]]) -> bool:
        """Put saved settings in force (blocks not named keep theirs)."""
        self.set({n: Setting(*value) for n, value in state.items()})
        return True

    def finer(self, lossy: bool = False) -> str | None:
        """Every unit one step finer (outputs do not change: nothing more where ``lossy``); ``None`` where none can
        be."""
        if lossy:
            return None
        stepped = False
        for unit in self.units:
            step = finer(unit, current(unit))
            if step is not None:
                unit.set(step.dim, step.size)
                stepped = True
        return "with every block one step finer" if stepped else None

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        saved = [(u, u.dim, u.size) for u in self.units]
        for unit in self.units:
            unit.set(unit.dim, None)
        try:
            yield
        finally:
            for unit, dim, size in saved:
                unit.set(dim, size)

    @property
    def changed(self) -> bool:
        return any(u.size is not None for u in self.units)

    def describe(self) -> str | None:
        return describe(self.in_force()) if self.units else None

    def summary(self) -> str | None:
        return f"chunked: {describe(self.in_force())}" if self.units else None

    def switchables(self) -> list[Switchable]:
        return [
            Switchable(
                u.name,
                u.module,
                "forward",
                functools.partial(u.set, u.dim, u.size),
                functools.partial(u.set, u.dim, None),
            )
            for u in self.units
            if u.size is not None and u.module is not None
        ]

    def knobs(self, planning: Planning) -> list[Knob]:
        """With ``chunk_size="auto"``, each block's setting (``(dim, size)``, ``size`` ``None`` unchunked): a knob of
        the stage's planner filled by running the block alone at every setting (:attr:`Knob.replay
        <lightning_memopt.techniques.base.Knob.replay>`)."""
        self._knobs = (
            [self._knob(u) for u in self.units if u.module is not None] if self.auto and planning.choose else []
        )
        return self._knobs

    @staticmethod
    def _knob(unit: ChunkUnit) -> Knob:
        def replay(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Hashable, ...], Hashable]:
            try:
                unit.lengths = {d: int(n) for d, n in unit.lengths_of(args, kwargs).items()}
            except (IndexError, KeyError, AttributeError, TypeError):
                unit.lengths = {}
            chunked = candidates(unit)
            settings = [(c.dim, c.size) for c in chunked]
            within = [(c.dim, c.size) for c in chunked if c.slices <= REFERENCE_SLICES]
            reference = within[-1] if within else settings[0] if settings else (unit.dim, None)
            return ((unit.dim, None), *settings), reference

        off = (unit.dim, None)
        return Knob(
            unit.name, unit.module, (off,), lambda s: unit.set(*s), lambda: (unit.dim, unit.size), off, replay=replay
        )

    def plan(self, planning: Planning) -> Plan | None:
        """What the stage's planner chose for the blocks, in words (the decodes say their own: ``Decoding.plan``)."""
        chosen = planning.chosen
        if chosen is None or not self._knobs:
            return None
        plan = Plan()
        if chosen.peak_bytes is None:
            why = chosen.notes[0] if chosen.notes else "the step could not be traced"
            plan.warnings.append(
                f"chunk settings could not be chosen: {why}. Chunking stays as it is"
                f" ({describe(self.in_force())}); a batch that runs out of memory is still retried finer. Pass an"
                " int `chunk_size` to choose yourself."
            )
            return plan
        self.seconds += chosen.seconds
        when = "longer inputs: " if planning.longer else ""
        settings = describe(self.in_force())
        plan.said.append(f"{when}chunk settings chosen by dry runs in {chosen.seconds:.2f} s: {settings}")
        return plan

    def section(self) -> Section:
        settings = describe(self.in_force())
        tuned = f", chosen by dry runs in {self.seconds:.2f} s" if self.seconds else ""
        return Section(settings={"chunk_settings": settings}, lines=[f"chunked: {settings}{tuned}"])
