"""kvguard.guards.telemetry.metrics: multiprocess files in an explicit dir (after client_python's test_multiprocess.py)."""

from __future__ import annotations

import os

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from kvguard.guards import names
from kvguard.guards.telemetry.metrics import GuardMetrics, flush_all, get_metrics
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
    """What the sidecar reads from ``path`` once this process published its counts."""
    flush_all()
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
    m.check_skipped("copy_coverage", "offload_manager")
    r = scrape(tmp_path / "metrics")
    assert r.get_sample_value("kvguard_check_skipped_total", {"check": "load_coverage", "reason": "group_kind"}) == 2
    assert r.get_sample_value(
        "kvguard_check_skipped_total", {"check": "copy_coverage", "reason": "offload_manager"}
    ) == 1
    assert r.get_sample_value("kvguard_check_skipped_total", {"check": "load_coverage", "reason": "partial_tail"}) == 0
    assert r.get_sample_value("kvguard_guard_errors_total", {"stage": "admission"}) == 0  # a skip is not an error


def test_two_processes_are_summed_and_the_child_starts_from_zero(tmp_path):
    m = GuardMetrics(state_dir=tmp_path)
    m.evaluations("scheduler_assert", 3)  # pending in the parent at the fork
    pid = os.fork()
    if pid == 0:  # child: a fresh file of its own, counting from 0, none of the parent's pending
        try:
            code = 3 if m.pending() else 0
            m.evaluations("scheduler_assert", 2)
            m.flush()
            code = code or (0 if len(list((tmp_path / "metrics").glob("counter_*.db"))) == 2 else 1)
        except BaseException:
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    r = scrape(tmp_path / "metrics")  # the parent publishes its 3 only now
    assert r.get_sample_value("kvguard_check_evaluations_total", {"check": "scheduler_assert"}) == 5
    assert len(list((tmp_path / "metrics").glob("counter_*.db"))) == 2


def _count_and_return(path: str, check: str, amount: int) -> None:
    from kvguard.guards.telemetry.metrics import get_metrics

    get_metrics(path).evaluations(check, amount)  # no flush: the child's exit must publish it


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_child_process_publishes_its_counts_when_it_exits(tmp_path, start):
    """vLLM starts EngineCore and its workers both ways; a child that returns normally
    publishes what it counted (fork: multiprocessing's exit finalizers; spawn: atexit)."""
    import multiprocessing

    m = get_metrics(tmp_path)
    m.evaluations("scheduler_assert", 1)  # pending in the parent: a fork child must not publish it
    child = multiprocessing.get_context(start).Process(
        target=_count_and_return, args=(str(tmp_path), "scheduler_assert", 20))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    # the child's own files (the parent's flusher may publish the parent's 1 meanwhile)
    from prometheus_client.mmap_dict import MmapedDict

    child_counts = [value for f in (tmp_path / "metrics").glob(f"counter_{child.pid}-*.db")
                    for key, value, *_ in MmapedDict.read_all_values_from_file(str(f))
                    if '"scheduler_assert"' in key and key.startswith('["kvguard_check_evaluations"')]
    assert child_counts == [20]
    assert scrape(tmp_path / "metrics").get_sample_value(
        "kvguard_check_evaluations_total", {"check": "scheduler_assert"}) == 21


def test_counts_wait_for_a_flush_and_the_flusher_publishes_them(tmp_path):
    """No prometheus write on the counting path: the files change only at a flush, and
    the process's flusher thread makes one within its interval without a next event."""
    import time

    from kvguard.guards.telemetry import metrics as metrics_module

    m = GuardMetrics(state_dir=tmp_path)
    unflushed = CollectorRegistry()
    MultiProcessCollector(unflushed, path=str(tmp_path / "metrics"))
    m.evaluations("swa_pending_bound", 2)
    m.tolerated("swa_pending_bound")
    m.swa_ratio(0.5)
    assert m.pending() == {
        ("kvguard_check_evaluations_total", (("check", "swa_pending_bound"),)): 2,
        ("kvguard_check_tolerated_total", (("check", "swa_pending_bound"),)): 1,
    }
    assert unflushed.get_sample_value("kvguard_check_evaluations_total", {"check": "swa_pending_bound"}) == 0
    assert metrics_module._flusher.thread is not None and metrics_module._flusher.thread.is_alive()
    deadline = time.monotonic() + 10 * metrics_module.FLUSH_INTERVAL_S
    while m.pending() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert m.pending() == {}
    fresh = CollectorRegistry()
    MultiProcessCollector(fresh, path=str(tmp_path / "metrics"))
    assert fresh.get_sample_value("kvguard_check_evaluations_total", {"check": "swa_pending_bound"}) == 2
    assert fresh.get_sample_value("kvguard_check_tolerated_total", {"check": "swa_pending_bound"}) == 1
    assert fresh.get_sample_value("kvguard_swa_pending_bound_ratio_bucket", {"le": "0.5"}) == 1


def test_a_raised_violation_and_a_fatal_count_publish_at_once(tmp_path):
    m = GuardMetrics(state_dir=tmp_path)
    m.evaluations("swa_pending_bound", 5)
    m.violation("swa_pending_bound", "continued")
    assert m.pending()  # a violation the engine goes on from waits for the batch
    m.violation("swa_pending_bound", "raised")
    assert m.pending() == {}
    m.evaluations("swa_pending_bound", 1)
    m.engine_fatal("AssertionError")
    assert m.pending() == {}
    r = CollectorRegistry()
    MultiProcessCollector(r, path=str(tmp_path / "metrics"))
    assert r.get_sample_value("kvguard_check_evaluations_total", {"check": "swa_pending_bound"}) == 6
    assert r.get_sample_value("kvguard_invariant_violations_total",
                              {"check": "swa_pending_bound", "action": "continued"}) == 1
    assert r.get_sample_value("kvguard_engine_fatal_total", {"exception": "AssertionError"}) == 1


def test_a_failed_write_keeps_the_increments_pending(tmp_path):
    m = GuardMetrics(state_dir=tmp_path)
    m.evaluations("swa_pending_bound", 3)
    write = m._b.counter

    def broken(*a, **k):
        raise OSError("disk full")

    m._b.counter = broken
    with pytest.raises(OSError):
        m.flush()
    assert m.pending() == {("kvguard_check_evaluations_total", (("check", "swa_pending_bound"),)): 3}
    m._b.counter = write
    m.flush()
    assert scrape(tmp_path / "metrics").get_sample_value(
        "kvguard_check_evaluations_total", {"check": "swa_pending_bound"}) == 3


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
