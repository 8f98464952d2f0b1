#!/usr/bin/env python3
"""Run vLLM's own offloading connector unit tests plain and with kvguard; compare (issue 5).

    .venvs/vllm-0.33.0/bin/python scripts/vllm_suite.py [--vllm-env .venvs/vllm-0.33.0]

Steps, all in one vLLM environment (the one running this script unless ``--vllm-env``):

1. ``fetch_sdist``: the sdist of the *installed* vLLM (``vllm-<version>.tar.gz``) from the
   package index (simple API, PEP 691 JSON or PEP 503 HTML, ``https://pypi.org/simple`` or
   ``--index-url`` / ``$PIP_INDEX_URL``), sha256-checked against the index, cached in
   ``~/.cache/kvguard/sdists``; a cached file with a matching ``.sha256`` needs no network.
   ``pip download --no-binary :all:`` is not used: it builds the sdist's metadata, which
   installs vLLM's build requirements (an exact torch) first.
2. ``extract_suite``: ``tests/v1/kv_connector/unit/offloading_connector/``, every
   ``conftest.py`` / ``__init__.py`` above it, the ``tests.*`` modules they import
   (transitively) and vLLM's ``pyproject.toml`` (its pytest markers), byte for byte.
3. Shim 1 (``tests/vllm_suite_shims/vllm_suite_hf_cache.py``): a local Hugging Face
   cache entry for ``facebook/opt-125m``; both runs use ``HF_HOME`` there and
   ``HF_HUB_OFFLINE=1``.
4. Two pytest runs, side by side (``--jobs``), same environment, same command, same shims
   (``-p vllm_suite_hybrid_kv -p vllm_suite_session``); only kvguard's settings differ:
   plain ``KVGUARD_DISABLE=1``, guarded ``KVGUARD_POLICY=guard``. Each writes junit XML
   and a session report (kvguard snapshot + ``$KVGUARD_STATE_DIR/metrics`` samples).
5. Compare test for test, print the table, the differing ids, the plain run's failures
   and skips with their reasons, kvguard's counters; exit 1 on any difference, on fewer
   passed than the threshold, on any kvguard guard error in the guarded run, or if kvguard
   was not active in the guarded run (or was active in the plain one). Exit 2 on a setup error.

Only the pure parts (junit parsing, comparison, report) are imported by the light test
(``tests/test_vllm_suite_script.py``); this file is stdlib only.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parent.parent
SHIMS = ROOT / "tests" / "vllm_suite_shims"
SUITE = "tests/v1/kv_connector/unit/offloading_connector"
#: The suites ``--suite`` names: vLLM's tests of each CPU offload connector's scheduler side
#: (a folder, or test files; a file a release lacks is left out). ``offloading``: the
#: OffloadingConnector's folder; ``simple``: the SimpleCPUOffloadConnector's scheduler tests
#: (``test_scheduler.py`` since 0.21.0) and its connector tests (0.34.0).
SUITES: dict[str, tuple[str, ...]] = {
    "offloading": (SUITE,),
    "simple": ("tests/v1/simple_kv_offload/test_scheduler.py",
               "tests/v1/kv_connector/unit/test_simple_cpu_offload_connector.py"),
}
DEFAULT_CACHE = Path.home() / ".cache" / "kvguard"
DEFAULT_INDEX = "https://pypi.org/simple"
# Fewest passed tests accepted in *each* run, per vLLM version (issue 5: >= 650 on 0.33.0;
# 0.25.1 ships 117 tests in the folder, 115 pass on a machine without a GPU; 0.34.0 ships
# 734, 719 pass on a machine without a GPU: docs/vllm-suite.md).
MIN_PASSED = {"0.34.0": 719, "0.33.0": 650, "0.25.1": 115}
#: the same for ``--suite simple`` (4 Dec 2026, a machine without a GPU: 0.34.0 ships 125
#: tests in its two files, 0.21.0 12 in test_scheduler.py; all pass: docs/vllm-suite.md)
MIN_PASSED_SIMPLE: dict[str, int] = {"0.34.0": 125, "0.21.0": 12}
OUTCOMES = ("passed", "failed", "error", "skipped")
PLUGINS = ("vllm_suite_hybrid_kv", "vllm_suite_session")
REPORT_ENV = "KVSUITE_REPORT"


from kvguard.guards.hooking.vllm_source import (  # noqa: E402 - re-exported for the CLI and its tests
    SourceError as SetupError,
    fetch_sdist,
    find_in_simple_page,
    index_file_entry,
    sdist_filename,
)


# --------------------------------------------------------------------------- sdist


# sdist fetching lives in kvguard.guards.hooking.vllm_source (one implementation for both).


def imported_test_modules(source: bytes, module: str, is_package: bool) -> set[str]:
    """The ``tests`` / ``tests.*`` modules a file imports (anywhere, relative ones resolved).

    ``module`` is the file's dotted name (``tests.v1.x.conftest``). For ``from a import b``
    both ``a`` and ``a.b`` are returned (``b`` may be a submodule); the caller keeps those
    that exist.
    """
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base_parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m == "tests" or m.startswith("tests.")}


def _module_files(module: str, names: set[str]) -> list[str]:
    """Files that define ``module`` and its packages' ``__init__.py``; [] if absent."""
    parts = module.split(".")
    files = []
    for i in range(1, len(parts)):
        init = "/".join(parts[:i]) + "/__init__.py"
        if init in names:
            files.append(init)
    as_module = "/".join(parts) + ".py"
    as_package = "/".join(parts) + "/__init__.py"
    if as_module in names:
        files.append(as_module)
    elif as_package in names:
        files.append(as_package)
    else:
        return []
    return files


