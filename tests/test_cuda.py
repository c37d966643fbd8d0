"""MemOpt on a CUDA GPU: fit and predict give the results they give without it, a budget holds from the first batch,
and the dry run's peak is compared with the allocator's peak of the real step.

Run on a GPU with ``pytest -m cuda tests/test_cuda.py`` (``benchmarks/gpu.sh`` does, and collects the figures).
Without CUDA, and in any run whose ``-m`` does not name ``cuda`` (the default run, ``-m slow``), every test here is
skipped. ``MEMOPT_TEST_DEVICE=cpu`` runs the same tests on CPU, peaks counted exactly by the package's CPU tracker
(``PeakMemory``), where each dry run must equal its real step to the byte: a check of the tests themselves.

What is measured on CUDA: each step's peak counted from a baseline, the bytes allocated before the model reaches the
device (taken after the cuBLAS workspaces exist: they are made by a warm-up, since the first matrix product of each
thread allocates one and keeps it), from ``torch.cuda.memory_stats`` after ``reset_peak_memory_stats`` at the batch's
start, as ``PeakMemory`` does:

- ``allocated``: ``allocated_bytes.all.peak`` (``max_memory_allocated``) less the baseline: the allocator's blocks, each
  request rounded up to a multiple of 512 bytes;
- ``requested``: ``requested_bytes.all.peak`` less the baseline's: the bytes the tensors asked for, which is what a dry
  run counts;
- ``allocations``: ``allocation.all.peak``, the most blocks live at once: the rounding adds under 512 bytes to each.

Tolerances, stated:

- **Fit and predict results**: on CPU those of ``tests/test_fit.py`` and ``tests/test_predict.py``; on CUDA (TF32 off,
  cuDNN deterministic) ``rtol=1e-4, atol=1e-6``: the recomputation of a checkpointed block runs the same kernels, but
  some backward kernels sum with atomics, in another order on each run.
- **Budget**: every batch, the first included, ``requested <= B`` and ``allocated <= B + 512 * allocations`` (the
  budget bounds what the dry run counts; the rounding is the allocator's, which the dry run leaves out).
- **Dry run against the real step** (``estimate`` on the device, the second step measured: last step's gradients
  alive, as the estimate counts them): ``|allocated - dry| <= 512 * allocations + 10% of dry`` on CUDA, the 10% for
  the kernels' scratch (cuDNN workspaces, attention's) and the choices they make on the device, which fake tensors
  do not see; exactly equal on CPU.

Every figure (and the differences) is written to the JSON file that ``MEMOPT_CUDA_FIGURES`` names, if set, before the
test asserts anything, so that a failing run still says by how much.
"""

from __future__ import annotations

import gc
import json
import os
import warnings
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lightning_memopt import MemOpt, PeakMemory, estimate
from tests import zoo
from tests.helpers import TRAINER_ARGS, DecodeLatents, Wrapped

#: The device the tests run on: ``cuda``, or ``cpu`` to check the tests themselves on a machine without a GPU.
DEVICE = os.environ.get("MEMOPT_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE == "cuda"

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        ON_CUDA and not torch.cuda.is_available(),
        reason="needs a CUDA GPU (MEMOPT_TEST_DEVICE=cpu runs these tests on CPU)",
    ),
]

#: Fit and predict results: CPU as the CPU tests; CUDA looser (atomics in backward kernels, see the docstring).
TOL = dict(rtol=1e-4, atol=1e-6) if ON_CUDA else dict(rtol=1e-5, atol=1e-8)
PREDICT_TOL = dict(rtol=1e-4, atol=1e-5) if ON_CUDA else dict(rtol=1e-5, atol=1e-5)
#: The estimate's tolerance on CUDA beyond the allocator's rounding, as a fraction of the dry run's figure.
ESTIMATE_SLACK = 0.10
BLOCK = 512  # the CUDA caching allocator rounds each request up to a multiple of this
BATCHES = 3

