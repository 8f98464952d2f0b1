"""Admission check of an offload cache hit: its load set must be loadable: every chunk a load reads is there.

Where the connector answers ``OffloadingConnectorScheduler.get_num_new_matched_tokens
(request, num_computed_tokens, ...)`` with ``(num_external_tokens, load_async)``, kvguard
computes the chunks the load of that hit will read (:mod:`kvguard.guards.checks.load_coverage`)
and asks the offload manager, without side effects, whether each one is present and
ready. The check runs once per lookup with a hit (``num_external_tokens`` > 0).

The admission checks of one lookup answer, one module per check:

- :mod:`~kvguard.guards.checks.admission.loadable`: ``load_coverage``, every chunk of the hit's load set present and ready;
- :mod:`~kvguard.guards.checks.admission.copied`: ``copy_coverage``, every slot the load reads was copied by its store;
- :mod:`~kvguard.guards.checks.admission.deferred`: what a deferred lookup waits for and what of it is ready now (the wait bound's measure and reduced answer);

where they run (:mod:`~kvguard.guards.checks.admission.lookup`: vLLM's lookup, rewritten or wrapped),
what they read (:mod:`kvguard.guards.checks.offload_plan`) and how they count
(:mod:`~kvguard.guards.checks.admission.counters`). The invariant math is
:mod:`kvguard.guards.checks.load_coverage`'s and :mod:`kvguard.guards.checks.copy_ledger`'s pure functions.
"""

from kvguard.guards.checks.admission.counters import (
    configure,
    metrics_sink,
    reset,
    set_metrics_sink,
    snapshot,
    snapshot_copy_coverage,
    snapshot_skipped,
    unconfigure,
)
from kvguard.guards.checks.admission.lookup import (
    admission_wrapper,
    admit,
    admit_return,
    admits_inline,
    attach,
    attach_wrapper,
    detach_all,
    unwrapped_lookup,
)
from kvguard.guards.checks.load_coverage import Unsupported
from kvguard.guards.checks.offload_plan import group_geometries

__all__ = [
    "admission_wrapper",
    "admit",
    "admit_return",
    "admits_inline",
    "attach",
    "attach_wrapper",
    "detach_all",
    "unwrapped_lookup",
    "configure",
    "unconfigure",
    "snapshot",
    "snapshot_copy_coverage",
    "snapshot_skipped",
    "reset",
    "metrics_sink",
    "set_metrics_sink",
    "group_geometries",
    "Unsupported",
]
