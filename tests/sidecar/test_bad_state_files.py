"""State files that parse but are semantically bad, against a real ``kvguard sidecar``
process on loopback (issue 23 item 3, "No state file blinds the sidecar").

Before issue 23, one such multiprocess file made every ``/metrics`` and ``/status`` answer
500 (the merge and the exposition ran over all files at once), a fatal record from the
future kept the engine ``dead`` while vLLM answered 200, a 15 KB exception name became a
label value, and a ``metrics/`` not created yet counted as blind from the sidecar's first
second. Each bad file here is written the way prometheus-client writes its files
(``MmapedDict`` and ``mmap_key``) or the plugin writes its records (one JSON object), next to
the real plugin's files; each test asserts that ``/metrics`` answers 200 with every series of
the good files, at the values prometheus-client's own ``MultiProcessCollector`` gives for
them alone, and that the bad file is counted with its reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector
from sidecartools import busy_wait, samples

from kvguard.guards.telemetry.statefile import (
    MAX_LABEL_CHARS,
    MAX_MESSAGE_CHARS,
    RunRecord,
    StateDir,
    write_run_record,
)

WRITER = textwrap.dedent(
    """
    import sys
    from kvguard.guards import names
    from kvguard.guards.telemetry.metrics import GuardMetrics
    m = GuardMetrics(sys.argv[1])
    m.violation("swa_pending_bound", "raised")
    m.violation("swa_pending_bound", "raised")
    m.evaluations("swa_pending_bound", 7)
    m.swa_ratio(0.5)
    m.swa_ratio(1.2)
    m._b.gauge_set(names.METRIC_SITE_INSTALLED, {names.LABEL_SITE: "site_0"}, 1.0)  # a gauge_max file
    """
)


@pytest.fixture
def shared_dir():
    """A state dir another user can reach (pytest's tmp_path is 0700, root's)."""
    d = Path(tempfile.mkdtemp(prefix="kvguard-state-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def plugin_writes(root: Path) -> None:
    """The plugin's own writer (GuardMetrics) in a fresh process: counter, histogram and
    gauge files."""
    subprocess.run([sys.executable, "-c", WRITER, str(root)], check=True)


def craft(path: Path, entries: list[tuple[str, float]]) -> None:
    """A multiprocess file written by prometheus-client's own ``MmapedDict``."""
    d = MmapedDict(str(path))
    try:
        for key, value in entries:
            d.write_value(key, value, 0.0)
    finally:
        d.close()


def good_samples(metrics_dir: Path) -> dict:
    """What prometheus-client's own collector serves for the files in ``metrics_dir``."""
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(metrics_dir))
    return samples(generate_latest(reg).decode())


def status(side) -> dict:
    r = side.get("/status")
    assert r.status_code == 200, r.text
    return r.json()


def series(name: str, source: str, reason: str) -> tuple[str, tuple]:
    return (name, (("reason", reason), ("source", source)))


def counted(m: dict, source: str, reason: str) -> tuple[float, float]:
    """``(kvguard_sidecar_errors_total, kvguard_sidecar_unreadable)`` of one source and reason."""
    return (m[series("kvguard_sidecar_errors_total", source, reason)],
            m[series("kvguard_sidecar_unreadable", source, reason)])


# --- multiprocess files: one per crafted shape --------------------------------------------

HELP = "Check failures that were not tolerated, by check and the action taken."

