"""The rewritten asserts' checks: what a vLLM assert kvguard rewrote decides when it runs.

Rewritten vLLM code (see :mod:`kvguard.guards.hooking.rewrite`) reaches this module through names that
cannot clash with vLLM's (``@kvguard_check``, ``@kvguard_locals``, ...), injected into
the target module's globals by :mod:`kvguard.guards.hooking.instrumentor`:

- a passing plain assert never reaches kvguard: it costs exactly vLLM's own assert (the
  test and one conditional jump);
- a failing assert calls :func:`check` ``(site_id, False, locals(), msg)``, which counts,
  logs and returns the exception the rewritten code must raise, or ``None`` to continue;
- the window site (the SWA / Mamba pending-block assert of ``update_state_after_alloc``)
  calls :func:`check` on every evaluation, because the exact bound needs the geometry
  (:func:`kvguard.guards.checks.invariants.swa_pending_bound`, vllm#48959);
- the store builder calls :func:`check_store` with each ``GPULoadStoreSpec`` it built (the
  store coverage check, :mod:`kvguard.guards.checks.store_coverage`, and the copy ledger).

What each outcome does under the policy in force is :mod:`kvguard.guards.policy.runtime`'s
table; the counts go to :mod:`kvguard.guards.telemetry.counts`. Never raises: an exception
inside kvguard code is counted in ``kvguard_guard_errors_total{stage}`` and vLLM's own
behaviour follows (the assert's AssertionError when it failed, otherwise continue).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import CodeType
from typing import Any

from kvguard.guards import names
from kvguard.guards.checks import copy_ledger, invariants, offload_plan, tier_publish
from kvguard.guards.checks.admission import counters as admission_counters
from kvguard.guards.checks.load_coverage import Unsupported
from kvguard.guards.checks.store_coverage import (
    GroupStore,
    group_store_problems,
    store_in_place,
    stored_end_block,
    uncomputed_problem,
)
from kvguard.guards import site_registry
from kvguard.guards.names import GLOBAL_FAIL_REQUEST
from kvguard.guards.names import KIND_WINDOW
from kvguard.guards.site_registry import Site
from kvguard.guards.policy import degrade, runtime
from kvguard.guards.telemetry import counts

__all__ = [
    "check",
    "check_store",
    "drop_store",
    "fail_request",
    "register",
    "STORE_BUILDER_CODES",
]


_NO_MSG: Any = object()



@dataclass(frozen=True, slots=True)
class _SiteRT:
    site_id: str
    check: str
    kind: str
    #: the window site: vLLM's own bound expression, compiled, and the module's globals
    bound_code: CodeType | None = None
    module_globals: dict[str, Any] | None = None
    #: the window site: the local name of the pending GPU blocks (the assert's left side)
    pending_name: str | None = None
    #: store_call sites: the drop releases the prepared keys (#42945), or nothing (#49118)
    release_keys: bool = False
    #: generic assert of a request-scoped method before its load is issued
    request_scoped: bool = False
    #: its release calls, compiled (:attr:`kvguard.guards.site_registry.Site.releases`)
    releases: tuple[CodeType, ...] = ()



#: site id -> runtime info (filled by :func:`register` as modules are instrumented).
_SITE_RT: dict[str, _SiteRT] = {}



def register(sites: list[Site], module_globals: dict[str, Any] | None = None) -> None:
    """Make discovered ``sites`` known to :func:`check` (called by the instrumentor before
    it swaps in rewritten code). For the window site, vLLM's own bound expression
    (:attr:`Site.bound_expr`) is compiled once, to be evaluated on the frame's locals:
    ``vllm_bound`` is what the installed release asserts, never a version cutoff."""
    for site in sites:
        code = None
        if site.kind == KIND_WINDOW and site.bound_expr:
            code = compile(site.bound_expr, f"<vllm bound of {site.site_id}>", "eval")
        pending = site.pending_expr if site.pending_expr and site.pending_expr.isidentifier() else None
        _SITE_RT[site.site_id] = _SiteRT(
            site.site_id, site.check, site.kind, code, module_globals, pending,
            release_keys=getattr(site, "release_keys", False),
            request_scoped=getattr(site, "request_scoped", False),
            releases=tuple(compile(expr, f"<release of {site.site_id}>", "eval")
                           for expr in getattr(site, "releases", ())),
        )



#: Code objects of rewritten ``_build_store_jobs`` (they catch StoreDropped).
STORE_BUILDER_CODES: set[CodeType] = set()



def _exc(msg: Any) -> AssertionError:
    # Exactly what a failing ``assert test`` / ``assert test, msg`` raises.
    return AssertionError() if msg is _NO_MSG else AssertionError(msg)



def check(site_id: str, ok: bool, context: dict[str, Any] | None = None, msg: Any = _NO_MSG) -> BaseException | None:
    """Decide one evaluation of check site ``site_id``; return the exception to raise, or None.

    ``ok`` is the value of vLLM's own assert test; ``context`` the frame's ``locals()``
    (read only, never stored; values are summarized before logging, token ids never);
    ``msg`` the assert's message when it has one. Never raises: an internal error counts
    ``kvguard_guard_errors_total{stage="check"}`` and returns vLLM's own outcome.
    """
    site = _SITE_RT.get(site_id)
    if site is None or runtime.suppress_depth:
        return None if ok else _exc(msg)
    try:
        if site.kind == KIND_WINDOW:
            return _check_window(site, ok, context or {}, msg)
        if ok:  # rewritten asserts call only on failure; a pass is vLLM's own, uncounted
            return None
        return _check_failed_assert(site, context or {}, msg)
    except Exception as error:  # guard code must never take the engine down
        counts.guard_error(names.STAGE_CHECK, error)
        return None if ok else _exc(msg)



def _check_failed_assert(site: _SiteRT, context: dict[str, Any], msg: Any) -> BaseException:
    action = names.ACTION_RAISED
    exc: BaseException = _exc(msg)
    # frame 0: this function, 1: check, 2: the vLLM function that holds the assert
    holder = sys._getframe(2)
    if runtime.policy() != names.POLICY_GUARD:
        pass  # observe: vLLM's behaviour; strict: raise
    elif site.check == names.CHECK_GROUP_SIZES_CONSISTENCY and holder.f_back is not None and (
        holder.f_back.f_code in STORE_BUILDER_CODES
    ):
        action = names.ACTION_STORE_DROPPED  # GPULoadStoreSpec.__init__ called by the store builder
    elif site.check == names.CHECK_STORE_KEYS_CONSISTENCY and holder.f_code in STORE_BUILDER_CODES:
        action = names.ACTION_STORE_DROPPED  # the assert is in the store builder's request loop
    elif site.request_scoped and GLOBAL_FAIL_REQUEST in holder.f_code.co_names:
        rid = _request_id(context)
        error = _failure_text(site, msg)
        if rid is not None and _give_back(site, holder) and degrade.register_failure(rid, error, site.site_id, holder):
            action = names.ACTION_REQUEST_FAILED
            exc = runtime.RequestFailed(msg) if msg is not _NO_MSG else runtime.RequestFailed()
    if action == names.ACTION_STORE_DROPPED:
        exc = runtime.StoreDropped(msg) if msg is not _NO_MSG else runtime.StoreDropped()
    runtime.report_violation(
        site.site_id, site.check, action,
        request_id=_request_id(context), blocks_per_chunk=_blocks_per_chunk(context),
        context=context, message=None if msg is _NO_MSG else msg,
    )
    return exc



def _give_back(site: _SiteRT, holder: Any) -> bool:
    """Run the request-scoped ``site``'s release calls in ``holder`` (the vLLM frame of the
    failing assert): the method's own calls that give back what it holds at that line
    (0.34.0's ``self._free_pending_cpu_hit(pending)``, ``BlockPool.free_blocks`` of blocks
    it touched), last taken first. True when every one ran (or there are none); False
    when one raised (counted, ``stage="request_fail"``): then the request is not failed
    and vLLM's assertion decides, as without kvguard."""
    if not site.releases:
        return True
    scope = {**(site.module_globals or holder.f_globals), **holder.f_locals}
    try:
        for code in site.releases:
            eval(code, scope)
    except Exception as error:
        counts.guard_error(names.STAGE_REQUEST_FAIL, error)
        return False
    return True


