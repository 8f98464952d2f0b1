"""Fail one request instead of the engine (action ``request_failed``).

When a request-scoped assert of the offload scheduler fails under ``guard`` (an assert
of ``update_state_after_alloc`` that runs before the method issues the request's load,
e.g. the ``num_locally_computed_tokens`` bound of vLLM #43884 / #50454 / #52807;
:mod:`kvguard.guards.hooking.sites` marks them), :func:`kvguard.guards.checks.asserts.check` decides
``request_failed`` and calls :func:`register_failure`; the rewritten method then
returns early (:class:`kvguard.guards.policy.runtime.RequestFailed`), so its load job is never
built: ``prepare_load`` did not run, nothing was added to the connector's load jobs.

What this module does with the request, modelled on vLLM's own failure path
(``kv_load_failure_policy="fail"`` in ``Scheduler.update_from_output``: read on 0.25.1 and
0.33.0, it calls ``finish_requests(ids, RequestStatus.FINISHED_ERROR)`` and appends an
``EngineCoreOutput(request_id, new_token_ids=[], finish_reason=..., events=...,
trace_headers=...)`` per request, so the client gets an error instead of waiting):

1. binding: the ``Scheduler`` is found by walking up the failing frame's callers to the
   first ``self`` that has ``finish_requests``, ``update_from_output`` and a
   ``requests`` mapping holding the request id (the caller of
   ``connector.update_state_after_alloc`` inside ``Scheduler.schedule``). No binding,
   no degrade: the assert is re-raised, as vLLM would.
2. never computed: the request was given ``load_kv_async`` by the offload lookup
   (``bool(num_hit_tokens)``), so vLLM parks it in ``WAITING_FOR_REMOTE_KVS`` and does
   not compute it until its load finishes, which never comes. As a safety net, the
   connector scheduler's ``build_connector_meta`` (end of ``schedule()``) raises the
   original failure if a failed request is scheduled for compute anyway (0.33's
   ``sync_load``): a dead engine is better than wrong KV.
3. finished with its blocks freed: before the next ``update_from_output`` the request
   is finished with ``FINISHED_ERROR`` through the real ``finish_requests`` (bound by
   signature). vLLM delays freeing the blocks of a ``WAITING_FOR_REMOTE_KVS`` request
   until its transfer reports back; no transfer was issued, so its status is first set
   back to ``WAITING`` and the blocks are freed at once.
4. the client is told: after ``update_from_output`` an ``EngineCoreOutput`` with the
   request's finish reason (``error``) is appended for its client, as vLLM's own path
   does.

vLLM's recompute path (``_update_requests_with_invalid_blocks``) is not used: on 0.25.1
and 0.33.0 it unpacks ``(req_block_ids,) = kv_cache_manager.get_block_ids(req_id)``, one
KV cache group, so it cannot serve the hybrid models these asserts fire on.
"""

from __future__ import annotations

import inspect
import threading
from types import FrameType
from typing import Any

from kvguard.guards import names
from kvguard.guards.telemetry import counts

__all__ = ["register_failure", "fail_waiting", "fail_unloaded", "find_scheduler", "method_returned", "failed_requests", "reset"]

#: frames walked up from the failing method to find the Scheduler (schedule() is 2 up)
_MAX_HOPS = 8

_lock = threading.Lock()
#: id(scheduler) -> {request_id: error} waiting to be finished
_pending: dict[int, dict[str, str]] = {}
#: request ids failed by :func:`fail_waiting`: their load may still be in flight, so
#: their status is left as it is (vLLM's ``finish_requests`` then delays freeing their
#: blocks until the transfer reports back, as for a client's abort)
_keep_status: set[str] = set()
#: every request failed in this process (request id -> error), for reports
_failed: dict[str, str] = {}


def failed_requests() -> dict[str, str]:
    """Request id -> error text of every request kvguard failed since :func:`reset`."""
    return dict(_failed)


