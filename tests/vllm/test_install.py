"""Installing kvguard into the real vLLM (run in each .venvs/vllm-* env with KVGUARD_EXPECT_VLLM)."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import types

import pytest
import wrapt
from prometheus_client import CollectorRegistry

from kvguard.guards.policy import runtime
from kvguard.guards.hooking.instrumentor import OffloadGuardInstrumentor, _resolve, installed_vllm_version
from kvguard.guards.telemetry.metrics import GuardMetrics
from kvguard.guards.hooking.rewrite import INJECTED_GLOBALS
from kvguard.guards.settings import GuardSettings
from vllmscope import discovered, import_scope

from guardtools_vllm import SITE_GROUP_SIZES_SUM, SITE_SWA_PENDING_BOUND

pytestmark = pytest.mark.vllm

#: One fewer than while a wrap of ``build_connector_meta`` flushed pass counts (removed:
#: passing generic asserts are no longer counted).


@pytest.fixture(autouse=True)
def _uninstalled():
    inst = OffloadGuardInstrumentor()
    if inst.is_installed:
        inst.uninstall()
    runtime.reset()
    yield
    if inst.is_installed:
        inst.uninstall()
    runtime.reset()


@pytest.fixture(scope="module")
def modules() -> dict[str, types.ModuleType]:
    return import_scope()[0]


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry) -> GuardMetrics:
    return GuardMetrics(registry=registry)


def snapshot_vllm(modules) -> dict[tuple[str, str], tuple[object, object, object]]:
    """(module, qualname) -> (class attribute object, function, its code) for every site target."""
    out = {}
    for name, module in modules.items():
        for site in discovered(module).sites:
            qualname = site.qualname
            owner, func = _resolve(module, qualname)
            if func is None:
                continue
            attr = qualname.rpartition(".")[2]
            out[(name, qualname)] = (vars(owner)[attr], func, func.__code__)
        scheduler_cls = vars(module).get("OffloadingConnectorScheduler")
        if scheduler_cls is not None:  # the geometry recorder's wrap target
            init = vars(scheduler_cls)["__init__"]
            out[(name, "OffloadingConnectorScheduler.__init__")] = (init, init, init.__code__)
    return out


def test_uninstall_restores_vllm_byte_for_byte(modules, metrics):
    before = snapshot_vllm(modules)
    globals_before = {name: set(vars(m)) for name, m in modules.items()}
    inst = OffloadGuardInstrumentor()
    inst.install(GuardSettings(), metrics=metrics)
    changed = [key for key, (_, func, code) in before.items() if func.__code__ is not code]
    assert len(changed) >= 10  # the rewritten functions, swapped in place
    inst.uninstall()
    after = snapshot_vllm(modules)
    assert after.keys() == before.keys()
    for key, (attr, func, code) in before.items():
        assert after[key][0] is attr, key  # the same class attribute (no wrapper left)
        assert after[key][1] is func and func.__code__ is code, key
        assert "wrapt" not in type(attr).__module__ and type(attr).__name__ != "FunctionWrapper"
    assert {name: set(vars(m)) for name, m in modules.items()} == globals_before
    assert not any(name in vars(m) for m in modules.values() for name in INJECTED_GLOBALS)


def test_second_install_is_a_no_op(modules, metrics):
    inst = OffloadGuardInstrumentor()
    assert inst.install(GuardSettings(), metrics=metrics) is True
    codes = {k: v[1].__code__ for k, v in snapshot_vllm(modules).items()}
    assert inst.install(GuardSettings(policy="strict"), metrics=metrics) is False
    assert {k: v[1].__code__ for k, v in snapshot_vllm(modules).items()} == codes
    assert runtime.policy() == "guard"


def test_round_trip_counts_only_while_installed(modules, registry, metrics):
    base = modules["vllm.v1.kv_offload.base"]

    def bad():
        with pytest.raises(AssertionError):
            base.GPULoadStoreSpec([1, 2], group_sizes=[3], block_indices=[0])

    def count():
        v = registry.get_sample_value(
            "kvguard_invariant_violations_total", {"check": "group_sizes_consistency", "action": "raised"}
        )
        return v or 0

    inst = OffloadGuardInstrumentor()
    inst.install(GuardSettings(), metrics=metrics)
    bad()
    inst.uninstall()
    bad()
    inst.install(GuardSettings(), metrics=metrics)
    bad()
    assert count() == 2


def test_disabled_sites(modules, registry, metrics, monkeypatch):
    monkeypatch.setenv("KVGUARD_DISABLED_SITES", f"{SITE_SWA_PENDING_BOUND},{SITE_GROUP_SIZES_SUM}")
    OffloadGuardInstrumentor().install(GuardSettings.from_env(), metrics=metrics)
    status = OffloadGuardInstrumentor().site_status()
    assert status[SITE_SWA_PENDING_BOUND] == status[SITE_GROUP_SIZES_SUM] == "disabled"
    assert registry.get_sample_value("kvguard_site_installed", {"site": SITE_SWA_PENDING_BOUND}) == 0
    base = modules["vllm.v1.kv_offload.base"]
    with pytest.raises(AssertionError):
        base.GPULoadStoreSpec([1, 2], group_sizes=[3], block_indices=[0])
    assert runtime.snapshot()["group_sizes_consistency"]["violations"] == 0  # vLLM's own assert


def test_import_time_install_through_the_plugin(tmp_path, modules):
    """The plugin loads before vLLM imports its connector: the hook instruments at import."""
    code = f"""
import json, sys
from kvguard.guards.plugin import register
from kvguard.guards.settings import GuardSettings
assert register(GuardSettings(state_dir={str(tmp_path)!r}))
assert "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler" not in sys.modules
import importlib
import vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler as s
for name in {sorted(modules)!r}:
    importlib.import_module(name)
from kvguard.guards.hooking.instrumentor import OffloadGuardInstrumentor
st = OffloadGuardInstrumentor().site_status()
print(json.dumps({{"installed": sum(v == "installed" for v in st.values()),
                  "loader": type(s.__spec__.loader).__name__,
                  "finder_left": any(type(f).__name__ == "GuardFinder" for f in sys.meta_path)}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {
        "installed": sum(len(discovered(m).sites) for m in modules.values()),
        "loader": "_PostImportLoader",
        "finder_left": True,  # like pytest's hook: a module in scope may be imported later
    }
    from prometheus_client import CollectorRegistry as R
    from prometheus_client.multiprocess import MultiProcessCollector

    r = R()
    MultiProcessCollector(r, path=str(tmp_path / "metrics"))
    assert r.get_sample_value("kvguard_site_installed", {"site": SITE_SWA_PENDING_BOUND}) == 1


def test_wraps_are_present_only_where_needed(modules, metrics):
    OffloadGuardInstrumentor().install(GuardSettings(), metrics=metrics)
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler

    # the geometry recorder (scheduler __init__, once per scheduler) is the only wrap;
    # the once-per-step scheduler path is vLLM's own code
    assert isinstance(vars(OffloadingConnectorScheduler)["__init__"], wrapt.FunctionWrapper)
    assert not isinstance(vars(OffloadingConnectorScheduler)["build_connector_meta"], wrapt.ObjectProxy)
