"""The state-dir format shared by the in-engine plugin, ``kvguard run`` and the sidecar.

``KVGUARD_STATE_DIR`` is one directory (in Kubernetes a shared ``emptyDir``) with this
layout::

    $KVGUARD_STATE_DIR/
      metrics/            prometheus-client multiprocess files (``<type>_<pid>.db``),
                          written by ``guards/metrics.py``; read by the sidecar with
                          ``MultiProcessCollector(registry, path=...)``.
      fatal/<pid>.json    one record per EngineCore process that died of an exception,
                          written by ``guards/fatal.py``; read by ``kvguard run`` (exit
                          status) and the sidecar (/status, /metrics).

A fatal record is one JSON object (UTF-8, at most :data:`MAX_RECORD_BYTES`)::

    {"exception": str,        # the exception's type name, e.g. "AssertionError"
     "message": str,          # str(exception), truncated to MAX_MESSAGE_CHARS
     "site": str | null,      # kvguard check site id if an offload check failed last
     "time": float,           # unix seconds when it was recorded
     "pid": int,              # the EngineCore process id
     "vllm_version": str,     # vLLM's __version__ ("unknown" when unavailable)
     "phase": str}            # optional: "startup" or "running"

Records are written the way prometheus-client's ``mmap_dict`` and pytest's pyc cache
are: to a pid-suffixed temp file in the same directory, flushed, then ``os.replace``d,
so a reader sees either nothing or a whole record. :func:`read_fatal_records` rejects
truncated or malformed files (returns them as errors) instead of failing the caller.

This module is stdlib only: the sidecar and the supervisor import it without vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = [
    "FATAL_DIR",
    "METRICS_DIR",
    "MAX_MESSAGE_CHARS",
    "MAX_RECORD_BYTES",
    "FatalRecord",
    "StateDir",
    "StateFileError",
    "read_fatal_records",
    "write_fatal_record",
]

METRICS_DIR = "metrics"
FATAL_DIR = "fatal"
#: A message longer than this is cut (and ends with "..."): exception text can be huge
#: (whole tensors, request dumps) and the record must stay small.
MAX_MESSAGE_CHARS = 2000
#: A record file larger than this is rejected by the reader.
MAX_RECORD_BYTES = 16 * 1024

_REQUIRED: dict[str, tuple[type, ...]] = {
    "exception": (str,),
    "message": (str,),
    "site": (str, type(None)),
    "time": (int, float),
    "pid": (int,),
    "vllm_version": (str,),
}


class StateFileError(ValueError):
    """A state file that is truncated, not JSON, too large, or misses a field."""


@dataclass(frozen=True)
class FatalRecord:
    """One fatal EngineCore exception (see the module docstring for the JSON layout)."""

    exception: str
    message: str
    site: str | None
    time: float
    pid: int
    vllm_version: str = "unknown"
    phase: str | None = None

    def cause(self) -> str:
        """A one-line cause for a termination message, e.g.
        ``engine fatal: AssertionError: ... (site=swa_pending_bound, pid=123)``."""
        msg = " ".join(self.message.split())
        where = f"site={self.site}, " if self.site else ""
        phase = f" during {self.phase}" if self.phase else ""
        return f"engine fatal{phase}: {self.exception}: {msg} ({where}pid={self.pid})"

    @classmethod
    def from_exception(
        cls,
        exc: BaseException,
        *,
        site: str | None,
        pid: int,
        vllm_version: str,
        phase: str | None = None,
        now: Callable[[], float] = time.time,
    ) -> FatalRecord:
        """Build a record from an exception: type name, truncated message, ``now()``."""
        message = str(exc)
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 3] + "..."
        return cls(
            exception=type(exc).__name__,
            message=message,
            site=site,
            time=float(now()),
            pid=int(pid),
            vllm_version=vllm_version,
            phase=phase,
        )


@dataclass(frozen=True)
class StateDir:
    """Paths inside one state dir. ``root`` need not exist."""

    root: Path
    pid: Callable[[], int] = field(default=os.getpid, compare=False)

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_DIR

    @property
    def fatal(self) -> Path:
        return self.root / FATAL_DIR

    def ensure(self) -> StateDir:
        """Create ``root``, ``metrics/`` and ``fatal/`` (idempotent). Raises ``OSError``."""
        self.metrics.mkdir(parents=True, exist_ok=True)
        self.fatal.mkdir(parents=True, exist_ok=True)
        return self

    def wipe(self) -> StateDir:
        """Remove everything inside ``root`` (not ``root`` itself: it may be a mount point),
        then :meth:`ensure`. Used by ``kvguard run`` at start so a new pid never inherits
        old counts or an old fatal record. Raises ``OSError``."""
        self.root.mkdir(parents=True, exist_ok=True)
        for entry in self.root.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                try:
                    entry.unlink()
                except FileNotFoundError:
                    pass
        return self.ensure()


def write_fatal_record(state: StateDir, record: FatalRecord) -> Path:
    """Write ``record`` to ``fatal/<record.pid>.json`` atomically (temp + ``os.replace``).

    The temp file name carries the *current* pid (``state.pid()``, checked at call time,
    so a forked child never reuses its parent's temp name). Returns the final path.
    Raises ``OSError`` when the directory cannot be written.
    """
    state.fatal.mkdir(parents=True, exist_ok=True)
    final = state.fatal / f"{record.pid}.json"
    tmp = state.fatal / f".{record.pid}.json.tmp.{state.pid()}"
    data = json.dumps(asdict(record), sort_keys=True).encode()
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final


def parse_fatal_record(raw: bytes) -> FatalRecord:
    """Validate and parse one record file's bytes. Raises :class:`StateFileError`."""
    if len(raw) > MAX_RECORD_BYTES:
        raise StateFileError(f"record is {len(raw)} bytes, more than {MAX_RECORD_BYTES}")
    try:
        obj = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StateFileError(f"not a JSON record (truncated?): {e}") from None
    if not isinstance(obj, dict):
        raise StateFileError("record is not a JSON object")
    for key, types in _REQUIRED.items():
        if key not in obj:
            raise StateFileError(f"record misses field {key!r}")
        if not isinstance(obj[key], types) or isinstance(obj[key], bool):
            raise StateFileError(f"field {key!r} has type {type(obj[key]).__name__}")
    phase = obj.get("phase")
    return FatalRecord(
        exception=obj["exception"],
        message=obj["message"],
        site=obj["site"],
        time=float(obj["time"]),
        pid=obj["pid"],
        vllm_version=obj["vllm_version"],
        phase=phase if isinstance(phase, str) else None,
    )


def read_fatal_records(state: StateDir) -> tuple[list[FatalRecord], list[str]]:
    """Read every ``fatal/*.json``: ``(records sorted by time, errors)``.

    Never raises: a missing directory gives ``([], [])``; an unreadable, truncated or
    malformed file is skipped and described in ``errors`` (``"<name>: <why>"``).
    Temp files (``.*.tmp.*``) are ignored.
    """
    records: list[FatalRecord] = []
    errors: list[str] = []
    try:
        paths = sorted(p for p in state.fatal.glob("*.json") if not p.name.startswith("."))
    except OSError as e:  # pragma: no cover - glob on an unreadable dir
        return [], [f"{state.fatal}: {e}"]
    for path in paths:
        try:
            records.append(parse_fatal_record(path.read_bytes()))
        except (OSError, StateFileError) as e:
            errors.append(f"{path.name}: {e}")
    records.sort(key=lambda r: r.time)
    return records, errors
