"""GuardSettings: the plugin's settings, read once from ``KVGUARD_*`` environment variables.

================================  =======================  =====================================
variable                          field                    meaning
================================  =======================  =====================================
``KVGUARD_POLICY``                ``policy``               ``observe`` | ``guard`` (default) |
                                                           ``strict``
``KVGUARD_DISABLE``               ``disable``              ``1``: the plugin installs nothing
``KVGUARD_DISABLED_SITES``        ``disabled_sites``       comma list of site ids; ``*`` all
``KVGUARD_STATE_DIR``             ``state_dir``            shared dir for multiprocess metrics
                                                           and fatal records
``KVGUARD_WAIT_BOUND_STEPS``      ``wait_bound_steps``     observations of a wait without
                                                           progress before it is ended (int
                                                           >= 1, default 32)
``KVGUARD_WAIT_BOUND_SECONDS``    ``wait_bound_seconds``   and seconds without progress (float
                                                           >= 0, default 30); both must pass
                                                           (:mod:`kvguard.guards.checks.wait_bound`)
================================  =======================  =====================================

A bad value raises ``pydantic.ValidationError`` from :meth:`GuardSettings.from_env`;
:func:`kvguard.guards.plugin.register` turns that into a logged, disabled plugin (never a crash).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from kvguard.guards import names

Policy = Literal["observe", "guard", "strict"]


class GuardSettings(BaseSettings):
    """Frozen plugin settings (pydantic-settings, env prefix ``KVGUARD_``).

    ``disabled_sites`` is a frozenset of site ids from ``KVGUARD_DISABLED_SITES``
    (commas, spaces stripped; ``*`` = every site). Unknown keys in the environment are
    ignored; a bad ``KVGUARD_POLICY`` or ``KVGUARD_DISABLE`` raises ``ValidationError``.
    """

    model_config = SettingsConfigDict(
        env_prefix=names.ENV_PREFIX, frozen=True, extra="ignore", case_sensitive=False
    )

    policy: Policy = names.DEFAULT_POLICY  # type: ignore[assignment]
    disable: bool = False
    disabled_sites: Annotated[frozenset[str], NoDecode] = frozenset()
    state_dir: Path | None = None
    wait_bound_steps: int = Field(default=names.DEFAULT_WAIT_BOUND_STEPS, ge=1)
    wait_bound_seconds: float = Field(default=names.DEFAULT_WAIT_BOUND_SECONDS, ge=0.0)

    @field_validator("policy", mode="before")
    @classmethod
    def _normalize_policy(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("disabled_sites", mode="before")
    @classmethod
    def _split_sites(cls, value: object) -> object:
        if isinstance(value, str):
            return frozenset(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("state_dir", mode="before")
    @classmethod
    def _empty_state_dir(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip():
            return None
        return value

    @classmethod
    def from_env(cls) -> "GuardSettings":
        """Read the ``KVGUARD_*`` environment now. Raises ``pydantic.ValidationError``."""
        return cls()

    def site_disabled(self, site_id: str) -> bool:
        """True when ``site_id`` is listed in ``KVGUARD_DISABLED_SITES`` (or it holds ``*``)."""
        return "*" in self.disabled_sites or site_id in self.disabled_sites
