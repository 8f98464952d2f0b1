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


@pytest.fixture
def fake_vllm():
    from sidecartools import FakeVllm

    f = FakeVllm()
    yield f
    f.stop()


@pytest.fixture
def sidecar_proc():
    from sidecartools import SidecarProc

    started: list[SidecarProc] = []

    def start(*args, **kw) -> SidecarProc:
        side = SidecarProc(*args, **kw)
        started.append(side)
        return side

    yield start
    for side in started:
        side.kill()
