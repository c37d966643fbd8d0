"""Will it fit? Real-scale models estimated on a laptop: nothing of their size is allocated.

The models are built on the meta device from the published configurations (no weights, no download), and
``lightning_memopt.estimate`` dry-runs their LightningModule's own step on fake tensors:

- the Latte-1 video transformer (28 layers, 16 heads x 72, patch 2) denoising 16 frames at 512x512, batch 2 for
  classifier-free guidance, followed by an SD-class ``AutoencoderKL`` decoding the 16 frames; and the transformer
  alone;
- an SD-1.5-size ``UNet2DConditionModel`` sampling 16 images at 64x64 latents (one denoising step, batch 32 with
  classifier-free guidance), followed by the same VAE decoding them at 512x512;
- a Llama-3-8B-shaped causal language model (vocabulary 128,256) fine-tuned with LoRA r=16 on q/k/v/o, bf16 weights,
  AdamW, on one sequence of 4,096 and of 16,384 tokens (``model(input_ids=ids, labels=ids).loss``): plain, and with
  ``MemOpt()``, which checkpoints every block, computes the loss in chunks and chunks the feed-forward where that
  lowers the peak;
- full fine-tunes, every parameter trained with AdamW: the SD-1.5-size UNet (860 M parameters) at 64x64 latents, batch 1
  and 4, fp32; SDXL's UNet (2.57 B parameters, stabilityai/stable-diffusion-xl-base-1.0's config) at 1024x1024 (128x128
  latents), batch 1, fp32, with its pooled text embedding and size and crop ids (``added_cond_kwargs``); and a
  Llama-3.2-1B-shaped language model (1.24 B parameters, tied embedding) in bf16 on one sequence of 4,096 tokens. MemOpt
  frees the gradients right after the optimizer step (``free_gradients``, on by default) and, under a budget where the
  planner predicts it the fastest way to meet it, steps the optimizer inside the backward pass
  (``optimizer_in_backward="auto"``), so that the gradients never exist at once: the floor is then the weights and
  AdamW's two moments (three times the weights), with the activations. Each full fine-tune is also estimated where
  results may change (``lossy=True``): under the same budgets, where MemOpt keeps AdamW's moments in 8 bits between
  steps (``optimizer_state_8bit="auto"``) only where no setting that keeps results is predicted faster, and without a
  budget with ``MemOpt(optimizer_state_8bit=True, optimizer_in_backward=True, lossy=True)``: the floor with the moments
  in 8 bits (about a quarter of their bytes) and the optimizer step in the backward pass.

The sampling pipelines, Latte-1's transformer alone and the Llama-3-8B LoRA fine-tune are also estimated where results
may change, without a budget, with ``MemOpt(weights_8bit=True, lossy=True)``: their frozen Linear and convolution
weights kept in 8 bits (blockwise codes, about a quarter of fp32's bytes and half of bf16's), each layer computing in
its own type one layer at a time. These rows have the same title as their exact row, and ``lossy`` says which they are.

The sampling pipelines and the full fine-tunes are estimated without a budget (plain and ``MemOpt()``) and under
budgets of 24, 16 and 12 GiB (SDXL's under 24 GiB only: its weights and AdamW's state are over all three). Each row
gives the peak plain and with MemOpt's choice, which part of the model holds each peak, and what holds MemOpt's peak
by kind: weights, gradients, optimizer state, activations, and the batch with the rest. The full fine-tunes have their
own table, after the first: it also says what held the plain peak, whether the budget is met and what each technique
saved (``Estimate.saved_by``, as the planner models it), and whether the row is lossy. All fp32 but the language
models (bf16), CPU-exact bytes; on a GPU add the allocator's rounding and cache.

    python examples/estimate_real_scale.py                          # the tables (about 44 minutes on 2 CPU cores)
    python examples/estimate_real_scale.py --markdown results.md    # and write them as markdown
    python examples/estimate_real_scale.py --json results.json      # and every figure as JSON (for plots)
    python examples/estimate_real_scale.py --quick                  # tiny configs (budgets scaled down), a few minutes
    python examples/estimate_real_scale.py --only "batch 1,"        # only the cases whose title holds this text
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import transformers
from diffusers import AutoencoderKL, LatteTransformer3DModel, UNet2DConditionModel
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_memopt import Estimate, estimate
from lightning_memopt.units import fmt_bytes, fmt_parts

warnings.filterwarnings("ignore", ".*does not have many workers.*")

#: The Latte-1 transformer's configuration (maxin-cn/Latte-1, transformer/config.json).
LATTE_1 = dict(
    activation_fn="gelu-approximate",
    attention_bias=True,
    attention_head_dim=72,
    caption_channels=4096,
    cross_attention_dim=1152,
    in_channels=4,
    norm_elementwise_affine=False,
    norm_eps=1e-6,
    norm_type="ada_norm_single",
    num_attention_heads=16,
    num_embeds_ada_norm=1000,
    num_layers=28,
    out_channels=8,
    patch_size=2,
    sample_size=64,
    video_length=16,
)
#: The Stable Diffusion VAE (4 levels, 128 to 512 channels), as Latte-1 uses it.
SD_VAE = dict(
    block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    layers_per_block=2,
    latent_channels=4,
    sample_size=512,
)
#: The SD-1.5 UNet: diffusers' defaults with 768-wide text embeddings.
SD_15_UNET = dict(sample_size=64, cross_attention_dim=768)
#: SDXL's UNet (stabilityai/stable-diffusion-xl-base-1.0, unet/config.json): 2.57 B parameters.
SDXL_UNET = dict(
    sample_size=128,
    block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 2, 10),
    attention_head_dim=(5, 10, 20),
    cross_attention_dim=2048,
    addition_embed_type="text_time",
    addition_embed_type_num_heads=64,
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,  # the pooled text embedding (1280) and 6 time ids x 256
    use_linear_projection=True,
)
#: Llama-3.2-1B's shape (meta-llama/Llama-3.2-1B, config.json): 1.24 B parameters, the embedding tied to the head.
LLAMA_32_1B = dict(
    vocab_size=128_256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131_072,
    rope_theta=500_000.0,
    rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
    tie_word_embeddings=True,
)  # fmt: skip
#: Llama-3-8B's shape (meta-llama/Meta-Llama-3-8B, config.json).
LLAMA_3_8B = dict(
    vocab_size=128_256,
    hidden_size=4096,
    intermediate_size=14_336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=16_384,
    rope_theta=500_000.0,
)
#: Small stand-ins for --quick.
QUICK = {
    "llama": dict(LLAMA_3_8B, vocab_size=8192, hidden_size=64, intermediate_size=224, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2),
    "latte": dict(LATTE_1, num_layers=2, attention_head_dim=8, num_attention_heads=2, caption_channels=16,
                  cross_attention_dim=16, sample_size=8, video_length=2),
    "vae": dict(SD_VAE, block_out_channels=(8, 8, 16, 16), norm_num_groups=4, sample_size=64),
    "unet": dict(sample_size=8, block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16, norm_num_groups=8,
                 layers_per_block=1),
    "sdxl": dict(SDXL_UNET, sample_size=8, block_out_channels=(32, 64, 64), transformer_layers_per_block=(1, 1, 2),
                 attention_head_dim=(2, 4, 4), cross_attention_dim=16, addition_time_embed_dim=8,
                 projection_class_embeddings_input_dim=16 + 6 * 8, norm_num_groups=8, layers_per_block=1),
    "llama_1b": dict(LLAMA_32_1B, vocab_size=8192, hidden_size=64, intermediate_size=224, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}  # fmt: skip


class LatteSampler(pl.LightningModule):
    """One denoising step of Latte with classifier-free guidance, optionally followed by the VAE decode of the video."""

    def __init__(self, transformer: dict, vae: dict | None) -> None:
        super().__init__()
        self.transformer = LatteTransformer3DModel(**transformer)
        self.vae = AutoencoderKL(**vae) if vae is not None else None

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        latents, captions = batch  # (1, 4, frames, h, w) and (2, tokens, channels): unconditional, conditional
        timestep = torch.full((2,), 500, dtype=torch.long)
        out = self.transformer(torch.cat([latents, latents]), timestep=timestep, encoder_hidden_states=captions).sample
        uncond, cond = out[:, :4].chunk(2)
        latents = latents - 0.1 * (uncond + 7.5 * (cond - uncond))
        if self.vae is None:
            return latents
        frames = latents[0].permute(1, 0, 2, 3)  # the frames as a batch of images
        return self.vae.decode(frames / self.vae.config.scaling_factor).sample


class UNetSampler(pl.LightningModule):
    """One denoising step of Stable Diffusion with classifier-free guidance, then the VAE decode of the images."""

    def __init__(self, unet: dict, vae: dict) -> None:
        super().__init__()
        self.unet, self.vae = UNet2DConditionModel(**unet), AutoencoderKL(**vae)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        latents, text = batch  # (n, 4, h, w) and (2n, tokens, channels): unconditional, conditional
        both = torch.cat([latents, latents])
        uncond, cond = self.unet(both, torch.full((len(both),), 500), encoder_hidden_states=text).sample.chunk(2)
        latents = latents - 0.1 * (uncond + 7.5 * (cond - uncond))
        return self.vae.decode(latents / self.vae.config.scaling_factor).sample


class UNetTrainer(pl.LightningModule):
    """Noise prediction on latents, as in Stable Diffusion training: every parameter of the UNet trained with AdamW.
    SDXL's batch also holds its pooled text embedding and its 6 size and crop ids (``added_cond_kwargs``)."""

    def __init__(self, unet: dict) -> None:
        super().__init__()
        self.unet = UNet2DConditionModel(**unet)

    def training_step(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        latents, text, *added = batch
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, 1000, (len(latents),))
        extra = {"added_cond_kwargs": dict(zip(("text_embeds", "time_ids"), added, strict=True))} if added else {}
        pred = self.unet(latents + noise, timesteps, encoder_hidden_states=text, **extra).sample
        return nn.functional.mse_loss(pred, noise)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.unet.parameters(), lr=1e-5)


