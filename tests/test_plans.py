"""Plans kept between runs (``lightning_memopt/plans.py``): a second run of the same fit reuses the settings and the
baseline's figures without a dry run of either, and says so; anything that decides them plans anew; an unreadable
file is set aside with one warning."""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import pytest
import torch

from lightning_memopt import MemOpt, plans
from lightning_memopt.engine import measure as measure_module
from lightning_memopt.engine import stage as stage_module
from tests.helpers import Wrapped, trainer


@pytest.fixture
def kept(monkeypatch, tmp_path):
    """A cache folder of the test's own, and a count of the dry runs planning and the baseline make."""
    monkeypatch.setenv("LIGHTNING_MEMOPT_CACHE_DIR", str(tmp_path))
    calls: list[str] = []
    for module in (stage_module, measure_module):
        real = module.dry_run_step
        monkeypatch.setattr(
            module, "dry_run_step", lambda *a, _r=real, _m=module.__name__, **k: calls.append(_m) or _r(*a, **k)
        )
    return calls


def test_a_second_run_reuses_the_plan_and_the_baseline_without_a_dry_run_of_either(kept, caplog) -> None:
    first = MemOpt(memory_budget=600_000, checkpointing="auto")
    trainer(first, batches=3).fit(Wrapped("torch_encoder"))
    planned = len(kept)
    assert planned > 2 and "measure" in " ".join(kept)  # the planner's dry runs, and the baseline's
    kept.clear()
    second = MemOpt(memory_budget=600_000, checkpointing="auto")
    with caplog.at_level("INFO"):
        trainer(second, batches=3).fit(Wrapped("torch_encoder"))
    assert "reusing the plan from" in caplog.text and "kept with the plan" in caplog.text
    assert not [c for c in kept if c.endswith("measure")]  # no baseline dry run
    assert len(kept) < planned
    a, b = first.report, second.report
    assert b.baseline_peak_bytes == a.baseline_peak_bytes and b.peak_bytes == a.peak_bytes
    assert b.planned_peak_bytes == a.planned_peak_bytes
    assert first.state_dict() == second.state_dict()  # the same settings


def _first_layer_frozen(model: Wrapped) -> Wrapped:
    model.encoder.layers[0].requires_grad_(False)
    return model


@pytest.mark.slow  # two fits each; the default run keeps the reuse test above
@pytest.mark.parametrize(
    "change",
    [
        lambda m, o: (m, {**o, "memory_budget": 650_000}),  # the options
        lambda m, o: (Wrapped("torch_encoder", samples=12), o),  # the batch count does not decide: still reused
        lambda m, o: (_first_layer_frozen(m), o),  # requires_grad
    ],
    ids=["options", "more batches", "requires_grad"],
)
def test_what_decides_a_plan_plans_anew_and_nothing_else_does(kept, caplog, change) -> None:
    options = {"memory_budget": 600_000, "checkpointing": "auto"}
    trainer(MemOpt(**options), batches=3).fit(Wrapped("torch_encoder"))
    model, changed = change(Wrapped("torch_encoder"), options)
    with caplog.at_level("INFO"):
        trainer(MemOpt(**changed), batches=3).fit(model)
    reused = "reusing the plan from" in caplog.text
    assert reused == (changed == options and all(p.requires_grad for p in model.parameters()))


def test_an_unreadable_file_is_set_aside_with_one_warning(kept, tmp_path) -> None:
    (tmp_path / "plans.json").write_text("{not json")
    plans._WARNED.clear()
    with pytest.warns(UserWarning, match="could not be read") as warned:
        trainer(MemOpt(), batches=3).fit(Wrapped("torch_encoder"))
    assert len([w for w in warned if "could not be read" in str(w.message)]) == 1
    assert isinstance(plans._read(), dict) and plans._read()  # replaced by a readable one


def test_the_key_is_what_decides_the_plan() -> None:
    net = torch.nn.Linear(4, 4)
    batch = torch.zeros(2, 4)
    same = plans.key_of(plans.tree(net), plans.layout(batch))
    assert same == plans.key_of(plans.tree(torch.nn.Linear(4, 4)), plans.layout(torch.ones(2, 4)))
    assert same != plans.key_of(plans.tree(net), plans.layout(torch.zeros(3, 4)))
    assert same != plans.key_of(plans.tree(net), plans.layout(torch.zeros(2, 4, dtype=torch.float64)))
    assert same != plans.key_of(plans.tree(net.requires_grad_(False)), plans.layout(batch))


def test_a_model_that_differs_only_in_a_setting_is_planned_anew(kept) -> None:
    """Two encoders with the same parameters, one batch first: a plan of one is not the other's (their dry runs
    differ: the second runs torch's fused inference kernel)."""
    from lightning_memopt import estimate

    class Encoder(pl.LightningModule):
        def __init__(self, batch_first: bool) -> None:
            super().__init__()
            layer = torch.nn.TransformerEncoderLayer(16, 2, 64, dropout=0.0, batch_first=batch_first)
            self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

        def predict_step(self, batch: torch.Tensor) -> torch.Tensor:
            return self.encoder(batch)

    encoder, x = Encoder, torch.zeros(4, 4, 16)
    one = estimate(encoder(False), x, stage="predict")
    other = estimate(encoder(True), x, stage="predict")
    assert not any("reused" in n for n in other.notes)
    assert other.plain.bytes != one.plain.bytes


@pytest.mark.slow  # three estimates; the default run keeps a fit's reuse
def test_the_same_estimate_again_is_the_one_kept_without_a_dry_run(kept, monkeypatch) -> None:
    from lightning_memopt import estimate

    estimate_module = sys.modules["lightning_memopt.estimate"]  # the package's name is the function
    model = Wrapped("torch_encoder")
    batch = torch.utils.data.default_collate([model.case.sample(torch.Generator().manual_seed(i)) for i in (0, 1)])
    first = estimate(model, batch, checkpointing="auto", memory_budget=600_000)
    calls: list[int] = []
    real = estimate_module.dry_run_step
    monkeypatch.setattr(estimate_module, "dry_run_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = estimate(Wrapped("torch_encoder"), batch, checkpointing="auto", memory_budget=600_000)
    assert again.plain == first.plain and again.memopt == first.memopt and again.how == first.how
    assert any("reused the estimate made at" in n for n in again.notes) and not calls
    other = estimate(Wrapped("torch_encoder"), batch, checkpointing="auto", memory_budget=650_000)
    assert not any("reused" in n for n in other.notes) and calls  # another budget: estimated anew


def test_a_step_that_reads_its_values_is_dry_run_once_for_its_baseline_on_the_second_run(kept) -> None:
    """LBFGS reads its losses to decide how often it evaluates: its baseline is the dry run after the real step that
    replays those values. The first run also dry-runs it before the step, on placeholders, to find that out; the
    second knows it from the plan kept and makes only the replay (it made both)."""
    from tests.test_honest_baseline import ClosureOptimized

    first = MemOpt()
    trainer(first, batches=3).fit(ClosureOptimized())
    kept.clear()
    second = MemOpt()
    trainer(second, batches=3).fit(ClosureOptimized())
    assert [c for c in kept if c.endswith("measure")] == ["lightning_memopt.engine.measure"]  # the replay alone
    assert second.report.baseline_peak_bytes == first.report.baseline_peak_bytes is not None
    assert second.report.peak_bytes == first.report.peak_bytes
    assert any("replays the" in n for n in second.report.notes)
