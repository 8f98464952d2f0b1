"""sidecar/parts.py: vLLM's processes found by their titles, a death seen on the next poll.

The pure pieces on their own (a stat line, a title, a process table), the watch on a
``/proc`` written by the test (zombies and reused pids, which real processes cannot be made
to show on demand) and on real processes titled as vLLM titles them (``exec -a``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvguard.guards.telemetry.statefile import process_name
from kvguard.sidecar.parts import PartDeath, PartWatch, descendants, parse_stat, title_prefix

from sidecartools import busy_wait


def stat_line(pid: int, comm: str, state: str, ppid: int, starttime: int) -> bytes:
    # fields 3..22 of proc(5): state ppid pgrp session tty_nr tpgid flags minflt cminflt
    # majflt cmajflt utime stime cutime cstime priority nice num_threads itrealvalue starttime
    rest = [state, str(ppid)] + ["0"] * 17 + [str(starttime)] + ["0"] * 30
    return f"{pid} ({comm}) {' '.join(rest)}\n".encode()


class TestProcessName:
    def test_vllm_titles(self):
        assert process_name(b"VLLM::EngineCore_DP1") == "EngineCore_DP1"
        assert process_name(b"VLLM::Worker_TP0" + b" " * 80) == "Worker_TP0"  # setproctitle pads
        assert process_name(b"VLLM::DPCoordinator\0\0\0") == "DPCoordinator"
        assert process_name(b"VLLM::Worker_DP0_PP0_PCP0_TP0_DCP0_EP0") == "Worker_DP0_PP0_PCP0_TP0_DCP0_EP0"
        assert process_name(b"VLLM::EngineCore_DP1\0-c\0x") == "EngineCore_DP1"  # exec -a keeps argv

    def test_other_processes_are_not_parts(self):
        for raw in (b"python\0-m\0vllm.entrypoints.openai.api_server", b"", b"VLLM::", b"VLLM:: ", b"vllm::EngineCore",
                    b" VLLM:EngineCore", b"VLLM::Engine-Core", b"VLLM::" + b"A" * 101, b"\xff\xfe"):
            assert process_name(raw) is None, raw
        assert process_name(b"VLLM::" + b"A" * 100) == "A" * 100

    def test_the_prefix_is_vllms_setting(self):
        assert process_name(b"MINE::EngineCore", "MINE") == "EngineCore"
        assert process_name(b"VLLM::EngineCore", "MINE") is None
        assert title_prefix({}) == "VLLM" and title_prefix({"VLLM_PROCESS_NAME_PREFIX": ""}) == "VLLM"
        assert title_prefix({"VLLM_PROCESS_NAME_PREFIX": "MINE"}) == "MINE"


class TestParseStat:
    def test_fields(self):
        st = parse_stat(stat_line(42, "VLLM::EngineCo", "S", 7, 123456))
        assert (st.pid, st.state, st.ppid, st.starttime) == (42, "S", 7, 123456)

    def test_a_command_name_with_spaces_and_parentheses(self):
        st = parse_stat(stat_line(42, "a) (b Z 1 (c", "R", 9, 55))
        assert (st.pid, st.state, st.ppid, st.starttime) == (42, "R", 9, 55)

    def test_not_a_stat_line(self):
        for raw in (b"", b"42 (x)", b"x (y) S 1 2", b"\xff"):
            assert parse_stat(raw) is None

    def test_the_real_one(self):
        st = parse_stat(Path(f"/proc/{os.getpid()}/stat").read_bytes())
        assert (st.pid, st.ppid) == (os.getpid(), os.getppid())
        assert st.starttime == int(Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19])


def test_descendants():
    parents = {2: 1, 3: 2, 4: 3, 5: 1, 6: 99, 7: 6, 8: 8}
    assert descendants(parents, 2) == {3, 4}
    assert descendants(parents, 1) == {2, 3, 4, 5}
    assert descendants(parents, 99) == {6, 7}
    assert descendants(parents, 4) == set()
    assert descendants(parents, 8) == set()  # a loop never hangs


class FakeProc:
    """A ``/proc`` of the test's making: ``add(pid, ppid, title, state, starttime)``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def add(self, pid: int, ppid: int, title: bytes, state: str = "S", starttime: int = 1000) -> None:
        d = self.root / str(pid)
        d.mkdir(exist_ok=True)
        (d / "stat").write_bytes(stat_line(pid, "python3", state, ppid, starttime))
        (d / "cmdline").write_bytes(title)

    def remove(self, pid: int) -> None:
        for f in (self.root / str(pid)).iterdir():
            f.unlink()
        (self.root / str(pid)).rmdir()


@pytest.fixture
def fake_proc(tmp_path):
    fp = FakeProc(tmp_path)
    fp.add(1, 0, b"kvguard\0run")
    fp.add(2, 1, b"python\0-m\0vllm.entrypoints.openai.api_server")
    fp.add(3, 2, b"VLLM::DPCoordinator")
    fp.add(4, 2, b"VLLM::EngineCore_DP0")
    fp.add(5, 2, b"VLLM::EngineCore_DP1")
    fp.add(6, 4, b"VLLM::Worker")
    fp.add(7, 5, b"VLLM::Worker")
    fp.add(8, 2, b"python\0-c\0from multiprocessing.resource_tracker import main")
    fp.add(50, 0, b"VLLM::EngineCore")  # another server's: not a descendant of kvguard run
    return fp