def reset() -> None:
    """Forget failed requests (tests, replay)."""
    with _lock:
        _pending.clear()
        _failed.clear()
        _keep_status.clear()


def fail_waiting(scheduler: Any, connector_scheduler: Any, request_id: str, error: str) -> bool:
    """Fail a request that is still waiting (never scheduled for compute since it began to
    wait) alone: at the next ``update_from_output`` of ``scheduler`` it is finished with
    ``FINISHED_ERROR`` through vLLM's own ``finish_requests`` (its status untouched, so a
    ``WAITING_FOR_REMOTE_KVS`` request whose load is still in flight keeps its blocks until
    the worker reports the transfer, exactly as when a client aborts it) and its client
    gets an output with the ``error`` finish reason. Used by the wait bound
    (:mod:`kvguard.guards.checks.wait_bound`). Returns False (nothing done) when either scheduler
    is None; never raises.
    """
    return _register(scheduler, connector_scheduler, request_id, error, keep_status=True)


def fail_unloaded(scheduler: Any, connector_scheduler: Any, request_id: str, error: str) -> bool:
    """Fail a request whose load was never issued alone, as for a failed request-scoped
    assert (module doc, steps 2-4: its status set back to ``WAITING`` and its blocks freed
    at once, ``FINISHED_ERROR``, its client told). Used by the exclusive-block check
    (:mod:`kvguard.guards.checks.admission.exclusive`). False when either scheduler is None
    or kvguard failed (counted); never raises."""
    return _register(scheduler, connector_scheduler, request_id, error, keep_status=False)


def _register(scheduler: Any, connector_scheduler: Any, request_id: str, error: str, keep_status: bool) -> bool:
    """Queue ``request_id`` of ``scheduler`` to be finished with ``FINISHED_ERROR`` at its next
    ``update_from_output`` (wrapping it and ``connector_scheduler.build_connector_meta`` once);
    False when either scheduler is None or kvguard failed (counted). Never raises."""
    try:
        if scheduler is None or connector_scheduler is None:
            return False
        _wrap_update_from_output(scheduler)
        _wrap_build_connector_meta(connector_scheduler, scheduler)
        with _lock:
            _pending.setdefault(id(scheduler), {})[request_id] = error
            _failed[request_id] = error
            if keep_status:
                _keep_status.add(request_id)
        return True
    except Exception as exc:
        counts.guard_error(names.STAGE_REQUEST_FAIL, exc)
        return False


def find_scheduler(frame: FrameType | None, request_id: str) -> Any:
    """The vLLM ``Scheduler`` among ``frame`` and its callers (at most :data:`_MAX_HOPS`
    frames up): the first ``self`` with ``finish_requests``, ``update_from_output`` and a
    ``requests`` dict holding ``request_id``; None when there is none."""
    for _ in range(_MAX_HOPS):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        requests = getattr(owner, "requests", None)
        if (
            callable(getattr(owner, "finish_requests", None))
            and callable(getattr(owner, "update_from_output", None))
            and isinstance(requests, dict)
            and request_id in requests
        ):
            return owner
        frame = frame.f_back
    return None


def register_failure(request_id: str, error: str, site_id: str, frame: FrameType) -> bool:
    """Bind a failed request-scoped assert (in ``frame``) to its request and scheduler.

    Returns True when the request will be failed alone (the caller then raises
    :class:`~kvguard.guards.policy.runtime.RequestFailed`), False when it cannot be tied to one
    request of one scheduler (the caller re-raises vLLM's AssertionError). Never raises.
    """
    try:
        scheduler = find_scheduler(frame.f_back, request_id)
        connector_scheduler = frame.f_locals.get("self")
    except Exception as exc:
        counts.guard_error(names.STAGE_REQUEST_FAIL, exc)
        return False
    return _register(scheduler, connector_scheduler, request_id, error, keep_status=False)


