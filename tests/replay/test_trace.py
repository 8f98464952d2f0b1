"""The replay trace format and the built-in traces (light: no vLLM needed)."""

from __future__ import annotations

import json
import sys

import pytest

from kvguard.lab.replay.trace import (
    BUILTIN_TRACES,
    DEFAULT_TRACE,
    TraceError,
    load_trace,
    parse_trace,
    segment_tokens,
)

HEADER = {
    "kind": "header",
    "format": "kvguard-replay/1",
    "name": "t",
    "geometry": {"tokens_per_block": 32, "tokens_per_chunk": 256, "sliding_window": 4096},
}


def _lines(*objs: dict) -> list[str]:
    return [json.dumps(o) for o in objs]


def _req(rid: str, **kw) -> dict:
    return {"kind": "request", "id": rid, "prompt": [{"seed": 1, "tokens": 10}], "max_tokens": 2, **kw}


def test_default_trace_is_the_48959_geometry() -> None:
    trace = load_trace(DEFAULT_TRACE)
    g = trace.geometry
    assert (g.sliding_window, g.tokens_per_block, g.tokens_per_chunk) == (4096, 32, 256)
    assert g.blocks_per_chunk == 8
    (driven,) = [r for r in trace.requests if r.external_hit_tokens is not None]
    assert driven.external_hit_tokens == 98012
    # The driven request shares agent-a's first segment and is longer than the hit.
    first = trace.requests[0].prompt[0]
    assert driven.prompt[0] == first
    assert sum(s.tokens for s in driven.prompt) > 98012


def test_42945_trace_has_16_gpu_blocks_per_chunk_and_a_straddling_local_hit() -> None:
    trace = load_trace("seed-42945")
    g = trace.geometry
    assert g.blocks_per_chunk == 16
    hit_blocks = 7808 // g.tokens_per_block  # the shared prefix of agent-a's turns
    window_blocks = -(-(g.sliding_window - 1) // g.tokens_per_block)
    first_real = hit_blocks - window_blocks
    assert (first_real // g.blocks_per_chunk, first_real % g.blocks_per_chunk) == (14, 8)
    assert [r.prompt[0].tokens for r in trace.requests if r.id.startswith("agent-a")] == [7808] * 3


@pytest.mark.parametrize("name", sorted(BUILTIN_TRACES))
def test_builtin_traces_round_trip(name: str) -> None:
    trace = load_trace(name)
    again = parse_trace(trace.dumps().splitlines(), source=name)
    assert again == trace


def test_segment_tokens_are_deterministic_and_in_vocab() -> None:
    a = segment_tokens(7, 1000, 32000)
    assert a == segment_tokens(7, 1000, 32000)
    assert a != segment_tokens(8, 1000, 32000)
    assert min(a) >= 1 and max(a) < 32000


def test_waits_for_lists_after_and_output_of() -> None:
    trace = parse_trace(
        _lines(
            HEADER,
            _req("a"),
            _req("b"),
            _req("c", after="a", prompt=[{"output_of": "b"}, {"seed": 2, "tokens": 3}]),
        )
    )
    assert trace.requests[2].waits_for == ("b", "a")
    assert trace.requests[0].waits_for == ()


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([json.dumps(_req("a"))], "first line must be"),
        (_lines(HEADER), "at least one request"),
        (_lines(HEADER, _req("a"), _req("a")), "unique"),
        (_lines(HEADER, _req("a", after="zzz")), "not an earlier request"),
        (_lines(HEADER, _req("a", prompt=[{"output_of": "a"}])), "not an earlier request"),
        (_lines(HEADER, _req("a", max_tokens=0)), "max_tokens"),
        (_lines(HEADER, _req("a", external_hit_tokens=-1)), "external_hit_tokens"),
        (_lines(HEADER, _req("a", prompt=[{"seed": 1, "tokens": 0}])), "positive int tokens"),
        (["{not json"], "not JSON"),
        (
            _lines(dict(HEADER, geometry={"tokens_per_block": 32, "tokens_per_chunk": 100}), _req("a")),
            "multiple of tokens_per_block",
        ),
        (_lines(dict(HEADER, geometry={"bogus": 1}), _req("a")), "bad geometry"),
    ],
)
def test_malformed_traces_are_rejected_with_the_line(lines: list[str], message: str) -> None:
    with pytest.raises(TraceError, match=message):
        parse_trace(lines, source="x.jsonl")


