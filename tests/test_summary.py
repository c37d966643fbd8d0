"""What the summary says is what happened (issue 31, item 3): rows only for techniques that changed something, the
whole step's figures on a row of their own, verify's result, and a saving below zero said as a cost."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_memopt import MemOpt
from lightning_memopt.engine.report import WHOLE_STEP, Figures, MemOptReport
from tests import zoo
from tests.helpers import TRAINER_ARGS, Wrapped


class LoRALlama(pl.LightningModule):
    """A PEFT Llama whose step passes ``labels=``: the loss and the feed-forward at fit are settings to choose, and
    with this small vocabulary the planner leaves both as the model has them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = zoo.lora_llama()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(memopt: MemOpt) -> None:
    ids = [torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    data = [{"input_ids": i, "labels": i.clone()} for i in ids]
    trainer = pl.Trainer(**TRAINER_ARGS, limit_train_batches=2, callbacks=[memopt])
    trainer.fit(LoRALlama(), DataLoader(data, batch_size=None))


def test_only_techniques_in_force_have_rows_and_the_whole_step_has_its_own(caplog) -> None:
    """Before, the summary had a row `loss | chunked loss of LlamaForCausalLM` beside `loss: as the model computes
    it`, and `fit_chunking ... 2 blocks` beside `0 of 2 blocks`, and the whole saving sat on the checkpointing row."""
    memopt = MemOpt(verify=True)
    with caplog.at_level(logging.INFO):
        _fit(memopt)
    report = memopt.report
    assert {a.technique for a in report.set_up} == {"checkpointing", "loss", "fit_chunking", "free_gradients"}
    assert report.loss == "as the model computes it" and report.fit_chunked == "0 of 2 blocks"
    assert [a.technique for a in report.applied] == ["checkpointing", "free_gradients"]
    rows = report.rows()
    assert {r[1] for r in rows} == {"checkpointing", "free_gradients", ""}
    (whole,) = [r for r in rows if r[0] == WHOLE_STEP]
    assert [r for r in rows if any(r[3:])] == [whole]  # the figures are the whole step's, on no technique's row
    assert rows.index(whole) > max(i for i, r in enumerate(rows) if r[1] == "checkpointing")
    how = [r[2] for r in rows]
    assert "not used: loss: as the model computes it" in how
    assert "not used: feed-forward chunked at fit: 0 of 2 blocks" in how
    # what MemOpt spent once, outside the steps, on a line of its own under the whole step (issue 44, item 6)
    once = report.one_off_line()
    assert once is not None and once.startswith("once: ") and "the baseline's dry run" in once and once in how
    # applied, the rows and the logged keys say the same: what is in force (before, `applied` listed loss and
    # fit_chunking, and the logged keys named them "not used")
    assert [a.technique for a in memopt.applied] == ["checkpointing", "free_gradients"]
    settings = report.settings()
    assert not [k for k in settings if k.startswith(("memopt/fit/loss", "memopt/fit/fit_chunk"))], settings
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("MemOpt: ")]
    assert "MemOpt: loss not used on net (PeftModel of LlamaForCausalLM): as the model computes it." in said
    assert not any(line.startswith(("MemOpt: loss on", "MemOpt: fit_chunking on")) for line in said)
    assert any(line.startswith("MemOpt: checkpointing on net") for line in said)
    # verify ran and passed: the summary says so, with the largest difference it found
    assert report.figures.verified.startswith("verify: the loss, every gradient and every buffer equal to a run")
    assert report.figures.verified in how and 0 <= report.metrics()["memopt/verify_max_rel_diff"] <= 1e-5


def test_without_verify_the_summary_says_nothing_of_it() -> None:
    memopt = MemOpt(chunked_loss=False, chunking=False)
    _fit(memopt)
    assert memopt.report.figures.verified is None and "verify" not in str(memopt.report)
    assert "memopt/verify_max_rel_diff" not in memopt.report.metrics()


def test_a_saving_below_zero_is_said_as_a_cost() -> None:
    report = MemOptReport("predict", "cpu")
    report.embed(Figures(batch_idx=0, peak_bytes=3 * 2**20, baseline_peak_bytes=2 * 2**20))
    assert report.saved_bytes == -(2**20)
    assert any("peaked 1.00 MiB higher with MemOpt's changes" in n and "cost memory" in n for n in report.notes)
    saved = MemOptReport("predict", "cpu")
    saved.embed(Figures(batch_idx=0, peak_bytes=2 * 2**20, baseline_peak_bytes=3 * 2**20))
    assert not any("cost memory" in n for n in saved.notes)


class AdamWEncoder(Wrapped):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.slow  # a fit with every lossy technique set up: 5 s
def test_a_lossy_technique_set_up_but_left_off_is_not_applied(tmp_path) -> None:
    """Under a budget without lossy=True, the 8-bit optimizer state is set up and left off (its state stays float32):
    before, `applied` listed it ("moments kept in 8 bits between steps") and the logged keys named it."""
    memopt = MemOpt(memory_budget=200_000, checkpointing="auto")
    run = pl.Trainer(**{**TRAINER_ARGS, "logger": CSVLogger(tmp_path)}, limit_train_batches=2, callbacks=[memopt])
    with pytest.warns(UserWarning, match="lossy"):
        run.fit(AdamWEncoder("torch_encoder"))
    report = memopt.report
    assert "optimizer_state_8bit" in {a.technique for a in report.set_up}
    assert "optimizer_state_8bit" not in {a.technique for a in memopt.applied}
    assert {a.technique for a in memopt.applied} == set(report.in_force) - {"optimizer_state_8bit"}
    state = run.optimizers[0].state
    assert all(v.dtype == torch.float32 for s in state.values() for k, v in s.items() if k.startswith("exp_avg"))
    assert not [k for k in report.settings() if "8bit" in k]
    assert not [k for k in report.metrics() if "8bit" in k]
    assert not [r for r in report.rows() if r[1] == "optimizer_state_8bit"]


def test_each_peak_says_where_it_comes_from() -> None:
    """Issue 60, item 5: the baseline is a dry run's, the peak with the changes the real step's, and the dry run of
    the settings in force is said apart where it differs from the real step."""
    report = MemOptReport("fit", "cpu", Figures(batch_idx=1, peak_bytes=600, baseline_peak_bytes=1000))
    text = str(report)
    assert "peak without (dry run)" in text and "peak with (real step)" in text
    assert "the dry run of the settings in force" not in text
    report.planned_peak_bytes = 650
    assert "the dry run of the settings in force: 650 B at the peak (the real step's is the peak with)" in str(report)
    report.planned_peak_bytes = 600  # the same figure: said once
    assert "the dry run of the settings in force" not in str(report)
