"""Policies on vLLM's real rewritten functions (each .venvs/vllm-* env).

``update_state_after_alloc`` is vLLM's own code, called with state built by
guards_vllm_stubs (see its docstring); ``GPULoadStoreSpec`` is constructed for real.
The end-to-end path through ``Scheduler.schedule()`` is ``kvguard replay`` (tests of
guards/replay).
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvguard.guards.telemetry import events

from kvguard.guards.checks import asserts
from kvguard.guards.policy import runtime
from kvguard.guards.hooking.instrumentor import OffloadGuardInstrumentor
from kvguard.guards.telemetry.metrics import GuardMetrics
from kvguard.guards.settings import GuardSettings
from guardtools_vllm import (
    SITE_GROUP_SIZES_SUM,
    SITE_SWA_PENDING_BOUND,
    seed_pending_blocks,
    seed_window_bound,
)

from guards_vllm_stubs import PastTheWindowCheck, load_call

pytestmark = pytest.mark.vllm

POLICIES = ("observe", "guard", "strict")


def seed_outcome(policy: str) -> str:
    """What the seed load (98012 cached tokens, window 4096, block 32, chunk 256, vLLM #48959:
    129 pending GPU blocks, all legal) gives under ``policy`` on the installed release:
    ``"raised"`` where the release's own window assert allows fewer blocks (its bound, read
    from its code) and the policy lets vLLM's assert decide (observe; strict checks the
    exact bound on top of vLLM's), else ``"continued"`` (guard replaces the too-strict
    assert with the exact bound)."""
    too_strict = seed_window_bound()[0] < seed_pending_blocks()
    return "raised" if too_strict and policy != "guard" else "continued"


def seed_tolerated() -> int:
    """Loads the guard tolerates in the seed case: 1 where vLLM's bound is too strict."""
    return int(seed_window_bound()[0] < seed_pending_blocks())


@pytest.fixture
def registry():
    return CollectorRegistry()


@pytest.fixture
def bare():
    """vLLM without kvguard (another test may have left the plugin installed)."""
    inst = OffloadGuardInstrumentor()
    if inst.is_installed:
        inst.uninstall()
    yield


@pytest.fixture
def install(registry):
    inst = OffloadGuardInstrumentor()
    if inst.is_installed:
        inst.uninstall()

    def _install(policy: str) -> None:
        runtime.reset()
        assert inst.install(GuardSettings(policy=policy), metrics=GuardMetrics(registry=registry))

    yield _install
    if inst.is_installed:
        inst.uninstall()
    runtime.reset()


def run_load(num_null_blocks: int) -> str:
    sched, args = load_call(num_cached_tokens=98012, num_null_blocks=num_null_blocks)
    try:
        sched.update_state_after_alloc(*args)
    except PastTheWindowCheck:
        return "continued"
    except AssertionError as error:
        assert type(error) is AssertionError
        return "raised"
    raise AssertionError("update_state_after_alloc returned before its offload keys were read")


def violations(registry, check: str, action: str) -> float:
    return registry.get_sample_value("kvguard_invariant_violations_total", {"check": check, "action": action}) or 0


class TestIssue48959:
    @pytest.mark.parametrize("policy", POLICIES)
    def test_seed_load(self, install, registry, policy):
        install(policy)
        with events.capture() as logged:
            outcome = run_load(num_null_blocks=3063 - 129)
        assert outcome == seed_outcome(policy)
        snap = runtime.snapshot()["swa_pending_bound"]
        assert (snap["evaluated"], snap["max_pending_blocks"], snap["bound"]) == (1, 129, 129)
        tolerated = seed_tolerated() if policy == "guard" else 0
        assert snap["tolerated"] == tolerated
        assert snap["violations"] == (1 if outcome == "raised" else 0)
        if tolerated:
            event = next(e for e in logged if e["event"] == "check_tolerated")
            assert (event["pending_blocks"], event["exact_bound"], event["vllm_bound"]) == (129, 129, seed_window_bound()[0])
            assert event["num_cached_tokens"] == 98012 and event["request_id"] == "req-98012"

    def test_without_kvguard_vllm_decides(self, bare):
        assert run_load(num_null_blocks=3063 - 129) == seed_outcome("observe")

    @pytest.mark.parametrize("policy", POLICIES)
    def test_planted_real_violation(self, install, registry, policy):
        install(policy)
        assert run_load(num_null_blocks=3063 - 130) == "raised"  # 130 > exact 129 >= vLLM's bound
        assert violations(registry, "swa_pending_bound", "raised") == 1
        assert runtime.last_failed_site() == SITE_SWA_PENDING_BOUND

    def test_planted_violation_without_kvguard_is_vllms_crash(self, bare):
        assert run_load(num_null_blocks=3063 - 130) == "raised"

    def test_error_inside_guard_code_is_counted_and_the_step_completes(self, install, registry, monkeypatch):
        install("guard")

        def broken(context):
            raise RuntimeError("kvguard bug")

        monkeypatch.setattr(asserts, "_window_geometry", broken)
        assert run_load(num_null_blocks=3063 - 128) == "continued"  # 128: legal everywhere
        assert registry.get_sample_value("kvguard_guard_errors_total", {"stage": "context"}) == 1


class TestIssue42945:
    @pytest.mark.parametrize("policy", POLICIES)
    def test_inconsistent_spec_is_counted_and_raises_outside_a_store(self, install, registry, policy):
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        install(policy)
        # 16 sub-blocks claimed, 8 block ids: the 0.21.0 over-count at the window edge
        with pytest.raises(AssertionError) as info:
            GPULoadStoreSpec(list(range(1, 9)), group_sizes=[0, 16], block_indices=[0, 8])
        assert type(info.value) is AssertionError
        assert violations(registry, "group_sizes_consistency", "raised") == 1
        assert runtime.last_failed_site() == SITE_GROUP_SIZES_SUM

    def test_consistent_spec_is_not_counted(self, install, registry):
        """Its two asserts pass on vLLM's own opcodes: no evaluation, no violation counted."""
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        install("guard")
        spec = GPULoadStoreSpec(list(range(1, 9)), group_sizes=[0, 8], block_indices=[0, 8])
        assert list(spec.group_sizes) == [0, 8]
        snap = runtime.snapshot()["group_sizes_consistency"]
        assert (snap["evaluated"], snap["violations"]) == (None, 0)
        assert registry.get_sample_value(
            "kvguard_check_evaluations_total", {"check": "group_sizes_consistency"}
        ) == 0
        assert "@kvguard_check" in GPULoadStoreSpec.__init__.__code__.co_names  # installed all the same
