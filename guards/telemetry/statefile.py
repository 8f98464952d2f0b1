"""The state-dir format shared by the in-engine plugin, ``kvguard run`` and the sidecar.

``KVGUARD_STATE_DIR`` is one directory (in Kubernetes a shared ``emptyDir``) with this
layout::

    $KVGUARD_STATE_DIR/
      metrics/            prometheus-client multiprocess files (``<type>_<pid>.db``),
                          written by ``guards/telemetry/metrics.py``; read by the sidecar with
                          ``MultiProcessCollector(registry, path=...)``.
      fatal/<pid>-<ms>.json  one record per EngineCore process that died of an exception
                          (``<ms>``: unix milliseconds of the record, so a pid reused by a
                          restarted container never overwrites an older record), written
                          by ``guards/policy/fatal.py``; read by ``kvguard run`` (exit status) and
                          the sidecar (/status, /metrics). Kept across ``kvguard run``
                          starts, the newest :data:`FATAL_HISTORY` only.
      run.json            the current ``kvguard run``: when its child started, whether a
                          stop was requested, how it ended (:class:`RunRecord`); the
                          sidecar reads it to tell ``starting`` and ``stopped`` from ``dead``.

Modes (the sidecar runs as another user, uid 65532 in ``deploy/k8s``): directories are
created ``0o2775`` (group-writable, setgid so new files keep the directory's group, the
pod's ``fsGroup``), every file ``0o644``, whatever the writer's umask. A reader opens
files with ``O_NOFOLLOW | O_NONBLOCK``, reads only regular files and at most a fixed
number of bytes (:func:`read_bounded`): a FIFO, a device or a symlink in the state dir is
an error, never a hang or an unbounded read.

A fatal record is one JSON object (UTF-8, at most :data:`MAX_RECORD_BYTES`)::

    {"exception": str,        # the exception's type name, e.g. "AssertionError": a Python
                              # identifier of at most MAX_LABEL_CHARS (exception_label())
     "message": str,          # str(exception), truncated to MAX_MESSAGE_CHARS
     "site": str | null,      # kvguard check site id if an offload check failed last
     "time": float,           # unix seconds when it was recorded (finite)
     "pid": int,              # the EngineCore process id
     "vllm_version": str,     # vLLM's __version__ ("unknown" when unavailable), at most
                              # MAX_LABEL_CHARS
     "phase": str,            # optional: "startup" or "running"
     "process": str}          # optional: the vLLM process name of the writer, as vLLM titled
                              # it ("EngineCore_DP1" for "VLLM::EngineCore_DP1", process_name()):
                              # a Python identifier of at most MAX_LABEL_CHARS

The reader accepts exactly what the writer can write: ``exception`` and ``vllm_version``
become Prometheus label values in the sidecar, so a record whose field is longer than the
writer's bound, whose exception is not a class name, or whose time is not finite or lies
in the future (later than the reader's clock plus :data:`MAX_CLOCK_STEP`) is rejected
with a reason (:class:`StateFileError` ``kind``), never served.

Records are written the way prometheus-client's ``mmap_dict`` and pytest's pyc cache
are: to a pid-suffixed temp file in the same directory, flushed, then ``os.replace``d,
so a reader sees either nothing or a whole record. :func:`read_fatal_records` rejects
truncated or malformed files (returns them as errors) instead of failing the caller.

This module is stdlib only: the sidecar and the supervisor import it without vLLM.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "DIR_MODE",
    "FATAL_DIR",
    "FATAL_HISTORY",
    "FILE_MODE",
    "RUN_FILE",
    "RunRecord",
    "open_regular",
    "read_bounded",
    "read_run_record",
    "write_run_record",
    "METRICS_DIR",
    "MAX_CLOCK_STEP",
    "MAX_LABEL_CHARS",
    "MAX_MESSAGE_CHARS",
    "MAX_RECORD_BYTES",
    "MAX_RUN_PARTS",
    "FatalRecord",
    "KINDS",
    "RecordError",
    "exception_label",
    "os_error_reason",
    "parse_fatal_record",
    "process_name",
    "own_process_name",
    "VLLM_TITLE_PREFIX",
    "VLLM_TITLE_PREFIX_ENV",
    "StateDir",
    "file_kind",
    "StateFileError",
    "read_fatal_records",
    "write_fatal_record",
]

METRICS_DIR = "metrics"
FATAL_DIR = "fatal"
#: Why a state file was not used: :class:`StateFileError` ``kind`` and
#: :func:`os_error_reason` values. They are the sidecar's ``reason`` label values
#: (``kvguard.guards.names.SIDECAR_REASONS``, the closed set); this module stays stdlib
#: only, so it spells them out and a test keeps the two equal.
KIND_CORRUPT = "corrupt"
KIND_TOO_LARGE = "too_large"
KIND_NOT_REGULAR = "not_regular"
KIND_INVALID_FIELD = "invalid_field"
KIND_OVERSIZED_FIELD = "oversized_field"
KIND_FUTURE_TIME = "future_time"
KIND_MISSING = "missing"
KIND_PERMISSION_DENIED = "permission_denied"
KIND_NOT_A_DIRECTORY = "not_a_directory"
KIND_IO_ERROR = "io_error"
KINDS: tuple[str, ...] = (
    KIND_CORRUPT, KIND_TOO_LARGE, KIND_NOT_REGULAR, KIND_INVALID_FIELD, KIND_OVERSIZED_FIELD,
    KIND_FUTURE_TIME, KIND_MISSING, KIND_PERMISSION_DENIED, KIND_NOT_A_DIRECTORY, KIND_IO_ERROR,
)
#: A message longer than this is cut (and ends with "..."): exception text can be huge
#: (whole tensors, request dumps) and the record must stay small.
MAX_MESSAGE_CHARS = 2000
#: A record file larger than this is rejected by the reader.
MAX_RECORD_BYTES = 16 * 1024
#: ``exception`` and ``vllm_version`` are at most this long: the sidecar serves them as
#: label values (``kvguard_engine_fatal_total{exception}``, ``kvguard_build_info``), and
#: the plugin's own ``engine_fatal`` label was already cut at 100 characters. The longest
#: exception class name in CPython's builtins has 25.
MAX_LABEL_CHARS = 100
#: A record whose ``time`` is later than the reader's clock plus this many seconds is
#: rejected (``future_time``). Writer and reader share one clock (one node; the state
#: dir is an ``emptyDir``), and the writer stamps the record before the file exists, so a
#: genuine record is never later than the reader's ``now``, unless the wall clock was
#: stepped back in between: this allows a step of a minute (an NTP correction), while a
#: record "from tomorrow" (or 1e300) can no longer latch the engine ``dead`` as if it
#: belonged to the current start.
MAX_CLOCK_STEP = 60.0
#: vLLM titles each of its processes ``<prefix>::<name>`` with setproctitle
#: (``vllm.utils.system_utils.set_process_title``): ``VLLM::EngineCore_DP1``,
#: ``VLLM::Worker_TP0``, ``VLLM::DPCoordinator``. The prefix is ``$VLLM_PROCESS_NAME_PREFIX``,
#: ``VLLM`` by default (``vllm/envs.py``).
VLLM_TITLE_PREFIX = "VLLM"
VLLM_TITLE_PREFIX_ENV = "VLLM_PROCESS_NAME_PREFIX"
#: ``run.json`` is a handful of fields.
RUN_FILE = "run.json"
MAX_RUN_BYTES = 64 * 1024
#: ``run.json`` lists at most this many of vLLM's processes (``parts``; a DP 8 x TP 8 pod
#: has 8 EngineCores, 64 workers and a coordinator).
MAX_RUN_PARTS = 256
#: Fatal records kept across ``kvguard run`` starts (the newest, by record time).
FATAL_HISTORY = 16
#: Multiprocess files kept across ``kvguard run`` starts (the newest, by mtime).
METRICS_HISTORY_FILES = 512
#: Modes of what kvguard creates in the state dir (see the module docstring).
DIR_MODE = 0o2775
FILE_MODE = 0o644

_REQUIRED: dict[str, tuple[type, ...]] = {
    "exception": (str,),
    "message": (str,),
    "site": (str, type(None)),
    "time": (int, float),
    "pid": (int,),
    "vllm_version": (str,),
}


class StateFileError(ValueError):
    """A state file that is truncated, not JSON, too large, not a regular file, misses a
    field, or holds a field the writer never writes. ``kind`` (:data:`KINDS`) is the
    sidecar's ``reason`` label: ``"corrupt"``, ``"too_large"``, ``"not_regular"``,
    ``"invalid_field"``, ``"oversized_field"`` or ``"future_time"``."""

    def __init__(self, message: str, kind: str = KIND_CORRUPT) -> None:
        super().__init__(message)
        self.kind = kind


class RecordError(NamedTuple):
    """A fatal-record path that was not read: ``name`` (``"<file>.json"``, or ``"fatal/"``
    for the directory), ``reason`` (one of :data:`KINDS`)
    and ``detail`` (free text for logs and /status). ``str()`` is ``"<name>: <detail>"``."""

    name: str
    reason: str
    detail: str

    def __str__(self) -> str:
        return f"{self.name}: {self.detail}"


def exception_label(name: str) -> str:
    """The ``exception`` field for an exception class named ``name``: ``name`` cut to
    :data:`MAX_LABEL_CHARS` (a prefix of an identifier is one), or, for a name that is not
    a Python identifier (``type("a b", (Exception,), {})``), the name with every character
    outside ``[A-Za-z0-9_]`` replaced by ``_`` (and ``_`` in front of a leading digit), so
    the reader never rejects what the writer wrote. Never raises."""
    cut = name[:MAX_LABEL_CHARS]
    if cut.isidentifier():
        return cut
    safe = "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in name)
    if not safe or safe[0].isdigit():
        safe = "_" + safe
    return safe[:MAX_LABEL_CHARS]


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
    process: str | None = None

    def cause(self) -> str:
        """A one-line cause for a termination message, e.g.
        ``engine fatal: AssertionError: ... (site=swa_pending_bound, pid=123)``; with the
        writer's vLLM process name: ``(..., pid=123, process=EngineCore_DP1)``."""
        msg = " ".join(self.message.split())
        where = f"site={self.site}, " if self.site else ""
        phase = f" during {self.phase}" if self.phase else ""
        proc = f", process={self.process}" if self.process else ""
        return f"engine fatal{phase}: {self.exception}: {msg} ({where}pid={self.pid}{proc})"

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
        process: str | None = None,
    ) -> FatalRecord:
        """Build a record from an exception: :func:`exception_label` of its type name, the
        message truncated to :data:`MAX_MESSAGE_CHARS`, ``vllm_version`` cut to
        :data:`MAX_LABEL_CHARS`, ``now()``, ``process`` kept only when it is a name
        :func:`process_name` could give: always a record :func:`parse_fatal_record` accepts."""
        message = str(exc)
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 3] + "..."
        return cls(
            exception=exception_label(type(exc).__name__),
            message=message,
            site=site,
            time=float(now()),
            pid=int(pid),
            vllm_version=vllm_version[:MAX_LABEL_CHARS],
            phase=phase,
            process=process if _valid_process(process) else None,
        )


