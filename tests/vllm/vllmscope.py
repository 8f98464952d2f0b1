"""The installed vLLM's in-scope modules, found from its files (no table), for tests/vllm."""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
from pathlib import Path

from kvguard.guards.hooking.sites import SCOPE_PACKAGES, CONNECTOR_MODULES, Discovery, discover, in_scope, worker_side_modules


@functools.cache
def package_sources() -> dict[str, str]:
    """``{module: source}`` of every module of the installed vLLM's offload packages, found
    by walking its files here (not with kvguard's own reader, which it checks)."""
    root = Path(importlib.util.find_spec("vllm").origin).parent
    out = {}
    for pkg in (*SCOPE_PACKAGES, *CONNECTOR_MODULES):
        rel = Path(*pkg.split(".")[1:])
        base = root / rel
        files = [base.with_suffix(".py")] if (base.with_suffix(".py")).exists() else sorted(base.rglob("*.py"))
        for f in files:
            parts = f.relative_to(root).with_suffix("").parts
            name = ".".join(("vllm", *parts))
            out[name.removesuffix(".__init__")] = f.read_text()
    return out


@functools.cache
def worker_side() -> frozenset[str]:
    """The installed release's worker-side modules (the scope rule's role set)."""
    return worker_side_modules(package_sources())


def scope_module_names() -> list[str]:
    """Every module of the installed vLLM that kvguard's scope rule accepts (by file)."""
    ws = worker_side()
    return sorted(name for name in package_sources() if in_scope(name, ws))


def import_scope() -> tuple[dict[str, object], dict[str, str]]:
    """Import every in-scope module: ``(modules, failures)``; a failure (an optional
    dependency this machine lacks, e.g. NIXL) is returned with its error, never hidden."""
    modules, failures = {}, {}
    for name in scope_module_names():
        try:
            modules[name] = importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - reported by the caller
            failures[name] = f"{type(error).__name__}: {error}"
    return modules, failures


def discovered(module: object) -> Discovery:
    """What kvguard's discovery finds in an imported module's own source."""
    return discover(module.__name__, ast.parse(Path(module.__file__).read_text()), worker_side())
