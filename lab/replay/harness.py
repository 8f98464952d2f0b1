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
  secondary tier (:mod:`kvguard.lab.replay.tiering`);
- simulated: the GPU side (:class:`kvguard.lab.replay.worker.SimulatedWorker`): the
  copy engine below vLLM's worker-side connector and the model forward.

What the lab knows about vLLM's internal types and call order lives in
:mod:`kvguard.lab.replay.vllm_api` (the rule of what is simulated is written there);
this module is the replay loop.

The guard is installed through the plugin's own entry point,
:func:`kvguard.guards.plugin.register`, before any vLLM offload module is imported, exactly as
vLLM's ``load_general_plugins()`` would call it inside EngineCore.

An exception escaping ``schedule()`` or ``update_from_output()`` is what kills
EngineCore in a server (vLLM #48966); the replay records it as the engine's death and
stops; so is an exception from vLLM's worker-side connector code (the worker process
dies, and EngineCore with it). An exception of the lab itself is not a death
(:func:`harness_error_of`): a :class:`~kvguard.lab.replay.vllm_api.HarnessError`, or
one whose innermost frame is the lab's code (``lab/``: a vLLM
API the lab expected is not there), ends the replay with ``ReplayResult.harness_error``
(``kvguard replay`` exits 2). A replay whose requests stop making progress for
:data:`STALL_STEPS` steps (a request deferred forever) stops as stalled, and
:class:`~kvguard.lab.replay.stalls.StallWatch` names each unfinished request's stall
(``ReplayResult.stalls``). Once every request has finished, the replay keeps stepping
(at most :data:`STALL_STEPS` steps) while the worker still has jobs to submit or
complete, as EngineCore keeps stepping while the connector has pending work.

With ``geometry.async_scheduling`` the scheduler is vLLM's ``AsyncScheduler`` (the class
``SchedulerConfig.get_scheduler_cls()`` gives) and each step follows vLLM 0.33.0's
``EngineCore.step_with_batch_queue`` with a batch queue of 2
(:mod:`kvguard.lab.replay.batch_queue`): ``schedule()``, the worker runs the step,
and only when the queue is full is the oldest step's output given to
``update_from_output``; without it, ``EngineCore.step``'s order (schedule, execute,
update, every step).
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import inspect
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvguard.lab.fuzz import classes as fuzz_classes
from kvguard.lab.replay import batch_queue, vllm_api
from kvguard.lab.replay.jobs import WorkerModel
from kvguard.lab.replay.stalls import StallWatch
from kvguard.lab.replay.fs_tier import TierStorage
from kvguard.lab.replay.tiering import TierTap, carry_contents, tiering_manager, unlink_shared_region
from kvguard.lab.replay.trace import Geometry, Trace, TraceRequest, segment_tokens
from kvguard.lab.replay.vllm_api import HarnessError, vllm_version
from kvguard.lab.replay.simple_worker import SimpleWorker
from kvguard.lab.replay.worker import SimulatedWorker, WorkerHang

__all__ = ["STALL_STEPS", "MAX_STEPS", "ReplayResult", "Engine", "HarnessError", "build_engine", "close_engine",
           "run_replay", "install_guard", "uninstall_guard", "vllm_version", "harness_error_of"]

#: Steps without any scheduled token, finished request or arrival before a replay stops.
STALL_STEPS = 64
#: Hard cap on steps per replay (a runaway trace is a bug, not a result), raised for a long
#: trace to :data:`STEPS_PER_REQUEST` per request: a 2,500-epoch life (``kvguard fuzz
#: --epochs``) of tens of thousands of requests ran into a flat 200,000 and read as a stall.
MAX_STEPS = 200_000
STEPS_PER_REQUEST = 64

