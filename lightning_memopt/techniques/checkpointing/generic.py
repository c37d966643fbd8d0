"""Plain torch models, and any block a library's switch does not cover: MemOpt's checkpoint wraps each block of the
repeated stacks, or of the classes the user names."""

from __future__ import annotations

from torch import nn

from lightning_memopt.adapters.base import find_block_stacks, find_blocks_by_class
from lightning_memopt.handles import HandleGroup
from lightning_memopt.techniques.base import Change
from lightning_memopt.techniques.checkpointing.core import (
    CheckpointConfig,
    CheckpointUnit,
    apply_checkpointing,
    checkpoint_parts,
)


def checkpoint(model: nn.Module, config: CheckpointConfig, skip: list[nn.Module]) -> Change | None:
    """Checkpoint the blocks of ``model``'s stacks (or the outermost instances of ``config.block_classes``) outside
    ``skip``, each with a unit of its own; ``None`` where there are none."""
    if config.block_classes:
        blocks = find_blocks_by_class(model, config.block_classes, skip)
    else:
        blocks = find_block_stacks(model, skip)
    if not blocks:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    switches = [CheckpointUnit(names[id(b)], b, native=False) for b in blocks]
    handle = HandleGroup([apply_checkpointing(blocks, config, switches), checkpoint_parts(switches)])
    kinds = ", ".join(sorted({type(b).__name__ for b in blocks}))
    return Change(f"generic checkpoint of {kinds}", len(blocks), handle, switches=switches)
