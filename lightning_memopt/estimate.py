"""Will it fit? The peak memory of a training or predict step, with and without MemOpt, before anything runs.

:func:`estimate` dry-runs the LightningModule's own ``training_step`` (with its backward pass, and the gradients and
optimizer state of a later step) or ``predict_step`` on fake tensors: no computation, no real memory. A model built on
the meta device (``with torch.device("meta"): model = MyModule()``) holds no weights at all, so the step of a model
of any size can be studied on a laptop: a 4 GiB video transformer is estimated in about a second. On CPU the figures
are what the real step allocates, to the byte. For CUDA the tensors' bytes (*requested*) are replayed through a model of
the caching allocator (:mod:`lightning_memopt.allocator`), which gives the *allocated* and *reserved* peaks that
``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` report; ``device="cuda"`` works on a machine without a
GPU too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch

import lightning_memopt.plans as plans
from lightning_memopt.allocator import Event, replay
from lightning_memopt.compat import in_backward
from lightning_memopt.engine.config import MemOptConfig, refuse_unknown
from lightning_memopt.engine.report import MemOptReport
from lightning_memopt.engine.stage import Hooks
from lightning_memopt.engine.stage import Stage as StageRun
from lightning_memopt.engine.step import (
    GRADIENT_HOOKS,
    STEPS,
    DryRun,
    Stage,
    StepContext,
    dry_run_step,
    hooks_defined,
)
from lightning_memopt.kernels import cuda_kernels, described
from lightning_memopt.progress import planning
from lightning_memopt.ranks import Ranks, ranks
from lightning_memopt.timeline import Timeline
from lightning_memopt.tuning import resolve_budget
from lightning_memopt.units import Recomputed, fmt_bytes, fmt_flops, fmt_parts

_PRECISIONS = {"32-true": None, "32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@dataclass
class Peak:
    """One dry run's figures: the peak, where it was reached, what was alive from the start, and what held the peak.

    Attributes:
        bytes: The peak on the device (``None``: the step could not be traced).
        where: The part of the model running at the peak, in words; ``path``: its module.
        live: The bytes alive from the start, by what they are (``weights``, ``batch``, ``gradients``, ``optimizer``
            and DDP's ``buckets``).
        by_kind: The bytes alive at the peak by kind (:data:`~lightning_memopt.memory.KINDS`: ``weights`` are the
            parameters and buffers, ``optimizer`` the optimizers' state, ``activations`` what the forward and backward
            passes allocate, ``other`` the optimizer step's temporaries), summing to ``bytes``.
        elsewhere: The peak bytes on each other device (the host, in an estimate for an accelerator), by device type
            (``"host"``: the host's, counted apart where the dry runs stand in for a GPU this machine does not have).
        phases: The peak of each phase of the step that ran (:data:`~lightning_memopt.timeline.PHASES`: ``forward``,
            ``backward``, ``recomputation``, ``optimizer step``), in bytes on the device.
        allocated: For CUDA, the peak of the blocks the caching allocator hands out (``max_memory_allocated``), from
            :func:`~lightning_memopt.allocator.replay` of this dry run's allocations and frees on the device, with
            cuBLAS's workspace where it is known (:attr:`Estimate.cublas_workspace`); ``None`` on another device.
        reserved: For CUDA, the peak of the segments the allocator reserves (``max_memory_reserved``), likewise; what
            a step needs free on the GPU beside the CUDA context. ``None`` on another device.
    """

    bytes: int | None
    where: str = "unknown"
    path: str = ""
    live: dict[str, int] = field(default_factory=dict)
    by_kind: dict[str, int] = field(default_factory=dict)
    elsewhere: dict[str, int] = field(default_factory=dict)
    phases: dict[str, int] = field(default_factory=dict)
    allocated: int | None = None
    reserved: int | None = None


@dataclass
class Estimate(Recomputed):
    """The peak memory of one step without and with MemOpt's changes, from dry runs on fake tensors.

    Attributes:
        stage: ``fit`` (forward and backward, a later step's gradients and optimizer state alive), ``predict``,
            ``validate`` or ``test`` (that loop's step, without gradients).
        device: The device the figures are for.
        plain: The step as the model is.
        memopt: The step with MemOpt's changes: every block checkpointed (or as many as the budget needs) at fit, the
            chunk settings and VAE decode modes MemOpt chooses in the other loops.
        how: What MemOpt changed, in words.
        budget_bytes: The budget the settings were chosen for, if any.
        seconds: The wall time of the whole ``estimate()`` call (its dry runs, the planner's, and the rest).
        notes: Anything that limited the estimate (a step that cannot be traced, a model with nothing to change).
        recompute_flops: At fit, the FLOPs the checkpointed blocks compute again in the backward pass.
        forward_flops: At fit, the FLOPs of the forward pass without MemOpt; ``recompute_fraction`` is the ratio.
        saved_by: Where the stage's planner chose settings, what each technique's settings save, by its name, as the
            planner's cost table models it (bytes).
        ranks: The number of ranks the figures are one rank's of (1: one process); ``strategy``: the strategy's
            class name, where one was given.
        cublas_workspace: For CUDA, the bytes of cuBLAS's workspace counted in ``allocated`` and ``reserved``, once
            for each thread that runs a matrix product (the step's and, at fit, autograd's for the backward pass);
            ``None`` where it is not counted (another device, or a GPU whose compute capability is unknown here).
    """

    stage: str
    device: str
    plain: Peak
    memopt: Peak
    how: str
    budget_bytes: int | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    recompute_flops: int | None = None
    forward_flops: int | None = None
    saved_by: dict[str, int] = field(default_factory=dict)
    ranks: int = 1
    strategy: str | None = None
    cublas_workspace: int | None = None

    @property
    def saved_fraction(self) -> float | None:
        if self.plain.bytes is None or self.memopt.bytes is None or not self.plain.bytes:
            return None
        return 1 - self.memopt.bytes / self.plain.bytes

    def as_dict(self) -> dict[str, Any]:
        """The figures as plain values, for JSON."""
        runs = {"plain": self.plain, "memopt": self.memopt}
        return {
            "stage": self.stage,
            "device": self.device,
            "how": self.how,
            "budget_bytes": self.budget_bytes,
            "saved_fraction": self.saved_fraction,
            "recompute_flops": self.recompute_flops,
            "forward_flops": self.forward_flops,
            "recompute_fraction": self.recompute_fraction,
            "saved_by": self.saved_by,
            "seconds": self.seconds,
            "ranks": self.ranks,
            "strategy": self.strategy,
            "cublas_workspace_bytes": self.cublas_workspace,
            "notes": self.notes,
            **{
                k: {
                    "peak_bytes": p.bytes,
                    "where": p.where,
                    "module": p.path,
                    "live_bytes": p.live,
                    "by_kind": p.by_kind,
                    "elsewhere_peak_bytes": p.elsewhere,
                    "phase_peak_bytes": p.phases,
                    "allocated_peak_bytes": p.allocated,
                    "reserved_peak_bytes": p.reserved,
                }
                for k, p in runs.items()
            },
        }

    def fits(self, budget: int) -> bool | None:
        """Whether the step with MemOpt's changes stays within ``budget`` bytes (``None``: unknown)."""
        return None if self.memopt.bytes is None else self.memopt.bytes <= budget

    def rows(self) -> list[tuple[str, ...]]:
        """One row per run: the configuration, its peak, what held it by kind, and where the peak is."""
        rows = []
        for label, peak in (("plain", self.plain), (f"MemOpt: {self.how}", self.memopt)):
            held = fmt_parts(peak.by_kind)
            held += "".join(f"; on {device} {fmt_bytes(n)} more" for device, n in peak.elsewhere.items() if n)
            where = f"{peak.where} ({peak.path})" if peak.path else peak.where
            rows.append((label, fmt_bytes(peak.bytes), held, where))
        return rows

    def __str__(self) -> str:
        on = f"{self.device}, per rank of {self.ranks} under {self.strategy}" if self.ranks > 1 else self.device
        head = f"MemOpt estimate, {self.stage} on {on} (dry runs on fake tensors, {self.seconds:.1f} s in all)"
        if self.budget_bytes is not None:
            head += f", budget {fmt_bytes(self.budget_bytes)}"
        table = [("run", "peak", "held at the peak", "peak reached in"), *self.rows()]
        widths = [max(len(r[i]) for r in table) for i in range(4)]
        lines = [head] + ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
        for label, peak in (("plain", self.plain), ("with MemOpt", self.memopt)):
            if len(peak.phases) > 1:
                lines.append(f"  the peak of each phase, {label}: {fmt_parts(peak.phases)}")
        if self.device.startswith("cuda"):
            lines.append(
                "  the caching allocator (modelled): "
                + "; ".join(
                    f"{label} allocated {fmt_bytes(peak.allocated)}, reserved {fmt_bytes(peak.reserved)}"
                    for label, peak in (("plain", self.plain), ("with MemOpt", self.memopt))
                )
            )
        if self.recompute_flops is not None:
            share = (
                f" ({self.recompute_fraction:.1%} of the forward pass)" if self.recompute_fraction is not None else ""
            )
            lines.append(f"  recomputed in the backward pass: {fmt_flops(self.recompute_flops)}{share}")
        if self.saved_by:
            saved = ", ".join(f"{name} {fmt_bytes(n)}" for name, n in self.saved_by.items())
            lines.append(f"  saved by each technique, as the planner's cost table models it: {saved}")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def estimate(
    module: pl.LightningModule,
    batch: Any,
    stage: Stage = "fit",
    device: str | torch.device | None = None,
    precision: str = "32-true",
    strategy: Any = None,
    devices: int | None = None,
    **memopt: Any,
) -> Estimate:
    """Estimate the peak memory of ``module``'s step on ``batch``, with and without MemOpt, without running it.

    Args:
        module: The LightningModule; it may be built on the meta device. Nothing of it is changed.
        batch: A batch as the stage's step receives it (its tensors may be on the meta device).
        stage: ``fit``, ``predict``, ``validate`` or ``test``.
        device: The device to estimate for: by default the module's, and ``"cpu"`` for a module on the meta device.
            ``"cuda"`` also without a GPU: the dry runs run on the CPU's fake tensors, every byte counted as the
            GPU's, with the caching allocator's ``allocated`` and ``reserved`` peaks and attention as a GPU's kernels
            keep it (``lightning_memopt/kernels.py``). No dry run sees a kernel's scratch (cuDNN's workspaces);
            cuBLAS's workspace is counted where its size is known (:attr:`Estimate.cublas_workspace`).
        precision: ``"32-true"``, ``"bf16-mixed"`` or ``"16-mixed"`` (autocast, as Lightning's precision plugin).
        strategy: For one rank of several: ``"ddp"`` (or a ``DDPStrategy``) with ``devices``, or a
            ``ModelParallelStrategy`` (FSDP2: ``configure_model`` runs on a deep copy under a device mesh of that many
            ranks). A fake process group stands in for the ranks in this process; ``batch`` is one rank's, and so are
            the figures.
        devices: The number of ranks (for ``"ddp"``; for a ``ModelParallelStrategy``, its sizes' product by default).
        **memopt: :class:`~lightning_memopt.MemOpt` arguments: ``memory_budget``, ``checkpointing``,
            ``chunked_loss``, ``chunking``, ``chunk_size``, ``chunk_dim``, ``models``, ``checkpoint_blocks``,
            ``free_gradients``, ``optimizer_in_backward``, ``optimizer_state_8bit``, ``weights_8bit``, ``lossy``.

    Returns:
        An :class:`Estimate`; ``str()`` of it is a small table.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> class Encoder(pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
        ...         self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        ...     def training_step(self, batch, batch_idx):
        ...         return self.encoder(batch).pow(2).mean()
        ...     def configure_optimizers(self):
        ...         return torch.optim.AdamW(self.parameters())
        >>> result = estimate(Encoder(), torch.zeros(8, 128, 64), stage="fit")
        >>> result.memopt.bytes < result.plain.bytes, result.how
        (True, 'checkpointing 4 of 4 blocks; gradients freed after the optimizer step')
    """
    _check(stage, precision)
    started = time.perf_counter()
    refuse_unknown(memopt, "estimate()")
    options = MemOptConfig(**memopt)
    target = torch.device(device) if device is not None else _device_of(module)
    run_on = _runs_on(target, options)
    budget = resolve_budget(options.memory_budget, target)
    result = _kept(module, batch, stage, target, precision, options, budget, run_on, strategy, devices)
    result.seconds = time.perf_counter() - started
    return result


def _key(
    module: pl.LightningModule,
    batch: Any,
    stage: Stage,
    target: torch.device,
    precision: str,
    options: MemOptConfig,
    budget: int | None,
    strategy: Any,
    devices: int | None,
) -> str | None:
    """The key an estimate is kept under between calls (:mod:`~lightning_memopt.plans`); ``None``: not kept."""
    if plans.path() is None:
        return None
    plain = (int, float, str, bool, type(None))
    described = strategy if isinstance(strategy, (str, type(None))) else [
        type(strategy).__qualname__, {k: v for k, v in vars(strategy).items() if isinstance(v, plain)}
    ]  # fmt: skip
    return plans.key_of(
        "estimate", stage, plans.tree(module), plans.layout(batch), str(target), precision,
        dataclasses.asdict(options), budget, described, devices, plans.source(type(module), STEPS[stage]),
    )  # fmt: skip


def _kept(module: pl.LightningModule, batch: Any, stage: Stage, target: torch.device, precision: str,
          options: MemOptConfig, budget: int | None, run_on: torch.device, strategy: Any,
          devices: int | None) -> Estimate:  # fmt: skip
    """The estimate kept for these arguments (:mod:`~lightning_memopt.plans`), else a new one, kept where both its
    figures are known."""
    key = _key(module, batch, stage, target, precision, options, budget, strategy, devices)
    kept = _recalled(key)
    if kept is not None:
        return kept
    with ranks(module, strategy, devices, stage) as one, planning(f"the estimate of {stage}"):
        result = _estimate(one, batch, stage, target, precision, options, budget, run_on)
    if result.plain.bytes is not None and result.memopt.bytes is not None:
        plans.keep(key, estimate=dataclasses.asdict(result))
    return result


def _recalled(key: str | None) -> Estimate | None:
    """The estimate kept under ``key`` (:mod:`~lightning_memopt.plans`), its notes saying so; ``None``: none is."""
    kept = plans.recall(key)
    figures = kept.get("estimate") if kept is not None else None
    if not isinstance(figures, dict):
        return None
    result = Estimate(**{**figures, "plain": Peak(**figures["plain"]), "memopt": Peak(**figures["memopt"])})
    result.notes.append(f"reused the estimate made at {kept['when']} ({plans.path()}), of the same model, batch,"
                        " options and libraries: delete that file to estimate anew")  # fmt: skip
    return result


def _check(stage: str, precision: str) -> None:
    if stage not in ("fit", "predict", "validate", "test"):
        raise ValueError(f"`stage` must be 'fit', 'predict', 'validate' or 'test', got {stage!r}")
    if precision not in _PRECISIONS:
        raise ValueError(f"`precision` must be one of {sorted(_PRECISIONS)}, got {precision!r}")


def _runs_on(target: torch.device, options: MemOptConfig) -> torch.device:
    """Where the dry runs' fake tensors are for an estimate of ``target``: on it, or on the CPU for a GPU this machine
    does not have; a device this torch cannot stand in for, or a budget given as a share of its memory, is refused."""
    if target.type in ("cpu", "meta") or _available(target):
        return target
    if target.type != "cuda":
        raise ValueError(
            f"`device` {str(target)!r} is not available to this torch: estimate for 'cpu' or 'cuda', which give"
            " the same bytes up to differences between kernels"
        )
    if isinstance(options.memory_budget, float) or options.memory_budget == "auto":
        raise ValueError(
            f"`memory_budget` {options.memory_budget!r} is a share of the memory of {str(target)!r}, which this"
            " machine does not have: give it in bytes (such as '12GiB')"
        )
    return torch.device("cpu")


def _estimate(
    one: Ranks,
    batch: Any,
    stage: Stage,
    target: torch.device,
    precision: str,
    options: MemOptConfig,
    budget: Any,
    run_on: torch.device,
) -> Estimate:
    module = one.module
    workspace = cublas_workspace(target) if target.type == "cuda" else None
    context = StepContext(
        world_size=one.world_size,
        strategy=one.strategy,
        gradient_buckets=one.gradient_buckets,
        optimizers=_optimizers(module) if stage == "fit" else [],
        precision=_autocast(run_on, _PRECISIONS[precision]),
        precision_name=precision,
        automatic=module.automatic_optimization,
        readers=hooks_defined([module], GRADIENT_HOOKS),
        zero_grad_readers=hooks_defined([module], ("on_before_zero_grad",)),
    )
    notes = _device_notes(target, run_on, precision, workspace)
    recorders = [_Recorder(workspace) if target.type == "cuda" else None for _ in range(2)]
    report = MemOptReport(stage, str(run_on))
    modes = [(m, m.training) for m in module.modules()]
    module.train(stage == "fit")
    try:
        with cuda_kernels() if run_on != target else contextlib.nullcontext() as calls:
            plain, optimized, how, attention = _dry_runs(
                context, module, batch, stage, options, report, notes, recorders, run_on, calls, target
            )
    finally:
        for m, training in modes:
            m.training = training
    if attention:
        notes.append(described(attention))
    notes += report.notes + [n for n in (plain.note, optimized.note) if n] + plain.remarks
    metrics = [(name, k, v) for name, section in report.sections.items() for k, v in section.metrics.items()]
    saved = {name: v for name, k, v in metrics if k.endswith("_saved_bytes") and v}
    return Estimate(
        stage,
        str(target),
        _peak(plain, recorders[0]),
        _peak(optimized, recorders[1]),
        how,
        budget,
        0.0,
        list(dict.fromkeys(notes)),
        report.recompute_flops,
        report.forward_flops,
        saved,
        one.world_size,
        type(one.strategy).__name__ if one.strategy is not None else None,
        workspace,
    )


def _device_notes(target: torch.device, run_on: torch.device, precision: str, workspace: int | None) -> list[str]:
    """What an estimate for ``target`` says about the device before anything runs."""
    notes = []
    if run_on != target:
        notes.append(
            f"{target} is not on this machine: the dry runs ran on the CPU's fake tensors, every byte counted as the"
            " GPU's, the planner's times priced at this CPU's speeds"
            + (", autocast by its CPU rules" if _PRECISIONS[precision] is not None else "")
        )
    if target.type == "cuda" and workspace is None:
        notes.append(
            "cuBLAS's workspace is not counted in allocated and reserved: its size depends on the GPU (8.12 MiB per"
            " thread running matrix products, 32 MiB on a Hopper GPU), unknown here; CUBLAS_WORKSPACE_CONFIG sets it"
        )
    return notes


def _dry_runs(
    context: StepContext,
    module: pl.LightningModule,
    batch: Any,
    stage: Stage,
    options: MemOptConfig,
    report: MemOptReport,
    notes: list[str],
    recorders: list[_Recorder | None],
    run_on: torch.device,
    calls: Counter[str] | None,
    target: torch.device,
) -> tuple[DryRun, DryRun, str, Counter[str] | None]:
    """The plain step's dry run, then MemOpt's choice and the step's dry run with it: both runs, what MemOpt did in
    words, and the attention calls of one plain step (where a GPU's kernels were counted)."""
    plain, _ = _runner(context, module, batch, stage, run_on, recorders[0])()
    attention = Counter(calls) if calls is not None else None  # one step's calls, before the planner's
    quiet = Hooks(context=lambda: context, device=run_on, target=target, warn=_silent, say=_silent)
    # only the techniques that are on; what they skip or leave unused goes into the notes
    pipeline = StageRun.open(stage, module, options, report, quiet, notes.append, notes.append, True, device=run_on)
    if pipeline is None:  # no technique of the stage is on (chunking=False at predict): the step is the plain one
        recorders[1] = recorders[0]
        return plain, plain, "nothing to change", attention
    completed = False
    try:
        if pipeline.changes.applied:  # MemOpt's choice for this step, in force
            pipeline.plan(module, batch)
        how = pipeline.changes.describe() or "nothing to change"
        changed = pipeline.changes.step_context(context)
        optimized, _ = _runner(changed, module, batch, stage, run_on, recorders[1])()
        completed = True
    finally:
        pipeline.close(completed)
    return plain, optimized, how, attention


def _silent(line: str) -> None:
    """An estimate says nothing while it runs: what limited it is in its notes."""


def _runner(
    context: StepContext,
    module: pl.LightningModule,
    batch: Any,
    stage: Stage,
    device: torch.device,
    recorder: _Recorder | None = None,
):
    def run() -> tuple[DryRun, float]:
        dry = dry_run_step(
            context,
            module,
            batch,
            0,
            stage,
            steady=stage == "fit",
            device=device,
            watch=(lambda probe: Timeline(probe, module)) if recorder is None else recorder.watching(module),
        )
        return dry, dry.seconds

    return run


#: The ops that run through cuBLAS, whose first call in a thread allocates that thread's workspace.
_MATMULS = {
    getattr(torch.ops.aten, name)
    for name in ("mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "_addmm_activation")
}


class _Recorder:
    """Records a dry run's allocations and frees on the device (:meth:`CPUPeakTracker.record`) for the allocator
    model, with cuBLAS's workspace (``workspace`` bytes, if known) allocated where each thread runs its first matrix
    product: the step's thread, and on a GPU autograd's device thread for the backward pass, each with a handle and
    a workspace of its own, kept for the life of the process."""

    def __init__(self, workspace: int | None) -> None:
        self.workspace = workspace
        self.events: list[Event] = []
        self.threads: set[str] = set()  # the threads that ran a matrix product

    def watching(self, module: pl.LightningModule) -> Callable[[Any], Any]:
        @contextlib.contextmanager
        def watch(probe: Any) -> Any:
            with Timeline(probe, module) as timeline:
                tracker = probe.tracker
                self.events, self.threads = tracker.record(), set()
                inner = tracker.on_op

                def on_op(func: Any, args: Any, kwargs: Any, out: Any) -> None:
                    if inner is not None:
                        inner(func, args, kwargs, out)
                    if getattr(func, "overloadpacket", None) in _MATMULS:
                        thread = "backward" if in_backward() else "step"
                        if thread not in self.threads:
                            self.threads.add(thread)
                            if self.workspace:  # never freed: negative keys, apart from the storages'
                                self.events.append(("+", -len(self.threads), self.workspace))

                tracker.on_op = on_op
                try:
                    yield timeline
                finally:
                    tracker.on_op = inner

        return watch


def cublas_workspace(device: torch.device) -> int | None:
    """The bytes of the workspace PyTorch allocates through the caching allocator for each cuBLAS handle and stream
    (``getChosenWorkspaceSize`` in ``aten/src/ATen/cuda/CublasHandlePool.cpp``): ``CUBLAS_WORKSPACE_CONFIG``'s sizes
    times counts (``:4096:8`` is 4096 KiB x 8) where it is set; else 32 MiB on a compute capability 9.0 GPU (Hopper)
    and ``:4096:2:16:8`` (8.12 MiB) on others. ``None`` where neither the variable nor the GPU is there to say.

    Examples:
        >>> import os
        >>> os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        >>> cublas_workspace(torch.device("cuda")) // 2**20
        32
        >>> del os.environ["CUBLAS_WORKSPACE_CONFIG"]
    """
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    sizes = re.findall(r":([0-9]+):([0-9]+)", config or "")
    if sizes:
        return sum(int(size) * 1024 * int(count) for size, count in sizes)
    if not _available(device):
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 32 * 2**20 if (major, minor) == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8


def _peak(dry: DryRun, recorder: _Recorder | None = None) -> Peak:
    if dry.peak_bytes is None:
        return Peak(None)
    timeline: Timeline = dry.watched
    path = f"`{timeline.path[-1][0]}`, {timeline.path[-1][1]}" if timeline.path else ""
    held, phases = dict(dry.at_peak), timeline.phase_peaks()
    # where the dry runs stand in for an accelerator on this machine's CPU, what they keep on the host is on the meta
    # device (optimizer_in_backward="host")
    elsewhere = {"host" if device == "meta" else device: n for device, n in dry.elsewhere_peak.items()}
    peak = Peak(dry.peak_bytes, timeline.part, path, dict(dry.live_bytes), held, elsewhere, phases)
    if recorder is not None:
        model = replay(recorder.events)
        peak.allocated, peak.reserved = model.allocated, model.reserved
    return peak


def _device_of(module: torch.nn.Module) -> torch.device:
    tensor = next(module.parameters(), None)
    return torch.device("cpu") if tensor is None or tensor.is_meta else tensor.device


def _available(device: torch.device) -> bool:
    backend = getattr(torch, device.type, None)
    return bool(backend is not None and getattr(backend, "is_available", lambda: False)())


def _autocast(device: torch.device, dtype: torch.dtype | None) -> Callable[[], Any]:
    if dtype is None:
        return contextlib.nullcontext
    # as Lightning's MixedPrecision plugin: no cache of the weights cast, which would keep a copy of each alive
    return lambda: torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=False)


def _optimizers(module: pl.LightningModule) -> list[torch.optim.Optimizer]:
    """The optimizers ``configure_optimizers`` returns, in any of the forms Lightning accepts."""
    if type(module).configure_optimizers is pl.LightningModule.configure_optimizers:
        return []

    def unpack(value: Any) -> list[torch.optim.Optimizer]:
        if isinstance(value, torch.optim.Optimizer):
            return [value]
        if isinstance(value, Mapping):
            return unpack(value.get("optimizer"))
        if isinstance(value, Sequence) and not isinstance(value, str):
            if len(value) == 2 and all(isinstance(v, Sequence) for v in value):  # ([optimizers], [schedulers])
                return unpack(value[0])
            return [o for v in value for o in unpack(v)]
        return []

    return unpack(module.configure_optimizers())
