"""The gpu_free_once check's pure part and its proxy, on a stand-in pool that records calls
(the real vLLM BlockPool runs in tests/vllm/test_simple_replay.py)."""

from __future__ import annotations

import pytest

from kvguard.guards import names
from kvguard.guards.checks import pool_frees
from kvguard.guards.checks.admission import counters
from kvguard.guards.policy import runtime


class _Pool:
    """Records each free_blocks call's block list; ``blocks`` like vLLM's pool."""

    def __init__(self):
        self.calls: list[list[str]] = []
        self.blocks = ["b0", "b1"]

    def free_blocks(self, ordered_blocks):
        self.calls.append(list(ordered_blocks))


def test_rounds_list_each_block_once_in_order():
    a, b, c = object(), object(), object()
    assert pool_frees.rounds([a, b, a, c, a, b]) == [[a, b, c], [a, b], [a]]
    assert pool_frees.rounds([a, b]) == [[a, b]]
    assert pool_frees.rounds([]) == []


@pytest.fixture
def policy():
    previous = runtime.policy()
    counters.reset()

    def set_policy(p: str) -> None:
        runtime.configure(policy=p)

    yield set_policy
    runtime.configure(policy=previous)
    counters.reset()


@pytest.mark.parametrize(("which", "calls", "action"), [
    (names.POLICY_GUARD, [["x", "y"], ["x"]], "free_split"),
    (names.POLICY_OBSERVE, [["x", "y", "x"]], "continued"),
])
def test_a_block_listed_twice_is_split_under_guard_and_passed_under_observe(policy, which, calls, action):
    policy(which)
    pool = _Pool()
    guarded = pool_frees.GuardedBlockPool(pool)
    guarded.free_blocks(iter(["x", "y", "x"]))
    assert pool.calls == calls
    assert guarded.blocks is pool.blocks  # every other attribute is the pool's own
    snap = pool_frees.snapshot()
    assert snap[action] == 1 and snap["violations"] == 1 and snap["evaluated"] == 1


def test_strict_raises_and_a_clean_call_passes_unchanged(policy):
    policy(names.POLICY_STRICT)
    pool = _Pool()
    guarded = pool_frees.GuardedBlockPool(pool)
    guarded.free_blocks(["x", "y"])
    assert pool.calls == [["x", "y"]] and pool_frees.snapshot()["violations"] == 0
    with pytest.raises(counters.StrictFailure):
        guarded.free_blocks(["x", "x"])
    assert pool.calls == [["x", "y"]] and pool_frees.snapshot()["raised"] == 1


class _DecrementThenAppend:
    """vLLM 0.21.0's order: every block decremented, then those at 0 appended."""

    def free_blocks(self, ordered_blocks):
        blocks = list(ordered_blocks)
        for b in blocks:
            b.ref_cnt -= 1
        self.free_block_queue.append_n([b for b in blocks if b.ref_cnt == 0 and not b.is_null])


class _TestEachBlock:
    """vLLM 0.34.0's order: each block tested right after its decrement."""

    def free_blocks(self, ordered_blocks):
        ready = []
        for b in ordered_blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                ready.append(b)
        self.free_block_queue.append_n(ready)


def test_whether_a_release_enqueues_a_doubly_listed_block_twice_is_read_off_its_code():
    assert pool_frees.duplicates_corrupt(_DecrementThenAppend) is True
    assert pool_frees.duplicates_corrupt(_TestEachBlock) is False
    assert pool_frees.duplicates_corrupt(_Pool) is True  # cannot run on the stand-in: guarded
