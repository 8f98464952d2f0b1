"""The sidecar's FastAPI app: ``create_app(cfg)`` and ``run_sidecar(cfg)``.

Endpoints (the OpenAPI document is generated at ``/openapi.json``):

==============  ==========================================================================
``/metrics``    Prometheus text: the state dir's multiprocess files merged, plus the
                sidecar's own series (see :mod:`kvguard.sidecar.collector`)
``/livez``      200 while the engine is ``up`` (vLLM's ``/health`` answers 200 and no fatal
                record of this start appeared); 503 otherwise
``/readyz``     200 only when live and ``/v1/models`` answered 200 on the same poll
``/status``     JSON: engine state, last fatal cause, counts by check, the waits the wait
                bound ended (``waits_ended``), policy, versions, state-dir problems (``blind``, ``unreadable``) and what the sidecar still
                waits for (``waiting``)
``/healthz``    the sidecar itself: 200 while its poller runs
==============  ==========================================================================

What runs where (so that a probe never waits on metrics):

- ``/livez``, ``/readyz`` and ``/healthz`` are ``async`` handlers that only read state
  kept in memory by the poller: no file, no parse, no HTTP, no thread hop.
- Reading and parsing the state dir happens in worker threads, never in the event loop.
  One scrape (:class:`Scraper`) reads every multiprocess file once and renders the text;
  concurrent ``/metrics`` requests share the scrape in flight (one worker at a time, so
  20 scrapers cost one), a scrape within :data:`METRICS_MAX_AGE` of the last read reuses
  that read (the sidecar's own series are always fresh), and ``/status`` reuses the newest
  scrape when it is younger than :data:`STATUS_MAX_AGE` seconds.
- vLLM is polled by one asyncio task with ``httpx.AsyncClient`` (non-blocking sockets).

No module globals: every piece of state hangs off the app built by :func:`create_app`,
so tests build as many apps as they like. The app never crashes on a missing, empty,
corrupt, unreadable or semantically bad state dir; it serves what it can and counts the
problem (:mod:`kvguard.sidecar.problems`). ``metrics/`` missing before it ever existed is
``waiting`` (not a problem) for ``SidecarConfig.metrics_dir_grace`` seconds from the
sidecar's start: a sidecar that starts long before vLLM is not blind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from pydantic import BaseModel

from kvguard.guards import names
from kvguard.guards.telemetry.statefile import StateDir
from kvguard.sidecar.collector import (
    ENGINE_FATAL,
    Families,
    describe_error,
    KeyVerdicts,
    SidecarCollector,
    SidecarView,
    check_counts,
    wait_counts,
    read_metrics_dir,
    with_zero_counters,
)
from kvguard.sidecar.config import SidecarConfig
from kvguard.sidecar.health import HealthPoller
from kvguard.sidecar.logconfig import kvguard_version
from kvguard.sidecar.problems import Problem

__all__ = ["STATUS_MAX_AGE", "Scraper", "create_app", "run_sidecar"]

#: /status reuses a scrape younger than this (seconds) instead of reading the dir again.
STATUS_MAX_AGE = 1.0
#: Default of ``SidecarConfig.metrics_max_age``: a scrape reuses the state-dir read of the
#: previous one when it is younger than this (seconds); the sidecar's own series are
#: rendered fresh every time. Prometheus scrapes every 1 s or more, so it always gets a
#: fresh read; 20 clients scraping back to back cost two reads a second, not one each.
METRICS_MAX_AGE = 0.5
#: ``sys.setswitchinterval`` of the sidecar process (seconds; CPython's default is 0.005).
SWITCH_INTERVAL = 0.0005

_SIDECAR_FAMILIES = {
    "kvguard_engine_up",
    "kvguard_engine_state",
    "kvguard_engine_startup_budget_seconds",
    "kvguard_engine_deaths",
    "kvguard_build_info",
    "kvguard_sidecar_errors",
    "kvguard_sidecar_unreadable",
    ENGINE_FATAL,
}


class ProbeResult(BaseModel):
    status: str
    engine: str
    detail: str | None = None


class FatalCause(BaseModel):
    exception: str
    message: str
    site: str | None
    time: float
    pid: int
    phase: str | None = None
    process: str | None = None


class CheckCounts(BaseModel):
    evaluated: float
    tolerated: float
    violations: float


class EngineProcess(BaseModel):
    name: str
    pid: int
    parent: str | None


class EngineStatus(BaseModel):
    state: str
    live: bool
    ready: bool
    deaths: int
    polls: int
    last_change: float | None
    started_at: float | None
    startup_budget_s: float | None
    reason: str | None
    health_status: int | None
    error: str | None
    processes: list[EngineProcess] = []


class Versions(BaseModel):
    kvguard: str
    vllm: str


class StateDirProblem(BaseModel):
    source: str
    path: str
    reason: str
    detail: str


class StatusResponse(BaseModel):
    engine: EngineStatus
    last_fatal: FatalCause | None
    fatal_history: int
    checks: dict[str, CheckCounts]
    #: waits the wait bound ended (guard) or counted (observe): ``{wait: {action: n}}``
    waits_ended: dict[str, dict[str, float]] = {}
    policy: str
    versions: Versions
    state_dir: str | None
    errors: dict[str, int]
    blind: bool
    unreadable: list[StateDirProblem]
    waiting: list[StateDirProblem]
    metrics_reads: int


class SidecarHealth(BaseModel):
    status: str
    poller_running: bool
    last_poll_age_s: float | None


@dataclass(frozen=True)
class ScrapeResult:
    """One scrape: the state dir's merged families, the rendered text, ``time.monotonic()``."""

    families: list[Metric]
    text: bytes
    at: float


