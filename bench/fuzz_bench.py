"""kvguard's reliability figure on every full release (issues 10 and 22): one table.

    python bench/fuzz_bench.py --versions 0.21.0 ... 0.34.0 [--examples 2000] [--seeds 0 1 2] [--jobs 2]
                               [--connector both] [--guarded-only] [--json]

For each vLLM release it runs, in that release's environment (``.venvs/vllm-<v>``, built by
``scripts/env.sh vllm-<v>``; ``make fuzz`` builds them):

- what vLLM alone does: ``kvguard fuzz --no-guard --examples N --seed S`` (the unhinted
  search; layouts, ``extra_retained_tokens``, the worker model and tiering drawn where the
  release has them): the classes it finds, by kind (deaths, stalls, wrong KV);
- with the guard: ``kvguard fuzz --guard`` on the same examples: kvguard-caused deaths,
  requests lost, wrong-KV blocks, kvguard bugs (goal 0, 0, 0, 0), and what kvguard did;
  every example where kvguard acted is replayed without the guard too (the differential
  fuzz, ``lab/fuzz/differential.py``): how many ended better, the same, no better and
  worse than vLLM alone (goal: 0 worse, a kvguard bug), and the hits cut where vLLM alone
  served every request (the price of acting early).

``--connector`` is each run's ``kvguard fuzz --connector`` (default ``both``: the
OffloadingConnector or the SimpleCPUOffloadConnector drawn per example).

``--examples`` fixes the budget, so the figures are reproducible for a seed and release;
``--seeds`` runs every release once per seed (one row each: a "never" is claimed over
traffic from several seeds, not one). ``--guarded-only`` skips the unguarded search (the
guarded goals alone, half the time; its column then reads "not run").
``--jobs`` runs that many fuzz processes side by side (one per core). Prints one table
(Markdown) and each release's classes; exit status 1 when a release misses a guarded goal
or a run failed (a harness error included), else 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOALS = ("kvguard_deaths", "requests_lost", "wrong_kv_blocks", "kvguard_bugs")


def run(version: str, guard: bool, examples: int, seed: int, out: Path, connector: str = "both") -> dict:
    """One ``kvguard fuzz`` on ``version``; its ``--json`` report (or an ``error`` entry)."""
    exe = ROOT / ".venvs" / f"vllm-{version}" / "bin" / "kvguard"
    if not exe.exists():
        return {"vllm_version": version, "error": f"{exe} missing: run scripts/env.sh vllm-{version}"}
    mode = "guard" if guard else "no-guard"
    proc = subprocess.run(
        [str(exe), "fuzz", f"--{mode}", "--examples", str(examples), "--seed", str(seed),
         "--connector", connector, "--shrink-replays", "20", "--out", str(out / version / mode), "--json"],
        capture_output=True, text=True,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"vllm_version": version, "error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
    report = json.loads(lines[-1])
    if report.get("harness_error"):
        report["error"] = f"harness error: {report['harness_error']['exception']}"
    return report


def _kinds(report: dict) -> str:
    by_kind: dict[str, int] = {}
    for c in report["classes"]:
        if c["kind"] in ("death", "stall", "wrong-kv"):
            by_kind[c["kind"]] = by_kind.get(c["kind"], 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(by_kind.items())) or "none"


def _verdicts(report: dict) -> str:
    diff = report.get("differential") or {}
    if not diff.get("enabled"):
        return "not compared"
    v = diff["verdicts"]
    return f"{report.get('acted_examples', 0)}: {v['better']} / {v['same']} / {v['no_better']} / {v['worse']}"


def _price(report: dict) -> str:
    price = (report.get("differential") or {}).get("price") or {}
    return ", ".join(f"{k} {n}" for k, n in sorted(price.items())) or "none"


def worse(report: dict) -> int:
    """Examples the guard made worse than vLLM alone (the differential fuzz; 0 when not compared)."""
    return int(((report.get("differential") or {}).get("verdicts") or {}).get("worse", 0))


def table(pairs: list[tuple[dict, dict]]) -> list[str]:
    """The Markdown table: one row per release and seed (unguarded search, guarded figures)."""
    rows = [
        "| vLLM | seed | examples | steps | requests | vLLM alone: classes (wrong-KV blocks, deaths, lost) "
        "| guarded: kvguard deaths | lost requests | wrong-KV blocks | kvguard bugs | failed requests (ended with an error) "
        "| kvguard acted: better / same / no better / worse than vLLM alone | hits cut where vLLM alone served all (by check) |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for plain, guarded in pairs:
        if "error" in plain or "error" in guarded:
            rows.append(f"| {guarded['vllm_version']} | {guarded.get('seed')} | FAILED: "
                        f"{plain.get('error') or guarded.get('error')} |")
            continue
        alone = "not run" if plain.get("skipped") else \
            f"{_kinds(plain)} ({plain['wrong_kv_blocks']}, {plain['engine_deaths']}, {plain['requests_lost']})"
        rows.append(
            f"| {guarded['vllm_version']} | {guarded['seed']} | {guarded['examples']} | {guarded['steps']} "
            f"| {guarded['requests']} | {alone} "
            f"| {guarded['kvguard_deaths']} | {guarded['requests_lost']} | {guarded['wrong_kv_blocks']} "
            f"| {guarded['kvguard_bugs']} | {guarded.get('requests_failed', 0)} | {_verdicts(guarded)} "
            f"| {_price(guarded)} |"
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", nargs="+", required=True)
    ap.add_argument("--examples", type=int, default=2000)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="Hypothesis seeds: one run each")
    ap.add_argument("--guarded-only", action="store_true", help="skip the unguarded search")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--connector", default="both",
                    choices=["OffloadingConnector", "SimpleCPUOffloadConnector", "both"],
                    help="kvguard fuzz --connector of every run (both: drawn per example)")
    ap.add_argument("--out", default=None, help="directory for the minimal traces (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="kvguard-fuzz-bench-"))
    runs = [(v, s) for s in args.seeds for v in args.versions]
    modes = (True,) if args.guarded_only else (False, True)
    work = [(v, s, g) for v, s in runs for g in modes]

    def one(vsg: tuple[str, int, bool]) -> dict:
        v, s, g = vsg
        return run(v, g, args.examples, s, out / f"seed-{s}", args.connector)

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        done = list(pool.map(one, work))
    if args.guarded_only:
        pairs = [({"vllm_version": v, "seed": s, "skipped": True}, g) for (v, s), g in zip(runs, done)]
    else:
        pairs = [(done[2 * i], done[2 * i + 1]) for i in range(len(runs))]
    ok = all("error" not in p and "error" not in g and not any(g[k] for k in GOALS) and not worse(g)
             for p, g in pairs)
    lines = [f"kvguard fuzz bench: seeds {' '.join(map(str, args.seeds))}, {args.examples} examples per release, "
             f"seed and mode; traces under {out}", *table(pairs)]
    for plain, guarded in pairs:
        for label, r in (("vLLM alone", plain), ("guarded", guarded)):
            if "error" in r or r.get("skipped"):
                continue
            lines.append(f"{r['vllm_version']} seed {r['seed']} {label}: {r['wall_s']} s")
            for c in r["classes"]:
                did = f": kvguard {', '.join(c['kvguard_did'])}" if c.get("kvguard_did") else ""
                lines.append(f"    {c['kind']:8} x{c['count']:<4} {c['class']}{did}")
                if c.get("upstream_report"):
                    lines.append(f"        upstream report: {c['upstream_report']}")
    if args.json:
        print(json.dumps({"seeds": args.seeds, "examples": args.examples, "pairs": pairs, "ok": ok}))
        print("\n".join(lines), file=sys.stderr)
    else:
        print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
