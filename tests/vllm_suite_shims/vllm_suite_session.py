"""Harness plugin of the vLLM-suite comparison (issue 5): load vLLM's general plugins, report kvguard.

Loaded with ``-p vllm_suite_session`` in *both* runs; the runs differ only in kvguard's
own environment (``KVGUARD_DISABLE=1`` in the plain run, ``KVGUARD_POLICY=guard`` in the
guarded one).

1. ``pytest_load_initial_conftests`` (tryfirst) calls
   ``vllm.plugins.load_general_plugins()``, exactly as vLLM's ``EngineCore.__init__``
   does (``vllm/v1/engine/core.py``) before it builds the scheduler and its KV
   connector. vLLM's unit tests build ``Scheduler`` and ``OffloadingConnector`` directly
   and never reach that call, so without it no ``vllm.general_plugins`` entry point
   (kvguard's ``kvguard.guards.plugin:register`` among them) would run in the pytest process.
   It runs before vLLM's ``tests/conftest.py`` is imported (that conftest imports
   ``vllm.LLM``, which pulls in the offload scheduler), so kvguard sees the offload
   modules imported after it, as in a real engine. The same call happens in the plain
   run, where kvguard's ``register()`` sees ``KVGUARD_DISABLE=1`` and does nothing;
   vLLM's own general plugins (the LoRA resolvers) load identically in both runs.
2. ``pytest_sessionfinish`` writes a JSON report to ``$KVSUITE_REPORT``:
   ``{"pid", "general_plugins": [entry point names], "kvguard_env": {KVGUARD_* vars},
   "kvguard_modules": [kvguard.guards.* modules imported], "snapshot": kvguard.guards.policy.runtime.snapshot()
   or null, "metrics": [{"name", "labels", "value"}] or null, "errors": [str]}``.
   ``metrics`` are the ``kvguard_*`` samples of ``$KVGUARD_STATE_DIR/metrics``, read with
   ``prometheus_client.multiprocess.MultiProcessCollector`` (every process of the run,
   summed as the sidecar sums them). The plugin never imports ``guards`` itself: the
   snapshot is taken only if kvguard's plugin already imported ``kvguard.guards.policy.runtime``.

It changes no test, no fixture and no vLLM code.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPORT_ENV = "KVSUITE_REPORT"

_general_plugins: list[str] = []
_errors: list[str] = []


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    from importlib.metadata import entry_points

    from vllm.plugins import load_general_plugins

    _general_plugins[:] = sorted(ep.name for ep in entry_points(group="vllm.general_plugins"))
    load_general_plugins()


def _kvguard_metrics(state_dir: str | None) -> list[dict[str, object]] | None:
    if not state_dir:
        return None
    path = Path(state_dir) / "metrics"
    if not path.is_dir():
        return None
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(path))
    samples = []
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.startswith("kvguard_"):
                samples.append(
                    {"name": sample.name, "labels": dict(sample.labels), "value": sample.value}
                )
    return sorted(samples, key=lambda s: (s["name"], sorted(s["labels"].items())))


def _platform() -> dict[str, object]:
    """What the tests saw of vLLM's platform (with shim 2 still applied)."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    return {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "device_type": current_platform.device_type,
        "support_hybrid_kv_cache": current_platform.support_hybrid_kv_cache(),
    }


def _snapshot() -> dict[str, object] | None:
    runtime = sys.modules.get("kvguard.guards.policy.runtime")
    if runtime is None or not hasattr(runtime, "snapshot"):
        return None
    return runtime.snapshot()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    target = os.environ.get(REPORT_ENV)
    if not target:
        return
    report: dict[str, object] = {
        "pid": os.getpid(),
        "general_plugins": _general_plugins,
        "kvguard_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("KVGUARD_")},
        "kvguard_modules": sorted(m for m in sys.modules if m == "kvguard.guards" or m.startswith("kvguard.guards.")),
        "platform": None,
        "snapshot": None,
        "metrics": None,
        "errors": list(_errors),
    }
    try:
        report["platform"] = _platform()
    except Exception as exc:
        report["errors"].append(f"platform: {exc!r}")
    try:
        report["snapshot"] = _snapshot()
    except Exception as exc:  # reported, never hides the test outcome
        report["errors"].append(f"snapshot: {exc!r}")
    try:
        report["metrics"] = _kvguard_metrics(os.environ.get("KVGUARD_STATE_DIR"))
    except Exception as exc:
        report["errors"].append(f"metrics: {exc!r}")
    tmp = Path(target).with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=True, default=str))
    os.replace(tmp, target)
