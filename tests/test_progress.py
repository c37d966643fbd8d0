"""A plan that takes a while shows what it dry-runs; a quick one shows nothing (``lightning_memopt/progress.py``)."""

from __future__ import annotations

import pytest
import torch

from lightning_memopt import estimate, progress
from tests.helpers import Wrapped


def _estimate() -> None:
    model = Wrapped("torch_encoder")
    batch = torch.utils.data.default_collate([model.case.sample(torch.Generator().manual_seed(i)) for i in (0, 1)])
    estimate(model, batch, checkpointing="auto", memory_budget=600_000)


@pytest.mark.slow  # two estimates; the default run has the bar alone below
@pytest.mark.parametrize("delay", [0.0, 3600.0], ids=["slow plan", "quick plan"])
def test_a_plan_shows_its_dry_runs_only_once_it_takes_a_while(monkeypatch, capsys, delay: float) -> None:
    monkeypatch.setattr(progress, "DELAY", delay)  # a plan past it, or one that never gets there
    _estimate()
    shown = capsys.readouterr().err
    if delay:
        assert "MemOpt: planning" not in shown
    else:
        assert "MemOpt: planning the estimate of fit" in shown and "dry runs" in shown
        assert "3 at full" in shown  # what is being dry-run: the blocks' modes


def test_the_bar_counts_the_dry_runs_and_names_the_one_running(monkeypatch, capsys) -> None:
    monkeypatch.setattr(progress, "DELAY", 0.0)
    with progress.planning("fit"):
        progress.dry_run("4 at full")
        with progress.planning("an inner plan"):  # shown by the outer one
            progress.dry_run("2 at attention, optimizer_in_backward='host'")
    shown = capsys.readouterr().err
    assert "MemOpt: planning fit" in shown and "an inner plan" not in shown
    assert "2 dry runs" in shown and "optimizer_in_backward='host'" in shown
    progress.dry_run("outside any plan")  # nothing to count it
    assert capsys.readouterr().err == ""
