"""Selective recomputation at real scale, by estimate: the bytes and the recompute FLOPs of each checkpointing plan.

Two training steps are built on the meta device from their configurations (no weights, no download), and
``lightning_memopt.estimate`` dry-runs each LightningModule's own ``training_step`` on fake tensors, with the backward
pass and a later step's gradients and AdamW state:

- an SD-1.5-size ``UNet2DConditionModel`` (diffusers' defaults with 768-wide text embeddings) learning to predict
  noise at batch 16, 64x64 latents, text embeddings 77x768, AdamW on every weight;
- a 7B-class Llama (hidden 4096, 32 layers, 32 heads, intermediate 11008, vocab 32000) wrapped by PEFT with LoRA
  r=16 on ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` (the base frozen), one sequence of 4096 tokens, AdamW on
  the LoRA weights.

For each: the plain step; ``checkpointing=True`` (every block recomputed, by the model's own switch);
``checkpointing="auto"`` without a budget (the cheapest mix within 5 % of the peak with every block checkpointed); and
``checkpointing="auto"`` under three budgets, at a quarter, half and three quarters of the way from the peak with
every block checkpointed to the plain peak (rounded down to a whole GiB; --quick: the middle one only, not rounded).
Under each budget the previous planner, whole-block counting (``benchmarks/whole_blocks.py``: whole blocks only,
spread evenly, their number searched by dry runs), is run too, for comparison. Each row gives the peak, whether it
meets the budget, the FLOPs recomputed in the backward pass and their share of the forward pass's, what was
checkpointed, and the time the dry runs took.

All fp32 (weights, gradients, optimizer state, activations), CPU-exact bytes; on a GPU add the allocator's rounding
and cache, and the CUDA context.

    python examples/estimate_recompute.py                          # the table (about ten minutes on one CPU core)
    python examples/estimate_recompute.py --markdown results.md    # and write it as markdown
    python examples/estimate_recompute.py --json results.json      # and every figure as JSON
    python examples/estimate_recompute.py --quick                  # tiny configs, one budget (under a minute)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import lightning_memopt
from lightning_memopt import Estimate, estimate
from lightning_memopt.adapters import find_models
from lightning_memopt.engine.changes import Changes
from lightning_memopt.engine.config import MemOptConfig
from lightning_memopt.engine.step import StepContext
from lightning_memopt.techniques.checkpointing import Checkpointing
from lightning_memopt.units import fmt_bytes, fmt_flops

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # whole_blocks.py, the baseline
from estimate_real_scale import UNetTrainer  # noqa: E402  (the SD-1.5 training step of the example beside it)
from whole_blocks import whole_block_counting  # noqa: E402

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*deprecated.*")  # PEFT asks transformers for it

#: The SD-1.5 UNet: diffusers' defaults with 768-wide text embeddings.
SD_15_UNET = dict(sample_size=64, cross_attention_dim=768)
#: A 7B-class Llama (Llama-2-7B's shape).
LLAMA_7B = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    max_position_embeddings=4096,
)
#: Small stand-ins for --quick.
QUICK = {
    "unet": dict(sample_size=8, block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16, norm_num_groups=8,
                 layers_per_block=1),
    "llama": dict(vocab_size=128, hidden_size=64, intermediate_size=172, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64),
}  # fmt: skip
#: Where the budgets lie between the peak with every block checkpointed (0) and the plain peak (1); --quick: the middle.
BUDGET_POINTS = (0.25, 0.5, 0.75)
QUICK_POINTS = (0.5,)


class LlamaLoRA(pl.LightningModule):
    """Causal language modelling with a PEFT LoRA adapter on the attention projections; the base model is frozen."""

    def __init__(self, llama: dict) -> None:
        super().__init__()
        lora = LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
        )
        self.model = get_peft_model(LlamaForCausalLM(LlamaConfig(**llama, use_cache=False)), lora)

    def training_step(self, batch: tuple[torch.Tensor]) -> torch.Tensor:
        ids = batch[0]
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)


@dataclass
class Row:
    """One plan's figures."""

    model: str
    plan: str
    budget: int | None
    peak: int | None
    recompute_flops: int | None
    forward_flops: int | None
    how: str
    seconds: float | None
    notes: list[str] = field(default_factory=list)
    estimate: dict[str, Any] | None = None

    @property
    def fraction(self) -> float | None:
        if self.recompute_flops is None or not self.forward_flops:
            return None
        return self.recompute_flops / self.forward_flops

    def cells(self) -> list[str]:
        meets = "" if self.budget is None or self.peak is None else ("yes" if self.peak <= self.budget else "**no**")
        fraction = "" if self.fraction is None else f"{self.fraction:.{1 if self.fraction >= 0.01 else 2}%}"
        return [
            self.model,
            self.plan,
            fmt_bytes(self.budget) if self.budget is not None else "none",
            fmt_bytes(self.peak),
            meets,
            fmt_flops(self.recompute_flops),
            fraction,
            self.how,
            "" if self.seconds is None else f"{self.seconds:.1f} s",
        ]


