"""Measuring one batch: the same step without MemOpt's changes on the side (the baseline), then the real step with
them, and, with ``verify``, a comparison of the two.

The side step leaves no trace in the run's results: the measured batch starts a gradient-accumulation window, where
Lightning clears the gradients between the forward and the backward pass anyway, and the side step does the same;
random number generators, the running
statistics of normalisation layers and the state of torchmetrics metrics are put back; its logging is switched off;
and under DDP it does not synchronise. Plain Python side effects of the user's step (appending to a list, a counter)
do see the second call.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import nn
from torch.utils._pytree import tree_flatten
from torchmetrics import Metric

from lightning_memopt.memory import free_memory, is_oom, probe_for
from lightning_memopt.verify import (
    OutputRecorder,
    VerificationError,
    first_difference,
    flat_tensors,
    worst_tensor,
)

Stage = Literal["fit", "predict"]
#: Strategies whose gradients are sharded over ranks: ``verify`` does not compare gradients under them.
SHARDED_STRATEGIES = ("FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy")


@dataclass
class Figures:
    """What one measured batch gave. ``None`` means unknown."""

    peak_bytes: int | None = None
    step_time_s: float | None = None
    baseline_peak_bytes: int | None = None
    baseline_step_time_s: float | None = None
    notes: list[str] = field(default_factory=list)


def live_tensors(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> list[torch.Tensor]:
    """What is on the device before a step and stays through it: weights, buffers, gradients, optimizer state, batch."""
    tensors = [*pl_module.parameters(), *pl_module.buffers()]
    tensors += [p.grad for p in pl_module.parameters() if p.grad is not None]
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
    tensors += [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    return tensors


def clear_grads(pl_module: pl.LightningModule) -> None:
    for p in pl_module.parameters():
        p.grad = None


@contextlib.contextmanager
def _side_effects_undone(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Iterator[None]:
    """Run code whose random draws, normalisation statistics, logging and gradient sync must not reach the run."""
    norms = [m for m in pl_module.modules() if isinstance(m, nn.modules.batchnorm._NormBase) and m.training]
    saved = [[b.detach().clone() for b in m.buffers(recurse=False)] for m in norms]
    metrics = [(m, _metric_state(m)) for m in pl_module.modules() if isinstance(m, Metric)]
    python_state = random.getstate()
    numpy = __import__("sys").modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    pl_module.__dict__["log"] = pl_module.__dict__["log_dict"] = lambda *args, **kwargs: None
    no_sync = getattr(trainer.strategy.model, "no_sync", None)
    try:
        with torch.random.fork_rng(devices=devices), no_sync() if callable(no_sync) else contextlib.nullcontext():
            yield
    finally:
        pl_module.__dict__.pop("log", None)
        pl_module.__dict__.pop("log_dict", None)
        random.setstate(python_state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)
        for metric, state in metrics:
            metric.__dict__.update(state)
        with torch.no_grad():
            for module, buffers in zip(norms, saved, strict=True):
                for buffer, value in zip(module.buffers(recurse=False), buffers, strict=True):
                    buffer.copy_(value)


def _metric_state(metric: Metric) -> dict[str, Any]:
    """A copy of a torchmetrics metric's accumulated state, to put back after the side step."""
    state = {k: v.clone() if isinstance(v, torch.Tensor) else list(v) for k, v in metric.metric_state.items()}
    return {**state, "_update_count": metric._update_count, "_computed": metric._computed}


def _step_args(pl_module: pl.LightningModule, name: str, batch: Any, batch_idx: int, dataloader_idx: int | None):
    args = [batch]
    if is_param_in_hook_signature(getattr(pl_module, name), "batch_idx", min_args=2):
        args.append(batch_idx)
        if dataloader_idx is not None:
            args.append(dataloader_idx)
    return args


def _loss(output: Any) -> torch.Tensor | None:
    return output.get("loss") if isinstance(output, Mapping) else output


