"""The simulated worker of the SimpleCPUOffloadConnector (``VLLM_USE_SIMPLE_KV_OFFLOAD=1``).

The connector's worker side is CUDA-only (``cuMemcpyBatchAsync``, CUDA streams and events,
host registration: ``vllm/v1/simple_kv_offload/worker.py``), so it cannot run here, and the
lab simulates it at the connector's own boundary, the contract the scheduler side relies on
(read in ``worker.py`` and ``metadata.py`` of 0.21.0 through 0.34.0; the fields are the same
on all of them):

- in: the step's ``SimpleCPUOffloadMetadata``: one load event (``load_event``, flat
  ``load_gpu_blocks`` / ``load_cpu_blocks``, pair ``k`` is one copy of a whole block, every
  layer), one store event (``store_event``, ``store_gpu_blocks`` -> ``store_cpu_blocks``),
  ``load_event_to_reqs`` (every load event still in flight -> its request ids) and
  ``need_flush`` (a request was preempted);
- order in a step (the model runner's): ``handle_preemptions`` (with ``need_flush``:
  ``_flush_and_sync_all``, every event in flight completes now), the forward,
  ``start_load_kv`` (the load event is launched *after* the forward: its requests are
  not scheduled in this step), ``wait_for_save`` (the store event, ordered after the
  forward's compute, #45704 / PR #46278), ``get_finished``;
- completion: one CUDA stream per direction; ``get_finished`` polls the events in launch
  order and stops at the first one not done (``_poll_stream_events``: a high-water mark),
  so a later event is never reported before an earlier one of its direction;
- out: ``finished_recving`` = the request ids of every load event reported (read from
  ``load_event_to_reqs``), and ``kv_connector_worker_meta =
  SimpleCPUOffloadWorkerMetadata(completed_store_events={event: 1})`` for the store events
  reported (one worker; the scheduler counts up to ``world_size``).

When each event is done is the trace's worker model (:class:`~.jobs.JobQueue`: latency in
steps, hung events); its ``fail_*`` faults do not apply (this worker reports no failed
copy) and a trace cannot set them for this connector. Job ids in the queue:
``2 * event`` for a load event, ``2 * event + 1`` for a store event (the connector numbers
loads and stores separately).

The KV-content oracle (:mod:`.kv_oracle`, one CPU block per GPU block) follows every copy
with the time a real copy may take: the copy happens at some moment between launch and the
event's completion, so

- a store reads its GPU blocks at launch *and* at completion; a block whose slots changed
  in between gives its CPU block garbage (zeros: every later read of it is wrong KV, the
  torn copy #45704 made);
- a load's GPU blocks are garbage from launch to completion (zeros: a read of them in
  between is wrong KV), and at completion they get the CPU blocks' slots, garbage for a
  CPU block that changed since launch.

Then, before the step's compute, every scheduled request's read range is checked as for the
OffloadingConnector (:meth:`~.kv_oracle.KVOracle.check`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvguard.lab.replay import vllm_api
from kvguard.lab.replay.jobs import JobQueue, PendingJob, WorkerModel
from kvguard.lab.replay.worker import FAULTS, Drafting, InFlightTokens, WorkerHang, forward, sample

if TYPE_CHECKING:
    from kvguard.lab.replay.kv_oracle import KVOracle

__all__ = ["SimpleWorker", "EventRecord", "job_id_of"]


def job_id_of(event: int, is_store: bool) -> int:
    """The job queue's id of a load or store event (module docstring)."""
    return 2 * int(event) + int(is_store)


@dataclass
class EventRecord:
    """One load or store event as the worker received it (flat GPU -> CPU block pairs)."""

    job_id: int
    event: int
    is_store: bool
    #: the load event's requests (``load_event_to_reqs``); a store event names none
    req_ids: list[str]
    block_ids: list[int]
    cpu_block_ids: list[int]
    #: what the report's per-spec fields read (a simple event has no group structure)
    group_sizes: list[int] = field(default_factory=list)
    block_indices: list[int] = field(default_factory=list)
    manager_block_ids: list[list[int]] | None = None
    #: the step whose ``get_finished`` reported it (``None``: not yet)
    done_step: int | None = None

    @property
    def req_id(self) -> str:
        return ",".join(self.req_ids)

    def problems(self, num_cpu_blocks: int | None) -> list[str]:
        """What a real copy could not execute as meant: unpaired lists, a CPU block id out of
        the pool, a load into the null block (id 0) or into one GPU block twice."""
        out = []
        if len(self.block_ids) != len(self.cpu_block_ids):
            out.append(f"{len(self.block_ids)} GPU blocks vs {len(self.cpu_block_ids)} CPU blocks")
        if num_cpu_blocks is not None and any(not 0 <= c < num_cpu_blocks for c in self.cpu_block_ids):
            out.append(f"a CPU block id outside 0..{num_cpu_blocks - 1}")
        if not self.is_store:
            if 0 in self.block_ids:
                out.append("null block id 0 in a load's GPU blocks")
            if len(set(self.block_ids)) != len(self.block_ids):
                out.append("a GPU block loaded twice in one event")
        return out


