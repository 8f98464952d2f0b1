"""sidecar/app.py: create_app(cfg) in process (TestClient runs the lifespan, so the real
poller polls a real fake-vLLM HTTP server), and once over real loopback HTTP (uvicorn)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sidecartools import FakeVllm, busy_wait, free_port

from kvguard.guards.telemetry.statefile import FatalRecord, StateDir, write_fatal_record
from kvguard.sidecar.app import create_app
from kvguard.sidecar.config import SidecarConfig


@pytest.fixture
def fake():
    f = FakeVllm()
    yield f
    f.stop()


def cfg(url: str, state_dir=None, **kw) -> SidecarConfig:
    return SidecarConfig(vllm_url=url, state_dir=state_dir, poll_interval=0.05, health_timeout=0.5, **kw)


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def write_mp(metrics_dir, code: str) -> None:
    """Run ``code`` in a fresh process with prometheus-client multiprocess mode on
    ``metrics_dir``: the real writer format, one pid per call."""
    env = {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", "from prometheus_client import *\n" + code], env=env, check=True)


def test_probes_follow_vllm_health(fake):
    with TestClient(create_app(cfg(fake.url))) as client:
        busy_wait(lambda: client.get("/livez").status_code == 200)
        assert busy_wait(lambda: client.get("/readyz").status_code == 200)
        assert client.get("/livez").json() == {"status": "ok", "engine": "up", "detail": None}
        fake.models = 500
        busy_wait(lambda: client.get("/readyz").status_code == 503)
        assert client.get("/livez").status_code == 200  # /v1/models is readiness only
        fake.health = 503
        busy_wait(lambda: client.get("/livez").status_code == 503)
        body = client.get("/livez").json()
        assert body == {"status": "fail", "engine": "dead", "detail": "vLLM /health answered 503"}
        m = samples(client.get("/metrics").text)
        assert m[("kvguard_engine_up", ())] == 0.0
        assert m[("kvguard_engine_deaths_total", ())] == 1.0
        fake.health, fake.models = 200, 200
        busy_wait(lambda: client.get("/readyz").status_code == 200)
        assert client.get("/status").json()["engine"]["deaths"] == 1


def test_starting_is_not_live(fake):
    fake.health = 503
    with TestClient(create_app(cfg(fake.url))) as client:
        busy_wait(lambda: client.get("/status").json()["engine"]["health_status"] == 503)
        assert client.get("/livez").status_code == 503
        assert client.get("/livez").json()["engine"] == "starting"
        assert client.get("/status").json()["engine"]["deaths"] == 0


def test_metrics_merge_multiprocess_files_across_pids(fake, tmp_path):
    state = StateDir(tmp_path).ensure()
    inc = "c = Counter('kvguard_check_evaluations', 'h', ['check']); c.labels('swa_pending_bound').inc({n})\n"
    write_mp(state.metrics, inc.format(n=3))
    write_mp(state.metrics, inc.format(n=4))
    write_mp(
        state.metrics,
        "Counter('kvguard_check_tolerated', 'h', ['check']).labels('swa_pending_bound').inc(2)\n"
        "Counter('kvguard_invariant_violations', 'h', ['check', 'action']).labels('swa_pending_bound', 'raise').inc()\n"
        "Counter('kvguard_engine_fatal', 'h', ['exception']).labels('AssertionError').inc()\n",
    )
    with TestClient(create_app(cfg(fake.url, tmp_path, vllm_version="0.32.0"))) as client:
        text = client.get("/metrics").text
        m = samples(text)
        assert m[("kvguard_check_evaluations_total", (("check", "swa_pending_bound"),))] == 7.0
        assert m[("kvguard_engine_fatal_total", (("exception", "AssertionError"),))] == 1.0
        assert m[("kvguard_build_info", (("kvguard_version", "0.1.0"), ("vllm_support", "measured"), ("vllm_version", "0.32.0")))] == 1.0
        assert text.count("# TYPE kvguard_engine_fatal_total counter") == 1
        status = client.get("/status").json()
        from kvguard.guards.names import CHECKS

        zero = {"evaluated": 0.0, "tolerated": 0.0, "violations": 0.0}
        assert status["checks"] == {  # every check exists at 0 (issue 12 row 2)
            **{c: zero for c in CHECKS},
            "swa_pending_bound": {"evaluated": 7.0, "tolerated": 2.0, "violations": 1.0},
        }
        assert m[("kvguard_invariant_violations_total", (("action", "store_dropped"), ("check", "group_sizes_consistency")))] == 0.0
        assert status["policy"] == "guard"
        assert status["versions"] == {"kvguard": "0.1.0", "vllm": "0.32.0"}


def test_status_names_the_waits_the_wait_bound_ended(fake, tmp_path):
    state = StateDir(tmp_path).ensure()
    inc = ("Counter('kvguard_wait_bound_exceeded', 'h', ['wait', 'action'])"
           ".labels('load_in_flight', 'request_failed').inc({n})\n")
    write_mp(state.metrics, inc.format(n=1))
    write_mp(state.metrics, inc.format(n=2))  # another EngineCore pid: summed
    write_mp(state.metrics, "Counter('kvguard_wait_bound_exceeded', 'h', ['wait', 'action'])"
                            ".labels('lookup_deferred', 'hit_reduced').inc()\n")
    with TestClient(create_app(cfg(fake.url, tmp_path))) as client:
        status = client.get("/status").json()
        assert status["waits_ended"] == {"load_in_flight": {"request_failed": 3.0},
                                         "lookup_deferred": {"hit_reduced": 1.0}}
        m = samples(client.get("/metrics").text)
        # every other series exists at 0 before its first event (the alert's increase() sees it)
        assert m[("kvguard_wait_bound_exceeded_total", (("action", "continued"), ("wait", "load_not_promoted")))] == 0.0
        assert m[("kvguard_wait_bound_exceeded_total", (("action", "request_failed"), ("wait", "load_in_flight")))] == 3.0


def test_fatal_record_turns_livez_503_and_is_reported(fake, tmp_path):
    state = StateDir(tmp_path).ensure()
    write_mp(state.metrics, "Counter('kvguard_engine_fatal', 'h', ['exception']).labels('AssertionError').inc()\n")
    with TestClient(create_app(cfg(fake.url, tmp_path))) as client:
        busy_wait(lambda: client.get("/livez").status_code == 200)
        rec = FatalRecord("AssertionError", "pending 129 > 128", "swa_pending_bound", 1234.5, 99, "0.25.1", "running")
        write_fatal_record(state, rec)
        write_fatal_record(state, FatalRecord("RuntimeError", "worker died", None, 1240.0, 98, "0.25.1", "running"))
        busy_wait(lambda: client.get("/livez").status_code == 503)
        # a poll between the two writes sees only the first record: wait for both
        busy_wait(lambda: client.get("/status").json()["fatal_history"] == 2)
        assert client.get("/livez").json()["detail"] == (
            "engine fatal during running: RuntimeError: worker died (pid=98)"
        )
        status = client.get("/status").json()
        assert status["engine"]["state"] == "dead"
        assert status["last_fatal"] == {
            "exception": "RuntimeError", "message": "worker died", "site": None,
            "time": 1240.0, "pid": 98, "phase": "running", "process": None,
        }
        m = samples(client.get("/metrics").text)
        # max(engine counter, records) per exception: nothing counted twice.
        assert m[("kvguard_engine_fatal_total", (("exception", "AssertionError"),))] == 1.0
        assert m[("kvguard_engine_fatal_total", (("exception", "RuntimeError"),))] == 1.0
        assert m[("kvguard_engine_deaths_total", ())] == 1.0
        assert ("kvguard_build_info", (("kvguard_version", "0.1.0"), ("vllm_support", "measured"), ("vllm_version", "0.32.0"))) in m


def errors(m: dict, source: str, reason: str) -> float:
    return m[("kvguard_sidecar_errors_total", (("reason", reason), ("source", source)))]


def unreadable(m: dict, source: str, reason: str) -> float:
    return m[("kvguard_sidecar_unreadable", (("reason", reason), ("source", source)))]


def test_missing_empty_and_corrupt_state_dir_are_served_and_counted(fake, tmp_path):
    missing = tmp_path / "missing"
    with TestClient(create_app(cfg(fake.url, missing, metrics_dir_grace=0))) as client:  # no grace: blind at once
        r = client.get("/metrics")
        assert r.status_code == 200
        assert errors(samples(r.text), "metrics_dir", "missing") == 1.0
        assert client.get("/status").status_code == 200

    state = StateDir(tmp_path / "s").ensure()
    with TestClient(create_app(cfg(fake.url, state.root))) as client:  # empty
        m = samples(client.get("/metrics").text)
        assert errors(m, "metrics_dir", "missing") == 0.0
        assert m[("kvguard_engine_up", ())] in (0.0, 1.0)

    write_mp(state.metrics, "Counter('kvguard_check_evaluations', 'h', ['check']).labels('x').inc(5)\n")
    (state.metrics / "counter_999999.db").write_bytes(b"\xff" * 64)  # corrupt
    (state.metrics / "gauge_max_999998.db").write_bytes(b"")  # being created: not an error
    (state.fatal / "777.json").write_text('{"exception": "Assert')  # torn record
    with TestClient(create_app(cfg(fake.url, state.root))) as client:
        busy_wait(lambda: client.get("/livez").status_code == 200)
        scraper = client.app.state.scraper
        for _ in range(3):  # one problem counts once, however often it is read (row 7)
            n = scraper.reads
            busy_wait(lambda: client.get("/metrics").status_code == 200 and scraper.reads > n)
            client.get("/status")
        assert scraper.reads >= 3
        r = client.get("/metrics")
        assert r.status_code == 200
        m = samples(r.text)
        assert m[("kvguard_check_evaluations_total", (("check", "x"),))] == 5.0
        assert errors(m, "metrics_file", "corrupt") == 1.0
        assert unreadable(m, "metrics_file", "corrupt") == 1.0
        assert errors(m, "fatal_record", "corrupt") == 1.0
        status = client.get("/status").json()
        assert status["last_fatal"] is None
        assert status["errors"]["metrics_file"] == 1 and status["errors"]["fatal_record"] == 1
        assert status["blind"] is True
        assert [(u["source"], u["path"], u["reason"]) for u in status["unreadable"]] == [
            ("fatal_record", "777.json", "corrupt"), ("metrics_file", "counter_999999.db", "corrupt"),
        ]


def test_healthz_and_openapi(fake):
    with TestClient(create_app(cfg(fake.url))) as client:
        busy_wait(lambda: client.get("/healthz").json()["last_poll_age_s"] is not None)
        assert client.get("/healthz").status_code == 200
        spec = client.get("/openapi.json").json()
        assert set(spec["paths"]) == {"/metrics", "/livez", "/readyz", "/status", "/healthz"}
        assert "StatusResponse" in spec["components"]["schemas"]


def test_over_real_loopback_http(fake):
    """uvicorn serving create_app on a real port; vLLM's server going away flips /livez."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(cfg(fake.url, port=port, host="127.0.0.1")), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{port}"

        def get(path: str) -> int:
            try:
                return httpx.get(base + path, timeout=2).status_code
            except httpx.HTTPError:
                return 0

        busy_wait(lambda: get("/readyz") == 200, timeout=20)
        assert "kvguard_engine_up 1.0" in httpx.get(base + "/metrics").text
        fake.stop()  # the API server process is gone: connection refused
        busy_wait(lambda: get("/livez") == 503, timeout=5)
        # the poll in flight when the server went away may end in ReadError (its kept-alive
        # connection closed); the next ones are refused
        busy_wait(lambda: (httpx.get(base + "/status").json()["engine"]["error"] or "").startswith("ConnectError"), timeout=5)
    finally:
        server.should_exit = True
        thread.join(10)
    assert not thread.is_alive()


