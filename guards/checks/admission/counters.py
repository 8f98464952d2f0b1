"""The admission checks' in-process counts, sinks and kill switches, and the one way a
violation of any of them is decided and counted (:func:`decide`, :func:`record_violation`).

Counts by check: ``load_coverage`` (keys without prefix), ``copy_coverage`` (:data:`CC`); skips by
``(check, reason)``. Read with :func:`snapshot` and its siblings; zeroed by :func:`reset`.
"""

from __future__ import annotations

import threading
from typing import Any

from kvguard.guards import names
from kvguard.guards.policy import runtime

_lock = threading.Lock()
_STAT_KEYS = ("evaluated", "reused", "hit_reduced", "continued", "raised", "recomputed_tokens", "unchecked")
#: every key of _STAT_KEYS is always present, so the hot path increments with ``+= 1``
stats: dict[str, int] = dict.fromkeys(_STAT_KEYS, 0)
#: the metrics sink (None: counters in :func:`snapshot` only) and the events module
sink_metrics: Any = None
sink_events: Any = None


def configure(metrics: Any = None, events: Any = None) -> None:
    """Set the metrics sink (a :class:`kvguard.guards.telemetry.metrics.GuardMetrics`) and events
    module."""
    global sink_metrics, sink_events
    sink_metrics, sink_events = metrics, events


def metrics_sink() -> Any:
    """The metrics sink :func:`configure` set (None: counters in :func:`snapshot` only)."""
    return sink_metrics


def set_metrics_sink(metrics: Any) -> None:
    """Replace only the metrics sink (the fuzz runner's tee of kvguard's decisions); the
    events module stays as configured."""
    global sink_metrics
    sink_metrics = metrics


def unconfigure() -> None:
    """Back to no sinks (counters in :func:`snapshot` only)."""
    configure(None, None)


def reset() -> None:
    """Zero the in-process counters of :func:`snapshot` and :func:`snapshot_copy_coverage`
    (the hot path increments the ``snapshot`` keys in place, so they stay present)."""
    with _lock:
        stats.clear()
        stats.update(dict.fromkeys(_STAT_KEYS, 0))
        _skipped.clear()


def snapshot() -> dict[str, int]:
    """In-process counts since :func:`reset`: ``evaluated`` (lookups with a hit checked),
    ``hit_reduced``, ``continued`` (observe), ``raised`` (strict), ``recomputed_tokens``
    (tokens cut from hits), ``unchecked`` (hits not checkable on this release), and
    ``violations`` (the sum of the three actions)."""
    out = {k: stats.get(k, 0) for k in _STAT_KEYS}
    out["violations"] = out["hit_reduced"] + out["continued"] + out["raised"]
    return out


def snapshot_copy_coverage() -> dict[str, int]:
    """The copy coverage check's in-process counts since :func:`reset`, same keys as
    :func:`snapshot`: ``evaluated`` (hits whose load set was loadable and read against the
    copy ledger while it held partly written chunks), ``hit_reduced``, ``continued``,
    ``raised``, ``recomputed_tokens``, ``unchecked`` (hits not checked because the
    scheduler's stores are not recorded, and stores the full ledger refused or, under
    observe, let through unrecorded) and ``violations``."""
    return _prefixed_snapshot(CC)


def snapshot_skipped() -> dict[tuple[str, str], int]:
    """In-process skipped evaluations since :func:`reset`, by ``(check, reason)`` (what
    ``kvguard_check_skipped_total`` counts; pairs with none are absent). Each is also in
    that check's ``unchecked`` of :func:`snapshot` / :func:`snapshot_copy_coverage`."""
    with _lock:
        return dict(_skipped)


def _prefixed_snapshot(prefix: str) -> dict[str, int]:
    out = {k: stats.get(prefix + k, 0) for k in _STAT_KEYS}
    out["violations"] = out["hit_reduced"] + out["continued"] + out["raised"]
    return out


#: key prefix of the copy-coverage counts in ``stats``
CC = "copy_coverage:"


def bump(key: str, amount: int = 1) -> None:
    stats[key] = stats.get(key, 0) + amount


