"""guards/telemetry/statefile.py: the state-dir format (after client_python's tests/test_multiprocess.py).

A tmp dir per test; pids are injected (``StateDir(pid=...)``) instead of forking.
"""

from __future__ import annotations

import json
import os

import pytest

from kvguard.guards.telemetry.statefile import (
    MAX_MESSAGE_CHARS,
    MAX_RECORD_BYTES,
    FatalRecord,
    StateDir,
    StateFileError,
    parse_fatal_record,
    read_fatal_records,
    write_fatal_record,
)


def record(pid: int, t: float = 1.0, exc: str = "AssertionError", site: str | None = None) -> FatalRecord:
    return FatalRecord(exception=exc, message=f"boom {pid}", site=site, time=t, pid=pid, vllm_version="0.32.0")


def test_round_trip_keeps_every_field(tmp_path):
    state = StateDir(tmp_path).ensure()
    rec = FatalRecord("AssertionError", "bound 129 > 128", "swa_pending_bound", 1700.5, 42, "0.25.1", "running")
    path = write_fatal_record(state, rec)
    assert path == tmp_path / "fatal" / "42-1700500.json"  # <pid>-<unix ms>: a reused pid never overwrites
    assert json.loads(path.read_text()) == {
        "exception": "AssertionError",
        "message": "bound 129 > 128",
        "site": "swa_pending_bound",
        "time": 1700.5,
        "pid": 42,
        "vllm_version": "0.25.1",
        "phase": "running",
        "process": None,
    }
    assert read_fatal_records(state) == ([rec], [])


def test_two_pids_are_two_records_sorted_by_time(tmp_path):
    state = StateDir(tmp_path)
    write_fatal_record(state, record(7, t=20.0))
    write_fatal_record(state, record(5, t=10.0))
    records, errors = read_fatal_records(state)
    assert [r.pid for r in records] == [5, 7]
    assert errors == []


def test_temp_name_uses_the_current_pid_and_is_gone_after_replace(tmp_path):
    pids = iter([111, 222])
    state = StateDir(tmp_path, pid=lambda: next(pids))
    write_fatal_record(state, record(9))
    write_fatal_record(state, record(10))
    assert sorted(p.name for p in (tmp_path / "fatal").iterdir()) == ["10-1000.json", "9-1000.json"]


def test_leftover_temp_file_is_ignored(tmp_path):
    state = StateDir(tmp_path).ensure()
    (state.fatal / ".9.json.tmp.9").write_text('{"exception": ')
    assert read_fatal_records(state) == ([], [])


def test_missing_dir_reads_as_empty(tmp_path):
    assert read_fatal_records(StateDir(tmp_path / "nope")) == ([], [])


@pytest.mark.parametrize(
    "content, why",
    [
        (b'{"exception": "AssertionError", "mess', "not a JSON record"),
        (b"", "not a JSON record"),
        (b"\xff\xfe", "not a JSON record"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"exception": "E", "message": "m", "site": null, "time": 1.0, "pid": 3}', "vllm_version"),
        (b'{"exception": "E", "message": "m", "site": 5, "time": 1.0, "pid": 3, "vllm_version": "x"}', "'site'"),
        (b'{"exception": "E", "message": "m", "site": null, "time": 1.0, "pid": true, "vllm_version": "x"}', "'pid'"),
    ],
)
def test_truncated_or_malformed_record_is_rejected_without_failing_the_read(tmp_path, content, why):
    state = StateDir(tmp_path)
    write_fatal_record(state, record(1))
    (state.fatal / "2.json").write_bytes(content)
    records, errors = read_fatal_records(state)
    assert [r.pid for r in records] == [1]
    assert len(errors) == 1 and str(errors[0]).startswith("2.json: ") and why in str(errors[0])
    assert (errors[0].name, errors[0].reason) == ("2.json", "corrupt")


def test_oversized_record_is_rejected():
    with pytest.raises(StateFileError, match="more than"):
        parse_fatal_record(b" " * (MAX_RECORD_BYTES + 1))


