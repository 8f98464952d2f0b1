"""The lab drives the SimpleCPUOffloadConnector (issue 30, item 3): replay, worker, KV oracle.

The replays run vLLM's real ``Scheduler`` with the real SimpleCPUOffloadConnector in the
scheduler role; its CUDA-only worker is simulated at the connector's boundary
(:mod:`kvguard.lab.replay.simple_worker`). What is proven:

- the built-in ``simple-39702`` trace (the #39702 class, from the public report's
  mechanism): where the installed lookup does not pin its hit, vLLM alone dies at the
  hit-length assert and kvguard fails that request alone with every other request finishing
  on the right KV; where it pins (vllm#42289), guarded and unguarded finish alike, the hit
  loaded. Which of the two is read from the installed code, not from the version;
- the oracle follows this connector's copies: the hit's loaded blocks are checked and hold
  the right KV, and the two negative controls (a load that copies nothing, a load that
  gives each GPU block its neighbour's CPU block) are flagged;
- the worker reports events in launch order per direction (the CUDA streams' high-water
  mark), holding back an event done before an earlier one.
"""

from __future__ import annotations

import inspect

import pytest

from kvguard.lab.replay import harness
from kvguard.lab.replay.trace import load_trace
from kvguard.lab.replay.worker import FAULTS

pytestmark = pytest.mark.vllm

TRACE = "simple-39702"
VICTIM = "a/turn-1"


def _lookup_pins_its_hit() -> bool:
    """vllm#42289 in the installed code: the lookup ``touch``es the blocks of its hit."""
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

    return "touch" in inspect.getsource(SimpleCPUOffloadScheduler.get_num_new_matched_tokens)


def _replay(guard: bool, fault: str | None = None, trace=None, policy: str = "guard"):
    trace = trace or load_trace(TRACE)
    if guard:
        harness.install_guard(policy)  # before vLLM's offload modules are imported
    else:
        harness.uninstall_guard()
    engine = harness.build_engine(trace.geometry, trace.worker)
    engine.worker.fault = fault
    return engine, harness.run_replay(trace, guard=guard, engine=engine, policy=policy)


def _hit_blocks(trace) -> int:
    """GPU blocks the victim's CPU hit loads: its shared prefix in full attention, plus the
    sliding-window group's last ``cdiv(sliding_window - 1, block)`` blocks (vLLM's
    ``SlidingWindowManager.find_longest_cache_hit`` keeps those, null below)."""
    geo = trace.geometry
    prefix = next(r for r in trace.requests if r.id == VICTIM).prompt[0].tokens
    tpb = geo.tokens_per_block
    return prefix // tpb + -(-(geo.sliding_window - 1) // tpb)


def test_the_39702_trace_without_the_guard() -> None:
    _, result = _replay(guard=False)
    assert result.driven_evictions.get(VICTIM, 0) > 0  # the eviction between the phases happened
    if _lookup_pins_its_hit():
        assert result.ok and result.finished == result.submitted == 5
    else:
        assert not result.engine_survived
        assert "hit tokens, got 0" in result.error
        assert "simple_kv_offload/manager.py" in result.error_site
        assert result.error_site.endswith("update_state_after_alloc")


def test_the_39702_trace_with_the_guard_fails_the_victim_alone_or_loads_its_hit() -> None:
    trace = load_trace(TRACE)
    engine, result = _replay(guard=True)
    assert result.guard_installed
    assert result.engine_survived and not result.stalled and result.wrong_kv_blocks == 0, result.error
    assert result.ok
    if _lookup_pins_its_hit():
        assert result.finished == result.submitted == 5 and result.failed_requests == []
        assert engine.worker.oracle.loaded_blocks == _hit_blocks(trace)
    else:
        assert [f["request_id"] for f in result.failed_requests] == [VICTIM]
        assert "request failed alone" in result.failed_requests[0]["error"]
        assert result.finished == result.submitted - 1 == 4
        assert result.checks["scheduler_assert"]["violations"] == 1
        assert engine.worker.oracle.loaded_blocks == 0


