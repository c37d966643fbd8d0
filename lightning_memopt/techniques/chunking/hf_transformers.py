"""transformers models: each layer's ``chunk_size_feed_forward``, always a divisor of the length it sees, and the
generic technique on the feed-forward modules of the rest."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from lightning_memopt.adapters.hf_transformers import CHUNK_ATTRIBUTE, chunking_layers, sequence_dim, sequence_lengths
from lightning_memopt.adapters.torch_generic import find_feed_forward
from lightning_memopt.techniques.base import Change
from lightning_memopt.techniques.chunking.core import ChunkConfig, ChunkUnit, apply_divisor_chunking
from lightning_memopt.techniques.chunking.generic import chunk_modules
from lightning_memopt.techniques.chunking.library import library_chunk


def chunk(model: nn.Module, config: ChunkConfig, skip: list[nn.Module]) -> Change | None:
    native = chunking_layers(model)
    generic = chunk_modules(model, find_feed_forward(model, skip + native), config)
    unit_of = functools.partial(_chunk_unit, config)
    return library_chunk(model, native, (CHUNK_ATTRIBUTE,), CHUNK_ATTRIBUTE, unit_of, generic)


def _write(layer: nn.Module, dim: int, size: int | None) -> None:
    layer.__dict__[CHUNK_ATTRIBUTE] = size or 0


def _chunk_unit(config: ChunkConfig, name: str, layer: nn.Module) -> tuple[ChunkUnit, Any]:
    """A layer's unit on its ``chunk_size_feed_forward`` attribute."""
    unit = ChunkUnit(name, (sequence_dim(layer),), config.dim, config.chunk_size, layer)
    return unit, apply_divisor_chunking(layer, unit, sequence_lengths(layer), _write)
