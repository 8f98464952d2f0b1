"""`kvguard check-geometry` (exit 0 safe, 3 would crash, 2 bad args)."""

from __future__ import annotations

import importlib.metadata

import pytest
from click.testing import CliRunner

from kvguard.lab.geometry import EXIT_BAD_ARGS, EXIT_SAFE, EXIT_WOULD_CRASH, check_geometry, tripping_remainders
from kvguard.sidecar.cli import main

SEED = ["--sliding-window", "4096", "--block-size", "32", "--chunk-size", "256"]


def run(*args: str):
    return CliRunner().invoke(main, ["check-geometry", *args])


@pytest.mark.parametrize("version", ["0.21.0", "0.25.1", "0.26.0", "0.27.0", "0.33.0", "0.34.0"])
def test_seed_geometry_per_release(version):
    """Judged from each release's own sdist (fetched from the index, cached): its window
    assert's bound expression on the geometry, never a version table. The expectation is
    read from the same sources by :func:`asserted_window_bound`; a crash verdict exactly
    when that bound is below the exact bound of #48959."""
    from kvguard.guards.checks import invariants
    from kvguard.guards.hooking.vllm_source import DEFAULT_CACHE, asserted_window_bound, fetch_sdist, sdist_offload_sources

    asserted, expression = asserted_window_bound(
        sdist_offload_sources(fetch_sdist(version, DEFAULT_CACHE / "sdists")), 4096, 32, 256
    )
    exact = invariants.swa_pending_bound(4096, 32, 0)
    code = EXIT_WOULD_CRASH if asserted < exact else EXIT_SAFE
    result = run(*SEED, "--vllm-version", version)
    assert result.exit_code == code, result.output
    assert f"exact bound (vLLM #48959): {exact} GPU blocks" in result.output
    assert f"given vLLM {version}: asserts pending <= {expression} = {asserted} GPU blocks" in result.output
    if asserted == exact - 1:  # #48959's product: every remainder 1..30 trips (brute force below)
        assert f"num_cached_tokens=98012: {exact} pending GPU blocks > {asserted}" in result.output
        assert "remainder mod 32 is in {1..30}" in result.output


def test_without_vllm_says_how_to_judge_a_release(monkeypatch):
    def missing(dist):
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    result = run(*SEED)
    assert result.exit_code == EXIT_SAFE
    assert "installed vLLM: none" in result.output and "--vllm-version" in result.output


def test_a_release_without_sources_is_a_clear_error():
    result = run(*SEED, "--vllm-version", "0.0.1")
    assert result.exit_code == EXIT_BAD_ARGS
    assert "cannot read vLLM 0.0.1's offload sources" in result.output


def test_window_below_a_chunk_boundary_is_safe_everywhere():
    result = run("--sliding-window", "4000", "--block-size", "32", "--chunk-size", "256", "--vllm-version", "0.25.1")
    assert result.exit_code == EXIT_SAFE, result.output
    assert "126 GPU blocks" in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["--sliding-window", "0", "--block-size", "32", "--chunk-size", "256"],
        ["--sliding-window", "4096", "--block-size", "32", "--chunk-size", "250"],
        ["--sliding-window", "4096", "--block-size", "32"],
        ["--sliding-window", "x", "--block-size", "32", "--chunk-size", "256"],
        SEED + ["--vllm-version", "banana"],
    ],
)
def test_bad_arguments_exit_2(args):
    result = run(*args)
    assert result.exit_code == EXIT_BAD_ARGS
    assert "Error" in result.output


def test_tripping_remainders_match_the_brute_force():
    first, remainders = tripping_remainders(4096, 32, 0, 128)
    assert (first, remainders) == (4097, list(range(1, 31)))
    assert tripping_remainders(4096, 32, 0, 129) == (0, [])


def test_command_object_is_exported():
    assert check_geometry.name == "check-geometry"
