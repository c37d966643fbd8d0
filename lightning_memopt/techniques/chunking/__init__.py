"""Feed-forward chunking: the mechanics (:mod:`.core`), a file per model family (:mod:`.generic`,
:mod:`.hf_transformers`, :mod:`.hf_diffusers`, and :mod:`.library` that the libraries share), the plug-in the engine
drives (:mod:`.technique`) and its planner (:mod:`.planner`)."""

from lightning_memopt.techniques.chunking.core import (
    ChunkConfig,
    ChunkUnit,
    Setting,
    apply_divisor_chunking,
    apply_feed_forward_chunking,
    describe,
    largest_divisor,
)
from lightning_memopt.techniques.chunking.technique import Chunking

__all__ = [
    "ChunkConfig",
    "ChunkUnit",
    "Chunking",
    "Setting",
    "apply_divisor_chunking",
    "apply_feed_forward_chunking",
    "describe",
    "largest_divisor",
]
