"""A time model of the step, calibrated on the device: what the planner minimises and the report predicts.

Each op a dry run dispatches is priced as a roofline with a floor: ``op_s + max(flops * flop_s, bytes * byte_s)``,
its FLOPs counted as :mod:`~lightning_memopt.flops` counts them and its bytes those of the tensors it reads and
writes. A checkpointed segment adds ``call_s`` (torch's non-reentrant checkpoint: its hooks, its recomputation's
set-up), and every op a selective segment routes through its policy's dispatch mode, in the forward pass and in the
recomputation, adds ``policy_op_s``. The five figures are measured once per device, torch version and thread count
(:func:`speed`; tens of milliseconds on a quiet CPU, seconds on a loaded one) and kept for the process and in a file
(``~/.cache/lightning_memopt/speeds.json``; the environment variable ``LIGHTNING_MEMOPT_CACHE_DIR`` moves it, and set
empty turns the file off), so that a later run on the same device does not measure them again. :func:`forget` drops
them: the next plan measures again.

The model is coarse: one matrix product size stands for every costly op, one elementwise op for every other. What it
gets right is what the planner weighs: a block recomputed costs its ops' time, not its FLOPs (an elementwise op costs
its memory traffic), a slice or a segment more costs its calls, and a selective block costs the ops it dispatches
through Python.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_memopt.compat import TorchDispatchMode


@dataclass(frozen=True)
class Speed:
    """A device's calibrated speeds (see the module's docstring), and the seconds measuring them took (0 where they
    were kept from before).

    Examples:
        >>> speed = Speed("cpu", flop_s=1e-10, byte_s=1e-10, op_s=5e-6, policy_op_s=1e-5, call_s=1e-4)
        >>> round(speed.op(flops=2_000_000, nbytes=48_000), 9)  # a matrix product: compute bound
        0.000205
        >>> round(speed.op(flops=1_000, nbytes=12_000), 9)  # an elementwise op on 1,000 float32: memory bound
        6.2e-06
    """

    device: str
    flop_s: float
    byte_s: float
    op_s: float
    policy_op_s: float
    call_s: float
    seconds: float = 0.0

    def op(self, flops: int, nbytes: int) -> float:
        """The predicted time of one op."""
        return self.op_s + max(flops * self.flop_s, nbytes * self.byte_s)


_MEASURED: dict[str, Speed] = {}
#: The fields of :class:`Speed` kept in the file.
_FIELDS = ("flop_s", "byte_s", "op_s", "policy_op_s", "call_s")


def speed(device: Any = "cpu") -> Speed:
    """The speeds of ``device`` (a CPU or a CUDA device; a fake or meta device is priced as the CPU): kept from an
    earlier call or run on this device (``seconds`` is then 0: nothing was spent now), else measured now.

    Examples:
        >>> speed("meta").device
        'cpu'
    """
    device = _priced(device)
    key = _key(device)
    kept = _MEASURED.get(key) or _stored(key, str(device))
    if kept is not None:
        _MEASURED[key] = kept
        return dataclasses.replace(kept, seconds=0.0)
    with torch.inference_mode(False), torch.enable_grad():  # a loop's hooks run without gradients
        measured = _MEASURED[key] = measure(device)
    _store(key, measured)
    return measured


def forget(device: Any = "cpu") -> None:
    """Drop the speeds kept for ``device`` (in the process and the file): the next :func:`speed` measures again."""
    key = _key(_priced(device))
    _MEASURED.pop(key, None)
    _store(key, None)


#: The seconds per byte copied between the host and an accelerator where none can be measured (an estimate for CUDA on a
#: machine without one): 25 GB/s, PCIe 4.0 x16's rate in practice. An assumption, said in the notes where it prices a
#: choice; on a real CUDA device the rate is measured (:func:`link_byte_s`).
ASSUMED_LINK_BYTE_S = 1 / 25e9
_LINKS: dict[str, float] = {}


def link_byte_s(device: Any) -> float | None:
    """The seconds per byte copied between the host (pinned memory) and ``device``, each way: measured once per
    process on a CUDA device (64 MiB each way, the least of a few); :data:`ASSUMED_LINK_BYTE_S` for a CUDA device this
    machine does not have; ``None`` for the CPU, whose host is the device."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return ASSUMED_LINK_BYTE_S
    key = str(device)
    if key not in _LINKS:
        host = torch.empty(64 * 2**20, dtype=torch.uint8, pin_memory=True)
        there = torch.empty_like(host, device=device)

        def both_ways() -> None:
            there.copy_(host, non_blocking=True)
            host.copy_(there, non_blocking=True)

        _LINKS[key] = _best(both_ways, lambda: torch.cuda.synchronize(device)) / (2 * host.numel())
    return _LINKS[key]


