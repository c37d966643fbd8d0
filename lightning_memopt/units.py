"""Figures for people: bytes, FLOPs and fractions in words."""

from __future__ import annotations


class Recomputed:
    """What holds ``recompute_flops`` (the FLOPs checkpointed blocks compute again in the backward pass) and
    ``forward_flops`` (the forward pass's), and so their ratio.

    Examples:
        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Figures(Recomputed):
        ...     recompute_flops: int | None = None
        ...     forward_flops: int | None = None
        >>> Figures(50, 200).recompute_fraction, Figures(50, 0).recompute_fraction, Figures().recompute_fraction
        (0.25, None, None)
    """

    recompute_flops: int | None
    forward_flops: int | None

    @property
    def recompute_fraction(self) -> float | None:
        """``recompute_flops`` over ``forward_flops``; ``None`` where either is unknown or the forward pass is none."""
        if self.recompute_flops is None or not self.forward_flops:
            return None
        return self.recompute_flops / self.forward_flops


def fmt_bytes(value: int | None) -> str:
    """Bytes for people: ``12.30 GiB``, ``512 B``; ``unknown`` for ``None``.

    Examples:
        >>> fmt_bytes(3 * 2**30 + 2**29), fmt_bytes(None)
        ('3.50 GiB', 'unknown')
    """
    if value is None:
        return "unknown"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value} B"


def fmt_parts(parts: dict[str, int]) -> str:
    """Bytes by what holds them, in words, those with none left out.

    Examples:
        >>> fmt_parts({"weights": 3 * 2**30, "gradients": 0, "activations": 512})
        'weights 3.00 GiB, activations 512 B'
    """
    return ", ".join(f"{name} {fmt_bytes(n)}" for name, n in parts.items() if n)


def fmt_sizes(*values: int) -> list[str]:
    """Sizes for people (:func:`fmt_bytes`), set side by side: where two different sizes would read the same, each
    says its exact bytes too.

    Examples:
        >>> fmt_sizes(12 * 2**30, 8 * 2**30)
        ['12.00 GiB', '8.00 GiB']
        >>> fmt_sizes(495_356, 495_355)
        ['483.75 KiB (495,356 bytes)', '483.75 KiB (495,355 bytes)']
    """
    words = [fmt_bytes(v) for v in values]
    if any(words.count(w) > 1 and values[i] != values[words.index(w)] for i, w in enumerate(words)):
        return [f"{w} ({v:,} bytes)" if abs(v) >= 2**10 else w for w, v in zip(words, values, strict=True)]
    return words


def fmt_flops(value: int | None) -> str:
    """FLOPs in a readable unit.

    Examples:
        >>> fmt_flops(1_234_000_000), fmt_flops(512), fmt_flops(None)
        ('1.23 GFLOP', '512 FLOP', 'unknown')
    """
    if value is None:
        return "unknown"
    for unit, size in (("TFLOP", 10**12), ("GFLOP", 10**9), ("MFLOP", 10**6), ("kFLOP", 10**3)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value} FLOP"


def percent(value: float | None, signed: bool = False) -> str:
    """A fraction as a percentage; ``unknown`` for ``None``.

    Examples:
        >>> percent(0.25), percent(-0.031, signed=True), percent(None)
        ('25.0%', '-3.1%', 'unknown')
    """
    if value is None:
        return "unknown"
    return f"{value:+.1%}" if signed else f"{value:.1%}"


def modelled_saving(nbytes: int | None) -> str:
    """What a technique's settings save as the stage planner's cost table models it, for a summary line ("" where
    nothing or unknown).

    Examples:
        >>> modelled_saving(3 * 2**30), modelled_saving(None)
        (" (saves 3.00 GiB, as the planner's table models it)", '')
    """
    return f" (saves {fmt_bytes(nbytes)}, as the planner's table models it)" if nbytes else ""
