"""Dry-run coverage on diffusers' and transformers' own test configs (issue 15): for how many model classes does
``lightning_memopt.estimate`` know the baseline (the peak of the step as the model is), and how close is it to the
real step's peak?

Each case is a model class built small and real on CPU from the init arguments and inputs of its own library's test
suite (diffusers' ``get_init_dict`` / ``get_dummy_inputs`` or ``prepare_init_args_and_inputs_for_common``, read from
the diffusers repository at commit 58eb52c0 and written down as plain data in ``benchmarks/coverage_cases/``;
transformers' MoE and dense causal LMs with configs of the size of their model testers). Each is wrapped in a minimal
LightningModule whose ``training_step`` returns ``output.pow(2).mean()`` (AdamW) and whose ``predict_step`` returns
the output. For each
stage the script calls ``estimate(module, batch, stage)`` and then runs the real step in a Trainer under
``PeakMemory`` (the second training batch at fit, so that the first step's gradients and optimizer state are alive,
as the estimate assumes; the first predict batch), and compares the two byte counts.

    python -m benchmarks.coverage --out benchmarks/results/coverage.md  # 2 workers: about 9 CPU-minutes

Nothing is downloaded. ``--only NAME ...`` runs the cases whose label contains one of the names.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import multiprocessing
import re
import sys
import time
import traceback
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_memopt import PeakMemory, estimate
from lightning_memopt.reads import PLACEHOLDERS
from tests import zoo

LIBRARIES = ("diffusers", "transformers")

# inputs, as plain data ---------------------------------------------------------------------------------------------


class R:
    """A tensor of random normal values of this shape."""

    def __init__(self, *shape: int, dtype: str = "float32") -> None:
        self.shape, self.dtype = shape, getattr(torch, dtype)

    def make(self, gen: torch.Generator) -> torch.Tensor:
        return torch.randn(self.shape, generator=gen, dtype=self.dtype)


class I:  # noqa: E742
    """A tensor of random integers in ``[low, high)``."""

    def __init__(self, low: int, high: int, *shape: int, dtype: str = "int64") -> None:
        self.low, self.high, self.shape, self.dtype = low, high, shape, getattr(torch, dtype)

    def make(self, gen: torch.Generator) -> torch.Tensor:
        return torch.randint(self.low, self.high, self.shape, generator=gen).to(self.dtype)


class F:
    """A tensor of this shape filled with one value."""

    def __init__(self, value: Any, *shape: int, dtype: str = "float32") -> None:
        self.value, self.shape, self.dtype = value, shape, getattr(torch, dtype)

    def make(self, gen: torch.Generator) -> torch.Tensor:
        return torch.full(self.shape, self.value, dtype=self.dtype)


class V:
    """A tensor of these values."""

    def __init__(self, values: Any, dtype: str = "float32") -> None:
        self.values, self.dtype = values, getattr(torch, dtype)

    def make(self, gen: torch.Generator) -> torch.Tensor:
        return torch.tensor(self.values, dtype=self.dtype)


class KVCache:
    """WanAnimate2's KV cache, empty, for its reference (``extract``) pass."""

    def __init__(self, layers: int) -> None:
        self.layers = layers

    def make(self, gen: torch.Generator) -> Any:
        from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

        return WanAnimate2KVCache(self.layers)


def make(spec: Any, gen: torch.Generator) -> Any:
    """The inputs ``spec`` describes, built in order from ``gen``."""
    if hasattr(spec, "make"):
        return spec.make(gen)
    if isinstance(spec, dict):
        return {k: make(v, gen) for k, v in spec.items()}
    if isinstance(spec, (list, tuple)):
        return type(spec)(make(v, gen) for v in spec)
    return spec


@dataclass
class Case:
    """One model class built from a test config: its label, the class, where the config comes from, the init
    arguments (for transformers: the config's), and the inputs of one call."""

    label: str
    cls: str
    source: str
    init: dict[str, Any]
    inputs: dict[str, Any]
    config: str | None = None  # transformers: the config class


# the cases, as data files -------------------------------------------------------------------------------------------

#: One JSON file per library, a list of cases: ``label``, ``cls``, ``source``, ``init``, ``inputs`` and, for
#: transformers, ``config``. diffusers.json holds the model tests' own init dicts and dummy inputs
#: (tests/models/{transformers,unets}/test_models_*.py). transformers.json holds causal LMs with configs of the size of
#: their model testers (batch 13, 7 tokens, vocabulary 99); the testers' intermediate size 37 is 40 there (and the
#: experts' 16): the grouped mm of the MoE experts on CPU needs strides that are multiples of 16 bytes ("strides should
#: be multiple of 16 bytes" in the real step).
#:
#: Plain JSON values are themselves (an array is a list); objects with one of these keys are what :func:`decode`
#: makes of them: ``{"$randn": [*shape]}`` is ``R``, ``{"$randint": [low, high, *shape]}`` is ``I``, ``{"$full":
#: [value, *shape]}`` is ``F``, ``{"$tensor": values}`` is ``V`` (each with an optional ``"dtype"``), ``{"$kv_cache":
#: layers}`` is ``KVCache``, ``{"$tuple": [...]}`` a tuple and ``{"$dict": [[key, value], ...]}`` a dict whose keys
#: are not strings.
CASE_FILES = [Path(__file__).resolve().parent / "coverage_cases" / f"{library}.json" for library in LIBRARIES]

