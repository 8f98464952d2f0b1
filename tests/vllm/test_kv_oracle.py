"""The KV-content oracle of the replay worker (issue 9, item 5), on the installed vLLM.

The replays are in-process: the guard is installed first (as vLLM's plugin loader would),
then the real Scheduler + OffloadingConnector are built and driven through the built-in
seed traces. The negative controls switch on a test-only worker fault (``worker.fault``)
and must be flagged; the unfaulted replay of the same trace must report 0.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

try:  # numpy comes with vLLM; the light env collects this module (then deselects it: marker vllm)
    import numpy as np
except ImportError:  # pragma: no cover - light env only
    np = None

from kvguard.lab.replay import harness, vllm_api, report
if np is not None:
    from kvguard.lab.replay.kv_oracle import GroupLayout, KVOracle
from kvguard.lab.replay.trace import load_trace
from kvguard.lab.replay.worker import FAULTS, SimulatedWorker

pytestmark = pytest.mark.vllm

#: seed-48959's load: 3063 full-attention + 129 sliding-window GPU blocks (docs/replay.md)
SEED_LOADED_BLOCKS = 3063 + 129


def _replay(trace_name: str, fault: str | None = None, guard: bool = True):
    trace = load_trace(trace_name)
    if guard:
        harness.install_guard("guard")  # before vLLM's offload modules are imported
    else:
        harness.uninstall_guard()
    engine = harness.build_engine(trace.geometry)
    engine.worker.fault = fault
    result = harness.run_replay(trace, guard=guard, engine=engine)
    return trace, engine, result


def test_seed_48959_load_is_checked_and_holds_the_right_kv() -> None:
    trace, engine, result = _replay("seed-48959")
    oracle = engine.worker.oracle
    assert result.engine_survived and result.finished == result.submitted == 4, result.error
    assert oracle.loaded_blocks == SEED_LOADED_BLOCKS
    # every block of the loaded prefix was checked at least once after the load
    assert oracle.checked_blocks >= SEED_LOADED_BLOCKS
    assert result.wrong_kv_blocks == 0 and oracle.wrong_kv == []
    assert result.ok
    out = report.to_json(result, trace.geometry)
    assert out["wrong_kv_blocks"] == 0 and out["wrong_kv"] == []
    assert out["worker"]["kv_oracle"]["loaded_blocks"] == SEED_LOADED_BLOCKS


@pytest.mark.parametrize("fault", FAULTS)
def test_a_faulty_load_is_flagged(fault: str) -> None:
    trace, engine, result = _replay("seed-48959", fault=fault)
    oracle = engine.worker.oracle
    # the engine survives (the scheduler cannot see KV content) but the replay fails
    assert result.engine_survived and result.finished == 4, result.error
    assert result.wrong_kv_blocks > 0
    assert not result.ok
    # every wrong block belongs to the loaded request, and the first is its block 0
    first = oracle.wrong_kv[0]
    assert first["request_id"] == "agent-a/turn-2"
    assert (first["group"], first["block_index"]) == (0, 0)
    assert {o["request_id"] for o in oracle.wrong_kv} == {"agent-a/turn-2"}
    assert result.wrong_kv_blocks <= SEED_LOADED_BLOCKS
    if fault == "load_copies_nothing":
        assert oracle.loaded_blocks == 0
    else:
        assert oracle.loaded_blocks == SEED_LOADED_BLOCKS
    out = report.to_json(result, trace.geometry)
    assert out["wrong_kv_blocks"] == result.wrong_kv_blocks
    assert "expected positions 0..31" in out["wrong_kv"][0]["what"]


def test_unknown_fault_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown worker fault"):
        SimulatedWorker(scheduler=None, vocab_size=10, fault="load_everything_twice")


@pytest.mark.parametrize("trace_name", ["seed-48959", "seed-42945"])
@pytest.mark.parametrize("guard", [True, False], ids=["guard", "no-guard"])
def test_seed_traces_serve_no_wrong_kv(trace_name: str, guard: bool) -> None:
    """Where the engine survives, and also up to its death, no block held wrong KV."""
    _trace, engine, result = _replay(trace_name, guard=guard)
    assert engine.worker.oracle.checks == result.steps
    assert result.wrong_kv_blocks == 0, engine.worker.oracle.wrong_kv


# -- the oracle alone: vLLM's GPU <-> CPU mapping and what it detects ---------------------


class _Requests:
    def __init__(self) -> None:
        self.requests: dict = {}


def _oracle(bpc: int = 4, tpb: int = 2, window: int | None = None, groups: int = 2) -> KVOracle:
    layouts = [GroupLayout(tpb)] + [GroupLayout(tpb, sliding_window=window) for _ in range(groups - 1)]
    return KVOracle(scheduler=_Requests(), groups=layouts, num_gpu_blocks=64,
                    blocks_per_chunk=bpc, vocab_size=100)


def _gpu_spec(block_ids, group_sizes, block_indices):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    return GPULoadStoreSpec(list(block_ids), group_sizes=group_sizes, block_indices=block_indices)


def test_store_then_load_of_a_group_that_starts_mid_chunk_restores_its_kv() -> None:
    """#42945's geometry in small: the window group starts at logical block 6 = 1*4 + 2."""
    oracle = _oracle(window=8)  # read start 20 - 8 + 1 = 13: window blocks 6..9
    tokens = list(range(1, 21))  # 20 tokens = 10 GPU blocks of 2
    oracle.token_codes("r", tokens)
    full = list(range(1, 11))        # GPU blocks 1..10 of group 0
    window = [0] * 6 + [11, 12, 13, 14]  # group 1: blocks 0..5 freed (null)
    oracle.computed_range("r", 0, full, 0, 20)
    oracle.computed_range("r", 1, window, 12, 20)
    # store chunks 0..1 of group 0 (8 blocks) and logical blocks 6..9 of group 1:
    # skip 6 % 4 = 2 sub-blocks, so 2 chunks (sub-blocks 2,3 of the first, 0,1 of the next)
    spec = _gpu_spec(full[:8] + window[6:], [8, 4], [0, 6])
    cpu = SimpleNamespace(block_ids=np.array([40, 41, 50, 51]))
    assert oracle.store(1, spec, cpu) == 12
    assert oracle.rejected_jobs == []
    # load them into other GPU blocks, as a later hit would
    oracle.load(2, cpu, _gpu_spec(list(range(21, 29)) + [31, 32, 33, 34], [8, 4], [0, 6]))
    new_full = list(range(21, 29)) + [9, 10]
    new_window = [0] * 6 + [31, 32, 33, 34]
    assert oracle.check_request("r", [new_full, new_window], 20) == 0
    # a load that forgets the group's mid-chunk start (block index 8, not 6) reads
    # sub-blocks 0..3 of chunk 50, i.e. shifted by two blocks: flagged
    oracle.load(3, SimpleNamespace(block_ids=np.array([50])), _gpu_spec([31, 32, 33, 34], [0, 4], [0, 8]))
    assert oracle.rejected_jobs == []
    assert oracle.check_request("r", [new_full, new_window], 20) == 4
    assert {o["group"] for o in oracle.wrong_kv} == {1}
    what = [o["what"] for o in oracle.wrong_kv]
    assert "never-written" in what[0]  # sub-blocks 0, 1 of chunk 50 were never stored
    assert any("found positions 12..13" in w for w in what)  # right tokens, 2 blocks early


