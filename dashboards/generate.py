"""Generate kvguard's Grafana dashboard and the Kubernetes objects derived from dashboards/.

Run from the repository root (the light env has PyYAML)::

    .venvs/light/bin/python dashboards/generate.py          # (re)write the outputs
    .venvs/light/bin/python dashboards/generate.py --check  # exit 1 if an output is stale

Outputs (all committed; ``tests/deploy/test_dashboard.py`` and ``test_k8s.py`` fail when a
committed file differs from what this script produces, so nobody edits them by hand):

- ``dashboards/kvguard.json``: the Grafana dashboard (schemaVersion 39, ``id`` null, a
  stable ``uid``, a ``datasource`` template variable used by every panel and target,
  ``$__rate_interval`` in every range). Import it in Grafana, or let kube-prometheus-stack's
  dashboard sidecar load the ConfigMap below.
- ``deploy/k8s/prometheusrule.yaml``: a ``monitoring.coreos.com/v1`` ``PrometheusRule`` whose
  ``spec`` is ``dashboards/alerts.yaml`` verbatim (the rules file stays the single source;
  promtool tests run on it).
- ``deploy/k8s/grafana-dashboard.yaml``: a ConfigMap holding ``kvguard.json``, labelled
  ``grafana_dashboard: "1"`` (the kube-prometheus-stack sidecar convention that
  vLLM production-stack's ``helm/templates/dashboards.yaml`` uses too).

Jobs: kvguard_* series come from the sidecar (job ``kvguard`` by default, variable
``$kvguard_job``); vLLM's own ``vllm:*`` series from vLLM's /metrics (job ``vllm``, variable
``$job``). Selecting vLLM by job keeps production-stack's router look-alike gauges (same
``vllm:`` names, another job) out. Both jobs share ``instance`` = pod name
(``deploy/k8s/servicemonitor.yaml`` relabels it so), hence one ``$instance`` variable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD_PATH = ROOT / "dashboards" / "kvguard.json"
ALERTS_PATH = ROOT / "dashboards" / "alerts.yaml"
PROMETHEUS_RULE_PATH = ROOT / "deploy" / "k8s" / "prometheusrule.yaml"
DASHBOARD_CONFIGMAP_PATH = ROOT / "deploy" / "k8s" / "grafana-dashboard.yaml"

#: Stable across installs (<= 40 characters): what makes dashboard URLs and provisioning stable.
DASHBOARD_UID = "kvguard-vllm-kv-offload"
SCHEMA_VERSION = 39
DS = {"type": "prometheus", "uid": "${datasource}"}
KV = 'job=~"$kvguard_job", instance=~"$instance"'
VL = 'job=~"$job", instance=~"$instance"'
RI = "[$__rate_interval]"

#: vLLM metrics the dashboard plots: source name -> (type, first supported vLLM release
#: that defines it), as measured in the full environments (0.21.0, 0.25.1, 0.26.0, 0.29.0, 0.33.0). Checked against the installed
#: vLLM by tests/deploy/test_vllm_metric_names.py (marked vllm) in every vLLM env.
#: Counters are exposed with ``_total``, histograms as ``_bucket``/``_sum``/``_count``.
VLLM_METRICS: dict[str, tuple[str, str]] = {
    "vllm:num_requests_running": ("gauge", "0.21.0"),
    "vllm:num_requests_waiting": ("gauge", "0.21.0"),
    "vllm:request_success": ("counter", "0.21.0"),
    "vllm:e2e_request_latency_seconds": ("histogram", "0.21.0"),
    "vllm:time_to_first_token_seconds": ("histogram", "0.21.0"),
    "vllm:kv_cache_usage_perc": ("gauge", "0.21.0"),
    # offload, older generation (transfer_type label); deprecated (still emitted) in 0.33.0
    "vllm:kv_offload_total_bytes": ("counter", "0.21.0"),
    # offload, flat names
    "vllm:kv_offload_load_bytes": ("counter", "0.25.1"),
    "vllm:kv_offload_store_bytes": ("counter", "0.25.1"),
    "vllm:kv_offload_cpu_cache_usage_perc": ("gauge", "0.25.1"),
    "vllm:kv_offload_stores_skipped": ("counter", "0.25.1"),
    "vllm:kv_offload_allocation_failure": ("counter", "0.26.0"),  # absent in 0.25.1, present in 0.26.0
}


def _target(expr: str, legend: str = "", ref: str = "A", instant: bool = False) -> dict[str, Any]:
    t: dict[str, Any] = {"refId": ref, "datasource": DS, "expr": expr, "legendFormat": legend}
    if instant:
        t.update({"instant": True, "range": False, "format": "table"})
    else:
        t.update({"range": True})
    return t


class _Layout:
    """Places panels on Grafana's 24-column grid, row by row; ids are sequential."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.y = 0
        self.x = 0
        self.row_h = 0

    def _next_id(self) -> int:
        return len(self.panels) + 1

    def row(self, title: str) -> None:
        if self.x:
            self.y += self.row_h
        self.panels.append(
            {
                "id": self._next_id(),
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                "panels": [],
            }
        )
        self.y += 1
        self.x = 0
        self.row_h = 0

    def add(self, panel: dict[str, Any], w: int = 8, h: int = 8) -> None:
        if self.x + w > 24:
            self.y += self.row_h
            self.x = 0
            self.row_h = 0
        panel = {"id": self._next_id(), **panel, "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y}}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)


def _timeseries(title: str, description: str, targets: list[dict[str, Any]], unit: str = "short",
                thresholds_line: float | None = None, stack: bool = False) -> dict[str, Any]:
    custom: dict[str, Any] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10,
                              "showPoints": "never", "spanNulls": False}
    if stack:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    if thresholds_line is not None:
        steps.append({"color": "red", "value": thresholds_line})
        custom["thresholdsStyle"] = {"mode": "line"}
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": targets,
        "fieldConfig": {
            "defaults": {"unit": unit, "custom": custom,
                         "thresholds": {"mode": "absolute", "steps": steps}},
            "overrides": [],
        },
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
    }


