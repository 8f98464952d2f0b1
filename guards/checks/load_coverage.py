"""The load set of an offload cache hit, as pure functions (stdlib only).

Invariant: *every chunk that a load will read is present and
readable in the offload tier when the hit is admitted*. vLLM's lookup
(``OffloadingConnectorScheduler._lookup`` / ``_lookup_complete_chunks``) decides a hit
from the chunks it scans; the load job is built later, in ``update_state_after_alloc``,
from the GPU blocks the real ``KVCacheManager`` allocated. When the two disagree, the
load reads a chunk nobody looked up, and ``prepare_load`` asserts ``Block ... not found
in cache`` (or ``not ready``) and EngineCore dies. This module computes, from the
geometry alone, the chunks the load reads, so the hit can be checked before vLLM
admits it (:mod:`kvguard.guards.checks.admission`).

Units are in the names: ``*_tokens`` are tokens; GPU blocks hold ``tokens_per_block``
tokens; a chunk (an offloaded block; ``block_size_factor`` / ``blocks_per_chunk`` GPU
blocks) holds ``tokens_per_chunk = tokens_per_block * blocks_per_chunk`` tokens. Chunk
*indices* count chunks of the request from token 0 (index ``i`` covers tokens
``[i * tokens_per_chunk, (i + 1) * tokens_per_chunk)``), the indices of the group's
``offload_keys`` list.

Derivation (``update_state_after_alloc`` read in the installed source: vLLM 0.25.1 and
0.33.0 for full-attention and sliding-window groups, 0.33.0 and 0.34.0 for all three kinds
of the table below; the same rule in each):

- ``num_cached_tokens = num_computed_tokens + num_external_tokens`` (the hit's end; it
  may fall inside a GPU block), ``num_gpu_blocks = cdiv(num_cached_tokens,
  tokens_per_block)``;
- the load starts at the first GPU block that is neither null nor a local (hashed)
  prefix-cache block: the local prefix is ``num_computed_tokens // tokens_per_block``
  blocks (vLLM asserts it is block aligned), and the real single-type manager of the
  group pads ``get_num_skipped_tokens(num_cached_tokens) // tokens_per_block`` null
  blocks in front of the blocks it allocates for the hit
  (``SingleTypeKVCacheManager.add_local_computed_blocks`` pads them,
  ``allocate_external_computed_blocks`` allocates ``cdiv(num_cached_tokens,
  tokens_per_block)`` minus what the request holds: ``vllm/v1/core/
  single_type_kv_cache_manager.py:317`` and ``:368`` in 0.34.0, ``:312`` and ``:363`` in
  0.33.0);
- the load reads ``offload_keys[load_start_block // blocks_per_chunk :
  cdiv(num_cached_tokens, tokens_per_chunk)]``, nothing when no GPU block is pending
  (0.34.0 ``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py:1554-1583``:
  the scan for the first non-null block without a hash from ``cdiv(num_computed_tokens,
  tokens_per_block)``, then the key slice; 0.33.0 the same code at ``:1401-1430``).

So a group's load set follows from the tokens its manager skips at the hit's end, and
kvguard writes that as the tokens it *keeps*: ``kept_tokens`` (:attr:`GroupGeometry.kept_tokens`)
with ``skipped = num_cached_tokens - kept_tokens`` (none for full attention):

============================  ==========================  ================================
group (spec class, by MRO)    vLLM's skipped tokens        ``kept_tokens``
============================  ==========================  ================================
full attention                0 (the base class)           None
``SlidingWindowSpec``         ``max(0, n - sliding_window  ``sliding_window - 1 +
                              + 1 - extra_retained)``      extra_retained_tokens``
``MambaSpec``                 ``n - 1``                    1
============================  ==========================  ================================

(``n``: ``num_cached_tokens``; a group's kind is read from its spec's class lineage, as
vLLM's own ``isinstance`` tests do, never from the release.)

The Mamba rule: ``MambaManager.get_num_skipped_tokens`` returns ``num_computed_tokens - 1``
("Mamba only need to keep the state of the last computed token":
``single_type_kv_cache_manager.py:1976-1981`` in 0.34.0, ``:1971-1976`` in 0.33.0) and
``MambaManager`` overrides neither ``add_local_computed_blocks`` nor
``allocate_external_computed_blocks``, so a hit ending at ``n`` tokens leaves
``(n - 1) // tokens_per_block`` null blocks and one new block, the one holding token
``n - 1``: the load of a Mamba group is exactly one GPU block and reads exactly one chunk,
``(n - 1) // tokens_per_chunk`` (the chunk holding the state at the hit's end), whatever
the local hit (it is always below that block). vLLM's own bound for such a group,
``sliding_window_size_in_chunks * blocks_per_chunk + 1`` pending blocks with a window of
one chunk (``offloading/config.py`` ``get_sliding_window_size_in_chunks``: "Mamba depends
on a single state"), holds with room to spare (check ``mamba_state_limit``). In
``mamba_cache_mode="align"`` vLLM's lookup rounds the hit down to a multiple of the Mamba
group's chunk (``_mamba_align_size``: ``scheduler.py:939`` in 0.34.0, ``:879`` in 0.33.0),
so there the chunk read is the hit's last; a partial-tail hit (0.33+) loads a boundary key instead and is not modelled
(:mod:`kvguard.guards.checks.admission` skips it).

Tested against the real ``KVCacheManager`` and ``update_state_after_alloc`` over many
geometries in ``tests/vllm/test_load_coverage_vllm.py`` (the chunk set of the real load
job equals :func:`load_chunks`; Mamba groups in both cache modes), and by brute force in
``tests/guards/test_load_coverage.py``. Other group kinds (e.g. ``ChunkedLocalAttentionSpec``,
whose manager skips ``n // attention_chunk_size * attention_chunk_size`` tokens) are not
modelled: :class:`GroupGeometry` has no such kind, and :mod:`kvguard.guards.checks.admission`
skips the check for a connector scheduler that has one (``kvguard_check_skipped_total``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class Unsupported(Exception):
    """The check cannot be made on this connector scheduler: kvguard cannot model or read
    what it needs (message: what). ``reason``: one of
    :data:`kvguard.guards.names.SKIP_REASONS`, the ``reason`` label of
    ``kvguard_check_skipped_total`` (not a guard error: nothing in kvguard failed).
    Raised by the admission check (``kvguard.guards.checks.admission``, which re-exports it) and
    met by the store check (``kvguard.guards.policy.runtime``): defined here, a module both can
    import (admission imports runtime)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason

