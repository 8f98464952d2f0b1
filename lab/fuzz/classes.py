"""What one fuzz example found, and the stable class name of each finding.

A finding is one of (``kind``):

- ``death``: an exception escaped ``schedule()`` / ``update_from_output()`` (what kills
  EngineCore in a server, vLLM #48966). Its class is the exception type and the
  innermost vLLM function it was raised in, with the file path relative to the ``vllm``
  package and the caller's function (``via``), never a line number, so a class is the
  same across a release's patch-level line shifts:
  ``AssertionError in vllm/v1/kv_offload/mediums.py:GPULoadStoreSpec.__init__ via _build_store_jobs``
  (the qualified name is used where Python 3.11 reports one). When the innermost frame
  of the traceback is in kvguard's own code the class starts with ``kvguard-raised`` and
  the finding is a kvguard bug.
- ``stall``: the replay stopped making progress (``ReplayResult.stalled``); the class is
  ``stall`` plus the stall kind when the replay names one (``stalls[].kind``).
- ``wrong-kv``: the KV-content oracle found blocks vLLM treats as computed that do not
  hold the right tokens (``wrong_kv_blocks``), or the simulated worker received a
  ``GPULoadStoreSpec`` it cannot execute (``inconsistent_specs``, #42945): served wrong KV
  is worse than a crash.
- ``request-failed``: the engine stayed up and vLLM itself failed a request whose load
  the worker reported failed (vLLM 0.34.0's ``load_failure_policy`` "fail": the release's
  own degrade of a worker-side transfer failure). A request that ended
  with an error status (this one, or kvguard's ``request_failed`` degrade, named by its
  ``check`` class) is counted in ``requests_failed``, never as lost: it ended, with an
  error its client sees. *Lost* is a request of a surviving engine that neither finished,
  failed nor was aborted (and its dependants never arrived because of it).
- ``worse``: with the guard on, kvguard acted and the same example replayed without the
  guard ended better for some request, or kept an engine alive the guarded run lost
  (:mod:`kvguard.lab.fuzz.differential`): ``worse-than-vllm-alone after <checks>``, a
  kvguard bug.
- ``check``: with the guard on, a kvguard check failed and kvguard acted (tolerated,
  degraded, raised): ``check <check name>``. It names the vLLM bug class kvguard kept
  from killing the engine, so the guarded report says what kvguard did for it.

:func:`slug` turns a class name into a file name (``<slug>.jsonl``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import kvguard.guards as _guards
from kvguard.lab.fuzz.differential import failed_load_requests

KIND_DEATH = "death"
KIND_STALL = "stall"
KIND_WRONG_KV = "wrong-kv"
KIND_CHECK = "check"
KIND_GUARD_ERROR = "guard-error"
KIND_REQUEST_FAILED = "request-failed"
#: guard on: the same example unguarded ended better for some request or kept the engine
#: alive (:mod:`kvguard.lab.fuzz.differential`): always a kvguard bug
KIND_WORSE = "worse"
#: Directory of kvguard's guard code (the ``kvguard.guards`` package, editable or installed).
KVGUARD_DIR = os.path.dirname(os.path.abspath(_guards.__file__))
#: The lab (the replay harness and this fuzzer, the ``kvguard.lab`` package): a frame there is
#: never the guard's.
LAB_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAB_DIRS = (LAB_DIR + os.sep,)
#: The one file under the lab that stands in for guard code: the planted fault
#: (:mod:`kvguard.lab.fuzz.plant`) is what a bug in ``asserts.check`` would raise, so its
#: frame counts as the guard's (a kvguard bug), never as the lab's own failure.
PLANT_FILE = os.path.join(LAB_DIR, "fuzz", "plant.py")
#: kvguard's own code, never a vLLM frame: the guards, the lab, and in a checkout its tests
#: (``tests/vllm/`` has ``/vllm/`` in its path)
OWN_DIRS = tuple(d + os.sep for d in (KVGUARD_DIR, LAB_DIR, os.path.join(os.path.dirname(KVGUARD_DIR), "tests")))


def in_lab(filename: str) -> bool:
    """True when ``filename`` is the lab's own code (:data:`LAB_DIRS`, less :data:`PLANT_FILE`).

    An exception whose innermost frame is here is a harness error (exit 2), never the
    engine's death nor a kvguard bug.
    """
    path = os.path.abspath(filename)
    return path.startswith(LAB_DIRS) and path != PLANT_FILE


@dataclass(frozen=True)
class Frame:
    """One traceback frame: file path, function (qualified where known), line number."""

    filename: str
    name: str
    lineno: int

    @property
    def vllm_path(self) -> str | None:
        """Path relative to the ``vllm`` package (``vllm/...``), or None outside vLLM: a file
        with a ``/vllm/`` directory in its path that is not kvguard's own
        (:data:`OWN_DIRS`; its ``tests/vllm/`` helpers would otherwise pass). Not by the name
        of a checkout: a clone named ``kvguard`` keeps its environments, vLLM included,
        under ``kvguard/.venvs/`` (before, any path with ``/kvguard`` in it was "outside
        vLLM", and every death in such a clone was named ``... outside vllm``)."""
        if os.path.abspath(self.filename).startswith(OWN_DIRS):
            return None
        path = self.filename.replace("\\", "/")
        if "/vllm/" not in path:
            return None
        return path[path.rindex("/vllm/") + 1 :]

    @property
    def in_kvguard(self) -> bool:
        """True for a frame of kvguard's guard code: a file under the ``kvguard.guards``
        package outside the lab (:func:`in_lab`: the lab's own failure is a harness
        error, never a kvguard bug)."""
        path = os.path.abspath(self.filename)
        return (path.startswith(KVGUARD_DIR + os.sep) or path == PLANT_FILE) and not in_lab(path)


def frames_of(exc: BaseException) -> list[Frame]:
    """The traceback of ``exc`` as :class:`Frame` objects, outermost first.

    Function names are code objects' qualified names (``GPULoadStoreSpec.__init__``,
    Python 3.11's ``co_qualname``), so a class names the method, not only ``__init__``.
    """
    out = []
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        out.append(Frame(code.co_filename, getattr(code, "co_qualname", code.co_name), tb.tb_lineno))
        tb = tb.tb_next
    return out


def _qualname(frame: Frame) -> str:
    return frame.name


def death_class(exc_type: str, frames: list[Frame]) -> tuple[str, bool]:
    """``(class name, kvguard_raised)`` of an engine death from its traceback frames.

    ``kvguard_raised`` is true when the innermost frame is in kvguard code (kvguard itself
    raised: a kvguard bug whatever the exception).
    """
    if frames and frames[-1].in_kvguard:
        f = frames[-1]
        path = os.path.abspath(f.filename)
        base, top = (LAB_DIR, "lab/") if path == PLANT_FILE else (KVGUARD_DIR, "guards/")
        rel = top + os.path.relpath(path, base).replace(os.sep, "/")
        return f"kvguard-raised {exc_type} in {rel}:{_qualname(f)}", True
    vllm_frames = [f for f in frames if f.vllm_path is not None]
    if not vllm_frames:
        return f"{exc_type} outside vllm", False
    inner = vllm_frames[-1]
    via = next((f.name for f in reversed(vllm_frames[:-1]) if f.name not in (inner.name, "<listcomp>", "<genexpr>")), None)
    name = f"{exc_type} in {inner.vllm_path}:{_qualname(inner)}"
    if via:
        name += f" via {via}"
    return name, False


def death_class_from_site(error: str | None, error_site: str | None) -> str:
    """Class of a death from ``ReplayResult.error`` / ``error_site`` only (``path:line in func``).

    Used when no traceback was captured (e.g. a report read back from JSON); it lacks the
    ``via`` part, so :func:`death_class` is preferred.
    """
    exc_type = (error or "Exception").split(":", 1)[0].strip() or "Exception"
    if not error_site:
        return f"{exc_type} outside vllm"
    m = re.match(r"^(?P<path>.*?):\d+ in (?P<func>.*)$", error_site)
    if not m:
        return f"{exc_type} in {error_site}"
    return f"{exc_type} in {m['path']}:{m['func']}"


def slug(name: str) -> str:
    """A file-name-safe slug of a class name: lower case ``[a-z0-9._-]``, at most 100 chars.

    File paths are dropped (``vllm/v1/kv_offload/base.py:GPULoadStoreSpec.__init__`` ->
    ``gpuloadstorespec.init``), so the slug names the exception and the functions:
    ``assertionerror-in-gpuloadstorespec.init-via-offloadingconnectorscheduler.build_store_jobs``.
    """
    s = re.sub(r"[\w./-]*/([\w.]+\.py):", "", name)
    s = s.replace("__", "").replace("._", ".")
    s = re.sub(r"[^A-Za-z0-9.]+", "-", s).strip("-.").lower()
    return s[:100].rstrip("-.") or "finding"


@dataclass
class Finding:
    """One class seen in one example."""

    kind: str
    name: str
    #: kvguard itself raised, lost a request or served wrong KV (guard on): the reason, else None
    kvguard_bug: str | None = None
    detail: str = ""


@dataclass
class ExampleOutcome:
    """Everything the runner keeps of one example (a replay)."""

    findings: list[Finding] = field(default_factory=list)
    steps: int = 0
    submitted: int = 0
    finished: int = 0
    engine_survived: bool = True
    requests_lost: int = 0
    #: requests of a surviving engine that ended with an error status (``FINISHED_ERROR``):
    #: by vLLM itself (a failed load, 0.34.0) or by kvguard's ``request_failed`` degrade;
    #: ended, so never lost
    requests_failed: int = 0
    wrong_kv_blocks: int = 0
    kvguard_death: bool = False
    #: what kvguard did (guard on): action -> count (tolerated, store_dropped, ..., raised)
    actions: dict[str, int] = field(default_factory=dict)
    guard_errors: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    error_site: str | None = None
    invalid: str | None = None
    #: the lab itself failed (:func:`kvguard.lab.replay.harness.harness_error_of`):
    #: ``{"exception", "traceback", "expected"}``; not a finding, the run stops
    harness_error: dict[str, str] | None = None
    #: kvguard's counted check evaluations (``runtime.snapshot()`` ``evaluated``; 0 unguarded)
    checks_evaluated: int = 0
    #: copy-coverage skips that could admit a load the check never read: a lookup of a
    #: scheduler whose stores are not recorded (``store_path``), or a store the full ledger
    #: let through unrecorded under ``observe`` (``ledger_full``; under guard/strict that
    #: store is refused, so no reader can load it). Issue 42's "0 skips that could admit a load"
    unchecked_copy_admits: int = 0
    #: guard on, kvguard acted and the runner replayed the example unguarded too: the
    #: comparison (:class:`kvguard.lab.fuzz.differential.Verdict`), else None
    differential: Any = None

    @property
    def classes(self) -> set[str]:
        return {f.name for f in self.findings}


def _stall_kinds(result: Any) -> list[str]:
    stalls = getattr(result, "stalls", None) or []
    kinds = []
    for s in stalls:
        kind = s.get("kind") if isinstance(s, dict) else getattr(s, "kind", None)
        if kind:
            kinds.append(str(kind))
    return sorted(set(kinds))


def _wrong_kv(result: Any) -> int:
    value = getattr(result, "wrong_kv_blocks", None)
    if isinstance(value, list):
        return len(value)
    if isinstance(value, int):
        return value
    return 0


def unchecked_copy_admits(checks: dict[str, Any], policy: str | None) -> int:
    """Copy-coverage skips in ``checks`` (a replay's ``checks``, with ``skipped`` by reason)
    that could let a load through unread: every ``store_path`` skip (a hit admitted with no
    store record to read), and ``ledger_full`` skips under ``observe`` only (under guard and
    strict the store the ledger had no room for is refused: its chunks are never
    published). Other reasons are counted where they happen and are not copy coverage."""
    from kvguard.guards import names

    skipped = (checks.get(names.CHECK_COPY_COVERAGE) or {}).get("skipped") or {}
    n = int(skipped.get(names.SKIP_STORE_PATH, 0))
    if policy == names.POLICY_OBSERVE:
        n += int(skipped.get(names.SKIP_LEDGER_FULL, 0))
    return n


def classify(result: Any, frames: list[Frame] | None, actions: dict[str, int]) -> ExampleOutcome:
    """The :class:`ExampleOutcome` of one :class:`~kvguard.lab.replay.harness.ReplayResult`.

    ``frames``: the traceback of the exception that ended the replay (None when it
    survived or none was captured); ``actions``: kvguard's decisions in this replay
    (``check:action`` -> count, from the runner's metrics tee; empty without the guard).
    A request is *lost* when the engine stayed up and the request neither finished nor
    was aborted by the trace.
    """
    if getattr(result, "harness_error", None) is not None:
        return ExampleOutcome(steps=result.steps, submitted=result.submitted, finished=result.finished,
                              harness_error=result.harness_error)
    out = ExampleOutcome(
        steps=result.steps,
        submitted=result.submitted,
        finished=result.finished,
        engine_survived=result.engine_survived,
        guard_errors=dict(result.guard_errors or {}),
        error=result.error,
        error_site=result.error_site,
    )
    guard = bool(result.guard)
    acted = bool(actions)
    out.checks_evaluated = sum(int(c.get("evaluated") or 0) for c in (result.checks or {}).values())
    if result.guard:
        out.actions = dict(actions)
        out.unchecked_copy_admits = unchecked_copy_admits(result.checks or {}, result.policy)
        if not result.engine_survived:
            out.actions["engine_died"] = 1
    if not result.engine_survived:
        exc_type = (result.error or "Exception").split(":", 1)[0].strip() or "Exception"
        if frames:
            name, kv_raised = death_class(exc_type, frames)
        else:
            name, kv_raised = death_class_from_site(result.error, result.error_site), False
        out.kvguard_death = guard and kv_raised
        bug = "kvguard code raised (innermost frame in kvguard)" if out.kvguard_death else None
        out.findings.append(Finding(KIND_DEATH, name, bug, result.error or ""))
    failed = [f.get("request_id") for f in (getattr(result, "failed_requests", None) or [])]
    failed_loads = failed_load_requests(result)
    by_vllm = [rid for rid in failed if rid in failed_loads]
    if result.engine_survived:
        out.requests_failed = len(failed)
        if by_vllm:
            out.findings.append(Finding(KIND_REQUEST_FAILED, "request-failed after its load failed", None,
                                        f"{len(by_vllm)} request(s): {', '.join(by_vllm[:3])}"))
    ended = result.finished + getattr(result, "aborted", 0) + out.requests_failed
    if result.engine_survived and (result.stalled or ended < result.submitted):
        out.requests_lost = result.submitted - ended
        kinds = _stall_kinds(result)
        name = "stall" + (f" {'+'.join(kinds)}" if kinds else "")
        bug = None
        if guard and acted:
            bug = f"{out.requests_lost} request(s) lost after kvguard acted ({', '.join(sorted(actions))})"
        out.findings.append(Finding(KIND_STALL, name, bug, f"{result.finished}/{result.submitted} finished"))
    wrong = _wrong_kv(result)
    worker = getattr(result, "worker", None)
    bad_specs = len(getattr(worker, "inconsistent_specs", []) or []) if worker is not None else 0
    out.wrong_kv_blocks = wrong
    if wrong:
        out.findings.append(
            Finding(KIND_WRONG_KV, "wrong-kv blocks", "served wrong KV with the guard on" if guard else None, f"{wrong} blocks")
        )
    if bad_specs:
        out.findings.append(
            Finding(
                KIND_WRONG_KV,
                "wrong-kv inconsistent GPULoadStoreSpec",
                "an inconsistent spec reached the worker with the guard on" if guard else None,
                f"{bad_specs} specs",
            )
        )
    if guard and out.guard_errors:
        stages = ",".join(sorted(out.guard_errors))
        out.findings.append(
            Finding(KIND_GUARD_ERROR, f"kvguard guard_errors {stages}", f"guard_errors {out.guard_errors}", "")
        )
    if guard:
        for key in sorted(actions):
            check = key.split(":", 1)[0]
            name = f"check {check}"
            if name not in out.classes:
                out.findings.append(Finding(KIND_CHECK, name, None, key))
    return out
