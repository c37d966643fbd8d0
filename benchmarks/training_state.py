"""The training state at fit: a full fine-tune step's time and peak memory with the gradients freed right after the
optimizer step (``free_gradients``), with every block checkpointed, in full and with its inputs on the host
(``checkpointing="offload"``: on a CPU, the price of the copies), with the optimizer stepped inside the backward pass
(``optimizer_in_backward``), also with its state on the host (``"host"``: on a CPU the host is the device, so that row
gives the price of the copies and of stepping each parameter there, not a saving), and with AdamW's moments kept in 8
bits (``optimizer_state_8bit``, lossy), side by side in one process with plain,
``MemOpt()`` and ``MemOpt(optimizer_in_backward=True)``.

    python -m benchmarks.training_state                        # on CPU, one thread: about 3-5 minutes
    python -m benchmarks.training_state --smoke --out /tmp/t   # tiny sizes, one round (CI)
    python -m benchmarks.training_state --device cuda          # on a GPU (benchmarks/gpu.sh runs it)

Writes ``<out>/training_state.json`` and ``<out>/training_state.md``; asserts nothing about figures. See
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.metadata
import importlib.util
import logging
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from benchmarks.harness import write_results
from lightning_memopt import MemOpt, PeakMemory
from tests import zoo

warnings.filterwarnings("ignore", ".*does not have many workers.*")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
Batch = dict[str, torch.Tensor]
STATE_ONLY = dict(checkpointing=False, chunked_loss=False, chunking=False, free_gradients=True)
CHECKPOINTED = dict(chunked_loss=False, chunking=False, free_gradients=False, optimizer_in_backward=False)


def memopt(**options: Any) -> Callable[[], MemOpt]:
    return lambda: MemOpt(measure=False, **options)


#: name: (label, what makes its callback, once per workload and reused by its fits; None for plain)
CONFIGS: dict[str, tuple[str, Callable[[], MemOpt] | None]] = {
    "plain": ("plain (no callback)", None),
    "free_gradients": ("free gradients", memopt(**STATE_ONLY, optimizer_in_backward=False)),
    "optimizer_in_backward": ("optimizer in backward", memopt(**STATE_ONLY, optimizer_in_backward=True)),
    # on a CPU the host is the device: this row prices the copies and the host steps, saving nothing there
    "in_backward_host": (
        "optimizer in backward, state on the host",
        memopt(**STATE_ONLY, optimizer_in_backward="host"),
    ),
    # every block checkpointed in full, and the same with each block's inputs copied to the host and back (on a CPU the
    # host is the device: the price of the copies, no saving)
    "checkpointed": ("every block checkpointed", memopt(**CHECKPOINTED, checkpointing=True)),
    "checkpoint_offload": (
        "every block checkpointed, inputs on the host",
        memopt(**CHECKPOINTED, checkpointing="offload"),
    ),
    "memopt": ("`MemOpt()`", memopt()),
    "memopt_in_backward": ("`MemOpt(optimizer_in_backward=True)`", memopt(optimizer_in_backward=True)),
    "state_8bit": (
        "8-bit optimizer state (lossy)",
        memopt(**STATE_ONLY, optimizer_in_backward=False, optimizer_state_8bit=True, lossy=True),
    ),
    "in_backward_8bit": (
        "optimizer in backward + 8-bit state (lossy)",
        memopt(**STATE_ONLY, optimizer_in_backward=True, optimizer_state_8bit=True, lossy=True),
    ),
}
if importlib.util.find_spec("bitsandbytes") is None:  # the 8-bit state needs it: its rows are left out, said in the log
    CONFIGS = {name: config for name, config in CONFIGS.items() if "8bit" not in name}
#: Per suite and workload: the sizes; ``cpu`` makes a plain step take roughly 100-200 ms on one CPU thread (on this
#: shared 2-core machine); ``gpu`` makes the tensors larger with the same kinds of blocks (not run here).
SIZES: dict[str, dict[str, dict[str, int]]] = {
    "smoke": {
        "unet2d_condition": dict(batch=2, res=16, channels=16, levels=2, text=16),
        "llama": dict(batch=2, seq=32, hidden=32, layers=2, intermediate=64, heads=2, vocab=128),
    },
    "cpu": {
        "unet2d_condition": dict(batch=4, res=16, channels=32, levels=3, text=64),
        "llama": dict(batch=2, seq=128, hidden=256, layers=4, intermediate=688, heads=4, vocab=4096),
    },
    "gpu": {
        "unet2d_condition": dict(batch=16, res=64, channels=128, levels=3, text=256),
        "llama": dict(batch=4, seq=1024, hidden=1024, layers=8, intermediate=2816, heads=16, vocab=32000),
    },
}
#: Per suite: rounds, warm-up steps per fit (untimed: the first creates AdamW's state), timed steps per fit.
PLANS: dict[str, dict[str, int]] = {
    "smoke": {"rounds": 1, "warmup": 1, "steps": 1},
    "cpu": {"rounds": 7, "warmup": 1, "steps": 5},
    "gpu": {"rounds": 2, "warmup": 2, "steps": 5},
}


def log(message: str) -> None:
    print(f"[training_state] {message}", flush=True)


# workloads: the model from a config, a batch, the loss ---------------------------------------------------------------


def unet(s: dict[str, int]) -> nn.Module:
    """Cross-attention in every level but the lowest; the channels double after the first level."""
    attn, ch = s["levels"] - 1, s["channels"]
    down, up = ("CrossAttnDownBlock2D",) * attn + ("DownBlock2D",), ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * attn
    config = dict(sample_size=s["res"], cross_attention_dim=s["text"], block_out_channels=(ch,) + (2 * ch,) * attn)
    return zoo.unet2d_condition(down_block_types=down, up_block_types=up, **config)


def unet_batch(g: torch.Generator, s: dict[str, int]) -> Batch:
    shape, t = (s["batch"], 4, s["res"], s["res"]), torch.randint(0, 1000, (s["batch"],), generator=g)
    x, noise = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    return {"x": x, "noise": noise, "t": t, "c": torch.randn(s["batch"], 8, s["text"], generator=g)}


def unet_loss(model: nn.Module, b: Batch) -> torch.Tensor:
    """DDPM noise prediction: noise the latents at the batch's timesteps, predict the noise."""
    alpha = torch.cos(b["t"].float() / 1000 * torch.pi / 2).view(-1, 1, 1, 1)
    noisy = alpha * b["x"] + (1 - alpha**2).sqrt() * b["noise"]
    return nn.functional.mse_loss(model(noisy, b["t"], encoder_hidden_states=b["c"]).sample, b["noise"])