def present_suite(files: dict[str, bytes] | set[str], suite: str | tuple[str, ...]) -> tuple[str, ...]:
    """The paths of ``suite`` (a folder or test file, or several) that the sdist has."""
    names = set(files)
    paths = (suite,) if isinstance(suite, str) else suite
    return tuple(p for p in paths if p in names or any(n.startswith(p + "/") for n in names))


def suite_closure(files: dict[str, bytes], suite: str | tuple[str, ...] = SUITE) -> list[str]:
    """The sdist files (paths relative to its root) needed to run the tests under ``suite``
    (a folder or a test file, or a tuple of them: the ones the sdist lacks are left out).

    ``files`` maps every ``.py`` / ``.toml`` path of the sdist to its bytes. Returns,
    sorted: ``pyproject.toml`` (vLLM's pytest markers); every file under ``suite``; the
    ``__init__.py`` and ``conftest.py`` of ``tests/`` and of each folder down to
    ``suite``; then, to a fixed point, the files of every ``tests.*`` module that any
    chosen file imports. Raises ``SetupError`` if ``suite`` holds no test file.
    """
    names = set(files)
    paths = (suite,) if isinstance(suite, str) else suite
    chosen = {n for n in names for p in paths if n == p or n.startswith(p + "/")}
    if not any(PurePosixPath(n).name.startswith("test_") for n in chosen):
        raise SetupError(f"the sdist has no test files under {'/, '.join(paths)}/")
    if "pyproject.toml" in names:
        chosen.add("pyproject.toml")
    for path in paths:
        parts = path.split("/")
        for i in range(1, len(parts) + 1):
            folder = "/".join(parts[:i])
            for special in ("__init__.py", "conftest.py"):
                if f"{folder}/{special}" in names:
                    chosen.add(f"{folder}/{special}")
    todo = [n for n in chosen if n.endswith(".py")]
    seen: set[str] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        is_package = path.endswith("/__init__.py")
        module = path[: -len("/__init__.py")] if is_package else path[: -len(".py")]
        module = module.replace("/", ".")
        try:
            imports = imported_test_modules(files[path], module, is_package)
        except SyntaxError as exc:
            raise SetupError(f"{path}: {exc}") from exc
        for imported in imports:
            for dep in _module_files(imported, names):
                if dep not in chosen:
                    chosen.add(dep)
                    todo.append(dep)
    return sorted(chosen)


