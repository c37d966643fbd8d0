"""Values a step reads out of tensors, for dry runs: recorded from a real step, replayed in a dry run, and placeholders
where nothing was recorded.

Fake tensors have no data. When a step reads one (``.item()``, ``int()``, ``float()``, ``bool()``, ``.tolist()``,
``.numpy()``) or runs an op whose output shape depends on the data (``nonzero``, a boolean mask, ``unique``,
``bincount``), a dry run asks :class:`Replay` for the value. It answers with what a real step of the same shapes read
at the same point, in order (:class:`Recorder` records it; reads in a checkpointed block's recomputation do not
count), and otherwise with a placeholder: zero of the right dtype, an array of zeros of the right shape, and a
data-dependent shape at its upper bound (every element of a mask set). Each read is keyed by the op and the shapes it
read, so a step whose blocks run chunked still finds the reads of its other parts.

Examples:
    >>> import torch
    >>> with Recorder() as recorder:
    ...     seed = int(torch.tensor(7))
    ...     picked = torch.arange(6)[torch.tensor([True, False] * 3)]
    >>> replay = Replay(recorder.recorded)
    >>> replay.scalar(torch.ops.aten._local_scalar_dense.default, torch.tensor(0)), replay.replayed
    (7, 1)
    >>> fresh = Replay()
    >>> fresh.scalar(torch.ops.aten._local_scalar_dense.default, torch.tensor(0.5)), dict(fresh.placeholders)
    (0.0, {'aten._local_scalar_dense.default': 1})
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_memopt.compat import (
    FakeTensor,
    TorchDispatchMode,
    _disable_current_modes,
    _pop_mode,
    _push_mode,
    in_backward,
    leave_mode,
    map_tensors,
    tree_flatten,
)

Key = tuple[str, tuple[Any, ...]]
SCALAR = torch.ops.aten._local_scalar_dense.default
#: Ops made of others, one of which reads the data (``nonzero(as_tuple=True)``, ``torch.where(mask)``,
#: ``bool(tensor)``): a dispatch mode sees them whole under inference mode, and their parts otherwise.
COMPOSITE_READERS = {torch.ops.aten.nonzero_numpy.default, torch.ops.aten.argwhere.default}
if hasattr(torch.ops.aten, "is_nonzero"):
    COMPOSITE_READERS.add(torch.ops.aten.is_nonzero.default)
NUMPY = "Tensor.numpy"
#: The largest array whose values are recorded by ``.numpy()``; larger ones (decoded images) replay as zeros of the
#: recorded shape: their values do not change what a step allocates.
ARRAY_VALUES = 4096
#: Ops whose output shape depends on the data, run for real on a placeholder input to find their upper bound: only
#: where the input is this small (in elements).
SMALL = 1 << 22


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    return None


def key(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Key:
    """What a read is known by: the op and the shapes and dtypes of the tensors it reads (``.item()`` reaches a
    dispatch mode as ``aten.item`` under inference mode, else as the op it is made of)."""
    name = str(SCALAR if func is torch.ops.aten.item.default else func)
    return name, tuple(_signature(v) for v in (*args, *kwargs.values()))


def dynamic(func: Any) -> bool:
    """Whether ``func``'s output shape (or value, for ``.item()`` and the like) depends on the data."""
    tags = getattr(func, "tags", ())
    return torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags


def _shapes(out: Any) -> Any:
    """What is kept of a data-dependent op's result: the shape and dtype of each tensor, and other values as they
    are."""
    if isinstance(out, torch.Tensor):
        return ("tensor", tuple(out.shape), out.dtype)
    if isinstance(out, (list, tuple)):
        return type(out)(_shapes(v) for v in out)
    return out


class Recorder:
    """Records, in order, what a real step reads out of its tensors: the values of scalar reads, the shapes of the
    results of ops whose shape depends on the data, and arrays from ``.numpy()`` (their values when small). Reads in a
    backward pass (checkpointed blocks computing their forward again) are not recorded."""

    def __init__(self) -> None:
        self.recorded: dict[Key, list[Any]] = collections.defaultdict(list)
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Recorder:
        numpy, tolist = torch.Tensor.numpy, torch.Tensor.tolist  # neither runs an op on a real tensor

        def recorded_numpy(tensor: torch.Tensor, *, force: bool = False) -> Any:  # ``np.asarray`` calls it too
            out = numpy(tensor, force=force)
            self.add(key(NUMPY, (tensor,), {}), out.copy() if out.size <= ARRAY_VALUES else out.shape)
            return out

        def recorded_tolist(tensor: torch.Tensor) -> Any:  # on a fake tensor: one ``.item()`` per element, in order
            out = tolist(tensor)
            scalar = (str(SCALAR), (((), str(tensor.dtype)),))  # the key of ``.item()`` on one element
            for value in tree_flatten(out)[0]:
                self.add(scalar, value)
            return out

        self._stack.enter_context(class_attribute(torch.Tensor, "numpy", recorded_numpy))
        self._stack.enter_context(class_attribute(torch.Tensor, "tolist", recorded_tolist))
        self._stack.enter_context(_RecordOps(self))
        return self

    def __exit__(self, *args: Any) -> None:
        self._stack.close()

    def add(self, read: Key, value: Any) -> None:
        if not in_backward():
            self.recorded[read].append(value)


