"""MkDocs hook: build the tables of ``models.md`` from the adapters' own tables and the installed libraries, and
include the committed result tables of ``benchmarks/results`` in ``results.md``.

Nothing in those tables is typed by hand. The placeholder comment in ``models.md`` is replaced, on every build, by
tables made from ``lightning_memopt.adapters`` (``ADAPTERS``, ``CHUNK_BLOCKS``, ``CHECKPOINT_ATTRIBUTES``,
``CHUNK_ATTRIBUTES``, ``FEED_FORWARD_SUFFIXES``, ``NOT_POSITION_WISE``) and from the classes of the installed
``diffusers.models``. Imports happen inside the hook, so that loading mkdocs.yml stays cheap.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import logging
import pkgutil
import sys
import warnings
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

PLACEHOLDER = "<!-- memopt:model-tables -->"
log = logging.getLogger("mkdocs.hooks.memopt")


#: Replaced by the benchmark suite's quick tables (benchmarks/results/quick.md), as committed.
BENCHMARK_PLACEHOLDER = "<!-- memopt:benchmark-quick -->"
#: Replaced by the real-scale estimates, as committed: a compact table made from benchmarks/results/real_scale.json,
#: then the full table, benchmarks/results/real_scale.md, folded. Both are written by one run of
#: ``python examples/estimate_real_scale.py --markdown benchmarks/results/real_scale.md --json
#: benchmarks/results/real_scale.json``; the plot on the page is made from the JSON by benchmarks/plot_real_scale.py.
REAL_SCALE_PLACEHOLDER = "<!-- memopt:real-scale -->"
RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
#: Put above quick tables that still count trial batches (a "tuning batches" column): they predate dry-run tuning.
OLDER_BENCHMARK = (
    '\n!!! warning "Written before tuning moved to dry runs"\n'
    '    These tables were produced by an earlier version of MemOpt, which tuned on trial batches: their "tuning\n'
    '    batches" column counts those, and their budget verdicts leave out the first batches. They will be\n'
    "    regenerated with `python -m benchmarks.run --quick --plots`.\n"
)


#: The benchmark's plots, shown on the results page (copied into the site under ``benchmark/``).
PLOTS = {
    "quick_scatter.png": "Peak memory against step time, every configuration of every workload",
    "quick_latte_chunks.png": "Latte-style model: peak and time against the uniform chunk size, MemOpt's choice marked",
    "quick_svd_unet_chunks.png": "SVD-style UNet: peak and time against the uniform chunk size, MemOpt's choice marked",
}


def on_files(files: Any, config: Any, **kwargs: Any) -> Any:
    """Serve the benchmark's plots with the pages."""
    from mkdocs.structure.files import File

    for name in PLOTS:
        if (RESULTS / name).exists():
            files.append(File(f"benchmark/{name}", str(RESULTS), config["site_dir"], config["use_directory_urls"]))
            files.get_file_from_path(f"benchmark/{name}").abs_src_path = str(RESULTS / name)
    return files


def _plots() -> str:
    """Each plot as a link to itself, so that a reader can open it at full size (the page shows it smaller)."""
    shown = [f"[![{caption}](benchmark/{name})](benchmark/{name})\n\n*{caption}.*" for name, caption in PLOTS.items()]
    return "Click a plot to open it at full size.\n\n" + "\n\n".join(shown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **kwargs: Any) -> str:
    if BENCHMARK_PLACEHOLDER in markdown:
        body = (RESULTS / "quick.md").read_text().split("\n", 1)[1]  # without its title: the page has its own
        if "| tuning batches |" in body:  # written before tuning moved to dry runs
            body = OLDER_BENCHMARK + body
        body = _narrow_tables(body.replace("\n# ", "\n## ").replace("\n### ", "\n#### "))
        markdown = markdown.replace(BENCHMARK_PLACEHOLDER, f"### Plots\n\n{_plots()}\n\n{body}")
    if REAL_SCALE_PLACEHOLDER in markdown:
        markdown = markdown.replace(REAL_SCALE_PLACEHOLDER, _real_scale())
    if PLACEHOLDER not in markdown:
        return markdown
    return markdown.replace(PLACEHOLDER, _tables())


