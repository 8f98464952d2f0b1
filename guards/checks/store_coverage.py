"""Store coverage: a chunk an offload store publishes holds every block it stands for.

The invariant (checked by :func:`kvguard.guards.checks.asserts.check_store` where vLLM's
store builder constructs a store's ``GPULoadStoreSpec``): **every GPU block of a chunk that
a store publishes is copied into that chunk's place, except blocks the request's KV cache
manager has already skipped** (a sliding-window or Mamba group frees the blocks wholly
below what it keeps, ``get_num_skipped_tokens``; those are null in vLLM's tables and nobody
in the window reads them).

Why (vLLM's own code, the same in 0.25.1-0.34.0): the store builder
(``OffloadingConnectorScheduler._build_store_jobs``) walks each stored chunk's GPU blocks in
the connector's own copy of the request's block table (``RequestGroupState.block_ids``)
and skips every block id 0 ("a sliding window / SSM skip or a stale entry that was zeroed
out"); the spec lists the rest of a group's blocks one after another from
``block_indices[g]``, and the copy engine places the ``i``-th of them at sub-block
``(skip + i) % blocks_per_chunk`` of the ``(skip + i) // blocks_per_chunk``-th CPU chunk,
``skip = block_indices[g] % blocks_per_chunk`` (``transfer_async`` in
``vllm/v1/kv_offload/cpu/gpu_worker.py``; ``iter_pointer_groups`` on 0.34.0). The store then
marks each chunk's key stored. So a block id that is 0 although the request still holds
that block's KV

- at the start of the first stored chunk: the chunk is published with those sub-blocks
  never written;
- anywhere after a copied block: every later block of the group is copied one place too
  early (the KV of one chunk lands in the next chunk's place).

A later hit loads such a chunk into GPU blocks its attention reads: wrong KV, served
silently. kvguard's fuzzer found the first kind on vLLM 0.29.0 (docs/fuzz.md, "The
stale-block zeroing misfire"): since PR #42959 (the #42761 fix) the connector zeroes a
sliding-window block id of a request when the same id appears among the step's newly
allocated blocks, which it takes for "freed by the window and re-allocated"; but a GPU
prefix-cache hit of another request in the same step lists the *shared* blocks among its
new blocks too, so a block the request still holds is zeroed and left out of its chunk.

Which zeros are legal is vLLM's skip rule, not a table: a block ``j`` of a group that
keeps ``kept_tokens`` tokens (:attr:`kvguard.guards.checks.load_coverage.GroupGeometry.kept_tokens`:
``sliding_window - 1 + extra_retained_tokens`` for a window, 1 for Mamba, None for full
attention, which skips nothing) may be null when it lies wholly below the skipped tokens
of the request, ``(j + 1) * tokens_per_block <= num_tokens - kept_tokens``; ``num_tokens``
is the request's token count (the most it can have skipped: the check never calls a
legal skip a violation).

A second way to publish a chunk without its KV: **every slot of a published chunk holds KV
the request computed**, i.e. the last stored chunk ends at or before the request's written
extent, ``num_computed_tokens + num_scheduled_tokens`` (vLLM's own account of the positions
whose KV the step's forward leaves in the GPU blocks; :func:`uncomputed_problem`). vLLM
0.26.0 and 0.29.0 break it with ``offload_prompt_only: false``: the store builder's final
pass over a finished request offloads up to ``req.num_tokens``, which counts the last
sampled token, whose KV no forward ever wrote; a chunk ending there is published with a
stale slot and a later turn that carries the output loads it (kvguard's fuzz, seed 0 of
the guarded suite, 0.29.0; vLLM PR #54288, in 0.33.0, clamps the final store to
``num_tokens - 1``, "the final sampled token's slot is never committed", and 0.34.0 to
``num_computed_tokens``).
Plain ints in, a list of problems out; stdlib only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["GroupStore", "group_store_problems", "store_in_place", "stored_end_block", "uncomputed_problem"]


@dataclass(frozen=True)
class GroupStore:
    """One KV cache group's part of a store, in the connector's terms.

    ``table``: the connector's copy of the request's block ids for this group (0 = null);
    ``copied``: the block ids the spec lists for this group, in order; ``first_index``:
    the spec's ``block_indices`` entry (logical GPU block of the first copied block);
    ``tokens_per_block``, ``blocks_per_chunk``: the group's geometry; ``kept_tokens``:
    tokens the group keeps at the end of a request (None: full attention, nothing skipped);
    ``num_tokens``: the request's tokens (the skipped tokens are ``num_tokens - kept_tokens``).
    """

    table: Sequence[int]
    copied: Sequence[int]
    first_index: int
    tokens_per_block: int
    blocks_per_chunk: int
    kept_tokens: int | None
    num_tokens: int


def group_store_problems(g: GroupStore) -> list[str]:
    """What would publish a chunk of this group without its KV; empty when the store is sound.

    The copy engine puts copied block ``i`` at
    sub-block ``(skip + i) % blocks_per_chunk`` of the ``(skip + i) // blocks_per_chunk``-th
    stored chunk, ``skip = first_index % blocks_per_chunk``. Problems (GPU blocks):

    - ``moved``: a run of copied blocks that the table does not hold, in order, at the
      chunk place the copy engine puts them (a block left out after a copied one shifts
      every later one into the wrong sub-block);
    - ``left_out``: a logical block of the first stored chunk before ``first_index`` that the
      request has not skipped (it holds live KV the published chunk lacks), or a last
      stored chunk whose final sub-blocks get nothing.
    """
    bpc, tpb = g.blocks_per_chunk, g.tokens_per_block
    if not g.copied:
        return []
    # lists as they come (the connector's block table is one): a copy per store was most
    # of the check's cost on long requests
    table = g.table if type(g.table) is list else list(g.table)
    copied = g.copied if type(g.copied) is list else list(g.copied)
    skip = g.first_index % bpc
    problems: list[str] = []
    # the table holds the copied blocks one after another from first_index: every run of
    # the walk below matches at the first place it is looked for (run 0 at first_index,
    # each next one at the chunk boundary where the previous ended), so nothing is moved
    # and only the ends are left to check (the usual store: one slice comparison)
    in_place = table[g.first_index : g.first_index + len(copied)] == copied
    _end, moved = _walk_runs(table, copied, g.first_index, bpc, in_place)
    if moved:
        problems.append(moved)
    skipped = 0 if g.kept_tokens is None else max(0, g.num_tokens - g.kept_tokens)
    start = (g.first_index // bpc) * bpc
    live = [j for j in range(start, g.first_index) if (j + 1) * tpb > skipped]
    if live:
        problems.append(
            f"left_out: logical blocks {live[0]}..{live[-1]} of the first stored chunk hold live KV "
            f"(skipped tokens {skipped}) and are not copied"
        )
    if (skip + len(copied)) % bpc:
        problems.append(
            f"left_out: the last stored chunk gets {(skip + len(copied)) % bpc} of its {bpc} sub-blocks"
        )
    return problems


def _walk_runs(table: list[int], copied: list[int], first_index: int, bpc: int,
               in_place: bool) -> tuple[int, str | None]:
    """``(logical GPU block just past the last copied block, the ``moved`` problem or None)``
    as the copy engine places the copied blocks (see :func:`group_store_problems`)."""
    if in_place:
        return first_index + len(copied), None
    # Walk the copied blocks chunk run by chunk run, as the copy engine places them: run r
    # fills sub-blocks (skip if r == 0 else 0)..bpc-1 of the r-th stored chunk. The first
    # run starts at first_index; a later run must be a whole chunk of the table, after the
    # previous run, that holds exactly the run's ids in order (an id can also appear
    # elsewhere in the table: a block the window freed and the allocator handed back,
    # vLLM #42761, so each candidate chunk is matched whole).
    skip = first_index % bpc
    k = 0
    prev_end = first_index
    while k < len(copied):
        sub0 = skip if k == 0 else 0
        run = copied[k : k + bpc - sub0]
        if k == 0:
            start_at = first_index if table[first_index : first_index + len(run)] == run else None
        else:
            # the first chunk that matches (a sound store: the next one; the scan goes on
            # only past a mismatch)
            start_at = next((
                c for c in range(-(-prev_end // bpc) * bpc, len(table), bpc)
                if table[c : c + len(run)] == run
            ), None)
        if start_at is None:
            at = table.index(run[0], prev_end) if run[0] in table[prev_end:] else None
            return prev_end, (
                f"moved: copied block {k} (id {run[0]}) goes to sub-block {sub0} of stored chunk "
                f"{(skip + k) // bpc}, but the table holds it at {at}"
            )
        prev_end = start_at + len(run)
        k += len(run)
    return prev_end, None


def stored_end_block(table: Sequence[int], copied: list[int], first_index: int, blocks_per_chunk: int) -> int:
    """The logical GPU block index where the last chunk a group's store publishes ends
    (a multiple of ``blocks_per_chunk``; blocks, not tokens). ``table``: the connector's
    copy of the request's block ids for the group; ``copied``: the spec's ids for the
    group; ``first_index``: its ``block_indices`` entry. A store whose runs are not found in
    the table (``moved``) ends where the walk stopped."""
    if not copied:
        return (first_index // blocks_per_chunk) * blocks_per_chunk
    table = table if type(table) is list else list(table)
    in_place = table[first_index : first_index + len(copied)] == copied
    end, _moved = _walk_runs(table, copied, first_index, blocks_per_chunk, in_place)
    return -(-end // blocks_per_chunk) * blocks_per_chunk


def uncomputed_problem(end_block: int, tokens_per_block: int, written_tokens: int) -> str | None:
    """The ``uncomputed`` problem of a store whose last published chunk ends at logical
    block ``end_block`` (:func:`stored_end_block`) of a group with ``tokens_per_block``,
    for a request whose KV is written up to ``written_tokens`` tokens
    (``num_computed_tokens`` plus the tokens the step schedules for it); None when every
    slot of the store's chunks holds computed KV. Source: vLLM 0.33.0's clamp of the final
    store ("the final sampled token's slot is never committed"), which 0.26.0-0.29.0 lack."""
    end_tokens = end_block * tokens_per_block
    if end_tokens <= written_tokens:
        return None
    return (f"uncomputed: a stored chunk ends at token {end_tokens}, the request's KV is written "
            f"up to token {written_tokens} (num_computed_tokens + scheduled)")


def store_in_place(table: Sequence[int], copied: list[int], first_index: int, tokens_per_block: int,
                   blocks_per_chunk: int, kept_tokens: int | None, num_tokens: int) -> bool:
    """True when the group's store is the usual sound one, read without building a
    :class:`GroupStore` (same fields, GPU blocks and tokens): the table holds the copied
    blocks one after another from ``first_index`` (one slice comparison), no live block of
    the first stored chunk precedes ``first_index`` and the last stored chunk is full. Then
    :func:`group_store_problems` is empty (the walk finds each run where it first looks);
    False says only "not this shape": call :func:`group_store_problems` for the verdict.
    """
    if not copied:
        return True
    if type(table) is not list or type(copied) is not list:
        return False  # compared element-wise elsewhere (group_store_problems makes lists)
    skip = first_index % blocks_per_chunk
    if (skip + len(copied)) % blocks_per_chunk:
        return False
    # the first stored chunk's blocks before first_index must all be skipped: the last of
    # them, first_index - 1, wholly below the skipped tokens
    if skip and (kept_tokens is None or first_index * tokens_per_block > num_tokens - kept_tokens):
        return False
    return table[first_index : first_index + len(copied)] == copied
