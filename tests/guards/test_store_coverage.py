"""The store coverage invariant (guards/checks/store_coverage.py, issue 22) against a simulation.

Exhaustive over small tables: vLLM's store builder (``_build_store_jobs``, 0.25.1-0.34.0:
walk each stored chunk's blocks in the connector's table, skip id 0, ``block_indices`` =
the first copied block's logical index) builds the spec; the copy engine places the
``k``-th copied block at sub-block ``(skip + k) % bpc`` of the ``(skip + k) // bpc``-th
stored chunk (``transfer_async``). The truth: a store is sound exactly when every placed
block sits at its own logical place and every sub-block of a stored chunk that gets
nothing was skipped by the request's KV cache manager (``(j + 1) * tpb <= skipped``).
:func:`group_store_problems` must say "sound" exactly then.
"""

from __future__ import annotations

import itertools

from kvguard.guards.checks.store_coverage import (
    GroupStore,
    group_store_problems,
    store_in_place,
    stored_end_block,
    uncomputed_problem,
)


def build_store(table: list[int], stored_chunks: list[int], bpc: int) -> tuple[list[int], int, list[int]]:
    """(copied ids, block_indices entry, their logical positions) as vLLM's loop builds them."""
    copied, positions, start = [], [], None
    for c in stored_chunks:
        for i in range(bpc):
            pos = c * bpc + i
            if table[pos] == 0:
                continue
            if start is None:
                start = pos
            copied.append(table[pos])
            positions.append(pos)
    return copied, start or 0, positions


def sound(table, stored_chunks, bpc, tpb, skipped, copied, first, positions) -> bool:
    skip = first % bpc
    placed = {}
    for k, pos in enumerate(positions):
        m, s = divmod(skip + k, bpc)
        if m >= len(stored_chunks):
            return False  # more blocks than stored chunks
        placed[(m, s)] = pos
    for m, c in enumerate(stored_chunks):
        for s in range(bpc):
            want = c * bpc + s
            got = placed.get((m, s))
            if got is None:
                if (want + 1) * tpb > skipped:
                    return False  # live KV left out of a published chunk
            elif got != want:
                return False  # a block copied to another block's place
    return True


import pytest


@pytest.mark.parametrize("bpc", [2, 3])
def test_the_check_says_sound_exactly_when_the_copy_is(bpc):
    tpb = 4
    cases = fast_cases = 0
    for n_chunks in (1, 2, 3):
        n = n_chunks * bpc
        # each position: live (its own id), zeroed (0), or a duplicate of an earlier id
        for pattern in itertools.product((0, 1, 2), repeat=n):
            table = []
            for j, kind in enumerate(pattern):
                if kind == 1:
                    table.append(100 + j)
                elif kind == 0:
                    table.append(0)
                else:
                    table.append(table[j - 1] if j and table[j - 1] else 100 + j)
            for stored in itertools.chain.from_iterable(
                itertools.combinations(range(n_chunks), r) for r in range(1, n_chunks + 1)
            ):
                stored = list(stored)
                # vLLM publishes a chunk only when its last block is non-zero
                if any(table[c * bpc + bpc - 1] == 0 for c in stored):
                    continue
                copied, first, positions = build_store(table, stored, bpc)
                if len(set(positions)) != len(positions):
                    continue
                for skipped in (0, 4, 8, 12, 40):
                    kept = 1000  # only num_tokens - kept matters: choose num_tokens to give `skipped`
                    g = GroupStore(table, copied, first, tpb, bpc, kept, kept + skipped)
                    truth = sound(table, stored, bpc, tpb, skipped, copied, first, positions)
                    assert (group_store_problems(g) == []) == truth, (table, stored, skipped, group_store_problems(g))
                    # the fast path (issue 31) never calls an unsound store sound
                    fast = store_in_place(table, copied, first, tpb, bpc, kept, kept + skipped)
                    assert not fast or truth, (table, stored, skipped)
                    fast_cases += fast
                    cases += 1
    assert cases > 500
    assert fast_cases > cases // 10  # and it is the usual answer, not a path never taken


def test_the_vllm_029_finding():
    """The fuzz finding on 0.29.0 (tests/vllm/traces/wrong-kv-stale-zeroing.jsonl): a
    sliding-window group, chunk 2 = blocks 16..23, blocks 16 and 17 zeroed by the
    connector's stale-id pass although the request (134 tokens, window 176) holds them."""
    table = list(range(100, 132))
    table[16] = table[17] = 0
    g = GroupStore(table, table[18:32], 18, 4, 8, 176 - 1 + 8, 134)
    assert group_store_problems(g) == [
        "left_out: logical blocks 16..17 of the first stored chunk hold live KV (skipped tokens 0) and are not copied"
    ]
    # the same zeros below the request's window are vLLM's own skip: sound (0.25.1's
    # straddling store of seed-42945 is this case)
    assert group_store_problems(GroupStore(table, table[18:32], 18, 4, 8, 183, 72 + 183)) == []


def test_full_attention_skips_nothing():
    table = [0] + list(range(1, 16))
    assert group_store_problems(GroupStore(table, table[1:16], 1, 8, 8, None, 10_000))[0].startswith("left_out")


def test_a_store_ends_at_its_last_chunk_and_within_the_computed_kv() -> None:
    """Where a store's last published chunk ends (blocks), read as the copy engine places
    the copied blocks: in place from ``first_index``, or in runs at later chunk boundaries
    when chunks in between were stored before; and the ``uncomputed`` rule on it (vLLM
    0.26.0-0.29.0's final store of a finished request counts its never-computed last token)."""
    table = list(range(100, 148))  # 48 blocks, 8 per chunk
    # in place: blocks 18..31 copied (the first chunk from sub-block 2): the store ends at 32
    assert stored_end_block(table, table[18:32], 18, 8) == 32
    # chunks 2 and 4 stored, chunk 3 already held by the tier: the second run sits at 32
    assert stored_end_block(table, table[16:24] + table[32:40], 16, 8) == 40
    # 4 tokens per block: the store ends at token 160
    assert uncomputed_problem(40, 4, 160) is None
    late = uncomputed_problem(40, 4, 159)
    assert late == ("uncomputed: a stored chunk ends at token 160, the request's KV is written "
                    "up to token 159 (num_computed_tokens + scheduled)")
