"""A callback that records the exact CPU peak memory of every train and predict batch."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_memopt.memory import CPUPeakTracker


class PeakMemory(pl.Callback):
    """Record, for every train and predict batch, the exact peak of the bytes that batch allocated on CPU.

    The figure covers the forward pass, the backward pass and the optimizer step, and leaves out what was alive
    before the batch (weights, for example). It is the same on every run, so two runs can be compared byte for byte.
    Exact accounting slows the batch down: use it to compare settings, not on every production run.

    Attributes:
        peaks: One figure per batch, in bytes, in the order the batches ran.

    Example:
        >>> probe = PeakMemory()
        >>> probe.peaks
        []
    """

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self._tracker: CPUPeakTracker | None = None

    @property
    def peak(self) -> int:
        """The largest per-batch peak seen so far, in bytes (0 before any batch)."""
        return max(self.peaks, default=0)

    def _start(self) -> None:
        self._tracker = CPUPeakTracker()
        self._tracker.__enter__()

    def _stop(self) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self.peaks.append(self._tracker.peak)
            self._tracker = None

    def on_train_batch_start(self, *args: Any) -> None:
        self._start()

    def on_train_batch_end(self, *args: Any) -> None:
        self._stop()

    def on_predict_batch_start(self, *args: Any) -> None:
        self._start()

    def on_predict_batch_end(self, *args: Any) -> None:
        self._stop()

    def on_exception(self, *args: Any) -> None:
        self._stop()
