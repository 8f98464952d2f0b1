"""sidecar/exitcode.py: the exit-status table, exhaustively (as tini's tests loop over codes)."""

from __future__ import annotations

import errno
import os
import signal

import pytest

from kvguard.guards.telemetry.statefile import FatalRecord
from kvguard.sidecar.exitcode import (
    ENGINE_FATAL,
    EXEC_NOT_EXECUTABLE,
    EXEC_NOT_FOUND,
    Exit,
    decide_exit,
    describe_command,
    signal_name,
)
from kvguard.sidecar.parts import PartDeath

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


# -- issue 23: one of vLLM's processes died while the child ran ------------------------

DEATH = PartDeath("EngineCore_DP1", 4242, 1000.0)
WORKER = PartDeath("Worker_TP1", 4250, 1000.0, parent="EngineCore")
API = "python -m vllm.entrypoints.openai.api_server"


def ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"was killed by {signal_name(os.WTERMSIG(status))}"
    return f"exited {os.WEXITSTATUS(status)}"


def every_status():
    yield from (exited(c) for c in range(256))
    yield from (killed(s) for s in range(1, signal.NSIG))


def test_a_part_death_is_engine_fatal_whatever_the_child_did_next():
    """Every exit code and every signal the child may end with after kvguard run stopped it
    (SIGTERM, SIGKILL after the grace) or after vLLM's own shutdown: 70, naming the part."""
    n = 0
    for status in every_status():
        for stop in (False, True):  # a stop requested after the death does not undo it
            got = decide_exit(status, stop, None, part_death=DEATH, child=API)
            assert got.code == ENGINE_FATAL
            assert got.cause == (
                f"vLLM process EngineCore_DP1 (pid 4242) died without a stop request; the child ({API}) then {ended(status)}"
            )
            n += 1
    assert n == 2 * (256 + signal.NSIG - 1)


def test_a_worker_death_names_its_engine():
    got = decide_exit(exited(0), False, None, part_death=WORKER)
    assert got == Exit(ENGINE_FATAL, "vLLM process Worker_TP1 (pid 4250, of EngineCore) died without a stop request; "
                                     "the child then exited 0")


def test_a_fatal_record_goes_before_or_after_the_death_by_time():
    before = FatalRecord("AssertionError", "bound", "swa_pending_bound", 999.5, 4242, "0.32.0", "running", "EngineCore_DP1")
    after = FatalRecord("RuntimeError", "Worker failed", None, 1000.5, 4240, "0.32.0", "running", "EngineCore")
    got = decide_exit(exited(0), False, before, part_death=DEATH)
    assert got.code == ENGINE_FATAL and got.cause == (
        "engine fatal during running: AssertionError: bound (site=swa_pending_bound, pid=4242, process=EngineCore_DP1); "
        "vLLM process EngineCore_DP1 (pid 4242) died without a stop request; the child then exited 0")
    got = decide_exit(killed(signal.SIGTERM), False, after, part_death=WORKER)
    assert got.code == ENGINE_FATAL and got.cause == (
        "vLLM process Worker_TP1 (pid 4250, of EngineCore) died without a stop request; "
        "engine fatal during running: RuntimeError: Worker failed (pid=4240, process=EngineCore); "
        "the child then was killed by SIGTERM")


def test_an_exec_failure_is_not_a_part_death():
    got = decide_exit(None, False, None, exec_error=FileNotFoundError(errno.ENOENT, "x", "vllm"), part_death=DEATH)
    assert got.code == EXEC_NOT_FOUND


def test_the_child_is_named_in_every_cause_that_speaks_of_it():
    assert decide_exit(killed(9), False, None, child=API).cause == f"child ({API}) killed by SIGKILL without a stop request"
    assert decide_exit(exited(0), False, None, child="vllm serve").cause == (
        "child (vllm serve) exited 0 without a stop request (vLLM exits 0 when its engine dies: vllm#48966)")
    assert decide_exit(exited(3), False, None, child="sh").cause == "child (sh) exited with status 3"
    assert decide_exit(exited(0), True, None, child="sh").cause == "stopped on request"


@pytest.mark.parametrize("argv, short", [
    (["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"], API),
    (["vllm", "serve", "/models/x", "--port=8000"], "vllm serve"),
    (["sh", "-c", "exit 3"], "sh"),
    (["/usr/bin/env"], "env"),
    (["python", "/app/serve.py"], "python"),
    (["python", "-m"], "python"),
    ([], "?"),
])
def test_describe_command(argv, short):
    assert describe_command(argv) == short
