"""The worker model's job queue and the trace header's ``worker`` object (light: no vLLM)."""

from __future__ import annotations

import json

import pytest

from kvguard.lab.replay.jobs import JobQueue, Latency, WorkerModel, WorkerModelError
from kvguard.lab.replay.trace import TraceError, parse_trace

HEADER = {
    "kind": "header",
    "format": "kvguard-replay/1",
    "name": "t",
    "geometry": {"tokens_per_block": 32, "tokens_per_chunk": 256, "sliding_window": 4096},
}
REQ = {"kind": "request", "id": "a", "prompt": [{"seed": 1, "tokens": 10}], "max_tokens": 2}


def _run(model: WorkerModel, n: int = 40, steps: int = 20) -> list[tuple[int, int, bool]]:
    """Submit ``n`` alternating load/store jobs, one per step; (job id, done step, success)."""
    q = JobQueue(model)
    out = []
    for step in range(steps + n):
        q.step = step
        if step < n:
            q.submit(step, is_store=bool(step % 2), req_id=f"r{step}")
        out += [(j.job_id, j.done_step, j.success) for j in q.finished()]
    return out


def test_default_model_completes_every_job_in_its_step() -> None:
    done = _run(WorkerModel())
    assert done == [(i, i, True) for i in range(40)]


def test_fixed_latency_delays_every_job_by_that_many_steps() -> None:
    done = _run(WorkerModel(load_latency=Latency(3, 3), store_latency=Latency(1, 1)))
    assert {j: s - j for j, s, _ in done} == {j: (1 if j % 2 else 3) for j in range(40)}


def test_random_latency_is_out_of_order_bounded_and_seeded() -> None:
    model = WorkerModel(load_latency=Latency(0, 4), store_latency=Latency(0, 4), seed=7)
    done = _run(model)
    delays = {j: s - j for j, s, _ in done}
    assert set(delays.values()) <= set(range(5)) and len(set(delays.values())) > 1
    order = [j for j, _, _ in done]
    assert order != sorted(order)  # a later job finished before an earlier one
    assert _run(model) == done  # same seed, same completions
    assert _run(WorkerModel(load_latency=Latency(0, 4), store_latency=Latency(0, 4), seed=8)) != done


def test_failures_by_ordinal_and_rate_do_not_move_completion_steps() -> None:
    lat = dict(load_latency=Latency(0, 4), store_latency=Latency(0, 4), seed=7)
    base = _run(WorkerModel(**lat))
    model = WorkerModel.from_json(
        {"load_latency_steps": {"min": 0, "max": 4}, "store_latency_steps": {"min": 0, "max": 4},
         "seed": 7, "fail_store_jobs": [3, 5], "fail_loads": {"rate": 0.5}}
    )
    done = _run(model)
    assert [(j, s) for j, s, _ in done] == [(j, s) for j, s, _ in base]
    failed = {j for j, _, ok in done if not ok}
    # stores are odd job ids here: store ordinals 3 and 5 are job ids 7 and 11
    assert {j for j in failed if j % 2} == {7, 11}
    loads_failed = {j for j in failed if not j % 2}
    assert 0 < len(loads_failed) < 20


def test_hung_job_never_completes_and_wait_names_it() -> None:
    q = JobQueue(WorkerModel.from_json({"hang_store_jobs": [0], "load_latency_steps": 9}))
    store = q.submit(10, is_store=True, req_id="a")
    load = q.submit(11, is_store=False, req_id="b")
    assert store.due_step is None and load.due_step == 9
    q.step = 1
    hung = q.wait({10, 11, 99})  # a flush: the load becomes due now, the store never
    assert [j.job_id for j in hung] == [10]
    assert [j.job_id for j in q.finished()] == [11]
    q.step = 500
    assert q.finished() == [] and [j.job_id for j in q.in_flight("a")] == [10]
    with pytest.raises(ValueError):
        q.submit(10, is_store=True)


def test_trace_header_worker_round_trips() -> None:
    worker = {"load_latency_steps": {"min": 0, "max": 4}, "store_latency_steps": 2,
              "seed": 7, "fail_loads": {"rate": 0.1}, "fail_store_jobs": [3, 5],
              "hang_load_jobs": [0]}
    trace = parse_trace([json.dumps({**HEADER, "worker": worker}), json.dumps(REQ)])
    assert trace.worker.load_latency == Latency(0, 4)
    assert trace.worker.store_latency == Latency(2, 2)
    assert trace.worker.store_faults.jobs == frozenset({3, 5})
    assert trace.worker.load_faults.rate == 0.1 and trace.worker.load_faults.hang_jobs == {0}
    again = parse_trace(trace.dumps().splitlines())
    assert again.worker == trace.worker
    assert json.loads(trace.dumps().splitlines()[0])["worker"] == worker
    plain = parse_trace([json.dumps(HEADER), json.dumps(REQ)])
    assert plain.worker.is_default and "worker" not in json.loads(plain.dumps().splitlines()[0])


@pytest.mark.parametrize(
    "worker",
    [
        {"load_latency_steps": -1},
        {"load_latency_steps": {"min": 3, "max": 1}},
        {"fail_loads": {"rate": 1.5}},
        {"fail_store_jobs": [-1]},
        {"seed": "x"},
        {"tiering": {}},  # unknown fields are refused, never ignored
    ],
)
def test_bad_worker_object_is_a_trace_error(worker: dict) -> None:
    with pytest.raises(TraceError, match="worker"):
        parse_trace([json.dumps({**HEADER, "worker": worker}), json.dumps(REQ)])
    with pytest.raises(WorkerModelError):
        WorkerModel.from_json(worker)


def test_a_failure_follows_the_request_not_the_job_count() -> None:
    """A job another request gains (a promotion the guard withheld, say) does not move a
    drawn failure: request r's n-th load draws the same fate either way."""
    model = WorkerModel.from_json({"fail_loads": {"rate": 0.5}, "seed": 3})

    def fates(extra_jobs: int) -> dict[tuple[str, int], bool]:
        q = JobQueue(model)
        out, job_id = {}, 0
        for n in range(20):
            for req in ("a", "b"):
                if req == "b":
                    for _ in range(extra_jobs):  # other work in between
                        q.submit(job_id, is_store=False, req_id=f"other{job_id}")
                        job_id += 1
                out[(req, n)] = q.submit(job_id, is_store=False, req_id=req).success
                job_id += 1
        return out

    base = fates(0)
    assert fates(1) == base == fates(3)
    assert set(base.values()) == {True, False}  # the rate draws both fates
