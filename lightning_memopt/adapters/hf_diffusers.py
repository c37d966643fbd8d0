"""diffusers models: ``enable_gradient_checkpointing`` and each block's ``set_chunk_feed_forward``."""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_memopt.adapters.base import Change, LibraryAdapter, library_checkpoint, library_chunk
from lightning_memopt.adapters.torch_generic import chunk_feed_forward_modules, find_feed_forward
from lightning_memopt.techniques.checkpointing import MemOptCheckpoint
from lightning_memopt.techniques.chunking import ChunkConfig, ChunkUnit, LengthsFn, apply_divisor_chunking

#: Attributes diffusers' checkpointing switch sets on modules.
CHECKPOINT_ATTRIBUTES = ("gradient_checkpointing", "_gradient_checkpointing_func")
#: Attributes diffusers' ``set_chunk_feed_forward`` sets on blocks.
CHUNK_ATTRIBUTES = ("_chunk_size", "_chunk_dim")


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else args[index]


def _hidden_lengths(block: nn.Module) -> LengthsFn:
    """Lengths along dims 0 and 1 of ``hidden_states``; JointTransformerBlock chunks its context with the same size,
    so there a length is the greatest common divisor of both."""

    def lengths(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int, int]:
        shape = _arg(args, kwargs, 0, "hidden_states").shape
        found = {0: shape[0], 1: shape[1]}
        if getattr(block, "ff_context", None) is not None:
            context = _arg(args, kwargs, 1, "encoder_hidden_states").shape
            found = {d: math.gcd(n, context[d]) for d, n in found.items()}
        return found

    return lengths


def _frame_lengths(block: nn.Module) -> LengthsFn:
    return lambda args, kwargs: {1: int(_arg(args, kwargs, 1, "num_frames"))}


def _writer(block: nn.Module) -> Callable[[nn.Module, int, int | None], None]:
    """Sets what ``set_chunk_feed_forward`` sets, before every call; whether the block takes a dim is read once."""
    takes_dim = "dim" in inspect.signature(block.set_chunk_feed_forward).parameters

    def write(module: nn.Module, dim: int, size: int | None) -> None:
        module.__dict__["_chunk_size"] = size
        if size is not None and takes_dim:
            module.__dict__["_chunk_dim"] = dim

    return write


#: Blocks whose checkpointed path computes something else than their plain path, by class name: their library's
#: checkpointing is switched off again (with a warning naming them), since it would change results.
BROKEN_CHECKPOINTING: dict[str, str] = {
    "EncoderTiny": "its checkpointed path skips the scaling of its input (x.add(1).div(2)) that its plain path does",
}

#: Per block class: the dims it can chunk, and how to read their lengths from its inputs. Blocks not listed chunk
#: ``hidden_states`` along dim 0 (batch) or 1 (sequence).
CHUNK_BLOCKS: dict[str, tuple[tuple[int, ...], Callable[[nn.Module], LengthsFn]]] = {
    "TemporalBasicTransformerBlock": ((1,), _frame_lengths),  # its set_chunk_feed_forward fixes dim 1: the frames
}


class DiffusersAdapter(LibraryAdapter):
    """Any ``diffusers.ModelMixin``."""

    name, model_class, supports = "diffusers", "ModelMixin", "_supports_gradient_checkpointing"

    def switch_checkpointing(self, model: nn.Module) -> Change:
        return library_checkpoint(model, CHECKPOINT_ATTRIBUTES, functools.partial(_switch_on, model), whole=True)

    def chunk(self, model: nn.Module, config: ChunkConfig, skip: list[nn.Module]) -> Change | None:
        native = [m for m in model.modules() if callable(getattr(m, "set_chunk_feed_forward", None))]
        covered = [sub for block in native for sub in block.modules()]
        missed = find_feed_forward(model, skip + covered)
        generic = chunk_feed_forward_modules(model, missed, config)
        unit_of = functools.partial(_chunk_unit, config)
        return library_chunk(model, native, CHUNK_ATTRIBUTES, "set_chunk_feed_forward()", unit_of, generic)


def _chunk_unit(config: ChunkConfig, name: str, block: nn.Module) -> tuple[ChunkUnit, Any]:
    """A block's unit on diffusers' own chunking, off until a call sets it."""
    block.set_chunk_feed_forward(chunk_size=None)  # by keyword: the library's own switch
    dims, lengths = CHUNK_BLOCKS.get(type(block).__name__, ((0, 1), _hidden_lengths))
    unit = ChunkUnit(name, dims, config.dim, config.chunk_size, block)
    return unit, apply_divisor_chunking(block, unit, lengths(block), _writer(block))


def _switch_on(model: nn.Module) -> tuple[str, list[str]]:
    """diffusers' switch with MemOpt's checkpoint function, and off again on blocks whose checkpointed path is wrong."""
    enable = model.enable_gradient_checkpointing  # type: ignore[operator]
    if "gradient_checkpointing_func" in inspect.signature(enable).parameters:
        enable(gradient_checkpointing_func=MemOptCheckpoint())
    else:  # older diffusers: its own local function
        enable()
    skipped = []
    for name, module in model.named_modules():
        reason = BROKEN_CHECKPOINTING.get(type(module).__name__)
        if reason is not None and module.__dict__.get("gradient_checkpointing"):
            module.__dict__["gradient_checkpointing"] = False
            skipped.append(f"`{name}` ({type(module).__name__}) is not checkpointed: {reason}")
    return "enable_gradient_checkpointing()", skipped
