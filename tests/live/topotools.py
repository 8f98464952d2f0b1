"""Helpers for the multi-process live modules (issue 23): a data-parallel and a
tensor-parallel vLLM CPU server with CPU KV offloading, under ``kvguard run`` with the
sidecar and a real Prometheus (tests/live/test_live_dp.py, test_live_tp.py).

What is shared: the server and Prometheus of a module (:class:`Topology`), the
conversation that stores and loads an offloaded prefix (pinned to one data-parallel rank
with vLLM's ``X-data-parallel-rank`` header), vLLM's per-engine metrics (its ``engine``
label), the process tree as vLLM titles it, what each process wrote into the state dir, and
the death of one process measured from the SIGKILL.
"""

from __future__ import annotations

import json
import random
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
from e2etools import SERVED_NAME, wait_for
from livetools import (
    GPU_BLOCK_TOKENS,
    OFFLOAD_BLOCK_TOKENS,
    SLIDING_WINDOW,
    VOCAB,
    LiveServer,
    Prometheus,
    kv_transfer_config,
    make_tiny_hybrid,
    samples,
)
from prometheus_client.mmap_dict import MmapedDict

from kvguard.guards.telemetry.statefile import process_name

REPO = Path(__file__).resolve().parents[2]
#: ``kvguard run``'s child, as the termination message names it (exitcode.describe_command)
API_SERVER = "python -m vllm.entrypoints.openai.api_server"
#: The workload of test_live_offloading.py (docs/live.md): P, four fillers that evict P from
#: the 100-block GPU prefix cache, then P + 40 tokens, which loads P's chunks.
P_TOKENS, FILLER_TOKENS, NUM_FILLERS, TURN2_EXTRA, GEN_TOKENS = 1000, 1400, 4, 40, 16
KV_BYTES_PER_TOKEN_PER_LAYER = 2 * 1 * 64 * 4  # K and V, 1 KV head, head_dim 64, float32
HIT_TOKENS = P_TOKENS // OFFLOAD_BLOCK_TOKENS * OFFLOAD_BLOCK_TOKENS  # 960: whole chunks only
SWA_LOAD_BLOCKS = (HIT_TOKENS - 1) // GPU_BLOCK_TOKENS - (HIT_TOKENS - SLIDING_WINDOW + 1) // GPU_BLOCK_TOKENS + 1
#: One load by one worker holding every KV head (the model has one: with tensor parallelism
#: each worker holds a replica of it, and vLLM's counters add up what every worker copied)
LOAD_BYTES = (HIT_TOKENS + SWA_LOAD_BLOCKS * GPU_BLOCK_TOKENS) * KV_BYTES_PER_TOKEN_PER_LAYER  # 540672
EXACT_BOUND = -(-(SLIDING_WINDOW + GPU_BLOCK_TOKENS - 1) // GPU_BLOCK_TOKENS)  # 4 GPU blocks
SWA_SITE = "offloading.scheduler:OffloadingConnectorScheduler.update_state_after_alloc:swa_pending_bound"
#: Dashboard queries with no series until an event happens (test_live_offloading.py, docs/live.md)
EMPTY_UNTIL_EVENT = {
    "vllm:kv_offload_stores_skipped_total": "vLLM defines it only with store_threshold >= 2",
    "vllm:kv_offload_allocation_failure_total": "vLLM creates its series at the first failed store allocation",
}
OFFLOAD_METRICS = ("vllm:external_prefix_cache_hits_total", "vllm:prefix_cache_hits_total",
                   "vllm:kv_offload_load_bytes_total", "vllm:kv_offload_store_bytes_total")


class Topology:
    """One module's server (under ``kvguard run`` with the sidecar and the shipped offload
    spec) and a real Prometheus scraping the sidecar and vLLM with the project's rules,
    started together at construction. ``extra``: vLLM's topology flags; ``env``: extra
    environment for vLLM."""

    def __init__(self, root: Path, name: str, extra: tuple[str, ...], env: dict[str, str] | None = None) -> None:
        self.root = root
        self.model = make_tiny_hybrid(root / "model")
        self.server = LiveServer(name, self.model, root / name, supervised=True, transfer_config=kv_transfer_config(),
                                 env_extra=env, extra=extra)
        self.prom = Prometheus(root / "prometheus", REPO / "dashboards" / "alerts.yaml",
                               sidecar=f"127.0.0.1:{self.server.sidecar_port}", vllm=f"127.0.0.1:{self.server.port}")
        self.prom_started = time.time()
        self.results: dict[str, object] = {}

    def stop(self) -> None:
        for p in (self.server, self.prom):
            p.stop()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, VOCAB) for _ in range(n)]  # 0..3 are unk/bos/eos/pad


