"""The sidecar's FastAPI app: ``create_app(cfg)`` and ``run_sidecar(cfg)``.

Endpoints (the OpenAPI document is generated at ``/openapi.json``):

==============  ==========================================================================
``/metrics``    Prometheus text: the state dir's multiprocess files merged, plus
                ``kvguard_engine_up``, ``kvguard_engine_deaths_total``,
                ``kvguard_engine_fatal_total{exception}``, ``kvguard_build_info`` and
                ``kvguard_sidecar_errors_total{source}`` (see :mod:`kvguard.sidecar.collector`)
``/livez``      200 while vLLM's ``/health`` answers 200 and no fatal record appeared;
                503 otherwise (within ``poll_interval + health_timeout`` of a death)
``/readyz``     200 only when live and ``/v1/models`` answered 200 on the same poll
``/status``     JSON: engine state, last fatal cause, counts by check, policy, versions
``/healthz``    the sidecar itself: 200 while its poller runs
==============  ==========================================================================

No module globals: every piece of state hangs off the app built by :func:`create_app`,
so tests build as many apps as they like. The app never crashes on a missing, empty or
corrupt state dir; it serves what it can and counts the problem in
``kvguard_sidecar_errors_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel

from kvguard.guards.statefile import StateDir
from kvguard.sidecar.collector import (
    ENGINE_FATAL,
    SidecarCollector,
    StateDirCollector,
    check_counts,
)
from kvguard.sidecar.config import SidecarConfig
from kvguard.sidecar.health import HealthPoller
from kvguard.sidecar.logconfig import kvguard_version

__all__ = ["create_app", "run_sidecar"]

_SIDECAR_FAMILIES = {
    "kvguard_engine_up",
    "kvguard_engine_deaths",
    "kvguard_build_info",
    "kvguard_sidecar_errors",
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


class CheckCounts(BaseModel):
    evaluated: float
    tolerated: float
    violations: float


class EngineStatus(BaseModel):
    state: str
    live: bool
    ready: bool
    deaths: int
    last_change: float | None
    health_status: int | None
    error: str | None


class Versions(BaseModel):
    kvguard: str
    vllm: str


class StatusResponse(BaseModel):
    engine: EngineStatus
    last_fatal: FatalCause | None
    checks: dict[str, CheckCounts]
    policy: str
    versions: Versions
    state_dir: str | None
    errors: dict[str, int]


class SidecarHealth(BaseModel):
    status: str
    poller_running: bool
    last_poll_age_s: float | None


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


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
    )
    kv_version = kvguard_version()

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

    def vllm_version() -> str:
        if cfg.vllm_version:
            return cfg.vllm_version
        if poller.vllm_version:
            return poller.vllm_version
        if poller.fatal_records:
            return poller.fatal_records[-1].vllm_version
        return "unknown"

    def engine_families() -> list[Metric]:
        if state is None:
            return []
        try:
            coll = StateDirCollector(state.metrics)
        except ValueError:
            poller.count_error("metrics_dir")
            return []
        fams = list(coll.collect())
        if coll.bad_files:
            poller.count_error("metrics_file", len(coll.bad_files))
        return fams

    @app.get("/metrics", response_class=Response, summary="Prometheus metrics")
    def metrics() -> Response:
        fams = engine_families()
        fatal = next((f for f in fams if f.name == ENGINE_FATAL), None)
        fams = [f for f in fams if f.name not in _SIDECAR_FAMILIES]
        snap = poller.tracker.snapshot

        def view() -> tuple:
            return (
                snap.live,
                snap.deaths,
                list(poller.fatal_records),
                dict(poller.errors),
                kv_version,
                vllm_version(),
            )

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(fams))
        registry.register(SidecarCollector(view, fatal))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def probe_response(ok: bool, detail: str | None) -> JSONResponse:
        snap = poller.tracker.snapshot
        body = ProbeResult(status="ok" if ok else "fail", engine=snap.state.value, detail=detail)
        return JSONResponse(body.model_dump(), status_code=200 if ok else 503)

    def why_not() -> str | None:
        snap = poller.tracker.snapshot
        if poller.fatal_records:
            return poller.fatal_records[-1].cause()
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
    def livez() -> JSONResponse:
        snap = poller.tracker.snapshot
        return probe_response(snap.live, None if snap.live else why_not())

    @app.get(
        "/readyz",
        response_model=ProbeResult,
        responses={503: {"model": ProbeResult}},
        summary="200 when up and /v1/models answers",
    )
    def readyz() -> JSONResponse:
        snap = poller.tracker.snapshot
        detail = None
        if not snap.ready:
            detail = why_not() or "vLLM /v1/models did not answer 200"
        return probe_response(snap.ready, detail)

    @app.get("/status", response_model=StatusResponse, summary="Engine state and counts")
    def status() -> StatusResponse:
        snap = poller.tracker.snapshot
        p = snap.last_probe
        last = poller.fatal_records[-1] if poller.fatal_records else None
        return StatusResponse(
            engine=EngineStatus(
                state=snap.state.value,
                live=snap.live,
                ready=snap.ready,
                deaths=snap.deaths,
                last_change=snap.last_change,
                health_status=p.health_status if p else None,
                error=p.error if p else None,
            ),
            last_fatal=FatalCause(
                exception=last.exception,
                message=last.message,
                site=last.site,
                time=last.time,
                pid=last.pid,
                phase=last.phase,
            )
            if last
            else None,
            checks={k: CheckCounts(**v) for k, v in check_counts(engine_families()).items()},
            policy=cfg.policy,
            versions=Versions(kvguard=kv_version, vllm=vllm_version()),
            state_dir=str(state.root) if state else None,
            errors=dict(poller.errors),
        )

    @app.get(
        "/healthz",
        response_model=SidecarHealth,
        responses={503: {"model": SidecarHealth}},
        summary="The sidecar itself",
    )
    def healthz() -> JSONResponse:
        task: asyncio.Task | None = getattr(app.state, "poller_task", None)
        running = task is not None and not task.done()
        age = time.time() - poller.last_poll if poller.last_poll else None
        body = SidecarHealth(
            status="ok" if running else "fail", poller_running=running, last_poll_age_s=age
        )
        return JSONResponse(body.model_dump(), status_code=200 if running else 503)

    return app


def run_sidecar(cfg: SidecarConfig) -> None:
    """Serve :func:`create_app` with uvicorn on ``cfg.host:cfg.port`` until stopped
    (SIGTERM/SIGINT, uvicorn's handling). Access logs are off: probes would flood them."""
    import uvicorn

    config = uvicorn.Config(
        create_app(cfg),
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        access_log=False,
        lifespan="on",
    )
    uvicorn.Server(config).run()
