"""Settings of ``kvguard sidecar`` and ``kvguard run``: values, defaults, validation.

As uvicorn's ``Config``: the values and their defaults live here, in one place; the app
(:func:`kvguard.sidecar.app.create_app`) and the supervisor (:func:`kvguard.sidecar.supervisor.run_supervisor`)
receive a config object and never read the environment themselves.

``SidecarConfig`` is a pydantic-settings model with the ``KVGUARD_`` environment prefix
(``SupervisorConfig`` follows the same rules as a stdlib dataclass, in
:mod:`kvguard.sidecar.runconfig`, because ``kvguard run`` must start vLLM fast), so
``KVGUARD_VLLM_URL=...`` and ``--vllm-url ...`` set the same field (a flag wins over the
environment). A bad value raises :class:`ConfigError`, whose message names the setting
as both its environment variable and its flag, e.g.
``invalid setting KVGUARD_POLL_INTERVAL (--poll-interval): must be > 0``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = [
    "DEFAULT_TERMINATION_LOG",
    "ConfigError",
    "SidecarConfig",
    "SupervisorConfig",
    "load",
]

# kvguard run's config is stdlib only (it runs before vLLM starts): re-exported here.
from kvguard.sidecar.runconfig import DEFAULT_TERMINATION_LOG, ConfigError, SupervisorConfig  # noqa: E402


class _Base(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVGUARD_", extra="ignore", frozen=True, validate_default=True
    )


class SidecarConfig(_Base):
    """``kvguard sidecar``: where vLLM is, where the state dir is, where to listen.

    Fields (env ``KVGUARD_<NAME>``, flag ``--<name-with-dashes>``):

    - ``vllm_url``: vLLM's OpenAI server base URL; ``/health`` and ``/v1/models`` are polled.
    - ``state_dir``: the shared state dir (``KVGUARD_STATE_DIR``); ``None`` serves only the
      sidecar's own series.
    - ``host`` / ``port``: where the sidecar listens (default ``0.0.0.0:9400``).
    - ``poll_interval``: seconds between polls of vLLM's ``/health`` (default 0.2 s; /livez
      turns 503 within ``poll_interval + health_timeout`` of vLLM failing its health check).
    - ``health_timeout``: seconds one health request may take before it counts as failed.
    - ``startup_budget``: seconds the engine may stay ``starting`` (loading its model)
      from the sidecar's start or a new ``kvguard run`` child before it counts as ``dead``
      (and ``VLLMEngineDown`` may fire); default 600 s, about the 10 minutes the vLLM
      container's startup probe allows in ``deploy/k8s`` (0 < x <= 86400).
    - ``metrics_dir_grace``: seconds from the sidecar's start during which a missing
      ``$STATE/metrics`` (one never seen yet) is ``waiting`` for vLLM's plugin (or
      ``kvguard run``) to create it, not a ``metrics_dir`` problem; after it, or once the
      directory was seen, a missing one is blind (``KVGuardSidecarBlind``). ``None``
      (default): the startup budget, since the directory appears when vLLM starts, before
      its engine comes up (0..86400; 0: blind at once).
    - ``metrics_max_age``: a ``/metrics`` within this many seconds of the last read of
      the state dir reuses that read (the sidecar's own series are always fresh); default
      0.5 s, below any scrape interval; 0 reads on every scrape (0..10).
    - ``vllm_version``: reported in ``kvguard_build_info`` and /status; ``None`` reads it
      from the newest fatal record, then the installed distribution (if any), else "unknown".
    - ``policy``: the guard policy the engine runs with, as reported by /status; the same
      ``KVGUARD_POLICY`` variable the in-engine plugin reads (``observe|guard|strict``).
    - ``log_level``, ``log_json``: logging (configured once, by the CLI).
    """

    vllm_url: str = "http://127.0.0.1:8000"
    state_dir: Path | None = None
    host: str = "0.0.0.0"
    port: int = Field(default=9400)
    poll_interval: float = 0.2
    health_timeout: float = 0.5
    startup_budget: float = 600.0
    metrics_dir_grace: float | None = None
    metrics_max_age: float = 0.5
    vllm_version: str | None = None
    policy: str = "guard"
    log_level: str = "info"
    log_json: bool = True

    @field_validator("vllm_url")
    @classmethod
    def _url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http(s) URL with a host, e.g. http://127.0.0.1:8000")
        return v.rstrip("/")

    @field_validator("port")
    @classmethod
    def _port(cls, v: int) -> int:
        if not 0 <= v <= 65535:
            raise ValueError("must be in 0..65535")
        return v

    @field_validator("poll_interval")
    @classmethod
    def _poll(cls, v: float) -> float:
        if not 0 < v <= 10:
            raise ValueError("must be > 0 and <= 10 seconds")
        return v

    @field_validator("health_timeout")
    @classmethod
    def _timeout(cls, v: float) -> float:
        if not 0 < v <= 30:
            raise ValueError("must be > 0 and <= 30 seconds")
        return v

    @field_validator("startup_budget")
    @classmethod
    def _budget(cls, v: float) -> float:
        if not 0 < v <= 86400:
            raise ValueError("must be > 0 and <= 86400 seconds")
        return v

    @field_validator("metrics_dir_grace")
    @classmethod
    def _grace(cls, v: float | None) -> float | None:
        if v is not None and not 0 <= v <= 86400:
            raise ValueError("must be >= 0 and <= 86400 seconds")
        return v

    @property
    def effective_metrics_dir_grace(self) -> float:
        """``metrics_dir_grace``, or the startup budget when it is ``None`` (seconds)."""
        return self.startup_budget if self.metrics_dir_grace is None else self.metrics_dir_grace

    @field_validator("metrics_max_age")
    @classmethod
    def _max_age(cls, v: float) -> float:
        if not 0 <= v <= 10:
            raise ValueError("must be >= 0 and <= 10 seconds")
        return v

    @field_validator("policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        if v not in ("observe", "guard", "strict"):
            raise ValueError("must be one of observe, guard, strict")
        return v

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        if v.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ValueError("must be one of debug, info, warning, error, critical")
        return v.lower()


_FLAGS: dict[str, str] = {"command": "CMD"}


def load(cls: type, **given: Any) -> Any:
    """Build ``cls`` from the environment plus the non-``None`` keyword values.

    Raises :class:`ConfigError` naming the first bad setting.
    """
    if cls is SupervisorConfig:
        from kvguard.sidecar.runconfig import load_run_config

        return load_run_config(**given)
    kwargs = {k: v for k, v in given.items() if v is not None}
    try:
        return cls(**kwargs)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else "?"
        reason = str(err["msg"]).removeprefix("Value error, ")
        if field in _FLAGS:
            raise ConfigError(_FLAGS[field], "argument", reason) from None
        raise ConfigError("KVGUARD_" + field.upper(), "--" + field.replace("_", "-"), reason) from None
