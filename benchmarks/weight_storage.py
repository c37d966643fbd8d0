"""Weights stored small, computed in their own type one layer at a time: diffusers' layerwise casting (float8) against
``weights_8bit``'s blockwise 8-bit codes and its NF4 codes (``weights_8bit="nf4"``; bitsandbytes), side by side in one
process, on CPU.

    python -m benchmarks.weight_storage                  # on CPU, one thread: about 2 minutes
    python -m benchmarks.weight_storage --repeats 1 --out /tmp/t   # one timed step per way, to try it

Two models built from configs: a bfloat16 Llama with a PEFT LoRA adapter, one training step (forward and backward);
a float32 Latte transformer at inference. Four ways each: ``plain``; diffusers' ``apply_layerwise_casting(model,
storage_dtype=torch.float8_e4m3fn, compute_dtype=<the model's type>)`` with its default skipped modules (on the LoRA
Llama in three variants: on the LoRA model, the adapter cast too; on it with ``"lora_"`` skipped; before the adapter
is added); and the mechanics of ``weights_8bit``: every layer for which ``storable(name, module, trainable)`` is
``None`` stored through ``StoredWeight`` in 8 bits, and again in 4 (restored after). Per way: the bytes of the weights
as stored, the exact CPU peak of the step, its median time and the largest relative differences from plain's output
(at fit, also loss and LoRA gradients); and whether MemOpt's dry run (``estimate``) runs on the model so changed, and
with which figure.
First, the three formats alone on one weight: bytes per value, time to store and to put back, error.

Writes ``<out>/weight_storage.json`` and ``<out>/weight_storage.md``; asserts nothing about figures. Exits with status
1 if ``plain`` or ``weights_8bit``'s way raised (diffusers' failures are findings, recorded). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.metadata
import logging
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from benchmarks.harness import write_results
from lightning_memopt import PeakMemory, estimate
from lightning_memopt.memory import CPUPeakTracker
from lightning_memopt.techniques.weights.core import Host, StoredWeight, storable
from tests import zoo

warnings.filterwarnings("ignore")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FP8 = torch.float8_e4m3fn
#: MemOpt's own techniques off in the dry run: its ``plain`` figure is the step of the model as each way left it.
DRY_RUN = dict(checkpointing=False, chunked_loss=False, chunking=False)
LLAMA = dict(
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=1000,
)
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)  # B random: both train
#: Latte at inference: 4 heads of 64 (hidden 256, every attention and feed-forward layer >= 65,536 weights)
LATTE = dict(
    num_attention_heads=4,
    attention_head_dim=64,
    cross_attention_dim=256,
    caption_channels=64,
    sample_size=16,
    video_length=4,
    num_layers=2,
)


def log(message: str) -> None:
    print(f"[weight_storage] {message}", flush=True)


# the ways ------------------------------------------------------------------------------------------------------------


@dataclass
class Way:
    """A model changed one way: the model, the layers changed, what puts it back (if anything), and notes."""

    model: nn.Module
    layers: int = 0
    weight_difference: float | None = None  # the largest difference of a stored value, relative to its layer's largest
    host_bytes: int = 0  # the originals kept off the model (weights_8bit: a temporary file on CPU)
    undo: Callable[[], None] | None = None


def layerwise(model: nn.Module, dtype: torch.dtype, skip: tuple[str, ...] | None = None) -> Way:
    """diffusers' layerwise casting: the weights of every Linear, Conv and Embedding not skipped by name stored in
    float8 e4m3, cast to ``dtype`` before each call and back after it. Not reversible (its hook's
    ``deinitalize_hook`` raises)."""
    from diffusers.hooks import apply_layerwise_casting
    from diffusers.hooks._common import _GO_LC_SUPPORTED_PYTORCH_LAYERS
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

    pattern = DEFAULT_SKIP_MODULES_PATTERN + (skip or ())
    given = {
        n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, _GO_LC_SUPPORTED_PYTORCH_LAYERS)
    }
    apply_layerwise_casting(model, storage_dtype=FP8, compute_dtype=dtype, skip_modules_pattern=pattern)
    cast = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, _GO_LC_SUPPORTED_PYTORCH_LAYERS) and m.weight.dtype == FP8
    ]
    difference = max((_relative(m.weight, given[name]) for name, m in cast if name in given), default=None)
    return Way(model, layers=len(cast), weight_difference=difference)


def stored_8bit(model: nn.Module, trainable: bool, bits: int = 8) -> Way:
    """``weights_8bit``'s mechanics: every layer ``storable`` accepts stored in blockwise 8 bits (bitsandbytes'
    dynamic map, 256 values a block) or, with ``bits=4``, in NF4 (64 values a block, ``weights_8bit="nf4"``), its
    original kept in a temporary file; ``undo`` puts every one back."""
    host = Host()
    units = [StoredWeight(n, m) for n, m in model.named_modules() if storable(n, m, trainable) is None]
    for unit in units:
        unit.store(host, bits)

    def undo() -> None:
        for unit in units:
            unit.restore()
        host.close()

    difference = max((u.difference for u in units), default=None)
    kept = sum(u.host.untyped_storage().nbytes() for u in units)
    return Way(model, layers=len(units), weight_difference=difference, host_bytes=kept, undo=undo)


def _relative(stored: torch.Tensor, given: torch.Tensor) -> float:
    largest = given.abs().max().float().item()
    return (stored.float() - given.float()).abs().max().item() / largest if largest else 0.0


# the workloads ------------------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """A model and its step: ``ways`` makes each way's model from the same weights; ``step`` runs one step and
    returns the output, the loss and the trainable parameters' gradients (``None`` at predict)."""

    name: str
    stage: str
    what: str
    ways: dict[str, tuple[str, Callable[[], Way]]]
    step: Callable[[nn.Module], tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]]
    batch: dict[str, torch.Tensor]
    module: Callable[[nn.Module], pl.LightningModule]
    steps_per_repeat: int = 1  # timed steps per repeat: more for a short step, whose time is noisier


