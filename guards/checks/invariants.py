"""The offload invariants as pure functions: plain ints in, ints/bools out (stdlib only).

Units are in the names: ``*_tokens`` are tokens, ``*_blocks`` are GPU blocks of
``tokens_per_block`` tokens, ``blocks_per_chunk`` GPU blocks make one offloaded block
(a chunk; older vLLM calls it ``block_size_factor``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = [
    "cdiv",
    "swa_pending_bound",
    "swa_pending_blocks",
    "swa_pending_max",
    "swa_skipped_tokens",
    "mamba_pending_limit",
    "release_tuple",
    "group_sizes_consistency",
]

def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b`` (vLLM's ``cdiv``)."""
    return -(a // -b)


def swa_pending_bound(
    sliding_window_tokens: int, tokens_per_block: int, extra_retained_tokens: int = 0
) -> int:
    """Exact maximum number of pending GPU blocks one load may fill for a sliding-window group.

    ``cdiv(sliding_window_tokens + extra_retained_tokens + tokens_per_block - 1,
    tokens_per_block)`` GPU blocks (vLLM #48959). The window of ``sw`` tokens that
    ends at the last cached token touches at most that many GPU blocks, because its
    first token may sit anywhere inside a block: with ``num_cached_tokens`` whose
    remainder mod ``tokens_per_block`` is 1..tokens_per_block-2 the window straddles
    one more block than ``sw / tokens_per_block``. For window 4096, block 32 this is
    129 (vLLM <= 0.26 asserted 128 and crashed at ``num_cached_tokens = 98012``).

    It is an upper bound of vLLM's own rule (:func:`swa_pending_blocks`) for every
    ``num_cached_tokens``, and equal to the true maximum (:func:`swa_pending_max`)
    except when ``(sliding_window_tokens + extra_retained_tokens) % tokens_per_block ==
    2 % tokens_per_block`` (e.g. any window with ``tokens_per_block == 1``), where the
    true maximum is one block less (checked exhaustively in tests/guards/test_invariants.py).

    Raises ``ValueError`` for a non-positive window or block size, or a negative
    ``extra_retained_tokens`` (MTP tokens retained past the window).
    """
    if sliding_window_tokens <= 0 or tokens_per_block <= 0 or extra_retained_tokens < 0:
        raise ValueError(
            "need sliding_window_tokens > 0, tokens_per_block > 0, extra_retained_tokens >= 0"
        )
    return cdiv(sliding_window_tokens + extra_retained_tokens + tokens_per_block - 1, tokens_per_block)


def swa_pending_max(
    sliding_window_tokens: int, tokens_per_block: int, extra_retained_tokens: int = 0
) -> int:
    """The true maximum of :func:`swa_pending_blocks` over all ``num_cached_tokens`` (GPU blocks).

    vLLM retains ``L = sliding_window + extra_retained_tokens - 1`` tokens before the
    last one; ``L`` consecutive tokens touch at most ``cdiv(L - 1, tokens_per_block) + 1``
    blocks. Same ``ValueError`` cases as :func:`swa_pending_bound`.
    """
    swa_pending_bound(sliding_window_tokens, tokens_per_block, extra_retained_tokens)  # validates
    retained = sliding_window_tokens + extra_retained_tokens - 1
    return cdiv(retained - 1, tokens_per_block) + 1


def swa_skipped_tokens(
    num_computed_tokens: int, sliding_window_tokens: int, extra_retained_tokens: int = 0
) -> int:
    """Tokens vLLM's SlidingWindowManager no longer needs (``get_num_skipped_tokens``).

    ``max(0, num_computed_tokens - sliding_window + 1 - extra_retained_tokens)`` tokens,
    the same rule in vLLM 0.21.0, 0.25.1 and 0.33.0
    (``vllm/v1/core/single_type_kv_cache_manager.py``; ``extra_retained_tokens`` exists
    from 0.33.0 on). Blocks fully inside the skipped prefix are null blocks.
    """
    return max(0, num_computed_tokens - sliding_window_tokens + 1 - extra_retained_tokens)


def swa_pending_blocks(
    num_cached_tokens: int,
    sliding_window_tokens: int,
    tokens_per_block: int,
    extra_retained_tokens: int = 0,
) -> int:
    """GPU blocks a load of ``num_cached_tokens`` (nothing computed locally) fills for a SWA group.

    The brute-force reference of vLLM's own rule: ``cdiv(num_cached_tokens,
    tokens_per_block)`` blocks cover the hit, of which the first
    ``skipped_tokens // tokens_per_block`` are null blocks (never loaded). This is what
    ``update_state_after_alloc`` counts as ``num_pending_gpu_blocks``.
    """
    skipped_blocks = (
        swa_skipped_tokens(num_cached_tokens, sliding_window_tokens, extra_retained_tokens)
        // tokens_per_block
    )
    return cdiv(num_cached_tokens, tokens_per_block) - skipped_blocks


def release_tuple(version: str) -> tuple[int, int, int]:
    """``"0.27.1rc1+cpu"`` -> ``(0, 27, 1)``; stdlib-only, for comparing vLLM releases.

    Raises ``ValueError`` when ``version`` does not start with a number.
    """
    m = re.match(r"v?(\d+)(?:\.(\d+))?(?:\.(\d+))?", version.strip())
    if m is None:
        raise ValueError(f"not a release version: {version!r}")
    major, minor, micro = (int(g) if g is not None else 0 for g in m.groups())
    return (major, minor, micro)


def mamba_pending_limit(blocks_per_chunk: int) -> int:
    """vLLM's own limit for a Mamba group's pending GPU blocks: one chunk (``1 * blocks_per_chunk``).

    Mamba depends on a single state (``get_sliding_window_size_in_blocks`` returns 1),
    so kvguard never loosens this limit: the check is exactly vLLM's.
    """
    return blocks_per_chunk


def group_sizes_consistency(
    block_ids_len: int, group_sizes: Sequence[int], block_indices: Sequence[int]
) -> bool:
    """True when a ``GPULoadStoreSpec``'s groups describe its block ids (vLLM #42945).

    ``sum(group_sizes) == block_ids_len`` (blocks, one entry per non-null GPU block)
    and ``len(block_indices) == len(group_sizes)`` (one entry per KV cache group).
    vLLM 0.21.0's ``_build_store_jobs`` added ``block_size_factor`` per stored chunk even
    when some of its sub-blocks were null (outside the window), so the sum exceeded
    the number of block ids at the window edge.
    """
    return sum(group_sizes) == block_ids_len and len(block_indices) == len(group_sizes)
