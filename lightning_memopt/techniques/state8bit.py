"""An 8-bit optimizer state at fit, where results may change (``lossy=True``): Adam's and AdamW's two moments kept in
8 bits between steps, blockwise (a scale per block of 256 values and a code per value from a dynamic map, as in
Dettmers et al., 2022; the quantization is bitsandbytes', through :func:`~lightning_memopt.techniques.lossy.quantize`),
about a quarter of their bytes in float32.

The user's optimizer object keeps doing the update, in its own precision, with its own hyperparameters and schedule:
its ``step`` runs over a few parameters at a time, each of whose moments is put back in full just before and kept in 8
bits again just after, so that the full moments of no more than the largest parameter exist at once. Its
``state_dict()`` gives the moments in full, in the optimizer's own format (a checkpoint loads without MemOpt, and a
plain checkpoint loads under it); when the fit ends they are put back in full in the optimizer itself. Parameters of
fewer than 4,096 values keep their moments as they are.

The update itself is exact; the moments lose precision each time they are kept in 8 bits, so the weights drift from a
plain optimizer's: the first step in force measures by how much the moments moved, which a warning, the loggers
(``memopt/optimizer_state_8bit_difference``) and the summary say (:class:`~lightning_memopt.techniques.lossy.
Difference`); the benchmark gives how far the weights moved.

bitsandbytes is imported only where the moments are kept in 8 bits for real (:func:`~lightning_memopt.techniques.
lossy.bitsandbytes`): the dry runs count its ops from their outputs' shapes alone.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_memopt.compat import strategy_refuses
from lightning_memopt.handles import AttributeOverride, HandleGroup
from lightning_memopt.techniques.base import (
    Change,
    OfTheStep,
    OnOff,
    Plan,
    Planning,
    Section,
    saving,
    twin_ids,
)
from lightning_memopt.techniques.lossy import Difference, code_map, dequantize, quantize, warn

#: The optimizers whose moments it keeps in 8 bits, and those moments: signed ones, and those never negative.
OPTIMIZERS = ("Adam", "AdamW")
SIGNED, UNSIGNED = ("exp_avg",), ("exp_avg_sq", "max_exp_avg_sq")
#: A parameter with fewer values than ``SMALLEST`` keeps its moments as they are.
SMALLEST = 4096
#: Where a moment is kept in 8 bits: ``state[name + CODES]`` (uint8, the parameter's shape) and ``state[name + SCALE]``
#: (float32, one per block).
CODES, SCALE = ".codes", ".scale"


def fits(param: torch.Tensor) -> bool:
    """Whether ``param``'s moments can be kept in 8 bits: a real float32, bfloat16 or float16 tensor of at least
    :data:`SMALLEST` values, not sharded."""
    return (
        param.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and param.numel() >= SMALLEST
        and type(param) in (torch.Tensor, torch.nn.Parameter)
    )


def pack(state: dict[str, Any], differences: list[float] | None = None) -> None:
    """Keep the moments in one parameter's ``state`` in 8 bits (those in full go); with ``differences``, append to it
    each moment's largest difference from its value in full, relative to its largest value."""
    for name in (*SIGNED, *UNSIGNED):
        value = state.pop(name, None)
        if isinstance(value, torch.Tensor):
            codes, scale = state[name + CODES], state[name + SCALE] = quantize(value, name in SIGNED)
            if differences is not None:
                largest = value.abs().max().item()
                error = (dequantize(codes, scale, name in SIGNED, value.dtype) - value).abs().max().item()
                differences.append(error / largest if largest else 0.0)


def unpack(state: dict[str, Any], dtype: torch.dtype, host: bool = False) -> None:
    """Put the moments in one parameter's ``state`` back in full, in ``dtype`` (the parameter's), in host memory with
    ``host``; those in 8 bits go."""
    for name in (*SIGNED, *UNSIGNED):
        if name + CODES in state:
            codes, scale = state.pop(name + CODES), state.pop(name + SCALE)
            full = dequantize(codes, scale, name in SIGNED, dtype)
            state[name] = full.cpu() if host else full