def extract_suite(sdist: Path, dest: Path, suite: str | tuple[str, ...] = SUITE) -> list[str]:
    """Extract the suite and what it imports from ``sdist`` into a fresh ``dest``.

    Files are written byte for byte (vLLM's tests stay untouched); ``dest`` is removed
    first. Returns the extracted paths (relative to ``dest``). Raises ``SetupError`` if
    the sdist lacks the suite folder.
    """
    with tarfile.open(sdist, "r:gz") as tar:
        members = {}
        for member in tar.getmembers():
            if not member.isfile():
                continue
            rel = member.name.split("/", 1)[1] if "/" in member.name else member.name
            if rel.endswith((".py", ".toml")) and (rel.startswith("tests/") or rel == "pyproject.toml"):
                members[rel] = member
        files = {rel: tar.extractfile(m).read() for rel, m in members.items()}
    chosen = suite_closure(files, suite)
    if dest.exists():
        shutil.rmtree(dest)
    for rel in chosen:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(files[rel])
    manifest = {rel: hashlib.sha256(files[rel]).hexdigest() for rel in chosen}
    (dest / "EXTRACTED.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return chosen


# --------------------------------------------------------------------------- junit


@dataclasses.dataclass(frozen=True)
class Result:
    """One test's outcome in a junit XML file: ``outcome`` in ``OUTCOMES``, ``reason`` text."""

    test_id: str
    outcome: str
    reason: str = ""
    seconds: float = 0.0


def _first_line(text: str | None, limit: int = 240) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def parse_junit(xml_text: str) -> dict[str, Result]:
    """Parse pytest's junit XML into ``{test_id: Result}``.

    ``test_id`` is ``"<classname>::<name>"`` (``name`` keeps the parametrisation). The
    outcome is the worst element of the ``<testcase>``: ``failure`` > ``error`` >
    ``skipped`` (an xfail is a skip whose reason starts with ``xfail``) > passed.
    ``reason`` is the element's ``message`` (or first text line). Raises ``ValueError``
    on a test id that occurs twice (the comparison would be ambiguous).
    """
    root = ET.fromstring(xml_text)
    results: dict[str, Result] = {}
    for case in root.iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, reason = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            element = case.find(tag)
            if element is not None:
                outcome = name
                reason = _first_line(element.get("message") or element.text)
                if tag == "skipped" and element.get("type") == "pytest.xfail":
                    reason = "xfail: " + reason
                break
        if test_id in results:
            raise ValueError(f"test id occurs twice in junit XML: {test_id}")
        results[test_id] = Result(test_id, outcome, reason, float(case.get("time") or 0.0))
    return results


def tally(results: dict[str, Result]) -> dict[str, int]:
    """Count outcomes: ``{"passed": n, "failed": n, "error": n, "skipped": n, "total": n}``."""
    counts = Counter(r.outcome for r in results.values())
    table = {o: counts.get(o, 0) for o in OUTCOMES}
    table["total"] = len(results)
    return table


def differences(plain: dict[str, Result], guarded: dict[str, Result]) -> list[tuple[str, str, str]]:
    """Ids whose outcome differs, sorted: ``(test_id, plain_outcome, guarded_outcome)``.

    A test present in one run only has outcome ``"absent"`` in the other.
    """
    diff = []
    for test_id in sorted(set(plain) | set(guarded)):
        a = plain[test_id].outcome if test_id in plain else "absent"
        b = guarded[test_id].outcome if test_id in guarded else "absent"
        if a != b:
            diff.append((test_id, a, b))
    return diff


def format_table(
    rows: dict[str, dict[str, int]],
    seconds: dict[str, float] | None = None,
    cpu_seconds: dict[str, float] | None = None,
) -> str:
    """Text table: one row per run (``rows[name] = tally(...)``), one column per outcome,
    then wall-clock and CPU seconds of the run when given."""
    cols = (*OUTCOMES, "total")
    head = f"{'run':<10}" + "".join(f"{c:>9}" for c in cols)
    head += (f"{'wall s':>10}" if seconds else "") + (f"{'cpu s':>10}" if cpu_seconds else "")
    lines = [head, "-" * len(head)]
    for name, counts in rows.items():
        line = f"{name:<10}" + "".join(f"{counts[c]:>9}" for c in cols)
        if seconds:
            line += f"{seconds.get(name, 0.0):>10.1f}"
        if cpu_seconds:
            line += f"{cpu_seconds.get(name, 0.0):>10.1f}"
        lines.append(line)
    return "\n".join(lines)


# --------------------------------------------------------------------------- kvguard report


def counter_rows(report: dict | None) -> list[tuple[str, str, float]]:
    """kvguard's metric samples from a session report: ``(name, "k=v,...", value)``, sorted.

    Histogram buckets are left out (their ``_sum`` / ``_count`` are kept). [] if the report
    has no metrics.
    """
    rows = []
    for sample in (report or {}).get("metrics") or []:
        if sample["name"].endswith("_bucket"):
            continue
        labels = ",".join(f"{k}={v}" for k, v in sorted(sample["labels"].items()))
        rows.append((sample["name"], labels, float(sample["value"])))
    return sorted(rows)


def metric_sum(report: dict | None, name: str) -> float:
    """Sum of a metric's samples in a session report (0.0 if absent)."""
    return sum(float(s["value"]) for s in (report or {}).get("metrics") or [] if s["name"] == name)


def kvguard_activity(report: dict | None) -> dict[str, float]:
    """The figures that say whether kvguard ran: sites installed, checks evaluated, snapshot."""
    snapshot = (report or {}).get("snapshot") or {}
    return {
        "sites_installed": metric_sum(report, "kvguard_site_installed"),
        "evaluations": metric_sum(report, "kvguard_check_evaluations_total"),
        "snapshot_evaluated": float(sum(int(v.get("evaluated") or 0) for v in snapshot.values())),
        "violations": metric_sum(report, "kvguard_invariant_violations_total"),
        "guard_errors": metric_sum(report, "kvguard_guard_errors_total"),
    }


def verdict(
    plain: dict[str, Result],
    guarded: dict[str, Result],
    min_passed: int,
    plain_report: dict | None,
    guarded_report: dict | None,
) -> list[str]:
    """Reasons to fail the comparison ([] = transparent). Pure."""
    problems = []
    diff = differences(plain, guarded)
    if diff:
        problems.append(f"{len(diff)} test ids differ between the plain and the guarded run")
    for name, results in (("plain", plain), ("guarded", guarded)):
        passed = tally(results)["passed"]
        if passed < min_passed:
            problems.append(f"{name} run: {passed} passed < {min_passed} required")
    on = kvguard_activity(guarded_report)
    if on["sites_installed"] <= 0 and on["evaluations"] <= 0 and on["snapshot_evaluated"] <= 0:
        problems.append("guarded run: kvguard did not install any site nor evaluate any check")
    if (guarded_report or {}).get("errors"):
        problems.append(f"guarded run report errors: {guarded_report['errors']}")
    # a guard error is kvguard's own failure (KVGuardGuardErrors pages on it): never expected
    # in vLLM's suite (issue 20: 0.34.0 had 79 at admission before Mamba groups were modelled)
    if on["guard_errors"] > 0:
        problems.append(f"guarded run: {on['guard_errors']:g} kvguard guard errors (kvguard_guard_errors_total)")
    off = kvguard_activity(plain_report)
    if off["sites_installed"] > 0 or off["evaluations"] > 0 or off["snapshot_evaluated"] > 0:
        problems.append("plain run: kvguard was active although KVGUARD_DISABLE=1")
    return problems


# --------------------------------------------------------------------------- runs


@dataclasses.dataclass
class Run:
    """One pytest run of the suite: its name, kvguard environment and artefacts."""

    name: str
    kvguard_env: dict[str, str]
    folder: Path
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    returncode: int | None = None
    #: the test paths pytest is given (the suite's paths this sdist has)
    suite: tuple[str, ...] = (SUITE,)

    @property
    def junit(self) -> Path:
        return self.folder / "junit.xml"

    @property
    def report(self) -> Path:
        return self.folder / "session.json"

    @property
    def log(self) -> Path:
        return self.folder / "pytest.log"

    @property
    def state_dir(self) -> Path:
        return self.folder / "state"


def run_env(base: dict[str, str], run: Run, hf_home: Path) -> dict[str, str]:
    """The environment of one pytest run: ``base`` without KVGUARD_*/HF_*, plus the run's.

    Both runs get the same HF cache (offline), the shims on ``PYTHONPATH`` (only them:
    kvguard's own ``tests`` folder must not shadow vLLM's ``tests`` package), a state dir
    and the report path; only ``run.kvguard_env`` differs.
    """
    env = {k: v for k, v in base.items() if not k.startswith(("KVGUARD_", "HF_", "PYTHONPATH"))}
    env.update(
        HF_HOME=str(hf_home),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONPATH=str(SHIMS),
        KVGUARD_STATE_DIR=str(run.state_dir),
        PYTHONHASHSEED="0",
    )
    env[REPORT_ENV] = str(run.report)
    env.update(run.kvguard_env)
    return env


def pytest_command(python: Path, run: Run, extra: list[str]) -> list[str]:
    """The pytest command line, identical for both runs but for the output paths."""
    cmd = [str(python), "-m", "pytest", *run.suite, "-q", "-rfEs", "-p", "no:cacheprovider"]
    for plugin in PLUGINS:
        cmd += ["-p", plugin]
    cmd += [f"--junitxml={run.junit}", "-o", "junit_family=xunit2", *extra]
    return cmd


def execute(runs: list[Run], python: Path, src: Path, hf_home: Path, extra: list[str],
            timeout: float, jobs: int = 2) -> None:
    """Run pytest for each of ``runs`` in ``src`` (the extracted sdist), ``jobs`` at a time.

    Each run logs to ``run.log``; its wall and CPU seconds are its own (``os.wait4`` reads
    the finished child's rusage, so two concurrent runs never mix their CPU time). The
    runs share only read-only inputs (``src``, ``hf_home``); everything they write is under
    their own ``run.folder``. ``jobs=2`` (the default) runs plain and guarded side by side:
    the suite is single-threaded, so on a two-core machine that halves its wall time.
    Raises ``SetupError`` when a run wrote no junit XML, ``subprocess.TimeoutExpired`` when
    one ran past ``timeout`` seconds (it is killed first).
    """
    pending = list(runs)
    while pending:
        batch, pending = pending[:max(1, jobs)], pending[max(1, jobs):]
        started = {}
        for run in batch:
            run_, proc, log, start = _start(run, python, src, hf_home, extra)
            started[proc.pid] = (run_, proc, log, start, _killer(proc, timeout))
        while started:  # reap in the order they end, so each run's wall time is its own
            pid, status, usage = os.wait4(-1, 0)
            if pid in started:
                _finish(*started.pop(pid), status, usage, timeout)


def _killer(proc: subprocess.Popen, timeout: float) -> threading.Timer:
    timer = threading.Timer(timeout, proc.kill)
    timer.daemon = True
    timer.start()
    return timer


def _start(run: Run, python: Path, src: Path, hf_home: Path, extra: list[str]):
    if run.folder.exists():
        shutil.rmtree(run.folder)
    run.state_dir.mkdir(parents=True)
    cmd = pytest_command(python, run, extra)
    env = run_env(dict(os.environ), run, hf_home)
    print(f"[{run.name}] {' '.join(f'{k}={v}' for k, v in sorted(run.kvguard_env.items()))} "
          f"{' '.join(cmd[1:])}", flush=True)
    log = open(run.log, "wb")
    proc = subprocess.Popen(cmd, cwd=src, env=env, stdout=log, stderr=subprocess.STDOUT)
    return run, proc, log, time.monotonic()


def _finish(run: Run, proc: subprocess.Popen, log, start: float, timer: threading.Timer,
            status: int, usage, timeout: float) -> None:
    timer.cancel()
    log.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    run.seconds = time.monotonic() - start
    run.cpu_seconds = usage.ru_utime + usage.ru_stime
    if run.seconds >= timeout:
        raise subprocess.TimeoutExpired(proc.args, timeout)
    run.returncode = proc.returncode
    tail = run.log.read_bytes().decode(errors="replace").strip().splitlines()[-1:]
    print(f"[{run.name}] exit {proc.returncode} in {run.seconds:.1f} s wall, {run.cpu_seconds:.1f} s CPU: "
          f"{' '.join(tail)}", flush=True)
    if not run.junit.exists():
        raise SetupError(f"{run.name} run wrote no junit XML; see {run.log}")


def installed_vllm(python: Path) -> str:
    """The version of the ``vllm`` distribution in the environment of ``python``."""
    code = "import importlib.metadata as m; print(m.version('vllm'))"
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SetupError(f"{python}: no vllm distribution installed\n{proc.stderr.strip()}")
    return proc.stdout.strip()


def render(plain: Run, guarded: Run, p: dict[str, Result], g: dict[str, Result],
           p_report: dict | None, g_report: dict | None) -> str:
    """The human report: table, differences, plain failures/skips, kvguard counters."""
    out = io.StringIO()
    w = lambda s="": print(s, file=out)  # noqa: E731
    w(format_table({"plain": tally(p), "guarded": tally(g)},
                   {"plain": plain.seconds, "guarded": guarded.seconds},
                   {"plain": plain.cpu_seconds, "guarded": guarded.cpu_seconds}))
    diff = differences(p, g) if plain.returncode is not None and guarded.returncode is not None else []
    w()
    w(f"differing test ids: {len(diff)}")
    for test_id, a, b in diff:
        w(f"  {test_id}: plain={a} guarded={b}")
    bad = [r for r in p.values() if r.outcome != "passed"]
    w()
    w(f"plain run, not passed: {len(bad)}")
    for r in sorted(bad, key=lambda r: (r.outcome, r.test_id)):
        w(f"  {r.outcome:<8} {r.test_id}")
        w(f"           reason: {r.reason}")
    w()
    for name, rep in (("plain", p_report), ("guarded", g_report)):
        w(f"platform seen by the {name} run: {(rep or {}).get('platform')}")
    w()
    w("kvguard in the guarded run (KVGUARD_POLICY=guard):")
    w(f"  general plugins loaded: {', '.join((g_report or {}).get('general_plugins') or []) or '-'}")
    w(f"  kvguard.guards modules imported: {len((g_report or {}).get('kvguard_modules') or [])}")
    for key, value in kvguard_activity(g_report).items():
        w(f"  {key}: {value:g}")
    rows = counter_rows(g_report)
    w(f"  metric samples ($KVGUARD_STATE_DIR/metrics): {len(rows) if rows else 'none'}")
    for name, labels, value in rows:
        w(f"    {name}{{{labels}}} {value:g}")
    snapshot = (g_report or {}).get("snapshot")
    w(f"  kvguard.guards.policy.runtime.snapshot(): {'none' if snapshot is None else ''}")
    for check, fields in sorted((snapshot or {}).items()):
        w(f"    {check}: " + ", ".join(f"{k}={v}" for k, v in sorted(fields.items())))
    w()
    w("kvguard in the plain run (KVGUARD_DISABLE=1): "
      + ", ".join(f"{k}={v:g}" for k, v in kvguard_activity(p_report).items()))
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-env", type=Path, default=Path(sys.prefix),
                        help="the vLLM virtual environment (default: this interpreter's)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE,
                        help="sdists/ and vllm-suite/<version>/ go here (default ~/.cache/kvguard)")
    parser.add_argument("--index-url", default=os.environ.get("PIP_INDEX_URL", DEFAULT_INDEX))
    parser.add_argument("--min-passed", type=int, default=None,
                        help="fewest passed per run (default: per version, MIN_PASSED)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per pytest run")
    parser.add_argument("--jobs", type=int, default=2,
                        help="pytest runs at a time (default 2: plain and guarded side by side)")
    parser.add_argument("--suite", choices=sorted(SUITES), default="offloading",
                        help="which connector's tests: offloading (default) or simple (SUITES)")
    parser.add_argument("--only", choices=("plain", "guarded"), default=None,
                        help="run one side only (for debugging; never passes the comparison)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)

    # Absolute but not resolved: pytest runs with cwd=src, and resolving the venv's
    # python symlink would leave the virtual environment.
    python = Path(os.path.abspath(args.vllm_env)) / "bin" / "python"
    try:
        version = installed_vllm(python)
        thresholds = MIN_PASSED if args.suite == "offloading" else MIN_PASSED_SIMPLE
        min_passed = args.min_passed if args.min_passed is not None else thresholds.get(version)
        if min_passed is None:
            raise SetupError(f"no pass threshold known for vLLM {version}: give --min-passed")
        sdist = fetch_sdist(version, args.cache_dir / "sdists", args.index_url)
        work = args.cache_dir / "vllm-suite" / (version if args.suite == "offloading" else f"{version}-{args.suite}")
        src = work / "src"
        extracted = extract_suite(sdist, src, SUITES[args.suite])
        with tarfile.open(sdist, "r:gz") as tar:
            paths = present_suite({m.name.split("/", 1)[-1] for m in tar.getmembers()}, SUITES[args.suite])
        sys.path.insert(0, str(SHIMS))
        from vllm_suite_hf_cache import write_hf_cache_entry

        hf_home = work / "hf_home"
        shutil.rmtree(hf_home, ignore_errors=True)  # only what this run writes
        write_hf_cache_entry(hf_home)
        print(f"vLLM {version} ({python}); sdist {sdist}; {len(extracted)} files -> {src}", flush=True)
        plain = Run("plain", {"KVGUARD_DISABLE": "1"}, work / "runs" / "plain", suite=paths)
        guarded = Run("guarded", {"KVGUARD_POLICY": "guard"}, work / "runs" / "guarded", suite=paths)
        runs = [r for r in (plain, guarded) if args.only in (None, r.name)]
        execute(runs, python, src, hf_home, args.pytest_args, args.timeout, args.jobs)
    except (SetupError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"vllm_suite: setup error: {exc}", file=sys.stderr)
        return 2

    def load(run: Run) -> tuple[dict[str, Result], dict | None]:
        if run.returncode is None:
            return {}, None
        report = json.loads(run.report.read_text()) if run.report.exists() else None
        return parse_junit(run.junit.read_text()), report

    p, p_report = load(plain)
    g, g_report = load(guarded)
    print()
    print(render(plain, guarded, p, g, p_report, g_report))
    summary = {
        "vllm": version,
        "suite": args.suite,
        "runs": {r.name: {**tally(res), "seconds": round(r.seconds, 1),
                          "cpu_seconds": round(r.cpu_seconds, 1), "pytest_exit": r.returncode}
                 for r, res in ((plain, p), (guarded, g))},
        "differences": [list(d) for d in differences(p, g)],
        "kvguard_guarded": kvguard_activity(g_report),
        "kvguard_plain": kvguard_activity(p_report),
        "counters": counter_rows(g_report),
        "snapshot": (g_report or {}).get("snapshot"),
    }
    (work / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if args.only:
        print(f"--only {args.only}: no comparison")
        return 1
    problems = verdict(p, g, min_passed, p_report, g_report)
    for problem in problems:
        print(f"FAIL: {problem}")
    if not problems:
        print(f"OK: vLLM {version}: {len(p)} tests, same outcome in both runs, "
              f">= {min_passed} passed in each, kvguard active in the guarded run only")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
