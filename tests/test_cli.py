"""MemOpt from LightningCLI: flags, YAML configs, --help and top-level --memopt.* flags, each in a subprocess running a
user's script (marked slow: run by CI with `python -m pytest -m slow`); and the help of `lightning-memopt estimate`,
built in this process (fast)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parent.parent / "examples" / "cli"
QUICK = [
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=2",
    "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_progress_bar=false",
    "--model.length=32",
]


def cli(*args: str, cwd: Path, script: Path = EXAMPLE / "train.py") -> subprocess.CompletedProcess:
    """Run the script in ``cwd``: LightningCLI saves the config where the run logs, and must not meet an old one."""
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.slow
def test_the_example_script_does_not_import_lightning_memopt() -> None:
    assert "lightning_memopt" not in (EXAMPLE / "train.py").read_text().split('"""')[2]


@pytest.mark.slow
def test_callback_flags_reach_memopt(tmp_path) -> None:
    flags = [
        "--trainer.callbacks+=lightning_memopt.MemOpt",
        "--trainer.callbacks.chunk_size=auto",
        "--trainer.callbacks.memory_budget=2GiB",
    ]
    config = cli("fit", *flags, *QUICK, "--print_config", cwd=tmp_path)
    assert config.returncode == 0, config.stderr[-3000:]
    assert "class_path: lightning_memopt.MemOpt" in config.stdout
    assert "memory_budget: 2GiB" in config.stdout and "chunk_size: auto" in config.stdout
    run = cli("fit", *flags, *QUICK, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "MemOpt: checkpointing on encoder (TransformerEncoder)" in run.stdout + run.stderr


@pytest.mark.slow
def test_yaml_config_with_class_path_and_init_args(tmp_path) -> None:
    run = cli("fit", "--config", str(EXAMPLE / "config.yaml"), *QUICK, "--trainer.limit_train_batches=4", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    output = run.stdout + run.stderr
    assert "MemOpt: checkpointing" in output and "of 4 blocks for a budget of 14.00 MiB" in output


@pytest.mark.slow
def test_help_explains_every_argument(tmp_path) -> None:
    run = cli("fit", "--trainer.callbacks.help", "lightning_memopt.MemOpt", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    for text in ("memory_budget", "The peak memory to stay under", "chunk_size", "checkpointing", "verify_tolerance"):
        assert text in run.stdout, text


@pytest.mark.slow
def test_bad_value_fails_naming_it(tmp_path) -> None:
    flags = ["--trainer.callbacks+=lightning_memopt.MemOpt", "--trainer.callbacks.memory_budget=lots"]
    run = cli("fit", *flags, *QUICK, cwd=tmp_path)
    assert run.returncode != 0
    assert "`memory_budget` must be" in run.stderr and "'lots'" in run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--trainer.callbacks.memory_budget=lots", "--trainer.callbacks.chunk_size=0"])
def test_a_bad_value_is_the_first_thing_a_cli_user_sees(tmp_path, flag: str) -> None:
    """jsonargparse wraps an error raised while it builds a class in a chained traceback of some 80 lines, with
    MemOpt's message in a list near its end; MemOpt's message must be the error itself."""
    run = cli("fit", "--trainer.callbacks+=lightning_memopt.MemOpt", flag, *QUICK, cwd=tmp_path)
    assert run.returncode != 0
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("MemOpt: `")]
    assert len(errors) == 1 and run.stderr.rstrip().endswith(errors[0]), run.stderr[-3000:]


@pytest.mark.slow
def test_a_bad_top_level_flag_is_the_first_thing_a_cli_user_sees(tmp_path) -> None:
    script = tmp_path / "my_cli.py"
    script.write_text(textwrap.dedent(TOP_LEVEL.format(example=str(EXAMPLE))))
    run = cli("fit", "--memopt.memory_budget=1.5", *QUICK, script=script, cwd=tmp_path)
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.rstrip().splitlines()[-1].startswith("MemOpt: `memory_budget` must be"), run.stderr[-3000:]


TOP_LEVEL = """
import sys
sys.path.insert(0, {example!r})
from lightning.pytorch.cli import LightningCLI
from train import SequenceModel
from lightning_memopt.cli import add_memopt_arguments


class MyCLI(LightningCLI):
    def add_arguments_to_parser(self, parser):
        add_memopt_arguments(parser)


MyCLI(SequenceModel)
"""


@pytest.mark.slow
def test_top_level_memopt_flags_with_an_on_off_switch(tmp_path) -> None:
    script = tmp_path / "my_cli.py"
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    script.write_text(textwrap.dedent(TOP_LEVEL.format(example=str(EXAMPLE))))
    config = cli("fit", "--memopt.memory_budget=500MB", *QUICK, "--print_config", script=script, cwd=tmp_path)
    assert config.returncode == 0, config.stderr[-3000:]
    assert "memopt:" in config.stdout and "memory_budget: 500MB" in config.stdout
    on = cli("fit", *QUICK, script=script, cwd=tmp_path / "on")
    off = cli("fit", "--memopt.enabled=false", *QUICK, script=script, cwd=tmp_path / "off")
    assert on.returncode == off.returncode == 0, on.stderr[-2000:] + off.stderr[-2000:]
    assert "MemOpt: checkpointing on" in on.stdout + on.stderr
    assert "MemOpt" not in off.stdout + off.stderr


#: The MemOpt options that ``estimate`` uses: all but those about real runs (strict, measure, verify,
#: verify_tolerance) and the off switch.
ESTIMATED = ("checkpointing", "chunking", "chunk_size", "chunk_dim", "memory_budget", "models", "checkpoint_blocks")


def help_entries(text: str) -> dict[str, str]:
    """Each option of an argparse help, by its flag, with its wrapped lines joined (whitespace removed, since a line
    may break after a hyphen)."""
    entries: dict[str, str] = {}
    flag = None
    for line in text.splitlines():
        if line.startswith("  -"):
            flag = line.split()[0]
            entries[flag] = "".join(line.split()[1:])
        elif line.startswith("    ") and flag is not None:
            entries[flag] += "".join(line.split())
        else:
            flag = None
    return entries


def test_estimate_help_gives_each_option_its_type_and_help() -> None:
    """`lightning-memopt estimate --help` printed `<function <locals>.<lambda> ...>` as the type of --stage, and
    `type: Any` with no description for each --memopt.* flag, of which chunking was missing. The flags' types and help
    now come from MemOptConfig and the config module's OPTION_HELP."""
    from lightning_memopt.cli import estimate_parser
    from lightning_memopt.engine.config import OPTION_HELP, MemOptConfig

    assert list(OPTION_HELP) == list(MemOptConfig.names())  # one help text per option, none left over
    text = estimate_parser().format_help()
    assert "<function" not in text and "lambda" not in text, text
    entries = help_entries(text)
    assert "{fit,predict,validate,test}" in entries["--stage"], entries["--stage"]
    for flag in ["--stage", "--device", "--meta", "--json", *(f"--memopt.{name}" for name in ESTIMATED)]:
        assert flag in entries, f"{flag} is missing from the help"
        description, _, rest = entries[flag].partition("(type:")
        shown_type = rest.split(",default:")[0]
        assert shown_type and shown_type != "Any" and "<" not in shown_type, f"{flag}: type {shown_type!r}"
        assert len(description) > 10, f"{flag} has no description"
    for name in ESTIMATED:
        assert "".join(OPTION_HELP[name].split()) in entries[f"--memopt.{name}"], name
