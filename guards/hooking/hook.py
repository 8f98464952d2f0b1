"""Import-time hook for the target vLLM modules (after pytest's ``AssertionRewritingHook``).

vLLM imports its connectors lazily, so the offload scheduler module is usually imported
long after the plugin loads. :class:`GuardFinder` sits first in ``sys.meta_path`` and
answers only for the modules kvguard's scope rule accepts: for every other import
``find_spec`` returns ``None`` after one ``str.startswith`` over the scope's prefixes (the
early bail-out; it runs on every import in the process). It stays installed while kvguard
is installed, as pytest's hook does: a module in scope can be imported at any time. For a target it asks the remaining finders for the real
spec and wraps its loader, so that right after vLLM's module body has executed (and
before anyone can call its functions) the instrumentor's callback rewrites the sites.

Modules already imported when the hook is installed are not the hook's business: the
instrumentor instruments them in place and reports them (``already_imported`` event).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

__all__ = ["GuardFinder", "install_finder", "uninstall_finder"]


class _PostImportLoader(importlib.abc.Loader):
    """Delegates to vLLM's own loader, then calls ``on_loaded(module)`` (never raising)."""

    def __init__(self, loader: Any, on_loaded: Callable[[ModuleType], None], on_error: Callable[[BaseException], None]) -> None:
        self._loader = loader
        self._on_loaded = on_loaded
        self._on_error = on_error

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        try:
            self._on_loaded(module)
        except Exception as error:  # the import itself must succeed regardless
            self._on_error(error)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package, ...
        return getattr(self._loader, name)


class GuardFinder(importlib.abc.MetaPathFinder):
    """A meta-path finder for the modules a scope rule accepts.

    ``modules``: a predicate ``accept(dotted_name) -> bool`` (kvguard's scope rule,
    :func:`kvguard.guards.hooking.sites.in_scope`) or an exact set of dotted names; ``prefixes``:
    the early bail-out, every other name costs one ``str.startswith``;
    ``on_loaded(module)``: called once each module's body has run; ``on_error(exc)``:
    called when ``on_loaded`` raised (the import still succeeds). ``lookups`` counts the
    imports that passed the bail-out (tests).
    """

    def __init__(
        self,
        modules: Iterable[str] | Callable[[str], bool],
        on_loaded: Callable[[ModuleType], None],
        on_error: Callable[[BaseException], None],
        prefixes: tuple[str, ...] = ("vllm.",),
    ) -> None:
        if callable(modules):
            self._accept = modules
            self.modules: frozenset[str] = frozenset()
        else:
            self.modules = frozenset(modules)
            self._accept = self.modules.__contains__
            prefixes = tuple(self.modules) or ("",)
        self._prefixes = prefixes
        self._on_loaded = on_loaded
        self._on_error = on_error
        self._busy: set[str] = set()
        self.lookups = 0

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(self._prefixes) or fullname in self._busy or not self._accept(fullname):
            return None  # early bail-out: every other import in the process costs this only
        self.lookups += 1
        self._busy.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        except Exception as error:
            self._on_error(error)
            return None
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PostImportLoader(spec.loader, self._on_loaded, self._on_error)
        return spec


def install_finder(finder: GuardFinder) -> None:
    """Put ``finder`` first in ``sys.meta_path`` (idempotent)."""
    if finder not in sys.meta_path:
        sys.meta_path.insert(0, finder)


def uninstall_finder(finder: GuardFinder) -> None:
    """Remove ``finder`` from ``sys.meta_path`` if present."""
    try:
        sys.meta_path.remove(finder)
    except ValueError:
        pass
