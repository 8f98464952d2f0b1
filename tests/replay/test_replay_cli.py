"""`kvguard replay` against the installed vLLM: the proofs of issue 2, item 6.

Each case runs ``kvguard replay --json`` once per (trace, guard on/off) in the vLLM
environment under test: seed-48959 with the guard through the real console script in a
fresh process (the installed entry point, the plugin installed before vLLM's scheduler
is imported, and stdout holding nothing but the report, on every release), the others
in this process through click's runner (the same click group; a subprocess costs a
fresh vLLM import, about 20-35 s per case per release here: CI budget). The outcome each
case must give is computed from what the installed release's code says, never from a
table keyed by release (issue 20, item 4):

- seed-48959 (vLLM #48959): the 129-block load is legal. Where the release's own window
  assert allows fewer blocks (its bound, read from its code by
  :func:`kvguard.guards.hooking.vllm_source.asserted_window_bound`: 128 up to 0.26.0, 129 after PR
  #49052) it dies unguarded in ``update_state_after_alloc`` on that assert, and the guard
  tolerates the load; otherwise both runs finish and the guard tolerates nothing.
- seed-42945 (vLLM #42945): whether the release over-counts ``group_sizes`` for a store
  that straddles the window edge is a measured fact (``release_facts.csv``,
  ``store_overcounts_straddling_chunk``); where it does, unguarded ``GPULoadStoreSpec``
  asserts, and the guard drops that store and releases its keys, so the later turn that
  needs them does not wait forever.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from guardstate import restored_guard_state

from kvguard.guards import names

pytestmark = pytest.mark.vllm

# the vLLM tests' helpers: the seed's window bound read from the release, its measured facts
sys.path.insert(0, str(Path(__file__).parents[1] / "vllm"))

# vLLM's own skipped-block rule for the seed geometry: window 4096, GPU block 32,
# num_cached_tokens 98012 -> blocks [2934, 3063) of the sliding-window group.
SEED_CACHED_TOKENS = 98012
SEED_WINDOW_FIRST_BLOCK = (SEED_CACHED_TOKENS - 4096 + 1) // 32
SEED_PENDING_BLOCKS = -(-SEED_CACHED_TOKENS // 32) - SEED_WINDOW_FIRST_BLOCK
assert (SEED_WINDOW_FIRST_BLOCK, SEED_PENDING_BLOCKS) == (2934, 129)

#: the assert of ``GPULoadStoreSpec.__init__`` that an over-counted store fails (#42945)
GROUP_SIZES_ASSERT = "assert sum(group_sizes) == len(block_ids)"


@dataclass(frozen=True)
class Expect:
    """What one replay must give: exit status and, when it dies, a text of its error."""

    exit_code: int
    error_contains: str | None = None
    swa_tolerated: int | None = None  # swa_pending_bound.tolerated with the guard
    group_sizes_violations: int | None = None  # group_sizes_consistency.violations


GUARD, NO_GUARD = "guard", "no-guard"
CASES = [(t, m) for t in ("seed-48959", "seed-42945") for m in (GUARD, NO_GUARD)]


def _vllm_version() -> str:
    from kvguard.guards.hooking.instrumentor import installed_vllm_version

    return installed_vllm_version()


def expected_outcomes() -> dict[tuple[str, str], Expect]:
    """Each case's outcome on the installed release, from its code and its measured facts."""
    from guardtools_vllm import seed_window_bound
    from release_facts import fact

    bound, bound_expr = seed_window_bound()
    window_dies = bound < SEED_PENDING_BLOCKS
    overcounts = bool(fact("store_overcounts_straddling_chunk"))
    return {
        ("seed-48959", GUARD): Expect(0, swa_tolerated=int(window_dies), group_sizes_violations=0),
        ("seed-48959", NO_GUARD): Expect(1, error_contains=" ".join(bound_expr.split())) if window_dies else Expect(0),
        ("seed-42945", GUARD): Expect(0, swa_tolerated=0, group_sizes_violations=int(overcounts)),
        ("seed-42945", NO_GUARD): Expect(1, error_contains=GROUP_SIZES_ASSERT) if overcounts else Expect(0),
    }


