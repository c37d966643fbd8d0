"""transformers models: ``activation_checkpointing_enable`` and each layer's ``chunk_size_feed_forward``."""

from __future__ import annotations

import functools
import sys
from typing import Any

from torch import nn

from lightning_memopt.adapters.base import Change, LibraryAdapter, library_checkpoint, library_chunk
from lightning_memopt.adapters.torch_generic import chunk_feed_forward_modules, find_feed_forward
from lightning_memopt.techniques.checkpointing import CHECKPOINT_FUNCTION, MemOptCheckpoint
from lightning_memopt.techniques.chunking import ChunkConfig, ChunkUnit, apply_divisor_chunking

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


class TransformersAdapter(LibraryAdapter):
    """Any ``transformers.PreTrainedModel``."""

    name, model_class, supports = "transformers", "PreTrainedModel", "supports_gradient_checkpointing"

    def switch_checkpointing(self, model: nn.Module) -> Change:
        inert = (sys.modules["transformers"].PreTrainedModel,)
        return library_checkpoint(model, CHECKPOINT_ATTRIBUTES, functools.partial(_switch_on, model), inert)

    def chunk(self, model: nn.Module, config: ChunkConfig, skip: list[nn.Module]) -> Change | None:
        native = [m for m in model.modules() if isinstance(m.__dict__.get("chunk_size_feed_forward"), int)]
        generic = chunk_feed_forward_modules(model, find_feed_forward(model, skip + native), config)
        unit_of = functools.partial(_chunk_unit, config)
        return library_chunk(model, native, ("chunk_size_feed_forward",), "chunk_size_feed_forward", unit_of, generic)


def _chunk_unit(config: ChunkConfig, name: str, layer: nn.Module) -> tuple[ChunkUnit, Any]:
    """A layer's unit on its ``chunk_size_feed_forward`` attribute."""
    unit = ChunkUnit(name, (getattr(layer, "seq_len_dim", 1),), config.dim, config.chunk_size, layer)
    return unit, apply_divisor_chunking(layer, unit, _seq_lengths(layer), _write)


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
