"""``kvguard sidecar`` and ``kvguard run``: flags -> config -> ``run_*()``.

As uvicorn's ``main()``: each option maps one to one onto a config field (see
:mod:`kvguard.sidecar.config`); an option left out falls back to the ``KVGUARD_<FIELD>``
environment variable, then the field default. A bad value stops the command before
anything starts, with exit status 2 and a message naming the setting, e.g.
``Error: invalid setting KVGUARD_PORT (--port): must be in 0..65535``.
"""

from __future__ import annotations

from pathlib import Path

import click

from kvguard.sidecar.runconfig import ConfigError, load_run_config

__all__ = ["run", "sidecar"]


def _load_sidecar(**given: object) -> object:
    from kvguard.sidecar.config import SidecarConfig, load  # pydantic: not on kvguard run's path

    try:
        return load(SidecarConfig, **given)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--vllm-url", default=None, help="vLLM base URL [env KVGUARD_VLLM_URL; http://127.0.0.1:8000]")
@click.option(
    "--state-dir",
    default=None,
    type=click.Path(path_type=Path),
    help="shared state dir [env KVGUARD_STATE_DIR; none]",
)
@click.option("--host", default=None, help="listen address [env KVGUARD_HOST; 0.0.0.0]")
@click.option("--port", default=None, type=int, help="listen port [env KVGUARD_PORT; 9400]")
@click.option(
    "--poll-interval",
    default=None,
    type=float,
    help="seconds between vLLM /health polls [env KVGUARD_POLL_INTERVAL; 0.2]",
)
@click.option(
    "--health-timeout",
    default=None,
    type=float,
    help="seconds one /health request may take [env KVGUARD_HEALTH_TIMEOUT; 0.5]",
)
@click.option(
    "--startup-budget",
    default=None,
    type=float,
    help="seconds vLLM may take to come up before it counts as dead [env KVGUARD_STARTUP_BUDGET; 600]",
)
@click.option(
    "--metrics-dir-grace",
    default=None,
    type=float,
    help="seconds a missing metrics/ counts as waiting for vLLM, not blind [env KVGUARD_METRICS_DIR_GRACE; the startup budget]",
)
@click.option(
    "--metrics-max-age",
    default=None,
    type=float,
    help="seconds a state-dir read is reused by later scrapes; 0: read every scrape [env KVGUARD_METRICS_MAX_AGE; 0.5]",
)
@click.option("--vllm-version", default=None, help="vLLM version for kvguard_build_info [env KVGUARD_VLLM_VERSION]")
@click.option("--policy", default=None, help="guard policy shown in /status [env KVGUARD_POLICY; guard]")
@click.option("--log-level", default=None, help="debug|info|warning|error [env KVGUARD_LOG_LEVEL; info]")
@click.option("--log-json/--log-console", default=None, help="log format [env KVGUARD_LOG_JSON; json]")
def sidecar(**options: object) -> None:
    """Serve /metrics, /livez, /readyz, /status and /healthz for one vLLM server."""
    cfg = _load_sidecar(**options)
    from kvguard.sidecar.app import run_sidecar
    from kvguard.sidecar.logconfig import configure_logging

    configure_logging(cfg.log_level, cfg.log_json)  # type: ignore[attr-defined]
    run_sidecar(cfg)  # type: ignore[arg-type]


@click.command(
    context_settings={
        "help_option_names": ["-h", "--help"],
        "ignore_unknown_options": True,
        "allow_interspersed_args": False,
    }
)
@click.option(
    "--termination-log",
    default=None,
    type=click.Path(path_type=Path),
    help="file for the one-line exit cause [env KVGUARD_TERMINATION_LOG; /dev/termination-log]",
)
@click.option(
    "--grace",
    default=None,
    type=float,
    help="seconds from the first stop signal to SIGKILL [env KVGUARD_GRACE; 30]",
)
@click.option(
    "--state-dir",
    default=None,
    type=click.Path(path_type=Path),
    help="state dir to prepare (history kept), write run.json into and export as KVGUARD_STATE_DIR [env KVGUARD_STATE_DIR; none]",
)
@click.option(
    "--fatal-wait",
    default=None,
    type=float,
    help="seconds to wait for a fatal record after an unrequested exit 0 [env KVGUARD_FATAL_WAIT; 0.5]",
)
@click.option(
    "--watch-processes/--no-watch-processes",
    default=None,
    help="stop the child when one of vLLM's processes (EngineCore_DP1, Worker_TP1, ...) dies [env KVGUARD_WATCH_PROCESSES; on]",
)
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error", "critical"], case_sensitive=False),
    help="log level",
)
@click.option("--log-json/--log-console", default=True, help="log format (default json)")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def run(
    ctx: click.Context,
    command: tuple[str, ...],
    log_level: str,
    log_json: bool,
    **options: object,
) -> None:
    """Run CMD as a PID-1-safe child and exit non-zero when its engine died.

    \b
    Exit status: 0 requested stop, clean exit; 70 one of vLLM's processes died (then the
    child is stopped), the child exited 0 unrequested or an engine fatal was recorded;
    128+N killed by signal N; 126/127 exec failed; else the child's own status.
    """
    try:
        cfg = load_run_config(command=tuple(command) or None, **options)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    from kvguard.sidecar.logconfig import configure_logging
    from kvguard.sidecar.supervisor import run_supervisor

    configure_logging(log_level, log_json)
    ctx.exit(run_supervisor(cfg))