#: The bytes a real step took beyond its dry run's prediction, per device and model (:func:`unseen_bytes`), for the
#: process.
_UNSEEN: dict[str, int] = {}


def _priced(device: Any) -> torch.device:
    """The device whose figures stand for ``device``: a CUDA device where there is one, else the CPU (a fake or meta
    device, or one this torch does not time)."""
    device = torch.device(device)
    return device if device.type == "cuda" and torch.cuda.is_available() else torch.device("cpu")


def _unseen_key(device: Any, owner: str) -> str:
    return f"{_key(_priced(device), threads=1)} | unseen | {owner}"  # the threads do not change what a step allocates


def unseen_bytes(device: Any = "cpu", owner: str = "") -> int:
    """The bytes the last real step of ``owner`` (a model's stage on a batch's shapes, see
    :func:`~lightning_memopt.plans.owner_of`) measured on ``device`` took beyond what its dry run predicted (scratch
    a fake tensor never holds, such as a kernel's workspace): kept for the process and in the speeds' file, so that
    its next stage and run on the device plan for it from their first batch; 0 where none was measured. Another
    model's step is charged nothing of it."""
    key = _unseen_key(device, owner)
    if key not in _UNSEEN:
        stored = _read().get(key)
        _UNSEEN[key] = stored["bytes"] if isinstance(stored, dict) and isinstance(stored.get("bytes"), int) else 0
    return _UNSEEN[key]


def keep_unseen(device: Any, nbytes: int, owner: str = "") -> None:
    """Keep what a real step of ``owner`` on ``device`` took beyond its dry run (:func:`unseen_bytes`), in the
    process and the file."""
    key = _unseen_key(device, owner)
    _UNSEEN[key] = nbytes
    _update(key, {"bytes": nbytes} if nbytes else None)


