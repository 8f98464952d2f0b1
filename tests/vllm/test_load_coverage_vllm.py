"""The admission check on the real vLLM scheduler (issue 9 item 1), in each .venvs/vllm-* env.

- :func:`kvguard.guards.load_coverage.load_set` equals the chunk set of the real load
  job: the real ``KVCacheManager`` allocates, the real ``update_state_after_alloc``
  builds the load, and the keys it hands to ``manager.prepare_load`` are mapped back to
  chunk indices, over several geometries and hit ends (some inside a GPU block);
- the built-in trace ``load-evicted-window`` (a window chunk evicted or never stored,
  then a driven hit that reads it) kills the engine without kvguard and survives with
  it: every request finishes, ``hit_reduced`` >= 1, recomputed tokens > 0, and each
  request generates the same tokens as a control run in which vLLM's own lookup
  answered (no driven hit); ``observe`` counts and vLLM dies as without kvguard;
  ``strict`` raises at admission;
- on the seed traces and the benchmark trace the check never reduces a hit that vLLM's
  own lookup admitted, and passes vLLM's answer through as the same object.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

from kvguard.guards import admission
from kvguard.guards.load_coverage import GroupGeometry, load_set
from kvguard.guards.replay import harness, vllm_api
from kvguard.guards.replay.trace import Geometry, Segment, Trace, TraceRequest, load_trace

pytestmark = pytest.mark.vllm

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(autouse=True)
def fresh_guard():
    """Each test installs the guard with its own policy (a repeat install keeps the old one)."""
    harness.uninstall_guard()
    yield
    harness.uninstall_guard()


def _stats(result) -> dict[str, Any]:
    return result.checks["load_coverage"]


def _keep_requests(monkeypatch) -> dict[str, Any]:
    """Keep every Request the harness builds (to read its generated tokens afterwards)."""
    made: dict[str, Any] = {}
    original = vllm_api.make_request

    def make(block_hasher, request_id, prompt, max_tokens):
        req = original(block_hasher, request_id, prompt, max_tokens)
        made[request_id] = req
        return req

    monkeypatch.setattr(vllm_api, "make_request", make)
    return made


# -- 1. the load set equals the real load job's chunks ----------------------------------
def _comparison_trace(tpb: int, tpc: int, sw: int) -> Trace:
    chunks = 20
    n = chunks * tpc
    blocks = n // tpb
    geometry = Geometry(
        tokens_per_block=tpb, tokens_per_chunk=tpc, sliding_window=sw,
        num_gpu_blocks=int(2.5 * blocks), cpu_chunks=8 * chunks, max_num_batched_tokens=max(512, 4 * tpc),
        max_num_seqs=4, max_model_len=8 * n, vocab_size=32000,
    )
    reqs = [TraceRequest("a", (Segment(seed=1, tokens=n),), 1)]
    prev = "a"
    ends = [n - 1, n - 7, n - tpc // 2 - 1, n - tpc - 3, n // 2 + 9]
    for i, end in enumerate(ends):
        evict = f"evict-{i}"
        reqs.append(TraceRequest(evict, (Segment(seed=100 + i, tokens=n),), 1, after=prev))
        rid = f"hit-{i}"
        reqs.append(
            TraceRequest(rid, (Segment(seed=1, tokens=n), Segment(seed=200 + i, tokens=tpc)), 2,
                         after=evict, external_hit_tokens=end)
        )
        prev = rid
    # a local GPU prefix hit followed by an external one (no evictor before it)
    reqs.append(TraceRequest("again", (Segment(seed=1, tokens=n), Segment(seed=999, tokens=2 * tpc)), 1, after=prev))
    return Trace(name=f"compare-{tpb}-{tpc}-{sw}", geometry=geometry, requests=tuple(reqs))


COMPARE_GEOMETRIES = [(16, 64, 256), (8, 64, 200), (16, 64, 40)]


@pytest.mark.parametrize("tpb,tpc,sw", COMPARE_GEOMETRIES)
def test_load_set_equals_the_real_load_job(tpb, tpc, sw):
    trace = _comparison_trace(tpb, tpc, sw)
    # installed before the scheduler is built, as in EngineCore (the spec recorder wraps __init__)
    assert harness.install_guard("guard")
    engine = harness.build_engine(trace.geometry)
    cs = engine.connector_scheduler
    groups = [GroupGeometry(tpb, tpc // tpb), GroupGeometry(tpb, tpc // tpb, sw)]
    compared: list[tuple[int, int]] = []
    pending: dict[str, Any] = {}
    real_prepare = cs.manager.prepare_load

    def prepare_load(keys, req_context, *a, **k):
        pending["keys"] = list(keys)
        return real_prepare(keys, req_context, *a, **k)

    real_after_alloc = cs.update_state_after_alloc

    def after_alloc(request, blocks, num_external_tokens):
        pending.clear()
        out = real_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens:
            status = cs._req_status[request.request_id]
            local = status.num_locally_computed_tokens
            index = [{key: i for i, key in enumerate(gs.offload_keys)} for gs in status.group_states]
            got: list[set[int]] = [set(), set()]
            for key in pending["keys"]:
                (g,) = [g for g in range(2) if key in index[g]]
                got[g].add(index[g][key])
            want = [set(r) for r in load_set(groups, local, local + num_external_tokens)]
            assert got == want, (request.request_id, local, num_external_tokens)
            compared.append((local, local + num_external_tokens))
        return out

    cs.manager.prepare_load = prepare_load
    cs.update_state_after_alloc = after_alloc
    result = harness.run_replay(trace, guard=True, policy="guard", engine=engine)
    assert result.ok, result.error
    assert result.guard_errors == {}
    # enough real loads were compared, some ending inside a GPU block, some after a local hit
    assert len(compared) >= 3, compared
    assert any(end % tpb for _, end in compared) or any(local for local, _ in compared), compared


# -- 2. the load class: a window chunk missing at a driven hit -------------------------
def test_load_evicted_window_dies_without_kvguard():
    result = harness.run_replay(load_trace("load-evicted-window"), guard=False)
    assert not result.engine_survived
    assert "prepare_load" in (result.error_site or ""), result.error_site
    assert "not found" in (result.error or "")
    assert "c/turn-0" not in {r.req_id for r in result.worker.load_specs} if hasattr(result.worker, "load_specs") else True


def test_load_evicted_window_survives_with_the_guard(monkeypatch):
    trace = load_trace("load-evicted-window")
    made = _keep_requests(monkeypatch)
    result = harness.run_replay(trace, guard=True, policy="guard")
    assert result.ok, result.error
    # never wrong KV: every block vLLM read for a request held that request's tokens
    assert result.wrong_kv_blocks == 0 and result.worker.oracle.checked_blocks > 0
    stats = _stats(result)
    assert stats["hit_reduced"] >= 1 and stats["recomputed_tokens"] > 0, stats
    assert result.guard_errors == {}
    driven = result.driven_hits["c/turn-0"]
    admitted = result.hits["c/turn-0"]["external_hit_tokens"]
    assert admitted < driven["num_cached_tokens"] - driven["local_hit_tokens"]
    assert stats["recomputed_tokens"] == driven["num_cached_tokens"] - driven["local_hit_tokens"] - admitted
    guarded = {rid: list(r.output_token_ids) for rid, r in made.items()}

    # control: the same trace where vLLM's own lookup answers (nothing driven)
    made.clear()
    control = dataclasses.replace(
        trace, requests=tuple(dataclasses.replace(r, external_hit_tokens=None) for r in trace.requests)
    )
    plain = harness.run_replay(control, guard=False)
    assert plain.ok, plain.error
    assert {rid: list(r.output_token_ids) for rid, r in made.items()} == guarded
    assert all(len(v) == t.max_tokens for t in trace.requests for k, v in guarded.items() if k == t.id)


def test_load_evicted_window_observe_counts_and_vllm_decides():
    result = harness.run_replay(load_trace("load-evicted-window"), guard=True, policy="observe")
    assert not result.engine_survived and "prepare_load" in (result.error_site or "")
    stats = _stats(result)
    assert stats["continued"] == 1 and stats["hit_reduced"] == 0 and stats["recomputed_tokens"] == 0


def test_load_evicted_window_strict_raises_at_admission():
    result = harness.run_replay(load_trace("load-evicted-window"), guard=True, policy="strict")
    assert not result.engine_survived
    assert "kvguard load_coverage" in (result.error or "")
    assert _stats(result)["raised"] == 1


# -- 3. vLLM's own admitted hits are never reduced ------------------------------------
def _bench_trace() -> Trace:
    sys.path.insert(0, str(BENCH))
    try:
        from replay_overhead import generate_trace
    finally:
        sys.path.remove(str(BENCH))
    return generate_trace(10, 4)


@pytest.mark.parametrize("name", ["seed-48959", "seed-42945", "bench"])
def test_vllm_admitted_hits_are_never_reduced(name, monkeypatch):
    trace = _bench_trace() if name == "bench" else load_trace(name)
    same: list[bool] = []
    original = admission.admit

    def spy(cs, request, num_computed_tokens, answer, *rest, **kw):
        out = original(cs, request, num_computed_tokens, answer, *rest, **kw)
        same.append(out is answer)
        return out

    monkeypatch.setattr(admission, "admit", spy)
    result = harness.run_replay(trace, guard=True, policy="guard")
    stats = _stats(result)
    assert stats["hit_reduced"] == 0 and stats["violations"] == 0 and stats["unchecked"] == 0, stats
    # no tiering here: the promotion-fit check of deferred tiered hits never runs
    assert result.checks["promotion_fit"]["evaluated"] == 0 and result.checks["promotion_fit"]["violations"] == 0
    # every request the scheduler finally admitted with an external hit was checked
    assert stats["evaluated"] >= sum(1 for h in result.hits.values() if h["external_hit_tokens"]), stats
    if name != "seed-42945":  # the store-side seed has no CPU hit on some releases
        assert stats["evaluated"] >= 1, stats
        assert same  # the check is called for lookups with a hit only
    assert all(same)
    assert result.guard_errors == {}


@pytest.mark.parametrize("path", ["instance", "class"])
def test_the_wraps_run_the_check_in_vllms_own_call_path(path, monkeypatch):
    """Without the harness' ordering (EngineCore's path): the wrapt wrap of
    ``get_num_new_matched_tokens`` itself calls the check, arguments bound by signature.
    ``instance``: the pre-bound wrapper every scheduler built after install gets
    (``admission.attach``, the hot path); ``class``: the class-level wrap, which serves a
    scheduler without it (one built before install)."""
    import inspect

    trace = load_trace("load-evicted-window")
    control = dataclasses.replace(
        trace, requests=tuple(dataclasses.replace(r, external_hit_tokens=None) for r in trace.requests)
    )
    assert harness.install_guard("guard")
    engine = harness.build_engine(control.geometry)
    cs = engine.connector_scheduler
    attr = inspect.getattr_static(type(cs), "get_num_new_matched_tokens")
    assert getattr(attr, "_self_wrapper", None) is admission.admission_wrapper
    own = cs.__dict__.get("get_num_new_matched_tokens")
    assert getattr(own, "_self_wrapper", None) is admission.admission_wrapper
    assert own.__wrapped__.__self__ is cs and own.__wrapped__.__func__ is attr.__wrapped__
    if path == "class":
        del cs.__dict__["get_num_new_matched_tokens"]
    calls = []
    original = admission.admit
    monkeypatch.setattr(admission, "admit", lambda *a, **k: calls.append(a[0]) or original(*a, **k))
    # the recorder calls the wrapped method as vLLM's scheduler does, and no admit of its own
    monkeypatch.setattr(admission, "unwrapped_lookup", lambda c: (c.get_num_new_matched_tokens, False))
    result = harness.run_replay(control, guard=True, policy="guard", engine=engine)
    assert result.ok, result.error
    stats = _stats(result)
    assert stats["evaluated"] >= 1 and stats["violations"] == 0, stats
    assert calls and all(c is cs for c in calls)  # the check ran on this scheduler's lookups
    assert result.guard_errors == {}
    # the replay put back what it shadowed
    assert ("get_num_new_matched_tokens" in cs.__dict__) is (path == "instance")
    harness.uninstall_guard()
    assert inspect.getattr_static(type(cs), "get_num_new_matched_tokens") is attr.__wrapped__
    assert "get_num_new_matched_tokens" not in cs.__dict__  # uninstall detaches the instance wrapper
