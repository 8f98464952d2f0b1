"""The recompute of a reported, never-promoted load (guards/policy/recompute.py) on stand-in
schedulers shaped like vLLM's, without vLLM: the binding by structure and what the action
changes. On vLLM's real scheduler: tests/vllm/test_wait_bound.py."""

from __future__ import annotations

import enum

from kvguard.guards.policy import recompute


class RequestStatus(enum.Enum):
    WAITING = 1
    WAITING_FOR_REMOTE_KVS = 3
    RUNNING = 4
    PREEMPTED = 5


class Req:
    def __init__(self, rid: str, preemptions: int = 0) -> None:
        self.request_id = rid
        self.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.num_computed_tokens = 96
        self.num_preemptions = preemptions

    def is_finished(self) -> bool:
        return False


class KVManager:
    def __init__(self) -> None:
        self.freed: list[str] = []
        self.cached: list[tuple[str, int]] = []

    def free(self, request) -> None:
        self.freed.append(request.request_id)

    def cache_blocks(self, request, n) -> None:
        self.cached.append((request.request_id, n))


class Scheduler:  # the shape of 0.25.1-0.29.0's Scheduler, as far as the recompute reads it
    def __init__(self) -> None:
        self.kv_cache_manager = KVManager()
        self.finished_recving_kv_req_ids: set[str] = set()
        self.failed_recving_kv_req_ids: set[str] = set()
        self._inflight_prefills: set = set()

    def _update_waiting_for_remote_kv(self, request) -> None:
        if request.request_id in self.failed_recving_kv_req_ids:
            if request.num_computed_tokens:
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            else:
                self.kv_cache_manager.free(request)
            self.failed_recving_kv_req_ids.remove(request.request_id)
        else:
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        self.finished_recving_kv_req_ids.remove(request.request_id)

    def _try_promote_blocked_waiting_request(self, request) -> bool:
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            if request.request_id not in self.finished_recving_kv_req_ids:
                return False
            self._update_waiting_for_remote_kv(request)
            request.status = RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
            return True
        return False

    def _preempt_request(self, request, timestamp) -> None:
        self.kv_cache_manager.free(request)
        self._inflight_prefills.discard(request)
        request.status = RequestStatus.PREEMPTED

    def _free_request(self, request) -> None:
        self._inflight_prefills.discard(request)


class NoFailedPath(Scheduler):
    """A release whose promotion never frees a failed receive's blocks: nothing to bind."""

    def _update_waiting_for_remote_kv(self, request) -> None:
        self.finished_recving_kv_req_ids.remove(request.request_id)


def setup_function() -> None:
    recompute.reset()


def test_a_reported_load_is_freed_and_waits_again_from_scratch():
    sched, req = Scheduler(), Req("r")
    sched.finished_recving_kv_req_ids.add("r")
    sched._inflight_prefills.add(req)
    assert recompute.recompute_reported(sched, req) is True
    assert sched.kv_cache_manager.freed == ["r"] and sched.kv_cache_manager.cached == []
    assert req.status is RequestStatus.WAITING and req.num_computed_tokens == 0
    assert sched.finished_recving_kv_req_ids == set() and sched.failed_recving_kv_req_ids == set()
    assert sched._inflight_prefills == set()  # released as the release's preemption releases it


def test_a_preempted_request_goes_back_preempted():
    sched, req = Scheduler(), Req("r", preemptions=1)
    sched.finished_recving_kv_req_ids.add("r")
    assert recompute.recompute_reported(sched, req) and req.status is RequestStatus.PREEMPTED


def test_nothing_changes_for_a_load_not_reported_or_a_release_without_the_path():
    sched, req = Scheduler(), Req("r")
    assert recompute.recompute_reported(sched, req) is False  # not in finished_recving
    assert req.num_computed_tokens == 96 and sched.kv_cache_manager.freed == []
    other, req2 = NoFailedPath(), Req("s")
    other.finished_recving_kv_req_ids.add("s")
    assert recompute.promoter(other) is None
    assert recompute.recompute_reported(other, req2) is False
    assert req2.num_computed_tokens == 96 and other.failed_recving_kv_req_ids == set()


def test_the_releases_are_read_from_the_preemption_and_the_free():
    assert [m.__self__ for m in recompute.releases(Scheduler())] != []
    assert recompute._release_calls(Scheduler._preempt_request, False) == [("_inflight_prefills", "discard")]
    assert recompute._release_calls(Scheduler._free_request, True) == [("_inflight_prefills", "discard")]


# -- recompute_unloaded: an admission whose load kvguard refused (block_exclusive) ----------

