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
        skipped: Parts of the model left unchanged, each with the reason, for a warning.
    """

    method: str
    blocks: int
    handle: Handle
    units: list[ChunkUnit] = field(default_factory=list)
    switches: list[CheckpointUnit] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # parts left unchanged, and why: for a warning


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


def flagged(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules whose ``gradient_checkpointing`` flag is on, by name."""
    return [(n, m) for n, m in model.named_modules() if m.__dict__.get("gradient_checkpointing") is True]


def checkpointing_on(model: nn.Module) -> bool:
    """Whether a library's checkpointing is already on in ``model`` (switched on by the user)."""
    return bool(flagged(model))


def native_switches(model: nn.Module, inert: tuple[type, ...] = ()) -> list[CheckpointUnit]:
    """After a library's checkpointing switch: one switch per flagged module below the model, each flag turning its
    own checkpointed calls on and off (a UNet's down, mid and up blocks, the transformers inside them; a decoder layer).
    Modules of the ``inert`` classes carry a flag that checkpoints nothing themselves (a transformers base model
    whose layers checkpoint themselves). A model whose library keeps one flag for all its blocks has no switches."""
    return [
        CheckpointUnit(name, block, native=True)
        for name, block in flagged(model)
        if block is not model and not isinstance(block, inert)
    ]


def kept(model: nn.Module, inert: tuple[type, ...] = ()) -> Change:
    """The model's own checkpointing, switched on by the user: kept as it is (their function, their layers)."""
    blocks = len(native_switches(model, inert)) or stack_blocks(model)
    return Change("already on: the model's own setting, kept as it is", blocks, HandleGroup())


def stack_blocks(model: nn.Module) -> int:
    """How many blocks the outermost stacks of ``model`` hold (an ``nn.ModuleList`` of modules of one class that have
    children, one-block stacks included): what a library that keeps one flag for all its blocks checkpoints."""
    children = [c for c in model.children() if c is not None]
    if isinstance(model, nn.ModuleList) and children and len({type(c) for c in children}) == 1:
        if any(True for _ in children[0].children()):
            return len(children)
    return sum(stack_blocks(c) for c in children)
