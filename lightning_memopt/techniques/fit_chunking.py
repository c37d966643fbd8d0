"""The feed-forward chunked at fit: each block's token-wise feed-forward runs on slices of the sequence, each slice
checkpointed (non-reentrant), so that one slice's intermediate lives at once in the forward pass and in the backward
pass, where it is recomputed; inside a checkpointed block's recomputation as in a block that is not checkpointed. The
block's own token-wise norms (a decoder layer's ``input_layernorm`` and ``post_attention_layernorm``) run in the same
slices: a norm computed in float32 keeps a float32 copy of its input and its backward pass holds several more, each
twice a bfloat16 input's bytes (10 GiB at 131,072 tokens of Llama-3-8B); in slices, one slice's at a time.

A block's setting is ``"plain"``, ``"chunked"`` (as many slices as the sequence holds widths: ``ceil(tokens /
width)``, the rule of ALST's tiled MLP) or, under a budget, ``"finer"`` (:data:`FINER` times as many, for a sequence
of a width or a few whose feed-forward still holds the peak), a knob of the stage's planner on the block itself, so
that it is priced together with the block's checkpointing mode. Its reference is ``"plain"``: under a budget a block
is chunked where the budget needs it; without one, only where the time model predicts that no slower (each slice is a
checkpoint).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_memopt.adapters.base import find_block_stacks
from lightning_memopt.adapters.torch_generic import find_feed_forward, find_token_norms
from lightning_memopt.compat import in_backward
from lightning_memopt.flops import recomputing
from lightning_memopt.handles import AttributeOverride, HandleGroup
from lightning_memopt.techniques.base import Change, Planning, Section
from lightning_memopt.techniques.chunked import SETTINGS as WHOLE_OR_CHUNKED
from lightning_memopt.techniques.chunked import ChunkedUnits
from lightning_memopt.units import modelled_saving

#: A block's settings: the feed-forward whole, in slices of a width, in finer slices.
SETTINGS = (*WHOLE_OR_CHUNKED, "finer")

#: Dropout layers: slices would draw other masks than the whole, so a feed-forward with one is not chunked.
DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def dropout(module: nn.Module) -> str | None:
    """The first dropout in ``module`` that draws masks (a dropout layer, or a float attribute named ``*dropout*``
    that ``forward`` passes to the functional one), in words; ``None`` where there is none."""
    for name, m in module.named_modules():
        if isinstance(m, DROPOUTS) and m.p > 0:
            return f"`{name}` (p={m.p})"
        for key, value in m.__dict__.items():
            if "dropout" in key and isinstance(value, float) and value > 0:
                return f"`{key}={value}`"
    return None


#: How many times as many slices ``"finer"`` runs as ``"chunked"``.
FINER = 4


def slices(tokens: int, width: int, setting: str = "chunked") -> int:
    """How many slices a chunked feed-forward runs: one per ``width`` tokens (``"finer"``: :data:`FINER` times as
    many), never more than the tokens.

    Examples:
        >>> slices(16384, 4096), slices(4096, 4096), slices(100, 32)
        (4, 1, 4)
        >>> slices(4096, 4096, "finer"), slices(2, 32, "finer")
        (4, 2)
    """
    pieces = max(1, math.ceil(tokens / max(width, 1)))
    return min(max(tokens, 1), pieces * FINER) if setting == "finer" else pieces


class FitChunkUnit:
    """One block's feed-forward at fit: ``setting`` is ``"plain"``, ``"chunked"`` or ``"finer"``; ``block`` is the
    knob's module, ``module`` the feed-forward, ``norms`` the block's token-wise norms, sliced as it is."""

    def __init__(self, name: str, block: nn.Module, module: nn.Module, norms: list[nn.Module] | None = None) -> None:
        self.name, self.block, self.module = name, block, module
        self.norms = norms or []
        self.setting = "plain"
        self.on = True
        #: the slices its last call with gradients had, or would have had, at each chunked setting
        self.pieces = dict.fromkeys(SETTINGS[1:], 1)

    def sliced(self, x: Any) -> bool:
        """Whether a call on ``x`` may run in slices: with gradients, on hidden states of a sequence."""
        return self.on and torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.dim() >= 3

    def forward(self, original: Callable[..., Any], x: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.sliced(x):
            return original(x, *args, **kwargs)
        alone = not (args or kwargs)  # only a feed-forward of the hidden states alone is sliced
        self.pieces = {s: slices(x.shape[1], x.shape[-1], s) if alone else 1 for s in self.pieces}
        return self.run(original, x, self.pieces.get(self.setting, 1), args, kwargs)

    def norm(self, original: Callable[..., Any], x: Any, *args: Any, **kwargs: Any) -> Any:
        if self.setting == "plain" or args or kwargs or not self.sliced(x):
            return original(x, *args, **kwargs)
        return self.run(original, x, slices(x.shape[1], x.shape[-1], self.setting), args, kwargs)

    def run(self, original: Callable[..., Any], x: torch.Tensor, pieces: int, args: Any, kwargs: Any) -> Any:
        """``original`` on ``x`` in ``pieces`` slices along the sequence, each checkpointed."""
        if pieces == 1:
            return original(x, *args, **kwargs)

        def run(part: torch.Tensor) -> Any:
            with recomputing(self.block) if in_backward() else contextlib.nullcontext():
                return original(part)

        size = math.ceil(x.shape[1] / pieces)
        parts = [checkpoint(run, part.contiguous(), use_reentrant=False) for part in x.split(size, dim=1)]
        return torch.cat(parts, dim=1)


class FitChunking(ChunkedUnits):
    """The feed-forward of each repeated block chunked along the sequence at fit (see the module's docstring)."""

    name = "fit_chunking"
    stages = ("fit",)
    option = "chunking"
    reports = ("fit_chunked", "fit_chunking_saved_bytes")
    #: Each slice is a checkpoint of its own, which costs time (its calls, its ops dispatched again): without a budget
    #: the feed-forward is chunked only where that is no slower than the native switch's step.
    reference = "plain"

    def apply(self, found: Any, config: Any) -> Change | None:
        units, random = [], []
        for index, block in enumerate(find_block_stacks(found.module, found.skip)):
            feed_forward = find_feed_forward(block, found.skip)
            if len(feed_forward) != 1:
                continue
            drawn = dropout(feed_forward[0])
            if drawn is None:
                norms = find_token_norms(block, found.skip)
                units.append(FitChunkUnit(f"{found.name}.{index}", block, feed_forward[0], norms))
            else:
                random.append(drawn)
        skipped = (
            [
                f"the feed-forward of {len(random)} blocks is not chunked at fit: its dropout ({random[0]}) would draw"
                " other masks on slices of the sequence than on the whole"
            ]
            if random
            else []
        )
        if not units:
            return Change("nothing", 0, HandleGroup(), skipped=skipped) if skipped else None
        handles = HandleGroup()
        for unit in units:
            handles.add(AttributeOverride.wrap(unit.module, "forward", lambda inner, u=unit: self._wrapped(u, inner)))
            for norm in unit.norms:
                handles.add(AttributeOverride.wrap(norm, "forward", lambda inner, u=unit: self._norm(u, inner)))
        self.units += units
        kind = type(units[0].module).__name__ + (" and its block's norms" if any(u.norms for u in units) else "")
        return Change(f"{kind} chunked along the sequence at fit", len(units), handles, skipped=skipped)

    @staticmethod
    def _wrapped(unit: FitChunkUnit, inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
            return unit.forward(inner, x, *args, **kwargs)

        return forward

    @staticmethod
    def _norm(unit: FitChunkUnit, inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(x: Any, *args: Any, **kwargs: Any) -> Any:
            return unit.norm(inner, x, *args, **kwargs)

        return forward

    def remove(self) -> None:
        self.units = []

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        for unit in self.units:
            unit.on = False
        try:
            yield
        finally:
            for unit in self.units:
                unit.on = True

    @property
    def changed(self) -> bool:
        return any(u.on and u.setting != "plain" for u in self.units)

    def describe(self) -> str | None:
        if not self.units:
            return None
        finer = sum(u.setting == "finer" for u in self.units)
        return f"{self.chunked} of {len(self.units)} blocks" + (f" ({finer} in {FINER}x finer slices)" if finer else "")

    def summary(self) -> str | None:
        return f"feed-forward chunked at fit in {self.describe()}" if self.chunked else None

    def module_of(self, unit: FitChunkUnit) -> nn.Module:
        return unit.block  # priced with the block's checkpointing mode

    def offered(self, planning: Planning | None = None) -> tuple[str, ...]:
        # finer slices only where a budget may need them: each setting is a dry run more
        return WHOLE_OR_CHUNKED if planning is not None and planning.budget is None else SETTINGS

    def worth(self, unit: FitChunkUnit, setting: Hashable) -> bool:
        # a call had more slices at this setting than at the one before it
        return unit.pieces[setting] > (unit.pieces["chunked"] if setting == "finer" else 1)

    def section(self) -> Section:
        if not self.units:
            return Section()
        described, saved = self.describe(), self.saved
        line = f"feed-forward chunked at fit: {described}{modelled_saving(saved)}"
        return Section(settings={"fit_chunked": described}, metrics={"fit_chunking_saved_bytes": saved}, lines=[line])
