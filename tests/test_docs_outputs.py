"""The outputs the docs print are what their code prints now.

A block whose printed output a page shows is marked with an HTML comment, ``<!-- printed-output: NAME -->``, right
before its code block (```` ```python ```` or ```` ```bash ````); the page then says "This prints" or "It prints" and
shows the output in a plain ```` ``` ```` block. Every such block of README.md and docs/*.md is in ``CHECKS``.

- The default tests (fast, nothing run) check that every printed output on the pages is marked and has a check here,
  and that the figures of each printed output agree with each other (the kinds held at a peak sum to it, the peak is
  the largest of the phases' peaks, a peak with MemOpt meets the budget it was chosen for).
- The slow tests run each block as written, in a subprocess with this Python, from a temporary folder, and compare
  the byte figures it prints with the page's, exactly. Times (seconds) are never compared: they depend on the
  machine. Under ``checkpointing="auto"`` with a budget, each block's mode follows the speeds the time model measures
  on the machine (the tests' pinned speeds do not reach a subprocess), so the row with MemOpt's changes may reach
  another peak under the same budget: for it only what does not depend on the modes is compared (the weights, the
  optimizer state and the batch held at its peak, the optimizer step's peak, what else MemOpt did, and that its peak
  meets the budget), and the plain row in full.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- printed-output: ([\w-]+) -->$")
FENCE = re.compile(r"^```(\w*)$")
#: A byte figure as the package writes it (``lightning_memopt.units.fmt_bytes``) or as a count: "13.68 GiB", "8 B".
BYTES = re.compile(r"(\d[\d,]*(?:\.\d+)?) (B|KiB|MiB|GiB|TiB)\b")
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


@dataclass(frozen=True)
class Block:
    page: str
    name: str
    lang: str
    code: str
    prose: str
    output: str
    output_line: int  # where the output block opens, 1-based


def fenced(lines: list[str], start: int) -> tuple[str, str, int]:
    """The fenced block opening at ``lines[start]``: its language, its text and the index after its closing fence."""
    lang = FENCE.match(lines[start]).group(1)
    end = next(i for i in range(start + 1, len(lines)) if lines[i] == "```")
    return lang, "".join(line + "\n" for line in lines[start + 1 : end]), end + 1


def marked_blocks() -> dict[str, Block]:
    """Every marked block of the pages: its code, the prose between it and its output, and the output."""
    found: dict[str, Block] = {}
    for page in PAGES:
        lines = page.read_text().split("\n")
        for i, line in enumerate(lines):
            marker = MARKER.match(line)
            if not marker:
                continue
            name = marker.group(1)
            where = f"{page.relative_to(ROOT)}:{i + 1}"
            assert FENCE.match(lines[i + 1]) and lines[i + 1] != "```", f"{where}: no code block after {name!r}"
            lang, code, after = fenced(lines, i + 1)
            assert lang in ("python", "bash"), f"{where}: {name!r} marks a {lang!r} block"
            start = next(j for j in range(after, len(lines)) if FENCE.match(lines[j]))
            assert lines[start] == "```", f"{where}: the next block after {name!r} is not a plain output block"
            prose = " ".join(" ".join(lines[after:start]).split())
            assert re.search(r"\b(?:This|It) prints\b", prose), f"{where}: no 'This prints' before {name!r}'s output"
            assert name not in found, f"{where}: {name!r} marks two blocks"
            output = fenced(lines, start)[1]
            found[name] = Block(page.relative_to(ROOT).as_posix(), name, lang, code, prose, output, start + 1)
    return found


def printed_outputs() -> list[str]:
    """Every plain block of the pages that the paragraph before it introduces as what something prints."""
    shown = []
    for page in PAGES:
        lines = page.read_text().split("\n")
        i = 0
        while i < len(lines):
            if not FENCE.match(lines[i]):
                i += 1
                continue
            lang, text, after = fenced(lines, i)
            if lang == "":
                end = i
                while end > 0 and not lines[end - 1].strip():
                    end -= 1
                begin = end
                while begin > 0 and lines[begin - 1].strip():
                    begin -= 1
                paragraph = " ".join(lines[begin:end])  # the paragraph before the block
                if re.search(r"\b(?:This|It) prints\b", paragraph):
                    shown.append(f"{page.relative_to(ROOT)}:{i + 1}")
            i = after
    return shown


def to_bytes(figure: str) -> float:
    value, unit = BYTES.fullmatch(figure.strip()).groups()
    return float(value.replace(",", "")) * UNITS[unit]


def rounding(figure: str) -> float:
    """Half the last digit of a written figure, in bytes: how far the figure may be from the bytes it stands for."""
    value, unit = BYTES.fullmatch(figure.strip()).groups()
    decimals = len(value.split(".")[1]) if "." in value else 0
    return 0.5 * 10**-decimals * UNITS[unit]


# an estimate as printed ---------------------------------------------------------------------------------------------


def parts(text: str) -> dict[str, str]:
    """``"weights 1.13 GiB, gradients 16.01 MiB"`` -> ``{"weights": "1.13 GiB", "gradients": "16.01 MiB"}``."""
    out = {}
    for item in text.split(", "):
        figure = BYTES.search(item)
        assert figure is not None and item.endswith(figure.group(0)), item
        out[item[: figure.start()].strip()] = figure.group(0)
    return out


#: The first line of a printed estimate; its time is never compared.
ESTIMATE_HEAD = re.compile(r"MemOpt estimate, (\w+) on (\w+) \(dry runs on fake tensors, [\d.]+ s[^)]*\)(, budget .+)?")


def parse_estimate(text: str) -> dict:
    """An ``Estimate`` printed (``print(estimate(...))``, ``lightning-memopt estimate``), with or without its last
    column, which says where each peak is reached."""
    lines = text.strip("\n").split("\n")
    head = ESTIMATE_HEAD.fullmatch(lines[0])
    assert head is not None, lines[0]
    budget = head.group(3) and head.group(3).removeprefix(", budget ")
    out: dict = {"stage": head.group(1), "device": head.group(2), "budget": budget}
    for line in lines[1:]:
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] == "plain" or cells[0].startswith("MemOpt"):
            row = "plain" if cells[0] == "plain" else "memopt"
            out[row] = {"label": cells[0], "peak": cells[1], "held": parts(cells[2])}
        elif line.strip().startswith("the peak of each phase"):
            found = re.fullmatch(r"the peak of each phase, (plain|with MemOpt): (.*)", line.strip())
            out["phases_" + ("plain" if found.group(1) == "plain" else "memopt")] = parts(found.group(2))
    assert {"plain", "memopt", "phases_plain", "phases_memopt"} <= set(out), text
    return out


def consistent_estimate(printed: dict) -> None:
    """The figures of one printed estimate agree with each other, to their rounding."""
    for row in ("plain", "memopt"):
        peak, held, phases = printed[row]["peak"], printed[row]["held"], printed["phases_" + row]
        slack = rounding(peak) + sum(rounding(f) for f in held.values())
        assert abs(sum(map(to_bytes, held.values())) - to_bytes(peak)) <= slack, (row, peak, held)
        assert max(phases.values(), key=to_bytes) == peak, (row, peak, phases)
    if printed["budget"] is not None:
        assert to_bytes(printed["memopt"]["peak"]) <= to_bytes(printed["budget"]), printed


#: What MemOpt's row holds at its peak whatever mode each block is in.
MODE_FREE_KINDS = ("weights", "optimizer", "batch")


def compare_estimate(ran: str, shown: str) -> None:
    """The figures that do not depend on the machine's speeds, exactly; see the module's docstring."""
    ran_, shown_ = parse_estimate(ran), parse_estimate(shown)
    consistent_estimate(ran_)
    for key in ("stage", "device", "budget"):
        assert ran_[key] == shown_[key], key
    assert ran_["plain"] == shown_["plain"], "the plain row"
    assert ran_["phases_plain"] == shown_["phases_plain"], "the plain row's phases"
    memopt, page = ran_["memopt"], shown_["memopt"]
    for kind in MODE_FREE_KINDS:
        assert memopt["held"].get(kind) == page["held"].get(kind), f"{kind} held at MemOpt's peak"
    assert ran_["phases_memopt"]["optimizer step"] == shown_["phases_memopt"]["optimizer step"]
    # the label is "MemOpt: checkpointing ... (modes); what else it did": the modes follow the speeds, the rest not
    assert memopt["label"].split("; ")[1:] == page["label"].split("; ")[1:], (memopt["label"], page["label"])


# the fitting page's lines -------------------------------------------------------------------------------------------


FITTING_LINE = re.compile(r"([\w-]+): plain (\S+ \S+), MemOpt (\S+ \S+) \((.*)\)")


def consistent_fitting(shown: str) -> None:
    lines = [FITTING_LINE.fullmatch(line) for line in shown.strip().split("\n")]
    assert all(lines) and [m.group(1) for m in lines] == ["32-true", "bf16-mixed"], shown
    for m in lines:
        assert to_bytes(m.group(3)) < to_bytes(m.group(2)), m.group(0)


def compare_fitting(ran: str, shown: str) -> None:
    """Whole lines: no budget, so MemOpt's choice does not move with the machine's speeds, and no time is printed."""
    consistent_fitting(ran)
    assert [BYTES.findall(line) for line in ran.strip().split("\n")] == [
        BYTES.findall(line) for line in shown.strip().split("\n")
    ], "the byte figures"
    assert ran.strip().split("\n") == shown.strip().split("\n"), "the lines"


#: Each marked block: how its page's output is checked on its own, and how a run's output is compared with it.
CHECKS: dict[str, tuple[Callable[[str], None], Callable[[str, str], None]]] = {
    "estimate-encoder": (lambda shown: consistent_estimate(parse_estimate(shown)), compare_estimate),
    "cli-estimate": (lambda shown: consistent_estimate(parse_estimate(shown)), compare_estimate),
    "fitting-causal-lm": (consistent_fitting, compare_fitting),
    "fitting-unet": (consistent_fitting, compare_fitting),
}


def run_block(block: Block, tmp_path: Path) -> str:
    """Run a block as the page gives it, from ``tmp_path``: a Python block with this Python, a bash block with this
    environment's scripts first on the PATH and a copy of ``examples/`` beside it, so nothing is written in the repo."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if block.lang == "python":
        (tmp_path / "block.py").write_text(block.code)
        command = [sys.executable, "block.py"]
    else:
        ignore = shutil.ignore_patterns("__pycache__", "lightning_logs")
        shutil.copytree(ROOT / "examples", tmp_path / "examples", ignore=ignore)
        command = ["bash", "-e", "-c", block.code]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return run.stdout