def cases(quick: bool) -> list[tuple[str, pl.LightningModule, tuple[torch.Tensor, ...]]]:
    """(title, module on the meta device, batch on the meta device) of each training step."""
    unet, llama = (QUICK["unet"], QUICK["llama"]) if quick else (SD_15_UNET, LLAMA_7B)
    images, side, text = (2 if quick else 16), unet["sample_size"], unet["cross_attention_dim"]
    tokens = llama["max_position_embeddings"]
    sd_batch = (torch.empty(images, 4, side, side, device="meta"), torch.empty(images, 77, text, device="meta"))
    ids = (torch.zeros(1, tokens, dtype=torch.long, device="meta"),)
    with torch.device("meta"):
        trainer, lora = UNetTrainer(unet), LlamaLoRA(llama)
    names = ("tiny UNet", "tiny Llama") if quick else ("SD-1.5 UNet", "Llama 7B-class")
    return [
        (f"{names[0]} training, batch {images}, {side}x{side} latents", trainer, sd_batch),
        (f"{names[1]} + LoRA r=16 on q/k/v/o, sequence {tokens}", lora, ids),
    ]


def run_estimate(title: str, plan: str, module: pl.LightningModule, batch: Any, **memopt: Any) -> tuple[Row, Estimate]:
    result = estimate(module, batch, "fit", **memopt)
    print(f"\n{title}: {plan}\n{result}", flush=True)
    if result.plain.bytes is None or result.memopt.bytes is None:
        raise SystemExit(f"check failed: {title} ({plan}) could not be estimated: {result.notes}")
    row = Row(
        title,
        plan,
        memopt.get("memory_budget"),
        result.memopt.bytes,
        result.recompute_flops,
        result.forward_flops,
        result.how,
        result.seconds,
        result.notes,
        {"forward_flops": result.forward_flops, **result.as_dict()},
    )
    return row, result


def run_whole_blocks(title: str, module: pl.LightningModule, batch: Any, budget: int, forward: int | None) -> Row:
    """Whole-block counting under ``budget``, set up as ``estimate`` sets up its dry runs of a meta module."""
    started = time.perf_counter()
    notes: list[str] = []
    options = MemOptConfig(checkpointing="auto", memory_budget=budget)
    context = StepContext(optimizers=[module.configure_optimizers()])
    found = [f for f in find_models(module, options.models) if any(p.requires_grad for p in f.module.parameters())]
    changes = Changes("fit", found, options, notes.append)
    changes.apply(quiet=True)
    try:
        count, choice = whole_block_counting(context, module, changes, batch, budget, device=torch.device("cpu"))
        blocks = len(changes.technique(Checkpointing).switches)
    finally:
        changes.remove()
    seconds = time.perf_counter() - started
    row = Row(
        title,
        "whole blocks (before)",
        budget,
        choice.peak_bytes,
        choice.recompute_flops,
        forward if forward is not None else choice.forward_flops,
        f"checkpointing {count} of {blocks} blocks, evenly spread",
        seconds,
        notes + choice.notes,
    )
    print(f"\n{title}: whole-block counting, budget {fmt_bytes(budget)}: {row.how}, peak {fmt_bytes(row.peak)}, "
          f"recomputed {fmt_flops(row.recompute_flops)} ({seconds:.1f} s)", flush=True)  # fmt: skip
    return row


