"""Helpers for the sidecar tests: deadline waits and a real ``kvguard run`` process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

KVGUARD = str(Path(sys.executable).with_name("kvguard"))


def busy_wait(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.02) -> object:
    """Poll ``predicate`` until truthy (returned) or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {predicate}")
        time.sleep(interval)


class KvguardRun:
    """``kvguard run`` as a real process (own session, so signals reach only it)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None):
        self.proc = subprocess.Popen(
            [KVGUARD, "run", "--log-console", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
            cwd=cwd,
            start_new_session=True,
        )

    def wait(self, timeout: float = 30.0) -> tuple[int, str]:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        return self.proc.returncode, out

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
            self.proc.wait(10)




class FakeVllm:
    """A tiny real HTTP server on loopback that answers like vLLM's OpenAI server:
    ``/health`` (status settable), ``/v1/models``, ``/version``. Flip ``health`` to
    play an engine death; :meth:`stop` to play the API server exiting."""

    def __init__(self, version: str = "0.32.0") -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.health = 200
        self.models = 200
        self.version = version
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/health":
                    code, body = fake.health, b""
                elif self.path == "/v1/models":
                    code, body = fake.models, json.dumps({"data": [{"id": "tiny"}]}).encode()
                elif self.path == "/version":
                    code, body = 200, json.dumps({"version": fake.version}).encode()
                else:
                    code, body = 404, b""
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                pass  # a client (the sidecar) that hung up early: not worth a traceback

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SidecarProc:
    """``kvguard sidecar`` as a real process on a free loopback port (own session).

    ``foreign``: when run as root, start it without ``CAP_DAC_OVERRIDE`` and
    ``CAP_DAC_READ_SEARCH`` (util-linux ``setpriv``), so that files owned by another uid
    are read under their modes, as the manifests' sidecar (uid 65532) reads what a root
    vLLM wrote. :meth:`get` is one real HTTP request with a timeout."""

    def __init__(self, vllm_url: str, state_dir: Path | None, *args: str, foreign: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [KVGUARD, "sidecar", "--host", "127.0.0.1", "--port", str(self.port),
               "--vllm-url", vllm_url, "--poll-interval", "0.05", *args]
        if state_dir is not None:
            cmd += ["--state-dir", str(state_dir)]
        if foreign and os.geteuid() == 0:
            cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--", *cmd]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **(env or {})}, start_new_session=True, cwd="/",
        )
        busy_wait(lambda: self.get("/healthz", timeout=1).status_code == 200 if self.alive() else _dead(self))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def get(self, path: str, timeout: float = 5.0):
        import httpx

        try:
            return httpx.get(self.base + path, timeout=timeout)
        except httpx.HTTPError as e:
            return _Failed(e)

    def stop(self, timeout: float = 15.0) -> tuple[int, str]:
        import signal

        if self.alive():
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        return self.proc.returncode, out

    def kill(self) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait(10)


class _Failed:
    status_code = 0

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.text = repr(error)

    def json(self) -> dict:
        raise AssertionError(f"request failed: {self.error!r}")


def _dead(side: SidecarProc) -> bool:
    out = side.proc.stdout.read() if side.proc.stdout else ""
    raise AssertionError(f"kvguard sidecar exited {side.proc.returncode}: {out[-3000:]}")


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted label items): value}`` of a Prometheus text page."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out