_TENSORS = {"$randn": R, "$randint": I, "$full": F, "$tensor": V}


def decode(value: Any) -> Any:
    """A value of a case file as the case holds it."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "$tuple" in value:
        return tuple(decode(v) for v in value["$tuple"])
    if "$dict" in value:
        return {decode(k): decode(v) for k, v in value["$dict"]}
    if "$kv_cache" in value:
        return KVCache(value["$kv_cache"])
    for tag, spec in _TENSORS.items():
        if tag in value:
            dtype = {"dtype": value["dtype"]} if "dtype" in value else {}
            return spec(decode(value[tag]), **dtype) if spec is V else spec(*value[tag], **dtype)
    return {k: decode(v) for k, v in value.items()}


def load(path: Path) -> list[Case]:
    with open(path) as f:
        return [
            Case(c["label"], c["cls"], c["source"], decode(c["init"]), decode(c["inputs"]), c.get("config"))
            for c in json.load(f)
        ]


CASES = [case for path in CASE_FILES for case in load(path)]

# the step -----------------------------------------------------------------------------------------------------------


def build(case: Case) -> torch.nn.Module:
    torch.manual_seed(0)
    return zoo.build(case.cls, case.init, case.config)


def first_tensor(output: Any) -> torch.Tensor | None:
    """The model's main output: the tensor itself, ``.sample``, a ModelOutput's first field, a tuple's first tensor."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(getattr(output, "sample", None), torch.Tensor):
        return output.sample
    values = output.values() if hasattr(output, "values") and callable(output.values) else output
    if isinstance(values, (list, tuple)) or hasattr(output, "values"):
        for value in values:
            if (found := first_tensor(value)) is not None:
                return found
    return None


class Step(pl.LightningModule):
    """A minimal LightningModule around one model: the loss is the mean square of its output."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.model = build(case)

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        output = first_tensor(self.model(**batch))
        if output is None:
            raise RuntimeError("the model returned no tensor")
        return output

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return self(batch).pow(2).mean()

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return self(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def batch_of(case: Case) -> dict[str, Any]:
    """A fresh batch: the same values every time (stateful inputs, such as a KV cache, start empty)."""
    return make(case.inputs, torch.Generator().manual_seed(0))


class Batches(Dataset):
    def __init__(self, case: Case, n: int) -> None:
        self.case, self.n = case, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return batch_of(self.case)


def _as_is(items: list[Any]) -> Any:
    return items[0]


class LastBatch(PeakMemory):
    """``PeakMemory`` on the last training batch only: the first runs at full speed, unprobed."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch = batch

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.batch:
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)


def real_peak(case: Case, stage: str) -> int:
    """The real step's peak in bytes, exactly, from ``PeakMemory`` in a Trainer (fit: the second batch)."""
    n = 2 if stage == "fit" else 1
    probe = LastBatch(n - 1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_train_batches=n, limit_predict_batches=n,
        callbacks=[probe],
    )  # fmt: skip
    loader = DataLoader(Batches(case, n), batch_size=1, collate_fn=_as_is)
    module = Step(case)
    if stage == "fit":
        trainer.fit(module, train_dataloaders=loader)
    else:
        trainer.predict(module, dataloaders=loader)
    return probe.peaks[-1]


@dataclass
class Row:
    label: str
    cls: str
    stage: str
    dry: int | None = None
    real: int | None = None
    note: str = ""
    placeholders: str = ""
    error: str = ""  # the real step (or building the model) failed: the case says nothing of the dry run
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def diff(self) -> float | None:
        if self.dry is None or not self.real:
            return None
        return 100.0 * (self.dry - self.real) / self.real


def _short(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}"[:200]


def run_case(case: Case, stage: str) -> Row:
    row = Row(case.label, case.cls, stage)
    started = time.perf_counter()
    try:
        module = Step(case)
    except Exception as error:
        row.error = f"building the model: {_short(error)}"
        return row
    try:
        result = estimate(module, batch_of(case), stage=stage)
        row.dry, row.notes = result.plain.bytes, list(result.notes)
        for note in result.notes:
            if note.startswith(PLACEHOLDERS):
                found = re.search(r"\((.*?)\): zeros", note)
                row.placeholders = found.group(1) if found else note
            elif note.startswith("the dry run"):
                row.note = note
    except Exception as error:
        row.note = f"estimate raised {_short(error)}"
        row.notes = [traceback.format_exc()]
    try:
        row.real = real_peak(case, stage)
    except Exception as error:
        row.error = f"the real step: {_short(error)}"
    row.seconds = time.perf_counter() - started
    return row


# the report ---------------------------------------------------------------------------------------------------------


