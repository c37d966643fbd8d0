"""Dry-run coverage on diffusers' and transformers' own test configs (issue 15): for how many model classes does
``lightning_memopt.estimate`` know the baseline (the peak of the step as the model is), and how close is it to the
real step's peak?

Each case is a model class built small and real on CPU from the init arguments and inputs of its own library's test
suite (diffusers' ``get_init_dict`` / ``get_dummy_inputs`` or ``prepare_init_args_and_inputs_for_common``, read from
the diffusers repository at commit 58eb52c0 and written down here as plain data; transformers' MoE and dense causal
LMs with configs of the size of their model testers). Each is wrapped in a minimal LightningModule whose
``training_step`` returns ``output.pow(2).mean()`` (AdamW) and whose ``predict_step`` returns the output. For each
stage the script calls ``estimate(module, batch, stage)`` and then runs the real step in a Trainer under
``PeakMemory`` (the second training batch at fit, so that the first step's gradients and optimizer state are alive,
as the estimate assumes; the first predict batch), and compares the two byte counts.

    python benchmarks/coverage.py --out benchmarks/results/coverage.md  # 2 workers: about 9 CPU-minutes

Nothing is downloaded. ``--only NAME ...`` runs the cases whose label contains one of the names.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import multiprocessing
import re
import sys
import time
import traceback
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_memopt import PeakMemory, estimate
from lightning_memopt.reads import PLACEHOLDERS

# inputs, as plain data ---------------------------------------------------------------------------------------------


class R:
    """A tensor of random normal values of this shape."""

    def __init__(self, *shape: int, dtype: str = "float32") -> None:
        self.shape, self.dtype = shape, getattr(torch, dtype)

    def make(self, gen: torch.Generator) -> torch.Tensor:
        return torch.randn(self.shape, generator=gen, dtype=self.dtype)


class I:  # noqa: E742
    """A tensor of random integers in ``[low, high)``."""

    def __init__(self, low: int, high: int, *shape: int, dtype: str = "int64") -> None:
        self.low, self.high, self.shape, self.dtype = low, high, shape, getattr(torch, dtype)

    def make(self, gen: torch.Generator) -> torch.Tensor:
        return torch.randint(self.low, self.high, self.shape, generator=gen).to(self.dtype)


class F:
    """A tensor of this shape filled with one value."""

    def __init__(self, value: Any, *shape: int, dtype: str = "float32") -> None:
        self.value, self.shape, self.dtype = value, shape, getattr(torch, dtype)

    def make(self, gen: torch.Generator) -> torch.Tensor:
        return torch.full(self.shape, self.value, dtype=self.dtype)


class V:
    """A tensor of these values."""

    def __init__(self, values: Any, dtype: str = "float32") -> None:
        self.values, self.dtype = values, getattr(torch, dtype)

    def make(self, gen: torch.Generator) -> torch.Tensor:
        return torch.tensor(self.values, dtype=self.dtype)


class KVCache:
    """WanAnimate2's KV cache, empty, for its reference (``extract``) pass."""

    def __init__(self, layers: int) -> None:
        self.layers = layers

    def make(self, gen: torch.Generator) -> Any:
        from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

        return WanAnimate2KVCache(self.layers)


def make(spec: Any, gen: torch.Generator) -> Any:
    """The inputs ``spec`` describes, built in order from ``gen``."""
    if hasattr(spec, "make"):
        return spec.make(gen)
    if isinstance(spec, dict):
        return {k: make(v, gen) for k, v in spec.items()}
    if isinstance(spec, (list, tuple)):
        return type(spec)(make(v, gen) for v in spec)
    return spec


@dataclass
class Case:
    """One model class built from a test config: its label, the class, where the config comes from, the init
    arguments (for transformers: the config's), and the inputs of one call."""

    label: str
    cls: str
    source: str
    init: dict[str, Any]
    inputs: dict[str, Any]
    config: str | None = None  # transformers: the config class


# diffusers: the model tests' own init dicts and dummy inputs (tests/models/{transformers,unets}/test_models_*.py) --

