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


