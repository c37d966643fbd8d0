"""Choosing settings from dry runs in loops without gradients: each block's chunk setting and each VAE decode's mode
and slice size (the figures per block come from :mod:`~lightning_memopt.techniques.chunking.recorder`)."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_memopt.handles import AttributeOverride, HandleGroup
from lightning_memopt.memory import CPUPeakTracker, CPUProbe
from lightning_memopt.techniques.base import Planning
from lightning_memopt.techniques.chunking.core import Setting
from lightning_memopt.techniques.chunking.recorder import BlockModel, ChunkRecorder, plan_chunks, tighten
from lightning_memopt.techniques.decoding import TILE_SCALES
from lightning_memopt.timeline import Timeline
from lightning_memopt.units import fmt_sizes

#: The key of the VAE decodes among the blocks :func:`plan_chunks` chooses for (no block is named so).
DECODE = "<VAE decode>"


def decode_options(n: int) -> list[Setting]:
    """The slice sizes tried for a decode of ``n`` samples, coarsest (plain: ``Setting(0, None, 1)``) first: the
    divisors of ``n`` and the powers of two below it, each made the smallest size that decodes in as many calls (no
    other size has a lower peak for as many calls), as ``Setting(0, k, calls)``.

    Examples:
        >>> [s.size for s in decode_options(14)], [s.slices for s in decode_options(14)]
        ([None, 7, 4, 2, 1], [1, 2, 4, 7, 14])
    """
    sizes = {d for d in range(1, n) if n % d == 0} | {2**i for i in range(max(n - 1, 0).bit_length())}
    sizes = {math.ceil(n / math.ceil(n / k)) for k in sizes if k < n}
    return [Setting(0, None, 1), *(Setting(0, k, math.ceil(n / k)) for k in sorted(sizes, reverse=True))]


@dataclass
class DecodeCall:
    """One call of a decode in a dry run with it sliced by 1: its samples, the bytes live when it started, its whole
    output's bytes, and the decode's own peak on ``k`` samples decoded alone, per ``k`` (shared by the calls of one
    decode on samples of one shape)."""

    n: int
    base: int
    output: int
    own: dict[int, int] = field(default_factory=dict)

    def peak(self, k: int) -> int:
        """The step's peak while this call decodes in slices of ``k`` (whole, where ``k`` is at least its samples):
        while a slice decodes, the outputs of the slices before it and the slice's own peak (that of the smallest size
        replayed that is at least its size: exact where it was replayed); while they are concatenated, the output
        twice."""
        if k >= self.n:
            return self.base + self._alone(self.n)
        calls = math.ceil(self.n / k)
        last, per = self.n - (calls - 1) * k, self.output // self.n
        during = max((calls - 2) * k * per + self._alone(k), (self.n - last) * per + self._alone(last))
        return self.base + max(during, 2 * self.output)

    def _alone(self, k: int) -> int:
        return self.own[min(s for s in self.own if s >= k)]


class DecodeRecorder:
    """While a dry run runs with the VAE decodes sliced by 1 (:mod:`~lightning_memopt.techniques.decoding`), notes
    every call of each decode as a :class:`DecodeCall`, and decodes a slice of it alone at each size its slices would
    take under the other settings of :func:`decode_options`, the last one's included (not counted in the run, as
    :class:`~lightning_memopt.techniques.chunking.recorder.ChunkRecorder` replays a block; each size once per sample
    shape). Only decodes MemOpt slices by any size are watched; ``unit.seen`` (the largest call, from the dry run
    without changes) gives their sizes."""

    def __init__(self, decoding: Any, probe: CPUProbe) -> None:
        self.units = [u for u in decoding.units if u.by_any and u.mode == "sliced"]
        self.probe = probe
        self.calls: dict[str, list[DecodeCall]] = {}
        self._own: dict[tuple[Any, ...], dict[int, int]] = {}
        self._handles = HandleGroup()

    def __enter__(self) -> DecodeRecorder:
        for unit in self.units:
            self._handles.add(AttributeOverride.wrap(unit.module, "decode", functools.partial(self._watch, unit)))
        return self

    def __exit__(self, *args: Any) -> None:
        self._handles.remove()

    def _watch(self, unit: Any, decode: Any) -> Any:
        def watched(z: Any, *args: Any, **kwargs: Any) -> Any:
            if not (isinstance(z, torch.Tensor) and z.dim() > 0 and unit.module.use_slicing):  # not a replay
                return decode(z, *args, **kwargs)
            n, largest = int(z.shape[0]), max(unit.seen, int(z.shape[0]))
            own = self._own.setdefault((unit.name, tuple(z.shape[1:]), z.dtype), {})
            ks = [s.size for s in decode_options(largest)[1:-1] if s.size < n]
            sizes = {*ks, *(n - (math.ceil(n / k) - 1) * k for k in ks)} | ({n} if n < largest else set())
            tracker = self.probe.tracker
            call = DecodeCall(n, tracker.current, 0, own)
            tracker.paused, unit.module.use_slicing = True, False  # decoded whole, not counted in the run
            try:
                for size in sorted(sizes - own.keys()):
                    with CPUPeakTracker(tracker) as alone:
                        decode(z[:size], *args, **kwargs)
                    own[size] = alone.peak
            finally:
                tracker.paused, unit.module.use_slicing = False, True
            unit.output_bytes = 0
            output = decode(z, *args, **kwargs)
            call.output = unit.output_bytes
            self.calls.setdefault(unit.name, []).append(call)
            return output

        return watched


def _decode_model(decoding: Any, calls: dict[str, list[DecodeCall]], plain: int, sliced: int) -> BlockModel:
    """The decodes as one more block for :func:`plan_chunks`: per setting, the step's peak outside the chunked blocks
    (``base`` 0). Plain and by 1 are the dry runs' (``plain``, ``sliced``); by ``k`` in between, the larger of
    ``sliced`` and each call's peak (:class:`DecodeCall`), every decode in as many slices as its largest call. Without
    calls noted (no decode sliced by any size), by 1 only."""
    if not calls:
        options = [Setting(0, None, 1), Setting(0, 1, 2)]
        return BlockModel(own=dict(zip(options, (plain, sliced), strict=True)), options=options)
    largest = {name: max(c.n for c in noted) for name, noted in calls.items()}
    options = decode_options(max(largest.values()))
    own = {options[0]: plain, options[-1]: sliced}
    for setting in options[1:-1]:
        peaks = [c.peak(math.ceil(largest[name] / setting.slices)) for name, noted in calls.items() for c in noted]
        own[setting] = max(sliced, *peaks)
    return BlockModel(own=own, options=options)


def _put(chunking: Any, decoding: Any, settings: dict[str, Setting]) -> None:
    """``settings`` in force: each block's, and the decodes' (each in as many calls as the largest decode takes)."""
    chunking.set(settings)
    decode = settings.get(DECODE)
    if decode is not None and decode.size is None:
        decoding.set("plain")
    elif decode is not None:
        decoding.set("sliced", k={u.name: max(1, math.ceil(u.seen / decode.slices)) for u in decoding.units})


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
       with the decoders sliced by 1, in which each decode call is replayed alone at the other slice sizes
       (:class:`DecodeRecorder`). The decodes are then one more block for the plan (:func:`_decode_model`).
    2. **Chunking** and the slice size, each block's coarsest setting (the largest slices) that meets the target (the
       budget, or without one the knee), checked by a dry run with the choice; blocks (and decodes) still over the
       target are tightened (three checks at most).
    3. **VAE tiling** (outputs change at the tile seams), only when a budget is still not met and ``planning.lossy``
       allows it; chunking is then chosen again with it, with the autoencoder's own tiles and, while the budget is
       not met, with smaller ones (:data:`~lightning_memopt.techniques.decoding.TILE_SCALES`): two dry runs or more
       each.

    The settings chosen are left in force; where the step cannot be traced they are left as they were."""
    budget, tiling = planning.budget, planning.lossy
    replays: dict[Any, Any] = {}  # each block kind is replayed once for all the dry runs

    def run(replay: bool, decodes: bool = False) -> Any:
        @contextlib.contextmanager
        def watch(probe: Any) -> Iterator[tuple[ChunkRecorder, Timeline, DecodeRecorder | None]]:
            with ChunkRecorder(chunking, probe, replay=replay, cache=replays) as recorder:
                with Timeline(probe, planning.module) as where:
                    with DecodeRecorder(decoding, probe) if decodes else contextlib.nullcontext() as calls:
                        yield recorder, where, calls

        return planning.run(watch)

    for unit in decoding.units:
        unit.seen = unit.output_bytes = 0
    with planning.off():
        dry = run(replay=True)
        sliced = None
        needed = budget is None or (dry.peak_bytes is not None and dry.peak_bytes > budget)  # nothing, if it fits
        if decoding.units and dry.peak_bytes is not None and needed:
            decoding.set("sliced", k=1)
            sliced = run(replay=True, decodes=True)
    if dry.peak_bytes is None:
        return ChunkChoice(dry, dry.seconds, [])
    seconds = dry.seconds + (sliced.seconds if sliced is not None else 0.0)
    recorder = dry.watched[0]
    blocks, rest = recorder.blocks, recorder.rest
    if sliced is not None and sliced.peak_bytes is not None:
        lower = _lowest(sliced.watched[0]) < _lowest(recorder)  # the decode holds the peak chunking cannot lower
        decoding.set("sliced" if lower else "plain", k=1)
        if lower:
            recorder = sliced.watched[0]
            model = _decode_model(decoding, sliced.watched[2].calls, rest, recorder.rest)
            blocks = {**recorder.blocks, DECODE: model}
            rest = 0  # the peak outside the blocks is the decodes' block's
    checked, part, notes, spent = _chunk_and_check(run, chunking, decoding, blocks, rest, budget)
    seconds += spent
    tileable = decoding.tileable() if tiling else []  # sliced or not: slicing may not have lowered the peak
    if budget is not None and checked is not None and checked > budget and tileable:
        reached, kept = _lowest(recorder), None  # the lowest peak reachable so far, and the tile scale reaching it
        for scale in TILE_SCALES:  # the largest tiles that meet the budget, each smaller only where it lowers more
            decoding.set("tiled", tileable, tile=scale)
            tiled = run(replay=True)
            seconds += tiled.seconds
            lowest = _lowest(tiled.watched[0]) if tiled.peak_bytes is not None else None
            if lowest is None or lowest >= reached:
                break
            reached, kept, tiles = lowest, scale, tiled.watched[0]
            checked, part, more, spent = _chunk_and_check(run, chunking, decoding, tiles.blocks, tiles.rest, budget)
            seconds += spent
            notes = [n for n in notes if "budget" not in n] + more
            if checked is None or checked <= budget:
                break
        decoding.set("sliced" if kept is None else "tiled", tileable, tile=kept or TILE_SCALES[0])
    return ChunkChoice(dry, seconds, notes, dry.watched[1].part, part, checked)