def llama_workload() -> Workload:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**LLAMA)).to(torch.bfloat16).requires_grad_(False)
    torch.manual_seed(1)
    reference = get_peft_model(copy.deepcopy(base), LoraConfig(**LORA))
    ids = torch.randint(0, LLAMA["vocab_size"], (1, 256), generator=torch.Generator().manual_seed(2))

    def lora_after_casting() -> Way:
        way = layerwise(copy.deepcopy(base), torch.bfloat16)
        torch.manual_seed(1)
        way.model = get_peft_model(way.model, LoraConfig(**LORA))
        given = dict(reference.named_parameters())
        with torch.no_grad():  # the same adapter as the others (its own init saw float8 base layers)
            for name, param in way.model.named_parameters():
                if param.requires_grad:
                    param.copy_(given[name])
        return way

    ways = {
        "plain": ("plain", lambda: Way(copy.deepcopy(reference))),
        "layerwise": ("layerwise fp8, LoRA added after casting", lora_after_casting),
        "layerwise_default": (
            "layerwise fp8 on the LoRA model, default skips (the adapter cast too)",
            lambda: layerwise(copy.deepcopy(reference), torch.bfloat16),
        ),
        "layerwise_skip_lora": (
            'layerwise fp8 on the LoRA model, `"lora_"` skipped',
            lambda: layerwise(copy.deepcopy(reference), torch.bfloat16, skip=("lora_",)),
        ),
        "8bit": ("weights_8bit (blockwise 8-bit)", lambda: stored_8bit(copy.deepcopy(reference), trainable=False)),
        "nf4": ('weights_8bit="nf4" (4-bit NF4)', lambda: stored_8bit(copy.deepcopy(reference), False, bits=4)),
    }

    def step(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return out.logits.detach(), out.loss.detach(), grads

    class Fit(pl.LightningModule):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch["ids"], labels=batch["ids"]).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader([{"ids": ids}] * 2, batch_size=None)

    what = (
        f"`LlamaForCausalLM(LlamaConfig({', '.join(f'{k}={v}' for k, v in LLAMA.items())}))` in bfloat16, frozen, "
        "with PEFT `LoraConfig(r=8, lora_alpha=16, target_modules=['q_proj', 'v_proj'], init_lora_weights=False)` "
        "(its adapters float32, as PEFT keeps them); one training step, forward and backward, on 1 x 256 tokens"
    )
    return Workload("llama_lora", "fit", what, ways, step, {"ids": ids}, Fit)


