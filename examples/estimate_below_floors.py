"""Below the exact floors: real-scale fine-tunes estimated for a CUDA GPU from a CPU-only machine, each under a budget.

Each model is built on the meta device from its published configuration (no weights, no download), and
``lightning_memopt.estimate(..., device="cuda", memory_budget=...)`` dry-runs its LightningModule's own step on fake
tensors that stand in for the GPU's; the planner chooses every setting, among them those an accelerator allows: the
optimizer's state in host memory (``optimizer_in_backward="host"``), each checkpointed block's input in host memory
(the checkpoint mode ``"offload"``, weighed with ``checkpointing="auto"``) and, with ``lossy=True``, the frozen
weights in 4 bits (NF4). The rows are those of docs/results.md, "Below the exact floors":

- SD-1.5's and SDXL's UNet, full fine-tunes in fp32 with AdamW, batch 1 at 64x64 and 128x128 latents, exact;
- Llama-3-8B with LoRA r=16 on q/k/v/o, bf16 base, at 4,096, 32,768 and 131,072 tokens, with ``lossy=True``;
- a FLUX.1-dev-shaped transformer (19 double and 38 single blocks) with LoRA r=16 on its attention projections, bf16
  base, one flow-matching step at 1024x1024 (4,096 image and 512 text tokens), with ``lossy=True``.

Each row says the peak on the device, whether the budget is met, what is kept on the host, and how long the dry runs
took. The Llama row at 131,072 tokens takes 25 to 50 minutes on 2 CPU cores; ``--only TEXT`` picks rows, ``--quick``
runs tiny stand-ins of every row without a budget in a minute or two (it checks the script, not the figures).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from estimate_real_scale import (  # noqa: E402
    LLAMA_3_8B,
    QUICK,
    SD_15_UNET,
    SDXL_UNET,
    LlamaLoRA,
    UNetTrainer,
    unet_batch,
)

from lightning_memopt import estimate  # noqa: E402
from lightning_memopt.units import fmt_bytes  # noqa: E402

#: FLUX.1-dev's transformer (black-forest-labs/FLUX.1-dev, transformer/config.json), and a tiny stand-in for --quick.
FLUX_1_DEV = dict(in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
                  joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True)  # fmt: skip
FLUX_TINY = dict(FLUX_1_DEV, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                 axes_dims_rope=(4, 6, 6), joint_attention_dim=32, pooled_projection_dim=16)  # fmt: skip


class FluxLoRA(pl.LightningModule):
    """One flow-matching step of a FLUX-shaped transformer with LoRA r=16 on its attention projections, the base in
    bf16, on packed latents and precomputed text embeddings (as diffusers' QLoRA recipe caches them)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        from diffusers import FluxTransformer2DModel
        from peft import LoraConfig, get_peft_model

        base = FluxTransformer2DModel(**config).to(torch.bfloat16)
        lora = LoraConfig(r=16, lora_alpha=16, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
        self.transformer = get_peft_model(base, lora)

    def training_step(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        latents, text, pooled, image_ids, text_ids = batch
        noise = torch.randn_like(latents)
        t = torch.rand(len(latents), device=latents.device, dtype=latents.dtype)
        noisy = (1 - t[:, None, None]) * latents + t[:, None, None] * noise
        pred = self.transformer(
            hidden_states=noisy, encoder_hidden_states=text, pooled_projections=pooled, timestep=t,
            img_ids=image_ids, txt_ids=text_ids, guidance=torch.full_like(t, 3.5),
        ).sample  # fmt: skip
        return nn.functional.mse_loss(pred.float(), (noise - latents).float())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def rows(quick: bool) -> list[tuple[str, Callable[[], tuple[Any, tuple, dict]]]]:
    """(title, what builds its module and batch on the meta device and estimate's options) for every row; ``quick``:
    tiny stand-ins, without a budget. A row is built only when estimated."""
    lossy = {"lossy": True, "checkpointing": "auto"}
    found: list[tuple[str, Callable[[], tuple[Any, tuple, dict]]]] = []

    def unet_row(unet: dict, budget: str) -> tuple[Any, tuple, dict]:
        with torch.device("meta"):
            return UNetTrainer(unet), unet_batch(unet), {"memory_budget": budget}

    def llama_row(tokens: int, budget: str) -> tuple[Any, tuple, dict]:
        config = dict(QUICK["llama"] if quick else LLAMA_3_8B)
        config["max_position_embeddings"] = max(tokens, config["max_position_embeddings"])
        with torch.device("meta"):
            module = LlamaLoRA(config)
        return module, (meta(1, tokens, dtype=torch.long),), {"memory_budget": budget, **lossy}

    def flux_row() -> tuple[Any, tuple, dict]:
        side = 8 if quick else 64  # packed latents: 1024 / 8 (the VAE) / 2 (2x2 patches)
        config = FLUX_TINY if quick else FLUX_1_DEV
        bf16 = torch.bfloat16
        batch = (meta(1, side * side, 64, dtype=bf16), meta(1, 512, config["joint_attention_dim"], dtype=bf16),
                 meta(1, config["pooled_projection_dim"], dtype=bf16), meta(side * side, 3), meta(512, 3))  # fmt: skip
        with torch.device("meta"):
            flux = FluxLoRA(config)
        return flux, batch, {"memory_budget": "10GiB", **lossy}

    for title, unet, stand_in, budget in (
        ("SD-1.5 UNet, full fine-tune, fp32 AdamW, batch 1, 64x64 latents", SD_15_UNET, "unet", "5GiB"),
        ("SDXL UNet, full fine-tune, fp32 AdamW, batch 1, 128x128 latents", SDXL_UNET, "sdxl", "12GiB"),
    ):
        found.append((title, functools.partial(unet_row, QUICK[stand_in] if quick else unet, budget)))
    for tokens, budget in ((4096, "6.5GiB"), (32_768, "8GiB"), (131_072, "24GiB")):
        tokens = tokens // 512 if quick else tokens
        title = f"Llama-3-8B + LoRA r=16 (q, k, v, o), bf16 base, {tokens:,} tokens"
        found.append((title, functools.partial(llama_row, tokens, budget)))
    found.append(("FLUX.1-dev-shaped transformer + LoRA r=16, bf16 base, 1024x1024", flux_row))
    if not quick:
        return found

    def without_budget(make: Callable[[], tuple[Any, tuple, dict]]) -> tuple[Any, tuple, dict]:
        module, batch, options = make()
        return module, batch, {k: v for k, v in options.items() if k != "memory_budget"}

    return [(f"tiny stand-in: {t}", functools.partial(without_budget, make)) for t, make in found]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny stand-ins of every row, without a budget")
    parser.add_argument("--only", metavar="TEXT", help="only the rows whose title holds TEXT (case-insensitive)")
    args = parser.parse_args()
    chosen = [r for r in rows(args.quick) if not args.only or args.only.lower() in r[0].lower()]
    if not chosen:
        raise SystemExit(f"no row's title holds {args.only!r}")
    lines = [
        "| workload | asked | MemOpt's choice | peak on the device | on the host | dry runs |",
        "|---|---|---|---|---|---|",
    ]
    for title, make in chosen:
        module, batch, options = make()
        started = time.perf_counter()
        result = estimate(module, batch, "fit", device="cuda", **options)
        seconds = time.perf_counter() - started
        peak, budget = result.memopt.bytes, result.budget_bytes
        met = "no budget" if budget is None else {True: "met", False: "missed", None: "unknown"}[result.fits(budget)]
        host = result.memopt.elsewhere.get("host")
        asked = ", ".join(f"{k}={v!r}" for k, v in options.items())
        lines.append(f"| {title} | `{asked}` | {result.how} | {fmt_bytes(peak)} ({met}) | "
                     f"{fmt_bytes(host) if host else 'nothing'} | {seconds:.1f} s |")  # fmt: skip
        print(lines[-1], flush=True)
    print("\n" + "\n".join(lines))
    print("\nnothing of the models' size allocated")


if __name__ == "__main__":
    main()
