"""Whole chunks only beyond this engine: a secondary tier and a peer never get a partly written chunk.

The invariant (issue 42, "sound across restarts and engines"): **every chunk this engine
hands to something that can outlive it or that another engine reads (a secondary tier of
vLLM's ``TieringOffloadingManager``, a peer fetching through it) is whole**: each of its
sub-blocks was copied from the GPU block the storing request's table held there. The copy
ledger (:mod:`kvguard.guards.checks.copy_ledger`) knows which chunks were written partly,
but it lives in this process; vLLM's fs, obj and p2p tiers (``vllm/v1/kv_offload/tiering/{fs,obj,p2p}``,
present in 0.25.1, 0.29.0, 0.33.0 and 0.34.0) keep chunks after the engine exits or serve them to
other engines, and no ledger there has heard of them. A partly written chunk is therefore
kept in this engine's CPU tier, where the ledger vouches for it, and never published
further: after a restart, or on a second engine sharing the directory, bucket or peer
group, every chunk a guarded engine wrote there is whole, so its loads need no ledger and
lose no legitimate whole-chunk hit.

Two paths take a chunk out of the CPU tier (read in ``tiering/manager.py`` of 0.25.1, 0.29.0,
0.33.0 and 0.34.0; the lab drives the first on every release with tiering):

1. **the cascade**: the manager pins the stored chunks and calls each secondary tier's
   ``submit_store(job)`` (``complete_store``; on 0.34.0 also the request-level cascade of
   chunks already in the CPU tier). :func:`install` wraps each tier's ``submit_store``
   (an instance attribute; vLLM's method runs unchanged) to hand the tier a copy of the
   job without the partly written keys and their CPU slots. The job id is kept, so the
   manager's own record of the job, which unpins every chunk it pinned when the tier
   reports the job finished, is untouched; a job left with no key never reaches the tier:
   kvguard reports it finished (``success``) on the tier's next ``get_finished_jobs``
   poll, which is all the manager does with a finished store job (``complete_read``, the
   unpin; read on 0.25.1 and 0.34.0), since not every tier finishes a job of no key
   (0.25.1's and 0.26.0's fs tier never does: :func:`_wrap_tier`).
2. **remote requesters** (the p2p tier's server, 0.34.0's kvcr tier): they ask the manager
   through its tier-facing parent, ``lookup(key, req_context, exclude_tier_idx=origin)``,
   and pin only what answers ``HIT``. :func:`install` wraps the manager's ``lookup`` (an
   instance attribute) so a call that names ``exclude_tier_idx`` gets ``MISS`` for a partly
   written key; the engine's own lookups (no ``exclude_tier_idx``) are untouched. Bound by
   signature: a release whose ``lookup`` takes no ``exclude_tier_idx`` (0.25.1) has no
   remote requester. Every such lookup is counted; the ``check_failed`` event is logged
   once per key (the last :data:`REPORTED_KEYS` keys remembered), since a peer may poll
   the same key every step.

Policy: ``guard`` and ``strict`` withhold (action ``chunk_withheld``; ``strict`` does not
raise: vLLM has no assert here and the engine itself serves correct KV, the ledger
guarding its own loads); ``observe`` counts (``continued``) and publishes. With
withholding on, no secondary tier holds a partial copy from this engine, so the ledger
may forget a key when the CPU tier evicts it or stores it whole again, as without
tiering (:func:`ledger_may_forget`).

Not covered (docs/degrade.md "Copy coverage"): a tier written by an engine without
kvguard, under ``observe``, or with ``admission:copy_coverage`` disabled may hold partial
chunks that no guard can tell from whole ones; clear such a tier's directory or bucket
when enabling the guard.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import sys
from typing import Any

from kvguard.guards import names
from kvguard.guards.checks import copy_ledger
from kvguard.guards.policy import runtime
from kvguard.guards.telemetry import counts

__all__ = ["INSTALLED_ATTR", "install", "ledger_may_forget", "partial_keys_of", "withholds"]

#: attribute on the tiering manager instance: the ledger its wrappers read (set by :func:`install`)
INSTALLED_ATTR = "_kvguard_tier_publish"
#: the site id the counters and events name
SITE_ID = "tiering:tier_publish"


def withholds() -> bool:
    """Whether the policy in force withholds partly written chunks (``guard``, ``strict``)."""
    return runtime.policy() != names.POLICY_OBSERVE


def ledger_may_forget(manager: Any) -> bool:
    """Whether the copy ledger of a connector scheduler whose manager is ``manager`` may
    forget a key on a CPU eviction or a whole re-store: without secondary tiers, or with
    them when :func:`install` withholds partial chunks from them (no tier then holds a
    partial copy from this engine)."""
    tiers = getattr(manager, "secondary_tiers", None)
    return not tiers or withholds()


def partial_keys_of(ledger: copy_ledger.CopyLedger, keys: Any) -> list[bool]:
    """Per key of ``keys``: whether the ledger holds it as partly written in any KV cache
    group. Every key is partial when the ledger is unreadable (it cannot vouch for any)."""
    if ledger.unreadable is not None:
        return [True] * len(keys)
    groups = [g for g in ledger.groups if g]
    if not groups:
        return [False] * len(keys)
    return [any(key in g for g in groups) for key in keys]


def _slot_field(job: Any) -> str | None:
    """The job's CPU slot field (``chunk_ids`` 0.29+, ``block_ids`` 0.25's ``JobMetadata``)."""
    for name in ("chunk_ids", "block_ids"):
        if hasattr(job, name):
            return name
    return None


def _without(job: Any, keep: list[bool]) -> Any:
    """A copy of ``job`` with only the keys (and their CPU slots) where ``keep`` is True;
    same job id. Raises ``TypeError`` for a job kvguard cannot copy (not a dataclass or a
    named tuple, or no slot field)."""
    slots_name = _slot_field(job)
    if slots_name is None:
        raise TypeError(f"{type(job).__qualname__} has no chunk_ids / block_ids field")
    keys = [k for k, kept in zip(list(job.keys), keep) if kept]
    slots = getattr(job, slots_name)
    if hasattr(slots, "shape"):  # numpy: keep the array type the tier indexes
        import numpy as np

        slots = slots[np.asarray(keep, dtype=bool)]
    else:
        slots = [s for s, kept in zip(list(slots), keep) if kept]
    fields = {"keys": keys, slots_name: slots}
    if dataclasses.is_dataclass(job):
        return dataclasses.replace(job, **fields)
    if hasattr(job, "_replace"):
        return job._replace(**fields)
    raise TypeError(f"{type(job).__qualname__} is neither a dataclass nor a named tuple")


#: remote-lookup keys whose ``check_failed`` event was logged, per manager (oldest forgotten
#: past :data:`REPORTED_KEYS`): a peer that polls a partial key every step is counted on
#: every lookup but logged once per key (a burst is one event, not one line per poll)
REPORTED_ATTR = "_kvguard_tier_publish_reported"
REPORTED_KEYS = 1024


def _first_report(manager: Any, key: Any) -> bool:
    """True the first time ``key``'s remote lookup is reported on ``manager`` (bounded)."""
    seen = manager.__dict__.get(REPORTED_ATTR)
    if seen is None:
        seen = manager.__dict__[REPORTED_ATTR] = collections.OrderedDict()
    if key in seen:
        seen.move_to_end(key)
        return False
    seen[key] = None
    if len(seen) > REPORTED_KEYS:
        seen.popitem(last=False)
    return True