def _request_id(context: dict[str, Any]) -> str | None:
    """The request id a failing assert's frame holds, under vLLM's usual local names
    (``req_id``; ``request`` / ``req``; ``req_status.req``), or None."""
    for key in ("req_id", "request_id"):
        value = context.get(key)
        if isinstance(value, str):
            return value
    for key in ("request", "req", "req_status", "req_state"):
        obj = context.get(key)
        for candidate in (obj, getattr(obj, "req", None)):
            value = getattr(candidate, "request_id", None)
            if isinstance(value, str):
                return value
    return None



def _blocks_per_chunk(context: dict[str, Any]) -> int | None:
    """``blocks_per_chunk`` (``block_size_factor`` before #48150) of the scheduler or
    spec the frame belongs to, or None; the frame's scalar locals (``num_cached_tokens``,
    token and block counts) are in the event's ``context``."""
    config = getattr(context.get("self"), "config", None)
    for owner in (config, context.get("self")):
        for name in ("blocks_per_chunk", "block_size_factor"):
            value = getattr(owner, name, None)
            if isinstance(value, int):
                return value
    return None



def _failure_text(site: _SiteRT, msg: Any) -> str:
    """What a failed request's client is told: the site and vLLM's assert (its text when
    the assert has no message)."""
    detail = "" if msg is _NO_MSG else f": {msg}"
    reg = _site_registry_entry(site.site_id)
    test = f" ({reg.fingerprint})" if reg is not None and not detail else ""
    return f"kvguard: offload invariant failed at {site.site_id}{detail}{test}; request failed alone"



