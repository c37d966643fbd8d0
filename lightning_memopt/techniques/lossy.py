"""What the techniques that change results (``lossy=True``: the 8-bit optimizer state, the 8-bit weights) share.

The 8-bit kernels both use (:func:`quantize`, :func:`dequantize`: bitsandbytes' blockwise quantization, by blocks of
:data:`BLOCK` values), here rather than in either technique, so that neither imports the other.

One contract for saying by how much results change (:class:`Difference`): once the difference is measured, a warning
that says what is kept lossy and gives the difference, the difference logged as ``memopt/<key>`` (a metric of the
technique's section), and a line of its section in the printed summary.

And bitsandbytes, imported only where one of them quantizes something real (:func:`bitsandbytes`), without its
import-time noise: importing it takes seconds and, with the ``kernels`` package installed, logs that a CPU kernel could
not be loaded from the Hugging Face Hub, which is of no use to MemOpt (it uses the blockwise 8-bit ops alone). The dry
runs count the 8-bit ops without it (:func:`counted_only`, the shapes and types its fake-tensor rules give).

Pure torch: no Lightning imports here.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from lightning_memopt.compat import FakeTensor, distributed_initialized

#: What importing bitsandbytes says that is no news to a MemOpt user, by where it is said: the logger of its CPU
#: backend (bitsandbytes 0.48 on, with the ``kernels`` package installed, on a CPU with AVX-512 BF16: a 4-bit CPU
#: kernel it tries to fetch from the Hugging Face Hub, which MemOpt never uses), what the ``kernels`` package logs
#: under ERROR while it tries (a trust check skipped offline), and warnings that its imports of torch's compiler raise
#: (torch 2.10 on). Only these are dropped, and only while it is imported; an error raised by the import is raised as
#: it is, after whatever it printed.
NOISE_LOGGERS = ("bitsandbytes.backends.cpu.ops",)
NOISE_LINES = ("Failed to load CPU gemm_4bit_forward from kernels-community",)
QUIET_LOGGERS = ("kernels",)
NOISE_WARNINGS = (r"`torch\.jit\.script_method` is deprecated",)


class _Known(logging.Filter):
    """Drops the records of :data:`NOISE_LINES` under ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not str(record.msg).startswith(NOISE_LINES)


def bitsandbytes() -> ModuleType:
    """bitsandbytes, imported the first time a technique quantizes something (which registers its ops), its known
    import-time noise dropped (:data:`NOISE_LINES`, :data:`NOISE_WARNINGS`); anything else it prints or logs is said as
    usual, and an error is raised, after what it printed."""
    loaded = sys.modules.get("bitsandbytes")
    if loaded is not None:
        return loaded
    with _quiet():
        import bitsandbytes as module
    return module


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    known = _Known()
    loggers = [logging.getLogger(name) for name in NOISE_LOGGERS]
    quiet = [(logger, logger.level) for logger in map(logging.getLogger, QUIET_LOGGERS)]
    out, err = io.StringIO(), io.StringIO()
    failed = True
    try:
        for logger in loggers:
            logger.addFilter(known)
        for logger, level in quiet:
            logger.setLevel(max(level, logging.ERROR))
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            for message in NOISE_WARNINGS:
                warnings.filterwarnings("ignore", message=message)
            yield
        failed = False
    finally:
        for logger in loggers:
            logger.removeFilter(known)
        for logger, level in quiet:
            logger.setLevel(level)
        for captured, stream in ((out, sys.stdout), (err, sys.stderr)):  # said as it would have been, less the noise
            lines = captured.getvalue().splitlines(keepends=True)
            kept = "".join(line for line in lines if failed or not line.startswith(NOISE_LINES))
            if kept:
                stream.write(kept)
                stream.flush()


