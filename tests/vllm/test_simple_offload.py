"""The SimpleCPUOffloadConnector (``VLLM_USE_SIMPLE_KV_OFFLOAD=1``) under kvguard, on vLLM's
real ``Scheduler`` with the real connector in the scheduler role (no GPU: the worker side
is out of scope, as in production where it runs in the GPU workers).

What is proven here: its scheduler side is in scope on the installed release (every
assert of its scheduler-role code is a metered site, counted from the installed source),
and the vllm#39702 race (a CPU hit found by the lookup is gone when
``update_state_after_alloc`` looks it up again: "Expected N hit tokens, got 0") fails that
request alone under ``guard`` where the installed code has the assert before it takes hold
of any block; ``observe`` keeps vLLM's crash and counts it, ``strict`` raises. The race
is produced at the connector's own boundary: the lookup answers a hit of ``HIT_TOKENS``
while the CPU pool is empty, which is what the second lookup sees after an eviction.
The lab replays and fuzzes this connector too (tests/vllm/test_simple_replay.py, docs/replay.md).
"""

from __future__ import annotations

import ast
import inspect

import pytest

from kvguard.guards.hooking import sites
from kvguard.guards.hooking.rewrite import iter_functions
from kvguard.guards.hooking.vllm_source import installed_package_sources, offload_scope
from kvguard.guards.policy import runtime
from kvguard.guards.telemetry import events
from kvguard.lab.replay import harness, vllm_api
from kvguard.lab.replay.trace import Geometry, GroupGeometry

pytestmark = pytest.mark.vllm

#: one full-attention group, 16-token blocks: a small pool the test can count
GEOMETRY = Geometry(
    tokens_per_block=16, tokens_per_chunk=16, num_gpu_blocks=64, cpu_chunks=64,
    max_num_batched_tokens=2048, max_num_seqs=4, max_model_len=4096,
    groups=(GroupGeometry(kind="full", tokens_per_block=16),),
)
VICTIM, OTHER = "victim", "other"
#: the lookup's promised hit (tokens): 4 blocks of the victim's 100-token prompt
HIT_TOKENS = 64
SIMPLE_MANAGER = f"{sites.SIMPLE_OFFLOAD_PACKAGE}.manager"


def _simple_sites() -> tuple[dict[str, str], list[sites.Site]]:
    """The installed release's SimpleCPUOffloadConnector sources in scope, and their sites."""
    scoped, worker_side = offload_scope(installed_package_sources())
    mine = {m: s for m, s in scoped.items() if sites.connector_of(m) == sites.CONNECTOR_SIMPLE}
    found = [site for m, s in mine.items() for site in sites.discover(m, ast.parse(s), worker_side).sites]
    return mine, found


def _manager_sites() -> list[sites.Site]:
    """The sites of the installed manager's ``update_state_after_alloc``."""
    _, found = _simple_sites()
    return [s for s in found if s.module == SIMPLE_MANAGER and s.qualname.endswith(".update_state_after_alloc")]


def _race_is_request_scoped() -> bool:
    """Whether the #39702 race can reach a request-scoped assert: the installed lookup does
    not pin its hit (vLLM 0.21.0, the release #39702 was reported on; from vllm#42289 on the
    lookup pins it and the race is gone) and ``update_state_after_alloc`` is request-scoped."""
    return not _lookup_pins_its_hit() and any(s.kind == sites.KIND_REQUEST_SCOPE for s in _manager_sites())


def _lookup_pins_its_hit() -> bool:
    """The fix of vllm#42289 in the installed code: the manager's lookup pins (``touch``)
    the blocks of the hit it answers."""
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

    return "touch" in inspect.getsource(SimpleCPUOffloadScheduler.get_num_new_matched_tokens)


