"""The sidecar's and ``kvguard run``'s costs, each against a baseline measured in the same run.

    .venvs/light/bin/python bench/sidecar_bench.py [--procs 64] [--requests 200] [--json]

1. **/metrics vs a bare exporter.** ``--procs`` processes write the plugin's own files
   (``GuardMetrics``: a counter, a max-gauge and a histogram file each, 192 files for 64
   processes) into one state dir. Two real servers on loopback read the same directory: the
   sidecar (``kvguard sidecar``, with a stand-in vLLM) and a bare exporter (uvicorn serving
   prometheus-client's ``make_asgi_app`` over a plain ``MultiProcessCollector``). One
   client alternates requests between them (``--requests`` each); printed: p50 and p99 of
   each and the ratios (issue 12: at most 1.2, goal 1.1). Then collect + render alone, in
   this process: the sidecar's ``Scraper.collect`` vs ``generate_latest`` over a
   ``MultiProcessCollector``, interleaved, medians.
   The sidecar runs with ``--metrics-max-age 0`` here (every scrape reads the directory).
2. **/livez under scrape load.** 20 concurrent clients (asyncio, in their own process)
   scrape the sidecar's ``/metrics`` back to back while one client asks ``/livez`` every 20 ms: p50, p99 and max of ``/livez`` (goal:
   p99 at most 50 ms; the kubelet's ``timeoutSeconds`` is 2 s).
3. **Sidecar RSS**, idle (after start and a few scrapes) and after the load.
4. **kvguard run** start and stop overhead: a child that touches a file when ready and exits
   0 on SIGTERM, alone vs under ``kvguard run`` (alternating, medians over ``--runs``): start
   to child ready, and SIGTERM to exit 0 (issue 12: at most +200 ms and +50 ms).

A measurement, not a test: exit status 0 whatever the figures; 1 if a server did not start.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "sidecar"))

import httpx  # noqa: E402
import psutil  # noqa: E402
from sidecartools import free_port  # noqa: E402

BIN = Path(sys.executable).parent
KVGUARD = str(BIN / "kvguard")

WRITER = textwrap.dedent(
    """
    import sys
    from kvguard.guards.telemetry.metrics import GuardMetrics
    from kvguard.guards import names
    m = GuardMetrics(sys.argv[1])
    i = int(sys.argv[2])
    m.evaluations("swa_pending_bound", 100 + i)
    if i % 4 == 0:
        m.tolerated("swa_pending_bound")
    m.swa_ratio(0.5 + (i % 10) / 10)
    # the site gauges (gauge_max file) as an EngineCore with 8 installed sites writes them;
    # without vLLM no site is registered here, so the backend is fed directly
    for k in range(8):
        m._b.gauge_set(names.METRIC_SITE_INSTALLED, {names.LABEL_SITE: f"site_{k}"}, 1.0)
    """
)

FAKE = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from sidecartools import FakeVllm
    import http.server
    fake = FakeVllm()
    fake.stop()
    # serve on the given port instead of a random one
    import socketserver
    class S(http.server.ThreadingHTTPServer):
        daemon_threads = True
        def handle_error(self, *a): pass
    srv = S(("127.0.0.1", int(sys.argv[2])), fake.server.RequestHandlerClass)
    srv.serve_forever()
    """
)

BARE = textwrap.dedent(
    """
    import sys
    import uvicorn
    from prometheus_client import CollectorRegistry, make_asgi_app
    from prometheus_client.multiprocess import MultiProcessCollector
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=sys.argv[1])
    uvicorn.run(make_asgi_app(reg), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning", access_log=False)
    """
)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def wait_up(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"not up: {url}")


def write_state(root: Path, procs: int) -> int:
    (root / "metrics").mkdir(parents=True)
    running = []
    for i in range(procs):
        running.append(subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(i)]))
        if len(running) >= 8:
            running.pop(0).wait()
    for p in running:
        p.wait()
    return len(list((root / "metrics").glob("*.db")))


def metrics_vs_bare(side: str, bare: str, n: int) -> dict:
    lat: dict[str, list[float]] = {"sidecar": [], "bare": []}
    with httpx.Client(timeout=10) as c:
        for _ in range(10):  # warm-up
            c.get(side + "/metrics")
            c.get(bare + "/metrics")
        for i in range(n):
            order = (("sidecar", side), ("bare", bare)) if i % 2 == 0 else (("bare", bare), ("sidecar", side))
            for name, base in order:
                t = time.perf_counter()
                r = c.get(base + "/metrics")
                lat[name].append(time.perf_counter() - t)
                assert r.status_code == 200
    out = {}
    for name, xs in lat.items():
        out[name] = {"p50_ms": 1000 * pct(xs, 0.5), "p99_ms": 1000 * pct(xs, 0.99)}
    out["ratio_p50"] = out["sidecar"]["p50_ms"] / out["bare"]["p50_ms"]
    out["ratio_p99"] = out["sidecar"]["p99_ms"] / out["bare"]["p99_ms"]
    return out


