"""Every diffusers ModelMixin class that supports gradient checkpointing, built small from its own defaults on the
meta device (no memory): MemOpt's checkpointing and chunking are applied and undone without a crash and without
leaving state behind, or the model is skipped with one warning naming it.

This applies and undoes the techniques; it runs no forward pass (that needs inputs of each model's own shape): the
test models elsewhere, and tests/test_peer_models.py, run steps with ``verify=True``.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch import nn

from lightning_memopt.adapters import find_models
from lightning_memopt.engine.changes import Changes
from lightning_memopt.engine.config import MemOptConfig
from tests.helpers import fingerprint

pytestmark = pytest.mark.slow  # about a hundred model classes; run by CI with `python -m pytest -m slow`

#: Sizes that keep any model small: depth and heads.
SMALL = {
    "num_layers": 1,
    "num_single_layers": 1,
    "layers_per_block": 1,
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "num_heads": 2,
    "head_dim": 8,
    "num_res_blocks": 1,
    "transformer_layers_per_block": 1,
}


def _small(name: str, value: object) -> object:
    """A default argument shrunk: depths to 1 or 2, widths and channels to at most 32."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        if name in SMALL:
            return SMALL[name]
        if "channel" in name or "dim" in name or (name.endswith("_size") and not name.startswith(("patch", "sample"))):
            return min(value, 32)
        if "layers" in name or (name.startswith("num_") and "head" not in name):
            return min(value, 2)
    if isinstance(value, (tuple, list)) and value and all(type(v) is int for v in value):
        if "channels" in name or "block_out" in name:
            return type(value)(min(v, 32) for v in value)
    return value


def _classes() -> list[type]:
    import diffusers

    found = {id(c): c for n in dir(diffusers) if isinstance(c := getattr(diffusers, n, None), type)}
    return sorted((c for c in found.values() if issubclass(c, diffusers.ModelMixin)), key=lambda c: c.__name__)


CLASSES = [c for c in _classes() if getattr(c, "_supports_gradient_checkpointing", False)]


def _build(cls: type) -> nn.Module | None:
    parameters = inspect.signature(cls.__init__).parameters.items()
    kwargs = {
        k: _small(k, p.default) for k, p in parameters if k != "self" and p.default is not inspect.Parameter.empty
    }
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return cls(**kwargs)
    except Exception:
        return None


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_checkpointing_and_chunking_apply_and_undo_cleanly(cls: type) -> None:
    model = _build(cls)
    if model is None:
        pytest.skip(f"{cls.__name__} cannot be built from its shrunk defaults")
    root = nn.Module()
    root.model = model
    before = fingerprint(model)
    for stage, technique in (("fit", "checkpointing"), ("predict", "chunking")):
        skipped: list[str] = []
        changes = Changes(stage, find_models(root), MemOptConfig(chunk_size=2), skipped.append)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            changes.apply()
        named = [str(w.message) for w in caught if "MemOpt" in str(w.message)]
        assert all(cls.__name__ in message for message in skipped + named), (skipped, named)
        if technique == "checkpointing" and not skipped:
            assert changes.applied and changes.applied[0].blocks > 0
        changes.remove()
        assert fingerprint(model) == before, technique
