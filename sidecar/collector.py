"""Read side of the state dir: Prometheus metric families for one scrape.

:func:`read_metrics_dir` is prometheus-client's ``MultiProcessCollector`` made tolerant
and safe: it reads each ``*.db`` file under ``$KVGUARD_STATE_DIR/metrics`` exactly once
(bounded, regular files only, never following a symlink, never blocking on a FIFO),
merges them as the library does (counters summed across pids, gauges per their
``multiprocess_mode``), and where one file is truncated, corrupt, unreadable, special or
semantically bad it merges the others and reports the bad one (a
:class:`~kvguard.sidecar.problems.Problem` with a ``reason``) instead of failing the
scrape. A zero-byte file, or one whose header is still 0, is a file prometheus-client is
creating: skipped, not an error. :class:`SidecarCollector` adds the sidecar's own series.

Series served (besides whatever the engine plugin writes):

- ``kvguard_engine_up``                      gauge 1/0: the sidecar's view (/livez)
- ``kvguard_engine_state{state}``            gauge: 1 for the current state (``starting``,
  ``up``, ``dead``, ``stopped``), 0 for the others (:mod:`kvguard.sidecar.health`)
- ``kvguard_engine_startup_budget_seconds``  gauge: how long ``starting`` may last
- ``kvguard_engine_deaths_total``            counter: transitions into "dead"
- ``kvguard_engine_fatal_total{exception}``  counter: fatal EngineCore exceptions. The
  engine plugin counts these in its multiprocess files; the sidecar also counts fatal
  records, and serves the larger of the two per exception, so a record whose counter
  file was lost (or the reverse) is still counted, and nothing is counted twice. The
  common exception types (:data:`PRECREATED_EXCEPTIONS`) exist at 0 from the start, so
  ``increase()`` sees their first event.
- ``kvguard_build_info{kvguard_version,vllm_version,vllm_support}``  gauge, always 1;
  ``vllm_support``: ``measured``, ``unmeasured`` or ``unknown``
  (:func:`kvguard.guards.hooking.sites.vllm_support` of ``vllm_version``, )
- ``kvguard_sidecar_errors_total{source,reason}``  counter: state-dir problems first met
- ``kvguard_sidecar_unreadable{source,reason}``    gauge: state-dir paths unusable now
  (:mod:`kvguard.sidecar.problems`)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.metrics import Gauge
from prometheus_client.mmap_dict import _read_all_values
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from kvguard.guards import names
from kvguard.guards.telemetry.statefile import FatalRecord, StateFileError, open_regular, os_error_reason
from kvguard.sidecar.problems import SOURCES, Problem, series

__all__ = [
    "ENGINE_FATAL",
    "ENGINE_STATES",
    "ERROR_SOURCES",
    "MAX_CACHED_KEYS",
    "MAX_DB_BYTES",
    "PRECREATED_EXCEPTIONS",
    "SIDECAR_METRICS",
    "Families",
    "KeyVerdicts",
    "SidecarCollector",
    "SidecarView",
    "StateDirCollector",
    "check_counts",
    "wait_counts",
    "describe_error",
    "judge_key",
    "read_metrics_dir",
    "with_zero_counters",
]

#: Family name of the engine fatal counter (prometheus-client strips ``_total``).
ENGINE_FATAL = "kvguard_engine_fatal"
#: Closed set of the ``source`` label of ``kvguard_sidecar_errors_total`` and ``kvguard_sidecar_unreadable``.
ERROR_SOURCES = SOURCES
#: Values of ``kvguard_engine_state{state}``.
ENGINE_STATES = ("starting", "up", "dead", "stopped")
#: ``kvguard_engine_fatal_total{exception}`` series that exist at 0 from the first scrape.
PRECREATED_EXCEPTIONS = (
    "AssertionError",
    "RuntimeError",
    "EngineDeadError",
    "OutOfMemoryError",
    "ValueError",
    "KeyError",
    "IndexError",
    "TypeError",
    "AttributeError",
)
#: Series names the sidecar itself exports (the alert and dashboard tests check against them).
SIDECAR_METRICS = (
    "kvguard_engine_up",
    "kvguard_engine_state",
    "kvguard_engine_startup_budget_seconds",
    "kvguard_engine_deaths_total",
    "kvguard_engine_fatal_total",
    "kvguard_build_info",
    names.METRIC_SIDECAR_ERRORS,
    names.METRIC_SIDECAR_UNREADABLE,
)
#: A multiprocess file larger than this is not read (prometheus-client files start at
#: 64 KiB and double when full; kvguard's hold a few hundred series).
MAX_DB_BYTES = 16 * 1024 * 1024
#: :class:`KeyVerdicts` forgets everything when it holds more keys than this (kvguard's
#: files share a few hundred distinct keys; a flood of distinct keys costs a re-judging,
#: never unbounded memory).
MAX_CACHED_KEYS = 16384
_PAGE = 4096
#: The gauge ``multiprocess_mode`` values prometheus-client writes (its own table): a
#: gauge file named with another mode was not written by it.
_GAUGE_MODES = frozenset(Gauge._MULTIPROC_MODES)
_DETAIL_CHARS = 200


class _Skip(Exception):
    """A file being created (zero bytes, or header still 0): not an error."""


class Families(Collector):
    """A ``Collector`` over a fixed list of metric families (for throwaway registries)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def describe_error(e: BaseException) -> str:
    """``"<Type>: <first arg>"`` of an exception, at most :data:`_DETAIL_CHARS` characters
    (``generate_latest`` appends the whole family to an exception's args): a problem's
    ``detail``."""
    first = e.args[0] if e.args else ""
    return f"{type(e).__name__}: {first}"[:_DETAIL_CHARS]