def test_right_tokens_at_the_wrong_position_and_a_partial_block_are_wrong_kv() -> None:
    oracle = _oracle(groups=1)
    tokens = [7] * 8  # same token everywhere: only the position tells blocks apart
    oracle.token_codes("r", tokens)
    oracle.computed_range("r", 0, [1, 2, 3, 4], 0, 8)
    assert oracle.check_request("r", [[1, 2, 3, 4]], 8) == 0
    assert oracle.check_request("r", [[2, 1, 3, 4]], 8) == 2  # swapped blocks
    oracle.computed("r", 0, 5, 0, [7])  # block 5 gets slot 0 only
    assert oracle.check_request("r", [[5, 2]], 4) == 0  # block 0 of [5, 2]: expected 2 slots
    # (the (r, 0, 0) offender was already counted above: counted once per block index)
    assert oracle.wrong_kv_blocks == 2
    fresh = _oracle(groups=1)
    fresh.token_codes("r", tokens)
    fresh.computed("r", 0, 5, 0, [7])
    assert fresh.check_request("r", [[5]], 2) == 1
    assert "1/2 slots differ" in fresh.wrong_kv[0]["what"] or "never" in fresh.wrong_kv[0]["what"]
    assert fresh.check_request("r", [[0]], 2) == 0  # same (request, group, block) again
    other = _oracle(groups=1)
    other.token_codes("r", tokens)
    assert other.check_request("r", [[0]], 2) == 1
    assert "null block" in other.wrong_kv[0]["what"]


