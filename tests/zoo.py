"""The zoo: every tiny model the tests and the benchmarks build, from configs, never downloaded.

Each builder takes keyword overrides of its config, so the benchmark workloads (``benchmarks/workloads.py``) size the
same models per suite, and ``benchmarks/coverage.py`` builds its cases with :func:`build`. The benchmarks run as
modules from the repository root (``python -m benchmarks.run``), so ``tests`` imports as a package there; the examples
stay self-contained, to be read and copied.
"""

from __future__ import annotations

import string
from typing import Any

from torch import nn


def build(cls: str, init: dict[str, Any], config: str | None = None) -> nn.Module:
    """A diffusers model class built from its init arguments or, with ``config``, a transformers model class from
    that config class built from ``init``: the classes named as strings, as in the coverage cases."""
    if config is None:
        import diffusers

        return getattr(diffusers, cls)(**init)
    import transformers

    return getattr(transformers, cls)(getattr(transformers, config)(**init))


# diffusers ---------------------------------------------------------------------------------------------------------


def unet2d(**config: Any) -> nn.Module:
    """A UNet2DModel with attention in its inner levels; the levels follow ``block_out_channels``."""
    channels = config.get("block_out_channels", (16, 32))
    inner = len(channels) - 1
    defaults = dict(
        sample_size=16,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=channels,
        down_block_types=("DownBlock2D",) + ("AttnDownBlock2D",) * inner,
        up_block_types=("AttnUpBlock2D",) * inner + ("UpBlock2D",),
        norm_num_groups=8,
        attention_head_dim=8,
    )
    return build("UNet2DModel", {**defaults, **config})


def unet2d_condition(**config: Any) -> nn.Module:
    defaults = dict(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=8,
        norm_num_groups=8,
    )
    return build("UNet2DConditionModel", {**defaults, **config})


def dit(**config: Any) -> nn.Module:
    defaults = dict(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        sample_size=16,
        patch_size=2,
        num_embeds_ada_norm=10,
    )
    return build("DiTTransformer2DModel", {**defaults, **config})


def sd3(**config: Any) -> nn.Module:
    defaults = dict(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        pooled_projection_dim=8,
        out_channels=4,
        pos_embed_max_size=16,
    )
    return build("SD3Transformer2DModel", {**defaults, **config})


def latte(**config: Any) -> nn.Module:
    defaults = dict(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,
        num_layers=2,
        sample_size=8,
        patch_size=2,
        cross_attention_dim=16,
        caption_channels=16,
        norm_type="ada_norm_single",
        video_length=3,
    )
    return build("LatteTransformer3DModel", {**defaults, **config})


def svd_unet(**config: Any) -> nn.Module:
    defaults = dict(
        sample_size=8,
        in_channels=8,
        out_channels=4,
        down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
        block_out_channels=(32, 64),
        addition_time_embed_dim=4,
        projection_class_embeddings_input_dim=12,
        layers_per_block=1,
        cross_attention_dim=16,
        num_attention_heads=(2, 4),
        num_frames=3,
    )
    return build("UNetSpatioTemporalConditionModel", {**defaults, **config})


def flux(**config: Any) -> nn.Module:
    defaults = dict(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        pooled_projection_dim=8,
        axes_dims_rope=(2, 2, 4),
    )
    return build("FluxTransformer2DModel", {**defaults, **config})


def wan(**config: Any) -> nn.Module:
    defaults = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=128,
        num_layers=2,
        rope_max_seq_len=32,
    )
    return build("WanTransformer3DModel", {**defaults, **config})


def vae(**config: Any) -> nn.Module:
    """An SD-style AutoencoderKL, by default 2 levels: 4 latent channels, x2 upsampling; tiles from 16x16 latents on.
    The levels follow ``block_out_channels``."""
    channels = config.get("block_out_channels", (8, 16))
    defaults = dict(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=channels,
        down_block_types=("DownEncoderBlock2D",) * len(channels),
        up_block_types=("UpDecoderBlock2D",) * len(channels),
        layers_per_block=1,
        norm_num_groups=4,
        sample_size=32,
    )
    return build("AutoencoderKL", {**defaults, **config})


def sampler_vae() -> nn.Module:
    """An SD-style AutoencoderKL with 3 levels (x4 upsampling), so that its decode holds a sampler's peak, as it does
    at real scale."""
    return vae(block_out_channels=(16, 32, 32), norm_num_groups=8)


def motion_adapter(**config: Any) -> nn.Module:
    """An AnimateDiff MotionAdapter for :func:`unet2d_condition`."""
    defaults = dict(
        block_out_channels=(16, 32),
        motion_layers_per_block=1,
        motion_num_attention_heads=2,
        motion_norm_num_groups=8,
        motion_max_seq_length=8,
    )
    return build("MotionAdapter", {**defaults, **config})


# the configs of diffusers' own model tests (tests/models/transformers/test_models_*.py)


def sd3_as_tested() -> nn.Module:
    """diffusers' tests/models/transformers/test_models_transformer_sd3.py."""
    return sd3(
        sample_size=32,
        patch_size=1,
        num_layers=4,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=32,
        pooled_projection_dim=64,
        pos_embed_max_size=96,
        dual_attention_layers=(),
        qk_norm=None,
    )


