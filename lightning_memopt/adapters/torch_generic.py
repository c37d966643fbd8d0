"""Plain torch models: checkpoint repeated block stacks, chunk token-wise feed-forward modules found by class name."""

from __future__ import annotations

from torch import nn

from lightning_memopt.adapters.base import Change
from lightning_memopt.techniques.checkpointing import (
    CheckpointConfig,
    CheckpointUnit,
    apply_checkpointing,
    find_block_stacks,
    find_blocks_by_class,
)
from lightning_memopt.techniques.chunking import ChunkConfig, ChunkUnit, apply_feed_forward_chunking
from lightning_memopt.techniques.handles import HandleGroup

#: Class names of token-wise feed-forward modules that are chunked when their block has no switch of its own.
FEED_FORWARD_CLASSES: tuple[str, ...] = ("FeedForward", "LuminaFeedForward", "Mlp")


def _names(blocks: list[nn.Module]) -> str:
    return ", ".join(sorted({type(b).__name__ for b in blocks}))


class TorchAdapter:
    """The fallback for any ``nn.Module``: generic checkpointing and chunking."""

    name = "torch"

    def claims(self, module: nn.Module) -> bool:
        return True

    def checkpoint(self, model: nn.Module, config: CheckpointConfig, skip: list[nn.Module]) -> Change | None:
        if config.block_classes:
            blocks = find_blocks_by_class(model, config.block_classes, skip)
        else:
            blocks = find_block_stacks(model, skip)
        if not blocks:
            return None
        names = {id(m): n for n, m in model.named_modules()}
        switches = [CheckpointUnit(names[id(b)], b, native=False) for b in blocks]
        handle = apply_checkpointing(blocks, config, switches)
        return Change(f"generic checkpoint of {_names(blocks)}", len(blocks), handle, switches=switches)

    def chunk(self, model: nn.Module, config: ChunkConfig, skip: list[nn.Module]) -> Change | None:
        return chunk_feed_forward_modules(model, find_blocks_by_class(model, FEED_FORWARD_CLASSES, skip), config)


def chunk_feed_forward_modules(model: nn.Module, modules: list[nn.Module], config: ChunkConfig) -> Change | None:
    """Generic chunking of the given token-wise modules of ``model``, as one :class:`Change`."""
    if not modules:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    units = [ChunkUnit(names[id(m)], (0, 1), config.dim, config.chunk_size, m) for m in modules]
    handle = HandleGroup(apply_feed_forward_chunking(m, u) for m, u in zip(modules, units, strict=True))
    return Change(f"generic chunking of {_names(modules)}", len(modules), handle, units)
