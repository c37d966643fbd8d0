"""The contract of a technique plug-in, and the line it adds to a report.

A technique is one object per run of a stage (:class:`~lightning_memopt.engine.changes.Changes` makes one of each
registered class whose ``stages`` hold the stage). It finds its units in each model (through the adapters), applies
and undoes itself as a transaction, is the only writer of its settings in force, switches its units off for a while
to show the model as the user gave it, says in one line what it has in force, and keeps what a resumed run needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from torch import nn

if TYPE_CHECKING:  # the adapters import the techniques' mechanics: no import of them at run time
    from lightning_memopt.adapters import FoundModel


@dataclass(frozen=True)
class Applied:
    """What MemOpt did to one model in a run.

    Attributes:
        model: The model's attribute path and class, such as ``unet (UNet2DModel)``.
        technique: ``checkpointing``, ``chunking`` or ``decoding`` (VAE slicing and tiling).
        method: The library switch that was used, or ``generic ...``.
        blocks: How many blocks it reached.
    """

    model: str
    technique: str
    method: str
    blocks: int


@dataclass
class Change:
    """One technique applied to one model (what an adapter returns).

    Attributes:
        method: How it was applied, for the user: the library switch that was called, or ``generic``.
        blocks: How many blocks (layers) it reached.
        handle: Undoes the change exactly.
        units: The technique's units in this model, whose settings can be changed while the model runs (a chunked
            block, an autoencoder's decode).
        switches: For checkpointing, the blocks that can be switched off and on one by one (a model whose library
            has one flag for all its blocks has none).
        skipped: Parts of the model left unchanged, each with the reason, for a warning.
    """

    method: str
    blocks: int
    handle: Any
    units: list[Any] = field(default_factory=list)
    switches: list[Any] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


class Technique(Protocol):
    """One technique. See the module's docstring for the contract."""

    #: Its name in reports and logs.
    name: ClassVar[str]
    #: The stages it acts in: ``("fit",)`` or the loops without gradients.
    stages: ClassVar[tuple[str, ...]]

    def apply(self, found: FoundModel, config: Any) -> Change | None:
        """Change one model (``config``: a :class:`~lightning_memopt.engine.config.MemOptConfig`); ``None`` where it
        has nothing this technique can use. Raises, having undone its part of that model, where it cannot be changed."""
        ...

    def remove(self) -> None:
        """Undo everything, exactly."""
        ...

    def off(self) -> contextlib.AbstractContextManager[None]:
        """Every unit switched off for a while (the model as the user gave it), then back as it was."""
        ...

    @property
    def changed(self) -> bool:
        """Whether any unit is in force."""
        ...

    def describe(self) -> str | None:
        """The settings in force, in words, for the report (``None``: nothing to say)."""
        ...

    def state(self) -> dict[str, Any]:
        """The settings in force as plain values, for a checkpoint (``state_dict``)."""
        ...

    def load(self, state: dict[str, Any]) -> bool:
        """Put saved settings in force; ``False`` where they do not fit the units (then nothing is changed)."""
        ...

    def switchables(self) -> list[Any]:
        """The changed modules in force, each with how to switch it on and off, to time what the change costs when
        the loop ends (:class:`~lightning_memopt.techniques.base.Switchable`); none where it is timed in the step."""
        ...

    def timer(self, synchronize: Callable[[], None]) -> Any:
        """What times, in the step itself, the work the technique adds (``None``: it is timed alone afterwards);
        ``.seconds`` and ``.remove()``."""
        ...


@dataclass
class Switchable:
    """A changed module: its name, the method its calls go through, and how to switch the change on and off."""

    name: str
    module: nn.Module
    method: str
    on: Callable[[], None]
    off: Callable[[], None]
