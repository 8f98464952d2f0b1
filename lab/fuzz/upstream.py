"""The upstream-ready report ``kvguard fuzz`` writes beside each wrong-KV trace.

For a ``wrong-kv`` class the fuzzer keeps the minimal trace (``<slug>.jsonl``) and writes
``<slug>.md`` beside it: what vLLM alone serves (the KV-content oracle's offenders: request,
KV cache group, block index, what the block held), which of kvguard's invariants sees the
class first (the same trace replayed with the guard under policy ``observe``, which only
counts, so the run is vLLM's own), the invariant's statement and source, what a fix must
guarantee, and the commands that replay it on every release. The mechanism of a class is
not guessed here: where no invariant fires, the report says the class is new to kvguard
and the guard cannot prevent it yet (a finding to trace by hand, docs/fuzz.md).

Nothing in this module is keyed by release: the text per invariant is what the check
itself enforces (its module's docstring says how it is derived from vLLM's code).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvguard.guards import names

#: Per kvguard check that stops wrong KV: (the invariant, what a vLLM fix must guarantee,
#: the public vLLM references behind it). The derivations live in the checks' modules.
WRONG_KV_INVARIANTS: dict[str, tuple[str, str, str]] = {
    names.CHECK_STORE_COVERAGE: (
        "a chunk an offload store publishes holds every GPU block it stands for, except blocks "
        "the request's KV cache manager skipped (below num_tokens - kept tokens); the copied "
        "blocks of each KV cache group sit at their chunk places; and every stored chunk ends "
        "within the KV the request computed (num_computed_tokens + the step's scheduled "
        "tokens) (guards/checks/store_coverage.py)",
        "a chunk key is published only when every block of that chunk that the load path can "
        "place inside an attention's read range was copied and computed; in particular the "
        "stale-id zeroing of `_update_req_states` must zero only ids the manager freed "
        "(remove_skipped_blocks), never a live block a new request's prefix-cache hit lists "
        "among its new blocks; and a finished request's final store must stop before its last "
        "sampled token, whose KV no forward wrote (as 0.33.0's `_build_store_jobs` clamps it)",
        "vLLM PR #42959 (stale sliding-window id zeroing, the fix of #42761), issue #46951; "
        "vLLM PR #54288 (the final-store clamp of 0.33.0's `_build_store_jobs`: \"the final "
        "sampled token's slot is never committed\")",
    ),
    names.CHECK_LOAD_COVERAGE: (
        "the load a CPU hit admits covers, for every KV cache group, each GPU block the hit "
        "marks computed with a chunk the offload manager holds, at the chunk place the GPU "
        "block allocation expects (guards/checks/admission/loadable.py, guards/checks/load_coverage.py)",
        "a hit is admitted only for tokens whose every group's blocks are loaded from chunks "
        "that hold those positions",
        "vLLM issues #55712, #56709 (prepare_load on chunks the manager no longer holds)",
    ),
    names.CHECK_COPY_COVERAGE: (
        "every GPU block a load writes comes from a chunk slot that a store copied from the GPU "
        "block the storing request's table held at that position (not the null block): the "
        "copy ledger kept at the store site, read at admission (guards/checks/copy_ledger.py)",
        "a chunk key is published only when every sub-block that a hit ending at any of the "
        "chunk's boundaries would load inside the reader's read range was copied (or keys are "
        "made per boundary): the store's reachability mask must not judge by the storing "
        "request's own resume points alone (docs/upstream/swa-partial-chunk.md)",
        "vLLM PR #42959 (the stale-id zeroing), RFC #52837 (offload sources from prefix-cache "
        "records); the reachability mask of 0.33.0 / 0.34.0's `_build_store_jobs`",
    ),
    names.CHECK_GROUP_SIZES_CONSISTENCY: (
        "sum(group_sizes) == len(block_ids) and len(block_indices) == len(group_sizes) in a "
        "GPULoadStoreSpec",
        "a transfer spec lists exactly the blocks its group sizes say",
        "vLLM issue #42945",
    ),
}


def _offender_rows(offenders: list[dict[str, Any]], limit: int = 8) -> list[str]:
    rows = ["| request | KV cache group | block index | GPU block id | what the oracle found |",
            "|---|---|---|---|---|"]
    for o in offenders[:limit]:
        rows.append(f"| `{o.get('request_id')}` | {o.get('group')} | {o.get('block_index')} | "
                    f"{o.get('gpu_block_id')} | {o.get('what')} |")
    return rows


def fired_checks(result: Any) -> dict[str, int]:
    """Checks with at least one violation in a replay (``ReplayResult.checks``): name -> count."""
    return {name: int(c.get("violations") or 0) for name, c in (result.checks or {}).items()
            if c.get("violations")}


def render(*, class_name: str, trace_file: str, version: str, unguarded: Any, observed: Any,
           description: str) -> str:
    """The Markdown report for one wrong-KV class.

    ``unguarded``: the :class:`~kvguard.lab.replay.harness.ReplayResult` of the minimal
    trace with ``--no-guard``; ``observed``: the same trace under policy ``observe``.
    """
    oracle = getattr(getattr(unguarded, "worker", None), "oracle", None)
    offenders = list(getattr(oracle, "wrong_kv", []) or [])
    fired = fired_checks(observed) if observed is not None else {}
    lines = [
        f"# {class_name} on vLLM {version}",
        "",
        f"{description}",
        "",
        f"Minimal trace: `{trace_file}` (JSONL, kvguard-replay/1). vLLM's real scheduler and "
        "offloading connector run it; the GPU worker is simulated below vLLM's own copy-engine "
        "boundary, and a KV-content oracle follows every slot's (position, token).",
        "",
        "## What vLLM alone serves",
        "",
        f"With the guard off the engine stays up, {unguarded.finished} of {unguarded.submitted} requests "
        f"finish, and {unguarded.wrong_kv_blocks} GPU block(s) an attention is about to read do not hold "
        "that request's tokens at those positions:",
        "",
        *_offender_rows(offenders),
        "",
        "## Which invariant sees it",
        "",
    ]
    if not fired:
        lines += [
            "No kvguard invariant fired under policy `observe`: this class is new to kvguard and "
            "the guard does not prevent it yet. Trace it step by step (docs/fuzz.md, \"Tracing a "
            "wrong-KV class\") before reporting it upstream.",
        ]
    for check, count in sorted(fired.items()):
        invariant, fix, refs = WRONG_KV_INVARIANTS.get(check, ("(see docs/fuzz.md)", "", ""))
        lines += [f"- `{check}` ({count} violation(s)): {invariant}."]
        if fix:
            lines += [f"  - What a fix must guarantee: {fix}.", f"  - Public references: {refs}."]
    lines += [
        "",
        "## Replay it",
        "",
        "```",
        f"kvguard replay --trace {Path(trace_file).name} --no-guard      # vLLM alone: wrong_kv_blocks > 0",
        f"kvguard replay --trace {Path(trace_file).name} --policy observe  # kvguard counts, changes nothing",
        f"kvguard replay --trace {Path(trace_file).name}                 # guard: 0 wrong-KV blocks expected",
        "```",
        "",
        "Affected releases: measured here on this release only. Replay the trace on every release "
        "you run (one `scripts/env.sh vllm-X.Y.Z` environment each) before filing: the minimal "
        "trace may not express the class on releases whose scheduler differs.",
        "",
    ]
    return "\n".join(lines)
