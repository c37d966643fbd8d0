"""MemOpt from LightningCLI: flags, YAML configs, --help and top-level --memopt.* flags, each in a subprocess running a
user's script."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # subprocesses: run by CI with `python -m pytest -m slow`

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


def test_the_example_script_does_not_import_lightning_memopt() -> None:
    assert "lightning_memopt" not in (EXAMPLE / "train.py").read_text().split('"""')[2]


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


def test_yaml_config_with_class_path_and_init_args(tmp_path) -> None:
    run = cli("fit", "--config", str(EXAMPLE / "config.yaml"), *QUICK, "--trainer.limit_train_batches=4", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    output = run.stdout + run.stderr
    assert "MemOpt: checkpointing" in output and "of 4 blocks for a budget of 14680064 bytes" in output


def test_help_explains_every_argument(tmp_path) -> None:
    run = cli("fit", "--trainer.callbacks.help", "lightning_memopt.MemOpt", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    for text in ("memory_budget", "The peak memory to stay under", "chunk_size", "checkpointing", "verify_tolerance"):
        assert text in run.stdout, text


def test_bad_value_fails_naming_it(tmp_path) -> None:
    flags = ["--trainer.callbacks+=lightning_memopt.MemOpt", "--trainer.callbacks.memory_budget=lots"]
    run = cli("fit", *flags, *QUICK, cwd=tmp_path)
    assert run.returncode != 0
    assert "`memory_budget` must be" in run.stderr and "'lots'" in run.stderr


@pytest.mark.parametrize("flag", ["--trainer.callbacks.memory_budget=lots", "--trainer.callbacks.chunk_size=0"])
def test_a_bad_value_is_the_first_thing_a_cli_user_sees(tmp_path, flag: str) -> None:
    """jsonargparse wraps an error raised while it builds a class in a chained traceback of some 80 lines, with
    MemOpt's message in a list near its end; MemOpt's message must be the error itself."""
    run = cli("fit", "--trainer.callbacks+=lightning_memopt.MemOpt", flag, *QUICK, cwd=tmp_path)
    assert run.returncode != 0
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("MemOpt: `")]
    assert len(errors) == 1 and run.stderr.rstrip().endswith(errors[0]), run.stderr[-3000:]


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
