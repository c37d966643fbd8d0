"""LoRA adapters' inputs kept in their own type for the backward pass, at fit.

PEFT computes a LoRA adapter in the adapter's type: where a frozen base runs in bfloat16 (or float16) and its adapter
in float32 (the QLoRA recipe, and PEFT's default ``autocast_adapter_dtype``), each adapted layer casts its input to
float32 and the adapter's first matrix product keeps that copy for the backward pass: twice the input's bytes, for
every adapted layer. Q, K and V of one attention take the same input and keep three such copies.

Here the first product casts its input itself and keeps the input as it came, casting it again in the backward
pass. Exact: the cast to a wider float type loses nothing, so the backward pass computes the same operations on the
same values (it runs the product's own backward on the recast input). A layer whose adapter has dropout (the dropout
of the wider input differs from that of the narrower) or a variant (DoRA) is left as PEFT runs it; so is a product
under autocast, or whose input is not narrower than its weight.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_memopt.adapters.peft_models import lora_layers
from lightning_memopt.handles import AttributeOverride, HandleGroup
from lightning_memopt.techniques.base import Change, OnOff, Planning, Section, Technique, saving


class UpcastLinear(torch.autograd.Function):
    """``F.linear(x.to(weight.dtype), weight, bias)`` keeping ``x`` for the backward pass instead of its wider copy;
    the backward pass casts it again, computes the product again (a LoRA adapter's first: rank-wide, a few columns)
    and runs that product's own backward, so that the gradients come from the same ops as without this."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight, bias)
        return F.linear(x.to(weight.dtype), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, bias = ctx.saved_tensors
        need = ctx.needs_input_grad
        with torch.enable_grad():
            wide = x.detach().to(weight.dtype).requires_grad_(need[0])
            inputs = [wide, weight.detach().requires_grad_(need[1])]
            inputs.append(None if bias is None else bias.detach().requires_grad_(need[2]))
            out = F.linear(*inputs)
            wanted = [t for t, n in zip(inputs, need, strict=True) if n and t is not None]  # one at least: else no call
            grads = iter(torch.autograd.grad(out, wanted, grad))
        found = [next(grads) if n and t is not None else None for t, n in zip(inputs, need, strict=True)]
        if found[0] is not None:
            found[0] = found[0].to(x.dtype)
        return tuple(found)


def widens(narrow: torch.dtype, wide: torch.dtype) -> bool:
    """Whether casting a ``narrow`` float to ``wide`` loses nothing and doubles (at least) its bytes.

    Examples:
        >>> widens(torch.bfloat16, torch.float32), widens(torch.float16, torch.float32)
        (True, True)
        >>> widens(torch.float32, torch.float32), widens(torch.float16, torch.bfloat16)
        (False, False)
    """
    if not (narrow.is_floating_point and wide.is_floating_point) or narrow.itemsize >= wide.itemsize:
        return False
    small, large = torch.finfo(narrow), torch.finfo(wide)
    return large.max >= small.max and large.eps <= small.eps


def refusal(layer: nn.Module) -> str | None:
    """Why this LoRA layer keeps PEFT's wider copy of its input (``None``: it need not)."""
    if not hasattr(layer, "cast_input_dtype_enabled"):
        return "this peft casts the input itself"
    if not getattr(layer, "cast_input_dtype_enabled", True):
        return "its input cast is off already"
    for adapter, first in layer.lora_A.items():
        if type(first) is not nn.Linear:
            return f"adapter {adapter!r} is a {type(first).__name__}"
        if adapter in getattr(layer, "lora_variant", {}):
            return f"adapter {adapter!r} is a variant ({type(layer.lora_variant[adapter]).__name__})"
        if not isinstance(layer.lora_dropout[adapter], nn.Identity):
            return f"adapter {adapter!r} has dropout"
    return None


class AdapterInputs(OnOff, Technique):
    """Each PEFT LoRA adapter's first product keeps its input in the input's own type for the backward pass, not the
    adapter's wider copy (see the module's docstring). Exact, and nothing to choose: on whenever MemOpt is at fit."""

    name, stages, incidental = "adapter_inputs", ("fit",), True
    reports = ("adapter_inputs_saved_bytes",)

    def __init__(self) -> None:
        self._layers = 0
        self._saved: int | None = None

    def apply(self, found: Any, config: Any) -> Change | None:
        handles, refused, count = HandleGroup(), collections.defaultdict(list), 0
        for name, layer in lora_layers(found.module):
            base = layer.get_base_layer().weight
            if not all(widens(base.dtype, first.weight.dtype) for first in layer.lora_A.values()):
                continue  # no wider copy to keep: the input already has the adapter's type (or a wider one)
            why = refusal(layer)
            if why is not None:
                refused[why].append(name)
                continue
            handles.add(AttributeOverride(layer, "cast_input_dtype_enabled", False))
            for first in layer.lora_A.values():
                handles.add(AttributeOverride(first, "forward", self._forward(first)))
            count += 1
        skipped = [
            f"{len(names)} LoRA layer{'s' if len(names) > 1 else ''} ({names[0]}{', ...' if len(names) > 1 else ''}) "
            f"keep a copy of their input in their adapter's type for the backward pass: {why}"
            for why, names in refused.items()
        ]
        if not count and not skipped:
            return None
        self._layers += count
        return Change("LoRA inputs kept in their own type", count, handles, skipped=skipped, unit="layer")

    def _forward(self, first: nn.Linear) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            weight = first.weight
            if self._on and widens(x.dtype, weight.dtype) and not torch.is_autocast_enabled(x.device.type):
                return UpcastLinear.apply(x, weight, first.bias)
            return F.linear(x.to(weight.dtype), weight, first.bias)  # as PEFT's cast, then the layer

        return forward

    def remove(self) -> None:
        self._layers = 0

    @property
    def changed(self) -> bool:
        return bool(self._layers) and self._on

    def describe(self) -> str | None:
        if not self.changed:
            return None
        return f"LoRA inputs kept in their own type for the backward pass in {self._layers} layers"

    def summary(self) -> str | None:
        return self.describe()

    def plan(self, planning: Planning) -> None:
        self._saved = saving(self, planning) if planning.measure else None

    def section(self) -> Section:
        return Section(metrics={"adapter_inputs_saved_bytes": self._saved})
