"""The package's layers, read from its source: imports flow one way with no cycle (counting imports inside functions
and under ``TYPE_CHECKING``, and the ``__init__`` of a package that importing one of its modules runs), and no
module outside ``techniques/`` picks a technique out by name."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_memopt
from lightning_memopt.techniques import REGISTRY

ROOT = Path(lightning_memopt.__file__).parent
PACKAGE = "lightning_memopt"


def module_name(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def package_of(name: str) -> str:
    """The package a module belongs to (a package's ``__init__`` belongs to that package)."""
    return name if (ROOT / Path(*name.split(".")[1:]) / "__init__.py").exists() else name.rpartition(".")[0]


def imported(name: str) -> set[str]:
    """The package's modules that importing ``name`` runs: every module it names in an import, wherever the import
    stands (a package named in ``from package import x`` counts, also its own), and the ``__init__`` of each package
    entered on the way from outside it (the top package's own is left out: every module runs it)."""
    tree = ast.parse(MODULES[name].read_text())
    named: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            named.add(node.module)
            named |= {f"{node.module}.{a.name}" for a in node.names}  # a submodule imported from its package
    edges = {target for target in named if target in MODULES and target not in (name, PACKAGE)}
    own = package_of(name)
    for target in named:
        parts = target.split(".")
        for end in range(2, len(parts)):  # each package on the way, entered from outside
            prefix = ".".join(parts[:end])
            if prefix in MODULES and not own.startswith(prefix):
                edges.add(prefix)
    return edges


GRAPH = {name: imported(name) for name in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_imports_in_functions_and_under_type_checking() -> None:
    assert len(GRAPH) > 40
    assert "lightning_memopt.estimate" in GRAPH["lightning_memopt.cli"]  # imported inside a function
    assert "lightning_memopt.adapters" in GRAPH["lightning_memopt.engine.stage"]  # a package's __init__ entered


def test_no_import_cycle() -> None:
    assert cycles(GRAPH) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]  # the check can fail


def layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or (ROOT / parts[1] / "__init__.py").exists() else "foundation"


def test_imports_flow_one_way() -> None:
    """From the bottom: the foundation (torch helpers, handles, dry runs), adapters (discovery and facts), techniques,
    the engine, then the Lightning glue (callbacks/) and the entry points (estimate, cli, the package itself)."""
    order = ["foundation", "adapters", "techniques", "engine", "callbacks"]
    for name, targets in GRAPH.items():
        if name in (PACKAGE, f"{PACKAGE}.estimate", f"{PACKAGE}.cli"):
            continue
        for target in targets:
            if target in (f"{PACKAGE}.estimate", f"{PACKAGE}.cli", PACKAGE):
                raise AssertionError(f"{name} imports the entry point {target}")
            assert order.index(layer(target)) <= order.index(layer(name)), f"{name} imports {target}, a layer above"


def test_only_the_package_itself_imports_the_lightning_glue() -> None:
    """Nothing but the package's ``__init__`` imports ``callbacks/``: the engine runs without a Trainer."""
    for name, targets in GRAPH.items():
        if name != PACKAGE and not name.startswith(f"{PACKAGE}.callbacks"):
            assert not any(t.startswith(f"{PACKAGE}.callbacks") for t in targets), name


def test_no_technique_is_picked_out_by_name_outside_techniques() -> None:
    """Outside ``techniques/`` no code indexes by a technique's name, compares with it, or imports one technique's
    own package: the engine and the callback reach techniques only through the registry and the plug-in methods."""
    names = {t.name for t in REGISTRY}
    own = {".".join(t.__module__.split(".")[:3]) for t in REGISTRY}  # each technique's package or module
    assert f"{PACKAGE}.techniques.loss" in own and f"{PACKAGE}.techniques.decoding" in own
    for name, path in MODULES.items():
        if name.startswith(f"{PACKAGE}.techniques"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                assert node.slice.value not in names, f"{name}:{node.lineno} indexes by a technique's name"
            if isinstance(node, ast.Compare):
                constants = [c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
                assert not names & set(constants), f"{name}:{node.lineno} compares with a technique's name"
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not any(node.module.startswith(o) for o in own), f"{name}:{node.lineno} imports {node.module}"


def home(module: str) -> str:
    """A technique's own module, or the package under ``techniques/`` it lives in."""
    return ".".join(module.split(".")[:3])


def test_each_technique_has_a_module_or_package_of_its_own_and_imports_no_others() -> None:
    """One built-in technique per module or package under ``techniques/``; none imports another's: what two share
    lives in a module that is no technique's (``base``, ``table``, ``lossy``, ``chunked``)."""
    homes: dict[str, list[str]] = {}
    for technique in REGISTRY:
        if technique.__module__.startswith(f"{PACKAGE}.techniques."):
            homes.setdefault(home(technique.__module__), []).append(technique.__name__)
    assert len(homes) >= 9, homes
    assert {h: names for h, names in homes.items() if len(names) > 1} == {}
    for name, targets in GRAPH.items():
        own = home(name) if name.startswith(f"{PACKAGE}.techniques.") else None
        if own not in homes:
            continue
        others = {home(t) for t in targets if home(t) in homes and home(t) != own}
        assert not others, f"{name}, of {homes[own]}, imports {sorted(others)}, another technique's"
    # the check can fail: a technique module importing another's, as the 8-bit weights once imported the state's
    fake = dict(GRAPH, **{f"{PACKAGE}.techniques.weights.core": {f"{PACKAGE}.techniques.state8bit"}})
    assert any(home(t) in homes and home(t) != home(n) for n, ts in fake.items() if home(n) in homes for t in ts)


def test_every_lightning_hook_the_callbacks_define_is_marked_override() -> None:
    """A hook whose name Lightning changes fails loudly under a type checker instead of never being called."""
    from lightning.pytorch.callbacks import Callback

    from lightning_memopt import MemOpt, PeakMemory

    for cls in (MemOpt, PeakMemory):
        hooks = [n for n, f in vars(cls).items() if callable(f) and hasattr(Callback, n) and not n.startswith("__")]
        assert len(hooks) >= 10, (cls, hooks)
        assert [n for n in hooks if not getattr(vars(cls)[n], "__override__", False)] == [], cls


def test_no_function_of_the_package_is_over_60_lines() -> None:
    """Docstrings count: a function that needs more is two."""
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == []


def test_no_file_of_the_planner_is_over_700_lines() -> None:
    """The planner is a package of what the dry runs measured, the pure model and the search; none of its files grows
    past 700 lines (techniques/table.py was 1,111 when it was split)."""
    planner = {name: path for name, path in MODULES.items() if name.startswith("lightning_memopt.techniques.planner")}
    assert len(planner) == 4, sorted(planner)
    sizes = {name: len(path.read_text().splitlines()) for name, path in planner.items()}
    assert max(sizes.values()) <= 700, sizes


def test_the_planners_model_runs_nothing() -> None:
    """``planner/model.py`` (the table and the solver) imports no module that runs a model or a dry run."""
    tree = ast.parse(MODULES["lightning_memopt.techniques.planner.model"].read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.startswith(("lightning_memopt", "torch"))], imported
