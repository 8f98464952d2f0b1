"""Discovery: every assert of a module in scope, and the few special sites matched by what
their code does (the window bound, ``group_sizes``, store constructions, the store-keys
asserts, request-scoped methods), from the module's AST (:func:`discover`). The rules are
stated in :mod:`kvguard.guards.hooking.sites`. Stdlib only.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

from kvguard.guards import names
from kvguard.guards.hooking.rewrite import (
    fingerprint_id,
    iter_functions,
    normalize_assert,
    normalize_statement,
)
from kvguard.guards.hooking.scope import (
    CONNECTOR_MODULES,
    SPECIAL_GROUP_SIZES,
    SPECIAL_STORE_DROP,
    SPECIAL_STORE_KEYS,
    SPECIAL_WINDOW,
    STORE_DROP_LOCALS,
    _generic_check,
    in_scope,
    short_module,
    worker_attributes,
    worker_role,
)
from kvguard.guards.names import KIND_ASSERT, KIND_REQUEST_SCOPE, KIND_STORE_CALL, KIND_WINDOW
from kvguard.guards.site_registry import Site

__all__ = ["Discovery", "discover", "LOAD_HOLD_CALLS"]


@dataclass
class Discovery:
    """What :func:`discover` found in one module.

    ``sites``: every check site (generic and special); ``in_scope_asserts``: every assert
    in scope (one per ``ast.Assert`` node); ``expected_special`` / ``special``: the special
    kinds this module should have (by structure) and the site of each that was matched.
    ``special_missing`` lists the expected kinds that were not matched."""

    module: str
    sites: list[Site] = field(default_factory=list)
    in_scope_asserts: int = 0
    expected_special: set[str] = field(default_factory=set)
    special: dict[str, list[Site]] = field(default_factory=dict)

    @property
    def special_missing(self) -> list[str]:
        return sorted(k for k in self.expected_special if not self.special.get(k))


def _idents(node: ast.AST) -> set[str]:
    out: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            out.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            out.add(sub.attr)
    return out


def _window_parts(test: ast.expr) -> tuple[ast.expr, ast.expr] | None:
    """(pending, bound) when ``test`` is ``<pending GPU blocks> <= <sliding-window bound>``."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.LtE)):
        return None
    left, right = test.left, test.comparators[0]
    left_ids = {i.lower() for i in _idents(left)}
    if not any("pending" in i and "block" in i for i in left_ids):
        return None
    if not any("sliding_window" in i for i in _idents(right)):
        return None
    return left, right


def _calls_gpu_spec(value: ast.expr) -> bool:
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    return name == "GPULoadStoreSpec"


def _store_constructions(func: ast.AST) -> list[ast.Assign]:
    """``x = GPULoadStoreSpec(...)`` statements inside a loop of this function's own scope."""
    found: list[ast.Assign] = []

    def walk(node: ast.AST, in_loop: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            if isinstance(child, ast.Assign) and in_loop and _calls_gpu_spec(child.value):
                found.append(child)
            loop_body = isinstance(child, (ast.For, ast.AsyncFor, ast.While))
            walk(child, in_loop or loop_body)

    walk(func, False)
    return found


def _binds(func: ast.AST, name: str) -> bool:
    if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = func.args
        if any(arg.arg == name for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]):
            return True
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store) for n in ast.walk(func))


def _is_len_compare(test: ast.expr) -> bool:
    """``len(<a>) == len(<b>)``: the keys-vs-block-ids class of the store builder."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = (test.left, test.comparators[0])
    return all(
        isinstance(x, ast.Call) and isinstance(x.func, ast.Name) and x.func.id == "len" and len(x.args) == 1
        for x in sides
    )


def _own_walk(node: ast.AST) -> Iterator[ast.AST]:
    """``ast.walk`` that does not enter nested functions, lambdas or classes."""
    todo = [node]
    while todo:
        cur = todo.pop()
        yield cur
        for child in ast.iter_child_nodes(cur):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                todo.append(child)


def _calls_attr(node: ast.AST, attr: str) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr
        for n in _own_walk(node)
    )


def _outer_loops(func: ast.AST) -> list[ast.For | ast.AsyncFor | ast.While]:
    """The loops of ``func``'s own scope that are not inside another loop."""
    found: list[ast.For | ast.AsyncFor | ast.While] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            if isinstance(child, (ast.For, ast.AsyncFor, ast.While)):
                found.append(child)
            else:
                walk(child)

    walk(func)
    return found


