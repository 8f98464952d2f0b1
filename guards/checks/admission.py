"""Admission check of an offload cache hit: its load set must be loadable: every chunk a load reads is there.

Where the connector answers ``OffloadingConnectorScheduler.get_num_new_matched_tokens
(request, num_computed_tokens, ...)`` with ``(num_external_tokens, load_async)``, kvguard
computes the chunks the load of that hit will read (:mod:`kvguard.guards.checks.load_coverage`)
and asks the offload manager, without side effects, whether each one is present and
ready. The check runs once per lookup with a hit (``num_external_tokens`` > 0).

Without side effects means: no ``lookup`` (it bumps the store-threshold tracker in
0.25/0.26), no ``touch`` (LRU order), no ``prepare_load`` (ref count / pin). The
manager's cache policy (``manager._policy``, or a policy-like attribute found by
structure: methods ``get``, ``insert``, ``remove``) is read through its ``get`` only
after the source of that ``get`` is verified to be a single ``return`` of dict
``.get(key)`` reads (the LRU and ARC policies of 0.21-0.33); an entry is readable when
its ``is_ready`` is true.

What kvguard cannot model or read is skipped, not an error: a connector
scheduler with a KV cache group of a kind :mod:`~kvguard.guards.checks.load_coverage` does not
model (reason ``group_kind``; modelled: full attention, sliding window, Mamba), with a
manager whose cache policy has not the structure above (``offload_manager``: a custom
``OffloadingManager``, or a test double), or whose config lacks what the plan reads
(``connector_config``); and a partial-tail hit (``partial_tail``, below). Each lookup
with a hit that the check so skips counts ``kvguard_check_skipped_total{check=
"load_coverage", reason}`` (in-process: ``unchecked``), the first one of each reason on a
connector scheduler emits a ``check_skipped`` event with what was not modelled, and
vLLM's answer passes through. ``kvguard_guard_errors_total{stage="admission"}`` counts
only exceptions inside kvguard's code (``KVGuardGuardErrors`` pages on those alone).

What is read: every chunk of a sliding-window group's load set (at most
``cdiv(sliding_window + extra_retained_tokens, tokens_per_chunk) + 1`` chunks), the one
chunk of a Mamba group's load set (the chunk holding the state at the hit's end,
``(num_cached_tokens - 1) // tokens_per_chunk``: :mod:`~kvguard.guards.checks.load_coverage`
derives it from ``MambaManager``), and the first and last chunk of a full-attention
group's load set. The interior of a
full-attention load set is what vLLM's own lookup has just confirmed: in 0.21.0-0.33.0
a full-attention group's hit is a maximal run of HIT chunks starting at
``num_computed_tokens // tokens_per_chunk`` (``_maximal_prefix_lookup``) and nothing
evicts between that lookup and the admission check (evictions happen in
``prepare_store``, at ``build_connector_meta``). Reading every chunk there costs about
as much as vLLM's lookup itself (measured on the bench trace: 18-29 us per lookup,
2.3% of step time), so it is opt-in: ``KVGUARD_ADMISSION_FULL=1``. On a failure every
chunk of every group is read to find the longest loadable hit.

The interior of a sliding-window load set is read too, although it is most of the cost
(16 of the 18 keys read in each sampled lookup of the bench trace; warm, 0.33.0, 1 Dec 2026: 2.9 us
per check, 1.8 us in a variant that read only the window's first and last chunk). It
would be redundant only where the installed lookup is known to have just confirmed it,
and that is not derived from the installed code yet: it depends on the lookup's
convergence loop placing the window's run of HIT chunks at the hit's last chunk, not
only on ``_sliding_window_lookup`` (read in the source: 0.21.0-0.26.0 require
``cdiv(sliding_window, tokens_per_chunk)`` HIT chunks there, and a hit ending inside a
chunk loads one chunk more, to the left, that the lookup never looked up; 0.33.0 widens
the first window by ``load_window_size_in_chunks``), and a driven hit of the replay
harness moves the load set left of the window the lookup confirmed.

Where the check runs: in vLLM's own lookup. The instrumentor rewrites each
``return <answer>`` of ``get_num_new_matched_tokens`` into ``return
admit_return(self, request, num_computed_tokens, <answer>)`` (the ``admission_return``
kind of :mod:`kvguard.guards.hooking.rewrite`, compiled with the function's other sites, vLLM's
file and lines kept), so a lookup pays one call and no wrapper frame, no ``wrapt`` proxy
and no argument binding (on the bench trace of 0.33.0, 3 Dec 2026, ``bench/step_toggle.py``:
the admission part +2.6% of the median step through the pre-bound ``wrapt`` wrapper, +0.3%
in the code, its per-step ratio +2.5% and +2.3%, the latter with the removal counting
switched too; the README's Benchmark section has the figures).
The rewrite applies where the method's parameters are named ``request`` and
``num_computed_tokens`` and never rebound (read off its ``def``; every full release
0.21.0-0.34.0 qualifies); elsewhere the fallback is the ``wrapt`` wrap
(:func:`admission_wrapper`, arguments bound by ``inspect.signature`` positions:
:class:`_Binder`), with each scheduler pre-bound (:func:`attach`). Under vLLM's tiering a
scheduler also gets a recording wrapper (:func:`recording_wrapper`): the promotion checks
of a deferred answer need the manager's per-key answers of that very call. In
:func:`admit` the chunk bounds are computed inline, the plan is read off the scheduler's
``__dict__`` and the counters are incremented without a call.

Kept verdicts: vLLM looks a waiting request up again on every step until its
GPU blocks fit (the head of the queue: 1,424 of the 1,624 checked lookups of the bench
trace on 0.33.0, 3 Dec 2026). A loadable verdict is kept per request with
``(epoch, the request's offload status object, num_computed_tokens, hit)`` and reused
(counted ``reused``, no entry read) while all four are the same; ``epoch`` counts the
cache policy's calls that may take an entry out (:mod:`kvguard.guards.checks.tier_removals`,
derived from the policy's source; read before any entry is read). Sound because a ready
entry stays ready until it is removed, and a removal bumps the epoch: proven on every
full release by ``tests/vllm/test_admission_verdicts.py`` (a full tier's eviction and
``reset_cache`` re-run the check and cut the hit; ``complete_store(success=False)`` cannot
take a ready chunk). Not kept: a failed verdict (each lookup is checked and counted), a
partial-tail hit, a deferred answer. vLLM 0.34.0 may run ``prepare_load`` a step after
admission (deferred loads): a reused verdict is as current as a fresh check at the same
lookup, since nothing was removed in between; what happens after admission is the store
and load checks' business, as without reuse. Where the policy's removal calls cannot be
derived (no source, a property, someone else's instance attribute) nothing is reused.

When every chunk is loadable, vLLM's answer is returned untouched (the same tuple
object). Otherwise, by policy:

============  ==========================================================================
``observe``   counted only (``action="continued"``); vLLM's answer passes through.
``guard``     the hit is reduced to the longest shorter hit whose load set is loadable
              (chunk aligned; or 0), so vLLM recomputes the rest (``action="hit_reduced"``,
              ``kvguard_recomputed_tokens_total{check="load_coverage"}`` += the tokens cut).
``strict``    raises ``AssertionError`` (strict raises on any failure;
              ``action="raised"``): the engine dies at admission, before a load is built.
============  ==========================================================================

An exception inside the check counts ``kvguard_guard_errors_total{stage="admission"}``
and vLLM's answer passes through. Passed through without a count: a deferred answer
(``None``) without vLLM's tiering and a hit of 0 (nothing to check). Passed through and
counted as skipped (``reason="partial_tail"``): a 0.33+ partial-tail hit
(``partial_tail_boundary`` set: its boundary key is not a chunk of
:mod:`~kvguard.guards.checks.load_coverage`).

Promotion fit (check ``promotion_fit``): a deferred hit under vLLM's tiering
------------------------------------------------------------------------------

With vLLM's ``TieringOffloadingManager`` (0.25+, ``vllm/v1/kv_offload/tiering/manager.py``;
found by structure: a manager with ``primary_tier`` and a non-empty ``secondary_tiers``),
a chunk missing from the primary (CPU) tier but held by a secondary tier is *promoted*:
``lookup`` allocates a CPU slot for it (``_initiate_promotion`` ->
``primary_tier.prepare_write``, which may evict any ready chunk whose ref count is 0)
and answers HIT_PENDING (0.33) / RETRY (0.25.1), so the connector's lookup answers
``None`` ("retry later", ``_maximal_prefix_lookup`` / ``_sliding_window_lookup``). The
lookup answers a number only when every chunk it scans is HIT, i.e. ready in the CPU
tier at the same time; nothing pins a HIT chunk between two lookups, and a promotion of
a later chunk of the same hit may evict an earlier one (it is ready, ref count 0).

Invariant: *the load set of the hit a deferred lookup waits for fits in the primary
tier*: ``load_set_size(hit) <= capacity`` (chunks; the capacity is the CPU tier's
``cache_capacity``, :func:`_primary_capacity`). When it does not, the chunks cannot all be
ready at once (pigeonhole), every lookup promotes the missing chunks by evicting ready
ones of the same hit and defers again, and the request waits forever (measured: the fuzz
finding ``tests/vllm/traces/tiering-promotion-loop.jsonl`` on 0.25.1 and 0.33.0, stall
``lookup_deferred``; a 48-chunk load set over a 30-chunk CPU tier). When it fits, the
deferral can end (promotions complete; other requests' pins are released), so the check
stays silent: it is not a timeout and does not count steps. Fitting is necessary, not
sufficient: on 0.33.0 a hit that fits is deferred forever when the LRU ranks the request's
promoted chunks below other ready chunks (``tests/vllm/traces/tiering-request-rank-loop.jsonl``,
23 chunks over 29; docs/fuzz.md, "A second tiering stall"): the next check is for that.

Promotion progress (check ``promotion_progress``): a deferral that evicts what it waits for
-------------------------------------------------------------------------------------------

Invariant: *a chunk of the awaited load set that was ready (HIT) at the request's
previous deferred lookup is still ready at this one*. A deferral is worth waiting for
while what became ready stays ready: then every step adds ready chunks and the wait ends
once the promotions complete. When a ready chunk of the same hit is gone (evicted from the
CPU tier, seen again as RETRY / HIT_PENDING: its promotion restarted), the wait lost
ground and nothing bounds it: on 0.33.0 the request-ranked LRU
(``cpu/policies/lru.py``: a chunk ranks by ``(request rank, -position)``, the rank fixed
at the request's first insert) makes each step's promotions evict the request's own ready
chunks, forever. Upstream the same rule is the fix proposed for vllm#49902 (PR #50014:
pin a promoted chunk until the waiting request reads it). The check compares the ready
keys of the awaited load set (the hit of the promotion-fit check, below, from ``seen``)
with those kept from the request's previous deferred lookup (:func:`_ready_memory`, on
the connector scheduler; dropped when a lookup of the request is answered, so a
deferral after a preemption starts afresh). It is evaluated from a request's second
deferred lookup on, after ``promotion_fit`` (which acts one deferral earlier on the
hits that can never fit); actions and the reduced answer are those of ``promotion_fit``
(table below, ``check="promotion_progress"``). What it costs when the wait would have
ended anyway (a chunk evicted by other requests' stores, re-promoted in time): the
recompute of the part not ready, never wrong KV. Measured: ``tiering-request-rank-loop.jsonl``
on 0.33.0 stalls without it and finishes every request with it, same tokens as without
the tiers; on 0.25.1 (plain LRU) the same trace finishes either way and the check also
answers some deferrals early (``tests/vllm/test_promotion_fit.py``). Kill switch:
``KVGUARD_DISABLED_SITES=admission:promotion_progress``.

The hit a deferral waits for is measured from what vLLM's lookup saw: during the
connector's lookup the manager's ``lookup`` is recorded per offload key
(:func:`record_lookup`: an instance attribute for the length of that one call, nothing
else changed); a chunk counts as found when the manager answered HIT or HIT_PENDING, or
RETRY and it now has a CPU entry (a started promotion). The waited-for hit is the
longest hit whose whole load set was found (:func:`~kvguard.guards.checks.load_coverage.longest_loadable_hit`
over the found chunks, up to ``min(num_tokens - 1, len(offload_keys) * tokens_per_chunk)``);
its load set is a lower bound of what the lookup waits for. A deferral for the
request's own transfers in flight (``transfer_jobs``, no lookup ran) is not checked.

============  ==========================================================================
``observe``   counted only (``action="continued"``); vLLM's ``None`` passes through
              (the request stays deferred, as without kvguard; counted once per deferred
              lookup, so a stall counts once per step).
``guard``     the lookup answers the longest hit whose load set is ready in the CPU tier
              now (chunk aligned; a chunk another load is reading does not count, as
              vLLM's own lookup delays such a hit), or 0 so vLLM recomputes
              (``action="hit_reduced"``, ``kvguard_recomputed_tokens_total{check=
              "promotion_fit"}`` += deferred hit - admitted hit); ``load_async`` is
              ``admitted > 0`` (no sync-load budget was reserved for a deferred answer).
``strict``    raises ``AssertionError`` at admission (``action="raised"``).
============  ==========================================================================

Why the reduced answer is safe: it is built of chunks that are ready in the CPU tier
(the load-set rule of :mod:`~kvguard.guards.checks.load_coverage`), and vLLM's scheduler calls
``update_state_after_alloc`` (``prepare_load`` pins them) right after allocating that
request's blocks, with no other lookup in between; for a deferred answer vLLM's
``get_num_new_matched_tokens`` already set ``num_locally_computed_tokens``, cleared
``partial_tail_boundary`` and reserved no sync load. Promotions the deferred lookup
started complete as any other and leave ordinary CPU chunks. Proven in the replay by
the KV-content oracle (``wrong_kv_blocks`` 0) and the request's generated tokens
(``tests/vllm/test_promotion_fit.py``). Kill switch:
``KVGUARD_DISABLED_SITES=admission:promotion_fit``.
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import textwrap
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from kvguard.guards.checks import copy_ledger, wait_bound

from kvguard.guards import names

from kvguard.guards.policy import runtime
from kvguard.guards.hooking.rewrite import GLOBAL_ADMIT_RETURN, GLOBAL_CHECK_STORE, keyword_argument_names
from kvguard.guards.checks.tier_removals import Epoch, unwatch_all as unwatch_removals, watch as _watch_removals
from kvguard.guards.checks.load_coverage import (  # Unsupported: defined there, raised here too
    GroupGeometry,
    Unsupported,
    load_set,
    longest_hit,
    longest_loadable_hit,
)

__all__ = [
    "admission_wrapper",
    "admit",
    "admit_return",
    "admits_inline",
    "recording_wrapper",
    "configure",
    "unconfigure",
    "snapshot",
    "snapshot_promotion_fit",
    "snapshot_promotion_progress",
    "snapshot_copy_coverage",
    "snapshot_skipped",
    "record_lookup",
    "reset",
    "metrics_sink",
    "set_metrics_sink",
    "Unsupported",
]

_lock = threading.Lock()
_STAT_KEYS = ("evaluated", "reused", "hit_reduced", "continued", "raised", "recomputed_tokens", "unchecked")
#: every key of _STAT_KEYS is always present, so the hot path increments with ``+= 1``
_stats: dict[str, int] = dict.fromkeys(_STAT_KEYS, 0)
_metrics: Any = None
_events: Any = None
#: False: the promotion-fit check is off (``KVGUARD_DISABLED_SITES=admission:promotion_fit``)
_promotion_fit = True
#: False: the promotion-progress check is off (``KVGUARD_DISABLED_SITES=admission:promotion_progress``)
_promotion_progress = True
#: Attribute cached on each connector scheduler instance (its plan or why it has none).
_PLAN_ATTR = "_kvguard_admission_plan"
#: verdicts kept per connector scheduler before the oldest are dropped (all at once: cheap, rare)
_VERDICTS_MAX = 4096
#: KVGUARD_ADMISSION_FULL=1: read every full-attention chunk too (cost grows with the hit)
_FULL = os.environ.get("KVGUARD_ADMISSION_FULL", "") == "1"


def configure(metrics: Any = None, events: Any = None, promotion_fit: bool = True,
              promotion_progress: bool = True) -> None:
    """Set the metrics sink (a :class:`kvguard.guards.telemetry.metrics.GuardMetrics`) and events
    module; ``promotion_fit`` / ``promotion_progress`` False turns that check of deferred
    tiered hits off (their kill switches)."""
    global _metrics, _events, _promotion_fit, _promotion_progress
    _metrics, _events = metrics, events
    _promotion_fit, _promotion_progress = bool(promotion_fit), bool(promotion_progress)


def metrics_sink() -> Any:
    """The metrics sink :func:`configure` set (None: counters in :func:`snapshot` only)."""
    return _metrics


def set_metrics_sink(metrics: Any) -> None:
    """Replace only the metrics sink (the fuzz runner's tee of kvguard's decisions); the
    events module and the kill switches stay as configured."""
    global _metrics
    _metrics = metrics


def unconfigure() -> None:
    """Back to no sinks (counters in :func:`snapshot` only), both deferred-hit checks on."""
    configure(None, None)


def reset() -> None:
    """Zero the in-process counters of :func:`snapshot`, :func:`snapshot_promotion_fit` and
    :func:`snapshot_promotion_progress`
    (the hot path increments the ``snapshot`` keys in place, so they stay present)."""
    with _lock:
        _stats.clear()
        _stats.update(dict.fromkeys(_STAT_KEYS, 0))
        _skipped.clear()


def snapshot() -> dict[str, int]:
    """In-process counts since :func:`reset`: ``evaluated`` (lookups with a hit checked),
    ``hit_reduced``, ``continued`` (observe), ``raised`` (strict), ``recomputed_tokens``
    (tokens cut from hits), ``unchecked`` (hits not checkable on this release), and
    ``violations`` (the sum of the three actions)."""
    out = {k: _stats.get(k, 0) for k in _STAT_KEYS}
    out["violations"] = out["hit_reduced"] + out["continued"] + out["raised"]
    return out


def snapshot_promotion_fit() -> dict[str, int]:
    """The promotion-fit check's in-process counts since :func:`reset`, same keys as
    :func:`snapshot`: ``evaluated`` (deferred lookups under vLLM's tiering checked),
    ``hit_reduced``, ``continued``, ``raised``, ``recomputed_tokens`` (tokens of the
    deferred hit not loaded), ``unchecked`` (deferred lookups the check could not read,
    plus one per connector scheduler whose CPU tier capacity it cannot read: ``_tiering_of``)
    and ``violations``."""
    return _prefixed_snapshot(_PF)


def snapshot_promotion_progress() -> dict[str, int]:
    """The promotion-progress check's in-process counts since :func:`reset`, same keys as
    :func:`snapshot_promotion_fit`: ``evaluated`` (deferred lookups compared with the
    request's previous deferred lookup), ``hit_reduced``, ``continued``, ``raised``,
    ``recomputed_tokens``, ``unchecked`` (always 0: an unreadable deferral counts under
    ``promotion_fit``) and ``violations``."""
    return _prefixed_snapshot(_PP)


def snapshot_copy_coverage() -> dict[str, int]:
    """The copy coverage check's in-process counts since :func:`reset`, same keys as
    :func:`snapshot`: ``evaluated`` (hits whose load set was loadable and read against the
    copy ledger while it held partly written chunks), ``hit_reduced``, ``continued``,
    ``raised``, ``recomputed_tokens``, ``unchecked`` (hits not checked: the scheduler's
    stores are not recorded, or the ledger dropped entries at its bound) and ``violations``."""
    return _prefixed_snapshot(_CC)


def snapshot_skipped() -> dict[tuple[str, str], int]:
    """In-process skipped evaluations since :func:`reset`, by ``(check, reason)`` (what
    ``kvguard_check_skipped_total`` counts; pairs with none are absent). Each is also in
    that check's ``unchecked`` of :func:`snapshot` / :func:`snapshot_promotion_fit`."""
    with _lock:
        return dict(_skipped)


def _prefixed_snapshot(prefix: str) -> dict[str, int]:
    out = {k: _stats.get(prefix + k, 0) for k in _STAT_KEYS}
    out["violations"] = out["hit_reduced"] + out["continued"] + out["raised"]
    return out


#: key prefixes of the promotion-fit and promotion-progress counts in ``_stats``
_PF = "promotion_fit:"
_PP = "promotion_progress:"
#: key prefix of the copy-coverage counts in ``_stats``
_CC = "copy_coverage:"


def _bump(key: str, amount: int = 1) -> None:
    _stats[key] = _stats.get(key, 0) + amount


# -- plan: per connector scheduler, discovered once ----------------------------------
@dataclass(frozen=True)
class _Plan:
    groups: tuple[GroupGeometry, ...]
    #: per group ``(tokens_per_block, blocks_per_chunk, tokens_per_chunk, kept tokens)``,
    #: :attr:`~kvguard.guards.checks.load_coverage.GroupGeometry.kept_tokens`: ``sliding_window_tokens
    #: - 1 + extra_retained_tokens`` for a window, 1 for a Mamba group, None for full attention
    fast: tuple[tuple[int, int, int, int | None], ...]
    #: the cache policy and, when its ``get`` reads exactly one dict, that dict's attribute
    #: name (read per call: ``clear()`` may rebind it); else ``get`` is the policy's own
    policy: Any
    dict_attr: str | None
    #: counts calls that may remove an entry the policy's ``get`` reads (:func:`_watch_removals`);
    #: None: those calls could not be found, so no verdict is reused (:func:`admit` checks every lookup)
    epoch: Epoch | None = None
    #: request id -> ``(epoch.n, request's offload status, num_computed_tokens, hit)`` of its
    #: last loadable verdict (:func:`admit` reuses it while all four are the same)
    verdicts: dict = field(default_factory=dict)
    #: whether kvguard records this scheduler's chunk stores (its class has a store builder
    #: rewritten with the store check, :func:`_stores_recorded`): copy coverage needs it
    stores_recorded: bool = False

    def getter(self) -> Callable[[Any], Any]:
        """``key -> entry | None``, side-effect free (a builtin ``dict.get`` when possible)."""
        if self.dict_attr is not None:
            return getattr(self.policy, self.dict_attr).get
        return self.policy.get


def _pure_dict_get(func: Any) -> list[str] | None:
    """The dict attributes ``func`` reads when its body is one ``return`` built only of
    ``self.<attr>.get(<arg>)`` calls joined by ``or`` (a read of the policy's dicts, no
    reordering); None when it is anything else."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError):
        return None
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, ast.FunctionDef):
        return None
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None:
        return None

    def pure(node: ast.AST) -> bool:
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            return all(pure(v) for v in node.values)
        return (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and isinstance(node.func.value, ast.Attribute)
            and isinstance(node.func.value.value, ast.Name)
            and node.func.value.value.id == "self"
            and len(node.args) == 1
            and isinstance(node.args[0], ast.Name)
            and not node.keywords
        )

    if not pure(body[0].value):
        return None
    return [n.func.value.attr for n in ast.walk(body[0].value) if isinstance(n, ast.Call)]


def _policy_reader(manager: Any) -> tuple[Any, str | None, list[str]]:
    """``(policy, dict attribute or None, every dict attribute its get reads)``: how to read
    the manager's cache policy without side effects (see :class:`_Plan`); Unsupported.

    The owner is the manager, a wrapped one (``backing`` / ``_backing``), or the CPU tier
    of vLLM's ``TieringOffloadingManager`` (``primary_tier``, 0.25+: a lookup answers a
    hit only for chunks ready there; a chunk in a secondary tier is promoted first)."""
    owners = (manager, getattr(manager, "backing", None), getattr(manager, "_backing", None),
              getattr(manager, "primary_tier", None))
    for owner in owners:
        if owner is None:
            continue
        candidates = [getattr(owner, "_policy", None)]
        candidates += [v for v in vars(owner).values() if v is not candidates[0]] if hasattr(owner, "__dict__") else []
        for policy in candidates:
            cls = type(policy)
            if policy is None or not all(callable(getattr(cls, m, None)) for m in ("get", "insert", "remove")):
                continue
            attrs = _pure_dict_get(cls.get)
            if attrs is not None:
                single = len(attrs) == 1 and isinstance(getattr(policy, attrs[0], None), dict)
                return policy, attrs[0] if single else None, attrs
            raise Unsupported(names.SKIP_OFFLOAD_MANAGER, f"{cls.__qualname__}.get is not a plain dict read")
    raise Unsupported(names.SKIP_OFFLOAD_MANAGER, f"no cache policy with get/insert/remove on {type(manager).__qualname__}")


def _spec_kind(spec: Any) -> str:
    """``"full"``, ``"sliding_window"``, ``"mamba"``, or the spec's class name (not modelled).

    By the spec's class lineage, as vLLM's own ``isinstance`` tests decide a group's
    manager and offload window (``offloading/config.py``
    ``get_sliding_window_size_in_chunks``): a ``SlidingWindowSpec`` (and its subclasses),
    a ``MambaSpec``, a ``FullAttentionSpec`` that is none of the kinds whose manager
    allocates differently; never by release."""
    mro = {c.__name__ for c in type(spec).__mro__}
    if "SlidingWindowSpec" in mro:
        return "sliding_window"
    if "MambaSpec" in mro:
        return "mamba"
    special = {"ChunkedLocalAttentionSpec", "CrossAttentionSpec", "SinkFullAttentionSpec"}
    if "FullAttentionSpec" in mro and not mro & special:
        return "full"
    return type(spec).__name__


def _plan(cs: Any) -> _Plan:
    """Read each KV cache group's geometry off the connector scheduler; Unsupported."""
    groups = group_geometries(cs)
    fast = tuple((g.tokens_per_block, g.blocks_per_chunk, g.tokens_per_chunk, g.kept_tokens) for g in groups)
    policy, dict_attr, attrs = _policy_reader(cs.manager)
    return _Plan(groups, fast, policy, dict_attr, _watch_removals(policy, attrs),
                 stores_recorded=_stores_recorded(type(cs)))


def _stores_recorded(cls: type) -> bool:
    """Whether a method of ``cls`` (or a base) calls kvguard's store check: the instrumentor
    rewrote its store builder (the ``store_drop`` site of :mod:`kvguard.guards.hooking.sites`), so every
    chunk store's spec reaches the copy ledger (:func:`kvguard.guards.policy.runtime.check_store`).
    Read off the compiled code's names, so a release whose builder was not rewritten is
    seen as such, whatever the reason."""
    for klass in cls.__mro__:
        for value in vars(klass).values():
            code = getattr(value, "__code__", None)
            if code is not None and GLOBAL_CHECK_STORE in code.co_names:
                return True
    return False


def group_geometries(cs: Any) -> tuple[GroupGeometry, ...]:
    """Each offloaded KV cache group's geometry (:class:`~kvguard.guards.checks.load_coverage.GroupGeometry`),
    in the connector's group order (``config.kv_group_configs``), read off the connector
    scheduler ``cs`` (also used by the store coverage check, :func:`kvguard.guards.policy.runtime.check_store`).

    Raises:
        Unsupported: the config lacks what is read (reason ``connector_config``), or a
            group kind is not modelled (``group_kind``).
    """
    config = getattr(cs, "config", None)
    group_configs = getattr(config, "kv_group_configs", None)
    if group_configs is None:
        raise Unsupported(names.SKIP_CONNECTOR_CONFIG, "connector scheduler has no config.kv_group_configs")
    blocks_per_chunk = getattr(config, "blocks_per_chunk", None) or getattr(config, "block_size_factor", None)
    if not isinstance(blocks_per_chunk, int):
        raise Unsupported(names.SKIP_CONNECTOR_CONFIG, "no blocks_per_chunk / block_size_factor on the scheduler config")
    recorded = getattr(cs, "_kvguard_kv_specs", None) or {}
    groups = []
    for index, gc in enumerate(group_configs):
        spec = getattr(gc, "kv_cache_spec", None) or recorded.get(getattr(gc, "group_idx", None))
        if spec is None:
            raise Unsupported(names.SKIP_CONNECTOR_CONFIG, "no KV cache spec for a group (neither on the config nor recorded)")
        kind = _spec_kind(spec)
        tokens_per_block = getattr(gc, "tokens_per_block", None) or getattr(gc, "gpu_block_size", None)
        if not isinstance(tokens_per_block, int):
            raise Unsupported(names.SKIP_CONNECTOR_CONFIG, "no tokens_per_block / gpu_block_size on a group config")
        if kind == "full":
            groups.append(GroupGeometry(tokens_per_block, blocks_per_chunk))
        elif kind == "sliding_window":
            groups.append(
                GroupGeometry(
                    tokens_per_block,
                    blocks_per_chunk,
                    int(spec.sliding_window),
                    int(getattr(spec, "extra_retained_tokens", 0) or 0),
                )
            )
        elif kind == "mamba":
            groups.append(GroupGeometry(tokens_per_block, blocks_per_chunk, recurrent_state=True))
        else:
            raise Unsupported(
                names.SKIP_GROUP_KIND,
                f"KV cache group {index} (group_idx {getattr(gc, 'group_idx', None)}) kind {kind!r} "
                "is not modelled by load_coverage",
            )
    return tuple(groups)


def _get_plan(cs: Any) -> _Plan | Unsupported:
    """The plan cached on ``cs`` (built on first use), or why this scheduler has none (an
    :class:`Unsupported`: each lookup the check then skips counts
    ``kvguard_check_skipped_total{reason}``, :func:`_skip`; not a guard error)."""
    plan = cs.__dict__.get(_PLAN_ATTR)
    if plan is None:
        try:
            plan = _plan(cs)
        except Unsupported as why:
            plan = why
        cs.__dict__[_PLAN_ATTR] = plan
    return plan


#: Attribute cached on each connector scheduler instance: the ``(check, reason)`` pairs
#: whose ``check_skipped`` event it emitted (once each).
_SKIPS_ATTR = "_kvguard_skips_announced"
#: in-process skips since :func:`reset`, by ``(check, reason)`` (:func:`snapshot_skipped`)
_skipped: dict[tuple[str, str], int] = {}


def _skip(cs: Any, check: str, prefix: str, reason: str, detail: str) -> None:
    """Count one evaluation of ``check`` skipped on ``cs`` for ``reason`` (in-process as
    ``prefix + "unchecked"`` and by reason, and ``kvguard_check_skipped_total``) and emit the
    ``check_skipped`` event the first time this scheduler skips ``check`` for ``reason``.
    Off the hot path: only a lookup the check does not evaluate comes here."""
    with _lock:
        _bump(prefix + "unchecked")
        _skipped[(check, reason)] = _skipped.get((check, reason), 0) + 1
    if _metrics is not None:
        try:
            _metrics.check_skipped(check, reason)
        except Exception as error:
            runtime.guard_error(names.STAGE_METRICS, error)
    announced = cs.__dict__.get(_SKIPS_ATTR)
    if announced is None:
        announced = cs.__dict__[_SKIPS_ATTR] = set()
    if (check, reason) in announced:
        return
    announced.add((check, reason))
    if _events is not None:
        _events.check_skipped(**{names.KEY_CHECK: check, names.KEY_REASON: reason, names.KEY_DETAIL: detail})


# -- readiness of one offload entry ------------------------------------------------------
#: entry class -> whether its ``is_ready`` is exactly ``return self.ref_cnt >= 0``
_REF_CNT_READY: dict[type, bool] = {}


def _is_ref_cnt_ready(cls: type) -> bool:
    """True when ``cls.is_ready`` is a property whose body is one ``return self.ref_cnt >= 0``
    (vLLM's ``BlockStatus`` / ``ChunkStatus`` of 0.21-0.33, a ctypes field): the check then
    reads the field itself, which costs about 0.9 us less per lookup than the property
    (measured on the bench trace). Anything else keeps ``is_ready``."""
    prop = inspect.getattr_static(cls, "is_ready", None)
    if not isinstance(prop, property) or prop.fget is None:
        return False
    try:
        fn = ast.parse(textwrap.dedent(inspect.getsource(prop.fget))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return False
    body = [s for s in getattr(fn, "body", []) if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return):
        return False
    test = body[0].value
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Attribute)
        and test.left.attr == "ref_cnt"
        and isinstance(test.left.value, ast.Name)
        and test.left.value.id == "self"
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.GtE)
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == 0
    )


