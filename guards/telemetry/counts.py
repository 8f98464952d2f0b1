"""In-process counts of every check and the sinks they publish to.

One place holds what kvguard counted in this process (evaluations, tolerated failures,
violations per action, the window site's largest pending-block count and its bound, the
exceptions inside kvguard code per stage, the site of the last failure that raised) and
the two sinks those counts and events go to: ``metrics`` (the methods of
:class:`kvguard.guards.telemetry.metrics.GuardMetrics`: Prometheus, multiprocess mode) and
``events`` (those of :mod:`kvguard.guards.telemetry.events`: structlog). Both are no-ops
until :func:`set_sinks` (called by :func:`kvguard.guards.policy.runtime.configure`).

Everything that counts writes here, and nothing here imports a check or a policy, so the
checks, the degrade actions and the fatal record all depend on this module and never on
each other for their counters (no import cycle).
"""

from __future__ import annotations

import threading
from typing import Any

from kvguard.guards import names

__all__ = [
    "metrics",
    "events",
    "set_sinks",
    "clear_sinks",
    "count_eval",
    "count_tolerated",
    "count_violation",
    "record_pending",
    "guard_error",
    "guard_errors",
    "last_failed_site",
    "snapshot",
    "reset",
]


class NullMetrics:
    """The metrics sink before :func:`set_sinks`: every method does nothing."""

    def evaluations(self, check: str, amount: int) -> None: ...
    def tolerated(self, check: str) -> None: ...
    def violation(self, check: str, action: str) -> None: ...
    def guard_error(self, stage: str) -> None: ...
    def swa_ratio(self, ratio: float) -> None: ...
    def connector_guarded(self, connector: str) -> None: ...


class NullEvents:
    """The events sink before :func:`set_sinks`: every method does nothing."""

    def check_failed(self, **kw: Any) -> None: ...
    def check_tolerated(self, **kw: Any) -> None: ...
    def store_dropped(self, **kw: Any) -> None: ...
    def guard_error(self, **kw: Any) -> None: ...


#: the metrics sink (read at each call: :func:`set_sinks` replaces it)
metrics: Any = NullMetrics()
#: the events sink (read at each call: :func:`set_sinks` replaces it)
events: Any = NullEvents()

_lock = threading.Lock()
_evals: dict[str, int] = {}
_tolerated: dict[str, int] = {}
_violations: dict[str, int] = {}
_max_pending: dict[str, int] = {}
_bound: dict[str, int] = {}
_guard_errors: dict[str, int] = {}
_last_failed_site: str | None = None


def set_sinks(metrics_sink: Any = None, events_sink: Any = None) -> tuple[Any, Any]:
    """Replace the sinks (``None`` leaves one unchanged); returns the previous ``(metrics, events)``."""
    global metrics, events
    previous = (metrics, events)
    if metrics_sink is not None:
        metrics = metrics_sink
    if events_sink is not None:
        events = events_sink
    return previous


def clear_sinks() -> None:
    """Back to the no-op sinks."""
    global metrics, events
    metrics, events = NullMetrics(), NullEvents()


def count_eval(check_name: str) -> None:
    """One evaluation of ``check_name`` (``kvguard_check_evaluations_total{check}``)."""
    # Only the window site and the store check evaluate on vLLM's path, so the metrics
    # sink is written on every evaluation: nothing to flush later.
    _evals[check_name] = _evals.get(check_name, 0) + 1
    try:
        metrics.evaluations(check_name, 1)
    except Exception as error:
        guard_error(names.STAGE_METRICS, error)


def count_violation(site_id: str, check_name: str, action: str) -> None:
    """One failure of ``check_name`` at ``site_id`` handled with ``action``
    (``kvguard_invariant_violations_total{check,action}``); a ``raised`` one becomes
    :func:`last_failed_site` (the fatal record names it)."""
    global _last_failed_site
    _violations[check_name] = _violations.get(check_name, 0) + 1
    if action == names.ACTION_RAISED:
        _last_failed_site = site_id
    metrics.violation(check_name, action)


