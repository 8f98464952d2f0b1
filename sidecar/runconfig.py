"""Settings of ``kvguard run``, stdlib only: it is imported before vLLM starts.

``kvguard run`` is the container's PID 1 and every millisecond it spends importing delays
vLLM, so its config is a plain dataclass (not pydantic-settings, which costs about a
quarter of a second to import). The rules are the sidecar's (:mod:`kvguard.sidecar.config`):
one field per flag, ``KVGUARD_<FIELD>`` as the fallback, a bad value raises
:class:`ConfigError` naming the setting as its variable and its flag.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_TERMINATION_LOG", "ConfigError", "SupervisorConfig", "load_run_config"]

DEFAULT_TERMINATION_LOG = Path("/dev/termination-log")


class ConfigError(ValueError):
    """A setting with a bad value. ``setting`` is the environment variable name."""

    def __init__(self, setting: str, flag: str, reason: str) -> None:
        self.setting = setting
        self.flag = flag
        self.reason = reason
        super().__init__(f"invalid setting {setting} ({flag}): {reason}")


def _bad(field: str, reason: str) -> ConfigError:
    if field == "command":
        return ConfigError("CMD", "argument", reason)
    return ConfigError("KVGUARD_" + field.upper(), "--" + field.replace("_", "-"), reason)


@dataclass(frozen=True)
class SupervisorConfig:
    """``kvguard run -- CMD ARGS...``: the child command and how to end it.

    Fields:

    - ``command``: the argv to run (required, non-empty; no environment variable).
    - ``termination_log``: where the one-line cause goes (Kubernetes'
      ``terminationMessagePath``, default ``/dev/termination-log``); skipped quietly when
      it cannot be written.
    - ``grace``: seconds between the first forwarded stop signal and SIGKILL to the
      child's process group (default 30, 0..3600).
    - ``state_dir``: ``KVGUARD_STATE_DIR``; prepared at start (history kept, see
      :meth:`kvguard.guards.telemetry.statefile.StateDir.prepare_run`), ``run.json`` written, exported
      to the child. ``None`` disables fatal-record detection.
    - ``fatal_wait``: after the child exits 0 unrequested, seconds to wait for a fatal
      record to appear (an EngineCore may still be writing it), default 0.5 (0..60).
    - ``watch_processes``: watch vLLM's processes below the child (``EngineCore_DP1``,
      ``Worker_TP1``, ...: :mod:`kvguard.sidecar.parts`) and stop the child when one dies
      (default on). Off for a vLLM that survives a dead rank by itself (vLLM's
      ``--enable-fault-tolerance``, which can scale a failed data-parallel EngineCore down).
      From the environment: ``1``/``0``, ``true``/``false``, ``yes``/``no``, ``on``/``off``.

    Values are coerced (``str`` paths to ``Path``, numbers to ``float``) and validated at
    construction: :class:`ConfigError` names the first bad one.
    """

    command: tuple[str, ...] = ()
    termination_log: Path = DEFAULT_TERMINATION_LOG
    grace: float = 30.0
    state_dir: Path | None = None
    fatal_wait: float = 0.5
    watch_processes: bool = True

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("command", tuple(str(a) for a in (self.command or ())))
        if not self.command:
            raise _bad("command", "no command given: kvguard run [OPTIONS] -- CMD [ARGS]...")
        put("termination_log", Path(self.termination_log))
        if self.state_dir is not None:
            put("state_dir", Path(self.state_dir))
        put("watch_processes", _boolean("watch_processes", self.watch_processes))
        for name, lo, hi in (("grace", 0, 3600), ("fatal_wait", 0, 60)):
            raw = getattr(self, name)
            try:
                value = float(raw)
            except (TypeError, ValueError):
                raise _bad(name, f"Input should be a valid number, got {raw!r}") from None
            if not lo <= value <= hi:
                raise _bad(name, f"must be >= {lo} and <= {hi} seconds")
            put(name, value)


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _boolean(name: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise _bad(name, f"must be a boolean (1/0, true/false, yes/no, on/off), got {raw!r}")


def load_run_config(**given: Any) -> SupervisorConfig:
    """Build :class:`SupervisorConfig` from ``KVGUARD_<FIELD>`` variables plus the
    non-``None`` keyword values (a given value wins). Raises :class:`ConfigError`."""
    kwargs: dict[str, Any] = {}
    for f in fields(SupervisorConfig):
        if f.name == "command":
            continue
        env = os.environ.get("KVGUARD_" + f.name.upper())
        if env is not None and env != "":
            kwargs[f.name] = env
    kwargs.update({k: v for k, v in given.items() if v is not None})
    return SupervisorConfig(**kwargs)
