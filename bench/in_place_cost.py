"""Where kvguard's time goes inside a replay: each entry point timed in place (issue 31).

    .venvs/vllm-0.33.0/bin/python bench/in_place_cost.py [--agents 40] [--turns 6] [--checks full|empty]

A warm loop (the same call repeated) shows a check at a fraction of what a step pays: in
an engine step each check runs once, after vLLM's own work has pushed kvguard's code and
data out of the CPU caches. So after a warm-up replay this script wraps each of kvguard's
entry points where vLLM calls it (the names injected into vLLM's rewritten modules:
``admit_return`` in the lookup, ``check_store`` in the store builder, ``check`` at the
window site; the ``wrapt`` wrapper of ``update_state_after_alloc``, timed without vLLM's
own method; the wait bound's per-step ``observe_step``; the cache policy's counted
methods, timed without the policy's own method) with a ``time.perf_counter_ns`` pair and
replays the bench trace once more. Printed per entry point: calls, mean microseconds per
call, microseconds per step; and the timer's own cost per call (an empty function through
the same wrapper). Wall time around code that runs on one thread without I/O; the timer's
own cost (about 0.13 us) is in each figure. ``--checks empty`` empties every entry point
first (``step_toggle.empty_entry_points``): what is left per entry point is the hooking's own
cost, and full minus empty is the checks' own work (issue 31's decomposition). A
measurement, not a test.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from replay_overhead import generate_trace  # noqa: E402

_clock = time.perf_counter_ns
totals: dict[str, list[int]] = {}


def timed(name: str, func):
    """``func`` with its calls' time added to ``totals[name]``."""
    def call(*args, **kwargs):
        t0 = _clock()
        try:
            return func(*args, **kwargs)
        finally:
            entry = totals.setdefault(name, [0, 0])
            entry[0] += _clock() - t0
            entry[1] += 1
    return call


def timed_inside(func, inside: list[int]):
    """``func`` with its calls' time added to ``inside[0]`` (what a caller subtracts)."""
    def inner(*a, **k):
        t1 = _clock()
        try:
            return func(*a, **k)
        finally:
            inside[0] += _clock() - t1
    return inner


def timed_around(name: str, wrapper):
    """A ``wrapt`` wrapper function whose own time (without the wrapped call) goes to ``totals[name]``."""
    def outer(wrapped, instance, args, kwargs):
        inside = [0]
        inner = timed_inside(wrapped, inside)
        t0 = _clock()
        try:
            return wrapper(inner, instance, args, kwargs)
        finally:
            entry = totals.setdefault(name, [0, 0])
            entry[0] += _clock() - t0 - inside[0]
            entry[1] += 1
    return outer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=40)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--checks", choices=["full", "empty"], default="full",
                        help="empty: every entry point returns at once (the hooking's own cost)")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import wrapt

    from kvguard.guards.checks import tier_removals, wait_bound
    from kvguard.guards.hooking import rewrite
    from kvguard.guards.hooking.instrumentor import OffloadGuardInstrumentor
    from kvguard.lab.replay import harness

    trace = generate_trace(args.agents, args.turns)
    if not harness.run_replay(trace, guard=True, policy="guard").ok:
        print("warm-up replay failed", file=sys.stderr)
        return 1
    gc.collect()
    gc.freeze()
    if args.checks == "empty":
        from step_toggle import empty_entry_points

        empty_entry_points()
    state = OffloadGuardInstrumentor()._state
    for module in state.injected:
        for name in (rewrite.GLOBAL_CHECK, rewrite.GLOBAL_CHECK_STORE, rewrite.GLOBAL_ADMIT_RETURN):
            if name in module.__dict__:
                module.__dict__[name] = timed(name.lstrip("@").replace("kvguard_", ""), module.__dict__[name])
    for owner, attr, original in state.attr_patches:
        current = owner.__dict__.get(attr)
        if attr != "__init__" and isinstance(current, wrapt.FunctionWrapper):
            label = f"{current._self_wrapper.__name__} ({attr})"
            setattr(owner, attr, wrapt.FunctionWrapper(original, timed_around(label, current._self_wrapper)))
    wait_bound.observe_step = timed("observe_step (wait bound, a step with a watched request)", wait_bound.observe_step)
    counting = tier_removals._counting

    def timed_counting(method, epoch, policy, attrs, keyed):
        inside = [0]
        counted = counting(timed_inside(method, inside), epoch, policy, attrs, keyed)

        def call(*a, **k):
            before, t0 = inside[0], _clock()
            try:
                return counted(*a, **k)
            finally:
                entry = totals.setdefault("removal counting (cache policy, per call)", [0, 0])
                entry[0] += _clock() - t0 - (inside[0] - before)
                entry[1] += 1

        call.__wrapped__ = method
        return call

    # the next replay's cache policy gets its counting wrappers through this
    tier_removals._counting = timed_counting
    result = harness.run_replay(trace, guard=True, policy="guard")
    steps = len(result.step_cpu_s)
    empty = timed("(timer, empty call)", lambda: None)
    for _ in range(1000):
        empty()
    print(f"vLLM {harness.vllm_version()}, {args.agents} agents x {args.turns} turns, checks {args.checks}: "
          f"{steps} steps, mean step "
          f"{1e6 * sum(result.step_cpu_s) / steps:.1f} us CPU, requests scheduled per step "
          f"{sum(result.step_requests) / steps:.1f}")
    print(f"  {'entry point':<58} {'calls':>7} {'us/call':>8} {'us/step':>8}")
    total = 0.0
    for name, (ns, n) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        per_step = ns / steps / 1e3 if not name.startswith("(") else float("nan")
        if not name.startswith("("):
            total += per_step
        print(f"  {name:<58} {n:>7} {ns / n / 1e3:>8.2f} {per_step:>8.2f}")
    print(f"  {'all entry points':<58} {'':>7} {'':>8} {total:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
