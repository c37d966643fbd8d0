"""The stage pipeline and the plug-in seam: the technique of ``examples/custom_technique.py``, outside the package,
registered through the public function, is applied, planned under the budget with checkpointing in force, reported,
logged, saved in ``state_dict``, reused by a resumed run and undone, without a line of the package changed; and a
stage undoes its changes in the reverse of the order they were made."""

from __future__ import annotations

import contextlib
import csv
import functools
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

import lightning_memopt
from lightning_memopt import MemOpt, estimate, timing
from lightning_memopt.adapters import find_models
from lightning_memopt.engine.changes import Changes
from lightning_memopt.engine.config import MemOptConfig
from lightning_memopt.techniques import Change, Knob, Planning, Technique
from lightning_memopt.timing import Speed
from tests.helpers import once


def _example() -> Any:
    """``examples/custom_technique.py``, the technique a user would write, imported as a module."""
    path = Path(__file__).resolve().parents[1] / "examples" / "custom_technique.py"
    spec = importlib.util.spec_from_file_location("custom_technique", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = _example()
# The example prices a slot of its queue at 10 ms, which dwarfs any recompute, so that the script chooses full queues on
# every machine. Here, at the tests' pinned speeds, a slot costs about what recomputing a few of its layer's operators
# does, so that the planner has something to trade: neither every queue full nor none.
EXAMPLE.WAIT = 0.0002
Encoder = EXAMPLE.Encoder


class Prefetch(EXAMPLE.Prefetch):
    """The example's technique, noting how many knobs it offered to each plan."""

    plans: list[int] = []  # each plan: the knobs offered

    def knobs(self, planning: Planning) -> list[Knob]:
        knobs = super().knobs(planning)
        if knobs:
            Prefetch.plans.append(len(knobs))
        return knobs


#: The device's speeds while the prefetch runs are planned: recomputation is traded against waiting by predicted time,
#: so that speeds measured on a loaded machine do not move the choice these tests read (nor a real step's time, far
#: from what these speeds predict, drop them).
STEADY = Speed("cpu", flop_s=1e-10, byte_s=1e-9, op_s=5e-6, policy_op_s=2.5e-6, call_s=2.5e-5)


@pytest.fixture
def prefetch(monkeypatch) -> Iterator[type[Prefetch]]:
    monkeypatch.setattr(Prefetch, "plans", [])
    monkeypatch.setattr(timing, "_MEASURED", {timing._key(torch.device("cpu"), n): STEADY for n in range(1, 65)})
    lightning_memopt.register_technique(Prefetch)
    try:
        yield Prefetch
    finally:
        lightning_memopt.unregister_technique(Prefetch)


def fit(memopt: MemOpt, model: pl.LightningModule, path: Path) -> None:
    trainer = pl.Trainer(
        max_epochs=1,
        limit_train_batches=3,
        logger=CSVLogger(path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[memopt],
    )
    trainer.fit(model)


# One encoder, as a user would run it: estimated alone and with the technique, fitted, then fitted again resumed. Each
# step is computed once, after the ones before it (the tests below read them, in any order, on one xdist worker), with
# the knobs the technique offered to the plans made in it.
prefetch_runs = pytest.mark.xdist_group("stage_prefetch")


@dataclass(frozen=True)
class Estimates:
    model: Encoder
    alone: Any  # every layer checkpointed, no queue; and the plain step
    budget: int
    planned: Any
    plans: list[int]


@functools.cache
def estimates() -> Estimates:
    model = Encoder()
    lightning_memopt.unregister_technique(Prefetch)
    try:
        alone = estimate(model, model.batch, stage="fit")
    finally:
        lightning_memopt.register_technique(Prefetch)
    assert alone.memopt.bytes is not None and alone.plain.bytes is not None
    budget = alone.memopt.bytes + (alone.plain.bytes - alone.memopt.bytes) // 4
    made = len(Prefetch.plans)
    options = dict(checkpointing="auto", memory_budget=budget)
    planned = estimate(model, model.batch, stage="fit", **options)
    return Estimates(model, alone, budget, planned, Prefetch.plans[made:])


@dataclass(frozen=True)
class Fitted:
    memopt: MemOpt
    path: Path
    plans: list[int]
    hooked: list[tuple[bool, bool]]  # per layer, after the fit: forward hooks left, a forward of its own left


@once
def first_fit(paths: pytest.TempPathFactory) -> Fitted:
    runs = estimates()
    memopt = MemOpt(checkpointing="auto", memory_budget=runs.budget)
    path = paths.mktemp("first")
    made = len(Prefetch.plans)
    fit(memopt, runs.model, path)
    hooked = [(bool(layer._forward_hooks), "forward" in layer.__dict__) for layer in runs.model.encoder.layers]
    return Fitted(memopt, path, Prefetch.plans[made:], hooked)


@once
def resumed_fit(paths: pytest.TempPathFactory) -> Fitted:
    runs, first = estimates(), first_fit(paths)
    resumed = MemOpt(checkpointing="auto", memory_budget=runs.budget)
    resumed.load_state_dict(first.memopt.state_dict())
    path = paths.mktemp("resumed")
    made = len(Prefetch.plans)
    fit(resumed, runs.model, path)
    hooked = [(bool(layer._forward_hooks), "forward" in layer.__dict__) for layer in runs.model.encoder.layers]
    return Fitted(resumed, path, Prefetch.plans[made:], hooked)


@pytest.mark.slow  # heavy: run by CI with -m slow
@prefetch_runs
def test_a_technique_registered_from_outside_is_planned_by_estimate_with_checkpointing(prefetch) -> None:
    assert estimates().plans == [4]  # one knob per layer, chosen with the layers' modes


@pytest.mark.slow  # heavy: run by CI with -m slow
@prefetch_runs
def test_a_technique_registered_from_outside_is_planned_once_at_fit_reported_logged_saved_and_undone(
    prefetch, tmp_path_factory
) -> None:
    runs, first = estimates(), first_fit(tmp_path_factory)
    memopt, planned, budget = first.memopt, runs.planned, runs.budget
    assert first.plans == [4]  # planned once, before the first batch
    report = memopt.report
    # the training state's techniques are applied at every fit with a budget (with free_gradients the peak moves into
    # the backward pass, after self.log: its float copy of the loss, 4 B, is counted by the dry run too)
    step = ("free_gradients", "optimizer_in_backward", "optimizer_state_8bit")
    assert {(a.technique, a.method) for a in report.applied if a.technique not in step} == {
        ("checkpointing", "generic checkpoint of TransformerEncoderLayer"),
        ("prefetch", "a prefetch queue per layer"),
    }
    assert planned.memopt.bytes == report.peak_bytes <= budget  # the real step, to the byte of the dry run on CPU
    assert f"prefetch: {report.prefetch}" in planned.how and f"prefetch: {report.prefetch}" in str(report)
    assert 0 < report.prefetch_slots < 16  # traded at these speeds: neither every queue full nor none
    (path,) = first.path.glob("**/metrics.csv")
    logged = [row for row in csv.DictReader(path.open()) if row.get("memopt/prefetch_slots")]
    assert [float(row["memopt/prefetch_slots"]) for row in logged] == [report.prefetch_slots]
    (saved,) = memopt.state_dict()["settings"]["fit"]
    assert saved[1]["prefetch"]["depths"] == [int(d) for d in report.prefetch.removeprefix("depths ").split(", ")]
    assert len(saved[1]["checkpointing"]["modes"]) == 4
    assert not any(hooks or own for hooks, own in first.hooked)  # undone


@pytest.mark.slow  # heavy: run by CI with -m slow
@prefetch_runs
def test_a_technique_registered_from_outside_is_reused_by_a_resumed_fit(prefetch, tmp_path_factory) -> None:
    first, resumed = first_fit(tmp_path_factory), resumed_fit(tmp_path_factory)
    assert resumed.plans == [] and resumed.memopt.report.prefetch == first.memopt.report.prefetch  # the same shapes


class Logged(Technique):
    """Marks each model; its change's handle notes when it is undone (or fails to be)."""

    stages = ("predict",)
    log: list[str] = []
    fail = False

    def apply(self, found: Any, config: Any) -> Change:
        technique, model = self.name, found.name

        class Handle:
            def remove(self) -> None:
                Logged.log.append(f"{model}.{technique}")
                if technique == "second" and model == "b" and Logged.fail:
                    raise RuntimeError("this handle failed")

        return Change("a mark", 1, Handle())

    def remove(self) -> None:
        Logged.log.append(f"{self.name} forgets")

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        yield

    @property
    def changed(self) -> bool:
        return False


class First(Logged):
    name = "first"


class Second(Logged):
    name = "second"


@pytest.mark.parametrize("fail", [False, True])
def test_a_stage_undoes_its_changes_in_reverse_and_always(fail: bool, monkeypatch) -> None:
    monkeypatch.setattr(Logged, "log", [])
    monkeypatch.setattr(Logged, "fail", fail)
    root = nn.Module()
    root.a, root.b = nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    lightning_memopt.register_technique(First)
    lightning_memopt.register_technique(Second)
    try:
        changes = Changes("predict", find_models(root), MemOptConfig(chunking=False), lambda note: None)
        changes.apply(quiet=True)
        assert [t.name for t in changes.techniques] == ["first", "second"]  # chunking off: only these two
        with pytest.raises(RuntimeError, match="this handle failed") if fail else contextlib.nullcontext():
            changes.remove()
    finally:
        lightning_memopt.unregister_technique(First)
        lightning_memopt.unregister_technique(Second)
    assert Logged.log == ["b.second", "b.first", "a.second", "a.first", "second forgets", "first forgets"]


def test_registering_a_bad_technique_names_the_problem() -> None:
    class Nameless(Technique):
        stages = ("fit",)

    class Elsewhere(Technique):
        name, stages = "elsewhere", ("train",)

    with pytest.raises(ValueError, match="needs a non-empty `name`, got '' on Nameless"):
        lightning_memopt.register_technique(Nameless)
    with pytest.raises(ValueError, match=r"stages` of Elsewhere must be some of .*got \('train',\)"):
        lightning_memopt.register_technique(Elsewhere)
    with pytest.raises(ValueError, match="must be a subclass of Technique, got <class 'int'>"):
        lightning_memopt.register_technique(int)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a technique named 'checkpointing' is registered already"):
        lightning_memopt.register_technique(type("Again", (Technique,), {"name": "checkpointing", "stages": ("fit",)}))
