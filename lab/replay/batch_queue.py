"""Async scheduling in the replay: vLLM's ``AsyncScheduler`` driven through a batch queue.

With ``--async-scheduling`` (``SchedulerConfig.async_scheduling``), vLLM's EngineCore
builds the scheduler class ``SchedulerConfig.get_scheduler_cls()`` returns
(``vllm.v1.core.sched.async_scheduler.AsyncScheduler``) and, because
``max_concurrent_batches`` is then 2, steps with ``EngineCore.step_with_batch_queue``
instead of ``EngineCore.step``: it schedules step N+1 (and hands it to the worker) before
step N's model output is given to ``Scheduler.update_from_output``. ``AsyncScheduler``
counts the token each scheduled step will sample as an output placeholder
(``Request.num_output_placeholders``) until that output is processed. That lag is the
timing under which a request can finish, be preempted or be aborted while one of its
steps (and the connector metadata built for it) is still in flight.

This module holds the two pieces the harness (:mod:`.harness`) needs and nothing else:

- :func:`unsupported`: why the installed vLLM cannot be driven this way (``None`` when it
  can), found by class, field and attribute, never by version number;
- :class:`BatchQueue`: the order of ``EngineCore.step_with_batch_queue`` as read on vLLM
  0.33.0 (``vllm/v1/engine/core.py``), with a queue depth of ``max_concurrent_batches``.

The order followed (vLLM 0.33.0 ``EngineCore.step_with_batch_queue``): if the scheduler
has requests, ``schedule()``, then ``execute_model(scheduler_output, non_block=True)``
(the worker runs that step's connector calls and forward at dispatch; only the sampled
tokens come back later), then the step is put at the head of the queue; if the queue is
not full and the step scheduled tokens (or the scheduler still has requests), return
without processing any output; otherwise pop the oldest step and give its output to
``update_from_output`` (aborts received meanwhile are processed just before that).
vLLM 0.21.0's version differs in one respect (measured by reading it): it also
processes the oldest output at once when that output is already done (``future.done()``),
which on a GPU depends on timing; the replay always lags, as 0.33.0 does when the GPU is
busy. The harness calls ``schedule()`` on every step, as its synchronous path does
(EngineCore keeps stepping while the connector has pending work).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

#: The queue depth the replay drives (EngineCore's ``max_concurrent_batches`` with async
#: scheduling, no pipeline parallelism).
DEPTH = 2


def unsupported() -> str | None:
    """Why the installed vLLM's async scheduling cannot be driven by the replay, or ``None``.

    Checked by structure: ``SchedulerConfig`` has the field ``async_scheduling`` and
    ``get_scheduler_cls``; ``vllm.v1.core.sched.async_scheduler.AsyncScheduler`` exists and
    subclasses ``Scheduler``; ``Request`` keeps ``num_output_placeholders`` (its
    ``__init__`` sets it). Measured present on 0.21.0, 0.25.1 and 0.33.0. Never raises;
    without vLLM the reason says so.
    """
    try:
        from vllm.config import SchedulerConfig
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.request import Request
    except ImportError:
        return "vLLM is not installed"
    try:
        fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    except TypeError:
        fields = set(getattr(SchedulerConfig, "__annotations__", {}))
    if "async_scheduling" not in fields or not hasattr(SchedulerConfig, "get_scheduler_cls"):
        return "SchedulerConfig has no async_scheduling field (or no get_scheduler_cls)"
    try:
        from vllm.v1.core.sched import async_scheduler
    except ImportError:
        return "vllm.v1.core.sched.async_scheduler does not exist"
    cls = getattr(async_scheduler, "AsyncScheduler", None)
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        return "vllm.v1.core.sched.async_scheduler has no AsyncScheduler subclassing Scheduler"
    try:
        init_source = inspect.getsource(Request.__init__)
    except (OSError, TypeError):
        init_source = ""
    if "num_output_placeholders" not in init_source:
        return "Request has no num_output_placeholders (no output placeholders to lag on)"
    return None


def require_supported(version: str) -> None:
    """Raise ``RuntimeError`` naming the trace field when :func:`unsupported` gives a reason."""
    why = unsupported()
    if why is not None:
        raise RuntimeError(
            f"vLLM {version}: {why}, so a trace cannot set async_scheduling "
            "(geometry.async_scheduling) on this release"
        )


def queue_depth(vllm_config: Any) -> int:
    """EngineCore's batch queue size for ``vllm_config`` (number of steps in flight).

    vLLM 0.25.1 and 0.33.0: ``VllmConfig.max_concurrent_batches``; 0.21.0 asks the
    executor (``UniProcExecutor.max_concurrent_batches``, a ``cached_property`` there,
    evaluated from the class's own function with this config's ``scheduler_config`` and
    ``parallel_config``). 2 with
    async scheduling and no pipeline parallelism, 1 without (measured on 0.21.0, 0.25.1,
    0.33.0).

    Raises:
        RuntimeError: neither place exists in the installed vLLM.
    """
    depth = getattr(vllm_config, "max_concurrent_batches", None)
    if isinstance(depth, int):
        return depth
    try:
        from vllm.v1.executor.uniproc_executor import UniProcExecutor
    except ImportError as exc:
        raise RuntimeError(f"no max_concurrent_batches in this vLLM ({exc})") from None
    prop = inspect.getattr_static(UniProcExecutor, "max_concurrent_batches", None)
    if isinstance(prop, property):
        fn = prop.fget
    elif isinstance(prop, functools.cached_property):  # 0.21.0
        fn = prop.func
    else:
        raise RuntimeError("UniProcExecutor.max_concurrent_batches is not a property")
    fake = SimpleNamespace(
        vllm_config=vllm_config,
        scheduler_config=vllm_config.scheduler_config,
        parallel_config=vllm_config.parallel_config,
    )
    return int(fn(fake))


@dataclass
class BatchQueue:
    """Steps handed to the worker whose output has not been processed yet (oldest last).

    ``depth`` 1 is the synchronous ``EngineCore.step`` (every output is processed in the
    step that scheduled it). Counters (the evidence that the lag is real; both are 0
    with depth 1):

    - ``scheduled_ahead``: ``schedule()`` calls made while an earlier step's output was
      still in the queue;
    - ``placeholder_requests``: (step, request) pairs where a request was scheduled while
      it had output placeholders (``num_output_placeholders > 0``: a token of an earlier
      step not yet processed).
    """

    depth: int = 1
    queue: deque[tuple[Any, Any]] = field(default_factory=deque)
    scheduled_ahead: int = 0
    placeholder_requests: int = 0
    max_placeholders: int = 0

    def before_schedule(self, scheduler: Any) -> dict[str, int]:
        """Note the lag before ``schedule()``: the placeholders of running requests."""
        if self.queue:
            self.scheduled_ahead += 1
        out = {}
        for req in getattr(scheduler, "running", ()):
            n = int(getattr(req, "num_output_placeholders", 0) or 0)
            if n:
                out[req.request_id] = n
        return out

    def after_schedule(self, sched_out: Any, placeholders: dict[str, int]) -> None:
        """Count the requests this step scheduled while they had placeholders."""
        for rid in sched_out.num_scheduled_tokens:
            n = placeholders.get(rid, 0)
            if n:
                self.placeholder_requests += 1
                self.max_placeholders = max(self.max_placeholders, n)

    def push(self, sched_out: Any, model_out: Any, has_requests: bool) -> list[tuple[Any, Any]]:
        """Queue one executed step; the (scheduler output, model output) pairs to process now.

        As ``step_with_batch_queue``: nothing while the queue is not full and the step
        scheduled tokens or the scheduler still has requests; else the oldest step.
        """
        self.queue.appendleft((sched_out, model_out))
        executed = sched_out.total_num_scheduled_tokens > 0
        if len(self.queue) < self.depth and (executed or has_requests):
            return []
        return [self.queue.pop()]

    def drain(self) -> list[tuple[Any, Any]]:
        """Every queued step, oldest first (the engine processes them before it idles)."""
        out = []
        while self.queue:
            out.append(self.queue.pop())
        return out