def _span_loadable(get: Callable[[Any], Any], span: Any) -> bool:
    """Whether every key of ``span`` has an entry (``get`` -> not None) that is ready.

    Entries of one policy are of one class; its readiness test is read once per class
    (:func:`_is_ref_cnt_ready`). Stops at the first miss. A plain loop: reading a ctypes
    field costs about 40 ns whichever way it is read, and ``min(map(attrgetter(...)))``
    measured slower than this loop (16 keys, 0.33.0's ``ChunkStatus``, warm, 2 Dec 2026:
    0.85 us loop, 1.09 us ``map``).
    """
    if not span:
        return True
    first = get(span[0])
    if first is None:
        return False
    cls = type(first)
    fast = _REF_CNT_READY.get(cls)
    if fast is None:
        fast = _REF_CNT_READY[cls] = _is_ref_cnt_ready(cls)
    if fast:
        for key in span:
            entry = get(key)
            if entry is None or entry.ref_cnt < 0:
                return False
        return True
    for key in span:
        entry = get(key)
        if entry is None or not entry.is_ready:
            return False
    return True


# -- the check -------------------------------------------------------------------------
def admit(cs: Any, request: Any, num_computed_tokens: int, answer: Any, seen: dict | None = None) -> Any:
    """Check vLLM's lookup ``answer`` for ``request`` (:func:`_admit`), then give the result
    to the wait bound (:mod:`kvguard.guards.checks.wait_bound`): a deferred answer (``None``) is an
    observation of the request's wait (which, stalled, may end it: a reduced answer under
    ``guard``), a number ends a deferral, an async load is watched until it is promoted.
    Raises ``AssertionError`` only under ``strict``.
    """
    out = _admit(cs, request, num_computed_tokens, answer, seen)
    if not wait_bound._enabled:
        return out
    try:
        hit = out[0]
        if hit is None:
            return _wait_deferred(cs, request, num_computed_tokens, out)
        if TABLE_ATTR in cs.__dict__:
            wait_bound.answered(cs, request.request_id)
        if hit and out[1]:
            wait_bound.admitted_async(cs, request)
    except AssertionError:
        raise  # strict
    except Exception as error:  # guard code never takes the engine down
        runtime.guard_error(names.STAGE_ADMISSION, error)
    return out


