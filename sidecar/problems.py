"""State-dir problems the sidecar met: one meaning for every ``source`` and ``reason``.

``kvguard_sidecar_errors_total{source,reason}`` counts *problems first met*: a path that
cannot be used (missing directory, permission denied, not a regular file, too large,
corrupt, semantically bad) counts once when it first shows up with that reason, however
many scrapes, polls or ``/status`` calls see it again; a problem that goes away and comes
back, or whose reason changes, counts again. ``kvguard_sidecar_unreadable{source,reason}``
is how many paths are unusable *now* (the last read of that source); the
``KVGuardSidecarBlind`` alert watches their sum.

Sources (a closed set, :data:`kvguard.guards.names.SIDECAR_SOURCES`):

================  ============================================================
``metrics_dir``   ``$STATE/metrics`` missing (after the start-up grace), unreadable or
                  not a directory
``metrics_file``  a ``metrics/*.db`` file unreadable, special, too large, corrupt, or one
                  that parses but fails a step from the file to the exposition
``fatal_dir``     ``$STATE/fatal`` unreadable or not a directory
``fatal_record``  a ``fatal/*.json`` record unreadable, special, too large, corrupt, or
                  untrustworthy (a field the writer never writes, a time in the future)
``run_record``    ``$STATE/run.json`` unreadable, special, corrupt, oversized or from the future
``state_dir``     an unexpected error reading the state dir (counted per event)
``poller``        an unexpected error in the health poller (counted per event)
================  ============================================================

Reasons are the closed set :data:`kvguard.guards.names.SIDECAR_REASONS` (labels never carry
free text); each problem also has a ``detail`` (free text) for ``/status`` and the log.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import structlog

from kvguard.guards import names

__all__ = ["SOURCES", "Problem", "ProblemLog", "series"]

SOURCES: tuple[str, ...] = names.SIDECAR_SOURCES
#: At most this many problems per source are kept (and shown in /status).
MAX_PER_SOURCE = 50

log = structlog.get_logger("kvguard.sidecar.problems")


class Problem(NamedTuple):
    """Why one path cannot be used: ``reason`` (a label value from
    :data:`kvguard.guards.names.SIDECAR_REASONS`) and ``detail`` (free text, never a label)."""

    reason: str
    detail: str


def series() -> list[tuple[str, str]]:
    """The ``(source, reason)`` pairs that exist at 0 from the first scrape, in order."""
    return [(s, r) for s in SOURCES for r in names.SIDECAR_SOURCE_REASONS[s]]


class ProblemLog:
    """Thread-safe record of state-dir problems (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[tuple[str, str], int] = {pair: 0 for pair in series()}
        self.current: dict[str, dict[str, Problem]] = {s: {} for s in SOURCES}

    def observe(self, found: dict[str, dict[str, Problem]]) -> int:
        """Replace the current problems of each source in ``found`` (``{source: {path:
        Problem}}``); count those not current before with the same reason. Returns how
        many were new. Raises ``ValueError`` for a source or reason outside the closed sets
        (a bug in the sidecar, not a state-dir problem)."""
        new_total = 0
        with self._lock:
            for source, problems in found.items():
                if source not in self.current:
                    raise ValueError(f"unknown source {source!r}")
                for p in problems.values():
                    if p.reason not in names.SIDECAR_REASONS:
                        raise ValueError(f"unknown reason {p.reason!r}")
                before = self.current[source]
                new = {path: p for path, p in problems.items() if path not in before or before[path].reason != p.reason}
                for p in new.values():
                    self.counts[(source, p.reason)] = self.counts.get((source, p.reason), 0) + 1
                new_total += len(new)
                self.current[source] = dict(list(problems.items())[:MAX_PER_SOURCE])
                if new:
                    log.warning(
                        "state_dir_unreadable",
                        source=source,
                        problems={path: f"{p.reason}: {p.detail}" for path, p in list(new.items())[:5]},
                    )
        return new_total

    def count(self, source: str, n: int = 1, reason: str = names.REASON_UNEXPECTED) -> None:
        """Count ``n`` one-off events of ``source`` (``state_dir``, ``poller``)."""
        with self._lock:
            self.counts[(source, reason)] = self.counts.get((source, reason), 0) + n

    def totals(self) -> dict[str, int]:
        """``{source: problems counted so far}`` for every source (all reasons)."""
        with self._lock:
            out = {s: 0 for s in SOURCES}
            for (s, _), n in self.counts.items():
                out[s] = out.get(s, 0) + n
            return out

    def by_reason(self) -> dict[tuple[str, str], int]:
        """``{(source, reason): problems counted so far}``: every pair of :func:`series`,
        plus any other pair met."""
        with self._lock:
            return dict(self.counts)

    def unreadable(self) -> dict[tuple[str, str], int]:
        """``{(source, reason): paths unusable now}``: every pair of :func:`series` (0 when
        none), plus any other pair current now."""
        with self._lock:
            out = {pair: 0 for pair in series()}
            for s, ps in self.current.items():
                for p in ps.values():
                    out[(s, p.reason)] = out.get((s, p.reason), 0) + 1
            return out

    def listing(self) -> list[tuple[str, str, str, str]]:
        """The current problems as ``(source, path, reason, detail)``, sorted."""
        with self._lock:
            return sorted((s, path, p.reason, p.detail) for s, ps in self.current.items() for path, p in ps.items())
