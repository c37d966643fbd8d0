"""diffusers models: ``enable_gradient_checkpointing`` with MemOpt's checkpoint function, off again on the blocks whose
checkpointed path is wrong (:data:`~lightning_memopt.adapters.hf_diffusers.BROKEN_CHECKPOINTING`)."""

from __future__ import annotations

import functools
import inspect

from torch import nn

from lightning_memopt.adapters.hf_diffusers import BROKEN_CHECKPOINTING, CHECKPOINT_ATTRIBUTES
from lightning_memopt.techniques.base import Change
from lightning_memopt.techniques.checkpointing.core import MemOptCheckpoint
from lightning_memopt.techniques.checkpointing.library import library_checkpoint


def checkpoint(model: nn.Module) -> Change:
    """The library's switch on ``model`` (a ``ModelMixin``); blocks that hold no other flagged block can also be
    checkpointed whole."""
    return library_checkpoint(model, CHECKPOINT_ATTRIBUTES, functools.partial(_switch_on, model), whole=True)


def _switch_on(model: nn.Module) -> tuple[str, list[str]]:
    """diffusers' switch with MemOpt's checkpoint function, and off again on blocks whose checkpointed path is wrong."""
    enable = model.enable_gradient_checkpointing  # type: ignore[operator]
    if "gradient_checkpointing_func" in inspect.signature(enable).parameters:
        enable(gradient_checkpointing_func=MemOptCheckpoint())
    else:  # older diffusers: its own local function
        enable()
    skipped = []
    for name, module in model.named_modules():
        reason = BROKEN_CHECKPOINTING.get(type(module).__name__)
        if reason is not None and module.__dict__.get("gradient_checkpointing"):
            module.__dict__["gradient_checkpointing"] = False
            skipped.append(f"`{name}` ({type(module).__name__}) is not checkpointed: {reason}")
    return "enable_gradient_checkpointing()", skipped
