"""LightningCLI support: top-level ``--memopt.*`` flags in one line, and the ``lightning-memopt estimate`` command.

MemOpt needs nothing special to be used from a LightningCLI script: ``--trainer.callbacks+=lightning_memopt.MemOpt``
and ``--trainer.callbacks.memory_budget=2GiB`` work, and so does a YAML config with ``class_path`` and ``init_args``.
This module adds the other way: MemOpt as a forced callback with its own ``--memopt.*`` flags, switched with
``--memopt.enabled``.

It also holds the ``lightning-memopt`` command. ``lightning-memopt estimate`` reads the same YAML config as a
LightningCLI script (``model:``, ``data:``, ``trainer:``; a MemOpt in ``trainer.callbacks`` gives its arguments) and
prints the peak memory of one step with and without MemOpt, from dry runs on fake tensors, building the model on the
meta device so that nothing of its size is allocated:

    lightning-memopt estimate --config config.yaml --stage predict --memopt.memory_budget 24GiB

Examples:
    >>> from lightning.pytorch.cli import LightningCLI
    >>> class MyCLI(LightningCLI):
    ...     def add_arguments_to_parser(self, parser):
    ...         add_memopt_arguments(parser)
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import MISSING, fields
from typing import Any, Literal, get_type_hints

import torch

from lightning_memopt import MemOpt
from lightning_memopt.engine.config import OPTION_HELP, MemOptConfig


def add_memopt_arguments(parser: Any, name: str = "memopt") -> None:
    """Add MemOpt to a LightningCLI parser as a forced callback with its own ``--<name>.*`` flags.

    Every argument of :class:`~lightning_memopt.MemOpt` becomes a flag (``--memopt.memory_budget=12GiB``,
    ``--memopt.chunk_size=4``) and a ``memopt:`` section of the YAML config; ``--memopt.enabled=false`` switches it off.

    Args:
        parser: The ``LightningArgumentParser`` given to ``LightningCLI.add_arguments_to_parser``.
        name: The flags' prefix.
    """
    parser.add_lightning_class_args(MemOpt, name)


#: The MemOpt arguments about runs (measuring, verifying, switching off), which an estimate has no use for.
RUN_ONLY = ("strict", "measure", "verify", "verify_tolerance", "enabled")
#: The MemOpt arguments that matter to an estimate: every other option.
ESTIMATE_ARGUMENTS = tuple(name for name in MemOptConfig.names() if name not in RUN_ONLY)


def estimate_parser() -> Any:
    """The parser of ``lightning-memopt estimate``: a LightningCLI-style config plus the estimate's own flags."""
    from jsonargparse import ActionConfigFile
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningArgumentParser

    parser = LightningArgumentParser(
        prog="lightning-memopt estimate",
        description="The peak memory of one training or predict step, with and without MemOpt, from dry runs on fake"
        " tensors: nothing of the model's size is allocated and nothing is computed.",
    )
    parser.add_argument("--config", action=ActionConfigFile, help="a LightningCLI YAML config (model, data, trainer)")
    parser.add_subclass_arguments(LightningModule, "model", help="the LightningModule (class_path and init_args)")
    parser.add_subclass_arguments(LightningDataModule, "data", required=False, help="the LightningDataModule, if any")
    parser.add_argument(
        "--trainer", type=dict, default={}, help="the trainer section: precision and callbacks are read"
    )
    parser.add_argument("--seed_everything", type=Any, default=None, help="ignored (read by LightningCLI)")
    parser.add_argument("--ckpt_path", type=Any, default=None, help="ignored (read by LightningCLI)")
    stages = Literal["fit", "predict", "validate", "test"]  # a type, not choices: the help shows it, not a lambda
    parser.add_argument("--stage", type=stages, default="fit", help="the step to estimate")
    parser.add_argument("--device", type=str, default="cpu", help="the device the figures are for")
    parser.add_argument(
        "--meta", type=bool, default=True, help="build the model on the meta device: no memory for its weights"
    )
    parser.add_argument("--json", type=bool, default=False, help="print the figures as JSON")
    _add_memopt_flags(parser)
    return parser


