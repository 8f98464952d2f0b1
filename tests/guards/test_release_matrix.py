"""The source-only release matrix for all 16 releases 0.21.0-0.33.0 (issue 8).

Each release's own sources (its sdist from the package index, cached under
``~/.cache/kvguard/sdists``; nothing installed, no torch) go through kvguard's discovery
and rewriter: every assert in scope must be rewritten, every special site matched, and
the window bound the release asserts for 4096/32/256 read from its own code.
"""

from __future__ import annotations

import pytest
from packaging.version import Version

from kvguard.guards.release_matrix import RELEASES, release_row
from kvguard.guards.vllm_source import DEFAULT_CACHE, fetch_sdist, sdist_package_sources


@pytest.mark.parametrize("version", RELEASES)
def test_release(version):
    row = release_row(version, sdist_package_sources(fetch_sdist(version, DEFAULT_CACHE / "sdists")))
    print(f"{version}: {row.in_scope} asserts in scope, {row.rewritten} rewritten, "
          f"window bound {row.window_bound} ({row.window_expr}), per module {row.modules}")
    assert row.in_scope == row.rewritten and row.in_scope >= 40
    assert all(scope == rewritten for scope, rewritten in row.modules.values()), row.modules
    assert row.special_expected == ["group_sizes", "store_drop", "store_keys", "swa_pending_bound"]
    assert row.special_missing == []
    # measured: the strict bound (#48959) up to 0.26.0, the `+ 1` of #49052 from 0.27.0 on
    assert row.window_bound == (128 if Version(version) <= Version("0.26.0") else 129)
    assert "sliding_window_size_in" in row.window_expr