def test_message_is_truncated_and_cause_is_one_line():
    exc = RuntimeError("line one\nline two " + "x" * (2 * MAX_MESSAGE_CHARS))
    rec = FatalRecord.from_exception(exc, site=None, pid=5, vllm_version="v", phase="startup", now=lambda: 3.0)
    assert len(rec.message) == MAX_MESSAGE_CHARS and rec.message.endswith("...")
    assert rec.time == 3.0 and rec.exception == "RuntimeError"
    cause = rec.cause()
    assert "\n" not in cause
    assert cause.startswith("engine fatal during startup: RuntimeError: line one line two x")
    assert cause.endswith("(pid=5)")


def test_cause_names_the_site():
    assert record(8, site="swa_pending_bound").cause() == (
        "engine fatal: AssertionError: boom 8 (site=swa_pending_bound, pid=8)"
    )


def test_wipe_empties_the_dir_but_keeps_it(tmp_path):
    state = StateDir(tmp_path / "s").ensure()
    write_fatal_record(state, record(3))
    (state.metrics / "counter_3.db").write_bytes(b"\0" * 8)
    (state.root / "stray.txt").write_text("x")
    os.symlink(tmp_path, state.root / "link")
    state.wipe()
    assert sorted(p.name for p in state.root.iterdir()) == ["fatal", "metrics"]
    assert list(state.fatal.iterdir()) == [] and list(state.metrics.iterdir()) == []
    assert tmp_path.exists()  # the symlink was removed, not followed


def test_statefile_is_stdlib_only():
    import ast
    import sys
    from pathlib import Path

    import kvguard.guards.telemetry.statefile as mod

    tree = ast.parse(Path(mod.__file__).read_text())
    imported = {
        (n.module or "").split(".")[0] if isinstance(n, ast.ImportFrom) else a.name.split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in (n.names if isinstance(n, ast.Import) else [n])
    }
    assert imported - {"__future__"} <= set(sys.stdlib_module_names), imported


# --- issue 23 item 3: the reader accepts exactly what the writer can write -----------------

from kvguard.guards import names  # noqa: E402
from kvguard.guards.telemetry import statefile  # noqa: E402
from kvguard.guards.telemetry.statefile import (  # noqa: E402
    MAX_CLOCK_STEP,
    MAX_LABEL_CHARS,
    RunRecord,
    exception_label,
    read_run_record,
    write_run_record,
)

NOW = 1_700_000_000.0


def raw_record(**over) -> bytes:
    obj = {"exception": "AssertionError", "message": "m", "site": None, "time": NOW, "pid": 3,
           "vllm_version": "0.33.0", "phase": "running"}
    obj.update(over)
    return json.dumps(obj).encode()


def test_kinds_are_the_sidecar_reason_labels():
    """statefile stays stdlib only, so it spells the reasons out; they must be names'."""
    assert set(statefile.KINDS) <= set(names.SIDECAR_REASONS)
    for attr in dir(statefile):
        if attr.startswith("KIND_"):
            assert getattr(statefile, attr) == getattr(names, "REASON_" + attr[len("KIND_"):]), attr


@pytest.mark.parametrize(
    "over, kind",
    [
        ({"time": 1e300}, "future_time"),
        ({"time": NOW + 86400}, "future_time"),
        ({"time": NOW + MAX_CLOCK_STEP + 0.5}, "future_time"),
        ({"time": float("inf")}, "invalid_field"),  # json.dumps writes Infinity, json.loads reads it
        ({"time": float("nan")}, "invalid_field"),
        ({"time": 10**400}, "invalid_field"),  # an int beyond a float's range
        ({"exception": "E" * 15000}, "oversized_field"),
        ({"exception": "E" * (MAX_LABEL_CHARS + 1)}, "oversized_field"),
        ({"exception": "Assertion Error"}, "invalid_field"),
        ({"exception": "torch.OutOfMemoryError"}, "invalid_field"),
        ({"exception": ""}, "invalid_field"),
        ({"message": "x" * (MAX_MESSAGE_CHARS + 1)}, "oversized_field"),
        ({"vllm_version": "v" * (MAX_LABEL_CHARS + 1)}, "oversized_field"),
    ],
)
def test_a_record_the_writer_never_writes_is_rejected_with_its_reason(over, kind):
    with pytest.raises(StateFileError) as info:
        parse_fatal_record(raw_record(**over), now=NOW)
    assert info.value.kind == kind


