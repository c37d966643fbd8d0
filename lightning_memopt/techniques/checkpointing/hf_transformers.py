"""transformers models: ``activation_checkpointing_enable``, non-reentrant, with MemOpt's checkpoint function."""

from __future__ import annotations

import functools
import sys

from torch import nn

from lightning_memopt.adapters.hf_transformers import CHECKPOINT_ATTRIBUTES
from lightning_memopt.techniques.base import Change
from lightning_memopt.techniques.checkpointing.core import CHECKPOINT_FUNCTION, MemOptCheckpoint
from lightning_memopt.techniques.checkpointing.library import library_checkpoint


def checkpoint(model: nn.Module) -> Change:
    """The library's switch on ``model`` (a ``PreTrainedModel``)."""
    inert = (sys.modules["transformers"].PreTrainedModel,)
    return library_checkpoint(model, CHECKPOINT_ATTRIBUTES, functools.partial(_switch_on, model), inert)


def _switch_on(model: nn.Module) -> tuple[str, list[str]]:
    """transformers' switch, non-reentrant, with MemOpt's checkpoint function and without its input hooks."""
    before = list(model.__dict__.get("_require_grads_hooks", []))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    # The switch hooks the input embeddings so that reentrant checkpointing gets inputs that require grad. MemOpt's
    # checkpoint is non-reentrant and needs none; a local function in a hook would also keep a copy of the model (an
    # EMA copy) from being pickled.
    for hook in model.__dict__.get("_require_grads_hooks", []):
        if all(hook is not b for b in before):
            hook.remove()
    ours = MemOptCheckpoint()
    for module in model.modules():  # the same non-reentrant checkpoint, and buffers changed once
        if CHECKPOINT_FUNCTION in module.__dict__:
            module.__dict__[CHECKPOINT_FUNCTION] = ours
    return "activation_checkpointing_enable()", []
