"""The one reset (guards/reset.py) calls every module-level ``reset()`` of the engine half,
found from the source, and really forgets: counts taken before are gone after."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from kvguard.guards import names
from kvguard.guards import reset as guard_reset
from kvguard.guards.checks import wait_bound
from kvguard.guards.policy import recompute
from kvguard.guards.telemetry import counts

GUARDS = Path(__file__).resolve().parents[2] / "guards"


def _resets_in_source() -> set[str]:
    found = set()
    for path in GUARDS.rglob("*.py"):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.FunctionDef) and n.name == "reset" for n in tree.body):
            parts = [p for p in path.relative_to(GUARDS).with_suffix("").parts if p != "__init__"]
            found.add(".".join(["kvguard.guards", *parts]))
    return found


def test_every_reset_of_the_engine_half_is_called_by_the_one_reset():
    modules = _resets_in_source()
    assert {"kvguard.guards.telemetry.counts", "kvguard.guards.policy.recompute"} <= modules  # the scan works
    called = {f.__module__ for f in guard_reset.RESETS}
    assert modules - called == set()
    for name in modules:  # each is that module's own function, not a stale alias
        assert importlib.import_module(name).reset in guard_reset.RESETS


def test_the_one_reset_forgets_what_was_counted():
    counts.count_eval(names.CHECK_SWA_PENDING_BOUND)
    wait_bound._bump("evaluated")
    with recompute._lock:
        recompute._stats["marked"] = 3
    assert counts.snapshot()[names.CHECK_SWA_PENDING_BOUND]["evaluated"] >= 1
    assert wait_bound.snapshot() and recompute.snapshot()
    guard_reset.reset_all()
    assert wait_bound.snapshot() == {} and recompute.snapshot() == {}
    assert counts.snapshot()[names.CHECK_SWA_PENDING_BOUND]["evaluated"] == 0
