"""TEST ONLY: an offloading spec whose loads copy nothing (the control of the greedy
comparison). Loaded by the control server through ``spec_module_path`` with this folder
on ``PYTHONPATH``; never shipped. A load reports its bytes and completes, as a real one,
but the GPU blocks keep whatever they held, so the request runs on wrong KV."""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec, TransferResult

from kvguard.guards.cpu_offloading import CPUPlatformOffloadingSpec, CPUPlatformOffloadingWorker

logger = init_logger("vllm.kvguard.broken_offload")


class NoCopyLoadWorker(CPUPlatformOffloadingWorker):
    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        refs = self._load.refs_per_group
        size = sum(n * sum(r.page_size_bytes for r in refs[g]) for g, n in enumerate(dst_spec.group_sizes))
        logger.info("broken load: job %d, %d bytes NOT copied", job_id, size)
        self._finished.append(TransferResult(job_id=job_id, success=True, transfer_size=size, transfer_time=0.0))
        return True


class NoCopyLoadSpec(CPUPlatformOffloadingSpec):
    def get_worker(self, kv_caches):
        if self._worker is None:
            self._worker = NoCopyLoadWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker


class HungFirstLoadWorker(CPUPlatformOffloadingWorker):
    """The first load job is accepted and never reported (a lost completion); every other
    job copies and completes as the shipped worker's. The fault of the wait-bound test
    (tests/live/test_live_wait_bound.py)."""

    hung: int | None = None

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        if self.hung is None:
            self.hung = job_id
            logger.info("hung load: job %d accepted, never completed", job_id)
            return True
        return super().submit_load(job_id, src_spec, dst_spec)


class HungFirstLoadSpec(CPUPlatformOffloadingSpec):
    def get_worker(self, kv_caches):
        if self._worker is None:
            self._worker = HungFirstLoadWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker
