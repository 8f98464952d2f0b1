"""The promotion checks of a deferred hit under vLLM's tiering, and what is ready now.

Promotion fit (check ``promotion_fit``): a deferred hit under vLLM's tiering
------------------------------------------------------------------------------

With vLLM's ``TieringOffloadingManager`` (0.25+, ``vllm/v1/kv_offload/tiering/manager.py``;
found by structure: a manager with ``primary_tier`` and a non-empty ``secondary_tiers``),
a chunk missing from the primary (CPU) tier but held by a secondary tier is *promoted*:
``lookup`` allocates a CPU slot for it (``_initiate_promotion`` ->
``primary_tier.prepare_write``, which may evict any ready chunk whose ref count is 0)
and answers HIT_PENDING (0.33) / RETRY (0.25.1), so the connector's lookup answers
``None`` ("retry later", ``_maximal_prefix_lookup`` / ``_sliding_window_lookup``). The
lookup answers a number only when every chunk it scans is HIT, i.e. ready in the CPU
tier at the same time; nothing pins a HIT chunk between two lookups, and a promotion of
a later chunk of the same hit may evict an earlier one (it is ready, ref count 0).

Invariant: *the load set of the hit a deferred lookup waits for fits in the primary
tier*: ``load_set_size(hit) <= capacity`` (chunks; the capacity is the CPU tier's
``cache_capacity``, :func:`_primary_capacity`). When it does not, the chunks cannot all be
ready at once (pigeonhole), every lookup promotes the missing chunks by evicting ready
ones of the same hit and defers again, and the request waits forever (measured: the fuzz
finding ``tests/vllm/traces/tiering-promotion-loop.jsonl`` on 0.25.1 and 0.33.0, stall
``lookup_deferred``; a 48-chunk load set over a 30-chunk CPU tier). When it fits, the
deferral can end (promotions complete; other requests' pins are released), so the check
stays silent: it is not a timeout and does not count steps. Fitting is necessary, not
sufficient: on 0.33.0 a hit that fits is deferred forever when the LRU ranks the request's
promoted chunks below other ready chunks (``tests/vllm/traces/tiering-request-rank-loop.jsonl``,
23 chunks over 29; docs/fuzz.md, "A second tiering stall"): the next check is for that.

Promotion progress (check ``promotion_progress``): a deferral that evicts what it waits for
-------------------------------------------------------------------------------------------

Invariant: *a chunk of the awaited load set that was ready (HIT) at the request's
previous deferred lookup is still ready at this one*. A deferral is worth waiting for
while what became ready stays ready: then every step adds ready chunks and the wait ends
once the promotions complete. When a ready chunk of the same hit is gone (evicted from the
CPU tier, seen again as RETRY / HIT_PENDING: its promotion restarted), the wait lost
ground and nothing bounds it: on 0.33.0 the request-ranked LRU
(``cpu/policies/lru.py``: a chunk ranks by ``(request rank, -position)``, the rank fixed
at the request's first insert) makes each step's promotions evict the request's own ready
chunks, forever. Upstream the same rule is the fix proposed for vllm#49902 (PR #50014:
pin a promoted chunk until the waiting request reads it). The check compares the ready
keys of the awaited load set (the hit of the promotion-fit check, below, from ``seen``)
with those kept from the request's previous deferred lookup (:func:`ready_memory`, on
the connector scheduler; dropped when a lookup of the request is answered, so a
deferral after a preemption starts afresh). It is evaluated from a request's second
deferred lookup on, after ``promotion_fit`` (which acts one deferral earlier on the
hits that can never fit); actions and the reduced answer are those of ``promotion_fit``
(table below, ``check="promotion_progress"``). What it costs when the wait would have
ended anyway (a chunk evicted by other requests' stores, re-promoted in time): the
recompute of the part not ready, never wrong KV. Measured: ``tiering-request-rank-loop.jsonl``
on 0.33.0 stalls without it and finishes every request with it, same tokens as without
the tiers; on 0.25.1 (plain LRU) the same trace finishes either way and the check also
answers some deferrals early (``tests/vllm/test_promotion_fit.py``). Kill switch:
``KVGUARD_DISABLED_SITES=admission:promotion_progress``.

The hit a deferral waits for is measured from what vLLM's lookup saw: during the
connector's lookup the manager's ``lookup`` is recorded per offload key
(:func:`record_lookup`: an instance attribute for the length of that one call, nothing
else changed); a chunk counts as found when the manager answered HIT or HIT_PENDING, or
RETRY and it now has a CPU entry (a started promotion). The waited-for hit is the
longest hit whose whole load set was found (:func:`~kvguard.guards.checks.load_coverage.longest_loadable_hit`
over the found chunks, up to ``min(num_tokens - 1, len(offload_keys) * tokens_per_chunk)``);
its load set is a lower bound of what the lookup waits for. A deferral for the
request's own transfers in flight (``transfer_jobs``, no lookup ran) is not checked.

============  ==========================================================================
``observe``   counted only (``action="continued"``); vLLM's ``None`` passes through
              (the request stays deferred, as without kvguard; counted once per deferred
              lookup, so a stall counts once per step).
``guard``     the lookup answers the longest hit whose load set is ready in the CPU tier
              now (chunk aligned; a chunk another load is reading does not count, as
              vLLM's own lookup delays such a hit), or 0 so vLLM recomputes
              (``action="hit_reduced"``, ``kvguard_recomputed_tokens_total{check=
              "promotion_fit"}`` += deferred hit - admitted hit); ``load_async`` is
              ``admitted > 0`` (no sync-load budget was reserved for a deferred answer).
``strict``    raises ``AssertionError`` at admission (``action="raised"``).
============  ==========================================================================

Why the reduced answer is safe: it is built of chunks that are ready in the CPU tier
(the load-set rule of :mod:`~kvguard.guards.checks.load_coverage`), and vLLM's scheduler calls
``update_state_after_alloc`` (``prepare_load`` pins them) right after allocating that
request's blocks, with no other lookup in between; for a deferred answer vLLM's
``get_num_new_matched_tokens`` already set ``num_locally_computed_tokens``, cleared
``partial_tail_boundary`` and reserved no sync load. Promotions the deferred lookup
started complete as any other and leave ordinary CPU chunks. Proven in the replay by
the KV-content oracle (``wrong_kv_blocks`` 0) and the request's generated tokens
(``tests/vllm/test_promotion_fit.py``). Kill switch:
``KVGUARD_DISABLED_SITES=admission:promotion_fit``.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any, Callable

from kvguard.guards import names
from kvguard.guards.checks import copy_ledger, offload_plan
from kvguard.guards.checks.admission import copied, counters
from kvguard.guards.checks.load_coverage import Unsupported, load_set, longest_hit, longest_loadable_hit
from kvguard.guards.hooking.rewrite import keyword_argument_names
from kvguard.guards.policy import runtime

#: Attribute cached on each connector scheduler instance: its :class:`_Tiering` or None.
TIERING_ATTR = "_kvguard_tiering"


UNSET = object()


#: ``LookupResult`` names that say the manager found the chunk (ready, being written, or
#: a promotion just started in 0.33) -- compared by name, so no vLLM import is needed.
_FOUND = frozenset({"HIT", "HIT_PENDING"})


#: Attribute cached on each connector scheduler instance: :func:`ready_memory`.
_READY_ATTR = "_kvguard_ready_keys"


@dataclass(frozen=True)
class _Tiering:
    """vLLM's ``TieringOffloadingManager`` of one connector scheduler, found by structure.

    ``manager``: the tiering manager (``primary_tier`` + a non-empty ``secondary_tiers``
    list + ``lookup``); ``primary``: its CPU tier; ``capacity``: the CPU tier's size in
    chunks (offloaded blocks), read by :func:`_primary_capacity`.
    """

    manager: Any
    primary: Any
    capacity: int


def _primary_capacity(primary: Any) -> int:
    """The primary (CPU) tier's capacity in chunks; Unsupported when it cannot be read.

    The CPU manager builds its cache policy as ``policy_cls(cache_capacity=<n>)`` with
    ``n`` its ``num_chunks`` (0.33) / ``num_blocks`` (0.25) argument, so the capacity is
    the policy's ``cache_capacity`` where the policy keeps it (0.33's ``CachePolicy``
    base; 0.25's ARC), else the attribute the constructor that passes ``cache_capacity=``
    assigns that same argument to (``self._num_blocks = num_blocks`` in 0.25.1), found
    in that constructor's source (walking the MRO), never by a name list.
    """
    capacity = getattr(getattr(primary, "_policy", None), "cache_capacity", None)
    if isinstance(capacity, int) and not isinstance(capacity, bool) and capacity > 0:
        return capacity
    for cls in type(primary).__mro__:
        init = vars(cls).get("__init__")
        if init is None:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        except (OSError, TypeError, SyntaxError):
            continue
        params = keyword_argument_names(tree, "cache_capacity")
        if not params:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign):
                targets, value = [node.target], node.value
            else:
                continue
            if not (isinstance(value, ast.Name) and value.id in params):
                continue
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                    capacity = getattr(primary, target.attr, None)
                    if isinstance(capacity, int) and not isinstance(capacity, bool) and capacity > 0:
                        return capacity
        break  # the constructor that sizes the policy was found: nothing further up does
    raise Unsupported(names.SKIP_OFFLOAD_MANAGER, f"cannot read the capacity of the primary tier {type(primary).__qualname__}")


def tiering_of(cs: Any) -> _Tiering | None:
    """The connector scheduler's :class:`_Tiering`, None without vLLM's tiering (cached on
    ``cs``). A tiering manager whose CPU tier capacity cannot be read gets no promotion-fit
    or promotion-progress check: counted once, as ``kvguard_check_skipped_total{check=
    "promotion_fit", reason="offload_manager"}`` (its deferred lookups are then not
    recorded, so they cannot be counted one by one); any other exception here counts
    ``kvguard_guard_errors_total{stage="admission"}``."""
    tiering = None
    try:
        manager = getattr(cs, "manager", None)
        primary = getattr(manager, "primary_tier", None)
        tiers = getattr(manager, "secondary_tiers", None)
        if primary is not None and isinstance(tiers, (list, tuple)) and tiers and callable(getattr(manager, "lookup", None)):
            tiering = _Tiering(manager, primary, _primary_capacity(primary))
    except Unsupported as why:
        # the deferred lookups of this scheduler are then not recorded, so they cannot be
        # counted one by one: counted once here
        counters.skip(cs, names.CHECK_PROMOTION_FIT, counters.PF, why.reason, str(why))
        tiering = None
    except Exception as error:
        runtime.guard_error(names.STAGE_ADMISSION, error)
        tiering = None
    try:
        cs.__dict__[TIERING_ATTR] = tiering
    except Exception:
        pass
    return tiering


class LookupRecorder:
    """Stands in for the tiering manager's ``lookup`` during one connector lookup:
    records ``key -> LookupResult`` of the scheduler's calls (``lookup(key, req_context)``;
    a call with more arguments, e.g. a secondary tier's ``exclude_tier_idx``, is not the
    scheduler's and is passed through unrecorded)."""

    __slots__ = ("inner", "seen")

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner
        self.seen: dict[Any, Any] = {}

    def __call__(self, key: Any, req_context: Any, *args: Any, **kwargs: Any) -> Any:
        result = self.inner(key, req_context, *args, **kwargs)
        if not args and not kwargs:
            self.seen[key] = result
        return result


