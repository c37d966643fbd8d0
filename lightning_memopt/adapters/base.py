"""What every adapter returns, and the shape of an adapter."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Protocol

from torch import nn

from lightning_memopt.handles import AttributeSnapshot, Handle, HandleGroup
from lightning_memopt.techniques.base import Change
from lightning_memopt.techniques.checkpointing import (
    CHECKPOINT_FUNCTION,
    CheckpointConfig,
    CheckpointUnit,
    MemOptCheckpoint,
    apply_checkpointing,
    flagged,
)
from lightning_memopt.techniques.chunking import ChunkConfig, ChunkUnit


def combine(method: str, units: list[ChunkUnit], handle: HandleGroup, extra: Change | None) -> Change:
    """One chunking :class:`Change` for a model's own switch plus, if any, the generic technique on what it missed."""
    if extra is None:
        return Change(method, len(units), handle, units)
    handle.add(extra.handle)
    return Change(f"{method} + {extra.method}", len(units) + extra.blocks, handle, units + extra.units)


def library_checkpoint(
    model: nn.Module,
    attributes: tuple[str, ...],
    switch: Callable[[], tuple[str, list[str]]],
    inert: tuple[type, ...] = (),
    whole: bool = False,
) -> Change:
    """A library's own checkpointing switch on ``model``, the skeleton every library adapter shares: the user's own
    setting kept where it is on already, else ``switch()`` (which returns the method's name and the parts it left
    out) with the ``attributes`` it sets snapshotted, so that nothing half-applied stays behind if it raises.

    With ``whole`` (a library that checkpoints parts of each flagged block, as diffusers does each resnet), the blocks
    that hold no other flagged block can also be checkpointed as one segment (their ``"whole"`` mode)."""
    if checkpointing_on(model):
        return kept(model, inert)
    snapshot = AttributeSnapshot(model.modules(), attributes)
    handle = HandleGroup([snapshot])
    try:
        method, skipped = switch()
        switches = native_switches(model, inert)
        for unit in switches if whole else []:
            inner = [u for u in switches if u is not unit and any(m is u.module for m in unit.module.modules())]
            if not inner:
                handle.add(apply_checkpointing([unit.module], units=[unit]))
                unit.whole = True
        # a model whose library keeps one flag for all its blocks checkpoints each block of its stacks
        return Change(method, len(switches) or stack_blocks(model), handle, switches=switches, skipped=skipped)
    except BaseException:
        handle.remove()
        raise


def library_chunk(
    model: nn.Module,
    native: list[nn.Module],
    attributes: tuple[str, ...],
    method: str,
    unit_of: Callable[[str, nn.Module], tuple[ChunkUnit, Handle]],
    generic: Change | None,
) -> Change | None:
    """A library's own chunking on its ``native`` blocks (``unit_of`` makes each block's unit and its handle), the
    ``attributes`` the switch sets snapshotted, plus the generic technique's ``generic`` change on what it missed."""
    if not native:
        return generic
    names = {id(m): n for n, m in model.named_modules()}
    group = HandleGroup([AttributeSnapshot(native, attributes)])
    units = []
    for block in native:
        unit, handle = unit_of(names[id(block)], block)
        group.add(handle)
        units.append(unit)
    return combine(method, units, group, generic)


class Adapter(Protocol):
    """Knows one model family: which modules belong to it and how to switch its techniques on."""

    name: str

    def claims(self, module: nn.Module) -> bool: ...

    def checkpoint(self, model: nn.Module, config: CheckpointConfig, skip: list[nn.Module]) -> Change | None: ...

    def chunk(self, model: nn.Module, config: ChunkConfig, skip: list[nn.Module]) -> Change | None: ...


class LibraryAdapter:
    """What every library's adapter shares: it claims the library's base model class (only where the library is
    imported already), and checkpoints a model with the generic technique where the user names the blocks or the model
    has no switch. Subclasses set the names and implement :meth:`switch_checkpointing` and ``chunk``."""

    name: str = ""  #: the library's module name
    model_class: str = ""  #: the library's base model class, in that module
    supports: str = ""  #: the model attribute that says it has a checkpointing switch

    def claims(self, module: nn.Module) -> bool:
        library = sys.modules.get(self.name)
        return library is not None and isinstance(module, getattr(library, self.model_class))

    def checkpoint(self, model: nn.Module, config: CheckpointConfig, skip: list[nn.Module]) -> Change | None:
        if config.block_classes or not getattr(model, self.supports, False):
            from lightning_memopt.adapters.torch_generic import TorchAdapter  # it imports this module

            return TorchAdapter().checkpoint(model, config, skip)
        return self.switch_checkpointing(model)

    def switch_checkpointing(self, model: nn.Module) -> Change:
        raise NotImplementedError


def checkpointing_on(model: nn.Module) -> bool:
    """Whether a library's checkpointing is already on in ``model`` (switched on by the user)."""
    return bool(flagged(model))


def native_switches(model: nn.Module, inert: tuple[type, ...] = ()) -> list[CheckpointUnit]:
    """After a library's checkpointing switch: one switch per flagged module below the model, each flag turning its
    own checkpointed calls on and off (a UNet's down, mid and up blocks, the transformers inside them; a decoder layer).
    Modules of the ``inert`` classes carry a flag that checkpoints nothing themselves (a transformers base model
    whose layers checkpoint themselves). A model whose library keeps one flag for all its blocks has no switches.
    A block that calls MemOpt's checkpoint function gets one of its own, so that its mode is its own."""
    units = []
    for name, block in flagged(model):
        if block is model or isinstance(block, inert):
            continue
        own = None
        if isinstance(block.__dict__.get(CHECKPOINT_FUNCTION), MemOptCheckpoint):
            own = block.__dict__[CHECKPOINT_FUNCTION] = MemOptCheckpoint()
        units.append(CheckpointUnit(name, block, native=True, function=own))
    return units


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
