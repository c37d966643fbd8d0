"""Selective recomputation, and what recomputation costs.

A checkpointed block set to ``"selective"`` keeps, for the backward pass, the outputs of its costly ops (matrix
products, convolutions, attention: the ops ``torch.utils.flop_counter.FlopCounterMode`` counts) and recomputes the
rest (norms, activations, dropout, elementwise ops) from them. Set to ``"attention"``, it keeps only the outputs of
its fused attention kernels (``scaled_dot_product_attention``'s), the ops that cost the most FLOPs per byte they
keep, and recomputes the rest, matrix products included. Set to ``"full"``, it keeps only its inputs and runs its
whole forward again. The mechanism is torch's: :func:`torch.utils.checkpoint.checkpoint` with a
:func:`~torch.utils.checkpoint.create_selective_checkpoint_contexts` policy. Random ops are recomputed under the
random state of the first run, so the results are the same as without checkpointing, dropout included.

:class:`FlopCount` counts what a step computes, in a dry run: the costly ops by FlopCounterMode's formulas, every
other op that computes something one FLOP per output element (an estimate: a norm or a softmax costs a few), views
and copies of metadata nothing. Ops run while a checkpointed block recomputes are counted for that block.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> from torch.utils.checkpoint import checkpoint
    >>> block = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> out = checkpoint(block, x, use_reentrant=False, context_fn=selective_contexts)
    >>> out.sum().backward()
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_memopt.compat import TorchDispatchMode, costly_flop_formulas, in_backward, tree_flatten

#: A checkpointed block's settings, from the most memory kept to the least: its activations kept (``none``), its
#: costly ops' outputs kept (``selective``), its fused attention's outputs kept (``attention``), its inputs kept at
#: the granularity of the model's own switch (``full``: a diffusers block checkpoints each of its resnets and
#: attentions), and only the block's inputs (``whole``: the block as one segment, where the switch checkpoints parts
#: of it).
MODES = ("none", "selective", "attention", "full", "whole")
#: The modes run by a checkpoint with a policy of what to keep (:func:`contexts`).
POLICIES = ("selective", "attention")


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


def _policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if costly(func) else CheckpointPolicy.PREFER_RECOMPUTE


def _attention_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if attention(func) else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> tuple[Any, Any]:
    """The ``context_fn`` of a selective checkpoint: costly ops' outputs kept, the rest recomputed."""
    return create_selective_checkpoint_contexts(_policy)


def attention_contexts() -> tuple[Any, Any]:
    """The ``context_fn`` of an ``"attention"`` checkpoint: fused attention's outputs kept, the rest recomputed."""
    return create_selective_checkpoint_contexts(_attention_policy)


_CONTEXTS = {"selective": selective_contexts, "attention": attention_contexts}


def contexts(mode: str) -> Any:
    """The ``context_fn`` a checkpoint in ``mode`` runs under (``None`` for one that keeps only its inputs)."""
    return _CONTEXTS.get(mode)


#: The blocks recomputing now, innermost last (pushed by the checkpoint function while a block runs again).
_RECOMPUTING: list[Any] = []


@contextlib.contextmanager
def recomputing(block: Any) -> Iterator[None]:
    """Marks ``block`` (a module, or ``None`` when unknown) as running again in the backward pass."""
    _RECOMPUTING.append(block)
    try:
        yield
    finally:
        _RECOMPUTING.pop()


def flops(func: Any, args: Any, kwargs: Any, out: Any) -> int:
    """FLOPs of one op: FlopCounterMode's formula for costly ops, else one per output element (none for views and
    ops that compute nothing)."""
    formula = _formulas().get(_packet(func))
    if formula is not None:
        return int(formula(*args, **(kwargs or {}), out_val=out))
    if getattr(func, "is_view", False) or func in _FREE:
        return 0
    return sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))


_FREE = {
    torch.ops.aten.detach.default,
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.zeros_like.default,
    torch.ops.aten.zeros.default,
    torch.ops.aten.ones_like.default,
    torch.ops.aten.copy_.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.lift_fresh.default,
    torch.ops.aten._unsafe_view.default,
}


class FlopCount(TorchDispatchMode):
    """While active, counts FLOPs (see :func:`flops`): those of the forward pass (every op before the first op of a
    backward pass) and those recomputed in the backward pass, in all, per block recomputing (the module the
    checkpoint function ran again, see :func:`recomputing`) and in fused attention kernels apart. It keeps no tensor,
    so the memory a step holds is the same with it.

    Examples:
        >>> from torch import nn
        >>> linear, x = nn.Linear(8, 4), torch.ones(2, 8)
        >>> with FlopCount() as count:
        ...     _ = linear(x)
        >>> count.forward  # 2 x 8 x 4 multiply-adds, the bias added inside addmm
        128
    """

    def __init__(self) -> None:
        super().__init__()
        self.forward = 0
        self.recomputed = 0
        self.recomputed_attention = 0  # those in fused attention kernels
        self.by_block: dict[int, int] = {}  # id(module) running again: its FLOPs
        self._backward = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if _RECOMPUTING:
            count = flops(func, args, kwargs, out)
            self.recomputed += count
            key = id(_RECOMPUTING[0])
            self.by_block[key] = self.by_block.get(key, 0) + count
            if attention(func):
                self.recomputed_attention += count
        elif in_backward():
            self._backward = True
        elif not self._backward:
            self.forward += flops(func, args, kwargs, out)
        return out