def test_a_42945_spec_copies_nothing_and_its_later_load_is_wrong_kv() -> None:
    """The over-counted store of #42945 (sum(group_sizes) != len(block_ids)) never
    reaches a real worker (vLLM's GPULoadStoreSpec asserts, the guard drops it); had it,
    vLLM's transfer loop asserts before copying: the oracle copies nothing, and a load
    of those chunks is wrong KV."""
    oracle = _oracle()
    tokens = list(range(1, 17))
    oracle.token_codes("r", tokens)
    oracle.computed_range("r", 0, [1, 2, 3, 4, 5, 6, 7, 8], 0, 16)
    bad = SimpleNamespace(block_ids=[1, 2, 3, 4, 5, 6], group_sizes=[4, 4], block_indices=[0, 4])
    assert oracle.store(9, bad, SimpleNamespace(block_ids=np.array([40, 41]))) == 0
    assert oracle.rejected_jobs == [{"job_id": 9, "store": True}]
    oracle.load(10, SimpleNamespace(block_ids=np.array([40])), _gpu_spec([21, 22, 23, 24], [4, 0], [0, 0]))
    assert oracle.check_request("r", [[21, 22, 23, 24]], 8) == 4  # group 0 only
    assert "never-written" in oracle.wrong_kv[0]["what"]


def test_sliding_window_blocks_below_the_window_are_not_read() -> None:
    oracle = _oracle(groups=2, window=4)
    oracle.token_codes("r", list(range(1, 13)))
    oracle.computed_range("r", 0, list(range(1, 7)), 0, 12)
    oracle.computed_range("r", 1, [0, 0, 0, 0, 20, 21], 8, 12)
    # read start = 12 - 4 + 1 = 9 -> blocks 4, 5 of the window group
    assert oracle.check_request("r", [list(range(1, 7)), [0, 0, 0, 0, 20, 21]], 12) == 0
    assert oracle.checked_blocks == 6 + 2


def test_retained_blocks_below_the_window_are_read_only_by_a_speculative_step() -> None:
    """``extra_retained_tokens`` blocks are kept by vLLM but attended only by the
    multi-module MTP re-prefill, in a step with speculative tokens (kv_oracle docstring)."""
    layouts = [GroupLayout(2), GroupLayout(2, sliding_window=4, extra_retained_tokens=2)]
    oracle = KVOracle(scheduler=_Requests(), groups=layouts, num_gpu_blocks=64,
                      blocks_per_chunk=4, vocab_size=100)
    oracle.token_codes("r", list(range(1, 13)))
    full = list(range(1, 7))
    oracle.computed_range("r", 0, full, 0, 12)
    oracle.computed_range("r", 1, [0, 0, 0, 0, 20, 21], 8, 12)
    window = layouts[1]
    # vLLM keeps from 12 - 4 + 1 - 2 = 7 (block 3); the first query reads from 9 (block 4)
    assert (window.kept_start(12), window.read_start(12)) == (7, 9)
    assert window.read_start(12, num_spec_tokens=1) == 9  # one draft: nothing re-prefilled
    assert window.read_start(12, num_spec_tokens=3) == 7  # re-prefill min(2, 3 - 1) = 2
    assert window.read_start(12, num_spec_tokens=8) == 7  # never below what vLLM keeps
    tables = [full, [0, 0, 0, 0, 20, 21]]  # block 3 null, as after a GPU prefix hit
    assert oracle.check_request("r", tables, 12) == 0
    assert oracle.check_request("r", tables, 12, num_spec_tokens=1) == 0
    assert oracle.check_request("r", tables, 12, num_spec_tokens=3) == 1
    assert oracle.wrong_kv[0]["block_index"] == 3
    assert oracle.wrong_kv[0]["what"] == "expected positions 7..7; found the null block"
    # the narrowed range still flags a null block the window itself reads
    other = KVOracle(scheduler=_Requests(), groups=layouts, num_gpu_blocks=64,
                     blocks_per_chunk=4, vocab_size=100)
    other.token_codes("r", list(range(1, 13)))
    other.computed_range("r", 1, [0, 0, 0, 0, 20, 21], 8, 12)
    assert other.check_request("r", [full, [0, 0, 0, 0, 0, 21]], 12) >= 1
    assert {(o["group"], o["block_index"]) for o in other.wrong_kv} >= {(1, 4)}