def _read_db(dir_fd: int, name: str) -> tuple[bytes, int]:
    """One multiprocess file's used bytes and ``used`` count, read once and bounded."""
    fd, st = open_regular(name, dir_fd=dir_fd)
    try:
        size = st.st_size
        if size == 0:
            raise _Skip
        if size > MAX_DB_BYTES:
            raise StateFileError(f"{size} bytes, more than {MAX_DB_BYTES}", kind=names.REASON_TOO_LARGE)
        data = os.read(fd, _PAGE)
        if len(data) < 8:
            raise StateFileError(f"truncated header ({size} bytes)")
        used = int.from_bytes(data[:4], "little", signed=True)
        if used == 0:
            raise _Skip
        if not 8 <= used <= size:
            raise StateFileError(f"corrupt header: used={used} outside 8..{size}")
        while len(data) < used:
            more = os.read(fd, used - len(data))
            if not more:
                raise StateFileError(f"file shrank below used={used}")
            data += more
        return data, used
    finally:
        os.close(fd)


def _add_rows(metrics: dict[str, Metric], typ: str, mode: str | None, pid: str | None, rows: list) -> None:
    """``MultiProcessCollector._read_metrics`` from the point where one file's values are
    read: each ``((metric, sample, labels_key, help), value, timestamp)`` row becomes a
    sample of its family in ``metrics`` (created with the file's type; a gauge's samples
    get the ``pid`` label and the family the file's mode). The per-key check
    (:func:`judge_key`) and the merge both call this, so they cannot drift apart."""
    for (metric_name, sample, labels_key, help_text), value, timestamp in rows:
        metric = metrics.get(metric_name)
        if metric is None:
            metric = metrics[metric_name] = Metric(metric_name, help_text, typ)
        if typ == "gauge":
            metric._multiprocess_mode = mode  # type: ignore[attr-defined]
            metric.add_sample(sample, labels_key + (("pid", pid),), value, timestamp)
        else:
            metric.add_sample(sample, labels_key, value)


