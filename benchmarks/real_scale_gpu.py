"""Real-scale models on a GPU: ``estimate()`` against the allocator's peak of the real step, plain and with MemOpt,
and a budget of 80% of the plain peak, each through Lightning's Trainer with MemOpt as a callback.

The models are built on the device from configurations (the configs of ``examples/estimate_real_scale.py``, random
weights, nothing downloaded), in this order, the cheapest dry runs first so that a short budget covers the most
(``--only TEXT`` keeps those whose name or title holds TEXT):

- ``sd15``: an SD-1.5 UNet (860 M parameters), full fine-tune, fp32, AdamW, batch 1, 64x64 latents;
- ``llama_1b``: a Llama-3.2-1B-shaped language model (1.24 B), full fine-tune in bf16, AdamW, one sequence of 4,096
  tokens;
- ``llama_8b_lora``: a Llama-3-8B-shaped language model in bf16, frozen, LoRA r=16 on q/k/v/o (the adapters in fp32,
  as PEFT makes them), AdamW, one sequence of 4,096 tokens;
- ``latte``: Latte-1's video transformer (fp32) denoising 16 frames at 512x512 (one step, classifier-free guidance),
  then the SD VAE decoding the 16 frames: a predict step;
- ``sdxl_lora``: SDXL's UNet (2.57 B) in bf16 at 1024x1024 (128x128 latents), batch 1, frozen, with PEFT LoRA (r=16)
  on the attention projections (``to_q``, ``to_k``, ``to_v``, ``to_out.0``), AdamW on the adapters.

For each, on the device: ``estimate(module, batch, stage, device=...)`` (plain and ``MemOpt()``), then three real
batches through ``Trainer`` plain, with ``MemOpt(measure=False)``, and with ``MemOpt(memory_budget=B, measure=False)``,
B being 80% of the plain step's real peak; then a workload's extra runs (``Workload.extra``), each estimated and run as
the MemOpt one with a setting of its own: ``sd15`` with ``optimizer_in_backward="host"`` (the optimizer state in host
memory), ``llama_1b`` with ``checkpointing="offload"`` (each layer's input in host memory until its recomputation),
``llama_8b_lora`` with ``weights_8bit="nf4", lossy=True`` (the frozen weights in NF4, bitsandbytes), each with
its step's time against plain's (the second batch; also the last, on CUDA without the memory history's cost).
``measure=False`` only skips MemOpt's own probe of one batch; its dry runs still choose its settings before the first
batch. A small callback after MemOpt resets the allocator's peak at each batch's start and reads at its end
``max_memory_allocated`` and ``max_memory_reserved`` (after a warm-up that makes the cuBLAS workspaces, so they are in
the baseline, not in the step). The figures:

- ``allocated``: the batch's ``max_memory_allocated`` less the baseline (what was allocated before the model was
  built); ``reserved``: ``max_memory_reserved`` as it is (the allocator's cache included);
- the estimate's error on the second batch (the last step's gradients and the optimizer state alive, as the estimate
  counts them): ``(dry - allocated) / allocated``, signed: positive means the dry run said more than the step took;
- the budget: each batch's ``allocated``, and whether every batch from the second on stayed within B;
- at the peak of the second batch, plain and with MemOpt: the largest blocks alive that the step allocated (size, the
  innermost frame outside torch and Lightning), at most 10, and the same summed by frame; from
  ``torch.cuda.memory._record_memory_history`` over that batch and ``_snapshot()`` after it, the allocations replayed
  to the peak. Blocks alive from before the batch (weights, gradients, optimizer state, the batch) are summed apart.

Which fit an 80 GB H100 (78 GiB usable), from ``estimate()`` on the meta device on CPU (bytes as on a GPU, without the
allocator's rounding and cache), plain and with ``MemOpt()``: SD-1.5 14.56 / 13.03 GiB; Llama-3.2-1B bf16 4,096
tokens 20.80 / 10.19 GiB; Llama-3-8B LoRA bf16 4,096 tokens 46.03 / 17.25 GiB (the 16,384-token step, 138.79 GiB
plain, does not fit, hence 4,096); Latte-1 + VAE decode 16.27 / 5.58 GiB; SDXL LoRA bf16 at 1024x1024 12.46 /
5.58 GiB. Every plain step fits with room to spare, so plain is measured on every workload, at batch 1. Building the
Llama-3-8B as the example does (fp32, then bf16) takes 32 GB for a moment, before anything is measured. Those
estimates took 40, 32, 74, 40 and 90 s on 2 loaded CPU cores; each workload runs about three times that in dry runs
(``estimate()``, then MemOpt's plans for its two runs), so within ``gpu.sh``'s 240 s the first two or three run: the
rest in a call of their own (``--only``, ``--budget-s 540``).

Time: each workload's wall time is recorded; the whole run stays within ``--budget-s`` (default 300): a workload whose
expected time (``EXPECT_S``, rough: the dry runs take most of it, on the CPU) is more than what is left is skipped
with a line, and an alarm at the deadline stops the one running, which is recorded as stopped. ``SIGTERM`` (the
``timeout`` of ``gpu.sh``) stops it the same way. Results are written after every workload, so a stopped run keeps
what it measured. A failure in one workload (an out-of-memory error included) is recorded and the run goes on.

``--smoke`` runs tiny configs of the same five kinds (those of the example's ``--quick``) on the CPU, peaks counted
exactly by ``PeakMemory`` in place of the allocator's counters, and no snapshot: the check that this script runs.

    python -m benchmarks.real_scale_gpu --device cuda --out DIR        # on a GPU (benchmarks/gpu.sh runs it)
    python -m benchmarks.real_scale_gpu --smoke --out "$(mktemp -d)"   # tiny, on CPU: what CI runs

It writes ``DIR/real_scale_gpu.json`` (every figure) and ``DIR/real_scale_gpu.md`` (the table), the smoke run
``real_scale_gpu_smoke.*``. It exits with status 1 if a workload raised, 0 otherwise (also when some were skipped for
time); it asserts nothing about the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import io
import logging
import os
import platform
import signal
import sys
import time
import traceback
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from benchmarks.harness import write_results
from lightning_memopt import MemOpt, PeakMemory, estimate
from lightning_memopt.memory import free_memory, is_oom
from lightning_memopt.units import fmt_bytes, percent

warnings.filterwarnings("ignore", ".*does not have many workers.*")
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _example() -> Any:
    """``examples/estimate_real_scale.py`` as a module: its configs and its Llama modules."""
    path = Path(__file__).resolve().parents[1] / "examples" / "estimate_real_scale.py"
    spec = importlib.util.spec_from_file_location("estimate_real_scale", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("estimate_real_scale", module)
    spec.loader.exec_module(module)
    return module


ex = _example()

#: Batches per run: the first warms up, the second is measured, the third checks that the budget still holds.
BATCHES = 3
MEASURED = 1
#: The budget run's budget, as a fraction of the plain step's real peak (``allocated``).
BUDGET_FRACTION = 0.8
#: The most blocks listed per run at the peak.
TOP = 10
#: History entries kept while the measured batch is recorded (a real-scale step makes some 10^4 to 10^5).
MAX_ENTRIES = 1_000_000


# the modules: the example's Llama modules; UNet and Latte modules that make their timesteps on the batch's device ---


class UNetFit(pl.LightningModule):
    """Noise prediction on latents, as Stable Diffusion trains: the whole UNet with AdamW, or (``lora``) the UNet frozen
    in ``dtype`` with LoRA adapters on the attention projections. SDXL's batch also holds its pooled text embedding and
    its 6 size and crop ids (``added_cond_kwargs``). (The example's ``UNetTrainer`` draws its timesteps on the CPU.)"""

    def __init__(self, unet: dict, dtype: torch.dtype = torch.float32, lora: bool = False) -> None:
        super().__init__()
        from diffusers import UNet2DConditionModel

        self.unet = UNet2DConditionModel(**unet)
        if dtype != torch.float32:
            self.unet.to(dtype)
        if lora:
            from peft import LoraConfig

            self.unet.requires_grad_(False)
            targets = ["to_q", "to_k", "to_v", "to_out.0"]
            self.unet.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights="gaussian", target_modules=targets))
        self.lr = 1e-4 if lora else 1e-5

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        latents, text, *added = batch
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, 1000, (len(latents),), device=latents.device)
        extra = {"added_cond_kwargs": dict(zip(("text_embeds", "time_ids"), added, strict=True))} if added else {}
        pred = self.unet(latents + noise, timesteps, encoder_hidden_states=text, **extra).sample
        return nn.functional.mse_loss(pred.float(), noise.float())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


