"""The stage pipeline and the plug-in seam: the technique of ``examples/custom_technique.py``, outside the package,
registered through the public function, is applied, planned under the budget with checkpointing in force, reported,
logged, saved in ``state_dict``, reused by a resumed run and undone, without a line of the package changed; and a
stage undoes its changes in the reverse of the order they were made."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger
from torch import nn

import lightning_memopt
from lightning_memopt import MemOpt, estimate
from lightning_memopt.adapters import find_models
from lightning_memopt.engine.changes import Changes
from lightning_memopt.engine.config import MemOptConfig
from lightning_memopt.techniques import Change, Plan, Planning, Technique


def _example() -> Any:
    """``examples/custom_technique.py``, the technique a user would write, imported as a module."""
    path = Path(__file__).resolve().parents[1] / "examples" / "custom_technique.py"
    spec = importlib.util.spec_from_file_location("custom_technique", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = _example()
SLOT, Encoder = EXAMPLE.SLOT, EXAMPLE.Encoder


class Prefetch(EXAMPLE.Prefetch):
    """The example's technique, noting the peak of each depth its planner tried."""

    plans: list[dict[int, int | None]] = []  # each plan: the peak of each depth it tried

    def plan(self, planning: Planning) -> Plan | None:
        peaks: dict[int, int | None] = {}

        def run(*args: Any, **kwargs: Any) -> Any:
            dry = planning.run(*args, **kwargs)
            peaks[self.depth] = dry.peak_bytes
            return dry

        plan = super().plan(dataclasses.replace(planning, run=run))
        if plan is not None:
            Prefetch.plans.append(peaks)
        return plan


@pytest.fixture
def prefetch(monkeypatch) -> Iterator[type[Prefetch]]:
    monkeypatch.setattr(Prefetch, "plans", [])
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


def test_a_technique_registered_from_outside_is_planned_reported_logged_saved_and_undone(prefetch, tmp_path) -> None:
    model = Encoder()
    lightning_memopt.unregister_technique(Prefetch)
    checkpointed = estimate(model, model.batch, stage="fit").memopt.bytes  # the step with checkpointing alone
    lightning_memopt.register_technique(Prefetch)
    assert checkpointed is not None
    budget = checkpointed + 2 * SLOT + SLOT // 2  # room for two slots of the queue, not four

    memopt = MemOpt(memory_budget=budget)  # checkpointing=True: every block checkpointed, with the queue on top
    fit(memopt, model, tmp_path / "first")
    (peaks,) = Prefetch.plans  # planned once, before the first batch
    assert peaks == {8: checkpointed + 8 * SLOT, 4: checkpointed + 4 * SLOT, 2: checkpointed + 2 * SLOT}
    report = memopt.report
    assert {(a.technique, a.method) for a in report.applied} == {
        ("checkpointing", "generic checkpoint of TransformerEncoderLayer"),
        ("prefetch", "a prefetch queue"),
    }
    assert report.prefetch_depth == 2 and report.prefetch == "depth 2" and report.checkpointed == "4 of 4 blocks"
    assert report.peak_bytes == checkpointed + 2 * SLOT <= budget  # the real step, to the byte on CPU
    assert "prefetch: depth 2" in str(report)
    (path,) = (tmp_path / "first").glob("**/metrics.csv")
    logged = [row for row in csv.DictReader(path.open()) if row.get("memopt/prefetch_depth")]
    assert [float(row["memopt/prefetch_depth"]) for row in logged] == [2.0]
    (saved,) = memopt.state_dict()["settings"]["fit"]
    assert saved[1]["prefetch"] == {"depth": 2} and saved[1]["checkpointing"]["modes"] == ["full"] * 4
    assert not model.encoder._forward_pre_hooks and "forward" not in model.encoder.layers[0].__dict__  # undone

    resumed = MemOpt(memory_budget=budget)
    resumed.load_state_dict(memopt.state_dict())
    fit(resumed, model, tmp_path / "resumed")
    assert len(Prefetch.plans) == 1 and resumed.report.prefetch_depth == 2  # reused for the same shapes: no plan


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
