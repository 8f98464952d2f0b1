"""``kvguard run -- CMD ARGS...``: a tini-shaped PID-1 loop around vLLM.

The loop, as tini's ``main``:

1. Setup (before forking): block the forwarded signals and SIGCHLD so they are only
   collected by :func:`signal.sigtimedwait`, never delivered to handlers; become a child
   subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``) so orphaned grandchildren (an EngineCore
   whose API server was killed) are reparented to us and reaped; warn when neither PID 1
   nor a subreaper. Prepare the state dir (keep the newest fatal records and metrics
   files of earlier starts: :meth:`kvguard.guards.telemetry.statefile.StateDir.prepare_run`), write
   ``run.json`` (``running``, the start time) and export ``KVGUARD_STATE_DIR`` to the child.
2. Spawn: ``os.posix_spawnp`` with the *original* signal mask, default dispositions for
   the forwarded signals, and a new process group (``setpgroup=0``). A failed exec is
   reported as 127 (not found) or 126 (not executable).
3. Loop: wait up to :data:`TICK` seconds for a signal. SIGCHLD only leads to reaping;
   SIGTERM/SIGINT/SIGHUP/SIGQUIT (and SIGUSR1/SIGUSR2/SIGWINCH) are forwarded to the main
   child; the four stop signals also mark a *stop request* and start the grace clock.
   When ``grace`` seconds have passed since the first stop request, SIGKILL goes to the
   child's whole process group. Then ``os.waitpid(-1, WNOHANG)`` until nothing is left;
   only the main child's status counts. Each reaped pid's live multiprocess gauge files
   are removed (prometheus-client's ``mark_process_dead``, as gunicorn's ``child_exit``).
   While the child runs and no stop was requested, :class:`kvguard.sidecar.parts.PartWatch`
   looks at the descendants vLLM titled (``VLLM::EngineCore_DP1``, ``VLLM::Worker_TP0``,
   ``VLLM::DPCoordinator``, ...; every :data:`TICK`, a full ``/proc`` scan every half
   second). When one dies (vLLM #54914: a dead ``EngineCore_DP1`` leaves the API server
   answering ``/health`` 200 for about 5 s, and it then exits 0), the supervisor writes
   ``run.json`` with the death first (the sidecar's ``/livez`` turns 503 on it), then
   sends SIGTERM to the child, not as a stop request, and the grace clock starts.
4. After the main child is reaped: the rest of its process group (orphaned EngineCore,
   workers), and any part still alive outside it, gets SIGTERM, then SIGKILL after
   ``min(grace, 5)`` s; the fatal record of this start (recorded at or after
   ``run.json``'s ``started``), if any, is read;
   :func:`kvguard.sidecar.exitcode.decide_exit` picks the status, the cause goes to the
   termination log and ``run.json`` says ``exited``.

``run.json`` (:class:`kvguard.guards.telemetry.statefile.RunRecord`) tells the sidecar a new start
(fresh startup budget), a requested stop (``stopping``: the engine is ``stopped``, not
``dead``) and the end. Writing it never changes the exit status.

vLLM #48966 is why this exists: the API server exits 0 when EngineCore dies.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvguard.guards.telemetry.statefile import (
    FatalRecord,
    RunRecord,
    StateDir,
    read_fatal_records,
    write_run_record,
)
from kvguard.sidecar.runconfig import SupervisorConfig
from kvguard.sidecar.exitcode import Exit, decide_exit, describe_command, signal_name
from kvguard.sidecar.parts import PartDeath, PartWatch, title_prefix
from kvguard.sidecar.termination import write_termination_message

__all__ = ["FORWARDED", "STOP_SIGNALS", "TICK", "Supervisor", "run_supervisor"]

from kvguard.sidecar import earlysignals
from kvguard.sidecar.earlysignals import FORWARDED, STOP_SIGNALS
#: Longest wait for a signal before re-checking deadlines (tini waits one second).
TICK = 0.1
#: Longest wait for the leftovers of the child's process group after the child exited.
LEFTOVER_WAIT = 5.0

_PR_SET_CHILD_SUBREAPER = 36

class _DeferredLog:
    """structlog's logger for ``kvguard run``, imported only after the child started.

    Importing structlog (and configuring it) costs more than the whole start-up budget of
    ``kvguard run`` on a busy node, so events before :meth:`attach` are kept and replayed,
    in order, once it is called (the supervisor calls it right after the spawn). Methods:
    ``info``, ``warning``, ``error`` with structlog's ``(event, **kw)``."""

    def __init__(self) -> None:
        self._real = None
        self._held: list[tuple[str, str, dict]] = []

    def attach(self, configure=None) -> None:
        if self._real is not None:
            return
        if configure is not None:
            configure()
        import structlog

        self._real = structlog.get_logger("kvguard.run")
        held, self._held = self._held, []
        for level, event, kw in held:
            getattr(self._real, level)(event, **kw)

    def _emit(self, level: str, event: str, **kw: object) -> None:
        if self._real is None:
            self._held.append((level, event, kw))
        else:
            getattr(self._real, level)(event, **kw)

    def info(self, event: str, **kw: object) -> None:
        self._emit("info", event, **kw)

    def warning(self, event: str, **kw: object) -> None:
        self._emit("warning", event, **kw)

    def error(self, event: str, **kw: object) -> None:
        self._emit("error", event, **kw)


