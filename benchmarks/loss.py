"""The loss of a causal language model whose vocabulary is far wider than the model, side by side in one run: the
model's own loss with its own checkpointing switched on by hand, ``MemOpt()``, and torch's fused
``linear_cross_entropy`` with the same checkpointing, by hand.

    python -m benchmarks.loss            # the quick suite (the default; --quick says so): about a minute on 2 cores
    python -m benchmarks.loss --smoke    # tiny sizes, one round: seconds (CI)

The workload is a Llama built from a config (``tests/zoo.py``), its vocabulary 256x its width at quick size (hidden 64,
4 layers, vocabulary 16,384, batch 2 x 512 tokens), trained in float32 with AdamW on every parameter. Configurations:

- ``own+ckpt``: ``model(input_ids=ids, labels=ids).loss`` after ``model.activation_checkpointing_enable()``; no MemOpt.
- ``memopt``: ``MemOpt()``'s changes at fit, applied and planned as a fit applies and plans them before its first
  batch (``open_stage`` and ``Stage.plan`` with ``MemOptConfig()``, every option at its default, no budget); the
  settings in force are written out. The step is the same call as ``own+ckpt``'s, without the switch by hand.
- ``fused-by-hand``: the switch by hand, the final hidden states from ``model.model(input_ids=ids)``, the labels
  shifted as transformers shifts them (padded right with -100, the first dropped), and
  ``torch.nn.functional.linear_cross_entropy(hidden, lm_head.weight, labels, ignore_index=-100,
  options=torch.nn.LinearCrossEntropyOptions())``.

First, from the same weights, each configuration's loss and gradients (no optimizer step): the losses must agree within
1e-5 relative (the run exits with status 1 otherwise), and the largest gradient difference against ``own+ckpt`` is
reported. Then real training steps (forward and loss, ``zero_grad(set_to_none=True)``, backward, ``AdamW.step()``) of
every configuration, round-robin in one process: the exact CPU peak of one step under ``CPUPeakTracker`` (weights,
gradients, AdamW state and batch added first) and the median time of untracked steps, each as a ratio to
``own+ckpt``'s.

Results: ``<out>/loss.json`` and ``<out>/loss.md`` (``loss_smoke.*`` for the smoke suite). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import logging
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # "use_cache=True is incompatible with checkpointing"

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from lightning_memopt.adapters import find_models
from lightning_memopt.engine.config import MemOptConfig
from lightning_memopt.engine.report import MemOptReport
from lightning_memopt.engine.stage import Hooks, Stage, open_stage, stage_budget
from lightning_memopt.engine.step import StepContext
from lightning_memopt.memory import CPUPeakTracker
from lightning_memopt.techniques.loss import ChunkedLoss
from lightning_memopt.techniques.loss.core import chunk_tokens
from tests import zoo

logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
logging.getLogger("lightning.fabric").setLevel(logging.WARNING)

MIB = 2**20
IGNORE_INDEX = -100
#: The reference every ratio and difference is taken against.
REFERENCE = "own+ckpt"
CONFIGS = (REFERENCE, "memopt", "fused-by-hand")
#: The largest relative difference of a loss from the reference's allowed (float32).
LOSS_RTOL = 1e-5
#: The phases of a step, in order.
PHASES = ("forward and loss", "backward", "optimizer step")
#: A configuration's loss: of the model and the batch.
LossOf = Callable[[Any, torch.Tensor], torch.Tensor]

SUITES: dict[str, dict[str, Any]] = {
    # size: the Llama's geometry and the batch; rounds x steps: timed steps per configuration, after one untimed step
    # per visit
    "smoke": {
        "size": {"batch": 2, "seq": 64, "hidden": 32, "layers": 2, "heads": 2, "vocab": 2048},
        "rounds": 1,
        "steps": 1,
    },
    "quick": {
        "size": {"batch": 2, "seq": 512, "hidden": 64, "layers": 4, "heads": 4, "vocab": 16384},
        "rounds": 5,
        "steps": 4,
    },
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# the workload ------------------------------------------------------------------------------------------------------


class CausalLM(pl.LightningModule):
    """A Llama under the attribute ``model``, as a fine-tuning LightningModule holds it; its training step is the
    model's own loss (what MemOpt's planner dry-runs)."""

    def __init__(self, size: dict[str, int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = zoo.causal_lm(
            "llama",
            vocab_size=size["vocab"],
            hidden_size=size["hidden"],
            intermediate_size=4 * size["hidden"],
            num_hidden_layers=size["layers"],
            num_attention_heads=size["heads"],
            num_key_value_heads=size["heads"],
            max_position_embeddings=size["seq"],
        )

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return own_loss(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-6)


def own_loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The model's own loss: the logits whole (or, with MemOpt's changes in force, the loss in chunks)."""
    return model(input_ids=ids, labels=ids).loss