def packed(state: dict[str, Any]) -> bool:
    return any(name + CODES in state for name in (*SIGNED, *UNSIGNED))


class Packed:
    """Keeps the moments of ``params`` (ids) in ``optimizer`` in 8 bits between steps: its ``step`` overridden to step a
    few parameters at a time with their moments in full, ``state_dict()`` in full, ``load_state_dict`` packs again.
    ``remove()`` puts every moment back in full."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: set[int]) -> None:
        self.optimizer = optimizer
        self.params = params  # the technique's own set: another model's parameters may join it (refresh)
        self.limit = 0  # values stepped at once: the largest parameter's
        self.differences: list[float] | None = None  # each moment's difference when packed, while measured
        self.refresh()
        self.handles = HandleGroup(
            [
                AttributeOverride.wrap(optimizer, "step", self._stepping),
                optimizer.register_state_dict_post_hook(self._in_full),
                optimizer.register_load_state_dict_post_hook(lambda optimizer: self._pack_all()),
            ]
        )

    def refresh(self) -> None:
        """Take in the parameters added to ``params`` since."""
        sizes = [p.numel() for g in self.optimizer.param_groups for p in g["params"] if id(p) in self.params]
        self.limit = max(sizes, default=0)
        self._pack_all()

    def _pack_all(self) -> None:
        for param, state in self.optimizer.state.items():
            if id(param) in self.params and not packed(state):
                pack(state)

    def _stepping(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def step(closure: Callable[[], Any] | None = None) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            optimizer, groups = self.optimizer, self.optimizer.param_groups
            try:
                for group in groups:
                    for chunk in self._chunks(group["params"]):
                        self._step(inner, group, chunk)
            finally:
                optimizer.param_groups = groups
            return loss

        return step

    def _chunks(self, params: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
        chunk, size = [], 0
        for param in params:
            if param.grad is None:
                continue
            ours = param.numel() if id(param) in self.params else 0
            if chunk and ours and size + ours > self.limit:
                yield chunk
                chunk, size = [], 0
            chunk.append(param)
            size += ours
        if chunk:
            yield chunk

    def _step(self, inner: Callable[..., Any], group: dict[str, Any], chunk: list[torch.Tensor]) -> None:
        state, params = self.optimizer.state, group["params"]
        ours = [p for p in chunk if id(p) in self.params]
        for param in ours:
            if param in state:
                unpack(state[param], param.dtype)
        group["params"], self.optimizer.param_groups = chunk, [group]
        try:
            inner()
        finally:
            group["params"] = params
            for param in ours:
                if param in state:
                    pack(state[param], self.differences)

    def _in_full(self, optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The state dict with every moment in full (the optimizer's own format; on an accelerator in host memory,
        one moment at a time on the device); the optimizer keeps its own."""
        params = [p for g in optimizer.param_groups for p in g["params"]]  # the state dict's indices, in order
        full = {}
        for index, state in state_dict["state"].items():
            full[index] = dict(state)
            if packed(state):
                unpack(full[index], params[index].dtype, host=params[index].device.type != "cpu")
        state_dict["state"] = full
        return state_dict

    def remove(self, unpack_all: bool = True) -> None:
        """Its hooks off, and with ``unpack_all`` every moment back in full: on an accelerator in host memory, where
        Lightning moves the optimizers' state when a fit ends anyway, so that the device never holds them all."""
        self.handles.remove()
        for param, state in self.optimizer.state.items() if unpack_all else ():
            if id(param) in self.params:
                unpack(state, param.dtype, host=param.device.type != "cpu")


