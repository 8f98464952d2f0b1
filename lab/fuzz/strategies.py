"""Hypothesis strategies for ``kvguard fuzz``: geometries and traffic as replay traces.

Everything here generates :class:`~kvguard.lab.replay.trace.Trace` objects (the format
``kvguard replay`` reads), so a finding is written with :meth:`Trace.dumps` and replays
exactly. The names follow vLLM's terms:

- :func:`geometry`: ``tokens_per_block`` (GPU block size, tokens), ``blocks_per_chunk``
  (GPU blocks per offloaded block; ``tokens_per_chunk = tokens_per_block *
  blocks_per_chunk``), ``sliding_window`` (tokens, of the sliding-window KV cache group),
  ``num_gpu_blocks`` (GPU blocks shared by all KV cache groups), ``cpu_chunks``
  (offloaded blocks the CPU tier holds: a few, so vLLM's LRU evicts),
  ``max_num_batched_tokens`` / ``max_num_seqs`` (SchedulerConfig; small values chunk
  prefills across steps), ``max_model_len`` (tokens); and, only where the installed
  release can express them (:func:`layout_support`), :func:`kv_cache_layout`'s
  ``groups`` (1..4 KV cache groups, full attention / sliding window, different
  ``tokens_per_block``) and ``extra_retained_tokens`` (tokens a sliding-window group
  keeps below its window).
- :func:`traffic`: requests of one trace: shared prefixes (segments with equal seeds:
  ``random.Random(seed)`` draws tokens sequentially, so a shorter segment with the same
  seed is a prefix of a longer one), multi-turn agents (turn k arrives ``after`` turn k-1
  and repeats its prompt plus ``output_of`` it; sometimes an *evictor*, a long unrelated
  prompt, runs between two turns so the next one loads from the CPU tier), fillers (unrelated prompts that evict
  the GPU prefix cache and the CPU tier), long and short prompts, arrival steps, and
  client aborts (``abort_at_step``, :func:`with_aborts`) on requests nobody waits for.
  Preemption comes from :func:`geometry`'s small ``num_gpu_blocks`` and ``max_model_len``.
- :func:`secondary_tiers`: vLLM's ``kv_connector_extra_config["secondary_tiers"]``, one
  or two of vLLM's in-memory example tiers below the CPU tier (``TieringOffloadingSpec``),
  drawn only where the installed release can run them
  (:func:`kvguard.lab.replay.tiering.unsupported_reason`, detected from its code);
  elsewhere :func:`not_generated` lists the field with the release's reason.
- :func:`traces`: a geometry and its traffic, one :class:`Trace`.

Not generated: ``external_hit_tokens`` (a driven hit is the replay's fallback for a
geometry ``schedule()`` cannot reach, not a natural finding). ``geometry.async_scheduling``
is drawn by :func:`traces` where the installed release can express it; the fields a
release cannot express are listed by :func:`not_generated` with the reason.

Sizes are kept small (prompts up to ``MAX_PROMPT_TOKENS`` tokens, GPU blocks of at most
16 tokens) so one example replays in milliseconds on a CPU: the geometry ratios that
break vLLM (chunk vs block vs window) do not need production sizes.

Every trace this module generates satisfies :meth:`Geometry.validate` and
``parse_trace(trace.dumps())`` round-trips to an equal :class:`Trace`; every request
fits in ``max_model_len`` and ``max_model_len`` fits in the GPU blocks (one request
alone can always be scheduled, so a stall is never the generator's doing).
"""

from __future__ import annotations

import dataclasses
import random
import functools
from dataclasses import dataclass

from hypothesis import strategies as st

from kvguard.lab.replay.trace import Geometry, GroupGeometry, Segment, Trace, TraceRequest

#: GPU block sizes (tokens) the fuzzer draws from.
TOKENS_PER_BLOCK = (4, 8, 16)
#: GPU blocks per offloaded block (vLLM's ``blocks_per_chunk`` / ``block_size_factor``).
BLOCKS_PER_CHUNK = (1, 2, 4, 8, 16)
#: Longest prompt (tokens) of one request.
MAX_PROMPT_TOKENS = 1536
#: Longest output (tokens) of one request.
MAX_OUTPUT_TOKENS = 8
#: First seed of segments that belong to one request only (prefix seeds are below it).
UNIQUE_SEED_BASE = 1000
VOCAB_SIZE = 32000


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


def min_gpu_blocks(tokens_per_block: int, sliding_window: int, max_model_len: int, max_num_batched_tokens: int) -> int:
    """GPU blocks one request of ``max_model_len`` tokens needs alone (both KV cache groups).

    Full attention: ``cdiv(max_model_len, tokens_per_block)``. Sliding window: while a
    prefill chunk of up to ``max_num_batched_tokens`` tokens is computed, the window
    before it and the chunks in flight are held: ``cdiv(sliding_window - 1 + 2 *
    max_num_batched_tokens, tokens_per_block) + 1`` (two batches in flight), at most the
    full count (the shape of vLLM's ``SlidingWindowSpec.max_memory_usage_bytes``, the
    start-up check that the longest request fits). Plus vLLM's null block (id 0) and one
    block of slack. This is only the generator's floor: the runner applies the installed
    release's own check (:func:`kvguard.lab.fuzz.runner.startup_refusal`) and counts a
    geometry it refuses as invalid, never as a finding.
    """
    return layout_min_gpu_blocks(
        (GroupGeometry("full", tokens_per_block), GroupGeometry("sliding_window", tokens_per_block, sliding_window)),
        max_model_len,
        max_num_batched_tokens,
    )


