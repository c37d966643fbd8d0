"""chunk_size='auto' and memory_budget, chosen by dry runs before a batch runs: the budget holds from the first batch,
no more feed-forward calls than a uniform setting needs, most of the saving at a fraction of the finest setting's
calls, OOM rescue, longer inputs and resuming. checkpointing='auto' at fit is tested in test_recompute.py."""

from __future__ import annotations

import functools
import logging

import lightning.pytorch as pl
import pytest
import torch
from torch._subclasses.fake_tensor import is_fake

from lightning_memopt import MemOpt, PeakMemory
from lightning_memopt.techniques.planner import SLACK
from lightning_memopt.tuning import parse_budget
from tests.helpers import Wrapped, heavy, longer, trainer

UNIFORM = (16, 8, 4, 2, 1)


class FeedForwardCalls(pl.Callback):
    """Counts the calls of every feed-forward module (diffusers' FeedForward, BERT's intermediate layer; each slice is
    one call), per predict batch. Put after MemOpt: the count starts after MemOpt's dry runs."""

    def __init__(self) -> None:
        self.per_batch: list[int] = []
        self._count = 0

    def on_predict_start(self, trainer, pl_module):
        for module in pl_module.modules():
            if type(module).__name__ in ("FeedForward", "BertIntermediate"):
                module.register_forward_hook(self._hook)

    def _hook(self, *args):
        self._count += 1

    def on_predict_batch_start(self, *args):
        self._count = 0

    def on_predict_batch_end(self, *args):
        self.per_batch.append(self._count)
        self._count = 0


def run(case: str, memopt: MemOpt | None, batches: int = 6) -> tuple[list[int], list[int], MemOpt | None]:
    """Predict ``batches`` batches; the peak and feed-forward calls of each (MemOpt's dry runs not included)."""
    probe, calls = PeakMemory(), FeedForwardCalls()
    trainer(*([memopt] if memopt else []), probe, calls, batches=batches).predict(Wrapped(case, samples=2 * batches))
    return probe.peaks, calls.per_batch, memopt


@functools.cache
def reference(case: str) -> tuple[tuple[int, int], dict[int, tuple[int, int]]]:
    """The plain peak and calls, and the peak and calls of every uniform chunk size: run once per case."""
    peaks, calls, _ = run(case, None, batches=1)
    uniform = {}
    for size in UNIFORM:
        peaks_, calls_, _ = run(case, MemOpt(chunk_size=size, measure=False), batches=1)
        uniform[size] = (peaks_[0], calls_[0])
    return (peaks[0], calls[0]), uniform


def sharing(*cases: str) -> list:
    """The cases, each of ``SHARED`` with an xdist group of its own: the tests that read its reference run on one
    worker, which computes it once; each of ``SLOW`` marked slow."""
    return heavy(cases, *(c for c in SLOW if c in cases), group="tuning", grouped=SHARED)


#: The cases whose reference more than one test reads.
SHARED = ("latte", "svd_unet")
#: The heaviest cases, left to CI's ``python -m pytest -m slow``: latte and BERT keep each test in the default run.
SLOW = ("svd_unet", "unet2d_condition")


@pytest.mark.parametrize("case", sharing("latte", "svd_unet"))
@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
def test_budget_holds_from_the_first_batch_with_no_more_calls_than_the_coarsest_uniform_setting(case, fraction) -> None:
    (plain, _), uniform = reference(case)
    lowest = min(peak for peak, _ in uniform.values())
    budget = int(lowest + fraction * (plain - lowest))
    peaks, calls, memopt = run(case, MemOpt(memory_budget=budget, measure=False), batches=3)
    assert all(p <= budget for p in peaks), (budget, peaks)  # from batch 0: no batch runs unchunked to be measured
    coarsest = max(size for size, (peak, _) in uniform.items() if peak <= budget)
    assert max(calls) <= uniform[coarsest][1], (calls, uniform)
    assert memopt.report.tuning_s > 0


@pytest.mark.parametrize("case", sharing("latte", "svd_unet", "unet2d_condition", "bert"))
def test_without_a_budget_the_peak_stays_within_slack_of_the_lowest(case) -> None:
    """The whole peak within SLACK (5%) of the lowest chunking reaches, with no more feed-forward calls than the
    coarsest uniform setting (or none) that gets there, where one does."""
    (plain, plain_calls), uniform = reference(case)
    finest = run(case, MemOpt(memory_budget=1, measure=False), batches=1)[0][0]  # every block as fine as can be
    lowest = min(finest, *(peak for peak, _ in uniform.values()))
    peaks, calls, _ = run(case, MemOpt(measure=False), batches=2)
    assert max(peaks) <= (1 + SLACK) * lowest, (peaks, lowest)
    reaching = [c for p, c in [(plain, plain_calls), *uniform.values()] if p <= (1 + SLACK) * lowest]
    assert not reaching or max(calls) <= min(reaching), (calls, uniform, lowest)  # latte: none gets there


def test_tuning_is_reported_and_logged(caplog) -> None:
    with caplog.at_level(logging.INFO):
        _, _, memopt = run("latte", MemOpt())
    report = memopt.report
    assert report.tuning_s > 0 and report.chunk_settings and report.saved_fraction > 0
    assert report.metrics()["memopt/tuning_s"] == report.tuning_s
    assert sum("chunk settings chosen by dry runs" in r.message for r in caplog.records) == 1  # once: same shapes


