"""Never worse than vLLM alone: a guarded replay compared with the same replay unguarded.

An instrumentation library's first promise is that it never makes its host worse. For
every fuzz example where kvguard acted (any ``check:action`` its metrics counted: an
assert tolerated, a store dropped, a hit cut, a request failed, a raise), the runner
replays the same trace once more with the guard removed (:func:`kvguard.lab.fuzz.runner.prepare`)
and compares the two replays **request by request** (:func:`compare`).

Each trace request ends one way (``ReplayResult.request_fates``), ranked by what its
client gets (:data:`RANK`, higher is better):

====  =======================================================================================
3     ``finished`` with the right KV, or ``aborted`` by the trace (the client's own choice)
2     ``failed``: ended with an error status its client sees; ``not_arrived``: never sent,
      because a request it waits for (directly or through others) failed (an agent's next
      turn after an error)
1     ``unfinished``: arrived and never ended (stranded in a stall, or lost with the engine);
      ``not_arrived_stalled``: never sent, no request it waits for failed (it waits behind a
      stranded one, or the replay stopped first: lost with the stall; ranking it 2 made the
      0.29.0 hour's guarded life, which stalled at epoch 394 where vLLM alone stalled at
      epoch 10, look ``worse`` for the 10 requests it stranded, 7 Dec 2026);
      ``not_arrived`` in a replay whose engine died (lost with it: ranking it 2 made a guarded
      run that lived longer before the same worker-model death look worse, 88 false
      ``worse`` verdicts in the first full run, 5 Dec 2026)
0     read wrong KV (the KV-content oracle found one of its blocks wrong), whatever its end:
      an engine that serves wrong KV is worse than one that crashes
====  =======================================================================================

The verdict of an example (:class:`Verdict`):

- ``worse``: some request ranks lower guarded than unguarded, or vLLM alone kept the
  engine alive and the guarded run lost it. A kvguard bug class (``worse-than-vllm-alone``),
  shrunk and reported like any other.
- ``better``: no request ranks lower and at least one ranks higher (or vLLM alone died
  and the guarded engine lived).
- ``same``: vLLM alone served every request right, and so did the guarded run. When
  kvguard cut a hit here (``hit_reduced``), it acted where vLLM alone would have served the
  same requests whole: the cut is counted per check as the *price* of acting early
  (:attr:`Verdict.price`), a recompute, never a worse outcome.
- ``no_better``: vLLM alone is wrong somewhere (a request stranded or failed, wrong KV, a
  death) and the guarded run is exactly as wrong: kvguard acted on something else in the
  example and left that wrong as it was. Counted, not a bug (the waits kvguard does not end,
  such as a worker that never reports a load it cannot tell apart from a slow one, stay
  vLLM's; docs/fuzz.md "Differential fuzzing").

Decisions (the issue was silent): a request the trace aborts counts as served whichever
run aborted it, since the abort is the client's; ``not_arrived`` ranks with ``failed``
because its cause is one. Requests are compared by outcome, not by latency: a guarded run
that finishes every request in more steps is ``same`` (the price counts the cuts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: What a request's client gets, by its fate (see the module docstring).
RANK = {"finished": 3, "aborted": 3, "failed": 2, "not_arrived": 2, "unfinished": 1, "not_arrived_stalled": 1}
#: The rank of a request that read wrong KV.
WRONG_KV_RANK = 0
#: Verdicts, best first.
VERDICTS = ("better", "same", "no_better", "worse")
#: The class name prefix of a guarded example that ended worse than vLLM alone.
WORSE_CLASS = "worse-than-vllm-alone"


def acted(actions: dict[str, int]) -> bool:
    """Whether kvguard acted in a replay: any ``check:action`` count (``engine_died``, the
    runner's mark of a death, is not an action)."""
    return any(k != "engine_died" for k in actions)


def to_compare(actions: dict[str, int]) -> bool:
    """Whether a guarded replay is compared with vLLM alone: kvguard acted, or the guarded
    engine died (a guarded death vLLM alone does not have is a ``worse`` verdict)."""
    return bool(actions)


def failed_load_requests(result: Any) -> set[str]:
    """Ids of requests with a load job the simulated worker reported failed (the worker
    model's drawn transfer failures, ``lab/replay/jobs.py``)."""
    queue = getattr(getattr(result, "worker", None), "queue", None)
    done = getattr(queue, "completed", None) or []
    return {j.req_id for j in done if not j.success and not j.is_store}


def failed_after_drawn_load_failure(result: Any) -> frozenset[str]:
    """Ids of the requests that ended ``failed`` after a failed load
    (:func:`failed_load_requests`): vLLM's own failure path (0.34.0 fails the request), not
    an action of kvguard's."""
    failed = {f.get("request_id") for f in (getattr(result, "failed_requests", None) or [])}
    return frozenset(failed & failed_load_requests(result))


@dataclass(frozen=True)
class Summary:
    """What :func:`compare` needs of one ``ReplayResult``: per request its rank
    (:func:`ranks`), whether the engine survived, and the steps replayed. Small, so a fuzz
    run keeps one per acted example until it replays them unguarded in one batch."""

    ranks: dict[str, int]
    survived: bool
    steps: int

    #: requests failed by vLLM after a drawn failed load (:func:`failed_after_drawn_load_failure`)
    failed_by_drawn_failure: frozenset[str] = frozenset()

    @classmethod
    def of(cls, result: Any) -> "Summary":
        return cls(ranks(result), bool(result.engine_survived), int(result.steps),
                   failed_after_drawn_load_failure(result))


def ranks(result: Any) -> dict[str, int]:
    """Per trace request id, the rank (:data:`RANK`) of its end in one ``ReplayResult``.

    Uses ``result.request_fates`` and ``result.wrong_kv_requests``; a request missing
    from the fates (a replay that never built its engine) is not ranked.
    """
    wrong = result.wrong_kv_requests
    died = not result.engine_survived
    out = {}
    for rid, fate in (result.request_fates or {}).items():
        if rid in wrong:
            out[rid] = WRONG_KV_RANK
        elif died and fate == "not_arrived":
            out[rid] = RANK["unfinished"]  # never served: lost with the engine, not failed
        else:
            out[rid] = RANK[fate]
    return out


def all_served(summary: Summary) -> bool:
    """True when the engine survived and every request ranks 3 (finished right or aborted)."""
    return summary.survived and all(r == 3 for r in summary.ranks.values())


@dataclass
class Verdict:
    """One example's comparison: ``verdict`` (:data:`VERDICTS`), the requests that ended
    ``worse`` / ``better`` guarded (ids), whether each engine survived, and ``price``: the
    checks that cut a hit (``hit_reduced``) in an example vLLM alone served whole."""

    verdict: str
    worse: list[str] = field(default_factory=list)
    better: list[str] = field(default_factory=list)
    guarded_survived: bool = True
    unguarded_survived: bool = True
    price: list[str] = field(default_factory=list)
    #: steps of each replay (guarded, unguarded): what acting cost in time
    steps: tuple[int, int] = (0, 0)
    #: ``worse`` only through the worker model's drawn transfer failures: every request
    #: ranked worse was failed by vLLM after a drawn failed load (set by :func:`compare`)
    by_drawn_failure: bool = False
    #: the verdict of the same comparison with the drawn failures off, where it was made
    without_drawn_failures: str | None = None

    def detail(self) -> str:
        """One line for a finding's detail."""
        parts = [f"{self.verdict}: guarded {self.steps[0]} steps, vLLM alone {self.steps[1]}"]
        if self.worse:
            parts.append(f"worse: {', '.join(self.worse[:5])}")
        if self.better:
            parts.append(f"better: {', '.join(self.better[:5])}")
        if self.unguarded_survived and not self.guarded_survived:
            parts.append("the guarded engine died where vLLM alone lived")
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        out = {"verdict": self.verdict, "worse": self.worse, "better": self.better,
               "guarded_survived": self.guarded_survived, "unguarded_survived": self.unguarded_survived,
               "price": self.price, "steps": list(self.steps)}
        if self.without_drawn_failures is not None:
            out["without_drawn_failures"] = self.without_drawn_failures
        return out


def compare(guarded: Any, unguarded: Any, actions: dict[str, int]) -> Verdict:
    """Compare a guarded replay with the unguarded replay of the same trace.

    ``guarded`` / ``unguarded``: a ``ReplayResult`` or its :class:`Summary`; ``actions``:
    kvguard's decisions in the guarded replay (``check:action`` -> count). Both must come
    from the same trace (the same request ids); raises ``ValueError`` when they do not.
    """
    g = guarded if isinstance(guarded, Summary) else Summary.of(guarded)
    u = unguarded if isinstance(unguarded, Summary) else Summary.of(unguarded)
    if set(g.ranks) != set(u.ranks):
        raise ValueError(f"different requests: {sorted(set(g.ranks) ^ set(u.ranks))[:5]}")
    worse = sorted(r for r in g.ranks if g.ranks[r] < u.ranks[r])
    better = sorted(r for r in g.ranks if g.ranks[r] > u.ranks[r])
    gs, us = g.survived, u.survived
    if worse or (us and not gs):
        verdict = "worse"
    elif better or (gs and not us):
        verdict = "better"
    elif all_served(u):
        verdict = "same"
    else:
        verdict = "no_better"
    price = []
    if verdict == "same":
        price = sorted({k.split(":", 1)[0] for k in actions if k.endswith(":hit_reduced")})
    drawn = bool(worse) and gs and us and set(worse) <= g.failed_by_drawn_failure
    return Verdict(verdict, worse, better, gs, us, price, (g.steps, u.steps), drawn)


def without_drawn_failures(trace: Any) -> Any:
    """``trace`` with its worker model's drawn transfer failures off (``rate`` 0 and no
    failing job ordinals in both directions; latency and hung jobs kept): the hardware the
    same on both sides of a comparison, every transfer succeeding.

    Why (7 Dec 2026, seed 12 on 0.34.0, example 4593): ``tier_publish`` withheld partial
    chunks from the fs tier, the CPU tier then kept a request's prefix that vLLM alone had
    evicted, the guarded run loaded it (a hit vLLM alone did not have) and the worker model's
    5% drawn load failure fell on that load: vLLM failed the request. A drawn failure follows
    the transfer (``JobQueue._failure_draw``), so a load that exists on one side only carries
    a failure the other side cannot have. A ``worse`` verdict whose every worse request is
    such a failure is compared again with the draws off (:func:`compare` on the two replays of
    this trace); kvguard's decisions are judged by that comparison."""
    import dataclasses

    worker = trace.worker
    off = {name: dataclasses.replace(getattr(worker, name), rate=0.0, jobs=frozenset())
           for name in ("load_faults", "store_faults")}
    return dataclasses.replace(trace, worker=dataclasses.replace(worker, **off))


def acting_checks(actions: dict[str, int]) -> list[str]:
    """The checks that acted in a replay other than by tolerating (``check:action`` keys
    with a count), sorted."""
    return sorted({k.split(":", 1)[0] for k, v in actions.items()
                   if v and ":" in k and not k.endswith(":tolerated")})


def worse_class(actions: dict[str, int]) -> str:
    """The class name of a ``worse`` example: :data:`WORSE_CLASS` and the checks that acted
    other than by tolerating (``after load_writes+wait_bound``), so shrinking keeps
    the same checks acting."""
    acting = acting_checks(actions)
    if not acting:
        acting = sorted({k.split(":", 1)[0] for k in actions if ":" in k})
    return f"{WORSE_CLASS} after {'+'.join(acting) or 'nothing'}"