def _valid_process(name: object) -> bool:
    return isinstance(name, str) and 0 < len(name) <= MAX_LABEL_CHARS and name.isidentifier()


def process_name(cmdline: bytes, prefix: str = VLLM_TITLE_PREFIX) -> str | None:
    """The vLLM process name in a process title: ``"EngineCore_DP1"`` for the raw
    ``/proc/<pid>/cmdline`` ``b"VLLM::EngineCore_DP1"`` (NUL separated, possibly padded
    with NULs or spaces by setproctitle); ``None`` for any other command line, and for a
    name that is not a Python identifier of at most :data:`MAX_LABEL_CHARS` (vLLM's are:
    ``Worker_DP0_PP0_PCP0_TP0_DCP0_EP0``, its longest, has 32 characters)."""
    text = cmdline.replace(b"\0", b" ").decode("utf-8", "replace").strip()
    head = f"{prefix}::"
    if not text.startswith(head):
        return None
    words = text[len(head):].split()
    name = words[0] if words else ""
    return name if _valid_process(name) else None


def own_process_name(environ: dict[str, str] | None = None) -> str | None:
    """This process's vLLM process name (:func:`process_name` of ``/proc/self/cmdline``
    with ``$VLLM_PROCESS_NAME_PREFIX``), ``None`` outside a titled vLLM process or where
    ``/proc`` cannot be read. Never raises."""
    env = os.environ if environ is None else environ
    try:
        with open("/proc/self/cmdline", "rb") as f:
            raw = f.read(4096)
    except OSError:
        return None
    return process_name(raw, env.get(VLLM_TITLE_PREFIX_ENV) or VLLM_TITLE_PREFIX)


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

    @property
    def run(self) -> Path:
        return self.root / RUN_FILE

    def ensure(self) -> StateDir:
        """Create ``root``, ``metrics/`` and ``fatal/`` (idempotent) with :data:`DIR_MODE`
        where this process owns them. Raises ``OSError``."""
        for d in (self.root, self.metrics, self.fatal):
            d.mkdir(parents=True, exist_ok=True)
            _chmod_own(d, DIR_MODE)
        return self

    def prepare_run(self) -> StateDir:
        """What ``kvguard run`` does at start, instead of wiping: :meth:`ensure`, keep the
        newest :data:`FATAL_HISTORY` fatal records and :data:`METRICS_HISTORY_FILES`
        multiprocess files (each process writes its own files, so the counters of earlier
        starts stay apart and keep their totals), remove temp files. Raises ``OSError``
        when the dirs cannot be created."""
        self.ensure()
        self.prune_fatal()
        self.prune_metrics()
        return self

    def prune_metrics(self, keep: int = METRICS_HISTORY_FILES) -> list[Path]:
        """Remove all but the newest ``keep`` ``metrics/*.db`` files (by mtime). Removing
        a counter file lowers the merged total, which Prometheus reads as a counter reset.
        Returns the removed paths. Never raises."""
        try:
            entries = [e for e in os.scandir(self.metrics) if e.name.endswith(".db")]
            entries.sort(key=lambda e: e.stat(follow_symlinks=False).st_mtime_ns)
        except OSError:
            return []
        removed: list[Path] = []
        for e in entries[: max(0, len(entries) - keep)]:
            try:
                os.unlink(e.path)
                removed.append(Path(e.path))
            except OSError:
                pass
        return removed

    def prune_fatal(self, keep: int = FATAL_HISTORY) -> list[Path]:
        """Remove all but the newest ``keep`` fatal records (by record time, unreadable
        files first) and leftover temp files. Returns the removed paths. Never raises."""
        records, _ = read_fatal_records(self, limit=None)
        keep_names = {r_path.name for r_path in [_record_path(self, r) for r in records[-keep:]]} if keep else set()
        removed: list[Path] = []
        try:
            entries = list(self.fatal.iterdir())
        except OSError:
            return removed
        for entry in entries:
            if entry.name in keep_names:
                continue
            try:
                entry.unlink()
                removed.append(entry)
            except OSError:
                pass
        return removed

    def wipe(self) -> StateDir:
        """Remove everything inside ``root`` (not ``root`` itself: it may be a mount point),
        then :meth:`ensure` (tests and tools; ``kvguard run`` keeps the history with
        :meth:`prepare_run`). Raises ``OSError``."""
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


