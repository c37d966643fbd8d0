"""What one op computes, and what it costs: :func:`flops` counts an op's FLOPs and :func:`op_seconds` prices it at
a device's speeds; a dry run's :class:`~lightning_memopt.timeline.Timeline` records both for every op, and sums them
for the forward pass and per module running again in the backward pass (marked by :func:`recomputing`: a
checkpointed block, a chunk whose intermediate is recomputed). Costly ops (matrix products, convolutions, attention:
those ``torch.utils.flop_counter.FlopCounterMode`` counts) by its formulas, every other op that computes something
one FLOP per output element (an estimate: a norm or a softmax costs a few), views and copies of metadata nothing.
Priced at a :class:`~lightning_memopt.timing.Speed`, a segment's recomputation and the ops run through a selective
policy (marked by :func:`policed`) cost their extra.

Examples:
    >>> x, w = torch.ones(2, 8), torch.ones(4, 8)
    >>> flops(torch.ops.aten.mm.default, (x, w.t()), {}, x @ w.t())  # 2 x 8 x 4 multiply-adds
    128
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from lightning_memopt.compat import HigherOrderOperator, costly_flop_formulas, op_tensors


@functools.cache
def _formulas() -> dict[Any, Any]:
    return costly_flop_formulas()


def _packet(func: Any) -> Any:
    return getattr(func, "overloadpacket", func)


def costly(func: Any) -> bool:
    """Whether ``func`` is an op whose output a selective block keeps (one FlopCounterMode counts)."""
    return _packet(func) in _formulas()


@functools.cache
def _attention_ops() -> frozenset[Any]:
    return frozenset(p for p in _formulas() if "attention" in str(p) and "backward" not in str(p))


def attention(func: Any) -> bool:
    """Whether ``func`` is a fused attention kernel, whose output an ``"attention"`` block keeps."""
    return _packet(func) in _attention_ops()


#: The blocks recomputing now, innermost last (pushed by the checkpoint function while a block runs again).
_RECOMPUTING: list[Any] = []


#: The selective blocks running now, whose ops pass through their policy's dispatch mode.
_POLICED: list[Any] = []
#: The timelines pricing ops now: each is told when a segment's recomputation starts (``spend``).
SPENDING: list[Any] = []


@contextlib.contextmanager
def recomputing(block: Any) -> Iterator[None]:
    """Marks ``block`` (a module, or ``None`` when unknown) as running again in the backward pass: one checkpointed
    segment's recomputation."""
    _RECOMPUTING.append(block)
    try:
        for timeline in SPENDING:
            timeline.spend(timeline.speed.call_s)
        yield
    finally:
        _RECOMPUTING.pop()


def in_recomputation() -> bool:
    """Whether a checkpointed segment runs again now (its block known or not)."""
    return bool(_RECOMPUTING)


def recomputing_now() -> Any:
    """The block whose checkpointed segment runs again now (the outermost, where one runs inside another), or
    ``None``."""
    return _RECOMPUTING[0] if _RECOMPUTING else None


@contextlib.contextmanager
def policed(block: Any) -> Iterator[None]:
    """Marks ``block`` as running under a selective checkpoint's policy (forward or recomputation)."""
    _POLICED.append(block)
    try:
        yield
    finally:
        _POLICED.pop()


def policed_now() -> bool:
    """Whether a selective policy's dispatch mode routes the ops running now."""
    return bool(_POLICED)


def nbytes(args: Any, out: Any) -> int:
    """The bytes of the tensors an op reads and writes.

    Examples:
        >>> nbytes(((torch.ones(2, 3), [torch.ones(4, dtype=torch.float16)]), {"alpha": 2}), torch.ones(3))
        44
    """
    return sum(t.numel() * t.element_size() for t in op_tensors((args, out)))


def flops(func: Any, args: Any, kwargs: Any, out: Any) -> int:
    """FLOPs of one op: FlopCounterMode's formula for costly ops, else one per output element (none for views and
    ops that compute nothing, and for a higher-order operator, whose inner ops are counted as they run)."""
    if isinstance(func, HigherOrderOperator):
        return 0
    formula = _formulas().get(_packet(func))
    if formula is not None:
        return int(formula(*args, **(kwargs or {}), out_val=out))
    if getattr(func, "is_view", False) or func in _FREE:
        return 0
    return sum(t.numel() for t in op_tensors(out))


#: Ops that move no data: views aside, those that allocate without writing or only change metadata.
_NO_TRAFFIC = {
    torch.ops.aten.detach.default,
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.lift_fresh.default,
    torch.ops.aten._unsafe_view.default,
}
#: Ops that compute nothing: those, and fills and copies.
_FREE = _NO_TRAFFIC | {
    torch.ops.aten.zeros_like.default,
    torch.ops.aten.zeros.default,
    torch.ops.aten.ones_like.default,
    torch.ops.aten.copy_.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default,
}


def op_seconds(speed: Any, func: Any, args: Any, kwargs: Any, out: Any, count: int | None = None) -> float:
    """The predicted time of one op at ``speed`` (a :class:`~lightning_memopt.timing.Speed`), given its FLOPs
    (``count``) where they are known, and its policy's dispatch where a selective block routes it (nothing for a
    higher-order operator: its inner ops are priced as they run)."""
    if isinstance(func, HigherOrderOperator):
        return 0.0
    count = flops(func, args, kwargs, out) if count is None else count
    moved = 0 if getattr(func, "is_view", False) or func in _NO_TRAFFIC else nbytes((args, kwargs), out)
    return speed.op(count, moved) + (speed.policy_op_s if _POLICED else 0.0)
