"""Shared helpers for the deploy tests (dashboards/, deploy/k8s/, Dockerfile).

These tests run real tools: promtool (Debian's ``prometheus`` package, installed by
``scripts/ensure-tools.sh``), and hadolint, kubectl (for ``kubectl kustomize``) and
kubernetes-validate from wheels in the ``test`` extra. A missing tool is an error that
says how to install it, never a skip.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
K8S = ROOT / "deploy" / "k8s"
BIN = Path(sys.executable).parent


def tool(name: str, hint: str) -> str:
    """Absolute path of ``name`` (this venv's bin first, then PATH); fail with ``hint`` if absent."""
    env = os.environ.get(f"KVGUARD_{name.upper()}")
    if env:
        return env
    local = BIN / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: {hint}", pytrace=False)
    return found


class Missing:
    """Stands in for a test-extra module missing from this env, so the module still collects
    (vLLM envs deselect these light tests); any use fails with the fix."""

    def __init__(self, err: ImportError) -> None:
        self.err = err

    def __getattr__(self, name: str):
        if name.startswith("__"):  # pytest's collection probes attributes such as __test__
            raise AttributeError(name)
        pytest.fail(f"{self.err}: rebuild this env with scripts/env.sh (test extra)", pytrace=False)

    def __call__(self, *a, **k):
        pytest.fail(f"{self.err}: rebuild this env with scripts/env.sh (test extra)", pytrace=False)


def promtool() -> str:
    return tool("promtool", "run scripts/ensure-tools.sh (Debian package 'prometheus')")


def run(cmd: list[str], cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def load_generator():
    """Import dashboards/generate.py as a module (it is a script, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvguard_dashboards_generate", DASHBOARDS / "generate.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dashboard() -> dict[str, Any]:
    return json.loads((DASHBOARDS / "kvguard.json").read_text())


def alerts() -> dict[str, Any]:
    return yaml.safe_load((DASHBOARDS / "alerts.yaml").read_text())


#: Metric names as they appear in PromQL: kvguard's (underscores) and vLLM's (colon prefix).
METRIC_RE = re.compile(r"(?<![\w:$])(kvguard_[a-z0-9_]+|vllm:[a-z0-9_:]+)")


def metric_names(expr: str) -> set[str]:
    """kvguard_* and vllm:* metric names in a PromQL expression.

    Strings, label matchers (``{...}``) and grouping clauses (``by (...)``) are removed
    first, so label names and values (``kvguard_version``, ``$kvguard_job``) never count.
    """
    expr = re.sub(r'"[^"]*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    return set(METRIC_RE.findall(expr))


def kvguard_exposed_names() -> set[str]:
    """Every series name kvguard's exporter can expose, from kvguard.guards.names and the
    sidecar's own list (kvguard.sidecar.collector.SIDECAR_METRICS): the contract.

    Histograms expand to _bucket/_sum/_count; counters are already spelled with _total.
    """
    from kvguard.guards import names
    from kvguard.sidecar.collector import SIDECAR_METRICS

    out: set[str] = set(SIDECAR_METRICS)
    histograms = {names.METRIC_SWA_PENDING_BOUND_RATIO}  # docs/ARCHITECTURE.md: the one histogram
    for attr, value in vars(names).items():
        if attr.startswith("METRIC_") and isinstance(value, str):
            out.add(value)
            if value in histograms:
                out.update({value + "_bucket", value + "_sum", value + "_count"})
    return out