@dataclass(frozen=True)
class RetiredOracle:
    """What the KV-content oracle of an engine that is gone found: its wrong-KV records
    (``wrong_kv``: dicts, see :mod:`.kv_oracle`), the requests that read them and the GPU
    blocks. Kept instead of the oracle, whose pages and token view (a bound method of its
    worker, and so the worker's scheduler) would keep every retired engine alive: a long
    life with hundreds of restarts grew to 23 GB and was killed for memory (0.34.0, fuzz
    seed 7003, ``--epochs 2500``)."""

    wrong_kv: tuple[Any, ...]
    wrong_kv_requests: frozenset[str]
    wrong_kv_blocks: int

    @classmethod
    def of(cls, oracle: Any) -> "RetiredOracle":
        return cls(tuple(oracle.wrong_kv), frozenset(oracle.wrong_kv_requests), int(oracle.wrong_kv_blocks))


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
    #: the lab itself failed (not vLLM, not kvguard's guard): ``{"exception", "traceback",
    #: "expected"}`` (:func:`harness_error_of`); ``engine_survived`` says nothing then
    harness_error: dict[str, str] | None = None
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
    #: per trace request, how it ended (a key of ``kvguard.lab.fuzz.differential.RANK``): ``finished``, ``failed`` (an error
    #: status its client sees), ``aborted`` (by the trace), ``unfinished`` (arrived, never
    #: ended: stranded, or the engine died), ``not_arrived`` (never sent: a request it waits
    #: for, directly or through others, failed), ``not_arrived_stalled`` (never sent, and no
    #: request it waits for failed: it waits behind one that never ended, or the replay ended
    #: first: lost with a stall or a death); the differential fuzz compares them request by request
    request_fates: dict[str, str] = field(default_factory=dict)
    steps: int = 0
    wall_s: float = 0.0
    step_times_s: list[float] = field(default_factory=list)
    #: the same intervals in this thread's CPU time (``time.thread_time``): what a step
    #: cost the engine's thread, without the time other processes held the core
    step_cpu_s: list[float] = field(default_factory=list)
    #: per step, the part of ``step_cpu_s`` spent in full (generation-2) garbage collections,
    #: CPU seconds; recorded when ``run_replay`` is given ``before_step`` (the benches), else
    #: 0.0. One such collection lands on one step per replay and costs 40-210 ms on the bench
    #: trace (a scan of every object the replay keeps alive): a single step that moves a sum of
    #: ~1.3 s by several percent, on whichever half of a bench pair it falls
    step_full_gc_s: list[float] = field(default_factory=list)
    #: per step, the requests ``schedule()`` scheduled (running requests; the bench's growth axis)
    step_requests: list[int] = field(default_factory=list)
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: per stage, exceptions inside kvguard code during the replay (runtime.guard_errors())
    guard_errors: dict[str, int] = field(default_factory=dict)
    #: the instrumentor's report: installed, not_rewritten, disabled, special_missing, modules
    sites: dict[str, Any] = field(default_factory=dict)
    #: engine restarts the trace made (``restart`` lines), and the KV oracles of the engines
    #: before the last one (``worker`` is the last engine's)
    restarts: int = 0
    #: what the KV oracles of the engines before the last restart and of the engines beside
    #: engine 0 (a trace whose requests name several ``engine``s sharing an fs tier) found
    #: (:class:`RetiredOracle`: the verdict only, so a retired engine is not kept alive)
    retired_oracles: list[Any] = field(default_factory=list, repr=False)
    #: engines that served the trace side by side (1 unless requests name ``engine`` > 0);
    #: ``worker`` and ``cpu_chunks`` are engine 0's, ``secondary_tiers`` sums every engine's
    engines: int = 1
    #: per request: local GPU hit and external hit tokens seen by the connector lookup
    hits: dict[str, dict[str, int]] = field(default_factory=dict)
    #: requests whose ``external_hit_tokens`` step was driven directly (see trace.py)
    driven_hits: dict[str, dict[str, int]] = field(default_factory=dict)
    #: per request with ``evict_cpu_after_lookup``: CPU blocks the driven eviction evicted
    driven_evictions: dict[str, int] = field(default_factory=dict)
    worker: "SimulatedWorker | SimpleWorker | None" = None
    #: the trace's ``async_scheduling`` (AsyncScheduler behind a batch queue of depth 2)
    async_scheduling: bool = False
    #: the batch queue and its lag counters (``scheduled_ahead``, ``placeholder_requests``)
    lag: batch_queue.BatchQueue | None = None
    cpu_chunks: int | None = None
    pending_store_keys: int | None = None
    #: with ``geometry.secondary_tiers``: :meth:`TierTap.summary` (chunks cascaded to and
    #: promoted from the secondary tiers); ``None`` without a secondary tier
    secondary_tiers: dict[str, int] | None = None

    def oracles(self) -> list[Any]:
        """The KV-content oracles of every engine of the replay, oldest first."""
        oracle = self.worker.oracle if self.worker is not None else None
        return self.retired_oracles + ([oracle] if oracle is not None else [])

    @property
    def wrong_kv_requests(self) -> set[str]:
        """Ids of the requests the KV-content oracle found reading wrong KV (empty without
        one), on every engine of the replay (a trace with restarts has several)."""
        return set().union(*(o.wrong_kv_requests for o in self.oracles()))

    @property
    def wrong_kv_blocks(self) -> int:
        """GPU blocks the KV-content oracle found holding wrong KV (0 without an oracle), on
        every engine of the replay."""
        return sum(o.wrong_kv_blocks for o in self.oracles())

    @property
    def ok(self) -> bool:
        """Exit-0 condition: the lab ran (no ``harness_error``), the engine survived, did not stall, every submitted request
        finished, was aborted by the trace, or was failed alone with an error status (its
        client got an error: not a lost request; see ``failed_requests``), and the
        KV-content oracle found no wrong KV (``wrong_kv_blocks == 0``)."""
        return (
            self.harness_error is None
            and self.engine_survived
            and not self.stalled
            and self.finished + self.aborted + len(self.failed_requests) == self.submitted
            and self.wrong_kv_blocks == 0
        )




def install_guard(policy: str) -> bool:
    """Install the offload guards the way vLLM loads the plugin (``kvguard.guards.plugin.register``).

    Returns what ``register`` returns: True when the guards are installed in this process.
    A guard this process installed earlier with another policy is uninstalled first (a
    repeated install keeps the first policy, as the plugin's does inside vLLM).
    """
    from kvguard.guards import plugin
    from kvguard.guards.hooking.instrumentor import OffloadGuardInstrumentor
    from kvguard.guards.settings import GuardSettings

    os.environ.pop("KVGUARD_DISABLE", None)
    from kvguard.guards.policy import runtime

    inst = OffloadGuardInstrumentor()
    if inst.is_installed and runtime.policy() != policy:
        inst.uninstall()  # a guard installed earlier in this process keeps its policy otherwise
    settings = GuardSettings(policy=policy)
    installed = plugin.register(settings)
    from kvguard.guards.checks import wait_bound

    # simulated time: the wait bound counts steps only (guards/checks/wait_bound.py)
    wait_bound.set_bound(steps=settings.wait_bound_steps, seconds=0.0)
    return bool(installed) or OffloadGuardInstrumentor().is_installed


def uninstall_guard() -> None:
    """Restore vLLM's original code if this process installed the guard (bench, tests)."""
    if "kvguard.guards.hooking.instrumentor" in sys.modules:
        from kvguard.guards.hooking.instrumentor import OffloadGuardInstrumentor

        inst = OffloadGuardInstrumentor()
        if inst.is_installed:
            inst.uninstall()




