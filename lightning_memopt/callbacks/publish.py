"""Sending a report out: the figures gathered over ranks through the strategy, logged to every logger, and the summary
printed once."""

from __future__ import annotations

import importlib.util
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn

from lightning_memopt.engine.report import COLUMNS, WHOLE_STEP, MemOptReport
from lightning_memopt.memory import KINDS
from lightning_memopt.units import fmt_sizes

#: A measured batch's figures, and how each is combined over ranks (the step's time less the mean time the changes
#: added is the mean of each rank's time without them).
OVER_RANKS = {"peak_bytes": "max", "baseline_peak_bytes": "max", "step_time_s": "mean", "added_s": "mean"}
#: What held each peak, by kind: the figures of the rank whose peak the job's is (the lowest such rank).
HELD = {"peak_bytes": "peak_by_kind", "baseline_peak_bytes": "baseline_by_kind"}


def aggregate(strategy: Any, report: MemOptReport, device: torch.device) -> None:
    """Make the figures describe the whole job, through the strategy (``strategy.reduce``): the maximum peak and what
    held it on the rank that reached it, the mean times, the longest dry runs and tuning. Unknown figures stay unknown
    if any rank did not know them.

    Every rank must call this, in the same order (five collectives; none on one process).
    """
    figures = report.figures
    mine = {name: getattr(figures, name) for name in HELD}
    where = [(figures, name, op) for name, op in OVER_RANKS.items()]
    where += [(figures, "dry_run_s", "max"), (report, "tuning_s", "max")]
    values = [getattr(holder, name) for holder, name, _ in where]

    def reduce(numbers: list[float], op: str) -> list[float]:
        tensor = torch.tensor(numbers, dtype=torch.float64, device=device)
        return strategy.reduce(tensor, reduce_op=op).tolist()

    known = reduce([float(v is not None) for v in values], "min")
    combined = {op: reduce([float(v or 0.0) for v in values], op) for op in ("max", "mean")}
    for index, (holder, name, op) in enumerate(where):
        value = combined[op][index] if known[index] else None
        setattr(holder, name, int(value) if value is not None and name.endswith("bytes") else value)
    _held_where_reached(reduce, figures, mine)


def _held_where_reached(reduce: Any, figures: Any, mine: dict[str, int | None]) -> None:
    """What held each peak of the job, by kind: the figures of the lowest rank whose own peak (``mine``) is the job's
    (two collectives). Empty where no rank knows it."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    reached = [
        mine[n] is not None and mine[n] == getattr(figures, n) and bool(getattr(figures, h)) for n, h in HELD.items()
    ]
    owners = reduce([float(rank if here else world) for here in reached], "min")
    vector = [
        float(getattr(figures, held).get(kind, 0) if rank == owner else 0)
        for held, owner in zip(HELD.values(), owners, strict=True)
        for kind in KINDS
    ]
    totals = reduce(vector, "sum")
    for index, (held, owner) in enumerate(zip(HELD.values(), owners, strict=True)):
        values = totals[index * len(KINDS) : (index + 1) * len(KINDS)]
        setattr(figures, held, {k: int(v) for k, v in zip(KINDS, values, strict=True)} if owner < world else {})


def publish(trainer: pl.Trainer, report: MemOptReport, device: torch.device, budget: int | None, how: str) -> None:
    """Gather the figures over ranks, send them to the loggers, and warn if the measured peak is over the budget
    (``how``: what MemOpt had in force, for the warning)."""
    if trainer.world_size > 1:  # one process has nothing to combine (and allocates nothing for it)
        aggregate(trainer.strategy, report, device)
    log_report(trainer, report)
    peak = report.peak_bytes
    if budget is not None and peak is not None and peak > budget:
        peaked, allowed = fmt_sizes(peak, budget)
        rank_zero_warn(
            f"MemOpt: the measured {report.stage} step peaked at {peaked}, over the budget of {allowed} ({how})."
        )


def log_report(trainer: pl.Trainer, report: MemOptReport) -> None:
    """Send the figures and settings to every logger, from rank zero."""
    if not trainer.is_global_zero:
        return
    metrics = report.metrics()
    for logger in trainer.loggers:
        logger.log_hyperparams(report.settings())
        if metrics:
            logger.log_metrics(metrics, step=trainer.global_step)
        logger.save()


def log_metrics(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """Send figures a rank knows alone (a step timed after the measured one) to every logger, from rank zero."""
    if not trainer.is_global_zero or not metrics:
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


@rank_zero_only
def print_report(report: MemOptReport) -> None:
    """Print the summary once, as a rich table where rich is installed and as plain text otherwise."""
    if importlib.util.find_spec("rich") is None:
        rank_zero_info(str(report))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"MemOpt {report.stage} summary ({report.title()})")
    for column in COLUMNS:
        table.add_column(column, justify="right" if column.startswith(("peak", "saved", "time")) else "left")
    for row in report.rows():
        if row[0] == WHOLE_STEP and table.row_count:
            table.add_section()  # the figures of the whole step, below what each technique does
        table.add_row(*row)
    console = Console()
    if not console.is_terminal:  # logs and notebooks: no need to squeeze the table into 80 columns
        console = Console(width=160)
    console.print(table)
    for note in report.notes:
        console.print(f"note: {note}")