def _bytes(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def totals(rows: list[Row]) -> list[str]:
    lines = []
    for stage in ("fit", "predict"):
        valid = [r for r in rows if r.stage == stage and not r.error]
        known = [r for r in valid if r.dry is not None]
        exact = [r for r in known if r.dry == r.real]
        close = [r for r in known if abs(r.diff) <= 1.0]
        placed = [r for r in known if r.placeholders]
        share = f"{100 * len(known) / len(valid):.1f}%" if valid else "-"
        lines.append(f"| {stage} | {len(known)}/{len(valid)} ({share}) | {len(exact)} | {len(close)} | {len(placed)} |")
    return lines


def markdown(rows: list[Row], seconds: float, argv: list[str], jobs: int) -> str:
    import diffusers
    import transformers

    classes = {r.cls for r in rows if not r.error}
    out = [
        "# Dry-run coverage on diffusers' and transformers' own test configs",
        "",
        f"`python -m benchmarks.coverage {' '.join(argv)}`: {len({r.label for r in rows})} cases, {len(classes)} model"
        f" classes; torch {torch.__version__}, diffusers {diffusers.__version__}, transformers"
        f" {transformers.__version__}; CPU, {jobs} worker processes; {seconds:.0f} s.",
        "",
        "The baseline is `estimate(...).plain.bytes` (the step as the model is); the real peak is `PeakMemory` in a",
        "Trainer (fit: the second batch, AdamW state and the first step's gradients alive; predict: the first batch).",
        "Difference: (dry run - real) / real. *Placeholders*: values read out of fake tensors that the dry run",
        "answered with placeholders (zeros, data-dependent shapes at their upper bound).",
        "",
        "## Totals",
        "",
        "| stage | baseline known | exact (0%) | within 1% | known with placeholders |",
        "|---|---|---|---|---|",
        *totals(rows),
    ]
    failed = [r for r in rows if r.error]
    if failed:
        out += ["", "Cases left out of the totals (the real step itself fails in this environment):", ""]
        out += [f"- {r.label}, {r.stage}: {_cell(r.error)}" for r in failed]
    unknown = [r for r in rows if not r.error and r.dry is None]
    out += ["", "## Baseline unknown", ""]
    out += [f"- {r.label}, {r.stage}: {_cell(r.note)}" for r in unknown] or ["None."]
    off = [r for r in rows if not r.error and r.dry is not None and abs(r.diff) > 1.0]
    out += ["", "## More than 1% from the real peak", ""]
    out += [
        f"- {r.label}, {r.stage}: dry run {_bytes(r.dry)} B, real {_bytes(r.real)} B ({r.diff:+.2f}%)"
        + (f"; placeholders {r.placeholders}" if r.placeholders else "")
        for r in off
    ] or ["None."]
    out += [
        "",
        "## Every case",
        "",
        "| class (config) | stage | baseline known | dry run (bytes) | real (bytes) | difference | placeholders"
        " | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        known = "-" if r.error else ("yes" if r.dry is not None else "**no**")
        diff = "-" if r.diff is None else ("0 (exact)" if r.dry == r.real else f"{r.diff:+.3f}%")
        note = r.error and f"left out: {r.error}" or r.note
        out.append(
            f"| {r.label} | {r.stage} | {known} | {_bytes(r.dry)} | {_bytes(r.real)} | {diff} |"
            f" {_cell(r.placeholders)} | {_cell(note)} |"
        )
    return "\n".join(out) + "\n"


def run_both(index: int, stages: list[str], threads: int) -> list[Row]:
    """Both stages of one case, in a worker process, its prints swallowed."""
    torch.set_num_threads(threads)
    quiet()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return [run_case(CASES[index], stage) for stage in stages]


def quiet() -> None:
    warnings.simplefilter("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "diffusers", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)  # meta failures the note reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the Markdown report here")
    parser.add_argument("--only", nargs="*", default=None, help="run the cases whose label contains one of these")
    parser.add_argument("--stages", nargs="*", default=["fit", "predict"])
    parser.add_argument("--jobs", type=int, default=2, help="worker processes, one case each at a time")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    args = parser.parse_args(argv)
    quiet()
    chosen = [i for i, c in enumerate(CASES) if not args.only or any(o.lower() in c.label.lower() for o in args.only)]
    started, done = time.perf_counter(), {}
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        futures = {pool.submit(run_both, i, args.stages, args.threads): i for i in chosen}
        for future in as_completed(futures):
            done[futures[future]] = future.result()
            for row in done[futures[future]]:
                known = "known" if row.dry is not None else "UNKNOWN"
                diff = "" if row.diff is None else f" {row.diff:+.3f}%"
                print(
                    f"{row.seconds:6.1f}s {row.label:60s} {row.stage:8s} {known:8s} dry={_bytes(row.dry)} real="
                    f"{_bytes(row.real)}{diff} {row.placeholders} {row.note} {row.error}",
                    flush=True,
                )
    rows = [row for i in chosen for row in done[i]]
    seconds = time.perf_counter() - started
    report = markdown(rows, seconds, sys.argv[1:] if argv is None else argv, args.jobs)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    print("\n".join(totals(rows)))
    print(f"{seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
