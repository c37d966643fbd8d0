"""The results as JSON, a markdown table, and (with matplotlib) plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MIB = 2**20


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "—"


def _mib(value: int | None) -> str:
    return f"{value / MIB:.2f}" if value is not None else "—"


def _ms(config: dict[str, Any]) -> str:
    median = config["median_step_s"]
    return f"{median * 1000:.1f} (n={len(config['step_times_s'])})" if median is not None else "—"


def _budget(config: dict[str, Any]) -> str:
    if config["budget_bytes"] is None:
        return ""
    verdict = {True: "met", False: "**over**", None: "?"}[config["meets_budget"]]
    return f"{_mib(config['budget_bytes'])} {verdict}"


def workload_table(name: str, data: dict[str, Any]) -> list[str]:
    by = {c["name"]: c for c in data["configs"]}
    plain, native = by.get("plain", {}), by.get("native", {})
    size = ", ".join(f"{k} {v}" for k, v in data["size"].items())
    budgets = ", ".join(f"{k} {_mib(v)} MiB" for k, v in data["budgets"].items()) or "none"
    lines = [
        f"### {name} ({data['stage']})",
        "",
        f"{size}; {data['parameters']:,} parameters ({data['trainable_parameters']:,} trainable); budgets: {budgets}.",
        "",
        "| configuration | peak MiB | peak × plain | peak × native | step ms (median) | time × plain | time × native"
        " | tuning s (dry runs) | FF calls/batch | settings | budget MiB (every batch) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for c in data["configs"]:
        p, t = c["peak_bytes"], c["median_step_s"]
        cells = [
            f"`{c['label']}`" if c["name"] != "native" else c["label"],
            _mib(p),
            _ratio(p, plain.get("peak_bytes")),
            _ratio(p, native.get("peak_bytes")),
            _ms(c),
            _ratio(t, plain.get("median_step_s")),
            _ratio(t, native.get("median_step_s")),
            "" if c["tuning_s"] is None else f"{c['tuning_s']:.3f}",
            "" if c["ff_calls_per_batch"] is None else str(c["ff_calls_per_batch"]),
            c["settings"] or "",
            _budget(c),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    for c in data["configs"]:
        lines += [f"- error in `{c['label']}`: {e}" for e in c["errors"]]
    return lines + [""]


def targets_table(targets: list[dict[str, Any]]) -> list[str]:
    lines = ["| target | workload | measured | limit | met |", "|---|---|---:|---:|---|"]
    for t in targets:
        measured, limit = t["measured"], t["limit"]
        if limit is None:
            value, verdict = "", f"reported: {t['detail']}"
        elif measured is None:
            value, verdict = "—", "not measured"
        else:
            value = f"{measured:.3f}"
            over = measured / limit - 1
            verdict = "yes" if t["met"] else "**no**"
            verdict += f", missed by {measured - limit:.3f} ({over:.1%} over the limit)" if measured > limit else ""
            verdict += f"; {t['detail']}" if t["detail"] else ""
        lines.append(
            f"| {t['target']} | {t['workload']} | {value} | {'' if limit is None else f'{limit:.2f}'} | {verdict} |"
        )
    return lines


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [
        f"# Benchmark: {meta['suite']} suite on {meta['device']}",
        "",
        f"torch {meta['torch']}, lightning {meta['lightning']}, diffusers {meta['diffusers']}, transformers"
        f" {meta['transformers']}; {meta['threads']} CPU thread(s); {meta['rounds']} round(s) x {meta['steps']} timed"
        f" step(s) per configuration; wall time {meta['wall_s']:.0f} s. Peaks: `PeakMemory` after MemOpt, steady"
        f" batches ({meta['peak_kind']}); a budget is met when every batch, the first included, stays within it. Step"
        " times: median of steady batches in separate timing runs without exact accounting, configurations"
        " interleaved round-robin. Tuning: the wall time of MemOpt's dry runs before the first batch (timing runs)."
        " Budgets lie 25% (tight) and 75% (loose) of the way from the lowest peak measured (native or finest"
        " chunking) to the plain peak.",
        "",
    ]
    for name, data in results["workloads"].items():
        lines += workload_table(name, data)
    lines += ["## Targets", "", *targets_table(results["targets"]), ""]
    return "\n".join(lines)


def write(results: dict[str, Any], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    suite = results["meta"]["suite"]
    json_path, md_path = out / f"{suite}.json", out / f"{suite}.md"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    md_path.write_text(markdown(results))
    return json_path, md_path


# plots -------------------------------------------------------------------------------------------------------------

#: Marker, colour and legend label per configuration (the uniform grid is drawn as a grey curve labelled by k).
STYLE = {
    "plain": ("s", "black", "plain"),
    "native": ("D", "tab:orange", "native (the library's switch by hand)"),
    "memopt": ("*", "tab:green", "MemOpt()"),
    "budget_tight": ("^", "tab:red", "MemOpt(memory_budget=tight)"),
    "budget_loose": ("^", "tab:purple", "MemOpt(memory_budget=loose)"),
    "auto_tight": ("v", "tab:red", "MemOpt(checkpointing='auto', memory_budget=tight)"),
    "auto_loose": ("v", "tab:purple", "MemOpt(checkpointing='auto', memory_budget=loose)"),
}


def plots(results: dict[str, Any], out: Path) -> list[Path]:
    """Per video workload: peak and step time against the uniform chunk size, and the memory/time trade-off curve,
    with the tuner's choices marked. For every workload: memory against time for all configurations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suite, written = results["meta"]["suite"], []
    for name, data in results["workloads"].items():
        uniform = [c for c in _points(data) if c["chunk_size"]]
        if not uniform:
            continue
        fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
        _against_chunk_size(left, name, data, uniform)
        _scatter(right, data)
        right.set_title(f"{name}: trade-off over uniform chunk sizes (grey, labelled by k)")
        right.legend(fontsize=7)
        fig.tight_layout()
        written.append(out / f"{suite}_{name}_chunks.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

    names = list(results["workloads"])
    cols = min(3, len(names))
    rows = len(names) // cols + 1  # one cell more than needed: the shared legend
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4.2 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        _scatter(ax, results["workloads"][name])
        ax.set_title(f"{name} ({results['workloads'][name]['stage']})")
    handles = {label: h for ax in axes.flat for h, label in zip(*ax.get_legend_handles_labels(), strict=True)}
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    list(axes.flat)[-1].legend(handles.values(), handles.keys(), loc="center", fontsize=8)
    fig.suptitle("peak memory against median step time, every configuration")
    fig.tight_layout()
    written.append(out / f"{suite}_scatter.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written


def _points(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in data["configs"] if c["peak_bytes"] and c["median_step_s"]]


def _against_chunk_size(ax: Any, name: str, data: dict[str, Any], uniform: list[dict[str, Any]]) -> None:
    """Peak (left axis) and step time (right axis) over the uniform grid; plain and the tuner's choice as lines."""
    by = {c["name"]: c for c in data["configs"]}
    sizes = [c["chunk_size"] for c in uniform]
    ax.plot(sizes, [c["peak_bytes"] / MIB for c in uniform], "o-", color="tab:blue", label="peak, uniform")
    ax.set(xscale="log", xlabel="uniform chunk size k: MemOpt(chunk_size=k)", ylabel="peak MiB")
    ax.set_xticks(sizes, [str(s) for s in sizes])
    twin = ax.twinx()
    twin.plot(sizes, [c["median_step_s"] * 1000 for c in uniform], "s--", color="tab:orange", label="time, uniform")
    twin.set_ylabel("median step ms")
    for key, style in (("plain", ":"), ("memopt", "-.")):
        c = by.get(key, {})
        if c.get("peak_bytes") and c.get("median_step_s"):
            tag = "plain" if key == "plain" else "tuner's choice, MemOpt()"
            ax.axhline(c["peak_bytes"] / MIB, color="tab:blue", ls=style, lw=1, label=f"peak, {tag}")
            twin.axhline(c["median_step_s"] * 1000, color="tab:orange", ls=style, lw=1, label=f"time, {tag}")
    lines = [a.get_legend_handles_labels() for a in (ax, twin)]
    ax.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], fontsize=7, loc="center right")
    ax.set_title(f"{name}: peak and step time against chunk size\ntuner: {by['memopt']['settings']}", fontsize=9)


