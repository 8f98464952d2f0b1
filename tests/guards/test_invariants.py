"""The invariants, exhaustively where the domain is small (as tini loops over 256 codes)."""

from __future__ import annotations

import pytest

from kvguard.guards.checks.invariants import (
    cdiv,
    group_sizes_consistency,
    mamba_pending_limit,
    release_tuple,
    swa_pending_blocks,
    swa_pending_bound,
    swa_pending_max,
    swa_skipped_tokens,
)

SW, TPB, BPC = 4096, 32, 8  # the seed geometry of vLLM #48959
#: the pending-block bound vLLM 0.21.0-0.26.0 asserts for the seed geometry (measured: test_release_matrix.py)
OLD_BOUND = 128


def brute_force_max(sw: int, tpb: int, extra: int, counts: range) -> tuple[int, int]:
    """(max pending blocks, first count reaching it) by vLLM's skipped-block rule."""
    best, first = -1, -1
    for n in counts:
        p = swa_pending_blocks(n, sw, tpb, extra)
        if p > best:
            best, first = p, n
    return best, first


class TestIssue48959:
    def test_seed_count_needs_129_blocks(self):
        assert swa_pending_blocks(98012, SW, TPB) == 129
        assert 98012 % TPB == 28

    def test_exact_bound_is_129_and_old_assert_128(self):
        assert swa_pending_bound(SW, TPB) == 129
        # what vLLM <= 0.26.0 asserts: window in chunks * blocks per chunk (the releases'
        # own expressions are evaluated in tests/guards/test_release_matrix.py)
        assert OLD_BOUND == cdiv(SW, TPB * BPC) * BPC == 128

    def test_brute_force_max_over_the_stored_prefix_range(self):
        # the 97,792-token prefix of the seeds, up to three chunks past the incident
        best, first = brute_force_max(SW, TPB, 0, range(97792, 98012 + 3 * 256))
        assert best == 129
        assert first == 97793  # remainder 1: the first count in this range that needs 129
        best, first = brute_force_max(SW, TPB, 0, range(98012, 98012 + 3 * 256))
        assert (best, first) == (129, 98012)

    @pytest.mark.parametrize("remainder", range(1, 31))
    def test_every_remainder_1_to_30_needs_one_more_block(self, remainder):
        for base in (4096, 32 * 1000, 97792, 32 * 100_000):
            n = base + remainder
            assert swa_pending_blocks(n, SW, TPB) == 129 > OLD_BOUND
            assert swa_pending_blocks(n, SW, TPB) <= swa_pending_bound(SW, TPB)

    @pytest.mark.parametrize("remainder", [0, 31])
    def test_aligned_remainders_fit_the_old_bound(self, remainder):
        for base in (4096, 97792, 32 * 100_000):
            assert swa_pending_blocks(base + remainder, SW, TPB) == 128


@pytest.mark.parametrize("tpb", [1, 2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize("sw", [1, 7, 31, 32, 33, 100, 512, 4000, 4096])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_bound_against_the_brute_force_maximum(sw, tpb, extra):
    best, _ = brute_force_max(sw, tpb, extra, range(0, sw + extra + 4 * tpb + 1))
    assert best == swa_pending_max(sw, tpb, extra)
    # the issue's formula never undercounts, and is tight except for one residue class
    if (sw + extra) % tpb == 2 % tpb:
        assert swa_pending_bound(sw, tpb, extra) == best + 1
    else:
        assert swa_pending_bound(sw, tpb, extra) == best


def test_skipped_tokens_rule():
    # vLLM's docstring example: window 4, 7 computed tokens -> 4 skipped
    assert swa_skipped_tokens(7, 4) == 4
    assert swa_skipped_tokens(3, 4) == 0
    assert swa_skipped_tokens(7, 4, extra_retained_tokens=2) == 2


def test_bound_rejects_bad_geometry():
    with pytest.raises(ValueError):
        swa_pending_bound(0, 32)
    with pytest.raises(ValueError):
        swa_pending_bound(4096, 0)
    with pytest.raises(ValueError):
        swa_pending_bound(4096, 32, -1)


def test_mamba_limit_is_vllms_own():
    # vLLM: sliding_window_size_in_blocks == 1 for Mamba, times blocks_per_chunk
    for bpc in range(1, 65):
        assert mamba_pending_limit(bpc) == 1 * bpc


class TestIssue42945:
    def test_window_edge_store_of_0_21_is_inconsistent(self):
        # 16 GPU blocks per chunk, chunk straddles the window: 8 sub-blocks are null.
        block_ids = list(range(101, 109))  # the 8 non-null sub-blocks
        assert not group_sizes_consistency(len(block_ids), [0, 16], [0, 8])  # 0.21.0 counted 16
        assert group_sizes_consistency(len(block_ids), [0, 8], [0, 8])  # fixed count

    def test_indices_must_match_groups(self):
        assert not group_sizes_consistency(3, [3], [0, 0])
        assert group_sizes_consistency(0, [], [])


def test_cdiv_and_release_tuple():
    assert [cdiv(a, 4) for a in range(9)] == [0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert release_tuple("0.27.1rc1+cpu") == (0, 27, 1)
    assert release_tuple("0.33") == (0, 33, 0)
    with pytest.raises(ValueError):
        release_tuple("garbage")
