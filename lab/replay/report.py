"""Turn a :class:`~kvguard.lab.replay.harness.ReplayResult` into the ``--json`` object or a short text.

The ``--json`` object (one line, one object, nothing else on stdout)::

    {"vllm_version": "0.25.1", "trace": "seed-48959", "guard": true, "policy": "guard",
     "guard_installed": true, "engine_survived": true, "error": null, "error_site": null,
     "harness_error": null, "stalled": false, "stalls": [], "preemptions": {},
     "requests": {"submitted": 4, "finished": 4, "aborted": 0, "failed": 0, "not_arrived": 0},
     "failed_requests": [],
     "wrong_kv_blocks": 0, "wrong_kv": [],
     "checks": {"swa_pending_bound": {"evaluated": 1, "tolerated": 1, "violations": 0,
                                      "max_pending_blocks": 129, "bound": 129}, ...},
     "guard_errors": {}, "sites": {"installed": 54, "not_rewritten": [], "disabled": 0,
                                   "special_missing": []},
     "steps": 68, "scheduling": {"async_scheduling": false, "batch_queue_depth": 1,
                                  "scheduled_ahead": 0, "placeholder_requests": 0},
     "wall_s": 0.61,
     "driven_hits": {"agent-a/turn-2": {"lookup_hit_tokens": 98304,
                                        "local_hit_tokens": 0, "num_cached_tokens": 98012}},
     "worker": {"jobs_completed": 16, "stores": 15, "inconsistent_specs": [],
                "kv_oracle": {"checks": 68, "checked_blocks": 52000, "stored_blocks": 24000,
                              "loaded_blocks": 3192, "rejected_jobs": [],
                              "shared_pages": false},
                "store_specs": [{"request_id": ..., "job_id": ..., "group_sizes": [...],
                                 "block_indices": [...]}, ...],
                "loads": [{"request_id": ..., "job_id": ..., "num_cached_tokens": 98012,
                           "group_sizes": [3063, 129], "block_indices": [0, 2934],
                           "swa_window": {"expected_blocks": 129, "spec_blocks": 129,
                                         "lost": 0, "added": 0}}]},
     "cpu_chunks": 2048, "pending_store_keys": 0,
     "secondary_tiers": null}

``secondary_tiers`` (a trace with ``geometry.secondary_tiers``, else ``null``):
``{"tiers", "cascaded_chunks", "promoted_chunks", "promoted_unknown"}``, offloaded chunks
vLLM's tiering manager handed to the secondary tiers' ``submit_store`` (CPU -> tier) and
``submit_load`` (tier -> CPU), and promoted chunks the KV-content oracle had never seen
cascaded (:mod:`kvguard.lab.replay.tiering`).

``wrong_kv_blocks`` counts distinct (request, KV cache group, block index) that the
KV-content oracle (:mod:`kvguard.lab.replay.kv_oracle`) found holding KV other than the
request's tokens at those positions when vLLM was about to read them; ``wrong_kv`` lists
the first few (``request_id``, ``group``, ``block_index``, ``gpu_block_id``, ``what``:
expected vs found positions, never token ids). ``kv_oracle`` is ``null`` when the worker
ran without the oracle. ``error`` is ``"ExcType: message"`` (a bare ``assert`` reports its source text);
``harness_error`` is ``null``, or ``{"exception", "traceback", "expected"}`` when the lab itself
could not drive the installed vLLM (a vLLM API it expected is not there,
:func:`kvguard.lab.replay.harness.harness_error_of`): then nothing else in the report is a
finding about vLLM or kvguard, and ``kvguard replay`` exits 2;
``checks`` is :func:`kvguard.guards.policy.runtime.snapshot` after the replay (empty without the
guard); ``guard_errors`` counts exceptions inside kvguard code per stage
(:func:`kvguard.guards.policy.runtime.guard_errors`; ``{}`` is the healthy value); ``sites`` is the
instrumentor's report (sites installed from the installed vLLM's own source, asserts
that could not be rewritten, disabled sites, special sites the release should have and
that were not matched). ``guard_installed`` is true only when the guard really rewrote
the offload scheduler module. ``swa_window`` compares the sliding-window GPU block ids the worker received in
the load spec with the blocks of the window in the real KV cache manager: the window
is GPU blocks ``[(num_cached_tokens - sliding_window + 1) // tokens_per_block,
cdiv(num_cached_tokens, tokens_per_block))`` (vLLM's skipped-token rule); ``lost`` are
window blocks missing from the spec, ``added`` spec blocks outside the window.
"""

from __future__ import annotations

from typing import Any

from kvguard.lab.replay.harness import ReplayResult
from kvguard.lab.replay.trace import Geometry

SWA_GROUP = 1  # the sliding-window KV cache group (group 0 is full attention)


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


