"""The mechanics of activation checkpointing: each block's unit and mode, MemOpt's non-reentrant checkpoint (the
function a library's switch calls, and the generic wrapper for blocks without one), and what times and counts the
recomputation."""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from lightning_memopt.adapters.torch_generic import find_feed_forward
from lightning_memopt.compat import FakeTensor, NormBase, in_backward, tensor_version
from lightning_memopt.flops import policed
from lightning_memopt.handles import (
    AttributeOverride,
    ContainerSnapshot,
    HandleGroup,
    find_containers,
)
from lightning_memopt.techniques.checkpointing.selective import MODES, PARTS, POLICIES, contexts, recomputing


@dataclass(frozen=True)
class CheckpointConfig:
    """How blocks are checkpointed.

    Args:
        use_reentrant: Passed to :func:`torch.utils.checkpoint.checkpoint`. Only ``False`` is accepted: the
            non-reentrant variant handles keyword arguments, frozen bases with adapters and DDP.
        block_classes: Checkpoint exactly the outermost instances of these classes (types or class names) instead of
            what a model's own switch or the stack search would pick.

    Examples:
        >>> CheckpointConfig(block_classes=("TransformerEncoderLayer",)).block_classes
        ('TransformerEncoderLayer',)
    """

    use_reentrant: bool = False
    block_classes: tuple[type | str, ...] | None = None

    def __post_init__(self) -> None:
        if self.use_reentrant is not False:
            raise ValueError(f"`use_reentrant` must be False, got {self.use_reentrant!r}")


class CheckpointUnit:
    """One block's checkpointing setting, which can be changed between steps: ``mode`` is one of :data:`MODES`:
    ``"none"`` (the block keeps its activations), ``"selective"`` (it keeps its costly ops' outputs and recomputes the
    rest), ``"feed_forward"`` (the block runs plain but for its feed-forward modules, :attr:`parts`, each checkpointed
    on its own: where they hold most of a block's activations, as in a Llama decoder layer, much of the memory for a
    part of the recomputation and no dispatch mode; ``"feed_forward_selective"``, each checkpointed selectively, its
    activation recomputed from the matrix products' outputs), ``"attention"`` (it keeps its fused attention's outputs
    and recomputes the rest), ``"full"`` (it recomputes its forward) or, for a block whose library checkpoints parts
    of it, ``"whole"`` (the block as one segment, keeping only its inputs) or, where :attr:`offload` says where,
    ``"offload"`` (``"full"``, its inputs that carry gradients kept in host memory, see :func:`ferried`).

    For a block checkpointed by its model library's own switch, the block's ``gradient_checkpointing`` flag says
    whether its parts are checkpointed and its own :class:`MemOptCheckpoint` (``function``) how; ``"whole"`` turns the
    flag off and checkpoints the block's ``forward`` (wrapped by :func:`apply_checkpointing` where ``whole`` was
    offered). A block wrapped by :func:`apply_checkpointing` keeps a setting of the unit's own.

    Examples:
        >>> from torch import nn
        >>> unit = CheckpointUnit("layers.0", nn.Linear(2, 2), native=False)
        >>> unit.mode = "selective"; unit.enabled, unit.mode, unit.modes
        (True, 'selective', ('none', 'selective', 'attention', 'full'))
        >>> unit.mode = "none"; unit.enabled
        False
    """

    def __init__(self, name: str, module: nn.Module, native: bool, function: MemOptCheckpoint | None = None) -> None:
        self.name = name
        self.module = module
        self.native = native
        self.function = function  # the checkpoint function the library calls for this block (native)
        self.whole = False  # whether the block's forward is wrapped, to checkpoint it whole (native)
        self.timer: RecomputeTimer | None = None
        self.parts: list[nn.Module] = []  # its feed-forward modules, checkpointed in "feed_forward" (checkpoint_parts)
        self.offload: HostInputs | None = None  # where "offload" keeps its inputs; None: that mode is not offered
        self._mode = "full"

    def __deepcopy__(self, memo: dict[int, Any]) -> CheckpointUnit:
        """A copy of the model (an EMA copy taken during fit) is not MemOpt's: its blocks run plain, whatever this
        unit does later, and it holds no timer."""
        copy = CheckpointUnit(self.name, deepcopy(self.module, memo), self.native)
        copy._mode = "none"
        return copy

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "timer": None, "_mode": "none"}

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes this block can take: ``"selective"`` and ``"attention"`` where MemOpt's checkpoint function runs
        it, ``"feed_forward"`` where it has feed-forward modules, ``"whole"`` where its forward is wrapped,
        ``"offload"`` where MemOpt's checkpoint function runs it and :attr:`offload` is set."""
        ours = not self.native or self.function is not None
        offered = {
            "whole": self.whole,
            "offload": ours and self.offload is not None,
            **dict.fromkeys(PARTS, bool(self.parts)),
        }
        return tuple(m for m in MODES if (m not in POLICIES or ours) and offered.get(m, True))

    @property
    def mode(self) -> str:
        if not self.native or self._mode in _OWN:
            return self._mode
        if not self.module.__dict__.get("gradient_checkpointing"):
            return "none"
        return self.function.mode if self.function is not None else "full"

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in self.modes:
            raise ValueError(f"the mode of block `{self.name}` must be one of {self.modes}, got {value!r}")
        self._mode = value
        if self.native:
            self.module.__dict__["gradient_checkpointing"] = value not in ("none", *_OWN)
            if self.function is not None:
                self.function.mode = value if value in (*POLICIES, "offload") else "full"
                self.function.offload = self.offload

    def offer(self, host: str | None) -> None:
        """Offer the ``"offload"`` mode, its inputs kept in ``host`` memory (``None``: not offered; a block in it goes
        back to ``"full"``)."""
        if host is None and self.mode == "offload":
            self.mode = "full"
        if host is None:
            self.offload = None
        elif self.offload is None:
            self.offload = HostInputs(host)
        else:
            self.offload.host = host
        if self.function is not None:
            self.function.offload = self.offload

    @property
    def wrapped(self) -> bool:
        """Whether the wrapper of :func:`apply_checkpointing` checkpoints the block's ``forward`` now."""
        return self.mode == "whole" if self.native else self.mode != "none" and self.mode not in PARTS

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


