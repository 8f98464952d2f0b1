"""One reset of every in-process state the guard keeps (the lab and the tests call it).

The guard keeps module-level state in a few places: the in-process counters
(:mod:`kvguard.guards.telemetry.counts`, the admission checks' counters, the wait bound's
and the recompute's counts), the requests queued to fail alone
(:mod:`kvguard.guards.policy.degrade`) and the admissions waiting to be recomputed with the
promotion methods found (:mod:`kvguard.guards.policy.recompute`). Each module owns its
``reset()``; :func:`reset_all` calls every one of them, so a replay that begins after
another one (the fuzzer runs thousands in one process) starts from nothing. A test
(``tests/guards/test_reset.py``) finds every ``def reset`` under ``guards/`` from the source
and fails when one is missing here. A production engine never calls it: its state lives as
long as the process. Prometheus series are not touched (they belong to the state dir).
"""

from __future__ import annotations

from kvguard.guards.checks import wait_bound
from kvguard.guards.checks.admission import counters as admission_counters
from kvguard.guards.policy import degrade, recompute, runtime
from kvguard.guards.telemetry import counts

__all__ = ["RESETS", "reset_all"]

#: every module-level ``reset()`` of the engine half, in an order where none undoes another
RESETS = (counts.reset, runtime.reset, degrade.reset, recompute.reset, wait_bound.reset, admission_counters.reset)


def reset_all() -> None:
    """Call every ``reset()`` of :data:`RESETS`. Raises nothing of its own."""
    for reset in RESETS:
        reset()
