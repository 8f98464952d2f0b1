"""Run fuzz examples on the installed vLLM's real scheduler, group, shrink and report.

One example = one generated :class:`~kvguard.lab.replay.trace.Trace` replayed by
:func:`kvguard.lab.replay.harness.run_replay` on a freshly built engine (the real
``Scheduler`` + ``OffloadingConnector`` in the scheduler role, simulated GPU worker).
An engine is never reused: a replay leaves requests, prefix-cache and CPU-tier state
behind, and every example has its own geometry. Building one costs about 10 ms once vLLM
is imported (measured on vLLM 0.21.0 on this project's 2-core CI machine: 6-9 ms per
``build_engine`` after a 22 s first import), so it is not the bottleneck.

Exploration is one Hypothesis ``@given`` over :func:`.strategies.traces` with
``@seed(seed)``, ``database=None``, ``phases=[generate]``, no deadline and a fixed
``max_examples``, and Hypothesis' local-constants pool pinned empty
(:mod:`.determinism`: otherwise the examples depend on which local modules the process
imported before): for ``--examples N`` the examples, and so the findings, are the same
for a given seed and vLLM release, in a fresh or a used process. ``--budget-s`` stops the
exploration after that many seconds, so how many examples run depends on the machine.

Each example's traceback is captured by wrapping the engine's ``schedule``,
``update_from_output`` and the worker's ``execute`` (instance attributes, vLLM code is
not changed); kvguard's decisions are read by a tee on kvguard's metrics sink
(:func:`kvguard.guards.policy.runtime.configure`), one count per ``check:action``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvguard.lab.fuzz import classes as cls
from kvguard.lab.fuzz.classes import ExampleOutcome
from kvguard.lab.fuzz.determinism import PINNED, pinned_constants
from kvguard.lab.fuzz.shrink import shrink, size
from kvguard.lab.replay.trace import Trace

#: Replays one class may spend on shrinking (default of ``--shrink-replays``).
SHRINK_REPLAYS = 120
#: Seconds a long-life run (``--epochs`` above 1, not shrinking) may spend, over all its
#: classes, verifying each class on its trace's first epochs (default of
#: ``--verify-budget-s`` there; :func:`_verify_long_life`). The hour-long lives of issue 42
#: ran a class's whole life (up to 388,545 steps, minutes per replay) once per class and
#: never reached their report.
LONG_LIFE_VERIFY_S = 900.0
#: Public issues a class matches, by the vLLM function it died in and the assert text
#: (each row names the public vLLM issue). A hint for the reader, never used to
#: decide what a finding is.
KNOWN_ISSUES: tuple[tuple[str, str, str], ...] = (
    ("GPULoadStoreSpec.__init__", "group_sizes", "vLLM #42945 (store group_sizes counts null blocks)"),
    ("update_state_after_alloc", "num_locally_computed_tokens", "vLLM #43884 / #50454 / PR #52807"),
    ("update_state_after_alloc", "pending", "vLLM #48959 (SWA pending-block bound)"),
    ("_build_store_jobs", "offload_keys", "vLLM #49118 / #52170 (keys vs block ids)"),
    ("_build_store_jobs", "offload_chunk_ids", "vLLM #49118 / #52170 (keys vs block ids)"),
    ("prepare_store", "KeyError", "vLLM #49635 (store after request finalization)"),
    (
        "OffloadingConnectorWorker.get_finished",
        "success",
        "not a vLLM bug: vLLM does not support failed transfers (worker.py: 'we currently do not "
        "support job failures'); reached through the worker model's failed transfers, which "
        "vLLM's CPU<->GPU handler never reports (it answers success=True, in order)",
    ),
    (
        "_remove_pending_job",
        "KeyError",
        "vLLM #42761 (a store lists stale sliding-window block ids twice; fixed by PR #42959)",
    ),
)


def known_issue(name: str, error: str | None) -> str | None:
    """The public issue a death class matches (by function and assert text), or None."""
    text = f"{name} {error or ''}"
    for func, needle, issue in KNOWN_ISSUES:
        if func in name and needle in text:
            return issue
    return None


class _ActionTee:
    """A metrics sink that counts kvguard's decisions (``check:action``) and forwards all
    calls (to nothing when ``inner`` is None). ``counts`` may be shared by two tees."""

    def __init__(self, inner: Any, counts: dict[str, int] | None = None):
        self.inner = inner
        self.counts: dict[str, int] = {} if counts is None else counts

    def tolerated(self, check: str) -> None:
        key = f"{check}:tolerated"
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.inner is not None:
            self.inner.tolerated(check)

    def violation(self, check: str, action: str) -> None:
        key = f"{check}:{action}"
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.inner is not None:
            self.inner.violation(check, action)

    def check_skipped(self, check: str, reason: str) -> None:
        """A skip is not an action, except a full copy ledger under ``guard``/``strict``:
        the store was refused (docs/policies.md: "counted as a ``ledger_full`` skip, not a
        violation"), so it counts as ``copy_coverage:store_dropped`` and the differential
        replays the example without the guard like any other refusal."""
        from kvguard.guards import names
        from kvguard.guards.policy import runtime

        if reason == names.SKIP_LEDGER_FULL and runtime.policy() != names.POLICY_OBSERVE:
            key = f"{check}:{names.ACTION_STORE_DROPPED}"
            self.counts[key] = self.counts.get(key, 0) + 1
        if self.inner is not None:
            self.inner.check_skipped(check, reason)

    def __getattr__(self, name: str) -> Any:
        if self.inner is None:
            return lambda *args, **kwargs: None
        return getattr(self.inner, name)


def _tee() -> _ActionTee:
    """Tee kvguard's two metrics sinks: the runtime's (assert sites, store drops, request
    failures) and the admission check's (``load_coverage``, ``copy_coverage``,
    ``load_writes``, configured apart by the instrumentor) and the wait bound's
    (``wait_bound``), into one ``counts``."""
    from kvguard.guards.checks import admission, wait_bound
    from kvguard.guards.policy import runtime

    current = runtime.configure()["metrics"]
    if isinstance(current, _ActionTee):
        current.counts.clear()
        tee = current
    else:
        tee = _ActionTee(current)
        runtime.configure(metrics=tee)
    for module in (admission, wait_bound):  # each keeps its own sink, configured apart
        sink = module.metrics_sink()
        if isinstance(sink, _ActionTee):
            sink.counts = tee.counts
        else:
            module.set_metrics_sink(_ActionTee(sink, tee.counts))
    return tee


class _Capture:
    """Wraps an engine's step calls to keep the traceback of the exception that ends a replay."""

    def __init__(self, engine: Any, guard: bool):
        self.frames: list[cls.Frame] | None = None
        self.tee: _ActionTee | None = None
        self._guard = guard
        sched, worker = engine.scheduler, engine.worker
        sched.schedule = self._wrap(sched.schedule, first=True)
        sched.update_from_output = self._wrap(sched.update_from_output)
        worker.execute = self._wrap(worker.execute)

    def _wrap(self, fn: Callable[..., Any], first: bool = False) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if first and self._guard and self.tee is None:
                self.tee = _tee()  # after run_replay's reset_all()/install
            try:
                return fn(*args, **kwargs)
            except BaseException as exc:
                if self.frames is None:
                    self.frames = cls.frames_of(exc)
                raise

        return call