def test_every_assert_of_update_state_after_alloc_is_request_scoped_and_gives_back_what_it_holds():
    """On every release each assert of the manager's ``update_state_after_alloc`` fails its
    request alone under guard (none re-raises), and each one that runs while the method
    holds something (the pinned hit it popped, blocks it touched) carries the method's own
    calls that give it back: release calls found in the method's source, or
    ``free_blocks`` on an object the method ``touch``es. Where the lookup pins its hit, the
    asserts after the pop give the pin back (tests/vllm/test_simple_replay.py runs one)."""
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

    found = _manager_sites()
    asserts = [s for s in found if s.kind == sites.KIND_ASSERT]
    assert any(s.kind == sites.KIND_REQUEST_SCOPE for s in found)
    assert asserts and all(s.request_scoped for s in asserts), [(s.lineno, s.fingerprint) for s in asserts]
    source = inspect.getsource(SimpleCPUOffloadScheduler.update_state_after_alloc)
    for site in asserts:
        for release in site.releases:
            obj, call = release.split("(", 1)[0].rsplit(".", 1)
            assert (f"{obj}.{call}(" in source) or (call == "free_blocks" and f"{obj}.touch(" in source), release
    pops = "_pending_cpu_hits.pop(" in source
    assert pops == _lookup_pins_its_hit()
    if pops:
        assert any(r.startswith("self._free_pending_cpu_hit(") for s in asserts for r in s.releases)


def test_every_scheduler_side_assert_of_the_simple_connector_is_a_site():
    """Counted from the installed source: every assert inside a function of the connector's
    scheduler side (its module's scheduler-role functions, its package minus the worker side);
    identical asserts in one function share one site (one series), as for every connector."""
    mine, found = _simple_sites()
    assert SIMPLE_MANAGER in mine and sites.SIMPLE_CONNECTOR_MODULE in mine
    assert not any(m.endswith(".worker") for m in mine)  # the CUDA copy engine stays out
    expected: set[tuple[str, str, str]] = set()
    for module, source in mine.items():
        tree = ast.parse(source)
        attrs = sites.worker_attributes(tree)
        for qualname, func, _ in iter_functions(tree):
            if module == sites.SIMPLE_CONNECTOR_MODULE and sites.worker_role(func, attrs):
                continue
            expected |= {(module, qualname, ast.unparse(n.test)) for n in ast.walk(func) if isinstance(n, ast.Assert)}
    generic = [s for s in found if s.kind == "assert"]
    assert expected and {(s.module, s.qualname) for s in generic} == {(m, q) for m, q, _ in expected}
    assert len(generic) == len(expected)
    assert all(s.check == "scheduler_assert" for s in generic)


@pytest.fixture
def race():
    """A scheduler with the SimpleCPUOffloadConnector whose lookup promises the victim a hit
    the CPU pool does not hold (the state after #39702's eviction); yields a stepper."""

    def start(requests: tuple[str, ...] = (VICTIM, OTHER)) -> tuple[object, object]:
        parts = vllm_api.build_scheduler(GEOMETRY, connector="SimpleCPUOffloadConnector")
        manager = parts.connector_scheduler
        real = manager.get_num_new_matched_tokens

        def lookup(request, num_computed_tokens):
            if request.request_id == VICTIM and num_computed_tokens == 0:
                return HIT_TOKENS, True  # found at lookup, evicted before the second lookup
            return real(request, num_computed_tokens)

        manager.get_num_new_matched_tokens = lookup
        for rid, seed in ((VICTIM, 1), (OTHER, 2)):
            if rid not in requests:
                continue
            prompt = [(seed * 7919 + i) % 30000 + 1 for i in range(100)]
            parts.scheduler.add_request(vllm_api.make_request(parts.block_hasher, rid, prompt, 3))
        return parts, manager

    yield start
    harness.uninstall_guard()


def _step(scheduler) -> tuple[object, object]:
    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    engine_outputs = scheduler.update_from_output(out, vllm_api.model_runner_output(ids, [[7] for _ in ids], {}))
    return out, engine_outputs