def _key(device: torch.device, threads: int | None = None) -> str:
    """What the speeds depend on: the device's model, torch's version and the thread count (by default torch's)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        with_model = Path("/proc/cpuinfo")
        if with_model.exists():
            lines = [line for line in with_model.read_text().splitlines() if line.startswith("model name")]
            name = lines[0].partition(":")[2].strip() if lines else name
    return f"{name} | torch {torch.__version__} | {threads or torch.get_num_threads()} threads"


def cache_file() -> Path | None:
    """Where the speeds are kept between runs (``None``: not kept, ``LIGHTNING_MEMOPT_CACHE_DIR`` set empty)."""
    folder = os.environ.get("LIGHTNING_MEMOPT_CACHE_DIR")
    if folder is None:
        folder = str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lightning_memopt")
    return Path(folder) / "speeds.json" if folder else None


def _read() -> dict[str, Any]:
    path = cache_file()
    try:
        return json.loads(path.read_text()) if path is not None and path.exists() else {}
    except (OSError, ValueError):  # unreadable or half-written: measured again
        return {}


def _stored(key: str, device: str) -> Speed | None:
    values = _read().get(key)
    if not isinstance(values, dict) or not all(isinstance(values.get(f), float) for f in _FIELDS):
        return None
    return Speed(device, **{f: values[f] for f in _FIELDS})


def _store(key: str, measured: Speed | None) -> None:
    """Keep ``measured`` in the file (``None``: drop the entry)."""
    _update(key, None if measured is None else {f: getattr(measured, f) for f in _FIELDS})


def _update(key: str, values: dict[str, Any] | None) -> None:
    """Keep ``values`` under ``key`` in the file (``None``: drop the entry); a file that cannot be written is left
    alone."""
    path = cache_file()
    if path is None:
        return
    entries = _read()
    if values is None:
        entries.pop(key, None)
    else:
        entries[key] = values
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(entries, indent=1))
        partial.replace(path)  # whole or not at all, for a run reading it meanwhile
    except OSError:
        pass


def _best(run: Callable[[], Any], sync: Callable[[], None], repeats: int = 5) -> float:
    """The least time of ``repeats`` runs of ``run`` (after one to warm up)."""
    run()
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - started)
    return min(times)


class _Ops(TorchDispatchMode):
    """Counts the ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def _per_op(device: torch.device, sync: Callable[[], None]) -> float:
    """The time of a training step of a small stack of tiny layers (modules' Python, autograd, the optimizer's
    update left out) over the ops it dispatches: what an op costs in a model beyond its arithmetic."""
    torch.manual_seed(0)
    layers = [m for _ in range(8) for m in (nn.Linear(4, 4), nn.LayerNorm(4), nn.GELU())]
    stack = nn.Sequential(*layers).to(device)
    x = torch.ones(2, 4, device=device)

    def step() -> None:
        stack(x).sum().backward()

    with _Ops() as ops:
        step()
    seconds = _best(step, sync)
    for parameter in stack.parameters():
        parameter.grad = None
    return seconds / max(ops.count, 1)


def _recompute_everything(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def measure(device: torch.device) -> Speed:
    """Time, on ``device``: a square matrix product (``flop_s``), an addition of two large vectors (``byte_s``), a
    training step of tiny layers per op it dispatches (``op_s``), a checkpoint of one tiny op against the op alone
    (``call_s``), and tiny ops in a selective checkpoint against a plain one (``policy_op_s``). No tensor of the
    user's is touched, nor their random state (the speeds may be measured in the middle of their run, whose dropout
    masks must be those of a run without MemOpt)."""
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type=device.type if cuda else "cuda"):
        return _measure(device)


def _measure(device: torch.device) -> Speed:
    started = time.perf_counter()
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n, length, ops = (2048, 1 << 24, 200) if cuda else (256, 1 << 20, 200)
    op_s = _per_op(device, sync)
    with torch.no_grad():
        a = torch.randn(n, n, device=device)
        x, y = torch.randn(length, device=device), torch.randn(length, device=device)
        flop_s = _best(lambda: a @ a, sync) / (2 * n**3)  # large enough for an op's floor not to count
        byte_s = _best(lambda: x + y, sync) / (3 * x.nbytes)

    def chain(v: torch.Tensor) -> torch.Tensor:
        for _ in range(ops):
            v = v * 1.0
        return v

    small = torch.ones(8, device=device, requires_grad=True)

    def step(run: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        return lambda: run(small).sum().backward()

    full = _best(step(lambda v: checkpoint(chain, v, use_reentrant=False)), sync)
    policed = _best(
        step(
            lambda v: checkpoint(
                chain,
                v,
                use_reentrant=False,
                context_fn=lambda: create_selective_checkpoint_contexts(_recompute_everything),
            )
        ),
        sync,
    )
    policy_op_s = max(policed - full, 0.0) / (2 * ops)  # each op through the mode twice: forward, recomputation
    single = _best(step(lambda v: checkpoint(torch.Tensor.exp, v, use_reentrant=False)), sync)
    alone = _best(step(torch.Tensor.exp), sync)
    call_s = max(single - alone - op_s, 0.0)
    small.grad = None
    return Speed(str(device), flop_s, byte_s, op_s, policy_op_s, call_s, time.perf_counter() - started)
