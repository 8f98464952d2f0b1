"""What existing deployments depend on stays exactly as it is, whatever the layout: the
plugin entry point vLLM loads, the console script, the environment variables operators set,
and every metric name dashboards and alerts query. A rename here breaks running pods."""

from __future__ import annotations

import tomllib
from pathlib import Path

from kvguard.guards import names
from kvguard.guards.settings import GuardSettings

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_plugin_entry_point_and_the_console_script():
    project = PYPROJECT["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"kvguard": "kvguard.guards.plugin:register"}
    assert project["scripts"] == {"kvguard": "kvguard.sidecar.entry:main"}
    from kvguard.guards.plugin import register
    from kvguard.sidecar.entry import main

    assert callable(register) and callable(main)


def test_the_plugin_environment_variables():
    fields = {f"{names.ENV_PREFIX}{name.upper()}" for name in GuardSettings.model_fields}
    assert fields == {
        "KVGUARD_POLICY", "KVGUARD_DISABLE", "KVGUARD_DISABLED_SITES", "KVGUARD_STATE_DIR",
        "KVGUARD_WAIT_BOUND_STEPS", "KVGUARD_WAIT_BOUND_SECONDS",
    }


def test_every_metric_name():
    metrics = {v for k, v in vars(names).items() if k.startswith("METRIC_")}
    assert metrics == {
        "kvguard_check_evaluations_total", "kvguard_check_tolerated_total",
        "kvguard_invariant_violations_total", "kvguard_guard_errors_total",
        "kvguard_swa_pending_bound_ratio", "kvguard_site_installed", "kvguard_engine_fatal_total",
        "kvguard_engine_up", "kvguard_engine_deaths_total", "kvguard_build_info",
        "kvguard_recomputed_tokens_total", "kvguard_sidecar_errors_total", "kvguard_sidecar_unreadable",
        "kvguard_check_skipped_total", "kvguard_wait_bound_exceeded_total",
        "kvguard_connector_info",
    }