def _store_keys_asserts(func: ast.AST) -> list[tuple[ast.Assert, ast.stmt, bool]]:
    """``(assert, statement of the request loop's body that holds it, before_prepare)``
    for every ``len(a) == len(b)`` assert inside an outer loop of the store builder;
    ``before_prepare``: the statement comes before the body's first ``prepare_store``."""
    out: list[tuple[ast.Assert, ast.stmt, bool]] = []
    for loop in _outer_loops(func):
        prepare_at = next(
            (i for i, st in enumerate(loop.body) if _calls_attr(st, "prepare_store")), len(loop.body)
        )
        for i, stmt in enumerate(loop.body):
            for node in _own_walk(stmt):
                if isinstance(node, ast.Assert) and _is_len_compare(node.test):
                    out.append((node, stmt, i < prepare_at))
    return out


#: The calls by which an offload scheduler's request-scoped method takes hold of blocks for
#: the request's load: ``prepare_load`` (the OffloadingConnector's offload manager pins the
#: load's chunks) and ``touch`` (the SimpleCPUOffloadConnector pins the CPU and GPU blocks
#: its load reads, ``BlockPool.touch``). An assert that runs before the first of them, and
#: before the method takes any per-request entry out of the scheduler's state (a
#: ``self.<attr>.pop(...)``: since vllm#42289 the SimpleCPUOffloadConnector's lookup pins its
#: hit and this method pops the pin, which is then the method's to release), has taken hold
#: of nothing, so failing that request alone leaves nothing to release. Where the method's
#: own code shows how to give a hold back, the scope reaches past it (:func:`_request_scope`).
LOAD_HOLD_CALLS: frozenset[str] = frozenset({"prepare_load", "touch"})

#: A hold call and the call of the same object that gives it back: vLLM's ``BlockPool.touch``
#: raises each block's ``ref_cnt`` (taking a free block out of the free queue) and
#: ``BlockPool.free_blocks`` lowers it (a block at 0 goes back to the free queue's tail, the
#: move 0.34.0's own ``update_state_after_alloc`` makes with ``touch`` then ``free_blocks`` to
#: refresh a block's LRU place). ``prepare_load`` has no such inverse in the method.
HOLD_RELEASES: dict[str, str] = {"touch": "free_blocks"}


def _takes_state(node: ast.AST) -> bool:
    """``self.<attr>.pop(...)``: a per-request entry taken out of the scheduler's state."""
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "pop"
        and isinstance(node.func.value, ast.Attribute) and isinstance(node.func.value.value, ast.Name)
        and node.func.value.value.id == "self"
    )


@dataclass(frozen=True)
class RequestScope:
    """Where failing a request-scoped method's request alone is sound, by source line.

    ``end``: the line of the first hold (or release of a hold) the method's code gives no
    way back from; asserts from there on are not request-scoped. ``gaps``: ``(first, last)``
    line ranges where a popped per-request entry the method has no release for is still to
    be read (an assert there would drop it). ``releases``: ``(first, last, expr)``: an assert
    on a line in ``[first, last)`` must give back what ``expr`` (the method's own release
    call, source text over the frame's locals) gives back before the request fails; in the
    order the holds were taken (run them last first).
    """

    end: int
    gaps: tuple[tuple[int, int], ...] = ()
    releases: tuple[tuple[int, int, str], ...] = ()

    def releases_at(self, line: int) -> tuple[str, ...] | None:
        """The release calls an assert at ``line`` needs (last taken first), or None when
        an assert there is not request-scoped."""
        if line >= self.end or any(a <= line <= b for a, b in self.gaps):
            return None
        return tuple(expr for a, b, expr in reversed(self.releases) if a < line < b)


