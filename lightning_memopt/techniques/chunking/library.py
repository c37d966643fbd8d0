"""A library's own chunking switch on its blocks, the skeleton every library family shares, plus the generic
technique on the feed-forward modules the switch does not reach."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from lightning_memopt.handles import AttributeSnapshot, Handle, HandleGroup
from lightning_memopt.techniques.base import Change
from lightning_memopt.techniques.chunking.core import ChunkUnit


def combine(method: str, units: list[ChunkUnit], handle: HandleGroup, extra: Change | None) -> Change:
    """One chunking :class:`Change` for a model's own switch plus, if any, the generic technique on what it missed."""
    if extra is None:
        return Change(method, len(units), handle, units)
    handle.add(extra.handle)
    return Change(f"{method} + {extra.method}", len(units) + extra.blocks, handle, units + extra.units)


def library_chunk(
    model: nn.Module,
    native: list[nn.Module],
    attributes: tuple[str, ...],
    method: str,
    unit_of: Callable[[str, nn.Module], tuple[ChunkUnit, Handle]],
    generic: Change | None,
) -> Change | None:
    """A library's own chunking on its ``native`` blocks (``unit_of`` makes each block's unit and its handle), the
    ``attributes`` the switch sets snapshotted, plus the generic technique's ``generic`` change on what it missed."""
    if not native:
        return generic
    names = {id(m): n for n, m in model.named_modules()}
    group = HandleGroup([AttributeSnapshot(native, attributes)])
    units = []
    for block in native:
        unit, handle = unit_of(names[id(block)], block)
        group.add(handle)
        units.append(unit)
    return combine(method, units, group, generic)
