"""Peak-memory probes, one per device kind, and out-of-memory detection.

On CUDA, XPU and MPS the allocator's own counters are used. On CPU the bytes of live tensor storages are counted
exactly, so a CPU figure is the same on every run and can be tested to the byte.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

from lightning_memopt.compat import (
    FakeTensor,
    HigherOrderOperator,
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
    dense_kernel,
    flex_attention_eager,
    is_traceable_wrapper_subclass,
    leave_mode,
    local_tensors,
    tree_flatten,
)


def _mse_loss_buffer(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    reduction = kwargs.get("reduction", args[2] if len(args) > 2 else 1)
    return args[0].numel() * args[0].element_size() if reduction != 0 else 0


#: What a byte alive in a step is: the model's parameters and buffers, the parameters' gradients (DDP's buckets
#: too), the optimizers' state, what the step allocates in its forward and backward passes (activations, the
#: gradients flowing between layers, temporaries), the batch, and the rest (the optimizer step's temporaries,
#: anything else alive before the step).
KINDS = ("weights", "gradients", "optimizer", "activations", "batch", "other")


#: Ops whose CPU kernel returns a result that keeps a larger buffer alive: the bytes that buffer holds. A dry run on
#: fake tensors allocates only the result, so these are counted for fake CPU tensors too, to give the real figure.
CPU_KERNEL_BUFFERS: dict[Any, Any] = {torch.ops.aten.mse_loss.default: _mse_loss_buffer}


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"a kind of bytes must be one of {', '.join(KINDS)}, got {kind!r}")


class CPUPeakTracker(TorchDispatchMode):
    """Count, byte for byte, the storages that tensors allocate while the tracker is active, and their peak.

    Every tensor an operator returns is looked at; a storage is counted once, from the op that first returns it until
    it is freed. Storages that already existed can be added with :meth:`add` (for example the parameters, gradients
    and optimizer state), so that :attr:`peak` means what ``torch.cuda.max_memory_allocated`` means on a GPU:
    everything live. The figure is deterministic: the same code gives the same bytes on every run.

    Fake tensors (a dry run, see :mod:`lightning_memopt.dryrun`) are counted like real CPU tensors, on the device they
    pretend to be, so a step run on fake tensors gives the same figure as the real step on CPU. :attr:`current` and
    :attr:`peak` are the bytes on ``device``; storages on another device (the host, in a dry run of an accelerator's
    step) are counted apart, in :attr:`elsewhere` and :attr:`elsewhere_peak`. While :attr:`paused` is set, nothing new
    is counted.

    Every storage has a kind (:data:`KINDS`): the one given to :meth:`add`, else :attr:`kind` when it was allocated,
    until :meth:`rekind` says what it became (a gradient accumulated into a parameter's ``.grad``, the state an
    optimizer step created). :attr:`by_kind` is the bytes alive now by kind and :attr:`at_peak` those alive at the
    peak, which sum to :attr:`current` and :attr:`peak`; a storage alive at the peak is counted there under the kind
    it has now.

    :meth:`record` starts an event log (:attr:`events`): each storage on ``device`` as it is allocated and freed, in
    order, with its bytes, which :func:`lightning_memopt.allocator.replay` turns into the CUDA caching allocator's
    figures. Off by default; off, it costs one attribute test per storage.

    Args:
        outer: Another tracker whose storages this one does not count again (views of tensors it already counts),
            to measure a stretch of code on its own.
        device: The device type whose bytes :attr:`peak` counts.

    Examples:
        >>> import torch
        >>> with CPUPeakTracker() as tracker:
        ...     a = torch.empty(1000)   # 4000 bytes
        ...     b = torch.empty(500)    # 2000 bytes
        ...     del a
        ...     c = torch.empty(200)    # 800 bytes
        >>> tracker.peak, tracker.current
        (6000, 2800)
        >>> tracker.at_peak["activations"], tracker.by_kind["activations"]
        (6000, 2800)
    """

    #: Higher-order operators (flex_attention) reach this mode: one with a plain implementation runs it op by op under
    #: the tracker, so what it allocates inside is counted; others run whole and only their outputs are counted.
    supports_higher_order_operators = True

    def __init__(self, outer: CPUPeakTracker | None = None, device: str = "cpu") -> None:
        super().__init__()
        self.device = device
        self.current = 0
        self.peak = 0
        self.high = 0  # the most bytes alive since a reader last set it to ``current`` (a timeline, after each op)
        self.kind = "activations"  # the kind of the storages allocated from now on
        self.by_kind = dict.fromkeys(KINDS, 0)
        self.at_peak = dict(self.by_kind)
        self.elsewhere: dict[str, int] = {}  # bytes alive on other devices now, by device type
        self.elsewhere_peak: dict[str, int] = {}
        self.paused = False
        self.on_peak: Any = None  # called with the new figure whenever the peak grows
        self.on_op: Any = None  # called with (func, args, kwargs, out) after each op is counted
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> [bytes, kind, device type, order]
        self._outer = outer
        self._order = 0  # storages counted so far
        self._peak_order = 0  # how many had been counted when the peak was reached
        self.highest = 0  # the peak over every restart (restart_peak), and what held it
        self.at_highest = dict(self.at_peak)
        self._highest_order = 0
        self.events: list[tuple[str, int, int]] | None = None  # the event log, once record() started it

    def record(self) -> list[tuple[str, int, int]]:
        """Start the event log and return it: ``("+", key, nbytes)`` for each storage on ``device`` allocated from now
        on and ``("-", key, nbytes)`` when it is freed, ``key`` numbering the storages. It starts with the storages
        alive now, as allocations in the order they were counted. No figure of the tracker changes.

        Examples:
            >>> with CPUPeakTracker() as tracker:
            ...     a = torch.empty(10)
            ...     events = tracker.record()
            ...     b = torch.empty(20)
            ...     del a
            >>> events
            [('+', 1, 40), ('+', 2, 80), ('-', 1, 40)]
        """
        alive = sorted((cell for cell in list(self._seen.values()) if cell[2] == self.device), key=lambda c: c[3])
        self.events = [("+", cell[3], cell[0]) for cell in alive]
        return self.events

    def add(self, tensors: Iterable[torch.Tensor], kind: str = "other") -> None:
        """Count storages that are already alive, such as ``model.parameters()``, as ``kind``."""
        _check_kind(kind)
        for tensor in tensors:
            self._track(tensor, kind=kind)

    def rekind(self, tensors: Iterable[torch.Tensor], kind: str) -> None:
        """Say what counted storages are now (a gradient accumulated into ``.grad``), at the peak too if they were
        alive then. Storages not counted are left alone."""
        _check_kind(kind)
        for tensor in tensors:
            for inner in local_tensors(tensor):
                cell = self._seen.get(inner.untyped_storage())
                if cell is None or cell[1] == kind or cell[2] != self.device:
                    continue
                nbytes, was = cell[0], cell[1]
                self.by_kind[was] -= nbytes
                self.by_kind[kind] += nbytes
                for held, order in ((self.at_peak, self._peak_order), (self.at_highest, self._highest_order)):
                    if cell[3] <= order:  # created before that peak and alive now: alive at it
                        held[was] -= nbytes
                        held[kind] += nbytes
                cell[1] = kind

    def gradients_of(self, params: Iterable[torch.Tensor]) -> list[Any]:
        """Each gradient accumulated into the ``.grad`` of one of ``params`` counts as ``gradients`` from then on.
        Returns the hooks' handles, to remove."""
        # a hook before this one may have stepped the parameter and freed its gradient (the optimizer in the backward)
        hook = lambda param: self.rekind([param.grad] if param.grad is not None else [], "gradients")  # noqa: E731
        return [param.register_post_accumulate_grad_hook(hook) for param in params if param.requires_grad]

    @contextmanager
    def allocating(self, kind: str) -> Iterator[None]:
        """What is allocated inside is counted as ``kind`` (the optimizer step's temporaries as ``other``)."""
        _check_kind(kind)
        was, self.kind = self.kind, kind
        try:
            yield
        finally:
            self.kind = was

    def restart_peak(self) -> None:
        """The peak starts again from what is alive now (:attr:`highest` keeps the highest of every stretch)."""
        self.fold()
        self.peak, self.at_peak, self._peak_order = self.current, dict(self.by_kind), self._order

    def fold(self) -> None:
        """Bring :attr:`highest` and :attr:`at_highest` up to date with the stretch since the last restart."""
        if self.peak >= self.highest:
            self.highest, self.at_highest, self._highest_order = self.peak, dict(self.at_peak), self._peak_order

    def _free(self, cell: list[Any]) -> None:
        nbytes, kind, device, order = cell
        if device == self.device:
            self.current -= nbytes
            self.by_kind[kind] -= nbytes
            if self.events is not None:
                self.events.append(("-", order, nbytes))
        else:
            self.elsewhere[device] -= nbytes

    def _track(self, tensor: torch.Tensor, nbytes: int = 0, kind: str | None = None) -> None:
        if is_traceable_wrapper_subclass(tensor):  # a DTensor: what this process holds is its local shard
            for inner in local_tensors(tensor):
                self._track(inner, nbytes, kind)
            return
        if not isinstance(tensor, FakeTensor) and (tensor.device.type != "cpu" or tensor.is_meta):
            return
        storage = tensor.untyped_storage()
        if storage in self._seen or (self._outer is not None and storage in self._outer._seen):
            return
        nbytes = max(nbytes, storage.nbytes())
        device = tensor.device.type
        self._order += 1
        cell = [nbytes, kind or self.kind, device, self._order]
        self._seen[storage] = cell
        weakref.finalize(storage, self._free, cell)
        if device != self.device:
            self.elsewhere[device] = now = self.elsewhere.get(device, 0) + nbytes
            self.elsewhere_peak[device] = max(self.elsewhere_peak.get(device, 0), now)
            return
        self.current += nbytes
        self.by_kind[cell[1]] += nbytes
        if self.events is not None:
            self.events.append(("+", self._order, nbytes))
        if self.current > self.high:
            self.high = self.current
        if self.current > self.peak:
            self.peak, self.at_peak, self._peak_order = self.current, dict(self.by_kind), self._order
            if self.on_peak is not None:
                self.on_peak(self.peak)

    def __exit__(self, *args: Any) -> None:
        """Leave, also when another mode entered later is still active (two probes whose spans overlap, such as
        MemOpt's and PeakMemory's): the modes above this one are set aside and put back."""
        if any(mode is self for mode in _get_current_dispatch_mode_stack()):
            self._eager.__exit__(None, None, None)
            leave_mode(self, lambda: super(CPUPeakTracker, self).__exit__(*args))

    def __enter__(self) -> CPUPeakTracker:
        self._eager = flex_attention_eager()
        self._eager.__enter__()
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        dense = dense_kernel(func) if isinstance(func, HigherOrderOperator) else None
        if dense is not None:  # run its aten ops under this tracker, so that what it allocates inside is counted
            _push_mode(self)
            try:
                out = dense(*args, **kwargs)
            finally:
                _pop_mode()
        else:
            out = func(*args, **kwargs)
        if self.paused:
            return out
        outputs = (
            [out] if isinstance(out, torch.Tensor) else [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        )
        buffer = CPU_KERNEL_BUFFERS.get(func)
        if buffer is not None and len(outputs) == 1 and outputs[0].device.type == "cpu":
            self._track(outputs[0], buffer(args, kwargs))
        for tensor in outputs:
            self._track(tensor)
        if self.on_op is not None:
            self.on_op(func, args, kwargs, out)
        return out


#: What :meth:`PeakProbe.start` takes as alive before the step: the tensors, or the tensors of each kind (see KINDS).
Live = Iterable[torch.Tensor] | Mapping[str, Iterable[torch.Tensor]]


class PeakProbe(Protocol):
    """Measures the peak bytes and the wall time between :meth:`start` and :meth:`stop`."""

    def start(self, live: Live) -> None: ...

    def so_far(self) -> int: ...

    def stop(self) -> tuple[int, float]: ...


@contextmanager
def trackers_paused() -> Iterator[None]:
    """Every :class:`CPUPeakTracker` active now counts nothing new inside: a dry run's fake storages are not memory
    of the code around it (PeakMemory's probe of a batch, when MemOpt dry-runs the step again after it ran)."""
    active = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, CPUPeakTracker) and not m.paused]
    for tracker in active:
        tracker.paused = True
    try:
        yield
    finally:
        for tracker in active:
            tracker.paused = False


