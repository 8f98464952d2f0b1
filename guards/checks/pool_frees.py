"""A connector frees each GPU block once per call (check ``gpu_free_once``).

End-to-end invariant: vLLM's GPU ``BlockPool`` keeps its free queue a doubly linked list
holding each free block once; every later allocation takes blocks from it, so a block in it
twice is handed to two readers (wrong KV), and the list's own asserts end the engine
(``FreeKVCacheBlockQueue.popleft_n`` / ``append_n``). ``BlockPool.free_blocks`` decrements
every block of its argument and then appends those at ``ref_cnt == 0`` (0.21.0,
``v1/core/block_pool.py``): a block listed twice in one call that reaches 0 is appended twice.

Whether the installed release enqueues such a block twice is read off its own code
(:func:`duplicates_corrupt`: 0.21.0 does; 0.34.0 tests each block right after its
decrement and enqueues it once, so there the check stays silent). Where it breaks (the
lab's SimpleCPUOffloadConnector fuzz on vLLM 0.21.0, seeds 4242 and 5151): one store event of the connector names a GPU block twice (two requests sharing a
prefix block stored in one step), the connector touched it once per pair and, at the
event's completion, releases it with one ``free_blocks`` call listing it twice
(``_process_store_completion``); the queue is corrupted, later requests read KV another
request writes, and the engine dies in the pool's asserts. Seen with kvguard and without.

The check wraps the GPU block pool the connector is given (its ``bind_gpu_block_pool``,
found by structure on both connectors' scheduler sides) in a proxy whose ``free_blocks``
looks for a block listed more than once (every other call and attribute is the pool's
own). Action by policy:

- ``observe``: counted (``continued``); vLLM's call as it is.
- ``strict``: counted (``raised``), :class:`~kvguard.guards.checks.admission.counters.StrictFailure`.
- ``guard``: the call is split into rounds that each list a block once, in the call's
  order (``free_split``): the same decrements, each block appended once when it reaches 0.
  Nothing else changes (the pairs were copied, both CPU copies hold the block's KV).
"""

from __future__ import annotations

from typing import Any

import wrapt

from kvguard.guards import names
from kvguard.guards.checks.admission import counters
from kvguard.guards.policy import runtime

__all__ = ["GuardedBlockPool", "bind_wrapper", "rounds", "snapshot", "duplicates_corrupt"]

PREFIX = "gpu_free_once:"


def rounds(blocks: list[Any]) -> list[list[Any]]:
    """``blocks`` split into lists that each hold a block (by identity) at most once: the
    first occurrences in order, then the second ones, and so on. Pure."""
    out: list[list[Any]] = []
    seen_per_round: list[set[int]] = []
    for block in blocks:
        key = id(block)
        for i, seen in enumerate(seen_per_round):
            if key not in seen:
                seen.add(key)
                out[i].append(block)
                break
        else:
            seen_per_round.append({key})
            out.append([block])
    return out


_corrupts: dict[type, bool] = {}


def duplicates_corrupt(pool_type: type) -> bool:
    """Whether the installed ``pool_type.free_blocks`` enqueues a block listed twice twice,
    found by running it on a stand-in pool (its queue records what is enqueued) with one
    block listed twice at ``ref_cnt`` 2: True on 0.21.0 (it decrements every block, then
    appends those at 0), False where the release tests each block right after its
    decrement (0.34.0: once). A stand-in the release's code cannot run on counts as True
    (the split is harmless: the same decrements). Cached per class."""
    known = _corrupts.get(pool_type)
    if known is not None:
        return known
    from types import SimpleNamespace

    queued: list[Any] = []
    queue = SimpleNamespace(append_n=queued.extend, prepend_n=queued.extend)
    block = SimpleNamespace(is_null=False, ref_cnt=2, block_hash=None, pool=None, block_id=1)
    stand_in = SimpleNamespace(free_block_queue=queue, enable_caching=True, _weak_self=None)
    try:
        pool_type.free_blocks(stand_in, [block, block])
        result = queued.count(block) > 1
    except Exception:
        result = True
    _corrupts[pool_type] = result
    return result


def snapshot() -> dict[str, int]:
    """In-process counts since :func:`counters.reset`: ``evaluated`` (connector frees
    checked), ``free_split``, ``continued``, ``raised`` and ``violations`` (their sum)."""
    out = {k: counters.stats.get(PREFIX + k, 0) for k in ("evaluated", "free_split", "continued", "raised")}
    out["violations"] = out["free_split"] + out["continued"] + out["raised"]
    return out


def _record(action: str, policy: str, duplicated: int) -> None:
    counters.record_check_failed(names.CHECK_GPU_FREE_ONCE, names.GPU_FREE_ONCE_SITE_ID, PREFIX, action, policy,
                                 {names.KEY_DUPLICATED_BLOCKS: duplicated})


class GuardedBlockPool(wrapt.ObjectProxy):
    """vLLM's GPU ``BlockPool`` as a connector's scheduler side sees it (module doc)."""

    def free_blocks(self, ordered_blocks: Any, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``free_blocks``; a block listed twice is handled by policy (module doc).
        Raises :class:`~kvguard.guards.checks.admission.counters.StrictFailure` under ``strict``."""
        pool = self.__wrapped__
        blocks = list(ordered_blocks)
        if runtime.suppress_depth:
            return pool.free_blocks(blocks, *args, **kwargs)
        try:
            counters.bump(PREFIX + "evaluated")
            split = rounds(blocks) if len({id(b) for b in blocks}) != len(blocks) else None
            if split is not None and not duplicates_corrupt(type(pool)):
                split = None  # this release enqueues such a block once: nothing to guard
        except Exception as error:
            runtime.guard_error(names.STAGE_CHECK, error)
            split = None
        if split is None:
            return pool.free_blocks(blocks, *args, **kwargs)
        policy = runtime.policy()
        duplicated = len(blocks) - len(split[0])
        if policy == names.POLICY_OBSERVE:
            _record(names.ACTION_CONTINUED, policy, duplicated)
            return pool.free_blocks(blocks, *args, **kwargs)
        if policy == names.POLICY_STRICT:
            _record(names.ACTION_RAISED, policy, duplicated)
            raise counters.StrictFailure(
                f"kvguard {names.CHECK_GPU_FREE_ONCE}: a connector frees {duplicated} GPU block(s) twice in one "
                "BlockPool.free_blocks call (the free queue would hold them twice)")
        _record(names.ACTION_FREE_SPLIT, policy, duplicated)
        result = None
        for part in split:
            result = pool.free_blocks(part, *args, **kwargs)
        return result


def bind_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``wrapt`` wrapper of a connector scheduler side's ``bind_gpu_block_pool(pool)``: where
    the release's ``free_blocks`` enqueues a doubly listed block twice
    (:func:`duplicates_corrupt`), the connector keeps a :class:`GuardedBlockPool` of vLLM's
    pool (the scheduler's own calls to the pool are untouched); elsewhere vLLM's pool itself
    (nothing to guard, no per-free cost). An error of kvguard's counts ``stage="install"``."""
    try:
        pool = args[0] if args else kwargs["gpu_block_pool"]
        if isinstance(pool, GuardedBlockPool) or not duplicates_corrupt(type(pool)):
            return wrapped(*args, **kwargs)  # this release enqueues such a block once: no proxy, no cost
        return wrapped(GuardedBlockPool(pool))
    except Exception as error:
        runtime.guard_error(names.STAGE_INSTALL, error)
        return wrapped(*args, **kwargs)
