"""What MemOpt did and what it saved: the report kept on the callback, printed as a summary and sent to loggers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_memopt.techniques import REGISTRY
from lightning_memopt.techniques.base import Applied, Section
from lightning_memopt.units import fmt_bytes, fmt_parts, percent

#: The first cell of the summary's row of figures for the whole step.
WHOLE_STEP = "whole step"

#: The summary's columns: each peak says where it comes from (the baseline from a dry run of the step as given, the
#: peak with the changes from the measured batch's real step).
COLUMNS = (
    "model",
    "technique",
    "how",
    "peak without (dry run)",
    "peak with (real step)",
    "saved",
    "saved %",
    "time +%",
)


@dataclass
class Figures:
    """What one measured batch gave, written by its measurement only (:class:`~lightning_memopt.engine.measure.
    Measurement`) and embedded in the report. ``None`` means unknown.

    Attributes:
        batch_idx: The batch measured.
        peak_bytes: The real step's peak with MemOpt's changes.
        step_time_s: The real step's time.
        baseline_peak_bytes: The step's peak without the changes, from a dry run (``None``: no dry run could trace it).
        added_s: The time the changes added to the step: recomputation at fit, chunked blocks and sliced decodes in
            a loop (timed alone when it ends); ``0.0`` where nothing was changed.
        dry_run_s: The time the dry runs for the baseline took.
        notes: What limited the figures.
        verified: What ``verify`` compared and found equal, in words (``None``: it compared nothing).
        verify_max_rel_diff: The largest relative difference ``verify`` found among what it compared.
        peak_by_kind: What held the real step's peak, by kind (:data:`~lightning_memopt.memory.KINDS`), where the
            probe counts it (on CPU; empty on an accelerator, whose allocator counts bytes, not what they are).
        baseline_by_kind: What held the baseline's peak, by kind, from its dry run.
    """

    batch_idx: int | None = None
    peak_bytes: int | None = None
    step_time_s: float | None = None
    baseline_peak_bytes: int | None = None
    added_s: float | None = None
    dry_run_s: float | None = None
    notes: list[str] = field(default_factory=list)
    verified: str | None = None
    verify_max_rel_diff: float | None = None
    peak_by_kind: dict[str, int] = field(default_factory=dict)
    baseline_by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def baseline_step_time_s(self) -> float | None:
        """The step's time without the changes: its time less what they added."""
        if self.step_time_s is None or self.added_s is None:
            return None
        return self.step_time_s - self.added_s


def _figure(name: str) -> Any:
    """A read-only attribute of the report that is its figures' ``name``."""
    return property(lambda report: getattr(report.figures, name), doc=f"The measured batch's ``{name}``.")


