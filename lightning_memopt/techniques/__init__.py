"""The techniques: one module each, pure torch (no Lightning imports here). Each module holds the mechanics, whose
handles undo them exactly, and the plug-in object the engine drives (see :mod:`lightning_memopt.techniques.base`).

:data:`REGISTRY` lists the plug-ins, in the order they are applied to each model and reported. Adding a technique
means its module, a line here, docs and tests."""

from lightning_memopt.handles import (
    AttributeOverride,
    AttributeSnapshot,
    ForwardOverride,
    Handle,
    HandleGroup,
)
from lightning_memopt.techniques.base import Applied, Change, Technique
from lightning_memopt.techniques.checkpointing import (
    CheckpointConfig,
    Checkpointing,
    apply_checkpointing,
    find_block_stacks,
    find_blocks_by_class,
)
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
    "Checkpointing",
    "Chunking",
    "Decoding",
    "Technique",
    "AttributeOverride",
    "AttributeSnapshot",
    "CheckpointConfig",
    "ChunkConfig",
    "ChunkUnit",
    "ForwardOverride",
    "Handle",
    "HandleGroup",
    "apply_checkpointing",
    "apply_divisor_chunking",
    "apply_feed_forward_chunking",
    "find_block_stacks",
    "find_blocks_by_class",
    "largest_divisor",
]
