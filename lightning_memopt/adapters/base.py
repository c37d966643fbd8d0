"""What every adapter returns, and the shape of an adapter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import nn

from lightning_memopt.techniques.checkpointing import CheckpointConfig
from lightning_memopt.techniques.chunking import ChunkConfig
from lightning_memopt.techniques.handles import Handle


@dataclass
class Change:
    """One technique applied to one model.

    Attributes:
        method: How it was applied, for the user: the library switch that was called, or ``generic``.
        blocks: How many blocks (layers) it reached.
        handle: Undoes the change exactly.
    """

    method: str
    blocks: int
    handle: Handle


class Adapter(Protocol):
    """Knows one model family: which modules belong to it and how to switch its techniques on."""

    name: str

    def claims(self, module: nn.Module) -> bool: ...

    def checkpoint(self, model: nn.Module, config: CheckpointConfig, skip: list[nn.Module]) -> Change | None: ...

    def chunk(self, model: nn.Module, config: ChunkConfig, skip: list[nn.Module]) -> Change | None: ...