TABLE_ATTR = wait_bound.TABLE_ATTR


def _admit(cs: Any, request: Any, num_computed_tokens: int, answer: Any, seen: dict | None = None) -> Any:
    """Check vLLM's lookup ``answer`` for ``request``; return it, a reduced one, or raise (strict).

    ``cs``: the ``OffloadingConnectorScheduler``; ``num_computed_tokens``: the local GPU
    prefix hit (tokens) passed to ``get_num_new_matched_tokens``; ``answer``: its
    ``(num_external_tokens | None, load_async)``; ``seen``: what the manager's ``lookup``
    answered per offload key during that call (:func:`record_lookup`; None when it was
    not recorded). Returns ``answer`` itself when the load set is loadable or nothing is
    checked; under ``guard`` a new ``(reduced, load_async and reduced > 0)`` tuple. A
    deferred answer (``None``) with ``seen`` goes to the promotion-fit check (module
    docstring), which under ``guard`` may answer ``(reduced, reduced > 0)`` instead.
    Raises ``AssertionError`` only under ``strict``.

    The per-group chunk bounds are :func:`kvguard.guards.checks.load_coverage.load_chunk_bounds`
    written out inline (a Python call per group cost more than the arithmetic; the two
    are compared over every small geometry in ``tests/guards/test_load_coverage.py``).
    """
    try:
        hit = answer[0]
        if seen is not None:  # vLLM's tiering manager (record_lookup recorded the lookup)
            if hit is None:
                return _check_deferred(cs, request, num_computed_tokens, answer, seen)
            _forget_ready(cs, request)  # the deferral, if any, ended with this answer
        if not hit:
            return answer
        plan = cs.__dict__.get(_PLAN_ATTR) or _get_plan(cs)
        req_status = cs._req_status[request.request_id]
        if plan.__class__ is not _Plan or getattr(req_status, "partial_tail_boundary", None) is not None:
            if plan.__class__ is not _Plan:
                _skip(cs, names.CHECK_LOAD_COVERAGE, "", plan.reason, str(plan))
            else:
                _skip(cs, names.CHECK_LOAD_COVERAGE, "", names.SKIP_PARTIAL_TAIL,
                      "a partial-tail hit loads a boundary key, not a chunk of load_coverage")
            return answer
        epoch = plan.epoch
        now = epoch.n if epoch is not None else None  # read before any entry (tier_removals)
        if now is not None:
            kept = plan.verdicts.get(request.request_id)
            if (kept is not None and kept[0] == now and kept[1] is req_status
                    and kept[2] == num_computed_tokens and kept[3] == hit):
                _stats["reused"] += 1  # same question, nothing removed since: same verdict
                return answer
        _stats["evaluated"] += 1
        num_cached = num_computed_tokens + hit
        dict_attr = plan.dict_attr
        get = getattr(plan.policy, dict_attr).get if dict_attr is not None else plan.policy.get
        for (tpb, bpc, tpc, kept), state in zip(plan.fast, req_status.group_states):
            # load_chunk_bounds(tpb, bpc, kept, num_computed_tokens, num_cached), inline
            start = num_computed_tokens // tpb  # first GPU block that is not a local hit
            if kept is not None:
                skipped = (num_cached - kept) // tpb  # null blocks of a window / Mamba group
                if skipped > start:
                    start = skipped
            if start * tpb >= num_cached:  # start >= cdiv(num_cached, tpb): no pending block
                continue
            stop = -(-num_cached // tpc)
            keys = state.offload_keys
            if stop > len(keys):
                break
            first = start // bpc
            if kept is None and stop - first > 2 and not _FULL:
                # full attention: vLLM's lookup is a maximal run of HIT chunks from
                # num_computed_tokens // tokens_per_chunk (0.21-0.33), so the interior of
                # this range was just confirmed; the ends are where a hit could reach past
                # it (module docstring). KVGUARD_ADMISSION_FULL=1 reads every chunk.
                span: Any = (keys[first], keys[stop - 1])
            else:
                span = keys[first:stop]
            if not _span_loadable(get, span):
                break
        else:
            ledger = cs.__dict__.get(_LEDGER_ATTR)
            if ledger is not None and (ledger.size or ledger.dropped or ledger.unreadable) or not plan.stores_recorded:
                if not _copies_checked(cs, plan, ledger, req_status.group_states, num_computed_tokens, num_cached):
                    return _act(plan, req_status.group_states, get, request, num_computed_tokens, hit, answer, ledger)
            if now is not None:  # keep the verdict for vLLM's next lookup of this request
                verdicts = plan.verdicts
                if len(verdicts) >= _VERDICTS_MAX:
                    verdicts.clear()
                verdicts[request.request_id] = (now, req_status, num_computed_tokens, hit)
            return answer  # every group loadable: vLLM's answer, the same object
        return _act(plan, req_status.group_states, get, request, num_computed_tokens, hit, answer,
                    cs.__dict__.get(_LEDGER_ATTR))
    except _StrictFailure as failure:
        raise AssertionError(str(failure)) from None
    except Exception as error:  # guard code never takes the engine down
        runtime.guard_error(names.STAGE_ADMISSION, error)
        return answer


_LEDGER_ATTR = copy_ledger.LEDGER_ATTR


def _copies_checked(cs: Any, plan: _Plan, ledger: Any, group_states: Any, num_computed_tokens: int,
                    num_cached: int) -> bool:
    """Copy coverage of a loadable hit ending at ``num_cached`` tokens: True when every GPU
    block its load writes comes from a slot a store copied (or when the check cannot be
    made here: skipped and counted), False when :func:`_act` must act.

    Skipped (``kvguard_check_skipped_total{check="copy_coverage"}``): a scheduler whose
    chunk stores kvguard does not record (``store_path``), and hits checked after the
    ledger dropped entries at its bound (``ledger_full``, once per dropped entry; the hit is
    still checked against what the ledger holds)."""
    if not plan.stores_recorded or (ledger is not None and ledger.unreadable):
        why = ledger.unreadable if ledger is not None and ledger.unreadable else \
            "the connector scheduler's store builder was not rewritten: its chunk stores are not recorded"
        _skip(cs, names.CHECK_COPY_COVERAGE, _CC, names.SKIP_STORE_PATH, why)
        return True
    if ledger.dropped:
        dropped, ledger.dropped = ledger.dropped, 0
        for _ in range(dropped):
            _skip(cs, names.CHECK_COPY_COVERAGE, _CC, names.SKIP_LEDGER_FULL,
                  f"the copy ledger keeps at most {ledger.limit} partly written chunks; the oldest were dropped")
    if not ledger.size:
        return True
    _stats[_CC + "evaluated"] = _stats.get(_CC + "evaluated", 0) + 1
    return copy_ledger.ok_for(ledger, plan.fast, group_states, num_computed_tokens)(num_cached)


def _act(plan: _Plan, group_states: Any, get: Any, request: Any, num_computed_tokens: int, hit: int, answer: Any,
         ledger: Any = None) -> Any:
    """The slow path after a miss (a chunk not loadable, or a slot not copied: the copy
    ledger ``ledger``): read every chunk, then act by policy (see module doc)."""

    def loadable(group: int, chunk: int) -> bool:
        group_keys = group_states[group].offload_keys
        if chunk >= len(group_keys):
            return False
        entry = get(group_keys[chunk])
        return entry is not None and bool(entry.is_ready)

    num_cached = num_computed_tokens + hit
    missing = [
        (g, c) for g, chunks in enumerate(load_set(plan.groups, num_computed_tokens, num_cached))
        for c in chunks if not loadable(g, c)
    ]
    copies = _copies_ok(plan, ledger, group_states, num_computed_tokens)
    uncopied = [] if missing else _uncopied(plan, ledger, group_states, num_computed_tokens, num_cached)
    if not missing and not uncopied:
        return answer
    check, prefix = (names.CHECK_LOAD_COVERAGE, "") if missing else (names.CHECK_COPY_COVERAGE, _CC)
    first = (f"group {missing[0][0]} chunk {missing[0][1]}" if missing
             else f"group {uncopied[0][0]} block {uncopied[0][1]} (slot not copied by its store)")
    count = len(missing) if missing else len(uncopied)
    policy = runtime.policy()
    if policy == names.POLICY_OBSERVE:
        return _decide(check, prefix, request, num_computed_tokens, hit, hit, count, first, names.ACTION_CONTINUED,
                       policy, answer)
    if policy == names.POLICY_STRICT:
        _decide(check, prefix, request, num_computed_tokens, hit, hit, count, first, names.ACTION_RAISED, policy, answer)
        what = "chunk(s) not present/ready in the offload tier" if missing else \
            "GPU block(s) from chunk slots no store copied (wrong KV)"
        raise _StrictFailure(
            f"kvguard {check}: hit of {hit} tokens after {num_computed_tokens} local tokens "
            f"loads {count} {what} (first: {first})"
        )

    def ok(end: int) -> bool:
        return all(
            loadable(g, c) for g, chunks in enumerate(load_set(plan.groups, num_computed_tokens, end)) for c in chunks
        ) and copies(end)

    reduced = longest_hit(plan.groups, num_computed_tokens, num_cached, ok)
    new_answer = (reduced, bool(answer[1]) and reduced > 0)
    return _decide(check, prefix, request, num_computed_tokens, hit, reduced, count, first, names.ACTION_HIT_REDUCED,
                   policy, new_answer)


def _copies_ok(plan: _Plan, ledger: Any, group_states: Any, num_computed_tokens: int) -> Callable[[int], bool]:
    """``end -> bool``: copy coverage of a hit ending at ``end`` (always True without a
    ledger or without recorded stores: nothing known to be partly written)."""
    if ledger is None or not ledger.size or not plan.stores_recorded or ledger.unreadable:
        return lambda end: True
    return copy_ledger.ok_for(ledger, plan.fast, group_states, num_computed_tokens)


def _uncopied(plan: _Plan, ledger: Any, group_states: Any, num_computed_tokens: int, num_cached: int) -> list:
    """``[(group, first GPU block loaded from a slot no store copied)]`` of a hit ending at ``num_cached``."""
    if ledger is None or not ledger.size or not plan.stores_recorded or ledger.unreadable:
        return []
    out = []
    for g, (tpb, bpc, _tpc, kept) in enumerate(plan.fast):
        group_ledger = ledger.groups[g]
        if group_ledger:
            block = copy_ledger.first_uncopied_block(tpb, bpc, kept, num_computed_tokens, num_cached,
                                                     group_states[g].offload_keys, group_ledger)
            if block >= 0:
                out.append((g, block))
    return out


class _StrictFailure(Exception):
    pass


def _decide(check: str, prefix: str, request: Any, local: int, hit: int, new_hit: int, count: int, first: str,
            action: str, policy: str, answer: Any) -> Any:
    return _count(
        check, prefix, request, action, policy, hit - new_hit, answer,
        {
            names.KEY_LOCAL_HIT_TOKENS: local,
            names.KEY_EXTERNAL_HIT_TOKENS: hit,
            names.KEY_ADMITTED_HIT_TOKENS: new_hit,
            names.KEY_MISSING_CHUNKS: count,
            names.KEY_FIRST_MISSING: first,
        },
    )


def _count(check: str, prefix: str, request: Any, action: str, policy: str, recomputed: int, answer: Any,
           fields: dict[str, Any]) -> Any:
    """Count one violation of ``check`` (in-process under ``prefix``, the counter, the
    recomputed tokens) and emit its ``hit_reduced`` event; returns ``answer``."""
    with _lock:
        _bump(prefix + action)
        _bump(prefix + "recomputed_tokens", recomputed)
    if _metrics is not None:
        try:
            _metrics.violation(check, action)
            if recomputed:
                _metrics.recomputed_tokens(check, recomputed)
        except Exception as error:
            runtime.guard_error(names.STAGE_METRICS, error)
    if _events is not None:
        _events.hit_reduced(
            **{
                names.KEY_CHECK: check,
                names.KEY_ACTION: action,
                names.KEY_POLICY: policy,
                names.KEY_REQUEST_ID: getattr(request, "request_id", None),
                **fields,
                names.KEY_RECOMPUTED_TOKENS: recomputed,
            }
        )
    return answer


# -- promotion fit of a deferred hit under vLLM's tiering manager ------------------------
#: Attribute cached on each connector scheduler instance: its :class:`_Tiering` or None.
_TIERING_ATTR = "_kvguard_tiering"
_UNSET = object()
#: ``LookupResult`` names that say the manager found the chunk (ready, being written, or
#: a promotion just started in 0.33) -- compared by name, so no vLLM import is needed.
_FOUND = frozenset({"HIT", "HIT_PENDING"})
#: Attribute cached on each connector scheduler instance: :func:`_ready_memory`.
_READY_ATTR = "_kvguard_ready_keys"


@dataclass(frozen=True)
class _Tiering:
    """vLLM's ``TieringOffloadingManager`` of one connector scheduler, found by structure.

    ``manager``: the tiering manager (``primary_tier`` + a non-empty ``secondary_tiers``
    list + ``lookup``); ``primary``: its CPU tier; ``capacity``: the CPU tier's size in
    chunks (offloaded blocks), read by :func:`_primary_capacity`.
    """

    manager: Any
    primary: Any
    capacity: int


def _primary_capacity(primary: Any) -> int:
    """The primary (CPU) tier's capacity in chunks; Unsupported when it cannot be read.

    The CPU manager builds its cache policy as ``policy_cls(cache_capacity=<n>)`` with
    ``n`` its ``num_chunks`` (0.33) / ``num_blocks`` (0.25) argument, so the capacity is
    the policy's ``cache_capacity`` where the policy keeps it (0.33's ``CachePolicy``
    base; 0.25's ARC), else the attribute the constructor that passes ``cache_capacity=``
    assigns that same argument to (``self._num_blocks = num_blocks`` in 0.25.1), found
    in that constructor's source (walking the MRO), never by a name list.
    """
    capacity = getattr(getattr(primary, "_policy", None), "cache_capacity", None)
    if isinstance(capacity, int) and not isinstance(capacity, bool) and capacity > 0:
        return capacity
    for cls in type(primary).__mro__:
        init = vars(cls).get("__init__")
        if init is None:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        except (OSError, TypeError, SyntaxError):
            continue
        params = keyword_argument_names(tree, "cache_capacity")
        if not params:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign):
                targets, value = [node.target], node.value
            else:
                continue
            if not (isinstance(value, ast.Name) and value.id in params):
                continue
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                    capacity = getattr(primary, target.attr, None)
                    if isinstance(capacity, int) and not isinstance(capacity, bool) and capacity > 0:
                        return capacity
        break  # the constructor that sizes the policy was found: nothing further up does
    raise Unsupported(names.SKIP_OFFLOAD_MANAGER, f"cannot read the capacity of the primary tier {type(primary).__qualname__}")