def latte_workload() -> Workload:
    torch.manual_seed(0)
    base = zoo.latte(**LATTE).eval()
    g = torch.Generator().manual_seed(2)
    frames, res = LATTE["video_length"], LATTE["sample_size"]
    batch = {"x": torch.randn(2, 4, frames, res, res, generator=g), "c": torch.randn(2, 8, 64, generator=g)}

    def forward(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        t = torch.full((len(b["x"]),), 500, dtype=torch.long)
        return model(b["x"], timestep=t, encoder_hidden_states=b["c"]).sample

    def step(model: nn.Module) -> tuple[torch.Tensor, None, dict[str, torch.Tensor]]:
        with torch.no_grad():
            return forward(model, batch), None, {}

    class Predict(pl.LightningModule):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def predict_step(self, b: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return forward(self.model, b)

        def predict_dataloader(self) -> Any:
            return torch.utils.data.DataLoader([batch] * 2, batch_size=None)

    ways = {
        "plain": ("plain", lambda: Way(copy.deepcopy(base))),
        "layerwise": ("layerwise fp8 (default skips)", lambda: layerwise(copy.deepcopy(base), torch.float32)),
        "8bit": ("weights_8bit (blockwise 8-bit)", lambda: stored_8bit(copy.deepcopy(base), trainable=True)),
        "nf4": ('weights_8bit="nf4" (4-bit NF4)', lambda: stored_8bit(copy.deepcopy(base), True, bits=4)),
    }
    what = (
        f"diffusers `LatteTransformer3DModel` (the zoo's, with {', '.join(f'{k}={v}' for k, v in LATTE.items())}) in "
        f"float32; one denoising forward at inference (`torch.no_grad`) on 2 videos of {frames} frames of {res}x{res} "
        "latents, 8 caption tokens"
    )
    return Workload("latte", "predict", what, ways, step, batch, Predict, steps_per_repeat=5)


WORKLOADS: dict[str, Callable[[], Workload]] = {"llama_lora": llama_workload, "latte": latte_workload}


def kernels(repeats: int) -> dict[str, Any]:
    """The two storage formats alone, on 1,048,576 values (a 1024 x 1024 weight, normal with std 0.02, as a Llama's
    initialised): bytes per value, the time to store and to put back in the weight's type (median of ``repeats``
    calls), and the error, the largest and the root mean square, each relative to the weight's own."""
    from lightning_memopt.techniques.lossy import dequantize, dequantize_nf4, quantize, quantize_nf4

    def store(fmt: str, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if fmt == "NF4":
            return quantize_nf4(x)
        return (x.to(FP8),) if fmt == "float8_e4m3fn" else quantize(x, signed=True)

    def load(fmt: str, y: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        if fmt == "NF4":
            return dequantize_nf4(*y, torch.Size((1024, 1024)), dtype)
        return y[0].to(dtype) if fmt == "float8_e4m3fn" else dequantize(*y, True, dtype)

    def timed(call: Callable[[], Any]) -> float:
        seconds = []
        for _ in range(repeats):
            began = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - began)
        return statistics.median(seconds) * 1e3

    found: dict[str, Any] = {}
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(1024, 1024, generator=torch.Generator().manual_seed(3)) * 0.02).to(dtype)
        for fmt in ("float8_e4m3fn", "blockwise 8-bit", "NF4"):
            y = store(fmt, x)
            error = load(fmt, y, dtype).float() - x.float()
            found[f"{fmt}, {str(dtype).removeprefix('torch.')}"] = {
                "bytes_per_value": sum(t.untyped_storage().nbytes() for t in y) / x.numel(),
                "store_ms": timed(functools.partial(store, fmt, x)),
                "load_ms": timed(functools.partial(load, fmt, y, dtype)),
                "max_error": error.abs().max().item() / x.float().abs().max().item(),
                "rms_error": error.square().mean().sqrt().item() / x.float().square().mean().sqrt().item(),
            }
    return found


# measuring ----------------------------------------------------------------------------------------------------------


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:400]


def storage_bytes(model: nn.Module) -> int:
    """The bytes of the model's parameters and buffers as stored: each distinct storage once."""
    seen: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def peak(model: nn.Module, w: Workload) -> tuple[int, dict[str, int]]:
    """The exact CPU peak of one step: the weights and the batch counted from the start, the gradients as they come."""
    model.zero_grad(set_to_none=True)
    with CPUPeakTracker() as tracker:
        tracker.add([*model.parameters(), *model.buffers()], "weights")
        tracker.add(w.batch.values(), "batch")
        handles = tracker.gradients_of(model.parameters())
        w.step(model)
    for handle in handles:
        handle.remove()
    model.zero_grad(set_to_none=True)
    return tracker.peak, dict(tracker.at_peak)


def difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference, relative to the largest absolute value of ``b`` (plain's)."""
    return (a.float() - b.float()).abs().max().item() / b.float().abs().max().item()


def dry_run(model: nn.Module, w: Workload) -> dict[str, Any]:
    """MemOpt's dry run (``estimate``, its own techniques off) of the LightningModule holding the changed model, and
    where it gives a figure, the real step it stands for: the second batch of a Lightning run under ``PeakMemory``
    (at fit SGD steps the adapter: run last)."""
    try:
        found = estimate(w.module(model), w.batch, w.stage, **DRY_RUN)
    except Exception as error:
        return {"estimate_bytes": None, "estimate_error": _error(error)}
    row = {"estimate_bytes": found.plain.bytes, "estimate_notes": found.notes, "estimate_s": found.seconds}
    if found.plain.bytes is None:
        return row
    probe, off = PeakMemory(), dict(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, enable_model_summary=False, callbacks=[probe], **off
    )
    try:
        (trainer.fit if w.stage == "fit" else trainer.predict)(w.module(model))
        row["lightning_peak_bytes"] = probe.peaks[-1]
    except Exception as error:
        row["lightning_error"] = _error(error)
    return row


def measure(w: Workload, repeats: int) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    models: dict[str, Way] = {}
    reference: tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]] | None = None
    for key, (label, make) in w.ways.items():
        row = rows[key] = {"label": label, "seconds": [], "errors": []}
        try:
            way = make()
            row.update(layers=way.layers, weight_difference=way.weight_difference, host_bytes=way.host_bytes)
            row["stored_bytes"] = storage_bytes(way.model)
            row["peak_bytes"], row["at_peak"] = peak(way.model, w)
            out, loss, grads = w.step(way.model)
        except Exception as error:  # recorded: this way is left out of the timing
            row["errors"].append(_error(error))
            log(f"  {w.name} {key} failed: {row['errors'][-1]}")
            continue
        if reference is None:
            reference = out, loss, {n: g.clone() for n, g in grads.items()}
        else:
            row["output_difference"] = difference(out, reference[0])
            if loss is not None and reference[1] is not None:
                row["loss_difference"] = abs(loss.item() - reference[1].item()) / abs(reference[1].item())
            if reference[2]:
                common = [n for n in reference[2] if n in grads]
                row["grad_difference"] = max(difference(grads[n], reference[2][n]) for n in common)
                row["grad_dtypes"] = sorted({str(grads[n].dtype) for n in common})
                if len(common) < len(reference[2]):
                    row["errors"].append(f"{len(reference[2]) - len(common)} LoRA parameters got no gradient")
        row["trained_dtypes"] = sorted({str(p.dtype) for p in way.model.parameters() if p.requires_grad})
        models[key] = way
        log(f"  {w.name} {key}: {row['layers']} layers, {row['stored_bytes']:,} B stored, peak {row['peak_bytes']:,} B")
    # time: one untimed round, then ``repeats`` timed ones, round-robin, each round starting one way later
    keys = list(models)
    for r in range(repeats * w.steps_per_repeat + 1):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            began = time.perf_counter()
            w.step(models[key].model)
            if r:
                rows[key]["seconds"].append(time.perf_counter() - began)
    for key, way in models.items():
        rows[key].update(dry_run(way.model, w))
        if way.undo is not None:  # every frozen weight back, exactly (the Lightning fit stepped the adapter)
            way.undo()
            given = dict(w.ways["plain"][1]().model.named_parameters())
            frozen = [(p, given[n]) for n, p in way.model.named_parameters() if not p.requires_grad]
            rows[key]["restored_exactly"] = all(p.dtype == q.dtype and torch.equal(p, q) for p, q in frozen)
    plain = rows["plain"]
    for row in rows.values():
        if row["seconds"]:
            row["median_s"], row["min_s"] = statistics.median(row["seconds"]), min(row["seconds"])
        for what in ("stored_bytes", "peak_bytes", "median_s", "min_s", "estimate_bytes"):
            if row.get(what) and plain.get(what):
                row[f"{what}_over_plain"] = row[what] / plain[what]
        if row.get("estimate_bytes") and row.get("lightning_peak_bytes"):
            row["estimate_over_real"] = row["estimate_bytes"] / row["lightning_peak_bytes"]
    return {"stage": w.stage, "what": w.what, "ways": rows}