def test_guarded_and_unguarded_outputs_agree_where_nothing_failed() -> None:
    """Where the release pins the hit, every request's generated tokens are the same with
    and without kvguard; elsewhere the requests that finished in both runs agree."""
    _, plain = _replay(guard=False)
    _, guarded = _replay(guard=True)
    both = set(plain.outputs) & set(guarded.outputs)
    assert both and all(plain.outputs[r] == guarded.outputs[r] for r in both)
    if _lookup_pins_its_hit():
        assert set(plain.outputs) == set(guarded.outputs) == {r.id for r in load_trace(TRACE).requests}


def _loading_trace():
    """``simple-39702`` without the driven eviction: the victim loads its CPU hit on every release."""
    import dataclasses

    trace = load_trace(TRACE)
    reqs = tuple(dataclasses.replace(r, evict_cpu_after_lookup=False) for r in trace.requests)
    return dataclasses.replace(trace, requests=reqs)


def test_the_oracle_checks_the_loaded_hit() -> None:
    trace = _loading_trace()
    engine, result = _replay(guard=True, trace=trace)
    oracle = engine.worker.oracle
    assert result.ok and result.finished == 5
    assert oracle.loaded_blocks == _hit_blocks(trace)
    assert oracle.checked_blocks >= oracle.loaded_blocks and oracle.stored_blocks > 0
    assert engine.worker.torn_blocks == 0 and engine.worker.inconsistent_specs == []


@pytest.mark.parametrize("fault", FAULTS)
def test_a_faulty_load_is_flagged(fault: str) -> None:
    engine, result = _replay(guard=True, fault=fault, trace=_loading_trace())
    assert result.wrong_kv_blocks > 0 and not result.ok
    assert {o["request_id"] for o in engine.worker.oracle.wrong_kv} == {VICTIM}


def test_events_are_reported_in_launch_order_per_direction() -> None:
    """Four seeded worker models with latency 0..4 steps: in every replay each direction's
    events are reported in launch order, and across them some event the model finished
    early was held back behind an earlier one (so the order is the worker's doing)."""
    import dataclasses

    from kvguard.lab.replay.jobs import Latency, WorkerModel

    held_back = 0
    for seed in range(4):
        model = WorkerModel(load_latency=Latency(0, 4), store_latency=Latency(0, 4), seed=seed)
        trace = dataclasses.replace(_loading_trace(), worker=model)
        engine, result = _replay(guard=True, trace=trace)
        worker = engine.worker
        assert result.ok and result.finished == 5 and result.wrong_kv_blocks == 0
        queue_done = {j.job_id: j.done_step for j in worker.queue.completed}
        for records in (worker.loads, worker.stores):
            steps = [r.done_step for r in records if r.done_step is not None]
            assert steps == sorted(steps)  # never a later event before an earlier one
            held_back += sum(1 for r in records if r.done_step is not None and r.done_step > queue_done[r.job_id])
    assert held_back > 0


# -- the classes the SimpleCPUOffloadConnector fuzz found (vLLM 0.21.0, seed 4242) ----------
TRACES = __import__("pathlib").Path(__file__).parent / "traces"


def _two_phase_allocation() -> bool:
    """vLLM #33775's fix in the installed code: the single-type managers add every group's
    prefix-cache hit before any group allocates external blocks (``add_local_computed_blocks``)."""
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    return hasattr(SingleTypeKVCacheManager, "add_local_computed_blocks")