class LatteSample(ex.LatteSampler):
    """The example's Latte sampler (one denoising step with classifier-free guidance, then the VAE decode of every
    frame), its timesteps made on the batch's device."""

    @torch.no_grad()
    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        latents, captions = batch
        timestep = torch.full((2,), 500, dtype=torch.long, device=latents.device)
        out = self.transformer(torch.cat([latents, latents]), timestep=timestep, encoder_hidden_states=captions).sample
        uncond, cond = out[:, :4].chunk(2)
        latents = latents - 0.1 * (uncond + 7.5 * (cond - uncond))
        frames = latents[0].permute(1, 0, 2, 3)  # the frames as a batch of images
        return self.vae.decode(frames / self.vae.config.scaling_factor).sample


class LlamaLoRA(ex.LlamaLoRA):
    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return super().training_step(tuple(batch))


class LlamaFull(ex.LlamaFull):
    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return super().training_step(tuple(batch))


# the workloads -------------------------------------------------------------------------------------------------------


def _g() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _unet_batch(unet: dict, dtype: torch.dtype, sdxl: bool) -> tuple[torch.Tensor, ...]:
    side, g = unet["sample_size"], _g()
    batch = [torch.randn(1, 4, side, side, generator=g), torch.randn(1, 77, unet["cross_attention_dim"], generator=g)]
    if sdxl:
        pooled = unet["projection_class_embeddings_input_dim"] - 6 * unet["addition_time_embed_dim"]
        batch += [torch.randn(1, pooled, generator=g), torch.tensor([[1024.0, 1024, 0, 0, 1024, 1024]])]
    return tuple(t.to(dtype) for t in batch)


def _ids(llama: dict, tokens: int) -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, llama["vocab_size"], (1, tokens), generator=_g()),)


def _video(latte: dict) -> tuple[torch.Tensor, ...]:
    g, frames, side = _g(), latte["video_length"], latte["sample_size"]
    captions = torch.randn(2, 120, latte["caption_channels"], generator=g)
    return torch.randn(1, 4, frames, side, side, generator=g), captions


