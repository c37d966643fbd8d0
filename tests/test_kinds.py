"""What holds a peak: every byte counted has a kind (weights, gradients, optimizer, activations, batch, other), the
kinds sum to the peak exactly, and a device's bytes are counted apart from another's."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_memopt import estimate
from lightning_memopt.engine.step import StepContext, dry_run_step
from lightning_memopt.memory import KINDS, CPUPeakTracker, CPUProbe


def test_a_storage_alive_at_the_peak_is_counted_there_under_the_kind_it_became() -> None:
    with CPUPeakTracker() as tracker:
        weights = torch.empty(100)  # 400 B, counted as what the step allocates until said otherwise
        tracker.rekind([weights], "weights")
        passing = torch.empty(25)  # 100 B, freed before the peak
        del passing
        before = torch.empty(50)  # 200 B, alive at the peak
        with tracker.allocating("other"):
            temporary = torch.empty(10)  # 40 B
        peak = dict(tracker.at_peak)
        del temporary
        after = torch.empty(1)  # 4 B, not alive at the peak: below it, the peak stays
        tracker.rekind([before, after], "gradients")
    assert tracker.peak == 640 == sum(tracker.at_peak.values())
    assert peak == {**dict.fromkeys(KINDS, 0), "weights": 400, "activations": 200, "other": 40}
    assert tracker.at_peak == {**peak, "activations": 0, "gradients": 200}  # `after` came later: not at the peak
    assert tracker.by_kind == {**dict.fromkeys(KINDS, 0), "weights": 400, "gradients": 204}
    assert tracker.current == sum(tracker.by_kind.values()) == 604


def test_a_kind_said_after_a_segment_reaches_the_peak_of_an_earlier_one() -> None:
    """A dry run split in segments (the planner's) keeps the highest peak of all: a storage that becomes a gradient
    later is counted as one there too."""
    probe, weights = CPUProbe(), torch.empty(10)
    probe.start({"weights": [weights]})
    grad = torch.empty(100)  # 400 B, allocated as what the step computes
    temporary = torch.empty(50)  # 200 B: the peak, 640 B
    del temporary
    probe.segment()
    small = torch.empty(1)  # a later segment, lower
    probe.tracker.rekind([grad], "gradients")
    peak, _ = probe.stop()
    assert peak == 640 and probe.at_peak == {
        **dict.fromkeys(KINDS, 0),
        "weights": 40,
        "gradients": 400,
        "activations": 200,
    }
    del small


def test_an_unknown_kind_is_refused_by_name() -> None:
    tracker, message = CPUPeakTracker(), "a kind of bytes must be one of weights, gradients.*got 'activation'"
    with pytest.raises(ValueError, match=message):
        tracker.add([torch.empty(1)], "activation")
    with pytest.raises(ValueError, match=message):
        tracker.rekind([torch.empty(1)], "activation")
    with pytest.raises(ValueError, match=message), tracker.allocating("activation"):
        pass
    assert tracker.current == 0 and tracker.kind == "activations"


def test_the_host_is_counted_apart_from_the_device_a_dry_run_pretends() -> None:
    with FakeTensorMode(), CPUPeakTracker(device="cuda") as tracker:
        on_device = torch.empty(100, device="cuda")  # 400 B
        copied = on_device.to("cpu")  # 400 B on the host
        on_device2 = torch.empty(50, device="cuda")  # 200 B
        del copied, on_device2
    assert (tracker.peak, tracker.current) == (600, 400)
    assert tracker.elsewhere_peak == {"cpu": 400} and tracker.elsewhere == {"cpu": 0}


class Offloading(pl.LightningModule):
    """Keeps its hidden activation on the host through the rest of the step."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 64)

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        hidden = self.a(batch)
        kept = hidden.to("cpu")
        del hidden
        return self.b(kept.to(batch.device)) + kept.sum()


def test_a_dry_run_for_an_accelerator_prices_bytes_moved_to_the_host_apart() -> None:
    with torch.device("meta"):  # a model built on the meta device pretends to be on the device asked for
        module, batch = Offloading(), torch.zeros(32, 64)
    on_cpu = dry_run_step(StepContext(), module, batch, 0, "predict")
    on_cuda = dry_run_step(StepContext(), module, batch, 0, "predict", device="cuda")
    hidden = 32 * 256 * 4 + 4  # the host copy, and its sum
    assert on_cpu.peak_bytes is not None and on_cuda.peak_bytes is not None
    assert on_cuda.elsewhere_peak == {"cpu": hidden} and on_cpu.elsewhere_peak == {}
    # on the device at its peak: the copy brought back and the output of `b`; the host's copy is not among them
    assert on_cuda.at_peak["activations"] == 32 * 256 * 4 + 32 * 64 * 4
    assert on_cpu.at_peak["activations"] > on_cuda.at_peak["activations"]  # on CPU the host's bytes are the device's
    for dry in (on_cpu, on_cuda):
        assert sum(dry.at_peak.values()) == dry.peak_bytes


class Encoder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.BatchNorm1d(24)  # a buffer or two among the weights

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.norm(self.encoder(batch)).pow(2).mean()

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.encoder(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


@pytest.mark.parametrize("stage", ["fit", "predict"])
def test_an_estimate_says_what_holds_each_peak_summing_to_it(stage: str) -> None:
    module = Encoder()
    result = estimate(module, torch.zeros(16, 24, 32), stage)
    weights = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
    for peak in (result.plain, result.memopt):
        assert peak.bytes is not None and sum(peak.by_kind.values()) == peak.bytes
        assert peak.by_kind["weights"] == weights and peak.by_kind["batch"] == 16 * 24 * 32 * 4
        assert peak.by_kind["activations"] > 0
        if stage == "fit":  # AdamW: two moments of every parameter, and a 4-byte step count for each
            params = list(module.parameters())
            moments = 2 * sum(p.numel() * 4 for p in params)
            assert peak.by_kind["optimizer"] == moments + 4 * len(params)
        else:
            assert peak.by_kind["optimizer"] == peak.by_kind["gradients"] == 0
    if stage == "fit":  # checkpointing keeps fewer activations (a TransformerEncoder has no chunking at predict)
        assert result.memopt.by_kind["activations"] < result.plain.by_kind["activations"]
    assert "held at the peak" in str(result) and "activations" in str(result)


class Small(pl.LightningModule):
    """Small enough that its step peaks in AdamW's step, with every gradient and the whole state alive."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


@pytest.mark.parametrize("steady", [True, False])
def test_a_peak_in_the_optimizer_step_is_held_by_the_gradients_the_state_and_its_temporaries(steady: bool) -> None:
    """The gradients the backward pass accumulated count as gradients, what the step allocates as other, and the state
    as the optimizer's, also where the first step creates it (``steady=False``): it was alive at the peak."""
    module = Small()
    optimizer = module.configure_optimizers()
    dry = dry_run_step(StepContext(optimizers=[optimizer]), module, torch.zeros(2, 128), 0, "fit", steady=steady)
    params = list(module.parameters())
    weights = sum(p.numel() * 4 for p in params)
    assert dry.peak_bytes is not None and sum(dry.at_peak.values()) == dry.peak_bytes
    assert dry.at_peak["gradients"] == dry.at_peak["weights"] == weights
    assert dry.at_peak["optimizer"] == 2 * weights + 4 * len(params)  # two moments and a step count each
    assert dry.at_peak["other"] > 0 and dry.at_peak["activations"] < 16  # the loss, no activations left
    assert not optimizer.state  # the user's optimizer: untouched
