"""Async scheduling in the replay (issue 10 item 1): vLLM's ``AsyncScheduler`` behind a
batch queue of depth 2 (marker vllm).

``geometry.async_scheduling`` makes the harness build the class vLLM's
``SchedulerConfig.get_scheduler_cls()`` gives for async scheduling and step it as
``EngineCore.step_with_batch_queue`` does (lab/replay/batch_queue.py): step N+1 is
scheduled before step N's output reaches ``update_from_output``. Asserted here: the seed
traces finish with no wrong KV under that lag, the lag is real (counters that are 0 on
the synchronous path), the generated tokens are the same as synchronously (the worker's
in-flight samples are the right ones), a release without the feature gets an error
naming the field, and the fuzzer draws the field deterministically.

Measured on vLLM 0.21.0, 0.25.1 and 0.33.0 (docs/replay.md, "Async scheduling").

Run: ``.venvs/vllm-0.33.0/bin/pytest -m vllm tests/vllm/test_async_scheduling.py``
"""

from __future__ import annotations

import dataclasses

import pytest

pytestmark = pytest.mark.vllm

from kvguard.lab.fuzz import runner, strategies  # noqa: E402
from kvguard.lab.replay import batch_queue, harness, report  # noqa: E402
from kvguard.lab.replay.trace import Trace, load_trace, parse_trace  # noqa: E402

SEED_TRACES = ("seed-48959", "seed-42945", "load-evicted-window")

# the guard and KVGUARD_DISABLE are restored after each module by tests/vllm/conftest.py


def _async(trace: Trace, on: bool = True) -> Trace:
    return dataclasses.replace(trace, geometry=dataclasses.replace(trace.geometry, async_scheduling=on))


def test_the_installed_release_supports_async_scheduling():
    # measured on 0.21.0, 0.25.1 and 0.33.0: AsyncScheduler, the config field and
    # Request.num_output_placeholders are there, and EngineCore's queue depth is 2
    assert batch_queue.unsupported() is None
    engine = harness.build_engine(_async(load_trace("seed-42945")).geometry)
    assert type(engine.scheduler).__name__ == "AsyncScheduler"
    assert engine.scheduler.vllm_config.scheduler_config.async_scheduling is True
    assert engine.batch_queue_depth == 2
    assert {f["field"] for f in strategies.not_generated()} >= {"external_hit_tokens"}
    assert "async_scheduling" not in {f["field"] for f in strategies.not_generated()}
    assert {"field": "async_scheduling", "reason": "--sync-scheduling: vLLM's synchronous Scheduler only"} in (
        strategies.not_generated(async_scheduling=False)
    )


@pytest.mark.parametrize("name", SEED_TRACES)
def test_seed_trace_finishes_under_async_scheduling_with_right_kv(name):
    """Guarded (seed-48959 and load-evicted-window are crash traces without kvguard on
    the releases they target): every request finishes, the oracle checked blocks and
    found none wrong, and the lag is real."""
    trace = _async(load_trace(name))
    result = harness.run_replay(trace, guard=True)
    assert result.engine_survived, result.error
    assert not result.stalled
    assert result.finished == result.submitted == len(trace.requests)
    assert result.wrong_kv_blocks == 0
    assert result.worker.oracle.checked_blocks > 0
    out = report.to_json(result, trace.geometry)["scheduling"]
    assert out["async_scheduling"] is True and out["batch_queue_depth"] == 2
    # every step after the first is scheduled while the previous output is outstanding
    assert out["scheduled_ahead"] == result.steps - 1
    assert out["placeholder_requests"] > 0


def test_async_outputs_equal_sync_outputs_and_sync_has_no_lag():
    """The same trace synchronously and asynchronously: the same generated tokens per
    request (the worker samples by output index; a wrong in-flight index would change
    them), no wrong KV either way, and the lag counters are 0 only synchronously."""
    trace = load_trace("seed-42945")
    sync = harness.run_replay(trace, guard=True)
    lagged = harness.run_replay(_async(trace), guard=True)
    assert sync.ok and lagged.ok
    assert sync.outputs and lagged.outputs == sync.outputs
    assert (sync.lag.scheduled_ahead, sync.lag.placeholder_requests) == (0, 0)
    assert lagged.lag.scheduled_ahead > 0 and lagged.lag.placeholder_requests > 0
    assert sync.async_scheduling is False and lagged.async_scheduling is True


