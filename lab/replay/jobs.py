"""The worker model of a replay: when each transfer job completes, and whether it succeeds.

vLLM's offloading connector worker hands every load and store job to an
``OffloadingWorker`` (0.23+: ``submit_load`` / ``submit_store``; 0.21: a handler's
``transfer_async``) and later collects ``TransferResult(job_id, success)`` from its
``get_finished()``. A real CPU<->GPU copy takes a number of engine steps that depends on
its size and the PCIe traffic, jobs of one request are not ordered against jobs of
another, and a copy can fail. This module is that timing, with no vLLM import (the
replay's :mod:`.worker` and the fuzzer share it):

- :class:`WorkerModel`: the parameters (a trace header's ``"worker"`` object, see
  :mod:`.trace`), all in engine steps or job ordinals;
- :class:`JobQueue`: the jobs in flight, each with the step it is due (drawn from
  ``WorkerModel.seed`` in submission order) and its success flag (drawn per transfer: the
  request and its count of transfers, see :meth:`JobQueue._failure_draw`).

Units: a latency is a number of engine steps (``schedule()`` + worker +
``update_from_output()`` = one step). Latency 0 means the job is reported in the
``get_finished()`` of the step it was submitted in. A job ordinal is the 0-based index of
the job among the jobs of its direction (loads, or stores) in the order the worker
received them (vLLM's job ids mix both directions and shift when the scheduler changes,
ordinals do not).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any


class WorkerModelError(ValueError):
    """A ``"worker"`` object that does not follow the format (message names the field)."""


@dataclass(frozen=True)
class Latency:
    """Completion latency in engine steps: uniform on ``[min, max]`` (fixed when equal)."""

    min: int = 0
    max: int = 0

    @classmethod
    def from_json(cls, obj: Any, name: str) -> "Latency":
        """``N`` (fixed) or ``{"min": A, "max": B}``. Raises :class:`WorkerModelError`."""
        if isinstance(obj, bool):
            raise WorkerModelError(f"worker.{name} must be an int or {{min, max}}")
        if isinstance(obj, int):
            obj = {"min": obj, "max": obj}
        if not isinstance(obj, dict) or set(obj) - {"min", "max"}:
            raise WorkerModelError(f"worker.{name} must be an int or {{min, max}}")
        lo, hi = obj.get("min", 0), obj.get("max", obj.get("min", 0))
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)):
            raise WorkerModelError(f"worker.{name}: min and max must be ints")
        if lo < 0 or hi < lo:
            raise WorkerModelError(f"worker.{name}: need 0 <= min <= max, got {lo}, {hi}")
        return cls(lo, hi)

    def to_json(self) -> Any:
        return self.min if self.min == self.max else {"min": self.min, "max": self.max}


@dataclass(frozen=True)
class Faults:
    """Which jobs of one direction fail or never complete.

    ``rate``: probability that a job fails (``TransferResult.success=False``), drawn per
    job; ``jobs``: job ordinals that always fail; ``hang_jobs``: job ordinals whose
    completion is never reported (a lost completion: the job stays in flight forever).
    """

    rate: float = 0.0
    jobs: frozenset[int] = frozenset()
    hang_jobs: frozenset[int] = frozenset()

    @property
    def active(self) -> bool:
        return bool(self.rate or self.jobs or self.hang_jobs)


def _ordinals(obj: Any, name: str) -> frozenset[int]:
    if not isinstance(obj, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in obj
    ):
        raise WorkerModelError(f"worker.{name} must be a list of non-negative job ordinals")
    return frozenset(obj)


def _rate(obj: Any, name: str) -> float:
    if not isinstance(obj, dict) or set(obj) != {"rate"}:
        raise WorkerModelError(f"worker.{name} must be {{\"rate\": R}}")
    rate = obj["rate"]
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
        raise WorkerModelError(f"worker.{name}.rate must be a number in [0, 1]")
    return float(rate)


#: The keys of a trace header's ``"worker"`` object.
WORKER_FIELDS = (
    "load_latency_steps",
    "store_latency_steps",
    "seed",
    "fail_loads",
    "fail_stores",
    "fail_load_jobs",
    "fail_store_jobs",
    "hang_load_jobs",
    "hang_store_jobs",
)


@dataclass(frozen=True)
class WorkerModel:
    """How the simulated worker completes transfer jobs (all fields optional).

    The default (every field absent) is the historical replay worker: every job
    completes, successfully, in the step it is submitted. ``seed`` seeds the latency
    and failure draws; the same model and the same submission order give the same
    completions, step for step.
    """

    load_latency: Latency = Latency()
    store_latency: Latency = Latency()
    load_faults: Faults = Faults()
    store_faults: Faults = Faults()
    seed: int = 0

    @property
    def is_default(self) -> bool:
        return self == WorkerModel()

    @classmethod
    def from_json(cls, obj: Any) -> "WorkerModel":
        """Parse a header's ``"worker"`` object. Raises :class:`WorkerModelError`."""
        if obj is None:
            return cls()
        if not isinstance(obj, dict):
            raise WorkerModelError("worker must be an object")
        unknown = sorted(set(obj) - set(WORKER_FIELDS))
        if unknown:
            raise WorkerModelError(f"worker: unknown fields {unknown} (known: {list(WORKER_FIELDS)})")
        seed = obj.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise WorkerModelError("worker.seed must be an int")

        def faults(kind: str) -> Faults:
            rate = _rate(obj[f"fail_{kind}s"], f"fail_{kind}s") if f"fail_{kind}s" in obj else 0.0
            return Faults(
                rate=rate,
                jobs=_ordinals(obj.get(f"fail_{kind}_jobs", []), f"fail_{kind}_jobs"),
                hang_jobs=_ordinals(obj.get(f"hang_{kind}_jobs", []), f"hang_{kind}_jobs"),
            )

        return cls(
            load_latency=Latency.from_json(obj.get("load_latency_steps", 0), "load_latency_steps"),
            store_latency=Latency.from_json(obj.get("store_latency_steps", 0), "store_latency_steps"),
            load_faults=faults("load"),
            store_faults=faults("store"),
            seed=seed,
        )

    def to_json(self) -> dict[str, Any]:
        """The ``"worker"`` object (only the fields that differ from the default)."""
        out: dict[str, Any] = {}
        if self.load_latency != Latency():
            out["load_latency_steps"] = self.load_latency.to_json()
        if self.store_latency != Latency():
            out["store_latency_steps"] = self.store_latency.to_json()
        for kind, f in (("load", self.load_faults), ("store", self.store_faults)):
            if f.rate:
                out[f"fail_{kind}s"] = {"rate": f.rate}
            if f.jobs:
                out[f"fail_{kind}_jobs"] = sorted(f.jobs)
            if f.hang_jobs:
                out[f"hang_{kind}_jobs"] = sorted(f.hang_jobs)
        if self.seed:
            out["seed"] = self.seed
        return out


