"""`make demo-live`: a live vLLM CPU server with CPU KV offloading under `kvguard run`,
the sidecar beside it, one short conversation that stores and loads, and the figures of
vLLM's offload metrics and kvguard's sidecar side by side (docs/live.md).

Everything runs on 127.0.0.1 and is stopped (by process id) on the way out. The helpers
are the live tests' own (tests/live/livetools.py, tests/e2e/e2etools.py).
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "e2e"), str(REPO / "tests" / "live")]

import httpx  # noqa: E402
from livetools import (  # noqa: E402
    GPU_BLOCK_TOKENS,
    OFFLOAD_BLOCK_TOKENS,
    SLIDING_WINDOW,
    VOCAB,
    LiveServer,
    kv_transfer_config,
    make_tiny_hybrid,
    samples,
)

START_TIMEOUT = 900  # s


def say(msg: str) -> None:
    print(msg, flush=True)


def wait_ready(s: LiveServer) -> None:
    t0 = time.monotonic()
    last = ""
    while True:
        if not s.proc.alive():
            raise SystemExit(f"the server exited while starting\n{s.proc.tail(40)}")
        if s.status("/health") == 200 and s.status("/v1/models") == 200:
            say(f"   ready after {time.monotonic() - t0:.0f} s")
            return
        if time.monotonic() - t0 > START_TIMEOUT:
            raise SystemExit(f"not ready after {START_TIMEOUT} s\n{s.proc.tail(40)}")
        lines = [ln for ln in s.proc.tail(400).splitlines() if " INFO " in ln]
        phase = lines[-1].split("]", 1)[-1].strip()[:90] if lines else "starting"
        if phase != last:
            say(f"   {time.monotonic() - t0:5.0f} s  {phase}")
            last = phase
        time.sleep(2)


def main() -> int:
    rng = random.Random(11)
    toks = lambda n: [rng.randrange(4, VOCAB) for _ in range(n)]  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="kvguard-demo-live-") as tmp:
        root = Path(tmp)
        say("== a tiny hybrid model (random weights: layer 0 sliding window "
            f"{SLIDING_WINDOW} tokens, layer 1 full attention) ==")
        model = make_tiny_hybrid(root / "model")
        say(f"== vLLM (CPU) under `kvguard run`, OffloadingConnector with kvguard's CPU-platform spec: "
            f"GPU block {GPU_BLOCK_TOKENS} tokens, chunk {OFFLOAD_BLOCK_TOKENS} tokens; sidecar beside it ==")
        s = LiveServer("demo", model, root / "server", supervised=True, transfer_config=kv_transfer_config())
        try:
            wait_ready(s)
            say(f"   vLLM {s.url}  sidecar {s.sidecar_url}  (logs: {root / 'server'})")
            say("== the conversation ==")
            p = toks(1000)
            t = time.monotonic()
            s.generate(p, 1)
            say(f"   turn 1: a 1000-token prompt P                      ({time.monotonic() - t:.1f} s)")
            for i in range(4):
                t = time.monotonic()
                s.generate(toks(1400), 1)
                say(f"   other request {i + 1}: 1400 tokens (evicts P from the GPU prefix cache) "
                    f"({time.monotonic() - t:.1f} s)")
            m1 = s.vllm_metrics()
            turn2 = p + toks(40)
            t = time.monotonic()
            got = s.generate(turn2, 12)
            say(f"   turn 2: P + 40 tokens -> {got['text']!r} ({time.monotonic() - t:.1f} s)")
            m2 = s.vllm_metrics()
            base = s.generate(turn2, 12, cache_salt=f"fresh-{time.time_ns()}")
            same = "the same" if base["logprobs"]["tokens"] == got["logprobs"]["tokens"] else "DIFFERENT"
            say(f"   turn 2 again with a fresh cache_salt (no cache, no offload): {same} greedy text")

            time.sleep(0.5)
            k = samples(httpx.get(s.sidecar_url + "/metrics", timeout=10).text)
            sites = [dict(key[1])["site"] for key, v in k.items() if key[0] == "kvguard_site_installed"]
            on = sum(1 for key, v in k.items() if key[0] == "kvguard_site_installed" and v == 1)
            errors = {dict(key[1])["stage"]: int(v) for key, v in k.items()
                      if key[0] == "kvguard_guard_errors_total" and v}

            def d(name: str) -> int:
                return int(m2.get(name, 0) - m1.get(name, 0))

            rows = [
                ("turn 2: tokens from the offload tier", f"{d('vllm:external_prefix_cache_hits_total')}",
                 "swa_pending_bound evaluations",
                 f"{int(k[('kvguard_check_evaluations_total', (('check', 'swa_pending_bound'),))])}"),
                ("turn 2: local prefix-cache hits", f"{d('vllm:prefix_cache_hits_total')}",
                 "SWA pending / exact bound (sum)", f"{k[('kvguard_swa_pending_bound_ratio_sum', ())]:.2f}"),
                ("turn 2: bytes loaded (CPU -> KV cache)", f"{d('vllm:kv_offload_load_bytes_total')}",
                 "offload check sites installed", f"{on} of {len(sites)}"),
                ("all: bytes stored (KV cache -> CPU)", f"{int(m2.get('vllm:kv_offload_store_bytes_total', 0))}",
                 "invariant violations / tolerated",
                 f"{int(sum(v for key, v in k.items() if key[0] == 'kvguard_invariant_violations_total'))} / "
                 f"{int(sum(v for key, v in k.items() if key[0] == 'kvguard_check_tolerated_total'))}"),
                ("", "", "guard errors by stage", str(errors or 0)),
            ]
            say("== vLLM's offload figures (vLLM /metrics)          | kvguard's figures (sidecar /metrics) ==")
            for a, b, c, e in rows:
                say(f"   {a:<40} {b:>9} | {c:<34} {e}")
            if errors.get("context"):
                say("   (guard_errors{stage=\"context\"} 1 at start on vLLM 0.32.0: a known recorder issue, issue 8)")
            return 0 if same == "the same" and d("vllm:external_prefix_cache_hits_total") > 0 else 1
        finally:
            s.stop()
            say("== stopped (every process this demo started) ==")


if __name__ == "__main__":
    sys.exit(main())