log = _DeferredLog()


def _set_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _mark_dead(metrics_dir: Path | None, pid: int) -> None:
    """prometheus-client's ``mark_process_dead``: remove the pid's ``gauge_live*`` files
    (both ``<pid>.db`` and kvguard's ``<pid>-<ms>.db`` names). Done here with a glob, not
    by importing prometheus-client, which would add a tenth of a second to every stop."""
    if metrics_dir is None:
        return
    try:
        for f in list(metrics_dir.glob(f"gauge_live*_{pid}.db")) + list(metrics_dir.glob(f"gauge_live*_{pid}-*.db")):
            f.unlink(missing_ok=True)
    except OSError as e:  # never let cleanup change the exit status
        log.warning("mark_process_dead_failed", pid=pid, error=str(e))


@dataclass
class Supervisor:
    """Run-time state of one ``kvguard run`` (uvicorn's ``Server``): built from a config,
    driven by :meth:`run`. Must run in the main thread (it changes the signal mask)."""

    config: SupervisorConfig
    #: called once right after the spawn (or the failed spawn), e.g. to set up logging
    after_spawn: object = None
    child_pid: int | None = None
    child_status: int | None = None
    stop_requested: bool = False
    stop_signal: int | None = None
    kill_deadline: float | None = None
    killed: bool = False
    started: float | None = None
    reaped_orphans: list[int] = field(default_factory=list)
    #: the vLLM process watch (None until the child is spawned, or after it failed)
    watch: PartWatch | None = None
    #: the first vLLM process seen dead while the child ran, before any stop request
    part_death: PartDeath | None = None

    @property
    def state(self) -> StateDir | None:
        return StateDir(self.config.state_dir) if self.config.state_dir else None

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.config.state_dir is not None:
            env["KVGUARD_STATE_DIR"] = str(self.config.state_dir)
        return env

    def _prepare_state_dir(self) -> None:
        state = self.state
        if state is None:
            return
        try:
            state.prepare_run()
            log.info("state_dir_prepared", state_dir=str(state.root))
        except OSError as e:
            log.warning("state_dir_unusable", state_dir=str(state.root), error=str(e))

    def _write_run(self, run_state: str, exit_status: int | None = None) -> None:
        state = self.state
        if state is None or self.started is None:
            return
        try:
            write_run_record(
                state,
                RunRecord(
                    started=self.started,
                    state=run_state,
                    pid=os.getpid(),
                    child_pid=self.child_pid,
                    stop_requested=self.stop_requested,
                    exit_status=exit_status,
                    death=(f"vLLM process {self.part_death.describe()} died" if self.part_death else None),
                    parts=tuple(self.watch.listing()) if self.watch is not None else (),
                ),
            )
        except OSError as e:
            log.warning("run_record_not_written", error=str(e))

    def _spawn(self, old_mask: set[int]) -> None:
        cmd = list(self.config.command)
        self.child_pid = os.posix_spawnp(
            cmd[0],
            cmd,
            self._env(),
            setpgroup=0,
            setsigmask=old_mask,
            setsigdef=FORWARDED | {signal.SIGCHLD, signal.SIGTTIN, signal.SIGTTOU},
        )
        log.info("child_started", pid=self.child_pid, command=cmd[:8])

    def _after_spawn(self) -> None:
        hook, self.after_spawn = self.after_spawn, None
        try:
            log.attach(hook if callable(hook) else None)
        except Exception:  # pragma: no cover - logging must never stop the supervisor
            pass

    def _forward(self, sig: int) -> None:
        assert self.child_pid is not None
        if sig in STOP_SIGNALS:
            first = not self.stop_requested
            if first:
                self.kill_deadline = time.monotonic() + self.config.grace
            self.stop_requested = True
            self.stop_signal = self.stop_signal or sig
            if first:
                self._write_run("stopping")
        try:
            os.kill(self.child_pid, sig)
            log.info("signal_forwarded", signal=signal_name(sig), pid=self.child_pid)
        except ProcessLookupError:
            log.warning("signal_not_forwarded_child_gone", signal=signal_name(sig))

    def _watch_parts(self) -> None:
        """One look at vLLM's processes (:class:`PartWatch`); on the first death: log it,
        tell the sidecar (``run.json``), stop the child (SIGTERM, not a stop request) and
        start the grace clock. A failure of the watch itself turns the watch off (logged),
        never the supervisor."""
        watch = self.watch
        if watch is None or self.part_death is not None or self.stop_requested or self.child_status is not None:
            return
        try:
            death = watch.poll()
        except Exception as e:  # pragma: no cover - the watch must never stop kvguard run
            self.watch = None
            log.warning("part_watch_failed", error=repr(e))
            return
        if death is None:
            if watch.changed:
                watch.changed = False
                log.info("engine_processes", processes=[f"{p['name']}:{p['pid']}" for p in watch.listing()])
                self._write_run("running")
            return
        watch.changed = False
        self.part_death = death
        log.error("engine_process_died", process=death.name, pid=death.pid, parent=death.parent,
                  alive=sorted(p.name for p in watch.parts.values()))
        self._write_run("running")
        _mark_dead(self.state.metrics if self.state else None, death.pid)
        assert self.child_pid is not None
        try:
            os.kill(self.child_pid, signal.SIGTERM)
            log.info("child_stopped_after_engine_death", signal="SIGTERM", pid=self.child_pid, grace=self.config.grace)
        except ProcessLookupError:
            pass
        if self.kill_deadline is None:
            self.kill_deadline = time.monotonic() + self.config.grace

    def _kill_parts(self, sig: int) -> int:
        """Send ``sig`` to every vLLM process still alive that the watch knows (one that left
        the child's process group, e.g. with ``setpgrp``, is not reached by ``killpg``).
        Returns how many were signalled."""
        if self.watch is None:
            return 0
        n = 0
        for part in self.watch.alive():
            try:
                os.kill(part.pid, sig)
                n += 1
            except (ProcessLookupError, PermissionError):
                pass
        return n

    def _kill_group(self, sig: int) -> bool:
        assert self.child_pid is not None
        try:
            os.killpg(self.child_pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def _reap(self) -> None:
        metrics = self.state.metrics if self.state else None
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            except InterruptedError:  # pragma: no cover
                continue
            if pid == 0:
                return
            _mark_dead(metrics, pid)
            if pid == self.child_pid:
                self.child_status = status
                log.info("child_exited", pid=pid, **_describe(status))
            else:
                self.reaped_orphans.append(pid)
                log.info("orphan_reaped", pid=pid, **_describe(status))

    def _wait_signals(self, sigset: set[int], timeout: float) -> None:
        info = signal.sigtimedwait(sigset, max(timeout, 0.001))
        if info is None or info.si_signo == signal.SIGCHLD:
            return
        self._forward(info.si_signo)

    def _finish_group(self, sigset: set[int]) -> None:
        """SIGTERM, then SIGKILL, whatever is left of the child's process group and of the
        vLLM processes the watch knows."""
        group = self._kill_group(0)
        if not group and not (self.watch is not None and self.watch.alive()):
            return
        log.info("stopping_leftover_processes", pgid=self.child_pid)
        self._kill_group(signal.SIGTERM)
        self._kill_parts(signal.SIGTERM)

        def left() -> bool:
            return self._kill_group(0) or bool(self.watch is not None and self.watch.alive())

        deadline = time.monotonic() + min(self.config.grace, LEFTOVER_WAIT)
        while time.monotonic() < deadline and left():
            signal.sigtimedwait({signal.SIGCHLD}, TICK)
            self._reap()
        if self._kill_group(signal.SIGKILL) | bool(self._kill_parts(signal.SIGKILL)):
            log.warning("leftover_processes_killed", pgid=self.child_pid)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and left():
            signal.sigtimedwait({signal.SIGCHLD}, TICK)
            self._reap()
        self._reap()

    def _fatal_marker(self) -> FatalRecord | None:
        state = self.state
        if state is None:
            return None
        status = self.child_status
        wait = (
            self.config.fatal_wait
            if status is not None and os.WIFEXITED(status) and not self.stop_requested
            else 0.0
        )
        deadline = time.monotonic() + wait
        since = self.started if self.started is not None else float("-inf")
        while True:
            records, errors = read_fatal_records(state)
            for err in errors:
                log.warning("fatal_record_unreadable", error=str(err), reason=err.reason)
            records = [r for r in records if r.time >= since]  # this start's only
            if records or time.monotonic() >= deadline:
                return records[-1] if records else None
            time.sleep(0.05)

    def run(self) -> Exit:
        """Spawn, supervise and reap the command; return the decided :class:`Exit`.

        Blocks the forwarded signals and SIGCHLD for the duration and restores the mask
        after. Never raises for anything the child does.
        """
        sigset = set(earlysignals.COLLECTED)
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, sigset)
        early = earlysignals.original_mask()
        child_mask = set(early) if early is not None else set(old_mask)
        try:
            if os.getpid() != 1 and not _set_subreaper():
                log.warning("not_pid1_nor_subreaper", detail="orphaned grandchildren are not reaped")
            self._prepare_state_dir()
            self.started = time.time()
            pending = signal.sigpending() & STOP_SIGNALS
            if pending:
                # a stop arrived while starting up (kept pending by the early block): stop
                # cleanly without starting the child at all
                sig = signal.sigtimedwait(pending, 0)
                self.stop_requested = True
                self.stop_signal = sig.si_signo if sig is not None else min(pending)
                log.attach()
                log.info("stopped_before_start", signal=signal_name(self.stop_signal))
                result = Exit(0, f"stopped on request ({signal_name(self.stop_signal)}) before the child started")
                self._write_run("exited", result.code)
                return result
            self._write_run("running")
            try:
                self._spawn(child_mask)
            except OSError as e:
                self._after_spawn()
                log.error("exec_failed", command=list(self.config.command), error=str(e))
                result = decide_exit(None, False, None, exec_error=e)
                self._write_run("exited", result.code)
                return result
            self._after_spawn()
            if self.config.watch_processes:
                try:
                    self.watch = PartWatch(root=os.getpid(), prefix=title_prefix(self._env()))
                except Exception as e:  # pragma: no cover
                    log.warning("part_watch_failed", error=repr(e))
            while self.child_status is None:
                timeout = TICK
                if self.kill_deadline is not None and not self.killed:
                    left = self.kill_deadline - time.monotonic()
                    if left <= 0:
                        log.warning("grace_expired_sigkill", grace=self.config.grace)
                        self._kill_group(signal.SIGKILL)
                        self.killed = True
                    else:
                        timeout = min(timeout, left)
                self._wait_signals(sigset, timeout)
                self._reap()
                self._watch_parts()
            self._finish_group(sigset)
            result = decide_exit(
                self.child_status,
                self.stop_requested,
                self._fatal_marker(),
                part_death=self.part_death,
                child=describe_command(self.config.command),
            )
            self._write_run("exited", result.code)
            return result
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _describe(status: int) -> dict[str, object]:
    if os.WIFSIGNALED(status):
        return {"signal": signal_name(os.WTERMSIG(status))}
    if os.WIFEXITED(status):
        return {"exit_status": os.WEXITSTATUS(status)}
    return {"wait_status": status}  # pragma: no cover


def run_supervisor(config: SupervisorConfig, log_level: str | None = None, log_json: bool = True) -> int:
    """Run ``config.command`` under the supervisor; return the exit status (0..255).

    ``log_level``: when given, logging is configured (:func:`kvguard.sidecar.logconfig.configure_logging`)
    right after the child started, not before; ``None``: the caller configured it.
    Writes the one-line cause to ``config.termination_log`` (quietly skipped when not
    writable) and logs it as ``kvguard_run_exit``.
    """
    configure = None
    if log_level is not None:

        def configure() -> None:
            from kvguard.sidecar.logconfig import configure_logging

            configure_logging(log_level, log_json)

    result = Supervisor(config, after_spawn=configure).run()
    log.attach()
    written = write_termination_message(config.termination_log, result.cause)
    log.info(
        "kvguard_run_exit",
        exit_status=result.code,
        cause=result.cause,
        termination_log=str(config.termination_log) if written else None,
    )
    return result.code

