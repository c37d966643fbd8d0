"""The chunked-loss technique at fit: a transformers causal language model called with ``labels=`` computes its loss
from its final hidden states in chunks (:mod:`~lightning_memopt.techniques.loss.core`), its logits never whole.

For each causal language model it can take (:func:`~lightning_memopt.adapters.hf_transformers.loss_refusal` says
which it cannot), it wraps three things, each undone exactly: the model's ``forward``, which, when ``labels`` are
passed, makes the output layer hand its input on and the loss function compute the loss through the model's
:class:`~lightning_memopt.techniques.loss.core.LossUnit`; the output layer's ``forward``; and the model's
``loss_function``. The output's ``logits`` stay readable: read (``outputs.logits``), they are computed then, from the
hidden states the loss was computed from. Each model's setting (``"plain"`` or ``"chunked"``) is a knob of the stage's
planner: without a budget the loss is chunked wherever the logits would hold the peak.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from lightning_memopt.adapters.hf_transformers import causal_lms, loss_refusal
from lightning_memopt.handles import AttributeOverride, HandleGroup
from lightning_memopt.techniques.base import Change, Section
from lightning_memopt.techniques.chunked import ChunkedUnits
from lightning_memopt.techniques.loss.core import LossUnit
from lightning_memopt.units import fmt_bytes, modelled_saving

_LAZY: dict[type, type] = {}


def _lazy(cls: type) -> type:
    """A subclass of a model output class whose ``logits``, where a function to compute them is pending, are computed
    when first read."""
    if cls not in _LAZY:

        def __getattribute__(self: Any, name: str) -> Any:
            if name == "logits":
                pending = object.__getattribute__(self, "__dict__").pop("_memopt_logits", None)
                if pending is not None:
                    self["logits"] = pending()
            return super(lazy, self).__getattribute__(name)

        lazy = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__})
        _LAZY[cls] = lazy
    return _LAZY[cls]


class ChunkedLoss(ChunkedUnits):
    """The loss of transformers' causal language models, computed in chunks at fit (see the module's docstring)."""

    name = "loss"
    stages = ("fit",)
    option = "chunked_loss"
    reports = ("loss", "loss_saved_bytes", "logits_read_bytes")

    def __init__(self) -> None:
        super().__init__()
        self.on = True
        self._capturing: LossUnit | None = None  # the unit whose model's forward runs with labels now
        self.logits_read_bytes: int | None = None  # the logits the step read, computed when read, in the last step

    def apply(self, found: Any, config: Any) -> Change | None:
        lms = causal_lms(found.module)
        if not lms:
            return None
        handles, skipped, units = HandleGroup(), [], []
        for name, lm in lms:
            label = f"{found.name}.{name}" if name else found.name
            why = loss_refusal(lm)
            if why is not None:
                skipped.append(f"the loss of {label} ({type(lm).__name__}) is computed as the model computes it: {why}")
                continue
            head = lm.get_output_embeddings()
            unit = LossUnit(label, head, lm.loss_function)
            handles.add(AttributeOverride.wrap(lm, "forward", lambda inner, unit=unit: self._forward(unit, inner)))
            handles.add(AttributeOverride.wrap(head, "forward", lambda inner, unit=unit: self._head(unit, inner)))
            handles.add(AttributeOverride(lm, "_loss_function", self._loss(unit, lm.loss_function)))
            units.append(unit)
        self.units += units
        method = f"chunked loss of {', '.join(sorted({type(lm).__name__ for _, lm in lms}))}"
        return Change(method, len(units), handles, units=units, skipped=skipped, unit="model")

    def _forward(self, unit: LossUnit, inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not self.on or kwargs.get("labels") is None or kwargs.get("return_dict") is False:
                return inner(*args, **kwargs)
            self._capturing = unit
            try:
                out = inner(*args, **kwargs)
            finally:
                self._capturing = None
            return self._logits(unit, out)

        return forward

    def _head(self, unit: LossUnit, inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(hidden: torch.Tensor) -> torch.Tensor:
            if self._capturing is unit:
                return hidden  # the loss function gets the hidden states, and projects them itself
            return inner(hidden)

        return forward

    def _loss(self, unit: LossUnit, own: Callable[..., Any]) -> Callable[..., Any]:
        def loss_function(logits: torch.Tensor, labels: Any, vocab_size: int, **kwargs: Any) -> torch.Tensor:
            if self._capturing is not unit:
                return own(logits=logits, labels=labels, vocab_size=vocab_size, **kwargs)
            return unit(logits, labels, vocab_size, kwargs)  # "logits": the hidden states, as the model hands them

        return loss_function

    def _logits(self, unit: LossUnit, out: Any) -> Any:
        """The model's output with its ``logits``: those the plain loss computed, or computed when read."""
        hidden, plain = unit.hidden, unit.logits
        unit.hidden = unit.logits = None
        head = unit.__dict__["head"]
        if hidden is None:  # the model did not call its loss function: its output layer's input came back as is
            out["logits"] = F.linear(out.logits, head.weight, head.bias)
            return out
        if plain is not None:
            out["logits"] = plain
            return out

        def compute() -> torch.Tensor:
            logits = F.linear(hidden, head.weight, head.bias)
            self.logits_read_bytes = (self.logits_read_bytes or 0) + logits.numel() * logits.element_size()
            return logits

        out.__class__ = _lazy(type(out))
        collections.OrderedDict.__delitem__(out, "logits")  # it held the hidden states
        object.__setattr__(out, "logits", None)
        out.__dict__["_memopt_logits"] = compute
        return out

    def remove(self) -> None:
        self.units, self._capturing = [], None

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        self.on = False
        try:
            yield
        finally:
            self.on = True

    @property
    def changed(self) -> bool:
        return self.on and any(u.setting == "chunked" for u in self.units)

    def describe(self) -> str | None:
        if not self.units:
            return None
        if len(self.units) == 1:
            return "in chunks" if self.chunked else "as the model computes it"
        return f"in chunks in {self.chunked} of {len(self.units)} models"

    def batch_start(self) -> None:
        self.logits_read_bytes = None

    def module_of(self, unit: LossUnit) -> LossUnit:
        return unit  # the loss runs as a module of its own

    def worth(self, unit: LossUnit, setting: Hashable) -> bool:
        return unit.calls > 0  # the step computed the loss through it

    def section(self) -> Section:
        if not self.units:
            return Section()
        described, saved = self.describe(), self.saved
        lines = [f"loss: {described}{modelled_saving(saved)}"]
        if self.logits_read_bytes:
            lines.append(f"logits read by the step: computed when read ({fmt_bytes(self.logits_read_bytes)})")
        return Section(
            settings={"loss": described},
            metrics={"loss_saved_bytes": saved, "logits_read_bytes": self.logits_read_bytes},
            lines=lines,
        )
