"""Policies observe / guard / strict on the (fake, light) scheduler code paths.

The same decisions run against the real vLLM functions in tests/vllm/test_policies.py.
"""

from __future__ import annotations

import pytest

from kvguard.guards.telemetry import events

from kvguard.guards import names

from kvguard.guards.checks import asserts
from kvguard.guards.policy import runtime
from kvguard.guards.hooking.instrumentor import OffloadGuardInstrumentor
from kvguard.guards.settings import GuardSettings
from guardtools import SITE_GROUP_SIZES_SUM, SITE_REQUEST_NOT_NONE, SITE_STORE_DROP, SITE_SWA_PENDING_BOUND

import fakevllm
from guardtools import sample

POLICIES = ["observe", "guard", "strict"]


@pytest.fixture
def fake(tmp_path, metrics):
    with fakevllm.fake_vllm(tmp_path):
        yield metrics


def install(policy: str, metrics) -> None:
    assert OffloadGuardInstrumentor().install(GuardSettings(policy=policy), metrics=metrics)


def swa_scheduler(sw: int = 4096):
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as mod

    return mod.OffloadingConnectorScheduler(fakevllm.Spec([mod.FullAttentionSpec(), mod.SlidingWindowSpec(sw)]))


class Request:
    request_id = "req-7"
    prompt_token_ids = [1, 2, 3]


class TestIssue48959:
    """98012 cached tokens, window 4096, block 32, chunk 256: 129 pending blocks, vLLM asserted 128."""

    def test_guard_tolerates_the_legal_129(self, fake, registry):
        install("guard", fake)
        sched = swa_scheduler()
        with events.capture() as logged:
            sched.update_state_after_alloc(Request(), 98012, 2934)
        assert sched.loads == [129, 129]  # the load went on, in both groups
        snap = runtime.snapshot()[names.CHECK_SWA_PENDING_BOUND]
        assert snap == {"evaluated": 1, "tolerated": 1, "violations": 0, "max_pending_blocks": 129, "bound": 129}
        assert sample(registry, "kvguard_check_tolerated_total", check="swa_pending_bound") == 1
        # the window site's evaluation reaches the counter at once (no flush, no step wrap)
        assert sample(registry, "kvguard_check_evaluations_total", check="swa_pending_bound") == 1
        event = next(e for e in logged if e["event"] == "check_tolerated")
        assert {
            "sliding_window": 4096, "tokens_per_block": 32, "blocks_per_chunk": 8, "num_cached_tokens": 98012,
            "pending_blocks": 129, "exact_bound": 129, "vllm_bound": 128, "vllm_version": "0.25.1",
            "request_id": "req-7",
        }.items() <= event.items()
        assert "prompt_token_ids" not in str(logged)
        assert runtime.last_failed_site() is None

    @pytest.mark.parametrize("policy", ["observe", "strict"])
    def test_observe_and_strict_keep_vllms_crash(self, fake, registry, policy):
        install(policy, fake)
        sched = swa_scheduler()
        with pytest.raises(AssertionError) as info:
            sched.update_state_after_alloc(Request(), 98012, 2934)
        assert str(info.value) == "" and type(info.value) is AssertionError
        assert sched.loads == [129]  # the full-attention group went through, the SWA group raised
        assert sample(registry, "kvguard_invariant_violations_total", check="swa_pending_bound", action="raised") == 1
        assert runtime.snapshot()["swa_pending_bound"]["tolerated"] == 0
        assert runtime.last_failed_site() == SITE_SWA_PENDING_BOUND

    def test_ratio_histogram_observes_every_load(self, fake, registry):
        install("guard", fake)
        sched = swa_scheduler()
        sched.update_state_after_alloc(Request(), 4096 * 2, 256 - 128)  # 128 pending: ratio 128/129
        sched.update_state_after_alloc(Request(), 98012, 2934)  # 129: ratio 1.0
        assert sample(registry, "kvguard_swa_pending_bound_ratio_count") == 2
        assert sample(registry, "kvguard_swa_pending_bound_ratio_bucket", le="0.99") == 0
        assert sample(registry, "kvguard_swa_pending_bound_ratio_bucket", le="1.0") == 2


