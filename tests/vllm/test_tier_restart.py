"""A restart over a tier that outlives the engine never loads a partly written chunk.

The hole (issue 42, "restarts and shared tiers"): the copy ledger that knows which chunks
a store wrote only partly lives in the engine process; vLLM's tiering cascades every
stored chunk to its secondary tiers, and the fs, obj and p2p tiers keep them after the
engine exits or serve them to other engines. ``tier-restart-swa-partial.jsonl`` is written
from the mechanism (the swa-partial-chunk class of tests/vllm/test_copy_coverage.py with
vLLM's example tier and a ``restart`` line): before the restart ``sharer`` stores window
chunk 0 with sub-block 0 never copied and the tier receives it; after it (a new engine
over the same tier contents, the oracle's fingerprints of them carried over:
``harness.restart_engine``) ``reader`` promotes that chunk and reads the uncopied slot, and
``again`` re-reads the writer's whole chunks.

Expectations: how many wrong blocks vLLM alone serves is a measured release fact
(``tier_restart_swa_partial_wrong_kv_blocks``); guarded, none on every release with
tiering, every request finishing, and ``again``'s hit the same as vLLM alone's (whole
chunks are still published and loaded).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from release_facts import fact

from kvguard.guards import names
from kvguard.guards.checks import copy_ledger
from kvguard.lab.replay import harness
from kvguard.lab.replay.tiering import PRESENCE_FIELDS, unsupported_reason
from kvguard.lab.replay.trace import load_trace

pytestmark = pytest.mark.vllm

TRACE = Path(__file__).parent / "traces" / "tier-restart-swa-partial.jsonl"
FACT = "tier_restart_swa_partial_wrong_kv_blocks"


@pytest.fixture(autouse=True)
def _fresh_guard():
    harness.uninstall_guard()
    yield
    harness.uninstall_guard()


def _trace(tier: str = "example"):
    """The trace over ``tier``: vLLM's in-memory example tier (carried over the restart by
    the lab) or its fs tier (real files the restarted engine reads: lab/replay/fs_tier.py).
    The release fact is the same for both: the wrong block is in the promoted chunk's
    bytes, wherever they are kept."""
    want = fact(FACT)
    if want is None:  # a release without vLLM's tiering: the trace cannot be expressed
        assert unsupported_reason() is not None
        pytest.skip(f"no vLLM tiering on this release ({unsupported_reason()}; release fact {FACT} is null)")
    trace = load_trace(str(TRACE))
    trace = dataclasses.replace(trace, geometry=dataclasses.replace(trace.geometry, secondary_tiers=(tier,)))
    return trace, want


@pytest.mark.parametrize("tier", ["example", "fs"])
def test_a_restart_over_the_tier_loads_no_partial_chunk_and_keeps_whole_hits(tier: str) -> None:
    trace, want = _trace(tier)
    assert trace.restarts == ("reader",)
    plain = harness.run_replay(trace, guard=False)
    assert plain.engine_survived and not plain.stalled and plain.restarts == 1
    assert plain.wrong_kv_blocks == want, plain.worker.oracle.wrong_kv
    if want:  # the wrong block is the uncopied slot of the promoted chunk, read by `reader`
        assert plain.wrong_kv_requests == {"reader"}
        assert plain.secondary_tiers["promoted_chunks"] >= 1
    guarded = harness.run_replay(trace, guard=True)
    assert guarded.ok and guarded.restarts == 1 and guarded.wrong_kv_blocks == 0 and guarded.guard_errors == {}
    assert guarded.finished == guarded.submitted == len(trace.requests) and not guarded.failed_requests
    withheld = guarded.checks[names.CHECK_TIER_PUBLISH]["violations"]
    assert (withheld >= 1) == bool(want)  # the partial chunk never reached the tier
    # the whole chunks did: `again` hits the same tokens as vLLM alone
    assert guarded.hits["again"] == plain.hits["again"]
    if plain.secondary_tiers["promoted_chunks"]:  # 0.25.1 and 0.26.0 promote nothing from this tier
        assert guarded.hits["again"]["external_hit_tokens"] > 0


@pytest.mark.parametrize("tier", ["example", "fs"])
def test_observe_publishes_and_counts(tier: str) -> None:
    """``observe`` changes nothing vLLM does: the partial chunk is cascaded (counted
    ``continued``) and the restarted engine serves the same wrong KV as vLLM alone."""
    trace, want = _trace(tier)
    if not want:
        pytest.skip(f"vLLM alone publishes no partial chunk with this trace on this release (release fact {FACT})")
    observed = harness.run_replay(trace, guard=True, policy="observe")
    assert observed.wrong_kv_blocks == want
    assert observed.checks[names.CHECK_TIER_PUBLISH]["violations"] >= 1


def test_a_remote_lookup_of_a_partial_chunk_answers_miss() -> None:
    """The second path out of the CPU tier: a peer (the p2p tier's server, 0.34.0's kvcr
    tier) asks through vLLM's tier-facing parent (``lookup(..., exclude_tier_idx=origin)``)
    and pins what answers HIT. Before the restart, the partly written key is in the CPU
    tier: vLLM alone answers HIT to the peer; guarded, MISS; a whole key answers HIT both
    ways."""
    trace, want = _trace()
    if not want:
        pytest.skip(f"no partial chunk is stored with this trace on this release (release fact {FACT})")
    cut = [r.id for r in trace.requests].index(trace.restarts[0])
    before = dataclasses.replace(trace, requests=trace.requests[:cut], restarts=())
    answers = {}
    for guard in (True, False):
        if guard:
            harness.install_guard("guard")
        engine = harness.build_engine(before.geometry, before.worker)
        result = harness.run_replay(before, guard=guard, engine=engine)
        assert result.ok
        manager = engine.tier_tap.manager
        parents = getattr(manager, "_tier_parents", None)
        if not parents:
            pytest.skip(f"vLLM {result.vllm_version}: the tiering manager serves no remote requester "
                        "(no tier-facing parents)")
        if guard:  # the keys, from the guarded engine (content-addressed: the same in both)
            ledger = engine.connector_scheduler.__dict__[copy_ledger.LEDGER_ATTR]
            partial = next(k for g in ledger.groups for k in g)
            tier = manager.secondary_tiers[0]
            held = next(vars(tier)[n] for n in PRESENCE_FIELDS if isinstance(vars(tier).get(n), dict))
            whole = next(iter(held))  # the tier holds whole chunks only, guarded
            assert partial not in held
        parent = next(iter(parents.values()))
        ctx = sys.modules[type(manager).__module__].ReqContext(req_id=f"peer-{guard}")
        parent.on_new_request(ctx)
        answers[guard] = (parent.lookup(partial, ctx).name, parent.lookup(whole, ctx).name)
        parent.on_request_finished(ctx)
        harness.uninstall_guard()
    assert answers == {True: ("MISS", "HIT"), False: ("HIT", "HIT")}


SHARED = Path(__file__).parent / "traces" / "tier-shared-swa-partial.jsonl"
SHARED_FACT = "tier_shared_swa_partial_wrong_kv_blocks"


def test_a_second_engine_on_the_same_fs_tier_loads_no_partial_chunk() -> None:
    """Two engines over one fs tier directory, side by side (two servers mounting one
    volume): engine 0 writes the partial chunk's file, engine 1 (its own empty GPU cache and
    CPU tier, and a ledger that never heard of the chunk) promotes it. vLLM alone serves the
    uncopied slot where the release stores the chunk partly (release fact); guarded, engine
    0 never publishes it, and engine 1's re-read of the whole chunks hits as vLLM alone's."""
    want = fact(SHARED_FACT)
    if want is None:
        assert unsupported_reason() is not None
        pytest.skip(f"no vLLM tiering on this release (release fact {SHARED_FACT} is null)")
    trace = load_trace(str(SHARED))
    assert trace.engines == 2 and [r.engine for r in trace.requests] == [0, 0, 0, 1, 1]
    plain = harness.run_replay(trace, guard=False)
    assert plain.engine_survived and not plain.stalled and plain.engines == 2
    assert plain.finished == plain.submitted == len(trace.requests)
    assert plain.wrong_kv_blocks == want, [o.wrong_kv for o in plain.oracles()]
    if want:
        assert plain.wrong_kv_requests == {"reader"}  # engine 1's request, engine 0's file
    guarded = harness.run_replay(trace, guard=True)
    assert guarded.ok and guarded.engines == 2 and guarded.wrong_kv_blocks == 0 and guarded.guard_errors == {}
    assert guarded.finished == guarded.submitted == len(trace.requests) and not guarded.failed_requests
    assert (guarded.checks[names.CHECK_TIER_PUBLISH]["violations"] >= 1) == bool(want)
    assert guarded.hits["again"] == plain.hits["again"]
    assert guarded.hits["again"]["external_hit_tokens"] > 0  # engine 0's whole chunks, from disk
