"""sidecar/supervisor.py with real children (after tini's test/run_inner_tests.py).

``kvguard run`` runs as a real process; waits use deadlines (``busy_wait``), never sleeps
that a slow machine could outrun.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvguard.guards.telemetry.statefile import FatalRecord, StateDir, write_fatal_record
from kvguard.sidecar.exitcode import ENGINE_FATAL

from sidecartools import busy_wait

LOOP = textwrap.dedent(
    """
    import json, sys
    from kvguard.sidecar.config import SupervisorConfig
    from kvguard.sidecar.supervisor import Supervisor
    out = {}
    for n in range(256):
        cfg = SupervisorConfig(command=("sh", "-c", f"exit {n}"), termination_log="/nonexistent/t")
        out[n] = Supervisor(cfg).run().code
    for sig in (1, 2, 3, 9, 15):
        cfg = SupervisorConfig(command=("sh", "-c", f"kill -{sig} $$"))
        out[f"sig{sig}"] = Supervisor(cfg).run().code
    print(json.dumps(out))
    """
)


def test_every_exit_code_and_signal_death_with_real_children():
    proc = subprocess.run([sys.executable, "-c", LOOP], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["0"] == ENGINE_FATAL
    assert {int(k): v for k, v in got.items() if k.isdigit() and k != "0"} == {n: n for n in range(1, 256)}
    assert {k: v for k, v in got.items() if k.startswith("sig")} == {
        "sig1": 129, "sig2": 130, "sig3": 131, "sig9": 137, "sig15": 143,
    }


def test_sigterm_death_gives_143(kvguard_run, tmp_path):
    # The child ignores nothing: SIGTERM kills sh, so the status is a signal death.
    run = kvguard_run(["--termination-log", str(tmp_path / "t"), "--", "sh", "-c", "kill -TERM $$; sleep 5"])
    code, out = run.wait()
    assert code == 143, out
    assert (tmp_path / "t").read_text() == "child (sh) killed by SIGTERM without a stop request\n"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT])
def test_forwarded_stop_signal_then_clean_exit_gives_0(kvguard_run, tmp_path, sig):
    ready = tmp_path / "ready"
    got = tmp_path / "got"
    script = (
        f"trap 'echo {sig.name} > {got}; exit 0' {sig.name[3:]}; "
        f"touch {ready}; while true; do sleep 0.05; done"
    )
    run = kvguard_run(["--termination-log", str(tmp_path / "t"), "--", "sh", "-c", script])
    busy_wait(ready.exists)
    os.kill(run.proc.pid, sig)
    code, out = run.wait()
    assert code == 0, out
    assert got.read_text().strip() == sig.name  # the child got the very signal
    assert (tmp_path / "t").read_text() == "stopped on request\n"


def test_grace_expired_sends_sigkill_to_the_group(kvguard_run, tmp_path):
    ready = tmp_path / "ready"
    script = f"trap '' TERM; touch {ready}; while true; do sleep 0.05; done"
    run = kvguard_run(["--grace", "0.5", "--", "sh", "-c", script])
    busy_wait(ready.exists)
    os.kill(run.proc.pid, signal.SIGTERM)
    code, out = run.wait()
    assert code == 137, out
    assert "grace_expired_sigkill" in out


def test_orphaned_grandchild_is_reaped(kvguard_run, tmp_path):
    gc_pid = tmp_path / "gc.pid"
    ready = tmp_path / "ready"
    # The middle shell starts a short-lived grandchild and exits at once: the grandchild
    # is orphaned, reparented to kvguard run (subreaper), and must not stay a zombie.
    script = (
        f"sh -c '(sleep 0.2; exit 3) & echo $! > {gc_pid}'; "
        f"touch {ready}; trap 'exit 0' TERM; while true; do sleep 0.05; done"
    )
    run = kvguard_run(["--", "sh", "-c", script])
    busy_wait(ready.exists)
    pid = int(gc_pid.read_text())

    def gone() -> bool:
        try:
            Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return True
        return False  # alive or a zombie (a zombie keeps its /proc entry until reaped)

    busy_wait(gone, timeout=10)
    os.kill(run.proc.pid, signal.SIGTERM)
    code, out = run.wait()
    assert code == 0, out
    assert f"orphan_reaped" in out and f"pid={pid}" in out


def test_exit_zero_with_fatal_marker_gives_engine_fatal_and_message(kvguard_run, tmp_path):
    state = tmp_path / "state"
    # The child plays EngineCore: it writes a fatal record into the exported state dir,
    # then exits 0 the way vLLM's API server does (#48966).
    writer = (
        "import os; from kvguard.guards.telemetry.statefile import *; "
        "write_fatal_record(StateDir(__import__('pathlib').Path(os.environ['KVGUARD_STATE_DIR'])), "
        "FatalRecord('AssertionError', 'pending 129 > 128', 'swa_pending_bound', __import__('time').time(), os.getpid(), '0.25.1', 'running'))"
    )
    term = tmp_path / "t"
    run = kvguard_run(
        ["--termination-log", str(term), "--state-dir", str(state), "--", sys.executable, "-c", writer]
    )
    code, out = run.wait()
    assert code == ENGINE_FATAL, out
    line = term.read_text()
    assert line.startswith("engine fatal during running: AssertionError: pending 129 > 128 (site=swa_pending_bound, pid=")
    assert line.endswith(")\n") and line.count("\n") == 1


def test_state_dir_history_is_kept_but_an_old_fatal_does_not_count(kvguard_run, tmp_path):
    """Row 2: kvguard run keeps the fatal history and the metrics files of earlier starts
    (the sidecar must still show them after a restart), but an old record never decides
    this start's exit status."""
    state = tmp_path / "state"
    old = StateDir(state).ensure()
    write_fatal_record(old, FatalRecord("E", "old", None, 1.0, 1, "x"))
    (old.metrics / "counter_1.db").write_bytes(b"\0" * 16)
    seen = tmp_path / "seen"
    script = f'echo "$KVGUARD_STATE_DIR" > {seen}; ls -A "$KVGUARD_STATE_DIR"/fatal "$KVGUARD_STATE_DIR"/metrics >> {seen}; exit 3'
    code, out = kvguard_run(["--state-dir", str(state), "--", "sh", "-c", script]).wait()
    assert code == 3, out  # the old fatal record does not count for this start
    assert seen.read_text().splitlines() == [
        str(state), f"{state}/fatal:", "1-1000.json", "", f"{state}/metrics:", "counter_1.db",
    ]
    run = json.loads((state / "run.json").read_text())
    assert run["state"] == "exited" and run["exit_status"] == 3 and run["stop_requested"] is False
    assert run["started"] > 1.0