def _scatter(ax: Any, data: dict[str, Any]) -> None:
    """Memory against time: the uniform grid as a grey curve (labelled by k, equal peaks labelled once), the other
    configurations with their markers; budgets as dotted lines."""
    points = _points(data)
    uniform = [c for c in points if c["chunk_size"]]
    if uniform:
        xs, ys = [c["median_step_s"] * 1000 for c in uniform], [c["peak_bytes"] / MIB for c in uniform]
        ax.plot(xs, ys, "o-", color="grey", ms=4, lw=1, label="MemOpt(chunk_size=k), uniform")
        groups: dict[int, list[int]] = {}
        for c in uniform:
            groups.setdefault(c["peak_bytes"], []).append(c["chunk_size"])
        for peak, ks in groups.items():
            x = min(c["median_step_s"] for c in uniform if c["peak_bytes"] == peak) * 1000
            text = f"k={ks[0]}" if len(ks) == 1 else f"k={min(ks)}..{max(ks)}"
            ax.annotate(text, (x, peak / MIB), fontsize=7, xytext=(4, 4), textcoords="offset points")
    for c in points:
        if c["name"] in STYLE:
            marker, colour, label = STYLE[c["name"]]
            size = 13 if marker == "*" else 8
            ax.plot(c["median_step_s"] * 1000, c["peak_bytes"] / MIB, marker, color=colour, ms=size, label=label)
    for key, budget in data["budgets"].items():
        ax.axhline(budget / MIB, ls=":", lw=1, color="black")
        ax.annotate(f"budget {key}", (0.01, budget / MIB), xycoords=("axes fraction", "data"), fontsize=7, va="bottom")
    ax.set(xlabel="median step ms", ylabel="peak MiB")