def _parents(func: ast.AST) -> dict[int, list[tuple[list[ast.stmt], int]]]:
    """``id(node) -> [(statement list, index of the statement holding it), ...]`` for every
    node of ``func``'s own scope, outermost list first."""
    out: dict[int, list[tuple[list[ast.stmt], int]]] = {}

    def visit(stmts: list[ast.stmt], chain: list[tuple[list[ast.stmt], int]]) -> None:
        for i, st in enumerate(stmts):
            here = [*chain, (stmts, i)]
            for node in _own_walk(st):
                out[id(node)] = here  # innermost list wins (visited last)
            for field_name in ("body", "orelse", "finalbody"):
                inner = getattr(st, field_name, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt) and not isinstance(
                        st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(inner, here)
            for handler in getattr(st, "handlers", []) or []:
                visit(handler.body, here)
            for case in getattr(st, "cases", []) or []:
                visit(case.body, here)

    visit(func.body, [])  # type: ignore[attr-defined]
    return out


def _exits(chain: list[tuple[list[ast.stmt], int]]) -> bool:
    """Whether a node at ``chain`` is in a branch that returns or raises after it (so code
    after the branch never runs once it has)."""
    return any(isinstance(stmts[-1], (ast.Return, ast.Raise)) for stmts, _ in chain[1:])


def _bound_name(func: ast.AST, call: ast.Call) -> str | None:
    """The local ``call``'s value is bound to (``x = call`` or ``(x := call)``), when that is
    the only binding of the name in ``func``; else None."""
    name = None
    for node in _own_walk(func):
        if isinstance(node, ast.Assign) and node.value is call and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        elif isinstance(node, ast.NamedExpr) and node.value is call:
            name = node.target.id
    if name is None:
        return None
    stores = sum(1 for n in _own_walk(func) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store))
    return name if stores == 1 else None


def _names_in(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


#: The last line of a release the method never makes itself: past every line of any
#: method (a release needed by every assert after its hold).
NEVER_RELEASED = 1 << 30

_Parents = dict[int, list[tuple[list[ast.stmt], int]]]


def _hold_release(call: ast.Call, parents: _Parents) -> tuple[int, int, str] | None | bool:
    """What a hold call (:data:`LOAD_HOLD_CALLS`) means for the scope: ``None`` when the
    method gives it back itself in the same statement list (no hold), a release
    ``(line, NEVER_RELEASED, expr)`` for a top-level hold with a :data:`HOLD_RELEASES`
    inverse, ``False`` when it ends the scope."""
    inverse = HOLD_RELEASES.get(call.func.attr)  # type: ignore[attr-defined]
    chain = parents.get(id(call), [])
    if inverse is None or len(call.args) != 1 or call.keywords or not chain:
        return False
    stmts, i = chain[-1]
    arg = _names_in(call.args[0])
    obj = ast.unparse(call.func.value)  # type: ignore[attr-defined]
    for st in stmts[i + 1:]:
        for n in _own_walk(st):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == inverse \
                    and ast.unparse(n.func.value) == obj \
                    and arg and arg <= set().union(*(_names_in(x) for x in n.args)):
                return None  # the method gives it back itself, in the same block
    if len(chain) != 1:
        return False  # a hold in a branch: whether it ran is not known here
    return (call.lineno, NEVER_RELEASED, f"{obj}.{inverse}({ast.unparse(call.args[0])})")


def _pop_scope(func: ast.AST, own: list[ast.AST], pop: ast.Call,
               parents: _Parents) -> tuple[str, int, int, str]:
    """What a popped per-request entry (:func:`_takes_state`) means for the scope, as
    ``(kind, first, last, expr)``: ``("end", line, line, "")`` ends it at ``line``;
    ``("release", pop line, first straight release line, expr)`` needs the method's own
    release ``expr`` in between; ``("gap", pop line, last read, "")`` is not scoped in
    between. The rules are :func:`_request_scope`'s."""
    name = _bound_name(func, pop)
    if name is None:
        return ("end", pop.lineno, pop.lineno, "")
    calls = [n for n in own if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"
             and len(n.args) == 1 and not n.keywords
             and isinstance(n.args[0], ast.Name) and n.args[0].id == name and n.lineno > pop.lineno]
    # the release: a method the code calls on the entry where it gives up (a branch
    # that returns or raises); any other call on it is a use
    given_up = {c.func.attr for c in calls if _exits(parents.get(id(c), []))}  # type: ignore[attr-defined]
    calls = [c for c in calls if c.func.attr in given_up]  # type: ignore[attr-defined]
    if len(given_up) == 1:
        straight = [c for c in calls if len(parents.get(id(c), [])) == 1]
        other = [c for c in calls if len(parents.get(id(c), [])) != 1 and not _exits(parents.get(id(c), []))]
        if other:
            first_other = min(c.lineno for c in other)
            return ("end", first_other, first_other, "")
        first = min((c.lineno for c in straight), default=NEVER_RELEASED)
        return ("release", pop.lineno, first, f"self.{calls[0].func.attr}({name})")  # type: ignore[attr-defined]
    if given_up:  # two ways to give it up: which one applies is not read here
        return ("end", pop.lineno, pop.lineno, "")
    reads = [n.lineno for n in own if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)]
    return ("gap", pop.lineno, max([pop.lineno, *reads]), "")


