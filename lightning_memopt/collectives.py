"""Collectives in a dry run, simulated by shape: nothing is sent, and every rank plans alike.

An all-gather gives a fake tensor of the gathered size, a reduce-scatter one of the shard, an all-reduce works in
place. The dry-run guard (:mod:`lightning_memopt.dryrun`) calls :func:`simulate` for every op in a distributed
namespace; one it cannot simulate raises ``NotImplementedError``, and the dry run stops with a note naming it.

The ops of ``c10d`` (what ``torch.distributed.all_gather_into_tensor``, ``all_reduce`` and the like call, FSDP2's
included) write into tensors they are given: here they write nothing, and return those tensors with a finished
:class:`~torch.distributed.Work`, as their schemas say. The functional ones (``_c10d_functional``, DTensor's) return
new tensors: here new empty ones, of the shape a real run gives. Nothing depends on the rank, so every rank's dry run
of the same step allocates the same.

Examples:
    >>> import torch
    >>> from lightning_memopt.compat import FakeTensorMode
    >>> with FakeTensorMode():
    ...     shard = torch.empty(3, 4)
    ...     gathered = simulate(torch.ops._c10d_functional.all_gather_into_tensor.default, (shard, 8, "any"), {})
    >>> gathered.shape
    torch.Size([24, 4])
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


def simulate(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The result of the collective ``func`` on fake tensors, as a real run would shape it, without sending anything.

    Called under the dry run's fake mode: the tensors it makes are fake.

    Raises:
        NotImplementedError: ``func`` is not simulated.
    """
    name = func._schema.name  # such as "c10d::_allgather_base_"
    if name in _IN_PLACE:
        return _in_place(func, args)
    if name in _NEW:
        schema_args = func._schema.arguments
        bound = {a.name: a.default_value for a in schema_args if a.has_default_value()}
        bound.update(zip((a.name for a in schema_args), args, strict=False))
        bound.update(kwargs)
        return _NEW[name](bound)
    raise NotImplementedError(f"`{func}` talks to other processes")


def _work() -> Any:
    """A finished ``Work`` in the form ops return it (a ``ScriptObject``): its ``wait()`` returns at once."""
    from torch._C._distributed_c10d import FakeWork

    return FakeWork().boxed()


def _in_place(func: Any, args: tuple[Any, ...]) -> Any:
    """A ``c10d`` op: its first argument holds the outputs, left unwritten, then the ``Work``, as its schema returns."""
    returns = func._schema.returns
    if not returns:  # monitored_barrier_
        return None
    if len(returns) == 1:  # Work only: the outputs were passed in
        return _work()
    return args[0], _work()


#: ``c10d`` ops, which write into tensors they are given (the first argument) and return them with a ``Work``.
_IN_PLACE = {
    f"c10d::{name}"
    for name in (
        "_allgather_base_",
        "_reduce_scatter_base_",
        "allgather_",
        "allgather_coalesced_",
        "allgather_into_tensor_coalesced_",
        "allreduce_",
        "allreduce_coalesced_",
        "alltoall_",
        "alltoall_base_",
        "barrier",
        "broadcast_",
        "gather_",
        "monitored_barrier_",
        "reduce_",
        "reduce_scatter_",
        "reduce_scatter_tensor_coalesced_",
        "scatter_",
    )
}


def _gathered(tensor: torch.Tensor, size: int) -> torch.Tensor:
    """The all-gather of ``tensor`` over ``size`` ranks: concatenated along the first dimension."""
    return tensor.new_empty((tensor.shape[0] * size, *tensor.shape[1:]))


