"""The assert -> check transformation (an AST pass modelled on pytest's assertion rewriting).

Pure: works on (tree, source) and a list of :class:`SiteSpec`; imports no vLLM, no
prometheus_client, no structlog. :mod:`kvguard.guards.hooking.instrumentor` compiles what this returns
and swaps the code of the existing vLLM function objects.

Algorithm (:class:`SiteRewriter`): for one top-level function (``func`` or
``Class.method``, nested classes allowed), every ``ast.Assert`` whose normalized test
text (:func:`normalize_assert`) matches a listed fingerprint is replaced; every other
assert stays an assert, node for node. Asserts inside nested functions, lambdas and
comprehensions of that function are reached too (they are compiled into its code).

Generated code per kind, with names that are not valid identifiers so they cannot
clash with vLLM's (pytest uses ``@py_assert``):

``assert`` (failure-only: counted when it fails)::

    if __debug__:
        if not <test>:
            @kvguard_exc = @kvguard_check(<site_id>, False, @kvguard_locals()[, <msg>])
            if @kvguard_exc is not None:
                raise @kvguard_exc

  On the passing path this is exactly vLLM's ``assert <test>``: CPython compiles both to
  the test followed by one conditional jump (``__debug__`` is folded at compile time, so
  ``-O`` strips the site as it strips the assert). A passing generic assert therefore costs
  nothing more than vLLM's own; ``tests/guards/test_rewrite.py`` counts the opcodes.

``window`` (every evaluation, the geometry is needed for the exact bound)::

    if __debug__:
        @kvguard_ok = <test>
        @kvguard_exc = @kvguard_check(<site_id>, @kvguard_ok, @kvguard_locals()[, <msg>])
        if @kvguard_exc is not None:
            raise @kvguard_exc

``store_call`` (an assignment, not an assert; vLLM #42945)::

    try:
        src_spec = GPULoadStoreSpec(...)           # the original statement, untouched
        @kvguard_exc = @kvguard_check_store(<site_id>, src_spec, @kvguard_locals())
        if @kvguard_exc is not None:               # store coverage
            raise @kvguard_exc
    except @kvguard_StoreDropped:
        @kvguard_drop_store(<site_id>, @kvguard_locals())
        continue

``store_call`` also wraps a statement of the store builder's request loop that holds
the ``len(...) == len(...)`` assert of vLLM #49118 (a ``for`` over the KV cache groups):
the same handler, so a drop skips to the next request. Such a statement is matched by
its normalized text *before* its own asserts are rewritten.

``request_scope`` (the whole body of a request-scoped method)::

    try:
        <body, its asserts rewritten as above>
    except @kvguard_RequestFailed:
        @kvguard_fail_request(<site_id>, @kvguard_locals())
        return None

``admission_return`` (the connector scheduler's ``get_num_new_matched_tokens``)::

    return @kvguard_admit_return(self, request, num_computed_tokens, <value>)

  Every ``return <value>`` of the function's own scope (not of nested scopes): vLLM's
  answer goes through kvguard's admission check before it leaves the function, with no
  wrapper frame and no argument binding per call (the three names are the function's own
  parameters, read off its ``def``). Applied only when the function has a first positional
  parameter and parameters named ``request`` and ``num_computed_tokens``, and no
  statement of it (or of a nested scope) rebinds one of the three
  (:func:`admission_return_names`), and no ``return`` sits inside a ``try`` or ``with``
  (then nothing of vLLM's runs after the value is computed, so the check sees exactly
  the answer the caller gets); else not matched, and the instrumentor wraps the method
  instead.

Locations: every generated node gets the location of the statement it replaces
(``ast.copy_location`` over the new subtree); original nodes keep theirs, so tracebacks
and ``co_positions`` point into vLLM's own file and lines.
"""

from __future__ import annotations

import ast
import copy
import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from types import CodeType

