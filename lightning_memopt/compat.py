"""Every private or version-dependent name lightning_memopt uses from torch, Lightning and torchmetrics, in one place.

When one of these libraries changes, this is the file to mend. Lightning and torchmetrics are imported inside the
functions that need them, so the pure-torch modules can import this one.

Every name here is checked, by the tests that reach it, at both ends of the supported range that CI installs: the
floors pinned in ``constraints-floor.txt`` (torch 2.9.0, lightning 2.6.0, torchmetrics 1.4.0) and the newest that
``constraints.txt`` allows (torch 2.13.0; lightning 2.6.6 and torchmetrics 1.9.0 when last run). A note "checked on"
names where a behaviour was looked at by hand. Outside this file, lightning_memopt uses only the public,
documented API of Trainer, Strategy and LightningModule.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch._subclasses.fake_tensor import (  # noqa: F401  (re-exported)
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import (  # noqa: F401  (re-exported)
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_flatten  # noqa: F401  (re-exported)

#: Operators that take functions (flex_attention, cond, while_loop): dispatch modes see them whole.
HigherOrderOperator = torch._ops.HigherOrderOperator


def dense_kernel(operator: Any) -> Callable[..., Any] | None:
    """A higher-order operator's plain implementation in aten ops, if it has one: run under a dispatch mode, the mode
    sees each op it is made of."""
    return operator.py_kernels.get(torch._C.DispatchKey.CompositeExplicitAutograd)


_EAGER = {"depth": 0, "before": False}


@contextlib.contextmanager
def flex_attention_eager() -> Iterator[None]:
    """Eager ``flex_attention`` runs its operator directly instead of through ``torch.compile``, which refuses to run
    under a dispatch mode (exact accounting, a dry run) and leaves dynamo unable to run the model afterwards. Nested
    and overlapping uses count: the setting is put back when the last one ends."""
    import torch.nn.attention.flex_attention as flex

    if _EAGER["depth"] == 0:
        _EAGER["before"] = getattr(flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", False)
        flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    _EAGER["depth"] += 1
    try:
        yield
    finally:
        _EAGER["depth"] -= 1
        if _EAGER["depth"] == 0:
            flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = _EAGER["before"]


#: Normalisation layers with running statistics (BatchNorm, InstanceNorm with ``track_running_stats``).
NormBase = torch.nn.modules.batchnorm._NormBase


def leave_modes_above(mode: TorchDispatchMode) -> None:
    """Pop the dispatch modes entered after ``mode`` and still active (nothing when ``mode`` is not active)."""
    if any(m is mode for m in _get_current_dispatch_mode_stack()):
        while _get_current_dispatch_mode() is not mode:
            _pop_mode()


def leave_mode(mode: TorchDispatchMode, leave: Callable[[], None]) -> None:
    """Leave the active dispatch ``mode`` by calling ``leave`` (its own ``__exit__``), also when modes entered after it
    are still active (two spans that overlap, such as MemOpt's and PeakMemory's, each closed by its own callback): those
    are set aside and put back. Nothing when ``mode`` is not active."""
    if not any(m is mode for m in _get_current_dispatch_mode_stack()):
        return
    above = []
    while _get_current_dispatch_mode() is not mode:
        above.append(_pop_mode())
    leave()
    for other in reversed(above):
        _push_mode(other)


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass in this thread (checkpointed blocks recompute there)."""
    return torch._C._current_graph_task_id() != -1


def map_tensors(data: Any, function: Callable[[torch.Tensor], Any]) -> Any:
    """A copy of a batch with every tensor replaced by ``function(tensor)``: dicts, lists, tuples, namedtuples and
    dataclasses are rebuilt, as Lightning rebuilds them when it moves a batch to its device."""
    from lightning_utilities.core.apply_func import apply_to_collection

    return apply_to_collection(data, torch.Tensor, function)


def tensors_in(data: Any) -> list[torch.Tensor]:
    """The tensors in a batch, in order, found as :func:`map_tensors` finds them."""
    found: list[torch.Tensor] = []
    map_tensors(data, found.append)
    return found