def llama(s: dict[str, int]) -> nn.Module:
    config = dict(intermediate_size=s["intermediate"], vocab_size=s["vocab"], max_position_embeddings=s["seq"])
    return zoo.llama(s["layers"], s["hidden"], num_attention_heads=s["heads"], num_key_value_heads=s["heads"], **config)


#: name: (the model from its sizes, a batch from a generator and the sizes, the loss of the model on a batch); the
#: Llama first, where the training state is most of the peak
WORKLOADS: dict[str, tuple[Callable[..., nn.Module], Callable[..., Batch], Callable[..., torch.Tensor]]] = {
    "llama": (
        llama,
        lambda g, s: {"ids": torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g)},
        lambda model, b: model(input_ids=b["ids"], labels=b["ids"]).loss,
    ),
    "unet2d_condition": (unet, unet_batch, unet_loss),
}


class FineTune(pl.LightningModule):
    """Every weight of ``model`` trained by AdamW (float32) on ``batches``, one per step."""

    def __init__(self, model: nn.Module, loss: Callable[..., torch.Tensor], batches: list[Batch]) -> None:
        super().__init__()
        self.model, self.loss, self.batches = model, loss, batches

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return self.loss(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(self.batches, batch_size=None)


class Clock(pl.Callback):
    """Each train batch's wall time (forward, backward, optimizer step) and, on CUDA, its ``max_memory_allocated``
    after ``reset_peak_memory_stats``, the device synchronised at both ends. After MemOpt: its dry runs come first."""

    def __init__(self, device: torch.device) -> None:
        self.cuda, self.seconds, self.peaks, self._began = device.type == "cuda", [], [], 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self._began = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peaks.append(torch.cuda.max_memory_allocated())
        self.seconds.append(time.perf_counter() - self._began)


def fit(
    base: nn.Module, loss: Callable, batches: list[Batch], memopt: MemOpt | None, device: torch.device, peak: bool
) -> dict[str, Any]:
    """One fit from ``base``'s weights: each step's seconds and peak (CUDA always; CPU with ``peak``, exact and slow),
    the final weights on the CPU, MemOpt's techniques in force and its dry runs' seconds before the first batch."""
    probe, clock = PeakMemory() if peak else None, Clock(device)
    module = FineTune(copy.deepcopy(base), loss, batches)
    off = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    callbacks = [c for c in (memopt, probe, clock) if c is not None]
    trainer = pl.Trainer(accelerator=device.type, devices=1, max_epochs=1, **off, callbacks=callbacks)
    trainer.fit(module)
    report = memopt.report if memopt is not None else None
    found = {
        "seconds": clock.seconds,
        "peaks": probe.peaks if probe is not None else clock.peaks,
        "held": probe.held if probe is not None else [],
        "weights": {k: v.detach().to("cpu", copy=True) for k, v in module.model.state_dict().items()},
        "in_force": report.in_force if report is not None else None,
        "tuning_s": report.tuning_s if report is not None else None,
    }
    for name in ("log", "log_dict") if memopt is not None else ():  # Lightning binds them to the module: a callback
        vars(memopt).pop(name, None)  # reused by the next fit would keep this one's model alive (on CUDA, in its peak)
    del module, trainer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return found


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].numel()), default=0.0)


