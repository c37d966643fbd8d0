"""The parts of tuning that are plain Python: memory budgets and blocks spread evenly. No Lightning here."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from lightning_memopt.compat import accelerator_free_memory, accelerator_total_memory
from lightning_memopt.units import fmt_bytes

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


#: The share of the memory free to this process that ``memory_budget="auto"`` leaves out of the budget. MemOpt's
#: budgets bound the tensors' peak (``max_memory_allocated``), while a CUDA process needs what its caching allocator
#: reserves: each allocation rounded up (to 512 B, and from segments of 2 MiB, 20 MiB or a multiple of 2 MiB) and the
#: unusable remainders of split segments. 5% is a choice, not a figure this project measured: steady training steps
#: commonly reserve a few percent above their allocated peak, and steps whose tensors change size reserve more
#: (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` lowers it). On CPU the same share covers malloc's rounding and
#: the interpreter's own memory, which ``RssAnon`` counts as held.
AUTO_MARGIN = 0.05


def parse_budget(value: int | float | str | None) -> int | float | str | None:
    """Validate a memory budget: bytes (int), a size string (``"12GiB"``, ``"500MB"``, ``"4096B"``), a fraction of
    the device's memory in (0, 1], also as a string (``"0.8"``, as a quoted YAML value arrives), or ``"auto"`` (any
    case): the memory free to this process at the start (:func:`auto_budget`).

    A number without a unit in a string is a fraction, never bytes: ``"500"`` is an error, not 500 bytes.

    Returns:
        Bytes as an int, a fraction of the device's memory as a float, ``"auto"``, or ``None``.

    Examples:
        >>> parse_budget("1.5KiB"), parse_budget("500MB"), parse_budget(0.5), parse_budget("0.8"), parse_budget(4096)
        (1536, 500000000, 0.5, 0.8, 4096)
        >>> parse_budget("auto"), parse_budget(" AUTO ")
        ('auto', 'auto')
        >>> parse_budget("500")
        Traceback (most recent call last):
        ...
        ValueError: `memory_budget` '500' has no unit: a number without one is a fraction of the device's memory in \
(0, 1]; for a size write it with a unit, such as '500MiB', '12GiB' or '500B'
    """
    error = ValueError(
        "`memory_budget` must be bytes (int > 0), a size such as '12GiB' or '500MB', a fraction in (0, 1] or 'auto',"
        f" got {value!r}"
    )
    if value is None:
        return None
    if isinstance(value, bool):
        raise error
    if isinstance(value, int):
        if value <= 0:
            raise error
        return value
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise error
        return value
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return "auto"
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", value, flags=re.IGNORECASE)
        if match and match.group(2) is None:
            number = float(match.group(1))
            if 0 < number <= 1:
                return number
            raise ValueError(
                f"`memory_budget` {value!r} has no unit: a number without one is a fraction of the device's memory in"
                " (0, 1]; for a size write it with a unit, such as '500MiB', '12GiB' or '500B'"
            )
        if match and (unit := match.group(2).upper()) in _UNITS and float(match.group(1)) > 0:
            return int(float(match.group(1)) * _UNITS[unit])
    raise error


def total_memory(device: torch.device) -> int:
    """The device's total memory in bytes: physical RAM on CPU."""
    if device.type == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return accelerator_total_memory(device)


def resolve_budget(budget: int | float | str | None, device: torch.device) -> int | None:
    """Bytes for a budget from :func:`parse_budget` (see :func:`budget_for`)."""
    return budget_for(budget, device)[0]


def budget_for(budget: int | float | str | None, device: torch.device) -> tuple[int | None, str | None]:
    """Bytes for a budget from :func:`parse_budget`, turning a fraction into bytes of ``device`` and ``"auto"`` into
    what :func:`auto_budget` reads of it now; and for ``"auto"`` the report's sentence of what it resolved to
    (:attr:`AutoBudget.words`), else ``None``.

    Examples:
        >>> budget_for(4096, torch.device("cpu")), budget_for(None, torch.device("cpu"))
        ((4096, None), (None, None))
    """
    if budget == "auto":
        auto = auto_budget(device)
        return auto.bytes, auto.words
    if isinstance(budget, float):
        return int(budget * total_memory(device)), None
    return budget, None  # type: ignore[return-value]


