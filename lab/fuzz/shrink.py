"""Shrink a trace to a minimal one that still shows the same finding class.

Delta debugging over the :class:`~kvguard.lab.replay.trace.Trace` itself, not
Hypothesis' shrinker. Why:

- it knows the trace's structure: removing a request removes the requests that wait for
  it (``after`` / ``output_of``), so every candidate is a valid trace; Hypothesis shrinks
  the choice sequence, and most of its candidates would change the geometry or the
  traffic shape at once, which loses a timing-dependent class;
- it shrinks any trace, also one not produced by the strategies (a seed trace, a trace
  from production), and the predicate is "the same class", whatever that class is;
- its cost is bounded by a replay count (``max_replays``), so ``kvguard fuzz`` knows what
  shrinking costs; the moves are deterministic, so the minimal trace is too.

Moves, repeated until none helps (each accepted only when ``predicate(candidate)``):
the immediate worker instead of a worker model (where the trace has one); the
synchronous scheduler instead of ``async_scheduling``; no ``secondary_tiers`` (the CPU
tier alone: a class that also shows without vLLM's tiering does not depend on it);
remove a chunk of requests (halves, then quarters, ..., then one at a time, each with
its dependents); remove a prompt segment; cut all segments of one seed (a shared
prefix) and then each segment alone to a half, a quarter...; ``max_tokens`` to 1;
a request's ``abort_at_step`` to none; a request's ``after`` / ``arrival_step`` to none (it arrives at step 0).
The geometry is otherwise kept: the class is usually a property of the geometry.

The size order is (requests, prompt tokens, output tokens); a candidate is accepted only
when it is strictly smaller, so shrinking terminates.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

from kvguard.lab.replay.trace import Segment, Trace, TraceRequest


def size(trace: Trace) -> tuple[int, int, int]:
    """``(requests, prompt tokens of seed segments, sum of max_tokens)``."""
    tokens = sum(s.tokens for r in trace.requests for s in r.prompt if s.output_of is None)
    return len(trace.requests), tokens, sum(r.max_tokens for r in trace.requests)


def without(trace: Trace, ids: set[str]) -> Trace | None:
    """``trace`` without requests ``ids`` and every request that waits for one (None if empty)."""
    gone = set(ids)
    kept: list[TraceRequest] = []
    for r in trace.requests:
        if r.id in gone or any(w in gone for w in r.waits_for):
            gone.add(r.id)
            continue
        kept.append(r)
    if not kept:
        return None
    return dataclasses.replace(trace, requests=tuple(kept))


def _replace_request(trace: Trace, index: int, req: TraceRequest) -> Trace:
    reqs = list(trace.requests)
    reqs[index] = req
    return dataclasses.replace(trace, requests=tuple(reqs))


def _candidates(trace: Trace) -> Iterator[Trace]:
    reqs = trace.requests
    # 0. the immediate worker (no latency, no failed transfers), where the format has one
    model = getattr(trace, "worker", None)
    if model is not None and not model.is_default:
        yield dataclasses.replace(trace, worker=type(model)())
    # 0b. the synchronous scheduler instead of async scheduling (a class that also shows
    # without the output lag does not depend on it)
    if getattr(trace.geometry, "async_scheduling", False):
        yield dataclasses.replace(
            trace, geometry=dataclasses.replace(trace.geometry, async_scheduling=False)
        )
    # 0c. the CPU tier alone instead of vLLM's tiering manager
    if getattr(trace.geometry, "secondary_tiers", None):
        yield dataclasses.replace(
            trace, geometry=dataclasses.replace(trace.geometry, secondary_tiers=None)
        )
    ids = [r.id for r in reqs]
    # 1. remove chunks of requests (ddmin-style: large chunks first)
    n = len(ids)
    chunk = max(1, n // 2)
    while True:
        for start in range(0, n, chunk):
            cand = without(trace, set(ids[start : start + chunk]))
            if cand is not None:
                yield cand
        if chunk == 1:
            break
        chunk = max(1, chunk // 2)
    # 2. remove one prompt segment
    for i, r in enumerate(reqs):
        if len(r.prompt) > 1:
            for j in range(len(r.prompt)):
                yield _replace_request(trace, i, dataclasses.replace(r, prompt=r.prompt[:j] + r.prompt[j + 1 :]))
    # 3. cut every segment of one seed at once (keeps shared prefixes shared), then one segment
    seeds = sorted({s.seed for r in reqs for s in r.prompt if s.output_of is None and s.seed is not None})
    for seed in seeds:
        longest = max(s.tokens for r in reqs for s in r.prompt if s.seed == seed and s.output_of is None)
        for frac in (2, 4, 8):
            cut = longest - max(1, longest // frac)

            def shrink_seg(s: Segment, seed: int = seed, cut: int = cut) -> Segment:
                if s.output_of is None and s.seed == seed:
                    return Segment(seed=seed, tokens=max(1, min(s.tokens, cut)))
                return s

            new = tuple(dataclasses.replace(r, prompt=tuple(shrink_seg(s) for s in r.prompt)) for r in reqs)
            yield dataclasses.replace(trace, requests=new)
    for i, r in enumerate(reqs):
        for j, s in enumerate(r.prompt):
            if s.output_of is not None or s.tokens <= 1:
                continue
            for frac in (2, 4, 8, 64):
                t = s.tokens - max(1, s.tokens // frac)
                seg = Segment(seed=s.seed, tokens=max(1, t))
                yield _replace_request(
                    trace, i, dataclasses.replace(r, prompt=r.prompt[:j] + (seg,) + r.prompt[j + 1 :])
                )
    # 4. shorter outputs
    for i, r in enumerate(reqs):
        if r.max_tokens > 1:
            yield _replace_request(trace, i, dataclasses.replace(r, max_tokens=1))
            yield _replace_request(trace, i, dataclasses.replace(r, max_tokens=r.max_tokens // 2 or 1))
    # 5. no client abort
    for i, r in enumerate(reqs):
        if getattr(r, "abort_at_step", None) is not None:
            yield _replace_request(trace, i, dataclasses.replace(r, abort_at_step=None))
    # 6. arrive at step 0 without waiting (only requests that do not read an output)
    for i, r in enumerate(reqs):
        if (r.after is not None or r.arrival_step) and not any(s.output_of for s in r.prompt):
            yield _replace_request(trace, i, dataclasses.replace(r, after=None, arrival_step=0))


def _order(trace: Trace) -> tuple:
    reqs = trace.requests
    aborts = sum(1 for r in reqs if getattr(r, "abort_at_step", None) is not None)
    model = getattr(trace, "worker", None)
    busy_worker = int(model is not None and not model.is_default)
    lag = int(getattr(trace.geometry, "async_scheduling", False))
    tiers = len(getattr(trace.geometry, "secondary_tiers", None) or ())
    return size(trace) + (busy_worker, lag, tiers, aborts, sum(1 for r in reqs if r.after), sum(r.arrival_step for r in reqs))


@dataclasses.dataclass
class ShrinkResult:
    """The smallest trace found, the replays spent and whether the budget ran out."""

    trace: Trace
    replays: int
    exhausted: bool
    wall_s: float


def shrink(
    trace: Trace,
    predicate: Callable[[Trace], bool],
    *,
    max_replays: int = 200,
    max_seconds: float | None = None,
) -> ShrinkResult:
    """Delta-debug ``trace`` to a smaller trace for which ``predicate`` still holds.

    ``predicate(trace)`` must be true for ``trace`` (not re-checked) and is called at most
    ``max_replays`` times (and not after ``max_seconds`` of wall time). Deterministic for a
    deterministic predicate. Returns the smallest accepted trace (``trace`` itself when
    no move helped).
    """
    t0 = time.monotonic()
    best = trace
    replays = 0
    exhausted = False
    improved = True
    while improved and not exhausted:
        improved = False
        for cand in _candidates(best):
            if _order(cand) >= _order(best):
                continue
            if replays >= max_replays or (max_seconds is not None and time.monotonic() - t0 > max_seconds):
                exhausted = True
                break
            replays += 1
            if predicate(cand):
                best = cand
                improved = True
                break  # restart the moves from the smaller trace
    return ShrinkResult(best, replays, exhausted, time.monotonic() - t0)
