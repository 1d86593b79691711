"""The product's import graph: no cycles, and every import runs downhill (issue 38).

The graph is read from the source with ``ast`` (nothing is imported): every ``import`` and
``from ... import`` that names a module of ``inferflow/``, at module level and inside functions
(a lazy import still runs), except those under ``if TYPE_CHECKING:`` (annotations only).

``LAYERS`` is the layer table of docs/architecture.md: for a package, its children (subpackages
and modules, by name; ``__init__`` is the package's own face) in tiers from the bottom up. A
module may import from its own tier and the tiers below it, never from a later one. Imports
inside one child (``scheduling/`` importing ``scheduling/``) are only checked for cycles.
To move a folder, edit its tier here; a new top-level module or folder must be added to a tier.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "inferflow"

LAYERS: dict[str, list[set[str]]] = {
    "inferflow": [
        {"paths", "json_types", "interrupts"},  # leaves
        {"config"},  # schemas, SLOTS, ConfigError: imports only the leaves
        {"sampling_params", "outputs", "guided"},  # what a request carries in and out
        {"models"},  # checkpoints, tokenizers, the models' ONNX graphs
        {"lora"},  # PEFT adapters, their registry and the engine's adapter slots
        {"scheduling", "speculative"},  # block pool -> KV manager -> scheduler
        {"sampling"},  # sampling a scheduler plan's logits
        {"runtimes"},  # compiled runners (ONNX Runtime, TensorRT, torch)
        {"stages"},  # the serving graph's stage contracts and built-in stages
        {"engine", "compose", "conf"},  # the engine and its step; composing config
        {"graph"},  # assembling a graph
        {"embeddings", "telemetry", "llm", "dry_run", "__init__"},  # built on graphs
        {"server"},  # the processes that serve a graph over HTTP
        {"cli", "__main__"},
        {"testing", "bench", "experiment"},  # test doubles, load generator, experiments: anything
    ],
    "inferflow.server": [
        {"messages", "shared_state", "process_utils", "routing", "observability", "lora"},
        {"http", "worker"},  # the API processes; the engine worker
        {"litserve", "ray", "process", "__init__"},  # the hosts that wire them together
    ],
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for branch in child.orelse:
                yield from _imports_in(branch)
        else:
            yield from _imports_in(child)


def _imports_in(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    yield from _imports(node)


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        prefix = node.module or ""
        if node.level:
            is_package = MODULES[module].name == "__init__.py"
            anchor = module if is_package else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                anchor = anchor.rpartition(".")[0]
            prefix = f"{anchor}.{prefix}" if prefix else anchor
        names = [f"{prefix}.{a.name}" for a in node.names]
    return {t for t in map(_resolve, names) if t is not None and t != module}


def import_edges() -> dict[tuple[str, str], tuple[Path, int]]:
    """(importer, imported) module names -> where (file, first line) it is imported."""
    edges: dict[tuple[str, str], tuple[Path, int]] = {}
    for module, path in MODULES.items():
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            for target in _targets(module, node):
                edges.setdefault((module, target), (path, node.lineno))
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = stack[stack.index(node):]
                    del stack[stack.index(node):]
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in stack:
                low[node] = min(low[node], index[child])
    return found


def _child(package: str, module: str) -> str | None:
    """The child of ``package`` that ``module`` lives in (``__init__``: the package itself)."""
    if module == package:
        return "__init__"
    if not module.startswith(package + "."):
        return None
    return module[len(package) + 1 :].split(".")[0]


def _tier(package: str, child: str) -> int | None:
    return next((i for i, tier in enumerate(LAYERS[package]) if child in tier), None)


def _where(edge: tuple[str, str], edges: dict[tuple[str, str], tuple[Path, int]]) -> str:
    path, line = edges[edge]
    return f"{path.relative_to(ROOT.parent)}:{line} imports {edge[1]}"


def test_every_child_of_a_layered_package_has_a_tier() -> None:
    for package, tiers in LAYERS.items():
        children = {_child(package, m) for m in MODULES} - {None}
        untiered = sorted(c for c in children if _tier(package, c) is None)
        assert not untiered, f"add {untiered} to a tier of LAYERS[{package!r}]"
        named = [c for tier in tiers for c in tier]
        assert len(named) == len(set(named)), f"LAYERS[{package!r}] names a child twice"


def test_every_folder_says_what_lives_there_and_what_it_may_import() -> None:
    undocumented = []
    for init in sorted(ROOT.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        data_only = not any(p.suffix == ".py" and p != init for p in init.parent.iterdir())
        if not data_only and "import" not in doc:
            undocumented.append(str(init.relative_to(ROOT.parent)))
    assert not undocumented, f"say what these folders may import: {undocumented}"


def test_no_import_cycles() -> None:
    edges = import_edges()
    graph: dict[str, set[str]] = defaultdict(set)
    for importer, imported in edges:
        graph[importer].add(imported)
    problems = [" <-> ".join(c) for c in _cycles(graph)]
    for package in LAYERS:  # folders too: two modules of one may not import the other's
        folders: dict[str, set[str]] = defaultdict(set)
        for importer, imported in edges:
            a, b = _child(package, importer), _child(package, imported)
            if a is not None and b is not None and a != b:
                folders[a].add(b)
        problems += [f"{package}: " + " <-> ".join(c) for c in _cycles(folders)]
    assert not problems, "import cycles:\n" + "\n".join(problems)


def test_every_import_runs_downhill() -> None:
    edges = import_edges()
    upward = []
    for edge in sorted(edges):
        for package in LAYERS:
            a, b = _child(package, edge[0]), _child(package, edge[1])
            if a is None or b is None or a == b:
                continue
            low, high = _tier(package, b), _tier(package, a)
            if low is None or high is None or low > high:
                upward.append(f"{_where(edge, edges)} (tier {high} -> {low} of {package})")
    assert not upward, "imports that run back up:\n" + "\n".join(upward)
