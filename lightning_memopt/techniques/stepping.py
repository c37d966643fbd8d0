"""The optimizer step run inside the backward pass at fit: each parameter stepped as soon as its gradient is
accumulated and its gradient freed then, so that the gradients never exist at once (freeing them right after the
optimizer step alone is :mod:`~lightning_memopt.techniques.free_gradients`).

It keeps results exact: the user's own optimizer object steps each parameter (its class, hyperparameters, state and
learning-rate schedule; its ``state_dict`` and every checkpoint in its own format), and a parameter's update reads its
own gradient and state alone in the optimizers allowed (:data:`PER_PARAMETER`). Where a setting would change results
(gradient accumulation, clipping by norm, several processes reducing gradients after the backward pass, a gradient
scaler, manual optimization), the optimizer step stays where it is, and MemOpt says why, naming the setting.

The mechanics are pure torch: :func:`step_one` steps one parameter with an optimizer, and the hooks are
``Tensor.register_post_accumulate_grad_hook`` and ``Optimizer.register_step_post_hook``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_memopt.collectives import sharded_parameters
from lightning_memopt.compat import strategy_refuses
from lightning_memopt.handles import AttributeOverride, HandleGroup
from lightning_memopt.techniques.base import (
    Change,
    FreesGradients,
    OfTheStep,
    Plan,
    Planning,
    Section,
    planned_peak,
    saving,
    trainable,
)
from lightning_memopt.timing import link_byte_s

#: The optimizers whose update of a parameter reads that parameter's gradient and state alone (none needs a closure or
#: every gradient at once, as ``LBFGS`` does): stepping one parameter at a time gives the same weights.
PER_PARAMETER = (
    "SGD",
    "Adam",
    "AdamW",
    "Adamax",
    "NAdam",
    "RAdam",
    "Adagrad",
    "Adadelta",
    "RMSprop",
    "Rprop",
    "ASGD",
    "Adafactor",
)


def step_one(optimizer: torch.optim.Optimizer, group: dict[str, Any], param: torch.Tensor) -> None:
    """Step ``param`` alone with ``optimizer``: its group's hyperparameters as they are now (a scheduler's learning
    rate), its state in ``optimizer.state``; the optimizer's groups are as they were afterwards.

    Examples:
        >>> w = torch.nn.Parameter(torch.ones(2)); v = torch.nn.Parameter(torch.ones(2))
        >>> sgd = torch.optim.SGD([w, v], lr=0.5)
        >>> w.grad = torch.ones(2); v.grad = torch.ones(2)
        >>> step_one(sgd, sgd.param_groups[0], w)
        >>> w.tolist(), v.tolist(), len(sgd.param_groups[0]["params"])
        ([0.5, 0.5], [1.0, 1.0], 2)
    """
    groups, params = optimizer.param_groups, group["params"]
    group["params"], optimizer.param_groups = [param], [group]
    try:
        optimizer.step()
    finally:
        optimizer.param_groups, group["params"] = groups, params


def _groups(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    return {id(p): g for g in optimizer.param_groups for p in g["params"]}


def _hard_reasons(context: Any, found: Any) -> list[str]:
    """The settings under which stepping the trainable parameters of ``found`` inside the backward pass would change
    results."""
    reasons = []
    if context.world_size > 1 and (why := _not_reduced_in_backward(context, found.module)):
        reasons.append(why)
    if context.accumulate_grad_batches > 1:
        reasons.append(f"accumulate_grad_batches={context.accumulate_grad_batches} sums gradients over batches")
    if context.gradient_clip_val:
        how = "by the norm of every gradient" if context.gradient_clip_algorithm == "norm" else "by value"
        reasons.append(
            f"gradient_clip_val={context.gradient_clip_val} clips the gradients {how} after the backward pass"
        )
    if not context.automatic:
        reasons.append("manual optimization steps the optimizers in training_step")
    if context.precision_name == "16-mixed":
        reasons.append("precision='16-mixed' scales the loss and unscales every gradient before the step")
    for optimizer in context.optimizers:
        if type(optimizer).__name__ not in PER_PARAMETER:
            reasons.append(
                f"{type(optimizer).__name__} is not known to update each parameter from its own gradient alone "
                f"(those that are: {', '.join(PER_PARAMETER)})"
            )
    return reasons


def _not_reduced_in_backward(context: Any, module: torch.nn.Module) -> str | None:
    """Why, with several processes, a parameter's gradient is not final when its post-accumulate-grad hook runs;
    ``None`` under FSDP2 (``fully_shard``) alone, which reduce-scatters each unit's gradients inside the backward pass
    and runs those hooks on the sharded parameter with its reduced, sharded gradient."""
    strategy = type(context.strategy).__name__ if context.strategy is not None else "the strategy"
    processes = f"{strategy} with {context.world_size} processes"
    if strategy != "ModelParallelStrategy":
        return (
            f"{processes} reduces the gradients after the backward pass, and a parameter stepped inside it would be "
            "stepped with its own process's gradient"
        )
    if getattr(context.strategy, "_tensor_parallel_size", 1) != 1:
        return f"{processes} and tensor_parallel_size={context.strategy._tensor_parallel_size}: not known to be exact"
    sharded = sharded_parameters(module)
    unsharded = [p for p in module.parameters() if p.requires_grad and id(p) not in sharded]
    if unsharded:
        return (
            f"{processes}: {len(unsharded)} trainable parameters are not sharded by fully_shard, so nothing reduces "
            "their gradients inside the backward pass"
        )
    return None


class OptimizerInBackward(FreesGradients, OfTheStep):
    """Steps each parameter inside the backward pass, as soon as its gradient is accumulated, with the user's optimizer
    (:func:`step_one`), and frees the gradient then: the gradients never exist at once. Exact (see the module's words);
    where a setting would change results it stays off and says why. With ``optimizer_in_backward="auto"`` it is a knob
    of the whole step for the stage's planner, in force where that is the fastest way under the budget (its hooks
    registered only then), and ``True`` puts it in force from the start. The user's hooks that read gradients after the
    backward pass (``on_after_backward``, ``on_before_optimizer_step``) then see none: a warning names them.

    Its setting ``"host"`` (``optimizer_in_backward="host"``, or the planner's choice on an accelerator) also keeps
    the optimizer's state in host memory: each parameter, its gradient as it arrives, and its state are stepped there
    by the user's optimizer, and the updated parameter is copied back, so that the device holds no optimizer state. Its
    cost is the bytes copied (the parameter and its gradient to the host, the parameter back) at the host link's
    rate; on a CPU the host is the device, and it saves nothing. When the stage ends the state goes back to each
    parameter's device. The update is the same computation; on an accelerator the host's CPU rounds it, which may
    differ from the device's kernels in the last bit."""

    name, stages, option = "optimizer_in_backward", ("fit",), "optimizer_in_backward"
    of_the_step = True
    reports = ("optimizer_in_backward", "optimizer_in_backward_saved_bytes")

    @classmethod
    def refuses(cls, context: Any) -> str | None:
        return strategy_refuses(cls.name, context.strategy)

    @classmethod
    def may_act(cls, config: Any) -> bool:
        return config.optimizer_in_backward is True or config.memory_budget is not None

    def __init__(self) -> None:
        self._params: dict[int, torch.optim.Optimizer] = {}  # id of each parameter stepped: its optimizer
        self._positions: list[set[tuple[int, int]]] = []  # per optimizer: (group, param) indices stepped
        self._groups: dict[int, dict[int, dict[str, Any]]] = {}  # per optimizer: id(param) -> its group
        self._engaged = False
        self._host = False  # the state kept in host memory, each parameter stepped there
        self._accelerator = False  # the stage's device is one (the host setting is worth offering)
        self._device: Any = "cpu"
        self._stand_in = False  # the dry runs stand in for the device on this machine's CPU
        self._on = True
        self._auto = True
        self._saved: int | None = None
        self._said: list[str] = []
        self._refused: list[str] = []
        self._told = False  # the budget was missed where a setting keeps it off, and that was said
        self._freed: dict[int, torch.Tensor] = {}
        self._waiting: list[torch.Tensor] = []  # the parameters whose hooks wait to be registered until it is in force
        self._hooks = HandleGroup()

    @classmethod
    def uses_budget(cls, config: Any) -> bool:
        return config.optimizer_in_backward == "auto"

    def apply(self, found: Any, config: Any) -> Change | None:
        context = self.context
        self._auto = config.optimizer_in_backward == "auto"
        if config.verify or (self._auto and config.memory_budget is None):  # verify compares the gradients
            return None
        self._refused = _hard_reasons(context, found)
        if self._refused:  # with True, said now; with "auto", where the budget is missed (plan)
            why = f"the optimizer step stays after the backward pass: {'; '.join(self._refused)}"
            return Change("", 0, HandleGroup(), skipped=[] if self._auto else [why])
        params, reached = trainable(found), []
        for index, optimizer in enumerate(context.optimizers):
            while len(self._positions) <= index:
                self._positions.append(set())
            for g, group in enumerate(optimizer.param_groups):
                for i, param in enumerate(group["params"]):
                    if id(param) in params and id(param) not in self._params:
                        self._params[id(param)] = optimizer
                        self._positions[index].add((g, i))
                        reached.append(param)
        if not reached:
            return None
        self._waiting += reached
        if config.optimizer_in_backward in (True, "host"):
            self.put(config.optimizer_in_backward)
            self.batch_start()
        return Change("each parameter stepped in the backward pass", len(reached), self._hooks, unit="parameter")

    @property
    def ready(self) -> bool:
        return bool(self._params)

    def settings(self) -> tuple[Any, ...]:
        return (False, True, "host") if self._accelerator else (False, True)

    def knobs(self, planning: Planning) -> list[Any]:
        self._device, self._stand_in = planning.target, torch.device(planning.target) != torch.device(planning.device)
        self._accelerator = link_byte_s(planning.target) is not None
        return super().knobs(planning)

    def setting(self) -> Any:
        return "host" if self._engaged and self._host else self._engaged

    def put(self, setting: Any) -> None:
        """What the dry runs see; the hooks wait for :meth:`batch_start`."""
        self._engaged, self._host = bool(setting), setting == "host"

    def cost(self, setting: Any) -> float:
        """The host setting's copies: each trainable parameter to the host and back, and its gradient to the host."""
        rate = link_byte_s(self._device) if setting == "host" else None
        if rate is None:
            return 0.0
        params = {id(p): p for o in self.context.optimizers for g in o.param_groups for p in g["params"]}
        return rate * sum(3 * p.numel() * p.element_size() for i, p in params.items() if i in self._params)

    def batch_start(self) -> None:
        """In force: each parameter's hook registered (none before, so that a step without it costs nothing; where it
        was put off again, they stay and do nothing)."""
        if self.changed and self._waiting:
            waiting, self._waiting = self._waiting, []
            for param in waiting:
                self._hooks.add(param.register_post_accumulate_grad_hook(self._step))

    def _step(self, param: torch.Tensor) -> None:
        if not self.changed or param.grad is None:
            return
        optimizer = self._params[id(param)]
        group = self._group(optimizer, param)
        if self._host:
            step_on_host(optimizer, group, param)
        else:
            step_one(optimizer, group, param)
        param.grad, self._freed[id(param)] = None, param

    def _group(self, optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, Any]:
        """The group holding ``param`` now (a checkpoint loaded into the optimizer replaces its groups)."""
        groups = self._groups.get(id(optimizer))
        group = groups.get(id(param)) if groups is not None else None
        if group is None or not any(g is group for g in optimizer.param_groups):
            groups = self._groups[id(optimizer)] = _groups(optimizer)
            group = groups[id(param)]
        return group

    def remove(self) -> None:
        for optimizer in {id(o): o for o in self._params.values()}.values():  # the state back on the device
            to_devices(optimizer)
        self._params, self._positions, self._groups, self._freed, self._waiting = {}, [], {}, {}, []
        self._hooks = HandleGroup()

    @property
    def changed(self) -> bool:
        return bool(self._params) and self._engaged and self._on

    def frees_in_backward(self, ids: set[int]) -> bool:
        return self.changed and ids <= self._params.keys()

    def describe(self) -> str | None:
        if not self._params:
            return None
        if not self.changed:
            return "optimizer step after the backward"
        return "each parameter stepped in the backward pass" + (", its state on the host" if self._host else "")

    def summary(self) -> str | None:
        if not self.changed:
            return None
        return "optimizer step in the backward pass" + (", state on the host" if self._host else "")

    def state(self) -> dict[str, Any]:
        return {"engaged": self._engaged, "host": self._host}

    def load(self, state: dict[str, Any]) -> bool:
        if self._auto and self._params and "engaged" in state:  # with True it stays in force
            # its hooks, if any, stay registered and do nothing while it is off
            self.put("host" if state["engaged"] and state.get("host") else state["engaged"])
        return True

    # the dry runs --------------------------------------------------------------------------------------------------

    def around_backward(self, default: Callable[..., Any]) -> Callable[..., Any]:
        @contextlib.contextmanager
        def backward(optimizers: list[Any], stepping: Callable[..., Any]) -> Iterator[None]:
            if not self.changed or len(optimizers) != len(self.context.optimizers):
                with default(optimizers, stepping):
                    yield
                return
            hooks = HandleGroup()
            for index, twin in enumerate(optimizers):
                positions = self._positions[index] if index < len(self._positions) else set()
                for g, group in enumerate(twin.param_groups):
                    for i, param in enumerate(group["params"]):
                        if (g, i) in positions:
                            host = self._host_device if self._host else None
                            step = functools.partial(_dry_step, optimizers, twin, group, stepping, host)
                            hooks.add(param.register_post_accumulate_grad_hook(step))
            try:
                with default(optimizers, stepping):
                    yield
            finally:
                hooks.remove()

        return backward

    def around_twins(self, default: Callable[..., Any]) -> Callable[..., Any]:
        """With the state on the host, the twins' state is there too (the state a first step makes, moved there after
        it); without, on each parameter's device, as the optimizer would hold it."""

        @contextlib.contextmanager
        def twins(pairs: list[tuple[Any, Any]]) -> Iterator[None]:
            wraps = HandleGroup()
            for twin, _ in pairs:
                if self.changed and self._host:
                    host = self._host_device
                    wraps.add(AttributeOverride.wrap(twin, "step", functools.partial(_then_to_host, twin, host)))
                    to_host(twin, host)
                else:
                    to_devices(twin)
            try:
                with default(pairs):
                    yield
            finally:
                wraps.remove()

        return twins

    @property
    def _host_device(self) -> str:
        """Where a dry run keeps the state on the host: the CPU, but for a CUDA device this machine does not have
        (whose dry runs count the CPU's fake tensors as the GPU's) the meta device, counted apart as the host's."""
        return "meta" if self._stand_in else "cpu"

    def plan(self, planning: Planning) -> Plan | None:
        """Says what the stage's planner chose for its knob: that the user's hooks reading gradients will see none,
        or, where a setting keeps it off and the budget is missed, which."""
        if self._auto and planning.budget is not None and planning.choose:
            if self._refused and not self._told and _missed(planning):  # said once; nothing can be put in force
                self._told = True
                reasons = "; ".join(self._refused)
                self._said.append(
                    f"the budget is missed, and the optimizer step stays after the backward pass: {reasons}"
                )
            elif self.changed and self.context.readers:
                self._said.append(
                    f"the budget needs the optimizer step in the backward pass: {', '.join(self.context.readers)} "
                    "will see no gradients"
                )
        self._saved = saving(self, planning) if planning.measure else None
        return None

    def section(self) -> Section:
        described = self.describe()
        return Section(
            settings={"optimizer_in_backward": described},
            metrics={"optimizer_in_backward_saved_bytes": self._saved},
            lines=[f"in force: {described}"] if self.changed and self._host else [],
        )


def _missed(planning: Planning) -> bool:
    """Whether the step's peak with the settings in force is over the budget."""
    if planning.chosen is not None:
        return planning.chosen.peak_bytes is not None and not planning.chosen.met
    peak = planned_peak(planning)
    return peak is not None and peak > planning.budget


def _dry_step(
    optimizers: list[Any],
    twin: Any,
    group: dict[str, Any],
    stepping: Callable[..., Any],
    host: str | None,
    param: torch.Tensor,
) -> None:
    if param.grad is not None:
        if host is None:
            stepping(optimizers, lambda: step_one(twin, group, param))
        else:
            stepping(optimizers, lambda: step_on_host(twin, group, param, host))
        param.grad = None


def step_on_host(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], param: torch.Tensor, host: str = "cpu"
) -> None:
    """Step ``param`` alone with ``optimizer`` in host memory (``host``): its data and gradient copied there for the
    step, its state there (kept in ``optimizer.state`` under ``param``, as any other technique finds it), and the
    updated copy written back into its data.

    Examples:
        >>> w = torch.nn.Parameter(torch.ones(2)); w.grad = torch.ones(2)
        >>> sgd = torch.optim.SGD([w], lr=0.5, momentum=0.9)
        >>> step_on_host(sgd, sgd.param_groups[0], w)
        >>> w.tolist(), sgd.state[w]["momentum_buffer"].tolist()
        ([0.5, 0.5], [1.0, 1.0])
    """
    if host == "meta":  # a dry run's stand-in for a host it cannot count apart: a tensor of its own, stepped there
        there = param.detach().to(host)
        there.grad = param.grad.detach().to(host)
        state = optimizer.state.pop(param, None)
        if state is not None:
            optimizer.state[there] = state
        try:
            step_one(optimizer, group, there)
        finally:
            optimizer.state[param] = optimizer.state.pop(there, state if state is not None else {})
        return
    here, grad = param.data, param.grad
    param.data, param.grad = here.to(host, copy=True), grad.detach().to(host, copy=True)
    try:  # the parameter itself, its data and gradient on the host for the step: its state is found as it is kept
        step_one(optimizer, group, param)
        there = param.data
    finally:
        param.data, param.grad = here, grad
    with torch.no_grad():
        here.copy_(there)


def _moments(optimizer: Any) -> Iterator[tuple[dict[str, Any], str, torch.Tensor, torch.Tensor]]:
    """Each state tensor of a parameter that has its shape (not a step count): its state, key, value, parameter."""
    for param, state in list(optimizer.state.items()):
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                yield state, key, value, param


def to_host(optimizer: Any, host: str = "cpu") -> None:
    """The optimizer's state in host memory (``host``)."""
    for state, key, value, _ in _moments(optimizer):
        if value.device.type != host:
            state[key] = value.to(host)


def to_devices(optimizer: Any) -> None:
    """The optimizer's state on each parameter's device (as the optimizer holds it without MemOpt)."""
    for state, key, value, param in _moments(optimizer):
        if value.device != param.device:
            state[key] = value.to(param.device)


def _then_to_host(twin: Any, host: str, inner: Callable[..., Any]) -> Callable[..., Any]:
    def step(*args: Any, **kwargs: Any) -> Any:
        result = inner(*args, **kwargs)
        to_host(twin, host)
        return result

    return step
