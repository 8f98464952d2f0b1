"""Speculative decoding in the lab: drafts from the simulated worker, verified as a target
model verifies them, on vLLM's real scheduler and both CPU offload connectors (the
OffloadingConnector and the SimpleCPUOffloadConnector; marker vllm).

The worker proposes ``k`` drafts after every sampled token (some the request's true next
tokens, some wrong: :func:`kvguard.lab.replay.worker.drafts`), the forward writes each draft's
own KV, the sampler accepts the leading drafts that equal the target's tokens plus one more,
and the drafts reach the scheduler through ``Scheduler.update_draft_token_ids`` as
``EngineCore.post_step`` hands them over. What is proven, on every full release:

- the same tokens as without speculation (the target decides every token), in fewer steps,
  with drafts both accepted and rejected, and 0 wrong-KV blocks in the oracle, which keeps a
  rejected draft's KV in its slot until vLLM computes the position again: a request reading
  it would be flagged;
- the same, guarded: the checks hold with drafts in the steps (no action on a healthy trace);
- ``mtp`` where the installed ``SpeculativeConfig`` accepts it for the lab's model (it refuses
  it before 0.34.0: the harness raises ``RuntimeError``, as for any field a release cannot
  express).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvguard.lab.replay import harness
from kvguard.lab.replay.trace import Trace, parse_trace
from kvguard.lab.replay.worker import drafts, sampled_token

pytestmark = pytest.mark.vllm

TRACES = Path(__file__).parent / "traces"
METHODS = ("ngram", "eagle", "mtp")
K = 3


CONNECTORS = ("OffloadingConnector", "SimpleCPUOffloadConnector")


def _trace(method: str | None, k: int = K, connector: str = CONNECTORS[0]) -> Trace:
    """r0 is stored and evicted by a filler; r1 (r0's prompt, its output and 70 tokens) hits
    it in the CPU tier and loads it; ``other`` decodes beside them. The SimpleCPUOffloadConnector
    stores block by block (a chunk is a block) into a pool counted in blocks."""
    geometry = {"tokens_per_block": 16, "tokens_per_chunk": 64, "sliding_window": 128,
                "num_gpu_blocks": 200, "cpu_chunks": 64, "max_num_batched_tokens": 512,
                "max_num_seqs": 4, "max_model_len": 2048, "vocab_size": 1000}
    if connector != CONNECTORS[0]:
        geometry.update(connector=connector, tokens_per_chunk=16, cpu_chunks=256)
    if method is not None:
        geometry["speculative"] = {"method": method, "num_speculative_tokens": k}
    header = {"kind": "header", "format": "kvguard-replay/1", "name": f"speculative-{method}", "geometry": geometry}
    reqs = [
        {"kind": "request", "id": "r0", "prompt": [{"seed": 1, "tokens": 500}], "max_tokens": 40},
        {"kind": "request", "id": "filler", "after": "r0", "prompt": [{"seed": 3, "tokens": 1200}], "max_tokens": 8},
        {"kind": "request", "id": "r1", "after": "filler",
         "prompt": [{"seed": 1, "tokens": 500}, {"output_of": "r0"}, {"seed": 2, "tokens": 70}], "max_tokens": 30},
        {"kind": "request", "id": "other", "after": "r0", "prompt": [{"seed": 9, "tokens": 96}], "max_tokens": 60},
    ]
    return parse_trace([json.dumps(o) for o in [header, *reqs]], source=f"speculative-{method}")


def _run(trace: Trace, guard: bool):
    if not guard:
        harness.uninstall_guard()
    engine = harness.build_engine(trace.geometry, trace.worker)
    return engine, harness.run_replay(trace, guard=guard, engine=engine)


_PLAIN: dict[tuple[bool, str], object] = {}


def _plain(guard: bool, connector: str = CONNECTORS[0]):
    """The trace without speculation (one replay per guard mode and connector for the module)."""
    if (guard, connector) not in _PLAIN:
        _PLAIN[guard, connector] = _run(_trace(None, connector=connector), guard)[1]
    return _PLAIN[guard, connector]


def test_drafts_mix_true_and_wrong_tokens() -> None:
    """Every count of accepted drafts 0..k occurs, and a wrong draft is never the true token."""
    seen = set()
    for index in range(200):
        d = drafts("r", index, K, 1000)
        true = [sampled_token("r", index + j, 1000) for j in range(K)]
        a = next((j for j in range(K) if d[j] != true[j]), K)
        assert all(d[j] != true[j] for j in range(a, K))
        seen.add(a)
    assert seen == set(range(K + 1))


@pytest.mark.parametrize("connector", CONNECTORS, ids=["offloading", "simple"])
@pytest.mark.parametrize("guard", [False, True], ids=["vllm-alone", "guarded"])
@pytest.mark.parametrize("method", METHODS)
def test_a_speculative_replay_serves_the_same_tokens_on_the_right_kv(method: str, guard: bool,
                                                                      connector: str) -> None:
    trace = _trace(method, connector=connector)
    try:
        engine, result = _run(trace, guard)
    except RuntimeError as exc:  # the release refuses the method for the lab's model
        assert method == "mtp" and "refuses method 'mtp'" in str(exc), exc
        return
    plain = _plain(guard, connector)
    assert result.ok and result.finished == result.submitted == 4, (result.error, result.stalls)
    assert result.wrong_kv_blocks == 0
    assert result.outputs == plain.outputs  # the target decides every token
    worker = engine.worker
    assert 0 < worker.drafts_accepted < worker.drafts_proposed  # accepted and rejected drafts
    assert result.steps < plain.steps
    assert engine.worker.oracle.loaded_blocks > 0  # r1's hit was loaded from the CPU tier
    if guard:  # a healthy trace: no check found anything to act on
        violations = {name: counts.get("violations", 0) for name, counts in result.checks.items()}
        assert not any(violations.values()), violations


def test_a_rejected_drafts_kv_left_in_its_slot_is_flagged(monkeypatch) -> None:
    """Negative control: the forward that computes a rejected draft's position again (the
    step after the rejection starts there) keeps the draft's KV in that slot, as a worker
    that never rewrote it would. The next step's read finds it: the oracle flags wrong KV
    (it would not if the forward wrote the true token's KV for drafts)."""
    from kvguard.lab.replay import worker as worker_mod

    real_forward = worker_mod.forward
    last: dict[str, tuple[int, int]] = {}  # request -> (first draft position, drafts) of the step before
    kept = []

    def forward(oracle, scheduler, scheduler_output):
        spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        restore = []
        for rid, (first, n) in last.items():
            req = scheduler.requests.get(rid)
            num = scheduler_output.num_scheduled_tokens.get(rid)
            if req is None or not num:
                continue
            start = int(req.num_computed_tokens) - int(num)
            if first <= start < first + n:  # the first rejected draft's position, computed again
                for group, table in enumerate(scheduler.kv_cache_manager.get_block_ids(rid)):
                    tpb = oracle.groups[group].tokens_per_block
                    block = int(table[start // tpb])
                    restore.append((group, block, start % tpb, int(oracle._gpu[group][block, start % tpb])))
        real_forward(oracle, scheduler, scheduler_output)
        for group, block, slot, code in restore:
            oracle._gpu[group][block, slot] = code
        kept.extend(restore)
        last.clear()
        for rid, d in spec.items():
            req = scheduler.requests.get(rid)
            if req is not None and d:
                last[rid] = (int(req.num_computed_tokens) - len(d), len(d))

    monkeypatch.setattr(worker_mod, "forward", forward)
    _, result = _run(_trace("ngram"), guard=False)
    assert kept, "no rejected draft was computed again"
    assert result.wrong_kv_blocks > 0


def test_only_the_multi_module_mtp_drafter_reads_the_retained_blocks() -> None:
    """The read range follows the engine's drafter: a sliding window's retained blocks
    (``extra_retained_tokens``) are read only by vLLM's multi-module MTP speculator
    (``SpeculativeConfig.use_multi_module_mtp()``). On the fuzz trace below an ngram engine
    leaves them null after a GPU prefix-cache hit and reads none of them: 0 wrong KV, vLLM
    alone and guarded. The same replay with the oracle reading them (the MTP re-prefill's
    range) flags the null block: the range, not luck, decides."""
    from kvguard.lab.replay.trace import load_trace

    trace = load_trace(str(TRACES / "spec-ngram-retained-null-034.jsonl"))
    try:
        engine = harness.build_engine(trace.geometry, trace.worker)
    except RuntimeError as exc:  # a release that cannot express the trace's layout or settings
        pytest.skip(f"vLLM {harness.vllm_version()} cannot build this trace's engine: {exc}")
    assert engine.worker.oracle.multi_module_mtp is False  # ngram: no re-prefill
    for guard in (False, True):
        if not guard:
            harness.uninstall_guard()
        engine = harness.build_engine(trace.geometry, trace.worker)
        result = harness.run_replay(trace, guard=guard, engine=engine)
        assert result.ok and result.finished == result.submitted, (result.error, result.stalls)
        assert result.wrong_kv_blocks == 0, engine.worker.oracle.wrong_kv
    engine = harness.build_engine(trace.geometry, trace.worker)
    engine.worker.oracle.multi_module_mtp = True  # read as the MTP re-prefill would
    result = harness.run_replay(trace, guard=True, engine=engine)
    if harness.vllm_version() == "0.34.0":  # where the fuzz found it: the null block is read
        offenders = engine.worker.oracle.wrong_kv
        assert result.wrong_kv_blocks >= 1 and "null block" in offenders[0]["what"]
