"""The source-only release matrix for every release of ``RELEASES`` (issue 8, issue 20).

Each release's own sources (its sdist from the package index, cached under
``~/.cache/kvguard/sdists``; nothing installed, no torch) go through kvguard's scope rule,
discovery and rewriter. Every expectation is computed from what the release's code says,
never from a per-release table: the asserts in scope are counted here independently (every
``ast.Assert`` inside a function of an in-scope module), the worker-side modules by import
are checked against their importers read from the sources, and the window bound is what
the release's own window assert computes (:func:`asserted_window_bound`), judged against
the exact bound of #48959.
"""

from __future__ import annotations

import ast

import pytest

from kvguard.guards.checks import invariants
from kvguard.lab.geometry import tripping_remainders
from kvguard.lab.release_matrix import RELEASES, SEED_GEOMETRY, release_row
from kvguard.guards.hooking.rewrite import iter_functions
from kvguard.guards.hooking.sites import (
    CONNECTOR_MODULE,
    CONNECTOR_MODULES,
    SIMPLE_CONNECTOR_MODULE,
    worker_attributes,
    imported_modules,
    in_scope,
    worker_by_name,
    worker_role,
)
from kvguard.guards.hooking.vllm_source import (
    DEFAULT_CACHE,
    asserted_window_bound,
    fetch_sdist,
    offload_scope,
    sdist_package_sources,
)


def count_asserts(module: str, source: str) -> int:
    """Every assert inside a function (a connector module: scheduler-role functions only)."""
    tree = ast.parse(source)
    attrs = worker_attributes(tree)
    return sum(
        isinstance(node, ast.Assert)
        for _, func, _ in iter_functions(tree)
        if not (module in CONNECTOR_MODULES and worker_role(func, attrs))
        for node in ast.walk(func)
    )


def importers(package: dict[str, str]) -> dict[str, set[str]]:
    known = set(package)
    out: dict[str, set[str]] = {m: set() for m in package}
    for module, source in package.items():
        is_package = any(other.startswith(module + ".") for other in package)
        for target in imported_modules(module, ast.parse(source), known, is_package):
            out[target].add(module)
    return out


@pytest.mark.parametrize("version", RELEASES)
def test_release(version):
    package = sdist_package_sources(fetch_sdist(version, DEFAULT_CACHE / "sdists"))
    row = release_row(version, package)
    sources, worker_side = offload_scope(package)
    print(f"{version}: {row.in_scope} asserts in scope, {row.rewritten} rewritten, "
          f"window bound {row.window_bound} ({row.window_expr}), worker-side by import "
          f"{row.worker_side_by_import}, per module {row.modules}")

    # every assert in scope, counted here, is rewritten
    expected = {m: n for m, src in sources.items() if (n := count_asserts(m, src))}
    assert {m: counts[0] for m, counts in row.modules.items()} == expected
    assert all(scope == rewritten for scope, rewritten in row.modules.values()), row.modules
    assert row.in_scope == row.rewritten == sum(expected.values())
    # the SimpleCPUOffloadConnector's share: its module and package, counted the same way
    simple = sum(n for m, n in expected.items() if m == SIMPLE_CONNECTOR_MODULE or m.startswith("vllm.v1.simple_kv_offload"))
    assert row.in_scope_by_connector["SimpleCPUOffloadConnector"] == simple > 0
    assert sum(row.in_scope_by_connector.values()) == row.in_scope
    assert row.special_expected == ["group_sizes", "store_drop", "store_keys", "swa_pending_bound"]
    assert row.special_missing == []
    # every setting the release reads is set or drawn by the lab, or explained (lab/knobs.py)
    assert row.config_keys_drawn and "cpu_bytes_to_use" in row.config_keys_drawn
    assert sorted(row.config_keys_drawn + list(row.config_keys_not_drawn)) == row.config_keys
    assert "unexplained" not in row.config_keys_not_drawn.values(), row.config_keys_not_drawn
    # every generic assert is request-scoped or re-raised with a reason (discovery.scope_refusal);
    # on every release the simple connector's update_state_after_alloc asserts are scoped
    reasons = {r for by in row.reraise_by_connector.values() for r in by}
    assert reasons and "unknown" not in reasons, row.reraise_by_connector
    assert row.request_scoped_by_connector.get("SimpleCPUOffloadConnector", 0) > 0
    print(f"{version}: request-scoped {row.request_scoped_by_connector}, re-raised {row.reraise_by_connector}")
    # the release's offload code handles the two kinds every lab engine has; the MLA kinds
    # the lab also builds are handled where the code imports them (0.21.0 imports neither:
    # there an MLA group is a FullAttentionSpec / SlidingWindowSpec to its isinstance tests)
    from kvguard.lab.knobs import LAB_SPEC_KINDS

    assert {"FullAttentionSpec", "SlidingWindowSpec"} <= set(row.kv_cache_spec_kinds), row.kv_cache_spec_kinds
    assert {"MLAAttentionSpec", "SlidingWindowMLASpec"} <= LAB_SPEC_KINDS
    print(f"{version}: spec kinds {row.kv_cache_spec_kinds}, speculative reads {row.speculative_reads}")

    # the scope rule's by-import part, checked against the importers read from the sources:
    # each module it takes out has importers, all worker-side; no in-scope module imports one
    by = importers(package)
    assert row.worker_side_by_import == sorted(m for m in worker_side if not worker_by_name(m))
    for module in row.worker_side_by_import:
        assert by[module] and by[module] <= worker_side, (module, by[module])
        assert not in_scope(module, worker_side) and module not in sources
    for module in sources:
        assert not (by[module] and by[module] <= worker_side) or module in CONNECTOR_MODULES, module

    # vLLM's own window bound, read from its code; a legal load exceeds it iff it is below
    # the exact bound (#48959), and then the incident's 98012 cached tokens trip it
    bound, expression = asserted_window_bound(sources, *SEED_GEOMETRY)
    assert (row.window_bound, row.window_expr) == (bound, expression)
    assert "sliding_window_size_in" in row.window_expr
    window, tokens_per_block, _ = SEED_GEOMETRY
    exact = invariants.swa_pending_bound(window, tokens_per_block, 0)
    first, remainders = tripping_remainders(window, tokens_per_block, 0, bound)
    assert bool(remainders) == (bound < exact)
    assert (98012 % tokens_per_block in remainders) == (bound < exact)
    print(f"{version}: vLLM's bound {bound} vs exact {exact}: "
          f"{'trips at 98012' if bound < exact else 'allows every legal load'}")


@pytest.mark.parametrize("version", RELEASES)
def test_each_connectors_worker_attribute_is_read_off_its_constructor(version):
    """The worker role of a connector module's functions: what its constructor binds in the
    ``KVConnectorRole.WORKER`` branch (OffloadingConnector: ``connector_worker``;
    SimpleCPUOffloadConnector: ``worker_handler``), on every release's source."""
    package = sdist_package_sources(fetch_sdist(version, DEFAULT_CACHE / "sdists"))
    assert worker_attributes(ast.parse(package[CONNECTOR_MODULE])) == {"connector_worker"}
    assert worker_attributes(ast.parse(package[SIMPLE_CONNECTOR_MODULE])) == {"worker_handler"}
