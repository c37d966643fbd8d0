"""Undo never depends on order: overrides of one attribute come off in any order and leave it exactly as given, a
group removes every handle even when one raises, and a stage undoes its techniques in the reverse of their order."""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from lightning_memopt import MemOpt
from lightning_memopt.handles import REDUCE, AttributeOverride, HandleGroup
from lightning_memopt.techniques import Change, Technique, register_technique, unregister_technique
from lightning_memopt.techniques.checkpointing import CheckpointUnit, apply_checkpointing
from lightning_memopt.techniques.chunking import ChunkUnit, apply_feed_forward_chunking
from tests.helpers import Wrapped, trainer


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))


@pytest.mark.parametrize("order", list(itertools.permutations(range(2))))
def test_two_techniques_wrapping_one_forward_come_off_in_any_order(order: tuple[int, ...]) -> None:
    """Checkpointing and chunking both wrap the same module's ``forward``; removed in either order, the module is
    exactly as given: no ``forward`` of MemOpt's on the instance, nothing left for copies, the same outputs and
    gradients. While only one is on, it alone runs."""
    block = mlp()
    x = torch.randn(2, 6, 8, requires_grad=True)
    expected = block(x)
    given = dict(block.__dict__)
    checkpoint_unit = CheckpointUnit("block", block, native=False)
    chunk_unit = ChunkUnit("block", (0, 1), dim=1, size=2, module=block)
    handles = [apply_checkpointing([block], units=[checkpoint_unit]), apply_feed_forward_chunking(block, chunk_unit)]
    torch.testing.assert_close(block(x), expected)
    assert chunk_unit.slices == 3  # chunked, inside the checkpointed call
    first, second = (handles[i] for i in order)
    first.remove()
    chunk_unit.slices = 0
    block(x).sum().backward()
    assert chunk_unit.slices == (3 if first is handles[0] else 0)  # the one removed no longer runs
    second.remove()
    assert block.__dict__.keys() == given.keys() and "forward" not in block.__dict__ and REDUCE not in block.__dict__
    chunk_unit.slices = 0
    torch.testing.assert_close(block(x), expected)
    assert chunk_unit.slices == 0
    twin = copy.deepcopy(block)
    assert "forward" not in twin.__dict__


def test_overrides_of_one_attribute_restore_the_original_whichever_comes_off_first() -> None:
    layer = nn.Identity()
    layer.flag = "user's"
    lower = AttributeOverride(layer, "flag", "lower")
    upper = AttributeOverride(layer, "flag", "upper")
    assert layer.flag == "upper"
    lower.remove()
    assert layer.flag == "upper"  # the newest stays in force
    upper.remove()
    assert layer.flag == "user's"
    lower.remove(), upper.remove()  # twice is harmless
    assert layer.flag == "user's"


class Failing:
    def remove(self) -> None:
        raise RuntimeError("this handle failed")


class Recorded:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def remove(self) -> None:
        self.log.append(self.name)


def test_a_failing_handle_strands_none_of_the_others() -> None:
    log: list[str] = []
    group = HandleGroup([Recorded(log, "a"), Failing(), Recorded(log, "b"), Failing()])
    with pytest.raises(RuntimeError, match="this handle failed"):
        group.remove()
    assert log == ["b", "a"] and len(group) == 0  # every handle removed, last first, and the first error raised


def test_a_wrapped_forward_keeps_the_modules_signature() -> None:
    """Code that reads ``inspect.signature(module.forward)`` (transformers does, for the arguments a model takes) sees
    the module's own while checkpointing and chunking wrap it; it saw ``(*args, **kwargs)`` before."""
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    given = inspect.signature(layer.forward)
    unit = ChunkUnit("layer", (0, 1), dim=1, size=2, module=layer)
    handles = [apply_checkpointing([layer]), apply_feed_forward_chunking(layer, unit)]
    assert "forward" in layer.__dict__ and inspect.signature(layer.forward) == given
    assert layer.forward.__name__ == "forward"
    for handle in handles:
        handle.remove()
    assert "forward" not in layer.__dict__ and inspect.signature(layer.forward) == given


class FailsToStop(Technique):
    """A technique whose ``abort`` raises: it must not keep the stage from undoing the rest."""

    name, stages = "fails_to_stop", ("fit",)

    def __init__(self) -> None:
        self.handles: list[AttributeOverride] = []

    def apply(self, found: Any, config: Any) -> Change:
        self.handles.append(AttributeOverride(found.module, "marked", True))
        return Change("a mark", 1, self.handles[-1])

    def remove(self) -> None:
        self.handles = []

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        yield

    @property
    def changed(self) -> bool:
        return bool(self.handles)

    def abort(self) -> None:
        raise RuntimeError("the technique's abort failed")


def test_a_part_that_fails_to_stop_strands_nothing_on_the_model() -> None:
    """The stage stops every part, and MemOpt undoes every change, even when one raises; the first error is raised
    after. Before, an abort that raised left checkpointing on the user's model."""
    model = Wrapped("torch_encoder")
    register_technique(FailsToStop)
    try:
        with pytest.raises(RuntimeError, match="the technique's abort failed"):
            trainer(MemOpt(measure=False)).fit(model)
    finally:
        unregister_technique(FailsToStop)
    assert not any("forward" in m.__dict__ for m in model.modules()), "checkpointing left on"
    assert "marked" not in model.encoder.__dict__