def _stat(title: str, description: str, targets: list[dict[str, Any]],
          mappings: list[dict[str, Any]] | None = None, red_below: float | None = None) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    if red_below is not None:
        steps = [{"color": "red", "value": None}, {"color": "green", "value": red_below}]
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": targets,
        "fieldConfig": {
            "defaults": {"mappings": mappings or [], "thresholds": {"mode": "absolute", "steps": steps}},
            "overrides": [],
        },
        "options": {"colorMode": "background", "graphMode": "none", "justifyMode": "auto",
                    "orientation": "auto", "textMode": "auto",
                    "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
    }


def _table(title: str, description: str, targets: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": targets,
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {"showHeader": True},
        "transformations": [{"id": "organize", "options": {"excludeByName": {"Time": True}}}],
    }


def _map(value: str, text: str, color: str) -> dict[str, Any]:
    return {"type": "value", "options": {value: {"text": text, "color": color, "index": 0}}}


def _query_var(name: str, label: str, query: str, multi: bool) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "definition": query,
        "query": {"query": query, "refId": f"{name}-variable"},
        "refresh": 2,
        "regex": "",
        "sort": 1,
        "hide": 0,
        "multi": multi,
        "includeAll": multi,
        **({"allValue": ".*"} if multi else {}),
        "current": {},
        "options": [],
    }


