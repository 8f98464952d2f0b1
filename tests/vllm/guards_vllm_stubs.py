"""Arguments for calling vLLM's *real* ``OffloadingConnectorScheduler.update_state_after_alloc``.

The function under test is vLLM's own (installed, rewritten by kvguard); only the state
it reads is built here: the scheduler instance (``object.__new__`` of the real class,
with the attributes that function touches), the request status, and ``KVCacheBlocks``-
shaped blocks: ``num_null`` null blocks (outside the window) followed by fresh blocks
(``block_hash is None``), exactly what vLLM's KV cache manager hands over for a load.

The offload keys object raises :class:`PastTheWindowCheck` on ``len()``: the first
thing each release does right after the SWA assert. Reaching it means the SWA check let
the load continue; everything later in the function (prepare_load, jobs) is not
needed to judge the check. The end-to-end path is ``kvguard replay`` (guards/replay).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

class PastTheWindowCheck(Exception):
    """Raised after the SWA pending-block check passed or was tolerated."""


class _Keys:
    def __len__(self) -> int:
        raise PastTheWindowCheck

    def __getitem__(self, item: Any) -> Any:
        raise PastTheWindowCheck


def sliding_window_spec(sliding_window: int, tokens_per_block: int) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(
        block_size=tokens_per_block, num_kv_heads=1, head_size=64, dtype=torch.float16,
        sliding_window=sliding_window,
    )


def load_call(
    *,
    num_cached_tokens: int,
    num_null_blocks: int,
    sliding_window: int = 4096,
    tokens_per_block: int = 32,
    blocks_per_chunk: int = 8,
) -> tuple[Any, tuple]:
    """(scheduler, args) for ``scheduler.update_state_after_alloc(*args)``: one SWA group."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        GroupOffloadConfig,
        OffloadingConnectorScheduler,
    )
    from vllm.utils.math_utils import cdiv

    spec = sliding_window_spec(sliding_window, tokens_per_block)
    chunk = tokens_per_block * blocks_per_chunk
    window_chunks = cdiv(sliding_window, chunk)
    new_names = "tokens_per_block" in GroupOffloadConfig._fields  # #48150 renames
    num_gpu_blocks = cdiv(num_cached_tokens, tokens_per_block)
    blocks = [
        SimpleNamespace(is_null=i < num_null_blocks, block_hash=None, block_id=0 if i < num_null_blocks else 1000 + i)
        for i in range(num_gpu_blocks)
    ]
    sched = object.__new__(OffloadingConnectorScheduler)
    if new_names:
        group_config = SimpleNamespace(
            group_idx=0, tokens_per_block=tokens_per_block, tokens_per_chunk=chunk,
            sliding_window_size_in_chunks=window_chunks, kv_cache_spec=spec, is_eagle_group=False,
        )
        sched.config = SimpleNamespace(kv_group_configs=(group_config,), blocks_per_chunk=blocks_per_chunk)
        sched._acquire_step = lambda: None
        sched._current_batch_sync_loads = set()
    else:
        group_config = SimpleNamespace(
            group_idx=0, gpu_block_size=tokens_per_block, offloaded_block_size=chunk,
            sliding_window_size_in_blocks=window_chunks,
        )
        sched.config = SimpleNamespace(kv_group_configs=(group_config,), block_size_factor=blocks_per_chunk)
        # what kvguard's geometry wrap records when vLLM constructs the scheduler
        sched._kvguard_kv_specs = {0: spec}
    sched._current_batch_allocated_block_ids = set()
    req_status = SimpleNamespace(
        num_locally_computed_tokens=0,
        req_context=SimpleNamespace(kv_transfer_params=None),
        group_states=(SimpleNamespace(offload_keys=_Keys()),),
        partial_tail_boundary=None,
        load_key_ranges=[],
        loaded_from_offload=False,
    )
    request = SimpleNamespace(request_id="req-98012")
    sched._req_status = {request.request_id: req_status}
    return sched, (request, SimpleNamespace(blocks=[blocks]), num_cached_tokens)