def test_fatal_history_is_bounded_across_starts(kvguard_run, tmp_path):
    from kvguard.guards.telemetry.statefile import FATAL_HISTORY

    state = StateDir(tmp_path / "state").ensure()
    for i in range(FATAL_HISTORY + 5):
        write_fatal_record(state, FatalRecord("E", f"r{i}", None, 10.0 + i, 100 + i, "x"))
    code, out = kvguard_run(["--state-dir", str(state.root), "--", "sh", "-c", "exit 4"]).wait()
    assert code == 4, out
    kept = sorted(p.name for p in state.fatal.iterdir())
    assert len(kept) == FATAL_HISTORY
    assert kept[0] == "105-15000.json"  # the 5 oldest (pids 100..104) are gone
    assert f"{100 + FATAL_HISTORY + 4}-{(10 + FATAL_HISTORY + 4) * 1000}.json" in kept


def test_dead_child_live_gauge_files_are_marked_dead(kvguard_run, tmp_path):
    state = tmp_path / "state"
    script = (
        'touch "$KVGUARD_STATE_DIR/metrics/gauge_livesum_$$.db" "$KVGUARD_STATE_DIR/metrics/counter_$$.db"; '
        'echo $$ > "$KVGUARD_STATE_DIR/../pid"; exit 4'
    )
    code, out = kvguard_run(["--state-dir", str(state), "--", "sh", "-c", script]).wait()
    assert code == 4, out
    pid = (tmp_path / "pid").read_text().strip()
    assert sorted(p.name for p in (state / "metrics").iterdir()) == [f"counter_{pid}.db"]


def test_command_not_found_gives_127(kvguard_run, tmp_path):
    code, out = kvguard_run(["--termination-log", str(tmp_path / "t"), "--", "no-such-command-kvguard"]).wait()
    assert code == 127, out
    assert (tmp_path / "t").read_text().startswith("exec failed: command not found")


