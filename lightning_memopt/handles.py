"""Handles that undo what a technique did to a module, exactly."""

from __future__ import annotations

import collections
import contextlib
import functools
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from torch import nn

_MISSING = object()
#: Where :class:`AsGiven` sits on a module: the instance attribute that ``copy.deepcopy``, ``copy.copy`` and pickle
#: look up before the class's.
REDUCE = "__reduce_ex__"


class AsGiven:
    """A module's instance ``__reduce_ex__`` while MemOpt has changed some of its instance attributes: a copy of the
    module (an EMA or best-model copy taken during fit, ``torch.save`` of it) gets those attributes as the user gave
    them, not MemOpt's (a checkpointing flag, a wrapped ``forward``), and no ``AsGiven`` of its own.

    Handles that change attributes :meth:`register` the values they will put back, and :meth:`release` them when
    they do; the oldest value registered for a name is the user's. The last release takes ``AsGiven`` off the
    module. A module whose class sets ``__deepcopy__`` (a parametrized one) is deep-copied by it, not by this.

    Examples:
        >>> import copy
        >>> from torch import nn
        >>> layer = nn.Linear(2, 2)
        >>> token = AsGiven.register(layer, {"forward": _MISSING, "flag": False})
        >>> layer.__dict__["forward"], layer.flag = (lambda x: x), True
        >>> twin = copy.deepcopy(layer)
        >>> "forward" in twin.__dict__, twin.flag, REDUCE in twin.__dict__
        (False, False, False)
        >>> AsGiven.release(layer, token); REDUCE in layer.__dict__
        False
    """

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)
        self._given: list[tuple[object, dict[str, Any]]] = []  # (token, values), oldest first

    @classmethod
    def register(cls, module: Any, values: dict[str, Any]) -> object | None:
        """Note the values of ``module``'s attributes that a copy should get (``_MISSING``: absent). Returns the
        token for :meth:`release`, or ``None`` if ``module`` is not a module or has a ``__reduce_ex__`` of its own."""
        if not isinstance(module, nn.Module):
            return None
        given = module.__dict__.setdefault(REDUCE, cls(module))
        if not isinstance(given, AsGiven):
            return None
        token = object()
        given._given.append((token, values))
        return token

    @staticmethod
    def release(module: Any, token: object | None) -> None:
        """Forget the values registered with ``token``; take ``AsGiven`` off the module when none are left."""
        given = module.__dict__.get(REDUCE) if token is not None else None
        if isinstance(given, AsGiven):
            given._given = [(t, v) for t, v in given._given if t is not token]
            if not given._given:
                del module.__dict__[REDUCE]

    def __call__(self, protocol: int) -> Any:
        module = self._module()
        reduced = type(module).__reduce_ex__(module, protocol)
        if not isinstance(reduced, tuple) or len(reduced) < 3 or not isinstance(reduced[2], dict):
            return reduced
        state = {k: v for k, v in reduced[2].items() if k != REDUCE}
        for _, values in reversed(self._given):  # the oldest last: the user's values win
            for name, value in values.items():
                if value is _MISSING:
                    state.pop(name, None)
                else:
                    state[name] = value
        return (*reduced[:2], state, *reduced[3:])

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None  # only reached when a module's __dict__ is copied by itself: the copy has no module to stand for


class Handle(Protocol):
    """Anything that can undo one change to a model. ``remove()`` must be safe to call twice."""

    def remove(self) -> None: ...


class AttributeSnapshot:
    """Remembers some instance attributes of modules and puts them back exactly as they were.

    An attribute that was absent from a module's ``__dict__`` is deleted again on :meth:`remove`, so class defaults
    show through as before.

    Examples:
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
        self._tokens = [AsGiven.register(m, values) for m, values in self._saved]  # copies get these values

    def remove(self) -> None:
        for (module, values), token in zip(self._saved, self._tokens, strict=True):
            for name, value in values.items():
                if value is _MISSING:
                    module.__dict__.pop(name, None)
                else:
                    module.__dict__[name] = value
            AsGiven.release(module, token)
        self._saved, self._tokens = [], []


class HandleGroup:
    """Several handles undone together, last applied first. Every handle is removed even when one raises; the first
    error is raised after the rest are removed.

    Examples:
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
        remove_all(self._handles)