def method_returned(request_id: str | None) -> None:
    """The rewritten method returned early for ``request_id`` (nothing to do: the load
    was never built); kept as the hook where the early return is observed."""
    return None


def _pending_for(scheduler: Any) -> dict[str, str]:
    with _lock:
        return dict(_pending.get(id(scheduler), {}))


def _wrap_build_connector_meta(cs: Any, scheduler: Any) -> None:
    if getattr(cs, "_kvguard_meta_wrapped", False):
        return
    orig = cs.build_connector_meta

    def build_connector_meta(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        pending = _pending_for(scheduler)
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        for rid, error in pending.items():
            if rid in scheduled and rid in _keep_status:
                # a wait the wait bound ended has ended by itself first (async scheduling:
                # this schedule() ran before the failing update_from_output): let it run
                with _lock:
                    _pending.get(id(scheduler), {}).pop(rid, None)
                    _failed.pop(rid, None)
                    _keep_status.discard(rid)
                continue
            if rid in scheduled:
                # vLLM would compute this request on KV that was never loaded: refuse.
                raise AssertionError(f"{error}; scheduled for compute before it was failed")
        return orig(scheduler_output, *args, **kwargs)

    cs.build_connector_meta = build_connector_meta
    cs._kvguard_meta_wrapped = True


def _wrap_update_from_output(scheduler: Any) -> None:
    if getattr(scheduler, "_kvguard_uo_wrapped", False):
        return
    orig = scheduler.update_from_output

    def update_from_output(scheduler_output: Any, model_runner_output: Any, *args: Any, **kwargs: Any):
        failed = _finish_pending(scheduler)
        outputs = orig(scheduler_output, model_runner_output, *args, **kwargs)
        if failed:
            _emit_outputs(outputs, failed)
        return outputs

    scheduler.update_from_output = update_from_output
    scheduler._kvguard_uo_wrapped = True


def _finish_pending(scheduler: Any) -> list[Any]:
    """Finish this scheduler's failed requests with FINISHED_ERROR; returns them."""
    with _lock:
        pending = _pending.pop(id(scheduler), {})
    if not pending:
        return []
    finished: list[Any] = []
    try:
        from vllm.v1.request import RequestStatus

        finish = scheduler.finish_requests
        params = list(inspect.signature(finish).parameters)
        recving = getattr(scheduler, "finished_recving_kv_req_ids", set())
        for rid in pending:
            request = scheduler.requests.get(rid)
            if request is None or request.is_finished():
                continue
            if rid in _keep_status:
                _keep_status.discard(rid)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and rid not in recving:
                # no load was issued for it (the method stopped before prepare_load), so
                # no transfer can still write its blocks: free them now, not "on recv"
                request.status = RequestStatus.WAITING
            bound = inspect.signature(finish).bind(
                **{params[0]: rid, params[1]: RequestStatus.FINISHED_ERROR}
            )
            finish(*bound.args, **bound.kwargs)
            finished.append(request)
    except Exception as exc:
        counts.guard_error(names.STAGE_REQUEST_FAIL, exc)
    return finished


def _emit_outputs(outputs: Any, requests: list[Any]) -> None:
    """Append one ``EngineCoreOutput`` per failed request, as vLLM's load-failure path."""
    try:
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

        fields = set(inspect.signature(EngineCoreOutput).parameters)
        for request in requests:
            values = {
                "request_id": request.request_id,
                "new_token_ids": [],
                "finish_reason": request.get_finished_reason(),
                "events": request.take_events() if hasattr(request, "take_events") else None,
                "trace_headers": getattr(request, "trace_headers", None),
            }
            out = EngineCoreOutput(**{k: v for k, v in values.items() if k in fields})
            client = getattr(request, "client_index", 0)
            eco = outputs.get(client)
            if eco is None:
                outputs[client] = eco = EngineCoreOutputs()
            eco.outputs.append(out)
    except Exception as exc:
        counts.guard_error(names.STAGE_REQUEST_FAIL, exc)
