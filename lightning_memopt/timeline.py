"""The timeline of a dry run: one moment per op, with the bytes alive on the device by kind and on the other devices,
the module running, the phase of the step, the spans open and, with a device's speeds, the op's predicted seconds.

What a step is made of is read from it afterwards: where its peak was reached (:attr:`Timeline.peak`), the peak of each
phase (:meth:`Timeline.phase_peaks`) or of any stretch (:meth:`Timeline.peak_between`), the time each phase is predicted
to take (:meth:`Timeline.seconds`), the FLOPs computed forward and recomputed, per block
(:meth:`Timeline.forward_flops`, :meth:`Timeline.recomputed`). The phases are the forward pass, the backward pass, the
recomputation of a checkpointed segment in it (marked by :func:`~lightning_memopt.flops.recomputing`) and the optimizer
step (the :data:`OPTIMIZER_STEP` span, which a dry run's optimizer step opens). Techniques mark the stretches of a step
they own with :func:`span`, and a watch its own moments with :meth:`Timeline.mark` (the planner's
:class:`~lightning_memopt.techniques.planner.BlockRecorder`: where a unit's forward pass starts and ends, where its
backward window opens); the timeline records them without knowing any technique or watch.

The moments are kept in flat arrays (about 110 bytes an op), so a step of a real-scale model costs a few MiB of host
memory, and each op a few microseconds.
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Hashable, Iterator
from typing import Any, NamedTuple

from torch import nn

from lightning_memopt.compat import in_backward
from lightning_memopt.flops import (
    SPENDING,
    attention,
    flops,
    in_recomputation,
    op_seconds,
    policed_now,
    recomputing_now,
)
from lightning_memopt.memory import KINDS, CPUProbe

#: The span a dry run's optimizer step opens.
OPTIMIZER_STEP = "optimizer step"
#: The phases of a step, in the order they first run.
PHASES = ("forward", "backward", "recomputation", OPTIMIZER_STEP)

#: Which part of a model a module is, by its class name or attribute name, for saying where a peak is reached. The
#: innermost module that matches wins; the VAE parts only inside an autoencoder.
PARTS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("attention", ("Attention", "Attn"), ("attn", "attn1", "attn2", "attention", "self_attn")),
    ("feed-forward", ("FeedForward", "MLP", "Mlp"), ("ff", "ff_context", "mlp", "ffn")),
)
AUTOENCODERS = ("Autoencoder", "VQModel")


def part_of(path: list[tuple[str, str]]) -> str:
    """The part of the model that the innermost of ``path`` (``(name, class name)`` pairs, outermost first) belongs to.

    Examples:
        >>> part_of([("transformer", "LatteTransformer3DModel"), ("transformer.blocks.0.attn1", "Attention")])
        'attention'
        >>> part_of([("vae", "AutoencoderKL"), ("vae.decoder", "Decoder"), ("vae.decoder.up_blocks.0", "UpBlock")])
        'VAE decode'
        >>> part_of([("encoder", "TransformerEncoder"), ("encoder.layers.1", "TransformerEncoderLayer")])
        'TransformerEncoderLayer'
    """
    if any(a in cls for _, cls in path for a in AUTOENCODERS):
        names = [name.rpartition(".")[2] for name, _ in path]
        return "VAE decode" if "decoder" in names else "VAE encode" if "encoder" in names else "VAE"
    for name, cls in reversed(path):
        last = name.rpartition(".")[2]
        for part, classes, names in PARTS:
            if any(c in cls for c in classes) or last in names:
                return part
    return path[-1][1] if path else "outside any module"


_SPANS: list[tuple[str, ...]] = [()]  # the spans open now, as one tuple (outermost first), on top


@contextlib.contextmanager
def span(label: str) -> Iterator[None]:
    """Marks what runs inside as ``label`` on any timeline recording it (:attr:`Moment.spans`)."""
    _SPANS.append((*_SPANS[-1], label))
    try:
        yield
    finally:
        _SPANS.pop()


class Moment(NamedTuple):
    """The state of the step right after one op (or a mark, whose ``op`` is ``None``)."""

    op: Any  # the op (an ``OpOverload``)
    device_bytes: int  # alive on the device counted
    high_bytes: int  # the most alive on the device since the moment before: no byte between two moments is missed
    elsewhere_bytes: int  # alive on other devices (the host, in a dry run of an accelerator's step)
    by_kind: dict[str, int]  # the device's bytes by kind, as known at that moment (see the tracker's ``rekind``)
    module: str | None  # the innermost module running (its name under the root), or None
    phase: str  # one of PHASES
    spans: tuple[str, ...]  # the spans open, outermost first
    seconds: float  # the op's predicted time (0 without a speed)
    flops: int  # the op's FLOPs (see :func:`~lightning_memopt.flops.flops`)
    recomputing: Any  # the block whose checkpointed segment runs again (``recomputing_now``), or None
    policed: bool  # run through a selective policy's dispatch mode


class Timeline:
    """While active, records a :class:`Moment` after every op a running :class:`~lightning_memopt.memory.CPUProbe`
    counts, under ``root`` (the modules are named as in it), and one where it starts (holding the peak the probe
    reached before).

    Args:
        probe: The running probe whose tracker counts the bytes.
        root: The module whose submodules name where an op runs.
        speed: A device's speeds (:class:`~lightning_memopt.timing.Speed`), to predict each op's time.

    Examples:
        >>> import torch
        >>> net = nn.Sequential(nn.Linear(10, 1000), nn.ReLU(), nn.Linear(1000, 10))
        >>> probe = CPUProbe()
        >>> probe.start({"weights": net.parameters()})
        >>> with Timeline(probe, net) as timeline:
        ...     out = net(torch.zeros(4, 10))
        >>> _ = probe.stop()
        >>> timeline.path[-1], timeline.peak.phase, timeline.peak.device_bytes == probe.at_peak["weights"] + 32160
        (('1', 'ReLU'), 'forward', True)
        >>> timeline.forward_flops()  # two matrix products (4 x 10 x 1000 and 4 x 1000 x 10 multiply-adds) and a ReLU
        164000
    """

    def __init__(self, probe: CPUProbe, root: nn.Module, speed: Any = None) -> None:
        self.probe = probe
        self.speed = speed
        self.marks: list[tuple[int, Hashable]] = []  # (moment, label) of each mark, in order
        self._names = {id(m): n for n, m in root.named_modules()}
        self._classes = {n: type(m).__name__ for n, m in root.named_modules()}
        self._running: list[tuple[nn.Module, int]] = []  # the modules running, each with the innermost named one's key
        self._handles: list[Any] = []
        self._ops: list[Any] = []
        self._device = array("q")
        self._high = array("q")
        self._elsewhere = array("q")
        self._kinds = [array("q") for _ in KINDS]
        self._module = array("i")  # a key of _modules, -1 for none
        self._modules: dict[str, int] = {}  # each module name met, numbered in order
        self._phase = array("b")  # an index into PHASES
        self._spans = array("i")  # a key of _span_sets
        self._span_sets: dict[tuple[str, ...], int] = {}
        self._seconds = array("d")
        self._flops = array("q")
        self._recomputing = array("i")  # an index into _blocks, -1 for none
        self._blocks: list[Any] = []  # the blocks met running again, in order
        self._block_keys: dict[int, int] = {}  # id(block): its index in _blocks
        self._policed = array("b")

    def __len__(self) -> int:
        return len(self._ops)

    def __getitem__(self, index: int) -> Moment:
        module, block = self._module[index], self._recomputing[index]
        modules, span_sets = list(self._modules), list(self._span_sets)
        return Moment(
            self._ops[index],
            self._device[index],
            self._high[index],
            self._elsewhere[index],
            {kind: values[index] for kind, values in zip(KINDS, self._kinds, strict=True)},
            modules[module] if module >= 0 else None,
            PHASES[self._phase[index]],
            span_sets[self._spans[index]],
            self._seconds[index],
            self._flops[index],
            self._blocks[block] if block >= 0 else None,
            bool(self._policed[index]),
        )

    def _record(self, func: Any, args: Any = (), kwargs: Any = None, out: Any = None, seconds: float = 0.0) -> None:
        tracker = self.probe.tracker
        self._ops.append(func)
        self._device.append(tracker.current)
        self._high.append(max(tracker.high, tracker.current))
        tracker.high = tracker.current
        self._elsewhere.append(sum(tracker.elsewhere.values()))
        for values, nbytes in zip(self._kinds, tracker.by_kind.values(), strict=True):  # in the order of KINDS
            values.append(nbytes)
        self._module.append(self._running[-1][1] if self._running else -1)
        spans, again = _SPANS[-1], in_recomputation()
        if again:
            phase = "recomputation"
        elif in_backward():
            phase = "backward"
        else:
            phase = OPTIMIZER_STEP if OPTIMIZER_STEP in spans else "forward"
        self._phase.append(PHASES.index(phase))
        self._spans.append(_index(self._span_sets, spans))
        count = 0 if func is None else flops(func, args, kwargs, out)
        if func is not None and self.speed is not None:
            seconds = op_seconds(self.speed, func, args, kwargs, out, count)
        self._seconds.append(seconds)
        self._flops.append(count)
        if not again:
            self._recomputing.append(-1)
        else:
            block = recomputing_now()
            key = self._block_keys.get(id(block))
            if key is None:
                key = self._block_keys[id(block)] = len(self._blocks)
                self._blocks.append(block)
            self._recomputing.append(key)
        self._policed.append(policed_now())

    def mark(self, label: Hashable) -> int:
        """Records a moment here, with no op, under ``label`` (in :attr:`marks`); returns its index."""
        self._record(None)
        self.marks.append((len(self) - 1, label))
        return len(self) - 1

    def spend(self, seconds: float) -> None:
        """Records a moment here, with no op, that takes ``seconds`` (a segment's recomputation starting)."""
        self._record(None, seconds=seconds)

    # queries ---------------------------------------------------------------------------------------------------------

    @property
    def peak_index(self) -> int | None:
        """The first moment with the most bytes on the device (``None``: no op ran)."""
        if not self._high:
            return None
        return self._high.index(max(self._high))

    @property
    def peak(self) -> Moment | None:
        """The moment the device's peak was reached (``None``: no op ran)."""
        index = self.peak_index
        return None if index is None else self[index]

    def peak_between(self, start: int, end: int) -> int:
        """The most bytes on the device from moment ``start`` (what was alive then) to moment ``end``."""
        return max(self._device[start], max(self._high[start + 1 : end + 1], default=0))

    def bytes_at(self, index: int) -> int:
        """The bytes alive on the device at moment ``index``."""
        return self._device[index]

    @property
    def path(self) -> list[tuple[str, str]]:
        """The modules that hold the one running at the peak, outermost first, as ``(name, class name)``."""
        peak = self.peak
        if peak is None or peak.module is None:
            return []
        parts = peak.module.split(".")
        holders = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        return [(name, self._classes[name]) for name in holders if name in self._classes]

    @property
    def backward(self) -> bool:
        """Whether the peak was reached in the backward pass (a recomputation there included)."""
        peak = self.peak
        return peak is not None and peak.phase in ("backward", "recomputation")

    @property
    def part(self) -> str:
        """The part of the model holding the peak, in words (see :func:`part_of`)."""
        if not self.backward:
            return part_of(self.path)
        return f"{part_of(self.path)}, recomputed in the backward pass" if self.path else "the backward pass"

    def phase_peaks(self) -> dict[str, int]:
        """The most bytes on the device after an op of each phase that ran, in the order of :data:`PHASES`."""
        peaks: dict[str, int] = {}
        for phase, nbytes in zip(self._phase, self._high, strict=True):
            name = PHASES[phase]
            if nbytes > peaks.get(name, -1):
                peaks[name] = nbytes
        return {p: peaks[p] for p in PHASES if p in peaks}

    def seconds(self, phase: str | None = None) -> float:
        """The predicted time of the ops of ``phase`` (every op's, by default); 0 without a speed."""
        if phase is None:
            return sum(self._seconds)
        index = PHASES.index(phase)
        return sum(s for p, s in zip(self._phase, self._seconds, strict=True) if p == index)

    def forward_flops(self) -> int:
        """The FLOPs of the forward pass: its ops before the backward pass's first."""
        backward = PHASES.index("backward")
        end = self._phase.index(backward) if backward in self._phase else len(self)
        forward = PHASES.index("forward")
        return sum(f for p, f in zip(self._phase[:end], self._flops[:end], strict=True) if p == forward)

    def recomputed(self, only: Any = None) -> dict[Any, int]:
        """The FLOPs recomputed, per block running again (the module, or ``None`` where unknown); with ``only`` (a
        predicate on ops), those of the ops it accepts."""
        by_block: dict[Any, int] = {}
        for op, key, count in zip(self._ops, self._recomputing, self._flops, strict=True):
            if key >= 0 and (only is None or only(op)):
                by_block[key] = by_block.get(key, 0) + count
        return {self._blocks[key]: count for key, count in by_block.items()}

    def recomputed_attention(self) -> dict[Any, int]:
        """The FLOPs recomputed in fused attention kernels, per block."""
        return self.recomputed(attention)

    @property
    def policed(self) -> int:
        """The ops run through a selective policy's dispatch mode."""
        return sum(self._policed)

    def moments(self, start: int = 0, end: int | None = None) -> Iterator[tuple[str, Any, float]]:
        """Each moment's phase, block recomputing (or ``None``) and predicted seconds, from ``start`` to ``end``
        (excluded)."""
        stretch = slice(start, end)
        columns = (self._phase[stretch], self._recomputing[stretch], self._seconds[stretch])
        for phase, key, seconds in zip(*columns, strict=True):
            yield PHASES[phase], self._blocks[key] if key >= 0 else None, seconds

    # recording -------------------------------------------------------------------------------------------------------

    def _enter(self, module: nn.Module, args: Any) -> None:
        name = self._names.get(id(module))
        inner = _index(self._modules, name) if name is not None else self._running[-1][1] if self._running else -1
        self._running.append((module, inner))

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._running and self._running[-1][0] is module:
            self._running.pop()

    def __enter__(self) -> Timeline:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._handles = [
            register_module_forward_pre_hook(self._enter),
            register_module_forward_hook(self._leave, always_call=True),
        ]
        tracker = self.probe.tracker
        tracker.high = max(tracker.high, tracker.peak)  # what the step held before, in the first moment
        self.mark("start")
        tracker.on_op = self._record
        if self.speed is not None:
            SPENDING.append(self)
        return self

    def __exit__(self, *args: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self in SPENDING:
            SPENDING.remove(self)
        if self.probe._tracker is not None:
            self.probe.tracker.on_op = None


@contextlib.contextmanager
def record(root: nn.Module | None = None, speed: Any = None) -> Iterator[Timeline]:
    """A :class:`Timeline` of what runs inside, counted by a probe of its own from the tensors made inside (``root``
    names the modules; ``speed`` prices the ops).

    Examples:
        >>> import torch
        >>> a = torch.ones(64, 64)
        >>> with record() as timeline:
        ...     _ = a @ a
        >>> timeline.forward_flops(), timeline.peak.device_bytes  # 64 x 64 x 64 multiply-adds; the product's bytes
        (524288, 16384)
    """
    probe = CPUProbe()
    probe.start({})
    try:
        with Timeline(probe, root if root is not None else nn.Module(), speed) as timeline:
            yield timeline
    finally:
        probe.stop()


def _index(numbered: dict[Any, int], key: Any) -> int:
    """``key``'s number in ``numbered``, given the next one if it has none."""
    number = numbered.get(key)
    if number is None:
        number = numbered[key] = len(numbered)
    return number
