"""A time model of the step, calibrated on the device: what the planner minimises and the report predicts.

Each op a dry run dispatches is priced as a roofline with a floor: ``op_s + max(flops * flop_s, bytes * byte_s)``,
its FLOPs counted as :mod:`~lightning_memopt.flops` counts them and its bytes those of the tensors it reads and
writes. A checkpointed segment adds ``call_s`` (torch's non-reentrant checkpoint: its hooks, its recomputation's
set-up), and every op a selective segment routes through its policy's dispatch mode, in the forward pass and in the
recomputation, adds ``policy_op_s``. The five figures are measured once per device and thread count in a process
(:func:`speed`; tens of milliseconds on a CPU) and reported with the time they took.

The model is coarse: one matrix product size stands for every costly op, one elementwise op for every other. What it
gets right is what the planner weighs: a block recomputed costs its ops' time, not its FLOPs (an elementwise op costs
its memory traffic), a slice or a segment more costs its calls, and a selective block costs the ops it dispatches
through Python.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_memopt.compat import TorchDispatchMode


@dataclass(frozen=True)
class Speed:
    """A device's calibrated speeds (see the module's docstring), and the seconds measuring them took.

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


_MEASURED: dict[tuple[str, int], Speed] = {}


def speed(device: Any = "cpu") -> Speed:
    """The speeds of ``device`` (a CPU or a CUDA device; a fake or meta device is priced as the CPU), measured on the
    first call for it and this thread count, then kept for the process."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        device = torch.device("cpu")
    key = (str(device), torch.get_num_threads())
    if key not in _MEASURED:
        with torch.inference_mode(False), torch.enable_grad():  # a loop's hooks run without gradients
            _MEASURED[key] = measure(device)
    return _MEASURED[key]


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
    user's is touched."""
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