__all__ = [
    "KIND_ASSERT",
    "KIND_WINDOW",
    "KIND_STORE_CALL",
    "KIND_REQUEST_SCOPE",
    "GLOBAL_CHECK",
    "GLOBAL_LOCALS",
    "GLOBAL_STORE_DROPPED",
    "GLOBAL_DROP_STORE",
    "GLOBAL_REQUEST_FAILED",
    "GLOBAL_FAIL_REQUEST",
    "GLOBAL_CHECK_STORE",
    "GLOBAL_ADMIT_RETURN",
    "KIND_ADMISSION_RETURN",
    "admission_return_names",
    "SiteSpec",
    "SiteRewriter",
    "normalize_assert",
    "normalize_statement",
    "fingerprint_id",
    "iter_asserts",
    "iter_functions",
    "find_function",
    "rewrite_function",
    "extract_function_code",
]

# the site kinds and injected global names are the engine half's shared vocabulary
from kvguard.guards.names import (  # noqa: E402  (re-exported: __all__)
    GLOBAL_ADMIT_RETURN,
    GLOBAL_CHECK,
    GLOBAL_CHECK_STORE,
    GLOBAL_DROP_STORE,
    GLOBAL_FAIL_REQUEST,
    GLOBAL_LOCALS,
    GLOBAL_REQUEST_FAILED,
    GLOBAL_STORE_DROPPED,
    KIND_ADMISSION_RETURN,
    KIND_ASSERT,
    KIND_REQUEST_SCOPE,
    KIND_STORE_CALL,
    KIND_WINDOW,
)
_LOCAL_OK = "@kvguard_ok"
_LOCAL_EXC = "@kvguard_exc"
#: Every global name rewritten code may read (the instrumentor injects exactly these).
INJECTED_GLOBALS: tuple[str, ...] = (
    GLOBAL_CHECK,
    GLOBAL_LOCALS,
    GLOBAL_STORE_DROPPED,
    GLOBAL_DROP_STORE,
    GLOBAL_REQUEST_FAILED,
    GLOBAL_FAIL_REQUEST,
    GLOBAL_CHECK_STORE,
    GLOBAL_ADMIT_RETURN,
)


@dataclass(frozen=True)
class SiteSpec:
    """One site to rewrite inside one function.

    ``fingerprints``: accepted normalized texts (assert test, or whole statement for
    ``store_call``).
    """

    site_id: str
    kind: str
    fingerprints: tuple[str, ...]


def normalize_assert(node: ast.Assert) -> str:
    """The normalized text of an assert's *test* (its message is ignored): ``ast.unparse`` with
    whitespace collapsed, so formatting, comments and parenthesization never matter."""
    return " ".join(ast.unparse(node.test).split())


def normalize_statement(node: ast.stmt) -> str:
    """Normalized text of a whole statement (used for ``store_call`` sites)."""
    return " ".join(ast.unparse(node).split())


def fingerprint_id(fingerprint: str) -> str:
    """A short stable id for a fingerprint: the first 8 hex digits of its sha1."""
    return hashlib.sha1(fingerprint.encode()).hexdigest()[:8]


_FUNC = (ast.FunctionDef, ast.AsyncFunctionDef)


def _iter_top_functions(
    body: Iterable[ast.stmt], prefix: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for node in body:
        if isinstance(node, _FUNC):
            yield prefix + node.name, node
        elif isinstance(node, ast.ClassDef):
            yield from _iter_top_functions(node.body, prefix + node.name + ".")


def iter_functions(
    tree: ast.Module,
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef, list[ast.ClassDef]]]:
    """Yield ``(qualname, def, enclosing classes)`` for every module-level function and
    (nested) class method, in source order; a redefined name yields each definition."""

    def walk(body: Iterable[ast.stmt], prefix: str, classes: list[ast.ClassDef]):
        for node in body:
            if isinstance(node, _FUNC):
                yield prefix + node.name, node, classes
            elif isinstance(node, ast.ClassDef):
                yield from walk(node.body, prefix + node.name + ".", [*classes, node])

    yield from walk(tree.body, "", [])


