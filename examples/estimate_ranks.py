"""Will it fit on 8 GPUs? One rank's peak under FSDP2, estimated from one process on a laptop.

``estimate(module, batch, "fit", strategy=ModelParallelStrategy(data_parallel_size=8, tensor_parallel_size=1))`` runs
the module's own ``configure_model`` (``fully_shard`` under ``self.device_mesh["data_parallel"]``) on a deep copy of it,
on a fake process group of 8 ranks: nothing is launched or sent, the collectives are simulated by shape, and the dry
run gives one rank's peak. The models are built on the meta device from the published configurations (no weights, no
download; the configurations and the training steps are those of ``estimate_real_scale.py``, imported from it):

- Llama-3-8B (meta-llama/Meta-Llama-3-8B's config.json), full fine-tune: every parameter trained with AdamW, weights
  (so gradients and AdamW's state) in bf16, one sequence of 4,096 tokens per rank, each decoder layer and the whole
  model ``fully_shard``-ed: plain, ``MemOpt()``, and ``MemOpt(optimizer_in_backward=True)``;
- SDXL's UNet (stabilityai/stable-diffusion-xl-base-1.0's unet/config.json), full fine-tune in fp32 with AdamW at
  1024x1024 (128x128 latents), batch 1 per rank, each down, mid and up block and the whole UNet ``fully_shard``-ed:
  plain and ``MemOpt()``.

Beside each row: what DeepSpeed's own estimator says a GPU needs for ZeRO-3 without offload, for the same number of
parameters and largest layer on 8 GPUs of one node. It counts the model states only (weights, gradients, optimizer
state), not the activations; see :func:`deepspeed_zero3_gpu_bytes` for the formula and its source.

    python examples/estimate_ranks.py                          # the table (real scale)
    python examples/estimate_ranks.py --markdown ranks.md      # and write it as markdown
    python examples/estimate_ranks.py --quick                  # tiny configs: seconds
    python examples/estimate_ranks.py --only "SDXL"            # only the rows whose title holds this text
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from estimate_real_scale import LLAMA_3_8B, QUICK, SDXL_UNET, LlamaFull, UNetTrainer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from lightning_memopt import Estimate, estimate
from lightning_memopt.units import fmt_bytes

warnings.filterwarnings("ignore", ".*does not have many workers.*")

#: The number of ranks, all on one node.
RANKS = 8


class ShardedLlama(LlamaFull):
    """:class:`LlamaFull` (bf16 weights, AdamW), each decoder layer and then the whole model sharded by FSDP2."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class ShardedUNet(UNetTrainer):
    """:class:`UNetTrainer` (fp32, AdamW), each down, mid and up block and then the whole UNet sharded by FSDP2."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in [*self.unet.down_blocks, self.unet.mid_block, *self.unet.up_blocks]:
            fully_shard(block, mesh=mesh)
        fully_shard(self.unet, mesh=mesh)


def model_to_params(model: nn.Module) -> tuple[int, int]:
    """The parameter count and the largest layer's (the most parameters any one module holds itself, not counting its
    children's), as DeepSpeed's ``model_to_params`` counts them (deepspeed/runtime/zero/stage3.py). DeepSpeed tells
    tied parameters apart by ``data_ptr()``, which is 0 for every tensor on the meta device; ``parameters()`` already
    yields a tied parameter once, so it is counted by identity here."""
    total = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


def deepspeed_zero3_gpu_bytes(total_params: int, largest_layer_params: int, gpus_per_node: int, nodes: int = 1) -> int:
    """One GPU's bytes for the model states under ZeRO-3 without offload, by DeepSpeed's
    ``estimate_zero3_model_states_mem_needs(total_params, largest_layer_params, num_gpus_per_node, num_nodes,
    cpu_offload=False)`` (deepspeed/runtime/zero/stage3.py, the branch without offload; it prints this figure as "per
    GPU" in ``estimate_zero3_model_states_mem_needs_all_live``, documented in DeepSpeed's "Memory Requirements" page):

        gpu_mem = 4 * largest_layer_params + int(18 * total_params / total_gpus)

    18 bytes a parameter spread over the GPUs (DeepSpeed's mixed-precision accounting: 16-bit weights and gradients,
    fp32 master weights and Adam's two fp32 moments, and a margin), plus the largest layer gathered whole. It is the
    same whatever the model's own dtype: it does not read it. Model states only: no activations, no batch, no
    communication buffers."""
    total_gpus = nodes * gpus_per_node
    return 4 * largest_layer_params + int(18 * total_params / total_gpus)


#: A case: (title, module on the meta device, one rank's batch on the meta device, MemOpt arguments).
Case = tuple[str, pl.LightningModule, tuple[torch.Tensor, ...], dict]


def cases(quick: bool) -> list[Case]:
    """Llama-3-8B (plain and ``MemOpt()``, then ``MemOpt(optimizer_in_backward=True)``) and SDXL's UNet (plain and
    ``MemOpt()``), or their tiny stand-ins with ``quick``."""
    # Llama-3-8B's published config.json has max_position_embeddings=8192 (the rotary buffers do not depend on it)
    llama = QUICK["llama"] if quick else dict(LLAMA_3_8B, max_position_embeddings=8192)
    sdxl = QUICK["sdxl"] if quick else SDXL_UNET
    with torch.device("meta"):
        llama_module, unet_module = ShardedLlama(llama), ShardedUNet(sdxl)
    tokens = 512 if quick else 4096
    ids = (torch.zeros(1, tokens, dtype=torch.long, device="meta"),)
    side = sdxl["sample_size"]
    pooled = sdxl["projection_class_embeddings_input_dim"] - 6 * sdxl["addition_time_embed_dim"]
    latents = (
        torch.empty(1, 4, side, side, device="meta"),
        torch.empty(1, 77, sdxl["cross_attention_dim"], device="meta"),
        torch.empty(1, pooled, device="meta"),  # text_embeds: the pooled embedding of the second text encoder
        torch.empty(1, 6, device="meta"),  # time_ids: original size, crop, target size
    )
    name, unet_name = ("tiny Llama", "tiny SDXL-shaped UNet") if quick else ("Llama-3-8B", "SDXL UNet")
    return [
        (f"{name}, AdamW, bf16, {tokens:,} tokens a rank", llama_module, ids, {}),
        (f"{name}, AdamW, bf16, {tokens:,} tokens a rank", llama_module, ids, {"optimizer_in_backward": True}),
        (f"{unet_name}, AdamW, fp32, batch 1 a rank, {side}x{side} latents", unet_module, latents, {}),
    ]


def _memopt(options: dict) -> str:
    return "MemOpt(" + ", ".join(f"{k}={v!r}" for k, v in options.items()) + ")"


def _rest(e: Estimate) -> int:
    return e.memopt.by_kind.get("batch", 0) + e.memopt.by_kind.get("other", 0)


KINDS = ("weights", "gradients", "optimizer", "activations")
HEADINGS = ("model and step", "MemOpt", "plain, a rank", "with MemOpt, a rank", "MemOpt did",
            *(f"{kind} (MemOpt)" for kind in KINDS), "batch, other", "dry runs",
            f"DeepSpeed ZeRO-3, {RANKS} GPUs, model states only")  # fmt: skip


def row(title: str, options: dict, e: Estimate, deepspeed: int) -> list[str]:
    kinds = [fmt_bytes(e.memopt.by_kind.get(kind, 0)) for kind in KINDS]
    return [title, f"`{_memopt(options)}`", fmt_bytes(e.plain.bytes), fmt_bytes(e.memopt.bytes), e.how or "-",
            *kinds, fmt_bytes(_rest(e)), f"{e.seconds:.1f} s", fmt_bytes(deepspeed)]  # fmt: skip


def table(rows: list[list[str]]) -> str:
    aligns = ["---", "---", "---:", "---:", "---", *["---:"] * len(KINDS), "---:", "---:", "---:"]
    lines = ["| " + " | ".join(HEADINGS) + " |", "|" + "|".join(aligns) + "|"]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny configs: seconds")
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument("--only", metavar="TEXT", help="only the rows whose title or MemOpt arguments hold TEXT")
    args = parser.parse_args()
    started = time.perf_counter()
    chosen = cases(args.quick)
    if args.only:
        chosen = [c for c in chosen if args.only.lower() in (c[0] + _memopt(c[3])).lower()]
        if not chosen:
            raise SystemExit(f"no row holds {args.only!r}")
    strategy = ModelParallelStrategy(data_parallel_size=RANKS, tensor_parallel_size=1)
    rows = []
    for title, module, batch, options in chosen:
        result = estimate(module, batch, "fit", strategy=strategy, **options)
        print(f"\n{title}, {_memopt(options)}\n{result}", flush=True)
        if result.plain.bytes is None or result.memopt.bytes is None or result.ranks != RANKS:
            raise SystemExit(f"check failed: {title} could not be estimated for {RANKS} ranks: {result.notes}")
        total, largest = model_to_params(module)
        deepspeed = deepspeed_zero3_gpu_bytes(total, largest, gpus_per_node=RANKS)
        print(f"{total:,} parameters, largest layer {largest:,}: DeepSpeed ZeRO-3 {fmt_bytes(deepspeed)} a GPU")
        print(f"bytes a rank: plain {result.plain.bytes:,}, MemOpt {result.memopt.bytes:,}", flush=True)
        rows.append(row(title, options, result, deepspeed))
    text = table(rows)
    print("\n" + text)
    seconds = time.perf_counter() - started
    print(f"\nestimated for {RANKS} ranks in {seconds:.0f} s, nothing of the models' size allocated")
    if args.markdown:
        args.markdown.write_text(text + "\n")


if __name__ == "__main__":
    main()