@dataclass(frozen=True)
class AutoBudget:
    """What ``memory_budget="auto"`` resolved to on a device, and from what.

    Attributes:
        device: The device, as ``str(torch.device)`` with its index (``"cuda:0"``, ``"cpu"``).
        free: The bytes free to any process: ``torch.cuda.mem_get_info``'s free memory on an accelerator,
            ``MemAvailable`` of ``/proc/meminfo`` on CPU.
        held: The bytes this process already held: its caching allocator's reserved bytes on an accelerator, its
            anonymous resident memory (``RssAnon`` of ``/proc/self/status``) on CPU.
        bytes: The budget: ``(free + held) * (1 - AUTO_MARGIN)``, rounded down.
    """

    device: str
    free: int
    held: int
    bytes: int

    @property
    def words(self) -> str:
        """What it resolved to and from what, for the report."""
        total, free, held = fmt_bytes(self.free + self.held), fmt_bytes(self.free), fmt_bytes(self.held)
        if self.device == "cpu":
            source = f"the memory of this machine available to this process at the start ({total}: {free} available"
            source += f" and {held} it held)"
        else:
            source = f"the memory of {self.device} free to this process at the start ({total}: {free} free and {held}"
            source += " its caching allocator held)"
        margin = f"less {AUTO_MARGIN:.0%} for the allocator's rounding and fragmentation"
        return f"memory_budget='auto': {fmt_bytes(self.bytes)}, {source} {margin}"


def auto_budget(device: torch.device | str) -> AutoBudget:
    """``memory_budget="auto"`` on ``device``, read now: the memory this process could have for its tensors, less
    :data:`AUTO_MARGIN` for the allocator's rounding and fragmentation.

    That memory is what the process already holds plus what is free to it: MemOpt's budgets bound every tensor of the
    process (the weights, optimizer state and batch already there included, as ``max_memory_allocated`` does), so the
    memory those already take is in the budget, not out of it. On an accelerator it is the free memory of
    ``torch.cuda.mem_get_info`` plus the bytes the caching allocator holds reserved: reserved bytes are used to
    other processes but free to this one's tensors. The CUDA context (this process's and others') is outside the
    allocator, and ``mem_get_info`` already counts it as used, so nothing more is subtracted for it; memory outside
    the allocator that appears later (kernels loaded lazily, library workspaces, communication buffers) is not seen
    here. On CPU it is ``MemAvailable`` (what the kernel can give without swapping: free pages plus reclaimable
    cache; ``SC_AVPHYS_PAGES`` is only the free pages) plus this process's anonymous resident memory (``RssAnon``:
    the tensors it loaded, and the interpreter's own few hundred MiB, which the margin covers). Both sums change little
    while the process runs, as memory moves from free to held, so the stages opened later in a fit read about the
    same budget; other processes that take memory after the start are not foreseen. Several processes on one device
    (ranks on one machine's CPU) each read the whole: give those a size. Elsewhere than Linux, ``psutil`` gives the
    available memory and the process's resident set where it is installed.

    Raises:
        ValueError: On the meta device, a device this machine does not have, or where the free memory cannot be read.
    """
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError(
            "`memory_budget` 'auto' is the memory free on the device at the start, and the meta device has none:"
            " estimate for 'cpu' or an accelerator, or give a size such as '12GiB'"
        )
    if device.type == "cpu":
        free, held = _cpu_memory()
    else:
        backend = getattr(torch, device.type, None)
        if backend is None or not getattr(backend, "is_available", lambda: False)():
            raise ValueError(
                f"`memory_budget` 'auto' is the memory free on {str(device)!r} at the start, and this machine does"
                " not have it: give a size such as '12GiB'"
            )
        if device.index is None and device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        free, held = accelerator_free_memory(device)
    return AutoBudget(str(device), free, held, int((free + held) * (1 - AUTO_MARGIN)))


def _cpu_memory() -> tuple[int, int]:
    """This machine's available memory and this process's anonymous resident memory, in bytes."""
    try:
        return _proc_kib("/proc/meminfo", "MemAvailable") * 1024, _proc_kib("/proc/self/status", "RssAnon") * 1024
    except (OSError, KeyError, ValueError):
        pass
    try:
        import psutil
    except ImportError:
        raise ValueError(
            "`memory_budget` 'auto' on CPU reads the available memory from /proc/meminfo (Linux) or psutil, and"
            " neither is here: give a size such as '12GiB' or a fraction such as 0.8"
        ) from None
    return int(psutil.virtual_memory().available), int(psutil.Process().memory_info().rss)


def _proc_kib(path: str, field: str) -> int:
    """A ``Field:   123 kB`` line's number from a ``/proc`` file."""
    with open(path) as lines:
        for line in lines:
            name, _, rest = line.partition(":")
            if name == field:
                return int(rest.split()[0])
    raise KeyError(field)


def spread(n: int, k: int) -> list[int]:
    """``k`` of ``n`` block indices, spread evenly: every n/k-th block.

    Examples:
        >>> spread(8, 2), spread(8, 4), spread(3, 3), spread(5, 0)
        ([2, 6], [1, 3, 5, 7], [0, 1, 2], [])
    """
    return [min(n - 1, int((i + 0.5) * n / k)) for i in range(k)]
