"""dashboards/kvguard.json: generated, parseable, linted, and naming only real metrics.

The lint rules reimplement grafana/dashboard-linter's (template-datasource-rule,
panel-datasource-rule, target-promql-rule, target-rate-interval-rule, template-job-rule,
template-instance-rule, target-job-rule, target-instance-rule) plus the provisioning rules
from ../shared/research/anchors.md section 6: no ``__inputs``/``${DS_...}`` (file
provisioning does not resolve them, grafana/grafana#10786), ``id`` null, a stable uid of
at most 40 characters, a pinned ``schemaVersion``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploytools import DASHBOARDS, metric_names, dashboard, kvguard_exposed_names, load_generator, promtool, run

GEN = load_generator()
DASH = dashboard()
PANELS = [p for p in DASH["panels"] if p["type"] != "row"]
TARGETS = [(p["title"], t) for p in PANELS for t in p["targets"]]
#: Grafana variables as Prometheus would see them after interpolation.
SUBST = {"$__rate_interval": "5m", "$kvguard_job": "kvguard", "$job": "vllm", "$instance": ".*"}


def _interpolate(expr: str) -> str:
    for k in sorted(SUBST, key=len, reverse=True):
        expr = expr.replace(k, SUBST[k])
    return expr


def _check_exprs(tmp_path: Path, exprs: list[str]) -> Any:
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr_{i}:check", "expr": e} for i, e in enumerate(exprs)]}]}
    f = tmp_path / "exprs.yaml"
    f.write_text(yaml.safe_dump(rules, sort_keys=False))
    return run([promtool(), "check", "rules", str(f)])


def test_committed_outputs_equal_the_generator():
    for path, text in GEN.outputs().items():
        assert path.read_text() == text, f"{path} is stale: run python dashboards/generate.py"


def test_generator_check_mode_reports_a_stale_file(tmp_path, monkeypatch):
    stale = tmp_path / "kvguard.json"
    stale.write_text("{}\n")
    monkeypatch.setattr(GEN, "outputs", lambda: {stale: GEN.dashboard_json()})
    assert GEN.main(["--check"]) == 1
    assert stale.read_text() == "{}\n"  # --check never writes
    assert GEN.main([]) == 0
    assert json.loads(stale.read_text())["uid"] == GEN.DASHBOARD_UID


def test_every_query_parses_with_promtool(tmp_path):
    exprs = [_interpolate(t["expr"]) for _, t in TARGETS]
    variable_queries = [v["query"]["query"] for v in DASH["templating"]["list"] if v["type"] == "query"]
    assert len(exprs) >= 20
    res = _check_exprs(tmp_path, exprs)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in res.stdout + res.stderr
    # variable queries are label_values(<selector>, label): the selector must parse too
    selectors = [re.fullmatch(r"label_values\((.+), (\w+)\)", q).group(1) for q in variable_queries]
    res = _check_exprs(tmp_path, [_interpolate(s) for s in selectors])
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_parse_check_rejects_a_broken_query(tmp_path):
    # the harness above must be able to fail: a missing parenthesis is reported
    res = _check_exprs(tmp_path, ["sum(rate(vllm:request_success_total[5m])"])
    assert res.returncode != 0


def test_identity_and_provisioning_rules():
    assert DASH["id"] is None
    assert DASH["uid"] == "kvguard-vllm-kv-offload" and len(DASH["uid"]) <= 40
    assert DASH["schemaVersion"] == 39
    raw = (DASHBOARDS / "kvguard.json").read_text()
    assert "__inputs" not in DASH and "${DS_" not in raw


def test_template_datasource_rule():
    variables = {v["name"]: v for v in DASH["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"


def test_template_job_and_instance_rules():
    variables = {v["name"]: v for v in DASH["templating"]["list"]}
    for name in ("job", "kvguard_job", "instance"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    assert variables["instance"]["multi"] and variables["instance"]["includeAll"]
    assert variables["instance"]["allValue"] == ".*"


@pytest.mark.parametrize("panel", PANELS, ids=lambda p: p["title"])
def test_panel_and_target_datasource_rule(panel):
    ds = {"type": "prometheus", "uid": "${datasource}"}
    assert panel["datasource"] == ds
    assert panel["targets"], "panel without a query"
    for t in panel["targets"]:
        assert t["datasource"] == ds


@pytest.mark.parametrize("title,target", TARGETS, ids=[f"{t}:{q['refId']}" for t, q in TARGETS])
def test_target_rules(title, target):
    expr = target["expr"]
    # target-rate-interval-rule: every range vector uses $__rate_interval
    ranges = re.findall(r"\[([^\]]+)\]", expr)
    assert all(r == "$__rate_interval" for r in ranges), ranges
    if re.search(r"\b(rate|increase|irate|delta)\(", expr):
        assert ranges
    # target-job-rule / target-instance-rule, for every selector: the job of the metric's source
    for selector in re.findall(r"\{([^}]*)\}", expr):
        names = metric_names(expr)
        assert 'instance=~"$instance"' in selector, selector
        if any(n.startswith("kvguard_") for n in names):
            assert 'job=~"$kvguard_job"' in selector, selector
        else:
            assert 'job=~"$job"' in selector, selector
    named = metric_names(expr) or re.findall(r'__name__=~"(vllm:[^"]+)"', expr)
    assert named, f"{title}: query names no kvguard_ or vllm: metric"


def test_kvguard_metric_names_are_in_the_exporter_contract():
    exposed = kvguard_exposed_names()
    used = {n for _, t in TARGETS for n in metric_names(t["expr"]) if n.startswith("kvguard_")}
    assert used - exposed == set()
    # the panels: violations and tolerated hits by check, SWA pending vs bound,
    # engine up, deaths and fatal causes, guard errors
    for must in ("kvguard_invariant_violations_total", "kvguard_check_tolerated_total",
                 "kvguard_swa_pending_bound_ratio_bucket", "kvguard_engine_up",
                 "kvguard_engine_deaths_total", "kvguard_engine_fatal_total", "kvguard_guard_errors_total"):
        assert must in used


def _exposed_vllm_names() -> set[str]:
    out = set()
    for name, (kind, _since) in GEN.VLLM_METRICS.items():
        if kind == "counter":
            out.add(name + "_total")
        elif kind == "histogram":
            out.update({name + "_bucket", name + "_sum", name + "_count"})
        else:
            out.add(name)
    return out


def test_vllm_metric_names_are_in_the_checked_table():
    # every vllm: name the dashboard plots is in generate.VLLM_METRICS, which
    # test_vllm_metric_names.py checks against each installed vLLM release
    known = _exposed_vllm_names()
    used = {n for _, t in TARGETS for n in metric_names(t["expr"]) if n.startswith("vllm:")}
    assert used - known == set()
    assert {n for n in known if n.startswith("vllm:kv_offload")} <= used
    # the regex in "Offload metric families present" matches every offload family we plot
    rx = re.compile("vllm:kv_offload.+")
    assert all(rx.fullmatch(n) for n in used if "kv_offload" in n)


def test_grid_positions_do_not_overlap():
    cells = set()
    for p in DASH["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, p["title"]
                cells.add((x, y))
    assert len({p["id"] for p in DASH["panels"]}) == len(DASH["panels"])


def test_every_kvguard_metric_used_is_in_a_real_sidecar_scrape(tmp_path):
    """Write the engine side's metric files with the real exporter (kvguard.guards.telemetry.metrics, as the
    plugin does inside EngineCore), serve them with the real sidecar app
    (kvguard.sidecar.app.create_app), scrape /metrics in process, and compare names: every kvguard_*
    series the dashboard or the alert rules name must be in the scrape."""
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from kvguard.guards.telemetry.metrics import GuardMetrics
    from kvguard.sidecar.app import create_app
    from kvguard.sidecar.config import SidecarConfig

    import ast

    from kvguard.guards.hooking import sites

    # a site as the instrumentor discovers it in an imported offload module
    found = sites.discover("vllm.v1.kv_offload.base", ast.parse("def f(n):\n    assert n\n"))
    sites.register(found.sites)
    metrics = GuardMetrics(state_dir=tmp_path)  # pre-creates the check/stage series at 0
    site = found.sites[0].site_id
    metrics.site_installed(site, True)  # what the instrumentor does per installed site
    metrics.connector_guarded("SimpleCPUOffloadConnector")  # a connector's scheduler side was built
    (tmp_path / "fatal").mkdir(exist_ok=True)
    # no lifespan: the health poller does not run; nothing listens on this port
    app = create_app(SidecarConfig(vllm_url="http://127.0.0.1:9", state_dir=tmp_path))
    res = TestClient(app).get("/metrics")
    assert res.status_code == 200
    scraped = set()
    for fam in text_string_to_metric_families(res.text):
        scraped.add(fam.name + "_total" if fam.type == "counter" else fam.name)
        scraped.update(s.name for s in fam.samples)
    used = {n for _, t in TARGETS for n in metric_names(t["expr"]) if n.startswith("kvguard_")}
    rules = yaml.safe_load((DASHBOARDS / "alerts.yaml").read_text())["groups"][0]["rules"]
    used |= {n for r in rules for n in metric_names(r["expr"]) if n.startswith("kvguard_")}
    assert len(used) >= 9
    assert used - scraped == set(), res.text
    # engine-side series really came from the files (a check series at 0), not only the sidecar
    assert 'kvguard_check_tolerated_total{check="swa_pending_bound"} 0.0' in res.text
    assert f'kvguard_site_installed{{site="{site}"}} 1.0' in res.text
