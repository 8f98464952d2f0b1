"""Request-scoped degrade on the real scheduler (issue 9 items 2-4; each .venvs/vllm-* env).

Each test replays a trace twice (``degrade_replay.py``): vLLM alone (``--no-guard``), then
with the guard (policy ``guard``). The planted trace runs in a fresh process (the planted
copy of the scheduler module must be put on the path before anything imports vLLM's); the
two natural traces run in this pytest process, from the same starting state as a fresh
process (no guard installed, ``KVGUARD_STATE_DIR`` unset, the Prometheus counters read as
increments since the start of the pair of replays): a subprocess costs a fresh vLLM
import, about 20-35 s per trace per release here (CI budget).

- store class (vLLM #49118): ``traces/abort-queued-49118.jsonl`` aborts a request that is
  still queued (its lookup ran, so its offload keys exist; it was never given GPU
  blocks) while another one runs. Measured: 0.26.0 dies in ``_build_store_jobs`` on
  ``assert len(offload_keys) == len(offload_block_ids)`` (it builds a store for finished
  requests from ``req.num_tokens``); 0.21.0 and 0.25.1 build stores only for scheduled
  requests and survive; 0.29.0, 0.33.0 and 0.34.0 survive (their store builder uses
  ``num_computed_tokens`` for an ``FINISHED_ABORTED`` request, PR #49146). Which release
  dies is the measured fact ``abort_queued_49118_dies`` (tests/vllm/release_facts.csv).
- request class, natural (vLLM #43884, fixed by PR #44409): ``traces/local-external-43884.jsonl``
  gives request ``victim`` a local GPU hit of 128 tokens plus a real CPU-tier hit (no
  driven hit) while the GPU block pool's LRU head holds the sliding-window group's
  untouched hit blocks. Where the KV cache coordinator allocates one group's external
  blocks before the next group's local hit blocks are touched (no two-phase allocation,
  feature-detected below), group 0's external allocation takes group 1's hit blocks (one
  physical block in both groups of the victim) and ``update_state_after_alloc`` asserts
  ``num_locally_computed_tokens <= num_locally_computed_gpu_blocks * gpu_block_size``.
  Measured: 0.21.0 dies so; 0.25.1, 0.26.0 and 0.33.0 (two-phase) survive, the victim
  loads its hit, and the guard changes no request's outcome.
- request class, planted: ``traces/planted-victim.jsonl`` with an assert planted in a copy
  of the installed ``update_state_after_alloc`` (the technique of test_sites.py) that
  fails for request ``victim`` only, after its CPU hit was admitted and before its load
  is issued (every release, whether or not it has the natural bug).
"""

from __future__ import annotations

import json
import functools
import subprocess
import sys
from pathlib import Path

import pytest
from release_facts import fact  # tests/vllm/release_facts.csv

pytestmark = pytest.mark.vllm

HERE = Path(__file__).parent


def dies_49118() -> bool:
    """Measured with --no-guard per release (release fact ``abort_queued_49118_dies``)."""
    return bool(fact("abort_queued_49118_dies"))

SITE_STORE_KEYS = "offloading.scheduler:OffloadingConnectorScheduler._build_store_jobs:f001a089"
ASSERT_43884 = "num_locally_computed_tokens <= num_locally_computed_gpu_blocks * gpu_block_size"


@functools.lru_cache(maxsize=None)
def _two_phase_allocation() -> bool:
    """True when the installed KV cache manager allocates a new request's blocks in two
    phases (PR #44409, the #43884 fix): every group's local hit blocks are added before
    any group's external blocks are allocated, as separate per-group steps
    (``add_local_computed_blocks`` then ``allocate_external_computed_blocks`` on the
    single-type managers). Without them (0.21.0) one ``allocate_new_computed_blocks``
    call per group touches, extends and allocates external blocks in one go. Asked at
    test time (a light run collects this module without vLLM)."""
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    return all(
        callable(getattr(SingleTypeKVCacheManager, name, None))
        for name in ("add_local_computed_blocks", "allocate_external_computed_blocks")
    )



