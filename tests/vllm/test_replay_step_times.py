"""The replay's per-step times and the full collections inside them (issue 31's bench).

``ReplayResult.step_full_gc_s`` is what ``bench/step_toggle.py --full-gc exclude`` takes out
of each step: a full collection forced inside one step's ``schedule()`` must show up on that
step, no more than the step's own time, and nowhere when the replay was not asked for it
(no ``before_step``: tests and the fuzzer replay without the ``gc`` callback).
"""

from __future__ import annotations

import gc
import time

import pytest

from kvguard.lab.replay import harness
from kvguard.lab.replay.trace import load_trace

pytestmark = pytest.mark.vllm

#: the step whose schedule() runs a full collection
FORCED_STEP = 3


def _replay_with_forced_collection(before_step):
    """Replay seed-48959 guarded (unguarded, the releases with vLLM's too-strict window
    assert die on it, #48959); ``schedule()`` of step FORCED_STEP runs ``gc.collect()``.
    Returns the result and the collection's CPU seconds as timed around it."""
    trace = load_trace("seed-48959")
    harness.install_guard("guard")  # before vLLM's offload modules are imported
    engine = harness.build_engine(trace.geometry)
    schedule = engine.scheduler.schedule
    calls = [0]
    forced = [0.0]

    def schedule_with_collection(*args, **kwargs):
        if calls[0] == FORCED_STEP:
            t0 = time.thread_time()
            gc.collect()  # generation 2: a full collection
            forced[0] = time.thread_time() - t0
        calls[0] += 1
        return schedule(*args, **kwargs)

    engine.scheduler.schedule = schedule_with_collection
    result = harness.run_replay(trace, guard=True, engine=engine, before_step=before_step)
    assert result.ok, result.error
    return result, forced[0]


def test_a_full_collection_inside_a_step_is_recorded_on_that_step() -> None:
    result, forced_s = _replay_with_forced_collection(before_step=lambda: None)
    assert len(result.step_full_gc_s) == len(result.step_cpu_s) == result.steps
    assert forced_s > 0
    recorded = result.step_full_gc_s[FORCED_STEP]
    # the callback's start/stop pair sits inside the timed gc.collect(): at most its time,
    # and all but the callbacks' own few microseconds of it
    assert forced_s * 0.5 <= recorded <= forced_s
    assert recorded <= result.step_cpu_s[FORCED_STEP]
    for cpu_s, gc_s in zip(result.step_cpu_s, result.step_full_gc_s):
        assert 0.0 <= gc_s <= cpu_s
    assert harness._on_full_gc not in gc.callbacks  # removed when the replay ended


def test_without_before_step_no_collection_is_recorded() -> None:
    result, forced_s = _replay_with_forced_collection(before_step=None)
    assert forced_s > 0
    assert len(result.step_full_gc_s) == result.steps
    assert set(result.step_full_gc_s) == {0.0}