#: The modes of a library's block that its switch's flag does not give: the flag is off, MemOpt's wrappers act.
_OWN = (*PARTS, "whole")


@dataclass
class HostInputs:
    """Where a block in the ``"offload"`` mode keeps its inputs: ``host`` is ``"cpu"``, or ``"meta"`` in a dry run
    standing in for an accelerator this machine does not have (its bytes counted apart, as the host's); ``moved``, the
    bytes its last call copied there (each comes back once, for the recomputation)."""

    host: str = "cpu"
    moved: int = 0


def ferried(function: Callable[..., Any], args: tuple[Any, ...], offload: HostInputs) -> tuple[Any, tuple[Any, ...]]:
    """``function`` and the arguments a checkpoint of it keeps, for a block whose inputs that carry gradients are kept
    in host memory until its recomputation: each such input is given to the checkpoint as a copy on the host (pinned,
    on a CUDA device), the first run gets the input itself (held weakly: nothing of MemOpt keeps it on the device), the
    recomputation the copy brought back to the input's device (needing gradients, as the input did). The copies are
    exact, so the recomputation is too.

    Examples:
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> offload = HostInputs()
        >>> run, kept = ferried(lambda t: t * 2, (x,), offload)
        >>> kept[0] is x, kept[0].requires_grad, offload.moved, run(*kept).tolist()
        (False, False, 24, [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]])
    """
    live: dict[int, tuple[weakref.ref[torch.Tensor], torch.device]] = {}
    kept = list(args)
    for index, value in enumerate(args):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            live[index] = (weakref.ref(value), value.device)
            kept[index] = _to_host(value.detach(), offload.host)
    offload.moved = sum(kept[i].numel() * kept[i].element_size() for i in live)

    def run(*given: Any, **kwargs: Any) -> Any:
        inputs = list(given)
        for index, (ref, device) in live.items():
            value = None if in_backward() else ref()
            if value is None:  # a leaf needing gradients, as the input did: the same ops save the same tensors
                value = given[index].to(device, non_blocking=True).detach().requires_grad_()
            inputs[index] = value
        return function(*inputs, **kwargs)

    return run, tuple(kept)


