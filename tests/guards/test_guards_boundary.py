"""Import boundaries: the pure modules never import vLLM (or prometheus/structlog for rewrite)."""

from __future__ import annotations

import subprocess
import sys


def imported_after(code: str) -> set[str]:
    # cwd=/ : from the repository root, `python -c` would find the folders guards/ and
    # sidecar/ as top-level packages, which an installed kvguard never provides.
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
        check=True, capture_output=True, text=True, cwd="/",
    ).stdout
    return set(out.split())


def test_pure_modules_import_no_vllm():
    mods = imported_after("import kvguard.guards.checks.invariants, kvguard.guards.names, kvguard.guards.hooking.rewrite, kvguard.guards.hooking.sites")
    assert "vllm" not in mods
    assert not {m for m in mods if m.split(".")[0] in {"prometheus_client", "structlog", "pydantic", "packaging"}}


def test_plugin_package_import_is_free():
    mods = imported_after("import kvguard.guards, kvguard.guards.plugin")
    assert "vllm" not in mods and "kvguard.guards.hooking.instrumentor" not in mods


def test_no_top_level_guards_or_sidecar_module():
    """Issue 11: everything lives under ``kvguard.``; no bare ``guards``/``sidecar`` names."""
    mods = imported_after("import kvguard.guards.plugin, kvguard.guards.policy.runtime, kvguard.sidecar.cli")
    assert {"kvguard.guards.policy.runtime", "kvguard.sidecar.cli"} <= mods
    assert not {m for m in mods if m.split(".")[0] in {"guards", "sidecar"}}


def test_geometry_command_imports_no_vllm():
    mods = imported_after("import kvguard.lab.geometry")
    assert "vllm" not in mods


def test_nothing_the_engine_imports_is_the_lab():
    """kvguard.guards is what runs inside vLLM; the replay and fuzz lab (kvguard.lab) never
    loads there: no module of guards/ imports it, at module level or inside a function."""
    import ast
    from pathlib import Path

    guards = Path(__file__).resolve().parents[2] / "guards"
    offenders = []
    for path in sorted(guards.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvguard.lab"):
                offenders.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.Import) and any(a.name.startswith("kvguard.lab") for a in node.names):
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []
    mods = imported_after("import kvguard.guards.plugin, kvguard.guards.hooking.instrumentor, kvguard.guards.policy.runtime, "
                          "kvguard.guards.checks.admission, kvguard.guards.checks.wait_bound")
    assert not {m for m in mods if m.startswith("kvguard.lab")}
