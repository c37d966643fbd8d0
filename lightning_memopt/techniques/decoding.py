"""VAE decode slicing and tiling: an autoencoder's own switches (``use_slicing``, ``use_tiling``), set by MemOpt, and
MemOpt's slicing by any size.

Slicing decodes a batch in slices of ``k`` samples (diffusers' own switch decodes one at a time; MemOpt's wrapper of
``decode`` decodes ``k`` at a time with that switch off) and gives the same outputs, up to the rounding of kernels run
on fewer samples (in float64 they agree to about 1e-15), and leaves the autoencoder as a plain decode does
(:func:`apply_decoding`). That rounding is not always small: a conv kernel's result depends on the batch size it runs
on, and an autoencoder amplifies it (HunyuanVideo's decode of diffusers' test config moves by up to 1e-4 relative
between a batch and its samples decoded alone, plain, without MemOpt). So under ``verify`` the run without MemOpt's
changes decodes on the same slices, and the slicing itself is checked after the batch against the rounding measured
on the same latents (:func:`check_slicing`). Only the decode is sliced or tiled: an ``encode`` runs with the
switches as the user set them (diffusers' ``use_slicing`` and ``use_tiling`` switch the encode too). Tiling decodes
overlapping tiles and blends
them, which changes outputs at the seams: MemOpt uses it only when a budget cannot be met otherwise, with the largest
tiles that meet it (the autoencoder's own, else halved, :data:`TILE_SCALES`), and :class:`TilingCheck` measures the
largest difference it made.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Hashable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_memopt.adapters.hf_diffusers import (
    DECODE_ATTRIBUTES,
    decode_in_slices,
    find_decoders,
    slices_by_any_size,
)
from lightning_memopt.compat import FakeTensor
from lightning_memopt.handles import AttributeOverride, AttributeSnapshot, HandleGroup
from lightning_memopt.techniques.base import Change, Knob, Plan, Planning, Section, Switchable, Technique
from lightning_memopt.units import fmt_bytes
from lightning_memopt.verify import VerificationError

MODES = ("plain", "sliced", "tiled")
#: An autoencoder's spatial tile sizes, in pixels of its output or of its latents (AutoencoderKL's
#: ``tile_sample_min_size`` and ``tile_latent_min_size``, Wan's ``tile_sample_min_height`` and
#: ``tile_sample_stride_width``, ...): MemOpt scales them together, so that tiles keep their overlap's fraction.
TILE_SIZE = re.compile(r"tile_(sample|latent)_(min|stride)_(size|height|width)")
#: The tile sizes tried, as fractions of the autoencoder's own: the largest that meets the budget is kept.
TILE_SCALES = (1.0, 0.5, 0.25)
#: How many times the rounding of a decode's kernels between batch sizes (:func:`check_slicing`) a sliced decode may
#: differ from the plain one under ``verify``. Measured on diffusers' test configs (5 weights x 2 inputs each, sliced
#: by 1): the largest ratio was 1.0 for HunyuanVideo, 1.1 for AutoencoderKL and 8.6 for Mochi, whose group norms
#: run frames of several samples in one call (the position in the batch rounds too). A decode that mixes samples (a
#: norm over the batch) differs by orders of magnitude more.
ROUNDING_MARGIN = 16


class DecodeUnit:
    """One autoencoder's decode: ``plain`` (as the user set it), ``sliced`` (``k`` samples at a time) or ``tiled``
    (one sample at a time, tiled, its tile sizes scaled by ``tile``, one of :data:`TILE_SCALES`). The user's own
    switches stay on in every mode.

    In ``sliced`` mode the autoencoder's ``use_slicing`` is on, and MemOpt's wrapper of its ``decode``
    (:func:`apply_decoding`) decodes slices of ``k`` samples with it off. Where the decode takes arguments that are not
    the same for every slice (:func:`~lightning_memopt.adapters.hf_diffusers.slices_by_any_size`), ``k`` stays 1: its
    own slicing.

    Examples:
        >>> from torch import nn
        >>> vae = nn.Module()
        >>> vae.use_slicing, vae.use_tiling = False, False
        >>> unit = DecodeUnit("vae", vae)
        >>> unit.set("tiled"); (vae.use_slicing, vae.use_tiling)
        (True, True)
        >>> unit.set("plain"); (vae.use_slicing, vae.use_tiling)
        (False, False)
        >>> vae.tile_sample_min_size, vae.tile_latent_min_size = 512, 64
        >>> unit = DecodeUnit("vae", vae)
        >>> unit.set("tiled", tile=0.5); (vae.tile_sample_min_size, vae.tile_latent_min_size, unit.describe())
        (256, 32, 'tiled, tiles 0.5x its own')
        >>> unit.set("sliced"); vae.tile_sample_min_size
        512
    """

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name = name
        self.module = module
        self.user = (bool(module.use_slicing), bool(module.use_tiling))
        self.mode = "plain"
        self.k = 1
        self.by_any = slices_by_any_size(module) and not self.user[0]  # the user's slicing by 1 stays on
        self.set_by_slices: list[tuple[dict[str, Any], str]] | None = None  # attributes a sliced decode set (_sliced)
        # its tile sizes as given (see TILE_SIZE), and the scale of them in force when tiled
        self.tile_sizes = {
            name: value
            for name, value in vars(module).items()
            if TILE_SIZE.fullmatch(name) and isinstance(value, int) and not isinstance(value, bool)
        }
        self.tile = 1.0
        self.verify = False  # MemOpt(verify=True): verify's run without the changes decodes on the same slices
        self.held: tuple[str, int, float] | None = None  # the setting that Decoding.off() holds back for a while
        self.kept: tuple[torch.Tensor, tuple[Any, ...], dict[str, Any]] | None = None  # a call for check_slicing

    def set(self, mode: str, k: int | None = None, tile: float | None = None) -> None:
        """Put ``mode`` in force, with slices of ``k`` samples where given (kept otherwise; 1 where the decode cannot
        be sliced by any size) and, when tiled, tiles ``tile`` times the autoencoder's own (kept where not given)."""
        if mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"`k` must be a positive int, got {k!r}")
        if tile is not None and tile not in TILE_SCALES:
            raise ValueError(f"`tile` must be one of {TILE_SCALES}, got {tile!r}")
        self.mode = mode
        self.k = (k if k is not None else self.k) if self.by_any else 1
        self.tile = tile if tile is not None else self.tile
        self.module.use_slicing = self.user[0] or mode != "plain"
        self.module.use_tiling = self.user[1] or mode == "tiled"
        scale = self.tile if mode == "tiled" else 1.0
        for name, size in self.tile_sizes.items():
            setattr(self.module, name, max(1, int(size * scale)))

    @property
    def setting(self) -> tuple[str, int]:
        return self.mode, self.k

    def describe(self) -> str:
        """The mode in words: ``plain``, ``sliced`` (one sample at a time), ``sliced by 4``, ``tiled``, ``tiled,
        tiles 0.5x its own``."""
        if self.mode == "tiled" and self.tile != 1.0:
            return f"tiled, tiles {self.tile:g}x its own"
        return f"sliced by {self.k}" if self.mode == "sliced" and self.k > 1 else self.mode

    @property
    def can_tile(self) -> bool:
        return not self.user[1]


