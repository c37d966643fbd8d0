"""Plot the real-scale estimates: the peak of each scenario, plain against MemOpt's choice, as grouped horizontal bars.

Reads the JSON that ``examples/estimate_real_scale.py --json`` writes; nothing in the plot is typed here. Each bar is
stacked by what held the peak (the estimate's ``by_kind``): the weights, the gradients, the optimizer state, the batch
and the rest (the optimizer step's temporaries), then the activations, coloured by the part of the model that was
running when the peak was reached and labelled with it. A budget is marked on its bar. The weights of a bar with
``weights_8bit=True`` (its frozen Linear and convolution weights in 8 bits) are hatched where they are fewer than the
plain step's, and every bar of a scenario that has such a bar says its weights, so that the weights' part of each peak
can be read apart.

    python examples/estimate_real_scale.py --markdown benchmarks/results/real_scale.md \\
        --json benchmarks/results/real_scale.json
    python -m benchmarks.plot_real_scale   # benchmarks/results/real_scale.json -> docs/images/real_scale.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "real_scale.json"
DEFAULT_PNG = ROOT / "docs" / "images" / "real_scale.png"

#: What held the peak but the activations, bottom of each bar first (the estimate's ``by_kind`` keys), and its colour.
HELD = {
    "weights": ("weights", "#4a4a4a"),
    "gradients": ("gradients", "#8a8a8a"),
    "optimizer": ("optimizer state", "#c2c2c2"),
    "batch": ("batch", "#d9c9a3"),
    "other": ("optimizer step's temporaries, other", "#e8e2f0"),
}
#: The colour of the activations, by where the peak was reached; any other place gets OTHER.
WHERE = {"attention": "#3a9e5a", "feed-forward": "#3b78c9", "VAE decode": "#e0822c"}
OTHER = "#9a6fc0"
BUDGET = "#b03a2e"
#: The hatch of the weights of a bar whose frozen Linear and convolution weights are in 8 bits (``weights_8bit=True``).
HATCH_8BIT = "////"


def _eight_bit(label: str) -> bool:
    return "weights_8bit=True" in label


def _fewer_weights(label: str, figures: dict[str, Any], plain: dict[str, Any]) -> bool:
    """Whether the bar's weights are in 8 bits: ``weights_8bit=True``, and fewer weight bytes than the plain step's
    (a model whose layers are all too small for 8-bit blocks keeps its weights as they are)."""
    weights = figures["by_kind"].get("weights", 0)
    return _eight_bit(label) and 0 < weights < plain["by_kind"].get("weights", 0)


def bars(rows: list[dict[str, Any]]) -> list[tuple[str, list[tuple[str, dict[str, Any], int | None]]]]:
    """The scenarios in the run's order, each with its bars: (label, figures, budget bytes). The first bar of a
    scenario is its plain step; then one bar per row of it, MemOpt's choice for that row's budget or arguments."""
    groups: dict[str, list[tuple[str, dict[str, Any], int | None]]] = {}
    for row in rows:
        group = groups.setdefault(row["title"], [])
        if not group:
            group.append(("plain", row["plain"], None))
        elif row["plain"]["peak_bytes"] != group[0][1]["peak_bytes"]:
            print(f"warning: {row['title']}: the plain peak differs between rows; the first is shown")
        extra = {k: v for k, v in row["options"].items() if k != "memory_budget"}
        label = "MemOpt(" + ", ".join(f"{k}={v!r}" for k, v in extra.items()) + ")" if extra else "MemOpt"
        if row["budget"] != "none":
            label += f", budget {row['budget']}"
        group.append((label, row["memopt"], row["budget_bytes"]))
    return list(groups.items())


def plot(data: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    groups = bars(data["rows"])
    #: The scenarios with a bar whose weights are in 8 bits: each of their bars says its weights.
    with_8bit = {title for title, group in groups if any(_eight_bit(label) for label, _, _ in group)}
    largest = max(f["peak_bytes"] for _, g in groups for _, f, _ in g)
    budgets = max((b for _, g in groups for _, _, b in g if b is not None), default=0)
    unit, scale = ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)

    height, y, ticks, labels, headings = 0.68, 0.0, [], [], []
    layout = []
    for title, group in groups:
        headings.append((y, title))
        y += 0.95
        for label, figures, budget in group:
            layout.append((y, label, figures, budget, group[0][1], title in with_8bit))
            ticks.append(y)
            labels.append(label)
            y += 1.0
        y += 0.45

    fig, ax = plt.subplots(figsize=(8.5, 0.4 * y + 1.0))
    places: dict[str, str] = {}
    pad = largest / scale * 0.008
    for pos, label, figures, budget, plain, say_weights in layout:
        left = 0.0
        for key, (_, colour) in HELD.items():
            size = figures["by_kind"].get(key, 0) / scale
            if size:
                hatch = HATCH_8BIT if key == "weights" and _fewer_weights(label, figures, plain) else None
                edge = "white" if hatch is None else "#d0d0d0"
                ax.barh(pos, size, height, left=left, color=colour, edgecolor=edge, linewidth=0.5, hatch=hatch)
                left += size
        total = figures["peak_bytes"] / scale
        places[figures["where"]] = colour = WHERE.get(figures["where"], OTHER)
        ax.barh(pos, total - left, height, left=left, color=colour, edgecolor="white", linewidth=0.5)
        text = f"{total:.2f} {unit}"
        if label != "plain" and plain["peak_bytes"]:
            saved = 1 - figures["peak_bytes"] / plain["peak_bytes"]
            text += f" ({saved:.0%} less)" if saved else " (unchanged)"
        text += f", peak {_where(figures['where'])}"
        if say_weights:
            weights = figures["by_kind"].get("weights", 0) / scale
            text += f"; weights {weights:.2f} {unit}"
            if _fewer_weights(label, figures, plain):
                text += f" ({plain['by_kind'].get('weights', 0) / scale:.2f} plain)"
        ax.text(total + pad, pos, text, va="center", fontsize=9.5)
        if budget is not None:  # a line from 0 to the budget just under the bar, clear of the text
            under = pos + height / 2 + 0.09
            ax.plot([0, budget / scale], [under, under], color=BUDGET, linewidth=1.6, solid_capstyle="butt")
            ax.plot(budget / scale, under, marker="|", markersize=8, markeredgewidth=1.8, color=BUDGET)
    for pos, title in headings:
        ax.text(0, pos + 0.1, title, fontsize=11, fontweight="bold", va="center")

    ax.set_yticks(ticks, labels, fontsize=10)
    ax.set_ylim(y - 0.3, -0.7)
    ax.set_xlim(0, max(largest * 1.85, budgets * 1.05) / scale)
    ax.set_xlabel(f"peak memory of the step, {unit}", fontsize=10)
    ax.tick_params(axis="y", length=0)
    ax.grid(axis="x", color="#e6e6e6", linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)

    present = {k for _, _, f, _, _, _ in layout for k, n in f["by_kind"].items() if n}
    handles = [Patch(color=colour, label=name) for key, (name, colour) in HELD.items() if key in present]
    if any(_fewer_weights(label, f, plain) for _, label, f, _, plain, _ in layout):
        eight = {"facecolor": HELD["weights"][1], "edgecolor": "#d0d0d0", "hatch": HATCH_8BIT}
        handles.insert(1, Patch(**eight, label="weights, weights_8bit=True"))
    handles += [Patch(color=c, label=f"activations, peak {_where(w)}") for w, c in places.items()]
    if any(b is not None for _, _, _, b, _, _ in layout):
        budget_line = {"color": BUDGET, "linewidth": 1.6, "marker": "|", "markersize": 8, "markeredgewidth": 1.8}
        handles.append(plt.Line2D([], [], **budget_line, label="memory budget (under its bar)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(-0.02, -0.06), ncol=2, fontsize=9.5, frameon=False)

    what = "tiny stand-in configs (--quick)" if data.get("quick") else "real-scale models on the meta device"
    versions = ", ".join(f"{k} {v}" for k, v in data.get("versions", {}).items())
    ax.set_title(
        f"Peak memory of one step, plain and with MemOpt\n{what}: dry runs on fake tensors, fp32 (the language models"
        f" bf16), CPU-exact bytes\n"
        f"{data['seconds']:.0f} s in all on {data.get('machine', 'an unknown machine')}; {versions}",
        fontsize=10,
        loc="left",
        pad=12,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {out}")


def _where(place: str) -> str:
    """``in attention``; ``outside any module``, ``unknown`` as they are."""
    return place if place.startswith("outside") or place == "unknown" else f"in {place}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", type=Path, nargs="?", default=DEFAULT_JSON, help=f"default {DEFAULT_JSON}")
    parser.add_argument("--out", type=Path, default=DEFAULT_PNG, help=f"default {DEFAULT_PNG}")
    args = parser.parse_args()
    plot(json.loads(args.json.read_text()), args.out)


if __name__ == "__main__":
    main()