def test_a_block_given_twice_is_wrong_kv_without_the_guard_and_one_recompute_with_it() -> None:
    trace = load_trace(str(TRACES / "simple-33775.jsonl"))
    _, plain = _replay(guard=False, trace=trace)
    _, observed = _replay(guard=True, trace=trace, policy="observe")
    engine, guarded = _replay(guard=True, trace=trace)
    checks = guarded.checks["block_exclusive"]
    # every admission with a load was checked (the lookups that answered a hit; counted on
    # the observed run, whose lookups vLLM answers: a request kvguard recomputed is answered
    # no load at its retry, and ``hits`` keeps each request's last answer)
    loads = sum(1 for h in observed.hits.values() if h["external_hit_tokens"] > 0)
    assert observed.checks["block_exclusive"]["evaluated"] >= loads >= 1 and checks["evaluated"] >= 1
    if _two_phase_allocation():
        assert plain.ok and guarded.ok and guarded.finished == guarded.submitted
        assert checks["violations"] == 0
        return
    assert plain.engine_survived and plain.wrong_kv_blocks > 0  # vLLM alone serves wrong KV
    assert {o["request_id"] for o in plain.worker.oracle.wrong_kv} == {"agent-1/turn-1"}
    assert observed.wrong_kv_blocks == plain.wrong_kv_blocks  # observe: vLLM's behaviour, counted
    # every admission of that request sees it (the load, then its resumption: 0.21.0 calls
    # update_state_after_alloc again when the loaded request is scheduled)
    assert observed.checks["block_exclusive"]["continued"] >= 1 and observed.failed_requests == []
    # guarded: the request's load is refused and it is recomputed through vLLM's
    # failed-receive path (its retry shares no block): every request finishes right
    assert guarded.ok and guarded.wrong_kv_blocks == 0 and guarded.failed_requests == []
    assert checks["recomputed"] == 1 and checks["request_failed"] == 0 and checks["raised"] == 0
    # its retry loaded nothing (guards/policy/recompute.py: a recomputed request computes)
    assert observed.hits["agent-1/turn-1"]["external_hit_tokens"] > 0
    assert guarded.hits["agent-1/turn-1"]["external_hit_tokens"] == 0
    assert guarded.finished == guarded.submitted == plain.submitted
    assert guarded.outputs == plain.outputs  # the simulated tokens; the KV under them is the oracle's


def test_the_wait_bound_ends_a_simple_connector_wait_vllm_never_ends() -> None:
    """Expectation from the release's own unguarded outcome: where vLLM alone stalls, the
    guarded replay ends the stalled wait (that request is recomputed through vLLM's
    failed-receive path, guards/policy/recompute.py) and every request finishes on the right KV."""
    trace = load_trace(str(TRACES / "stall-simple-remote-kvs-021.jsonl"))
    _, plain = _replay(guard=False, trace=trace)
    _, guarded = _replay(guard=True, trace=trace)
    assert guarded.ok and not guarded.stalled and guarded.wrong_kv_blocks == 0
    if plain.ok:
        assert guarded.finished == guarded.submitted and guarded.failed_requests == []
        return
    assert plain.stalled and any(s["kind"] == "remote_kvs_never_promoted" for s in plain.stalls)
    stalled = {s["request_id"] for s in plain.stalls if s["kind"] == "remote_kvs_never_promoted"}
    assert guarded.failed_requests == [] and guarded.finished == guarded.submitted
    assert guarded.checks["wait_bound"]["load_not_promoted:recomputed"] == len(stalled)
    assert stalled <= set(guarded.outputs)  # the recomputed requests finished


#: the class without drafts (0.29.0, seed 4242) and with ngram drafts (0.34.0, seed 12: the
#: check did not run with speculative decoding before 7 Dec 2026 and the fuzz served it guarded)
UNWRITTEN_TRACES = ["simple-retained-unwritten.jsonl", "simple-retained-unwritten-spec-034.jsonl"]


def _unwritten_trace_or_refusal(name: str = UNWRITTEN_TRACES[0]):
    """The ``extra_retained_tokens`` trace and vLLM's unguarded run of it; ``None`` where the
    release refuses the geometry (0.21.0-0.26.0: ``SlidingWindowSpec`` has no such field,
    and the lab's refusal names it)."""
    trace = load_trace(str(TRACES / name))
    try:
        _, plain = _replay(guard=False, trace=trace)
    except RuntimeError as exc:
        assert "extra_retained_tokens" in str(exc)
        return None
    return trace, plain


