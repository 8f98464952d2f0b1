"""The stall the fuzzer named ``remote_kvs_never_reported``, traced (docs/fuzz.md, "The
remote-KVs stall is vLLM's waiting scan").

``stall-remote-kvs-hol-021.jsonl``: two requests, ``a`` and ``b``, get CPU hits admitted as
async loads in the same step (each allocates only its hit's blocks and parks in
``WAITING_FOR_REMOTE_KVS``, ``a`` first). Both loads complete and the worker reports both in
``finished_recving``. On every later step vLLM's waiting scan promotes ``a``, whose remaining
prefill does not fit the free blocks, and ``break``s: ``b`` behind it is never reached, and
nothing runs, so nothing frees a block (vLLM 0.21.0 ``v1/core/sched/scheduler.py``
:539-549, :714-721, :2050-2051; public: vllm#45388). From 0.25.1 on vLLM reserves a
waiting load's remaining blocks at admission and this trace finishes.

What the lab must say (the test that would catch a harness that drops a finished load): the
load of ``b`` *was* reported (its id is in the scheduler's ``finished_recving_kv_req_ids``),
so the stall kind is ``remote_kvs_never_promoted``, not ``remote_kvs_never_reported``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from release_facts import fact

from kvguard.lab.replay import harness
from kvguard.lab.replay.trace import load_trace

pytestmark = pytest.mark.vllm

TRACE = Path(__file__).parent / "traces" / "stall-remote-kvs-hol-021.jsonl"


def test_the_waiting_scan_stall_is_named_for_what_happened() -> None:
    harness.uninstall_guard()
    result = harness.run_replay(load_trace(str(TRACE)), guard=False)
    assert result.engine_survived and result.wrong_kv_blocks == 0
    if not fact("remote_kvs_hol_stalls"):
        assert not result.stalled and result.finished == result.submitted == 5
        return
    assert result.stalled and result.finished == 3
    kinds = {s["request_id"]: s["kind"] for s in result.stalls}
    assert kinds == {"a": "waiting_for_blocks", "b": "remote_kvs_never_promoted"}
    (b,) = [s for s in result.stalls if s["request_id"] == "b"]
    assert b["connector"]["load_reported"] is True and b["connector"]["pending_loads"] == []
