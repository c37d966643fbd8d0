"""diffusers models: ``enable_gradient_checkpointing`` and each block's ``set_chunk_feed_forward``."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from lightning_memopt.adapters.base import Change, combine
from lightning_memopt.adapters.torch_generic import FEED_FORWARD_CLASSES, TorchAdapter, chunk_feed_forward_modules
from lightning_memopt.techniques.checkpointing import CheckpointConfig, find_block_stacks, find_blocks_by_class
from lightning_memopt.techniques.chunking import ChunkConfig, apply_divisor_chunking
from lightning_memopt.techniques.handles import AttributeSnapshot, HandleGroup

#: Attributes diffusers' checkpointing switch sets on modules.
CHECKPOINT_ATTRIBUTES = ("gradient_checkpointing", "_gradient_checkpointing_func")
#: Attributes diffusers' ``set_chunk_feed_forward`` sets on blocks.
CHUNK_ATTRIBUTES = ("_chunk_size", "_chunk_dim")


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else args[index]


def _hidden_lengths(block: nn.Module, dim: int) -> Callable[[tuple[Any, ...], dict[str, Any]], Sequence[int]]:
    def lengths(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Sequence[int]:
        found = [_arg(args, kwargs, 0, "hidden_states").shape[dim]]
        # JointTransformerBlock chunks the context with the same size
        if getattr(block, "ff_context", None) is not None:
            found.append(_arg(args, kwargs, 1, "encoder_hidden_states").shape[dim])
        return found

    return lengths


def _frame_lengths(block: nn.Module, dim: int) -> Callable[[tuple[Any, ...], dict[str, Any]], Sequence[int]]:
    return lambda args, kwargs: [int(_arg(args, kwargs, 1, "num_frames"))]


#: How to read, from a block's inputs, the lengths its feed-forward layers chunk. Blocks not listed chunk
#: ``hidden_states`` (and ``encoder_hidden_states`` when they have an ``ff_context``) along their chunk dim.
CHUNK_LENGTHS: dict[str, Callable[[nn.Module, int], Callable[[tuple[Any, ...], dict[str, Any]], Sequence[int]]]] = {
    "TemporalBasicTransformerBlock": _frame_lengths,
}


class DiffusersAdapter:
    """Any ``diffusers.ModelMixin``."""

    name = "diffusers"

    def claims(self, module: nn.Module) -> bool:
        diffusers = sys.modules.get("diffusers")
        return diffusers is not None and isinstance(module, diffusers.ModelMixin)

    def checkpoint(self, model: nn.Module, config: CheckpointConfig, skip: list[nn.Module]) -> Change | None:
        if config.block_classes or not getattr(model, "_supports_gradient_checkpointing", False):
            return TorchAdapter().checkpoint(model, config, skip)
        snapshot = AttributeSnapshot(model.modules(), CHECKPOINT_ATTRIBUTES)
        model.enable_gradient_checkpointing()  # type: ignore[operator]
        flagged = [m for m in model.modules() if m.__dict__.get("gradient_checkpointing") is True]
        # transformer models carry one flag and checkpoint each block of their stacks
        blocks = len(find_block_stacks(model)) if flagged == [model] else len(flagged)
        return Change("enable_gradient_checkpointing()", blocks, snapshot)

    def chunk(self, model: nn.Module, config: ChunkConfig, skip: list[nn.Module]) -> Change | None:
        native = [m for m in model.modules() if callable(getattr(m, "set_chunk_feed_forward", None))]
        covered = [sub for block in native for sub in block.modules()]
        generic = chunk_feed_forward_modules(find_blocks_by_class(model, FEED_FORWARD_CLASSES, skip + covered), config)
        if not native:
            return generic
        group = HandleGroup()
        for block in native:
            snapshot = AttributeSnapshot([block], CHUNK_ATTRIBUTES)
            block.set_chunk_feed_forward(chunk_size=config.chunk_size, dim=config.dim)
            dim = block.__dict__.get("_chunk_dim", config.dim)  # some blocks fix their own dim
            lengths = CHUNK_LENGTHS.get(type(block).__name__, _hidden_lengths)(block, dim)
            group.add(snapshot)
            group.add(apply_divisor_chunking(block, "_chunk_size", config.chunk_size, lengths, off=None))
        return combine("set_chunk_feed_forward()", len(native), group, generic)
