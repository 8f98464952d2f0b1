"""Memory of kvguard's copy ledger (issue 42): bytes per engine at N partly written chunks.

Fills a :class:`kvguard.guards.checks.copy_ledger.CopyLedger` with ``--keys`` entries the
way stores record them (one partial mask per key, keys built as vLLM builds offload keys:
``make_offload_key(block_hash, group_idx)`` = a 32-byte hash and the group index, 0.29.0+)
and measures with tracemalloc (a) the ledger alone, the keys being objects vLLM's CPU tier
already holds while they are resident, and (b) the ledger with its own key objects (a key
the tier no longer holds, kept because a secondary tier may). One number each, in bytes;
a count, not a timing, so no baseline is needed.

    python bench/ledger_memory.py --keys 1000000 --groups 2 --blocks-per-chunk 16
"""

from __future__ import annotations

import argparse
import json
import os
import tracemalloc

from kvguard.guards.checks.copy_ledger import CopyLedger


def _keys(n: int, groups: int) -> list[list[bytes]]:
    per = [[] for _ in range(groups)]
    for i in range(n):
        g = i % groups
        # vLLM 0.34.0 base.make_offload_key: block_hash + group_idx.to_bytes(4, "big")
        per[g].append(os.urandom(32) + g.to_bytes(4, "big"))
    return per


def _masks(n: int, full: int) -> list[int]:
    # never whole, never empty; made inside the measured span so the int objects count
    return [(i % (full - 1)) + 1 for i in range(n)]


def _filled(keys: list[list[bytes]], n: int, full: int) -> CopyLedger:
    """A ledger holding one partial mask per key of ``keys`` (group by group)."""
    masks = _masks(n, full)
    ledger = CopyLedger(len(keys), limit=n)
    j = 0
    for g, group_keys in enumerate(keys):
        ledger.record(g, group_keys, masks[j : j + len(group_keys)], full)
        j += len(group_keys)
    assert ledger.size == n
    return ledger


def _traced(build) -> int:
    """Bytes still allocated by ``build()``'s result (tracemalloc), temporaries freed."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = build()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del kept
    return used


def measure(n: int, groups: int, bpc: int) -> dict[str, int]:
    """``{"ledger_bytes", "ledger_with_keys_bytes", "keys"}`` for ``n`` partial entries."""
    full = (1 << bpc) - 1
    keys = _keys(n, groups)  # made before tracing: vLLM's CPU tier holds these objects
    return {
        "keys": n,
        "ledger_bytes": _traced(lambda: _filled(keys, n, full)),
        "ledger_with_keys_bytes": _traced(lambda: _filled(_keys(n, groups), n, full)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--blocks-per-chunk", type=int, default=16)
    args = parser.parse_args()
    print(json.dumps(measure(args.keys, args.groups, args.blocks_per_chunk)))


if __name__ == "__main__":
    main()