def collect_vs_bare(state: Path, n: int) -> dict:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    from kvguard.guards.telemetry.statefile import StateDir
    from kvguard.sidecar.app import create_app
    from kvguard.sidecar.config import SidecarConfig

    app = create_app(SidecarConfig(state_dir=state, metrics_max_age=0))
    scraper = app.state.scraper
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(StateDir(state).metrics))
    t_side, t_bare = [], []
    for i in range(n):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            t = time.perf_counter()
            if which == 0:
                scraper.collect()
            else:
                generate_latest(reg)
            (t_side if which == 0 else t_bare).append(time.perf_counter() - t)
    return {
        "sidecar_ms": 1000 * statistics.median(t_side),
        "bare_ms": 1000 * statistics.median(t_bare),
        "ratio": statistics.median(t_side) / statistics.median(t_bare),
    }


LOAD = textwrap.dedent(
    """
    import asyncio, sys, httpx
    url, clients, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    async def one(c, stop, n):
        while asyncio.get_running_loop().time() < stop:
            await c.get(url)
            n[0] += 1
    async def main():
        n = [0]
        stop = asyncio.get_running_loop().time() + seconds
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(timeout=60, limits=limits) as c:
            await asyncio.gather(*(one(c, stop, n) for _ in range(clients)))
        print(n[0])
    asyncio.run(main())
    """
)


def probe_latencies(side: str, probes: int, codes: list[int] | None = None) -> list[float]:
    """Latencies of ``probes`` /livez requests (any status: a 503 answered fast is a fast
    probe; the statuses go to ``codes``)."""
    lat = []
    with httpx.Client(timeout=10) as c:
        for _ in range(probes):
            t = time.perf_counter()
            code = c.get(side + "/livez").status_code
            lat.append(time.perf_counter() - t)
            if codes is not None:
                codes.append(code)
            time.sleep(0.02)
    return lat