@dataclass(frozen=True)
class Workload:
    """A model built on the device (under ``torch.device``) and its batch (on the CPU, the loader's)."""

    name: str
    title: str
    stage: str  # "fit" or "predict"
    build: Callable[[bool], pl.LightningModule]  # smoke -> module
    batch: Callable[[bool], tuple[torch.Tensor, ...]]  # smoke -> batch
    expect_s: int  # roughly what it takes on an H100 machine, the dry runs included: skipped if less is left
    #: Extra runs after the budget's, each estimated and run as the ``memopt`` one: name -> MemOpt's options (with
    #: ``measure=False``), the error of its dry run and its step's time against plain's recorded.
    extra: dict[str, dict[str, Any]] = field(default_factory=dict)


#: --smoke's configs: the example's --quick ones, the UNets cut to fewer levels (their dry runs cost by the op).
SMOKE = {
    **ex.QUICK,
    "unet": dict(ex.QUICK["unet"], block_out_channels=(32,), down_block_types=("CrossAttnDownBlock2D",),
                 up_block_types=("CrossAttnUpBlock2D",)),
    "sdxl": dict(ex.QUICK["sdxl"], block_out_channels=(32, 64), transformer_layers_per_block=(1, 1),
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4)),
}  # fmt: skip


def _q(smoke: bool, key: str, real: dict) -> dict:
    return SMOKE[key] if smoke else real


WORKLOADS = [
    Workload(
        "sd15",
        "SD-1.5 UNet, full fine-tune, fp32, AdamW, batch 1, 64x64 latents",
        "fit",
        lambda smoke: UNetFit(_q(smoke, "unet", ex.SD_15_UNET)),
        lambda smoke: _unet_batch(_q(smoke, "unet", ex.SD_15_UNET), torch.float32, sdxl=False),
        90,  # 60 before its extra run (an estimate and three batches more)
        # the optimizer state in host memory, each parameter stepped there as its gradient arrives
        extra={"host": {"optimizer_in_backward": "host"}},
    ),
    Workload(
        "llama_1b",
        "Llama-3.2-1B, full fine-tune, bf16, AdamW, 4,096 tokens",
        "fit",
        lambda smoke: LlamaFull(_q(smoke, "llama_1b", ex.LLAMA_32_1B)),
        lambda smoke: _ids(_q(smoke, "llama_1b", ex.LLAMA_32_1B), 256 if smoke else 4096),
        80,  # 50 before its extra run
        # every decoder layer checkpointed with its input in host memory, brought back for its recomputation
        extra={"offload": {"checkpointing": "offload"}},
    ),
    Workload(
        "llama_8b_lora",
        "Llama-3-8B + LoRA r=16, bf16, AdamW, 4,096 tokens",
        "fit",
        lambda smoke: LlamaLoRA(_q(smoke, "llama", ex.LLAMA_3_8B)),
        lambda smoke: _ids(_q(smoke, "llama", ex.LLAMA_3_8B), 256 if smoke else 4096),
        140,  # 100 before its extra run
        # the frozen base weights in 4 bits (NF4, bitsandbytes)
        extra={"nf4": {"weights_8bit": "nf4", "lossy": True}},
    ),
    Workload(
        "latte",
        "Latte-1 + SD VAE decode, 16 frames at 512x512, fp32, predict",
        "predict",
        lambda smoke: LatteSample(_q(smoke, "latte", ex.LATTE_1), _q(smoke, "vae", ex.SD_VAE)),
        lambda smoke: _video(_q(smoke, "latte", ex.LATTE_1)),
        60,
    ),
    Workload(
        "sdxl_lora",
        "SDXL UNet + LoRA r=16, bf16, batch 1, 1024x1024 (128x128 latents)",
        "fit",
        lambda smoke: UNetFit(_q(smoke, "sdxl", ex.SDXL_UNET), torch.bfloat16, lora=True),
        lambda smoke: _unet_batch(_q(smoke, "sdxl", ex.SDXL_UNET), torch.bfloat16, sdxl=True),
        120,
    ),
]


class Repeat(Dataset):
    """The same batch ``n`` times (the loader's automatic batching off: each item is a whole batch)."""

    def __init__(self, batch: tuple[torch.Tensor, ...], n: int) -> None:
        self.batch, self.n = batch, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> list[torch.Tensor]:
        return list(self.batch)


# time ----------------------------------------------------------------------------------------------------------------


class OutOfTime(BaseException):
    """Raised by the alarm at the deadline or by SIGTERM: stops the workload running; the results are written."""


def _stop(signum: int, frame: Any) -> None:
    raise OutOfTime(f"stopped by {signal.Signals(signum).name}")


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """An alarm after ``seconds`` (and SIGTERM) raise :class:`OutOfTime` in the main thread while inside."""
    saved = signal.signal(signal.SIGALRM, _stop), signal.signal(signal.SIGTERM, _stop)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, saved[0])
        signal.signal(signal.SIGTERM, saved[1])


# measuring -----------------------------------------------------------------------------------------------------------


