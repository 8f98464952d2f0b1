"""The load coverage check (check ``load_coverage``): every chunk the load of a hit reads is
present and ready in the offload tier.

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
"""

from __future__ import annotations

import os
from typing import Any

from kvguard.guards import names
from kvguard.guards.checks import copy_ledger, offload_plan
from kvguard.guards.checks.admission import copied, counters
from kvguard.guards.checks.load_coverage import load_set, longest_hit
from kvguard.guards.policy import runtime


def check_hit(cs: Any, request: Any, num_computed_tokens: int, answer: Any, hit: int) -> Any:
    """Load and copy coverage of vLLM's lookup ``answer`` with a hit of ``hit`` tokens (> 0)
    after ``num_computed_tokens`` local tokens, for ``request`` of the connector scheduler
    ``cs``; returns ``answer`` itself when the load set is loadable and copied (or nothing
    is checked), else what :func:`_act` decides. Raises
    :class:`~kvguard.guards.checks.admission.counters.StrictFailure` under ``strict``; any
    other exception is the caller's to count (:func:`kvguard.guards.checks.admission.lookup.admit`).

    The per-group chunk bounds are :func:`kvguard.guards.checks.load_coverage.load_chunk_bounds`
    written out inline (a Python call per group cost more than the arithmetic; the two
    are compared over every small geometry in ``tests/guards/test_load_coverage.py``).
    """
    plan = cs.__dict__.get(offload_plan.PLAN_ATTR) or offload_plan.get_plan(cs)
    req_status = cs._req_status[request.request_id]
    if plan.__class__ is not offload_plan.Plan or getattr(req_status, "partial_tail_boundary", None) is not None:
        if plan.__class__ is not offload_plan.Plan:
            counters.skip(cs, names.CHECK_LOAD_COVERAGE, "", plan.reason, str(plan))
        else:
            counters.skip(cs, names.CHECK_LOAD_COVERAGE, "", names.SKIP_PARTIAL_TAIL,
                  "a partial-tail hit loads a boundary key, not a chunk of load_coverage")
        return answer
    epoch = plan.epoch
    now = epoch.n if epoch is not None else None  # read before any entry (tier_removals)
    if now is not None and verdict_kept(plan, now, req_status, request.request_id, num_computed_tokens, hit):
        counters.stats["reused"] += 1  # same question, nothing removed since: same verdict
        return answer
    counters.stats["evaluated"] += 1
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
        if not offload_plan.span_loadable(get, span):
            break
    else:
        ledger = cs.__dict__.get(copy_ledger.LEDGER_ATTR)
        if ledger is not None and (ledger.size or ledger.unreadable) or not plan.stores_recorded:
            if not copied.copies_checked(cs, plan, ledger, req_status.group_states, num_computed_tokens, num_cached):
                return _act(plan, req_status.group_states, get, request, num_computed_tokens, hit, answer, ledger)
        if now is not None:  # keep the verdict for vLLM's next lookup of this request
            verdicts = plan.verdicts
            if len(verdicts) >= offload_plan.VERDICTS_MAX:
                verdicts.clear()
            verdicts[request.request_id] = (now, req_status, num_computed_tokens, hit)
        return answer  # every group loadable: vLLM's answer, the same object
    return _act(plan, req_status.group_states, get, request, num_computed_tokens, hit, answer,
                cs.__dict__.get(copy_ledger.LEDGER_ATTR))


def verdict_kept(plan: offload_plan.Plan, epoch_now: int, req_status: Any, request_id: str,
                 num_computed_tokens: int, hit: int) -> bool:
    """Whether the plan keeps a passing verdict for this very question: the same request
    status object, local tokens and hit (tokens), asked at removal epoch ``epoch_now``
    (:mod:`kvguard.guards.checks.tier_removals`: nothing the check read can have left the
    tier since). :func:`kvguard.guards.checks.admission.lookup.admit_return` writes the same
    test inline for the repeated lookup (a call there costs more than the test, cold);
    ``tests/vllm/test_admission_verdicts.py`` proves both paths on every full release."""
    kept = plan.verdicts.get(request_id)
    return (kept is not None and kept[0] == epoch_now and kept[1] is req_status
            and kept[2] == num_computed_tokens and kept[3] == hit)


#: KVGUARD_ADMISSION_FULL=1: read every full-attention chunk too (cost grows with the hit)
_FULL = os.environ.get("KVGUARD_ADMISSION_FULL", "") == "1"


def _act(plan: offload_plan.Plan, group_states: Any, get: Any, request: Any, num_computed_tokens: int, hit: int, answer: Any,
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
    copies = copied.copies_ok(plan, ledger, group_states, num_computed_tokens)
    uncopied = [] if missing else copied.uncopied(plan, ledger, group_states, num_computed_tokens, num_cached)
    if not missing and not uncopied:
        return answer
    check, prefix = (names.CHECK_LOAD_COVERAGE, "") if missing else (names.CHECK_COPY_COVERAGE, counters.CC)
    first = (f"group {missing[0][0]} chunk {missing[0][1]}" if missing
             else f"group {uncopied[0][0]} block {uncopied[0][1]} (slot not copied by its store)")
    count = len(missing) if missing else len(uncopied)
    policy = runtime.policy()
    if policy == names.POLICY_OBSERVE:
        return counters.decide(check, prefix, request, num_computed_tokens, hit, hit, count, first, names.ACTION_CONTINUED,
                       policy, answer)
    if policy == names.POLICY_STRICT:
        counters.decide(check, prefix, request, num_computed_tokens, hit, hit, count, first, names.ACTION_RAISED, policy, answer)
        what = "chunk(s) not present/ready in the offload tier" if missing else \
            "GPU block(s) from chunk slots no store copied (wrong KV)"
        raise counters.StrictFailure(
            f"kvguard {check}: hit of {hit} tokens after {num_computed_tokens} local tokens "
            f"loads {count} {what} (first: {first})"
        )

    def ok(end: int) -> bool:
        return all(
            loadable(g, c) for g, chunks in enumerate(load_set(plan.groups, num_computed_tokens, end)) for c in chunks
        ) and copies(end)

    reduced = longest_hit(plan.groups, num_computed_tokens, num_cached, ok)
    new_answer = (reduced, bool(answer[1]) and reduced > 0)
    return counters.decide(check, prefix, request, num_computed_tokens, hit, reduced, count, first, names.ACTION_HIT_REDUCED,
                   policy, new_answer)