def remove_all(handles: list[Any]) -> None:
    """Remove every handle in ``handles``, last first, emptying the list; when some raise, the first error is raised
    once all are removed (a handle that fails cannot strand the others on the user's model)."""
    steps = []
    while handles:
        steps.append(handles.pop().remove)
    run_all(steps)


def run_all(steps: Iterable[Any]) -> None:
    """Call every step in order; when some raise, the first error is raised once all have run (one that fails cannot
    keep the others from undoing their part).

    Examples:
        >>> done = []
        >>> def fail(): raise ValueError("first")
        >>> run_all([fail, lambda: done.append(1)])
        Traceback (most recent call last):
        ...
        ValueError: first
        >>> done
        [1]
    """
    first: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as error:  # noqa: B036 - re-raised below, after the others have run
            first = first or error
    if first is not None:
        raise first


class _Layers:
    """The overrides of one attribute of one object, oldest first, and what was there before the first
    (``_MISSING``: nothing in the instance's ``__dict__``)."""

    def __init__(self, original: Any) -> None:
        self.original = original
        self.overrides: list[AttributeOverride] = []


#: Per object (by id, with a weak reference to tell a reused id apart) and attribute name, its overrides.
_LAYERS: dict[int, tuple[Any, dict[str, _Layers]]] = {}


def _layers(obj: Any, name: str, create: bool) -> _Layers | None:
    entry = _LAYERS.get(id(obj))
    if entry is not None and entry[0]() is not obj:  # an object gone whose id was reused
        entry = None
        del _LAYERS[id(obj)]
    if entry is None:
        if not create:
            return None
        entry = _LAYERS[id(obj)] = (weakref.ref(obj), {})
    layers = entry[1].get(name)
    if layers is None and create:
        layers = entry[1][name] = _Layers(obj.__dict__.get(name, _MISSING))
    return layers


def _resolved(obj: Any, name: str, value: Any) -> Any:
    """``value``, or where the instance had none (``_MISSING``) its class's attribute, bound to it (where the class
    has none either, a callable that says so)."""
    if value is not _MISSING:
        return value
    attribute = getattr(type(obj), name, _MISSING)
    if attribute is _MISSING:
        return functools.partial(_absent, type(obj).__name__, name)
    return attribute.__get__(obj, type(obj)) if hasattr(attribute, "__get__") else attribute


def _absent(owner: str, name: str, *args: Any, **kwargs: Any) -> Any:
    raise AttributeError(f"{owner} has no attribute {name!r} below this override")


def _forget(obj: Any, name: str) -> None:
    entry = _LAYERS.get(id(obj))
    if entry is not None:
        entry[1].pop(name, None)
        if not entry[1]:
            del _LAYERS[id(obj)]


