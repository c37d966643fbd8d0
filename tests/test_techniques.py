"""The pure torch layer: exact CPU accounting, generic checkpointing and chunking, and exact undo."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_memopt import CPUPeakTracker
from lightning_memopt.adapters.base import find_block_stacks
from lightning_memopt.handles import AttributeSnapshot
from lightning_memopt.techniques import ChunkUnit, apply_checkpointing, apply_feed_forward_chunking, largest_divisor
from tests import zoo


def test_tracker_counts_known_allocations_to_the_byte() -> None:
    with CPUPeakTracker() as tracker:
        a = torch.empty(1000, dtype=torch.float32)  # 4000
        b = torch.empty(10, 10, dtype=torch.float64)  # 800
        view = a[:10]  # a view shares a's storage: no new bytes
        c = torch.empty(3, dtype=torch.int8)  # 3
        assert tracker.current == 4803
        del a, view
        assert tracker.current == 803
        d = torch.empty(250, dtype=torch.float16)  # 500
    assert (tracker.peak, tracker.current) == (4803, 1303)
    del b, c, d


def test_tracker_adds_storages_that_already_exist() -> None:
    layer = nn.Linear(10, 10)  # 400 + 40 bytes
    with CPUPeakTracker() as tracker:
        tracker.add(layer.parameters())
        tracker.add(layer.parameters())  # counted once
        with torch.no_grad():
            out = layer(torch.ones(1, 10))  # input 40, output 40
        assert tracker.current == 440 + 40  # the input was a temporary
        del out
        out = layer(torch.ones(1, 10))  # now autograd keeps the input alive for the weight's gradient
        assert tracker.current == 440 + 40 + 40
    assert tracker.peak == 520
    del out


def test_tracker_is_deterministic() -> None:
    def peak() -> int:
        model = zoo.torch_encoder()
        with CPUPeakTracker() as tracker:
            model(torch.ones(2, 16, 32)).sum().backward()
        return tracker.peak

    assert peak() == peak() == peak()


def _train_step(model: nn.Module, x: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    model.zero_grad()
    with CPUPeakTracker() as tracker:
        model(x).pow(2).mean().backward()
    return tracker.peak, [p.grad.clone() for p in model.parameters()]


def test_generic_checkpointing_saves_memory_and_keeps_gradients() -> None:
    torch.manual_seed(0)
    model = zoo.torch_encoder()
    x = torch.randn(4, 32, 32)
    plain_peak, plain_grads = _train_step(model, x)
    blocks = find_block_stacks(model)
    assert len(blocks) == 3
    handle = apply_checkpointing(blocks)
    peak, grads = _train_step(model, x)
    assert peak < plain_peak
    for a, b in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    with torch.no_grad():  # no recording, no checkpointing: the plain forward runs
        torch.testing.assert_close(model(x), model.layers[2](model.layers[1](model.layers[0](x))))
    handle.remove()
    handle.remove()  # twice is harmless
    assert all("forward" not in b.__dict__ for b in blocks)


class _Counter(nn.Module):
    """Counts its calls in a buffer (changed in place) and keeps the last input's shape (an attribute set)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.last_shape = x.shape
        return self.linear(x).relu() * self.calls


def test_a_block_is_looked_through_on_its_first_run_only(monkeypatch) -> None:
    """What a checkpointed block's runs change (its buffers and attributes) is found on its first run: later runs do
    not walk its modules again, and still leave the state as a plain run does and give its gradients."""
    torch.manual_seed(0)
    block, plain = _Counter(), _Counter()
    plain.load_state_dict(block.state_dict())
    handle = apply_checkpointing([block])
    walks = []
    for step in range(3):
        if step == 1:  # from the second run on, the block's modules are not walked
            monkeypatch.setattr(nn.Module, "modules", lambda self: walks.append(self) or iter(()))
        grads = []
        for model in (block, plain):
            x = torch.ones(2, 4, requires_grad=True)
            model(x).sum().backward()
            grads.append(x.grad)
        torch.testing.assert_close(grads[0], grads[1])
    assert walks == []
    assert float(block.calls) == float(plain.calls) == 3  # the recomputation counted nothing twice
    assert block.last_shape == (2, 4)
    handle.remove()


def test_stack_search_ignores_leaves_and_mixed_lists() -> None:
    root = nn.Module()
    root.linears = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))  # leaves: nothing to checkpoint inside
    root.mixed = nn.ModuleList([nn.Sequential(nn.Linear(2, 2)), nn.TransformerEncoderLayer(8, 2)])
    root.single = nn.ModuleList([nn.Sequential(nn.Linear(2, 2))])
    assert find_block_stacks(root) == []


@pytest.mark.parametrize(("n", "limit"), [(n, limit) for n in range(1, 40) for limit in (1, 2, 3, 5, 8, 64)])
def test_largest_divisor(n: int, limit: int) -> None:
    d = largest_divisor(n, limit)
    assert n % d == 0 and d <= max(limit, 1)
    assert not any(n % e == 0 for e in range(d + 1, min(n, limit) + 1))


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 7, 100])
@pytest.mark.parametrize("dim", [0, 1])
def test_generic_chunking_is_exact_for_uneven_slices(chunk_size: int, dim: int) -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(5, 7, 8)
    expected = mlp(x)
    handle = apply_feed_forward_chunking(mlp, ChunkUnit("mlp", (0, 1), dim=dim, size=chunk_size))
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-6)
    flat = torch.randn(5, 8)  # 2-D inputs are never split along the features
    torch.testing.assert_close(mlp(flat), mlp.__class__.forward(mlp, flat))
    handle.remove()
    assert "forward" not in mlp.__dict__


def test_generic_chunking_lowers_the_peak() -> None:
    mlp = nn.Sequential(nn.Linear(16, 256), nn.GELU(), nn.Linear(256, 16))
    x = torch.randn(2, 64, 16)

    def peak() -> int:
        with torch.no_grad(), CPUPeakTracker() as tracker:
            mlp(x)
        return tracker.peak

    plain = peak()
    handle = apply_feed_forward_chunking(mlp, ChunkUnit("mlp", (0, 1), dim=1, size=8))
    chunked = peak()
    handle.remove()
    assert chunked < plain / 2


def test_attribute_snapshot_restores_present_and_absent_attributes() -> None:
    layer = nn.Linear(2, 2)
    layer.flag = "user"
    snapshot = AttributeSnapshot([layer], ("flag", "extra"))
    layer.flag, layer.extra = "ours", 1
    snapshot.remove()
    assert layer.flag == "user" and not hasattr(layer, "extra")


def test_trackers_whose_spans_overlap_each_count_everything() -> None:
    """MemOpt's probe and PeakMemory's start and stop in different hooks: the first may stop while the second runs."""
    first, second = CPUPeakTracker(), CPUPeakTracker()
    first.__enter__()
    a = torch.empty(100)  # 400
    second.__enter__()
    b = torch.empty(50)  # 200, seen by both
    first.__exit__(None, None, None)  # leaves before the one entered after it
    c = torch.empty(25)  # 100, seen by the second only
    second.__exit__(None, None, None)
    assert (first.peak, second.peak) == (600, 300)
    d = torch.empty(10)  # seen by neither
    assert (first.current, second.current) == (600, 300)
    del a, b, c, d