@dataclass
class SimpleWorker(Drafting):
    """The SimpleCPUOffloadConnector's worker at its boundary (module docstring).

    The same interface as :class:`~.worker.SimulatedWorker` (``execute``, ``busy``,
    ``queue``, ``oracle``, ``loads``, ``stores``, ``inconsistent_specs``,
    ``jobs_completed``): ``scheduler`` is the real ``Scheduler`` (read only),
    ``num_cpu_blocks`` the connector's CPU pool size, ``oracle_on`` False turns the KV
    oracle off.
    """

    scheduler: Any
    vocab_size: int
    model: WorkerModel = field(default_factory=WorkerModel)
    num_cpu_blocks: int | None = None
    oracle_on: bool = True
    oracle: "KVOracle | None" = None
    loads: list[EventRecord] = field(default_factory=list)
    stores: list[EventRecord] = field(default_factory=list)
    inconsistent_specs: list[dict[str, Any]] = field(default_factory=list)
    jobs_completed: int = 0
    #: per job, the GPU block ids the copy engine received
    copy_engine_jobs: dict[int, Any] = field(default_factory=dict)
    #: copies whose source changed while they ran (the oracle wrote garbage for them)
    torn_blocks: int = 0
    step: int = 0
    #: test-only negative controls of the oracle, one of :data:`~.worker.FAULTS`
    #: (``load_copies_nothing``, ``load_wrong_chunk``: a load gives each GPU block the CPU
    #: block of its neighbour in the event)
    fault: str | None = None
    queue: JobQueue = field(init=False)
    _events: dict[int, EventRecord] = field(default_factory=dict, init=False, repr=False)
    _snapshots: dict[int, Any] = field(default_factory=dict, init=False, repr=False)
    #: per direction (is_store), events done by the queue but behind an earlier one
    _done: dict[bool, dict[int, PendingJob]] = field(default_factory=lambda: {False: {}, True: {}},
                                                     init=False, repr=False)
    #: per direction, the events launched and not yet reported, in launch order
    _launched: dict[bool, list[int]] = field(default_factory=lambda: {False: [], True: []},
                                             init=False, repr=False)

    def __post_init__(self) -> None:
        self.queue = JobQueue(self.model)
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"unknown worker fault {self.fault!r}; known: {', '.join(FAULTS)}")
        if self.oracle is None and self.oracle_on:
            # numpy (the oracle's storage) comes with vLLM; the light env imports this module
            from kvguard.lab.replay.kv_oracle import oracle_for

            self.oracle = oracle_for(self.scheduler, self.vocab_size, 1,
                                     token_view=lambda req: InFlightTokens(req, self.vocab_size))

    @property
    def busy(self) -> bool:
        """Whether an event will still complete (a hung one never does)."""
        return any(j.due_step is not None for j in self.queue.pending.values())

    # -- launch and completion -------------------------------------------------------
    def _launch(self, event: int, is_store: bool, gpu: list[int], cpu: list[int], req_ids: list[str]) -> None:
        job_id = job_id_of(event, is_store)
        rec = EventRecord(job_id=job_id, event=event, is_store=is_store, req_ids=req_ids,
                          block_ids=gpu, cpu_block_ids=cpu)
        problems = rec.problems(self.num_cpu_blocks)
        if problems:
            self.inconsistent_specs.append({"job_id": job_id, "request_id": rec.req_id,
                                            "store": is_store, "problems": problems})
        (self.stores if is_store else self.loads).append(rec)
        self._events[job_id] = rec
        self.copy_engine_jobs[job_id] = list(gpu)
        self.queue.submit(job_id, is_store, rec.req_id or None)
        self._launched[is_store].append(job_id)
        oracle = self.oracle
        if oracle is None or problems:
            return
        if is_store:
            self._snapshots[job_id] = oracle.gpu_pages(gpu)
        else:
            self._snapshots[job_id] = oracle.cpu_pages(cpu)
            # the destination is being overwritten until the event completes
            oracle.write_gpu_pages(gpu, [p * 0 for p in oracle.gpu_pages(gpu)], count=False)

    def _complete(self, job_id: int) -> None:
        rec = self._events.pop(job_id)
        snap = self._snapshots.pop(job_id, None)
        oracle = self.oracle
        if oracle is None or snap is None:
            return
        if rec.is_store:
            now = oracle.gpu_pages(rec.block_ids)
            target = oracle.write_cpu_pages
            ids = rec.cpu_block_ids
        else:
            now = oracle.cpu_pages(rec.cpu_block_ids)
            target = oracle.write_gpu_pages
            ids = rec.block_ids
        torn = oracle.changed_rows(snap, now)
        if torn.any():
            self.torn_blocks += int(torn.sum())
            for page in snap:
                page[torn] = 0
        if not rec.is_store and self.fault == "load_copies_nothing":
            return  # the destination keeps the garbage of the launch
        if not rec.is_store and self.fault == "load_wrong_chunk":
            import numpy as np  # with vLLM (the light env imports this module)

            snap = [np.roll(page, 1, axis=0) for page in snap]  # each GPU block gets a neighbour's
        target(ids, snap)

    def _report(self, is_store: bool) -> list[EventRecord]:
        """The events of one direction the high-water-mark poll reports now, in order."""
        out = []
        launched = self._launched[is_store]
        done = self._done[is_store]
        while launched and launched[0] in done:
            job_id = launched.pop(0)
            done.pop(job_id)
            self._events[job_id].done_step = self.step
            out.append(self._events[job_id])
            self._complete(job_id)
        return out

    def _flush(self) -> None:
        """``_flush_and_sync_all``: every event in flight completes now; a hung one blocks forever."""
        hung = self.queue.wait(list(self.queue.pending))
        if hung:
            raise WorkerHang(hung)

    # -- one step ------------------------------------------------------------------------
    def execute(self, scheduler_output: Any) -> Any:
        """Run one step; returns the ``ModelRunnerOutput`` for ``update_from_output``.

        Raises :class:`~.worker.WorkerHang` when a flush waits on a hung event, and
        :class:`~.vllm_api.HarnessError` when the step carries no ``SimpleCPUOffloadMetadata``.
        """
        self.queue.step = self.step
        meta = scheduler_output.kv_connector_metadata
        if not vllm_api.is_simple_offload_metadata(meta):
            raise vllm_api.HarnessError(
                f"SchedulerOutput.kv_connector_metadata is a {type(meta).__name__}",
                expected="a SimpleCPUOffloadMetadata in SchedulerOutput.kv_connector_metadata")
        if meta.need_flush:
            self._flush()
        if self.oracle is not None:
            forward(self.oracle, self.scheduler, scheduler_output)
            self.oracle.check(scheduler_output)
        if meta.load_event >= 0 and meta.load_gpu_blocks:
            self._launch(meta.load_event, False, list(map(int, meta.load_gpu_blocks)),
                         list(map(int, meta.load_cpu_blocks)),
                         list(meta.load_event_to_reqs.get(meta.load_event, ())))
        if meta.store_event >= 0 and meta.store_gpu_blocks:
            self._launch(meta.store_event, True, list(map(int, meta.store_gpu_blocks)),
                         list(map(int, meta.store_cpu_blocks)), [])
        for job in self.queue.finished():
            self._done[job.is_store][job.job_id] = job
        loads, stores = self._report(False), self._report(True)
        self.jobs_completed += len(loads) + len(stores)
        self.step += 1
        kv: dict[str, Any] = {
            # read from this step's map, as vLLM's get_finished does (an event missing there
            # reports no request)
            "finished_recving": {rid for rec in loads for rid in meta.load_event_to_reqs.get(rec.event) or ()},
            "finished_sending": set(),
            "kv_connector_worker_meta": (
                vllm_api.simple_worker_metadata({rec.event: 1 for rec in stores}) if stores else None),
        }
        req_ids, sampled = sample(self.scheduler, scheduler_output, self.vocab_size)
        if self.speculative_tokens:
            self._propose(scheduler_output, req_ids, sampled)
        return vllm_api.model_runner_output(req_ids, sampled, kv)