def swa_window(load: Any, num_cached_tokens: int, geometry: Geometry) -> dict[str, int] | None:
    """Compare a load's sliding-window block ids with the window in the KV cache manager."""
    if load.manager_block_ids is None or len(load.group_sizes) <= SWA_GROUP:
        return None
    tpb = geometry.tokens_per_block
    first = max(0, num_cached_tokens - geometry.sliding_window + 1) // tpb
    end = _cdiv(num_cached_tokens, tpb)
    window = [b for b in load.manager_block_ids[SWA_GROUP][first:end] if b != 0]
    spec = load.group_block_ids(SWA_GROUP)
    return {
        "expected_blocks": end - first,
        "spec_blocks": len(spec),
        "lost": len(set(window) - set(spec)),
        "added": len(set(spec) - set(window)),
    }


def _worker_timing(worker: Any) -> dict[str, Any]:
    """The worker model and what its job queue did (see :mod:`.jobs`)."""
    queue = worker.queue
    done = queue.completed
    # a pair (earlier submitted, later reported) = a later job finished first
    out_of_order = sum(
        1 for a, b in zip(done, done[1:]) if (a.submit_step, a.job_id) > (b.submit_step, b.job_id)
    )
    return {
        "model": worker.model.to_json(),
        "jobs_submitted": queue.submitted,
        "out_of_order_completions": out_of_order,
        "failed_jobs": [
            {"job_id": j.job_id, "request_id": j.req_id, "store": j.is_store, "step": j.done_step}
            for j in done
            if not j.success
        ],
        "jobs_in_flight": [
            {"job_id": j.job_id, "request_id": j.req_id, "store": j.is_store,
             "submit_step": j.submit_step, "hung": j.due_step is None}
            for j in queue.in_flight()
        ],
    }


def scheduling(result: ReplayResult) -> dict[str, Any]:
    """The report's ``scheduling`` object: how the replay stepped vLLM's scheduler.

    ``async_scheduling`` (the trace's ``geometry.async_scheduling``), ``batch_queue_depth``
    (steps in flight: 1 synchronous, 2 async), ``scheduled_ahead`` (``schedule()`` calls
    made while an earlier step's output was not yet given to ``update_from_output``) and
    ``placeholder_requests`` (requests scheduled while they had output placeholders):
    both counters are 0 on the synchronous path, so a positive value proves the lag.
    """
    lag = result.lag
    return {
        "async_scheduling": result.async_scheduling,
        "batch_queue_depth": lag.depth if lag is not None else 1,
        "scheduled_ahead": lag.scheduled_ahead if lag is not None else 0,
        "placeholder_requests": lag.placeholder_requests if lag is not None else 0,
    }


def to_json(result: ReplayResult, geometry: Geometry) -> dict[str, Any]:
    """The ``--json`` object for ``result`` (field list in the module docstring)."""
    worker = result.worker
    loads = []
    for load in worker.loads if worker is not None else ():
        hit = result.hits.get(load.req_id)
        cached = hit["local_hit_tokens"] + hit["external_hit_tokens"] if hit else None
        loads.append(
            {
                "request_id": load.req_id,
                "job_id": load.job_id,
                "num_cached_tokens": cached,
                "group_sizes": load.group_sizes,
                "block_indices": load.block_indices,
                "swa_window": swa_window(load, cached, geometry) if cached else None,
            }
        )
    oracle = worker.oracle if worker is not None else None
    out = {
        "vllm_version": result.vllm_version,
        "trace": result.trace,
        "guard": result.guard,
        "policy": result.policy,
        "guard_installed": result.guard_installed,
        "engine_survived": result.engine_survived,
        "error": result.error,
        "error_site": result.error_site,
        "harness_error": result.harness_error,
        "stalled": result.stalled,
        "stalls": result.stalls,
        "preemptions": result.preemptions,
        "requests": {
            "submitted": result.submitted,
            "finished": result.finished,
            "aborted": result.aborted,
            "failed": len(result.failed_requests),
            "not_arrived": result.not_arrived,
        },
        "failed_requests": result.failed_requests,
        "wrong_kv_blocks": result.wrong_kv_blocks,
        "wrong_kv": [w for o in result.oracles() for w in o.wrong_kv],
        "checks": result.checks,
        "guard_errors": result.guard_errors,
        "sites": {k: v for k, v in result.sites.items() if k != "modules"},
        "steps": result.steps,
        "scheduling": scheduling(result),
        "wall_s": round(result.wall_s, 3),
        "driven_hits": result.driven_hits,
        "driven_evictions": result.driven_evictions,
        "worker": {
            "jobs_completed": worker.jobs_completed if worker else 0,
            **(_worker_timing(worker) if worker else {}),
            "stores": len(worker.stores) if worker else 0,
            "inconsistent_specs": worker.inconsistent_specs if worker else [],
            "kv_oracle": oracle.summary() if oracle is not None else None,
            "loads": loads,
            "store_specs": [
                {
                    "request_id": st.req_id,
                    "job_id": st.job_id,
                    "group_sizes": st.group_sizes,
                    "block_indices": st.block_indices,
                }
                for st in (worker.stores if worker is not None else ())
            ],
        },
        "cpu_chunks": result.cpu_chunks,
        "pending_store_keys": result.pending_store_keys,
        "secondary_tiers": result.secondary_tiers,
    }
    if result.restarts:  # a trace with restart lines: the figures above sum every engine's
        out["restarts"] = result.restarts
    if result.engines > 1:  # engines sharing an fs tier: requests, wrong KV and secondary_tiers
        out["engines"] = result.engines  # sum every engine's; worker and cpu_chunks are engine 0's
    return out


