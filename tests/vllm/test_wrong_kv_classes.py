"""Every wrong-KV class kvguard's fuzzer found, on every full release (issue 22).

The stale-id zeroing misfire (docs/fuzz.md, "Wrong KV: the stale-block zeroing misfire"):
since PR #42959 (the #42761 fix, in 0.23.0 and later) vLLM's offloading connector zeroes a
sliding-window block id of a request whenever the same id is among the step's newly
listed blocks, taking it for "freed by the window and re-allocated"; a GPU prefix-cache
hit of another request lists the *shared* blocks too, so a block the request still holds
is zeroed, its chunk is stored without it, and a later load serves never-written KV.

Two minimal traces, each a ``kvguard fuzz --no-guard`` finding shrunk by the fuzzer: the
0.26.0 one (default layout, a shared 8-token prefix) and the 0.29.0 one (three groups of
mixed block sizes). How many wrong blocks each shows without the guard is a measured
release fact (release_facts.csv: ``stale_zeroing_*_wrong_kv_blocks``; 0 where the release's
store path does not reach it with that trace, null where the geometry cannot be expressed).
With the guard every request finishes with 0 wrong-KV blocks, and where vLLM alone serves
wrong KV the ``store_coverage`` check names the action (``store_dropped``); ``observe``
counts it and leaves vLLM's behaviour; ``strict`` raises at the store.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from guardtools_vllm import expressible
from release_facts import fact

from kvguard.guards.telemetry import events

from kvguard.guards import names
from kvguard.lab.replay import harness
from kvguard.lab.replay.trace import load_trace

pytestmark = pytest.mark.vllm

TRACES = Path(__file__).parent / "traces"
CASES = [("wrong-kv-stale-zeroing-026.jsonl", "stale_zeroing_026_wrong_kv_blocks"),
         ("wrong-kv-stale-zeroing-029.jsonl", "stale_zeroing_029_wrong_kv_blocks")]


@pytest.mark.parametrize(("name", "fact_name"), CASES, ids=[c[0] for c in CASES])
def test_the_class_on_this_release(name: str, fact_name: str) -> None:
    trace = load_trace(str(TRACES / name))
    want = fact(fact_name)
    if want is None:
        assert not expressible(trace)
        return
    plain = harness.run_replay(trace, guard=False)
    assert plain.engine_survived and not plain.stalled
    assert plain.wrong_kv_blocks == want, plain.worker.oracle.wrong_kv
    if want:
        # the wrong blocks are never-written slots of a sliding-window group
        assert all("never-written" in w["what"] for w in plain.worker.oracle.wrong_kv)

    with events.capture() as logged:
        guarded = harness.run_replay(trace, guard=True)
    assert guarded.ok, (guarded.error, guarded.stalls, guarded.worker.oracle.wrong_kv)
    assert guarded.wrong_kv_blocks == 0 and guarded.guard_errors == {}
    cover = guarded.checks[names.CHECK_STORE_COVERAGE]
    assert cover["evaluated"] >= 1
    dropped = [e for e in logged if e["event"] == "check_failed" and e["check"] == names.CHECK_STORE_COVERAGE]
    if want:
        assert cover["violations"] >= 1
        assert dropped and all(e["action"] == names.ACTION_STORE_DROPPED for e in dropped)
        assert any(e["event"] == "store_dropped" and e["check"] == names.CHECK_STORE_COVERAGE for e in logged)
        assert "left_out" in dropped[0]["message"]


@pytest.mark.parametrize("policy", ["observe", "strict"])
def test_observe_counts_and_strict_raises(policy: str) -> None:
    """On a release where the 0.26.0 trace serves wrong KV: ``observe`` counts the check
    (``continued``) and vLLM serves the same wrong KV; ``strict`` raises at the store."""
    trace = load_trace(str(TRACES / CASES[0][0]))
    want = fact(CASES[0][1])
    if not want:
        pytest.skip(f"vLLM alone serves no wrong KV with this trace on this release (release fact {CASES[0][1]})")
    harness.uninstall_guard()  # a guard installed earlier in this process keeps its policy
    try:
        result = harness.run_replay(trace, guard=True, policy=policy)
    finally:
        harness.uninstall_guard()
    cover = result.checks[names.CHECK_STORE_COVERAGE]
    assert cover["violations"] >= 1
    if policy == "observe":
        assert result.engine_survived and result.wrong_kv_blocks == want
    else:
        assert not result.engine_survived
        assert result.error.startswith("AssertionError: store coverage: group ")
        assert result.wrong_kv_blocks == 0


def test_fuzz_writes_an_upstream_report_beside_the_trace(tmp_path: Path) -> None:
    """``kvguard fuzz`` writes ``<slug>.md`` beside a wrong-KV trace (issue 22 item 2): what
    vLLM alone serves (the oracle's offenders, as many as the release fact says), the
    invariant that sees it under ``observe`` (``store_coverage``, with what a fix must
    guarantee and the public references) and the replay commands. Where vLLM alone serves no
    wrong KV with the trace, no report is written (a guarded-only class is a kvguard bug)."""
    from kvguard.lab.fuzz import runner

    trace = load_trace(str(TRACES / CASES[0][0]))
    want = fact(CASES[0][1])
    path = tmp_path / "wrong-kv-blocks.jsonl"
    path.write_text(trace.dumps(), encoding="utf-8")
    try:
        written = runner._upstream_report("wrong-kv", "wrong-kv blocks", path, trace, harness.vllm_version(),
                                          guard=True, policy="guard")
    finally:
        harness.uninstall_guard()
    if not want:
        assert written is None and not path.with_suffix(".md").exists()
        return
    assert written == str(path.with_suffix(".md"))
    text = path.with_suffix(".md").read_text()
    assert f"{want} GPU block(s)" in text
    assert text.count("never-written") == min(want, 8)
    assert "- `store_coverage` (" in text and "#42959" in text
    assert "No kvguard invariant fired" not in text
    assert "kvguard replay --trace wrong-kv-blocks.jsonl --no-guard" in text


def _final_store_counts_last_token() -> bool:
    """Whether the installed store builder's final pass over a finished request stores up to
    ``req.num_tokens`` (the last sampled token, whose KV no forward wrote): the assignment
    ``num_tokens_after_batch = req.num_tokens`` in ``_build_store_jobs``, read from the
    source (0.26.0 and 0.29.0 have it; 0.33.0 clamps to ``num_tokens - 1``, 0.34.0 to
    ``num_computed_tokens``; 0.21.0 and 0.25.1 never store a finished request)."""
    import ast
    import importlib
    import inspect
    import textwrap

    try:
        module = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler")
    except ImportError:  # 0.21.0 keeps the scheduler side in one module
        module = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector")
    tree = ast.parse(textwrap.dedent(inspect.getsource(module.OffloadingConnectorScheduler._build_store_jobs)))
    return any(
        isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["num_tokens_after_batch"]
        and ast.unparse(node.value) == "req.num_tokens"
        for node in ast.walk(tree)
    )


def test_the_final_token_class_on_this_release() -> None:
    """With ``offload_prompt_only: false`` a finished request's final store covers its last
    sampled token on releases whose builder says so (:func:`_final_store_counts_last_token`):
    the chunk ending there is published with one stale slot and the next turn, whose prompt
    carries that output, loads it (1 wrong GPU block, 1 of its 8 slots). With the guard the
    ``store_coverage`` check finds the stored chunk past the computed KV (``uncomputed``),
    drops the store, and every request finishes with 0 wrong blocks. Found by the guarded
    suite's seed 0 on 0.29.0 once the fuzzer drew operator settings (7 Dec 2026)."""
    trace = load_trace(str(TRACES / "wrong-kv-final-token-029.jsonl"))
    unclamped = _final_store_counts_last_token()
    plain = harness.run_replay(trace, guard=False)
    assert plain.engine_survived and not plain.stalled
    assert plain.wrong_kv_blocks == (1 if unclamped else 0), plain.worker.oracle.wrong_kv
    if unclamped:
        (wrong,) = plain.worker.oracle.wrong_kv
        assert wrong["request_id"] == "agent-0/turn-2" and "1/8 slots differ" in wrong["what"]
    with events.capture() as logged:
        guarded = harness.run_replay(trace, guard=True)
    assert guarded.ok and guarded.wrong_kv_blocks == 0 and guarded.guard_errors == {}
    assert guarded.finished == len(trace.requests)
    dropped = [e for e in logged if e["event"] == "check_failed" and e["check"] == names.CHECK_STORE_COVERAGE]
    assert bool(dropped) == unclamped
    assert all("uncomputed: a stored chunk ends at token" in e["message"] and e["action"] == names.ACTION_STORE_DROPPED
               for e in dropped)
