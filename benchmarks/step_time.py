"""Step time where time means something on CPU: the comparison of ``recompute.py`` (whole-block counting, the planner,
the native switch, torch.compile's activation memory budget, at 5 budgets per workload) on workloads whose steps take
at least half a second on one CPU thread, and the Latte pipeline at predict under ``MemOpt`` and 5 budgets.

    python -m benchmarks.step_time --plots          # the whole run on CPU (9-13 minutes on 2 shared cores)
    python -m benchmarks.step_time --smoke          # tiny sizes, one budget, no compile: under a minute (CI)
    python -m benchmarks.step_time --device cuda    # on a GPU: the GPU sizes, peaks and times from the allocator and
                                               # synchronised clocks

Fit (a Llama and a UNet2DCondition with LoRA): the budgets, the modes counting and the planner choose and the real
training steps come from ``recompute.py`` (checkpointing alone in force: no chunked loss, no chunked feed-forward);
this script adds the loss and gradients of every configuration against plain's, torch.compile with the gradients
checked, the predicted step times where the planner gives them, and the time summary. Predict (Latte): plain, the
native switches, ``MemOpt()`` and ``MemOpt(memory_budget=B_k)`` run through Lightning as ``run.py`` runs them.

Results: ``<out>/time.json`` and ``<out>/time.md`` (``time_smoke.*`` for smoke), and with ``--plots``
``docs/images/time.png`` (on CPU; ``<out>/time[_smoke].png`` otherwise). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from benchmarks import recompute
from benchmarks.harness import Config, run
from benchmarks.recompute import (
    COMPILE_ORDER,
    FRACTIONS,
    MIB,
    ROOT,
    Setups,
    Trainer,
    batch_of,
    dry_runs,
    dynamo_counter,
    key_name,
    letters,
    log,
    mib_cell,
    mode_key,
    ratio_cell,
    real_steps,
    verdict_cell,
)
from benchmarks.suite import Result, peak_run
from benchmarks.workloads import WORKLOADS, Bench, Workload
from lightning_memopt import MemOpt
from lightning_memopt.adapters import find_models
from lightning_memopt.engine.changes import Changes
from lightning_memopt.engine.config import MemOptConfig
from tests import zoo

NAMES = ("llama", "unet2d_condition_lora", "latte")
RESULTS = Path(__file__).resolve().parent / "results"
DOCS_PLOT = ROOT / "docs" / "images" / "time.png"
#: Per suite: the workloads (smoke leaves the UNet out: its dry runs take seconds each, whatever its size), the
#: budgets run (k of 5), rounds x timed steps per configuration (one untimed step per visit first), the workloads
#: torch.compile runs on and its steps (each followed by a plain eager one); the seconds of compiling allowed per
#: workload are :data:`COMPILE_BOX_S`'s unless ``--compile-box`` says. The GPU suite is sized for the 240 s that
#: ``benchmarks/gpu.sh`` gives it: two rounds, a short compile box, the UNet (whose dry runs take longest) last; the
#: results are written after each workload, so that a run stopped at a time limit keeps what it measured.
SUITES: dict[str, dict[str, Any]] = {
    "smoke": {
        "workloads": ("llama", "latte"),
        "budgets": (2,),
        "rounds": 1,
        "steps": 1,
        "compile": (),
        "compile_steps": 0,
    },
    "cpu": {
        "workloads": NAMES,
        "budgets": (0, 1, 2, 3, 4),
        "rounds": 6,
        "steps": 2,
        "compile": ("llama",),
        "compile_steps": 3,
    },
    "gpu": {
        "workloads": ("llama", "latte", "unet2d_condition_lora"),
        "budgets": (0, 1, 2, 3, 4),
        "rounds": 2,
        "steps": 5,
        "compile": ("llama",),
        "compile_steps": 10,
    },
}
#: Seconds of compiling allowed per workload (the budgets in :data:`recompute.COMPILE_ORDER`; one that would likely
#: end past it is skipped, the reason recorded).
COMPILE_BOX_S = {"cpu": 150, "gpu": 45}
#: Why torch.compile is left out of a suite for a workload.
NOT_COMPILED = {
    ("cpu", "unet2d_condition_lora"): "a cold compile of this UNet took 253 s at budget 0 on this 2-core machine, "
    "too long for the run's 15 minutes",
    ("gpu", "unet2d_condition_lora"): "left out so that the GPU run stays well under 10 minutes (a cold compile of "
    "this UNet took 253 s on CPU)",
}
#: Relative difference of a loss from plain's over which the run exits with status 1 (eager configurations only;
#: compiled ones are reported, their kernels round differently).
LOSS_TOLERANCE = 1e-5
#: Checkpointing alone: the chunked loss and the feed-forward chunked at fit stay off, so that every configuration
#: computes the model's own loss as plain does and only the recomputation differs.
CHECKPOINTING_ONLY = MemOptConfig(chunked_loss=False, chunking=False)


# workloads ---------------------------------------------------------------------------------------------------------


def _llama(s: dict[str, int]) -> torch.nn.Module:
    return zoo.llama(
        s["layers"],
        s["hidden"],
        intermediate_size=s["intermediate"],
        vocab_size=s["vocab"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["heads"],
        max_position_embeddings=s["seq"],
    )


#: Sizes per suite: ``cpu`` makes a plain step take 0.5 s or more on one CPU thread (Llama 0.55-0.6 s, the UNet
#: 0.6-0.65 s, a Latte batch 0.6 s on this 2-core machine); ``gpu`` makes the tensors larger for an accelerator
#: with the same blocks (the dry runs, on the host's CPU, take as long as at ``cpu`` size). Not run here yet.
SIZES: dict[str, dict[str, dict[str, int]]] = {
    "llama": {
        "smoke": {"batch": 2, "seq": 32, "hidden": 32, "layers": 2, "intermediate": 64, "heads": 2, "vocab": 128},
        "cpu": {"batch": 2, "seq": 512, "hidden": 384, "layers": 4, "intermediate": 1152, "heads": 6, "vocab": 1024},
        "gpu": {"batch": 4, "seq": 2048, "hidden": 1024, "layers": 4, "intermediate": 2816, "heads": 16, "vocab": 1024},
    },
    "unet2d_condition_lora": {
        "smoke": WORKLOADS["unet2d_condition_lora"].sizes["smoke"],
        "cpu": {"batch": 24, "res": 16, "channels": 64, "layers": 1},
        "gpu": {"batch": 16, "res": 64, "channels": 64, "layers": 1},
    },
    "latte": {
        "smoke": WORKLOADS["latte"].sizes["smoke"],
        "cpu": {"batch": 2, "res": 64, "frames": 8, "head_dim": 16, "layers": 2},
        "gpu": {"batch": 2, "res": 64, "frames": 16, "head_dim": 32, "layers": 2},
    },
}


def workload(name: str) -> Workload:
    """The workload of ``workloads.py`` at this script's sizes; the Llama with a vocabulary and an MLP of its own."""
    w = WORKLOADS[name]
    if name == "llama":
        w = dataclasses.replace(
            w,
            build=_llama,
            sample=lambda g, s: {"ids": torch.randint(0, s["vocab"], (s["seq"],), generator=g)},
        )
    return dataclasses.replace(w, sizes=SIZES[name])