def _recorded(tiering: _Tiering, call: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, dict | None]:
    manager = tiering.manager
    try:
        inner = manager.__dict__.get("lookup", UNSET)
        recorder = LookupRecorder(manager.lookup)
        manager.lookup = recorder  # an instance attribute: vLLM calls self.manager.lookup
    except Exception as error:
        runtime.guard_error(names.STAGE_ADMISSION, error)
        return call(*args, **kwargs), None
    try:
        answer = call(*args, **kwargs)
    finally:
        if inner is UNSET:
            manager.__dict__.pop("lookup", None)
        else:
            manager.lookup = inner
    return answer, recorder.seen


def record_lookup(cs: Any, call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, dict | None]:
    """``(call(*args, **kwargs), seen)``: run vLLM's lookup ``call`` for one request and record
    what the tiering manager's ``lookup`` answered per offload key (``seen``, for :func:`lookup.admit`).
    The arguments are passed through so the wrapper's hot path builds no closure.

    ``seen`` is None when ``cs`` has no tiering manager (nothing is wrapped then) or the
    promotion-fit check is off. The manager's own method runs unchanged; the stand-in is
    removed when ``call`` returns or raises.
    """
    tiering = cs.__dict__.get(TIERING_ATTR, UNSET)
    if tiering is UNSET:
        tiering = tiering_of(cs)
    if tiering is None or not (counters.promotion_fit_on or counters.promotion_progress_on):
        return call(*args, **kwargs), None
    return _recorded(tiering, call, args, kwargs)


