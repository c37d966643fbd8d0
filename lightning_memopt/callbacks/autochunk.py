"""Lightning glue for chunk tuning at predict: trial batches, re-adjusting when input lengths change, rescuing a batch
that runs out of memory, and keeping every rank on the same settings."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_memopt.callbacks.measure import live_tensors
from lightning_memopt.memory import BlockPeaks, PeakProbe, free_memory, is_oom, probe_for
from lightning_memopt.techniques.chunking import ChunkUnit
from lightning_memopt.techniques.handles import AttributeOverride
from lightning_memopt.tuning import ChunkTuner, Setting, Trial, current, finer

Signature = tuple[tuple[str, tuple[tuple[int, int], ...]], ...]


def signature(units: list[ChunkUnit]) -> Signature:
    """The input lengths every block saw in its last call: settings are tuned, and cached, per signature."""
    return tuple((u.name, tuple(sorted(u.lengths.items()))) for u in units)


def describe(settings: dict[str, Setting]) -> str:
    """A short text of a set of settings, such as ``3 blocks dim 1 size 2, 1 block off``."""
    counts: dict[str, int] = {}
    for s in settings.values():
        key = "off" if s.size is None else f"dim {s.dim} size {s.size}"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} block{'s' if n > 1 else ''} {key}" for key, n in sorted(counts.items()))


def _sync_max(values: list[float], device: torch.device) -> list[float]:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return tensor.tolist()


class AutoChunk:
    """Runs the chunk tuner on predict batches and keeps the settings right for the rest of the run.

    Args:
        units: The blocks' chunk units, by their full names.
        blocks: The modules of the units, for per-block peaks.
        budget: The peak to stay under, in bytes, or ``None``.
        tune: Tune (``chunk_size="auto"``); otherwise only rescue batches that run out of memory.
        cache: Settings already tuned, per signature (from a checkpoint, or earlier in the run).
        on_change: Called with a message whenever the settings change, to log it.
    """

    def __init__(
        self,
        units: list[ChunkUnit],
        blocks: dict[str, nn.Module],
        budget: int | None,
        tune: bool,
        cache: dict[Signature, dict[str, Setting]],
        on_change: Callable[[str], None],
    ) -> None:
        self.units = units
        self.blocks = blocks
        self.budget = budget
        self.tune = tune
        self.cache = cache
        self.on_change = on_change
        self.tuner: ChunkTuner | None = None
        self.trial_batches = 0
        self.notes: list[str] = []
        self._signature: Signature | None = None
        self._probe: PeakProbe | None = None
        self._peaks: BlockPeaks | None = None
        self._device = torch.device("cpu")
        if tune and cache:  # resumed: start from the last settings tuned; tune again only if the lengths differ
            self._signature, last = list(cache.items())[-1]
            self._apply(last)
            self.on_change(f"reusing tuned settings: {describe(self.settings)}")
        elif tune:
            for unit in units:
                unit.set(unit.dim, None)  # tuning starts from the blocks as they are
            self.tuner = ChunkTuner(units, budget)

    @property
    def tuning(self) -> bool:
        return self.tuner is not None and not self.tuner.done

    @property
    def settings(self) -> dict[str, Setting]:
        return {u.name: current(u) for u in self.units}

    def batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        self._device = pl_module.device
        if not self.tuning:
            return
        assert self.tuner is not None
        self.tuner.next_trial()
        self._start_probe(trainer, pl_module, batch)

    def _start_probe(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        self._probe = probe_for(pl_module.device)
        self._probe.start(live_tensors(trainer, pl_module, batch))
        self._peaks = BlockPeaks(self._probe, self.blocks)

    def _stop_probe(self) -> tuple[int, float, dict[str, int], int]:
        assert self._probe is not None and self._peaks is not None
        self._peaks.__exit__()
        peak, seconds = self._probe.stop()
        result = (peak, seconds, dict(self._peaks.blocks), self._peaks.rest)
        self._probe = self._peaks = None
        return result

    def abort(self) -> None:
        if self._probe is not None:
            self._peaks.__exit__()  # type: ignore[union-attr]
            with contextlib.suppress(RuntimeError):
                self._probe.stop()
        self._probe = self._peaks = None

    def batch_end(self) -> bool:
        """After a predict batch. Returns True when a tuning finished with this batch."""
        if self._probe is not None:
            assert self.tuner is not None
            seen = signature(self.units)
            peak, seconds, blocks, rest = self._stop_probe()
            names = sorted(self.blocks)
            # every rank decides from the largest peaks and lengths of all ranks, so all choose the same settings
            lengths = [(u, d) for u in self.units for d in u.dims]
            values = [peak, rest, *(blocks.get(n, 0) for n in names), *(u.lengths.get(d, 0) for u, d in lengths)]
            synced = _sync_max(values, self._device)
            self._agree()  # a rank that retried a batch finer: all take its settings (a trial still, if pessimistic)
            blocks = {n: int(v) for n, v in zip(names, synced[2 : 2 + len(names)], strict=True) if v > 0}
            for (unit, dim), length in zip(lengths, synced[2 + len(names) :], strict=True):
                if length > 0:
                    unit.lengths[dim] = int(length)
            self._observe(Trial(self.settings, int(synced[0]), blocks, int(synced[1]), seconds))
            if self.tuner.done:
                self._signature = seen
                self.cache[seen] = self.settings
                self.notes = list(self.tuner.notes)
                self.on_change(f"tuned after {len(self.tuner.trials)} trial batches: {describe(self.settings)}")
                return True
            return False
        if self.tune:
            self._readjust()
        self._agree()
        return False

    def _agree(self) -> None:
        """Under DDP, a rank that rescued a batch chunks more finely than the others: every rank takes the finest size
        of each block, so that all stay on the same settings."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        sizes = _sync_max([-float(u.size or 2**31) for u in self.units], self._device)
        for unit, size in zip(self.units, sizes, strict=True):
            finest = int(-size)
            unit.size = None if finest >= 2**31 else finest

    def _observe(self, trial: Trial) -> None:
        assert self.tuner is not None
        self.trial_batches += 1
        self.tuner.observe(trial)

    def _readjust(self) -> None:
        """The lengths changed (longer videos, bigger batches): reuse settings tuned for them, or tune again."""
        seen = signature(self.units)
        changed = _sync_max([float(seen != self._signature)], self._device)[0] > 0
        if not changed:
            return
        if seen in self.cache:
            self._apply(self.cache[seen])
            self._signature = seen
            self.on_change(f"input lengths changed; reusing the settings tuned for them: {describe(self.settings)}")
            return
        self.tuner = ChunkTuner(self.units, self.budget)  # starts from the settings in force
        self.on_change("input lengths changed; tuning again from the settings in force")

    def _apply(self, settings: dict[str, Setting]) -> None:
        for unit in self.units:
            if unit.name in settings:
                unit.set(settings[unit.name].dim, settings[unit.name].size)

    def rescue(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> bool:
        """A batch ran out of memory: every block one step finer before it is retried. False when none can be.

        This stays on this rank (the retry happens inside ``predict_step``); the ranks agree again when the batch
        ends, every rank taking the finest size of each block.
        """
        free_memory(pl_module.device)
        tightened = False
        for unit in self.units:
            step = finer(unit, current(unit))
            if step is not None:
                unit.set(step.dim, step.size)
                tightened = True
        if not tightened:
            return False
        if self._probe is not None:  # a trial: the retry is measured afresh, with the finer settings
            self.abort()
            self._start_probe(trainer, pl_module, batch)
        self.on_change(f"a batch ran out of memory; retrying it with {describe(self.settings)}")
        return True


def rescue_out_of_memory(
    trainer: pl.Trainer, pl_module: pl.LightningModule, auto: AutoChunk, on_retry: Callable[[], None]
) -> AttributeOverride:
    """Wrap ``predict_step`` so that a batch that runs out of memory is retried with finer chunking, in place: the
    predictions hold every batch once, in order. The error is raised, with a clear message, only when no block can be
    chunked more finely."""
    original = pl_module.predict_step

    def predict_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
        while True:
            try:
                return original(batch, *args, **kwargs)
            except Exception as error:
                if not is_oom(error):
                    raise
                on_retry()
                if not auto.rescue(trainer, pl_module, batch):
                    raise RuntimeError(
                        "MemOpt: a predict batch ran out of memory even with every block chunked as finely as it can"
                        f" be ({describe(auto.settings)}). Lower the batch size or the input size. ({error})"
                    ) from error

    return AttributeOverride(pl_module, "predict_step", predict_step)
