"""dashboards/alerts.yaml: real `promtool check rules` / `promtool test rules`, plus conventions.

The promtool unit tests (dashboards/alerts_test.yaml) hold the firing / not-firing cases, the
exact labels and annotations, and the `for:` timing. The mutation tests below prove that
those unit tests really pin every `for:` and every severity: a changed rule must fail them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from deploytools import DASHBOARDS, metric_names, ROOT, alerts, kvguard_exposed_names, promtool, run

#: alert -> (severity, for). The issue fixes the names; `for` is what the runbooks promise.
EXPECTED = {
    "KVGuardInvariantViolation": ("critical", None),
    "KVGuardRequestWaitStalled": ("critical", None),
    "KVGuardBoundTolerated": ("warning", "1m"),
    "VLLMEngineDown": ("critical", "1m"),
    "VLLMEngineRestartLoop": ("warning", "1m"),
    "KVGuardGuardErrors": ("warning", "5m"),
    "KVGuardSidecarDown": ("warning", "5m"),
    "KVGuardSidecarBlind": ("warning", "5m"),
}
RUNBOOK_PREFIX = "https://github.com/kvguard/kvguard/blob/main/docs/runbooks/"


def _rules() -> list[dict]:
    groups = alerts()["groups"]
    return [r for g in groups for r in g["rules"]]


def test_promtool_check_rules_accepts_the_rules_file():
    res = run([promtool(), "check", "rules", str(DASHBOARDS / "alerts.yaml")])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS: 8 rules found" in res.stdout + res.stderr


def test_promtool_unit_tests_pass():
    res = run([promtool(), "test", "rules", str(DASHBOARDS / "alerts_test.yaml")])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout + res.stderr


def test_rule_set_names_severities_and_for_durations():
    got = {r["alert"]: (r["labels"]["severity"], r.get("for")) for r in _rules()}
    assert got == EXPECTED


@pytest.mark.parametrize("rule", _rules(), ids=lambda r: r["alert"])
def test_rule_annotations_and_runbook(rule):
    ann = rule["annotations"]
    assert set(ann) == {"summary", "description", "runbook_url"}
    assert "{{" not in ann["summary"], "summary is the static notification headline"
    assert "$labels" in ann["description"], "description is templated per alert"
    assert ann["runbook_url"] == RUNBOOK_PREFIX + rule["alert"] + ".md"
    runbook = ROOT / "docs" / "runbooks" / (rule["alert"] + ".md")
    text = runbook.read_text()
    assert text.startswith("# " + rule["alert"] + "\n")
    for heading in ("## What it means", "## How to confirm", "## What to do"):
        assert heading in text, f"{runbook.name} lacks {heading!r}"
    # how to confirm: the sidecar's /status, and either a log line or the pod's termination message
    assert "/status" in text or "/healthz" in text
    assert "kubectl logs" in text


def test_rules_name_only_metrics_the_exporter_produces():
    exposed = kvguard_exposed_names()
    for rule in _rules():
        for name in metric_names(rule["expr"]):
            assert name in exposed, f"{rule['alert']}: {name} is not in kvguard.guards.names"


def test_every_alert_has_firing_and_not_firing_unit_tests():
    tests = yaml.safe_load((DASHBOARDS / "alerts_test.yaml").read_text())["tests"]
    firing: set[str] = set()
    silent: set[str] = set()
    for group in tests:
        for case in group.get("alert_rule_test", []):
            (firing if case["exp_alerts"] else silent).add(case["alertname"])
            for exp in case["exp_alerts"]:
                assert exp["exp_labels"]["severity"] == EXPECTED[case["alertname"]][0]
                assert set(exp["exp_annotations"]) == {"summary", "description", "runbook_url"}
    assert firing == set(EXPECTED)
    assert silent == set(EXPECTED)


def _mutated_run(tmp_path: Path, alert: str, mutate) -> str:
    doc = alerts()
    for rule in doc["groups"][0]["rules"]:
        if rule["alert"] == alert:
            mutate(rule)
    (tmp_path / "alerts.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    (tmp_path / "alerts_test.yaml").write_text((DASHBOARDS / "alerts_test.yaml").read_text())
    res = run([promtool(), "test", "rules", str(tmp_path / "alerts_test.yaml")])
    assert res.returncode != 0, f"promtool tests did not notice the mutated {alert}"
    return res.stdout + res.stderr


def _longer_for(rule: dict) -> None:
    old = rule.get("for")
    minutes = 0 if old is None else int(re.fullmatch(r"(\d+)m", old).group(1))
    rule["for"] = f"{max(1, 2 * minutes)}m"


@pytest.mark.parametrize("alert", sorted(EXPECTED))
def test_unit_tests_pin_the_for_duration(tmp_path, alert):
    out = _mutated_run(tmp_path, alert, _longer_for)
    assert alert in out


@pytest.mark.parametrize("alert", sorted(EXPECTED))
def test_unit_tests_pin_the_severity(tmp_path, alert):
    def flip(rule: dict) -> None:
        rule["labels"]["severity"] = "info"

    out = _mutated_run(tmp_path, alert, flip)
    assert "severity" in out


def test_runbooks_name_real_dashboard_panels_and_status_fields():
    import json as _json

    from kvguard.sidecar.app import StatusResponse

    titles = {p["title"] for p in _json.loads((DASHBOARDS / "kvguard.json").read_text())["panels"]}
    top = StatusResponse.model_fields

    def nested(key: str) -> set[str]:
        ann = top[key].annotation
        for cand in (ann, *getattr(ann, "__args__", ())):  # X | None, dict[str, X]
            if hasattr(cand, "model_fields"):
                return set(cand.model_fields)
        raise AssertionError(key)

    quoted_panels = status_paths = 0
    for rule in _rules():
        text = (ROOT / "docs" / "runbooks" / (rule["alert"] + ".md")).read_text()
        for line in text.splitlines():
            if "Grafana" in line or 'dashboard "' in line:
                for title in re.findall(r'"([^"]+)"', line):
                    assert title in titles, f"{rule['alert']}: no panel {title!r}"
                    quoted_panels += 1
        # /status JSON paths quoted as `engine.state`, `checks.<check>.tolerated`, `last_fatal`
        for path in re.findall(r"`((?:engine|last_fatal|checks|versions|waits_ended)(?:\.[\w<>]+)*)`", text):
            parts = path.split(".")
            assert parts[0] in top, path
            leaf = parts[-1]
            if len(parts) > 1 and not leaf.startswith("<"):
                assert leaf in nested(parts[0]), f"{rule['alert']}: /status has no {path}"
            status_paths += 1
    assert quoted_panels >= 8 and status_paths >= 8
