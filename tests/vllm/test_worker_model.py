"""The replay's worker model and stall detector on the real vLLM scheduler (marker vllm).

The worker side is vLLM's own worker-role ``OffloadingConnector`` over the simulated copy
engine (lab/replay/worker.py); the timing and faults come from the trace's ``worker``
object (lab/replay/jobs.py). Outcomes asserted here hold on every full release; where
a release decides differently (a failed transfer), the expectation is read from its code.

Run: ``KVGUARD_EXPECT_VLLM=0.33.0 .venvs/vllm-0.33.0/bin/pytest -m vllm tests/vllm/test_worker_model.py``
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

from kvguard.lab.replay import harness, report, vllm_api  # noqa: E402
from kvguard.lab.replay.jobs import WorkerModel  # noqa: E402
from kvguard.lab.replay.trace import Trace, load_trace, parse_trace  # noqa: E402

def _small(worker: dict | None = None, gpu: int = 96, reqs: list[dict] | None = None) -> Trace:
    """r0 is stored, a filler evicts it from the GPU, r1 (r0's prompt + 64) loads it back."""
    header = {
        "kind": "header",
        "format": "kvguard-replay/1",
        "name": "small",
        "geometry": {"tokens_per_block": 16, "tokens_per_chunk": 64, "sliding_window": 128,
                     "num_gpu_blocks": gpu, "cpu_chunks": 64, "max_num_batched_tokens": 512,
                     "max_num_seqs": 4, "max_model_len": 4096, "vocab_size": 1000},
        "worker": worker or {},
    }
    reqs = reqs or [
        {"kind": "request", "id": "r0", "prompt": [{"seed": 1, "tokens": 512}], "max_tokens": 4},
        {"kind": "request", "id": "filler", "after": "r0",
         "prompt": [{"seed": 3, "tokens": 640}], "max_tokens": 4},
        {"kind": "request", "id": "r1", "after": "filler",
         "prompt": [{"seed": 1, "tokens": 512}, {"seed": 2, "tokens": 64}], "max_tokens": 4},
    ]
    return parse_trace([json.dumps(o) for o in [header, *reqs]], source="small")


def _replay(trace: Trace, guard: bool = False) -> tuple[harness.ReplayResult, dict[str, Any]]:
    result = harness.run_replay(trace, guard=guard)
    return result, report.to_json(result, trace.geometry)


@pytest.fixture(scope="module")
def seed_runs() -> dict[str, tuple[harness.ReplayResult, dict[str, Any]]]:
    """seed-48959 with latency 0 and with 0..4-step latency (guard on: 0.21.0 would die
    of the #48959 bound without it)."""
    trace = load_trace("seed-48959")
    slow = dataclasses.replace(
        trace,
        worker=WorkerModel.from_json(
            {"load_latency_steps": {"min": 0, "max": 4},
             "store_latency_steps": {"min": 0, "max": 4}, "seed": 7}
        ),
    )
    return {"instant": _replay(trace, guard=True), "slow": _replay(slow, guard=True)}


def test_latency_finishes_every_request_with_the_same_tokens(seed_runs) -> None:
    (fast, fast_out), (slow, slow_out) = seed_runs["instant"], seed_runs["slow"]
    for res, out in ((fast, fast_out), (slow, slow_out)):
        assert res.ok, out
        assert out["requests"]["finished"] == 4 and out["stalls"] == []
        assert out["wrong_kv_blocks"] == 0 and out["pending_store_keys"] == 0
        assert out["worker"]["jobs_in_flight"] == []
    assert slow.outputs == fast.outputs
    assert {rid: len(t) for rid, t in slow.outputs.items()} == {
        r.id: r.max_tokens for r in load_trace("seed-48959").requests
    }
    # the same jobs, completed later and out of order
    assert slow_out["worker"]["jobs_submitted"] == fast_out["worker"]["jobs_submitted"]
    assert fast_out["worker"]["out_of_order_completions"] == 0
    assert slow_out["worker"]["out_of_order_completions"] > 0
    assert slow_out["steps"] > fast_out["steps"]


def test_out_of_order_completion_on_the_small_trace_keeps_kv_right() -> None:
    """Three concurrent requests, then one that loads the first one's prefix back."""
    reqs = [
        {"kind": "request", "id": rid, "prompt": [{"seed": seed, "tokens": 256}], "max_tokens": 130}
        for rid, seed in (("a", 1), ("b", 2), ("c", 3))
    ] + [
        {"kind": "request", "id": "filler", "after": "c",
         "prompt": [{"seed": 4, "tokens": 768}], "max_tokens": 4},
        {"kind": "request", "id": "d", "after": "filler",
         "prompt": [{"seed": 1, "tokens": 256}, {"seed": 5, "tokens": 64}], "max_tokens": 4},
    ]
    # seed 1: the first store (a's prefill) takes 4 steps, the second (b's) 0
    worker = {"load_latency_steps": {"min": 0, "max": 6},
              "store_latency_steps": {"min": 0, "max": 6}, "seed": 1}
    res, out = _replay(_small(worker, gpu=128, reqs=reqs))
    base, base_out = _replay(_small(gpu=128, reqs=reqs))
    assert res.ok and out["wrong_kv_blocks"] == 0, out
    assert res.outputs == base.outputs
    done = res.worker.queue.completed
    assert any(a.job_id > b.job_id for a, b in zip(done, done[1:]))  # a later job first
    assert out["worker"]["out_of_order_completions"] > 0
    assert base_out["worker"]["out_of_order_completions"] == 0
    assert "d" in [ld["request_id"] for ld in out["worker"]["loads"]]
    assert out["worker"]["kv_oracle"]["loaded_blocks"] > 0


@pytest.mark.parametrize("guard", [False, True], ids=["no-guard", "guard"])
@pytest.mark.parametrize("fault", ["fail_load_jobs", "fail_store_jobs"])
def test_a_failed_transfer(fault: str, guard: bool) -> None:
    """What a failed transfer costs is the release's own decision, read from its code.

    Where the connector worker asserts ``transfer_result.success``
    (:func:`~kvguard.lab.replay.vllm_api.failed_transfer_assert`; 0.21.0-0.33.0, "we
    currently do not support job failures") the worker, and EngineCore, dies at that
    assert: no recompute, no failed request. Where it reports the job failed instead
    (0.34.0), the engine stays up: a failed store leaves its chunks unloadable, so the
    later turn recomputes them (same tokens as without the fault); a failed load is handled
    by the release's ``kv_load_failure_policy`` default (``"fail"``: the request fails
    alone; ``"recompute"``: it finishes with the same tokens). Either way no wrong KV, and
    kvguard changes nothing (the same outcome guarded and unguarded)."""
    site = vllm_api.failed_transfer_assert()
    res, out = _replay(_small({fault: [0]}), guard=guard)
    (failed,) = out["worker"]["failed_jobs"]
    assert failed["store"] is (fault == "fail_store_jobs")
    assert failed["request_id"] == ("r1" if fault == "fail_load_jobs" else "r0")
    # the failed load copied nothing into the GPU, and no request read wrong KV
    assert out["worker"]["kv_oracle"]["loaded_blocks"] == 0
    assert out["wrong_kv_blocks"] == 0
    if site is not None:
        assert out["engine_survived"] is False
        assert out["error"].startswith("AssertionError: ") and "success" in out["error"]
        assert out["error_site"] == site
        assert out["requests"]["finished"] == (2 if fault == "fail_load_jobs" else 0)
        assert out["requests"]["failed"] == 0
        return
    base, _ = _replay(_small())
    assert out["engine_survived"] is True and out["stalled"] is False
    if fault == "fail_store_jobs" or vllm_api.load_failure_policy() == "recompute":
        assert res.ok and res.outputs == base.outputs
        if fault == "fail_store_jobs":
            assert out["worker"]["loads"] == []  # r0's chunks never became loadable
    else:
        assert vllm_api.load_failure_policy() == "fail"
        assert [f["request_id"] for f in out["failed_requests"]] == ["r1"]
        assert out["requests"]["finished"] == 2
        assert {rid: res.outputs[rid] for rid in ("r0", "filler")} == {
            rid: base.outputs[rid] for rid in ("r0", "filler")
        }


def test_the_fuzzer_draws_failed_transfers_only_where_the_release_supports_them() -> None:
    """The generator draws a failed transfer only where the installed worker reports one and
    goes on (0.34.0); where it asserts every transfer succeeded (0.21.0-0.33.0, read from its
    code) no generated trace fails a job, its latencies still drawn, and ``not_generated``
    names the assert. Drawn there, the lab's own fault killed both engines wherever a
    schedule put it, and a guard that moved the schedule looked worse than vLLM alone."""
    from kvguard.lab.fuzz import runner, strategies

    site = vllm_api.failed_transfer_assert()
    workers = [t.worker for t in runner.generate(7, 60) if t.geometry.connector != "SimpleCPUOffloadConnector"]
    assert len(workers) > 20
    failing = [w for w in workers if w.load_faults.rate or w.store_faults.rate]
    slow = [w for w in workers if w.load_latency.max or w.store_latency.max]
    assert slow  # the latency draws stay
    listed = {n["field"]: n["reason"] for n in strategies.not_generated()}
    if site is None:
        assert failing and "worker.fail_loads/fail_stores" not in listed
    else:
        assert failing == [] and site in listed["worker.fail_loads/fail_stores"]


def test_the_dependants_of_a_request_failed_after_its_load_never_arrive() -> None:
    """A request that waits for one vLLM failed (0.34.0: its load failed, policy "fail")
    never arrives, nor does one that waits for it: the replay ends, no stall. Before the
    fix the second-level dependant stayed pending and the replay reported a stall with
    every arrived request ended (``kvguard fuzz --guard`` seed 0 on 0.34.0, examples 41-42).
    Where the worker asserts a transfer's success the engine dies first (nothing to see)."""
    if vllm_api.failed_transfer_assert() is not None or vllm_api.load_failure_policy() != "fail":
        pytest.skip("a failed load does not fail the request alone on this release "
                    f"(worker assert: {vllm_api.failed_transfer_assert()}, policy: {vllm_api.load_failure_policy()})")
    reqs = [
        {"kind": "request", "id": "r0", "prompt": [{"seed": 1, "tokens": 512}], "max_tokens": 4},
        {"kind": "request", "id": "filler", "after": "r0", "prompt": [{"seed": 3, "tokens": 640}], "max_tokens": 4},
        {"kind": "request", "id": "r1", "after": "filler",
         "prompt": [{"seed": 1, "tokens": 512}, {"seed": 2, "tokens": 64}], "max_tokens": 4},
        {"kind": "request", "id": "r2", "after": "r1", "prompt": [{"seed": 4, "tokens": 32}], "max_tokens": 2},
        {"kind": "request", "id": "r3", "after": "r2", "prompt": [{"seed": 5, "tokens": 32}], "max_tokens": 2},
    ]
    res, out = _replay(_small({"fail_load_jobs": [0]}, reqs=reqs))
    assert out["stalled"] is False and out["engine_survived"] is True
    assert [f["request_id"] for f in out["failed_requests"]] == ["r1"]
    assert out["requests"]["not_arrived"] == 2 and out["requests"]["finished"] == 2
    # never sent behind a failed request: ranked with the failure by the differential
    assert {r: res.request_fates[r] for r in ("r1", "r2", "r3")} == {
        "r1": "failed", "r2": "not_arrived", "r3": "not_arrived"}


def test_a_load_that_never_completes_is_named() -> None:
    res, out = _replay(_small({"hang_load_jobs": [0]}))
    assert out["stalled"] is True and out["engine_survived"] is True
    (stall,) = out["stalls"]
    assert stall["request_id"] == "r1"
    assert stall["status"] == "WAITING_FOR_REMOTE_KVS"
    assert stall["kind"] == "load_never_completes"
    assert stall["waiting_steps"] == harness.STALL_STEPS
    (load,) = stall["connector"]["pending_loads"]
    assert load["hung"] is True
    assert stall["connector"]["transfer_jobs"] == [{"job_id": load["job_id"], "store": False}]


def test_a_store_that_never_completes_hangs_the_flush_of_its_blocks() -> None:
    """Measured: vLLM fences the blocks of a pending store; the filler's allocation reuses
    r0's freed blocks, so vLLM's worker waits on r0's store (``jobs_to_flush``) forever
    before r1 ever looks it up."""
    res, out = _replay(_small({"hang_store_jobs": [0]}))
    assert out["stalled"] is True and out["engine_survived"] is True
    (stall,) = out["stalls"]
    assert stall["request_id"] == "filler"
    assert stall["kind"] == "flush_waits_forever"
    assert stall["blocked_by"] == [{"job_id": 0, "request_id": "r0"}]
    assert out["requests"] == {"submitted": 2, "finished": 1, "aborted": 0, "failed": 0, "not_arrived": 0}
    assert out["pending_store_keys"] > 0  # r0's chunks stay "being written"


def test_a_prompt_larger_than_the_gpu_waits_for_blocks() -> None:
    reqs = [{"kind": "request", "id": "big", "prompt": [{"seed": 1, "tokens": 1200}], "max_tokens": 2}]
    _res, out = _replay(_small(gpu=48, reqs=reqs))
    assert out["stalled"] is True
    assert [(s["request_id"], s["status"], s["kind"], s["waiting_steps"]) for s in out["stalls"]] == [
        ("big", "WAITING", "waiting_for_blocks", harness.STALL_STEPS)
    ]


def test_memory_pressure_preempts_and_readmits() -> None:
    reqs = [
        {"kind": "request", "id": rid, "prompt": [{"seed": seed, "tokens": 150}], "max_tokens": 300}
        for rid, seed in (("a", 1), ("b", 2))
    ]
    worker = {"load_latency_steps": {"min": 0, "max": 3},
              "store_latency_steps": {"min": 0, "max": 3}, "seed": 1}
    res, out = _replay(_small(worker, gpu=64, reqs=reqs))
    assert res.ok and out["wrong_kv_blocks"] == 0
    assert sum(out["preemptions"].values()) > 0
    assert {rid: len(t) for rid, t in res.outputs.items()} == {"a": 300, "b": 300}


def test_same_seed_same_report() -> None:
    worker = {"load_latency_steps": {"min": 0, "max": 5}, "store_latency_steps": {"min": 1, "max": 3},
              "seed": 5, "fail_loads": {"rate": 0.0}}
    one = _replay(_small(worker))[1]
    two = _replay(_small(worker))[1]
    one.pop("wall_s"), two.pop("wall_s")
    assert one == two
    other = _replay(_small({**worker, "seed": 6}))[1]
    other.pop("wall_s")
    assert other["worker"]["model"]["seed"] == 6 and one["worker"]["model"]["seed"] == 5


def test_a_drawn_failure_follows_the_transfer_not_the_job_count() -> None:
    """fault-moved-by-tier-publish-034.jsonl (fuzz seed 13, 0.34.0, two engines over an fs
    tier, 30% of loads fail): guarded, ``tier_publish`` withholds partial chunks and one
    promotion fewer is issued. When the worker drew failures per job in submission order,
    that moved the one failure onto another request (the differential's false 'worse').
    Drawn per transfer (the request and its count of loads), every request the guarded run
    fails is one vLLM alone fails too, and at least one is failed by both. (0.25.1 to 0.33.0
    recompute after a failed load in this trace: no request fails on either side.)"""
    from guardtools_vllm import expressible

    trace = load_trace(str(Path(__file__).parent / "traces" / "fault-moved-by-tier-publish-034.jsonl"))
    if not expressible(trace):
        pytest.skip("no vLLM fs tier on this release: the trace's secondary_tiers cannot be expressed")
    failed = {}
    for guard in (False, True):
        out = _replay(trace, guard=guard)[1]
        assert out["wrong_kv_blocks"] == 0 and not out["stalled"]
        failed[guard] = {f["request_id"] for f in out["failed_requests"]}
    assert failed[True] <= failed[False], failed
    if failed[False]:  # a release that fails a request on a failed load (0.34.0's policy)
        assert failed[True] & failed[False], failed
