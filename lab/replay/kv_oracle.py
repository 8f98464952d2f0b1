"""The KV-content oracle of the replay worker: proves "never wrong KV", not only "no crash".

The simulated GPU has no tensors, so the oracle keeps, for every slot of every GPU block
and of every offloaded chunk, a fingerprint of the KV a real worker would hold there:
the token id *and* its position, encoded as one int64 per slot::

    code(position, token_id) = position * (vocab_size + 1) + token_id + 1   (0 = never written)

Per-slot codes detect the failures a block hash of the request would hide: the right
tokens at the wrong position (a chunk loaded one chunk off), a partially written block (a
load that copied nothing leaves the block's previous or empty slots), and stale content of
a reallocated block. Content, not request ids, is compared, so a prefix-cache hit (a block
computed for request X holding the same tokens at the same positions) is valid for Y.

Storage (numpy, allocated once): GPU ``num_gpu_blocks x tokens_per_block`` per KV cache
group; CPU one ``blocks_per_chunk x tokens_per_block`` array per (group, CPU block id),
created when a store first writes it. On vLLM 0.21 / 0.25 the replay's ``KVCacheTensor``
is ``shared_by`` the layers of every group, so a GPU block id (and its CPU chunk) is the
same memory whichever group owns it: ``shared_pages=True`` keys storage by block id alone,
as the hardware would. On 0.33 the layers sit side by side in each block, so storage is
keyed by (group, block id).

The hooks, in the order the simulated worker calls them in one step (a worker model with
job latency calls the same hooks at other times; each hook is self-contained):

- :meth:`load` (``cpu_spec`` -> ``gpu_spec``): a load job's copy, at its *completion*.
- :meth:`check` (``scheduler_output``): before the step's compute. For every scheduled
  request and every KV cache group, every GPU block that an attention of this step will
  read for it must hold that request's tokens at those positions. Read range in tokens
  (:meth:`GroupLayout.read_start`): ``[0, num_computed_tokens)`` for full attention;
  ``[max(0, num_computed_tokens - sliding_window + 1 - reprefill), num_computed_tokens)``
  for a sliding-window group. A null block (id 0) inside the read range is an offender.
  ``num_computed_tokens`` is the value before the step: ``request.num_computed_tokens -
  scheduler_output.num_scheduled_tokens[req_id]`` (vLLM's ``_update_after_schedule``
  already added the scheduled tokens when ``schedule()`` returned), so call it between
  ``schedule()`` and ``update_from_output()``.

  Why that range (vLLM 0.33.0 source): a sliding-window layer's query at position ``p``
  reads keys ``p - sliding_window + 1 .. p`` (``window_size=(sliding_window - 1, 0)``,
  ``v1/attention/backends/flash_attn.py:1087``; the same in triton_attn, flashinfer), so
  the step's first query ``num_computed_tokens`` reads the computed positions from
  ``num_computed_tokens - sliding_window + 1`` on. ``extra_retained_tokens`` blocks below
  that are kept by the manager (``get_num_skipped_tokens``,
  ``v1/core/single_type_kv_cache_manager.py:1148``) "retained (but not attended)"
  (``SlidingWindowSpec``, ``v1/kv_cache_interface.py:903``): the only reader is the
  multi-module MTP drafter's rejection re-prefill (vLLM PR #48892; KV cache support PR
  #50062), which prepends ``num_rejected - 1`` tokens below the step's first position
  (``v1/worker/gpu/spec_decode/multi_module_mtp/speculator.py:517,586``), and only in a
  step that verified speculative tokens (``num_rejected`` is 0 otherwise,
  ``v1/worker/gpu/input_batch.py:540``). ``reprefill`` is therefore ``min(extra_retained_tokens,
  k - 1)`` for a request with ``k`` scheduled speculative tokens
  (``scheduler_output.scheduled_spec_decode_tokens``; the worst case, as the check runs
  before the rejection is known) in an engine whose drafter is that speculator
  (``SpeculativeConfig.use_multi_module_mtp()``, :func:`multi_module_mtp`: method ``mtp``
  with more than one MTP module and more than one draft token), and 0 otherwise: an
  ngram, EAGLE or single-module MTP drafter reads nothing below the window. So after a GPU
  prefix-cache hit (``SlidingWindowManager.find_longest_cache_hit`` supplies
  ``cdiv(sliding_window - 1, block_size)`` blocks, null below) the retained blocks are not
  demanded there: that null range is never read (docs/fuzz.md; the fuzz trace
  ``tests/vllm/traces/spec-ngram-retained-null-034.jsonl``, ngram drafts over it).
- :meth:`computed_range` / :meth:`computed`: the step's forward writes the scheduled
  tokens ``[num_computed_tokens, num_computed_tokens + num_scheduled_tokens)`` into the
  request's real block table (``kv_cache_manager.get_block_ids(req_id)``, per group).
- :meth:`store` (``gpu_spec`` -> ``cpu_spec``): a store job's copy. vLLM's offloading
  worker defers a store to the beginning of the next engine step (``prepare_store_kv``,
  "NOTE(orozery)" in 0.21.0 and 0.33.0), i.e. after this step's forward and before the
  next step's loads: the simulated worker calls it after :meth:`computed_range`.

Secondary tier (trace ``geometry.secondary_tiers``, :mod:`kvguard.lab.replay.tiering`):
vLLM's example tier keeps only the presence of an offload key, so the oracle keeps the
data: :meth:`secondary_store` (at the tier's ``submit_store``, a cascade of CPU slot ``c``
for key ``k``) copies slot ``c``'s fingerprints, every group's, under ``(tier, k)``;
:meth:`secondary_load` (at ``submit_load``, a promotion of ``k`` into CPU slot ``c``)
writes them back into slot ``c``. A promotion of a key never cascaded clears slot ``c``
(its GPU load then reads never-written slots: a wrong-KV finding, not a silent pass).
What the oracle cannot see there: a tier that would hold *different* bytes than it was
given (vLLM's example tier holds none; its behaviour is only presence), and an eviction
inside the tier (the example tier never evicts).

GPU <-> CPU mapping, exactly that of vLLM's ``transfer_async``
(``vllm/v1/kv_offload/cpu/gpu_worker.py``, the same loop in 0.21.0 and 0.33.0; the
factor is ``block_size_factor`` in 0.21 and ``blocks_per_chunk`` in 0.33): for spec group
``i`` with ``group_sizes[i]`` GPU blocks starting at logical block ``block_indices[i]``,
``skip = block_indices[i] % blocks_per_chunk``; its CPU chunks are the next
``cdiv(group_sizes[i] + skip, blocks_per_chunk)`` ids of the CPU spec, and its ``j``-th GPU
block is sub-block ``(skip + j) % blocks_per_chunk`` of chunk ``(skip + j) //
blocks_per_chunk``. Spec group ``i`` is KV cache group ``offload_group_ids[i]`` (vLLM
0.33's ``get_offloading_group_ids``; every group on earlier releases). A spec on which
vLLM's own loop asserts (``dst_end_offset <= num_dst_blocks``, ``src_offset ==
num_src_blocks``, ``len(group_sizes)`` != groups) copies nothing (vLLM asserts before the
batched copy) and is listed in :attr:`KVOracle.rejected_jobs`.

Costs: a step's check gathers ``num_computed_tokens`` int64 per group and request (one
numpy gather + compare); token codes are built once per request and extended as it
decodes. Offenders are counted once per (request, group, block index).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

#: How many offenders the report lists in full (the count is always exact).
MAX_OFFENDERS = 8


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


@dataclass(frozen=True)
class GroupLayout:
    """One KV cache group as the oracle sees it.

    ``tokens_per_block``: tokens per GPU block of this group. ``sliding_window`` (tokens) and
    ``extra_retained_tokens`` (tokens kept below the window, MTP; vLLM 0.33
    ``SlidingWindowSpec.extra_retained_tokens``) are ``None`` / 0 for full attention.
    """

    tokens_per_block: int
    sliding_window: int | None = None
    extra_retained_tokens: int = 0

    def kept_start(self, num_computed_tokens: int) -> int:
        """First token position vLLM's manager keeps for ``num_computed_tokens`` computed
        (tokens; ``SlidingWindowManager.get_num_skipped_tokens``, window plus
        ``extra_retained_tokens``). Blocks wholly below it are freed to the null block."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens)

    def read_start(self, num_computed_tokens: int, num_spec_tokens: int = 0) -> int:
        """First token position an attention of the step reads (tokens), for
        ``num_computed_tokens`` computed before the step and ``num_spec_tokens`` speculative
        tokens scheduled for the request in it (module docstring, "Why that range").

        Full attention: 0. Sliding window: ``num_computed_tokens - sliding_window + 1`` (the
        first query's window), lowered by the multi-module MTP re-prefill,
        ``min(extra_retained_tokens, num_spec_tokens - 1)`` tokens, in a step with
        speculative tokens; never below :meth:`kept_start`, never below 0.
        """
        if self.sliding_window is None:
            return 0
        reprefill = min(self.extra_retained_tokens, max(0, num_spec_tokens - 1))
        return max(0, num_computed_tokens - self.sliding_window + 1 - reprefill)