# default tests: nothing run -----------------------------------------------------------------------------------------


def test_every_printed_output_is_marked_and_checked() -> None:
    blocks = marked_blocks()
    assert sorted(blocks) == sorted(CHECKS), "a marked block without a check here, or a check without its block"
    marked = {f"{block.page}:{block.output_line}" for block in blocks.values()}
    outputs = printed_outputs()
    assert len(outputs) == len(blocks), outputs
    assert [o for o in outputs if o not in marked] == [], "a printed output without a marker before its code"


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_the_printed_figures_agree_with_each_other(name: str) -> None:
    CHECKS[name][0](marked_blocks()[name].output)


def test_a_wrong_figure_is_caught() -> None:
    """The comparison itself: one figure of a page changed is a failure, a time changed is not."""
    shown = marked_blocks()["estimate-encoder"].output
    compare_estimate(shown, shown)
    compare_estimate(re.sub(r"tensors, [\d.]+ s", "tensors, 999.9 s", shown), shown)
    plain_peak = parse_estimate(shown)["plain"]["peak"]
    with pytest.raises(AssertionError):
        compare_estimate(shown.replace(plain_peak, "13.67 GiB", 1), shown)
    with pytest.raises(AssertionError):
        consistent_estimate(parse_estimate(shown.replace("optimizer step 4.57 GiB", "optimizer step 14.57 GiB")))


