"""A fatal exit carries every count it had (issue 31): kvguard's checks count into pending
increments and publish them in batches, so an engine that dies right after a check fired
must publish them on its way out, before its fatal record.

A child process plays EngineCore: the plugin installed as vLLM loads it (``KVGUARD_STATE_DIR``
set: multiprocess files), vLLM's real scheduler replays ``seed-48959`` under ``guard`` (its
window check fires on the load), the child prints its in-process counts, then dies the way
EngineCore does: vLLM's busy loop catches the exception and calls
``EngineCoreProc._send_engine_dead`` (kvguard's fatal hook records it first), and the
process is gone at once (``os._exit``: no atexit, no finalizer; the flusher's interval is
set to an hour, so no tick publishes anything either). The
sidecar, a real process on loopback, then serves every one of those counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sidecartools import busy_wait

from kvguard.guards import names

pytestmark = pytest.mark.vllm

ENGINE = textwrap.dedent(
    """
    import json, os, sys
    from kvguard.guards.telemetry import metrics
    metrics.FLUSH_INTERVAL_S = 3600.0  # no flusher tick: only the way out may publish
    from kvguard.lab.replay import harness
    from kvguard.lab.replay.trace import load_trace
    from kvguard.guards.telemetry import counts
    result = harness.run_replay(load_trace("seed-48959"), guard=True, policy="guard")
    assert result.ok, result.error
    snap = counts.snapshot()
    print(json.dumps({name: {"evaluated": c["evaluated"], "tolerated": c["tolerated"]}
                      for name, c in snap.items()}), flush=True)
    from vllm.v1.engine import core
    try:
        raise RuntimeError("EngineCore died right after a check fired")
    except RuntimeError:
        try:  # vLLM's own method cannot send on a stand-in engine: kvguard's hook ran first
            core.EngineCoreProc._send_engine_dead(object.__new__(core.EngineCoreProc))
        except Exception:
            pass
    os._exit(70)
    """
)


def test_an_engine_that_dies_right_after_a_check_publishes_every_count(tmp_path, fake_vllm, sidecar_proc):
    state = tmp_path / "state"
    env = {**os.environ, "KVGUARD_STATE_DIR": str(state), "VLLM_LOGGING_LEVEL": "ERROR"}
    child = subprocess.run([sys.executable, "-c", ENGINE], env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 70, child.stderr[-3000:]
    counted = json.loads(child.stdout.strip().splitlines()[-1])
    window = counted[names.CHECK_SWA_PENDING_BOUND]
    assert window["evaluated"] >= 1  # the check fired in the step before the death
    [record] = list((state / "fatal").glob("*.json"))
    assert json.loads(record.read_text())["exception"] == "RuntimeError"

    side = sidecar_proc(fake_vllm.url, state)
    text = busy_wait(lambda: (lambda r: r.status_code == 200 and r.text)(side.get("/metrics")), timeout=30)
    served = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for fam in text_string_to_metric_families(text) for s in fam.samples}
    for check, c in counted.items():
        if c["evaluated"] is not None:
            assert served[("kvguard_check_evaluations_total", (("check", check),))] == c["evaluated"], check
        assert served[("kvguard_check_tolerated_total", (("check", check),))] == c["tolerated"], check
    assert served[("kvguard_engine_fatal_total", (("exception", "RuntimeError"),))] == 1.0
