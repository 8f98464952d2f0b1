"""Multi-head latent attention groups (DeepSeek's MLA) in the lab: vLLM's own
``MLAAttentionSpec`` and ``SlidingWindowMLASpec`` (issue 43, the KV cache group kinds).

vLLM's scheduler side treats them as the kinds they derive from (``MLAAttentionSpec`` is a
``FullAttentionSpec``, ``SlidingWindowMLASpec`` a ``SlidingWindowSpec``: the single-type
manager, the offload window ``get_sliding_window_size_in_chunks`` and kvguard's
``offload_plan._spec_kind`` all decide by ``isinstance``); what differs is the page (one
latent vector per token, no separate V), which the harness sizes by the head size so every
group's page is equal (``vllm_api._mla_spec``). These tests prove the lab builds vLLM's MLA
classes, that an offload hit loads the right KV through them, and that the sliding-window
partial-chunk class (docs/upstream/swa-partial-chunk.md) is the same class in MLA form:
vLLM alone serves what it serves for the non-MLA layout (the release fact), guarded none.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from guardtools_vllm import check_the_fuzz_class

from kvguard.guards import names
from kvguard.lab.replay import harness, vllm_api
from kvguard.lab.replay.trace import load_trace

pytestmark = pytest.mark.vllm

TRACES = Path(__file__).parent / "traces"


@pytest.fixture(autouse=True)
def _fresh_guard():
    harness.uninstall_guard()
    yield
    harness.uninstall_guard()


def _mla_form(name: str):
    """A trace of ``TRACES`` with every KV cache group made ``mla`` (the groups kept)."""
    trace = load_trace(str(TRACES / name))
    groups = tuple(dataclasses.replace(g, mla=True) for g in trace.geometry.kv_groups())
    return dataclasses.replace(trace, geometry=dataclasses.replace(trace.geometry, groups=groups))


def test_the_lab_builds_vllms_mla_specs_with_one_page_size() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowMLASpec, SlidingWindowSpec

    assert vllm_api.mla_refusal() is None  # both classes, both lineages (measured on 0.21.0 to 0.34.0)
    trace = load_trace(str(TRACES / "mla-offload-hit.jsonl"))
    assert all(g.mla for g in trace.geometry.kv_groups())
    config, page = vllm_api.make_kv_cache_config(trace.geometry)
    specs = [g.kv_cache_spec for g in config.kv_cache_groups]
    assert [type(s) for s in specs] == [MLAAttentionSpec, SlidingWindowMLASpec]
    assert isinstance(specs[0], FullAttentionSpec) and isinstance(specs[1], SlidingWindowSpec)
    assert specs[1].sliding_window == 40 and all(s.num_kv_heads == 1 for s in specs)
    # MLA's page has no K/V factor: the head size is what makes it the other groups' page
    plain = vllm_api.make_kv_cache_config(dataclasses.replace(
        trace.geometry, groups=tuple(dataclasses.replace(g, mla=False) for g in trace.geometry.kv_groups())))[1]
    assert {s.page_size_bytes for s in specs} == {page} == {plain}


@pytest.mark.parametrize("guard", [False, True])
def test_an_mla_offload_hit_loads_the_right_kv(guard: bool) -> None:
    trace = load_trace(str(TRACES / "mla-offload-hit.jsonl"))
    result = harness.run_replay(trace, guard=guard)
    assert result.engine_survived and not result.stalled
    assert result.finished == result.submitted == 3 and result.wrong_kv_blocks == 0
    loads = result.worker.loads
    # `again` loads from the CPU tier in both MLA groups: the full-attention chunks and the window's blocks
    assert [ld.req_id for ld in loads] == ["again"]
    assert len(loads[0].group_sizes) == 2 and all(n > 0 for n in loads[0].group_sizes)
    assert result.worker.oracle.loaded_blocks > 0 and result.worker.oracle.checks > 0
    if guard:  # the window bound was evaluated on the SlidingWindowMLASpec group
        assert result.checks[names.CHECK_SWA_PENDING_BOUND]["evaluated"] >= 1
        assert result.guard_errors == {}


def test_the_swa_partial_chunk_class_in_mla_form() -> None:
    """The fuzz finding of test_copy_coverage (0.33.0, seed 2) with every group MLA: vLLM
    alone serves the release's fact for the non-MLA form, the guard none, the hit cut by
    copy coverage."""
    trace = _mla_form("wrong-kv-swa-partial-chunk-033.jsonl")
    assert all(g.mla for g in trace.geometry.kv_groups())
    check_the_fuzz_class(trace)
