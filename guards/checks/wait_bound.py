"""The wait bound (check ``wait_bound``): every wait the offload path creates ends.

A request that never finishes is a failure nobody sees: its client times out, its GPU
blocks stay held, the engine looks healthy. The guard's other checks were each derived
from one stall shape (``promotion_fit``, ``promotion_progress``; retired once the
differential fuzz showed this bound ending every stall they ended, with no needless cut:
:mod:`kvguard.guards.checks.admission.deferred`); this one is the end-to-end invariant they served: *a request the offload path keeps waiting makes
progress within a bound*, whatever the mechanism.

The waits, read off vLLM's code (the same on every full release, 0.21.0-0.34.0)
-------------------------------------------------------------------------------

The scheduler (``vllm/v1/core/sched/scheduler.py``) asks the connector about a waiting
request in exactly two ways, and each can make it wait:

1. ``get_num_new_matched_tokens`` answers ``None``: "the connector needs more time to
   determine the number of matched tokens; the scheduler should query for this request
   again later" (the method's documented contract). The request stays ``WAITING`` and
   is asked again at the next step the scan reaches it. The offloading connector answers
   ``None`` when the request's own transfer jobs are in flight (``req_status.transfer_jobs``:
   the stores of a preempted request; wait ``transfers_in_flight``) and when its lookup
   finds a chunk that is not ready yet (being stored, being promoted from a secondary
   tier, being loaded by another request; wait ``lookup_deferred``).
2. ``load_kv_async`` is True: the scheduler allocates the request's blocks, parks it in a
   *blocked waiting status* that names KV (:func:`kv_wait_statuses`: the members of
   ``RequestStatus`` whose name starts ``WAITING_FOR_`` and contains ``KV``; every full
   release has one, ``WAITING_FOR_REMOTE_KVS``) and promotes it only when the worker
   reports the load (``finished_recving``) *and* the waiting scan reaches it. Wait
   ``load_in_flight`` until the report, ``load_not_promoted`` after it.

3. The connector's own stores hold GPU blocks a waiting request needs
   (``blocks_held_by_stores``). The SimpleCPUOffloadConnector's lazy mode
   (``lazy_offload: true``) walks the GPU free queue from its head in every
   ``build_connector_meta`` and ``touch``es each block it stores (``_prepare_lazy_store_specs``,
   0.21.0-0.34.0), releasing them when the store is reported. With async scheduling the
   report of a step's store is processed after the next ``schedule()``, so every admission
   runs with the previous step's pins held; where the CPU pool is smaller than the walker's
   reach (``_target_free``) it never runs out of blocks to store, and a request whose full
   sequence needs the pinned blocks (``scheduler_reserve_full_isl``) is never admitted: the
   engine idles with requests waiting and no transfer of theirs pending (fuzz seed 14, 3 Dec
   2026: every lost request of those runs, on 0.26.0, 0.29.0, 0.33.0 and 0.34.0; vLLM alone
   and guarded alike before this wait). Observed once per step in which the engine scheduled
   nothing while a request waits and the connector has stores pending
   (``has_pending_stores()``); progress is a step that schedules any token.

Waits the scheduler side cannot end are left to vLLM: the worker's ``wait(jobs_to_flush)``
(the engine itself blocks; nothing kvguard runs in the scheduler can help) and a
finished request's blocks held for its last stores (the client already has its answer).

Progress, and the bound
-----------------------

Each wait has a progress measure that only a real step forward raises:

- ``lookup_deferred``: the number of chunks of the awaited load set (the load set of the
  longest hit the request's offload keys allow) that are ready in the CPU tier now,
  high-water mark over the wait (it is bounded, so it cannot rise forever);
- ``transfers_in_flight``: the set of the request's own transfer jobs changes (one
  completed);
- ``load_in_flight``: the load is reported (the wait becomes ``load_not_promoted``);
- ``load_not_promoted``: the engine schedules any token (the scan legitimately serves
  other requests first; only a step in which the engine scheduled nothing while the
  load sits reported counts: vLLM's waiting scan ``break``s at a head it cannot allocate,
  vllm#45388, and when that head waits for blocks the reported request holds, nothing
  ever changes).

A wait is *stalled* when it was observed ``KVGUARD_WAIT_BOUND_STEPS`` times in a row
without progress (observed = a deferred answer for the first two kinds, an engine step
for the last two) **and** ``KVGUARD_WAIT_BOUND_SECONDS`` passed since its last progress.
Both must pass: steps alone would fire on an idle engine that steps in microseconds,
seconds alone would fire when the whole engine is slow. Why 32 and 30 s: a healthy wait
waits for one transfer (a store, a promotion, a load), so it moves within one transfer's
latency; the replay's worker model draws at most 6 steps (``kvguard fuzz``), a live CPU
offload of a chunk takes milliseconds, and 30 s is past any client's patience for a
first token on a hit, yet far below the minutes an operator's alert looks at.
The replay runs on simulated time (steps) and sets the seconds to 0.

What each policy does with a stalled wait
-----------------------------------------

============  ==========================================================================
``observe``   counted once per wait (``kvguard_wait_bound_exceeded_total{wait, action=
              "continued"}``, ``kvguard_invariant_violations_total{check="wait_bound"}``),
              event ``wait_bound_exceeded``; vLLM's behaviour is unchanged.
``guard``     the wait ends the cheapest safe way:

              - ``lookup_deferred``: the lookup answers the longest hit whose load set
                is ready in the CPU tier now (chunk aligned, a chunk another load reads
                does not count, copy coverage holds), or 0: the rest is recomputed
                (``action="hit_reduced"``). Safe for the same reasons as
                any reduced answer (:mod:`kvguard.guards.checks.admission.deferred`).
              - ``load_not_promoted``: the load was reported, so nothing writes the
                request's blocks any more: vLLM's own failed-receive path frees them and
                sends the request back to ``WAITING``, to be computed from scratch
                (``action="recomputed"``, :mod:`kvguard.guards.policy.recompute`: a prefill
                instead of the request; its retry is answered no load, so it is admitted
                computing and cannot park behind the same head again), on every release whose scheduler has that path
                (bound by structure; 0.21.0-0.34.0 all have it). Where none is found the
                request fails alone, as below.
              - ``blocks_held_by_stores``: the walker takes no new GPU blocks until the
                engine schedules again (``action="stores_withheld"``: its switch, the
                attribute the installed walker returns nothing for when ``<= 0``, found by
                :func:`lazy_store_switch`, is 0 for those steps). The pins it holds are
                released as their stores are reported, the head request is admitted, and
                the walker resumes. The cost is the lazy offloads of those idle steps: the
                blocks stay in the GPU prefix cache, uncopied (never wrong KV: a store
                not made publishes nothing).
              - ``transfers_in_flight`` and ``load_in_flight``: the connector cannot
                release them (a transfer in flight still reads or writes the request's
                blocks), so that request fails alone (``action="request_failed"``):
                vLLM's ``finish_requests(id, FINISHED_ERROR)`` at the next
                ``update_from_output`` (:func:`kvguard.guards.policy.degrade.fail_waiting`),
                the same path as a client's abort (blocks of a load still in flight are
                freed only when the worker reports it), and the client gets an output
                with finish reason ``error``. Every other request goes on.
``strict``    raises ``AssertionError`` naming the wait (``action="raised"``).
============  ==========================================================================

Where it runs: the deferred answers at admission (:mod:`kvguard.guards.checks.admission` calls
:func:`observe_deferred`), the async loads from the connector scheduler's
``build_connector_meta`` (once per ``schedule()``, :func:`attach` puts an instance-level
wrapper there; with nothing waiting it costs one dict read). Kill switch:
``KVGUARD_DISABLED_SITES=scheduler:wait_bound``.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from kvguard.guards import names
from kvguard.guards.policy import degrade, recompute, runtime

__all__ = [
    "Wait",
    "WaitTable",
    "attach",
    "configure",
    "detach_all",
    "kv_wait_statuses",
    "lazy_store_switch",
    "observe_idle",
    "observe_deferred",
    "answered",
    "admitted_async",
    "hit_answered",
    "snapshot",
    "reset",
]

#: attribute holding each connector scheduler's :class:`WaitTable`
TABLE_ATTR = "_kvguard_waits"

_lock = threading.Lock()
_enabled = True
_steps = names.DEFAULT_WAIT_BOUND_STEPS
_seconds = names.DEFAULT_WAIT_BOUND_SECONDS
_metrics: Any = None
_events: Any = None
#: in-process counts: "evaluated" (observations), "<wait>:<action>"
_stats: dict[str, int] = {}


def configure(steps: int = names.DEFAULT_WAIT_BOUND_STEPS, seconds: float = names.DEFAULT_WAIT_BOUND_SECONDS,
              enabled: bool = True, metrics: Any = None, events: Any = None) -> None:
    """Set the bound (``steps`` observations >= 1 and ``seconds`` >= 0 without progress)
    and the sinks; ``enabled`` False turns the check off (kill switch)."""
    global _enabled, _metrics, _events
    set_bound(steps, seconds)
    _enabled, _metrics, _events = bool(enabled), metrics, events


def metrics_sink() -> Any:
    """The metrics sink :func:`configure` set (None: counts in :func:`snapshot` only)."""
    return _metrics


def set_metrics_sink(metrics: Any) -> None:
    """Replace only the metrics sink (the fuzz runner's tee of kvguard's decisions)."""
    global _metrics
    _metrics = metrics


def set_bound(steps: int | None = None, seconds: float | None = None) -> None:
    """Change the bound in force, keeping the sinks (the replay sets ``seconds=0``: its
    time is simulated steps)."""
    global _steps, _seconds
    if steps is not None:
        if int(steps) < 1:
            raise ValueError(f"wait bound steps must be >= 1, got {steps}")
        _steps = int(steps)
    if seconds is not None:
        if float(seconds) < 0:
            raise ValueError(f"wait bound seconds must be >= 0, got {seconds}")
        _seconds = float(seconds)


def reset() -> None:
    """Zero the in-process counts of :func:`snapshot`."""
    with _lock:
        _stats.clear()


def snapshot() -> dict[str, int]:
    """In-process counts: ``evaluated`` (observations of a waiting request) and
    ``<wait>:<action>`` per stalled wait and action taken."""
    with _lock:
        return dict(_stats)


def _bump(key: str) -> None:
    with _lock:
        _stats[key] = _stats.get(key, 0) + 1


def kv_wait_statuses(status_enum: Any) -> frozenset[str]:
    """Names of the members of vLLM's ``RequestStatus`` (``status_enum``, read off a
    request's own ``status``, so nothing is imported) that park a request for its KV: a
    name that starts ``WAITING_FOR_`` and contains ``KV`` (``WAITING_FOR_REMOTE_KVS`` on
    0.21.0-0.34.0)."""
    return frozenset(m.name for m in status_enum if m.name.startswith("WAITING_FOR_") and "KV" in m.name)


@dataclass
class Wait:
    """One request's wait: its ``kind`` (:data:`kvguard.guards.names.WAITS`), the
    ``request`` (vLLM ``Request``), the progress measure's high-water mark ``best``
    (ready chunks of the awaited load set for ``lookup_deferred``, else 0), the request's transfer jobs ``jobs`` at the
    last observation, ``stale`` (observations in a row without progress), ``since``
    (``time.monotonic()`` of the last progress, seconds) and whether it was acted on."""

    kind: str
    request: Any
    best: int = 0
    jobs: frozenset = frozenset()
    stale: int = 0
    since: float = field(default_factory=time.monotonic)
    acted: bool = False

    def progress(self, now: float) -> None:
        self.stale = 0
        self.since = now
        self.acted = False

    def exceeded(self, now: float) -> bool:
        return self.stale >= _steps and now - self.since >= _seconds


@dataclass
class WaitTable:
    """The waits of one connector scheduler: ``waits`` (request id -> :class:`Wait`),
    ``async_loads`` (request id -> ``Request`` admitted with ``load_kv_async``, not yet seen
    parked), the vLLM ``Scheduler`` once found (``scheduler``) and the derived KV wait
    statuses."""

    waits: dict[str, Wait] = field(default_factory=dict)
    async_loads: dict[str, Any] = field(default_factory=dict)
    scheduler: Any = None
    statuses: frozenset | None = None
    #: ``RequestStatus.WAITING`` once read (compared by identity: an enum member)
    waiting: Any = None
    #: True once :func:`attach` put the per-step hook on the connector scheduler: async
    #: loads are watched only then (nothing else would ever drop them)
    stepped: bool = False
    #: the lazy store walker's switch attribute (:func:`lazy_store_switch`; None: no walker)
    lazy_switch: str | None = None
    #: the ``blocks_held_by_stores`` wait, while the engine idles with requests waiting
    hold: Wait | None = None


def _table(cs: Any) -> WaitTable:
    table = cs.__dict__.get(TABLE_ATTR)
    if table is None:
        table = cs.__dict__[TABLE_ATTR] = WaitTable()
    return table


def _known(cs: Any, request_id: str) -> bool:
    """Whether the connector scheduler still tracks the request: the OffloadingConnector's
    ``_req_status``; a connector without it (the SimpleCPUOffloadConnector) tracks every
    request it answered until vLLM finishes it (its status then leaves the waits)."""
    req_status = getattr(cs, "_req_status", None)
    return True if req_status is None else request_id in req_status


def _scheduler(table: WaitTable, frame: Any, request_id: str) -> Any:
    if table.scheduler is None:
        table.scheduler = degrade.find_scheduler(frame, request_id)
    return table.scheduler


# -- deferred lookups (called by the admission check) ----------------------------------
def observe_deferred(cs: Any, request: Any, ready: int) -> Wait | None:
    """Observe one deferred answer (``None``) of the connector's lookup for ``request``;
    ``ready``: the progress measure, the number of chunks of the awaited load set (the
    load set of the longest hit the request's offload keys allow) that are ready in the
    CPU tier now. Returns the :class:`Wait` when it is stalled and not yet acted on under
    ``observe`` (the caller then calls :func:`act_deferred`), else None."""
    rid = request.request_id
    table = _table(cs)
    req_status = cs._req_status.get(rid)
    jobs = frozenset(getattr(req_status, "transfer_jobs", None) or ())
    kind = names.WAIT_TRANSFERS_IN_FLIGHT if jobs else names.WAIT_LOOKUP_DEFERRED
    now = time.monotonic()
    _bump("evaluated")
    wait = table.waits.get(rid)
    if wait is None or wait.kind != kind or wait.request is not request:
        if len(table.waits) > 2 * len(cs._req_status) + 16:
            # requests vLLM no longer tracks (finished or aborted while deferred), when no
            # per-step hook drops them
            for gone in [r for r in table.waits if r not in cs._req_status]:
                del table.waits[gone]
        table.waits[rid] = Wait(kind, request, best=ready, jobs=jobs, since=now)
        return None
    if ready > wait.best or jobs != wait.jobs:
        wait.best = max(wait.best, ready)
        wait.jobs = jobs
        wait.progress(now)
        return None
    wait.stale += 1
    if wait.acted or not wait.exceeded(now):
        return None
    return wait


def act_deferred(cs: Any, wait: Wait, ready_hit: int, answer: Any) -> Any:
    """Act by policy on a stalled deferred lookup; returns the lookup's answer.

    ``lookup_deferred`` under guard: ``(ready_hit, ready_hit > 0)``; ``transfers_in_flight``
    under guard: the request is failed alone (:func:`kvguard.guards.policy.degrade.fail_waiting`)
    and ``answer`` (vLLM's ``None``) is returned. Observe returns ``answer``; strict raises
    ``AssertionError``."""
    policy = runtime.policy()
    table = _table(cs)
    message = _message(wait)
    if policy == names.POLICY_STRICT:
        _count(wait, names.ACTION_RAISED, policy, ready_hit)
        raise AssertionError(message)
    if policy == names.POLICY_OBSERVE:
        wait.acted = True
        _count(wait, names.ACTION_CONTINUED, policy, ready_hit)
        return answer
    if wait.kind == names.WAIT_LOOKUP_DEFERRED:
        table.waits.pop(wait.request.request_id, None)
        _count(wait, names.ACTION_HIT_REDUCED, policy, ready_hit)
        return (ready_hit, ready_hit > 0)
    scheduler = _scheduler(table, sys._getframe(1), wait.request.request_id)
    if degrade.fail_waiting(scheduler, cs, wait.request.request_id, message):
        wait.acted = True
        _count(wait, names.ACTION_REQUEST_FAILED, policy, None)
    return answer


def answered(cs: Any, request_id: str) -> None:
    """The lookup answered ``request_id`` with a number: a deferral, if any, ended."""
    waits = cs.__dict__.get(TABLE_ATTR)
    if waits is not None and waits.waits:
        wait = waits.waits.get(request_id)
        if wait is not None and wait.kind in (names.WAIT_LOOKUP_DEFERRED, names.WAIT_TRANSFERS_IN_FLIGHT):
            del waits.waits[request_id]


def admitted_async(cs: Any, request: Any) -> None:
    """The lookup admitted ``request`` with ``load_kv_async``: watch it at the next steps
    (it is parked in a KV wait status once vLLM allocates its blocks)."""
    table = _table(cs)
    if table.stepped:
        table.async_loads[request.request_id] = request


def hit_answered(cs: Any, request: Any, load_async: bool) -> None:
    """The lookup answered ``request`` with a number (a hit, or 0): a deferral, if any,
    ended (:func:`answered`); ``load_async`` (a hit loaded asynchronously): watched
    (:func:`admitted_async`, where the per-step hook is attached)."""
    table = cs.__dict__.get(TABLE_ATTR)
    if table is None:
        return
    if table.waits:
        answered(cs, request.request_id)
    if load_async and table.stepped:
        table.async_loads[request.request_id] = request


# -- async loads (once per schedule(), from build_connector_meta) -----------------------
def observe_step(cs: Any, scheduler_output: Any, frame: Any) -> None:
    """One ``schedule()`` of the scheduler that owns ``cs`` ended (``build_connector_meta``
    with ``scheduler_output``; ``frame`` is that call's, to find vLLM's ``Scheduler``).

    Parks newly admitted async loads, drops ended waits, counts a step without progress
    for every KV wait and acts on each stalled one. Raises ``AssertionError`` only under
    ``strict``."""
    table = cs.__dict__.get(TABLE_ATTR)
    if table is None or not (table.waits or table.async_loads):
        return
    req_status = getattr(cs, "_req_status", None)
    waiting = table.waiting
    statuses = table.statuses
    now = time.monotonic()
    parked: set[str] = set()
    if table.async_loads:
        for rid, request in list(table.async_loads.items()):
            status = request.status
            if status is waiting and (req_status is None or rid in req_status):
                continue
            if statuses is None:
                statuses = table.statuses = kv_wait_statuses(type(status))
            if waiting is None:
                waiting = table.waiting = getattr(type(status), "WAITING", None)
            status = status.name
            if status in statuses:
                del table.async_loads[rid]
                table.waits[rid] = Wait(names.WAIT_LOAD_IN_FLIGHT, request, since=now)
                parked.add(rid)  # the wait begins: its first observation is the next step
            elif status != "WAITING" or not _known(cs, rid):
                del table.async_loads[rid]  # scheduled, finished or preempted: no async wait
    if not table.waits:
        return
    scheduler = None
    busy = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0) > 0
    for rid, wait in list(table.waits.items()):
        request = wait.request
        status = request.status.name
        if wait.kind in (names.WAIT_LOOKUP_DEFERRED, names.WAIT_TRANSFERS_IN_FLIGHT):
            if status != "WAITING" and status != "PREEMPTED" or not _known(cs, rid):
                del table.waits[rid]  # scheduled or finished: the deferral ended
            continue
        if statuses is None or status not in statuses:
            del table.waits[rid]  # promoted (or finished): the wait ended
            continue
        if rid in parked:
            continue
        if scheduler is None:
            scheduler = _scheduler(table, frame, rid)
        reported = rid in (getattr(scheduler, "finished_recving_kv_req_ids", None) or ())
        kind = names.WAIT_LOAD_NOT_PROMOTED if reported else names.WAIT_LOAD_IN_FLIGHT
        _bump("evaluated")
        if kind != wait.kind:
            wait.kind = kind
            wait.progress(now)
            continue
        if kind == names.WAIT_LOAD_NOT_PROMOTED and busy:
            wait.progress(now)  # the engine serves others: the scan reaches it in time
            continue
        wait.stale += 1
        if wait.acted or not wait.exceeded(now):
            continue
        policy = runtime.policy()
        message = _message(wait)
        if policy == names.POLICY_STRICT:
            _count(wait, names.ACTION_RAISED, policy, None)
            raise AssertionError(message)
        wait.acted = True
        if policy == names.POLICY_OBSERVE:
            _count(wait, names.ACTION_CONTINUED, policy, None)
        elif kind == names.WAIT_LOAD_NOT_PROMOTED and _recompute(scheduler, request):
            del table.waits[rid]  # WAITING again, blocks freed: the wait ended
            recompute.mark_recomputed(cs, scheduler, rid)  # and its retry computes, never parks again
            _count(wait, names.ACTION_RECOMPUTED, policy, None)
        elif degrade.fail_waiting(scheduler, cs, rid, message):
            _count(wait, names.ACTION_REQUEST_FAILED, policy, None)


def observe_idle(cs: Any, table: WaitTable, frame: Any) -> bool:
    """One ``schedule()`` of the scheduler that owns ``cs`` (a connector with a lazy store
    walker) scheduled no token; ``frame`` is the caller of ``build_connector_meta``.

    Observes the ``blocks_held_by_stores`` wait (module docstring): the head of the waiting
    queue waits for an admission (``WAITING`` or ``PREEMPTED``, not parked for its KV) and
    the connector has stores pending when the wait begins. Returns True when this step's walker must take no
    new GPU blocks (``guard``, the bound exceeded, until the engine schedules again).
    Raises ``AssertionError`` only under ``strict``."""
    scheduler = table.scheduler
    if scheduler is None:
        scheduler = table.scheduler = _stepping_scheduler(frame)
    waiting = getattr(scheduler, "waiting", None) if scheduler is not None else None
    hold = table.hold
    if not waiting:
        table.hold = None  # nothing waits: no wait
        return False
    if hold is None:
        head = next(iter(waiting))
        # a head parked for its KV (or anything but plain WAITING) has its own wait
        if head.status.name not in _ADMISSION_STATUSES or not cs.has_pending_stores():
            return False  # an idle step the connector's stores play no part in
        table.hold = Wait(names.WAIT_BLOCKS_HELD_BY_STORES, head)
        return False
    if hold.acted:
        # withholding (guard) or counted (observe): until the engine schedules again
        return runtime.policy() == names.POLICY_GUARD
    _bump("evaluated")
    hold.stale += 1
    now = time.monotonic()
    if not hold.exceeded(now):
        return False
    policy = runtime.policy()
    message = _message(hold)
    if policy == names.POLICY_STRICT:
        _count(hold, names.ACTION_RAISED, policy, None)
        raise AssertionError(message)
    hold.acted = True
    if policy == names.POLICY_OBSERVE:
        _count(hold, names.ACTION_CONTINUED, policy, None)
        return False
    _count(hold, names.ACTION_STORES_WITHHELD, policy, None)
    return True


#: statuses of a request the waiting scan tries to allocate blocks for
_ADMISSION_STATUSES = frozenset({"WAITING", "PREEMPTED"})


def _stepping_scheduler(frame: Any) -> Any:
    """vLLM's ``Scheduler`` among ``frame`` and its callers (at most 4 frames up): the first
    ``self`` with ``update_from_output``, ``waiting`` and ``running``; None if none."""
    for _ in range(4):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if callable(getattr(owner, "update_from_output", None)) and hasattr(owner, "waiting") and hasattr(owner, "running"):
            return owner
        frame = frame.f_back
    return None


@functools.lru_cache(maxsize=8)
def lazy_store_switch(cls: type) -> str | None:
    """The attribute that switches a connector scheduler's lazy store walker off, read from
    the installed source of ``cls`` (never guessed from a release): a method that reads the
    GPU pool's ``free_block_queue`` and returns at once when ``self.<attr> <= 0``. On the
    SimpleCPUOffloadConnector (0.21.0-0.34.0) that is ``_prepare_lazy_store_specs``' ``if
    gpu_pool is None or self._target_free <= 0: return [], [], [], None``, and
    ``_target_free`` is 0 in eager mode. None where no method has that shape (no walker:
    the ``blocks_held_by_stores`` wait is not watched). Never raises."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return None
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef):
            continue
        if not any(isinstance(n, ast.Attribute) and n.attr == "free_block_queue" for n in ast.walk(func)):
            continue
        for node in ast.walk(func):
            if not (isinstance(node, ast.If) and len(node.body) == 1 and isinstance(node.body[0], ast.Return)):
                continue
            for cmp in ast.walk(node.test):
                if (isinstance(cmp, ast.Compare) and len(cmp.ops) == 1 and isinstance(cmp.ops[0], ast.LtE)
                        and isinstance(cmp.left, ast.Attribute) and isinstance(cmp.left.value, ast.Name)
                        and cmp.left.value.id == "self" and isinstance(cmp.comparators[0], ast.Constant)
                        and cmp.comparators[0].value == 0):
                    return cmp.left.attr
    return None


def _recompute(scheduler: Any, request: Any) -> bool:
    """vLLM's failed-receive path for a reported load (:func:`kvguard.guards.policy.recompute.recompute_reported`);
    False (the caller fails the request) where the release has none or it raised (counted)."""
    try:
        return recompute.recompute_reported(scheduler, request)
    except Exception as error:
        runtime.guard_error(names.STAGE_REQUEST_FAIL, error)
        return False


def _message(wait: Wait) -> str:
    return (
        f"kvguard wait_bound: request {wait.request.request_id} waited ({wait.kind}) "
        f"{wait.stale} observations and {time.monotonic() - wait.since:.1f} s without progress "
        f"(bound: {_steps} observations and {_seconds:g} s)"
    )


def _count(wait: Wait, action: str, policy: str, ready_hit: int | None) -> None:
    _bump(f"{wait.kind}:{action}")
    if _metrics is not None:
        try:
            _metrics.violation(names.CHECK_WAIT_BOUND, action)
            _metrics.wait_bound_exceeded(wait.kind, action)
        except Exception as error:
            runtime.guard_error(names.STAGE_METRICS, error)
    if _events is not None:
        _events.wait_bound_exceeded(
            **{
                names.KEY_CHECK: names.CHECK_WAIT_BOUND,
                names.KEY_WAIT: wait.kind,
                names.KEY_ACTION: action,
                names.KEY_POLICY: policy,
                names.KEY_REQUEST_ID: wait.request.request_id,
                names.KEY_STALE_OBSERVATIONS: wait.stale,
                names.KEY_STALE_SECONDS: round(time.monotonic() - wait.since, 3),
                names.KEY_READY_HIT_TOKENS: ready_hit,
            }
        )


# -- the per-step hook -------------------------------------------------------------------
_attached: "weakref.WeakSet[Any]" = weakref.WeakSet()


def attach(cs: Any) -> bool:
    """Give connector scheduler ``cs`` an instance-level wrapper of ``build_connector_meta``
    that runs :func:`observe_step` before vLLM's method; True when attached (not when the
    check is off or ``cs`` has its own ``build_connector_meta`` attribute already)."""
    if not _enabled or "build_connector_meta" in cs.__dict__ or not callable(
            getattr(cs, "build_connector_meta", None)):
        return False
    inner = cs.build_connector_meta
    state = cs.__dict__

    def build_connector_meta(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        # the usual step, tested here without a call (each costs about a microsecond cold,
        # issue 31): nothing watched, or only requests vLLM looks up again each step,
        # still WAITING for their blocks and still the connector's
        table = state.get(TABLE_ATTR)
        if table is not None and (table.waits or table.async_loads):
            try:
                waiting = table.waiting
                if table.waits or waiting is None:
                    observe_step(cs, scheduler_output, sys._getframe(1))
                else:
                    req_status = getattr(cs, "_req_status", None)
                    for rid, request in table.async_loads.items():
                        if request.status is not waiting or (req_status is not None and rid not in req_status):
                            observe_step(cs, scheduler_output, sys._getframe(1))
                            break
            except AssertionError:
                raise  # strict
            except Exception as error:
                runtime.guard_error(names.STAGE_ADMISSION, error)
        if table is not None and table.lazy_switch is not None:
            if getattr(scheduler_output, "total_num_scheduled_tokens", 1):
                table.hold = None  # the engine scheduled: progress
            else:
                withhold = False
                try:
                    withhold = observe_idle(cs, table, sys._getframe(1))
                except AssertionError:
                    raise  # strict
                except Exception as error:
                    runtime.guard_error(names.STAGE_ADMISSION, error)
                if withhold:
                    switch = table.lazy_switch
                    saved = getattr(cs, switch)
                    setattr(cs, switch, 0)
                    try:
                        return inner(scheduler_output, *args, **kwargs)
                    finally:
                        setattr(cs, switch, saved)
        return inner(scheduler_output, *args, **kwargs)

    build_connector_meta._kvguard_wait_bound = True  # type: ignore[attr-defined]
    cs.__dict__["build_connector_meta"] = build_connector_meta
    table = _table(cs)
    table.stepped = True
    switch = lazy_store_switch(type(cs))
    if switch is not None and callable(getattr(cs, "has_pending_stores", None)):
        value = getattr(cs, switch, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            table.lazy_switch = switch  # lazy mode on: its walker can hold blocks
    _attached.add(cs)
    return True


def observe_answer(cs: Any, request: Any, answer: Any) -> None:
    """A lookup of a connector scheduler kvguard's admission check does not run in (the
    SimpleCPUOffloadConnector's) answered ``answer`` for ``request``: an answer with
    ``load_kv_async`` is watched (:func:`admitted_async`), a number ends a deferral
    (:func:`answered`). Called by :func:`kvguard.guards.checks.admission.written.lookup_wrapper`."""
    if answer is not None and answer[0] is not None:
        hit_answered(cs, request, bool(answer[1]))


def attach_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``wrapt`` wrapper of such a connector scheduler's ``__init__``: vLLM's constructor,
    then :func:`attach` (an error counts ``stage="admission"``)."""
    result = wrapped(*args, **kwargs)
    try:
        attach(instance)
    except Exception as error:
        runtime.guard_error(names.STAGE_ADMISSION, error)
    return result


def detach_all() -> None:
    """Remove every wrapper :func:`attach` set."""
    for cs in list(_attached):
        attr = cs.__dict__.get("build_connector_meta")
        if getattr(attr, "_kvguard_wait_bound", False):
            del cs.__dict__["build_connector_meta"]
        cs.__dict__.pop(TABLE_ATTR, None)
    _attached.clear()