#: Why an assert is not request-scoped (:func:`scope_refusal`), the reasons the release
#: matrix counts per connector.
REFUSE_NOT_SCHEDULER = "not a scheduler method"
REFUSE_NO_REQUEST = "no request parameter"
REFUSE_GENERATOR = "a generator or coroutine"
REFUSE_RETURNS = "returns a value to vLLM"
REFUSE_LOAD_IN_LOOP = "issues loads in a loop"
REFUSE_NO_HOLD = "takes no hold for a load"
REFUSE_AFTER_HOLD = "after a hold it has no release for"
REFUSE_ENTRY_IN_USE = "while a popped per-request entry is in use"


def scope_refusal(func: ast.FunctionDef | ast.AsyncFunctionDef, owner: str, line: int) -> str | None:
    """Why a generic assert at ``line`` of ``func`` (a method of class ``owner``) cannot
    fail one request alone (one of the ``REFUSE_*`` texts), or None when it can (it is
    request-scoped: :func:`_request_scope`). The conditions are :func:`_request_scope`'s,
    in its order."""
    if not owner.endswith("Scheduler"):
        return REFUSE_NOT_SCHEDULER
    a = func.args
    if not any(arg.arg == "request" for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]):
        return REFUSE_NO_REQUEST
    own = list(_own_walk(func))
    if any(isinstance(n, (ast.Yield, ast.YieldFrom, ast.Await)) for n in own):
        return REFUSE_GENERATOR
    if any(isinstance(n, ast.Return) and n.value is not None for n in own):
        return REFUSE_RETURNS
    if any(_calls_attr(loop, name) for loop in _outer_loops(func) for name in LOAD_HOLD_CALLS):
        return REFUSE_LOAD_IN_LOOP
    scope = _request_scope(func)
    if scope is None:
        return REFUSE_NO_HOLD
    if scope.releases_at(line) is not None:
        return None
    return REFUSE_AFTER_HOLD if line >= scope.end else REFUSE_ENTRY_IN_USE