def generate(server: LiveServer, prompt: list[int], max_tokens: int, rank: int | None = None,
             cache_salt: str | None = None, timeout: float = 300) -> dict:
    """Greedy completion of a token-id prompt; ``rank``: the data-parallel rank vLLM must
    run it on (its ``X-data-parallel-rank`` header)."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": 1, "ignore_eos": True}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    headers = {"X-data-parallel-rank": str(rank)} if rank is not None else {}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=timeout)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    choice["usage"] = out["usage"]
    return choice


def engine_metrics(server: LiveServer) -> dict[tuple[str, str], float]:
    """vLLM's /metrics: ``{(sample name, engine label): value}`` (other labels summed)."""
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200
    out: dict[tuple[str, str], float] = {}
    for (name, labels), v in samples(r.text).items():
        key = (name, dict(labels).get("engine", ""))
        out[key] = out.get(key, 0.0) + v
    return out


def conversation(server: LiveServer, rank: int | None = None) -> dict:
    """The offload workload on one engine (``rank``); returns that engine's vLLM metric
    deltas for turn 2 and for the fresh-``cache_salt`` baseline, and both choices."""
    engine = str(rank if rank is not None else 0)
    rng = random.Random(11)
    p = tokens(rng, P_TOKENS)
    fillers = [tokens(rng, FILLER_TOKENS) for _ in range(NUM_FILLERS)]
    turn2 = p + tokens(rng, TURN2_EXTRA)
    m0 = engine_metrics(server)
    generate(server, p, 1, rank)
    for f in fillers:
        generate(server, f, 1, rank)
    m1 = engine_metrics(server)
    got = generate(server, turn2, GEN_TOKENS, rank)
    m2 = engine_metrics(server)
    base = generate(server, turn2, GEN_TOKENS, rank, cache_salt=f"baseline-{time.time_ns()}")
    m3 = engine_metrics(server)

    def delta(a: dict, b: dict, name: str) -> float:
        return b.get((name, engine), 0.0) - a.get((name, engine), 0.0)

    out = {
        "engine": engine,
        "store_bytes_before_turn2": delta(m0, m1, "vllm:kv_offload_store_bytes_total"),
        "turn2": {k: delta(m1, m2, k) for k in OFFLOAD_METRICS[:3]},
        "baseline": {k: delta(m2, m3, k) for k in OFFLOAD_METRICS[:3]},
        "got": got, "base": base,
    }
    print(f"[topo] {server.name} engine {engine}: {json.dumps({k: v for k, v in out.items() if k not in ('got', 'base')})}")
    return out


def check_conversation(r: dict, workers: int = 1) -> float:
    """The offload proof of one engine's conversation; returns max |logprob diff|.
    ``workers``: how many workers each copy their replica of the one KV head."""
    assert r["store_bytes_before_turn2"] >= workers * HIT_TOKENS * KV_BYTES_PER_TOKEN_PER_LAYER
    assert r["turn2"] == {"vllm:external_prefix_cache_hits_total": HIT_TOKENS, "vllm:prefix_cache_hits_total": 0,
                          "vllm:kv_offload_load_bytes_total": workers * LOAD_BYTES}
    assert r["baseline"] == {"vllm:external_prefix_cache_hits_total": 0, "vllm:prefix_cache_hits_total": 0,
                             "vllm:kv_offload_load_bytes_total": 0}
    got, base = r["got"], r["base"]
    assert got["usage"]["completion_tokens"] == GEN_TOKENS
    assert got["logprobs"]["tokens"] == base["logprobs"]["tokens"] and got["text"] == base["text"]
    return max(abs(a - b) for a, b in zip(got["logprobs"]["token_logprobs"], base["logprobs"]["token_logprobs"]))


def vllm_processes(server: LiveServer) -> dict[int, tuple[str | None, int]]:
    """Every process of the server's tree below ``kvguard run``: ``{pid: (vLLM process
    name or None, ppid)}`` (psutil, the test's own view, independent of kvguard's)."""
    out: dict[int, tuple[str | None, int]] = {}
    for p in server.proc.tagged():
        if p.pid == server.proc.pid:
            continue
        try:
            out[p.pid] = (process_name("\0".join(p.cmdline()).encode()), p.ppid())
        except psutil.Error:
            continue
    return out


def api_server_pid(server: LiveServer) -> int:
    [pid] = [p.pid for p in psutil.Process(server.proc.pid).children()]
    return pid


def files_by_pid(state_dir: Path) -> dict[int, list[Path]]:
    """The multiprocess files of the state dir, by the pid in their name (``<type>_<pid>-<ms>.db``)."""
    out: dict[int, list[Path]] = {}
    for f in (state_dir / "metrics").glob("*.db"):
        pid = int(f.stem.rsplit("_", 1)[1].split("-", 1)[0])
        out.setdefault(pid, []).append(f)
    return out


