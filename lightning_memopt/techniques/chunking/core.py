"""The mechanics of feed-forward chunking: run a token-wise layer on slices of its input, so one slice's activations
live at once; each block's unit and settings."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_memopt.adapters.base import LengthsFn
from lightning_memopt.handles import AttributeOverride

WriteFn = Callable[[nn.Module, int, "int | None"], None]


@dataclass(frozen=True)
class ChunkConfig:
    """How feed-forward layers are chunked.

    Args:
        chunk_size: The number of positions along ``dim`` in one slice. Smaller slices need less memory and more calls.
        dim: The dimension that is sliced: ``1`` is the sequence (the default), ``0`` the batch. Blocks whose library
            fixes the dimension keep their own.

    Examples:
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
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim not in (0, 1):
            raise ValueError(f"`dim` must be 0 (batch) or 1 (sequence), got {self.dim!r}")


def largest_divisor(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is at most ``limit``: a chunk size that is valid for a length ``n``.

    Examples:
        >>> largest_divisor(12, 5), largest_divisor(7, 2), largest_divisor(8, 100)
        (4, 1, 8)
    """
    for size in range(min(n, limit), 0, -1):
        if n % size == 0:
            return size
    return 1


class ChunkUnit:
    """One block's feed-forward chunking, which can be changed between calls.

    The block reads ``size`` and ``dim`` on every call, so a tuner can change them while a run goes on.

    Attributes:
        name: The block's path, such as ``transformer.transformer_blocks.0``.
        module: The block's module (its calls delimit the block when peaks are measured per block).
        dims: The dimensions this block can chunk.
        dim: The dimension chunked now.
        size: Positions per slice now, or ``None`` for no chunking.
        lengths: The length along each allowed dimension in the block's last call.
        lengths_of: Reads those lengths from a call's ``(args, kwargs)``, before the call runs.
        slices: Feed-forward slices run so far (an unchunked call counts one).

    Examples:
        >>> unit = ChunkUnit("block", dims=(0, 1), dim=1, size=4)
        >>> unit.lengths = {0: 2, 1: 10}
        >>> unit.slices_per_call(divisor=True), unit.slices_per_call(divisor=False)
        (5, 3)
    """

    def __init__(
        self, name: str, dims: tuple[int, ...], dim: int, size: int | None, module: nn.Module | None = None
    ) -> None:
        self.name = name
        self.module = module
        self.dims = dims
        self.dim = dim if dim in dims else dims[0]
        self.size = size
        self.lengths: dict[int, int] = {}
        self.lengths_of: LengthsFn = _leading_lengths
        self.slices = 0

    def set(self, dim: int, size: int | None) -> None:
        """Chunk ``dim`` in slices of ``size`` from the next call on (``None``: no chunking)."""
        if dim not in self.dims:
            raise ValueError(f"{self.name} can chunk dims {self.dims}, got {dim!r}")
        self.dim, self.size = dim, size

    def slice_size(self, length: int, divisor: bool) -> int | None:
        """The slice for ``length``: the largest divisor up to ``size`` where the library needs one."""
        if self.size is None or length <= self.size:
            return None
        return largest_divisor(length, self.size) if divisor else self.size

    def slices_per_call(self, divisor: bool) -> int:
        length = self.lengths.get(self.dim, 0)
        size = self.slice_size(length, divisor)
        return 1 if size is None else -(-length // size)

    def __repr__(self) -> str:
        return f"ChunkUnit({self.name!r}, dim={self.dim}, size={self.size})"


def _leading_lengths(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int, int]:
    """Dims 0 and 1 of the first input, when it has at least 3 dims (the feature dim is never chunked)."""
    x = args[0] if args else None
    return {0: x.shape[0], 1: x.shape[1]} if isinstance(x, torch.Tensor) and x.dim() >= 3 else {}


def apply_feed_forward_chunking(module: nn.Module, unit: ChunkUnit) -> AttributeOverride:
    """Chunk a token-wise feed-forward module that has no switch of its own.

    On each call the module's first input is split along ``unit.dim`` into slices of ``unit.size`` (the last may be
    shorter), and so is every other tensor argument with the same leading dims (a residual added inside, as BLOOM's MLP
    takes); each slice is made contiguous (modules that ``view`` their input, as GPT-2's ``Conv1D`` does, need it) and
    the outputs are concatenated. This is exact for layers that treat every position independently, as transformer
    MLPs do. Inputs with fewer than 3 dimensions are passed through unchunked, so the feature dimension is never split.

    Returns:
        A handle whose ``remove()`` restores the original ``forward``.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> mlp = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4))
        >>> x = torch.randn(2, 6, 4)
        >>> expected = mlp(x)
        >>> handle = apply_feed_forward_chunking(mlp, ChunkUnit("mlp", (0, 1), dim=1, size=4))
        >>> torch.allclose(mlp(x), expected, atol=1e-6)
        True
        >>> handle.remove()
    """

    def chunked(original: Callable[..., Any]) -> Callable[..., Any]:
        return functools.partial(_chunked_forward, unit, original)

    return AttributeOverride.wrap(module, "forward", chunked)


def _chunked_forward(unit: ChunkUnit, original: Callable[..., Any], x: Any, *args: Any, **kwargs: Any) -> Any:
    """One call of a chunked module (see :func:`apply_feed_forward_chunking`); ``original`` runs one slice."""
    unit.lengths = _leading_lengths((x,), kwargs)
    if not unit.lengths:
        return original(x, *args, **kwargs)
    size = unit.slice_size(x.shape[unit.dim], divisor=False)
    if size is None:
        unit.slices += 1
        return original(x, *args, **kwargs)
    lead = x.shape[:2]

    def pieces(value: Any) -> Any:  # a tensor that runs along x is cut with it; anything else is passed whole
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == lead:
            return [p.contiguous() for p in value.split(size, dim=unit.dim)]
        return None

    parts = pieces(x)
    others = [pieces(a) for a in args]
    named = {k: pieces(v) for k, v in kwargs.items()}
    unit.slices += len(parts)
    outputs = []
    for i, part in enumerate(parts):
        call_args = [o[i] if o is not None else a for o, a in zip(others, args, strict=True)]
        call_kwargs = {k: named[k][i] if named[k] is not None else v for k, v in kwargs.items()}
        outputs.append(original(part, *call_args, **call_kwargs))
    return torch.cat(outputs, dim=unit.dim)


def apply_divisor_chunking(module: nn.Module, unit: ChunkUnit, lengths: LengthsFn, write: WriteFn) -> RemovableHandle:
    """Drive a library's own chunking switch so that its chunk size always divides the length the block sees.

    Libraries such as diffusers and transformers raise when a chunk size does not divide the chunked length, and one
    model can chunk different lengths in different blocks (Latte's spatial and temporal blocks). Before every call the
    block's lengths are read from its inputs and ``write(module, dim, size)`` sets the library's attributes to the
    largest divisor of the length that is at most ``unit.size`` (``size=None``: no chunking, also when the lengths
    cannot be read).

    Returns:
        The hook's handle; restoring the attributes is the caller's part.

    Examples:
        >>> from torch import nn
        >>> block = nn.Identity()
        >>> unit = ChunkUnit("block", dims=(1,), dim=1, size=4)
        >>> write = lambda mod, dim, size: setattr(mod, "chunk", size)
        >>> handle = apply_divisor_chunking(block, unit, lambda args, kwargs: {1: args[0].shape[1]}, write)
        >>> _ = block(torch.zeros(1, 6, 2)); block.chunk, unit.slices
        (3, 2)
        >>> handle.remove()
    """
    cache: dict[tuple[int, int, int], int | None] = {}
    unit.lengths_of = lengths

    def pre_hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            unit.lengths = {d: int(n) for d, n in lengths(args, kwargs).items()}
        except (IndexError, KeyError, AttributeError, TypeError):
            unit.lengths = {}
        length = unit.lengths.get(unit.dim)
        if length is None:
            write(mod, unit.dim, None)
            return
        key = (length, unit.dim, unit.size or 0)
        if key not in cache:
            cache[key] = unit.slice_size(length, divisor=True)
        size = cache[key]
        unit.slices += 1 if size is None else length // size
        write(mod, unit.dim, size)

    return module.register_forward_pre_hook(pre_hook, with_kwargs=True)


@dataclass(frozen=True)
class Setting:
    """How one block chunks: along ``dim`` in slices of ``size`` (``None``: not chunked), ``slices`` per call."""

    dim: int
    size: int | None
    slices: int


def current(unit: ChunkUnit) -> Setting:
    return Setting(unit.dim, unit.size, unit.slices_per_call(divisor=True))


def candidates(unit: ChunkUnit) -> list[Setting]:
    """Every valid chunked setting of a block, coarsest first: on each allowed dim, the sizes that divide its length.

    Where two dims give the same number of slices, the block's own dim wins.

    Examples:
        >>> unit = ChunkUnit("block", dims=(0, 1), dim=1, size=None)
        >>> unit.lengths = {0: 2, 1: 6}
        >>> [(s.dim, s.size, s.slices) for s in candidates(unit)]
        [(1, 3, 2), (1, 2, 3), (1, 1, 6)]
    """
    found: dict[int, Setting] = {}
    for dim in sorted(unit.dims, key=lambda d: d != unit.dim):
        length = unit.lengths.get(dim, 0)
        for size in range(length - 1, 0, -1):
            if length % size == 0 and length // size not in found:
                found[length // size] = Setting(dim, size, length // size)
    return [found[n] for n in sorted(found)]


def finer(unit: ChunkUnit, setting: Setting) -> Setting | None:
    """The next finer setting of a block, or ``None`` at its finest. A block that never ran (its lengths unknown)
    halves its slice, down to one position.

    Examples:
        >>> unit = ChunkUnit("block", dims=(1,), dim=1, size=None)
        >>> finer(unit, current(unit))
        Setting(dim=1, size=1, slices=1)
        >>> unit.lengths = {1: 8}
        >>> finer(unit, Setting(1, 4, 2))
        Setting(dim=1, size=2, slices=4)
    """
    options = [c for c in candidates(unit) if c.slices > setting.slices]
    if options:
        return options[0]
    if not unit.lengths and setting.size != 1:
        return Setting(unit.dim, max(1, (setting.size or 2) // 2), setting.slices)
    return None


def describe(settings: dict[str, Setting]) -> str:
    """A short text of a set of settings.

    Examples:
        >>> describe({"a": Setting(1, 2, 8), "b": Setting(1, 2, 8), "c": Setting(0, None, 1)})
        '3 blocks: 2 dim 1 size 2, 1 off'
    """
    counts: dict[str, int] = {}
    for s in settings.values():
        key = "off" if s.size is None else f"dim {s.dim} size {s.size}"
        counts[key] = counts.get(key, 0) + 1
    total = sum(counts.values())
    parts = ", ".join(f"{n} {key}" for key, n in sorted(counts.items()))
    return f"{total} block{'s' if total != 1 else ''}: {parts}"