EXTRA_RETAINED_TRACE = Path(__file__).parent / "traces" / "extra-retained-gpu-hit-033.jsonl"


def test_a_gpu_prefix_hit_leaves_retained_blocks_null_and_no_attention_reads_them() -> None:
    """The former ``wrong-kv blocks`` class of ``kvguard fuzz --kv-layouts`` (docs/fuzz.md):
    turn 1 gets a 40-token GPU prefix-cache hit; in the 4-token group (window 32,
    ``extra_retained_tokens`` 4) ``find_longest_cache_hit`` supplies cdiv(31, 4) = 8 blocks
    (indices 2..9) and leaves block 1 (positions 4..7) null although vLLM's
    ``get_num_skipped_tokens(40)`` = 5 keeps it. The step's first query (position 40)
    reads from 40 - 32 + 1 = 9; no speculative tokens are scheduled, so nothing reads block 1."""
    from kvguard.lab.fuzz import strategies

    support = strategies.layout_support()
    for field in ("groups", "extra_retained_tokens"):
        if support[field] is not None:
            pytest.skip(f"{field} is not drawn on this release: {support[field]}")
    trace = load_trace(str(EXTRA_RETAINED_TRACE))
    harness.uninstall_guard()
    engine = harness.build_engine(trace.geometry)
    oracle = engine.worker.oracle
    seen: list[tuple[str, list[list[int]], int, int]] = []
    check_request = oracle.check_request

    def recording(req_id, block_ids, num_computed_tokens, num_spec_tokens=0):
        seen.append((req_id, [list(map(int, g)) for g in block_ids], num_computed_tokens, num_spec_tokens))
        return check_request(req_id, block_ids, num_computed_tokens, num_spec_tokens=num_spec_tokens)

    oracle.check_request = recording
    result = harness.run_replay(trace, guard=False, engine=engine)
    assert result.engine_survived and result.finished == result.submitted == 2, result.error
    assert result.hits["agent-2/turn-1"] == {"local_hit_tokens": 40, "external_hit_tokens": 0}
    ((_, tables, computed, spec),) = [c for c in seen if c[0] == "agent-2/turn-1"]
    assert (computed, spec) == (40, 0)
    window = oracle.groups[1]
    assert (window.tokens_per_block, window.sliding_window, window.extra_retained_tokens) == (4, 32, 4)
    manager = engine.scheduler.kv_cache_manager.coordinator.single_type_managers[1]
    assert window.kept_start(40) == manager.get_num_skipped_tokens(40) == 5
    assert tables[1][1] == 0 and all(b != 0 for b in tables[1][2:10])  # block 1 null, 2..9 hit
    assert window.read_start(40) == 9  # block 2: what the window reads
    assert window.read_start(40, num_spec_tokens=5) == 5  # an MTP step would read block 1
    assert result.wrong_kv_blocks == 0 and result.ok, oracle.wrong_kv


# -- harness geometry (issue 9, item 6): more groups, block sizes, extra_retained_tokens ----

THREE_GROUPS = [
    {"kind": "full", "tokens_per_block": 32},
    {"kind": "sliding_window", "tokens_per_block": 16, "sliding_window": 1024},
    {"kind": "sliding_window", "tokens_per_block": 32, "sliding_window": 2048},
]


