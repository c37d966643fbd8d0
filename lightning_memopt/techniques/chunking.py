"""Feed-forward chunking: run a token-wise layer on slices of its input, so one slice's activations live at once."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_memopt.techniques.handles import AttributeSnapshot, ForwardOverride, HandleGroup


@dataclass(frozen=True)
class ChunkConfig:
    """How feed-forward layers are chunked.

    Args:
        chunk_size: The number of positions along ``dim`` in one slice. Smaller slices need less memory and more calls.
        dim: The dimension that is sliced: ``1`` is the sequence (the default), ``0`` the batch. Blocks whose library
            fixes the dimension keep their own.

    Example:
        >>> ChunkConfig(chunk_size=4)
        ChunkConfig(chunk_size=4, dim=1)
        >>> ChunkConfig(chunk_size=0)
        Traceback (most recent call last):
        ...
        ValueError: `chunk_size` must be a positive int, got 0
    """

    chunk_size: int = 2
    dim: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"`chunk_size` must be a positive int, got {self.chunk_size!r}")
        if self.dim not in (0, 1):
            raise ValueError(f"`dim` must be 0 (batch) or 1 (sequence), got {self.dim!r}")


def largest_divisor(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is at most ``limit``: a chunk size that is valid for a length ``n``.

    Example:
        >>> largest_divisor(12, 5), largest_divisor(7, 2), largest_divisor(8, 100)
        (4, 1, 8)
    """
    for size in range(min(n, limit), 0, -1):
        if n % size == 0:
            return size
    return 1


def _chunked(original: Callable[..., Any], config: ChunkConfig, x: Any, *args: Any, **kwargs: Any) -> Any:
    dim = config.dim
    if not isinstance(x, torch.Tensor) or x.dim() < 3 or x.shape[dim] <= config.chunk_size:
        return original(x, *args, **kwargs)
    return torch.cat([original(part, *args, **kwargs) for part in x.split(config.chunk_size, dim=dim)], dim=dim)


def apply_feed_forward_chunking(module: nn.Module, config: ChunkConfig) -> ForwardOverride:
    """Chunk a token-wise feed-forward module that has no switch of its own.

    The module's first input is split along ``config.dim`` into slices of ``config.chunk_size`` (the last may be
    shorter) and the outputs are concatenated. This is exact for layers that treat every position independently, as
    transformer MLPs do. Inputs with fewer than 3 dimensions are passed through unchunked, so the feature dimension is
    never split.

    Returns:
        A handle whose ``remove()`` restores the original ``forward``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> mlp = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4))
        >>> x = torch.randn(2, 6, 4)
        >>> expected = mlp(x)
        >>> handle = apply_feed_forward_chunking(mlp, ChunkConfig(chunk_size=2))
        >>> torch.allclose(mlp(x), expected, atol=1e-6)
        True
        >>> handle.remove()
    """
    original = module.forward

    def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
        return _chunked(original, config, x, *args, **kwargs)

    return ForwardOverride(module, forward)


LengthsFn = Callable[[tuple[Any, ...], dict[str, Any]], Sequence[int]]


def apply_divisor_chunking(
    module: nn.Module, attribute: str, chunk_size: int, lengths: LengthsFn, off: Any
) -> HandleGroup:
    """Drive a library's own chunk-size attribute so it always divides the lengths the block sees.

    Libraries such as diffusers and transformers raise when a chunk size does not divide the chunked length, and one
    model can chunk different lengths in different blocks (Latte's spatial and temporal blocks). Before every call,
    ``module.<attribute>`` is set to the largest divisor of the lengths that is at most ``chunk_size``; when the
    lengths cannot be read it is set to ``off`` and the call runs unchunked.

    Args:
        module: The block that owns the attribute.
        attribute: The attribute the library reads, such as ``_chunk_size`` or ``chunk_size_feed_forward``.
        chunk_size: The largest slice wanted.
        lengths: Maps the block's ``(args, kwargs)`` to the lengths it will chunk.
        off: The attribute's value that switches chunking off.

    Returns:
        A handle that removes the hook and restores the attribute.

    Example:
        >>> from torch import nn
        >>> block = nn.Identity()
        >>> handle = apply_divisor_chunking(block, "chunk", 4, lambda args, kwargs: [args[0].shape[1]], off=None)
        >>> _ = block(torch.zeros(1, 6, 2)); block.chunk
        3
        >>> handle.remove(); hasattr(block, "chunk")
        False
    """
    snapshot = AttributeSnapshot([module], (attribute,))
    cache: dict[int, int] = {}

    def pre_hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            found = [int(n) for n in lengths(args, kwargs)]
        except (IndexError, KeyError, AttributeError, TypeError):
            found = []
        if not found:
            mod.__dict__[attribute] = off
            return
        n = math.gcd(*found)
        if n not in cache:
            cache[n] = largest_divisor(n, chunk_size)
        mod.__dict__[attribute] = cache[n]

    hook: RemovableHandle = module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    return HandleGroup([snapshot, hook])