def measure(name: str, s: dict[str, int], plan: dict[str, int], device: torch.device) -> dict[str, Any]:
    """One workload at sizes ``s``: on CPU a peak fit per configuration first; then the timed fits, round-robin."""
    build, make_batch, loss = WORKLOADS[name]
    torch.manual_seed(0)
    base, g = build(s), torch.Generator().manual_seed(1)
    batches = [make_batch(g, s) for _ in range(plan["warmup"] + plan["steps"])]
    skip, rows = plan["warmup"], {c: {"seconds": [], "errors": []} for c in CONFIGS}
    data = {"sizes": s, "parameters": sum(p.numel() for p in base.parameters()), "configs": rows}
    # one callback per configuration: its dry runs (which choose the chunking at fit) run in its first fit alone,
    # before the first batch's clock starts; its later fits, of batches of the same shapes, reuse the choice
    callbacks = {c: make() if make is not None else None for c, (_, make) in CONFIGS.items()}
    reference: dict[str, torch.Tensor] | None = None
    for r in range(plan["rounds"]):
        for config in list(CONFIGS)[r % len(CONFIGS) :] + list(CONFIGS)[: r % len(CONFIGS)]:
            row, callback = rows[config], callbacks[config]
            try:
                if device.type == "cpu" and r == 0:  # exact peaks, in fits of their own (accounting slows steps)
                    found = fit(base, loss, batches[: skip + 1], callback, device, peak=True)
                    i = max(range(skip, len(found["peaks"])), key=found["peaks"].__getitem__)
                    row.update(peak_bytes=found["peaks"][i], held_at_peak=found["held"][i], tuning_s=found["tuning_s"])
                found = fit(base, loss, batches, callback, device, peak=False)
            except Exception as error:  # recorded; the other configurations go on
                row["errors"].append(f"{type(error).__name__}: {error}".splitlines()[0][:300])
                continue
            row["seconds"] += found["seconds"][skip:]
            row["in_force"] = found["in_force"]
            row.setdefault("tuning_s", found["tuning_s"])
            if device.type == "cuda":
                row["peak_bytes"] = max([row.get("peak_bytes", 0), *found["peaks"][skip:]])
            if config == "plain" and reference is None:
                reference = found["weights"]
            elif reference is not None:  # plain's own later rounds: the run-to-run floor
                diff = max_diff(found["weights"], reference)
                row["weights_max_abs_diff"] = max(row.get("weights_max_abs_diff", 0.0), diff)
        log(f"  {name} round {r + 1}/{plan['rounds']} done")
    plain = rows["plain"]
    for row in rows.values():
        row["median_s"] = statistics.median(row["seconds"]) if row["seconds"] else None
        if row["median_s"] and plain["median_s"]:
            row["time_over_plain"] = row["median_s"] / plain["median_s"]
            row["fastest_over_plain"] = min(row["seconds"]) / min(plain["seconds"])
        if row.get("peak_bytes") and plain.get("peak_bytes"):
            row["peak_over_plain"] = row["peak_bytes"] / plain["peak_bytes"]
    return data


# results -----------------------------------------------------------------------------------------------------------


