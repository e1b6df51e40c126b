"""The package's layering: imports run only down. No import cycle between modules, nor between
packages (`guardrails.tracing` and `guardrails.reporting` are one room each: a module of one
importing the other while a module of the other imports back is a cycle, even when no single
module closes it), lazy and TYPE_CHECKING imports included; and every module importable on its
own in a fresh interpreter.

The graph is read from the source (every `import` statement anywhere in a module, inside
functions and `if TYPE_CHECKING:` blocks too), so a cycle held together by a late import is
still a cycle here. Parent packages are not edges: importing `guardrails.kernels._cpu` runs
`guardrails/kernels/__init__.py`, but what that file imports is its own edge.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "guardrails"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {
    _module_name(path): path
    for path in sorted(PACKAGE.rglob("*.py"))
    # Run by site.py under `guardrails run`, never imported as part of the package.
    if path.name != "sitecustomize.py"
}


def _target(name: str) -> str | None:
    """The package module `name` refers to (the longest known prefix), or None."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str) -> set[str]:
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import sub` imports the submodule `pkg.sub` where there is one, and
            # reads a name of `pkg` itself otherwise.
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        for name in names:
            target = _target(name)
            if target is not None and target != module:
                found.add(target)
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def _cycle() -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(GRAPH):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _room(module: str) -> str:
    """The package (or root module) a module belongs to: `guardrails.tracing.ops` ->
    `guardrails.tracing`."""
    return ".".join(module.split(".")[:2])


def _rooms(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        edges = rooms.setdefault(_room(module), set())
        edges.update(_room(t) for t in targets if _room(t) != _room(module))
    return rooms


def _lazy_imports() -> list[str]:
    """Every import of a guardrails module that is not at a module's top level: inside a
    function or an `if TYPE_CHECKING:` block ("module -> target")."""
    found = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in top:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module:
                    base = node.module  # (the package uses absolute imports only)
                    names = [
                        f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                        for a in node.names
                    ]
                found += [f"{module} -> {n}" for n in names if n.startswith("guardrails")]
    return found


def test_the_graph_sees_the_package() -> None:
    # Guards the test itself: a graph with no edges would have no cycle either.
    assert len(MODULES) > 40
    assert "guardrails.sites" in GRAPH["guardrails.service"]
    assert "guardrails.reporting.mirror" in GRAPH["guardrails.sites._buffers"]
    assert "guardrails.sites._buffers" in GRAPH["guardrails.sites._site"]


def test_no_import_cycle_lazy_and_type_checking_imports_included() -> None:
    cycle = _cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_cycle_between_packages_lazy_and_type_checking_imports_included(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys.modules[__name__], "GRAPH", _rooms(GRAPH))
    cycle = _cycle()
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle or [])


def test_lazy_imports_are_counted_as_edges() -> None:
    # A lazy or TYPE_CHECKING import is an edge like any other: it may defer a cost (the CLI
    # imports a command's modules when it runs), never hide a cycle. Each one is in the graph
    # the cycle tests walk.
    lazy = _lazy_imports()
    assert len(lazy) > 20, lazy
    for edge in lazy:
        module, _, name = edge.partition(" -> ")
        target = _target(name)
        assert target == module or target in GRAPH[module], edge
    assert "guardrails.tracing.tracer" in GRAPH["guardrails.reporting._reporter"]  # TYPE_CHECKING


def test_a_package_cycle_no_module_closes_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    # tracing.tracer -> reporting.mirror and reporting._reporter -> tracing.tracer: no module
    # cycle, a package cycle (what the package graph had before the floors below existed).
    planted = {name: set(edges) for name, edges in GRAPH.items()}
    planted["guardrails.tracing.tracer"].add("guardrails.reporting.mirror")
    assert "guardrails.tracing.tracer" in planted["guardrails.reporting._reporter"]
    monkeypatch.setattr(sys.modules[__name__], "GRAPH", _rooms(planted))
    cycle = _cycle()
    assert cycle is not None
    assert {"guardrails.tracing", "guardrails.reporting"} <= set(cycle)


def test_the_cycle_finder_finds_a_planted_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    planted = {name: set(edges) for name, edges in GRAPH.items()}
    planted["guardrails.names"].add("guardrails.service")
    monkeypatch.setattr(sys.modules[__name__], "GRAPH", planted)
    cycle = _cycle()
    assert cycle is not None
    assert cycle[0] == cycle[-1]


@pytest.mark.parametrize(
    "module",
    [
        "guardrails.names",
        "guardrails.flags",
        "guardrails.exceptions",
        "guardrails._removable",
        "guardrails._suggest",
    ],
)
def test_the_shared_vocabulary_imports_nothing_of_guardrails(module: str) -> None:
    assert GRAPH[module] == set()


def test_the_cuda_floor_imports_only_process_state() -> None:
    assert GRAPH["guardrails._cuda"] == {"guardrails._process"}


@pytest.mark.parametrize(
    ("low", "high"),
    [
        ("guardrails.kernels", "guardrails.sites"),
        ("guardrails.kernels", "guardrails.settings"),
        ("guardrails.kernels", "guardrails.reporting"),
        ("guardrails.reporting", "guardrails.sites"),
        ("guardrails.reporting", "guardrails.service"),
        ("guardrails.attach", "guardrails.service"),
        ("guardrails.attach", "guardrails.sites"),
        ("guardrails.settings", "guardrails.sites"),
        ("guardrails.settings", "guardrails.service"),
        ("guardrails.settings", "guardrails.reporting"),
        # Inside sites/: a site's buffers and input checks sit below the sites, and the ops
        # reach a site only through the key it registered; the registry is on top.
        ("guardrails.sites._buffers", "guardrails.sites._site"),
        ("guardrails.sites._inputs", "guardrails.sites._site"),
        ("guardrails.sites.ops", "guardrails.sites._site"),
        ("guardrails.sites._site", "guardrails.sites.registry"),
        # The sites are below what attaches them and the service that owns them.
        ("guardrails.sites", "guardrails.attach"),
        ("guardrails.sites", "guardrails.service"),
        ("guardrails.sites", "guardrails.integrations"),
        # Process state is the bottom layer: it imports nothing of guardrails.
        ("guardrails._process", "guardrails"),
        # Tracing is a floor: what it shares with the layers above (a removable handle, the
        # "did you mean", the capture check) lives in floor modules both import.
        ("guardrails.tracing", "guardrails.attach"),
        ("guardrails.tracing", "guardrails.reporting"),
        ("guardrails.tracing", "guardrails.settings"),
        ("guardrails.tracing", "guardrails.service"),
        ("guardrails.tracing", "guardrails.integrations"),
        # The service is below the engine integrations that use it.
        ("guardrails.service", "guardrails.integrations"),
        ("guardrails.attach", "guardrails.integrations"),
    ],
)
def test_lower_layers_never_import_higher_ones(low: str, high: str) -> None:
    offenders = sorted(
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        if module == low or module.startswith(low + ".")
        for target in targets
        if target == high or target.startswith(high + ".")
    )
    assert offenders == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_module_imports_alone_in_a_fresh_interpreter(module: str) -> None:
    if module == "guardrails.integrations.transformers":
        pytest.importorskip("transformers")
    if module == "guardrails.kernels._triton_kernel":
        pytest.importorskip("triton")
    # `guardrails.__main__` is `python -m guardrails`: importing it runs the command.
    argv = (
        ["-m", "guardrails", "--help"]
        if module == "guardrails.__main__"
        else ["-c", f"import {module}"]
    )
    result = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_no_protocol_restates_a_class_the_package_defines() -> None:
    # A Protocol named like a class of the package is a copy of it kept in step by hand
    # (it was how sinks.py, loaders.py and settings/checks.py kept the layering): the class
    # moves down a floor instead, or the lower module takes the callables it uses.
    protocols: dict[str, list[str]] = {}
    classes: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {
                base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
                for base in node.bases
            }
            kind = protocols if "Protocol" in bases else classes
            kind.setdefault(node.name, []).append(module)
    restated = {
        name: (where, classes[name]) for name, where in protocols.items() if name in classes
    }
    assert restated == {}, restated