#: Attribute cached on each connector scheduler instance: the ``(check, reason)`` pairs
#: whose ``check_skipped`` event it emitted (once each).
_SKIPS_ATTR = "_kvguard_skips_announced"


#: in-process skips since :func:`reset`, by ``(check, reason)`` (:func:`snapshot_skipped`)
_skipped: dict[tuple[str, str], int] = {}


def skip(cs: Any, check: str, prefix: str, reason: str, detail: str) -> None:
    """Count one evaluation of ``check`` skipped on ``cs`` for ``reason`` (in-process as
    ``prefix + "unchecked"`` and by reason, and ``kvguard_check_skipped_total``) and emit the
    ``check_skipped`` event the first time this scheduler skips ``check`` for ``reason``.
    Off the hot path: only a lookup the check does not evaluate comes here."""
    with _lock:
        bump(prefix + "unchecked")
        _skipped[(check, reason)] = _skipped.get((check, reason), 0) + 1
    if sink_metrics is not None:
        try:
            sink_metrics.check_skipped(check, reason)
        except Exception as error:
            runtime.guard_error(names.STAGE_METRICS, error)
    announced = cs.__dict__.get(_SKIPS_ATTR)
    if announced is None:
        announced = cs.__dict__[_SKIPS_ATTR] = set()
    if (check, reason) in announced:
        return
    announced.add((check, reason))
    if sink_events is not None:
        sink_events.check_skipped(**{names.KEY_CHECK: check, names.KEY_REASON: reason, names.KEY_DETAIL: detail})


class StrictFailure(Exception):
    pass


def decide(check: str, prefix: str, request: Any, local: int, hit: int, new_hit: int, count: int, first: str,
            action: str, policy: str, answer: Any) -> Any:
    return record_violation(
        check, prefix, request, action, policy, hit - new_hit, answer,
        {
            names.KEY_LOCAL_HIT_TOKENS: local,
            names.KEY_EXTERNAL_HIT_TOKENS: hit,
            names.KEY_ADMITTED_HIT_TOKENS: new_hit,
            names.KEY_MISSING_CHUNKS: count,
            names.KEY_FIRST_MISSING: first,
        },
    )


def record_violation(check: str, prefix: str, request: Any, action: str, policy: str, recomputed: int, answer: Any,
           fields: dict[str, Any]) -> Any:
    """Count one violation of ``check`` (in-process under ``prefix``, the counter, the
    recomputed tokens) and emit its ``hit_reduced`` event; returns ``answer``."""
    with _lock:
        bump(prefix + action)
        bump(prefix + "recomputed_tokens", recomputed)
    if sink_metrics is not None:
        try:
            sink_metrics.violation(check, action)
            if recomputed:
                sink_metrics.recomputed_tokens(check, recomputed)
        except Exception as error:
            runtime.guard_error(names.STAGE_METRICS, error)
    if sink_events is not None:
        sink_events.hit_reduced(
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


def record_check_failed(check: str, site: str, prefix: str, action: str, policy: str,
                        fields: dict[str, Any], recomputed: int = 0) -> None:
    """Count one violation of a check that names its own site (``block_exclusive``,
    ``load_writes``, ``gpu_free_once``): in-process under ``prefix`` (with ``recomputed``
    tokens), ``kvguard_invariant_violations_total{check,action}`` (and
    ``kvguard_recomputed_tokens_total`` when tokens were recomputed), and the
    ``check_failed`` event with ``fields``. A sink's error counts ``stage="metrics"``."""
    bump(prefix + action)
    if recomputed:
        bump(prefix + "recomputed_tokens", recomputed)
    if sink_metrics is not None:
        try:
            sink_metrics.violation(check, action)
            if recomputed:
                sink_metrics.recomputed_tokens(check, recomputed)
        except Exception as error:
            runtime.guard_error(names.STAGE_METRICS, error)
    if sink_events is not None:
        sink_events.check_failed(**{names.KEY_SITE: site, names.KEY_CHECK: check, names.KEY_ACTION: action,
                                    names.KEY_POLICY: policy, **fields})