def fused_loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """torch's fused, chunked ``linear_cross_entropy`` from the final hidden states, the labels shifted as
    transformers' ``ForCausalLMLoss`` shifts them (its mean over the labels not ignored, float32)."""
    hidden = model.model(input_ids=ids).last_hidden_state
    labels = F.pad(ids, (0, 1), value=IGNORE_INDEX)[..., 1:]
    head = model.get_output_embeddings()
    return F.linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]),
        head.weight,
        labels.reshape(-1),
        linear_bias=head.bias,
        ignore_index=IGNORE_INDEX,
        options=torch.nn.LinearCrossEntropyOptions(),
    )


def fused_options(tokens: int, width: int, vocab: int) -> str:
    """What ``LinearCrossEntropyOptions()`` resolves to for this call on CPU in float32 (torch's internal
    ``_adjust``; ``"unknown"`` where that is not there)."""
    try:
        resolved = torch.nn.LinearCrossEntropyOptions()._adjust(
            tokens, width, vocab, torch.float32, torch.device("cpu")
        )
    except Exception as error:  # an internal API: its absence only costs this line of the report
        return f"unknown ({type(error).__name__})"
    return (
        f"acc_policy {resolved.acc_policy!r}, chunking_method {resolved.chunking_method!r}, "
        f"batch_chunk_size {resolved.batch_chunk_size}"
    )


def batch_of(size: dict[str, int]) -> torch.Tensor:
    return torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=torch.Generator().manual_seed(1))


# configurations ----------------------------------------------------------------------------------------------------


class Setups:
    """The three configurations on the one model. MemOpt's changes are applied and planned once, as a fit does before
    its first batch, their settings kept, and removed; ``memopt`` applies them again with those settings, the others
    run without them."""

    def __init__(self, module: CausalLM, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> None:
        self.module = module
        self.notes: list[str] = []
        self.said: list[str] = []
        config = MemOptConfig()
        self.config = {k: getattr(config, k) for k in ("checkpointing", "chunked_loss", "chunking", "memory_budget")}
        self.changes = open_stage("fit", find_models(module, None), config, self.notes.append, quiet=True)
        hooks = Hooks(context=lambda: StepContext(optimizers=[optimizer]), warn=self.notes.append, say=self.said.append)
        budget = stage_budget(config, self.changes, None)
        started = time.perf_counter()
        Stage("fit", self.changes, config, budget, MemOptReport("fit", "cpu"), measure=False, hooks=hooks).plan(
            module, batch
        )
        self.planning_s = time.perf_counter() - started
        self.state = self.changes.state()
        self.described = self.changes.describe()
        self.applied = [
            f"{a.technique} on {a.model} via {a.method} ({a.blocks} {a.unit})" for a in self.changes.applied
        ]
        loss = self.changes.technique(ChunkedLoss)
        self.loss_settings = [u.setting for u in loss.units] if loss is not None else []
        self.changes.remove()

    @contextlib.contextmanager
    def memopt(self) -> Iterator[None]:
        self.changes.apply(quiet=True)
        try:
            if not self.changes.load(self.state):
                raise RuntimeError("MemOpt's settings did not fit the changes applied again")
            yield
        finally:
            self.changes.remove()

    @contextlib.contextmanager
    def switch(self) -> Iterator[None]:
        """The model's own checkpointing switched on by hand, as benchmarks/workloads.py switches it."""
        self.module.model.activation_checkpointing_enable()
        try:
            yield
        finally:
            self.module.model.activation_checkpointing_disable()

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[LossOf]:
        """``name`` in force; yields its loss function."""
        if name == "memopt":
            with self.memopt():
                yield own_loss
        elif name == REFERENCE:
            with self.switch():
                yield own_loss
        elif name == "fused-by-hand":
            with self.switch():
                yield fused_loss
        else:
            raise ValueError(name)


# a real training step ----------------------------------------------------------------------------------------------


class Trainer:
    """The model, the batch and AdamW, and the step every configuration runs, as Lightning's automatic optimization
    runs it: forward and loss, gradients zeroed (the last step's alive until then), backward, AdamW step."""

    def __init__(self, module: CausalLM, batch: torch.Tensor) -> None:
        self.module, self.batch = module, batch
        self.optimizer = module.configure_optimizers()

    def step(self, loss_of: LossOf, mark: Callable[[str], None] = lambda phase: None) -> None:
        """One step; ``mark`` is called with the name of each phase as it begins."""
        mark(PHASES[0])
        # as Lightning's closure: the loss divided by accumulate_grad_batches (1), a detached copy kept
        loss = loss_of(self.module.model, self.batch) / 1
        _kept = loss.detach().clone()
        self.optimizer.zero_grad(set_to_none=True)
        mark(PHASES[1])
        loss.backward()
        mark(PHASES[2])
        self.optimizer.step()

    def timed(self, loss_of: LossOf) -> float:
        started = time.perf_counter()
        self.step(loss_of)
        return time.perf_counter() - started

    def live(self) -> list[torch.Tensor]:
        """What is alive between steps: weights, buffers, gradients, optimizer state, batch."""
        m = self.module
        state = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        grads = [p.grad for p in m.parameters() if p.grad is not None]
        return [*m.parameters(), *m.buffers(), *grads, *state, self.batch]

    def live_bytes(self) -> int:
        storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in self.live()}
        return sum(storages.values())

    def tracked_peak(self, loss_of: LossOf) -> dict[str, Any]:
        """The exact CPU peak of one step, everything alive counted (:class:`CPUPeakTracker`); the peak before the
        optimizer step (forward, loss and backward), and the phase the peak was reached in."""
        phase, reached, before = [""], [""], [0]

        def mark(name: str) -> None:
            phase[0] = name
            if name == PHASES[2]:
                before[0] = tracker.peak

        with CPUPeakTracker() as tracker:
            tracker.add(self.live())
            tracker.on_peak = lambda _: reached.__setitem__(0, phase[0])
            self.step(loss_of, mark)
        return {"real_peak_bytes": tracker.peak, "peak_before_optimizer_bytes": before[0], "peak_in": reached[0]}