@dataclass
class Engine:
    """The real scheduler, its offloading connector (scheduler role) and the worker."""

    scheduler: Any
    connector: Any
    connector_scheduler: Any
    worker: "SimulatedWorker | SimpleWorker"
    geometry: Geometry
    version: str
    block_hasher: Callable[[Any], Any]
    #: the secondary tiers' tap (``geometry.secondary_tiers``), else ``None``
    tier_tap: TierTap | None = None
    #: steps in flight (EngineCore's batch queue size): 1 synchronous, 2 async scheduling
    batch_queue_depth: int = 1
    #: where an ``"fs"`` secondary tier keeps its files (shared with the engines a restart
    #: builds), else ``None``
    tier_storage: TierStorage | None = None
    #: this engine created :attr:`tier_storage` (so :meth:`close` removes it)
    owns_tier_storage: bool = False

    def close(self) -> None:
        """Shut the secondary tiers down (vLLM's ``shutdown()`` of each: the fs tier joins
        its I/O threads) and remove the fs tier's directory when this engine created it.
        Idempotent."""
        if self.tier_tap is not None:
            self.tier_tap.close()
            self.tier_tap = None
        if self.owns_tier_storage and self.tier_storage is not None:
            self.tier_storage.close()
            self.owns_tier_storage = False


def build_engine(geometry: Geometry, worker_model: WorkerModel | None = None,
                 tier_storage: TierStorage | None = None) -> Engine:
    """Construct the real ``Scheduler`` + the connector ``geometry.connector`` names
    (scheduler role) for ``geometry`` and the simulated worker
    (:func:`kvguard.lab.replay.vllm_api.build_scheduler` builds vLLM's part; the
    SimpleCPUOffloadConnector's worker is :class:`~kvguard.lab.replay.simple_worker.SimpleWorker`).

    ``worker_model`` is the simulated worker's timing and faults (default: every job
    completes, successfully, in the step it is submitted). ``tier_storage``: the directory
    (and record contents) of an ``"fs"`` secondary tier; without one, a geometry with an fs
    tier gets a new one that the engine owns (:meth:`Engine.close` removes it).

    Raises whatever vLLM raises for a geometry it rejects, ``RuntimeError`` for a geometry
    the release cannot express (and :class:`~kvguard.lab.replay.tiering.TieringUnsupported`),
    and :class:`HarnessError` when the lab cannot bind to the installed vLLM.
    """
    owns = False
    if tier_storage is None and "fs" in (geometry.secondary_tiers or ()):
        tier_storage, owns = TierStorage.create(), True
    try:
        parts = vllm_api.build_scheduler(geometry, connector=geometry.connector,
                                         tier_root=tier_storage.root_dir if tier_storage else None)
    except BaseException:
        if owns:
            tier_storage.close()
        raise
    worker: SimulatedWorker | SimpleWorker
    if geometry.connector == "SimpleCPUOffloadConnector":
        # its worker side is CUDA-only: simulated at the connector's boundary (simple_worker.py)
        worker = SimpleWorker(
            scheduler=parts.scheduler,
            vocab_size=geometry.vocab_size,
            model=worker_model or WorkerModel(),
            num_cpu_blocks=vllm_api.simple_num_cpu_blocks(parts.connector_scheduler),
            speculative_tokens=geometry.speculative[1] if geometry.speculative else 0,
        )
    else:
        worker = SimulatedWorker(
            scheduler=parts.scheduler,
            vocab_size=geometry.vocab_size,
            model=worker_model or WorkerModel(),
            blocks_per_chunk=geometry.blocks_per_chunk,
            speculative_tokens=geometry.speculative[1] if geometry.speculative else 0,
        )
    tap = None
    if geometry.secondary_tiers:
        manager = tiering_manager(parts.connector_scheduler)
        if manager is None:
            raise RuntimeError(
                f"vLLM {parts.version}: geometry.secondary_tiers is set but the connector's manager is "
                f"{type(parts.connector_scheduler.manager).__qualname__}, not a TieringOffloadingManager"
            )
        unlink_shared_region(manager)  # no worker joins it here (tiering.py)
        tap = TierTap(manager, worker.oracle, tier_storage)
    return Engine(
        scheduler=parts.scheduler,
        connector=parts.connector,
        connector_scheduler=parts.connector_scheduler,
        worker=worker,
        geometry=geometry,
        version=parts.version,
        block_hasher=parts.block_hasher,
        tier_tap=tap,
        batch_queue_depth=parts.batch_queue_depth,
        tier_storage=tier_storage,
        owns_tier_storage=owns,
    )


def never_sent_fates(trace: Trace, fates: dict[str, str]) -> dict[str, str]:
    """``fates`` (request id -> fate, every engine's) with each ``not_arrived`` request told
    apart by its cause: ``not_arrived`` where a request it waits for (``after`` /
    ``output_of``, directly or through other never-sent ones) failed, else
    ``not_arrived_stalled`` (it waits behind a request that never ended, or the replay
    stopped first: lost with the stall or the death). The differential ranks the first with
    ``failed`` and the second with a stranded request (lab/fuzz/differential.py)."""
    by_id = {r.id: r for r in trace.requests}
    memo: dict[str, bool] = {}

    def behind_failure(rid: str) -> bool:
        if rid not in memo:
            memo[rid] = False  # a cycle is not a failure's
            memo[rid] = any(fates.get(w) == "failed" or (fates.get(w) == "not_arrived" and w in by_id
                                                          and behind_failure(w))
                            for w in by_id[rid].waits_for)
        return memo[rid]

    causes = {rid: behind_failure(rid) for rid, fate in fates.items() if fate == "not_arrived" and rid in by_id}
    return {rid: ("not_arrived_stalled" if rid in causes and not causes[rid] else fate)
            for rid, fate in fates.items()}


def close_engine(engine: Engine) -> None:
    """End an engine the caller built with :func:`build_engine`: :meth:`Engine.close` (its
    tiers shut down, its fs directory removed when it owns it) and its model directory
    removed (:func:`kvguard.lab.replay.vllm_api.remove_model_dir`). Idempotent."""
    engine.close()
    vllm_api.remove_model_dir(getattr(engine.scheduler.vllm_config.model_config, "model", None))


