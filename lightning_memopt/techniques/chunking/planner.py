"""Choosing settings from dry runs in loops without gradients: each block's chunk setting and each VAE decode's mode
(the figures per block come from :mod:`~lightning_memopt.techniques.chunking.recorder`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from lightning_memopt.memory import PeakLocator
from lightning_memopt.techniques.base import Planning
from lightning_memopt.techniques.chunking.recorder import ChunkRecorder, plan_chunks, tighten


@dataclass
class ChunkChoice:
    """What :func:`choose_chunks` did (the settings chosen are in force on the units afterwards): the dry run without
    any change (the baseline), the time the dry runs took, notes, and the part of the model that holds the peak
    without the changes and with them (``feed-forward``, ``attention``, ``VAE decode``, ...)."""

    unchunked: Any
    seconds: float
    notes: list[str]
    part_without: str | None = None
    part: str | None = None
    peak_bytes: int | None = None  # the peak the check dry run gave with the choice


def choose_chunks(planning: Planning, chunking: Any, decoding: Any) -> ChunkChoice:
    """Choose the settings of ``chunking`` and ``decoding`` (the stage's
    :class:`~lightning_memopt.techniques.chunking.Chunking` and :class:`~lightning_memopt.techniques.decoding.Decoding`)
    from dry runs of the batch, cheapest first:

    1. **VAE slicing** (identical outputs), where the decode holds the lowest peak chunking could reach without it
       (and, under a budget, only when the step does not meet it as it is): one dry run without any change replays
       each chunked block alone at several settings (:class:`~lightning_memopt.techniques.chunking.recorder.
       ChunkRecorder`), one more
       with the decoders sliced.
    2. **Chunking**, each block's coarsest setting that meets the target (the budget, or without one the knee),
       checked by a dry run with the choice; blocks still over the target are tightened (three checks at most).
    3. **VAE tiling** (outputs change at the tile seams), only when a budget is still not met and ``planning.lossy``
       allows it; chunking is then chosen again with it.

    The settings chosen are left in force; where the step cannot be traced they are left as they were."""
    budget, tiling = planning.budget, planning.lossy
    replays: dict[Any, Any] = {}  # each block kind is replayed once for all the dry runs

    def run(replay: bool) -> Any:
        @contextlib.contextmanager
        def watch(probe: Any) -> Iterator[tuple[ChunkRecorder, PeakLocator]]:
            with ChunkRecorder(chunking, probe, replay=replay, cache=replays) as recorder:
                with PeakLocator(probe, planning.module) as where:
                    yield recorder, where

        return planning.run(watch)

    with planning.off():
        dry = run(replay=True)
        sliced = None
        needed = budget is None or (dry.peak_bytes is not None and dry.peak_bytes > budget)  # nothing, if it fits
        if decoding.units and dry.peak_bytes is not None and needed:
            decoding.set("sliced")
            sliced = run(replay=True)
    if dry.peak_bytes is None:
        return ChunkChoice(dry, dry.seconds, [])
    seconds = dry.seconds + (sliced.seconds if sliced is not None else 0.0)
    recorder = dry.watched[0]
    if sliced is not None and sliced.peak_bytes is not None:
        lower = _lowest(sliced.watched[0]) < _lowest(recorder)  # the decode holds the peak chunking cannot lower
        decoding.set("sliced" if lower else "plain")
        recorder = sliced.watched[0] if lower else recorder
    checked, part, notes, spent = _chunk_and_check(run, chunking, recorder, budget)
    seconds += spent
    tileable = decoding.tileable() if tiling else []  # sliced or not: slicing may not have lowered the peak
    if budget is not None and checked is not None and checked > budget and tileable:
        decoding.set("tiled", tileable)
        tiled = run(replay=True)
        seconds += tiled.seconds
        if tiled.peak_bytes is not None and _lowest(tiled.watched[0]) < _lowest(recorder):
            checked, part, more, spent = _chunk_and_check(run, chunking, tiled.watched[0], budget)
            seconds += spent
            notes = [n for n in notes if "budget" not in n] + more
        else:
            decoding.set("sliced", tileable)
    return ChunkChoice(dry, seconds, notes, dry.watched[1].part, part, checked)


def _lowest(recorder: ChunkRecorder) -> int:
    """The lowest peak chunking reaches, from a dry run's figures."""
    return plan_chunks(recorder.blocks, recorder.rest, None).lowest


def _chunk_and_check(
    run: Callable[[bool], Any], chunking: Any, recorder: ChunkRecorder, budget: int | None
) -> tuple[int | None, str | None, list[str], float]:
    """Choose each block's chunking from ``recorder``'s figures, then check it by dry runs with the choice, tightening
    blocks still over the target. Returns the checked peak, the part holding it, notes and the seconds spent."""
    plan = plan_chunks(recorder.blocks, recorder.rest, budget)
    settings, checked, part, seconds = plan.settings, None, None, 0.0
    chunking.set(settings)
    for _ in range(3):
        check = run(False)
        seconds += check.seconds
        if check.peak_bytes is None:
            break
        checked, part = check.peak_bytes, check.watched[1].part
        if plan.target is None or checked <= plan.target:
            break
        for name, block in check.watched[0].blocks.items():
            recorder.blocks[name].inside = block.inside
        tightened = tighten(recorder.blocks, settings, plan.target)
        if tightened is None:
            what = "budget" if budget is not None and plan.target == budget else "target"
            plan.notes.append(f"the {what} of {plan.target} bytes was not reached: the peak is {checked} bytes")
            break
        settings = tightened
        chunking.set(settings)
    return checked, part, plan.notes, seconds
