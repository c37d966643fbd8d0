"""Dry runs: run a step on fake tensors, so that its peak memory is known without running it.

Inside a :class:`Sandbox`, every parameter and buffer of a module is a fake copy (``FakeTensorMode``: shape, dtype,
device and no data), and so is anything passed through :meth:`Sandbox.fake`, such as the batch. Code run there
computes nothing on the model's tensors, allocates no real memory for them, advances no generator and writes into no
real tensor; when the sandbox closes, the parameters, buffers, module attributes and random states are as before.
Exact accounting (:class:`~lightning_memopt.memory.CPUPeakTracker`) counts fake storages as it counts real ones, so a
dry run's peak on CPU is the real step's, to the byte. On a GPU it is an estimate: the allocator's rounding, caching
and fragmentation are not in it.

A step that needs a value from the data (``.item()``, a data-dependent shape) cannot run on fake tensors: it raises,
and :func:`failure_note` says which op stopped it. Small computations on real tensors that are not the model's (a
scheduler's timestep table, say) run for real, which is what lets sampling loops be dry-run.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_memopt.memory import CPUPeakTracker
    >>> net = nn.Linear(1000, 1000)
    >>> with Sandbox(net) as box, CPUPeakTracker() as tracker:
    ...     tracker.add(box.parameters())
    ...     out = net(box.fake(torch.zeros(8, 1000)))
    >>> tracker.peak  # weights, bias, input and output: nothing of it was allocated
    4068000
    >>> type(net.weight).__name__, net.weight.grad is None
    ('Parameter', True)
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from lightning_memopt.collectives import sharded_fakes, simulate
from lightning_memopt.compat import (
    FAKE_RULES,
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    HigherOrderOperator,
    TorchDispatchMode,
    UnsupportedOperatorException,
    _disable_current_modes,
    _pop_mode,
    _push_mode,
    flex_attention_eager,
    is_traceable_wrapper_subclass,
    leave_modes_above,
    local_tensors,
    map_tensors,
    metric_state_names,
    op_tensors,
    tree_flatten,
)
from lightning_memopt.handles import ContainerSnapshot, find_containers
from lightning_memopt.reads import Replay, class_attribute, dynamic

_MISSING = object()
_LIFTS = (torch.ops.aten.lift_fresh.default,)


class DryRunError(RuntimeError):
    """The dry run met something it must not do on fake tensors (write into a real tensor, talk to other ranks)."""


def failure_note(error: BaseException) -> str:
    """Why a dry run stopped, naming the op: for the report's notes.

    Examples:
        >>> failure_note(DataDependentOutputException(torch.ops.aten._local_scalar_dense.default))[:60]
        'the dry run cannot trace `aten._local_scalar_dense.default`,'
    """
    if isinstance(error, DataDependentOutputException):
        return f"the dry run cannot trace `{error.func}`, which needs a value from the data (such as `.item()`)"
    if isinstance(error, DynamicOutputShapeException):
        return f"the dry run cannot trace `{error.func}`, whose output shape depends on the data"
    if isinstance(error, UnsupportedOperatorException):
        return f"the dry run cannot trace `{error.func}`, which has no fake-tensor implementation"
    if isinstance(error, DryRunError):
        return f"the dry run stopped: {error}"
    return f"the dry run failed with {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an op writes into, by its schema."""
    found = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = kwargs.get(argument.name, args[index] if index < len(args) else None)
        found += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return found


#: The largest factory output or batch tensor (in elements) that a dry run makes for real.
SMALL_FACTORY = 1 << 16
#: The longest row of integers (a sequence's positions, ``arange``) a dry run makes for real: transformers reads the
#: position ids of a model without a cache to find packed sequences, but not fake ones, and then builds the whole
#: causal mask (131,072 tokens: 16 GiB of booleans, and keys and values copied per head) that the real step skips.
POSITIONS = 1 << 22
#: The largest output (in elements) an op on real tensors gives for real; a larger one is made fake (a causal mask
#: built from real positions), so that a dry run never holds it in this machine's memory.
LARGEST_REAL = 1 << 22


def _small_on_cpu(out: Any) -> bool:
    """Whether every tensor of a factory's (fake) output is on the CPU and small, or a row of integers no longer
    than :data:`POSITIONS`: worth making real, so that code reading it (``position_ids`` checked for packed
    sequences) takes the path the real step takes."""
    found = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return bool(found) and all(
        t.device.type == "cpu"
        and (
            t.numel() <= SMALL_FACTORY
            or (t.dim() <= 1 and not (t.is_floating_point() or t.is_complex()) and t.numel() <= POSITIONS)
        )
        for t in found
    )


