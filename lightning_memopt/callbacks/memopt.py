"""The ``MemOpt`` callback: Lightning glue that switches techniques on at fit and predict start and undoes them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_memopt.adapters import FoundModel, find_models
from lightning_memopt.techniques.checkpointing import CheckpointConfig
from lightning_memopt.techniques.chunking import ChunkConfig
from lightning_memopt.techniques.handles import HandleGroup

Technique = Literal["checkpointing", "chunking"]


@dataclass(frozen=True)
class Applied:
    """What MemOpt did to one model in the current or last run.

    Attributes:
        model: The model's attribute path and class, such as ``unet (UNet2DModel)``.
        technique: ``checkpointing`` or ``chunking``.
        method: The library switch that was used, or ``generic ...``.
        blocks: How many blocks it reached.
    """

    model: str
    technique: Technique
    method: str
    blocks: int


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
    model library's own switch is used where it has one; a generic torch technique covers the rest. When the run
    ends, normally or with an exception, every model is restored exactly as it was.

    Args:
        checkpointing: Switch on non-reentrant gradient (activation) checkpointing when fit starts.
        chunking: Chunk the feed-forward layers when predict starts.
        chunk_size: The number of positions in one feed-forward slice. Where a model needs the size to divide the
            chunked length, each block uses the largest divisor of its own length that is at most this.
        chunk_dim: The dimension that is chunked: ``1`` is the sequence, ``0`` the batch. Blocks whose library fixes
            the dimension keep their own.
        models: Act only on these attributes of the LightningModule, such as ``["unet"]``. By default every model
            found is used.
        checkpoint_blocks: Checkpoint exactly the outermost instances of these block classes (class names), with the
            generic technique, instead of what each model's own switch would pick.
        strict: Raise instead of warning when a model has nothing MemOpt can checkpoint or chunk.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[MemOpt()], logger=False, enable_checkpointing=False)
        >>> MemOpt(chunk_size=0)
        Traceback (most recent call last):
        ...
        ValueError: `chunk_size` must be a positive int, got 0
    """

    def __init__(
        self,
        checkpointing: bool = True,
        chunking: bool = True,
        chunk_size: int = 2,
        chunk_dim: int = 1,
        models: Sequence[str] | None = None,
        checkpoint_blocks: Sequence[str] | None = None,
        strict: bool = False,
    ) -> None:
        for name, value in (("checkpointing", checkpointing), ("chunking", chunking), ("strict", strict)):
            if not isinstance(value, bool):
                raise ValueError(f"`{name}` must be True or False, got {value!r}")
        self.chunk_config = ChunkConfig(chunk_size=chunk_size, dim=chunk_dim)
        self.models = _names_or_none("models", models)
        blocks = _names_or_none("checkpoint_blocks", checkpoint_blocks)
        self.checkpoint_config = CheckpointConfig(block_classes=tuple(blocks) if blocks else None)
        self.checkpointing = checkpointing
        self.chunking = chunking
        self.strict = strict
        self.applied: list[Applied] = []
        self._handles = HandleGroup()
        self._warned: set[str] = set()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
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
        self._apply(pl_module, "checkpointing", trainable, found_any=bool(models))

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.chunking:
            models = find_models(pl_module, self.models)
            self._apply(pl_module, "chunking", models, found_any=bool(models))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.restore()

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.restore()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.restore()

    def restore(self) -> None:
        """Undo every change MemOpt made to the models. Safe to call at any time, and more than once."""
        self._handles.remove()

    def _apply(
        self, pl_module: pl.LightningModule, technique: Technique, models: list[FoundModel], found_any: bool
    ) -> None:
        self.restore()
        self.applied = []
        for found in models:
            if technique == "checkpointing":
                change = found.adapter.checkpoint(found.module, self.checkpoint_config, found.skip)
            else:
                change = found.adapter.chunk(found.module, self.chunk_config, found.skip)
            if change is None:
                if not found.skip:  # a plain container of library models has nothing of its own to miss
                    self._nothing_to_do(f"{found.label} has no blocks MemOpt can use for {technique}")
                continue
            self._handles.add(change.handle)
            self.applied.append(Applied(found.label, technique, change.method, change.blocks))
            rank_zero_info(f"MemOpt: {technique} on {found.label} via {change.method} ({change.blocks} blocks).")
        if not found_any:
            self._nothing_to_do(f"{type(pl_module).__name__} contains no model MemOpt can use for {technique}")

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