#: The benchmark tables' columns, as two tables that each fit the page: what a configuration costs in memory, and in
#: time. Each keeps the configuration column; a column empty on every row of a workload is left out.
MEMORY_COLUMNS = ("configuration", "peak MiB", "peak × plain", "peak × native", "budget MiB (every batch)")
TIME_COLUMNS = ("configuration", "step ms (median)", "time × plain", "time × native", "tuning s (dry runs)")
TIME_COLUMNS += ("FF calls/batch", "settings")


def _narrow_tables(markdown: str) -> str:
    """Split each benchmark table (11 columns, wider than the page) into a memory table and a time table."""
    out: list[str] = []
    lines = markdown.split("\n")
    i = 0
    while i < len(lines):
        if not (lines[i].startswith("| configuration |") and "step ms (median)" in lines[i]):
            out.append(lines[i])
            i += 1
            continue
        end = i + 2
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[i:end]]
        header, align, rows = cells[0], cells[1], cells[2:]
        for title, wanted in (("Memory", MEMORY_COLUMNS), ("Time", TIME_COLUMNS)):
            keep = [header.index(c) for c in wanted if c in header]
            keep = [k for k in keep if k == 0 or any(row[k] for row in rows)]
            out += [f"*{title}:*", ""]
            out += ["| " + " | ".join(row[k] for k in keep) + " |" for row in (header, align, *rows)]
            out.append("")
        i = end
    return "\n".join(out)


def _real_scale() -> str:
    """The real-scale estimates: six columns from the JSON for the first table's rows (the full fine-tunes' own table
    is on the page), and every column of the markdown tables in a fold."""
    from lightning_memopt.units import fmt_bytes, fmt_parts

    full = (RESULTS / "real_scale.md").read_text().strip()
    folded = '??? note "All columns"\n\n' + "\n".join("    " + line if line else "" for line in full.split("\n"))
    path = RESULTS / "real_scale.json"
    if not path.exists():
        log.warning("results.md: %s is missing: only the full real-scale table is shown", path.name)
        return full
    rows = [r for r in json.loads(path.read_text())["rows"] if r.get("table", "main") == "main"]
    first = full.split("\n\n")[0].split("\n")  # the first table: its heading, alignment and rows
    header = [c.strip() for c in first[0].split("|")[1:-1]]
    columns = [header.index(name) for name in ("model and step", "stage", "budget", "plain peak")]
    written = [[c.strip() for c in line.split("|")[1:-1]] for line in first[2:]]
    same = [[cells[k] for k in columns] for cells in written] == [
        [r["title"], r["stage"], r["budget"], fmt_bytes(r["plain"]["peak_bytes"])] for r in rows
    ]
    if not same:
        log.warning("results.md: real_scale.json and real_scale.md are not from the same run: write both at once")

    def row(r: dict[str, Any]) -> tuple[str, ...]:
        scenario = r["title"] + (f", budget {r['budget']}" if r["budget"] != "none" else "")
        forced = [f"{k}=True" for k, v in r.get("options", {}).items() if v is True and k != "lossy"]
        if r.get("options", {}).get("lossy"):  # a lossy twin has its exact row's title: say which it is
            scenario += ", lossy" + (f" ({', '.join(forced)})" if forced else "")
        saved = f"{r['saved_fraction']:.0%}" if r["saved_fraction"] is not None else "unknown"
        where = f"{r['plain']['where']} → {r['memopt']['where']}"
        held = fmt_parts(r["memopt"].get("by_kind", {}))
        plain, memopt = fmt_bytes(r["plain"]["peak_bytes"]), fmt_bytes(r["memopt"]["peak_bytes"])
        return scenario, plain, memopt, saved, where, held or "unknown"

    table = [
        "| scenario | plain peak | with MemOpt | saved | peak in: plain → MemOpt | held at MemOpt's peak |",
        "|---|---:|---:|---:|---|---|",
    ]
    table += ["| " + " | ".join(row(r)) + " |" for r in rows]
    return "\n".join(table) + f"\n\n{folded}"


# helpers ------------------------------------------------------------------------------------------------------------


def _code(values: Iterable[Any]) -> str:
    return ", ".join(f"`{v}`" for v in values) or "none"


