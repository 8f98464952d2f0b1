"""sidecar/health.py: the engine-state latch, as a pure function of probes."""

from __future__ import annotations

from kvguard.sidecar.health import EngineState, EngineTracker, Probe

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
