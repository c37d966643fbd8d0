"""Gradients freed right after the optimizer step at fit, instead of when Lightning zeroes them after the next step's
forward pass, so that they are not alive through it. Exact: the optimizer has stepped with them already; it stays off
where something may read them in between (manual optimization, a hook of the user's on ``on_before_zero_grad``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_memopt.compat import strategy_refuses
from lightning_memopt.handles import HandleGroup
from lightning_memopt.techniques.base import (
    Change,
    FreesGradients,
    Plan,
    Planning,
    Section,
    Technique,
    overrides,
    saving,
    trainable,
    twin_ids,
)


class FreeGradients(FreesGradients, Technique):
    """Frees the gradients right after the optimizer step, instead of when Lightning zeroes them, after the next
    step's forward pass: they are not alive through it. Exact where nothing reads a gradient between the step and
    the next backward pass: it stays off, with a warning, under manual optimization and where a hook of the user's
    runs there (``on_before_zero_grad``)."""

    name, stages, option = "free_gradients", ("fit",), "free_gradients"
    of_the_step = True
    reports = ("free_gradients_saved_bytes",)

    def __init__(self) -> None:
        self._models = 0  # the models changed
        self._on = True
        self._saved: int | None = None
        self._saved_before: int | None = None  # kept with settings loaded
        self._freed: dict[int, torch.Tensor] = {}
        self._ids: set[int] = set()  # the parameters whose gradients it frees

    @classmethod
    def refuses(cls, context: Any) -> str | None:
        if (owned := strategy_refuses(cls.name, context.strategy)) is not None:
            return owned
        if not context.automatic:
            return "free_gradients left off: manual optimization may read the gradients after opt.step()."
        if context.zero_grad_readers:
            readers = ", ".join(context.zero_grad_readers)
            return (
                f"free_gradients left off: {readers} runs after the optimizer step and may read the gradients; pass "
                "free_gradients=False to silence this."
            )
        return None

    def apply(self, found: Any, config: Any) -> Change | None:
        params = trainable(found)
        ours = [o for o in self.context.optimizers if any(id(p) in params for g in o.param_groups for p in g["params"])]
        if not ours:
            return None
        handles = HandleGroup(o.register_step_post_hook(functools.partial(self._free, params)) for o in ours)
        self._models += 1
        self._ids |= set(params)
        return Change("a hook after the optimizer step", 1, handles, unit="model")

    def _free(self, params: dict[int, torch.Tensor], optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._on:
            return
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) in params and param.grad is not None:
                    param.grad, self._freed[id(param)] = None, param

    def remove(self) -> None:
        self._models, self._freed, self._ids = 0, {}, set()

    @property
    def changed(self) -> bool:
        return bool(self._models) and self._on

    def describe(self) -> str | None:
        return "gradients freed after the optimizer step" if self.changed else None

    def summary(self) -> str | None:
        return self.describe()

    def plan(self, planning: Planning) -> Plan | None:
        if planning.measure and not planning.choose and self._saved_before is not None:  # kept with reused settings
            self._saved = self._saved_before
            return None
        self._saved = self._saving(planning) if planning.measure else None
        return None

    def state(self) -> dict[str, Any]:
        """What freeing the gradients saved, as a dry run found it (so that a run reusing the settings need not)."""
        return {"saved": self._saved} if self._saved is not None else {}

    def load(self, state: dict[str, Any]) -> bool:
        saved = state.get("saved")
        self._saved_before = saved if isinstance(saved, int) else None
        return True

    def _saving(self, planning: Planning) -> int | None:
        """What freeing the gradients saves: where it alone changes the optimizer's part, from one dry run, which
        also gives the peak with those gradients kept until Lightning zeroes them (``DryRun.kept_peak``). Another
        technique that steps the optimizers its own way in a dry run (in the backward pass, over 8-bit state) leaves
        that figure to a dry run without this one; where it steps every parameter in the backward pass, no gradient is
        left to free: 0, without a dry run."""
        if self.changed and any(
            isinstance(t, FreesGradients) and t is not self and t.frees_in_backward(self._ids)
            for t in planning.techniques
        ):
            return 0  # the optimizer step in the backward pass leaves no gradient for it to free: no dry run
        others = [
            t
            for t in planning.techniques
            if t is not self and t.changed and (overrides(t, "around_backward") or overrides(t, "around_twins"))
        ]
        if not self.changed or planning.chosen is not None or others:
            return saving(self, planning)
        dry = planning.run(steady=True)
        if dry.kept_peak is None or dry.peak_bytes is None:
            return saving(self, planning)
        return dry.kept_peak - dry.peak_bytes

    def around_twins(self, default: Callable[..., Any]) -> Callable[..., Any]:
        """In a dry run, the twins free their gradients after each step too: a step of a few parameters at a time
        (an 8-bit state's) frees each one's as it goes."""

        @contextlib.contextmanager
        def twins(pairs: list[tuple[Any, Any]]) -> Iterator[None]:
            hooks = HandleGroup()
            for twin, real in pairs if self.changed else ():
                fakes = twin_ids(twin, real, self._ids)
                if fakes:
                    hooks.add(twin.register_step_post_hook(functools.partial(_free_some, fakes)))
            try:
                with default(pairs):
                    yield
            finally:
                hooks.remove()

        return twins

    def section(self) -> Section:
        return Section(metrics={"free_gradients_saved_bytes": self._saved})


def _free_some(ids: set[int], optimizer: Any, args: Any, kwargs: Any) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) in ids:
                param.grad = None
