"""How kvguard's cost per scheduler step grows with the traffic (issue 31).

    .venvs/vllm-0.33.0/bin/python bench/growth.py [--out build/bench/growth.json] [--reps 2] [--quick]

``bench/step_toggle.py``'s method (one process, one installed guard, everything kvguard
runs in a step switched on for every other step, each step timed once on and once off),
swept over generated traffic on vLLM's real scheduler:

- **running requests**: ``R`` in 8, 16, 32, 64, 128, 256 concurrent agents, ``max_num_seqs
  = R``, GPU blocks for 60% of their prefixes, 3 serialized turns each (so later turns hit
  the CPU tier and load), prompts of 1,000-3,000 tokens;
- **chunks per hit**: 16 agents with prompts of 2,048, 8,192 and 32,768 tokens (8, 32 and
  128 chunks of 256 tokens per full-attention hit).

Per point: the requests scheduled per step (mean), the store checks per step (kvguard's
``store_coverage`` evaluations, which run in the "on" half only, doubled), vLLM's own
mean step time (thread CPU time of ``schedule()`` + ``update_from_output()``, the off
half) and kvguard's added microseconds per step (sums of each step's least time over the
repetitions, on minus off, per step: ``step_toggle.figures``). An ``aa`` row at the
default point says what "no difference" reads as in the same run. Writes JSON for
``bench/plot_growth.py`` (the picture and the table in ``docs/``). A measurement, not a
test: exit 0 unless a replay failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvguard.lab.replay.trace import Geometry, Segment, Trace, TraceRequest  # noqa: E402
from step_toggle import Toggler, figures, freeze_heap, warm_up  # noqa: E402

TOKENS_PER_BLOCK = 32
TOKENS_PER_CHUNK = 256
RUNNING = (8, 16, 32, 64, 128, 256)
PROMPTS = (2048, 8192, 32768)


def growth_trace(agents: int, prompt: tuple[int, int], turns: int = 3, seed: int = 0) -> Trace:
    """``agents`` agents of ``turns`` serialized turns; prompts of ``prompt`` = (least, most)
    tokens, a 100-400-token tool result per later turn, 16-48 output tokens; agents arrive
    four per step. GPU blocks for 60% of the agents' last turns (the rest of the prefixes
    are evicted from the GPU, so later turns load them from the CPU tier), CPU chunks for
    all of them twice."""
    rng = random.Random(seed)
    requests: list[TraceRequest] = []
    longest = prompt[1] + turns * 450
    for a in range(agents):
        segments: list[Segment] = [Segment(seed=10_000 + a, tokens=rng.randrange(prompt[0], prompt[1] + 1))]
        prev: str | None = None
        for t in range(turns):
            rid = f"agent-{a:03d}/turn-{t}"
            if prev is not None:
                segments = segments + [Segment(output_of=prev),
                                       Segment(seed=1_000_000 + 100 * a + t, tokens=rng.randrange(100, 400))]
            requests.append(TraceRequest(id=rid, prompt=tuple(segments), max_tokens=rng.randrange(16, 48),
                                         after=prev, arrival_step=0 if prev else a // 4))
            prev = rid
    requests.sort(key=lambda r: (int(r.id.split("/turn-")[1]), r.arrival_step))
    blocks_per_agent = -(-longest // TOKENS_PER_BLOCK)
    geometry = Geometry(
        tokens_per_block=TOKENS_PER_BLOCK,
        tokens_per_chunk=TOKENS_PER_CHUNK,
        sliding_window=4096,
        num_gpu_blocks=agents * blocks_per_agent * 6 // 10 + 256,
        cpu_chunks=2 * agents * -(-longest // TOKENS_PER_CHUNK) + 256,
        max_num_batched_tokens=8192,
        max_num_seqs=agents,
        max_model_len=65536,
        vocab_size=32000,
    )
    return Trace(name=f"growth-{agents}x{turns}-{prompt[0]}-{prompt[1]}", geometry=geometry,
                 requests=tuple(requests), description="bench/growth.py")


def measure(toggler: Toggler, trace: Trace, part: str, reps: int) -> dict:
    """One point: ``reps`` pairs of replays of ``trace`` with ``part`` switched; the figures."""
    rows = []
    stores = 0
    requests_per_step = 0.0
    for rep in range(reps):
        on, off, results = toggler.pair(trace, part, odd_first=rep % 2 == 1)
        # each replay counts its own (run_replay resets the counts): the two "on" halves
        # together are one replay's stores
        stores += sum(r.checks.get("store_coverage", {}).get("evaluated") or 0 for r in results)
        rows.append((on, off))
        requests_per_step = sum(results[0].step_requests) / len(results[0].step_requests)
    steps = len(rows[0][0])
    f = figures(rows)
    return {
        "steps": steps,
        "requests_per_step": round(requests_per_step, 2),
        "store_checks_per_step": round(stores / reps / steps, 3),
        "vllm_step_us": round(f["mean_step_us_off"], 1),
        "kvguard_added_us_per_step": round(f["added_us_per_step"], 2),
        "min_sum_ratio": round(f["min_sum_ratio"], 4),
        "median_step_ratio": round(f["median_step_ratio"], 4),
        "sum_ratio": round(f["sum_ratio"], 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="build/bench/growth.json")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="two points per sweep (a smoke run)")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from kvguard.lab.replay import harness

    running = RUNNING[:2] if args.quick else RUNNING
    prompts = PROMPTS[:2] if args.quick else PROMPTS
    if warm_up(growth_trace(8, (1000, 3000))):
        return 1
    freeze_heap()
    toggler = Toggler()
    out: dict = {"vllm_version": harness.vllm_version(), "reps": args.reps,
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "running": [], "chunks": [], "aa": None}
    try:
        for r in running:
            point = measure(toggler, growth_trace(r, (1000, 3000)), "all", args.reps)
            point["agents"] = r
            out["running"].append(point)
            print(f"running {r}: {point}", file=sys.stderr)
        aa = measure(toggler, growth_trace(16, (1000, 3000)), "aa", args.reps)
        aa["agents"] = 16
        out["aa"] = aa
        print(f"aa (16 agents): {aa}", file=sys.stderr)
        for tokens in prompts:
            point = measure(toggler, growth_trace(16, (tokens, tokens)), "all", args.reps)
            point["prompt_tokens"] = tokens
            point["chunks_per_hit"] = tokens // TOKENS_PER_CHUNK
            out["chunks"].append(point)
            print(f"prompt {tokens}: {point}", file=sys.stderr)
    except RuntimeError as error:
        print(f"replay failed: {error}", file=sys.stderr)
        return 1
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
