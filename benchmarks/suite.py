"""The suite: configurations per workload, peak runs, budgets, timing rounds interleaved round-robin, and targets."""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.harness import Config, Run, run
from benchmarks.workloads import WORKLOADS, Bench, Workload
from lightning_memopt import MemOpt

#: Timing rounds (each configuration runs once per round, in turn) and timed steps per run.
SUITES = {"smoke": {"rounds": 1, "steps": 1}, "quick": {"rounds": 3, "steps": 3}, "full": {"rounds": 5, "steps": 5}}
#: The budgets lie this far from the lowest peak measured (every block checkpointed at fit, the finest chunking at
#: predict) towards the plain peak: "tight" near the lowest, "loose" near plain.
BUDGET_FRACTIONS = {"tight": 0.25, "loose": 0.75}
#: The batches the dry runs replace, as configurations whose steps they ran like: chunk tuning ran 3 trial batches
#: (the model as it is, every block at its finest, then the choice); checkpointing="auto" measured 2 batches, which
#: ran 3 steps (the step plain and with every block checkpointed, then the choice). On CPU they ran under exact
#: accounting, as the peak runs' steps do.
REPLACED = {"predict": ("plain", "finest", None), "fit": ("plain", "memopt", None)}


@dataclass
class Result:
    """One configuration of one workload: its peak run and every step of its timing runs."""

    config: Config
    peak_bytes: int | None = None
    first_batch_peak_bytes: int | None = None
    seconds: list[float] = field(default_factory=list)
    tracked_seconds: list[float] = field(default_factory=list)
    tuning_s: float | None = None
    ff_calls: int | None = None
    settings: str | None = None
    first_steady: int = 1
    errors: list[str] = field(default_factory=list)

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.seconds) if self.seconds else None

    @property
    def meets_budget(self) -> bool | None:
        """Whether every batch, the first included, stayed within the budget."""
        if self.config.budget is None or self.peak_bytes is None:
            return None
        return max(self.peak_bytes, self.first_batch_peak_bytes or 0) <= self.config.budget

    def as_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "name": c.name,
            "label": c.label,
            "chunk_size": c.chunk_size,
            "budget_bytes": c.budget,
            "peak_bytes": self.peak_bytes,
            "first_batch_peak_bytes": self.first_batch_peak_bytes,
            "meets_budget": self.meets_budget,
            "median_step_s": self.median_s,
            "step_times_s": self.seconds,
            "median_tracked_step_s": statistics.median(self.tracked_seconds) if self.tracked_seconds else None,
            "tuning_s": self.tuning_s,
            "ff_calls_per_batch": self.ff_calls,
            "settings": self.settings,
            "errors": self.errors,
        }


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def memopt(**kwargs: Any) -> Any:
    return lambda: MemOpt(**kwargs)


def base_configs(w: Workload) -> list[Config]:
    return [
        Config("plain", "plain"),
        Config("native", f"native: {w.native_label}", native=True),
        Config("memopt", "MemOpt()", memopt(measure=False), tuned=w.stage == "predict"),
    ]


def finest_config() -> Config:
    """Every block at its finest setting on either dim: a budget of one byte, which no setting meets."""
    return Config("finest", "MemOpt(memory_budget=1): finest", memopt(memory_budget=1, measure=False))


def uniform_configs(lengths: set[int]) -> list[Config]:
    """``MemOpt(chunk_size=k)`` for every k that gives a distinct uniform setting: each block uses the largest divisor
    of its length up to k, so the divisors of the lengths seen are the whole grid (k >= the longest is plain)."""
    longest = max(lengths, default=1)
    sizes = sorted({d for n in lengths for d in range(1, n + 1) if n % d == 0 and d < longest})
    return [
        Config(f"chunk_{k}", f"MemOpt(chunk_size={k})", memopt(chunk_size=k, measure=False), chunk_size=k)
        for k in sizes
    ]


def budget_configs(w: Workload, budgets: dict[str, int]) -> list[Config]:
    configs = []
    for key, budget in budgets.items():
        configs.append(
            Config(
                f"budget_{key}",
                f"MemOpt(memory_budget={key})",
                memopt(memory_budget=budget, measure=False),
                budget=budget,
                tuned=w.stage == "predict",
            )
        )
        if w.stage == "fit":  # chosen by dry runs before the first batch, as chunk settings are
            configs.append(
                Config(
                    f"auto_{key}",
                    f"MemOpt(checkpointing='auto', memory_budget={key})",
                    memopt(checkpointing="auto", memory_budget=budget, measure=False),
                    budget=budget,
                    tuned=True,
                )
            )
    return configs


def peak_run(bench: Bench, config: Config, device: torch.device, steps: int) -> tuple[Result, Run]:
    r = run(bench, config, 1 + steps, device, peak=True)
    result = Result(config, tuning_s=r.tuning_s, settings=r.settings, first_steady=r.first_steady)
    if r.error:
        result.errors.append(f"peak run: {r.error}")
    result.peak_bytes = max(r.peaks, default=None)
    result.first_batch_peak_bytes = r.all_peaks[0] if r.all_peaks else None
    result.ff_calls = max(r.ff_calls, default=None)
    result.tracked_seconds = r.seconds
    return result, r


