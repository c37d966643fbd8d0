"""transformers models: any ``PreTrainedModel``; its checkpointing switch is ``activation_checkpointing_enable`` and
a layer's feed-forward chunking its ``chunk_size_feed_forward`` attribute."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_memopt.adapters.base import LengthsFn, LibraryAdapter

#: Attributes the checkpointing switch sets on modules, including the input-embedding hooks it registers.
CHECKPOINT_ATTRIBUTES = (
    "gradient_checkpointing",
    "_gradient_checkpointing_func",
    "_require_grads_hooks",
    "_require_grads_hook",
)
#: The layer attribute that chunks its feed-forward.
CHUNK_ATTRIBUTE = "chunk_size_feed_forward"


class TransformersAdapter(LibraryAdapter):
    """Any ``transformers.PreTrainedModel``."""

    name, model_class, supports = "transformers", "PreTrainedModel", "supports_gradient_checkpointing"


def chunking_layers(model: nn.Module) -> list[nn.Module]:
    """The layers whose feed-forward chunking is their ``chunk_size_feed_forward`` attribute (the older encoders)."""
    return [m for m in model.modules() if isinstance(m.__dict__.get(CHUNK_ATTRIBUTE), int)]


def sequence_dim(layer: nn.Module) -> int:
    """The dim a layer chunks: its ``seq_len_dim``."""
    return getattr(layer, "seq_len_dim", 1)


def sequence_lengths(layer: nn.Module) -> LengthsFn:
    """Reads a layer's sequence length from its ``hidden_states``."""
    dim = sequence_dim(layer)

    def lengths(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int, int]:
        return {dim: (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).shape[dim]}

    return lengths
