"""A store is prepared only for a request the offloading manager still tracks (check
``store_after_finalize``).

End-to-end invariant: the connector's scheduler side tells its manager that a request
started (``on_new_request``) and that it finished (``on_request_finished``); between the
two the manager keeps per-request state, and its ``prepare_store`` reads that state by the
request's id. vLLM's ``TieringOffloadingManager`` (``vllm/v1/kv_offload/tiering/manager.py``,
0.25.1 onwards) reads ``self._req_state[req_context.req_id]`` in ``prepare_store`` and
deletes the entry in ``_maybe_finalize_request`` once the request finished with no
GPU->CPU store in flight. On vLLM 0.25.1 and 0.26.0 the connector's ``request_finished``
calls ``manager.on_request_finished`` *before* the store builder's last pass over the
finished request (``_build_store_jobs`` walks ``scheduler_output.finished_req_ids`` on the
next step to store the final chunks): a request that finishes with no store in flight and
a new chunk to store is finalized, then stored, and ``prepare_store`` dies with
``KeyError: '<request id>'``, taking EngineCore with it (vLLM #49635, "Final KV offload
store after request finalization crashes EngineCore"; fixed upstream by PR #49671, which
builds the final stores before ``on_request_finished``: that order is in 0.29.0's code and
later). From 0.29.0 on the read always finds its entry: the check stays installed there and
silent, for the next lifecycle regression (the upstream fix keeps the manager's read strict
on purpose, so that one surfaces as a crash). Found here by the differential fuzz on 0.26.0
(``kvguard fuzz --seed 2 --connector both``, example 114: vLLM alone dies, 1 of 2
requests unfinished).

What is read from the installed code (:func:`tracked_reads`), never from a release
number: in the manager class's own ``prepare_store`` source, every read
``self.<d>[<p>.req_id]`` (or of a local bound to ``<p>.req_id``; ``+=`` on it reads too) where ``<p>`` is a
parameter, and ``self.<d>`` is never tested with ``in`` / ``.get`` in that method: such a
read raises ``KeyError`` for a request ``<d>`` no longer holds. A class without such a read
is not wrapped (no cost). The refusal is vLLM's own: ``prepare_store`` is declared to
return ``None`` when "store cannot proceed" (checked on the method's return annotation),
and every release's store builder answers ``None`` by skipping the request's store for the
step (counting an allocation failure and cleaning the finished request up).

Action by policy:

- ``observe``: counted (``continued``); vLLM's call as it is (the engine dies as in vLLM).
- ``strict``: counted (``raised``), :class:`~kvguard.guards.checks.admission.counters.StrictFailure`.
- ``guard``: ``prepare_store`` is not called and answers ``None`` (``store_dropped``):
  nothing was allocated in the CPU tier, nothing is published, the finished request's
  final chunks are not offloaded (a later request recomputes them instead of loading
  them: never wrong KV, since an offload that did not happen cannot be read).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from typing import Any

from kvguard.guards import names
from kvguard.guards.checks.admission import counters
from kvguard.guards.policy import runtime

__all__ = ["tracked_reads", "manager_classes", "prepare_store_wrapper", "snapshot", "METHOD"]

PREFIX = "store_after_finalize:"
#: the manager method whose per-request reads are checked
METHOD = "prepare_store"

#: class -> (the dicts read by request id, the index of the request-context argument
#: after ``self``, its name): filled at install by :func:`manager_classes`
_READS: dict[type, tuple[tuple[str, ...], int, str]] = {}
#: type of a wrapped manager instance -> its :data:`_READS` entry found along its MRO (None:
#: none), so a ``prepare_store`` call walks the MRO once per type, not once per call;
#: cleared whenever :data:`_READS` changes
_BY_TYPE: dict[type, tuple[tuple[str, ...], int, str] | None] = {}


def _self_attr(node: ast.AST) -> str | None:
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "self"):
        return node.attr
    return None


def tracked_reads(func: Any) -> tuple[tuple[str, ...], str] | None:
    """``(dicts, param)`` for the method ``func``: the names ``d`` of every unguarded read
    ``self.d[param.req_id]`` in its source (module doc), sorted, and the parameter whose
    ``req_id`` keys them; None when the source has no such read, cannot be read, or the
    method is not declared to return ``None`` (no refusal vLLM's callers expect). Pure."""
    if not isinstance(func, types.FunctionType):
        return None
    try:
        source = textwrap.dedent(inspect.getsource(func))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return None
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    returns = ast.unparse(fn.returns) if fn.returns is not None else ""
    if "None" not in returns and "Optional" not in returns:
        return None
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)][1:]
    # locals bound to <param>.req_id (``req_id = req_context.req_id``)
    aliases: dict[str, str] = {}
    for node in ast.walk(fn):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Attribute) and node.value.attr == "req_id"
                and isinstance(node.value.value, ast.Name) and node.value.value.id in params):
            aliases[node.targets[0].id] = node.value.value.id
    guarded: set[str] = set()
    reads: dict[str, set[str]] = {}
    # ``self.d[k] += 1`` reads the entry too (its target's context is Store)
    augmented = {id(node.target) for node in ast.walk(fn) if isinstance(node, ast.AugAssign)}
    for node in ast.walk(fn):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            for comparator in node.comparators:
                if (attr := _self_attr(comparator)) is not None:
                    guarded.add(attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("get", "setdefault", "pop")):
            if (attr := _self_attr(node.func.value)) is not None:
                guarded.add(attr)
        elif isinstance(node, ast.Subscript) and (isinstance(node.ctx, ast.Load) or id(node) in augmented):
            attr = _self_attr(node.value)
            key = node.slice
            param = None
            if isinstance(key, ast.Attribute) and key.attr == "req_id" and isinstance(key.value, ast.Name):
                param = key.value.id if key.value.id in params else None
            elif isinstance(key, ast.Name):
                param = aliases.get(key.id)
            if attr is not None and param is not None:
                reads.setdefault(param, set()).add(attr)
    for param, dicts in reads.items():
        unguarded = tuple(sorted(dicts - guarded))
        if unguarded:
            return unguarded, param
    return None


