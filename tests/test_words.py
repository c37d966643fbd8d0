"""What the docs say is true: the planner's objective in words, the fitting page's code, the FAQ's sampling loop.

``checkpointing="auto"`` takes the mix with the least predicted step time that meets the budget
(``lightning_memopt/techniques/planner/``, ``choose``); no page, nor the MemOpt docstring, nor the command line's
option help may say it goes for the fewest recompute FLOPs. The recomputed FLOPs are still a figure
(``memopt/recompute_flops``), and saying so is fine.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import re
from importlib.metadata import version
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_memopt import MemOpt, estimate

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"

#: Ways of saying that the planner minimises FLOPs or recomputation, each within one sentence. They are matched on
#: text whose whitespace is collapsed and whose Markdown emphasis and code marks are removed.
FLOPS_OBJECTIVE = [
    # "for the fewest recompute FLOPs", "the least recomputation", "the fewest FLOPs" (not "at least ... TFLOP")
    r"(?<!at )\b(?:fewest|least|minimum|minimal|smallest|lowest)(?:\s+[\w-]+){0,2}?\s+(?:FLOPs?|recomputation)\b",
    # "the table's cost is FLOPs"
    r"\bcost\s+is\s+(?:in\s+)?(?:the\s+)?(?:recompute[ds]?\s+)?FLOPs?\b",
    # "the planner minimises FLOPs", "minimizes the recomputed FLOPs"
    r"\bminimi[sz](?:e|es|ed|ing)\b[^.;:]{0,60}?\b(?:FLOPs?|recomputation)\b",
    # "ranks the mixes by FLOPs", "chooses ... by recompute FLOPs"
    r"\b(?:ranks?|chooses?|picks?)\b[^.;:]{0,40}?\bby\s+(?:the\s+)?(?:recompute[ds]?\s+)?FLOPs?\b",
    # "recompute as little as possible"
    r"\brecomput\w*\s+as\s+little\b",
]


def flops_objective(text: str) -> list[str]:
    """The places in ``text`` that describe the planner's objective as FLOPs, with some context."""
    plain = " ".join(re.sub(r"[`*]", "", text).split())
    found = []
    for pattern in FLOPS_OBJECTIVE:
        for match in re.finditer(pattern, plain, re.IGNORECASE):
            found.append(plain[max(0, match.start() - 60) : match.end() + 40])
    return found


def test_the_patterns_catch_the_old_wording_and_pass_the_figure() -> None:
    """What the pages said before the planner was described truly, and what they may say."""
    wrong = [
        "under a budget for the fewest recompute FLOPs that meet it",
        "(nothing, its cheap ops, or its whole forward) for the fewest recompute\nFLOPs that meet the `memory_budget`",
        "The table's cost is FLOPs, not time.",
        "# or: stay under a budget for the least recomputation: each block recomputes all, part or none of its forward",
        "The planner minimises FLOPs, which is what grows with model size.",
        "recomputes, for the fewest recompute FLOPs whose peak meets memory_budget, or without a budget stays within",
        "It chooses the mix with the fewest recompute FLOPs.",
        "The planner minimizes the recomputed FLOPs under the budget.",
        "The planner ranks the mixes by recompute FLOPs.",
        "Each block is chosen to recompute as little as possible.",
    ]
    right = [
        "The FLOPs recomputed are still logged as `memopt/recompute_flops` and `memopt/recompute_fraction`.",
        "fewer FLOPs do not mean less time",
        "so `attention` keeps most of `full`'s saving for less recompute",
        "it keeps 33,792 B more than `full` and recomputes 14% fewer FLOPs",
        "a mix that recomputes fewer FLOPs is not always faster",
        "The planner never recomputes more than counting.",
        "a time model prices every op of the dry run by its FLOPs or its bytes over a per-op floor",
        "A knob's own `cost` is still given in FLOPs.",
        "`cost(value)`: the work a setting adds beyond the FLOPs it makes the step recompute, in FLOPs.",
        'under every budget `"auto"` recomputes far fewer FLOPs than whole-block counting',
        "the backward pass recomputes at least 1.5 TFLOP",
        "The planner takes the mix with the least predicted step time whose modelled peak meets the budget.",
        "mixes chosen by an earlier version of the planner, which ranked mixes by the FLOPs they recompute",
    ]
    assert [w for w in wrong if not flops_objective(w)] == []
    assert [(r, flops_objective(r)) for r in right if flops_objective(r)] == []


def _option_help() -> str:
    """Each option's help as the command line shows it: ``engine/config.py``'s ``OPTION_HELP``, or where it is made
    from MemOpt's docstring, ``lightning_memopt.cli.option_help()`` (which needs the ``cli`` extra)."""
    from lightning_memopt.engine import config

    if hasattr(config, "OPTION_HELP"):
        return "\n".join(config.OPTION_HELP.values())
    pytest.importorskip("docstring_parser")
    from lightning_memopt import cli

    return "\n".join(cli.option_help().values())