def op_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in an op's arguments or outputs (tensors, and tuples, lists and dicts of them): what
    ``tree_flatten`` finds there, without its cost, which a dry run would pay on every op.

    Examples:
        >>> [tuple(t.shape) for t in op_tensors(((torch.ones(2), [torch.ones(3)]), {"alpha": 2, "out": torch.ones(1)}))]
        [(2,), (3,), (1,)]
    """
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from op_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from op_tensors(item)


def step_args(pl_module: Any, name: str, batch: Any, batch_idx: int, dataloader_idx: int | None) -> list[Any]:
    """The arguments Lightning passes to ``training_step``/``predict_step``: the batch index only if it is taken."""
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    args = [batch]
    if is_param_in_hook_signature(getattr(pl_module, name), "batch_idx", min_args=2):
        args.append(batch_idx)
        if dataloader_idx is not None:
            args.append(dataloader_idx)
    return args


def closure_loss(output: Any, accumulate_grad_batches: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What Lightning's automatic optimization makes of a ``training_step`` output before the backward pass: the loss
    divided by ``accumulate_grad_batches`` and a detached copy of it that it keeps (``ClosureResult``)."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        return None, None
    loss = loss / accumulate_grad_batches
    return loss, loss.detach().clone()


def zeroes_grads(batch_idx: int, accumulate_grad_batches: int) -> bool:
    """Whether Lightning's automatic optimization zeroes the gradients (between forward and backward) on this batch."""
    return batch_idx % accumulate_grad_batches == 0


def strategy_checkpoints(strategy: Any) -> str | None:
    """The name of the strategy if it already checkpoints activations itself (FSDP with a policy, DeepSpeed)."""
    if getattr(strategy, "_activation_checkpointing_kwargs", None):
        return type(strategy).__name__  # FSDPStrategy(activation_checkpointing_policy=...)
    config = getattr(strategy, "config", None)
    if type(strategy).__name__ == "DeepSpeedStrategy" and isinstance(config, dict):
        if any((config.get("activation_checkpointing") or {}).values()):
            return type(strategy).__name__
    return None


#: Why each technique stays off under a Lightning strategy that holds what it would change (by the strategy's class,
#: then the technique's name). DeepSpeed's engine steps the optimizer, and ZeRO partitions the gradients, the
#: optimizer's state and (stage 3) the parameters. FSDPStrategy (FSDP1) keeps the parameters in flat parameters,
#: reduce-scatters the gradients after the backward pass and keeps each rank's state per shard of them; freeing the
#: original parameters' gradients after the step is what ``optimizer.zero_grad(set_to_none=True)`` does there, and FSDP
#: frees the flat gradient before the next forward pass (``_reset_flat_param_grad_info_if_needed``, checked on torch
#: 2.13), so free_gradients stays. Under ModelParallelStrategy, only where the parameters are DTensors (fully_shard,
#: tensor parallelism): bitsandbytes' blockwise quantization takes a plain tensor, and on a DTensor shard raises
#: "bitsandbytes.quantize_blockwise.default got mixed torch.Tensor and DTensor" (bitsandbytes 0.50.2).
_OWNED = {
    "DeepSpeedStrategy": {
        "optimizer_in_backward": "DeepSpeed owns the optimizer step, which its engine runs after it has reduced the "
        "gradients",
        "free_gradients": "DeepSpeed owns the optimizer step and the gradients' buffers (ZeRO partitions them)",
        "optimizer_state_8bit": "DeepSpeed owns the optimizer step and its state (ZeRO partitions it)",
        "weights_8bit": "DeepSpeed's engine owns the parameters (ZeRO stage 3 partitions them across processes)",
    },
    "FSDPStrategy": {
        "optimizer_in_backward": "FSDP keeps the parameters in flat parameters and reduce-scatters their gradients "
        "after the backward pass, so a parameter stepped inside it would miss the other processes' gradients",
        "optimizer_state_8bit": "FSDP keeps the optimizer's state per shard of its flat parameters and gathers it "
        "itself (FSDP.optim_state_dict)",
        "weights_8bit": "FSDP keeps each layer's weight as a view of its flat parameter, which it all-gathers before "
        "the forward pass",
    },
    "ModelParallelStrategy": {
        "optimizer_state_8bit": "the parameters are DTensor shards (fully_shard), and bitsandbytes' 8-bit "
        "quantization takes plain tensors only",
        "weights_8bit": "the weights are DTensor shards (fully_shard) that FSDP2 all-gathers before each forward "
        "pass, and only a plain weight can be kept in 8 bits",
    },
}


