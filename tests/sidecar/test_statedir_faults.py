"""Faults planted in the state dir, against a real ``kvguard sidecar`` process on loopback
(issue 12 rows 3, 4, 5, 7, 8). Each test asserts what the sidecar answered; on the code
before issue 12 each of them failed (a hang, a timeout, an unbounded read, an unreadable
file served as nothing)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import httpx
import psutil
import pytest
from sidecartools import busy_wait, free_port, samples

from kvguard.guards.telemetry.statefile import FatalRecord, StateDir, write_fatal_record

WRITER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    os.umask(0o077)  # the strictest umask a vLLM image might run with
    from kvguard.guards.telemetry.metrics import GuardMetrics
    from kvguard.guards.telemetry.statefile import FatalRecord, StateDir, write_fatal_record
    root = Path(sys.argv[1])
    m = GuardMetrics(root)
    for _ in range(int(sys.argv[2])):
        m.violation("swa_pending_bound", "raised")
    write_fatal_record(StateDir(root).ensure(), FatalRecord("AssertionError", "pending 129 > 128",
                       "swa_pending_bound", time.time(), os.getpid(), "0.25.1", "running"))
    """
)


def plugin_writes(root: Path, violations: int = 1) -> None:
    """Run the plugin's own writers (GuardMetrics, write_fatal_record) in a fresh process."""
    subprocess.run([sys.executable, "-c", WRITER, str(root), str(violations)], check=True)


VIOLATION = ("kvguard_invariant_violations_total", (("action", "raised"), ("check", "swa_pending_bound")))