def test_unwritable_termination_log_is_skipped_quietly(kvguard_run):
    code, out = kvguard_run(["--termination-log", "/proc/kvguard-nope/t", "--", "sh", "-c", "exit 5"]).wait()
    assert code == 5
    assert "Traceback" not in out


def _pid_namespaces_available() -> bool:
    try:
        return subprocess.run(["unshare", "-fp", "--mount-proc", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(
    not _pid_namespaces_available(),
    reason="needs `unshare -fp` (a new PID namespace, root or user namespaces) to run kvguard run as PID 1",
)
def test_as_pid_1_forwards_sigterm_and_reaps_orphans(tmp_path):
    """In a new PID namespace kvguard run is PID 1: the kernel drops unhandled signals
    to PID 1, so forwarding only works because they are blocked and collected."""
    import psutil

    from sidecartools import KVGUARD

    ready = tmp_path / "ready"
    script = (
        f"sh -c '(sleep 0.1; exit 3) &'; trap 'exit 0' TERM; touch {ready}; "
        "while true; do sleep 0.05; done"
    )
    proc = subprocess.Popen(
        ["unshare", "-fp", "--mount-proc", KVGUARD, "run", "--log-console", "--termination-log",
         str(tmp_path / "t"), "--", "sh", "-c", script],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        busy_wait(ready.exists)
        [pid1] = psutil.Process(proc.pid).children()
        os.kill(pid1.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, out
    assert "pid=1" in out and "orphan_reaped" in out and "signal_forwarded" in out
    assert (tmp_path / "t").read_text() == "stopped on request\n"


# --- issue 12 row 6: signals from the first instruction ------------------------------------

CLEAN_CHILD = "trap 'exit 0' TERM; while true; do sleep 0.01; done"


def blocks_sigterm(pid: int) -> bool:
    """kvguard run has executed its first instruction: the process is kvguard (not
    ``unshare`` before its exec, which blocks SIGTERM itself for a moment) and SIGTERM is
    in its blocked mask (``SigBlk``), or it already spawned its child (the kernel shows the
    waited-for signals unblocked while ``sigtimedwait`` runs)."""
    import psutil

    try:
        fields = dict(
            line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line
        )
        if fields.get("Name", "").strip() != "kvguard":
            return False
        if int(fields["SigBlk"].strip(), 16) & (1 << (signal.SIGTERM - 1)):
            return True
        return bool(psutil.Process(pid).children())
    except (FileNotFoundError, psutil.NoSuchProcess):
        return False


def sigterm_soon_after_start(pid: int, create_time: float) -> None:
    """SIGTERM 100 ms after the process started, or as soon as it blocks signals when the
    interpreter's own start-up (before kvguard's first instruction) took longer."""
    import time

    busy_wait(lambda: blocks_sigterm(pid), timeout=10, interval=0.002)
    time.sleep(max(0.0, create_time + 0.1 - time.time()))
    os.kill(pid, signal.SIGTERM)


def test_sigterm_100_ms_after_start_is_a_clean_stop_with_exit_0(kvguard_run, tmp_path):
    """Signals used to be blocked only after the imports: a SIGTERM in the first 1-2 s was
    lost (PID 1) or killed kvguard run with -15 and no termination message."""
    import psutil

    term = tmp_path / "t"
    run = kvguard_run(["--termination-log", str(term), "--state-dir", str(tmp_path / "s"), "--", "sh", "-c", CLEAN_CHILD])
    sigterm_soon_after_start(run.proc.pid, psutil.Process(run.proc.pid).create_time())
    code, out = run.wait()
    assert code == 0, out
    assert term.read_text().startswith("stopped on request")
    rec = json.loads((tmp_path / "s" / "run.json").read_text())
    assert (rec["state"], rec["stop_requested"], rec["exit_status"]) == ("exited", True, 0)


def test_a_stop_pending_before_the_spawn_never_starts_the_child(tmp_path):
    """In process: a SIGTERM kept pending by the early block stops kvguard run before it
    spawns anything (the early-signal path, deterministically)."""
    code = textwrap.dedent(
        f"""
        import os, signal, sys
        from kvguard.sidecar import earlysignals
        earlysignals.block()
        os.kill(os.getpid(), signal.SIGTERM)  # pending, not delivered
        from kvguard.sidecar.runconfig import SupervisorConfig
        from kvguard.sidecar.supervisor import Supervisor
        r = Supervisor(SupervisorConfig(command=("sh", "-c", "touch {tmp_path}/started"))).run()
        print(r.code, r.cause)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "0 stopped on request (SIGTERM) before the child started"
    assert not (tmp_path / "started").exists()


@pytest.mark.skipif(
    not _pid_namespaces_available(),
    reason="needs `unshare -fp` (a new PID namespace, root or user namespaces) to run kvguard run as PID 1",
)
def test_as_pid_1_a_sigterm_100_ms_after_start_is_a_clean_stop(tmp_path):
    import psutil

    from sidecartools import KVGUARD

    proc = subprocess.Popen(
        ["unshare", "-fp", "--mount-proc", KVGUARD, "run", "--log-console", "--termination-log",
         str(tmp_path / "t"), "--", "sh", "-c", CLEAN_CHILD],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        pid1 = busy_wait(lambda: (psutil.Process(proc.pid).children() or [None])[0], timeout=10)
        sigterm_soon_after_start(pid1.pid, pid1.create_time())
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, out
    assert (tmp_path / "t").read_text().startswith("stopped on request")


def test_kvguard_run_spawns_its_child_before_importing_click_structlog_or_pydantic():
    """Issue 12 row 6: start to child ready was 2.18 s (pydantic-settings, click and the
    sidecar config were imported first); bench/sidecar_bench.py has the figure."""
    code = textwrap.dedent(
        """
        import json, sys
        sys.argv = ["kvguard", "run", "--log-console", "--grace", "5", "--", "true"]
        from kvguard.sidecar import supervisor
        real = supervisor.Supervisor._spawn
        def spy(self, mask):
            heavy = sorted({m.split(".")[0] for m in sys.modules} & {"click", "structlog", "pydantic", "pydantic_settings", "prometheus_client", "fastapi"})
            print("HEAVY", json.dumps(heavy), flush=True)
            return real(self, mask)
        supervisor.Supervisor._spawn = spy
        from kvguard.sidecar.entry import main
        main()
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 70, out.stdout + out.stderr  # `true` exits 0 unrequested
    [line] = [ln for ln in out.stdout.splitlines() if ln.startswith("HEAVY")]
    assert json.loads(line[len("HEAVY "):]) == []


# -- issue 23: one of vLLM's processes dies while the API server runs ---------------------

def _parts(state: Path) -> dict[str, int]:
    try:
        rec = json.loads((state / "run.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return {p["name"]: p["pid"] for p in rec.get("parts", [])}


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


def test_a_dead_vllm_process_stops_the_child_and_exits_70_naming_it(kvguard_run, tmp_path):
    """The child plays vLLM's API server with two data-parallel EngineCores (titled as vLLM
    titles them; the API server does not notice a death, as vLLM takes about 5 s): one is
    SIGKILLed. kvguard run tells the sidecar first (run.json), stops the child, cleans up
    the other rank, and exits 70 with a message naming the rank."""
    state, term = tmp_path / "state", tmp_path / "t"
    script = (
        "(exec -a VLLM::DPCoordinator sleep 60) & (exec -a VLLM::EngineCore_DP0 sleep 60) & "
        "(exec -a VLLM::EngineCore_DP1 sleep 60) & trap 'exit 0' TERM; wait; wait"
    )
    run = kvguard_run(["--termination-log", str(term), "--state-dir", str(state), "--", "bash", "-c", script])
    parts = busy_wait(lambda: (lambda p: len(p) == 3 and p)(_parts(state)))
    assert set(parts) == {"DPCoordinator", "EngineCore_DP0", "EngineCore_DP1"}
    t0 = time.monotonic()
    os.kill(parts["EngineCore_DP1"], signal.SIGKILL)
    rec = busy_wait(lambda: (lambda r: r.get("death") and r)(json.loads((state / "run.json").read_text())))
    seen = time.monotonic() - t0
    code, out = run.wait()
    took = time.monotonic() - t0
    print(f"[supervisor] death in run.json {seen * 1000:.0f} ms, kvguard run exited {took * 1000:.0f} ms after the SIGKILL")
    assert rec["death"] == f"vLLM process EngineCore_DP1 (pid {parts['EngineCore_DP1']}) died"
    assert rec["state"] == "running" and rec["stop_requested"] is False
    assert code == ENGINE_FATAL, out
    assert term.read_text() == (
        f"vLLM process EngineCore_DP1 (pid {parts['EngineCore_DP1']}) died without a stop request; "
        "the child (bash) then exited 0\n")
    assert "engine_process_died" in out and "child_stopped_after_engine_death" in out
    final = json.loads((state / "run.json").read_text())
    assert (final["state"], final["exit_status"], final["death"]) == ("exited", ENGINE_FATAL, rec["death"])
    assert all(_gone(pid) for pid in parts.values())


def test_parts_out_of_the_process_group_are_stopped_at_the_end(kvguard_run, tmp_path):
    """vLLM's multi-port DP launcher puts each rank's server in a new process group
    (``os.setpgrp``): killpg of the child's group misses it, the watch does not."""
    state = tmp_path / "state"
    away = (f"{sys.executable} -c \"import os; os.setpgrp(); "
            "os.execv('/bin/sleep', ['VLLM::APIServer_DP1', '60'])\"")
    script = f"({away}) & (exec -a VLLM::EngineCore_DP0 sleep 60) & trap 'exit 0' TERM; wait; wait"
    run = kvguard_run(["--grace", "5", "--state-dir", str(state), "--", "bash", "-c", script])
    parts = busy_wait(lambda: (lambda p: len(p) == 2 and p)(_parts(state)))
    assert os.getpgid(parts["APIServer_DP1"]) != os.getpgid(parts["EngineCore_DP0"])
    os.kill(parts["EngineCore_DP0"], signal.SIGKILL)
    code, out = run.wait()
    assert code == ENGINE_FATAL, out
    assert _gone(parts["APIServer_DP1"]), out


def test_parts_that_die_after_a_stop_request_are_a_clean_stop(kvguard_run, tmp_path):
    state, term = tmp_path / "state", tmp_path / "t"
    script = ("(exec -a VLLM::EngineCore_DP0 sleep 60) & (exec -a VLLM::EngineCore_DP1 sleep 60) & "
              "trap 'kill -9 $(jobs -p); exit 0' TERM; wait; wait")
    run = kvguard_run(["--termination-log", str(term), "--state-dir", str(state), "--", "bash", "-c", script])
    parts = busy_wait(lambda: (lambda p: len(p) == 2 and p)(_parts(state)))
    os.kill(run.proc.pid, signal.SIGTERM)
    code, out = run.wait()
    assert code == 0, out
    assert term.read_text() == "stopped on request\n"
    assert "engine_process_died" not in out
    assert json.loads((state / "run.json").read_text())["death"] is None
    assert all(_gone(pid) for pid in parts.values())


def test_a_child_that_titles_nothing_is_not_watched(kvguard_run, tmp_path):
    """kvguard run runs anything: with no vLLM title below it, nothing is a part, and a
    grandchild that ends is just reaped."""
    state = tmp_path / "state"
    run = kvguard_run(["--state-dir", str(state), "--", "bash", "-c", "sleep 0.3 & wait; exit 3"])
    code, out = run.wait()
    assert code == 3, out
    rec = json.loads((state / "run.json").read_text())
    assert (rec["parts"], rec["death"]) == ([], None)


def test_no_watch_processes_leaves_a_dead_part_to_vllm(kvguard_run, tmp_path):
    """``--no-watch-processes`` (a vLLM that survives a dead rank: --enable-fault-tolerance):
    the child goes on after a titled process dies, and its own status decides."""
    state, ready = tmp_path / "state", tmp_path / "ready"
    # the part lives 1.5 s, three scans of the watch: with the watch on this is exit 70
    script = (f"(exec -a VLLM::EngineCore_DP1 sleep 1.5); touch {ready}; sleep 0.5; exit 3")
    run = kvguard_run(["--no-watch-processes", "--state-dir", str(state), "--", "bash", "-c", script])
    code, out = run.wait()
    assert ready.exists() and code == 3, out
    rec = json.loads((state / "run.json").read_text())
    assert (rec["parts"], rec["death"], rec["exit_status"]) == ([], None, 3)
