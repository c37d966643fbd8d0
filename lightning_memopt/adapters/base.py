"""What every adapter returns, and the shape of an adapter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import nn

from lightning_memopt.techniques.checkpointing import CheckpointConfig
from lightning_memopt.techniques.chunking import ChunkConfig
from lightning_memopt.techniques.handles import Handle, HandleGroup


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


def combine(method: str, blocks: int, handle: HandleGroup, extra: Change | None) -> Change:
    """One :class:`Change` for a model's own switch plus, if any, the generic technique on the modules it missed."""
    if extra is not None:
        handle.add(extra.handle)
        method, blocks = f"{method} + {extra.method}", blocks + extra.blocks
    return Change(method, blocks, handle)


class Adapter(Protocol):
    """Knows one model family: which modules belong to it and how to switch its techniques on."""

    name: str

    def claims(self, module: nn.Module) -> bool: ...

    def checkpoint(self, model: nn.Module, config: CheckpointConfig, skip: list[nn.Module]) -> Change | None: ...

    def chunk(self, model: nn.Module, config: ChunkConfig, skip: list[nn.Module]) -> Change | None: ...