@pytest.mark.parametrize("raw", [b"[" * 16000, b'{"pid": ' + b"1" * 5000 + b"}"])
def test_json_that_python_refuses_is_corrupt_not_an_escaped_error(raw):
    """A record nested 16000 deep raises RecursionError and a 5000-digit int ValueError
    (Python's int limit): neither may escape the reader."""
    with pytest.raises(StateFileError) as info:
        parse_fatal_record(raw, now=NOW)
    assert info.value.kind == "corrupt"


def test_the_bounds_themselves_are_accepted():
    rec = parse_fatal_record(
        raw_record(time=NOW + MAX_CLOCK_STEP, exception="E" * MAX_LABEL_CHARS, message="x" * MAX_MESSAGE_CHARS,
                   vllm_version="v" * MAX_LABEL_CHARS),
        now=NOW,
    )
    assert (rec.time, len(rec.exception), len(rec.message), len(rec.vllm_version)) == (
        NOW + MAX_CLOCK_STEP, MAX_LABEL_CHARS, MAX_MESSAGE_CHARS, MAX_LABEL_CHARS,
    )
    assert parse_fatal_record(raw_record(time=1e300)).time == 1e300  # without a clock: not checked


def test_the_writer_clamps_to_what_the_reader_accepts():
    long_name = type("E" * 150, (Exception,), {})
    odd_name = type("3 bad-name!", (Exception,), {})
    for exc, expect in ((long_name("m"), "E" * MAX_LABEL_CHARS), (odd_name("m"), "_3_bad_name_")):
        rec = FatalRecord.from_exception(exc, site=None, pid=1, vllm_version="v" * 150, now=lambda: NOW)
        assert rec.exception == expect
        assert len(rec.vllm_version) == MAX_LABEL_CHARS
        from dataclasses import asdict

        assert parse_fatal_record(json.dumps(asdict(rec)).encode(), now=NOW) == rec
    assert exception_label("OutOfMemoryError") == "OutOfMemoryError"


def test_read_fatal_records_rejects_a_future_record_by_the_given_clock(tmp_path):
    state = StateDir(tmp_path).ensure()
    write_fatal_record(state, record(1, t=NOW))
    (state.fatal / "2-1.json").write_bytes(raw_record(time=NOW + 86400))
    records, errors = read_fatal_records(state, now=lambda: NOW)
    assert [r.pid for r in records] == [1]
    assert [(e.name, e.reason) for e in errors] == [("2-1.json", "future_time")]
    assert str(errors[0]) == "2-1.json: recorded 86400 s in the future (more than 60 s)"


def test_kvguard_run_prunes_a_future_record_at_its_start(tmp_path):
    """prune_fatal keeps the newest good records; a record from the future is not one."""
    state = StateDir(tmp_path).ensure()
    write_fatal_record(state, record(1, t=NOW))
    (state.fatal / "2-9.json").write_bytes(raw_record(time=1e300))
    removed = state.prune_fatal()
    assert [p.name for p in removed] == ["2-9.json"]
    assert sorted(p.name for p in state.fatal.iterdir()) == [f"1-{int(NOW * 1000)}.json"]


@pytest.mark.parametrize(
    "started, kind",
    [(1e300, "future_time"), (NOW + 86400, "future_time"), (float("nan"), "invalid_field"), (float("inf"), "invalid_field")],
)
def test_a_run_record_from_the_future_is_rejected(tmp_path, started, kind):
    """A run.json started in the future made every fatal record of this start look older."""
    state = StateDir(tmp_path)
    write_run_record(state, RunRecord(started=started, state="running", pid=1))
    with pytest.raises(StateFileError) as info:
        read_run_record(state, now=lambda: NOW)
    assert info.value.kind == kind


def test_a_deeply_nested_run_record_is_corrupt(tmp_path):
    (tmp_path / "run.json").write_text("[" * 4000)
    with pytest.raises(StateFileError) as info:
        read_run_record(StateDir(tmp_path))
    assert info.value.kind == "corrupt"


# -- issue 23: the process that wrote a record, and the processes kvguard run watches ----