def _to_host(value: torch.Tensor, host: str) -> torch.Tensor:
    """A copy of ``value`` in ``host`` memory: pinned, copied without waiting, from a CUDA device (the copy back is
    ordered after it on the same stream); else a plain copy."""
    if host == "cpu" and value.device.type == "cuda" and not isinstance(value, FakeTensor):
        return torch.empty_like(value, device="cpu", pin_memory=True).copy_(value, non_blocking=True)
    return value.to(host, copy=True)


class _Part:
    """A block's feed-forward module as :func:`apply_checkpointing` sees it: checkpointed on its own while its
    block's unit is in one of the :data:`PARTS` modes, in the mode that one gives; timed with the block."""

    def __init__(self, unit: CheckpointUnit) -> None:
        self.unit = unit

    @property
    def mode(self) -> str:
        return PARTS.get(self.unit.mode, "none")

    @property
    def wrapped(self) -> bool:
        return self.unit.mode in PARTS

    @property
    def timer(self) -> RecomputeTimer | None:
        return self.unit.timer


def inside(unit: CheckpointUnit, units: list[CheckpointUnit]) -> list[CheckpointUnit]:
    """The other ``units`` whose block lies inside ``unit``'s (a diffusers attention inside its down block)."""
    return [u for u in units if u is not unit and any(m is u.module for m in unit.module.modules())]


def checkpoint_parts(units: list[CheckpointUnit]) -> HandleGroup:
    """Give each unit its feed-forward modules (:attr:`CheckpointUnit.parts`, the outermost ones in its block and in
    no other unit's block inside it), each wrapped to be checkpointed on its own in the unit's :data:`PARTS` modes; a
    handle that unwraps them.

    Examples:
        >>> class MLP(nn.Sequential): pass
        >>> block = nn.Sequential(nn.LayerNorm(4), MLP(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4)))
        >>> unit = CheckpointUnit("block", block, native=False)
        >>> handles = HandleGroup([apply_checkpointing([block], units=[unit]), checkpoint_parts([unit])])
        >>> unit.mode = "feed_forward"; [type(m).__name__ for m in unit.parts], unit.wrapped
        (['MLP'], False)
        >>> block(torch.ones(2, 4, requires_grad=True)).sum().backward()
        >>> handles.remove()
    """
    group = HandleGroup()
    for unit in units:
        unit.parts = find_feed_forward(unit.module, [u.module for u in inside(unit, units)])
        part = _Part(unit)
        for module in unit.parts:
            group.add(AttributeOverride.wrap(module, "forward", _wrapper(part, module)))
    return group


class RecomputeTimer:
    """Adds up the wall time checkpointed blocks spend running forward again in the backward pass.

    Blocks checkpointed by a library's switch call the checkpoint function the switch stored on a module
    (``_gradient_checkpointing_func`` in diffusers and transformers): while the timer lasts, that function is wrapped
    on ``modules`` so that the recomputation is timed. Blocks wrapped by :func:`apply_checkpointing` report to the
    timer set on their ``units``. :meth:`remove` puts everything back.

    Args:
        modules: Modules that hold a library's ``_gradient_checkpointing_func``.
        units: Units of blocks wrapped by :func:`apply_checkpointing`.
        synchronize: Called before reading the clock (``torch.cuda.synchronize`` on a GPU).

    Examples:
        >>> from torch import nn
        >>> block = nn.Sequential(nn.Linear(4, 4), nn.GELU())
        >>> unit = CheckpointUnit("block", block, native=False)
        >>> handle = apply_checkpointing([block], units=[unit])
        >>> timer = RecomputeTimer(units=[unit])
        >>> block(torch.ones(2, 4, requires_grad=True)).sum().backward()
        >>> timer.seconds > 0, timer.calls
        (True, 1)
        >>> timer.remove(); handle.remove()
    """

    def __init__(
        self,
        modules: Iterable[nn.Module] = (),
        units: Iterable[CheckpointUnit] = (),
        synchronize: Callable[[], None] = lambda: None,
    ) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.synchronize = synchronize
        self._units = list(units)
        for unit in self._units:
            unit.timer = self
        self._wrapped = HandleGroup()
        for module in modules:
            if callable(module.__dict__.get(CHECKPOINT_FUNCTION)):
                timed = functools.partial(functools.partial, _timed_checkpoint, self)
                self._wrapped.add(AttributeOverride.wrap(module, CHECKPOINT_FUNCTION, timed))

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        """Adds the time of what runs inside as one call, also when it stops early by an exception (a recomputation
        does once the backward pass has what it needs)."""
        self.synchronize()
        started = time.perf_counter()
        try:
            yield
        finally:
            self.synchronize()
            self.seconds += time.perf_counter() - started
            self.calls += 1

    def remove(self) -> None:
        self._wrapped.remove()
        for unit in self._units:
            unit.timer = None
        self._units = []