def _table(header: tuple[str, ...], rows: Iterable[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _summary(obj: Any) -> str:
    """The first paragraph of an object's docstring, for a table cell, its Sphinx roles (``:func:`name```) shown as
    code spans, as the API reference shows them (``griffe_rst.py``)."""
    doc = inspect.getdoc(obj) or ""
    return _sphinx_roles(" ".join(doc.split("\n\n")[0].split())).replace("|", "\\|")


@cache
def _roles() -> Any:
    """The API reference's griffe extension (``docs/griffe_rst.py``), loaded from its file: the docs folder is not a
    package, and it is the one place that says how a Sphinx role reads in these pages."""
    spec = importlib.util.spec_from_file_location("griffe_rst", Path(__file__).with_name("griffe_rst.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sphinx_roles(text: str) -> str:
    roles = _roles()
    return roles._ROLE.sub(roles._code, text)


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


@cache
def _diffusers_classes() -> tuple[type, ...]:
    """Every class defined in a module of the installed ``diffusers.models`` (cached: importing them takes seconds)."""
    import diffusers.models
    from diffusers.utils import logging as diffusers_logging

    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    found: list[type] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prefix = diffusers.models.__name__ + "."
            for info in pkgutil.walk_packages(diffusers.models.__path__, prefix):
                try:
                    module = importlib.import_module(info.name)
                except Exception as error:  # a module that needs an optional library: say which, go on
                    log.info("models.md: skipped %s (%s)", info.name, error)
                    continue
                found += [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == module.__name__]
    finally:
        diffusers_logging.set_verbosity(verbosity)
    return tuple(sorted(found, key=lambda c: (c.__module__, c.__name__)))


# the tables ---------------------------------------------------------------------------------------------------------


def _adapters() -> str:
    from lightning_memopt.adapters import ADAPTERS, GENERIC

    rows = []
    for index, adapter in enumerate([*ADAPTERS, GENERIC], start=1):
        cls = type(adapter)
        covers = _summary(cls) + " " + _summary(sys.modules[cls.__module__])
        rows.append((str(index), f"`{adapter.name}`", f"`{cls.__module__}.{cls.__name__}`", covers))
    return _table(("order", "adapter", "class", "claims, and uses"), rows)


def _diffusers() -> str:
    from lightning_memopt.adapters import hf_diffusers
    from lightning_memopt.adapters.torch_generic import FEED_FORWARD_SUFFIXES, NOT_POSITION_WISE

    def is_feed_forward_name(name: str) -> bool:
        return not name.startswith(NOT_POSITION_WISE)

    try:
        classes = _diffusers_classes()
        from diffusers import ModelMixin
    except ImportError as error:
        log.warning("models.md: diffusers cannot be imported (%s); its tables are missing", error)
        return "!!! warning\n    diffusers was not installed where these pages were built: its tables are missing.\n"

    models = [c for c in classes if issubclass(c, ModelMixin) and c is not ModelMixin]
    switch = [c for c in models if getattr(c, "_supports_gradient_checkpointing", False) is True]
    no_switch = [c for c in models if c not in switch]
    blocks = [c for c in classes if callable(getattr(c, "set_chunk_feed_forward", None))]
    feed_forward = [
        c for c in classes if c.__name__.endswith(FEED_FORWARD_SUFFIXES) and is_feed_forward_name(c.__name__)
    ]

    def dims(block: type) -> tuple[str, str]:
        if block.__name__ in hf_diffusers.CHUNK_BLOCKS:
            allowed, lengths = hf_diffusers.CHUNK_BLOCKS[block.__name__]
            return _code(allowed), f"`CHUNK_BLOCKS` entry (`{lengths.__name__}`)"
        return _code((0, 1)), "`hidden_states` (default)"

    def block_row(block: type) -> tuple[str, ...]:
        own_dim = "dim" in inspect.signature(block.set_chunk_feed_forward).parameters
        return (f"`{block.__name__}`", f"`{block.__module__}`", *dims(block), "yes" if own_dim else "no")

    parts = [
        f"Generated from diffusers {_version('diffusers')}.",
        "### Checkpointing: `enable_gradient_checkpointing()`",
        f"The attributes MemOpt saves before the switch and puts back afterwards (`CHECKPOINT_ATTRIBUTES`): "
        f"{_code(hf_diffusers.CHECKPOINT_ATTRIBUTES)}.",
        f"{len(switch)} `ModelMixin` subclasses in `diffusers.models` set `_supports_gradient_checkpointing = True`; "
        "MemOpt calls their own switch:",
        _table(("model class", "module"), ((f"`{c.__name__}`", f"`{c.__module__}`") for c in switch)),
        f"The other {len(no_switch)} `ModelMixin` subclasses get the generic technique, which checkpoints the blocks "
        f"of their repeated stacks: {_code(c.__name__ for c in no_switch)}.",
        "### Chunking: each block's `set_chunk_feed_forward()`",
        f"The attributes MemOpt saves and puts back (`CHUNK_ATTRIBUTES`): {_code(hf_diffusers.CHUNK_ATTRIBUTES)}. "
        "The classes in `diffusers.models` that have `set_chunk_feed_forward`, the dims MemOpt may chunk in each "
        "(`0` batch, `1` sequence, unless the block's own `CHUNK_BLOCKS` entry says otherwise), where those lengths "
        "are read, and whether the block's switch takes a `dim`:",
        _table(("block class", "module", "dims", "lengths from", "takes `dim`"), (block_row(b) for b in blocks)),
        "Inside blocks without that switch (Flux, Wan, ...), the outermost modules whose class name ends with one of "
        f"`FEED_FORWARD_SUFFIXES` ({_code(FEED_FORWARD_SUFFIXES)}) get the generic chunking. In the installed "
        "diffusers these are:",
        _table(("class", "module"), ((f"`{c.__name__}`", f"`{c.__module__}`") for c in feed_forward)),
    ]
    return "\n\n".join(parts)


def _transformers() -> str:
    from lightning_memopt.adapters import hf_transformers
    from lightning_memopt.adapters.torch_generic import FEED_FORWARD_SUFFIXES, NOT_POSITION_WISE

    installed = _version("transformers")
    if installed == "not installed":
        installed = "transformers is not installed where these pages were built"
    else:
        installed = f"MemOpt calls `activation_checkpointing_enable()` (transformers {installed} installed here)"
    rows = [
        (
            "checkpointing",
            "models with `supports_gradient_checkpointing`",
            "`activation_checkpointing_enable()`, with `use_reentrant=False`",
            _code(hf_transformers.CHECKPOINT_ATTRIBUTES),
        ),
        (
            "chunking",
            "layers with an int `chunk_size_feed_forward` (BERT-style)",
            "the layer's own attribute",
            "`chunk_size_feed_forward`",
        ),
        (
            "chunking",
            "elsewhere, the outermost modules whose class name ends with one of `FEED_FORWARD_SUFFIXES` ("
            f"{_code(FEED_FORWARD_SUFFIXES)}): `LlamaMLP`, `GPT2MLP`, `T5LayerFF`, the MoE blocks of Mixtral, "
            f"Qwen2-MoE and OLMoE; not the families in `NOT_POSITION_WISE` ({_code(NOT_POSITION_WISE)}), whose "
            "experts have a capacity. OPT, BART and Whisper call `fc1` and `fc2` inline: nothing to chunk",
            "generic chunking",
            "the module's `forward`",
        ),
    ]
    table = _table(("technique", "applies to", "switch", "saved and put back"), rows)
    return f"{table}\n\nFor the checkpointing switch, {installed}."


def _generic() -> str:
    from lightning_memopt.adapters.torch_generic import FEED_FORWARD_SUFFIXES

    return (
        "Any other model with trainable parameters: every block of the outermost repeated stacks (an `nn.ModuleList` "
        "or `nn.Sequential` of two or more children of one class that have submodules) is checkpointed by wrapping its "
        "`forward`, and the outermost modules whose class name ends with one of `FEED_FORWARD_SUFFIXES` "
        f"({_code(FEED_FORWARD_SUFFIXES)}) are chunked."
    )


def _tables() -> str:
    return "\n\n".join(
        [
            "## Adapters, in the order they are tried",
            _adapters(),
            "## diffusers",
            _diffusers(),
            "## transformers",
            _transformers(),
            "## Plain torch",
            _generic(),
        ]
    )