def _chmod_own(path: Path, mode: int) -> None:
    """chmod ``path`` when this process owns it (another user's directory is left as is)."""
    try:
        if os.stat(path).st_uid == os.geteuid():
            os.chmod(path, mode)
    except OSError:
        pass


def _atomic_write(directory: Path, name: str, data: bytes, tmp_pid: int) -> Path:
    tmp = directory / f".{name}.tmp.{tmp_pid}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # whatever the umask
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    final = directory / name
    os.replace(tmp, final)
    return final


def _record_path(state: StateDir, record: FatalRecord) -> Path:
    return state.fatal / f"{record.pid}-{int(record.time * 1000)}.json"


def write_fatal_record(state: StateDir, record: FatalRecord) -> Path:
    """Write ``record`` to ``fatal/<pid>-<unix ms>.json`` atomically (temp +
    ``os.replace``), mode :data:`FILE_MODE`.

    The temp file name carries the *current* pid (``state.pid()``, checked at call time,
    so a forked child never reuses its parent's temp name). Returns the final path.
    Raises ``OSError`` when the directory cannot be written.
    """
    if not state.fatal.is_dir():
        state.fatal.mkdir(parents=True, exist_ok=True)
        _chmod_own(state.fatal, DIR_MODE)
    data = json.dumps(asdict(record), sort_keys=True).encode()
    return _atomic_write(state.fatal, _record_path(state, record).name, data, state.pid())