#: Where diffusers' and transformers' checkpointing switches store the checkpoint function on a module.
CHECKPOINT_FUNCTION = "_gradient_checkpointing_func"


#: Instance attributes of a module that are its structure, not state a forward pass keeps.
_STRUCTURE = frozenset({"training", "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})
_MISSING = object()


class _Block:
    """What :class:`_Recompute` needs to know about a block, found once instead of at every call: its modules (and
    which are normalisation layers), and, from its first checkpointed run on, which buffers and instance attributes a
    run changes. A later run copies only those buffers and looks only at those attributes; a buffer it finds changed
    that the first run left alone (its version counter tells) is added for the runs after it. Tensors are looked up by
    name at each call: a dry run swaps them for fake ones. :func:`forget` drops what was found (checkpointing is
    applied afresh in each stage, after the user may have changed the model)."""

    def __init__(self, module: nn.Module) -> None:
        self.modules = list(module.modules())
        # normalisation layers update their statistics inside the kernel, without bumping the version counter
        self.norms = [m for m in self.modules if isinstance(m, NormBase)]
        self.stateful: set[tuple[int, str]] | None = None  # (module index, buffer name) a run changed
        self.attributes: list[tuple[int, str]] | None = None  # (module index, attribute name) a run set

    def buffers(self) -> list[tuple[tuple[int, str], torch.Tensor]]:
        return [((i, k), b) for i, m in enumerate(self.modules) for k, b in m._buffers.items() if b is not None]

    def statistics(self) -> list[torch.Tensor]:
        return [b for m in self.norms for b in m._buffers.values() if b is not None]

    def attributes_now(self) -> dict[tuple[int, str], tuple[dict[str, Any], Any]]:
        """Every instance attribute on the first run; later, those the first run set."""
        if self.attributes is not None:
            return {
                (i, k): (self.modules[i].__dict__, self.modules[i].__dict__.get(k, _MISSING))
                for i, k in self.attributes
            }
        return {
            (i, k): (m.__dict__, v)
            for i, m in enumerate(self.modules)
            for k, v in m.__dict__.items()
            if k not in _STRUCTURE and "hook" not in k
        }


_BLOCKS: weakref.WeakKeyDictionary[nn.Module, _Block] = weakref.WeakKeyDictionary()


def _known(module: nn.Module) -> _Block:
    block = _BLOCKS.get(module)
    if block is None:
        block = _BLOCKS[module] = _Block(module)
    return block


def forget(modules: Iterable[nn.Module]) -> None:
    """Drop what :class:`_Recompute` found about these blocks and the blocks inside them."""
    for module in modules:
        for inner in module.modules():
            _BLOCKS.pop(inner, None)


class _Recompute:
    """A checkpointed function, whose run again in the backward pass sees and leaves the block as a plain run would.

    The first run notes what it changed in the block: buffers changed in place (BatchNorm's running statistics,
    spectral norm's vectors), instance attributes set (a cache of the last frames that a causal convolution keeps for
    its next call) and dicts or lists among its arguments filled (a cache passed from block to block). The run in the
    backward pass starts from the buffers, attributes and containers as the first run found them (spectral norm's
    power iteration starts from its vectors as they were, so it computes the same weight) and puts back, when it ends,
    the buffers, attributes and containers as they are now, so checkpointing changes the state once, as a run without
    it does; it is timed when a timer is set. A recomputation that stops early (by an exception, once the backward pass
    has what it needs) puts them back too.

    To start from them, the first run keeps a copy of the buffers it changed as they were before it. Which buffers and
    attributes a block's runs change is found on its first run (:class:`_Block`): that run copies every buffer and
    looks at every attribute, later ones only at those. Normalisation statistics are not copied: a training run's
    output does not depend on them."""

    def __init__(
        self, function: Callable[..., Any], module: nn.Module | None, timer: Callable[[], Any], policy: bool = False
    ) -> None:
        self.function = function
        self.block = module
        self.policy = policy  # its ops pass through a selective policy (for the time model, see ``policed``)
        self.known = _known(module) if module is not None else None
        self.timer = timer
        self.changed: list[torch.Tensor] = []
        self.started: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, its value before the first run)
        self.found: list[tuple[dict[str, Any], str, Any]] = []  # (a module's __dict__, name, value before the run)
        self.filled = ContainerSnapshot([])  # the dicts and lists among the arguments that the run filled

    def _first(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        known = self.known
        buffers = known.buffers() if known is not None else []
        statistics = known.statistics() if known is not None else []
        versions = [(key, b, tensor_version(b)) for key, b in buffers]
        ids = {id(b) for b in statistics}
        copied = known is None or known.stateful is None
        with torch.no_grad():
            values = {key: b.clone() for key, b in buffers if id(b) not in ids and (copied or key in known.stateful)}
        before = known.attributes_now() if known is not None else {}
        containers = ContainerSnapshot(find_containers((args, kwargs)))
        with policed(self.block) if self.policy else contextlib.nullcontext():
            output = self.function(*args, **kwargs)
        self.filled = containers.changed()
        changed = [(key, b) for key, b, version in versions if tensor_version(b) != version]
        self.started = [(b, values[key]) for key, b in changed if key in values]
        del values
        self.changed = list({id(b): b for b in [*statistics, *(b for _, b in changed)]}.values())
        after = known.attributes_now() if known is not None else {}
        set_now = [key for key, (_, value) in after.items() if key not in before or before[key][1] is not value]
        self.found = [(after[key][0], key[1], before[key][1] if key in before else _MISSING) for key in set_now]
        if known is not None:
            stateful = {key for key, b in changed if id(b) not in ids}
            known.stateful = stateful if known.stateful is None else known.stateful | stateful
            if known.attributes is None:
                known.attributes = set_now
        return output

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not in_backward():
            return self._first(args, kwargs)
        with torch.no_grad():
            saved = [(b, b.clone()) for b in self.changed]
        now = [(store, name, store.get(name, _MISSING)) for store, name, _ in self.found]
        filled_now = ContainerSnapshot(self.filled.containers)
        for store, name, value in self.found:  # the state the first run started from
            _put(store, name, value)
        with torch.no_grad():
            for buffer, value in self.started:
                buffer.copy_(value)
        self.filled.remove()
        timer = self.timer()
        try:
            with (
                timer.timing() if timer is not None else contextlib.nullcontext(),
                recomputing(self.block),
                policed(self.block) if self.policy else contextlib.nullcontext(),
            ):
                return self.function(*args, **kwargs)
        finally:
            with torch.no_grad():
                for buffer, value in saved:
                    buffer.copy_(value)
            for store, name, value in now:
                _put(store, name, value)
            filled_now.remove()


def _put(store: dict[str, Any], name: str, value: Any) -> None:
    if value is _MISSING:
        store.pop(name, None)
    else:
        store[name] = value


def _checkpoint(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mode: str,
    offload: HostInputs | None = None,
) -> Any:
    """Non-reentrant checkpoint of ``function(*args, **kwargs)``, the one a library's switch calls through
    :class:`MemOptCheckpoint`: keyword arguments pass through, buffers the block changes in place are changed once
    (see :class:`_Recompute`); ``mode`` (``"selective"``, ``"attention"``, ``"full"`` or ``"offload"``, its inputs
    kept where ``offload`` says) says what is kept."""
    module = getattr(function, "module", function)
    if isinstance(module, functools.partial) and module.args and isinstance(module.args[0], nn.Module):
        module = module.args[0]  # transformers checkpoints partial(forward, layer, **kwargs)
    runner = _Recompute(function, module if isinstance(module, nn.Module) else None, lambda: None, mode in POLICIES)
    return _run(runner, args, kwargs, mode, offload)


def _run(runner: Any, args: tuple[Any, ...], kwargs: dict[str, Any], mode: str, offload: HostInputs | None) -> Any:
    context = contexts(mode) or noop_context_fn
    if mode == "offload" and offload is not None:
        runner, args = ferried(runner, args, offload)
    return checkpoint(runner, *args, use_reentrant=False, context_fn=context, **kwargs)


class MemOptCheckpoint:
    """MemOpt's non-reentrant checkpoint as the function a library's switch stores on the model's modules; its
    ``mode``, ``"selective"`` or ``"attention"``, has the block keep some ops' outputs and recompute the rest
    (:mod:`~lightning_memopt.techniques.checkpointing.selective`), ``"full"`` only its inputs. Each switchable block
    gets its own, so that each has its mode.

    A deep copy of the model (an EMA copy taken during fit) is not MemOpt's: it gets the modules' attributes as the
    user gave them (:class:`~lightning_memopt.handles.AsGiven`), flags and function included. Should a copy
    reach this object another way, its copy is :func:`run_plain`, so the copy's blocks run as they would without
    MemOpt. Both pickle, unlike a library's local function.
    """

    def __init__(self) -> None:
        self.mode = "full"
        self.offload: HostInputs | None = None  # its unit's, for the "offload" mode

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return _checkpoint(function, args, kwargs, self.mode, self.offload)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., Any]:
        return run_plain


def run_plain(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A checkpoint function that does not checkpoint: the block runs as it would without one."""
    return function(*args, **kwargs)


class _Timed:
    """``function``, its runs in the backward pass timed; ``module`` is the block it runs, for the buffers."""

    def __init__(self, timer: RecomputeTimer, function: Callable[..., Any]) -> None:
        self.timer = timer
        self.function = function
        self.module = getattr(function, "module", function)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not in_backward():
            return self.function(*args, **kwargs)
        with self.timer.timing():
            return self.function(*args, **kwargs)


def _timed_checkpoint(timer: RecomputeTimer, checkpoint_fn: Callable[..., Any], function: Any, *args: Any, **kw: Any):
    return checkpoint_fn(_Timed(timer, function), *args, **kw)


def _checkpointed(
    original: Callable[..., Any], unit: CheckpointUnit | _Part | None, block: nn.Module, *args: Any, **kwargs: Any
) -> Any:
    if not torch.is_grad_enabled() or (unit is not None and not unit.wrapped):
        return original(*args, **kwargs)
    mode = unit.mode if unit is not None else "full"
    runner = _Recompute(
        functools.partial(original, **kwargs), block, lambda: unit.timer if unit else None, mode in POLICIES
    )
    return _run(runner, args, {}, mode, getattr(unit, "offload", None))


def _wrapper(unit: CheckpointUnit | _Part | None, block: nn.Module) -> Callable[[Callable[..., Any]], Any]:
    return lambda inner: functools.partial(_checkpointed, inner, unit, block)


def apply_checkpointing(
    blocks: Iterable[nn.Module], config: CheckpointConfig | None = None, units: list[CheckpointUnit] | None = None
) -> HandleGroup:
    """Checkpoint each block: its activations are recomputed in the backward pass instead of being kept.

    Only forward passes that record gradients are checkpointed; under ``torch.no_grad`` the block runs as before.

    Args:
        blocks: The modules whose ``forward`` is wrapped.
        config: A :class:`CheckpointConfig`; the default is non-reentrant checkpointing.
        units: One :class:`CheckpointUnit` per block, to switch blocks off and on later.

    Returns:
        A handle whose ``remove()`` restores every block's original ``forward``.

    Examples:
        >>> from torch import nn
        >>> blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(2))
        >>> handle = apply_checkpointing(blocks)
        >>> len(handle)
        2
        >>> handle.remove(); "forward" in blocks[0].__dict__
        False
    """
    config = config or CheckpointConfig()
    blocks = list(blocks)
    group = HandleGroup()
    for block, unit in zip(blocks, units or [None] * len(blocks), strict=True):
        group.add(AttributeOverride.wrap(block, "forward", _wrapper(unit, block)))
    return group