@pytest.fixture
def shared_dir():
    """A state dir another user can reach (pytest's tmp_path is 0700, root's)."""
    d = Path(tempfile.mkdtemp(prefix="kvguard-state-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def status(side) -> dict:
    r = side.get("/status")
    assert r.status_code == 200, r.text
    return r.json()


def unreadable(side) -> list[tuple[str, str, str, str]]:
    return [(u["source"], u["path"], u["reason"], u["detail"]) for u in status(side)["unreadable"]]


def series(name: str, source: str, reason: str) -> tuple[str, tuple]:
    """The ``samples()`` key of ``name{source, reason}``."""
    return (name, (("reason", reason), ("source", source)))


# --- row 8: FIFOs, links to devices ------------------------------------------------------


def test_a_fifo_db_never_hangs_metrics_status_or_shutdown(fake_vllm, sidecar_proc, shared_dir):
    plugin_writes(shared_dir, violations=2)
    os.mkfifo(shared_dir / "metrics" / "counter_666-1.db")
    side = sidecar_proc(fake_vllm.url, shared_dir)
    r = side.get("/metrics", timeout=5)
    assert r.status_code == 200, r.text
    m = samples(r.text)
    assert m[VIOLATION] == 2.0  # the real file is still merged
    assert m[series("kvguard_sidecar_unreadable", "metrics_file", "not_regular")] == 1.0
    assert unreadable(side) == [("metrics_file", "counter_666-1.db", "not_regular", "not a regular file (fifo)")]
    code, out = side.stop()
    assert code == 0, out  # row 9: a SIGTERM'd sidecar exits 0, and nothing blocked shutdown


def test_a_fifo_json_never_freezes_the_probes(fake_vllm, sidecar_proc, shared_dir):
    StateDir(shared_dir).ensure()
    os.mkfifo(shared_dir / "fatal" / "9-9000.json")
    side = sidecar_proc(fake_vllm.url, shared_dir)
    for _ in range(20):
        assert side.get("/livez", timeout=2).status_code == 200
    assert unreadable(side) == [("fatal_record", "9-9000.json", "not_regular", "not a regular file (fifo)")]


def test_a_record_linked_to_dev_zero_is_not_followed(fake_vllm, sidecar_proc, shared_dir):
    StateDir(shared_dir).ensure()
    os.symlink("/dev/zero", shared_dir / "fatal" / "x.json")
    side = sidecar_proc(fake_vllm.url, shared_dir)
    polls = status(side)["engine"]["polls"]
    busy_wait(lambda: status(side)["engine"]["polls"] >= polls + 20)
    assert psutil.Process(side.proc.pid).memory_info().rss < 200 * 2**20
    assert unreadable(side) == [("fatal_record", "x.json", "not_regular", "a symlink (not followed)")]
    assert side.get("/livez", timeout=2).status_code == 200


def test_a_50_mb_junk_record_is_rejected_without_being_read(fake_vllm, sidecar_proc, shared_dir):
    """Row 4: the poller used to read the whole file every 0.2 s in the event loop."""
    StateDir(shared_dir).ensure()
    (shared_dir / "fatal" / "junk.json").write_bytes(b"x" * (50 * 2**20))
    side = sidecar_proc(fake_vllm.url, shared_dir)
    proc = psutil.Process(side.proc.pid)
    polls = status(side)["engine"]["polls"]
    before = proc.io_counters().read_chars
    busy_wait(lambda: status(side)["engine"]["polls"] >= polls + 20)
    read = proc.io_counters().read_chars - before
    assert read < 5 * 2**20, f"the sidecar read {read} bytes in 20 polls"
    assert unreadable(side) == [("fatal_record", "junk.json", "too_large", "52428800 bytes, more than 16384")]


# --- row 7: one meaning for every error count -------------------------------------------


def read_again(side, times: int) -> None:
    """Make the sidecar read its metrics dir ``times`` more times (scrapes within
    METRICS_MAX_AGE reuse a read, so wait for each new one)."""
    for _ in range(times):
        n = status(side)["metrics_reads"]
        busy_wait(lambda: side.get("/metrics").status_code == 200 and status(side)["metrics_reads"] > n)


def test_each_problem_counts_once_and_a_file_being_created_is_no_error(fake_vllm, sidecar_proc, shared_dir):
    side = sidecar_proc(fake_vllm.url, shared_dir / "not-yet", "--metrics-dir-grace", "0")
    read_again(side, 3)
    m = samples(side.get("/metrics").text)
    assert m[series("kvguard_sidecar_errors_total", "metrics_dir", "missing")] == 1.0
    assert m[series("kvguard_sidecar_unreadable", "metrics_dir", "missing")] == 1.0
    side.kill()

    state = StateDir(shared_dir).ensure()
    (state.metrics / "counter_5-1.db").write_bytes(b"")  # MmapedDict between open and truncate
    (state.metrics / "counter_6-1.db").write_bytes(b"\0" * 65536)  # truncated, header not yet set
    (state.metrics / "counter_7-1.db").write_bytes(b"\xff" * 64)  # corrupt
    (state.fatal / "3-3000.json").write_text('{"exception": "Assert')  # torn
    side = sidecar_proc(fake_vllm.url, shared_dir)
    polls = status(side)["engine"]["polls"]
    busy_wait(lambda: status(side)["engine"]["polls"] >= polls + 10)  # the fatal dir read 10+ times
    read_again(side, 3)
    m = samples(side.get("/metrics").text)
    errors = {src: m[series("kvguard_sidecar_errors_total", src, "corrupt")] for src in ("metrics_file", "fatal_record")}
    assert errors == {"metrics_file": 1.0, "fatal_record": 1.0}
    assert m[series("kvguard_sidecar_errors_total", "metrics_dir", "missing")] == 0.0
    assert status(side)["errors"]["metrics_file"] == 1
    (state.metrics / "counter_7-1.db").unlink()  # gone: no longer unreadable; counts stay
    unread = series("kvguard_sidecar_unreadable", "metrics_file", "corrupt")
    m = busy_wait(lambda: (lambda m: m if m[unread] == 0.0 else None)(samples(side.get("/metrics").text)))
    assert m[series("kvguard_sidecar_errors_total", "metrics_file", "corrupt")] == 1.0


# --- row 3: permissions by design ---------------------------------------------------------


VLLM_UID = 1000  # the files' owner; the sidecar is "another user" to them


def hand_over(root: Path) -> None:
    """chown the state dir to VLLM_UID (as root), keeping the modes the writer set."""
    if os.geteuid() != 0:  # pragma: no cover - non-root CI: the files are already ours
        return
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
            mode = os.lstat(name).st_mode & 0o7777
            os.lchown(name, VLLM_UID, VLLM_UID)
            if not os.path.islink(name):
                os.chmod(name, mode)  # chown clears setgid on some file systems


def test_plugin_files_are_readable_by_another_user_whatever_the_umask(fake_vllm, sidecar_proc, shared_dir):
    """As deploy/k8s runs it: vLLM writes (here with umask 077), the sidecar reads as
    another user. As root the files are handed to uid 1000 and the sidecar runs without
    the capabilities that bypass file modes; without root only the modes are checked."""
    plugin_writes(shared_dir, violations=3)
    st = StateDir(shared_dir)
    for d in (st.metrics, st.fatal):
        assert d.stat().st_mode & 0o7777 == 0o2775, d
    files = list(st.metrics.iterdir()) + list(st.fatal.iterdir())
    assert files and {f.stat().st_mode & 0o777 for f in files} == {0o644}
    hand_over(shared_dir)
    side = sidecar_proc(fake_vllm.url, shared_dir, foreign=True)
    m = samples(side.get("/metrics").text)
    assert m[VIOLATION] == 3.0
    body = status(side)
    assert body["last_fatal"]["exception"] == "AssertionError"
    assert body["blind"] is False and body["unreadable"] == []


@pytest.mark.parametrize("fault", ["metrics_unreadable", "fatal_unreadable", "fatal_is_a_file"])
def test_what_the_sidecar_cannot_read_is_counted_shown_and_flagged(fake_vllm, sidecar_proc, shared_dir, fault):
    plugin_writes(shared_dir)
    st = StateDir(shared_dir)
    if fault == "metrics_unreadable":
        os.chmod(st.metrics, 0o700)
        expect = ("metrics_dir", "metrics/", "permission_denied", "PermissionError: Permission denied")
    elif fault == "fatal_unreadable":
        os.chmod(st.fatal, 0o700)
        expect = ("fatal_dir", "fatal/", "permission_denied", "PermissionError: Permission denied")
    else:
        shutil.rmtree(st.fatal)
        st.fatal.write_text("not a directory")
        os.chmod(st.fatal, 0o644)
        expect = ("fatal_dir", "fatal/", "not_a_directory", "NotADirectoryError: Not a directory")
    hand_over(shared_dir)
    if os.geteuid() != 0 and fault != "fatal_is_a_file":  # pragma: no cover - non-root CI
        os.chmod(st.metrics if fault == "metrics_unreadable" else st.fatal, 0o000)
    side = sidecar_proc(fake_vllm.url, shared_dir, foreign=True)
    side.get("/metrics")
    busy_wait(lambda: expect in unreadable(side))
    body = status(side)
    assert body["blind"] is True
    assert unreadable(side) == [expect]
    m = samples(side.get("/metrics").text)
    assert m[series("kvguard_sidecar_unreadable", expect[0], expect[2])] == 1.0
    assert m[series("kvguard_sidecar_errors_total", expect[0], expect[2])] == 1.0


# --- rows 4 and 5: probes never wait on metrics; one scrape shared ------------------------


@pytest.fixture
def served_app(fake_vllm, tmp_path, monkeypatch):
    """create_app over real loopback HTTP (uvicorn in a thread), with the state-dir read
    of /metrics held on an Event so a scrape can be kept in flight."""
    import uvicorn

    import kvguard.sidecar.app as app_mod
    from kvguard.sidecar.config import SidecarConfig

    StateDir(tmp_path).ensure()
    gate = threading.Event()
    calls: list[int] = []
    real = app_mod.read_metrics_dir

    def held(path, *args):
        calls.append(1)
        gate.wait(30)
        return real(path, *args)

    monkeypatch.setattr(app_mod, "read_metrics_dir", held)
    port = free_port()
    cfg = SidecarConfig(vllm_url=fake_vllm.url, state_dir=tmp_path, poll_interval=0.05, host="127.0.0.1", port=port)
    app = app_mod.create_app(cfg)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    busy_wait(lambda: _code(base + "/livez") == 200, timeout=20)
    yield base, app, gate, calls
    gate.set()
    server.should_exit = True
    thread.join(10)


def _code(url: str, timeout: float = 2.0) -> int:
    try:
        return httpx.get(url, timeout=timeout).status_code
    except httpx.HTTPError:
        return 0


def test_probes_answer_while_50_scrapes_wait_on_the_state_dir(served_app):
    base, app, gate, calls = served_app
    results: list[int] = []
    clients = [threading.Thread(target=lambda: results.append(_code(base + "/metrics", 30))) for _ in range(50)]
    for c in clients:
        c.start()
    scraper = app.state.scraper
    busy_wait(lambda: scraper.requests >= 50, timeout=20)
    # 50 scrapes in flight (more than the 40 threads of the threadpool a sync handler uses):
    for path in ("/livez", "/readyz", "/healthz"):
        assert _code(base + path, timeout=2) == 200, path
    assert len(calls) == 1  # one read of the state dir for all 50
    gate.set()
    for c in clients:
        c.join(30)
    assert results == [200] * 50
    assert scraper.scrapes == 1


def test_status_reuses_the_scrape_and_each_file_is_read_once(served_app, monkeypatch):
    import kvguard.sidecar.collector as coll

    base, app, gate, calls = served_app
    gate.set()
    metrics_dir = app.state.config.state_dir / "metrics"
    for pid in range(4):
        (metrics_dir / f"counter_{pid}-1.db").write_bytes(Path(_one_counter_file(metrics_dir.parent / f"w{pid}")).read_bytes())
    reads: list[str] = []
    real = coll._read_db
    monkeypatch.setattr(coll, "_read_db", lambda fd, name: (reads.append(name), real(fd, name))[1])
    r = httpx.get(base + "/metrics", timeout=5)
    assert r.status_code == 200
    assert sorted(reads) == [f"counter_{pid}-1.db" for pid in range(4)]  # once each
    assert samples(r.text)[("kvguard_check_evaluations_total", (("check", "swa_pending_bound"),))] == 4.0
    body = httpx.get(base + "/status", timeout=5).json()
    assert body["checks"]["swa_pending_bound"]["evaluated"] == 4.0
    assert len(reads) == 4  # /status used the same scrape


def _one_counter_file(tmp: Path) -> str:
    tmp.mkdir()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp), "PATH": "/usr/bin:/bin"}
    code = "from prometheus_client import Counter\nCounter('kvguard_check_evaluations', 'h', ['check']).labels('swa_pending_bound').inc()\n"
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    [f] = tmp.glob("counter_*.db")
    return str(f)


# --- row 9: the sidecar's own process -----------------------------------------------------


def test_sigterm_stops_the_sidecar_with_exit_0_and_every_log_line_is_json(fake_vllm, sidecar_proc, tmp_path):
    import json

    side = sidecar_proc(fake_vllm.url, tmp_path)
    busy_wait(lambda: side.get("/livez").status_code == 200)
    code, out = side.stop()
    assert code == 0, out  # uvicorn re-raises SIGTERM after shutdown: it used to exit 143
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines, "the sidecar logged nothing"
    events = [json.loads(line) for line in lines]  # raises on uvicorn's plain "INFO:" lines
    assert {"Uvicorn running on http://127.0.0.1:%d (Press CTRL+C to quit)" % side.port,
            "engine_state_changed"} <= {e["event"] for e in events}
    assert all("timestamp" in e and "level" in e for e in events)
