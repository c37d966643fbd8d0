"""What a change costs in time where no step ran without it: each changed module timed alone, outside the step, at
the shapes the step gave it, with the change and without.

A predict step with chunked blocks never runs unchunked, so its time without chunking is not measured. While the
measured step runs, :class:`CallCounter` counts each changed module's calls and keeps the shapes of its first call's
inputs (no tensor is held). Afterwards, :meth:`CallCounter.seconds_added` runs each kind of module (class and input
shapes) on inputs of those shapes (random floats, zeros elsewhere), in eval mode without gradients, once with the
change and once without, and returns the calls times the difference. The module's attributes and random states are
put back (:func:`~lightning_memopt.dryrun.kept_as_is`).

Examples:
    >>> import torch
    >>> from torch import nn
    >>> block = nn.Linear(8, 8)
    >>> counter = CallCounter([Switchable("block", block, "forward", lambda: None, lambda: None)])
    >>> with counter:
    ...     _ = block(torch.ones(3, 8)), block(torch.ones(3, 8))
    >>> counter.calls["block"], counter.shapes["block"]
    (2, ((Spec(shape=(3, 8), dtype=torch.float32, device=device(type='cpu')),), {}))
    >>> counter.seconds_added() < 0.1  # the same call with and without a change that does nothing
    True
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_memopt.compat import map_tensors
from lightning_memopt.dryrun import kept_as_is
from lightning_memopt.handles import AttributeOverride, HandleGroup
from lightning_memopt.techniques.base import Switchable


@dataclass(frozen=True)
class Spec:
    """A tensor's shape, dtype and device: what an input is rebuilt from."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def make(self, generator: torch.Generator) -> torch.Tensor:
        if self.dtype.is_floating_point:
            return torch.randn(self.shape, generator=generator).to(self.dtype).to(self.device)
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)


class CallCounter:
    """Counts the calls of each changed module while active, keeping the shapes of its first call's inputs.

    Args:
        units: The changed modules.
        sync: Waits for the device before a time is read (``torch.cuda.synchronize`` on a GPU).
        around: What the timed calls run in, to cost what the step's calls cost (the step's exact accounting on CPU).
    """

    def __init__(
        self,
        units: list[Switchable],
        sync: Callable[[], None] = lambda: None,
        around: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.units = units
        self.sync = sync
        self.around = around
        self.calls: dict[str, int] = {u.name: 0 for u in units}
        self.shapes: dict[str, tuple[Any, Any]] = {}
        self._handles = HandleGroup()

    def _seen(self, unit: Switchable, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.calls[unit.name] += 1
        if unit.name not in self.shapes:
            spec = lambda t: Spec(tuple(t.shape), t.dtype, t.device)  # noqa: E731
            self.shapes[unit.name] = (map_tensors(args, spec), map_tensors(kwargs, spec))

    def _counted(self, unit: Switchable, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self._seen(unit, args, kwargs)
            return original(*args, **kwargs)

        return counted

    def __enter__(self) -> CallCounter:
        for unit in self.units:
            if unit.method == "forward":
                hook = unit.module.register_forward_pre_hook(
                    lambda m, a, k, unit=unit: self._seen(unit, a, k), with_kwargs=True
                )
                self._handles.add(hook)
            else:
                self._handles.add(
                    AttributeOverride.wrap(unit.module, unit.method, functools.partial(self._counted, unit))
                )
        return self

    def __exit__(self, *args: Any) -> None:
        self._handles.remove()
        self._handles = HandleGroup()

    def seconds_added(self) -> float:
        """The time the changes added to the step: for each kind of module called, the difference between one call
        with the change and one without, times its calls. Runs each kind twice, outside the step."""
        timed: dict[Any, float] = {}
        total = 0.0
        for unit in self.units:
            if unit.name not in self.shapes:
                continue
            kind = (type(unit.module), repr(self.shapes[unit.name]))
            if kind not in timed:
                with kept_as_is(unit.module):
                    timed[kind] = self._time(unit, True) - self._time(unit, False)
            total += self.calls[unit.name] * timed[kind]
        return total

    def _time(self, unit: Switchable, changed: bool) -> float:
        """One call of the unit on inputs of the shapes it saw, the best of two."""
        (unit.on if changed else unit.off)()
        try:
            best = float("inf")
            for _ in range(2):
                args, kwargs = self._inputs(unit)
                self.sync()
                started = time.perf_counter()
                with torch.no_grad(), _eval(unit.module), self.around():
                    getattr(unit.module, unit.method)(*args, **kwargs)
                self.sync()
                best = min(best, time.perf_counter() - started)
            return best
        finally:
            unit.on()

    def _inputs(self, unit: Switchable) -> tuple[Any, Any]:
        from lightning_utilities.core.apply_func import apply_to_collection

        generator = torch.Generator().manual_seed(0)
        args, kwargs = self.shapes[unit.name]
        return (
            apply_to_collection(args, Spec, lambda s: s.make(generator)),
            apply_to_collection(kwargs, Spec, lambda s: s.make(generator)),
        )


@contextlib.contextmanager
def _eval(module: nn.Module) -> Iterator[None]:
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
