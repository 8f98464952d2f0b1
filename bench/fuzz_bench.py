"""kvguard's reliability figure (issue 10, item 4): a fixed fuzz budget with the guard on.

    python bench/fuzz_bench.py [--versions 0.33.0 0.25.1] [--examples 600] [--seed 0] [--json]

For each vLLM release it runs ``.venvs/vllm-<v>/bin/kvguard fuzz --guard --examples N
--seed S --json`` (the environment must exist: ``scripts/env.sh vllm-<v>``; ``make fuzz``
builds them) and prints, per release: examples, scheduler steps, engine deaths caused by
kvguard code, requests lost, wrong-KV blocks (goal 0 for the last three), kvguard bugs,
and the classes the guard met with what it did. ``--examples`` fixes the budget, so the
figures are reproducible for a seed and release. Exit status 1 when a release misses a
goal (or its run failed), else 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOALS = ("kvguard_deaths", "requests_lost", "wrong_kv_blocks", "kvguard_bugs")


def run(version: str, examples: int, seed: int, out: Path) -> dict:
    """One guarded ``kvguard fuzz`` on ``version``; its ``--json`` report (or an ``error`` entry)."""
    exe = ROOT / ".venvs" / f"vllm-{version}" / "bin" / "kvguard"
    if not exe.exists():
        return {"vllm_version": version, "error": f"{exe} missing: run scripts/env.sh vllm-{version}"}
    proc = subprocess.run(
        [str(exe), "fuzz", "--guard", "--examples", str(examples), "--seed", str(seed),
         "--shrink-replays", "20", "--out", str(out / version), "--json"],
        capture_output=True, text=True,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"vllm_version": version, "error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
    return json.loads(lines[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", nargs="+", default=["0.33.0", "0.25.1"])
    ap.add_argument("--examples", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for the minimal traces (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="kvguard-fuzz-bench-"))
    reports = [run(v, args.examples, args.seed, out) for v in args.versions]
    ok = True
    rows = []
    for r in reports:
        if "error" in r:
            ok = False
            rows.append(f"vLLM {r['vllm_version']}: FAILED: {r['error']}")
            continue
        missed = [g for g in GOALS if r[g]]
        ok &= not missed
        rows.append(
            f"vLLM {r['vllm_version']}: {r['examples']} examples, {r['steps']} scheduler steps, "
            f"{r['requests']} requests, {r['checks_evaluated']} check evaluations; "
            f"kvguard-caused deaths {r['kvguard_deaths']}, requests lost {r['requests_lost']}, "
            f"wrong-KV blocks {r['wrong_kv_blocks']}, kvguard bugs {r['kvguard_bugs']} "
            f"(engine deaths in vLLM code {r['engine_deaths'] - r['kvguard_deaths']}); {r['wall_s']} s"
            + (f"  MISSED: {', '.join(missed)}" if missed else "")
        )
        for c in r["classes"]:
            rows.append(f"    {c['kind']:8} x{c['count']:<4} {c['class']}: kvguard {', '.join(c['kvguard_did'] or [])}")
    if args.json:
        print(json.dumps({"seed": args.seed, "examples": args.examples, "reports": reports, "ok": ok}))
        print("\n".join(rows), file=sys.stderr)
    else:
        print(f"kvguard fuzz bench: seed {args.seed}, {args.examples} examples per release, guard on (policy guard)")
        print("\n".join(rows))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
