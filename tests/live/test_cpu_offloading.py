"""The CPU-platform offloading spec moves the real KV bytes (no server; seconds).

vLLM's own spec classes, config dataclasses and load/store specs are used throughout;
only the copies are kvguard's (``kvguard.guards.cpu_offloading``). Layout: two KV cache
tensors (one padded, one strided like a packed cache), two KV cache groups, GPU block =
one page, chunk (offloaded block) = ``BPC`` GPU blocks.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

# vLLM and torch are imported when the tests run, not at collection: `make test-light`
# collects this folder in an environment without vLLM (and deselects it by marker).


def _api() -> SimpleNamespace:
    names = {
        "vllm.v1.kv_offload.base": ("CanonicalKVCacheRef", "CanonicalKVCaches", "CanonicalKVCacheTensor",
                                    "GPULoadStoreSpec"),
        "vllm.v1.kv_offload.config": ("OffloadingCacheConfig", "OffloadingConfig", "OffloadingGroupConfig",
                                      "OffloadingModelConfig", "OffloadingParallelConfig"),
        "vllm.v1.kv_offload.cpu.common": ("CPULoadStoreSpec",),
        "vllm.v1.kv_offload.factory": ("OffloadingSpecFactory",),
        "kvguard.guards.cpu_offloading": ("CPUPlatformOffloadingSpec", "CPUPlatformOffloadingWorker"),
    }
    ns = {n: getattr(importlib.import_module(m), n) for m, ns_ in names.items() for n in ns_}
    ns["torch"] = importlib.import_module("torch")
    ns["np"] = importlib.import_module("numpy")
    return SimpleNamespace(**ns)


A = SimpleNamespace()  # filled by the fixture below, before the first test of the module


@pytest.fixture(autouse=True, scope="module")
def _vllm_api():
    A.__dict__.update(vars(_api()))


pytestmark = [pytest.mark.vllm_server, pytest.mark.live]

BPC = 4            # GPU blocks per chunk
NUM_GPU_BLOCKS = 24
PAGE = 96          # bytes per GPU block page of tensor 0 (64 used + 32 padding)
USED0 = 64         # unpadded page bytes of tensor 0's layer
PAGE1 = 48         # tensor 1: page bytes, inside a row stride of 80 (packed-like)
STRIDE1 = 80


def spec_config(extra: dict, worker_kv_bytes_per_block: int, blocks_per_chunk: int) -> object:
    return A.OffloadingConfig(
        groups=(A.OffloadingGroupConfig(32, ("l0",), 0), A.OffloadingGroupConfig(32, ("l1",), 1)),
        worker_kv_bytes_per_block=worker_kv_bytes_per_block, enable_kv_cache_events=False,
        extra_config=extra, engine_id="t",
        model=A.OffloadingModelConfig(name="tiny", dtype="float32"),
        cache=A.OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=blocks_per_chunk),
        parallel=A.OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def kv_caches() -> tuple:
    """Two random KV cache tensors; group 0 -> tensor 0 (64 of 96 bytes used), group 1 ->
    tensor 1 (48-byte pages at a row stride of 80 bytes)."""
    g = A.torch.Generator().manual_seed(0)
    t0 = A.torch.randint(-128, 128, (NUM_GPU_BLOCKS, PAGE), dtype=A.torch.int8, generator=g)
    back1 = A.torch.randint(-128, 128, (NUM_GPU_BLOCKS, STRIDE1), dtype=A.torch.int8, generator=g)
    t1 = back1.as_strided((NUM_GPU_BLOCKS, PAGE1), (STRIDE1, 1))
    caches = A.CanonicalKVCaches(
        tensors=[A.CanonicalKVCacheTensor(t0, PAGE), A.CanonicalKVCacheTensor(t1, PAGE1)],
        group_data_refs=[[A.CanonicalKVCacheRef(0, USED0)], [A.CanonicalKVCacheRef(1, PAGE1)]],
    )
    return caches, t0, back1


def test_vllm_factory_loads_the_spec_by_module_path_and_its_worker_runs_on_cpu():
    """What `kv_connector_extra_config` does in every vLLM process: vLLM's factory imports
    the module from the installed package and accepts the class (subclass check)."""
    extra = {"spec_name": "CPUPlatformOffloadingSpec", "spec_module_path": "kvguard.guards.cpu_offloading",
             "cpu_bytes_to_use": 10 * 4096}
    cls = A.OffloadingSpecFactory.get_spec_cls(extra)
    assert cls is A.CPUPlatformOffloadingSpec
    spec = cls(spec_config(extra, worker_kv_bytes_per_block=PAGE + PAGE1, blocks_per_chunk=BPC))
    # vLLM's chunk count: cpu_bytes_to_use // round_up(bytes per chunk, alignment)
    assert spec.num_chunks == 10 * 4096 // (-(-(PAGE + PAGE1) * BPC // spec.BLOCK_SIZE_ALIGNMENT)
                                           * spec.BLOCK_SIZE_ALIGNMENT)
    caches, _, _ = kv_caches()
    worker = spec.get_worker(caches)  # vLLM's own get_worker raises here (not CUDA/XPU)
    assert isinstance(worker, A.CPUPlatformOffloadingWorker) and spec.get_worker(caches) is worker
    assert worker.cpu_pages[0].shape == (spec.num_chunks * BPC, PAGE)


def test_a_load_serves_the_stored_kv_across_groups_skips_and_sub_blocks():
    caches, t0, back1 = kv_caches()
    w = A.CPUPlatformOffloadingWorker(caches, blocks_per_chunk=BPC, num_cpu_chunks=8)
    stored0 = t0.clone()
    stored1 = back1.clone()
    # Store: group 0 = logical GPU blocks 0..5 of a request (chunk-aligned start, 6 blocks ->
    # chunks 2 and 5, the second half-filled); group 1 = logical blocks 6..9 (starts 2 pages
    # into a chunk: skip 2 -> chunks 3 and 7).
    g0_gpu, g1_gpu = [3, 7, 1, 12, 20, 5], [9, 2, 15, 11]
    assert w.submit_store(1, A.GPULoadStoreSpec(g0_gpu + g1_gpu, [6, 4], [0, 6]), A.CPULoadStoreSpec([2, 5, 3, 7]))
    [done] = w.get_finished()
    assert (done.job_id, done.success, done.transfer_size) == (1, True, 6 * USED0 + 4 * PAGE1)
    assert w.get_finished() == []
    # Chunk pages hold exactly those GPU blocks, in order, after the skip.
    host0 = w.cpu_pages[0].view(8, BPC, PAGE)
    for i, b in enumerate(g0_gpu):
        chunk, page = [2, 5][i // BPC], i % BPC
        assert A.torch.equal(host0[chunk, page, :USED0], stored0[b, :USED0])
    host1 = w.cpu_pages[1].view(8, BPC, PAGE1)
    for i, b in enumerate(g1_gpu):
        chunk, page = [3, 7][(i + 2) // BPC], (i + 2) % BPC
        assert A.torch.equal(host1[chunk, page], stored1[b, :PAGE1])
    assert not host1[3, :2].any()  # the skipped pages were never written

    # The engine reuses the GPU blocks; the load brings the KV back into other blocks:
    # group 0 from logical block 4 (page 0 of chunk 5: blocks 4, 5), group 1 from logical
    # block 7 (skip 3 of chunk 3, then chunk 7: blocks 7, 8, 9).
    t0.random_(-128, 127)
    back1.random_(-128, 127)
    before1 = back1.clone()
    dst0, dst1 = [0, 23], [4, 6, 8]
    assert w.submit_load(2, A.CPULoadStoreSpec([5, 3, 7]), A.GPULoadStoreSpec(dst0 + dst1, [2, 3], [4, 7]))
    [done] = w.get_finished()
    assert done.transfer_size == 2 * USED0 + 3 * PAGE1
    assert A.torch.equal(t0[dst0, :USED0], stored0[[20, 5], :USED0])
    assert A.torch.equal(back1[dst1, :PAGE1], stored1[[2, 15, 11], :PAGE1])
    # Bytes outside the pages (tensor 1's stride gap) and other blocks are untouched.
    assert A.torch.equal(back1[:, PAGE1:], before1[:, PAGE1:])
    untouched = [b for b in range(NUM_GPU_BLOCKS) if b not in dst1]
    assert A.torch.equal(back1[untouched], before1[untouched])


def test_mismatched_specs_are_refused_as_upstream():
    caches, _, _ = kv_caches()
    w = A.CPUPlatformOffloadingWorker(caches, blocks_per_chunk=BPC, num_cpu_chunks=4)
    with pytest.raises(AssertionError):  # 5 GPU blocks need 2 chunks, one given
        w.submit_store(1, A.GPULoadStoreSpec([0, 1, 2, 3, 4], [5, 0], [0, 0]), A.CPULoadStoreSpec([0]))
    with pytest.raises(AssertionError):  # one chunk left unused
        w.submit_store(1, A.GPULoadStoreSpec([0, 1], [2, 0], [0, 0]), A.CPULoadStoreSpec([0, 1]))
    assert A.np.array_equal(w.cpu_pages[0].numpy(), A.np.zeros_like(w.cpu_pages[0].numpy()))


def test_page_rows_is_vllms_own_page_enumeration():
    from vllm.v1.kv_offload.cpu.gpu_worker import _canonical_page_ids

    from kvguard.guards.cpu_offloading import page_rows

    ids = A.np.array([5, 2, 9], dtype=A.np.int32)
    for bpc, count, skip in ((1, 3, 0), (1, 2, 0), (4, 12, 0), (4, 9, 3), (4, 5, 2), (2, 1, 1)):
        assert page_rows(ids, bpc, count, skip).tolist() == _canonical_page_ids(ids, bpc, count, skip).tolist()
    assert page_rows(ids, 4, 5, 2).tolist() == [22, 23, 8, 9, 10]