def layout_min_gpu_blocks(groups: tuple[GroupGeometry, ...], max_model_len: int, max_num_batched_tokens: int) -> int:
    """:func:`min_gpu_blocks` for any KV cache groups (one shared pool of GPU blocks).

    Per group, in that group's ``tokens_per_block``: full attention
    ``cdiv(max_model_len, tokens_per_block)``; sliding window ``cdiv(sliding_window - 1 +
    extra_retained_tokens + 2 * max_num_batched_tokens, tokens_per_block) + 1``, at most
    the full count (``extra_retained_tokens`` widens the kept window). Summed, plus the
    null block and one block of slack.

    At least vLLM's own start-up need, too: the null block plus, per group, full
    attention's count and a sliding window's ``cdiv(min(sliding_window - 1 +
    extra_retained_tokens + max_in_flight_tokens, max_model_len), tokens_per_block) + 1``
    (vLLM 0.29.0 / 0.33.0 ``SlidingWindowSpec.max_admission_blocks_per_request``, read
    by ``max_memory_usage_bytes``; ``max_in_flight_tokens`` is at most two batches of
    ``max_num_batched_tokens``, async scheduling's, used here for both). A window whose
    kept range reaches ``max_model_len`` needs one block more than the full count there
    (the window may not start at a block boundary); the slack block above covers one such
    group, so the first sum is the floor for the default two-group layout (unchanged),
    and with two or more such groups the generator's floor was short of vLLM's check by
    one block per further group (3 of seed 0's 200 examples on 0.33.0, two capped
    windows, refused with ``StartupCheck``; measured 1 Dec 2026).
    """
    total = 2
    need = 1
    for g in groups:
        full = _cdiv(max_model_len, g.tokens_per_block)
        vllm_need = full
        if g.kind == "sliding_window":
            kept = (g.sliding_window or 0) - 1 + g.extra_retained_tokens + 2 * max_num_batched_tokens
            vllm_need = _cdiv(min(kept, max_model_len), g.tokens_per_block) + 1
            full = min(full, _cdiv(kept, g.tokens_per_block) + 1)
        total += full
        need += vllm_need
    return max(total, need)


#: ``max_model_len`` values (tokens): a short one makes the GPU pool small, so requests
#: running together preempt each other.
MAX_MODEL_LEN = (128, 256, 512, 1024, MAX_PROMPT_TOKENS + MAX_OUTPUT_TOKENS)


