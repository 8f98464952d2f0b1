"""The promotion-fit check: a deferred tiered hit that cannot fit the CPU tier (marker vllm).

``tests/vllm/traces/tiering-promotion-loop.jsonl`` (a ``kvguard fuzz`` finding, 0.33.0
seed 0): request ``agent-2/turn-3`` has its prefix only in vLLM's example secondary tier,
and the hit's load set (full-attention + sliding-window chunks) is larger than the
30-chunk CPU tier. vLLM's ``TieringOffloadingManager`` promotes the missing chunks on
every lookup, evicting ready chunks of the same hit, and the connector answers "retry
later" forever (stall ``lookup_deferred``). With the guard the admission check sees the
deferral's load set does not fit (``kvguard.guards.checks.admission``, check ``promotion_fit``)
and answers what is ready in the CPU tier (here 0: vLLM recomputes), so every request
finishes with the right KV and the same tokens as a run without the secondary tier.

Whether the release has vLLM's tiering is detected from its code
(:func:`kvguard.lab.replay.tiering.unsupported_reason`): measured present on 0.25.1
and 0.33.0, absent on 0.21.0 (every test here skips there, with that reason).

Run: ``.venvs/vllm-0.33.0/bin/pytest -m vllm tests/vllm/test_promotion_fit.py``
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

from kvguard.guards.checks import admission

from kvguard.guards.telemetry import events

from kvguard.guards import names  # noqa: E402
from kvguard.lab.replay import harness, tiering  # noqa: E402
from kvguard.lab.replay.trace import load_trace  # noqa: E402

TRACES = Path(__file__).parent / "traces"
LOOP = load_trace(str(TRACES / "tiering-promotion-loop.jsonl"))
FITS = load_trace(str(TRACES / "secondary-tier.jsonl"))
VICTIM = "agent-2/turn-3"
WHY = tiering.unsupported_reason()
needs_tiering = pytest.mark.skipif(WHY is not None, reason=f"no vLLM tiering here: {WHY}")


@pytest.fixture(autouse=True)
def fresh_guard():
    """Each test installs the guard with its own policy; leave no guard or KVGUARD_DISABLE behind."""
    import os

    saved = os.environ.get("KVGUARD_DISABLE")
    harness.uninstall_guard()
    yield
    harness.uninstall_guard()
    if saved is None:
        os.environ.pop("KVGUARD_DISABLE", None)
    else:
        os.environ["KVGUARD_DISABLE"] = saved


def _without_tiers(trace):
    return dataclasses.replace(trace, geometry=dataclasses.replace(trace.geometry, secondary_tiers=None))


def _violations() -> dict[tuple[str, str], float]:
    """``kvguard_invariant_violations_total`` in this process's registry, per (check, action)."""
    from prometheus_client import REGISTRY

    return {
        (s.labels[names.LABEL_CHECK], s.labels[names.LABEL_ACTION]): s.value
        for metric in REGISTRY.collect()
        for s in metric.samples
        if s.name == names.METRIC_INVARIANT_VIOLATIONS
    }


def _replay(trace, policy: str, check: str = names.CHECK_PROMOTION_FIT):
    """``(result, counter deltas per (check, action), the events of check)``."""
    before = _violations()
    with events.capture() as logged:
        result = harness.run_replay(trace, guard=True, policy=policy)
    after = _violations()
    delta = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    fit = [e for e in logged if e.get("check") == check]
    return result, delta, fit


@needs_tiering
def test_without_the_guard_the_request_is_deferred_forever() -> None:
    result = harness.run_replay(LOOP, guard=False)
    assert result.engine_survived and result.stalled
    assert [(s["request_id"], s["kind"]) for s in result.stalls] == [(VICTIM, "lookup_deferred")]
    assert result.finished == result.submitted - 1 and result.wrong_kv_blocks == 0


