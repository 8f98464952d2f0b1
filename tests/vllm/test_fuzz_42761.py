"""The fuzzer's second 0.21.0 crash class is vLLM's own bug #42761, not the simulated worker's.

``traces/fuzz-keyerror-42761.jsonl`` is the minimal trace ``kvguard fuzz --no-guard --seed 0
--examples 300 --immediate-worker`` found and shrank on vLLM 0.21.0 (3 requests; window 36
tokens, GPU block 4 tokens, chunk 64 tokens, 426 GPU blocks). The sequence (docs/fuzz.md):
``agent-1/evictor-1`` (918 prompt tokens) prefills 255 tokens a step; a chunk that straddles
two steps has its first GPU blocks computed in the earlier step, and by the next step's
allocation the window has freed them (``remove_skipped_blocks``) and the allocator handed
them to later positions of the same request. vLLM 0.21.0's connector keeps its own copy of
the request's block ids (``RequestGroupState.block_ids``, extended from each step's
``new_block_ids``, never told about the freeing), so the store job it builds for the
finished chunks lists those ids twice in its sliding-window block ids; ``_build_store_jobs``
registers each (block, job) pair once in the set-valued ``_block_id_to_pending_jobs``, and
the job's completion removes it twice: ``KeyError`` in ``_remove_pending_job`` via
``update_connector_output``. Public: vLLM #42761 (the same ``KeyError`` on 0.21.0), fixed by
PR #42959 ("Prevent offloading stale sliding window blocks": 0.25.1 and 0.33.0 zero the stale
ids before building a store).

What is simulated plays no part: the worker reports each job exactly once, successfully, in
submission order, which is what vLLM 0.21.0's CPU<->GPU handler does
(``SingleDirectionOffloadingHandler``: each transfer waits for the previous one's end event,
``get_finished`` pops them in order, always ``success=True``); the duplicate ids are in the
job when the real scheduler-role connector builds it, before any worker sees it.

Measured (release fact ``keyerror_42761_dies``, tests/vllm/release_facts.csv): 0.21.0 dies;
0.25.1, 0.26.0, 0.29.0, 0.33.0 and 0.34.0 finish all 3 requests. On every release the law is
checked too: the engine dies exactly when a store job lists a window block id twice.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from kvguard.lab.fuzz import runner
from release_facts import fact
from kvguard.lab.replay.trace import load_trace

pytestmark = pytest.mark.vllm

TRACE = Path(__file__).parent / "traces" / "fuzz-keyerror-42761.jsonl"
CLASS = (
    "KeyError in vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py:"
    "OffloadingConnectorScheduler._remove_pending_job via OffloadingConnectorScheduler.update_connector_output"
)


def _sliding_window_groups(scheduler) -> list[int]:
    return [
        i for i, g in enumerate(scheduler.kv_cache_config.kv_cache_groups)
        if getattr(g.kv_cache_spec, "sliding_window", None)
    ]


def _duplicated(ids: list[int]) -> set[int]:
    """Block ids listed more than once."""
    return {b for b, n in Counter(ids).items() if n > 1}


@pytest.fixture(scope="module")
def replay():
    outcome, result = runner.run_example(load_trace(str(TRACE)), guard=False)
    return outcome, result


def test_the_store_job_lists_stale_window_block_ids_twice_exactly_where_vllm_dies(replay):
    outcome, result = replay
    worker = result.worker
    (sw,) = _sliding_window_groups(worker.scheduler)
    # store specs as vLLM's worker-role connector received them from the real scheduler
    dup_jobs = {
        rec.job_id: _duplicated(rec.group_block_ids(sw)) for rec in worker.stores
        if _duplicated(rec.group_block_ids(sw))
    }
    # on any release: the engine dies exactly when a store lists a window block id twice
    assert (not result.engine_survived) == bool(dup_jobs), (result.error, dup_jobs)
    dies = bool(fact("keyerror_42761_dies"))  # measured with this trace, --no-guard
    assert bool(dup_jobs) == dies
    if dies:
        assert CLASS in outcome.classes
        assert result.error.startswith("KeyError: ")
        key = int(result.error.split(": ", 1)[1])
        assert any(key in d for d in dup_jobs.values()), (key, dup_jobs)
        assert "offloading/scheduler.py:" in result.error_site and result.error_site.endswith("in _remove_pending_job")
        assert runner.known_issue(CLASS, result.error).startswith("vLLM #42761")
        # the job whose completion raised was reported once, as the real handler reports it
        assert any(j.job_id in dup_jobs for j in worker.queue.completed)
        assert result.finished == 2 and result.submitted == 3  # the evictor's last store kills it
    else:
        assert result.finished == result.submitted == 3 and not result.stalled
        assert result.wrong_kv_blocks == 0
        assert worker.stores  # the window chunks are still stored, without the stale ids


def test_the_worker_reports_what_vllms_cpu_gpu_handler_can(replay):
    """Each job once, successfully, in submission order per direction (the real 0.21.0
    handler serializes its transfers), and only jobs the scheduler issued."""
    _, result = replay
    worker = result.worker
    done = worker.queue.completed
    ids = [j.job_id for j in done]
    assert ids and len(ids) == len(set(ids))
    assert all(j.success for j in done)
    issued = {r.job_id for r in worker.stores} | {r.job_id for r in worker.loads}
    assert set(ids) <= issued
    for is_store in (True, False):
        order = [j.job_id for j in done if j.is_store is is_store]
        submitted = sorted((j for j in done if j.is_store is is_store), key=lambda j: (j.submit_step, j.ordinal))
        assert order == [j.job_id for j in submitted]
