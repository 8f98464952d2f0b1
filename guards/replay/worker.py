"""The simulated worker: the GPU side of a replay, where vLLM's scheduler hands over.

vLLM's scheduler runs for real (``Scheduler.schedule()`` / ``update_from_output()`` with
the real ``OffloadingConnector`` in the scheduler role). What a GPU worker would do with
each :class:`SchedulerOutput` is simulated here, the way vLLM's own offloading
connector worker reports it (``offloading/worker.py``):

- every load and store job in the step's ``OffloadingConnectorMetadata`` completes in
  the same step: its job id goes to ``OffloadingWorkerMetadata.completed_jobs`` (count 1,
  one worker), and a load's request id goes to ``KVConnectorOutput.finished_recving``;
  stores never report ``finished_sending`` (as vLLM's worker);
- every scheduled request whose prompt is fully computed after the step samples one
  token, chosen deterministically from (request id, output index) so traces replay the
  same way every time;
- the KV-content oracle (:mod:`kvguard.guards.replay.kv_oracle`) follows the KV each
  GPU block and CPU chunk holds: per step, loads copy (they complete in their step),
  then every scheduled request's computed blocks are checked, then the forward writes
  the scheduled tokens, then stores copy (vLLM defers a store to the start of the next
  step, i.e. after this step's forward);
- every ``GPULoadStoreSpec`` the worker receives is checked for the consistency a real
  transfer relies on (#42945): ``sum(group_sizes) == len(block_ids)``,
  ``len(block_indices) == len(group_sizes)``, and no null block (id 0) in
  ``block_ids``. A failing spec is recorded in :attr:`SimulatedWorker.inconsistent_specs`
  (it would make a real worker copy the wrong blocks), never raised.

Test-only faults (negative controls of the oracle; not reachable from the CLI or a
trace): ``SimulatedWorker(fault=...)`` or ``worker.fault = ...`` before the replay, one of
:data:`FAULTS`: ``"load_copies_nothing"`` (a load job completes without copying) and
``"load_wrong_chunk"`` (a load reads the CPU chunk ids rotated by one, i.e. every GPU
block gets a neighbouring chunk's KV).

The ``TransferJob`` layout differs between releases: ``transfer_spec=(src, dst)`` in
vLLM 0.21.0, ``src_spec`` / ``dst_spec`` from 0.23 on. Both are read.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

from kvguard.guards.replay.kv_oracle import (
    KVOracle,
    layouts_from_kv_cache_config,
    offload_group_ids,
    pages_shared_by_groups,
)

#: Test-only worker faults (module docstring).
FAULTS = ("load_copies_nothing", "load_wrong_chunk")

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
        if 0 in self.block_ids:
            out.append("null block id 0 in block_ids")
        return out


def sampled_token(req_id: str, index: int, vocab_size: int) -> int:
    """The token id the simulated worker samples at output position ``index``."""
    return zlib.crc32(f"{req_id}:{index}".encode()) % (vocab_size - 1) + 1


def _job_specs(job: Any) -> tuple[Any, Any]:
    if hasattr(job, "transfer_spec"):  # vLLM 0.21.x
        src, dst = job.transfer_spec
        return src, dst
    return job.src_spec, job.dst_spec


@dataclass
class SimulatedWorker:
    """Completes transfer jobs and samples tokens for the real scheduler's outputs.

    ``scheduler`` is the real ``vllm.v1.core.sched.scheduler.Scheduler`` (read only: its
    ``requests``, ``kv_cache_manager`` and ``kv_cache_config``). ``blocks_per_chunk``: GPU
    blocks per offloaded chunk (the oracle's GPU <-> CPU mapping); ``None`` turns the
    oracle off (then nothing proves the KV content). ``fault``: test-only, one of
    :data:`FAULTS`. Call :meth:`execute` once per step with the step's
    ``SchedulerOutput``; it returns the ``ModelRunnerOutput`` to feed back into
    ``Scheduler.update_from_output``.

    Raises:
        ValueError: an unknown ``fault``.
    """

    scheduler: Any
    vocab_size: int
    blocks_per_chunk: int | None = None
    fault: str | None = None
    oracle: KVOracle | None = None
    loads: list[SpecRecord] = field(default_factory=list)
    stores: list[SpecRecord] = field(default_factory=list)
    inconsistent_specs: list[dict[str, Any]] = field(default_factory=list)
    jobs_completed: int = 0

    def __post_init__(self) -> None:
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"unknown worker fault {self.fault!r}; known: {', '.join(FAULTS)}")
        if self.oracle is None and self.blocks_per_chunk is not None:
            config = self.scheduler.kv_cache_config
            self.oracle = KVOracle(
                scheduler=self.scheduler,
                groups=layouts_from_kv_cache_config(config),
                num_gpu_blocks=int(config.num_blocks),
                blocks_per_chunk=self.blocks_per_chunk,
                vocab_size=self.vocab_size,
                offload_group_ids=offload_group_ids(config),
                shared_pages=pages_shared_by_groups(config),
            )

    def _oracle_load(self, job_id: int, cpu_spec: Any, gpu_spec: Any) -> None:
        if self.oracle is None or self.fault == "load_copies_nothing":
            return
        if self.fault == "load_wrong_chunk":
            cpu_spec = _Rotated(cpu_spec)
        self.oracle.load(job_id, cpu_spec, gpu_spec)

    def _compute(self, scheduler_output: Any) -> None:
        """The forward: write each scheduled request's scheduled tokens into its blocks."""
        oracle = self.oracle
        manager = self.scheduler.kv_cache_manager
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            req = self.scheduler.requests.get(req_id)
            if req is None or not num_scheduled:
                continue
            end = int(req.num_computed_tokens)  # schedule() already added the scheduled tokens
            start = end - int(num_scheduled)
            codes = oracle.token_codes(req_id)
            for group, table in enumerate(manager.get_block_ids(req_id)):
                oracle.computed_range(req_id, group, table, start, end, codes)

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
        """Run one step on the simulated GPU; returns a ``ModelRunnerOutput``."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingConnectorMetadata,
            OffloadingWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        completed: dict[int, int] = {}
        finished_recving: set[str] = set()
        stores: list[tuple[int, Any, Any]] = []
        meta = scheduler_output.kv_connector_metadata
        if isinstance(meta, OffloadingConnectorMetadata):
            for job_id, job in meta.store_jobs.items():
                src, dst = _job_specs(job)
                self.stores.append(self._record(job_id, job.req_id, src, is_store=True))
                stores.append((job_id, src, dst))
                completed[job_id] = 1
            for job_id, job in meta.load_jobs.items():
                src, dst = _job_specs(job)
                rec = self._record(job_id, job.req_id, dst, is_store=False)
                if job.req_id in self.scheduler.requests:
                    ids = self.scheduler.kv_cache_manager.get_block_ids(job.req_id)
                    rec.manager_block_ids = [list(map(int, g)) for g in ids]
                self.loads.append(rec)
                self._oracle_load(job_id, src, dst)
                completed[job_id] = 1
                finished_recving.add(job.req_id)
        self.jobs_completed += len(completed)
        if self.oracle is not None:
            # The forward writes every scheduled token's KV before attention reads (per
            # layer, for the whole batch), so a prefix hit on a block another request of
            # the same step computes is valid: write first, then check what is read.
            self._compute(scheduler_output)
            self.oracle.check(scheduler_output)
            for job_id, src, dst in stores:
                self.oracle.store(job_id, src, dst)

        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for req_id in scheduler_output.num_scheduled_tokens:
            req = self.scheduler.requests.get(req_id)
            req_ids.append(req_id)
            if req is not None and req.num_computed_tokens >= req.num_tokens:
                sampled.append([sampled_token(req_id, len(req.output_token_ids), self.vocab_size)])
            else:
                sampled.append([])  # a partial prefill chunk samples nothing
        kv_out = KVConnectorOutput(
            finished_sending=set(),
            finished_recving=finished_recving,
            kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=completed)
            if completed
            else None,
        )
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=kv_out,
        )


class _Rotated:
    """A CPU spec whose chunk ids are rotated by one (the ``load_wrong_chunk`` fault)."""

    def __init__(self, spec: Any):
        import numpy as np

        self.block_ids = np.roll(np.asarray(spec.block_ids), 1)
