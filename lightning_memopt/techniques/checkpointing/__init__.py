"""Activation checkpointing: the mechanics (:mod:`.core`), what a block keeps in each mode (:mod:`.selective`), a
file per model family (:mod:`.generic`, :mod:`.hf_transformers`, :mod:`.hf_diffusers`, and :mod:`.library` that the
libraries share), the plug-in the engine drives (:mod:`.technique`) and its planner (:mod:`.planner`)."""

from lightning_memopt.techniques.checkpointing.core import (
    CheckpointConfig,
    CheckpointUnit,
    MemOptCheckpoint,
    RecomputeTimer,
    apply_checkpointing,
)
from lightning_memopt.techniques.checkpointing.selective import MODES
from lightning_memopt.techniques.checkpointing.technique import Checkpointing

__all__ = [
    "MODES",
    "CheckpointConfig",
    "CheckpointUnit",
    "Checkpointing",
    "MemOptCheckpoint",
    "RecomputeTimer",
    "apply_checkpointing",
]