class Scraper:
    """Single-flight scrapes of the state dir, in a worker thread.

    :meth:`scrape` starts a scrape unless one is in flight, and returns that one's
    result: N concurrent callers cost one read of the directory. ``view`` gives the
    sidecar's own series at render time. Never raises for state-dir problems (they go to
    ``poller.problems``). ``verdicts``: the per-key checks of the multiprocess files,
    kept across scrapes (:class:`kvguard.sidecar.collector.KeyVerdicts`).

    ``grace``: seconds from this scraper's creation (the sidecar's start) during which a
    ``metrics/`` that is missing, and was never seen, is ``waiting`` (listed in
    :attr:`waiting`, not a problem) rather than blind: the plugin (or ``kvguard run``)
    creates it when vLLM starts, which may be long after the sidecar. Once ``metrics/``
    was read, or after the grace, a missing ``metrics/`` is a ``metrics_dir`` problem
    (``missing``). ``clock``: ``time.monotonic`` (injectable for tests)."""

    def __init__(
        self,
        state: StateDir | None,
        poller: HealthPoller,
        view,
        max_age: float = METRICS_MAX_AGE,
        grace: float = 0.0,
        clock=time.monotonic,
    ) -> None:
        self.state = state
        self.poller = poller
        self.view = view
        self.max_age = max_age
        self.grace = grace
        self.clock = clock
        self.started = clock()
        self.latest: ScrapeResult | None = None
        self._read: tuple[list[Metric], float] | None = None
        self.verdicts = KeyVerdicts()
        self._metrics_dir_seen = False
        #: ``{source: {path: Problem}}`` the sidecar waits for (within the grace)
        self.waiting: dict[str, dict[str, Problem]] = {}
        #: reads of the state dir (a scrape within ``max_age`` of the last read reuses it)
        self.reads = 0
        #: scrapes run and requests served by them (``requests - scrapes`` shared one)
        self.scrapes = 0
        self.requests = 0
        self._task: asyncio.Task[ScrapeResult] | None = None
        self._limiter: anyio.CapacityLimiter | None = None

    def _wait_or_blind(self, problems: dict[str, dict[str, Problem]]) -> None:
        """Move a never-seen missing ``metrics/`` from ``problems`` to :attr:`waiting`
        while within the grace (see the class docstring)."""
        found = problems["metrics_dir"].get("metrics/")
        self.waiting = {}
        if found is None:
            self._metrics_dir_seen = True
            return
        left = self.grace - (self.clock() - self.started)
        if found.reason == names.REASON_MISSING and not self._metrics_dir_seen and left > 0:
            del problems["metrics_dir"]["metrics/"]
            detail = f"{found.detail}; waiting for the plugin's first write, blind in {left:.0f} s"
            self.waiting = {"metrics_dir": {"metrics/": Problem(found.reason, detail)}}

    def collect(self) -> ScrapeResult:
        """Read, merge and render (blocking: runs in a worker thread)."""
        fams: list[Metric] = []
        problems: dict[str, dict[str, Problem]] | None = None
        if self.state is not None:
            now = time.monotonic()
            if self._read is not None and now - self._read[1] < self.max_age:
                fams = self._read[0]
            else:
                fams, problems = read_metrics_dir(self.state.metrics, self.verdicts)
                self._wait_or_blind(problems)
                self._read = (fams, now)
                self.reads += 1
        fatal = next((f for f in fams if f.name == ENGINE_FATAL), None)
        engine = with_zero_counters([f for f in fams if f.name not in _SIDECAR_FAMILIES])
        try:
            engine_text = generate_latest(Families(engine))
        except Exception as e:  # every file's keys were rendered alone (judge_key): should not happen
            # Never answer 500 for what the state dir holds: serve the sidecar's own series
            # and flag the whole metrics dir (once, while it lasts), so KVGuardSidecarBlind fires.
            problems = problems if problems is not None else {"metrics_dir": {}}
            problems["metrics_dir"]["metrics/"] = Problem(names.REASON_UNEXPECTED, f"rendering: {describe_error(e)}")
            engine, fatal, engine_text = [], None, b""
        if problems is not None:
            self.poller.problems.observe(problems)
        # generate_latest renders collector after collector: the engine's text, then the
        # sidecar's own (rendered now, after the problems above were counted)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(SidecarCollector(self.view, fatal))
        result = ScrapeResult(engine, engine_text + generate_latest(registry), time.monotonic())
        self.latest = result
        self.scrapes += 1
        return result

    async def _run(self) -> ScrapeResult:
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(1)
        try:
            return await anyio.to_thread.run_sync(self.collect, limiter=self._limiter)
        finally:
            self._task = None

    async def scrape(self) -> ScrapeResult:
        self.requests += 1
        task = self._task
        if task is None:
            task = self._task = asyncio.ensure_future(self._run())
        return await asyncio.shield(task)

    async def recent(self, max_age: float) -> ScrapeResult:
        """The newest scrape if younger than ``max_age`` seconds, else a new one."""
        latest = self.latest
        if latest is not None and time.monotonic() - latest.at <= max_age:
            return latest
        return await self.scrape()