class AttributeOverride:
    """Sets an attribute on one instance (shadowing its class's) and can put back exactly what was there.

    Overrides of the same attribute stack, as hooks do: the attribute holds the newest, and removing any of them, in
    any order, leaves the next newest in force, or, once the last is removed, the value the first one found (the
    class's, where the instance had none). A wrapper made with :meth:`wrap` calls whatever is below it *now*, so that
    removing a wrapper beneath it takes that wrapper out of the chain at once.

    Examples:
        >>> from torch import nn
        >>> layer = nn.Identity()
        >>> handle = AttributeOverride(layer, "forward", lambda x: x * 2)
        >>> layer(3)
        6
        >>> handle.remove(); layer(3)
        3
        >>> double = AttributeOverride.wrap(layer, "forward", lambda inner: lambda x: inner(x) * 2)
        >>> plus = AttributeOverride.wrap(layer, "forward", lambda inner: lambda x: inner(x) + 1)
        >>> layer(3), double.remove(), layer(3), plus.remove(), "forward" in layer.__dict__
        (7, None, 4, None, False)
    """

    def __init__(self, obj: Any, name: str, value: Any) -> None:
        self._obj: Any = obj
        self._name = name
        layers = _layers(obj, name, create=True)
        assert layers is not None
        self._token = AsGiven.register(obj, {name: layers.original})  # a copy of a module gets what the user had
        # what is below it: the override beneath, else the user's attribute (the class's, bound, where none)
        self._next = layers.overrides[-1].value if layers.overrides else _resolved(obj, name, layers.original)
        layers.overrides.append(self)
        self.value = value
        obj.__dict__[name] = value

    @classmethod
    def wrap(cls, obj: Any, name: str, make: Any) -> AttributeOverride:
        """Override ``obj.name`` with ``make(inner)``, where ``inner`` calls what is below this override at the time
        of the call (an override beneath, or the original). The wrapper shows what it wraps (its name, docstring and
        signature, as ``functools.update_wrapper`` gives them): code that reads ``inspect.signature(module.forward)``
        sees the module's own."""
        handle = cls.__new__(cls)
        AttributeOverride.__init__(handle, obj, name, make(handle.below))
        if callable(handle._next):
            with contextlib.suppress(AttributeError, TypeError):  # a wrapper that takes no attributes stays as made
                functools.update_wrapper(handle.value, handle._next)
        return handle

    def below(self, *args: Any, **kwargs: Any) -> Any:
        """Call what is below this override now: the override beneath it, or the attribute as the user had it."""
        return self._next(*args, **kwargs)

    def remove(self) -> None:
        obj, name = self._obj, self._name
        if obj is None:
            return
        layers = _layers(obj, name, create=False)
        if layers is not None and self in layers.overrides:
            index = layers.overrides.index(self)
            layers.overrides.pop(index)
            if index < len(layers.overrides):  # the one above now calls what was below this one
                layers.overrides[index]._next = self._next
            if not layers.overrides:  # the last: what the first found
                if layers.original is _MISSING:
                    obj.__dict__.pop(name, None)
                else:
                    obj.__dict__[name] = layers.original
                _forget(obj, name)
            elif index == len(layers.overrides):  # the newest: the next newest is in force
                obj.__dict__[name] = layers.overrides[-1].value
        AsGiven.release(obj, self._token)
        self._obj = None


CONTAINERS = (dict, list, set, collections.deque)


def find_containers(value: Any, depth: int | None = None) -> list[Any]:
    """The dicts, lists, sets and deques in ``value`` and nested in them, each once, down to ``depth`` levels (all
    without one). Tuples are looked into but not kept; tensors and other objects are not looked into.

    Examples:
        >>> cache = {"k": [1]}
        >>> " ".join(type(c).__name__ for c in find_containers(((cache,), {"x": 2})))
        'dict list dict'
    """
    found: dict[int, Any] = {}

    def visit(item: Any, level: int) -> None:
        if isinstance(item, CONTAINERS):
            if id(item) in found:
                return
            found[id(item)] = item
        elif not isinstance(item, tuple):
            return
        if depth is None or level < depth:
            for inner in list(item.values() if isinstance(item, dict) else item):
                visit(inner, level + 1)

    visit(value, 0)
    return list(found.values())


class ContainerSnapshot:
    """The contents of some dicts, lists, sets and deques, put back in place by :meth:`remove`, so that whoever holds
    them sees them as they were; a container whose contents are the same objects is left alone.

    Examples:
        >>> outputs, by_stage = [1], {"val": [2]}
        >>> snapshot = ContainerSnapshot(find_containers((outputs, by_stage)))
        >>> outputs.append(3); by_stage["val"].append(4); by_stage["test"] = []
        >>> " ".join(type(c).__name__ for c in snapshot.changed().containers)
        'list dict list'
        >>> snapshot.remove(); outputs, by_stage
        ([1], {'val': [2]})
    """

    def __init__(self, containers: Iterable[Any]) -> None:
        self._saved = [(c, _contents(c)) for c in containers]

    @property
    def containers(self) -> list[Any]:
        return [c for c, _ in self._saved]

    def changed(self) -> ContainerSnapshot:
        """The containers whose contents changed since this snapshot, with their contents as they were."""
        changed = ContainerSnapshot([])
        changed._saved = [(c, old) for c, old in self._saved if not _same(c, old)]
        return changed

    def remove(self) -> None:
        for container, old in self._saved:
            if not _same(container, old):
                container.clear()
                if isinstance(container, (dict, set)):
                    container.update(old)
                else:
                    container.extend(old)


def _contents(container: Any) -> Any:
    return dict(container) if isinstance(container, dict) else list(container)


def _same(container: Any, old: Any) -> bool:
    if isinstance(container, dict):
        return container.keys() == old.keys() and all(container[k] is v for k, v in old.items())
    return len(container) == len(old) and all(a is b for a, b in zip(container, old, strict=True))
