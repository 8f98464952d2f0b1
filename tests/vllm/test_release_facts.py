"""Every measured release fact has a row for the installed vLLM (tests/vllm/release_facts.py)."""

from __future__ import annotations

import pytest

from release_facts import FACTS, _rows, missing, missing_message

pytestmark = pytest.mark.vllm


def test_every_measured_fact_has_a_row_for_this_release() -> None:
    from kvguard.guards.hooking.instrumentor import installed_vllm_version

    release = installed_vllm_version()
    assert not missing(release), missing_message(release)


def test_the_file_names_only_known_facts() -> None:
    assert {fact for _release, fact in _rows()} <= set(FACTS)