@dataclass
class PendingJob:
    """One transfer job in flight: vLLM's job id, direction, and its drawn fate."""

    job_id: int
    is_store: bool
    #: 0-based index among the jobs of this direction, in submission order
    ordinal: int
    submit_step: int
    #: the step whose ``get_finished()`` reports it; ``None``: never (a hung job)
    due_step: int | None
    success: bool
    #: the request id, when the submitter knows it (vLLM's job carries it)
    req_id: str | None = None
    #: the step it was reported in (set by :meth:`JobQueue.finished`)
    done_step: int | None = None


@dataclass
class JobQueue:
    """The jobs in flight and their completion order, deterministic from ``model.seed``.

    Latency is drawn from one ``random.Random`` stream per direction (seeded from
    ``model.seed`` and the stream's name) in submission order; a failure from a stream per
    transfer (the request and the count of its transfers of that direction, see
    :meth:`_failure_draw`), so that changing a failure rate does not move any job's
    completion step, and a job gained or lost elsewhere does not move a failure.
    """

    model: WorkerModel = field(default_factory=WorkerModel)
    step: int = 0
    pending: dict[int, PendingJob] = field(default_factory=dict)
    #: every job reported so far, in the order it was reported
    completed: list[PendingJob] = field(default_factory=list)
    submitted: int = 0
    _ordinals: dict[bool, int] = field(default_factory=lambda: {False: 0, True: 0})
    _rngs: dict[str, random.Random] = field(default_factory=dict)
    #: transfers submitted so far per (direction, request id), for the failure draw
    _per_request: dict[tuple[str, str], int] = field(default_factory=dict)

    def _rng(self, name: str) -> random.Random:
        rng = self._rngs.get(name)
        if rng is None:
            rng = self._rngs[name] = random.Random(f"kvguard-worker:{self.model.seed}:{name}")
        return rng

    def _failure_draw(self, kind: str, req_id: str | None) -> float:
        """The failure draw of a request's next transfer of one direction, in ``[0, 1)``.

        It follows the transfer, not the job count: the n-th load (or store) of request
        ``r`` draws from a stream named by the seed, the direction, ``r`` and ``n``, so a
        job another request gains or loses (a guard that withholds a chunk, a promotion
        fewer) never moves a failure onto a different request. Both sides of the
        differential fuzz then fail the same transfers. Jobs with no known request share
        one stream in submission order.
        """
        if req_id is None:
            return self._rng(f"{kind}-failure").random()
        n = self._per_request[(kind, req_id)] = self._per_request.get((kind, req_id), -1) + 1
        return random.Random(f"kvguard-worker:{self.model.seed}:{kind}-failure:{req_id}:{n}").random()

    def submit(self, job_id: int, is_store: bool, req_id: str | None = None) -> PendingJob:
        """Record a job the worker received at :attr:`step`; returns its drawn fate.

        Raises ``ValueError`` for a job id already in flight (vLLM never reuses one).
        """
        if job_id in self.pending:
            raise ValueError(f"transfer job {job_id} is already in flight")
        kind = "store" if is_store else "load"
        latency = self.model.store_latency if is_store else self.model.load_latency
        faults = self.model.store_faults if is_store else self.model.load_faults
        ordinal = self._ordinals[is_store]
        self._ordinals[is_store] += 1
        # The latency stream advances on every job, whatever the model, so completion steps
        # stay aligned when a failure rate changes.
        delay = self._rng(f"{kind}-latency").randint(latency.min, latency.max)
        fails = self._failure_draw(kind, req_id) < faults.rate
        job = PendingJob(
            job_id=job_id,
            is_store=is_store,
            ordinal=ordinal,
            submit_step=self.step,
            due_step=None if ordinal in faults.hang_jobs else self.step + delay,
            success=not (fails or ordinal in faults.jobs),
            req_id=req_id,
        )
        self.pending[job_id] = job
        self.submitted += 1
        return job

    def wait(self, job_ids: set[int] | list[int]) -> list[PendingJob]:
        """Make the given in-flight jobs due now (a blocking ``wait()`` of the worker).

        Returns the hung jobs among them: a real ``wait()`` on those never returns.
        Unknown ids (already reported) are ignored, as vLLM's worker does.
        """
        hung = []
        for job_id in job_ids:
            job = self.pending.get(job_id)
            if job is None:
                continue
            if job.due_step is None:
                hung.append(job)
            else:
                job.due_step = min(job.due_step, self.step)
        return hung

    def finished(self) -> list[PendingJob]:
        """Pop the jobs due at or before :attr:`step`, ordered by (due step, job id)."""
        due = sorted(
            (j for j in self.pending.values() if j.due_step is not None and j.due_step <= self.step),
            key=lambda j: (j.due_step, j.job_id),
        )
        for job in due:
            del self.pending[job.job_id]
            job.done_step = self.step
            self.completed.append(job)
        return due

    def in_flight(self, req_id: str | None = None) -> list[PendingJob]:
        """Jobs in flight (of one request when ``req_id`` is given), by job id."""
        return sorted(
            (j for j in self.pending.values() if req_id is None or j.req_id == req_id),
            key=lambda j: j.job_id,
        )
