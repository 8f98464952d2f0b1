"""A store for a request the offloading manager already finalized (check
``store_after_finalize``, vLLM #49635), on the installed vLLM's real scheduler, connector and
``TieringOffloadingManager`` (marker vllm).

The trace ``tests/vllm/traces/store-after-finalize-026.jsonl`` is the differential fuzz's
finding on 0.26.0 (seed 2, example 114, shrunk to 2 requests): a request finishes with no
store in flight and a chunk still to store; where the connector's ``request_finished``
finalizes the request in the manager before the store builder's last pass, vLLM alone dies
with ``KeyError`` in ``prepare_store``. Which releases do that is read from the installed
code (:func:`_finalizes_before_last_store`), never from the version: 0.25.1 and 0.26.0
finalize early, 0.29.0-0.34.0 build the last stores first. Measured on this trace: vLLM
alone dies on 0.26.0 only (on 0.25.1 the schedule never reaches a store after finalization;
the differential fuzz meets the class there too rarely to keep a trace: 0 no-better
examples in three seeds), so the replay's expectation follows vLLM alone's outcome, and a
release that builds its last stores first must not die of it.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

from kvguard.guards.checks import finalized_store
from kvguard.lab.replay import harness, tiering
from kvguard.lab.replay.trace import load_trace

pytestmark = pytest.mark.vllm

TRACE = Path(__file__).parent / "traces" / "store-after-finalize-026.jsonl"
WHY = tiering.unsupported_reason()


def _connector_scheduler() -> type:
    for module in ("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
                   "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector"):
        try:
            cls = getattr(importlib.import_module(module), "OffloadingConnectorScheduler", None)
        except ImportError:
            continue
        if cls is not None:
            return cls
    raise AssertionError("no OffloadingConnectorScheduler in the installed vLLM")


def _finalizes_before_last_store() -> bool:
    """The installed connector's ``request_finished`` tells the manager a *tracked* request
    finished (``on_request_finished(req_status.req_context)``), before the store builder's
    pass over ``finished_req_ids`` on the next step."""
    source = inspect.getsource(_connector_scheduler().request_finished)
    return "self.manager.on_request_finished(req_status.req_context)" in source


def _bound_managers() -> dict[str, tuple[tuple[str, ...], int, str]]:
    """Every class of ``vllm.v1.kv_offload`` the check binds to, by module and name."""
    import vllm.v1.kv_offload as pkg

    out = {}
    for info in pkgutil.walk_packages(pkg.__path__, f"{pkg.__name__}."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # an optional backend (nixl, a cloud SDK) this machine lacks
            continue
        for name in finalized_store.manager_classes(module):
            out[f"{info.name}.{name}"] = finalized_store._READS[getattr(module, name)]
    return out


def test_the_check_binds_where_prepare_store_reads_request_state_by_id() -> None:
    """Expectation from the release's code: the tiering manager's ``prepare_store`` holds
    ``self._req_state[req_context.req_id]`` wherever the tiering package exists; nothing
    else in ``vllm.v1.kv_offload`` reads per-request state unguarded."""
    bound = _bound_managers()
    if WHY is not None:
        assert bound == {}, WHY
        return
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

    reads = "self._req_state[req_context.req_id]" in inspect.getsource(TieringOffloadingManager.prepare_store)
    assert reads
    assert bound == {"vllm.v1.kv_offload.tiering.manager.TieringOffloadingManager": (("_req_state",), 1, "req_context")}


@pytest.mark.skipif(WHY is not None, reason=f"no vLLM tiering here: {WHY}")
def test_a_store_after_finalization_is_refused_under_guard_and_left_to_vllm_under_observe() -> None:
    """One test, one skip reason: the three replays (vLLM alone, guard, observe) share the
    release's tiering."""
    trace = load_trace(str(TRACE))
    plain = harness.run_replay(trace, guard=False)
    observed = harness.run_replay(trace, guard=True, policy="observe")
    guarded = harness.run_replay(trace, guard=True, policy="guard")
    checks = guarded.checks["store_after_finalize"]
    observe_counts = observed.checks["store_after_finalize"]
    assert guarded.ok and guarded.finished == guarded.submitted == 2 and guarded.wrong_kv_blocks == 0
    assert checks["evaluated"] > 0  # vLLM's stores went through the check
    if not _finalizes_before_last_store():
        # the release builds the last stores first: vLLM alone cannot meet the KeyError
        assert plain.ok
    if plain.ok:
        # vLLM alone lived (0.25.1 finalizes early too, but this 0.26.0 trace does not reach
        # a store after finalization there): the check never acts
        assert plain.finished == 2 and checks["violations"] == 0
        assert observed.ok and observe_counts["violations"] == 0
        return
    # observe: counted, then vLLM's own KeyError, as without kvguard
    assert not observed.engine_survived and observed.error.startswith("KeyError")
    assert observe_counts["continued"] >= 1 and observe_counts["store_dropped"] == 0
    assert not plain.engine_survived and plain.error.startswith("KeyError")
    assert plain.error_site.endswith("in prepare_store") and plain.finished < plain.submitted
    assert checks["store_dropped"] >= 1 and checks["continued"] == checks["raised"] == 0
    # every request generated all of its tokens (the oracle checked the KV they read above)
    assert {rid: len(out) for rid, out in guarded.outputs.items()} == {r.id: r.max_tokens for r in trace.requests}
