"""A library's own checkpointing switch, the skeleton every library family shares: the user's own setting kept where
it is on already, else the switch with the attributes it sets snapshotted, and one switch per flagged block."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from lightning_memopt.adapters.base import flagged, stack_blocks
from lightning_memopt.handles import AttributeSnapshot, HandleGroup
from lightning_memopt.techniques.base import Change
from lightning_memopt.techniques.checkpointing.core import (
    CHECKPOINT_FUNCTION,
    CheckpointUnit,
    MemOptCheckpoint,
    apply_checkpointing,
    checkpoint_parts,
    inside,
)


def library_checkpoint(
    model: nn.Module,
    attributes: tuple[str, ...],
    switch: Callable[[], tuple[str, list[str]]],
    inert: tuple[type, ...] = (),
    whole: bool = False,
) -> Change:
    """A library's own checkpointing switch on ``model``: the user's own setting kept where it is on already, else
    ``switch()`` (which returns the method's name and the parts it left out) with the ``attributes`` it sets
    snapshotted, so that nothing half-applied stays behind if it raises.

    With ``whole`` (a library that checkpoints parts of each flagged block, as diffusers does each resnet), the blocks
    that hold no other flagged block can also be checkpointed as one segment (their ``"whole"`` mode)."""
    if flagged(model):
        return kept(model, inert)
    snapshot = AttributeSnapshot(model.modules(), attributes)
    handle = HandleGroup([snapshot])
    try:
        method, skipped = switch()
        switches = native_switches(model, inert)
        handle.add(checkpoint_parts(switches))
        for unit in switches if whole else []:
            if not inside(unit, switches):
                handle.add(apply_checkpointing([unit.module], units=[unit]))
                unit.whole = True
        # a model whose library keeps one flag for all its blocks checkpoints each block of its stacks
        return Change(method, len(switches) or stack_blocks(model), handle, switches=switches, skipped=skipped)
    except BaseException:
        handle.remove()
        raise


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