def build_dashboard() -> dict[str, Any]:
    """The dashboard as a JSON-ready dict (see the module docstring for the conventions)."""
    lay = _Layout()

    lay.row("Guards inside EngineCore (kvguard)")
    lay.add(_timeseries(
        "Invariant violations by check",
        "Real violations of an exact offload invariant (alert KVGuardInvariantViolation), by check and "
        "by what happened next (action). Should be empty.",
        [_target(f"sum by (check, action) (increase(kvguard_invariant_violations_total{{{KV}}}{RI}))",
                 "{{check}} ({{action}})")]))
    lay.add(_timeseries(
        "Degrade actions and recomputed tokens",
        "What each failed invariant cost under policy guard (issue 9), cheapest first: hit_reduced "
        "(latency: the hit was cut at admission and vLLM recomputed the tokens on the right axis), "
        "recomputed (a prefill: the wait bound sent a parked request back to be computed from scratch), "
        "store_dropped (one store), request_failed (one request), raised (the engine).",
        [_target(f"sum by (action) (increase(kvguard_invariant_violations_total{{{KV}}}{RI}))",
                 "{{action}}", "A"),
         _target(f"sum(increase(kvguard_recomputed_tokens_total{{{KV}}}{RI}))", "recomputed tokens", "B")]))
    lay.add(_timeseries(
        "Tolerated hits by check",
        "Hits where the installed vLLM's own assertion would have crashed EngineCore but the exact "
        "invariant holds, so kvguard continued (alert KVGuardBoundTolerated; vLLM #48959).",
        [_target(f"sum by (check) (increase(kvguard_check_tolerated_total{{{KV}}}{RI}))", "{{check}}")]))
    lay.add(_timeseries(
        "Check evaluations per second",
        "How often each check runs: proof that the guards are live on this traffic.",
        [_target(f"sum by (check) (rate(kvguard_check_evaluations_total{{{KV}}}{RI}))", "{{check}}")],
        unit="ops"))
    lay.add(_timeseries(
        "SWA pending blocks / exact bound",
        "Pending sliding-window GPU blocks of each load divided by the exact bound "
        "cdiv(sliding_window + extra_retained_tokens + tokens_per_block - 1, tokens_per_block). "
        "100% = exactly at the bound (legal); above 100% is a violation. vLLM <= 0.26 asserted a bound "
        "one block lower, which unaligned hits reach.",
        [_target("histogram_quantile(0.99, sum by (le) "
                 f"(rate(kvguard_swa_pending_bound_ratio_bucket{{{KV}}}{RI})))", "p99", "A"),
         _target("histogram_quantile(0.5, sum by (le) "
                 f"(rate(kvguard_swa_pending_bound_ratio_bucket{{{KV}}}{RI})))", "p50", "B")],
        unit="percentunit", thresholds_line=1.0))
    lay.add(_stat(
        "Guard sites installed",
        "1 = the site is patched in every process; 0 = not installed (vLLM outside the tested range, "
        "the site's code changed, or disabled by KVGUARD_DISABLED_SITES).",
        [_target(f"min by (site) (kvguard_site_installed{{{KV}}})", "{{site}}", instant=True)],
        mappings=[_map("1", "installed", "green"), _map("0", "NOT installed", "red")], red_below=1))
    lay.add(_stat(
        "Guarded connector",
        "The CPU offload connector whose scheduler side kvguard guards on this engine: OffloadingConnector "
        "(--kv-offloading-backend native) or SimpleCPUOffloadConnector (VLLM_USE_SIMPLE_KV_OFFLOAD=1). "
        "Every kvguard check series of the pod belongs to it (kvguard_connector_info).",
        [_target(f"max by (connector) (kvguard_connector_info{{{KV}}})", "{{connector}}", instant=True)],
        mappings=[_map("1", "guarded", "green")], red_below=1))
    lay.add(_timeseries(
        "Guard errors by stage",
        "Exceptions inside kvguard's own code; vLLM ran its original path unguarded for those calls "
        "(alert KVGuardGuardErrors).",
        [_target(f"sum by (stage) (increase(kvguard_guard_errors_total{{{KV}}}{RI}))", "{{stage}}")]))
    lay.add(_timeseries(
        "Checks skipped by reason",
        "Lookups an admission check did not evaluate because kvguard cannot model or read what they "
        "involve; vLLM's answer passed through unchecked. group_kind: a KV cache group kind kvguard does "
        "not model (full attention, sliding window and Mamba are modelled); offload_manager: an offload "
        "manager whose cache policy kvguard cannot read; connector_config: a connector config it cannot "
        "read; partial_tail: a partial-tail hit. Not an error (no alert); the check_skipped event names "
        "what was not modelled.",
        [_target(f"sum by (check, reason) (increase(kvguard_check_skipped_total{{{KV}}}{RI}))",
                 "{{check}} ({{reason}})")]))
    lay.add(_timeseries(
        "Waits ended by the wait bound",
        "Requests the offload path kept waiting without progress past the wait bound "
        "(KVGUARD_WAIT_BOUND_STEPS and KVGUARD_WAIT_BOUND_SECONDS; alert KVGuardRequestWaitStalled), by "
        "what they waited for (wait) and what kvguard did (action: hit_reduced, request_failed, or "
        "continued under observe: still stuck). Should be empty.",
        [_target(f"sum by (wait, action) (increase(kvguard_wait_bound_exceeded_total{{{KV}}}{RI}))",
                 "{{wait}} ({{action}})")]))

    lay.row("Engine (kvguard sidecar)")
    lay.add(_stat(
        "Engine up",
        "The sidecar's view of vLLM's /health, per pod (alert VLLMEngineDown after 1m at 0).",
        [_target(f"kvguard_engine_up{{{KV}}}", "{{instance}}", instant=True)],
        mappings=[_map("1", "up", "green"), _map("0", "DOWN", "red")], red_below=1), w=6)
    lay.add(_timeseries(
        "Engine deaths",
        "Engine deaths counted by the sidecar (alert VLLMEngineRestartLoop at 3 in 30m).",
        [_target(f"sum by (instance) (increase(kvguard_engine_deaths_total{{{KV}}}{RI}))", "{{instance}}")]),
        w=6)
    lay.add(_timeseries(
        "Fatal EngineCore exceptions by type",
        "Fatal exceptions recorded by kvguard inside EngineCore before it died; the newest cause is "
        "in the sidecar's /status and the vLLM container's termination message.",
        [_target(f"sum by (exception) (increase(kvguard_engine_fatal_total{{{KV}}}{RI}))", "{{exception}}")]),
        w=6)
    lay.add(_table(
        "Versions",
        "kvguard and vLLM versions per pod (kvguard_build_info); vllm_support: measured, or unmeasured "
        "(a vLLM release kvguard was not measured on: it runs anyway and logs vllm_unmeasured once).",
        [_target(f"max by (instance, kvguard_version, vllm_version, vllm_support) (kvguard_build_info{{{KV}}})",
                 instant=True)]), w=6)
    lay.add(_timeseries(
        "Engine state",
        "1 for the state the sidecar sees: starting (loading the model, within the startup budget), "
        "up, dead (alert VLLMEngineDown after 1m), stopped (a requested stop).",
        [_target(f"max by (state) (kvguard_engine_state{{{KV}}})", "{{state}}")]), w=12)
    lay.add(_timeseries(
        "Sidecar state-dir errors by source and reason",
        "State-dir paths the sidecar cannot use now (alert KVGuardSidecarBlind after 5m), and "
        "problems first met in the range, by source and reason; /status lists each path and why.",
        [_target(f"sum by (source, reason) (kvguard_sidecar_unreadable{{{KV}}})",
                 "unreadable {{source}} {{reason}}", "A"),
         _target(f"sum by (source, reason) (increase(kvguard_sidecar_errors_total{{{KV}}}{RI}))",
                 "new {{source}} {{reason}}", "B")]),
        w=12)

    lay.row("vLLM (its own /metrics)")
    lay.add(_timeseries(
        "Requests running / waiting",
        "vLLM's scheduler queue (vllm:num_requests_running, vllm:num_requests_waiting).",
        [_target(f"sum(vllm:num_requests_running{{{VL}}})", "running", "A"),
         _target(f"sum(vllm:num_requests_waiting{{{VL}}})", "waiting", "B")]))
    lay.add(_timeseries(
        "Finished requests by reason",
        "Requests per second by finished_reason (stop, length, abort, error, ...).",
        [_target(f"sum by (finished_reason) (rate(vllm:request_success_total{{{VL}}}{RI}))",
                 "{{finished_reason}}")], unit="reqps", stack=True))
    lay.add(_timeseries(
        "Error and abort ratio",
        "Share of finished requests that ended in error or abort.",
        [_target(f'sum(rate(vllm:request_success_total{{{VL}, finished_reason=~"error|abort"}}{RI})) / '
                 f"sum(rate(vllm:request_success_total{{{VL}}}{RI}))", "error + abort")],
        unit="percentunit"))
    lay.add(_timeseries(
        "End-to-end request latency",
        "vllm:e2e_request_latency_seconds quantiles.",
        [_target("histogram_quantile(0.95, sum by (le) "
                 f"(rate(vllm:e2e_request_latency_seconds_bucket{{{VL}}}{RI})))", "p95", "A"),
         _target("histogram_quantile(0.5, sum by (le) "
                 f"(rate(vllm:e2e_request_latency_seconds_bucket{{{VL}}}{RI})))", "p50", "B")],
        unit="s"))
    lay.add(_timeseries(
        "Time to first token",
        "vllm:time_to_first_token_seconds quantiles.",
        [_target("histogram_quantile(0.95, sum by (le) "
                 f"(rate(vllm:time_to_first_token_seconds_bucket{{{VL}}}{RI})))", "p95", "A"),
         _target("histogram_quantile(0.5, sum by (le) "
                 f"(rate(vllm:time_to_first_token_seconds_bucket{{{VL}}}{RI})))", "p50", "B")],
        unit="s"))
    lay.add(_timeseries(
        "GPU KV cache usage",
        "vllm:kv_cache_usage_perc per pod (1 = full).",
        [_target(f"max by (instance) (vllm:kv_cache_usage_perc{{{VL}}})", "{{instance}}")],
        unit="percentunit"))
    lay.add(_timeseries(
        "KV offload throughput by direction",
        "Bytes per second moved GPU_to_CPU (store) and CPU_to_GPU (load). Uses the older "
        "vllm:kv_offload_total_bytes (transfer_type label; vLLM 0.21 to 0.33) and falls back to the flat "
        "vllm:kv_offload_store_bytes / load_bytes (0.25.1 on) where the older one is gone.",
        [_target(f"sum by (transfer_type) (rate(vllm:kv_offload_total_bytes_total{{{VL}}}{RI})) "
                 f"or label_replace(sum(rate(vllm:kv_offload_store_bytes_total{{{VL}}}{RI})), "
                 '"transfer_type", "GPU_to_CPU", "", "") '
                 f"or label_replace(sum(rate(vllm:kv_offload_load_bytes_total{{{VL}}}{RI})), "
                 '"transfer_type", "CPU_to_GPU", "", "")', "{{transfer_type}}")],
        unit="Bps"))
    lay.add(_timeseries(
        "KV offload CPU cache usage",
        "vllm:kv_offload_cpu_cache_usage_perc (vLLM 0.25.1 on).",
        [_target(f"max by (instance) (vllm:kv_offload_cpu_cache_usage_perc{{{VL}}})", "{{instance}}")],
        unit="percentunit"))
    lay.add(_timeseries(
        "KV offload stores skipped / allocation failures",
        "vllm:kv_offload_stores_skipped (0.25.1 on) and vllm:kv_offload_allocation_failure (0.26.0 on).",
        [_target(f"sum(increase(vllm:kv_offload_stores_skipped_total{{{VL}}}{RI}))", "stores skipped", "A"),
         _target(f"sum(increase(vllm:kv_offload_allocation_failure_total{{{VL}}}{RI}))",
                 "allocation failures", "B")]))
    lay.add(_table(
        "Offload metric families present",
        "Which vllm:kv_offload* families this vLLM exports (names move between releases): an empty "
        "offload panel above explains itself here. Empty table = offloading is off.",
        [_target(f'count by (__name__) ({{__name__=~"vllm:kv_offload.+", {VL}}})', instant=True)]), w=24)

    return {
        "id": None,
        "uid": DASHBOARD_UID,
        "title": "kvguard: vLLM KV offload guards",
        "description": "kvguard's runtime invariant guards for vLLM's CPU KV offloading, the engine "
                       "state seen by its sidecar, and vLLM's own request and offload metrics.",
        "tags": ["kvguard", "vllm", "kv-offload"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "timezone": "browser",
        "refresh": "30s",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
            "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
            "type": "dashboard"}]},
        "links": [],
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "regex": "", "hide": 0, "refresh": 1, "multi": False, "includeAll": False, "current": {},
             "options": []},
            _query_var("kvguard_job", "kvguard job", "label_values(kvguard_build_info, job)", multi=False),
            _query_var("job", "vLLM job", "label_values(vllm:num_requests_running, job)", multi=False),
            _query_var("instance", "Pod", 'label_values(kvguard_build_info{job=~"$kvguard_job"}, instance)',
                       multi=True),
        ]},
        "panels": lay.panels,
    }


