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

from kvguard.guards import runtime
from kvguard.guards.instrumentor import OffloadGuardInstrumentor, _resolve, installed_vllm_version
from kvguard.guards.metrics import GuardMetrics
from kvguard.guards.rewrite import INJECTED_GLOBALS
from kvguard.guards.settings import GuardSettings
from kvguard.guards.sites import (
    KIND_WRAP_INIT,
    SITE_GROUP_SIZES_SUM,
    SITE_SWA_PENDING_BOUND,
    SITES,
    TARGET_MODULES,
    site_in_range,
)

pytestmark = pytest.mark.vllm

#: One fewer than while a wrap of ``build_connector_meta`` flushed pass counts (removed:
#: passing generic asserts are no longer counted).
EXPECTED_INSTALLED = {"0.21.0": 33, "0.25.1": 47, "0.33.0": 65}


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


def existing_targets() -> list[str]:
    """The target modules this vLLM release has (tiering from 0.25, offloading.config in 0.33)."""
    out = []
    for name in TARGET_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                out.append(name)
        except ModuleNotFoundError:
            pass
    return out


@pytest.fixture(scope="module")
def modules() -> dict[str, types.ModuleType]:
    return {name: importlib.import_module(name) for name in existing_targets()}


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry) -> GuardMetrics:
    return GuardMetrics(registry=registry)


def snapshot_vllm(modules) -> dict[tuple[str, str], tuple[object, object, object]]:
    """(module, qualname) -> (class attribute object, function, its code) for every site target."""
    out = {}
    for site in SITES:
        module = modules.get(site.module)
        if module is None:
            continue
        for qualname, _ in site.targets:
            owner, func = _resolve(module, qualname)
            if func is None:
                continue
            attr = qualname.rpartition(".")[2]
            out[(site.module, qualname)] = (vars(owner)[attr], func, func.__code__)
    return out


def test_every_in_range_site_installs(modules, registry, metrics):
    version = installed_vllm_version()
    assert OffloadGuardInstrumentor().install(GuardSettings(), metrics=metrics)
    status = OffloadGuardInstrumentor().site_status()
    expected = {s.site_id for s in SITES if site_in_range(s, version)}
    assert {k for k, v in status.items() if v == "installed"} == expected
    assert len(expected) == EXPECTED_INSTALLED[version]
    assert {v for k, v in status.items() if k not in expected} == {"out_of_range"}
    for site_id in expected:
        assert registry.get_sample_value("kvguard_site_installed", {"site": site_id}) == 1


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


@pytest.mark.parametrize("fake_version", ["0.20.0", "0.34.0"])
def test_version_mismatch_installs_nothing(modules, registry, metrics, monkeypatch, fake_version):
    before = snapshot_vllm(modules)
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: fake_version)
    OffloadGuardInstrumentor().install(GuardSettings(), metrics=metrics)
    assert set(OffloadGuardInstrumentor().site_status().values()) == {"out_of_range"}
    for site in SITES:
        assert registry.get_sample_value("kvguard_site_installed", {"site": site.site_id}) == 0
    assert all(v[1].__code__ is before[k][2] for k, v in snapshot_vllm(modules).items())


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


def test_import_time_install_through_the_plugin(tmp_path):
    """The plugin loads before vLLM imports its connector: the hook instruments at import."""
    code = f"""
import json, sys
from kvguard.guards.plugin import register
from kvguard.guards.settings import GuardSettings
assert register(GuardSettings(state_dir={str(tmp_path)!r}))
assert {list(TARGET_MODULES)!r}[0] not in sys.modules
import importlib
import vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler as s
for name in {existing_targets()!r}:
    importlib.import_module(name)
from kvguard.guards.instrumentor import OffloadGuardInstrumentor
st = OffloadGuardInstrumentor().site_status()
print(json.dumps({{"installed": sum(v == "installed" for v in st.values()),
                  "loader": type(s.__spec__.loader).__name__,
                  "finder_left": any(type(f).__name__ == "GuardFinder" for f in sys.meta_path)}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {
        "installed": EXPECTED_INSTALLED[installed_vllm_version()],
        "loader": "_PostImportLoader",
        "finder_left": False,  # all targets imported: the finder removed itself
    }
    from prometheus_client import CollectorRegistry as R
    from prometheus_client.multiprocess import MultiProcessCollector

    r = R()
    MultiProcessCollector(r, path=str(tmp_path / "metrics"))
    assert r.get_sample_value("kvguard_site_installed", {"site": SITE_SWA_PENDING_BOUND}) == 1


def test_wraps_are_present_only_where_needed(modules, metrics):
    version = installed_vllm_version()
    OffloadGuardInstrumentor().install(GuardSettings(), metrics=metrics)
    status = OffloadGuardInstrumentor().site_status()
    wraps = {s.site_id: status[s.site_id] for s in SITES if s.kind == KIND_WRAP_INIT}
    geometry = "scheduler:OffloadingConnectorScheduler.__init__:geometry"
    # the geometry recorder is the only wrap; the once-per-step scheduler path is vLLM's own
    assert wraps == {geometry: "out_of_range" if version == "0.33.0" else "installed"}
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler

    assert not isinstance(vars(OffloadingConnectorScheduler)["build_connector_meta"], wrapt.ObjectProxy)