@pytest.mark.parametrize("name", UNWRITTEN_TRACES)
def test_a_hit_whose_load_would_leave_blocks_unwritten_is_recomputed(name: str) -> None:
    """Expectation from the release's own unguarded outcome: where vLLM alone caches blocks
    its load left unwritten (wrong KV for a later prefix hit), the guard answers those hits 0
    at the lookup: every request is served, recomputed, with the right KV; with speculative
    decoding too (the second trace)."""
    got = _unwritten_trace_or_refusal(name)
    if got is None:
        return
    trace, plain = got
    _, guarded = _replay(guard=True, trace=trace)
    checks = guarded.checks["load_writes"]
    assert guarded.ok and guarded.wrong_kv_blocks == 0 and guarded.failed_requests == []
    assert guarded.finished == guarded.submitted == plain.submitted
    if plain.ok:
        assert checks["violations"] == 0
        return
    assert plain.wrong_kv_blocks > 0  # vLLM alone caches the unwritten blocks and serves them
    assert checks["hit_reduced"] >= 1 and checks["recomputed_tokens"] > 0
    assert checks["request_failed"] == checks["continued"] == checks["raised"] == 0


def test_where_the_lookup_cannot_predict_it_the_load_is_withdrawn_and_the_request_fails_alone(monkeypatch) -> None:
    """The safety net: with the lookup's prediction unreadable, the check after allocation
    withdraws the load (vLLM's ``_cleanup_load_request``) and fails that request alone."""
    from kvguard.guards.checks.admission import written

    got = _unwritten_trace_or_refusal()
    if got is None:
        return
    trace, plain = got
    monkeypatch.setattr(written, "predicted_unwritten", lambda *args: None)
    _, guarded = _replay(guard=True, trace=trace)
    checks = guarded.checks["load_writes"]
    assert guarded.engine_survived and not guarded.stalled and guarded.wrong_kv_blocks == 0 and guarded.ok
    if plain.ok:
        assert checks["violations"] == 0
        return
    assert checks["hit_reduced"] == 0 and checks["request_failed"] >= 1
    assert guarded.failed_requests and all("load_writes" in f["error"] for f in guarded.failed_requests)
    assert len(guarded.failed_requests) == checks["request_failed"]


def test_a_gpu_block_freed_twice_in_one_call_is_split() -> None:
    """Expectation from the release's own unguarded outcome: where vLLM alone corrupts its
    free queue (the engine dies in the pool's asserts, or serves wrong KV first), the guard
    splits the connector's call and every request finishes with the right KV."""
    trace = load_trace(str(TRACES / "simple-free-twice-021.jsonl"))
    _, plain = _replay(guard=False, trace=trace)
    _, guarded = _replay(guard=True, trace=trace)
    checks = guarded.checks["gpu_free_once"]
    assert guarded.ok and guarded.finished == guarded.submitted and guarded.wrong_kv_blocks == 0
    from vllm.v1.core.block_pool import BlockPool

    from kvguard.guards.checks import pool_frees

    if pool_frees.duplicates_corrupt(BlockPool):
        assert checks["evaluated"] > 0  # the connector's frees went through the guarded pool
    else:
        # this release enqueues a doubly listed block once: vLLM's own pool, no proxy, no cost
        assert checks["evaluated"] == 0 and plain.ok
    if plain.ok:
        assert checks["violations"] == 0
        return
    assert not plain.engine_survived or plain.wrong_kv_blocks > 0
    if not plain.engine_survived:
        # vLLM's own free-queue asserts (FreeKVCacheBlockQueue.popleft_n / append_n)
        assert "kv_cache_utils.py" in plain.error_site and plain.error_site.endswith(("popleft_n", "append_n"))
    assert checks["free_split"] >= 1 and checks["continued"] == checks["raised"] == 0


def _misaligned_hit_replay(guard: bool):
    """simple-39702 with the victim's lookup answering its hit one token short: an external
    hit no scheduler block boundary allows, so the first alignment assert of
    ``update_state_after_alloc`` after the pending hit is popped fails (0.25.1 to 0.29.0
    ``num_external_tokens % g_block_size``, 0.33.0 and 0.34.0 ``% self.hash_block_size``; on
    0.21.0, whose lookup pins nothing, ``hit_length == num_external_tokens``)."""
    trace = load_trace(TRACE)
    if guard:
        harness.install_guard("guard")
    else:
        harness.uninstall_guard()
    engine = harness.build_engine(trace.geometry, trace.worker)
    manager = engine.connector_scheduler
    real = manager.get_num_new_matched_tokens

    def lookup(request, num_computed_tokens):
        hit, is_async = real(request, num_computed_tokens)
        if request.request_id == VICTIM and hit:
            return hit - 1, is_async
        return hit, is_async

    manager.get_num_new_matched_tokens = lookup
    return manager, harness.run_replay(trace, guard=guard, engine=engine)


