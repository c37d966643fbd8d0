"""The changes MemOpt makes to the models for one technique: applied through the adapters, undone exactly, and set
aside for a while to see the model as the user gave it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_memopt.adapters import FoundModel
from lightning_memopt.callbacks.report import Applied, Technique
from lightning_memopt.techniques.checkpointing import CHECKPOINT_FUNCTION, CheckpointConfig, CheckpointUnit
from lightning_memopt.techniques.chunking import ChunkConfig, ChunkUnit
from lightning_memopt.techniques.decoding import DecodeUnit, apply_decoding, find_decoders
from lightning_memopt.techniques.handles import HandleGroup


class Changes:
    """One technique applied to the models found.

    Args:
        technique: ``checkpointing`` or ``chunking``.
        found: The models to change.
        checkpoint_config: How to checkpoint.
        chunk_config: How to chunk.
        skipped: Called with a sentence when a model has nothing the technique can use.

    Attributes:
        applied: What was done to which model, for the report.
        units: For chunking, each block's unit.
        decoders: For chunking, each autoencoder whose decode can be sliced or tiled (plain until chosen).
        switches: For checkpointing, the blocks that can be switched one by one.
        recomputed: For checkpointing by a library's switch, the modules that hold the checkpoint function it stored
            (to time the recomputation; blocks checkpointed generically are timed through their switches).
    """

    def __init__(
        self,
        technique: Technique,
        found: list[FoundModel],
        checkpoint_config: CheckpointConfig,
        chunk_config: ChunkConfig,
        skipped: Callable[[str], None],
    ) -> None:
        self.technique = technique
        self.found = found
        self.checkpoint_config = checkpoint_config
        self.chunk_config = chunk_config
        self.skipped = skipped
        self.applied: list[Applied] = []
        self.units: list[ChunkUnit] = []
        self.decoders: list[DecodeUnit] = []
        self.switches: list[CheckpointUnit] = []
        self.recomputed: list[nn.Module] = []
        self._handles = HandleGroup()

    def apply(self, quiet: bool = False) -> None:
        self.applied, self.units, self.switches, self.recomputed, self.decoders = [], [], [], [], []
        for found in self.found:
            try:  # an adapter undoes what it did before it raises: a model is changed fully or not at all
                if self.technique == "checkpointing":
                    change = found.adapter.checkpoint(found.module, self.checkpoint_config, found.skip)
                else:
                    change = found.adapter.chunk(found.module, self.chunk_config, found.skip)
            except Exception as error:
                reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                self.skipped(f"{self.technique} could not be applied to {found.label} ({reason})")
                continue
            decoders = self._decoders(found, quiet) if self.technique == "chunking" else []
            if change is None:
                if not found.skip and not quiet and not decoders:  # a container of library models has nothing to miss
                    self.skipped(f"{found.label} has no blocks MemOpt can use for {self.technique}")
                continue
            self._handles.add(change.handle)
            for part in change.skipped if not quiet else []:
                rank_zero_warn(f"MemOpt: in {found.label}, {part}.")
            for unit in [*change.units, *change.switches]:
                unit.name = f"{found.name}.{unit.name}"
            self.units += change.units
            self.switches += change.switches
            if self.technique == "checkpointing":
                self.recomputed += [m for m in found.module.modules() if CHECKPOINT_FUNCTION in m.__dict__]
            self.applied.append(Applied(found.label, self.technique, change.method, change.blocks))
            if not quiet:
                rank_zero_info(
                    f"MemOpt: {self.technique} on {found.label} via {change.method} ({change.blocks} blocks)."
                )

    def _decoders(self, found: FoundModel, quiet: bool) -> list[DecodeUnit]:
        """The model's autoencoders with decode slicing and tiling switches, as units left plain until chosen."""
        decoders = [(n, m) for n, m in find_decoders(found.module) if all(m is not s for s in found.skip)]
        units = [DecodeUnit(f"{found.name}.{n}" if n else found.name, m) for n, m in decoders]
        if not units:
            return []
        self._handles.add(apply_decoding(units))
        self.decoders += units
        method = "decode slicing (tiling only under a budget)"
        self.applied.append(Applied(found.label, "decoding", method, len(units)))
        if not quiet:
            rank_zero_info(f"MemOpt: decoding on {found.label} via {method}.")
        return units

    def remove(self) -> None:
        self._handles.remove()
        self.units, self.switches, self.recomputed, self.decoders = [], [], [], []

    def add_handle(self, handle: object) -> None:
        """Undo ``handle`` with the rest (a wrapper MemOpt added for this technique)."""
        self._handles.add(handle)

    @contextlib.contextmanager
    def undone(self) -> Iterator[None]:
        """The models as the user gave them for a while: chunk units off (they keep their settings for afterwards),
        checkpointing removed and put back with every switch as it was."""
        if self.technique == "chunking":
            saved = [(u, u.dim, u.size) for u in self.units]
            modes = [(d, d.mode) for d in self.decoders]
            for unit in self.units:
                unit.size = None
            for decoder in self.decoders:
                decoder.set("plain")
            try:
                yield
            finally:
                for unit, dim, size in saved:
                    unit.set(dim, size)
                for decoder, mode in modes:
                    decoder.set(mode)
            return
        enabled = [u.enabled for u in self.switches]
        wrappers, self._handles = self._handles, HandleGroup()
        wrappers.remove()
        try:
            yield
        finally:
            self.apply(quiet=True)
            for unit, on in zip(self.switches, enabled, strict=True):
                unit.enabled = on