def judge_key(typ: str, mode: str | None, key: str) -> tuple[tuple | None, Problem | None]:
    """Run one multiprocess key through every step from the file to the exposition.

    ``typ`` and ``mode`` come from the file's name (``counter``, ``gauge`` + ``max``, ...),
    ``key`` is one entry's JSON key as prometheus-client's ``mmap_key`` writes it
    (``[metric, sample, {label: value}, help]``). Returns ``(parsed, None)`` with
    ``parsed = (metric, sample, sorted label items, help)``, or ``(None, Problem)`` naming
    the first step that failed: ``corrupt`` (not that JSON shape), ``invalid_family``
    (building the ``Metric``: a type or metric name prometheus-client refuses),
    ``invalid_sample`` (``MultiProcessCollector._accumulate_metrics``: a histogram ``le``
    that is not a number, an unhashable label value), ``unrenderable``
    (``generate_latest``: a help text or label value that is not a string). Never raises.

    Why per key, with prometheus-client's own code rather than a schema of ours: the
    merge and the exposition of a scrape are one pass over every file, so one bad entry
    made every ``/metrics`` and ``/status`` answer 500. The library's steps are what the
    scrape runs; a sample's value and timestamp are always floats (the file stores them as
    doubles) and no step depends on them, so a key that passes alone passes in the merge
    (families of one type only: :func:`read_metrics_dir` rejects a file whose family has
    another type in an earlier file). The verdict depends on ``(typ, mode, key)`` only,
    so :class:`KeyVerdicts` keeps it across scrapes: each distinct key is judged once (a
    one-sample family built, accumulated and rendered: about 45 us), and a scrape of
    files already seen costs one dict lookup per entry, as the old per-scrape key cache
    did. On ``bench/sidecar_bench.py``'s 192 files (105 distinct keys) a scrape of known
    keys cost 0.90 to 1.03 of the code before this check, one in which every key is new
    (the first) 1.05 to 1.18 (docs/sidecar.md)."""
    try:
        metric_name, sample, labels, help_text = json.loads(key)
        parsed = (metric_name, sample, tuple(sorted(labels.items())), help_text)
    except Exception as e:
        return None, Problem(names.REASON_CORRUPT, f"key {key[:80]!r} is not [metric, sample, labels, help]: {describe_error(e)}"[:_DETAIL_CHARS])
    metrics: dict[str, Metric] = {}
    try:
        _add_rows(metrics, typ, mode, "0", [(parsed, 0.0, 0.0)])
    except Exception as e:
        return None, Problem(names.REASON_INVALID_FAMILY, describe_error(e))
    try:
        families = list(MultiProcessCollector._accumulate_metrics(metrics, True))
    except Exception as e:
        return None, Problem(names.REASON_INVALID_SAMPLE, describe_error(e))
    try:
        generate_latest(Families(families))
    except Exception as e:
        return None, Problem(names.REASON_UNRENDERABLE, describe_error(e))
    return parsed, None


class KeyVerdicts:
    """:func:`judge_key`'s verdicts, kept across scrapes: ``{(typ, mode): {key: (parsed,
    problem)}}``, at most :data:`MAX_CACHED_KEYS` keys (then it starts over). Not
    thread-safe: one scrape at a time (the :class:`~kvguard.sidecar.app.Scraper` runs
    them under a limiter of one)."""

    def __init__(self, limit: int = MAX_CACHED_KEYS) -> None:
        self.limit = limit
        self._tables: dict[tuple[str, str | None], dict[str, tuple]] = {}
        self._size = 0
        #: keys judged so far (each is judged once while cached)
        self.judged = 0

    def table(self, typ: str, mode: str | None) -> dict[str, tuple]:
        """The verdicts of keys in files of type ``typ`` and gauge mode ``mode``."""
        t = self._tables.get((typ, mode))
        if t is None:
            t = self._tables[(typ, mode)] = {}
        return t

    def judge(self, table: dict[str, tuple], typ: str, mode: str | None, key: str) -> tuple:
        """Judge ``key`` (:func:`judge_key`) and remember the verdict in ``table``."""
        if self._size >= self.limit:
            self._tables = {(typ, mode): table}
            table.clear()
            self._size = 0
        verdict = table[key] = judge_key(typ, mode, key)
        self._size += 1
        self.judged += 1
        return verdict


