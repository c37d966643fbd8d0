"""The time model (``lightning_memopt.timing``): the device's speeds, each op of a dry run priced with them, and the
prediction set against a real step in the report."""

from __future__ import annotations

import dataclasses
import json
import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_memopt import MemOpt, timing
from lightning_memopt.flops import policed, recomputing
from lightning_memopt.techniques.checkpointing import CheckpointUnit, apply_checkpointing
from lightning_memopt.timeline import record
from lightning_memopt.timing import Speed, measure
from tests import zoo

SPEED = Speed("cpu", flop_s=1e-9, byte_s=1e-8, op_s=1e-3, policy_op_s=1e-2, call_s=1.0)


def test_the_device_is_measured_with_every_figure_known() -> None:
    speed = measure(torch.device("cpu"))
    figures = (speed.flop_s, speed.byte_s, speed.op_s, speed.seconds)
    assert all(math.isfinite(f) and f > 0 for f in figures), speed
    assert speed.policy_op_s >= 0 and speed.call_s >= 0  # differences of two timings: a loaded machine may see none


def test_measuring_the_device_leaves_the_users_random_state_as_it_was() -> None:
    """The speeds are measured in the user's run (its first plan, or again where a prediction was far off): a reseed
    there gave the dropout masks of another run than plain's (found forcing checkpointing with dropout 0.2)."""
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    measure(torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), state)


def test_the_device_is_measured_from_a_loops_hook_where_gradients_are_off(monkeypatch) -> None:
    """The first planner of a process may run in a predict loop's hook, under ``torch.inference_mode``."""
    monkeypatch.setattr(timing, "_MEASURED", {})
    with torch.inference_mode():
        measured = timing.speed("cpu")
    assert measured.op_s > 0 and not torch.is_inference_mode_enabled()


def test_each_op_is_priced_by_its_flops_or_its_bytes_and_recomputation_by_its_calls() -> None:
    """A matrix product costs its FLOPs, an elementwise op its bytes, each op its floor; a recomputation adds a
    checkpoint's call, an op under a selective policy its dispatch."""
    a, b = torch.ones(64, 64), torch.ones(64, 64)
    with record(speed=SPEED) as timeline:
        torch.mm(a, b)
    assert timeline.seconds() == pytest.approx(1e-3 + 2 * 64**3 * 1e-9)  # compute bound: 524,288 FLOPs
    x = torch.ones(1000)
    with record(speed=SPEED) as timeline:
        torch.add(x, x)
    assert timeline.seconds() == pytest.approx(1e-3 + 12_000 * 1e-8)  # memory bound: 2 x 4,000 read, 4,000 written
    with record(speed=SPEED) as timeline:
        x.view(10, 100)
    assert timeline.seconds() == pytest.approx(1e-3)  # a view moves nothing
    with record(speed=SPEED) as timeline, recomputing(None), policed(None):
        torch.add(x, x)
    charged = [timeline[i].seconds for i in range(len(timeline)) if timeline[i].seconds]
    assert charged == pytest.approx([1.0, 1e-3 + 12_000 * 1e-8 + 1e-2])  # the checkpoint's call, then the op
    assert timeline.seconds("recomputation") == pytest.approx(sum(charged))
    assert timeline.policed == 1  # the op run through a policy, for the planner's tiebreak (table.fastest)
    with record() as timeline:  # without speeds: FLOPs only
        torch.mm(a, b)
    assert timeline.seconds() == 0 and timeline.forward_flops() == 2 * 64**3


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = zoo.torch_encoder()

    def training_step(self, batch, batch_idx):
        return self.model(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 16, 32)), batch_size=2)