def iter_asserts(tree: ast.Module) -> Iterator[tuple[str, str, int]]:
    """Yield ``(qualname, fingerprint, lineno)`` for every assert inside a module-level
    function or a (nested) class method, including asserts in its nested scopes.
    Asserts at module or class-body level are not sites (they run once, at import)."""
    for qualname, func in _iter_top_functions(tree.body):
        for node in ast.walk(func):
            if isinstance(node, ast.Assert):
                yield qualname, normalize_assert(node), node.lineno


def keyword_argument_names(node: ast.AST, keyword: str) -> set[str]:
    """Names passed as ``keyword=<name>`` to any call under ``node`` (e.g. the variable a
    constructor hands to ``cache_capacity=``); calls passing an expression are skipped."""
    return {
        kw.value.id
        for n in ast.walk(node) if isinstance(n, ast.Call)
        for kw in n.keywords
        if kw.arg == keyword and isinstance(kw.value, ast.Name)
    }


def find_function(
    tree: ast.Module, qualname: str
) -> tuple[ast.FunctionDef | ast.AsyncFunctionDef, list[ast.ClassDef]] | None:
    """The ``def`` for ``qualname`` (``"f"`` or ``"A.B.f"``) and its enclosing classes, or None."""
    parts = qualname.split(".")
    body: list[ast.stmt] = tree.body
    classes: list[ast.ClassDef] = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        match = None
        for node in body:
            if last and isinstance(node, _FUNC) and node.name == part:
                match = node  # the last definition wins, as at run time
            elif not last and isinstance(node, ast.ClassDef) and node.name == part:
                match = node
        if match is None:
            return None
        if last:
            return match, classes  # type: ignore[return-value]
        classes.append(match)  # type: ignore[arg-type]
        body = match.body  # type: ignore[union-attr]
    return None


def _name(id_: str, ctx: ast.expr_context | None = None) -> ast.Name:
    return ast.Name(id=id_, ctx=ctx or ast.Load())


def _locate(new: ast.AST, old: ast.AST) -> ast.AST:
    """Give every node of ``new`` that lacks a location the location of ``old``."""
    for node in ast.walk(new):
        if "lineno" in node._attributes and not hasattr(node, "lineno"):
            ast.copy_location(node, old)
        elif "lineno" in node._attributes and getattr(node, "_kvguard_generated", False):
            ast.copy_location(node, old)
    return new


def _gen(node: ast.AST) -> ast.AST:
    node._kvguard_generated = True  # type: ignore[attr-defined]
    return node


