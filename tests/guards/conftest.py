"""Fixtures for the light guards tests: a clean runtime and instrumentor around each test."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvguard.guards.policy import runtime
from kvguard.guards.hooking.instrumentor import OffloadGuardInstrumentor
from kvguard.guards.reset import reset_all
from kvguard.guards.telemetry.metrics import GuardMetrics


@pytest.fixture(autouse=True)
def _clean_guards():
    OffloadGuardInstrumentor().uninstall() if OffloadGuardInstrumentor().is_installed else None
    reset_all()
    yield
    if OffloadGuardInstrumentor().is_installed:
        OffloadGuardInstrumentor().uninstall()
    runtime.unconfigure()
    reset_all()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> GuardMetrics:
    return GuardMetrics(registry=registry)
