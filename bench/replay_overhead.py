"""Step-time cost of the guard: replay one long trace with and without it, in one process.

    .venvs/vllm-0.33.0/bin/python bench/replay_overhead.py [--reps 6] [--agents 40]
        [--turns 6] [--write-trace PATH] [--json]

The trace is generated (``generate_trace``): ``agents`` concurrent agent sessions of
``turns`` serialized turns each (>= 200 requests by default: 40 x 6 = 240) on the
seed geometry (full attention + sliding window 4096, GPU block 32, offloaded block 256).
Each turn's prompt is the previous turn's prompt, its output and a new tool result, so
the GPU prefix cache, CPU stores and CPU loads all run; the GPU pool is small enough
that agents evict each other and later turns load from the CPU tier.

Two processes replay the trace, one with the guard (installed through the plugin, as in
vLLM) and one without (``KVGUARD_DISABLE=1``), each after one unmeasured warm-up replay,
``--reps`` times each, **in lockstep**: both pinned to one core, they take turns step by
step (``harness.run_replay(before_step=...)`` waits for the coordinator's go in a pipe
read, outside the timed window), so the host's speed drift over seconds to minutes hits
both sides of a step pair alike (:func:`_lockstep`). The measured time of a step is
``schedule()`` + ``update_from_output()`` (the simulated worker is not timed), in two clocks: the engine thread's CPU time
(``time.thread_time``; the headline figure, since on a shared machine the wall clock also
counts the time other processes held the core: A/A controls on this host spanned 0.98-1.14
in wall time) and wall time (``perf_counter``). Both sides schedule the same steps, so each
side's time of step i is its fastest over the repetitions; printed are, per clock, the
median of those per side and their ratio (guard / no guard), beside the pooled medians and
the median of per-repetition ratios. The goal is <= 1.01, since a check that passes should
cost what vLLM's ``assert`` cost; ``--control`` (both sides unguarded) shows the noise floor
of the same statistics in the same minutes. Exit status is 0 whatever the ratio (a measurement,
not a test); 1 only if a replay failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvguard.lab.replay.trace import Geometry, Segment, Trace, TraceRequest  # noqa: E402

GEOMETRY = Geometry(
    tokens_per_block=32,
    tokens_per_chunk=256,
    sliding_window=4096,
    num_gpu_blocks=2048,
    cpu_chunks=4096,
    max_num_batched_tokens=8192,
    max_num_seqs=16,
    max_model_len=65536,
    vocab_size=32000,
)


def generate_trace(agents: int = 40, turns: int = 6, seed: int = 0) -> Trace:
    """``agents`` x ``turns`` requests: serialized turns per agent, agents staggered.

    Agent ``a`` starts at step ``3 * a`` with a system+task prompt of 4,000-12,000
    tokens; turn ``t`` appends turn ``t-1``'s output and a 200-1,500-token tool result.
    Deterministic for a given ``seed``.
    """
    rng = random.Random(seed)
    requests: list[TraceRequest] = []
    for a in range(agents):
        prompt: list[Segment] = [Segment(seed=10_000 + a, tokens=rng.randrange(4000, 12000))]
        prev: str | None = None
        for t in range(turns):
            rid = f"agent-{a:03d}/turn-{t}"
            if prev is not None:
                prompt = prompt + [
                    Segment(output_of=prev),
                    Segment(seed=1_000_000 + 100 * a + t, tokens=rng.randrange(200, 1500)),
                ]
            requests.append(
                TraceRequest(
                    id=rid,
                    prompt=tuple(prompt),
                    max_tokens=rng.randrange(8, 48),
                    after=prev,
                    arrival_step=0 if prev else 3 * a,
                )
            )
            prev = rid
    # Arrival order: by the step the first turn arrives, then turn index (file order
    # must list a request after the ones it waits for).
    requests.sort(key=lambda r: (int(r.id.split("/turn-")[1]), r.arrival_step))
    return Trace(
        name=f"bench-agents-{agents}x{turns}",
        geometry=GEOMETRY,
        requests=tuple(requests),
        description=f"{agents} agents x {turns} serialized turns (bench/replay_overhead.py)",
    )


def _side(conn: Any, guard: bool, policy: str, agents: int, turns: int, reps: int, cpu: int | None) -> None:
    """One side of the lockstep bench, in its own process: a warm-up replay, then ``reps``
    replays whose every step waits for the coordinator's go (``before_step``)."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})  # both sides on one core: the same core's speed
    from kvguard.lab.replay import harness

    trace = generate_trace(agents, turns)
    if not harness.run_replay(trace, guard=guard, policy=policy).ok:
        conn.send(("failed", "warm-up replay failed"))
        return

    def wait_for_go() -> None:
        conn.send(("wait",))
        conn.recv()

    for _ in range(reps):
        gc.collect()  # the previous replay's engine must not be collected mid-replay
        result = harness.run_replay(trace, guard=guard, policy=policy, before_step=wait_for_go)
        if not result.ok:
            conn.send(("failed", result.error or "stalled"))
            return
        checks = {k: v["evaluated"] for k, v in (result.checks or {}).items() if v.get("evaluated")}
        conn.send(("done", result.step_cpu_s, result.step_times_s, checks))


