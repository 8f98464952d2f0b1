"""``kvguard run``'s exit status, as one pure function (tini's exit rules, plus #48966).

vLLM's API server exits with status 0 when its EngineCore dies (vLLM #48966), so a
supervisor that passes the status through tells systemd ``Restart=on-failure``,
Kubernetes Jobs and "container failed" alerts that all is well. :func:`decide_exit`
turns that case into a fixed non-zero code.

The table (first matching row wins):

=====================================================  ==================  =========================
the child ...                                          exit status         cause
=====================================================  ==================  =========================
could not be started: command not found               127                 ``exec failed: ...``
could not be started: permission denied / not a file   126                 ``exec failed: ...``
was killed by signal N                                 128 + N             ``killed by SIGxxx ...``
exited 0 after a requested stop (SIGTERM/INT/HUP/QUIT) 0                   ``stopped on request``
exited (any status) and a fatal record exists          70 (``ENGINE_FATAL``)  the fatal record
exited 0, no stop requested                            70 (``ENGINE_FATAL``)  ``exited 0 without ...``
exited with status N != 0                              N                   ``exited with status N``
=====================================================  ==================  =========================

70 is ``EX_SOFTWARE`` from BSD ``sysexits.h`` ("internal software error"), unused by
vLLM, Python (1, 2) and shells (126, 127, 128+N). A fatal record outranks the child's
own exit code: the engine died of an exception, whatever the front end did next (it may
exit 0 or 1 depending on the vLLM version and timing). A signal death keeps 128 + N
(the record, if any, is added to the cause). A requested stop that ended with SIGKILL
after the grace period is a signal death (137), not a clean stop.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from kvguard.guards.statefile import FatalRecord

__all__ = [
    "ENGINE_FATAL",
    "EXEC_NOT_FOUND",
    "EXEC_NOT_EXECUTABLE",
    "Exit",
    "decide_exit",
    "signal_name",
]

#: Child exited 0 without a stop request, or an engine fatal record was found.
ENGINE_FATAL = 70
#: The command was not found (as tini and shells).
EXEC_NOT_FOUND = 127
#: The command exists but could not be executed (as tini and shells).
EXEC_NOT_EXECUTABLE = 126


@dataclass(frozen=True)
class Exit:
    """The decision: ``code`` (0..255) for ``sys.exit`` and a one-line ``cause``."""

    code: int
    cause: str


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; ``signal 99`` for a number with no name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def decide_exit(
    status: int | None,
    stop_requested: bool,
    fatal_marker: FatalRecord | None,
    *,
    exec_error: OSError | None = None,
) -> Exit:
    """Map the main child's wait status to ``kvguard run``'s exit status (table above).

    ``status`` is the raw ``os.waitpid`` status (``None`` only together with
    ``exec_error``, when the child never started); ``stop_requested`` is true once a
    SIGTERM/SIGINT/SIGHUP/SIGQUIT was forwarded; ``fatal_marker`` is the newest record
    from ``$KVGUARD_STATE_DIR/fatal`` or ``None``. Never raises for any status.
    """
    if exec_error is not None or status is None:
        err = exec_error
        if isinstance(err, FileNotFoundError):
            return Exit(EXEC_NOT_FOUND, f"exec failed: command not found: {err.filename or err}")
        code = EXEC_NOT_EXECUTABLE if isinstance(err, (PermissionError, IsADirectoryError)) else 1
        if isinstance(err, OSError) and err.errno is not None and code == 1:
            # ENOEXEC and friends: not an executable format.
            import errno

            if err.errno in (errno.ENOEXEC, errno.EACCES):
                code = EXEC_NOT_EXECUTABLE
        return Exit(code, f"exec failed: {err}")

    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        code = min(128 + sig, 255)
        how = "after a requested stop" if stop_requested else "without a stop request"
        cause = f"child killed by {signal_name(sig)} {how}"
        if fatal_marker is not None:
            cause += "; " + fatal_marker.cause()
        return Exit(code, cause)

    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1
    if code == 0 and stop_requested:
        return Exit(0, "stopped on request")
    if fatal_marker is not None:
        return Exit(ENGINE_FATAL, fatal_marker.cause())
    if code == 0:
        return Exit(
            ENGINE_FATAL,
            "child exited 0 without a stop request "
            "(vLLM exits 0 when its engine dies: vllm#48966)",
        )
    return Exit(code, f"child exited with status {code}")