def apply_decoding(units: list[DecodeUnit]) -> HandleGroup:
    """A handle that puts every unit's switches back as the user set them. Until then, a decode that MemOpt sliced
    is sliced by the unit's ``k``, and leaves the autoencoder as a plain decode would (see :func:`_sliced`); an
    ``encode`` runs with the switches as the user set them (:func:`_user_encode`)."""
    group = HandleGroup([AttributeSnapshot([u.module], (*DECODE_ATTRIBUTES, *u.tile_sizes)) for u in units])
    for unit in units:
        group.add(AttributeOverride.wrap(unit.module, "decode", functools.partial(_sliced, unit)))
        if callable(getattr(unit.module, "encode", None)):
            group.add(AttributeOverride.wrap(unit.module, "encode", functools.partial(_user_encode, unit)))
    return group


def _user_encode(unit: DecodeUnit, encode: Any) -> Any:
    """``encode`` with the autoencoder's switches as the user set them: MemOpt slices and tiles decodes only (diffusers'
    ``use_slicing`` slices the encode too, by 1, which changes its outputs by the rounding of kernels run on fewer
    samples, 6e-5 relative on Mochi's test config, and ``use_tiling`` tiles it), and its planner chose for decodes."""

    def encoding(*args: Any, **kwargs: Any) -> Any:
        module = unit.module
        given = (module.use_slicing, module.use_tiling)
        module.use_slicing, module.use_tiling = unit.user
        try:
            return encode(*args, **kwargs)
        finally:
            module.use_slicing, module.use_tiling = given

    return encoding


