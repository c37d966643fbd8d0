"""The timeline of a dry run: one moment per op, with the bytes alive on the device by kind and on the other devices,
the module running, the phase of the step, the spans open and, with a device's speeds, the op's predicted seconds.

What a step is made of is read from it afterwards: where its peak was reached (:attr:`Timeline.peak`), the peak of
each phase (:meth:`Timeline.phase_peaks`), the time each phase is predicted to take (:meth:`Timeline.seconds`). The
phases are the forward pass, the backward pass, the recomputation of a checkpointed segment in it (marked by
:func:`~lightning_memopt.flops.recomputing`) and the optimizer step (the :data:`OPTIMIZER_STEP` span, which a dry run's
optimizer step opens). Techniques mark the stretches of a step they own with :func:`span`; the timeline records them
without knowing any technique.

The moments are kept in flat arrays (about 80 bytes an op), so a step of a real-scale model costs a few MiB of host
memory, and each op a few microseconds.
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Iterator
from typing import Any, NamedTuple

from torch import nn

from lightning_memopt.compat import in_backward
from lightning_memopt.flops import op_seconds, recomputing_now
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
    """The state of the step right after one op."""

    op: Any  # the op (an ``OpOverload``)
    device_bytes: int  # alive on the device counted
    elsewhere_bytes: int  # alive on other devices (the host, in a dry run of an accelerator's step)
    by_kind: dict[str, int]  # the device's bytes by kind, as known at that moment (see the tracker's ``rekind``)
    module: str | None  # the innermost module running (its name under the root), or None
    phase: str  # one of PHASES
    spans: tuple[str, ...]  # the spans open, outermost first
    seconds: float  # the op's predicted time (0 without a speed)


class Timeline:
    """While active, records a :class:`Moment` after every op a running :class:`~lightning_memopt.memory.CPUProbe`
    counts, under ``root`` (the modules are named as in it).

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
    """

    def __init__(self, probe: CPUProbe, root: nn.Module, speed: Any = None) -> None:
        self.probe = probe
        self.speed = speed
        self._names = {id(m): n for n, m in root.named_modules()}
        self._classes = {n: type(m).__name__ for n, m in root.named_modules()}
        self._running: list[tuple[nn.Module, int]] = []  # the modules running, each with the innermost named one's key
        self._handles: list[Any] = []
        self._ops: list[Any] = []
        self._device = array("q")
        self._elsewhere = array("q")
        self._kinds = [array("q") for _ in KINDS]
        self._module = array("i")  # a key of _modules, -1 for none
        self._modules: dict[str, int] = {}  # each module name met, numbered in order
        self._phase = array("b")  # an index into PHASES
        self._spans = array("i")  # a key of _span_sets
        self._span_sets: dict[tuple[str, ...], int] = {}
        self._seconds = array("d")

    def __len__(self) -> int:
        return len(self._ops)

    def __getitem__(self, index: int) -> Moment:
        module = self._module[index]
        modules, span_sets = list(self._modules), list(self._span_sets)
        return Moment(
            self._ops[index],
            self._device[index],
            self._elsewhere[index],
            {kind: values[index] for kind, values in zip(KINDS, self._kinds, strict=True)},
            modules[module] if module >= 0 else None,
            PHASES[self._phase[index]],
            span_sets[self._spans[index]],
            self._seconds[index],
        )

    def _record(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        tracker = self.probe.tracker
        self._ops.append(func)
        self._device.append(tracker.current)
        self._elsewhere.append(sum(tracker.elsewhere.values()))
        for values, nbytes in zip(self._kinds, tracker.by_kind.values(), strict=True):  # in the order of KINDS
            values.append(nbytes)
        self._module.append(self._running[-1][1] if self._running else -1)
        spans = _SPANS[-1]
        if recomputing_now() is not None:
            phase = "recomputation"
        elif in_backward():
            phase = "backward"
        else:
            phase = OPTIMIZER_STEP if OPTIMIZER_STEP in spans else "forward"
        self._phase.append(PHASES.index(phase))
        self._spans.append(_index(self._span_sets, spans))
        self._seconds.append(op_seconds(self.speed, func, args, kwargs, out) if self.speed is not None else 0.0)

    # queries ---------------------------------------------------------------------------------------------------------

    @property
    def peak_index(self) -> int | None:
        """The first moment with the most bytes on the device (``None``: no op ran)."""
        if not self._device:
            return None
        highest = max(self._device)
        return self._device.index(highest)

    @property
    def peak(self) -> Moment | None:
        """The moment the device's peak was reached (``None``: no op ran)."""
        index = self.peak_index
        return None if index is None else self[index]

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
        for phase, nbytes in zip(self._phase, self._device, strict=True):
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
        self.probe.tracker.on_op = self._record
        return self

    def __exit__(self, *args: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.probe._tracker is not None:
            self.probe.tracker.on_op = None


def _index(numbered: dict[Any, int], key: Any) -> int:
    """``key``'s number in ``numbered``, given the next one if it has none."""
    number = numbered.get(key)
    if number is None:
        number = numbered[key] = len(numbered)
    return number