def _lockstep(args: Any, per_rep: dict) -> dict:
    """Run the guarded and the unguarded replays in two processes, step by step in turn
    (one step of one side, then the same step of the other; the waiting side sleeps in a
    pipe read, outside its timed window). The host's speed drifts over seconds to minutes
    on this shared machine (the same replay measured 0.36 and 0.58 ms per step minutes
    apart); both sides of one step pair run within milliseconds, so the drift hits both.
    Fills ``per_rep[clock][guard]``; returns the guarded side's evaluated checks.
    RuntimeError when a replay fails."""
    ctx = multiprocessing.get_context("spawn")
    # the core both sides run on (they take turns, so they never compete for it): the
    # last one this process may use
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cpu = cores[-1] if cores else None
    conns, procs = {}, []
    for guard in (True, False):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_side, args=(child, guard and not args.control, args.policy,
                                               args.agents, args.turns, args.reps, cpu), daemon=True)
        proc.start()
        conns[guard] = parent
        procs.append(proc)
    checks: dict = {}
    try:
        pending = {guard: conn.recv() for guard, conn in conns.items()}
        reps_done = {True: 0, False: 0}
        step = 0
        while any(n < args.reps for n in reps_done.values()):
            order = (True, False) if step % 2 == 0 else (False, True)
            step += 1
            for guard in order:
                msg = pending[guard]
                if msg[0] == "failed":
                    raise RuntimeError(f"replay failed (guard={guard}): {msg[1]}")
                if msg[0] == "done":
                    per_rep["cpu"][guard].append(msg[1])
                    per_rep["wall"][guard].append(msg[2])
                    if guard:
                        checks = msg[3]
                    reps_done[guard] += 1
                    print(f"rep {reps_done[guard]}/{args.reps} guard={'on ' if guard else 'off'}: "
                          f"{len(msg[1])} steps, median step {1e3 * statistics.median(msg[1]):.3f} ms CPU",
                          file=sys.stderr)
                    pending[guard] = conns[guard].recv() if reps_done[guard] < args.reps else ("end",)
                    continue
                if msg[0] == "wait":
                    conns[guard].send("go")
                    pending[guard] = conns[guard].recv()
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return checks