def create_app(cfg: SidecarConfig) -> FastAPI:
    """Build the app for one vLLM server from ``cfg`` (nothing is read from the
    environment here). The health poller starts with the app's lifespan and stops
    with it."""
    state = StateDir(Path(cfg.state_dir)) if cfg.state_dir is not None else None
    poller = HealthPoller(
        base_url=cfg.vllm_url,
        interval=cfg.poll_interval,
        timeout=cfg.health_timeout,
        state_dir=state,
        startup_budget=cfg.startup_budget,
    )
    kv_version = kvguard_version()

    def vllm_version() -> str:
        if cfg.vllm_version:
            return cfg.vllm_version
        if poller.vllm_version:
            return poller.vllm_version
        if poller.fatal_records:
            return poller.fatal_records[-1].vllm_version
        return "unknown"

    def view() -> SidecarView:
        snap = poller.tracker.snapshot
        return SidecarView(
            state=snap.state.value,
            deaths=snap.deaths,
            fatal_records=tuple(poller.fatal_records),
            errors=poller.problems.by_reason(),
            unreadable=poller.problems.unreadable(),
            kvguard_version=kv_version,
            vllm_version=vllm_version(),
            startup_budget=cfg.startup_budget,
        )

    scraper = Scraper(state, poller, view, max_age=cfg.metrics_max_age, grace=cfg.effective_metrics_dir_grace)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(poller.run(), name="kvguard-health-poller")
        app.state.poller_task = task
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    app = FastAPI(
        title="kvguard sidecar",
        version=kv_version,
        description="Liveness, readiness, status and metrics for one vLLM server (vLLM #48966).",
        lifespan=lifespan,
    )
    app.state.poller = poller
    app.state.config = cfg
    app.state.scraper = scraper

    @app.get("/metrics", response_class=Response, summary="Prometheus metrics")
    async def metrics() -> Response:
        result = await scraper.scrape()
        return Response(result.text, media_type=CONTENT_TYPE_LATEST)

    def probe_response(ok: bool, detail: str | None) -> JSONResponse:
        snap = poller.tracker.snapshot
        body = ProbeResult(status="ok" if ok else "fail", engine=snap.state.value, detail=detail)
        return JSONResponse(body.model_dump(), status_code=200 if ok else 503)

    def why_not() -> str | None:
        snap = poller.tracker.snapshot
        current = [r for r in poller.fatal_records
                   if poller.run_record is None or r.time >= poller.run_record.started]
        if snap.state.value == "dead" and current:
            return current[-1].cause()
        if snap.reason:
            return snap.reason
        p = snap.last_probe
        if p is None:
            return "not polled yet"
        if p.health_status != 200:
            return p.error or f"vLLM /health answered {p.health_status}"
        return None

    @app.get(
        "/livez",
        response_model=ProbeResult,
        responses={503: {"model": ProbeResult}},
        summary="200 while the engine is up",
    )
    async def livez() -> JSONResponse:
        snap = poller.tracker.snapshot
        return probe_response(snap.live, None if snap.live else why_not())

    @app.get(
        "/readyz",
        response_model=ProbeResult,
        responses={503: {"model": ProbeResult}},
        summary="200 when up and /v1/models answers",
    )
    async def readyz() -> JSONResponse:
        snap = poller.tracker.snapshot
        detail = None
        if not snap.ready:
            detail = why_not() or "vLLM /v1/models did not answer 200"
        return probe_response(snap.ready, detail)

    @app.get("/status", response_model=StatusResponse, summary="Engine state and counts")
    async def status() -> StatusResponse:
        result = await scraper.recent(max(STATUS_MAX_AGE, cfg.poll_interval))
        snap = poller.tracker.snapshot
        p = snap.last_probe
        records = list(poller.fatal_records)
        last = records[-1] if records else None
        listing = poller.problems.listing()
        return StatusResponse(
            engine=EngineStatus(
                state=snap.state.value,
                live=snap.live,
                ready=snap.ready,
                deaths=snap.deaths,
                polls=snap.polls,
                last_change=snap.last_change,
                started_at=snap.started_at,
                startup_budget_s=cfg.startup_budget,
                reason=snap.reason,
                health_status=p.health_status if p else None,
                error=p.error if p else None,
                processes=[EngineProcess(**x) for x in poller.run_record.parts] if poller.run_record else [],
            ),
            last_fatal=FatalCause(
                exception=last.exception,
                message=last.message,
                site=last.site,
                time=last.time,
                pid=last.pid,
                phase=last.phase,
                process=last.process,
            )
            if last
            else None,
            fatal_history=len(records),
            checks={k: CheckCounts(**v) for k, v in check_counts(result.families).items()},
            waits_ended=wait_counts(result.families),
            policy=cfg.policy,
            versions=Versions(kvguard=kv_version, vllm=vllm_version()),
            state_dir=str(state.root) if state else None,
            errors=poller.problems.totals(),
            blind=bool(listing),
            unreadable=[StateDirProblem(source=s, path=p_, reason=r, detail=d) for s, p_, r, d in listing],
            waiting=[
                StateDirProblem(source=s, path=p_, reason=pr.reason, detail=pr.detail)
                for s, ps in sorted(scraper.waiting.items())
                for p_, pr in sorted(ps.items())
            ],
            metrics_reads=scraper.reads,
        )

    @app.get(
        "/healthz",
        response_model=SidecarHealth,
        responses={503: {"model": SidecarHealth}},
        summary="The sidecar itself",
    )
    async def healthz() -> JSONResponse:
        task: asyncio.Task | None = getattr(app.state, "poller_task", None)
        running = task is not None and not task.done()
        age = time.time() - poller.last_poll if poller.last_poll else None
        body = SidecarHealth(
            status="ok" if running else "fail", poller_running=running, last_poll_age_s=age
        )
        return JSONResponse(body.model_dump(), status_code=200 if running else 503)

    return app


