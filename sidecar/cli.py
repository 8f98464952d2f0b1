"""The ``kvguard`` console script: one click group, each subcommand in its own module.

Subcommands are imported lazily (click's documented LazyGroup pattern), so
``kvguard sidecar`` never imports the replay harness or vLLM, and a missing optional
dependency only breaks the subcommand that needs it.

==================  =====================================  ==============================
command             module                                 needs
==================  =====================================  ==============================
``replay``          ``guards.replay.command:replay``       vLLM
``check-geometry``  ``guards.geometry:check_geometry``     (vLLM optional)
``sidecar``         ``sidecar.commands:sidecar``           the ``sidecar`` extra
``run``             ``sidecar.commands:run``               nothing beyond the core
==================  =====================================  ==============================
"""

from __future__ import annotations

import importlib

import click

_COMMANDS: dict[str, str] = {
    "replay": "guards.replay.command:replay",
    "check-geometry": "guards.geometry:check_geometry",
    "sidecar": "sidecar.commands:sidecar",
    "run": "sidecar.commands:run",
}


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
@click.version_option(package_name="kvguard")
def main() -> None:
    """kvguard: invariant guards and a monitoring sidecar for vLLM's CPU KV offloading."""


if __name__ == "__main__":  # pragma: no cover
    main()