def _run(trace: str, *extra: str) -> dict:
    """``degrade_replay.py`` in a fresh process (the planted trace: it must plant before
    vLLM's scheduler module is imported, which this pytest process has done already)."""
    proc = subprocess.run(
        [sys.executable, str(HERE / "degrade_replay.py"), str(HERE / "traces" / trace), *extra],
        capture_output=True, text=True, timeout=900,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def _run_here(trace: str) -> dict:
    """What ``degrade_replay.py TRACE`` prints, computed in this process (no planting).

    As in the fresh process: no guard installed before the no-guard replay (an earlier
    replay here leaves its guard installed), ``KVGUARD_STATE_DIR`` unset, and each
    replay's ``violations`` the series' increments since the pair started (the process's
    registry counts earlier tests' violations too); the result passes through JSON as the
    ``RESULT`` line does."""
    import degrade_replay  # tests/vllm, beside this module

    from kvguard.lab.replay.harness import uninstall_guard
    from kvguard.lab.replay.trace import load_trace

    def counts() -> dict[tuple[str, str], float]:
        return {(check, action): value for check, action, value in degrade_replay._violations()}

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("KVGUARD_STATE_DIR", raising=False)
        uninstall_guard()
        loaded = load_trace(str(HERE / "traces" / trace))
        before = counts()
        out: dict = {}
        for mode, guard in (("no_guard", False), ("guard", True)):
            report = degrade_replay.replay(loaded, guard=guard)
            report["violations"] = sorted(
                [check, action, value - before.get((check, action), 0.0)]
                for (check, action), value in counts().items()
                if value != before.get((check, action), 0.0)
            )
            out[mode] = report
    return json.loads(json.dumps(out))


@pytest.fixture(scope="module")
def abort_queued():
    return _run_here("abort-queued-49118.jsonl")


@pytest.fixture(scope="module")
def local_external():
    return _run_here("local-external-43884.jsonl")


@pytest.fixture(scope="module")
def planted():
    return _run("planted-victim.jsonl", "--plant", "victim")


def test_49118_without_the_guard(abort_queued):
    r = abort_queued["no_guard"]
    if dies_49118():
        assert not r["engine_survived"]
        assert r["error"] == "AssertionError: assert len(offload_keys) == len(offload_block_ids)"
        assert "in _build_store_jobs" in r["error_site"]
    else:
        assert r["ok"] and r["requests"]["aborted"] == 1 and r["requests"]["finished"] == 2


def test_49118_with_the_guard_drops_that_store_only(abort_queued):
    r = abort_queued["guard"]
    assert r["ok"] and r["engine_survived"] and not r["stalled"], r["error"]
    assert r["wrong_kv_blocks"] == 0  # never wrong KV (the replay worker's KV-content oracle)
    assert r["requests"] == {"submitted": 3, "finished": 2, "aborted": 1, "failed": 0, "not_arrived": 0}
    assert "queued" not in r["scheduled"]  # it never ran: the abort hit a queued request
    assert r["pending_store_keys"] == 0 and r["guard_errors"] == {}
    # nothing leaked: on 0.26.0 the drop runs vLLM's own skip epilogue
    # (_maybe_cleanup_finished_req); other requests' entries are vLLM's own bookkeeping
    assert r["left_requests"] == [] and "queued" not in r["req_status_left"]
    assert r["free_blocks"] == r["num_gpu_blocks"] - 1  # all but the null block
    dropped = [e for e in r["events"] if e["event"] == "check_failed"]
    if dies_49118():
        assert dropped == [
            {"event": "check_failed", "site": SITE_STORE_KEYS, "check": "store_keys_consistency",
             "action": "store_dropped", "request_id": "queued", "released_keys": None}
        ]
        (store_event,) = [e for e in r["events"] if e["event"] == "store_dropped"]
        assert store_event["released_keys"] == 0  # fired before prepare_store: nothing to release
        assert r["checks"]["store_keys_consistency"]["violations"] == 1
    else:
        assert dropped == [] and r["checks"]["store_keys_consistency"]["violations"] == 0


def test_planted_request_assert_without_the_guard_kills_the_engine(planted):
    r = planted["no_guard"]
    assert not r["engine_survived"]
    assert r["error"] == "AssertionError: planted: inconsistent offload state"
    assert "update_state_after_alloc" in r["error_site"]


def test_planted_request_assert_with_the_guard_fails_that_request_alone(planted):
    r = planted["guard"]
    assert r["ok"] and r["engine_survived"] and not r["stalled"], r["error"]
    assert r["wrong_kv_blocks"] == 0  # never wrong KV (the replay worker's KV-content oracle)
    # first, filler and bystander finish; victim failed; next-turn waited for it
    assert r["requests"] == {"submitted": 4, "finished": 3, "aborted": 0, "failed": 1, "not_arrived": 1}
    (failed,) = r["failed_requests"]
    assert failed["request_id"] == "victim"
    assert "planted: inconsistent offload state" in failed["error"] and "update_state_after_alloc" in failed["error"]
    # never computed on KV that was not loaded: never scheduled, no load, no store
    assert "victim" not in r["scheduled"] and "bystander" in r["scheduled"]
    assert "victim" not in r["loads"] and "victim" not in r["stores"]
    # its blocks are freed and nothing is left behind
    assert r["left_requests"] == [] and "victim" not in r["req_status_left"]
    assert r["free_blocks"] == r["num_gpu_blocks"] - 1
    # The planted copy is a second OffloadingConnectorScheduler class whose __init__ kvguard
    # does not wrap, so on a release that keeps no KV cache spec on the scheduler config
    # (0.21.0) the admission check cannot plan for it: it is skipped there (counted as
    # kvguard_check_skipped_total{reason="connector_config"}, issue 20 item 5), not a guard
    # error, and passes vLLM's answer through. Any guard error is a defect.
    assert r["pending_store_keys"] == 0
    assert r["guard_errors"] == {}, r["guard_errors"]
    failed_events = [e for e in r["events"] if e["event"] == "check_failed"]
    (event,) = [e for e in failed_events if e["action"] == "request_failed"]
    assert (event["request_id"], event["check"]) == ("victim", "scheduler_assert")
    assert event["site"].startswith("offloading.scheduler:OffloadingConnectorScheduler.update_state_after_alloc:")
    # 0.26.0 then builds a store for the finished victim up to req.num_tokens with no
    # block ids (the #49118 mechanism): that store is dropped too; nothing else fails
    others = [(e["check"], e["action"], e["request_id"]) for e in failed_events if e is not event]
    expected_others = [("store_keys_consistency", "store_dropped", "victim")] if dies_49118() else []
    assert others == expected_others


def test_43884_trace_reaches_the_request_class_without_a_driven_hit(local_external):
    for mode in ("no_guard", "guard"):
        r = local_external[mode]
        assert r["driven_hits"] == {}  # the CPU hit is vLLM's own lookup answer
        (victim,) = [rid for rid in r["allocs"]]  # the only request with an external hit
        assert victim == "victim"
        alloc = r["allocs"]["victim"]
        local = alloc["block_ids"][0][:8]  # 128 local tokens = 8 GPU blocks of 16 tokens
        assert alloc["external_tokens"] >= 112  # measured: 128 (0.21.0, 0.25.1), 112 (0.33.0)
        assert len(alloc["block_ids"][0]) == (128 + alloc["external_tokens"]) // 16
        assert local == list(range(1, 9))  # short's blocks: its group-0 hit of P[:128]
        if _two_phase_allocation():
            assert alloc["doubly_held"] == []
        else:
            # group 0's external blocks are group 1's still untouched hit blocks: one
            # physical block handed out twice to the victim (measured: 7 of the 8)
            group1_hit = alloc["block_ids"][1][:8]
            assert alloc["doubly_held"] and set(alloc["doubly_held"]) <= set(group1_hit)
            assert set(alloc["doubly_held"]) <= set(alloc["block_ids"][0][8:])


def test_43884_without_the_guard(local_external):
    r = local_external["no_guard"]
    assert r["wrong_kv_blocks"] == 0
    if _two_phase_allocation():  # fixed upstream: the victim loads its CPU hit and finishes
        assert r["ok"], r["error"]
        assert r["requests"] == {"submitted": 5, "finished": 5, "aborted": 0, "failed": 0, "not_arrived": 0}
        assert "victim" in r["loads"] and len(r["outputs"]["victim"]) == 4
    else:
        assert not r["engine_survived"]
        assert r["error"] == f"AssertionError: assert ( {ASSERT_43884} )"
        assert r["error_site"].endswith(" in update_state_after_alloc")
        assert "victim" not in r["loads"]


def test_43884_with_the_guard(local_external):
    plain, r = local_external["no_guard"], local_external["guard"]
    assert r["ok"] and r["engine_survived"] and not r["stalled"], r["error"]
    assert r["wrong_kv_blocks"] == 0  # never wrong KV (the replay worker's KV-content oracle)
    assert r["guard_errors"] == {} and r["pending_store_keys"] == 0
    # the admission check ran on the victim's hit and admitted it whole (it is loadable)
    assert r["checks"]["load_coverage"]["evaluated"] >= 1
    assert r["checks"]["load_coverage"]["hit_reduced"] == 0
    if _two_phase_allocation():  # the guard changes nothing: same outcomes, same tokens, nothing counted
        assert r["requests"] == plain["requests"] and r["outputs"] == plain["outputs"]
        assert r["failed_requests"] == [] and r["violations"] == [] and r["events"] == []
        return
    # the victim is recomputed (vLLM's failed-receive path frees the blocks it was given
    # twice and sends it back to the queue, guards/policy/recompute.py): every request finishes
    assert r["requests"] == {"submitted": 5, "finished": 5, "aborted": 0, "failed": 0, "not_arrived": 0}
    assert r["failed_requests"] == []
    # the victim's blocks were the doubly held ones (#33775): kvguard's block_exclusive check
    # (the end-to-end invariant, before vLLM's method runs) refused its load before vLLM's
    # #43884 assert, which used to be the first to see it, and its retry shares no block
    assert len(r["outputs"]["victim"]) == 4 and "victim" in r["scheduled"]
    assert {k: r["outputs"][k] for k in plain["outputs"]} == plain["outputs"]  # same tokens as unguarded
    assert r["left_requests"] == [] and "victim" not in r["req_status_left"]
    assert r["free_blocks"] == r["num_gpu_blocks"] - 1  # the doubly held blocks freed once each
    # the counters say which action was taken (the #42945 store check did not fire here)
    assert r["violations"] == [["block_exclusive", "recomputed", 1.0]]
    (event,) = [e for e in r["events"] if e["event"] == "check_failed"]
    assert (event["request_id"], event["check"], event["action"]) == ("victim", "block_exclusive", "recomputed")
    assert event["site"] == "admission:block_exclusive"
