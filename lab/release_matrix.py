"""The source-only release matrix: for each vLLM release, from its own sources,
every assert in scope vs every assert kvguard's rewriter replaces, the special sites
matched, and the window bound the release asserts for a geometry. No torch, no install:
the sdist is fetched once (cached) and only the offload packages' ``.py`` files are read
(the worker modules' only for their imports: the scope rule's by-import part,
:func:`kvguard.guards.hooking.sites.worker_side_modules`, the same rule the live install applies);
only the in-scope ones are discovered and rewritten.

``python -m kvguard.lab.release_matrix [VERSION ...]`` prints the table (Markdown);
``--json`` prints one object per release.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import asdict, dataclass, field

from kvguard.guards import names
from kvguard.guards.hooking.rewrite import SiteSpec, find_function, rewrite_function
from kvguard.lab import knobs
from kvguard.guards.hooking.sites import (
    CONNECTOR_SIMPLE,
    MEASURED_VLLM_RELEASES,
    SPECIAL_GROUP_SIZES,
    SPECIAL_STORE_DROP,
    SPECIAL_WINDOW,
    connector_of,
    discover,
    worker_by_name,
)
from kvguard.guards.hooking.vllm_source import (
    DEFAULT_CACHE,
    asserted_window_bound,
    fetch_sdist,
    offload_scope,
    sdist_package_sources,
)

__all__ = ["RELEASES", "ReleaseRow", "release_row", "main"]

#: The releases the matrix reads: every release kvguard declares measured
#: (:data:`kvguard.guards.hooking.sites.MEASURED_VLLM_RELEASES`, the one list; every published
#: release from 0.21.0 to 0.34.0).
RELEASES: tuple[str, ...] = MEASURED_VLLM_RELEASES
#: The seed geometry of #48959: sliding window 4096 tokens, GPU block 32, chunk 256.
SEED_GEOMETRY = (4096, 32, 256)


@dataclass
class ReleaseRow:
    """One release: per module ``[in_scope_asserts, rewritten_asserts]``, totals, the
    special kinds expected and matched, vLLM's own window bound (GPU blocks), the modules
    the scope rule's by-import part left out (``worker_side_by_import``) and the asserts in
    scope per CPU offload connector (``in_scope_by_connector``: OffloadingConnector,
    SimpleCPUOffloadConnector)."""

    version: str
    modules: dict[str, list[int]] = field(default_factory=dict)
    in_scope: int = 0
    rewritten: int = 0
    special_expected: list[str] = field(default_factory=list)
    special_missing: list[str] = field(default_factory=list)
    window_bound: int | None = None
    window_expr: str | None = None
    worker_side_by_import: list[str] = field(default_factory=list)
    in_scope_by_connector: dict[str, int] = field(default_factory=dict)
    #: every ``kv_connector_extra_config`` key the release's offload code reads
    #: (:func:`kvguard.lab.knobs.extra_config_keys`), those the lab's engines set or the
    #: fuzzer draws, and for the others the verdict of :data:`kvguard.lab.knobs.NOT_DRAWN`
    #: (``cannot`` / ``not yet``; ``unexplained`` for a key it does not list)
    config_keys: list[str] = field(default_factory=list)
    config_keys_drawn: list[str] = field(default_factory=list)
    config_keys_not_drawn: dict[str, str] = field(default_factory=dict)
    #: the KV cache spec kinds the offload code handles (:func:`kvguard.lab.knobs.kv_cache_spec_kinds`)
    #: and what it reads off the speculative config (:func:`kvguard.lab.knobs.speculative_reads`)
    kv_cache_spec_kinds: list[str] = field(default_factory=list)
    speculative_reads: list[str] = field(default_factory=list)
    #: per connector: generic asserts a guard fails one request alone for
    #: (``request_scoped``), and those it re-raises, by why no request can be blamed
    #: (:func:`kvguard.guards.hooking.discovery.scope_refusal`)
    request_scoped_by_connector: dict[str, int] = field(default_factory=dict)
    reraise_by_connector: dict[str, dict[str, int]] = field(default_factory=dict)


def _count_asserts(node: ast.AST) -> int:
    return sum(isinstance(n, ast.Assert) for n in ast.walk(node))


#: The ``check`` labels of generic asserts (vLLM's own asserts, no special handling).
GENERIC_CHECKS = frozenset({names.CHECK_SCHEDULER_ASSERT, names.CHECK_OFFLOAD_MANAGER_ASSERT,
                            names.CHECK_OFFLOAD_SPEC_ASSERT})


def _count_scopes(row: ReleaseRow, connector: str, sites: list) -> None:
    """Add one module's generic assert sites to the row's per-connector scope counts."""
    for site in sites:
        if site.kind != names.KIND_ASSERT or site.check not in GENERIC_CHECKS:
            continue
        if site.request_scoped:
            row.request_scoped_by_connector[connector] = row.request_scoped_by_connector.get(connector, 0) + 1
        else:
            reasons = row.reraise_by_connector.setdefault(connector, {})
            reason = site.unscoped_reason or "unknown"
            reasons[reason] = reasons.get(reason, 0) + 1


def release_row(version: str, package_sources: dict[str, str]) -> ReleaseRow:
    """Discover and rewrite every in-scope module of one release (compiled, never run).

    ``package_sources``: every module of the offload packages, worker modules included
    (:func:`kvguard.guards.hooking.vllm_source.sdist_package_sources`): the scope rule is applied
    here (:func:`kvguard.guards.hooking.vllm_source.offload_scope`), as the live install applies it."""
    sources, worker_side = offload_scope(package_sources)
    row = ReleaseRow(version)
    row.worker_side_by_import = sorted(m for m in worker_side if not worker_by_name(m))
    expected: set[str] = set()
    missing: set[str] = set()
    for module, source in sorted(sources.items()):
        tree = ast.parse(source)
        found = discover(module, tree, worker_side)
        expected |= found.expected_special
        missing |= set(found.special_missing)
        _count_scopes(row, connector_of(module), found.sites)
        by_qualname: dict[str, list] = {}
        for site in found.sites:
            by_qualname.setdefault(site.qualname, []).append(site)
        rewritten = 0
        for qualname, sites in by_qualname.items():
            specs = [SiteSpec(s.site_id, s.kind, (s.fingerprint,)) for s in sites]
            result = rewrite_function(tree, qualname, specs)
            if result is None:
                continue
            new_module, _ = result
            compile(new_module, module, "exec")  # what the instrumentor compiles
            original = find_function(tree, qualname)[0]
            rewritten += _count_asserts(original) - _count_asserts(new_module)
        if found.in_scope_asserts:
            row.modules[module] = [found.in_scope_asserts, rewritten]
        row.in_scope += found.in_scope_asserts
        if found.in_scope_asserts:
            connector = connector_of(module)
            row.in_scope_by_connector[connector] = row.in_scope_by_connector.get(connector, 0) + found.in_scope_asserts
        row.rewritten += rewritten
    row.special_expected = sorted(expected)
    row.special_missing = sorted(missing)
    row.window_bound, row.window_expr = asserted_window_bound(sources, *SEED_GEOMETRY)
    row.config_keys = list(knobs.extra_config_keys(package_sources))
    drawn = set(knobs.LAB_KEYS) | set(knobs.OPERATOR_SETTINGS)
    row.config_keys_drawn = [k for k in row.config_keys if k in drawn]
    row.config_keys_not_drawn = {
        k: knobs.NOT_DRAWN[k.split(".", 1)[0]][2] if k.split(".", 1)[0] in knobs.NOT_DRAWN else "unexplained"
        for k in row.config_keys if k not in drawn
    }
    row.kv_cache_spec_kinds = knobs.kv_cache_spec_kinds(package_sources)
    row.speculative_reads = list(knobs.speculative_reads(package_sources))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="*", default=list(RELEASES))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = [release_row(v, sdist_package_sources(fetch_sdist(v, DEFAULT_CACHE / "sdists"))) for v in args.versions]
    if args.json:
        for row in rows:
            print(json.dumps(asdict(row)))
        return 0
    print("| vLLM | asserts in scope | of which SimpleCPUOffloadConnector | rewritten | special sites matched "
          "| window bound (4096/32/256) | worker-side by import | extra-config keys read (set or drawn by the lab) "
          "| generic asserts failing one request / re-raised |")
    print("|---|---:|---:|---:|---|---:|---|---:|---|")
    for r in rows:
        specials = ", ".join(k for k in (SPECIAL_WINDOW, SPECIAL_GROUP_SIZES, SPECIAL_STORE_DROP)
                             if k in r.special_expected and k not in r.special_missing)
        by_import = ", ".join(f"`{m.rsplit('.', 1)[-1]}`" for m in r.worker_side_by_import) or "-"
        simple = r.in_scope_by_connector.get(CONNECTOR_SIMPLE, 0)
        keys = f"{len(r.config_keys)} ({len(r.config_keys_drawn)})"
        scopes = ", ".join(
            f"{c}: {r.request_scoped_by_connector.get(c, 0)} / {sum(r.reraise_by_connector.get(c, {}).values())}"
            for c in sorted(set(r.request_scoped_by_connector) | set(r.reraise_by_connector)))
        print(f"| {r.version} | {r.in_scope} | {simple} | {r.rewritten} | {specials} | {r.window_bound} | {by_import} "
              f"| {keys} | {scopes} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
