"""Your own technique, planned by MemOpt under a memory budget next to the built-in ones.

``Prefetch`` is a made-up technique that trades memory for speed: before each training forward pass it holds a queue
of ``depth`` slots (64 KiB each), kept until the next pass. A deeper queue would wait less and holds more memory. It
subclasses ``lightning_memopt.Technique`` and is registered with ``lightning_memopt.register_technique``; from then on
MemOpt applies it when fit starts, plans its depth from dry runs of the first batch (with gradient checkpointing
already in force, under the same budget), reports it, logs it, keeps it in ``state_dict`` and undoes it when fit ends,
without a line of the package changed.

The budget is the peak of the step with checkpointing alone, as :func:`lightning_memopt.estimate` gives it, plus room
for two and a half slots: the planner tries 8, 4, 2, ... slots and keeps the deepest queue whose dry-run peak fits,
which is 2. On CPU dry runs count bytes exactly, so the real step's peak is the planned one to the byte. (MemOpt
warns that ``memory_budget`` is not used with ``checkpointing=True``: checkpointing itself does not use it; the
prefetch planner does.)

    python examples/custom_technique.py          # 3 training batches of a small transformer encoder
    python examples/custom_technique.py --quick  # the same (it takes a few seconds either way)

The docs page "Your own technique" (docs/techniques.md) explains each method.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

import lightning_memopt
from lightning_memopt import MemOpt, Technique
from lightning_memopt.techniques import Change, Plan, Planning, Section

warnings.filterwarnings("ignore", ".*does not have many workers.*")

#: Bytes one slot of the prefetch queue holds.
SLOT = 64 * 1024


class Prefetch(Technique):
    """Before each training forward pass a model holds a queue of ``depth`` slots, kept until the next pass. Its
    planner chooses the deepest queue whose step, as dry runs count it, stays within the budget."""

    name = "prefetch"  # its name in the report, the logged keys and the saved state
    stages = ("fit",)  # it acts on the training steps only
    option = None  # no MemOpt option turns it off: on whenever MemOpt is
    reports = ("prefetch", "prefetch_depth")  # its section's keys, read as attributes of the report
    DEPTHS = (8, 4, 2, 1, 0)  # tried in this order: the deepest first

    def __init__(self) -> None:  # one object per run of a stage
        self.depth = self.DEPTHS[0]
        self.models: list[nn.Module] = []
        self.handles: list[Any] = []
        self.held: torch.Tensor | None = None
        self.on = True

    @classmethod
    def uses_budget(cls, config: Any) -> bool:
        return True  # memory_budget steers its planner

    # applying and undoing: the only writer of its settings, undone exactly ------------------------------------------

    def apply(self, found: Any, config: Any) -> Change:
        handle = found.module.register_forward_pre_hook(self._fetch)
        self.handles.append(handle)
        self.models.append(found.module)
        return Change("a prefetch queue", 1, handle)  # the stage removes `handle` when it undoes the changes

    def _fetch(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.held = None  # the last pass's queue is let go
        if self.on and self.depth and torch.is_grad_enabled():
            self.held = torch.empty(self.depth * SLOT // 4, device=args[0].device)  # float32: 4 bytes an element

    def remove(self) -> None:  # called after the handles were removed: safe to call again
        for handle in self.handles:
            handle.remove()
        self.models, self.handles, self.held = [], [], None

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:  # the model as the user gave it, for the baseline's dry run
        self.on = False
        try:
            yield
        finally:
            self.on = True

    @property
    def changed(self) -> bool:
        return bool(self.models) and self.depth > 0 and self.on

    def describe(self) -> str | None:
        return f"depth {self.depth}" if self.models else None

    # saved and resumed ----------------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {"depth": self.depth}

    def load(self, state: dict[str, Any]) -> bool:
        if "depth" not in state:
            return False  # nothing changed: the stage plans again
        self.depth = state["depth"]
        return True

    # planning, agreeing over ranks, reporting -----------------------------------------------------------------------

    def plan(self, planning: Planning) -> Plan | None:
        if not planning.choose or not self.models:
            return None  # settings reused for these shapes (a resumed run), or nothing applied
        peaks: dict[int, int | None] = {}
        seconds, chosen = 0.0, 0
        for depth in self.DEPTHS:
            self.depth = depth
            dry = planning.run(None, steady=True)  # the step as a later one runs it: gradients and optimizer state
            seconds += dry.seconds
            peaks[depth] = dry.peak_bytes
            if dry.peak_bytes is not None and (planning.budget is None or dry.peak_bytes <= planning.budget):
                chosen = depth
                break
        self.depth = chosen  # in force from here on
        tried = ", ".join(f"{d}: {p} B" for d, p in peaks.items())
        return Plan(seconds, peak_bytes=peaks.get(chosen), said=[f"prefetch depth {chosen} (peaks tried: {tried})"])

    def agree(self, reduce_max: Any) -> None:
        """Every rank chose from its own batch: all take the shallowest queue any rank chose."""
        if self.models:
            self.depth = int(-reduce_max([-float(self.depth)])[0])

    def section(self) -> Section:
        return Section(
            settings={"prefetch": self.describe()},  # a hyperparameter memopt/fit/prefetch, and report.prefetch
            metrics={"prefetch_depth": self.depth if self.models else None},  # logged as memopt/prefetch_depth
            lines=[f"prefetch: {self.describe()}"] if self.models else [],  # a line of the printed summary
        )


class Encoder(pl.LightningModule):
    """A small transformer encoder trained to shrink its outputs: 4 layers, 3 batches of 2 sequences of 16 tokens."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.batch = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.encoder(batch).pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader([self.batch] * 3, batch_size=None)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the same run: it takes a few seconds either way")
    parser.parse_args()

    pl.seed_everything(0)
    model = Encoder()
    # 1. The step's peak with the built-in techniques alone (every block checkpointed), before anything runs.
    checkpointed = lightning_memopt.estimate(model, model.batch, stage="fit").memopt.bytes
    assert checkpointed is not None, "the dry run could not trace the step"
    budget = checkpointed + 2 * SLOT + SLOT // 2  # room for two slots of the queue, not four
    print(f"step peak with checkpointing alone: {checkpointed:,} B; budget: {budget:,} B")

    # 2. Register the technique: from now on MemOpt and estimate() apply, plan, report and undo it too.
    lightning_memopt.register_technique(Prefetch)
    try:
        memopt = MemOpt(memory_budget=budget)
        trainer = pl.Trainer(
            accelerator="cpu",
            max_epochs=1,
            limit_train_batches=3,
            logger=CSVLogger(save_dir="lightning_logs", name="custom_technique"),
            log_every_n_steps=1,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[memopt],
        )
        trainer.fit(model)
    finally:
        lightning_memopt.unregister_technique(Prefetch)

    # 3. What it chose, and what is left on the model.
    report = memopt.report  # MemOpt printed it as a summary when fit ended; the technique's keys are attributes
    assert report is not None
    print(f"report: checkpointed {report.checkpointed!r}, prefetch {report.prefetch!r}, peak {report.peak_bytes:,} B")
    print(f"logged: memopt/prefetch_depth = {report.metrics()['memopt/prefetch_depth']}")
    print(f"saved for a resumed run: {memopt.state_dict()['settings']['fit'][0][1]}")
    print(f"logs (train_loss and the memopt/ keys): {Path(trainer.logger.log_dir).resolve() / 'metrics.csv'}")
    depth, peak = report.prefetch_depth, report.peak_bytes
    if depth != 2 or peak is None or peak > budget or peak != checkpointed + depth * SLOT:
        raise SystemExit(f"check failed: depth {depth}, measured peak {peak} B, budget {budget} B")
    if model.encoder._forward_pre_hooks or any("forward" in vars(layer) for layer in model.encoder.layers):
        raise SystemExit("check failed: the model was not left as given")
    print(f"prefetch depth {depth}: measured peak {peak:,} B within the budget of {budget:,} B; model left as given")


if __name__ == "__main__":
    main()
