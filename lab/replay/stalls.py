"""The stall detector: a request that never finishes, named by what it waits for.

A replay whose requests make no progress for ``STALL_STEPS`` steps stops as stalled
(:mod:`.harness`). :class:`StallWatch` then says, for every request still unfinished,
what state vLLM holds it in and why, from the real scheduler's and connector's state:

- ``status``: the request's ``RequestStatus`` name in vLLM's scheduler (``WAITING``,
  ``WAITING_FOR_REMOTE_KVS``, ``RUNNING``, ``PREEMPTED``, ...);
- ``waiting_steps``: engine steps since the request last made progress (a computed
  token, an output token or a status change);
- ``connector``: the offloading connector's view: ``deferred_lookup`` (its last
  ``get_num_new_matched_tokens`` returned ``None``, "ask again later"), the request's
  in-flight ``transfer_jobs`` in the connector scheduler, and the loads / stores the
  simulated worker still holds for it (``hung`` = never completes);
- ``kind``, derived from the above, first match:

  ``flush_waits_forever``
      vLLM's worker blocks in ``wait(jobs_to_flush)`` on a job that never completes
      (the engine itself hangs);
  ``load_never_completes``
      ``WAITING_FOR_REMOTE_KVS`` with its load job still in flight;
  ``remote_kvs_never_promoted``
      ``WAITING_FOR_REMOTE_KVS``, its load reported done (the request id is in the
      scheduler's ``finished_recving_kv_req_ids``) but vLLM's waiting scan never reaches
      it: an unschedulable request ahead of it ``break``s the scan (vLLM #45388);
  ``remote_kvs_never_reported``
      ``WAITING_FOR_REMOTE_KVS`` with no load in flight and none reported (``finished_recving`` lost);
  ``store_never_completes``
      the lookup is deferred while a store job in the worker never completes: its
      offloaded blocks stay "being written" and the lookup answers "retry later" (#49829);
  ``lookup_deferred``
      the lookup is deferred with no store in flight (HIT_PENDING forever, #49829);
  ``waiting_for_blocks``
      ``WAITING`` / ``PREEMPTED``, the lookup answered: the KV cache manager cannot
      allocate its GPU blocks;
  ``running_without_progress``
      ``RUNNING`` but scheduled no token;
  ``unknown``
      anything else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class _ReqState:
    status: str
    progress: tuple[int, int]
    since_step: int
    deferred: bool = False


@dataclass
class StallWatch:
    """Tracks every live request's state per step, and names the stall.

    Wraps the connector scheduler's ``get_num_new_matched_tokens`` instance attribute
    (over whatever wrapper is already there) to see deferred lookups; :meth:`restore`
    puts the previous attribute back.
    """

    connector_scheduler: Any
    states: dict[str, _ReqState] = field(default_factory=dict)
    _prev: Any = None

    def __post_init__(self) -> None:
        self._prev = self.connector_scheduler.get_num_new_matched_tokens
        self.connector_scheduler.get_num_new_matched_tokens = self._lookup

    def _lookup(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        out = self._prev(request, *args, **kwargs)
        st = self.states.get(request.request_id)
        if st is not None:
            st.deferred = out[0] is None
        return out

    def restore(self) -> None:
        self.connector_scheduler.get_num_new_matched_tokens = self._prev

    def observe(self, step: int, live: dict[str, Any]) -> None:
        """Record ``live`` (request id -> vLLM ``Request``) after step ``step``."""
        for rid in list(self.states):
            if rid not in live:
                del self.states[rid]
        for rid, req in live.items():
            status = req.status.name
            progress = (int(req.num_computed_tokens), len(req.output_token_ids))
            st = self.states.get(rid)
            if st is None:
                self.states[rid] = _ReqState(status, progress, step)
                continue
            if status != st.status or progress != st.progress:
                st.status, st.progress, st.since_step = status, progress, step

    def _connector_view(self, rid: str, worker: Any) -> dict[str, Any]:
        cs = self.connector_scheduler
        view: dict[str, Any] = {"deferred_lookup": self.states[rid].deferred}
        req_status = (getattr(cs, "_req_status", None) or {}).get(rid)
        jobs = getattr(cs, "_jobs", None) or {}
        if req_status is not None:
            ids = sorted(getattr(req_status, "transfer_jobs", ()) or ())
            view["transfer_jobs"] = [
                {"job_id": j, "store": bool(getattr(jobs.get(j), "is_store", False))} for j in ids
            ]
        flight = worker.queue.in_flight(rid) if worker is not None else []
        view["pending_loads"] = [
            {"job_id": j.job_id, "submit_step": j.submit_step, "hung": j.due_step is None}
            for j in flight
            if not j.is_store
        ]
        view["pending_stores"] = [
            {"job_id": j.job_id, "submit_step": j.submit_step, "hung": j.due_step is None}
            for j in flight
            if j.is_store
        ]
        return view

    def findings(
        self, step: int, live: dict[str, Any], worker: Any, hung_flush: list[Any] | None = None,
        scheduler: Any = None
    ) -> list[dict[str, Any]]:
        """One finding per live request: ``{request_id, status, waiting_steps, kind, connector}``.

        ``hung_flush`` are the jobs vLLM's worker waits on forever (``WorkerHang.jobs``).
        Sorted by request id, so the same replay gives the same list.
        """
        self.observe(step, live)
        hung_stores = [
            j for j in (worker.queue.in_flight() if worker is not None else [])
            if j.is_store and j.due_step is None
        ]
        flush_reqs = {j.req_id for j in hung_flush or ()}
        out = []
        for rid in sorted(live):
            st = self.states[rid]
            view = self._connector_view(rid, worker)
            if hung_flush:
                kind = "flush_waits_forever"
            elif st.status == "WAITING_FOR_REMOTE_KVS":
                reported = rid in (getattr(scheduler, "finished_recving_kv_req_ids", None) or ())
                view["load_reported"] = reported
                if view["pending_loads"]:
                    kind = "load_never_completes"
                elif reported:
                    kind = "remote_kvs_never_promoted"
                else:
                    kind = "remote_kvs_never_reported"
            elif st.deferred:
                kind = "store_never_completes" if hung_stores else "lookup_deferred"
            elif st.status in ("WAITING", "PREEMPTED"):
                kind = "waiting_for_blocks"
            elif st.status == "RUNNING":
                kind = "running_without_progress"
            else:
                kind = "unknown"
            finding = {
                "request_id": rid,
                "status": st.status,
                "waiting_steps": step - st.since_step,
                "kind": kind,
                "connector": view,
            }
            if kind == "store_never_completes":
                finding["blocked_by"] = [
                    {"job_id": j.job_id, "request_id": j.req_id} for j in hung_stores
                ]
            if kind == "flush_waits_forever":
                finding["blocked_by"] = [
                    {"job_id": j.job_id, "request_id": j.req_id} for j in hung_flush or ()
                ]
                finding["flushing"] = rid in flush_reqs
            out.append(finding)
        return out
