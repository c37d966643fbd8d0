"""Pure torch techniques. Each returns a handle whose ``remove()`` undoes it exactly. No Lightning imports here."""

from lightning_memopt.techniques.checkpointing import (
    CheckpointConfig,
    apply_checkpointing,
    find_block_stacks,
    find_blocks_by_class,
)
from lightning_memopt.techniques.chunking import (
    ChunkConfig,
    ChunkUnit,
    apply_divisor_chunking,
    apply_feed_forward_chunking,
    largest_divisor,
)
from lightning_memopt.techniques.handles import (
    AttributeOverride,
    AttributeSnapshot,
    ForwardOverride,
    Handle,
    HandleGroup,
)

__all__ = [
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
