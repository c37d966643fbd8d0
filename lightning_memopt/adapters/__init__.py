"""Model adapters, and the search that finds models inside a LightningModule.

Adapters are tried in order; the first that claims a module handles it and its whole subtree. Anything left over is
handled by the generic torch adapter. Supporting a new family means adding an adapter to :data:`ADAPTERS` (what it
claims, and its facts tables), and, where the family has its own switch, an entry in each technique's table of
per-family code (checkpointing's ``SWITCHES``, chunking's ``FAMILIES``); without one, its models get the techniques'
generic code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from lightning_memopt.adapters.base import Adapter
from lightning_memopt.adapters.hf_diffusers import DiffusersAdapter
from lightning_memopt.adapters.hf_transformers import TransformersAdapter
from lightning_memopt.adapters.peft_models import unwrap
from lightning_memopt.adapters.torch_generic import TorchAdapter

#: Library adapters, tried in order before the generic fallback.
ADAPTERS: tuple[Adapter, ...] = (DiffusersAdapter(), TransformersAdapter())
GENERIC: Adapter = TorchAdapter()

__all__ = ["ADAPTERS", "GENERIC", "Adapter", "FoundModel", "find_models"]


@dataclass
class FoundModel:
    """A model found inside the LightningModule.

    Attributes:
        name: Its attribute path in the LightningModule, such as ``unet`` or ``model``.
        module: The module the adapter acts on (a PEFT wrapper's base model, not the wrapper).
        adapter: The adapter that handles it.
        wrapper: The wrapper's class name, such as ``PeftModel``, if it was unwrapped.
        skip: Library models nested inside a generic model; the generic adapter leaves them alone.
    """

    name: str
    module: nn.Module
    adapter: Adapter
    wrapper: str | None = None
    skip: list[nn.Module] = field(default_factory=list)

    @property
    def label(self) -> str:
        cls = type(self.module).__name__
        return f"{self.name} ({self.wrapper} of {cls})" if self.wrapper else f"{self.name} ({cls})"


def _library_models(name: str, root: nn.Module) -> list[FoundModel]:
    found: list[FoundModel] = []
    claimed: list[str] = []
    for sub_name, module in root.named_modules(prefix=name):
        if any(sub_name == c or sub_name.startswith(c + ".") for c in claimed):
            continue
        base = unwrap(module)
        target = base if base is not None else module
        adapter = next((a for a in ADAPTERS if a.claims(target)), None)
        if adapter is not None:
            wrapper = type(module).__name__ if base is not None else None
            found.append(FoundModel(sub_name, target, adapter, wrapper))
            claimed.append(sub_name)
    return found


def find_models(root: nn.Module, names: Sequence[str] | None = None) -> list[FoundModel]:
    """Find every model inside ``root`` (a LightningModule) that MemOpt can act on.

    Library models (diffusers, transformers, PEFT-wrapped) are found at any depth. Each direct child of ``root`` (or
    each named attribute) that is not one of them, and has parameters and submodules, becomes a generic model.

    Args:
        root: The module to search.
        names: Search only these attributes of ``root``.

    Raises:
        ValueError: If a name in ``names`` is not a submodule of ``root``.

    Examples:
        >>> from torch import nn
        >>> root = nn.Module()
        >>> root.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2), 2, enable_nested_tensor=False)
        >>> [m.label for m in find_models(root)]
        ['encoder (TransformerEncoder)']
    """
    children = dict(root.named_children())
    if names is not None:
        missing = [n for n in names if not isinstance(getattr(root, n, None), nn.Module)]
        if missing:
            raise ValueError(f"`models` names {missing!r}, which are not submodules; choose from {sorted(children)!r}")
        children = {n: getattr(root, n) for n in names}
    found: list[FoundModel] = []
    for name, child in children.items():
        library = _library_models(name, child)
        found.extend(library)
        if library and library[0].name == name:
            continue
        has_params = any(True for _ in child.parameters())
        if has_params and any(True for _ in child.children()):
            found.append(FoundModel(name, child, GENERIC, skip=[m.module for m in library]))
    return found