@dataclass
class SiteRewriter(ast.NodeTransformer):
    """Rewrites the listed asserts / statements of one function (see module docstring).

    ``found`` collects the site ids that matched at least once; ``loop_depth`` tracks
    whether a ``continue`` is legal at the current statement (``store_call`` needs one
    enclosing loop of this function's own scope).
    """

    specs: list[SiteSpec]
    found: set[str] = field(default_factory=set)
    _by_assert: dict[str, SiteSpec] = field(default_factory=dict)
    _by_stmt: dict[str, SiteSpec] = field(default_factory=dict)
    _loop_depth: int = 0
    _func_depth: int = 0

    def __post_init__(self) -> None:
        for spec in self.specs:
            if spec.kind in (KIND_REQUEST_SCOPE, KIND_ADMISSION_RETURN):
                continue  # the whole body: rewrite_function rewrites it
            target = self._by_stmt if spec.kind == KIND_STORE_CALL else self._by_assert
            for fp in spec.fingerprints:
                target[fp] = spec

    # -- scopes -----------------------------------------------------------------
    def _visit_scope(self, node: ast.AST) -> ast.AST:
        saved = self._loop_depth
        self._loop_depth = 0
        self._func_depth += 1
        self.generic_visit(node)
        self._func_depth -= 1
        self._loop_depth = saved
        return node

    visit_FunctionDef = _visit_scope  # type: ignore[assignment]
    visit_AsyncFunctionDef = _visit_scope  # type: ignore[assignment]
    visit_Lambda = _visit_scope  # type: ignore[assignment]

    def _visit_loop(self, node: ast.For | ast.While | ast.AsyncFor) -> ast.AST:
        # Only the body is "inside" the loop for continue; orelse is not.
        node.target = self.visit(node.target) if hasattr(node, "target") else None  # type: ignore[union-attr]
        self._loop_depth += 1
        node.body = self._visit_stmts(node.body)
        self._loop_depth -= 1
        node.orelse = self._visit_stmts(node.orelse)
        return node

    def visit_For(self, node: ast.For) -> ast.AST:
        return self._visit_loop(node)

    def visit_AsyncFor(self, node: ast.AsyncFor) -> ast.AST:
        return self._visit_loop(node)

    def visit_While(self, node: ast.While) -> ast.AST:
        self._loop_depth += 1
        node.body = self._visit_stmts(node.body)
        self._loop_depth -= 1
        node.orelse = self._visit_stmts(node.orelse)
        return node

    def _visit_stmts(self, stmts: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for stmt in stmts:
            # a non-assignment store_call statement (the #49118 group loop) is matched by
            # its text before its own asserts are rewritten
            spec = None
            if self._by_stmt and self._loop_depth and not isinstance(stmt, ast.Assign):
                spec = self._by_stmt.get(normalize_statement(stmt))
            epilogue = _skip_epilogue(stmts[stmts.index(stmt) + 1 :]) if spec is not None else []
            new = self.visit(stmt)
            if spec is not None and new is not None and not isinstance(new, list):
                self.found.add(spec.site_id)
                new = self._store_drop_try(new, spec, epilogue)
            if new is None:
                continue
            if isinstance(new, list):
                out.extend(new)
            else:
                out.append(new)
        return out

    # -- sites ------------------------------------------------------------------
    def visit_Assert(self, node: ast.Assert) -> ast.AST | list[ast.stmt]:
        self.generic_visit(node)
        spec = self._by_assert.get(normalize_assert(node))
        if spec is None:
            return node
        self.found.add(spec.site_id)
        return self._assert_replacement(node, spec)

    def visit_Assign(self, node: ast.Assign) -> ast.AST | list[ast.stmt]:
        self.generic_visit(node)
        if not self._by_stmt:
            return node
        spec = self._by_stmt.get(normalize_statement(node))
        if spec is None or self._loop_depth == 0:
            return node
        self.found.add(spec.site_id)
        return self._store_drop_try(node, spec, coverage=_store_coverage_check(node, spec))

    def _store_drop_try(
        self, node: ast.stmt, spec: SiteSpec, epilogue: list[ast.stmt] | None = None,
        coverage: list[ast.stmt] | None = None,
    ) -> ast.stmt:
        """``try: <node>; <coverage> except @kvguard_StoreDropped: drop_store(site, locals());
        <epilogue>; continue`` (``epilogue``: see :func:`_skip_epilogue`; ``coverage``: the
        store coverage check of the spec ``node`` built, :func:`_store_coverage_check`)."""
        handler = ast.ExceptHandler(
            type=_gen(_name(GLOBAL_STORE_DROPPED)),
            name=None,
            body=[
                _gen(
                    ast.Expr(
                        value=_gen(
                            ast.Call(
                                func=_gen(_name(GLOBAL_DROP_STORE)),
                                args=[
                                    _gen(ast.Constant(spec.site_id)),
                                    _gen(ast.Call(func=_gen(_name(GLOBAL_LOCALS)), args=[], keywords=[])),
                                ],
                                keywords=[],
                            )
                        )
                    )
                ),
                *(epilogue or []),
                _gen(ast.Continue()),
            ],
        )
        _gen(handler)
        new = _gen(ast.Try(body=[node, *(coverage or [])], handlers=[handler], orelse=[], finalbody=[]))
        _locate(new, node)
        return new

    def _assert_replacement(self, node: ast.Assert, spec: SiteSpec) -> list[ast.stmt]:
        def call(ok: ast.expr) -> ast.Call:
            args: list[ast.expr] = [
                _gen(ast.Constant(spec.site_id)),
                ok,
                _gen(ast.Call(func=_gen(_name(GLOBAL_LOCALS)), args=[], keywords=[])),
            ]
            if node.msg is not None:
                args.append(node.msg)
            return _gen(ast.Call(func=_gen(_name(GLOBAL_CHECK)), args=args, keywords=[]))  # type: ignore[return-value]

        # CPython attributes an assert's raise to its test expression: so do we.
        raise_stmt = ast.Raise(exc=_name(_LOCAL_EXC), cause=None)
        for sub in ast.walk(raise_stmt):
            ast.copy_location(sub, node.test)
        raise_if = _gen(
            ast.If(
                test=_gen(
                    ast.Compare(
                        left=_gen(_name(_LOCAL_EXC)),
                        ops=[_gen(ast.IsNot())],
                        comparators=[_gen(ast.Constant(None))],
                    )
                ),
                body=[raise_stmt],
                orelse=[],
            )
        )
        if spec.kind == KIND_WINDOW:
            body: list[ast.stmt] = [
                _gen(ast.Assign(targets=[_gen(_name(_LOCAL_OK, ast.Store()))], value=node.test)),
                _gen(
                    ast.Assign(
                        targets=[_gen(_name(_LOCAL_EXC, ast.Store()))],
                        value=call(_gen(_name(_LOCAL_OK))),
                    )
                ),
                raise_if,
            ]
            if node.msg is not None:
                # the message is evaluated only when the test failed, as in an assert
                body[1].value.args[3] = _gen(  # type: ignore[attr-defined]
                    ast.IfExp(test=_gen(_name(_LOCAL_OK)), body=_gen(ast.Constant(None)), orelse=node.msg)
                )
        else:
            fail = [
                _gen(
                    ast.Assign(
                        targets=[_gen(_name(_LOCAL_EXC, ast.Store()))],
                        value=call(_gen(ast.Constant(False))),
                    )
                ),
                raise_if,
            ]
            # ``if not <test>``: the compiler folds the ``not`` into the jump, so the
            # passing path is the assert's own (test, one conditional jump).
            not_test = _gen(ast.UnaryOp(op=_gen(ast.Not()), operand=node.test))
            body = [_gen(ast.If(test=not_test, body=fail, orelse=[]))]
        guard = _gen(ast.If(test=_gen(_name("__debug__")), body=body, orelse=[]))
        _locate(guard, node)
        return [guard]  # type: ignore[list-item]


def _store_coverage_check(node: ast.Assign, spec: SiteSpec) -> list[ast.stmt]:
    """After the store drop site's ``<name> = GPULoadStoreSpec(...)``: the store coverage
    check of the spec just built (:mod:`kvguard.guards.checks.store_coverage`)::

        @kvguard_exc = @kvguard_check_store(<site_id>, <name>, @kvguard_locals())
        if @kvguard_exc is not None:
            raise @kvguard_exc

    inside the same ``try``, so a ``StoreDropped`` it returns (policy ``guard``) drops the
    store as a failed spec does. Empty when the assignment's target is not a plain name."""
    if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
        return []
    call = _gen(
        ast.Call(
            func=_gen(_name(GLOBAL_CHECK_STORE)),
            args=[
                _gen(ast.Constant(spec.site_id)),
                _gen(_name(node.targets[0].id)),
                _gen(ast.Call(func=_gen(_name(GLOBAL_LOCALS)), args=[], keywords=[])),
            ],
            keywords=[],
        )
    )
    assign = _gen(ast.Assign(targets=[_gen(_name(_LOCAL_EXC, ast.Store()))], value=call))
    raise_if = _gen(
        ast.If(
            test=_gen(ast.Compare(left=_gen(_name(_LOCAL_EXC)), ops=[_gen(ast.IsNot())],
                                  comparators=[_gen(ast.Constant(None))])),
            body=[_gen(ast.Raise(exc=_gen(_name(_LOCAL_EXC)), cause=None))],
            orelse=[],
        )
    )
    return [assign, raise_if]


def _skip_epilogue(later: list[ast.stmt]) -> list[ast.stmt]:
    """What vLLM itself does on every skip of a request after ``later[0]`` starts.

    The top-level ``if`` statements of the request loop's body after the dropped
    statement whose body ends in ``continue`` are vLLM's own "skip this request's store"
    branches (nothing to store, ``prepare_store`` refused, nothing new). The statements
    every one of them runs (same normalized text; e.g. 0.26.0's
    ``self._maybe_cleanup_finished_req(req_id, req_status)``, none on 0.25.1 or 0.33.0)
    are what a drop must run too, so a finished request's state is not leaked. Deep
    copies, in the order of the first branch; ``[]`` when there is no such branch.
    """
    branches = [
        st.body[:-1]
        for st in later
        if isinstance(st, ast.If) and st.body and isinstance(st.body[-1], ast.Continue)
    ]
    if not branches:
        return []
    common = set.intersection(*({normalize_statement(x) for x in b} for b in branches))
    return [copy.deepcopy(x) for x in branches[0] if normalize_statement(x) in common]


def _wrap_request_scope(func: ast.FunctionDef | ast.AsyncFunctionDef, spec: SiteSpec) -> None:
    """Make ``func``'s body ``try: <body> except @kvguard_RequestFailed:
    fail_request(site, locals()); return None`` (the docstring stays first)."""
    body = list(func.body)
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        body = body[1:] or [ast.Pass()]  # keep the docstring out of the try (co_consts[0])
        func.body = [first]
    else:
        func.body = []
    call = _gen(
        ast.Call(
            func=_gen(_name(GLOBAL_FAIL_REQUEST)),
            args=[
                _gen(ast.Constant(spec.site_id)),
                _gen(ast.Call(func=_gen(_name(GLOBAL_LOCALS)), args=[], keywords=[])),
            ],
            keywords=[],
        )
    )
    handler = _gen(
        ast.ExceptHandler(
            type=_gen(_name(GLOBAL_REQUEST_FAILED)),
            name=None,
            body=[_gen(ast.Expr(value=call)), _gen(ast.Return(value=_gen(ast.Constant(None))))],
        )
    )
    new = _gen(ast.Try(body=body, handlers=[handler], orelse=[], finalbody=[]))
    _locate(new, body[0])
    func.body.append(new)


def rewrite_function(
    tree: ast.Module, qualname: str, specs: list[SiteSpec]
) -> tuple[ast.Module, set[str]] | None:
    """Rewrite the listed sites of ``qualname`` into a new, compilable module.

    Returns ``(module, found_site_ids)``; the module holds only the (rewritten, deep
    copied) ``def`` nested in empty copies of its enclosing classes, so private-name
    mangling and the ``__class__`` cell of ``super()`` come out as in vLLM's own code.
    The input tree is not modified. None when ``qualname`` is not defined in ``tree``.
    """
    located = find_function(tree, qualname)
    if located is None:
        return None
    func, classes = located
    func = copy.deepcopy(func)
    rewriter = SiteRewriter(specs)
    # visit the body only: the def itself is the scope, not a nested one
    func.body = rewriter._visit_stmts(func.body)
    admit = next((sp for sp in specs if sp.kind == KIND_ADMISSION_RETURN), None)
    if admit is not None and _admit_returns(func):
        rewriter.found.add(admit.site_id)
    scope = next((sp for sp in specs if sp.kind == KIND_REQUEST_SCOPE), None)
    if scope is not None:
        _wrap_request_scope(func, scope)
        rewriter.found.add(scope.site_id)
    inner: ast.stmt = func
    for cls in reversed(classes):
        shell = ast.ClassDef(name=cls.name, bases=[], keywords=[], body=[inner], decorator_list=[])
        if "type_params" in ast.ClassDef._fields:  # Python >= 3.12
            shell.type_params = []
        ast.copy_location(shell, cls)
        shell.end_lineno = cls.end_lineno
        inner = shell
    module = ast.Module(body=[inner], type_ignores=[])
    ast.fix_missing_locations(module)
    return module, set(rewriter.found)


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def admission_return_names(func: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, str, str] | None:
    """``(self, "request", "num_computed_tokens")``: the parameter names an ``admission_return``
    rewrite passes to the check, or None when ``func`` does not qualify.

    Qualifies: a plain ``def`` (not ``async``, not a generator) whose first positional
    parameter is the instance and that has parameters named ``request`` and
    ``num_computed_tokens``, none of the three ever rebound in it (an assignment, ``del``,
    ``for`` / ``with`` / ``except`` / ``import`` / ``match`` target, ``:=``, ``global`` /
    ``nonlocal``, or a nested scope declaring one ``nonlocal``): then each name holds the argument of the call at
    every ``return``."""
    if not isinstance(func, ast.FunctionDef):
        return None
    positional = [*func.args.posonlyargs, *func.args.args]
    params = {a.arg for a in [*positional, *func.args.kwonlyargs]}
    if not positional or not {"request", "num_computed_tokens"} <= params:
        return None
    names = (positional[0].arg, "request", "num_computed_tokens")
    for node in ast.walk(func):
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            return None
        if isinstance(node, ast.Name) and node.id in names and not isinstance(node.ctx, ast.Load):
            return None
        if isinstance(node, (ast.Global, ast.Nonlocal)) and set(node.names) & set(names):
            return None
        bound = None
        if isinstance(node, ast.ExceptHandler):
            bound = node.name
        elif isinstance(node, ast.alias):
            bound = node.asname or node.name.partition(".")[0]
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)):
            bound = node.name
        elif isinstance(node, ast.MatchMapping):
            bound = node.rest
        if bound in names:
            return None
    return names