def check_deferred(cs: Any, request: Any, num_computed_tokens: int, answer: Any, seen: dict) -> Any:
    """The promotion-fit and promotion-progress checks of a deferred answer (``None``)
    under vLLM's tiering (module docstring).

    The chunks the deferred lookup found (``seen`` HIT / HIT_PENDING, or RETRY with an
    entry now in the CPU tier: a promotion started in 0.25) give the hit it waits for: the
    longest hit, up to ``min(num_tokens - 1, len(offload_keys) * tokens_per_chunk)``,
    whose whole load set was found. Promotion fit: when that load set holds more chunks
    than the CPU tier, vLLM can never answer it. Promotion progress: when a chunk of that
    load set that was ready (HIT) at the request's previous deferred lookup is not ready
    now, the wait lost ground. Either acts by policy.
    """
    req_status = cs._req_status[request.request_id]
    if getattr(req_status, "transfer_jobs", None) or not seen:
        return answer  # deferred for the request's own transfers in flight, or no lookup ran
    tiering = cs.__dict__.get(TIERING_ATTR)
    plan = offload_plan.get_plan(cs)
    if plan.__class__ is not offload_plan.Plan or tiering is None:  # offload_plan.get_plan gives Unsupported, never None
        if plan.__class__ is not offload_plan.Plan:
            counters.skip(cs, names.CHECK_PROMOTION_FIT, counters.PF, plan.reason, str(plan))
        else:
            with counters._lock:
                counters.bump(counters.PF + "unchecked")
        return answer
    if counters.promotion_fit_on:
        with counters._lock:
            counters.bump(counters.PF + "evaluated")
    group_states = req_status.group_states
    get = plan.getter()

    def found(group: int, chunk: int) -> bool:
        group_keys = group_states[group].offload_keys
        if chunk >= len(group_keys):
            return False
        result = seen.get(group_keys[chunk])
        name = getattr(result, "name", None)
        return name in _FOUND or (name == "RETRY" and get(group_keys[chunk]) is not None)

    end = awaited_end(plan, group_states, request)
    if end <= num_computed_tokens:
        return answer
    target = longest_loadable_hit(plan.groups, num_computed_tokens, end, found)
    if target <= 0:
        return answer
    awaited = load_set(plan.groups, num_computed_tokens, num_computed_tokens + target)
    needed = sum(len(chunks) for chunks in awaited)
    policy = runtime.policy()
    fields = {
        names.KEY_LOCAL_HIT_TOKENS: num_computed_tokens,
        names.KEY_DEFERRED_HIT_TOKENS: target,
        names.KEY_NEEDED_CHUNKS: needed,
        names.KEY_PRIMARY_CAPACITY_CHUNKS: tiering.capacity,
    }
    if counters.promotion_fit_on and needed > tiering.capacity:
        return _act_deferred(
            cs, names.CHECK_PROMOTION_FIT, counters.PF, plan, req_status, get, request, num_computed_tokens, target,
            policy, answer, fields,
            f"kvguard promotion_fit: the deferred hit of {target} tokens after {num_computed_tokens} local "
            f"tokens loads {needed} chunks, more than the {tiering.capacity}-chunk primary tier holds: "
            f"vLLM's tiered lookup can never answer it",
        )
    if not counters.promotion_progress_on:
        return answer
    # it fits: the deferral can end, as long as what became ready stays ready
    ready_now = []
    lost = []
    memory = ready_memory(cs)
    previous = memory.get(request.request_id)
    for group, chunks in enumerate(awaited):
        group_keys = group_states[group].offload_keys
        for chunk in chunks:
            key = group_keys[chunk]
            if getattr(seen.get(key), "name", None) == "HIT":
                ready_now.append(key)
            elif previous is not None and key in previous:
                lost.append((group, chunk))
    memory[request.request_id] = frozenset(ready_now)
    if previous is None:
        return answer  # the request's first deferred lookup: nothing to compare yet
    with counters._lock:
        counters.bump(counters.PP + "evaluated")
    if not lost:
        return answer
    fields[names.KEY_LOST_READY_CHUNKS] = len(lost)
    fields[names.KEY_FIRST_LOST] = f"group {lost[0][0]} chunk {lost[0][1]}"
    return _act_deferred(
        cs, names.CHECK_PROMOTION_PROGRESS, counters.PP, plan, req_status, get, request, num_computed_tokens, target,
        policy, answer, fields,
        f"kvguard promotion_progress: {len(lost)} chunk(s) of the deferred hit of {target} tokens after "
        f"{num_computed_tokens} local tokens were ready at the previous deferred lookup and are not now "
        f"(first: group {lost[0][0]} chunk {lost[0][1]}): the wait evicts what it waits for",
    )