@pytest.mark.slow  # heavy: run by CI with -m slow
@pytest.mark.parametrize(
    ("off", "checkpointing"), [(False, "auto"), (True, "auto"), (True, True)], ids=["near", "far off", "nothing ranked"]
)
def test_the_prediction_is_set_against_a_real_step_logged_and_the_speeds_kept_when_far_off(
    tmp_path, pinned_speeds, off, checkpointing
) -> None:
    """The step after the measured one is timed (no probe slows it) and logged beside the prediction; the device's
    speeds are kept however far off it is (they were dropped past 25%, and measured again by every run). The summary
    gives the step's time in one line, the prediction in it only where the predicted time chose among several settings
    that met the target (with every block checkpointed it chose nothing). Far off: speeds a thousand times too slow."""
    if off:
        for key, speed in pinned_speeds.items():
            pinned_speeds[key] = Speed("cpu", *(1000 * f for f in (speed.flop_s, speed.byte_s, speed.op_s)), 0.0, 0.0)
    memopt = MemOpt(checkpointing=checkpointing)
    logger = CSVLogger(tmp_path)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=4, logger=logger, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[memopt],
    )  # fmt: skip
    trainer.fit(Tiny())
    report = memopt.report
    assert report.predicted_step_s > 0 and report.real_step_s > 0
    assert report.prediction_error == pytest.approx(report.predicted_step_s / report.real_step_s - 1)
    assert report.time_ranked == (checkpointing == "auto")
    assert timing._key(torch.device("cpu")) in pinned_speeds
    if off:
        assert report.prediction_error > 10
    assert not [n for n in report.notes if "time model" in n]  # no note of several lines any more
    (line,) = [r[2] for r in report.rows() if r[2].startswith("step time")]
    assert ("settings chosen as the fastest predicted" in line) == report.time_ranked
    logged = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert all(key in logged for key in ("memopt/predicted_step_s", "memopt/real_step_s", "memopt/prediction_error"))


def test_the_speeds_are_kept_for_the_device_in_a_file_and_dropped_when_forgotten(tmp_path, monkeypatch) -> None:
    """Measuring the speeds is a one-off per device: a later run reads them from the file and spends nothing."""
    monkeypatch.setenv("LIGHTNING_MEMOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "_MEASURED", {})
    measured = timing.speed("cpu")
    assert measured.seconds > 0 and timing.cache_file() == tmp_path / "speeds.json"
    monkeypatch.setattr(timing, "_MEASURED", {})  # a new process
    again = timing.speed("cpu")
    assert again.seconds == 0.0 and again == dataclasses.replace(measured, seconds=0.0)
    timing.forget("cpu")
    assert timing._key(torch.device("cpu")) not in json.loads((tmp_path / "speeds.json").read_text())
    assert timing.speed("cpu").seconds > 0  # measured again


def test_a_selective_block_of_cheap_ops_is_predicted_slower_than_full_recomputation() -> None:
    """The planner's view of MemOpt's checkpoint: a block of many cheap ops costs more selective than full, since
    each of its ops passes through the policy's dispatch twice (forward and recomputation), and full costs one
    checkpoint call more than none."""
    block = nn.Sequential(*[nn.GELU() for _ in range(20)])
    unit = CheckpointUnit("block", block, native=False)
    handle = apply_checkpointing([block], units=[unit])
    seconds = {}
    for mode in ("none", "full", "selective"):
        unit.mode = mode
        with record(speed=SPEED) as timeline:
            block(torch.ones(4, 8, requires_grad=True)).sum().backward()
        seconds[mode] = timeline.seconds()
    handle.remove()
    assert seconds["full"] - seconds["none"] >= SPEED.call_s  # the call, and the ops run again
    assert seconds["selective"] - seconds["full"] >= 40 * SPEED.policy_op_s


def test_speeds_are_kept_when_the_step_is_far_from_its_prediction(monkeypatch, tmp_path) -> None:
    """A real step far from the time model's prediction keeps the device's speeds (it dropped them, and every run of
    a small model measured them again: the prediction was off on most, and no better measured again)."""
    from lightning_memopt import MemOpt
    from tests.helpers import Wrapped, trainer

    monkeypatch.setenv("LIGHTNING_MEMOPT_CACHE_DIR", str(tmp_path))
    slow = timing.Speed("cpu", flop_s=1e-6, byte_s=1e-6, op_s=1e-2, policy_op_s=1e-2, call_s=1e-2)  # far too slow
    key = timing._key(torch.device("cpu"))
    monkeypatch.setattr(timing, "_MEASURED", {key: slow})
    memopt = MemOpt()
    trainer(memopt, batches=3).fit(Wrapped("torch_encoder"))
    assert memopt.report.prediction_error is not None and memopt.report.prediction_error > 10
    assert timing._MEASURED.get(key) == slow
