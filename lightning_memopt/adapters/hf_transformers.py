"""transformers models: ``activation_checkpointing_enable`` and each layer's ``chunk_size_feed_forward``."""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from lightning_memopt.adapters.base import Change, checkpointing_on, combine, kept, native_switches, stack_blocks
from lightning_memopt.adapters.torch_generic import TorchAdapter, chunk_feed_forward_modules, find_feed_forward
from lightning_memopt.techniques.checkpointing import CHECKPOINT_FUNCTION, CheckpointConfig, MemOptCheckpoint
from lightning_memopt.techniques.chunking import ChunkConfig, ChunkUnit, apply_divisor_chunking
from lightning_memopt.techniques.handles import AttributeSnapshot, HandleGroup

#: Attributes the checkpointing switch sets on modules, including the input-embedding hooks it registers.
CHECKPOINT_ATTRIBUTES = (
    "gradient_checkpointing",
    "_gradient_checkpointing_func",
    "_require_grads_hooks",
    "_require_grads_hook",
)


def _seq_lengths(layer: nn.Module) -> Any:
    dim = getattr(layer, "seq_len_dim", 1)
    return lambda args, kwargs: {dim: (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).shape[dim]}


def _write(layer: nn.Module, dim: int, size: int | None) -> None:
    layer.__dict__["chunk_size_feed_forward"] = size or 0


class TransformersAdapter:
    """Any ``transformers.PreTrainedModel``."""

    name = "transformers"

    def claims(self, module: nn.Module) -> bool:
        transformers = sys.modules.get("transformers")
        return transformers is not None and isinstance(module, transformers.PreTrainedModel)

    def checkpoint(self, model: nn.Module, config: CheckpointConfig, skip: list[nn.Module]) -> Change | None:
        if config.block_classes or not getattr(model, "supports_gradient_checkpointing", False):
            return TorchAdapter().checkpoint(model, config, skip)
        if checkpointing_on(model):
            return kept(model, inert=(sys.modules["transformers"].PreTrainedModel,))
        snapshot = AttributeSnapshot(model.modules(), CHECKPOINT_ATTRIBUTES)
        before = list(model.__dict__.get("_require_grads_hooks", []))
        try:
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
                method = "activation_checkpointing_enable()"
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]
                method = "gradient_checkpointing_enable()"
            # The switch hooks the input embeddings so that reentrant checkpointing gets inputs that require grad.
            # MemOpt's checkpoint is non-reentrant and needs none; a local function in a hook would also keep a
            # copy of the model (an EMA copy) from being pickled.
            for hook in model.__dict__.get("_require_grads_hooks", []):
                if all(hook is not b for b in before):
                    hook.remove()
            ours = MemOptCheckpoint()
            for module in model.modules():  # the same non-reentrant checkpoint, and buffers changed once
                if CHECKPOINT_FUNCTION in module.__dict__:
                    module.__dict__[CHECKPOINT_FUNCTION] = ours
            switches = native_switches(model, inert=(sys.modules["transformers"].PreTrainedModel,))
            return Change(method, len(switches) or stack_blocks(model), snapshot, switches=switches)
        except BaseException:
            snapshot.remove()  # nothing half-applied stays behind
            raise

    def chunk(self, model: nn.Module, config: ChunkConfig, skip: list[nn.Module]) -> Change | None:
        native = [m for m in model.modules() if isinstance(m.__dict__.get("chunk_size_feed_forward"), int)]
        generic = chunk_feed_forward_modules(model, find_feed_forward(model, skip + native), config)
        if not native:
            return generic
        names = {id(m): n for n, m in model.named_modules()}
        group = HandleGroup([AttributeSnapshot(native, ("chunk_size_feed_forward",))])
        units = []
        for layer in native:
            dims = (getattr(layer, "seq_len_dim", 1),)
            unit = ChunkUnit(names[id(layer)], dims, config.dim, config.chunk_size, layer)
            group.add(apply_divisor_chunking(layer, unit, _seq_lengths(layer), _write))
            units.append(unit)
        return combine("chunk_size_feed_forward", units, group, generic)
