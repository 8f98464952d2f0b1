"""Every block a load makes computed is written by it (check ``load_writes``).

End-to-end invariant: when a connector's load completes, vLLM treats every GPU block of the
request's external range as computed and caches it under the request's block hash
(``Scheduler._update_waiting_for_remote_kv`` -> ``cache_blocks``), so a later request's
GPU prefix-cache hit reads it. Every such block must therefore be written by the load: in
each KV cache group ``g`` (``b_g`` tokens per block), the non-null GPU blocks at indices
``[local // b_g, cdiv(local + external, b_g))`` of the request's table (``local``: the
local hit the lookup was given, ``external``: the tokens the scheduler accepted) must all be
destinations of the connector's load. A block left out keeps whatever its last owner wrote,
is cached as this request's KV, and is served to the next prefix hit as wrong KV.

Where vLLM breaks it (the lab's SimpleCPUOffloadConnector fuzz, seed 4242, on 0.29.0 and
0.34.0): a sliding-window group with ``extra_retained_tokens``. The GPU KV cache manager keeps
(allocates) the retained blocks below the window; the connector's CPU hit supplies the
sliding-window group's blocks only from the window on (null below), and its
``update_state_after_alloc`` skips null CPU blocks ("Skip null blocks (e.g. sliding window
or mamba padding)"), so the retained GPU blocks get no copy and are cached with stale KV.

Read from vLLM's own data, per release: ``local`` is the ``num_computed_tokens`` the
scheduler passed to the connector's lookup for that request (recorded by
:func:`lookup_wrapper`); the load's destinations are the connector's
``_reqs_to_load[request_id].transfer_meta.gpu_block_ids`` (the SimpleCPUOffloadConnector,
0.21.0-0.34.0: the same field on every release). A scheduler side without them (the
OffloadingConnector, whose loads the ``load_coverage`` and ``copy_coverage`` checks read)
is not checked here.

Action by policy (inside ``Scheduler.schedule()``, before the step's
``build_connector_meta`` issues the load):

- ``observe``: counted (``continued``); the load runs as vLLM built it.
- ``strict``: counted (``raised``), :class:`~kvguard.guards.checks.admission.counters.StrictFailure`.
- ``guard``, at the lookup (before anything is allocated): where the pinned hit's CPU blocks
  can be read (0.25.1 and later), a hit whose load would leave blocks unwritten
  (:func:`predicted_unwritten`) is answered ``(0, False)``: vLLM recomputes those tokens
  (``hit_reduced``), the request is served. Where a load still leaves a block unwritten at
  ``update_state_after_alloc`` (a prediction missed, or 0.21.0):
- ``guard``, after allocation: the load is withdrawn through vLLM's own release of a load
  (``_cleanup_load_request``: its CPU and GPU pins freed) and the request fails alone
  (:func:`kvguard.guards.policy.degrade.fail_unloaded`, ``request_failed``): its blocks are
  freed without being cached. Where that release method or a ``Scheduler`` is missing:
  ``raised`` (a dead engine is better than one that serves wrong KV).
"""

from __future__ import annotations

import sys
from typing import Any

from kvguard.guards import names
from kvguard.guards.checks import wait_bound
from kvguard.guards.checks.admission import counters, exclusive
from kvguard.guards.policy import degrade, recompute, runtime

__all__ = ["unwritten_blocks", "lookup_wrapper", "written_wrapper", "snapshot"]

PREFIX = "load_writes:"
#: per connector scheduler: request id -> the local hit (tokens) its last lookup with a hit was given
LOCAL_ATTR = "_kvguard_lookup_local_tokens"