@needs_tiering
def test_with_the_guard_every_request_finishes_with_the_right_kv_and_tokens() -> None:
    result, delta, fit = _replay(LOOP, "guard")
    assert result.ok and not result.stalled, result.error
    assert result.finished == result.submitted == 7
    assert result.wrong_kv_blocks == 0 and result.guard_errors == {}
    pf = result.checks[names.CHECK_PROMOTION_FIT]
    assert pf["hit_reduced"] == 1 and pf["violations"] == 1 and pf["unchecked"] == 0
    assert pf["recomputed_tokens"] > 0
    assert result.checks[names.CHECK_LOAD_COVERAGE]["violations"] == 0
    # the counter an operator scrapes names the check and the action, and nothing else moved
    assert delta == {(names.CHECK_PROMOTION_FIT, names.ACTION_HIT_REDUCED): 1.0}
    (event,) = fit
    assert event["request_id"] == VICTIM and event["action"] == names.ACTION_HIT_REDUCED
    # the invariant, as measured from the lookup: the load set needs more chunks than the CPU tier has
    assert event["primary_capacity_chunks"] == LOOP.geometry.cpu_chunks == 30
    assert event["needed_chunks"] > event["primary_capacity_chunks"]
    assert event["recomputed_tokens"] == event["deferred_hit_tokens"] - event["admitted_hit_tokens"]
    assert result.hits[VICTIM]["external_hit_tokens"] == event["admitted_hit_tokens"]
    # the same tokens as a run without the secondary tier (where nothing stalls)
    plain = harness.run_replay(_without_tiers(LOOP), guard=False)
    assert plain.ok and plain.finished == 7
    assert result.outputs == plain.outputs


@needs_tiering
def test_a_reduced_hit_above_zero_loads_only_ready_chunks(monkeypatch) -> None:
    """The first deferral's ready chunks give 0 on this trace; one step later part of the
    hit is ready (measured on 0.33.0: 56 tokens; on 0.25.1 nothing, the test skips). The
    check is held back (``seen`` withheld) on the victim's first deferral, so it acts on
    the second: the admitted hit is > 0, its load runs through vLLM's own
    ``prepare_load`` and the worker, and the KV oracle finds no wrong block."""
    original = admission.lookup.admit
    deferrals: list[int] = []

    def second_deferral(cs, request, num_computed_tokens, answer, seen=None):
        if answer[0] is None and request.request_id == VICTIM:
            deferrals.append(1)
            if len(deferrals) == 1:
                seen = None
        return original(cs, request, num_computed_tokens, answer, seen=seen)

    monkeypatch.setattr(admission.lookup, "admit", second_deferral)
    result, delta, fit = _replay(LOOP, "guard")
    assert len(deferrals) == 2 and result.ok and result.finished == 7, result.error
    assert result.wrong_kv_blocks == 0
    (event,) = fit
    if event["admitted_hit_tokens"] == 0:
        # measured on 0.25.1: at every deferral of this trace (the 1st to the 8th) no chunk
        # prefix of the hit is ready in both groups, so the answer is 0 and no load runs;
        # 0.26.0 and 0.29.0 skip here too (1 Dec CI rehearsal): proven on 0.33.0 only
        pytest.skip(f"vLLM {harness.vllm_version()}: nothing of the hit is ready at the second deferral")
    assert 0 < event["admitted_hit_tokens"] < event["deferred_hit_tokens"]
    assert result.hits[VICTIM]["external_hit_tokens"] == event["admitted_hit_tokens"]
    assert VICTIM in [ld.req_id for ld in result.worker.loads]
    assert result.worker.oracle.loaded_blocks > 0 and result.wrong_kv_blocks == 0
    assert delta == {(names.CHECK_PROMOTION_FIT, names.ACTION_HIT_REDUCED): 1.0}
    plain = harness.run_replay(_without_tiers(LOOP), guard=False)
    assert result.outputs == plain.outputs


@needs_tiering
def test_observe_counts_and_keeps_vllms_deferral() -> None:
    result, delta, fit = _replay(LOOP, "observe")
    assert result.engine_survived and result.stalled
    assert [(s["request_id"], s["kind"]) for s in result.stalls] == [(VICTIM, "lookup_deferred")]
    pf = result.checks[names.CHECK_PROMOTION_FIT]
    assert pf["hit_reduced"] == 0 and pf["recomputed_tokens"] == 0
    assert pf["continued"] >= 1 and pf["continued"] == pf["violations"]  # once per deferred lookup
    # the wait bound (guards/checks/wait_bound.py) counts the same stall once, when it passes the
    # bound, and leaves it too
    assert result.checks[names.CHECK_WAIT_BOUND].get(f"{names.WAIT_LOOKUP_DEFERRED}:{names.ACTION_CONTINUED}") == 1
    assert delta == {(names.CHECK_PROMOTION_FIT, names.ACTION_CONTINUED): float(pf["continued"]),
                     (names.CHECK_WAIT_BOUND, names.ACTION_CONTINUED): 1.0}
    assert {e["action"] for e in fit} == {names.ACTION_CONTINUED}


