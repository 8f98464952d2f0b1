"""Replay traces: the JSONL format ``kvguard replay`` reads, and its built-in traces.

A trace is a UTF-8 JSON Lines file. Blank lines are ignored. The first object is the
header; every later object is one request.

Header (exactly one, first line)::

    {"kind": "header", "format": "kvguard-replay/1", "name": "seed-48959",
     "description": "...",
     "geometry": {"tokens_per_block": 32, "tokens_per_chunk": 256,
                  "sliding_window": 4096, "num_gpu_blocks": 8192,
                  "cpu_chunks": 4096, "max_num_batched_tokens": 16384,
                  "max_num_seqs": 8, "max_model_len": 131072, "vocab_size": 32000}}

``geometry`` units: ``tokens_per_block`` tokens per GPU block (vLLM's
``cache_config.block_size``, the same for both KV cache groups), ``tokens_per_chunk``
tokens per offloaded block (``kv_connector_extra_config.block_size``; vLLM calls the
ratio ``block_size_factor`` before #48150 and ``blocks_per_chunk`` after),
``sliding_window`` tokens (``SlidingWindowSpec.sliding_window`` of the second KV cache
group; the first group is full attention), ``num_gpu_blocks`` GPU blocks shared by both
groups, ``cpu_chunks`` offloaded blocks the CPU tier holds (it sets
``cpu_bytes_to_use``), ``max_num_batched_tokens`` / ``max_num_seqs`` /
``max_model_len`` as in vLLM's ``SchedulerConfig``, ``vocab_size`` for token ids.

Optional geometry fields (omitted, the layout is the two groups above):

- ``extra_retained_tokens``: tokens the sliding-window group keeps below its window
  (MTP; vLLM's ``SlidingWindowSpec.extra_retained_tokens``, vLLM 0.33.0 has it, 0.21.0 and
  0.25.1 do not: the harness raises ``RuntimeError`` naming the field and release there).
- ``groups``: the KV cache groups, in order, replacing the default two::

      "groups": [{"kind": "full", "tokens_per_block": 64},
                 {"kind": "sliding_window", "tokens_per_block": 32,
                  "sliding_window": 4096, "extra_retained_tokens": 0},
                 {"kind": "sliding_window", "tokens_per_block": 16, "sliding_window": 512}]

  ``tokens_per_block`` tokens per GPU block of that group (default the flat field),
  ``sliding_window`` tokens (required for ``sliding_window``), ``extra_retained_tokens``
  as above, ``mla`` (optional, bool): the group's layers are multi-head latent attention
  (DeepSeek's MLA), vLLM's ``MLAAttentionSpec`` for full attention and
  ``SlidingWindowMLASpec`` for a sliding window (one latent vector per token, no separate
  V: the harness gives it the page size of the other groups by its head size). With ``groups`` the flat ``tokens_per_block`` is the block size the
  blocks-per-chunk ratio is taken from: ``blocks_per_chunk = tokens_per_chunk //
  tokens_per_block`` GPU blocks per offloaded chunk in *every* group (a group's chunk is
  ``blocks_per_chunk * its tokens_per_block`` tokens). Groups of different block sizes
  are configured with ``kv_connector_extra_config["blocks_per_chunk"]`` (vLLM 0.33.0;
  ``block_size`` there requires one block size for all groups); a release without that
  key raises ``RuntimeError``. ``num_gpu_blocks`` is shared by all groups.

- ``secondary_tiers``: vLLM's ``TieringOffloadingSpec`` key of
  ``kv_connector_extra_config``, a list of secondary tier configs below the CPU tier::

      "secondary_tiers": [{"type": "example"}]

  Set, the harness runs the real ``OffloadingConnector`` with ``spec_name =
  "TieringOffloadingSpec"``: vLLM's ``TieringOffloadingManager`` over the CPU tier
  (``cpu_chunks``) plus one secondary tier per entry. The only ``type`` is ``"example"``,
  vLLM's in-memory ``ExampleSecondaryTierManager`` (unbounded; it holds presence, the
  KV-content oracle holds the data: :mod:`kvguard.lab.replay.tiering`). A release
  without vLLM's tiering package (0.21.0, measured) raises
  :class:`~kvguard.lab.replay.tiering.TieringUnsupported` (a ``RuntimeError``) naming
  the field, the release and the reason.

Optional geometry field ``async_scheduling`` (bool, default false; vLLM's
``SchedulerConfig.async_scheduling``, ``--async-scheduling``): the harness builds the
scheduler class vLLM's ``SchedulerConfig.get_scheduler_cls()`` gives for it (the real
``AsyncScheduler``) and steps it as ``EngineCore.step_with_batch_queue`` does with a batch
queue of depth 2: step N+1 is scheduled and handed to the worker before step N's output
reaches ``update_from_output`` (output placeholders, ``num_output_placeholders``;
:mod:`kvguard.lab.replay.batch_queue`). A release whose code lacks what that needs
(``AsyncScheduler``, the config field, output placeholders) raises ``RuntimeError``
naming the field and release, as ``groups`` does where a release cannot express it.

Optional geometry field ``connector`` (default ``"OffloadingConnector"``): vLLM's
``kv_connector``, one of :data:`CONNECTORS`. ``"SimpleCPUOffloadConnector"`` (what vLLM runs
with ``VLLM_USE_SIMPLE_KV_OFFLOAD=1``) replays the real connector's scheduler side
(``scheduler_manager``, vLLM's ``SimpleCPUOffloadScheduler``) with its copy engine simulated
at the connector's own boundary (:mod:`kvguard.lab.replay.simple_worker`); it has no chunk
(a CPU block is one GPU block: ``tokens_per_chunk`` must equal ``tokens_per_block``), no
secondary tier, and its worker reports no failed copy (a ``worker`` with ``fail_*`` faults
is refused; latency and hung events are modelled).

Optional geometry field ``extra_config`` (object, default none): operator settings, the
further ``kv_connector_extra_config`` keys the engine is built with (``eviction_policy``,
``store_threshold``, ``max_tracker_size``, ``offload_prompt_only``, ``sync_load_budget_bytes``,
``lazy_offload``, as
``kvguard fuzz`` draws them: :data:`kvguard.lab.knobs.OPERATOR_SETTINGS`), passed to vLLM as
written, so vLLM's own checks judge them. Values are JSON scalars; a key the lab derives
from the geometry (:data:`kvguard.lab.knobs.LAB_KEYS`) is refused.

Optional geometry field ``speculative`` (object, default none): speculative decoding,
``{"method": "ngram" | "eagle" | "mtp", "num_speculative_tokens": k}`` (vLLM's
``SpeculativeConfig``; ``eagle`` and ``mtp`` take the target's tiny config as their draft
model, enough for the scheduler side, which reads ``use_eagle`` and the lookahead slots).
The simulated worker proposes ``k`` draft tokens after every sampled token, the first
``a`` of them the request's true next tokens and the rest wrong ones (``a`` drawn from the
request id and output index, :func:`kvguard.lab.replay.worker.drafts`), verifies them as
a target model would (the accepted prefix plus one token), and the forward writes the
drafts' own KV, so a rejected draft's KV is in the block until the position is computed
again. Not with ``async_scheduling`` or the SimpleCPUOffloadConnector yet (refused).

Optional header object ``worker``: the simulated worker's transfer timing and faults
(:class:`kvguard.lab.replay.jobs.WorkerModel`; absent = every job completes,
successfully, in the step it is submitted)::

    "worker": {"load_latency_steps": {"min": 0, "max": 4}, "store_latency_steps": 2,
               "seed": 7, "fail_loads": {"rate": 0.1}, "fail_store_jobs": [3, 5],
               "hang_load_jobs": [0]}

- ``load_latency_steps`` / ``store_latency_steps``: engine steps from the step vLLM's
  worker submits a job to the step its ``get_finished()`` reports it; an int (fixed) or
  ``{"min", "max"}`` (uniform, drawn per job from ``seed``). Different draws make a
  later job finish before an earlier one (out-of-order completion).
- ``fail_loads`` / ``fail_stores``: ``{"rate": R}``, each job fails
  (``TransferResult.success=False``) with probability R; ``fail_load_jobs`` /
  ``fail_store_jobs``: 0-based job ordinals (per direction, in submission order) that
  fail; ``hang_load_jobs`` / ``hang_store_jobs``: ordinals whose completion is never
  reported (a lost completion).
- ``seed``: seeds the latency and failure draws (int, default 0).

Request (one per line, in arrival order)::

    {"kind": "request", "id": "agent-a/turn-1",
     "after": "agent-a/turn-0",
     "prompt": [{"seed": 7, "tokens": 98304}, {"output_of": "agent-a/turn-0"},
                {"seed": 8, "tokens": 200}],
     "max_tokens": 8,
     "external_hit_tokens": 98012}

- ``id``: unique request id (vLLM ``request_id``).
- ``after`` (optional): the request arrives once that earlier request has finished
  (serialized agent turns). Without it the request arrives at step ``arrival_step``
  (optional, default 0), i.e. before the ``arrival_step``-th ``schedule()`` call.
- ``prompt``: a list of segments, concatenated. ``{"seed": S, "tokens": N}`` is N token
  ids drawn from ``random.Random(S)`` (the same seed gives the same tokens, which is how
  two requests share a prefix). ``{"output_of": ID}`` is the tokens the simulated worker
  sampled for request ID (an earlier request; this request arrives only once ID has
  finished, whatever ``after`` says).
- ``max_tokens``: output tokens to generate (``SamplingParams.max_tokens``).
- ``external_hit_tokens`` (optional): drive this request's external-hit step directly.
  The real lookup runs first; its hit (tokens beyond the local GPU hit) is then capped so
  that ``num_cached_tokens`` equals this value. This is the documented fallback
  for a geometry a vLLM release cannot reach through ``schedule()`` alone (see
  ``docs/replay.md``); everything after it (allocation in the real KV cache manager,
  ``update_state_after_alloc``, the load job, the worker) is vLLM's own path.
- ``abort_at_step`` (optional, non-negative int ``N``): the client aborts the request.
  Before the ``N``-th ``schedule()`` call (the harness loop's 0-based step counter,
  after that step's arrivals), if the request has arrived and is not finished, the
  harness calls the real ``Scheduler.finish_requests(request_id,
  RequestStatus.FINISHED_ABORTED)``, as EngineCore does when a client disconnects. The
  request then counts as ``aborted``, not ``finished``; an aborted request is not lost.
  If the request has not arrived by step ``N``, or finished before it, nothing is
  aborted and it runs to its end. No request may depend on a request that has
  ``abort_at_step`` (``after`` or ``output_of``): its arrival would depend on whether the
  abort came before the end, so the trace is rejected with :class:`TraceError`.

- ``evict_cpu_after_lookup`` (optional, bool; SimpleCPUOffloadConnector traces only): the
  first time the connector's lookup answers this request a CPU hit, its CPU block pool
  allocates every free block and frees them again (vLLM's own ``BlockPool.get_new_blocks``
  / ``free_blocks``): every cached CPU block nobody pins is evicted, between the lookup and
  ``update_state_after_alloc``, the window of vllm#39702 ("found by the lookup, evicted
  before update_state_after_alloc"). A driven step like ``external_hit_tokens``: in one
  engine's ``schedule()`` order nothing allocates CPU blocks between the two phases
  (stores allocate in ``build_connector_meta``, after every admission of the step; read in
  0.21.0's ``scheduler.py`` and ``simple_kv_offload/manager.py``), so the lab makes the
  allocation the public report names; whether the hit survives it is the release's own
  pinning (vllm#42289: the lookup ``touch``es its hit from 0.25.1 on).

Restart (optional, between two requests)::

    {"kind": "restart"}

The engine restarts over its secondary tiers (vLLM's fs, obj and p2p tiers outlive the
engine; the lab carries its example tier over): once every request before the line has
ended and the connector drained, a new engine (scheduler, GPU prefix cache, CPU tier,
worker, kvguard's per-scheduler state) is built over the same tier contents, and the
requests after the line arrive there. Needs ``geometry.secondary_tiers``. An ``after`` or
``output_of`` across a restart is allowed (the client keeps the earlier answer).

Engines sharing a tier (optional request field ``engine``, an int from 0 to 3, default 0):
the requests of each engine number are served by their own engine (scheduler, GPU prefix
cache, CPU tier, worker, kvguard's per-scheduler state), every engine stepping once per
replay step in engine order, all over the same fs tier directory (vLLM's fs tier is the
tier several servers share through a volume). Needs an ``"fs"`` tier in
``geometry.secondary_tiers``; not combined with restart lines. ``after`` and
``output_of`` may name a request of another engine (the client saw its answer).

Prompt tokens are generated at replay time and are never written to a report or log.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

from kvguard.lab.replay.jobs import WorkerModel, WorkerModelError

FORMAT = "kvguard-replay/1"
#: Built-in trace names -> file names under lab/replay/traces/.
BUILTIN_TRACES: dict[str, str] = {
    "seed-48959": "seed-48959.jsonl",
    "seed-42945": "seed-42945.jsonl",
    "load-evicted-window": "load-evicted-window.jsonl",
    "simple-39702": "simple-39702.jsonl",
}
DEFAULT_TRACE = "seed-48959"


class TraceError(ValueError):
    """A trace file that does not follow the format above (message names the line)."""


GROUP_KINDS = ("full", "sliding_window")


@dataclass(frozen=True)
class GroupGeometry:
    """One KV cache group of a trace's ``geometry.groups`` (units in the module docstring)."""

    kind: str
    tokens_per_block: int
    sliding_window: int | None = None
    extra_retained_tokens: int = 0
    #: multi-head latent attention: vLLM's ``MLAAttentionSpec`` / ``SlidingWindowMLASpec``
    mla: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "tokens_per_block": self.tokens_per_block}
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
        if self.extra_retained_tokens:
            out["extra_retained_tokens"] = self.extra_retained_tokens
        if self.mla:
            out["mla"] = True
        return out


