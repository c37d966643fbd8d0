"""The checkpointing technique at fit, as the engine drives it: each model's library switch, or MemOpt's generic
wrapper, on its blocks; each block's mode; and the family tables that say which code applies it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_memopt.adapters.base import find_block_stacks, flagged
from lightning_memopt.compat import strategy_checkpoints
from lightning_memopt.techniques.base import Change, Knob, Plan, Planning, Section, Technique
from lightning_memopt.techniques.checkpointing.core import (
    CHECKPOINT_FUNCTION,
    CheckpointConfig,
    CheckpointUnit,
    RecomputeTimer,
    forget,
)
from lightning_memopt.techniques.checkpointing.generic import checkpoint as generic_checkpoint
from lightning_memopt.techniques.checkpointing.hf_diffusers import checkpoint as diffusers_checkpoint
from lightning_memopt.techniques.checkpointing.hf_transformers import checkpoint as transformers_checkpoint
from lightning_memopt.techniques.checkpointing.planner import count, knobs
from lightning_memopt.techniques.checkpointing.selective import MODES
from lightning_memopt.timing import link_byte_s
from lightning_memopt.tuning import spread
from lightning_memopt.units import Recomputed, fmt_bytes, fmt_flops, modelled_saving, percent

#: Per model family (an adapter's ``name``), the library's own switch; a family not here, a model without its
#: library's switch, or blocks named by the user get MemOpt's generic wrapper.
SWITCHES: dict[str, Callable[[nn.Module], Change]] = {
    "transformers": transformers_checkpoint,
    "diffusers": diffusers_checkpoint,
}


def checkpoint_model(found: Any, config: CheckpointConfig) -> Change | None:
    """Checkpoint one found model (:class:`~lightning_memopt.adapters.FoundModel`) with its library's switch where it
    has one, else with the generic wrapper; ``None`` where it has no blocks to checkpoint."""
    switch = SWITCHES.get(found.adapter.name)
    if switch is None or config.block_classes or not found.adapter.has_checkpointing_switch(found.module):
        return generic_checkpoint(found.module, config, found.skip)
    return switch(found.module)


class Checkpointing(Technique, Recomputed):
    """The checkpointing technique at fit: each model's library switch, or the generic wrapper, on its blocks.

    It is the only writer of which blocks are checkpointed (:meth:`set`); :meth:`off` switches every block it
    checkpoints off (the flags the library switch turned on, and the generic wrappers) and back, without re-applying
    anything. A model whose checkpointing the user had switched on already keeps it, also in :meth:`off`. With
    ``checkpointing="auto"`` each block's mode is a knob of the stage's planner (:mod:`~lightning_memopt.techniques.
    table`, see :func:`~lightning_memopt.techniques.checkpointing.planner.knobs`); otherwise it counts what the blocks
    recompute when a batch is measured.
    """

    name = "checkpointing"
    stages = ("fit",)
    option = "checkpointing"
    reports = ("checkpointed", "recompute_flops", "recompute_fraction", "forward_flops", "checkpointing_saved_bytes")

    def __init__(self) -> None:
        self.switches: list[CheckpointUnit] = []  # the blocks that can be switched one by one
        self.recomputed: list[nn.Module] = []  # modules holding a library's checkpoint function, to time it
        self.flags: list[nn.Module] = []  # modules whose flag the library switch turned on
        self.models = 0
        self.blocks = 0  # every block it reached, in every model
        self.auto = False  # checkpointing="auto": the planner chooses the modes
        self.offloads = False  # checkpointing="offload": every block's inputs kept in host memory
        self.planned = False
        self.recompute_flops: int | None = None  # FLOPs the blocks recompute per step, counted in a dry run
        self.forward_flops: int | None = None  # the forward pass's FLOPs without checkpointing
        self._chose = False  # the last plan chose the modes: the ranks agree on them
        self._knobs: list[Knob] = []  # the knobs offered to the stage's planner for the batch being planned
        self._chosen: Any = None  # what the stage's planner chose (an Outcome)
        self._counted_before: tuple[int, int | None] | None = None  # the FLOPs kept with settings loaded

    @classmethod
    def uses_budget(cls, config: Any) -> bool:
        return config.checkpointing == "auto"

    @classmethod
    def refuses(cls, context: Any) -> str | None:
        owner = strategy_checkpoints(context.strategy) if context.strategy is not None else None
        if owner is None:
            return None
        return (
            f"{owner} already checkpoints activations; MemOpt leaves checkpointing to it and does not wrap the blocks"
            " a second time."
        )

    @classmethod
    def validate(cls, config: Any, found: list[Any]) -> None:
        """``checkpoint_blocks`` names that match no module of the models are a mistake: say which, and what there
        is."""
        names = config.checkpoint_blocks
        if not names:
            return
        modules = [m for f in found for m in f.module.modules()]
        present = {type(m).__name__.lower() for m in modules}
        missing = [n for n in names if isinstance(n, str) and n.lower() not in present]
        if missing:
            stacks = sorted({type(b).__name__ for f in found for b in find_block_stacks(f.module)})
            others = sorted({type(m).__name__ for m in modules if any(True for _ in m.children())} - set(stacks))
            raise ValueError(
                f"`checkpoint_blocks` names {missing!r}, which match no module of {[f.label for f in found]}; their"
                f" repeated blocks are {stacks or 'none'}, and the other modules with children are {others[:20]}"
            )

    @classmethod
    def budget_unused(cls, config: Any) -> str | None:
        if config.checkpointing in (True, "offload"):
            return (
                f"`checkpointing={config.checkpointing!r}` checkpoints every block in full whatever `memory_budget`"
                " says; pass `checkpointing='auto'` to choose what each block recomputes under the budget."
            )
        return None

    def apply(self, found: Any, config: Any) -> Any:
        before = {id(m) for _, m in flagged(found.module)}
        forget([found.module])  # what a block's runs change is found again: the user may have changed the model
        self.auto = config.checkpointing == "auto"
        self.offloads = config.checkpointing == "offload"
        change = checkpoint_model(found, CheckpointConfig(block_classes=config.checkpoint_blocks))
        if change is None:
            return None
        for unit in change.switches if self.offloads else []:
            unit.offer("cpu")
            if "offload" in unit.modes:
                unit.mode = "offload"
        self.models += 1
        self.blocks += change.blocks
        for unit in change.switches:
            unit.name = f"{found.name}.{unit.name}"
        self.switches += change.switches
        self.recomputed += [m for m in found.module.modules() if CHECKPOINT_FUNCTION in m.__dict__]
        self.flags += [m for _, m in flagged(found.module) if id(m) not in before]
        return change

    def remove(self) -> None:
        self.switches, self.recomputed, self.flags, self.models, self.blocks = [], [], [], 0, 0

    def enable(self, count: int) -> None:
        """Checkpoint ``count`` of the switchable blocks whole, spread evenly (every n/count-th)."""
        chosen = set(spread(len(self.switches), count))
        self.set(["full" if index in chosen else "none" for index in range(len(self.switches))])

    def set(self, modes: list[str]) -> None:
        """Each switchable block's mode, in order: one of the block's :attr:`CheckpointUnit.modes`."""
        if len(modes) != len(self.switches):
            raise ValueError(f"one mode per block is needed ({len(self.switches)}), got {len(modes)}")
        for unit, mode in zip(self.switches, modes, strict=True):
            unit.mode = mode

    @property
    def modes(self) -> list[str]:
        return [u.mode for u in self.switches]

    def state(self) -> dict[str, Any]:
        """How the blocks are checkpointed, for a checkpoint: the switchable blocks and each one's mode, and the FLOPs
        a dry run counted with them (recomputed, and the forward pass's), so that a run reusing them need not count
        again."""
        state: dict[str, Any] = {"switches": [u.name for u in self.switches], "modes": self.modes}
        if self.planned and self.recompute_flops is not None:
            state["counted"] = [self.recompute_flops, self.forward_flops]
        return state

    def load(self, state: dict[str, Any]) -> bool:
        """Checkpoint the blocks as saved; ``False`` (nothing changed) where the blocks are not the same."""
        if state.get("switches") != [u.name for u in self.switches] or "modes" not in state:
            return False
        if any(m not in u.modes for u, m in zip(self.switches, state["modes"], strict=False)):
            return False  # a mode this run does not offer (offload, saved on an accelerator)
        self.set(list(state["modes"]))
        counted = state.get("counted")
        self._counted_before = tuple(counted) if isinstance(counted, list) and len(counted) == 2 else None
        return True

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        flags = [(m, m.__dict__.get("gradient_checkpointing")) for m in self.flags]
        modes = self.modes
        for module in self.flags:
            module.__dict__["gradient_checkpointing"] = False
        for unit in self.switches:
            unit.mode = "none"
        try:
            yield
        finally:
            for module, flag in flags:
                module.__dict__["gradient_checkpointing"] = flag
            for unit, mode in zip(self.switches, modes, strict=True):
                unit.mode = mode

    @property
    def changed(self) -> bool:
        return bool(self.models) and (not self.switches or any(u.enabled for u in self.switches))

    def describe(self) -> str | None:
        if not self.switches:
            return None
        modes = self.modes
        described = f"{len(modes) - modes.count('none')} of {len(modes)} blocks"
        if any(m not in ("none", "full") for m in modes):
            kinds = [f"{modes.count(m)} {m}" for m in MODES[1:] if m in modes]
            described += f" ({', '.join(kinds)})"
        return described

    def summary(self) -> str | None:
        if not self.models:
            return None
        return f"checkpointing {self.describe() or f'{self.blocks} of {self.blocks} blocks'}"

    def timer(self, synchronize: Callable[[], None]) -> RecomputeTimer:
        """Times the recomputation of the checkpointed blocks in the step."""
        units = [u for u in self.switches if not u.native or u.whole or u.parts]
        return RecomputeTimer(self.recomputed, units, synchronize)

    # the planner, the ranks and the report ---------------------------------------------------------------------------

    def knobs(self, planning: Planning) -> list[Knob]:
        """With ``checkpointing="auto"``, each switchable block's mode, for the stage's planner to choose;
        ``"offload"`` among them only for an accelerator."""
        rate = self._place(planning)
        self._knobs = knobs(self, rate) if self.auto and planning.choose else []
        return self._knobs

    def _place(self, planning: Planning) -> float | None:
        """Where the blocks' ``"offload"`` mode keeps their inputs while ``planning`` plans: in host memory, offered
        for an accelerator under a budget (and wherever ``checkpointing="offload"``), on the meta device in the dry
        runs of an estimate for an accelerator this machine does not have (counted apart, as the host's); the host
        link's seconds per byte (``None`` on a CPU)."""
        rate = link_byte_s(planning.target)
        stand_in = torch.device(planning.target) != torch.device(planning.device)
        offered = rate is not None and planning.budget is not None
        host = ("meta" if stand_in else "cpu") if offered or self.offloads else None
        for unit in self.switches:
            unit.offer(host)
        return rate

    def plan(self, planning: Planning) -> Plan | None:
        """What the stage's planner chose for the blocks with ``checkpointing="auto"``; otherwise (or for settings
        reused for these shapes), where a batch is measured, one dry run counts what the blocks recompute."""
        self._place(planning)
        if self._knobs and planning.chosen is not None:
            return self._chosen_plan(planning.chosen, planning.budget)
        if not ((self.auto and self.switches) or (planning.measure and self.models)):
            return None
        chosen = planning.chosen
        if chosen is not None and chosen.peak_bytes is not None:  # the planner's dry run with the choice counted them
            self._counted(chosen, chose=False)
            return Plan()
        if not planning.choose and self._counted_before is not None:  # reused settings, counted when they were chosen
            self.planned, self._chose = True, False
            self.recompute_flops, self.forward_flops = self._counted_before
            return Plan()
        choice = count(planning, self)
        self._counted(choice, chose=False)
        return Plan(
            choice.seconds, list(choice.notes), predicted_s=choice.predicted_s, calibration_s=choice.calibration_s
        )

    def _counted(self, figures: Any, chose: bool) -> None:
        """The FLOPs a dry run with the modes in force counted (an ``Outcome`` or a ``RecomputeChoice``)."""
        self.planned, self._chose = True, chose
        self.recompute_flops, self.forward_flops = figures.recompute_flops, figures.forward_flops

    def _chosen_plan(self, outcome: Any, budget: int | None) -> Plan:
        self._counted(outcome, chose=True)
        self._chosen = outcome
        plan = Plan()
        if not outcome.chose(self._knobs):
            plan.warnings.append(
                "checkpointing='auto' could not choose the blocks' modes (the dry run could not trace the step, see"
                " the summary's notes); every block is checkpointed."
            )
        target = f"a budget of {fmt_bytes(budget)}" if budget is not None else "no budget"
        plan.said.append(lambda: f"checkpointing {self.describe()} for {target}")
        return plan

    def agree(self, reduce_max: Callable[[list[float]], list[float]]) -> None:
        """Every rank chose from its own first batch: each block takes the most recomputing mode any rank chose."""
        if not self._chose:
            return
        ranks = reduce_max([float(MODES.index(m)) for m in self.modes]) if self.switches else []
        self.set([MODES[int(r)] for r in ranks])

    def section(self) -> Section:
        if not self.planned:
            return Section()
        described = self.describe()
        share = f" ({percent(self.recompute_fraction)} of the forward pass)" if self.recompute_fraction else ""
        saved = self._chosen.saved(self._knobs) if self._chosen is not None else None
        lines = [f"checkpointed: {described}{modelled_saving(saved)}"] if described is not None else []
        if self.recompute_flops is not None:
            lines.append(f"recomputed: {fmt_flops(self.recompute_flops)}{share}")
        return Section(
            settings={"checkpointed": described},
            metrics={
                "recompute_flops": self.recompute_flops,
                "recompute_fraction": self.recompute_fraction,
                "checkpointing_saved_bytes": saved,
            },
            figures={"forward_flops": self.forward_flops},
            lines=lines,
        )