__all__ = [
    "GroupGeometry",
    "Unsupported",
    "load_block_bounds",
    "load_chunk_bounds",
    "load_chunks",
    "load_set",
    "load_set_size",
    "longest_hit",
    "longest_loadable_hit",
]


@dataclass(frozen=True, slots=True)
class GroupGeometry:
    """One KV cache group as the offloading connector sees it.

    ``tokens_per_block``: tokens per GPU block of this group; ``blocks_per_chunk``: GPU
    blocks per chunk (offloaded block); ``sliding_window_tokens``: the window of a
    ``SlidingWindowSpec`` group, None otherwise; ``extra_retained_tokens``: tokens a
    sliding-window group keeps past the window (MTP, vLLM 0.33+; 0 before);
    ``recurrent_state``: True for a ``MambaSpec`` group (one recurrent state per request:
    vLLM keeps only the block holding the state of the last computed token). Neither of
    the last two: full attention. ``ValueError`` (from :meth:`validate`) for non-positive
    sizes, a negative extra, or a group that is both a window and a recurrent state.
    """

    tokens_per_block: int
    blocks_per_chunk: int
    sliding_window_tokens: int | None = None
    extra_retained_tokens: int = 0
    recurrent_state: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.tokens_per_block <= 0 or self.blocks_per_chunk <= 0:
            raise ValueError("need tokens_per_block > 0 and blocks_per_chunk > 0")
        if self.sliding_window_tokens is not None and self.sliding_window_tokens <= 0:
            raise ValueError("need sliding_window_tokens > 0 (or None for full attention)")
        if self.extra_retained_tokens < 0:
            raise ValueError("need extra_retained_tokens >= 0")
        if self.recurrent_state and (self.sliding_window_tokens is not None or self.extra_retained_tokens):
            raise ValueError("a recurrent-state (Mamba) group has no sliding window and no extra_retained_tokens")

    @property
    def tokens_per_chunk(self) -> int:
        """Tokens per chunk (offloaded block)."""
        return self.tokens_per_block * self.blocks_per_chunk

    @property
    def kept_tokens(self) -> int | None:
        """Tokens at the end of a hit whose GPU blocks the group keeps: vLLM's manager skips
        (pads with null blocks) ``num_cached_tokens - kept_tokens`` tokens when that is
        positive. ``sliding_window_tokens - 1 + extra_retained_tokens`` for a sliding window
        (``SlidingWindowManager.get_num_skipped_tokens``), 1 for a recurrent state
        (``MambaManager.get_num_skipped_tokens``: ``num_computed_tokens - 1``), None for full
        attention (nothing skipped). Module docstring: where in vLLM."""
        if self.recurrent_state:
            return 1
        if self.sliding_window_tokens is None:
            return None
        return self.sliding_window_tokens - 1 + self.extra_retained_tokens


