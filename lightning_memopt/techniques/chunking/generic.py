"""Plain torch models, and the feed-forward modules a library's switch does not reach: MemOpt's wrapper slices each
token-wise feed-forward module found by class name, and each ``nn.TransformerEncoderLayer`` along its batch."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_memopt.adapters.base import find_outermost
from lightning_memopt.adapters.torch_generic import find_feed_forward
from lightning_memopt.handles import AttributeOverride, HandleGroup
from lightning_memopt.techniques.base import Change
from lightning_memopt.techniques.chunking.core import ChunkConfig, ChunkUnit, apply_feed_forward_chunking


def chunk(model: nn.Module, config: ChunkConfig, skip: list[nn.Module]) -> Change | None:
    """Chunk the feed-forward modules of ``model`` outside ``skip``, and its ``nn.TransformerEncoderLayer`` s by batch
    (their feed-forward is inline, :func:`apply_batch_chunking`) where they run torch's Python path. A layer that is
    batch first runs torch's fused inference kernel when it has no gradients to keep, whose own buffers neither a dry
    run nor the CPU's count sees: it is left whole, with a warning."""
    layers = find_outermost(model, lambda m: isinstance(m, nn.TransformerEncoderLayer), skip)
    fused = sum(m.self_attn.batch_first for m in layers)
    parts = [
        chunk_modules(model, find_feed_forward(model, [*skip, *layers]), config),
        _chunk_layers(model, [m for m in layers if not m.self_attn.batch_first], config),
    ]
    found = [c for c in parts if c is not None]
    if not found and not fused:
        return None
    return Change(
        ", and ".join(c.method for c in found),
        sum(c.blocks for c in found),
        HandleGroup([c.handle for c in found]),
        [u for c in found for u in c.units],
        skipped=[
            f"{fused} TransformerEncoderLayer (batch_first=True) left whole: without gradients torch runs each as one"
            " fused kernel, whose buffers MemOpt can neither see nor cut exactly (batch_first=False layers are chunked)"
        ]
        if fused
        else [],
    )


def _chunk_layers(model: nn.Module, layers: list[nn.Module], config: ChunkConfig) -> Change | None:
    """Batch chunking of the given ``nn.TransformerEncoderLayer`` s, whose inputs are (sequence, batch, features)."""
    if not layers:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    units = [ChunkUnit(names[id(m)], (1,), 1, config.chunk_size, m) for m in layers]
    handle = HandleGroup(apply_batch_chunking(m, u) for m, u in zip(layers, units, strict=True))
    return Change("generic chunking of TransformerEncoderLayer by batch", len(layers), handle, units)


def chunk_modules(model: nn.Module, modules: list[nn.Module], config: ChunkConfig) -> Change | None:
    """Generic chunking of the given token-wise modules of ``model``, as one :class:`Change`."""
    if not modules:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    units = [ChunkUnit(names[id(m)], (0, 1), config.dim, config.chunk_size, m) for m in modules]
    handle = HandleGroup(apply_feed_forward_chunking(m, u) for m, u in zip(modules, units, strict=True))
    kinds = ", ".join(sorted({type(m).__name__ for m in modules}))
    return Change(f"generic chunking of {kinds}", len(modules), handle, units)


def apply_batch_chunking(layer: nn.Module, unit: ChunkUnit) -> AttributeOverride:
    """Run an ``nn.TransformerEncoderLayer`` on slices of ``unit.size`` batch elements (``unit.dim``, its batch dim)
    and concatenate them: each element attends only to itself, so the outputs are those of one call, up to the float
    rounding of kernels that see fewer rows (as the feed-forward's slices are). Its feed-forward
    is inline in the layer (``_ff_block``), so this is how its hidden activations are cut (its attention's too). A call
    with a 3-D attention mask (one per batch element and head) or a nested tensor runs whole.

    Returns:
        A handle whose ``remove()`` restores the original ``forward``.

    Examples:
        >>> layer = nn.TransformerEncoderLayer(8, 2, 32, dropout=0.0).eval()  # (sequence, batch, features)
        >>> x = torch.randn(5, 4, 8)
        >>> with torch.no_grad():
        ...     expected = layer(x)
        ...     handle = apply_batch_chunking(layer, ChunkUnit("layer", (1,), dim=1, size=1))
        ...     torch.allclose(layer(x), expected, atol=1e-6)
        True
        >>> handle.remove()
    """
    unit.lengths_of = functools.partial(_batch_length, unit.dim)

    def chunked(original: Callable[..., Any]) -> Callable[..., Any]:
        return functools.partial(_batch_chunked_forward, unit, original)

    return AttributeOverride.wrap(layer, "forward", chunked)


def _batch_length(dim: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int, int]:
    src = args[0] if args else kwargs.get("src")
    ok = isinstance(src, torch.Tensor) and src.dim() == 3 and not src.is_nested
    return {dim: src.shape[dim]} if ok else {}


def _batch_chunked_forward(unit: ChunkUnit, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """One call of a layer chunked by batch (see :func:`apply_batch_chunking`)."""
    bound = dict(zip(("src", "src_mask", "src_key_padding_mask", "is_causal"), args, strict=False)) | kwargs
    unit.lengths = _batch_length(unit.dim, (), bound)
    mask = bound.get("src_mask")
    size = unit.slice_size(unit.lengths[unit.dim], divisor=False) if unit.lengths else None
    if size is None or (isinstance(mask, torch.Tensor) and mask.dim() == 3):
        unit.slices += 1
        return original(*args, **kwargs)
    src, padding = bound.pop("src"), bound.pop("src_key_padding_mask", None)
    parts = src.split(size, dim=unit.dim)
    paddings = padding.split(size, dim=0) if isinstance(padding, torch.Tensor) else [padding] * len(parts)
    unit.slices += len(parts)
    outputs = [
        original(part.contiguous(), src_key_padding_mask=pad, **bound)
        for part, pad in zip(parts, paddings, strict=True)
    ]
    return torch.cat(outputs, dim=unit.dim)