def _ratios(per_rep: dict[bool, list[list[float]]]) -> dict:
    """Per-step statistics of one clock: ``per_rep[guard]`` holds each repetition's step
    times (seconds, the same steps on both sides). Step i's time per side is its fastest
    over the repetitions; the ratio is of the medians of those (guard / no guard)."""
    fastest_on = [min(col) for col in zip(*per_rep[True])]
    fastest_off = [min(col) for col in zip(*per_rep[False])]
    best_on = statistics.median(fastest_on)
    best_off = statistics.median(fastest_off)
    pooled_on = statistics.median(t for r in per_rep[True] for t in r)
    pooled_off = statistics.median(t for r in per_rep[False] for t in r)
    pairs = [statistics.median(a) / statistics.median(b) for a, b in zip(per_rep[True], per_rep[False])]
    return {
        "median_step_ms": {"guard": round(1e3 * best_on, 4), "no_guard": round(1e3 * best_off, 4)},
        "median_step_time_ratio": round(best_on / best_off, 4),
        "pooled_median_ratio": round(pooled_on / pooled_off, 4),
        "median_of_rep_ratios": round(statistics.median(pairs), 4),
        # the whole replay's step time (sum of each step's fastest): what a replay costs,
        # heavy prefill steps included, where the median is the typical step
        "total_time_ratio": round(sum(fastest_on) / sum(fastest_off), 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--reps", type=int, default=6, help="repetitions per side, even keeps the order balanced"
    )
    parser.add_argument("--agents", type=int, default=40)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--policy", default="guard", choices=["observe", "guard", "strict"])
    parser.add_argument("--write-trace", metavar="PATH", help="also write the trace as JSONL")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--control",
        action="store_true",
        help="A/A control: both sides run without the guard (shows the noise floor)",
    )
    args = parser.parse_args(argv)

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    trace = generate_trace(args.agents, args.turns)
    if args.write_trace:
        Path(args.write_trace).write_text(trace.dumps(), encoding="utf-8")

    from kvguard.lab.replay import harness

    clocks = ("cpu", "wall")
    per_rep: dict[str, dict[bool, list[list[float]]]] = {c: {True: [], False: []} for c in clocks}
    t0 = time.perf_counter()
    try:
        checks = _lockstep(args, per_rep)
    except RuntimeError as error:
        print(str(error), file=sys.stderr)
        return 1
    if len({len(r) for c in clocks for r in per_rep[c][True] + per_rep[c][False]}) != 1:
        print("the two sides scheduled different steps: no per-step comparison", file=sys.stderr)
        return 1
    figures = {c: _ratios(per_rep[c]) for c in clocks}
    cpu = figures["cpu"]
    out = {
        "vllm_version": harness.vllm_version(),
        "trace": trace.name,
        "requests": len(trace.requests),
        "reps": args.reps,
        "steps_per_replay": len(per_rep["cpu"][True][0]),
        "median_step_ms": cpu["median_step_ms"],
        "median_step_time_ratio": cpu["median_step_time_ratio"],
        "pooled_median_ratio": cpu["pooled_median_ratio"],
        "median_of_rep_ratios": cpu["median_of_rep_ratios"],
        "total_time_ratio": cpu["total_time_ratio"],
        "clock": "thread CPU time",
        "wall_clock": figures["wall"],
        "goal": 1.01,
        "control": args.control,
        "checks_evaluated_per_replay": checks,
        "bench_wall_s": round(time.perf_counter() - t0, 1),
    }
    if args.json:
        print(json.dumps(out))
    else:
        wall = figures["wall"]
        print(
            f"kvguard bench: {out['requests']} requests x {args.reps} reps per side on vLLM "
            f"{out['vllm_version']}, {out['steps_per_replay']} steps per replay"
            f"{' (A/A control: both sides unguarded)' if args.control else ''}\n"
            f"  median step CPU time: guard {cpu['median_step_ms']['guard']} ms, "
            f"no guard {cpu['median_step_ms']['no_guard']} ms\n"
            f"  median step-time ratio (guard / no guard, thread CPU time): {cpu['median_step_time_ratio']} "
            f"(goal <= 1.01; pooled medians {cpu['pooled_median_ratio']}, "
            f"median of per-rep ratios {cpu['median_of_rep_ratios']}; "
            f"total step time {cpu['total_time_ratio']})\n"
            f"  wall clock: {wall['median_step_time_ratio']} (pooled {wall['pooled_median_ratio']}, "
            f"per-rep {wall['median_of_rep_ratios']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