def latte_as_tested() -> nn.Module:
    """diffusers' tests/models/transformers/test_models_transformer_latte.py."""
    return latte(
        attention_head_dim=4,
        caption_channels=8,
        cross_attention_dim=8,
        attention_bias=True,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000,
        norm_elementwise_affine=False,
        norm_eps=1e-6,
    )


def dit_as_tested() -> nn.Module:
    """diffusers' tests/models/transformers/test_models_dit_transformer2d.py."""
    return dit(
        out_channels=8,
        activation_fn="gelu-approximate",
        attention_head_dim=4,
        attention_bias=True,
        num_layers=1,
        norm_type="ada_norm_zero",
        num_embeds_ada_norm=8,
        sample_size=8,
    )


# transformers ------------------------------------------------------------------------------------------------------


def llama(layers: int = 2, hidden: int = 32, **config: Any) -> nn.Module:
    defaults = dict(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return build("LlamaForCausalLM", {**defaults, **config}, "LlamaConfig")


#: Causal language models of every family whose loss MemOpt computes in chunks, by name: (model class, config
#: class, config) for one layer of width 32 and a vocabulary of 512 (16x the width).
CAUSAL_LMS: dict[str, tuple[str, str, dict[str, Any]]] = {
    name: (cls, config, {"vocab_size": 512, **sizes, **extra})
    for sizes in [dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)]
    for name, cls, config, extra in [
        ("llama", "LlamaForCausalLM", "LlamaConfig", {"num_key_value_heads": 2}),
        ("llama_tied", "LlamaForCausalLM", "LlamaConfig", {"tie_word_embeddings": True}),
        ("mistral", "MistralForCausalLM", "MistralConfig", {"num_key_value_heads": 1}),
        ("qwen2", "Qwen2ForCausalLM", "Qwen2Config", {"num_key_value_heads": 2}),
        ("qwen3", "Qwen3ForCausalLM", "Qwen3Config", {"num_key_value_heads": 2, "head_dim": 16}),
        ("gemma", "GemmaForCausalLM", "GemmaConfig", {"num_key_value_heads": 1, "head_dim": 16}),
        ("gemma2", "Gemma2ForCausalLM", "Gemma2Config", {"num_key_value_heads": 1, "head_dim": 16}),
        (
            "gemma2_uncapped",
            "Gemma2ForCausalLM",
            "Gemma2Config",
            {"num_key_value_heads": 1, "head_dim": 16, "final_logit_softcapping": None},
        ),
        ("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", {"num_key_value_heads": 1, "head_dim": 16}),
        ("phi", "PhiForCausalLM", "PhiConfig", {}),
        ("phi3", "Phi3ForCausalLM", "Phi3Config", {"num_key_value_heads": 2, "pad_token_id": 0}),
        ("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", {}),
    ]
}


def causal_lm(name: str, **config: Any) -> nn.Module:
    """One of :data:`CAUSAL_LMS`, with config overrides."""
    cls, config_cls, defaults = CAUSAL_LMS[name]
    return build(cls, {**defaults, **config}, config_cls)


def lora_llama() -> nn.Module:
    """A PEFT LoRA Llama (queries and values), as a fine-tune builds it."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(llama(intermediate_size=64), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def bert(**config: Any) -> nn.Module:
    defaults = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return build("BertForMaskedLM", {**defaults, **config}, "BertConfig")


def gpt2(**config: Any) -> nn.Module:
    defaults = dict(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    return build("GPT2LMHeadModel", {**defaults, **config}, "GPT2Config")


def bloom(**config: Any) -> nn.Module:
    return build(
        "BloomForCausalLM", {**dict(vocab_size=128, hidden_size=32, n_layer=2, n_head=2), **config}, "BloomConfig"
    )


def t5(**config: Any) -> nn.Module:
    defaults = dict(vocab_size=128, d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=8, dropout_rate=0.0)
    return build("T5ForConditionalGeneration", {**defaults, **config}, "T5Config")


def mixtral(**config: Any) -> nn.Module:
    defaults = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=4,
    )
    return build("MixtralForCausalLM", {**defaults, **config}, "MixtralConfig")


def qwen2_moe(**config: Any) -> nn.Module:
    defaults = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    return build("Qwen2MoeForCausalLM", {**defaults, **config}, "Qwen2MoeConfig")


# text encoders and their tokenizers, built in memory


def clip_text_encoder(hidden: int = 16) -> nn.Module:
    config = dict(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    return build("CLIPTextModel", config, "CLIPTextConfig")


def clip_tokenizer() -> Any:
    """A CLIP BPE tokenizer over single letters (no merges): enough to turn prompts into ids, nothing downloaded."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in string.ascii_lowercase:
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=16)


def t5_encoder(d_model: int = 16) -> nn.Module:
    config = dict(vocab_size=32, d_model=d_model, d_ff=32, num_layers=1, num_heads=2, d_kv=8, dropout_rate=0.0)
    return build("T5EncoderModel", config, "T5Config")


def t5_tokenizer() -> Any:
    """A T5 unigram tokenizer over single letters and the word boundary."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    return T5Tokenizer(vocab=pieces + [(c, -1.0) for c in string.ascii_lowercase], extra_ids=0)


# torch -------------------------------------------------------------------------------------------------------------


def torch_encoder(layers: int = 3) -> nn.Module:
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=2, dim_feedforward=128, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
