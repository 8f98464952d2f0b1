"""The simulated worker: the GPU side of a replay, where vLLM's scheduler hands over.

vLLM's scheduler runs for real (``Scheduler.schedule()`` / ``update_from_output()`` with
the real ``OffloadingConnector`` in the scheduler role). The worker side runs vLLM's own
code too: a second ``OffloadingConnector`` in the *worker* role (its real
``OffloadingConnectorWorker``), driven every step in the order vLLM's model runner
drives it (``KVConnectorModelRunnerMixin``): ``handle_preemptions(meta)``,
``bind_connector_metadata``, ``start_load_kv``, ``wait_for_save``,
``get_transfer_results`` (0.33) or ``get_finished`` (0.21), ``get_block_ids_with_load_errors``,
``build_connector_worker_meta``, ``clear_connector_metadata``. So what the scheduler gets
back (``OffloadingWorkerMetadata.completed_jobs``, ``finished_recving`` for async loads,
no ``finished_sending`` for stores, ``invalid_block_ids``) is what the release's real
worker reports, including its deferral of every store to the start of the next step
(``prepare_store_kv``) and its blocking ``wait`` on ``jobs_to_flush`` when a request is
preempted or a block with a pending store is reallocated.

Only the copy engine below it is simulated: :class:`SimulatedTransfers` is the object the
release's offloading spec would hand its connector worker (``get_worker``, or one handler
per direction from ``get_handlers`` on 0.21), handed over by
:class:`kvguard.lab.replay.vllm_api.WorkerConnector` (the rule of what is simulated is
written in :mod:`kvguard.lab.replay.vllm_api`). vLLM's ``register_kv_caches`` runs on
host tensors the lab lays out as the ``KVCacheConfig`` declares, so whatever vLLM's
worker does before a copy (0.34.0 resolves each GPU block to a device pointer,
``vllm/v1/kv_offload/pointer_utils.py``) runs as vLLM's code; the copy engine reads the GPU
side it receives by its declared fields (:func:`~kvguard.lab.replay.vllm_api.gpu_side`).
When each job finishes and whether it succeeds is the
:class:`~kvguard.lab.replay.jobs.JobQueue` of the trace's worker model (latency in
steps, out-of-order completion, failed and hung jobs). A failed job is returned as
``TransferResult(success=False)`` and the release's own ``get_finished`` decides what
follows: measured on 0.21.0 and 0.33.0, ``assert transfer_result.success`` ("we currently
do not support job failures"), so the worker, and with it EngineCore, dies; 0.34.0 reports
the job failed (``OffloadingWorkerMetadata``, ``failed_recving`` for a load) and goes on.

Besides that:

- every scheduled request whose prompt is fully computed after the step samples one
  token, chosen deterministically from (request id, output index) so traces replay the
  same way every time;
- the KV-content oracle (:mod:`kvguard.lab.replay.kv_oracle`) follows the KV each
  GPU block and CPU chunk holds: a store copies when vLLM's worker *submits* it (at the
  start of the step after the one that scheduled it, ``prepare_store_kv``), a load copies
  when it *completes* successfully (a failed load copies nothing); then every scheduled
  request's computed blocks are checked, then the forward writes the scheduled tokens;
- every ``GPULoadStoreSpec`` the worker receives is checked for the consistency a real
  transfer relies on (#42945): ``sum(group_sizes) == len(block_ids)``,
  ``len(block_indices) == len(group_sizes)``, and no null block (id 0) among a load's
  ``block_ids`` (a store may copy it: :meth:`SpecRecord.problems`). A failing spec is recorded in :attr:`SimulatedWorker.inconsistent_specs`
  (it would make a real worker copy the wrong blocks), never raised.

Test-only faults (negative controls of the oracle; not reachable from the CLI or a
trace): ``SimulatedWorker(fault=...)`` or ``worker.fault = ...`` before the replay, one of
:data:`FAULTS`: ``"load_copies_nothing"`` (a load job completes without copying) and
``"load_wrong_chunk"`` (a load reads the CPU chunk ids rotated by one, i.e. every GPU
block gets a neighbouring chunk's KV).

The ``TransferJob`` layout differs between releases: ``transfer_spec=(src, dst)`` in
vLLM 0.21.0, ``src_spec`` / ``dst_spec`` from 0.23 on (:func:`~kvguard.lab.replay.vllm_api.job_specs`).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvguard.lab.replay import vllm_api
from kvguard.lab.replay.jobs import JobQueue, PendingJob, WorkerModel

if TYPE_CHECKING:
    from kvguard.lab.replay.kv_oracle import KVOracle

#: Test-only worker faults (module docstring).
FAULTS = ("load_copies_nothing", "load_wrong_chunk")


class WorkerHang(RuntimeError):
    """The worker blocks forever: vLLM's ``wait(job_ids)`` on a job that never completes.

    A real engine hangs in ``handle_preemptions`` (``jobs_to_flush``); the replay stops
    and reports the stall (kind ``flush_waits_forever``). ``jobs`` are the hung jobs.
    """

    def __init__(self, jobs: list[PendingJob]):
        super().__init__(f"worker waits forever on transfer jobs {[j.job_id for j in jobs]}")
        self.jobs = jobs


@dataclass
class SpecRecord:
    """One ``GPULoadStoreSpec`` as the worker received it (GPU block ids, per group)."""

    job_id: int
    req_id: str
    is_store: bool
    group_sizes: list[int]
    block_indices: list[int]
    block_ids: list[int]
    #: The request's block ids per KV cache group in the real KV cache manager, taken
    #: when the worker received a load (``None`` for stores or a finished request).
    manager_block_ids: list[list[int]] | None = None

    def group_block_ids(self, group: int) -> list[int]:
        """The block ids of KV cache group ``group`` in this spec (spec order)."""
        start = sum(self.group_sizes[:group])
        return self.block_ids[start : start + self.group_sizes[group]]

    def problems(self) -> list[str]:
        """What is inconsistent in this spec (empty when a worker could execute it)."""
        out = []
        if sum(self.group_sizes) != len(self.block_ids):
            out.append(
                f"sum(group_sizes)={sum(self.group_sizes)} != len(block_ids)={len(self.block_ids)}"
            )
        if len(self.block_indices) != len(self.group_sizes):
            out.append(
                f"len(block_indices)={len(self.block_indices)} != "
                f"len(group_sizes)={len(self.group_sizes)}"
            )
        # A store may copy the null block: vLLM 0.34.0's store builder keeps null pages
        # inside a chunk as placeholders for blocks the load path never reaches ("The null
        # GPU block is zeroed and can be copied safely", offloading/scheduler.py
        # _build_store_jobs). That is no inconsistency in itself: the oracle carries the
        # null block's "never written" slots into the chunk and flags them wherever a later
        # load places them inside an attention's read range. A load into the null block
        # would overwrite the page every request's skipped positions share: flagged.
        if not self.is_store and 0 in self.block_ids:
            out.append("null block id 0 in a load's block_ids")
        return out


def sampled_token(req_id: str, index: int, vocab_size: int) -> int:
    """The token id the simulated worker samples at output position ``index``."""
    return zlib.crc32(f"{req_id}:{index}".encode()) % (vocab_size - 1) + 1


def drafts(req_id: str, index: int, k: int, vocab_size: int) -> list[int]:
    """The ``k`` draft tokens the simulated drafter proposes for output positions ``index ..
    index + k - 1`` of ``req_id``: the first ``a = crc32(f"draft:{req_id}:{index}") % (k + 1)``
    are the request's true tokens (:func:`sampled_token`: what the target samples, so
    verification accepts them), the others a wrong token each (the true one plus one, within
    the vocabulary), so every count of accepted drafts from 0 to ``k`` occurs."""
    a = zlib.crc32(f"draft:{req_id}:{index}".encode()) % (k + 1)
    out = []
    for j in range(k):
        true = sampled_token(req_id, index + j, vocab_size)
        out.append(true if j < a else true % (vocab_size - 1) + 1)
    return out


class SimulatedTransfers:
    """The copy engine under vLLM's ``OffloadingConnectorWorker`` (the oracle copies fingerprints).

    The ``OffloadingWorker`` API vLLM's connector worker calls (0.25+:
    ``submit_load(job_id, src_spec, dst_spec, expedited=False)``, ``submit_store(job_id,
    src_spec, dst_spec)``; on 0.21.0 two per-direction handlers over it,
    :class:`~kvguard.lab.replay.vllm_api.WorkerConnector`), ``get_finished()`` (a list of
    the release's ``TransferResult``), ``wait(job_ids)`` and ``shutdown()``; ``bind`` keeps
    the ``CanonicalKVCaches`` vLLM's registration built (device pointers are read against
    it). The GPU side of a job is what vLLM hands over: a ``GPULoadStoreSpec``, or device
    pointers on 0.34.0 (:func:`~kvguard.lab.replay.vllm_api.gpu_side`).
    Raises :class:`WorkerHang` from ``wait`` on a job the model never completes.
    """

    def __init__(self, owner: "SimulatedWorker"):
        self._owner = owner
        self.kv_caches: Any = None
        self._done: list[PendingJob] = []

    def bind(self, kv_caches: Any) -> None:
        self.kv_caches = kv_caches

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._owner._submit(job_id, True, vllm_api.gpu_side(src_spec, self.kv_caches), dst_spec)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        return self._owner._submit(job_id, False, src_spec, vllm_api.gpu_side(dst_spec, self.kv_caches))

    def get_finished(self, store: bool | None = None) -> list[Any]:
        """Jobs finished since the last call (of direction ``store`` only, for 0.21.0's
        per-direction handlers: each reports its own jobs)."""
        self._done.extend(self._owner._finished())
        if store is None:
            out, self._done = self._done, []
        else:
            out = [j for j in self._done if j.is_store is store]
            self._done = [j for j in self._done if j.is_store is not store]
        return [self._owner.connector().transfer_result(j.job_id, j.success) for j in out]

    def wait(self, job_ids: set[int]) -> None:
        hung = self._owner.queue.wait(job_ids)
        if hung:
            raise WorkerHang(hung)

    def shutdown(self) -> None:
        pass


@dataclass(kw_only=True)
class Drafting:
    """The simulated drafter both workers share (:class:`SimulatedWorker`,
    :class:`~.simple_worker.SimpleWorker`): after each step's verification it proposes
    ``speculative_tokens`` drafts per request (:func:`drafts`), which the harness hands to
    ``Scheduler.update_draft_token_ids`` as ``EngineCore.post_step`` does. The worker
    provides ``scheduler`` and ``vocab_size``."""

    #: speculative decoding: draft tokens proposed per sampled token (0: off;
    #: ``geometry.speculative``'s ``num_speculative_tokens``)
    speculative_tokens: int = 0
    #: drafts proposed and accepted so far (the replay report's ``speculative``)
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    _drafts: dict[str, list[int]] = field(default_factory=dict, init=False, repr=False)

    def _propose(self, scheduler_output: Any, req_ids: list[str], sampled: list[list[int]]) -> None:
        """The drafter's proposal after this step's verification: :func:`drafts` for the
        position after each request's last sampled token (none for a partial prefill),
        handed to the scheduler by :meth:`take_draft_token_ids`."""
        spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        k = self.speculative_tokens
        for req_id, tokens in zip(req_ids, sampled):
            if not tokens:
                continue
            scheduled = spec.get(req_id) or ()
            self.drafts_proposed += len(scheduled)
            self.drafts_accepted += len(tokens) - 1
            req = self.scheduler.requests.get(req_id)
            if req is None:
                continue
            # the index of the token after the last one sampled now (see sample())
            index = int(req.num_computed_tokens) - int(req.num_prompt_tokens) - len(scheduled) + len(tokens)
            self._drafts[req_id] = drafts(req_id, index, k, self.vocab_size)

    def take_draft_token_ids(self) -> Any:
        """The step's drafts as vLLM's ``DraftTokenIds`` (``req_ids``, ``draft_token_ids``), or
        None: what ``EngineCore.post_step`` hands to ``Scheduler.update_draft_token_ids``."""
        if not self._drafts:
            return None
        from vllm.v1.outputs import DraftTokenIds

        req_ids = list(self._drafts)
        out = DraftTokenIds(req_ids, [self._drafts[r] for r in req_ids])
        self._drafts = {}
        return out


@dataclass
class SimulatedWorker(Drafting):
    """Runs vLLM's worker-side offloading connector over simulated transfers; samples tokens.

    ``scheduler`` is the real ``vllm.v1.core.sched.scheduler.Scheduler`` (read only: its
    ``requests``, ``kv_cache_manager``, ``vllm_config``, ``kv_cache_config`` and the class
    of its connector). ``model`` is the worker model (:class:`~.jobs.WorkerModel`; the
    default completes every job, successfully, in the step it is submitted).
    ``blocks_per_chunk``: GPU blocks per offloaded chunk (the oracle's GPU <-> CPU
    mapping); ``None`` turns the oracle off (then nothing proves the KV content).
    ``fault``: test-only, one of :data:`FAULTS`. Call
    :meth:`execute` once per step with the step's ``SchedulerOutput``; it returns the
    ``ModelRunnerOutput`` to feed back into ``Scheduler.update_from_output``. An
    exception raised by vLLM's worker code (e.g. its assert on a failed transfer)
    propagates: in a server it kills the worker and EngineCore.

    Raises:
        ValueError: an unknown ``fault``.
    """

    scheduler: Any
    vocab_size: int
    model: WorkerModel = field(default_factory=WorkerModel)
    blocks_per_chunk: int | None = None
    fault: str | None = None
    oracle: KVOracle | None = None
    loads: list[SpecRecord] = field(default_factory=list)
    stores: list[SpecRecord] = field(default_factory=list)
    inconsistent_specs: list[dict[str, Any]] = field(default_factory=list)
    jobs_completed: int = 0
    #: per job, the GPU side as the copy engine received it from vLLM's worker code
    #: (:class:`~kvguard.lab.replay.vllm_api.GPUSide`, GPU block ids)
    copy_engine_jobs: dict[int, Any] = field(default_factory=dict)
    #: engine steps executed so far (the job queue's clock)
    step: int = 0
    queue: JobQueue = field(init=False)
    _connector: Any = field(default=None, init=False, repr=False)
    _job_req: dict[int, str] = field(default_factory=dict, init=False, repr=False)
    _job_specs: dict[int, tuple[Any, Any]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.queue = JobQueue(self.model)
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"unknown worker fault {self.fault!r}; known: {', '.join(FAULTS)}")
        if self.oracle is None and self.blocks_per_chunk is not None:
            # numpy (the oracle's storage) comes with vLLM; the light env imports this module
            from kvguard.lab.replay.kv_oracle import oracle_for

            self.oracle = oracle_for(self.scheduler, self.vocab_size, self.blocks_per_chunk,
                                     token_view=self.known_tokens)

    def known_tokens(self, req: Any) -> "InFlightTokens":
        """``req``'s token ids as this worker knows them: vLLM's ``all_token_ids``, then the
        tokens the worker sampled at positions the scheduler already counts as computed
        (``num_computed_tokens``) but whose output it has not processed yet (async
        scheduling's output placeholders). Synchronously the second part is empty."""
        return InFlightTokens(req, self.vocab_size)

    # -- the worker-role connector -------------------------------------------------
    def connector(self) -> "vllm_api.WorkerConnector":
        """vLLM's ``OffloadingConnector`` in the worker role over :class:`SimulatedTransfers`
        (built on first use; raises :class:`~kvguard.lab.replay.vllm_api.HarnessError`
        when the lab cannot hand it the copy engine)."""
        if self._connector is None:
            self._connector = vllm_api.WorkerConnector(self.scheduler, SimulatedTransfers(self))
        return self._connector

    def unsubmitted_stores(self) -> int:
        """Stores vLLM's worker holds back for the next step (``prepare_store_kv``)."""
        return 0 if self._connector is None else self._connector.unsubmitted_stores()

    @property
    def busy(self) -> bool:
        """Whether a job is still to be submitted or will still complete (hung jobs never)."""
        return self.unsubmitted_stores() > 0 or any(
            j.due_step is not None for j in self.queue.pending.values()
        )

    def _submit(self, job_id: int, is_store: bool, src: Any, dst: Any) -> bool:
        self.copy_engine_jobs[job_id] = src if is_store else dst
        job = self.queue.submit(job_id, is_store, self._job_req.get(job_id))
        self._job_specs[job_id] = (src, dst)
        if is_store:
            self.on_store_submitted(job, src, dst)
        return True

    def _finished(self) -> list[PendingJob]:
        done = self.queue.finished()
        for job in done:
            src, dst = self._job_specs.pop(job.job_id, (None, None))
            if not job.is_store and job.success:
                self.on_load_completed(job, src, dst)
        return done

    def on_store_submitted(self, job: PendingJob, src_spec: Any, dst_spec: Any) -> None:
        """A store's GPU blocks are read when vLLM's worker submits it (oracle copy)."""
        if self.oracle is not None:
            self.oracle.store(job.job_id, src_spec, dst_spec)

    def on_load_completed(self, job: PendingJob, src_spec: Any, dst_spec: Any) -> None:
        """A successful load's GPU blocks are written when it completes (oracle copy)."""
        if self.oracle is None or self.fault == "load_copies_nothing":
            return
        if self.fault == "load_wrong_chunk":
            src_spec = _Rotated(src_spec)
        self.oracle.load(job.job_id, src_spec, dst_spec)

    def _record(self, job_id: int, req_id: str, gpu_spec: Any, is_store: bool) -> SpecRecord:
        rec = SpecRecord(
            job_id=job_id,
            req_id=req_id,
            is_store=is_store,
            group_sizes=[int(x) for x in getattr(gpu_spec, "group_sizes", None) or ()],
            block_indices=[int(x) for x in getattr(gpu_spec, "block_indices", None) or ()],
            block_ids=[int(x) for x in gpu_spec.block_ids],
        )
        problems = rec.problems()
        if problems:
            self.inconsistent_specs.append(
                {"job_id": job_id, "request_id": req_id, "store": is_store, "problems": problems}
            )
        return rec

    def execute(self, scheduler_output: Any) -> Any:
        """Run one step on the simulated GPU; returns a ``ModelRunnerOutput``.

        Raises :class:`WorkerHang` when vLLM's worker would block forever, whatever
        vLLM's worker code raises (a failed transfer on 0.21.0-0.33.0: ``AssertionError``),
        and :class:`~kvguard.lab.replay.vllm_api.HarnessError` when the lab cannot
        drive the release's worker.
        """
        self.queue.step = self.step
        jobs = vllm_api.offload_jobs(scheduler_output)
        kv: dict[str, Any] = {}
        if jobs is not None:
            store_jobs, load_jobs = jobs
            for job_id, job in store_jobs.items():
                src, _dst = vllm_api.job_specs(job)
                self._job_req[job_id] = job.req_id
                self.stores.append(self._record(job_id, job.req_id, src, is_store=True))
            for job_id, job in load_jobs.items():
                _src, dst = vllm_api.job_specs(job)
                self._job_req[job_id] = job.req_id
                rec = self._record(job_id, job.req_id, dst, is_store=False)
                if job.req_id in self.scheduler.requests:
                    ids = self.scheduler.kv_cache_manager.get_block_ids(job.req_id)
                    rec.manager_block_ids = [list(map(int, g)) for g in ids]
                self.loads.append(rec)
            kv = self.connector().step(scheduler_output, scheduler_output.kv_connector_metadata)
        if self.oracle is not None:
            # The forward writes every scheduled token's KV before attention reads (per
            # layer, for the whole batch), so a prefix hit on a block another request of
            # the same step computes is valid: write first, then check what is read
            # (after this step's submitted stores read and completed loads wrote).
            forward(self.oracle, self.scheduler, scheduler_output)
            self.oracle.check(scheduler_output)
        self.step += 1
        worker_meta = kv.get("kv_connector_worker_meta")
        self.jobs_completed += len(getattr(worker_meta, "completed_jobs", None) or ())
        req_ids, sampled = sample(self.scheduler, scheduler_output, self.vocab_size)
        if self.speculative_tokens:
            self._propose(scheduler_output, req_ids, sampled)
        return vllm_api.model_runner_output(req_ids, sampled, kv)

def forward(oracle: "KVOracle", scheduler: Any, scheduler_output: Any) -> None:
    """The forward, in the oracle: each scheduled request's scheduled tokens are written into
    its blocks (``kv_cache_manager.get_block_ids``, every KV cache group)."""
    manager = scheduler.kv_cache_manager
    spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
        req = scheduler.requests.get(req_id)
        if req is None or not num_scheduled:
            continue
        end = int(req.num_computed_tokens)  # schedule() already added the scheduled tokens
        start = end - int(num_scheduled)
        codes = oracle.token_codes(req_id)
        scheduled_drafts = spec.get(req_id)
        if scheduled_drafts:
            # the last len(drafts) scheduled positions hold the drafts' own KV, right or not
            codes = oracle.with_tokens(codes, end - len(scheduled_drafts), scheduled_drafts)
        for group, table in enumerate(manager.get_block_ids(req_id)):
            oracle.computed_range(req_id, group, table, start, end, codes)


def sample(scheduler: Any, scheduler_output: Any, vocab_size: int) -> tuple[list[str], list[list[int]]]:
    """``(req_ids, sampled token ids)`` of a step: one :func:`sampled_token` for every
    scheduled request whose prompt is computed after it, none for a partial prefill chunk."""
    req_ids: list[str] = []
    sampled: list[list[int]] = []
    spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    for req_id in scheduler_output.num_scheduled_tokens:
        req = scheduler.requests.get(req_id)
        req_ids.append(req_id)
        if req is not None and req.num_computed_tokens >= req.num_tokens:
            # the token after the last computed position; synchronously that index is
            # len(output_token_ids), under async scheduling it is ahead of it by the
            # outputs still in flight (num_output_placeholders); with m drafts scheduled the
            # last m computed positions are theirs
            scheduled_drafts = spec.get(req_id) or ()
            index = int(req.num_computed_tokens) - int(req.num_prompt_tokens) - len(scheduled_drafts)
            out = [sampled_token(req_id, index, vocab_size)]
            for draft in scheduled_drafts:  # a target verifies: the accepted prefix, plus one
                if draft != out[-1]:
                    break
                out.append(sampled_token(req_id, index + len(out), vocab_size))
            sampled.append(out)
        else:
            sampled.append([])  # a partial prefill chunk samples nothing
    return req_ids, sampled


class InFlightTokens:
    """A live request's token ids up to ``num_computed_tokens``, read lazily (no copy).

    Position ``p < len(all_token_ids)`` is vLLM's token; a position beyond it (a token the
    worker sampled whose output the scheduler has not processed: async scheduling) is
    :func:`sampled_token` at output index ``p - num_prompt_tokens``, the token the worker
    returned for it (the scheduler appends exactly that token when it processes the output).
    """

    def __init__(self, req: Any, vocab_size: int):
        self._ids = req.all_token_ids
        self._known = len(self._ids)
        self._len = max(self._known, int(req.num_computed_tokens))
        self._req_id = req.request_id
        self._prompt = int(req.num_prompt_tokens)
        self._vocab = vocab_size

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> int:
        if i < self._known:
            return self._ids[i]
        if not 0 <= i < self._len:
            raise IndexError(i)
        return sampled_token(self._req_id, i - self._prompt, self._vocab)


class _Rotated:
    """A CPU spec whose chunk ids are rotated by one (the ``load_wrong_chunk`` fault)."""

    def __init__(self, spec: Any):
        import numpy as np

        self.block_ids = np.roll(np.asarray(spec.block_ids), 1)