def _site_registry_entry(site_id: str) -> Any:
    return site_registry.registered(site_id)



def fail_request(site_id: str, context: dict[str, Any]) -> None:
    """Called by a rewritten request-scoped method after :class:`~kvguard.guards.policy.runtime.RequestFailed`, with its
    ``locals()``, as it returns early (before it issued the request's load). The
    decision and the binding were made in :func:`check`; this confirms that the method
    really stopped, for :mod:`kvguard.guards.policy.degrade`. Never raises (``stage="request_fail"``)."""
    try:
        degrade.method_returned(_request_id(context))
    except Exception as error:
        counts.guard_error(names.STAGE_REQUEST_FAIL, error)



def _window_geometry(context: dict[str, Any]) -> tuple[str, int, int, int | None, int] | None:
    """(kind, sliding_window, tokens_per_block, blocks_per_chunk, extra_retained_tokens) or None.

    The group's KV cache spec comes from vLLM's own locals of the window site:
    ``group_config.kv_cache_spec`` where the release keeps it there, else the spec the
    instrumentor recorded on the scheduler (``self._kvguard_kv_specs[group_idx]``, bound
    by signature at construction). ``sliding_window`` and ``tokens_per_block``
    (``spec.block_size``, the GPU block) are read from the spec, so the exact bound needs no
    name of the scheduler's own config; ``blocks_per_chunk`` (``block_size_factor`` before
    #48150) is for the event only (None when neither name exists).
    """
    group_config = context.get("group_config")
    scheduler = context.get("self")
    if group_config is None or scheduler is None:
        return None
    spec = getattr(group_config, "kv_cache_spec", None)
    if spec is None:
        specs = getattr(scheduler, "_kvguard_kv_specs", None)
        if specs is not None:
            spec = specs.get(getattr(group_config, "group_idx", None))
    if spec is None:
        return None
    config = getattr(scheduler, "config", None)
    bpc = getattr(config, "blocks_per_chunk", None) or getattr(config, "block_size_factor", None)
    bpc = int(bpc) if bpc is not None else None
    tpb = int(spec.block_size)
    kind = _spec_kinds.get(type(spec))
    if kind is None:
        lineage = {cls.__name__ for cls in type(spec).__mro__}
        kind = _spec_kinds[type(spec)] = (
            "swa" if "SlidingWindowSpec" in lineage else "mamba" if "MambaSpec" in lineage else "other"
        )
    if kind == "swa":
        extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
        return ("swa", int(spec.sliding_window), tpb, bpc, extra)
    return (kind, 0, tpb, bpc, 0)



#: KV cache spec class -> its kind for the window site ("swa", "mamba", "other"), by lineage
_spec_kinds: dict[type, str] = {}


def _vllm_window_bound(site: _SiteRT, context: dict[str, Any]) -> int | None:
    """vLLM's own bound (GPU blocks): the installed release's bound expression evaluated
    on the window site's locals; None when it cannot be evaluated (counted)."""
    if site.bound_code is None:
        return None
    try:
        return int(eval(site.bound_code, site.module_globals or {}, context))  # noqa: S307 - vLLM's own expression
    except Exception as error:
        counts.guard_error(names.STAGE_CONTEXT, error)
        return None



