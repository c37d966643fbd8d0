"""Several ranks from one process: what :func:`~lightning_memopt.estimate` needs to give one rank's peak under DDP or
FSDP2 without launching the ranks.

A fake process group of N ranks (torch's ``fake`` backend: nothing is sent) stands in for the job. Under DDP the
module is the one given: a rank runs the whole step, plus DDP's buckets, a copy of every gradient. Under
``ModelParallelStrategy`` the module's own ``configure_model`` runs on a deep copy of it, under a device mesh of N
ranks, as Lightning runs it, so that ``fully_shard`` shards the copy; the dry run then all-gathers and reduce-scatters
by shape (:mod:`lightning_memopt.collectives`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch


@dataclass
class Ranks:
    """The step of one rank among ``world_size``: its module (a sharded copy under FSDP2), the strategy object its
    techniques read, and the bytes of DDP's buckets."""

    module: pl.LightningModule
    world_size: int = 1
    strategy: Any = None
    gradient_buckets: int = 0


def parse(strategy: Any, devices: int | None) -> tuple[str, int, int]:
    """The kind of ``strategy`` (``"one"``, ``"ddp"`` or ``"fsdp2"``), its data-parallel size and its tensor-parallel
    size (1 but for ``ModelParallelStrategy``), the sizes as Lightning's setup on one node resolves them.

    Raises:
        ValueError: A strategy estimate cannot stand in for, or a number of devices that does not fit it.
    """
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    if devices is not None and (isinstance(devices, bool) or not isinstance(devices, int) or devices < 1):
        raise ValueError(f"`devices` must be a number of ranks, 1 or more, got {devices!r}")
    if strategy in (None, "auto", "single_device") or isinstance(strategy, SingleDeviceStrategy):
        if devices not in (None, 1):
            raise ValueError(f"`devices={devices}` needs a strategy for several ranks: 'ddp' or ModelParallelStrategy")
        return "one", 1, 1
    if strategy == "ddp" or type(strategy) is DDPStrategy:
        if devices is None:
            raise ValueError("`strategy='ddp'` needs `devices`, the number of ranks to estimate for")
        return "ddp", devices, 1
    if isinstance(strategy, ModelParallelStrategy):
        data, tensor = strategy._data_parallel_size, strategy._tensor_parallel_size
        # as Lightning's setup on one node: "auto" data parallelism is the number of nodes, tensor the processes
        data = 1 if data == "auto" else data
        tensor = (devices or 1) // data if tensor == "auto" else tensor
        if devices is not None and data * tensor != devices:
            raise ValueError(
                f"ModelParallelStrategy(data_parallel_size={data}, tensor_parallel_size={tensor}) needs "
                f"{data * tensor} devices, got `devices={devices}`"
            )
        return "fsdp2", data, tensor
    raise ValueError(
        f"`strategy` must be None, 'ddp', a DDPStrategy or a ModelParallelStrategy, got {strategy!r}"
        " (FSDPStrategy and DeepSpeedStrategy need a GPU in Lightning, and estimate does not stand in for them)"
    )


@contextlib.contextmanager
def ranks(module: pl.LightningModule, strategy: Any, devices: int | None, stage: str) -> Iterator[Ranks]:
    """One rank of ``strategy`` on ``devices`` ranks, in this process, while open (see the module's words)."""
    kind, data, tensor = parse(strategy, devices)
    world = data * tensor
    if kind == "one":
        yield Ranks(module)
        return
    import torch.distributed as dist

    if dist.is_initialized():
        raise ValueError(
            "estimate with a strategy stands in for every rank in this one process, and a process group is "
            "initialized already: call it outside the distributed run"
        )
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        if kind == "ddp":
            obj = strategy if isinstance(strategy, DDPStrategy) else DDPStrategy()
            as_views = obj._ddp_kwargs.get("gradient_as_bucket_view", False)
            trainable = [p for p in module.parameters() if p.requires_grad]
            buckets = 0 if as_views or stage != "fit" else sum(p.numel() * p.element_size() for p in trainable)
            yield Ranks(module, world, obj, buckets)
        else:
            resolved = ModelParallelStrategy(data, tensor)  # what the techniques read, its sizes resolved
            yield Ranks(_sharded(module, data, tensor), world, resolved)
    finally:
        dist.destroy_process_group()


def _sharded(module: pl.LightningModule, data: int, tensor: int) -> pl.LightningModule:
    """A deep copy of ``module`` after its ``configure_model`` ran under a device mesh of ``data`` by ``tensor``
    ranks, as Lightning's ``ModelParallelStrategy`` makes it."""
    from torch.distributed.device_mesh import init_device_mesh

    if type(module).configure_model is pl.LightningModule.configure_model:
        raise ValueError(
            f"ModelParallelStrategy runs {type(module).__name__}.configure_model to parallelize the model, and "
            f"{type(module).__name__} does not define it"
        )
    mesh = init_device_mesh("cpu", (data, tensor), mesh_dim_names=("data_parallel", "tensor_parallel"))
    sharded = copy.deepcopy(module)
    sharded._device_mesh = mesh
    sharded.configure_model()
    if not any(isinstance(p, torch.distributed.tensor.DTensor) for p in sharded.parameters()):
        raise ValueError(
            f"{type(module).__name__}.configure_model parallelized nothing under a device mesh of {data * tensor} "
            "ranks (no parameter is a DTensor): each rank would hold the whole model"
        )
    return sharded
