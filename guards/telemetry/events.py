"""kvguard's structured events: one JSON line each, on a private structlog chain.

kvguard is a guest inside vLLM, so it never calls ``structlog.configure``: the logger is
built with ``structlog.wrap_logger(..., processors=[...])``, whose explicit chain wins over
any global configuration. One function per event; keys come from :mod:`kvguard.guards.names`.

The ``_sanitize`` processor keeps numbers, booleans and short strings, replaces
containers by ``"<list len=N>"`` and objects by their type name, drops any key in
:data:`kvguard.guards.names.REDACTED_KEYS` (prompt text, token ids) and kvguard's own ``@``
temporaries, and truncates long strings: prompt tokens never reach a log line.

:func:`capture` collects event dicts (after sanitizing) for tests, as
``structlog.testing.capture_logs`` does for globally configured loggers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import structlog

from kvguard.guards import names

__all__ = [
    "check_failed",
    "check_tolerated",
    "store_dropped",
    "site_missing",
    "site_installed",
    "guard_error",
    "engine_fatal",
    "already_imported",
    "plugin_disabled",
    "installed",
    "uninstalled",
    "hit_reduced",
    "vllm_unmeasured",
    "check_skipped",
    "capture",
]

_MAX_STR = 200
#: Per-group lists whose values are geometry, shown in full when short (#42945).
_SHOWN_LISTS = frozenset({"group_sizes", "block_indices"})
_SCALARS = (int, float, bool, type(None))


def _summarize(value: Any, depth: int = 0) -> Any:
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, str):
        return value if len(value) <= _MAX_STR else value[:_MAX_STR] + "..."
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} len={len(value)}>"
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"<{type(value).__name__} shape={tuple(shape)}>"
    return f"<{type(value).__name__}>"


def _clean_context(context: Any) -> dict[str, Any]:
    if not isinstance(context, dict):
        return {}
    out: dict[str, Any] = {}
    for key, value in context.items():
        if not isinstance(key, str) or key.startswith(("@", "__")) or key == "self":
            continue
        if key in names.REDACTED_KEYS:
            continue
        if key in _SHOWN_LISTS and isinstance(value, (list, tuple)) and len(value) <= 16:
            out[key] = [v if isinstance(v, _SCALARS) else _summarize(v) for v in value]
        else:
            out[key] = _summarize(value)
    return out


def _sanitize(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
    for key in list(event):
        if key in names.REDACTED_KEYS:
            del event[key]
        elif key == names.KEY_CONTEXT:
            event[key] = _clean_context(event[key])
        elif key not in ("event", "timestamp", "level"):
            event[key] = _summarize(event[key])
    return event


def _add_common(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
    event.setdefault("logger", "kvguard")
    event.setdefault("pid", os.getpid())
    return event


_captured: list[list[dict[str, Any]]] = []


def _capture(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
    if _captured:
        _captured[-1].append(dict(event, log_level=method))
        raise structlog.DropEvent
    return event


_PROCESSORS = [
    structlog.processors.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
    _add_common,
    _sanitize,
    _capture,
    structlog.processors.JSONRenderer(),
]
class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at call time (vLLM or a test may replace it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


_log = structlog.wrap_logger(
    structlog.PrintLogger(_CurrentStderr()),
    processors=_PROCESSORS,
    wrapper_class=structlog.make_filtering_bound_logger(
        getattr(logging, os.environ.get("KVGUARD_LOG_LEVEL", "INFO").upper(), logging.INFO)
    ),
    cache_logger_on_first_use=False,
)


@contextlib.contextmanager
def capture() -> Iterator[list[dict[str, Any]]]:
    """Collect kvguard events (sanitized dicts, plus ``log_level``) instead of printing them."""
    bucket: list[dict[str, Any]] = []
    _captured.append(bucket)
    try:
        yield bucket
    finally:
        _captured.remove(bucket)


def _emit(level: str, event: str, fields: dict[str, Any]) -> None:
    try:
        getattr(_log, level)(event, **fields)
    except Exception:  # a log line must never break vLLM
        pass


def check_failed(**fields: Any) -> None:
    """A check failed (``violated``/``raised``): site, check, policy, action, geometry or context."""
    _emit("warning", names.EVENT_CHECK_FAILED, {names.KEY_OUTCOME: names.OUTCOME_VIOLATED, **fields})


def check_tolerated(**fields: Any) -> None:
    """vLLM's assert failed, the exact invariant held and guard continued (with geometry)."""
    _emit("warning", names.EVENT_CHECK_TOLERATED, {names.KEY_OUTCOME: names.OUTCOME_TOLERATED, **fields})