def count_tolerated(check_name: str) -> None:
    """One failure of vLLM's assert the guard let through (``kvguard_check_tolerated_total``)."""
    _tolerated[check_name] = _tolerated.get(check_name, 0) + 1
    metrics.tolerated(check_name)


def record_pending(check_name: str, pending: int, bound: int) -> None:
    """Keep the largest ``pending`` GPU blocks seen by the window check ``check_name`` and
    the exact ``bound`` (GPU blocks) of the geometry where it was seen."""
    if pending > _max_pending.get(check_name, -1):
        _max_pending[check_name] = pending
        _bound[check_name] = bound
    elif check_name not in _bound:
        _bound[check_name] = bound


def guard_error(stage: str, error: BaseException) -> None:
    """Count and log an exception raised inside kvguard code; never raises."""
    _guard_errors[stage] = _guard_errors.get(stage, 0) + 1
    try:
        metrics.guard_error(stage)
    except Exception:  # pragma: no cover - last line of defence
        pass
    try:
        events.guard_error(stage=stage, error=f"{type(error).__name__}: {error}")
    except Exception:  # pragma: no cover
        pass


#: the connectors whose scheduler side was built under kvguard in this process
_connectors: set[str] = set()


def connector_guarded(connector: str) -> None:
    """A connector's scheduler side was built under kvguard (``kvguard_connector_info``);
    an error of the sink counts ``stage="metrics"``; never raises."""
    _connectors.add(connector)
    try:
        metrics.connector_guarded(connector)
    except Exception as error:
        guard_error(names.STAGE_METRICS, error)


def connectors() -> set[str]:
    """The connectors :func:`connector_guarded` saw in this process (not cleared by :func:`reset`)."""
    return set(_connectors)


def guard_errors() -> dict[str, int]:
    """Per stage, the exceptions inside kvguard code counted in this process since
    :func:`reset` (what ``kvguard_guard_errors_total{stage}`` counts); stages with none
    are absent."""
    return dict(_guard_errors)


def last_failed_site() -> str | None:
    """Site id of the last check that raised in this process (for the fatal record), or None."""
    return _last_failed_site


def snapshot() -> dict[str, dict[str, int | None]]:
    """Per check name: ``{"evaluated", "tolerated", "violations", "max_pending_blocks", "bound"}``.

    Every name of :data:`kvguard.guards.names.CHECKS` is present. ``evaluated`` is an int for the
    checks of :data:`kvguard.guards.names.EVALUATED_CHECKS` (``swa_pending_bound``,
    ``mamba_state_limit``: counted on every evaluation) and None for every other check
    (``group_sizes_consistency`` and the generic ``*_assert`` checks): their passing
    evaluations are vLLM's own asserts and are not counted, so None says "not counted",
    never "not evaluated"; their failures are in ``violations``. ``max_pending_blocks``
    (GPU blocks) and ``bound`` (the exact bound, GPU blocks, of the geometry where the max
    was seen) are set for ``swa_pending_bound`` and ``mamba_state_limit`` once evaluated,
    else None.
    """
    result: dict[str, dict[str, int | None]] = {}
    for name in names.CHECKS:
        result[name] = {
            "evaluated": _evals.get(name, 0) if name in names.EVALUATED_CHECKS else None,
            "tolerated": _tolerated.get(name, 0),
            "violations": _violations.get(name, 0),
            "max_pending_blocks": _max_pending.get(name),
            "bound": _bound.get(name),
        }
    return result


def reset() -> None:
    """Zero every in-process counter (not the Prometheus ones) and forget the last failure."""
    global _last_failed_site
    with _lock:
        for d in (_evals, _tolerated, _violations, _max_pending, _bound, _guard_errors):
            d.clear()
        _last_failed_site = None