def _count(kind: str, withheld: int, tier: int | None, policy: str, action: str, log: bool = True) -> None:
    if not log:
        counts.count_violation(SITE_ID, names.CHECK_TIER_PUBLISH, action)
        return
    runtime.report_violation(
        SITE_ID, names.CHECK_TIER_PUBLISH, action, policy=policy,
        context={"path": kind, "tier": tier, "partial_chunks": withheld},
        message=f"{withheld} partly written chunk(s) "
        + ("withheld from " if action == names.ACTION_CHUNK_WITHHELD else "published to ")
        + (f"secondary tier {tier}" if kind == "cascade" else "a remote requester"),
    )


def job_result(tier: Any, job_id: Any) -> Any | None:
    """A successful ``JobResult`` for store job ``job_id`` that moved no byte
    (``transfer_bytes=0`` where the class declares it), of the class the tier's own module
    reports with (``vllm.v1.kv_offload.tiering.base.JobResult``, a dataclass whose declared
    fields include ``job_id`` and ``success``; the others have defaults on 0.25.1 to
    0.34.0); ``None`` when the tier's module has no such class."""
    module = sys.modules.get(type(tier).__module__)
    cls = getattr(module, "JobResult", None)
    if cls is None:
        base = sys.modules.get("vllm.v1.kv_offload.tiering.base")
        cls = getattr(base, "JobResult", None)
    if cls is None or not dataclasses.is_dataclass(cls):
        return None
    declared = {f.name for f in dataclasses.fields(cls)}
    if not {"job_id", "success"} <= declared:
        return None
    # nothing was transferred: a back-pressure detector that reads the bytes (0.33.0 on)
    # must not take the finished job for a fast store of every key
    extra = {"transfer_bytes": 0} if "transfer_bytes" in declared else {}
    return cls(job_id=job_id, success=True, **extra)


