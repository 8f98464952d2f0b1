"""The copy coverage check (check ``copy_coverage``): every GPU block the load of a loadable
hit writes comes from a chunk slot a store really copied (:mod:`kvguard.guards.checks.copy_ledger`
records the copies where vLLM builds each store). A chunk is published whole while its
store may have copied only some of its sub-blocks; a later load of a sub-block no store
wrote would give the reader wrong KV. Acts as :mod:`~kvguard.guards.checks.admission.loadable`
does (``hit_reduced`` under ``guard``: the longest hit whose slots were copied). Kill switch:
``KVGUARD_DISABLED_SITES=admission:copy_coverage``.
"""

from __future__ import annotations

from typing import Any, Callable

from kvguard.guards import names
from kvguard.guards.checks import copy_ledger, offload_plan
from kvguard.guards.checks.admission import counters


def copies_checked(cs: Any, plan: offload_plan.Plan, ledger: Any, group_states: Any, num_computed_tokens: int,
                    num_cached: int) -> bool:
    """Copy coverage of a loadable hit ending at ``num_cached`` tokens: True when every GPU
    block its load writes comes from a slot a store copied (or when the check cannot be
    made here: skipped and counted), False when :func:`loadable._act` must act.

    Skipped (``kvguard_check_skipped_total{check="copy_coverage"}``): a scheduler whose
    chunk stores kvguard does not record (``store_path``). The ledger never forgets a
    partial copy a tier may still hold (a store it has no room for is refused, counted as
    ``ledger_full`` where it is refused), so a key it does not hold was written whole."""
    if not plan.stores_recorded or (ledger is not None and ledger.unreadable):
        why = ledger.unreadable if ledger is not None and ledger.unreadable else \
            "the connector scheduler's store builder was not rewritten: its chunk stores are not recorded"
        counters.skip(cs, names.CHECK_COPY_COVERAGE, counters.CC, names.SKIP_STORE_PATH, why)
        return True
    if not ledger.size:
        return True
    counters.stats[counters.CC + "evaluated"] = counters.stats.get(counters.CC + "evaluated", 0) + 1
    return copy_ledger.ok_for(ledger, plan.fast, group_states, num_computed_tokens)(num_cached)


def copies_ok(plan: offload_plan.Plan, ledger: Any, group_states: Any, num_computed_tokens: int) -> Callable[[int], bool]:
    """``end -> bool``: copy coverage of a hit ending at ``end`` (always True without a
    ledger or without recorded stores: nothing known to be partly written)."""
    if ledger is None or not ledger.size or not plan.stores_recorded or ledger.unreadable:
        return lambda end: True
    return copy_ledger.ok_for(ledger, plan.fast, group_states, num_computed_tokens)


def uncopied(plan: offload_plan.Plan, ledger: Any, group_states: Any, num_computed_tokens: int, num_cached: int) -> list:
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
