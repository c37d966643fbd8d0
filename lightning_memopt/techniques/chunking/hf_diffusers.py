"""diffusers models: each block's ``set_chunk_feed_forward``, always a divisor of the length it sees, and the generic
technique on the feed-forward modules outside those blocks."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_memopt.adapters.hf_diffusers import CHUNK_ATTRIBUTES, chunk_dims, chunking_blocks
from lightning_memopt.adapters.torch_generic import find_feed_forward
from lightning_memopt.techniques.base import Change
from lightning_memopt.techniques.chunking.core import ChunkConfig, ChunkUnit, apply_divisor_chunking
from lightning_memopt.techniques.chunking.generic import chunk_modules
from lightning_memopt.techniques.chunking.library import library_chunk


def chunk(model: nn.Module, config: ChunkConfig, skip: list[nn.Module]) -> Change | None:
    native = chunking_blocks(model)
    covered = [sub for block in native for sub in block.modules()]
    generic = chunk_modules(model, find_feed_forward(model, skip + covered), config)
    unit_of = functools.partial(_chunk_unit, config)
    return library_chunk(model, native, CHUNK_ATTRIBUTES, "set_chunk_feed_forward()", unit_of, generic)


def _writer(block: nn.Module) -> Callable[[nn.Module, int, int | None], None]:
    """Sets what ``set_chunk_feed_forward`` sets, before every call; whether the block takes a dim is read once."""
    takes_dim = "dim" in inspect.signature(block.set_chunk_feed_forward).parameters

    def write(module: nn.Module, dim: int, size: int | None) -> None:
        module.__dict__["_chunk_size"] = size
        if size is not None and takes_dim:
            module.__dict__["_chunk_dim"] = dim

    return write


def _chunk_unit(config: ChunkConfig, name: str, block: nn.Module) -> tuple[ChunkUnit, Any]:
    """A block's unit on diffusers' own chunking, off until a call sets it."""
    block.set_chunk_feed_forward(chunk_size=None)  # by keyword: the library's own switch
    dims, lengths = chunk_dims(block)
    unit = ChunkUnit(name, dims, config.dim, config.chunk_size, block)
    return unit, apply_divisor_chunking(block, unit, lengths, _writer(block))