def test_chunking_is_left_off_where_it_saves_little() -> None:
    """BERT with a feed-forward as narrow as its hidden size: attention and weights hold the peak."""
    model = Wrapped("bert", samples=12)
    model.net.apply(lambda m: None)
    for layer in model.net.bert.encoder.layer:
        layer.intermediate.dense = torch.nn.Linear(32, 8)
        layer.output.dense = torch.nn.Linear(8, 32)
    memopt = MemOpt(measure=False)
    trainer(memopt, batches=6).predict(model)
    assert "off" in memopt.report.chunk_settings and "size" not in memopt.report.chunk_settings


def raise_oom_above(model: torch.nn.Module, limit: int) -> None:
    """Make every FeedForward run out of memory when its input has more than ``limit`` elements."""

    def hook(module, args):
        if args[0].numel() > limit:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes")

    for module in model.modules():
        if type(module).__name__ == "FeedForward":
            module.register_forward_pre_hook(hook)


@pytest.mark.parametrize("chunk_size", heavy([64, "auto"], 64))
def test_a_batch_that_runs_out_of_memory_is_retried_finer_and_no_prediction_is_lost(chunk_size, caplog) -> None:
    plain = trainer(batches=4).predict(Wrapped("latte", samples=8))
    model = Wrapped("latte", samples=8)
    raise_oom_above(model, 16 * 16 * 2)  # a spatial block's whole input is 6 x 16 x 16
    with caplog.at_level(logging.INFO):
        outputs = trainer(MemOpt(chunk_size=chunk_size), batches=4).predict(model)
    assert len(outputs) == len(plain) == 4
    for a, b in zip(outputs, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert any("ran out of memory; retrying it with every block one step finer" in r.message for r in caplog.records)


def test_out_of_memory_at_the_finest_setting_gives_a_clear_error() -> None:
    model = Wrapped("latte", samples=8)
    raise_oom_above(model, 1)
    with pytest.raises(RuntimeError, match="ran out of memory even with every setting as cheap in memory as it goes"):
        trainer(MemOpt(chunk_size=2), batches=4).predict(model)
    assert "predict_step" not in model.__dict__  # the rescue wrapper is gone


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_resumed_run_reuses_chosen_settings_unless_the_shapes_changed(tmp_path) -> None:
    first = MemOpt(memory_budget=230_000)
    t = trainer(first, batches=3)
    t.predict(Wrapped("latte", samples=6))
    path = tmp_path / "tuned.ckpt"
    t.save_checkpoint(path)
    assert first.report.tuning_s > 0

    resumed = MemOpt(memory_budget=230_000)
    trainer(resumed, batches=2).predict(Wrapped("latte", samples=4), ckpt_path=path)
    assert resumed.report.tuning_s is None  # no dry run spent on choosing
    assert resumed.report.chunk_settings == first.report.chunk_settings

    again = MemOpt(memory_budget=600_000)
    trainer(again, batches=2).predict(longer(Wrapped("latte", samples=4)), ckpt_path=path)
    assert again.report.tuning_s > 0


def test_longer_inputs_later_in_the_run_are_planned_before_they_run(caplog) -> None:
    model = Wrapped("latte", samples=16)
    items = [model.case.sample(torch.Generator().manual_seed(i)) for i in range(6)]
    items += [longer(Wrapped("latte")).case.sample(torch.Generator().manual_seed(i)) for i in range(6)]
    model.predict_dataloader = lambda: torch.utils.data.DataLoader(items + items[:6], batch_size=2)
    probe, memopt = PeakMemory(), MemOpt(memory_budget=600_000, measure=False)
    with caplog.at_level(logging.INFO):
        trainer(memopt, probe, batches=9).predict(model)
    assert sum("longer inputs: chunk settings chosen by dry runs" in r.message for r in caplog.records) == 1
    assert all(peak <= 600_000 for peak in probe.peaks), probe.peaks  # the first long batch included
    assert probe.peaks[3] > probe.peaks[2]  # the long batches are chunked for themselves, not off


@pytest.mark.parametrize(
    ("value", "expected"), [(1024, 1024), ("2GiB", 2 * 2**30), ("500MB", 500 * 10**6), ("1.5 kib", 1536), (0.25, 0.25)]
)
def test_budget_forms(value, expected) -> None:
    assert parse_budget(value) == expected


@pytest.mark.parametrize("value", [0, -5, 1.5, 0.0, "12 parsecs", "GiB", True, [1]])
def test_bad_budgets_raise_naming_the_value(value) -> None:
    with pytest.raises(ValueError, match=f"`memory_budget` must be .* got {value!r}".replace("[", r"\[")):
        MemOpt(memory_budget=value)


class Untraceable(Wrapped):
    """A predict step that refuses fake tensors: no dry run of it can be traced."""

    def predict_step(self, batch, batch_idx):
        if any(is_fake(t) for t in batch.values() if isinstance(t, torch.Tensor)):
            raise ValueError("this step runs on real tensors only")
        return super().predict_step(batch, batch_idx)


def test_a_step_no_dry_run_can_trace_keeps_its_chunking_and_says_why() -> None:
    memopt, probe = MemOpt(measure=False), PeakMemory()
    with pytest.warns(UserWarning, match="chunk settings could not be chosen: .*real tensors only") as caught:
        outputs = trainer(memopt, probe, batches=2).predict(Untraceable("latte", samples=4))
    assert len(outputs) == 2 and all(torch.isfinite(o).all() for o in outputs)
    assert "4 blocks: 4 off" in memopt.report.chunk_settings  # unchunked, as the planner found it
    assert sum("could not be chosen" in str(w.message) for w in caught) == 1
