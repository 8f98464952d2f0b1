"""The ``kvguard`` console script's entry point: ``kvguard run`` first, then click.

``kvguard run`` is a container's PID 1 and starts vLLM, so its first instruction blocks
the signals it collects (:mod:`kvguard.sidecar.earlysignals`) and the common forms of its
command line are parsed here with the standard library (:func:`parse_run_args`), so that
the child starts before click, structlog or pydantic are imported: start to child ready
costs a few tens of milliseconds more than the child alone (bench/sidecar_bench.py).
Anything else (``--help``, an unknown option, a bad value, every other subcommand) goes to
the click group in :mod:`kvguard.sidecar.cli`, which parses the same options the same way
(a test compares both parsers) and reports errors as usual (exit status 2).
"""

from __future__ import annotations

import sys

__all__ = ["main", "parse_run_args"]

#: ``kvguard run`` options with a value -> config field (None: a logging option).
_VALUED = {
    "--termination-log": "termination_log",
    "--grace": "grace",
    "--state-dir": "state_dir",
    "--fatal-wait": "fatal_wait",
    "--log-level": None,
}


def parse_run_args(args: list[str]) -> tuple[dict[str, object], str, bool] | None:
    """Parse ``kvguard run``'s arguments (after ``run``) as click would:
    ``(config values, log level, log json)``, or ``None`` for anything this parser leaves
    to click (``-h``/``--help``, an unknown option, no command)."""
    given: dict[str, object] = {}
    level, json_logs = "info", True
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            i += 1
            break
        if not a.startswith("-") or a == "-":
            break
        name, eq, value = a.partition("=")
        if name in _VALUED:
            if not eq:
                if i + 1 >= len(args):
                    return None
                value = args[i + 1]
                i += 1
            field = _VALUED[name]
            if field is None:
                level = value
            else:
                given[field] = value
        elif a in ("--watch-processes", "--no-watch-processes"):
            given["watch_processes"] = a == "--watch-processes"
        elif a == "--log-json":
            json_logs = True
        elif a == "--log-console":
            json_logs = False
        else:
            return None
        i += 1
    command = tuple(args[i:])
    if not command:
        return None
    given["command"] = command
    return given, level, json_logs


def main() -> None:
    """``kvguard``: the fast path for ``kvguard run``, else the click group."""
    if sys.argv[1:2] == ["run"]:
        from kvguard.sidecar import earlysignals

        earlysignals.block()
        parsed = parse_run_args(sys.argv[2:])
        if parsed is not None:
            from kvguard.sidecar.runconfig import ConfigError, load_run_config

            given, level, json_logs = parsed
            try:
                cfg = load_run_config(**given)
            except ConfigError:
                cfg = None  # click reports it (exit 2)
            if cfg is not None and level.lower() in ("debug", "info", "warning", "error", "critical"):
                import os

                from kvguard.sidecar.supervisor import run_supervisor

                code = run_supervisor(cfg, log_level=level, log_json=json_logs)
                # Everything is reaped, written and logged: skip the interpreter's teardown
                # (tens of milliseconds of module clean-up on a busy node) on the way out.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
    from kvguard.sidecar.cli import main as cli_main

    cli_main()


if __name__ == "__main__":  # pragma: no cover
    main()
