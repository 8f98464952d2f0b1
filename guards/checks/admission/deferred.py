"""What a deferred lookup waits for, and what of it is ready now (the wait bound's measure and answer).

The connector's lookup answers ``None`` ("ask again later") when a chunk of the hit is not
ready yet: being stored, being loaded by another request, or, under vLLM's tiering, being
promoted from a secondary tier. The wait bound (:mod:`kvguard.guards.checks.wait_bound`)
measures such a wait's progress by the chunks of the awaited load set that are ready in
the CPU tier now (:func:`awaited_end`, :func:`ready_pred`), and when the wait is stalled it
answers the longest hit whose load set is ready now and whose copies are covered
(:func:`ready_hit`), or 0: vLLM recomputes the rest.

The awaited hit is the longest hit the request's offload keys allow
(``min(len(offload_keys) * tokens_per_chunk, num_tokens - 1)``); its load set is what the
lookup must find ready at once. Why the reduced answer is safe: it is built of chunks that
are ready in the CPU tier (the load-set rule of :mod:`~kvguard.guards.checks.load_coverage`)
and whose store copied every slot the load reads (:mod:`~kvguard.guards.checks.copy_ledger`),
and vLLM's scheduler calls ``update_state_after_alloc`` (``prepare_load`` pins them) right
after allocating that request's blocks, with no other lookup in between; for a deferred
answer vLLM's ``get_num_new_matched_tokens`` already set ``num_locally_computed_tokens``,
cleared ``partial_tail_boundary`` and reserved no sync load.

Two checks once acted on deferred hits under vLLM's tiering before the wait bound existed,
each derived from one stall shape: ``promotion_fit`` (the awaited load set holds more
chunks than the CPU tier) and ``promotion_progress`` (a chunk ready at the previous
deferred lookup is not ready now). The differential fuzz (docs/fuzz.md, "Differential
fuzzing") showed them cutting hits in examples vLLM alone served whole, and the wait bound
ending every stall they ended, with no request worse off: they were retired (vllm#49902's
request-ranked LRU loop and the promotion loop of ``tests/vllm/traces/tiering-*.jsonl``
now end by the wait bound, ``tests/vllm/test_tiering_stalls.py``).
"""

from __future__ import annotations

from typing import Any, Callable

from kvguard.guards.checks import copy_ledger, offload_plan
from kvguard.guards.checks.admission import copied
from kvguard.guards.checks.load_coverage import load_set, longest_hit


def ready_pred(cs: Any, group_states: Any, get: Any) -> Callable[[int, int], bool]:
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


def ready_hit(cs: Any, plan: offload_plan.Plan, group_states: Any, get: Any, num_computed_tokens: int, target: int) -> int:
    """The longest hit (tokens beyond ``num_computed_tokens``, at most ``target``) whose
    load set is ready in the CPU tier now (:func:`ready_pred`) and whose copies are
    covered (:mod:`kvguard.guards.checks.copy_ledger`); 0 when none is."""
    ready = ready_pred(cs, group_states, get)
    copies = copied.copies_ok(plan, cs.__dict__.get(copy_ledger.LEDGER_ATTR), group_states, num_computed_tokens)

    def ok(end: int) -> bool:
        return all(
            ready(g, c) for g, chunks in enumerate(load_set(plan.groups, num_computed_tokens, end)) for c in chunks
        ) and copies(end)

    return longest_hit(plan.groups, num_computed_tokens, num_computed_tokens + target, ok)


def awaited_end(plan: offload_plan.Plan, group_states: Any, request: Any) -> int:
    """The end (tokens) of the longest hit the request's offload keys allow:
    ``min(len(offload_keys) * tokens_per_chunk over the groups, num_tokens - 1)``."""
    end = min(len(state.offload_keys) * g.tokens_per_chunk for state, g in zip(group_states, plan.groups))
    return min(end, int(request.num_tokens) - 1)