class CPUProbe:
    """Exact CPU peak: the tensors in ``live`` plus everything allocated until :meth:`stop`.

    ``live`` should hold what is already on the device and stays alive through the step: parameters, buffers,
    gradients, optimizer state and the batch, by kind (a mapping such as ``{"weights": model.parameters()}``; tensors
    given as one list count as ``other``). With those, the peak means what ``max_memory_allocated`` means on a GPU,
    and after :meth:`stop` :attr:`at_peak` says what held it, by kind.

    Examples:
        >>> import torch
        >>> probe = CPUProbe()
        >>> weights = torch.zeros(100)  # 400 bytes, alive before the step
        >>> probe.start({"weights": [weights]})
        >>> activations = torch.zeros(50)  # 200 bytes
        >>> del activations
        >>> peak, seconds = probe.stop()
        >>> peak, probe.at_peak["weights"], probe.at_peak["activations"]
        (600, 400, 200)
    """

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.at_peak: dict[str, int] = {}  # the peak's bytes by kind, after stop()
        self.elsewhere_peak: dict[str, int] = {}  # the peak bytes on each other device, after stop()
        self._tracker: CPUPeakTracker | None = None
        self._started = 0.0

    def start(self, live: Live) -> None:
        self._tracker = CPUPeakTracker(device=self.device)
        for kind, tensors in live.items() if isinstance(live, Mapping) else [("other", live)]:
            self._tracker.add(tensors, kind)
        self._tracker.__enter__()
        self.at_peak = {}
        self._started = time.perf_counter()

    @property
    def tracker(self) -> CPUPeakTracker:
        if self._tracker is None:
            raise RuntimeError("CPUProbe.tracker was read before start()")
        return self._tracker

    def so_far(self) -> int:
        """The peak since :meth:`start`, while the probe runs."""
        return max(self.tracker.highest, self.tracker.peak)

    def segment(self) -> int:
        """The peak since the last segment (or the start); the next segment starts from what is live now. The
        planner splits a dry run at every block this way."""
        if self._tracker is None:
            raise RuntimeError("CPUProbe.segment() was called before start()")
        peak = self._tracker.peak
        self._tracker.restart_peak()
        return peak

    def stop(self) -> tuple[int, float]:
        seconds = time.perf_counter() - self._started
        tracker, self._tracker = self._tracker, None
        if tracker is None:
            raise RuntimeError("CPUProbe.stop() was called before start()")
        tracker.__exit__(None, None, None)
        tracker.fold()
        self.at_peak, self.elsewhere_peak = dict(tracker.at_highest), dict(tracker.elsewhere_peak)
        return tracker.highest, seconds