def counted_only(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has no values (a dry run's fake tensor, or one on the meta device): an 8-bit op on it only
    needs its outputs' shapes and types, which bitsandbytes' fake-tensor rules give and :func:`bitsandbytes` need not
    be imported for."""
    return isinstance(tensor, FakeTensor) or tensor.is_meta


#: Values per block sharing one scale in the 8-bit kernels below.
BLOCK = 256

_MAPS: dict[tuple[bool, torch.device], torch.Tensor] = {}


def code_map(signed: bool, device: torch.device) -> torch.Tensor:
    """The 256 values a code stands for (bitsandbytes' dynamic map) on ``device``: made once per device, best before
    the first real step that quantizes (a technique's ``batch_start``), outside any dry run (inside one, on a device
    this machine lacks, a copy is made for that run alone)."""
    device = torch.device(device)
    found = _MAPS.get((signed, device))
    if found is None:
        bitsandbytes()
        from bitsandbytes.functional import create_dynamic_map

        with unset_fake_temporarily():
            made = create_dynamic_map(signed=signed)
            if device.type == "cpu" or device.type == "meta" or _available(device):
                found = _MAPS[(signed, device)] = made.to(device)
        if found is None:  # a device a dry run pretends to be on
            found = made.to(device)
    return found


def _available(device: torch.device) -> bool:
    return torch.accelerator.is_available() and torch.accelerator.current_accelerator().type == device.type


def quantize(value: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``value`` in 8 bits: its codes (uint8, its shape) and one scale per block of :data:`BLOCK` values (float32),
    by bitsandbytes' blockwise quantization (one op, which holds nothing but these). A dry run's fake tensor, or one on
    the meta device, gets these outputs as bitsandbytes' fake-tensor rule makes them, without bitsandbytes.

    Examples:
        >>> value = torch.linspace(-1, 1, 512)
        >>> codes, scale = quantize(value, signed=True)
        >>> codes.dtype, scale.shape, bool((dequantize(codes, scale, True, torch.float32) - value).abs().max() < 0.02)
        (torch.uint8, torch.Size([2]), True)
    """
    if counted_only(value):  # as bitsandbytes' fake-tensor rule (bitsandbytes/_ops.py)
        codes = torch.empty_like(value, dtype=torch.uint8)
        return codes, torch.empty((-(value.numel() // -BLOCK),), dtype=torch.float32, device=value.device)
    bitsandbytes()  # registers the ops
    codes, scale = torch.ops.bitsandbytes.quantize_blockwise(value, code_map(signed, value.device), BLOCK)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, signed: bool, dtype: torch.dtype) -> torch.Tensor:
    """The values ``codes`` and ``scale`` (from :func:`quantize`) stand for, in ``dtype`` (for a dry run's fake codes,
    or codes on the meta device, a tensor of that shape and type, as bitsandbytes' fake-tensor rule makes it)."""
    if counted_only(codes):
        return torch.empty_like(codes, dtype=dtype)
    bitsandbytes()
    return torch.ops.bitsandbytes.dequantize_blockwise(codes, scale, code_map(signed, codes.device), BLOCK, dtype)


#: Values per block sharing one scale in the 4-bit (NF4) kernels below.
NF4_BLOCK = 64


def quantize_nf4(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``value`` in 4 bits, as QLoRA keeps a frozen base: NF4 codes, two to a byte (uint8), and one float32 scale per
    block of :data:`NF4_BLOCK` values, by bitsandbytes' ``quantize_4bit``. A dry run's fake tensor, or one on the meta
    device, gets these outputs as bitsandbytes' fake-tensor rule makes them, without bitsandbytes.

    Examples:
        >>> value = torch.linspace(-1, 1, 512)
        >>> codes, scale = quantize_nf4(value)
        >>> back = dequantize_nf4(codes, scale, value.shape, torch.float32)
        >>> codes.numel(), scale.shape, round(float((back - value).abs().max()), 2)  # NF4 is coarsest near the ends
        (256, torch.Size([8]), 0.15)
    """
    if counted_only(value):  # as bitsandbytes' fake-tensor rule (bitsandbytes/_ops.py)
        codes = torch.empty(((value.numel() + 1) // 2, 1), dtype=torch.uint8, device=value.device)
        return codes, torch.empty((-(value.numel() // -NF4_BLOCK),), dtype=torch.float32, device=value.device)
    bitsandbytes()
    return torch.ops.bitsandbytes.quantize_4bit(value, NF4_BLOCK, "nf4", torch.uint8)


def dequantize_nf4(codes: torch.Tensor, scale: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The values ``codes`` and ``scale`` (from :func:`quantize_nf4`) stand for, of ``shape``, in ``dtype``."""
    if counted_only(codes):
        return torch.empty(shape, dtype=dtype, device=codes.device)
    bitsandbytes()
    return torch.ops.bitsandbytes.dequantize_4bit(codes, scale, NF4_BLOCK, "nf4", list(shape), dtype)


@dataclass
class Difference:
    """How a technique that changes results says by how much: the largest difference it measured, relative.

    Attributes:
        key: The report's attribute and the logged key (``memopt/<key>``): ``optimizer_state_8bit_difference``.
        what: What differs, and from what: ``a moment kept in 8 bits from its value in full``.
        relative: What the difference is a fraction of: ``its largest value``.
        warned: The warning was given (once per stage).

    Examples:
        >>> difference = Difference("weights_8bit_difference", "a stored weight from its original", "its largest value")
        >>> difference.warning("the weights of 2 layers are kept in 8 bits", 0.0071)
        'the weights of 2 layers are kept in 8 bits, which changes results: the largest difference of a stored weight \
from its original is 0.0071 of its largest value (logged as memopt/weights_8bit_difference)'
        >>> difference.warning("the weights of 2 layers are kept in 8 bits", 0.0071) is None  # said once
        True
        >>> difference.lines(0.0071)
        ['changes results: largest difference 0.0071 of its largest value (weights_8bit_difference)']
        >>> difference.metrics(None), difference.lines(None)
        ({'weights_8bit_difference': None}, [])
    """

    key: str
    what: str
    relative: str
    warned: bool = False

    def warning(self, kept: str, value: float | None) -> str | None:
        """``kept`` (what is kept lossy, in words) and the difference, for a warning, the first time it is known;
        ``None`` after, and while it is not."""
        if value is None or self.warned:
            return None
        self.warned = True
        return (
            f"{kept}, which changes results: the largest difference of {self.what} is {value:.2g} of {self.relative} "
            f"(logged as memopt/{self.key})"
        )

    def metrics(self, value: float | None) -> dict[str, float | None]:
        """The difference, as the section's metric (logged as ``memopt/<key>`` where known)."""
        return {self.key: value}

    def lines(self, value: float | None) -> list[str]:
        """The summary's line for it, where it is known."""
        if value is None:
            return []
        return [f"changes results: largest difference {value:.2g} of {self.relative} ({self.key})"]


def warn(message: str) -> None:
    """``message`` as a warning from MemOpt, on the first process only (as the stage's own warnings are), for a
    difference measured after a step, where no plan of the stage is left to say it."""
    if distributed_initialized() and torch.distributed.get_rank() != 0:
        return
    warnings.warn(f"MemOpt: {message}.", UserWarning, stacklevel=3)
