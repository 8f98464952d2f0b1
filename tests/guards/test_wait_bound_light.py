"""The wait bound's bookkeeping (guards/checks/wait_bound.py) without vLLM: what counts as progress,
when a wait is stalled (both bounds), and what each policy does. The same decisions on the
real scheduler and connector: tests/vllm/test_wait_bound.py (this file: tests/guards/test_wait_bound_light.py)."""

from __future__ import annotations

import enum

import pytest

from kvguard.guards.policy import degrade, runtime

from kvguard.guards import names

from kvguard.guards.checks import wait_bound


class Status(enum.Enum):  # the shape of vllm.v1.request.RequestStatus
    WAITING = 1
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = 2
    WAITING_FOR_REMOTE_KVS = 3
    RUNNING = 4
    PREEMPTED = 5
    FINISHED_ERROR = 6


class Req:
    def __init__(self, rid: str, status: Status = Status.WAITING) -> None:
        self.request_id = rid
        self.status = status


class ReqStatus:
    def __init__(self) -> None:
        self.transfer_jobs: set[int] = set()


class CS:  # the connector scheduler's fields the wait bound reads
    def __init__(self, *rids: str) -> None:
        self._req_status = {rid: ReqStatus() for rid in rids}


class Scheduler:
    def __init__(self) -> None:
        self.finished_recving_kv_req_ids: set[str] = set()


class Out:
    def __init__(self, tokens: int) -> None:
        self.total_num_scheduled_tokens = tokens


@pytest.fixture(autouse=True)
def bound(monkeypatch):
    wait_bound.configure(steps=4, seconds=0.0)
    wait_bound.reset()
    runtime.configure(policy="guard")
    failed: list[tuple[str, str]] = []
    monkeypatch.setattr(degrade, "fail_waiting", lambda sched, cs, rid, error: failed.append((rid, error)) or True)
    yield failed
    wait_bound.configure()
    runtime.unconfigure()


def test_the_kv_wait_statuses_are_read_off_the_enum():
    assert wait_bound.kv_wait_statuses(Status) == {"WAITING_FOR_REMOTE_KVS"}


def test_a_deferral_is_stalled_after_the_bound_of_observations_without_progress():
    cs, req = CS("r"), Req("r")
    assert wait_bound.observe_deferred(cs, req, 3) is None  # the wait begins
    for _ in range(3):
        assert wait_bound.observe_deferred(cs, req, 3) is None
    stalled = wait_bound.observe_deferred(cs, req, 2)  # 4th without a new high: stalled
    assert stalled is not None and stalled.kind == names.WAIT_LOOKUP_DEFERRED and stalled.stale == 4


def test_a_new_high_of_ready_chunks_is_progress_a_flapping_count_is_not():
    cs, req = CS("r"), Req("r")
    wait_bound.observe_deferred(cs, req, 1)
    for ready in (3, 2, 3, 1):  # 3 is a new high once; then it only flaps below or at it
        wait_bound.observe_deferred(cs, req, ready)
    assert cs.__dict__[wait_bound.TABLE_ATTR].waits["r"].stale == 3
    assert wait_bound.observe_deferred(cs, req, 4) is None
    assert cs.__dict__[wait_bound.TABLE_ATTR].waits["r"].stale == 0


def test_the_seconds_bound_must_pass_too():
    wait_bound.set_bound(seconds=3600.0)
    cs, req = CS("r"), Req("r")
    for _ in range(50):
        assert wait_bound.observe_deferred(cs, req, 0) is None


def test_a_completed_transfer_job_is_progress():
    cs, req = CS("r"), Req("r")
    cs._req_status["r"].transfer_jobs = {1, 2}
    wait_bound.observe_deferred(cs, req, 0)
    for _ in range(3):
        wait_bound.observe_deferred(cs, req, 0)
    cs._req_status["r"].transfer_jobs = {2}
    assert wait_bound.observe_deferred(cs, req, 0) is None
    wait = cs.__dict__[wait_bound.TABLE_ATTR].waits["r"]
    assert wait.kind == names.WAIT_TRANSFERS_IN_FLIGHT and wait.stale == 0


def _stall(cs, req):
    wait_bound.observe_deferred(cs, req, 0)
    for _ in range(3):
        wait_bound.observe_deferred(cs, req, 0)
    return wait_bound.observe_deferred(cs, req, 0)


