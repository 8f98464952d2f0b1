"""The admission check on the real vLLM scheduler (issue 9 item 1), in each .venvs/vllm-* env.

- :func:`kvguard.guards.checks.load_coverage.load_set` equals the chunk set of the real load
  job: the real ``KVCacheManager`` allocates, the real ``update_state_after_alloc``
  builds the load, and the keys it hands to ``manager.prepare_load`` are mapped back to
  chunk indices, over several geometries and hit ends (some inside a GPU block);
- the built-in trace ``load-evicted-window`` (a window chunk evicted or never stored,
  then a driven hit that reads it) kills the engine without kvguard and survives with
  it: every request finishes, ``hit_reduced`` >= 1, recomputed tokens > 0, and each
  request generates the same tokens as a control run in which vLLM's own lookup
  answered (no driven hit); ``observe`` counts and vLLM dies as without kvguard;
  ``strict`` raises at admission;
- on the seed traces and the benchmark trace the check never reduces a hit that vLLM's
  own lookup admitted, and passes vLLM's answer through as the same object.
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
from guardtools_vllm import plant_in_cpu_tier

from kvguard.guards.checks import admission, offload_plan
from kvguard.guards.checks.load_coverage import GroupGeometry, load_set
from kvguard.lab.replay import harness, vllm_api
from kvguard.lab.replay.trace import Geometry, Segment, Trace, TraceRequest, load_trace

pytestmark = pytest.mark.vllm

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(autouse=True)
def fresh_guard():
    """Each test installs the guard with its own policy (a repeat install keeps the old one)."""
    harness.uninstall_guard()
    yield
    harness.uninstall_guard()


def _stats(result) -> dict[str, Any]:
    return result.checks["load_coverage"]


def _keep_requests(monkeypatch) -> dict[str, Any]:
    """Keep every Request the harness builds (to read its generated tokens afterwards)."""
    made: dict[str, Any] = {}
    original = vllm_api.make_request

    def make(block_hasher, request_id, prompt, max_tokens):
        req = original(block_hasher, request_id, prompt, max_tokens)
        made[request_id] = req
        return req

    monkeypatch.setattr(vllm_api, "make_request", make)
    return made


# -- 1. the load set equals the real load job's chunks ----------------------------------
def _comparison_trace(tpb: int, tpc: int, sw: int) -> Trace:
    chunks = 20
    n = chunks * tpc
    blocks = n // tpb
    geometry = Geometry(
        tokens_per_block=tpb, tokens_per_chunk=tpc, sliding_window=sw,
        num_gpu_blocks=int(2.5 * blocks), cpu_chunks=8 * chunks, max_num_batched_tokens=max(512, 4 * tpc),
        max_num_seqs=4, max_model_len=8 * n, vocab_size=32000,
    )
    reqs = [TraceRequest("a", (Segment(seed=1, tokens=n),), 1)]
    prev = "a"
    ends = [n - 1, n - 7, n - tpc // 2 - 1, n - tpc - 3, n // 2 + 9]
    for i, end in enumerate(ends):
        evict = f"evict-{i}"
        reqs.append(TraceRequest(evict, (Segment(seed=100 + i, tokens=n),), 1, after=prev))
        rid = f"hit-{i}"
        reqs.append(
            TraceRequest(rid, (Segment(seed=1, tokens=n), Segment(seed=200 + i, tokens=tpc)), 2,
                         after=evict, external_hit_tokens=end)
        )
        prev = rid
    # a local GPU prefix hit followed by an external one (no evictor before it)
    reqs.append(TraceRequest("again", (Segment(seed=1, tokens=n), Segment(seed=999, tokens=2 * tpc)), 1, after=prev))
    return Trace(name=f"compare-{tpb}-{tpc}-{sw}", geometry=geometry, requests=tuple(reqs))


COMPARE_GEOMETRIES = [(16, 64, 256), (8, 64, 200), (16, 64, 40)]


@pytest.mark.parametrize("tpb,tpc,sw", COMPARE_GEOMETRIES)
def test_load_set_equals_the_real_load_job(tpb, tpc, sw):
    trace = _comparison_trace(tpb, tpc, sw)
    # installed before the scheduler is built, as in EngineCore (the spec recorder wraps __init__)
    assert harness.install_guard("guard")
    engine = harness.build_engine(trace.geometry)
    cs = engine.connector_scheduler
    groups = [GroupGeometry(tpb, tpc // tpb), GroupGeometry(tpb, tpc // tpb, sw)]
    compared: list[tuple[int, int]] = []
    pending: dict[str, Any] = {}
    real_prepare = cs.manager.prepare_load

    def prepare_load(keys, req_context, *a, **k):
        pending["keys"] = list(keys)
        return real_prepare(keys, req_context, *a, **k)

    real_after_alloc = cs.update_state_after_alloc

    def after_alloc(request, blocks, num_external_tokens):
        pending.clear()
        out = real_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens:
            status = cs._req_status[request.request_id]
            local = status.num_locally_computed_tokens
            index = [{key: i for i, key in enumerate(gs.offload_keys)} for gs in status.group_states]
            got: list[set[int]] = [set(), set()]
            for key in pending["keys"]:
                (g,) = [g for g in range(2) if key in index[g]]
                got[g].add(index[g][key])
            want = [set(r) for r in load_set(groups, local, local + num_external_tokens)]
            assert got == want, (request.request_id, local, num_external_tokens)
            compared.append((local, local + num_external_tokens))
        return out

    cs.manager.prepare_load = prepare_load
    cs.update_state_after_alloc = after_alloc
    result = harness.run_replay(trace, guard=True, policy="guard", engine=engine)
    assert result.ok, result.error
    assert result.guard_errors == {}
    # enough real loads were compared, some ending inside a GPU block, some after a local hit
    assert len(compared) >= 3, compared
    assert any(end % tpb for _, end in compared) or any(local for local, _ in compared), compared


# -- 2. the load class: a window chunk missing at a driven hit -------------------------
def test_load_evicted_window_dies_without_kvguard():
    result = harness.run_replay(load_trace("load-evicted-window"), guard=False)
    assert not result.engine_survived
    assert "prepare_load" in (result.error_site or ""), result.error_site
    assert "not found" in (result.error or "")
    assert "c/turn-0" not in {r.req_id for r in result.worker.load_specs} if hasattr(result.worker, "load_specs") else True


def test_load_evicted_window_survives_with_the_guard(monkeypatch):
    trace = load_trace("load-evicted-window")
    made = _keep_requests(monkeypatch)
    result = harness.run_replay(trace, guard=True, policy="guard")
    assert result.ok, result.error
    # never wrong KV: every block vLLM read for a request held that request's tokens
    assert result.wrong_kv_blocks == 0 and result.worker.oracle.checked_blocks > 0
    stats = _stats(result)
    assert stats["hit_reduced"] >= 1 and stats["recomputed_tokens"] > 0, stats
    assert result.guard_errors == {}
    driven = result.driven_hits["c/turn-0"]
    admitted = result.hits["c/turn-0"]["external_hit_tokens"]
    assert admitted < driven["num_cached_tokens"] - driven["local_hit_tokens"]
    assert stats["recomputed_tokens"] == driven["num_cached_tokens"] - driven["local_hit_tokens"] - admitted
    guarded = {rid: list(r.output_token_ids) for rid, r in made.items()}

    # control: the same trace where vLLM's own lookup answers (nothing driven)
    made.clear()
    control = dataclasses.replace(
        trace, requests=tuple(dataclasses.replace(r, external_hit_tokens=None) for r in trace.requests)
    )
    plain = harness.run_replay(control, guard=False)
    assert plain.ok, plain.error
    assert {rid: list(r.output_token_ids) for rid, r in made.items()} == guarded
    assert all(len(v) == t.max_tokens for t in trace.requests for k, v in guarded.items() if k == t.id)


def test_load_evicted_window_observe_counts_and_vllm_decides():
    result = harness.run_replay(load_trace("load-evicted-window"), guard=True, policy="observe")
    assert not result.engine_survived and "prepare_load" in (result.error_site or "")
    stats = _stats(result)
    assert stats["continued"] == 1 and stats["hit_reduced"] == 0 and stats["recomputed_tokens"] == 0


def test_load_evicted_window_strict_raises_at_admission():
    result = harness.run_replay(load_trace("load-evicted-window"), guard=True, policy="strict")
    assert not result.engine_survived
    assert "kvguard load_coverage" in (result.error or "")
    assert _stats(result)["raised"] == 1


# -- 3. vLLM's own admitted hits are never reduced ------------------------------------
def _bench_trace() -> Trace:
    sys.path.insert(0, str(BENCH))
    try:
        from replay_overhead import generate_trace
    finally:
        sys.path.remove(str(BENCH))
    return generate_trace(10, 4)


@pytest.mark.parametrize("name", ["seed-48959", "seed-42945", "bench"])
def test_vllm_admitted_hits_are_never_reduced(name, monkeypatch):
    trace = _bench_trace() if name == "bench" else load_trace(name)
    same: list[bool] = []
    original = admission.lookup.admit

    def spy(cs, request, num_computed_tokens, answer, *rest, **kw):
        out = original(cs, request, num_computed_tokens, answer, *rest, **kw)
        same.append(out is answer)
        return out

    monkeypatch.setattr(admission.lookup, "admit", spy)
    result = harness.run_replay(trace, guard=True, policy="guard")
    stats = _stats(result)
    assert stats["hit_reduced"] == 0 and stats["violations"] == 0 and stats["unchecked"] == 0, stats
    assert "promotion_fit" not in result.checks  # retired (guards/checks/admission/deferred.py)
    # every request the scheduler finally admitted with an external hit was checked
    assert stats["evaluated"] >= sum(1 for h in result.hits.values() if h["external_hit_tokens"]), stats
    if name != "seed-42945":  # the store-side seed has no CPU hit on some releases
        assert stats["evaluated"] >= 1, stats
        assert same  # the check is called for lookups with a hit only
    assert all(same)
    assert result.guard_errors == {}


@pytest.mark.parametrize("path", ["inline", "instance", "class"])
def test_the_check_runs_in_vllms_own_call_path(path, monkeypatch):
    """Without the harness' ordering (EngineCore's path): vLLM's own call of
    ``get_num_new_matched_tokens`` runs the check on this scheduler's lookups.

    ``inline``: the ``admission_return`` rewrite (issue 21), what a release whose lookup
    qualifies gets: every ``return`` of vLLM's method passes its answer through
    ``admission.admit_return``, and a scheduler without vLLM's tiering carries no wrapper
    at all. ``instance`` / ``class``: the fallback where the rewrite does not apply
    (forced here: ``rewrite.admission_return_names`` refuses the method): the wrapt wrap
    of the method, arguments bound by signature, through the pre-bound wrapper every
    scheduler built after install gets (``admission.attach``) or the class-level wrap
    (a scheduler without it)."""
    import inspect

    from kvguard.guards.hooking import rewrite

    if path != "inline":
        monkeypatch.setattr(rewrite, "admission_return_names", lambda func: None)
    trace = load_trace("load-evicted-window")
    control = dataclasses.replace(
        trace, requests=tuple(dataclasses.replace(r, external_hit_tokens=None) for r in trace.requests)
    )
    assert harness.install_guard("guard")
    engine = harness.build_engine(control.geometry)
    cs = engine.connector_scheduler
    attr = inspect.getattr_static(type(cs), "get_num_new_matched_tokens")
    own = cs.__dict__.get("get_num_new_matched_tokens")
    if path == "inline":
        assert admission.admits_inline(attr) and not hasattr(attr, "_self_wrapper")
        assert own is None  # no tiering: nothing pre-bound, vLLM's method is called directly
    else:
        assert not admission.admits_inline(attr.__wrapped__)
        assert getattr(attr, "_self_wrapper", None) is admission.admission_wrapper
        assert getattr(own, "_self_wrapper", None) is admission.admission_wrapper
        assert own.__wrapped__.__self__ is cs and own.__wrapped__.__func__ is attr.__wrapped__
        if path == "class":
            del cs.__dict__["get_num_new_matched_tokens"]
    calls = []
    original = admission.lookup.admit
    monkeypatch.setattr(admission.lookup, "admit", lambda *a, **k: calls.append(a[0]) or original(*a, **k))
    # the recorder calls the method as vLLM's scheduler does, and no admit of its own
    monkeypatch.setattr(admission.lookup, "unwrapped_lookup", lambda c: (c.get_num_new_matched_tokens, False))
    result = harness.run_replay(control, guard=True, policy="guard", engine=engine)
    assert result.ok, result.error
    stats = _stats(result)
    assert stats["evaluated"] >= 1 and stats["violations"] == 0, stats
    assert calls and all(c is cs for c in calls)  # the check ran on this scheduler's lookups
    assert result.guard_errors == {}
    # the replay put back what it shadowed
    assert ("get_num_new_matched_tokens" in cs.__dict__) is (path == "instance")
    harness.uninstall_guard()
    restored = inspect.getattr_static(type(cs), "get_num_new_matched_tokens")
    if path == "inline":
        assert restored is attr and not admission.admits_inline(restored)  # vLLM's own code back
    else:
        assert restored is attr.__wrapped__
    assert "get_num_new_matched_tokens" not in cs.__dict__  # uninstall detaches the instance wrapper


# -- 4. Mamba groups (issue 20 item 5): the load set against the real KVCacheManager ----
_MAMBA_LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.mixer")


def _hybrid_mamba_scheduler(tmp_path: Path, tpb: int, tpc: int, mode: str, second: str = "mamba") -> Any:
    """vLLM's real ``Scheduler`` and ``OffloadingConnector`` (CPU spec) over a KV cache of
    two groups: full attention and a ``MambaSpec`` group in ``mamba_cache_mode`` ``mode``
    (``second="chunked_local"``: a ``ChunkedLocalAttentionSpec`` group instead), both with
    ``tpb``-token GPU blocks, ``tpc``-token chunks, one page size, 4000 GPU blocks and room
    for 4096 chunks per group. Prefix caching is on in ``"align"`` mode only (vLLM's
    ``MambaManager`` refuses it otherwise). Skips where the release cannot build it."""
    import json as _json

    import torch

    try:
        from vllm import SamplingParams
        from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            ChunkedLocalAttentionSpec,
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
            MambaSpec,
        )
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager
    except ImportError as exc:
        pytest.skip(f"vLLM {harness.vllm_version()}: {exc}")
    if "layer_stride" not in {f.name for f in dataclasses.fields(KVCacheTensor)}:
        pytest.skip(f"vLLM {harness.vllm_version()}: KVCacheTensor has no layer_stride (a layout this helper does not build)")
    num_blocks = 4000
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(_json.dumps({
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 256,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "num_hidden_layers": 2, "vocab_size": 32000, "max_position_embeddings": 8192,
        "torch_dtype": "float16", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    }))
    full = FullAttentionSpec(block_size=tpb, num_kv_heads=2, head_size=64, dtype=torch.float16)
    page = full.page_size_bytes
    if second == "mamba":
        other: Any = MambaSpec(block_size=tpb, shapes=((page // 2,),), dtypes=(torch.float16,), mamba_cache_mode=mode)
    else:
        other = ChunkedLocalAttentionSpec(
            block_size=tpb, num_kv_heads=2, head_size=64, dtype=torch.float16, attention_chunk_size=4 * tpc
        )
    assert other.page_size_bytes == page
    layers = list(_MAMBA_LAYERS)
    tensors = [KVCacheTensor(size=2 * page * num_blocks, layers=layers, layer_stride=page, block_stride=2 * page)]
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec([layers[0]], full), KVCacheGroupSpec([layers[1]], other)],
    )
    model_dir = str(tmp_path)
    model_config = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True, max_model_len=8192,
                               dtype="float16")
    cache_config = CacheConfig(block_size=tpb, enable_prefix_caching=mode == "align", mamba_cache_mode=mode)
    cache_config.num_gpu_blocks = num_blocks
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=16, max_model_len=8192,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"block_size": tpc, "cpu_bytes_to_use": 2 * page * (tpc // tpb) * 4096},
        ),
        device_config=DeviceConfig(device="cpu"),
    )
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    try:
        scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                              structured_output_manager=StructuredOutputManager(vllm_config),
                              block_size=tpb, log_stats=True)
    except Exception as exc:  # a release whose offloading connector refuses the group
        pytest.skip(f"vLLM {harness.vllm_version()}: the scheduler refuses a {second} group: {exc!r}")
    hasher = get_request_block_hasher(tpb, hash_fn)

    def request(request_id: str, tokens: list[int]) -> Any:
        params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
        return Request(request_id=request_id, prompt_token_ids=tokens, sampling_params=params,
                       pooling_params=None, block_hasher=hasher)

    scheduler.kvguard_test_request = request
    return scheduler


def _plant(cs: Any, request: Any, skip: set[tuple[int, int]] = frozenset()) -> None:
    plant_in_cpu_tier(cs, request, skip)


def _drive(cs: Any, ends: dict[str, int]) -> None:
    """Make the connector answer ``ends[request_id] - num_computed_tokens`` tokens for the
    requests named in ``ends`` (a driven hit, as the replay's ``external_hit_tokens``)
    after vLLM's own lookup ran; the admission check, when installed, sees the driven
    answer as it would vLLM's (``admission.unwrapped_lookup``)."""
    real, wrapped = admission.unwrapped_lookup(cs)

    def lookup(request, num_computed_tokens, *args, **kwargs):
        answer = real(request, num_computed_tokens, *args, **kwargs)
        end = ends.get(request.request_id)
        if end is not None:
            answer = (end - num_computed_tokens, end > num_computed_tokens)
        return admission.admit(cs, request, num_computed_tokens, answer) if wrapped else answer

    cs.get_num_new_matched_tokens = lookup


def _record_loads(cs: Any) -> list[tuple[int, int, list[set[int]]]]:
    """``(local, num_cached_tokens, chunk indices per group)`` of every load job the real
    ``update_state_after_alloc`` builds (the keys it hands ``manager.prepare_load``)."""
    loads: list[tuple[int, int, list[set[int]]]] = []
    pending: dict[str, Any] = {}
    real_prepare = cs.manager.prepare_load

    def prepare_load(keys, req_context, *a, **k):
        pending["keys"] = list(keys)
        return real_prepare(keys, req_context, *a, **k)

    real_after_alloc = cs.update_state_after_alloc

    def after_alloc(request, blocks, num_external_tokens):
        pending.clear()
        out = real_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens:
            status = cs._req_status[request.request_id]
            index = [{key: i for i, key in enumerate(gs.offload_keys)} for gs in status.group_states]
            got: list[set[int]] = [set() for _ in index]
            for key in pending["keys"]:
                (g,) = [g for g in range(len(index)) if key in index[g]]
                got[g].add(index[g][key])
            local = status.num_locally_computed_tokens
            loads.append((local, local + num_external_tokens, got))
        return out

    cs.manager.prepare_load = prepare_load
    cs.update_state_after_alloc = after_alloc
    return loads


MAMBA_GEOMETRIES = [(16, 64, "align"), (16, 16, "align"), (16, 64, "none"), (8, 32, "none"), (16, 16, "none")]


@pytest.mark.parametrize("tpb,tpc,mode", MAMBA_GEOMETRIES)
def test_mamba_load_set_equals_the_real_load_job(tmp_path, tpb, tpc, mode):
    """A full-attention + Mamba hybrid: every load job vLLM's real ``KVCacheManager`` and
    ``update_state_after_alloc`` build reads, of each group, the chunks
    :func:`~kvguard.guards.checks.load_coverage.load_set` gives (of the Mamba group one chunk,
    the one holding the hit's last token). Hits: vLLM's own lookup answer and driven ends
    (in ``"none"`` mode some inside a GPU block; in ``"align"`` mode on chunk boundaries,
    as its lookup rounds them, some after a local prefix-cache hit). With the guard
    installed the admission check evaluated every hit, cut none, skipped none and counted
    no guard error."""
    from kvguard.guards.policy import runtime

    assert harness.install_guard("guard")
    scheduler = _hybrid_mamba_scheduler(tmp_path, tpb, tpc, mode)
    cs = scheduler.connector.connector_scheduler
    plan = offload_plan.get_plan(cs)
    assert [g.recurrent_state for g in plan.groups] == [False, True], plan
    groups = [GroupGeometry(tpb, tpc // tpb), GroupGeometry(tpb, tpc // tpb, recurrent_state=True)]
    make = scheduler.kvguard_test_request
    n = 20 * tpc
    prompt = list(range(1, n + 1))
    _plant(cs, make("plant-p", prompt))
    ends: dict[str, int] = {}
    _drive(cs, ends)
    loads = _record_loads(cs)
    admission.reset()
    runtime.reset()
    if mode == "align":  # vLLM's align-mode lookup answers hits on chunk boundaries only
        driven = [None, 7 * tpc, 13 * tpc, n - tpc]
    else:
        driven = [None, n - 1, 7 * tpc + 3, 5 * tpc + 1, 9 * tpc, tpc // 2 + 1]
    for i, end in enumerate(driven):
        rid = f"hit-{i}"
        if end is not None:
            ends[rid] = end
        scheduler.add_request(make(rid, prompt + [40000 + i] * tpc))
        scheduler.schedule()
    if mode == "align":
        # a local prefix-cache hit first: "a" computes 5 chunks (and 8 tokens, cut by vLLM's
        # Mamba-aligned split), then "b-*" hit them on the GPU and load more from the CPU tier
        q = list(range(50000, 50000 + 12 * tpc))
        _plant(cs, make("plant-q", q))
        ends["a"] = 0
        scheduler.add_request(make("a", q[: 5 * tpc + 8]))
        scheduler.schedule()
        for i, end in enumerate([8 * tpc, 11 * tpc]):
            ends[f"b-{i}"] = end
            scheduler.add_request(make(f"b-{i}", q + [60000 + i] * tpc))
            scheduler.schedule()
    for local, end, got in loads:
        want = [set(r) for r in load_set(groups, local, end)]
        assert got == want, (local, end, got, want)
        assert got[1] == {(end - 1) // tpc}
    assert len(loads) >= len(driven), loads
    if mode == "align":
        assert sum(1 for local, _, _ in loads if local) >= 2, loads
    else:
        assert sum(1 for _, end, _ in loads if end % tpb) >= 2, loads
    stats = admission.snapshot()
    assert stats["evaluated"] >= len(loads) and stats["unchecked"] == 0 and stats["violations"] == 0, stats
    assert admission.snapshot_skipped() == {}
    assert runtime.guard_errors() == {}


@pytest.mark.parametrize("mode", ["align", "none"])
def test_a_missing_mamba_chunk_dies_without_kvguard_and_is_cut_with_it(tmp_path, mode):
    """A driven hit ending in chunk 9 whose Mamba chunk 9 is not in the CPU tier (every
    other chunk is): without kvguard vLLM's ``prepare_load`` raises for it; under
    ``guard`` the admission check cuts the hit to 9 chunks (Mamba chunk 8 is there), the
    load reads exactly that set, and the cut tokens are counted."""
    from kvguard.guards.policy import runtime

    tpb, tpc = 16, 64
    end = 10 * tpc if mode == "align" else 9 * tpc + 5
    for guarded in (False, True):
        harness.uninstall_guard()
        if guarded:
            assert harness.install_guard("guard")
        scheduler = _hybrid_mamba_scheduler(tmp_path / str(guarded), tpb, tpc, mode)
        cs = scheduler.connector.connector_scheduler
        make = scheduler.kvguard_test_request
        prompt = list(range(1, 20 * tpc + 1))
        _plant(cs, make("plant", prompt), skip={(1, 9)})
        _drive(cs, {"victim": end})
        loads = _record_loads(cs)
        admission.reset()
        runtime.reset()
        scheduler.add_request(make("victim", prompt + [7] * tpc))
        if not guarded:
            with pytest.raises(Exception) as raised:
                scheduler.schedule()
            assert "prepare_load" in "".join(traceback.format_tb(raised.value.__traceback__))
            continue
        scheduler.schedule()
        assert [(local, e) for local, e, _ in loads] == [(0, 9 * tpc)]
        assert loads[0][2] == [set(range(9)), {8}]
        stats = admission.snapshot()
        assert stats["hit_reduced"] == 1 and stats["recomputed_tokens"] == end - 9 * tpc, stats
        assert runtime.guard_errors() == {}


def test_an_unmodelled_group_kind_is_skipped_on_the_real_scheduler(tmp_path):
    """A full-attention + ``ChunkedLocalAttentionSpec`` hybrid (a kind load_coverage does not
    model): the guarded scheduler's lookups with a hit are passed through unchanged and
    counted as skipped (``group_kind``), never as guard errors."""
    from kvguard.guards.policy import runtime

    tpb, tpc = 16, 64
    assert harness.install_guard("guard")
    scheduler = _hybrid_mamba_scheduler(tmp_path, tpb, tpc, "align", second="chunked_local")
    cs = scheduler.connector.connector_scheduler
    make = scheduler.kvguard_test_request
    prompt = list(range(1, 20 * tpc + 1))
    _plant(cs, make("plant", prompt))
    answers: list[Any] = []
    real, wrapped = admission.unwrapped_lookup(cs)
    assert wrapped

    def lookup(request, num_computed_tokens, *args, **kwargs):
        answer = real(request, num_computed_tokens, *args, **kwargs)
        out = admission.admit(cs, request, num_computed_tokens, answer)
        answers.append((answer, out))
        return out

    cs.get_num_new_matched_tokens = lookup
    admission.reset()
    runtime.reset()
    scheduler.add_request(make("r", prompt + [9] * tpc))
    scheduler.schedule()
    hits = [(a, o) for a, o in answers if a[0]]
    assert hits and all(o is a for a, o in hits), answers
    assert admission.snapshot_skipped() == {("load_coverage", "group_kind"): len(hits)}
    assert runtime.guard_errors() == {}
    assert "ChunkedLocalAttentionSpec" in str(offload_plan.get_plan(cs))
