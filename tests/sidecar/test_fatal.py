"""guards/policy/fatal.py against the real ``vllm.v1.engine.core`` (runs in the vLLM envs).

The hooked methods are called the way ``EngineCoreProc.run_engine_core`` calls them,
with a stand-in ``self`` that has only what the real method body touches.
"""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import pytest

from kvguard.guards.telemetry.statefile import StateDir, read_fatal_records
from kvguard.sidecar.collector import StateDirCollector

pytestmark = pytest.mark.vllm


@pytest.fixture
def recorder(tmp_path):
    from kvguard.guards.policy import fatal
    from kvguard.guards.settings import GuardSettings

    assert fatal.install(GuardSettings(state_dir=tmp_path)) is True
    assert fatal.install(GuardSettings(state_dir=tmp_path)) is True  # idempotent
    yield StateDir(tmp_path)
    fatal.uninstall()


def fatal_counts(state: StateDir) -> dict[str, float]:
    return {
        s.labels["exception"]: s.value
        for fam in StateDirCollector(state.metrics).collect()
        for s in fam.samples
        if s.name == "kvguard_engine_fatal_total"
    }


def test_send_engine_dead_records_the_busy_loop_exception(recorder):
    from vllm.v1.engine.core import EngineCoreProc

    import wrapt

    assert isinstance(EngineCoreProc.__dict__["_send_engine_dead"], wrapt.FunctionWrapper)
    done = threading.Thread(target=lambda: None)
    done.start()
    done.join()
    engine = SimpleNamespace(output_queue=queue.Queue(), output_thread=done)
    try:
        raise AssertionError("pending 129 > 128")
    except AssertionError:
        EngineCoreProc._send_engine_dead(engine)
    # vLLM's own method still ran: the dead signal was queued.
    assert engine.output_queue.get_nowait() == EngineCoreProc.ENGINE_CORE_DEAD
    records, errors = read_fatal_records(recorder)
    assert errors == [] and len(records) == 1
    rec = records[0]
    assert (rec.exception, rec.message, rec.site, rec.phase) == ("AssertionError", "pending 129 > 128", None, "running")
    assert rec.vllm_version not in ("", "unknown")
    assert fatal_counts(recorder) == {"AssertionError": 1.0}

    try:  # a second death in the same process is not recorded twice
        raise RuntimeError("again")
    except RuntimeError:
        EngineCoreProc._send_engine_dead(engine)
    assert [r.exception for r in read_fatal_records(recorder)[0]] == ["AssertionError"]


def test_startup_failure_is_recorded_and_reraised_unchanged(recorder):
    from vllm.v1.engine.core import EngineCore

    with pytest.raises(AttributeError) as info:
        EngineCore._initialize_kv_caches(SimpleNamespace(), None)
    records, _ = read_fatal_records(recorder)
    assert [(r.exception, r.phase) for r in records] == [("AttributeError", "startup")]
    assert records[0].message == str(info.value)


def test_no_exception_no_record(recorder):
    from vllm.v1.engine.core import EngineCoreProc

    done = threading.Thread(target=lambda: None)
    done.start()
    done.join()
    EngineCoreProc._send_engine_dead(SimpleNamespace(output_queue=queue.Queue(), output_thread=done))
    assert read_fatal_records(recorder) == ([], [])


def test_uninstall_restores_vllm(recorder):
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    from kvguard.guards.policy import fatal

    import wrapt

    assert isinstance(EngineCore.__dict__["_initialize_kv_caches"], wrapt.FunctionWrapper)
    fatal.uninstall()
    assert not isinstance(EngineCoreProc.__dict__["_send_engine_dead"], wrapt.ObjectProxy)
    assert not isinstance(EngineCore.__dict__["_initialize_kv_caches"], wrapt.ObjectProxy)