def test_vllm_version_null_is_unknown_and_is_read_again_after_a_restart(fake):
    """Issue 12 row 9: `/version` answering null gave vllm_version="None", and the version
    was read once per sidecar life."""
    fake.version = None
    with TestClient(create_app(cfg(fake.url))) as client:
        busy_wait(lambda: client.get("/livez").status_code == 200)
        busy_wait(lambda: client.get("/status").json()["engine"]["polls"] > 3)
        m = samples(client.get("/metrics").text)
        assert m[("kvguard_build_info", (("kvguard_version", "0.1.0"), ("vllm_support", "unknown"), ("vllm_version", "unknown")))] == 1.0
        fake.health = 503  # the container restarts with another vLLM
        busy_wait(lambda: client.get("/livez").status_code == 503)
        fake.version, fake.health = "0.33.0", 200
        busy_wait(lambda: client.get("/status").json()["versions"]["vllm"] == "0.33.0")


def test_a_timeout_names_what_it_waited_for():
    from kvguard.sidecar.health import _describe_error

    assert _describe_error(httpx.ReadTimeout(""), 0.5) == "ReadTimeout: no answer within 0.5 s"
    assert _describe_error(httpx.ConnectError("[Errno 111] Connection refused"), 0.5) == (
        "ConnectError: [Errno 111] Connection refused"
    )