class AcceleratorProbe:
    """The allocator's peak on a CUDA, XPU or MPS device, through ``torch.accelerator``. Everything allocated on the
    device counts, so ``live`` is not needed."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._memory: Any = torch.accelerator
        self._started = 0.0

    def start(self, live: Live = ()) -> None:
        self._memory.synchronize(self.device)
        self._memory.reset_peak_memory_stats(self.device)
        self._started = time.perf_counter()

    def so_far(self) -> int:
        """The allocator's peak since :meth:`start`, while the probe runs."""
        self._memory.synchronize(self.device)
        return int(self._memory.max_memory_allocated(self.device))

    def stop(self) -> tuple[int, float]:
        self._memory.synchronize(self.device)
        return int(self._memory.max_memory_allocated(self.device)), time.perf_counter() - self._started


def probe_for(device: torch.device) -> PeakProbe:
    """The probe for ``device``: exact accounting on CPU, the allocator's counters elsewhere.

    Examples:
        >>> type(probe_for(torch.device("cpu"))).__name__
        'CPUProbe'
    """
    return CPUProbe() if device.type == "cpu" else AcceleratorProbe(device)


_OOM_MESSAGES = (
    " out of memory",  # CUDA, HIP, XPU
    "MPS backend out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",  # what cuDNN raises when it cannot get its workspace
    "DefaultCPUAllocator: can't allocate memory",
    "PT_DEVMEM Allocation failed",  # HPU
)


def is_oom(exception: BaseException) -> bool:
    """Whether ``exception`` means the device ran out of memory (CUDA, cuDNN, MPS, XPU, HPU or the CPU allocator).

    Examples:
        >>> is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
        True
        >>> is_oom(ValueError("bad shape"))
        False
    """
    if isinstance(exception, torch.OutOfMemoryError):
        return True
    return isinstance(exception, RuntimeError) and any(m in str(exception) for m in _OOM_MESSAGES)


def free_memory(device: torch.device) -> None:
    """Collect garbage and return the allocator's cached blocks after an out-of-memory error."""
    gc.collect()
    if device.type != "cpu":
        torch.accelerator.empty_cache()
