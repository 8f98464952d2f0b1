"""Fixtures for the sidecar tests (helpers live in sidecartools.py)."""

from __future__ import annotations

import pytest
from sidecartools import KvguardRun


@pytest.fixture
def kvguard_run():
    started: list[KvguardRun] = []

    def start(args: list[str], **kw: object) -> KvguardRun:
        run = KvguardRun(args, **kw)  # type: ignore[arg-type]
        started.append(run)
        return run

    yield start
    for run in started:
        run.kill()