def budgets(full: int, plain: int, quick: bool) -> list[int]:
    """Budgets at :data:`BUDGET_POINTS` (:data:`QUICK_POINTS`) between the peak with every block checkpointed and the
    plain peak, rounded down to a whole GiB at real scale."""
    values = [int(full + point * (plain - full)) for point in (QUICK_POINTS if quick else BUDGET_POINTS)]
    return values if quick else [v // 2**30 * 2**30 for v in values]


def study(title: str, module: pl.LightningModule, batch: Any, quick: bool) -> list[Row]:
    rows = []
    every, result = run_estimate(title, "checkpointing=True", module, batch, checkpointing=True)
    plain = Row(title, "plain", None, result.plain.bytes, 0, result.forward_flops, "nothing", None)
    rows += [plain, every, run_estimate(title, '"auto"', module, batch, checkpointing="auto")[0]]
    for budget in budgets(result.memopt.bytes, result.plain.bytes, quick):
        auto, _ = run_estimate(title, '"auto"', module, batch, checkpointing="auto", memory_budget=budget)
        rows += [auto, run_whole_blocks(title, module, batch, budget, result.forward_flops)]
    return rows


def table(rows: list[Row]) -> list[str]:
    lines = [
        "| model and step | plan | budget | peak | meets budget | recomputed | of forward FLOPs | checkpointed"
        " | dry runs |",
        "|---|---|---:|---:|---|---:|---:|---|---:|",
    ]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    forwards = dict.fromkeys((row.model, row.forward_flops) for row in rows if row.plan == "plain")
    lines.append("")
    lines += [f"- {model}: forward pass {fmt_flops(flops)}" for model, flops in forwards]
    return lines


def package_version() -> str:
    """The commit of the lightning_memopt checkout that ran (and whether its package or the baseline differ from it)."""
    root = str(Path(lightning_memopt.__file__).resolve().parent.parent)
    try:
        git = ["git", "-C", root]
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        paths = ["lightning_memopt", "benchmarks/whole_blocks.py"]
        status = subprocess.run([*git, "status", "--porcelain", "--", *paths], capture_output=True, text=True)
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + (" with uncommitted changes" if status.stdout.strip() else "")


def heading(quick: bool, seconds: float) -> list[str]:
    """What the markdown file says above the table: how it was made and how to read it."""
    import diffusers
    import peft
    import transformers

    points = QUICK_POINTS if quick else BUDGET_POINTS
    where = ", ".join(f"{p:.0%}" for p in points)
    versions = (
        f"torch {torch.__version__}, lightning {pl.__version__}, diffusers {diffusers.__version__}, transformers"
        f" {transformers.__version__}, peft {peft.__version__}"
    )
    return [
        "# Selective recomputation at real scale, by estimate" + (" (--quick)" if quick else ""),
        "",
        f"`python examples/estimate_recompute.py{' --quick' if quick else ''}`: models built on the meta device, every"
        f" figure from dry runs on fake tensors ({seconds:.0f} s in all on {platform.machine()}, {os.cpu_count()}"
        f" CPUs; lightning_memopt at {package_version()}; {versions}). fp32 throughout (weights, gradients, AdamW"
        " state, activations); CPU-exact bytes, to which a GPU adds the allocator's rounding and cache and the CUDA"
        " context.",
        "",
        "- *plan*: `plain` is the step as the model is; `checkpointing=True` checkpoints every block (the model's"
        ' own switch, every block `full`); `"auto"` chooses each block\'s mode for the least predicted step time'
        " (the time model calibrated on this machine's CPU) under the budget (without one: within 5 % of the peak with"
        " every block checkpointed); `whole blocks (before)` is"
        " the previous planner, whole-block counting (`benchmarks/whole_blocks.py`: a number of blocks, all `full`,"
        " spread evenly), under the same budget.",
        f"- *budget*: at {where} of the way from the peak with every block checkpointed to the plain peak"
        + (", rounded down to a whole GiB." if not quick else "."),
        "- *recomputed*: the FLOPs the checkpointed blocks compute again in the backward pass (matrix products,"
        " convolutions and attention by FlopCounterMode's formulas, any other op one per output element); *of"
        " forward FLOPs*: their share of the plain forward pass's.",
        "- *dry runs*: the seconds `estimate`'s dry runs took (the plain step's included); for whole-block counting,"
        " the wall-clock time of its search.",
        "",
    ]


def as_json(rows: list[Row], quick: bool, seconds: float) -> dict:
    import diffusers
    import peft
    import transformers

    versions = {
        "torch": torch.__version__,
        "lightning": pl.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }
    return {
        "quick": quick,
        "seconds": round(seconds, 1),
        "versions": versions,
        "lightning_memopt": package_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "budget_points": QUICK_POINTS if quick else BUDGET_POINTS,
        "rows": [
            {
                "model": row.model,
                "plan": row.plan,
                "budget_bytes": row.budget,
                "peak_bytes": row.peak,
                "recompute_flops": row.recompute_flops,
                "forward_flops": row.forward_flops,
                "recompute_fraction": row.fraction,
                "how": row.how,
                "seconds": row.seconds,
                "notes": row.notes,
                "estimate": row.estimate,
            }
            for row in rows
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny configs, one budget: under a minute")
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument("--json", type=Path, help="also write every figure here, as JSON")
    args = parser.parse_args()
    started, rows = time.perf_counter(), []
    for title, module, batch in cases(args.quick):
        rows += study(title, module, batch, args.quick)
    seconds = time.perf_counter() - started
    lines = table(rows)
    print("\n" + "\n".join(lines))
    print(f"\nestimated in {seconds:.0f} s, fp32, nothing of the models' size allocated")
    if args.markdown:
        args.markdown.write_text("\n".join(heading(args.quick, seconds) + lines) + "\n")
    if args.json:
        args.json.write_text(json.dumps(as_json(rows, args.quick, seconds), indent=2) + "\n")


if __name__ == "__main__":
    main()
