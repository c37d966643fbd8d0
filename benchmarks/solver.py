"""The planner's solver alone: the time to choose one setting per row under a target, against the number of rows and
of whole-step mixes, on synthetic cost tables (no model, no dry run). Each row is a block with four settings (none,
attention, finer, full): the bytes it keeps fall and its cost rises setting by setting, with a little noise so no two
rows are alike; each whole-step mix saves some bytes and adds some seconds.

    python -m benchmarks.solver            # rows 8..256, mixes 1..512
    python -m benchmarks.solver --smoke    # the smallest sizes (CI)

Results: ``<out>/solver.json`` and ``<out>/solver.md``. Nothing about time is asserted.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from lightning_memopt.techniques.planner import Option, solve_many

RESULTS = Path(__file__).resolve().parent / "results"


def table(rows: int, seed: int = 0) -> tuple[list[list[Option]], int]:
    """``rows`` rows of four options, and the peak outside them."""
    rng = random.Random(seed)
    built = []
    for _ in range(rows):
        kept = rng.randint(900_000, 1_100_000)
        window = rng.randint(400_000, 600_000)
        built.append(
            [
                Option(setting, int(kept * share), int(window * (1 + share)), 1.0 + extra + rng.random() * 0.01)
                for setting, share, extra in (
                    ("none", 1.0, 0.0),
                    ("attention", 0.6, 0.1),
                    ("finer", 0.4, 0.2),
                    ("full", 0.05, 0.35),
                )  # fmt: skip
            ]
        )
    return built, 2_000_000


def time_one(rows: int, mixes: int) -> dict[str, float]:
    options, outside = table(rows)
    everything = sum(o[0].kept for o in options) + outside
    target = everything // 2
    saved = [target * i // (4 * max(mixes, 1)) for i in range(mixes)]
    started = time.perf_counter()
    solved = solve_many(options, [], [], outside, [target + s for s in saved])
    seconds = time.perf_counter() - started
    return {"rows": rows, "mixes": mixes, "seconds": seconds, "found": sum(s is not None for s in solved)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the smallest sizes only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    sizes = [(8, 1), (32, 16)] if args.smoke else [(r, m) for r in (8, 32, 100, 256) for m in (1, 16, 512)]
    results = [time_one(rows, mixes) for rows, mixes in sizes]
    name = "solver_smoke" if args.smoke else "solver"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=1))
    lines = ["| rows | whole-step mixes | solve time (s) | mixes with a choice |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['rows']} | {r['mixes']} | {r['seconds']:.3f} | {r['found']} |" for r in results]
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
