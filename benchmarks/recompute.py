"""Selective recomputation, side by side in one run: whole-block counting (the previous ``checkpointing="auto"``), the
planner (:func:`lightning_memopt.techniques.checkpointing.planner.choose_modes`), the native switch, and torch.compile's
activation memory budget, at 5 budgets per workload.

    python -m benchmarks.recompute --quick --plots   # the quick suite on CPU (about 6-8 minutes on 2 cores)
    python -m benchmarks.recompute --smoke           # tiny sizes, one budget, no compile: seconds (CI)
    python -m benchmarks.recompute                   # the full suite (long on CPU)

Per workload: the peak with every block fully checkpointed and with none (dry runs), 5 budgets evenly spaced between
them (both ends included); at each budget the modes whole-block counting and the planner choose (dry runs: peak,
recompute FLOPs); then real training steps (forward, loss, backward, AdamW step) of every configuration, round-robin
in one process: the exact CPU peak of one step under ``CPUPeakTracker`` and the median time of untracked steps.
torch.compile runs the plain model with ``torch._functorch.config.activation_memory_budget = k / 4`` at budget k; its
peak comes from the profiler's allocation events (the tracker cannot see inductor's buffers), a method checked
against the tracker on the eager step first.

Results: ``<out>/recompute.json`` and ``<out>/recompute.md`` (``recompute_<suite>.*`` for smoke and full), and with
``--plots`` ``docs/images/recompute.png`` (``<out>/recompute_<suite>.png`` for smoke and full). See
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
import os
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # "use_cache=True is incompatible with checkpointing"

import torch
from torch import nn
from torch.utils.data import default_collate

from benchmarks.whole_blocks import whole_block_counting
from benchmarks.workloads import WORKLOADS, Bench, Workload
from lightning_memopt.adapters import find_models
from lightning_memopt.engine.changes import Changes
from lightning_memopt.engine.config import MemOptConfig
from lightning_memopt.engine.stage import planning_for
from lightning_memopt.engine.step import StepContext
from lightning_memopt.memory import CPUPeakTracker
from lightning_memopt.techniques.checkpointing import Checkpointing
from lightning_memopt.techniques.checkpointing.planner import RecomputeChoice, choose_modes

warnings.filterwarnings("ignore", ".*does not have many workers.*")
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
logging.getLogger("lightning.fabric").setLevel(logging.WARNING)

MIB = 2**20
ROOT = Path(__file__).resolve().parent.parent
#: Budget k of 5 (k = 0: the peak with every block fully checkpointed, k = 4: the plain peak) and torch.compile's
#: ``activation_memory_budget`` at it.
FRACTIONS = {k: k / 4 for k in range(5)}
#: The order compile runs take the budgets in, so that a time box cut short keeps the ends and the middle.
COMPILE_ORDER = (0, 4, 2, 1, 3)


# the GELU transformer ----------------------------------------------------------------------------------------------


def _gelu_transformer(s: dict[str, int]) -> nn.Module:
    layer = nn.TransformerEncoderLayer(
        s["hidden"], s["heads"], 4 * s["hidden"], activation="gelu", batch_first=True, norm_first=True
    )
    return nn.TransformerEncoder(layer, s["layers"], enable_nested_tensor=False)


GELU_TRANSFORMER = Workload(
    "gelu_transformer",
    "fit",
    "encoder",
    _gelu_transformer,
    lambda g, s: {
        "x": torch.randn(s["seq"], s["hidden"], generator=g),
        "y": torch.randn(s["seq"], s["hidden"], generator=g),
    },
    lambda m, b: nn.functional.mse_loss(m(b["x"]), b["y"]),
    lambda m: lambda: None,  # torch has no switch: the native configuration is every block "full" through MemOpt
    'every block "full" through MemOpt\'s units (torch.utils.checkpoint, non-reentrant); torch has no switch',
    {
        "smoke": {"batch": 2, "seq": 32, "hidden": 32, "heads": 2, "layers": 2},
        "quick": {"batch": 4, "seq": 256, "hidden": 64, "heads": 4, "layers": 4},
        "full": {"batch": 8, "seq": 1024, "hidden": 128, "heads": 4, "layers": 8},
    },
)
#: Workloads whose native configuration is every block "full" through MemOpt's own units.
BY_UNITS = {"gelu_transformer"}

SUITES: dict[str, dict[str, Any]] = {
    # budgets: which k of 5 run; rounds x steps: timed steps per configuration, after one untimed step per visit;
    # compile: the workloads torch.compile runs on, and the seconds of compiling allowed per workload
    "smoke": {
        "workloads": ("gelu_transformer", "llama"),  # the UNets' dry runs take seconds each, whatever their size
        "budgets": (2,),
        "rounds": 1,
        "steps": 1,
        "compile": (),
        "compile_box_s": 0,
        "compile_steps": 0,
    },
    "quick": {
        "workloads": ("gelu_transformer", "llama", "unet2d_ddpm", "unet2d_condition_lora"),
        "budgets": (0, 1, 2, 3, 4),
        "rounds": 2,
        "steps": 2,
        "compile": ("gelu_transformer", "llama"),
        "compile_box_s": 60,
        "compile_steps": 3,
    },
    "full": {
        "workloads": ("gelu_transformer", "llama", "unet2d_ddpm", "unet2d_condition_lora"),
        "budgets": (0, 1, 2, 3, 4),
        "rounds": 5,
        "steps": 3,
        "compile": ("gelu_transformer", "llama", "unet2d_ddpm", "unet2d_condition_lora"),
        "compile_box_s": 900,
        "compile_steps": 5,
    },
}
NAMES = SUITES["full"]["workloads"]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


#: Sizes that differ from those of the main suite (workloads.py): at res 32 the UNet2DCondition step spends 90% of
#: its 2-3 s in CPU flash attention over 1024 tokens of 8-dim heads, too slow for 40-odd steps per budget sweep.
SIZES = {"unet2d_condition_lora": {"quick": {"batch": 8, "res": 16, "channels": 16, "layers": 1}}}


def workload(name: str) -> Workload:
    w = GELU_TRANSFORMER if name == GELU_TRANSFORMER.name else WORKLOADS[name]
    return dataclasses.replace(w, sizes={**w.sizes, **SIZES.get(name, {})})


# a real training step ----------------------------------------------------------------------------------------------


class Trainer:
    """One workload's model, batch and AdamW, and the step every configuration runs, as Lightning's automatic
    optimization runs it: forward and loss, gradients zeroed (last step's alive until then), backward, AdamW step."""

    def __init__(self, bench: Bench, batch: dict[str, torch.Tensor]) -> None:
        self.bench, self.batch = bench, batch
        self.trainable = [p for p in bench.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=1e-6)

    def step(self, model: Any = None) -> None:
        runner = self.bench.runner if model is None else model
        # as Lightning's closure: the loss divided by accumulate_grad_batches (1) and a detached copy kept, the
        # step's own output dropped before the backward pass (a CPU mse_loss result holds an input-sized buffer)
        loss = self.bench.workload.step(runner, self.batch) / 1
        _kept = loss.detach().clone()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def timed(self, model: Any = None) -> float:
        started = time.perf_counter()
        self.step(model)
        return time.perf_counter() - started

    def live(self) -> list[torch.Tensor]:
        """What is alive between steps: weights, buffers, gradients, optimizer state, batch."""
        state = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        grads = [p.grad for p in self.bench.parameters() if p.grad is not None]
        return [*self.bench.parameters(), *self.bench.buffers(), *grads, *state, *self.batch.values()]

    def live_bytes(self) -> int:
        storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in self.live()}
        return sum(storages.values())

    def tracked_peak(self, model: Any = None) -> int:
        """The exact CPU peak of one step, everything alive counted (:class:`CPUPeakTracker`)."""
        with CPUPeakTracker() as tracker:
            tracker.add(self.live())
            self.step(model)
        return tracker.peak

    def profiled_peak(self, model: Any = None) -> int:
        """The peak of one step from the profiler's CPU allocation events: what is alive between steps plus the
        highest running sum of the bytes allocated less those freed during the step. Two steps are profiled and the
        second is read, so that every free in it is of a block the profiler saw allocated (it drops frees of blocks
        allocated before it started). Inductor's buffers are seen as well: they come from the same allocator."""
        from torch.profiler import ProfilerActivity, profile, record_function

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            self.step(model)
            with record_function("measured step"):
                self.step(model)
        nodes: list[Any] = []
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children)
        mark = min(n.start_time_ns for n in nodes if n.name == "measured step")
        events = sorted(
            (n.start_time_ns, n.extra_fields.alloc_size)
            for n in nodes
            if type(n.extra_fields).__name__ == "_ExtraFields_Allocation" and n.extra_fields.device.type == "cpu"
        )
        current, start, peak = 0, None, 0
        for stamp, size in events:
            if start is None and stamp >= mark:
                start = peak = current
            current += size
            if start is not None:
                peak = max(peak, current)
        return self.live_bytes() + (peak - start if start is not None else 0)


