"""Measured release facts: what a test can only observe, never read from the release's code.

Most expectations of the vLLM tests are computed from what the installed release's code
says (the window bound it asserts, whether its worker asserts a transfer's success:
:mod:`kvguard.guards.hooking.vllm_source`, :mod:`kvguard.lab.replay.vllm_api`). What cannot be
read, only measured, lives in one file, ``tests/vllm/release_facts.csv``: one row per
release and fact (``release,fact,value,measured``; ``value`` is JSON). A release without a
row for a fact fails :func:`fact` and ``test_release_facts.py`` with one message naming
every fact to measure and how. A new vLLM release needs rows here, and nothing else in
the tests: each row is measured by running the command in the fact's description.
"""

from __future__ import annotations

import csv
import functools
import json
from pathlib import Path
from typing import Any

import pytest

FILE = Path(__file__).with_name("release_facts.csv")

#: Every measured fact, with how to measure it on a new release.
FACTS: dict[str, str] = {
    "store_overcounts_straddling_chunk": (
        "vLLM #42945: `kvguard replay --no-guard --trace seed-42945` dies on `assert sum(group_sizes) "
        "== len(block_ids)` (true) or every request finishes (false)"
    ),
    "seed42945_turn1_store_specs": (
        "`kvguard replay --json --trace seed-42945`: worker.store_specs of request agent-a/turn-1, "
        "each as {group_sizes, block_indices}"
    ),
    "abort_queued_49118_dies": (
        "vLLM #49118: `python tests/vllm/degrade_replay.py tests/vllm/traces/abort-queued-49118.jsonl`: "
        "no_guard.engine_survived is false (true) or true (false)"
    ),
    "swa_partial_chunk_wrong_kv_blocks": (
        "`kvguard replay --no-guard --json --trace tests/vllm/traces/wrong-kv-swa-partial-chunk.jsonl`: "
        "wrong_kv_blocks (vLLM publishes a sliding-window chunk whose first sub-blocks the storing "
        "request had skipped; docs/upstream/swa-partial-chunk.md)"
    ),
    "swa_partial_chunk_033_wrong_kv_blocks": (
        "`kvguard replay --no-guard --json --trace tests/vllm/traces/wrong-kv-swa-partial-chunk-033.jsonl`: "
        "wrong_kv_blocks (the same class as found by `kvguard fuzz --no-guard --seed 2` on 0.33.0; null "
        "where the trace's geometry cannot be expressed)"
    ),
    "remote_kvs_hol_stalls": (
        "`kvguard replay --no-guard --json --trace tests/vllm/traces/stall-remote-kvs-hol-021.jsonl`: "
        "stalled (true: request b waits in WAITING_FOR_REMOTE_KVS behind a head that cannot "
        "allocate, vLLM #45388) or every request finishes (false)"
    ),
    "tiered_partial_restore_wrong_kv_blocks": (
        "`kvguard replay --no-guard --json --trace tests/vllm/traces/wrong-kv-tiered-partial-restore-029.jsonl`: "
        "wrong_kv_blocks (null where the release has no vLLM tiering: the trace cannot be expressed)"
    ),
    "tier_restart_swa_partial_wrong_kv_blocks": (
        "`kvguard replay --no-guard --json --trace tests/vllm/traces/tier-restart-swa-partial.jsonl`: "
        "wrong_kv_blocks (null where the release has no vLLM tiering)"
    ),
    "tier_shared_swa_partial_wrong_kv_blocks": (
        "`kvguard replay --no-guard --json --trace tests/vllm/traces/tier-shared-swa-partial.jsonl`: "
        "wrong_kv_blocks, both engines (null where the release has no vLLM tiering)"
    ),
    "stale_zeroing_026_wrong_kv_blocks": (
        "`kvguard replay --no-guard --json --trace tests/vllm/traces/wrong-kv-stale-zeroing-026.jsonl`: "
        "wrong_kv_blocks (null where the trace's geometry cannot be expressed)"
    ),
    "stale_zeroing_029_wrong_kv_blocks": (
        "`kvguard replay --no-guard --json --trace tests/vllm/traces/wrong-kv-stale-zeroing-029.jsonl`: "
        "wrong_kv_blocks (null where the trace's geometry cannot be expressed)"
    ),
    "keyerror_42761_dies": (
        "vLLM #42761: `kvguard replay --no-guard --trace tests/vllm/traces/fuzz-keyerror-42761.jsonl` "
        "dies of a KeyError in _remove_pending_job (true) or survives (false)"
    ),
}


@functools.cache
def _rows() -> dict[tuple[str, str], Any]:
    with FILE.open(encoding="utf-8", newline="") as fh:
        return {(r["release"], r["fact"]): json.loads(r["value"]) for r in csv.DictReader(fh)}


def missing(release: str) -> list[str]:
    """The facts :data:`FACTS` names that have no row for ``release``."""
    return [name for name in FACTS if (release, name) not in _rows()]


def missing_message(release: str) -> str:
    """One message naming every fact ``release`` lacks and how to measure each."""
    lines = [f"vLLM {release} has no measured row in {FILE.name} for: {', '.join(missing(release))}."]
    lines += [f"  {name}: {FACTS[name]}" for name in missing(release)]
    lines.append(f"Measure each on vLLM {release} and add a row `{release},<fact>,<JSON value>,<date and how>`.")
    return "\n".join(lines)


def fact(name: str) -> Any:
    """The measured value of fact ``name`` on the installed vLLM (JSON-decoded).

    Fails the calling test with :func:`missing_message` when the release has no row."""
    from kvguard.guards.hooking.instrumentor import installed_vllm_version

    if name not in FACTS:
        raise KeyError(f"unknown release fact {name!r}; known: {', '.join(FACTS)}")
    release = installed_vllm_version()
    try:
        return _rows()[(release, name)]
    except KeyError:
        pytest.fail(missing_message(release), pytrace=False)
