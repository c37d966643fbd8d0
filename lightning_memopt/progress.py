"""A progress bar for plans that take a while: what is being dry-run, and how many dry runs so far.

A plan (at fit, in a loop, or in :func:`~lightning_memopt.estimate`) opens :func:`planning`; each dry run inside says
what it runs through :func:`dry_run`. Nothing is shown for a plan that ends within :data:`DELAY` seconds; after that,
a bar on standard error (tqdm's, which Lightning brings) counts the dry runs and names the one running. Only the
process of rank 0 shows it.

Examples:
    >>> with planning("fit"):
    ...     dry_run("every block full")  # a quick plan: nothing shown
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from collections.abc import Iterator
from typing import Any

from lightning_memopt.compat import distributed_initialized

#: Seconds a plan runs before its bar is shown.
DELAY = 3.0


class _Plan:
    def __init__(self, title: str) -> None:
        self.title = title
        self.started = time.perf_counter()
        self.runs = 0
        self.bar: Any = None

    def dry_run(self, what: str) -> None:
        self.runs += 1
        if self.bar is None and time.perf_counter() - self.started >= DELAY and _rank_zero():
            from tqdm.auto import tqdm

            wide = None if sys.stderr.isatty() else 160  # a log file has no width of its own
            self.bar = tqdm(desc=f"MemOpt: planning {self.title}", unit=" dry runs", file=sys.stderr, leave=False,
                            ncols=wide)  # fmt: skip
            self.bar.update(self.runs - 1)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(what[:80])  # a dry run takes a while: shown at once

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


_ACTIVE: contextvars.ContextVar[_Plan | None] = contextvars.ContextVar("lightning_memopt_plan", default=None)


@contextlib.contextmanager
def planning(title: str) -> Iterator[None]:
    """A plan runs inside: its dry runs are counted, and shown once it has taken :data:`DELAY` seconds."""
    if _ACTIVE.get() is not None:  # a plan inside a plan (an estimate's stage): the outer one shows it
        yield
        return
    plan = _Plan(title)
    token = _ACTIVE.set(plan)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        plan.close()


def dry_run(what: str) -> None:
    """A dry run of the plan open (if any) starts; ``what`` says what it runs."""
    plan = _ACTIVE.get()
    if plan is not None:
        plan.dry_run(what)


def _rank_zero() -> bool:
    import torch.distributed as dist

    return not distributed_initialized() or dist.get_rank() == 0