class BatchMeasurement:
    """Measures one batch of a stage. The callback calls these methods from its hooks, in order.

    Args:
        stage: ``fit`` or ``predict``.
        models: The models MemOpt changed, by name; with ``verify`` their modules' outputs are compared.
        side_step: Measure the step without the changes too (off: only the real step is measured).
        verify: Compare results with and without the changes and raise :class:`VerificationError` on a difference.
        tolerance: The relative tolerance of ``verify``.
    """

    def __init__(
        self, stage: Stage, models: Mapping[str, nn.Module], verify: bool, tolerance: float, side_step: bool = True
    ) -> None:
        self.stage = stage
        self.side_step = side_step
        self.models = models
        self.verify = verify
        self.tolerance = tolerance
        self.figures = Figures()
        self.batch_idx = -1
        self._probe: Any = None
        self._recorders: list[OutputRecorder] = []
        self._expected: dict[str, torch.Tensor] = {}
        self._expected_output: dict[str, torch.Tensor] = {}

    def start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int | None,
        without_changes: Callable[[], contextlib.AbstractContextManager[None]],
    ) -> None:
        """Before the real step: the side step without the changes, then start measuring the real one."""
        self.batch_idx = batch_idx
        device = pl_module.device
        had_grads = [p for p in pl_module.parameters() if p.grad is not None] if self.stage == "fit" else []
        if self.side_step:
            with without_changes():
                self._side_step(trainer, pl_module, batch, batch_idx, dataloader_idx)
        if self.stage == "fit" and self.verify and type(trainer.strategy).__name__ in SHARDED_STRATEGIES:
            self._expected = {}
            self.figures.notes.append(f"verify compared no gradients: {type(trainer.strategy).__name__} shards them")
        elif self.stage == "fit" and self.verify and trainer.world_size > 1:
            self._average_expected_grads(device)
        if self.stage == "fit":  # as in any step, last step's gradients are alive until Lightning zeroes them
            clear_grads(pl_module)
            for p in had_grads:
                p.grad = torch.zeros_like(p)
        if self.verify and self._recorders:
            self._recorders.append(OutputRecorder(self.models))
        elif self.verify and self.side_step:
            self.figures.notes.append("verify was skipped: there was no result without MemOpt to compare with")
        self._probe = probe_for(device)
        self._probe.start(live_tensors(trainer, pl_module, batch))

    def _side_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int | None
    ) -> None:
        name = "training_step" if self.stage == "fit" else "predict_step"
        args = _step_args(pl_module, name, batch, batch_idx, dataloader_idx)
        recorder = OutputRecorder(self.models) if self.verify else None
        probe = probe_for(pl_module.device)
        try:
            with _side_effects_undone(trainer, pl_module):
                probe.start(live_tensors(trainer, pl_module, batch))
                output = getattr(trainer.strategy, name)(*args)
                if recorder is not None:
                    recorder.stop()
                if self.stage == "fit" and (output := _loss(output)) is not None:
                    clear_grads(pl_module)  # as Lightning's zero_grad does between the forward and backward pass
                    scaler = getattr(trainer.precision_plugin, "scaler", None)
                    (scaler.scale(output) if scaler is not None else output).backward()
                peak, seconds = probe.stop()
            if self.stage == "fit" and self.verify:
                self._expected = {
                    n: p.grad.detach().cpu() for n, p in pl_module.named_parameters() if p.grad is not None
                }
        except Exception as error:
            with contextlib.suppress(RuntimeError):
                probe.stop()
            if not is_oom(error):
                raise
            free_memory(pl_module.device)
            self.figures.notes.append(f"the step without MemOpt ran out of memory ({type(error).__name__})")
            return
        finally:
            if recorder is not None:
                recorder.stop()
            if self.stage == "fit":
                clear_grads(pl_module)
        self.figures.baseline_peak_bytes, self.figures.baseline_step_time_s = peak, seconds
        if recorder is not None:
            self._recorders = [recorder]
            self._expected_output = {k: v.detach().cpu() for k, v in flat_tensors(output).items()}

    def _average_expected_grads(self, device: torch.device) -> None:
        """DDP averages the real step's gradients over ranks; average the side step's the same way. Every rank takes
        part, also one whose side step failed, so no collective is left waiting."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        ok = torch.tensor([1.0 if self._expected else 0.0], device=device)
        torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
        if ok.item() == 0:
            self._expected = {}
            return
        world = torch.distributed.get_world_size()
        for name, grad in self._expected.items():
            synced = grad.to(device)
            torch.distributed.all_reduce(synced)
            self._expected[name] = (synced / world).cpu()

    def before_backward(self) -> None:
        """Checkpointing runs forward again in the backward pass: stop recording outputs here."""
        for recorder in self._recorders:
            recorder.stop()

    def abort(self) -> None:
        """The run failed mid-batch: stop measuring, so that nothing stays hooked in."""
        if self._probe is not None:
            with contextlib.suppress(RuntimeError):
                self._probe.stop()
            self._probe = None
        self.before_backward()

    def stop(self, pl_module: pl.LightningModule) -> None:
        """After the real step's backward (fit) or the whole predict step: stop measuring, check gradients."""
        if self._probe is None:
            return
        self.figures.peak_bytes, self.figures.step_time_s = self._probe.stop()
        self._probe = None
        self.before_backward()
        if self.verify and self.stage == "fit" and self._expected:
            grads = {n: p.grad for n, p in pl_module.named_parameters() if p.requires_grad}
            self._check("the gradient of", worst_tensor(self._expected.items(), grads))

    def finish(self, output: Any) -> bool:
        """After the real step: check its loss or output. Returns whether the batch was measured in full."""
        if self._probe is not None:  # no backward ran (the step returned None): try another batch
            self.abort()
            return False
        if self.verify and self._expected_output:
            actual = flat_tensors(_loss(output) if self.stage == "fit" else output)
            what = "the loss" if self.stage == "fit" else "the output"
            self._check(what, worst_tensor(self._expected_output.items(), actual))
        self._recorders = []
        return True

    def _check(self, what: str, worst: tuple[str, float, float] | None) -> None:
        if worst is None or worst[2] <= self.tolerance:
            return
        name, diff, rel = worst
        subject = f"{what} `{name}`" if what.startswith("the gradient") else what
        message = (
            f"MemOpt verify: on {self.stage} batch {self.batch_idx}, {subject} differs with MemOpt's changes by"
            f" {diff:.3g} (relative {rel:.3g}, tolerance {self.tolerance:g})."
        )
        if what.startswith("the gradient"):
            message += f" That parameter belongs to module `{name.rpartition('.')[0] or name}`."
        if len(self._recorders) == 2:
            first = first_difference(self._recorders[0], self._recorders[1], self.tolerance)
            if first is not None:
                message += f" The first module whose forward output differs is `{first[0]}` (relative {first[1]:.3g})."
        raise VerificationError(message)
