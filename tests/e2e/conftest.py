"""Fixtures for the real-server end-to-end tests: tiny models and a small fleet of servers.

Server starts are the cost (a minute or more each on 2 cores), so each scenario gets
exactly one server, and the next servers start in the background while the current test
runs (at most three at a time, to bound memory). Every server is stopped in a finally.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from e2etools import Server, make_tiny_mistral

#: vLLM's data-parallel flags for the API-server kill (issue 23): two EngineCores, a
#: coordinator and two workers to be orphaned; 0.25: with the default 0.92 each rank asks
#: for 92% of the memory and EngineCore_DP0 fails its memory check.
DP2 = ("--data-parallel-size", "2", "--gpu-memory-utilization", "0.25")

#: name -> (model key, supervised by kvguard run, with a sidecar, extra vLLM flags)
PLAN: dict[str, tuple[str, bool, bool, tuple[str, ...]]] = {
    "supervised": ("m64", True, True, ()),   # (a) normal running, then (b) EngineCore SIGKILL
    "plain": ("m64", False, False, ()),      # (b) the same kill without kvguard: exit 0 (#48966)
    "worker_crash": ("m16", True, True, ()), # (e) head_dim 16 rejected by the CPU attention kernel
    "sigterm": ("m64", True, False, ()),     # (c) clean stop
    "kill_api": ("m64", True, True, DP2),    # (d) API server of a data-parallel server SIGKILLed
}


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"m64": make_tiny_mistral(root / "m64", 64), "m16": make_tiny_mistral(root / "m16", 16)}


class Fleet:
    def __init__(self, models: dict[str, Path], root: Path) -> None:
        self.models = models
        self.root = root
        self.servers: dict[str, Server] = {}

    def start(self, *names: str) -> None:
        for name in names:
            if name not in self.servers:
                model, supervised, sidecar, extra = PLAN[name]
                self.servers[name] = Server(name, self.models[model], self.root / name, supervised, sidecar,
                                            extra=extra)

    def get(self, name: str, prefetch: tuple[str, ...] = ()) -> Server:
        # KVGUARD_E2E_PREFETCH=0 (when running one test with -k) starts only what it needs.
        if os.environ.get("KVGUARD_E2E_PREFETCH", "1") == "0":
            prefetch = ()
        self.start(name, *prefetch)
        return self.servers[name]

    def done(self, name: str) -> None:
        server = self.servers.get(name)
        if server is not None:
            server.stop()

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.stop()


@pytest.fixture(scope="module")
def fleet(models, tmp_path_factory):
    started = time.monotonic()
    f = Fleet(models, tmp_path_factory.mktemp("fleet"))
    try:
        yield f
    finally:
        f.stop_all()
        print(f"\n[e2e] module wall time (servers, incl. model creation excluded): {time.monotonic() - started:.1f}s")