# the check: loss and gradients from the same weights ---------------------------------------------------------------


def agreement(setups: Setups, trainer: Trainer) -> dict[str, Any]:
    """Each configuration's loss and gradients from the same weights and batch (no optimizer step); the losses
    against the reference's (relative), the gradients (largest absolute difference, and over the reference's largest
    gradient)."""
    model = trainer.module.model
    losses: dict[str, float] = {}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    caught: dict[str, list[str]] = {}
    for name in CONFIGS:
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as seen, setups.use(name) as loss_of:
            warnings.simplefilter("always")
            loss = loss_of(model, trainer.batch)
            loss.backward()
        losses[name] = loss.item()
        grads[name] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        caught[name] = sorted({str(w.message).splitlines()[0] for w in seen})
    model.zero_grad(set_to_none=True)
    ref, ref_grads = losses[REFERENCE], grads[REFERENCE]
    largest = max(g.abs().max().item() for g in ref_grads.values())
    out: dict[str, Any] = {}
    for name in CONFIGS:
        if grads[name].keys() != ref_grads.keys():
            raise RuntimeError(f"{name} gave gradients of other parameters than {REFERENCE}")
        diffs = {n: (grads[name][n] - g).abs().max().item() for n, g in ref_grads.items()}
        worst = max(diffs, key=diffs.__getitem__)
        out[name] = {
            "loss": losses[name],
            "loss_rel_diff": abs(losses[name] - ref) / abs(ref),
            "max_grad_abs_diff": diffs[worst],
            "max_grad_abs_diff_param": worst,
            "max_grad_rel_diff": diffs[worst] / largest,
            "warnings": caught[name],
        }
    return {
        "configs": out,
        "largest_reference_grad": largest,
        "losses_agree": all(o["loss_rel_diff"] <= LOSS_RTOL for o in out.values()),
    }


# real steps --------------------------------------------------------------------------------------------------------