def test_abort_and_slow_stores_while_a_step_is_in_flight():
    """Client aborts and stores completing two steps later, under the output lag: the
    aborted request's step is still in the batch queue when it is aborted. Every other
    request finishes, r1 loads r0's prefix back from the CPU tier, no wrong KV."""
    lines = [
        '{"kind": "header", "format": "kvguard-replay/1", "name": "async-abort", "geometry": '
        '{"tokens_per_block": 16, "tokens_per_chunk": 64, "sliding_window": 128, "num_gpu_blocks": 96, '
        '"cpu_chunks": 64, "max_num_batched_tokens": 512, "max_num_seqs": 4, "max_model_len": 4096, '
        '"vocab_size": 1000, "async_scheduling": true}, "worker": {"store_latency_steps": 2, "load_latency_steps": 1}}',
        '{"kind": "request", "id": "r0", "prompt": [{"seed": 1, "tokens": 512}], "max_tokens": 4}',
        '{"kind": "request", "id": "gone", "prompt": [{"seed": 5, "tokens": 300}], "max_tokens": 8, "abort_at_step": 2}',
        '{"kind": "request", "id": "filler", "after": "r0", "prompt": [{"seed": 3, "tokens": 640}], "max_tokens": 4}',
        '{"kind": "request", "id": "r1", "after": "filler", "prompt": [{"seed": 1, "tokens": 576}], "max_tokens": 4}',
    ]
    trace = parse_trace(lines)
    assert trace.geometry.async_scheduling is True
    assert parse_trace(trace.dumps().splitlines()) == trace
    result = harness.run_replay(trace, guard=True)
    assert result.engine_survived and not result.stalled, result.error
    assert (result.finished, result.aborted, result.submitted) == (3, 1, 4)
    assert result.ok and result.wrong_kv_blocks == 0
    assert result.hits["r1"]["external_hit_tokens"] > 0
    assert result.worker.oracle.loaded_blocks > 0
    assert result.lag.scheduled_ahead == result.steps - 1


def test_a_release_without_async_scheduler_gets_an_error_naming_the_field(monkeypatch):
    """Feature detection, not a version table: with ``AsyncScheduler`` taken out of the
    installed vLLM's module (what a release without it looks like), the harness refuses
    a trace that sets the field, and the fuzzer reports the field as not generated."""
    from vllm.v1.core.sched import async_scheduler

    monkeypatch.delattr(async_scheduler, "AsyncScheduler")
    monkeypatch.setattr(strategies, "_ASYNC_WHY", strategies._UNKNOWN)
    why = batch_queue.unsupported()
    assert why is not None and "AsyncScheduler" in why
    with pytest.raises(RuntimeError, match=r"async_scheduling \(geometry.async_scheduling\)"):
        harness.build_engine(_async(load_trace("seed-42945")).geometry)
    (entry,) = [f for f in strategies.not_generated() if f["field"] == "async_scheduling"]
    assert "AsyncScheduler" in entry["reason"]
    monkeypatch.undo()
    strategies._ASYNC_WHY = strategies._UNKNOWN
    assert batch_queue.unsupported() is None


def test_fuzz_draws_async_scheduling_deterministically(tmp_path):
    """Same seed, same release: the same examples, the same async ones; some are async,
    some not; --sync-scheduling draws none."""
    a = runner.fuzz(seed=3, examples=12, guard=False, out_dir=tmp_path / "a", shrink_replays=0)
    b = runner.fuzz(seed=3, examples=12, guard=False, out_dir=tmp_path / "b", shrink_replays=0)
    s = runner.fuzz(seed=3, examples=12, guard=False, out_dir=tmp_path / "s", shrink_replays=0,
                    async_scheduling=False)
    assert a["async_scheduling"] is True and s["async_scheduling"] is False
    assert 0 < a["async_scheduling_examples"] < a["examples"]
    for key in ("async_scheduling_examples", "examples", "steps", "requests", "engine_deaths"):
        assert a[key] == b[key], key
    assert [(c["class"], c["count"]) for c in a["classes"]] == [(c["class"], c["count"]) for c in b["classes"]]
    assert s["async_scheduling_examples"] == 0
    assert any(f["field"] == "async_scheduling" for f in s["not_generated"])