def _pending_blocks(site: _SiteRT, context: dict[str, Any]) -> int:
    """The pending GPU blocks of the load: the left side of vLLM's window assert."""
    value = context.get(site.pending_name) if site.pending_name else None
    return int(value if value is not None else context.get("num_pending_gpu_blocks", 0))



def _check_window(site: _SiteRT, ok: bool, context: dict[str, Any], msg: Any) -> BaseException | None:
    policy = runtime.policy()
    try:
        geometry = _window_geometry(context)
    except Exception as error:
        counts.guard_error(names.STAGE_CONTEXT, error)
        geometry = None
    if geometry is None or geometry[0] == "other":
        # Unknown group kind or geometry: vLLM's own assert decides, and it is counted
        # like any generic assert (only when it fails).
        check_name = names.CHECK_SCHEDULER_ASSERT
        if ok:
            return None
        if geometry is None:
            # e.g. a scheduler constructed before install (no recorded KV cache spec):
            # the guard is blind here, say so
            counts.guard_error(names.STAGE_CONTEXT, LookupError("no KV cache spec for this group"))
        runtime.report_violation(site.site_id, check_name, names.ACTION_RAISED, policy=policy, context=context)
        return _exc(msg)

    kind, sw, tpb, bpc, extra = geometry
    pending = _pending_blocks(site, context)
    # vLLM's own bound (an eval of its expression) is read where it decides something:
    # Mamba's exact limit, and the event of a failure; a passing SWA check never reads it
    vllm_bound = None
    if kind == "mamba":
        # Mamba depends on a single state: never loosened (exactly vLLM's limit).
        check_name = names.CHECK_MAMBA_STATE_LIMIT
        vllm_bound = _vllm_window_bound(site, context)
        exact = vllm_bound if vllm_bound is not None else pending
        exact_ok = ok
    else:
        check_name = names.CHECK_SWA_PENDING_BOUND
        exact = invariants.swa_pending_bound(sw, tpb, extra)
        exact_ok = pending <= exact
        try:
            counts.metrics.swa_ratio(pending / exact)
        except Exception as error:
            counts.guard_error(names.STAGE_METRICS, error)
    counts.count_eval(check_name)
    counts.record_pending(check_name, pending, exact)
    if ok and exact_ok:
        return None

    if ok:  # vLLM's assert passed, the exact invariant did not
        action = names.ACTION_RAISED if policy == names.POLICY_STRICT else names.ACTION_CONTINUED
        result: BaseException | None = (
            AssertionError(
                f"kvguard strict: {check_name}: {pending} pending GPU blocks > exact bound {exact}"
            )
            if action == names.ACTION_RAISED
            else None
        )
    elif exact_ok and policy == names.POLICY_GUARD:
        action = ""
        result = None
    else:
        action = names.ACTION_RAISED
        result = _exc(msg)

    if kind != "mamba":
        vllm_bound = _vllm_window_bound(site, context)
    request = context.get("request")
    geometry_fields = dict(
        site=site.site_id,
        check=check_name,
        policy=policy,
        vllm_version=runtime.vllm_version(),
        request_id=getattr(request, "request_id", None),
        sliding_window=sw if kind == "swa" else None,
        tokens_per_block=tpb,
        blocks_per_chunk=bpc,
        extra_retained_tokens=extra,
        num_cached_tokens=context.get("num_cached_tokens"),
        pending_blocks=pending,
        exact_bound=exact,
        vllm_bound=vllm_bound,
    )
    if not action:
        counts.count_tolerated(check_name)
        counts.events.check_tolerated(**geometry_fields)
        return None
    counts.count_violation(site.site_id, check_name, action)
    counts.events.check_failed(action=action, **geometry_fields)
    return result



#: ``KVGUARD_DISABLED_SITES`` holds ``store:store_coverage`` (set at install): no store
#: coverage check (:func:`check_store` returns at once).
store_coverage_disabled = False



#: True: the copy ledger records nothing (``KVGUARD_DISABLED_SITES=admission:copy_coverage``),
#: so the admission check's copy coverage has nothing to read and is off too
copy_coverage_disabled = False



#: the check whose violation made :func:`check_store` return a StoreDropped; the
#: rewritten handler then calls :func:`drop_store`, which names it (one thread: EngineCore's)
_drop_check: str | None = None



def check_store(site_id: str, spec: Any, context: dict[str, Any]) -> BaseException | None:
    """The store coverage check (:mod:`kvguard.guards.checks.store_coverage`) of the
    ``GPULoadStoreSpec`` the store builder just built; returns the exception to raise, or None.

    ``spec``: the spec (``block_ids``, ``group_sizes``, ``block_indices``: GPU block ids
    and counts per KV cache group); ``context``: the builder's ``locals()`` (``self``, the
    connector scheduler; ``req_status``, whose ``group_states[g].block_ids`` is the
    connector's copy of the request's block table and ``req`` the request). Evaluated once
    per store job (``kvguard_check_evaluations_total{check="store_coverage"}``). On a
    violation: ``observe`` counts it (``continued``) and the store goes on; ``guard``
    returns :class:`~kvguard.guards.policy.runtime.StoreDropped` (the rewritten handler releases the store's keys and
    skips it: the chunks are not published, a later request recomputes them); ``strict``
    returns an ``AssertionError``. Never raises: an internal error counts
    ``kvguard_guard_errors_total{stage="check"}`` and the store goes on as vLLM built it.
    """
    global _drop_check
    policy = runtime.policy()  # once per store: the store path runs every step with a store
    if copy_coverage_disabled and (store_coverage_disabled or runtime.suppress_depth):
        return None
    try:
        try:
            geometries, parts = _store_inputs(spec, context)
        except Unsupported:  # a group kind or config kvguard cannot read: not checked
            return None
        if store_coverage_disabled or runtime.suppress_depth:
            problems: list[str] = []
        else:
            problems = _store_problems(context, geometries, parts)
            counts.count_eval(names.CHECK_STORE_COVERAGE)
        # the ledger records a store that goes ahead only: a dropped store writes nothing,
        # and recording it would forget an earlier partial copy of the same key
        remembered = True
        if not copy_coverage_disabled and (not problems or policy == names.POLICY_OBSERVE):
            remembered = _record_copies(context, geometries, parts)
        if not remembered:
            refused = _refuse_unremembered(context, policy, problems)
            if refused is not None:
                return refused
        if not problems:
            return None
        if policy == names.POLICY_GUARD:
            action, exc = names.ACTION_STORE_DROPPED, runtime.StoreDropped("; ".join(problems))
            _drop_check = names.CHECK_STORE_COVERAGE
        elif policy == names.POLICY_STRICT:
            action, exc = names.ACTION_RAISED, AssertionError("store coverage: " + "; ".join(problems))
        else:
            action, exc = names.ACTION_CONTINUED, None
        runtime.report_violation(
            site_id, names.CHECK_STORE_COVERAGE, action, policy=policy, context={},
            message="; ".join(problems), request_id=_request_id(context),
            blocks_per_chunk=_blocks_per_chunk(context),
        )
        return exc
    except Exception as error:  # guard code must never take the engine down
        counts.guard_error(names.STAGE_CHECK, error)
        return None



def _store_inputs(spec: Any, context: dict[str, Any]) -> tuple[tuple[Any, ...], list[tuple[int, int, list[int]]]]:
    """``(group geometries, the spec's groups as :func:`_spec_groups` lists them)`` of a store
    the builder just built, read once for the store check and the copy ledger both;
    Unsupported when kvguard cannot read a group's geometry."""
    cs = context["self"]
    geometries = cs.__dict__.get("_kvguard_store_geometry")
    if geometries is None:
        geometries = cs.__dict__["_kvguard_store_geometry"] = offload_plan.group_geometries(cs)
    # vLLM keeps the ids as a numpy array (0.21-0.34): tolist() gives plain ints at once;
    # list() would give numpy scalars, slow to build and to compare with the table's ints
    block_ids = spec.block_ids
    block_ids = block_ids.tolist() if hasattr(block_ids, "tolist") else list(block_ids)
    return geometries, _spec_groups(spec, block_ids)