def read_metrics_dir(
    path: Path | str, verdicts: KeyVerdicts | None = None
) -> tuple[list[Metric], dict[str, dict[str, Problem]]]:
    """Merge the multiprocess files in ``path``, each read and parsed once.

    Returns ``(families, problems)`` where ``problems`` is ``{"metrics_dir": {...},
    "metrics_file": {...}}`` (``{name: Problem}``). A file is left out of the merge, whole,
    when it cannot be read (``permission_denied``, ``not_regular``, ``too_large``,
    ``io_error``), is corrupt (``corrupt``), is a gauge file whose name lacks a mode
    prometheus-client writes (``invalid_family``), holds a key that fails a step to the
    exposition (:func:`judge_key`), or holds a family that an earlier file (in name order)
    holds with another type (``invalid_family``). ``verdicts``: the key verdicts to reuse
    (a fresh :class:`KeyVerdicts` when ``None``). Never raises.
    """
    problems: dict[str, dict[str, Problem]] = {"metrics_dir": {}, "metrics_file": {}}
    if verdicts is None:
        verdicts = KeyVerdicts()
    path = str(path)
    try:
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        problems["metrics_dir"]["metrics/"] = Problem(os_error_reason(e), f"{type(e).__name__}: {e.strerror or e}")
        return [], problems
    try:
        try:
            names_ = sorted(n for n in os.listdir(dir_fd) if n.endswith(".db"))
        except OSError as e:
            problems["metrics_dir"]["metrics/"] = Problem(os_error_reason(e), f"{type(e).__name__}: {e.strerror or e}")
            return [], problems
        bad = problems["metrics_file"]
        metrics: dict[str, Metric] = {}
        family_types: dict[str, str] = {}
        for name in names_:
            parts = name.split("_")
            typ = parts[0]
            mode = pid = None
            if typ == "gauge":
                if len(parts) < 3 or parts[1] not in _GAUGE_MODES:
                    bad[name] = Problem(names.REASON_INVALID_FAMILY, "gauge file name without a multiprocess mode")
                    continue
                mode, pid = parts[1], parts[2][:-3]
            try:
                data, used = _read_db(dir_fd, name)
            except _Skip:
                continue
            except FileNotFoundError:
                continue  # removed since the listing (a dead process's live gauge)
            except OSError as e:
                bad[name] = Problem(os_error_reason(e), f"{type(e).__name__}: {e.strerror or e}")
                continue
            except StateFileError as e:
                bad[name] = Problem(e.kind, str(e))
                continue
            table = verdicts.table(typ, mode)
            rows = []
            problem: Problem | None = None
            try:
                for key, value, timestamp, _ in _read_all_values(data, used):
                    verdict = table.get(key)
                    if verdict is None:
                        verdict = verdicts.judge(table, typ, mode, key)
                    parsed, problem = verdict
                    if problem is not None:
                        break
                    rows.append((parsed, value, timestamp))
            except Exception as e:  # the entries' layout: a length past `used`, a key not UTF-8
                problem = Problem(names.REASON_CORRUPT, describe_error(e))
            in_file = {row[0][0] for row in rows}
            if problem is None:
                for metric_name in in_file:
                    other = family_types.get(metric_name, typ)
                    if other != typ:
                        problem = Problem(
                            names.REASON_INVALID_FAMILY,
                            f"family {metric_name!r} is a {typ} here and a {other} in an earlier file"[:_DETAIL_CHARS],
                        )
                        break
            if problem is not None:
                bad[name] = problem
                continue
            for metric_name in in_file:
                family_types.setdefault(metric_name, typ)
            _add_rows(metrics, typ, mode, pid, rows)
        try:
            return list(MultiProcessCollector._accumulate_metrics(metrics, True)), problems
        except Exception as e:  # pragma: no cover - every key was accumulated alone (judge_key)
            problems["metrics_dir"]["metrics/"] = Problem(names.REASON_UNEXPECTED, "merging the files: " + describe_error(e))
            return [], problems
    finally:
        os.close(dir_fd)