class LlamaLoRA(pl.LightningModule):
    """Causal language modelling with LoRA (r=16) on the attention projections; the base model frozen, in bf16."""

    def __init__(self, llama: dict) -> None:
        super().__init__()
        lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        base = LlamaForCausalLM(LlamaConfig(**llama, use_cache=False)).to(torch.bfloat16)
        self.model = get_peft_model(base, lora)  # the adapters in float32, as PEFT makes them

    def training_step(self, batch: tuple[torch.Tensor]) -> torch.Tensor:
        ids = batch[0]
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)


class LlamaFull(pl.LightningModule):
    """Causal language modelling, every parameter trained with AdamW, weights (so gradients and AdamW's state) in
    bf16."""

    def __init__(self, llama: dict) -> None:
        super().__init__()
        self.model = LlamaForCausalLM(LlamaConfig(**llama, use_cache=False)).to(torch.bfloat16)

    def training_step(self, batch: tuple[torch.Tensor]) -> torch.Tensor:
        ids = batch[0]
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-5)


#: The budgets the sampling pipelines and full fine-tunes are estimated under (--quick: fractions of the plain peak).
BUDGETS = {"24 GiB": 24 * 2**30, "16 GiB": 16 * 2**30, "12 GiB": 12 * 2**30}
QUICK_BUDGETS = {"0.9 x plain": 0.9, "0.6 x plain": 0.6, "0.4 x plain": 0.4}
#: --quick estimates the full fine-tunes under one budget only: their planner's dry runs take seconds even when tiny.
QUICK_FINETUNE_BUDGETS = {"0.9 x plain": 0.9}
#: SDXL's full fine-tune under the first budget only: its weights and AdamW's state alone (28.7 GiB) are over all three,
#: and each of its estimates under a budget takes over two minutes of dry runs on 2 CPU cores (all three: 19 minutes).
SDXL_BUDGETS = dict(list(BUDGETS.items())[:1])
#: The full fine-tunes' lossy rows: under each budget (--quick: none) with ``lossy=True``, and without a budget with the
#: moments in 8 bits and the optimizer step in the backward pass put in force (the floor where results may change).
LOSSY = {"lossy": True}
LOSSY_FLOOR = {"optimizer_state_8bit": True, "optimizer_in_backward": True, "lossy": True}
#: The lossy twin of each sampling pipeline, of Latte-1's transformer alone and of the LoRA fine-tunes, without a
#: budget: the frozen Linear and convolution weights in 8 bits.
WEIGHTS_8BIT = {"weights_8bit": True, "lossy": True}

