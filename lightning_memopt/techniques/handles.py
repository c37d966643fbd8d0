"""Handles that undo what a technique did to a module, exactly."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from torch import nn

_MISSING = object()


class Handle(Protocol):
    """Anything that can undo one change to a model. ``remove()`` must be safe to call twice."""

    def remove(self) -> None: ...


class AttributeSnapshot:
    """Remembers some instance attributes of modules and puts them back exactly as they were.

    An attribute that was absent from a module's ``__dict__`` is deleted again on :meth:`remove`, so class defaults
    show through as before.

    Example:
        >>> from torch import nn
        >>> layer = nn.Linear(2, 2)
        >>> snap = AttributeSnapshot([layer], ("chunk_size", "training"))
        >>> layer.chunk_size, layer.training = 4, False
        >>> snap.remove()
        >>> hasattr(layer, "chunk_size"), layer.training
        (False, True)
    """

    def __init__(self, modules: Iterable[nn.Module], names: Sequence[str]) -> None:
        self._saved = [(m, {n: m.__dict__.get(n, _MISSING) for n in names}) for m in modules]

    def remove(self) -> None:
        for module, values in self._saved:
            for name, value in values.items():
                if value is _MISSING:
                    module.__dict__.pop(name, None)
                else:
                    module.__dict__[name] = value
        self._saved = []


class HandleGroup:
    """Several handles undone together, last applied first.

    Example:
        >>> group = HandleGroup()
        >>> group.add(AttributeSnapshot([], ("x",)))
        >>> len(group)
        1
        >>> group.remove(); len(group)
        0
    """

    def __init__(self, handles: Iterable[Any] = ()) -> None:
        self._handles: list[Any] = list(handles)

    def add(self, handle: Any) -> None:
        self._handles.append(handle)

    def __len__(self) -> int:
        return len(self._handles)

    def remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()


class AttributeOverride:
    """Sets an attribute on one instance (shadowing its class's) and can put back exactly what was there.

    Example:
        >>> from torch import nn
        >>> layer = nn.Identity()
        >>> handle = AttributeOverride(layer, "forward", lambda x: x * 2)
        >>> layer(3)
        6
        >>> handle.remove(); layer(3)
        3
    """

    def __init__(self, obj: Any, name: str, value: Any) -> None:
        self._obj: Any = obj
        self._name = name
        self._previous = obj.__dict__.get(name, _MISSING)
        obj.__dict__[name] = value

    def remove(self) -> None:
        if self._obj is None:
            return
        if self._previous is _MISSING:
            self._obj.__dict__.pop(self._name, None)
        else:
            self._obj.__dict__[self._name] = self._previous
        self._obj = None


class ForwardOverride(AttributeOverride):
    """Replaces ``module.forward`` on the instance; ``remove()`` puts the original back."""

    def __init__(self, module: nn.Module, forward: Any) -> None:
        super().__init__(module, "forward", forward)