@needs_tiering
def test_strict_raises_at_admission() -> None:
    result, delta, _ = _replay(LOOP, "strict")
    assert not result.engine_survived
    assert "kvguard promotion_fit" in (result.error or "") and "AssertionError" in result.error
    assert delta == {(names.CHECK_PROMOTION_FIT, names.ACTION_RAISED): 1.0}


@needs_tiering
def test_a_promotion_that_fits_is_left_to_vllm() -> None:
    """secondary-tier.jsonl: r1's hit is promoted from the secondary tier (one deferral)
    and fits the 16-chunk CPU tier: the check runs on that deferral and does nothing."""
    result, delta, fit = _replay(FITS, "guard")
    assert result.ok and result.finished == 3
    pf = result.checks[names.CHECK_PROMOTION_FIT]
    assert pf["evaluated"] >= 1 and pf["violations"] == 0 and fit == [] and delta == {}
    assert result.hits["r1"]["external_hit_tokens"] > 0 and result.wrong_kv_blocks == 0


@needs_tiering
def test_the_kill_switches_leave_vllms_deferral(monkeypatch) -> None:
    """Both deferred-hit checks and the wait bound off: vLLM's deferral stands (the stall)."""
    monkeypatch.setenv("KVGUARD_DISABLED_SITES",
                       "admission:promotion_fit,admission:promotion_progress,scheduler:wait_bound")
    result, delta, fit = _replay(LOOP, "guard")
    assert result.stalled and fit == [] and delta == {}
    assert result.checks[names.CHECK_PROMOTION_FIT]["evaluated"] == 0
    assert result.checks[names.CHECK_PROMOTION_PROGRESS]["evaluated"] == 0
    assert not [k for k in result.checks[names.CHECK_WAIT_BOUND] if ":" in k]  # the bound never acted


@needs_tiering
def test_without_the_promotion_checks_the_wait_bound_ends_the_loop(monkeypatch) -> None:
    """Both checks fitted to a tiering shape off: the end-to-end invariant alone (every wait
    ends) ends the pigeonhole loop, a bound later, with the hit cut to what is ready."""
    monkeypatch.setenv("KVGUARD_DISABLED_SITES", "admission:promotion_fit,admission:promotion_progress")
    result, delta, fit = _replay(LOOP, "guard")
    assert result.ok and not result.stalled and result.finished == 7 and result.wrong_kv_blocks == 0
    assert delta == {(names.CHECK_WAIT_BOUND, names.ACTION_HIT_REDUCED): 1.0}
    assert result.checks[names.CHECK_WAIT_BOUND][f"{names.WAIT_LOOKUP_DEFERRED}:{names.ACTION_HIT_REDUCED}"] == 1


@needs_tiering
def test_without_promotion_fit_promotion_progress_ends_the_pigeonhole_loop(monkeypatch) -> None:
    """promotion_fit off: the pigeonhole loop's promotions evict ready chunks of the same
    hit, so the second deferred lookup sees a ready chunk lost and ``promotion_progress``
    answers what is ready (one deferral later than ``promotion_fit`` would)."""
    monkeypatch.setenv("KVGUARD_DISABLED_SITES", "admission:promotion_fit")
    result, delta, progress = _replay(LOOP, "guard", names.CHECK_PROMOTION_PROGRESS)
    assert result.ok and not result.stalled and result.finished == 7 and result.wrong_kv_blocks == 0
    assert delta == {(names.CHECK_PROMOTION_PROGRESS, names.ACTION_HIT_REDUCED): 1.0}
    (event,) = progress
    assert event["request_id"] == VICTIM and event["lost_ready_chunks"] > 0
    assert result.checks[names.CHECK_PROMOTION_FIT]["evaluated"] == 0


@pytest.mark.skipif(WHY is None, reason="this release has vLLM's tiering (the tests above run)")
def test_a_release_without_tiering_skips_with_the_reason() -> None:
    assert "no vllm.v1.kv_offload.tiering package" in WHY


