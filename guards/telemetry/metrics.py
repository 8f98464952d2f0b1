"""kvguard's Prometheus metrics; the only prometheus_client user in ``guards``.

Two backends behind one interface (:class:`GuardMetrics`):

- **state dir** (``KVGUARD_STATE_DIR`` set): prometheus-client *multiprocess* files in
  ``$KVGUARD_STATE_DIR/metrics/`` (``counter_<pid>-<ms>.db``, ``gauge_max_<pid>-<ms>.db``,
  ``histogram_<pid>-<ms>.db``; ``<ms>``: unix milliseconds when this process opened its
  files, so a restarted container whose EngineCore gets the same pid never inherits the
  old process's counts: each process's counters stay apart and the sidecar sums them),
  written with ``prometheus_client.mmap_dict.MmapedDict`` and the library's own key
  format, so the sidecar reads them with ``MultiProcessCollector(registry, path=...)``.
  Files are mode ``0o644`` and the directory ``0o2775`` whatever the umask, so the
  sidecar's user (another uid, same ``fsGroup``) can read them. The directory is
  explicit: kvguard never sets ``PROMETHEUS_MULTIPROC_DIR`` inside vLLM (vLLM uses
  prometheus_client itself). Like ``MmapedValue``, the pid is re-checked on every write
  and the files are reopened after a fork.
- **in-process**: ordinary ``Counter``/``Gauge``/``Histogram`` objects on a registry
  (prometheus_client's default ``REGISTRY`` unless one is given).

Every child over the closed label sets of :mod:`kvguard.guards.names` is created up front, so
each series exists (at 0) from the first scrape. Label values outside those sets raise
``ValueError`` (callers in ``kvguard.guards.policy.runtime`` turn that into a guard-error count).

No Prometheus write on a check's path (issue 31)
------------------------------------------------

A check that counts on vLLM's path (an evaluation, a tolerated failure, a skipped lookup)
adds to a plain dict of this process's counts (one update under the GIL, no lock; the
label values are tested against the closed sets); nothing there builds a prometheus label
set, finds a child or writes an mmap file (17 us of a 66 us store check, measured in place
on 3 Dec 2026). A flush publishes what was counted since the last one
(:meth:`GuardMetrics.flush`):

- every :data:`FLUSH_INTERVAL_S` seconds, from one daemon thread for the whole process
  (started on the first increment, so a flush never waits for a next event);
- at once, on the thread that counts it, for a ``raised`` violation (the engine may be
  dying) and before a fatal record (:mod:`kvguard.guards.policy.fatal` counts
  :meth:`GuardMetrics.engine_fatal` first, which runs :func:`flush_all`: a fatal record's
  counters are never lost);
- at process exit: ``atexit`` (the main process, a ``spawn``-started EngineCore or worker,
  which leaves through ``sys.exit``) and ``multiprocessing``'s exit finalizers (a
  ``fork``-started child leaves through ``os._exit`` after running them);
- before each collection of an in-process registry (a collector registered first on it
  flushes: :class:`_FlushOnCollect`).

Fork: a child starts with no pending increments (the parent publishes its own), new
locks (one held by the parent's flusher at the fork would never be released) and no
flusher thread (the first increment starts its own). A ``SIGKILL`` (an OOM kill, a
liveness kill) runs no code: at most the last :data:`FLUSH_INTERVAL_S` of evaluations and
tolerated failures are lost then; a check that raised was published before it raised.

=========================================================  =========  ==========================
metric                                                     type       labels
=========================================================  =========  ==========================
``kvguard_check_evaluations_total``                        counter    ``check``
``kvguard_check_tolerated_total``                          counter    ``check``
``kvguard_invariant_violations_total``                     counter    ``check``, ``action``
``kvguard_guard_errors_total``                             counter    ``stage``
``kvguard_swa_pending_bound_ratio``                        histogram  (pending / exact bound)
``kvguard_site_installed``  (multiprocess_mode ``max``)    gauge      ``site``
``kvguard_engine_fatal_total``                             counter    ``exception``
``kvguard_recomputed_tokens_total``                        counter    ``check``
``kvguard_check_skipped_total``                            counter    ``check``, ``reason``
``kvguard_wait_bound_exceeded_total``                      counter    ``wait``, ``action``
=========================================================  =========  ==========================
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from kvguard.guards import names
from kvguard.guards.site_registry import known_site_ids

__all__ = ["GuardMetrics", "get_metrics", "flush_all", "FLUSH_INTERVAL_S", "SWA_RATIO_BUCKETS",
           "SITE_GAUGE_MULTIPROCESS_MODE"]

#: seconds between two publications of the pending increments (a Prometheus scrape is
#: 5-60 s apart: one second keeps a scrape at most a second behind EngineCore)
FLUSH_INTERVAL_S = 1.0
#: histogram observations kept pending before the counting thread publishes them itself
MAX_PENDING_OBSERVATIONS = 4096

#: Buckets of pending SWA GPU blocks / exact bound (1.0 = at the bound; > 1 = violation).
SWA_RATIO_BUCKETS: tuple[float, ...] = (0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0, 1.01, 1.1, 1.5, 2.0)
SITE_GAUGE_MULTIPROCESS_MODE = "max"


def _bucket_labels() -> tuple[tuple[float, str], ...]:
    from prometheus_client.utils import floatToGoString

    return tuple((bound, floatToGoString(bound)) for bound in (*SWA_RATIO_BUCKETS, float("inf")))


#: ``(upper bound, le label)`` of each histogram bucket, ``+Inf`` last
_BUCKET_LABELS = _bucket_labels()

_HELP = {
    names.METRIC_CHECK_EVALUATIONS: (
        "Evaluations of kvguard's exact-invariant checks (swa_pending_bound, mamba_state_limit). "
        "Other checks are vLLM asserts counted only when they fail (see violations); their series stays 0."
    ),
    names.METRIC_CHECK_TOLERATED: "vLLM assertions that would have failed while the exact invariant held (continued).",
    names.METRIC_INVARIANT_VIOLATIONS: "Check failures that were not tolerated, by check and the action taken.",
    names.METRIC_GUARD_ERRORS: "Exceptions raised inside kvguard code (the original vLLM path ran).",
    names.METRIC_SWA_PENDING_BOUND_RATIO: "Pending sliding-window GPU blocks of a load divided by the exact bound.",
    names.METRIC_SITE_INSTALLED: "1 when the check site is installed in this process, else 0.",
    names.METRIC_CONNECTOR_INFO: (
        "1 for the CPU offload connector (OffloadingConnector or SimpleCPUOffloadConnector) whose "
        "scheduler side kvguard guards in this engine."
    ),
    names.METRIC_ENGINE_FATAL: "Fatal EngineCore exceptions recorded by kvguard, by exception type.",
    names.METRIC_RECOMPUTED_TOKENS: (
        "Tokens vLLM recomputes instead of loading because kvguard reduced a cache hit, by check."
    ),
    names.METRIC_CHECK_SKIPPED: (
        "Lookups a check did not evaluate because kvguard cannot model or read what they involve, "
        "by check and reason; vLLM's answer passed through."
    ),
    names.METRIC_WAIT_BOUND_EXCEEDED: (
        "Requests whose offload wait made no progress within the wait bound, by wait kind and the action taken."
    ),
}


def _base(counter_name: str) -> str:
    return counter_name[: -len("_total")] if counter_name.endswith("_total") else counter_name


def _validate(value: str, allowed: Any, what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} label value {value!r}")


# the closed label sets as frozensets (a membership test per count, not a tuple scan)
_CHECKS = frozenset(names.CHECKS)
#: the pending-count key of each check's evaluations, built once
_EVALUATION_KEYS = {c: (names.METRIC_CHECK_EVALUATIONS, ((names.LABEL_CHECK, c),)) for c in _CHECKS}
_ACTIONS = frozenset(names.ACTIONS)
_STAGES = frozenset(names.STAGES)
_SKIPPABLE = frozenset(names.SKIPPABLE_CHECKS)
_REASONS = frozenset(names.SKIP_REASONS)
_WAITS = frozenset(names.WAITS)


class _MmapBackend:
    """Writes prometheus-client multiprocess files into an explicit directory."""

    def __init__(self, directory: Path) -> None:
        from prometheus_client.mmap_dict import MmapedDict, mmap_key

        self._MmapedDict = MmapedDict
        self._key = mmap_key
        from kvguard.guards.telemetry.statefile import DIR_MODE

        self._dir = Path(directory)
        if not self._dir.is_dir():
            self._dir.mkdir(parents=True, exist_ok=True)
            try:
                os.chmod(self._dir, DIR_MODE)
            except OSError:
                pass
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._tag = f"{self._pid}-{int(time.time() * 1000)}"
        self._files: dict[str, Any] = {}
        self._values: dict[tuple[str, str], float] = {}
        self._keys: dict[tuple[Any, ...], str] = {}

    def _file(self, prefix: str) -> Any:
        pid = os.getpid()
        if pid != self._pid:  # forked: start this process's own files from zero
            for f in self._files.values():
                f.close()
            self._files.clear()
            self._values.clear()
            self._pid = pid
            self._tag = f"{pid}-{int(time.time() * 1000)}"
        f = self._files.get(prefix)
        if f is None:
            from kvguard.guards.telemetry.statefile import FILE_MODE

            path = self._dir / f"{prefix}_{self._tag}.db"
            f = self._files[prefix] = self._MmapedDict(str(path))
            try:
                os.chmod(path, FILE_MODE)  # readable by the sidecar's user, whatever the umask
            except OSError:
                pass
        return f

    def _write(self, prefix: str, metric: str, sample: str, labels: dict[str, str], value: float | None, inc: float) -> None:
        # the library's key is JSON of the whole series (several us a write): made once per series
        series = (metric, sample, *labels.items())
        key = self._keys.get(series)
        if key is None:
            key = self._keys[series] = self._key(
                metric, sample, list(labels), list(labels.values()), _HELP.get(metric, _HELP.get(metric + "_total", ""))
            )
        with self._lock:
            f = self._file(prefix)
            cache_key = (prefix, key)
            if value is None:
                current = self._values.get(cache_key)
                if current is None:
                    current = f.read_value(key)[0]
                value = current + inc
            self._values[cache_key] = value
            f.write_value(key, value, 0.0)

    def counter(self, name: str, labels: dict[str, str], amount: float) -> None:
        self._write("counter", _base(name), name, labels, None, amount)

    def gauge_set(self, name: str, labels: dict[str, str], value: float) -> None:
        self._write(f"gauge_{SITE_GAUGE_MULTIPROCESS_MODE}", name, name, labels, value, 0.0)

    def histogram(self, name: str, value: float) -> None:
        self._write("histogram", name, name + "_sum", {}, None, value)
        for bound, le in _BUCKET_LABELS:
            if value <= bound:
                self._write("histogram", name, name + "_bucket", {"le": le}, None, 1.0)
                break

    def precreate_histogram(self, name: str) -> None:
        self._write("histogram", name, name + "_sum", {}, None, 0.0)
        for _, le in _BUCKET_LABELS:
            self._write("histogram", name, name + "_bucket", {"le": le}, None, 0.0)


class _RegistryBackend:
    """Plain prometheus_client metric objects on one registry."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        n = names

        def counter(name: str, labels: tuple[str, ...]) -> Any:
            return Counter(name, _HELP[name], labels, registry=registry)

        self._m = {
            n.METRIC_CHECK_EVALUATIONS: counter(n.METRIC_CHECK_EVALUATIONS, (n.LABEL_CHECK,)),
            n.METRIC_CHECK_TOLERATED: counter(n.METRIC_CHECK_TOLERATED, (n.LABEL_CHECK,)),
            n.METRIC_INVARIANT_VIOLATIONS: counter(n.METRIC_INVARIANT_VIOLATIONS, (n.LABEL_CHECK, n.LABEL_ACTION)),
            n.METRIC_GUARD_ERRORS: counter(n.METRIC_GUARD_ERRORS, (n.LABEL_STAGE,)),
            n.METRIC_ENGINE_FATAL: counter(n.METRIC_ENGINE_FATAL, (n.LABEL_EXCEPTION,)),
            n.METRIC_RECOMPUTED_TOKENS: counter(n.METRIC_RECOMPUTED_TOKENS, (n.LABEL_CHECK,)),
            n.METRIC_CHECK_SKIPPED: counter(n.METRIC_CHECK_SKIPPED, (n.LABEL_CHECK, n.LABEL_REASON)),
            n.METRIC_WAIT_BOUND_EXCEEDED: counter(n.METRIC_WAIT_BOUND_EXCEEDED, (n.LABEL_WAIT, n.LABEL_ACTION)),
            n.METRIC_SITE_INSTALLED: Gauge(
                n.METRIC_SITE_INSTALLED, _HELP[n.METRIC_SITE_INSTALLED], (n.LABEL_SITE,),
                registry=registry, multiprocess_mode=SITE_GAUGE_MULTIPROCESS_MODE,
            ),
            n.METRIC_CONNECTOR_INFO: Gauge(
                n.METRIC_CONNECTOR_INFO, _HELP[n.METRIC_CONNECTOR_INFO], (n.LABEL_CONNECTOR,),
                registry=registry, multiprocess_mode=SITE_GAUGE_MULTIPROCESS_MODE,
            ),
            n.METRIC_SWA_PENDING_BOUND_RATIO: Histogram(
                n.METRIC_SWA_PENDING_BOUND_RATIO, _HELP[n.METRIC_SWA_PENDING_BOUND_RATIO],
                buckets=SWA_RATIO_BUCKETS, registry=registry,
            ),
        }
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, name: str, labels: dict[str, str]) -> Any:
        # ``labels(**...)`` validates and looks the child up under a lock on every call:
        # each series' child is kept after its first write
        series = (name, *labels.items())
        child = self._children.get(series)
        if child is None:
            child = self._children[series] = self._m[name].labels(**labels)
        return child

    def counter(self, name: str, labels: dict[str, str], amount: float) -> None:
        self._child(name, labels).inc(amount)

    def gauge_set(self, name: str, labels: dict[str, str], value: float) -> None:
        self._child(name, labels).set(value)

    def histogram(self, name: str, value: float) -> None:
        self._m[name].observe(value)

    def precreate_histogram(self, name: str) -> None:
        pass  # a Histogram without labels exports its buckets at 0 already


