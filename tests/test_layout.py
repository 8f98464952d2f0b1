"""The layout by concern holds: kvguard's import graph has no cycle, the lab never loads in
the engine, and the lower layers of the engine half never import the upper ones.

The graph is read from the source (``ast``), not from what one run happened to import:
every ``import`` counts, at module level or inside a function, and importing
``a.b.c`` also imports the packages ``a`` and ``a.b`` (their ``__init__`` runs first).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: import package -> folder, as pyproject.toml's [tool.setuptools.package-dir] maps them
PACKAGES = {"kvguard.guards": ROOT / "guards", "kvguard.lab": ROOT / "lab", "kvguard.sidecar": ROOT / "sidecar"}


def modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under each package folder."""
    out = {}
    for package, folder in packages.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def import_graph(packages: dict[str, Path]) -> dict[str, set[str]]:
    """``module -> the modules of ``packages`` it imports`` (with the packages above each)."""
    mods = modules(packages)

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = module if is_package else module.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                targets = [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                found = known(target)
                while found:
                    if found != module and not module.startswith(found + "."):
                        graph[module].add(found)
                    found = known(found.rpartition(".")[0])
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle():
    graph = import_graph(PACKAGES)
    # the reader sees the edges that matter (a reader that saw none would find no cycle)
    assert "kvguard.guards.checks.asserts" in graph["kvguard.guards.hooking.instrumentor"]
    assert "kvguard.guards.telemetry.counts" in graph["kvguard.guards.policy.degrade"]
    assert "kvguard.guards.checks.wait_bound" in graph["kvguard.guards.checks.admission.lookup"]
    assert cycles(graph) == []


def test_a_cycle_through_a_function_level_import_or_a_package_is_found(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from x.p import b\n")
    (pkg / "b.py").write_text("from x.p.sub import c\n")
    (pkg / "sub" / "__init__.py").write_text("from x.p import a\n")
    (pkg / "sub" / "c.py").write_text("")
    assert cycles(import_graph({"x.p": pkg})) == [["x.p.a", "x.p.b", "x.p.sub"]]


def _imports_of(prefix: str) -> dict[str, set[str]]:
    graph = import_graph(PACKAGES)
    return {m: targets for m, targets in graph.items() if m == prefix or m.startswith(prefix + ".")}


def test_the_engine_half_never_imports_the_lab_or_the_sidecar():
    offenders = {m: sorted(t for t in targets if t.startswith(("kvguard.lab", "kvguard.sidecar")))
                 for m, targets in _imports_of("kvguard.guards").items()}
    assert {m: t for m, t in offenders.items() if t} == {}


def test_policy_and_telemetry_never_import_a_check():
    """The layering that keeps the graph acyclic: a check asks the policy what to do and
    counts through telemetry; the policy and telemetry never reach back into a check."""
    for lower in ("kvguard.guards.policy", "kvguard.guards.telemetry"):
        offenders = {m: sorted(t for t in targets if t.startswith("kvguard.guards.checks"))
                     for m, targets in _imports_of(lower).items()}
        assert {m: t for m, t in offenders.items() if t} == {}, lower
    offenders = {m: sorted(t for t in targets if t.startswith("kvguard.guards.policy"))
                 for m, targets in _imports_of("kvguard.guards.telemetry").items()}
    assert {m: t for m, t in offenders.items() if t} == {}


def test_only_the_hooking_layer_imports_the_hooking_layer():
    """One-way imports: the hooking layer wires the checks into vLLM's code, so it imports
    them; a check, the policy and the telemetry never import it back (the names they share
    with it, the site kinds and the injected globals, are in ``guards/names.py``, the site
    registry is ``guards/site_registry.py``). Both of those import no subpackage at all."""
    for lower in ("kvguard.guards.checks", "kvguard.guards.policy", "kvguard.guards.telemetry"):
        offenders = {m: sorted(t for t in targets if t.startswith("kvguard.guards.hooking"))
                     for m, targets in _imports_of(lower).items()}
        assert {m: t for m, t in offenders.items() if t} == {}, lower
    for shared in ("kvguard.guards.names", "kvguard.guards.site_registry"):
        graph = import_graph(PACKAGES)
        assert not [t for t in graph[shared] if t.startswith("kvguard.guards.") and t != "kvguard.guards.names"], shared


def test_the_architecture_page_names_every_subpackage_of_the_engine_half():
    page = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    subpackages = sorted(p.parent.name for p in (ROOT / "guards").glob("*/__init__.py"))
    assert subpackages == ["checks", "hooking", "policy", "telemetry"]
    assert [s for s in subpackages if f"guards/{s}/" not in page] == []
