"""MemOpt from LightningCLI: flags, YAML configs, --help and top-level --memopt.* flags, each in a subprocess running a
user's script (marked slow: run by CI with `python -m pytest -m slow`); and the help of `lightning-memopt estimate`,
built in this process (fast)."""

from __future__ import annotations

import csv
import dataclasses
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "cli"
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
    # the budget alone plans the blocks: 2 GiB needs none checkpointed
    assert "MemOpt: checkpointing 0 of 4 blocks for a budget of 2.00 GiB" in run.stdout + run.stderr


@pytest.mark.slow
def test_memory_budget_auto_from_a_flag_and_from_yaml(tmp_path) -> None:
    """'auto' gets through jsonargparse (the type is int | float | str) as a flag and from the YAML it prints."""
    flags = ["--trainer.callbacks+=lightning_memopt.MemOpt", "--trainer.callbacks.memory_budget=auto"]
    config = cli("fit", *flags, "--trainer.callbacks.checkpointing=auto", *QUICK, "--print_config", cwd=tmp_path)
    assert config.returncode == 0, config.stderr[-3000:]
    assert "memory_budget: auto" in config.stdout, config.stdout
    (tmp_path / "auto.yaml").write_text(config.stdout)
    run = cli("fit", "--config", "auto.yaml", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "MemOpt: checkpointing" in run.stdout + run.stderr


#: A warning as Lightning prints it, ``path:line: message``, whose message is MemOpt's.
MEMOPT_WARNING = re.compile(r"^\S+\.py:\d+: MemOpt", re.MULTILINE)


def first_command(page: Path, section: str) -> list[str]:
    """The first command of the first ``bash`` block of a Markdown page's section, its continued lines joined."""
    text = page.read_text().split(f"\n{section}\n", 1)[1]
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return shlex.split(block.replace("\\\n", " ").splitlines()[0], comments=True)


@pytest.mark.slow
@pytest.mark.parametrize("page", ["README.md", "docs/cli.md"])
def test_the_documented_flags_run_without_a_warning_and_meet_the_budget(tmp_path, page: str) -> None:
    """The first LightningCLI command of the README and of the LightningCLI page, as written (the README's runs from
    examples/cli, the page's from the repository's root): it gave a budget that ``checkpointing=True`` ignores, with a
    warning saying so. Now it runs with no MemOpt warning and its measured peak meets its budget."""
    command = first_command(ROOT / page, "## LightningCLI" if page == "README.md" else "## Flags")
    assert command[:2] in (["python", "train.py"], ["python", "examples/cli/train.py"]), command
    run = cli(*command[2:], cwd=tmp_path)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert not MEMOPT_WARNING.search(output), MEMOPT_WARNING.findall(output)
    assert "MemOpt: checkpointing" in output
    rows = list(csv.DictReader((tmp_path / "lightning_logs" / "version_0" / "metrics.csv").open()))
    measured = next(row for row in rows if row.get("memopt/peak_bytes"))
    assert float(measured["memopt/peak_bytes"]) <= float(measured["memopt/budget_bytes"]), measured


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
    assert_plain(run.stdout)


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
    `type: Any` with no description for each --memopt.* flag, of which chunking was missing. The flags' types now come
    from MemOptConfig and their help from MemOpt's docstring, the text LightningCLI shows for the callback."""
    from lightning_memopt.cli import estimate_parser, option_help

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
        assert "".join(option_help()[name].split()) in entries[f"--memopt.{name}"], name


def assert_plain(text: str) -> None:
    """No reST markup: no double backquotes, no roles such as :class:`...`."""
    assert "``" not in text, [line for line in text.splitlines() if "``" in line]
    assert not re.search(r":[a-z]+:`", text), re.findall(r".{20}:[a-z]+:`.{20}", text)


def test_main_help_lists_the_commands(capsys) -> None:
    """`lightning-memopt --help` was one usage line: it says what the command is, its commands with one line each,
    and how to get more help."""
    from lightning_memopt.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert "PyTorch Lightning callback" in out and "--version" in out, out
    assert re.search(r"^\s+estimate\s+one step's peak memory", out, re.MULTILINE), out
    assert "lightning-memopt estimate --help" in " ".join(out.split()), out


def test_main_help_and_version_import_neither_torch_nor_lightning() -> None:
    """`lightning-memopt --help` imported torch, Lightning, diffusers and transformers before parsing anything (14.5 s
    on a quiet machine): the package's names are imported when first used, the command's heavy imports when it runs."""
    run = fresh_python(
        """
import sys
from lightning_memopt.cli import main
for argv in (['--help'], ['--version']):
    try:
        main(argv)
    except SystemExit as exit_:
        assert exit_.code == 0, exit_.code
heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'lightning', 'diffusers', 'transformers'})
print('heavy:', heavy, file=sys.stderr)
"""
    )
    assert "heavy: []" in run.stderr, run.stderr[-2000:]
    assert "estimate" in run.stdout and "lightning-memopt 0." in run.stdout


def test_the_package_names_are_the_same_whatever_was_imported_first() -> None:
    """With the names imported when first used, a submodule imported first (``lightning_memopt.estimate``, as the
    callbacks import it) hid the function of the same name: ``from lightning_memopt import estimate`` gave the
    module ("TypeError: 'module' object is not callable" in examples/estimate_below_floors.py)."""
    fresh_python(
        """
import lightning_memopt.estimate, lightning_memopt.memory
from lightning_memopt import CPUPeakTracker, MemOpt, estimate
import lightning_memopt
assert callable(estimate) and estimate is lightning_memopt.estimate, estimate
assert MemOpt.__name__ == 'MemOpt' and CPUPeakTracker.__name__ == 'CPUPeakTracker'
assert sorted(set(lightning_memopt.__all__) - set(dir(lightning_memopt))) == []
"""
    )


def fresh_python(script: str) -> subprocess.CompletedProcess:
    """``script`` run by a new Python process from the repository's root (nothing imported yet); it must succeed."""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    return run


def test_main_version_prints_the_version(capsys) -> None:
    """`lightning-memopt --version` was an unknown command."""
    from lightning_memopt import __version__
    from lightning_memopt.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"lightning-memopt {__version__}"


@pytest.mark.parametrize(
    ("argv", "said"),
    [(["measure"], "unknown command 'measure'"), (["--bogus"], "unrecognized arguments: --bogus"), ([], "usage:")],
)
def test_main_names_a_bad_command_or_flag_and_exits_2(capsys, argv: list[str], said: str) -> None:
    from lightning_memopt.cli import main

    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    assert said in capsys.readouterr().err


def test_estimate_help_reads_as_plain_words() -> None:
    """It showed `type: <class 'dict'>` (--trainer), `type: Any` for the ignored --seed_everything and --ckpt_path,
    a `<class '...LightningModule'>:` group header and Lightning's DataModule docstring cut at its first line."""
    from lightning_memopt.cli import estimate_parser

    parser = estimate_parser()
    text = parser.format_help()
    assert "<class " not in text and "type: Any" not in text, text
    assert "The main advantage is" not in text and "DataModule standardizes" not in text, text
    headers = [line for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert headers == [
        "options:",
        "The model: the config's model section, or a class path:",
        "The data: the config's data section, if any (else the model's own dataloaders):",
        "MemOpt's arguments:",
    ], headers
    assert_plain(text)
    for name in ("seed_everything", "ckpt_path"):  # hidden, and still accepted in a config
        assert f"--{name}" not in text
    cfg = parser.parse_string("seed_everything: 3\nckpt_path: last\noptimizer: null\ntrainer: {precision: 32}\n")
    assert cfg.seed_everything == 3 and cfg.trainer == {"precision": 32}


def callback_help() -> str:
    """The help of MemOpt's arguments as LightningCLI prints it (`--trainer.callbacks.help lightning_memopt.MemOpt`
    builds it the same way, with jsonargparse)."""
    from jsonargparse import ArgumentParser

    from lightning_memopt import MemOpt

    parser = ArgumentParser(prog="train.py")
    parser.add_class_arguments(MemOpt, "trainer.callbacks")
    return parser.format_help()


def test_the_callback_help_is_plain_text() -> None:
    """It showed reST markup (double backquotes, :class:`~...VerificationError`) and a title cut at the end of the
    docstring's first line, since jsonargparse takes the first line alone."""
    from lightning_memopt import MemOpt

    text = callback_help()
    assert_plain(text)
    summary = " ".join(MemOpt.__doc__.split("\n\n")[0].split())
    assert f"\n{summary.removesuffix('.')}:\n" in text, text[:2000]
    for name in MemOpt.__init__.__code__.co_varnames[1 : MemOpt.__init__.__code__.co_argcount]:
        assert f"--trainer.callbacks.{name}" in text, name


def test_memopt_documents_each_option_once_for_python_docs_and_both_clis() -> None:
    """One source for each option's help: MemOpt's docstring, in the order of its arguments and of MemOptConfig's
    fields (the estimate's --memopt.* flags take their help from it, LightningCLI reads it itself)."""
    import inspect

    from lightning_memopt import MemOpt
    from lightning_memopt.cli import option_help
    from lightning_memopt.engine.config import MemOptConfig

    helps = option_help()
    assert list(helps) == list(MemOptConfig.names()) == list(inspect.signature(MemOpt).parameters)
    assert all(len(text) > 20 for text in helps.values()), helps
    # the signature LightningCLI reads gives each option the config's own type and default
    parameters = inspect.signature(MemOpt).parameters
    for field in dataclasses.fields(MemOptConfig):
        assert (str(parameters[field.name].annotation), parameters[field.name].default) == (
            str(field.type),
            field.default,
        ), field.name


@pytest.mark.parametrize("which", ["callback", "estimate"])
def test_checkpointing_auto_is_documented_as_the_planner_does_it(which: str) -> None:
    """Both helps said 'auto' chose "for the fewest recompute FLOPs" and named 4 of the 7 modes (the callback's) or
    none: the planner takes the mix with the least predicted step time, among every mode."""
    from lightning_memopt.cli import estimate_parser
    from lightning_memopt.techniques.checkpointing.selective import MODES

    if which == "callback":
        text, flag = callback_help(), "--trainer.callbacks.checkpointing"
    else:
        text, flag = estimate_parser().format_help(), "--memopt.checkpointing"
    text = " ".join(text.split(f"\n  {flag} ", 1)[1].split("\n  --", 1)[0].split())  # the flag's entry
    assert "least predicted step time" in text and "peak with every block fully checkpointed" in text, text
    assert "FLOPs" not in text.replace("FLOPs or bytes", ""), text  # the time model prices ops by FLOPs or bytes
    for mode in MODES:
        assert re.search(rf"\b{mode}\b", text), mode