def _wrap_tier(index: int, tier: Any, ledger: copy_ledger.CopyLedger) -> None:
    """Wrap ``tier``'s ``submit_store`` (withhold the partial keys) and, for a job left with
    no key, its ``get_finished_jobs``: such a job never reaches the tier, and kvguard
    reports it finished on the tier's next poll, so the manager unpins its chunks as after
    any store (``complete_read``). Found by the lab's fs tier: vLLM 0.25.1's and 0.26.0's
    ``FileSystemTierManager.submit_store`` enqueues one task per key
    (``enqueue_store(job_id, len(keys), tasks)``), so a job of no key never finishes there:
    its chunks stayed pinned in the CPU tier and ``drain_jobs()`` waited forever."""
    submit = tier.submit_store
    finished = tier.get_finished_jobs
    done_here: list[Any] = []

    def submit_store(job: Any) -> Any:
        try:
            keys = list(job.keys)
            partial = partial_keys_of(ledger, keys) if keys else []
            n = sum(partial)
            if n:
                policy = runtime.policy()
                if policy == names.POLICY_OBSERVE:
                    _count("cascade", n, index, policy, names.ACTION_CONTINUED)
                else:
                    _count("cascade", n, index, policy, names.ACTION_CHUNK_WITHHELD)
                    if n == len(keys) and job_result(tier, job.job_id) is not None:
                        done_here.append(job.job_id)  # nothing to publish: finished here
                        return None
                    job = _without(job, [not p for p in partial])
        except Exception as error:  # guard code must never take the engine down
            counts.guard_error(names.STAGE_CHECK, error)
        return submit(job)

    def get_finished_jobs(*args: Any, **kwargs: Any) -> Any:
        out = finished(*args, **kwargs)
        if not done_here:
            return out
        try:
            results = list(out)
            while done_here:
                results.append(job_result(tier, done_here.pop(0)))
            return results
        except Exception as error:
            counts.guard_error(names.STAGE_CHECK, error)
            return out

    tier.submit_store = submit_store
    tier.get_finished_jobs = get_finished_jobs


def _wrap_lookup(manager: Any, ledger: copy_ledger.CopyLedger) -> bool:
    """Wrap the manager's ``lookup`` for remote requesters; False when its signature has no
    ``exclude_tier_idx`` (no remote path on this release)."""
    lookup = manager.lookup
    try:
        if "exclude_tier_idx" not in inspect.signature(lookup).parameters:
            return False
    except (TypeError, ValueError):
        return False

    def remote_aware_lookup(key: Any, req_context: Any, *args: Any, **kwargs: Any) -> Any:
        result = lookup(key, req_context, *args, **kwargs)
        if kwargs.get("exclude_tier_idx") is None:
            return result  # the engine's own lookup: the admission check judges its loads
        try:
            miss = getattr(type(result), "MISS", None)
            if miss is not None and result is not miss and partial_keys_of(ledger, [key])[0]:
                policy = runtime.policy()
                log = _first_report(manager, key)
                if policy == names.POLICY_OBSERVE:
                    _count("remote", 1, None, policy, names.ACTION_CONTINUED, log)
                else:
                    _count("remote", 1, None, policy, names.ACTION_CHUNK_WITHHELD, log)
                    return miss
        except Exception as error:
            counts.guard_error(names.STAGE_CHECK, error)
        return result

    manager.lookup = remote_aware_lookup
    return True


def install(manager: Any, ledger: copy_ledger.CopyLedger) -> bool:
    """Wrap ``manager``'s secondary tiers and remote lookups (module docstring) to read
    ``ledger``; once per manager (``INSTALLED_ATTR``). ``manager``: a connector scheduler's
    ``TieringOffloadingManager`` (anything with a non-empty ``secondary_tiers``; else
    nothing is done and False is returned). Never raises (counts ``stage="check"``)."""
    try:
        tiers = getattr(manager, "secondary_tiers", None)
        if not tiers or manager.__dict__.get(INSTALLED_ATTR) is not None:
            return False
        for index, tier in enumerate(tiers):
            _wrap_tier(index, tier, ledger)
        _wrap_lookup(manager, ledger)
        manager.__dict__[INSTALLED_ATTR] = ledger
        return True
    except Exception as error:
        counts.guard_error(names.STAGE_CHECK, error)
        return False
