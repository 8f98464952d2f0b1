"""Engine state: poll vLLM's ``/health`` and ``/v1/models``, latch deaths, decide probes.

Two parts, kept apart so the rules are testable without a network:

- :class:`EngineTracker` is pure: it takes one :class:`Probe` (what vLLM answered) and the
  set of fatal-record pids seen in the state dir, and returns an :class:`EngineSnapshot`
  (state, liveness, readiness, deaths). No clock, no I/O.
- :class:`HealthPoller` does the I/O: every ``poll_interval`` seconds it asks vLLM (one
  ``httpx.AsyncClient``, ``health_timeout`` per request), reads the fatal records and
  feeds the tracker. It runs as one asyncio task in the sidecar's lifespan.

States (``EngineState``):

=============  ===============================================================
``starting``   vLLM has not answered ``/health`` with 200 yet (loading weights)
``up``         the last ``/health`` was 200 and no fatal record appeared since
``dead``       vLLM was up and stopped answering 200, or a fatal record appeared;
               stays ``dead`` until ``/health`` is 200 again *after* having failed
=============  ===============================================================

``/livez`` is 200 only in ``up``. vLLM's API server answers ``/health`` with 503 as soon
as its client sees EngineCore gone, and stops listening shortly after (vLLM #48966 is
that it then exits 0), so ``/livez`` turns 503 at most ``poll_interval + health_timeout``
after EngineCore dies (0.7 s with the defaults). ``/readyz`` is 200 only when the state
is ``up`` and ``/v1/models`` answered 200 on the same poll.

``kvguard_engine_deaths_total`` counts transitions into ``dead`` (one per episode, even
when both the fatal record and the failing health check report the same death).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import httpx
import structlog

from kvguard.guards.statefile import FatalRecord, StateDir, read_fatal_records

__all__ = [
    "EngineSnapshot",
    "EngineState",
    "EngineTracker",
    "HealthPoller",
    "Probe",
]

log = structlog.get_logger("kvguard.sidecar.health")


class EngineState(str, enum.Enum):
    STARTING = "starting"
    UP = "up"
    DEAD = "dead"


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
    """What the probes and /status report after one observation."""

    state: EngineState = EngineState.STARTING
    ready: bool = False
    deaths: int = 0
    last_change: float | None = None
    last_probe: Probe | None = None
    polls: int = 0

    @property
    def live(self) -> bool:
        return self.state is EngineState.UP


@dataclass
class EngineTracker:
    """The latch (pure; see the module docstring). Feed :meth:`observe` once per poll."""

    snapshot: EngineSnapshot = field(default_factory=EngineSnapshot)
    _seen_fatal: frozenset[int] = frozenset()
    _failed_in_episode: bool = False

    def observe(self, probe: Probe, fatal_pids: frozenset[int] = frozenset()) -> EngineSnapshot:
        """Advance the state with one probe; returns (and keeps) the new snapshot."""
        prev = self.snapshot
        new_fatal = bool(fatal_pids - self._seen_fatal)
        self._seen_fatal = self._seen_fatal | fatal_pids
        state = prev.state
        deaths = prev.deaths

        if state is EngineState.DEAD:
            if not probe.health_ok:
                self._failed_in_episode = True
            elif self._failed_in_episode and not new_fatal:
                state = EngineState.UP  # a restarted vLLM answered again
        elif new_fatal or (state is EngineState.UP and not probe.health_ok):
            state = EngineState.DEAD
            deaths += 1
            self._failed_in_episode = not probe.health_ok
        elif probe.health_ok:
            state = EngineState.UP

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
        )
        if changed:
            log.info(
                "engine_state_changed",
                from_state=prev.state.value,
                to_state=state.value,
                health_status=probe.health_status,
                error=probe.error,
            )
        return self.snapshot


@dataclass
class HealthPoller:
    """Polls ``base_url`` every ``interval`` s and keeps the tracker, the newest fatal
    records and vLLM's ``/version`` current. :meth:`run` loops until cancelled; it never
    raises for network or state-dir errors (they are counted in ``errors``)."""

    base_url: str
    interval: float
    timeout: float
    state_dir: StateDir | None
    tracker: EngineTracker = field(default_factory=EngineTracker)
    fatal_records: list[FatalRecord] = field(default_factory=list)
    fatal_errors: list[str] = field(default_factory=list)
    vllm_version: str | None = None
    errors: dict[str, int] = field(default_factory=dict)
    last_poll: float | None = None
    clock: Callable[[], float] = time.time

    def count_error(self, source: str, n: int = 1) -> None:
        self.errors[source] = self.errors.get(source, 0) + n

    async def probe(self, client: httpx.AsyncClient) -> Probe:
        """One round: ``/health``, then (when 200) ``/v1/models`` and, once, ``/version``."""
        now = self.clock()
        try:
            r = await client.get(self.base_url + "/health")
        except httpx.HTTPError as e:
            return Probe(None, False, f"{type(e).__name__}: {e}" or type(e).__name__, now)
        if r.status_code != 200:
            return Probe(r.status_code, False, None, now)
        models_ok = False
        try:
            models_ok = (await client.get(self.base_url + "/v1/models")).status_code == 200
        except httpx.HTTPError:
            pass
        if self.vllm_version is None:
            try:
                v = await client.get(self.base_url + "/version")
                if v.status_code == 200:
                    self.vllm_version = str(v.json().get("version")) or None
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
        return Probe(200, models_ok, None, now)

    def read_state(self) -> frozenset[int]:
        if self.state_dir is None:
            return frozenset()
        records, errors = read_fatal_records(self.state_dir)
        if errors and errors != self.fatal_errors:
            self.count_error("fatal_record", len(errors))
            log.warning("fatal_records_unreadable", errors=errors[:5])
        self.fatal_records, self.fatal_errors = records, errors
        return frozenset(r.pid for r in records)

    async def poll_once(self, client: httpx.AsyncClient) -> EngineSnapshot:
        probe = await self.probe(client)
        try:
            fatal = self.read_state()
        except Exception as e:  # never let the state dir stop the poller
            self.count_error("state_dir")
            log.warning("state_dir_read_failed", error=str(e))
            fatal = frozenset()
        snap = self.tracker.observe(probe, fatal)
        self.last_poll = self.clock()
        return snap

    async def run(self) -> None:
        limits = httpx.Limits(max_keepalive_connections=2, max_connections=4)
        async with httpx.AsyncClient(timeout=self.timeout, limits=limits) as client:
            while True:
                started = time.monotonic()
                try:
                    await self.poll_once(client)
                except Exception as e:  # pragma: no cover - belt and braces
                    self.count_error("poller")
                    log.error("poll_failed", error=repr(e))
                await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))