@dataclass
class MemOptReport:
    """The techniques MemOpt applied in one fit, predict, validation or test run, and the figures of its measured
    batch. Each technique writes its own section (``sections``, by name): what it has in force (``checkpointed``,
    ``chunk_settings``, ``decoding``) and its figures (``recompute_flops``, ``tiling_max_abs_diff``), read as attributes
    of the report too. Where a planner found it, the report also says which part of the model holds the peak with
    MemOpt's changes (``peak_part``) and without them (``baseline_part``), and the weights' bytes.

    The peaks are for the whole step (every model in the LightningModule together), on one batch: the baseline from
    a dry run of the step on fake tensors without MemOpt's changes (exact on CPU; on an accelerator an estimate
    without the allocator's overhead), and the peak with them from the real step. The baseline time at fit is the
    real step's time less the time its checkpointed blocks spent recomputing; in a loop, less what its chunked blocks
    and sliced decodes cost over plain ones, each kind timed alone when the loop ends. Under DDP the peaks are the
    maximum over ranks and the times the mean. ``None`` means unknown: not measured, or the dry run could not trace the
    step (a note says why); then no saving is claimed.

    Examples:
        >>> report = MemOptReport("fit", "cpu", Figures(peak_bytes=600, baseline_peak_bytes=1000))
        >>> report.saved_bytes, report.saved_fraction
        (400, 0.4)
        >>> report.metrics()
        {'memopt/peak_bytes': 600.0, 'memopt/baseline_peak_bytes': 1000.0, 'memopt/saved_bytes': 400.0, \
'memopt/saved_fraction': 0.4, 'memopt/baseline_exact': 1.0}
    """

    stage: str
    device: str
    figures: Figures = field(default_factory=Figures)
    #: Everything set up on each model, in force or not (a technique its planner left off for every unit is set up
    #: but not applied).
    set_up: list[Applied] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    budget_bytes: int | None = None
    tuning_s: float | None = None
    peak_part: str | None = None
    baseline_part: str | None = None
    weights_bytes: int | None = None
    sections: dict[str, Section] = field(default_factory=dict)
    predicted_step_s: float | None = None
    calibration_s: float | None = None
    real_step_s: float | None = None
    #: Whether the predicted step time chose among several settings that met the target (the time note's subject).
    time_ranked: bool = False
    #: The techniques with something in force when the sections were last written.
    in_force: list[str] = field(default_factory=list)
    #: The step's peak with the settings in force as the dry runs count it (``None``: no dry run counted it).
    planned_peak_bytes: int | None = None
    #: The most a real step took beyond its dry run's prediction (scratch a fake tensor never holds, such as a kernel's
    #: workspace), over the batches set against one; ``None``: none was.
    unseen_bytes: int | None = None
    #: Where the step that took more than its dry run reached its peak: ``"the forward pass"``, ``"the backward
    #: pass"`` or ``"the optimizer step"`` at fit; ``None`` in a loop, or where no step took more.
    unseen_where: str | None = None

    def __getattr__(self, name: str) -> Any:
        """A technique's setting or figure, by its key in its section (``None`` where the technique has none here,
        as for a figure unknown)."""
        if name.startswith("_") or "sections" not in self.__dict__:
            raise AttributeError(name)
        for section in self.__dict__["sections"].values():
            for values in (section.settings, section.metrics, section.figures):
                if name in values:
                    return values[name]
        if any(name in technique.reports for technique in REGISTRY):
            return None
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def embed(self, figures: Figures) -> None:
        """The measured batch's figures become the report's, with their notes."""
        self.figures = figures
        self.note(*figures.notes)
        saved = self.saved_bytes
        if saved is not None and saved < 0:
            self.note(
                f"the step peaked {fmt_bytes(-saved)} higher with MemOpt's changes than the same step without them:"
                " here they cost memory instead of saving it"
            )

    def timed(self, seconds: float) -> dict[str, float]:
        """The time of a step after the measured one (no probe slows it), against the time model's prediction (the
        device's speeds are kept however far apart they are: measuring them again would cost each run its time and
        predict no better; a note says where the prediction was off). Returns the figures to log."""
        self.real_step_s = seconds
        figures = {"real_step_s": seconds, "prediction_error": self.prediction_error}
        return {f"{self.prefix}{k}": float(v) for k, v in figures.items() if v is not None}

    def note(self, *notes: str | None) -> list[str]:
        """Add each note not there yet (and not empty); returns those added, to say them once."""
        added = [n for n in dict.fromkeys(notes) if n and n not in self.notes]
        self.notes += added
        return added

    # the measured batch's figures, read through the report
    peak_bytes = _figure("peak_bytes")
    baseline_peak_bytes = _figure("baseline_peak_bytes")
    step_time_s = _figure("step_time_s")
    baseline_step_time_s = _figure("baseline_step_time_s")
    batch_idx = _figure("batch_idx")
    dry_run_s = _figure("dry_run_s")

    @property
    def baseline_exact(self) -> bool:
        """Whether the baseline is exact (a dry run counted on CPU) rather than an estimate (on an accelerator)."""
        return self.device.startswith("cpu")

    @property
    def saved_bytes(self) -> int | None:
        if self.peak_bytes is None or self.baseline_peak_bytes is None:
            return None
        return self.baseline_peak_bytes - self.peak_bytes

    @property
    def saved_fraction(self) -> float | None:
        saved = self.saved_bytes
        return None if saved is None or not self.baseline_peak_bytes else saved / self.baseline_peak_bytes

    @property
    def prediction_error(self) -> float | None:
        """The time model's predicted step time over a real one's (:meth:`timed`), less 1 (``0.1``: predicted 10%
        slower)."""
        if self.predicted_step_s is None or not self.real_step_s:
            return None
        return self.predicted_step_s / self.real_step_s - 1

    @property
    def time_overhead(self) -> float | None:
        """The fraction of extra step time: 0.25 means the step took 25% longer with MemOpt's changes."""
        if self.step_time_s is None or not self.baseline_step_time_s:
            return None
        return self.step_time_s / self.baseline_step_time_s - 1

    def metrics(self) -> dict[str, float]:
        """The known figures under their ``memopt/`` keys (see :attr:`prefix`)."""
        values = {
            "peak_bytes": self.peak_bytes,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "saved_bytes": self.saved_bytes,
            "saved_fraction": self.saved_fraction,
            "step_time_s": self.step_time_s,
            "baseline_step_time_s": self.baseline_step_time_s,
            "time_overhead": self.time_overhead,
            "budget_bytes": self.budget_bytes,
            "tuning_s": self.tuning_s,
            "dry_run_s": self.dry_run_s,
            "predicted_step_s": self.predicted_step_s,
            "real_step_s": self.real_step_s,
            "prediction_error": self.prediction_error,
            "calibration_s": self.calibration_s,
            "planned_peak_bytes": self.planned_peak_bytes,
            "unseen_bytes": self.unseen_bytes,
            "verify_max_rel_diff": self.figures.verify_max_rel_diff,
            "baseline_exact": None if self.baseline_peak_bytes is None else self.baseline_exact,
        }
        values.update({f"peak_{kind}_bytes": n for kind, n in self.figures.peak_by_kind.items()})
        values.update({f"baseline_peak_{kind}_bytes": n for kind, n in self.figures.baseline_by_kind.items()})
        for name, section in self.sections.items():  # a technique set up but not in force has no figures
            values.update(section.metrics if name in self.in_force else {})
        return {f"{self.prefix}{k}": float(v) for k, v in values.items() if v is not None}

    @property
    def prefix(self) -> str:
        """``memopt/`` for the training steps and predict, ``memopt/validate/`` and ``memopt/test/`` for those loops
        (a fit logs its validation loops' figures next to its own)."""
        return "memopt/" if self.stage in ("fit", "predict") else f"memopt/{self.stage}/"

    def settings(self) -> dict[str, Any]:
        """The settings in force, for the loggers' hyperparameters."""
        result: dict[str, Any] = {f"memopt/{self.stage}/device": self.device}
        result[f"memopt/{self.stage}/baseline"] = (
            "unknown: no dry run could trace the step"
            if self.baseline_peak_bytes is None
            else "dry run on fake tensors, exact"
            if self.baseline_exact
            else "dry run on fake tensors, an estimate without the allocator's overhead"
        )
        for name, section in self.sections.items():
            settings = section.settings if name in self.in_force else {}
            result.update({f"memopt/{self.stage}/{k}": v for k, v in settings.items() if v is not None})
        if self.peak_part is not None:
            result[f"memopt/{self.stage}/peak_part"] = self.peak_part
        for a in self.applied:
            name, _, cls = a.model.partition(" ")  # "unet (UNet2DModel)": keys stay plain for every logger
            result[f"memopt/{self.stage}/{a.technique}/{name}"] = f"{cls.strip('()')}: {a.method} ({_count(a)})"
        return result

    @property
    def applied(self) -> list[Applied]:
        """What is in force on each model: the summary's rows and the logged keys (a technique set up but left off
        for every unit by its planner, such as a loss left as the model computes it, is not among them)."""
        return [a for a in self.set_up if a.technique in self.in_force]

    def rows(self) -> list[tuple[str, ...]]:
        """The summary's rows: each technique in force on each model, with its section's lines; then the whole step,
        measured, with what holds its peak and ``verify``'s result; then what was set up but not used."""
        blank = ("", "", "", "", "")
        rows: list[tuple[str, ...]] = []
        applied = self.applied
        for name in dict.fromkeys(a.technique for a in applied):
            rows += [(a.model, name, f"{a.method}, {_count(a)}", *blank) for a in applied if a.technique == name]
            rows += [("", "", line, *blank) for line in self.sections[name].lines] if name in self.sections else []
        figures = (
            fmt_bytes(self.baseline_peak_bytes),
            fmt_bytes(self.peak_bytes),
            fmt_bytes(self.saved_bytes),
            percent(self.saved_fraction),
            percent(self.time_overhead, signed=True),
        )
        rows.append((WHOLE_STEP, "", "", *figures))
        if self.planned_peak_bytes is not None and self.planned_peak_bytes != self.peak_bytes:
            planned = f"the dry run of the settings in force: {fmt_bytes(self.planned_peak_bytes)} at the peak"
            rows.append(("", "", f"{planned} (the real step's is the peak with)", *blank))
        rows += [("", "", line, *blank) for line in (self.time_line(), self.one_off_line()) if line]
        if self.peak_part is not None:
            weights = f"; weights {fmt_bytes(self.weights_bytes)} of it" if self.weights_bytes is not None else ""
            rows.append(("", "", f"peak in: {self.peak_part} (without MemOpt: {self.baseline_part}){weights}", *blank))
        for label, kinds in (("with", self.figures.peak_by_kind), ("without", self.figures.baseline_by_kind)):
            if kinds:
                rows.append(("", "", f"held at the peak {label} MemOpt: {fmt_parts(kinds)}", *blank))
        if self.figures.verified is not None:
            rows.append(("", "", self.figures.verified, *blank))
        unused = [n for n in self.sections if n not in self.in_force]
        rows += [("", "", f"not used: {line}", *blank) for n in unused for line in self.sections[n].lines]
        return rows

    def time_line(self) -> str | None:
        """The step's time as measured, with and without the changes, and the time model's prediction only where it
        chose among settings that met the target, in one line."""
        words = []
        if self.step_time_s is not None:
            without = self.baseline_step_time_s
            words.append(
                f"step time {self.step_time_s:.3g} s"
                + (f", {without:.3g} s without MemOpt's changes (less the time they took, timed)" if without else "")
            )
        if self.predicted_step_s is not None and self.time_ranked:
            real = f"; the next step took {self.real_step_s:.3g} s" if self.real_step_s else ""
            words.append(f"settings chosen as the fastest predicted ({self.predicted_step_s:.3g} s{real})")
        return "; ".join(words) or None

    def one_off_line(self) -> str | None:
        """What MemOpt spent once, outside the steps: choosing the settings (measuring the device's speeds, where it
        did) and the dry run of the measured batch without the changes."""
        parts = []
        if self.calibration_s:
            parts.append(f"measuring the device's speeds {self.calibration_s:.2g} s (kept for later runs)")
        if self.tuning_s:
            parts.append(f"choosing the settings by dry runs {self.tuning_s:.2g} s")
        if self.dry_run_s:
            parts.append(f"the baseline's dry run {self.dry_run_s:.2g} s")
        return f"once: {', '.join(parts)}" if parts else None

    def title(self) -> str:
        measured = "nothing measured" if self.batch_idx is None else f"measured on batch {self.batch_idx}"
        return f"{self.device}, {measured}"

    def __str__(self) -> str:
        table = [COLUMNS, *self.rows()]
        widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
        lines.insert(0, f"MemOpt {self.stage} summary ({self.title()}):")
        if self.budget_bytes is not None:
            lines.append(f"  budget: {fmt_bytes(self.budget_bytes)}")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def _count(applied: Applied) -> str:
    return f"{applied.blocks} {applied.unit}{'s' if applied.blocks != 1 else ''}"
