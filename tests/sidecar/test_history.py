"""Issue 12 row 2: a fatal outlives the restart that follows it; each process's counters
stay apart; the series alerts and panels use exist at 0 from the start."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient
from sidecartools import busy_wait, samples

from kvguard.guards.telemetry.statefile import FatalRecord, RunRecord, StateDir, write_fatal_record, write_run_record
from kvguard.sidecar.app import create_app
from kvguard.sidecar.collector import PRECREATED_EXCEPTIONS, read_metrics_dir
from kvguard.sidecar.config import SidecarConfig


def cfg(url, state_dir, **kw):
    return SidecarConfig(vllm_url=url, state_dir=state_dir, poll_interval=0.05, **kw)


def test_a_fatal_before_a_restart_stays_visible_and_the_new_start_is_up(fake_vllm, tmp_path):
    state = StateDir(tmp_path).prepare_run()
    t0 = time.time()
    write_run_record(state, RunRecord(started=t0, state="running", pid=1, child_pid=2))
    with TestClient(create_app(cfg(fake_vllm.url, tmp_path))) as client:
        busy_wait(lambda: client.get("/livez").status_code == 200)
        m = samples(client.get("/metrics").text)
        assert m[("kvguard_engine_fatal_total", (("exception", "AssertionError"),))] == 0.0  # exists at 0
        write_fatal_record(state, FatalRecord("AssertionError", "pending 129 > 128", "swa_pending_bound",
                                              time.time(), 2, "0.25.1", "running"))
        busy_wait(lambda: client.get("/status").json()["engine"]["state"] == "dead")
        # kvguard run restarts the child at once: prepare_run keeps the record, run.json is new
        state.prepare_run()
        write_run_record(state, RunRecord(started=time.time(), state="running", pid=1, child_pid=3))
        busy_wait(lambda: client.get("/livez").status_code == 200)
        body = client.get("/status").json()
        assert body["engine"]["state"] == "up" and body["engine"]["deaths"] == 1
        assert body["last_fatal"]["message"] == "pending 129 > 128" and body["fatal_history"] == 1
        m = samples(client.get("/metrics").text)
        assert m[("kvguard_engine_fatal_total", (("exception", "AssertionError"),))] == 1.0
        assert m[("kvguard_engine_state", (("state", "up"),))] == 1.0


def test_every_counter_an_alert_or_panel_uses_exists_at_0_before_the_plugin_writes(fake_vllm, tmp_path):
    StateDir(tmp_path).ensure()  # empty: vLLM has not loaded the plugin yet
    with TestClient(create_app(cfg(fake_vllm.url, tmp_path))) as client:
        m = samples(client.get("/metrics").text)
    from kvguard.guards import names

    for check in names.CHECKS:
        assert m[("kvguard_check_tolerated_total", (("check", check),))] == 0.0
        for action in names.ACTIONS:
            assert m[("kvguard_invariant_violations_total", (("action", action), ("check", check)))] == 0.0
    for stage in names.STAGES:
        assert m[("kvguard_guard_errors_total", (("stage", stage),))] == 0.0
    for exc in PRECREATED_EXCEPTIONS:
        assert m[("kvguard_engine_fatal_total", (("exception", exc),))] == 0.0
    assert m[("kvguard_engine_deaths_total", ())] == 0.0
    for state in ("starting", "up", "dead", "stopped"):
        assert ("kvguard_engine_state", (("state", state),)) in m


def test_a_new_process_with_the_same_pid_never_inherits_old_counts(tmp_path):
    """A restarted container's EngineCore often gets the old pid: its files are new."""
    from kvguard.guards.telemetry.metrics import GuardMetrics

    old = GuardMetrics(tmp_path)
    old.violation("swa_pending_bound", "raised")
    old.violation("swa_pending_bound", "raised")
    time.sleep(0.005)
    new = GuardMetrics(tmp_path)  # same pid, a new process lifetime
    new.violation("swa_pending_bound", "raised")
    files = sorted((tmp_path / "metrics").glob("counter_*.db"))
    assert len(files) == 2
    key = ("kvguard_invariant_violations_total", (("action", "raised"), ("check", "swa_pending_bound")))
    per_file = []
    for f in files:
        alone = tmp_path / f"alone-{f.stem}"
        alone.mkdir()
        (alone / f.name).write_bytes(f.read_bytes())
        fams, _ = read_metrics_dir(alone)
        per_file.append({(s.name, tuple(sorted(s.labels.items()))): s.value for fam in fams for s in fam.samples}[key])
    assert sorted(per_file) == [1.0, 2.0]  # apart; the sidecar sums them to 3
    fams, _ = read_metrics_dir(tmp_path / "metrics")
    assert {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in fams for s in fam.samples}[key] == 3.0


def test_run_record_round_trip_and_rejects(tmp_path):
    from kvguard.guards.telemetry.statefile import StateFileError, read_run_record

    state = StateDir(tmp_path)
    assert read_run_record(state) is None
    rec = RunRecord(started=12.5, state="stopping", pid=1, child_pid=7, stop_requested=True)
    write_run_record(state, rec)
    assert read_run_record(state) == rec
    assert (tmp_path / "run.json").stat().st_mode & 0o777 == 0o644
    (tmp_path / "run.json").write_text(json.dumps({"started": 1.0, "state": "zombie", "pid": 1}))
    with pytest.raises(StateFileError, match="unknown run state 'zombie'"):
        read_run_record(state)