# slow tests: each block run ---------------------------------------------------------------------------------------


@pytest.mark.slow  # a 24-layer encoder of width 1,024 planned under a budget by dry runs: 35 to 50 s on 2 cores
def test_the_estimate_on_the_getting_started_page(tmp_path: Path) -> None:
    block = marked_blocks()["estimate-encoder"]
    CHECKS[block.name][1](run_block(block, tmp_path), block.output)


@pytest.mark.slow  # a process that imports torch, Lightning and jsonargparse, and plans by dry runs: 10 to 25 s
def test_the_estimate_command_on_the_lightningcli_page(tmp_path: Path) -> None:
    block = marked_blocks()["cli-estimate"]
    CHECKS[block.name][1](run_block(block, tmp_path), block.output)


@pytest.mark.slow  # two estimates of a causal LM whose loss the planner weighs: 15 to 30 s
def test_the_fitting_pages_language_model(tmp_path: Path) -> None:
    block = marked_blocks()["fitting-causal-lm"]
    CHECKS[block.name][1](run_block(block, tmp_path), block.output)


@pytest.mark.slow  # two estimates of a UNet2DCondition: 25 to 45 s
def test_the_fitting_pages_unet(tmp_path: Path) -> None:
    block = marked_blocks()["fitting-unet"]
    CHECKS[block.name][1](run_block(block, tmp_path), block.output)