def prepare(guard: bool, policy: str) -> None:
    """Install (or remove) the guard before any engine is built, as the plugin would."""
    from kvguard.lab.replay import harness, vllm_api

    vllm_api.route_vllm_logs_to_stderr()
    if guard:
        from kvguard.guards.reset import reset_all

        reset_all()
        harness.install_guard(policy)
    else:
        os.environ["KVGUARD_DISABLE"] = "1"
        harness.uninstall_guard()


def run_example(trace: Trace, *, guard: bool, policy: str = "guard", plant: str | None = None,
                differential: bool = False) -> tuple[ExampleOutcome, Any]:
    """Replay ``trace`` once on a new engine; ``(outcome, ReplayResult or None)``.

    Never raises for what the engine does; a geometry vLLM rejects at build time is an
    outcome with ``invalid`` set (not a finding: vLLM refuses it at start-up).
    ``differential`` (guard on): when kvguard acted, replay ``trace`` once more without the
    guard and compare (:func:`differential_of`).
    """
    from kvguard.lab.fuzz.differential import to_compare

    outcome, result = _run_once(trace, guard=guard, policy=policy, plant=plant)
    if differential and guard and result is not None and to_compare(outcome.actions):
        differential_of(trace, outcome, result, policy)
    return outcome, result


def differential_of(trace: Trace, outcome: ExampleOutcome, guarded: Any, policy: str) -> Any:
    """Replay ``trace`` unguarded and compare it with the guarded ``guarded`` result
    (:func:`kvguard.lab.fuzz.differential.compare`); sets ``outcome.differential`` and, for a
    ``worse`` verdict, adds the kvguard-bug finding. The guard is removed for that replay
    and installed again with ``policy`` after it (:func:`prepare`). Returns the verdict."""
    try:
        prepare(False, policy)
        _, unguarded = _run_once(trace, guard=False)
    finally:
        prepare(True, policy)
    return judge(outcome, guarded, unguarded, trace=trace, policy=policy, guard_after=True)


def judge(outcome: ExampleOutcome, guarded: Any, unguarded: Any, trace: Trace | None = None,
          policy: str = "guard", guard_after: bool = True) -> Any:
    """Compare a guarded example (``outcome`` and its result or summary ``guarded``) with
    its unguarded replay ``unguarded`` (a result, a summary, or None when vLLM refused to
    build it: not comparable); sets ``outcome.differential`` and adds the ``worse``
    finding. Returns the verdict or None.

    A ``worse`` verdict whose every worse request was failed by vLLM after a drawn failed
    load (``Verdict.by_drawn_failure``) is compared again on ``trace`` with the worker
    model's drawn failures off (:func:`kvguard.lab.fuzz.differential.without_drawn_failures`:
    both sides replayed again, the guard installed then removed, and left as
    ``guard_after`` says); that comparison's verdict is the example's
    (``without_drawn_failures`` in its JSON)."""
    from kvguard.lab.fuzz import differential

    if unguarded is None:
        return None
    verdict = differential.compare(guarded, unguarded, outcome.actions)
    if verdict.by_drawn_failure and trace is not None:
        again = _compare_without_drawn_failures(trace, policy, guard_after)
        if again is not None:
            verdict = dataclasses.replace(again, by_drawn_failure=True, without_drawn_failures=again.verdict)
    outcome.differential = verdict
    if verdict.verdict == "worse":
        outcome.findings.append(cls.Finding(
            cls.KIND_WORSE, differential.worse_class(outcome.actions),
            "kvguard acted and some request ended worse than vLLM alone left it", verdict.detail()))
    return verdict