SHAPES = {
    # the four: a file name giving an unknown metric type ...
    "unknown_type": ("bogus_50-1.db", [(mmap_key("kvguard_x", "kvguard_x_total", [], [], "h"), 1.0)],
                     "invalid_family", "ValueError: Invalid metric type: bogus"),
    # ... a histogram sample with le="abc" ...
    "le_not_a_number": ("histogram_51-1.db",
                        [(mmap_key("kvguard_y", "kvguard_y_bucket", ["le"], ["abc"], "h"), 1.0)],
                        "invalid_sample", "ValueError: could not convert string to float: 'abc'"),
    # ... an integer label value ...
    "integer_label_value": ("counter_52-1.db",
                            [(mmap_key("kvguard_invariant_violations", "kvguard_invariant_violations_total",
                                       ["check", "action"], [5, "raised"], HELP), 1.0)],
                            "unrenderable", "AttributeError: 'int' object has no attribute 'replace'"),
    # ... a help text that is not a string
    "help_not_a_string": ("counter_53-1.db",
                          [(mmap_key("kvguard_z", "kvguard_z_total", [], [], 5), 1.0)],
                          "unrenderable", "AttributeError: 'int' object has no attribute 'replace'"),
    # a gauge file whose name holds no mode prometheus-client writes
    "unknown_gauge_mode": ("gauge_bogus_54-1.db", [(mmap_key("kvguard_g", "kvguard_g", [], [], "h"), 1.0)],
                           "invalid_family", "gauge file name without a multiprocess mode"),
    # a key that is JSON, but not [metric, sample, labels, help]
    "labels_not_an_object": ("counter_55-1.db", [(json.dumps(["kvguard_w", "kvguard_w_total", [], "h"]), 1.0)],
                             "corrupt", None),
    # a family the plugin's counter file holds, as a summary with le="abc": each key passes
    # alone as a summary, but merged into the (earlier) histogram family float("abc") raised
    "type_conflict": ("summary_56-1.db",
                      [(mmap_key("kvguard_swa_pending_bound_ratio", "kvguard_swa_pending_bound_ratio_bucket",
                                 ["le"], ["abc"], "h"), 1.0)],
                      "invalid_family",
                      "family 'kvguard_swa_pending_bound_ratio' is a summary here and a histogram in an earlier file"),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_semantically_bad_multiprocess_file_is_skipped_and_counted(fake_vllm, sidecar_proc, shared_dir, shape):
    name, entries, reason, detail = SHAPES[shape]
    state = StateDir(shared_dir).ensure()
    plugin_writes(shared_dir)
    good = good_samples(state.metrics)
    assert good[("kvguard_invariant_violations_total", (("action", "raised"), ("check", "swa_pending_bound")))] == 2.0
    craft(state.metrics / name, entries)
    side = sidecar_proc(fake_vllm.url, shared_dir)
    r = side.get("/metrics")
    assert r.status_code == 200, r.text
    m = samples(r.text)
    assert {k: m.get(k) for k in good} == good  # every good series, at prometheus-client's value
    assert counted(m, "metrics_file", reason) == (1.0, 1.0)
    body = status(side)
    [(source, path, got_reason, got_detail)] = [(u["source"], u["path"], u["reason"], u["detail"])
                                                for u in body["unreadable"]]
    assert (source, path, got_reason) == ("metrics_file", name, reason)
    if detail is not None:
        assert got_detail == detail
    assert body["blind"] is True and body["errors"]["metrics_file"] == 1
    assert body["checks"]["swa_pending_bound"]["violations"] == 2.0  # /status served the good files too


def test_every_shape_at_once_still_serves_the_good_files(fake_vllm, sidecar_proc, shared_dir):
    state = StateDir(shared_dir).ensure()
    plugin_writes(shared_dir)
    good = good_samples(state.metrics)
    for name, entries, _, _ in SHAPES.values():
        craft(state.metrics / name, entries)
    side = sidecar_proc(fake_vllm.url, shared_dir)
    r = side.get("/metrics")
    assert r.status_code == 200, r.text
    m = samples(r.text)
    assert {k: m.get(k) for k in good} == good
    want: dict[str, float] = {}
    for _, _, reason, _ in SHAPES.values():
        want[reason] = want.get(reason, 0.0) + 1.0
    assert {reason: m[series("kvguard_sidecar_unreadable", "metrics_file", reason)] for reason in want} == want
    assert sorted(u["path"] for u in status(side)["unreadable"]) == sorted(n for n, _, _, _ in SHAPES.values())


# --- fatal records ------------------------------------------------------------------------


def record(**over) -> bytes:
    obj = {"exception": "AssertionError", "message": "pending 129 > 128", "site": "swa_pending_bound",
           "time": time.time(), "pid": 4242, "vllm_version": "0.33.0", "phase": "running"}
    obj.update(over)
    return json.dumps(obj).encode()


RECORDS = {  # case: (the fields that differ from a good record, computed when the test runs; reason)
    "time_1e300": (lambda: {"time": 1e300}, "future_time"),
    "time_plus_one_day": (lambda: {"time": time.time() + 86400}, "future_time"),
    "exception_15_kb": (lambda: {"exception": "E" * 15000}, "oversized_field"),
    "exception_not_a_class_name": (lambda: {"exception": "Assertion Error; see logs"}, "invalid_field"),
    "message_over_the_writer_bound": (lambda: {"message": "x" * (MAX_MESSAGE_CHARS + 1)}, "oversized_field"),
    "vllm_version_over_the_label_bound": (lambda: {"vllm_version": "9" * (MAX_LABEL_CHARS + 1)}, "oversized_field"),
}


@pytest.mark.parametrize("case", sorted(RECORDS))
def test_an_untrustworthy_fatal_record_is_rejected_and_the_engine_stays_up(fake_vllm, sidecar_proc, shared_dir, case):
    """As the issue saw it: kvguard run's current start (run.json) and vLLM answering 200;
    a record from the future used to count as this start's and latch the engine dead."""
    fields, reason = RECORDS[case]
    state = StateDir(shared_dir).ensure()
    write_run_record(state, RunRecord(started=time.time() - 5, state="running", pid=1))
    (state.fatal / "4242-1.json").write_bytes(record(**fields()))
    side = sidecar_proc(fake_vllm.url, shared_dir)
    busy_wait(lambda: status(side)["engine"]["polls"] >= 5)
    assert side.get("/livez").status_code == 200
    body = status(side)
    assert body["engine"]["state"] == "up" and body["engine"]["deaths"] == 0
    assert body["last_fatal"] is None and body["fatal_history"] == 0
    assert [(u["source"], u["path"], u["reason"]) for u in body["unreadable"]] == [("fatal_record", "4242-1.json", reason)]
    r = side.get("/metrics")
    assert r.status_code == 200
    m = samples(r.text)
    assert counted(m, "fatal_record", reason) == (1.0, 1.0)
    assert m[("kvguard_engine_up", ())] == 1.0
    assert m[("kvguard_engine_fatal_total", (("exception", "AssertionError"),))] == 0.0
    longest = max((len(v) for key in m for _, v in key[1]), default=0)
    assert longest <= MAX_LABEL_CHARS  # no label value from the record (15 KB, 101 characters)


def test_a_record_of_now_still_kills_the_engine(fake_vllm, sidecar_proc, shared_dir):
    """The control: the same record with a time of now is trusted (the engine turns dead)."""
    state = StateDir(shared_dir).ensure()
    write_run_record(state, RunRecord(started=time.time() - 5, state="running", pid=1))
    side = sidecar_proc(fake_vllm.url, shared_dir)
    busy_wait(lambda: side.get("/livez").status_code == 200)
    (state.fatal / "4242-1.json").write_bytes(record())
    busy_wait(lambda: side.get("/livez").status_code == 503)
    body = status(side)
    assert body["engine"]["state"] == "dead" and body["last_fatal"]["exception"] == "AssertionError"
    assert body["unreadable"] == []


# --- metrics/ not created yet: waiting, then blind ------------------------------------------


def test_metrics_dir_missing_is_waiting_within_the_grace_and_served_once_written(fake_vllm, sidecar_proc, shared_dir):
    side = sidecar_proc(fake_vllm.url, shared_dir / "state")  # the default grace: the startup budget, 600 s
    r = side.get("/metrics")
    assert r.status_code == 200
    m = samples(r.text)
    assert counted(m, "metrics_dir", "missing") == (0.0, 0.0)
    body = status(side)
    assert body["blind"] is False and body["unreadable"] == []
    [waiting] = body["waiting"]
    assert (waiting["source"], waiting["path"], waiting["reason"]) == ("metrics_dir", "metrics/", "missing")
    assert "waiting for the plugin's first write, blind in" in waiting["detail"]

    plugin_writes(shared_dir / "state")  # vLLM starts: the plugin creates metrics/
    vio = ("kvguard_invariant_violations_total", (("action", "raised"), ("check", "swa_pending_bound")))
    m = busy_wait(lambda: (lambda m: m if m.get(vio) == 2.0 else None)(samples(side.get("/metrics").text)))
    assert counted(m, "metrics_dir", "missing") == (0.0, 0.0)
    assert status(side)["waiting"] == []

    shutil.rmtree(shared_dir / "state" / "metrics")  # seen once, gone again: blind at once, grace or not
    busy_wait(lambda: status(side)["blind"])
    m = samples(side.get("/metrics").text)
    assert counted(m, "metrics_dir", "missing") == (1.0, 1.0)
    assert status(side)["waiting"] == []


def test_metrics_dir_still_missing_after_the_grace_is_blind(fake_vllm, sidecar_proc, shared_dir):
    side = sidecar_proc(fake_vllm.url, shared_dir / "state", "--metrics-dir-grace", "5")
    body = status(side)
    assert body["blind"] is False and [w["path"] for w in body["waiting"]] == ["metrics/"]
    m = samples(side.get("/metrics").text)
    assert counted(m, "metrics_dir", "missing") == (0.0, 0.0)
    busy_wait(lambda: status(side)["blind"], timeout=20)
    body = status(side)
    assert body["waiting"] == []
    assert [(u["source"], u["path"], u["reason"]) for u in body["unreadable"]] == [("metrics_dir", "metrics/", "missing")]
    m = samples(side.get("/metrics").text)
    assert counted(m, "metrics_dir", "missing") == (1.0, 1.0)


def test_a_metrics_dir_that_is_not_a_directory_is_blind_at_once(fake_vllm, sidecar_proc, shared_dir):
    """Only "missing" waits: a file named metrics is not vLLM starting late."""
    (shared_dir / "metrics").write_text("not a directory")
    side = sidecar_proc(fake_vllm.url, shared_dir)
    body = status(side)
    assert body["waiting"] == [] and body["blind"] is True
    assert [(u["source"], u["reason"]) for u in body["unreadable"]] == [("metrics_dir", "not_a_directory")]