def _parse_group(obj: Any, i: int, default_tpb: int) -> GroupGeometry:
    where = f"geometry.groups[{i}]"
    if not isinstance(obj, dict):
        raise TraceError(f"{where} must be an object")
    unknown = set(obj) - {"kind", "tokens_per_block", "sliding_window", "extra_retained_tokens", "mla"}
    if unknown:
        raise TraceError(f"{where}: unknown fields {sorted(unknown)}")
    kind = obj.get("kind")
    if kind not in GROUP_KINDS:
        raise TraceError(f"{where}.kind must be one of {GROUP_KINDS}, got {kind!r}")
    tpb = obj.get("tokens_per_block", default_tpb)
    window = obj.get("sliding_window")
    extra = obj.get("extra_retained_tokens", 0)
    if not isinstance(tpb, int) or tpb <= 0:
        raise TraceError(f"{where}.tokens_per_block must be a positive int")
    if kind == "sliding_window":
        if not isinstance(window, int) or window <= 0:
            raise TraceError(f"{where}.sliding_window must be a positive int")
    elif window is not None or extra:
        raise TraceError(f"{where}: a full-attention group has no sliding_window")
    if not isinstance(extra, int) or extra < 0:
        raise TraceError(f"{where}.extra_retained_tokens must be a non-negative int")
    mla = obj.get("mla", False)
    if not isinstance(mla, bool):
        raise TraceError(f"{where}.mla must be true or false")
    return GroupGeometry(kind=kind, tokens_per_block=tpb, sliding_window=window,
                         extra_retained_tokens=extra, mla=mla)