def unwritten_blocks(block_ids_by_group: Any, block_sizes: list[int], local: int, external: int,
                     destinations: set[int]) -> list[tuple[int, int, int]]:
    """``(group, block index, GPU block id)`` of every non-null block of the external range
    ``[local // b_g, cdiv(local + external, b_g))`` that is not a load destination.
    ``block_sizes``: tokens per GPU block of each group; tokens in, indices out."""
    out = []
    end_tokens = local + external
    for g, ids in enumerate(block_ids_by_group):
        b = block_sizes[g]
        for i in range(local // b, min(len(ids), -(-end_tokens // b))):
            if ids[i] and ids[i] not in destinations:
                out.append((g, i, int(ids[i])))
    return out


def snapshot() -> dict[str, int]:
    """In-process counts since :func:`counters.reset`: ``evaluated`` (loads checked),
    ``hit_reduced`` (hits answered 0 at the lookup), ``request_failed``, ``continued``,
    ``raised``, ``recomputed_tokens`` and ``violations`` (the sum of the actions)."""
    keys = ("evaluated", "hit_reduced", "request_failed", "continued", "raised", "recomputed_tokens")
    out = {k: counters.stats.get(PREFIX + k, 0) for k in keys}
    out["violations"] = out["hit_reduced"] + out["request_failed"] + out["continued"] + out["raised"]
    return out


def modelled(cs: Any) -> bool:
    """Whether the check reads this connector scheduler's layout as vLLM does: no context
    parallelism (``cp_world_size`` 1), and with speculative decoding every KV cache group
    treated alike. vLLM's KV cache coordinator drops the EAGLE last block of a hit in the
    groups marked ``KVCacheGroupSpec.is_eagle_group`` and, where none is marked, in every group
    ("Conservatively fall back to flag all groups when no group is flagged",
    ``v1/core/kv_cache_coordinator.py``, 0.34.0); with no group marked, or all, each group's
    external range is the same rule as without drafts (the drafts of a running request are
    scheduled after its admission and never reach a load), so the check runs. Groups marked
    apart (a drafter's own group beside the target's), or DCP-sharded groups, keep blocks
    outside a load on purpose in vLLM's own tests
    (``test_eager_store_matches_gpu_cacheable_prefix``, 0.34.0), with block sizes and dropped
    blocks this check does not model: there it does not run (nothing counted), and vLLM's
    behaviour is unchanged.

    Before 7 Dec 2026 the check never ran with speculative decoding; the lab's fuzz (seed 12,
    0.34.0, SimpleCPUOffloadConnector, MTP drafts, ``extra_retained_tokens`` 2) then served
    the class of this module's docstring guarded (``tests/vllm/traces/simple-retained-unwritten-spec-034.jsonl``)."""
    if int(getattr(cs, "cp_world_size", 1) or 1) != 1:
        return False
    config = getattr(cs, "vllm_config", None)
    if getattr(config, "speculative_config", None) is None:
        return True
    groups = getattr(getattr(cs, "kv_cache_config", None), "kv_cache_groups", None) or ()
    marked = {bool(getattr(g, "is_eagle_group", False)) for g in groups}
    return len(marked) <= 1


def _cached_groups(cs: Any, num_groups: int) -> list[int]:
    """The KV cache groups vLLM caches a loaded request's blocks in: the connector's
    ``prefix_cacheable_group_ids`` where it has them (0.34.0: a scratch or ring group is
    neither stored, loaded nor cached), else every group."""
    ids = getattr(cs, "prefix_cacheable_group_ids", None)
    return [g for g in range(num_groups) if ids is None or g in ids]


def predicted_unwritten(cs: Any, request_id: str, local: int, hit: int) -> list[tuple[int, int]] | None:
    """``(group, block index)`` the load of the ``hit`` tokens the lookup just pinned after
    ``local`` tokens would leave unwritten, read before allocation from vLLM's own state: the
    pinned hit's CPU blocks per group (``_pending_cpu_hits[request_id][0]``; 0.25.1 and
    later) against the blocks the GPU KV cache manager will keep non-null in the external
    range, ``[max(local // b_g, skipped_g), cdiv(local + hit, b_g))`` with ``skipped_g`` the
    group's own ``get_num_skipped_tokens(local + hit) // b_g`` (the connector's CPU
    coordinator has the same KV cache groups as the GPU's). None when not readable."""
    pending = (getattr(cs, "_pending_cpu_hits", None) or {}).get(request_id)
    coordinator = getattr(cs, "cpu_coordinator", None)
    if pending is None or coordinator is None or not modelled(cs):
        return None
    cpu_blocks = pending[0]
    total = int(local) + int(hit)
    out = []
    managers = coordinator.single_type_managers
    for g in _cached_groups(cs, len(managers)):
        manager = managers[g]
        b = int(manager.block_size)
        first = max(int(local) // b, int(manager.get_num_skipped_tokens(total)) // b)
        cpu = cpu_blocks[g] if g < len(cpu_blocks) else ()
        for i in range(first, -(-total // b)):
            j = i - int(local) // b
            if j >= len(cpu) or cpu[j].is_null:
                out.append((g, i))
    return out


def lookup_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``wrapt`` wrapper of the lookup of a connector scheduler kvguard's admission check does
    not run in (the SimpleCPUOffloadConnector's). For an answer with a hit: the local hit it
    was given is recorded (for :func:`written_wrapper`); under ``guard``, a hit whose load
    would leave blocks unwritten (:func:`predicted_unwritten`) is answered ``(0, False)``
    instead: vLLM recomputes it (``hit_reduced``, ``kvguard_recomputed_tokens_total``), and
    its own ``update_state_after_alloc`` releases the pinned hit. The wait bound sees the
    answer (:func:`kvguard.guards.checks.wait_bound.observe_answer`). An error of kvguard's is
    counted (``stage="admission"``) and vLLM's answer passes."""
    answer = wrapped(*args, **kwargs)
    try:
        request = args[0] if args else kwargs["request"]
        if answer is not None and answer[0]:
            local = args[1] if len(args) > 1 else kwargs["num_computed_tokens"]
            table = instance.__dict__.get(LOCAL_ATTR)
            if table is None:
                table = instance.__dict__[LOCAL_ATTR] = {}
            table[request.request_id] = int(local)
            if instance.__dict__.get(recompute.RECOMPUTE_ATTR):  # kvguard recomputed it: no load
                reduced = recompute.without_load(instance, request, answer)
                if reduced is not answer:
                    table.pop(request.request_id, None)
                    wait_bound.observe_answer(instance, request, reduced)
                    return reduced
            if not runtime.suppress_depth and runtime.policy() == names.POLICY_GUARD:
                unwritten = predicted_unwritten(instance, request.request_id, int(local), int(answer[0]))
                if unwritten:
                    _record(names.ACTION_HIT_REDUCED, request, [(g, i, -1) for g, i in unwritten],
                            int(answer[0]), names.POLICY_GUARD, recomputed=int(answer[0]))
                    table.pop(request.request_id, None)
                    answer = (0, False)
        wait_bound.observe_answer(instance, request, answer)
    except Exception as error:
        runtime.guard_error(names.STAGE_ADMISSION, error)
    return answer


def _record(action: str, request: Any, unwritten: list[tuple[int, int, int]], external: int, policy: str,
            recomputed: int = 0) -> None:
    counters.record_check_failed(
        names.CHECK_LOAD_WRITES, names.LOAD_WRITES_SITE_ID, PREFIX, action, policy,
        {names.KEY_REQUEST_ID: getattr(request, "request_id", None),
         names.KEY_UNWRITTEN_BLOCKS: [list(u) for u in unwritten[:8]], names.KEY_EXTERNAL_HIT_TOKENS: external},
        recomputed=recomputed)


def _check(instance: Any, request: Any, blocks: Any, external: int) -> list[tuple[int, int, int]] | None:
    """The unwritten blocks of the load vLLM just recorded, or None when nothing is checked
    (no load, or this scheduler side does not record its loads so)."""
    rid = request.request_id
    local = (instance.__dict__.get(LOCAL_ATTR) or {}).pop(rid, None)
    state = (getattr(instance, "_reqs_to_load", None) or {}).get(rid)
    meta = getattr(state, "transfer_meta", None)
    if external <= 0 or local is None or meta is None or not modelled(instance):
        return None
    sizes = [int(g.kv_cache_spec.block_size) for g in instance.kv_cache_config.kv_cache_groups]
    counters.bump(PREFIX + "evaluated")
    by_group = blocks.get_block_ids()
    cached = set(_cached_groups(instance, len(by_group)))
    found = unwritten_blocks(by_group, sizes, local, external, set(meta.gpu_block_ids))
    return [u for u in found if u[0] in cached]


def written_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``wrapt`` wrapper of such a connector scheduler's ``update_state_after_alloc``: vLLM's
    method, then the check of the load it recorded (module doc). Raises
    :class:`~kvguard.guards.checks.admission.counters.StrictFailure` under ``strict`` and
    ``AssertionError`` under ``guard`` where the request cannot fail alone."""
    result = wrapped(*args, **kwargs)
    if runtime.suppress_depth:
        return result
    try:
        request, blocks, external = exclusive.bind_call(wrapped, args, kwargs)
        unwritten = _check(instance, request, blocks, external)
    except Exception as error:
        runtime.guard_error(names.STAGE_ADMISSION, error)
        return result
    if not unwritten:
        return result
    policy = runtime.policy()
    rid = request.request_id
    what = (f"kvguard {names.CHECK_LOAD_WRITES}: the load of request {rid} leaves {len(unwritten)} GPU block(s) "
            f"of its external range unwritten (group, index, block id: {unwritten[:4]}); vLLM would cache "
            "them as this request's KV (wrong KV for the next prefix hit)")
    if policy == names.POLICY_OBSERVE:
        _record(names.ACTION_CONTINUED, request, unwritten, external, policy)
        return result
    if policy == names.POLICY_STRICT:
        _record(names.ACTION_RAISED, request, unwritten, external, policy)
        raise counters.StrictFailure(what)
    release = getattr(instance, "_cleanup_load_request", None)
    scheduler = degrade.find_scheduler(sys._getframe(1), rid)
    if release is None or scheduler is None:
        _record(names.ACTION_RAISED, request, unwritten, external, policy)
        raise AssertionError(what)
    release(rid)  # vLLM's own release of a load not yet issued: its pins freed
    if not degrade.fail_unloaded(scheduler, instance, rid, what + "; request failed alone"):
        _record(names.ACTION_RAISED, request, unwritten, external, policy)
        raise AssertionError(what)
    _record(names.ACTION_REQUEST_FAILED, request, unwritten, external, policy)
    return result