def _tiering_of(cs: Any) -> _Tiering | None:
    """The connector scheduler's :class:`_Tiering`, None without vLLM's tiering (cached on
    ``cs``). A tiering manager whose CPU tier capacity cannot be read gets no promotion-fit
    or promotion-progress check: counted once, as ``kvguard_check_skipped_total{check=
    "promotion_fit", reason="offload_manager"}`` (its deferred lookups are then not
    recorded, so they cannot be counted one by one); any other exception here counts
    ``kvguard_guard_errors_total{stage="admission"}``."""
    tiering = None
    try:
        manager = getattr(cs, "manager", None)
        primary = getattr(manager, "primary_tier", None)
        tiers = getattr(manager, "secondary_tiers", None)
        if primary is not None and isinstance(tiers, (list, tuple)) and tiers and callable(getattr(manager, "lookup", None)):
            tiering = _Tiering(manager, primary, _primary_capacity(primary))
    except Unsupported as why:
        # the deferred lookups of this scheduler are then not recorded, so they cannot be
        # counted one by one: counted once here
        _skip(cs, names.CHECK_PROMOTION_FIT, _PF, why.reason, str(why))
        tiering = None
    except Exception as error:
        runtime.guard_error(names.STAGE_ADMISSION, error)
        tiering = None
    try:
        cs.__dict__[_TIERING_ATTR] = tiering
    except Exception:
        pass
    return tiering