def _act_deferred(cs: Any, check: str, prefix: str, plan: offload_plan.Plan, req_status: Any, get: Any, request: Any,
                  num_computed_tokens: int, target: int, policy: str, answer: Any, fields: dict[str, Any],
                  message: str) -> Any:
    """Act by ``policy`` on a deferred hit of ``target`` tokens that ``check`` failed:
    observe counts and passes vLLM's ``None`` through; strict raises ``message``; guard
    answers the longest hit whose load set is ready in the CPU tier now (a chunk another
    load is reading does not count: vLLM's own lookup delays such a hit), or 0."""
    if policy == names.POLICY_OBSERVE:
        return counters.record_violation(check, prefix, request, names.ACTION_CONTINUED, policy, 0, answer,
                      {**fields, names.KEY_ADMITTED_HIT_TOKENS: None})
    if policy == names.POLICY_STRICT:
        counters.record_violation(check, prefix, request, names.ACTION_RAISED, policy, 0, answer,
               {**fields, names.KEY_ADMITTED_HIT_TOKENS: None})
        raise counters.StrictFailure(message)
    reduced = ready_hit(cs, plan, req_status.group_states, get, num_computed_tokens, target)
    ready_memory(cs).pop(request.request_id, None)  # the deferral ends with this answer
    return counters.record_violation(check, prefix, request, names.ACTION_HIT_REDUCED, policy, target - reduced, (reduced, reduced > 0),
                  {**fields, names.KEY_ADMITTED_HIT_TOKENS: reduced})


