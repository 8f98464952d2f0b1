"""The replay's batch queue: EngineCore.step_with_batch_queue's order (light: no vLLM)."""

from __future__ import annotations

from types import SimpleNamespace

from kvguard.lab.replay.batch_queue import BatchQueue


def _out(n: int, tokens: int = 1) -> SimpleNamespace:
    return SimpleNamespace(name=n, total_num_scheduled_tokens=tokens, num_scheduled_tokens={})


def test_depth_2_processes_each_output_one_step_late_and_drains_in_order() -> None:
    q = BatchQueue(2)
    processed = []
    for n in range(4):
        q.before_schedule(SimpleNamespace(running=[]))
        processed += [so.name for so, _ in q.push(_out(n), f"mo{n}", has_requests=True)]
    # step 0 is processed after step 1 is scheduled, and so on: one output in flight
    assert processed == [0, 1, 2]
    assert q.scheduled_ahead == 3
    assert [so.name for so, _ in q.drain()] == [3] and not q.queue


def test_depth_1_is_the_synchronous_step() -> None:
    q = BatchQueue(1)
    for n in range(3):
        q.before_schedule(SimpleNamespace(running=[]))
        assert [so.name for so, _ in q.push(_out(n), None, has_requests=True)] == [n]
    assert q.scheduled_ahead == 0 and not q.queue


def test_an_empty_step_with_no_requests_does_not_wait() -> None:
    q = BatchQueue(2)
    assert [so.name for so, _ in q.push(_out(0, tokens=0), None, has_requests=False)] == [0]


def test_placeholder_requests_counts_requests_scheduled_with_outputs_in_flight() -> None:
    q = BatchQueue(2)
    running = [SimpleNamespace(request_id="a", num_output_placeholders=1),
               SimpleNamespace(request_id="b", num_output_placeholders=0)]
    seen = q.before_schedule(SimpleNamespace(running=running))
    q.after_schedule(SimpleNamespace(num_scheduled_tokens={"a": 1, "b": 1}), seen)
    assert (q.placeholder_requests, q.max_placeholders) == (1, 1)