class _FlushOnCollect:
    """A collector registered on an in-process registry before kvguard's metrics: its
    ``collect`` publishes the pending increments, so a scrape (or ``get_sample_value``)
    reads every count made before it."""

    def __init__(self, metrics: "GuardMetrics") -> None:
        self._metrics = weakref.ref(metrics)

    def describe(self) -> list:
        return []

    def collect(self) -> list:
        metrics = self._metrics()
        if metrics is not None:
            metrics.flush()
        return []


class GuardMetrics:
    """The metrics sink of :mod:`kvguard.guards.policy.runtime` (and of ``kvguard.guards.policy.fatal``).

    ``state_dir``: when given, multiprocess files go to ``state_dir/metrics/`` (created);
    otherwise ``registry`` (default: prometheus_client's ``REGISTRY``) holds them. Use
    :func:`get_metrics` rather than constructing twice on one registry (prometheus_client
    raises ``ValueError`` on duplicated series).

    Counting methods validate their labels (``ValueError`` at once, on the caller's thread)
    and add to the pending increments; :meth:`flush` publishes them (module docstring:
    when). Gauges (installation time) and ``engine_fatal`` are written at once.
    """

    def __init__(self, state_dir: Path | str | None = None, registry: Any = None) -> None:
        #: serializes flushes (the flusher thread, a raised check, a fatal record, exit)
        self._flush_lock = threading.Lock()
        #: (metric name, labels as ((name, value), ...)) -> everything counted in this
        #: process; written by the counting threads only, without a lock (each count is one
        #: dict update under the GIL: the scheduler's own thread makes them)
        self._counts: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        #: the same keys -> what a flush has published (read and written by flushes only)
        self._published: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        #: histogram observations not yet published (list.append and del of a prefix are
        #: atomic under the GIL)
        self._observed: list[float] = []
        if state_dir is not None:
            self.path: Path | None = Path(state_dir) / names.STATE_METRICS_SUBDIR
            self._b: Any = _MmapBackend(self.path)
        else:
            from prometheus_client import REGISTRY

            self.path = None
            registry = registry if registry is not None else REGISTRY
            registry.register(_FlushOnCollect(self))
            self._b = _RegistryBackend(registry)
        self._precreate()
        _flusher.watch(self)

    def _precreate(self) -> None:
        n = names
        for check in n.CHECKS:
            self._b.counter(n.METRIC_CHECK_EVALUATIONS, {n.LABEL_CHECK: check}, 0)
            self._b.counter(n.METRIC_CHECK_TOLERATED, {n.LABEL_CHECK: check}, 0)
            for action in n.ACTIONS:
                self._b.counter(n.METRIC_INVARIANT_VIOLATIONS, {n.LABEL_CHECK: check, n.LABEL_ACTION: action}, 0)
        for stage in n.STAGES:
            self._b.counter(n.METRIC_GUARD_ERRORS, {n.LABEL_STAGE: stage}, 0)
        for check in n.RECOMPUTE_CHECKS:
            self._b.counter(n.METRIC_RECOMPUTED_TOKENS, {n.LABEL_CHECK: check}, 0)
        for check in n.SKIPPABLE_CHECKS:
            for reason in n.SKIP_REASONS:
                self._b.counter(n.METRIC_CHECK_SKIPPED, {n.LABEL_CHECK: check, n.LABEL_REASON: reason}, 0)
        for wait in n.WAITS:
            for action in n.ACTIONS:
                self._b.counter(n.METRIC_WAIT_BOUND_EXCEEDED, {n.LABEL_WAIT: wait, n.LABEL_ACTION: action}, 0)
        self._b.precreate_histogram(n.METRIC_SWA_PENDING_BOUND_RATIO)

    # -- batching ----------------------------------------------------------------------
    def _add(self, name: str, labels: tuple[tuple[str, str], ...], amount: float) -> None:
        counted = self._counts
        key = (name, labels)
        counted[key] = counted.get(key, 0) + amount
        if _flusher.thread is None:
            _flusher.start()

    def pending(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The increments not yet published (``{(metric, labels): amount}``)."""
        published = self._published
        return {key: total - published.get(key, 0) for key, total in list(self._counts.items())
                if total != published.get(key, 0)}

    def flush(self) -> None:
        """Publish the increments and observations counted since the last flush to Prometheus
        (the multiprocess files or the registry); safe from any thread. A write that raises
        leaves what it had not written for the next flush, and re-raises."""
        with self._flush_lock:
            published = self._published
            for key, total in list(self._counts.items()):  # one C call: atomic under the GIL
                delta = total - published.get(key, 0)
                if delta:
                    name, labels = key
                    self._b.counter(name, dict(labels), delta)
                    published[key] = total
            observed = self._observed
            n = len(observed)
            if n:
                for value in observed[:n]:
                    self._b.histogram(names.METRIC_SWA_PENDING_BOUND_RATIO, value)
                del observed[:n]

    def _after_fork_in_child(self) -> None:
        # the parent publishes what it counted; the child's files start from zero (the
        # backend reopens them), and a lock held by the parent's flusher at the fork
        # would stay held here forever
        self._flush_lock = threading.Lock()
        self._counts = {}
        self._published = {}
        self._observed = []
        backend_lock = getattr(self._b, "_lock", None)
        if backend_lock is not None:
            self._b._lock = threading.Lock()

    # -- the counting methods ----------------------------------------------------------
    def evaluations(self, check: str, amount: int) -> None:
        """Add ``amount`` evaluations of ``check``; ValueError for an unknown check.

        :mod:`kvguard.guards.policy.runtime` calls it for :data:`kvguard.guards.names.EVALUATED_CHECKS` only
        (``swa_pending_bound``, ``mamba_state_limit``); every other check's series is
        created at 0 and stays there, because a passing vLLM assert is not counted.
        """
        key = _EVALUATION_KEYS.get(check)
        if key is None:
            _validate(check, _CHECKS, "check")
        counted = self._counts  # _add written out: the store and window checks count here (issue 31)
        counted[key] = counted.get(key, 0) + amount
        if _flusher.thread is None:
            _flusher.start()

    def tolerated(self, check: str) -> None:
        _validate(check, _CHECKS, "check")
        self._add(names.METRIC_CHECK_TOLERATED, ((names.LABEL_CHECK, check),), 1)

    def violation(self, check: str, action: str) -> None:
        """Count one failure of ``check`` handled with ``action``; a ``raised`` one is
        published at once (the engine may be about to die of it)."""
        _validate(check, _CHECKS, "check")
        _validate(action, _ACTIONS, "action")
        self._add(names.METRIC_INVARIANT_VIOLATIONS, ((names.LABEL_CHECK, check), (names.LABEL_ACTION, action)), 1)
        if action == names.ACTION_RAISED:
            self.flush()

    def guard_error(self, stage: str) -> None:
        _validate(stage, _STAGES, "stage")
        self._add(names.METRIC_GUARD_ERRORS, ((names.LABEL_STAGE, stage),), 1)

    def recomputed_tokens(self, check: str, amount: int) -> None:
        """Add ``amount`` tokens (>= 0) that vLLM recomputes because ``check`` reduced a hit."""
        _validate(check, _CHECKS, "check")
        if amount < 0:
            raise ValueError("recomputed tokens must be >= 0")
        self._add(names.METRIC_RECOMPUTED_TOKENS, ((names.LABEL_CHECK, check),), amount)

    def check_skipped(self, check: str, reason: str) -> None:
        """Count one evaluation of ``check`` skipped for ``reason`` (kvguard cannot model or
        read what it involves; not a guard error); ValueError for a check outside
        :data:`~kvguard.guards.names.SKIPPABLE_CHECKS` or a reason outside
        :data:`~kvguard.guards.names.SKIP_REASONS`."""
        _validate(check, _SKIPPABLE, "check")
        _validate(reason, _REASONS, "reason")
        self._add(names.METRIC_CHECK_SKIPPED, ((names.LABEL_CHECK, check), (names.LABEL_REASON, reason)), 1)

    def wait_bound_exceeded(self, wait: str, action: str) -> None:
        """Count one request whose ``wait`` (:data:`~kvguard.guards.names.WAITS`) exceeded the
        wait bound, and the ``action`` taken; ValueError for a label outside those sets."""
        _validate(wait, _WAITS, "wait")
        _validate(action, _ACTIONS, "action")
        self._add(names.METRIC_WAIT_BOUND_EXCEEDED, ((names.LABEL_WAIT, wait), (names.LABEL_ACTION, action)), 1)

    def swa_ratio(self, ratio: float) -> None:
        """Observe pending SWA GPU blocks / exact bound (dimensionless)."""
        observed = self._observed
        observed.append(float(ratio))
        if len(observed) >= MAX_PENDING_OBSERVATIONS:
            self.flush()
        elif _flusher.thread is None:
            _flusher.start()

    def site_installed(self, site: str, installed: bool) -> None:
        """Set ``kvguard_site_installed{site}`` to 1 or 0 (written at once); ValueError for an unknown site."""
        _validate(site, known_site_ids(), "site")
        self._b.gauge_set(names.METRIC_SITE_INSTALLED, {names.LABEL_SITE: site}, 1.0 if installed else 0.0)

    def connector_guarded(self, connector: str) -> None:
        """Set ``kvguard_connector_info{connector}`` to 1 (a connector's scheduler side was built
        under kvguard; written at once); ValueError for a name outside :data:`~kvguard.guards.names.CONNECTORS`."""
        _validate(connector, names.CONNECTORS, "connector")
        self._b.gauge_set(names.METRIC_CONNECTOR_INFO, {names.LABEL_CONNECTOR: connector}, 1.0)

    def engine_fatal(self, exception: str) -> None:
        """Publish every pending increment of the process (:func:`flush_all`), then count a
        fatal EngineCore exception by its class name, at once (``exception`` label, through
        :func:`kvguard.guards.telemetry.statefile.exception_label`: the fatal record's own field, at
        most ``MAX_LABEL_CHARS`` characters and a Python identifier)."""
        from kvguard.guards.telemetry.statefile import exception_label

        flush_all()
        self._b.counter(names.METRIC_ENGINE_FATAL, {names.LABEL_EXCEPTION: exception_label(str(exception))}, 1)


class _Flusher:
    """The process's one flusher: a daemon thread that publishes every live
    :class:`GuardMetrics`' pending increments each :data:`FLUSH_INTERVAL_S`, started by the
    first increment (in each process: a forked child starts its own)."""

    def __init__(self) -> None:
        # strong references: a sink dropped with increments pending still publishes them
        # (sinks are process-wide, one per state dir or registry: get_metrics)
        self.instances: list[GuardMetrics] = []
        self.thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def watch(self, metrics: GuardMetrics) -> None:
        self.instances.append(metrics)

    def start(self) -> None:
        with self._start_lock:
            if self.thread is None:
                thread = threading.Thread(target=self._run, name="kvguard-metrics-flush", daemon=True)
                self.thread = thread  # before it runs: _run stops once it is not the current one
                thread.start()

    def _run(self) -> None:
        me = threading.current_thread()
        while self.thread is me:
            time.sleep(FLUSH_INTERVAL_S)
            flush_all()

    def after_fork_in_child(self) -> None:
        self.thread = None
        self._start_lock = threading.Lock()
        for metrics in list(self.instances):
            metrics._after_fork_in_child()


_flusher = _Flusher()


def flush_all() -> None:
    """Publish the pending increments of every :class:`GuardMetrics` of this process; never
    raises (an error leaves that instance's increments pending for the next flush)."""
    for metrics in list(_flusher.instances):
        try:
            metrics.flush()
        except Exception:
            pass


def _finalize_in_child(_: Any) -> None:
    from multiprocessing import util

    util.Finalize(None, flush_all, exitpriority=100)


def _register_exit_flushes() -> None:
    atexit.register(flush_all)
    try:
        from multiprocessing import util

        # a fork-started multiprocessing child leaves through os._exit after its exit
        # finalizers; it clears the registry it inherited, then runs the after-fork hooks
        util.Finalize(None, flush_all, exitpriority=100)
        util.register_after_fork(_flusher, _finalize_in_child)
    except Exception:  # pragma: no cover - multiprocessing is always there
        pass
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_flusher.after_fork_in_child)


_register_exit_flushes()


_instances: dict[tuple[str | None, int], GuardMetrics] = {}
_instances_lock = threading.Lock()


def get_metrics(state_dir: Path | str | None = None, registry: Any = None) -> GuardMetrics:
    """The process-wide :class:`GuardMetrics` for ``state_dir`` (or the registry), created once."""
    key = (str(Path(state_dir).resolve()) if state_dir is not None else None, id(registry))
    with _instances_lock:
        metrics = _instances.get(key)
        if metrics is None:
            metrics = _instances[key] = GuardMetrics(state_dir, registry)
        return metrics