SOURCES = {
    **{path.relative_to(ROOT).as_posix(): path.read_text for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]},
    "MemOpt docstring": lambda: "\n".join(filter(None, [inspect.getdoc(MemOpt), inspect.getdoc(MemOpt.__init__)])),
    "option help": _option_help,
}


@pytest.mark.parametrize("source", list(SOURCES))
def test_no_text_says_the_planner_goes_for_the_fewest_flops(source: str) -> None:
    """The planner takes the mix with the least predicted step time; FLOPs are a figure it logs, not its goal."""
    assert flops_objective(SOURCES[source]()) == []


# the "Fitting your model" page ----------------------------------------------------------------------------------------


def _page_block(marker: str) -> tuple[str, list[str], dict[str, str]]:
    """The fitting page's Python block that contains ``marker``, the lines the page says it prints, and the versions
    it says they were printed with."""
    text = (DOCS / "fitting.md").read_text()
    block = r"```python\n((?:(?!```).)*?" + re.escape(marker) + r".*?)```\n\n"
    found = re.search(block + r"It prints \((.*?)\):\n\n```\n(.*?)```", text, re.DOTALL)
    assert found is not None, f"no block with {marker!r} followed by what it prints on docs/fitting.md"
    versions = dict(v.split(" ") for v in found.group(2).split(", "))
    return found.group(1), found.group(3).strip().split("\n"), versions


def _run_page_block(marker: str) -> tuple[list[str], list[str], dict[str, str]]:
    code, printed, versions = _page_block(marker)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"docs/fitting.md ({marker})", "exec"), {"__name__": "fitting_page"})
    return out.getvalue().strip().split("\n"), printed, versions


def _figures(line: str) -> tuple[str, float, float]:
    found = re.match(r"([\w-]+): plain ([\d.]+) MiB, MemOpt ([\d.]+) MiB \(", line)
    assert found is not None, line
    return found.group(1), float(found.group(2)), float(found.group(3))


def _check(lines: list[str], printed: list[str], versions: dict[str, str]) -> dict[str, tuple[float, float]]:
    figures = {precision: (plain, memopt) for precision, plain, memopt in map(_figures, lines)}
    assert list(figures) == ["32-true", "bf16-mixed"]
    assert figures["32-true"][1] < figures["32-true"][0]
    if all(version(name).split("+")[0] == wanted for name, wanted in versions.items()):
        assert lines == printed, "the page's printed figures are not what its code prints now"
    return figures


@pytest.mark.slow  # two estimates of a causal LM whose loss and feed-forward the planner weighs: about 12 s
def test_the_fitting_pages_language_model_is_estimated_from_its_config() -> None:
    """The page's first block (transformers, from_config on the meta device) runs and prints what the page shows."""
    _check(*_run_page_block("AutoModelForCausalLM.from_config"))


@pytest.mark.slow  # two estimates of a UNet2DCondition: 25 to 40 s
def test_the_fitting_pages_unet_is_built_in_configure_model_and_estimated() -> None:
    """The page's second block (diffusers, configure_model on the meta device) runs and prints what the page shows;
    mixed precision lowers this UNet's peak."""
    figures = _check(*_run_page_block("def configure_model"))
    assert figures["bf16-mixed"][0] < figures["32-true"][0]


# the FAQ's sampling loop ----------------------------------------------------------------------------------------------


#: The timesteps each call of ``Sampler.predict_step`` read (outside the module: a dry run puts its attributes back).
SEEN: list[list[float]] = []


class Sampler(pl.LightningModule):
    """A predict step that loops over timesteps read out of a tensor: made in the step, or the module's buffer."""

    def __init__(self, from_buffer: bool) -> None:
        super().__init__()
        self.net = nn.Linear(8, 8)
        self.from_buffer = from_buffer
        self.register_buffer("timesteps", torch.linspace(999, 0, 4))

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        timesteps = self.timesteps if self.from_buffer else torch.linspace(999, 0, 4)
        values = timesteps.tolist()
        SEEN.append(values)
        for t in values:
            batch = self.net(batch) * (1 - t / 1000)
        return batch


def test_a_sampling_loop_over_linspace_made_in_the_step_is_dry_run_with_its_values() -> None:
    """docs/faq.md: the timesteps a step makes with torch.linspace are real in a dry run; a buffer's are placeholders
    (zeros, as many as the buffer holds) before any real step, and a note says so."""
    SEEN.clear()
    result = estimate(Sampler(from_buffer=False), torch.randn(2, 8), stage="predict")
    assert SEEN and all(seen == [999.0, 666.0, 333.0, 0.0] for seen in SEEN)
    assert not any("placeholder" in note for note in result.notes)

    SEEN.clear()
    result = estimate(Sampler(from_buffer=True), torch.randn(2, 8), stage="predict")
    assert SEEN and all(seen == [0.0] * 4 for seen in SEEN)
    assert any("placeholder" in note for note in result.notes)