def manager_classes(module: types.ModuleType) -> list[str]:
    """Qualified names of the classes of ``module`` that define :data:`METHOD` themselves
    with a :func:`tracked_reads` answer; each is remembered for the wrapper. Errors: none
    (a class whose method cannot be read is left out)."""
    out: list[str] = []
    for name, value in vars(module).items():
        if not isinstance(value, type) or value.__module__ != module.__name__:
            continue
        method = vars(value).get(METHOD)
        found = tracked_reads(method)
        if found is None:
            continue
        dicts, param = found
        try:
            index = list(inspect.signature(method).parameters).index(param) - 1
        except (TypeError, ValueError):
            continue
        _READS[value] = (dicts, index, param)
        _BY_TYPE.clear()
        out.append(name)
    return out


def snapshot() -> dict[str, int]:
    """In-process counts since :func:`counters.reset`: ``evaluated`` (stores checked),
    ``store_dropped``, ``continued``, ``raised`` and ``violations`` (their sum)."""
    out = {k: counters.stats.get(PREFIX + k, 0) for k in ("evaluated", "store_dropped", "continued", "raised")}
    out["violations"] = out["store_dropped"] + out["continued"] + out["raised"]
    return out


def _untracked(instance: Any, args: tuple, kwargs: dict) -> str | None:
    """The request id of this ``prepare_store`` call when a dict it reads by that id no
    longer holds it; None otherwise."""
    kind = type(instance)
    try:
        known = _BY_TYPE[kind]
    except KeyError:
        known = _BY_TYPE[kind] = next(
            (_READS[klass] for klass in kind.__mro__ if klass in _READS), None)
    if known is None:
        return None
    dicts, index, param = known
    ctx = args[index] if len(args) > index else kwargs.get(param)
    req_id = getattr(ctx, "req_id", None)
    if req_id is None:
        return None
    for d in dicts:
        held = getattr(instance, d, None)
        if held is not None and req_id not in held:
            return req_id
    return None


def prepare_store_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``wrapt`` wrapper of an offloading manager's ``prepare_store(keys, req_context)``:
    a store for a request the manager no longer tracks is handled by policy (module doc).
    Returns vLLM's answer, or ``None`` (refused) under ``guard``. Raises
    :class:`~kvguard.guards.checks.admission.counters.StrictFailure` under ``strict``; an
    error of kvguard's own counts ``stage="check"`` and vLLM's call runs as it is."""
    if runtime.suppress_depth:
        return wrapped(*args, **kwargs)
    try:
        counters.bump(PREFIX + "evaluated")
        req_id = _untracked(instance, args, kwargs)
    except Exception as error:
        runtime.guard_error(names.STAGE_CHECK, error)
        req_id = None
    if req_id is None:
        return wrapped(*args, **kwargs)
    policy = runtime.policy()
    fields = {names.KEY_REQUEST_ID: req_id}
    if policy == names.POLICY_OBSERVE:
        _record(names.ACTION_CONTINUED, policy, fields)
        return wrapped(*args, **kwargs)
    if policy == names.POLICY_STRICT:
        _record(names.ACTION_RAISED, policy, fields)
        raise counters.StrictFailure(
            f"kvguard {names.CHECK_STORE_AFTER_FINALIZE}: a store for request {req_id!r}, which the offloading "
            f"manager ({type(instance).__name__}) already finalized")
    _record(names.ACTION_STORE_DROPPED, policy, fields)
    return None


def _record(action: str, policy: str, fields: dict[str, Any]) -> None:
    counters.record_check_failed(names.CHECK_STORE_AFTER_FINALIZE, names.STORE_AFTER_FINALIZE_SITE_ID, PREFIX,
                                 action, policy, fields)
