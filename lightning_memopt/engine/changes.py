"""The changes MemOpt makes to the models in one stage: every registered technique of the stage whose option is on,
applied to each model found, undone exactly, and switched off for a while to see the model as the user gave it."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_memopt.adapters import FoundModel
from lightning_memopt.engine.config import MemOptConfig
from lightning_memopt.engine.step import StepContext
from lightning_memopt.handles import remove_all
from lightning_memopt.techniques import Applied, Technique, techniques_for


class Changes:
    """The stage's techniques (those registered whose ``stages`` hold it and whose ``option`` is on, see
    :func:`~lightning_memopt.techniques.techniques_for`), applied to the models found.

    Args:
        stage: ``fit``, ``predict``, ``validate`` or ``test``.
        found: The models to change.
        config: MemOpt's options.
        skipped: Called with a sentence when a model has nothing the stage's techniques can use.
        exclude: Technique classes left out (one that a Lightning strategy does itself).
        context: The Trainer's facts (:class:`~lightning_memopt.engine.step.StepContext`), given to each technique as
            its ``context`` before it is applied.

    Attributes:
        techniques: One object per technique of the stage, in the registry's order; each is the only writer of its
            settings.
        applied: What was done to which model, for the report.
    """

    def __init__(
        self,
        stage: str,
        found: list[FoundModel],
        config: MemOptConfig,
        skipped: Callable[[str], None],
        exclude: tuple[type[Technique], ...] = (),
        context: StepContext | None = None,
    ) -> None:
        self.found = found
        self.config = config
        self.skipped = skipped
        self.techniques: list[Any] = [t() for t in techniques_for(stage) if t.enabled_by(config) and t not in exclude]
        for technique in self.techniques:
            technique.context = context if context is not None else StepContext()
        self.applied: list[Applied] = []
        self._announced: list[tuple[Technique, Applied]] = []  # said once the settings are chosen (announce)
        self._undo: list[Any] = []  # every change's handle, then the stage's own wrappers, in the order made

    def technique(self, cls: type) -> Any | None:
        """The stage's technique of class ``cls``, or ``None``."""
        return next((t for t in self.techniques if isinstance(t, cls)), None)

    def apply(self, quiet: bool = False) -> None:
        """Apply every technique to every model; unless ``quiet``, what each one reached is said by :meth:`announce`
        once the settings are chosen, and what it skipped is warned about now."""
        self.applied, self._announced = [], []
        for found in self.found:
            reached = False
            for technique in self.techniques:
                try:  # an adapter undoes what it did before it raises: a model is changed fully or not at all
                    change = technique.apply(found, self.config)
                except Exception as error:
                    reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                    self.skipped(f"{technique.name} could not be applied to {found.label} ({reason})")
                    reached = True
                    continue
                if change is None:
                    continue
                self._undo.append(change.handle)
                for part in change.skipped if not quiet else []:
                    rank_zero_warn(f"MemOpt: in {found.label}, {part}.")
                if not change.blocks:  # it reached nothing: only its warnings
                    continue
                reached = reached or not (technique.of_the_step or technique.incidental)
                applied = Applied(found.label, technique.name, change.method, change.blocks, change.unit)
                self.applied.append(applied)
                if not quiet:
                    self._announced.append((technique, applied))
            # a technique of the model's blocks is on
            blocks = any(not (t.of_the_step or t.incidental) for t in self.techniques)
            if not reached and blocks and not found.skip and not quiet:  # a container of library models: nothing
                self.skipped(f"{found.label} has no blocks MemOpt can use for {self.lead}")

    def announce(self) -> list[str]:
        """What each technique does to each model, once its settings are chosen (once: later calls give nothing). A
        technique whose planner left every unit as it was is said to be unused, with its settings."""
        lines = []
        for technique, a in self._announced:
            if technique.changed:
                count = f"{a.blocks} {a.unit}{'s' if a.blocks != 1 else ''}"
                lines.append(f"MemOpt: {a.technique} on {a.model} via {a.method} ({count}).")
            else:
                described = technique.describe()
                lines.append(f"MemOpt: {a.technique} not used on {a.model}" + (f": {described}." if described else "."))
        self._announced = []
        return lines

    @property
    def lead(self) -> str:
        """The stage's first technique, which names what a model without anything to change misses."""
        return next((t.name for t in self.techniques if not (t.of_the_step or t.incidental)), "nothing")

    @property
    def changed(self) -> bool:
        """Whether any unit of any technique is in force."""
        return any(t.changed for t in self.techniques)

    @property
    def nothing(self) -> bool:
        """Whether no technique found anything to change."""
        return not self.applied

    def remove(self) -> None:
        """Undo everything, in the reverse of the order it was done (the stage's wrappers first, then each model's
        changes, the last applied first), and every part even when one raises (the first error is raised after);
        then each technique forgets its units."""
        try:
            remove_all(self._undo)
        finally:
            remove_all(list(self.techniques))

    def add_handle(self, handle: object) -> None:
        """Undo ``handle`` with the rest, before them (a wrapper MemOpt added for this stage)."""
        self._undo.append(handle)

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """The models as the user gave them for a while: every unit of every technique switched off, then back with
        its settings."""
        with contextlib.ExitStack() as stack:
            for technique in self.techniques:
                stack.enter_context(technique.off())
            yield

    def step_context(self, context: StepContext) -> StepContext:
        """``context`` with the optimizer step as the techniques in force have it (each may replace how a dry run steps
        the optimizers, what it enters around the backward pass, whether the last step's gradients are alive when
        it starts, and what it enters once the optimizers' twins are made, on top of the ones before it)."""
        step, backward, kept, twins = context.optimizer_step, context.backward, context.gradients_kept, context.twins
        for technique in self.techniques:
            step = technique.optimizer_step(step) or step
            backward = technique.around_backward(backward) or backward
            kept = technique.gradients_kept(kept) or kept
            twins = technique.around_twins(twins) or twins
        return dataclasses.replace(context, optimizer_step=step, backward=backward, gradients_kept=kept, twins=twins)

    def describe(self) -> str | None:
        """What the techniques have in force, in one line (``None``: nothing)."""
        return "; ".join(s for t in self.techniques if (s := t.summary()) is not None) or None

    def state(self) -> dict[str, Any]:
        """Every technique's settings in force, by name, as plain values."""
        return {t.name: t.state() for t in self.techniques}

    def load(self, state: dict[str, Any]) -> bool:
        """Put saved settings in force, each technique its own; ``False`` where one does not fit (choose again)."""
        return all(t.load(state.get(t.name, {})) for t in self.techniques)
