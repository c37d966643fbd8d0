"""One config type: every MemOpt option and its validation, shared by :class:`~lightning_memopt.MemOpt`,
:func:`~lightning_memopt.estimate` and the ``lightning-memopt estimate`` command."""

from __future__ import annotations

import difflib
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

from lightning_memopt.tuning import parse_budget

#: The options that take a word besides True and False, and those words.
WORDS = {
    "checkpointing": ("auto", "offload"),
    "optimizer_in_backward": ("auto", "host"),
    "optimizer_state_8bit": ("auto",),
    "weights_8bit": ("auto", "nf4"),
}


@dataclass(frozen=True)
class MemOptConfig:
    """MemOpt's options, validated once and frozen. The arguments are those of :class:`~lightning_memopt.MemOpt`,
    which documents each; ``memory_budget`` is kept parsed (bytes as an int, a fraction of the device's memory as a
    float, or ``"auto"``, resolved on the device when a stage opens), ``models`` and ``checkpoint_blocks`` as tuples.

    Examples:
        >>> config = MemOptConfig(memory_budget="1KiB", models=["unet"])
        >>> config.memory_budget, config.models, config.chunk_size
        (1024, ('unet',), 'auto')
        >>> MemOptConfig(chunk_dim=2)
        Traceback (most recent call last):
        ...
        ValueError: `chunk_dim` must be 0 (batch) or 1 (sequence), got 2
        >>> MemOptConfig(enabled=False).checkpointing, MemOptConfig(enabled=False).chunking
        (False, False)
        >>> MemOptConfig().checkpointing, MemOptConfig(memory_budget="12GiB").checkpointing  # a budget is enough
        (True, 'auto')
    """

    checkpointing: bool | Literal["auto", "offload"] | None = None
    chunked_loss: bool = True
    chunking: bool = True
    chunk_size: int | Literal["auto"] = "auto"
    chunk_dim: int = 1
    memory_budget: int | float | str | None = None
    models: Sequence[str] | None = None
    checkpoint_blocks: Sequence[str] | None = None
    strict: bool = False
    measure: bool = True
    verify: bool = False
    verify_tolerance: float = 1e-5
    free_gradients: bool = True
    optimizer_in_backward: bool | Literal["auto", "host"] = "auto"
    optimizer_state_8bit: bool | Literal["auto"] = "auto"
    weights_8bit: bool | Literal["auto", "nf4"] = "auto"
    lossy: bool = False
    enabled: bool = True

    @property
    def may_change_results(self) -> bool:
        """Settings that change results may be chosen: ``lossy=True``, and not under ``verify``."""
        return self.lossy and not self.verify

    def __post_init__(self) -> None:
        if self.checkpointing is None:  # the default: a budget alone is enough for the blocks to be planned under it
            object.__setattr__(self, "checkpointing", "auto" if self.memory_budget is not None else True)
        for name, words in WORDS.items():
            value = getattr(self, name)
            if not (isinstance(value, bool) or value in words):
                allowed = ["True", "False", *map(repr, words)]
                raise ValueError(f"`{name}` must be {', '.join(allowed[:-1])} or {allowed[-1]}, got {value!r}")
        for name in ("chunked_loss", "chunking", "free_gradients", "lossy", "strict", "measure", "enabled", "verify"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be True or False, got {getattr(self, name)!r}")
        if self.optimizer_state_8bit is True and self.lossy is not True and self.enabled:
            raise ValueError(
                "`optimizer_state_8bit=True` keeps the optimizer's moments in 8 bits, which changes results: pass "
                "lossy=True as well"
            )
        if self.optimizer_in_backward == "host" and self.optimizer_state_8bit is True and self.enabled:
            raise ValueError(
                "`optimizer_in_backward='host'` keeps the optimizer state in host memory, in full, and "
                "`optimizer_state_8bit=True` keeps it in 8 bits on the device: pass one of them"
            )
        if self.weights_8bit in (True, "nf4") and self.lossy is not True and self.enabled:
            bits = "4 bits (NF4)" if self.weights_8bit == "nf4" else "8 bits"
            raise ValueError(
                f"`weights_8bit={self.weights_8bit!r}` keeps the weights in {bits}, which changes results: pass "
                "lossy=True as well"
            )
        tolerance = self.verify_tolerance
        if (
            isinstance(tolerance, bool)
            or not isinstance(tolerance, (int, float))
            or not math.isfinite(tolerance)
            or tolerance < 0
        ):
            raise ValueError(f"`verify_tolerance` must be a non-negative finite number, got {tolerance!r}")
        dim = self.chunk_dim
        if isinstance(dim, bool) or not isinstance(dim, int) or dim not in (0, 1):
            raise ValueError(f"`chunk_dim` must be 0 (batch) or 1 (sequence), got {dim!r}")
        size = self.chunk_size
        positive = isinstance(size, int) and not isinstance(size, bool) and size >= 1
        if size != "auto" and not positive:
            raise ValueError(f"`chunk_size` must be a positive int or 'auto', got {size!r}")
        normal = {
            "memory_budget": parse_budget(self.memory_budget),
            "models": _names_or_none("models", self.models),
            "checkpoint_blocks": _names_or_none("checkpoint_blocks", self.checkpoint_blocks),
            "verify_tolerance": float(tolerance),
        }
        if not self.enabled:  # a switch for configs: nothing at all is done
            normal.update(
                checkpointing=False,
                chunked_loss=False,
                chunking=False,
                free_gradients=False,
                optimizer_in_backward=False,
                optimizer_state_8bit=False,
                weights_8bit=False,
            )
        for name, value in normal.items():
            object.__setattr__(self, name, value)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every option's name, in order."""
        return tuple(f.name for f in fields(cls))

    def replace(self, **changes: Any) -> MemOptConfig:
        """A copy with some options changed (validated again)."""
        given = {name: getattr(self, name) for name in self.names()}
        return MemOptConfig(**{**given, **changes})


def _names_or_none(argument: str, value: Sequence[str] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str) or not value or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"`{argument}` must be a non-empty list of names or None, got {value!r}")
    return tuple(value)


def refuse_unknown(given: Iterable[str], where: str) -> None:
    """Refuse option names that are not MemOpt's, naming the first and the closest one that is (a misspelling).

    Examples:
        >>> refuse_unknown(["memory_budget", "chekpointing"], "MemOpt()")
        Traceback (most recent call last):
        ...
        TypeError: MemOpt() got an unknown option `chekpointing`; did you mean `checkpointing`?
    """
    known = MemOptConfig.names()
    unknown = [name for name in given if name not in known]
    if not unknown:
        return
    close = difflib.get_close_matches(unknown[0], known, n=1)
    hint = f"did you mean `{close[0]}`?" if close else f"the options are {', '.join(known)}"
    raise TypeError(f"{where} got an unknown option `{unknown[0]}`; {hint}")


def options_checked(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` (a constructor taking MemOpt's options by name) refusing unknown names with :func:`refuse_unknown`
    before Python's bare ``TypeError``; its signature stays the one LightningCLI reads."""

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        refuse_unknown(kwargs, f"{type(self).__name__}()")
        init(self, *args, **kwargs)

    return checked