def _add_memopt_flags(parser: Any) -> None:
    """The ``--memopt.*`` flags of ``lightning-memopt estimate``, one per name in ``ESTIMATE_ARGUMENTS``: each takes
    its type from :class:`~lightning_memopt.engine.config.MemOptConfig`'s field and its help from ``OPTION_HELP``, both
    in the config module. Each defaults to ``None``: unset, so that a MemOpt in the config's ``trainer.callbacks``, or
    else MemOpt's own default, gives the value.

    Examples:
        >>> from jsonargparse import ArgumentParser
        >>> parser = ArgumentParser()
        >>> _add_memopt_flags(parser)
        >>> flags = parser.parse_args(["--memopt.checkpointing", "auto", "--memopt.chunk_size", "4"]).memopt
        >>> flags.checkpointing, flags.chunk_size, flags.memory_budget
        ('auto', 4, None)
    """
    types = get_type_hints(MemOptConfig)
    defaults = {f.name: f.default for f in fields(MemOptConfig) if f.default is not MISSING}
    for argument in ESTIMATE_ARGUMENTS:
        unset = f"Unset: as a MemOpt in trainer.callbacks has it, else MemOpt's default, {defaults[argument]!r}."
        help_text = f"{OPTION_HELP[argument]} {unset}"
        parser.add_argument(f"--memopt.{argument}", type=types[argument] | None, default=None, help=help_text)


def _memopt_arguments(cfg: Any) -> dict[str, Any]:
    """MemOpt's arguments: those of a MemOpt in ``trainer.callbacks``, overridden by ``--memopt.*`` flags."""
    found: dict[str, Any] = {}
    callbacks = (cfg.trainer or {}).get("callbacks") or []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        if isinstance(callback, dict) and str(callback.get("class_path", "")).endswith("MemOpt"):
            found.update({k: v for k, v in (callback.get("init_args") or {}).items() if k in ESTIMATE_ARGUMENTS})
    flags = cfg.memopt or {}
    found.update({k: v for k, v in dict(flags).items() if v is not None})
    return found


def _first_batch(model: Any, data: Any, stage: str) -> Any:
    hooks = {"fit": "train_dataloader", "predict": "predict_dataloader", "validate": "val_dataloader"}
    hook = hooks.get(stage, "test_dataloader")
    source = data if data is not None else model
    if data is not None and hasattr(data, "setup"):
        data.setup(stage)
    if not callable(getattr(source, hook, None)):
        raise ValueError(f"`{type(source).__name__}` has no `{hook}` to take a batch from")
    return next(iter(getattr(source, hook)()))


def run_estimate(argv: list[str]) -> int:
    parser = estimate_parser()
    cfg = parser.parse_args(argv)
    memopt = _memopt_arguments(cfg)
    precision = str((cfg.trainer or {}).get("precision", "32-true"))
    with torch.device("meta") if cfg.meta else contextlib.nullcontext():
        instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # jsonargparse 4.49 renamed it
        init = instantiate(cfg)
    batch = _first_batch(init.model, init.get("data"), cfg.stage)
    from lightning_memopt.estimate import estimate

    try:
        result = estimate(init.model, batch, cfg.stage, device=cfg.device, precision=precision, **memopt)
    except ValueError as error:  # a bad --memopt.* value or config entry: say it, as for any other bad flag
        print(f"lightning-memopt estimate: {error}", file=sys.stderr)
        return 2
    if cfg.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(result)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``lightning-memopt`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    sys.path.insert(0, os.getcwd())  # class paths in configs name modules next to them, as with LightningCLI scripts
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: lightning-memopt estimate [--config CONFIG] [options]   (lightning-memopt estimate --help)")
        return 0 if argv else 2
    if argv[0] != "estimate":
        print(f"lightning-memopt: unknown command {argv[0]!r}; the command is `estimate`", file=sys.stderr)
        return 2
    return run_estimate(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
