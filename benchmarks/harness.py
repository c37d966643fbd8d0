"""One Lightning run of a workload under one configuration: either a peak run (``PeakMemory`` after MemOpt, and the
feed-forward calls counted; its step times are under exact accounting) or a timing run (a ``time.perf_counter``
callback, no exact accounting, no hooks)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from benchmarks.workloads import Bench
from lightning_memopt import MemOpt, PeakMemory

warnings.filterwarnings("ignore", ".*does not have many workers.*")
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # also MemOpt's info lines; warnings still show
logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # "use_cache=True is incompatible with checkpointing"


@dataclass(frozen=True)
class Config:
    """A configuration of a workload: plain, the native switch by hand, or a MemOpt made fresh for every run."""

    name: str
    label: str
    memopt: Callable[[], MemOpt] | None = None
    native: bool = False
    chunk_size: int | None = None  # for the uniform grid
    budget: int | None = None
    tuned: bool = False  # chooses its settings by dry runs before the first batch


class StepTimer(pl.Callback):
    """Wall time of every train or predict batch, by batch index; on a GPU the device is synchronised around it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[int, float] = {}
        self._started = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _start(self, *args: Any) -> None:
        self._sync()
        self._started = time.perf_counter()

    def _stop(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int, *a) -> None:
        self._sync()
        self.seconds[idx] = time.perf_counter() - self._started

    on_train_batch_start = on_predict_batch_start = _start
    on_train_batch_end = on_predict_batch_end = _stop


class FeedForwardCalls(pl.Callback):
    """Calls of diffusers ``FeedForward`` modules per predict batch (each slice is one call), and the lengths along
    dim 1 that they see (in an unchunked run: every length a block chunks)."""

    def __init__(self) -> None:
        self.per_batch: list[int] = []
        self.lengths: set[int] = set()
        self._count = 0
        self._handles: list[Any] = []

    def _hook(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self._count += 1
        if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 3:
            self.lengths.add(int(args[0].shape[1]))

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for module in pl_module.modules():
            if type(module).__name__ == "FeedForward":
                self._handles.append(module.register_forward_pre_hook(self._hook))

    def on_predict_batch_start(self, *args: Any) -> None:
        self._count = 0  # after MemOpt's hook: its dry runs are not counted

    def on_predict_batch_end(self, *args: Any) -> None:
        self.per_batch.append(self._count)
        self._count = 0

    def on_predict_end(self, *args: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


@dataclass
class Run:
    """What one run gave, on its steady batches only (after the warm-up batch and MemOpt's measured batch), and
    the wall time MemOpt's dry runs spent choosing its settings before the first batch."""

    first_steady: int = 1
    peaks: list[int] = field(default_factory=list)
    all_peaks: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    ff_calls: list[int] = field(default_factory=list)
    ff_lengths: set[int] = field(default_factory=set)
    tuning_s: float | None = None
    settings: str | None = None
    error: str | None = None


def first_steady(memopt: MemOpt | None) -> int:
    """The first batch after the warm-up batch and MemOpt's measured batch (whose probe slows it down)."""
    report = memopt.report if memopt is not None else None
    measured = report.batch_idx + 1 if report is not None and report.batch_idx is not None else 0
    return max(1, measured)


def settings(memopt: MemOpt | None) -> str | None:
    report = memopt.report if memopt is not None else None
    if report is None:
        return None
    if report.checkpointed is not None:
        return f"checkpointed {report.checkpointed}"
    return report.chunk_settings


def run(bench: Bench, config: Config, batches: int, device: torch.device, peak: bool) -> Run:
    """Fit or predict ``batches`` batches of ``bench`` under ``config``: a peak run or a timing run."""
    bench.reset(batches)
    memopt = config.memopt() if config.memopt is not None else None
    probe, calls, timer = PeakMemory(), FeedForwardCalls(), StepTimer(device)
    callbacks = [c for c in (memopt, *((probe, calls) if peak else ()), timer) if c is not None]
    trainer = pl.Trainer(
        accelerator=device.type,
        devices=1,
        max_epochs=1,
        limit_train_batches=batches,
        limit_predict_batches=batches,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    result = Run()
    try:
        with contextlib.redirect_stdout(io.StringIO()), bench.native() if config.native else contextlib.nullcontext():
            if bench.workload.stage == "fit":
                trainer.fit(bench)
            else:
                trainer.predict(bench, return_predictions=False)
    except Exception as error:  # recorded in the results; the suite goes on with the next configuration
        result.error = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        return result
    start = result.first_steady = first_steady(memopt)
    result.peaks, result.all_peaks = probe.peaks[start:], list(probe.peaks)
    result.ff_calls, result.ff_lengths = calls.per_batch[start:], calls.lengths
    result.seconds = [s for i, s in sorted(timer.seconds.items()) if i >= start]
    result.tuning_s = memopt.report.tuning_s if memopt is not None and memopt.report is not None else None
    result.settings = settings(memopt)
    return result


def write_results(name: str, results: dict[str, Any], markdown: Callable[[dict[str, Any]], str], out: Path,
                  started: float) -> None:  # fmt: skip
    """``results`` (with ``meta``) as ``out/<name>.json`` and, through ``markdown``, ``out/<name>.md``: the run's wall
    time since ``started`` and the load average at its end added to ``meta`` first."""
    results["meta"].update(wall_s=round(time.perf_counter() - started, 1), load_average_end=os.getloadavg())
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / f"{name}.md").write_text(markdown(results))
    print(f"[{name}] wrote {name}.json and {name}.md in {out} at {results['meta']['wall_s']:.0f} s", flush=True)
