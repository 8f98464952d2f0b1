"""Discovery against the installed vLLM's own source (run in each .venvs/vllm-* env, issue 8).

No table: the expected sites are what :func:`kvguard.guards.hooking.sites.discover` finds in each
in-scope module's file, and the proof is that the installed guard rewrote all of them
(every rewritten function's code reads kvguard's injected check), matched every special
site, and evaluates vLLM's own window bound.
"""

from __future__ import annotations

import ast
import sys

import pytest
from prometheus_client import CollectorRegistry

from kvguard.guards.policy import runtime
from kvguard.guards.hooking.instrumentor import OffloadGuardInstrumentor, _resolve
from kvguard.guards.telemetry.metrics import GuardMetrics
from kvguard.guards.hooking.rewrite import GLOBAL_CHECK
from kvguard.guards.settings import GuardSettings
from kvguard.guards.hooking.sites import SPECIAL_GROUP_SIZES, SPECIAL_STORE_DROP, SPECIAL_WINDOW, in_scope

from vllmscope import discovered, import_scope, package_sources, scope_module_names, worker_side

pytestmark = pytest.mark.vllm

SCHEDULER = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
BASE = "vllm.v1.kv_offload.base"


@pytest.fixture(scope="module")
def scope():
    modules, failures = import_scope()
    return modules, failures


@pytest.fixture
def installed(scope):
    inst = OffloadGuardInstrumentor()
    if inst.is_installed:
        inst.uninstall()
    runtime.reset()
    registry = CollectorRegistry()
    assert inst.install(GuardSettings(), metrics=GuardMetrics(registry=registry))
    yield inst, registry
    inst.uninstall()


def names_in(code) -> set[str]:
    """Global names read by ``code`` and every code object nested in it."""
    out = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            out |= names_in(const)
    return out


def test_scope_rule_keeps_the_worker_side_out():
    names = scope_module_names()
    assert SCHEDULER in names and BASE in names
    assert "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector" in names
    assert not [n for n in names if n.endswith((".worker", "gpu_worker")) or ".worker." in n]
    assert not in_scope("vllm.v1.kv_offload.cpu.gpu_worker")
    assert not in_scope("vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker")


POINTER_UTILS = "vllm.v1.kv_offload.pointer_utils"


def static_reach(start: str, package: dict[str, str], ws: frozenset[str]) -> set[str]:
    """The offload modules ``start`` imports statically, followed through in-scope modules."""
    from kvguard.guards.hooking.sites import imported_modules

    seen, todo = {start}, [start]
    while todo:
        module = todo.pop()
        is_package = any(other.startswith(module + ".") for other in package)
        for target in imported_modules(module, ast.parse(package[module]), set(package), is_package):
            if target not in seen:
                seen.add(target)
                if in_scope(target, ws):
                    todo.append(target)
    return seen - {start}


def test_scope_by_role_on_the_installed_release(installed):
    """Issue 20 item 6: a module that only worker code imports is out of scope (on 0.34.0,
    ``pointer_utils``: ``offloading/worker.py``, ``cpu/gpu_worker.py`` and ``fs/worker.py``
    import it), and nothing the scheduler imports is taken out by that rule. The live
    install (the hook's role set, read by kvguard's reader) and the source matrix's
    function agree with the role set computed here from the files."""
    import importlib

    from kvguard.lab.release_matrix import release_row
    from kvguard.guards.hooking.sites import worker_by_name
    from kvguard.guards.hooking.vllm_source import installed_package_sources

    inst, _ = installed
    package, ws = package_sources(), worker_side()
    assert installed_package_sources() == package
    by_import = sorted(m for m in ws if not worker_by_name(m))
    reach = static_reach(SCHEDULER, package, ws)
    assert BASE in reach and not reach & set(by_import), reach & set(by_import)
    assert release_row("installed", package).worker_side_by_import == by_import
    if POINTER_UTILS in package:  # the module of the issue (0.34.0 has it)
        assert POINTER_UTILS in by_import and POINTER_UTILS not in scope_module_names()
        module = importlib.import_module(POINTER_UTILS)
        assert inst.report()["worker_side_by_import"] == by_import
        assert POINTER_UTILS not in inst.report()["modules"]
        assert not [s for s in inst.site_status() if s.startswith("kv_offload.pointer_utils:")]
        assert "@kvguard_check" not in vars(module)


def test_the_scheduler_side_imports(scope):
    modules, failures = scope
    # the modules the offload scheduler itself needs must import on this CPU machine;
    # only optional transports (NIXL, object stores) may lack their dependency here
    assert SCHEDULER in modules and BASE in modules
    assert all(".tiering." in name for name in failures), failures


