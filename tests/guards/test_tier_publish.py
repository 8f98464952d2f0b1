"""The pure parts of ``tier_publish``: which keys are partial, the job copy without them,
and when the ledger may forget with tiers (the wrappers on vLLM's real tiering manager:
tests/vllm/test_tier_restart.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pytest

from kvguard.guards import names
from kvguard.guards.checks import copy_ledger, tier_publish
from kvguard.guards.policy import runtime


@dataclass
class _Job:  # the fields vLLM 0.29-0.34's TransferJob declares that the copy touches
    job_id: int
    keys: list
    chunk_ids: np.ndarray
    is_promotion: bool = False
    extra: dict = field(default_factory=dict)


class _OldJob(NamedTuple):  # 0.25.1's slot field name, as a named tuple
    job_id: int
    keys: tuple
    block_ids: list


def _ledger() -> copy_ledger.CopyLedger:
    ledger = copy_ledger.CopyLedger(2)
    ledger.record(1, [b"k1"], [0b10], 0b11)  # group 1: k1 written partly
    return ledger


def test_partial_keys_are_those_the_ledger_holds_in_any_group() -> None:
    ledger = _ledger()
    assert tier_publish.partial_keys_of(ledger, [b"k0", b"k1", b"k2"]) == [False, True, False]
    ledger.record(1, [b"k1"], [0b11], 0b11)  # rewritten whole: forgotten (forget mode)
    assert tier_publish.partial_keys_of(ledger, [b"k1"]) == [False]
    ledger.unreadable = "no keys_to_store"
    assert tier_publish.partial_keys_of(ledger, [b"k0", b"k1"]) == [True, True]  # it vouches for none


def test_the_job_copy_keeps_its_id_and_drops_keys_with_their_slots() -> None:
    job = _Job(7, [b"a", b"b", b"c"], np.array([4, 5, 6]))
    out = tier_publish._without(job, [True, False, True])
    assert out.job_id == 7 and out.keys == [b"a", b"c"] and out.chunk_ids.tolist() == [4, 6]
    assert isinstance(out.chunk_ids, np.ndarray) and job.keys == [b"a", b"b", b"c"]  # the original is untouched
    none = tier_publish._without(job, [False, False, False])
    assert none.keys == [] and none.chunk_ids.tolist() == []
    old = tier_publish._without(_OldJob(3, (b"a", b"b"), [9, 8]), [False, True])
    assert old == _OldJob(3, [b"b"], [8])
    with pytest.raises(TypeError, match="chunk_ids"):
        tier_publish._without(object(), [True])


class _Tiered:
    secondary_tiers = [object()]


@pytest.mark.parametrize(("policy", "tiers", "forget"), [
    (names.POLICY_GUARD, True, True), (names.POLICY_STRICT, True, True),
    (names.POLICY_OBSERVE, True, False), (names.POLICY_OBSERVE, False, True)])
def test_the_ledger_forgets_with_tiers_only_while_partial_chunks_are_withheld(policy, tiers, forget) -> None:
    previous = runtime.configure(policy=policy)
    try:
        assert tier_publish.ledger_may_forget(_Tiered() if tiers else object()) is forget
    finally:
        runtime.configure(policy=previous["policy"])


class _Result(enum.Enum):  # the shape of vLLM's LookupResult (an enum with HIT and MISS)
    HIT = 1
    MISS = 2


class _Manager:
    """A manager whose ``lookup`` has the remote signature (0.29.0 onwards) and answers HIT."""

    secondary_tiers = [object()]

    def lookup(self, key, req_context, exclude_tier_idx=None):
        return _Result.HIT


def test_a_peer_polling_a_partial_key_is_counted_every_time_and_logged_once_per_key() -> None:
    from kvguard.guards.telemetry import counts, events

    manager, ledger = _Manager(), _ledger()
    assert tier_publish._wrap_lookup(manager, ledger)
    previous = counts.set_sinks(events_sink=events)  # the real events module, as configure() sets
    before = counts.snapshot()[names.CHECK_TIER_PUBLISH]["violations"]
    try:
        with events.capture() as logged:
            answers = [manager.lookup(b"k1", None, exclude_tier_idx=0) for _ in range(5)]
            answers.append(manager.lookup(b"k0", None, exclude_tier_idx=0))  # a whole key
            answers.append(manager.lookup(b"k1", None))  # the engine's own lookup: untouched
    finally:
        counts.set_sinks(*previous)
    assert answers == [_Result.MISS] * 5 + [_Result.HIT, _Result.HIT]
    failed = [e for e in logged if e.get("event") == names.EVENT_CHECK_FAILED]
    assert len(failed) == 1 and failed[0]["context"]["path"] == "remote"
    seen = manager.__dict__[tier_publish.REPORTED_ATTR]
    assert list(seen) == [b"k1"]
    for i in range(tier_publish.REPORTED_KEYS + 1):  # bounded: the oldest key is forgotten
        tier_publish._first_report(manager, i)
    assert len(seen) == tier_publish.REPORTED_KEYS and b"k1" not in seen
    assert counts.snapshot()[names.CHECK_TIER_PUBLISH]["violations"] - before == 5  # every poll counted


@dataclass
class JobResult:  # the declared fields of vLLM's tiering JobResult that kvguard fills
    job_id: int
    success: bool
    transfer_bytes: int | None = None


class _Tier:
    """A secondary tier that finishes nothing by itself (as 0.25.1's fs tier never
    finishes a job of no key); its module declares ``JobResult`` as vLLM's tiers' do."""

    def __init__(self) -> None:
        self.submitted: list = []

    def submit_store(self, job):
        self.submitted.append(job)

    def get_finished_jobs(self):
        return []


def test_a_job_left_with_no_key_never_reaches_the_tier_and_finishes_on_its_next_poll() -> None:
    tier, ledger = _Tier(), _ledger()
    tier_publish._wrap_tier(0, tier, ledger)
    previous = runtime.configure(policy=names.POLICY_GUARD)
    try:
        tier.submit_store(_Job(7, [b"k1"], np.array([3])))  # only the partial chunk
        tier.submit_store(_Job(8, [b"k0", b"k1"], np.array([4, 5])))  # one whole chunk left
        first, second = tier.get_finished_jobs(), tier.get_finished_jobs()
    finally:
        runtime.configure(policy=previous["policy"])
    assert [j.job_id for j in tier.submitted] == [8] and tier.submitted[0].keys == [b"k0"]
    assert first == [JobResult(job_id=7, success=True, transfer_bytes=0)] and second == []
    assert tier_publish.job_result(object(), 1) is None  # no JobResult class: no synthesis


def test_observe_hands_the_tier_every_job() -> None:
    tier, ledger = _Tier(), _ledger()
    tier_publish._wrap_tier(0, tier, ledger)
    previous = runtime.configure(policy=names.POLICY_OBSERVE)
    try:
        tier.submit_store(_Job(7, [b"k1"], np.array([3])))
    finally:
        runtime.configure(policy=previous["policy"])
    assert [j.keys for j in tier.submitted] == [[b"k1"]] and tier.get_finished_jobs() == []
