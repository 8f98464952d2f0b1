"""The site table against the installed vLLM's own source (run in each .venvs/vllm-* env)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from kvguard.guards.instrumentor import installed_vllm_version
from kvguard.guards.rewrite import KIND_STORE_CALL, find_function, iter_asserts, normalize_statement
from kvguard.guards.sites import KIND_WRAP_INIT, SITES, TARGET_MODULES, site_in_range

pytestmark = pytest.mark.vllm

#: In-range sites per release (read from the three installed wheels; see guards/sites.py).
#: One fewer than before the counter flush wrap of ``build_connector_meta`` was removed
#: (generic asserts are no longer counted when they pass: nothing to flush).
EXPECTED_IN_RANGE = {"0.21.0": 33, "0.25.1": 47, "0.33.0": 65}


def source(module: str) -> ast.Module | None:
    """The module's parsed source, or None when this release has no such module."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:  # a parent package this release does not have
        return None
    if spec is None:
        return None
    return ast.parse(Path(spec.origin).read_text())


@pytest.fixture(scope="module")
def version() -> str:
    v = installed_vllm_version()
    assert v is not None
    return v


@pytest.fixture(scope="module")
def trees() -> dict[str, ast.Module]:
    return {m: source(m) for m in TARGET_MODULES}


def found_in(tree: ast.Module | None, site) -> bool:
    if tree is None:
        return False
    for qualname, fingerprint in site.targets:
        located = find_function(tree, qualname)
        if located is None:
            continue
        if site.kind == KIND_WRAP_INIT:
            return True
        if site.kind == KIND_STORE_CALL:
            if any(
                isinstance(n, ast.Assign) and normalize_statement(n) == fingerprint for n in ast.walk(located[0])
            ):
                return True
        elif any(q == qualname and fp == fingerprint for q, fp, _ in iter_asserts(tree)):
            return True
    return False


def test_every_in_range_site_is_in_the_source(version, trees):
    in_range = [s for s in SITES if site_in_range(s, version)]
    assert len(in_range) == EXPECTED_IN_RANGE[version]
    missing = [s.site_id for s in in_range if not found_in(trees[s.module], s)]
    assert missing == []


def test_out_of_range_sites_are_really_absent(version, trees):
    # a site marked out of range whose code is present would be a table error
    present = [
        s.site_id for s in SITES
        if not site_in_range(s, version) and s.kind != KIND_WRAP_INIT
        and found_in(trees[s.module], s)
    ]
    assert present == []


def test_every_assert_on_the_offload_path_is_a_site(version, trees):
    covered = {
        (s.module, q, fp) for s in SITES if site_in_range(s, version) for q, fp in s.targets
    }
    uncovered = [
        (m, q, fp)
        for m, tree in trees.items()
        if tree is not None
        for q, fp, _ in iter_asserts(tree)
        if (m, q, fp) not in covered
    ]
    assert uncovered == []


def test_modules_per_release(version, trees):
    present = {m for m, tree in trees.items() if tree is not None}
    absent = {
        "0.21.0": {"vllm.v1.kv_offload.tiering.manager", "vllm.v1.kv_offload.tiering.spec",
                   "vllm.distributed.kv_transfer.kv_connector.v1.offloading.config"},
        "0.25.1": {"vllm.distributed.kv_transfer.kv_connector.v1.offloading.config"},
        "0.33.0": set(),
    }[version]
    assert present == set(TARGET_MODULES) - absent


def test_window_and_group_sizes_sites_are_listed_for_every_release(version):
    ids = {s.site_id for s in SITES if site_in_range(s, version)}
    assert {
        "scheduler:OffloadingConnectorScheduler.update_state_after_alloc:swa_pending_bound",
        "kv_offload.base:GPULoadStoreSpec.__init__:group_sizes_sum",
        "kv_offload.base:GPULoadStoreSpec.__init__:block_indices_len",
        "scheduler:OffloadingConnectorScheduler._build_store_jobs:store_drop",
    } <= ids
