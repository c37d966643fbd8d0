"""A callback that records the peak memory of every train and predict batch."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_memopt.engine.measure import RealKinds, live_by_kind
from lightning_memopt.memory import CPUProbe, PeakProbe, probe_for


class PeakMemory(pl.Callback):
    """Record the peak memory of every train, predict, validation and test batch, as ``memopt/peak_bytes`` means it.

    The figure is everything live on the device during the batch: weights, buffers, gradients, optimizer state, the
    batch and what the forward pass, backward pass and optimizer step allocate. On CPU it is an exact byte count, the
    same on every run, so two runs can be compared byte for byte; on a GPU it is the allocator's peak.

    Exact accounting slows the batch down: use it to compare settings, not on every production run. Put it after
    :class:`MemOpt` in the callback list, so that it does not also count MemOpt's measurement of the step without its
    changes. Running under exact accounting can change floating-point results in the last bits.

    Attributes:
        peaks: One figure per train or predict batch, in bytes, in the order the batches ran.
        loop_peaks: The same for validation (``"validate"``) and test (``"test"``) batches, sanity checks included.
        held: For each figure in ``peaks``, what held that peak by kind (:data:`~lightning_memopt.memory.KINDS`), on
            CPU (empty on an accelerator).

    Examples:
        >>> probe = PeakMemory()
        >>> probe.peak
        0
    """

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self.loop_peaks: dict[str, list[int]] = {"validate": [], "test": []}
        self.held: list[dict[str, int]] = []
        self._probe: PeakProbe | None = None
        self._kinds: RealKinds | None = None
        self._into = self.peaks

    @property
    def peak(self) -> int:
        """The largest per-batch peak seen so far, in bytes (0 before any batch)."""
        return max(self.peaks, default=0)

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, into: list[int]) -> None:
        self._into = into
        self._probe = probe_for(pl_module.device)
        self._probe.start(live_by_kind(trainer, pl_module, batch))
        stage = "fit" if into is self.peaks and trainer.training else "predict"
        self._kinds = RealKinds(self._probe, trainer, pl_module, stage)

    def _stop(self) -> None:
        if self._probe is not None:
            assert self._kinds is not None
            self._kinds.close()
            self._into.append(self._probe.stop()[0])
            if self._into is self.peaks:
                self.held.append(dict(self._probe.at_peak) if isinstance(self._probe, CPUProbe) else {})
            self._probe, self._kinds = None, None

    @override
    def on_before_optimizer_step(self, *args: Any) -> None:
        if self._kinds is not None:
            self._kinds.optimizer_step()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any) -> None:
        self._start(trainer, pl_module, batch, self.peaks)

    @override
    def on_train_batch_end(self, *args: Any) -> None:
        self._stop()

    @override
    def on_predict_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any
    ) -> None:
        self._start(trainer, pl_module, batch, self.peaks)

    @override
    def on_predict_batch_end(self, *args: Any) -> None:
        self._stop()

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any
    ) -> None:
        self._start(trainer, pl_module, batch, self.loop_peaks["validate"])

    @override
    def on_validation_batch_end(self, *args: Any) -> None:
        self._stop()

    @override
    def on_test_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any) -> None:
        self._start(trainer, pl_module, batch, self.loop_peaks["test"])

    @override
    def on_test_batch_end(self, *args: Any) -> None:
        self._stop()

    @override
    def on_exception(self, *args: Any) -> None:
        self._stop()