class _LookupRecorder:
    """Stands in for the tiering manager's ``lookup`` during one connector lookup:
    records ``key -> LookupResult`` of the scheduler's calls (``lookup(key, req_context)``;
    a call with more arguments, e.g. a secondary tier's ``exclude_tier_idx``, is not the
    scheduler's and is passed through unrecorded)."""

    __slots__ = ("inner", "seen")

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner
        self.seen: dict[Any, Any] = {}

    def __call__(self, key: Any, req_context: Any, *args: Any, **kwargs: Any) -> Any:
        result = self.inner(key, req_context, *args, **kwargs)
        if not args and not kwargs:
            self.seen[key] = result
        return result


def _recorded(tiering: _Tiering, call: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, dict | None]:
    manager = tiering.manager
    try:
        inner = manager.__dict__.get("lookup", _UNSET)
        recorder = _LookupRecorder(manager.lookup)
        manager.lookup = recorder  # an instance attribute: vLLM calls self.manager.lookup
    except Exception as error:
        runtime.guard_error(names.STAGE_ADMISSION, error)
        return call(*args, **kwargs), None
    try:
        answer = call(*args, **kwargs)
    finally:
        if inner is _UNSET:
            manager.__dict__.pop("lookup", None)
        else:
            manager.lookup = inner
    return answer, recorder.seen


