"""Each checkpointed block's mode at fit (``"none"``, ``"feed_forward_selective"``, ``"selective"``,
``"feed_forward"``, ``"attention"``, ``"full"``, ``"whole"`` or ``"offload"``, see
:data:`~lightning_memopt.techniques.checkpointing.selective.MODES`) as knobs of the stage's planner
(:mod:`~lightning_memopt.techniques.planner`), which chooses them, with any other technique's knobs, for the least
predicted step time that meets a memory budget; and the FLOPs the modes in force recompute, counted by one dry run.

A block's modes are offered in the order ``none``, ``feed_forward_selective``, ``selective``, ``feed_forward``,
``full``, ``attention``, ``whole``, ``offload``: ``"full"`` is the reference (the model's own switch: without a
budget the planner stays within :data:`~lightning_memopt.techniques.planner.SLACK` of its peak), and ``"attention"`` is
worth a dry run only for a block that recomputed fused attention in its ``"full"`` run (elsewhere it keeps and
recomputes what ``"full"`` does). ``"offload"`` is offered only for an accelerator (see :meth:`~lightning_memopt.
techniques.checkpointing.Checkpointing.knobs`), priced by the bytes its inputs take over the host link, there and
back.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from lightning_memopt.techniques.base import Knob, Planning
from lightning_memopt.techniques.planner import BlockRecorder, Outcome, Run
from lightning_memopt.techniques.planner import choose as choose_jointly
from lightning_memopt.timing import speed
from lightning_memopt.units import Recomputed

#: The order a block's modes are offered in: the first changes nothing, and where two keep the same bytes for the
#: same FLOPs the earlier one is taken.
OFFERED = ("none", "feed_forward_selective", "selective", "feed_forward", "full", "attention", "whole", "offload")


def _worth(mode: Hashable, seen: Callable[[Hashable], Any]) -> bool:
    """``"attention"`` only where the block recomputed fused attention in its ``"full"`` run."""
    if mode != "attention":
        return True
    full = seen("full")
    return full is not None and full.attention > 0


def knobs(checkpointing: Any, link_byte_s: float | None = None) -> list[Knob]:
    """A knob per switchable block of ``checkpointing`` (the stage's
    :class:`~lightning_memopt.techniques.checkpointing.Checkpointing`): its modes, ``"full"`` the reference;
    ``"offload"`` (where a block offers it) costs its inputs' bytes there and back at ``link_byte_s``."""

    def knob(unit: Any) -> Knob:
        def put(mode: Hashable) -> None:
            unit.mode = mode

        def cost(mode: Hashable) -> float:
            if mode != "offload" or link_byte_s is None or unit.offload is None:
                return 0.0
            return 2 * unit.offload.moved * link_byte_s

        return Knob(
            unit.name,
            unit.module,
            tuple(m for m in OFFERED if m in unit.modes),
            put,
            lambda: unit.mode,
            "full",
            cost=cost,
            worth=_worth,
            alone=lambda mode: mode != "offload",  # its input leaves the device only where the step lets it go
        )

    return [knob(unit) for unit in checkpointing.switches]


@dataclass
class RecomputeChoice(Recomputed):
    """What :func:`choose_modes` did (the modes chosen are in force afterwards): the peak the dry run with them gave
    (``None``: it could not be traced), the FLOPs they recompute and the forward pass's, the time the dry runs took,
    notes, and whether a dry run gave placeholders for values the step read."""

    peak_bytes: int | None = None
    recompute_flops: int | None = None
    forward_flops: int | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    placeholders: bool = False
    predicted_s: float | None = None  # the step's predicted time (see :mod:`~lightning_memopt.timing`)
    calibration_s: float | None = None  # the time measuring the device's speeds took (once per process)
    policed: int = 0  # ops through a selective policy's dispatch mode, forward and recomputation

    @classmethod
    def of(cls, outcome: Outcome) -> RecomputeChoice:
        return cls(
            outcome.peak_bytes,
            outcome.recompute_flops,
            outcome.forward_flops,
            outcome.seconds,
            list(outcome.notes),
            outcome.placeholders,
            outcome.predicted_s,
            outcome.speed.seconds if outcome.speed is not None else None,
            outcome.policed,
        )


def count(planning: Planning, checkpointing: Any) -> RecomputeChoice:
    """The FLOPs the modes in force recompute, and the peak, from one dry run of the batch as a later step runs it."""
    pace = speed(planning.device)
    dry = planning.run(lambda probe: BlockRecorder(checkpointing.switches, probe, pace).watching(), steady=True)
    run = Run.of(dry)
    choice = RecomputeChoice(seconds=dry.seconds, notes=[dry.note] if dry.note else [])
    choice.placeholders = bool(dry.placeholders)
    choice.peak_bytes, choice.predicted_s, choice.calibration_s = run.peak, run.predicted_s, pace.seconds
    choice.policed = run.policed
    if run.peak is not None:
        choice.recompute_flops, choice.forward_flops = run.recomputed_total, run.forward_flops
    return choice


def choose_modes(planning: Planning, checkpointing: Any, budget: int | None, choose: bool = True) -> RecomputeChoice:
    """Each block's mode of ``checkpointing`` alone, chosen by the stage's planner for ``budget`` (or, without one,
    within :data:`~lightning_memopt.techniques.planner.SLACK` of every block ``"full"``) and left in force; with
    ``choose`` off, or no block to switch, the FLOPs the modes in force recompute (:func:`count`). The benchmarks
    compare the planner through it."""
    if not choose or not checkpointing.switches:
        return count(planning, checkpointing)
    return RecomputeChoice.of(choose_jointly(planning, knobs(checkpointing), budget))
