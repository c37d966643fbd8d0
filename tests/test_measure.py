"""Measurement, verification and logging: figures that agree with an independent measurement, no trace in the run,
a clear error on a broken block, and no work on the batches that are not measured."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

import lightning_memopt.callbacks.publish as report_module
from lightning_memopt import CPUPeakTracker, MemOpt, PeakMemory, VerificationError
from lightning_memopt.engine.measure import live_tensors
from lightning_memopt.memory import KINDS, CPUProbe, is_oom
from tests.helpers import Wrapped, heavy, scaled_model, trainer

#: What a measured fit batch logs: the baseline from the dry run, the peak and time of the real step, and its time
#: less the recomputation of checkpointed blocks.
FIT_KEYS = {
    "memopt/peak_bytes",
    "memopt/baseline_peak_bytes",
    "memopt/saved_bytes",
    "memopt/saved_fraction",
    "memopt/step_time_s",
    "memopt/baseline_step_time_s",
    "memopt/time_overhead",
    "memopt/dry_run_s",
    "memopt/baseline_exact",
}
#: What held each peak, by kind: the real step's (counted on CPU) and the baseline's.
FIT_KEYS |= {f"memopt/{run}peak_{kind}_bytes" for run in ("", "baseline_") for kind in KINDS}
#: At predict the baseline time is the step's less what its chunked blocks cost, timed alone after it.
PREDICT_KEYS = set(FIT_KEYS)
#: At fit, a dry run counts what the checkpointed blocks recompute (its time is the tuning time).
FIT_KEYS |= {"memopt/recompute_flops", "memopt/recompute_fraction", "memopt/tuning_s"}
#: That dry run also predicts the step's time (with the device's speeds, measured once); the step after the measured
#: one, where there is one, is timed against it.
FIT_KEYS |= {"memopt/predicted_step_s", "memopt/calibration_s"}
#: The gradients freed right after the optimizer step: what that saved, from a dry run without it.
FIT_KEYS |= {"memopt/free_gradients_saved_bytes"}
TIMED_KEYS = {"memopt/real_step_s", "memopt/prediction_error"}


def logged(tmp_path: Path) -> dict[str, float]:
    (path,) = tmp_path.glob("**/metrics.csv")
    rows = list(csv.DictReader(path.open()))
    return {k: float(v) for row in rows for k, v in row.items() if k.startswith("memopt/") and v != ""}


def independent_fraction(case: str, technique) -> float:
    """Exact peak of one step, plain against the library's own switch applied by hand, outside Lightning, in the
    order a Lightning training step runs: forward, zero_grad, backward."""
    peaks = []
    for switched in (False, True):
        model = Wrapped(case)
        batch = torch.utils.data.default_collate([model.case.sample(torch.Generator().manual_seed(i)) for i in (2, 3)])
        if switched:
            technique(model.net)
        training = technique.__name__ == "checkpoint"
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params if training and not switched else []:  # MemOpt frees them after the step (free_gradients)
            p.grad = torch.zeros_like(p)  # last step's gradients: alive until Lightning zeroes them
        grads = [p.grad for p in params if p.grad is not None]
        tensors = [*model.parameters(), *model.buffers(), *batch.values(), *grads]
        with CPUPeakTracker() as tracker:
            tracker.add(tensors)
            del tensors, grads  # the tracker holds weak references only: zero_grad below must free the old gradients
            if training:
                loss = model.case.loss(model.case.forward(model.net, batch), batch)
                for p in params:
                    p.grad = None  # Lightning's zero_grad, between the forward and the backward pass
                loss.backward()
            else:
                with torch.no_grad():
                    model.case.forward(model.net, batch)
        peaks.append(tracker.peak)
    return 1 - peaks[1] / peaks[0]


def checkpoint(net: nn.Module) -> None:
    net.enable_gradient_checkpointing() if hasattr(net, "enable_gradient_checkpointing") else (
        net.activation_checkpointing_enable()
    )


def assert_kinds_sum_to_the_peaks(metrics: dict[str, float]) -> None:
    for run in ("", "baseline_"):
        held = [metrics[f"memopt/{run}peak_{kind}_bytes"] for kind in KINDS]
        assert sum(held) == metrics[f"memopt/{run}peak_bytes"]
        assert metrics[f"memopt/{run}peak_weights_bytes"] > 0 and metrics[f"memopt/{run}peak_activations_bytes"] > 0


def chunk(net: nn.Module) -> None:
    """What MemOpt(chunk_size=2) chooses for the Latte test model, by hand: 2 for 16 tokens, 1 for 3 frames."""
    for name, block in net.named_modules():
        if hasattr(block, "set_chunk_feed_forward"):
            block.set_chunk_feed_forward(chunk_size=1 if name.startswith("temporal") else 2, dim=1)


@pytest.mark.parametrize("case", heavy(["unet2d", "llama"], "unet2d"))
def test_fit_logs_every_key_and_the_fraction_agrees_with_an_independent_measurement(case: str, tmp_path) -> None:
    memopt = MemOpt()
    trainer_ = trainer(memopt)
    trainer_.loggers = [CSVLogger(tmp_path)]
    trainer_.fit(Wrapped(case))
    metrics = logged(tmp_path)
    planned = {"memopt/planned_peak_bytes", "memopt/unseen_bytes"}  # where a planner's dry run counted the step
    assert set(metrics) - planned == FIT_KEYS  # 2 batches: none after the measured one to time
    if planned <= set(metrics):  # the real step took nothing beyond it, on CPU
        assert metrics["memopt/planned_peak_bytes"] == metrics["memopt/peak_bytes"]
        assert metrics["memopt/unseen_bytes"] == 0
    assert metrics["memopt/saved_bytes"] == metrics["memopt/baseline_peak_bytes"] - metrics["memopt/peak_bytes"] > 0
    assert_kinds_sum_to_the_peaks(metrics)
    assert metrics["memopt/saved_fraction"] == pytest.approx(independent_fraction(case, checkpoint), abs=0.05)
    report = memopt.report
    assert report is not None and report.batch_idx == 1 and report.saved_fraction == metrics["memopt/saved_fraction"]
    plain = PeakMemory()
    trainer(plain).fit(Wrapped(case))
    assert metrics["memopt/baseline_peak_bytes"] == plain.peaks[1]  # the dry run: exact, without a second real step
    assert metrics["memopt/baseline_exact"] == 1.0
    assert 0 < metrics["memopt/baseline_step_time_s"] < metrics["memopt/step_time_s"]  # less the recomputation
    hparams = (next(tmp_path.glob("**/hparams.yaml"))).read_text()
    assert "enable_gradient_checkpointing()" in hparams or "activation_checkpointing_enable()" in hparams
    assert "dry run on fake tensors, exact" in hparams


def test_predict_logs_every_key_and_the_fraction_agrees_with_an_independent_measurement(tmp_path) -> None:
    memopt = MemOpt(chunk_size=2)
    trainer_ = trainer(memopt)
    trainer_.loggers = [CSVLogger(tmp_path)]
    trainer_.predict(Wrapped("latte"))
    metrics = logged(tmp_path)
    assert set(metrics) == PREDICT_KEYS
    assert_kinds_sum_to_the_peaks(metrics)
    assert metrics["memopt/peak_gradients_bytes"] == metrics["memopt/peak_optimizer_bytes"] == 0  # no fit before
    assert metrics["memopt/saved_fraction"] == pytest.approx(independent_fraction("latte", chunk), abs=0.05)


@pytest.mark.slow  # a UNet2DCondition with LoRA fitted and predicted twice: 14 s
def test_measuring_leaves_training_and_predictions_unchanged() -> None:
    runs = {}
    for label, callbacks in (("plain", []), ("measured", [MemOpt(verify=True)])):
        model = Wrapped("unet2d_condition_lora")
        trainer(*callbacks, batches=3).fit(model)
        runs[label] = (model.state_dict(), model.losses, trainer(*callbacks).predict(model))
    (weights, losses, out), (weights2, losses2, out2) = runs["plain"], runs["measured"]
    assert losses == pytest.approx(losses2, rel=1e-6) and len(losses) == 3
    for name in weights:
        torch.testing.assert_close(weights[name], weights2[name], rtol=1e-5, atol=1e-7, msg=name)
    for a, b in zip(out, out2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class Stateful(Wrapped):
    """Has BatchNorm running statistics, a torchmetrics metric, self.log and dropout: all touched by a second run."""

    def __init__(self) -> None:
        super().__init__("torch_encoder")
        from torchmetrics import MeanMetric

        self.norm = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.5)
        self.mean_loss = MeanMetric()

    def training_step(self, batch, batch_idx):
        out = self.drop(self.norm(self.encoder(batch["x"]).transpose(1, 2)))
        loss = out.pow(2).mean()
        self.mean_loss.update(loss)
        self.log("loss", loss, on_epoch=True)
        return loss


@pytest.mark.parametrize("verify", [False, True])
def test_measuring_and_verifying_leave_no_trace(verify: bool) -> None:
    models = []
    for callbacks in ([], [MemOpt(verify=verify)]):
        torch.manual_seed(0)
        model = Stateful()
        trainer(*callbacks, batches=3).fit(model)
        models.append(model)
    plain, measured = models
    assert measured.mean_loss._update_count == plain.mean_loss._update_count == 3
    torch.testing.assert_close(measured.mean_loss.compute(), plain.mean_loss.compute())
    for (name, a), b in zip(plain.state_dict().items(), measured.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_verify_names_the_module_where_a_broken_checkpointed_path_differs() -> None:
    model = Wrapped("torch_encoder")
    model.encoder = scaled_model(broken=True)
    with pytest.raises(VerificationError) as error:
        trainer(MemOpt(verify=True)).fit(model)
    message = str(error.value)
    assert "on fit batch 1" in message and "the gradient of `encoder.blocks." in message
    assert "The first module whose forward output differs is `encoder.blocks.0`" in message
    assert not model.encoder.gradient_checkpointing  # restored after the error

    good = Wrapped("torch_encoder")
    good.encoder = scaled_model(broken=False)
    memopt = MemOpt(verify=True)
    trainer(memopt).fit(good)  # the same model with its checkpointed path right: verify finds no difference
    assert [(a.model, a.method) for a in memopt.applied if a.technique == "checkpointing"] == [
        ("encoder (Scaled)", "enable_gradient_checkpointing()")
    ]
    assert memopt.report.batch_idx == 1 and not any(note.startswith("verify") for note in memopt.report.notes)
    assert len(good.losses) == 2 and not good.encoder.gradient_checkpointing


def test_verify_names_the_block_where_broken_chunking_differs(monkeypatch) -> None:
    from diffusers.models import attention

    def wrong(ff, hidden_states, chunk_dim, chunk_size):  # forgets every slice but the first
        first = ff(hidden_states.narrow(chunk_dim, 0, chunk_size))
        return torch.cat([first] * (hidden_states.shape[chunk_dim] // chunk_size), dim=chunk_dim)

    monkeypatch.setattr(attention, "_chunked_feed_forward", wrong)
    with pytest.raises(VerificationError, match=r"on predict batch 0, the output differs .* is `transformer\."):
        trainer(MemOpt(chunk_size=2, verify=True)).predict(Wrapped("latte"))


@pytest.mark.parametrize("case", heavy(["dit", "bert", "peft_llama", "svd_unet"], "dit", "svd_unet"))
def test_verify_accepts_correct_models(case: str) -> None:
    """verify compares the measured batch with and without MemOpt's changes and finds them equal: the changes are in
    force, the batch is measured, no note says verify left anything out, and the results are those of a plain run."""
    stage = "predict" if case == "svd_unet" else "fit"
    memopt, runs = MemOpt(verify=True), []
    for callbacks in ([], [memopt]):
        model = Wrapped(case)  # built right before its run: both runs start from the same random state
        run = trainer(*callbacks)
        runs.append((model, run.fit(model) if stage == "fit" else run.predict(model)))
    (plain, plain_outputs), (model, outputs) = runs
    report = memopt.report
    assert report.stage == stage and report.applied
    assert report.batch_idx == (1 if stage == "fit" else 0)  # the batch verify compared
    assert report.baseline_peak_bytes is not None and report.peak_bytes is not None
    assert report.peak_bytes <= report.baseline_peak_bytes
    assert not any(note.startswith("verify") for note in report.notes)  # nothing skipped or left uncompared
    if stage == "fit":
        assert model.losses == pytest.approx(plain.losses, rel=1e-6) and len(model.losses) == 2
        for (name, a), b in zip(plain.state_dict().items(), model.state_dict().values(), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=name)
    else:
        for a, b in zip(outputs, plain_outputs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class DataDependent(Wrapped):
    """Branches on a value from the data: a dry run on fake tensors has no value to follow."""

    def __init__(self) -> None:
        super().__init__("torch_encoder")
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        scale = 2.0 if batch["x"].mean() > 0 else 1.0
        return super().training_step(batch, batch_idx) * scale


def test_a_step_that_branches_on_a_value_from_the_data_is_measured_and_runs_unchanged(tmp_path) -> None:
    plain, peaks = DataDependent(), PeakMemory()
    trainer(peaks, batches=3).fit(plain)
    model = DataDependent()
    memopt = MemOpt()
    trainer_ = trainer(memopt, batches=3)
    trainer_.loggers = [CSVLogger(tmp_path)]
    trainer_.fit(model)
    assert model.steps == 3 and trainer_.global_step == 3  # the dry runs' counts were put back
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-6, atol=1e-7)
    report = memopt.report
    # the branch read a placeholder in the dry run before the step, the step's own value in the one after it
    assert report.baseline_peak_bytes == peaks.peaks[1] > report.peak_bytes
    assert report.figures.baseline_by_kind == peaks.held[1]  # what held it, from the replay too
    assert any("replays the 1 values the real step read" in n for n in report.notes)
    assert set(logged(tmp_path)) == FIT_KEYS | TIMED_KEYS  # 3 batches: the measured one, and one after it


def test_unmeasured_batches_cost_nothing_but_the_hook_calls() -> None:
    """Profile every Python call made while batch 3, the last, runs (batch 1 is measured, batch 2 timed for the time
    model's prediction): from the Lightning glue and the engine (the stage, its dry runs and measurements), only the
    hooks themselves and the stage's methods they forward to may appear."""
    calls: list[str] = []
    package = Path(report_module.__file__).parent.parent
    profiled = (str(package / "callbacks"), str(package / "engine"))

    class Profile(__import__("lightning.pytorch").pytorch.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 3:
                sys.setprofile(
                    lambda frame, event, arg: (
                        calls.append(frame.f_code.co_name)
                        if event == "call" and frame.f_code.co_filename.startswith(profiled)
                        else None
                    )
                )

        def on_train_end(self, trainer, pl_module):
            sys.setprofile(None)

    memopt = MemOpt()
    trainer(Profile(), memopt, batches=4).fit(Wrapped("torch_encoder"))
    assert memopt.report is not None and memopt.report.batch_idx == 1 and memopt.report.real_step_s is not None
    hooks = {"on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end"}
    forwarded = {"batch_start", "before_backward", "before_optimizer_step", "batch_end", "due"}  # the stage's
    # Lightning reads `state_key` around every hook call (to name it for its profiler): a cached attribute
    assert set(calls) - {"state_key"} == hooks | forwarded  # no dry run, probe or tracker on batches 2 and 3
    assert calls.count("on_train_batch_start") == 1


def test_summary_is_printed_once_as_plain_text_without_rich(monkeypatch, caplog) -> None:
    find_spec = report_module.importlib.util.find_spec  # rich is hidden; diffusers, imported lazily, still finds torch
    monkeypatch.setattr(
        report_module.importlib.util, "find_spec", lambda name, *a: None if name == "rich" else find_spec(name, *a)
    )
    with caplog.at_level("INFO"):
        trainer(MemOpt()).fit(Wrapped("unet2d"))
    summaries = [r.message for r in caplog.records if "MemOpt fit summary" in r.message]
    assert len(summaries) == 1
    assert "unet (UNet2DModel)" in summaries[0] and "peak without" in summaries[0]


def test_cpu_probe_counts_live_tensors_and_allocations_to_the_byte() -> None:
    probe = CPUProbe()
    weights = torch.zeros(250)  # 1000 bytes
    probe.start([weights, weights[:10]])  # a view shares the storage
    a = torch.zeros(100, dtype=torch.float64)  # 800
    del a
    b = torch.zeros(50, dtype=torch.int16)  # 100
    peak, seconds = probe.stop()
    assert peak == 1800 and seconds >= 0
    del b


def test_live_tensors_cover_weights_grads_optimizer_state_and_batch() -> None:
    class FakeTrainer:
        optimizers = [torch.optim.Adam([nn.Parameter(torch.zeros(3))])]

    model = Wrapped("torch_encoder")
    param = next(model.parameters())
    param.grad = torch.ones_like(param)
    FakeTrainer.optimizers[0].state["x"] = {"exp_avg": torch.zeros(7)}
    batch = {"x": torch.zeros(2)}
    tensors = live_tensors(FakeTrainer(), model, batch)
    ids = {id(t) for t in tensors}
    assert id(param.grad) in ids and id(batch["x"]) in ids
    assert any(t.shape == (7,) for t in tensors)


def test_out_of_memory_errors_are_recognised_broadly() -> None:
    for message in (
        "CUDA out of memory. Tried to allocate 2.00 GiB",
        "XPU out of memory.",
        "MPS backend out of memory (MPS allocated: 1 GB)",
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.",
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes",
    ):
        assert is_oom(RuntimeError(message)), message
    assert is_oom(torch.OutOfMemoryError("x"))
    assert not is_oom(RuntimeError("shapes cannot be multiplied"))
    assert not is_oom(KeyboardInterrupt())


def test_bad_verify_arguments_raise() -> None:
    with pytest.raises(ValueError, match="`verify` must be True or False, got 'yes'"):
        MemOpt(verify="yes")
    with pytest.raises(ValueError, match="`verify_tolerance` must be a non-negative finite number, got -1"):
        MemOpt(verify_tolerance=-1)


def test_accelerator_probe_resets_then_reads_the_allocator_peak(monkeypatch) -> None:
    """No GPU here: fake torch.accelerator's counters and check the probe's calls and figure."""
    from lightning_memopt.memory import AcceleratorProbe, probe_for

    calls: list[str] = []

    class FakeCounters:
        def synchronize(self, device):
            calls.append("sync")

        def reset_peak_memory_stats(self, device):
            calls.append(f"reset {device}")

        def max_memory_allocated(self, device):
            calls.append("read")
            return 12345

    device = torch.device("cuda", 1)
    probe = probe_for(device)
    assert isinstance(probe, AcceleratorProbe)
    monkeypatch.setattr(probe, "_memory", FakeCounters())
    probe.start()
    peak, seconds = probe.stop()
    assert peak == 12345 and seconds >= 0
    assert calls == ["sync", "reset cuda:1", "sync", "read"]
