"""PEFT: a ``PeftModel`` is unwrapped and its base model is handled by that model's own adapter.

LoRA layers live inside the base model's blocks, so checkpointing those blocks (non-reentrant) keeps the adapter
weights' gradients, and chunking a feed-forward layer chunks its LoRA branch with it.
"""

from __future__ import annotations

import sys

from torch import nn


def unwrap(module: nn.Module) -> nn.Module | None:
    """The base model inside a PEFT wrapper, or ``None`` when ``module`` is not one.

    peft is looked up only if it is already imported: a model cannot be a ``PeftModel`` otherwise.
    """
    peft = sys.modules.get("peft")
    if peft is None or not isinstance(module, peft.PeftModel):
        return None
    return module.get_base_model()


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """PEFT's LoRA linear layers in ``model``, by name (none where peft's LoRA is not imported: a model cannot hold one
    then)."""
    lora = sys.modules.get("peft.tuners.lora")
    layer = getattr(lora, "Linear", None)
    return [(name, m) for name, m in model.named_modules() if isinstance(m, layer)] if layer is not None else []