FIGURES: dict[str, Any] = {
    "device": DEVICE,
    "torch": torch.__version__,
    "gpu": None,  # filled in by the first record: importing this module must not initialise CUDA
    "tolerance": {
        "results": {"fit": TOL, "predict": PREDICT_TOL},
        "budget": "requested <= B and allocated <= B + 512 * allocations, every batch",
        "estimate": "|allocated - dry| <= 512 * allocations + 10% of dry (CUDA); dry == real (CPU)",
    },
    "fit": {},
    "optimizer_in_backward": {},
    "predict": {},
    "budget": {},
    "estimate": {},
    "lossy": {},
}


def record(section: str, key: str, figures: dict[str, Any]) -> None:
    """Keep ``figures`` and write them all to ``$MEMOPT_CUDA_FIGURES`` now, before the caller asserts."""
    FIGURES[section][key] = figures
    if ON_CUDA and FIGURES["gpu"] is None:
        FIGURES["gpu"] = torch.cuda.get_device_name()
    path = os.environ.get("MEMOPT_CUDA_FIGURES")
    if path:
        with open(path, "w") as file:
            json.dump(FIGURES, file, indent=2, default=str)


@pytest.fixture(autouse=True)
def selected(request: pytest.FixtureRequest) -> None:
    """Only a run that asks for these tests by marker runs them: the default run and ``-m slow`` never try CUDA."""
    if "cuda" not in (request.config.option.markexpr or ""):
        pytest.skip("the CUDA tests run only when selected: pytest -m cuda tests/test_cuda.py")


@pytest.fixture(autouse=True)
def deterministic() -> Iterator[None]:
    """TF32 off and cuDNN's deterministic algorithms on, put back afterwards."""
    if not ON_CUDA:
        yield
        return
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark,
        ) = saved


def warm_up(device: str) -> None:
    """Matrix products forward, backward and recomputed in the backward pass (as a checkpointed block's are), so that
    each thread that runs them has its cuBLAS workspace."""
    x = torch.randn(4, 64, 64, device=device, requires_grad=True)
    w = torch.randn(64, 64, device=device, requires_grad=True)
    y = torch.nn.functional.linear(x, w, w[0])  # addmm, through cuBLASLt where torch takes it
    z = checkpoint(torch.nn.functional.linear, y, w, w[0], use_reentrant=False)
    torch.bmm(z @ w, y.transpose(1, 2)).sum().backward()


def settle() -> tuple[int, int]:
    """Free what earlier runs left and make the cuBLAS workspaces (the main thread's and autograd's, which runs the
    backward pass on a thread of its own); the bytes allocated and requested now, the baseline of every figure."""
    gc.collect()
    if not ON_CUDA:
        return 0, 0
    warm_up(DEVICE)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    stats = torch.cuda.memory_stats()
    return stats["allocated_bytes.all.current"], stats.get("requested_bytes.all.current", 0)


class Meter(pl.Callback):
    """Each train or predict batch's peak from the baseline (see the module's docstring): on CUDA from the allocator's
    statistics, on CPU ``PeakMemory``'s exact count (``allocated`` and ``requested`` the same, no allocations)."""

    def __init__(self, baseline: tuple[int, int]) -> None:
        self.baseline = baseline
        self.exact = PeakMemory()
        self.batches: list[dict[str, int]] = []

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if ON_CUDA:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.exact.on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def _stop(self) -> None:
        if ON_CUDA:
            torch.cuda.synchronize()
            stats = torch.cuda.memory_stats()
            allocated = stats["allocated_bytes.all.peak"] - self.baseline[0]
            requested = stats.get("requested_bytes.all.peak", stats["allocated_bytes.all.peak"]) - self.baseline[1]
            self.batches.append(
                {"allocated": allocated, "requested": requested, "allocations": stats["allocation.all.peak"]}
            )
        else:
            self.exact.on_train_batch_end()
            peak = self.exact.peaks[-1]
            self.batches.append({"allocated": peak, "requested": peak, "allocations": 0})

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, *args: Any) -> None:
        self._stop()

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._start(trainer, pl_module, batch, batch_idx)

    def on_predict_batch_end(self, *args: Any) -> None:
        self._stop()


