"""sidecar/health.py: the engine-state latch, as a pure function of probes."""

from __future__ import annotations

from kvguard.sidecar.health import EngineState, EngineTracker, Probe, RunView

UP = Probe(200, True, None, 1.0)
UP_NOT_READY = Probe(200, False, None, 1.0)
SICK = Probe(503, False, None, 2.0)
GONE = Probe(None, False, "ConnectError", 3.0)


def run(*steps):
    t = EngineTracker()
    out = []
    for step in steps:
        probe, fatal = step if isinstance(step, tuple) else (step, frozenset())
        out.append(t.observe(probe, frozenset(fatal)))
    return out


def test_starting_until_first_200_then_up_and_ready():
    s = run(GONE, SICK, UP_NOT_READY, UP)
    assert [x.state for x in s] == [EngineState.STARTING] * 2 + [EngineState.UP] * 2
    assert [x.live for x in s] == [False, False, True, True]
    assert [x.ready for x in s] == [False, False, False, True]
    assert s[-1].deaths == 0


def test_up_then_health_fails_is_one_death_latched_until_recovery():
    s = run(UP, SICK, GONE, GONE, UP, UP)
    assert [x.state for x in s] == [
        EngineState.UP, EngineState.DEAD, EngineState.DEAD, EngineState.DEAD, EngineState.UP, EngineState.UP,
    ]
    assert [x.deaths for x in s] == [0, 1, 1, 1, 1, 1]
    assert s[1].last_change == SICK.at


def test_fatal_record_kills_at_once_even_while_health_is_still_200():
    s = run(UP, (UP, {42}), (UP, {42}), (SICK, {42}), (GONE, {42}))
    assert [x.state for x in s][1:] == [EngineState.DEAD] * 4
    assert s[-1].deaths == 1  # the record and the failing health are one death
    assert not s[1].ready


def test_recovery_needs_a_failure_first_after_a_fatal_record():
    s = run(UP, (UP, {42}), (SICK, {42}), (UP, {42}))
    assert [x.state for x in s] == [EngineState.UP, EngineState.DEAD, EngineState.DEAD, EngineState.UP]


def test_startup_failure_with_fatal_record_counts_a_death():
    s = run(GONE, (GONE, {7}), GONE)
    assert [x.state for x in s] == [EngineState.STARTING, EngineState.DEAD, EngineState.DEAD]
    assert s[-1].deaths == 1


def test_second_death_after_recovery_counts_again():
    s = run(UP, SICK, UP, (UP, {9}), GONE, UP)
    assert [x.deaths for x in s] == [0, 1, 1, 2, 2, 2]
    assert s[-1].state is EngineState.UP


# --- row 1 of issue 12: starting / up / dead / stopped, and the startup budget -----------

from kvguard.sidecar.health import RunView


def at(probe: Probe, t: float) -> Probe:
    return Probe(probe.health_status, probe.models_ok, probe.error, t)


def test_a_ten_minute_model_load_stays_starting_within_the_budget():
    t = EngineTracker(startup_budget=600.0)
    states = [t.observe(at(GONE, 1000.0 + s)).state for s in (0, 60, 300, 599, 600)]
    assert states == [EngineState.STARTING] * 5
    assert t.snapshot.deaths == 0
    assert t.observe(at(UP, 1601.0)).state is EngineState.UP


def test_not_up_within_the_budget_is_a_death_with_a_reason():
    t = EngineTracker(startup_budget=600.0)
    t.observe(at(GONE, 1000.0))
    s = t.observe(at(GONE, 1600.5))
    assert (s.state, s.deaths) == (EngineState.DEAD, 1)
    assert s.reason == "not up within the startup budget of 600 s"
    assert t.observe(at(UP, 1700.0)).state is EngineState.UP  # came up late: up again


def test_a_new_kvguard_run_child_restarts_the_budget_and_clears_dead():
    t = EngineTracker(startup_budget=100.0)
    run1 = RunView(started=1000.0, state="running")
    assert t.observe(at(UP, 1001.0), run=run1).state is EngineState.UP
    s = t.observe(at(GONE, 1050.0), frozenset({(7, 1049.0)}), run=RunView(1000.0, "exited"))
    assert (s.state, s.deaths) == (EngineState.DEAD, 1)
    run2 = RunView(started=1060.0, state="running")
    s = t.observe(at(GONE, 1061.0), frozenset({(7, 1049.0)}), run=run2)
    assert (s.state, s.started_at, s.reason) == (EngineState.STARTING, 1060.0, None)
    assert t.observe(at(GONE, 1159.0), frozenset({(7, 1049.0)}), run=run2).state is EngineState.STARTING
    assert t.observe(at(UP, 1160.0), run=run2).state is EngineState.UP
    assert t.snapshot.deaths == 1


def test_a_requested_stop_is_stopped_not_dead():
    t = EngineTracker(startup_budget=100.0)
    t.observe(at(UP, 1.0), run=RunView(0.5, "running"))
    s = t.observe(at(SICK, 2.0), run=RunView(0.5, "stopping", stop_requested=True))
    assert (s.state, s.deaths, s.live) == (EngineState.STOPPED, 0, False)
    s = t.observe(at(GONE, 3.0), run=RunView(0.5, "exited", stop_requested=True))
    assert (s.state, s.deaths) == (EngineState.STOPPED, 0)
    s = t.observe(at(GONE, 500.0), run=RunView(0.5, "exited", stop_requested=True))
    assert s.state is EngineState.STOPPED  # the startup budget does not apply to a stop


def test_child_exit_without_stop_request_is_dead_at_once():
    t = EngineTracker()
    t.observe(at(UP, 1.0), run=RunView(0.5, "running"))
    s = t.observe(at(UP, 2.0), run=RunView(0.5, "exited"))
    assert (s.state, s.deaths, s.reason) == (
        EngineState.DEAD, 1, "the engine process exited without a stop request",
    )


# -- issue 23: kvguard run saw one of vLLM's processes die (run.json ``death``) ----------

DEATH = "vLLM process EngineCore_DP1 (pid 866) died"


def run_with(*steps):
    t = EngineTracker()
    return [t.observe(probe, frozenset(), view) for probe, view in steps]


def test_a_process_death_kills_at_once_while_health_is_still_200_and_never_revives():
    alive = RunView(100.0, "running")
    died = RunView(100.0, "running", death=DEATH)
    gone = RunView(100.0, "exited", death=DEATH)
    s = run_with((UP, alive), (UP, died), (UP, died), (SICK, died), (UP, died), (GONE, gone), (UP, gone))
    assert [x.state for x in s] == [EngineState.UP] + [EngineState.DEAD] * 6
    assert s[1].reason == DEATH and not s[1].live and not s[1].ready
    assert [x.deaths for x in s] == [0] + [1] * 6  # one death, however it shows next


def test_a_stop_requested_after_a_process_death_is_still_a_death():
    stopping = RunView(100.0, "stopping", stop_requested=True, death=DEATH)
    s = run_with((UP, RunView(100.0, "running")), (UP, stopping))
    assert s[-1].state is EngineState.DEAD and s[-1].reason == DEATH


def test_a_new_child_after_a_process_death_starts_again():
    s = run_with((UP, RunView(100.0, "exited", death=DEATH)), (GONE, RunView(200.0, "running")),
                 (UP, RunView(200.0, "running")))
    assert [x.state for x in s] == [EngineState.DEAD, EngineState.STARTING, EngineState.UP]