class StateDirCollector(Collector):
    """A ``Collector`` over :func:`read_metrics_dir` (for registries and tests).

    Raises ``ValueError`` at construction when ``path`` is not a directory (as
    ``MultiProcessCollector``). :meth:`collect` never raises: a file that cannot be read
    is left out and listed in ``bad_files`` (``"<name>: <reason>: <detail>"``).
    """

    def __init__(self, path: Path | str) -> None:
        self.path = str(path)
        if not os.path.isdir(self.path):
            raise ValueError(f"metrics dir {self.path!r} is not a directory")
        self.bad_files: list[str] = []

    def collect(self) -> Iterator[Metric]:
        families, problems = read_metrics_dir(self.path)
        for name, why in sorted({**problems["metrics_dir"], **problems["metrics_file"]}.items()):
            self.bad_files.append(f"{name}: {why.reason}: {why.detail}")
        yield from families


def _engine_counters() -> list[tuple[str, str, tuple[str, ...], list[tuple[str, ...]]]]:
    """(family, help, label names, label values) of the engine's counters over closed
    label sets (:mod:`kvguard.guards.names`), which the sidecar serves at 0 until the
    plugin's files hold them."""
    from kvguard.guards import names as n

    return [
        ("kvguard_check_evaluations", "Evaluations of kvguard's exact-invariant checks.",
         (n.LABEL_CHECK,), [(c,) for c in n.CHECKS]),
        ("kvguard_check_tolerated", "vLLM assertions that would have failed while the exact invariant held (continued).",
         (n.LABEL_CHECK,), [(c,) for c in n.CHECKS]),
        ("kvguard_invariant_violations", "Check failures that were not tolerated, by check and the action taken.",
         (n.LABEL_CHECK, n.LABEL_ACTION), [(c, a) for c in n.CHECKS for a in n.ACTIONS]),
        ("kvguard_guard_errors", "Exceptions raised inside kvguard code (the original vLLM path ran).",
         (n.LABEL_STAGE,), [(st,) for st in n.STAGES]),
        ("kvguard_wait_bound_exceeded",
         "Requests whose offload wait made no progress within the wait bound, by wait kind and the action taken.",
         (n.LABEL_WAIT, n.LABEL_ACTION), [(w, a) for w in n.WAITS for a in n.ACTIONS]),
    ]


def with_zero_counters(families: list[Metric]) -> list[Metric]:
    """``families`` plus, at 0, every engine counter series over a closed label set that
    they lack, so that an alert's ``increase()`` sees the very first event even when the
    sidecar is scraped before vLLM loaded the plugin (an alert's first event)."""
    by_name = {f.name: f for f in families}
    out = list(families)
    for name, help_text, labelnames, values in _engine_counters():
        fam = by_name.get(name)
        have = set()
        if fam is not None:
            have = {tuple(s.labels.get(l, "") for l in labelnames) for s in fam.samples if s.name == name + "_total"}
        missing = [v for v in values if v not in have]
        if not missing:
            continue
        if fam is None:
            fam = CounterMetricFamily(name, help_text, labels=list(labelnames))
            out.append(fam)
            for v in missing:
                fam.add_metric(list(v), 0.0)
        else:
            from prometheus_client.samples import Sample

            copy = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            copy.samples = list(fam.samples) + [
                Sample(name + "_total", dict(zip(labelnames, v)), 0.0) for v in missing
            ]
            out[out.index(fam)] = copy
    return out


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


def wait_counts(families: Iterable[Metric]) -> dict[str, dict[str, float]]:
    """Waits the wait bound ended (or counted, under observe) from merged families:
    ``{wait: {action: n}}`` of ``kvguard_wait_bound_exceeded_total`` (guards/checks/wait_bound.py),
    only the non-zero series."""
    out: dict[str, dict[str, float]] = {}
    for fam in families:
        for s in fam.samples:
            if s.name != "kvguard_wait_bound_exceeded_total" or not s.value:
                continue
            wait, action = s.labels.get("wait"), s.labels.get("action")
            if wait is None or action is None:
                continue
            row = out.setdefault(wait, {})
            row[action] = row.get(action, 0.0) + s.value
    return out