def restart_engine(old: Engine) -> Engine:
    """A new engine over ``old``'s secondary tiers: what an engine restarted over tiers
    that outlive it sees (vLLM's fs, obj and p2p tiers; the lab's example tier carried over
    by :func:`kvguard.lab.replay.tiering.carry_contents`). Everything else is new: the
    scheduler, its GPU prefix cache, the CPU tier, kvguard's per-scheduler state (its copy
    ledger among it) and the worker; the KV oracle keeps only the tiers' copies
    (:meth:`~kvguard.lab.replay.kv_oracle.KVOracle.adopt_secondary`). A trace's ``restart``
    lines call it (:meth:`_Replay.restart`).

    Raises ``ValueError`` when ``old`` has no secondary tier (nothing outlives an engine
    without one) and :class:`~kvguard.lab.replay.tiering.TieringUnsupported` when its tiers
    cannot be carried.
    """
    if old.tier_tap is None:
        raise ValueError("restart_engine needs geometry.secondary_tiers: without a tier nothing outlives the engine")
    new = build_engine(old.geometry, old.worker.model, old.tier_storage)
    new.owns_tier_storage, old.owns_tier_storage = old.owns_tier_storage, False
    carry_contents(old.tier_tap.manager, new.tier_tap.manager)
    new.worker.oracle.adopt_secondary(old.worker.oracle)
    old.close()  # vLLM's shutdown of the old engine's tiers (its files stay)
    return new


class _HitRecorder:
    """Wraps the connector scheduler's ``get_num_new_matched_tokens`` (instance attribute).

    It records, per request, the local GPU hit and the external hit the connector
    answered, and applies a trace's ``external_hit_tokens`` (the directly driven step,
    the fallback for a geometry ``schedule()`` cannot reach): the external hit is
    capped so that ``num_cached_tokens`` is exactly the trace's value.

    A request without a driven hit (every request of most traces) takes the scheduler's
    own call path: what ``cs.get_num_new_matched_tokens`` was before this recorder (a
    wrapper the guard attached to this scheduler, :func:`kvguard.guards.checks.admission.attach`,
    or the class's method, bound per call as attribute access binds it: with the guard,
    vLLM's code carrying the check, :func:`kvguard.guards.checks.admission.admit_return`), so the
    replay and the bench run kvguard's admission check exactly as EngineCore does. For a
    driven hit:

    Order: vLLM's own lookup (with the guard: its code with kvguard's check passing the
    answer through, :func:`kvguard.guards.checks.admission.unwrapped_lookup`), then the cap, then
    kvguard's admission check (:func:`kvguard.guards.checks.admission.admit`, when the guard
    checks the lookup), so a driven hit passes the same check as any answer of vLLM's
    lookup. The recorded ``external_hit_tokens`` is what the
    scheduler finally received. This recorder changes nothing inside vLLM's code.
    """

    def __init__(self, connector_scheduler: Any, result: ReplayResult):
        # the lookup module itself, read at each call: a test may replace its admit
        from kvguard.guards.checks.admission import lookup

        self._cs = connector_scheduler
        self._admission = lookup
        self._orig, self._admitted = lookup.unwrapped_lookup(connector_scheduler)
        self._cls = type(connector_scheduler)
        self._method = inspect.getattr_static(self._cls, "get_num_new_matched_tokens")
        # what vLLM's ``cs.get_num_new_matched_tokens`` finds first: an instance attribute
        # (a wrapper kvguard attached, admission.attach), else the class's method
        self._instance_attr = connector_scheduler.__dict__.get("get_num_new_matched_tokens")
        self._result = result
        self.targets: dict[str, int] = {}
        #: requests whose first CPU hit is followed by the trace's driven eviction
        self.evict_after: set[str] = set()
        connector_scheduler.get_num_new_matched_tokens = self

    def __call__(self, request: Any, num_computed_tokens: int, *args: Any, **kwargs: Any):
        rid = request.request_id
        target = self.targets.get(rid)
        if target is None:
            # no driven hit: EngineCore's call path (a wrapper kvguard attached, or the
            # class's method bound as attribute access binds it), so the guard's check
            # runs as in EngineCore and the bench times what an operator pays
            lookup = self._instance_attr or self._method.__get__(self._cs, self._cls)
            answer = lookup(request, num_computed_tokens, *args, **kwargs)
        else:
            answer = self._driven(request, num_computed_tokens, target, args, kwargs)
        hit = answer[0]
        if hit and rid in self.evict_after:
            # the trace's driven eviction between the lookup and update_state_after_alloc
            self.evict_after.discard(rid)
            self._result.driven_evictions[rid] = vllm_api.evict_unpinned_cpu_blocks(self._cs)
        if hit is not None:
            self._result.hits[rid] = {
                "local_hit_tokens": int(num_computed_tokens),
                "external_hit_tokens": int(hit),
            }
        return answer

    def _driven(self, request: Any, num_computed_tokens: int, target: int, args: tuple, kwargs: dict) -> Any:
        """vLLM's own lookup, the cap to ``target`` tokens, then kvguard's admission check."""
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
            answer = self._admission.admit(self._cs, request, num_computed_tokens, answer)
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


def _failure_error(request: Any) -> str:
    """kvguard's error text for a request it failed (guards/policy/degrade.py), else the status."""
    try:
        from kvguard.guards.policy import degrade

        error = degrade.failed_requests().get(request.request_id)
    except Exception:
        error = None
    return error or f"{request.status.name} (finish reason {request.get_finished_reason()})"



#: Folders of the lab's own code (the replay and the fuzzer): an exception whose innermost
#: frame is here is the lab's failure, never vLLM's or the guard's (see :func:`in_lab`).
LAB_DIRS = fuzz_classes.LAB_DIRS


def harness_error_of(exc: BaseException) -> dict[str, str] | None:
    """``{"exception", "traceback", "expected"}`` when ``exc`` is the lab's own failure, else None.

    The lab failed when ``exc`` is a :class:`HarnessError` (``expected`` is the vLLM API
    it names) or when the innermost frame of its traceback is the lab's code
    (:func:`~kvguard.lab.fuzz.classes.in_lab`: a call into vLLM that the installed release does not accept, such as
    a struct field it removed, fails in the caller's frame); ``expected`` then names
    that frame. An exception raised inside vLLM's code or kvguard's guard code is not
    one: that is the engine's death (or a kvguard bug).
    """
    tb = traceback.extract_tb(exc.__traceback__)
    inner = tb[-1] if tb else None
    if isinstance(exc, HarnessError):
        expected = exc.expected
    elif inner is not None and fuzz_classes.in_lab(inner.filename):
        expected = f"the vLLM API called at {os.path.basename(inner.filename)}:{inner.lineno} in {inner.name}"
    else:
        return None
    return {
        "exception": _describe(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-6000:],
        "expected": expected,
    }


