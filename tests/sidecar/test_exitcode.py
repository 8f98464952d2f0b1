"""sidecar/exitcode.py: the exit-status table, exhaustively (as tini's tests loop over codes)."""

from __future__ import annotations

import errno
import os
import signal

import pytest

from kvguard.guards.statefile import FatalRecord
from kvguard.sidecar.exitcode import ENGINE_FATAL, EXEC_NOT_EXECUTABLE, EXEC_NOT_FOUND, decide_exit

FATAL = FatalRecord("AssertionError", "bound", "swa_pending_bound", 1.0, 77, "0.25.1", "running")


def exited(code: int) -> int:
    return code << 8  # a wait status as os.waitpid returns it


def killed(sig: int) -> int:
    return sig


def test_engine_fatal_is_a_fixed_code_unused_by_shells_and_python():
    assert ENGINE_FATAL == 70
    assert ENGINE_FATAL not in (0, 1, 2, 126, 127) and ENGINE_FATAL < 128


@pytest.mark.parametrize("stop", [False, True])
def test_every_nonzero_status_passes_through(stop):
    for code in range(1, 256):
        got = decide_exit(exited(code), stop, None)
        assert (got.code, got.cause) == (code, f"child exited with status {code}")


def test_exit_zero_without_stop_request_is_engine_fatal():
    got = decide_exit(exited(0), False, None)
    assert got.code == ENGINE_FATAL
    assert "exited 0 without a stop request" in got.cause and "48966" in got.cause


def test_exit_zero_after_stop_request_is_zero():
    assert decide_exit(exited(0), True, None).code == 0
    assert decide_exit(exited(0), True, FATAL).code == 0


@pytest.mark.parametrize("code", [0, 1, 3, 255])
def test_fatal_record_outranks_the_exit_code(code):
    got = decide_exit(exited(code), False, FATAL)
    assert got.code == ENGINE_FATAL
    assert got.cause == "engine fatal during running: AssertionError: bound (site=swa_pending_bound, pid=77)"


def test_every_signal_gives_128_plus_n():
    for sig in range(1, signal.NSIG):
        for stop in (False, True):
            got = decide_exit(killed(sig), stop, None)
            assert got.code == 128 + sig
            assert got.cause.startswith("child killed by ")


def test_signal_death_keeps_its_code_and_adds_the_fatal_cause():
    got = decide_exit(killed(signal.SIGKILL), False, FATAL)
    assert got.code == 137
    assert got.cause == (
        "child killed by SIGKILL without a stop request; "
        "engine fatal during running: AssertionError: bound (site=swa_pending_bound, pid=77)"
    )


def test_sigterm_death_is_143():
    assert decide_exit(killed(signal.SIGTERM), True, None).code == 143


@pytest.mark.parametrize(
    "err, code",
    [
        (FileNotFoundError(errno.ENOENT, "No such file", "vllm"), EXEC_NOT_FOUND),
        (PermissionError(errno.EACCES, "Permission denied", "/x"), EXEC_NOT_EXECUTABLE),
        (OSError(errno.ENOEXEC, "Exec format error"), EXEC_NOT_EXECUTABLE),
        (OSError(errno.E2BIG, "Argument list too long"), 1),
    ],
)
def test_exec_failures(err, code):
    got = decide_exit(None, False, None, exec_error=err)
    assert got.code == code and got.cause.startswith("exec failed")


def test_real_wait_statuses_agree(tmp_path):
    """The helpers above build the statuses os.waitpid really returns."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os._exit(42)
    assert os.waitpid(pid, 0)[1] == exited(42)
