"""The checkpointing technique at fit, as the engine drives it: each model's library switch, or MemOpt's generic
wrapper, on its blocks; each block's mode; and the family tables that say which code applies it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from lightning_memopt.adapters.base import flagged
from lightning_memopt.handles import HandleGroup
from lightning_memopt.techniques.base import Change
from lightning_memopt.techniques.checkpointing import generic, hf_diffusers, hf_transformers
from lightning_memopt.techniques.checkpointing.core import (
    CHECKPOINT_FUNCTION,
    CheckpointConfig,
    CheckpointUnit,
    RecomputeTimer,
)
from lightning_memopt.techniques.checkpointing.selective import MODES, POLICIES
from lightning_memopt.tuning import spread

#: Per model family (an adapter's ``name``), the library's own switch; a family not here, a model without its
#: library's switch, or blocks named by the user get MemOpt's generic wrapper.
SWITCHES: dict[str, Callable[[nn.Module], Change]] = {
    "transformers": hf_transformers.checkpoint,
    "diffusers": hf_diffusers.checkpoint,
}


def checkpoint_model(found: Any, config: CheckpointConfig) -> Change | None:
    """Checkpoint one found model (:class:`~lightning_memopt.adapters.FoundModel`) with its library's switch where it
    has one, else with the generic wrapper; ``None`` where it has no blocks to checkpoint."""
    switch = SWITCHES.get(found.adapter.name)
    if switch is None or config.block_classes or not found.adapter.has_checkpointing_switch(found.module):
        return generic.checkpoint(found.module, config, found.skip)
    return switch(found.module)


class Checkpointing:
    """The checkpointing technique at fit: each model's library switch, or the generic wrapper, on its blocks.

    It is the only writer of which blocks are checkpointed (:meth:`enable`); :meth:`off` switches every block it
    checkpoints off (the flags the library switch turned on, and the generic wrappers) and back, without re-applying
    anything. A model whose checkpointing the user had switched on already keeps it, also in :meth:`off`.
    """

    name = "checkpointing"
    stages = ("fit",)

    def __init__(self) -> None:
        self.switches: list[CheckpointUnit] = []  # the blocks that can be switched one by one
        self.recomputed: list[nn.Module] = []  # modules holding a library's checkpoint function, to time it
        self.flags: list[nn.Module] = []  # modules whose flag the library switch turned on
        self.models = 0
        self._handles = HandleGroup()

    def apply(self, found: Any, config: Any) -> Any:
        before = {id(m) for _, m in flagged(found.module)}
        change = checkpoint_model(found, CheckpointConfig(block_classes=config.checkpoint_blocks))
        if change is None:
            return None
        self._handles.add(change.handle)
        self.models += 1
        for unit in change.switches:
            unit.name = f"{found.name}.{unit.name}"
        self.switches += change.switches
        self.recomputed += [m for m in found.module.modules() if CHECKPOINT_FUNCTION in m.__dict__]
        self.flags += [m for _, m in flagged(found.module) if id(m) not in before]
        return change

    def remove(self) -> None:
        self._handles.remove()
        self.switches, self.recomputed, self.flags, self.models = [], [], [], 0

    def enable(self, count: int) -> None:
        """Checkpoint ``count`` of the switchable blocks whole, spread evenly (every n/count-th)."""
        chosen = set(spread(len(self.switches), count))
        self.set(["full" if index in chosen else "none" for index in range(len(self.switches))])

    def set(self, modes: list[str]) -> None:
        """Each switchable block's mode, in order: one of the block's :attr:`CheckpointUnit.modes`."""
        if len(modes) != len(self.switches):
            raise ValueError(f"one mode per block is needed ({len(self.switches)}), got {len(modes)}")
        for unit, mode in zip(self.switches, modes, strict=True):
            unit.mode = mode

    @property
    def modes(self) -> list[str]:
        return [u.mode for u in self.switches]

    def state(self) -> dict[str, Any]:
        """How the blocks are checkpointed, for a checkpoint: the switchable blocks and each one's mode."""
        return {"switches": [u.name for u in self.switches], "modes": self.modes}

    def load(self, state: dict[str, Any]) -> bool:
        """Checkpoint the blocks as saved (a count of whole blocks, from an older checkpoint, too); ``False``
        (nothing changed) where the blocks are not the same."""
        if state.get("switches") != [u.name for u in self.switches]:
            return False
        if "modes" in state:
            self.set(list(state["modes"]))
        elif "count" in state:
            self.enable(state["count"])
        else:
            return False
        return True

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        flags = [(m, m.__dict__.get("gradient_checkpointing")) for m in self.flags]
        modes = self.modes
        for module in self.flags:
            module.__dict__["gradient_checkpointing"] = False
        for unit in self.switches:
            unit.mode = "none"
        try:
            yield
        finally:
            for module, flag in flags:
                module.__dict__["gradient_checkpointing"] = flag
            for unit, mode in zip(self.switches, modes, strict=True):
                unit.mode = mode

    @property
    def changed(self) -> bool:
        return bool(self.models) and (not self.switches or any(u.enabled for u in self.switches))

    def describe(self) -> str | None:
        if not self.switches:
            return None
        modes = self.modes
        described = f"{len(modes) - modes.count('none')} of {len(modes)} blocks"
        if any(m in modes for m in (*POLICIES, "whole")):
            kinds = [f"{modes.count(m)} {m}" for m in MODES[1:] if m in modes]
            described += f" ({', '.join(kinds)})"
        return described

    def switchables(self) -> list[Any]:
        return []  # the recomputation is timed in the step itself (:meth:`timer`)

    def timer(self, synchronize: Callable[[], None]) -> RecomputeTimer:
        """Times the recomputation of the checkpointed blocks in the step."""
        return RecomputeTimer(self.recomputed, [u for u in self.switches if not u.native or u.whole], synchronize)
