"""Read side of the state dir: Prometheus metric families for one scrape.

:class:`StateDirCollector` is prometheus-client's ``MultiProcessCollector`` made
tolerant: it merges the ``*.db`` files that ``guards/metrics.py`` writes under
``$KVGUARD_STATE_DIR/metrics`` (counters summed across pids, gauges per their
``multiprocess_mode``), and where one file is truncated or corrupt it merges the others
and reports the bad one instead of failing the scrape. :class:`SidecarCollector` adds the
sidecar's own series. The app builds a fresh ``CollectorRegistry`` with both per scrape.

Series served (besides whatever the engine plugin writes):

- ``kvguard_engine_up``                      gauge 1/0: the sidecar's view (/livez)
- ``kvguard_engine_deaths_total``            counter: transitions into "dead"
- ``kvguard_engine_fatal_total{exception}``  counter: fatal EngineCore exceptions. The
  engine plugin counts these in its multiprocess files; the sidecar also counts fatal
  records, and serves the larger of the two per exception, so a record whose counter
  file was lost (or the reverse) is still counted, and nothing is counted twice.
- ``kvguard_build_info{kvguard_version,vllm_version}``  gauge, always 1
- ``kvguard_sidecar_errors_total{source}``   counter: state-dir problems met while
  serving (``metrics_dir`` missing, ``metrics_file`` corrupt, ``fatal_record`` corrupt,
  ``state_dir``, ``poller``)
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from kvguard.guards.statefile import FatalRecord

__all__ = [
    "ENGINE_FATAL",
    "ERROR_SOURCES",
    "SidecarCollector",
    "StateDirCollector",
    "check_counts",
]

#: Family name of the engine fatal counter (prometheus-client strips ``_total``).
ENGINE_FATAL = "kvguard_engine_fatal"
#: Closed set of ``kvguard_sidecar_errors_total{source}`` values.
ERROR_SOURCES = ("metrics_dir", "metrics_file", "fatal_record", "state_dir", "poller")


class StateDirCollector(Collector):
    """Merge the multiprocess files in ``path``.

    Raises ``ValueError`` at construction when ``path`` is not a directory (as
    ``MultiProcessCollector``). :meth:`collect` never raises: a file that cannot be read
    is left out and listed in ``bad_files`` (``"<name>: <error>"``).
    """

    def __init__(self, path: Path | str) -> None:
        self.path = str(path)
        if not os.path.isdir(self.path):
            raise ValueError(f"metrics dir {self.path!r} is not a directory")
        self.bad_files: list[str] = []

    @staticmethod
    def _check_header(path: str) -> None:
        """``mmap_dict``'s layout starts with a 4-byte little-endian ``used`` count that
        includes the 8-byte header; a value outside ``8..file size`` is corruption that
        the library would silently read as "no samples"."""
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(4)
        if len(head) < 4:
            raise ValueError(f"truncated header ({size} bytes)")
        used = int.from_bytes(head, "little", signed=True)
        if not 8 <= used <= size:
            raise ValueError(f"used={used} outside 8..{size}")

    def collect(self) -> Iterator[Metric]:
        good = []
        for f in sorted(glob.glob(os.path.join(self.path, "*.db"))):
            try:
                self._check_header(f)
                # Parse this file alone: a bad one must not sink the others.
                MultiProcessCollector._read_metrics([f])
                good.append(f)
            except FileNotFoundError:
                continue  # a live gauge file removed by mark_process_dead meanwhile
            except Exception as e:
                self.bad_files.append(f"{os.path.basename(f)}: {type(e).__name__}: {e}")
        try:
            metrics = list(MultiProcessCollector.merge(good, accumulate=True))
        except Exception as e:  # pragma: no cover - files changed between check and merge
            self.bad_files.append(f"*: {type(e).__name__}: {e}")
            metrics = []
        yield from metrics


def check_counts(families: Iterable[Metric]) -> dict[str, dict[str, float]]:
    """Counts by check name from merged families:
    ``{check: {"evaluated": n, "tolerated": n, "violations": n}}`` (violations summed over
    ``action``). Families that are absent give no keys."""
    wanted = {
        "kvguard_check_evaluations_total": "evaluated",
        "kvguard_check_tolerated_total": "tolerated",
        "kvguard_invariant_violations_total": "violations",
    }
    out: dict[str, dict[str, float]] = {}
    for fam in families:
        for s in fam.samples:
            key = wanted.get(s.name)
            check = s.labels.get("check")
            if key is None or check is None:
                continue
            row = out.setdefault(check, {"evaluated": 0.0, "tolerated": 0.0, "violations": 0.0})
            row[key] += s.value
    return out


def merge_fatal(engine: Metric | None, records: Iterable[FatalRecord]) -> CounterMetricFamily:
    """One ``kvguard_engine_fatal_total{exception}`` family: per exception, the larger of
    the engine's own counter and the number of fatal records."""
    counts: dict[str, float] = {}
    for r in records:
        counts[r.exception] = counts.get(r.exception, 0.0) + 1.0
    if engine is not None:
        for s in engine.samples:
            if s.name == ENGINE_FATAL + "_total" and "exception" in s.labels:
                exc = s.labels["exception"]
                counts[exc] = max(counts.get(exc, 0.0), s.value)
    fam = CounterMetricFamily(
        ENGINE_FATAL,
        "Fatal EngineCore exceptions, by exception type (vLLM #48966).",
        labels=["exception"],
    )
    for exc, n in sorted(counts.items()):
        fam.add_metric([exc], n)
    return fam


class SidecarCollector(Collector):
    """The sidecar's own series, from a ``view()`` callable returning
    ``(engine_up, deaths, fatal_records, errors_by_source, kvguard_version, vllm_version)``.

    ``engine_fatal`` is the engine's own fatal family (from :class:`StateDirCollector`),
    merged by :func:`merge_fatal`.
    """

    def __init__(
        self,
        view: Callable[[], tuple[bool, int, list[FatalRecord], dict[str, int], str, str]],
        engine_fatal: Metric | None = None,
    ) -> None:
        self.view = view
        self.engine_fatal = engine_fatal

    def collect(self) -> Iterator[Metric]:
        up, deaths, records, errors, kv_version, vllm_version = self.view()
        yield GaugeMetricFamily(
            "kvguard_engine_up",
            "1 while vLLM answers /health with 200 and no fatal EngineCore record appeared.",
            value=1.0 if up else 0.0,
        )
        yield CounterMetricFamily(
            "kvguard_engine_deaths",
            "Times the engine went from up (or starting) to dead, as seen by the sidecar.",
            value=float(deaths),
        )
        yield merge_fatal(self.engine_fatal, records)
        info = GaugeMetricFamily(
            "kvguard_build_info",
            "kvguard and vLLM versions; always 1.",
            labels=["kvguard_version", "vllm_version"],
        )
        info.add_metric([kv_version, vllm_version], 1.0)
        yield info
        err = CounterMetricFamily(
            "kvguard_sidecar_errors",
            "State-dir problems met by the sidecar (it serves what it can).",
            labels=["source"],
        )
        for source in ERROR_SOURCES:
            err.add_metric([source], float(errors.get(source, 0)))
        yield err