def ready_pred(cs: Any, group_states: Any, get: Any) -> Callable[[int, int], bool]:
    """``ready(group, chunk)``: the chunk is in the CPU tier and ready, and no other load
    reads it (vLLM's own lookup delays a hit on a chunk another load is reading)."""
    being_loaded = getattr(cs, "_chunks_being_loaded", None)
    if being_loaded is None:
        being_loaded = getattr(cs, "_blocks_being_loaded", None)
    being_loaded = being_loaded or ()

    def ready(group: int, chunk: int) -> bool:
        group_keys = group_states[group].offload_keys
        if chunk >= len(group_keys):
            return False
        key = group_keys[chunk]
        if key in being_loaded:
            return False
        entry = get(key)
        return entry is not None and bool(entry.is_ready)

    return ready


def ready_hit(cs: Any, plan: offload_plan.Plan, group_states: Any, get: Any, num_computed_tokens: int, target: int) -> int:
    """The longest hit (tokens beyond ``num_computed_tokens``, at most ``target``) whose
    load set is ready in the CPU tier now (:func:`ready_pred`) and whose copies are
    covered (:mod:`kvguard.guards.checks.copy_ledger`); 0 when none is."""
    ready = ready_pred(cs, group_states, get)
    copies = copied.copies_ok(plan, cs.__dict__.get(copy_ledger.LEDGER_ATTR), group_states, num_computed_tokens)

    def ok(end: int) -> bool:
        return all(
            ready(g, c) for g, chunks in enumerate(load_set(plan.groups, num_computed_tokens, end)) for c in chunks
        ) and copies(end)

    return longest_hit(plan.groups, num_computed_tokens, num_computed_tokens + target, ok)


def awaited_end(plan: offload_plan.Plan, group_states: Any, request: Any) -> int:
    """The end (tokens) of the longest hit the request's offload keys allow:
    ``min(len(offload_keys) * tokens_per_chunk over the groups, num_tokens - 1)``."""
    end = min(len(state.offload_keys) * g.tokens_per_chunk for state, g in zip(group_states, plan.groups))
    return min(end, int(request.num_tokens) - 1)


def ready_memory(cs: Any) -> dict[str, frozenset]:
    """``request_id -> offload keys of its awaited load set ready at its last deferred
    lookup``, kept on the connector scheduler (vLLM's per-request state has ``__slots__``
    on 0.33). Entries of requests vLLM no longer tracks (finished or aborted while
    deferred) are dropped whenever it holds more than twice as many as ``_req_status``."""
    memory = cs.__dict__.get(_READY_ATTR)
    if memory is None:
        memory = cs.__dict__[_READY_ATTR] = {}
    elif len(memory) > 2 * len(cs._req_status) + 16:
        for request_id in [r for r in memory if r not in cs._req_status]:
            del memory[request_id]
    return memory


def forget_ready(cs: Any, request: Any) -> None:
    """Drop what the promotion-progress check remembered of ``request``'s last deferred
    lookup: vLLM answered it, so a later deferral (after a preemption) starts afresh."""
    memory = cs.__dict__.get(_READY_ATTR)
    if memory:
        memory.pop(request.request_id, None)
