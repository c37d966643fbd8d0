"""Collectives in a dry run are simulated by shape: right shapes, dtypes and devices, nothing sent or written."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_memopt.collectives import sharded_fakes, simulate
from lightning_memopt.compat import FakeTensor
from lightning_memopt.dryrun import Sandbox

WORLD = 4

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@pytest.fixture(scope="module")
def group():
    """A fake process group of 4 ranks in this one process (it sends nothing): the world size the ops see."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _dry(step):
    """Run ``step(x)`` in a sandbox on a fake (3, 5) bfloat16 input; returns what it returns."""
    with Sandbox(nn.Linear(1, 1)) as box:
        return step(box.fake(torch.ones(3, 5, dtype=torch.bfloat16)))


def _fake(tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    assert isinstance(tensor, FakeTensor)
    assert tuple(tensor.shape) == shape and tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu"


def test_c10d_all_gather_and_reduce_scatter_give_the_gathered_size_and_the_shard(group) -> None:
    def step(x):
        gathered = x.new_empty(3 * WORLD, 5)  # made from the input: fake (small factory outputs stay real)
        work = dist.all_gather_into_tensor(gathered, x, group=group, async_op=True)
        work.wait()
        shard = x.new_empty(3, 5)
        dist.reduce_scatter_tensor(shard, gathered, group=group)
        parts = [torch.empty_like(x) for _ in range(WORLD)]
        dist.all_gather(parts, x, group=group)
        return gathered, shard, parts

    gathered, shard, parts = _dry(step)
    _fake(gathered, (3 * WORLD, 5))
    _fake(shard, (3, 5))
    assert len(parts) == WORLD and all(isinstance(p, FakeTensor) for p in parts)


def test_c10d_all_reduce_broadcast_and_barrier_work_in_place_and_write_no_real_tensor(group) -> None:
    real = torch.arange(6.0)

    def step(x):
        dist.all_reduce(x, group=group)
        dist.broadcast(x, src=0, group=group)
        dist.all_reduce(real, group=group)  # a real tensor: the real op would write into it
        dist.barrier(group=group)
        return x

    _fake(_dry(step), (3, 5))
    assert torch.equal(real, torch.arange(6.0))


def test_functional_collectives_return_new_fakes_of_the_right_shape(group) -> None:
    import torch.distributed._functional_collectives as funcol

    def step(x):
        return (
            funcol.all_gather_tensor(x, 0, group),
            funcol.reduce_scatter_tensor(torch.cat([x] * WORLD), "sum", 0, group),
            funcol.all_reduce(x, "sum", group),
            funcol.all_to_all_single(x, [1, 1, 0, 1], [1, 1, 1, 0], group),
        )

    gathered, shard, reduced, exchanged = _dry(step)
    _fake(gathered, (3 * WORLD, 5))
    _fake(shard, (3, 5))
    _fake(reduced, (3, 5))
    _fake(exchanged, (3, 5))


def test_an_op_not_simulated_is_refused(group) -> None:
    with pytest.raises(NotImplementedError, match="talks to other processes"):
        simulate(torch.ops.c10d.send.default, (), {})


def test_fsdp2_shards_are_faked_in_a_dry_run_and_put_back(group) -> None:
    """With FSDP2, the all-gather reads the shard FSDP2 holds itself: it is a fake while open, the real one after."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for block in net:
        fully_shard(block, mesh=init_device_mesh("cpu", (WORLD,)))
    fully_shard(net, mesh=init_device_mesh("cpu", (WORLD,)))
    fsdp_param = net[0]._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
    shard = fsdp_param._sharded_param_data
    box = Sandbox(net)
    with box, sharded_fakes(net, box.fake):
        assert isinstance(fsdp_param._sharded_param_data, FakeTensor)
        out = net(box.fake(torch.ones(2, 8)))
        out.sum().backward()
        assert isinstance(out, FakeTensor) and out.shape == (2, 8)
    assert fsdp_param._sharded_param_data is shard and fsdp_param.all_gather_outputs == []
    assert net[0]._get_fsdp_state()._state_ctx.all_states == []  # FSDP2's first forward is still to come