def _scattered(tensor: torch.Tensor, size: int) -> torch.Tensor:
    """This rank's part of the reduce-scatter of ``tensor`` over ``size`` ranks: a slice of the first dimension."""
    return tensor.new_empty((tensor.shape[0] // size, *tensor.shape[1:]))


def _same(tensor: torch.Tensor) -> torch.Tensor:
    """An all-reduce or broadcast out of place: a new tensor like ``tensor``."""
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


def _alltoall(tensor: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
    """An all-to-all: the first dimension is the sum of the sizes received, or the input's without them."""
    rows = sum(int(s) for s in sizes) if sizes else tensor.shape[0]
    return tensor.new_empty((rows, *tensor.shape[1:]))


def _group_size(group: Any) -> int:
    """The number of ranks of a process group given by name or as a ``ProcessGroup``."""
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group)
    return group.size()


def _shard_dim_alltoall(bound: dict[str, Any]) -> torch.Tensor:
    """DTensor's redistribution from sharding one dimension to another: that one grows, the other shrinks."""
    tensor, size = bound["input"], _group_size(bound["group_name"])
    shape = list(tensor.shape)
    shape[bound["gather_dim"]] *= size
    shape[bound["shard_dim"]] //= size
    return tensor.new_empty(shape)


#: Functional ops (``_c10d_functional``, ``_dtensor``), which return their result, by what they are given.
_NEW: dict[str, Callable[[dict[str, Any]], Any]] = {
    "_c10d_functional::all_gather_into_tensor": lambda a: _gathered(a["input"], a["group_size"]),
    "_c10d_functional::all_gather_into_tensor_out": lambda a: a["out"],
    "_c10d_functional::all_gather_into_tensor_coalesced": lambda a: [
        _gathered(t, a["group_size"]) for t in a["inputs"]
    ],
    "_c10d_functional::reduce_scatter_tensor": lambda a: _scattered(a["input"], a["group_size"]),
    "_c10d_functional::reduce_scatter_tensor_out": lambda a: a["out"],
    "_c10d_functional::reduce_scatter_tensor_coalesced": lambda a: [
        _scattered(t, a["group_size"]) for t in a["inputs"]
    ],
    "_c10d_functional::all_reduce": lambda a: _same(a["input"]),
    "_c10d_functional::all_reduce_": lambda a: a["input"],
    "_c10d_functional::all_reduce_coalesced": lambda a: [_same(t) for t in a["inputs"]],
    "_c10d_functional::all_reduce_coalesced_": lambda a: a["inputs"],
    "_c10d_functional::broadcast": lambda a: _same(a["input"]),
    "_c10d_functional::broadcast_": lambda a: a["input"],
    "_c10d_functional::all_to_all_single": lambda a: _alltoall(a["input"], a["output_split_sizes"]),
    "_c10d_functional::wait_tensor": lambda a: a["tensor"],  # the collective "finished" when it was issued
    "_dtensor::shard_dim_alltoall": _shard_dim_alltoall,
}


#: The tensors an FSDP2 parameter (``FSDPParam``) holds besides the module's own: the shard and its padded data, and
#: what it all-gathers into. Swapped for fakes during a dry run; the all-gather buffers are made afresh inside it.
_SHARD_TENSORS = (
    "sharded_param",
    "_sharded_param_data",
    "_sharded_post_forward_param",
    "_sharded_post_forward_param_data",
)
_GATHER_STATE = ("all_gather_outputs", "_unsharded_param", "_unsharded_inner_tensors", "unsharded_accumulated_grad")


@contextlib.contextmanager
def sharded_fakes(module: nn.Module, fake: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """While open, FSDP2 (``fully_shard``) modules inside ``module`` all-gather from fake shards into fake buffers.

    FSDP2 keeps its own references to each parameter's shard and to the buffers it all-gathers into, on objects that
    are not modules, and writes the unsharded parameters into the modules itself before each forward. Here those
    references are swapped: the shard for ``fake(shard)`` (pass the sandbox's :meth:`~lightning_memopt.dryrun.Sandbox
    .fake`, so that the module's fake parameter and FSDP2's are the same object), the all-gather buffers for none, so
    that FSDP2 makes fake ones, as on its first step. On closing, every attribute of FSDP2's state, parameter groups
    and parameters is put back as it was. Nothing is done for a module without FSDP2.
    """
    objects = []
    for state in _fsdp_states(module):
        group = state._fsdp_param_group
        objects += [state, state._state_ctx, state._comm_ctx]
        if group is not None:
            objects += [group, group.comm_ctx, *group.fsdp_params]
    saved = [_Attributes(obj) for obj in {id(o): o for o in objects}.values()]
    try:
        for attributes in saved:
            current = attributes.current
            if "sharded_param" in current and "_sharded_param_data" in current:  # an FSDPParam
                for name in _SHARD_TENSORS:
                    if isinstance(current.get(name), torch.Tensor):
                        current[name] = fake(current[name])
                for name in _GATHER_STATE:
                    current.pop(name, None)
                current.update(all_gather_outputs=[], _unsharded_inner_tensors=[], unsharded_accumulated_grad=None)
        yield
    finally:
        for attributes in saved:
            attributes.restore()


class _Attributes:
    """An object's attributes, and the contents of the lists, dicts and sets among them (FSDP2's first forward
    appends to them in place), to put back."""

    def __init__(self, obj: Any) -> None:
        self.current: dict[str, Any] = obj.__dict__
        self.old = dict(self.current)
        self.contents = {k: copy.copy(v) for k, v in self.current.items() if type(v) in (list, dict, set)}

    def restore(self) -> None:
        self.current.clear()
        self.current.update(self.old)
        for name, contents in self.contents.items():
            container = self.current[name]
            container.clear()
            container.update(contents) if not isinstance(container, list) else container.extend(contents)


def _fsdp_states(module: nn.Module) -> list[Any]:
    """The FSDP2 states of the modules inside ``module`` that ``fully_shard`` was applied to."""
    if not torch.distributed.is_available():
        return []
    from torch.distributed.fsdp import FSDPModule

    return [m._get_fsdp_state() for m in module.modules() if isinstance(m, FSDPModule)]


def sharded_parameters(module: nn.Module) -> set[int]:
    """The ids of the parameters FSDP2 shards inside ``module`` (of the modules ``fully_shard`` was applied to)."""
    groups = [state._fsdp_param_group for state in _fsdp_states(module)]
    return {id(p.sharded_param) for group in groups if group is not None for p in group.fsdp_params}


def unsharded_parameters(module: nn.Module) -> list[torch.Tensor]:
    """The unsharded parameters FSDP2 has made inside ``module`` so far (in its forward pass's all-gathers), which
    require gradients: the leaves of the autograd graph where the module's own parameters are shards. A backward pass
    into those gradients, as FSDP2's, must reach these; FSDP2 then reduce-scatters them into the shards' gradients."""
    groups = [state._fsdp_param_group for state in _fsdp_states(module)]
    params = [getattr(p, "_unsharded_param", None) for g in groups if g is not None for p in g.fsdp_params]
    return [p for p in params if p is not None and p.requires_grad]