def test_unknown_trace_name_lists_the_builtins(tmp_path) -> None:
    with pytest.raises(TraceError, match="seed-42945, seed-48959"):
        load_trace(str(tmp_path / "missing.jsonl"))


def test_replay_modules_import_without_vllm() -> None:
    """vLLM is imported only when a replay runs (the CLI's ``--help`` stays light)."""
    import subprocess

    code = (
        "import sys, kvguard.lab.replay.trace, kvguard.lab.replay.report, kvguard.lab.replay.command;"
        "bad = [m for m in sys.modules if m == 'vllm' or m.startswith(('vllm.', 'torch'))];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_abort_at_step_parses_and_round_trips() -> None:
    trace = parse_trace(_lines(HEADER, _req("a", abort_at_step=3), _req("b")))
    assert [r.abort_at_step for r in trace.requests] == [3, None]
    assert parse_trace(trace.dumps().splitlines()) == trace
    assert trace.requests[0].to_json()["abort_at_step"] == 3
    assert "abort_at_step" not in trace.requests[1].to_json()


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_abort_at_step_must_be_a_non_negative_int(bad) -> None:
    with pytest.raises(TraceError, match="abort_at_step must be a non-negative int"):
        parse_trace(_lines(HEADER, _req("a", abort_at_step=bad)))


@pytest.mark.parametrize(
    "dependent",
    [{"after": "a"}, {"prompt": [{"output_of": "a"}, {"seed": 2, "tokens": 3}]}],
)
def test_no_request_may_depend_on_an_aborted_one(dependent) -> None:
    with pytest.raises(TraceError, match="may not wait for an aborted one"):
        parse_trace(_lines(HEADER, _req("a", abort_at_step=0), _req("b", **dependent)))
    # the same dependency on a request that is not aborted is fine
    parse_trace(_lines(HEADER, _req("a"), _req("b", **dependent)))


def _tiered(tiers) -> dict:
    return {**HEADER, "geometry": {**HEADER["geometry"], "secondary_tiers": tiers}}


def test_secondary_tiers_parse_and_round_trip() -> None:
    trace = parse_trace(_lines(_tiered([{"type": "example"}, {"type": "example"}]), _req("a")))
    assert trace.geometry.secondary_tiers == ("example", "example")
    assert trace.geometry.to_json()["secondary_tiers"] == [{"type": "example"}] * 2
    assert parse_trace(trace.dumps().splitlines()) == trace
    plain = parse_trace(_lines(HEADER, _req("a")))
    assert plain.geometry.secondary_tiers is None
    assert "secondary_tiers" not in plain.geometry.to_json()


@pytest.mark.parametrize(
    "tiers, message",
    [
        ([], "non-empty list"),
        ({"type": "example"}, "non-empty list"),
        (["example"], r"secondary_tiers\[0\] must be an object"),
        ([{"type": "obj"}], "must be one of .'example', 'fs'."),
        ([{"type": "fs", "root_dir": "/x"}], "unknown fields"),
        ([{"type": "example", "custom_param": 3}], "unknown fields .'custom_param'."),
    ],
)
def test_bad_secondary_tiers_are_rejected(tiers, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        parse_trace(_lines(_tiered(tiers), _req("a")))


def test_secondary_tiers_without_vllm_name_the_field_and_reason() -> None:
    """In an environment without vLLM the tiering check refuses with the reason."""
    from kvguard.guards.hooking.instrumentor import installed_vllm_version
    from kvguard.lab.replay import tiering

    if installed_vllm_version() is not None:
        pytest.skip("vLLM is installed here: tests/vllm/test_tiering.py covers the release")

    assert tiering.unsupported_reason() == "vLLM is not installed"
    with pytest.raises(tiering.TieringUnsupported, match="geometry.secondary_tiers.*vLLM is not installed"):
        tiering.extra_config(("example",))
    assert tiering.extra_config(None) == {}


def test_async_scheduling_parses_round_trips_and_defaults_to_false() -> None:
    geo = {**HEADER["geometry"], "async_scheduling": True}
    trace = parse_trace(_lines({**HEADER, "geometry": geo}, _req("a")))
    assert trace.geometry.async_scheduling is True
    assert json.loads(trace.dumps().splitlines()[0])["geometry"]["async_scheduling"] is True
    assert parse_trace(trace.dumps().splitlines()) == trace
    plain = parse_trace(_lines(HEADER, _req("a")))
    assert plain.geometry.async_scheduling is False
    assert "async_scheduling" not in json.loads(plain.dumps().splitlines()[0])["geometry"]


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_async_scheduling_must_be_a_bool(bad) -> None:
    geo = {**HEADER["geometry"], "async_scheduling": bad}
    with pytest.raises(TraceError, match="geometry.async_scheduling must be true or false"):
        parse_trace(_lines({**HEADER, "geometry": geo}, _req("a")))


SIMPLE_GEO = {"tokens_per_block": 16, "tokens_per_chunk": 16, "sliding_window": 128,
              "connector": "SimpleCPUOffloadConnector"}


def test_connector_parses_round_trips_and_defaults_to_the_offloading_connector() -> None:
    trace = parse_trace(_lines({**HEADER, "geometry": SIMPLE_GEO}, _req("a", evict_cpu_after_lookup=True)))
    assert trace.geometry.connector == "SimpleCPUOffloadConnector"
    assert trace.requests[0].evict_cpu_after_lookup is True
    assert parse_trace(trace.dumps().splitlines()) == trace
    plain = parse_trace(_lines(HEADER, _req("a")))
    assert plain.geometry.connector == "OffloadingConnector"
    assert plain.requests[0].evict_cpu_after_lookup is False
    header = json.loads(plain.dumps().splitlines()[0])
    assert "connector" not in header["geometry"]
    assert "evict_cpu_after_lookup" not in json.loads(plain.dumps().splitlines()[1])


@pytest.mark.parametrize(
    ("geometry", "request_kw", "worker", "message"),
    [
        ({**SIMPLE_GEO, "connector": "LMCacheConnectorV1"}, {}, None, "geometry.connector must be one of"),
        ({**SIMPLE_GEO, "tokens_per_chunk": 64}, {}, None, "copies whole GPU blocks"),
        ({**SIMPLE_GEO, "secondary_tiers": [{"type": "example"}]}, {}, None, "secondary_tiers is the OffloadingConnector's"),
        (SIMPLE_GEO, {}, {"fail_loads": {"rate": 0.1}}, "reports no failed copy"),
        (SIMPLE_GEO, {}, {"fail_store_jobs": [2]}, "reports no failed copy"),
        (HEADER["geometry"], {"evict_cpu_after_lookup": True}, None, "evict_cpu_after_lookup drives the SimpleCPUOffloadConnector"),
        (SIMPLE_GEO, {"evict_cpu_after_lookup": "yes"}, None, "evict_cpu_after_lookup must be true or false"),
    ],
)
def test_what_the_simple_connector_cannot_express_is_refused(geometry, request_kw, worker, message) -> None:
    header = {**HEADER, "geometry": geometry, **({"worker": worker} if worker else {})}
    with pytest.raises(TraceError, match=message):
        parse_trace(_lines(header, _req("a", **request_kw)))


def test_simple_connector_worker_latency_and_hangs_are_accepted() -> None:
    worker = {"load_latency_steps": {"min": 0, "max": 3}, "hang_store_jobs": [1], "seed": 5}
    trace = parse_trace(_lines({**HEADER, "geometry": SIMPLE_GEO, "worker": worker}, _req("a")))
    assert trace.worker.load_latency.max == 3 and trace.worker.store_faults.hang_jobs == frozenset({1})


def test_a_restart_line_parses_to_the_next_request_and_round_trips() -> None:
    restart = {"kind": "restart"}
    trace = parse_trace(_lines(_tiered([{"type": "example"}]), _req("a"), restart, _req("b"), _req("c"),
                               restart, _req("d", after="a")))
    assert trace.restarts == ("b", "d")
    assert parse_trace(trace.dumps().splitlines()) == trace
    assert trace.dumps().count('"restart"') == 2
    assert parse_trace(_lines(_tiered([{"type": "example"}]), _req("a"))).restarts == ()


@pytest.mark.parametrize(
    "lines, message",
    [
        ([_tiered([{"type": "example"}]), {"kind": "restart"}, _req("a")], "between requests"),
        ([_tiered([{"type": "example"}]), _req("a"), {"kind": "restart"}], "between requests"),
        ([_tiered([{"type": "example"}]), _req("a"), {"kind": "restart"}, {"kind": "restart"}, _req("b")],
         "between requests"),
        ([_tiered([{"type": "example"}]), _req("a"), {"kind": "restart", "at": 3}, _req("b")], "no other field"),
        ([HEADER, _req("a"), {"kind": "restart"}, _req("b")], "needs geometry.secondary_tiers"),
    ],
)
def test_a_restart_line_is_checked(lines, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        parse_trace(_lines(*lines))


def test_engines_sharing_an_fs_tier_parse_and_round_trip() -> None:
    trace = parse_trace(_lines(_tiered([{"type": "fs"}]), _req("a"), _req("b", engine=1, after="a"), _req("c")))
    assert trace.engines == 2 and [r.engine for r in trace.requests] == [0, 1, 0]
    again = parse_trace(trace.dumps().splitlines())
    assert [r.engine for r in again.requests] == [0, 1, 0] and '"engine"' in trace.dumps()
    assert parse_trace(_lines(_tiered([{"type": "fs"}]), _req("a"))).engines == 1


@pytest.mark.parametrize(
    "lines, message",
    [
        ([_tiered([{"type": "example"}]), _req("a"), _req("b", engine=1)], "need an fs tier"),
        ([HEADER, _req("a", engine=1)], "need an fs tier"),
        ([_tiered([{"type": "fs"}]), _req("a"), {"kind": "restart"}, _req("b", engine=1)], "not expressed together"),
        ([_tiered([{"type": "fs"}]), _req("a", engine=-1)], "engine must be an int"),
        ([_tiered([{"type": "fs"}]), _req("a", engine=True)], "engine must be an int"),
        ([_tiered([{"type": "fs"}]), _req("a", engine=4)], "engine must be an int from 0 to 3"),
    ],
)
def test_a_request_engine_is_checked(lines, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        parse_trace(_lines(*lines))


def test_operator_settings_parse_sorted_and_round_trip() -> None:
    settings = {"store_threshold": 2, "eviction_policy": "arc", "offload_prompt_only": False}
    geo = {**HEADER["geometry"], "extra_config": settings}
    trace = parse_trace(_lines({**HEADER, "geometry": geo}, _req("a")))
    assert trace.geometry.extra_config == (
        ("eviction_policy", "arc"), ("offload_prompt_only", False), ("store_threshold", 2))
    assert json.loads(trace.dumps().splitlines()[0])["geometry"]["extra_config"] == settings
    assert parse_trace(trace.dumps().splitlines()) == trace
    plain = parse_trace(_lines(HEADER, _req("a")))
    assert plain.geometry.extra_config is None
    assert "extra_config" not in json.loads(plain.dumps().splitlines()[0])["geometry"]


@pytest.mark.parametrize("settings, message", [
    ({"cpu_bytes_to_use": 1}, r"extra_config.cpu_bytes_to_use: the lab sets it from the geometry"),
    ({"secondary_tiers": "fs"}, r"extra_config.secondary_tiers: the lab sets it"),
    ({"backpressure": {"max": 1}}, r"extra_config.backpressure must be a bool, number or string"),
    (["eviction_policy"], r"geometry.extra_config must be an object"),
])
def test_operator_settings_the_lab_owns_or_cannot_pass_are_refused(settings, message: str) -> None:
    geo = {**HEADER["geometry"], "extra_config": settings}
    with pytest.raises(TraceError, match=message):
        parse_trace(_lines({**HEADER, "geometry": geo}, _req("a")))
