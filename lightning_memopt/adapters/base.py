"""The shape of an adapter, and the discovery every technique shares: repeated block stacks, blocks by class, the
outermost modules that match, and the flags a library's checkpointing switch leaves. Facts only: how a technique acts
on a family lives in the technique's own package (:mod:`lightning_memopt.techniques`)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from torch import nn

#: Reads the lengths a block can chunk along (dim: length) from one call's ``(args, kwargs)``, before it runs.
LengthsFn = Callable[[tuple[Any, ...], dict[str, Any]], dict[int, int]]


class Adapter(Protocol):
    """Knows one model family: which modules belong to it (:meth:`claims`). ``name`` is the family's key in each
    technique's table of per-family code (``torch``, ``transformers``, ``diffusers``)."""

    name: str

    def claims(self, module: nn.Module) -> bool: ...


class LibraryAdapter:
    """What every library's adapter shares: it claims the library's base model class, only where the library is
    imported already (a model cannot be one otherwise)."""

    name: str = ""  #: the library's module name
    model_class: str = ""  #: the library's base model class, in that module
    supports: str = ""  #: the model attribute that says it has a checkpointing switch

    def claims(self, module: nn.Module) -> bool:
        library = sys.modules.get(self.name)
        return library is not None and isinstance(module, getattr(library, self.model_class))

    def has_checkpointing_switch(self, model: nn.Module) -> bool:
        """Whether ``model`` has its library's checkpointing switch."""
        return bool(getattr(model, self.supports, False))


def flagged(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules whose ``gradient_checkpointing`` flag is on, by name (a library's checkpointing switch)."""
    return [(n, m) for n, m in model.named_modules() if m.__dict__.get("gradient_checkpointing") is True]


def stack_blocks(model: nn.Module) -> int:
    """How many blocks the outermost stacks of ``model`` hold (an ``nn.ModuleList`` of modules of one class that have
    children, one-block stacks included): what a library that keeps one flag for all its blocks checkpoints."""
    children = [c for c in model.children() if c is not None]
    if isinstance(model, nn.ModuleList) and children and len({type(c) for c in children}) == 1:
        if any(True for _ in children[0].children()):
            return len(children)
    return sum(stack_blocks(c) for c in children)


def _is_stack(module: nn.Module) -> bool:
    children = list(module.children())
    if len(children) < 2 or not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return False
    first = type(children[0])
    return all(type(c) is first for c in children) and any(True for _ in children[0].children())


def find_block_stacks(root: nn.Module, skip: Sequence[nn.Module] = ()) -> list[nn.Module]:
    """Find the blocks of the outermost repeated stacks under ``root``.

    A stack is an ``nn.ModuleList`` or ``nn.Sequential`` of two or more children of one class that has submodules of
    its own, such as the ``layers`` of an ``nn.TransformerEncoder``. Subtrees in ``skip`` are not searched.

    Examples:
        >>> from torch import nn
        >>> layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, batch_first=True)
        >>> encoder = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
        >>> [type(b).__name__ for b in find_block_stacks(encoder)]
        ['TransformerEncoderLayer', 'TransformerEncoderLayer', 'TransformerEncoderLayer']
    """
    return [block for stack in find_outermost(root, _is_stack, skip) for block in stack.children()]


def find_outermost(
    root: nn.Module, match: Callable[[nn.Module], bool], skip: Sequence[nn.Module] = ()
) -> list[nn.Module]:
    """The outermost modules in ``root`` (``root`` itself included) for which ``match`` is true, outside the subtrees in
    ``skip``.

    Examples:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2))
        >>> [type(m).__name__ for m in find_outermost(net, lambda m: isinstance(m, nn.Linear))]
        ['Linear', 'Linear']
    """
    skipped = {id(m) for m in skip}
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if id(module) in skipped:
            return
        if match(module):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(root)
    return found


def find_blocks_by_class(
    root: nn.Module, classes: Sequence[type | str], skip: Sequence[nn.Module] = ()
) -> list[nn.Module]:
    """Find the outermost instances of ``classes`` (types, or class names compared without regard to case) under
    ``root``.

    Examples:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.ReLU())
        >>> [type(b).__name__ for b in find_blocks_by_class(net, ["Linear"])]
        ['Linear']
    """
    types = tuple(c for c in classes if isinstance(c, type))
    names = {c.lower() for c in classes if isinstance(c, str)}
    return find_outermost(root, lambda m: isinstance(m, types) or type(m).__name__.lower() in names, skip)
