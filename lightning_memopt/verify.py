"""Check that MemOpt's changes leave results unchanged: compare outputs, losses and gradients, and find the first
module whose forward output differs. Pure torch."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_memopt.compat import _disable_current_modes, tree_flatten


class VerificationError(RuntimeError):
    """Results with MemOpt's changes differ from results without them beyond the tolerance."""


class OutputRecorder:
    """Record, per module, the sum and absolute sum (in float64) of every forward output while recording is on.

    Sums add up over slices, so a chunked module and its unchunked twin record the same figures up to rounding. Stop
    recording before the backward pass: checkpointing runs forward again there.

    Examples:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> with OutputRecorder({"net": net}) as recorder:
        ...     _ = net(torch.ones(1, 2))
        >>> list(recorder.sums)
        ['net.0', 'net.1', 'net']
    """

    def __init__(self, models: Mapping[str, nn.Module]) -> None:
        self.sums: dict[str, list[float]] = {}  # name -> [sum, abs sum], in the order forward passes first finished
        self._handles = []
        for prefix, model in models.items():
            for name, module in model.named_modules(prefix=prefix):
                self._handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if not tensors:
                return
            entry = self.sums.setdefault(name, [0.0, 0.0])
            # outside any dispatch mode, so that exact CPU accounting does not count these temporaries
            with torch.no_grad(), _disable_current_modes():
                for t in tensors:
                    entry[0] += t.detach().sum(dtype=torch.float64).item()
                    entry[1] += t.detach().abs().sum(dtype=torch.float64).item()

        return hook

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> OutputRecorder:
        return self

    def __exit__(self, *args: Any) -> None:
        self.stop()


def first_difference(expected: OutputRecorder, actual: OutputRecorder, rtol: float) -> tuple[str, float] | None:
    """The first module whose recorded output differs, and the relative size of the difference.

    Modules are taken in the order their forward passes finished, so an inner module comes before the block that
    holds it: the name points at the innermost module where the results part.
    """
    for name, (total, magnitude) in expected.sums.items():
        other = actual.sums.get(name)
        if other is None:
            continue
        scale = max(magnitude, other[1], 1e-30)
        diff = max(abs(total - other[0]), abs(magnitude - other[1])) / scale
        if diff > rtol:
            return name, diff
    return None


def tensor_difference(expected: torch.Tensor, actual: torch.Tensor) -> tuple[float, float]:
    """The largest absolute difference, and it relative to the largest magnitude of ``expected``.

    Examples:
        >>> tensor_difference(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
        (0.5, 0.25)
    """
    expected, actual = expected.detach().cpu().double(), actual.detach().cpu().double()  # nothing on the device
    if expected.shape != actual.shape:
        return float("inf"), float("inf")
    diff = (expected - actual).abs().max().item() if expected.numel() else 0.0
    scale = expected.abs().max().item() if expected.numel() else 0.0
    return diff, diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def worst_tensor(
    expected: Iterable[tuple[str, torch.Tensor | None]],
    actual: Mapping[str, torch.Tensor | None],
    scale: float | None = None,
) -> tuple[str, float, float] | None:
    """Among named tensors (gradients, outputs), the one with the largest relative difference: name, abs, relative.

    With ``scale`` (the largest magnitude of all the gradients), a difference is relative to the larger of its own
    tensor's magnitude and ``scale``: rounding noise on a gradient that is near zero is not a difference.

    Examples:
        >>> expected = [("big", torch.tensor([1.0])), ("tiny", torch.tensor([1e-9]))]
        >>> actual = {"big": torch.tensor([1.0]), "tiny": torch.tensor([3e-9])}
        >>> round(worst_tensor(expected, actual)[2], 6), worst_tensor(expected, actual, scale=1.0)[2] < 1e-8
        (2.0, True)
    """
    worst: tuple[str, float, float] | None = None
    for name, tensor in expected:
        other = actual.get(name)
        if tensor is None and other is None:
            continue
        if tensor is None or other is None:
            return name, float("inf"), float("inf")
        diff, rel = tensor_difference(tensor, other)
        if scale:
            rel = diff / max(scale, diff / rel if rel else 0.0) if diff else 0.0
        if worst is None or rel > worst[2]:
            worst = (name, diff, rel)
    return worst


def largest_magnitude(tensors: Iterable[torch.Tensor]) -> float:
    """The largest absolute value among ``tensors`` (0 for none)."""
    return max((t.detach().abs().max().item() for t in tensors if t.numel()), default=0.0)


def worst_gradient(
    expected: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor | None]
) -> tuple[str, float, float] | None:
    """:func:`worst_tensor` of gradients, judged against the expected gradients' largest magnitude. It runs outside
    every dispatch mode and copies each gradient to the CPU before widening it, so that a running peak probe counts
    nothing of it, on any device.

    Examples:
        >>> worst_gradient({"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([1.0, 1e-9])})[0]
        'w'
    """
    with _disable_current_modes(), torch.no_grad():
        return worst_tensor(expected.items(), grads, largest_magnitude(expected.values()))


def flat_tensors(output: Any) -> dict[str, torch.Tensor]:
    """The floating-point tensors in a step's output, keyed by their position.

    Examples:
        >>> sorted(flat_tensors({"loss": torch.tensor(1.0), "n": 3}))
        ['0']
    """
    leaves = tree_flatten(output)[0]
    return {str(i): t for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()}
