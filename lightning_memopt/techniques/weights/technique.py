"""The weight-storage technique's plug-in: which layers' weights are kept in 8 bits (:mod:`.core`), chosen under the
stage's budget, where results may change (``lossy=True``)."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any
from weakref import WeakKeyDictionary

from lightning_memopt.compat import strategy_refuses
from lightning_memopt.handles import HandleGroup
from lightning_memopt.techniques.base import Change, OfTheStep, Plan, Planning, Section, saving
from lightning_memopt.techniques.lossy import Difference
from lightning_memopt.techniques.weights.core import Host, StoredWeight, storable
from lightning_memopt.timing import speed

#: The layers stored by any stage now (a fit's, seen by the validation loop inside it): each is stored once.
STORED: WeakKeyDictionary[Any, StoredWeight] = WeakKeyDictionary()


class Weights8bit(OfTheStep):
    """Keeps the weights of linear and convolution layers in 8 bits, each computed in its own type one layer at a time
    (:class:`~lightning_memopt.techniques.weights.core.StoredWeight`), where results may change: only with
    ``lossy=True``. Parameters an optimizer trains keep their type (at fit, every trainable one), and so do norms,
    embeddings, LoRA adapters, a model's first and last projections and layers under 4,096 weights.

    With ``weights_8bit="auto"`` it is a knob of the whole step for the stage's planner, whose settings are how many
    layers are stored, the largest first: the planner stores the fewest that bring the peak under the budget, where no
    mix that keeps results is predicted faster; ``True`` stores every layer it can from the start. Without
    ``lossy=True``, a budget only it would meet is missed, and the warning says what it would reach. The originals are
    kept off the device (host memory, or on CPU a temporary file) and put back exactly when the stage ends; a state dict
    taken meanwhile holds them."""

    name, stages, option = "weights_8bit", ("fit", "predict", "validate", "test"), "weights_8bit"
    reports = ("weights_8bit_saved_bytes", "weights_8bit_difference")
    lossy = True

    def __init__(self) -> None:
        self.units: list[StoredWeight] = []
        self._host = Host()
        self._auto, self._lossy = True, False
        self._saved: int | None = None
        self._said: list[str] = []
        self._difference = Difference(
            "weights_8bit_difference", "a stored weight from its original", "that weight's largest value"
        )

    @classmethod
    def enabled_by(cls, config: Any) -> bool:
        """On where it may store anything: ``weights_8bit=True``, or ``"auto"`` under a budget; never under
        ``verify``."""
        auto = config.weights_8bit == "auto" and config.memory_budget is not None
        return bool(config.enabled) and not config.verify and (config.weights_8bit in (True, "nf4") or auto)

    @classmethod
    def uses_budget(cls, config: Any) -> bool:
        return config.weights_8bit == "auto"

    @classmethod
    def refuses(cls, context: Any) -> str | None:
        return strategy_refuses(cls.name, context.strategy)

    @classmethod
    def may_act(cls, config: Any) -> bool:
        return config.weights_8bit in (True, "nf4") or (
            config.weights_8bit == "auto" and config.lossy and config.memory_budget is not None
        )

    def apply(self, found: Any, config: Any) -> Change | None:
        self._auto, self._lossy = config.weights_8bit == "auto", config.lossy
        if importlib.util.find_spec("bitsandbytes") is None:
            if not self._auto or self._lossy:
                why = (
                    "the weights stay as they are: storing them in 8 bits needs bitsandbytes (pip install bitsandbytes)"
                )
                return Change("", 0, HandleGroup(), skipped=[why])
            return None
        trainable = not self.context.optimizers  # a loop without a fit: no parameter is trained
        kept = {id(m) for s in found.skip for m in s.modules()}  # library models found on their own
        output = getattr(found.module, "get_output_embeddings", lambda: None)()  # a language model's head
        kept |= {id(output)} | _sharing(found.module)
        units = [
            StoredWeight(f"{found.name}.{name}", module)
            for name, module in found.module.named_modules()
            if id(module) not in kept and module not in STORED and storable(name, module, trainable) is None
        ]
        if not units:
            return None
        for unit in units:
            STORED[unit.module] = unit
        self.units += units
        if config.weights_8bit in (True, "nf4"):  # every layer, in 8 bits or in 4
            self.put(len(self.units) * (2 if config.weights_8bit == "nf4" else 1))
        bits = {True: "8 bits", "nf4": "4 bits (NF4)"}.get(config.weights_8bit, "8 or 4 bits")
        what = f"weights kept in {bits}, computed in their own type one layer at a time"
        return Change(what, len(units), _Restore(units), unit="layer")

    def remove(self) -> None:
        for unit in self.units:
            STORED.pop(unit.module, None)
        self.units = []
        self._host.close()

    @property
    def stored(self) -> list[StoredWeight]:
        return [u for u in self.units if u.stored]

    @property
    def changed(self) -> bool:
        return any(u.stored and u.on for u in self.units)

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """Every stored layer as given, for dry runs: its weight on the meta device (see
        :meth:`~lightning_memopt.techniques.weights.core.StoredWeight.switch`)."""
        was = [(u, u.on) for u in self.stored]
        for unit, _ in was:
            unit.switch(False)
        try:
            yield
        finally:
            for unit, on in was:
                unit.switch(on)

    def describe(self) -> str | None:
        stored = self.stored
        if not self.units:
            return None
        saved = sum(u.saving_at(u.bits) for u in stored)
        return f"{len(stored)} of {len(self.units)} layers' weights in {self._in_bits()} ({saved} B saved)"

    def _in_bits(self) -> str:
        stored = self.stored
        small = sum(u.bits == 4 for u in stored)
        if small == 0:
            return "8 bits"
        return "4 bits (NF4)" if small == len(stored) else f"8 bits or, the {small} largest, in 4 bits (NF4)"

    def summary(self) -> str | None:
        return f"weights of {len(self.stored)} layers in {self._in_bits()}" if self.changed else None

    def state(self) -> dict[str, Any]:
        return {"stored": [u.name for u in self.stored], "nf4": [u.name for u in self.stored if u.bits == 4]}

    def load(self, state: dict[str, Any]) -> bool:
        names, small = set(state.get("stored", ())), set(state.get("nf4", ()))
        if self._auto and self._lossy:
            for unit in self.units:
                if unit.name in names and not unit.stored:
                    unit.store(self._host, 4 if unit.name in small else 8)
        return True

    # its knob: how many layers are stored, the largest first -----------------------------------------------------

    @property
    def ready(self) -> bool:
        return bool(self.units)

    def _largest(self) -> list[StoredWeight]:
        return sorted(self.units, key=lambda u: -u.saving)

    def settings(self) -> tuple[int, ...]:
        """0 to n: that many layers stored in 8 bits, the largest first; n + 1 to 2n: every layer stored, that many
        less n of them (the largest first) in 4 bits (NF4)."""
        return tuple(range(2 * len(self.units) + 1))

    def _bits(self, setting: int) -> list[tuple[StoredWeight, int | None]]:
        """Each layer, the largest first, and the bits ``setting`` stores it in (``None``: kept as given)."""
        n = len(self.units)
        return [(u, 4 if p < setting - n else 8 if p < setting else None) for p, u in enumerate(self._largest())]

    def setting(self) -> int:
        return len(self.stored) + sum(u.bits == 4 for u in self.stored)

    def put(self, setting: Any) -> None:
        """Store the layers as ``setting`` says and put the others back (at once: the dry runs read the layers)."""
        for unit, bits in self._bits(setting):
            if unit.stored and unit.bits != bits:
                unit.restore()
            if bits is not None and not unit.stored:
                unit.store(self._host, bits)

    def estimate(self, setting: Any) -> tuple[int, float]:
        """What ``setting`` saves (the stored layers' bytes, less the largest one's copy in its type, alive during its
        call) and adds (each weight put back in its type once a call, twice at fit)."""
        chosen = [(u, bits) for u, bits in self._bits(setting) if bits is not None]
        if not chosen:
            return 0, 0.0
        calls = 1 if not self.context.optimizers else 2
        per_byte = speed(chosen[0][0].module.weight.device).byte_s
        return (
            sum(u.saving_at(bits) for u, bits in chosen) - max(u.copy_bytes for u, _ in chosen),
            calls * per_byte * sum(2 * u.copy_bytes for u, _ in chosen),
        )

    def plan(self, planning: Planning) -> Plan | None:
        said = []
        reach = self.would_reach(planning)
        if reach is not None:
            eight = reach[0] - self.estimate(len(self.units))[0]
            said.append(
                f"memory_budget={planning.budget} B is missed ({reach[0]} B); keeping the weights of "
                f"{len(self.units)} layers in 8 bits would reach at most {eight} B, in 4 bits (NF4) {reach[1]} B, but "
                "changes results: pass lossy=True to allow it"
            )
        self._saved = saving(self, planning) if planning.measure else None
        if self.changed:  # the difference is measured as each layer is stored
            kept = f"the weights of {len(self.stored)} layers are kept in {self._in_bits()}"
            said += [line for line in [self._difference.warning(kept, self.difference)] if line is not None]
        return Plan(warnings=[f"{line}." for line in said]) if said else None

    @property
    def difference(self) -> float | None:
        found = [u.difference for u in self.stored if u.difference is not None]
        return max(found) if found else None

    def section(self) -> Section:
        difference = self.difference
        return Section(
            settings={"weights_8bit": self.describe()},
            metrics={"weights_8bit_saved_bytes": self._saved, **self._difference.metrics(difference)},
            lines=self._difference.lines(difference) if self.changed else [],
        )


def _sharing(model: Any) -> set[int]:
    """The ids of the modules whose weight another module holds too (tied embeddings): they keep it."""
    holders: dict[int, list[int]] = {}
    for _, module in model.named_modules(remove_duplicate=False):  # modules() has no such argument in torch 2.9
        weight = module._parameters.get("weight")
        if weight is not None:
            holders.setdefault(id(weight), []).append(id(module))
    return {m for held in holders.values() if len(set(held)) > 1 for m in held}


class _Restore:
    """Puts one model's stored layers back, the last stored first."""

    def __init__(self, units: list[StoredWeight]) -> None:
        self.units = units

    def remove(self) -> None:
        HandleGroup(reversed(self.units)).remove()