def _request_scope(func: ast.FunctionDef | ast.AsyncFunctionDef) -> RequestScope | None:
    """The :class:`RequestScope` of ``func`` when it is request-scoped (takes ``request``,
    returns nothing, takes hold of blocks for a load, not in a loop), else None.

    Derived from the method's own code, statement by statement (only the method's top-level
    statements are sure to have run before a later line):

    - a hold (:data:`LOAD_HOLD_CALLS`) given back by its :data:`HOLD_RELEASES` call on the
      same argument later in the same statement list is no hold;
    - a top-level hold with such an inverse adds a release (the inverse on the hold's own
      object and argument, re-evaluated on the frame) until the method itself gives it back;
      any other hold ends the scope;
    - a popped per-request entry (:func:`_takes_state`) bound to a local: its release is the
      one method ``self.<m>(local)`` the code calls where it gives up (in a branch that
      returns or raises: vLLM's own early exit, e.g. 0.34.0's
      ``self._free_pending_cpu_hit(pending)`` when no token is external); that call is added
      as a release until the method makes it on its straight path; a call of it in a branch
      that does not return ends the scope.
      With no such call the entry is the method's to use: asserts between the pop and the
      local's last read are not scoped (``gaps``), later ones are (the entry is consumed).
      A pop bound to nothing, or bound twice, ends the scope.
    """
    a = func.args
    if not any(arg.arg == "request" for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]):
        return None
    own = list(_own_walk(func))
    if any(isinstance(n, (ast.Yield, ast.YieldFrom, ast.Await)) for n in own):
        return None
    if any(isinstance(n, ast.Return) and n.value is not None for n in own):
        return None
    if any(_calls_attr(loop, name) for loop in _outer_loops(func) for name in LOAD_HOLD_CALLS):
        return None  # a load issued in a loop: a later assert could follow a half-issued load
    holds = [n for n in own if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr in LOAD_HOLD_CALLS]
    if not holds:
        return None
    parents = _parents(func)
    ends: list[int] = []
    gaps: list[tuple[int, int]] = []
    releases: list[tuple[int, int, str]] = []
    for call in sorted(holds, key=lambda c: c.lineno):
        release = _hold_release(call, parents)
        if release is False:
            ends.append(call.lineno)
        elif release is not None:
            releases.append(release)  # type: ignore[arg-type]
    for pop in (n for n in own if _takes_state(n)):
        kind, first, last, expr = _pop_scope(func, own, pop, parents)
        if kind == "end":
            ends.append(first)
        elif kind == "release":
            releases.append((first, last, expr))
        else:
            gaps.append((first, last))
    end = min(ends, default=max(n.lineno for n in own if hasattr(n, "lineno")) + 1)
    # a release that the method itself runs past ``end`` changes nothing before it
    return RequestScope(end, tuple(sorted(gaps)), tuple(sorted(releases)))