RANK_LOOP = load_trace(str(TRACES / "tiering-request-rank-loop.jsonl"))
RANK_VICTIM = "agent-1/turn-2"


def _ranks_by_request() -> bool:
    """Whether the installed LRU policy ranks an inserted chunk by its request's rank
    (0.33.0: ``LRUCachePolicy._get_request_rank``, fixed at the request's first insert)."""
    from vllm.v1.kv_offload.cpu.policies import lru

    return callable(getattr(lru.LRUCachePolicy, "_get_request_rank", None))


@needs_tiering
def test_a_deferral_that_evicts_its_own_ready_chunks_is_answered_with_what_is_ready() -> None:
    """tiering-request-rank-loop.jsonl (a fuzz finding, docs/fuzz.md): the victim's
    208-token hit loads 23 chunks (13 full-attention + 10 sliding-window), within the
    29-chunk CPU tier, so ``promotion_fit`` is silent. On a release whose LRU ranks chunks
    by request (0.33.0) the request's own promotions evict its own ready chunks and, without
    the guard, it is deferred forever; on 0.25.1 (plain LRU) every request finishes. With
    the guard ``promotion_progress`` sees a ready chunk of the awaited load set lost between
    two deferred lookups and answers what is ready: every request finishes, with the right
    KV and the tokens of a run without the secondary tiers."""
    from kvguard.guards.checks.load_coverage import GroupGeometry, load_set_size

    groups = [GroupGeometry(8, 2, None, 0), GroupGeometry(8, 2, 156, 0)]
    assert load_set_size(groups, 0, 208) == 23 <= RANK_LOOP.geometry.cpu_chunks == 29
    unguarded = harness.run_replay(RANK_LOOP, guard=False)
    if _ranks_by_request():
        assert [(s["request_id"], s["kind"]) for s in unguarded.stalls] == [(RANK_VICTIM, "lookup_deferred")]
        assert unguarded.finished == unguarded.submitted - 1 == 9
    else:
        assert unguarded.ok and not unguarded.stalled and unguarded.finished == 10
    result, delta, progress = _replay(RANK_LOOP, "guard", names.CHECK_PROMOTION_PROGRESS)
    assert result.ok and not result.stalled and result.finished == result.submitted == 10, result.error
    assert result.wrong_kv_blocks == 0 and result.guard_errors == {}
    assert result.checks[names.CHECK_PROMOTION_FIT]["evaluated"] > 0
    assert result.checks[names.CHECK_PROMOTION_FIT]["violations"] == 0
    pp = result.checks[names.CHECK_PROMOTION_PROGRESS]
    assert pp["hit_reduced"] >= 1 and pp["violations"] == pp["hit_reduced"] <= pp["evaluated"]
    assert delta == {(names.CHECK_PROMOTION_PROGRESS, names.ACTION_HIT_REDUCED): float(pp["hit_reduced"])}
    assert len(progress) == pp["hit_reduced"]
    assert sum(e["recomputed_tokens"] for e in progress) == pp["recomputed_tokens"]
    for event in progress:
        # the invariant as measured: ready chunks lost, and the load set fits (not promotion_fit's case)
        assert event["lost_ready_chunks"] > 0 and event["needed_chunks"] <= event["primary_capacity_chunks"] == 29
        assert event["recomputed_tokens"] == event["deferred_hit_tokens"] - event["admitted_hit_tokens"]
    if _ranks_by_request():
        assert RANK_VICTIM in {e["request_id"] for e in progress}
    plain = harness.run_replay(_without_tiers(RANK_LOOP), guard=False)
    assert plain.ok and not plain.stalled and plain.finished == 10 and plain.wrong_kv_blocks == 0
    assert result.outputs == plain.outputs


@needs_tiering
def test_promotion_progress_strict_raises_at_the_second_deferral() -> None:
    result, delta, progress = _replay(RANK_LOOP, "strict", names.CHECK_PROMOTION_PROGRESS)
    if not _ranks_by_request() and not progress:
        pytest.skip(f"vLLM {harness.vllm_version()}: no deferral of this trace loses a ready chunk")
    assert not result.engine_survived
    assert "kvguard promotion_progress" in (result.error or "") and "AssertionError" in result.error
    assert delta == {(names.CHECK_PROMOTION_PROGRESS, names.ACTION_RAISED): 1.0}