def record_lookup(cs: Any, call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, dict | None]:
    """``(call(*args, **kwargs), seen)``: run vLLM's lookup ``call`` for one request and record
    what the tiering manager's ``lookup`` answered per offload key (``seen``, for :func:`admit`).
    The arguments are passed through so the wrapper's hot path builds no closure.

    ``seen`` is None when ``cs`` has no tiering manager (nothing is wrapped then) or the
    promotion-fit check is off. The manager's own method runs unchanged; the stand-in is
    removed when ``call`` returns or raises.
    """
    tiering = cs.__dict__.get(_TIERING_ATTR, _UNSET)
    if tiering is _UNSET:
        tiering = _tiering_of(cs)
    if tiering is None or not (_promotion_fit or _promotion_progress):
        return call(*args, **kwargs), None
    return _recorded(tiering, call, args, kwargs)


def _check_deferred(cs: Any, request: Any, num_computed_tokens: int, answer: Any, seen: dict) -> Any:
    """The promotion-fit and promotion-progress checks of a deferred answer (``None``)
    under vLLM's tiering (module docstring).

    The chunks the deferred lookup found (``seen`` HIT / HIT_PENDING, or RETRY with an
    entry now in the CPU tier: a promotion started in 0.25) give the hit it waits for: the
    longest hit, up to ``min(num_tokens - 1, len(offload_keys) * tokens_per_chunk)``,
    whose whole load set was found. Promotion fit: when that load set holds more chunks
    than the CPU tier, vLLM can never answer it. Promotion progress: when a chunk of that
    load set that was ready (HIT) at the request's previous deferred lookup is not ready
    now, the wait lost ground. Either acts by policy.
    """
    req_status = cs._req_status[request.request_id]
    if getattr(req_status, "transfer_jobs", None) or not seen:
        return answer  # deferred for the request's own transfers in flight, or no lookup ran
    tiering = cs.__dict__.get(_TIERING_ATTR)
    plan = _get_plan(cs)
    if plan.__class__ is not _Plan or tiering is None:  # _get_plan gives Unsupported, never None
        if plan.__class__ is not _Plan:
            _skip(cs, names.CHECK_PROMOTION_FIT, _PF, plan.reason, str(plan))
        else:
            with _lock:
                _bump(_PF + "unchecked")
        return answer
    if _promotion_fit:
        with _lock:
            _bump(_PF + "evaluated")
    group_states = req_status.group_states
    get = plan.getter()

    def found(group: int, chunk: int) -> bool:
        group_keys = group_states[group].offload_keys
        if chunk >= len(group_keys):
            return False
        result = seen.get(group_keys[chunk])
        name = getattr(result, "name", None)
        return name in _FOUND or (name == "RETRY" and get(group_keys[chunk]) is not None)

    end = _awaited_end(plan, group_states, request)
    if end <= num_computed_tokens:
        return answer
    target = longest_loadable_hit(plan.groups, num_computed_tokens, end, found)
    if target <= 0:
        return answer
    awaited = load_set(plan.groups, num_computed_tokens, num_computed_tokens + target)
    needed = sum(len(chunks) for chunks in awaited)
    policy = runtime.policy()
    fields = {
        names.KEY_LOCAL_HIT_TOKENS: num_computed_tokens,
        names.KEY_DEFERRED_HIT_TOKENS: target,
        names.KEY_NEEDED_CHUNKS: needed,
        names.KEY_PRIMARY_CAPACITY_CHUNKS: tiering.capacity,
    }
    if _promotion_fit and needed > tiering.capacity:
        return _act_deferred(
            cs, names.CHECK_PROMOTION_FIT, _PF, plan, req_status, get, request, num_computed_tokens, target,
            policy, answer, fields,
            f"kvguard promotion_fit: the deferred hit of {target} tokens after {num_computed_tokens} local "
            f"tokens loads {needed} chunks, more than the {tiering.capacity}-chunk primary tier holds: "
            f"vLLM's tiered lookup can never answer it",
        )
    if not _promotion_progress:
        return answer
    # it fits: the deferral can end, as long as what became ready stays ready
    ready_now = []
    lost = []
    memory = _ready_memory(cs)
    previous = memory.get(request.request_id)
    for group, chunks in enumerate(awaited):
        group_keys = group_states[group].offload_keys
        for chunk in chunks:
            key = group_keys[chunk]
            if getattr(seen.get(key), "name", None) == "HIT":
                ready_now.append(key)
            elif previous is not None and key in previous:
                lost.append((group, chunk))
    memory[request.request_id] = frozenset(ready_now)
    if previous is None:
        return answer  # the request's first deferred lookup: nothing to compare yet
    with _lock:
        _bump(_PP + "evaluated")
    if not lost:
        return answer
    fields[names.KEY_LOST_READY_CHUNKS] = len(lost)
    fields[names.KEY_FIRST_LOST] = f"group {lost[0][0]} chunk {lost[0][1]}"
    return _act_deferred(
        cs, names.CHECK_PROMOTION_PROGRESS, _PP, plan, req_status, get, request, num_computed_tokens, target,
        policy, answer, fields,
        f"kvguard promotion_progress: {len(lost)} chunk(s) of the deferred hit of {target} tokens after "
        f"{num_computed_tokens} local tokens were ready at the previous deferred lookup and are not now "
        f"(first: group {lost[0][0]} chunk {lost[0][1]}): the wait evicts what it waits for",
    )


