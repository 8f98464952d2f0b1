"""Cost of kvguard's admission check per lookup with a hit (issue 9 item 1).

    .venvs/vllm-0.33.0/bin/python bench/admission_cost.py [--agents 40] [--turns 6] [--json]

Replays the generated trace of ``bench/replay_overhead.py`` once with the guard, timing
every call of :func:`kvguard.guards.admission.admit` (``perf_counter`` around it) and
every lookup (``get_num_new_matched_tokens``, vLLM's own lookup plus the check). Prints
the lookups with a hit that were checked, the median and p99 of the check in
microseconds, the median time of a whole lookup (vLLM's lookup plus the check), and the check's total time as a fraction of the replay's measured step time
(schedule() + update_from_output()). ``hit_reduced`` must be 0 on this trace (every hit
vLLM's lookup admits on the generated trace is loadable). A measurement, not a test:
exit 0 unless the replay failed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from replay_overhead import generate_trace  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=40)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from kvguard.guards import admission
    from kvguard.guards.replay import harness

    trace = generate_trace(args.agents, args.turns)
    check_us: list[float] = []
    lookup_us: list[float] = []
    original_admit = admission.admit

    def timed_admit(cs, request, num_computed_tokens, answer):
        t0 = time.perf_counter()
        try:
            return original_admit(cs, request, num_computed_tokens, answer)
        finally:
            if answer[0]:
                check_us.append((time.perf_counter() - t0) * 1e6)

    engine = harness.build_engine(trace.geometry)
    admission.admit = timed_admit
    try:
        recorder_cls = harness._HitRecorder
        original_call = recorder_cls.__call__

        def timed_call(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return original_call(self, *a, **k)
            finally:
                lookup_us.append((time.perf_counter() - t0) * 1e6)

        recorder_cls.__call__ = timed_call
        result = harness.run_replay(trace, guard=True, policy="guard", engine=engine)
    finally:
        admission.admit = original_admit
        recorder_cls.__call__ = original_call
    stats = result.checks.get("load_coverage", {})
    step_s = sum(result.step_times_s)
    out = {
        "vllm_version": result.vllm_version,
        "ok": result.ok,
        "steps": result.steps,
        "lookups": len(lookup_us),
        "checked_hits": len(check_us),
        "hit_reduced": stats.get("hit_reduced"),
        "check_us_median": round(statistics.median(check_us), 1) if check_us else None,
        "check_us_p99": round(sorted(check_us)[int(0.99 * (len(check_us) - 1))], 1) if check_us else None,
        "lookup_us_median": round(statistics.median(lookup_us), 1) if lookup_us else None,
        "check_total_s": round(sum(check_us) / 1e6, 4),
        "step_total_s": round(step_s, 3),
        "check_share_of_step_time": round(sum(check_us) / 1e6 / step_s, 5) if step_s else None,
    }
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
