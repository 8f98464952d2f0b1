"""The operator settings the fuzzer draws (``geometry.extra_config``) reach vLLM and change
what it decides, on the real scheduler side, guarded, with the KV oracle clean.

One small trace (r0 stores a 512-token prompt, a filler pushes it out of the GPU prefix
cache, r1 reads r0's prompt back), replayed with vLLM's defaults and with each setting
the installed release reads. Each expectation is what vLLM's own code says the setting
does (``vllm/v1/kv_offload/cpu/manager.py``, ``.../offloading/scheduler.py``,
``vllm/v1/simple_kv_offload/manager.py``); where the release does not read a key
(the settings census, ``lab/knobs.py``), the setting must change nothing.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from kvguard.lab.knobs import installed_reads
from kvguard.lab.replay import harness, report
from kvguard.lab.replay.trace import Trace, parse_trace

pytestmark = pytest.mark.vllm

SIMPLE = "SimpleCPUOffloadConnector"


def _trace(settings: dict[str, Any] | None = None, connector: str | None = None, max_tokens: int = 4) -> Trace:
    geo: dict[str, Any] = {
        "tokens_per_block": 16, "tokens_per_chunk": 64, "sliding_window": 128, "num_gpu_blocks": 96,
        "cpu_chunks": 64, "max_num_batched_tokens": 512, "max_num_seqs": 4, "max_model_len": 4096,
        "vocab_size": 1000,
    }
    if connector:
        geo.update(connector=connector, tokens_per_chunk=16, cpu_chunks=256)
    if settings:
        geo["extra_config"] = settings
    header = {"kind": "header", "format": "kvguard-replay/1", "name": "settings", "geometry": geo}
    reqs = [
        {"kind": "request", "id": "r0", "prompt": [{"seed": 1, "tokens": 512}], "max_tokens": max_tokens},
        {"kind": "request", "id": "filler", "after": "r0", "prompt": [{"seed": 3, "tokens": 640}],
         "max_tokens": 4},
        {"kind": "request", "id": "r1", "after": "filler",
         "prompt": [{"seed": 1, "tokens": 512}, {"seed": 2, "tokens": 64}], "max_tokens": 4},
    ]
    return parse_trace([json.dumps(o) for o in [header, *reqs]], source="settings")


def _run(trace: Trace) -> dict[str, Any]:
    """Guarded replay; asserts every request finished and no wrong KV; the oracle's counts."""
    out = report.to_json(harness.run_replay(trace, guard=True), trace.geometry)
    assert out["engine_survived"] and out["requests"]["finished"] == 3, out["requests"]
    assert out["wrong_kv_blocks"] == 0 and out["stalls"] == []
    oracle = out["worker"]["kv_oracle"]
    return {"stored": oracle["stored_blocks"], "loaded": oracle["loaded_blocks"]}


def _reads(key: str) -> bool:
    return key in installed_reads()


def test_store_threshold_stores_a_chunk_only_on_its_second_offer() -> None:
    """vLLM: a chunk is stored once it was offered ``store_threshold`` times; r0's chunks
    are offered once before r1's lookup, so r1 loads nothing (default: it loads r0's)."""
    default = _run(_trace())
    assert default["loaded"] > 0
    got = _run(_trace({"store_threshold": 2}))
    if _reads("store_threshold"):
        assert got["loaded"] == 0 and 0 < got["stored"] < default["stored"]
    else:
        assert got == default


def test_offload_prompt_only_false_stores_the_decode_chunk_too() -> None:
    """r0 generates 80 tokens past its 512-token prompt: the chunk of tokens 512-575 is made
    of decode tokens; vLLM stores it only with ``offload_prompt_only`` false."""
    prompt_only = _run(_trace(max_tokens=80))
    got = _run(_trace({"offload_prompt_only": False}, max_tokens=80))
    if _reads("offload_prompt_only"):
        assert got["stored"] > prompt_only["stored"]
    else:
        assert got == prompt_only


