"""A real Prometheus (Debian's ``prometheus`` 2.42, installed by scripts/ensure-tools.sh)
scrapes a real ``kvguard sidecar`` on loopback with the project's alert rules
(dashboards/alerts.yaml), and the tests ask Prometheus's HTTP API (``/api/v1/alerts``,
``/api/v1/query``) what an operator's Prometheus would know (issue 12, "Proof").

The rules are the project's expressions unchanged; only their ``for:`` durations are
shortened (to :data:`FOR`), so that an alert that pages after a minute in production
fires within seconds here. Scrape and evaluation intervals are 1 s, except in the
restart case, which uses the ServiceMonitor's 15 s scrape interval.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import yaml
from sidecartools import busy_wait, free_port

from kvguard.guards.telemetry.statefile import StateDir

ROOT = Path(__file__).resolve().parents[2]
#: the shortened `for:` of every rule
FOR = "2s"


def prometheus_binary() -> str:
    """The ``prometheus`` server binary: ``KVGUARD_PROMETHEUS``, else PATH. Missing is a
    failure with the fix, never a skip."""
    found = os.environ.get("KVGUARD_PROMETHEUS") or shutil.which("prometheus")
    if not found:
        pytest.fail(
            "the prometheus server is not installed: run scripts/ensure-tools.sh "
            "(Debian package 'prometheus', which also ships promtool)",
            pytrace=False,
        )
    return found


def project_rules(dest: Path) -> Path:
    doc = yaml.safe_load((ROOT / "dashboards" / "alerts.yaml").read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = FOR
    dest.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dest


class Prometheus:
    """A Prometheus server on a free loopback port, scraping ``targets`` as job kvguard."""

    def __init__(self, workdir: Path, targets: list[str], scrape_interval: str = "1s") -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        rules = project_rules(workdir / "rules.yaml")
        config = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": "kvguard", "static_configs": [{"targets": targets}]}],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [prometheus_binary(), f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        busy_wait(self._ready, timeout=60, interval=0.1)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited {self.proc.returncode}: {Path(self.log.name).read_text()[-2000:]}")
        try:
            return httpx.get(self.base + "/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        body = httpx.get(self.base + "/api/v1/query", params=params, timeout=10).json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def value(self, expr: str, at: float | None = None) -> float | None:
        result = self.query(expr, at)
        return float(result[0]["value"][1]) if result else None

    def alerts(self, name: str) -> list[dict]:
        body = httpx.get(self.base + "/api/v1/alerts", timeout=10).json()
        assert body["status"] == "success", body
        return [a for a in body["data"]["alerts"] if a["labels"]["alertname"] == name]

    def firing(self, name: str) -> list[dict]:
        return [a for a in self.alerts(name) if a["state"] == "firing"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


@pytest.fixture
def prometheus(tmp_path):
    started: list[Prometheus] = []

    def start(targets: list[str], scrape_interval: str = "1s") -> Prometheus:
        p = Prometheus(tmp_path / f"prom{len(started)}", targets, scrape_interval)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


def target(side) -> str:
    return f"127.0.0.1:{side.port}"


def test_a_slow_engine_start_pages_nobody_and_a_death_pages(fake_vllm, sidecar_proc, prometheus, tmp_path):
    """Row 1: the sidecar starts before the engine; vLLM loads its model for a while (here
    12 s of 503, within a 30 s startup budget): no VLLMEngineDown, pending or firing,
    although kvguard_engine_up is 0 all along. Then the engine comes up and dies: it fires."""
    fake_vllm.health = 503
    side = sidecar_proc(fake_vllm.url, tmp_path / "state", "--startup-budget", "30")
    prom = prometheus([target(side)])
    busy_wait(lambda: (prom.value('count_over_time(kvguard_engine_state{state="starting"}[1m])') or 0) >= 12,
              timeout=60, interval=0.5)
    assert prom.alerts("VLLMEngineDown") == []
    assert prom.value('kvguard_engine_state{state="starting"}') == 1.0
    assert prom.value("kvguard_engine_up") == 0.0  # the old rule (engine_up == 0) would page here
    assert prom.value("max_over_time(kvguard_engine_state{state=\"dead\"}[1m])") == 0.0
    fake_vllm.health = 200
    busy_wait(lambda: prom.value('kvguard_engine_state{state="up"}') == 1.0, timeout=30, interval=0.5)
    fake_vllm.health = 503  # EngineCore died: vLLM answers /health with 503
    busy_wait(lambda: prom.firing("VLLMEngineDown"), timeout=30, interval=0.5)
    [alert] = prom.firing("VLLMEngineDown")
    assert alert["labels"]["severity"] == "critical" and alert["labels"]["state"] == "dead"
    assert prom.value("kvguard_engine_deaths_total") == 1.0


def test_not_coming_up_within_the_startup_budget_pages(fake_vllm, sidecar_proc, prometheus, tmp_path):
    fake_vllm.health = 503
    side = sidecar_proc(fake_vllm.url, tmp_path / "state", "--startup-budget", "3")
    prom = prometheus([target(side)])
    busy_wait(lambda: prom.firing("VLLMEngineDown"), timeout=60, interval=0.5)
    body = side.get("/status").json()
    assert body["engine"]["reason"] == "not up within the startup budget of 3 s"


VIOLATE = textwrap.dedent(
    """
    import sys
    from kvguard.guards.telemetry.metrics import GuardMetrics
    GuardMetrics(sys.argv[1]).violation("swa_pending_bound", "store_dropped")
    """
)


def test_a_planted_violation_fires_kvguard_invariant_violation(fake_vllm, sidecar_proc, prometheus, tmp_path):
    state = StateDir(tmp_path / "state").ensure()
    side = sidecar_proc(fake_vllm.url, state.root)
    prom = prometheus([target(side)])
    sel = 'kvguard_invariant_violations_total{check="swa_pending_bound",action="store_dropped"}'
    # the series exists at 0 before the plugin ever wrote (row 2), so the first event counts
    busy_wait(lambda: (prom.value(f"count_over_time({sel}[1m])") or 0) >= 2, timeout=60, interval=0.5)
    assert prom.value(sel) == 0.0
    assert prom.alerts("KVGuardInvariantViolation") == []
    subprocess.run([sys.executable, "-c", VIOLATE, str(state.root)], check=True)
    busy_wait(lambda: prom.firing("KVGuardInvariantViolation"), timeout=30, interval=0.5)
    [alert] = prom.firing("KVGuardInvariantViolation")
    assert (alert["labels"]["check"], alert["labels"]["action"], alert["labels"]["severity"]) == (
        "swa_pending_bound", "store_dropped", "critical",
    )


CRASH = textwrap.dedent(
    """
    # plays vLLM under kvguard run: EngineCore records a fatal exception (the plugin's own
    # recorder), then the API server exits 0 (vLLM #48966)
    import os
    from kvguard.guards.policy import fatal
    from kvguard.guards.settings import GuardSettings
    assert fatal.install(GuardSettings.from_env())
    assert fatal.record_exception(AssertionError("pending 129 > 128"), "running")
    """
)


def test_a_fatal_followed_at_once_by_a_restart_reaches_a_15s_prometheus(
    fake_vllm, sidecar_proc, prometheus, kvguard_run, tmp_path
):
    """Row 2: the fatal record and counter survive the kvguard run restart that follows
    1 s later, so a Prometheus scraping every 15 s sees increase() == 1 and /status still
    names the cause."""
    state = tmp_path / "state"
    env = {"KVGUARD_STATE_DIR": str(state)}
    first = kvguard_run(["--state-dir", str(state), "--termination-log", str(tmp_path / "t1"), "--",
                         "sh", "-c", "trap 'exit 0' TERM; while true; do sleep 0.05; done"], env=env)
    busy_wait(lambda: (state / "run.json").exists())
    side = sidecar_proc(fake_vllm.url, state)
    prom = prometheus([target(side)], scrape_interval="15s")
    sel = 'kvguard_engine_fatal_total{exception="AssertionError"}'
    busy_wait(lambda: prom.value(sel) == 0.0, timeout=60, interval=0.5)  # one scrape at 0
    first.proc.terminate()
    assert first.wait()[0] == 0
    crash = kvguard_run(["--state-dir", str(state), "--termination-log", str(tmp_path / "t2"), "--",
                         sys.executable, "-c", CRASH], env=env)
    code, out = crash.wait()
    assert code == 70, out
    time.sleep(1.0)  # the restart follows one second later
    restarted = kvguard_run(["--state-dir", str(state), "--", "sh", "-c",
                             "trap 'exit 0' TERM; while true; do sleep 0.05; done"], env=env)
    busy_wait(lambda: side.get("/status").json()["engine"]["state"] == "up", timeout=30)
    # two more 15 s scrapes
    busy_wait(lambda: (prom.value(f"count_over_time({sel}[10m])") or 0) >= 3, timeout=60, interval=1.0)
    assert prom.value(sel) == 1.0
    at = prom.value(f"timestamp({sel})")  # the newest scrape: increase() over samples 0 .. 1, exactly
    assert prom.value(f"increase({sel}[10m])", at=at) == 1.0
    assert prom.value(f"resets({sel}[10m])", at=at) == 0.0
    body = side.get("/status").json()
    assert body["last_fatal"]["exception"] == "AssertionError"
    assert body["last_fatal"]["message"] == "pending 129 > 128"
    assert body["engine"]["state"] == "up"  # the restarted engine is not latched dead
    restarted.proc.terminate()
    assert restarted.wait()[0] == 0


def test_an_unreadable_state_dir_fires_kvguard_sidecar_blind(fake_vllm, sidecar_proc, prometheus):
    d = Path(tempfile.mkdtemp(prefix="kvguard-blind-", dir="/tmp"))
    try:
        os.chmod(d, 0o755)
        state = StateDir(d).ensure()
        subprocess.run([sys.executable, "-c", VIOLATE, str(state.root)], check=True)
        if os.geteuid() == 0:
            for p in (state.root, state.metrics, *state.metrics.iterdir()):
                os.lchown(p, 1000, 1000)
            os.chmod(state.metrics, 0o700)  # as another user's umask 077 would leave it
        else:  # pragma: no cover - non-root CI
            os.chmod(state.metrics, 0o000)
        side = sidecar_proc(fake_vllm.url, state.root, foreign=True)
        prom = prometheus([target(side)])
        busy_wait(lambda: prom.firing("KVGuardSidecarBlind"), timeout=60, interval=0.5)
        [alert] = prom.firing("KVGuardSidecarBlind")
        assert alert["labels"]["severity"] == "warning"
        assert prom.value('kvguard_sidecar_unreadable{source="metrics_dir",reason="permission_denied"}') == 1.0
    finally:
        shutil.rmtree(d, ignore_errors=True)