class OptimizerState8bit(OnOff, OfTheStep):
    """Keeps Adam's and AdamW's moments in 8 bits between steps (:class:`Packed`), where results may change: only with
    ``lossy=True``. With ``optimizer_state_8bit="auto"`` it is a knob of the whole step for the stage's planner, in
    force where no mix that keeps results is predicted faster under the budget; ``True`` puts it in force from the start
    (the moments are packed as the next batch starts). Without ``lossy=True``, a budget that only it would meet is
    missed, and the warning says what it would reach. ``off()`` makes the dry runs see the optimizers' state in full
    (the moments in 8 bits stay so in the optimizers)."""

    name, stages, option = "optimizer_state_8bit", ("fit",), "optimizer_state_8bit"
    of_the_step, lossy = True, True
    reports = ("optimizer_state_8bit_saved_bytes", "optimizer_state_8bit_difference")

    def __init__(self) -> None:
        self._targets: dict[int, tuple[torch.optim.Optimizer, set[int]]] = {}  # by id: each optimizer, its params
        self._packed: list[Packed] = []
        self._auto = True
        self._lossy = False
        self._on = True
        self._wanted = False  # the dry runs see it in force; the optimizers' moments are packed as a batch starts
        self._saved: int | None = None
        self._differences: list[float] = []
        self._measured = False  # the first step in force measured how far the moments in 8 bits are from full
        self._difference = Difference(
            "optimizer_state_8bit_difference", "a moment kept in 8 bits from its value in full", "its largest value"
        )
        self._said: list[str] = []

    @classmethod
    def uses_budget(cls, config: Any) -> bool:
        return config.optimizer_state_8bit == "auto"

    @classmethod
    def refuses(cls, context: Any) -> str | None:
        return strategy_refuses(cls.name, context.strategy)

    @classmethod
    def may_act(cls, config: Any) -> bool:
        return config.optimizer_state_8bit is True or (
            config.optimizer_state_8bit == "auto"
            and config.lossy
            and config.memory_budget is not None
            and config.optimizer_in_backward != "host"
        )

    def goes_with(self, setting: Any, others: dict[str, Any]) -> bool:
        """Not in 8 bits with the optimizer step on the host, which keeps the state there in full."""
        return not setting or others.get("optimizer_in_backward") != "host"

    def apply(self, found: Any, config: Any) -> Change | None:
        self._auto, self._lossy = config.optimizer_state_8bit == "auto", config.may_change_results
        host = config.optimizer_in_backward == "host"  # the state in full on the host: nothing to keep in 8 bits
        if config.verify or (self._auto and (config.memory_budget is None or host)):
            return None
        if importlib.util.find_spec("bitsandbytes") is None:
            if not self._auto or self._lossy:  # asked for, or allowed under the budget
                why = "the optimizer state stays as it is: an 8-bit state needs bitsandbytes (pip install bitsandbytes)"
                return Change("", 0, HandleGroup(), skipped=[why])
            return None
        trainable = {id(p) for p in found.module.parameters() if p.requires_grad}
        skipped, reached = [], 0
        for optimizer in self.context.optimizers:
            ids = {id(p) for g in optimizer.param_groups for p in g["params"] if id(p) in trainable and fits(p)}
            if not ids:
                continue
            kind = type(optimizer).__name__
            if kind not in OPTIMIZERS:
                skipped.append(f"{kind}'s state stays as it is: an 8-bit state is kept for {' and '.join(OPTIMIZERS)}")
                continue
            _, params = self._targets.setdefault(id(optimizer), (optimizer, set()))
            reached += len(ids - params)
            params |= ids
        if not reached:
            return Change("", 0, HandleGroup(), skipped=skipped) if skipped else None
        if config.optimizer_state_8bit is True:
            self.put(True)
        return Change("moments kept in 8 bits between steps", reached, _Release(self), skipped, unit="parameter")

    def _release(self) -> None:
        packs, self._packed = self._packed, []
        HandleGroup(packs).remove()

    def remove(self) -> None:
        self._release()
        self._targets = {}

    @property
    def changed(self) -> bool:
        return self._wanted and self._on and bool(self._targets)

    @property
    def ready(self) -> bool:
        return bool(self._targets)

    def setting(self) -> bool:
        return self._wanted

    def put(self, setting: Any) -> None:
        """What the dry runs see; the moments are packed, or put back in full, as the next batch starts."""
        self._wanted = bool(setting)

    def describe(self) -> str | None:
        if not self._targets:
            return None
        return "Adam's moments kept in 8 bits" if self._wanted else "optimizer state as it is"

    def summary(self) -> str | None:
        return "optimizer state in 8 bits" if self.changed else None

    def state(self) -> dict[str, Any]:
        return {"engaged": self._wanted}

    def load(self, state: dict[str, Any]) -> bool:
        if self._auto and self._targets and state.get("engaged") and self._lossy:
            self.put(True)
        return True

    def _pack(self) -> None:
        """Every optimizer's moments of the parameters reached kept in 8 bits (another model's parameters joining an
        optimizer kept already)."""
        have = {id(packs.optimizer) for packs in self._packed}
        for packs in self._packed:
            packs.refresh()
        self._packed += [Packed(o, params) for o, params in self._targets.values() if id(o) not in have]
        if not self._measured:
            for packs in self._packed:
                packs.differences = self._differences

    def batch_start(self) -> None:
        """Before a step: the moments packed where the planner put it in force (or back in full where it no longer
        is), and the dynamic maps made for their devices (bitsandbytes imported), outside the step."""
        if self._wanted and len(self._packed) < len(self._targets):
            self._pack()
        elif not self._wanted and self._packed:
            self._release()
        for packs in self._packed if self.changed else ():
            groups = packs.optimizer.param_groups
            for device in {p.device for g in groups for p in g["params"] if id(p) in packs.params}:
                code_map(True, device), code_map(False, device)

    def batch_end(self) -> None:
        if self._packed and not self._measured and self._differences:
            self._measured = True
            for packs in self._packed:
                packs.differences = None
            said = self._difference.warning("Adam's moments are kept in 8 bits between steps", self.difference)
            if said is not None:  # measured by the first step in force: no plan of the stage is left to say it
                warn(said)

    @property
    def difference(self) -> float | None:
        """The largest difference of a moment kept in 8 bits from its value in full, relative to its largest value, on
        the first step it was kept so (``None``: none measured yet)."""
        return max(self._differences) if self._differences else None

    def notices(self, budget: int | None) -> list[str]:
        said, self._said = self._said, []
        return said

    # the dry runs --------------------------------------------------------------------------------------------------

    def around_twins(self, default: Callable[..., Any]) -> Callable[..., Any]:
        @contextlib.contextmanager
        def twins(pairs: list[tuple[Any, Any]]) -> Iterator[None]:
            packs = []
            for twin, real in pairs:
                target = self._targets.get(id(real))
                if target is None:
                    continue
                ids = twin_ids(twin, real, target[1])
                if self.changed:
                    packs.append(Packed(twin, ids))
                else:  # as the optimizer would hold it without: in full
                    for param, state in twin.state.items():
                        if id(param) in ids:
                            unpack(state, param.dtype)
            try:
                with default(pairs):
                    yield
            finally:
                for packs_ in packs:
                    packs_.remove(unpack_all=False)

        return twins

    def plan(self, planning: Planning) -> Plan | None:
        reach = self.would_reach(planning)
        if reach is not None:
            self._said.append(
                f"memory_budget={planning.budget} B is missed ({reach[0]} B); keeping the optimizer's moments "
                f"in 8 bits would reach {reach[1]} B, but changes results: pass lossy=True to allow it"
            )
        self._saved = saving(self, planning) if planning.measure else None
        return None

    def section(self) -> Section:
        difference = self.difference
        return Section(
            metrics={"optimizer_state_8bit_saved_bytes": self._saved, **self._difference.metrics(difference)},
            lines=self._difference.lines(difference) if self.changed else [],
        )


class _Release:
    def __init__(self, technique: OptimizerState8bit) -> None:
        self.technique = technique

    def remove(self) -> None:
        self.technique._release()
