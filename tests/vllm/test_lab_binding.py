"""The lab binds to vLLM by declared fields and signatures (issue 20, items 2 and 3).

A test-only copy of vLLM's ``ModelRunnerOutput`` stands in for the next release's struct
(monkeypatched into ``vllm.v1.outputs``, where the lab looks it up at each step):

- the 0.33 -> 0.34 kind of change, one field removed (``logprobs``: the copy no longer
  declares it; reads of it get its old default, as a release that drops a field stops
  reading it) and one optional field added: the replay runs with no change in the lab and
  gives the same tokens, steps and KV checks as with the real struct;
- a required field the lab cannot fill: ``kvguard replay`` reports ``harness_error`` naming
  it and exits 2, never an engine death; ``kvguard fuzz`` stops at the first example with
  that message, with no finding and no kvguard bug.

And the copy engine sits below the boundary the release defines: vLLM's own
``register_kv_caches`` ran (or, where the release's registration needs a model, the
handler registration it would do), and the GPU side every job carried reached the oracle
as the same GPU block ids the scheduler put in its spec.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from kvguard.lab.replay import harness, report, vllm_api
from kvguard.lab.replay.trace import load_trace

pytestmark = pytest.mark.vllm

TRACE = "seed-42945"  # 7 requests, stores and a full-attention hit, 44 steps


def _copy(*, drop: str | None = None, add_required: str | None = None) -> type:
    """A copy of the installed ``ModelRunnerOutput``: ``drop`` removed (its default kept as
    a class attribute), an optional ``kvguard_test_note`` added, and ``add_required`` (no
    default) added when given."""
    from vllm.v1.outputs import ModelRunnerOutput

    fields = []
    for f in dataclasses.fields(ModelRunnerOutput):
        if f.name == drop:
            continue
        kw = {}
        if f.default is not dataclasses.MISSING:
            kw["default"] = f.default
        if f.default_factory is not dataclasses.MISSING:
            kw["default_factory"] = f.default_factory
        fields.append((f.name, f.type, dataclasses.field(**kw)) if kw else (f.name, f.type))
    required = [(add_required, int)] if add_required else []
    # required fields first (dataclass order), then the rest, then the optional addition
    ordered = required + [f for f in fields if len(f) == 2] + [f for f in fields if len(f) == 3]
    ordered.append(("kvguard_test_note", "int | None", dataclasses.field(default=None)))
    namespace = {}
    if drop is not None:
        old = next(f for f in dataclasses.fields(ModelRunnerOutput) if f.name == drop)
        namespace[drop] = old.default if old.default is not dataclasses.MISSING else None
    return dataclasses.make_dataclass("ModelRunnerOutput", ordered, namespace=namespace)


def _summary(result: harness.ReplayResult) -> dict:
    out = report.to_json(result, load_trace(TRACE).geometry)
    return {
        "survived": out["engine_survived"], "harness_error": out["harness_error"], "steps": out["steps"],
        "requests": out["requests"], "wrong_kv_blocks": out["wrong_kv_blocks"],
        "checked_blocks": out["worker"]["kv_oracle"]["checked_blocks"] if out["worker"]["kv_oracle"] else None,
    }


@pytest.fixture(scope="module")
def baseline():
    # guarded: 0.21.0 over-counts a store of this trace (#42945) and dies without the guard
    result = harness.run_replay(load_trace(TRACE), guard=True)
    assert result.ok, result.error
    return result


def test_a_removed_field_and_an_added_optional_field_need_no_lab_change(baseline, monkeypatch):
    import vllm.v1.outputs as outputs

    copy = _copy(drop="logprobs")
    assert "logprobs" not in {f.name for f in dataclasses.fields(copy)}
    monkeypatch.setattr(outputs, "ModelRunnerOutput", copy)
    made: list = []
    build = vllm_api.build_struct

    def spy(cls, values, neutral=None):
        obj = build(cls, values, neutral)
        made.append(obj)
        return obj

    monkeypatch.setattr(vllm_api, "build_struct", spy)
    result = harness.run_replay(load_trace(TRACE), guard=True)
    assert _summary(result) == _summary(baseline)
    assert result.outputs == baseline.outputs
    steps = [o for o in made if isinstance(o, copy)]
    assert len(steps) == result.steps and all(o.kvguard_test_note is None for o in steps)


def test_a_required_field_the_lab_cannot_fill_is_a_harness_error(monkeypatch):
    import vllm.v1.outputs as outputs

    monkeypatch.setattr(outputs, "ModelRunnerOutput", _copy(add_required="kvguard_test_required"))
    result = harness.run_replay(load_trace(TRACE), guard=True)
    assert result.harness_error is not None
    assert "kvguard_test_required" in result.harness_error["exception"]
    assert result.harness_error["exception"].startswith("HarnessError: ")
    assert "kvguard_test_required" in result.harness_error["expected"]
    assert result.engine_survived is True and result.error is None and not result.ok

    from kvguard.lab.replay.command import replay

    cli = CliRunner().invoke(replay, ["--json", "--trace", TRACE])
    assert cli.exit_code == 2, cli.output[-2000:]
    obj = json.loads(cli.stdout.strip().splitlines()[-1])
    assert obj["harness_error"]["exception"] == result.harness_error["exception"]
    assert obj["engine_survived"] is True and obj["error"] is None


def test_the_fuzzer_stops_at_the_first_harness_error(monkeypatch, tmp_path):
    import vllm.v1.outputs as outputs

    from kvguard.lab.fuzz import runner

    monkeypatch.setattr(outputs, "ModelRunnerOutput", _copy(add_required="kvguard_test_required"))
    r = runner.fuzz(seed=0, examples=30, guard=True, out_dir=tmp_path, shrink_replays=0)
    assert r["harness_error"] is not None and "kvguard_test_required" in r["harness_error"]["exception"]
    assert r["examples"] == 0 and r["classes"] == [] and r["kvguard_bugs"] == 0
    assert r["engine_deaths"] == 0 and r["kvguard_deaths"] == 0


def test_vllms_registration_runs_and_every_job_reaches_the_copy_engine_as_its_spec(baseline):
    """The copy engine is what the release's spec hands its connector worker; vLLM's own
    registration ran where it runs on tensors alone; every store and load the scheduler
    built reached the copy engine (through vLLM's worker code, device pointers on 0.34.0)
    as the same GPU block ids."""
    worker = baseline.worker
    conn = worker._connector
    assert conn is not None
    cw = conn.connector.connector_worker
    if conn.registration == "register_kv_caches":
        assert cw.worker is conn.engine  # the spec's get_worker handed our copy engine over
    else:  # 0.21.0: the handler API, registered as vLLM's _register_handlers does
        assert conn.registration.startswith("handlers: register_kv_caches needs the model")
        assert hasattr(cw.worker, "register_handler")
    received = {rec.job_id: rec for rec in worker.stores + worker.loads}
    seen = worker.copy_engine_jobs
    assert seen and set(seen) <= set(received)
    for job_id, side in seen.items():
        assert list(side.block_ids) == received[job_id].block_ids
        assert list(side.group_sizes) == received[job_id].group_sizes


def test_the_lab_sets_only_the_settings_its_census_declares() -> None:
    """``lab/knobs.py``'s ``LAB_KEYS`` and ``OPERATOR_SETTINGS`` are what the lab's engines
    really set: every ``kv_connector_extra_config`` key of an engine built for the seed trace
    (with and without operator settings, and, where the release has tiering, for an fs-tier
    trace) is declared there, and every declared key the
    installed offload code reads is one it reads (the census, from the installed sources)."""
    from kvguard.guards.hooking.vllm_source import installed_package_sources
    from kvguard.lab.knobs import LAB_KEYS, OPERATOR_SETTINGS, extra_config_keys
    from kvguard.lab.replay import tiering

    from pathlib import Path

    base = load_trace(TRACE)
    # an example with every operator setting the fuzzer can draw for the connector
    settings = (("eviction_policy", "arc"), ("max_tracker_size", 8), ("offload_prompt_only", False),
                ("store_threshold", 2))
    traces = [base, dataclasses.replace(base, geometry=dataclasses.replace(base.geometry, extra_config=settings))]
    if tiering.unsupported_reason() is None:
        traces.append(load_trace(str(Path(__file__).parent / "traces" / "tier-shared-swa-partial.jsonl")))
    seen: set[str] = set()
    for trace in traces:
        engine = harness.build_engine(trace.geometry, trace.worker)
        try:
            extra = engine.scheduler.vllm_config.kv_transfer_config.kv_connector_extra_config
            seen |= set(extra)
        finally:
            harness.close_engine(engine)
    declared = set(LAB_KEYS) | set(OPERATOR_SETTINGS)
    assert seen and seen <= declared, seen - declared
    read = set(extra_config_keys(installed_package_sources()))
    # the lab sets nothing the release does not read; the fuzzer draws an operator setting
    # only where it is read (strategies.operator_settings), this test sets all four
    assert seen - set(OPERATOR_SETTINGS) <= read, seen - read