def test_every_assert_in_scope_is_rewritten(scope, installed):
    modules, _ = scope
    inst, registry = installed
    status = inst.site_status()
    total = 0
    for name, module in modules.items():
        found = discovered(module)
        total += found.in_scope_asserts
        for site in found.sites:
            assert status.get(site.site_id) == "installed", (site.site_id, status.get(site.site_id))
            assert registry.get_sample_value("kvguard_site_installed", {"site": site.site_id}) == 1
            _, func = _resolve(module, site.qualname)
            assert GLOBAL_CHECK in names_in(func.__code__) or site.kind == "store_call", site.site_id
    report = inst.report()
    assert report["not_rewritten"] == [] and report["special_missing"] == []
    assert total >= 30 and report["installed"] == sum(len(discovered(m).sites) for m in modules.values())


def test_every_special_site_is_matched(scope):
    modules, _ = scope
    scheduler = discovered(modules[SCHEDULER])
    base = discovered(modules[BASE])
    assert {SPECIAL_WINDOW, SPECIAL_STORE_DROP} <= scheduler.expected_special
    assert SPECIAL_GROUP_SIZES in base.expected_special
    assert scheduler.special_missing == [] and base.special_missing == []
    (window,) = scheduler.special[SPECIAL_WINDOW]
    assert "sliding_window" in window.bound_expr
    assert len(base.special[SPECIAL_GROUP_SIZES]) == 2


def test_no_assert_is_left_out_of_discovery(scope):
    """Independent count: every ``ast.Assert`` inside a function of an in-scope module
    (connector: scheduler-role functions) is one site occurrence."""
    from kvguard.guards.hooking.rewrite import iter_functions
    from kvguard.guards.hooking.sites import CONNECTOR_MODULES, worker_attributes, worker_role

    modules, _ = scope
    for name, module in modules.items():
        tree = ast.parse(open(module.__file__).read())
        attrs = worker_attributes(tree)
        count = sum(
            isinstance(node, ast.Assert)
            for _, func, _ in iter_functions(tree)
            if not (name in CONNECTOR_MODULES and worker_role(func, attrs))
            for node in ast.walk(func)
        )
        assert discovered(module).in_scope_asserts == count, name


def test_check_geometry_reads_the_installed_release(tmp_path):
    """``check-geometry`` judges the installed release from its own window assert: the
    bound read by :func:`asserted_window_bound` from the installed files (no version
    table), and a crash verdict exactly when it is below the exact bound of #48959."""
    from click.testing import CliRunner

    from kvguard.guards.checks import invariants
    from kvguard.guards.hooking.instrumentor import installed_vllm_version
    from kvguard.guards.hooking.vllm_source import asserted_window_bound, offload_scope
    from kvguard.sidecar.cli import main

    version = installed_vllm_version()
    out = CliRunner().invoke(main, ["check-geometry", "--sliding-window", "4096", "--block-size", "32",
                                    "--chunk-size", "256"])
    bound, expression = asserted_window_bound(offload_scope(package_sources())[0], 4096, 32, 256)
    assert f"installed vLLM {version}: asserts pending <= {expression} = {bound} GPU blocks" in out.output
    would_crash = bound < invariants.swa_pending_bound(4096, 32, 0)
    assert out.exit_code == (3 if would_crash else 0), out.output


def test_a_planted_assert_in_a_copy_of_a_target_module(tmp_path, installed):
    """A copy of the installed release's CPU offload manager, as a future release might
    ship it (a new module name, one assert nobody has seen): rewritten at import,
    counted and re-raised with its site id, with no change in kvguard (issue 8)."""
    import importlib
    import importlib.util
    from pathlib import Path

    import vllm.v1.kv_offload as pkg
    from kvguard.guards.telemetry import events
    from kvguard.guards.hooking.rewrite import fingerprint_id

    inst, registry = installed
    source = Path(importlib.util.find_spec("vllm.v1.kv_offload.cpu.manager").origin).read_text()
    planted = "\n\ndef kvguard_planted_evict(n_chunks):\n    assert n_chunks <= 3, f'cannot evict {n_chunks}'\n    return n_chunks\n"
    (tmp_path / "planted_manager.py").write_text(source + planted)
    pkg.__path__.append(str(tmp_path))
    try:
        module = importlib.import_module("vllm.v1.kv_offload.planted_manager")
        site = f"kv_offload.planted_manager:kvguard_planted_evict:{fingerprint_id('n_chunks <= 3')}"
        assert inst.site_status()[site] == "installed"
        # the copied manager's own asserts are sites of the new module too
        copied = [s for s in discovered(module).sites if s.qualname != "kvguard_planted_evict"]
        assert copied and all(inst.site_status()[s.site_id] == "installed" for s in copied)
        assert module.kvguard_planted_evict(3) == 3
        with events.capture() as logged, pytest.raises(AssertionError, match="cannot evict 4"):
            module.kvguard_planted_evict(4)
        (failed,) = [e for e in logged if e["event"] == "check_failed"]
        assert (failed["site"], failed["action"]) == (site, "raised")
        assert runtime.last_failed_site() == site
        labels = {"check": "offload_manager_assert", "action": "raised"}
        assert registry.get_sample_value("kvguard_invariant_violations_total", labels) == 1
    finally:
        pkg.__path__.remove(str(tmp_path))
        sys.modules.pop("vllm.v1.kv_offload.planted_manager", None)
