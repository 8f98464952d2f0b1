"""Where the admission checks run: vLLM's own lookup (``get_num_new_matched_tokens``).

:func:`admit` is every check of one lookup answer in order: the load and copy coverage of
a hit (:mod:`~kvguard.guards.checks.admission.loadable`), then the wait bound
(:mod:`kvguard.guards.checks.wait_bound`; a deferred answer's measure and reduced answer:
:mod:`~kvguard.guards.checks.admission.deferred`).

Where the check runs: in vLLM's own lookup. The instrumentor rewrites each
``return <answer>`` of ``get_num_new_matched_tokens`` into ``return
admit_return(self, request, num_computed_tokens, <answer>)`` (the ``admission_return``
kind of :mod:`kvguard.guards.hooking.rewrite`, compiled with the function's other sites, vLLM's
file and lines kept), so a lookup pays one call and no wrapper frame, no ``wrapt`` proxy
and no argument binding (on the bench trace of 0.33.0, 3 Dec 2026, ``bench/step_toggle.py``:
the admission part +2.6% of the median step through the pre-bound ``wrapt`` wrapper, +0.3%
in the code, its per-step ratio +2.5% and +2.3%, the latter with the removal counting
switched too; the README's Benchmark section has the figures).
The rewrite applies where the method's parameters are named ``request`` and
``num_computed_tokens`` and never rebound (read off its ``def``; every full release
0.21.0-0.34.0 qualifies); elsewhere the fallback is the ``wrapt`` wrap
(:func:`admission_wrapper`, arguments bound by ``inspect.signature`` positions:
:class:`_Binder`), with each scheduler pre-bound (:func:`attach`). In
:func:`~kvguard.guards.checks.admission.loadable.check_hit` the chunk bounds are computed inline, the plan is read off the scheduler's
``__dict__`` and the counters are incremented without a call.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Callable

from kvguard.guards import names
from kvguard.guards.checks import offload_plan, wait_bound
from kvguard.guards.checks.admission import counters, deferred, loadable
from kvguard.guards.checks.admission.counters import stats
from kvguard.guards.checks.load_coverage import load_set
from kvguard.guards.checks.offload_plan import PLAN_ATTR, Plan
from kvguard.guards.checks.tier_removals import unwatch_all as unwatch_removals
from kvguard.guards.names import GLOBAL_ADMIT_RETURN
from kvguard.guards.policy import recompute, runtime
from kvguard.guards.policy.recompute import RECOMPUTE_ATTR


def admit(cs: Any, request: Any, num_computed_tokens: int, answer: Any) -> Any:
    """Check vLLM's lookup ``answer`` for ``request`` (:func:`_admit`), then give the result
    to the wait bound (:mod:`kvguard.guards.checks.wait_bound`): a deferred answer (``None``) is an
    observation of the request's wait (which, stalled, may end it: a reduced answer under
    ``guard``), a number ends a deferral, an async load is watched until it is promoted.
    Raises ``AssertionError`` only under ``strict``.
    """
    out = _admit(cs, request, num_computed_tokens, answer)
    if not wait_bound._enabled:
        return out
    try:
        hit = out[0]
        if hit is None:
            return _wait_deferred(cs, request, num_computed_tokens, out)
        wait_bound.hit_answered(cs, request, bool(hit and out[1]))
    except AssertionError:
        raise  # strict
    except Exception as error:  # guard code never takes the engine down
        runtime.guard_error(names.STAGE_ADMISSION, error)
    return out


def _wait_deferred(cs: Any, request: Any, num_computed_tokens: int, answer: Any) -> Any:
    """The wait bound of a deferred answer (:mod:`kvguard.guards.checks.wait_bound`): observe the
    deferral with its progress measure (ready chunks of the awaited load set; 0 when the
    request's own transfers are in flight or the plan cannot be read) and, when the wait
    is stalled, act (guard: the longest ready hit, or the request failed alone)."""
    req_status = cs._req_status[request.request_id]
    plan = cs.__dict__.get(offload_plan.PLAN_ATTR) or offload_plan.get_plan(cs)
    readable = plan.__class__ is offload_plan.Plan and not getattr(req_status, "transfer_jobs", None)
    ready_chunks = 0
    end = 0
    if readable:
        group_states = req_status.group_states
        get = plan.getter()
        end = deferred.awaited_end(plan, group_states, request)
        if end > num_computed_tokens:
            ready = deferred.ready_pred(cs, group_states, get)
            ready_chunks = sum(
                1 for g, chunks in enumerate(load_set(plan.groups, num_computed_tokens, end)) for c in chunks
                if ready(g, c)
            )
    wait = wait_bound.observe_deferred(cs, request, ready_chunks)
    if wait is None:
        return answer
    hit = 0
    if readable and end > num_computed_tokens:
        hit = deferred.ready_hit(cs, plan, req_status.group_states, plan.getter(), num_computed_tokens,
                                 end - num_computed_tokens)
    return wait_bound.act_deferred(cs, wait, hit, answer)


def _admit(cs: Any, request: Any, num_computed_tokens: int, answer: Any) -> Any:
    """Check vLLM's lookup ``answer`` for ``request``; return it, a reduced one, or raise (strict).

    ``cs``: the ``OffloadingConnectorScheduler``; ``num_computed_tokens``: the local GPU
    prefix hit (tokens) passed to ``get_num_new_matched_tokens``; ``answer``: its
    ``(num_external_tokens | None, load_async)``. Returns ``answer`` itself when the load
    set is loadable or nothing is checked (a deferred answer is the wait bound's,
    :func:`admit`); under ``guard`` a new ``(reduced, load_async and reduced > 0)`` tuple.
    Raises ``AssertionError`` only under ``strict``.
    """
    try:
        hit = answer[0]
        if not hit:
            return answer
        return loadable.check_hit(cs, request, num_computed_tokens, answer, hit)
    except counters.StrictFailure as failure:
        raise AssertionError(str(failure)) from None
    except Exception as error:  # guard code never takes the engine down
        runtime.guard_error(names.STAGE_ADMISSION, error)
        return answer


TABLE_ATTR = wait_bound.TABLE_ATTR


class _Binder:
    """Where ``request`` and ``num_computed_tokens`` sit in a ``get_num_new_matched_tokens``
    call, read once from ``inspect.signature`` of vLLM's method.

    ``Signature.bind`` costs several microseconds a call (7.5 us measured on a loaded
    2-core machine: more than the check itself), so the positions are taken from the
    signature once and each call reads ``kwargs[name]`` or ``args[position]``; any other
    call shape (defaults, ``*args``) goes through ``Signature.bind``.
    """

    __slots__ = ("sig", "slots", "positions", "min_args")

    def __init__(self, wrapped: Any) -> None:
        self.sig = inspect.signature(wrapped)
        params = list(self.sig.parameters.values())
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        slots = []
        for name in ("request", "num_computed_tokens"):
            index = next((i for i, p in enumerate(params) if p.name == name), None)
            ok = index is not None and all(p.kind in positional for p in params[: index + 1])
            slots.append((name, index if ok else None, params[index].kind if index is not None else None))
        self.slots = tuple(slots)
        # vLLM's own call shape, ``(request, num_computed_tokens)`` passed positionally:
        # two tuple reads, no loop (both parameters positional, found above)
        indices = tuple(index for _, index, _ in slots)
        self.positions = indices if None not in indices else None
        self.min_args = max(indices) + 1 if self.positions is not None else 0

    def bind(self, args: tuple, kwargs: dict) -> tuple[Any, int]:
        """``(request, num_computed_tokens)``; ``TypeError`` when the call does not bind."""
        positions = self.positions
        if positions is not None and not kwargs and len(args) >= self.min_args:
            return args[positions[0]], args[positions[1]]
        out = []
        for name, index, kind in self.slots:
            if kind in _BY_NAME and name in kwargs:
                out.append(kwargs[name])
            elif index is not None and index < len(args):
                out.append(args[index])
            else:
                bound = self.sig.bind(*args, **kwargs)
                return bound.arguments["request"], bound.arguments["num_computed_tokens"]
        return out[0], out[1]


_BY_NAME = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


_BINDERS: dict[Any, _Binder] = {}


def _bind(wrapped: Any, args: tuple, kwargs: dict) -> tuple[Any, int]:
    """``(request, num_computed_tokens)`` of a ``get_num_new_matched_tokens`` call, by signature
    (the :class:`_Binder` of the function, built once)."""
    func = getattr(wrapped, "__func__", wrapped)
    binder = _BINDERS.get(func)
    if binder is None:
        binder = _BINDERS[func] = _Binder(wrapped)
    return binder.bind(args, kwargs)


#: > 0 while :func:`unwrapped_lookup`'s call of vLLM's lookup runs (the replay harness'
#: driven hits: it caps the answer, then admits it itself). A module global, not a
#: thread-local, read once per answer: vLLM's scheduler makes its lookups from one thread.
_suspended = 0


def admit_return(cs: Any, request: Any, num_computed_tokens: int, answer: Any) -> Any:
    """The admission check where vLLM's rewritten lookup calls it: on each ``return`` of
    ``get_num_new_matched_tokens`` (the ``admission_return`` rewrite of
    :mod:`kvguard.guards.hooking.rewrite`: no wrapper frame, no argument binding).

    ``cs``, ``request``, ``num_computed_tokens``: the method's own ``self`` and arguments
    (tokens); ``answer``: the ``(num_external_tokens | None, load_async)`` it is returning.
    Returns what the method returns instead: :func:`admit`'s result for a hit or a deferred
    answer (the wait bound's), ``answer`` itself otherwise. Raises ``AssertionError`` only
    under ``strict`` (from :func:`admit`); an error of kvguard's counts ``stage="admission"``
    and returns ``answer``.
    """
    if _suspended:
        return answer
    try:
        hit = answer[0]
        if not hit:  # None (deferred) or 0: no hit to check
            if hit is None and wait_bound._enabled:
                return admit(cs, request, num_computed_tokens, answer)  # the wait bound
            table = cs.__dict__.get(TABLE_ATTR)
            if table is not None and table.waits:  # a deferral, if any, ended
                wait_bound.answered(cs, request.request_id)
            return answer
        if cs.__dict__.get(RECOMPUTE_ATTR):  # a request kvguard recomputed loads nothing
            out = recompute.without_load(cs, request, answer)
            if out is not answer:
                wait_bound.hit_answered(cs, request, False)
                return out
        # a kept verdict asked again (vLLM asks the head of the waiting queue again
        # every step until its blocks fit: 1,424 of 1,885 lookups on the bench trace,
        # 0.33.0): loadable.verdict_kept and wait_bound.hit_answered written inline,
        # since each Python call here costs about a microsecond cold (issue 31,
        # bench/in_place_cost.py: 5.6 us per reused answer through three calls)
        plan = cs.__dict__.get(PLAN_ATTR)
        if plan.__class__ is Plan:
            rid = request.request_id
            kept = plan.verdicts.get(rid)
            epoch = plan.epoch
            if (kept is not None and epoch is not None and kept[0] == epoch.n
                    and kept[2] == num_computed_tokens and kept[3] == hit):
                req_status = cs._req_status.get(rid)
                if kept[1] is req_status and getattr(req_status, "partial_tail_boundary", None) is None:
                    stats["reused"] += 1
                    if wait_bound._enabled:
                        table = cs.__dict__.get(TABLE_ATTR)
                        if table is not None:
                            if table.waits:
                                wait_bound.answered(cs, rid)
                            if answer[1] and table.stepped:
                                table.async_loads[rid] = request
                    return answer
    except Exception as error:
        runtime.guard_error(names.STAGE_ADMISSION, error)
        return answer
    return admit(cs, request, num_computed_tokens, answer)


def admits_inline(method: Any) -> bool:
    """True when ``method`` (a connector scheduler class's ``get_num_new_matched_tokens``,
    as ``inspect.getattr_static`` finds it) is vLLM's function with kvguard's
    ``admission_return`` rewrite in its code (it reads the injected check by name)."""
    code = getattr(method, "__code__", None)
    return code is not None and GLOBAL_ADMIT_RETURN in code.co_names


def _call_unchecked(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    global _suspended
    _suspended += 1
    try:
        return call(*args, **kwargs)
    finally:
        _suspended -= 1


def admission_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``wrapt`` wrapper of ``OffloadingConnectorScheduler.get_num_new_matched_tokens``.

    Calls vLLM's method, then :func:`admit` on its answer (arguments bound by
    ``inspect.signature``, see :class:`_Binder`). An answer without a hit (``None`` or
    0 tokens) returns at once, unbound, except a deferred answer (``None``), which goes to
    the wait bound. A binding error counts ``stage="admission"``
    and returns vLLM's answer. The fallback where the ``admission_return`` rewrite does not
    apply (:func:`kvguard.guards.hooking.rewrite.admission_return_names`): a lookup that rebinds
    its arguments, or whose parameters are named otherwise.
    """
    if instance is None:
        return wrapped(*args, **kwargs)
    answer = wrapped(*args, **kwargs)
    try:
        if not answer[0]:  # None (deferred) or 0: no hit to check
            if (answer[0] is None and wait_bound._enabled) or TABLE_ATTR in instance.__dict__:
                request, num_computed_tokens = _bind(wrapped, args, kwargs)
                if answer[0] is None:
                    return admit(instance, request, num_computed_tokens, answer)  # the wait bound
                wait_bound.answered(instance, request.request_id)
            return answer
        request, num_computed_tokens = _bind(wrapped, args, kwargs)
        if instance.__dict__.get(RECOMPUTE_ATTR):  # a request kvguard recomputed loads nothing
            out = recompute.without_load(instance, request, answer)
            if out is not answer:
                wait_bound.hit_answered(instance, request, False)
                return out
    except Exception as error:
        runtime.guard_error(names.STAGE_ADMISSION, error)
        return answer
    return admit(instance, request, num_computed_tokens, answer)


#: connector schedulers given an instance-level wrapper by :func:`attach` (for :func:`detach_all`)
_attached: "weakref.WeakSet[Any]" = weakref.WeakSet()


def attach(cs: Any) -> bool:
    """Give the connector scheduler ``cs`` its own pre-bound wrapper of the lookup, where
    one is needed; True when attached.

    - vLLM's lookup carries the check in its own code (:func:`admits_inline`): nothing to
      attach, every scheduler calls vLLM's method directly.
    - the fallback, the class-level wrap (:func:`admission_wrapper`): every scheduler gets
      ``wrapt.FunctionWrapper(<vLLM's method bound to cs>, admission_wrapper)``: vLLM calls
      ``self.connector_scheduler.get_num_new_matched_tokens(...)`` on every waiting request
      every step, and through the class-level wrap each call first binds the descriptor (a
      ``BoundFunctionWrapper`` and a bound method, allocated per call); an instance attribute
      skips that (measured warm, 2 Dec 2026: about 1.1 us per call through the class wrap
      against 0.43 us pre-bound, a trivial wrapped method).

    Behaviour is the same either way. Only where the class's attribute is kvguard's (a
    subclass that overrides the method keeps the class path, through ``super()``) and
    ``cs`` has no instance attribute of that name already (someone else's wrapper is never
    replaced). :func:`detach_all` removes it (``uninstall``).
    """
    if "get_num_new_matched_tokens" in cs.__dict__:
        return False
    attr = inspect.getattr_static(type(cs), "get_num_new_matched_tokens", None)
    if admits_inline(attr):
        return False  # the rewritten method is all it takes
    if getattr(attr, "_self_wrapper", None) is admission_wrapper:
        target, wrapper = attr.__wrapped__, admission_wrapper
    else:
        return False
    import wrapt

    cs.__dict__["get_num_new_matched_tokens"] = wrapt.FunctionWrapper(target.__get__(cs, type(cs)), wrapper)
    _attached.add(cs)
    return True


def attach_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``wrapt`` wrapper of the connector scheduler's ``__init__``: vLLM's constructor,
    then :func:`attach` (an error counts ``stage="admission"``; vLLM's rewritten lookup, or
    the class-level wrap, still checks every hit)."""
    result = wrapped(*args, **kwargs)
    try:
        attach(instance)
        wait_bound.attach(instance)
    except Exception as error:
        runtime.guard_error(names.STAGE_ADMISSION, error)
    return result


def detach_all() -> None:
    """Remove every instance-level wrapper :func:`attach` set (vLLM's lookup is the class's
    method again on those schedulers) and the cache policies' removal counters
    (:func:`kvguard.guards.checks.tier_removals.unwatch_all`: no kept verdict is reused after)."""
    for cs in list(_attached):
        attr = cs.__dict__.get("get_num_new_matched_tokens")
        if getattr(attr, "_self_wrapper", None) is admission_wrapper:
            del cs.__dict__["get_num_new_matched_tokens"]
    _attached.clear()
    wait_bound.detach_all()
    unwatch_removals()


def unwrapped_lookup(cs: Any) -> tuple[Callable[..., Any], bool]:
    """``(vLLM's lookup of cs without kvguard's check, whether kvguard's admission applies to it)``.

    For a caller that must act between vLLM's lookup and kvguard's check (the replay
    harness' driven hits): call the first, change the answer, then :func:`admit` it when
    the second is True. Where the check is in vLLM's rewritten code (:func:`admits_inline`)
    the first runs that code with :func:`admit_return` passing answers through.
    """
    attr = inspect.getattr_static(type(cs), "get_num_new_matched_tokens", None)
    if admits_inline(attr):
        return functools.partial(_call_unchecked, attr.__get__(cs, type(cs))), True
    if getattr(attr, "_self_wrapper", None) is admission_wrapper:
        return attr.__wrapped__.__get__(cs, type(cs)), True
    return cs.get_num_new_matched_tokens, False