def _cell(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def markdown(results: dict[str, Any]) -> str:
    meta, cuda = results["meta"], results["meta"]["device"] != "cpu"
    load = [", ".join(f"{x:.1f}" for x in meta[k]) for k in ("load_average_start", "load_average_end")]
    versions = ", ".join(f"{p} {meta[p]}" for p in ("torch", "lightning", "diffusers", "transformers"))
    peak = (
        "`torch.cuda.max_memory_allocated` over a step after `reset_peak_memory_stats`, the largest over timed steps"
        if cuda
        else "the exact CPU count of `PeakMemory` (weights, gradients, AdamW state, batch, activations) of the first "
        "step after the warm-up, in a fit of its own (exact accounting slows steps); `held` is what was alive then"
    )
    lines = [
        "# The training state at fit: gradients freed, the optimizer step in the backward pass, an 8-bit state",
        "",
        f"Suite `{meta['suite']}` on {meta['device']}, {meta['threads']} thread(s), {versions}; {meta['wall_s']:.0f} s "
        f"in all, at commit {meta['git'] or 'unknown'}. Generated by `benchmarks/training_state.py` (see "
        "benchmarks/README.md).",
        "",
        "**Timings are noisy**: the machine may have been shared with other processes (load average "
        f"{load[0]} at the start, {load[1]} at the end, over 1, 5, 15 min, on {meta['cpus']} CPUs). Nothing about "
        "speed is asserted; read the ratios as rough.",
        "",
        "AdamW (float32, lr 1e-3) on every weight, each fit a fresh `Trainer` from the same weights and batches. Time: "
        f"the median of {meta['rounds']} rounds x {meta['steps']} timed steps (after {meta['warmup']} untimed warm-up "
        "step(s) per fit), the configurations interleaved round-robin in one process, each round starting one later; "
        f"in brackets the fastest step over plain's fastest. Peak: {peak}. Weights: the largest absolute difference of "
        "the final weights from plain's first fit; plain's row, its later fits against its first, is the run-to-run "
        "floor (on CUDA, backward kernels such as memory-efficient attention's are not deterministic, and AdamW turns "
        "any difference in a gradient into one of up to its lr in the weights). Dry runs: the seconds MemOpt's dry "
        "runs took before the first batch of its first fit (not in the step time; the callback is reused by the later "
        "fits, which keep the choice). Every MemOpt runs with `measure=False`; `free gradients` and `optimizer in "
        "backward` (and the 8-bit rows) turn checkpointing, the chunked loss and chunking off, so that only the "
        "training state differs. The 8-bit rows keep AdamW's moments in 8 bits (`lossy=True`): their weights differ "
        "from plain's by more than the run-to-run floor, and the column says by how much.",
    ]
    for name, data in results["workloads"].items():
        lines += ["", f"## {name}", ""]
        if "error" in data:
            lines += [f"Failed: {data['error']}"]
            continue
        lines += [
            f"Sizes {data['sizes']}, {data['parameters']:,} parameters.",
            "",
            "| configuration | median step | time / plain | peak MiB | peak / plain | weights vs plain | dry runs |"
            + ("" if cuda else " held at peak, MiB |"),
            "|---|---|---|---|---|---|---|" + ("" if cuda else "---|"),
        ]
        errors = []
        for config, row in data["configs"].items():
            held = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in (row.get("held_at_peak") or {}).items() if v)
            cells = [
                CONFIGS[config][0],
                f"{_cell(row['median_s'] and row['median_s'] * 1e3, '.1f')} ms",
                f"{_cell(row.get('time_over_plain'), '.3f')} ({_cell(row.get('fastest_over_plain'), '.3f')})",
                _cell(row.get("peak_bytes") and row["peak_bytes"] / 2**20, ".1f"),
                _cell(row.get("peak_over_plain"), ".3f"),
                _cell(row.get("weights_max_abs_diff"), ".2e"),
                "" if row.get("tuning_s") is None else f"{row['tuning_s']:.1f} s",
                *([] if cuda else [held]),
            ]
            lines.append("| " + " | ".join(cells) + " |")
            errors += [f"- {CONFIGS[config][0]} failed: {e}" for e in row["errors"]]
        lines += ["", *errors] if errors else []
    return "\n".join(lines) + "\n"


def write(results: dict[str, Any], out: Path, started: float) -> None:
    write_results("training_state", results, markdown, out, started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round (CI)")
    parser.add_argument("--rounds", type=int, help="rounds of every configuration (default: the suite's)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default 1 on CPU)")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if not any("8bit" in name for name in CONFIGS):
        log("bitsandbytes is not installed: the 8-bit state's rows are left out")
    suite = "smoke" if args.smoke else "gpu" if device.type == "cuda" else "cpu"
    plan = {**PLANS[suite], **({"rounds": args.rounds} if args.rounds else {})}
    threads = args.threads or (1 if device.type == "cpu" else torch.get_num_threads())
    torch.set_num_threads(threads)
    try:  # the commit measured; a copy of the checkout without git has none
        git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    except OSError:
        git = subprocess.CompletedProcess([], 1, "")
    started, name_of = time.perf_counter(), torch.cuda.get_device_name if device.type == "cuda" else str
    versions = {p: importlib.metadata.version(p) for p in ("torch", "lightning", "diffusers", "transformers")}
    meta = dict(suite=suite, device=name_of(device), threads=threads, cpus=os.cpu_count(), **plan, **versions)
    meta.update(load_average_start=os.getloadavg(), git=git.stdout.strip() or None)
    results: dict[str, Any] = {"meta": meta, "workloads": {}}
    for name in args.workloads:
        log(f"{name} ({suite}, {device})")
        try:
            results["workloads"][name] = measure(name, SIZES[suite][name], plan, device)
        except Exception as error:
            results["workloads"][name] = {"error": f"{type(error).__name__}: {error}".splitlines()[0][:300]}
        write(results, args.out, started)  # after each workload: a run stopped at a time limit keeps the rest
    done = results["workloads"].items()
    failed = [n for n, d in done if "error" in d or any(r["errors"] for r in d["configs"].values())]
    if failed:
        log(f"failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
