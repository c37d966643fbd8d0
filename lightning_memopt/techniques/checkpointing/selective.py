"""Selective recomputation.

A checkpointed block set to ``"selective"`` keeps, for the backward pass, the outputs of its costly ops (matrix
products, convolutions, attention: the ops ``torch.utils.flop_counter.FlopCounterMode`` counts) and recomputes the
rest (norms, activations, dropout, elementwise ops) from them. Set to ``"attention"``, it keeps only the outputs of
its fused attention kernels (``scaled_dot_product_attention``'s), the ops that cost the most FLOPs per byte they
keep, and recomputes the rest, matrix products included. Set to ``"full"``, it keeps only its inputs and runs its
whole forward again. Set to ``"feed_forward"``, the block runs plain but for its feed-forward modules (a transformer
layer's MLP), each checkpointed on its own, keeping only its input; ``"feed_forward_selective"`` checkpoints them with
the selective policy, so that only their activation is recomputed. No other op of the block passes through a dispatch
mode: in a Llama decoder layer the MLP holds about two thirds of what ``"full"`` frees, for a part of the recomputation.

The mechanism is torch's: :func:`torch.utils.checkpoint.checkpoint` with a
:func:`~torch.utils.checkpoint.create_selective_checkpoint_contexts` policy. Random ops are recomputed under the
random state of the first run, so the results are the same as without checkpointing, dropout included.

What recomputation costs is counted by a dry run's :class:`~lightning_memopt.timeline.Timeline`.

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

from typing import Any

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_memopt.flops import attention, costly, recomputing

__all__ = [
    "MODES",
    "PARTS",
    "POLICIES",
    "attention_contexts",
    "contexts",
    "recomputing",
    "selective_contexts",
]

#: A checkpointed block's settings, from the most memory kept to the least (as a rule; which keeps less depends on the
#: block): its activations kept (``none``), its feed-forward modules checkpointed selectively, the rest of the block
#: running plain (``feed_forward_selective``), its costly ops' outputs kept (``selective``), its feed-forward modules
#: checkpointed on their own, each keeping only its input, the rest of the block running plain (``feed_forward``), its
#: fused attention's outputs kept (``attention``), its inputs kept at the granularity of the model's own switch
#: (``full``: a diffusers block checkpoints each of its resnets and attentions), only the block's inputs
#: (``whole``: the block as one segment, where the switch checkpoints parts of it), and ``full`` with the inputs that
#: carry gradients kept in host memory (``offload``: an accelerator's; they come back for the recomputation).
MODES = ("none", "feed_forward_selective", "selective", "feed_forward", "attention", "full", "whole", "offload")
#: The modes that checkpoint a block's feed-forward modules alone, and the mode each of them is checkpointed in.
PARTS = {"feed_forward_selective": "selective", "feed_forward": "full"}
#: The modes run by a checkpoint with a policy of what to keep (:func:`contexts`).
POLICIES = ("selective", "attention")


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