@st.composite
def geometry(draw: st.DrawFn, max_model_len: int | None = None, kv_layouts: bool = True) -> Geometry:
    """A KV cache + scheduler geometry (units in the module docstring).

    ``max_model_len`` (tokens) is drawn from :data:`MAX_MODEL_LEN` unless given.
    ``sliding_window`` is mostly a multiple of ``tokens_per_block`` (as in real models)
    and sometimes not; it is at least one GPU block. ``num_gpu_blocks`` ranges from
    :func:`min_gpu_blocks` (vLLM preempts as soon as two requests run) to a few times
    that (no preemption).
    """
    if max_model_len is None:
        max_model_len = draw(st.sampled_from(MAX_MODEL_LEN))
    tokens_per_block = draw(st.sampled_from(TOKENS_PER_BLOCK))
    blocks_per_chunk = draw(st.sampled_from(BLOCKS_PER_CHUNK))
    window_blocks = draw(st.integers(1, 48))
    window_extra = draw(st.sampled_from((0, 0, 0, 1, tokens_per_block // 2)))
    sliding_window = window_blocks * tokens_per_block + window_extra
    max_num_seqs = draw(st.integers(1, 8))
    max_num_batched_tokens = max(
        max_num_seqs, draw(st.sampled_from((32, 64, 128, 256, 512, 2048)))
    )
    floor = min_gpu_blocks(tokens_per_block, sliding_window, max_model_len, max_num_batched_tokens)
    layout: dict[str, object] = {}
    if kv_layouts and any(reason is None for reason in layout_support().values()):
        # only where the release can express a field (``kvguard fuzz --default-layout``
        # turns it off): otherwise nothing more is drawn, so the examples are the ones before
        layout = draw(kv_cache_layout(tokens_per_block, sliding_window))
        groups = layout.get("groups") or (
            GroupGeometry("full", tokens_per_block),
            GroupGeometry("sliding_window", tokens_per_block, sliding_window,
                          int(layout.get("extra_retained_tokens", 0))),
        )
        floor = layout_min_gpu_blocks(groups, max_model_len, max_num_batched_tokens)
    # half the examples sit near the floor: requests evict each other's prefix cache
    # (so later turns load from the CPU tier) and running requests preempt each other
    if draw(st.booleans()):
        num_gpu_blocks = floor + draw(st.integers(0, max(1, floor // 4)))
    else:
        num_gpu_blocks = floor + draw(st.integers(0, 3 * floor))
    cpu_chunks = draw(st.integers(1, 96))
    return Geometry(
        tokens_per_block=tokens_per_block,
        tokens_per_chunk=tokens_per_block * blocks_per_chunk,
        sliding_window=sliding_window,
        num_gpu_blocks=num_gpu_blocks,
        cpu_chunks=cpu_chunks,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        vocab_size=VOCAB_SIZE,
        **layout,
    )


#: KV cache groups :func:`kv_cache_layout` draws (with ``groups``), at most.
MAX_GROUPS = 4


@functools.cache
def layout_support() -> dict[str, str | None]:
    """Per geometry field (``groups``, ``extra_retained_tokens``, ``mla``, the group
    field): why the installed vLLM, as the replay harness drives it, cannot express it, or
    None where it can (``mla``: :func:`~kvguard.lab.replay.vllm_api.mla_refusal`, and
    ``groups`` drawn).

    The harness's own checks, by feature detection (cached per process):
    ``groups`` needs :func:`~kvguard.lab.replay.vllm_api.mixed_block_sizes_refusal`
    to be None (groups of different ``tokens_per_block``), ``extra_retained_tokens``
    :func:`~kvguard.lab.replay.vllm_api.extra_retained_tokens_refusal` (the field
    exists) and :func:`~kvguard.lab.replay.vllm_api.extra_retained_tokens_setter`
    (the release's code that sets it gives every sliding-window layer one value, so the
    generator draws one value per example: :func:`kv_cache_layout`). Without vLLM (the
    light test env) neither is drawn.
    """
    try:
        from kvguard.lab.replay import vllm_api

        vllm_api.vllm_version()
        extra = vllm_api.extra_retained_tokens_refusal()
        if extra is None:
            extra = vllm_api.extra_retained_tokens_setter()[1]
        groups = vllm_api.mixed_block_sizes_refusal()
        return {
            "extra_retained_tokens": extra,
            "groups": groups,
            # drawn with groups only (a group field): where groups are not, neither is mla
            "mla": vllm_api.mla_refusal() or (f"drawn with groups only: {groups}" if groups else None),
        }
    except (ImportError, RuntimeError) as exc:
        why = f"not drawn without vLLM ({exc})"
        return {"extra_retained_tokens": why, "groups": why, "mla": why}


@st.composite
def kv_cache_layout(draw: st.DrawFn, tokens_per_block: int, sliding_window: int) -> dict[str, object]:
    """The KV cache group fields of a :class:`Geometry`, for :func:`layout_support`'s release.

    Half the examples keep the default layout (full attention + one sliding window of
    ``sliding_window`` tokens, ``tokens_per_block`` each), with ``extra_retained_tokens``
    where supported. The other half, where ``groups`` is supported, draw 1..
    :data:`MAX_GROUPS` KV cache groups (``geometry.groups``): each full attention or
    sliding window; the first has the flat ``tokens_per_block`` (the block size
    ``blocks_per_chunk`` is taken from), the others one of :data:`TOKENS_PER_BLOCK` (all
    divide the largest, as the harness's equal page sizes need); the first sliding-window
    group's window is ``sliding_window`` tokens, each later one's is drawn after the sliding-window
    group before it as 1..48 blocks of that group's block size (plus 0, 1 or half
    a block: sometimes not a multiple). With groups, half the examples are multi-head
    latent attention models (every group ``mla``, vLLM's ``MLAAttentionSpec`` /
    ``SlidingWindowMLASpec``, as a DeepSeek model's layers all are), where
    ``layout_support()["mla"]`` is None. ``extra_retained_tokens`` is drawn once per
    example, where supported, and every sliding-window group gets that one value, as vLLM
    builds it: its KV cache planning sets ``extra_retained_tokens =
    num_prefill_lookahead_tokens - 1`` (0.33.0; ``num_speculative_tokens - 1`` for
    multi-module MTP on 0.29.0) on every ``SlidingWindowSpec`` of the engine
    (:func:`~kvguard.lab.replay.vllm_api.extra_retained_tokens_setter` finds that code;
    where it does not, the field is not drawn). Returns ``{}``,
    ``{"extra_retained_tokens": N}`` or ``{"groups": (GroupGeometry, ...)}``.
    """
    support = layout_support()
    # MTP keeps a few tokens below the window (num_prefill_lookahead_tokens - 1): values
    # 0..3 and about one GPU block, in the flat tokens_per_block
    tpb0 = tokens_per_block
    extra = draw(st.sampled_from((0, 0, 1, 2, 3, tpb0, tpb0 + 1))) if support["extra_retained_tokens"] is None else 0
    if support["groups"] is not None or draw(st.booleans()):
        return {"extra_retained_tokens": extra} if extra else {}
    groups = []
    window = sliding_window
    for i in range(draw(st.integers(1, MAX_GROUPS))):
        tpb = tokens_per_block if i == 0 else draw(st.sampled_from(TOKENS_PER_BLOCK))
        if draw(st.booleans()):
            groups.append(GroupGeometry("full", tpb))
            continue
        groups.append(GroupGeometry("sliding_window", tpb, window, extra))
        window = draw(st.integers(1, 48)) * tpb + draw(st.sampled_from((0, 0, 0, 1, tpb // 2)))
    if support.get("mla") is None and draw(st.booleans()):
        groups = [dataclasses.replace(g, mla=True) for g in groups]
    return {"groups": tuple(groups)}


def prompt_tokens(draw: st.DrawFn, budget: int) -> int:
    """A prompt segment length (tokens): short (1..64) or long (up to ``budget``)."""
    if budget <= 1:
        return 1
    if draw(st.booleans()):
        return draw(st.integers(1, min(64, budget)))
    return draw(st.integers(1, budget))


@dataclass
class _Prompt:
    segments: list[Segment]
    tokens: int  # known tokens (outputs counted at their max_tokens)


@st.composite
def traffic(draw: st.DrawFn, max_model_len: int = MAX_PROMPT_TOKENS + MAX_OUTPUT_TOKENS) -> tuple[TraceRequest, ...]:
    """The requests of one trace, in arrival order (fields as in :mod:`..replay.trace`).

    Agents (1..4) share prefixes drawn from a pool of 1..3 prefix seeds; each agent runs
    1..4 turns, turn k ``after`` turn k-1 with the previous prompt, ``output_of`` the
    previous turn and a new segment. Fillers (0..3) are unrelated prompts that arrive
    after a drawn earlier request or at a drawn step. Every prompt plus its
    ``max_tokens`` fits in ``max_model_len``.
    """
    limit = min(max_model_len, MAX_PROMPT_TOKENS + MAX_OUTPUT_TOKENS)
    prefixes = [(s, draw(st.integers(1, max(1, (limit - MAX_OUTPUT_TOKENS) // 2)))) for s in range(1, draw(st.integers(1, 3)) + 1)]
    unique = iter(range(UNIQUE_SEED_BASE, UNIQUE_SEED_BASE + 10_000))
    requests: list[TraceRequest] = []
    for a in range(draw(st.integers(1, 4))):
        prefix_seed, prefix_max = draw(st.sampled_from(prefixes))
        first: list[Segment] = []
        used = 0
        if draw(st.integers(0, 3)):  # mostly a shared prefix (a cut of the pool's prefix)
            n = draw(st.integers(1, prefix_max))
            first.append(Segment(seed=prefix_seed, tokens=n))
            used = n
        room = limit - MAX_OUTPUT_TOKENS - used
        if room > 0 and (not first or draw(st.booleans())):
            n = prompt_tokens(draw, room)
            first.append(Segment(seed=next(unique), tokens=n))
            used += n
        prompt = _Prompt(first, used)
        arrival = draw(st.integers(0, 24)) if a else 0
        prev: TraceRequest | None = None
        for turn in range(draw(st.integers(1, 4))):
            max_tokens = draw(st.integers(1, MAX_OUTPUT_TOKENS))
            if prev is not None:
                grow = prompt.tokens + prev.max_tokens
                room = limit - max_tokens - grow
                if room < 1:
                    break
                n = prompt_tokens(draw, min(room, 256))
                prompt = _Prompt(
                    prompt.segments + [Segment(output_of=prev.id), Segment(seed=next(unique), tokens=n)],
                    grow + n,
                )
            after = prev.id if prev is not None else None
            if prev is not None and draw(st.integers(0, 2)) == 0:
                # an evictor between two turns (a long unrelated prompt): it pushes the
                # agent's prefix out of the GPU prefix cache, so the next turn loads it
                # from the CPU tier (the path of #42945, #43884, #48959)
                evictor = TraceRequest(
                    id=f"agent-{a}/evictor-{turn}",
                    prompt=(Segment(seed=next(unique), tokens=draw(st.integers(max(1, limit // 2), limit - MAX_OUTPUT_TOKENS))),),
                    max_tokens=1,
                    after=prev.id,
                )
                requests.append(evictor)
                after = evictor.id
            req = TraceRequest(
                id=f"agent-{a}/turn-{turn}",
                prompt=tuple(prompt.segments),
                max_tokens=max_tokens,
                after=after,
                arrival_step=arrival if prev is None else 0,
            )
            requests.append(req)
            prev = req
    for f in range(draw(st.integers(0, 4))):
        max_tokens = draw(st.integers(1, MAX_OUTPUT_TOKENS))
        n = prompt_tokens(draw, limit - max_tokens)
        after = None
        arrival = 0
        if draw(st.booleans()):
            after = draw(st.sampled_from([r.id for r in requests]))
        else:
            arrival = draw(st.integers(0, 48))
        requests.append(
            TraceRequest(
                id=f"filler-{f}",
                prompt=(Segment(seed=next(unique), tokens=n),),
                max_tokens=max_tokens,
                after=after,
                arrival_step=arrival,
            )
        )
    if ABORTS:
        requests = draw(with_aborts(requests))
    return tuple(requests)


#: How far apart the unique segment seeds of two epochs of a long life are (one
#: :func:`traffic` draw uses at most 10,000 from :data:`UNIQUE_SEED_BASE`).
EPOCH_SEEDS = 10_000


@st.composite
def lifetime(draw: st.DrawFn, requests: tuple[TraceRequest, ...], epochs: int) -> tuple[TraceRequest, ...]:
    """A long life (``kvguard fuzz --epochs N``): ``requests`` (one :func:`traffic` draw)
    served ``epochs`` times by one engine, so one replay runs for many steps and its CPU
    tier evicts many times (issue 42: the copy ledger and every wait over a server's life).

    Epoch ``k >= 1`` is a variant of the drawn traffic: ids prefixed ``e<k>/``; each unique
    segment (seed from :data:`UNIQUE_SEED_BASE`) gets new content (seed ``+ k *``
    :data:`EPOCH_SEEDS`) while the shared prefix seeds stay, so later epochs hit chunks
    that earlier epochs stored, or find them evicted; each request no other request waits
    for is left out with probability 1/4; the epoch's first requests arrive once the
    previous epoch's last request without an abort has finished. Aborts are absolute steps
    (``abort_at_step``), so they stay in epoch 0 only. One draw (a seeded ``Random``) makes
    every epoch, so Hypothesis' choice sequence does not grow with ``epochs``."""
    # one integer drawn, then a plain Random: a Hypothesis ``randoms()`` records every call as
    # a draw, and 2,500 epochs overflow the choice sequence ("too large to finish generating")
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    out = list(requests)
    waited = {w for r in requests for w in r.waits_for}
    anchor = next((r.id for r in reversed(requests) if r.abort_at_step is None), None) if ABORTS else \
        (requests[-1].id if requests else None)
    for k in range(1, epochs):
        keep = [r for r in requests if r.id in waited or rnd.random() >= 0.25] or list(requests)

        def rid(old: str, k: int = k) -> str:
            return f"e{k}/{old}"

        for r in keep:
            prompt = tuple(
                Segment(output_of=rid(seg.output_of)) if seg.output_of is not None else
                Segment(seed=seg.seed + k * EPOCH_SEEDS if seg.seed >= UNIQUE_SEED_BASE else seg.seed,
                        tokens=seg.tokens)
                for seg in r.prompt
            )
            fields = {"abort_at_step": None} if ABORTS else {}
            out.append(dataclasses.replace(
                r, id=rid(r.id), prompt=prompt, after=rid(r.after) if r.after is not None else anchor,
                arrival_step=0, **fields))
        anchor = out[-1].id
    return tuple(out)


#: The trace format of this checkout has ``abort_at_step`` (vLLM ``finish_requests``
#: with ``FINISHED_ABORTED``, what EngineCore does when a client disconnects).
ABORTS = "abort_at_step" in {f.name for f in dataclasses.fields(TraceRequest)}


@st.composite
def with_aborts(draw: st.DrawFn, requests: list[TraceRequest]) -> list[TraceRequest]:
    """Aborts: about a quarter of the requests no other request waits for get an
    ``abort_at_step`` (0..48: queued, prefilling, decoding or storing at that step)."""
    waited = {w for r in requests for w in r.waits_for}
    out = []
    for r in requests:
        if r.id not in waited and draw(st.integers(0, 3)) == 0:
            r = dataclasses.replace(r, abort_at_step=draw(st.integers(0, 48)))
        out.append(r)
    return out


try:  # the worker model (header ``worker``) where this checkout's trace format has it
    from kvguard.lab.replay.jobs import Faults, Latency, WorkerModel
except ImportError:  # pragma: no cover - older trace format
    WorkerModel = None  # type: ignore[assignment,misc]
WORKER = WorkerModel is not None and "worker" in {f.name for f in dataclasses.fields(Trace)}


@st.composite
def worker(draw: st.DrawFn) -> "WorkerModel":
    """The simulated worker's behaviour: per-job completion latency in engine steps
    (``load_latency`` / ``store_latency``: fixed or uniform ``[min, max]``, 0..6; jobs
    with different draws complete out of order) and failed transfers
    (``TransferResult.success=False`` at a rate, 0..0.3, per direction), seeded.

    Hung jobs (a completion never reported) are not drawn: a request that waits for a
    transfer that never ends stalls by construction; that is a test of the stall
    detector, not a natural finding. A third of the examples keep the immediate worker.
    """
    if draw(st.integers(0, 2)) == 0:
        return WorkerModel()

    def latency() -> "Latency":
        lo = draw(st.integers(0, 3))
        return Latency(lo, lo + draw(st.integers(0, 3)))

    def faults() -> "Faults":
        return Faults(rate=draw(st.sampled_from((0.0, 0.0, 0.05, 0.1, 0.3))))

    return WorkerModel(
        load_latency=latency(),
        store_latency=latency(),
        load_faults=faults(),
        store_faults=faults(),
        seed=draw(st.integers(0, 2**16)),
    )


def tiering_unsupported() -> str | None:
    """Why the installed vLLM cannot run ``geometry.secondary_tiers`` (``None``: it can).

    :func:`kvguard.lab.replay.tiering.unsupported_reason`, asked once per process
    (the answer is the installed release's, so the generator stays deterministic for a
    seed and release). It imports vLLM's tiering modules, so it is asked when the first
    trace is drawn, after the fuzz runner installed the guard, not at import.
    """
    global _TIERING_WHY
    if _TIERING_WHY is None:
        from kvguard.lab.replay.tiering import unsupported_reason

        _TIERING_WHY = (unsupported_reason(),)
    return _TIERING_WHY[0]


_TIERING_WHY: tuple[str | None] | None = None


@st.composite
def secondary_tiers(draw: st.DrawFn) -> tuple[str, ...] | None:
    """``geometry.secondary_tiers``: ``None`` (CPU tier alone) in about two thirds of the
    examples, else one or two tiers, each vLLM's in-memory ``"example"`` tier or its real
    ``"fs"`` tier (files in the replay's temporary directory:
    :mod:`kvguard.lab.replay.fs_tier`), with equal odds. Every stored chunk cascades to
    each tier; a lookup that misses the CPU tier promotes from the first that holds it.
    Always ``None`` where :func:`tiering_unsupported` gives a reason (nothing is drawn
    then, so the other fields' draws are those of a release without tiering)."""
    if tiering_unsupported() is not None:
        return None
    if draw(st.integers(0, 2)):
        return None
    n = draw(st.integers(1, 2))
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))  # even odds (Hypothesis favours the first choice)
    return tuple(rnd.choice(TIER_TYPES) for _ in range(n))


#: the tier types :func:`secondary_tiers` draws (``kvguard.lab.replay.tiering.TIER_TYPES``)
TIER_TYPES = ("example", "fs")


def async_scheduling_unsupported() -> str | None:
    """Why the installed vLLM's async scheduling cannot be replayed (None: it can).

    :func:`kvguard.lab.replay.batch_queue.unsupported` (by class, config field and
    request attribute), computed once per process: the answer depends only on the
    installed release, so the examples of a seed stay the same for that release.
    """
    global _ASYNC_WHY
    if _ASYNC_WHY is _UNKNOWN:
        from kvguard.lab.replay import batch_queue

        _ASYNC_WHY = batch_queue.unsupported()
    return _ASYNC_WHY  # type: ignore[return-value]


_UNKNOWN = object()
_ASYNC_WHY: object = _UNKNOWN


#: ``kvguard fuzz --connector``: vLLM's two native CPU offload connectors, or both drawn.
CONNECTORS = ("OffloadingConnector", "SimpleCPUOffloadConnector")
BOTH = "both"


def for_simple_connector(geo: Geometry, extra: dict) -> tuple[Geometry, dict]:
    """A drawn geometry and worker made fit for the SimpleCPUOffloadConnector: it copies whole
    GPU blocks (``tokens_per_chunk = tokens_per_block``; ``cpu_chunks`` is then its CPU
    pool in blocks, ``blocks_per_chunk`` times the drawn count, so the pool holds as many
    tokens as the drawn tier), has no secondary tier, and its worker reports no failed copy
    (the worker model's failure rates are dropped, its latencies kept). Where the installed
    connector refuses a layout without a full-attention group
    (:func:`~kvguard.lab.replay.vllm_api.simple_full_attention_assert`), a drawn layout of
    sliding-window groups only gets one full-attention group appended, in the flat
    ``tokens_per_block``, and the GPU pool grows by that group's need
    (``cdiv(max_model_len, tokens_per_block)``, as :func:`layout_min_gpu_blocks` counts it,
    so the drawn headroom is kept): the drawn windows stay, and the example is one vLLM
    starts instead of one it refuses at start (about 6% of ``--connector both`` examples
    before)."""
    geo = dataclasses.replace(
        geo, connector=CONNECTORS[1], tokens_per_chunk=geo.tokens_per_block,
        cpu_chunks=geo.cpu_chunks * geo.blocks_per_chunk, secondary_tiers=None)
    if geo.groups is not None and all(g.kind != "full" for g in geo.groups) and _simple_needs_full():
        geo = dataclasses.replace(
            geo, groups=(*geo.groups, GroupGeometry("full", geo.tokens_per_block)),
            num_gpu_blocks=geo.num_gpu_blocks + _cdiv(geo.max_model_len, geo.tokens_per_block))
    if "worker" in extra:
        extra = {**extra, "worker": without_failures(extra["worker"])}
    return geo, extra


def _simple_needs_full() -> bool:
    """Whether the installed SimpleCPUOffloadConnector asserts a full-attention group (asked
    once per process)."""
    global _SIMPLE_FULL
    if _SIMPLE_FULL is None:
        from kvguard.lab.replay.vllm_api import simple_full_attention_assert

        _SIMPLE_FULL = simple_full_attention_assert() is not None
    return _SIMPLE_FULL


_SIMPLE_FULL: bool | None = None


def failed_transfers_unsupported() -> str | None:
    """Where the installed vLLM's connector worker asserts that every transfer succeeded
    (:func:`kvguard.lab.replay.vllm_api.failed_transfer_assert`: 0.21.0-0.33.0, "we
    currently do not support job failures"), or ``None`` where it reports a failed job and
    goes on (0.34.0). Asked once per process, like :func:`tiering_unsupported`.

    Where it asserts, the generator draws no failed transfer (:func:`traces`): a failed
    transfer is an input that release declares unsupported and that its CPU<->GPU handler
    never produces (it answers ``success=True``, in order), and an injected one kills both
    the guarded and the unguarded engine at whichever job draws it. Drawn there, it made the
    differential comparison judge where a schedule shift moved the lab's own fault (0.33.0,
    5 Dec 2026: a wait-bound cut moved a drawn store failure into the guarded run only,
    ``worse`` for a death vLLM cannot have), and ended ~8% of the examples early. Explicit
    failed jobs in a trace (``fail_load_jobs`` / ``fail_store_jobs``) still replay as vLLM
    does them (``tests/vllm/test_fuzz.py::test_run_example_replays_with_the_traces_worker_model``).
    """
    global _FAILED_WHY
    if _FAILED_WHY is None:
        from kvguard.lab.replay.vllm_api import failed_transfer_assert

        _FAILED_WHY = (failed_transfer_assert(),)
    return _FAILED_WHY[0]


_FAILED_WHY: tuple[str | None] | None = None


def without_failures(model: "WorkerModel") -> "WorkerModel":
    """``model`` with its failure rates dropped and its latencies and seed kept (the other
    draws of the example stay as they were)."""
    from kvguard.lab.replay.jobs import Faults

    return dataclasses.replace(model, load_faults=Faults(), store_faults=Faults())


@st.composite
def traces(
    draw: st.DrawFn, name: str = "fuzz", worker_model: bool = True, async_scheduling: bool = True,
    kv_layouts: bool = True, connector: str = "OffloadingConnector", epochs: int = 1,
    draw_settings: bool = True,
) -> Trace:
    """One trace: :func:`geometry` and :func:`traffic` sharing ``max_model_len``, and
    :func:`worker` where the trace format has a worker model and ``worker_model`` is
    true (``kvguard fuzz --immediate-worker`` turns it off: the same examples as on a
    checkout without the worker model). ``geometry.async_scheduling`` (vLLM's
    ``SchedulerConfig.async_scheduling``: ``AsyncScheduler`` behind a batch queue of depth
    2) is drawn after the traffic and the worker model, half the examples, where ``async_scheduling`` is true and the
    installed release supports it (:func:`async_scheduling_unsupported`);
    ``kvguard fuzz --sync-scheduling`` turns it off (no draw: the same examples as before
    the field existed); :func:`secondary_tiers` (drawn last, after async scheduling, on a release that has
    vLLM's tiering). ``kv_layouts`` (default; ``kvguard fuzz --default-layout`` turns it
    off) draws :func:`kv_cache_layout` where :func:`layout_support` allows it.
    ``connector`` (``kvguard fuzz --connector``): the ``geometry.connector`` of every trace,
    or :data:`BOTH` (drawn last, per example, after everything above: the other draws of a
    seed stay those of one connector); a SimpleCPUOffloadConnector trace is the drawn one
    made fit for it (:func:`for_simple_connector`). ``epochs`` > 1 (``kvguard fuzz
    --epochs``): the traffic becomes a :func:`lifetime`; then engines sharing an fs tier
    (:func:`shared_engines`) and, last of all, the operator's settings
    (:func:`operator_settings`) and speculative decoding (:func:`speculative`, the
    operator's ``--speculative-config``), unless ``draw_settings`` is false (``kvguard fuzz
    --default-settings``: no draw, vLLM's defaults, the examples of a checkout before the
    settings were drawn)."""
    geo = draw(geometry(kv_layouts=kv_layouts))
    reqs = draw(traffic(geo.max_model_len))
    extra = {"worker": draw(worker())} if WORKER and worker_model else {}
    if extra and failed_transfers_unsupported() is not None:
        extra = {"worker": without_failures(extra["worker"])}
    if async_scheduling and async_scheduling_unsupported() is None and draw(st.booleans()):
        geo = dataclasses.replace(geo, async_scheduling=True)
    tiers = draw(secondary_tiers())
    if tiers is not None:
        geo = dataclasses.replace(geo, secondary_tiers=tiers)
    chosen = connector if connector != BOTH else draw(st.sampled_from(CONNECTORS))
    if chosen != CONNECTORS[0]:
        geo, extra = for_simple_connector(geo, extra)
    if epochs > 1:
        reqs = draw(lifetime(reqs, epochs))
        if geo.secondary_tiers and RESTARTS:
            extra["restarts"] = draw(restarts(reqs, epochs))
    if "fs" in (geo.secondary_tiers or ()) and not extra.get("restarts") and SHARED_ENGINES:
        reqs = draw(shared_engines(reqs))
    if SETTINGS and draw_settings:
        drawn = draw(operator_settings(geo))
        if drawn:
            geo = dataclasses.replace(geo, extra_config=drawn)
        if SPECULATIVE:
            spec = draw(speculative(geo))
            if spec is not None:
                geo = dataclasses.replace(geo, speculative=spec)
    return Trace(
        name=name,
        geometry=geo,
        requests=reqs,
        description="generated by kvguard fuzz (lab/fuzz/strategies.py)",
        **extra,
    )


#: The trace format has operator settings (``geometry.extra_config``).
SETTINGS = "extra_config" in {f.name for f in dataclasses.fields(Geometry)}
#: The trace format has speculative decoding (``geometry.speculative``).
SPECULATIVE = "speculative" in {f.name for f in dataclasses.fields(Geometry)}


@st.composite
def speculative(draw: st.DrawFn, geo: Geometry) -> tuple[str, int] | None:
    """``geometry.speculative`` for half the examples the lab can speculate in (either
    connector, synchronous scheduling: the trace format refuses async scheduling with drafts):
    a method the installed release builds for the lab's model (:func:`speculative_methods`)
    and 1..4 draft tokens per step; None for the other half and where no method builds."""
    methods = speculative_methods()
    if not methods or geo.async_scheduling or not draw(st.booleans()):
        return None
    return (draw(st.sampled_from(methods)), draw(st.integers(1, 4)))


def speculative_methods() -> tuple[str, ...]:
    """The :data:`~kvguard.lab.replay.trace.SPECULATIVE_METHODS` the installed vLLM builds a
    scheduler for with the lab's tiny model (``mtp`` needs 0.34.0's config; a release whose
    ``Scheduler`` has no ``update_draft_token_ids`` builds none). Probed once per process by
    building one small engine per method."""
    global _SPEC_METHODS
    if _SPEC_METHODS is None:
        from kvguard.lab.replay import vllm_api
        from kvguard.lab.replay.trace import SPECULATIVE_METHODS

        ok = []
        for method in SPECULATIVE_METHODS:
            geo = Geometry(tokens_per_block=16, tokens_per_chunk=16, sliding_window=64, num_gpu_blocks=64,
                           cpu_chunks=8, max_num_batched_tokens=64, max_num_seqs=2, max_model_len=256,
                           vocab_size=VOCAB_SIZE, speculative=(method, 2))
            try:
                vllm_api.build_scheduler(geo)
            except (RuntimeError, ImportError):
                continue
            ok.append(method)
        _SPEC_METHODS = tuple(ok)
    return _SPEC_METHODS


_SPEC_METHODS: tuple[str, ...] | None = None

#: ``store_threshold`` values drawn (vLLM: "Values < 2 disable filtering", 0 the default).
STORE_THRESHOLDS = (0, 2, 3)
#: ``max_tracker_size`` values drawn with a threshold: vLLM's default and small tables.
TRACKER_SIZES = (64_000, 2, 8, 32)
#: ``sync_load_budget_bytes`` values drawn: off (vLLM's default), about one small hit, every hit.
SYNC_LOAD_BUDGETS = (0, 1 << 20, 1 << 40)


def _release_reads(key: str) -> bool:
    """The installed offload code reads ``key`` (:func:`kvguard.lab.knobs.installed_reads`)."""
    from kvguard.lab.knobs import installed_reads

    return key in installed_reads()


def _tiering_reads(key: str) -> bool:
    """vLLM's tiering package reads ``key`` (0.25.1-0.34.0: ``store_threshold``, only to
    refuse it: ``TieringOffloadingSpec.get_manager`` raises ``ValueError`` for >= 2)."""
    from kvguard.lab.knobs import installed_reads

    return any(".tiering." in where for where in installed_reads().get(key, ()))


@st.composite
def operator_settings(draw: st.DrawFn, geo: Geometry) -> tuple[tuple[str, object], ...]:
    """``geometry.extra_config``: the settings of :data:`kvguard.lab.knobs.OPERATOR_SETTINGS`
    that ``geo.connector`` reads, each where the installed release reads it, every value one
    vLLM documents (sorted ``(key, value)`` pairs; ``()`` where none applies). A key is drawn
    on each example that can have it, vLLM's default among its values, so an example keeps
    the defaults with a known probability."""
    from kvguard.lab.knobs import OPERATOR_SETTINGS
    from kvguard.lab.replay.vllm_api import cache_policy_names

    def applies(key: str) -> bool:
        return OPERATOR_SETTINGS[key][0] == geo.connector and _release_reads(key)

    out: dict[str, object] = {}
    if applies("eviction_policy") and cache_policy_names():
        out["eviction_policy"] = draw(st.sampled_from(cache_policy_names()))
    if applies("store_threshold") and not (geo.secondary_tiers and _tiering_reads("store_threshold")):
        out["store_threshold"] = draw(st.sampled_from(STORE_THRESHOLDS))
        if out["store_threshold"] >= 2 and applies("max_tracker_size"):
            out["max_tracker_size"] = draw(st.sampled_from(TRACKER_SIZES))
    if applies("offload_prompt_only"):
        out["offload_prompt_only"] = draw(st.booleans())
    if applies("sync_load_budget_bytes"):
        out["sync_load_budget_bytes"] = draw(st.sampled_from(SYNC_LOAD_BUDGETS))
    if applies("lazy_offload"):
        out["lazy_offload"] = draw(st.booleans())
    return tuple(sorted(out.items()))


@st.composite
def shared_engines(draw: st.DrawFn, requests: tuple[TraceRequest, ...]) -> tuple[TraceRequest, ...]:
    """Engines sharing the fs tier (issue 42: two servers mounting one volume): in half of
    the examples that draw an fs tier and no restart, each request is served by engine 0
    or 1 with equal odds (the request field ``engine``), from one drawn integer (as
    :func:`restarts`); ``after`` and ``output_of`` then cross engines as the traffic drew
    them. The other half keep one engine."""
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    if rnd.random() < 0.5:
        return requests
    return tuple(dataclasses.replace(r, engine=rnd.randrange(2)) for r in requests)


#: The trace format of this checkout has engines sharing an fs tier (``TraceRequest.engine``).
SHARED_ENGINES = "engine" in {f.name for f in dataclasses.fields(TraceRequest)}


#: The trace format of this checkout has engine restarts (``Trace.restarts``).
RESTARTS = "restarts" in {f.name for f in dataclasses.fields(Trace)}


def epoch_of(request_id: str) -> int:
    """The epoch of a request id of :func:`lifetime` (``e<k>/...`` is epoch ``k``; any
    other id is epoch 0)."""
    if request_id.startswith("e") and "/" in request_id:
        k = request_id[1:request_id.index("/")]
        if k.isdigit():
            return int(k)
    return 0


def first_epochs(trace: Trace, k: int) -> Trace:
    """``trace`` cut to its first ``k`` epochs (:func:`lifetime`): the requests of epochs
    ``0 .. k-1`` and the restarts before them, nothing else changed. A later epoch only
    follows an earlier one (``after``, ``waits_for`` and ``output_of`` name the same or an
    earlier epoch), so the cut is a trace of its own: the first ``k`` epochs of the same
    life, step for step the same engine until the cut. ``k`` at least 1; a ``k`` at or
    above the trace's epochs returns ``trace``."""
    if k < 1:
        raise ValueError(f"first_epochs: k must be at least 1, got {k}")
    keep = tuple(r for r in trace.requests if epoch_of(r.id) < k)
    if len(keep) == len(trace.requests):
        return trace
    ids = {r.id for r in keep}
    return dataclasses.replace(trace, requests=keep, restarts=tuple(r for r in trace.restarts if r in ids))


def epochs_of(trace: Trace) -> int:
    """How many epochs ``trace`` holds (1 for a trace not made by :func:`lifetime`)."""
    return 1 + max((epoch_of(r.id) for r in trace.requests), default=0)


@st.composite
def restarts(draw: st.DrawFn, requests: tuple[TraceRequest, ...], epochs: int) -> tuple[str, ...]:
    """Engine restarts over the secondary tiers in a long life (issue 42: a restarted
    engine finds in vLLM's fs, obj and p2p tiers what the previous one wrote): before each
    epoch ``k >= 1`` (its first request, ``e<k>/...``), with probability 1/4, from one drawn
    integer (as :func:`lifetime`). Drawn only with ``secondary_tiers`` (a trace rejects a
    restart without one)."""
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    first: dict[int, str] = {}
    for r in requests:
        k = epoch_of(r.id)
        if k >= 1 and k not in first:
            first[k] = r.id
    return tuple(first[k] for k in range(1, epochs) if k in first and rnd.random() < 0.25)


#: Why the KV cache layout fields are not drawn with ``kvguard fuzz --default-layout``.
LAYOUTS_OFF = (
    "--default-layout: full attention + one sliding window of one block size, no "
    "extra_retained_tokens (without the flag it is drawn where the release expresses it)"
)


def not_generated(
    worker_model: bool = True, async_scheduling: bool = True, kv_layouts: bool = True,
    connector: str = "OffloadingConnector", draw_settings: bool = True,
) -> list[dict[str, str]]:
    """Fields of the fuzz specification this generator does not draw in this checkout, each with why.

    The trace format grows (aborts, the worker model, several KV cache groups) in other
    branches; a field appears here until the trace format here has it.
    """
    import dataclasses as dc

    req_fields = {f.name for f in dc.fields(TraceRequest)}
    geo_fields = {f.name for f in dc.fields(Geometry)}
    out = [
        {"field": "external_hit_tokens", "reason": "a driven hit is the replay's fallback, not a natural finding"},
    ]
    if not ABORTS:
        out.append({"field": "abort_at_step", "reason": "not in this checkout's trace format"})
    out.append({"field": "evict_cpu_after_lookup",
                "reason": "a driven eviction is the replay's fallback for the #39702 window, not a natural finding"})
    if connector != BOTH:
        out.append({"field": "geometry.connector", "reason": f"--connector {connector}: every trace uses it "
                    "(--connector both draws it per example)"})
    if connector != CONNECTORS[0]:
        out.append({"field": "worker.fail_loads/fail_stores (SimpleCPUOffloadConnector traces)",
                    "reason": "its worker reports no failed copy (CUDA events only complete)"})
    if WORKER and worker_model and failed_transfers_unsupported() is not None:
        out.append({"field": "worker.fail_loads/fail_stores",
                    "reason": f"this release's worker asserts every transfer succeeded "
                              f"({failed_transfers_unsupported()}): an input it does not support, "
                              "never produced by its CPU<->GPU handler"})
    # Drawn only where the installed release can express them (layout_support): listed
    # with the harness's own reason elsewhere, never silently left out.
    for name, why in (layout_support() if kv_layouts else dict.fromkeys(("extra_retained_tokens", "groups", "mla"), LAYOUTS_OFF)).items():
        if name not in geo_fields | {f.name for f in dc.fields(GroupGeometry)}:
            out.append({"field": name, "reason": "not in this checkout's trace format"})
        elif why is not None:
            out.append({"field": name, "reason": why})
    why = tiering_unsupported()
    if why is not None:
        out.append({"field": "secondary_tiers", "reason": why})
    else:
        out.append({
            "field": "secondary_tiers[].type",
            "reason": "vLLM's 'example' and 'fs' tiers are drawn; obj, p2p and kvcr need an "
                      "object store, peer engines or a KV cache registry the lab does not run",
        })
    if not SETTINGS:
        out.append({"field": "extra_config", "reason": "not in this checkout's trace format"})
    elif not draw_settings:
        out.append({"field": "extra_config", "reason": "--default-settings: every setting at vLLM's default"})
    else:
        from kvguard.lab.knobs import LAB_KEYS, OPERATOR_SETTINGS, installed_reads

        rest = sorted(set(installed_reads()) - set(LAB_KEYS) - set(OPERATOR_SETTINGS))
        if rest:
            out.append({"field": "extra_config", "reason": "read by this release and left at vLLM's default: "
                        + ", ".join(rest) + " (docs/fuzz.md, the settings census)"})
    if not async_scheduling:
        out.append({"field": "async_scheduling", "reason": "--sync-scheduling: vLLM's synchronous Scheduler only"})
    else:
        why = async_scheduling_unsupported()
        if why is not None:
            out.append({"field": "async_scheduling", "reason": f"this vLLM release cannot express it: {why}"})
    if WORKER and not worker_model:
        out.append({"field": "worker", "reason": "--immediate-worker: every job completes in its step"})
    elif WORKER:
        out.append({"field": "worker.hang_load_jobs/hang_store_jobs", "reason": "a hung transfer stalls by construction"})
    else:
        out.append({"field": "worker", "reason": "no worker model (latency, failed transfers) in this checkout's trace format"})
    return out
