"""Configure structlog once, for the sidecar and ``kvguard run`` processes only.

structlog's production recipe: a level-filtering bound logger, contextvars, log level,
exception formatting, an ISO/UTC timestamp, then JSON (or console) rendering to stderr.
A processor adds ``kvguard_version`` and ``pid``. Called exactly once, from
``sidecar/commands.py`` before anything logs; guards/ never configures structlog (it is
a guest inside vLLM).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

__all__ = ["configure_logging", "kvguard_version"]


def kvguard_version() -> str:
    """The installed kvguard distribution version, or ``"unknown"``."""
    from importlib import metadata

    try:
        return metadata.version("kvguard")
    except metadata.PackageNotFoundError:  # pragma: no cover - editable installs have it
        return "unknown"


def _add_process(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    event.setdefault("kvguard_version", _VERSION)
    event.setdefault("pid", os.getpid())
    return event


_VERSION = kvguard_version()


def configure_logging(level: str = "info", json: bool = True) -> None:
    """Set structlog's global configuration (level name as in ``logging``) and route the
    standard library's log records (uvicorn's, httpx's) through the same processors and
    renderer (structlog's ``ProcessorFormatter``), so that with ``json`` every line on
    stderr is one JSON object, whoever logged it."""
    renderer: Any = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_process,
    ]
    structlog.configure(
        processors=[*shared[:2], structlog.processors.format_exc_info, *shared[2:], renderer],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelName(level.upper())
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        # uvicorn's own handlers (when it configured them) would print plain text
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    # httpx logs every request at INFO: the health poller would flood the log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
