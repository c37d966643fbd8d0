"""A closure optimizer: 6 LBFGS steps (``max_iter=6``) of a 4-layer encoder of width 256 (8 sequences of 128 tokens),
plain, then with ``MemOpt()`` twice in the same process (the first plans; the second reuses the plan kept in a
cache folder of its own, as a user's second run of the same script does), one torch thread. Each step is timed from
the batch's start to its end; ``--peaks`` adds each step's real peak (``PeakMemory``, exact on CPU, slower).

    python -m benchmarks.closure [--peaks]

Nothing is asserted; docs/faq.md has what it measured.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.short_fit import Encoder as ShortFitEncoder


class Encoder(ShortFitEncoder):
    """short_fit's encoder, stepped by LBFGS on 6 batches of 8 sequences."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=6)

    def train_dataloader(self) -> DataLoader:
        data = torch.randn(6 * 8, 128, 256, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(data), batch_size=8)


class StepTimes(pl.Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._started = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.seconds.append(time.perf_counter() - self._started)


def fit(memopt: bool, peaks: bool) -> tuple[float, list[float], list[int]]:
    from lightning_memopt import MemOpt, PeakMemory

    times, probe = StepTimes(), PeakMemory()
    callbacks = [*([MemOpt()] if memopt else []), *([probe] if peaks else []), times]
    started = time.perf_counter()
    pl.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks,
    ).fit(Encoder())  # fmt: skip
    return time.perf_counter() - started, times.seconds, probe.peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peaks", action="store_true", help="each step's real peak too (slower)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["LIGHTNING_MEMOPT_CACHE_DIR"] = os.environ.get("LIGHTNING_MEMOPT_CACHE_DIR", cache)
        for name, memopt in (("plain", False), ("MemOpt, first run", True), ("MemOpt, second run", True)):
            total, steps, peaks = fit(memopt, args.peaks)
            print(f"{name:<19} fit {total:6.2f} s  steps " + " ".join(f"{s:.3f}" for s in steps))
            if peaks:
                print(f"{'':<19} peaks " + " ".join(f"{p:,}" for p in peaks))


if __name__ == "__main__":
    main()