@pytest.fixture(scope="module")
def expected() -> dict[tuple[str, str], Expect]:
    return expected_outcomes()


@pytest.fixture(scope="module", autouse=True)
def _restore_guard_state():
    """The in-process replays install kvguard into vLLM's code for the whole process (as
    the plugin does inside EngineCore): after this module, remove it and restore
    ``KVGUARD_DISABLE``, so the next module starts with vLLM's own code (as in
    tests/vllm/conftest.py)."""
    yield from restored_guard_state()


#: the one case run through the real console script in a fresh process (every release)
CONSOLE_SCRIPT_CASE = ("seed-48959", GUARD)


def _cli_env() -> dict[str, str | None]:
    """The environment of an in-process run, as the subprocess gets it: no ``KVGUARD_*``
    variable (None: unset during the run). The variables the command sets for vLLM are
    listed with their current values, so click's runner restores them afterwards."""
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KVGUARD_")}
    for k in ("VLLM_LOGGING_STREAM", "VLLM_LOGGING_LEVEL"):
        env[k] = os.environ.get(k)
    return env


def run_cli(args: list[str]) -> tuple[int, str, str]:
    """``kvguard <args>`` in this process through the console script's click group
    (click's runner); (exit code, stdout, stderr)."""
    from kvguard.sidecar.cli import main

    res = CliRunner().invoke(main, args, env=_cli_env(), catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def run_console_script(args: list[str]) -> tuple[int, str, str]:
    """The installed ``kvguard`` console script in a fresh process; (exit code, stdout, stderr)."""
    script = Path(sys.executable).with_name("kvguard")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD_")}
    proc = subprocess.run([str(script), *args], capture_output=True, text=True, env=env, timeout=900)
    return proc.returncode, proc.stdout, proc.stderr


_RUNS: dict[tuple[str, str], tuple[int, dict[str, Any], str]] = {}


def replay(trace: str, mode: str) -> tuple[int, dict[str, Any], str]:
    """Run ``kvguard replay --json`` once per (trace, mode); (exit code, object, stderr).
    :data:`CONSOLE_SCRIPT_CASE` runs the real console script as a subprocess, the others
    run in this process."""
    key = (trace, mode)
    if key not in _RUNS:
        args = ["replay", "--json", "--trace", trace]
        if mode == NO_GUARD:
            args.append("--no-guard")
        code, stdout, stderr = (run_console_script if key == CONSOLE_SCRIPT_CASE else run_cli)(args)
        try:
            obj = json.loads(stdout)  # the whole stdout is exactly one JSON object
        except json.JSONDecodeError:
            pytest.fail(f"stdout is not one JSON object: {stdout[-2000:]!r}\n{stderr[-4000:]}")
        _RUNS[key] = (code, obj, stderr)
    return _RUNS[key]


@pytest.mark.parametrize(("trace", "mode"), CASES, ids=[f"{t}-{m}" for t, m in CASES])
def test_exit_status_and_error(trace: str, mode: str, expected: dict) -> None:
    want: Expect = expected[(trace, mode)]
    code, out, stderr = replay(trace, mode)
    assert out["vllm_version"] == _vllm_version()
    assert out["guard"] is (mode == GUARD)
    assert out["policy"] == ("guard" if mode == GUARD else None)
    assert out["guard_installed"] is (mode == GUARD)
    assert code == want.exit_code, stderr[-3000:]
    # The CPU tier vLLM built holds exactly the trace's offloaded blocks.
    assert out["cpu_chunks"] == {"seed-48959": 2048, "seed-42945": 64}[trace]
    assert out["engine_survived"] is (want.error_contains is None)
    if want.error_contains is None:
        assert out["error"] is None
        assert out["requests"]["finished"] == out["requests"]["submitted"]
    else:
        assert out["error"].startswith("AssertionError: ")
        assert want.error_contains in " ".join(out["error"].split())
        assert out["requests"]["finished"] < out["requests"]["submitted"]
    # Whatever happens, no inconsistent transfer spec ever reaches the worker.
    assert out["worker"]["inconsistent_specs"] == []
    if mode == NO_GUARD:
        assert out["checks"] == {}


@pytest.mark.parametrize("mode", [GUARD, NO_GUARD])
def test_seed_48959_load_is_exactly_the_window(mode: str, expected: dict) -> None:
    """The 129-block load carries exactly the window's GPU blocks: none lost, none added."""
    _code, out, _ = replay("seed-48959", mode)
    assert out["driven_hits"]["agent-a/turn-2"]["num_cached_tokens"] == SEED_CACHED_TOKENS
    loads = out["worker"]["loads"]
    if expected[("seed-48959", mode)].exit_code:
        assert loads == []  # vLLM died building it: no load reached the worker
        return
    (load,) = loads
    assert load["request_id"] == "agent-a/turn-2"
    assert load["num_cached_tokens"] == SEED_CACHED_TOKENS
    assert load["group_sizes"] == [-(-SEED_CACHED_TOKENS // 32), SEED_PENDING_BLOCKS]
    assert load["block_indices"] == [0, SEED_WINDOW_FIRST_BLOCK]
    assert load["swa_window"] == {
        "expected_blocks": SEED_PENDING_BLOCKS,
        "spec_blocks": SEED_PENDING_BLOCKS,
        "lost": 0,
        "added": 0,
    }


@pytest.mark.parametrize("trace", ["seed-48959", "seed-42945"])
def test_guard_counts(trace: str, expected: dict) -> None:
    want: Expect = expected[(trace, GUARD)]
    _code, out, _ = replay(trace, GUARD)
    # issue 8: no error inside kvguard, every discovered site rewritten, no special missing
    assert out["guard_errors"] == {}
    assert out["sites"]["not_rewritten"] == [] and out["sites"]["special_missing"] == []
    assert out["sites"]["installed"] >= 40
    swa = out["checks"]["swa_pending_bound"]
    assert swa["tolerated"] == want.swa_tolerated
    assert swa["violations"] == 0
    sizes = out["checks"]["group_sizes_consistency"]
    assert sizes["violations"] == want.group_sizes_violations
    # group sizes and the generic asserts are counted when they fail only ("not counted": null);
    # the window check counts every evaluation (one load per seed-48959 replay, below)
    # the admission check (issue 9) counts each lookup with a hit it checked; it never
    # reduces a hit that vLLM's own lookup admitted on the seed traces
    cover = out["checks"]["load_coverage"]
    assert isinstance(cover["evaluated"], int)
    assert cover["hit_reduced"] == 0 and cover["recomputed_tokens"] == 0
    # the retired tiering checks (guards/checks/admission/deferred.py) are not reported
    assert "promotion_fit" not in out["checks"] and "promotion_progress" not in out["checks"]
    # copy coverage: nothing partly written is loaded on the seed traces (a hit reduced there
    # would be a false alarm); its evaluations are counted, so it is an int
    copies = out["checks"]["copy_coverage"]
    assert isinstance(copies["evaluated"], int) and copies["violations"] == 0 and copies["recomputed_tokens"] == 0
    admission_checks = (names.CHECK_LOAD_COVERAGE,
                        names.CHECK_COPY_COVERAGE, names.CHECK_BLOCK_EXCLUSIVE, names.CHECK_LOAD_WRITES,
                        names.CHECK_GPU_FREE_ONCE, names.CHECK_STORE_AFTER_FINALIZE)
    # the exclusive-block check reads every admission with a load (the window check reads
    # the same calls: update_state_after_alloc with external tokens), none given twice here
    exclusive = out["checks"]["block_exclusive"]
    assert exclusive["evaluated"] == out["checks"]["swa_pending_bound"]["evaluated"]
    assert exclusive["violations"] == 0
    assert {name: c["evaluated"] for name, c in out["checks"].items() if c["evaluated"] is None} == {
        name: None
        for name in names.CHECKS
        if name not in names.EVALUATED_CHECKS and name not in admission_checks
    }
    assert isinstance(swa["evaluated"], int)
    if trace == "seed-48959":
        # One load of the sliding-window group, measured against the exact bound.
        assert swa["evaluated"] == 1
        assert swa["max_pending_blocks"] == SEED_PENDING_BLOCKS
        assert swa["bound"] == SEED_PENDING_BLOCKS


def test_seed_42945_store_keys_never_left_pending(expected: dict) -> None:
    """The straddling store's keys end completed or released; later turns are served."""
    for mode in (GUARD, NO_GUARD):
        code, out, _ = replay("seed-42945", mode)
        if code == 0:
            assert out["pending_store_keys"] == 0
            assert out["requests"] == {"submitted": 7, "finished": 7, "aborted": 0, "failed": 0, "not_arrived": 0}
            assert out["stalled"] is False
        else:
            # vLLM 0.21.0 unguarded: prepare_store already reserved the store's 50 keys
            # (32 full-attention + 18 sliding-window chunks) when the spec asserted.
            assert out["pending_store_keys"] == 50


#: agent-a/turn-1's store spec as the worker receives it (guard on) is a measured fact
#: (``seed42945_turn1_store_specs``): 0.25.1 (fixed #42945) counts only the 8 appended
#: blocks of sliding-window chunk 14: 280 = 8 + 17 * 16 blocks starting at GPU block
#: 232 = 14 * 16 + 8. 0.33.0 stores only the sliding-window chunks a later hit can reach
#: (chunks 23..31 here), so the straddling chunk is never stored. 0.21.0 over-counts (288)
#: and the guard drops it.


def test_seed_42945_straddling_store_as_the_worker_gets_it(expected: dict) -> None:
    """No spec that violates ``sum(group_sizes) == len(block_ids)`` reaches the worker."""
    _code, out, _ = replay("seed-42945", GUARD)
    stores = [
        {"group_sizes": s["group_sizes"], "block_indices": s["block_indices"]}
        for s in out["worker"]["store_specs"]
        if s["request_id"] == "agent-a/turn-1"
    ]
    from release_facts import fact

    assert stores == fact("seed42945_turn1_store_specs")


def test_text_progress_is_whole_lines() -> None:
    """Without ``--json`` the progress goes to stderr as whole lines, one per finished
    request, never a ``\\r`` line that the next JSON event line would be glued onto
    (found by a newcomer reading ``make demo``'s output). The progress is kvguard's own
    formatting, the same whatever the release: run on the newest full release only, in
    this process through click's runner (the console script in a fresh process is proven
    by :data:`CONSOLE_SCRIPT_CASE`; CI budget)."""
    if _vllm_version() != "0.34.0":
        pytest.skip(f"the CLI's text progress is kvguard's formatting: run on vLLM 0.34.0 only (CI budget); "
                    f"installed {_vllm_version()}")
    code, _stdout, stderr = run_cli(["replay", "--trace", "seed-48959"])
    assert code == 0, stderr[-3000:]
    assert "\r" not in stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("  replaying: ")]
    finished = [int(ln.split("replaying: ")[1].split("/")[0]) for ln in lines]
    # one line per finished count: strictly increasing, at most the trace's 4 requests
    assert finished and finished == sorted(set(finished)) and finished[-1] <= 4
    # every kvguard event line on stderr is one JSON object on its own line
    events = [ln for ln in stderr.splitlines() if '"logger": "kvguard"' in ln]
    assert events and all(json.loads(ln)["logger"] == "kvguard" for ln in events)
