"""The scope rule: which vLLM modules and functions are the scheduler side of the two CPU
offload connectors (:func:`in_scope`, the only place that decides it), read from their
import statements and attribute names, never from a table of releases. The rule itself is
stated in :mod:`kvguard.guards.hooking.sites`. Stdlib only.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterator, Mapping

from kvguard.guards import names

__all__ = [
    "SIMPLE_OFFLOAD_PACKAGE",
    "SCOPE_PACKAGES",
    "CONNECTOR_MODULE",
    "SIMPLE_CONNECTOR_MODULE",
    "CONNECTOR_MODULES",
    "CONNECTOR_OFFLOADING",
    "CONNECTOR_SIMPLE",
    "SCOPE_PREFIXES",
    "STORE_DROP_LOCALS",
    "SPECIAL_WINDOW",
    "SPECIAL_GROUP_SIZES",
    "SPECIAL_STORE_DROP",
    "SPECIAL_STORE_KEYS",
    "in_offload_packages",
    "worker_by_name",
    "in_scope",
    "imported_modules",
    "worker_side_modules",
    "worker_attributes",
    "worker_role",
    "connector_of",
    "short_module",
]

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
