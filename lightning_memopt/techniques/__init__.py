"""The techniques: a package or module each, pure torch (no Lightning imports here). Each holds its mechanics, whose
handles undo them exactly, its code per model family, and the plug-in object the engine drives (see
:mod:`lightning_memopt.techniques.base`).

:data:`REGISTRY` lists the plug-ins, in the order they are applied to each model and reported."""

from lightning_memopt.techniques.base import Applied, Change, Switchable, Technique
from lightning_memopt.techniques.checkpointing import CheckpointConfig, Checkpointing, apply_checkpointing
from lightning_memopt.techniques.chunking import (
    ChunkConfig,
    Chunking,
    ChunkUnit,
    apply_divisor_chunking,
    apply_feed_forward_chunking,
    largest_divisor,
)
from lightning_memopt.techniques.decoding import Decoding

#: The technique plug-ins, in the order they are applied to each model.
REGISTRY: tuple[type[Technique], ...] = (Checkpointing, Chunking, Decoding)

__all__ = [
    "REGISTRY",
    "Applied",
    "Change",
    "CheckpointConfig",
    "Checkpointing",
    "ChunkConfig",
    "ChunkUnit",
    "Chunking",
    "Decoding",
    "Switchable",
    "Technique",
    "apply_checkpointing",
    "apply_divisor_chunking",
    "apply_feed_forward_chunking",
    "largest_divisor",
]