def test_guard_answers_a_stalled_deferral_with_the_ready_hit():
    cs, req = CS("r"), Req("r")
    assert wait_bound.act_deferred(cs, _stall(cs, req), 128, (None, False)) == (128, True)
    assert wait_bound.act_deferred(cs, _stall(cs, req), 0, (None, False)) == (0, False)
    assert wait_bound.snapshot()[f"{names.WAIT_LOOKUP_DEFERRED}:{names.ACTION_HIT_REDUCED}"] == 2


def test_guard_fails_a_stalled_request_whose_own_transfers_never_report(bound):
    cs, req = CS("r"), Req("r")
    cs._req_status["r"].transfer_jobs = {7}
    answer = (None, False)
    assert wait_bound.act_deferred(cs, _stall(cs, req), 0, answer) is answer
    assert [rid for rid, _ in bound] == ["r"] and names.WAIT_TRANSFERS_IN_FLIGHT in bound[0][1]


def test_observe_counts_once_and_strict_raises():
    runtime.configure(policy="observe")
    cs, req = CS("r"), Req("r")
    answer = (None, False)
    assert wait_bound.act_deferred(cs, _stall(cs, req), 64, answer) is answer
    assert wait_bound.observe_deferred(cs, req, 0) is None  # acted: not again for this wait
    assert wait_bound.snapshot()[f"{names.WAIT_LOOKUP_DEFERRED}:{names.ACTION_CONTINUED}"] == 1
    runtime.configure(policy="strict")
    cs2, req2 = CS("s"), Req("s")
    with pytest.raises(AssertionError, match="lookup_deferred"):
        wait_bound.act_deferred(cs2, _stall(cs2, req2), 0, answer)


def test_an_answer_ends_the_deferral():
    cs, req = CS("r"), Req("r")
    wait_bound.observe_deferred(cs, req, 0)
    wait_bound.answered(cs, "r")
    assert cs.__dict__[wait_bound.TABLE_ATTR].waits == {}


def _step(cs, sched, tokens=0):
    wait_bound.observe_step(cs, Out(tokens), None)


def test_an_async_load_is_watched_from_the_step_it_is_parked(bound):
    cs, sched, req = CS("r"), Scheduler(), Req("r")
    table = cs.__dict__.setdefault(wait_bound.TABLE_ATTR, wait_bound.WaitTable(scheduler=sched, stepped=True))
    wait_bound.admitted_async(cs, req)
    _step(cs, sched)  # still WAITING: not parked yet
    assert table.waits == {} and "r" in table.async_loads
    req.status = Status.WAITING_FOR_REMOTE_KVS
    _step(cs, sched)
    assert table.waits["r"].kind == names.WAIT_LOAD_IN_FLIGHT
    for _ in range(3):
        _step(cs, sched, tokens=512)  # a load in flight counts every step, busy or not
    assert bound == []
    _step(cs, sched)
    assert [rid for rid, _ in bound] == ["r"] and names.WAIT_LOAD_IN_FLIGHT in bound[0][1]
    assert wait_bound.snapshot()[f"{names.WAIT_LOAD_IN_FLIGHT}:{names.ACTION_REQUEST_FAILED}"] == 1


def test_a_reported_load_waits_only_through_steps_that_schedule_nothing(bound):
    cs, sched, req = CS("r"), Scheduler(), Req("r", Status.WAITING_FOR_REMOTE_KVS)
    table = cs.__dict__.setdefault(wait_bound.TABLE_ATTR, wait_bound.WaitTable(scheduler=sched, stepped=True))
    wait_bound.admitted_async(cs, req)
    _step(cs, sched)
    sched.finished_recving_kv_req_ids.add("r")
    _step(cs, sched)  # reported: the kind changes, which is progress
    assert table.waits["r"].kind == names.WAIT_LOAD_NOT_PROMOTED and table.waits["r"].stale == 0
    for _ in range(10):
        _step(cs, sched, tokens=1)  # the engine serves others: the scan will reach it
    assert bound == [] and table.waits["r"].stale == 0
    for _ in range(4):
        _step(cs, sched)
    assert [rid for rid, _ in bound] == ["r"] and names.WAIT_LOAD_NOT_PROMOTED in bound[0][1]
    req.status = Status.WAITING  # promoted: the wait ended
    _step(cs, sched)
    assert table.waits == {}


def test_without_the_step_hook_async_loads_are_not_kept():
    cs = CS("r")
    wait_bound.admitted_async(cs, Req("r"))
    assert cs.__dict__[wait_bound.TABLE_ATTR].async_loads == {}


