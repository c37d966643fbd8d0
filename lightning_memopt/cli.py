"""LightningCLI support: top-level ``--memopt.*`` flags in one line, and the ``lightning-memopt estimate`` command.

MemOpt needs nothing special to be used from a LightningCLI script: ``--trainer.callbacks+=lightning_memopt.MemOpt``
and ``--trainer.callbacks.checkpointing=auto`` work, and so does a YAML config with ``class_path`` and ``init_args``.
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

import argparse
import contextlib
import importlib
import json
import os
import sys
from dataclasses import MISSING, fields
from typing import Any, Literal, get_type_hints

from lightning_memopt import __version__  # the rest is imported by the commands: --help answers at once


def add_memopt_arguments(parser: Any, name: str = "memopt") -> None:
    """Add MemOpt to a LightningCLI parser as a forced callback with its own ``--<name>.*`` flags.

    Every argument of :class:`~lightning_memopt.MemOpt` becomes a flag (``--memopt.memory_budget=12GiB``,
    ``--memopt.chunk_size=4``) and a ``memopt:`` section of the YAML config; ``--memopt.enabled=false`` switches it off.

    Args:
        parser: The ``LightningArgumentParser`` given to ``LightningCLI.add_arguments_to_parser``.
        name: The flags' prefix.
    """
    from lightning_memopt import MemOpt

    parser.add_lightning_class_args(MemOpt, name)


#: The MemOpt arguments about runs (measuring, verifying, switching off), which an estimate has no use for.
RUN_ONLY = ("strict", "measure", "verify", "verify_tolerance", "enabled")


def estimate_arguments() -> tuple[str, ...]:
    """The MemOpt arguments that matter to an estimate: every option but those of ``RUN_ONLY``."""
    from lightning_memopt.engine.config import MemOptConfig

    return tuple(name for name in MemOptConfig.names() if name not in RUN_ONLY)


#: The commands of ``lightning-memopt``, each with the line ``lightning-memopt --help`` shows for it.
COMMANDS = {
    "estimate": "one step's peak memory with and without MemOpt, from a LightningCLI config",
}


#: The sections of a LightningCLI config that an estimate has no use for: accepted, ignored, and hidden from the help.
IGNORED = ("seed_everything", "optimizer", "lr_scheduler", "ckpt_path", "weights_only")


def option_help() -> dict[str, str]:
    """Each MemOpt argument's help: its description in MemOpt's docstring (``Args``), as LightningCLI shows it too.

    Examples:
        >>> option_help()["verify_tolerance"]
        'The largest relative difference verify accepts.'
    """
    from docstring_parser import parse  # jsonargparse's, which reads the same docstring for LightningCLI

    from lightning_memopt import MemOpt

    return {p.arg_name: " ".join((p.description or "").split()) for p in parse(MemOpt.__doc__ or "").params}


def estimate_parser() -> Any:
    """The parser of ``lightning-memopt estimate``: a LightningCLI-style config plus the estimate's own flags."""
    from jsonargparse import SUPPRESS, ActionConfigFile
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningArgumentParser

    parser = LightningArgumentParser(
        prog="lightning-memopt estimate",
        description="The peak memory of one training or predict step, with and without MemOpt, from dry runs on fake"
        " tensors: nothing of the model's size is allocated and nothing is computed.",
    )
    parser.add_argument(
        "--config",
        action=ActionConfigFile,
        help="a LightningCLI YAML config: its model, data and trainer sections are read; the others it may have"
        f" ({', '.join(IGNORED)}) are accepted and ignored (the optimizer is the model's configure_optimizers')",
    )
    parser.add_subclass_arguments(LightningModule, "model", help="the LightningModule (class_path and init_args)")
    parser.add_subclass_arguments(LightningDataModule, "data", required=False, help="the LightningDataModule, if any")
    parser.groups["model"].title = "The model: the config's model section, or a class path"
    parser.groups["data"].title = "The data: the config's data section, if any (else the model's own dataloaders)"
    parser.add_argument(
        "--trainer",
        type=dict | None,
        default={},
        help="the trainer section: its precision, callbacks, strategy and devices are read (under 'ddp' or a"
        " ModelParallelStrategy, the figures are one rank's of that many)",
    )
    for ignored in IGNORED:  # read by LightningCLI: accepted here, not shown
        parser.add_argument(f"--{ignored}", type=Any, default=None, help=SUPPRESS)
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
    """The ``--memopt.*`` flags of ``lightning-memopt estimate``, one per name of :func:`estimate_arguments`, in a group
    of their own: each takes its type from :class:`~lightning_memopt.engine.config.MemOptConfig`'s field and its help
    from MemOpt's docstring (:func:`option_help`). Each defaults to ``None``: unset, so that a MemOpt in the config's
    ``trainer.callbacks``, or else MemOpt's own default, gives the value.

    Examples:
        >>> from jsonargparse import ArgumentParser
        >>> parser = ArgumentParser()
        >>> _add_memopt_flags(parser)
        >>> flags = parser.parse_args(["--memopt.checkpointing", "auto", "--memopt.chunk_size", "4"]).memopt
        >>> flags.checkpointing, flags.chunk_size, flags.memory_budget
        ('auto', 4, None)
    """
    from lightning_memopt.engine.config import MemOptConfig

    types = get_type_hints(MemOptConfig)
    defaults = {f.name: f.default for f in fields(MemOptConfig) if f.default is not MISSING}
    helps = option_help()
    group = parser.add_argument_group(
        "MemOpt's arguments",
        "Each left unset (null) takes its value from a MemOpt in the config's trainer.callbacks, else MemOpt's default"
        " (given at the end of each help).",
    )
    for argument in estimate_arguments():
        default = "null" if defaults[argument] is None else defaults[argument]
        help_text = f"{helps.get(argument, '')} MemOpt's default: {default}."
        group.add_argument(f"--memopt.{argument}", type=types[argument] | None, default=None, help=help_text)


