"""Replay two traces across an engine restart over the same secondary tiers and print
one JSON line: per replay, the report (``to_json``) and the oracle's wrong-KV findings.

Usage: ``python restart_replay.py BEFORE AFTER [--no-guard] [--policy P]``
(:func:`kvguard.lab.replay.harness.run_across_restart`; measures the release fact
``tier_restart_swa_partial_wrong_kv_blocks``, tests/vllm/release_facts.py).
"""

from __future__ import annotations

import argparse
import json

from kvguard.lab.replay import harness, report
from kvguard.lab.replay.trace import load_trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--no-guard", action="store_true")
    parser.add_argument("--policy", default="guard", choices=("observe", "guard", "strict"))
    args = parser.parse_args()
    before = load_trace(args.before)
    results = harness.run_across_restart(before, load_trace(args.after), guard=not args.no_guard, policy=args.policy)
    print(json.dumps([{"report": report.to_json(r, before.geometry), "wrong_kv": r.worker.oracle.wrong_kv}
                      for r in results], default=str))


if __name__ == "__main__":
    main()