def test_a_record_names_its_vllm_process(tmp_path):
    state = StateDir(tmp_path).ensure()
    rec = FatalRecord.from_exception(AssertionError("x"), site=None, pid=5, vllm_version="0.32.0",
                                     now=lambda: NOW, process="EngineCore_DP1")
    write_fatal_record(state, rec)
    [got], errors = read_fatal_records(state, now=lambda: NOW)
    assert errors == [] and got.process == "EngineCore_DP1"
    assert got.cause() == "engine fatal: AssertionError: x (pid=5, process=EngineCore_DP1)"
    # a name the writer could not have given is dropped, never written
    for bad in ("", "a b", "VLLM::EngineCore", "x" * 101, 7):
        assert FatalRecord.from_exception(AssertionError(), site=None, pid=5, vllm_version="v", process=bad).process is None


@pytest.mark.parametrize("process, kind", [
    ("Engine Core", "invalid_field"), (7, "invalid_field"), ("", "invalid_field"), ("x" * 101, "oversized_field"),
])
def test_a_record_whose_process_the_plugin_could_not_have_written_is_rejected(process, kind):
    with pytest.raises(StateFileError) as info:
        parse_fatal_record(raw_record(process=process), now=NOW)
    assert info.value.kind == kind
    assert parse_fatal_record(raw_record(process=None), now=NOW).process is None
    assert parse_fatal_record(raw_record(), now=NOW).process is None  # records of earlier kvguard releases


def test_own_process_name_in_a_process_titled_by_vllm(tmp_path):
    import subprocess
    import sys

    import sysconfig

    # argv[0] is the title, so Python cannot find its environment from it: add its site dir
    site_dir = sysconfig.get_paths()["purelib"]
    code = (f"import site; site.addsitedir({site_dir!r}); from kvguard.guards.telemetry.statefile import own_process_name as n; "
            "print(n(), n({'VLLM_PROCESS_NAME_PREFIX': 'X'}))")
    out = subprocess.run(["bash", "-c", 'exec -a VLLM::EngineCore_DP1 "$0" -c "$1"', sys.executable, code],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.split() == ["EngineCore_DP1", "None"]
    assert statefile.own_process_name() is None  # pytest's own title is no vLLM title


def test_run_record_death_and_parts_round_trip(tmp_path):
    state = StateDir(tmp_path)
    parts = ({"name": "EngineCore_DP0", "pid": 865, "parent": None}, {"name": "Worker", "pid": 1191, "parent": "EngineCore_DP0"})
    rec = RunRecord(started=NOW, state="running", pid=1, child_pid=2, death="vLLM process EngineCore_DP1 (pid 866) died",
                    parts=parts)
    write_run_record(state, rec)
    assert read_run_record(state, now=lambda: NOW) == rec
    write_run_record(state, RunRecord(started=NOW, state="running", pid=1))
    old = json.loads((tmp_path / "run.json").read_text())
    del old["parts"], old["death"]  # run.json of an earlier kvguard release
    (tmp_path / "run.json").write_text(json.dumps(old))
    assert read_run_record(state, now=lambda: NOW) == RunRecord(started=NOW, state="running", pid=1)


@pytest.mark.parametrize("over, kind", [
    ({"death": 7}, "invalid_field"),
    ({"death": "d" * 2001}, "oversized_field"),
    ({"parts": {}}, "invalid_field"),
    ({"parts": [{"name": "EngineCore", "pid": 1}]}, "invalid_field"),
    ({"parts": [{"name": "Engine Core", "pid": 1, "parent": None}]}, "invalid_field"),
    ({"parts": [{"name": "EngineCore", "pid": True, "parent": None}]}, "invalid_field"),
    ({"parts": [{"name": "EngineCore", "pid": 0, "parent": None}]}, "invalid_field"),
    ({"parts": [{"name": "Worker", "pid": 3, "parent": "a/b"}]}, "invalid_field"),
    ({"parts": [{"name": "Worker", "pid": n, "parent": None} for n in range(1, 258)]}, "oversized_field"),
])
def test_a_run_record_the_supervisor_could_not_have_written_is_rejected(tmp_path, over, kind):
    obj = {"started": NOW, "state": "running", "pid": 1, "child_pid": 2, "stop_requested": False,
           "exit_status": None, **over}
    (tmp_path / "run.json").write_text(json.dumps(obj))
    with pytest.raises(StateFileError) as info:
        read_run_record(StateDir(tmp_path), now=lambda: NOW)
    assert info.value.kind == kind