def strategy_refuses(technique: str, strategy: Any) -> str | None:
    """Why ``technique`` (a technique's name, which is also its option's) stays off under the Lightning ``strategy``,
    naming both, for a warning; ``None`` where it composes with it. A subclass counts as the strategy it extends.

    Examples:
        >>> from lightning.pytorch.strategies import FSDPStrategy
        >>> print(strategy_refuses("weights_8bit", FSDPStrategy()))  # doctest: +ELLIPSIS
        weights_8bit left off under FSDPStrategy: FSDP keeps each layer's weight as a view ...
        >>> strategy_refuses("free_gradients", FSDPStrategy()) is None
        True
    """
    kinds = [c.__name__ for c in type(strategy).__mro__ if c.__name__ in _OWNED]
    why = _OWNED[kinds[0]].get(technique) if kinds else None
    if why is None or (kinds[0] == "ModelParallelStrategy" and not _sharded(strategy)):
        return None
    return f"{technique} left off under {type(strategy).__name__}: {why}; pass {technique}=False to silence this."


def _sharded(strategy: Any) -> bool:
    """Whether the strategy's LightningModule has a DTensor parameter (``fully_shard`` or tensor parallelism)."""
    module = getattr(strategy, "lightning_module", None)
    if module is None or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def steps_optimizer(batch_idx: int, accumulate_grad_batches: int) -> bool:
    """Whether Lightning's automatic optimization steps the optimizers after this batch (the end of an accumulation
    window; the last batch of an epoch too, which a dry run does not know of)."""
    return (batch_idx + 1) % accumulate_grad_batches == 0


def logging_levels(fx: str, on_step: bool | None, on_epoch: bool | None) -> tuple[bool, bool]:
    """``on_step`` and ``on_epoch`` of a ``self.log`` call in the hook ``fx``, with Lightning's defaults for that hook
    (on step in ``training_step``, on epoch elsewhere), checked as Lightning checks them (it raises where the hook may
    not log, as in ``predict_step``). Lightning's ``_FxValidator``; checked on 2.6.0 and 2.6.6."""
    from lightning.pytorch.trainer.connectors.logger_connector.fx_validator import _FxValidator

    return _FxValidator.check_logging_and_get_default_levels(fx, on_step=on_step, on_epoch=on_epoch)


def log_reduction(fx: str, name: str, on_step: bool, on_epoch: bool, reduce_fx: Any) -> str:
    """How Lightning reduces a value logged with ``reduce_fx`` over the epoch: ``"mean"``, ``"max"``, ``"min"`` or
    ``"sum"``, checked as Lightning checks it (it raises for one it does not support, and for a value logged neither on
    step nor on epoch). Lightning's ``_Metadata``; checked on 2.6.0 and 2.6.6."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata

    meta = _Metadata(fx=fx, name=name, on_step=on_step, on_epoch=on_epoch, reduce_fx=reduce_fx)
    kinds = {"mean": meta.is_mean_reduction, "max": meta.is_max_reduction, "min": meta.is_min_reduction}
    return next((kind for kind, found in kinds.items() if found), "sum" if meta.is_sum_reduction else "custom")


def distributed_initialized() -> bool:
    """Whether torch.distributed has a process group (a real one, or the fake one of a one-process estimate)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def metric_state_names(module: Any) -> list[str]:
    """The names of the states a torchmetrics ``Metric`` accumulates (tensors or lists of tensors, held as plain
    attributes, not buffers); none for any other module. Read from ``Metric._defaults``."""
    return list(getattr(module, "_defaults", {})) if _is_metric(module) else []


def _is_metric(module: Any) -> bool:
    """Whether ``module`` is a torchmetrics ``Metric`` (without importing torchmetrics where no one has)."""
    metric = getattr(sys.modules.get("torchmetrics"), "Metric", None)
    return metric is not None and isinstance(module, metric)


def metric_state(metric: Any) -> dict[str, Any]:
    """A copy of a torchmetrics metric's accumulated state, to put back with ``metric.__dict__.update``."""
    state = {k: v.clone() if isinstance(v, torch.Tensor) else list(v) for k, v in metric.metric_state.items()}
    return {**state, "_update_count": metric._update_count, "_computed": metric._computed}


