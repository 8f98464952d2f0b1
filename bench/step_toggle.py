"""Step-time cost of kvguard's parts, switched on and off step by step in one process.

    .venvs/vllm-0.33.0/bin/python bench/step_toggle.py [--part aa admission code all]
        [--admission full|call-only] [--checks full|empty] [--gc freeze|plain] [--full-gc exclude|include] [--reps 5] [--agents 40] [--turns 6] [--json]

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
  instrumentor keeps both; the sliding-window and store checks live in the rewritten code);
- ``wrappers``: kvguard's ``wrapt`` wraps of vLLM methods that run per step or per
  request (``block_exclusive`` on ``update_state_after_alloc``, the GPU pool proxy's
  binding, the SimpleCPUOffloadConnector's lookup) put on the class or taken off, and the
  wait bound's per-scheduler ``build_connector_meta`` wrapper with them (constructors'
  wraps stay: they run once per engine);
- ``all``: the three together, everything kvguard runs in a step;
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
medians barely see it); a part is read against the ``aa`` row of the same run.

The mean, two ways (issue 31): ``sum_ratio`` is each repetition's sum on / sum off, the
median over repetitions (the figure read against ``aa``): one step that another tenant's
burst or a page fault slows by a millisecond moves a repetition's sum by a percent or
more (0.82-1.18 across three repetitions of ``aa``, 4 Dec 2026), so the median over
repetitions is what is read. ``min_sum_ratio`` takes each step's least time over the
repetitions, on and off separately, then sums (the replays are deterministic, and noise
on a host only adds time); ``added_us_per_step`` is the same difference per step in
microseconds (the growth figure of ``bench/growth.py``). Read it with its own ``aa``: at
``--agents 160`` that row reads 0.983 (4 Dec 2026, the cause not found), at the default
traffic 1.001. ``--admission call-only``
makes :func:`~kvguard.guards.checks.admission.admit_return` return vLLM's answer at once (what
the call from vLLM's code costs alone); ``--checks empty`` does that to every entry point
vLLM's code calls in a step (:func:`empty_entry_points`): what ``all`` adds then is the
hooking's own cost, the floor of checking from inside vLLM's Python. The bench needs the admission check in vLLM's
code (the ``admission_return`` rewrite) and a lookup with no other site; it says so and
exits 1 otherwise. ``--gc``: after the warm-up the start-up heap is frozen as vLLM's
EngineCore freezes its own (``freeze``, the default since 3 Dec 2026; ``plain`` leaves it:
the earlier figures were taken so, and a full collection then lands on one step).
``--full-gc``: even with the heap frozen, one automatic full (generation-2) collection lands
on one step of each replay (a scan of every object the replay keeps alive: 40-210 ms CPU on the
bench trace, against a sum of about 1.3 s), on whichever half of the pair that step belongs
to; it was the first pair's `aa` sum ratio of 0.92 (4 Dec 2026, traced with ``gc.callbacks``:
the first replay after the warm-up collects on an odd step, the second on an even one, both
then in the "off" half). ``exclude`` (the default since 4 Dec 2026 evening) takes each step's
full-collection time out of it (``ReplayResult.step_full_gc_s``) and prints the time taken
out per half; ``include`` keeps it (the earlier figures).
A measurement, not a test: exit 0 unless a replay failed. :class:`Toggler` is also what
``bench/growth.py`` measures with.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

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


class Toggler:
    """One installed guard whose parts can be switched on and off step by step, and the
    replays that do it; built after the warm-up replay installed the guard.

    Raises ``RuntimeError`` when the admission check is not in vLLM's lookup code alone
    (the ``admission_return`` rewrite): nothing this bench can switch then.
    """

    PARTS = ("aa", "admission", "code", "wrappers", "all")

    def __init__(self) -> None:
        from kvguard.guards.hooking.instrumentor import OffloadGuardInstrumentor
        from kvguard.lab.replay import harness

        state = OffloadGuardInstrumentor()._state
        originals = dict(state.code_patches)
        self.lookups = [(f, ours, without) for f, ours, without in state.admission_codes]
        if not self.lookups or any(without is not originals[f] for f, _, without in self.lookups):
            raise RuntimeError("the admission check is not in vLLM's lookup code alone (admission_return rewrite)")
        lookup_funcs = {x[0] for x in self.lookups}
        self.codes = [(f, f.__code__, original) for f, original in state.code_patches if f not in lookup_funcs]
        # class-level wrapt wraps that run per step or per request (constructors run once)
        self.wraps = [(owner, attr, owner.__dict__[attr], original) for owner, attr, original in state.attr_patches
                      if attr != "__init__" and attr in owner.__dict__]
        self.recorders: list = []
        init = harness._HitRecorder.__init__
        recorders = self.recorders

        def capture(self_, *a, **k):
            init(self_, *a, **k)
            recorders.append(self_)

        harness._HitRecorder.__init__ = capture
        #: "exclude": each step's time less its full collections' (``--full-gc``, module doc)
        self.full_gc = "exclude"
        #: the last pair's full collections, CPU ms inside on and off steps
        self.last_full_gc_ms = (0.0, 0.0)
        self.removals: list = [None, 0]  # the current replay's policy counting (once watched), recorders before it
        self.instance_wraps: list = [None, 0]  # the current replay's per-scheduler wrappers, recorders before it

    def _scheduler(self) -> Any:
        return self.recorders[-1]._cs if len(self.recorders) > self.removals[1] else None

    def switch(self, part: str, on: bool) -> None:
        if part in ("code", "all"):
            for func, ours, original in self.codes:
                func.__code__ = ours if on else original
        if part in ("admission", "all"):
            for func, ours, without in self.lookups:
                func.__code__ = ours if on else without
            if self.removals[0] is None and (cs := self._scheduler()) is not None:
                self.removals[0] = _Removals.of(cs)
            if self.removals[0] is not None:
                self.removals[0].switch(on)
        if part in ("wrappers", "all"):
            for owner, attr, wrapper, original in self.wraps:
                setattr(owner, attr, wrapper if on else original)
            if self.instance_wraps[0] is None and (cs := self._scheduler()) is not None:
                self.instance_wraps[0] = (cs, {k: v for k, v in cs.__dict__.items()
                                                if getattr(v, "_kvguard_wait_bound", False)})
            if self.instance_wraps[0] is not None:
                cs, attrs = self.instance_wraps[0]
                if on:
                    cs.__dict__.update(attrs)
                else:
                    for name in attrs:
                        cs.__dict__.pop(name, None)

    def replay(self, trace: Any, part: str, parity: int) -> Any:
        """Replay ``trace`` with ``part`` on for the steps of ``parity``; the ReplayResult.
        Raises ``RuntimeError`` when the replay failed or stalled."""
        from kvguard.lab.replay import harness

        step = [0]
        self.removals[:] = [None, len(self.recorders)]
        self.instance_wraps[:] = [None, len(self.recorders)]

        def before() -> None:
            self.switch(part, step[0] % 2 == parity)
            step[0] += 1

        gc.collect()
        try:
            result = harness.run_replay(trace, guard=True, policy="guard", before_step=before)
        finally:
            self.switch("all", True)
        if not result.ok:
            raise RuntimeError(result.error or "stalled")
        return result

    def pair(self, trace: Any, part: str, odd_first: bool = False) -> tuple[list[float], list[float], list[Any]]:
        """Two replays with opposite parity: ``(on, off, results)``, each step's CPU seconds
        with ``part`` on and off (``results``: the two ReplayResults, even parity first).
        ``odd_first``: run the odd-parity replay first (alternated over repetitions, so
        neither half is always timed in the second replay of a pair). Raises
        ``RuntimeError`` when a replay failed or the two scheduled different steps."""
        if odd_first:
            rb = self.replay(trace, part, 1)
            ra = self.replay(trace, part, 0)
        else:
            ra, rb = self.replay(trace, part, 0), self.replay(trace, part, 1)
        a, b = ra.step_cpu_s, rb.step_cpu_s
        if len(a) != len(b):
            raise RuntimeError("the two replays scheduled different steps")
        ga, gb = ra.step_full_gc_s, rb.step_full_gc_s
        self.last_full_gc_ms = tuple(1e3 * sum(half) for half in _halves(ga, gb))
        if self.full_gc == "exclude":
            a = [c - g for c, g in zip(a, ga)]
            b = [c - g for c, g in zip(b, gb)]
        on, off = _halves(a, b)
        return on, off, [ra, rb]


def _halves(even_on: list[float], odd_on: list[float]) -> tuple[list[float], list[float]]:
    """``(on, off)`` per step from the two replays of a pair: ``even_on`` had the part on for
    even steps, ``odd_on`` for odd ones."""
    on = [even_on[i] if i % 2 == 0 else odd_on[i] for i in range(len(even_on))]
    off = [odd_on[i] if i % 2 == 0 else even_on[i] for i in range(len(even_on))]
    return on, off


def figures(reps: list[tuple[list[float], list[float]]]) -> dict[str, float]:
    """The figures of one part from its repetitions' ``(on, off)`` per-step CPU seconds
    (module docstring): medians over repetitions of the per-repetition ratios, and the
    per-step minima over repetitions (``min_sum_ratio``, ``added_us_per_step``)."""
    per_rep = [{
        "median_step_ratio": statistics.median(on) / statistics.median(off),
        "median_per_step_ratio": statistics.median(x / y for x, y in zip(on, off)),
        "sum_ratio": sum(on) / sum(off),
        "median_step_ms_off": 1e3 * statistics.median(off),
    } for on, off in reps]
    out = {k: statistics.median(r[k] for r in per_rep) for k in per_rep[0]}
    steps = min(len(on) for on, _ in reps)
    min_on = [min(on[i] for on, _ in reps) for i in range(steps)]
    min_off = [min(off[i] for _, off in reps) for i in range(steps)]
    out["min_sum_ratio"] = sum(min_on) / sum(min_off)
    out["added_us_per_step"] = 1e6 * (sum(min_on) - sum(min_off)) / steps
    out["mean_step_us_off"] = 1e6 * sum(min_off) / steps
    return out


def warm_up(trace: Any) -> int:
    """The warm-up replay (installs the guard); 0, or 1 after printing why not."""
    from kvguard.lab.replay import harness

    if not harness.run_replay(trace, guard=True, policy="guard").ok:
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
    return 0


def freeze_heap() -> None:
    """What vLLM's EngineCore does once it is built (v1/engine/core.py: freeze_gc_heap(),
    gc.collect of each generation then gc.freeze()): the start-up heap (torch, vLLM, the
    model's modules) is left out of every later collection. Without it a full collection
    scans that whole heap, and whichever step's allocations trigger it pays it all."""
    gc.collect(0)
    gc.collect(1)
    gc.collect(2)
    gc.freeze()


def empty_entry_points() -> None:
    """Make every kvguard entry point that vLLM's code calls in a step return at once, for
    the rest of the process (``--checks empty``): the lookup's ``admit_return`` returns vLLM's
    answer, the window site's ``check`` and the store site's ``check_store`` return None (no
    exception to raise: on the bench trace no check fails), ``block_exclusive``'s wrapper
    and the wait bound's ``observe_step`` call through. What ``all`` still adds then is the
    hooking's own cost: the calls from the rewritten code (with their ``locals()``), the
    ``wrapt`` wrapper, the per-step hook's test, the removal counting. Their code objects
    are replaced (``__code__``), so every reference, the names injected into vLLM's modules
    included, runs the empty body."""
    from kvguard.guards.checks import admission, asserts, wait_bound
    from kvguard.guards.checks.admission import exclusive

    def admit_return(cs, request, num_computed_tokens, answer):
        return answer

    def check(site_id, ok, context=None, msg=None):
        return None

    def check_store(site_id, spec, context):
        return None

    def exclusive_wrapper(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    def observe_step(cs, scheduler_output, frame):
        return None

    admission.admit_return.__code__ = admit_return.__code__
    asserts.check.__code__ = check.__code__
    asserts.check_store.__code__ = check_store.__code__
    exclusive.exclusive_wrapper.__code__ = exclusive_wrapper.__code__
    wait_bound.observe_step.__code__ = observe_step.__code__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", nargs="+", choices=list(Toggler.PARTS), default=["all"],
                        help="the parts to switch, in turn within each repetition")
    parser.add_argument("--admission", choices=["full", "call-only"], default="full")
    parser.add_argument("--checks", choices=["full", "empty"], default="full",
                        help="empty: every kvguard entry point vLLM's code calls returns at once "
                             "(the hooking's own cost, see empty_entry_points)")
    parser.add_argument("--gc", choices=["freeze", "plain"], default="freeze",
                        help="freeze the start-up heap after the warm-up, as EngineCore does (default), or not")
    parser.add_argument("--full-gc", choices=["exclude", "include"], default="exclude",
                        help="exclude (default): each step's time less its full collections' "
                             "(printed per pair); include: as measured")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--agents", type=int, default=40)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

    from kvguard.guards.checks import admission
    from kvguard.lab.replay import harness

    trace = generate_trace(args.agents, args.turns)
    if warm_up(trace):
        return 1
    if args.gc == "freeze":
        freeze_heap()
    if args.admission == "call-only":
        def _call_only(cs, request, num_computed_tokens, answer):
            return answer

        admission.admit_return.__code__ = _call_only.__code__
    if args.checks == "empty":
        empty_entry_points()
    try:
        toggler = Toggler()
    except RuntimeError as error:
        print(f"{error}: nothing this bench can switch", file=sys.stderr)
        return 1
    toggler.full_gc = args.full_gc
    per_rep: dict[str, list[tuple[list[float], list[float]]]] = {part: [] for part in args.part}
    try:
        for rep in range(args.reps):
            for part in args.part:
                on, off, _ = toggler.pair(trace, part, odd_first=rep % 2 == 1)
                per_rep[part].append((on, off))
                f = figures([(on, off)])
                print(f"rep {rep + 1}/{args.reps} {part}: " + ", ".join(
                    f"{k} {f[k]:.4f}" for k in ("median_step_ratio", "median_per_step_ratio", "sum_ratio",
                                                "median_step_ms_off"))
                    + ", full collections in on/off steps {:.1f}/{:.1f} ms ({})".format(
                        *toggler.last_full_gc_ms, "excluded" if args.full_gc == "exclude" else "included"),
                    file=sys.stderr)
    except RuntimeError as error:
        print(f"replay failed: {error}", file=sys.stderr)
        return 1
    out = {
        "vllm_version": harness.vllm_version(),
        "admission": args.admission,
        "checks": args.checks,
        "gc": args.gc,
        "full_gc": args.full_gc,
        "reps": args.reps,
        "agents": args.agents,
        "turns": args.turns,
        "steps": len(per_rep[args.part[0]][0][0]),
        "parts": {part: {k: round(v, 4) for k, v in figures(rows).items()} for part, rows in per_rep.items()},
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"kvguard replay step toggle on vLLM {out['vllm_version']} ({args.agents} agents x {args.turns} turns, "
          f"{out['steps']} steps; admission {args.admission}, gc {args.gc}, full collections {args.full_gc}d, "
          f"{args.reps} reps; read each part against aa):")
    for part, f in out["parts"].items():
        print(f"  {part:<10} median step on/off {f['median_step_ratio']:.4f}, median per-step ratio "
              f"{f['median_per_step_ratio']:.4f}, sum on/off {f['sum_ratio']:.4f}, sum of per-step minima "
              f"on/off {f['min_sum_ratio']:.4f} ({f['added_us_per_step']:+.1f} us per step; median step off "
              f"{f['median_step_ms_off']:.3f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
