"""The dry-run baseline against an independent meter of the real step: every storage any op receives or returns, plus
what is alive from the start, from first sight until it is freed (issue 15, items 5 and 7).

The meter shares no code with :mod:`lightning_memopt.memory`. The models (from ``tests/zoo.py``) are built from the
small configs diffusers' own tests use (SD3, Latte, DiT) and a PEFT LoRA Llama as a fine-tune feeds it (token ids,
attention mask, labels).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader

from lightning_memopt import MemOpt, estimate
from lightning_memopt.memory import CPUPeakTracker
from tests import zoo
from tests.helpers import TRAINER_ARGS, heavy

Batch = dict[str, torch.Tensor]


class Meter(TorchDispatchMode):
    """Every CPU storage that an op receives (``torch.from_numpy`` tensors first appear there) or returns, and those
    added, counted from first sight until freed; the peak of their sum."""

    def __init__(self) -> None:
        super().__init__()
        self.current = self.peak = 0
        self.live: dict[int, int] = {}

    def add(self, tensors: Any) -> None:
        for value in tree_flatten(tensors)[0]:
            if not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor) or value.device.type != "cpu":
                continue  # fake tensors: MemOpt's own dry runs, inside the batch
            storage = value.untyped_storage()
            if id(storage) in self.live:
                continue
            self.live[id(storage)] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, id(storage))

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.add((args, kwargs))
        out = func(*args, **kwargs)
        self.add(out)
        return out


class Metered(pl.Callback):
    """The meter around every train and predict batch, with the weights, gradients, optimizer state and batch."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self._meter: Meter | None = None

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        self._meter = Meter()
        self._meter.add([*pl_module.parameters(), *pl_module.buffers(), batch])
        self._meter.add([p.grad for p in pl_module.parameters() if p.grad is not None])
        self._meter.add([list(s.values()) for o in trainer.optimizers for s in o.state.values()])
        self._meter.__enter__()

    def _stop(self) -> None:
        assert self._meter is not None
        self._meter.__exit__(None, None, None)
        self.peaks.append(self._meter.peak)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any) -> None:
        self._start(trainer, pl_module, batch)

    def on_train_batch_end(self, *args: Any) -> None:
        self._stop()

    def on_predict_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any
    ) -> None:
        self._start(trainer, pl_module, batch)

    def on_predict_batch_end(self, *args: Any) -> None:
        self._stop()


def test_tensors_made_from_numpy_are_counted_by_both() -> None:
    """``torch.from_numpy`` and ``torch.tensor`` reach a dispatch mode as ``aten.lift_fresh``, so the tracker counts
    them as it counts any op's result; ``torch.frombuffer`` does not, and the meter counts it where an op reads it."""
    weights = torch.zeros(100)  # 400 bytes, alive from the start
    with Meter() as meter, CPUPeakTracker() as tracker:
        tracker.add([weights])
        meter.add([weights])
        made = torch.from_numpy(np.zeros(50, dtype=np.float32))  # 200 bytes
        out = weights[:50] + made  # 200 bytes
        raw = torch.frombuffer(bytearray(40), dtype=torch.float32)  # 40 bytes no op returns
        more = raw + 1  # 40 bytes
        del made, out, raw, more
    assert (meter.peak, meter.current) == (880, 400)
    assert tracker.peak == 840