def open_regular(path: Path | str, *, dir_fd: int | None = None) -> tuple[int, os.stat_result]:
    """``(fd, stat)`` of the regular file ``path``, opened read-only with ``O_NOFOLLOW |
    O_NONBLOCK``: a symlink, FIFO, socket or device is never followed, waited on or read.
    The caller closes ``fd``. Raises :class:`StateFileError` (``kind="not_regular"``) or
    ``OSError`` (missing, permission denied)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise StateFileError("a symlink (not followed)", kind=KIND_NOT_REGULAR) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StateFileError(f"not a regular file ({file_kind(st.st_mode)})", kind=KIND_NOT_REGULAR)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_bounded(path: Path | str, limit: int, *, dir_fd: int | None = None) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    Opened with ``O_NOFOLLOW | O_NONBLOCK``: a symlink, FIFO, socket or device is never
    followed, waited on or read. Raises :class:`StateFileError` (``kind`` is
    ``"not_regular"`` or ``"too_large"``) or ``OSError`` (missing, permission denied).
    """
    fd, st = open_regular(path, dir_fd=dir_fd)
    try:
        if st.st_size > limit:
            raise StateFileError(f"{st.st_size} bytes, more than {limit}", kind=KIND_TOO_LARGE)
        chunks = []
        left = limit + 1
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        data = b"".join(chunks)
        if len(data) > limit:
            raise StateFileError(f"more than {limit} bytes", kind=KIND_TOO_LARGE)
        return data
    finally:
        os.close(fd)


