"""The policy in force in this process, and what each outcome of a check does under it.

The checks (:mod:`kvguard.guards.checks`) compute an invariant and ask :func:`policy` what
to do; the degrade actions are :mod:`kvguard.guards.policy.degrade`'s; the counters and
sinks are :mod:`kvguard.guards.telemetry.counts`' (re-exported here: :func:`snapshot`,
:func:`guard_error`, :func:`guard_errors`, :func:`last_failed_site`).

Policies (``../shared/DESIGN.md``):

============  ================================================================================
``observe``   exactly vLLM's behaviour: vLLM's own assert decides; kvguard counts, measures
              headroom and logs (every failure is ``raised``).
``guard``     vLLM's too-strict SWA assert is replaced by the exact bound (#48959): legal loads
              continue and are counted as *tolerated*. Store side: an inconsistent store spec
              (#42945, after ``prepare_store``) is dropped and its keys released; a
              ``len(offload_keys) == len(offload_block_ids)`` failure in the store builder's
              request loop (#49118, #52170, #55503, before ``prepare_store``: nothing to
              release) drops that request's store for this step (action ``store_dropped``).
              Request side: a failed assert of a request-scoped method before it issues the
              load (e.g. #43884's ``num_locally_computed_tokens`` bound in
              ``update_state_after_alloc``) fails that request alone with ``FINISHED_ERROR``,
              its blocks freed, no load issued (action ``request_failed``,
              :mod:`kvguard.guards.policy.degrade`). Any other failure (not tied to one store or one
              request) is counted, logged and re-raised. The Mamba single-state limit stays
              exactly vLLM's (raised). Guard never raises where vLLM's own assert passes.
``strict``    exact invariants on top of vLLM's: any failure of either raises.
============  ================================================================================

``kvguard_check_tolerated_total`` counts failures of vLLM's assert that the guard let
through; ``kvguard_invariant_violations_total{check,action}`` counts every other failure
(``raised``: the AssertionError propagated; ``store_dropped``; ``continued``: the exact
invariant failed but vLLM's looser assert passed and vLLM went on; ``request_failed``: one
request was failed alone).

Sinks (metrics, events) are no-ops until :func:`configure` sets them; an exception inside
kvguard code is counted in ``kvguard_guard_errors_total{stage}`` and vLLM's own behaviour
follows (the assert's AssertionError when it failed, otherwise continue).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from kvguard.guards import names
from kvguard.guards.policy import degrade
from kvguard.guards.telemetry import counts
from kvguard.guards.telemetry.counts import guard_error, guard_errors, last_failed_site, snapshot

__all__ = [
    "StoreDropped",
    "RequestFailed",
    "configure",
    "unconfigure",
    "policy",
    "vllm_version",
    "report_violation",
    "suppressed",
    "snapshot",
    "reset",
    "guard_error",
    "guard_errors",
    "last_failed_site",
]


class StoreDropped(AssertionError):
    """Raised by a ``GPULoadStoreSpec`` group-sizes check under ``guard`` inside ``_build_store_jobs``.

    The rewritten ``_build_store_jobs`` catches it around ``src_spec = GPULoadStoreSpec(...)``,
    releases the store's keys (``manager.complete_store(keys, req_context, success=False)``)
    and skips that store, so no inconsistent spec reaches the worker (vLLM #42945). It is
    an ``AssertionError`` so that any other caller sees exactly vLLM's exception type.
    """


class RequestFailed(AssertionError):
    """Raised by a request-scoped assert under ``guard``.

    The rewritten request-scoped method (``update_state_after_alloc``) catches it around
    its whole body and returns before it issued the request's load; the request was
    registered with :mod:`kvguard.guards.policy.degrade`, which finishes it with
    ``FINISHED_ERROR`` at the next ``update_from_output``. An ``AssertionError`` so that
    any other caller sees exactly vLLM's exception type.
    """


_policy: str = names.DEFAULT_POLICY
_vllm_version: str = "unknown"
#: > 0 inside :func:`suppressed` (read by the checks at each call)
suppress_depth = 0


def configure(
    *,
    policy: str | None = None,
    metrics: Any = None,
    events: Any = None,
    vllm_version: str | None = None,
) -> dict[str, Any]:
    """Set the sinks and policy; returns the previous values (pass them back to restore).

    ``metrics`` needs the methods of :class:`kvguard.guards.telemetry.metrics.GuardMetrics`, ``events`` those
    of :mod:`kvguard.guards.telemetry.events`. ``None`` leaves a value unchanged. Raises ``ValueError`` for
    an unknown policy.
    """
    global _policy, _vllm_version
    previous = {
        "policy": _policy,
        "metrics": counts.metrics,
        "events": counts.events,
        "vllm_version": _vllm_version,
    }
    if policy is not None:
        if policy not in names.POLICIES:
            raise ValueError(f"unknown policy {policy!r}")
        _policy = policy
    counts.set_sinks(metrics, events)
    if vllm_version is not None:
        _vllm_version = vllm_version
    return previous


def unconfigure() -> None:
    """Back to no-op sinks and the default policy (used by ``uninstall()``)."""
    global _policy
    counts.clear_sinks()
    _policy = names.DEFAULT_POLICY


def policy() -> str:
    """The policy in force (``observe`` | ``guard`` | ``strict``)."""
    return _policy


def vllm_version() -> str:
    """The vLLM release the events name (set by :func:`configure`; ``unknown`` before)."""
    return _vllm_version


def report_violation(site: str, check: str, action: str, *, policy: str | None = None,
                     context: dict[str, Any] | None = None, message: str | None = None,
                     **fields: Any) -> None:
    """One violation of ``check`` at ``site`` handled with ``action``: counted
    (``kvguard_invariant_violations_total{check,action}``; a ``raised`` one becomes the
    fatal record's site) and the ``check_failed`` event with the policy (``policy`` or the
    one in force), the vLLM release, ``context``, ``message`` and any other ``fields``
    (``request_id``, ``blocks_per_chunk``). The one shape every check site reports in."""
    counts.count_violation(site, check, action)
    counts.events.check_failed(
        site=site, check=check, policy=_policy if policy is None else policy, action=action,
        vllm_version=_vllm_version, **fields, context={} if context is None else context, message=message,
    )


@contextlib.contextmanager
def suppressed() -> Iterator[None]:
    """Inside this block every check behaves exactly like vLLM's plain assert, uncounted."""
    global suppress_depth
    suppress_depth += 1
    try:
        yield
    finally:
        suppress_depth -= 1


def reset() -> None:
    """Zero every in-process counter (not the Prometheus ones), forget the last failure and
    the requests queued to fail (:func:`kvguard.guards.policy.degrade.reset`)."""
    counts.reset()
    degrade.reset()