def _spec_groups(spec: Any, block_ids: list[int]) -> list[tuple[int, int, list[int]]]:
    """``(group, block_indices[group], that group's block ids)`` of each KV cache group with
    blocks in the spec (``GPULoadStoreSpec``: the ids of group ``g`` follow those of the
    groups before it, ``group_sizes[g]`` of them)."""
    parts = []
    offset = 0
    for g, (size, first) in enumerate(zip(spec.group_sizes, spec.block_indices)):
        size = int(size)
        if size:
            parts.append((g, int(first), block_ids[offset : offset + size]))
        offset += size
    return parts



def _record_copies(context: dict[str, Any], geometries: tuple[Any, ...], parts: list[tuple[int, int, list[int]]]) -> bool:
    """Keep which sub-blocks of each chunk this store writes (:mod:`kvguard.guards.checks.copy_ledger`),
    for the admission check's copy coverage, after forgetting the keys the CPU tier evicted
    to make room for it (``store_output.evicted_keys``, the builder's ``prepare_store``
    answer). False when the ledger has no room for the store's partly written chunks
    (nothing recorded: the caller refuses the store). Needs the builder's ``keys_to_store``
    (the keys the manager will write); without it the ledger is marked unreadable for this
    scheduler, and the admission check skips copy coverage there (counted)."""
    cs = context["self"]
    req_status = context["req_status"]
    keys_to_store = context.get("keys_to_store")
    group_states = req_status.group_states
    ledger = cs.__dict__.get(copy_ledger.LEDGER_ATTR)
    if ledger is None:
        # with vLLM's tiering a partly written chunk is withheld from every secondary tier
        # (tier_publish, guard and strict); under observe it may be cascaded and promoted
        # back later, so then neither an eviction nor a whole re-store may forget it
        manager = getattr(cs, "manager", None)
        ledger = cs.__dict__[copy_ledger.LEDGER_ATTR] = copy_ledger.CopyLedger(
            len(group_states), forget_on_whole_store=tier_publish.ledger_may_forget(manager))
        tier_publish.install(manager, ledger)
    if keys_to_store is None or not hasattr(keys_to_store, "__contains__"):
        ledger.unreadable = "the store builder has no keys_to_store collection"
        return True
    evicted = getattr(context.get("store_output"), "evicted_keys", None)
    if evicted:
        ledger.forget_evicted(evicted)
    writes = []
    fulls = []
    for g, first, copied in parts:
        state = group_states[g]
        bpc = geometries[g].blocks_per_chunk
        found = copy_ledger.group_store_writes(ledger, g, state.block_ids, copied, first, bpc,
                                               state.offload_keys, keys_to_store)
        if found is not None:
            writes.append((g, *found))
            fulls.append((1 << bpc) - 1)
    if not writes:
        return True
    if not ledger.room_for(writes, fulls):
        ledger.refused += 1
        return False
    for (g, keys, masks), full in zip(writes, fulls):
        ledger.record(g, keys, masks, full)
    return True



def _refuse_unremembered(context: dict[str, Any], policy: str, problems: list[str]) -> BaseException | None:
    """A store whose partly written chunks the copy ledger has no room for: counted as
    ``kvguard_check_skipped_total{check="copy_coverage", reason="ledger_full"}``; under
    ``guard`` and ``strict`` the store is refused (returns
    :class:`~kvguard.guards.policy.runtime.StoreDropped`: its chunks are not published, so
    no reader loads a slot the ledger cannot vouch for; a full ledger is kvguard's limit,
    not vLLM's fault, so ``strict`` does not raise for it); under ``observe`` (or when the
    store coverage check drops the store anyway) None."""
    global _drop_check
    cs = context["self"]
    ledger = cs.__dict__.get(copy_ledger.LEDGER_ATTR)
    limit = ledger.limit if ledger is not None else copy_ledger.LEDGER_MAX
    admission_counters.skip(cs, names.CHECK_COPY_COVERAGE, admission_counters.CC, names.SKIP_LEDGER_FULL,
                            f"the copy ledger holds at most {limit} partly written chunks per scheduler; "
                            + ("the store went ahead unrecorded (observe)" if policy == names.POLICY_OBSERVE
                               else "the store was refused, its chunks are not published"))
    if policy == names.POLICY_OBSERVE or problems:
        return None
    _drop_check = names.CHECK_COPY_COVERAGE
    return runtime.StoreDropped(f"copy ledger full ({limit} partly written chunks)")



