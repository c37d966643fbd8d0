"""The timeline of a dry run (``lightning_memopt.timeline``): a moment per op, with the bytes by kind, the module, the
phase, the spans and the predicted seconds; the peak and where it is, the peak of each phase, read from it."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from lightning_memopt import estimate
from lightning_memopt.engine.step import StepContext, dry_run_step
from lightning_memopt.memory import CPUProbe
from lightning_memopt.timeline import OPTIMIZER_STEP, PHASES, Timeline, span
from lightning_memopt.timing import Speed
from tests.test_kinds import Encoder, Small


def fit_timeline(module, batch, **kwargs) -> tuple[object, Timeline]:
    optimizer = module.configure_optimizers()
    dry = dry_run_step(
        StepContext(optimizers=[optimizer]),
        module,
        batch,
        0,
        "fit",
        steady=True,
        watch=lambda probe: Timeline(probe, module, **kwargs),
    )
    return dry, dry.watched


def test_the_timelines_peak_is_the_probes_and_each_moment_sums_by_kind() -> None:
    dry, timeline = fit_timeline(Encoder(), torch.zeros(16, 24, 32))
    assert dry.peak_bytes is not None and len(timeline) > 100
    peak = timeline.peak
    assert peak is not None and peak.device_bytes == dry.peak_bytes
    assert max(timeline.phase_peaks().values()) == dry.peak_bytes
    assert list(timeline.phase_peaks()) == ["forward", "backward", OPTIMIZER_STEP]  # no block checkpointed
    for index in range(0, len(timeline), 37):
        moment = timeline[index]
        assert sum(moment.by_kind.values()) == moment.device_bytes and moment.phase in PHASES


def test_a_peak_in_the_optimizer_step_is_said_to_be_there() -> None:
    module = Small()
    dry, timeline = fit_timeline(module, torch.zeros(2, 128))
    assert timeline.peak is not None and timeline.peak.phase == OPTIMIZER_STEP and timeline.peak.module is None
    assert timeline.phase_peaks()[OPTIMIZER_STEP] == dry.peak_bytes > timeline.phase_peaks()["backward"]
    result = estimate(Small(), torch.zeros(2, 128), "fit")
    assert result.plain.where == "outside any module" and result.plain.phases[OPTIMIZER_STEP] == result.plain.bytes


def test_checkpointed_blocks_recompute_in_a_phase_of_their_own() -> None:
    result = estimate(Encoder(), torch.zeros(16, 24, 32), "fit")
    assert "recomputation" not in result.plain.phases and result.memopt.phases["recomputation"] > 0
    assert result.memopt.bytes == max(result.memopt.phases.values())
    assert "the peak of each phase, with MemOpt: forward" in str(result)


def test_spans_are_recorded_and_each_op_is_priced_with_a_speed() -> None:
    speed = Speed("cpu", flop_s=1e-9, byte_s=1e-9, op_s=1e-6, policy_op_s=0.0, call_s=0.0)
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    probe = CPUProbe()
    probe.start({"weights": net.parameters()})
    with Timeline(probe, net, speed) as timeline:
        net(torch.ones(2, 8))
        with span("outer"), span("inner"):
            net(torch.ones(2, 8))
    probe.stop()
    spans = {timeline[i].spans for i in range(len(timeline))}
    assert spans == {(), ("outer", "inner")}
    linear = next(timeline[i] for i in range(len(timeline)) if timeline[i].op is torch.ops.aten.addmm.default)
    assert linear.module == "0" and linear.seconds > 1e-6  # the floor and the product's FLOPs
    assert timeline[0].module is None  # torch.ones, outside the model
    assert timeline.seconds() == pytest.approx(sum(timeline[i].seconds for i in range(len(timeline))))
    assert timeline.seconds("forward") == timeline.seconds() and timeline.seconds("backward") == 0


def test_a_timeline_left_early_stops_recording() -> None:
    probe = CPUProbe()
    probe.start({})
    with contextlib.suppress(RuntimeError), Timeline(probe, nn.Linear(2, 2)) as timeline:
        torch.ones(2)
        raise RuntimeError("the step failed")
    torch.ones(2)
    probe.stop()
    ops = [timeline[i].op for i in range(len(timeline))]
    assert ops == [None, torch.ops.aten.ones.default]  # where it started, the op inside; not the op after it left


def test_a_stretch_between_marks_peaks_as_a_probe_split_there_measures() -> None:
    """What the planner's watch reads (a unit's forward peak, the bytes it keeps) is a query over marks on the
    timeline, equal to what the probe measured when split at those moments."""
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    probe = CPUProbe()
    probe.start({"weights": net.parameters()})
    measured = []
    with Timeline(probe, net) as timeline:
        x = torch.randn(32, 64)
        probe.segment()
        begin = timeline.mark("begin")
        hidden = net[1](net[0](x))
        end = timeline.mark("end")
        measured.append(probe.segment())
        out = net[2](hidden)
        del hidden
        last = timeline.mark("last")
        measured.append(probe.segment())
    probe.stop()
    assert timeline.marks == [(0, "start"), (begin, "begin"), (end, "end"), (last, "last")]
    assert [timeline.peak_between(begin, end), timeline.peak_between(end, last)] == measured
    assert timeline.bytes_at(end) - timeline.bytes_at(begin) == 32 * 256 * 4  # the ReLU's output: the linear's is freed
    assert timeline.peak_between(0, last) == max(measured) == timeline.peak.high_bytes
    assert out.shape == (32, 64)
