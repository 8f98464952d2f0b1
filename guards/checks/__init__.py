"""The invariants: pure functions of vLLM's geometry (invariants, load and store coverage,
the copy ledger) and the checks that evaluate them on a vLLM call (admission, the rewritten
asserts, tier removals, the wait bound)."""