def warm_up(device: torch.device) -> None:
    """Matrix products forward, backward and recomputed in the backward pass, in fp32 and bf16, so that each thread
    that runs them (the main one, autograd's) has its cuBLAS workspace before the baseline is read."""
    from torch.utils.checkpoint import checkpoint

    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4, 64, 64, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)
        y = nn.functional.linear(x, w, w[0])
        z = checkpoint(nn.functional.linear, y, w, w[0], use_reentrant=False)
        torch.bmm(z @ w, y.transpose(1, 2)).float().sum().backward()


def settle(device: torch.device) -> int:
    """Free what is left, make the cuBLAS workspaces: the bytes allocated now, the baseline of a workload."""
    gc.collect()
    if device.type != "cuda":
        return 0
    warm_up(device)
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


class Meter(pl.Callback):
    """Each train or predict batch's peak and time; on CUDA the allocator's counters (reset at the batch's start),
    and the memory history recorded over batch ``record`` (``None``: none); on CPU ``PeakMemory``'s exact count."""

    def __init__(self, device: torch.device, baseline: int, record: int | None) -> None:
        self.device, self.baseline, self.record = device, baseline, record
        self.exact = PeakMemory()
        self.batches: list[dict[str, Any]] = []
        self.snapshot: dict[str, Any] | None = None
        self.snapshot_error: str | None = None
        self._recording = False
        self._started = 0.0

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            if batch_idx == self.record:
                self._recording = start_history()
        else:
            self.exact.on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._started = time.perf_counter()

    def _end(self, batch_idx: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - self._started
            stats = torch.cuda.memory_stats(self.device)
            self.batches.append(
                {
                    "batch": batch_idx,
                    "allocated": stats["allocated_bytes.all.peak"] - self.baseline,
                    "allocated_raw": stats["allocated_bytes.all.peak"],
                    "requested": stats.get("requested_bytes.all.peak", stats["allocated_bytes.all.peak"])
                    - self.baseline,
                    "reserved": stats["reserved_bytes.all.peak"],
                    "allocations": stats["allocation.all.peak"],
                    "seconds": round(seconds, 4),
                }
            )
            if self._recording:
                self._recording = False
                try:
                    self.snapshot = torch.cuda.memory._snapshot()
                except Exception as error:  # recorded; the figures above stand
                    self.snapshot_error = f"{type(error).__name__}: {error}"[:300]
                finally:
                    stop_history()
        else:
            self.exact.on_train_batch_end()
            seconds = time.perf_counter() - self._started
            peak = self.exact.peaks[-1]
            self.batches.append({"batch": batch_idx, "allocated": peak, "allocated_raw": peak, "requested": peak,
                                 "reserved": None, "allocations": None, "seconds": round(seconds, 4)})  # fmt: skip

    def on_before_optimizer_step(self, *args: Any) -> None:
        if self.device.type != "cuda":
            self.exact.on_before_optimizer_step(*args)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._end(batch_idx)

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._start(trainer, pl_module, batch, batch_idx)

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._end(batch_idx)


def start_history() -> bool:
    """Record every allocation and free with its Python stack, from an empty history; False where torch cannot."""
    record = torch.cuda.memory._record_memory_history
    try:
        try:
            record("all", context="alloc", stacks="python", max_entries=MAX_ENTRIES, clear_history=True)
        except TypeError:  # an older torch without clear_history
            record(None)
            record("all", context="alloc", stacks="python", max_entries=MAX_ENTRIES)
    except Exception:
        return False
    return True


def stop_history() -> None:
    with contextlib.suppress(Exception):
        torch.cuda.memory._record_memory_history(None)


#: Frames from these parts of a path are the machinery, not the model: the top user frame is the first one outside.
MACHINERY = ("/torch/", "/lightning/", "/lightning_fabric/", "/lightning_utilities/", "/contextlib.py", "/functools.py")


def _where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame outside torch and Lightning (file from its package on, line, function); the innermost
    frame where every frame is theirs; a word where there is none (autograd's thread runs the backward pass in C++)."""
    if not frames:
        return "no Python frame (autograd's backward thread, or C++)"
    chosen = next((f for f in frames if not any(m in f.get("filename", "") for m in MACHINERY)), frames[0])
    name = chosen.get("filename", "?")
    for marker in ("site-packages/", "dist-packages/", "/work/main/", "/lib/python"):
        if marker in name:
            name = name.split(marker, 1)[1]
            break
    return f"{name}:{chosen.get('line', '?')} {chosen.get('name', '?')}"


def blocks_at_peak(snapshot: dict[str, Any], device: int = 0, top: int = TOP) -> dict[str, Any]:
    """The blocks alive at the peak of the recorded history: the allocations replayed from the state before the first
    recorded event (the snapshot's live blocks, the history undone backwards) to the most bytes alive.

    A free counts when requested, as ``max_memory_allocated`` counts it. Returns the peak replayed, the bytes alive
    from before the history (weights, gradients, optimizer state, the batch), the ``top`` largest blocks the history
    allocated that are alive at the peak, and the same summed by frame.

    Examples:
        >>> frame = [{"filename": "/x/site-packages/diffusers/attention.py", "line": 7, "name": "forward"}]
        >>> snap = {"segments": [{"device": 0, "address": 0, "blocks": [
        ...     {"address": 0, "size": 512, "state": "active_allocated"},
        ...     {"address": 512, "size": 1024, "state": "active_allocated"}]}],
        ...     "device_traces": [[
        ...     {"action": "alloc", "addr": 2048, "size": 4096, "frames": frame},
        ...     {"action": "alloc", "addr": 512, "size": 1024, "frames": []},
        ...     {"action": "free_requested", "addr": 2048, "size": 4096, "frames": []},
        ...     {"action": "free_completed", "addr": 2048, "size": 4096, "frames": []}]]}
        >>> out = blocks_at_peak(snap)
        >>> out["peak_bytes"], out["before_bytes"], out["in_step_bytes"]
        (5632, 512, 5120)
        >>> [(b["bytes"], b["where"]) for b in out["blocks"]]
        [(4096, 'diffusers/attention.py:7 forward'), (1024, "no Python frame (autograd's backward thread, or C++)")]
    """
    trace = snapshot.get("device_traces", [[]])
    events = trace[device] if device < len(trace) else []
    live_end = {}
    for segment in snapshot.get("segments", []):
        if segment.get("device", device) != device:
            continue
        address = segment.get("address", 0)
        for block in segment.get("blocks", []):
            if block.get("state") == "active_allocated":
                live_end[block.get("address", address)] = block["size"]
            address = block.get("address", address) + block["size"]
    free_action = "free_requested" if any(e["action"] == "free_requested" for e in events) else "free_completed"
    live = dict(live_end)
    for event in reversed(events):  # undo the history: the state before its first event
        if event["action"] == "alloc":
            live.pop(event["addr"], None)
        elif event["action"] == free_action:
            live[event["addr"]] = event["size"]
    before = dict(live)
    total = peak = sum(live.values())
    peak_at = -1
    for index, event in enumerate(events):
        if event["action"] == "alloc":
            live[event["addr"]] = event["size"]
            total += event["size"]
        elif event["action"] == free_action and event["addr"] in live:
            total -= live.pop(event["addr"])
        if total > peak:
            peak, peak_at = total, index
    alive: dict[int, dict[str, Any]] = {}  # address -> the alloc event, of the blocks the history made alive at peak
    for event in events[: peak_at + 1]:
        if event["action"] == "alloc":
            alive[event["addr"]] = event
        elif event["action"] == free_action:
            alive.pop(event["addr"], None)
    blocks = sorted(alive.values(), key=lambda e: -e["size"])
    by_frame: dict[str, list[int]] = {}
    for event in blocks:
        entry = by_frame.setdefault(_where(event.get("frames", [])), [0, 0])
        entry[0] += event["size"]
        entry[1] += 1
    before_alive = sum(size for address, size in before.items() if address not in alive)
    return {
        "events": len(events),
        "truncated": len(events) >= MAX_ENTRIES,
        "peak_bytes": peak,
        "before_bytes": before_alive,
        "before_blocks": len(before),
        "in_step_bytes": sum(e["size"] for e in blocks),
        "in_step_blocks": len(blocks),
        "blocks": [
            {"bytes": e["size"], "size": fmt_bytes(e["size"]), "where": _where(e.get("frames", []))}
            for e in blocks[:top]
        ],
        "by_frame": [
            {"bytes": n, "size": fmt_bytes(n), "blocks": count, "where": where}
            for where, (n, count) in sorted(by_frame.items(), key=lambda item: -item[1][0])[:top]
        ],
    }


# one workload --------------------------------------------------------------------------------------------------------


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:400]


def _forget(module: pl.LightningModule, device: torch.device) -> None:
    """Between runs: no gradients left, no trainer held (its optimizer state goes with it), the cache emptied."""
    for p in module.parameters():
        p.grad = None
    module._trainer = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fit_or_predict(module: pl.LightningModule, stage: str, batch: tuple[torch.Tensor, ...], device: torch.device,
                   memopt: MemOpt | None, meter: Meter) -> None:  # fmt: skip
    trainer = pl.Trainer(
        accelerator=device.type,
        devices=1,
        max_steps=BATCHES,
        limit_train_batches=BATCHES,
        limit_predict_batches=BATCHES,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[c for c in (memopt, meter) if c is not None],
    )
    loader = DataLoader(Repeat(batch, BATCHES), batch_size=None)
    with contextlib.redirect_stdout(io.StringIO()):
        if stage == "fit":
            trainer.fit(module, train_dataloaders=loader)
        else:
            trainer.predict(module, dataloaders=loader, return_predictions=False)


def run_config(module: pl.LightningModule, work: Workload, batch: tuple[torch.Tensor, ...], device: torch.device,
               baseline: int, memopt: MemOpt | None, record: bool, out: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """One Trainer run of three batches into ``out`` (filled as it goes: a run stopped for time keeps its batches):
    its batches' figures, MemOpt's choice, and the blocks at the measured batch's peak (CUDA, ``record``)."""
    started = time.perf_counter()
    meter = Meter(device, baseline, MEASURED if record and device.type == "cuda" else None)
    out["batches"] = meter.batches
    try:
        fit_or_predict(module, work.stage, batch, device, memopt, meter)
    except OutOfTime:
        out["stopped"] = True
        raise
    except Exception as error:  # recorded: an out-of-memory error, a library's, ours
        out["error"] = _error(error)
        out["oom"] = is_oom(error)
        if out["oom"]:
            free_memory(device)
    finally:
        stop_history()
    out["batches"] = meter.batches
    if memopt is not None:
        report = memopt.report
        out["how"] = [f"{a.technique}: {a.method}" for a in memopt.applied]
        out["tuning_s"] = getattr(report, "tuning_s", None)
        out["checkpointed"] = getattr(report, "checkpointed", None)
        out["chunk_settings"] = getattr(report, "chunk_settings", None)
    if meter.snapshot is not None:
        try:
            out["at_peak"] = blocks_at_peak(meter.snapshot, device.index or 0)
        except Exception as error:
            out["at_peak"] = {"error": _error(error)}
    elif meter.snapshot_error:
        out["at_peak"] = {"error": meter.snapshot_error}
    meter.snapshot = None
    out["seconds"] = round(time.perf_counter() - started, 1)
    _forget(module, device)
    return out


def _measured(run: dict[str, Any]) -> int | None:
    batches = run.get("batches", [])
    return batches[MEASURED]["allocated"] if len(batches) > MEASURED else None


def _error_of(dry: int | None, real: int | None) -> float | None:
    return None if dry is None or not real else (dry - real) / real


def _build(work: Workload, device: torch.device, smoke: bool, result: dict[str, Any]) -> pl.LightningModule:
    """The workload's module, built on the device and kept there; its sizes and build time into ``result``."""
    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.device(device):
        module = work.build(smoke)
    module.to(device)
    # Lightning's teardown moves the module to the CPU after each run: kept on the device between the runs of a
    # workload (16 GB of Llama-3-8B weights would cross PCIe six times), as it is for each run's batches
    module.cpu = types.MethodType(lambda self: self, module)
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    result["build_s"] = round(time.perf_counter() - t, 1)
    result["parameters"] = sum(p.numel() for p in module.parameters())
    result["trainable"] = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return module


def _budget_run(module: pl.LightningModule, work: Workload, batch: tuple[torch.Tensor, ...], device: torch.device,
                baseline: int, real_plain: int | None, result: dict[str, Any]) -> None:  # fmt: skip
    """The run under a budget of 80% of plain's real peak, its batches against the budget into ``result``."""
    if real_plain is None:
        result["budget"] = {"skipped": "no plain peak to take 80% of"}
        return
    budget = int(BUDGET_FRACTION * real_plain)
    memopt = MemOpt(memory_budget=budget, measure=False)
    run = result["budget"] = {"budget_bytes": budget, "allocated": []}
    run_config(module, work, batch, device, baseline, memopt, False, run)
    peaks = [b["allocated"] for b in run["batches"]]
    run.update(
        allocated=peaks,
        over_budget=[p - budget for p in peaks],
        met_from_second=len(peaks) == BATCHES and all(p <= budget for p in peaks[1:]),
        met_every_batch=len(peaks) == BATCHES and all(p <= budget for p in peaks),
        # MemOpt's own word: no setting's dry run reached the budget (a miss there is not the loop's)
        out_of_reach=memopt.report is not None
        and any("is not met even with the settings" in note for note in memopt.report.notes),
    )


def _step_s(run: dict[str, Any], index: int) -> float | None:
    batches = run.get("batches", [])
    return batches[index]["seconds"] if len(batches) > index else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def _extra_runs(module: pl.LightningModule, work: Workload, batch: tuple[torch.Tensor, ...], device: torch.device,
                baseline: int, runs: dict[str, Any], errors: dict[str, Any]) -> None:  # fmt: skip
    """Each of ``work.extra``: estimated, then run as the ``memopt`` run is, with MemOpt's options; its dry run's
    error and its step's time against plain's (the second batch; ``_last``: the last, never recorded) recorded."""
    for name, options in work.extra.items():
        out = runs.setdefault(name, {"options": options})
        dry = None
        try:
            t = time.perf_counter()
            found = estimate(module, tuple(x.to(device) for x in batch), work.stage, device=device, **options)
            dry = out["dry_bytes"] = found.memopt.bytes
            out["dry_how"], out["estimate_s"] = found.how, round(time.perf_counter() - t, 1)
        except Exception as error:
            out["estimate_error"] = _error(error)
        try:
            run_config(module, work, batch, device, baseline, MemOpt(measure=False, **options), True, out)
        except Exception as error:  # MemOpt refusing its options: recorded as the run's failure
            out["error"] = _error(error)
        errors[name] = _error_of(dry, _measured(out))
        plain, last = runs.get("plain", {}), BATCHES - 1
        out["step_s"], out["plain_step_s"] = _step_s(out, MEASURED), _step_s(plain, MEASURED)
        out["time_vs_plain"] = _ratio(out["step_s"], out["plain_step_s"])
        out["time_vs_plain_last"] = _ratio(_step_s(out, last), _step_s(plain, last))


def run_workload(work: Workload, device: torch.device, smoke: bool) -> dict[str, Any]:
    """Build, estimate, run plain, with MemOpt, under a budget and the extra runs; every step guarded, its failure
    recorded."""
    started = time.perf_counter()
    result: dict[str, Any] = {"name": work.name, "title": work.title, "stage": work.stage}
    module = None
    try:
        baseline = settle(device)
        result["baseline_bytes"] = baseline
        module = _build(work, device, smoke, result)
        batch = work.batch(smoke)

        t = time.perf_counter()
        try:
            dry = estimate(module, tuple(x.to(device) for x in batch), work.stage, device=device)
            result["estimate"] = dry.as_dict()
            result["estimate_s"] = round(time.perf_counter() - t, 1)
            dry_plain, dry_memopt = dry.plain.bytes, dry.memopt.bytes
        except Exception as error:
            result["estimate"] = {"error": _error(error), "traceback": traceback.format_exc()[-2000:]}
            dry_plain = dry_memopt = None

        runs: dict[str, Any] = result.setdefault("runs", {})
        errors = result["error"] = {"definition": "(dry - allocated) / allocated on the second batch"}
        run_config(module, work, batch, device, baseline, None, True, runs.setdefault("plain", {}))
        real_plain = _measured(runs["plain"])
        errors["plain"] = _error_of(dry_plain, real_plain)
        run_config(module, work, batch, device, baseline, MemOpt(measure=False), True, runs.setdefault("memopt", {}))
        errors["memopt"] = _error_of(dry_memopt, _measured(runs["memopt"]))
        _budget_run(module, work, batch, device, baseline, real_plain, result)
        _extra_runs(module, work, batch, device, baseline, runs, errors)
    except OutOfTime as stop:
        result["stopped"] = f"{stop} at {time.perf_counter() - started:.0f} s into the workload"
    except Exception as error:
        result["failed"] = _error(error)
        result["traceback"] = traceback.format_exc()[-3000:]
        if is_oom(error):
            free_memory(device)
    finally:
        stop_history()
        del module
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


# output --------------------------------------------------------------------------------------------------------------


def _extra_lines(results: dict[str, Any]) -> list[str]:
    """The extra runs' table: each one's dry and real peaks, the error, and its step's time against plain's."""
    rows = []
    for r in results["workloads"]:
        for name, run in r.get("runs", {}).items():
            if name in ("plain", "memopt"):
                continue
            batches = run.get("batches", [])
            measured = batches[MEASURED] if len(batches) > MEASURED else {}
            ratio, last = run.get("time_vs_plain"), run.get("time_vs_plain_last")
            setting = ", ".join(f"{k}={v!r}" for k, v in run.get("options", {}).items())
            cells = [
                r["name"],
                f"{name} (`{setting}`)",
                fmt_bytes(run.get("dry_bytes")) if "dry_bytes" in run else run.get("estimate_error", "-")[:60],
                fmt_bytes(measured.get("allocated")) if measured else run.get("error", "-")[:60],
                fmt_bytes(measured.get("reserved")),
                percent(r.get("error", {}).get(name), signed=True),
                f"{run['step_s']:.3f} s / {run['plain_step_s']:.3f} s" if ratio is not None else "-",
                "-" if ratio is None else f"{ratio:.2f}x" + ("" if last is None else f" ({last:.2f}x)"),
            ]
            rows.append("| " + " | ".join(cells) + " |")
    if not rows:
        return []
    return [
        "",
        "Extra runs, each `MemOpt(measure=False, ...)` with its setting, estimated with the same options; time: the"
        " second batch's step against plain's (in brackets the last batch's, on CUDA the one without memory history).",
        "",
        "| workload | run | dry | allocated | reserved | error | step / plain's | time vs plain |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]


def _at_peak_lines(results: dict[str, Any]) -> list[str]:
    """Per run with a snapshot: the largest blocks alive at the second batch's peak, and the same by frame."""
    lines = []
    for r in results["workloads"]:
        for config, run in r.get("runs", {}).items():
            at = run.get("at_peak")
            if not at or "error" in at:
                continue
            lines += [
                "",
                f"**{r['name']}, {config}**: at the second batch's peak ({fmt_bytes(at['peak_bytes'])} replayed),"
                f" {fmt_bytes(at['before_bytes'])} alive from before the batch, {fmt_bytes(at['in_step_bytes'])} in"
                f" {at['in_step_blocks']} blocks allocated by it; the largest, and by frame:",
                "",
                "| block | where | | by frame | blocks | where |",
                "|---:|---|---|---:|---:|---|",
            ]
            for i in range(max(len(at["blocks"]), len(at["by_frame"]))):
                b = at["blocks"][i] if i < len(at["blocks"]) else {"size": "", "where": ""}
                f = at["by_frame"][i] if i < len(at["by_frame"]) else {"size": "", "blocks": "", "where": ""}
                lines.append(f"| {b['size']} | {b['where']} | | {f['size']} | {f['blocks']} | {f['where']} |")
    return lines


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [
        f"# Real scale on {meta['device_name']}",
        "",
        f"torch {meta['torch']}, {meta['mode']}, {meta['wall_s']:.0f} s of a {meta['budget_s']} s budget.",
        "",
        "Peaks on the second batch: `allocated` is `max_memory_allocated` less the baseline (on CPU the exact count);"
        " `reserved` is `max_memory_reserved`; error is (dry - allocated) / allocated. The budget is 80% of plain's"
        " allocated peak; met: every batch from the second on within it.",
        "",
        "| workload | dry plain | allocated plain | reserved plain | error | dry MemOpt | allocated MemOpt |"
        " reserved MemOpt | error | budget | budget run, each batch | met | wall |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for r in results["workloads"]:
        if "skipped" in r:
            lines.append(f"| {r['name']} | skipped: {r['skipped']} |" + " |" * 12)
            continue
        est = r.get("estimate", {})
        runs = r.get("runs", {})
        cells = [r["name"]]
        for config in ("plain", "memopt"):
            run = runs.get(config, {})
            batches = run.get("batches", [])
            measured = batches[MEASURED] if len(batches) > MEASURED else {}
            cells += [
                fmt_bytes(est.get(config, {}).get("peak_bytes")),
                fmt_bytes(measured.get("allocated")) if measured else run.get("error", "-")[:60],
                fmt_bytes(measured.get("reserved")),
                percent(r.get("error", {}).get(config), signed=True),
            ]
        budget = r.get("budget", {})
        if "budget_bytes" in budget:
            each = ", ".join(fmt_bytes(p) for p in budget["allocated"]) or budget.get("error", "-")[:60]
            met = budget.get("met_from_second")
            cells += [fmt_bytes(budget["budget_bytes"]), each, "-" if met is None else "yes" if met else "**no**"]
        else:
            cells += ["-", budget.get("skipped", "-"), "-"]
        cells.append(f"{r['wall_s']:.0f} s")
        note = r.get("failed") or r.get("stopped")
        if note:
            cells[0] += f" ({note[:80]})"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + _extra_lines(results) + _at_peak_lines(results)) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cuda (the default where there is one) or cpu (with --smoke)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--smoke", action="store_true", help="tiny configs of the same kinds: the check that it runs")
    parser.add_argument("--only", metavar="TEXT", help="only the workloads whose name or title holds TEXT")
    parser.add_argument("--budget-s", type=float, default=300.0, help="the whole run's seconds (default 300)")
    args = parser.parse_args()
    started = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("real scale needs a GPU: pass --device cuda, or --smoke for tiny configs on CPU")
    if device.type == "cpu":
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    chosen = [w for w in WORKLOADS if not args.only or args.only.lower() in (w.name + " " + w.title).lower()]
    if not chosen:
        raise SystemExit(f"no workload's name or title holds {args.only!r}")
    name = "real_scale_gpu_smoke" if args.smoke else "real_scale_gpu"
    results: dict[str, Any] = {
        "meta": {
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "memory_bytes": torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None,
            "mode": "smoke (tiny configs)" if args.smoke else "real scale",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "budget_s": args.budget_s,
            "batches": BATCHES,
            "measured_batch": MEASURED,
            "budget_fraction": BUDGET_FRACTION,
            "load_average_start": os.getloadavg(),
        },
        "workloads": [],
    }
    failed = stopped = False
    for work in chosen:
        left = args.budget_s - (time.perf_counter() - started)
        need = 5 if args.smoke else work.expect_s
        if stopped or left < need:
            line = "the run was stopped" if stopped else f"{left:.0f} s left, it takes about {need} s"
            print(f"[real_scale_gpu] skipped {work.name}: {line}", flush=True)
            results["workloads"].append({"name": work.name, "title": work.title, "skipped": line})
            continue
        print(f"[real_scale_gpu] {work.name}: {work.title} ({left:.0f} s left)", flush=True)
        with deadline(left):
            result = run_workload(work, device, args.smoke)
        failed |= "failed" in result or any("error" in r for r in result.get("runs", {}).values())
        results["workloads"].append(result)
        print(f"[real_scale_gpu] {work.name}: {summary(result)}", flush=True)
        write_results(name, results, markdown, args.out, started)
        stopped = "stopped" in result  # out of time, or told to stop: the rest are skipped
    if stopped or not any("wall_s" in r for r in results["workloads"]):
        write_results(name, results, markdown, args.out, started)
    sys.exit(1 if failed else 0)


def summary(r: dict[str, Any]) -> str:
    """One line: the dry and real peaks, the error, the budget, the extra runs (their time against plain's) and the
    time."""
    if "failed" in r:
        return f"FAILED: {r['failed']} ({r['wall_s']:.0f} s)"
    parts = []
    for config in ("plain", "memopt"):
        run = r.get("runs", {}).get(config, {})
        dry = r.get("estimate", {}).get(config, {}).get("peak_bytes")
        real = _measured(run)
        error = percent(r.get("error", {}).get(config), signed=True)
        parts.append(f"{config} dry {fmt_bytes(dry)} real {fmt_bytes(real)} ({error})"
                     + (f" error {run['error']}" if "error" in run else ""))  # fmt: skip
    budget = r.get("budget", {})
    if "budget_bytes" in budget:
        each = ", ".join(fmt_bytes(p) for p in budget["allocated"])
        met = budget.get("met_from_second")
        reach = " (out of reach: no setting's dry run holds less)" if budget.get("out_of_reach") else ""
        parts.append(f"budget {fmt_bytes(budget['budget_bytes'])}: {each}, met from the 2nd: {met}{reach}")
    for name, run in r.get("runs", {}).items():
        if name not in ("plain", "memopt"):
            error = percent(r.get("error", {}).get(name), signed=True)
            ratio = run.get("time_vs_plain")
            ratio = "unknown" if ratio is None else f"{ratio:.2f}x"
            failure = f" error {run['error']}" if "error" in run else ""
            dry, real = fmt_bytes(run.get("dry_bytes")), fmt_bytes(_measured(run))
            parts.append(f"{name} dry {dry} real {real} ({error}), time vs plain {ratio}{failure}")
    if "stopped" in r:
        parts.append(r["stopped"])
    return "; ".join(parts) + f" ({r['wall_s']:.0f} s)"


if __name__ == "__main__":
    main()
