"""The parts of tuning that are plain Python: memory budgets and blocks spread evenly. No Lightning here."""

from __future__ import annotations

import os
import re

import torch

from lightning_memopt.compat import accelerator_total_memory

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_budget(value: int | float | str | None) -> int | float | None:
    """Validate a memory budget: bytes (int), a size string (``"12GiB"``, ``"500MB"``, ``"4096B"``) or a fraction of
    the device's memory in (0, 1], also as a string (``"0.8"``, as a quoted YAML value arrives).

    A number without a unit in a string is a fraction, never bytes: ``"500"`` is an error, not 500 bytes.

    Returns:
        Bytes as an int, a fraction of the device's memory as a float, or ``None``.

    Examples:
        >>> parse_budget("1.5KiB"), parse_budget("500MB"), parse_budget(0.5), parse_budget("0.8"), parse_budget(4096)
        (1536, 500000000, 0.5, 0.8, 4096)
        >>> parse_budget("500")
        Traceback (most recent call last):
        ...
        ValueError: `memory_budget` '500' has no unit: a number without one is a fraction of the device's memory in \
(0, 1]; for a size write it with a unit, such as '500MiB', '12GiB' or '500B'
    """
    error = ValueError(
        "`memory_budget` must be bytes (int > 0), a size such as '12GiB' or '500MB', or a fraction in (0, 1],"
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


def resolve_budget(budget: int | float | None, device: torch.device) -> int | None:
    """Bytes for a budget from :func:`parse_budget`, turning a fraction into bytes of ``device``."""
    if isinstance(budget, float):
        return int(budget * total_memory(device))
    return budget


def spread(n: int, k: int) -> list[int]:
    """``k`` of ``n`` block indices, spread evenly: every n/k-th block.

    Examples:
        >>> spread(8, 2), spread(8, 4), spread(3, 3), spread(5, 0)
        ([2, 6], [1, 3, 5, 7], [0, 1, 2], [])
    """
    return [min(n - 1, int((i + 0.5) * n / k)) for i in range(k)]