def load_chunk_bounds(
    tokens_per_block: int,
    blocks_per_chunk: int,
    kept_tokens: int | None,
    num_computed_tokens: int,
    num_cached_tokens: int,
) -> tuple[int, int]:
    """``(first, stop)`` chunk indices of one group's load (``first == stop``: no load).

    The arithmetic core of :func:`load_chunks`, on plain ints for the admission check's
    hot path: ``kept_tokens`` is :attr:`GroupGeometry.kept_tokens` (None for full
    attention). The first loaded GPU block is ``max(num_computed_tokens //
    tokens_per_block, skipped // tokens_per_block)`` with ``skipped = num_cached_tokens -
    kept_tokens`` when positive (vLLM's ``get_num_skipped_tokens`` of the group's
    manager); the load reads its chunk up to ``cdiv(num_cached_tokens, tokens_per_block *
    blocks_per_chunk)``. No validation.
    """
    start, num_gpu_blocks = load_block_bounds(tokens_per_block, kept_tokens, num_computed_tokens, num_cached_tokens)
    if start >= num_gpu_blocks:
        return (0, 0)
    return (start // blocks_per_chunk, -(-num_cached_tokens // (tokens_per_block * blocks_per_chunk)))


def load_block_bounds(tokens_per_block: int, kept_tokens: int | None, num_computed_tokens: int,
                      num_cached_tokens: int) -> tuple[int, int]:
    """``(start, stop)``: the logical GPU blocks one group's load writes, ``[start, stop)``
    (``start >= stop``: none). ``stop = cdiv(num_cached_tokens, tokens_per_block)``;
    ``start = max(num_computed_tokens // tokens_per_block, skipped // tokens_per_block)``
    with ``skipped = num_cached_tokens - kept_tokens`` when positive (module docstring).
    Tokens in, blocks out; no validation."""
    stop = -(-num_cached_tokens // tokens_per_block)
    start = num_computed_tokens // tokens_per_block
    if kept_tokens is not None:
        skipped = num_cached_tokens - kept_tokens
        if skipped > 0 and skipped // tokens_per_block > start:
            start = skipped // tokens_per_block
    return start, stop


def load_chunks(group: GroupGeometry, num_computed_tokens: int, num_cached_tokens: int) -> range:
    """Chunk indices one group's load reads for a hit ending at ``num_cached_tokens``.

    ``num_computed_tokens``: tokens computed locally (the GPU prefix-cache hit passed to
    ``get_num_new_matched_tokens``; a multiple of ``tokens_per_block`` in vLLM);
    ``num_cached_tokens``: local + external hit tokens. Returns an empty range when the
    load fills no GPU block of this group; for a recurrent-state (Mamba) group it is the
    one chunk ``(num_cached_tokens - 1) // tokens_per_chunk``. Raises ``ValueError`` when
    ``0 <= num_computed_tokens <= num_cached_tokens`` does not hold.
    """
    if not 0 <= num_computed_tokens <= num_cached_tokens:
        raise ValueError("need 0 <= num_computed_tokens <= num_cached_tokens")
    first, stop = load_chunk_bounds(
        group.tokens_per_block, group.blocks_per_chunk, group.kept_tokens, num_computed_tokens, num_cached_tokens
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
    def ok(end: int) -> bool:
        return all(
            loadable(g, c) for g, chunks in enumerate(load_set(groups, num_computed_tokens, end)) for c in chunks
        )

    return longest_hit(groups, num_computed_tokens, num_cached_tokens, ok)


def longest_hit(
    groups: Sequence[GroupGeometry],
    num_computed_tokens: int,
    num_cached_tokens: int,
    ok: Callable[[int], bool],
) -> int:
    """The longest external hit (tokens beyond ``num_computed_tokens``) ending at an ``end``
    for which ``ok(end)`` holds: the given hit when ``ok(num_cached_tokens)``, else the
    longest shorter one that ends on a chunk boundary of every group (a multiple of the lcm
    of the groups' ``tokens_per_chunk``) and is at least one such step long; 0 when none
    is. :func:`longest_loadable_hit` with its own ``ok``; the admission check also asks
    copy coverage (:mod:`kvguard.guards.checks.copy_ledger`) in ``ok``."""
    if not groups:
        return num_cached_tokens - num_computed_tokens
    if ok(num_cached_tokens):
        return num_cached_tokens - num_computed_tokens
    step = math.lcm(*(g.tokens_per_chunk for g in groups))
    end = ((num_cached_tokens - 1) // step) * step
    while end - num_computed_tokens >= step:
        if ok(end):
            return end - num_computed_tokens
        end -= step
    return 0
