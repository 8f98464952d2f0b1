"""Stalls of vLLM's tiering end by the wait bound, never worse than vLLM alone (marker vllm).

Two fuzz findings of vLLM's ``TieringOffloadingManager`` (docs/fuzz.md):

- ``tiering-promotion-loop.jsonl`` (0.33.0 seed 0): request ``agent-2/turn-3`` has its
  prefix only in the example secondary tier, and the hit's load set (48 chunks) is larger
  than the 30-chunk CPU tier: every lookup promotes the missing chunks by evicting ready
  ones of the same hit and answers "retry later" (stall ``lookup_deferred``).
- ``tiering-request-rank-loop.jsonl``: the victim's 23-chunk hit fits the 29-chunk CPU
  tier, but on a release whose LRU ranks chunks by request (0.33.0) the request's own
  promotions evict its own ready chunks, forever.

Two checks were once written for these shapes (``promotion_fit``, ``promotion_progress``);
the differential fuzz showed them cutting hits in examples vLLM alone served whole, and the
wait bound ending every stall they ended, so they were retired. These tests are the
evidence kept: where vLLM alone stalls, the guarded replay ends the stall through the wait
bound (``lookup_deferred``, ``hit_reduced``: the hit cut to what is ready, 0 here, vLLM
recomputes), every request finishes with the right KV and the tokens of a run without the
secondary tier; where vLLM alone finishes, the guard does nothing. Each expectation is the
release's own unguarded outcome, measured in the same test.

Whether the release has vLLM's tiering is detected from its code
(:func:`kvguard.lab.replay.tiering.unsupported_reason`): absent on 0.21.0 (the tests skip
there, with that reason).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

from kvguard.guards import names  # noqa: E402
from kvguard.lab.fuzz import differential  # noqa: E402
from kvguard.lab.replay import harness, tiering  # noqa: E402
from kvguard.lab.replay.trace import load_trace  # noqa: E402

TRACES = Path(__file__).parent / "traces"
WHY = tiering.unsupported_reason()
needs_tiering = pytest.mark.skipif(WHY is not None, reason=f"no vLLM tiering here: {WHY}")
STALLS = {
    "tiering-promotion-loop.jsonl": "agent-2/turn-3",
    "tiering-request-rank-loop.jsonl": "agent-1/turn-2",
}


@pytest.fixture(autouse=True)
def fresh_guard():
    """Each test installs the guard itself; leave no guard or KVGUARD_DISABLE behind."""
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


def _actions(result) -> dict[str, int]:
    return {k: v for k, v in (result.checks.get(names.CHECK_WAIT_BOUND) or {}).items() if ":" in k and v}


@needs_tiering
@pytest.mark.parametrize("name", sorted(STALLS))
def test_a_tiering_stall_ends_by_the_wait_bound_and_no_request_is_worse(name: str) -> None:
    trace = load_trace(str(TRACES / name))
    victim = STALLS[name]
    plain = harness.run_replay(trace, guard=False)
    guarded = harness.run_replay(trace, guard=True)
    assert guarded.ok and not guarded.stalled, guarded.error
    assert guarded.finished == guarded.submitted and guarded.failed_requests == []
    assert guarded.wrong_kv_blocks == 0 and guarded.guard_errors == {}
    verdict = differential.compare(guarded, plain, _actions(guarded))
    assert verdict.worse == [] and verdict.verdict != "worse"
    if plain.stalled:
        assert [(s["request_id"], s["kind"]) for s in plain.stalls] == [(victim, "lookup_deferred")]
        assert _actions(guarded) == {f"{names.WAIT_LOOKUP_DEFERRED}:{names.ACTION_HIT_REDUCED}": 1}
        assert verdict.verdict == "better" and verdict.better == [victim]
    else:  # vLLM alone finishes (0.25.1's plain LRU on the rank loop): the guard does nothing
        assert _actions(guarded) == {} and verdict.verdict == "same"
    reference = harness.run_replay(_without_tiers(trace), guard=False)
    assert reference.ok and reference.wrong_kv_blocks == 0
    assert guarded.outputs == reference.outputs  # the same tokens as without the secondary tier


@needs_tiering
@pytest.mark.parametrize("name", sorted(STALLS))
def test_a_request_never_sent_behind_the_stall_is_lost_with_it(name: str) -> None:
    """A next turn that waits for the stalled request is never sent in vLLM alone's run: it
    is lost with the stall (``not_arrived_stalled``, ranked with a stranded request), not
    "failed"; guarded, the wait bound ends the stall and both finish, so the comparison is
    ``better`` for both (7 Dec 2026: ranked as failed, a guarded life that stalled later
    than vLLM alone's was called ``worse``)."""
    from kvguard.lab.replay.trace import Segment, TraceRequest

    trace = load_trace(str(TRACES / name))
    victim = STALLS[name]
    nxt = TraceRequest(id="next-turn", prompt=(Segment(output_of=victim), Segment(seed=77, tokens=8)),
                       max_tokens=2, after=victim)
    trace = dataclasses.replace(trace, requests=trace.requests + (nxt,))
    plain = harness.run_replay(trace, guard=False)
    guarded = harness.run_replay(trace, guard=True)
    assert guarded.request_fates["next-turn"] == "finished" and not guarded.stalled
    if plain.stalled:
        assert plain.request_fates[victim] == "unfinished"
        assert plain.request_fates["next-turn"] == "not_arrived_stalled"
        verdict = differential.compare(guarded, plain, _actions(guarded))
        assert verdict.verdict == "better" and verdict.better == sorted([victim, "next-turn"])
    else:
        assert plain.request_fates["next-turn"] == "finished"


@needs_tiering
def test_the_wait_bound_off_leaves_vllms_deferral(monkeypatch) -> None:
    """Negative control: with its kill switch the wait bound never acts and vLLM's deferral
    stands (the stall the test above ends)."""
    monkeypatch.setenv("KVGUARD_DISABLED_SITES", "scheduler:wait_bound")
    trace = load_trace(str(TRACES / "tiering-promotion-loop.jsonl"))
    result = harness.run_replay(trace, guard=True)
    assert result.stalled and _actions(result) == {}


@needs_tiering
def test_a_promotion_that_fits_is_left_to_vllm() -> None:
    """secondary-tier.jsonl: r1's hit is promoted from the secondary tier (one deferral)
    and the wait ends by itself: the wait bound observes it and never acts."""
    trace = load_trace(str(TRACES / "secondary-tier.jsonl"))
    result = harness.run_replay(trace, guard=True)
    assert result.ok and result.finished == 3 and _actions(result) == {}
    assert result.hits["r1"]["external_hit_tokens"] > 0 and result.wrong_kv_blocks == 0


@pytest.mark.skipif(WHY is None, reason="this release has vLLM's tiering (the tests above run)")
def test_a_release_without_tiering_skips_with_the_reason() -> None:
    assert "no vllm.v1.kv_offload.tiering package" in WHY
