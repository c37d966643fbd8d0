"""LightningCLI support: top-level ``--memopt.*`` flags in one line.

MemOpt needs nothing special to be used from a LightningCLI script: ``--trainer.callbacks+=lightning_memopt.MemOpt``
and ``--trainer.callbacks.memory_budget=2GiB`` work, and so does a YAML config with ``class_path`` and ``init_args``.
This module adds the other way: MemOpt as a forced callback with its own ``--memopt.*`` flags, switched with
``--memopt.enabled``.

Example:
    >>> from lightning.pytorch.cli import LightningCLI
    >>> class MyCLI(LightningCLI):
    ...     def add_arguments_to_parser(self, parser):
    ...         add_memopt_arguments(parser)
"""

from __future__ import annotations

from typing import Any

from lightning_memopt.callbacks.memopt import MemOpt


def add_memopt_arguments(parser: Any, name: str = "memopt") -> None:
    """Add MemOpt to a LightningCLI parser as a forced callback with its own ``--<name>.*`` flags.

    Every argument of :class:`~lightning_memopt.MemOpt` becomes a flag (``--memopt.memory_budget=12GiB``,
    ``--memopt.chunk_size=4``) and a ``memopt:`` section of the YAML config; ``--memopt.enabled=false`` switches it off.

    Args:
        parser: The ``LightningArgumentParser`` given to ``LightningCLI.add_arguments_to_parser``.
        name: The flags' prefix.
    """
    parser.add_lightning_class_args(MemOpt, name)