def _grouped_mm_fake(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``aten._grouped_mm`` on fake tensors of any float dtype: torch's own fake rule (checked on 2.13) accepts bf16
    only, where the CPU kernel runs fp32 too (transformers' MoE experts in fp32). The result's shape as the kernel's."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        assert offs is not None, "a 2D x 2D grouped mm needs offs"
        shape = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif mat_a.dim() == 2:
        shape = [mat_a.size(0), mat_b.size(-1)]
    elif mat_b.dim() == 2:
        shape = [mat_a.size(1), mat_b.size(1)]
    else:
        shape = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    return torch.empty(shape, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


#: Our own rules for ops whose fake-tensor rule is wrong or missing in the torch versions we support: a dry run uses
#: these where any input is a fake tensor. Each is tested against the real op's shape, dtype and bytes.
FAKE_RULES: dict[Any, Callable[..., Any]] = {torch.ops.aten._grouped_mm.default: _grouped_mm_fake}


def local_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a tensor subclass is made of (a DTensor's local shard), or the tensor itself: what holds
    memory on this process."""
    if is_traceable_wrapper_subclass(tensor):
        names = tensor.__tensor_flatten__()[0]
        return [inner for name in names for inner in local_tensors(getattr(tensor, name))]
    return [tensor] if isinstance(tensor, torch.Tensor) else []


def ddp_bucket_bytes(model: Any) -> int:
    """The bytes of the buckets DDP copies gradients into (none when they are views of the gradients, or without DDP),
    from ``DistributedDataParallel._get_ddp_logging_data`` (checked on torch 2.13)."""
    logging_data = getattr(model, "_get_ddp_logging_data", None)
    if logging_data is None:
        return 0
    data = logging_data()
    if data.get("gradient_as_bucket_view") or not data.get("bucket_sizes"):
        return 0
    return sum(int(size) for size in str(data["bucket_sizes"]).split(","))


def innermost_saved_tensor_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The pack and unpack hooks of the innermost ``saved_tensors_hooks`` in force (non-reentrant checkpointing's own,
    inside a checkpointed block), or ``None`` (checked on torch 2.13)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def tensor_version(tensor: torch.Tensor) -> int:
    """The counter torch bumps on every in-place change of ``tensor`` (checked on torch 2.13)."""
    return tensor._version


def accelerator_total_memory(device: torch.device) -> int:
    """An accelerator's total memory in bytes: ``torch.accelerator.get_memory_info`` where torch has it (torch 2.13;
    not in torch 2.9, the floor), else the CUDA device's properties."""
    if hasattr(torch.accelerator, "get_memory_info"):
        return int(torch.accelerator.get_memory_info(device)[1])
    return int(torch.cuda.get_device_properties(device).total_memory)


def accelerator_free_memory(device: torch.device) -> tuple[int, int]:
    """What an accelerator has for this process now, in bytes: the memory free to any process
    (``torch.cuda.mem_get_info``'s first figure, which every process's CUDA context and caching allocator already
    count as used), and the bytes this process's caching allocator holds reserved (its tensors' and its cache's).
    ``torch.accelerator`` for other accelerators where torch has it (``get_memory_info``: torch 2.13)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0]), int(torch.cuda.memory_reserved(device))
    if hasattr(torch.accelerator, "get_memory_info"):
        reserved = torch.accelerator.memory_reserved(device) if hasattr(torch.accelerator, "memory_reserved") else 0
        return int(torch.accelerator.get_memory_info(device)[0]), int(reserved)
    raise ValueError(
        f"`memory_budget` 'auto' reads the free memory of {str(device)!r}, which this torch cannot tell: give a size"
        " such as '12GiB' or a fraction such as 0.8"
    )


def costly_flop_formulas() -> dict[Any, Callable[..., int]]:
    """The FLOP formulas of ``torch.utils.flop_counter.FlopCounterMode`` by operator (matrix products, convolutions,
    attention), plus CPU's fused attention, which FlopCounterMode does not count, under the formula of the flash
    attention it stands for (the same query, key and value shapes). Checked on torch 2.9 and 2.13."""
    from torch.utils.flop_counter import flop_registry

    formulas = dict(flop_registry)
    cpu_attention = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    if cpu_attention is not None and flash in formulas:
        formulas[cpu_attention] = formulas[flash]
    return formulas
