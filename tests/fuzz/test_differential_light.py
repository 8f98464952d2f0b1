"""The differential comparison of a guarded replay with vLLM alone (lab/fuzz/differential.py), without vLLM.

Each verdict is computed from two hand-built replay summaries whose expected verdict follows
from the ranks in the module's table; every test would fail if a rank or a rule changed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvguard.lab.fuzz import differential
from kvguard.lab.fuzz.differential import Summary, compare


def _result(fates: dict[str, str], wrong: set[str] = frozenset(), survived: bool = True, steps: int = 10):
    """The fields of a ReplayResult the comparison reads."""
    return SimpleNamespace(request_fates=dict(fates), wrong_kv_requests=set(wrong),
                           engine_survived=survived, steps=steps)


ALL = {"a": "finished", "b": "finished", "c": "finished"}


def test_identical_good_runs_are_the_same_and_a_cut_is_its_price():
    v = compare(_result(ALL, steps=12), _result(ALL, steps=10),
                {"promotion_progress:hit_reduced": 1, "wait_bound:hit_reduced": 2, "group_sizes:store_dropped": 1})
    assert v.verdict == "same" and v.worse == [] and v.better == []
    assert v.price == ["promotion_progress", "wait_bound"]  # only hit cuts are a price
    assert v.steps == (12, 10)


def test_a_request_vllm_alone_finishes_and_the_guard_fails_is_worse():
    guarded = _result({**ALL, "b": "failed"})
    v = compare(guarded, _result(ALL), {"wait_bound:request_failed": 1})
    assert v.verdict == "worse" and v.worse == ["b"] and v.price == []
    assert differential.worse_class({"promotion_progress:hit_reduced": 1, "wait_bound:request_failed": 1,
                                     "x:tolerated": 3}) == "worse-than-vllm-alone after promotion_progress+wait_bound"


def test_worse_on_one_request_is_worse_even_when_another_is_better():
    guarded = _result({"a": "failed", "b": "finished", "c": "finished"})
    plain = _result({"a": "finished", "b": "unfinished", "c": "finished"})
    v = compare(guarded, plain, {"wait_bound:recomputed": 1})
    assert v.verdict == "worse" and v.worse == ["a"] and v.better == ["b"]


def test_a_guarded_death_where_vllm_alone_lives_is_worse_with_every_request_equal():
    v = compare(_result(ALL, survived=False), _result(ALL), {"engine_died": 1})
    assert v.verdict == "worse" and v.worse == []
    assert "died where vLLM alone lived" in v.detail()


def test_ending_a_stall_is_better_and_wrong_kv_ranks_below_a_stall():
    stranded = _result({**ALL, "c": "unfinished"})
    assert compare(_result({**ALL, "c": "failed"}), stranded, {"wait_bound:request_failed": 1}).verdict == "better"
    assert compare(_result(ALL), stranded, {"wait_bound:recomputed": 1}).better == ["c"]
    # a request that read wrong KV ranks 0: stranding it instead would be better, serving it right best
    wrong = _result(ALL, wrong={"a"})
    assert compare(_result({**ALL, "a": "unfinished"}), wrong, {"x:hit_reduced": 1}).verdict == "better"
    assert compare(wrong, _result(ALL), {"x:tolerated": 1}).worse == ["a"]


def test_surviving_where_vllm_alone_dies_is_better():
    dead = _result({"a": "finished", "b": "unfinished", "c": "not_arrived"}, survived=False)
    assert compare(_result(ALL), dead, {"s:tolerated": 1}).verdict == "better"


def test_the_same_wrong_outcome_is_no_better_and_has_no_price():
    both = _result({**ALL, "c": "unfinished"})
    v = compare(both, _result({**ALL, "c": "unfinished"}), {"load_writes:hit_reduced": 1})
    assert v.verdict == "no_better" and v.price == []
    dead = _result(ALL, survived=False)
    assert compare(dead, _result(ALL, survived=False), {"engine_died": 1}).verdict == "no_better"


def test_a_client_abort_counts_as_served_and_a_request_never_sent_as_failed():
    assert differential.RANK["aborted"] == differential.RANK["finished"]
    assert differential.RANK["not_arrived"] == differential.RANK["failed"] < differential.RANK["finished"]
    v = compare(_result({**ALL, "a": "aborted"}), _result(ALL), {"x:hit_reduced": 1})
    assert v.verdict == "same"
    v = compare(_result({**ALL, "c": "not_arrived"}), _result(ALL), {"x:request_failed": 1})
    assert v.verdict == "worse" and v.worse == ["c"]


def test_summaries_compare_like_results_and_other_requests_are_refused():
    g, u = _result({**ALL, "b": "failed"}), _result(ALL)
    assert compare(Summary.of(g), Summary.of(u), {}).to_json() == compare(g, u, {}).to_json()
    with pytest.raises(ValueError, match="different requests"):
        compare(_result({"a": "finished"}), _result({"z": "finished"}), {})


def test_acted_leaves_out_the_runners_death_mark():
    assert differential.acted({"load_coverage:hit_reduced": 1})
    assert not differential.acted({"engine_died": 1}) and differential.to_compare({"engine_died": 1})
    assert not differential.to_compare({})


def test_a_request_never_sent_because_the_engine_died_is_lost_not_failed():
    """vLLM alone dies early (its pending requests never arrive); the guarded engine lives
    longer and dies of the same worker fault later with those requests in flight: not worse."""
    plain = _result({"a": "finished", "b": "not_arrived"}, survived=False)
    guarded = _result({"a": "finished", "b": "unfinished"}, survived=False)
    assert differential.ranks(plain)["b"] == differential.RANK["unfinished"]
    assert compare(guarded, plain, {"group_sizes_consistency:store_dropped": 1}).verdict == "no_better"


def test_a_request_never_sent_behind_a_stall_is_lost_not_failed():
    """The 0.29.0 hour (7 Dec 2026): vLLM alone stalls at epoch 10, so every later request
    is never sent, behind a stranded one; the guarded life runs to epoch 394 and strands 10
    requests there. Those 10 are lost on both sides (not worse) and the thousands the guarded
    life finished are better: ``better``, not ``worse``. A request never sent because one it
    waits for *failed* still ranks with ``failed``."""
    plain = _result({"a": "unfinished", "b": "not_arrived_stalled", "c": "not_arrived_stalled"})
    guarded = _result({"a": "finished", "b": "finished", "c": "unfinished"})
    assert differential.RANK["not_arrived_stalled"] == differential.RANK["unfinished"] < differential.RANK["not_arrived"]
    v = compare(guarded, plain, {"wait_bound:recomputed": 13})
    assert v.verdict == "better" and v.worse == [] and v.better == ["a", "b"]
    after_failure = _result({"a": "failed", "b": "not_arrived", "c": "finished"})
    assert compare(_result({"a": "failed", "b": "unfinished", "c": "finished"}), after_failure,
                   {"x:request_failed": 1}).verdict == "worse"


def test_a_never_sent_request_is_told_apart_by_what_it_waits_behind():
    """``harness.never_sent_fates``: behind a failure (directly or through another never-sent
    request) ``not_arrived``; behind a stranded request, or nothing, ``not_arrived_stalled``;
    other fates unchanged. Pure: no vLLM import."""
    from kvguard.lab.replay.harness import never_sent_fates
    from kvguard.lab.replay.trace import Geometry, Segment, Trace, TraceRequest

    def req(rid: str, after: str | None = None) -> TraceRequest:
        return TraceRequest(id=rid, prompt=(Segment(seed=1, tokens=8),), max_tokens=1, after=after)

    trace = Trace(name="t", geometry=Geometry(), requests=(
        req("f"), req("f2", "f"), req("f3", "f2"), req("s"), req("s2", "s"), req("s3", "s2"), req("t")))
    fates = {"f": "failed", "f2": "not_arrived", "f3": "not_arrived", "s": "unfinished",
             "s2": "not_arrived", "s3": "not_arrived", "t": "not_arrived"}
    assert never_sent_fates(trace, fates) == {
        "f": "failed", "f2": "not_arrived", "f3": "not_arrived", "s": "unfinished",
        "s2": "not_arrived_stalled", "s3": "not_arrived_stalled", "t": "not_arrived_stalled"}


def test_a_request_worse_only_by_a_drawn_load_failure_is_compared_again_without_the_draws():
    """Seed 12 on 0.34.0 (example 4593): the guarded run loaded a prefix vLLM alone had
    evicted, and the worker model's drawn 5% failure fell on that load. Every worse request
    failed after a drawn failed load: ``by_drawn_failure``, so the runner compares the two
    replays again with the draws off (``without_drawn_failures``). A worse request kvguard
    failed itself is not such a failure."""
    from kvguard.lab.replay.jobs import Faults, WorkerModel
    from kvguard.lab.replay.trace import Geometry, Segment, Trace, TraceRequest

    g = Summary({"a": 2, "b": 3}, True, 10, frozenset({"a"}))
    u = Summary({"a": 3, "b": 2}, True, 10, frozenset({"b"}))
    v = compare(g, u, {"tier_publish:chunk_withheld": 28})
    assert v.verdict == "worse" and v.by_drawn_failure and v.worse == ["a"]
    kvguard_failed = Summary({"a": 2, "b": 3}, True, 10, frozenset())
    assert not compare(kvguard_failed, u, {"x:request_failed": 1}).by_drawn_failure

    worker = WorkerModel(load_faults=Faults(rate=0.05, jobs=frozenset({2}), hang_jobs=frozenset({7})),
                         store_faults=Faults(rate=0.05), seed=65535)
    trace = Trace(name="t", geometry=Geometry(), worker=worker,
                  requests=(TraceRequest(id="a", prompt=(Segment(seed=1, tokens=8),), max_tokens=1),))
    off = differential.without_drawn_failures(trace).worker
    assert (off.load_faults.rate, off.load_faults.jobs, off.store_faults.rate) == (0.0, frozenset(), 0.0)
    assert off.load_faults.hang_jobs == frozenset({7}) and off.seed == 65535  # hangs and latency kept
