"""kvguard.guards.telemetry.metrics: multiprocess files in an explicit dir (after client_python's test_multiprocess.py)."""

from __future__ import annotations

import os

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from kvguard.guards import names
from kvguard.guards.telemetry.metrics import GuardMetrics, get_metrics
from guardtools import SITE_SWA_PENDING_BOUND


@pytest.fixture
def window_site_registered():
    """The window site in the process's site registry, as discovery registers it when the
    guard installs; the ``site`` label is validated against that registry, so a test that
    exports it must not depend on an earlier test module having installed the guard."""
    from kvguard.guards.hooking import sites

    sites.register([sites.Site(
        SITE_SWA_PENDING_BOUND, "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
        "OffloadingConnectorScheduler.update_state_after_alloc", sites.KIND_WINDOW, names.CHECK_SWA_PENDING_BOUND, "", 0,
    )])


def scrape(path) -> CollectorRegistry:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(path))
    return registry


def test_state_dir_files_are_read_by_multiprocess_collector(tmp_path, monkeypatch, window_site_registered):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    m = GuardMetrics(state_dir=tmp_path)
    m.evaluations("swa_pending_bound", 7)
    m.tolerated("swa_pending_bound")
    m.violation("group_sizes_consistency", "store_dropped")
    m.guard_error("check")
    m.swa_ratio(129 / 129)
    m.site_installed(SITE_SWA_PENDING_BOUND, True)
    m.connector_guarded("SimpleCPUOffloadConnector")
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ  # never set inside vLLM
    assert sorted(p.name.split("_")[0] for p in (tmp_path / "metrics").iterdir()) == ["counter", "gauge", "histogram"]
    r = scrape(tmp_path / "metrics")
    assert r.get_sample_value("kvguard_check_evaluations_total", {"check": "swa_pending_bound"}) == 7
    assert r.get_sample_value("kvguard_check_tolerated_total", {"check": "swa_pending_bound"}) == 1
    assert r.get_sample_value(
        "kvguard_invariant_violations_total", {"check": "group_sizes_consistency", "action": "store_dropped"}
    ) == 1
    assert r.get_sample_value("kvguard_guard_errors_total", {"stage": "check"}) == 1
    assert r.get_sample_value("kvguard_swa_pending_bound_ratio_bucket", {"le": "1.0"}) == 1
    assert r.get_sample_value("kvguard_swa_pending_bound_ratio_bucket", {"le": "0.99"}) == 0
    assert r.get_sample_value("kvguard_swa_pending_bound_ratio_count") == 1
    assert r.get_sample_value("kvguard_site_installed", {"site": SITE_SWA_PENDING_BOUND}) == 1
    assert r.get_sample_value("kvguard_connector_info", {"connector": "SimpleCPUOffloadConnector"}) == 1
    assert r.get_sample_value("kvguard_connector_info", {"connector": "OffloadingConnector"}) is None


def test_every_closed_label_child_exists_at_zero(tmp_path):
    GuardMetrics(state_dir=tmp_path)
    r = scrape(tmp_path / "metrics")
    for check in names.CHECKS:
        assert r.get_sample_value("kvguard_check_evaluations_total", {"check": check}) == 0
        for action in names.ACTIONS:
            assert r.get_sample_value(
                "kvguard_invariant_violations_total", {"check": check, "action": action}
            ) == 0
    for stage in names.STAGES:
        assert r.get_sample_value("kvguard_guard_errors_total", {"stage": stage}) == 0
    for check in names.SKIPPABLE_CHECKS:
        for reason in names.SKIP_REASONS:
            assert r.get_sample_value("kvguard_check_skipped_total", {"check": check, "reason": reason}) == 0


def test_a_skipped_check_is_counted_by_check_and_reason(tmp_path):
    m = GuardMetrics(state_dir=tmp_path)
    m.check_skipped("load_coverage", "group_kind")
    m.check_skipped("load_coverage", "group_kind")
    m.check_skipped("promotion_fit", "offload_manager")
    r = scrape(tmp_path / "metrics")
    assert r.get_sample_value("kvguard_check_skipped_total", {"check": "load_coverage", "reason": "group_kind"}) == 2
    assert r.get_sample_value(
        "kvguard_check_skipped_total", {"check": "promotion_fit", "reason": "offload_manager"}
    ) == 1
    assert r.get_sample_value("kvguard_check_skipped_total", {"check": "load_coverage", "reason": "partial_tail"}) == 0
    assert r.get_sample_value("kvguard_guard_errors_total", {"stage": "admission"}) == 0  # a skip is not an error


def test_two_processes_are_summed_and_the_child_starts_from_zero(tmp_path):
    m = GuardMetrics(state_dir=tmp_path)
    m.evaluations("scheduler_assert", 3)
    pid = os.fork()
    if pid == 0:  # child: a fresh file of its own, counting from 0
        try:
            m.evaluations("scheduler_assert", 2)
            code = 0 if len(list((tmp_path / "metrics").glob("counter_*.db"))) == 2 else 1
        except BaseException:
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    r = scrape(tmp_path / "metrics")
    assert r.get_sample_value("kvguard_check_evaluations_total", {"check": "scheduler_assert"}) == 5


def test_counts_survive_a_new_instance_in_the_same_process(tmp_path):
    GuardMetrics(state_dir=tmp_path).evaluations("scheduler_assert", 4)
    GuardMetrics(state_dir=tmp_path).evaluations("scheduler_assert", 1)
    r = scrape(tmp_path / "metrics")
    assert r.get_sample_value("kvguard_check_evaluations_total", {"check": "scheduler_assert"}) == 5


def test_in_process_registry(registry):
    m = GuardMetrics(registry=registry)
    m.violation("swa_pending_bound", "raised")
    assert registry.get_sample_value(
        "kvguard_invariant_violations_total", {"check": "swa_pending_bound", "action": "raised"}
    ) == 1


def test_get_metrics_is_one_instance_per_target(tmp_path):
    assert get_metrics(tmp_path) is get_metrics(tmp_path)
    assert get_metrics(tmp_path) is not get_metrics(tmp_path / "other")


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.evaluations("not_a_check", 1),
        lambda m: m.violation("swa_pending_bound", "ignored"),
        lambda m: m.guard_error("nowhere"),
        lambda m: m.site_installed("no:such:site", True),
        lambda m: m.connector_guarded("LMCacheConnectorV1"),
        lambda m: m.check_skipped("load_coverage", "some text"),
        lambda m: m.check_skipped("swa_pending_bound", "group_kind"),
    ],
)
def test_unknown_label_values_raise(registry, call):
    with pytest.raises(ValueError):
        call(GuardMetrics(registry=registry))


def test_site_gauge_names_its_multiprocess_mode(tmp_path, window_site_registered):
    GuardMetrics(state_dir=tmp_path).site_installed(SITE_SWA_PENDING_BOUND, False)
    assert [p.name.rsplit("_", 1)[0] for p in (tmp_path / "metrics").glob("gauge_*.db")] == ["gauge_max"]
