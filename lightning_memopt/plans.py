"""Plans kept between runs: what a stage chose and what its dry runs found, under a key of what decided them.

The entries live beside the device's speeds (:func:`~lightning_memopt.timing.cache_file`'s folder, ``plans.json``;
``LIGHTNING_MEMOPT_CACHE_DIR`` moves it, set empty keeps nothing). A key is a hash of everything the figures depend on:
the module tree (each module's class and where its code is, each parameter's and buffer's shape, type and
``requires_grad``), the batch's shapes and types, MemOpt's options, the device, the Trainer's facts that reach the step,
the step's own source and the libraries' versions. The same key gives the same plan; any change makes a new one. An
unreadable file is set aside with one warning, and the plans are made anew.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> a = key_of(tree(nn.Linear(2, 2)), layout(torch.zeros(3, 2)))
    >>> a == key_of(tree(nn.Linear(2, 2)), layout(torch.zeros(3, 2))), a == key_of(tree(nn.Linear(2, 3)))
    (True, False)
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_memopt.compat import tensors_in
from lightning_memopt.timing import cache_file

#: The layout of an entry; an entry of another is not read.
VERSION = 1
#: The most entries the file keeps: the newest.
KEPT = 64
#: The libraries whose versions are in every key, where they are imported.
LIBRARIES = ("torch", "lightning", "diffusers", "transformers", "peft", "torchmetrics", "bitsandbytes")


def path() -> Path | None:
    """Where the plans are kept (``None``: nowhere, ``LIGHTNING_MEMOPT_CACHE_DIR`` set empty)."""
    speeds = cache_file()
    return speeds.with_name("plans.json") if speeds is not None else None


def _code(cls: type) -> tuple[str, str, float | None]:
    """A class, and when the file that holds its code last changed (``None``: none is known)."""
    try:
        changed: float | None = os.path.getmtime(inspect.getfile(cls))
    except (OSError, TypeError):
        changed = None
    return cls.__module__, cls.__qualname__, changed


def tree(module: nn.Module) -> list[Any]:
    """What a module tree's memory depends on: each module's class, its code's file time and its plain settings (a
    layer's ``batch_first``, a norm's ``eps``: :func:`settings`; not a LightningModule's own, which hold the run's
    hyperparameters and counts), each parameter's and buffer's name, shape, type and ``requires_grad``.

    Examples:
        >>> def layer(batch_first):
        ...     return nn.TransformerEncoderLayer(8, 2, 16, batch_first=batch_first)
        >>> tree(layer(True)) == tree(layer(True)), tree(layer(True)) == tree(layer(False))
        (True, False)
    """
    classes = sorted({_code(type(m)) for m in module.modules()}, key=repr)
    params = [(n, list(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]
    buffers = [(n, list(b.shape), str(b.dtype)) for n, b in module.named_buffers()]
    modules = [
        [name, type(m).__qualname__, [] if isinstance(m, LightningModule) else settings(m)]
        for name, m in module.named_modules()
    ]
    return [modules, classes, params, buffers]


def settings(module: nn.Module) -> list[Any]:
    """A module's own public attributes that hold plain values (``bool``, ``int``, ``float``, ``str``, ``None``), but
    ``training``, which Lightning switches.

    Examples:
        >>> settings(nn.Dropout(0.1))
        [['inplace', False], ['p', 0.1]]
    """
    plain = (bool, int, float, str, type(None))
    return sorted(
        [k, v] for k, v in vars(module).items() if not k.startswith("_") and k != "training" and isinstance(v, plain)
    )


def layout(batch: Any) -> list[Any]:
    """A batch's tensors' shapes and types, in order."""
    return [[list(t.shape), str(t.dtype)] for t in tensors_in(batch)]


@functools.cache
def _package_changed() -> float:
    """When this package's code last changed (its newest file): an edit of it in a checkout plans anew too."""
    return max(path.stat().st_mtime for path in Path(__file__).parent.rglob("*.py"))


def versions() -> dict[str, str]:
    """The versions of the libraries imported now, and when this package's code last changed."""
    found = {"lightning_memopt": str(_package_changed())}
    for name in LIBRARIES:
        module = sys.modules.get(name)
        if module is not None:
            found[name] = str(getattr(module, "__version__", "?"))
    return found


def source(cls: type, name: str) -> str:
    """The source of ``cls``'s method ``name`` (the step), or its qualified name where the source is not at hand."""
    method = getattr(cls, name, None)
    try:
        return inspect.getsource(method) if method is not None else ""
    except (OSError, TypeError):
        return getattr(method, "__qualname__", repr(method))


def key_of(*parts: Any) -> str:
    """A key for ``parts`` (plain values; anything else by its ``repr``)."""
    text = json.dumps([*parts, versions()], default=repr, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def owner_of(stage: str, module: nn.Module, batch: Any) -> str:
    """What the bytes a real step takes beyond its dry run belong to (:func:`~lightning_memopt.timing.unseen_bytes`):
    the stage, the module tree and the batch's layout."""
    return key_of(stage, tree(module), layout(batch))[:16]


def recall(key: str | None) -> dict[str, Any] | None:
    """The entry kept under ``key``, with ``when`` it was kept (``None``: none, or another layout's)."""
    if key is None:
        return None
    entry = _read().get(key)
    return entry if isinstance(entry, dict) and entry.get("version") == VERSION else None


def keep(key: str | None, **values: Any) -> None:
    """Keep ``values`` under ``key`` (merged into its entry, stamped with the time); the oldest entries past
    :data:`KEPT` are dropped. A file that cannot be written is left alone."""
    where = path()
    if key is None or where is None:
        return
    entries = _read()
    entry = entries.pop(key, None)
    entry = entry if isinstance(entry, dict) and entry.get("version") == VERSION else {}
    when = datetime.datetime.now().isoformat(timespec="seconds")
    entries[key] = {**entry, **values, "version": VERSION, "when": when}
    entries = dict(list(entries.items())[-KEPT:])
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        partial = where.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(entries, default=_plain))
        partial.replace(where)  # whole or not at all, for a run reading it meanwhile
    except OSError:
        pass


def _plain(value: Any) -> Any:
    if isinstance(value, (tuple, set)):
        return list(value)
    if isinstance(value, torch.dtype):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not kept in {path()}")


_WARNED: set[str] = set()


def _read() -> dict[str, Any]:
    where = path()
    if where is None or not where.exists():
        return {}
    try:
        entries = json.loads(where.read_text())
        if not isinstance(entries, dict):
            raise ValueError(f"a {type(entries).__name__}, not a mapping")
        return entries
    except (OSError, ValueError) as error:
        if str(where) not in _WARNED:
            _WARNED.add(str(where))
            rank_zero_warn(f"MemOpt: {where} could not be read ({error}); the plans are made anew and it is replaced.")
        return {}
