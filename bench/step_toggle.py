"""Step-time cost of kvguard's parts, switched on and off step by step in one process.

    .venvs/vllm-0.33.0/bin/python bench/step_toggle.py [--part aa admission code all]
        [--admission full|call-only] [--gc freeze|plain] [--reps 5] [--agents 40] [--turns 6] [--json]

The lockstep bench (``bench/replay_overhead.py``) compares two processes; its A/A control
still moves by a few percent on this shared host (0.974 on 2 Dec 2026). This one keeps
one process and one installed guard and switches a part of it on for every other step:

- ``admission``: the connector scheduler's lookup with kvguard's admission check in its
  code or not (the instrumentor keeps both code objects: ``admission_codes``), and the
  cache policy's removal counting (:mod:`kvguard.guards.checks.tier_removals`) on or off with it:
  its counting wrappers are taken off the policy for an "off" step and put back after;
  if an entry the policy held before an "off" step is gone or replaced after it, the
  epoch is bumped (a kept verdict is then re-checked, as the counting would have made
  it; :class:`_Removals`);
- ``code``: each other rewritten vLLM function's code, kvguard's or vLLM's original (the
  instrumentor keeps both; the sliding-window check lives in the rewritten code);
- ``all``: both;
- ``aa``: switches nothing (the A/A control: scheduled, switched and timed the same way).

Each repetition replays the generated bench trace twice per part, with the part on for
even steps in the first replay and for odd steps in the second, so every step is timed
once on and once off, in the same minutes; the replays schedule the same steps (the part
changes no decision on this trace: no check fails). Several parts (``--part aa admission
all``) take turns within each repetition, so a part and its A/A control share the
minutes. Printed per repetition and as the median over repetitions: the ratio of the
median step (CPU time, ``time.thread_time``) on / off, the median of the per-step
ratios, and the ratio of the sums (all steps on / all steps off: the mean cost, where
the work of the few steps with a store or a window check counts in full; the two
medians barely see it); a part is read against the ``aa`` row of the same run. ``--admission call-only``
makes :func:`~kvguard.guards.checks.admission.admit_return` return vLLM's answer at once (what
the call from vLLM's code costs alone). The bench needs the admission check in vLLM's
code (the ``admission_return`` rewrite) and a lookup with no other site; it says so and
exits 1 otherwise. ``--gc``: after the warm-up the start-up heap is frozen as vLLM's
EngineCore freezes its own (``freeze``, the default since 3 Dec 2026; ``plain`` leaves it:
the earlier figures were taken so, and a full collection then lands on one step).
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


class _Removals:
    """The removal counting of one scheduler's cache policy, switched off and on."""

    def __init__(self, policy, attrs, epoch, wrappers) -> None:
        self.policy, self.attrs, self.epoch, self.wrappers = policy, attrs, epoch, wrappers
        self.held = None  # the policy's entries before the previous step
        self.was_off = False  # the previous step ran without the counting

    @classmethod
    def of(cls, cs) -> "_Removals | None":
        from kvguard.guards.checks import offload_plan, tier_removals

        plan = cs.__dict__.get(offload_plan.PLAN_ATTR)
        if plan is None or getattr(plan, "epoch", None) is None:
            return None  # not watched yet (no hit checked so far): nothing counts
        policy = plan.policy
        _, _, attrs = offload_plan.policy_reader(cs.manager)
        state = policy.__dict__
        wrappers = {name: state[name] for name in state.get(tier_removals._WRAPPED_ATTR, ())}
        return cls(policy, attrs, plan.epoch, wrappers)

    def switch(self, on: bool) -> None:
        """Before each step of the part: the counting wrappers on (``on``) or off. The
        same work at every step boundary, whatever the parity (a copy of the policy's
        entries and a comparison with the previous copy touch every entry and leave the
        caches as cold for an "on" step as for an "off" one; done only before "on"
        steps, they alone cost about 2% in the on half, 3 Dec 2026)."""
        state = self.policy.__dict__
        gone = self.held is not None and any(getattr(self.policy, a).get(key) is not entry
                                             for a, held in self.held for key, entry in held.items())
        if self.was_off and gone and self.epoch.n is not None:
            self.epoch.n += 2  # an entry left or was replaced while nothing counted
        self.held = [(a, dict(getattr(self.policy, a))) for a in self.attrs]
        if on:
            state.update(self.wrappers)
        else:
            for name in self.wrappers:
                state.pop(name, None)
        self.was_off = not on


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", nargs="+", choices=["aa", "admission", "code", "all"], default=["all"],
                        help="the parts to switch, in turn within each repetition")
    parser.add_argument("--admission", choices=["full", "call-only"], default="full")
    parser.add_argument("--gc", choices=["freeze", "plain"], default="freeze",
                        help="freeze the start-up heap after the warm-up, as EngineCore does (default), or not")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--agents", type=int, default=40)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

    from kvguard.guards.checks import admission
    from kvguard.guards.hooking.instrumentor import OffloadGuardInstrumentor
    from kvguard.lab.replay import harness

    trace = generate_trace(args.agents, args.turns)
    if not harness.run_replay(trace, guard=True, policy="guard").ok:  # warm-up, installs the guard
        print("warm-up replay failed", file=sys.stderr)
        return 1
    from kvguard.guards.checks import wait_bound

    ended = {k: v for k, v in wait_bound.snapshot().items() if ":" in k}
    # a healthy trace: the wait bound must never end a wait here (no false alarm)
    print(f"wait bound on the bench trace: {wait_bound.snapshot().get('evaluated', 0)} observations, "
          f"ended {ended or 'none'}", file=sys.stderr)
    if ended:
        print("the wait bound ended a wait on the bench trace: a false alarm", file=sys.stderr)
        return 1
    if args.gc == "freeze":
        # what vLLM's EngineCore does once it is built (v1/engine/core.py: freeze_gc_heap(),
        # gc.collect of each generation then gc.freeze()): the start-up heap (torch, vLLM,
        # the model's modules) is left out of every later collection. Without it a full
        # collection here scans that whole heap, and whichever step's allocations trigger
        # it pays it all, on or off.
        gc.collect(0)
        gc.collect(1)
        gc.collect(2)
        gc.freeze()
    if args.admission == "call-only":
        def _call_only(cs, request, num_computed_tokens, answer):
            return answer

        admission.admit_return.__code__ = _call_only.__code__

    state = OffloadGuardInstrumentor()._state
    originals = dict(state.code_patches)
    lookups = [(f, ours, without) for f, ours, without in state.admission_codes]
    if not lookups or any(without is not originals[f] for f, _, without in lookups):
        print("the admission check is not in vLLM's lookup code alone (admission_return rewrite): "
              "nothing this bench can switch", file=sys.stderr)
        return 1
    codes = [(f, f.__code__, original) for f, original in state.code_patches if f not in {x[0] for x in lookups}]
    recorders: list = []
    init = harness._HitRecorder.__init__

    def capture(self, *a, **k):
        init(self, *a, **k)
        recorders.append(self)

    harness._HitRecorder.__init__ = capture
    removals: list = [None, 0]  # the current replay's policy counting (once watched), recorders before it

    def switch(part: str, on: bool) -> None:
        if part in ("code", "all"):
            for func, ours, original in codes:
                func.__code__ = ours if on else original
        if part in ("admission", "all"):
            for func, ours, without in lookups:
                func.__code__ = ours if on else without
            if removals[0] is None and len(recorders) > removals[1]:
                removals[0] = _Removals.of(recorders[-1]._cs)
            if removals[0] is not None:
                removals[0].switch(on)

    def replay(part: str, parity: int) -> list[float]:
        step = [0]
        removals[:] = [None, len(recorders)]

        def before() -> None:
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
                    "sum_ratio": sum(on) / sum(off),
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
        "admission": args.admission,
        "gc": args.gc,
        "reps": args.reps,
        "parts": {part: {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}
                  for part, rows in per_rep.items()},
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"kvguard replay step toggle on vLLM {out['vllm_version']} (admission {args.admission}, gc {args.gc}, {args.reps} reps, "
          f"medians over reps; read each part against aa):")
    for part, f in out["parts"].items():
        print(f"  {part:<10} median step on/off {f['median_step_ratio']:.4f}, median per-step ratio "
              f"{f['median_per_step_ratio']:.4f}, sum on/off {f['sum_ratio']:.4f} "
              f"(median step off {f['median_step_ms_off']:.3f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