def trainer(*callbacks: pl.Callback, batches: int = BATCHES) -> pl.Trainer:
    args = {**TRAINER_ARGS, "accelerator": DEVICE}
    return pl.Trainer(**args, limit_train_batches=batches, limit_predict_batches=batches, callbacks=list(callbacks))


class Quiet(Wrapped):
    """Keeps no copy of the gradients: on CUDA every live tensor counts, and an estimate counts only the step."""

    def on_after_backward(self) -> None:
        pass


def on_device(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(DEVICE) for k, v in batch.items()}


def largest_difference(a: list[torch.Tensor] | dict[str, torch.Tensor], b: Any) -> float:
    pairs = zip(a.values(), b.values(), strict=True) if isinstance(a, dict) else zip(a, b, strict=True)
    return max((float((x.double().cpu() - y.double().cpu()).abs().max()) for x, y in pairs), default=0.0)


# fit: the same losses, gradients and weights ------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["llama", "unet2d"])
def test_fit_gives_the_same_losses_gradients_and_weights(case: str) -> None:
    plain = Wrapped(case)
    trainer().fit(plain)
    model, memopt = Wrapped(case), MemOpt()
    trainer(memopt).fit(model)

    weights = {k: v for k, v in model.net.state_dict().items() if v.is_floating_point()}
    plain_weights = {k: plain.net.state_dict()[k] for k in weights}
    record(
        "fit",
        case,
        {
            "applied": [f"{a.technique}: {a.method}" for a in memopt.applied],
            "losses": model.losses,
            "loss_max_abs_diff": max(abs(a - b) for a, b in zip(model.losses, plain.losses, strict=True)),
            "grad_max_abs_diff": max(largest_difference(a, b) for a, b in zip(model.grads, plain.grads, strict=True)),
            "weight_max_abs_diff": largest_difference(weights, plain_weights),
        },
    )
    assert memopt.applied and memopt.applied[0].technique == "checkpointing"
    assert len(model.losses) == len(plain.losses) == len(model.grads) == len(plain.grads) == BATCHES
    torch.testing.assert_close(torch.tensor(model.losses), torch.tensor(plain.losses), rtol=1e-5, atol=1e-6)
    for step, (grads, plain_grads) in enumerate(zip(model.grads, plain.grads, strict=True)):
        assert grads.keys() == plain_grads.keys() and grads
        for name in grads:
            torch.testing.assert_close(grads[name], plain_grads[name], **TOL, msg=f"step {step}: {name}")
    for name in weights:
        torch.testing.assert_close(weights[name], plain_weights[name], **TOL, msg=name)


class AdamWQuiet(Quiet):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)


@pytest.mark.parametrize("case", ["llama", "unet2d"])
def test_the_optimizer_step_in_the_backward_pass_gives_plain_adamws_weights(case: str) -> None:
    """On CUDA AdamW steps every parameter with one multi-tensor (foreach) kernel; stepped one parameter at a time it
    runs the same arithmetic per tensor. The weights after the steps, and each configuration's allocator peaks."""
    runs = {}
    for name, callbacks in (("plain", []), ("in backward", [MemOpt(optimizer_in_backward=True)])):
        baseline = settle()
        model, meter = AdamWQuiet(case), Meter(baseline)
        trainer(*callbacks, meter).fit(model)
        runs[name] = (model, [b["allocated"] for b in meter.batches])
    (plain, plain_peaks), (stepped, stepped_peaks) = runs.values()
    weights = {k: v for k, v in stepped.net.state_dict().items() if v.is_floating_point()}
    plain_weights = {k: plain.net.state_dict()[k] for k in weights}
    record(
        "optimizer_in_backward",
        case,
        {
            "weight_max_abs_diff": largest_difference(weights, plain_weights),
            "loss_max_abs_diff": max(abs(a - b) for a, b in zip(stepped.losses, plain.losses, strict=True)),
            "plain_allocated_peaks": plain_peaks,
            "in_backward_allocated_peaks": stepped_peaks,
        },
    )
    for name in weights:
        torch.testing.assert_close(weights[name], plain_weights[name], **TOL, msg=name)
    assert max(stepped_peaks[1:]) < max(plain_peaks[1:])  # a later step: the gradients never all exist