def run_sidecar(cfg: SidecarConfig) -> None:
    """Serve :func:`create_app` with uvicorn on ``cfg.host:cfg.port`` until stopped.

    SIGTERM/SIGINT stop it gracefully and the process then returns normally (exit 0):
    uvicorn re-raises the captured signal after shutdown, which a handler installed here
    absorbs. Access logs are off (probes would flood them); uvicorn's own log records go
    through the structlog formatter that :func:`kvguard.sidecar.logconfig.configure_logging`
    installed on the root logger (``log_config=None`` keeps uvicorn from adding its own
    plain-text handlers)."""
    import gc

    import uvicorn

    app = create_app(cfg)
    # Everything imported and built so far (FastAPI, pydantic, the routes) lives as long as
    # the process: move it out of the collector's generations (CPython's gc.freeze, as
    # pre-fork servers use it), so that a full collection during a scrape walks only the
    # scrape's own objects. It took /metrics p99 from 63-133 ms to 21-25 ms (192 files).
    gc.collect()
    gc.freeze()
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        log_config=None,
        access_log=False,
        lifespan="on",
    )
    # A scrape renders in a worker thread while the event loop answers probes; a shorter
    # GIL switch interval (default 5 ms) bounds how long the loop waits for the GIL behind
    # a render, so /livez stays fast under scrape load (bench/sidecar_bench.py).
    sys.setswitchinterval(SWITCH_INTERVAL)
    stopped: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        # uvicorn restores this handler after shutdown and raise_signal()s the captured
        # signal: it then lands here instead of killing the process with 128 + n.
        signal.signal(sig, lambda s, _f: stopped.append(s))
    uvicorn.Server(config).run()
    if stopped:
        logging.getLogger("kvguard.sidecar").info("sidecar stopped on %s", signal.Signals(stopped[0]).name)