def _act_deferred(cs: Any, check: str, prefix: str, plan: _Plan, req_status: Any, get: Any, request: Any,
                  num_computed_tokens: int, target: int, policy: str, answer: Any, fields: dict[str, Any],
                  message: str) -> Any:
    """Act by ``policy`` on a deferred hit of ``target`` tokens that ``check`` failed:
    observe counts and passes vLLM's ``None`` through; strict raises ``message``; guard
    answers the longest hit whose load set is ready in the CPU tier now (a chunk another
    load is reading does not count: vLLM's own lookup delays such a hit), or 0."""
    if policy == names.POLICY_OBSERVE:
        return _count(check, prefix, request, names.ACTION_CONTINUED, policy, 0, answer,
                      {**fields, names.KEY_ADMITTED_HIT_TOKENS: None})
    if policy == names.POLICY_STRICT:
        _count(check, prefix, request, names.ACTION_RAISED, policy, 0, answer,
               {**fields, names.KEY_ADMITTED_HIT_TOKENS: None})
        raise _StrictFailure(message)
    reduced = _ready_hit(cs, plan, req_status.group_states, get, num_computed_tokens, target)
    _ready_memory(cs).pop(request.request_id, None)  # the deferral ends with this answer
    return _count(check, prefix, request, names.ACTION_HIT_REDUCED, policy, target - reduced, (reduced, reduced > 0),
                  {**fields, names.KEY_ADMITTED_HIT_TOKENS: reduced})


def _ready_pred(cs: Any, group_states: Any, get: Any) -> Callable[[int, int], bool]:
    """``ready(group, chunk)``: the chunk is in the CPU tier and ready, and no other load
    reads it (vLLM's own lookup delays a hit on a chunk another load is reading)."""
    being_loaded = getattr(cs, "_chunks_being_loaded", None)
    if being_loaded is None:
        being_loaded = getattr(cs, "_blocks_being_loaded", None)
    being_loaded = being_loaded or ()

    def ready(group: int, chunk: int) -> bool:
        group_keys = group_states[group].offload_keys
        if chunk >= len(group_keys):
            return False
        key = group_keys[chunk]
        if key in being_loaded:
            return False
        entry = get(key)
        return entry is not None and bool(entry.is_ready)

    return ready


def _ready_hit(cs: Any, plan: _Plan, group_states: Any, get: Any, num_computed_tokens: int, target: int) -> int:
    """The longest hit (tokens beyond ``num_computed_tokens``, at most ``target``) whose
    load set is ready in the CPU tier now (:func:`_ready_pred`) and whose copies are
    covered (:mod:`kvguard.guards.checks.copy_ledger`); 0 when none is."""
    ready = _ready_pred(cs, group_states, get)
    copies = _copies_ok(plan, cs.__dict__.get(_LEDGER_ATTR), group_states, num_computed_tokens)

    def ok(end: int) -> bool:
        return all(
            ready(g, c) for g, chunks in enumerate(load_set(plan.groups, num_computed_tokens, end)) for c in chunks
        ) and copies(end)

    return longest_hit(plan.groups, num_computed_tokens, num_computed_tokens + target, ok)


def _awaited_end(plan: _Plan, group_states: Any, request: Any) -> int:
    """The end (tokens) of the longest hit the request's offload keys allow:
    ``min(len(offload_keys) * tokens_per_chunk over the groups, num_tokens - 1)``."""
    end = min(len(state.offload_keys) * g.tokens_per_chunk for state, g in zip(group_states, plan.groups))
    return min(end, int(request.num_tokens) - 1)


def _wait_deferred(cs: Any, request: Any, num_computed_tokens: int, answer: Any) -> Any:
    """The wait bound of a deferred answer (:mod:`kvguard.guards.checks.wait_bound`): observe the
    deferral with its progress measure (ready chunks of the awaited load set; 0 when the
    request's own transfers are in flight or the plan cannot be read) and, when the wait
    is stalled, act (guard: the longest ready hit, or the request failed alone)."""
    req_status = cs._req_status[request.request_id]
    plan = cs.__dict__.get(_PLAN_ATTR) or _get_plan(cs)
    readable = plan.__class__ is _Plan and not getattr(req_status, "transfer_jobs", None)
    ready_chunks = 0
    end = 0
    if readable:
        group_states = req_status.group_states
        get = plan.getter()
        end = _awaited_end(plan, group_states, request)
        if end > num_computed_tokens:
            ready = _ready_pred(cs, group_states, get)
            ready_chunks = sum(
                1 for g, chunks in enumerate(load_set(plan.groups, num_computed_tokens, end)) for c in chunks
                if ready(g, c)
            )
    wait = wait_bound.observe_deferred(cs, request, ready_chunks)
    if wait is None:
        return answer
    hit = 0
    if readable and end > num_computed_tokens:
        hit = _ready_hit(cs, plan, req_status.group_states, plan.getter(), num_computed_tokens,
                         end - num_computed_tokens)
    _ready_memory(cs).pop(request.request_id, None)
    return wait_bound.act_deferred(cs, wait, hit, answer)


def _ready_memory(cs: Any) -> dict[str, frozenset]:
    """``request_id -> offload keys of its awaited load set ready at its last deferred
    lookup``, kept on the connector scheduler (vLLM's per-request state has ``__slots__``
    on 0.33). Entries of requests vLLM no longer tracks (finished or aborted while
    deferred) are dropped whenever it holds more than twice as many as ``_req_status``."""
    memory = cs.__dict__.get(_READY_ATTR)
    if memory is None:
        memory = cs.__dict__[_READY_ATTR] = {}
    elif len(memory) > 2 * len(cs._req_status) + 16:
        for request_id in [r for r in memory if r not in cs._req_status]:
            del memory[request_id]
    return memory


def _forget_ready(cs: Any, request: Any) -> None:
    """Drop what the promotion-progress check remembered of ``request``'s last deferred
    lookup: vLLM answered it, so a later deferral (after a preemption) starts afresh."""
    memory = cs.__dict__.get(_READY_ATTR)
    if memory:
        memory.pop(request.request_id, None)


# -- the wrap --------------------------------------------------------------------------
class _Binder:
    """Where ``request`` and ``num_computed_tokens`` sit in a ``get_num_new_matched_tokens``
    call, read once from ``inspect.signature`` of vLLM's method.

    ``Signature.bind`` costs several microseconds a call (7.5 us measured on a loaded
    2-core machine: more than the check itself), so the positions are taken from the
    signature once and each call reads ``kwargs[name]`` or ``args[position]``; any other
    call shape (defaults, ``*args``) goes through ``Signature.bind``.
    """

    __slots__ = ("sig", "slots", "positions", "min_args")

    def __init__(self, wrapped: Any) -> None:
        self.sig = inspect.signature(wrapped)
        params = list(self.sig.parameters.values())
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        slots = []
        for name in ("request", "num_computed_tokens"):
            index = next((i for i, p in enumerate(params) if p.name == name), None)
            ok = index is not None and all(p.kind in positional for p in params[: index + 1])
            slots.append((name, index if ok else None, params[index].kind if index is not None else None))
        self.slots = tuple(slots)
        # vLLM's own call shape, ``(request, num_computed_tokens)`` passed positionally:
        # two tuple reads, no loop (both parameters positional, found above)
        indices = tuple(index for _, index, _ in slots)
        self.positions = indices if None not in indices else None
        self.min_args = max(indices) + 1 if self.positions is not None else 0

    def bind(self, args: tuple, kwargs: dict) -> tuple[Any, int]:
        """``(request, num_computed_tokens)``; ``TypeError`` when the call does not bind."""
        positions = self.positions
        if positions is not None and not kwargs and len(args) >= self.min_args:
            return args[positions[0]], args[positions[1]]
        out = []
        for name, index, kind in self.slots:
            if kind in _BY_NAME and name in kwargs:
                out.append(kwargs[name])
            elif index is not None and index < len(args):
                out.append(args[index])
            else:
                bound = self.sig.bind(*args, **kwargs)
                return bound.arguments["request"], bound.arguments["num_computed_tokens"]
        return out[0], out[1]


_BY_NAME = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_BINDERS: dict[Any, _Binder] = {}


