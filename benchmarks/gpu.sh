#!/usr/bin/env bash
# The GPU checks, in one go on a fresh GPU machine, within 8 minutes (each step under `timeout`):
#   1. the facts: nvidia-smi, the python chosen, its torch, CUDA and library versions;
#   2. the CUDA tests: pytest -m cuda tests/test_cuda.py, their figures (the dry run's peak against the allocator's);
#   3. python -m benchmarks.real_scale_gpu --device cuda --out "$OUT/scale": real-scale models (SD-1.5, SDXL LoRA,
#      Llama-3.2-1B, Llama-3-8B LoRA, Latte-1), estimate() against the allocator's peak, a budget, the blocks at the peak;
#   4. python -m benchmarks.training_state --device cuda --out "$OUT/state", if a minute or more is left;
#   5. python -m benchmarks.step_time --device cuda --out "$OUT/time", likewise (each skipped if not in the checkout);
#   6. python -m benchmarks.run --quick --device cuda --out "$OUT/quick", likewise.
# Everything lands under $OUT (default ./gpu_out): gpu.log (all the output), figures.json (the facts, each step's
# status and seconds, the test results, the CUDA figures and the real-scale summary), scale/, state/, time/, quick/.
#
#   bash benchmarks/gpu.sh                    # on the GPU machine, from any folder
#   MEMOPT_GPU_DRY=1 bash benchmarks/gpu.sh   # the same flow on CPU (tests on CPU, smoke sizes): checks this script
#   bash benchmarks/gpu.sh --fetch-wheels     # on a machine with PyPI: wheels of what a GPU image may lack, in .whl/
#
# Python: the first whose torch sees CUDA among $MEMOPT_PYTHON, the repo's .venv and the python3/python on PATH
# (outside .venv). The checkout goes on PYTHONPATH (no install needed); wheels in .whl/ ($MEMOPT_WHEELS) are installed
# into a scratch folder on PYTHONPATH, ahead of that python's own packages; if packages are still missing, it tries
# `pip install -c constraints.txt -e ".[test]"` with the constraints' torch pin left out (the CUDA torch stays).
# Settings: MEMOPT_GPU_BUDGET_S (default 450: the script's own seconds, all steps), MEMOPT_GPU_TESTS_S (150: they took
# 114 s on an H200), MEMOPT_GPU_SCALE_S (240), MEMOPT_GPU_STATE_S (90) and MEMOPT_GPU_TIME_S (240): the most the tests,
# real_scale_gpu.py, training_state.py and step_time.py may take; the steps after real_scale_gpu.py run only with a
# minute or more left (with the defaults, about 60 s remain for training_state.py when the tests take 115 s); the quick
# suite gets what is left. A dry run (MEMOPT_GPU_DRY=1, on CPU) defaults to 900 s and 300 s for the tests, which take
# about 2 minutes on 2 idle CPU cores. Also MEMOPT_PYTHON, MEMOPT_WHEELS, OUT.
# Exit status: 0 when the CUDA tests ran and passed, 1 otherwise (the other steps' status is in figures.json).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
WHEELS=${MEMOPT_WHEELS:-$ROOT/.whl}

