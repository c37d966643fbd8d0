"""diffusers models: any ``ModelMixin``; its checkpointing switch is ``enable_gradient_checkpointing``, a block's
feed-forward chunking its ``set_chunk_feed_forward``, and an autoencoder's decode switches ``use_slicing`` and
``use_tiling``. The tables say which blocks differ from the rest."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_memopt.adapters.base import LengthsFn, LibraryAdapter

#: Attributes diffusers' checkpointing switch sets on modules.
CHECKPOINT_ATTRIBUTES = ("gradient_checkpointing", "_gradient_checkpointing_func")
#: Attributes diffusers' ``set_chunk_feed_forward`` sets on blocks.
CHUNK_ATTRIBUTES = ("_chunk_size", "_chunk_dim")
#: The attributes an autoencoder's ``enable_slicing``/``enable_tiling`` set (diffusers' autoencoders).
DECODE_ATTRIBUTES = ("use_slicing", "use_tiling")


class DiffusersAdapter(LibraryAdapter):
    """Any ``diffusers.ModelMixin``."""

    name, model_class, supports = "diffusers", "ModelMixin", "_supports_gradient_checkpointing"


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


def chunking_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks with a ``set_chunk_feed_forward`` switch."""
    return [m for m in model.modules() if callable(getattr(m, "set_chunk_feed_forward", None))]


def chunk_dims(block: nn.Module) -> tuple[tuple[int, ...], LengthsFn]:
    """The dims a block can chunk, and how to read their lengths from its inputs (:data:`CHUNK_BLOCKS`)."""
    dims, lengths = CHUNK_BLOCKS.get(type(block).__name__, ((0, 1), _hidden_lengths))
    return dims, lengths(block)


def has_decode_switches(module: nn.Module) -> bool:
    """Whether ``module`` is an autoencoder with slicing and tiling switches (diffusers' ``AutoencoderKL`` and its
    video variants)."""
    return all(callable(getattr(module, m, None)) for m in ("enable_slicing", "enable_tiling", "decode")) and all(
        isinstance(getattr(module, a, None), bool) for a in DECODE_ATTRIBUTES
    )


def find_decoders(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules under ``root`` (itself included) with decode slicing and tiling switches."""
    found: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> None:
        if has_decode_switches(module):
            found.append((name, module))
            return
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", root)
    return found
