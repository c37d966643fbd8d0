"""Benchmark MemOpt against plain runs and the libraries' own switches: peak memory, step time, tuning cost.

    python -m benchmarks.run --quick --plots    # the quick suite on CPU, one thread (14 to 21 minutes), with plots
    python -m benchmarks.run --quick --smoke    # one round at the smallest sizes (CI: keeps the suite running)
    python -m benchmarks.run --device cuda      # the full suite on a GPU, peaks from the allocator's counters

Results go to ``<out>/<suite>.json`` and ``<out>/<suite>.md`` (suite: smoke, quick or full). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
import time
from pathlib import Path

import torch

from benchmarks import report
from benchmarks.suite import SUITES, log, measure_workload, targets
from benchmarks.workloads import WORKLOADS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 rounds: 14-21 min, 1 thread")
    parser.add_argument("--smoke", action="store_true", help="with --quick: the smallest sizes, one round")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--plots", action="store_true", help="write PNG plots (needs matplotlib)")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: 1 on CPU, see README)")
    args = parser.parse_args()
    if args.smoke and not args.quick:
        parser.error("--smoke is a variant of the quick suite: pass --quick --smoke")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.plots and importlib.util.find_spec("matplotlib") is None:  # said before the suite runs, not after it
        parser.error(
            '--plots needs matplotlib, which the bench extra installs: pip install -c constraints.txt -e ".[bench]"'
        )
    suite = "smoke" if args.smoke else "quick" if args.quick else "full"
    threads = args.threads or (1 if args.device == "cpu" else torch.get_num_threads())
    torch.set_num_threads(threads)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")

    started = time.perf_counter()
    workloads = {}
    for name in args.workloads:
        log(f"{name} ({suite}, {args.device})")
        began = time.perf_counter()
        workloads[name] = measure_workload(name, suite, device)
        workloads[name]["wall_s"] = time.perf_counter() - began
        log(f"{name} done in {workloads[name]['wall_s']:.0f} s")
    results = {
        "meta": {
            "suite": suite,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "peak_kind": "allocator max_memory_allocated" if device.type == "cuda" else "exact CPU bytes",
            "threads": threads,
            **{p: importlib.metadata.version(p) for p in ("torch", "lightning", "diffusers", "transformers", "peft")},
            **SUITES[suite],
            "wall_s": time.perf_counter() - started,
        },
        "workloads": workloads,
        "targets": targets(workloads),
    }
    json_path, md_path = report.write(results, args.out)
    log(f"wrote {json_path} and {md_path} in {results['meta']['wall_s']:.0f} s")
    if args.plots:
        for path in report.plots(results, args.out):
            log(f"wrote {path}")
    errors = [e for data in workloads.values() for c in data["configs"] for e in c["errors"]]
    if errors:
        log(f"{len(errors)} run(s) failed; see {md_path}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
