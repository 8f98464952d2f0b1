"""Step-time cost of kvguard's parts, switched on and off step by step in one process.

    .venvs/vllm-0.33.0/bin/python bench/step_toggle.py [--part aa admission code all]
        [--wrapper full|empty|no-check] [--reps 5] [--agents 40] [--turns 6] [--json]

The lockstep bench (``bench/replay_overhead.py``) compares two processes; its A/A control
still moves by a few percent on this shared host (0.974 on 2 Dec 2026). This one keeps
one process and one installed guard and switches a part of it on for every other step:

- ``admission``: the connector scheduler's lookup through kvguard's pre-bound wrapper
  (:func:`kvguard.guards.admission.attach`) or vLLM's own method (its ``__wrapped__``);
- ``code``: each rewritten vLLM function's code, kvguard's or vLLM's original (the
  instrumentor keeps both; the sliding-window check lives in the rewritten code);
- ``all``: both;
- ``aa``: switches nothing (the A/A control: scheduled, switched and timed the same way).

Each repetition replays the generated bench trace twice per part, with the part on for
even steps in the first replay and for odd steps in the second, so every step is timed
once on and once off, in the same minutes; the replays schedule the same steps (the part
changes no decision on this trace: no check fails). Several parts (``--part aa admission
all``) take turns within each repetition, so a part and its A/A control share the
minutes. Printed per repetition and as the median over repetitions: the ratio of the
median step (CPU time, ``time.thread_time``) on / off, and the median of the per-step
ratios; a part is read against the ``aa`` row of the same run. ``--wrapper`` replaces the admission
wrapper's work (measured parts of it): ``empty`` only calls vLLM (wrapt's own cost),
``no-check`` binds the arguments but skips :func:`~kvguard.guards.admission.admit`.
A measurement, not a test: exit 0 unless a replay failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from replay_overhead import generate_trace  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", nargs="+", choices=["aa", "admission", "code", "all"], default=["all"],
                        help="the parts to switch, in turn within each repetition")
    parser.add_argument("--wrapper", choices=["full", "empty", "no-check"], default="full")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--agents", type=int, default=40)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

    from kvguard.guards import admission
    from kvguard.guards.instrumentor import OffloadGuardInstrumentor
    from kvguard.guards.replay import harness

    trace = generate_trace(args.agents, args.turns)
    if not harness.run_replay(trace, guard=True, policy="guard").ok:  # warm-up, installs the guard
        print("warm-up replay failed", file=sys.stderr)
        return 1
    if args.wrapper == "empty":
        def _empty(wrapped, instance, args, kwargs):
            return wrapped(*args, **kwargs)

        admission.admission_wrapper.__code__ = _empty.__code__
    elif args.wrapper == "no-check":
        admission.admit = lambda cs, request, num_computed_tokens, answer, seen=None: answer

    codes = [(f, f.__code__, original) for f, original in OffloadGuardInstrumentor()._state.code_patches]
    recorders: list = []
    init = harness._HitRecorder.__init__

    def capture(self, *a, **k):
        init(self, *a, **k)
        recorders.append(self)

    harness._HitRecorder.__init__ = capture

    def switch(part: str, on: bool) -> None:
        if part in ("code", "all"):
            for func, ours, original in codes:
                func.__code__ = ours if on else original
        if part in ("admission", "all"):
            rec = recorders[-1]
            rec._instance_attr = rec._kvguard_wrapper if on else rec._kvguard_wrapper.__wrapped__

    def replay(part: str, parity: int) -> list[float]:
        step = [0]

        def before() -> None:
            if step[0] == 0:
                rec = recorders[-1]
                if rec._instance_attr is None:
                    raise RuntimeError("no pre-bound admission wrapper on the scheduler")
                rec._kvguard_wrapper = rec._instance_attr
            switch(part, step[0] % 2 == parity)
            step[0] += 1

        gc.collect()
        result = harness.run_replay(trace, guard=True, policy="guard", before_step=before)
        switch("all", True)
        if not result.ok:
            raise RuntimeError(result.error or "stalled")
        return result.step_cpu_s

    per_rep: dict[str, list[dict]] = {part: [] for part in args.part}
    try:
        for rep in range(args.reps):
            for part in args.part:
                a, b = replay(part, 0), replay(part, 1)
                if len(a) != len(b):
                    print("the two replays scheduled different steps", file=sys.stderr)
                    return 1
                on = [a[i] if i % 2 == 0 else b[i] for i in range(len(a))]
                off = [b[i] if i % 2 == 0 else a[i] for i in range(len(a))]
                figures = {
                    "median_step_ratio": statistics.median(on) / statistics.median(off),
                    "median_per_step_ratio": statistics.median(x / y for x, y in zip(on, off)),
                    "median_step_ms_off": 1e3 * statistics.median(off),
                }
                per_rep[part].append(figures)
                print(f"rep {rep + 1}/{args.reps} {part}: " + ", ".join(f"{k} {v:.4f}" for k, v in figures.items()),
                      file=sys.stderr)
    except RuntimeError as error:
        print(f"replay failed: {error}", file=sys.stderr)
        return 1
    out = {
        "vllm_version": harness.vllm_version(),
        "wrapper": args.wrapper,
        "reps": args.reps,
        "parts": {part: {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}
                  for part, rows in per_rep.items()},
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"kvguard replay step toggle on vLLM {out['vllm_version']} (wrapper {args.wrapper}, {args.reps} reps, "
          f"medians over reps; read each part against aa):")
    for part, f in out["parts"].items():
        print(f"  {part:<10} median step on/off {f['median_step_ratio']:.4f}, median per-step ratio "
              f"{f['median_per_step_ratio']:.4f} (median step off {f['median_step_ms_off']:.3f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