def batch_of(w: Workload, size: dict[str, int]) -> dict[str, torch.Tensor]:
    return default_collate([w.sample(torch.Generator().manual_seed(i), size) for i in range(size["batch"])])


# configurations ----------------------------------------------------------------------------------------------------


class Setups:
    """Puts a configuration in force on the one model: ``plain`` (MemOpt's changes removed), ``native`` (the library's
    switch by hand, MemOpt's changes removed; or every block "full" through MemOpt's units) or a list of modes (MemOpt's
    checkpointing applied, each block's mode set)."""

    def __init__(self, bench: Bench, notes: list[str]) -> None:
        self.bench = bench
        self.changes = Changes("fit", find_models(bench, None), MemOptConfig(), notes.append)
        self.changes.apply(quiet=True)
        self.names = [u.name for u in self.changes.technique(Checkpointing).switches]
        self.applied = True

    @property
    def checkpointing(self) -> Any:
        return self.changes.technique(Checkpointing)

    def _apply(self) -> None:
        if not self.applied:
            self.changes.apply(quiet=True)
            self.applied = True
            names = [u.name for u in self.checkpointing.switches]
            if names != self.names:
                raise RuntimeError(f"MemOpt found other blocks when applied again: {names} != {self.names}")

    def _remove(self) -> None:
        if self.applied:
            self.changes.remove()
            self.applied = False

    @contextlib.contextmanager
    def use(self, key: str | tuple[str, ...]) -> Iterator[None]:
        if key == "plain":
            self._remove()
            yield
        elif key == "native" and self.bench.workload.name in BY_UNITS:
            self._apply()
            self.checkpointing.set(["full"] * len(self.names))
            yield
        elif key == "native":
            self._remove()
            with self.bench.native():
                yield
        else:
            self._apply()
            self.checkpointing.set(list(key))
            yield

    def close(self) -> None:
        self._remove()