Case = tuple[str, pl.LightningModule, tuple[torch.Tensor, ...], str, dict]


def twin(case: Case) -> Case:
    """The case with its frozen Linear and convolution weights in 8 bits (:data:`WEIGHTS_8BIT`), under its title."""
    return (*case[:4], {**case[4], **WEIGHTS_8BIT})


def unet_batch(unet: dict, size: int = 1) -> tuple[torch.Tensor, ...]:
    """A :class:`UNetTrainer` batch on the meta device: latents and text embeddings, and for SDXL (a config with
    ``addition_time_embed_dim``) its pooled text embedding and its 6 size and crop ids."""
    side, text = unet["sample_size"], unet["cross_attention_dim"]
    batch = (torch.empty(size, 4, side, side, device="meta"), torch.empty(size, 77, text, device="meta"))
    if "addition_time_embed_dim" not in unet:
        return batch
    pooled = unet["projection_class_embeddings_input_dim"] - 6 * unet["addition_time_embed_dim"]
    return (*batch, torch.empty(size, pooled, device="meta"), torch.empty(size, 6, device="meta"))


def cases(quick: bool) -> tuple[list[Case], list[Case], list[tuple[Case, dict[str, float] | None]]]:
    """(title, module on the meta device, batch on the meta device, stage, MemOpt arguments): the sampling pipelines,
    each estimated under every budget, the other rows (among them the 8-bit weights' twins of the pipelines, of
    Latte-1's transformer alone and of the LoRA fine-tunes), and the full fine-tunes with their budgets (``None``: every
    budget)."""
    latte, vae, unet = (QUICK[k] for k in ("latte", "vae", "unet")) if quick else (LATTE_1, SD_VAE, SD_15_UNET)
    llama = QUICK["llama"] if quick else LLAMA_3_8B
    sdxl, llama_1b = (QUICK["sdxl"], QUICK["llama_1b"]) if quick else (SDXL_UNET, LLAMA_32_1B)
    frames, side = latte["video_length"], latte["sample_size"]
    video = (
        torch.empty(1, 4, frames, side, side, device="meta"),
        torch.empty(2, 120, latte["caption_channels"], device="meta"),
    )
    text = unet["cross_attention_dim"]
    images = 16 if not quick else 2
    shape = (images, 4, unet["sample_size"], unet["sample_size"])
    sd_batch = (torch.empty(*shape, device="meta"), torch.empty(2 * images, 77, text, device="meta"))
    with torch.device("meta"):
        transformer_only, latte_pipeline = LatteSampler(latte, None), LatteSampler(latte, vae)
        sd_pipeline, trainer, lora = UNetSampler(unet, vae), UNetTrainer(unet), LlamaLoRA(llama)
        sdxl_trainer, full_llama = UNetTrainer(sdxl), LlamaFull(llama_1b)
    pipelines = [
        (f"Latte-1 + VAE decode, {frames} frames", latte_pipeline, video, "predict", {}),
        (f"SD-1.5 UNet + VAE decode, {images} images", sd_pipeline, sd_batch, "predict", {}),
    ]
    alone = ("Latte-1 transformer alone, one step", transformer_only, video, "predict", {})
    others = [
        *(twin(case) for case in pipelines),
        alone,
        twin(alone),
        ("Latte-1 transformer alone, every feed-forward chunked to 1", transformer_only, video, "predict",
         {"chunk_size": 1}),
    ]  # fmt: skip
    name = "tiny Llama" if quick else "Llama-3-8B"
    for tokens in (4096, 16_384) if not quick else (512, 2048):
        ids = (torch.zeros(1, tokens, dtype=torch.long, device="meta"),)
        lora_case = (f"{name} + LoRA r=16, bf16, {tokens:,} tokens", lora, ids, "fit", {})
        others += [lora_case, twin(lora_case)]
    finetunes = []
    side = unet["sample_size"]
    for batch_size in (1, 4):
        title = f"SD-1.5 UNet, AdamW, fp32, batch {batch_size}, {side}x{side} latents"
        finetunes.append(((title, trainer, unet_batch(unet, batch_size), "fit", {}), None))
    side = sdxl["sample_size"]
    title = f"SDXL UNet, AdamW, fp32, batch 1, {side}x{side} latents"
    finetunes.append(((title, sdxl_trainer, unet_batch(sdxl), "fit", {}), None if quick else SDXL_BUDGETS))
    tokens = 4096 if not quick else 512
    ids = (torch.zeros(1, tokens, dtype=torch.long, device="meta"),)
    name = "tiny Llama" if quick else "Llama-3.2-1B"
    finetunes.append(((f"{name}, AdamW, bf16, {tokens:,} tokens", full_llama, ids, "fit", {}), None))
    return pipelines, others, finetunes


