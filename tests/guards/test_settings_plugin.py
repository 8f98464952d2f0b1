"""GuardSettings and the plugin entry point."""

from __future__ import annotations

import importlib.metadata
import sys
import types
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvguard.guards.telemetry import events

from kvguard.guards import names

from kvguard.guards.policy import runtime
from kvguard.guards.hooking.instrumentor import OffloadGuardInstrumentor
from kvguard.guards.plugin import register
from kvguard.guards.settings import GuardSettings

import fakevllm


def test_defaults(monkeypatch):
    for var in ("KVGUARD_POLICY", "KVGUARD_DISABLE", "KVGUARD_DISABLED_SITES", "KVGUARD_STATE_DIR"):
        monkeypatch.delenv(var, raising=False)
    s = GuardSettings.from_env()
    assert (s.policy, s.disable, s.disabled_sites, s.state_dir) == ("guard", False, frozenset(), None)


def test_env_values(monkeypatch, tmp_path):
    monkeypatch.setenv("KVGUARD_POLICY", " Strict ")
    monkeypatch.setenv("KVGUARD_DISABLE", "1")
    monkeypatch.setenv("KVGUARD_DISABLED_SITES", " a , b,,")
    monkeypatch.setenv("KVGUARD_STATE_DIR", str(tmp_path))
    s = GuardSettings.from_env()
    assert (s.policy, s.disable, s.disabled_sites, s.state_dir) == ("strict", True, frozenset({"a", "b"}), tmp_path)
    assert s.site_disabled("a") and not s.site_disabled("c")
    with pytest.raises(ValidationError):
        s.policy = "observe"  # frozen


@pytest.mark.parametrize("var, value", [("KVGUARD_POLICY", "yolo"), ("KVGUARD_DISABLE", "maybe")])
def test_bad_values_raise(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValidationError):
        GuardSettings.from_env()


def test_register_with_bad_policy_disables_with_a_reason(monkeypatch):
    monkeypatch.setenv("KVGUARD_POLICY", "yolo")
    with events.capture() as logged:
        assert register() is False
    assert not OffloadGuardInstrumentor().is_installed
    disabled = [e for e in logged if e["event"] == "plugin_disabled"]
    assert len(disabled) == 1 and "policy" in disabled[0]["reason"]


def test_register_disable(monkeypatch):
    monkeypatch.setenv("KVGUARD_DISABLE", "1")
    with events.capture() as logged:
        assert register() is False
    assert not OffloadGuardInstrumentor().is_installed
    assert logged[-1]["reason"] == "KVGUARD_DISABLE=1"


def test_register_installs_and_calls_fatal_install(tmp_path, monkeypatch):
    calls = []
    fake_fatal = types.ModuleType("kvguard.guards.policy.fatal")
    fake_fatal.install = calls.append
    monkeypatch.setitem(sys.modules, "kvguard.guards.policy.fatal", fake_fatal)
    settings = GuardSettings(state_dir=tmp_path / "state", policy="observe")
    with fakevllm.fake_vllm(tmp_path):
        assert register(settings) is True
        assert register(settings) is True  # vLLM may load plugins twice: still installed, no error
    assert calls == [settings, settings]
    assert runtime.policy() == "observe"
    assert (tmp_path / "state" / names.STATE_METRICS_SUBDIR).is_dir()


def test_register_counts_a_failing_fatal_install(tmp_path, monkeypatch):
    fake_fatal = types.ModuleType("kvguard.guards.policy.fatal")

    def install(settings):
        raise OSError("read-only state dir")

    fake_fatal.install = install
    monkeypatch.setitem(sys.modules, "kvguard.guards.policy.fatal", fake_fatal)
    errors = []
    with fakevllm.fake_vllm(tmp_path):
        monkeypatch.setattr(runtime, "guard_error", lambda stage, error: errors.append(stage))
        assert register(GuardSettings(state_dir=tmp_path / "state")) is True
    assert errors == [names.STAGE_FATAL]


def test_entry_point_is_declared():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert "kvguard.guards.plugin:register" in {ep.value for ep in eps if ep.name == "kvguard"}