def _compare_without_drawn_failures(trace: Trace, policy: str, guard_after: bool) -> Any:
    """Both sides of ``trace`` replayed with the drawn transfer failures off and compared
    (:func:`judge`); None when either cannot be built. The guard is installed for the first
    replay, removed for the second, and left installed or not as ``guard_after`` says."""
    from kvguard.lab.fuzz import differential

    plain = differential.without_drawn_failures(trace)
    try:
        prepare(True, policy)
        outcome, guarded = _run_once(plain, guard=True, policy=policy)
        prepare(False, policy)
        _, unguarded = _run_once(plain, guard=False)
    finally:
        prepare(guard_after, policy)
    if guarded is None or unguarded is None:
        return None
    return differential.compare(guarded, unguarded, outcome.actions)


def _run_once(trace: Trace, *, guard: bool, policy: str = "guard", plant: str | None = None) -> tuple[ExampleOutcome, Any]:
    """One replay of ``trace`` on a new engine (:func:`run_example` without the comparison)."""
    from kvguard.lab.fuzz.plant import planted
    from kvguard.lab.replay import harness

    try:
        engine = harness.build_engine(trace.geometry, trace.worker)
    except harness.HarnessError as exc:  # the lab cannot bind to this release: not a finding
        return ExampleOutcome(harness_error=harness.harness_error_of(exc)), None
    except Exception as exc:
        return ExampleOutcome(invalid=f"{type(exc).__name__}: {exc}"[:300]), None
    refusal = startup_refusal(engine)
    if refusal is not None:
        harness.close_engine(engine)
        return ExampleOutcome(invalid=refusal), None
    capture = _Capture(engine, guard)
    try:
        with planted(plant if guard else None):
            result = harness.run_replay(trace, guard=guard, policy=policy, engine=engine)
    finally:
        harness.close_engine(engine)
    actions = dict(capture.tee.counts) if capture.tee is not None else {}
    return cls.classify(result, capture.frames, actions), result


