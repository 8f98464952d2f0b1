"""A kept admission verdict is sound on the real vLLM manager (issue 21), in each .venvs/vllm-* env.

The admission check reuses its verdict "this load set is loadable" for a request whose
lookup vLLM repeats with the same ``num_computed_tokens`` and the same answer, until the
cache policy may have removed an entry (:mod:`kvguard.guards.checks.tier_removals`). Here, on the
real ``Scheduler`` + ``OffloadingConnector`` of the installed release and its real CPU
manager: a planted prompt, a request whose hit reads it, the verdict kept (the second
check reads nothing: ``reused``), then a chunk of that load set is taken out of the tier
by each way the installed manager has, and the next check must read the tier again and
cut the hit, where the kept verdict would have passed vLLM's answer through:

- a full tier's ``prepare_store`` evicting it (every release);
- ``reset_cache`` (where the manager has one: 0.25+);
- ``complete_store(success=False)`` removes only chunks that are not ready (read in each
  release's ``cpu/manager.py``), so it cannot take a chunk of a loadable verdict: the test
  shows that on the installed manager (the chunk stays, the verdict stays true).

Every chunk of the load set is read (``admission.loadable._FULL``), so whichever chunk the
manager's own policy evicts first is one the check reads.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from guardtools_vllm import offload_status, plant_in_cpu_tier

from kvguard.guards.checks import admission, offload_plan
from kvguard.guards.checks.load_coverage import load_set
from kvguard.lab.replay import harness, vllm_api
from kvguard.lab.replay.trace import Geometry

pytestmark = pytest.mark.vllm

TPB, TPC, WINDOW, CHUNKS = 16, 64, 256, 12
#: room for the planted prompt's chunks of both groups and a few more: a filler store evicts
GEOMETRY = Geometry(tokens_per_block=TPB, tokens_per_chunk=TPC, sliding_window=WINDOW, num_gpu_blocks=4000,
                    cpu_chunks=2 * CHUNKS + 4, max_num_batched_tokens=4096, max_num_seqs=8,
                    max_model_len=16384, vocab_size=32000)


#: the check a lookup answer is given to (set per test by :func:`check_path`)
_CHECK: list[Any] = [admission.admit]


@pytest.fixture(autouse=True, params=["admit", "admit_return"])
def check_path(request):
    """Both ways an answer reaches the check: ``admit`` (the wrapped fallback, the replay's
    driven hits: a kept verdict tested in ``check_hit``) and ``admit_return`` (what vLLM's
    rewritten lookup calls: a kept verdict tested inline, before any other call)."""
    _CHECK[0] = getattr(admission, request.param)
    yield request.param
    _CHECK[0] = admission.admit


def _check(cs: Any, request: Any, num_computed_tokens: int, answer: tuple) -> Any:
    return _CHECK[0](cs, request, num_computed_tokens, answer)


@pytest.fixture(autouse=True)
def every_chunk_read(monkeypatch):
    """Every chunk of a load set read; the guard uninstalled after each test."""
    monkeypatch.setattr(admission.loadable, "_FULL", True)
    yield
    harness.uninstall_guard()


@pytest.fixture()
def engine():
    harness.uninstall_guard()
    assert harness.install_guard("guard")
    return harness.build_engine(GEOMETRY)


def _prompt(seed: int, tokens: int) -> list[int]:
    return [1 + (seed * 7919 + i * 104729) % 31000 for i in range(tokens)]


def _kept_verdict(engine: Any) -> tuple[Any, Any, tuple, list]:
    """Plant a prompt; a request that extends it is answered a hit of the whole planted
    prompt (a driven answer, as the replay's ``external_hit_tokens``: vLLM's own lookup
    would also hold the manager's step lock, which only a scheduler step releases); check
    it twice: ``(cs, request, answer, load-set keys)``; asserts the second check reused
    the verdict."""
    cs = engine.connector_scheduler
    prompt = _prompt(1, CHUNKS * TPC)
    plant_in_cpu_tier(cs, vllm_api.make_request(engine.block_hasher, "plant", prompt, 1))
    request = vllm_api.make_request(engine.block_hasher, "victim", prompt + _prompt(2, TPC), 1)
    status = offload_status(cs, request)
    admission.reset()
    answer = (CHUNKS * TPC, True)
    assert _check(cs, request, 0, answer) is answer
    assert _check(cs, request, 0, answer) is answer
    stats = admission.snapshot()
    assert (stats["evaluated"], stats["reused"], stats["violations"]) == (1, 1, 0), stats
    plan = offload_plan.get_plan(cs)
    keys = [status.group_states[g].offload_keys[c]
            for g, chunks in enumerate(load_set(plan.groups, 0, answer[0])) for c in chunks]
    assert len(keys) > CHUNKS  # both groups: every full-attention chunk and the window's
    return cs, request, answer, keys


def _policy_get(cs: Any) -> Any:
    return offload_plan.get_plan(cs).getter()


def _rechecked_and_cut(cs: Any, request: Any, answer: tuple) -> None:
    before = admission.snapshot()
    reduced = _check(cs, request, 0, answer)
    after = admission.snapshot()
    assert after["evaluated"] == before["evaluated"] + 1, (before, after)  # read the tier again
    assert after["reused"] == before["reused"]
    assert reduced is not answer and reduced[0] < answer[0], (answer, reduced)
    assert after["hit_reduced"] == before["hit_reduced"] + 1


def _evict_by_storing(engine: Any, cs: Any, keys: list) -> None:
    """Store filler prompts in the full tier until the manager's policy evicts a load-set key."""
    get = _policy_get(cs)
    filler = 0
    while all(get(key) is not None for key in keys):
        filler += 1
        assert filler < 20, "the manager never evicted a chunk of the load set"
        plant_in_cpu_tier(cs, vllm_api.make_request(engine.block_hasher, f"filler-{filler}",
                                                    _prompt(100 + filler, 2 * TPC), 1))


def _reset_cache(engine: Any, cs: Any, keys: list) -> None:
    with getattr(cs.manager, "lock", None) or contextlib.nullcontext():
        cs.manager.reset_cache()
    assert all(_policy_get(cs)(key) is None for key in keys)


def test_every_way_the_manager_removes_a_chunk_reruns_the_check():
    """Each removal path the installed manager has, each on a fresh engine: a full tier's
    ``prepare_store`` (every release) and ``reset_cache`` (where the manager has it)."""
    paths = {"prepare_store eviction": _evict_by_storing}
    harness.uninstall_guard()
    built = harness.build_engine(GEOMETRY)
    if callable(getattr(built.connector_scheduler.manager, "reset_cache", None)):
        paths["reset_cache"] = _reset_cache
    for name, remove in paths.items():
        harness.uninstall_guard()
        assert harness.install_guard("guard")
        engine = harness.build_engine(GEOMETRY)
        cs, request, answer, keys = _kept_verdict(engine)
        remove(engine, cs, keys)
        try:
            _rechecked_and_cut(cs, request, answer)
        except AssertionError as error:
            raise AssertionError(f"after {name}: {error}") from None


def test_a_failed_store_cannot_take_a_ready_chunk(engine):
    """``complete_store(success=False)`` of a load-set key: the installed manager keeps the
    ready chunk, so the kept verdict is still true (and the check may reuse it)."""
    cs, request, answer, keys = _kept_verdict(engine)
    status = cs._req_status[request.request_id]
    with getattr(cs.manager, "lock", None) or contextlib.nullcontext():
        cs.manager.complete_store([keys[0]], status.req_context, success=False)
    entry = _policy_get(cs)(keys[0])
    assert entry is not None and entry.is_ready
    assert _check(cs, request, 0, answer) is answer
    assert admission.snapshot()["violations"] == 0


def test_a_different_question_is_checked_again(engine):
    """A verdict is kept for one ``(num_computed_tokens, hit)``: another hit reads the tier."""
    cs, request, answer, _ = _kept_verdict(engine)
    shorter = (answer[0] - TPC, answer[1])
    _check(cs, request, 0, shorter)
    stats = admission.snapshot()
    assert (stats["evaluated"], stats["reused"]) == (2, 1), stats
