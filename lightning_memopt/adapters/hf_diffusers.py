"""diffusers models: any ``ModelMixin``; its checkpointing switch is ``enable_gradient_checkpointing``, a block's
feed-forward chunking its ``set_chunk_feed_forward``, and an autoencoder's decode switches ``use_slicing`` and
``use_tiling`` (and how a decode is sliced by more than one sample, :func:`decode_in_slices`). The tables say which
blocks differ from the rest."""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_memopt.adapters.base import LengthsFn, LibraryAdapter

#: Attributes diffusers' checkpointing switch sets on modules.
CHECKPOINT_ATTRIBUTES = ("gradient_checkpointing", "_gradient_checkpointing_func")
#: Attributes diffusers' ``set_chunk_feed_forward`` sets on blocks.
CHUNK_ATTRIBUTES = ("_chunk_size", "_chunk_dim")
#: The attributes an autoencoder's ``enable_slicing``/``enable_tiling`` set (diffusers' autoencoders).
DECODE_ATTRIBUTES = ("use_slicing", "use_tiling")
#: The arguments of an autoencoder's ``decode`` besides the latents that every slice of a batch takes unchanged (none
#: is per sample): a decode that takes only these can be sliced by any size, as its own slicing by 1 is. One that takes
#: others (``num_frames``, a ``temb`` per sample, ``num_inference_steps``) is sliced only by its own switch.
SLICE_ARGUMENTS = frozenset({"return_dict", "generator"})


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


def slices_by_any_size(module: nn.Module) -> bool:
    """Whether ``module``'s ``decode`` (its class's) takes only the latents and :data:`SLICE_ARGUMENTS`, so that
    decoding slices of several samples each gives what its own slicing by 1 gives.

    Examples:
        >>> from torch import nn
        >>> class Video(nn.Module):
        ...     def decode(self, z, num_frames, return_dict=True): ...
        >>> slices_by_any_size(Video())
        False
    """
    try:
        parameters = list(inspect.signature(type(module).decode).parameters.values())[2:]  # self, the latents
    except (AttributeError, TypeError, ValueError):
        return False
    return all(p.name in SLICE_ARGUMENTS for p in parameters)


def _rebuild(output: Any) -> Callable[[list[torch.Tensor]], Any] | None:
    """How to make an output like a decode's ``output`` from other tensors: a tensor, a tuple of them
    (``return_dict=False``) or a ``DecoderOutput`` with its ``sample`` only; ``None`` for any other output."""
    if isinstance(output, torch.Tensor):
        return lambda tensors: tensors[0]
    if isinstance(output, tuple) and output and all(isinstance(t, torch.Tensor) for t in output):
        return tuple
    if dataclasses.is_dataclass(output) and not isinstance(output, type) and isinstance(output.sample, torch.Tensor):
        others = [f.name for f in dataclasses.fields(output) if f.name != "sample"]
        if all(getattr(output, name) is None for name in others):
            kind = type(output)  # not the output itself, which would keep its tensors alive
            return lambda tensors: kind(sample=tensors[0])
    return None


def _leaves(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    return list(output) if isinstance(output, tuple) else [output.sample]


def decode_in_slices(
    module: nn.Module, decode: Callable[..., Any], z: torch.Tensor, k: int, args: Any, kwargs: Any
) -> tuple[Any, int, int] | None:
    """``decode(z, *args, **kwargs)`` in slices of ``k`` samples along dim 0, with ``module``'s own slicing off
    (``use_slicing`` is put back afterwards), the slices' outputs concatenated as diffusers' own slicing does (by 1,
    this is its computation and its peak). Gives what the decode gives for the whole batch (the same type), the size
    of the last slice and the output's bytes; ``None`` (after one slice) where the output is not a batch of tensors
    that can be put together.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> vae = nn.Module(); vae.use_slicing = True
        >>> calls = []
        >>> def decode(z, return_dict=True):
        ...     calls.append((len(z), vae.use_slicing))
        ...     return (z * 2,)
        >>> output, last, nbytes = decode_in_slices(vae, decode, torch.ones(5, 3), 2, (), {"return_dict": False})
        >>> calls, output[0].shape, last, nbytes, vae.use_slicing
        ([(2, False), (2, False), (1, False)], torch.Size([5, 3]), 1, 60, True)
    """
    n, slices = int(z.shape[0]), z.split(k)
    parts: list[list[torch.Tensor]] = []
    rebuild, slicing = None, module.use_slicing
    module.use_slicing = False
    try:
        for piece in slices:
            output = decode(piece, *args, **kwargs)
            if rebuild is None:
                rebuild = _rebuild(output)
                if len(slices) == 1:
                    return output, n, sum(t.numel() * t.element_size() for t in _leaves(output)) if rebuild else 0
                if rebuild is None or any(t.dim() == 0 or t.shape[0] != len(piece) for t in _leaves(output)):
                    return None
            parts.append(_leaves(output))
            del output  # only its tensors are kept
    finally:
        module.use_slicing = slicing
    whole = [torch.cat(tensors) for tensors in zip(*parts, strict=True)]
    del parts
    return rebuild(whole), len(slices[-1]), sum(t.numel() * t.element_size() for t in whole)


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