# fit: the step on a device, and agreement with plain ---------------------------------------------------------------


class DeviceTrainer(Trainer):
    """``recompute.Trainer`` on a device: on a GPU, times between synchronisations and peaks from the allocator
    (``max_memory_allocated`` after ``reset_peak_memory_stats``: everything allocated, inductor's buffers included);
    on CPU, as ``recompute.py`` measures. Also the loss and gradients of one forward and backward pass."""

    def __init__(self, bench: Bench, batch: dict[str, torch.Tensor], device: torch.device) -> None:
        self.device = device
        bench.to(device)
        super().__init__(bench, {k: v.to(device) for k, v in batch.items()})

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, model: Any = None) -> float:
        self.sync()
        started = time.perf_counter()
        self.step(model)
        self.sync()
        return time.perf_counter() - started

    def allocator_peak(self, model: Any = None) -> int:
        self.sync()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.step(model)
        self.sync()
        return torch.cuda.max_memory_allocated(self.device)

    def tracked_peak(self, model: Any = None) -> int:
        return self.allocator_peak(model) if self.device.type == "cuda" else super().tracked_peak(model)

    def profiled_peak(self, model: Any = None) -> int:
        return self.allocator_peak(model) if self.device.type == "cuda" else super().profiled_peak(model)

    def gradients(self, model: Any = None) -> tuple[float, dict[str, torch.Tensor]]:
        """The loss and every gradient of one forward and backward pass from the weights as they are (no optimizer
        step)."""
        loss = self.bench.workload.step(self.bench.runner if model is None else model, self.batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in self.bench.named_parameters() if p.grad is not None}
        return loss.item(), grads


def agreement(reference: tuple[float, dict[str, torch.Tensor]], found: tuple[float, dict[str, torch.Tensor]]) -> dict:
    """The loss's difference from the reference's (absolute and relative) and the largest absolute difference of any
    gradient, with the parameter it is in."""
    (loss, grads), (ref_loss, ref_grads) = found, reference
    if grads.keys() != ref_grads.keys():
        raise RuntimeError(f"other parameters have gradients: {sorted(grads.keys() ^ ref_grads.keys())[:4]}")
    worst = max(ref_grads, key=lambda n: (grads[n] - ref_grads[n]).abs().max().item())
    return {
        "loss": loss,
        "loss_abs_diff": abs(loss - ref_loss),
        "loss_rel_diff": abs(loss - ref_loss) / abs(ref_loss) if ref_loss else None,
        "grad_max_abs_diff": (grads[worst] - ref_grads[worst]).abs().max().item(),
        "grad_max_abs": max(g.abs().max().item() for g in ref_grads.values()),
        "grad_worst_parameter": worst,
    }


def agreements(setups: Setups, trainer: DeviceTrainer, keys: list[Any]) -> dict[str, dict]:
    """Every configuration's loss and gradients against plain's, all from the same weights."""
    with setups.use("plain"):
        reference = trainer.gradients()
    found = {}
    for key in keys:
        with setups.use(key):
            found[key_name(key)] = agreement(reference, trainer.gradients())
    return found


# fit: torch.compile ------------------------------------------------------------------------------------------------


