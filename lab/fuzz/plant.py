"""A planted kvguard fault, for tests only: proves the fuzz report can flag a kvguard bug.

``KVGUARD_TEST_PLANT_FAULT=check`` in the environment of ``kvguard fuzz`` (read only by
the fuzz runner, never by the plugin or :mod:`kvguard.guards.checks.asserts`) makes every call
of kvguard's check entry point from rewritten vLLM code raise :class:`PlantedFault`
instead of deciding: exactly what a bug inside ``asserts.check`` that escaped its own
``except`` would do. The runner applies it per example with :func:`planted` after the
guard is installed, by replacing the ``@kvguard_check`` global that the instrumentor
injected into each rewritten vLLM module (:data:`kvguard.guards.hooking.rewrite.GLOBAL_CHECK`),
and restores it afterwards. The raising frame is in this module (kvguard code), so the
death is classed ``kvguard-raised`` and flagged ``kvguard_bug``.

The window site calls the check on every evaluation (every load of a sliding-window
group), so any example with a CPU hit meets the planted fault.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

ENV = "KVGUARD_TEST_PLANT_FAULT"
#: Values of :data:`ENV` this module knows.
KINDS = ("check",)


class PlantedFault(RuntimeError):
    """Raised by the planted check (never in production: needs :data:`ENV`)."""


def requested() -> str | None:
    """The planted fault named by :data:`ENV` (``"check"``) or None. Raises ValueError for another value."""
    value = os.environ.get(ENV, "").strip().lower()
    if not value:
        return None
    if value not in KINDS:
        raise ValueError(f"{ENV}={value!r}: known values are {', '.join(KINDS)}")
    return value


def planted_check(site_id: str, ok: bool, *args: Any, **kwargs: Any) -> None:
    """Stand-in for :func:`kvguard.guards.checks.asserts.check` that always raises."""
    raise PlantedFault(f"kvguard test-only planted fault in check({site_id!r})")


@contextlib.contextmanager
def planted(kind: str | None) -> Iterator[int]:
    """Inside the block the rewritten modules call :func:`planted_check` (``kind="check"``).

    Yields the number of rewritten modules patched (0 when ``kind`` is None or the guard
    is not installed).
    """
    if kind is None:
        yield 0
        return
    from kvguard.guards.hooking.rewrite import GLOBAL_CHECK

    patched: list[tuple[dict[str, Any], Any]] = []
    for mod in list(sys.modules.values()):
        d = getattr(mod, "__dict__", None)
        if isinstance(d, dict) and GLOBAL_CHECK in d:
            patched.append((d, d[GLOBAL_CHECK]))
            d[GLOBAL_CHECK] = planted_check
    try:
        yield len(patched)
    finally:
        for d, original in patched:
            d[GLOBAL_CHECK] = original