# results -----------------------------------------------------------------------------------------------------------


def _f(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    load = [", ".join(f"{x:.1f}" for x in meta[k]) for k in ("load_average_start", "load_average_end")]
    versions = ", ".join(f"{p} {meta['versions'][p]}" for p in meta["versions"])
    lines = [
        "# Weights stored small: diffusers' layerwise casting (float8) against weights_8bit (blockwise 8-bit, NF4)",
        "",
        f"On CPU, {meta['threads']} thread(s), {versions}; {meta['wall_s']:.0f} s in all, at commit "
        f"{meta['git'] or 'unknown'}. Generated by `benchmarks/weight_storage.py` (see benchmarks/README.md). Load "
        f"average {load[0]} at the start, {load[1]} at the end (1, 5, 15 min, on {meta['cpus']} CPUs): times are "
        "rough.",
        "",
        "**Stored**: the bytes of the model's parameters and buffers as each way leaves them, each storage once "
        "(weights_8bit: the codes, the scales and each stored weight's one-value stand-in; its originals are kept "
        "off the model, on CPU in a temporary file, to be put back exactly: `host` below). **Peak**: the exact CPU "
        "count of `CPUPeakTracker` over one step, the weights and batch counted from the start. **Time**: the median "
        f"of {meta['repeats']} timed steps (x 5 at predict, a shorter step) after an untimed one, the ways "
        "interleaved round-robin in one process; in "
        "brackets the fastest over plain's fastest. **Differences**, relative: the largest absolute difference from "
        "plain's, over plain's largest absolute value (output: the logits at fit, the sample at predict; LoRA "
        "gradients: the largest over the adapter's tensors, each against its own largest); weights: the largest "
        "difference of a stored value from its original, over its layer's largest. **Dry run**: `estimate(module, "
        "batch, stage, checkpointing=False, chunked_loss=False, chunking=False)` on a LightningModule holding the "
        "changed model, its `plain` figure over the real peak of the step it stands for: the second batch of a "
        "Lightning run of the same module under `PeakMemory` (at fit: `training_step`, backward and SGD's step on the "
        "adapter; 1.0000 is to the byte). Layerwise casting's weights, cast anew at each call, count as activations "
        "in `at_peak` (JSON); the totals are right.",
    ]
    lines += [
        "",
        "## The formats alone",
        "",
        "A 1024 x 1024 weight (normal, std 0.02): bytes per value as stored, the milliseconds to store it and to put "
        "it back in its type (median of 21 calls, one thread), and the error of the values put back, the largest "
        "and the root mean square, each over the weight's own (largest absolute value, root mean square).",
        "",
        "| format, weight type | bytes / value | store ms | back ms | largest error | rms error |",
        "|---|---|---|---|---|---|",
        *(
            f"| {name} | {k['bytes_per_value']:.4f} | {k['store_ms']:.2f} | {k['load_ms']:.2f} | "
            f"{k['max_error']:.2e} | {k['rms_error']:.2e} |"
            for name, k in results.get("kernels", {}).items()
        ),
    ]
    for name, data in results["workloads"].items():
        lines += ["", f"## {name} ({data.get('stage', '?')})", ""]
        if "error" in data:
            lines += [f"Failed: {data['error']}"]
            continue
        fit = data["stage"] == "fit"
        lines += [
            data["what"] + ".",
            "",
            "| way | layers | stored (x plain) | peak (x plain) | time (x plain) | output | "
            + ("loss | LoRA grads | " if fit else "")
            + "weights | dry run / real |",
            "|---|---|---|---|---|---|" + ("---|---|" if fit else "") + "---|---|",
        ]
        failures = []
        for key, row in data["ways"].items():
            if row["errors"] and "peak_bytes" not in row:
                failures.append(f"- **{row['label']}**: `{row['errors'][0]}`")
                lines.append(f"| {row['label']} | {row.get('layers', 'n/a')} | failed, below |" + " |" * (5 + 2 * fit))
                continue
            stored = f"{row['stored_bytes'] / 2**20:.2f} MiB ({_f(row.get('stored_bytes_over_plain'), '.3f')})"
            if row.get("host_bytes"):
                stored += f", host {row['host_bytes'] / 2**20:.2f} MiB"
            cells = [
                row["label"],
                str(row.get("layers", "")),
                stored,
                f"{row['peak_bytes'] / 2**20:.2f} MiB ({_f(row.get('peak_bytes_over_plain'), '.3f')})",
                f"{_f(row.get('median_s') and row['median_s'] * 1e3, '.1f')} ms "
                f"({_f(row.get('median_s_over_plain'), '.3f')}; {_f(row.get('min_s_over_plain'), '.3f')})",
                _f(row.get("output_difference"), ".2e"),
                *([_f(row.get("loss_difference"), ".2e"), _f(row.get("grad_difference"), ".2e")] if fit else []),
                _f(row.get("weight_difference"), ".2e"),
                _f(row.get("estimate_over_real"), ".4f") if row.get("estimate_bytes") else "failed, below",
            ]
            lines.append("| " + " | ".join(cells) + " |")
            for error in row["errors"]:
                failures.append(f"- **{row['label']}**: {error}")
            if row.get("lightning_error"):
                failures.append(f"- **{row['label']}**, the real Lightning step: `{row['lightning_error']}`")
            if row.get("estimate_bytes") is None:
                why = row.get("estimate_error") or "; ".join(row.get("estimate_notes") or []) or "no figure"
                failures.append(f"- **{row['label']}**, dry run: `{why}`")
            if row.get("trained_dtypes") and fit and key != "plain":
                failures.append(
                    f"- {row['label']}: trainable parameters in {', '.join(row['trained_dtypes'])}, gradients in "
                    f"{', '.join(row.get('grad_dtypes') or ['n/a'])}"
                )
            if row.get("restored_exactly") is not None:
                failures.append(
                    f"- {row['label']}: every frozen weight back exactly, in its type, after `restore()`: "
                    f"{row['restored_exactly']}"
                )
        lines += ["", "Notes and failures:", "", *failures] if failures else []
    return "\n".join(lines) + "\n"


def write(results: dict[str, Any], out: Path, started: float) -> None:
    write_results("weight_storage", results, markdown, out, started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per way (after one untimed)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    try:  # the commit measured; a copy of the checkout without git has none
        git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    except OSError:
        git = subprocess.CompletedProcess([], 1, "")
    packages = ("torch", "diffusers", "transformers", "peft", "bitsandbytes", "lightning")
    meta = dict(
        threads=args.threads,
        repeats=args.repeats,
        cpus=os.cpu_count(),
        versions={p: importlib.metadata.version(p) for p in packages},
        load_average_start=os.getloadavg(),
        git=git.stdout.strip() or None,
    )
    started, results = time.perf_counter(), {"meta": meta, "workloads": {}}
    results["kernels"] = kernels(repeats=21)
    for name in args.workloads:
        log(name)
        try:
            results["workloads"][name] = measure(WORKLOADS[name](), args.repeats)
        except Exception as error:
            results["workloads"][name] = {"error": _error(error)}
        write(results, args.out, started)
    failed = [
        f"{n} {k}"
        for n, d in results["workloads"].items()
        for k, row in (d.get("ways") or {"all": {"errors": [d.get("error")]}}).items()
        if k in ("plain", "8bit", "nf4", "all") and row["errors"]
    ]
    if failed:
        log(f"failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