if [[ ${1:-} == --fetch-wheels ]]; then
    # The wheels for CPython ${MEMOPT_WHEELS_PYTHON:-3.12} on x86-64 Linux, at the versions of this machine's python.
    py=${MEMOPT_PYTHON:-$ROOT/.venv/bin/python}
    names=(diffusers transformers peft regex huggingface_hub httpx2 httpcore2 truststore bitsandbytes) # hub >= 2.4
    specs=$("$py" -c 'import sys
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))' "${names[@]}") || exit 1
    scratch=$(mktemp -d)
    # shellcheck disable=SC2086  # one word per requirement
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "${MEMOPT_WHEELS_PYTHON:-3.12}" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$scratch" $specs || exit 1
    mkdir -p "$WHEELS"
    for name in "${names[@]}"; do rm -f "$WHEELS/$name"-*.whl; done  # one version of each
    # bitsandbytes' wheel holds a library per CUDA, ROCm and XPU version (43 MB): keep the CPU's and that of the GPU
    # image's CUDA ($MEMOPT_WHEELS_CUDA, default 130 for CUDA 13.0), so that it travels within a carry's 64 MiB
    for wheel in "$scratch"/bitsandbytes-*.whl; do
        unpacked=$(mktemp -d) && (cd "$unpacked" && unzip -q "$wheel") || exit 1
        for lib in "$unpacked"/bitsandbytes/libbitsandbytes_*.so; do
            case ${lib##*/} in libbitsandbytes_cpu.so | "libbitsandbytes_cuda${MEMOPT_WHEELS_CUDA:-130}.so") ;;
            *) rm "$lib" && sed -i "\|^bitsandbytes/${lib##*/},|d" "$unpacked"/bitsandbytes-*.dist-info/RECORD ;;
            esac
        done
        rm "$wheel" && (cd "$unpacked" && zip -q -r "$wheel" .) && rm -rf "$unpacked"
    done
    mv "$scratch"/*.whl "$WHEELS"/ && rmdir "$scratch"
    ls -l "$WHEELS"
    echo "To take them along: echo /.whl/ >> .git/info/exclude, and carry .whl with the checkout."
    exit 0
fi

DRY=${MEMOPT_GPU_DRY:-0}
[[ $DRY == 0 || -z $DRY ]] && DRY=0 || DRY=1
BUDGET=${MEMOPT_GPU_BUDGET_S:-$( ((DRY)) && echo 900 || echo 450)}
TESTS_S=${MEMOPT_GPU_TESTS_S:-$( ((DRY)) && echo 300 || echo 150)}
RESERVE=20 # seconds kept for the summary
OUT=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
WORK=$(mktemp -d) # what is summarised into figures.json: $OUT keeps to a few files
STEPS=$WORK/steps.tsv
: >"$STEPS"

say() { printf '[gpu.sh %4ss] %s\n' "$SECONDS" "$*"; }

left() { echo $((BUDGET - SECONDS - RESERVE)); }

# step NAME LIMIT_S COMMAND...: run COMMAND under timeout (LIMIT_S, or what is left if less); its status, exit code
# and seconds go to the summary.
step() {
    local name=$1 limit=$2
    shift 2
    local remaining
    remaining=$(left)
    ((limit > remaining)) && limit=$remaining
    if ((limit < 10)); then
        say "skipped $name: no time left"
        printf '%s\tskipped\t\t0\t0\tno time left\n' "$name" >>"$STEPS"
        return 0
    fi
    say "== $name (at most ${limit}s): $*"
    local start=$SECONDS rc status
    timeout -k 10 "$limit" "$@"
    rc=$?
    case $rc in
    0) status=ok ;;
    124 | 137) status=timed_out ;;
    *) status=failed ;;
    esac
    say "== $name: $status (exit $rc) in $((SECONDS - start))s"
    printf '%s\t%s\t%s\t%s\t%s\t\n' "$name" "$status" "$rc" "$((SECONDS - start))" "$limit" >>"$STEPS"
    return "$rc"
}

skipped() { # NAME WHY
    say "skipped $1: $2"
    printf '%s\tskipped\t\t0\t0\t%s\n' "$1" "$2" >>"$STEPS"
}

# python -c "import torch; assert torch.cuda.is_available()", told apart from a torch without CUDA and no torch
torch_of() {
    timeout 120 "$1" -c 'import torch; print(torch.__version__, torch.cuda.is_available())' 2>/dev/null | tail -n 1
}

choose_python() {
    local candidates=() seen=() path real found cpu=""
    [[ -n ${MEMOPT_PYTHON:-} ]] && candidates+=("$MEMOPT_PYTHON")
    if [[ -e $ROOT/.venv/bin/python ]]; then
        candidates+=("$ROOT/.venv/bin/python")
    else
        say ".venv is missing: a python on PATH must hold torch with CUDA"
    fi
    while read -r path; do
        [[ $path == "$ROOT/.venv/"* ]] || candidates+=("$path")
    done < <(type -ap python3 python 2>/dev/null)
    for path in "${candidates[@]}"; do
        real=$(command -v "$path" || echo "$path") # not resolved: a venv's python links to the system's
        [[ " ${seen[*]} " == *" $real "* ]] && continue
        seen+=("$real")
        found=$(torch_of "$path")
        case $found in
        *" True")
            say "$path: torch ${found% *} with CUDA"
            PY=$path
            return 0
            ;;
        *" False")
            say "$path: torch ${found% *} WITHOUT CUDA$([[ $path == "$ROOT/.venv/"* ]] && echo ' (the constraints pin a CPU torch): trying the system python')"
            [[ -z $cpu ]] && cpu=$path
            ;;
        *) say "$path: no torch (or it does not run here)" ;;
        esac
    done
    if ((DRY)) && [[ -n $cpu ]]; then
        PY=$cpu
        return 0
    fi
    return 1
}

missing_packages() {
    "$PY" - <<'EOF' 2>/dev/null || echo "python fails"
import importlib

missing = []
for name in ("lightning", "torchmetrics", "transformers", "diffusers", "peft", "pytest", "lightning_memopt"):
    try:
        importlib.import_module(name)
    except Exception as error:
        missing.append(f"{name} ({type(error).__name__}: {str(error)[:120]})")
print("; ".join(missing))
EOF
}

summarise() {
    local python=${PY:-python3}
    command -v "$python" >/dev/null 2>&1 || python=python3
    "$python" - "$OUT" "$WORK" "$DEVICE" "$DRY" "$BUDGET" "$SECONDS" "${PY:-}" <<'EOF'
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, work, device, dry, budget, elapsed, python = sys.argv[1:]
work = Path(work)


def read(name, parse=None):
    path = work / name
    if not path.exists():
        return None
    text = path.read_text(errors="replace")
    try:
        return parse(text) if parse else text.strip()
    except ValueError as error:
        return f"unreadable: {error}"


steps = []
for line in (read("steps.tsv") or "").splitlines():
    name, status, rc, seconds, limit, why = (line.split("\t") + [""] * 6)[:6]
    steps.append({"step": name, "status": status, "exit": int(rc) if rc else None, "seconds": int(seconds),
                  "limit_s": int(limit), **({"why": why} if why else {})})

def real_scale():
    """Each real-scale workload in a line of figures, from scale/real_scale_gpu*.json (None if it did not run)."""
    found = sorted((Path(out) / "scale").glob("real_scale_gpu*.json"))
    if not found:
        return None
    try:
        data = json.loads(found[0].read_text())
    except ValueError as error:
        return f"unreadable: {error}"
    rows = []
    for w in data.get("workloads", []):
        row = {"workload": w["name"]}
        for key in ("skipped", "failed", "stopped", "wall_s"):
            if key in w:
                row[key] = w[key]
        for config in ("plain", "memopt"):
            batches = w.get("runs", {}).get(config, {}).get("batches", [])
            real = batches[1] if len(batches) > 1 else {}
            row[config] = {"dry": w.get("estimate", {}).get(config, {}).get("peak_bytes"),
                           "allocated": real.get("allocated"), "reserved": real.get("reserved"),
                           "error": w.get("error", {}).get(config)}
        budget = w.get("budget", {})
        if "budget_bytes" in budget:
            row["budget"] = {"bytes": budget["budget_bytes"], "allocated": budget.get("allocated"),
                             "met_from_second": budget.get("met_from_second")}
        rows.append(row)
    return {"file": found[0].name, "wall_s": data.get("meta", {}).get("wall_s"), "workloads": rows}


scale = real_scale()
tests = None
if (work / "cuda_tests.xml").exists():
    root = ET.parse(work / "cuda_tests.xml").getroot()
    cases = []
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            element = case.find(kind)
            if element is not None:
                outcome = {"failure": "failed", "error": "error"}.get(kind, kind)
                message = (element.get("message") or element.text or "")[:2000]
        cases.append({"test": case.get("name"), "outcome": outcome, "seconds": float(case.get("time") or 0),
                      **({"message": message} if message else {})})
    tests = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    tests["cases"] = cases

figures = {
    "mode": "dry run on CPU (MEMOPT_GPU_DRY)" if dry == "1" else "gpu",
    "device": device,
    "python": python,
    "versions": read("versions.json", json.loads),
    "nvidia_smi": read("nvidia.csv"),
    "budget_s": int(budget),
    "elapsed_s": int(elapsed),
    "steps": steps,
    "tests": tests if tests is not None else "no results (the tests did not run or were stopped)",
    "cuda_figures": read("cuda_figures.json", json.loads),
    "real_scale": scale,
    "outputs": {d: sorted(str(p.relative_to(out)) for p in (Path(out) / d).rglob("*") if p.is_file())
                for d in ("scale", "state", "time", "quick") if (Path(out) / d).is_dir()},
}
(Path(out) / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")

print(f"[gpu.sh] figures.json written to {out}")
for s in steps:
    print(f"  {s['step']:12s} {s['status']:9s} {s['seconds']:4d} s" + (f"  ({s['why']})" if s.get("why") else ""))
if isinstance(tests, dict):
    print("  tests: " + ", ".join(f"{tests[k]} {k}" for k in ("passed", "failed", "error", "skipped")))
    for case in tests["cases"]:
        if case["outcome"] in ("failed", "error"):
            print(f"    {case['outcome']}: {case['test']}: {case.get('message', '')[:300]}")
cuda = figures["cuda_figures"]
if isinstance(cuda, dict):
    for key, row in cuda.get("estimate", {}).items():
        print(f"  estimate {key}: dry {row['dry']} B, allocated {row['allocated']} B"
              f" ({row['allocated_minus_dry']:+d} B, {row['allocated_minus_dry_fraction']:+.2%}),"
              f" requested {row['requested_minus_dry']:+d} B, {row['allocations']} allocations")
    for key, row in cuda.get("budget", {}).items():
        print(f"  budget {key}: B {row['budget']} B, requested - B {row['requested_minus_budget']},"
              f" allocated - B {row['allocated_minus_budget']}")
if isinstance(scale, dict):
    for row in scale["workloads"]:
        if "skipped" in row or "failed" in row:
            print(f"  scale {row['workload']}: {row.get('skipped') or row.get('failed')}")
            continue
        line = ", ".join(f"{c} dry {row[c]['dry']} B, allocated {row[c]['allocated']} B" +
                         (f" ({row[c]['error']:+.1%})" if row[c]["error"] is not None else "") for c in ("plain", "memopt"))
        if "budget" in row:
            line += f"; budget {row['budget']['bytes']} B met from the 2nd batch: {row['budget']['met_from_second']}"
        print(f"  scale {row['workload']}: {line}" + (f" [{row['stopped']}]" if "stopped" in row else ""))
failed = not isinstance(tests, dict) or tests["failed"] or tests["error"] or not tests["passed"]
sys.exit(1 if failed else 0)
EOF
}

main() {
    say "lightning_memopt GPU checks in $ROOT, output in $OUT, $BUDGET s$( ((DRY)) && echo ', DRY RUN on CPU')"
    DEVICE=cuda
    ((DRY)) && DEVICE=cpu

    # 1. facts
    if command -v nvidia-smi >/dev/null 2>&1; then
        timeout 30 nvidia-smi
        timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap,clocks.max.sm \
            --format=csv >"$WORK/nvidia.csv"
    else
        say "no nvidia-smi on this machine"
    fi
    PY=""
    if ! choose_python; then
        say "no python here has torch with CUDA: nothing to run (set MEMOPT_PYTHON to one that has)"
        printf 'python\tfailed\t1\t0\t0\tno torch with CUDA\n' >>"$STEPS"
        summarise
        return 1
    fi
    say "python: $PY, device: $DEVICE"

    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        step wheels 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$WORK/site" "$WHEELS"/*.whl
        export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    local missing
    missing=$(missing_packages)
    if [[ -n $missing && $PY != "$ROOT/.venv/"* ]] && ! ((DRY)); then
        say "missing: $missing; trying pip install -e .[test] (the CUDA torch kept)"
        grep -v '^torch==' constraints.txt >"$WORK/constraints.txt"
        step install 150 "$PY" -m pip install -q --retries 0 --timeout 10 -c "$WORK/constraints.txt" -e ".[test]"
        missing=$(missing_packages)
    fi
    [[ -n $missing ]] && say "still missing: $missing (carry wheels: bash benchmarks/gpu.sh --fetch-wheels)"
    "$PY" - >"$WORK/versions.json" <<'EOF'
import json
import platform
from importlib.metadata import PackageNotFoundError, version

import torch

facts = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
         "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    facts.update(gpu=props.name, capability=f"{props.major}.{props.minor}", memory_bytes=props.total_memory)
for name in ("lightning", "torchmetrics", "transformers", "diffusers", "peft", "pytest"):
    try:
        facts[name] = version(name)
    except PackageNotFoundError:
        facts[name] = None
print(json.dumps(facts))
EOF
    cat "$WORK/versions.json"

    # 2. the CUDA tests
    step cuda_tests "$TESTS_S" env MEMOPT_TEST_DEVICE="$DEVICE" MEMOPT_CUDA_FIGURES="$WORK/cuda_figures.json" \
        PYTHONUNBUFFERED=1 "$PY" -m pytest -m cuda tests/test_cuda.py -q -rfEs --durations=5 \
        --junitxml="$WORK/cuda_tests.xml"

    # 3. real scale: the script stops itself 15 s before the step's limit, so that it writes what it measured
    local smoke=()
    ((DRY)) && smoke=(--smoke)
    local scale=${MEMOPT_GPU_SCALE_S:-240}
    (($(left) < scale)) && scale=$(left)
    if [[ ! -f benchmarks/real_scale_gpu.py ]]; then
        skipped real_scale "benchmarks/real_scale_gpu.py is not in this checkout"
    elif ((scale >= 60)); then
        step real_scale "$scale" env PYTHONUNBUFFERED=1 "$PY" -m benchmarks.real_scale_gpu --device "$DEVICE" \
            --out "$OUT/scale" --budget-s $((scale - 15)) "${smoke[@]}"
    else
        skipped real_scale "less than 60 s left"
    fi

    # 4, 5. the training state and step times, each only with a minute or more left
    local name script limit
    for name in training_state time; do
        script=$([[ $name == time ]] && echo step_time || echo "$name")
        limit=$([[ $name == time ]] && echo "${MEMOPT_GPU_TIME_S:-240}" || echo "${MEMOPT_GPU_STATE_S:-90}")
        if [[ ! -f benchmarks/$script.py ]]; then
            skipped "$name" "benchmarks/$script.py is not in this checkout"
        elif (($(left) < 60)); then
            skipped "$name" "less than 60 s left"
        else
            step "$name" "$limit" env PYTHONUNBUFFERED=1 "$PY" -m "benchmarks.$script" --device "$DEVICE" \
                --out "$OUT/$([[ $name == time ]] && echo time || echo state)" "${smoke[@]}"
        fi
    done

    # 6. the quick suite, with what is left
    if (($(left) >= 60)); then
        step quick "$(left)" env PYTHONUNBUFFERED=1 "$PY" -m benchmarks.run --quick --device "$DEVICE" \
            --out "$OUT/quick" "${smoke[@]}"
    else
        skipped quick "less than 60 s left"
    fi

    summarise
}

main 2>&1 | tee "$OUT/gpu.log"
status=${PIPESTATUS[0]}
rm -rf "$WORK"
exit "$status"