def test_a_sync_load_budget_loads_the_hit_within_its_step() -> None:
    """vLLM 0.33.0 onwards: a hit within the step's ``sync_load_budget_bytes`` is answered
    ``load_kv_async=False`` and loaded in the step that schedules it, so r1 skips the
    steps it waits for an asynchronous load (with a worker that takes up to 4 steps per
    job); the same blocks are loaded, the same tokens come out."""
    from kvguard.lab.replay.trace import WorkerModel

    slow = WorkerModel.from_json({"load_latency_steps": {"min": 1, "max": 4},
                                  "store_latency_steps": {"min": 0, "max": 4}, "seed": 7})

    def run(settings):
        trace = dataclasses.replace(_trace(settings), worker=slow)
        result = harness.run_replay(trace, guard=True)
        out = report.to_json(result, trace.geometry)
        assert out["requests"]["finished"] == 3 and out["wrong_kv_blocks"] == 0
        return out["steps"], out["worker"]["kv_oracle"]["loaded_blocks"], result.outputs

    steps, loaded, tokens = run(None)
    got_steps, got_loaded, got_tokens = run({"sync_load_budget_bytes": 1 << 40})
    assert got_loaded == loaded > 0 and got_tokens == tokens
    if _reads("sync_load_budget_bytes"):
        assert got_steps < steps
    else:
        assert got_steps == steps


def test_lazy_offload_stores_from_the_gpu_free_queue_instead() -> None:
    """The SimpleCPUOffloadConnector's lazy mode stores blocks as they near eviction from
    the GPU free queue, not as they are computed: a different store plan, the same tokens."""
    eager = _run(_trace(connector=SIMPLE))
    got = _run(_trace({"lazy_offload": True}, connector=SIMPLE))
    if _reads("lazy_offload"):
        assert got != eager
    else:
        assert got == eager


def _classes(obj: Any, depth: int = 0, seen: set[int] | None = None) -> set[str]:
    """Class names of the vLLM objects reachable from ``obj`` through instance attributes."""
    seen = set() if seen is None else seen
    names: set[str] = set()
    if id(obj) in seen or depth > 4 or not hasattr(obj, "__dict__"):
        return names
    seen.add(id(obj))
    for value in vars(obj).values():
        if type(value).__module__.startswith("vllm.v1") or type(value).__module__.startswith("vllm.distributed"):
            names.add(type(value).__name__)
            names |= _classes(value, depth + 1, seen)
    return names


def test_eviction_policy_builds_the_named_cache_policy() -> None:
    """Every built-in name the release registers builds its own policy class in the CPU
    tier's manager (no behaviour change visible in a short trace: the class is the proof),
    and a replay with it is clean."""
    from kvguard.lab.replay.vllm_api import cache_policy_names

    names = cache_policy_names()
    assert _reads("eviction_policy") and len(names) >= 2
    built = {}
    for name in names:
        engine = harness.build_engine(_trace({"eviction_policy": name}).geometry)
        try:
            built[name] = {c for c in _classes(engine.scheduler.connector) if c.endswith("CachePolicy")}
        finally:
            harness.close_engine(engine)
    assert all(len(classes) == 1 for classes in built.values()), built
    assert len({next(iter(c)) for c in built.values()}) == len(names), built  # one class per name
    _run(_trace({"eviction_policy": names[-1]}))



def test_every_key_read_is_drawn_or_explained_by_a_line_of_this_release() -> None:
    """Each key the installed offload code reads is set by the lab, drawn by the fuzzer, or
    in ``NOT_DRAWN`` with a fragment of the module it cites, present in this release."""
    from kvguard.guards.hooking.vllm_source import installed_package_sources
    from kvguard.lab.knobs import LAB_KEYS, NOT_DRAWN, OPERATOR_SETTINGS

    sources = installed_package_sources()
    for key, where in installed_reads().items():
        if key in LAB_KEYS or key in OPERATOR_SETTINGS:
            continue
        outer = key.split(".", 1)[0]
        assert outer in NOT_DRAWN, f"{key} (read at {where}) is neither drawn nor explained"
        module, fragment, verdict, _ = NOT_DRAWN[outer]
        assert verdict in ("cannot", "not yet")
        if module in sources:  # a release that reads the key elsewhere cites its own line
            assert fragment in sources[module], f"{key}: {module} no longer has {fragment!r}"
