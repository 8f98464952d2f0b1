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
ran while one of vLLM's processes died, no stop        70 (``ENGINE_FATAL``)  ``vLLM process ... died ...``
requested before (kvguard run then stopped the child)
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

A vLLM process that dies while the child runs (an ``EngineCore_DP1``, a ``Worker_TP1``,
the ``DPCoordinator``: :mod:`kvguard.sidecar.parts`) is an engine death whatever the
child does next: vLLM notices it late or not at all (a dead ``EngineCore_DP1`` turns
``/health`` 503 after about 5 s, and the API server then exits 0: vLLM #54914, #48966),
so ``kvguard run`` stops the child itself and exits 70 naming the process. Its cause
comes first and a fatal record, if any, is put before or after it by time (an EngineCore
records its exception, then exits). Where the supervisor knows its child's command
(``child``, :func:`describe_command`), every cause names it: ``child (python -m
vllm.entrypoints.openai.api_server) killed by SIGKILL ...``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass

from kvguard.guards.telemetry.statefile import FatalRecord
from kvguard.sidecar.parts import PartDeath

__all__ = [
    "ENGINE_FATAL",
    "EXEC_NOT_FOUND",
    "EXEC_NOT_EXECUTABLE",
    "Exit",
    "decide_exit",
    "describe_command",
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


def describe_command(argv: Sequence[str]) -> str:
    """A short name for a command line: the program's base name, plus ``-m MODULE`` or a
    first argument that reads as a subcommand (no leading ``-``, no ``/``):
    ``python -m vllm.entrypoints.openai.api_server``, ``vllm serve``, ``sh``."""
    if not argv:
        return "?"
    prog = os.path.basename(str(argv[0])) or str(argv[0])
    if len(argv) > 2 and argv[1] == "-m":
        return f"{prog} -m {argv[2]}"
    if len(argv) > 1 and argv[1] and not argv[1].startswith("-") and "/" not in argv[1]:
        return f"{prog} {argv[1]}"
    return prog


def _ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"was killed by {signal_name(os.WTERMSIG(status))}"
    return f"exited {os.WEXITSTATUS(status) if os.WIFEXITED(status) else status}"


def decide_exit(
    status: int | None,
    stop_requested: bool,
    fatal_marker: FatalRecord | None,
    *,
    exec_error: OSError | None = None,
    part_death: PartDeath | None = None,
    child: str | None = None,
) -> Exit:
    """Map the main child's wait status to ``kvguard run``'s exit status (table above).

    ``status`` is the raw ``os.waitpid`` status (``None`` only together with
    ``exec_error``, when the child never started); ``stop_requested`` is true once a
    SIGTERM/SIGINT/SIGHUP/SIGQUIT was forwarded; ``fatal_marker`` is the newest record
    from ``$KVGUARD_STATE_DIR/fatal`` or ``None``; ``part_death``: the vLLM process the
    supervisor saw die while the child ran, before any stop request (``None``: none);
    ``child``: a short name of the child's command (:func:`describe_command`), put in
    every cause that speaks of the child. Never raises for any status.
    """
    who = f"child ({child})" if child else "child"
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

    if part_death is not None:
        pieces = [f"vLLM process {part_death.describe()} died without a stop request"]
        if fatal_marker is not None:
            if fatal_marker.time <= part_death.at:
                pieces.insert(0, fatal_marker.cause())
            else:
                pieces.append(fatal_marker.cause())
        pieces.append(f"the {who} then {_ended(status)}")
        return Exit(ENGINE_FATAL, "; ".join(pieces))

    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        code = min(128 + sig, 255)
        how = "after a requested stop" if stop_requested else "without a stop request"
        cause = f"{who} killed by {signal_name(sig)} {how}"
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
            f"{who} exited 0 without a stop request "
            "(vLLM exits 0 when its engine dies: vllm#48966)",
        )
    return Exit(code, f"{who} exited with status {code}")