def test_build_info_says_whether_kvguard_was_measured_on_the_vllm_release(fake):
    """Issue 20 item 7: ``kvguard_build_info{vllm_support}`` is the plugin's own rule
    (:func:`kvguard.guards.hooking.sites.vllm_support`) on the version vLLM's ``/version`` reports:
    a newer release is served (never refused) as ``unmeasured``; after a restart on a
    measured release (a local build label ignored) it is ``measured``."""
    from packaging.version import Version

    from kvguard.guards.hooking.sites import MEASURED_VLLM_RELEASES

    newest = Version(MEASURED_VLLM_RELEASES[-1])
    newer = f"{newest.major}.{newest.minor + 1}.0"
    measured = f"{MEASURED_VLLM_RELEASES[-1]}+cu130"

    def build_info(client):
        m = samples(client.get("/metrics").text)
        return [labels for (name, labels) in m if name == "kvguard_build_info"]

    fake.version = newer
    with TestClient(create_app(cfg(fake.url))) as client:
        busy_wait(lambda: client.get("/status").json()["versions"]["vllm"] == newer)
        assert build_info(client) == [(("kvguard_version", "0.1.0"), ("vllm_support", "unmeasured"), ("vllm_version", newer))]
        fake.health = 503
        busy_wait(lambda: client.get("/livez").status_code == 503)
        fake.version, fake.health = measured, 200
        busy_wait(lambda: client.get("/status").json()["versions"]["vllm"] == measured)
        assert build_info(client) == [(("kvguard_version", "0.1.0"), ("vllm_support", "measured"), ("vllm_version", measured))]