def _run(scheduler, steps: int = 8) -> dict:
    """Step until no request is left (at most ``steps``); what finished how, and the pool."""
    finished: dict[str, str] = {}
    for _ in range(steps):
        _, engine_outputs = _step(scheduler)
        for outputs in engine_outputs.values():
            for output in outputs.outputs:
                if output.finish_reason is not None:
                    finished[output.request_id] = str(output.finish_reason).lower()
        if not scheduler.requests:
            break
    return {"finished": finished, "requests_left": len(scheduler.requests),
            "free_blocks": scheduler.kv_cache_manager.block_pool.get_num_free_blocks()}


def test_the_39702_race_crashes_without_the_guard(race):
    harness.uninstall_guard()
    if not _race_is_request_scoped():
        assert _lookup_pins_its_hit()  # vllm#42289: the race cannot happen on this release
        return
    parts, _ = race()
    with pytest.raises(AssertionError, match=f"Expected {HIT_TOKENS} hit tokens, got 0"):
        parts.scheduler.schedule()


@pytest.mark.parametrize("policy", ["observe", "strict"])
def test_observe_and_strict_keep_the_crash_and_count_it(race, policy):
    if not _race_is_request_scoped():
        assert _lookup_pins_its_hit()  # vllm#42289: the race cannot happen on this release
        return
    assert harness.install_guard(policy)
    runtime.reset()
    parts, _ = race()
    with events.capture() as logged, pytest.raises(AssertionError, match="Expected"):
        parts.scheduler.schedule()
    assert runtime.snapshot()["scheduler_assert"]["violations"] == 1
    (failed,) = [e for e in logged if e["event"] == "check_failed"]
    assert failed["action"] == "raised"
    assert failed["site"].startswith("simple_kv_offload.manager:SimpleCPUOffloadScheduler.update_state_after_alloc:")


def test_guard_fails_the_victim_alone_and_frees_its_blocks(race):
    """Under ``guard`` the victim finishes with an error at the next step (vLLM's own
    ``finish_requests``), the other request is served to its length, and every GPU block
    is free again: the victim took hold of nothing and loaded nothing."""
    if not _race_is_request_scoped():
        assert _lookup_pins_its_hit()  # vllm#42289: the race cannot happen on this release
        return
    assert harness.install_guard("guard")
    # control: the other request alone (its eager stores hold its blocks until a worker
    # reports them, and no worker runs here), then the same with the victim's race
    control = _run(race((OTHER,))[0].scheduler)
    runtime.reset()
    with events.capture() as logged:
        raced = _run(race()[0].scheduler)
    assert raced["finished"][VICTIM].endswith("error")
    assert raced["finished"][OTHER] == control["finished"][OTHER] and control["finished"][OTHER].endswith("length")
    assert raced["requests_left"] == control["requests_left"] == 0
    # the victim took hold of no block: the pool ends exactly as without it
    assert raced["free_blocks"] == control["free_blocks"]
    assert runtime.snapshot()["scheduler_assert"]["violations"] == 1
    (failed,) = [e for e in logged if e["event"] == "check_failed"]
    assert failed["action"] == "request_failed"
    assert failed["site"].startswith("simple_kv_offload.manager:SimpleCPUOffloadScheduler.update_state_after_alloc:")


def test_the_instrumentors_report_counts_the_simple_connectors_sites(race):
    """``installed_by_connector`` (the report ``kvguard replay --json`` prints under ``sites``)
    counts, for the SimpleCPUOffloadConnector, every site of its modules imported here."""
    import sys

    from kvguard.guards.hooking.instrumentor import OffloadGuardInstrumentor

    assert harness.install_guard("guard")
    race()  # imports the connector and its manager, as EngineCore does
    _, found = _simple_sites()
    expected = {s.site_id for s in found if s.module in sys.modules}
    report = OffloadGuardInstrumentor().report()
    assert len(expected) > 0
    assert report["installed_by_connector"][sites.CONNECTOR_SIMPLE] == len(expected)
    assert report["installed_by_connector"][sites.CONNECTOR_OFFLOADING] > 0
    assert sum(report["installed_by_connector"].values()) == report["installed"]