def compile_unavailable(device: torch.device) -> str | None:
    """Why inductor cannot compile on this machine, or None: a tiny function compiled first."""
    try:
        torch._dynamo.reset()
        torch.compile(lambda x: torch.sin(x) + 1)(torch.ones(4, device=device))
    except Exception as error:
        return (
            f"inductor cannot compile here: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        )
    finally:
        torch._dynamo.reset()
    return None


def compile_at(setups: Setups, trainer: DeviceTrainer, k: int, steps: int) -> dict[str, Any]:
    """The plain model compiled under ``activation_memory_budget = k / 4``: its loss and gradients against the eager
    model's from the same weights (the first compiled pass compiles both graphs), one more step (compile time: both),
    then ``steps`` compiled steps each followed by a plain eager one, and the peak of one step."""
    import torch._functorch.config as functorch_config

    torch._dynamo.reset()
    hits = {c: dynamo_counter(*c) for c in (("inductor", "fxgraph_cache_hit"), ("aot_autograd", "autograd_cache_hit"))}
    try:
        with setups.use("plain"), functorch_config.patch(activation_memory_budget=FRACTIONS[k]):
            eager = trainer.gradients()
            compiled = torch.compile(trainer.bench.net)
            started = time.perf_counter()
            checked = agreement(eager, trainer.gradients(compiled))
            trainer.step(compiled)
            compile_s = time.perf_counter() - started
            pairs = [(trainer.timed(compiled), trainer.timed()) for _ in range(steps)]
            peak = trainer.profiled_peak(compiled)
    finally:
        torch._dynamo.reset()
    median, eager_median = (statistics.median(times) for times in zip(*pairs, strict=True))
    return {
        "k": k,
        "activation_memory_budget": FRACTIONS[k],
        "peak_bytes": peak,
        "compile_s": round(compile_s, 2),
        "cache_hits": {f"{g}.{c}": dynamo_counter(g, c) - before for (g, c), before in hits.items()},
        "step_times_s": [p[0] for p in pairs],
        "eager_plain_step_times_s": [p[1] for p in pairs],
        "median_step_s": median,
        "eager_plain_median_s": eager_median,
        "time_vs_plain": median / eager_median,
        "time_vs_plain_min": min(p[0] for p in pairs) / min(p[1] for p in pairs),
        "agreement": checked,
    }


def compiled_runs(setups: Setups, trainer: DeviceTrainer, budgets: dict[int, int], box: float, steps: int) -> dict:
    """:func:`compile_at` at each budget, in :data:`recompute.COMPILE_ORDER`, skipping one that would likely end past
    ``box`` seconds of compiling; on CPU the peak method (the profiler's allocation events) checked against the
    tracker's exact count on the plain eager step first."""
    result: dict[str, Any] = {"runs": [], "skipped": [], "error": None}
    if trainer.device.type == "cpu":
        with setups.use("plain"):
            tracker, profiler = trainer.tracked_peak(), trainer.profiled_peak()
        result["validation"] = {
            "tracker_bytes": tracker,
            "profiler_bytes": profiler,
            "difference_bytes": profiler - tracker,
        }
    spent, last = 0.0, 0.0
    for k in [k for k in COMPILE_ORDER if k in budgets]:
        if spent + max(last, 1.0) > box:
            result["skipped"].append({"k": k, "why": f"time box: {spent:.0f} s of {box:.0f} s spent compiling"})
            continue
        try:
            r = compile_at(setups, trainer, k, steps)
        except Exception as error:  # recorded, and no further budget tried
            result["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            log(f"  compile failed at budget {k}: {result['error']}")
            break
        r.update(budget_bytes=budgets[k], meets_budget=r["peak_bytes"] <= budgets[k])
        log(
            f"  compile budget {k}: {mib_cell(r['peak_bytes'])} MiB, {r['time_vs_plain']:.2f}x eager, "
            f"{r['compile_s']} s"
        )
        result["runs"].append(r)
        spent, last = spent + r["compile_s"], r["compile_s"]
    return result | {"runs": sorted(result["runs"], key=lambda r: r["k"])}


# fit: one workload -------------------------------------------------------------------------------------------------


def _prediction(choice: Any, wall: float) -> dict[str, Any]:
    """``recompute.figures`` with the planner's predicted step time where it gives one (``None`` until it does)."""
    return {**_FIGURES(choice, wall), "predicted_s": getattr(choice, "predicted_s", None)}


_FIGURES = recompute.figures


def error(predicted: float | None, real: float | None) -> float | None:
    """(predicted - real) / real, or None where either is unknown."""
    return None if predicted is None or not real else (predicted - real) / real


def largest(errors: list[float | None]) -> float | None:
    """The error of the largest magnitude, with its sign; None if none is known."""
    return max((e for e in errors if e is not None), key=abs, default=None)


def measure_fit(name: str, suite: str, plan: dict[str, Any], device: torch.device) -> dict[str, Any]:
    w = workload(name)
    torch.manual_seed(0)
    bench = Bench(w, suite)
    bench.train()
    trainer = DeviceTrainer(bench, batch_of(w, bench.size), device)
    notes: list[str] = []
    setups = Setups(bench, notes)
    setups.changes.remove()  # recompute.py's changes are every default technique's: checkpointing alone here
    setups.changes = Changes("fit", find_models(bench, None), CHECKPOINTING_ONLY, notes.append)
    setups.changes.apply(quiet=True)
    in_force = setups.changes.describe()
    try:
        with setups.use("plain"):
            trainer.step()  # gradients and optimizer state exist from here: every step is a later step
        data: dict[str, Any] = {
            "stage": "fit",
            "size": dict(bench.size),
            "blocks": setups.names,
            "in_force": in_force,
            "native": w.native_label,
            "parameters": sum(p.numel() for p in bench.parameters()),
            "trainable_parameters": sum(p.numel() for p in trainer.trainable),
            "live_bytes": trainer.live_bytes(),
            "notes": notes,
        }
        with setups.use(tuple(["full"] * len(setups.names))), mock.patch.object(recompute, "figures", _prediction):
            data.update(dry_runs(setups, trainer, plan["budgets"]))
        chosen = [(row, row[method]) for row in data["budgets"] for method in ("counting", "planner")]
        keys = list(dict.fromkeys(["plain", "native", *(mode_key(m["modes"], name) for _, m in chosen)]))
        log(f"  {len(keys)} configurations: {', '.join(key_name(k) for k in keys)}")
        checked = agreements(setups, trainer, keys)
        data["configs"] = configs = real_steps(setups, trainer, keys, plan["rounds"], plan["steps"])
        for key, c in configs.items():
            c["agreement"] = checked[key]
            c["time_vs_plain_min"] = min(c["step_times_s"]) / min(configs["plain"]["step_times_s"])
            log(f"  {key}: {c['median_step_s'] * 1000:.0f} ms, {c['time_vs_plain']:.2f}x plain")
        plain = configs["plain"]
        plain["predicted_s"] = data["none"]["predicted_s"]  # every block "none" runs as plain
        plain["predicted_error"] = error(plain["predicted_s"], plain["median_step_s"])
        for row, m in chosen:
            m["config"] = key_name(mode_key(m["modes"], name))
            c = configs[m["config"]]
            m.update({f: c[f] for f in ("real_peak_bytes", "median_step_s", "time_vs_plain", "time_vs_plain_min")})
            m["meets_budget"] = c["real_peak_bytes"] <= row["budget_bytes"]
            m["predicted_error"] = error(m["predicted_s"], c["median_step_s"])
            # the prediction over plain's, against the measured ratio: what load on the machine does not move
            known = m["predicted_s"] is not None and plain["predicted_s"]
            m["predicted_vs_plain"] = m["predicted_s"] / plain["predicted_s"] if known else None
            m["predicted_vs_plain_error"] = error(m["predicted_vs_plain"], c["time_vs_plain"])
        budgets = {row["k"]: row["budget_bytes"] for row in data["budgets"]}
        off = plan["compile_off"] or (
            None if name in plan["compile"] else NOT_COMPILED.get((suite, name), f"not in the {suite} suite")
        )
        if off is None:
            data["compile"] = compiled_runs(setups, trainer, budgets, plan["compile_box_s"], plan["compile_steps"])
        else:
            data["compile"] = {"runs": [], "skipped": [], "error": None, "not_run": off}
    finally:
        setups.close()
    data["summary"] = summarize_fit(data)
    return data


def overhead_ratio(rows: list[dict[str, Any]], figure: str) -> tuple[float | None, list[float | None]]:
    """The planner's time overhead over plain (``figure - 1``) averaged over the budgets, over counting's; and per
    budget (None where both run plain or counting's overhead is not above 0; 1.0 where both chose the same mix)."""
    overhead = {m: [r[m][figure] - 1 for r in rows] for m in ("counting", "planner")}
    per_budget = []
    for r, p, c in zip(rows, overhead["planner"], overhead["counting"], strict=True):
        same, both_plain = r["counting"]["config"] == r["planner"]["config"], r["counting"]["config"] == "plain"
        per_budget.append(None if same and both_plain else 1.0 if same else p / c if c > 0 else None)
    mean = statistics.mean(overhead["counting"])
    return (statistics.mean(overhead["planner"]) / mean if mean > 0 else None), per_budget


def summarize_fit(data: dict[str, Any]) -> dict[str, Any]:
    """The planner's time overhead over plain against counting's, the budgets met, the largest prediction error."""
    rows = data["budgets"]
    ratio, per_budget = overhead_ratio(rows, "time_vs_plain")
    runs = data["compile"]["runs"]
    chosen = [r[m] for r in rows for m in ("counting", "planner")]
    eager = [c["agreement"] for c in data["configs"].values()]
    return {
        "overhead_ratio": ratio,
        "overhead_ratio_goal_le_0_75": ratio is not None and ratio <= 0.75,
        "overhead_ratio_per_budget": per_budget,
        "overhead_ratio_of_fastest_steps": overhead_ratio(rows, "time_vs_plain_min")[0],
        "planner_le_counting_x_1_02_every_budget": all(
            r["planner"]["median_step_s"] <= r["counting"]["median_step_s"] * 1.02 for r in rows
        ),
        "planner_meets_every_budget": all(r["planner"]["meets_budget"] for r in rows),
        "counting_meets_every_budget": all(r["counting"]["meets_budget"] for r in rows),
        "compile_meets_every_budget": all(r["meets_budget"] for r in runs) if runs else None,
        "largest_predicted_error": largest([c["predicted_error"] for c in [*chosen, data["configs"]["plain"]]]),
        "largest_predicted_ratio_error": largest([c["predicted_vs_plain_error"] for c in chosen]),
        "max_loss_rel_diff": max(a["loss_rel_diff"] or 0.0 for a in eager),
        "max_grad_abs_diff": max(a["grad_max_abs_diff"] for a in eager),
        "compile_max_grad_abs_diff": max((r["agreement"]["grad_max_abs_diff"] for r in runs), default=None),
    }


# predict -----------------------------------------------------------------------------------------------------------


class Made:
    """A MemOpt factory for :class:`harness.Config` that keeps the instance it made last, to read its report."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs, self.last = kwargs, None

    def __call__(self) -> MemOpt:
        self.last = MemOpt(**self.kwargs)
        return self.last

    def predicted(self) -> float | None:
        """The time model's prediction of a step with the settings chosen: the report's ``predicted_step_s`` (or its
        figures'), None where there is none."""
        report = self.last.report if self.last is not None else None
        if report is None:
            return None
        found = getattr(report, "predicted_step_s", None)
        return found if found is not None else getattr(report.figures, "predicted_step_s", None)


def predict_configs(w: Workload, budgets: dict[int, int]) -> list[Config]:
    """Plain, the native switches and ``MemOpt()`` without ``budgets``;
    ``MemOpt(memory_budget=B_k)`` for each with. Every MemOpt runs with ``measure=False``, as in ``run.py``."""
    if budgets:
        return [
            Config(
                f"budget_{k}", f"MemOpt(memory_budget=B{k})", Made(memory_budget=b, measure=False), budget=b, tuned=True
            )
            for k, b in budgets.items()
        ]
    return [
        Config("plain", "plain"),
        Config("native", f"native: {w.native_label}", native=True),
        Config("memopt", "MemOpt()", Made(measure=False), tuned=True),
    ]


def measure_predict(name: str, suite: str, plan: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Peak runs (``suite.peak_run``: ``PeakMemory`` after MemOpt, one warm-up batch and one steady batch) of plain,
    native and ``MemOpt()``; the budgets from the lower of the last two peaks to plain's; a peak run of each budget;
    then the timing runs round-robin, each round starting one configuration later. (``MemOpt(memory_budget=1)``, the
    finest chunking, is left out: on the Latte at CPU size its dry runs took 85 s and it reached native's peak.)"""
    w = workload(name)
    bench = Bench(w, suite)
    results: dict[str, Result] = {}
    predicted: dict[str, list[float | None]] = {}

    def peaks(configs: list[Config]) -> None:
        for config in configs:
            results[config.name], r = peak_run(bench, config, device, 1)
            predicted[config.name] = [config.memopt.predicted()] if isinstance(config.memopt, Made) else []
            log(f"  peak {config.label}: {mib_cell(results[config.name].peak_bytes)} MiB {r.error or ''}")

    peaks(predict_configs(w, {}))
    plain = results["plain"].peak_bytes
    lowest = min(r.peak_bytes for n, r in results.items() if n != "plain" and r.peak_bytes)
    budgets = {k: int(lowest + FRACTIONS[k] * (plain - lowest)) for k in plan["budgets"]}
    peaks(predict_configs(w, budgets))
    timed = [r.config for r in results.values()]
    for round_ in range(plan["rounds"]):
        for config in timed[round_ % len(timed) :] + timed[: round_ % len(timed)]:
            result = results[config.name]
            r = run(bench, config, result.first_steady + plan["steps"], device, peak=False)
            result.seconds += r.seconds
            result.errors += [f"timing run {round_}: {r.error}"] if r.error else []
            predicted[config.name] += [config.memopt.predicted()] if isinstance(config.memopt, Made) else []
        log(f"  timing round {round_ + 1}/{plan['rounds']} done")
    configs = {n: r.as_dict() for n, r in results.items()}
    plain_s, fastest_plain = configs["plain"]["median_step_s"], min(configs["plain"]["step_times_s"], default=None)
    for n, c in configs.items():
        c["k"] = next((k for k, b in budgets.items() if n == f"budget_{k}"), None)
        c["time_vs_plain"] = c["median_step_s"] / plain_s if c["median_step_s"] and plain_s else None
        c["time_vs_plain_min"] = min(c["step_times_s"]) / fastest_plain if c["step_times_s"] and fastest_plain else None
        c["predicted_s"] = next((p for p in predicted[n] if p is not None), None)
        c["predicted_error"] = error(c["predicted_s"], c["median_step_s"])
    budgeted = [c for c in configs.values() if c["k"] is not None]
    return {
        "stage": "predict",
        "size": dict(bench.size),
        "parameters": sum(p.numel() for p in bench.parameters()),
        "native": w.native_label,
        "lowest_bytes": lowest,
        "budgets": {str(k): b for k, b in budgets.items()},
        "configs": configs,
        "summary": {
            "memopt_meets_every_budget": all(c["meets_budget"] for c in budgeted),
            "mean_time_vs_plain_under_budgets": statistics.mean(c["time_vs_plain"] or 0 for c in budgeted),
            "largest_predicted_error": largest([c["predicted_error"] for c in configs.values()]),
            "largest_predicted_ratio_error": None,  # plain, not a MemOpt run, has no prediction
            "errors": [e for c in configs.values() for e in c["errors"]],
        },
    }


# report ------------------------------------------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1000:.0f}" if seconds is not None else "n/a"


def _err(value: float | None) -> str:
    return f"{value:+.0%}" if value is not None else "n/a"


def _git(git: dict[str, Any] | None) -> str:
    if not git:
        return "."
    changed = ", ".join(f"`{f}`" for f in git["library_changed"])
    return f" at commit {git['head']}" + (f", with uncommitted changes to {changed}." if changed else ".")


def _predicted(figures: dict[str, Any]) -> str:
    """Two cells: the predicted step and its error; in brackets the prediction over plain's and that ratio's error."""
    ratio = figures.get("predicted_vs_plain")
    if ratio is None:
        return f"{_ms(figures.get('predicted_s'))} | {_err(figures.get('predicted_error'))}"
    return (
        f"{_ms(figures['predicted_s'])} ({ratio:.2f}) | {_err(figures['predicted_error'])} "
        f"({_err(figures['predicted_vs_plain_error'])})"
    )


def _times(figures: dict[str, Any]) -> str:
    """The median step over plain's, and in brackets the fastest step over plain's fastest."""
    return f"{ratio_cell(figures['time_vs_plain'])} ({ratio_cell(figures['time_vs_plain_min'])})"


def _seconds(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else ""


def _diff(a: dict[str, Any] | None) -> str:
    return f"{a['loss_abs_diff']:.1e} / {a['grad_max_abs_diff']:.1e}" if a else ""


def _met(budgets: list[dict[str, Any]], peak: int) -> str:
    met = [f"B{r['k']}" for r in budgets if peak <= r["budget_bytes"]]
    return f"meets {', '.join(met)}" if met else "meets none"


def fit_table(data: dict[str, Any]) -> list[str]:
    configs = data["configs"]
    lines = [
        "| k | budget MiB | configuration | modes | peak MiB | budget | step ms | time / plain (fastest) | "
        "predicted ms (/ plain's) | predicted error (of the ratio) | loss / grad max abs diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    compiled = {r["k"]: r for r in data["compile"]["runs"]}
    for row in data["budgets"]:
        k, budget = row["k"], mib_cell(row["budget_bytes"])
        for method in ("counting", "planner"):
            m = row[method]
            cells = f"`{letters(m['modes'])}`", mib_cell(m["real_peak_bytes"]), verdict_cell(m["meets_budget"])
            lines.append(_row(k, budget, method, *cells, m, configs[m["config"]]["agreement"]))
        if k in compiled:
            r = compiled[k]
            cells = "", mib_cell(r["peak_bytes"]), verdict_cell(r["meets_budget"])
            lines.append(_row(k, budget, f"compile ({r['activation_memory_budget']:.2f})", *cells, r, r["agreement"]))
    for key in ("plain", "native"):
        c = configs[key]
        cells = "", mib_cell(c["real_peak_bytes"]), _met(data["budgets"], c["real_peak_bytes"])
        lines.append(_row("", "", key, *cells, c, c["agreement"] if key != "plain" else None))
    return lines


def _row(*cells: Any) -> str:
    """A row of the fit table: the cells given, then the step's time, its ratios, the prediction and the agreement
    with plain, from the last two (the figures and the agreement)."""
    *given, figures, agreed = cells
    timed = _ms(figures["median_step_s"]), _times(figures), _predicted(figures), _diff(agreed)
    return "| " + " | ".join(str(c) for c in (*given, *timed)) + " |"


def predict_table(data: dict[str, Any]) -> list[str]:
    lines = [
        "| configuration | budget MiB | budget | peak MiB | step ms | time / plain (fastest) | predicted ms | "
        "predicted error | "
        "dry runs s | settings |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in data["configs"].values():
        budget = f"{mib_cell(c['budget_bytes'])} | {verdict_cell(c['meets_budget'])}" if c["budget_bytes"] else " | "
        lines.append(
            f"| {c['label']} | {budget} | {mib_cell(c['peak_bytes'])} | {_ms(c['median_step_s'])} | "
            f"{_times(c)} | {_predicted(c)} | "
            f"{_seconds(c['tuning_s'])} | {c['settings'] or ''} |"
        )
    return lines


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    load = ", ".join(f"{x:.1f}" for x in meta["load_average_start"])
    lines = [
        "# Step time where it means something: recomputation at fit, MemOpt at predict",
        "",
        f"Suite `{meta['suite']}` on {meta['device']}, {meta['threads']} thread(s), torch {meta['torch']}, "
        f"diffusers {meta['diffusers']}, transformers {meta['transformers']}, peft {meta['peft']}; "
        f"{meta['wall_s']:.0f} s in all. Generated by `benchmarks/step_time.py` (see benchmarks/README.md)"
        + _git(meta.get("git")),
        "",
        f"**The machine may have been shared with other processes at the time** (other engineers run tests on it): "
        f"load average {load} at the start (1, 5, 15 min), "
        f"{', '.join(f'{x:.1f}' for x in meta['load_average_end'])} at the end, on {meta['cpus']} CPUs. The "
        "figures are rough; nothing about speed is asserted.",
        "",
        "Fit: budgets `B_k = full + k/4 * (plain - full)`, k = 0..4, full and plain being the dry-run peaks with every "
        "block fully checkpointed and with none (checkpointing alone in force). Peaks: "
        + (
            "exact CPU bytes of one real step (`CPUPeakTracker`; compile: the profiler's allocation events)"
            if meta["device"] == "cpu"
            else "`torch.cuda.max_memory_allocated` over one step after `reset_peak_memory_stats`"
        )
        + f". Times: the median of {meta['rounds']} rounds x {meta['steps']} timed steps (one untimed step per visit), "
        "configurations interleaved round-robin in one process; `time / plain` against the plain step measured "
        "alongside (compile: against plain eager steps interleaved with its own); in brackets the fastest step over "
        "plain's fastest, less sensitive to other processes. Modes: one letter per block, `n` "
        "none, `k` feed-forward selective, `s` selective, `m` feed-forward, `a` attention, `f` full, `w` whole. "
        "Loss / grad: the absolute difference of the loss "
        "and the largest absolute difference of any gradient from plain's, from the same weights. Predicted: the "
        "planner's `RecomputeChoice.predicted_s` (plain: the dry run with every block `none`), MemOpt's "
        "`report.predicted_step_s`; `n/a` where none is given; error `(predicted - real) / real`. In brackets: "
        "the prediction over plain's prediction, and its error against the measured `time / plain`.",
        "",
        "Predict: budgets `B_k = lowest + k/4 * (plain - lowest)`, lowest being the lower peak of native and "
        "`MemOpt()`; peaks from `PeakMemory` over every batch, the "
        "first included, of a separate run; times the median of the steady batches (after one warm-up batch) of "
        f"{meta['rounds']} timing runs per configuration x {meta['steps']} batches, interleaved round-robin. Outputs "
        "are not compared here (the tests do).",
        "",
        "## Summary",
        "",
        "Goals (reported, not asserted): the planner's overhead over plain (`time / plain - 1`, averaged over the "
        "budgets) / counting's <= 0.75; the planner's step <= counting's x 1.02 at every budget; every budget met.",
        "",
        "| workload | plain step ms | overhead ratio (goal <= 0.75) | per budget k = 0..4 | fastest steps' "
        "overhead ratio | planner <= counting x 1.02 everywhere | budgets met: planner, counting, compile | largest "
        "predicted error (of a ratio to plain) | loss rel / grad max abs diff (eager; compile) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    all_errors: dict[str, list[float | None]] = {"largest_predicted_error": [], "largest_predicted_ratio_error": []}
    for name, data in results["workloads"].items():
        if "error" in data:
            lines.append(f"| {name} | error: {data['error']} | | | | | | | |")
            continue
        s = data["summary"]
        for key, found in all_errors.items():
            found.append(s[key])
        predicted = f"{_err(s['largest_predicted_error'])} ({_err(s['largest_predicted_ratio_error'])})"
        if data["stage"] == "predict":
            lines.append(
                f"| {name} (predict) | {_ms(data['configs']['plain']['median_step_s'])} | | MemOpt under the budgets: "
                f"{ratio_cell(s['mean_time_vs_plain_under_budgets'])}x plain on average | | | "
                f"MemOpt: {s['memopt_meets_every_budget']} | {predicted} | |"
            )
            continue
        per = ", ".join(ratio_cell(r) for r in s["overhead_ratio_per_budget"])
        compile_diff = s["compile_max_grad_abs_diff"]
        lines.append(
            f"| {name} | {_ms(data['configs']['plain']['median_step_s'])} "
            f"| {ratio_cell(s['overhead_ratio'])} | {per} | "
            f"{ratio_cell(s['overhead_ratio_of_fastest_steps'])} | "
            f"{s['planner_le_counting_x_1_02_every_budget']} | {s['planner_meets_every_budget']}, "
            f"{s['counting_meets_every_budget']}, {s['compile_meets_every_budget']} | "
            f"{predicted} | {s['max_loss_rel_diff']:.1e} / {s['max_grad_abs_diff']:.1e}; "
            f"{'—' if compile_diff is None else f'{compile_diff:.1e}'} |"
        )
    lines += [
        "",
        f"Largest predicted error over all rows: {_err(largest(all_errors['largest_predicted_error']))} of the step "
        f"time, {_err(largest(all_errors['largest_predicted_ratio_error']))} of the step time over plain's (the "
        "prediction over plain's against the measured ratio, which load on the machine moves less). Per budget, the "
        "overhead ratio is 1.00 where both chose the same mix, and — where both run plain or counting's median step "
        "came out no slower than plain's.",
    ]
    for name, data in results["workloads"].items():
        if "error" in data:
            lines += ["", f"## {name}", "", f"Failed: `{data['error']}`"]
            continue
        size = ", ".join(f"{k} {v}" for k, v in data["size"].items())
        lines += ["", f"## {name}", "", f"{size}; {data['parameters']:,} parameters. Native: {data['native']}."]
        if data["stage"] == "predict":
            budgets = ", ".join(f"B{k} {mib_cell(b)}" for k, b in data["budgets"].items())
            lines += ["", f"Budgets (MiB): {budgets}.", "", *predict_table(data)]
            continue
        lines += [
            "",
            f"{data['trainable_parameters']:,} trainable; blocks: {', '.join(f'`{b}`' for b in data['blocks'])}; in "
            f"force with MemOpt: {data['in_force']}. Alive between steps: {mib_cell(data['live_bytes'])} MiB.",
            "",
            *fit_table(data),
        ]
        comp = data["compile"]
        if comp.get("not_run"):
            lines += ["", f"torch.compile not run: {comp['not_run']}."]
            continue
        v = comp.get("validation")
        checked = (
            f"Compile's peak method checked on the plain eager step: tracker {v['tracker_bytes']:,} B, profiler "
            f"{v['profiler_bytes']:,} B ({v['difference_bytes']:+,} B). "
            if v
            else ""
        )
        done = "; ".join(
            f"k={r['k']} {r['compile_s']:.0f} s, {sum(r['cache_hits'].values())} hits" for r in comp["runs"]
        )
        lines += ["", f"{checked}Compile seconds (the first two steps) and cache hits: {done or 'none'}."]
        if comp["skipped"]:
            lines += [
                "",
                "Compile skipped: " + "; ".join(f"budget {x['k']} ({x['why']})" for x in comp["skipped"]) + ".",
            ]
        if comp["error"]:
            lines += ["", f"Compile failed: `{comp['error']}`."]
    if meta.get("plot"):
        lines += ["", f"![step time over plain against peak]({meta['plot']})"]
    return "\n".join(lines) + "\n"


def points(data: dict[str, Any]) -> dict[str, list[tuple[float, float, str]]]:
    """Per configuration kind, the (peak MiB, time / plain, label) of each run, for the plot."""
    out: dict[str, list[tuple[float, float, str]]] = {}

    def add(kind: str, peak: int | None, ratio: float | None, label: str = "") -> None:
        if peak is not None and ratio is not None:
            out.setdefault(kind, []).append((peak / MIB, ratio, label))

    if data["stage"] == "predict":
        for c in data["configs"].values():
            kind = "MemOpt(memory_budget=B_k)" if c["k"] is not None else c["label"].split(":")[0]
            add(kind, c["peak_bytes"], c["time_vs_plain"], "" if c["k"] is None else str(c["k"]))
        return out
    configs = data["configs"]
    for row in data["budgets"]:
        for method in ("counting", "planner"):
            add(method, row[method]["real_peak_bytes"], row[method]["time_vs_plain"], str(row["k"]))
    for r in data["compile"]["runs"]:
        add("torch.compile", r["peak_bytes"], r["time_vs_plain"], str(r["k"]))
    for key in ("native", "plain"):
        add(key, configs[key]["real_peak_bytes"], configs[key]["time_vs_plain"])
    return out


STYLE = {
    "plain": ("x", "k"),
    "native": ("^", "tab:green"),
    "counting": ("s", "tab:orange"),
    "planner": ("o", "tab:blue"),
    "torch.compile": ("D", "tab:purple"),
    "MemOpt()": ("*", "tab:red"),
    "MemOpt(memory_budget=B_k)": ("o", "tab:blue"),
}


def plot(results: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, d in results["workloads"].items() if "error" not in d]
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        data = results["workloads"][name]
        budgets = (
            data["budgets"]
            if data["stage"] == "fit"
            else [{"k": k, "budget_bytes": b} for k, b in data["budgets"].items()]
        )
        for b in budgets:
            ax.axvline(b["budget_bytes"] / MIB, color="0.6", lw=0.8, ls="--", zorder=0)
            ax.annotate(
                f"B{b['k']}",
                (b["budget_bytes"] / MIB, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(2, -9),
                textcoords="offset points",
                fontsize=7,
                color="0.45",
            )
        for kind, found in points(data).items():
            marker, color = STYLE.get(kind, ("v", "tab:gray"))
            ax.plot(
                [p[0] for p in found],
                [p[1] for p in found],
                marker,
                color=color,
                label=kind,
                ms=7,
                mfc="none" if kind == "counting" else color,
            )
            for x, y, label in found:
                ax.annotate(label, (x, y), xytext=(4, 3), textcoords="offset points", fontsize=6, color=color)
        ax.axhline(1.0, color="0.6", lw=0.6, ls=":")
        ax.set_title(f"{name} ({data['stage']})", fontsize=10)
        ax.set_xlabel("peak MiB")
        ax.set_ylabel("step time / plain")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(
        "Step time over plain against peak; dashed lines: the budgets B0..B4, numbers: the budget each point is for",
        fontsize=10,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


# main --------------------------------------------------------------------------------------------------------------


def git_state() -> dict[str, Any] | None:
    """The commit measured and the library's files changed since (other engineers edit the same checkout), or None
    without git."""
    try:
        head, changed = (
            subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True, timeout=30).stdout
            for a in (["rev-parse", "--short", "HEAD"], ["status", "--porcelain", "--", "lightning_memopt"])
        )
    except (OSError, subprocess.SubprocessError):
        return None
    changed = [line[3:] for line in changed.splitlines()]  # "XY path"
    return {"head": head.strip(), "library_changed": changed} if head.strip() else None


def write(results: dict[str, Any], out: Path, stem: str, started: float) -> None:
    results["meta"]["wall_s"] = round(time.perf_counter() - started, 1)
    results["meta"]["load_average_end"] = os.getloadavg()
    out.mkdir(parents=True, exist_ok=True)
    texts = {f"{stem}.json": json.dumps(results, indent=1, default=str) + "\n", f"{stem}.md": markdown(results)}
    for file, text in texts.items():
        (out / file).write_text(text)
    log(f"wrote {', '.join(texts)} in {out} at {results['meta']['wall_s']:.0f} s")


def measure(name: str, suite: str, plan: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """One workload's figures, or the error it raised (the other workloads still run), and its wall time."""
    log(f"{name} ({suite}, {device.type})")
    began = time.perf_counter()
    try:
        data = (measure_fit if WORKLOADS[name].stage == "fit" else measure_predict)(name, suite, plan, device)
    except Exception as error:
        data = {"error": f"{type(error).__name__}: {error}".splitlines()[0][:300]}
        log(f"  failed: {data['error']}")
    data["wall_s"] = round(time.perf_counter() - began, 1)
    log(f"{name} done in {data['wall_s']:.0f} s")
    return data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one budget, no compile: under a minute (CI)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--plots", action="store_true", help="write the plot (needs matplotlib)")
    parser.add_argument("--workloads", nargs="+", choices=NAMES, help="a subset (default: the suite's)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default 1 on CPU, see README)")
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument("--compile-box", type=float, help="seconds of compiling allowed per workload")
    args = parser.parse_args()
    if args.plots and importlib.util.find_spec("matplotlib") is None:  # said before the suite runs, not after it
        parser.error(
            '--plots needs matplotlib, which the bench extra installs: pip install -c constraints.txt -e ".[bench]"'
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    suite = "smoke" if args.smoke else "gpu" if device.type == "cuda" else "cpu"
    plan = dict(SUITES[suite])
    plan["compile_box_s"] = args.compile_box if args.compile_box is not None else COMPILE_BOX_S.get(suite, 0)
    # why torch.compile runs nowhere in this run, if it does not
    plan["compile_off"] = (
        "--no-compile" if args.no_compile else compile_unavailable(device) if plan["compile"] else None
    )
    threads = args.threads or (1 if device.type == "cpu" else torch.get_num_threads())
    torch.set_num_threads(threads)
    stem = "time_smoke" if args.smoke else "time"
    load_start = os.getloadavg()
    started = time.perf_counter()
    results: dict[str, Any] = {
        "meta": {
            "suite": suite,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "threads": threads,
            "cpus": os.cpu_count(),
            "load_average_start": load_start,
            **{p: importlib.metadata.version(p) for p in ("torch", "lightning", "diffusers", "transformers", "peft")},
            **plan,
            "plot": None,
            "optimizer": "AdamW(lr=1e-6), zero_grad(set_to_none=True) between forward and backward",
            "git": git_state(),
        },
        "workloads": {},
    }
    workloads = results["workloads"]
    for name in args.workloads or plan["workloads"]:
        workloads[name] = measure(name, suite, plan, device)
        write(results, args.out, stem, started)  # after each workload: a run stopped by a time limit keeps the rest
    # the docs' plot from a CPU run into the committed results, else next to the results
    path = DOCS_PLOT if suite == "cpu" and args.out.resolve() == RESULTS else args.out / f"{stem}.png"
    if args.plots:
        log(f"wrote {plot(results, path)}")
        results["meta"]["plot"] = os.path.relpath(path, args.out.resolve())
        write(results, args.out, stem, started)
    failed = [n for n, d in workloads.items() if "error" in d or d["summary"].get("errors")]
    disagree = [
        f"{n} {k}"
        for n, d in workloads.items()
        if d.get("stage") == "fit"
        for k, c in d["configs"].items()
        if (c["agreement"]["loss_rel_diff"] or 0) > LOSS_TOLERANCE
    ]
    if failed or disagree:
        log(f"failed: {failed}; losses off plain's by more than {LOSS_TOLERANCE} relative: {disagree}")
    return 1 if failed or disagree else 0


if __name__ == "__main__":
    sys.exit(main())