def measure_workload(name: str, suite: str, device: torch.device) -> dict[str, Any]:
    """Peak runs of every configuration (budgets chosen from the first ones), then the timing rounds."""
    w, steps, rounds = WORKLOADS[name], SUITES[suite]["steps"], SUITES[suite]["rounds"]
    peak_steps = 1 if suite == "smoke" else 2
    bench = Bench(w, suite)
    results: dict[str, Result] = {}

    def peaks(configs: list[Config]) -> set[int]:
        lengths: set[int] = set()
        for config in configs:
            results[config.name], r = peak_run(bench, config, device, peak_steps)
            lengths |= r.ff_lengths
            log(f"  peak   {config.label}: {results[config.name].peak_bytes} bytes {r.error or ''}")
        return lengths

    lengths = peaks(base_configs(w))
    if w.stage == "predict":
        peaks([*uniform_configs(lengths), finest_config()])
    plain = results["plain"].peak_bytes
    lowest = min((r.peak_bytes for n, r in results.items() if n != "plain" and r.peak_bytes), default=None)
    budgets = {}
    if plain and lowest and lowest < plain:
        budgets = {key: int(lowest + f * (plain - lowest)) for key, f in BUDGET_FRACTIONS.items()}
        peaks(budget_configs(w, budgets))

    configs = [r.config for r in results.values()]
    for round_ in range(rounds):  # round-robin, each round starting one configuration later: drift cancels
        order = configs[round_ % len(configs) :] + configs[: round_ % len(configs)]
        for config in order:
            result = results[config.name]
            r = run(bench, config, result.first_steady + steps, device, peak=False)
            result.seconds += r.seconds
            if r.tuning_s is not None:  # outside exact accounting, as the timing runs are
                result.tuning_s = r.tuning_s if round_ == 0 else min(result.tuning_s or r.tuning_s, r.tuning_s)
            if r.error:
                result.errors.append(f"timing run {round_}: {r.error}")
        log(f"  timing round {round_ + 1}/{rounds} done")
    return {
        "stage": w.stage,
        "native": w.native_label,
        "size": w.sizes[suite],
        "parameters": sum(p.numel() for p in bench.parameters()),
        "trainable_parameters": sum(p.numel() for p in bench.parameters() if p.requires_grad),
        "budgets": budgets,
        "configs": [r.as_dict() for r in results.values()],
    }


# targets -----------------------------------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _target(what: str, workload: str, measured: float | None, limit: float | None, detail: str = "") -> dict:
    met = None if measured is None or limit is None else measured <= limit
    return {"target": what, "workload": workload, "measured": measured, "limit": limit, "met": met, "detail": detail}


def targets(workloads: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets of the benchmark issue, measured; plus whether every budget held (its peak over the budget)."""
    found = []
    for name, data in workloads.items():
        by = {c["name"]: c for c in data["configs"]}

        def versus(key: str, figure: str, by: dict = by) -> float | None:  # MemOpt() against another configuration
            return _ratio(by.get("memopt", {}).get(figure), by.get(key, {}).get(figure))

        if data["stage"] == "fit":
            found.append(_target("peak MemOpt() / native", name, versus("native", "peak_bytes"), 1.00))
            found.append(_target("step time MemOpt() / native", name, versus("native", "median_step_s"), 1.02))
        if name == "latte":
            found.append(_target("peak MemOpt() / plain", name, versus("plain", "peak_bytes"), 0.65))
            found.append(_target("step time MemOpt() / plain", name, versus("plain", "median_step_s"), 1.10))
        uniform = [c for c in data["configs"] if c["chunk_size"] is not None and c["median_step_s"]]
        for c in [c for c in data["configs"] if c["budget_bytes"] is not None]:
            every = max(c["peak_bytes"] or 0, c["first_batch_peak_bytes"] or 0) or None  # the first batch included
            found.append(
                _target(f"peak {c['label']} / budget, every batch", name, _ratio(every, c["budget_bytes"]), 1.0)
            )
            if data["stage"] != "predict":
                continue
            meeting = [u for u in uniform if u["peak_bytes"] and u["peak_bytes"] <= c["budget_bytes"]]
            best = min(meeting, key=lambda u: u["median_step_s"], default=None)
            detail = f"best uniform: chunk_size={best['chunk_size']}" if best else "no uniform size meets the budget"
            ratio = _ratio(c["median_step_s"], best["median_step_s"] if best else None)
            target = _target(f"step time {c['label']} / best uniform under it", name, ratio, 1.05, detail)
            if c["meets_budget"] is False:  # faster than the uniform settings, but it does not meet the budget
                target["met"], target["detail"] = False, f"{detail}; the tuned peak is OVER the budget"
            found.append(target)
        for c in [c for c in data["configs"] if c["tuning_s"] is not None and c["name"] != "finest"]:
            steps = [by.get(name, {}) if name else c for name in REPLACED[data["stage"]]]
            times = [s.get("median_tracked_step_s") for s in steps]
            old = sum(times) if all(times) else None
            what = " + ".join(s.get("label", "?") for s in steps)
            detail = f"dry runs {c['tuning_s']:.3f} s; the {len(steps)} batches they replace ({what}): {old or 0:.3f} s"
            found.append(
                _target(
                    f"tuning time {c['label']} / the batches it replaces", name, _ratio(c["tuning_s"], old), 1.0, detail
                )
            )
    return found
