"""Counting what a step computes, in a dry run: :class:`FlopCount` counts the forward pass's FLOPs and those
recomputed in the backward pass, per module running again (marked by :func:`recomputing`: a checkpointed block, a
chunk whose intermediate is recomputed). Costly ops (matrix products, convolutions, attention: those
``torch.utils.flop_counter.FlopCounterMode`` counts) by its formulas, every other op that computes something one FLOP
per output element (an estimate: a norm or a softmax costs a few), views and copies of metadata nothing. Given a
:class:`~lightning_memopt.timing.Speed`, it also prices every op of the step, backward pass included, in predicted
seconds (a segment's recomputation and the ops run through a selective policy, marked by :func:`policed`, at their
extra cost).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_memopt.compat import (
    HigherOrderOperator,
    TorchDispatchMode,
    costly_flop_formulas,
    in_backward,
    run_op,
    tree_flatten,
)


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
#: The counts pricing ops now (see :class:`FlopCount`).
_PRICING: list[FlopCount] = []


@contextlib.contextmanager
def recomputing(block: Any) -> Iterator[None]:
    """Marks ``block`` (a module, or ``None`` when unknown) as running again in the backward pass: one checkpointed
    segment's recomputation."""
    _RECOMPUTING.append(block)
    try:
        for count in _PRICING:
            count.spend(count.speed.call_s)
        yield
    finally:
        _RECOMPUTING.pop()


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


def nbytes(args: Any, out: Any) -> int:
    """The bytes of the tensors an op reads and writes."""
    return sum(t.numel() * t.element_size() for t in tree_flatten((args, out))[0] if isinstance(t, torch.Tensor))


def flops(func: Any, args: Any, kwargs: Any, out: Any) -> int:
    """FLOPs of one op: FlopCounterMode's formula for costly ops, else one per output element (none for views and
    ops that compute nothing)."""
    formula = _formulas().get(_packet(func))
    if formula is not None:
        return int(formula(*args, **(kwargs or {}), out_val=out))
    if getattr(func, "is_view", False) or func in _FREE:
        return 0
    return sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))


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


class FlopCount(TorchDispatchMode):
    """While active, counts FLOPs (see :func:`flops`): those of the forward pass (every op before the first op of a
    backward pass) and those recomputed in the backward pass, in all, per block recomputing (the module the
    checkpoint function ran again, see :func:`recomputing`) and in fused attention kernels apart. It keeps no tensor,
    so the memory a step holds is the same with it.

    With ``speed`` (a :class:`~lightning_memopt.timing.Speed`), every op of the step is priced too: ``seconds`` is the
    predicted time of all of them, and ``charge`` (where given) gets each op's price as it runs, for a caller that
    shares the time out (the planner, per row of its table).

    Examples:
        >>> from torch import nn
        >>> linear, x = nn.Linear(8, 4), torch.ones(2, 8)
        >>> with FlopCount() as count:
        ...     _ = linear(x)
        >>> count.forward  # 2 x 8 x 4 multiply-adds, the bias added inside addmm
        128
    """

    def __init__(self, speed: Any = None, charge: Callable[[float], None] | None = None) -> None:
        super().__init__()
        self.forward = 0
        self.recomputed = 0
        self.recomputed_attention = 0  # those in fused attention kernels
        self.by_block: dict[int, int] = {}  # id(module) running again: its FLOPs
        self.attention_by_block: dict[int, int] = {}  # id(module) running again: its FLOPs in fused attention
        self.speed = speed
        self.seconds = 0.0  # the predicted time of every op (with ``speed``)
        self.policed = 0  # ops run through a selective policy's dispatch mode, forward and recomputation
        self._charge = charge
        self._backward = False
        self._aside: list[float] | None = None  # while set, ops are priced into it and counted nowhere else

    @contextlib.contextmanager
    def aside(self) -> Iterator[list[float]]:
        """While open, ops are not counted in the step: only their predicted seconds are summed, into the one-item
        list it yields (a module run again alone, to price another setting of it)."""
        saved, self._aside = self._aside, [0.0]
        try:
            yield self._aside
        finally:
            self._aside = saved

    def __enter__(self) -> FlopCount:
        if self.speed is not None:
            _PRICING.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self in _PRICING:
            _PRICING.remove(self)
        return super().__exit__(*exc)

    def spend(self, seconds: float) -> None:
        self.seconds += seconds
        if self._charge is not None:
            self._charge(seconds)

    #: Higher-order operators (flex_attention) reach this mode: one with a plain implementation is counted op by op.
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = run_op(self, func, args, kwargs or {})
        if isinstance(func, HigherOrderOperator):
            return out  # its inner ops were counted, or (without a plain implementation) it has no formula
        if self._aside is not None:
            if self.speed is not None:
                self._aside[0] += op_seconds(self.speed, func, args, kwargs, out)
            return out
        count = None
        if _RECOMPUTING:
            count = flops(func, args, kwargs, out)
            self.recomputed += count
            key = id(_RECOMPUTING[0])
            self.by_block[key] = self.by_block.get(key, 0) + count
            if attention(func):
                self.recomputed_attention += count
                self.attention_by_block[key] = self.attention_by_block.get(key, 0) + count
        elif in_backward():
            self._backward = True
        elif not self._backward:
            count = flops(func, args, kwargs, out)
            self.forward += count
        self.policed += bool(_POLICED)
        if self.speed is not None:
            self.spend(op_seconds(self.speed, func, args, kwargs, out, count))
        return out


def op_seconds(speed: Any, func: Any, args: Any, kwargs: Any, out: Any, count: int | None = None) -> float:
    """The predicted time of one op at ``speed`` (a :class:`~lightning_memopt.timing.Speed`), given its FLOPs
    (``count``) where they are known, and its policy's dispatch where a selective block routes it."""
    count = flops(func, args, kwargs, out) if count is None else count
    moved = 0 if getattr(func, "is_view", False) or func in _NO_TRAFFIC else nbytes((args, kwargs), out)
    return speed.op(count, moved) + (speed.policy_op_s if _POLICED else 0.0)
