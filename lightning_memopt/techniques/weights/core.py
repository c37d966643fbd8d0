"""Weights kept in 8 bits, computed in their own type one layer at a time: the mechanics, pure torch.

A stored layer (``nn.Linear``, ``nn.Conv1d``/``2d``/``3d``) keeps its weight as bitsandbytes' blockwise 8-bit codes
(the dynamic map, one float32 scale per 256 values: about 1.016 bytes per value, against 2 in bfloat16 and 4 in
float32), in two buffers of the layer's own. Each call puts the weight back in the layer's type for that call alone
and computes with it; the backward pass puts it back again rather than keep it, so that one layer's copy at a time is
alive. The ``weight`` parameter stays the same object, of the same type, shape and device, but holds a single NaN
(broadcast to its shape): code that reads it around the layer's ``forward`` gets NaN, not silently wrong numbers.

The original values are kept off the device (in host memory, or on CPU in a temporary file) and come back exactly
when the handle is removed; a state dict taken meanwhile holds them.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> layer = nn.Linear(256, 64).requires_grad_(False)
    >>> given, x = layer.weight.detach().clone(), torch.randn(2, 256)
    >>> host = Host()
    >>> unit = StoredWeight("layer", layer)
    >>> unit.store(host)
    >>> bool((layer(x) - x @ given.T - layer.bias).abs().max() < 0.05), layer.weight.untyped_storage().nbytes()
    (True, 4)
    >>> unit.restore(); host.close()
    >>> torch.equal(layer.weight, given)
    True
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_memopt.handles import AsGiven, AttributeOverride
from lightning_memopt.techniques.lossy import BLOCK, NF4_BLOCK, dequantize, dequantize_nf4, quantize, quantize_nf4

#: The layers whose weights can be stored in 8 bits.
LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
#: Layers whose name in their model matches one of these (``re.search``) keep their weights: norms, embeddings,
#: positional and patch embeddings, LoRA adapters, and a model's first and last projections (as diffusers' layerwise
#: casting skips by default).
SKIP = ("norm", "embed", "lora_", "^proj_in$", "^proj_out$")
#: Layers with fewer weights than this keep them (the codes and scales would save too little).
SMALLEST = 4096
#: The buffers that hold a stored layer's codes and scales.
CODES, SCALE = "_memopt_codes", "_memopt_scale"


class Host:
    """Where the originals are kept while the weights are stored small: host memory for an accelerator's, and for the
    CPU's a temporary directory, one file per weight, removed by :meth:`close`."""

    def __init__(self) -> None:
        self.directory: str | None = None
        self._count = 0

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` off its device (on CPU: mapped from a file), of its type and shape."""
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            return tensor.to("cpu", copy=True)
        if self.directory is None:
            self.directory = tempfile.mkdtemp(prefix="memopt-weights-")
        path = os.path.join(self.directory, f"{self._count}.bin")
        self._count += 1
        tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tofile(path)
        return torch.from_file(path, shared=False, size=tensor.numel(), dtype=tensor.dtype).view(tensor.shape)

    def close(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


def storable(name: str, module: nn.Module, trainable: bool) -> str | None:
    """Why the layer ``module`` (``name`` in its model) keeps its weights (``None``: they can be stored in 8 bits).
    ``trainable``: its trainable weights may be stored (a loop without gradients)."""
    if not isinstance(module, LAYERS):
        return "not a linear or convolution layer"
    if any(re.search(pattern, name) for pattern in SKIP):
        return "kept by name"
    weight = module.weight
    if type(weight) is not nn.Parameter or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return "not a plain floating-point parameter"
    if weight.numel() < SMALLEST:
        return "too small"
    if not trainable and any(p.requires_grad for p in module.parameters(recurse=False)):
        return "trained"
    return None


def stored_bytes(numel: int, bits: int = 8) -> int:
    """The bytes of a weight of ``numel`` values in ``bits`` (8, or 4: NF4): its codes and scales."""
    if bits == 4:
        return (numel + 1) // 2 + 4 * math.ceil(numel / NF4_BLOCK)
    return numel + 4 * math.ceil(numel / BLOCK)


class StoredWeight:
    """One layer whose weight can be stored in 8 bits (:meth:`store`) and put back exactly (:meth:`restore`).

    Attributes:
        name: Its name, for notes.
        module: The layer.
        saving: The bytes storing it saves.
        copy_bytes: The bytes of its weight in its own type (alive during each of its calls, once stored).
        on: Whether calls use the 8-bit weight (``False``: its ``weight`` is the original's shape and type on the meta
            device, for dry runs of the model as given).
        difference: The largest difference of a stored value from its original, relative to the largest original.
    """

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name, self.module = name, module
        weight = module.weight
        self.shape, self.dtype = weight.shape, weight.dtype
        self.copy_bytes = weight.numel() * weight.element_size()
        self.saving = self.saving_at(8)
        self.bits = 8  # the bits it is stored in (or would be)
        self.on = True
        self.difference: float | None = None
        self.host: torch.Tensor | None = None
        self._stand_in: torch.Tensor | None = None
        self._handles: list[Any] = []
        self._token: object | None = None
        self._off: tuple[torch.Tensor, ...] = ()  # the weight, codes and scales while switched off

    @property
    def stored(self) -> bool:
        return self.host is not None

    def saving_at(self, bits: int) -> int:
        """The bytes storing it in ``bits`` saves (its weight's, less the codes' and scales', and the stand-in's)."""
        element = self.copy_bytes // math.prod(self.shape)
        return self.copy_bytes - stored_bytes(math.prod(self.shape), bits) - element

    def store(self, host: Host, bits: int = 8) -> None:
        """Keep the original off the device, the weight in ``bits`` (8, or 4: NF4) in the layer, and its calls
        computing with it."""
        module, weight = self.module, self.module.weight
        value = weight.detach()
        self.bits = bits
        codes, scale = quantize(value.contiguous(), signed=True) if bits == 8 else quantize_nf4(value.contiguous())
        if value.is_meta:  # a model built without memory (an estimate): nothing to keep or compare
            self.host = value
        else:
            largest = value.abs().max().float().item()
            error = (self.weight(codes, scale) - value).abs().max().float().item()
            self.difference = error / largest if largest else 0.0
            self.host = host.keep(value)
        # a copy of the layer taken meanwhile (an EMA's deepcopy, torch.save) gets the original weight, no codes
        given = dict(module._parameters, weight=nn.Parameter(self.host, requires_grad=weight.requires_grad))
        self._token = AsGiven.register(module, {"_parameters": given, "_buffers": dict(module._buffers)})
        module.register_buffer(CODES, codes, persistent=False)
        module.register_buffer(SCALE, scale, persistent=False)
        self._stand_in = torch.full((), math.nan, dtype=self.dtype, device=value.device).expand(self.shape)
        del value
        weight.data = self._stand_in
        self._handles = [
            AttributeOverride.wrap(module, "forward", self._forward),
            module.register_state_dict_post_hook(lambda *args: self._originals(*args)),
        ]

    def restore(self) -> None:
        """The original weight back in the layer, exactly; the codes, the hooks and the copy off the device go."""
        if self.host is None:
            return
        module = self.module
        for handle in self._handles:
            handle.remove()
        self._handles = []
        module.weight.data = self.host.to(self._stand_in.device, copy=True)
        module._buffers.pop(CODES, None)
        module._buffers.pop(SCALE, None)
        AsGiven.release(module, self._token)
        self.host = self._stand_in = self._token = None

    remove = restore

    def switch(self, on: bool) -> None:
        """Calls use the 8-bit weight, or (off) the layer looks as given to a dry run: its weight a parameter of the
        original's shape and type on the meta device (no memory, counted on the model's device), no codes."""
        if not self.stored or on == self.on:
            return
        module = self.module
        if on:
            module._parameters["weight"], module._buffers[CODES], module._buffers[SCALE] = self._off
        else:
            self._off = module._parameters["weight"], module._buffers.pop(CODES), module._buffers.pop(SCALE)
            given = torch.empty(self.shape, dtype=self.dtype, device="meta")
            module._parameters["weight"] = nn.Parameter(given, requires_grad=self._off[0].requires_grad)
        self.on = on

    # the calls ------------------------------------------------------------------------------------------------------

    def _forward(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        module = self.module

        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not self.on or args or kwargs:  # as given (a dry run's baseline), or a call we do not know
                return inner(x, *args, **kwargs)
            return _Stored.apply(x, module._buffers[CODES], module._buffers[SCALE], self)

        return forward

    def weight(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The weight in the layer's type, for one call."""
        if self.bits == 4:
            return dequantize_nf4(codes, scale, self.shape, self.dtype)
        return dequantize(codes, scale, True, self.dtype)

    def compute(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        module = self.module
        if isinstance(module, nn.Linear):
            return F.linear(x, weight, module.bias)
        return module._conv_forward(x, weight, module.bias)

    def input_grad(self, grad: torch.Tensor, weight: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        module, weight = self.module, weight.to(grad.dtype)
        if isinstance(module, nn.Linear):
            return grad.matmul(weight)
        if isinstance(module.padding, str) or module.padding_mode != "zeros":
            raise RuntimeError(
                f"{self.name}: a gradient through a convolution padded {module.padding!r} "
                f"({module.padding_mode}) is not supported with its weights stored in 8 bits"
            )
        dims = weight.dim() - 2
        shapeless = grad.new_empty(1).expand(shape)  # the input's values do not enter its gradient
        return torch.ops.aten.convolution_backward(
            grad,
            shapeless,
            weight,
            None,
            module.stride,
            module.padding,
            module.dilation,
            False,
            [0] * dims,
            module.groups,
            [True, False, False],
        )[0]

    def _originals(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local: Any) -> None:
        """A state dict taken while the weight is stored holds the original (off the device)."""
        if self.host is not None and prefix + "weight" in state_dict:
            state_dict[prefix + "weight"] = self.host


class _Stored(torch.autograd.Function):
    """A stored layer's call: the weight put back in its type for the call, and again for the input's gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, unit: StoredWeight) -> Any:
        ctx.unit, ctx.shape = unit, x.shape
        ctx.save_for_backward(codes, scale)
        return unit.compute(x, unit.weight(codes, scale))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        codes, scale = ctx.saved_tensors
        return ctx.unit.input_grad(grad, ctx.unit.weight(codes, scale), ctx.shape), None, None, None
