"""The shape of the package, read from its source (no imports run): the import graph of minisgl/ has no cycle and
no arrow from a lower layer up to a higher one, the environment is read in one module, no kernel module has a
switch for others to flip, and no module reaches into another package's private attributes."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "minisgl"

# Bottom to top; a module may import from its own layer and the layers below. A unit is a top-level module or a
# subpackage of minisgl (every module in it).
LAYERS = [
    {"errors", "environment", "config", "sampling_params", "stop_strings", "grammar"},  # settings, requests, grammars
    {"kernels"},  # Triton kernels and their torch references
    {"attention"},  # attention backends over the paged pool
    {"kvcache", "models", "checkpoint", "tokenizer"},  # memory pools and caches; model definitions and their files
    {"loader"},  # building a model from a folder
    {"scheduler"},  # requests, batches, scheduling policy
    {"distributed"},  # tensor-parallel processes (they run whatever runner class the engine hands them)
    {"engine"},  # model runner, graphs, runtimes, the loop
    {"llm", "bench"},  # the offline API, workloads and timing
    {"server"},  # the HTTP server
    {"__init__", "__main__"},  # the package's face and its command line
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module -> the minisgl modules it imports, at the top or inside a function (a lazy import is an arrow too)."""
    graph = {}
    for name, path in MODULES.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {_resolve(a.name) for a in node.names if a.name.startswith("minisgl")}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                if base.startswith("minisgl"):
                    targets |= {_resolve(f"{base}.{a.name}") for a in node.names}
        graph[name] = {t for t in targets if t and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 50 and graph["minisgl.engine.model_runner"], "the graph was not read"
    assert cycles(graph) == []


def test_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_arrow_points_up():
    graph = import_graph()
    units = {unit(m) for m in graph}
    assert units <= set(LAYER_OF), f"place these in LAYERS: {sorted(units - set(LAYER_OF))}"
    upward = [f"{a} -> {b}" for a, targets in graph.items() for b in targets
              if LAYER_OF[unit(b)] > LAYER_OF[unit(a)]]
    assert upward == []


def test_the_environment_is_read_in_one_module():
    readers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if "os.environ" in p.read_text() or "getenv" in p.read_text())
    assert readers == ["environment.py"]


def test_no_kernel_module_has_a_switch_to_flip():
    """Nothing in minisgl/kernels rebinds a module-level name after import (a `global` statement), and no
    module anywhere assigns an attribute of a kernel module (the old `pdl.PDL_ENABLED = ...`)."""
    for path in (PACKAGE / "kernels").rglob("*.py"):
        tree = ast.parse(path.read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)], path
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        kernel_aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                          and n.module == "minisgl.kernels" for a in n.names}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                        assert target.value.id not in kernel_aliases, f"{path}: {ast.unparse(target)}"


def test_no_module_reads_another_packages_private_attributes():
    """`obj._name` on anything but self/cls is fine inside the package that defines `_name` (a module's own
    helpers, the kernels sharing their decorator); from another package it reaches past the owner's interface
    (as the tensor-parallel group once did, pickling the request pool's queued writes out of its fields)."""
    defined: dict[str, set[str]] = {}  # private name -> the units (subpackages) that define it
    trees = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr.startswith("_"):
                defined.setdefault(node.attr, set()).add(unit(name))
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name.startswith("_"):
                defined.setdefault(node.name, set()).add(unit(name))
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id.startswith("_"):
                defined.setdefault(node.id, set()).add(unit(name))
    bad = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                    and node.attr in defined and unit(name) not in defined[node.attr]):
                bad.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert bad == []
