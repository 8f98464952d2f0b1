"""The ``vllm.general_plugins`` entry point: ``kvguard = kvguard.guards.plugin:register``.

vLLM calls :func:`register` in every process it starts (API server, EngineCore, workers),
possibly more than once; it must be cheap and must never raise.
"""

from __future__ import annotations

from typing import Any

from kvguard.guards import names

__all__ = ["register"]


def register(settings: Any = None) -> bool:
    """Install kvguard in this process; True when the offload guards are installed.

    ``settings``: a :class:`kvguard.guards.settings.GuardSettings`; default
    ``GuardSettings.from_env()``. ``KVGUARD_DISABLE=1`` -> nothing is installed. A bad
    setting (``KVGUARD_POLICY=bogus``) logs ``plugin_disabled`` with the reason and
    installs nothing. With ``KVGUARD_STATE_DIR`` set, also installs the fatal-exception
    recorder (``kvguard.guards.policy.fatal.install(settings)``). Never raises.
    """
    try:
        from kvguard.guards.telemetry import events

        if settings is None:
            from kvguard.guards.settings import GuardSettings

            try:
                settings = GuardSettings.from_env()
            except Exception as error:  # pydantic.ValidationError
                events.plugin_disabled(reason=f"invalid kvguard settings: {error}".replace("\n", " "))
                return False
        if settings.disable:
            events.plugin_disabled(reason="KVGUARD_DISABLE=1")
            return False
        from kvguard.guards.hooking.instrumentor import OffloadGuardInstrumentor

        instrumentor = OffloadGuardInstrumentor()
        installed = instrumentor.install(settings) or instrumentor.is_installed
        if settings.state_dir is not None:
            try:
                import importlib

                fatal = importlib.import_module("kvguard.guards.policy.fatal")
                fatal.install(settings)
            except Exception as error:
                from kvguard.guards.policy import runtime

                runtime.guard_error(names.STAGE_FATAL, error)
        return bool(installed)
    except Exception as error:  # pragma: no cover - last line of defence
        try:
            from kvguard.guards.policy import runtime

            runtime.guard_error(names.STAGE_INSTALL, error)
        except Exception:
            pass
        return False