def layouts_from_kv_cache_config(kv_cache_config: Any) -> list[GroupLayout]:
    """The :class:`GroupLayout` of every group of a real vLLM ``KVCacheConfig``.

    Sliding-window groups are recognised by the spec's ``sliding_window`` field;
    ``extra_retained_tokens`` is read where the release's spec has it (0 otherwise).
    """
    out = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        out.append(
            GroupLayout(
                tokens_per_block=int(spec.block_size),
                sliding_window=int(window) if window else None,
                extra_retained_tokens=int(getattr(spec, "extra_retained_tokens", 0) or 0),
            )
        )
    return out


def offload_group_ids(kv_cache_config: Any) -> tuple[int, ...]:
    """KV cache group of each spec group: vLLM's ``get_offloading_group_ids`` where it exists."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
            get_offloading_group_ids,
        )
    except ImportError:  # 0.21 / 0.25: every group is offloaded, in order
        return tuple(range(len(kv_cache_config.kv_cache_groups)))
    return tuple(int(g) for g in get_offloading_group_ids(kv_cache_config))


def pages_shared_by_groups(kv_cache_config: Any) -> bool:
    """True when one ``KVCacheTensor`` is ``shared_by`` layers of several groups (0.21 / 0.25)."""
    layer_group = {
        name: gi for gi, g in enumerate(kv_cache_config.kv_cache_groups) for name in g.layer_names
    }
    for tensor in kv_cache_config.kv_cache_tensors:
        shared = getattr(tensor, "shared_by", None)
        if shared and len({layer_group.get(n) for n in shared}) > 1:
            return True
    return False


@dataclass
class KVOracle:
    """Per-slot KV fingerprints of the simulated GPU and CPU tier (module docstring).

    Args:
        scheduler: the real vLLM ``Scheduler`` (read only: ``requests``,
            ``kv_cache_manager.get_block_ids``), used by :meth:`check` and the worker.
        groups: one :class:`GroupLayout` per KV cache group, in vLLM's group order.
        num_gpu_blocks: GPU blocks of the KV cache (block id 0 is vLLM's null block).
        blocks_per_chunk: GPU blocks per offloaded chunk (0.21 ``block_size_factor``).
        vocab_size: token ids are in ``[0, vocab_size)``.
        offload_group_ids: KV cache group of each GPU spec group (default: all, in order).
        shared_pages: one page per block id for all groups (0.21 / 0.25 ``shared_by``).

    Raises:
        ValueError: ``shared_pages`` with groups of different ``tokens_per_block``.
    """

    scheduler: Any
    groups: Sequence[GroupLayout]
    num_gpu_blocks: int
    blocks_per_chunk: int
    vocab_size: int
    offload_group_ids: Sequence[int] | None = None
    shared_pages: bool = False
    #: distinct (request, group, block index) found holding the wrong KV at a check
    wrong_kv_blocks: int = 0
    #: the first :data:`MAX_OFFENDERS` offenders (short form, no bulk token ids)
    wrong_kv: list[dict[str, Any]] = field(default_factory=list)
    #: block checks done (a block checked at 10 steps counts 10): evidence the oracle ran
    checked_blocks: int = 0
    checks: int = 0
    stored_blocks: int = 0
    loaded_blocks: int = 0
    #: chunks copied CPU -> secondary tier / secondary tier -> CPU (:meth:`secondary_store`)
    secondary_stored_chunks: int = 0
    secondary_loaded_chunks: int = 0
    #: transfer jobs vLLM's own worker loop would assert on (nothing copied)
    rejected_jobs: list[dict[str, Any]] = field(default_factory=list)
    #: the token ids of a live request as the worker knows them (default: its
    #: ``all_token_ids``); under async scheduling the worker also knows the tokens it
    #: sampled whose output the scheduler has not processed yet (see worker.py)
    token_view: Callable[[Any], Sequence[int]] | None = None
    #: whether the engine's drafter re-prefills rejected tokens below a step's first
    #: position (vLLM's multi-module MTP speculator, the only reader of a sliding window's
    #: ``extra_retained_tokens``): ``SpeculativeConfig.use_multi_module_mtp()`` of the
    #: engine (:func:`oracle_for`); True, the widest read, where it is not known
    multi_module_mtp: bool = True

    def __post_init__(self) -> None:
        self.groups = list(self.groups)
        if self.offload_group_ids is None:
            self.offload_group_ids = tuple(range(len(self.groups)))
        self.offload_group_ids = tuple(self.offload_group_ids)
        if self.shared_pages and self.blocks_per_chunk != 1 and len({g.tokens_per_block for g in self.groups}) > 1:
            raise ValueError("shared_pages needs one tokens_per_block for every KV cache group")
        self._base = self.vocab_size + 1
        if self.shared_pages:
            # one page per block id; a group of fewer tokens per block uses its first slots
            # (a block id belongs to one group at a time, so its slots never mix groups)
            one = np.zeros((self.num_gpu_blocks, max(g.tokens_per_block for g in self.groups)), np.int64)
            self._pages = [one]
            self._gpu = [one[:, : g.tokens_per_block] for g in self.groups]
        else:
            self._gpu = [
                np.zeros((self.num_gpu_blocks, g.tokens_per_block), np.int64) for g in self.groups
            ]
            self._pages = self._gpu
        #: CPU storage: (group, chunk id) -> chunk; ("page", page group, CPU block id) -> page
        self._cpu: dict[tuple, np.ndarray] = {}
        #: (tier, offload key) -> per group, the fingerprints of the cascaded CPU slot
        self._secondary: dict[tuple[int, Any], list[np.ndarray | None]] = {}
        self._codes: dict[str, np.ndarray] = {}
        self._seen: set[tuple[str, int, int]] = set()

    # -- fingerprints -------------------------------------------------------------------

    def _key(self, group: int, block_id: int) -> tuple[int, int]:
        return (0 if self.shared_pages else group, int(block_id))

    def token_codes(self, req_id: str, token_ids: Sequence[int] | None = None) -> np.ndarray:
        """Slot codes of request ``req_id``'s tokens at positions 0..n-1 (int64, cached).

        ``token_ids`` defaults to the live request's ``all_token_ids``; the cache only grows
        (prompt, then sampled tokens), so a decode step appends one code. A request that
        is no longer live keeps its cached codes. Raises KeyError when neither exists.
        """
        have = self._codes.get(req_id)
        if token_ids is None:
            req = self.scheduler.requests.get(req_id)
            if req is None:
                if have is None:
                    raise KeyError(f"no live request {req_id!r} and no token codes for it")
                return have
            token_ids = self.token_view(req) if self.token_view is not None else req.all_token_ids
        n = len(token_ids)
        if have is not None and len(have) >= n:
            return have[:n] if len(have) > n else have
        start = 0 if have is None else len(have)
        new = np.fromiter((token_ids[i] for i in range(start, n)), np.int64, n - start)
        new += np.arange(start, n, dtype=np.int64) * self._base + 1
        codes = new if have is None else np.concatenate([have, new])
        self._codes[req_id] = codes
        return codes

    def with_tokens(self, codes: np.ndarray, start: int, token_ids: Sequence[int]) -> np.ndarray:
        """A copy of ``codes`` (a request's :meth:`token_codes`) up to ``start +
        len(token_ids)`` with positions ``start ..`` holding ``token_ids`` instead: the slot
        codes of speculative drafts, whose KV the forward writes whether or not they are the
        request's tokens (a rejected draft's KV stays in its slot until the position is
        computed again)."""
        end = start + len(token_ids)
        out = np.array(codes[:end], np.int64)
        if len(out) < end:
            out = np.concatenate([out, np.zeros(end - len(out), np.int64)])
        out[start:end] = np.asarray(token_ids, np.int64) + np.arange(start, end, dtype=np.int64) * self._base + 1
        return out

    def forget(self, req_id: str) -> None:
        """Drop the cached token codes of a finished request (storage is not touched)."""
        self._codes.pop(req_id, None)

    # -- hooks ----------------------------------------------------------------------------

    def computed(
        self,
        req_id: str,
        group: int,
        gpu_block_id: int,
        block_index: int,
        tokens: Sequence[int],
        start: int | None = None,
    ) -> None:
        """GPU block ``gpu_block_id`` (logical block ``block_index`` of ``req_id`` in
        ``group``) now holds ``tokens`` at positions ``start .. start + len(tokens) - 1``
        (default ``start``: the block's first position). Writes to the null block are
        dropped. Raises ValueError for positions outside the block."""
        tpb = self.groups[group].tokens_per_block
        base = block_index * tpb
        start = base if start is None else start
        if not (base <= start and start + len(tokens) <= base + tpb):
            raise ValueError(f"positions {start}+{len(tokens)} are outside block index {block_index}")
        if gpu_block_id == 0 or not len(tokens):
            return
        pos = np.arange(start, start + len(tokens), dtype=np.int64)
        codes = pos * self._base + np.asarray(tokens, np.int64) + 1
        self._gpu[group][gpu_block_id, start - base : start - base + len(tokens)] = codes

    def computed_range(
        self, req_id: str, group: int, block_ids: Sequence[int], start: int, end: int,
        codes: np.ndarray | None = None,
    ) -> None:
        """The forward wrote positions ``[start, end)`` of ``req_id`` into ``block_ids`` (the
        request's block table of ``group``; logical block ``k`` is ``block_ids[k]``).
        ``codes`` defaults to :meth:`token_codes`. Null blocks (id 0) are skipped."""
        if end <= start:
            return
        if codes is None:
            codes = self.token_codes(req_id)
        tpb = self.groups[group].tokens_per_block
        pos = np.arange(start, end, dtype=np.int64)
        blk = pos // tpb
        table = np.asarray(block_ids, np.int64)
        if len(table) <= int(blk[-1]):
            raise ValueError(
                f"{req_id}: group {group} has {len(table)} GPU blocks, positions up to {end - 1}"
            )
        ids = table[blk]
        keep = ids != 0
        self._gpu[group][ids[keep], (pos % tpb)[keep]] = codes[start:end][keep]

    def _plan(self, gpu_spec: Any, num_cpu_blocks: int) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] | None:
        """Per spec group: (KV cache group, GPU block ids, CPU chunk ids, sub-block index).

        ``None`` where vLLM's ``transfer_async`` would assert (nothing is copied then).
        """
        sizes = [int(x) for x in gpu_spec.group_sizes]
        indices = [int(x) for x in gpu_spec.block_indices]
        gpu_ids = np.asarray(gpu_spec.block_ids, np.int64)
        if len(sizes) != len(self.offload_group_ids) or len(indices) != len(sizes):
            return None
        if sum(sizes) != len(gpu_ids):
            return None
        bpc = self.blocks_per_chunk
        plan = []
        g_off = c_off = 0
        for i, (size, idx) in enumerate(zip(sizes, indices)):
            if size == 0:
                continue
            skip = idx % bpc
            n_chunks = _cdiv(size + skip, bpc)
            if c_off + n_chunks > num_cpu_blocks:
                return None
            flat = np.arange(skip, skip + size, dtype=np.int64)
            plan.append((self.offload_group_ids[i], gpu_ids[g_off : g_off + size],
                         flat // bpc + c_off, flat % bpc))
            g_off += size
            c_off += n_chunks
        if c_off != num_cpu_blocks:
            return None
        return plan

    def _chunk(self, group: int, cpu_block: int) -> np.ndarray:
        key = self._key(group, cpu_block)
        arr = self._cpu.get(key)
        if arr is None:
            tpb = self.groups[group].tokens_per_block
            arr = self._cpu[key] = np.zeros((self.blocks_per_chunk, tpb), np.int64)
        return arr

    def _copies(self, job_id: int, gpu_spec: Any, cpu_spec: Any, store: bool) -> list[tuple[int, int, int, int]]:
        """One ``(KV cache group, GPU block id, CPU chunk id, sub-block index)`` per GPU block
        of a transfer job, in the job's order; empty (and the job recorded in
        :attr:`rejected_jobs`) where vLLM's ``transfer_async`` would assert."""
        cpu_ids = np.asarray(cpu_spec.block_ids, np.int64)
        plan = self._plan(gpu_spec, len(cpu_ids))
        if plan is None:
            self.rejected_jobs.append({"job_id": int(job_id), "store": store})
            return []
        return [
            (group, int(gids[k]), int(cpu_ids[chunk_pos[k]]), int(sub[k]))
            for group, gids, chunk_pos, sub in plan
            for k in range(len(gids))
        ]

    def store(self, job_id: int, gpu_spec: Any, cpu_spec: Any) -> int:
        """Copy a store job's GPU blocks into its CPU chunks; returns GPU blocks copied."""
        copies = self._copies(job_id, gpu_spec, cpu_spec, store=True)
        for group, gpu_block, cpu_block, sub in copies:
            self._chunk(group, cpu_block)[sub] = self._gpu[group][gpu_block]
        self.stored_blocks += len(copies)
        return len(copies)

    def _slot_groups(self) -> range:
        return range(1 if self.shared_pages else len(self.groups))

    def cpu_slot(self, cpu_block: int) -> list[np.ndarray | None]:
        """Copies of CPU slot ``cpu_block``'s fingerprints, one per slot group (``None``:
        never written); what a secondary tier that copies the slot's bytes takes away."""
        out: list[np.ndarray | None] = []
        for g in self._slot_groups():
            arr = self._cpu.get((g, int(cpu_block)))
            out.append(None if arr is None else arr.copy())
        return out

    def fill_cpu_slot(self, cpu_block: int, snap: list[np.ndarray | None] | None) -> None:
        """Write ``snap`` (a :meth:`cpu_slot` result) into CPU slot ``cpu_block``: what a
        promotion from a secondary tier writes. ``None`` (or a ``None`` group) leaves the
        slot reading as never written, so a GPU load from it is a wrong-KV finding."""
        for i, g in enumerate(self._slot_groups()):
            arr = None if snap is None else snap[i]
            if arr is None:
                self._cpu.pop((g, int(cpu_block)), None)
            else:
                self._cpu[(g, int(cpu_block))] = arr.copy()

    def secondary_store(self, tier: int, key: Any, cpu_block: int) -> None:
        """Secondary tier ``tier`` copies CPU slot ``cpu_block`` (every group) for ``key``."""
        self._secondary[(int(tier), key)] = self.cpu_slot(cpu_block)
        self.secondary_stored_chunks += 1

    def adopt_secondary(self, other: "KVOracle") -> int:
        """Take ``other``'s secondary-tier copies (an engine restart over persistent tiers:
        the tiers' bytes outlive the engine, so their fingerprints do too; codes are content,
        not request ids, so they mean the same in the new engine). Returns the copies taken."""
        self._secondary.update({k: [None if a is None else a.copy() for a in v]
                                for k, v in other._secondary.items()})
        return len(other._secondary)

    def secondary_load(self, tier: int, key: Any, cpu_block: int) -> bool:
        """Secondary tier ``tier`` writes ``key``'s copy into CPU slot ``cpu_block``.

        Returns False (and clears the slot: it reads as never written) when ``key`` was
        never cascaded to that tier."""
        snap = self._secondary.get((int(tier), key))
        self.secondary_loaded_chunks += 1
        self.fill_cpu_slot(cpu_block, snap)
        return snap is not None

    def load(self, job_id: int, cpu_spec: Any, gpu_spec: Any) -> int:
        """Copy a load job's CPU chunks into its GPU blocks; returns GPU blocks copied.

        A chunk slot never stored reads as "never written" (zeros), as fresh memory would
        not hold the request's KV either.
        """
        copies = self._copies(job_id, gpu_spec, cpu_spec, store=False)
        for group, gpu_block, cpu_block, sub in copies:
            chunk = self._cpu.get(self._key(group, cpu_block))
            tpb = self.groups[group].tokens_per_block
            self._gpu[group][gpu_block] = chunk[sub] if chunk is not None else np.zeros(tpb, np.int64)
        self.loaded_blocks += len(copies)
        return len(copies)

    # -- whole-block pages (the SimpleCPUOffloadConnector: CPU block = one GPU block) -----

    def gpu_pages(self, block_ids: Sequence[int]) -> list[np.ndarray]:
        """A copy of GPU blocks ``block_ids``' slots, one ``len(block_ids) x tokens_per_block``
        array per page group (every KV cache group, or one with ``shared_pages``): a copy of a
        block id moves every layer of that block, whichever group owns it."""
        ids = np.asarray(block_ids, np.int64)
        return [self._pages[g][ids].copy() for g in self._slot_groups()]

    def cpu_pages(self, block_ids: Sequence[int]) -> list[np.ndarray]:
        """CPU blocks ``block_ids``' slots (as :meth:`gpu_pages`; never written = zeros).
        Only for ``blocks_per_chunk == 1`` (a CPU block holds one GPU block)."""
        out = []
        for g in self._slot_groups():
            page = np.zeros((len(block_ids), self._pages[g].shape[1]), np.int64)
            for k, c in enumerate(block_ids):
                chunk = self._cpu.get(("page", g, int(c)))
                if chunk is not None:
                    page[k] = chunk
            out.append(page)
        return out

    def write_gpu_pages(self, block_ids: Sequence[int], pages: Sequence[np.ndarray], count: bool = True) -> None:
        """GPU blocks ``block_ids`` now hold ``pages`` (:meth:`gpu_pages`' shape); the null
        block (id 0) is never written. ``count``: a load's copy (``loaded_blocks``)."""
        ids = np.asarray(block_ids, np.int64)
        keep = ids != 0
        for g, page in zip(self._slot_groups(), pages):
            self._pages[g][ids[keep]] = page[keep]
        if count:
            self.loaded_blocks += int(keep.sum())

    def write_cpu_pages(self, block_ids: Sequence[int], pages: Sequence[np.ndarray]) -> None:
        """CPU blocks ``block_ids`` now hold ``pages`` (:meth:`cpu_pages`' shape)."""
        for g, page in zip(self._slot_groups(), pages):
            for k, c in enumerate(block_ids):
                self._cpu[("page", g, int(c))] = page[k].copy()
        self.stored_blocks += len(block_ids)

    @staticmethod
    def changed_rows(before: Sequence[np.ndarray], after: Sequence[np.ndarray]) -> np.ndarray:
        """Per block, whether any page group's slots differ between two page snapshots."""
        if not before or not len(before[0]):
            return np.zeros(0, bool)
        return np.any([(a != b).any(axis=1) for a, b in zip(before, after)], axis=0)

    def check(self, scheduler_output: Any) -> int:
        """Check every scheduled request's read range (module docstring); returns new offenders."""
        self.checks += 1
        new = 0
        requests = self.scheduler.requests
        manager = self.scheduler.kv_cache_manager
        spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            req = requests.get(req_id)
            if req is None:
                continue
            computed = int(req.num_computed_tokens) - int(num_scheduled)
            if computed <= 0:
                continue
            # only the multi-module MTP drafter reads below the window (module docstring)
            drafts = len(spec.get(req_id, ())) if self.multi_module_mtp else 0
            new += self.check_request(req_id, manager.get_block_ids(req_id), computed,
                                      num_spec_tokens=drafts)
        return new

    def check_request(
        self, req_id: str, block_ids: Sequence[Sequence[int]], num_computed_tokens: int,
        num_spec_tokens: int = 0,
    ) -> int:
        """Check ``req_id``'s blocks (per group) for the positions the step's attention reads
        (:meth:`GroupLayout.read_start`: ``num_computed_tokens`` computed, ``num_spec_tokens``
        speculative tokens scheduled); returns new offenders."""
        codes = self.token_codes(req_id)
        new = 0
        for group, (layout, table) in enumerate(zip(self.groups, block_ids)):
            tpb = layout.tokens_per_block
            lo = layout.read_start(num_computed_tokens, num_spec_tokens)
            first, end = lo // tpb, _cdiv(num_computed_tokens, tpb)
            ids = np.asarray(table[first:end], np.int64)
            if len(ids) < end - first:
                bad = list(range(first + len(ids), end))
                new += self._offend(req_id, group, bad, [-1] * len(bad), "no GPU block")
                ids = np.concatenate([ids, np.zeros(end - first - len(ids), np.int64)])
            found = self._gpu[group][ids].reshape(-1)
            want = np.zeros_like(found)
            a, b = lo - first * tpb, num_computed_tokens - first * tpb
            want[a:b] = codes[lo:num_computed_tokens]
            mask = np.zeros(len(found), bool)
            mask[a:b] = True
            diff = ((found != want) & mask).reshape(-1, tpb).any(axis=1) | (ids == 0)
            self.checked_blocks += len(ids)
            if diff.any():
                for k in np.flatnonzero(diff):
                    bi = first + int(k)
                    new += self._offend(
                        req_id, group, [bi], [int(ids[k])],
                        self._describe(found[k * tpb : (k + 1) * tpb], want[k * tpb : (k + 1) * tpb],
                                       mask[k * tpb : (k + 1) * tpb], int(ids[k])),
                    )
        return new

    def _describe(self, found: np.ndarray, want: np.ndarray, mask: np.ndarray, block_id: int) -> str:
        """Short form of a wrong block: what was expected vs found (positions, never tokens)."""
        exp = np.flatnonzero(mask)
        wp = (want[exp] - 1) // self._base
        expected = f"positions {int(wp[0])}..{int(wp[-1])}"
        if block_id == 0:
            return f"expected {expected}; found the null block"
        got = found[exp]
        written = got != 0
        if not written.any():
            return f"expected {expected}; found never-written slots"
        fp = (got[written] - 1) // self._base
        wrong = int((got != want[exp]).sum())
        same_pos = bool((fp == wp[written]).all())
        what = "other tokens at the same positions" if same_pos else (
            f"positions {int(fp.min())}..{int(fp.max())}")
        return f"expected {expected}; {wrong}/{len(exp)} slots differ, found {what}"

    def _offend(self, req_id: str, group: int, block_indices: list[int], block_ids: list[int], what: str) -> int:
        new = 0
        for bi, bid in zip(block_indices, block_ids):
            key = (req_id, group, bi)
            if key in self._seen:
                continue
            self._seen.add(key)
            new += 1
            self.wrong_kv_blocks += 1
            if len(self.wrong_kv) < MAX_OFFENDERS:
                self.wrong_kv.append(
                    {"request_id": req_id, "group": group, "block_index": bi,
                     "gpu_block_id": bid, "what": what}
                )
        return new

    @property
    def wrong_kv_requests(self) -> set[str]:
        """Ids of the requests with at least one block found holding wrong KV."""
        return {key[0] for key in self._seen}

    def summary(self) -> dict[str, Any]:
        """The report's ``kv_oracle`` object (counts in GPU blocks)."""
        return {
            "checks": self.checks,
            "checked_blocks": self.checked_blocks,
            "stored_blocks": self.stored_blocks,
            "loaded_blocks": self.loaded_blocks,
            "rejected_jobs": list(self.rejected_jobs),
            "secondary_stored_chunks": self.secondary_stored_chunks,
            "secondary_loaded_chunks": self.secondary_loaded_chunks,
            "shared_pages": self.shared_pages,
        }


def multi_module_mtp(scheduler: Any) -> bool:
    """Whether ``scheduler``'s engine drafts with vLLM's multi-module MTP speculator, whose
    rejection re-prefill reads below a step's first position
    (``SpeculativeConfig.use_multi_module_mtp()``, 0.34.0; a release without the method has
    no such speculator). No speculative config: False."""
    spec = getattr(getattr(scheduler, "vllm_config", None), "speculative_config", None)
    if spec is None:
        return False
    probe = getattr(spec, "use_multi_module_mtp", None)
    return bool(probe()) if callable(probe) else False


def oracle_for(scheduler: Any, vocab_size: int, blocks_per_chunk: int,
               token_view: Callable[[Any], Sequence[int]] | None = None) -> KVOracle:
    """The oracle of a replay worker over the real ``scheduler``'s ``KVCacheConfig``: its
    groups, GPU blocks, offloaded groups and page sharing; ``blocks_per_chunk`` GPU blocks
    per CPU chunk (1 for the SimpleCPUOffloadConnector: a CPU block is one GPU block)."""
    config = scheduler.kv_cache_config
    return KVOracle(
        multi_module_mtp=multi_module_mtp(scheduler),
        scheduler=scheduler,
        groups=layouts_from_kv_cache_config(config),
        num_gpu_blocks=int(config.num_blocks),
        blocks_per_chunk=blocks_per_chunk,
        vocab_size=vocab_size,
        offload_group_ids=offload_group_ids(config),
        shared_pages=pages_shared_by_groups(config),
        token_view=token_view,
    )
