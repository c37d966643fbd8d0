"""The kernels a CUDA GPU runs where the CPU runs others, for a dry run on the CPU's fake tensors that stands in for a
GPU this machine does not have (``estimate(..., device="cuda")``).

Attention is the one that changes what a step keeps. ``F.scaled_dot_product_attention`` on the CPU always runs its
flash kernel, which keeps the output and a log-sum-exp per query. A GPU picks a backend by dtype, head dimension and
mask (``select_sdp_backend`` in ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``):

- **flash** (or cuDNN's, preferred on some Hopper builds, which keeps the same): half or bfloat16, no ``attn_mask``,
  equal head dimensions of at most 256, no causal mask over unequal lengths. It keeps the output and the log-sum-exp;
  a head dimension that is not a multiple of 8 is padded first, and the padded copies are kept too.
- **memory-efficient**: float32, half or bfloat16 with a head dimension that is a multiple of 4 (float32) or 8, any
  mask. It keeps the output, the log-sum-exp (its length rounded up to 32) and the mask as a float bias (a boolean
  mask is converted; a bias whose rows are not a multiple of 16 long is padded).
- **math** otherwise: the products and the softmax in aten ops, which keeps the attention probabilities, length by
  length.

The rules are those of a GPU of compute capability 8.0 or newer (A100, H100, H200) with the backends left enabled;
:func:`cuda_kernels` applies them while the dry runs run, and counts which backend each call took. Grouped-query
attention (``enable_gqa=True``, fewer key heads than query heads, as transformers' Llama passes it) is not covered: it
is counted as the CPU's flash kernel keeps it (the output and the log-sum-exp, as flash does on a GPU), and the note
says how many calls were.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from lightning_memopt.compat import FakeTensor

aten = torch.ops.aten

#: The backends' names as the notes give them.
BACKENDS = {
    "flash": "flash",
    "efficient": "memory-efficient",
    "math": "math",
    "other": "grouped-query heads counted as the CPU's flash kernel keeps them",
}


def attention_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> str:
    """The backend a GPU of compute capability 8.0 or newer runs for these inputs: ``"flash"``, ``"efficient"`` or
    ``"math"``.

    Examples:
        >>> q = torch.empty(1, 2, 16, 64, dtype=torch.bfloat16)
        >>> attention_backend(q, q, q), attention_backend(q.float(), q.float(), q.float())
        ('flash', 'efficient')
        >>> attention_backend(q[..., :6].float(), q[..., :6].float(), q[..., :6].float())
        'math'
    """
    head, head_k, head_v = query.shape[-1], key.shape[-1], value.shape[-1]
    dense = query.dim() == 4 and all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in (query, key, value))
    half = query.dtype in (torch.float16, torch.bfloat16)
    if (
        dense
        and half
        and attn_mask is None
        and head == head_k == head_v <= 256
        and not (is_causal and query.shape[-2] != key.shape[-2])
    ):
        return "flash"
    alignment = 8 if half else 4
    if (
        dense
        and query.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and head == head_k
        and head % alignment == 0
        and head_v % alignment == 0
    ):
        return "efficient"
    return "math"


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as the float bias a GPU's kernels add (0 where attended, -inf elsewhere); others as they are."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros((), dtype=dtype).masked_fill(mask.logical_not(), float("-inf"))


def _bias(mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """The mask as the memory-efficient kernel takes it: a float bias in the query's dtype, padded to rows of a
    multiple of 16 where its strides are not, and expanded to every batch, head and query."""
    mask = _additive(mask, query.dtype)
    if mask is None:
        return None
    if any(s % 16 for s in mask.stride()[:-1]):
        length = mask.shape[-1]
        mask = F.pad(mask, (0, 16 - length % 16))[..., :length]
    return mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])


def _scale(query: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` by the kernel ``backend`` (by default the one a GPU picks), which keeps for
    the backward pass what that kernel keeps on a GPU. Its aten operators run on fake tensors of any device."""
    backend = backend or attention_backend(query, key, value, attn_mask, is_causal)
    scale = _scale(query, scale)
    if backend == "flash":
        head = query.shape[-1]
        pad = (-head) % 8
        if pad:
            query, key, value = (F.pad(t, (0, pad)) for t in (query, key, value))
        out = aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        return out[..., :head] if pad else out
    if backend == "efficient":
        keeps = any(t.requires_grad for t in (query, key, value)) and torch.is_grad_enabled()
        bias = _bias(attn_mask, query, key)
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, keeps, dropout_p, is_causal, scale=scale
        )[0]
    mask = _additive(attn_mask, query.dtype)
    return aten._scaled_dot_product_attention_math(query, key, value, mask, dropout_p, is_causal, scale=scale)[0]


@contextlib.contextmanager
def cuda_kernels() -> Iterator[Counter[str]]:
    """While entered, ``F.scaled_dot_product_attention`` on fake tensors runs the kernel a GPU would (real tensors and
    grouped-query calls run as they are). Yields a count of the calls by backend. Nested uses count from the outer
    one, which puts the function back."""
    original = F.scaled_dot_product_attention
    if getattr(original, "_memopt_counts", None) is not None:
        yield original._memopt_counts
        return
    counts: Counter[str] = Counter()

    def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs):
        names = ("attn_mask", "dropout_p", "is_causal", "scale")
        options: dict[str, Any] = dict(zip(names, args, strict=False))
        options.update((k, v) for k, v in kwargs.items() if k != "enable_gqa" or v)
        if not isinstance(query, FakeTensor):
            return original(query, key, value, *args, **kwargs)  # a real call
        grouped = query.dim() < 3 or key.dim() < 3 or query.shape[-3] != key.shape[-3]
        if grouped or len(args) > len(names) or set(options) - set(names):
            counts["other"] += 1  # grouped-query heads (enable_gqa): as the CPU's flash kernel keeps them
            return original(query, key, value, *args, **kwargs)
        backend = attention_backend(query, key, value, options.get("attn_mask"), options.get("is_causal", False))
        counts[backend] += 1
        return attention(query, key, value, **options, backend=backend)

    scaled_dot_product_attention._memopt_counts = counts  # type: ignore[attr-defined]
    F.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield counts
    finally:
        F.scaled_dot_product_attention = original


def described(counts: Counter[str]) -> str | None:
    """The note an estimate gives for the attention calls of one step that :func:`cuda_kernels` counted.

    Examples:
        >>> described(Counter({"efficient": 4, "math": 2}))
        'attention counted as a GPU of compute capability 8.0+ runs it: memory-efficient 4 calls, math 2 calls'

    """
    if not counts:
        return None
    calls = ", ".join(f"{BACKENDS[name]} {n} call{'s' if n != 1 else ''}" for name, n in sorted(counts.items()))
    return f"attention counted as a GPU of compute capability 8.0+ runs it: {calls}"