_ENCLOSING = (ast.Try, ast.With, ast.AsyncWith, *((ast.TryStar,) if hasattr(ast, "TryStar") else ()))


def _guarded_return(func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """True when a ``return`` of ``func``'s own scope lies inside a ``try`` or ``with``: there
    code of vLLM's runs after the returned value is computed (``finally``, ``__exit__``) or
    could catch what the check raises (``strict``), so checking at the ``return`` would not
    be checking the answer the caller gets. Such a method is not rewritten."""

    def visit(node: ast.AST, enclosed: bool) -> bool:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _SCOPES):
                continue
            if isinstance(child, ast.Return) and enclosed:
                return True
            if visit(child, enclosed or isinstance(child, _ENCLOSING)):
                return True
        return False

    return visit(func, False)


def _admit_returns(func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Rewrite each ``return <value>`` of ``func``'s own scope (module docstring,
    ``admission_return``); False (nothing changed) when it does not qualify or has none."""
    names = admission_return_names(func)
    if names is None or _guarded_return(func):
        return False
    found = False

    def visit(node: ast.AST) -> None:
        nonlocal found
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _SCOPES):
                continue  # a nested scope's returns are not the method's answer
            if isinstance(child, ast.Return) and child.value is not None:
                call = _gen(ast.Call(
                    func=_gen(_name(GLOBAL_ADMIT_RETURN)),
                    args=[_gen(_name(n)) for n in names] + [child.value],
                    keywords=[],
                ))
                child.value = _locate(call, child)
                found = True
            visit(child)

    visit(func)
    return found


def extract_function_code(module_code: CodeType, qualname: str) -> CodeType | None:
    """Find the code object of ``qualname`` inside a compiled :func:`rewrite_function` module."""
    code = module_code
    for part in qualname.split("."):
        nxt = None
        for const in code.co_consts:
            if isinstance(const, CodeType) and const.co_name == part:
                nxt = const
        if nxt is None:
            return None
        code = nxt
    return code