#: Geometry fields that are not positive ints (validated on their own).
#: engines a trace may run side by side over one fs tier (request field ``engine``)
MAX_ENGINES = 4

_OPTIONAL_FIELDS = ("extra_retained_tokens", "groups", "secondary_tiers", "async_scheduling", "connector",
                    "extra_config", "speculative")

#: ``geometry.speculative`` methods: vLLM's ``SpeculativeConfig.method`` values whose
#: scheduler side the lab builds without a drafter's weights (``ngram`` needs no model;
#: ``eagle`` and ``mtp`` are given the target's own tiny config as their draft model).
SPECULATIVE_METHODS = ("ngram", "eagle", "mtp")
#: the most ``num_speculative_tokens`` a trace may ask for
MAX_SPECULATIVE_TOKENS = 8

#: JSON types an ``extra_config`` value may have (vLLM reads them with ``int()``, ``bool()``,
#: ``str``): no list or object, which would be a setting the lab builds itself.
_SETTING_TYPES = (bool, int, float, str)

#: The ``kv_connector`` a trace may select (``geometry.connector``): vLLM's two native CPU
#: offload connectors. The first is the default (``--kv-offloading-backend native``); the
#: second is what vLLM runs with ``VLLM_USE_SIMPLE_KV_OFFLOAD=1``.
CONNECTORS = ("OffloadingConnector", "SimpleCPUOffloadConnector")


