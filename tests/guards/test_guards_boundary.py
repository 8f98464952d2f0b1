"""Import boundaries: the pure modules never import vLLM (or prometheus/structlog for rewrite)."""

from __future__ import annotations

import subprocess
import sys


def imported_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
        check=True, capture_output=True, text=True,
    ).stdout
    return set(out.split())


def test_pure_modules_import_no_vllm():
    mods = imported_after("import guards.invariants, guards.names, guards.rewrite, guards.sites")
    assert "vllm" not in mods
    assert not {m for m in mods if m.split(".")[0] in {"prometheus_client", "structlog", "pydantic", "packaging"}}


def test_plugin_package_import_is_free():
    mods = imported_after("import guards, guards.plugin")
    assert "vllm" not in mods and "guards.instrumentor" not in mods


def test_geometry_command_imports_no_vllm():
    mods = imported_after("import guards.geometry")
    assert "vllm" not in mods
