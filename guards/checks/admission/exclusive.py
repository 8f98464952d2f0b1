"""Exclusive GPU blocks at admission (check ``block_exclusive``): one page, one reader.

End-to-end invariant: a GPU block a request reads holds that request's KV for one logical
block of one KV cache group, so no GPU block id may appear twice among the blocks the
scheduler hands the connector for one request (``update_state_after_alloc(request,
blocks, num_external_tokens)``: ``blocks.get_block_ids()``, one list per KV cache group;
the null block, id 0, is the shared placeholder of skipped positions and is exempt). A
block listed twice is one page written as two: whichever write comes last (the connector's
load, or the forward) overwrites KV that the other position's attention then reads.

Where vLLM breaks it (measured with the lab's SimpleCPUOffloadConnector fuzz on 0.21.0,
seed 4242): the KV cache coordinator's ``allocate_new_computed_blocks`` ran group by group,
so group 0's ``get_new_blocks`` for the external (connector-hit) tokens could pop from the
free queue a prefix-cache hit block that group 1 had not touched yet; group 1 then touched
it as its own hit. The load for group 0 overwrote group 1's cached block: wrong KV, no
crash. vLLM issue #33775; 0.25.1 and later allocate in two phases ("first touch every
group's local cache-hit blocks", ``kv_cache_coordinator.py``), and the check never fires
there. It depends on no connector's internals, so it guards both of vLLM's CPU offload
connectors' scheduler sides (found by structure: :func:`scheduler_sides`).

Scope: an allocation with a load (``num_external_tokens > 0``). The connector's load is
what writes a page the offload path owns; without one the connector writes none of the
request's blocks (its ``update_state_after_alloc`` only tracks their ids), and a repeat
would be vLLM's core allocator serving wrong KV to its own forward, outside an offload
guard (the #33775 path is the allocation of the external tokens' blocks between the
groups' touches: there is none without external tokens).

Cost: one pass in C over the request's block ids per admitted load (not per step; about
20 us warm for a 12,000-token prompt in two groups, 4 Dec 2026: vLLM's own
``get_block_ids`` is 8 of them, the set 8; 0.33.0's own method walks the same blocks in Python).

Action by policy (``update_state_after_alloc`` runs inside ``Scheduler.schedule()`` right
after ``allocate_slots``):

- ``observe``: counted (``continued``), vLLM's call unchanged: the wrong KV is served.
- ``strict``: counted (``raised``), :class:`~kvguard.guards.checks.admission.counters.StrictFailure`.
- ``guard`` (vLLM 0.21.0 produces it with external tokens): the connector is
  told the request loads nothing (vLLM's own method with ``num_external_tokens=0``: it
  takes no load and releases what its lookup pinned), then the request is **recomputed**
  (``recomputed``, :func:`kvguard.guards.policy.recompute.recompute_unloaded`): at the end
  of the ``schedule()`` that admitted it, vLLM's own failed-receive path frees the blocks
  it was given and makes it ``WAITING`` again, to be looked up and allocated afresh. The
  retry loads nothing (:func:`kvguard.guards.policy.recompute.without_load`: a retry
  answered as before parked again and, behind a head waiting for its blocks, never ran),
  so it is outside this check's scope, and it cannot meet the same shared block anyway:
  popping a cached block from the free queue evicts its hash (``BlockPool.get_new_blocks``). Failing the request instead (the action until 5 Dec
  2026) was worse than vLLM alone wherever nothing read the page written twice before the
  request ended (differential fuzz, 0.21.0: a request the client aborted two steps later,
  failed by kvguard). Where the release has no failed-receive path, the request fails
  alone through :func:`kvguard.guards.policy.degrade.fail_unloaded` (``request_failed``:
  finished with ``FINISHED_ERROR`` at the next ``update_from_output``, its blocks freed,
  its client told). Without a ``Scheduler`` to bind, or where vLLM schedules the request
  for compute in the same step (a synchronous load): ``raised``, the engine dies, as a dead
  engine is better than one that serves wrong KV.
"""

from __future__ import annotations

import inspect
import sys
from itertools import chain
from typing import Any

from kvguard.guards import names
from kvguard.guards.checks.admission import counters
from kvguard.guards.policy import degrade, recompute, runtime

__all__ = ["shared_blocks", "exclusive_wrapper", "scheduler_sides", "snapshot", "bind_call"]

#: key prefix of this check's counts in :data:`counters.stats`
PREFIX = "block_exclusive:"


def shared_blocks(block_ids_by_group: Any) -> list[int]:
    """GPU block ids (``int``) listed more than once across the groups' lists, null block
    (0) exempt; sorted. ``block_ids_by_group``: one sequence of block ids per KV cache group.

    The common answer (none) is found in C: the distinct ids number the listed ones, less
    the null block's repeats (a ``set`` over the chained lists, ``list.count(0)``); only a
    request with a repeat takes the Python loop that names them (issue 31: the cost of an
    admission must not be a Python loop over every block of a long prompt)."""
    groups = [ids if isinstance(ids, (list, tuple)) else list(ids) for ids in block_ids_by_group]
    listed = 0
    nulls = 0
    for ids in groups:
        listed += len(ids)
        nulls += ids.count(0)
    if len(set(chain.from_iterable(groups))) == listed - max(nulls - 1, 0):
        return []
    seen: set[int] = set()
    twice: set[int] = set()
    for ids in groups:
        for block_id in ids:
            if block_id and block_id in seen:
                twice.add(int(block_id))
            seen.add(block_id)
    return sorted(twice)