def to_text(report: dict[str, Any]) -> str:
    """A short human report of a ``to_json`` object."""
    guard = f"guard on (policy {report['policy']})" if report["guard"] else "guard off"
    lines = [f"kvguard replay: trace {report['trace']} on vLLM {report['vllm_version']}, {guard}"]
    req = report["requests"]
    lab = report.get("harness_error")
    if lab:
        lines.append(f"  HARNESS ERROR after {report['steps']} steps (the lab, not vLLM or the guard): "
                     f"{lab['exception']}")
        lines.append(f"            expected: {lab['expected']}")
        lines.append("            (kvguard's lab cannot drive this vLLM release: lab/replay/vllm_api.py)")
    elif report["engine_survived"]:
        state = "stalled (a request waits forever)" if report["stalled"] else "survived"
        aborted = f", {req['aborted']} aborted" if req.get("aborted") else ""
        if req.get("failed"):
            aborted += f", {req['failed']} failed alone (request_failed)"
        lines.append(
            f"  engine:   {state}; {req['finished']}/{req['submitted']} requests finished{aborted}"
        )
        for st in report.get("stalls", ()):
            lines.append(
                f"  stall:    {st['request_id']}: {st['kind']} ({st['status']}, "
                f"{st['waiting_steps']} steps without progress)"
            )
    else:
        lines.append(f"  engine:   DIED after {report['steps']} steps: {report['error']}")
        if report["error_site"]:
            lines.append(f"            at {report['error_site']}")
        lines.append(f"            {req['finished']}/{req['submitted']} requests had finished")
    for failed in report.get("failed_requests", ()):
        lines.append(f"  failed:   {failed['request_id']}: {failed['error']}")
    for rid, hit in report["driven_hits"].items():
        lines.append(
            f"  step:     {rid}: external hit driven to num_cached_tokens="
            f"{hit['num_cached_tokens']} (lookup found {hit['lookup_hit_tokens']})"
        )
    for load in report["worker"]["loads"]:
        win = load["swa_window"]
        extra = ""
        if win:
            extra = (
                f"; window {win['expected_blocks']} blocks, lost {win['lost']}, added {win['added']}"
            )
        lines.append(
            f"  load:     {load['request_id']}: num_cached_tokens={load['num_cached_tokens']}, "
            f"GPU blocks per group {load['group_sizes']}{extra}"
        )
    kv = report["worker"].get("kv_oracle")
    if kv is not None:
        lines.append(
            f"  kv:       {report['wrong_kv_blocks']} GPU blocks with wrong KV "
            f"({kv['checked_blocks']} block checks over {kv['checks']} steps)"
        )
        for off in report["wrong_kv"]:
            lines.append(
                f"            {off['request_id']} group {off['group']} block {off['block_index']}"
                f" (GPU block {off['gpu_block_id']}): {off['what']}"
            )
    tiers = report.get("secondary_tiers")
    if tiers:
        lines.append(
            f"  tiering:  {tiers['tiers']} secondary tier(s): {tiers['cascaded_chunks']} chunks "
            f"cascaded, {tiers['promoted_chunks']} promoted to the CPU tier "
            f"({tiers['promoted_unknown']} never cascaded)"
        )
    bad = report["worker"]["inconsistent_specs"]
    lines.append(f"  worker:   {report['worker']['jobs_completed']} transfer jobs done, "
                 f"{len(bad)} inconsistent specs received")
    for name, c in sorted(report["checks"].items()):
        if not (c["evaluated"] or c["tolerated"] or c["violations"]):
            continue
        bound = ""
        if c.get("max_pending_blocks") is not None:
            bound = f", max pending {c['max_pending_blocks']} / bound {c['bound']} GPU blocks"
        # evaluated is None for checks counted only when they fail (names.EVALUATED_CHECKS)
        evaluated = "" if c["evaluated"] is None else f"{c['evaluated']} evaluated, "
        lines.append(
            f"  check:    {name}: {evaluated}{c['tolerated']} tolerated, "
            f"{c['violations']} violations{bound}"
        )
    sched = report.get("scheduling") or {}
    if sched.get("async_scheduling"):
        lines.append(
            f"  schedule: async (AsyncScheduler, batch queue {sched['batch_queue_depth']}): "
            f"{sched['scheduled_ahead']} steps scheduled ahead of an output, "
            f"{sched['placeholder_requests']} requests scheduled with output placeholders"
        )
    lines.append(f"  time:     {report['wall_s']} s replay, {report['steps']} scheduler steps")
    return "\n".join(lines)
