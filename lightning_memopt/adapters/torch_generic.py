"""Plain torch models: any ``nn.Module`` is claimed; token-wise feed-forward modules are found by class name."""

from __future__ import annotations

from torch import nn

from lightning_memopt.adapters.base import find_outermost

#: How the class names of token-wise feed-forward modules end, in diffusers (``FeedForward``, ``AuraFlowFeedForward``,
#: ``Flux2FeedForward``), transformers (``LlamaMLP``, ``GPT2MLP``, T5's ``T5LayerFF``, the MoE blocks of Mixtral,
#: Qwen2-MoE and OLMoE) and timm-style models (``Mlp``). The outermost such module of a block is chunked when the block
#: has no chunking switch of its own. Families whose feed-forward is inline in the layer (OPT, BART, Whisper: ``fc1``
#: and ``fc2`` called from the layer's own ``forward``) have no such module and are not chunked.
FEED_FORWARD_SUFFIXES: tuple[str, ...] = ("FeedForward", "MLP", "Mlp", "FFN", "LayerFF", "MoeBlock")
#: Families (class name prefixes) whose feed-forward output for a position depends on the others, so that slices
#: would change results: mixtures of experts with an expert capacity, which drop the tokens over it.
NOT_POSITION_WISE: tuple[str, ...] = ("SwitchTransformers", "NllbMoe", "GPTSanJapanese")


def is_feed_forward(module: nn.Module) -> bool:
    """Whether ``module`` is a token-wise feed-forward module, by its class name.

    Examples:
        >>> from torch import nn
        >>> class LlamaMLP(nn.Module): ...
        >>> is_feed_forward(LlamaMLP()), is_feed_forward(nn.Linear(2, 2))
        (True, False)
    """
    name = type(module).__name__
    return name.endswith(FEED_FORWARD_SUFFIXES) and not name.startswith(NOT_POSITION_WISE)


def find_feed_forward(root: nn.Module, skip: list[nn.Module]) -> list[nn.Module]:
    """The outermost token-wise feed-forward modules under ``root`` (not ``root`` itself: a whole model is not sliced),
    outside the subtrees in ``skip``."""
    return find_outermost(root, lambda m: m is not root and is_feed_forward(m), skip)


def is_token_norm(module: nn.Module) -> bool:
    """Whether ``module`` normalizes each token alone over its last dimension: a ``LayerNorm`` or ``RMSNorm`` of one
    dimension, or a library's ``*RMSNorm`` (``LlamaRMSNorm``) without submodules and with at most a vector of weights.

    Examples:
        >>> from torch import nn
        >>> is_token_norm(nn.LayerNorm(8)), is_token_norm(nn.LayerNorm((4, 8))), is_token_norm(nn.GroupNorm(2, 8))
        (True, False, False)
    """
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return len(module.normalized_shape) == 1
    plain = not list(module.children()) and all(p.dim() == 1 for p in module.parameters(recurse=False))
    return type(module).__name__.endswith("RMSNorm") and plain


def find_token_norms(block: nn.Module, skip: list[nn.Module]) -> list[nn.Module]:
    """The token-wise norms that are ``block``'s own children (a decoder layer's ``input_layernorm`` and
    ``post_attention_layernorm``), outside ``skip``."""
    return [m for m in block.children() if is_token_norm(m) and not any(m is s for s in skip)]


class TorchAdapter:
    """The fallback for any ``nn.Module``: the techniques' generic code."""

    name = "torch"

    def claims(self, module: nn.Module) -> bool:
        return True
