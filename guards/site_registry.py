"""The process-wide registry of the check sites discovered in the installed vLLM.

:class:`Site` is one check site (discovered by :mod:`kvguard.guards.hooking.discovery`);
:func:`register` / :func:`register_missing` fill the registry as the instrumentor finds
sites, and :func:`known_site_ids` is the closed set of ``site`` label values that the
metrics validate against. It lives at the top of the engine half, beside
:mod:`kvguard.guards.names`, so the checks (which read a site's fields) and the telemetry
(which validates its labels) read it without importing the hooking layer that fills it.
Stdlib only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["Site", "register", "register_missing", "known_site_ids", "registered"]


@dataclass(frozen=True)
class Site:
    """One check site of the installed release.

    ``site_id``: the ``site`` label; ``module``: dotted vLLM module; ``qualname``: the
    function (``f`` or ``Class.method``) whose code holds it; ``kind``: ``assert`` /
    ``window`` / ``store_call``; ``check``: the ``check`` label; ``fingerprint``: the
    normalized assert test (or whole statement for ``store_call``), which the rewriter
    matches; ``lineno``: where it was seen (information only); ``issue``: the upstream
    issue of a special site; ``bound_expr`` / ``pending_expr``: for the window site, the
    source text of vLLM's own bound (GPU blocks) and of the pending count;
    ``release_keys`` / ``request_scoped``: see the fields.
    """

    site_id: str
    module: str
    qualname: str
    kind: str
    check: str
    fingerprint: str
    lineno: int
    issue: str | None = None
    bound_expr: str | None = None
    pending_expr: str | None = None
    #: ``store_call`` sites: True when the store's keys were prepared before the site
    #: (``prepare_store`` ran): a drop releases them; False: nothing to release.
    release_keys: bool = False
    #: generic asserts of a request-scoped method before its ``prepare_load`` 
    request_scoped: bool = False
    #: request-scoped asserts: the method's own release calls (source text over the frame's
    #: locals, last hold first) that give back what it holds at the assert, run before the
    #: request fails (:class:`kvguard.guards.hooking.discovery.RequestScope`)
    releases: tuple[str, ...] = ()
    #: generic asserts that are not request-scoped: why one request cannot be blamed
    #: (:func:`kvguard.guards.hooking.discovery.scope_refusal`); guarded, such an assert
    #: re-raises (vLLM's crash, counted). None for every other site.
    unscoped_reason: str | None = None


# --- the process-wide registry of discovered sites (metrics validate labels with it) -----
_registry: dict[str, Site] = {}
_registry_lock = threading.Lock()


def register(sites: list[Site]) -> None:
    """Add discovered sites to the process registry (the closed set of ``site`` labels)."""
    with _registry_lock:
        for site in sites:
            _registry[site.site_id] = site


_missing_ids: set[str] = set()


def register_missing(site_id: str) -> None:
    """Register the id of a special site that its module should have and does not
    (``<module short>:special:<kind>``), so its ``kvguard_site_installed`` 0 can be exported."""
    with _registry_lock:
        _missing_ids.add(site_id)


def known_site_ids() -> frozenset[str]:
    """Every site id registered in this process (discovered in an imported module), plus
    the ids of missing special sites."""
    return frozenset(_registry) | frozenset(_missing_ids)


def registered(site_id: str) -> Site | None:
    """The registered :class:`Site` of ``site_id``, or None."""
    return _registry.get(site_id)