def dashboard_json() -> str:
    return json.dumps(build_dashboard(), indent=2, ensure_ascii=False) + "\n"


class _Literal(str):
    """A string dumped as a YAML literal block (``|``)."""


def _dump(doc: Any) -> str:
    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(_Literal, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|"))
    return yaml.dump(doc, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=100000,
                     allow_unicode=True)


_HEADER = "# GENERATED by dashboards/generate.py from {src}. Do not edit: run the script.\n"
_LABELS = {"app.kubernetes.io/name": "vllm", "app.kubernetes.io/part-of": "kvguard"}


def prometheus_rule_yaml() -> str:
    spec = yaml.safe_load(ALERTS_PATH.read_text())
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "kvguard", "labels": dict(_LABELS)},
        "spec": spec,
    }
    return _HEADER.format(src="dashboards/alerts.yaml") + _dump(doc)


def dashboard_configmap_yaml() -> str:
    doc = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "kvguard-grafana-dashboard",
                     "labels": {**_LABELS, "grafana_dashboard": "1"}},
        "data": {"kvguard.json": _Literal(dashboard_json())},
    }
    return _HEADER.format(src="dashboards/generate.py") + _dump(doc)


def outputs() -> dict[Path, str]:
    """Every generated file and its expected content."""
    return {
        DASHBOARD_PATH: dashboard_json(),
        PROMETHEUS_RULE_PATH: prometheus_rule_yaml(),
        DASHBOARD_CONFIGMAP_PATH: dashboard_configmap_yaml(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a committed output is stale")
    args = ap.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        stale.append(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if args.check and stale:
        print("stale (run python dashboards/generate.py): " + ", ".join(map(str, stale)), file=sys.stderr)
        return 1
    for p in stale:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