def mode_key(modes: list[str], workload_name: str) -> str | tuple[str, ...]:
    """The configuration a mix of modes runs as: ``plain`` for no block checkpointed, ``native`` for every block
    "full" where the native configuration is MemOpt's units, else the modes."""
    if all(m == "none" for m in modes):
        return "plain"
    if workload_name in BY_UNITS and all(m == "full" for m in modes):
        return "native"
    return tuple(modes)


#: One letter per mode: ``n`` none, ``k`` feed-forward selective (the MLP keeps its matrix products' outputs), ``s``
#: selective, ``m`` feed-forward (the MLP), ``a`` attention, ``f`` full, ``w`` whole.
LETTERS = {
    "none": "n",
    "feed_forward_selective": "k",
    "selective": "s",
    "feed_forward": "m",
    "attention": "a",
    "full": "f",
    "whole": "w",
}


def letters(modes: list[str] | tuple[str, ...]) -> str:
    """One letter per block (:data:`LETTERS`)."""
    return "".join(LETTERS[m] for m in modes)


def key_name(key: str | tuple[str, ...]) -> str:
    return key if isinstance(key, str) else letters(key)


# dry runs ----------------------------------------------------------------------------------------------------------


def figures(choice: RecomputeChoice, wall: float) -> dict[str, Any]:
    return {
        "dry_peak_bytes": choice.peak_bytes,
        "recompute_flops": choice.recompute_flops,
        "forward_flops": choice.forward_flops,
        "recompute_fraction": choice.recompute_fraction,
        "dry_run_s": round(choice.seconds, 3),
        "wall_s": round(wall, 3),
        "notes": list(choice.notes),
        "placeholders": choice.placeholders,
    }


def flops_ratio(planner: int | None, counting: int | None) -> float | None:
    """Planner / counting recompute FLOPs; 1.0 where neither recomputes anything (the same cost)."""
    if planner is None or counting is None:
        return None
    if counting == 0:
        return 1.0 if planner == 0 else float("inf")
    return planner / counting


