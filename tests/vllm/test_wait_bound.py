"""The wait bound (guards/checks/wait_bound.py) on the real vLLM scheduler and connector (marker vllm).

Every wait the offload path creates must end: guarded, each stall class of
``tests/vllm/traces/`` and each fault that leaves a wait with nothing to end it (a load
whose completion is never reported) ends with every request finished or failed alone,
0 wrong-KV blocks; a healthy wait (a slow worker, the seed and degrade traces) is never
ended. The replay runs on simulated time: the bound is ``KVGUARD_WAIT_BOUND_STEPS``
(32) observations without progress, seconds 0.

Run: ``KVGUARD_EXPECT_VLLM=0.34.0 .venvs/vllm-0.34.0/bin/pytest -m vllm tests/vllm/test_wait_bound.py``
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

from kvguard.guards import names  # noqa: E402
from kvguard.lab.replay import harness, report  # noqa: E402
from kvguard.lab.replay.trace import Trace, load_trace, parse_trace  # noqa: E402
from guardtools_vllm import expressible  # noqa: E402
from release_facts import fact  # noqa: E402

TRACES = Path(__file__).parent / "traces"
BOUND = names.DEFAULT_WAIT_BOUND_STEPS


def _small(worker: dict, reqs: list[dict] | None = None, gpu: int = 96) -> Trace:
    """r0 is stored, a filler evicts it from the GPU, r1 (r0's prompt + 64) loads it back
    from the CPU tier (an async load); ``other`` arrives with r1 and shares nothing."""
    header = {
        "kind": "header", "format": "kvguard-replay/1", "name": "wait-bound-small",
        "geometry": {"tokens_per_block": 16, "tokens_per_chunk": 64, "sliding_window": 128,
                     "num_gpu_blocks": gpu, "cpu_chunks": 64, "max_num_batched_tokens": 512,
                     "max_num_seqs": 4, "max_model_len": 4096, "vocab_size": 1000},
        "worker": worker,
    }
    reqs = reqs or [
        {"kind": "request", "id": "r0", "prompt": [{"seed": 1, "tokens": 512}], "max_tokens": 4},
        {"kind": "request", "id": "filler", "after": "r0", "prompt": [{"seed": 3, "tokens": 640}], "max_tokens": 4},
        {"kind": "request", "id": "r1", "after": "filler",
         "prompt": [{"seed": 1, "tokens": 512}, {"seed": 2, "tokens": 64}], "max_tokens": 4},
        {"kind": "request", "id": "other", "after": "filler", "prompt": [{"seed": 9, "tokens": 96}], "max_tokens": 40},
    ]
    return parse_trace([json.dumps(o) for o in [header, *reqs]], source="wait-bound-small")


def _replay(trace: Trace, guard: bool = True, policy: str = "guard") -> dict[str, Any]:
    if not guard:
        harness.uninstall_guard()
    result = harness.run_replay(trace, guard=guard, policy=policy)
    return report.to_json(result, trace.geometry)


def _acted(out: dict[str, Any]) -> dict[str, int]:
    """``<wait>:<action>`` counts of the wait bound in a guarded replay's report."""
    counts = (out.get("checks") or {}).get(names.CHECK_WAIT_BOUND) or {}
    return {k: v for k, v in counts.items() if ":" in k}


def _ended(out: dict[str, Any]) -> bool:
    r = out["requests"]
    return not out["stalled"] and r["finished"] + r["failed"] + r["aborted"] == r["submitted"]


# -- a load whose completion never comes ---------------------------------------------------
def test_unguarded_a_hung_load_waits_forever() -> None:
    out = _replay(_small({"hang_load_jobs": [0]}), guard=False)
    assert out["stalled"] is True
    assert {s["request_id"]: s["kind"] for s in out["stalls"]} == {"r1": "load_never_completes"}


def test_guard_fails_the_request_of_a_hung_load_alone() -> None:
    out = _replay(_small({"hang_load_jobs": [0]}))
    assert _ended(out), out["stalls"]
    (failed,) = out["failed_requests"]
    assert failed["request_id"] == "r1"
    assert "wait_bound" in failed["error"] and names.WAIT_LOAD_IN_FLIGHT in failed["error"]
    assert out["requests"]["finished"] == 3  # r0, filler and other, whose run never noticed
    assert out["wrong_kv_blocks"] == 0
    assert _acted(out) == {f"{names.WAIT_LOAD_IN_FLIGHT}:{names.ACTION_REQUEST_FAILED}": 1}


def test_observe_counts_a_hung_load_once_and_changes_nothing() -> None:
    out = _replay(_small({"hang_load_jobs": [0]}), policy="observe")
    assert out["stalled"] is True and out["failed_requests"] == []
    assert _acted(out) == {f"{names.WAIT_LOAD_IN_FLIGHT}:{names.ACTION_CONTINUED}": 1}


def test_strict_raises_naming_the_wait() -> None:
    out = _replay(_small({"hang_load_jobs": [0]}), policy="strict")
    assert out["engine_survived"] is False
    assert "AssertionError" in out["error"] and names.WAIT_LOAD_IN_FLIGHT in out["error"]


# -- a slow worker is not a stall ----------------------------------------------------------
@pytest.mark.parametrize("latency", [BOUND // 2, BOUND - 4])
def test_a_slow_worker_below_the_bound_is_never_cut(latency: int) -> None:
    out = _replay(_small({"load_latency_steps": latency, "store_latency_steps": latency}))
    assert out["requests"]["finished"] == out["requests"]["submitted"] == 4
    assert _acted(out) == {} and out["failed_requests"] == []
    assert out["wrong_kv_blocks"] == 0


def test_a_load_slower_than_the_bound_is_ended() -> None:
    """The bound is what it says: a load reported after 2 x 32 steps is ended at 32."""
    out = _replay(_small({"load_latency_steps": 2 * BOUND}))
    assert _ended(out)
    assert [f["request_id"] for f in out["failed_requests"]] == ["r1"]
    assert out["wrong_kv_blocks"] == 0


# -- the stall classes of tests/vllm/traces ------------------------------------------------
def test_the_waiting_scan_stall_ends_guarded() -> None:
    """vllm#45388's shape (stall-remote-kvs-hol-021.jsonl): guarded, the reported request the
    scan never reaches is sent back through vLLM's failed-receive path (its blocks freed,
    ``recomputed``: guards/policy/recompute.py), the head it blocked then runs, and every
    request finishes on the right KV: none is failed."""
    trace = load_trace(str(TRACES / "stall-remote-kvs-hol-021.jsonl"))
    out = _replay(trace)
    assert _ended(out) and out["wrong_kv_blocks"] == 0
    assert out["failed_requests"] == [] and out["requests"]["finished"] == out["requests"]["submitted"]
    if fact("remote_kvs_hol_stalls"):
        assert _acted(out) == {f"{names.WAIT_LOAD_NOT_PROMOTED}:{names.ACTION_RECOMPUTED}": 1}
    else:
        assert _acted(out) == {}


def test_the_async_waiting_scan_stall_ends_guarded() -> None:
    """stall-remote-kvs-hol-029.jsonl (fuzz seed 5360 on 0.29.0, async scheduling): where vLLM
    alone leaves a reported load unpromoted behind a head that cannot allocate (vllm#45388's
    scan), guarded the wait bound recomputes that one request and every request finishes
    (before the recompute took the request out of 0.29.0's admission bookkeeping,
    ``_inflight_prefills``, the head still could not be admitted and the replay stalled
    again); where vLLM alone finishes the trace, the guard changes nothing. The expectation
    is the release's own unguarded outcome, measured in the same test."""
    trace = load_trace(str(TRACES / "stall-remote-kvs-hol-029.jsonl"))
    if not expressible(trace):
        pytest.skip("not expressible on this release (guardtools_vllm.expressible)")
    plain = _replay(trace, guard=False)
    out = _replay(trace)
    assert _ended(out) and out["wrong_kv_blocks"] == 0
    r = out["requests"]
    assert out["failed_requests"] == [] and r["finished"] == r["submitted"]
    if plain["stalled"]:
        assert "remote_kvs_never_promoted" in {s["kind"] for s in plain["stalls"]}
        assert _acted(out) == {f"{names.WAIT_LOAD_NOT_PROMOTED}:{names.ACTION_RECOMPUTED}": 1}
    else:
        assert _acted(out) == {}
        assert r["finished"] == plain["requests"]["finished"] == r["submitted"]


def test_every_release_has_the_failed_receive_path_the_recompute_binds() -> None:
    """guards/policy/recompute.py binds by structure: on every full release 0.21.0-0.34.0 the
    scheduler has exactly one promotion of a blocked request that runs
    ``_update_waiting_for_remote_kv``, whose failed-receive branch frees the blocks, and the
    admission bookkeeping its preemption releases is read from its own code."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvguard.guards.policy import recompute

    name = recompute._find(Scheduler)
    assert name in ("_try_promote_blocked_waiting_request", "_handle_blocked_waiting_request")
    calls = [c for m, u in (("_preempt_request", False), ("_free_request", True))
             for c in recompute._release_calls(getattr(Scheduler, m), u)]
    # the release declares an in-flight-prefill reservation exactly where its preemption discards it
    import inspect

    declares_inflight = "_inflight_prefills" in inspect.getsource(Scheduler.__init__)
    assert (("_inflight_prefills", "discard") in calls) == declares_inflight
    declares_parked = hasattr(Scheduler, "_unreserve_parked")
    assert (("_unreserve_parked", None) in calls) == declares_parked


def test_the_tiering_deferral_stall_ends_guarded() -> None:
    """stall-tiering-lookup-deferred-029.jsonl (fuzz seed 7069 on 0.29.0): where vLLM alone
    leaves a request deferred forever, the guard cuts its hit to what is ready and every
    request finishes on identical KV."""
    trace = load_trace(str(TRACES / "stall-tiering-lookup-deferred-029.jsonl"))
    if not expressible(trace):
        pytest.skip("no vLLM tiering on this release: the trace's secondary_tiers cannot be expressed")
    plain = _replay(trace, guard=False)
    out = _replay(trace)
    assert _ended(out) and out["wrong_kv_blocks"] == 0 and out["failed_requests"] == []
    if plain["stalled"]:
        assert {s["kind"] for s in plain["stalls"]} == {"lookup_deferred"}
        assert out["checks"][names.CHECK_WAIT_BOUND].get(f"{names.WAIT_LOOKUP_DEFERRED}:{names.ACTION_HIT_REDUCED}", 0) >= 1


# -- healthy waits: the seed and degrade traces never trip the bound -----------------------
#: (the tiering loops stall unguarded where the release's tiering allows: test_tiering_stalls.py)
HEALTHY = ["seed-48959", "seed-42945", "load-evicted-window",
           *(p.name for p in sorted(TRACES.glob("*.jsonl"))
             if not p.name.startswith("stall-") and not p.name.endswith("-loop.jsonl"))]


@pytest.mark.parametrize("name", HEALTHY)
def test_no_false_alarm_on_a_trace_without_a_stall(name: str) -> None:
    trace = load_trace(name if "." not in name else str(TRACES / name))
    if not expressible(trace):
        pytest.skip("not expressible on this release (guardtools_vllm.expressible)")
    out = _replay(trace)
    assert _acted(out) == {}, f"{name}: the wait bound acted on a trace with no stall"


# -- the connector's own stores hold the GPU blocks a waiting request needs ----------------
#: the SimpleCPUOffloadConnector's lazy walker (guards/checks/wait_bound.py, wait
#: ``blocks_held_by_stores``): shrunk from fuzz seed 14 on 0.34.0 (async scheduling) and on
#: 0.26.0 (sync, stores reported 3 steps late)
LAZY_HOLDS = ["stall-lazy-store-hold-034.jsonl", "stall-lazy-store-hold-026.jsonl"]
HELD = f"{names.WAIT_BLOCKS_HELD_BY_STORES}:{names.ACTION_STORES_WITHHELD}"


@pytest.mark.parametrize("name", LAZY_HOLDS)
def test_the_lazy_store_hold_ends_guarded(name: str) -> None:
    """Where vLLM alone leaves a request waiting for GPU blocks its lazy stores keep pinned
    (nothing of its own in flight), guarded the walker takes no new block until the engine
    schedules again, the pins drain, and every request finishes on the right KV, none failed;
    where vLLM alone finishes the trace, the guard changes nothing. The expectation is the
    release's own unguarded outcome, measured in the same test."""
    trace = load_trace(str(TRACES / name))
    if not expressible(trace):
        pytest.skip("not expressible on this release (guardtools_vllm.expressible)")
    plain = _replay(trace, guard=False)
    out = _replay(trace)
    assert _ended(out) and out["wrong_kv_blocks"] == 0
    r = out["requests"]
    assert out["failed_requests"] == [] and r["finished"] == r["submitted"]
    if plain["stalled"]:
        assert {s["kind"] for s in plain["stalls"]} == {"waiting_for_blocks"}
        assert not any(s["connector"]["pending_loads"] or s["connector"]["pending_stores"] for s in plain["stalls"])
        assert set(_acted(out)) == {HELD} and _acted(out)[HELD] >= 1
    else:
        assert _acted(out) == {}
        assert plain["requests"]["finished"] == r["submitted"]


def test_observe_counts_the_lazy_store_hold_and_strict_raises() -> None:
    """Under observe the hold is counted once and vLLM's stall is left as it is; under strict
    the engine raises naming the wait. On a release where vLLM alone does not stall on the
    trace, neither policy acts."""
    trace = load_trace(str(TRACES / "stall-lazy-store-hold-026.jsonl"))
    plain = _replay(trace, guard=False)
    seen = _replay(trace, policy="observe")
    strict = _replay(trace, policy="strict")
    if plain["stalled"]:
        assert seen["stalled"] is True and seen["failed_requests"] == []
        assert _acted(seen) == {f"{names.WAIT_BLOCKS_HELD_BY_STORES}:{names.ACTION_CONTINUED}": 1}
        assert strict["engine_survived"] is False
        assert "AssertionError" in strict["error"] and names.WAIT_BLOCKS_HELD_BY_STORES in strict["error"]
    else:
        assert _acted(seen) == {} and _ended(seen)
        assert strict["engine_survived"] is True and _ended(strict)


def test_the_lazy_walker_switch_is_read_from_the_installed_code() -> None:
    """:func:`~kvguard.guards.checks.wait_bound.lazy_store_switch` finds the attribute the
    installed walker returns nothing for when ``<= 0``; built by vLLM it is above 0 with
    ``lazy_offload: true`` and 0 without (so the hold is watched in lazy mode only)."""
    import dataclasses

    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

    from kvguard.guards.checks import wait_bound
    from kvguard.lab.replay import vllm_api

    switch = wait_bound.lazy_store_switch(SimpleCPUOffloadScheduler)
    assert switch is not None
    geo = dataclasses.replace(load_trace(str(TRACES / "stall-lazy-store-hold-026.jsonl")).geometry)
    values = {}
    for lazy in (True, False):
        parts = vllm_api.build_scheduler(dataclasses.replace(geo, extra_config={"lazy_offload": lazy}),
                                         "SimpleCPUOffloadConnector")
        values[lazy] = getattr(parts.connector_scheduler, switch)
    assert values[True] > 0 and values[False] == 0, values
