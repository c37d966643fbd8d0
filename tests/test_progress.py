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


@pytest.mark.parametrize("delay", [0.0, pytest.param(3600.0, marks=pytest.mark.slow)], ids=["slow plan", "quick plan"])
def test_a_plan_shows_its_dry_runs_only_once_it_takes_a_while(monkeypatch, capsys, delay: float) -> None:
    monkeypatch.setattr(progress, "DELAY", delay)  # a plan past it, or one that never gets there
    _estimate()
    shown = capsys.readouterr().err
    if delay:
        assert "MemOpt: planning" not in shown
    else:
        assert "MemOpt: planning the estimate of fit" in shown and "dry runs" in shown
        assert "3 at full" in shown  # what is being dry-run: the blocks' modes
