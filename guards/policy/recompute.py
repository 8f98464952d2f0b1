"""Recompute a parked request whose load was reported but never promoted (action ``recomputed``).

The wait bound's ``load_not_promoted`` wait (:mod:`kvguard.guards.checks.wait_bound`): the
worker reported a request's async load (``finished_recving``), the request sits in
``WAITING_FOR_REMOTE_KVS`` holding its GPU blocks, and vLLM's waiting scan never reaches it
to promote it (vllm#45388: the scan ``break``s at a head that cannot allocate, and that head
waits for the very blocks the parked request holds). Failing the request ends the wait at
the price of the request. vLLM's own code offers a cheaper way on every full release
0.21.0-0.34.0: its **failed-receive path**. A request whose load failed is listed in
``Scheduler.failed_recving_kv_req_ids`` with ``num_computed_tokens`` set to what is valid;
when its promotion runs, ``_update_waiting_for_remote_kv`` frees its blocks when nothing is
valid ("No valid computed tokens, release allocated blocks. There may be a local cache hit
on retry."), and the promotion sets it back to ``WAITING`` (``PREEMPTED`` after a
preemption): the request is scheduled again from scratch, with a fresh lookup, and costs a
prefill instead of the request.

:func:`recompute_reported` runs exactly that path, now, instead of when the scan would have
reached the request: it marks the request a failed receive with nothing valid
(``failed_recving_kv_req_ids.add``, ``num_computed_tokens = 0``, as vLLM's
``_update_requests_with_invalid_blocks`` does for a load whose first block is invalid) and
calls the release's own promotion of a blocked waiting request; then it takes the request
out of the admission bookkeeping the way the release's own preemption and free do
(:func:`releases`). The freed blocks let the head allocate; the parked request goes on when
the scan reaches it.

The promotion is bound by structure, never by release number (:func:`promoter`): the one
method of the scheduler's class that takes ``(self, request)``, names
``WAITING_FOR_REMOTE_KVS`` and ``finished_recving_kv_req_ids`` and calls
``self._update_waiting_for_remote_kv(request)``, whose source in turn frees the request's
blocks for a failed receive (``failed_recving_kv_req_ids`` and ``kv_cache_manager.free(request)``).
On 0.21.0-0.29.0 that is ``_try_promote_blocked_waiting_request``, on 0.33.0-0.34.0
``_handle_blocked_waiting_request`` (0.34.0 also re-reserves the parked request's blocks
there, ``_reserve_parked``, exactly as for any promotion). A release without such a method,
or a request the scheduler does not list as reported, is not recomputed: the caller then
fails it alone (``request_failed``).

A recomputed request is computed, never loaded again in its retry
-----------------------------------------------------------------

The retry is looked up afresh, and the CPU tier usually still holds the hit it was
recomputed from: answered as vLLM answers it, the retry parks again with a fresh load,
holding the same blocks, behind the same head, and the wait it left begins again; a
bound that ends a wait into the same wait ends nothing (measured: fuzz seed 0 on 0.21.0,
example 140: recomputed every 32 steps, two requests never finished). So "recomputed"
means what it says: :func:`mark_recomputed` lists the request on its connector
scheduler (:data:`RECOMPUTE_ATTR`), and every lookup that would give it a hit while it is
still waiting answers ``(0, False)`` instead (:func:`without_load`, called from both
connectors' admission checks). That is the answer of any reduced hit (safe for the same
reasons: the connector's own ``update_state_after_alloc`` takes no load and releases its
pin); the request is admitted ``RUNNING`` with its local prefix-cache hit and computes
the rest, so it makes progress in the step it is admitted, and once admitted (or
finished) it leaves the list: a later preemption looks up normally. The same holds after
the exclusive-block refusal (:func:`recompute_unloaded`): its retry, loading nothing, is
outside that check's scope by construction.

Why it is safe: the load was reported, so the worker no longer writes the blocks; the
blocks were allocated with caching delayed until the promotion (``delay_cache_blocks``), so
freeing them publishes nothing; the connector forgets the request's old block ids at its
next lookup (both connectors reset the request's per-lookup state there, as after a
preemption). Proven in the replay by the KV-content oracle and the generated tokens on the
waiting-scan traces (``tests/vllm/test_wait_bound.py``) and by the differential fuzz.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Callable

__all__ = ["promoter", "recompute_reported", "recompute_unloaded", "can_recompute", "releases", "reset",
           "RECOMPUTE_ATTR", "mark_recomputed", "without_load", "snapshot"]

_lock = threading.Lock()
#: scheduler class -> the name of its promotion method, or None (none found)
_promoters: dict[type, str | None] = {}


def reset() -> None:
    """Forget the promotion methods found and the admissions waiting to be recomputed (tests)."""
    with _lock:
        _promoters.clear()
        _releases.clear()
        _unloaded.clear()
        _stats.clear()


def snapshot() -> dict[str, int]:
    """In-process counts: ``marked`` (requests recomputed, their next admissions without a
    load) and ``loads_refused`` (lookups of such a request answered ``(0, False)``)."""
    with _lock:
        return dict(_stats)


def _source(fn: Any) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def _find(cls: type) -> str | None:
    update = getattr(cls, "_update_waiting_for_remote_kv", None)
    body = _source(update)
    if not ("failed_recving_kv_req_ids" in body and "kv_cache_manager.free(request)" in body):
        return None
    found = []
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            continue
        if params != ["self", "request"] or name == "_update_waiting_for_remote_kv":
            continue
        src = _source(fn)
        if ("WAITING_FOR_REMOTE_KVS" in src and "finished_recving_kv_req_ids" in src
                and "self._update_waiting_for_remote_kv(request)" in src):
            found.append(name)
    return found[0] if len(found) == 1 else None


def promoter(scheduler: Any) -> Callable[[Any], Any] | None:
    """The bound promotion method of ``scheduler`` (module doc), or None when its class
    has none or more than one candidate. Found once per scheduler class."""
    cls = type(scheduler)
    with _lock:
        if cls not in _promoters:
            _promoters[cls] = _find(cls)
        name = _promoters[cls]
    return getattr(scheduler, name) if name is not None else None


def recompute_reported(scheduler: Any, request: Any) -> bool:
    """Send ``request`` (a vLLM ``Request`` in ``WAITING_FOR_REMOTE_KVS`` whose load the
    scheduler lists in ``finished_recving_kv_req_ids``) back to be computed from scratch
    through vLLM's failed-receive path (module doc): its GPU blocks are freed now and it is
    ``WAITING`` (or ``PREEMPTED``) again. True when done; False, with nothing changed, when
    the release has no such path or the request is not a reported load. Exceptions from
    vLLM's own promotion propagate (the caller counts them and fails the request instead).
    """
    if scheduler is None:
        return False
    promote = promoter(scheduler)
    finished = getattr(scheduler, "finished_recving_kv_req_ids", None)
    failed = getattr(scheduler, "failed_recving_kv_req_ids", None)
    rid = request.request_id
    if promote is None or finished is None or failed is None or rid not in finished:
        return False
    if request.status.name != "WAITING_FOR_REMOTE_KVS":
        return False
    failed.add(rid)
    request.num_computed_tokens = 0
    promote(request)
    for release in releases(scheduler):
        release(request)
    return True


def _release_calls(fn: Any, unreserve: bool) -> list[tuple[str, str | None]]:
    """The statements of ``fn`` (a scheduler method) that take a request out of the
    scheduler's admission bookkeeping: ``self.<attr>.discard(request)`` -> ``(attr, "discard")``
    and, with ``unreserve``, ``self.<method>(request)`` of a method named ``_unreserve*`` ->
    ``(method, None)``."""
    import ast
    import textwrap

    src = _source(fn)
    if not src:
        return []
    try:
        tree = ast.parse(textwrap.dedent(src))
    except SyntaxError:
        return []
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
            continue
        call = node.value
        if len(call.args) != 1 or not (isinstance(call.args[0], ast.Name) and call.args[0].id == "request"):
            continue
        f = call.func
        if (isinstance(f, ast.Attribute) and f.attr == "discard" and isinstance(f.value, ast.Attribute)
                and isinstance(f.value.value, ast.Name) and f.value.value.id == "self"):
            out.append((f.value.attr, "discard"))
        elif (unreserve and isinstance(f, ast.Attribute) and f.attr.startswith("_unreserve")
              and isinstance(f.value, ast.Name) and f.value.id == "self"):
            out.append((f.attr, None))
    return out


#: scheduler class -> its admission-bookkeeping releases (:func:`releases`)
_releases: dict[type, list[tuple[str, str | None]]] = {}


def releases(scheduler: Any) -> list[Callable[[Any], Any]]:
    """What the release does to a request's admission bookkeeping when the request gives
    its blocks back, read from its own code: every ``self.<set>.discard(request)`` of
    ``_preempt_request`` (a preempted request is no in-flight prefill any more:
    ``_inflight_prefills`` on 0.25.1+) and of ``_free_request``, and every
    ``self._unreserve*(request)`` of ``_free_request`` (0.34.0's parked-load reservation,
    ``_unreserve_parked``). A recomputed request is in the position of a preempted one (no
    blocks, back in the queue, computed from scratch): without these releases 0.25.1+'s
    admission cap keeps counting the blocks it would need as reserved, and the head it
    gave its blocks to still cannot be admitted (measured: ``stall-remote-kvs-hol-029.jsonl``
    on 0.29.0 stalled again after the recompute). Bound methods, in source order."""
    cls = type(scheduler)
    with _lock:
        if cls not in _releases:
            found: list[tuple[str, str | None]] = []
            for name, unreserve in (("_preempt_request", False), ("_free_request", True)):
                for item in _release_calls(getattr(cls, name, None), unreserve):
                    if item not in found:
                        found.append(item)
            _releases[cls] = found
        found = _releases[cls]
    out = []
    for attr, method in found:
        target = getattr(scheduler, attr, None)
        if method is None:
            if callable(target):
                out.append(target)
        elif target is not None and callable(getattr(target, method, None)):
            out.append(getattr(target, method))
    return out


#: counts for :func:`snapshot`
_stats: dict[str, int] = {}

#: attribute of a connector scheduler (its ``__dict__``): ids of the requests kvguard
#: recomputed that have not been admitted again (:func:`without_load`)
RECOMPUTE_ATTR = "_kvguard_recompute_ids"


def mark_recomputed(cs: Any, scheduler: Any, request_id: str) -> None:
    """List ``request_id`` on connector scheduler ``cs``: its lookups answer no load until it
    is admitted (module doc). The list is pruned at the end of every ``schedule()`` of
    ``scheduler`` (vLLM's ``Scheduler``): an id whose request is no longer ``WAITING`` /
    ``PREEMPTED`` (admitted, finished, aborted) leaves it."""
    ids = cs.__dict__.get(RECOMPUTE_ATTR)
    if ids is None:
        ids = cs.__dict__[RECOMPUTE_ATTR] = set()
    ids.add(request_id)
    _wrap_build_connector_meta(cs, scheduler)
    with _lock:
        _stats["marked"] = _stats.get("marked", 0) + 1


def without_load(cs: Any, request: Any, answer: Any) -> Any:
    """The lookup answer for ``request`` on connector scheduler ``cs``: ``(0, False)`` when
    ``answer`` (vLLM's ``(num_external_tokens | None, load_kv_async)``) is a hit and kvguard
    recomputed the request (:func:`mark_recomputed`), else ``answer`` itself. O(1); the
    callers test ``cs.__dict__.get(RECOMPUTE_ATTR)`` first, so an engine that never
    recomputed pays one dict read per lookup."""
    ids = cs.__dict__.get(RECOMPUTE_ATTR)
    if ids and answer is not None and answer[0] and request.request_id in ids:
        with _lock:
            _stats["loads_refused"] = _stats.get("loads_refused", 0) + 1
        return (0, False)
    return answer


def _prune(cs: Any, scheduler: Any) -> None:
    ids = cs.__dict__.get(RECOMPUTE_ATTR)
    if not ids:
        return
    requests = getattr(scheduler, "requests", None) or {}
    for rid in list(ids):
        request = requests.get(rid)
        if request is None or request.is_finished() or request.status.name not in ("WAITING", "PREEMPTED"):
            ids.discard(rid)


#: id(scheduler) -> {request_id: callback(action)}: admissions to recompute at the end of
#: the ``schedule()`` that admitted them (:func:`recompute_unloaded`)
_unloaded: dict[int, dict[str, Callable[[str], None]]] = {}


def can_recompute(scheduler: Any) -> bool:
    """Whether ``scheduler`` offers the failed-receive path :func:`recompute_reported` takes
    (its promotion method found by structure, and both receive sets)."""
    return (scheduler is not None and promoter(scheduler) is not None
            and isinstance(getattr(scheduler, "finished_recving_kv_req_ids", None), set)
            and isinstance(getattr(scheduler, "failed_recving_kv_req_ids", None), set))


def recompute_unloaded(scheduler: Any, connector_scheduler: Any, request: Any,
                       done: Callable[[str], None]) -> bool:
    """Recompute, instead of failing, a request admitted with a load that kvguard refused
    before it was issued (the exclusive-block check: the connector was told the request
    loads nothing, :mod:`kvguard.guards.checks.admission.exclusive`).

    vLLM goes on with the admission it began: an asynchronous load parks the request in
    ``WAITING_FOR_REMOTE_KVS`` holding the blocks just allocated (``delay_cache_blocks``:
    none of them published), and it would wait for a load that no worker will report. At
    the end of that ``schedule()`` (the connector scheduler's ``build_connector_meta``,
    wrapped once), kvguard lists it as reported (``finished_recving_kv_req_ids``) and runs
    :func:`recompute_reported`: vLLM's failed-receive path with nothing valid frees its
    blocks and makes it ``WAITING`` again, to be looked up and allocated afresh at a later
    step. Its KV is never read from the refused blocks.

    ``done(action)`` is called then with what happened: ``recomputed``; ``request_failed``
    where the request was not parked as expected or vLLM's path failed (it is then failed
    alone, :func:`kvguard.guards.policy.degrade.fail_unloaded`); ``raised`` where vLLM
    scheduled it for compute in that very step (a synchronous load: the forward would run
    on the refused blocks, so the engine dies with ``AssertionError``, a dead engine being
    better than wrong KV). Returns False, with nothing registered, where the release offers
    no failed-receive path (:func:`can_recompute`): the caller fails the request itself.
    """
    if connector_scheduler is None or not can_recompute(scheduler):
        return False
    _wrap_build_connector_meta(connector_scheduler, scheduler)
    with _lock:
        _unloaded.setdefault(id(scheduler), {})[request.request_id] = done
    return True


def _wrap_build_connector_meta(cs: Any, scheduler: Any) -> None:
    if getattr(cs, "_kvguard_recompute_wrapped", False):
        return
    orig = cs.build_connector_meta

    def build_connector_meta(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if cs.__dict__.get(RECOMPUTE_ATTR):
            _prune(cs, scheduler)
        with _lock:
            pending = _unloaded.pop(id(scheduler), {})
        if pending:
            _recompute_admitted(scheduler, cs, scheduler_output, pending)
        return orig(scheduler_output, *args, **kwargs)

    cs.build_connector_meta = build_connector_meta
    cs._kvguard_recompute_wrapped = True


def _recompute_admitted(scheduler: Any, cs: Any, scheduler_output: Any,
                        pending: dict[str, Callable[[str], None]]) -> None:
    from kvguard.guards import names
    from kvguard.guards.policy import degrade
    from kvguard.guards.telemetry import counts

    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    for rid, done in pending.items():
        request = scheduler.requests.get(rid)
        if request is None or request.is_finished():
            continue
        if rid in scheduled:
            done(names.ACTION_RAISED)
            raise AssertionError(f"kvguard: request {rid} was refused its load and scheduled for compute "
                                 "in the same step (synchronous load)")
        ok = False
        if request.status.name == "WAITING_FOR_REMOTE_KVS" and rid not in scheduler.finished_recving_kv_req_ids:
            scheduler.finished_recving_kv_req_ids.add(rid)
            try:
                ok = recompute_reported(scheduler, request)
            except Exception as error:  # vLLM's path failed: fail the request alone instead
                counts.guard_error(names.STAGE_REQUEST_FAIL, error)
            if not ok:
                scheduler.finished_recving_kv_req_ids.discard(rid)
                scheduler.failed_recving_kv_req_ids.discard(rid)
        if ok:
            mark_recomputed(cs, scheduler, rid)
            done(names.ACTION_RECOMPUTED)
        elif degrade.fail_unloaded(scheduler, cs, rid, f"kvguard: request {rid} could not be recomputed"):
            done(names.ACTION_REQUEST_FAILED)
        else:
            done(names.ACTION_RAISED)
            raise AssertionError(f"kvguard: request {rid} could be neither recomputed nor failed")
