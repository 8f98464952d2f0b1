"""The copy ledger's arithmetic against a slot-by-slot model of vLLM's copy engine.

The model is written from ``transfer_async`` (``vllm/v1/kv_offload/cpu/gpu_worker.py``): a
spec's group part of ``n`` ids from logical block ``first`` fills sub-block ``(skip + i) %
bpc`` of the ``(skip + i) // bpc``-th destination chunk, ``skip = first % bpc``. A slot is
right when it received the id the request's table holds at that logical block and the id
is not the null block 0. The ledger must say exactly that, and the admission side must
name a loaded block exactly when the load writes it from a slot that is not right.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.guards.checks import copy_ledger
from kvguard.guards.checks.copy_ledger import CopyLedger, chunk_masks, destination_chunks, first_uncopied_block


def _record_group_store(ledger, group, table, copied, first_index, blocks_per_chunk, offload_keys,
                        keys_to_store) -> bool:
    """One group's part of a store, as ``asserts._record_copies`` records every group's:
    :func:`copy_ledger.group_store_writes`, then ``room_for``, then ``record``; False
    (nothing recorded) when the ledger has no room."""
    writes = copy_ledger.group_store_writes(ledger, group, table, copied, first_index, blocks_per_chunk,
                                            offload_keys, keys_to_store)
    if writes is None:
        return True
    full = (1 << blocks_per_chunk) - 1
    if not ledger.room_for([(group, *writes)], [full]):
        return False
    ledger.record(group, writes[0], writes[1], full)
    return True


def _slots_written(table, copied, first, bpc, chunks):
    """{(logical chunk, sub-block): id written}, the copy engine's placement."""
    skip = first % bpc
    out = {}
    for i, bid in enumerate(copied):
        r, s = divmod(skip + i, bpc)
        if r < len(chunks):
            out[(chunks[r], s)] = bid
    return out


def _right(table, written, c, s, bpc):
    bid = written.get((c, s))
    pos = c * bpc + s
    return bid is not None and bid != 0 and pos < len(table) and table[pos] == bid


@st.composite
def _store(draw):
    bpc = draw(st.integers(1, 5))
    nchunks = draw(st.integers(1, 6))
    table = draw(st.lists(st.integers(0, 9), min_size=nchunks * bpc, max_size=nchunks * bpc + bpc - 1))
    first = draw(st.integers(0, len(table) - 1))
    n = draw(st.integers(1, len(table) - first))
    if draw(st.booleans()):  # the usual store: the table's ids in place
        copied = list(table[first : first + n])
    else:
        copied = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    return bpc, table, first, copied


