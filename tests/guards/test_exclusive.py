"""block_exclusive's pure part: the GPU block ids listed twice across a request's groups."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.guards.checks.admission.exclusive import shared_blocks


def by_counting(groups) -> list[int]:
    """The definition, spelled out: every id but the null block (0) listed more than once."""
    listed = [b for ids in groups for b in ids]
    return sorted({b for b in listed if b != 0 and listed.count(b) > 1})


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), max_size=10), min_size=1, max_size=4))
def test_shared_blocks_is_the_definition(groups):
    assert shared_blocks(groups) == by_counting(groups)
    assert shared_blocks(tuple(tuple(g) for g in groups)) == by_counting(groups)


def test_the_null_block_is_exempt_and_a_repeat_is_named():
    assert shared_blocks(([0, 0, 1, 2], [0, 3, 4])) == []
    assert shared_blocks(([0, 0, 1, 2], [0, 3, 2])) == [2]
    assert shared_blocks(([5, 5],)) == [5]
    assert shared_blocks((range(1, 4), [3])) == [3]  # any sequence of ids