def test_deferrals_of_requests_vllm_dropped_are_purged():
    cs = CS(*(f"r{i}" for i in range(4)))
    for i in range(40):
        wait_bound.observe_deferred(cs, Req(f"gone{i}"), 0)  # never answered, never stepped
    wait_bound.observe_deferred(cs, Req("r0"), 0)
    assert len(cs.__dict__[wait_bound.TABLE_ATTR].waits) <= 2 * 4 + 16 + 1


def test_switched_off_nothing_is_attached():
    wait_bound.configure(enabled=False)
    cs = CS("r")
    cs.build_connector_meta = lambda out: "meta"
    del cs.__dict__["build_connector_meta"]
    assert wait_bound.attach(cs) is False


# -- blocks_held_by_stores: a lazy store walker's pins (the SimpleCPUOffloadConnector's shape) --
class LazyCS:
    """A connector scheduler with a lazy walker: it pins one more block in every
    ``build_connector_meta`` while its switch is above 0 (never run out of blocks to store)."""

    def __init__(self, target: int = 8) -> None:
        self._target_free = target
        self.pins = 0
        self.walks = 0

    def has_pending_stores(self) -> bool:
        return self.pins > 0

    def _prepare_lazy_store_specs(self):
        free_queue = self.gpu_pool.free_block_queue  # noqa: F841 (the walker's shape)
        if self.gpu_pool is None or self._target_free <= 0:
            return []
        return [1]

    def build_connector_meta(self, scheduler_output):
        if self._target_free > 0:
            self.pins += 1
            self.walks += 1
        return "meta"


class WaitingScheduler:
    """The vLLM ``Scheduler``'s fields the hold reads, calling ``build_connector_meta`` as
    ``schedule()`` does (so the hold finds it one frame up)."""

    def __init__(self, cs, *waiting) -> None:
        self.cs, self.waiting, self.running = cs, list(waiting), []

    def update_from_output(self, *args) -> None:  # pragma: no cover - only its presence is read
        pass

    def schedule(self, tokens: int = 0):
        return self.cs.build_connector_meta(Out(tokens))


def test_the_lazy_walker_switch_is_found_by_shape():
    assert wait_bound.lazy_store_switch(LazyCS) == "_target_free"
    assert wait_bound.lazy_store_switch(CS) is None  # no walker: the hold is not watched


@pytest.mark.parametrize("policy", ["guard", "observe"])
def test_an_idle_engine_whose_stores_hold_blocks_stops_the_walker_after_the_bound(policy):
    runtime.configure(policy=policy)
    cs = LazyCS()
    cs.pins = 1  # a store in flight
    sched = WaitingScheduler(cs, Req("head"))
    assert wait_bound.attach(cs) is True
    for _ in range(5):  # the wait begins, then 4 observations without progress: the bound
        sched.schedule()
    walks = cs.walks
    key = f"{names.WAIT_BLOCKS_HELD_BY_STORES}:"
    for _ in range(3):
        sched.schedule()
    if policy == "guard":
        assert cs.walks == walks  # no new pin while the engine idles
        assert wait_bound.snapshot()[key + names.ACTION_STORES_WITHHELD] == 1
    else:
        assert cs.walks == walks + 3  # observe: counted once, vLLM unchanged
        assert wait_bound.snapshot()[key + names.ACTION_CONTINUED] == 1
    assert cs._target_free == 8  # the switch is vLLM's again after every call
    sched.schedule(tokens=64)  # the engine scheduled: progress, the walker resumes
    assert cs.__dict__[wait_bound.TABLE_ATTR].hold is None
    walks = cs.walks
    sched.schedule()
    assert cs.walks == walks + 1
    wait_bound.detach_all()


def test_strict_raises_on_the_hold_and_no_hold_without_a_waiting_admission():
    runtime.configure(policy="strict")
    cs = LazyCS()
    cs.pins = 1
    sched = WaitingScheduler(cs, Req("parked", Status.WAITING_FOR_REMOTE_KVS))
    wait_bound.attach(cs)
    for _ in range(8):
        sched.schedule()  # the head waits for its KV: its own wait, not this one
    assert cs.__dict__[wait_bound.TABLE_ATTR].hold is None
    sched.waiting = [Req("head")]
    for _ in range(4):
        sched.schedule()
    with pytest.raises(AssertionError, match=names.WAIT_BLOCKS_HELD_BY_STORES):
        sched.schedule()
    wait_bound.detach_all()
