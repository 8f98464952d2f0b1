"""guards/policy/fatal.py without vLLM: the record, the counter, the dead-pid sweep (light env).

The hooks into ``vllm.v1.engine.core`` are tested against the real module in
test_fatal.py (vLLM envs); here the recorder is called directly.
"""

from __future__ import annotations

import subprocess

import pytest

from kvguard.guards.telemetry.statefile import StateDir, read_fatal_records
from kvguard.sidecar.collector import StateDirCollector


@pytest.fixture
def fatal():
    from kvguard.guards.policy import fatal as mod

    yield mod
    mod.uninstall()


def settings(path):
    from kvguard.guards.settings import GuardSettings

    return GuardSettings(state_dir=path)


def test_without_a_state_dir_nothing_is_installed(fatal):
    from kvguard.guards.settings import GuardSettings

    assert fatal.install(GuardSettings(state_dir=None)) is False
    assert fatal.record_exception(RuntimeError("x")) is None


def test_record_and_count_once_per_process(fatal, tmp_path):
    assert fatal.install(settings(tmp_path))
    path = fatal.record_exception(AssertionError("pending 129 > 128"), "running")
    assert path.parent == tmp_path / "fatal" and path.name.startswith(f"{__import__('os').getpid()}-")
    assert fatal.record_exception(RuntimeError("later"), "running") is None
    records, errors = read_fatal_records(StateDir(tmp_path))
    assert errors == [] and [(r.exception, r.message, r.phase) for r in records] == [
        ("AssertionError", "pending 129 > 128", "running")
    ]
    counts = {
        s.labels["exception"]: s.value
        for fam in StateDirCollector(tmp_path / "metrics").collect()
        for s in fam.samples
        if s.name == "kvguard_engine_fatal_total"
    }
    assert counts == {"AssertionError": 1.0}


def test_system_exit_is_not_fatal(fatal, tmp_path):
    assert fatal.install(settings(tmp_path))
    assert fatal.record_exception(SystemExit(0)) is None
    assert read_fatal_records(StateDir(tmp_path)) == ([], [])


def test_unwritable_state_dir_never_raises(fatal, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    assert fatal.install(settings(blocker)) is False


def test_install_marks_dead_pids_live_gauges_dead(fatal, tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    metrics = StateDir(tmp_path).ensure().metrics
    for name in (f"gauge_livesum_{dead.pid}.db", f"gauge_liveall_{dead.pid}.db", f"counter_{dead.pid}.db",
                 f"gauge_livesum_{dead.pid}-1700000000000.db", f"counter_{dead.pid}-1700000000000.db",
                 f"gauge_livesum_{__import__('os').getpid()}.db"):
        (metrics / name).write_bytes(b"")
    assert fatal.install(settings(tmp_path))
    assert sorted(p.name for p in metrics.iterdir()) == sorted(
        [f"counter_{dead.pid}.db", f"counter_{dead.pid}-1700000000000.db", f"gauge_livesum_{__import__('os').getpid()}.db"]
    )
