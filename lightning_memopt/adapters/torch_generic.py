"""Plain torch models: checkpoint repeated block stacks, chunk token-wise feed-forward modules found by class name."""

from __future__ import annotations

from torch import nn

from lightning_memopt.adapters.base import Change
from lightning_memopt.handles import HandleGroup
from lightning_memopt.techniques.checkpointing import (
    CheckpointConfig,
    CheckpointUnit,
    apply_checkpointing,
    find_block_stacks,
    find_blocks_by_class,
    find_outermost,
)
from lightning_memopt.techniques.chunking import ChunkConfig, ChunkUnit, apply_feed_forward_chunking

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


def _names(blocks: list[nn.Module]) -> str:
    return ", ".join(sorted({type(b).__name__ for b in blocks}))


class TorchAdapter:
    """The fallback for any ``nn.Module``: generic checkpointing and chunking."""

    name = "torch"

    def claims(self, module: nn.Module) -> bool:
        return True

    def checkpoint(self, model: nn.Module, config: CheckpointConfig, skip: list[nn.Module]) -> Change | None:
        if config.block_classes:
            blocks = find_blocks_by_class(model, config.block_classes, skip)
        else:
            blocks = find_block_stacks(model, skip)
        if not blocks:
            return None
        names = {id(m): n for n, m in model.named_modules()}
        switches = [CheckpointUnit(names[id(b)], b, native=False) for b in blocks]
        handle = apply_checkpointing(blocks, config, switches)
        return Change(f"generic checkpoint of {_names(blocks)}", len(blocks), handle, switches=switches)

    def chunk(self, model: nn.Module, config: ChunkConfig, skip: list[nn.Module]) -> Change | None:
        return chunk_feed_forward_modules(model, find_feed_forward(model, skip), config)


def chunk_feed_forward_modules(model: nn.Module, modules: list[nn.Module], config: ChunkConfig) -> Change | None:
    """Generic chunking of the given token-wise modules of ``model``, as one :class:`Change`."""
    if not modules:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    units = [ChunkUnit(names[id(m)], (0, 1), config.dim, config.chunk_size, m) for m in modules]
    handle = HandleGroup(apply_feed_forward_chunking(m, u) for m, u in zip(modules, units, strict=True))
    return Change(f"generic chunking of {_names(modules)}", len(modules), handle, units)
