"""State-dir problems the sidecar met: one meaning for every ``source``.

``kvguard_sidecar_errors_total{source}`` counts *problems first met*: a path that cannot
be read (missing directory, permission denied, not a regular file, too large, corrupt)
counts once when it first shows up with that reason, however many scrapes, polls or
``/status`` calls see it again; a problem that goes away and comes back counts again.
``kvguard_sidecar_unreadable{source}`` is how many paths are unreadable *now* (the last
read of that source), the number the ``KVGuardSidecarBlind`` alert watches.

Sources (a closed set, :data:`SOURCES`):

================  ============================================================
``metrics_dir``   ``$STATE/metrics`` missing, unreadable or not a directory
``metrics_file``  a ``metrics/*.db`` file unreadable, special, too large or corrupt
``fatal_dir``     ``$STATE/fatal`` unreadable or not a directory
``fatal_record``  a ``fatal/*.json`` record unreadable, special, too large or corrupt
``run_record``    ``$STATE/run.json`` unreadable, special or corrupt
``state_dir``     an unexpected error reading the state dir (counted per event)
``poller``        an unexpected error in the health poller (counted per event)
================  ============================================================
"""

from __future__ import annotations

import threading

import structlog

__all__ = ["SOURCES", "ProblemLog"]

SOURCES: tuple[str, ...] = (
    "metrics_dir",
    "metrics_file",
    "fatal_dir",
    "fatal_record",
    "run_record",
    "state_dir",
    "poller",
)
#: At most this many problems per source are kept (and shown in /status).
MAX_PER_SOURCE = 50

log = structlog.get_logger("kvguard.sidecar.problems")


class ProblemLog:
    """Thread-safe record of state-dir problems (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {s: 0 for s in SOURCES}
        self.current: dict[str, dict[str, str]] = {s: {} for s in SOURCES}

    def observe(self, found: dict[str, dict[str, str]]) -> int:
        """Replace the current problems of each source in ``found`` (``{source: {path:
        reason}}``); count those not current before. Returns how many were new."""
        new_total = 0
        with self._lock:
            for source, problems in found.items():
                if source not in self.counts:
                    raise ValueError(f"unknown source {source!r}")
                before = self.current[source]
                new = {p: r for p, r in problems.items() if before.get(p) != r}
                self.counts[source] += len(new)
                new_total += len(new)
                self.current[source] = dict(list(problems.items())[:MAX_PER_SOURCE])
                if new:
                    log.warning("state_dir_unreadable", source=source, problems=dict(list(new.items())[:5]))
        return new_total

    def count(self, source: str, n: int = 1) -> None:
        """Count ``n`` one-off events of ``source`` (``state_dir``, ``poller``)."""
        with self._lock:
            self.counts[source] = self.counts.get(source, 0) + n

    def totals(self) -> dict[str, int]:
        """``{source: problems counted so far}`` for every source."""
        with self._lock:
            return dict(self.counts)

    def unreadable(self) -> dict[str, int]:
        """``{source: paths unreadable now}`` for every source."""
        with self._lock:
            return {s: len(self.current.get(s, {})) for s in SOURCES}

    def listing(self) -> list[tuple[str, str, str]]:
        """The current problems as ``(source, path, reason)``, sorted."""
        with self._lock:
            return sorted((s, p, r) for s, ps in self.current.items() for p, r in ps.items())