#: Instance attributes of a module that are its structure, not state a decode leaves.
_STRUCTURE = frozenset({"training", "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})


def _state(module: nn.Module) -> dict[tuple[int, str], tuple[dict[str, Any], Any]]:
    return {
        (id(m), k): (m.__dict__, v)
        for m in module.modules()
        for k, v in m.__dict__.items()
        if k not in _STRUCTURE and "hook" not in k
    }


def _sliced(unit: DecodeUnit, decode: Any) -> Any:
    """``decode``, sliced by ``unit.k`` where MemOpt sliced it (not the user, nor tiled by MemOpt), after which what
    the slices left on the autoencoder's modules reads as a plain decode of the whole batch leaves it: a shape of the
    last slice (KVAE's decoder keeps ``last_z_shape``) gets the batch's size. Other attributes are left as they are.
    Which attributes a sliced decode sets is found on the first (every attribute of every module looked at before and
    after it: about 1.5 ms a call for the quick benchmark's VAE, under cProfile); later decodes look only at those."""

    def sliced(z: Any, *args: Any, **kwargs: Any) -> Any:
        module = unit.module
        if not (isinstance(z, torch.Tensor) and z.dim() > 0):
            return decode(z, *args, **kwargs)
        n = int(z.shape[0])
        if _verify_run(unit, z, n, args, kwargs):  # decoded as the real step does, checked after the batch
            held, unit.held = unit.held, None
            unit.kept = unit.kept or (z.detach(), args, kwargs)
            unit.set(*held)
            try:
                return sliced(z, *args, **kwargs)
            finally:
                unit.set("plain")
                unit.held = held
        if not (module.use_slicing and not unit.user[0] and module.use_tiling == unit.user[1] and n > 1):
            return decode(z, *args, **kwargs)
        before = _state(module) if unit.set_by_slices is None else None
        output, last = _in_slices(unit, decode, z, args, kwargs) if unit.by_any else (decode(z, *args, **kwargs), 1)
        if before is not None:
            after = _state(module).items()
            unit.set_by_slices = [(store, k[1]) for k, (store, v) in after if k not in before or before[k][1] is not v]
        for store, name in unit.set_by_slices or []:
            value = store.get(name)
            if isinstance(value, torch.Size) and len(value) > 0 and value[0] == last < n:
                store[name] = torch.Size((n, *value[1:]))
        return output

    return sliced


def _verify_run(unit: DecodeUnit, z: torch.Tensor, n: int, args: Any, kwargs: Any) -> bool:
    """Whether this decode is one of verify's run of the step without MemOpt's changes (``Decoding.off()`` holds a
    sliced setting back, and the latents are real: a dry run's are fake) that the real step slices, with no tensor
    argument besides the latents (:func:`check_slicing` decodes copies of one sample with the same arguments)."""
    held = unit.held
    if not (unit.verify and held is not None and held[0] == "sliced" and n > 1 and not unit.user[0]):
        return False
    if isinstance(z, FakeTensor) or z.device.type == "meta":
        return False
    return not any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values()))