def _lowest(recorder: ChunkRecorder) -> int:
    """The lowest peak chunking reaches, from a dry run's figures."""
    return plan_chunks(recorder.blocks, recorder.rest, None).lowest


def _chunk_and_check(
    run: Callable[[bool], Any],
    chunking: Any,
    decoding: Any,
    blocks: dict[str, BlockModel],
    rest: int,
    budget: int | None,
) -> tuple[int | None, str | None, list[str], float]:
    """Choose each block's chunking (and the decodes' slice size, where ``blocks`` has them) from a dry run's figures,
    then check it by dry runs with the choice, tightening blocks still over the target. Returns the checked peak, the
    part holding it, notes and the seconds spent."""
    plan = plan_chunks(blocks, rest, budget)
    settings, checked, part, seconds = plan.settings, None, None, 0.0
    _put(chunking, decoding, settings)
    for _ in range(3):
        check = run(False)
        seconds += check.seconds
        if check.peak_bytes is None:
            break
        checked, part = check.peak_bytes, check.watched[1].part
        if plan.target is None or checked <= plan.target:
            break
        for name, block in check.watched[0].blocks.items():
            blocks[name].inside = block.inside
        if DECODE in blocks:
            blocks[DECODE].inside = check.watched[0].rest
        tightened = tighten(blocks, settings, plan.target)
        if tightened is None:
            what = "budget" if budget is not None and plan.target == budget else "target"
            target_words, peak_words = fmt_sizes(plan.target, checked)
            plan.notes.append(f"the {what} of {target_words} was not reached: the peak is {peak_words}")
            break
        settings = tightened
        _put(chunking, decoding, settings)
    return checked, part, plan.notes, seconds