def merge_fatal(engine: Metric | None, records: Iterable[FatalRecord]) -> CounterMetricFamily:
    """One ``kvguard_engine_fatal_total{exception}`` family: per exception, the larger of
    the engine's own counter and the number of fatal records; the
    :data:`PRECREATED_EXCEPTIONS` at least 0."""
    counts: dict[str, float] = {exc: 0.0 for exc in PRECREATED_EXCEPTIONS}
    by_records: dict[str, float] = {}
    for r in records:
        by_records[r.exception] = by_records.get(r.exception, 0.0) + 1.0
    for exc, n in by_records.items():
        counts[exc] = max(counts.get(exc, 0.0), n)
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


@dataclass(frozen=True)
class SidecarView:
    """What :class:`SidecarCollector` exports, taken at one moment."""

    state: str
    deaths: int
    fatal_records: tuple[FatalRecord, ...]
    #: ``{(source, reason): problems counted}`` and ``{(source, reason): paths unusable now}``
    #: (:class:`kvguard.sidecar.problems.ProblemLog`); a pair of
    #: :func:`kvguard.sidecar.problems.series` that is absent is served as 0
    errors: dict[tuple[str, str], int]
    unreadable: dict[tuple[str, str], int]
    kvguard_version: str
    vllm_version: str
    startup_budget: float | None = None

    @property
    def up(self) -> bool:
        return self.state == "up"


class SidecarCollector(Collector):
    """The sidecar's own series, from a ``view()`` callable returning a :class:`SidecarView`.

    ``engine_fatal`` is the engine's own fatal family (from :func:`read_metrics_dir`),
    merged by :func:`merge_fatal`.
    """

    def __init__(self, view: Callable[[], SidecarView], engine_fatal: Metric | None = None) -> None:
        self.view = view
        self.engine_fatal = engine_fatal

    def collect(self) -> Iterator[Metric]:
        v = self.view()
        yield GaugeMetricFamily(
            "kvguard_engine_up",
            "1 while vLLM answers /health with 200 and no fatal EngineCore record appeared.",
            value=1.0 if v.up else 0.0,
        )
        st = GaugeMetricFamily(
            "kvguard_engine_state",
            "1 for the engine's current state (starting, up, dead, stopped), else 0.",
            labels=["state"],
        )
        for name in ENGINE_STATES:
            st.add_metric([name], 1.0 if v.state == name else 0.0)
        yield st
        if v.startup_budget is not None:
            yield GaugeMetricFamily(
                "kvguard_engine_startup_budget_seconds",
                "Seconds the engine may stay starting (loading its model) before it counts as dead.",
                value=float(v.startup_budget),
            )
        yield CounterMetricFamily(
            "kvguard_engine_deaths",
            "Times the engine went from up (or starting) to dead, as seen by the sidecar.",
            value=float(v.deaths),
        )
        yield merge_fatal(self.engine_fatal, v.fatal_records)
        # stdlib-only (packaging is imported lazily by the function): the declared support
        # of the vLLM version served here, the plugin's own rule
        from kvguard.guards.hooking.sites import vllm_support

        info = GaugeMetricFamily(
            "kvguard_build_info",
            "kvguard and vLLM versions, and whether kvguard was measured on that vLLM release; always 1.",
            labels=["kvguard_version", "vllm_version", "vllm_support"],
        )
        info.add_metric([v.kvguard_version, v.vllm_version, vllm_support(v.vllm_version)], 1.0)
        yield info
        pairs = series()
        pairs += sorted((set(v.errors) | set(v.unreadable)) - set(pairs))
        err = CounterMetricFamily(
            names.METRIC_SIDECAR_ERRORS.removesuffix("_total"),
            "State-dir problems the sidecar met, by source and reason, each counted once when first met "
            "(it serves what it can).",
            labels=[names.LABEL_SOURCE, names.LABEL_REASON],
        )
        for pair in pairs:
            err.add_metric(list(pair), float(v.errors.get(pair, 0)))
        yield err
        unread = GaugeMetricFamily(
            names.METRIC_SIDECAR_UNREADABLE,
            "State-dir paths the sidecar cannot use now, by source and reason (it is blind to them).",
            labels=[names.LABEL_SOURCE, names.LABEL_REASON],
        )
        for pair in pairs:
            unread.add_metric(list(pair), float(v.unreadable.get(pair, 0)))
        yield unread