@dataclass(frozen=True)
class Geometry:
    """KV cache and scheduler geometry of one replay (units in the module docstring)."""

    tokens_per_block: int = 32
    tokens_per_chunk: int = 256
    sliding_window: int = 4096
    num_gpu_blocks: int = 8192
    cpu_chunks: int = 4096
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 8
    max_model_len: int = 131072
    vocab_size: int = 32000
    #: tokens the sliding-window group keeps below its window (default layout only)
    extra_retained_tokens: int = 0
    #: explicit KV cache groups (``None``: full attention + one sliding window)
    groups: tuple[GroupGeometry, ...] | None = None
    #: secondary tier types below the CPU tier (``None``: the CPU tier alone)
    secondary_tiers: tuple[str, ...] | None = None
    #: vLLM's ``SchedulerConfig.async_scheduling``: drive ``AsyncScheduler`` through a
    #: batch queue of depth 2 (``EngineCore.step_with_batch_queue``; see batch_queue.py)
    async_scheduling: bool = False
    #: vLLM's ``kv_connector`` (one of :data:`CONNECTORS`)
    connector: str = "OffloadingConnector"
    #: operator settings: further ``kv_connector_extra_config`` keys, as sorted
    #: ``(key, value)`` pairs (``None``: vLLM's defaults); see the module docstring
    extra_config: tuple[tuple[str, Any], ...] | None = None
    #: speculative decoding: ``(method, num_speculative_tokens)`` (``None``: off); see the
    #: module docstring
    speculative: tuple[str, int] | None = None

    def kv_groups(self) -> tuple[GroupGeometry, ...]:
        """The KV cache groups of this geometry, in vLLM's group order."""
        if self.groups is not None:
            return self.groups
        return (
            GroupGeometry("full", self.tokens_per_block),
            GroupGeometry("sliding_window", self.tokens_per_block, self.sliding_window,
                          self.extra_retained_tokens),
        )

    def to_json(self) -> dict[str, Any]:
        """The header's ``geometry`` object (optional fields only when set)."""
        out: dict[str, Any] = {
            k: v for k, v in vars(self).items() if k not in _OPTIONAL_FIELDS
        }
        if self.extra_retained_tokens:
            out["extra_retained_tokens"] = self.extra_retained_tokens
        if self.groups is not None:
            out["groups"] = [g.to_json() for g in self.groups]
        if self.secondary_tiers is not None:
            out["secondary_tiers"] = [{"type": t} for t in self.secondary_tiers]
        if self.async_scheduling:
            out["async_scheduling"] = True
        if self.connector != CONNECTORS[0]:
            out["connector"] = self.connector
        if self.extra_config is not None:
            out["extra_config"] = dict(self.extra_config)
        if self.speculative is not None:
            out["speculative"] = {"method": self.speculative[0], "num_speculative_tokens": self.speculative[1]}
        return out

    @property
    def blocks_per_chunk(self) -> int:
        """GPU blocks per offloaded block (``block_size_factor`` / ``blocks_per_chunk``)."""
        return self.tokens_per_chunk // self.tokens_per_block

    def validate(self) -> None:
        """Raise :class:`TraceError` for a geometry vLLM would reject."""
        for name, value in vars(self).items():
            if name in _OPTIONAL_FIELDS:
                continue
            if not isinstance(value, int) or value <= 0:
                raise TraceError(f"geometry.{name} must be a positive int, got {value!r}")
        if self.tokens_per_chunk % self.tokens_per_block:
            raise TraceError("geometry.tokens_per_chunk must be a multiple of tokens_per_block")
        if not isinstance(self.extra_retained_tokens, int) or self.extra_retained_tokens < 0:
            raise TraceError("geometry.extra_retained_tokens must be a non-negative int")
        if not isinstance(self.async_scheduling, bool):
            raise TraceError("geometry.async_scheduling must be true or false")
        if self.connector not in CONNECTORS:
            raise TraceError(f"geometry.connector must be one of {', '.join(CONNECTORS)}, got {self.connector!r}")
        if self.connector != CONNECTORS[0] and self.secondary_tiers is not None:
            raise TraceError("geometry.secondary_tiers is the OffloadingConnector's (TieringOffloadingSpec); "
                             f"geometry.connector is {self.connector}")
        if self.connector != CONNECTORS[0] and self.tokens_per_chunk != self.tokens_per_block:
            raise TraceError(f"geometry.tokens_per_chunk: the {self.connector} copies whole GPU blocks "
                             "(no chunk), so it must equal tokens_per_block")
        if self.groups is not None:
            if self.extra_retained_tokens:
                raise TraceError("geometry: with groups, set extra_retained_tokens per group")
            if not self.groups:
                raise TraceError("geometry.groups must list at least one group")
        if self.secondary_tiers is not None:
            from kvguard.lab.replay.tiering import validate_tiers

            try:
                validate_tiers([{"type": t} for t in self.secondary_tiers])
            except ValueError as exc:
                raise TraceError(str(exc)) from None
        if self.extra_config is not None:
            _validate_extra_config(self.extra_config)
        if self.speculative is not None:
            _validate_speculative(self)