def _may_be_large(func: Any, real: list[torch.Tensor]) -> bool:
    """Whether an op on real tensors might give an output of more than :data:`LARGEST_REAL` elements, by what
    broadcasting its inputs could make (an op that writes into its input makes nothing new): only then is its output's
    size asked of the fake mode first, which costs as much as the op on small tensors."""
    return bool(real) and not func._schema.is_mutable and math.prod(t.numel() for t in real) > LARGEST_REAL


def _large(out: Any) -> bool:
    """Whether a (fake) output holds a tensor of more than :data:`LARGEST_REAL` elements."""
    return any(isinstance(t, torch.Tensor) and t.numel() > LARGEST_REAL for t in tree_flatten(out)[0])


def _readable(tensor: torch.Tensor) -> bool:
    """A small integer or boolean CPU tensor with data, whose own storage it fills: kept real in a batch."""
    return (
        not isinstance(tensor, FakeTensor)
        and not tensor.is_meta
        and tensor.device.type == "cpu"
        and not (tensor.is_floating_point() or tensor.is_complex())
        and tensor.numel() <= SMALL_FACTORY
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


class _Guard(TorchDispatchMode):
    """Sits above the fake mode. Refuses writes into real tensors that were not made inside the sandbox, and
    collectives. Keeps tensors made from Python values (``torch.tensor(0.0)``) real, and runs deterministic ops whose
    tensor inputs are all real (constants outside the model, such as a scheduler's timestep table) for real, so that
    their values stay known to the code that reads them."""

    def __init__(self, reads: Replay) -> None:
        super().__init__()
        self.owned: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storages made inside: free to write
        self.reads = reads

    def own(self, tensor: torch.Tensor) -> torch.Tensor:
        self.owned[tensor.untyped_storage()] = True
        return tensor

    supports_higher_order_operators = True  # flex_attention and the like go on to the fake mode, which has rules

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            return func(*args, **kwargs)
        if func.namespace in ("c10d", "_c10d_functional", "_dtensor"):
            try:
                return simulate(func, args, kwargs)
            except NotImplementedError as error:
                raise DryRunError(str(error)) from error
        if func in _LIFTS and not isinstance(args[0], FakeTensor):
            return self.own(args[0])
        tensors = list(op_tensors((args, kwargs)))
        real = [t for t in tensors if not isinstance(t, FakeTensor)]
        if len(real) < len(tensors):
            if func in FAKE_RULES:
                return FAKE_RULES[func](*args, **kwargs)
            if dynamic(func):
                return self._read(func, args, kwargs, next(t for t in tensors if isinstance(t, FakeTensor)).device)
        if real and func._schema.is_mutable:
            for tensor in _written(func, args, kwargs):
                inner = local_tensors(tensor)  # a DTensor writes into its local shard
                if any(not isinstance(t, FakeTensor) and t.untyped_storage() not in self.owned for t in inner):
                    raise DryRunError(f"`{func}` would write into a real tensor")
        if len(real) == len(tensors) and torch.Tag.nondeterministic_seeded not in func.tags:
            if _may_be_large(func, real) and _large(self._fake_run(func, args, kwargs)):
                return func(*args, **kwargs)  # the fake mode below takes real inputs as constants: a fake output
            if real or _small_on_cpu(func(*args, **kwargs)):  # a factory (``arange``): its fake tells the size
                with _disable_current_modes():
                    out = func(*args, **kwargs)
                for tensor in tree_flatten(out)[0]:
                    if isinstance(tensor, torch.Tensor) and not any(tensor is t for t in real):
                        self.own(tensor)
                return out
        try:
            return func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            # an op made of others (``nonzero(as_tuple=True)`` under inference mode): run them through this guard,
            # so that the one that reads the data gets its value
            _push_mode(self)
            try:
                out = func.decompose(*args, **kwargs)
            finally:
                _pop_mode()
            if out is NotImplemented:
                raise
            return out

    @staticmethod
    def _fake_run(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """The op's output from the fake mode below (its sizes, nothing computed); ``None`` where it needs the data."""
        try:
            return func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            return None

    def _read(self, func: Any, args: Any, kwargs: dict[str, Any], device: torch.device) -> Any:
        """An op that reads values out of a fake tensor, or whose output shape depends on them: answered by the
        replay of a real step's reads, or a placeholder."""
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            return self.reads.scalar(func, args[0])
        try:
            return func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            make = lambda spec: torch.empty(spec[0], dtype=spec[1], device=device)  # noqa: E731
            return self.reads.shaped(func, args, kwargs, make)


def plain_objects(values: Iterable[tuple[str, Any]]) -> list[Any]:
    """Objects held in public attributes that are neither modules nor tensors (a noise scheduler, a config)."""
    return [
        v
        for k, v in values
        if not k.startswith("_")
        and hasattr(v, "__dict__")
        and not isinstance(v, (nn.Module, torch.Tensor))
        and not callable(v)  # classes, functions, methods
    ]


class ObjectSnapshot:
    """Puts the instance attributes of objects back as they were (values changed, added or removed), and the state of
    optimizers among them."""

    def __init__(self, objects: Iterable[Any]) -> None:
        seen: set[int] = set()
        self._saved = []
        for obj in objects:
            if id(obj) not in seen and hasattr(obj, "__dict__"):
                seen.add(id(obj))
                self._saved.append((obj.__dict__, dict(obj.__dict__)))
            if isinstance(obj, torch.optim.Optimizer):
                self._saved.append((obj.state, dict(obj.state)))
                self._saved += [(state, dict(state)) for state in obj.state.values()]

    def restore(self) -> None:
        for current, old in self._saved:
            for key in [k for k in current if k not in old]:
                del current[key]
            for key, value in old.items():
                if current.get(key, _MISSING) is not value:
                    current[key] = value


class RandomStates:
    """Every random state a step may draw from: torch's (CPU and initialised GPUs), Python's and numpy's global ones,
    and the generators held by the given objects or in the globals of the given functions."""

    def __init__(self, objects: Iterable[Any], functions: Iterable[Callable[..., Any]]) -> None:
        numpy = sys.modules.get("numpy")
        self._saved: list[tuple[Callable[[Any], Any], Any]] = [(random.setstate, random.getstate())]
        self._saved.append((torch.set_rng_state, torch.get_rng_state()))
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._saved.append((torch.cuda.set_rng_state_all, torch.cuda.get_rng_state_all()))
        if numpy is not None:
            self._saved.append((numpy.random.set_state, numpy.random.get_state()))
        values = [v for obj in objects for v in getattr(obj, "__dict__", {}).values()]
        values += [v for fn in functions for v in getattr(fn, "__globals__", {}).values()]
        seen: set[int] = set()
        for value in values:
            if id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, torch.Generator):
                self._saved.append((value.set_state, value.get_state()))
            elif isinstance(value, random.Random) and value is not random._inst:  # type: ignore[attr-defined]
                self._saved.append((value.setstate, value.getstate()))
            elif numpy is not None and isinstance(value, numpy.random.Generator):
                state = value.bit_generator.state
                self._saved.append((lambda state, g=value: setattr(g.bit_generator, "state", state), state))
            elif numpy is not None and isinstance(value, numpy.random.RandomState):
                self._saved.append((value.set_state, value.get_state()))

    def restore(self) -> None:
        for setter, state in self._saved:
            setter(state)


@contextlib.contextmanager
def kept_as_is(
    module: nn.Module, objects: Iterable[Any] = (), functions: Iterable[Callable[..., Any]] = ()
) -> Iterator[None]:
    """Put back, however the block ends, the instance attributes of every submodule of ``module``, of the plain
    objects they hold in public attributes (a noise scheduler), and of ``objects`` (optimizers: their state too), the
    contents of the containers in their public attributes (a list of outputs a step appends to), and every random
    state (also generators held by those objects or in the globals of ``functions``).

    Examples:
        >>> from torch import nn
        >>> net = nn.Linear(2, 2)
        >>> with kept_as_is(net):
        ...     net.counter = 1
        ...     noise = torch.randn(3)
        >>> hasattr(net, "counter"), torch.equal(torch.randn(3), noise)
        (False, True)
    """
    modules = list(module.modules())
    everything = [*modules, *(v for m in modules for v in plain_objects(m.__dict__.items())), *objects]
    attributes, randoms = ObjectSnapshot(everything), RandomStates(everything, functions)
    public = tuple(v for obj in everything for k, v in getattr(obj, "__dict__", {}).items() if not k.startswith("_"))
    containers = ContainerSnapshot(find_containers(public, depth=4))  # a list of outputs a step appends to
    try:
        yield
    finally:
        attributes.restore()
        containers.remove()
        randoms.restore()


class Sandbox:
    """While open, ``module``'s parameters and buffers are fake copies, and code run inside runs on fake tensors.

    On closing, the parameters and buffers are put back, and everything :func:`kept_as_is` keeps is as before.

    Args:
        module: The module whose parameters and buffers are swapped for fake copies.
        objects: More objects to put back as they were, such as the optimizers.
        functions: Functions whose module globals may hold random generators (the step being dry-run).
        device: The device that tensors on the meta device pretend to be on (for models built with
            ``torch.device("meta")``, which hold no memory). Real tensors keep their own device.
        reads: What to answer when code reads values out of fake tensors (:class:`~lightning_memopt.reads.Replay`:
            a real step's reads, else placeholders).
    """

    def __init__(
        self,
        module: nn.Module,
        objects: Iterable[Any] = (),
        functions: Iterable[Callable[..., Any]] = (),
        device: torch.device | str = "cpu",
        reads: Replay | None = None,
    ) -> None:
        self.module = module
        self.objects = list(objects)
        self.functions = list(functions)
        self.device = torch.device(device)
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._fakes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._made: set[int] = set()  # the fakes given out, by id (a fake DTensor is not a FakeTensor)
        self._swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        self._stack = contextlib.ExitStack()
        self.reads = reads if reads is not None else Replay()
        self._guard = _Guard(self.reads)

    def fake(self, value: Any) -> Any:
        """A fake copy of a tensor, or of every tensor in a batch (dicts, lists, tuples and dataclasses are copied, so
        the step can change its copy freely). The same tensor always gives the same fake."""
        if not isinstance(value, torch.Tensor):
            return map_tensors(value, self.fake)
        if isinstance(value, FakeTensor) or id(value) in self._made:
            return value
        if id(value) not in self._fakes:
            if value.is_meta and is_traceable_wrapper_subclass(value):  # a DTensor on the meta device: its parts
                names, context = value.__tensor_flatten__()
                inner = {name: self.fake(getattr(value, name)) for name in names}
                fake = type(value).__tensor_unflatten__(inner, context, value.shape, value.stride())
                fake.requires_grad_(value.requires_grad)
            elif value.is_meta:
                with self.mode:
                    fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=self.device)
                fake.requires_grad_(value.requires_grad)
            else:
                fake = self.mode.from_tensor(value, static_shapes=True)
            self._fakes[id(value)] = (value, fake)  # the real tensor is held, so its id is not reused meanwhile
            self._made.add(id(fake))
        return self._fakes[id(value)][1]

    def _unshared(self, tensor: torch.Tensor) -> torch.Tensor:
        """A fake copy of ``tensor`` that nothing else holds: freed once the code inside lets it go, as the real one
        would be (:meth:`fake` keeps its copies alive, one per real tensor)."""
        return self.fake(tensor).clone()

    def batch(self, value: Any) -> Any:
        """A copy of a batch for the step: small integer and boolean CPU tensors (token ids, attention masks, labels,
        seeds) as real copies, whose values code may read as the real step does (a mask found all ones is skipped,
        and no mask is built); the rest as fakes (:meth:`fake`)."""
        copies: dict[int, torch.Tensor] = {}

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            if id(tensor) not in copies:
                copies[id(tensor)] = self.scratch(tensor) if _readable(tensor) else self.fake(tensor)
            return copies[id(tensor)]

        return map_tensors(value, copy)

    def scratch(self, value: torch.Tensor) -> torch.Tensor:
        """A real copy of a small tensor that code inside may read as a value and write into (an optimizer's step
        count, which it reads with ``.item()``)."""
        with _disable_current_modes():
            copy = value.detach().clone()
        return self._guard.own(copy)

    def parameters(self) -> list[torch.Tensor]:
        """The fake parameters and buffers, each once."""
        return list({id(store[name]): store[name] for store, name, _ in self._swapped}.values())

    def trainable(self) -> list[torch.Tensor]:
        return [t for t in self.parameters() if t.requires_grad]

    def __enter__(self) -> Sandbox:
        with contextlib.ExitStack() as stack:
            stack.enter_context(kept_as_is(self.module, self.objects, self.functions))
            stack.callback(self._put_back)
            for m in self.module.modules():
                for store in (m._parameters, m._buffers):
                    for name, tensor in store.items():
                        if tensor is not None:
                            self._swapped.append((store, name, tensor))
                            store[name] = self.fake(tensor)
            for m in self.module.modules():  # a torchmetrics metric's states, which its update writes into
                for name in metric_state_names(m):  # (kept_as_is puts the real ones back)
                    m.__dict__[name] = map_tensors(m.__dict__[name], self._unshared)
            stack.enter_context(sharded_fakes(self.module, self.fake))  # FSDP2's own references to the shards
            stack.enter_context(flex_attention_eager())
            stack.enter_context(self.mode)
            stack.enter_context(self._guard)
            # ``.numpy()`` of a fake tensor (a pipeline's images handed to PIL): an array from the replay, or zeros. Set
            # on the fake tensor class alone: a torch function mode would turn models off their fast paths
            reads = self.reads
            stack.enter_context(class_attribute(FakeTensor, "numpy", lambda t, *, force=False: reads.array(t)))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *args: Any) -> None:
        leave_modes_above(self._guard)  # a dispatch mode entered inside and left behind by an error
        self._stack.close()

    def _put_back(self) -> None:
        for store, name, tensor in reversed(self._swapped):
            store[name] = tensor
        self._swapped = []
        self._fakes, self._made = {}, set()
