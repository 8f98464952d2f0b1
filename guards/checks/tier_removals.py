"""Which calls can take an entry out of the offload tier, found in the cache policy's source.

The admission check (:mod:`kvguard.guards.checks.admission`) reuses a verdict "this load set is
loadable" for a request whose lookup vLLM repeats every step: a request at the
head of the waiting queue whose GPU blocks do not fit yet is looked up again on each
step, with the same ``num_computed_tokens`` and the same answer. The verdict stays true
exactly as long as no entry it read has left the tier, because a ready entry stays ready
until it is removed: vLLM's ``BlockStatus`` / ``ChunkStatus`` start with ``ref_cnt = -1``
(not ready) in their ``__init__`` and the managers of 0.21.0-0.34.0 only set it to 0 on a
completed store and move it up and down by one around a load (read in each release's
``cpu/manager.py`` and ``cpu/policies/base.py``).

What removes an entry is derived, not listed: :func:`removal_calls` reads every method
of the policy's class (the object whose ``get`` the check reads, see
``offload_plan.policy_reader``) and finds each use of a dict that ``get`` reads:

- ``self.<d>.get(...)`` / ``.keys()`` / ``.values()`` / ``.items()`` / ``.move_to_end(...)``,
  ``self.<d>[k]`` read, ``k in self.<d>``, ``len(self.<d>)``, ``for k in self.<d>``: a read;
- ``self.<d>[k] = v`` where ``k`` is a parameter of the method: may replace an entry, so
  the call counts only when that key is already present (vLLM's ``insert`` of a new key
  does not count, a replacement would);
- anything else (``del self.<d>[k]``, ``.pop``, ``.popitem``, ``.clear``, ``.update``,
  rebinding ``self.<d>``, an alias, passing it elsewhere, a store with a computed key):
  a removal;
- a call of another method of ``self`` that removes: a removal (transitively).

On vLLM's ``LRUCachePolicy`` that finds ``remove``, ``evict`` and ``clear`` (the paths of
``complete_store(success=False)``, a full tier's ``prepare_store`` and ``reset_cache``)
and ``insert`` as a keyed store; on ``ARCCachePolicy`` also ``touch`` and
``on_request_finished`` (they move an entry between ``t1`` and ``t2``: counted, which is
safe). :func:`watch` puts a counting wrapper of each such method on the policy instance
(an instance attribute, as ``admission.attach`` does for the lookup); the
:class:`Epoch` it returns is bumped before and after each counted call, so a verdict
computed while another thread removes (0.33+ managers take a ``lock`` for that) is
stale once the call returns. A verdict is kept with the epoch read *before* its entries
were read and is reused only while the epoch is unchanged.

Where the source cannot be read or a method is not a plain function (a property, a
builtin), :func:`removal_calls` answers None and nothing is reused: the check runs on
every lookup, as before.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import weakref
from typing import Any, Callable

__all__ = ["Epoch", "removal_calls", "watch", "unwatch_all"]

#: dict methods that never take an entry out
_READS = frozenset({"get", "keys", "values", "items", "move_to_end", "copy", "__contains__", "__len__"})
#: attribute on a watched policy instance: its :class:`Epoch`
_EPOCH_ATTR = "_kvguard_removal_epoch"
#: attribute on a watched policy instance: the method names given a counting wrapper
_WRAPPED_ATTR = "_kvguard_removal_wrapped"

_watched: "weakref.WeakSet[Any]" = weakref.WeakSet()


class Epoch:
    """A counter of calls that may have removed an entry from one cache policy (``n``;
    None once :func:`unwatch_all` stopped counting)."""

    __slots__ = ("n", "__weakref__")

    def __init__(self) -> None:
        self.n: int | None = 0


def _methods(cls: type) -> dict[str, Callable[..., Any]] | None:
    """Every function defined on ``cls`` or a base (the most derived definition of each
    name), ``__init__`` and other dunders left out; None if one is not a plain function."""
    out: dict[str, Callable[..., Any]] = {}
    for klass in reversed(cls.__mro__[:-1]):  # object last: nothing of it
        for name, value in vars(klass).items():
            if name.startswith("__") and name.endswith("__"):
                out.pop(name, None)
                continue
            if isinstance(value, (staticmethod, classmethod)):
                out.pop(name, None)  # no ``self``: cannot reach the instance's dicts
                continue
            if isinstance(value, property):
                if any(f is not None for f in (value.fget, value.fset, value.fdel)):
                    return None  # code run on attribute access: not wrapped per call
                continue
            if callable(value):
                if not inspect.isfunction(value):
                    return None
                out[name] = value
            else:
                out.pop(name, None)
    return out


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _use_of(node: ast.Attribute, parent: dict[ast.AST, ast.AST], params: list[str]) -> str | tuple[int, str]:
    """How the expression ``self.<d>`` at ``node`` is used: ``"read"``, ``"remove"``, or
    ``(parameter position, parameter name)`` for ``self.<d>[<parameter>] = value``."""
    up = parent.get(node)
    if isinstance(up, ast.Attribute) and up.value is node:
        call = parent.get(up)
        if up.attr in _READS and isinstance(call, ast.Call) and call.func is up:
            return "read"
        return "remove"
    if isinstance(up, ast.Subscript) and up.value is node:
        if isinstance(up.ctx, ast.Load):
            return "read"
        if isinstance(up.ctx, ast.Store) and isinstance(up.slice, ast.Name) and up.slice.id in params:
            return (params.index(up.slice.id), up.slice.id)
        return "remove"
    if isinstance(up, ast.Compare) and node in up.comparators and all(
        isinstance(op, (ast.In, ast.NotIn)) for op in up.ops
    ):
        return "read"
    if (isinstance(up, ast.Call) and isinstance(up.func, ast.Name) and up.func.id == "len"
            and up.args == [node]):
        return "read"
    if isinstance(up, (ast.For, ast.comprehension)) and up.iter is node:
        return "read"
    return "remove"


def removal_calls(cls: type, attrs: list[str]) -> dict[str, tuple[int, str] | None] | None:
    """The methods of ``cls`` that may remove an entry from the dicts ``attrs`` (what the
    policy's ``get`` reads), by the rules of the module docstring: ``name -> None`` (every
    call counts) or ``name -> (position, parameter name)`` (counts only when that argument,
    ``self`` excluded, is already a key). None when a method's source cannot be read."""
    methods = _methods(cls)
    if methods is None:
        return None
    # cached by the very function objects read (a patched method is a new key): parsing
    # the sources costs about 20 ms, paid once per engine, but per replay in the fuzzer
    cache_key = (frozenset(methods.items()), tuple(attrs))
    if cache_key not in _FOUND:
        _FOUND[cache_key] = _derive(methods, attrs)
    found = _FOUND[cache_key]
    return dict(found) if found is not None else None