def _validate_speculative(geo: "Geometry") -> None:
    """Raise :class:`TraceError` for a ``geometry.speculative`` the lab cannot drive."""
    method, k = geo.speculative  # type: ignore[misc]
    if method not in SPECULATIVE_METHODS:
        raise TraceError(f"geometry.speculative.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                         f"got {method!r}")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise TraceError(f"geometry.speculative.num_speculative_tokens must be an int in "
                         f"1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
    if geo.async_scheduling:
        raise TraceError("geometry.speculative: not with async_scheduling (the lab's batch queue "
                         "does not carry draft tokens yet)")


def _validate_extra_config(pairs: tuple[tuple[str, Any], ...]) -> None:
    """Raise :class:`TraceError` unless ``pairs`` are sorted unique ``(key, scalar)`` pairs
    naming no key the lab sets from the geometry (:data:`kvguard.lab.knobs.LAB_KEYS`)."""
    from kvguard.lab.knobs import LAB_KEYS

    keys = [k for k, _ in pairs]
    if keys != sorted(set(keys)):
        raise TraceError(f"geometry.extra_config: keys must be unique and sorted, got {keys}")
    for key, value in pairs:
        if key in LAB_KEYS:
            raise TraceError(f"geometry.extra_config.{key}: the lab sets it from the geometry "
                             f"({LAB_KEYS[key]})")
        if not isinstance(value, _SETTING_TYPES):
            raise TraceError(f"geometry.extra_config.{key} must be a bool, number or string, got {value!r}")


@dataclass(frozen=True)
class Segment:
    """One prompt segment: ``seed``/``tokens`` or ``output_of``."""

    seed: int | None = None
    tokens: int = 0
    output_of: str | None = None

    def to_json(self) -> dict[str, Any]:
        if self.output_of is not None:
            return {"output_of": self.output_of}
        return {"seed": self.seed, "tokens": self.tokens}


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace (fields as in the module docstring)."""

    id: str
    prompt: tuple[Segment, ...]
    max_tokens: int
    after: str | None = None
    arrival_step: int = 0
    external_hit_tokens: int | None = None
    abort_at_step: int | None = None
    evict_cpu_after_lookup: bool = False
    #: the engine that serves it (0 unless the trace runs engines sharing an fs tier)
    engine: int = 0

    @property
    def waits_for(self) -> tuple[str, ...]:
        """Request ids that must have finished before this one arrives."""
        ids = [s.output_of for s in self.prompt if s.output_of is not None]
        if self.after is not None:
            ids.append(self.after)
        return tuple(dict.fromkeys(ids))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": "request", "id": self.id}
        if self.after is not None:
            out["after"] = self.after
        elif self.arrival_step:
            out["arrival_step"] = self.arrival_step
        out["prompt"] = [s.to_json() for s in self.prompt]
        out["max_tokens"] = self.max_tokens
        if self.external_hit_tokens is not None:
            out["external_hit_tokens"] = self.external_hit_tokens
        if self.abort_at_step is not None:
            out["abort_at_step"] = self.abort_at_step
        if self.evict_cpu_after_lookup:
            out["evict_cpu_after_lookup"] = True
        if self.engine:
            out["engine"] = self.engine
        return out


@dataclass(frozen=True)
class Trace:
    """A parsed trace: a header (name, description, geometry) and its requests."""

    name: str
    geometry: Geometry
    requests: tuple[TraceRequest, ...]
    description: str = ""
    source: str = field(default="", compare=False)
    #: the simulated worker's timing and faults (header ``worker``; default: immediate)
    worker: WorkerModel = field(default_factory=WorkerModel)
    #: engine restarts over the secondary tiers: the ids of the requests each restart comes
    #: before (a ``{"kind": "restart"}`` line; needs ``geometry.secondary_tiers``). The engine
    #: restarts once every request before it has ended and the connector drained; the
    #: requests after it arrive on the new engine (lab/replay/harness.py). An id no longer in
    #: ``requests`` (a shrunk trace) drops its restart.
    restarts: tuple[str, ...] = ()

    @property
    def engines(self) -> int:
        """Engines the trace runs side by side over its fs tier (1 + the largest request
        ``engine``)."""
        return 1 + max((r.engine for r in self.requests), default=0)

    def dumps(self) -> str:
        """Serialize back to JSONL (one header line, one line per request)."""
        header = {
            "kind": "header",
            "format": FORMAT,
            "name": self.name,
            "description": self.description,
            "geometry": self.geometry.to_json(),
        }
        if not self.worker.is_default:
            header["worker"] = self.worker.to_json()
        restarts = set(self.restarts)
        lines = [json.dumps(header)]
        for r in self.requests:
            if r.id in restarts:
                lines.append(json.dumps({"kind": "restart"}))
            lines.append(json.dumps(r.to_json()))
        return "\n".join(lines) + "\n"


def segment_tokens(seed: int, num_tokens: int, vocab_size: int) -> list[int]:
    """``num_tokens`` token ids in ``[1, vocab_size)`` drawn from ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [rng.randrange(1, vocab_size) for _ in range(num_tokens)]


def _parse_segment(obj: Any, where: str) -> Segment:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a prompt segment must be an object")
    if "output_of" in obj:
        if not isinstance(obj["output_of"], str):
            raise TraceError(f"{where}: output_of must be a request id")
        return Segment(output_of=obj["output_of"])
    seed, tokens = obj.get("seed"), obj.get("tokens")
    if not isinstance(seed, int) or not isinstance(tokens, int) or tokens <= 0:
        raise TraceError(f"{where}: a segment needs int seed and positive int tokens")
    return Segment(seed=seed, tokens=tokens)


def parse_trace(lines: Iterable[str], source: str = "<string>") -> Trace:
    """Parse JSONL text into a :class:`Trace`. Raises :class:`TraceError`."""
    header: dict[str, Any] | None = None
    requests: list[TraceRequest] = []
    seen: set[str] = set()
    aborting: set[str] = set()  # ids with abort_at_step: nothing may depend on them
    restarts: list[str] = []
    restart_where: str | None = None  # a restart line not followed by a request yet
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not JSON ({exc.msg})") from None
        kind = obj.get("kind") if isinstance(obj, dict) else None
        if header is None:
            if kind != "header" or obj.get("format") != FORMAT:
                raise TraceError(f"{where}: first line must be a {FORMAT!r} header")
            header = obj
            continue
        if kind == "restart":
            if set(obj) != {"kind"}:
                raise TraceError(f"{where}: a restart line has no other field")
            if not requests or restart_where is not None:
                raise TraceError(f"{where}: a restart must come between requests")
            restart_where = where
            continue
        if kind != "request":
            raise TraceError(f"{where}: expected kind 'request' or 'restart', got {kind!r}")
        rid = obj.get("id")
        if not isinstance(rid, str) or not rid or rid in seen:
            raise TraceError(f"{where}: id must be a unique non-empty string")
        prompt = obj.get("prompt")
        if not isinstance(prompt, list) or not prompt:
            raise TraceError(f"{where}: prompt must be a non-empty list of segments")
        segments = tuple(_parse_segment(s, where) for s in prompt)
        for seg in segments:
            if seg.output_of is not None and seg.output_of not in seen:
                raise TraceError(f"{where}: output_of {seg.output_of!r} is not an earlier request")
        after = obj.get("after")
        if after is not None and after not in seen:
            raise TraceError(f"{where}: after {after!r} is not an earlier request")
        max_tokens = obj.get("max_tokens")
        if not isinstance(max_tokens, int) or max_tokens <= 0:
            raise TraceError(f"{where}: max_tokens must be a positive int")
        hit = obj.get("external_hit_tokens")
        if hit is not None and (not isinstance(hit, int) or hit <= 0):
            raise TraceError(f"{where}: external_hit_tokens must be a positive int")
        step = obj.get("arrival_step", 0)
        if not isinstance(step, int) or step < 0:
            raise TraceError(f"{where}: arrival_step must be a non-negative int")
        abort = obj.get("abort_at_step")
        if abort is not None and (isinstance(abort, bool) or not isinstance(abort, int) or abort < 0):
            raise TraceError(f"{where}: abort_at_step must be a non-negative int")
        for dep in [s.output_of for s in segments if s.output_of is not None] + [after]:
            if dep is not None and dep in aborting:
                raise TraceError(
                    f"{where}: depends on {dep!r}, which has abort_at_step "
                    "(a request may not wait for an aborted one)"
                )
        evict = obj.get("evict_cpu_after_lookup", False)
        if not isinstance(evict, bool):
            raise TraceError(f"{where}: evict_cpu_after_lookup must be true or false")
        engine = obj.get("engine", 0)
        if isinstance(engine, bool) or not isinstance(engine, int) or not 0 <= engine < MAX_ENGINES:
            raise TraceError(f"{where}: engine must be an int from 0 to {MAX_ENGINES - 1}")
        if abort is not None:
            aborting.add(rid)
        if restart_where is not None:
            restarts.append(rid)
            restart_where = None
        seen.add(rid)
        requests.append(
            TraceRequest(
                id=rid,
                prompt=segments,
                max_tokens=max_tokens,
                after=after,
                arrival_step=step,
                external_hit_tokens=hit,
                abort_at_step=abort,
                evict_cpu_after_lookup=evict,
                engine=engine,
            )
        )
    if header is None:
        raise TraceError(f"{source}: empty trace")
    geo = dict(header.get("geometry") or {})
    if "groups" in geo:
        groups = geo["groups"]
        if not isinstance(groups, list):
            raise TraceError(f"{source}: geometry.groups must be a list")
        tpb = geo.get("tokens_per_block", Geometry.tokens_per_block)
        geo["groups"] = tuple(_parse_group(g, i, tpb) for i, g in enumerate(groups))
    if "secondary_tiers" in geo:
        from kvguard.lab.replay.tiering import validate_tiers

        try:
            geo["secondary_tiers"] = validate_tiers(geo["secondary_tiers"])
        except ValueError as exc:
            raise TraceError(f"{source}: {exc}") from None
    if "speculative" in geo:
        spec = geo["speculative"]
        if not isinstance(spec, dict) or set(spec) != {"method", "num_speculative_tokens"}:
            raise TraceError(f"{source}: geometry.speculative must be an object with method and "
                             "num_speculative_tokens")
        geo["speculative"] = (spec["method"], spec["num_speculative_tokens"])
    if "extra_config" in geo:
        settings = geo["extra_config"]
        if not isinstance(settings, dict):
            raise TraceError(f"{source}: geometry.extra_config must be an object")
        geo["extra_config"] = tuple(sorted(settings.items()))
    try:
        geometry = Geometry(**geo)
    except TypeError as exc:
        raise TraceError(f"{source}: bad geometry ({exc})") from None
    geometry.validate()
    try:
        worker = WorkerModel.from_json(header.get("worker"))
    except WorkerModelError as exc:
        raise TraceError(f"{source}: {exc}") from None
    if geometry.connector != "SimpleCPUOffloadConnector" and any(r.evict_cpu_after_lookup for r in requests):
        raise TraceError(f"{source}: evict_cpu_after_lookup drives the SimpleCPUOffloadConnector's CPU block "
                         "pool; set geometry.connector to SimpleCPUOffloadConnector")
    if geometry.connector != CONNECTORS[0] and (worker.load_faults.rate or worker.load_faults.jobs
                                                 or worker.store_faults.rate or worker.store_faults.jobs):
        raise TraceError(f"{source}: worker fail_* faults: the {geometry.connector}'s worker reports no "
                         "failed copy (its CUDA events only complete), so a trace for it models latency "
                         "and hung events only")
    if not requests:
        raise TraceError(f"{source}: a trace needs at least one request")
    if restart_where is not None:
        raise TraceError(f"{restart_where}: a restart must come between requests")
    if restarts and not geometry.secondary_tiers:
        raise TraceError(f"{source}: a restart needs geometry.secondary_tiers (without a tier "
                         "nothing outlives the engine)")
    if any(r.engine for r in requests):
        if "fs" not in (geometry.secondary_tiers or ()):
            raise TraceError(f"{source}: requests on engine > 0 need an fs tier in geometry.secondary_tiers "
                             "(engines share a tier through its files)")
        if restarts:
            raise TraceError(f"{source}: restart lines and several engines are not expressed together")
    return Trace(
        name=str(header.get("name") or Path(source).stem),
        geometry=geometry,
        requests=tuple(requests),
        description=str(header.get("description", "")),
        source=source,
        worker=worker,
        restarts=tuple(restarts),
    )


def load_trace(name_or_path: str) -> Trace:
    """Load a built-in trace by name (``seed-48959``, ``seed-42945``) or a JSONL file path.

    Raises :class:`TraceError` for an unknown name, a missing file or a malformed trace.
    """
    if name_or_path in BUILTIN_TRACES:
        ref = resources.files("kvguard.lab.replay").joinpath("traces", BUILTIN_TRACES[name_or_path])
        return parse_trace(ref.read_text(encoding="utf-8").splitlines(), source=name_or_path)
    path = Path(name_or_path)
    if not path.is_file():
        known = ", ".join(sorted(BUILTIN_TRACES))
        raise TraceError(f"no trace {name_or_path!r}: not a file and not one of {known}")
    return parse_trace(path.read_text(encoding="utf-8").splitlines(), source=str(path))