def _prompt_tokens(treq: TraceRequest, outputs: dict[str, list[int]], vocab_size: int) -> list[int]:
    """A trace request's prompt: its segments' tokens, earlier requests' outputs spliced in."""
    prompt: list[int] = []
    for seg in treq.prompt:
        if seg.output_of is not None:
            prompt.extend(outputs[seg.output_of])
        else:
            prompt.extend(segment_tokens(seg.seed, seg.tokens, vocab_size))
    return prompt


def _engine_part(trace: Trace, k: int) -> Trace:
    """The requests of ``trace`` that engine ``k`` serves (request field ``engine``)."""
    return dataclasses.replace(trace, requests=tuple(r for r in trace.requests if r.engine == k))


class _BuildFailed(Exception):
    """Carries an exception of :func:`build_engine` out of :func:`run_replay` unclassified."""


class _Replay:
    """The state of one replay between steps (what :func:`run_replay` used to keep in locals).

    One engine step (:meth:`step`): arrivals (:meth:`arrive`), client aborts
    (:meth:`abort`), ``schedule()``, the worker, ``update_from_output()`` through the batch
    queue, then the requests that finished (:meth:`collect`) and the stall counter.
    """

    def __init__(self, trace: Trace, engine: Engine, result: ReplayResult,
                 recorder: "_HitRecorder", watch: StallWatch,
                 outputs: dict[str, list[int]] | None = None) -> None:
        self.trace, self.engine, self.result = trace, engine, result
        self.recorder, self.watch = recorder, watch
        self.queue = batch_queue.BatchQueue(engine.batch_queue_depth)
        result.async_scheduling = engine.batch_queue_depth > 1
        result.lag = self.queue
        # the arrival index (a long life has tens of thousands of requests pending: a scan
        # of all of them per step made 100,000-step replays quadratic): indices of the trace
        # requests not arrived yet; no-wait requests by arrival step in a heap; per request
        # with waits, how many are not finished yet, and who waits for each id
        reqs = trace.requests
        self.pending: set[int] = set(range(len(reqs)))
        self._timed: list[tuple[int, int]] = []
        self._unfinished_waits: dict[int, int] = {}
        self._dependents: dict[str, list[int]] = {}
        self._ready: list[int] = []
        # engine restarts (trace ``restart`` lines): the phase of each request; a request of a
        # later phase than the engine's waits in ``_held`` until its restart
        starts = set(trace.restarts)
        self.phase = 0
        phase = 0
        self._phase_of: list[int] = []
        for treq in reqs:
            if treq.id in starts:
                phase += 1
            self._phase_of.append(phase)
        self.phases = phase + 1
        self._phase_pending = [0] * self.phases
        for p in self._phase_of:
            self._phase_pending[p] += 1
        self._held: list[list[tuple[int, int]]] = [[] for _ in range(self.phases)]
        for i, treq in enumerate(reqs):
            waits = treq.waits_for
            if waits:
                self._unfinished_waits[i] = len(waits)
                for w in waits:
                    self._dependents.setdefault(w, []).append(i)
            elif self._phase_of[i]:
                self._held[self._phase_of[i]].append((treq.arrival_step, i))
            else:
                self._timed.append((treq.arrival_step, i))
        heapq.heapify(self._timed)

        self.live: dict[str, Any] = {}
        # shared by the engines of one replay (a prompt may reuse another engine's answer)
        self.outputs: dict[str, list[int]] = outputs if outputs is not None else {}
        self.finished: set[str] = set()
        self.failed_ids: set[str] = set()
        self.aborted_ids: set[str] = set()
        self.aborts = {t.id: t.abort_at_step for t in trace.requests if t.abort_at_step is not None}
        self.idle_steps = 0
        self.drain_steps = 0
        #: this engine's requests the last :meth:`collect` found will never arrive
        self.dropped: list[str] = []

    def arrive(self, step: int) -> bool:
        """Add every trace request due at ``step`` (its ``waits_for`` finished, or its
        ``arrival_step`` reached), in trace order; True when one arrived. A request's waits
        are counted down as they finish (:meth:`collect`), so a step costs what arrives, not
        what is pending."""
        due, self._ready = self._ready, []
        timed = self._timed
        while timed and timed[0][0] <= step:
            due.append(heapq.heappop(timed)[1])
        if not due:
            return False
        due.sort()
        for i in due:
            treq = self.trace.requests[i]
            self.pending.discard(i)
            self._phase_pending[self._phase_of[i]] -= 1
            prompt = _prompt_tokens(treq, self.outputs, self.trace.geometry.vocab_size)
            if treq.external_hit_tokens is not None:
                self.recorder.targets[treq.id] = treq.external_hit_tokens
            if treq.evict_cpu_after_lookup:
                self.recorder.evict_after.add(treq.id)
            request = vllm_api.make_request(self.engine.block_hasher, treq.id, prompt, treq.max_tokens)
            self.engine.scheduler.add_request(request)
            self.live[treq.id] = request
            self.result.submitted += 1
        return True

    def abort(self, step: int) -> bool:
        """Client aborts (trace ``abort_at_step``): after the step's arrivals, before its
        ``schedule()``, only a request that arrived and is not finished. True when one did."""
        aborted = False
        for rid, at in self.aborts.items():
            req = self.live.get(rid)
            if at == step and req is not None and not req.is_finished():
                vllm_api.abort_request(self.engine.scheduler, rid)
                self.live.pop(rid)
                self.aborted_ids.add(rid)
                self.result.aborted += 1
                aborted = True
        return aborted

    def restart(self) -> None:
        """The next ``restart`` of the trace: a new engine over this one's secondary tiers
        (:func:`restart_engine`), its hit recorder, stall watch and batch queue; the next
        phase's requests become due (a timed one at once if its step has passed)."""
        old = self.engine
        self.recorder.restore()
        self.watch.restore()
        if old.tier_tap is not None:
            old.tier_tap.restore()
        if old.worker.oracle is not None:
            self.result.retired_oracles.append(RetiredOracle.of(old.worker.oracle))
        self.engine = new = restart_engine(old)
        self.recorder = _HitRecorder(new.connector_scheduler, self.result)
        self.watch = StallWatch(new.connector_scheduler)
        self.queue = batch_queue.BatchQueue(new.batch_queue_depth)
        self.result.lag = self.queue
        self.result.worker = new.worker
        self.result.restarts += 1
        self.phase += 1
        for at, i in self._held[self.phase]:
            if at < 0:
                self._ready.append(i)
            else:
                heapq.heappush(self._timed, (at, i))
        self._held[self.phase] = []
        self.drain_steps = 0
        self.idle_steps = 0

    def fates(self) -> dict[str, str]:
        """How each trace request ended so far (``ReplayResult.request_fates``)."""
        out: dict[str, str] = {}
        for treq in self.trace.requests:
            rid = treq.id
            if rid in self.finished:
                out[rid] = "finished"
            elif rid in self.failed_ids:
                out[rid] = "failed"
            elif rid in self.aborted_ids:
                out[rid] = "aborted"
            elif rid in self.live:
                out[rid] = "unfinished"
            else:
                out[rid] = "not_arrived"  # why: never_sent_fates, over every engine's fates
        return out

    def drained(self) -> bool:
        """With every request done, EngineCore keeps stepping while the connector has pending
        work (the last stores are built and submitted, in-flight jobs complete; bounded: a hung
        job never does). True when the replay is over (the steps still in flight are applied)."""
        if not self.engine.worker.busy and self.drain_steps > 0 or self.drain_steps >= STALL_STEPS:
            for done_out in self.queue.drain():
                self.engine.scheduler.update_from_output(*done_out)
            return True
        self.drain_steps += 1
        return False

    def step(self, step: int, before_step: Callable[[], None] | None) -> Any:
        """One timed engine step; returns the step's ``SchedulerOutput``."""
        scheduler, result = self.engine.scheduler, self.result
        placeholders = self.queue.before_schedule(scheduler)
        if before_step is not None:
            before_step()
        full_gc = _FULL_GC
        g0 = full_gc[0]
        c0 = time.thread_time()
        t0 = time.perf_counter()
        sched_out = scheduler.schedule()
        t1 = time.perf_counter()
        c1 = time.thread_time()
        g1 = full_gc[0]
        self.queue.after_schedule(sched_out, placeholders)
        model_out = self.engine.worker.execute(sched_out)
        g2 = full_gc[0]
        c2 = time.thread_time()
        t2 = time.perf_counter()
        for done_out in self.queue.push(sched_out, model_out, scheduler.has_requests()):
            scheduler.update_from_output(*done_out)
        if sched_out.total_num_scheduled_tokens and getattr(self.engine.worker, "speculative_tokens", 0):
            # EngineCore.post_step (synchronous scheduling): the drafter's proposals
            drafts = self.engine.worker.take_draft_token_ids()
            if drafts is not None:
                scheduler.update_draft_token_ids(drafts)
        t3 = time.perf_counter()
        c3 = time.thread_time()
        g3 = full_gc[0]
        result.step_times_s.append((t1 - t0) + (t3 - t2))
        result.step_cpu_s.append((c1 - c0) + (c3 - c2))
        result.step_full_gc_s.append((g1 - g0) + (g3 - g2))
        result.step_requests.append(len(getattr(sched_out, "num_scheduled_tokens", None) or ()))
        result.steps = step + 1
        for rid in getattr(sched_out, "preempted_req_ids", None) or ():
            result.preemptions[rid] = result.preemptions.get(rid, 0) + 1
        return sched_out

    def collect(self) -> list[str]:
        """Move the requests that finished in this step out of ``live``; returns their ids.
        A request failed with an error status is listed in ``failed_requests``, and trace
        requests waiting for it will never arrive."""
        result = self.result
        done_now = [rid for rid, req in self.live.items() if req.is_finished()]
        oracle = getattr(self.engine.worker, "oracle", None)
        for rid in done_now:
            req = self.live.pop(rid)
            if oracle is not None:
                # its token codes are a cache for the forwards of a live request (a long life
                # kept every request's: about 1 KiB each, issue 42's hour-long runs)
                oracle.forget(rid)
            if vllm_api.finished_with_error(req):
                self.failed_ids.add(rid)
                result.failed_requests.append({"request_id": rid, "error": _failure_error(req)})
                continue
            self.outputs[rid] = list(req.output_token_ids)
            self.finished.add(rid)
            result.finished += 1
            self.settle(rid)
        self.dropped = []
        for rid in done_now:
            if rid in self.failed_ids:
                self.dropped += self.settle(rid, failed=True)
        return done_now

    def settle(self, rid: str, failed: bool = False) -> list[str]:
        """Request ``rid`` (of this engine or another sharing the tier) ended: count down the
        waits of the requests waiting for it. When it ``failed`` (or will never arrive), a
        request that waits for it never arrives, nor does one that waits for that one
        (transitively: before, a second-level dependant stayed pending and the replay
        reported a stall with every arrived request ended; fuzz seed 0 on 0.34.0). Returns
        the ids of this engine's requests that will never arrive."""
        if not failed:
            for i in self._dependents.get(rid, ()):
                left = self._unfinished_waits[i] - 1
                self._unfinished_waits[i] = left
                if left == 0 and i in self.pending:
                    if self._phase_of[i] > self.phase:
                        self._held[self._phase_of[i]].append((-1, i))
                    else:
                        self._ready.append(i)
            return []
        dropped: list[str] = []
        gone = [rid]
        while gone:
            for i in self._dependents.get(gone.pop(), ()):
                if i in self.pending:
                    self.pending.discard(i)
                    self._phase_pending[self._phase_of[i]] -= 1
                    self.result.not_arrived += 1
                    gone.append(self.trace.requests[i].id)
                    dropped.append(self.trace.requests[i].id)
        return dropped

    def stalled(self, sched_out: Any, progressed: bool) -> bool:
        """Count a step without progress; True (findings recorded) after :data:`STALL_STEPS`."""
        if sched_out.total_num_scheduled_tokens or progressed:
            self.idle_steps = 0
            return False
        self.idle_steps += 1
        # requests of a later phase wait for their restart, not for this engine
        if self.idle_steps >= STALL_STEPS and (self.live or self._phase_pending[self.phase]):
            self.result.stalled = True
            self.result.stalls = self.watch.findings(
                self.result.steps, self.live, self.engine.worker, scheduler=self.engine.scheduler)
            return True
        return False

    def tick(self, step: int, before_step: Callable[[], None] | None,
             others: list["_Replay"] | None = None) -> bool:
        """One replay step of this engine: a due restart, arrivals, aborts, one engine step,
        the requests that ended, the stall count. True when this engine is over: every
        request done and the connector drained, or a stall (``result.stalled``).

        ``others``: engines sharing the tier (:func:`_run_together`): what ends here is told
        to them (a request may wait for another engine's), and an engine with no live
        request is not stalled while it waits for theirs (their own count catches a real
        stall). A :class:`WorkerHang` carries this replay (``hang.replay``)."""
        if (self.phase + 1 < self.phases and not self.live and not self._phase_pending[self.phase]
                and self.drained()):
            self.restart()
        progressed = self.arrive(step)
        progressed = self.abort(step) or progressed
        if not self.live and not self.pending and self.drained():
            return True
        try:
            sched_out = self.step(step, before_step)
        except WorkerHang as hang:
            hang.replay = self
            raise
        done_now = self.collect()
        if others:
            ended = [(rid, rid in self.failed_ids) for rid in done_now] + [(rid, True) for rid in self.dropped]
            while ended:  # tell the others, and what that drops there, until nothing more ends
                rid, failed = ended.pop()
                for o in others:
                    ended += [(d, True) for d in o.settle(rid, failed)]
        self.watch.observe(self.result.steps, self.live)
        if others and not self.live:
            self.idle_steps = 0
        return self.stalled(sched_out, progressed or bool(done_now))

    def run(self, progress: Callable[[int, int, int], None] | None,
            before_step: Callable[[], None] | None) -> None:
        """Step until every request is done and the connector drained, or a stall."""
        for step in range(max(MAX_STEPS, STEPS_PER_REQUEST * len(self.trace.requests))):
            if self.tick(step, before_step):
                return
            if progress is not None and step % 8 == 0:
                progress(self.result.finished, len(self.trace.requests), self.result.steps)


