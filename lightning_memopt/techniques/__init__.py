"""The techniques: a package or module each, pure torch (no Lightning imports here). Each holds its mechanics, whose
handles undo them exactly, its code per model family, and the plug-in object the engine drives (see
:mod:`lightning_memopt.techniques.base`).

:data:`REGISTRY` lists the plug-ins, in the order they are applied to each model, planned and reported; a technique
defined outside the package joins them through :func:`register_technique`."""

from lightning_memopt.techniques.adapter_inputs import AdapterInputs
from lightning_memopt.techniques.base import (
    Applied,
    Change,
    Knob,
    OfTheStep,
    Plan,
    Planning,
    Section,
    Switchable,
    Technique,
    saving,
)
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
from lightning_memopt.techniques.fit_chunking import FitChunking
from lightning_memopt.techniques.free_gradients import FreeGradients
from lightning_memopt.techniques.loss import ChunkedLoss
from lightning_memopt.techniques.registry import REGISTRY, register_technique, techniques_for, unregister_technique
from lightning_memopt.techniques.state8bit import OptimizerState8bit
from lightning_memopt.techniques.stepping import OptimizerInBackward, step_one
from lightning_memopt.techniques.weights import Weights8bit

#: The built-in techniques, in the order they are applied to each model.
BUILTIN = (
    Checkpointing,
    ChunkedLoss,
    AdapterInputs,
    FitChunking,
    Chunking,
    Decoding,
    FreeGradients,
    OptimizerInBackward,
    OptimizerState8bit,
    Weights8bit,
)
for _builtin in BUILTIN:
    if _builtin not in REGISTRY:
        register_technique(_builtin)

__all__ = [
    "REGISTRY",
    "AdapterInputs",
    "Applied",
    "Change",
    "CheckpointConfig",
    "Checkpointing",
    "ChunkConfig",
    "ChunkedLoss",
    "ChunkUnit",
    "Chunking",
    "Decoding",
    "FitChunking",
    "FreeGradients",
    "Knob",
    "OfTheStep",
    "OptimizerInBackward",
    "OptimizerState8bit",
    "Plan",
    "Planning",
    "Section",
    "Switchable",
    "Technique",
    "Weights8bit",
    "apply_checkpointing",
    "apply_divisor_chunking",
    "apply_feed_forward_chunking",
    "largest_divisor",
    "register_technique",
    "saving",
    "step_one",
    "techniques_for",
    "unregister_technique",
]
