"""The stage pipeline and the plug-in seam: a technique defined here, outside the package, registered through the
public function, is applied, planned under the budget with checkpointing in force, reported, logged, saved in
``state_dict``, reused by a resumed run and undone, without a line of the package changed; and a stage undoes its
changes in the reverse of the order they were made."""

from __future__ import annotations

import contextlib
import csv
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

import lightning_memopt
from lightning_memopt import MemOpt, estimate
from lightning_memopt.adapters import find_models
from lightning_memopt.engine.changes import Changes
from lightning_memopt.engine.config import MemOptConfig
from lightning_memopt.techniques import Change, Plan, Planning, Section, Technique

#: Bytes one slot of the prefetch queue holds.
SLOT = 64 * 1024


class Prefetch(Technique):
    """A user's technique: before each training forward pass a model holds a queue of ``depth`` slots (a deeper
    queue would wait less, and holds more memory), kept until the next pass. Its planner chooses the deepest queue
    whose step, as dry runs count it, stays within the budget."""

    name, stages, option = "prefetch", ("fit",), None
    reports = ("prefetch", "prefetch_depth")
    DEPTHS = (8, 4, 2, 1, 0)
    plans: list[dict[int, int | None]] = []  # each plan: the peak of each depth it tried

    def __init__(self) -> None:
        self.depth = self.DEPTHS[0]
        self.models: list[nn.Module] = []
        self.handles: list[Any] = []
        self.held: torch.Tensor | None = None
        self.on = True

    @classmethod
    def uses_budget(cls, config: Any) -> bool:
        return True

    def apply(self, found: Any, config: Any) -> Change:
        handle = found.module.register_forward_pre_hook(self._fetch)
        self.handles.append(handle)
        self.models.append(found.module)
        return Change("a prefetch queue", 1, handle)

    def _fetch(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.held = None
        if self.on and self.depth and torch.is_grad_enabled():
            self.held = torch.empty(self.depth * SLOT // 4, device=args[0].device)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.models, self.handles, self.held = [], [], None

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        self.on = False
        try:
            yield
        finally:
            self.on = True

    @property
    def changed(self) -> bool:
        return bool(self.models) and self.depth > 0 and self.on

    def describe(self) -> str | None:
        return f"depth {self.depth}" if self.models else None

    def state(self) -> dict[str, Any]:
        return {"depth": self.depth}

    def load(self, state: dict[str, Any]) -> bool:
        if "depth" not in state:
            return False
        self.depth = state["depth"]
        return True

    def plan(self, planning: Planning) -> Plan | None:
        if not planning.choose or not self.models:
            return None
        peaks: dict[int, int | None] = {}
        seconds, chosen = 0.0, 0
        for depth in self.DEPTHS:
            self.depth = depth
            dry = planning.run(None, steady=True)
            seconds += dry.seconds
            peaks[depth] = dry.peak_bytes
            if dry.peak_bytes is not None and (planning.budget is None or dry.peak_bytes <= planning.budget):
                chosen = depth
                break
        self.depth = chosen
        Prefetch.plans.append(peaks)
        return Plan(seconds, peak_bytes=peaks.get(chosen), said=[f"prefetch depth {chosen}"])

    def section(self) -> Section:
        return Section(
            settings={"prefetch": self.describe()},
            metrics={"prefetch_depth": self.depth if self.models else None},
            lines=[f"prefetch: {self.describe()}"] if self.models else [],
        )


class Encoder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.batch = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.encoder(batch).pow(2).mean()

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader([self.batch] * 3, batch_size=None)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


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