def _memopt_arguments(cfg: Any) -> dict[str, Any]:
    """MemOpt's arguments: those of a MemOpt in ``trainer.callbacks``, overridden by ``--memopt.*`` flags."""
    found: dict[str, Any] = {}
    names = estimate_arguments()
    callbacks = (cfg.trainer or {}).get("callbacks") or []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        if isinstance(callback, dict) and str(callback.get("class_path", "")).endswith("MemOpt"):
            found.update({k: v for k, v in (callback.get("init_args") or {}).items() if k in names})
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


def _strategy(trainer: dict[str, Any]) -> tuple[Any, int | None]:
    """The trainer section's strategy (a name, or a class path with its init args, instantiated) and its number of
    devices (``None`` where it is not a number: ``"auto"``)."""
    strategy = trainer.get("strategy")
    if isinstance(strategy, dict) and "class_path" in strategy:
        module, _, name = str(strategy["class_path"]).rpartition(".")
        strategy = getattr(importlib.import_module(module), name)(**(strategy.get("init_args") or {}))
    devices = trainer.get("devices")
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    return strategy, devices if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0 else None


def run_estimate(argv: list[str]) -> int:
    import torch

    parser = estimate_parser()
    cfg = parser.parse_args(argv)
    memopt = _memopt_arguments(cfg)
    precision = str((cfg.trainer or {}).get("precision") or "32-true")  # null in a config LightningCLI printed
    with torch.device("meta") if cfg.meta else contextlib.nullcontext():
        instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # jsonargparse 4.49 renamed it
        init = instantiate(cfg)
    batch = _first_batch(init.model, init.get("data"), cfg.stage)
    from lightning_memopt.estimate import estimate

    try:
        strategy, devices = _strategy(cfg.trainer or {})
        if strategy is None or isinstance(strategy, str):  # by name, as the Trainer reads it
            name = strategy or "auto"
            if name.startswith("ddp") or (name == "auto" and (devices or 1) > 1):  # one rank's step: the same in each
                strategy = "ddp"
            elif name in ("auto", "single_device"):
                strategy, devices = None, None
        result = estimate(
            init.model,
            batch,
            cfg.stage,
            device=cfg.device,
            precision=precision,
            strategy=strategy,
            devices=devices,
            **memopt,
        )
    except ValueError as error:  # a bad --memopt.* value or config entry: say it, as for any other bad flag
        print(f"lightning-memopt estimate: {error}", file=sys.stderr)
        return 2
    if cfg.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(result)
    return 0


def main_parser() -> argparse.ArgumentParser:
    """The parser of ``lightning-memopt`` itself, for its ``--help``, ``--version`` and errors: each command has its
    own."""
    parser = argparse.ArgumentParser(
        prog="lightning-memopt",
        usage="lightning-memopt [-h] [--version] <command> [options]",
        description="Command-line tools of lightning-memopt, the PyTorch Lightning callback (MemOpt) that makes big"
        " models fit in memory by gradient checkpointing and chunking.",
        epilog="Run `lightning-memopt <command> --help` for a command's options, such as"
        " `lightning-memopt estimate --help`.",
    )
    parser.add_argument("--version", action="version", version=f"lightning-memopt {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="<command>", dest="command")
    for name, what in COMMANDS.items():
        commands.add_parser(name, help=what, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``lightning-memopt`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    sys.path.insert(0, os.getcwd())  # class paths in configs name modules next to them, as with LightningCLI scripts
    if argv and argv[0] == "estimate":
        return run_estimate(argv[1:])
    parser = main_parser()
    if argv and not argv[0].startswith("-"):
        parser.error(f"unknown command {argv[0]!r} (the commands: {', '.join(COMMANDS)})")  # exits 2
    parser.parse_args(argv)  # --help and --version exit 0; an unknown flag exits 2, naming it
    parser.print_help(sys.stderr)  # no command
    return 2


if __name__ == "__main__":
    sys.exit(main())