def dry_runs(setups: Setups, trainer: Trainer, budgets_k: tuple[int, ...]) -> dict[str, Any]:
    bench, batch = trainer.bench, trainer.batch
    context = StepContext(optimizers=[trainer.optimizer])
    ck = setups.checkpointing
    ends: dict[str, Any] = {}
    whole = any("whole" in u.modes for u in ck.switches)  # diffusers blocks: one segment each, below "full"
    for mode in ("full", "none", *(["whole"] if whole else [])):
        ck.set([mode if mode in u.modes else "full" for u in ck.switches])
        started = time.perf_counter()
        ends[mode] = figures(
            choose_modes(planning_for(context, bench, setups.changes, batch), setups.checkpointing, None, choose=False),
            0.0,
        )
        ends[mode]["wall_s"] = round(time.perf_counter() - started, 3)
        ends[mode]["modes"] = list(ck.modes)
    full, plain = ends["full"]["dry_peak_bytes"], ends["none"]["dry_peak_bytes"]
    if full is None or plain is None:
        raise RuntimeError(f"a dry run could not be traced: {ends['full']['notes'] + ends['none']['notes']}")
    rows = []
    for k in budgets_k:
        budget = int(full + (plain - full) * k / 4)
        started = time.perf_counter()
        count, old = whole_block_counting(context, bench, setups.changes, batch, budget)
        counting = {"count": count, "modes": list(ck.modes), **figures(old, time.perf_counter() - started)}
        started = time.perf_counter()
        new = choose_modes(planning_for(context, bench, setups.changes, batch), setups.checkpointing, budget)
        planner = {"modes": list(ck.modes), "described": ck.describe(), **figures(new, time.perf_counter() - started)}
        ratio = flops_ratio(planner["recompute_flops"], counting["recompute_flops"])
        rows.append({"k": k, "budget_bytes": budget, "counting": counting, "planner": planner, "flops_ratio": ratio})
        log(
            f"  budget {k} ({budget / MIB:.1f} MiB): counting {key_name(tuple(counting['modes']))} "
            f"{(counting['dry_peak_bytes'] or 0) / MIB:.1f} MiB {counting['recompute_flops']:,} FLOPs "
            f"({counting['wall_s']:.1f} s) | planner {key_name(tuple(planner['modes']))} "
            f"{(planner['dry_peak_bytes'] or 0) / MIB:.1f} MiB {planner['recompute_flops']:,} FLOPs "
            f"({planner['wall_s']:.1f} s) | ratio {ratio if ratio is None else round(ratio, 3)}"
        )
    return {"full": ends["full"], "none": ends["none"], "whole": ends.get("whole"), "budgets": rows}


# real steps --------------------------------------------------------------------------------------------------------


def real_steps(setups: Setups, trainer: Trainer, keys: list[Any], rounds: int, steps: int) -> dict[str, Any]:
    """Every configuration round-robin (each round starting one later): one untimed step per visit, then ``steps``
    timed ones; the tracked step (exact peak) once, on the first visit, after the untimed step."""
    out: dict[str, Any] = {key_name(k): {"key": k, "step_times_s": [], "real_peak_bytes": None} for k in keys}
    for r in range(rounds):
        order = keys[r % len(keys) :] + keys[: r % len(keys)]
        for key in order:
            entry = out[key_name(key)]
            with setups.use(key):
                trainer.step()
                if entry["real_peak_bytes"] is None:
                    entry["real_peak_bytes"] = trainer.tracked_peak()
                entry["step_times_s"] += [trainer.timed() for _ in range(steps)]
    for entry in out.values():
        entry["median_step_s"] = statistics.median(entry["step_times_s"])
        entry["key"] = entry["key"] if isinstance(entry["key"], str) else list(entry["key"])
    plain = out["plain"]["median_step_s"]
    for entry in out.values():
        entry["time_vs_plain"] = entry["median_step_s"] / plain
    return out


# torch.compile -----------------------------------------------------------------------------------------------------


def dynamo_counter(group: str, name: str) -> int:
    from torch._dynamo.utils import counters

    return int(counters[group][name])