#: A row of a table: (title, stage, budget label, estimate, MemOpt arguments).
Row = tuple[str, str, str, Estimate, dict]
KINDS = ("weights", "gradients", "optimizer", "activations")


def _met(e: Estimate) -> str:
    return "-" if e.budget_bytes is None else ("yes" if e.fits(e.budget_bytes) else "**no**")


def _rest(e: Estimate) -> int:
    return e.memopt.by_kind.get("batch", 0) + e.memopt.by_kind.get("other", 0)


def _lossy(options: dict) -> str:
    """Whether the row may change results, and which lossy techniques it puts in force (rather than "auto")."""
    if not options.get("lossy"):
        return "no"
    names = ("optimizer_state_8bit", "optimizer_in_backward", "weights_8bit")
    forced = [f"{name}=True" for name in names if options.get(name) is True]
    return f"**yes**, {', '.join(forced)}" if forced else "**yes**"


#: Every column either table has: name -> (heading, alignment, cell). The by-kind cells are what holds MemOpt's peak.
COLUMNS: dict[str, tuple[str, str, Callable[[Row], str]]] = {
    "title": ("model and step", "---", lambda r: r[0]),
    "stage": ("stage", "---", lambda r: r[1]),
    "budget": ("budget", "---", lambda r: r[2]),
    "lossy": ("lossy", "---", lambda r: _lossy(r[4])),
    "plain": ("plain peak", "---:", lambda r: fmt_bytes(r[3].plain.bytes)),
    "plain where": ("where", "---", lambda r: r[3].plain.where),
    "plain held": ("held at the plain peak", "---", lambda r: fmt_parts(r[3].plain.by_kind)),
    "memopt": ("with MemOpt", "---:", lambda r: fmt_bytes(r[3].memopt.bytes)),
    "met": ("budget met", "---", lambda r: _met(r[3])),
    "memopt where": ("where", "---", lambda r: r[3].memopt.where),
    "how": ("MemOpt did", "---", lambda r: r[3].how),
    **{kind: (kind, "---:", lambda r, kind=kind: fmt_bytes(r[3].memopt.by_kind.get(kind, 0))) for kind in KINDS},
    "rest": ("batch, other", "---:", lambda r: fmt_bytes(_rest(r[3]))),
    "saved by": ("saved by", "---", lambda r: ", ".join(f"{k} {fmt_bytes(n)}" for k, n in r[3].saved_by.items())),
    "seconds": ("dry runs", "---:", lambda r: f"{r[3].seconds:.1f} s"),
}  # fmt: skip
#: The first table's columns (with whether the row is lossy), and the full fine-tunes': also what held the plain peak,
#: whether the budget is met and what each technique saved.
MAIN_COLUMNS = ("title", "stage", "budget", "lossy", "plain", "plain where", "memopt", "memopt where", "how", *KINDS,
                "rest", "seconds")  # fmt: skip