# predict: the same outputs with chunking and decode slicing ---------------------------------------------------------


def vae_decode() -> DecodeLatents:
    """The tiny VAE decoding latents of 24x24, 4 a batch (as ``tests/test_decoding.py``)."""
    torch.manual_seed(0)
    latents = torch.randn(8, 4, 24, 24, generator=torch.Generator().manual_seed(0))
    return DecodeLatents(zoo.vae(), latents, batch_size=4)


PREDICT: dict[str, tuple[Any, dict[str, Any], str]] = {
    # name: (the LightningModule, MemOpt's arguments, the technique that must be applied)
    "llama": (lambda: Wrapped("llama"), {"chunk_size": 4}, "chunking"),
    "dit": (lambda: Wrapped("dit"), {"chunk_size": 2}, "chunking"),
    "vae_decode": (vae_decode, {}, "decoding"),
}


@pytest.mark.parametrize("case", list(PREDICT))
def test_predict_gives_the_same_outputs(case: str) -> None:
    build, options, technique = PREDICT[case]
    plain = trainer().predict(build())
    memopt = MemOpt(**options)
    outputs = trainer(memopt).predict(build())

    record(
        "predict",
        case,
        {
            "applied": [f"{a.technique}: {a.method}" for a in memopt.applied],
            "chunk_settings": memopt.report.chunk_settings,
            "decoding": memopt.report.decoding,
            "max_abs_diff": largest_difference(outputs, plain),
        },
    )
    assert any(a.technique == technique for a in memopt.applied), memopt.applied
    assert len(outputs) == len(plain) > 0
    for a, b in zip(outputs, plain, strict=True):
        torch.testing.assert_close(a, b, **PREDICT_TOL)


# a budget holds from the first batch --------------------------------------------------------------------------------


@pytest.mark.parametrize(("case", "checkpointing"), [("llama_long", "auto"), ("unet2d", "auto"), ("llama_long", True)])
def test_a_budget_holds_from_the_first_batch(case: str, checkpointing: bool | str) -> None:
    """B halfway between the dry runs' peaks of the step with every block checkpointed and of the plain step."""
    model = Quiet(case).to(DEVICE)
    dry = estimate(model, on_device(next(iter(model.train_dataloader()))), "fit")
    del model
    assert dry.plain.bytes is not None and dry.memopt.bytes is not None, dry.notes
    budget = dry.memopt.bytes + (dry.plain.bytes - dry.memopt.bytes) // 2

    meter = Meter(settle())
    memopt = MemOpt(checkpointing=checkpointing, memory_budget=budget)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(memopt, meter).fit(Quiet(case))

    over = [str(w.message) for w in caught if "over the budget" in str(w.message)]
    figures = {
        "budget": budget,
        "dry_plain": dry.plain.bytes,
        "dry_checkpointed": dry.memopt.bytes,
        "applied": [f"{a.technique}: {a.method}" for a in memopt.applied],
        "checkpointed": memopt.report.checkpointed,
        "batches": meter.batches,
        "requested_minus_budget": [b["requested"] - budget for b in meter.batches],
        "allocated_minus_budget": [b["allocated"] - budget for b in meter.batches],
        "memopt_measured_peak": memopt.report.peak_bytes,  # MemOpt's own figure: everything on the device
        "memopt_warned_over_budget": over,
    }
    record("budget", f"{case}-{checkpointing}", figures)
    assert len(meter.batches) == BATCHES
    for index, batch in enumerate(meter.batches):
        assert batch["requested"] <= budget, (index, batch, budget)
        assert batch["allocated"] <= budget + BLOCK * batch["allocations"], (index, batch, budget)


