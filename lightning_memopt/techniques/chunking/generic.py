"""Plain torch models, and the feed-forward modules a library's switch does not reach: MemOpt's wrapper slices each
token-wise feed-forward module found by class name."""

from __future__ import annotations

from torch import nn

from lightning_memopt.adapters.torch_generic import find_feed_forward
from lightning_memopt.handles import HandleGroup
from lightning_memopt.techniques.base import Change
from lightning_memopt.techniques.chunking.core import ChunkConfig, ChunkUnit, apply_feed_forward_chunking


def chunk(model: nn.Module, config: ChunkConfig, skip: list[nn.Module]) -> Change | None:
    """Chunk the feed-forward modules of ``model`` outside ``skip``."""
    return chunk_modules(model, find_feed_forward(model, skip), config)


def chunk_modules(model: nn.Module, modules: list[nn.Module], config: ChunkConfig) -> Change | None:
    """Generic chunking of the given token-wise modules of ``model``, as one :class:`Change`."""
    if not modules:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    units = [ChunkUnit(names[id(m)], (0, 1), config.dim, config.chunk_size, m) for m in modules]
    handle = HandleGroup(apply_feed_forward_chunking(m, u) for m, u in zip(modules, units, strict=True))
    kinds = ", ".join(sorted({type(m).__name__ for m in modules}))
    return Change(f"generic chunking of {kinds}", len(modules), handle, units)