def discover(module: str, tree: ast.Module, worker_side: Collection[str] = frozenset()) -> Discovery:
    """Every check site of one in-scope module's source (see the module docstring).

    ``module``: the dotted name; ``tree``: its parsed source; ``worker_side``: the
    release's worker-side modules (:func:`worker_side_modules`) for :func:`in_scope`.
    Asserts at module or class body level are not sites (they run once, at import).
    Returns an empty :class:`Discovery` for a module out of scope. Never raises for
    valid Python."""
    result = Discovery(module)
    if not in_scope(module, worker_side):
        return result
    short = short_module(module)
    generic_check = _generic_check(module)
    worker_attrs = worker_attributes(tree) if module in CONNECTOR_MODULES else frozenset()
    for qualname, func, classes in iter_functions(tree):
        if module in CONNECTOR_MODULES and worker_role(func, worker_attrs):
            continue
        owner = classes[-1].name if classes else ""
        method = qualname.rsplit(".", 1)[-1]
        is_spec_init = owner == "GPULoadStoreSpec" and method == "__init__"
        if is_spec_init and any(arg.arg == "group_sizes" for arg in func.args.args + func.args.kwonlyargs):
            result.expected_special.add(SPECIAL_GROUP_SIZES)
        if method == "update_state_after_alloc" and owner.endswith("Scheduler") and any(
            i.startswith("sliding_window_size_in") for i in _idents(classes[-1])
        ):
            # the window assert bounds pending GPU blocks by the offload config's window size
            # in blocks or chunks; a scheduler that never reads one (the
            # SimpleCPUOffloadConnector's, which reads only a spec's ``sliding_window`` in
            # tokens to size its pool) has no such assert to expect
            result.expected_special.add(SPECIAL_WINDOW)
        is_store_builder = owner.endswith("Scheduler") and "store" in method
        store_keys = {id(a): (stmt, before) for a, stmt, before in _store_keys_asserts(func)} if is_store_builder else {}
        if store_keys:
            result.expected_special.add(SPECIAL_STORE_KEYS)
        scope = _request_scope(func) if owner.endswith("Scheduler") else None
        scoped = False
        for node in ast.walk(func):
            if not isinstance(node, ast.Assert):
                continue
            result.in_scope_asserts += 1
            fp = normalize_assert(node)
            parts = _window_parts(node.test)
            if parts is not None:
                site = Site(
                    f"{short}:{qualname}:{names.CHECK_SWA_PENDING_BOUND}", module, qualname, KIND_WINDOW,
                    names.CHECK_SWA_PENDING_BOUND, fp, node.lineno, "vllm#48959",
                    bound_expr=ast.unparse(parts[1]), pending_expr=ast.unparse(parts[0]),
                )
                result.special.setdefault(SPECIAL_WINDOW, []).append(site)
            elif is_spec_init and "group_sizes" in _idents(node.test):
                site = Site(
                    f"{short}:{qualname}:{fingerprint_id(fp)}", module, qualname, KIND_ASSERT,
                    names.CHECK_GROUP_SIZES_CONSISTENCY, fp, node.lineno, "vllm#42945",
                )
                result.special.setdefault(SPECIAL_GROUP_SIZES, []).append(site)
            elif id(node) in store_keys and store_keys[id(node)][1] and _binds(func, "self"):
                stmt = store_keys[id(node)][0]
                site = Site(
                    f"{short}:{qualname}:{fingerprint_id(fp)}", module, qualname, KIND_ASSERT,
                    names.CHECK_STORE_KEYS_CONSISTENCY, fp, node.lineno, "vllm#49118",
                )
                skip = Site(
                    f"{short}:{qualname}:store_skip:{fingerprint_id(fp)}", module, qualname, KIND_STORE_CALL,
                    names.CHECK_STORE_KEYS_CONSISTENCY, normalize_statement(stmt), stmt.lineno, "vllm#49118",
                    release_keys=False,
                )
                result.special.setdefault(SPECIAL_STORE_KEYS, []).extend([site, skip])
                if skip.site_id not in {s.site_id for s in result.sites}:
                    result.sites.append(skip)
            else:
                to_release = scope.releases_at(node.lineno) if scope is not None else None
                in_scope_of_request = to_release is not None
                scoped = scoped or in_scope_of_request
                site = Site(f"{short}:{qualname}:{fingerprint_id(fp)}", module, qualname, KIND_ASSERT,
                            generic_check, fp, node.lineno, request_scoped=in_scope_of_request,
                            releases=to_release or (),
                            unscoped_reason=None if in_scope_of_request else scope_refusal(func, owner, node.lineno))
            if site.site_id not in {s.site_id for s in result.sites}:
                result.sites.append(site)
        if scoped:
            site = Site(
                f"{short}:{qualname}:request_scope", module, qualname, KIND_REQUEST_SCOPE,
                generic_check, qualname, func.lineno, "kvguard#9",
            )
            result.sites.append(site)
        if owner.endswith("Scheduler") and "store" in method:
            constructions = _store_constructions(func)
            if constructions:
                result.expected_special.add(SPECIAL_STORE_DROP)
                if all(_binds(func, n) for n in STORE_DROP_LOCALS):
                    for node in constructions:
                        site = Site(
                            f"{short}:{qualname}:store_drop", module, qualname, KIND_STORE_CALL,
                            names.CHECK_GROUP_SIZES_CONSISTENCY, normalize_statement(node), node.lineno,
                            "vllm#42945", release_keys=True,
                        )
                        result.special.setdefault(SPECIAL_STORE_DROP, []).append(site)
                        if site.site_id not in {s.site_id for s in result.sites}:
                            result.sites.append(site)
    return result