def real_steps(setups: Setups, trainer: Trainer, rounds: int, steps: int) -> dict[str, Any]:
    """Every configuration round-robin (each round starting one later): one untimed step per visit, then ``steps``
    timed ones; the tracked step (exact peak) once, on the first visit, after the untimed step."""
    names = list(CONFIGS)
    out: dict[str, Any] = {n: {"step_times_s": [], "real_peak_bytes": None} for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            entry = out[name]
            with setups.use(name) as loss_of:
                trainer.step(loss_of)
                if entry["real_peak_bytes"] is None:
                    entry.update(trainer.tracked_peak(loss_of))
                entry["step_times_s"] += [trainer.timed(loss_of) for _ in range(steps)]
    for entry in out.values():
        entry["median_step_s"] = statistics.median(entry["step_times_s"])
    ref = out[REFERENCE]
    for entry in out.values():
        entry["peak_vs_reference"] = entry["real_peak_bytes"] / ref["real_peak_bytes"]
        entry["time_vs_reference"] = entry["median_step_s"] / ref["median_step_s"]
    return out


def measure(suite: str, plan: dict[str, Any]) -> dict[str, Any]:
    size = plan["size"]
    module = CausalLM(size).train()
    batch = batch_of(size)
    trainer = Trainer(module, batch)
    setups = Setups(module, trainer.optimizer, batch)
    tokens, width, vocab = size["batch"] * size["seq"], size["hidden"], size["vocab"]
    data: dict[str, Any] = {
        "size": dict(size),
        "parameters": sum(p.numel() for p in module.parameters()),
        "logits_bytes": tokens * vocab * 4,  # float32 logits of the batch, whole
        "memopt": {
            "config": setups.config,
            "applied": setups.applied,
            "described": setups.described,
            "state": setups.state,
            "loss_settings": setups.loss_settings,
            "chunk_tokens": chunk_tokens(tokens, width, vocab),
            "planning_s": round(setups.planning_s, 3),
            "notes": setups.notes,
            "said": setups.said,
        },
        "fused_options": fused_options(tokens, width, vocab),
    }
    log(f"  MemOpt in force: {setups.described} (planned in {setups.planning_s:.1f} s)")
    data["check"] = agreement(setups, trainer)
    for name, c in data["check"]["configs"].items():
        log(
            f"  {name}: loss {c['loss']:.7f} (rel. diff {c['loss_rel_diff']:.1e}), largest gradient difference "
            f"{c['max_grad_abs_diff']:.2e} ({c['max_grad_rel_diff']:.1e} of the largest gradient)"
        )
    with setups.use(REFERENCE) as loss_of:
        trainer.step(loss_of)  # gradients and AdamW's state exist from here: every step measured is a later step
    data["live_bytes"] = trainer.live_bytes()
    data["configs"] = real_steps(setups, trainer, plan["rounds"], plan["steps"])
    for name, c in data["configs"].items():
        log(
            f"  {name}: peak {c['real_peak_bytes'] / MIB:.2f} MiB ({c['peak_vs_reference']:.3f}x, in the "
            f"{c['peak_in']}; {c['peak_before_optimizer_bytes'] / MIB:.2f} MiB before it), "
            f"{c['median_step_s'] * 1000:.0f} ms ({c['time_vs_reference']:.2f}x)"
        )
    return data


# report ------------------------------------------------------------------------------------------------------------


def markdown(results: dict[str, Any]) -> str:
    meta, data = results["meta"], results["workload"]
    if "error" in data:
        return f"# The language model's loss\n\nFailed: `{data['error']}`\n"
    size, memopt, check = data["size"], data["memopt"], data["check"]
    lines = [
        "# The language model's loss: its own, MemOpt's in chunks, torch's fused linear_cross_entropy",
        "",
        f"Suite `{meta['suite']}` on {meta['device']}, {meta['threads']} thread(s), torch {meta['torch']}, "
        f"transformers {meta['transformers']}, lightning {meta['lightning']}; {meta['wall_s']:.0f} s in all. "
        "Generated by `benchmarks/loss.py` (see benchmarks/README.md).",
        "",
        f"`LlamaForCausalLM` from a config: hidden {size['hidden']}, {size['layers']} layers, {size['heads']} heads, "
        f"vocabulary {size['vocab']:,} ({size['vocab'] // size['hidden']}x the width), {data['parameters']:,} "
        f"parameters, float32, AdamW on every parameter; batch {size['batch']} x {size['seq']} tokens, the labels the "
        f"inputs. The logits of the batch, whole, are {data['logits_bytes'] / MIB:.2f} MiB; alive between steps "
        f"(weights, gradients, AdamW state, batch): {data['live_bytes'] / MIB:.2f} MiB.",
        "",
        f"- `{REFERENCE}`: `model(input_ids=ids, labels=ids).loss`, `model.activation_checkpointing_enable()` by hand.",
        f"- `memopt`: `MemOptConfig()` ({', '.join(f'{k}={v!r}' for k, v in memopt['config'].items())}), applied and "
        f"planned as a fit does before its first batch (in {memopt['planning_s']:.1f} s); in force: "
        f"`{memopt['described']}` (the loss in chunks of {memopt['chunk_tokens']} tokens). MemOpt said: "
        + "; ".join(f'"{line.removeprefix("MemOpt: ")}"' for line in memopt["said"])
        + ".",
        "- `fused-by-hand`: the same switch by hand, `model.model(input_ids=ids).last_hidden_state`, the labels "
        "shifted (padded right with -100, the first dropped), `F.linear_cross_entropy(hidden, lm_head.weight, labels, "
        "ignore_index=-100, options=torch.nn.LinearCrossEntropyOptions())`; the options resolve here to "
        f"{data['fused_options']}.",
        "",
        "Peak: exact CPU bytes of one real step (forward, loss, `zero_grad(set_to_none=True)`, backward, AdamW step) "
        "under `CPUPeakTracker`, everything alive counted; also the peak before the optimizer step, and the phase "
        f"the step's peak is reached in. Time: median of {meta['rounds']} rounds x {meta['steps']} timed steps, "
        "configurations interleaved round-robin in one process. Ratios are to "
        f"`{REFERENCE}`, measured alongside. Loss and gradients: from the same weights and batch, before any "
        "optimizer step; differences against "
        f"`{REFERENCE}`'s.",
        "",
        "| configuration | peak MiB | peak ratio | before the optimizer step MiB | peak in | step ms | time ratio | "
        "loss | loss rel. diff | largest grad diff | over the largest grad |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in CONFIGS:
        c, k = data["configs"][name], check["configs"][name]
        lines.append(
            f"| `{name}` | {c['real_peak_bytes'] / MIB:.2f} | {c['peak_vs_reference']:.3f} | "
            f"{c['peak_before_optimizer_bytes'] / MIB:.2f} | {c['peak_in']} | {c['median_step_s'] * 1000:.0f} | "
            f"{c['time_vs_reference']:.2f} | {k['loss']:.7f} | {k['loss_rel_diff']:.1e} | "
            f"{k['max_grad_abs_diff']:.1e} | {k['max_grad_rel_diff']:.1e} |"
        )
    verdict = "agree" if check["losses_agree"] else "**do not agree**"
    lines += [
        "",
        f"The losses {verdict} within {LOSS_RTOL:g} relative. The largest gradient of `{REFERENCE}` is "
        f"{check['largest_reference_grad']:.2e}; the largest differences are in "
        + ", ".join(f"`{check['configs'][n]['max_grad_abs_diff_param']}` ({n})" for n in CONFIGS if n != REFERENCE)
        + ".",
    ]
    warned = {n: check["configs"][n]["warnings"] for n in CONFIGS if check["configs"][n]["warnings"]}
    if warned:
        lines += ["", "Warnings during the check: " + "; ".join(f"{n}: {', '.join(w)}" for n, w in warned.items())]
    if memopt["notes"]:
        lines += ["", "MemOpt's notes: " + "; ".join(memopt["notes"])]
    return "\n".join(lines) + "\n"


# main --------------------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the quick suite (the default)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round: seconds (CI)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, see README)")
    args = parser.parse_args()
    if args.smoke and args.quick:
        parser.error("--smoke and --quick: choose one")
    suite = "smoke" if args.smoke else "quick"
    plan = SUITES[suite]
    torch.set_num_threads(args.threads)
    stem = "loss" if suite == "quick" else f"loss_{suite}"
    started = time.perf_counter()
    log(f"loss ({suite})")
    try:
        workload = measure(suite, plan)
    except Exception as error:  # recorded in both files
        workload = {"error": f"{type(error).__name__}: {error}"}
        log(f"  failed: {workload['error']}")
    results = {
        "meta": {
            "suite": suite,
            "device": "cpu",
            "threads": args.threads,
            **{p: importlib.metadata.version(p) for p in ("torch", "lightning", "transformers")},
            "rounds": plan["rounds"],
            "steps": plan["steps"],
            "reference": REFERENCE,
            "loss_rtol": LOSS_RTOL,
            "optimizer": "AdamW(lr=1e-6), zero_grad(set_to_none=True) between forward and backward",
            "wall_s": round(time.perf_counter() - started, 1),
        },
        "workload": workload,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = args.out / f"{stem}.json", args.out / f"{stem}.md"
    json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    md_path.write_text(markdown(results))
    log(f"wrote {json_path} and {md_path} in {results['meta']['wall_s']:.0f} s")
    if "error" in workload:
        return 1
    if not workload["check"]["losses_agree"]:
        log(f"the losses do not agree within {LOSS_RTOL:g} relative")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
