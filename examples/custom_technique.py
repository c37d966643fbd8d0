"""Your own technique, planned by MemOpt under a memory budget together with the built-in ones.

``Prefetch`` is a made-up technique that trades memory for speed: before each training forward pass of a layer it fills
a queue of ``depth`` slots (4 KiB each) that the layer's backward pass uses, and frees it there. A shorter queue makes
the step wait, which the technique prices as work. It subclasses ``lightning_memopt.Technique``, offers each layer's
depth as a knob, and is registered with ``lightning_memopt.register_technique``. From then on MemOpt applies it when
fit starts, and its planner chooses each layer's depth together with each layer's checkpointing mode
(``checkpointing="auto"``), from one cost table, for the least work whose peak meets the budget; then it reports it,
logs it, keeps it in ``state_dict`` and undoes it when fit ends, without a line of the package changed.

The budget lies a quarter of the way from the peak with every layer checkpointed to the plain step's peak, as
:func:`lightning_memopt.estimate` gives them. A slot short of a full queue is priced at 10 ms of waiting, far more than
recomputing a layer of this size, so the planner checkpoints layers to make room for full queues rather than shorten
one (whatever this machine's speeds). On CPU dry runs count bytes exactly, so the real step's peak is the planned one.

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
from lightning_memopt.handles import HandleGroup
from lightning_memopt.techniques import Change, Knob, Plan, Planning, Section

warnings.filterwarnings("ignore", ".*does not have many workers.*")

#: Bytes one slot of a queue holds.
SLOT = 4 * 1024
#: The time one slot short of a full queue makes a step wait, in seconds (a knob's ``cost``, added to the step's
#: predicted time). It dwarfs a layer's recompute here, so the choice does not hang on this machine's speed.
WAIT = 0.01


class Hold(torch.autograd.Function):
    """Passes a layer's output on unchanged and holds the layer's queue until the layer's backward pass starts."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, queue: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(queue)  # freed once this node's backward has run
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class Prefetch(Technique):
    """Before each training forward pass of a layer, a queue of that layer's ``depth`` slots, held until its backward
    pass starts. Each layer's depth is a knob of the stage's planner."""

    name = "prefetch"  # its name in the report, the logged keys and the saved state
    stages = ("fit",)  # it acts on the training steps only
    option = None  # no MemOpt option turns it off: on whenever MemOpt is
    reports = ("prefetch", "prefetch_slots")  # its section's keys, read as attributes of the report
    LAYER = nn.TransformerEncoderLayer  # the layers it queues for
    DEPTHS = (0, 2, 4)  # the depths a layer may take: the first changes nothing

    def __init__(self) -> None:  # one object per run of a stage
        self.layers: list[nn.Module] = []
        self.names: list[str] = []
        self.depths: list[int] = []
        self.on = True

    @classmethod
    def uses_budget(cls, config: Any) -> bool:
        return True  # memory_budget steers its depths

    # applying and undoing: the only writer of its settings, undone exactly ------------------------------------------

    def apply(self, found: Any, config: Any) -> Change | None:
        layers = [(name, m) for name, m in found.module.named_modules() if isinstance(m, self.LAYER)]
        if not layers:
            return None  # nothing of this model to queue for
        hooks = HandleGroup()
        for name, layer in layers:
            hooks.add(layer.register_forward_hook(self._fetch))
            self.layers.append(layer)
            self.names.append(f"{found.name}.{name}")
            self.depths.append(self.DEPTHS[-1])
        return Change("a prefetch queue per layer", len(layers), hooks)  # the stage removes the hooks when it undoes

    def _fetch(self, layer: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        depth = self.depths[self.layers.index(layer)]
        if not (self.on and depth and torch.is_grad_enabled()):
            return None  # the output as it is
        queue = torch.empty(depth * SLOT // 4, device=output.device)  # float32: 4 bytes an element
        return Hold.apply(output, queue)

    def remove(self) -> None:  # called after the hooks were removed: safe to call again
        self.layers, self.names, self.depths = [], [], []

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:  # the model as the user gave it, for the baseline's dry run
        self.on = False
        try:
            yield
        finally:
            self.on = True

    @property
    def changed(self) -> bool:
        return any(self.depths) and self.on

    def describe(self) -> str | None:
        return f"depths {', '.join(map(str, self.depths))}" if self.layers else None

    # saved and resumed ----------------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {"layers": self.names, "depths": self.depths}

    def load(self, state: dict[str, Any]) -> bool:
        if state.get("layers") != self.names:
            return False  # not the same layers: nothing changed, the stage plans again
        self.depths = list(state["depths"])
        return True

    # planning, agreeing over ranks, reporting -----------------------------------------------------------------------

    def knobs(self, planning: Planning) -> list[Knob]:
        if not planning.choose:
            return []  # settings reused for these shapes (a resumed run)

        def knob(index: int) -> Knob:
            def put(depth: Any) -> None:
                self.depths[index] = depth

            return Knob(
                self.names[index],
                self.layers[index],  # what the planner records: what the layer keeps, its backward pass's peak
                self.DEPTHS,
                put,
                lambda: self.depths[index],
                reference=0,  # without a budget: stay near the peak with no queue
                cost=lambda depth: (self.DEPTHS[-1] - depth) * WAIT,  # a short queue makes the step wait
            )

        return [knob(i) for i in range(len(self.layers))]

    def plan(self, planning: Planning) -> Plan | None:
        if planning.chosen is None or not self.layers:
            return None  # nothing chosen: the depths loaded stay
        return Plan(said=[f"prefetch {self.describe()}"])  # the planner's choice is in force already

    def agree(self, reduce_max: Any) -> None:
        """Every rank chose from its own batch: each layer takes the shallowest queue any rank chose."""
        if self.layers:
            self.depths = [int(-d) for d in reduce_max([-float(d) for d in self.depths])]

    def section(self) -> Section:
        return Section(
            settings={"prefetch": self.describe()},  # a hyperparameter memopt/fit/prefetch, and report.prefetch
            metrics={"prefetch_slots": sum(self.depths) if self.layers else None},  # logged: memopt/prefetch_slots
            lines=[f"prefetch: {self.describe()}"] if self.layers else [],  # a line of the printed summary
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
    # 1. The step's peak with the built-in techniques alone (every layer checkpointed), and without MemOpt.
    alone = lightning_memopt.estimate(model, model.batch, stage="fit")
    assert alone.memopt.bytes is not None and alone.plain.bytes is not None, "the dry run could not trace the step"
    budget = alone.memopt.bytes + (alone.plain.bytes - alone.memopt.bytes) // 4
    print(f"step peak with every layer checkpointed: {alone.memopt.bytes:,} B, plain: {alone.plain.bytes:,} B")

    # 2. Register the technique: from now on MemOpt and estimate() apply, plan, report and undo it too.
    lightning_memopt.register_technique(Prefetch)
    try:
        memopt = MemOpt(checkpointing="auto", memory_budget=budget)  # modes and depths chosen together
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
    print(f"chosen for a budget of {budget:,} B: checkpointed {report.checkpointed}, prefetch {report.prefetch}")
    slots = report.metrics().get("memopt/prefetch_slots", "nothing: no queue in force")
    print(f"logged: memopt/prefetch_slots = {slots}")
    print(f"saved for a resumed run: {memopt.state_dict()['settings']['fit'][0][1]}")
    print(f"logs (train_loss and the memopt/ keys): {Path(trainer.logger.log_dir).resolve() / 'metrics.csv'}")
    peak = report.peak_bytes
    if peak is None or peak > budget or report.prefetch_slots is None:
        raise SystemExit(f"check failed: measured peak {peak} B, budget {budget} B, {report.prefetch_slots} slots")
    if any(layer._forward_hooks or "forward" in vars(layer) for layer in model.encoder.layers):
        raise SystemExit("check failed: the model was not left as given")
    print(f"measured peak {peak:,} B within the budget of {budget:,} B; model left as given")


if __name__ == "__main__":
    main()
