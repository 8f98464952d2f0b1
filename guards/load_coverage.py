"""The load set of an offload cache hit, as pure functions (stdlib only).

Invariant (issue 9, item 1): *every chunk that a load will read is present and
readable in the offload tier when the hit is admitted*. vLLM's lookup
(``OffloadingConnectorScheduler._lookup`` / ``_lookup_complete_chunks``) decides a hit
from the chunks it scans; the load job is built later, in ``update_state_after_alloc``,
from the GPU blocks the real ``KVCacheManager`` allocated. When the two disagree, the
load reads a chunk nobody looked up, and ``prepare_load`` asserts ``Block ... not found
in cache`` (or ``not ready``) and EngineCore dies. This module computes, from the
geometry alone, the chunks the load reads, so the hit can be checked before vLLM
admits it (:mod:`kvguard.guards.admission`).

Units are in the names: ``*_tokens`` are tokens; GPU blocks hold ``tokens_per_block``
tokens; a chunk (an offloaded block; ``block_size_factor`` / ``blocks_per_chunk`` GPU
blocks) holds ``tokens_per_chunk = tokens_per_block * blocks_per_chunk`` tokens. Chunk
*indices* count chunks of the request from token 0 (index ``i`` covers tokens
``[i * tokens_per_chunk, (i + 1) * tokens_per_chunk)``), the indices of the group's
``offload_keys`` list.

Derivation (vLLM 0.25.1 and 0.33.0 ``update_state_after_alloc``, read in the installed
source; the same rule in both):

- ``num_cached_tokens = num_computed_tokens + num_external_tokens`` (the hit's end; it
  may fall inside a GPU block), ``num_gpu_blocks = cdiv(num_cached_tokens,
  tokens_per_block)``;
- the load starts at the first GPU block that is neither null nor a local (hashed)
  prefix-cache block: the local prefix is ``num_computed_tokens // tokens_per_block``
  blocks (vLLM asserts it is block aligned), and for a sliding-window group the real
  ``SlidingWindowManager`` allocates null blocks for the tokens it no longer needs,
  ``swa_skipped_tokens(num_cached_tokens)`` (:func:`kvguard.guards.invariants.swa_skipped_tokens`),
  i.e. ``skipped // tokens_per_block`` whole GPU blocks;
- the load reads ``offload_keys[load_start_block // blocks_per_chunk :
  cdiv(num_cached_tokens, tokens_per_chunk)]``, nothing when no GPU block is pending.

Tested against the real ``KVCacheManager`` and ``update_state_after_alloc`` over many
geometries in ``tests/vllm/test_load_coverage_vllm.py`` (the chunk set of the real load
job equals :func:`load_chunks`), and by brute force in ``tests/guards/test_load_coverage.py``.
Mamba groups (one recurrent state, vLLM 0.25+) are not modelled: :class:`GroupGeometry`
has no Mamba kind, and :mod:`kvguard.guards.admission` does not check such a model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvguard.guards.invariants import cdiv

__all__ = [
    "GroupGeometry",
    "load_chunk_bounds",
    "load_chunks",
    "load_set",
    "load_set_size",
    "longest_loadable_hit",
]


@dataclass(frozen=True, slots=True)
class GroupGeometry:
    """One KV cache group as the offloading connector sees it.

    ``tokens_per_block``: tokens per GPU block of this group; ``blocks_per_chunk``: GPU
    blocks per chunk (offloaded block); ``sliding_window_tokens``: the window of a
    ``SlidingWindowSpec`` group, None for full attention; ``extra_retained_tokens``:
    tokens a sliding-window group keeps past the window (MTP, vLLM 0.33+; 0 before).
    ``ValueError`` (from :meth:`validate`) for non-positive sizes or a negative extra.
    """

    tokens_per_block: int
    blocks_per_chunk: int
    sliding_window_tokens: int | None = None
    extra_retained_tokens: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.tokens_per_block <= 0 or self.blocks_per_chunk <= 0:
            raise ValueError("need tokens_per_block > 0 and blocks_per_chunk > 0")
        if self.sliding_window_tokens is not None and self.sliding_window_tokens <= 0:
            raise ValueError("need sliding_window_tokens > 0 (or None for full attention)")
        if self.extra_retained_tokens < 0:
            raise ValueError("need extra_retained_tokens >= 0")

    @property
    def tokens_per_chunk(self) -> int:
        """Tokens per chunk (offloaded block)."""
        return self.tokens_per_block * self.blocks_per_chunk


def load_chunk_bounds(
    tokens_per_block: int,
    blocks_per_chunk: int,
    retained_tokens: int | None,
    num_computed_tokens: int,
    num_cached_tokens: int,
) -> tuple[int, int]:
    """``(first, stop)`` chunk indices of one group's load (``first == stop``: no load).

    The arithmetic core of :func:`load_chunks`, on plain ints for the admission check's
    hot path: ``retained_tokens`` is ``sliding_window_tokens + extra_retained_tokens``
    (None for full attention). The first loaded GPU block is
    ``max(num_computed_tokens // tokens_per_block, skipped // tokens_per_block)`` with
    ``skipped = max(0, num_cached_tokens - retained_tokens + 1)`` (vLLM's
    ``get_num_skipped_tokens``); the load reads its chunk up to
    ``cdiv(num_cached_tokens, tokens_per_block * blocks_per_chunk)``. No validation.
    """
    num_gpu_blocks = -(-num_cached_tokens // tokens_per_block)
    start = num_computed_tokens // tokens_per_block
    if retained_tokens is not None:
        skipped = num_cached_tokens - retained_tokens + 1
        if skipped > 0 and skipped // tokens_per_block > start:
            start = skipped // tokens_per_block
    if start >= num_gpu_blocks:
        return (0, 0)
    return (start // blocks_per_chunk, -(-num_cached_tokens // (tokens_per_block * blocks_per_chunk)))


def load_chunks(group: GroupGeometry, num_computed_tokens: int, num_cached_tokens: int) -> range:
    """Chunk indices one group's load reads for a hit ending at ``num_cached_tokens``.

    ``num_computed_tokens``: tokens computed locally (the GPU prefix-cache hit passed to
    ``get_num_new_matched_tokens``; a multiple of ``tokens_per_block`` in vLLM);
    ``num_cached_tokens``: local + external hit tokens. Returns an empty range when the
    load fills no GPU block of this group. Raises ``ValueError`` when
    ``0 <= num_computed_tokens <= num_cached_tokens`` does not hold.
    """
    if not 0 <= num_computed_tokens <= num_cached_tokens:
        raise ValueError("need 0 <= num_computed_tokens <= num_cached_tokens")
    retained = (
        None if group.sliding_window_tokens is None else group.sliding_window_tokens + group.extra_retained_tokens
    )
    first, stop = load_chunk_bounds(
        group.tokens_per_block, group.blocks_per_chunk, retained, num_computed_tokens, num_cached_tokens
    )
    return range(first, stop)


def load_set(groups: Sequence[GroupGeometry], num_computed_tokens: int, num_cached_tokens: int) -> list[range]:
    """Per KV cache group (in ``groups`` order), :func:`load_chunks`."""
    return [load_chunks(g, num_computed_tokens, num_cached_tokens) for g in groups]


def load_set_size(groups: Sequence[GroupGeometry], num_computed_tokens: int, num_cached_tokens: int) -> int:
    """Chunks (offloaded blocks, all groups together) the load of a hit ending at
    ``num_cached_tokens`` reads: the sum of :func:`load_set`'s range lengths.

    Every group's chunks are distinct offload keys (vLLM's ``make_offload_key`` folds the
    group index into the key), so this is the number of CPU-tier slots the whole load set
    occupies at once. ``ValueError`` as :func:`load_chunks`.
    """
    return sum(len(chunks) for chunks in load_set(groups, num_computed_tokens, num_cached_tokens))


def longest_loadable_hit(
    groups: Sequence[GroupGeometry],
    num_computed_tokens: int,
    num_cached_tokens: int,
    loadable: Callable[[int, int], bool],
) -> int:
    """The longest external hit (tokens beyond ``num_computed_tokens``) whose load set is loadable.

    ``loadable(group_index, chunk_index)`` says whether that chunk is present and ready.
    The answer is ``num_cached_tokens - num_computed_tokens`` when the whole load set of
    the given hit is loadable; otherwise the longest shorter hit that ends on a chunk
    boundary of every group (a multiple of the lcm of the groups' ``tokens_per_chunk``),
    is at least one such chunk long (vLLM never admits a hit under one chunk) and whose
    load set is loadable; 0 when there is none (vLLM recomputes the whole prefix).
    """
    if not groups:
        return num_cached_tokens - num_computed_tokens

    def ok(end: int) -> bool:
        return all(
            loadable(g, c) for g, chunks in enumerate(load_set(groups, num_computed_tokens, end)) for c in chunks
        )

    if ok(num_cached_tokens):
        return num_cached_tokens - num_computed_tokens
    step = math.lcm(*(g.tokens_per_chunk for g in groups))
    end = ((num_cached_tokens - 1) // step) * step
    while end - num_computed_tokens >= step:
        if ok(end):
            return end - num_computed_tokens
        end -= step
    return 0