def _layout_trace(tmp_path, **geometry_fields):
    """A turn stored to the CPU tier, a filler that evicts it from the GPU, then the same
    prefix again: the hit is loaded from the CPU tier and ends where the layout puts it."""
    import json

    geometry = {
        "tokens_per_block": 16, "tokens_per_chunk": 64, "sliding_window": 1024,
        "num_gpu_blocks": 1200, "cpu_chunks": 2048, "max_num_batched_tokens": 2048,
        "max_num_seqs": 4, "max_model_len": 32768, "vocab_size": 32000, **geometry_fields,
    }
    lines = [
        {"kind": "header", "format": "kvguard-replay/1", "name": "layout", "geometry": geometry},
        {"kind": "request", "id": "a/turn-0", "prompt": [{"seed": 5, "tokens": 6000}], "max_tokens": 8},
        {"kind": "request", "id": "filler", "after": "a/turn-0",
         "prompt": [{"seed": 6, "tokens": 12000}], "max_tokens": 4},
        {"kind": "request", "id": "a/turn-1", "after": "filler",
         "prompt": [{"seed": 5, "tokens": 6000}, {"output_of": "a/turn-0"}, {"seed": 7, "tokens": 300}],
         "max_tokens": 8},
    ]
    path = tmp_path / "layout.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return load_trace(str(path))


def _layout_replay(trace, fault=None):
    harness.install_guard("guard")
    engine = harness.build_engine(trace.geometry)
    engine.worker.fault = fault
    return engine, harness.run_replay(trace, guard=True, engine=engine)


def _window_blocks(cached: int, tpb: int, window: int, extra: int = 0) -> tuple[int, int]:
    """(first block index, block count) vLLM keeps for a sliding-window group."""
    first = max(0, cached - window + 1 - extra) // tpb
    return first, -(-cached // tpb) - first


def test_three_groups_with_different_block_sizes(tmp_path) -> None:
    trace = _layout_trace(tmp_path, groups=THREE_GROUPS)
    if vllm_api.blocks_per_chunk_refusal() is not None:  # 0.21.0, 0.25.1: the clear error instead
        with pytest.raises(RuntimeError, match="blocks_per_chunk"):
            harness.build_engine(trace.geometry)
        return
    if "shared_by" in vllm_api.tensor_fields():
        # 0.26.0 has the blocks_per_chunk key, but its KVCacheTensor is shared by every
        # layer (one page per block id for all groups), which cannot hold groups of
        # different block sizes: the oracle refuses with a clear error (measured on 0.26.0)
        with pytest.raises(ValueError, match="shared_pages needs one tokens_per_block"):
            _layout_replay(trace)
        return
    engine, result = _layout_replay(trace)
    assert result.engine_survived and result.finished == 3, result.error
    (load,) = engine.worker.loads
    cached = result.hits["a/turn-1"]["local_hit_tokens"] + result.hits["a/turn-1"]["external_hit_tokens"]
    assert cached > 0
    w16, w32 = _window_blocks(cached, 16, 1024), _window_blocks(cached, 32, 2048)
    assert load.group_sizes == [-(-cached // 32), w16[1], w32[1]]
    assert load.block_indices == [0, w16[0], w32[0]]
    oracle = engine.worker.oracle
    assert [g.tokens_per_block for g in oracle.groups] == [32, 16, 32]
    assert oracle.loaded_blocks == sum(load.group_sizes)
    assert result.wrong_kv_blocks == 0 and result.ok
    # the negative control holds for this layout too
    engine, faulty = _layout_replay(trace, fault="load_wrong_chunk")
    assert faulty.wrong_kv_blocks > 0 and not faulty.ok


def test_extra_retained_tokens_widen_the_loaded_window(tmp_path) -> None:
    trace = _layout_trace(tmp_path, extra_retained_tokens=64)
    import dataclasses

    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    if "extra_retained_tokens" not in {f.name for f in dataclasses.fields(SlidingWindowSpec)}:
        with pytest.raises(RuntimeError, match="extra_retained_tokens"):
            harness.build_engine(trace.geometry)
        return
    engine, result = _layout_replay(trace)
    assert result.engine_survived and result.finished == 3, result.error
    (load,) = engine.worker.loads
    cached = result.hits["a/turn-1"]["local_hit_tokens"] + result.hits["a/turn-1"]["external_hit_tokens"]
    first, count = _window_blocks(cached, 16, 1024, extra=64)
    assert (load.block_indices[1], load.group_sizes[1]) == (first, count)
    assert engine.worker.oracle.groups[1].extra_retained_tokens == 64
    assert result.wrong_kv_blocks == 0 and result.ok