class _RecordOps(TorchDispatchMode):
    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __exit__(self, *args: Any) -> None:
        """Leave, also when a mode entered later is still active (PeakMemory's probe, started after MemOpt's
        recorder and stopped after it)."""
        leave_mode(self, lambda: super(_RecordOps, self).__exit__(*args))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in COMPOSITE_READERS:  # under inference mode they arrive whole: record the ops they are made of
            with _again(self):
                return func.decompose(*args, **kwargs)
        out = func(*args, **kwargs)
        if dynamic(func):
            self.recorder.add(key(func, args, kwargs), _shapes(out))
        return out


@contextlib.contextmanager
def _again(mode: TorchDispatchMode) -> Iterator[None]:
    """Inside ``mode``'s own dispatch: the ops run here reach it too."""
    _push_mode(mode)
    try:
        yield
    finally:
        _pop_mode()


@contextlib.contextmanager
def class_attribute(cls: type, name: str, value: Any) -> Iterator[None]:
    """Set an attribute on a class for a while (a method of torch's tensor classes), then put back what was there."""
    before = cls.__dict__.get(name, _MISSING)
    setattr(cls, name, value)
    try:
        yield
    finally:
        if before is _MISSING:
            delattr(cls, name)
        else:
            setattr(cls, name, before)


class Replay:
    """Answers a dry run's reads: what a real step recorded for the same read, in order, else a placeholder.

    Args:
        recorded: What a :class:`Recorder` recorded (it is not changed: each replay takes its own copy).

    Attributes:
        placeholders: How many placeholders were given, per op.
        replayed: How many reads were answered from the recording.
    """

    def __init__(self, recorded: dict[Key, list[Any]] | None = None) -> None:
        self._queues = {k: collections.deque(v) for k, v in (recorded or {}).items()}
        self.placeholders: dict[str, int] = collections.Counter()
        self.replayed = 0

    def _take(self, read: Key) -> Any:
        queue = self._queues.get(read)
        if queue:
            self.replayed += 1
            return queue.popleft()
        self.placeholders[read[0]] += 1
        return _MISSING

    def scalar(self, func: Any, tensor: torch.Tensor) -> Any:
        """``.item()`` and friends on a fake tensor: the value recorded, else zero of its dtype."""
        value = self._take(key(func, (tensor,), {}))
        if value is not _MISSING:
            return value
        return False if tensor.dtype == torch.bool else 0.0 if tensor.is_floating_point() else 0

    def array(self, tensor: torch.Tensor) -> Any:
        """``.numpy()`` of a fake tensor: the array recorded (zeros of its shape if only that was kept), else zeros."""
        import numpy

        value = self._take(key(NUMPY, (tensor,), {}))
        if value is _MISSING:
            with _disable_current_modes():
                value = numpy.zeros(tuple(tensor.shape), dtype=torch.empty(0, dtype=tensor.dtype).numpy().dtype)
        elif isinstance(value, tuple):  # only the shape of a large array was kept
            value = numpy.zeros(value, dtype=torch.empty(0, dtype=tensor.dtype).numpy().dtype)
        else:
            value = value.copy()
        return value

    def shaped(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], make: Callable[[Any], Any]) -> Any:
        """A data-dependent op on fake tensors: fakes of the recorded result's shapes (made by ``make`` from
        ``(shape, dtype)``), else its upper bound."""
        value = self._take(key(func, args, kwargs))
        if value is _MISSING:
            return upper_bound(func, args, kwargs, make)
        return _rebuild(value, make)

    def ops(self) -> str:
        """The ops that got placeholders, with how many each."""
        return ", ".join(f"`{op}` x{n}" for op, n in sorted(self.placeholders.items()))

    def note(self) -> str | None:
        """What the report says of the placeholders given, if any."""
        if not self.placeholders:
            return None
        return (
            f"{PLACEHOLDERS} ({self.ops()}): zeros, and data-dependent shapes at their upper bound; a real step's"
            " values replace them once one has run"
        )


_MISSING = object()
#: How the note on placeholders begins.
PLACEHOLDERS = "the dry run read values from tensors it has no data for and gave placeholders"


def _rebuild(value: Any, make: Callable[[Any], Any]) -> Any:
    if isinstance(value, tuple) and len(value) == 3 and value[0] == "tensor":
        return make(value[1:])
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuild(v, make) for v in value)
    return value


def _bool_indices(indices: list[Any], make: Callable[[Any], Any]) -> list[Any]:
    """Boolean masks among ``x[...]``'s indices as the long indices of a mask with every element set."""
    out: list[Any] = []
    for index in indices:
        if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8):
            out += [make(((index.numel(),), torch.long)) for _ in range(index.dim())]
        else:
            out.append(index)
    return out


def upper_bound(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], make: Callable[[Any], Any]) -> Any:
    """The result of a data-dependent op at its largest: indexing by a mask with every element set; other ops run for
    real on inputs of ones (a mask of ones selects everything; ``unique`` gets distinct values) when they are small.

    Raises:
        NotImplementedError: the inputs are too large to run the op on for real.
    """
    aten = torch.ops.aten
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return func(args[0], _bool_indices(list(args[1]), make), *args[2:], **kwargs)
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if sum(t.numel() for t in tensors) > SMALL:
        raise NotImplementedError(f"`{func}` has an output shape that depends on data too large to stand in for")
    distinct = "unique" in str(func)  # every value its own: the most a `unique` can return

    def ones(value: Any) -> Any:
        if not isinstance(value, FakeTensor):
            return value
        if distinct:
            return torch.arange(value.numel()).reshape(value.shape).to(value.dtype)
        return torch.ones(value.shape, dtype=value.dtype)

    with _disable_current_modes():
        real = func(*map_tensors(list(args), ones), **map_tensors(kwargs, ones))
    return _rebuild(_shapes(real), make)
