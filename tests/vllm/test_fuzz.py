"""`kvguard fuzz` on the installed vLLM: the proofs of issue 10, item 3.

Budget (issue 10: the fuzz tests in CI take at most 10 minutes over all releases): the
heavy searches are gated by the installed release, with the reason in the skip:

- vLLM 0.21.0: one unhinted search (`kvguard fuzz --no-guard`, seed 14, 300 examples,
  about 30-60 s after vLLM is imported on the 2-core CI machine, in this process) that
  must find the #42945 ``group_sizes`` class and a crash class the seed traces do not
  cover (#43884's ``num_locally_computed_tokens`` assert in ``update_state_after_alloc``);
  every minimal trace replays to the same class, the #42945 one through the
  ``kvguard replay`` console script (the #42761 ``KeyError`` class an earlier, unpinned
  generator found is replayed in test_fuzz_42761.py);
- vLLM 0.33.0: a guarded fixed-seed run with the KV cache layouts drawn (0 kvguard-caused
  deaths, 0 lost requests, 0 wrong-KV blocks, no geometry vLLM refuses) and the planted
  kvguard fault (reported as a kvguard bug);
- every release: a short smoke run whose every class replays from its file, and the
  same seed twice in one used process giving the same examples and classes.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvguard.lab.fuzz import determinism, plant, runner
from kvguard.guards.hooking.instrumentor import installed_vllm_version
from kvguard.lab.replay import harness
from kvguard.lab.replay.trace import Geometry, Segment, Trace, TraceRequest, load_trace

pytestmark = pytest.mark.vllm

# None in the light env, which collects this module and deselects it (marker vllm)
VERSION = installed_vllm_version()
CLASS_42945 = (
    "AssertionError in vllm/v1/kv_offload/base.py:GPULoadStoreSpec.__init__"
    " via OffloadingConnectorScheduler._build_store_jobs"
)
CLASS_43884 = (
    "AssertionError in vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py:"
    "OffloadingConnectorScheduler.update_state_after_alloc via OffloadingConnector.update_state_after_alloc"
)
#: What the seed traces cover (seed-48959: the SWA bound in update_state_after_alloc,
#: seed-42945: group_sizes), by the assert text of their deaths.
SEED_ASSERTS = ("sum(group_sizes) == len(block_ids)", "num_pending")
KVGUARD = Path(sys.executable).with_name("kvguard")


def _cli_fuzz(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict]:
    """``kvguard fuzz ... --json`` in-process (click's runner; one vLLM import per session)."""
    from kvguard.sidecar.cli import main

    res = CliRunner().invoke(main, ["fuzz", "--out", str(tmp_path), "--json", *args], env=env, catch_exceptions=False)
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    assert len(line) == 1, res.output[-2000:]
    return res.exit_code, json.loads(line[0])


@pytest.fixture(scope="module", autouse=True)
def _restore_plugin_state():
    """The fuzzer's --no-guard runs set KVGUARD_DISABLE=1 process-wide (as its CLI process
    wants); later test modules in this process install the guard themselves, so restore
    the variable and remove the guard after this module."""
    before = os.environ.get("KVGUARD_DISABLE")
    yield
    if before is None:
        os.environ.pop("KVGUARD_DISABLE", None)
    else:
        os.environ["KVGUARD_DISABLE"] = before
    harness.uninstall_guard()


@pytest.fixture(scope="module")
def search_021(tmp_path_factory):
    if VERSION != "0.21.0":
        pytest.skip(f"the unhinted #42945 search runs on vLLM 0.21.0 only (CI budget); installed {VERSION}")
    out = tmp_path_factory.mktemp("fuzz021")
    # In this pytest process, after other vLLM test modules: the generator is pinned
    # (lab/fuzz/determinism.py), so this is the run an operator gets from the console
    # script in a fresh process (test_fuzz_is_deterministic_inside_a_used_process).
    # Seed 14: with the pinned generator, 24 of seeds 0-24 at 300 examples find #42945 (not 3);
    # seeds 1, 14, 19 and 24 also find the #43884 class (seed 14: 7 examples, the most).
    # --immediate-worker: the same examples whether or not the checkout has the worker model;
    # --sync-scheduling: the same examples as before geometry.async_scheduling was drawn;
    # --default-settings: the same as before the operator settings were drawn (with them,
    # 7 Dec 2026, seed 14 finds #42945 only: the draws after the traffic shift the examples)
    code, r = _cli_fuzz(out, "--no-guard", "--immediate-worker", "--sync-scheduling", "--default-settings",
                        "--seed", "14", "--examples", "300", "--shrink-replays", "60")
    assert code == 0
    return r


def test_unhinted_fuzz_finds_42945_and_its_minimal_trace_replays(search_021):
    r = search_021
    assert r["vllm_version"] == "0.21.0" and r["guard"] is False and r["deterministic"] is True
    assert r["settings_drawn"] is False and r["settings"] == {}
    assert r["examples"] == 300 and r["steps"] > 1000
    (c,) = [c for c in r["classes"] if c["class"] == CLASS_42945]
    assert c["kind"] == "death" and c["count"] >= 1
    assert "sum(group_sizes) == len(block_ids)" in c["error"]
    assert c["known_issue"].startswith("vLLM #42945")
    assert c["reproduces"] is True
    assert c["size"]["requests"] <= c["found_size"]["requests"]
    assert c["size"]["prompt_tokens"] < c["found_size"]["prompt_tokens"]  # it did shrink
    # the file replays to the same assertion through the console script
    proc = subprocess.run(
        [str(KVGUARD), "replay", "--no-guard", "--trace", c["trace"], "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    rep = json.loads(proc.stdout)
    assert rep["engine_survived"] is False
    assert rep["error"] == "AssertionError: assert sum(group_sizes) == len(block_ids)"
    assert rep["error_site"].startswith("vllm/v1/kv_offload/base.py:") and rep["error_site"].endswith("in __init__")


def test_unhinted_fuzz_finds_a_class_the_seeds_do_not_cover(search_021):
    deaths = [c for c in search_021["classes"] if c["kind"] == "death"]
    new = [c for c in deaths if not any(s in c["error"] for s in SEED_ASSERTS)]
    assert new, [c["class"] for c in deaths]
    (c,) = [c for c in new if c["class"] == CLASS_43884]
    assert "num_locally_computed_tokens" in c["error"] and c["known_issue"].startswith("vLLM #43884")
    for c in new:
        assert c["reproduces"] is True
        # replayed again from the file, unguarded: the same class, the same exception
        outcome, result = runner.run_example(load_trace(c["trace"]), guard=False)
        assert c["class"] in outcome.classes
        assert result.error.split(":")[0] == c["error"].split(":")[0]


def test_fuzz_is_deterministic_inside_a_used_process(tmp_path, monkeypatch):
    """The same seed twice in one process, with other work in between, gives the same
    examples, the same per-example steps, classes and minimal traces.

    Root cause of the drift seen before (docs/fuzz.md, Determinism): Hypothesis draws
    some values from the literals of every local module imported so far, and which of
    kvguard's modules a process has imported depends on what it ran before. The fuzzer
    pins that pool empty (lab/fuzz/determinism.py). In between: another seed with the
    guard on, a new local module full of integer literals imported (as another test
    module importing kvguard.sidecar.* did), the global ``random`` state moved.
    PYTHONHASHSEED is set so that vLLM's ``init_none_hash`` gives every engine the same
    block-hash seed (else vLLM's LRU order within a store follows a set of random keys:
    measured on 0.25.1, seed 5 gave 1540-1542 steps from run to run; docs/fuzz.md).
    """
    monkeypatch.setenv("PYTHONHASHSEED", "0")

    def run(out: Path) -> tuple[dict, list[int]]:
        steps: list[int] = []

        def progress(p: dict) -> None:
            if p["phase"] == "explore":
                steps.append(p["totals"]["steps"])

        r = runner.fuzz(seed=3, examples=20, guard=False, out_dir=out, shrink_replays=4, progress=progress)
        return r, steps

    a, steps_a = run(tmp_path / "a")
    traces_a = [t.dumps() for t in runner.generate(3, 60)]

    runner.fuzz(seed=4, examples=5, guard=True, out_dir=tmp_path / "other", shrink_replays=0)
    monkeypatch.syspath_prepend(str(tmp_path))
    unpinned_before = [t.dumps() for t in runner.generate(3, 60, pin=False)]
    # 799 literals (Hypothesis ignores a module with more than 1024): token counts and rates
    (tmp_path / "kvguard_fuzz_local_constants.py").write_text(
        "TOKENS = [" + ", ".join(str(v) for v in range(101, 601)) + "]\n"
        "RATES = [" + ", ".join(f"0.{i:03d}" for i in range(1, 300)) + "]\n"
    )
    importlib.import_module("kvguard_fuzz_local_constants")
    unpinned_after = [t.dumps() for t in runner.generate(3, 60, pin=False)]
    random.seed(99)
    random.random()

    b, steps_b = run(tmp_path / "b")
    assert a["generation"] == determinism.PINNED and a["deterministic"] is True
    assert [t.dumps() for t in runner.generate(3, 60)] == traces_a
    assert len(steps_a) == 20 and steps_a == steps_b  # example by example
    key = lambda r: (r["steps"], r["requests"], [(x["class"], x["count"], x["size"]) for x in r["classes"]])  # noqa: E731
    assert key(a) == key(b)
    for x, y in zip(a["classes"], b["classes"]):
        assert Path(x["trace"]).read_text() == Path(y["trace"]).read_text()
    # negative control: unpinned, the new module's literals reach Hypothesis' draws
    # (measured: 20 examples were not enough to show it, 60 are)
    assert unpinned_before != unpinned_after


def test_fuzz_is_deterministic_for_a_seed(tmp_path, monkeypatch):
    """Same seed, same examples -> the same classes, counts, steps and minimal traces
    (vLLM's block-hash seed fixed, as in the test above)."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    a = runner.fuzz(seed=5, examples=25, guard=False, out_dir=tmp_path / "a", shrink_replays=8)
    b = runner.fuzz(seed=5, examples=25, guard=False, out_dir=tmp_path / "b", shrink_replays=8)
    c = runner.fuzz(seed=6, examples=25, guard=False, out_dir=tmp_path / "c", shrink_replays=0)
    key = lambda r: (r["steps"], r["requests"], [(x["class"], x["count"], x["size"]) for x in r["classes"]])  # noqa: E731
    assert key(a) == key(b)
    assert a["steps"] != c["steps"]
    for x, y in zip(a["classes"], b["classes"]):
        assert Path(x["trace"]).read_text() == Path(y["trace"]).read_text()


def test_smoke_every_class_replays_from_its_file(tmp_path):
    r = runner.fuzz(seed=11, examples=40, guard=False, out_dir=tmp_path, shrink_replays=10)
    assert r["examples"] == 40 and r["invalid_geometries"] == 0
    assert {n["field"] for n in r["not_generated"]} >= {"external_hit_tokens"}
    for c in r["classes"]:
        assert c["reproduces"] is True, c


def test_same_step_prefix_hit_is_not_wrong_kv():
    """Found by kvguard fuzz: two requests arriving together share a GPU block the first
    one computes in that step. The forward writes before attention reads, so the second
    one's hit holds the right KV (the oracle once checked before the step's writes)."""
    geo = Geometry(tokens_per_block=8, tokens_per_chunk=8, sliding_window=248, num_gpu_blocks=133,
                   cpu_chunks=66, max_num_batched_tokens=128, max_num_seqs=4, max_model_len=256)
    trace = Trace("same-step-hit", geo, (
        TraceRequest("a", (Segment(seed=1, tokens=8),), 1),
        TraceRequest("b", (Segment(seed=1, tokens=9),), 8),
    ))
    outcome, result = runner.run_example(trace, guard=False)
    assert result.finished == 2 and result.engine_survived
    assert result.worker.oracle is not None and result.worker.oracle.checked_blocks > 0
    assert result.wrong_kv_blocks == 0 and outcome.findings == []


#: Examples of each fixed-seed guarded run on every full release (the CI's share of the
#: reliability figure; ``make fuzz`` runs 5,000 per release and seed, README "Reliability")
GUARDED_EXAMPLES = 200
#: The fixed seeds: two, so a "never" in CI stands on traffic of more than one draw (seed 1
#: took 52-92 s per release on 0.29.0 / 0.34.0 on a loaded 2-core machine, 3 Dec 2026).
#: ``True``: no request may be lost either. Seed 1 on 0.21.0 lost 4 requests in examples 126
#: and 127 to vLLM's own waiting-scan stall (vllm#45388) until the wait bound
#: (guards/checks/wait_bound.py) ended such waits: now both seeds lose none on every release.
GUARDED_SEEDS = ((0, True), (1, True))


@pytest.mark.parametrize(("seed", "no_lost_requests"), GUARDED_SEEDS, ids=[f"seed-{s}" for s, _ in GUARDED_SEEDS])
def test_guarded_fuzz_has_no_kvguard_bug(tmp_path, seed, no_lost_requests):
    """Seeds 0 and 1, guard on, KV cache layouts drawn where the release expresses them (the
    default), on every full release: 0 kvguard-caused deaths, 0 wrong-KV blocks, no kvguard
    bug, no guard error and no geometry vLLM refuses, and for seed 0 0 requests lost (issues
    10, 22). On
    0.33.0 before the ``promotion_progress`` check (2 Dec 2026) this run lost 8 requests in 7
    examples (109-115) to vLLM's tiering stall (docs/fuzz.md "A second tiering stall");
    before ``store_coverage`` the same kind of run served wrong KV on 0.25.1-0.29.0 (the
    stale-id zeroing class, tests/vllm/test_wrong_kv_classes.py)."""
    from kvguard.lab.fuzz import strategies

    lost: dict[int, int] = {}
    seen = {"requests_lost": 0}

    def progress(p: dict) -> None:
        if p["phase"] == "explore":
            t = p["totals"]
            if t["requests_lost"] > seen["requests_lost"]:
                lost[t["examples"] + t["invalid_geometries"] - 1] = t["requests_lost"] - seen["requests_lost"]
            seen["requests_lost"] = t["requests_lost"]

    r = runner.fuzz(seed=seed, examples=GUARDED_EXAMPLES, guard=True, out_dir=tmp_path, shrink_replays=10,
                    progress=progress)
    assert r["guard"] is True and r["policy"] == "guard" and r["harness_error"] is None
    # every generated geometry passes vLLM's start-up check: the generator's floor is at
    # least vLLM's own need (strategies.layout_min_gpu_blocks)
    assert r["examples"] == GUARDED_EXAMPLES and r["invalid_geometries"] == 0
    assert r["steps"] > 10 * GUARDED_EXAMPLES and r["checks_evaluated"] > 0  # the guard really ran
    assert r["kvguard_deaths"] == 0
    assert r["wrong_kv_blocks"] == 0
    _open_worse_only(r)
    assert not [c for c in r["classes"] if c["kind"] == "guard-error"]
    traces = runner.generate(seed, GUARDED_EXAMPLES)  # the same examples, in order (no geometry refused)
    # the report counts exactly the layouts of the traces this seed generates; where the
    # release expresses them (its own probes), they include several groups, mixed block
    # sizes and extra_retained_tokens
    expected = runner.new_layout_counts()
    for trace in traces:
        runner.count_layout(expected, trace)
    assert r["layouts"] == expected
    support = strategies.layout_support()
    if support["groups"] is None:
        assert set(expected["kv_cache_groups"]) - {"2"} and expected["mixed_block_sizes"] > 0
    if support["extra_retained_tokens"] is None:
        assert expected["extra_retained_tokens"] > 0
    assert (expected["mla"] > 0) == (support["mla"] is None)  # drawn where the release builds MLA groups
    # never worse than vLLM alone: every example where kvguard acted was replayed unguarded
    # and compared request by request (lab/fuzz/differential.py)
    diff = r["differential"]
    assert diff["enabled"] is True
    worse = {c["class"] for c in r["classes"] if c["kind"] == "worse"}
    assert worse <= OPEN_WORSE.get(VERSION, set())
    assert (diff["verdicts"]["worse"] == 0) == (not worse)
    assert sum(diff["verdicts"].values()) >= r["acted_examples"]
    assert "promotion_fit" not in diff["price"] and "promotion_progress" not in diff["price"]  # retired
    # each check's price keeps the traces of its first examples, to be traced from
    assert set(diff["price_traces"]) == set(diff["price"])
    for check, n in diff["price"].items():
        kept = diff["price_traces"][check]
        assert len(kept) == min(n, runner.PRICE_TRACES) and all(os.path.isfile(p) for p in kept)
    if no_lost_requests:  # no request lost, no stall of any kind
        assert lost == {} and r["requests_lost"] == 0
        assert not [c for c in r["classes"] if c["kind"] == "stall"]
    else:  # a stall kvguard took part in would be flagged (kvguard_bugs above)
        assert all(not c["kvguard_bug"] for c in r["classes"] if c["kind"] == "stall")


@pytest.fixture
def only_033():
    if VERSION != "0.33.0":
        pytest.skip(f"the planted-fault control is measured on vLLM 0.33.0 (CI budget); installed {VERSION}")


def test_planted_fault_is_reported_as_a_kvguard_bug(only_033, tmp_path):
    # 50 examples: with the KV cache layouts drawn (the default) the first example of seed
    # 0 that reaches a kvguard check is example 41 (measured on 0.33.0, 1 Dec 2026: the
    # planted run dies in kvguard in examples 41 and 42); 30 reached none
    code, r = _cli_fuzz(
        tmp_path, "--guard", "--seed", "0", "--examples", "50", "--shrink-replays", "10",
        env={plant.ENV: "check"},
    )
    assert r["planted_fault"] == "check"
    assert code == 1 and r["kvguard_bugs"] >= 1 and r["kvguard_deaths"] >= 1
    (c,) = [c for c in r["classes"] if c["class"].startswith("kvguard-raised PlantedFault")]
    assert c["class"] == "kvguard-raised PlantedFault in lab/fuzz/plant.py:planted_check"
    assert c["kvguard_bug"] is True and c["reproduces"] is True
    assert "innermost frame in kvguard" in c["kvguard_bug_reasons"][0]
    assert "raised" in c["kvguard_did"]
    # without the switch the same trace is fine: the fault is the plant, not vLLM
    os.environ.pop(plant.ENV, None)
    outcome, _ = runner.run_example(load_trace(c["trace"]), guard=True)
    assert not outcome.kvguard_death


def test_a_long_life_class_is_verified_on_its_first_epochs(only_033, tmp_path):
    """``--epochs``: shrinking is off, and each class is verified on the first 1, 2, 4, ...
    epochs of the life that found it (the hour-long lives of issue 42 never reached their
    report while each class's whole life was replayed). With the planted fault, seed 0's
    examples 7 and 8 die in kvguard within 4 epochs (measured on 0.33.0, 7 Dec 2026): the
    written trace is the prefix that showed the class, and it replays."""
    from kvguard.lab.fuzz.strategies import epochs_of

    code, r = _cli_fuzz(tmp_path, "--guard", "--seed", "0", "--examples", "10", "--epochs", "4",
                        env={plant.ENV: "check"})
    os.environ.pop(plant.ENV, None)
    assert code == 1 and r["kvguard_bugs"] >= 1 and r["epochs"] == 4
    (c,) = [c for c in r["classes"] if c["class"].startswith("kvguard-raised PlantedFault")]
    v = c["verification"]
    assert c["reproduces"] is True and c["shrink_replays"] == 0 and v["stopped"] == "shown"
    k = v["shown_at_epochs"]
    assert v["epochs"] == 4 and v["replayed_epochs"] == [n for n in (1, 2, 4) if n <= k]
    assert epochs_of(load_trace(c["trace"])) == k
    assert c["size"]["requests"] <= c["found_size"]["requests"]
    for other in r["classes"]:
        assert other["verification"] is not None and other["reproduces"] is not None


def test_a_guard_that_acts_too_early_is_reported_worse_than_vllm_alone(monkeypatch):
    """The differential's negative control: the wait bound set to one observation
    (``KVGUARD_WAIT_BOUND_STEPS=1``) ends a healthy load that takes four steps by failing its
    request; vLLM alone finishes it, so the comparison says ``worse`` and names the request
    and the check, and the finding is a kvguard bug. With the default bound the same trace
    is compared ``same`` or not at all (the guard never acts on it)."""
    import json as _json

    from kvguard.lab.fuzz import differential
    from kvguard.lab.replay.trace import parse_trace

    header = {
        "kind": "header", "format": "kvguard-replay/1", "name": "slow-load",
        "geometry": {"tokens_per_block": 16, "tokens_per_chunk": 64, "sliding_window": 128,
                     "num_gpu_blocks": 68, "cpu_chunks": 64, "max_num_batched_tokens": 128,
                     "max_num_seqs": 4, "max_model_len": 640, "vocab_size": 1000},
        "worker": {"load_latency_steps": 4},
    }
    reqs = [
        {"kind": "request", "id": "r0", "prompt": [{"seed": 1, "tokens": 512}], "max_tokens": 4},
        {"kind": "request", "id": "filler", "after": "r0", "prompt": [{"seed": 3, "tokens": 600}], "max_tokens": 4},
        {"kind": "request", "id": "r1", "after": "filler",
         "prompt": [{"seed": 1, "tokens": 512}, {"seed": 2, "tokens": 64}], "max_tokens": 4},
    ]
    trace = parse_trace([_json.dumps(o) for o in [header, *reqs]], source="slow-load")
    monkeypatch.setenv("KVGUARD_WAIT_BOUND_STEPS", "1")
    runner.prepare(True, "guard")
    outcome, result = runner.run_example(trace, guard=True, differential=True)
    assert outcome.invalid is None and result.hits["r1"]["external_hit_tokens"] > 0  # r1 loads from the CPU tier
    assert [f["request_id"] for f in result.failed_requests] == ["r1"]
    verdict = outcome.differential
    assert verdict is not None and verdict.verdict == "worse" and verdict.worse == ["r1"]
    (worse,) = [f for f in outcome.findings if f.kind == "worse"]
    # the checks that acted, wait_bound among them (0.26.0 also drops the #49118 store here)
    assert worse.name.startswith(f"{differential.WORSE_CLASS} after ") and worse.kvguard_bug
    assert "wait_bound" in worse.name.split(" after ", 1)[1].split("+")
    monkeypatch.delenv("KVGUARD_WAIT_BOUND_STEPS")
    runner.prepare(True, "guard")
    outcome, result = runner.run_example(trace, guard=True, differential=True)
    assert result.failed_requests == [] and result.finished == 3
    assert outcome.differential is None or outcome.differential.verdict == "same"
    assert not [f for f in outcome.findings if f.kind == "worse"]


def test_run_example_replays_with_the_traces_worker_model():
    """The fuzzer explores with the worker model it drew (the same one ``kvguard replay
    --trace`` uses): a trace whose worker fails its first store reports that failed job,
    and where the release's worker asserts a transfer's success
    (:func:`~kvguard.lab.replay.vllm_api.failed_transfer_assert`, 0.21.0-0.33.0) it dies
    in vLLM's worker-role ``get_finished``, while the same trace with the immediate worker
    finishes. Before the fix the runner built every engine with the immediate worker, so
    both outcomes were the second."""
    import dataclasses

    from kvguard.lab.replay import report, vllm_api
    from kvguard.lab.replay.jobs import WorkerModel

    geo = Geometry(tokens_per_block=8, tokens_per_chunk=8, sliding_window=248, num_gpu_blocks=133,
                   cpu_chunks=66, max_num_batched_tokens=128, max_num_seqs=4, max_model_len=256)
    plain = Trace("store-fails", geo, (TraceRequest("a", (Segment(seed=1, tokens=40),), 4),))
    failing = dataclasses.replace(plain, worker=WorkerModel.from_json({"fail_store_jobs": [0]}))
    ok_outcome, ok = runner.run_example(plain, guard=False)
    assert ok.engine_survived and ok.finished == 1 and ok_outcome.findings == []
    outcome, result = runner.run_example(failing, guard=False)
    assert [(j["job_id"], j["store"]) for j in report.to_json(result, geo)["worker"]["failed_jobs"]] == [(0, True)]
    if vllm_api.failed_transfer_assert() is None:  # the release reports it and goes on
        assert result.engine_survived and result.finished == 1 and outcome.findings == []
        return
    assert not result.engine_survived
    (finding,) = outcome.findings
    assert "get_finished" in finding.name and "success" in (result.error or "")
    assert "does not support failed transfers" in runner.known_issue(finding.name, result.error)

#: "Guard made it worse" classes still open, by release: none (docs/fuzz.md "Differential
#: fuzzing"). The last two were closed on 5 Dec 2026: 0.21.0's ``block_exclusive`` now
#: recomputes the request it refused instead of failing it, and the generator no longer draws
#: failed transfers on a release whose worker asserts they never happen. Any worse class, on
#: any release, fails these tests.
OPEN_WORSE: dict[str, set[str]] = {}


def _open_worse_only(r: dict) -> None:
    """Every kvguard bug of a guarded report is an open worse class of this release."""
    allowed = OPEN_WORSE.get(VERSION, set())
    bugs = {c["class"] for c in r["classes"] if c["kvguard_bug"]}
    assert bugs <= allowed, bugs - allowed
    assert r["kvguard_bugs"] == len(bugs)


#: Examples of the guarded SimpleCPUOffloadConnector run on every full release (about 10 s)
SIMPLE_EXAMPLES = 200


def test_guarded_simple_connector_fuzz_has_no_kvguard_bug(tmp_path):
    """Seed 0, ``--connector SimpleCPUOffloadConnector``, guard on, on every full release
    (issue 30): every example replays vLLM's SimpleCPUOffloadConnector; 0 kvguard-caused deaths,
    0 wrong-KV blocks, no kvguard bug, no guard error, no request left waiting (the wait
    bound ends vLLM 0.21.0's remote-KV stall). A death here can only be vLLM's own (0.21.0's
    block-pool free-queue asserts with this connector, docs/fuzz.md): never kvguard's."""
    r = runner.fuzz(seed=0, examples=SIMPLE_EXAMPLES, guard=True, out_dir=tmp_path, shrink_replays=4,
                    connector="SimpleCPUOffloadConnector")
    assert r["harness_error"] is None and r["connector"] == "SimpleCPUOffloadConnector"
    assert r["examples"] + r["invalid_geometries"] == SIMPLE_EXAMPLES
    assert r["simple_connector_examples"] == r["examples"] > SIMPLE_EXAMPLES // 2
    assert r["steps"] > 10 * r["examples"]
    assert r["kvguard_deaths"] == 0 and r["wrong_kv_blocks"] == 0
    assert not [c for c in r["classes"] if c["kind"] in ("guard-error", "stall", "wrong-kv")]
    _open_worse_only(r)
    # none refused: the one start-up refusal this connector has (a layout without a
    # full-attention group, its ``fa_gidx`` assert) is fitted away by the generator
    # (strategies.for_simple_connector); before, 6% of these examples never started
    assert r["invalid_geometries"] == 0, r["invalid_reasons"]