def test_an_assert_after_the_pinned_hit_is_popped_fails_the_request_alone_and_gives_the_pin_back() -> None:
    """Where the lookup pins its hit (vllm#42289) ``update_state_after_alloc`` pops the pin
    before its asserts, so failing the request there must give the pin back: kvguard runs the
    method's own release (``self._free_pending_cpu_hit(pending)``, read from the installed
    code, guards/hooking/discovery.RequestScope) and then fails the request. vLLM alone dies
    at the assert; guarded, the victim fails alone, every other request finishes on the
    right KV, and at the end no CPU block is still pinned (a leaked pin would hold one)."""
    from kvguard.guards.telemetry import events

    _, plain = _misaligned_hit_replay(guard=False)
    assert not plain.engine_survived and "AssertionError" in (plain.error or "")
    with events.capture() as logged:
        manager, guarded = _misaligned_hit_replay(guard=True)
    assert guarded.engine_survived and not guarded.stalled and guarded.wrong_kv_blocks == 0
    assert [f["request_id"] for f in guarded.failed_requests] == [VICTIM]
    assert guarded.finished == guarded.submitted - 1
    (failed,) = [e for e in logged if e["event"] == "check_failed"]
    assert failed["action"] == "request_failed" and failed["request_id"] == VICTIM
    assert sum(1 for b in manager.cpu_block_pool.blocks if b.ref_cnt > 0) == 0
    assert guarded.guard_errors == {}


def test_a_layout_without_full_attention_is_refused_by_vllm_and_never_drawn_for_this_connector() -> None:
    """The installed SimpleCPUOffloadConnector asserts a full-attention group at construction
    (:func:`~kvguard.lab.replay.vllm_api.simple_full_attention_assert`): vLLM refuses a
    layout of sliding-window groups only, at the line the reader names. The fuzzer's
    :func:`~kvguard.lab.fuzz.strategies.for_simple_connector` appends one full-attention
    group there (drawn windows kept, the GPU pool grown by that group's need), and the
    fitted trace replays to the end on the right KV."""
    import dataclasses
    import traceback

    from kvguard.lab.fuzz import strategies
    from kvguard.lab.replay import vllm_api
    from kvguard.lab.replay.trace import GroupGeometry

    harness.uninstall_guard()
    base = load_trace(TRACE)
    geo = base.geometry
    swa_only = dataclasses.replace(
        geo, groups=(GroupGeometry("sliding_window", geo.tokens_per_block, geo.sliding_window),))
    fitted, _ = strategies.for_simple_connector(swa_only, {})
    site = vllm_api.simple_full_attention_assert()
    if site is None:  # a release that takes any layout: nothing to fit
        assert fitted.groups == swa_only.groups
        return
    where = site.split(" in ")[0]
    with pytest.raises(AssertionError) as refused:
        vllm_api.build_scheduler(swa_only, "SimpleCPUOffloadConnector")
    last = traceback.extract_tb(refused.value.__traceback__)[-1]
    assert f"{last.filename}:{last.lineno}".endswith(where), (last, site)
    assert fitted.groups == (*swa_only.groups, GroupGeometry("full", geo.tokens_per_block))
    assert fitted.num_gpu_blocks == geo.num_gpu_blocks + -(-geo.max_model_len // geo.tokens_per_block)
    engine, result = _replay(guard=False, trace=dataclasses.replace(base, geometry=fitted))
    assert result.engine_survived and not result.stalled, result.error
    assert result.ok and result.finished == result.submitted == len(base.requests)
    assert engine.worker.oracle.stored_blocks > 0 and engine.worker.oracle.checked_blocks > 0