FINETUNE_COLUMNS = ("title", "budget", "lossy", "plain", "plain held", "memopt", "met", "memopt where", "how", *KINDS,
                    "rest", "saved by", "seconds")  # fmt: skip


def table(results: list[Row], columns: tuple[str, ...]) -> list[str]:
    """The rows as a markdown table of ``columns`` (names in :data:`COLUMNS`)."""
    specs = [COLUMNS[name] for name in columns]
    lines = ["| " + " | ".join(h for h, _, _ in specs) + " |", "|" + "|".join(a for _, a, _ in specs) + "|"]
    lines += ["| " + " | ".join(cell(row) or "-" for _, _, cell in specs) + " |" for row in results]
    return lines


def run(title: str, module: pl.LightningModule, batch: Any, stage: str, memopt: dict) -> Estimate:
    result = estimate(module, batch, stage, **memopt)
    print(f"\n{title}\n{result}", flush=True)
    if result.plain.bytes is None or result.memopt.bytes is None:
        raise SystemExit(f"check failed: {title} could not be estimated: {result.notes}")
    budget = memopt.get("memory_budget")
    if budget is not None and result.memopt.bytes > budget and result.plain.bytes > budget:
        print(f"note: {title}: the budget is not met ({fmt_bytes(result.memopt.bytes)})")
    return result


