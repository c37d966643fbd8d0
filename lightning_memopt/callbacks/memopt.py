"""The ``MemOpt`` callback: Lightning glue that opens one :class:`~lightning_memopt.engine.stage.Stage` when fit
starts and one when each predict, validation or test loop starts, calls it from the Trainer's hooks, and undoes
everything at the end."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

import lightning_memopt.plans as plans
from lightning_memopt.callbacks.publish import log_metrics, print_report, publish
from lightning_memopt.engine.config import MemOptConfig, options_checked
from lightning_memopt.engine.report import Applied, MemOptReport
from lightning_memopt.engine.schedule import Shapes
from lightning_memopt.engine.stage import (
    Hooks,
    Stage,
    agree_over,
)
from lightning_memopt.engine.step import STEPS, StepContext
from lightning_memopt.engine.step import Stage as StageName
from lightning_memopt.handles import run_all
from lightning_memopt.timing import unseen_bytes

#: The layout of :meth:`MemOpt.state_dict`; a checkpoint of another is not read (its settings are chosen again).
STATE_VERSION = 1


class MemOpt(Callback):
    """Make big models fit, results unchanged unless lossy=True: its techniques under one budget, undone at the end.

    At fit, gradient checkpointing of every repeated block, the loss and the feed-forward in chunks where they hold
    the peak, and the training state's techniques (gradients freed after the optimizer step, the optimizer step in
    the backward pass; with lossy=True Adam's moments and frozen weights kept in 8 bits); in predict, validation and
    test loops (sampling in validation_step included), feed-forward chunking and VAE decode slicing. Every model
    inside the LightningModule is found (diffusers, transformers, PEFT-wrapped or plain torch) and the model
    library's own switch is used where it has one; a generic torch technique covers the rest. Settings are chosen
    and the baseline is measured by dry runs of the step on fake tensors, which run none of the user's computations
    for real; the saving goes to every logger under memopt/. When the run ends, normally or with an exception, every
    model is restored exactly as it was.

    Args:
        checkpointing: None (the default) is "auto" where memory_budget is given and True otherwise: a budget alone is
            enough for the blocks to be planned under it. True switches on non-reentrant gradient (activation)
            checkpointing of every block when fit starts. "auto" chooses instead, by dry runs before the first batch,
            each block's mode, what it recomputes in the backward pass: none (nothing), feed_forward_selective or
            selective (the cheap ops, such as activations and norms, of its feed-forward modules or of the whole block),
            feed_forward (its feed-forward modules' forward), attention (all but its fused attention), full or whole
            (its forward, at the model library's own granularity or as one segment); each block is offered the modes
            that apply to it. The mix taken has the least predicted step time (a time model prices every op by its FLOPs
            or bytes, each checkpoint call and each op a selective policy routes) whose modelled peak meets
            memory_budget, or, without a budget, stays within 5% of the peak with every block fully checkpointed
            (checkpointing=True). On an accelerator "auto" also weighs offload: full, with the block's inputs that carry
            gradients kept in host memory until its recomputation (exact; priced by the bytes over the host link, there
            and back). "offload" checkpoints every block so whatever the budget (on a CPU, whose host is the device, it
            saves nothing).
        chunked_loss: At fit, compute the loss of transformers' causal language models (Llama, Mistral, Qwen2,
            Qwen3, Gemma, Gemma 2 and 3 without logit soft-capping, Phi, Phi-3, GPT-NeoX; PEFT-wrapped ones too)
            called with labels= from their final hidden states in chunks of tokens, so that the logits are never
            whole; outputs.logits is computed when the step reads it. Chosen by the same dry runs as the blocks'
            modes: under memory_budget together with them, and without a budget wherever the logits would hold the
            peak. Loss and gradients are those of the model's own loss (float32, as its own).
        chunking: Chunk the feed-forward layers, and slice (under a budget, tile) VAE decodes, when a predict,
            validation or test loop starts; undone when it ends. At fit, each repeated block's feed-forward runs on
            slices of the sequence, each recomputed in the backward pass, where that lowers the peak (chosen by the
            same dry runs as the blocks' modes).
        chunk_size: "auto" (the default) chooses each block's slice, and whether a VAE decode is sliced, from dry runs
            of the loop's first batch, before it runs: the mix predicted fastest (by the time model) whose whole peak
            meets memory_budget, or without a budget is within 5% of the peak with each block at its finest setting of
            at most 16 slices (a block stays unchunked where the peak is there already). A VAE decode is sliced where it
            holds that peak, and tiled only with lossy=True when a budget cannot be met otherwise. A batch with longer
            inputs is planned again. An int is the number of positions in one feed-forward slice; where a model needs it
            to divide the chunked length, each block uses the largest divisor of its own length that is at most this.
        chunk_dim: The dimension that is chunked: 1 is the sequence, 0 the batch. Blocks whose library fixes the
            dimension keep their own. With chunk_size="auto", it is the dimension preferred where both give as many
            slices.
        memory_budget: The peak memory to stay under: bytes (int), a size such as 12GiB or 500MB, a fraction in
            (0, 1] of the device's memory (physical RAM on CPU), or "auto": 95% of what the device had for this
            process when the stage started (on a GPU its free memory plus what this process's allocator held; on CPU
            the available RAM plus what this process held), the other 5% left for the allocator's rounding and
            fragmentation. At fit, the budget is planned for with checkpointing="auto" (the default where a budget is
            given); checkpointing=True checkpoints every block in full whatever the budget.
        models: Act only on these attributes of the LightningModule, such as ["unet"]. By default every model found
            is used.
        checkpoint_blocks: Checkpoint exactly the outermost instances of these block classes (class names), with the
            generic technique, instead of what each model's own switch would pick.
        strict: Raise instead of warning when a model has nothing MemOpt can checkpoint or chunk.
        measure: Measure one batch (at fit the first of the second optimizer step, at predict the first): its peak
            without the changes from a dry run on fake tensors, its peak and time with them from the real step; log
            the figures and print a summary. False measures nothing (tuning still runs its dry runs).
        verify: On the measured batch, compare the loss and every gradient (fit) or the outputs (predict) with and
            without the changes, and raise VerificationError (lightning_memopt.VerificationError) naming the module
            where they differ. This runs the step a second time, for real, on a copy of the batch; see the docs for
            what that run puts back and what it cannot.
        verify_tolerance: The largest relative difference verify accepts.
        free_gradients: At fit, free the gradients right after the optimizer step instead of when Lightning zeroes
            them, after the next step's forward pass: they are not alive through it. Exact; off, with a warning, under
            manual optimization or where a hook of yours runs on_before_zero_grad. Pass False if a hook of yours reads
            .grad after the optimizer step (in on_train_batch_end, say).
        optimizer_in_backward: At fit, step each parameter inside the backward pass as soon as its gradient is
            accumulated, with your optimizer (its class, hyperparameters, state and schedule; its state_dict and
            checkpoints unchanged), and free the gradient then: the gradients never exist at once. "auto" (the default)
            does it under memory_budget where the planner predicts it the fastest way to meet it; True always. "host"
            also keeps the optimizer's state in host memory and steps each parameter there (its gradient copied to the
            host, the updated parameter back): the device holds no optimizer state; under "auto" the planner weighs this
            too on an accelerator (never on a CPU, whose host is the device). Exact, on the optimizers that update each
            parameter from its own gradient (SGD, Adam, AdamW and the like); left off, with a warning naming the
            setting, under accumulate_grad_batches > 1, gradient clipping by norm, manual optimization,
            precision="16-mixed", several processes (DDP, FSDP) and other optimizers (LBFGS). Your hooks that read
            gradients after the backward pass (on_after_backward, on_before_optimizer_step) then see none: a warning
            names them. Off under verify, which compares the gradients.
        optimizer_state_8bit: At fit, keep Adam's and AdamW's two moments in 8 bits between steps (blockwise, a
            quarter of their float32 bytes; parameters under 4,096 values keep theirs), your optimizer doing each
            update in full precision a few parameters at a time; its state_dict and checkpoints in its own format.
            Changes results: needs lossy=True. "auto" (the default) does it under memory_budget where no setting
            that keeps results is predicted faster to meet it; True always.
        weights_8bit: In any stage, keep the weights of linear and convolution layers in 8 bits (blockwise, about
            1 byte per weight), each computed in its own type one layer at a time; at fit only the frozen ones (a LoRA
            base). Trainable parameters, LoRA adapters, norms, embeddings, a language model's head and layers under
            4,096 weights keep their type. The originals are kept off the device (on CPU in a temporary file) and put
            back exactly when the stage ends; a state_dict() taken meanwhile holds them. Changes results: needs
            lossy=True. "auto" (the default) does it under memory_budget where no setting that keeps results is
            predicted faster, on the fewest layers that meet it, the largest first, and where 8 bits on every layer
            are not enough, the largest of them in 4 bits (NF4, blockwise, about half a byte per weight, as QLoRA keeps
            a frozen base); True on every layer it can, in 8 bits; "nf4" on every layer it can, in 4 bits.
        lossy: Allow techniques whose results differ from plain beyond float rounding: VAE tiling, an 8-bit
            optimizer state and weights in 8 bits (each chosen only under a budget: VAE tiling where nothing else
            meets it, the 8-bit state and weights where nothing that keeps results is predicted faster; the
            largest difference each made, from the plain decode on the measured batch, from the moments in full on
            the first step it kept, and from the original weights, is reported). Without it, a budget that only
            such a technique could meet is missed, and the warning says what the technique would reach. Never under
            verify.
        enabled: False makes MemOpt do nothing at all: a switch for configs and --memopt.enabled=false.

    Examples:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[MemOpt(verify=True)], logger=False, enable_checkpointing=False)
        >>> MemOpt(chunk_size=0)
        Traceback (most recent call last):
        ...
        ValueError: `chunk_size` must be a positive int or 'auto', got 0
    """

    @options_checked
    def __init__(
        self,
        checkpointing: bool | Literal["auto", "offload"] | None = None,
        chunked_loss: bool = True,
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
        free_gradients: bool = True,
        optimizer_in_backward: bool | Literal["auto", "host"] = "auto",
        optimizer_state_8bit: bool | Literal["auto"] = "auto",
        weights_8bit: bool | Literal["auto", "nf4"] = "auto",
        lossy: bool = False,
        enabled: bool = True,
    ) -> None:
        with _short_error_under_a_cli():
            self.config = MemOptConfig(
                checkpointing=checkpointing,
                chunked_loss=chunked_loss,
                chunking=chunking,
                chunk_size=chunk_size,
                chunk_dim=chunk_dim,
                memory_budget=memory_budget,
                models=models,
                checkpoint_blocks=checkpoint_blocks,
                strict=strict,
                measure=measure,
                verify=verify,
                verify_tolerance=verify_tolerance,
                free_gradients=free_gradients,
                optimizer_in_backward=optimizer_in_backward,
                optimizer_state_8bit=optimizer_state_8bit,
                weights_8bit=weights_8bit,
                lossy=lossy,
                enabled=enabled,
            )
        self.reports: dict[str, MemOptReport] = {}  # of the last call: its own stage, and during fit "validate" too
        self._stage: str | None = None  # the stage the Trainer was called for
        self._state_key = self._generate_state_key(chunk_size=chunk_size, memory_budget=memory_budget, models=models)
        self._fit: Stage | None = None
        self._loop: Stage | None = None
        self._measured: set[str] = set()  # the loops measured in this fit: once each
        self._warned: set[str] = set()
        self._saved: dict[str, dict[Shapes, dict[str, Any]]] = {}  # per stage and batch shapes: each technique's

    def __getattr__(self, name: str) -> Any:
        """The options, read-only, as attributes too: ``MemOpt(verify=True).verify``."""
        config = self.__dict__.get("config")
        if config is not None and name in MemOptConfig.names():
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def report(self) -> MemOptReport | None:
        """The report of the last fit, predict, validate or test call (during fit, the validation loop's is in
        :attr:`reports`)."""
        return self.reports.get(self._stage) if self._stage is not None else None

    @property
    def applied(self) -> list[Applied]:
        """What MemOpt has in force on which model in the current or last run (what it set up but left off, such as an
        8-bit state without ``lossy=True``, is not among them: it is in the report's ``set_up``)."""
        return self.report.applied if self.report is not None else []

    @override
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

    # opening a stage ------------------------------------------------------------------------------------------------

    def _open(
        self,
        stage: StageName,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        report: MemOptReport,
        skipped: Callable[[str], None],
        quiet: bool,
        measure: bool,
    ) -> Stage | None:
        """The stage's techniques applied to the models, and the stage that drives them (``None`` where it has
        nothing to do: no technique on, or nothing changed and nothing to measure)."""
        hooks = Hooks(
            context=functools.partial(StepContext.of, trainer, stage),
            reduce_max=agree_over(trainer.strategy, pl_module.device),
            publish=lambda report, budget, how: publish(trainer, report, pl_module.device, budget, how),
            # a step timed against the prediction is one rank's alone: on one process only (ranks would report apart)
            log=(lambda metrics: log_metrics(trainer, metrics)) if trainer.world_size == 1 else None,
            unseen=lambda owner: unseen_bytes(pl_module.device, owner),
            plan_key=functools.partial(self._plan_key, trainer, pl_module, stage),
        )
        cache = self._saved.setdefault(stage, {})
        warn = lambda why: self._warn_once(f"MemOpt: {why}")  # noqa: E731
        return Stage.open(stage, pl_module, self.config, report, hooks, skipped, warn, quiet, measure, cache)

    def _plan_key(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: StageName, batch: Any, target: int | None
    ) -> str | None:
        """The key a plan of ``stage`` for ``batch`` is kept under between runs (:mod:`~lightning_memopt.plans`):
        the models, the batch, the options, the device, the Trainer's facts that reach the step and the step's code."""
        if plans.path() is None:
            return None
        context = StepContext.of(trainer, stage)
        optimizers = [
            [type(o).__qualname__, o.defaults, [len(g["params"]) for g in o.param_groups]] for o in context.optimizers
        ]
        facts = [
            context.precision_name,
            context.accumulate_grad_batches,
            context.gradient_clip_val,
            context.gradient_clip_algorithm,
            context.world_size,
            type(trainer.strategy).__qualname__,
            context.automatic,
            optimizers,
            context.schedulers,
            context.readers,
            context.zero_grad_readers,
        ]
        return plans.key_of(
            stage,
            plans.tree(pl_module),
            plans.layout(batch),
            dataclasses.asdict(self.config),
            target,
            str(pl_module.device),
            facts,
            plans.source(type(pl_module), STEPS[stage]),
        )

    # fit ------------------------------------------------------------------------------------------------------------

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stage, self.reports, self._measured = "fit", {"fit": MemOptReport("fit", str(pl_module.device))}, set()
        self.restore()
        report = self.reports["fit"]
        self._fit = self._open("fit", trainer, pl_module, report, self._nothing_to_do, False, self.config.measure)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._fit is not None:
            self._fit.batch_start(trainer, pl_module, batch, batch_idx)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        if self._fit is not None:
            self._fit.before_backward()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._fit is not None:
            self._fit.before_optimizer_step(pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._fit is not None:
            self._fit.batch_end(trainer, pl_module, outputs)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stage, self._fit = self._fit, None
        if stage is not None:
            stage.close()
        report = self.reports["fit"]
        if report.set_up and self.config.measure:
            print_report(report)
        self.restore()

    # predict, validation and test loops ---------------------------------------------------------------------------

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._loop_start(trainer, pl_module, "predict")

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._loop_start(trainer, pl_module, "validate")

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._loop_start(trainer, pl_module, "test")

    @override
    def on_predict_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._loop_batch_start(trainer, pl_module, batch, batch_idx, dataloader_idx)

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._loop_batch_start(trainer, pl_module, batch, batch_idx, dataloader_idx)

    @override
    def on_test_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._loop_batch_start(trainer, pl_module, batch, batch_idx, dataloader_idx)

    @override
    def on_predict_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int, *args: Any
    ) -> None:
        if self._loop is not None:
            self._loop.batch_end(trainer, pl_module, outputs)

    @override
    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int, *args: Any
    ) -> None:
        if self._loop is not None:
            self._loop.batch_end(trainer, pl_module, outputs)

    @override
    def on_test_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int, *args: Any
    ) -> None:
        if self._loop is not None:
            self._loop.batch_end(trainer, pl_module, outputs)

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._loop_end(trainer, pl_module)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._loop_end(trainer, pl_module)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._loop_end(trainer, pl_module)

    def _loop_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: StageName) -> None:
        """A loop without gradients starts: its techniques on top of whatever fit has in force (its checkpointing
        does nothing without gradients), undone when the loop ends."""
        inside_fit = trainer.state.fn == "fit"
        if not inside_fit:
            self.restore()
            self._stage, self.reports, self._measured = stage, {}, set()
        report = self.reports.get(stage) if stage in self._measured else None  # the loop's figures, kept
        report = self.reports[stage] = report or MemOptReport(stage, str(pl_module.device))
        # during fit, `strict` is about the training steps: a validation loop with nothing to chunk is only said, once
        skipped = self._nothing_to_do if not inside_fit else self._said_in_validation
        quiet = stage in self._measured or trainer.sanity_checking  # say it once per fit, not every epoch
        measure = self.config.measure and stage not in self._measured
        self._loop = self._open(stage, trainer, pl_module, report, skipped, quiet, measure)

    def _loop_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int
    ) -> None:
        if self._loop is not None:
            loader = dataloader_idx if len(_batch_counts(trainer, self._loop.stage)) > 1 else None  # as Lightning
            self._loop.batch_start(trainer, pl_module, batch, batch_idx, dataloader_idx, loader)

    def _loop_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stage, self._loop = self._loop, None
        if stage is not None:
            stage.close()
            inside_fit = trainer.state.fn == "fit"
            if stage.report.set_up and stage.measure and (stage.measured or not inside_fit):
                print_report(stage.report)  # during fit, once for each kind of loop: the one it was measured in
            if stage.measured:
                self._measured.add(stage.stage)
        if trainer.state.fn != "fit":
            self.restore()

    # the end, however it comes ------------------------------------------------------------------------------------

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.restore()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.restore()

    @property
    def state_key(self) -> str:
        return self._state_key  # Lightning reads it around every hook call, so it is computed once

    @override
    def state_dict(self) -> dict[str, Any]:
        """What was chosen, so that a resumed run does not choose again: per stage and batch shapes, each technique's
        settings (its own ``state()``: the blocks' checkpointing modes, chunk settings, VAE decode modes), under the
        layout's ``version``."""
        return {
            "version": STATE_VERSION,
            "settings": {
                stage: [[[list(s) for s in key], states] for key, states in cache.items()]
                for stage, cache in self._saved.items()
            },
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The settings a run saved, reused for batches of the same shapes. A state of another layout (another
        ``version``) is not read: the settings are chosen again, as in a new run, and a warning says so."""
        if state_dict.get("version") != STATE_VERSION:
            rank_zero_warn(
                f"MemOpt: the checkpoint's MemOpt state has version {state_dict.get('version')!r} where this MemOpt"
                f" reads version {STATE_VERSION}: its settings are not reused, they are chosen again by dry runs."
            )
            self._saved = {}
            return
        self._saved = {
            stage: {tuple(tuple(s) for s in key): dict(states) for key, states in entries}
            for stage, entries in state_dict["settings"].items()
        }

    def restore(self) -> None:
        """Undo every change MemOpt made to the models. Safe to call at any time, and more than once; every part is
        undone even when one raises (the first error is raised after)."""
        stages = [s for s in (self._loop, self._fit) if s is not None]  # the loop opened last comes off first
        self._fit, self._loop = None, None
        run_all([functools.partial(s.close, completed=False) for s in stages])

    # helpers --------------------------------------------------------------------------------------------------------

    def _nothing_to_do(self, what: str) -> None:
        if self.config.strict:
            raise RuntimeError(
                f"MemOpt: {what}. `strict=True` makes this an error; without it the model runs unchanged."
            )
        self._warn_once(f"MemOpt: {what}; it is skipped and runs unchanged.")

    def _said_in_validation(self, what: str) -> None:
        self._warn_once(f"MemOpt: in the validation loop, {what}; it runs unchanged.", say=rank_zero_info)

    def _warn_once(self, message: str, say: Callable[[str], Any] = rank_zero_warn) -> None:
        if message not in self._warned:
            self._warned.add(message)
            say(message)


def _batch_counts(trainer: pl.Trainer, stage: str) -> list[Any]:
    """The loop's number of batches per dataloader, as Lightning keeps it."""
    counts = {"predict": "num_predict_batches", "validate": "num_val_batches", "test": "num_test_batches"}
    return list(getattr(trainer, counts[stage]))


@contextlib.contextmanager
def _short_error_under_a_cli() -> Iterator[None]:
    """Turn a bad argument into a one-line exit when jsonargparse (LightningCLI) is building MemOpt.

    jsonargparse reports an error raised while it builds a class as a chained traceback of some 80 lines, with the
    message in a list near its end. A CLI user should see the message alone, as for any other bad flag; a Python
    caller still gets the ValueError.
    """
    try:
        yield
    except ValueError as error:
        frame = sys._getframe()
        while frame is not None and not frame.f_globals.get("__name__", "").startswith("jsonargparse"):
            frame = frame.f_back
        if frame is None:
            raise
        raise SystemExit(f"MemOpt: {error}") from None
