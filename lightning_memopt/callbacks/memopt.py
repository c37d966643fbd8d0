"""The ``MemOpt`` callback: Lightning glue that switches techniques on at fit and predict start, measures one batch
with and without them, logs the saving, and undoes everything at the end."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils._pytree import tree_flatten

from lightning_memopt.adapters import FoundModel, find_models
from lightning_memopt.callbacks.autochunk import AutoChunk, Signature, describe, rescue_out_of_memory
from lightning_memopt.callbacks.measure import BatchMeasurement, Stage
from lightning_memopt.callbacks.report import Applied, MemOptReport, Technique, aggregate, log_report, print_report
from lightning_memopt.techniques.checkpointing import CheckpointConfig, CheckpointUnit
from lightning_memopt.techniques.chunking import ChunkConfig, ChunkUnit
from lightning_memopt.techniques.handles import HandleGroup
from lightning_memopt.tuning import CheckpointTuner, Setting, parse_budget, resolve_budget, spread


def _strategy_checkpoints(strategy: Any) -> str | None:
    """The name of the strategy if it already checkpoints activations itself."""
    if getattr(strategy, "_activation_checkpointing_kwargs", None):
        return type(strategy).__name__  # FSDPStrategy(activation_checkpointing_policy=...)
    config = getattr(strategy, "config", None)
    if type(strategy).__name__ == "DeepSpeedStrategy" and isinstance(config, dict):
        if any((config.get("activation_checkpointing") or {}).values()):
            return type(strategy).__name__
    return None


class MemOpt(Callback):
    """Make big models fit: gradient checkpointing during fit, feed-forward chunking during predict.

    Every model inside the LightningModule is found (diffusers, transformers, PEFT-wrapped or plain torch) and the
    model library's own switch is used where it has one; a generic torch technique covers the rest. One batch of each
    run is measured with and without the changes, and the saving goes to every logger under ``memopt/``. When the run
    ends, normally or with an exception, every model is restored exactly as it was.

    Args:
        checkpointing: Switch on non-reentrant gradient (activation) checkpointing when fit starts. ``"auto"`` with
            a ``memory_budget`` checkpoints only as many blocks as the training peak needs to meet it, spread
            evenly, which spends less time on recomputation; without a budget it checkpoints every block, as ``True``.
        chunking: Chunk the feed-forward layers when predict starts.
        chunk_size: ``"auto"`` (the default) chooses each block's slice from the peaks of a few predict batches: the
            coarsest setting that meets ``memory_budget``, or without a budget the coarsest that comes within 10% of
            the largest saving chunking can give; chunking stays off where it saves under 5%. An int is the number of
            positions in one feed-forward slice; where a model needs it to divide the chunked length, each block
            uses the largest divisor of its own length that is at most this.
        chunk_dim: The dimension that is chunked: ``1`` is the sequence, ``0`` the batch. Blocks whose library fixes
            the dimension keep their own. With ``"auto"``, the dim a block prefers when both give as many slices.
        memory_budget: The peak memory to stay under: bytes (int), a size such as ``"12GiB"`` or ``"500MB"``, or a
            fraction in (0, 1] of the device's memory (physical RAM on CPU).
        models: Act only on these attributes of the LightningModule, such as ``["unet"]``. By default every model
            found is used.
        checkpoint_blocks: Checkpoint exactly the outermost instances of these block classes (class names), with the
            generic technique, instead of what each model's own switch would pick.
        strict: Raise instead of warning when a model has nothing MemOpt can checkpoint or chunk.
        measure: Measure one batch (the second, or the first if there is only one) without the changes and with them,
            log the figures and print a summary. The measured batch's step runs once more, on the side, without the
            changes; nothing of that run reaches the results. ``False`` adds no work at all.
        verify: On the measured batch, compare the loss and every gradient (fit) or the outputs (predict) with and
            without the changes, and raise :class:`~lightning_memopt.verify.VerificationError` naming the module
            where they differ.
        verify_tolerance: The largest relative difference ``verify`` accepts.
        enabled: ``False`` makes MemOpt do nothing at all: a switch for configs and ``--memopt.enabled=false``.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[MemOpt(verify=True)], logger=False, enable_checkpointing=False)
        >>> MemOpt(chunk_size=0)
        Traceback (most recent call last):
        ...
        ValueError: `chunk_size` must be a positive int or 'auto', got 0
    """

    def __init__(
        self,
        checkpointing: bool | Literal["auto"] = True,
        chunking: bool = True,
        chunk_size: int | Literal["auto"] = "auto",
        chunk_dim: int = 1,
        memory_budget: int | float | str | None = None,
        models: Sequence[str] | None = None,
        checkpoint_blocks: Sequence[str] | None = None,
        strict: bool = False,
        measure: bool = True,
        verify: bool = False,
        verify_tolerance: float = 1e-5,
        enabled: bool = True,
    ) -> None:
        if not (isinstance(checkpointing, bool) or checkpointing == "auto"):
            raise ValueError(f"`checkpointing` must be True, False or 'auto', got {checkpointing!r}")
        flags = {"chunking": chunking, "strict": strict, "measure": measure, "enabled": enabled}
        for name, value in {**flags, "verify": verify}.items():
            if not isinstance(value, bool):
                raise ValueError(f"`{name}` must be True or False, got {value!r}")
        if isinstance(verify_tolerance, bool) or not isinstance(verify_tolerance, (int, float)) or verify_tolerance < 0:
            raise ValueError(f"`verify_tolerance` must be a non-negative number, got {verify_tolerance!r}")
        if chunk_size != "auto" and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(f"`chunk_size` must be a positive int or 'auto', got {chunk_size!r}")
        self.chunk_size = chunk_size
        self.chunk_config = ChunkConfig(chunk_size=2 if chunk_size == "auto" else chunk_size, dim=chunk_dim)
        self.memory_budget = parse_budget(memory_budget)
        self.models = _names_or_none("models", models)
        blocks = _names_or_none("checkpoint_blocks", checkpoint_blocks)
        self.checkpoint_config = CheckpointConfig(block_classes=tuple(blocks) if blocks else None)
        self.enabled = enabled
        self.checkpointing = checkpointing if enabled else False
        self.chunking = chunking and enabled
        self.strict = strict
        self.measure = measure
        self.verify = verify
        self.verify_tolerance = float(verify_tolerance)
        self.report: MemOptReport | None = None
        self._state_key = self._generate_state_key(chunk_size=chunk_size, memory_budget=memory_budget, models=models)
        self._handles = HandleGroup()
        self._found: list[FoundModel] = []
        self._warned: set[str] = set()
        self._measurement: BatchMeasurement | None = None
        self._target = -1
        self._measuring = False
        self._units: list[ChunkUnit] = []
        self._switches: list[CheckpointUnit] = []
        self._checkpoint_tuner: CheckpointTuner | None = None
        self._checkpoint_state: dict[str, Any] = {}
        self._baseline: tuple[int | None, float | None] = (None, None)
        self._with_all: tuple[int | None, float | None, int] = (None, None, 0)
        self._batch_shapes: list[list[int]] = []
        self._auto: AutoChunk | None = None
        self._chunk_cache: dict[Signature, dict[str, Setting]] = {}

    @property
    def applied(self) -> list[Applied]:
        """What MemOpt did to which model in the current or last run."""
        return self.report.applied if self.report is not None else []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Lightning moves BatchSizeFinder (and LearningRateFinder) to the front of the callbacks, and it searches when
        fit starts. MemOpt goes just before it, so that the batch size it finds already includes MemOpt's saving."""
        from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder

        callbacks = list(trainer.callbacks)
        tuners = [i for i, c in enumerate(callbacks) if isinstance(c, (BatchSizeFinder, LearningRateFinder))]
        if stage == "fit" and self in callbacks and tuners and callbacks.index(self) > tuners[0]:
            callbacks.remove(self)
            callbacks.insert(tuners[0], self)
            trainer.callbacks = callbacks  # a new list: the loop calling setup goes on over the old one

    # fit ------------------------------------------------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.report = MemOptReport("fit", str(pl_module.device))
        if not self.checkpointing:
            return
        owner = _strategy_checkpoints(trainer.strategy)
        if owner is not None:
            rank_zero_warn(
                f"MemOpt: {owner} already checkpoints activations; MemOpt leaves checkpointing to it and does not wrap"
                " the blocks a second time."
            )
            return
        models = find_models(pl_module, self.models)
        for found in models:
            if not any(p.requires_grad for p in found.module.parameters()):
                rank_zero_info(f"MemOpt: {found.label} has no trainable parameters; not checkpointing it.")
        trainable = [f for f in models if any(p.requires_grad for p in f.module.parameters())]
        self._start(pl_module, "checkpointing", trainable, found_any=bool(models))
        self._checkpoint_tuner = None
        budget = resolve_budget(self.memory_budget, pl_module.device)
        if self.checkpointing == "auto" and budget is not None and self._switches and self._measurement is not None:
            self.report.budget_bytes = budget
            self._checkpoint_tuner = CheckpointTuner(len(self._switches), budget)
            if self._checkpoint_state.get("switches") == [u.name for u in self._switches]:
                self._checkpoint_tuner.count = self._checkpoint_state["count"]  # resumed: tuned already
                self._choose_switches(self._checkpoint_tuner.count)
        if self.measure and not pl_module.automatic_optimization:
            rank_zero_info("MemOpt: manual optimization owns the gradients; no batch is measured.")
            self._measurement = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._measurement is None:
            return
        if self._target < 0:  # the first batch: batch counts are known now
            step = trainer.accumulate_grad_batches
            self._target = step if trainer.num_training_batches > step else 0
        if batch_idx == self._target:
            self._batch_shapes = [list(t.shape) for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
            self._measurement.start(trainer, pl_module, batch, batch_idx, None, self._without_changes)
            self._measuring = True

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        if self._measuring:
            self._measurement.before_backward()  # type: ignore[union-attr]

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._measuring:
            self._measurement.stop(pl_module)  # type: ignore[union-attr]

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._measuring:
            self._finish(trainer, pl_module, outputs, retry_step=trainer.accumulate_grad_batches)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end()

    # predict --------------------------------------------------------------------------------------------------------

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.report = MemOptReport("predict", str(pl_module.device))
        if not self.chunking:
            return
        models = find_models(pl_module, self.models)
        self._start(pl_module, "chunking", models, found_any=bool(models))
        batches = trainer.num_predict_batches[0] if trainer.num_predict_batches else 0
        self._target = 1 if batches > 1 else 0
        if not self._units:
            return
        budget = resolve_budget(self.memory_budget, pl_module.device)
        self.report.budget_bytes = budget
        tune = self.chunk_size == "auto"
        blocks = {u.name: u.module for u in self._units if u.module is not None}
        self._auto = AutoChunk(self._units, blocks, budget, tune, self._chunk_cache, self._log_change)
        self._handles.add(rescue_out_of_memory(trainer, pl_module, self._auto, self._retry_measurement))
        if self._auto.tuning:
            self._target = -1  # measured once tuning is over

    def on_predict_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._auto is not None:
            self._auto.batch_start(trainer, pl_module, batch)
        trial = self._auto is not None and self._auto.tuning
        if not trial and self._measurement is not None and batch_idx == self._target and dataloader_idx == 0:
            loader = dataloader_idx if len(trainer.num_predict_batches) > 1 else None
            self._measurement.start(trainer, pl_module, batch, batch_idx, loader, self._without_changes)
            self._measuring = True

    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._measuring:
            self._measurement.stop(pl_module)  # type: ignore[union-attr]
            self._finish(trainer, pl_module, outputs, retry_step=1)
        if self._auto is not None and self._auto.batch_end() and self._measurement is not None:
            self._target = batch_idx + 1

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end()

    # the end, however it comes ------------------------------------------------------------------------------------

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._measurement is not None:
            self._measurement.abort()
        if self._auto is not None:
            self._auto.abort()
        self._measurement, self._measuring, self._auto = None, False, None
        self.restore()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.restore()

    @property
    def state_key(self) -> str:
        return self._state_key  # Lightning reads it around every hook call, so it is computed once

    def state_dict(self) -> dict[str, Any]:
        """The tuned chunk settings, per signature of input lengths, so that a resumed run does not tune again."""
        return {
            "checkpointing": self._checkpoint_state,
            "chunk_settings": [
                [[list(lengths) for lengths in sig], {n: [s.dim, s.size, s.slices] for n, s in settings.items()}]
                for sig, settings in self._chunk_cache.items()
            ],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._checkpoint_state = dict(state_dict.get("checkpointing", {}))
        self._chunk_cache = {
            tuple((name, tuple(tuple(pair) for pair in lengths)) for name, lengths in sig): {
                n: Setting(dim, size, slices) for n, (dim, size, slices) in settings.items()
            }
            for sig, settings in state_dict.get("chunk_settings", [])
        }

    def restore(self) -> None:
        """Undo every change MemOpt made to the models. Safe to call at any time, and more than once."""
        self._handles.remove()
        self._found, self._units, self._switches = [], [], []

    # helpers --------------------------------------------------------------------------------------------------------

    def _start(self, pl_module: pl.LightningModule, technique: Technique, models: list[FoundModel], found_any: bool):
        self.restore()
        self._found = models
        self._apply(technique, quiet=False)
        if not found_any:
            self._nothing_to_do(f"{type(pl_module).__name__} contains no model MemOpt can use for {technique}")
        self._target = -1
        self._measuring = False
        self._measurement = None
        if self.measure and self.applied:
            stage: Stage = "fit" if technique == "checkpointing" else "predict"
            named = {f.name: f.module for f in models}
            self._measurement = BatchMeasurement(stage, named, self.verify, self.verify_tolerance)

    def _apply(self, technique: Technique, quiet: bool) -> None:
        assert self.report is not None
        self.report.applied, self._units, self._switches = [], [], []
        for found in self._found:
            if technique == "checkpointing":
                change = found.adapter.checkpoint(found.module, self.checkpoint_config, found.skip)
            else:
                change = found.adapter.chunk(found.module, self.chunk_config, found.skip)
            if change is None:
                if not found.skip and not quiet:  # a plain container of library models has nothing of its own to miss
                    self._nothing_to_do(f"{found.label} has no blocks MemOpt can use for {technique}")
                continue
            self._handles.add(change.handle)
            for unit in [*change.units, *change.switches]:
                unit.name = f"{found.name}.{unit.name}"
            self._units += change.units
            self._switches += change.switches
            self.report.applied.append(Applied(found.label, technique, change.method, change.blocks))
            if not quiet:
                rank_zero_info(f"MemOpt: {technique} on {found.label} via {change.method} ({change.blocks} blocks).")

    @contextlib.contextmanager
    def _without_changes(self) -> Iterator[None]:
        technique = self.applied[0].technique
        if technique == "chunking":  # switch the units off: they keep their tuned settings for afterwards
            saved = [(u, u.dim, u.size) for u in self._units]
            for unit in self._units:
                unit.size = None
            try:
                yield
            finally:
                for unit, dim, size in saved:
                    unit.set(dim, size)
            return
        enabled = [u.enabled for u in self._switches]
        self._handles.remove()
        try:
            yield
        finally:
            self._apply(technique, quiet=True)
            for unit, on in zip(self._switches, enabled, strict=True):
                unit.enabled = on

    def _retry_measurement(self) -> None:
        """A batch is retried after running out of memory: measure a later one instead."""
        if self._measuring and self._measurement is not None:
            self._measurement.abort()
            self._measuring = False
            self._target += 1

    def _log_change(self, message: str) -> None:
        rank_zero_info(f"MemOpt: {message}")

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, retry_step: int) -> None:
        measurement, report = self._measurement, self.report
        assert measurement is not None and report is not None
        self._measuring = False
        if not measurement.finish(outputs):
            self._target += retry_step
            return
        self._measurement = None
        figures = measurement.figures
        report.peak_bytes, report.step_time_s = figures.peak_bytes, figures.step_time_s
        report.baseline_peak_bytes, report.baseline_step_time_s = (
            figures.baseline_peak_bytes,
            figures.baseline_step_time_s,
        )
        report.batch_idx, report.notes = measurement.batch_idx, list(figures.notes)
        if self._auto is not None:
            report.trial_batches = self._auto.trial_batches if self._auto.tune else None
            report.chunk_settings = describe(self._auto.settings)
            report.notes += [n for n in self._auto.notes if n not in report.notes]
        aggregate(report, pl_module.device)
        if self._tune_checkpointing(trainer, pl_module, measurement):
            return  # the next batch is measured again; the figures are logged once tuning is over
        log_report(trainer, report)

    def _tune_checkpointing(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, measurement: BatchMeasurement
    ) -> bool:
        """With ``checkpointing="auto"``: after a measured step, choose how many blocks to checkpoint. True when the
        next batch is to be measured with the new choice."""
        tuner, report = self._checkpoint_tuner, self.report
        if tuner is None or report is None:
            return False
        if measurement.side_step:
            self._baseline = (report.baseline_peak_bytes, report.baseline_step_time_s)
            self._with_all = (report.peak_bytes, report.step_time_s, tuner.count)
        report.baseline_peak_bytes, report.baseline_step_time_s = self._baseline
        resumed = self._checkpoint_state.get("shapes") == self._batch_shapes and measurement.side_step
        if report.baseline_peak_bytes is None or report.peak_bytes is None or (resumed and tuner.steps == 0):
            more = False
        else:
            more = tuner.observe(report.baseline_peak_bytes, report.peak_bytes)
        report.notes += [n for n in tuner.notes if n not in report.notes]
        report.checkpointed = f"{tuner.count} of {tuner.blocks} blocks"
        if not more and tuner.count == self._with_all[2] and tuner.steps > 1:  # back to the first step's choice
            report.peak_bytes, report.step_time_s = self._with_all[:2]
        if more:
            self._choose_switches(tuner.count)
            named = {f.name: f.module for f in self._found}
            self._measurement = BatchMeasurement("fit", named, False, self.verify_tolerance, side_step=False)
            self._target = measurement.batch_idx + trainer.accumulate_grad_batches
            return True
        self._choose_switches(tuner.count)  # the final count may differ from the last one measured
        self._checkpoint_state = {
            "switches": [u.name for u in self._switches],
            "count": tuner.count,
            "shapes": self._batch_shapes,
        }
        self._log_change(f"checkpointing {report.checkpointed} for a budget of {tuner.budget} bytes")
        return False

    def _choose_switches(self, count: int) -> None:
        chosen = set(spread(len(self._switches), count))
        for index, unit in enumerate(self._switches):
            unit.enabled = index in chosen

    def _end(self) -> None:
        if self._measurement is not None and self.report is not None:
            self._measurement.abort()
            self.report.notes.append("no batch was measured: the run ended before the batch chosen for it")
        if self._auto is not None and self.report is not None:
            if self._auto.tuning:
                self._auto.abort()
                self.report.notes.append("the run ended before tuning finished; the last trial's settings were used")
            self.report.trial_batches = self._auto.trial_batches if self._auto.tune else None
            self.report.chunk_settings = describe(self._auto.settings)
            self.report.notes += [n for n in self._auto.notes if n not in self.report.notes]
        self._measurement, self._measuring, self._auto = None, False, None
        if self.report is not None and self.report.applied and self.measure:
            print_report(self.report)
        self.restore()

    def _nothing_to_do(self, what: str) -> None:
        message = f"MemOpt: {what}; it is skipped and runs unchanged."
        if self.strict:
            raise RuntimeError(message + " (`strict=True` makes this an error.)")
        if message not in self._warned:
            self._warned.add(message)
            rank_zero_warn(message)


def _names_or_none(argument: str, value: Sequence[str] | None) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str) or not all(isinstance(v, str) and v for v in value) or not value:
        raise ValueError(f"`{argument}` must be a non-empty list of names or None, got {value!r}")
    return list(value)