def _store_problems(context: dict[str, Any], geometries: tuple[Any, ...], parts: list[tuple[int, int, list[int]]]) -> list[str]:
    """Per KV cache group of the spec, :func:`kvguard.guards.checks.store_coverage.group_store_problems`
    (prefixed ``group <g>:``); groups with no block in this store are skipped."""
    req_status = context["req_status"]
    req = req_status.req
    num_tokens = int(req.num_tokens)
    written = _written_tokens(context, req)
    problems: list[str] = []
    group_states = req_status.group_states
    for g, first, copied in parts:
        geo = geometries[g]
        table = group_states[g].block_ids
        bpc, tpb = geo.blocks_per_chunk, geo.tokens_per_block
        in_place = store_in_place(table, copied, first, tpb, bpc, geo.kept_tokens, num_tokens)
        # the store's chunks end within the KV the request has computed (vLLM 0.26.0-0.29.0's
        # final store of a finished request counts its last, never computed, token). An
        # in-place store ends at ``first + len(copied)`` (a chunk boundary); a store in runs
        # ends at least there (later runs only skip forward), so the walk runs only then.
        if written is not None:
            end = -(-(first + len(copied)) // bpc) * bpc
            if not in_place:
                end = max(end, stored_end_block(table, copied, first, bpc))
            late = uncomputed_problem(end, tpb, written)
            if late:
                problems.append(f"group {g}: {late}")
        # the usual store, read with one slice comparison and no dataclass (issue 31)
        if in_place:
            continue
        found = group_store_problems(GroupStore(
            table=table,
            copied=copied,
            first_index=first,
            tokens_per_block=geo.tokens_per_block,
            blocks_per_chunk=geo.blocks_per_chunk,
            kept_tokens=geo.kept_tokens,
            num_tokens=num_tokens,
        ))
        problems.extend(f"group {g}: {p}" for p in found)
    return problems



def _written_tokens(context: dict[str, Any], req: Any) -> int | None:
    """Tokens of ``req`` whose KV is in its GPU blocks once the step's forward ran:
    ``num_computed_tokens`` plus what ``scheduler_output`` (the builder's parameter, on
    every release) schedules for it this step; a finished request is not scheduled, and its
    last sampled token is not computed. None when the builder has no ``scheduler_output``."""
    scheduled = getattr(context.get("scheduler_output"), "num_scheduled_tokens", None)
    if scheduled is None:
        return None
    return int(req.num_computed_tokens) + int(scheduled.get(req.request_id, 0))



def drop_store(site_id: str, context: dict[str, Any]) -> None:
    """Release a dropped store's keys so no later request waits on them (vLLM #42945).

    Called by the rewritten ``_build_store_jobs`` after :class:`~kvguard.guards.policy.runtime.StoreDropped`, with its
    ``locals()``: ``self`` (the OffloadingConnectorScheduler), ``req_status`` and
    ``keys_to_store``. For a site that runs after ``prepare_store`` (``release_keys``,
    #42945) it calls ``self.manager.complete_store(keys, req_context, success=False)``,
    which frees the CPU blocks that ``prepare_store`` allocated and never marks them
    stored. For the ``store_keys_consistency`` site (#49118 class) the assert fires
    before ``prepare_store``: nothing is released; the builder then skips to the next
    request (the request's store cursor did not move, so a live request retries next
    step). Never raises (errors count ``stage="store_drop"``).
    """
    global _drop_check
    try:
        rt = _SITE_RT.get(site_id)
        check_name = rt.check if rt is not None else names.CHECK_GROUP_SIZES_CONSISTENCY
        if _drop_check is not None:  # the store coverage check dropped it (check_store)
            check_name, _drop_check = _drop_check, None
        released = 0
        if rt is None or rt.release_keys:
            scheduler = context["self"]
            req_status = context["req_status"]
            keys = context["keys_to_store"]
            scheduler.manager.complete_store(keys, req_status.req_context, success=False)
            released = len(keys)
        # else (#49118 class): the assert fired before prepare_store in this request's
        # iteration, so nothing was prepared and nothing is released; a keys_to_store
        # local of an earlier iteration belongs to another request's store and is left alone.
        counts.events.store_dropped(
            site=site_id,
            check=check_name,
            policy=runtime.policy(),
            vllm_version=runtime.vllm_version(),
            request_id=context.get("req_id"),
            released_keys=released,
        )
    except Exception as error:
        counts.guard_error(names.STAGE_STORE_DROP, error)

