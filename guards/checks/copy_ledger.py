"""Copy coverage: a load places inside a reader's read range only slots a store copied.

The end-to-end invariant behind "never wrong KV" on the offload path: **every GPU block
that a load of an offload hit writes holds KV that a store really copied into that chunk
slot from the GPU block holding those positions.** A load writes exactly the GPU blocks
``[start, cdiv(num_cached_tokens, tokens_per_block))`` of each KV cache group, ``start``
the first block that is neither a local prefix-cache block nor one the group's manager
skips (:func:`kvguard.guards.checks.load_coverage.load_chunk_bounds`), and every one of them lies
inside the widest read range of the reader's first step: ``[0, n)`` for full attention,
``[n - sliding_window + 1 - reprefill, n)`` for a sliding window with ``reprefill`` up to
``extra_retained_tokens`` (the MTP rejection re-prefill, PR #48892), the one block holding
token ``n - 1`` for Mamba (``n = num_cached_tokens``; docs/fuzz.md, "Which blocks must hold
the right KV"). So the rule needs no per-kind read range: every loaded slot must have
been copied. ``reprefill`` is taken at its widest because admission runs before the
request's speculative tokens are known.

Why a ledger (vLLM 0.33.0 / 0.34.0, traced in docs/upstream/swa-partial-chunk.md): the
store builder (``OffloadingConnectorScheduler._build_store_jobs``) publishes a
sliding-window chunk whose first sub-blocks are null for the *storing* request (its window
has moved past them, or a GPU prefix-cache hit supplied only the last window's blocks),
because its reachability mask looks only at where that request could resume. The key is
content-addressed: a later request whose hit ends at that chunk's end reads those
sub-blocks inside its window and gets KV nobody copied (0.33.0 leaves the CPU slots as they
were; 0.34.0 copies the zeroed null page). Whether a sub-block is legal to leave out
depends on the *reader*, so the store cannot judge it; the admission check can, if it
knows which slots each chunk really holds. kvguard sees every chunk store's
``GPULoadStoreSpec`` where vLLM builds it (:func:`kvguard.guards.checks.asserts.check_store`), so it
keeps that knowledge here.

What is kept: per connector scheduler and KV cache group, ``offload key -> mask`` for each
chunk a store wrote *partly* (bit ``s`` set: sub-block ``s`` was copied from the GPU block
the request's table holds at that logical position, and that block is not the null block
0). A chunk written whole is not kept, so the usual full-attention store costs one slice
comparison and leaves nothing behind. Only a store that goes ahead is recorded (a store the
``store_coverage`` check drops writes nothing). When is an entry forgotten: only when no
tier can still hold the key's partial copy, so a key the ledger does not hold was written
whole (the soundness the admission check rests on, at any size):

- when the CPU tier evicts the key (``PrepareStoreOutput.evicted_keys``, a declared field
  in 0.21.0-0.34.0), only when no secondary tier can hold a partial copy
  (``forget_on_whole_store``: no tiering, or tiering with partial chunks withheld from
  every tier, :mod:`kvguard.guards.checks.tier_publish`, under ``guard`` and ``strict``):
  an evicted key is gone, and it comes back only through a store that kvguard sees or as a
  whole copy promoted from a tier; under ``observe`` with tiering the partial copy may have
  been cascaded and be promoted back later;
- on a whole re-store of the key, under the same condition, for the same reason (found
  by ``kvguard fuzz --seed 1`` on 0.29.0: a re-store of a partial key that
  ``store_coverage`` then dropped had erased the entry, and the tier's partial copy was
  loaded). Where a tier may hold a partial copy (``observe`` with tiering) a partial
  re-store does not replace the entry either: it keeps
  the slots both copies hold (:meth:`CopyLedger.record`), since the tier that holds the
  older copy may not have taken the new one (vLLM 0.34.0's fs tier never overwrites a file
  it holds, ``vllm/v1/kv_offload/tiering/fs/io.py``; a failed or skipped store leaves the old
  copy too).

Never at a bound. The ledger holds at most :data:`LEDGER_MAX` entries per scheduler; a
store that would need more is refused whole (:meth:`CopyLedger.room_for`; the store check
drops it under ``guard`` and ``strict``: its chunks are not published, their readers
recompute), so a partial chunk is never published unremembered (dropping the oldest entry
instead, as a FIFO would, lets a later reader of that chunk load it unchecked: issue 42
reports it on 0.33.0 and 0.34.0 with the bound lowered in-process). Without tiering the evictions
keep the ledger no larger than the CPU tier's partly written chunks, so the refusal is
reached only by a CPU tier holding more than :data:`LEDGER_MAX` of them.

Which slots a store writes is the copy engine's rule (``transfer_async`` in
``vllm/v1/kv_offload/cpu/gpu_worker.py``, 0.21.0-0.34.0; :mod:`kvguard.guards.checks.store_coverage`):
the spec lists group ``g``'s ``group_sizes[g]`` block ids from logical block
``block_indices[g]``; ``skip = block_indices[g] % blocks_per_chunk``; id ``i`` lands in
sub-block ``(skip + i) % blocks_per_chunk`` of the group's ``(skip + i) //
blocks_per_chunk``-th destination chunk, and the group's destination chunks are its
offload keys that the store writes (``keys_to_store``), in chunk order from the chunk
holding ``block_indices[g]`` (the builder walks ``group_state.offload_keys`` in order and
keeps those in ``keys_to_store``: the same in every release).

Not covered (written down, counted where it matters): stores built elsewhere than the
chunk store builder (0.33+'s boundary-key stores for Mamba hand-offs and partial tails:
a partial-tail hit is skipped by the admission check anyway, and a Mamba group's load is
one block, the boundary state those stores write).

Plain ints and lists in, masks out; stdlib only.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from kvguard.guards.checks.load_coverage import load_block_bounds

__all__ = [
    "LEDGER_ATTR",
    "LEDGER_MAX",
    "CopyLedger",
    "destination_chunks",
    "group_store_writes",
    "chunk_masks",
    "first_uncopied_block",
]

#: partly written chunks kept per connector scheduler (all groups); a store that would need
#: more is refused (module docstring). Read when a ledger is made, so a test can lower it.
#: Memory: docs/degrade.md "Copy coverage" (measured with bench/ledger_memory.py). A partly
#: written chunk is one per sliding-window group at the edge of a storing request's window.
LEDGER_MAX = 1 << 20
#: attribute on each connector scheduler instance: its :class:`CopyLedger` (made at its first store)
LEDGER_ATTR = "_kvguard_copy_ledger"


def destination_chunks(offload_keys: Sequence[Any], keys_to_store: Collection[Any],
                       first_chunk: int, count: int) -> list[int]:
    """The logical chunk indices (of ``offload_keys``) a group's part of a store writes, in
    the copy engine's order: the first ``count`` chunks from ``first_chunk`` on whose key
    is in ``keys_to_store``. Shorter than ``count`` when the keys run out (a store the
    builder could not have made: the caller treats the missing chunks as unwritten)."""
    out: list[int] = []
    c = first_chunk
    n = len(offload_keys)
    while len(out) < count and c < n:
        if offload_keys[c] in keys_to_store:
            out.append(c)
        c += 1
    return out


def chunk_masks(table: Sequence[int], copied: Sequence[int], first_index: int, blocks_per_chunk: int,
                chunks: Sequence[int]) -> list[int]:
    """Per destination chunk (``chunks``, logical chunk indices in order), the mask of its
    sub-blocks the store copies right: bit ``s`` of mask ``r`` is set when copied id ``i =
    r * blocks_per_chunk + s - skip`` exists, is not the null block 0, and is the id the
    request's table holds at logical block ``chunks[r] * blocks_per_chunk + s``
    (``skip = first_index % blocks_per_chunk``). ``table``: the connector's block ids of
    the group; ``copied``: the group's ids in the spec. A full chunk's mask is
    ``(1 << blocks_per_chunk) - 1``."""
    bpc = blocks_per_chunk
    skip = first_index % bpc
    ncopied = len(copied)
    ntable = len(table)
    masks = []
    for r, c in enumerate(chunks):
        mask = 0
        base = c * bpc
        for s in range(bpc):
            i = r * bpc + s - skip
            if 0 <= i < ncopied:
                bid = copied[i]
                if bid and base + s < ntable and table[base + s] == bid:
                    mask |= 1 << s
        masks.append(mask)
    return masks


def first_uncopied_block(tokens_per_block: int, blocks_per_chunk: int, kept_tokens: int | None,
                         num_computed_tokens: int, num_cached_tokens: int, offload_keys: Sequence[Any],
                         ledger: dict) -> int:
    """The first GPU block (logical index) that the load of a hit ending at
    ``num_cached_tokens`` (tokens) writes from a chunk slot no store copied, or -1.

    ``num_computed_tokens``: the local prefix-cache hit (tokens); ``kept_tokens``: as
    :attr:`kvguard.guards.checks.load_coverage.GroupGeometry.kept_tokens` (None: full attention);
    ``ledger``: this group's ``key -> mask`` of partly written chunks (a key not in it was
    written whole). The loaded blocks are those of
    :func:`~kvguard.guards.checks.load_coverage.load_chunk_bounds`; chunks past ``offload_keys``
    are the load coverage check's business (not looked at here)."""
    bpc = blocks_per_chunk
    start, stop = load_block_bounds(tokens_per_block, kept_tokens, num_computed_tokens, num_cached_tokens)
    if start >= stop:
        return -1
    last = min(-(-stop // bpc), len(offload_keys))
    for c in range(start // bpc, last):
        mask = ledger.get(offload_keys[c])
        if mask is None:
            continue
        lo = max(start, c * bpc) - c * bpc
        hi = min(stop, (c + 1) * bpc) - c * bpc
        want = ((1 << hi) - 1) ^ ((1 << lo) - 1)
        if mask & want != want:
            missing = want & ~mask
            return c * bpc + (missing & -missing).bit_length() - 1
    return -1


class CopyLedger:
    """The partly written chunks of one connector scheduler: ``groups[g]`` maps an offload
    key of KV cache group ``g`` to its copied sub-block mask (module docstring).

    ``limit``: the most entries held (all groups; default :data:`LEDGER_MAX`, read at
    construction); ``refused``: stores refused since the admission check last read it,
    because the ledger had no room for their partial chunks (counted as ``ledger_full``);
    ``unreadable``: why a store could not be recorded (None while every store was), after
    which the admission check skips copy coverage on this scheduler."""

    __slots__ = ("groups", "size", "refused", "limit", "unreadable", "forget_on_whole_store")

    def __init__(self, num_groups: int, limit: int | None = None, forget_on_whole_store: bool = True) -> None:
        self.forget_on_whole_store = forget_on_whole_store
        self.groups: list[dict] = [{} for _ in range(num_groups)]
        self.size = 0
        self.refused = 0
        self.limit = LEDGER_MAX if limit is None else limit
        self.unreadable: str | None = None

    def any(self) -> bool:
        """Whether any partly written chunk is known."""
        return self.size > 0

    def room_for(self, writes: Sequence[tuple[int, Sequence[Any], Sequence[int]]], full_masks: Sequence[int]) -> bool:
        """Whether recording ``writes`` (``(group, keys, masks)`` each, as
        :meth:`record` takes them; ``full_masks[i]`` the whole-chunk mask of ``writes[i]``)
        keeps the ledger within ``limit``: the new entries are the partial masks of keys
        the group does not hold yet."""
        new = 0
        for (group, keys, masks), full in zip(writes, full_masks):
            ledger = self.groups[group]
            for key, mask in zip(keys, masks):
                if mask != full and key not in ledger:
                    new += 1
        return self.size + new <= self.limit

    def record(self, group: int, keys: Sequence[Any], masks: Sequence[int], full: int) -> None:
        """Record the masks of one group's written chunks (``keys[r]`` got ``masks[r]``);
        a whole chunk (``full``) drops the key's earlier entry, if any, when
        ``forget_on_whole_store`` (module docstring). Where a secondary tier may hold a
        partial copy (not ``forget_on_whole_store``) a key's copies may differ from tier to tier (a re-store
        that fails, that backpressure skips, or that a tier does not overwrite leaves the
        older copy there), so the key keeps the slots every recorded copy holds: the
        intersection of its masks, whatever each tier's overwrite rule. May pass ``limit``:
        the caller asks :meth:`room_for` first."""
        ledger = self.groups[group]
        keep_all = not self.forget_on_whole_store
        for key, mask in zip(keys, masks):
            if mask == full:
                if not keep_all and ledger and ledger.pop(key, None) is not None:
                    self.size -= 1
                continue
            old = ledger.get(key)
            if old is None:
                self.size += 1
            elif keep_all:
                mask &= old
            ledger[key] = mask

    def forget_evicted(self, keys: Iterable[Any]) -> None:
        """Forget ``keys`` the CPU tier evicted, in every group, when no secondary tier can
        hold their copies (``forget_on_whole_store``; module docstring)."""
        if not self.forget_on_whole_store or not self.size:
            return
        for key in keys:
            for ledger in self.groups:
                if ledger and ledger.pop(key, None) is not None:
                    self.size -= 1


def group_store_writes(ledger: CopyLedger, group: int, table: Sequence[int], copied: Sequence[int],
                       first_index: int, blocks_per_chunk: int, offload_keys: Sequence[Any],
                       keys_to_store: Collection[Any]) -> tuple[list[Any], list[int]] | None:
    """``(keys, masks)``: what one KV cache group's part of a store (``copied`` ids from
    logical block ``first_index``) writes into its destination chunks (module docstring),
    for :meth:`CopyLedger.record`; None when there is nothing to record (whole chunks only
    and no entry of the group to forget). The usual store (chunk aligned, whole chunks from
    the first one on, the table's ids in place, no null id) writes whole chunks only: one
    slice comparison and a key test per chunk in C."""
    bpc = blocks_per_chunk
    skip = first_index % bpc
    count = -(-(skip + len(copied)) // bpc)
    full = (1 << bpc) - 1
    first_chunk = first_index // bpc
    if skip == 0 and len(copied) == count * bpc and 0 not in copied:
        copied_list = copied if type(copied) is list else list(copied)
        span = offload_keys[first_chunk : first_chunk + count]
        # the copy engine writes the count chunks from first_chunk (every key of them is
        # stored), each from the table's own ids: whole chunks, tested in C (issue 31)
        if (len(span) == count and table[first_index : first_index + len(copied)] == copied_list
                and all(map(keys_to_store.__contains__, span))):
            if ledger.groups[group]:
                return list(span), [full] * count
            return None
    chunks = destination_chunks(offload_keys, keys_to_store, first_chunk, count)
    keys = [offload_keys[c] for c in chunks]
    return keys, chunk_masks(table, copied, first_index, bpc, chunks)


def ok_for(ledger: CopyLedger, fast: Sequence[tuple[int, int, int, int | None]], group_states: Sequence[Any],
           num_computed_tokens: int) -> Callable[[int], bool]:
    """``end -> bool``: whether a hit ending at ``end`` tokens loads only copied slots in
    every group (``fast``: per group ``(tokens_per_block, blocks_per_chunk,
    tokens_per_chunk, kept_tokens)``, ``group_states[g].offload_keys`` its keys)."""

    def ok(end: int) -> bool:
        for g, (tpb, bpc, _tpc, kept) in enumerate(fast):
            groups = ledger.groups[g]
            if groups and first_uncopied_block(tpb, bpc, kept, num_computed_tokens, end,
                                               group_states[g].offload_keys, groups) >= 0:
                return False
        return True

    return ok