# the dry run's peak against the real step's ------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["llama_long", "unet2d"])
def test_the_dry_runs_peak_against_the_real_step(case: str) -> None:
    model = Quiet(case).to(DEVICE)
    dry = estimate(model, on_device(next(iter(model.train_dataloader()))), "fit")
    del model
    assert dry.plain.bytes is not None and dry.memopt.bytes is not None, dry.notes

    checks = []
    for config, expected in (("plain", dry.plain.bytes), ("memopt", dry.memopt.bytes)):
        meter = Meter(settle())
        callbacks = [MemOpt(measure=False), meter] if config == "memopt" else [meter]
        trainer(*callbacks, batches=2).fit(Quiet(case))
        real = meter.batches[1]  # the second step: last step's gradients alive, as the estimate counts them
        tolerance = BLOCK * real["allocations"] + int(ESTIMATE_SLACK * expected) if ON_CUDA else 0
        checks.append((config, expected, real, tolerance))
        record(
            "estimate",
            f"{case}-{config}",
            {
                "dry": expected,
                "where": (dry.plain if config == "plain" else dry.memopt).where,
                "how": dry.how if config == "memopt" else "plain",
                **real,
                "allocated_minus_dry": real["allocated"] - expected,
                "requested_minus_dry": real["requested"] - expected,
                "allocated_minus_dry_fraction": (real["allocated"] - expected) / expected,
                "tolerance": tolerance,
                "first_step": meter.batches[0],
            },
        )
    for config, expected, real, tolerance in checks:
        assert abs(real["allocated"] - expected) <= tolerance, (config, expected, real, tolerance)


# lossy: the weights and the optimizer state in 8 bits, with bitsandbytes' CUDA kernels ------------------------------

LOSSY_CASES = ["weights_8bit-fit", "weights_8bit-predict", "optimizer_state_8bit-fit"]


@pytest.mark.parametrize("case", LOSSY_CASES)
def test_the_8_bit_techniques_lower_the_peak_and_stay_near_the_exact_run(case: str) -> None:
    """Each 8-bit technique against MemOpt's exact run (chunking off in both: its choice follows the measured speeds):
    the allocator's peaks, the estimate's, the largest difference of the losses or outputs, and for the weights that
    every parameter comes back exactly."""
    pytest.importorskip("bitsandbytes")
    from tests.test_weights8bit import Latte, LoRALlama

    option, stage = case.split("-")
    make = {"weights_8bit-fit": LoRALlama, "weights_8bit-predict": Latte}.get(case, lambda: AdamWQuiet("llama"))
    runs = {}
    for name, options in (("exact", {}), ("lossy", {option: True, "lossy": True})):
        meter, model = Meter(settle()), make()
        given = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
        run = trainer(MemOpt(measure=False, chunking=False, **options), meter)
        outputs = run.fit(model) if stage == "fit" else run.predict(model)
        results = model.losses if stage == "fit" else [o.detach().cpu() for o in outputs]
        runs[name] = (model, results, [b["allocated"] for b in meter.batches], given)
    model = make().to(DEVICE)
    batch = next(iter(model.train_dataloader() if stage == "fit" else model.predict_dataloader()))
    dry = estimate(model, on_device(batch), stage, chunking=False, **{option: True, "lossy": True})
    del model
    (_, exact, exact_peaks, _), (lossy_model, lossy, lossy_peaks, given) = runs.values()
    if stage == "fit":
        difference = max(abs(a - b) / abs(b) for a, b in zip(lossy, exact, strict=True))
    else:
        difference = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(lossy, exact, strict=True))
    unchanged = [
        n for n, p in lossy_model.named_parameters() if not p.requires_grad and not torch.equal(p.cpu(), given[n])
    ]
    record(
        "lossy",
        case,
        {
            "exact_allocated_peaks": exact_peaks,
            "lossy_allocated_peaks": lossy_peaks,
            "lossy_dry": dry.memopt.bytes,
            "allocated_minus_dry": lossy_peaks[-1] - (dry.memopt.bytes or 0),
            "largest_relative_difference": difference,
            "frozen_weights_changed": unchanged,
        },
    )
    assert max(lossy_peaks[1:]) < max(exact_peaks[1:])
    assert difference < 0.05
    if option == "weights_8bit":
        assert not unchanged