#: :func:`removal_calls`' answers by (the methods read, the dict attributes)
_FOUND: dict[tuple[frozenset, tuple[str, ...]], dict[str, tuple[int, str] | None] | None] = {}


def _derive(methods: dict[str, Any], attrs: list[str]) -> dict[str, tuple[int, str] | None] | None:
    direct: dict[str, tuple[int, str] | None] = {}
    calls: dict[str, set[str]] = {}
    for name, func in methods.items():
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
        except (OSError, TypeError, SyntaxError):
            return None
        fn = tree.body[0] if tree.body else None
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.args.args:
            return None
        self_name = fn.args.args[0].arg
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args][1:]
        parent = _parents(fn)
        found: Any = "none"
        calls[name] = set()
        for node in ast.walk(fn):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == self_name):
                continue
            up = parent.get(node)
            if node.attr in methods and isinstance(up, ast.Call) and up.func is node:
                calls[name].add(node.attr)
            if node.attr not in attrs:
                continue
            use = _use_of(node, parent, params)
            if use == "read":
                continue
            if use == "remove" or found not in ("none", use):
                found = None
                break
            found = use
        if found != "none":
            direct[name] = found
    # a method that calls a remover removes (a keyed store reached indirectly counts always)
    removers = dict(direct)
    changed = True
    while changed:
        changed = False
        for name, callees in calls.items():
            if removers.get(name, "x") is not None and any(c in removers for c in callees):
                removers[name] = None
                changed = True
    return removers


def watch(policy: Any, attrs: list[str]) -> Epoch | None:
    """The :class:`Epoch` of ``policy`` (one per instance, made on the first call): each
    method :func:`removal_calls` finds gets an instance-level wrapper that bumps it before
    and after the call. None (nothing wrapped) when the methods cannot be derived or the
    instance has no ``__dict__``."""
    state = getattr(policy, "__dict__", None)
    if state is None:
        return None
    epoch = state.get(_EPOCH_ATTR)
    if epoch is not None:
        return epoch
    found = removal_calls(type(policy), attrs)
    if found is None:
        return None
    epoch = Epoch()
    for name in found:
        if name in state:  # someone else's instance attribute: leave it, reuse nothing
            return None
    for name, keyed in found.items():
        state[name] = _counting(getattr(policy, name), epoch, policy, attrs, keyed)
    state[_EPOCH_ATTR] = epoch
    state[_WRAPPED_ATTR] = tuple(found)
    _watched.add(policy)
    return epoch


def _counting(method: Callable[..., Any], epoch: Epoch, policy: Any, attrs: list[str],
              keyed: tuple[int, str] | None) -> Callable[..., Any]:
    if keyed is None:
        def counted(*args: Any, **kwargs: Any) -> Any:
            epoch.n += 1
            try:
                return method(*args, **kwargs)
            finally:
                epoch.n += 1
    else:
        position, name = keyed

        def counted(*args: Any, **kwargs: Any) -> Any:
            key = args[position] if position < len(args) else kwargs.get(name)
            for a in attrs:  # a loop, not any(<generator>): a call per insert of the store path
                if key in getattr(policy, a, ()):
                    break
            else:
                return method(*args, **kwargs)  # a new key: nothing the check read is replaced
            epoch.n += 1
            try:
                return method(*args, **kwargs)
            finally:
                epoch.n += 1
    counted.__wrapped__ = method  # type: ignore[attr-defined]
    return counted


def unwatch_all() -> None:
    """Remove every wrapper :func:`watch` set (``uninstall``); the policies' own methods
    are called directly again. Each of their epochs is left at ``n = None`` for good
    (removals are no longer counted): a plan that still holds one reuses nothing."""
    for policy in list(_watched):
        state = policy.__dict__
        for name in state.pop(_WRAPPED_ATTR, ()):
            state.pop(name, None)
        epoch = state.pop(_EPOCH_ATTR, None)
        if epoch is not None:
            epoch.n = None
    _watched.clear()
