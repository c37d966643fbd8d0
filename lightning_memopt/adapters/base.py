"""What every adapter returns, and the shape of an adapter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from torch import nn

from lightning_memopt.techniques.checkpointing import CheckpointConfig, CheckpointUnit
from lightning_memopt.techniques.chunking import ChunkConfig, ChunkUnit
from lightning_memopt.techniques.handles import Handle, HandleGroup


@dataclass
class Change:
    """One technique applied to one model.

    Attributes:
        method: How it was applied, for the user: the library switch that was called, or ``generic``.
        blocks: How many blocks (layers) it reached.
        handle: Undoes the change exactly.
        units: For chunking, one unit per block, whose slice size can be changed while the model runs.
        switches: For checkpointing, the blocks that can be switched off and on one by one (a model whose library
            has one flag for all its blocks has none).
    """

    method: str
    blocks: int
    handle: Handle
    units: list[ChunkUnit] = field(default_factory=list)
    switches: list[CheckpointUnit] = field(default_factory=list)


def combine(method: str, units: list[ChunkUnit], handle: HandleGroup, extra: Change | None) -> Change:
    """One chunking :class:`Change` for a model's own switch plus, if any, the generic technique on what it missed."""
    if extra is None:
        return Change(method, len(units), handle, units)
    handle.add(extra.handle)
    return Change(f"{method} + {extra.method}", len(units) + extra.blocks, handle, units + extra.units)


class Adapter(Protocol):
    """Knows one model family: which modules belong to it and how to switch its techniques on."""

    name: str

    def claims(self, module: nn.Module) -> bool: ...

    def checkpoint(self, model: nn.Module, config: CheckpointConfig, skip: list[nn.Module]) -> Change | None: ...

    def chunk(self, model: nn.Module, config: ChunkConfig, skip: list[nn.Module]) -> Change | None: ...


def native_switches(model: nn.Module) -> list[CheckpointUnit]:
    """After a library's checkpointing switch: the flagged blocks that sit in a stack (``nn.ModuleList``), one switch
    each. Flags outside stacks (a whole model, a mid block) stay as the library set them."""
    switches = []
    for name, parent in model.named_modules():
        if isinstance(parent, nn.ModuleList):
            for index, block in enumerate(parent):
                if block.__dict__.get("gradient_checkpointing") is True:
                    switches.append(CheckpointUnit(f"{name}.{index}" if name else str(index), block, native=True))
    return switches