def _bind(wrapped: Any, args: tuple, kwargs: dict) -> tuple[Any, int]:
    """``(request, num_computed_tokens)`` of a ``get_num_new_matched_tokens`` call, by signature
    (the :class:`_Binder` of the function, built once)."""
    func = getattr(wrapped, "__func__", wrapped)
    binder = _BINDERS.get(func)
    if binder is None:
        binder = _BINDERS[func] = _Binder(wrapped)
    return binder.bind(args, kwargs)


#: > 0 while :func:`unwrapped_lookup`'s call of vLLM's lookup runs (the replay harness'
#: driven hits: it caps the answer, then admits it itself). A module global, not a
#: thread-local, read once per answer: vLLM's scheduler makes its lookups from one thread.
_suspended = 0


def admit_return(cs: Any, request: Any, num_computed_tokens: int, answer: Any) -> Any:
    """The admission check where vLLM's rewritten lookup calls it: on each ``return`` of
    ``get_num_new_matched_tokens`` (the ``admission_return`` rewrite of
    :mod:`kvguard.guards.hooking.rewrite`: no wrapper frame, no argument binding).

    ``cs``, ``request``, ``num_computed_tokens``: the method's own ``self`` and arguments
    (tokens); ``answer``: the ``(num_external_tokens | None, load_async)`` it is returning.
    Returns what the method returns instead: :func:`admit`'s result for a hit (or a
    deferred answer under vLLM's tiering), ``answer`` itself otherwise. Under vLLM's
    tiering the manager's per-key answers of this very call come from the
    :class:`_LookupRecorder` the scheduler's recording wrapper (:func:`attach`) put on
    the manager for its length (``seen``; None without one: a deferred answer is then
    passed through unchecked). Raises ``AssertionError`` only under ``strict`` (from
    :func:`admit`); an error of kvguard's counts ``stage="admission"`` and returns ``answer``.
    """
    if _suspended:
        return answer
    try:
        tiering = cs.__dict__.get(_TIERING_ATTR, _UNSET)
        if tiering is _UNSET:
            tiering = _tiering_of(cs)
        seen = None
        if tiering is not None:
            recorder = tiering.manager.__dict__.get("lookup")
            if recorder.__class__ is _LookupRecorder:
                seen = recorder.seen
        if seen is None and not answer[0]:  # None (deferred) or 0: no hit to check
            if answer[0] is None and wait_bound._enabled:
                return admit(cs, request, num_computed_tokens, answer, None)  # the wait bound
            if TABLE_ATTR in cs.__dict__:
                wait_bound.answered(cs, request.request_id)
            return answer
    except Exception as error:
        runtime.guard_error(names.STAGE_ADMISSION, error)
        return answer
    return admit(cs, request, num_computed_tokens, answer, seen)


def admits_inline(method: Any) -> bool:
    """True when ``method`` (a connector scheduler class's ``get_num_new_matched_tokens``,
    as ``inspect.getattr_static`` finds it) is vLLM's function with kvguard's
    ``admission_return`` rewrite in its code (it reads the injected check by name)."""
    code = getattr(method, "__code__", None)
    return code is not None and GLOBAL_ADMIT_RETURN in code.co_names


def recording_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``wrapt`` wrapper of a tiering connector scheduler's own (rewritten) lookup: runs it
    inside :func:`record_lookup`, so :func:`admit_return` reads what the tiering manager's
    ``lookup`` answered per key during the call (the promotion checks of a deferred answer)."""
    if instance is None:
        return wrapped(*args, **kwargs)
    return record_lookup(instance, wrapped, *args, **kwargs)[0]


def _call_unchecked(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    global _suspended
    _suspended += 1
    try:
        return call(*args, **kwargs)
    finally:
        _suspended -= 1


def admission_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``wrapt`` wrapper of ``OffloadingConnectorScheduler.get_num_new_matched_tokens``.

    Calls vLLM's method, then :func:`admit` on its answer (arguments bound by
    ``inspect.signature``, see :class:`_Binder`). An answer without a hit (``None`` or
    0 tokens) returns at once, unbound, except a deferred answer (``None``) under vLLM's
    tiering manager: there vLLM's method runs inside :func:`record_lookup` and the
    answer goes to the promotion-fit check. A binding error counts ``stage="admission"``
    and returns vLLM's answer. The fallback where the ``admission_return`` rewrite does not
    apply (:func:`kvguard.guards.hooking.rewrite.admission_return_names`): a lookup that rebinds
    its arguments, or whose parameters are named otherwise.
    """
    if instance is None:
        return wrapped(*args, **kwargs)
    if instance.__dict__.get(_TIERING_ATTR, _UNSET) is None:  # no tiering (known): nothing to record
        answer = wrapped(*args, **kwargs)
        seen = None
    else:
        answer, seen = record_lookup(instance, wrapped, *args, **kwargs)
    try:
        if seen is None and not answer[0]:  # None (deferred) or 0: no hit to check
            if (answer[0] is None and wait_bound._enabled) or TABLE_ATTR in instance.__dict__:
                request, num_computed_tokens = _bind(wrapped, args, kwargs)
                if answer[0] is None:
                    return admit(instance, request, num_computed_tokens, answer, None)  # the wait bound
                wait_bound.answered(instance, request.request_id)
            return answer
        request, num_computed_tokens = _bind(wrapped, args, kwargs)
    except Exception as error:
        runtime.guard_error(names.STAGE_ADMISSION, error)
        return answer
    return admit(instance, request, num_computed_tokens, answer, seen)


#: connector schedulers given an instance-level wrapper by :func:`attach` (for :func:`detach_all`)
_attached: "weakref.WeakSet[Any]" = weakref.WeakSet()


def attach(cs: Any) -> bool:
    """Give the connector scheduler ``cs`` its own pre-bound wrapper of the lookup, where
    one is needed; True when attached.

    - vLLM's lookup carries the check in its own code (:func:`admits_inline`): only a
      scheduler with vLLM's tiering manager gets one, ``wrapt.FunctionWrapper(<the method
      bound to cs>, recording_wrapper)`` (the promotion checks need the manager's per-key
      answers of the call); every other scheduler calls vLLM's method directly.
    - the fallback, the class-level wrap (:func:`admission_wrapper`): every scheduler gets
      ``wrapt.FunctionWrapper(<vLLM's method bound to cs>, admission_wrapper)``: vLLM calls
      ``self.connector_scheduler.get_num_new_matched_tokens(...)`` on every waiting request
      every step, and through the class-level wrap each call first binds the descriptor (a
      ``BoundFunctionWrapper`` and a bound method, allocated per call); an instance attribute
      skips that (measured warm, 2 Dec 2026: about 1.1 us per call through the class wrap
      against 0.43 us pre-bound, a trivial wrapped method).

    Behaviour is the same either way. Only where the class's attribute is kvguard's (a
    subclass that overrides the method keeps the class path, through ``super()``) and
    ``cs`` has no instance attribute of that name already (someone else's wrapper is never
    replaced). :func:`detach_all` removes it (``uninstall``).
    """
    if "get_num_new_matched_tokens" in cs.__dict__:
        return False
    attr = inspect.getattr_static(type(cs), "get_num_new_matched_tokens", None)
    if admits_inline(attr):
        if _tiering_of(cs) is None:
            return False  # nothing to record: the rewritten method is all it takes
        target, wrapper = attr, recording_wrapper
    elif getattr(attr, "_self_wrapper", None) is admission_wrapper:
        target, wrapper = attr.__wrapped__, admission_wrapper
    else:
        return False
    import wrapt

    cs.__dict__["get_num_new_matched_tokens"] = wrapt.FunctionWrapper(target.__get__(cs, type(cs)), wrapper)
    _attached.add(cs)
    return True


def attach_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``wrapt`` wrapper of the connector scheduler's ``__init__``: vLLM's constructor,
    then :func:`attach` (an error counts ``stage="admission"``; vLLM's rewritten lookup, or
    the class-level wrap, still checks every hit)."""
    result = wrapped(*args, **kwargs)
    try:
        attach(instance)
        wait_bound.attach(instance)
    except Exception as error:
        runtime.guard_error(names.STAGE_ADMISSION, error)
    return result


def detach_all() -> None:
    """Remove every instance-level wrapper :func:`attach` set (vLLM's lookup is the class's
    method again on those schedulers) and the cache policies' removal counters
    (:func:`kvguard.guards.checks.tier_removals.unwatch_all`: no kept verdict is reused after)."""
    for cs in list(_attached):
        attr = cs.__dict__.get("get_num_new_matched_tokens")
        if getattr(attr, "_self_wrapper", None) in (admission_wrapper, recording_wrapper):
            del cs.__dict__["get_num_new_matched_tokens"]
    _attached.clear()
    wait_bound.detach_all()
    unwatch_removals()


def unwrapped_lookup(cs: Any) -> tuple[Callable[..., Any], bool]:
    """``(vLLM's lookup of cs without kvguard's check, whether kvguard's admission applies to it)``.

    For a caller that must act between vLLM's lookup and kvguard's check (the replay
    harness' driven hits): call the first, change the answer, then :func:`admit` it when
    the second is True. Where the check is in vLLM's rewritten code (:func:`admits_inline`)
    the first runs that code with :func:`admit_return` passing answers through.
    """
    attr = inspect.getattr_static(type(cs), "get_num_new_matched_tokens", None)
    if admits_inline(attr):
        return functools.partial(_call_unchecked, attr.__get__(cs, type(cs))), True
    if getattr(attr, "_self_wrapper", None) is admission_wrapper:
        return attr.__wrapped__.__get__(cs, type(cs)), True
    return cs.get_num_new_matched_tokens, False