def file_values(files: list[Path], prefix: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` of one process's files of one type."""
    out: dict[tuple[str, tuple], float] = {}
    for f in files:
        if not f.name.startswith(prefix + "_"):
            continue
        for key, value, *_ in MmapedDict.read_all_values_from_file(str(f)):
            _, sample, labels, _help = json.loads(key)
            out[(sample, tuple(sorted(labels.items())))] = value
    return out


def sidecar_samples(server: LiveServer) -> dict[tuple[str, tuple], float]:
    r = httpx.get(server.sidecar_url + "/metrics", timeout=10)
    assert r.status_code == 200
    return samples(r.text)


def dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads((REPO / "dashboards" / "kvguard.json").read_text())
    out = []
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            expr = (t["expr"].replace("$__rate_interval", "1m").replace("$kvguard_job", "kvguard")
                    .replace("$job", "vllm").replace("$instance", ".+"))
            out.append((panel["title"], expr))
    return out


def check_dashboard(prom: Prometheus) -> list[str]:
    """Every dashboard query returns data except the documented empty-until-event ones,
    and those are really empty; returns the empty panels' titles."""
    time.sleep(3)  # rate() over 1m needs two samples per series (scrape interval 1 s)
    empty = [(title, expr) for title, expr in dashboard_queries() if not prom.query(expr)]
    undocumented = [(t, e) for t, e in empty if not any(key in e for key in EMPTY_UNTIL_EVENT)]
    assert not undocumented, undocumented
    assert {key for key in EMPTY_UNTIL_EVENT if any(key in e for _, e in empty)} == set(EMPTY_UNTIL_EVENT)
    return [t for t, _ in empty]


def check_quiet_start(topo: Topology) -> None:
    """Nothing paged, nothing pending for the engine and the engine never ``dead`` during
    the start-up, read back from Prometheus over the whole time it has run."""
    prom = topo.prom
    window = f"{int(time.time() - topo.prom_started) + 60}s"
    assert prom.query(f'count_over_time(ALERTS{{alertstate="firing"}}[{window}])') == []
    assert prom.query(f'count_over_time(ALERTS{{alertname="VLLMEngineDown"}}[{window}])') == []
    dead = wait_for(lambda: prom.query(f'max_over_time(kvguard_engine_state{{job="kvguard",state="dead"}}[{window}])'),
                    20, "prometheus: engine state series")
    assert [x["value"][1] for x in dead] == ["0"]
    starting = prom.query(f'max_over_time(kvguard_engine_state{{job="kvguard",state="starting"}}[{window}])')
    print(f"[topo] start-up: engine state `starting` seen: {[x['value'][1] for x in starting]}, no alert in {window}")


def kill_and_measure(server: LiveServer, pid: int, sig: int = signal.SIGKILL, timeout: float = 120) -> dict[str, float]:
    """SIGKILL ``pid`` and measure, from the kill: the sidecar's ``/livez`` 503, vLLM's
    ``/health`` first not 200, and ``kvguard run``'s exit (seconds)."""
    seen: dict[str, float] = {}
    victim = psutil.Process(pid)
    t0 = time.monotonic()
    victim.send_signal(sig)
    deadline = t0 + timeout
    # each time is taken when its answer is in (an upper bound of when the state changed)
    while time.monotonic() < deadline and not {"livez", "health", "exit"} <= set(seen):
        if "livez" not in seen and server.status("/livez", server.sidecar_url) == 503:
            seen["livez"] = time.monotonic() - t0
        if "health" not in seen and server.status("/health") != 200:
            seen["health"] = time.monotonic() - t0
        if "exit" not in seen and not server.proc.alive():
            seen["exit"] = time.monotonic() - t0
        time.sleep(0.01)
    print(f"[topo] {server.name}: after SIGKILL of pid {pid}: " +
          ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in sorted(seen.items(), key=lambda kv: kv[1])))
    return seen


def part_death_message(name: str, pid: int, parent: str | None = None) -> re.Pattern[str]:
    """The termination message of a part's death (sidecar/exitcode.py): the part by name and
    pid, any fatal record an engine wrote meanwhile, then how the child ended."""
    of = f", of {re.escape(parent)}" if parent else ""
    return re.compile(
        rf"vLLM process {re.escape(name)} \(pid {pid}{of}\) died without a stop request; "
        rf"(?P<fatal>engine fatal [^\n]*; )?"
        rf"the child \({re.escape(API_SERVER)}\) then (?P<end>exited \d+|was killed by SIG[A-Z0-9]+)\n"
    )


def wait_alert_firing(prom: Prometheus, name: str, timeout: float = 150) -> dict:
    """Wait until alert ``name`` fires in Prometheus (its ``for:`` included); returns it."""
    def firing() -> dict | None:
        for a in prom.get("/api/v1/alerts")["alerts"]:
            if a["labels"]["alertname"] == name and a["state"] == "firing":
                return a
        return None

    return wait_for(firing, timeout, f"alert {name} firing", interval=1.0)  # type: ignore[return-value]


def timed(what: str, fn: Callable[[], object]) -> object:
    t0 = time.monotonic()
    out = fn()
    print(f"[topo] {what}: {time.monotonic() - t0:.1f}s")
    return out