def livez_under_load(side: str, clients: int, probes: int) -> dict:
    """``clients`` concurrent scrapers in their own process (so that their GIL is not the
    probe's), one probe client here; the same probes without load first (the noise floor
    of this machine)."""
    idle = probe_latencies(side, probes)
    seconds = probes * 0.03 + 2.0
    load = subprocess.Popen([sys.executable, "-c", LOAD, side + "/metrics", str(clients), str(seconds)],
                            stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    codes: list[int] = []
    lat = probe_latencies(side, probes, codes)
    scrapes = int(load.communicate(timeout=seconds + 60)[0].strip() or 0)
    return {
        "clients": clients,
        "probes": probes,
        "scrapes_served": scrapes,
        "p50_ms": 1000 * pct(lat, 0.5),
        "p99_ms": 1000 * pct(lat, 0.99),
        "max_ms": 1000 * max(lat),
        "non_200": sum(1 for c in codes if c != 200),
        "idle_p50_ms": 1000 * pct(idle, 0.5),
        "idle_p99_ms": 1000 * pct(idle, 0.99),
    }


CHILD = ["/bin/sh", "-c", 'trap "exit 0" TERM; touch "$KVGUARD_BENCH_READY"; while :; do sleep 0.01; done']


def run_once(prefix: list[str], tmp: Path) -> tuple[float, float]:
    ready = tmp / f"ready-{time.monotonic_ns()}"
    env = {**os.environ, "KVGUARD_BENCH_READY": str(ready)}
    t = time.perf_counter()
    p = subprocess.Popen(prefix + CHILD, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not ready.exists():
        time.sleep(0.0005)
    start = time.perf_counter() - t
    time.sleep(0.5)  # settled: kvguard run is in its wait loop, as with a loaded model
    t = time.perf_counter()
    p.send_signal(signal.SIGTERM)
    code = p.wait(30)
    stop = time.perf_counter() - t
    assert code == 0, code
    return start, stop


def run_overhead(runs: int, tmp: Path) -> dict:
    res: dict[str, list[tuple[float, float]]] = {"child": [], "kvguard_run": []}
    prefix = {"child": [], "kvguard_run": [KVGUARD, "run", "--termination-log", str(tmp / "t"), "--"]}
    for i in range(runs):
        for name in (("child", "kvguard_run") if i % 2 == 0 else ("kvguard_run", "child")):
            res[name].append(run_once(prefix[name], tmp))
    med = {k: (statistics.median(s for s, _ in v), statistics.median(s for _, s in v)) for k, v in res.items()}
    return {
        "runs": runs,
        "child_start_ms": 1000 * med["child"][0],
        "run_start_ms": 1000 * med["kvguard_run"][0],
        "start_overhead_ms": 1000 * (med["kvguard_run"][0] - med["child"][0]),
        "child_stop_ms": 1000 * med["child"][1],
        "run_stop_ms": 1000 * med["kvguard_run"][1],
        "stop_overhead_ms": 1000 * (med["kvguard_run"][1] - med["child"][1]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=64)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--probes", type=int, default=200)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="kvguard-bench-"))
    state = tmp / "state"
    files = write_state(state, args.procs)
    # the stand-in vLLM runs in its own process: in this one its threads would take the
    # GIL from the timing client whenever the sidecar polls it
    fake_port = free_port()
    fake_proc = subprocess.Popen([sys.executable, "-c", FAKE, str(ROOT / "tests" / "sidecar"), str(fake_port)])
    fake_url = f"http://127.0.0.1:{fake_port}"
    wait_up(fake_url + "/health")
    side_port, bare_port = free_port(), free_port()
    # --metrics-max-age 0: every scrape reads the directory, as the bare exporter does
    # (the default 0.5 s reuse would make back-to-back requests nearly free)
    side_proc = subprocess.Popen(
        [KVGUARD, "sidecar", "--host", "127.0.0.1", "--port", str(side_port), "--vllm-url", fake_url,
         "--state-dir", str(state), "--log-level", "warning", "--metrics-max-age", "0",
         "--health-timeout", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    side_default_port = free_port()
    side_default = subprocess.Popen(
        [KVGUARD, "sidecar", "--host", "127.0.0.1", "--port", str(side_default_port), "--vllm-url", fake_url,
         "--state-dir", str(state), "--log-level", "warning", "--health-timeout", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    bare_proc = subprocess.Popen([sys.executable, "-c", BARE, str(state / "metrics"), str(bare_port)])
    side, bare = f"http://127.0.0.1:{side_port}", f"http://127.0.0.1:{bare_port}"
    side_def = f"http://127.0.0.1:{side_default_port}"
    out: dict = {"files": files, "procs": args.procs, "cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]}
    try:
        wait_up(side + "/livez")
        wait_up(side_def + "/livez")
        wait_up(bare + "/metrics")
        sp = psutil.Process(side_proc.pid)
        for _ in range(5):
            httpx.get(side + "/metrics", timeout=10)
        out["rss_idle_mb"] = sp.memory_info().rss / 2**20
        out["metrics"] = metrics_vs_bare(side, bare, args.requests)
        out["collect_render"] = collect_vs_bare(state, max(20, args.requests // 4))
        out["livez_under_load"] = livez_under_load(side, args.clients, args.probes)
        out["rss_after_load_mb"] = sp.memory_info().rss / 2**20
        out["livez_under_load_default"] = livez_under_load(side_def, args.clients, args.probes)
    finally:
        for p in (side_proc, side_default, bare_proc):
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        fake_proc.terminate()
        fake_proc.wait(15)
    out["kvguard_run"] = run_overhead(args.runs, tmp)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    m, c, lz, r = out["metrics"], out["collect_render"], out["livez_under_load"], out["kvguard_run"]
    print(f"{files} files from {args.procs} processes; {out['cpus']} CPUs, load {out['loadavg_1m']:.1f}")
    print(f"/metrics p50: sidecar {m['sidecar']['p50_ms']:.1f} ms, bare {m['bare']['p50_ms']:.1f} ms, ratio {m['ratio_p50']:.2f}")
    print(f"/metrics p99: sidecar {m['sidecar']['p99_ms']:.1f} ms, bare {m['bare']['p99_ms']:.1f} ms, ratio {m['ratio_p99']:.2f}")
    print(f"collect + render: sidecar {c['sidecar_ms']:.1f} ms, bare {c['bare_ms']:.1f} ms, ratio {c['ratio']:.2f}")
    print(f"/livez with {lz['clients']} clients scraping ({lz['scrapes_served']} scrapes served): "
          f"p50 {lz['p50_ms']:.1f} ms, p99 {lz['p99_ms']:.1f} ms, max {lz['max_ms']:.1f} ms "
          f"(without load: p50 {lz['idle_p50_ms']:.1f} ms, p99 {lz['idle_p99_ms']:.1f} ms)")
    ld = out["livez_under_load_default"]
    print(f"  same with the default --metrics-max-age 0.5 ({ld['scrapes_served']} scrapes served): "
          f"p50 {ld['p50_ms']:.1f} ms, p99 {ld['p99_ms']:.1f} ms, max {ld['max_ms']:.1f} ms")
    print(f"sidecar RSS: idle {out['rss_idle_mb']:.1f} MB, after load {out['rss_after_load_mb']:.1f} MB")
    print(f"kvguard run start to child ready: {r['run_start_ms']:.0f} ms vs {r['child_start_ms']:.0f} ms alone "
          f"(+{r['start_overhead_ms']:.0f} ms)")
    print(f"kvguard run SIGTERM to exit 0: {r['run_stop_ms']:.0f} ms vs {r['child_stop_ms']:.0f} ms alone "
          f"(+{r['stop_overhead_ms']:.0f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
