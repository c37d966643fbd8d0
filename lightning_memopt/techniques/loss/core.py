"""A causal language model's loss computed in chunks of tokens: the logits are never whole. Pure torch.

:func:`chunked_cross_entropy` projects each chunk of hidden states to the vocabulary, takes its cross-entropy in
float32, and keeps only one float per token (the log-sum-exp) for the backward pass, which projects each chunk again
(counted as recomputed on a dry run's :class:`~lightning_memopt.timeline.Timeline`). Its semantics are those of
transformers' ``ForCausalLMLoss``: the labels shifted by one, ``ignore_index`` (-100), the mean over the tokens not
ignored, or the sum over ``num_items_in_batch``. The logits of a chunk are computed in the hidden states' dtype and
taken to float32, as the model's own loss does, so a bf16 model's loss is float32 like the model's own.

:class:`LossUnit` is one model's loss as a module, so that a dry run can watch it: ``"plain"`` computes the logits
whole and calls the model's own loss function, ``"chunked"`` computes it in chunks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_memopt.flops import recomputing

#: The label the model's own loss ignores by default.
IGNORE_INDEX = -100
#: The most chunks one loss is cut into (each chunk costs a few calls in the forward and the backward pass).
MAX_CHUNKS = 32


def chunk_tokens(tokens: int, width: int, vocabulary: int) -> int:
    """Tokens per chunk (a power of two): as many as make one chunk's logits about as large as the hidden states, in
    :data:`MAX_CHUNKS` chunks at most.

    Examples:
        >>> chunk_tokens(4096, 4096, 128_256)  # 32 chunks of 128 tokens
        128
        >>> chunk_tokens(64, 32, 4096)  # 32 chunks, where 128 would hold the hidden states' size
        2
    """
    chunks = min(MAX_CHUNKS, math.ceil(vocabulary / max(width, 1)))
    return min(tokens, 1 << max(0, math.ceil(math.log2(max(1, math.ceil(tokens / chunks))))))


class _ChunkedCrossEntropy(torch.autograd.Function):
    """The summed cross-entropy of ``hidden @ weight.T + bias`` against ``targets``, chunk by chunk."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk: int,
        ignore_index: int,
        owner: nn.Module | None,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        norms = []  # each chunk's log-sum-exp (written into one tensor, a slice at a time, a dry run would count more)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, tokens, chunk):
            stop = min(start + chunk, tokens)
            logits = F.linear(hidden[start:stop], weight, bias).float()
            target = targets[start:stop]
            ignored = target == ignore_index
            norm = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, target.masked_fill(ignored, 0).unsqueeze(1)).squeeze(1)
            total = total + (norm - picked).masked_fill_(ignored, 0.0).sum()
            norms.append(norm)
            del logits
        lse = torch.cat(norms) if len(norms) > 1 else norms[0]
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk, ctx.ignore_index, ctx.owner = chunk, ignore_index, owner
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = None
        if need_bias and bias is not None:
            grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        for start in range(0, hidden.shape[0], ctx.chunk):
            stop = min(start + ctx.chunk, hidden.shape[0])
            part = hidden[start:stop]
            with recomputing(ctx.owner):
                logits = F.linear(part, weight, bias).float()
            target = targets[start:stop]
            valid = target != ctx.ignore_index
            probs = logits.sub_(lse[start:stop].unsqueeze(1)).exp_()  # the softmax, in place
            probs.scatter_add_(1, torch.where(valid, target, 0).unsqueeze(1), -valid.to(probs.dtype).unsqueeze(1))
            probs.mul_((valid.to(probs.dtype) * grad).unsqueeze(1))  # d loss / d logits, float32
            step = probs.to(hidden.dtype)  # as the model's own upcast passes it back
            del logits, probs
            if grad_hidden is not None:
                grad_hidden[start:stop] = step @ weight
            if grad_weight is not None:  # summed in place in float32: no second vocabulary-by-width product
                grad_weight.addmm_(step.t().float(), part.float())
            if grad_bias is not None:
                grad_bias += step.float().sum(0)
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
            None,
            None,
            None,
            None,
        )


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor | None,
    num_items_in_batch: Any = None,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: torch.Tensor | None = None,
    chunk: int | None = None,
    owner: nn.Module | None = None,
) -> torch.Tensor:
    """A causal language model's loss from its final hidden states (``(..., tokens, width)``) and its output layer's
    ``weight`` and ``bias``, as transformers' ``ForCausalLMLoss`` computes it from the logits (see the module's
    docstring); ``chunk`` tokens at a time (default :func:`chunk_tokens`). ``owner``: the module its recomputation
    is counted for."""
    if shift_labels is None:
        assert labels is not None
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    flat = hidden.reshape(-1, hidden.shape[-1])
    targets = shift_labels.reshape(-1).to(flat.device)
    size = chunk or chunk_tokens(flat.shape[0], flat.shape[1], weight.shape[0])
    total = _ChunkedCrossEntropy.apply(flat, weight, bias, targets, size, ignore_index, owner)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    return total / (targets != ignore_index).sum()


def fits(hidden: torch.Tensor, labels: Any, shift_labels: Any, ignore_index: Any) -> bool:
    """Whether the chunked loss takes these inputs as the model's own would: integer labels (``torch.long``), as many
    as there are tokens, an int ``ignore_index``; anything else goes to the model's own loss, whose error or result it
    then is."""
    given = shift_labels if shift_labels is not None else labels
    if not isinstance(given, torch.Tensor) or given.dtype != torch.long or not isinstance(ignore_index, int):
        return False
    tokens = hidden.shape[:-1].numel()
    if not tokens:
        return False
    if shift_labels is None:
        return tuple(given.shape) == tuple(hidden.shape[:-1])
    return given.numel() == tokens


class LossUnit(nn.Module):
    """One causal language model's loss, as a module the planner can watch (a knob's module): called with the final
    hidden states (as the model hands them to its output layer), the labels, the vocabulary size and the loss
    function's other arguments, it returns the loss, ``"plain"`` (the logits whole, then the model's own loss
    function) or ``"chunked"`` (:func:`chunked_cross_entropy`). It holds no parameter: the output layer and the loss
    function are the model's."""

    def __init__(self, name: str, head: nn.Linear, own: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.name = name
        self.__dict__["head"] = head  # not a submodule: the model's own
        self.own = own
        self.setting = "chunked"
        self.hidden: torch.Tensor | None = None  # what its last call computed the loss from, for the model's output
        self.logits: torch.Tensor | None = None  # those the plain loss computed, for the model's output
        self.calls = 0  # calls so far (a step that passes no labels makes none)

    def forward(self, hidden: torch.Tensor, labels: Any, vocab_size: int, kwargs: dict[str, Any]) -> torch.Tensor:
        self.calls += 1
        self.hidden = hidden
        head: nn.Linear = self.__dict__["head"]
        ignore_index = kwargs.get("ignore_index", IGNORE_INDEX)
        shift_labels = kwargs.get("shift_labels")
        if self.setting == "plain" or not fits(hidden, labels, shift_labels, ignore_index):
            self.logits = F.linear(hidden, head.weight, head.bias)
            return self.own(logits=self.logits, labels=labels, vocab_size=vocab_size, **kwargs)
        return chunked_cross_entropy(
            hidden,
            head.weight,
            head.bias,
            labels,
            kwargs.get("num_items_in_batch"),
            ignore_index,
            shift_labels,
            owner=self,
        )
