"""Copy coverage on vLLM's real scheduler: a load writes only slots a store copied.

The class (docs/upstream/swa-partial-chunk.md): vLLM 0.33.0 and 0.34.0 publish a
sliding-window chunk whose first sub-blocks the storing request had skipped (it got them
as null blocks from a GPU prefix-cache hit), because the store's reachability mask looks
only at where *that* request could resume; a later request whose hit ends at the chunk's
end reads those sub-blocks inside its window. ``wrong-kv-swa-partial-chunk.jsonl`` is
written from that mechanism, not shrunk from a fuzz run: ``writer`` computes 64 tokens
(window 24, chunks of 16 tokens, blocks of 4); ``sharer`` shares its first 28 tokens (a
GPU hit: the window group gets blocks 1..6, block 0 null) and stores sliding-window chunk
0 with sub-block 0 never copied (reachable for it only through its later sub-blocks);
``evictor`` flushes the GPU prefix cache; ``reader`` shares the first 16 tokens, hits
chunk 0 on the CPU, and its window at 16 reads from token 0.

How many wrong blocks vLLM alone serves is a measured release fact
(``swa_partial_chunk_wrong_kv_blocks``); the guard must serve none on every release, each
request finishing, and name ``copy_coverage`` where vLLM alone serves wrong KV.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from guardtools_vllm import check_the_fuzz_class, expressible
from release_facts import fact

from kvguard.guards.telemetry import events

from kvguard.guards import names
from kvguard.lab.replay import harness
from kvguard.lab.replay.trace import load_trace

pytestmark = pytest.mark.vllm

TRACES = Path(__file__).parent / "traces"
CLASS_TRACE = "wrong-kv-swa-partial-chunk.jsonl"
#: the same class as the fuzzer found it on 0.33.0 (seed 2, shrunk): mixed layout, extra_retained_tokens 2
FUZZ_TRACE = "wrong-kv-swa-partial-chunk-033.jsonl"
#: a partial key promoted back from vLLM's tiering after a dropped re-store (0.29.0, seed 1)
TIERED_TRACE = "wrong-kv-tiered-partial-restore-029.jsonl"
STALE_TRACES = [("wrong-kv-stale-zeroing-026.jsonl", "stale_zeroing_026_wrong_kv_blocks"),
                ("wrong-kv-stale-zeroing-029.jsonl", "stale_zeroing_029_wrong_kv_blocks")]


@pytest.fixture(autouse=True)
def _fresh_guard():
    harness.uninstall_guard()  # a guard installed earlier in this process keeps its policy
    yield
    harness.uninstall_guard()


def test_the_class_as_the_fuzzer_found_it() -> None:
    """The fuzz finding (0.33.0, seed 2): a 122-token shared prefix's GPU hit leaves the
    window group's first blocks null; the sharer publishes chunk 0 with them; the next turn
    loads it with a 111-token window reading from 0. Guarded: 0 wrong blocks, every request
    finishing, the hit cut by copy coverage."""
    check_the_fuzz_class(load_trace(str(TRACES / FUZZ_TRACE)))




def test_a_partial_key_restored_from_a_secondary_tier_is_still_cut() -> None:
    """``kvguard fuzz --seed 1`` on 0.29.0, guarded (3 Dec 2026; the trace as found, 20
    requests, a single sliding-window group and vLLM's tiering with two example tiers): a
    chunk stored partly (its first sub-block below the storing request's window) is cascaded
    to a secondary tier and evicted from the CPU tier; a later request re-stores the same
    key, but ``store_coverage`` drops that store (its copied run is off its chunk places); a
    reader's hit promotes the tier's partial copy and loads it. The ledger used to forget
    the key's partial entry at the dropped re-store (1 wrong block guarded, 2 unguarded). Now
    only a store that goes ahead is recorded, and with tiering a whole re-store forgets
    nothing (guards/checks/copy_ledger.py)."""
    trace = load_trace(str(TRACES / TIERED_TRACE))
    want = fact("tiered_partial_restore_wrong_kv_blocks")
    if want is None:
        assert not expressible(trace)
        return
    plain = harness.run_replay(trace, guard=False)
    assert plain.wrong_kv_blocks == want
    guarded = harness.run_replay(trace, guard=True)
    assert guarded.wrong_kv_blocks == 0 and guarded.guard_errors == {}
    if plain.engine_survived:  # 0.26.0 dies in vLLM's tiering (KeyError in prepare_store) either way
        assert guarded.ok and guarded.finished == guarded.submitted == len(trace.requests)


def test_the_swa_partial_chunk_class_on_this_release() -> None:
    trace = load_trace(str(TRACES / CLASS_TRACE))
    want = fact("swa_partial_chunk_wrong_kv_blocks")
    plain = harness.run_replay(trace, guard=False)
    assert plain.engine_survived and not plain.stalled
    assert plain.wrong_kv_blocks == want, plain.worker.oracle.wrong_kv
    if want:  # the wrong block is the window group's never-copied slot, read by `reader`
        assert {w["request_id"] for w in plain.worker.oracle.wrong_kv} == {"reader"}
        assert all("never-written" in w["what"] for w in plain.worker.oracle.wrong_kv)
    with events.capture() as logged:
        guarded = harness.run_replay(trace, guard=True)
    assert guarded.ok, (guarded.error, guarded.stalls, guarded.worker.oracle.wrong_kv)
    assert guarded.wrong_kv_blocks == 0 and guarded.guard_errors == {}
    assert guarded.finished == guarded.submitted == len(trace.requests) and not guarded.failed_requests
    copies = guarded.checks[names.CHECK_COPY_COVERAGE]
    reduced = [e for e in logged if e["event"] == "hit_reduced" and e["check"] == names.CHECK_COPY_COVERAGE]
    if want:
        # the reader's 16-token hit is cut to 0 (its only chunk holds the uncopied slot)
        assert copies["hit_reduced"] == 1 and copies["recomputed_tokens"] == 16
        assert reduced and reduced[0]["request_id"] == "reader" and reduced[0]["admitted_hit_tokens"] == 0
        assert "block 0" in reduced[0]["first_missing"]
    else:
        assert copies["violations"] == 0 and not reduced


@pytest.mark.parametrize("policy", ["observe", "strict"])
def test_observe_counts_and_strict_raises(policy: str) -> None:
    want = fact("swa_partial_chunk_wrong_kv_blocks")
    if not want:
        pytest.skip("vLLM alone serves no wrong KV with this trace on this release "
                    "(release fact swa_partial_chunk_wrong_kv_blocks)")
    trace = load_trace(str(TRACES / CLASS_TRACE))
    result = harness.run_replay(trace, guard=True, policy=policy)
    copies = result.checks[names.CHECK_COPY_COVERAGE]
    if policy == "observe":  # vLLM's behaviour exactly: the same wrong KV, counted
        assert result.engine_survived and result.wrong_kv_blocks == want
        assert copies["continued"] == 1 and copies["hit_reduced"] == 0
    else:
        assert not result.engine_survived and result.wrong_kv_blocks == 0
        assert copies["raised"] == 1
        assert "kvguard copy_coverage" in result.error


@pytest.mark.parametrize(("name", "fact_name"), STALE_TRACES, ids=[c[0] for c in STALE_TRACES])
def test_the_ledger_alone_prevents_the_stale_zeroing_class(name: str, fact_name: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """With the store coverage check switched off, copy coverage alone keeps the reader off
    the chunks the stale-id zeroing published without their blocks (the measurement behind
    "the ledger subsumes store_coverage's protection"; store_coverage stays for naming the
    cause at the store)."""
    want = fact(fact_name)
    if not want:
        pytest.skip(f"vLLM alone serves no wrong KV with this trace on this release (release fact {fact_name})")
    monkeypatch.setenv("KVGUARD_DISABLED_SITES", names.STORE_COVERAGE_SITE_ID)
    result = harness.run_replay(load_trace(str(TRACES / name)), guard=True)
    assert result.ok and result.wrong_kv_blocks == 0
    assert result.checks[names.CHECK_STORE_COVERAGE]["violations"] == 0  # it was off
    assert result.checks[names.CHECK_COPY_COVERAGE]["hit_reduced"] >= 1


def _planted_spec(module, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Plant a store that leaves out one GPU block: the first store spec built by the store
    builder gets its first full-attention id replaced by the null block 0 (what a stale
    table entry does), in vLLM's own module, so it holds guarded and unguarded alike."""
    real = module.GPULoadStoreSpec
    planted: list[int] = []

    def spec(block_ids, *args, **kwargs):
        caller = inspect.currentframe().f_back.f_code.co_name
        if caller == "_build_store_jobs" and not planted and len(block_ids) and block_ids[0] != 0:
            block_ids = [0, *list(block_ids)[1:]]
            planted.append(1)
        return real(block_ids, *args, **kwargs)

    monkeypatch.setattr(module, "GPULoadStoreSpec", spec)
    return planted


def test_a_planted_store_that_skips_a_block_is_flagged_unguarded_and_cut_guarded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The oracle's positive control for stores: the planted store leaves block 0 of the
    writer's first chunk uncopied; the reader's hit loads it inside its read range."""
    import importlib

    # the OffloadingConnector's scheduler side, in every full release (0.21.0-0.34.0)
    module = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler")
    trace = load_trace(str(TRACES / CLASS_TRACE))
    planted = _planted_spec(module, monkeypatch)
    plain = harness.run_replay(trace, guard=False)
    assert planted and plain.engine_survived
    assert any(w["group"] == 0 and w["block_index"] == 0 for w in plain.worker.oracle.wrong_kv), \
        plain.worker.oracle.wrong_kv
    planted.clear()
    monkeypatch.setenv("KVGUARD_DISABLED_SITES", names.STORE_COVERAGE_SITE_ID)  # the ledger alone
    guarded = harness.run_replay(trace, guard=True)
    assert planted and guarded.ok and guarded.wrong_kv_blocks == 0
    assert guarded.checks[names.CHECK_COPY_COVERAGE]["hit_reduced"] >= 1


@pytest.mark.parametrize("policy", ["guard", "strict", "observe"])
def test_a_full_ledger_refuses_the_partial_store_instead_of_forgetting(policy: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The capacity hole: a ledger that forgot its oldest partial chunk at a bound let a
    later reader of that chunk load it unchecked (the same wrong block as vLLM alone on
    0.33.0 and 0.34.0). With no room at all (bound 0), ``sharer``'s partial store of window
    chunk 0 is refused under guard and strict, so ``reader`` finds nothing on the CPU and
    recomputes: 0 wrong blocks, every request finishing, no hit cut (there is none to cut),
    and each refusal counted as a ``ledger_full`` skip with a ``store_dropped`` event naming
    copy coverage. Under observe the store goes ahead unrecorded: vLLM's own outcome."""
    from kvguard.guards.checks import copy_ledger
    from kvguard.lab.fuzz.classes import unchecked_copy_admits

    want = fact("swa_partial_chunk_wrong_kv_blocks")
    monkeypatch.setattr(copy_ledger, "LEDGER_MAX", 0)
    trace = load_trace(str(TRACES / CLASS_TRACE))
    with events.capture() as logged:
        result = harness.run_replay(trace, guard=True, policy=policy)
    copies = result.checks[names.CHECK_COPY_COVERAGE]
    refused = [e for e in logged if e["event"] == "store_dropped" and e["check"] == names.CHECK_COPY_COVERAGE]
    assert result.guard_errors == {}
    if want:  # where vLLM alone serves the wrong block, the sharer's window chunk 0 was stored partly
        assert copies["unchecked"] >= 1
        assert copies["skipped"] == {names.SKIP_LEDGER_FULL: copies["unchecked"]}
    # the fuzz's "could admit an unread load": the observe stores only (guard refused them)
    assert unchecked_copy_admits(result.checks, policy) == (copies["unchecked"] if policy == "observe" else 0)
    assert copies["hit_reduced"] == 0 and copies["raised"] == 0
    if policy == "observe":
        assert result.engine_survived and result.wrong_kv_blocks == want and not refused
        return
    assert result.ok and result.wrong_kv_blocks == 0
    assert result.finished == result.submitted == len(trace.requests) and not result.failed_requests
    assert len(refused) == copies["unchecked"]
    if want:
        assert refused[0]["request_id"] == "sharer"


def test_the_store_builder_hands_the_ledger_the_evictions_it_forgets() -> None:
    """The ledger forgets a key the CPU tier evicted (without tiering) by reading the
    builder's ``store_output`` local at the store site: on this release the store builder
    assigns it from ``self.manager.prepare_store(...)`` before it builds the store's
    ``GPULoadStoreSpec``, and ``PrepareStoreOutput`` declares ``evicted_keys``. If a release
    renames either, the ledger forgets nothing (sound, larger): this test names it."""
    import ast
    import dataclasses
    import importlib
    import textwrap

    from vllm.v1.kv_offload.base import PrepareStoreOutput

    assert "evicted_keys" in {f.name for f in dataclasses.fields(PrepareStoreOutput)}
    module = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler")
    builder = module.OffloadingConnectorScheduler._build_store_jobs
    tree = ast.parse(textwrap.dedent(inspect.getsource(builder)))
    assigned = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "store_output" for t in n.targets)
                and isinstance(n.value, ast.Call) and getattr(n.value.func, "attr", "") == "prepare_store"]
    specs = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)
             and getattr(n.func, "id", getattr(n.func, "attr", "")) == "GPULoadStoreSpec"]
    assert assigned and specs and min(assigned) < max(specs)
