"""Replay one trace twice in one fresh process, ``--no-guard`` then guard, on the real
scheduler, and print one ``RESULT {json}`` line (used by tests/vllm/test_degrade.py).

Usage: ``python degrade_replay.py TRACE [--plant VICTIM]``

``--plant VICTIM``: the planted-assert technique of tests/vllm/test_sites.py, applied to
the real scheduler: a copy of the installed release's
``...offloading/scheduler.py`` whose ``update_state_after_alloc`` gets one extra assert
(``request.request_id != VICTIM``) right after ``num_cached_tokens`` is computed, i.e.
before the method issues the load, is put first on the ``offloading`` package's path
before anything imports the scheduler module, so the real ``OffloadingConnector`` uses
it and kvguard discovers and rewrites it like vLLM's own (same module name, same site
ids). Nothing else is changed; the file is a copy of the installed one.

Per mode the JSON holds the replay report (``to_json``) plus: ``scheduled`` (request ids
that were ever given tokens to compute), ``left_requests`` (ids still in the
scheduler's ``requests``), ``free_blocks`` / ``num_gpu_blocks`` (block pool at the end),
``req_status_left`` (ids the connector scheduler still tracks) and ``events`` (the
guard's ``check_failed`` / ``store_dropped`` events).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
import tempfile

SCHEDULER_PKG = "vllm.distributed.kv_transfer.kv_connector.v1.offloading"
ANCHOR = "num_cached_tokens = num_locally_computed_tokens + num_external_tokens\n"


def plant(victim: str) -> str:
    import importlib

    pkg = importlib.import_module(SCHEDULER_PKG)
    name = f"{SCHEDULER_PKG}.scheduler"
    assert name not in sys.modules, "the scheduler module was imported before planting"
    src = pathlib.Path(importlib.util.find_spec(name).origin).read_text()
    start = src.index("def update_state_after_alloc(")
    at = src.index(ANCHOR, start) + len(ANCHOR)
    line_start = src.rindex("\n", 0, at - len(ANCHOR)) + 1
    indent = src[line_start : at - len(ANCHOR)]
    planted = f"{indent}assert request.request_id != {victim!r}, 'planted: inconsistent offload state'\n"
    tmp = tempfile.mkdtemp(prefix="kvguard-planted-")
    (pathlib.Path(tmp) / "scheduler.py").write_text(src[:at] + planted + src[at:])
    pkg.__path__.insert(0, tmp)
    return planted.strip()


def replay(trace, guard: bool) -> dict:
    from kvguard.guards import events
    from kvguard.guards.replay.harness import build_engine, run_replay
    from kvguard.guards.replay.report import to_json

    engine = build_engine(trace.geometry)
    scheduled: set[str] = set()
    execute = engine.worker.execute

    def recording_execute(sched_out):
        scheduled.update(sched_out.num_scheduled_tokens)
        return execute(sched_out)

    engine.worker.execute = recording_execute
    with events.capture() as logged:
        result = run_replay(trace, guard=guard, policy="guard", engine=engine)
    report = to_json(result, trace.geometry)
    pool = engine.scheduler.kv_cache_manager.block_pool
    report.update(
        ok=result.ok,
        scheduled=sorted(scheduled),
        left_requests=sorted(engine.scheduler.requests),
        free_blocks=pool.get_num_free_blocks(),
        num_gpu_blocks=trace.geometry.num_gpu_blocks,
        req_status_left=sorted(getattr(engine.connector_scheduler, "_req_status", {})),
        events=[
            {k: e.get(k) for k in ("event", "site", "check", "action", "request_id", "released_keys")}
            for e in logged
            if e.get("event") in ("check_failed", "store_dropped")
        ],
    )
    report.pop("worker", None)
    report["loads"] = [ld.req_id for ld in engine.worker.loads]
    report["stores"] = sorted({st.req_id for st in engine.worker.stores})
    return report


def main() -> None:
    from kvguard.guards.replay.trace import load_trace

    trace = load_trace(sys.argv[1])
    out: dict = {}
    if "--plant" in sys.argv:
        out["planted"] = plant(sys.argv[sys.argv.index("--plant") + 1])
    out["no_guard"] = replay(trace, guard=False)
    out["guard"] = replay(trace, guard=True)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
