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


#: Causal language models (``config.model_type``) whose ``forward`` passes its output layer's result straight to the
#: loss function (``loss_function(logits=..., labels=..., vocab_size=...)``): their loss can be computed from the
#: hidden states. Gemma 2 and 3 also soft-cap the logits in between (``final_logit_softcapping``); they are taken
#: only with it off.
CAUSAL_LM_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "gpt_neox"}
)
#: The name of transformers' default causal language-model loss function.
CAUSAL_LM_LOSS = "ForCausalLMLoss"


def causal_lms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The transformers causal language models in ``model`` (itself included), by name: ``PreTrainedModel``s whose
    class name ends with ``ForCausalLM``."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if type(m).__name__.endswith("ForCausalLM") and any(c.__name__ == "PreTrainedModel" for c in type(m).__mro__)
    ]


def loss_refusal(lm: nn.Module) -> str | None:
    """Why the loss of causal language model ``lm`` cannot be computed from its hidden states (``None``: it can)."""
    config = getattr(lm, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in CAUSAL_LM_TYPES:
        known = ", ".join(sorted(CAUSAL_LM_TYPES))
        return f"model type {kind!r} is not among those whose loss MemOpt computes ({known})"
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        return f"its logits are soft-capped (`final_logit_softcapping={cap}`)"
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        kind = type(head)
        return f"its output layer is a {kind.__module__}.{kind.__qualname__}, not a torch.nn.Linear"
    own = lm.__dict__.get("_loss_function") or getattr(lm, "loss_function", None)
    if getattr(own, "__name__", None) != CAUSAL_LM_LOSS:
        return f"it computes its loss with {getattr(own, '__name__', own)!r}, not transformers' {CAUSAL_LM_LOSS}"
    return None