def watch(fp: FakeProc) -> PartWatch:
    return PartWatch(root=1, proc=fp.root, scan_interval=0.0)


class TestWatch:
    def test_finds_the_titled_descendants_and_their_parents(self, fake_proc):
        w = watch(fake_proc)
        assert w.poll(0.0) is None
        got = {p.pid: (p.name, p.parent, p.parent_pid) for p in w.parts.values()}
        assert got == {
            3: ("DPCoordinator", None, None), 4: ("EngineCore_DP0", None, None), 5: ("EngineCore_DP1", None, None),
            6: ("Worker", "EngineCore_DP0", 4), 7: ("Worker", "EngineCore_DP1", 5),
        }

    def test_a_part_gone_from_proc_is_dead_once(self, fake_proc):
        w = watch(fake_proc)
        w.poll(0.0)
        fake_proc.remove(5)
        t0 = time.time()
        death = w.poll(1.0)
        assert isinstance(death, PartDeath) and (death.name, death.pid, death.parent) == ("EngineCore_DP1", 5, None)
        assert t0 <= death.at <= time.time()
        assert death.describe() == "EngineCore_DP1 (pid 5)"
        assert w.poll(2.0) is None and 5 not in w.parts

    def test_a_zombie_is_dead(self, fake_proc):
        w = watch(fake_proc)
        w.poll(0.0)
        fake_proc.add(7, 5, b"", state="Z")  # exited, not reaped by its EngineCore yet
        death = w.poll(1.0)
        assert (death.name, death.pid, death.parent) == ("Worker", 7, "EngineCore_DP1")
        assert death.describe() == "Worker (pid 7, of EngineCore_DP1)"

    def test_a_reused_pid_is_not_the_part(self, fake_proc):
        w = watch(fake_proc)
        w.poll(0.0)
        fake_proc.add(4, 2, b"VLLM::EngineCore_DP0", starttime=2000)  # same pid, another process
        assert w.poll(1.0).name == "EngineCore_DP0"

    def test_an_engine_and_its_worker_dead_together_blame_the_engine(self, fake_proc):
        w = watch(fake_proc)
        w.poll(0.0)
        fake_proc.remove(7)
        fake_proc.remove(5)
        death = w.poll(1.0)
        assert (death.name, death.pid) == ("EngineCore_DP1", 5)
        assert not {5, 7} & set(w.parts)

    def test_a_renamed_worker_is_known_by_its_new_name(self, fake_proc):
        w = watch(fake_proc)
        w.poll(0.0)
        fake_proc.add(6, 4, b"VLLM::Worker_TP0")
        w.poll(1.0)
        fake_proc.remove(6)
        assert w.poll(2.0).name == "Worker_TP0"

    def test_new_parts_wait_for_the_next_scan(self, fake_proc):
        w = PartWatch(root=1, proc=fake_proc.root, scan_interval=10.0)
        w.poll(0.0)
        fake_proc.add(9, 2, b"VLLM::APIServer_1")
        w.poll(5.0)
        assert 9 not in w.parts
        w.poll(10.0)
        assert w.parts[9].name == "APIServer_1"
        assert w.scans == 2

    def test_an_unreadable_proc_finds_nothing(self, tmp_path):
        w = PartWatch(root=1, proc=tmp_path / "missing", scan_interval=0.0)
        assert w.poll(0.0) is None and w.parts == {}


def titled(title: str, *argv: str) -> list[str]:
    return ["bash", "-c", f'exec -a "{title}" "$@"', "bash", *argv]


def test_real_processes_titled_as_vllm_titles_them(tmp_path):
    """Children of this test process titled with ``exec -a``; one is killed, one becomes a
    zombie that nobody reaps (as a killed EngineCore until the API server reaps it)."""
    engine = subprocess.Popen(titled("VLLM::EngineCore_DP1", "sleep", "60"))
    worker = subprocess.Popen(titled("VLLM::Worker_TP1", "sleep", "60"))
    other = subprocess.Popen(["sleep", "60"])
    try:
        w = PartWatch(root=os.getpid(), scan_interval=0.0)
        busy_wait(lambda: w.poll() is None and {engine.pid, worker.pid} <= set(w.parts))
        assert other.pid not in w.parts
        assert w.parts[engine.pid].name == "EngineCore_DP1"
        os.kill(worker.pid, signal.SIGKILL)
        death = busy_wait(lambda: w.poll())
        assert (death.name, death.pid) == ("Worker_TP1", worker.pid)
        assert Path(f"/proc/{worker.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # not reaped
        worker.wait()
        assert w.poll() is None and engine.pid in w.parts
    finally:
        for p in (engine, worker, other):
            p.kill()
            p.wait()