class AdmittingScheduler(Scheduler):
    def __init__(self, *reqs: Req) -> None:
        super().__init__()
        self.requests = {r.request_id: r for r in reqs}



class ConnectorScheduler:
    def __init__(self) -> None:
        self.built: list[object] = []

    def build_connector_meta(self, scheduler_output):
        self.built.append(scheduler_output)
        return "meta"


class Output:
    def __init__(self, scheduled: dict[str, int]) -> None:
        self.num_scheduled_tokens = scheduled


def test_a_refused_admission_is_recomputed_at_the_end_of_its_schedule():
    req = Req("r")
    sched, cs, done = AdmittingScheduler(req), ConnectorScheduler(), []
    assert recompute.recompute_unloaded(sched, cs, req, done.append) is True
    assert done == [] and sched.kv_cache_manager.freed == []  # nothing before vLLM finished the admission
    out = Output({"other": 16})
    assert cs.build_connector_meta(out) == "meta" and cs.built == [out]  # vLLM's own method still runs
    assert done == ["recomputed"]
    assert sched.kv_cache_manager.freed == ["r"] and sched.kv_cache_manager.cached == []  # nothing published
    assert req.status is RequestStatus.WAITING and req.num_computed_tokens == 0
    assert sched.finished_recving_kv_req_ids == set() and sched.failed_recving_kv_req_ids == set()
    cs.build_connector_meta(Output({}))
    assert done == ["recomputed"]  # once


def test_a_refused_admission_scheduled_for_compute_in_the_same_step_kills_the_engine():
    req = Req("r")
    sched, cs, done = AdmittingScheduler(req), ConnectorScheduler(), []
    assert recompute.recompute_unloaded(sched, cs, req, done.append)
    try:
        cs.build_connector_meta(Output({"r": 16}))
    except AssertionError as error:
        assert "scheduled for compute" in str(error)
    else:
        raise AssertionError("a forward on refused blocks must not run")
    assert done == ["raised"] and sched.kv_cache_manager.freed == []


def test_a_release_without_the_failed_receive_path_is_not_registered():
    req = Req("r")
    other = NoFailedPath()
    other.requests = {"r": req}
    assert recompute.can_recompute(other) is False
    assert recompute.recompute_unloaded(other, ConnectorScheduler(), req, lambda a: None) is False
    assert recompute.recompute_unloaded(AdmittingScheduler(req), None, req, lambda a: None) is False


def test_a_recomputed_request_is_answered_no_load_until_it_is_admitted():
    """The retry of a recomputed request computes: a hit is answered (0, False) while it waits
    (else it parks again behind the same head: fuzz seed 0 on 0.21.0, example 140), a lookup
    without a hit passes, another request's hit passes, and once admitted it loads normally."""
    req, other = Req("r"), Req("o")
    sched, cs, done = AdmittingScheduler(req, other), ConnectorScheduler(), []
    assert recompute.without_load(cs, req, (96, True)) == (96, True)  # nothing recomputed yet
    assert recompute.recompute_unloaded(sched, cs, req, done.append)
    cs.build_connector_meta(Output({}))
    assert done == ["recomputed"] and req.status is RequestStatus.WAITING
    assert recompute.without_load(cs, req, (96, True)) == (0, False)
    assert recompute.without_load(cs, req, (64, False)) == (0, False)  # a synchronous hit too
    assert recompute.without_load(cs, req, (None, False)) == (None, False)  # a deferral is the wait bound's
    assert recompute.without_load(cs, other, (96, True)) == (96, True)
    cs.build_connector_meta(Output({}))  # still waiting: still listed
    assert recompute.without_load(cs, req, (32, True)) == (0, False)
    req.status = RequestStatus.RUNNING  # admitted without a load
    cs.build_connector_meta(Output({"r": 32}))
    req.status = RequestStatus.PREEMPTED  # a later preemption looks up as vLLM does
    assert recompute.without_load(cs, req, (96, True)) == (96, True)
    assert recompute.snapshot() == {"marked": 1, "loads_refused": 3}


def test_a_recomputed_request_that_finishes_while_waiting_leaves_the_list():
    req = Req("r")
    sched, cs = AdmittingScheduler(req), ConnectorScheduler()
    recompute.mark_recomputed(cs, sched, "r")
    assert recompute.without_load(cs, req, (16, True)) == (0, False)
    del sched.requests["r"]  # aborted by its client
    cs.build_connector_meta(Output({}))
    assert cs.__dict__[recompute.RECOMPUTE_ATTR] == set()