def compiled_runs(setups: Setups, trainer: Trainer, budgets: list[dict[str, Any]], box: float, steps: int) -> dict:
    """torch.compile of the plain model at each budget's ``activation_memory_budget``: compile time (first two steps),
    median step time interleaved with plain eager steps, the profiler's peak. Budgets are taken in
    :data:`COMPILE_ORDER`; one that would likely end past ``box`` seconds of compiling is skipped."""
    import torch._functorch.config as functorch_config

    result: dict[str, Any] = {"runs": [], "skipped": [], "error": None}
    with setups.use("plain"):
        eager_tracker, eager_profiler = trainer.tracked_peak(), trainer.profiled_peak()
    result["validation"] = {
        "what": "the plain eager step: the tracker's exact peak and the profiler method's",
        "tracker_bytes": eager_tracker,
        "profiler_bytes": eager_profiler,
        "difference_bytes": eager_profiler - eager_tracker,
    }
    by_k = {row["k"]: row for row in budgets}
    spent, last = 0.0, 0.0
    for k in [k for k in COMPILE_ORDER if k in by_k]:
        fraction = FRACTIONS[k]
        if spent + max(last, 1.0) > box:
            result["skipped"].append({"k": k, "why": f"time box: {spent:.0f} s of {box:.0f} s spent compiling"})
            continue
        torch._dynamo.reset()
        hits = {
            c: dynamo_counter(*c) for c in (("inductor", "fxgraph_cache_hit"), ("aot_autograd", "autograd_cache_hit"))
        }
        try:
            with setups.use("plain"), functorch_config.patch(activation_memory_budget=fraction):
                compiled = torch.compile(trainer.bench.net)
                started = time.perf_counter()
                trainer.step(compiled)  # compiles the forward and backward graphs
                trainer.step(compiled)
                compile_s = time.perf_counter() - started
                times, eager = [], []
                for _ in range(steps):
                    times.append(trainer.timed(compiled))
                    eager.append(trainer.timed())
                peak = trainer.profiled_peak(compiled)
        except Exception as error:  # recorded, and no further budget tried
            result["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            log(f"  compile failed at budget {k}: {result['error']}")
            break
        finally:
            torch._dynamo.reset()
        spent += compile_s
        last = compile_s
        median, eager_median = statistics.median(times), statistics.median(eager)
        run = {
            "k": k,
            "activation_memory_budget": fraction,
            "budget_bytes": by_k[k]["budget_bytes"],
            "peak_bytes": peak,
            "meets_budget": peak <= by_k[k]["budget_bytes"],
            "compile_s": round(compile_s, 2),
            "cache_hits": {f"{g}.{c}": dynamo_counter(g, c) - before for (g, c), before in hits.items()},
            "step_times_s": times,
            "eager_plain_step_times_s": eager,
            "median_step_s": median,
            "eager_plain_median_s": eager_median,
            "time_vs_plain": median / eager_median,
        }
        result["runs"].append(run)
        log(
            f"  compile budget {k} (activation_memory_budget {fraction}): peak {peak / MIB:.1f} MiB, "
            f"{median * 1000:.0f} ms vs eager {eager_median * 1000:.0f} ms, compiled in {compile_s:.0f} s"
        )
    result["runs"].sort(key=lambda r: r["k"])
    return result


# one workload ------------------------------------------------------------------------------------------------------


def measure(name: str, suite: str, plan: dict[str, Any]) -> dict[str, Any]:
    w = workload(name)
    torch.manual_seed(0)
    bench = Bench(w, suite)
    bench.train()
    trainer = Trainer(bench, batch_of(w, bench.size))
    notes: list[str] = []
    setups = Setups(bench, notes)
    data: dict[str, Any] = {
        "size": dict(bench.size),
        "parameters": sum(p.numel() for p in bench.parameters()),
        "trainable_parameters": sum(p.numel() for p in trainer.trainable),
        "blocks": setups.names,
        "native": w.native_label,
        "notes": notes,
    }
    try:
        with setups.use("plain"):
            trainer.step()  # gradients and optimizer state exist from here: every step is a later step
        data["live_bytes"] = trainer.live_bytes()
        with setups.use(tuple(["full"] * len(setups.names))):  # MemOpt applied for the dry runs
            data.update(dry_runs(setups, trainer, plan["budgets"]))
        keys: list[Any] = ["plain", "native"]
        for row in data["budgets"]:
            for method in ("counting", "planner"):
                key = mode_key(row[method]["modes"], name)
                row[method]["config"] = key_name(key)
                if key not in keys:
                    keys.append(key)
        data["configs"] = real_steps(setups, trainer, keys, plan["rounds"], plan["steps"])
        for row in data["budgets"]:
            for method in ("counting", "planner"):
                real = data["configs"][row[method]["config"]]["real_peak_bytes"]
                row[method]["real_peak_bytes"] = real
                row[method]["meets_budget"] = real <= row["budget_bytes"]
                row[method]["dry_meets_budget"] = (row[method]["dry_peak_bytes"] or 0) <= row["budget_bytes"]
        if name in plan["compile"]:
            data["compile"] = compiled_runs(
                setups, trainer, data["budgets"], plan["compile_box_s"], plan["compile_steps"]
            )
        else:
            data["compile"] = {"runs": [], "skipped": [], "error": None, "not_run": f"not in the {suite} suite"}
    finally:
        setups.close()
    data["summary"] = summarize(data)
    return data


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Planner / counting recompute FLOPs per budget and averaged (a budget where neither recomputes anything counts
    as 1.0 in ``mean_flops_ratio``, as 0 in ``mean_flops_ratio_zero_as_zero``), and whether every budget was met."""
    rows = data["budgets"]
    ratios = [r["flops_ratio"] for r in rows]
    known = [r for r in ratios if r is not None]
    zero_zero = [r["k"] for r in rows if r["counting"]["recompute_flops"] == 0 and r["planner"]["recompute_flops"] == 0]
    counting_total = sum(r["counting"]["recompute_flops"] or 0 for r in rows)
    planner_total = sum(r["planner"]["recompute_flops"] or 0 for r in rows)
    complete = bool(known) and len(known) == len(rows)
    mean = sum(known) / len(known) if complete else None
    zero = sum(0.0 if r["k"] in zero_zero else r["flops_ratio"] for r in rows) / len(rows) if complete else None
    return {
        "flops_ratios": ratios,
        "mean_flops_ratio": mean,
        "mean_flops_ratio_zero_as_zero": zero,
        "max_flops_ratio": max(known) if known else None,
        "ratio_of_totals": planner_total / counting_total if counting_total else None,
        "budgets_neither_recomputes": zero_zero,
        "planner_meets_every_budget": all(r["planner"]["meets_budget"] for r in rows),
        "counting_meets_every_budget": all(r["counting"]["meets_budget"] for r in rows),
        "goal_mean_le_0_5": mean is not None and mean <= 0.5,
        "goal_mean_le_0_5_zero_as_zero": zero is not None and zero <= 0.5,
        "goal_every_le_1_0": complete and max(known) <= 1.0,
        "dry_equals_real": all(
            r[m]["dry_peak_bytes"] == r[m]["real_peak_bytes"] for r in rows for m in ("counting", "planner")
        ),
    }


# report ------------------------------------------------------------------------------------------------------------


def mib_cell(value: int | None) -> str:
    return f"{value / MIB:.2f}" if value is not None else "—"


def _gflop(value: int | None) -> str:
    return f"{value / 1e9:.3f}" if value is not None else "—"


def ratio_cell(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "—"


def verdict_cell(met: bool | None) -> str:
    return {True: "met", False: "**over**", None: "?"}[met]


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [
        "# Selective recomputation: whole-block counting, the planner, the native switch, torch.compile",
        "",
        f"Suite `{meta['suite']}` on {meta['device']}, {meta['threads']} thread(s), torch {meta['torch']}, "
        f"diffusers {meta['diffusers']}, transformers {meta['transformers']}, peft {meta['peft']}; "
        f"{meta['wall_s']:.0f} s in all. Generated by `benchmarks/recompute.py` (see benchmarks/README.md).",
        "",
        "Budgets: k = 0..4, `B_k = full + k/4 * (plain - full)`, full and plain being the dry-run peaks with every "
        "block fully checkpointed and with none. Peaks are exact CPU bytes (dry run: fake tensors; real: "
        "`CPUPeakTracker` over one real step, weights, gradients, AdamW state and batch included). Recompute FLOPs "
        "are counted in the dry run with the modes chosen (matmul/conv/attention by FlopCounterMode's formulas, other "
        "ops one per output element). Modes: one letter per block, `n` none, `k` feed-forward selective (the block "
        "plain, its MLP checkpointed selectively), `s` selective, `m` feed-forward (the block plain, its MLP "
        "checkpointed), `a` attention (fused attention's outputs kept), `f` full, `w` whole (a "
        "diffusers block as one segment, where its library's switch checkpoints its parts). Time: median of "
        f"{meta['rounds']} rounds x {meta['steps']} timed steps, configurations interleaved round-robin in one "
        "process; ratio to the plain step measured alongside.",
        "",
        "## Summary",
        "",
        "Goal (reported, not asserted): planner / counting recompute FLOPs <= 0.5 averaged over the budgets, <= 1.0 at "
        "every budget, every budget met. A budget where neither recomputes anything counts as a ratio of 1.0 in the "
        "mean (`mean, 0/0 as 0` counts it as 0 instead).",
        "",
        "| workload | FLOPs ratio per budget (k = 0..4) | mean | mean, 0/0 as 0 | max | ratio of totals | planner "
        "meets all (real) | counting meets all (real) | dry = real peak | goal | time / plain: counting, planner, "
        "native (mean over budgets) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, data in results["workloads"].items():
        if "error" in data:
            lines.append(f"| {name} | error: {data['error']} | | | | | | | | | |")
            continue
        s = data["summary"]
        per = ", ".join(ratio_cell(r) for r in s["flops_ratios"])
        rest = s["goal_every_le_1_0"] and s["planner_meets_every_budget"]
        goal = (
            "met"
            if rest and s["goal_mean_le_0_5"]
            else "met with 0/0 as 0"
            if rest and s["goal_mean_le_0_5_zero_as_zero"]
            else "not met"
        )
        times = [
            statistics.mean(data["configs"][r[m]["config"]]["time_vs_plain"] for r in data["budgets"])
            for m in ("counting", "planner")
        ]
        times.append(data["configs"]["native"]["time_vs_plain"])
        lines.append(
            f"| {name} | {per} | {ratio_cell(s['mean_flops_ratio'])} "
            f"| {ratio_cell(s['mean_flops_ratio_zero_as_zero'])} | "
            f"{ratio_cell(s['max_flops_ratio'])} | {ratio_cell(s['ratio_of_totals'])} "
            f"| {s['planner_meets_every_budget']} | "
            f"{s['counting_meets_every_budget']} | {s['dry_equals_real']} | {goal} | "
            f"{', '.join(ratio_cell(t) for t in times)} |"
        )
    for name, data in results["workloads"].items():
        lines += ["", f"## {name}", ""]
        if "error" in data:
            lines += [f"Failed: `{data['error']}`"]
            continue
        size = ", ".join(f"{k} {v}" for k, v in data["size"].items())
        lines += [
            f"{size}; {data['parameters']:,} parameters ({data['trainable_parameters']:,} trainable); "
            f"{len(data['blocks'])} checkpointable blocks: {', '.join(f'`{b}`' for b in data['blocks'])}. "
            f"Alive between steps: {mib_cell(data['live_bytes'])} MiB. Native: {data['native']}.",
            "",
            f"Every block full: {mib_cell(data['full']['dry_peak_bytes'])} MiB, "
            f"{_gflop(data['full']['recompute_flops'])} GFLOP recomputed "
            f"({ratio_cell(data['full']['recompute_fraction'])} of the forward's "
            f"{_gflop(data['full']['forward_flops'])}); "
            f"none: {mib_cell(data['none']['dry_peak_bytes'])} MiB"
            + (
                f"; every block whole where it can be (`{letters(data['whole']['modes'])}`): "
                f"{mib_cell(data['whole']['dry_peak_bytes'])} MiB, {_gflop(data['whole']['recompute_flops'])} GFLOP."
                if data.get("whole")
                else "."
            ),
            "",
            "| k | budget MiB | method | modes | dry-run peak MiB | real peak MiB | budget | recompute GFLOP | "
            "recompute / forward | choice s (dry runs s) | step ms | time / plain |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        configs = data["configs"]
        for row in data["budgets"]:
            for method in ("counting", "planner"):
                m = row[method]
                c = configs[m["config"]]
                modes = letters(m["modes"])
                label = f"counting ({m['count']})" if method == "counting" else "planner"
                lines.append(
                    f"| {row['k']} | {mib_cell(row['budget_bytes'])} | {label} | `{modes}` "
                    f"| {mib_cell(m['dry_peak_bytes'])} | "
                    f"{mib_cell(m['real_peak_bytes'])} | {verdict_cell(m['meets_budget'])} "
                    f"| {_gflop(m['recompute_flops'])} | "
                    f"{ratio_cell(m['recompute_fraction'])} | {m['wall_s']:.1f} ({m['dry_run_s']:.1f}) | "
                    f"{c['median_step_s'] * 1000:.0f} | {ratio_cell(c['time_vs_plain'])} |"
                )
        for key in ("plain", "native"):
            c = configs[key]
            flops = data["full"]["recompute_flops"] if key == "native" else 0
            lines.append(
                f"| | | {key} | | | {mib_cell(c['real_peak_bytes'])} | | {_gflop(flops)} | | | "
                f"{c['median_step_s'] * 1000:.0f} | {ratio_cell(c['time_vs_plain'])} |"
            )
        lines.append("")
        lines.append(
            "The native row's FLOPs are those of every block full through MemOpt's units (the same blocks recomputed "
            "whole)."
        )
        comp = data["compile"]
        lines += [
            "",
            "**torch.compile** (`activation_memory_budget` = k/4 at budget k, the plain model compiled):",
            "",
        ]
        if comp.get("not_run"):
            lines.append(f"not run: {comp['not_run']}.")
            continue
        v = comp["validation"]
        lines.append(
            f"Peak method checked on the plain eager step: tracker {v['tracker_bytes']:,} B, profiler "
            f"{v['profiler_bytes']:,} B (difference {v['difference_bytes']:+,} B)."
        )
        if comp["runs"]:
            lines += [
                "",
                "| k | activation_memory_budget | budget MiB | peak MiB (profiler) | budget | step ms | eager plain "
                "ms | time / plain | compile s (first 2 steps) | cache hits |",
                "|---|---|---|---|---|---|---|---|---|---|",
            ]
            for r in comp["runs"]:
                hits = ", ".join(f"{k.split('.')[0]} {v}" for k, v in r["cache_hits"].items())
                lines.append(
                    f"| {r['k']} | {r['activation_memory_budget']:.2f} | {mib_cell(r['budget_bytes'])} | "
                    f"{mib_cell(r['peak_bytes'])} | {verdict_cell(r['meets_budget'])} "
                    f"| {r['median_step_s'] * 1000:.0f} | "
                    f"{r['eager_plain_median_s'] * 1000:.0f} | {ratio_cell(r['time_vs_plain'])} "
                    f"| {r['compile_s']:.0f} | "
                    f"{hits} |"
                )
        if comp["skipped"]:
            skipped = "; ".join(f"budget {x['k']} ({x['why']})" for x in comp["skipped"])
            lines.append(f"\nSkipped: {skipped}.")
        if comp["error"]:
            lines.append(f"\nFailed: `{comp['error']}`.")
    if results["meta"].get("plot"):
        lines += ["", f"![peak against recompute FLOPs]({results['meta']['plot']})"]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, d in results["workloads"].items() if "error" not in d]
    columns = min(2, len(names))
    rows = -(-len(names) // columns)
    fig, grid = plt.subplots(rows, columns, figsize=(5.6 * columns, 4.0 * rows), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[len(names) :]:
        ax.set_visible(False)
    for ax, name in zip(axes, names, strict=False):
        data = results["workloads"][name]
        configs = data["configs"]
        for row in data["budgets"]:
            ax.axhline(row["budget_bytes"] / MIB, color="0.8", lw=0.8, zorder=0)
            ax.annotate(
                f"B{row['k']}",
                (0.99, row["budget_bytes"] / MIB),
                xycoords=("axes fraction", "data"),
                fontsize=7,
                color="0.45",
                ha="right",
                va="bottom",
            )
        for method, marker, color in (("counting", "s", "tab:orange"), ("planner", "o", "tab:blue")):
            xs = [r[method]["recompute_flops"] / 1e9 for r in data["budgets"]]
            ys = [r[method]["real_peak_bytes"] / MIB for r in data["budgets"]]
            label = "whole-block counting" if method == "counting" else "planner"
            ax.plot(xs, ys, marker, color=color, label=label, mfc="none" if method == "counting" else color, ms=7)
            for row, x, y in zip(data["budgets"], xs, ys, strict=True):  # which budget each point is for
                ax.annotate(
                    str(row["k"]),
                    (x, y),
                    xytext=(4, -9 if method == "counting" else 3),
                    fontsize=6,
                    textcoords="offset points",
                    color=color,
                )
        ax.plot(
            [data["full"]["recompute_flops"] / 1e9],
            [configs["native"]["real_peak_bytes"] / MIB],
            "^",
            color="tab:green",
            label="native switch",
            ms=7,
        )
        ax.plot([0], [configs["plain"]["real_peak_bytes"] / MIB], "x", color="k", label="plain", ms=7)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("recompute GFLOP per step")
        ax.set_ylabel("peak MiB (real step)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper right")
    fig.suptitle(
        "Peak of a real training step against the FLOPs it recomputes; grey lines: the budgets B0..B4, "
        "numbers: the budget each point was chosen for",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# main --------------------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="quick sizes: about 6-8 minutes on a 2-core CPU")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one budget, no compile: seconds (CI)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--plots", action="store_true", help="write the plot (needs matplotlib)")
    parser.add_argument("--workloads", nargs="+", choices=NAMES, help="a subset (default: the suite's)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, see README)")
    parser.add_argument("--compile-box", type=float, help="seconds of compiling allowed per workload (suite default)")
    args = parser.parse_args()
    if args.plots and importlib.util.find_spec("matplotlib") is None:  # said before the suite runs, not after it
        parser.error(
            '--plots needs matplotlib, which the bench extra installs: pip install -c constraints.txt -e ".[bench]"'
        )
    suite = "smoke" if args.smoke else "quick" if args.quick else "full"
    plan = dict(SUITES[suite])
    if args.compile_box is not None:
        plan["compile_box_s"] = args.compile_box
    torch.set_num_threads(args.threads)
    stem = "recompute" if suite == "quick" else f"recompute_{suite}"
    started = time.perf_counter()
    workloads: dict[str, Any] = {}
    for name in args.workloads or plan["workloads"]:
        log(f"{name} ({suite})")
        began = time.perf_counter()
        try:
            workloads[name] = measure(name, suite, plan)
        except Exception as error:  # recorded; the other workloads still run
            workloads[name] = {"error": f"{type(error).__name__}: {error}"}
            log(f"  failed: {workloads[name]['error']}")
        workloads[name]["wall_s"] = round(time.perf_counter() - began, 1)
        log(f"{name} done in {workloads[name]['wall_s']:.0f} s")
    plot_path = ROOT / "docs" / "images" / "recompute.png" if suite == "quick" else args.out / f"{stem}.png"
    results = {
        "meta": {
            "suite": suite,
            "device": "cpu",
            "threads": args.threads,
            **{p: importlib.metadata.version(p) for p in ("torch", "lightning", "diffusers", "transformers", "peft")},
            **{k: v for k, v in plan.items()},
            "fractions": {str(k): v for k, v in FRACTIONS.items()},
            "optimizer": "AdamW(lr=1e-6), zero_grad(set_to_none=True) between forward and backward",
            "plot": None,
        },
        "workloads": workloads,
    }
    if args.plots:
        log(f"wrote {plot(results, plot_path)}")
        results["meta"]["plot"] = os.path.relpath(plot_path, args.out.resolve())
    results["meta"]["wall_s"] = round(time.perf_counter() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = args.out / f"{stem}.json", args.out / f"{stem}.md"
    json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    md_path.write_text(markdown(results))
    log(f"wrote {json_path} and {md_path} in {results['meta']['wall_s']:.0f} s")
    return 1 if any("error" in d for d in workloads.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