def file_kind(mode: int) -> str:
    """``"fifo"``, ``"character device"``, ... for an ``st_mode`` that is not a regular file."""
    for test, name in (
        (stat.S_ISFIFO, "fifo"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symlink"),
    ):
        if test(mode):
            return name
    return "special file"  # pragma: no cover


def parse_fatal_record(raw: bytes, now: float | None = None) -> FatalRecord:
    """Validate and parse one record file's bytes.

    ``now``: the reader's unix time; a record whose ``time`` is later than ``now +``
    :data:`MAX_CLOCK_STEP` is rejected (``None``: not checked). Raises
    :class:`StateFileError`, whose ``kind`` says why: ``too_large`` (over
    :data:`MAX_RECORD_BYTES`), ``corrupt`` (not JSON, not an object, a field missing or of
    the wrong type), ``invalid_field`` (``exception`` not a Python identifier, ``time`` not
    finite), ``oversized_field`` (``exception`` or ``vllm_version`` over
    :data:`MAX_LABEL_CHARS`, ``message`` over :data:`MAX_MESSAGE_CHARS`), ``future_time``.
    """
    if len(raw) > MAX_RECORD_BYTES:
        raise StateFileError(f"record is {len(raw)} bytes, more than {MAX_RECORD_BYTES}", kind=KIND_TOO_LARGE)
    try:
        obj = json.loads(raw.decode())
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, an int of > 4300 digits
        raise StateFileError(f"not a JSON record (truncated?): {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise StateFileError("record is not a JSON object")
    for key, types in _REQUIRED.items():
        if key not in obj:
            raise StateFileError(f"record misses field {key!r}")
        if not isinstance(obj[key], types) or isinstance(obj[key], bool):
            raise StateFileError(f"field {key!r} has type {type(obj[key]).__name__}")
    for key, limit in (("exception", MAX_LABEL_CHARS), ("vllm_version", MAX_LABEL_CHARS), ("message", MAX_MESSAGE_CHARS)):
        if len(obj[key]) > limit:
            raise StateFileError(
                f"field {key!r} has {len(obj[key])} characters, more than {limit}", kind=KIND_OVERSIZED_FIELD
            )
    if not obj["exception"].isidentifier():
        raise StateFileError(f"field 'exception' is not a class name: {obj['exception'][:40]!r}", kind=KIND_INVALID_FIELD)
    try:
        t = float(obj["time"])  # JSON's NaN, Infinity and 1e400 are floats already
    except OverflowError:  # an int beyond a float's range
        t = math.inf
    if not math.isfinite(t):
        raise StateFileError(f"field 'time' is {t}", kind=KIND_INVALID_FIELD)
    if now is not None and t > now + MAX_CLOCK_STEP:
        raise StateFileError(
            f"recorded {t - now:.6g} s in the future (more than {MAX_CLOCK_STEP:g} s)", kind=KIND_FUTURE_TIME
        )
    phase = obj.get("phase")
    process = obj.get("process")
    if process is not None and not _valid_process(process):
        kind = KIND_OVERSIZED_FIELD if isinstance(process, str) and len(process) > MAX_LABEL_CHARS else KIND_INVALID_FIELD
        raise StateFileError(f"field 'process' is not a vLLM process name: {str(process)[:40]!r}", kind=kind)
    return FatalRecord(
        exception=obj["exception"],
        message=obj["message"],
        site=obj["site"],
        time=t,
        pid=obj["pid"],
        vllm_version=obj["vllm_version"],
        phase=phase if isinstance(phase, str) else None,
        process=process,
    )


def read_fatal_records(
    state: StateDir, limit: int | None = 4 * FATAL_HISTORY, now: Callable[[], float] = time.time
) -> tuple[list[FatalRecord], list[RecordError]]:
    """Read the ``fatal/*.json`` records: ``(records sorted by time, errors)``.

    At most ``limit`` files are read (the newest by name order; ``None``: all), each at
    most :data:`MAX_RECORD_BYTES` (:func:`read_bounded`), each checked by
    :func:`parse_fatal_record` against one ``now()`` taken for the whole read. Never
    raises: a missing directory gives ``([], [])``; an unreadable directory, or an
    unreadable, special, oversized, truncated, malformed or future file is skipped and
    described in ``errors`` (:class:`RecordError`; ``str()``: ``"<name>: <why>"``). Temp
    files (``.*.tmp.*``) are ignored.
    """
    records: list[FatalRecord] = []
    errors: list[RecordError] = []
    try:
        names_ = sorted(n for n in os.listdir(state.fatal) if n.endswith(".json") and not n.startswith("."))
    except FileNotFoundError:
        return [], []
    except OSError as e:
        return [], [RecordError(f"{FATAL_DIR}/", os_error_reason(e), f"{type(e).__name__}: {e.strerror or e}")]
    if limit is not None and len(names_) > limit:
        names_ = sorted(names_, key=_name_time)[-limit:]
    t_now = now()
    for name in names_:
        try:
            records.append(parse_fatal_record(read_bounded(state.fatal / name, MAX_RECORD_BYTES), now=t_now))
        except FileNotFoundError:
            continue  # pruned meanwhile
        except OSError as e:
            errors.append(RecordError(name, os_error_reason(e), f"{type(e).__name__}: {e.strerror or e}"))
        except StateFileError as e:
            errors.append(RecordError(name, e.kind, str(e)))
    records.sort(key=lambda r: r.time)
    return records, errors


def os_error_reason(e: OSError) -> str:
    """The ``reason`` label of an ``OSError``: ``missing`` (ENOENT), ``permission_denied``
    (EACCES, EPERM), ``not_a_directory`` (ENOTDIR), ``not_regular`` (ELOOP: a symlink
    opened with ``O_NOFOLLOW``), else ``io_error``."""
    return {
        errno.ENOENT: KIND_MISSING,
        errno.EACCES: KIND_PERMISSION_DENIED,
        errno.EPERM: KIND_PERMISSION_DENIED,
        errno.ENOTDIR: KIND_NOT_A_DIRECTORY,
        errno.ELOOP: KIND_NOT_REGULAR,
    }.get(e.errno, KIND_IO_ERROR)


def _name_time(name: str) -> tuple[int, str]:
    stem = name[: -len(".json")]
    tail = stem.rsplit("-", 1)[-1]
    return (int(tail) if tail.isdigit() else 0, name)


@dataclass(frozen=True)
class RunRecord:
    """``run.json``: one ``kvguard run`` and its child, as the supervisor last wrote it.

    - ``started``: unix seconds when the child was spawned (a new value = a new start)
    - ``state``: ``"running"`` (child alive), ``"stopping"`` (a stop signal was forwarded)
      or ``"exited"`` (child reaped)
    - ``pid``: the supervisor's pid; ``child_pid``: the child's
    - ``stop_requested``: a SIGTERM/SIGINT/SIGHUP/SIGQUIT reached the supervisor
    - ``exit_status``: ``kvguard run``'s decided exit status once ``exited``, else ``None``
    - ``death``: set when ``kvguard run`` saw one of vLLM's processes die while its child
      ran and no stop was requested (:mod:`kvguard.sidecar.parts`): what died, e.g.
      ``vLLM process EngineCore_DP1 (pid 4242) died`` (at most :data:`MAX_MESSAGE_CHARS`);
      the sidecar turns the engine ``dead`` on it at once, without waiting for vLLM's
      ``/health``
    - ``parts``: vLLM's processes ``kvguard run`` watches now, ``{"name": "EngineCore_DP1",
      "pid": 866, "parent": null}`` (``parent``: the name of a worker's EngineCore), by pid,
      at most :data:`MAX_RUN_PARTS`
    """

    started: float
    state: str
    pid: int
    child_pid: int | None = None
    stop_requested: bool = False
    exit_status: int | None = None
    death: str | None = None
    parts: tuple[dict, ...] = ()

    STATES = ("running", "stopping", "exited")


def _parse_parts(raw: object) -> tuple[dict, ...]:
    """``run.json``'s ``parts``, checked as the supervisor writes them; raises
    :class:`StateFileError` (``invalid_field`` / ``oversized_field``) otherwise."""
    if not isinstance(raw, list):
        raise StateFileError(f"field 'parts' has type {type(raw).__name__}", kind=KIND_INVALID_FIELD)
    if len(raw) > MAX_RUN_PARTS:
        raise StateFileError(f"field 'parts' has {len(raw)} entries, more than {MAX_RUN_PARTS}", kind=KIND_OVERSIZED_FIELD)
    out = []
    for entry in raw:
        ok = (
            isinstance(entry, dict)
            and set(entry) == {"name", "pid", "parent"}
            and _valid_process(entry["name"])
            and isinstance(entry["pid"], int) and not isinstance(entry["pid"], bool) and entry["pid"] > 0
            and (entry["parent"] is None or _valid_process(entry["parent"]))
        )
        if not ok:
            raise StateFileError(f"field 'parts' holds {str(entry)[:60]!r}", kind=KIND_INVALID_FIELD)
        out.append({"name": entry["name"], "pid": entry["pid"], "parent": entry["parent"]})
    return tuple(out)


def write_run_record(state: StateDir, record: RunRecord) -> Path:
    """Write ``run.json`` atomically, mode :data:`FILE_MODE`. Raises ``OSError``."""
    state.root.mkdir(parents=True, exist_ok=True)
    data = json.dumps({**asdict(record), "parts": list(record.parts)}, sort_keys=True).encode()
    return _atomic_write(state.root, RUN_FILE, data, state.pid())


def read_run_record(state: StateDir, now: Callable[[], float] | None = time.time) -> RunRecord | None:
    """``run.json``, or ``None`` when there is none (no ``kvguard run``).

    ``now``: the reader's clock (unix seconds); a ``started`` later than ``now() +``
    :data:`MAX_CLOCK_STEP` is rejected (``kind="future_time"``: every fatal record would
    count as older than that start); ``None``: not checked. Raises
    :class:`StateFileError` for a malformed (``corrupt``), oversized or special file or a
    ``started`` that is not finite (``invalid_field``), and ``OSError`` when it cannot be
    read."""
    try:
        raw = read_bounded(state.run, MAX_RUN_BYTES)
    except FileNotFoundError:
        return None
    try:
        obj = json.loads(raw.decode())
        rec = RunRecord(
            started=float(obj["started"]),
            state=str(obj["state"]),
            pid=int(obj["pid"]),
            child_pid=None if obj.get("child_pid") is None else int(obj["child_pid"]),
            stop_requested=bool(obj.get("stop_requested", False)),
            exit_status=None if obj.get("exit_status") is None else int(obj["exit_status"]),
            death=obj.get("death"),
        )
        raw_parts = obj.get("parts", [])
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as e:
        raise StateFileError(f"not a run record: {type(e).__name__}: {e}") from None
    rec = replace(rec, parts=_parse_parts(raw_parts))
    if rec.death is not None and not isinstance(rec.death, str):
        raise StateFileError(f"field 'death' has type {type(rec.death).__name__}", kind=KIND_INVALID_FIELD)
    if rec.death is not None and len(rec.death) > MAX_MESSAGE_CHARS:
        raise StateFileError(
            f"field 'death' has {len(rec.death)} characters, more than {MAX_MESSAGE_CHARS}", kind=KIND_OVERSIZED_FIELD
        )
    if rec.state not in RunRecord.STATES:
        raise StateFileError(f"unknown run state {rec.state!r}")
    if not math.isfinite(rec.started):
        raise StateFileError(f"field 'started' is {rec.started}", kind=KIND_INVALID_FIELD)
    t_now = now() if now is not None else None
    if t_now is not None and rec.started > t_now + MAX_CLOCK_STEP:
        raise StateFileError(
            f"started {rec.started - t_now:.6g} s in the future (more than {MAX_CLOCK_STEP:g} s)",
            kind=KIND_FUTURE_TIME,
        )
    return rec