def snapshot() -> dict[str, int]:
    """In-process counts since :func:`counters.reset`: ``evaluated`` (admissions checked),
    ``recomputed``, ``request_failed``, ``continued``, ``raised`` and ``violations`` (their sum)."""
    out = {k: counters.stats.get(PREFIX + k, 0)
           for k in ("evaluated", "recomputed", "request_failed", "continued", "raised")}
    out["violations"] = out["recomputed"] + out["request_failed"] + out["continued"] + out["raised"]
    return out


def bind_call(wrapped: Any, args: tuple, kwargs: dict) -> tuple[Any, Any, int]:
    """``(request, blocks, num_external_tokens)`` of a call, bound by vLLM's signature
    (the ``Scheduler`` passes the three positionally: no binding then)."""
    if len(args) == 3 and not kwargs:
        return args[0], args[1], int(args[2])
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    values = list(bound.arguments.values())
    return values[0], values[1], int(values[2])


def _record(action: str, request: Any, shared: list[int], num_external_tokens: int, policy: str) -> None:
    """Count one violation and emit ``check_failed`` with the shared block ids (at most 8)
    and the request's external tokens."""
    counters.record_check_failed(
        names.CHECK_BLOCK_EXCLUSIVE, names.BLOCK_EXCLUSIVE_SITE_ID, PREFIX, action, policy,
        {names.KEY_REQUEST_ID: getattr(request, "request_id", None), names.KEY_SHARED_BLOCKS: shared[:8],
         names.KEY_EXTERNAL_HIT_TOKENS: num_external_tokens})


def exclusive_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``wrapt`` wrapper of a connector scheduler's ``update_state_after_alloc`` (module doc).

    Raises :class:`~kvguard.guards.checks.admission.counters.StrictFailure` under ``strict``
    and ``AssertionError`` under ``guard`` where no request can be failed alone; an error
    of kvguard's own is counted (``stage="admission"``) and vLLM's call runs unchanged.
    """
    if runtime.suppress_depth:  # inside runtime.suppressed(): vLLM's behaviour, uncounted
        return wrapped(*args, **kwargs)
    try:
        request, blocks, num_external_tokens = bind_call(wrapped, args, kwargs)
        if num_external_tokens <= 0:
            return wrapped(*args, **kwargs)  # no load: the connector writes none of these blocks
        shared = shared_blocks(blocks.get_block_ids())
        counters.bump(PREFIX + "evaluated")
    except Exception as error:
        runtime.guard_error(names.STAGE_ADMISSION, error)
        return wrapped(*args, **kwargs)
    if not shared:
        return wrapped(*args, **kwargs)
    policy = runtime.policy()
    rid = getattr(request, "request_id", None)
    what = (f"kvguard {names.CHECK_BLOCK_EXCLUSIVE}: request {rid} is given GPU block(s) {shared[:8]} twice "
            "across its KV cache groups (one page written as two: wrong KV; vLLM #33775)")
    if policy == names.POLICY_OBSERVE:
        _record(names.ACTION_CONTINUED, request, shared, num_external_tokens, policy)
        return wrapped(*args, **kwargs)
    if policy == names.POLICY_STRICT:
        _record(names.ACTION_RAISED, request, shared, num_external_tokens, policy)
        raise counters.StrictFailure(what)
    scheduler = degrade.find_scheduler(sys._getframe(1), rid) if num_external_tokens > 0 else None
    if scheduler is None:
        _record(names.ACTION_RAISED, request, shared, num_external_tokens, policy)
        raise AssertionError(what)
    result = wrapped(request, blocks, 0)  # the connector takes no load, releases its pin

    def done(action: str) -> None:
        _record(action, request, shared, num_external_tokens, policy)

    if recompute.recompute_unloaded(scheduler, instance, request, done):
        return result  # recomputed (or failed) at the end of this schedule(): ``done`` counts it
    if not degrade.fail_unloaded(scheduler, instance, rid, what + "; request failed alone"):
        _record(names.ACTION_RAISED, request, shared, num_external_tokens, policy)
        raise AssertionError(what)
    _record(names.ACTION_REQUEST_FAILED, request, shared, num_external_tokens, policy)
    return result


def scheduler_sides(module: Any) -> list[str]:
    """Qualnames of ``module``'s own classes that are a connector's scheduler side: they
    define ``get_num_new_matched_tokens`` and ``update_state_after_alloc``, and the latter
    does its own work (a facade that delegates names ``update_state_after_alloc`` in its
    code: the OffloadingConnector and SimpleCPUOffloadConnector classes are facades)."""
    found = []
    for obj in vars(module).values():
        if not (isinstance(obj, type) and obj.__module__ == module.__name__):
            continue
        usa = vars(obj).get("update_state_after_alloc")
        code = getattr(usa, "__code__", None)
        if callable(vars(obj).get("get_num_new_matched_tokens")) and code is not None \
                and "update_state_after_alloc" not in code.co_names:
            found.append(obj.__qualname__)
    return found