def _run_together(replays: list[_Replay], progress: Callable[[int, int, int], None] | None,
                  before_step: Callable[[], None] | None) -> None:
    """Step engines that share an fs tier (a trace's request ``engine`` field): in each
    replay step every engine not done takes one :meth:`_Replay.tick`, in engine order.
    Stops at the first engine that stalls."""
    total = sum(len(r.trace.requests) for r in replays)
    done = [False] * len(replays)
    for step in range(max(MAX_STEPS, STEPS_PER_REQUEST * total)):
        for k, r in enumerate(replays):
            if not done[k] and r.tick(step, before_step, [o for o in replays if o is not r]):
                if r.result.stalled:
                    return
                done[k] = True
        if all(done):
            return
        if progress is not None and step % 8 == 0:
            progress(replays[0].result.finished, total, replays[0].result.steps)


#: CPU seconds spent in full (generation-2) collections while :func:`_on_full_gc` is a
#: ``gc`` callback, and the start of the one under way (None between collections)
_FULL_GC: list[Any] = [0.0, None]


def _on_full_gc(phase: str, info: dict[str, Any]) -> None:
    """``gc.callbacks`` entry of a replay given ``before_step``: adds each full collection's
    CPU time to ``_FULL_GC[0]`` (``ReplayResult.step_full_gc_s``)."""
    if info.get("generation") != 2:
        return
    if phase == "start":
        _FULL_GC[1] = time.thread_time()
    elif _FULL_GC[1] is not None:
        _FULL_GC[0] += time.thread_time() - _FULL_GC[1]
        _FULL_GC[1] = None


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
    replays in lockstep through it); with it, the time of full collections inside each
    step is recorded too (``ReplayResult.step_full_gc_s``).
    Exceptions escaping the scheduler end the replay with ``engine_survived`` False; the
    lab's own failure ends it with ``harness_error`` set (:func:`harness_error_of`).
    """
    version = vllm_version()
    result = ReplayResult(
        vllm_version=version, trace=trace.name, guard=guard, policy=policy if guard else None
    )
    previous_disable = os.environ.get("KVGUARD_DISABLE")
    if guard:
        from kvguard.guards.reset import reset_all

        reset_all()  # before install: install-stage guard errors belong to this replay
        result.guard_installed = install_guard(policy)
    else:
        # vLLM may load general plugins while the engine is built: keep kvguard off for
        # this replay only (the previous value is restored at the end, so an in-process
        # caller, e.g. the fuzzer or a test module, is not left with the plugin disabled)
        os.environ["KVGUARD_DISABLE"] = "1"
        uninstall_guard()
    t_start = time.perf_counter()
    replay: _Replay | None = None
    replays: list[_Replay] = []
    recorder = watch = None
    given_engine = engine
    try:
        if engine is None:
            try:
                engine = build_engine(trace.geometry, trace.worker)
            except HarnessError as exc:  # the lab cannot bind to this release
                result.harness_error = harness_error_of(exc)
                return result
            except Exception as exc:  # a geometry vLLM (or this release) rejects: the caller's
                raise _BuildFailed() from exc
        result.worker = engine.worker
        result.cpu_chunks = vllm_api.cpu_capacity(engine.connector_scheduler)
        recorder = _HitRecorder(engine.connector_scheduler, result)
        watch = StallWatch(engine.connector_scheduler)
        n = trace.engines
        replay = _Replay(_engine_part(trace, 0) if n > 1 else trace, engine, result, recorder, watch)
        replays.append(replay)
        for k in range(1, n):  # engines sharing engine 0's fs tier directory
            try:
                peer = build_engine(trace.geometry, trace.worker, engine.tier_storage)
            except HarnessError:
                raise
            except Exception as exc:
                raise _BuildFailed() from exc
            replays.append(_Replay(_engine_part(trace, k), peer, result,
                                   _HitRecorder(peer.connector_scheduler, result),
                                   StallWatch(peer.connector_scheduler), outputs=replay.outputs))
        if before_step is not None:
            gc.callbacks.append(_on_full_gc)
        try:
            if n > 1:
                _run_together(replays, progress, before_step)
            else:
                replay.run(progress, before_step)
        finally:
            if _on_full_gc in gc.callbacks:
                gc.callbacks.remove(_on_full_gc)
    except WorkerHang as hang:  # vLLM's worker blocks forever: the engine hangs
        result.stalled = True
        hung = getattr(hang, "replay", None) or replay
        hung_engine, hung_watch = hung.engine, hung.watch  # the engine of the last restart
        result.stalls = hung_watch.findings(result.steps, hung.live, hung_engine.worker, hang.jobs,
                                            scheduler=hung_engine.scheduler)
    except _BuildFailed as failed:
        raise failed.__cause__ from None
    except Exception as exc:
        lab = harness_error_of(exc)
        if lab is not None:  # the lab's failure: not the engine's death
            result.harness_error = lab
        else:  # the engine's death, as EngineCore would die of it
            result.engine_survived = False
            result.error = _describe(exc)
            result.error_site = _error_site(exc)
    finally:
        if replay is not None:  # after a restart, the last engine's
            engine, watch, recorder = replay.engine, replay.watch, replay.recorder
        if watch is not None:
            watch.restore()
        if recorder is not None:
            recorder.restore()
        for peer_replay in replays[1:]:
            peer_replay.watch.restore()
            peer_replay.recorder.restore()
        result.outputs = replay.outputs if replay is not None else {}
        fates: dict[str, str] = {}
        for r in replays or ([replay] if replay is not None else []):
            fates.update(r.fates())
        result.request_fates = never_sent_fates(trace, fates)
        result.wall_s = time.perf_counter() - t_start
        if not guard:
            if previous_disable is None:
                os.environ.pop("KVGUARD_DISABLE", None)
            else:
                os.environ["KVGUARD_DISABLE"] = previous_disable
    peer_tiers: list[dict[str, int]] = []
    for peer_replay in replays[1:]:  # engines beside engine 0: their oracles count, their tiers end
        peer = peer_replay.engine
        if peer.worker.oracle is not None:
            result.retired_oracles.append(RetiredOracle.of(peer.worker.oracle))
        if peer.tier_tap is not None:
            peer_tiers.append(peer.tier_tap.summary())
        result.engines += 1
        peer.close()
    if engine is not None:
        result.pending_store_keys = vllm_api.pending_store_keys(engine.connector_scheduler)
        if engine.tier_tap is not None:
            result.secondary_tiers = engine.tier_tap.summary()
            for other in peer_tiers:  # chunks moved by every engine (the tiers are shared)
                for name, value in other.items():
                    if name != "tiers":
                        result.secondary_tiers[name] += value
            if engine.tier_storage is not None:
                result.secondary_tiers["files"] = engine.tier_storage.files()
        if engine is not given_engine:  # built here (or by a restart): its tiers end here
            engine.close()
    if guard:
        _guard_report(result)
    return result


def _guard_report(result: ReplayResult) -> None:
    """What the guard counted and installed during the replay (``checks``, ``guard_errors``,
    ``sites``, ``guard_installed``)."""
    from kvguard.guards.checks import admission, wait_bound
    from kvguard.guards.checks import finalized_store, pool_frees
    from kvguard.guards.checks.admission import exclusive, written
    from kvguard.guards import names
    from kvguard.guards.policy import runtime
    from kvguard.guards.hooking.instrumentor import OffloadGuardInstrumentor

    result.checks = runtime.snapshot()
    # the admission check keeps its own counts (kvguard.guards.checks.admission.snapshot)
    for check, counts in (
        (names.CHECK_LOAD_COVERAGE, admission.snapshot()),
        (names.CHECK_COPY_COVERAGE, admission.snapshot_copy_coverage()),
        (names.CHECK_WAIT_BOUND, wait_bound.snapshot()),
        (names.CHECK_BLOCK_EXCLUSIVE, exclusive.snapshot()),
        (names.CHECK_LOAD_WRITES, written.snapshot()),
        (names.CHECK_GPU_FREE_ONCE, pool_frees.snapshot()),
        (names.CHECK_STORE_AFTER_FINALIZE, finalized_store.snapshot()),
    ):
        result.checks[check] = {**result.checks.get(check, {}), **counts}
    # the admission checks' skips by reason (what kvguard_check_skipped_total counts)
    for (check, reason), n in admission.snapshot_skipped().items():
        result.checks.setdefault(check, {}).setdefault("skipped", {})[reason] = n
    result.guard_errors = runtime.guard_errors()
    result.sites = OffloadGuardInstrumentor().report()
    # true only when the guard really rewrote the offload path (the scheduler module)
    # (the OffloadingConnector's scheduler module, the SimpleCPUOffloadConnector's manager)
    result.guard_installed = result.guard_installed and result.sites["installed"] > 0 and any(
        m.endswith((".offloading.scheduler", ".simple_kv_offload.manager")) for m in result.sites["modules"]
    )