DIFFUSERS = [
    Case(
        "DiTTransformer2DModel",
        "DiTTransformer2DModel",
        "test_models_dit_transformer2d",
        {
            "in_channels": 4,
            "out_channels": 8,
            "activation_fn": "gelu-approximate",
            "num_attention_heads": 2,
            "attention_head_dim": 4,
            "attention_bias": True,
            "num_layers": 1,
            "norm_type": "ada_norm_zero",
            "num_embeds_ada_norm": 8,
            "patch_size": 2,
            "sample_size": 8,
        },
        {
            "hidden_states": R(4, 4, 8, 8),
            "timestep": V([44, 239, 933, 760], dtype="int64"),
            "class_labels": V([0, 3, 1, 0], dtype="int64"),
        },
    ),
    Case(
        "PixArtTransformer2DModel",
        "PixArtTransformer2DModel",
        "test_models_pixart_transformer2d",
        {
            "sample_size": 8,
            "num_layers": 1,
            "patch_size": 2,
            "attention_head_dim": 2,
            "num_attention_heads": 2,
            "in_channels": 4,
            "cross_attention_dim": 8,
            "out_channels": 8,
            "attention_bias": True,
            "activation_fn": "gelu-approximate",
            "num_embeds_ada_norm": 8,
            "norm_type": "ada_norm_single",
            "norm_elementwise_affine": False,
            "norm_eps": 1e-06,
            "use_additional_conditions": False,
            "caption_channels": None,
        },
        {
            "hidden_states": R(4, 4, 8, 8),
            "timestep": V([44, 239, 933, 760], dtype="int64"),
            "encoder_hidden_states": R(4, 8, 8),
            "added_cond_kwargs": {"aspect_ratio": None, "resolution": None},
        },
    ),
    Case(
        "PriorTransformer",
        "PriorTransformer",
        "test_models_prior",
        {
            "num_attention_heads": 2,
            "attention_head_dim": 4,
            "num_layers": 2,
            "embedding_dim": 8,
            "num_embeddings": 7,
            "additional_embeddings": 4,
        },
        {"hidden_states": R(4, 8), "timestep": 2, "proj_embedding": R(4, 8), "encoder_hidden_states": R(4, 7, 8)},
    ),
    Case(
        "AceStepTransformer1DModel",
        "AceStepTransformer1DModel",
        "test_models_transformer_ace_step",
        {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "in_channels": 24,
            "audio_acoustic_hidden_dim": 8,
            "patch_size": 2,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-06,
            "sliding_window": 16,
        },
        {
            "hidden_states": R(2, 8, 8),
            "timestep": V([1.541, 0.2934], dtype="float32"),
            "timestep_r": V([1.541, 0.2934], dtype="float32"),
            "encoder_hidden_states": R(2, 10, 32),
            "context_latents": R(2, 8, 16),
        },
    ),
    Case(
        "AllegroTransformer3DModel",
        "AllegroTransformer3DModel",
        "test_models_transformer_allegro",
        {
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "in_channels": 4,
            "out_channels": 4,
            "num_layers": 1,
            "cross_attention_dim": 16,
            "sample_width": 8,
            "sample_height": 8,
            "sample_frames": 8,
            "caption_channels": 8,
        },
        {
            "hidden_states": R(2, 4, 2, 8, 8),
            "encoder_hidden_states": R(2, 16, 8),
            "timestep": V([44, 239], dtype="int64"),
        },
    ),
    Case(
        "AnyFlowTransformer3DModel",
        "AnyFlowTransformer3DModel",
        "test_models_transformer_anyflow",
        {
            "patch_size": (1, 2, 2),
            "num_attention_heads": 2,
            "attention_head_dim": 12,
            "in_channels": 4,
            "out_channels": 4,
            "text_dim": 16,
            "freq_dim": 256,
            "ffn_dim": 32,
            "num_layers": 2,
            "cross_attn_norm": True,
            "rope_max_seq_len": 32,
            "gate_value": 0.25,
            "deltatime_type": "r",
        },
        {
            "hidden_states": R(1, 2, 4, 16, 16),
            "timestep": F(500.0, 1, 2, dtype="float32"),
            "r_timestep": F(250.0, 1, 2, dtype="float32"),
            "encoder_hidden_states": R(1, 12, 16),
        },
    ),
    Case(
        "AnyFlowFARTransformer3DModel",
        "AnyFlowFARTransformer3DModel",
        "test_models_transformer_anyflow_far",
        {
            "patch_size": (1, 2, 2),
            "compressed_patch_size": (1, 4, 4),
            "full_chunk_limit": 3,
            "num_attention_heads": 2,
            "attention_head_dim": 12,
            "in_channels": 4,
            "out_channels": 4,
            "text_dim": 16,
            "freq_dim": 256,
            "ffn_dim": 32,
            "num_layers": 2,
            "cross_attn_norm": True,
            "rope_max_seq_len": 32,
            "gate_value": 0.25,
            "deltatime_type": "r",
        },
        {
            "hidden_states": R(1, 4, 4, 16, 16),
            "timestep": F(500.0, 1, 4, dtype="float32"),
            "r_timestep": F(250.0, 1, 4, dtype="float32"),
            "encoder_hidden_states": R(1, 12, 16),
            "chunk_partition": [2, 2],
        },
    ),
    Case(
        "AuraFlowTransformer2DModel",
        "AuraFlowTransformer2DModel",
        "test_models_transformer_aura_flow",
        {
            "sample_size": 32,
            "patch_size": 2,
            "in_channels": 4,
            "num_mmdit_layers": 1,
            "num_single_dit_layers": 1,
            "attention_head_dim": 8,
            "num_attention_heads": 4,
            "caption_projection_dim": 32,
            "joint_attention_dim": 32,
            "out_channels": 4,
            "pos_embed_max_size": 256,
        },
        {
            "hidden_states": R(2, 4, 32, 32),
            "encoder_hidden_states": R(2, 256, 32),
            "timestep": V([44, 239], dtype="int64"),
        },
    ),
    Case(
        "BriaTransformer2DModel",
        "BriaTransformer2DModel",
        "test_models_transformer_bria",
        {
            "patch_size": 1,
            "in_channels": 4,
            "num_layers": 1,
            "num_single_layers": 1,
            "attention_head_dim": 8,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "pooled_projection_dim": None,
            "axes_dims_rope": [0, 4, 4],
        },
        {
            "hidden_states": R(1, 16, 4),
            "encoder_hidden_states": R(1, 48, 32),
            "img_ids": R(16, 3),
            "txt_ids": R(48, 3),
            "timestep": V([1.0], dtype="float32"),
        },
    ),
    Case(
        "BriaFiboTransformer2DModel",
        "BriaFiboTransformer2DModel",
        "test_models_transformer_bria_fibo",
        {
            "patch_size": 1,
            "in_channels": 48,
            "num_layers": 1,
            "num_single_layers": 1,
            "attention_head_dim": 8,
            "num_attention_heads": 2,
            "joint_attention_dim": 64,
            "text_encoder_dim": 32,
            "pooled_projection_dim": None,
            "axes_dims_rope": [0, 4, 4],
        },
        {
            "hidden_states": R(1, 256, 48),
            "encoder_hidden_states": R(1, 32, 64),
            "img_ids": R(256, 3),
            "txt_ids": R(32, 3),
            "timestep": V([1.0], dtype="float32"),
            "text_encoder_layers": [R(1, 32, 32), R(1, 32, 32)],
        },
    ),
    Case(
        "ChromaTransformer2DModel",
        "ChromaTransformer2DModel",
        "test_models_transformer_chroma",
        {
            "patch_size": 1,
            "in_channels": 4,
            "num_layers": 1,
            "num_single_layers": 1,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "axes_dims_rope": [4, 4, 8],
            "approximator_num_channels": 8,
            "approximator_hidden_dim": 16,
            "approximator_layers": 1,
        },
        {
            "hidden_states": R(1, 16, 4),
            "encoder_hidden_states": R(1, 48, 32),
            "img_ids": R(16, 3),
            "txt_ids": R(48, 3),
            "timestep": V([1.0], dtype="float32"),
        },
    ),
    Case(
        "ChronoEditTransformer3DModel",
        "ChronoEditTransformer3DModel",
        "test_models_transformer_chronoedit",
        {
            "patch_size": (1, 2, 2),
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "in_channels": 16,
            "out_channels": 16,
            "text_dim": 32,
            "freq_dim": 16,
            "ffn_dim": 32,
            "num_layers": 2,
            "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads",
            "eps": 1e-06,
            "image_dim": None,
            "added_kv_proj_dim": None,
            "rope_max_seq_len": 64,
            "pos_embed_seq_len": None,
            "rope_temporal_skip_len": 8,
        },
        {
            "hidden_states": R(1, 16, 2, 8, 8),
            "timestep": V([44], dtype="int64"),
            "encoder_hidden_states": R(1, 12, 32),
            "encoder_hidden_states_image": None,
        },
    ),
    Case(
        "CogVideoXTransformer3DModel (CogVideoXTransformer)",
        "CogVideoXTransformer3DModel",
        "test_models_transformer_cogvideox",
        {
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "in_channels": 4,
            "out_channels": 4,
            "time_embed_dim": 2,
            "text_embed_dim": 8,
            "num_layers": 2,
            "sample_width": 8,
            "sample_height": 8,
            "sample_frames": 8,
            "patch_size": 2,
            "patch_size_t": None,
            "temporal_compression_ratio": 4,
            "max_text_seq_length": 8,
        },
        {
            "hidden_states": R(2, 1, 4, 8, 8),
            "encoder_hidden_states": R(2, 8, 8),
            "timestep": V([44, 239], dtype="int64"),
        },
    ),
    Case(
        "CogVideoXTransformer3DModel (CogVideoX15Transformer)",
        "CogVideoXTransformer3DModel",
        "test_models_transformer_cogvideox",
        {
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "in_channels": 4,
            "out_channels": 4,
            "time_embed_dim": 2,
            "text_embed_dim": 8,
            "num_layers": 2,
            "sample_width": 8,
            "sample_height": 8,
            "sample_frames": 8,
            "patch_size": 2,
            "patch_size_t": 2,
            "temporal_compression_ratio": 4,
            "max_text_seq_length": 8,
            "use_rotary_positional_embeddings": True,
        },
        {
            "hidden_states": R(2, 2, 4, 8, 8),
            "encoder_hidden_states": R(2, 8, 8),
            "timestep": V([44, 239], dtype="int64"),
        },
    ),
    Case(
        "CogView3PlusTransformer2DModel",
        "CogView3PlusTransformer2DModel",
        "test_models_transformer_cogview3plus",
        {
            "patch_size": 2,
            "in_channels": 4,
            "num_layers": 2,
            "attention_head_dim": 4,
            "num_attention_heads": 2,
            "out_channels": 4,
            "text_embed_dim": 8,
            "time_embed_dim": 8,
            "condition_dim": 2,
            "pos_embed_max_size": 8,
            "sample_size": 8,
        },
        {
            "hidden_states": R(2, 4, 8, 8),
            "encoder_hidden_states": R(2, 8, 8),
            "original_size": F(64, 2, 2, dtype="int64"),
            "target_size": F(64, 2, 2, dtype="int64"),
            "crop_coords": F(0, 2, 2, dtype="int64"),
            "timestep": V([44, 239], dtype="int64"),
        },
    ),
    Case(
        "CogView4Transformer2DModel",
        "CogView4Transformer2DModel",
        "test_models_transformer_cogview4",
        {
            "patch_size": 2,
            "in_channels": 4,
            "num_layers": 2,
            "attention_head_dim": 4,
            "num_attention_heads": 4,
            "out_channels": 4,
            "text_embed_dim": 8,
            "time_embed_dim": 8,
            "condition_dim": 4,
        },
        {
            "hidden_states": R(2, 4, 8, 8),
            "encoder_hidden_states": R(2, 8, 8),
            "timestep": V([44, 239], dtype="int64"),
            "original_size": F(64, 2, 2, dtype="int64"),
            "target_size": F(64, 2, 2, dtype="int64"),
            "crop_coords": F(0, 2, 2, dtype="int64"),
        },
    ),
    Case(
        "ConsisIDTransformer3DModel",
        "ConsisIDTransformer3DModel",
        "test_models_transformer_consisid",
        {
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "in_channels": 4,
            "out_channels": 4,
            "time_embed_dim": 2,
            "text_embed_dim": 8,
            "num_layers": 1,
            "sample_width": 8,
            "sample_height": 8,
            "sample_frames": 8,
            "patch_size": 2,
            "temporal_compression_ratio": 4,
            "max_text_seq_length": 8,
            "cross_attn_interval": 1,
            "is_kps": False,
            "is_train_face": True,
            "cross_attn_dim_head": 1,
            "cross_attn_num_heads": 1,
            "LFE_id_dim": 2,
            "LFE_vit_dim": 2,
            "LFE_depth": 5,
            "LFE_dim_head": 8,
            "LFE_num_heads": 2,
            "LFE_num_id_token": 1,
            "LFE_num_querie": 1,
            "LFE_output_dim": 10,
            "LFE_ff_mult": 1,
            "LFE_num_scale": 1,
        },
        {
            "hidden_states": R(2, 1, 4, 8, 8),
            "encoder_hidden_states": R(2, 8, 8),
            "timestep": V([44, 239], dtype="int64"),
            "id_vit_hidden": [F(1.0, 2, 2, 2, dtype="float32")],
            "id_cond": F(1.0, 2, 2, dtype="float32"),
        },
    ),
    Case(
        "CosmosTransformer3DModel (CosmosTransformer)",
        "CosmosTransformer3DModel",
        "test_models_transformer_cosmos",
        {
            "in_channels": 4,
            "out_channels": 4,
            "num_attention_heads": 2,
            "attention_head_dim": 12,
            "num_layers": 2,
            "mlp_ratio": 2,
            "text_embed_dim": 16,
            "adaln_lora_dim": 4,
            "max_size": (4, 32, 32),
            "patch_size": (1, 2, 2),
            "rope_scale": (2.0, 1.0, 1.0),
            "concat_padding_mask": True,
            "extra_pos_embed_type": "learnable",
        },
        {
            "hidden_states": R(1, 4, 1, 16, 16),
            "timestep": V([44], dtype="int64"),
            "encoder_hidden_states": R(1, 12, 16),
            "attention_mask": F(1.0, 1, 12, dtype="float32"),
            "fps": 30,
            "padding_mask": F(0.0, 1, 1, 16, 16, dtype="float32"),
        },
    ),
    Case(
        "CosmosTransformer3DModel (CosmosTransformerVideoToWorld)",
        "CosmosTransformer3DModel",
        "test_models_transformer_cosmos",
        {
            "in_channels": 5,
            "out_channels": 4,
            "num_attention_heads": 2,
            "attention_head_dim": 12,
            "num_layers": 2,
            "mlp_ratio": 2,
            "text_embed_dim": 16,
            "adaln_lora_dim": 4,
            "max_size": (4, 32, 32),
            "patch_size": (1, 2, 2),
            "rope_scale": (2.0, 1.0, 1.0),
            "concat_padding_mask": True,
            "extra_pos_embed_type": "learnable",
        },
        {
            "hidden_states": R(1, 4, 1, 16, 16),
            "timestep": V([44], dtype="int64"),
            "encoder_hidden_states": R(1, 12, 16),
            "attention_mask": F(1.0, 1, 12, dtype="float32"),
            "fps": 30,
            "condition_mask": F(1.0, 1, 1, 1, 16, 16, dtype="float32"),
            "padding_mask": F(0.0, 1, 1, 16, 16, dtype="float32"),
        },
    ),
    Case(
        "Cosmos3OmniTransformer",
        "Cosmos3OmniTransformer",
        "test_models_transformer_cosmos3",
        {
            "head_dim": 6,
            "hidden_act": "relu2",
            "hidden_size": 12,
            "intermediate_size": 24,
            "latent_channel": 2,
            "latent_patch_size": 1,
            "num_attention_heads": 2,
            "num_hidden_layers": 2,
            "num_key_value_heads": 1,
            "patch_latent_dim": 2,
            "qk_norm_for_text": False,
            "rms_norm_eps": 1e-05,
            "rope_axes_dim": [1, 1, 1],
            "rope_theta": 100000000.0,
            "vocab_size": 32,
        },
        {
            "input_ids": V([1, 2], dtype="int64"),
            "text_indexes": V([0, 1], dtype="int64"),
            "position_ids": F(0, 3, 3, dtype="int64"),
            "und_len": 2,
            "sequence_length": 3,
            "vision_tokens": [V([[[[[1.541]]], [[[-0.2934]]]]], dtype="float32")],
            "vision_token_shapes": [(1, 1, 1)],
            "vision_sequence_indexes": V([2], dtype="int64"),
            "vision_mse_loss_indexes": V([2], dtype="int64"),
            "vision_timesteps": V([1.0], dtype="float32"),
            "vision_noisy_frame_indexes": [V([0], dtype="int64")],
        },
    ),
    Case(
        "EasyAnimateTransformer3DModel",
        "EasyAnimateTransformer3DModel",
        "test_models_transformer_easyanimate",
        {
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "in_channels": 4,
            "mmdit_layers": 2,
            "num_layers": 2,
            "out_channels": 4,
            "patch_size": 2,
            "sample_height": 60,
            "sample_width": 90,
            "text_embed_dim": 16,
            "time_embed_dim": 8,
            "time_position_encoding_type": "3d_rope",
            "timestep_activation_fn": "silu",
        },
        {
            "hidden_states": R(2, 4, 2, 16, 16),
            "timestep": V([44, 239], dtype="int64"),
            "timestep_cond": None,
            "encoder_hidden_states": R(2, 16, 16),
            "encoder_hidden_states_t5": None,
            "inpaint_latents": None,
            "control_latents": None,
        },
    ),
    Case(
        "ErnieImageTransformer2DModel",
        "ErnieImageTransformer2DModel",
        "test_models_transformer_ernie_image",
        {
            "hidden_size": 16,
            "num_attention_heads": 1,
            "num_layers": 1,
            "ffn_hidden_size": 16,
            "in_channels": 16,
            "out_channels": 16,
            "patch_size": 1,
            "text_in_dim": 16,
            "rope_theta": 256,
            "rope_axes_dim": (8, 4, 4),
            "eps": 1e-06,
            "qk_layernorm": True,
        },
        {
            "hidden_states": R(1, 16, 16, 16),
            "timestep": V([1.0], dtype="float32"),
            "text_bth": R(1, 16, 16),
            "text_lens": V([16], dtype="int64"),
        },
    ),
    Case(
        "FluxTransformer2DModel",
        "FluxTransformer2DModel",
        "test_models_transformer_flux",
        {
            "patch_size": 1,
            "in_channels": 4,
            "num_layers": 1,
            "num_single_layers": 1,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "pooled_projection_dim": 32,
            "axes_dims_rope": [4, 4, 8],
        },
        {
            "hidden_states": R(1, 16, 4),
            "encoder_hidden_states": R(1, 48, 32),
            "pooled_projections": R(1, 32),
            "img_ids": R(16, 3),
            "txt_ids": R(48, 3),
            "timestep": V([1.0], dtype="float32"),
        },
    ),
    Case(
        "Flux2Transformer2DModel (Flux2Transformer)",
        "Flux2Transformer2DModel",
        "test_models_transformer_flux2",
        {
            "patch_size": 1,
            "in_channels": 4,
            "num_layers": 1,
            "num_single_layers": 1,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "timestep_guidance_channels": 256,
            "axes_dims_rope": [4, 4, 4, 4],
        },
        {
            "hidden_states": R(1, 16, 4),
            "encoder_hidden_states": R(1, 48, 32),
            "img_ids": V(
                [
                    [
                        [0, 0, 0, 0],
                        [0, 0, 1, 0],
                        [0, 0, 2, 0],
                        [0, 0, 3, 0],
                        [0, 1, 0, 0],
                        [0, 1, 1, 0],
                        [0, 1, 2, 0],
                        [0, 1, 3, 0],
                        [0, 2, 0, 0],
                        [0, 2, 1, 0],
                        [0, 2, 2, 0],
                        [0, 2, 3, 0],
                        [0, 3, 0, 0],
                        [0, 3, 1, 0],
                        [0, 3, 2, 0],
                        [0, 3, 3, 0],
                    ]
                ],
                dtype="int64",
            ),
            "txt_ids": I(0, 48, 1, 48, 4, dtype="int64"),
            "timestep": V([1.0], dtype="float32"),
            "guidance": V([1.0], dtype="float32"),
        },
    ),
    Case(
        "Flux2Transformer2DModel (Flux2TransformerKVCache)",
        "Flux2Transformer2DModel",
        "test_models_transformer_flux2",
        {
            "patch_size": 1,
            "in_channels": 4,
            "num_layers": 1,
            "num_single_layers": 1,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "timestep_guidance_channels": 256,
            "axes_dims_rope": [4, 4, 4, 4],
        },
        {
            "hidden_states": R(1, 20, 4),
            "encoder_hidden_states": R(1, 48, 32),
            "img_ids": V(
                [
                    [
                        [0, 0, 0, 0],
                        [0, 1, 0, 0],
                        [0, 2, 0, 0],
                        [0, 3, 0, 0],
                        [0, 0, 0, 0],
                        [0, 0, 1, 0],
                        [0, 0, 2, 0],
                        [0, 0, 3, 0],
                        [0, 1, 0, 0],
                        [0, 1, 1, 0],
                        [0, 1, 2, 0],
                        [0, 1, 3, 0],
                        [0, 2, 0, 0],
                        [0, 2, 1, 0],
                        [0, 2, 2, 0],
                        [0, 2, 3, 0],
                        [0, 3, 0, 0],
                        [0, 3, 1, 0],
                        [0, 3, 2, 0],
                        [0, 3, 3, 0],
                    ]
                ],
                dtype="int64",
            ),
            "txt_ids": I(0, 48, 1, 48, 4, dtype="int64"),
            "timestep": V([1.0], dtype="float32"),
            "guidance": V([1.0], dtype="float32"),
        },
    ),
    Case(
        "GlmImageTransformer2DModel",
        "GlmImageTransformer2DModel",
        "test_models_transformer_glm_image",
        {
            "patch_size": 2,
            "in_channels": 4,
            "out_channels": 4,
            "num_layers": 1,
            "attention_head_dim": 8,
            "num_attention_heads": 2,
            "text_embed_dim": 32,
            "time_embed_dim": 16,
            "condition_dim": 8,
            "prior_vq_quantizer_codebook_size": 64,
        },
        {
            "hidden_states": R(1, 4, 8, 8),
            "encoder_hidden_states": R(1, 12, 32),
            "prior_token_id": V([44], dtype="int64"),
            "prior_token_drop": F(False, 1, dtype="bool"),
            "timestep": V([44], dtype="int64"),
            "target_size": F(8.0, 1, 2, dtype="float32"),
            "crop_coords": F(0.0, 1, 2, dtype="float32"),
        },
    ),
    Case(
        "HeliosTransformer3DModel",
        "HeliosTransformer3DModel",
        "test_models_transformer_helios",
        {
            "patch_size": (1, 2, 2),
            "num_attention_heads": 2,
            "attention_head_dim": 12,
            "in_channels": 4,
            "out_channels": 4,
            "text_dim": 16,
            "freq_dim": 256,
            "ffn_dim": 32,
            "num_layers": 2,
            "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads",
            "rope_dim": (4, 4, 4),
            "has_multi_term_memory_patch": True,
            "guidance_cross_attn": True,
            "zero_history_timestep": True,
            "is_amplify_history": False,
        },
        {
            "hidden_states": R(1, 4, 2, 16, 16),
            "timestep": V([44], dtype="int64"),
            "encoder_hidden_states": R(1, 12, 16),
            "indices_hidden_states": F(1.0, 1, 2, dtype="float32"),
            "indices_latents_history_short": V([[1.0]], dtype="float32"),
            "indices_latents_history_mid": V([[1.0]], dtype="float32"),
            "indices_latents_history_long": F(1.0, 1, 4, dtype="float32"),
            "latents_history_short": R(1, 4, 1, 16, 16),
            "latents_history_mid": R(1, 4, 1, 16, 16),
            "latents_history_long": R(1, 4, 4, 16, 16),
        },
    ),
    Case(
        "HiDreamImageTransformer2DModel",
        "HiDreamImageTransformer2DModel",
        "test_models_transformer_hidream",
        {
            "patch_size": 2,
            "in_channels": 4,
            "out_channels": 4,
            "num_layers": 1,
            "num_single_layers": 1,
            "attention_head_dim": 8,
            "num_attention_heads": 4,
            "caption_channels": [8, 4],
            "text_emb_dim": 8,
            "num_routed_experts": 2,
            "num_activated_experts": 2,
            "axes_dims_rope": (4, 2, 2),
            "max_resolution": (32, 32),
            "llama_layers": (0, 1),
            "force_inference_output": True,
        },
        {
            "hidden_states": R(2, 4, 32, 32),
            "encoder_hidden_states_t5": R(2, 8, 8),
            "encoder_hidden_states_llama3": R(2, 2, 8, 4),
            "pooled_embeds": R(2, 8),
            "timesteps": V([44, 239], dtype="int64"),
        },
    ),
    Case(
        "HunyuanVideo15Transformer3DModel",
        "HunyuanVideo15Transformer3DModel",
        "test_models_transformer_hunyuan_1_5",
        {
            "in_channels": 4,
            "out_channels": 4,
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "num_layers": 2,
            "num_refiner_layers": 1,
            "mlp_ratio": 2.0,
            "patch_size": 1,
            "patch_size_t": 1,
            "text_embed_dim": 16,
            "text_embed_2_dim": 8,
            "image_embed_dim": 12,
            "rope_axes_dim": (2, 2, 4),
            "target_size": 16,
            "task_type": "t2v",
        },
        {
            "hidden_states": R(1, 4, 1, 8, 8),
            "timestep": V([1.0], dtype="float32"),
            "encoder_hidden_states": R(1, 6, 16),
            "encoder_hidden_states_2": R(1, 4, 8),
            "encoder_attention_mask": F(1.0, 1, 6, dtype="float32"),
            "encoder_attention_mask_2": F(1.0, 1, 4, dtype="float32"),
            "image_embeds": F(0.0, 1, 3, 12, dtype="float32"),
        },
    ),
    Case(
        "HunyuanDiT2DModel",
        "HunyuanDiT2DModel",
        "test_models_transformer_hunyuan_dit",
        {
            "sample_size": 8,
            "patch_size": 2,
            "in_channels": 4,
            "num_layers": 1,
            "attention_head_dim": 8,
            "num_attention_heads": 2,
            "cross_attention_dim": 8,
            "cross_attention_dim_t5": 8,
            "pooled_projection_dim": 4,
            "hidden_size": 16,
            "text_len": 4,
            "text_len_t5": 4,
            "activation_fn": "gelu-approximate",
        },
        {
            "hidden_states": R(2, 4, 8, 8),
            "encoder_hidden_states": R(2, 4, 8),
            "text_embedding_mask": F(1.0, 2, 4, dtype="float32"),
            "encoder_hidden_states_t5": R(2, 4, 8),
            "text_embedding_mask_t5": F(1.0, 2, 4, dtype="float32"),
            "timestep": V([44.0, 239.0], dtype="float32"),
            "image_meta_size": V(
                [[1024.0, 1024.0, 16.0, 16.0, 0.0, 0.0], [1024.0, 1024.0, 16.0, 16.0, 0.0, 0.0]], dtype="float32"
            ),
            "style": F(0, 2, dtype="int64"),
            "image_rotary_emb": [F(1.0, 1, 8, dtype="float32"), F(0.0, 1, 8, dtype="float32")],
        },
    ),
    Case(
        "HunyuanVideoTransformer3DModel (HunyuanVideoTransformer)",
        "HunyuanVideoTransformer3DModel",
        "test_models_transformer_hunyuan_video",
        {
            "in_channels": 4,
            "out_channels": 4,
            "num_attention_heads": 2,
            "attention_head_dim": 10,
            "num_layers": 1,
            "num_single_layers": 1,
            "num_refiner_layers": 1,
            "patch_size": 1,
            "patch_size_t": 1,
            "guidance_embeds": True,
            "text_embed_dim": 16,
            "pooled_projection_dim": 8,
            "rope_axes_dim": (2, 4, 4),
            "image_condition_type": None,
        },
        {
            "hidden_states": R(1, 4, 1, 16, 16),
            "timestep": V([44.0], dtype="float32"),
            "encoder_hidden_states": R(1, 12, 16),
            "pooled_projections": R(1, 8),
            "encoder_attention_mask": F(1.0, 1, 12, dtype="float32"),
            "guidance": V([44.0], dtype="float32"),
        },
    ),
    Case(
        "HunyuanVideoTransformer3DModel (HunyuanVideoI2VTransformer)",
        "HunyuanVideoTransformer3DModel",
        "test_models_transformer_hunyuan_video",
        {
            "in_channels": 9,
            "out_channels": 4,
            "num_attention_heads": 2,
            "attention_head_dim": 10,
            "num_layers": 1,
            "num_single_layers": 1,
            "num_refiner_layers": 1,
            "patch_size": 1,
            "patch_size_t": 1,
            "guidance_embeds": False,
            "text_embed_dim": 16,
            "pooled_projection_dim": 8,
            "rope_axes_dim": (2, 4, 4),
            "image_condition_type": "latent_concat",
        },
        {
            "hidden_states": R(1, 9, 1, 16, 16),
            "timestep": V([44], dtype="int64"),
            "encoder_hidden_states": R(1, 12, 16),
            "pooled_projections": R(1, 8),
            "encoder_attention_mask": F(1.0, 1, 12, dtype="float32"),
        },
    ),
    Case(
        "HunyuanVideoTransformer3DModel (HunyuanVideoTokenReplaceTransformer)",
        "HunyuanVideoTransformer3DModel",
        "test_models_transformer_hunyuan_video",
        {
            "in_channels": 2,
            "out_channels": 4,
            "num_attention_heads": 2,
            "attention_head_dim": 10,
            "num_layers": 1,
            "num_single_layers": 1,
            "num_refiner_layers": 1,
            "patch_size": 1,
            "patch_size_t": 1,
            "guidance_embeds": True,
            "text_embed_dim": 16,
            "pooled_projection_dim": 8,
            "rope_axes_dim": (2, 4, 4),
            "image_condition_type": "token_replace",
        },
        {
            "hidden_states": R(1, 2, 1, 16, 16),
            "timestep": V([44], dtype="int64"),
            "encoder_hidden_states": R(1, 12, 16),
            "pooled_projections": R(1, 8),
            "encoder_attention_mask": F(1.0, 1, 12, dtype="float32"),
            "guidance": V([44.0], dtype="float32"),
        },
    ),
    Case(
        "HunyuanVideoFramepackTransformer3DModel",
        "HunyuanVideoFramepackTransformer3DModel",
        "test_models_transformer_hunyuan_video_framepack",
        {
            "in_channels": 4,
            "out_channels": 4,
            "num_attention_heads": 2,
            "attention_head_dim": 10,
            "num_layers": 1,
            "num_single_layers": 1,
            "num_refiner_layers": 1,
            "patch_size": 2,
            "patch_size_t": 1,
            "guidance_embeds": True,
            "text_embed_dim": 16,
            "pooled_projection_dim": 8,
            "rope_axes_dim": (2, 4, 4),
            "image_condition_type": None,
            "has_image_proj": True,
            "image_proj_dim": 16,
            "has_clean_x_embedder": True,
        },
        {
            "hidden_states": R(1, 4, 3, 4, 4),
            "timestep": V([44], dtype="int64"),
            "encoder_hidden_states": R(1, 12, 16),
            "pooled_projections": R(1, 8),
            "encoder_attention_mask": F(1.0, 1, 12, dtype="float32"),
            "guidance": V([44], dtype="int64"),
            "image_embeds": R(1, 12, 16),
            "indices_latents": F(1.0, 3, dtype="float32"),
            "latents_clean": R(1, 4, 2, 4, 4),
            "indices_latents_clean": F(1.0, 2, dtype="float32"),
            "latents_history_2x": R(1, 4, 2, 4, 4),
            "indices_latents_history_2x": F(1.0, 2, dtype="float32"),
            "latents_history_4x": R(1, 4, 8, 4, 4),
            "indices_latents_history_4x": F(1.0, 8, dtype="float32"),
        },
    ),
    Case(
        "Ideogram4Transformer2DModel",
        "Ideogram4Transformer2DModel",
        "test_models_transformer_ideogram4",
        {
            "in_channels": 16,
            "num_layers": 2,
            "attention_head_dim": 8,
            "num_attention_heads": 4,
            "intermediate_size": 32,
            "adaln_dim": 16,
            "llm_features_dim": 24,
            "rope_theta": 10000,
            "mrope_section": (2, 1, 1),
            "norm_eps": 1e-05,
        },
        {
            "hidden_states": R(1, 8, 16),
            "encoder_hidden_states": R(1, 8, 24),
            "timestep": V([0.5], dtype="float32"),
            "position_ids": V(
                [
                    [
                        [0, 0, 0],
                        [1, 1, 1],
                        [2, 2, 2],
                        [3, 3, 3],
                        [65536, 65536, 65536],
                        [65536, 65536, 65537],
                        [65536, 65537, 65536],
                        [65536, 65537, 65537],
                    ]
                ],
                dtype="int64",
            ),
            "segment_ids": F(1, 1, 8, dtype="int64"),
            "indicator": V([[3, 3, 3, 3, 2, 2, 2, 2]], dtype="int64"),
        },
    ),
    Case(
        "JoyImageEditTransformer3DModel",
        "JoyImageEditTransformer3DModel",
        "test_models_transformer_joyimage",
        {
            "patch_size": [1, 2, 2],
            "in_channels": 16,
            "hidden_size": 32,
            "num_attention_heads": 2,
            "text_dim": 16,
            "num_layers": 2,
            "rope_dim_list": [4, 6, 6],
            "theta": 256,
        },
        {
            "hidden_states": R(1, 16, 1, 4, 4),
            "encoder_hidden_states": R(1, 12, 16),
            "timestep": V([1.0], dtype="float32"),
        },
    ),
    Case(
        "JoyImageEditPlusTransformer3DModel",
        "JoyImageEditPlusTransformer3DModel",
        "test_models_transformer_joyimage_edit_plus",
        {
            "patch_size": [1, 2, 2],
            "in_channels": 16,
            "hidden_size": 32,
            "num_attention_heads": 2,
            "text_dim": 16,
            "num_layers": 2,
            "rope_dim_list": [4, 6, 6],
            "theta": 256,
        },
        {
            "hidden_states": R(1, 2, 16, 1, 2, 2),
            "encoder_hidden_states": R(1, 12, 16),
            "timestep": V([1.0], dtype="float32"),
            "shape_list": [[(1, 1, 1), (1, 1, 1)]],
        },
    ),
    Case(
        "Krea2Transformer2DModel",
        "Krea2Transformer2DModel",
        "test_models_transformer_krea2",
        {
            "in_channels": 16,
            "num_layers": 2,
            "attention_head_dim": 8,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 32,
            "timestep_embed_dim": 8,
            "text_hidden_dim": 16,
            "num_text_layers": 3,
            "text_num_attention_heads": 2,
            "text_num_key_value_heads": 1,
            "text_intermediate_size": 16,
            "num_layerwise_text_blocks": 1,
            "num_refiner_text_blocks": 1,
            "axes_dims_rope": (4, 2, 2),
            "rope_theta": 1000.0,
            "norm_eps": 1e-05,
        },
        {
            "hidden_states": R(1, 4, 16),
            "encoder_hidden_states": R(1, 4, 3, 16),
            "timestep": V([0.5], dtype="float32"),
            "position_ids": V(
                [
                    [0.0, 0.0, 0.0],
                    [0.0, 0.0, 0.0],
                    [0.0, 0.0, 0.0],
                    [0.0, 0.0, 0.0],
                    [0.0, 0.0, 0.0],
                    [0.0, 0.0, 1.0],
                    [0.0, 1.0, 0.0],
                    [0.0, 1.0, 1.0],
                ],
                dtype="float32",
            ),
            "encoder_attention_mask": V([[True, True, True, False]], dtype="bool"),
        },
    ),
    Case(
        "LatteTransformer3DModel",
        "LatteTransformer3DModel",
        "test_models_transformer_latte",
        {
            "sample_size": 8,
            "num_layers": 1,
            "patch_size": 2,
            "attention_head_dim": 4,
            "num_attention_heads": 2,
            "caption_channels": 8,
            "in_channels": 4,
            "cross_attention_dim": 8,
            "out_channels": 8,
            "attention_bias": True,
            "activation_fn": "gelu-approximate",
            "num_embeds_ada_norm": 1000,
            "norm_type": "ada_norm_single",
            "norm_elementwise_affine": False,
            "norm_eps": 1e-06,
        },
        {
            "hidden_states": R(2, 4, 1, 8, 8),
            "encoder_hidden_states": R(2, 8, 8),
            "timestep": V([44, 239], dtype="int64"),
            "enable_temporal_attentions": True,
        },
    ),
    Case(
        "LongCatAudioDiTTransformer",
        "LongCatAudioDiTTransformer",
        "test_models_transformer_longcat_audio_dit",
        {"dit_dim": 64, "dit_depth": 2, "dit_heads": 4, "dit_text_dim": 32, "latent_dim": 8, "text_conv": False},
        {
            "hidden_states": R(1, 16, 8),
            "encoder_hidden_states": R(1, 10, 32),
            "encoder_attention_mask": F(True, 1, 10, dtype="bool"),
            "attention_mask": F(True, 1, 16, dtype="bool"),
            "timestep": V([1.0], dtype="float32"),
        },
    ),
    Case(
        "LongCatImageTransformer2DModel",
        "LongCatImageTransformer2DModel",
        "test_models_transformer_longcat_image",
        {
            "patch_size": 1,
            "in_channels": 4,
            "num_layers": 1,
            "num_single_layers": 1,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "pooled_projection_dim": 32,
            "axes_dims_rope": [4, 4, 8],
        },
        {
            "hidden_states": R(1, 16, 4),
            "encoder_hidden_states": R(1, 48, 32),
            "img_ids": R(16, 3),
            "txt_ids": R(48, 3),
            "timestep": V([1.0], dtype="float32"),
            "guidance": V([3.5], dtype="float32"),
        },
    ),
    Case(
        "LTXVideoTransformer3DModel",
        "LTXVideoTransformer3DModel",
        "test_models_transformer_ltx",
        {
            "in_channels": 4,
            "out_channels": 4,
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "cross_attention_dim": 16,
            "num_layers": 1,
            "qk_norm": "rms_norm_across_heads",
            "caption_channels": 16,
        },
        {
            "hidden_states": R(2, 512, 4),
            "encoder_hidden_states": R(2, 16, 16),
            "timestep": V([44, 239], dtype="int64"),
            "encoder_attention_mask": F(True, 2, 16, dtype="bool"),
            "num_frames": 2,
            "height": 16,
            "width": 16,
        },
    ),
    Case(
        "LTX2VideoTransformer3DModel",
        "LTX2VideoTransformer3DModel",
        "test_models_transformer_ltx2",
        {
            "in_channels": 4,
            "out_channels": 4,
            "patch_size": 1,
            "patch_size_t": 1,
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "cross_attention_dim": 16,
            "audio_in_channels": 4,
            "audio_out_channels": 4,
            "audio_num_attention_heads": 2,
            "audio_attention_head_dim": 4,
            "audio_cross_attention_dim": 8,
            "num_layers": 2,
            "qk_norm": "rms_norm_across_heads",
            "caption_channels": 16,
            "rope_double_precision": False,
        },
        {
            "hidden_states": R(2, 512, 4),
            "audio_hidden_states": R(2, 9, 4),
            "encoder_hidden_states": R(2, 16, 16),
            "audio_encoder_hidden_states": R(2, 16, 16),
            "timestep": V([1540.9961, 293.4289], dtype="float32"),
            "encoder_attention_mask": F(True, 2, 16, dtype="bool"),
            "num_frames": 2,
            "height": 16,
            "width": 16,
            "audio_num_frames": 9,
            "fps": 25.0,
        },
    ),
    Case(
        "LuminaNextDiT2DModel",
        "LuminaNextDiT2DModel",
        "test_models_transformer_lumina",
        {
            "sample_size": 16,
            "patch_size": 2,
            "in_channels": 4,
            "hidden_size": 24,
            "num_layers": 2,
            "num_attention_heads": 3,
            "num_kv_heads": 1,
            "multiple_of": 16,
            "ffn_dim_multiplier": None,
            "norm_eps": 1e-05,
            "learn_sigma": False,
            "qk_norm": True,
            "cross_attention_dim": 32,
            "scaling_factor": 1.0,
        },
        {
            "hidden_states": R(2, 4, 16, 16),
            "encoder_hidden_states": R(2, 16, 32),
            "timestep": V([0.4963, 0.7682], dtype="float32"),
            "encoder_mask": R(2, 16),
            "image_rotary_emb": R(384, 384, 4),
            "cross_attention_kwargs": {},
        },
    ),
    Case(
        "Lumina2Transformer2DModel",
        "Lumina2Transformer2DModel",
        "test_models_transformer_lumina2",
        {
            "sample_size": 16,
            "patch_size": 2,
            "in_channels": 4,
            "hidden_size": 24,
            "num_layers": 2,
            "num_refiner_layers": 1,
            "num_attention_heads": 3,
            "num_kv_heads": 1,
            "multiple_of": 2,
            "ffn_dim_multiplier": None,
            "norm_eps": 1e-05,
            "scaling_factor": 1.0,
            "axes_dim_rope": (4, 2, 2),
            "axes_lens": (128, 128, 128),
            "cap_feat_dim": 32,
        },
        {
            "hidden_states": R(2, 4, 16, 16),
            "encoder_hidden_states": R(2, 16, 32),
            "timestep": V([0.4963, 0.7682], dtype="float32"),
            "encoder_attention_mask": F(True, 2, 16, dtype="bool"),
        },
    ),
    Case(
        "MiniMaxH3Transformer3DModel",
        "MiniMaxH3Transformer3DModel",
        "test_models_transformer_minimax_h3",
        {
            "num_attention_heads": 2,
            "attention_head_dim": 16,
            "hidden_size": 24,
            "num_layers": 2,
            "num_refiner_layers": 2,
            "ffn_dim": 32,
            "in_channels": 4,
            "audio_in_channels": 6,
            "patch_size": (1, 2, 2),
            "text_dim": 8,
            "freq_dim": 8,
            "time_embed_hidden_dim": 24,
            "time_embed_dim": 16,
            "rope_freq_dim": 2,
        },
        {
            "hidden_states": R(2, 8, 16),
            "audio_hidden_states": R(2, 6, 6),
            "encoder_hidden_states": R(2, 4, 8),
            "timestep": V([0.7, 0.3], dtype="float32"),
            "timestep_indices": V([0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0], dtype="int64"),
            "token_tags": V([1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0], dtype="int64"),
            "position_ids": V(
                [
                    [0.0, 0.0, 0.0],
                    [1.0, 0.0, 0.0],
                    [2.0, 0.0, 0.0],
                    [3.0, 0.0, 0.0],
                    [4.0, 0.0, 0.0],
                    [5.0, 0.0, 0.0],
                    [6.0, 0.0, 0.0],
                    [7.0, 0.0, 0.0],
                    [8.0, 0.0, 0.0],
                    [9.0, 0.0, 0.0],
                    [10.0, 0.0, 0.0],
                    [11.0, 1.0, 1.0],
                    [12.0, 2.0, 0.0],
                    [13.0, 3.0, 1.0],
                    [14.0, 0.0, 0.0],
                    [15.0, 1.0, 1.0],
                    [16.0, 2.0, 0.0],
                    [17.0, 3.0, 1.0],
                ],
                dtype="float32",
            ),
            "video_indices": V([10, 11, 12, 13, 14, 15, 16, 17], dtype="int64"),
            "audio_indices": V([4, 5, 6, 7, 8, 9], dtype="int64"),
            "text_indices": V([0, 1, 2, 3], dtype="int64"),
        },
    ),
    Case(
        "MiniMaxMusic3Transformer1DModel",
        "MiniMaxMusic3Transformer1DModel",
        "test_models_transformer_minimax_music3",
        {
            "in_channels": 8,
            "condition_dim": 16,
            "num_layers": 2,
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "ff_inner_dim": 32,
            "rotary_dim": 4,
            "fourier_embedding_dim": 8,
        },
        {"hidden_states": R(1, 8, 24), "encoder_hidden_states": R(1, 24, 16), "timestep": V([0.5], dtype="float32")},
    ),
    Case(
        "MochiTransformer3DModel",
        "MochiTransformer3DModel",
        "test_models_transformer_mochi",
        {
            "patch_size": 2,
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "num_layers": 2,
            "pooled_projection_dim": 16,
            "in_channels": 4,
            "out_channels": None,
            "qk_norm": "rms_norm",
            "text_embed_dim": 16,
            "time_embed_dim": 4,
            "activation_fn": "swiglu",
            "max_sequence_length": 16,
        },
        {
            "hidden_states": R(2, 4, 2, 16, 16),
            "encoder_hidden_states": R(2, 16, 16),
            "timestep": V([44, 239], dtype="int64"),
            "encoder_attention_mask": F(True, 2, 16, dtype="bool"),
        },
    ),
    Case(
        "MotifVideoTransformer3DModel",
        "MotifVideoTransformer3DModel",
        "test_models_transformer_motif_video",
        {
            "in_channels": 33,
            "out_channels": 16,
            "num_attention_heads": 2,
            "attention_head_dim": 12,
            "num_layers": 1,
            "num_single_layers": 1,
            "num_decoder_layers": 0,
            "mlp_ratio": 4.0,
            "patch_size": 1,
            "patch_size_t": 1,
            "qk_norm": "rms_norm",
            "norm_type": "layer_norm",
            "text_embed_dim": 32,
            "image_embed_dim": 4,
            "rope_theta": 256.0,
            "rope_axes_dim": (4, 4, 4),
            "enable_text_cross_attention_dual": False,
            "enable_text_cross_attention_single": False,
        },
        {
            "hidden_states": R(1, 33, 9, 16, 16),
            "encoder_hidden_states": R(1, 12, 32),
            "timestep": V([44], dtype="int64"),
        },
    ),
    Case(
        "NucleusMoEImageTransformer2DModel",
        "NucleusMoEImageTransformer2DModel",
        "test_models_transformer_nucleusmoe_image",
        {
            "patch_size": 2,
            "in_channels": 16,
            "out_channels": 4,
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 4,
            "joint_attention_dim": 16,
            "axes_dims_rope": (8, 4, 4),
            "moe_enabled": False,
            "capacity_factors": [8.0, 8.0],
        },
        {
            "hidden_states": R(1, 16, 16),
            "encoder_hidden_states": R(1, 8, 16),
            "encoder_hidden_states_mask": F(1, 1, 8, dtype="int64"),
            "timestep": V([1.0], dtype="float32"),
            "img_shapes": [(1, 4, 4)],
        },
    ),
    Case(
        "OmniGenTransformer2DModel",
        "OmniGenTransformer2DModel",
        "test_models_transformer_omnigen",
        {
            "hidden_size": 16,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "intermediate_size": 32,
            "num_layers": 20,
            "pad_token_id": 0,
            "vocab_size": 1000,
            "in_channels": 4,
            "time_step_dim": 4,
            "rope_scaling": {"long_factor": [1, 2], "short_factor": [1, 2]},
        },
        {
            "hidden_states": R(2, 4, 8, 8),
            "timestep": V([0.4963, 0.7682], dtype="float32"),
            "input_ids": V(
                [
                    [4, 9, 3, 0, 3, 9, 7, 3, 7, 3, 1, 6, 6, 9, 8, 6, 6, 8, 4, 3, 6, 9, 1, 4],
                    [4, 1, 9, 9, 9, 0, 1, 2, 3, 0, 5, 5, 2, 9, 1, 8, 8, 3, 6, 9, 1, 7, 3, 5],
                ],
                dtype="int64",
            ),
            "input_img_latents": [R(1, 4, 8, 8)],
            "input_image_sizes": {0: [[0, 16]]},
            "attention_mask": F(1.0, 2, 41, 41, dtype="float32"),
            "position_ids": V(
                [
                    [
                        0,
                        1,
                        2,
                        3,
                        4,
                        5,
                        6,
                        7,
                        8,
                        9,
                        10,
                        11,
                        12,
                        13,
                        14,
                        15,
                        16,
                        17,
                        18,
                        19,
                        20,
                        21,
                        22,
                        23,
                        24,
                        25,
                        26,
                        27,
                        28,
                        29,
                        30,
                        31,
                        32,
                        33,
                        34,
                        35,
                        36,
                        37,
                        38,
                        39,
                        40,
                    ],
                    [
                        0,
                        1,
                        2,
                        3,
                        4,
                        5,
                        6,
                        7,
                        8,
                        9,
                        10,
                        11,
                        12,
                        13,
                        14,
                        15,
                        16,
                        17,
                        18,
                        19,
                        20,
                        21,
                        22,
                        23,
                        24,
                        25,
                        26,
                        27,
                        28,
                        29,
                        30,
                        31,
                        32,
                        33,
                        34,
                        35,
                        36,
                        37,
                        38,
                        39,
                        40,
                    ],
                ],
                dtype="int64",
            ),
        },
    ),
    Case(
        "OvisImageTransformer2DModel",
        "OvisImageTransformer2DModel",
        "test_models_transformer_ovis_image",
        {
            "patch_size": 1,
            "in_channels": 4,
            "out_channels": 4,
            "num_layers": 1,
            "num_single_layers": 1,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "axes_dims_rope": (4, 4, 8),
        },
        {
            "hidden_states": R(1, 16, 4),
            "encoder_hidden_states": R(1, 48, 32),
            "img_ids": R(16, 3),
            "txt_ids": R(48, 3),
            "timestep": V([1.0], dtype="float32"),
        },
    ),
    Case(
        "PRXTransformer2DModel",
        "PRXTransformer2DModel",
        "test_models_transformer_prx",
        {
            "in_channels": 16,
            "patch_size": 2,
            "context_in_dim": 1792,
            "hidden_size": 1792,
            "mlp_ratio": 3.5,
            "num_heads": 28,
            "depth": 4,
            "axes_dim": [32, 32],
            "theta": 10000,
        },
        {
            "hidden_states": R(1, 16, 16, 16),
            "encoder_hidden_states": R(1, 16, 1792),
            "timestep": V([1.0], dtype="float32"),
        },
    ),
    Case(
        "QwenImageTransformer2DModel",
        "QwenImageTransformer2DModel",
        "test_models_transformer_qwenimage",
        {
            "patch_size": 2,
            "in_channels": 16,
            "out_channels": 4,
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 4,
            "joint_attention_dim": 16,
            "guidance_embeds": False,
            "axes_dims_rope": (8, 4, 4),
        },
        {
            "hidden_states": R(1, 16, 16),
            "encoder_hidden_states": R(1, 8, 16),
            "encoder_hidden_states_mask": F(1, 1, 8, dtype="int64"),
            "timestep": V([1.0], dtype="float32"),
            "img_shapes": [(1, 4, 4)],
        },
    ),
    Case(
        "SanaTransformer2DModel",
        "SanaTransformer2DModel",
        "test_models_transformer_sana",
        {
            "patch_size": 1,
            "in_channels": 4,
            "out_channels": 4,
            "num_layers": 1,
            "attention_head_dim": 4,
            "num_attention_heads": 2,
            "num_cross_attention_heads": 2,
            "cross_attention_head_dim": 4,
            "cross_attention_dim": 8,
            "caption_channels": 8,
            "sample_size": 32,
        },
        {
            "hidden_states": R(2, 4, 32, 32),
            "encoder_hidden_states": R(2, 8, 8),
            "timestep": V([44, 239], dtype="int64"),
        },
    ),
    Case(
        "SanaVideoTransformer3DModel",
        "SanaVideoTransformer3DModel",
        "test_models_transformer_sana_video",
        {
            "in_channels": 16,
            "out_channels": 16,
            "num_attention_heads": 2,
            "attention_head_dim": 12,
            "num_layers": 2,
            "num_cross_attention_heads": 2,
            "cross_attention_head_dim": 12,
            "cross_attention_dim": 24,
            "caption_channels": 16,
            "mlp_ratio": 2.5,
            "dropout": 0.0,
            "attention_bias": False,
            "sample_size": 8,
            "patch_size": (1, 2, 2),
            "norm_elementwise_affine": False,
            "norm_eps": 1e-06,
            "qk_norm": "rms_norm_across_heads",
            "rope_max_seq_len": 32,
        },
        {
            "hidden_states": R(1, 16, 2, 16, 16),
            "encoder_hidden_states": R(1, 12, 16),
            "timestep": V([44], dtype="int64"),
        },
    ),
    Case(
        "SD3Transformer2DModel (SD3Transformer)",
        "SD3Transformer2DModel",
        "test_models_transformer_sd3",
        {
            "sample_size": 32,
            "patch_size": 1,
            "in_channels": 4,
            "num_layers": 4,
            "attention_head_dim": 8,
            "num_attention_heads": 4,
            "caption_projection_dim": 32,
            "joint_attention_dim": 32,
            "pooled_projection_dim": 64,
            "out_channels": 4,
            "pos_embed_max_size": 96,
            "dual_attention_layers": (),
            "qk_norm": None,
        },
        {
            "hidden_states": R(2, 4, 32, 32),
            "encoder_hidden_states": R(2, 154, 32),
            "pooled_projections": R(2, 64),
            "timestep": V([44, 239], dtype="int64"),
        },
    ),
    Case(
        "SD3Transformer2DModel (SD35Transformer)",
        "SD3Transformer2DModel",
        "test_models_transformer_sd3",
        {
            "sample_size": 32,
            "patch_size": 1,
            "in_channels": 4,
            "num_layers": 4,
            "attention_head_dim": 8,
            "num_attention_heads": 4,
            "caption_projection_dim": 32,
            "joint_attention_dim": 32,
            "pooled_projection_dim": 64,
            "out_channels": 4,
            "pos_embed_max_size": 96,
            "dual_attention_layers": (0,),
            "qk_norm": "rms_norm",
        },
        {
            "hidden_states": R(2, 4, 32, 32),
            "encoder_hidden_states": R(2, 154, 32),
            "pooled_projections": R(2, 64),
            "timestep": V([44, 239], dtype="int64"),
        },
    ),
    Case(
        "SkyReelsV2Transformer3DModel",
        "SkyReelsV2Transformer3DModel",
        "test_models_transformer_skyreels_v2",
        {
            "patch_size": (1, 2, 2),
            "num_attention_heads": 2,
            "attention_head_dim": 12,
            "in_channels": 4,
            "out_channels": 4,
            "text_dim": 16,
            "freq_dim": 256,
            "ffn_dim": 32,
            "num_layers": 2,
            "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads",
            "rope_max_seq_len": 32,
        },
        {
            "hidden_states": R(1, 4, 2, 16, 16),
            "encoder_hidden_states": R(1, 12, 16),
            "timestep": V([44], dtype="int64"),
        },
    ),
    Case(
        "StableAudio3DiTModel",
        "StableAudio3DiTModel",
        "test_models_transformer_stable_audio3",
        {
            "io_channels": 8,
            "patch_size": 1,
            "embed_dim": 32,
            "depth": 2,
            "num_heads": 4,
            "cond_token_dim": 16,
            "global_cond_dim": 12,
            "local_add_cond_dim": 5,
            "timestep_features_dim": 16,
            "ff_mult": 2,
            "num_memory_tokens": 3,
            "use_differential_attention": False,
        },
        {
            "hidden_states": R(2, 8, 16),
            "timestep": V([0.0044, 0.7257], dtype="float32"),
            "encoder_hidden_states": R(2, 4, 16),
            "global_hidden_states": R(2, 12),
        },
    ),
    Case(
        "TransformerTemporalModel",
        "TransformerTemporalModel",
        "test_models_transformer_temporal",
        {"num_attention_heads": 8, "attention_head_dim": 4, "in_channels": 4, "num_layers": 1, "norm_num_groups": 1},
        {"hidden_states": R(2, 4, 32, 32), "timestep": V([44, 239], dtype="int64")},
    ),
    Case(
        "WanTransformer3DModel",
        "WanTransformer3DModel",
        "test_models_transformer_wan",
        {
            "patch_size": (1, 2, 2),
            "num_attention_heads": 2,
            "attention_head_dim": 12,
            "in_channels": 4,
            "out_channels": 4,
            "text_dim": 16,
            "freq_dim": 256,
            "ffn_dim": 32,
            "num_layers": 2,
            "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads",
            "rope_max_seq_len": 32,
        },
        {
            "hidden_states": R(1, 4, 2, 16, 16),
            "encoder_hidden_states": R(1, 12, 16),
            "timestep": V([44], dtype="int64"),
        },
    ),
    Case(
        "WanAnimateTransformer3DModel",
        "WanAnimateTransformer3DModel",
        "test_models_transformer_wan_animate",
        {
            "patch_size": (1, 2, 2),
            "num_attention_heads": 2,
            "attention_head_dim": 12,
            "in_channels": 12,
            "latent_channels": 4,
            "out_channels": 4,
            "text_dim": 16,
            "freq_dim": 256,
            "ffn_dim": 32,
            "num_layers": 2,
            "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads",
            "image_dim": 16,
            "rope_max_seq_len": 32,
            "motion_encoder_channel_sizes": {"4": 16, "8": 16, "16": 16},
            "motion_encoder_size": 16,
            "motion_style_dim": 8,
            "motion_dim": 4,
            "motion_encoder_dim": 16,
            "face_encoder_hidden_dim": 16,
            "face_encoder_num_heads": 2,
            "inject_face_latents_blocks": 2,
        },
        {
            "hidden_states": R(1, 12, 21, 16, 16),
            "timestep": V([44], dtype="int64"),
            "encoder_hidden_states": R(1, 12, 16),
            "encoder_hidden_states_image": R(1, 12, 16),
            "pose_hidden_states": R(1, 4, 20, 16, 16),
            "face_pixel_values": R(1, 3, 77, 16, 16),
        },
    ),
    Case(
        "WanAnimate2Transformer3DModel",
        "WanAnimate2Transformer3DModel",
        "test_models_transformer_wan_animate_2",
        {
            "patch_size": (1, 2, 2),
            "text_len": 16,
            "in_dim": 36,
            "dim": 128,
            "ffn_dim": 256,
            "freq_dim": 64,
            "text_dim": 32,
            "out_dim": 16,
            "num_heads": 4,
            "num_layers": 2,
            "cross_attn_norm": True,
            "use_img_emb": True,
        },
        {
            "hidden_states": [R(16, 2, 4, 4)],
            "timestep": V([1.0], dtype="float32"),
            "encoder_hidden_states": [R(8, 32)],
            "condition_latents": [R(20, 2, 4, 4)],
            "encoder_hidden_states_image": R(1, 4, 1280),
            "kv_cache": KVCache(2),
            "kv_cache_mode": "extract",
            "seq_len": 8,
            "offset_grid_sizes": F(2, 1, 3, dtype="int64"),
        },
    ),
    Case(
        "WanVACETransformer3DModel",
        "WanVACETransformer3DModel",
        "test_models_transformer_wan_vace",
        {
            "patch_size": (1, 2, 2),
            "num_attention_heads": 2,
            "attention_head_dim": 12,
            "in_channels": 16,
            "out_channels": 16,
            "text_dim": 32,
            "freq_dim": 256,
            "ffn_dim": 32,
            "num_layers": 4,
            "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads",
            "rope_max_seq_len": 32,
            "vace_layers": [0, 2],
            "vace_in_channels": 48,
        },
        {
            "hidden_states": R(1, 16, 2, 16, 16),
            "encoder_hidden_states": R(1, 12, 32),
            "control_hidden_states": R(1, 48, 2, 16, 16),
            "timestep": V([44], dtype="int64"),
        },
    ),
    Case(
        "ZImageTransformer2DModel",
        "ZImageTransformer2DModel",
        "test_models_transformer_z_image",
        {
            "all_patch_size": (2,),
            "all_f_patch_size": (1,),
            "in_channels": 16,
            "dim": 16,
            "n_layers": 1,
            "n_refiner_layers": 1,
            "n_heads": 1,
            "n_kv_heads": 2,
            "qk_norm": True,
            "cap_feat_dim": 16,
            "rope_theta": 256.0,
            "t_scale": 1000.0,
            "axes_dims": [8, 4, 4],
            "axes_lens": [256, 32, 32],
        },
        {"x": [R(16, 1, 16, 16)], "cap_feats": [R(16, 16)], "t": V([0.0], dtype="float32")},
    ),
    Case(
        "UNet1DModel (UNet1D)",
        "UNet1DModel",
        "test_models_unet_1d",
        {
            "block_out_channels": (8, 8, 16, 16),
            "in_channels": 14,
            "out_channels": 14,
            "time_embedding_type": "positional",
            "use_timestep_embedding": True,
            "flip_sin_to_cos": False,
            "freq_shift": 1.0,
            "out_block_type": "OutConv1DBlock",
            "mid_block_type": "MidResTemporalBlock1D",
            "down_block_types": ("DownResnetBlock1D", "DownResnetBlock1D", "DownResnetBlock1D", "DownResnetBlock1D"),
            "up_block_types": ("UpResnetBlock1D", "UpResnetBlock1D", "UpResnetBlock1D"),
            "act_fn": "swish",
        },
        {"sample": R(4, 14, 16), "timestep": F(10, 4, dtype="int64")},
    ),
    Case(
        "UNet1DModel (UNetRL)",
        "UNet1DModel",
        "test_models_unet_1d",
        {
            "in_channels": 14,
            "out_channels": 14,
            "down_block_types": ["DownResnetBlock1D", "DownResnetBlock1D", "DownResnetBlock1D", "DownResnetBlock1D"],
            "up_block_types": [],
            "out_block_type": "ValueFunction",
            "mid_block_type": "ValueFunctionMidBlock1D",
            "block_out_channels": [32, 64, 128, 256],
            "layers_per_block": 1,
            "downsample_each_block": True,
            "use_timestep_embedding": True,
            "freq_shift": 1.0,
            "flip_sin_to_cos": False,
            "time_embedding_type": "positional",
            "act_fn": "mish",
        },
        {"sample": R(4, 14, 16), "timestep": F(10, 4, dtype="int64")},
    ),
    Case(
        "UNet2DModel (Unet2D)",
        "UNet2DModel",
        "test_models_unet_2d",
        {
            "block_out_channels": (4, 8),
            "norm_num_groups": 2,
            "down_block_types": ("DownBlock2D", "AttnDownBlock2D"),
            "up_block_types": ("AttnUpBlock2D", "UpBlock2D"),
            "attention_head_dim": 3,
            "out_channels": 3,
            "in_channels": 3,
            "layers_per_block": 2,
            "sample_size": 32,
        },
        {"sample": R(4, 3, 32, 32), "timestep": V([10], dtype="int64")},
    ),
    Case(
        "UNet2DModel (UNetLDM)",
        "UNet2DModel",
        "test_models_unet_2d",
        {
            "sample_size": 32,
            "in_channels": 4,
            "out_channels": 4,
            "layers_per_block": 2,
            "block_out_channels": (32, 64),
            "attention_head_dim": 32,
            "down_block_types": ("DownBlock2D", "DownBlock2D"),
            "up_block_types": ("UpBlock2D", "UpBlock2D"),
        },
        {"sample": R(4, 4, 32, 32), "timestep": V([10], dtype="int64")},
    ),
    Case(
        "UNet2DModel (NCSNpp)",
        "UNet2DModel",
        "test_models_unet_2d",
        {
            "block_out_channels": [32, 64, 64, 64],
            "in_channels": 3,
            "layers_per_block": 1,
            "out_channels": 3,
            "time_embedding_type": "fourier",
            "norm_eps": 1e-06,
            "mid_block_scale_factor": 1.4142135623730951,
            "norm_num_groups": None,
            "down_block_types": ["SkipDownBlock2D", "AttnSkipDownBlock2D", "SkipDownBlock2D", "SkipDownBlock2D"],
            "up_block_types": ["SkipUpBlock2D", "SkipUpBlock2D", "AttnSkipUpBlock2D", "SkipUpBlock2D"],
        },
        {"sample": R(4, 3, 32, 32), "timestep": F(10, 4, dtype="int32")},
    ),
    Case(
        "UNet2DConditionModel",
        "UNet2DConditionModel",
        "test_models_unet_2d_condition",
        {
            "block_out_channels": (4, 8),
            "norm_num_groups": 4,
            "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
            "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
            "cross_attention_dim": 8,
            "attention_head_dim": 2,
            "out_channels": 4,
            "in_channels": 4,
            "layers_per_block": 1,
            "sample_size": 16,
        },
        {"sample": R(4, 4, 16, 16), "timestep": V([10], dtype="int64"), "encoder_hidden_states": R(4, 4, 8)},
    ),
    Case(
        "UNet3DConditionModel",
        "UNet3DConditionModel",
        "test_models_unet_3d_condition",
        {
            "block_out_channels": (4, 8),
            "norm_num_groups": 4,
            "down_block_types": ("CrossAttnDownBlock3D", "DownBlock3D"),
            "up_block_types": ("UpBlock3D", "CrossAttnUpBlock3D"),
            "cross_attention_dim": 8,
            "attention_head_dim": 2,
            "out_channels": 4,
            "in_channels": 4,
            "layers_per_block": 1,
            "sample_size": 16,
        },
        {"sample": R(4, 4, 4, 16, 16), "timestep": V([10], dtype="int64"), "encoder_hidden_states": R(4, 4, 8)},
    ),
    Case(
        "UNetControlNetXSModel",
        "UNetControlNetXSModel",
        "test_models_unet_controlnetxs",
        {
            "sample_size": 16,
            "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
            "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
            "block_out_channels": (4, 8),
            "cross_attention_dim": 8,
            "transformer_layers_per_block": 1,
            "num_attention_heads": 2,
            "norm_num_groups": 4,
            "upcast_attention": False,
            "ctrl_block_out_channels": [2, 4],
            "ctrl_num_attention_heads": 4,
            "ctrl_max_norm_num_groups": 2,
            "ctrl_conditioning_embedding_out_channels": (2, 2),
        },
        {
            "sample": R(4, 4, 16, 16),
            "timestep": V([10], dtype="int64"),
            "encoder_hidden_states": R(4, 4, 8),
            "controlnet_cond": R(4, 3, 32, 32),
            "conditioning_scale": 1,
        },
    ),
    Case(
        "UNetMotionModel",
        "UNetMotionModel",
        "test_models_unet_motion",
        {
            "block_out_channels": (16, 32),
            "norm_num_groups": 16,
            "down_block_types": ("CrossAttnDownBlockMotion", "DownBlockMotion"),
            "up_block_types": ("UpBlockMotion", "CrossAttnUpBlockMotion"),
            "cross_attention_dim": 16,
            "num_attention_heads": 2,
            "out_channels": 4,
            "in_channels": 4,
            "layers_per_block": 1,
            "sample_size": 16,
        },
        {"sample": R(4, 4, 4, 16, 16), "timestep": V([10], dtype="int64"), "encoder_hidden_states": R(16, 4, 16)},
    ),
    Case(
        "UNetSpatioTemporalConditionModel",
        "UNetSpatioTemporalConditionModel",
        "test_models_unet_spatiotemporal",
        {
            "block_out_channels": (32, 64),
            "down_block_types": ("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
            "up_block_types": ("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
            "cross_attention_dim": 32,
            "num_attention_heads": 8,
            "out_channels": 4,
            "in_channels": 4,
            "layers_per_block": 2,
            "sample_size": 32,
            "projection_class_embeddings_input_dim": 96,
            "addition_time_embed_dim": 32,
        },
        {
            "sample": R(2, 2, 4, 32, 32),
            "timestep": V([10], dtype="int64"),
            "encoder_hidden_states": R(2, 1, 32),
            "added_time_ids": R(2, 3),
        },
    ),
]

# transformers: causal LMs with configs of the size of their model testers (batch 13, 7 tokens, vocabulary 99); the
# testers' intermediate size 37 is 40 here (and the experts' 16): the grouped mm of the MoE experts on CPU needs strides
# that are multiples of 16 bytes ("strides should be multiple of 16 bytes" in the real step) ----------------------

_LM = {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4,
       "max_position_embeddings": 512}  # fmt: skip
_TOKENS = {"input_ids": I(0, 99, 13, 7), "attention_mask": F(1, 13, 7, dtype="int64")}

TRANSFORMERS = [
    Case("MixtralForCausalLM", "MixtralForCausalLM", "transformers MixtralConfig",
         {**_LM, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2}, _TOKENS, "MixtralConfig"),
    Case("OlmoeForCausalLM", "OlmoeForCausalLM", "transformers OlmoeConfig",
         {**_LM, "num_key_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2}, _TOKENS, "OlmoeConfig"),
    Case("Qwen2MoeForCausalLM", "Qwen2MoeForCausalLM", "transformers Qwen2MoeConfig",
         {**_LM, "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
          "shared_expert_intermediate_size": 36}, _TOKENS, "Qwen2MoeConfig"),
    Case("Qwen3MoeForCausalLM", "Qwen3MoeForCausalLM", "transformers Qwen3MoeConfig",
         {**_LM, "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
         _TOKENS, "Qwen3MoeConfig"),
    Case("LlamaForCausalLM", "LlamaForCausalLM", "transformers LlamaConfig",
         {**_LM, "num_key_value_heads": 2}, _TOKENS, "LlamaConfig"),
    Case("Qwen2ForCausalLM", "Qwen2ForCausalLM", "transformers Qwen2Config",
         {**_LM, "num_key_value_heads": 2}, _TOKENS, "Qwen2Config"),
    Case("GPT2LMHeadModel", "GPT2LMHeadModel", "transformers GPT2Config",
         {"vocab_size": 99, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_inner": 40, "n_positions": 512}, _TOKENS,
         "GPT2Config"),
]  # fmt: skip

CASES = DIFFUSERS + TRANSFORMERS

# the step -----------------------------------------------------------------------------------------------------------


def build(case: Case) -> torch.nn.Module:
    torch.manual_seed(0)
    if case.config is None:
        import diffusers

        return getattr(diffusers, case.cls)(**case.init)
    import transformers

    return getattr(transformers, case.cls)(getattr(transformers, case.config)(**case.init))


def first_tensor(output: Any) -> torch.Tensor | None:
    """The model's main output: the tensor itself, ``.sample``, a ModelOutput's first field, a tuple's first tensor."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(getattr(output, "sample", None), torch.Tensor):
        return output.sample
    values = output.values() if hasattr(output, "values") and callable(output.values) else output
    if isinstance(values, (list, tuple)) or hasattr(output, "values"):
        for value in values:
            if (found := first_tensor(value)) is not None:
                return found
    return None


class Step(pl.LightningModule):
    """A minimal LightningModule around one model: the loss is the mean square of its output."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.model = build(case)

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        output = first_tensor(self.model(**batch))
        if output is None:
            raise RuntimeError("the model returned no tensor")
        return output

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return self(batch).pow(2).mean()

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return self(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def batch_of(case: Case) -> dict[str, Any]:
    """A fresh batch: the same values every time (stateful inputs, such as a KV cache, start empty)."""
    return make(case.inputs, torch.Generator().manual_seed(0))


class Batches(Dataset):
    def __init__(self, case: Case, n: int) -> None:
        self.case, self.n = case, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return batch_of(self.case)


def _as_is(items: list[Any]) -> Any:
    return items[0]


class LastBatch(PeakMemory):
    """``PeakMemory`` on the last training batch only: the first runs at full speed, unprobed."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch = batch

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.batch:
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)


def real_peak(case: Case, stage: str) -> int:
    """The real step's peak in bytes, exactly, from ``PeakMemory`` in a Trainer (fit: the second batch)."""
    n = 2 if stage == "fit" else 1
    probe = LastBatch(n - 1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_train_batches=n, limit_predict_batches=n,
        callbacks=[probe],
    )  # fmt: skip
    loader = DataLoader(Batches(case, n), batch_size=1, collate_fn=_as_is)
    module = Step(case)
    if stage == "fit":
        trainer.fit(module, train_dataloaders=loader)
    else:
        trainer.predict(module, dataloaders=loader)
    return probe.peaks[-1]


@dataclass
class Row:
    label: str
    cls: str
    stage: str
    dry: int | None = None
    real: int | None = None
    note: str = ""
    placeholders: str = ""
    error: str = ""  # the real step (or building the model) failed: the case says nothing of the dry run
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def diff(self) -> float | None:
        if self.dry is None or not self.real:
            return None
        return 100.0 * (self.dry - self.real) / self.real


def _short(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}"[:200]


def run_case(case: Case, stage: str) -> Row:
    row = Row(case.label, case.cls, stage)
    started = time.perf_counter()
    try:
        module = Step(case)
    except Exception as error:
        row.error = f"building the model: {_short(error)}"
        return row
    try:
        result = estimate(module, batch_of(case), stage=stage)
        row.dry, row.notes = result.plain.bytes, list(result.notes)
        for note in result.notes:
            if note.startswith(PLACEHOLDERS):
                found = re.search(r"\((.*?)\): zeros", note)
                row.placeholders = found.group(1) if found else note
            elif note.startswith("the dry run"):
                row.note = note
    except Exception as error:
        row.note = f"estimate raised {_short(error)}"
        row.notes = [traceback.format_exc()]
    try:
        row.real = real_peak(case, stage)
    except Exception as error:
        row.error = f"the real step: {_short(error)}"
    row.seconds = time.perf_counter() - started
    return row


# the report ---------------------------------------------------------------------------------------------------------


def _bytes(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def totals(rows: list[Row]) -> list[str]:
    lines = []
    for stage in ("fit", "predict"):
        valid = [r for r in rows if r.stage == stage and not r.error]
        known = [r for r in valid if r.dry is not None]
        exact = [r for r in known if r.dry == r.real]
        close = [r for r in known if abs(r.diff) <= 1.0]
        placed = [r for r in known if r.placeholders]
        share = f"{100 * len(known) / len(valid):.1f}%" if valid else "-"
        lines.append(f"| {stage} | {len(known)}/{len(valid)} ({share}) | {len(exact)} | {len(close)} | {len(placed)} |")
    return lines


def markdown(rows: list[Row], seconds: float, argv: list[str], jobs: int) -> str:
    import diffusers
    import transformers

    classes = {r.cls for r in rows if not r.error}
    out = [
        "# Dry-run coverage on diffusers' and transformers' own test configs",
        "",
        f"`python benchmarks/coverage.py {' '.join(argv)}`: {len({r.label for r in rows})} cases, {len(classes)} model"
        f" classes; torch {torch.__version__}, diffusers {diffusers.__version__}, transformers"
        f" {transformers.__version__}; CPU, {jobs} worker processes; {seconds:.0f} s.",
        "",
        "The baseline is `estimate(...).plain.bytes` (the step as the model is); the real peak is `PeakMemory` in a",
        "Trainer (fit: the second batch, AdamW state and the first step's gradients alive; predict: the first batch).",
        "Difference: (dry run - real) / real. *Placeholders*: values read out of fake tensors that the dry run",
        "answered with placeholders (zeros, data-dependent shapes at their upper bound).",
        "",
        "## Totals",
        "",
        "| stage | baseline known | exact (0%) | within 1% | known with placeholders |",
        "|---|---|---|---|---|",
        *totals(rows),
    ]
    failed = [r for r in rows if r.error]
    if failed:
        out += ["", "Cases left out of the totals (the real step itself fails in this environment):", ""]
        out += [f"- {r.label}, {r.stage}: {_cell(r.error)}" for r in failed]
    unknown = [r for r in rows if not r.error and r.dry is None]
    out += ["", "## Baseline unknown", ""]
    out += [f"- {r.label}, {r.stage}: {_cell(r.note)}" for r in unknown] or ["None."]
    off = [r for r in rows if not r.error and r.dry is not None and abs(r.diff) > 1.0]
    out += ["", "## More than 1% from the real peak", ""]
    out += [
        f"- {r.label}, {r.stage}: dry run {_bytes(r.dry)} B, real {_bytes(r.real)} B ({r.diff:+.2f}%)"
        + (f"; placeholders {r.placeholders}" if r.placeholders else "")
        for r in off
    ] or ["None."]
    out += [
        "",
        "## Every case",
        "",
        "| class (config) | stage | baseline known | dry run (bytes) | real (bytes) | difference | placeholders"
        " | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        known = "-" if r.error else ("yes" if r.dry is not None else "**no**")
        diff = "-" if r.diff is None else ("0 (exact)" if r.dry == r.real else f"{r.diff:+.3f}%")
        note = r.error and f"left out: {r.error}" or r.note
        out.append(
            f"| {r.label} | {r.stage} | {known} | {_bytes(r.dry)} | {_bytes(r.real)} | {diff} |"
            f" {_cell(r.placeholders)} | {_cell(note)} |"
        )
    return "\n".join(out) + "\n"


def run_both(index: int, stages: list[str], threads: int) -> list[Row]:
    """Both stages of one case, in a worker process, its prints swallowed."""
    torch.set_num_threads(threads)
    quiet()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return [run_case(CASES[index], stage) for stage in stages]


def quiet() -> None:
    warnings.simplefilter("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "diffusers", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)  # meta failures the note reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the Markdown report here")
    parser.add_argument("--only", nargs="*", default=None, help="run the cases whose label contains one of these")
    parser.add_argument("--stages", nargs="*", default=["fit", "predict"])
    parser.add_argument("--jobs", type=int, default=2, help="worker processes, one case each at a time")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    args = parser.parse_args(argv)
    quiet()
    chosen = [i for i, c in enumerate(CASES) if not args.only or any(o.lower() in c.label.lower() for o in args.only)]
    started, done = time.perf_counter(), {}
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        futures = {pool.submit(run_both, i, args.stages, args.threads): i for i in chosen}
        for future in as_completed(futures):
            done[futures[future]] = future.result()
            for row in done[futures[future]]:
                known = "known" if row.dry is not None else "UNKNOWN"
                diff = "" if row.diff is None else f" {row.diff:+.3f}%"
                print(
                    f"{row.seconds:6.1f}s {row.label:60s} {row.stage:8s} {known:8s} dry={_bytes(row.dry)} real="
                    f"{_bytes(row.real)}{diff} {row.placeholders} {row.note} {row.error}",
                    flush=True,
                )
    rows = [row for i in chosen for row in done[i]]
    seconds = time.perf_counter() - started
    report = markdown(rows, seconds, sys.argv[1:] if argv is None else argv, args.jobs)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    print("\n".join(totals(rows)))
    print(f"{seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