@settings(max_examples=400, deadline=None)
@given(_store())
def test_masks_match_the_copy_engine(store) -> None:
    bpc, table, first, copied = store
    count = -(-(first % bpc + len(copied)) // bpc)
    chunks = list(range(first // bpc, first // bpc + count))
    masks = chunk_masks(table, copied, first, bpc, chunks)
    written = _slots_written(table, copied, first, bpc, chunks)
    for r, c in enumerate(chunks):
        for s in range(bpc):
            assert bool(masks[r] >> s & 1) == _right(table, written, c, s, bpc), (r, s, masks)


def test_a_null_placeholder_and_a_skipped_start_are_not_copied() -> None:
    # 0.34.0 lists the null page 0 as a placeholder; 0.33.0 starts after the nulls (skip 2)
    table = [0, 0, 7, 8, 9, 10, 11, 12]
    assert chunk_masks(table, [0, 0, 7, 8], 0, 4, [0]) == [0b1100]
    assert chunk_masks(table, [7, 8, 9, 10, 11, 12], 2, 4, [0, 1]) == [0b1100, 0b1111]
    # a block left out after a copied one shifts the rest: those slots are wrong too
    assert chunk_masks([1, 2, 0, 4, 5, 6, 7, 8], [1, 2, 4, 5, 6, 7, 8], 0, 4, [0, 1]) == [0b0011, 0b0000]


def test_destination_chunks_follow_the_stored_keys_in_order() -> None:
    keys = ["k0", "k1", "k2", "k3", "k4"]
    assert destination_chunks(keys, {"k1", "k3", "k4"}, 1, 2) == [1, 3]
    assert destination_chunks(keys, {"k3"}, 0, 2) == [3]  # ran out: the caller sees it short


def _loaded_blocks(tpb, kept, local, n):
    start = local // tpb
    if kept is not None and n - kept > 0:
        start = max(start, (n - kept) // tpb)
    return range(start, -(-n // tpb))


@settings(max_examples=400, deadline=None)
@given(
    tpb=st.integers(1, 4), bpc=st.integers(1, 4), nchunks=st.integers(1, 5),
    kept=st.one_of(st.none(), st.integers(1, 20)), data=st.data(),
)
def test_the_first_uncopied_block_is_the_first_loaded_wrong_slot(tpb, bpc, nchunks, kept, data) -> None:
    keys = [f"k{c}" for c in range(nchunks)]
    masks = data.draw(st.lists(st.integers(0, (1 << bpc) - 1), min_size=nchunks, max_size=nchunks))
    ledger = {k: m for k, m in zip(keys, masks) if m != (1 << bpc) - 1}
    n = data.draw(st.integers(1, nchunks * bpc * tpb))
    local = data.draw(st.integers(0, n // tpb)) * tpb
    want = next((b for b in _loaded_blocks(tpb, kept, local, n)
                 if keys[b // bpc] in ledger and not ledger[keys[b // bpc]] >> (b % bpc) & 1), -1)
    assert first_uncopied_block(tpb, bpc, kept, local, n, keys, ledger) == want


def test_the_issue_class_a_window_wider_than_the_chunk_end_reads_the_skipped_sub_blocks() -> None:
    # chunk 1 (blocks 4..7, tokens 16..31) stored with its first two sub-blocks null for the
    # storing request; a reader whose hit ends at 32 with a 40-token window loads from 0
    keys = ["k0", "k1"]
    ledger = {"k1": 0b1100}
    assert first_uncopied_block(4, 4, 39, 0, 32, keys, ledger) == 4
    # a reader whose window starts past them (hit ending at 32, window 8) is fine
    assert first_uncopied_block(4, 4, 7, 0, 32, keys, ledger) == -1
    # full attention after a local hit of 24 tokens loads blocks 6, 7 only
    assert first_uncopied_block(4, 4, None, 24, 32, keys, ledger) == -1


def test_the_ledger_keeps_partial_chunks_only_and_refuses_past_its_bound() -> None:
    ledger = CopyLedger(2, limit=3)
    ledger.record(0, ["a", "b"], [0b0011, 0b1111], 0b1111)
    assert ledger.groups[0] == {"a": 0b0011} and ledger.size == 1
    ledger.record(0, ["a"], [0b1111], 0b1111)  # a whole re-store of the key forgets it
    assert ledger.groups[0] == {} and ledger.size == 0
    four_new = [(1, ["c", "d", "e", "f"], [1, 2, 3, 4])]
    assert not ledger.room_for(four_new, [0b1111])  # 4 new entries > 3: refused, never a FIFO
    assert ledger.room_for([(1, ["c", "d", "e", "f"], [1, 2, 3, 0b1111])], [0b1111])  # a whole chunk costs nothing
    ledger.record(1, ["c", "d", "e"], [1, 2, 3], 0b1111)
    assert ledger.room_for([(1, ["c"], [5])], [0b1111])  # re-recording a held key takes no room
    assert not ledger.room_for([(0, ["c"], [5])], [0b1111])  # the same key in another group does
    # _record_group_store asks first: a full ledger records nothing and says so
    assert not _record_group_store(ledger, 0, [0, 0, 7, 8], [0, 0, 7, 8], 0, 4, ["k0"], {"k0"})
    assert ledger.groups[0] == {} and ledger.size == 3


def test_an_evicted_key_is_forgotten_only_without_secondary_tiers() -> None:
    ledger = CopyLedger(2)
    ledger.record(0, ["a", "b"], [1, 2], 0b1111)
    ledger.record(1, ["a"], [3], 0b1111)
    ledger.forget_evicted(["a", "zzz"])  # evicted from the CPU tier: gone in every group
    assert ledger.groups == [{"b": 2}, {}] and ledger.size == 1
    tiered = CopyLedger(1, forget_on_whole_store=False)
    tiered.record(0, ["a"], [1], 0b1111)
    tiered.forget_evicted(["a"])  # its partial copy may have been cascaded to a secondary tier
    assert tiered.groups == [{"a": 1}] and tiered.size == 1


def test_the_bound_is_read_when_a_ledger_is_made(monkeypatch) -> None:
    monkeypatch.setattr(copy_ledger, "LEDGER_MAX", 2)
    assert CopyLedger(1).limit == 2


def test_the_fast_path_records_what_the_slow_path_would() -> None:
    table = [5, 6, 7, 8, 9, 10, 11, 12]
    keys = ["k0", "k1"]
    ledger = CopyLedger(1)
    ledger.record(0, ["k1"], [0b0001], 0b1111)  # an old partial copy of k1
    _record_group_store(ledger, 0, table, table[:], 0, 4, keys, {"k0", "k1"})
    assert ledger.groups[0] == {} and ledger.size == 0
    _record_group_store(ledger, 0, [0, 0, 7, 8], [0, 0, 7, 8], 0, 4, ["k0"], {"k0"})
    assert ledger.groups[0] == {"k0": 0b1100}


@settings(max_examples=400, deadline=None)
@given(_store(), st.data())
def test_record_group_store_records_the_copy_engines_masks(store, data) -> None:
    """Whichever path it takes (the usual store's test in C, or the masks), the ledger ends
    as recording the slow path's destination chunks and masks would leave it."""
    bpc, table, first, copied = store
    nchunks = -(-len(table) // bpc) + 1
    keys = [f"k{c}" for c in range(nchunks)]
    stored = {k for k in keys if data.draw(st.integers(0, 4)) > 0}  # most keys are to store
    old = {k: data.draw(st.integers(1, (1 << bpc) - 2)) for k in keys if data.draw(st.booleans())} \
        if bpc > 1 else {}
    ledger, expected = CopyLedger(1), CopyLedger(1)
    for target in (ledger, expected):
        if old:
            target.record(0, list(old), list(old.values()), (1 << bpc) - 1)
    _record_group_store(ledger, 0, table, copied, first, bpc, keys, stored)
    count = -(-(first % bpc + len(copied)) // bpc)
    chunks = destination_chunks(keys, stored, first // bpc, count)
    expected.record(0, [keys[c] for c in chunks], chunk_masks(table, copied, first, bpc, chunks), (1 << bpc) - 1)
    assert ledger.groups[0] == expected.groups[0]


def test_with_secondary_tiers_a_whole_re_store_forgets_nothing() -> None:
    # the partial copy may live on in a secondary tier and be promoted back (0.29.0, seed 1)
    ledger = CopyLedger(1, forget_on_whole_store=False)
    ledger.record(0, ["k"], [0b10], 0b11)
    ledger.record(0, ["k"], [0b11], 0b11)
    assert ledger.groups[0] == {"k": 0b10} and ledger.size == 1


def test_with_secondary_tiers_a_partial_re_store_keeps_only_the_slots_both_copies_hold() -> None:
    """A tier may keep the older copy of a key (a failed or skipped re-store; vLLM 0.34.0's
    fs tier never overwrites a file it holds), so after two partial stores of one key the
    ledger vouches only for the slots both copies hold; a reader of slot 0 or 1 is cut."""
    ledger = CopyLedger(1, forget_on_whole_store=False)
    ledger.record(0, ["k"], [0b1110], 0b1111)  # the first copy lacks slot 0
    ledger.record(0, ["k"], [0b1101], 0b1111)  # the re-store lacks slot 1
    assert ledger.groups[0] == {"k": 0b1100} and ledger.size == 1
    assert first_uncopied_block(4, 4, None, 0, 16, ["k"], ledger.groups[0]) == 0
    ledger.record(0, ["k"], [0b1111], 0b1111)  # a whole re-store vouches for nothing more
    assert ledger.groups[0] == {"k": 0b1100}
    plain = CopyLedger(1)  # without tiers only the newest copy exists: it replaces
    plain.record(0, ["k"], [0b1110], 0b1111)
    plain.record(0, ["k"], [0b1101], 0b1111)
    assert plain.groups[0] == {"k": 0b1101}