class Step(pl.LightningModule):
    def __init__(self, make: Callable[[], nn.Module], forward: Callable[[nn.Module, Batch], torch.Tensor]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = make()
        self.forward_fn = forward
        self.peaks: list[int] = []

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return self.forward_fn(self.net, batch)

    def predict_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        """Metered inside the step, so that MemOpt's dry runs in the batch hooks are not."""
        with Meter() as meter:
            meter.add([*self.parameters(), *self.buffers(), batch])
            out = self.forward_fn(self.net, batch)
        self.peaks.append(meter.peak)
        return out

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def run(model: Step, data: list[Batch], stage: str, *callbacks: pl.Callback) -> None:
    trainer = pl.Trainer(
        **TRAINER_ARGS, limit_train_batches=len(data), limit_predict_batches=1, callbacks=list(callbacks)
    )
    loader = DataLoader(data, batch_size=None)
    trainer.fit(model, loader) if stage == "fit" else trainer.predict(model, loader)


def tokens(g: torch.Generator) -> Batch:
    ids = torch.randint(0, 128, (2, 32), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


PREDICT: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], Batch], Callable[..., Any]]] = {
    "sd3": (
        zoo.sd3_as_tested,
        lambda g: {
            "x": torch.randn(2, 4, 8, 8, generator=g),  # diffusers' tests take 32 x 32 and 154 tokens: slow here
            "c": torch.randn(2, 16, 32, generator=g),
            "p": torch.randn(2, 64, generator=g),
            "t": torch.randint(0, 1000, (2,), generator=g),
        },
        lambda m, b: m(b["x"], encoder_hidden_states=b["c"], pooled_projections=b["p"], timestep=b["t"]).sample,
    ),
    "latte": (
        zoo.latte_as_tested,
        lambda g: {
            "x": torch.randn(1, 4, 3, 8, 8, generator=g),
            "c": torch.randn(1, 8, 8, generator=g),
            "t": torch.randint(0, 1000, (1,), generator=g),
        },
        lambda m, b: m(b["x"], encoder_hidden_states=b["c"], timestep=b["t"], enable_temporal_attentions=False).sample,
    ),
    "dit": (
        zoo.dit_as_tested,
        lambda g: {
            "x": torch.randn(4, 4, 8, 8, generator=g),
            "t": torch.randint(0, 1000, (4,), generator=g),
            "y": torch.randint(0, 4, (4,), generator=g),
        },
        lambda m, b: m(b["x"], timestep=b["t"], class_labels=b["y"]).sample,
    ),
}


@pytest.mark.parametrize("case", heavy(list(PREDICT), "sd3", "dit"))
def test_predict_baseline_equals_the_meter(case: str) -> None:
    """MemOpt's baseline dry run replays each chunked block alone at several settings: the block then ran with the
    last replay's chunking (DiT's baseline was 37,600 bytes against 46,176 metered), and the real step with MemOpt's
    chunking came out above its baseline."""
    make, sample, forward = PREDICT[case]
    batch = sample(torch.Generator().manual_seed(0))
    plain, changed, memopt = Step(make, forward), Step(make, forward), MemOpt()
    run(plain, [batch], "predict")
    run(changed, [batch], "predict", memopt)
    assert memopt.report.baseline_peak_bytes == plain.peaks[0]
    assert memopt.report.peak_bytes == changed.peaks[0]
    assert estimate(Step(make, forward), batch, "predict").plain.bytes == plain.peaks[0]


@pytest.mark.slow  # heavy: run by CI with -m slow
def test_lora_llama_fit_estimate_equals_the_meter() -> None:
    """transformers reads fake tensors as a trace and builds the causal mask its eager path skips, after finding the
    attention mask all ones and the positions unpacked: the estimate was 467,180 bytes against 450,796 metered."""

    def forward(m: nn.Module, b: Batch) -> torch.Tensor:
        return m(**b).loss

    data = [tokens(torch.Generator().manual_seed(i)) for i in range(2)]
    plain, changed, memopt = Metered(), Metered(), MemOpt()
    run(Step(zoo.lora_llama, forward), data, "fit", plain)
    run(Step(zoo.lora_llama, forward), data, "fit", MemOpt(measure=False), changed)
    result = estimate(Step(zoo.lora_llama, forward), data[0], "fit")
    assert result.plain.bytes == plain.peaks[1]  # a later step: gradients and optimizer state alive
    assert result.memopt.bytes == changed.peaks[1] < plain.peaks[1]
    run(Step(zoo.lora_llama, forward), data, "fit", memopt)
    assert memopt.report.baseline_peak_bytes == plain.peaks[1]
