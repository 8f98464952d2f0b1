"""Helpers of tests/vllm: site ids of the special sites as discovery names them where vLLM
keeps them, the #48959 seed geometry, and planting chunks in a real CPU tier."""

import contextlib
from typing import Any

from kvguard.guards.hooking.rewrite import fingerprint_id

SITE_SWA_PENDING_BOUND = "offloading.scheduler:OffloadingConnectorScheduler.update_state_after_alloc:swa_pending_bound"
SITE_GROUP_SIZES_SUM = f"kv_offload.base:GPULoadStoreSpec.__init__:{fingerprint_id('sum(group_sizes) == len(block_ids)')}"


#: The #48959 seed geometry (tokens): sliding window, GPU block, offloaded chunk; and the
#: production hit's ``num_cached_tokens``.
SEED_WINDOW, SEED_BLOCK, SEED_CHUNK, SEED_CACHED_TOKENS = 4096, 32, 256, 98012


def seed_window_bound() -> tuple[int, str]:
    """``(bound, expression)``: the pending GPU blocks the installed release's window assert
    allows for the seed geometry, read from its own code (:func:`kvguard.guards.hooking.vllm_source.asserted_window_bound`;
    vLLM #48959 asserted 128 there, PR #49052 relaxed it to 129)."""
    from kvguard.guards.hooking.vllm_source import asserted_window_bound, installed_offload_sources

    return asserted_window_bound(installed_offload_sources(), SEED_WINDOW, SEED_BLOCK, SEED_CHUNK)


def seed_pending_blocks() -> int:
    """The legal pending GPU blocks of the seed load: the exact bound's count at 98012 cached
    tokens (window blocks ``[(98012 - 4096 + 1) // 32, cdiv(98012, 32))``: 129)."""
    first = (SEED_CACHED_TOKENS - SEED_WINDOW + 1) // SEED_BLOCK
    return -(-SEED_CACHED_TOKENS // SEED_BLOCK) - first


def plant_in_cpu_tier(cs: Any, request: Any, skip: "set[tuple[int, int]] | frozenset" = frozenset()) -> Any:
    """Store every chunk of ``request``'s prompt, in every group, in the real CPU tier of the
    connector scheduler ``cs`` through the manager's own ``prepare_store`` /
    ``complete_store`` (as a finished store job would), except the ``(group, chunk)`` pairs
    in ``skip``. Returns the request's offload status (``group_states[g].offload_keys``)."""
    status = offload_status(cs, request)
    del cs._req_status[request.request_id]
    keys = [key for g, state in enumerate(status.group_states) for c, key in enumerate(state.offload_keys)
            if (g, c) not in skip]
    # 0.33.0+ managers guard their state with ``lock``; earlier ones have none (no
    # concurrent caller there), so nothing to hold
    with getattr(cs.manager, "lock", None) or contextlib.nullcontext():
        cs.manager.prepare_store(keys, status.req_context)
        cs.manager.complete_store(keys, status.req_context)
    return status


def offload_status(cs: Any, request: Any) -> Any:
    """The connector scheduler's offload status of a new ``request`` (its ``_req_status``
    entry, offload keys computed): made by ``on_new_request`` where the release has one
    (0.25+), else by vLLM's own first lookup of the request (0.21.0 makes it there; no
    step lock is taken on that release)."""
    if callable(getattr(cs, "on_new_request", None)):
        cs.on_new_request(request)
    else:
        from kvguard.guards.checks import admission

        admission.unwrapped_lookup(cs)[0](request, 0)
    status = cs._req_status[request.request_id]
    status.update_offload_keys()
    return status


def expressible(trace: Any) -> bool:
    """Whether the installed release can build the engine ``trace``'s geometry asks for (the
    harness's own probes raise ``RuntimeError`` for one it cannot express)."""
    from kvguard.lab.replay import harness

    try:
        engine = harness.build_engine(trace.geometry, trace.worker)
    except RuntimeError:
        return False
    del engine
    return True


def check_the_fuzz_class(trace: Any) -> None:
    """The sliding-window partial-chunk class as the fuzzer found it (0.33.0, seed 2:
    ``traces/wrong-kv-swa-partial-chunk-033.jsonl``), on ``trace`` (that layout, or its MLA
    form: test_mla_groups.py): vLLM alone serves the release's fact
    ``swa_partial_chunk_033_wrong_kv_blocks``; guarded none, every request finishing, the
    hit cut by copy coverage where vLLM alone serves wrong KV. Where the fact is null the
    release cannot express the trace."""
    from release_facts import fact

    from kvguard.guards import names
    from kvguard.lab.replay import harness

    want = fact("swa_partial_chunk_033_wrong_kv_blocks")
    if want is None:
        assert not expressible(trace)
        return
    plain = harness.run_replay(trace, guard=False)
    assert plain.engine_survived and not plain.stalled and plain.wrong_kv_blocks == want
    guarded = harness.run_replay(trace, guard=True)
    assert guarded.ok and guarded.wrong_kv_blocks == 0 and guarded.guard_errors == {}
    assert guarded.finished == guarded.submitted == len(trace.requests)
    assert (guarded.checks[names.CHECK_COPY_COVERAGE]["hit_reduced"] >= 1) == bool(want)
