"""The feed-forward chunking technique in loops without gradients, as the engine drives it: each model's library
switch or MemOpt's generic wrapper, one unit per block, and the family table that says which code applies it."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from lightning_memopt.handles import HandleGroup
from lightning_memopt.techniques.base import Change, Switchable
from lightning_memopt.techniques.chunking import generic, hf_diffusers, hf_transformers
from lightning_memopt.techniques.chunking.core import ChunkConfig, ChunkUnit, Setting, current, describe, finer

#: Per model family (an adapter's ``name``), the code that chunks its blocks; any other family gets the generic one.
FAMILIES: dict[str, Callable[[nn.Module, ChunkConfig, list[nn.Module]], Change | None]] = {
    "transformers": hf_transformers.chunk,
    "diffusers": hf_diffusers.chunk,
}


def chunk_config(config: Any) -> ChunkConfig:
    """The chunking the models get when a loop starts, from MemOpt's options (``"auto"`` starts from 2 until chosen).

    Examples:
        >>> from lightning_memopt.engine.config import MemOptConfig
        >>> chunk_config(MemOptConfig(chunk_size=8, chunk_dim=0)), chunk_config(MemOptConfig()).chunk_size
        (ChunkConfig(chunk_size=8, dim=0), 2)
    """
    return ChunkConfig(chunk_size=2 if config.chunk_size == "auto" else config.chunk_size, dim=config.chunk_dim)


class Chunking:
    """The feed-forward chunking technique in loops without gradients: each model's library switch
    (``set_chunk_feed_forward``, ``chunk_size_feed_forward``) or the generic wrapper, one :class:`ChunkUnit` per block.

    It is the only writer of the settings in force (:meth:`set`, :meth:`finer`, :meth:`off`).
    """

    name = "chunking"
    stages = ("predict", "validate", "test")

    def __init__(self) -> None:
        self.units: list[ChunkUnit] = []
        self._handles = HandleGroup()

    def apply(self, found: Any, config: Any) -> Any:
        chunk = FAMILIES.get(found.adapter.name, generic.chunk)
        change = chunk(found.module, chunk_config(config), found.skip)
        if change is None:
            return None
        self._handles.add(change.handle)
        for unit in change.units:
            unit.name = f"{found.name}.{unit.name}"
        self.units += change.units
        return change

    def remove(self) -> None:
        self._handles.remove()
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

    def finer(self) -> bool:
        """Every unit one step finer; ``False`` where none can be."""
        stepped = False
        for unit in self.units:
            step = finer(unit, current(unit))
            if step is not None:
                unit.set(step.dim, step.size)
                stepped = True
        return stepped

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

    def timer(self, synchronize: Callable[[], None]) -> None:
        return None  # timed alone when the loop ends (:meth:`switchables`)