def check_slicing(unit: DecodeUnit, tolerance: float) -> tuple[float, float] | None:
    """Under ``verify``: whether slicing changed the decode that verify's run kept (:func:`_verify_run`) by more
    than float rounding. Gives the largest difference between its plain and its sliced decode, relative to the plain
    decode's largest magnitude, and the rounding it is held to; raises :class:`VerificationError` where the first is
    over ``ROUNDING_MARGIN`` times the second (and over ``tolerance``). ``None``: nothing was kept.

    The rounding is measured on the same latents, without other samples: the sample that moved most, decoded in a
    batch of as many copies of itself as the batch has samples and in one of as many as its slice has. A decode that
    treats each sample alone moves by the same amount between those two (only the kernels' batch size changed); one
    that mixes samples moves far more in the real batch. (Comparing the plain decode of the batch with its samples
    decoded alone would measure the slicing's own difference again, and accept any.)"""
    if unit.kept is None:
        return None
    (z, args, kwargs), unit.kept = unit.kept, None
    setting, n = (unit.mode, unit.k, unit.tile), int(z.shape[0])

    def decoded(latents: torch.Tensor, *mode: Any) -> torch.Tensor:
        unit.set(*mode)
        try:
            return _sample(unit.module.decode(latents, *args, **kwargs)).detach().double()
        finally:
            unit.set(*setting)

    with torch.no_grad():
        plain, sliced = decoded(z, "plain"), decoded(z, *setting)
        scale = float(plain.abs().max()) or 1.0
        moved = (plain - sliced).flatten(1).abs().amax(1)
        j, k = int(moved.argmax()), unit.k
        slice_size = min(k, n - j // k * k)  # the slice sample j was decoded in
        copies = z[j : j + 1].expand(n, *z.shape[1:]).contiguous()
        rounding = float((decoded(copies, "plain")[:1] - decoded(copies[:slice_size], "plain")[:1]).abs().max())
    difference, rounding = float(moved.max()) / scale, rounding / scale
    if difference > max(tolerance, ROUNDING_MARGIN * rounding):
        raise VerificationError(
            f"MemOpt verify: slicing the decode of {unit.name} ({unit.describe()}) changes it by {difference:.3g}"
            f" (relative), more than {ROUNDING_MARGIN} times the rounding of its kernels between batch sizes"
            f" ({rounding:.3g}: sample {j} decoded in a batch of {n} copies of itself and in one of {slice_size}) and"
            f" than the tolerance {tolerance:g}: its decode does not treat each sample alone, and slicing it is not the"
            " same computation."
        )
    return difference, rounding


def _in_slices(unit: DecodeUnit, decode: Any, z: torch.Tensor, args: Any, kwargs: Any) -> tuple[Any, int]:
    """The decode of ``z`` in slices of ``unit.k`` (:func:`~lightning_memopt.adapters.hf_diffusers.decode_in_slices`)
    and the size of its last slice. An output that is not a batch of tensors is decoded by the autoencoder's own
    slicing, from then on."""
    done = decode_in_slices(unit.module, decode, z, unit.k, args, kwargs)
    if done is None:
        unit.by_any, unit.k = False, 1
        return decode(z, *args, **kwargs), 1
    output, last, _ = done
    return output, last


class TilingCheck:
    """Until :meth:`stop`, keeps the first call of each tiled decoder: the first sample's latents and output.
    :meth:`differences` then decodes that sample again without tiling (no grad) and gives the largest absolute
    difference per decoder. MemOpt calls it when the loop ends, outside every batch.

    Args:
        units: The decode units; only those in ``tiled`` mode are watched.
    """

    def __init__(self, units: list[DecodeUnit]) -> None:
        self.units = [u for u in units if u.mode == "tiled"]
        self.calls: dict[str, tuple[tuple[Any, ...], dict[str, Any], torch.Tensor]] = {}
        self._handles = HandleGroup()
        for unit in self.units:
            self._handles.add(AttributeOverride.wrap(unit.module, "decode", functools.partial(self._watch, unit)))

    def _watch(self, unit: DecodeUnit, decode: Any) -> Any:
        def watched(z: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            output = decode(z, *args, **kwargs)
            if unit.name not in self.calls and isinstance(z, torch.Tensor) and z.shape[0] > 0:
                self.calls[unit.name] = (
                    (z[:1].detach(), *args),
                    kwargs,
                    _sample(output)[:1].detach().clone(),
                )
            return output

        return watched

    def stop(self) -> None:
        self._handles.remove()

    def differences(self) -> dict[str, float | None]:
        """Per tiled decoder, the largest absolute difference tiling made on the first sample it decoded (``None``:
        the untiled decode could not run, for example out of memory)."""
        self.stop()
        result: dict[str, float | None] = {}
        for unit in self.units:
            if unit.name not in self.calls:
                continue
            args, kwargs, tiled = self.calls.pop(unit.name)
            unit.set("sliced")
            try:
                with torch.no_grad():
                    plain = _sample(unit.module.decode(*args, **kwargs))[:1]
                result[unit.name] = float((plain.float() - tiled.float()).abs().max())
            except RuntimeError:
                result[unit.name] = None
            finally:
                unit.set("tiled")
        return result


def _sample(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    return output.sample if hasattr(output, "sample") else output[0]


def decode_options(n: int) -> list[int]:
    """The slice sizes tried for a decode of ``n`` samples, largest first: the divisors of ``n`` and the powers of two
    below it, each made the smallest size that decodes in as many calls (no other size has a lower peak for as many
    calls).

    Examples:
        >>> decode_options(14), decode_options(12), decode_options(2), decode_options(1)
        ([7, 4, 2, 1], [6, 4, 3, 2, 1], [1], [])
    """
    sizes = {d for d in range(1, n) if n % d == 0} | {2**i for i in range(max(n - 1, 0).bit_length())}
    return sorted({math.ceil(n / math.ceil(n / k)) for k in sizes if k < n}, reverse=True)


#: A decode's setting as a knob of the stage's planner: ``(mode, k, tile)``.
PLAIN = ("plain", 1, 1.0)


class Decoding(Technique):
    """The VAE decode technique in loops without gradients: each autoencoder's decode ``plain`` until chosen,
    ``sliced`` in slices of ``k`` samples (identical outputs) or ``tiled`` (outputs change at the tile seams; only
    where nothing else is left).

    It is the only writer of the modes in force (:meth:`set`, :meth:`finer`, :meth:`off`). With
    ``chunk_size="auto"`` each decode is a knob of the stage's planner, chosen with the blocks' chunking under one
    budget; a batch that runs out of memory slices the decodes first, by 1. Where a decode is tiled, the first sample
    it tiled is decoded again untiled when the loop ends, and the largest difference is reported
    (``tiling_max_abs_diff``).
    """

    name = "decoding"
    stages = ("predict", "validate", "test")
    option = "chunking"
    replans_longer = True
    timed_alone = True
    rescue_order = 0  # slicing first: its outputs do not change
    reports = ("decoding", "tiling_max_abs_diff")
    method = "decode slicing (tiling only under a budget)"

    def __init__(self) -> None:
        self.units: list[DecodeUnit] = []
        self.tiling: TilingCheck | None = None
        self.tiling_max_abs_diff: float | None = None
        self._notes: list[str] = []
        self._warned = False
        self.auto = False
        self.tolerance: float | None = None  # verify's, where verify is on
        self.slicing_checked: dict[str, tuple[float, float]] = {}  # per decode: check_slicing's figures

    def apply(self, found: Any, config: Any) -> Change | None:
        self.auto = config.chunk_size == "auto"
        decoders = [(n, m) for n, m in find_decoders(found.module) if all(m is not s for s in found.skip)]
        if not decoders:
            return None
        units = [DecodeUnit(f"{found.name}.{n}" if n else found.name, m) for n, m in decoders]
        self.tolerance = config.verify_tolerance if config.verify else None
        for unit in units:
            unit.verify = bool(config.verify)
        handle = apply_decoding(units)
        self.units += units
        return Change(self.method, len(units), handle, units, unit="autoencoder")

    def remove(self) -> None:
        self.units = []

    def set(
        self,
        modes: str | dict[str, Any],
        units: list[DecodeUnit] | None = None,
        k: int | dict[str, int] | None = None,
        tile: float | None = None,
    ) -> None:
        """Put ``modes`` in force: one mode for ``units`` (by default every one), or per unit name a mode or a
        ``(mode, k)`` or ``(mode, k, tile)`` tuple; ``k``, one for all or per unit name, sets the slice size too, and
        ``tile`` the tile scale (each unit keeps its own where not given)."""
        for unit in self.units if units is None else units:
            mode = modes if isinstance(modes, str) else modes.get(unit.name)
            size = k.get(unit.name) if isinstance(k, dict) else k
            scale = tile
            if isinstance(mode, list | tuple):
                mode, size, scale = (*mode, tile)[:3]
            if mode is not None:
                unit.set(mode, size, scale)

    def in_force(self) -> dict[str, tuple[str, int]]:
        """Per decode, its mode and slice size (each keeps its tile scale when these are put back)."""
        return {u.name: u.setting for u in self.units}

    def described(self) -> dict[str, str]:
        """Per decode, its mode in words (``sliced by 4``)."""
        return {u.name: u.describe() for u in self.units}

    def state(self) -> dict[str, list[Any]]:
        """The modes in force, for a checkpoint: ``[mode, k]`` per decode, and the tile scale where it is not 1."""
        return {u.name: [*u.setting, *([u.tile] if u.tile != 1.0 else [])] for u in self.units}

    def load(self, state: dict[str, Any]) -> bool:
        """Put saved modes in force; ``False`` (nothing changed) where they do not name every decode or are not
        modes. A mode saved without a tile scale tiles at the autoencoder's own size."""
        settings = {}
        for unit in self.units:
            value = state.get(unit.name)
            listed = isinstance(value, list | tuple) and len(value) in (2, 3)
            mode, k, tile = (*value, 1.0)[:3] if listed else (None,) * 3
            if mode not in MODES or isinstance(k, bool) or not isinstance(k, int) or k < 1 or tile not in TILE_SCALES:
                return False
            settings[unit.name] = (mode, k, tile)
        self.set(settings)
        return True

    def tileable(self, mode: str | None = None) -> list[DecodeUnit]:
        """The units that can be tiled (the user has not tiled them already), those in ``mode`` where given."""
        return [u for u in self.units if u.can_tile and mode in (None, u.mode)]

    def finer(self, lossy: bool) -> str | None:
        """One step cheaper in memory: slice every plain decode by 1, else every one sliced by more by 1, else, if
        ``lossy``, tile every sliced one, else halve the tiles of every tiled one. Says what it did; ``None`` where
        nothing was left."""
        if plain := [u for u in self.units if u.mode == "plain"]:
            self.set("sliced", plain, k=1)
            return "with the VAE decode sliced"
        if coarse := [u for u in self.units if u.mode == "sliced" and u.k > 1]:
            self.set("sliced", coarse, k=1)
            return "with the VAE decode sliced by 1"
        if lossy and (sliced := self.tileable("sliced")):
            self.set("tiled", sliced)
            return "with the VAE decode tiled"
        if lossy and (large := [u for u in self.tileable("tiled") if u.tile > TILE_SCALES[-1]]):
            for unit in large:
                unit.set("tiled", tile=TILE_SCALES[TILE_SCALES.index(unit.tile) + 1])
            return "with the VAE decode's tiles halved"
        return None

    def knobs(self, planning: Planning) -> list[Knob]:
        """With ``chunk_size="auto"``, each decode's ``(mode, k, tile)``: a knob of the stage's planner filled by
        decoding the first call's latents alone in each mode: plain, sliced by each of :func:`decode_options` (by 1
        only where it cannot be sliced by any size) and tiled at each of :data:`TILE_SCALES` where the user has not
        tiled it (the planner tries those only under a budget nothing else meets, where results may change:
        :attr:`Knob.lossy <lightning_memopt.techniques.base.Knob.lossy>`). The reference is sliced by 1."""
        return [self._knob(u) for u in self.units] if self.auto and planning.choose else []

    def plan(self, planning: Planning) -> Plan | None:
        """What the stage's planner chose for the decodes, in words (``chunk_size="auto"``)."""
        chosen = planning.chosen
        if chosen is None or not (self.auto and self.units and planning.choose):
            return None
        if chosen.peak_bytes is None:
            why = chosen.notes[0] if chosen.notes else "the step could not be traced"
            return Plan(warnings=[f"decode settings could not be chosen: {why}. The decodes stay as they are"])
        when = "longer inputs: " if planning.longer else ""
        modes = "; ".join(f"{name} decodes {mode}" for name, mode in self.described().items())
        return Plan(said=[f"{when}decode settings chosen by dry runs: {modes}"])

    @staticmethod
    def _knob(unit: DecodeUnit) -> Knob:
        def replay(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Hashable, ...], Hashable]:
            z = args[0] if args else kwargs.get("z")
            n = int(z.shape[0]) if isinstance(z, torch.Tensor) and z.dim() > 0 else 1
            sizes = decode_options(n) if unit.by_any else ([1] if n > 1 else [])
            sliced = [("sliced", k, 1.0) for k in sizes]
            tiled = [("tiled", 1, scale) for scale in TILE_SCALES] if unit.can_tile else []
            return (PLAIN, *sliced, *tiled), (sliced or [PLAIN])[-1]

        return Knob(
            unit.name,
            unit.module,
            (PLAIN,),
            lambda s: unit.set(*s),
            lambda: (unit.mode, unit.k, unit.tile),
            PLAIN,
            replay=replay,
            method="decode",
            lossy=lambda s: s[0] == "tiled",
        )

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """Every decode plain for a while. Each unit holds its setting meanwhile: verify's run of the step, the only
        one on real latents in here, decodes on the same slices as the real step (:func:`_verify_run`)."""
        saved = self.in_force()
        for unit in self.units:
            unit.held = (unit.mode, unit.k, unit.tile)
        self.set("plain")
        try:
            yield
        finally:
            self.set(saved)
            for unit in self.units:
                unit.held = None

    @property
    def changed(self) -> bool:
        return any(u.mode != "plain" for u in self.units)

    @classmethod
    def uses_budget(cls, config: Any) -> bool:
        return True

    def summary(self) -> str | None:
        return "; ".join(f"{name} decode {mode}" for name, mode in self.described().items()) or None

    def describe(self) -> str | None:
        return ", ".join(f"{name} {mode}" for name, mode in self.described().items()) or None

    def switchables(self) -> list[Switchable]:
        return [
            Switchable(
                u.name,
                u.module,
                "decode",
                functools.partial(u.set, *u.setting, u.tile),
                functools.partial(u.set, "plain"),
            )
            for u in self.units
            if u.mode != "plain"
        ]

    def batch_start(self) -> None:
        if self.tiling is None and any(u.mode == "tiled" for u in self.units):
            self.tiling = TilingCheck(self.units)  # the first tiled batch: keeps its first sample

    def batch_end(self) -> None:
        if self.tiling is not None:
            self.tiling.stop()  # what it kept is decoded again untiled when the loop ends, outside every batch
        for unit in self.units:  # after verify compared the step: the slicing itself, against its rounding
            try:
                checked = check_slicing(unit, self.tolerance or 0.0)
            except torch.OutOfMemoryError:
                checked = None
                self._notes.append(f"verify could not check {unit.name}'s slicing: its plain decode ran out of memory")
            if checked is not None and unit.name not in self.slicing_checked:
                self.slicing_checked[unit.name] = checked
                self._notes.append(
                    f"verify: {unit.name}'s decode compared on its slices; sliced, it differs from its plain decode by"
                    f" {checked[0]:.2g} (relative), the rounding of kernels run on fewer samples (a sample moves by"
                    f" {checked[1]:.2g} between batch sizes alone)"
                )

    def end(self) -> None:
        if self.tiling is None:
            return
        differences = self.tiling.differences()
        known = [d for d in differences.values() if d is not None]
        if known:
            self.tiling_max_abs_diff = max(known)
        if len(known) < len(differences):
            self._notes.append("the difference VAE tiling made could not be measured: decoding untiled failed")

    def abort(self) -> None:
        for unit in self.units:
            unit.kept, unit.held = None, None
        if self.tiling is not None:
            self.tiling.stop()
            self.tiling = None

    def notices(self, budget: int | None) -> list[str]:
        tiled = [u.name for u in self.units if u.mode == "tiled"]
        if not tiled or self._warned:
            return []
        self._warned = True
        why = f"the budget of {fmt_bytes(budget)} cannot be met" if budget else "a batch runs out of memory"
        return [
            f"VAE tiling is on for {', '.join(tiled)}, because {why} otherwise. Tiling changes the decoded outputs at"
            " the tile seams; the largest difference it made on the first sample it tiled is measured when the loop"
            " ends and logged as `memopt/tiling_max_abs_diff`."
        ]

    def section(self) -> Section:
        described = self.describe()
        return Section(
            settings={"decoding": described},
            metrics={"tiling_max_abs_diff": self.tiling_max_abs_diff},
            lines=[f"decoding: {described}"] if described is not None else [],
            notes=list(self._notes),
        )