def budgeted(case: Case, budgets: dict[str, float], unbudgeted: dict | None = None) -> list[Row]:
    """One case without a budget (plain and ``MemOpt(**unbudgeted)``, by default the case's own MemOpt arguments),
    then under each budget (bytes, or a fraction of the plain peak) with the case's arguments."""
    title, module, batch, stage, memopt = case
    first = memopt if unbudgeted is None else unbudgeted
    plain = run(title, module, batch, stage, first)
    out = [(title, stage, "none", plain, first)]
    for label, budget in budgets.items():
        value = int(budget * plain.plain.bytes) if isinstance(budget, float) else budget
        option = {**memopt, "memory_budget": value}
        out.append((title, stage, label, run(title, module, batch, stage, option), option))
    return out


def as_json(results: list[tuple[str, str, str, Estimate, dict, str]], quick: bool, seconds: float) -> dict:
    """Every figure of every row, as plain values (``Estimate.as_dict()`` with the row's title, budget label, MemOpt
    arguments and table: ``main`` or ``full fine-tune``), and how long the whole run took where."""
    import diffusers

    return {
        "quick": quick,
        "seconds": round(seconds, 1),
        "versions": {
            "torch": torch.__version__,
            "lightning": pl.__version__,
            "diffusers": diffusers.__version__,
            "transformers": transformers.__version__,
        },
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "rows": [
            {"title": title, "budget": budget, "options": option, "table": table, **e.as_dict()}
            for title, _, budget, e, option, table in results
        ],
    }


#: The heading of the full fine-tunes' table, in the printout and the markdown.
FINETUNE_HEADING = (
    "**Full fine-tunes**: every parameter trained with AdamW; MemOpt frees the gradients after the optimizer step and,"
    " where a budget is missed without it, steps the optimizer inside the backward pass; the lossy rows"
    " (`lossy=True`) may also keep AdamW's moments in 8 bits, where a budget is missed with everything exact"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny configs: a few minutes")
    parser.add_argument("--markdown", type=Path, help="also write the tables here")
    parser.add_argument("--json", type=Path, help="also write every figure here, as JSON (for plot_real_scale.py)")
    parser.add_argument("--only", metavar="TEXT", help="only the cases whose title holds TEXT (case-insensitive)")
    args = parser.parse_args()
    started = time.perf_counter()
    pipelines, others, finetunes = cases(args.quick)
    if args.only:

        def chosen(case: Case) -> bool:
            return args.only.lower() in case[0].lower()

        pipelines, others = [c for c in pipelines if chosen(c)], [c for c in others if chosen(c)]
        finetunes = [(c, own) for c, own in finetunes if chosen(c)]
        if not pipelines + others + finetunes:
            raise SystemExit(f"no case's title holds {args.only!r}")
    budgets = QUICK_BUDGETS if args.quick else BUDGETS
    results = [(*row, "main") for case in pipelines for row in budgeted(case, budgets)]
    for title, module, batch, stage, memopt in others:
        results.append((title, stage, "none", run(title, module, batch, stage, memopt), memopt, "main"))
    for case, own in finetunes:
        case_started = time.perf_counter()
        every = own if own is not None else QUICK_FINETUNE_BUDGETS if args.quick else budgets
        lossy = (*case[:4], {**case[4], **LOSSY})
        floor = {**case[4], **LOSSY_FLOOR}
        done = budgeted(case, every) + budgeted(lossy, {} if args.quick else every, unbudgeted=floor)
        results += [(*row, "full fine-tune") for row in done]
        print(f"\n{case[0]}: estimated without and under each budget, exact and lossy, in"
              f" {time.perf_counter() - case_started:.0f} s")  # fmt: skip
    seconds = time.perf_counter() - started
    main_table = table([r[:5] for r in results if r[5] == "main"], MAIN_COLUMNS)
    finetune_table = table([r[:5] for r in results if r[5] == "full fine-tune"], FINETUNE_COLUMNS)
    text = "\n".join(main_table) + "\n\n" + FINETUNE_HEADING + "\n\n" + "\n".join(finetune_table)
    print("\n" + text)
    print(f"\nestimated in {seconds:.0f} s, nothing of the models' size allocated")
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps(as_json(results, args.quick, seconds), indent=2) + "\n")


if __name__ == "__main__":
    main()