def test_each_distinct_key_is_judged_once_across_scrapes(fake, tmp_path):
    """The per-key check (collector.judge_key) runs once per distinct (type, mode, key), not
    once per file or per scrape: its cost is paid when a key first appears."""
    from prometheus_client.mmap_dict import MmapedDict

    state = StateDir(tmp_path).ensure()
    for n in (1, 2, 3):  # three processes, the same keys
        write_mp(state.metrics, f"Counter('kvguard_check_evaluations', 'h', ['check']).labels('swa_pending_bound').inc({n})\n"
                                "Histogram('kvguard_swa_pending_bound_ratio', 'h', buckets=(0.5, 1.0)).observe(0.7)\n")
    distinct = {
        (f.name.split("_")[0], key)
        for f in state.metrics.glob("*.db")
        for key, _, _, _ in MmapedDict.read_all_values_from_file(str(f))
    }
    # two files per process; the counter key, 3 bucket keys (0.5, 1.0, +Inf) and _sum (_count is derived)
    assert len(list(state.metrics.glob("*.db"))) == 6 and len(distinct) == 1 + 3 + 1
    with TestClient(create_app(cfg(fake.url, tmp_path, metrics_max_age=0))) as client:
        scraper = client.app.state.scraper
        for _ in range(3):
            assert client.get("/metrics").status_code == 200
        assert scraper.reads == 3
        assert scraper.verdicts.judged == len(distinct)
        assert samples(client.get("/metrics").text)[("kvguard_check_evaluations_total", (("check", "swa_pending_bound"),))] == 6.0


def test_a_render_failure_serves_the_sidecar_series_and_flags_the_metrics_dir(fake, tmp_path, monkeypatch):
    """Belt and braces behind the per-file checks: should a family that cannot be rendered
    ever reach the exposition, /metrics still answers 200 with the sidecar's own series and
    the metrics dir counts as unusable (KVGuardSidecarBlind), instead of a 500 per request."""
    import kvguard.sidecar.app as app_mod
    from prometheus_client.core import Metric

    StateDir(tmp_path).ensure()
    bad = Metric("kvguard_bad", 5, "counter")  # a help text that is not a string
    bad.add_sample("kvguard_bad_total", {}, 1.0)
    monkeypatch.setattr(app_mod, "with_zero_counters", lambda families: [bad])
    with TestClient(create_app(cfg(fake.url, tmp_path, metrics_max_age=0))) as client:
        for _ in range(3):  # three reads, three failed renders: one problem, counted once
            r = client.get("/metrics")
            assert r.status_code == 200
        m = samples(r.text)
        assert unreadable(m, "metrics_dir", "unexpected") == 1.0 and errors(m, "metrics_dir", "unexpected") == 1.0
        assert ("kvguard_bad_total", ()) not in m and ("kvguard_engine_up", ()) in m
        status = client.get("/status").json()
        assert [(u["source"], u["reason"], u["detail"]) for u in status["unreadable"]] == [
            ("metrics_dir", "unexpected", "rendering: AttributeError: 'int' object has no attribute 'replace'"),
        ]
        assert client.app.state.scraper.reads >= 3
