"""A secondary tier (vLLM's TieringOffloadingManager + its example tier) in the replay (marker vllm).

The trace ``tests/vllm/traces/secondary-tier.jsonl`` stores r0, evicts it from the GPU
and from a 16-chunk CPU tier, then r1 reuses r0's prompt: only the secondary tier still
holds it, so vLLM promotes it to the CPU tier and loads it to the GPU. Whether the
release can run it is detected from its code (:func:`tiering.unsupported_reason`), not
from its version: measured present on 0.25.1 and 0.33.0, absent on 0.21.0.

Run: ``.venvs/vllm-0.33.0/bin/pytest -m vllm tests/vllm/test_tiering.py``
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

from kvguard.lab.fuzz import determinism, strategies  # noqa: E402
from kvguard.lab.replay import harness, report, tiering  # noqa: E402
from kvguard.lab.replay.trace import load_trace  # noqa: E402

TRACE = load_trace(str(Path(__file__).parent / "traces" / "secondary-tier.jsonl"))
WHY = tiering.unsupported_reason()
needs_tiering = pytest.mark.skipif(WHY is not None, reason=f"no vLLM tiering here: {WHY}")


def _without_tiers(trace):
    return dataclasses.replace(trace, geometry=dataclasses.replace(trace.geometry, secondary_tiers=None))


@needs_tiering
def test_a_load_is_served_through_the_secondary_tier_with_the_right_kv() -> None:
    result = harness.run_replay(TRACE, guard=False)
    out = report.to_json(result, TRACE.geometry)
    assert result.ok and out["requests"]["finished"] == 3, out["error"]
    tiers = out["secondary_tiers"]
    assert tiers["tiers"] == 1 and tiers["cascaded_chunks"] > 0
    assert tiers["promoted_chunks"] > 0 and tiers["promoted_unknown"] == 0
    # r1's hit exists only through the promotion: the same trace without the tier gets none
    assert result.hits["r1"]["external_hit_tokens"] > 0
    assert [l["request_id"] for l in out["worker"]["loads"]] == ["r1"]
    kv = out["worker"]["kv_oracle"]
    assert kv["secondary_loaded_chunks"] == tiers["promoted_chunks"] and kv["loaded_blocks"] > 0
    assert out["wrong_kv_blocks"] == 0

    plain = harness.run_replay(_without_tiers(TRACE), guard=False)
    assert plain.ok and plain.secondary_tiers is None
    assert plain.hits["r1"]["external_hit_tokens"] == 0 and plain.worker.oracle.loaded_blocks == 0


@needs_tiering
def test_a_tier_that_keeps_no_kv_is_wrong_kv_not_a_silent_pass() -> None:
    """Negative control: the tier's copy (the oracle's fingerprints) is dropped, so the
    promoted slots read as never written and r1's loaded blocks are wrong KV."""
    engine = harness.build_engine(TRACE.geometry, TRACE.worker)
    # the CPU tier's /dev/shm file was unlinked at build (nothing joins it; no leak)
    region = next(v for v in vars(engine.connector_scheduler.manager.primary_tier).values()
                  if isinstance(getattr(v, "mmap_path", None), str))
    assert not Path(region.mmap_path).exists()
    engine.worker.oracle.secondary_store = lambda *args: None
    result = harness.run_replay(TRACE, guard=False, engine=engine)
    assert result.engine_survived and not result.ok
    assert result.secondary_tiers["promoted_unknown"] == result.secondary_tiers["promoted_chunks"] > 0
    assert result.wrong_kv_blocks > 0
    assert "never-written" in result.worker.oracle.wrong_kv[0]["what"]


@needs_tiering
def test_the_guard_checks_a_promoted_hit_without_guard_errors() -> None:
    """kvguard's admission check reads the tiering manager's CPU tier (``primary_tier``)."""
    result = harness.run_replay(TRACE, guard=True)
    assert result.ok and result.guard_installed
    assert result.guard_errors == {}
    coverage = result.checks["load_coverage"]
    assert coverage["evaluated"] >= 1 and coverage["unchecked"] == 0 and coverage["hit_reduced"] == 0
    assert result.secondary_tiers["promoted_chunks"] > 0


@pytest.mark.skipif(WHY is None, reason="this release has vLLM's tiering (the tests above run)")
def test_a_release_without_tiering_refuses_the_field_clearly() -> None:
    with pytest.raises(RuntimeError, match=r"geometry\.secondary_tiers on this release: .*tiering"):
        harness.run_replay(TRACE, guard=False)
    assert "no vllm.v1.kv_offload.tiering package" in WHY


def test_the_fuzzer_draws_secondary_tiers_only_where_the_release_has_them() -> None:
    """Deterministic for a seed on this release; listed in not_generated where absent."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed

    seen: list = []

    @hseed(3)
    @settings(max_examples=30, database=None, derandomize=False, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategies.traces())
    def draw(trace):
        seen.append(trace.geometry.secondary_tiers)

    # the fuzzer's own generation pins Hypothesis' local-constants pool; so do these draws
    with determinism.pinned_constants():
        draw()
        first = list(seen)
        seen.clear()
        draw()
    assert seen == first
    fields = {n["field"]: n["reason"] for n in strategies.not_generated()}
    if WHY is None:
        assert {("example",), ("example", "example")} & set(first) and None in first
        assert "secondary_tiers" not in fields and "secondary_tiers[].type" in fields
    else:
        assert set(first) == {None}
        assert fields["secondary_tiers"] == WHY
    assert "tiering" not in fields


LOOP = load_trace(str(Path(__file__).parent / "traces" / "tiering-promotion-loop.jsonl"))


@needs_tiering
def test_the_fuzzers_promotion_loop_finding_replays() -> None:
    """kvguard fuzz's tiering finding (``make fuzz``, 0.33.0, seed 0): a hit that needs
    more chunks than the CPU tier holds is promoted and evicted in a loop; the request is
    deferred forever (stall ``lookup_deferred``). With twice the CPU chunks it finishes."""
    result = harness.run_replay(LOOP, guard=False)
    assert result.engine_survived and result.stalled
    assert [(s["request_id"], s["kind"]) for s in result.stalls] == [("agent-2/turn-3", "lookup_deferred")]
    tiers = result.secondary_tiers
    assert tiers["promoted_chunks"] > tiers["cascaded_chunks"]  # the same chunks, again and again
    assert result.wrong_kv_blocks == 0
    bigger = dataclasses.replace(LOOP, geometry=dataclasses.replace(LOOP.geometry, cpu_chunks=64))
    assert harness.run_replay(bigger, guard=False).ok