def startup_refusal(engine: Any) -> str | None:
    """Why vLLM's start-up check would refuse this KV cache, or None.

    vLLM refuses to start when the KV cache cannot hold one request of
    ``max_model_len`` tokens: the sum over KV cache groups of
    ``kv_cache_spec.max_memory_usage_bytes(vllm_config)`` (the installed release's own
    formula; a sliding-window group reserves the window plus the in-flight tokens)
    must fit. Here all groups share one pool of equal pages, so in GPU blocks:
    ``sum(cdiv(max_memory_usage_bytes, page_size_bytes)) + 1`` (the null block) must be
    at most ``num_gpu_blocks``. Such a geometry would make a long request wait forever
    by construction, so it is not a finding.
    """
    sched = engine.scheduler
    cfg = sched.kv_cache_config
    try:
        need = 1
        for group in cfg.kv_cache_groups:
            spec = group.kv_cache_spec
            need += -(-int(spec.max_memory_usage_bytes(sched.vllm_config)) // int(spec.page_size_bytes))
    except Exception:  # a release without the estimate: nothing to refuse by
        return None
    if cfg.num_blocks < need:
        return f"StartupCheck: {cfg.num_blocks} GPU blocks < {need} that one max_model_len request needs"
    return None


@dataclass
class ClassStats:
    """Aggregate of one class over the examples that showed it."""

    name: str
    kind: str
    count: int = 0
    first_example: int = -1
    trace: Trace | None = None
    kvguard_bug_reasons: set[str] = field(default_factory=set)
    actions: dict[str, int] = field(default_factory=dict)
    died: int = 0
    error: str | None = None
    error_site: str | None = None


def _held(finding: cls.Finding) -> bool:
    """A stall flagged as kvguard's only because kvguard acted in its example
    (:func:`kvguard.lab.fuzz.classes.classify`): with the differential on, its verdict
    waits for the unguarded replay of the example (``fuzz``'s ``judge_all``)."""
    return finding.kind == cls.KIND_STALL and finding.kvguard_bug is not None


def resolve_held(held: list[cls.Finding], verdict: str | None) -> list[cls.Finding]:
    """The stall findings :func:`_held` kept back, once the differential compared their
    example with vLLM alone (``verdict``: one of ``differential.VERDICTS``, or None when vLLM
    alone could not be built or compared). Any verdict but ``worse`` means no request ended
    worse than vLLM alone left it, so every request the guarded run lost was lost unguarded
    too: the stall is vLLM's own (``kvguard_bug`` cleared, the detail says why). ``worse``
    or None: kept as kvguard's (the ``worse`` finding names the requests)."""
    if verdict is None or verdict == "worse":
        return held
    return [dataclasses.replace(f, kvguard_bug=None, detail=(
        f"{f.detail}; vLLM alone lost the same requests (differential: {verdict})")) for f in held]


def kvguard_did(actions: dict[str, int], died: int, count: int) -> list[str]:
    """What kvguard did for a class: ``tolerated``, ``degraded``, ``request failed``, ``raised``, ``none``."""
    out = []
    acts = {k.split(":", 1)[1] for k in actions if ":" in k}
    if "tolerated" in acts:
        out.append("tolerated")
    if acts & {"store_dropped", "hit_reduced", "continued", "recomputed", "free_split", "chunk_withheld"}:
        out.append("degraded")
    if acts & {"request_failed", "failed_request"}:
        out.append("request failed")
    if died or "raised" in acts:
        out.append("raised")
    return out or ["none"]


def _upstream_report(kind: str, name: str, path: Path, minimal: Trace, version: str,
                     guard: bool, policy: str) -> str | None:
    """Write ``<slug>.md`` beside a wrong-KV class's trace (:mod:`.upstream`); its path, or None.

    The minimal trace is replayed twice more: with the guard off (what vLLM alone serves)
    and under policy ``observe`` (which kvguard invariant sees it; observe changes nothing).
    Each is prepared as the run itself is (:func:`prepare`: the guard installed or removed
    before the engine is built; an engine built under the other setting keeps it), and the
    fuzz run's own ``guard`` / ``policy`` are restored after. Only a class whose unguarded
    replay shows wrong-KV blocks gets a report: a wrong-KV class seen only with the guard on
    is a kvguard bug, reported as such.
    """
    from kvguard.lab.fuzz import upstream

    if kind != cls.KIND_WRONG_KV:
        return None
    try:
        prepare(False, policy)
        _, unguarded = run_example(minimal, guard=False)
        if unguarded is None or not unguarded.wrong_kv_blocks:
            return None
        prepare(True, "observe")
        _, observed = run_example(minimal, guard=True, policy="observe")
    finally:
        prepare(guard, policy)
    md = path.with_suffix(".md")
    md.write_text(upstream.render(class_name=name, trace_file=str(path), version=version,
                                  unguarded=unguarded, observed=observed,
                                  description=minimal.description or ""), encoding="utf-8")
    return str(md)


def _verify_long_life(
    found: Trace,
    name: str,
    verify: Callable[[Trace], tuple[ExampleOutcome, Any]],
    named: Callable[[Trace, str], Trace],
    deadline: float,
    progress: Callable[[dict[str, Any]], None] | None,
) -> tuple[Trace, ExampleOutcome | None, Any, dict[str, Any]]:
    """Verify class ``name`` of a long life (``--epochs``) on the first 1, 2, 4, ... epochs
    of ``found`` (:func:`.strategies.first_epochs`), then the whole life, until a replay
    shows the class or ``deadline`` (``time.monotonic()``) passes; a replay started before
    the deadline runs to its end. ``verify`` writes a trace and replays it as
    ``kvguard replay --trace`` reads it; ``named`` names a trace and says how it was cut.

    Returns ``(trace written, outcome, result, verification)``: the smallest prefix that
    showed the class (a whole life is minutes per replay; its first epochs are seconds),
    or, when none did, the whole life written and ``outcome`` None if the deadline stopped
    it before the whole life was replayed. ``verification``: ``{"epochs": N (the life),
    "replayed_epochs": [k, ...], "shown_at_epochs": k or None, "stopped": "shown" |
    "whole life replayed" | "budget spent"}``.
    """
    from kvguard.lab.fuzz.strategies import epochs_of, first_epochs

    total = epochs_of(found)
    replayed: list[int] = []
    k = 1
    while True:
        if time.monotonic() > deadline:
            whole = named(found, f"the whole life of {total} epochs, not verified (the verification budget was spent)")
            return whole, None, None, {"epochs": total, "replayed_epochs": replayed, "shown_at_epochs": None,
                                       "stopped": "budget spent"}
        k = min(k, total)
        if progress is not None:
            progress({"phase": "verify", "class": name, "epochs": k})
        cut = named(first_epochs(found, k), f"the first {k} of {total} epochs of its life" if k < total
                    else f"its whole life of {total} epochs")
        outcome, result = verify(cut)
        replayed.append(k)
        if name in outcome.classes or k == total:
            shown = name in outcome.classes
            return cut, outcome, result, {"epochs": total, "replayed_epochs": replayed,
                                          "shown_at_epochs": k if shown else None,
                                          "stopped": "shown" if shown else "whole life replayed"}
        k *= 2


def _replay_summary(result: Any) -> dict[str, Any] | None:
    if result is None:
        return None
    checks = {
        k: {kk: vv for kk, vv in v.items() if vv}
        for k, v in (result.checks or {}).items()
        if v.get("tolerated") or v.get("violations") or v.get("evaluated")
    }
    out = {
        "engine_survived": result.engine_survived,
        "error": result.error,
        "error_site": result.error_site,
        "stalled": result.stalled,
        "requests": {"submitted": result.submitted, "finished": result.finished},
        "steps": result.steps,
        "checks": checks,
        "guard_errors": result.guard_errors,
    }
    for extra in ("stalls", "wrong_kv_blocks"):
        if hasattr(result, extra):
            out[extra] = getattr(result, extra)
    return out


def new_layout_counts() -> dict[str, Any]:
    """Empty ``layouts`` object of the report (see :func:`count_layout`)."""
    return {"kv_cache_groups": {}, "mixed_block_sizes": 0, "extra_retained_tokens": 0, "mla": 0}


def count_settings(settings: dict[str, int], trace: Trace) -> None:
    """Count one replayed example's operator settings into the report's ``settings``
    (``"key=value"`` -> examples; ``geometry.extra_config``, drawn by
    :func:`kvguard.lab.fuzz.strategies.operator_settings`)."""
    for key, value in getattr(trace.geometry, "extra_config", None) or ():
        name = f"{key}={json.dumps(value)}"
        settings[name] = settings.get(name, 0) + 1
    spec = getattr(trace.geometry, "speculative", None)
    if spec is not None:  # ``speculative=<method>``: drawn with the settings (strategies.speculative)
        name = f"speculative={spec[0]}"
        settings[name] = settings.get(name, 0) + 1


def count_layout(layouts: dict[str, Any], trace: Trace) -> None:
    """Count one replayed example's KV cache layout into the report's ``layouts``:
    ``kv_cache_groups`` (number of groups -> examples), ``mixed_block_sizes`` (examples
    whose groups differ in ``tokens_per_block``), ``extra_retained_tokens`` (examples with a
    sliding-window group keeping tokens below its window), ``mla`` (examples whose groups
    are multi-head latent attention: ``MLAAttentionSpec`` / ``SlidingWindowMLASpec``)."""
    groups = trace.geometry.kv_groups()
    key = str(len(groups))
    layouts["kv_cache_groups"][key] = layouts["kv_cache_groups"].get(key, 0) + 1
    layouts["mixed_block_sizes"] += int(len({g.tokens_per_block for g in groups}) > 1)
    layouts["extra_retained_tokens"] += int(any(g.extra_retained_tokens for g in groups))
    layouts["mla"] += int(any(g.mla for g in groups))


def not_generated(
    worker_model: bool = True, async_scheduling: bool = True, kv_layouts: bool = True,
    connector: str = "OffloadingConnector", draw_settings: bool = True,
) -> list[dict[str, str]]:
    """Fields of the fuzz specification the fuzzer does not generate on this checkout/release, with the reason."""
    from kvguard.lab.fuzz import strategies

    return strategies.not_generated(worker_model, async_scheduling, kv_layouts, connector, draw_settings)


def explorer(
    seed: int, max_examples: int, worker_model: bool, async_scheduling: bool = True,
    kv_layouts: bool = True, connector: str = "OffloadingConnector", epochs: int = 1,
    draw_settings: bool = True,
) -> Callable[[Callable[[Trace], None]], Callable[[], None]]:
    """The Hypothesis decorator of an exploration: ``@explorer(...) def body(trace): ...``.

    ``@seed(seed)``, no example database, only the generate phase, no deadline, at most
    ``max_examples`` examples of :func:`.strategies.traces` (``worker_model``,
    ``async_scheduling``, ``kv_layouts``, ``connector``, ``epochs`` and ``draw_settings`` as there),
    no health check, quiet. The decorated ``body`` is called once per generated trace.
    Call the result inside :func:`.determinism.pinned_constants` for examples that do
    not depend on the process's imports.
    """
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hseed

    from kvguard.lab.fuzz import strategies

    def wrap(body: Callable[[Trace], None]) -> Callable[[], None]:
        return hseed(seed)(
            settings(
                max_examples=max_examples,
                database=None,
                deadline=None,
                derandomize=False,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
                verbosity=Verbosity.quiet,
                print_blob=False,
                report_multiple_bugs=False,
            )(given(strategies.traces(worker_model=worker_model, async_scheduling=async_scheduling,
                                      kv_layouts=kv_layouts, connector=connector, epochs=epochs,
                                      draw_settings=draw_settings))(body))
        )

    return wrap


def generate(
    seed: int, examples: int, *, worker_model: bool = True, async_scheduling: bool = True,
    kv_layouts: bool = True, pin: bool = True, connector: str = "OffloadingConnector", epochs: int = 1,
    draw_settings: bool = True,
) -> list[Trace]:
    """The traces ``kvguard fuzz --seed seed --examples examples`` explores, without replaying them.

    The same sequence :func:`fuzz` replays (a geometry vLLM refuses is an example to
    Hypothesis in both: it never sees the replay's verdict), before :func:`fuzz` renames
    each trace ``fuzz-seed<seed>-example<i>``. ``pin=False``
    leaves Hypothesis' local-constants pool as the process has it (the behaviour before
    :mod:`.determinism`; for the negative control of the determinism test).
    """
    import contextlib

    from kvguard.lab.fuzz import strategies

    if kv_layouts:
        strategies.layout_support()  # probed before the draws, as in :func:`fuzz`
    out: list[Trace] = []

    @explorer(seed, examples, worker_model, async_scheduling, kv_layouts, connector, epochs, draw_settings)
    def body(trace: Trace) -> None:
        out.append(trace)

    with pinned_constants() if pin else contextlib.nullcontext():
        body()
    return out


# price traces kept per check (each can be a long life's whole trace: bounded on disk)
PRICE_TRACES = 5


def _write_price_trace(out_dir: Path, check: str, index: int, trace: Trace) -> str:
    """Write the trace of example ``index``, where ``check`` cut a hit vLLM alone served.

    The file is ``<out_dir>/price/<check>-example<index>.jsonl`` (the trace as explored,
    unshrunk, named ``price-<check>-example<index>``); returns its path.
    """
    folder = out_dir / "price"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{check}-example{index}.jsonl"
    named = dataclasses.replace(
        trace, name=f"price-{check}-example{index}",
        description=f"kvguard fuzz: example {index}, where {check} cut a hit vLLM alone served whole")
    path.write_text(named.dumps(), encoding="utf-8")
    return str(path)


def fuzz(
    *,
    seed: int = 0,
    examples: int | None = None,
    budget_s: float | None = None,
    guard: bool = False,
    policy: str = "guard",
    out_dir: str | Path = "fuzz-findings",
    shrink_replays: int = SHRINK_REPLAYS,
    plant: str | None = None,
    worker_model: bool = True,
    kv_layouts: bool = True,
    progress: Callable[[dict[str, Any]], None] | None = None,
    async_scheduling: bool = True,
    connector: str = "OffloadingConnector",
    differential: bool = True,
    epochs: int = 1,
    draw_settings: bool = True,
    verify_budget_s: float | None = None,
) -> dict[str, Any]:
    """Explore, group, shrink, write and verify; the ``--json`` report (docs/fuzz.md).

    ``examples`` (default 200 when ``budget_s`` is None) fixes the number of generated
    examples; ``budget_s`` bounds exploration wall time instead (examples up to 10**6).
    ``shrink_replays`` bounds replays per class spent shrinking (0: keep the first trace).
    ``plant``: the test-only planted fault (:mod:`.plant`), guard on only.
    ``worker_model``: draw the worker's latency and failed transfers where the trace
    format has them (False: every job completes in its step).
    ``async_scheduling``: draw ``geometry.async_scheduling`` where the release supports it
    (False: vLLM's synchronous ``Scheduler`` only, the examples of a checkout without it).
    ``kv_layouts``: also draw KV cache groups and ``extra_retained_tokens`` where the
    release expresses them (:func:`.strategies.kv_cache_layout`; default; False:
    ``--default-layout``, full attention + one sliding window).
    ``connector``: ``geometry.connector`` of every example, or ``"both"`` (drawn per
    example; :func:`.strategies.traces`).
    ``epochs`` (``--epochs``; default 1): each example's traffic served that many times
    by one engine (:func:`.strategies.lifetime`, the long-life mode).
    ``draw_settings`` (default): draw the operator settings each release reads
    (:func:`.strategies.operator_settings`); False (``--default-settings``): vLLM's defaults.
    ``verify_budget_s`` (``--verify-budget-s``): with ``epochs`` above 1 and shrinking off,
    each class is verified on its trace's first 1, 2, 4, ... epochs until it shows
    (:func:`_verify_long_life`), all classes together within this many seconds (default
    :data:`LONG_LIFE_VERIFY_S`); a class not shown when it is spent is reported with
    ``reproduces`` null. Ignored otherwise (a class's trace is verified whole, once).
    ``differential`` (guard on; default): every example where kvguard acted is replayed
    unguarded too and compared request by request (:mod:`.differential`); a ``worse``
    example is the kvguard-bug class ``worse-than-vllm-alone after <checks>``. The report's
    ``differential`` object counts the verdicts, the verdicts per check that acted
    (``by_check``: any action but ``tolerated``) and, per check, the examples where it cut
    a hit vLLM alone served whole (``price``), and the traces of the first
    :data:`PRICE_TRACES` of those examples per check (``price_traces``: paths under
    ``<out_dir>/price/``, each replayable with ``kvguard replay --trace``).
    """
    from kvguard.lab.fuzz import strategies
    from kvguard.lab.fuzz.differential import VERDICTS, Summary, acted, acting_checks, to_compare
    from kvguard.lab.replay import harness
    from kvguard.lab.replay.trace import load_trace

    version = harness.vllm_version()
    if examples is None and budget_s is None:
        examples = 200
    prepare(guard, policy)
    if kv_layouts:
        # probe before Hypothesis draws: with the probe (and its first vLLM import) inside
        # the first draw, a 0.21.0 seed-0 run generated other examples than without it
        # (observed once; cause not established), so keep the draws free of it
        strategies.layout_support()
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    deadline = t0 + budget_s if budget_s is not None else None
    stats: dict[str, ClassStats] = {}
    totals = {
        "examples": 0,
        "invalid_geometries": 0,
        "steps": 0,
        "requests": 0,
        "checks_evaluated": 0,
        "engine_deaths": 0,
        "kvguard_deaths": 0,
        "requests_lost": 0,
        # requests that ended with an error status: by vLLM (a failed load) or kvguard's degrade
        "requests_failed": 0,
        "wrong_kv_blocks": 0,
        "stalls": 0,
        # examples replayed with geometry.async_scheduling (AsyncScheduler, batch queue 2)
        "async_scheduling_examples": 0,
        # examples replayed on the SimpleCPUOffloadConnector (geometry.connector)
        "simple_connector_examples": 0,
        # engine restarts over the secondary tiers the examples' traces asked for (--epochs)
        "engine_restarts": 0,
        # examples with vLLM's real fs tier among their secondary tiers (files on disk)
        "fs_tier_examples": 0,
        # examples served by two engines sharing the fs tier (request field ``engine``)
        "shared_tier_examples": 0,
        # guarded: examples where kvguard acted (replayed unguarded too when differential)
        "acted_examples": 0,
        # guarded: copy-coverage skips that could admit a load unread (classes.unchecked_copy_admits)
        "copy_coverage_unchecked_admits": 0,
    }
    # the differential comparison of each acted example (lab/fuzz/differential.py):
    # verdict -> examples, and per check the examples where it cut a hit vLLM alone served
    differential_counts: dict[str, int] = {v: 0 for v in VERDICTS}
    price: dict[str, int] = {}
    # the traces of the examples behind each check's price, <out>/price/, at most
    # PRICE_TRACES per check: a cut is traced from its example, and a budget run cannot be
    # regenerated example by example
    price_traces: dict[str, list[str]] = {}
    # per check that acted (any action but tolerated): verdict -> examples
    by_check: dict[str, dict[str, int]] = {}
    invalid_reasons: dict[str, int] = {}
    layouts = new_layout_counts()
    settings: dict[str, int] = {}
    to_judge: list[tuple[int, Trace, ExampleOutcome, Any]] = []

    class _BudgetSpent(Exception):
        pass

    class _HarnessStop(Exception):
        """The lab failed: stop at the first one (every later example would fail alike)."""

    harness_error: dict[str, Any] | None = None

    def record(trace: Trace) -> None:
        index = totals["examples"] + totals["invalid_geometries"]
        trace = dataclasses.replace(trace, name=f"fuzz-seed{seed}-example{index}")
        outcome, result = run_example(trace, guard=guard, policy=policy, plant=plant)
        if outcome.harness_error is not None:
            nonlocal harness_error
            harness_error = {**outcome.harness_error, "example": index}
            raise _HarnessStop
        if outcome.invalid is not None:
            totals["invalid_geometries"] += 1
            key = outcome.invalid.split(":", 1)[0]
            invalid_reasons[key] = invalid_reasons.get(key, 0) + 1
            return
        totals["examples"] += 1
        totals["async_scheduling_examples"] += int(getattr(trace.geometry, "async_scheduling", False))
        totals["simple_connector_examples"] += int(trace.geometry.connector == "SimpleCPUOffloadConnector")
        totals["engine_restarts"] += len(getattr(trace, "restarts", ()))
        totals["fs_tier_examples"] += int("fs" in (trace.geometry.secondary_tiers or ()))
        totals["shared_tier_examples"] += int(trace.engines > 1)
        count_layout(layouts, trace)
        count_settings(settings, trace)
        totals["steps"] += outcome.steps
        totals["requests"] += outcome.submitted
        totals["checks_evaluated"] += outcome.checks_evaluated
        totals["engine_deaths"] += int(not outcome.engine_survived)
        totals["kvguard_deaths"] += int(outcome.kvguard_death)
        totals["requests_lost"] += outcome.requests_lost
        totals["requests_failed"] += outcome.requests_failed
        totals["wrong_kv_blocks"] += outcome.wrong_kv_blocks
        totals["stalls"] += int(any(f.kind == cls.KIND_STALL for f in outcome.findings))
        totals["acted_examples"] += int(bool(guard and acted(outcome.actions)))
        totals["copy_coverage_unchecked_admits"] += outcome.unchecked_copy_admits
        judged = differential and guard and result is not None and to_compare(outcome.actions)
        if judged:
            # compared after the exploration, all in one unguarded batch (removing and
            # installing the guard costs ~0.5 s, ten examples' worth)
            to_judge.append((index, trace, outcome, Summary.of(result)))
        # a stall after kvguard acted is its bug only if vLLM alone did not lose the same
        # requests: held back until the differential has compared them (judge_all)
        add_findings(index, trace, outcome, [f for f in outcome.findings if not (judged and _held(f))])
        if progress is not None:
            progress({"phase": "explore", "totals": dict(totals), "classes": {n: s.count for n, s in stats.items()},
                      "elapsed_s": time.monotonic() - t0})

    def add_findings(index: int, trace: Trace, outcome: ExampleOutcome, findings: list[cls.Finding]) -> None:
        for f in findings:
            s = stats.get(f.name)
            if s is None:
                s = stats[f.name] = ClassStats(f.name, f.kind, first_example=index, trace=trace)
                s.error, s.error_site = outcome.error, outcome.error_site
            s.count += 1
            if f.kvguard_bug:
                s.kvguard_bug_reasons.add(f.kvguard_bug)
            for k, v in outcome.actions.items():
                s.actions[k] = s.actions.get(k, 0) + v
            s.died += int(not outcome.engine_survived)

    def judge_all() -> None:
        """Replay every acted example unguarded, compare, count, add the worse findings."""
        if not to_judge:
            return
        if progress is not None:
            progress({"phase": "differential", "examples": len(to_judge)})
        try:
            prepare(False, policy)
            for index, trace, outcome, summary in to_judge:
                _, unguarded = _run_once(trace, guard=False)
                before = len(outcome.findings)
                verdict = judge(outcome, summary, unguarded, trace=trace, policy=policy, guard_after=False)
                add_findings(index, trace, outcome, resolve_held(
                    [f for f in outcome.findings[:before] if _held(f)], verdict.verdict if verdict else None))
                if verdict is None:
                    continue
                differential_counts[verdict.verdict] += 1
                for check in verdict.price:
                    price[check] = price.get(check, 0) + 1
                    kept = price_traces.setdefault(check, [])
                    if len(kept) < PRICE_TRACES:
                        kept.append(_write_price_trace(out_path, check, index, trace))
                for check in acting_checks(outcome.actions):
                    row = by_check.setdefault(check, {v: 0 for v in differential_counts})
                    row[verdict.verdict] += 1
                add_findings(index, trace, outcome, outcome.findings[before:])
        finally:
            prepare(True, policy)
        to_judge.clear()

    @explorer(seed, examples if examples is not None else 10**6, worker_model, async_scheduling, kv_layouts,
              connector, epochs, draw_settings)
    def explore(trace: Trace) -> None:
        if deadline is not None and time.monotonic() > deadline:
            raise _BudgetSpent
        record(trace)

    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # vLLM and Hypothesis print nothing on our stdout
    try:
        # the examples of a seed must not depend on what this process imported before
        with pinned_constants() as generation:
            try:
                explore()
            except (_BudgetSpent, _HarnessStop):
                pass
        if harness_error is None:
            judge_all()
        explore_s = time.monotonic() - t0
        out_classes = []
        long_life = epochs > 1 and shrink_replays <= 0
        verify_deadline = (time.monotonic() + (LONG_LIFE_VERIFY_S if verify_budget_s is None else verify_budget_s)
                           if long_life else None)
        for name in sorted(stats) if harness_error is None else ():
            s = stats[name]
            assert s.trace is not None

            compare = differential and s.kind == cls.KIND_WORSE

            def same_class(t: Trace, name: str = name, compare: bool = compare) -> bool:
                outcome, _ = run_example(t, guard=guard, policy=policy, plant=plant, differential=compare)
                return name in outcome.classes

            if progress is not None:
                progress({"phase": "shrink", "class": name})
            shrunk = shrink(s.trace, same_class, max_replays=shrink_replays) if shrink_replays > 0 else None
            minimal = shrunk.trace if shrunk is not None else s.trace
            file_slug = cls.slug(name)
            path = out_path / f"{file_slug}.jsonl"
            how = f"shrunk from {size(s.trace)} to {size(minimal)} (requests, prompt tokens, output tokens)"

            def named(t: Trace, how: str) -> Trace:
                return dataclasses.replace(t, name=file_slug, description=(
                    f"kvguard fuzz finding: {name}. vLLM {version}, seed {seed}, example "
                    f"{s.first_example}, guard {'on (policy ' + policy + ')' if guard else 'off'}; {how}."))

            def verify(t: Trace) -> tuple[ExampleOutcome, Any]:
                # read the file back the way `kvguard replay --trace FILE` does and replay it
                path.write_text(t.dumps(), encoding="utf-8")
                return run_example(load_trace(str(path)), guard=guard, policy=policy, plant=plant,
                                   differential=compare)

            verification: dict[str, Any] | None = None
            if verify_deadline is not None:
                minimal, outcome, result, verification = _verify_long_life(
                    s.trace, name, verify, named, verify_deadline, progress)
            else:
                minimal = named(minimal, how)
                outcome, result = verify(minimal)
            report_path = (_upstream_report(s.kind, name, path, minimal, version, guard, policy)
                           if plant is None and outcome is not None else None)
            bug = sorted(s.kvguard_bug_reasons)
            out_classes.append(
                {
                    "class": name,
                    "kind": s.kind,
                    "count": s.count,
                    "first_example": s.first_example,
                    "trace": str(path),
                    "reproduces": (name in outcome.classes if outcome is not None else None),
                    # long lives (--epochs): the epochs replayed to verify, and why it stopped
                    "verification": verification,
                    "size": dict(zip(("requests", "prompt_tokens", "output_tokens"), size(minimal))),
                    "found_size": dict(zip(("requests", "prompt_tokens", "output_tokens"), size(s.trace))),
                    "shrink_replays": shrunk.replays if shrunk is not None else 0,
                    "geometry": minimal.geometry.to_json(),
                    "error": s.error,
                    "error_site": s.error_site,
                    "known_issue": known_issue(name, s.error),
                    "kvguard_did": kvguard_did(s.actions, s.died, s.count) if guard else None,
                    "actions": s.actions if guard else None,
                    "kvguard_bug": bool(bug),
                    "kvguard_bug_reasons": bug,
                    "replay": _replay_summary(result),
                    "differential": (outcome.differential.to_json()
                                     if outcome is not None and outcome.differential is not None else None),
                    "upstream_report": report_path,
                }
            )
    finally:
        sys.stdout = real_stdout
    return {
        "vllm_version": version,
        "seed": seed,
        "guard": guard,
        "policy": policy if guard else None,
        "planted_fault": plant,
        "mode": "examples" if budget_s is None else "budget",
        "max_examples": examples,
        "budget_s": budget_s,
        "deterministic": budget_s is None and generation == PINNED,
        "generation": generation,
        **totals,
        "invalid_reasons": invalid_reasons,
        "layouts": layouts,
        # operator settings drawn (geometry.extra_config): "key=value" -> examples
        "settings": dict(sorted(settings.items())),
        "kvguard_bugs": sum(1 for c in out_classes if c["kvguard_bug"]),
        "differential": (
            {"enabled": True, "verdicts": differential_counts, "price": price, "price_traces": price_traces,
             "by_check": by_check,
             "worse_examples": differential_counts["worse"]}
            if guard and differential else {"enabled": False}
        ),
        "harness_error": harness_error,
        "classes": out_classes,
        "worker_model": worker_model and strategies.WORKER,
        "async_scheduling": async_scheduling and strategies.async_scheduling_unsupported() is None,
        "kv_layouts": kv_layouts,
        "connector": connector,
        "epochs": epochs,
        "settings_drawn": draw_settings and strategies.SETTINGS,
        "not_generated": not_generated(worker_model, async_scheduling, kv_layouts, connector, draw_settings),
        "out_dir": str(out_path),
        "explore_s": round(explore_s, 2),
        "wall_s": round(time.monotonic() - t0, 2),
    }
