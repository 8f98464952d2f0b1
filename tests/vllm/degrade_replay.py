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
guard's ``check_failed`` / ``store_dropped`` events), ``outputs`` (per finished request,
the token ids it generated) and ``allocs`` (per request whose external hit vLLM passed to
the connector's ``update_state_after_alloc``, its first such admission: ``external_tokens``, the GPU ``block_ids``
of each KV cache group and ``doubly_held``, the non-null block ids that appear in more
than one group of that one request: one physical block handed out twice, the #43884
mechanism) and ``violations`` (the non-zero series of
``kvguard_invariant_violations_total`` in this process's Prometheus registry after that
replay, ``[check, action, value]``: what an operator's scrape would show; the process
starts with ``KVGUARD_STATE_DIR`` unset so the counters live in that registry).
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
    from kvguard.guards.telemetry import events
    from kvguard.lab.replay.harness import build_engine, install_guard, run_replay
    from kvguard.lab.replay.report import to_json

    if guard:
        # as in EngineCore (and harness.run_replay without an engine): the plugin is
        # installed before the connector is built, so kvguard's admission check is bound
        # to this engine's connector scheduler (run_replay's own install is then a no-op)
        install_guard("guard")
    engine = build_engine(trace.geometry)
    scheduled: set[str] = set()
    execute = engine.worker.execute

    def recording_execute(sched_out):
        scheduled.update(sched_out.num_scheduled_tokens)
        return execute(sched_out)

    engine.worker.execute = recording_execute
    allocs: dict[str, dict] = {}
    update_state_after_alloc = engine.connector.update_state_after_alloc

    def recording_update_state_after_alloc(request, blocks, num_external_tokens):
        if num_external_tokens and request.request_id not in allocs:  # its first admission with a load
            per_group = [[b.block_id for b in group if not b.is_null] for group in blocks.blocks]
            seen = [set(ids) for ids in per_group]
            allocs[request.request_id] = {
                "external_tokens": num_external_tokens,
                "block_ids": per_group,
                "doubly_held": sorted(
                    {i for g, ids in enumerate(seen) for i in ids if any(i in o for o in seen[g + 1 :])}
                ),
            }
        return update_state_after_alloc(request, blocks, num_external_tokens)

    engine.connector.update_state_after_alloc = recording_update_state_after_alloc
    with events.capture() as logged:
        result = run_replay(trace, guard=guard, policy="guard", engine=engine)
    report = to_json(result, trace.geometry)
    pool = engine.scheduler.kv_cache_manager.block_pool
    report.update(
        ok=result.ok,
        outputs=result.outputs,
        allocs=allocs,
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
    report["violations"] = _violations()
    report.pop("worker", None)
    report["loads"] = [ld.req_id for ld in engine.worker.loads]
    report["stores"] = sorted({st.req_id for st in engine.worker.stores})
    return report


def _violations() -> list[list]:
    from prometheus_client import REGISTRY

    from kvguard.guards import names

    return sorted(
        [s.labels[names.LABEL_CHECK], s.labels[names.LABEL_ACTION], s.value]
        for metric in REGISTRY.collect()
        for s in metric.samples
        if s.name == names.METRIC_INVARIANT_VIOLATIONS and s.value
    )


def main() -> None:
    import os

    from kvguard.lab.replay.trace import load_trace

    os.environ.pop("KVGUARD_STATE_DIR", None)

    trace = load_trace(sys.argv[1])
    out: dict = {}
    if "--plant" in sys.argv:
        out["planted"] = plant(sys.argv[sys.argv.index("--plant") + 1])
    out["no_guard"] = replay(trace, guard=False)
    out["guard"] = replay(trace, guard=True)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
