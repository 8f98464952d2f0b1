"""Where ``load_writes`` runs (``guards/checks/admission/written.py``, ``modelled``): read off
the connector scheduler's own fields, as vLLM's KV cache coordinator decides which groups
get the EAGLE block drop (every group when none is marked, 0.34.0)."""

from __future__ import annotations

from types import SimpleNamespace

from kvguard.guards.checks.admission import written


def _cs(spec: object | None, marks: list[bool], cp: int = 1) -> SimpleNamespace:
    groups = [SimpleNamespace(is_eagle_group=m) for m in marks]
    return SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=spec),
                           kv_cache_config=SimpleNamespace(kv_cache_groups=groups), cp_world_size=cp)


def test_the_check_runs_with_drafts_where_every_group_is_treated_alike() -> None:
    spec = object()
    assert written.modelled(_cs(None, [False, False]))
    assert written.modelled(_cs(spec, [False, False]))  # none marked: vLLM drops in every group
    assert written.modelled(_cs(spec, [True, True]))
    assert not written.modelled(_cs(spec, [False, True]))  # a drafter's group apart: not modelled
    assert not written.modelled(_cs(None, [False], cp=8))  # DCP-sharded groups: not modelled
    # a release whose KVCacheGroupSpec has no is_eagle_group field: every group alike
    assert written.modelled(SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=spec),
                                            kv_cache_config=SimpleNamespace(kv_cache_groups=[object(), object()])))