@pytest.mark.parametrize("policy", POLICIES)
def test_planted_real_violation_is_counted_and_raises_under_every_policy(fake, registry, policy):
    install(policy, fake)
    sched = swa_scheduler()
    with pytest.raises(AssertionError):
        sched.update_state_after_alloc(Request(), 98012, 2933)  # 130 pending > exact 129 > vLLM's 128
    assert sample(registry, "kvguard_invariant_violations_total", check="swa_pending_bound", action="raised") == 1
    assert runtime.snapshot()["swa_pending_bound"]["max_pending_blocks"] == 130


def test_exact_violation_that_vllm_allows_is_counted_and_only_strict_raises(fake, registry):
    # window 4000: exact bound 126, vLLM 0.25.1 asserts cdiv(4000, 256) * 8 = 128
    for policy, raises in (("observe", False), ("guard", False), ("strict", True)):
        install(policy, fake)
        sched = swa_scheduler(sw=4000)
        if raises:
            with pytest.raises(AssertionError, match="kvguard strict: swa_pending_bound"):
                sched.update_state_after_alloc(Request(), 98012, 98012 // 32 - 126)
        else:
            sched.update_state_after_alloc(Request(), 98012, 98012 // 32 - 126)  # 127 pending
        action = "raised" if raises else "continued"
        assert sample(registry, "kvguard_invariant_violations_total", check="swa_pending_bound", action=action) >= 1
        OffloadGuardInstrumentor().uninstall()


def test_mamba_limit_is_never_loosened(fake, registry):
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as mod

    install("guard", fake)
    sched = mod.OffloadingConnectorScheduler(fakevllm.Spec([mod.MambaSpec()]))
    sched.update_state_after_alloc(Request(), 256, 0)  # 8 blocks == 1 chunk: fine
    with pytest.raises(AssertionError):
        sched.update_state_after_alloc(Request(), 288, 0)  # 9 blocks > 8
    assert sample(registry, "kvguard_invariant_violations_total", check="mamba_state_limit", action="raised") == 1
    assert runtime.snapshot()["mamba_state_limit"]["evaluated"] == 2


class TestIssue42945:
    @property
    def STORES(self):
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as mod

        return [
            ("ok-1", mod.ReqStatus(), [5, 6], [0, 2]),
            ("edge", mod.ReqStatus(), [7, 8, 9], [0, 16]),  # 0.21.0's over-count: 16 claimed, 3 ids
            ("ok-2", mod.ReqStatus(), [10], [1, 0]),
        ]

    def test_guard_drops_the_store_and_releases_its_keys(self, fake, registry):
        install("guard", fake)
        sched = swa_scheduler()
        with events.capture() as logged:
            jobs = sched._build_store_jobs(self.STORES)
        assert sorted(jobs) == ["ok-1", "ok-2"]  # the inconsistent spec never reaches the worker
        assert sched.manager.released == [["edge-k0", "edge-k1"]]  # complete_store(success=False)
        assert sample(
            registry, "kvguard_invariant_violations_total", check="group_sizes_consistency", action="store_dropped"
        ) == 1
        dropped = next(e for e in logged if e["event"] == "store_dropped")
        assert dropped["released_keys"] == 2 and dropped["site"] == SITE_STORE_DROP
        assert runtime.last_failed_site() is None  # nothing raised

    @pytest.mark.parametrize("policy", ["observe", "strict"])
    def test_observe_and_strict_raise_like_vllm(self, fake, registry, policy):
        install(policy, fake)
        sched = swa_scheduler()
        with pytest.raises(AssertionError) as info:
            sched._build_store_jobs(self.STORES)
        assert type(info.value) is AssertionError
        assert sched.manager.released == []
        assert sample(
            registry, "kvguard_invariant_violations_total", check="group_sizes_consistency", action="raised"
        ) == 1
        assert runtime.last_failed_site() == SITE_GROUP_SIZES_SUM

    def test_guard_raises_for_an_inconsistent_load_spec(self, fake):
        import vllm.v1.kv_offload.base as base

        install("guard", fake)
        with pytest.raises(AssertionError) as info:
            base.GPULoadStoreSpec([1, 2], group_sizes=[3], block_indices=[0])  # not inside a store build
        assert type(info.value) is AssertionError


def test_unknown_assert_is_counted_logged_and_reraised(fake, registry):
    install("guard", fake)
    sched = swa_scheduler()
    with events.capture() as logged, pytest.raises(AssertionError) as info:
        sched.update_state_after_alloc(None, 4096, 100)  # `assert request is not None`: listed nowhere
    # every assert in scope is a site: counted and logged with its id, then vLLM's own error
    assert type(info.value) is AssertionError
    (failed,) = [e for e in logged if e["event"] == "check_failed"]
    assert (failed["site"], failed["check"], failed["action"]) == (SITE_REQUEST_NOT_NONE, "scheduler_assert", "raised")
    assert sample(registry, "kvguard_invariant_violations_total", check="scheduler_assert", action="raised") == 1


def test_guard_error_is_counted_and_vllm_behaviour_follows(fake, registry, monkeypatch):
    install("guard", fake)
    sched = swa_scheduler()

    def boom(*a, **k):
        raise RuntimeError("bug inside kvguard")

    monkeypatch.setattr(asserts, "_check_window", boom)
    sched.update_state_after_alloc(Request(), 4096 * 2, 256 - 128)  # passing: the step completes
    with pytest.raises(AssertionError):
        sched.update_state_after_alloc(Request(), 98012, 2934)  # failing: vLLM's own decision
    assert sample(registry, "kvguard_guard_errors_total", stage="check") == 2


def test_context_error_falls_back_to_vllm(fake, registry, monkeypatch):
    install("guard", fake)
    sched = swa_scheduler()

    def boom(context):
        raise KeyError("geometry")

    monkeypatch.setattr(asserts, "_window_geometry", boom)
    sched.update_state_after_alloc(Request(), 4096 * 2, 256 - 128)
    assert sched.loads == [128, 128]
    assert sample(registry, "kvguard_guard_errors_total", stage="context") == 1
    # blind: vLLM's assert decided and passed, counted like a generic assert (not at all)
    assert runtime.snapshot()["scheduler_assert"] == {
        "evaluated": None, "tolerated": 0, "violations": 0, "max_pending_blocks": None, "bound": None,
    }
    assert sample(registry, "kvguard_check_evaluations_total", check="scheduler_assert") == 0


def test_suppressed_behaves_like_plain_asserts(fake, registry):
    install("guard", fake)
    sched = swa_scheduler()
    with runtime.suppressed(), pytest.raises(AssertionError):
        sched.update_state_after_alloc(Request(), 98012, 2934)
    assert runtime.snapshot()["swa_pending_bound"]["evaluated"] == 0
    assert sample(registry, "kvguard_check_tolerated_total", check="swa_pending_bound") == 0


def test_scheduler_built_before_install_is_reported_blind(fake, registry):
    sched = swa_scheduler()  # constructed before install: no KV cache spec recorded
    install("guard", fake)
    with pytest.raises(AssertionError):
        sched.update_state_after_alloc(Request(), 98012, 2934)  # vLLM's own decision
    assert sample(registry, "kvguard_guard_errors_total", stage="context") == 1
    assert sample(registry, "kvguard_invariant_violations_total", check="scheduler_assert", action="raised") == 1


def test_generic_assert_event_carries_the_request_and_geometry(fake, registry):
    """Issue 8 item 6: a generic assert's event names the request and the geometry the
    frame holds (here the stand-in's store builder: req_id and the scheduler's config)."""
    install("guard", fake)
    sched = swa_scheduler()
    with events.capture() as logged, pytest.raises(AssertionError):
        sched.update_state_after_alloc(None, 4096, 100)
    (failed,) = [e for e in logged if e["event"] == "check_failed"]
    assert failed["blocks_per_chunk"] == 8
    assert failed["context"]["num_cached_tokens"] == 4096
    assert failed["request_id"] is None  # the frame's request is None: nothing invented
