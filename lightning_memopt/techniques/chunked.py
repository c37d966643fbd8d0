"""What the techniques whose units are each ``"plain"`` or chunked share (the loss, the feed-forward at fit): each
unit's setting a knob of the stage's planner, the ranks' agreement, the saved state and the plan's line."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from torch import nn

from lightning_memopt.techniques.base import Knob, Plan, Planning, Technique

#: A unit's settings: as the model computes it, or in chunks.
SETTINGS = ("plain", "chunked")


class ChunkedUnits(Technique):
    """A technique whose units (each with a ``name`` and a ``setting``, one of :meth:`offered`, by default
    :data:`SETTINGS`, the first ``"plain"``, the later ones finer) are knobs of the stage's planner. A subclass says on
    which module a unit's knob is recorded and whether a setting is worth a dry run (:meth:`module_of`,
    :meth:`worth`), and which setting is its reference (:attr:`reference`): without a budget, the planner keeps the
    peak within :data:`~lightning_memopt.techniques.planner.SLACK` of the one with every knob at its reference, for the
    least predicted time."""

    #: ``"chunked"``: without a budget a unit stays plain only where that keeps the peak near the one with every unit
    #: chunked; ``"plain"``: it is chunked only where a budget needs it (or where that is no slower).
    reference = "chunked"

    def __init__(self) -> None:
        self.units: list[Any] = []
        self._knobs: list[Knob] = []
        self._chosen: Any = None  # what the stage's planner chose (an Outcome)

    @classmethod
    def uses_budget(cls, config: Any) -> bool:
        return True

    def module_of(self, unit: Any) -> nn.Module:
        """The module the planner records for ``unit``'s knob."""
        raise NotImplementedError

    def worth(self, unit: Any, setting: Hashable) -> bool:
        """Whether ``setting`` could change anything in ``unit``, from the dry runs so far."""
        return True

    def offered(self, planning: Planning | None = None) -> tuple[str, ...]:
        """The settings a unit's knob has, ``"plain"`` first and the finest last (for ``planning``; ``None``: every
        setting a unit may have been given, as the ranks agree on them)."""
        return SETTINGS

    @property
    def chunked(self) -> int:
        return sum(u.setting != "plain" for u in self.units)

    @property
    def saved(self) -> int | None:
        """What the settings in force save, as the planner's cost table models it."""
        return self._chosen.saved(self._knobs) if self._chosen is not None else None

    def knobs(self, planning: Planning) -> list[Knob]:
        settings = self.offered(planning)
        self._knobs = [self._knob(u, settings) for u in self.units] if planning.choose else []
        return self._knobs

    def _knob(self, unit: Any, settings: tuple[str, ...]) -> Knob:
        def put(setting: Hashable) -> None:
            unit.setting = setting

        def worth(setting: Hashable, seen: Callable[[Hashable], Any]) -> bool:
            return setting == "plain" or self.worth(unit, setting)

        return Knob(unit.name, self.module_of(unit), settings, put, lambda: unit.setting, self.reference, worth=worth)

    def plan(self, planning: Planning) -> Plan | None:
        if not (self._knobs and planning.chosen is not None):
            return None
        self._chosen = planning.chosen
        return Plan()  # what was chosen is said with what every technique does (Changes.announce)

    def agree(self, reduce_max: Callable[[list[float]], list[float]]) -> None:
        """A unit is chunked where any rank chose it, as finely as the finest rank's."""
        if self.units:
            settings = self.offered()
            chosen = reduce_max([float(settings.index(u.setting)) for u in self.units])
            for unit, index in zip(self.units, chosen, strict=True):
                unit.setting = settings[int(index)]

    def state(self) -> dict[str, Any]:
        return {"units": [u.name for u in self.units], "settings": [u.setting for u in self.units]}

    def load(self, state: dict[str, Any]) -> bool:
        if state.get("units") != [u.name for u in self.units]:
            return False
        for unit, setting in zip(self.units, state["settings"], strict=True):
            unit.setting = setting
        return True