def store_dropped(**fields: Any) -> None:
    """An inconsistent store was dropped and its keys released (vLLM #42945)."""
    _emit("warning", names.EVENT_STORE_DROPPED, fields)


def site_missing(**fields: Any) -> None:
    """A site was not installed: site, module, reason (``not_rewritten`` with a ``detail``,
    or ``special_missing``: a special site the module should have and that was not matched)."""
    _emit("warning", names.EVENT_SITE_MISSING, fields)


def site_installed(**fields: Any) -> None:
    """A site was installed: site, module, qualname."""
    _emit("debug", names.EVENT_SITE_INSTALLED, fields)


def guard_error(**fields: Any) -> None:
    """An exception inside kvguard code: stage, error."""
    _emit("error", names.EVENT_GUARD_ERROR, {names.KEY_OUTCOME: names.OUTCOME_GUARD_ERROR, **fields})


def engine_fatal(**fields: Any) -> None:
    """A fatal EngineCore exception was recorded: exception, message, site."""
    _emit("error", names.EVENT_ENGINE_FATAL, fields)


def already_imported(**fields: Any) -> None:
    """A target module was imported before install (instrumented in place): module."""
    _emit("info", names.EVENT_ALREADY_IMPORTED, fields)


def plugin_disabled(**fields: Any) -> None:
    """The plugin did not install: reason."""
    _emit("warning", names.EVENT_PLUGIN_DISABLED, fields)


def installed(**fields: Any) -> None:
    """The instrumentor installed: policy, vllm_version, sites counts."""
    _emit("info", names.EVENT_INSTALLED, fields)


def uninstalled(**fields: Any) -> None:
    """The instrumentor uninstalled."""
    _emit("info", names.EVENT_UNINSTALLED, fields)


def hit_reduced(**fields: Any) -> None:
    """The admission check found a hit whose load set is not loadable:
    check, action (``hit_reduced`` / ``continued`` / ``raised``), request_id, local /
    external / admitted hit tokens, recomputed_tokens, missing_chunks, first_missing."""
    _emit("warning", names.EVENT_HIT_REDUCED, fields)


def wait_bound_exceeded(**fields: Any) -> None:
    """A request's offload wait made no progress within the wait bound
    (:mod:`kvguard.guards.checks.wait_bound`): wait, action, policy, request_id,
    stale_observations, stale_seconds, ready_hit_tokens (a cut lookup)."""
    _emit("warning", names.EVENT_WAIT_BOUND_EXCEEDED, fields)


def vllm_unmeasured(**fields: Any) -> None:
    """The installed vLLM is not a release kvguard was measured on:
    vllm_version, vllm_support, relation (``newer`` / ``older`` / ``unlisted``),
    measured_range, reason. kvguard installed anyway; logged once per process and version."""
    _emit("warning", names.EVENT_VLLM_UNMEASURED, fields)


def check_skipped(**fields: Any) -> None:
    """A check is skipped on a connector scheduler, once per scheduler,
    check and reason: check, reason (:data:`kvguard.guards.names.SKIP_REASONS`), detail
    (what kvguard could not model or read, e.g. the group kind); vLLM's answers pass through."""
    _emit("warning", names.EVENT_CHECK_SKIPPED, fields)
