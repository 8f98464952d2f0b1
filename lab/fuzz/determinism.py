"""Deterministic generation: a seed's examples must not depend on what the process imported.

``kvguard fuzz`` must be deterministic for a given seed and vLLM release.
Hypothesis' ``@seed`` + ``database=None`` + a fixed ``max_examples`` are not enough:
Hypothesis' default provider (``HypothesisProvider``) draws, with probability 0.05 per
integer / float / string / bytes draw, a value from a pool of *constants*, and half of
that pool is the **local constants**: every literal (ints outside -100..100, short
strings, ...) of every module in ``sys.modules`` whose file is neither in site-packages
nor in the stdlib nor a test file (``hypothesis.internal.conjecture.providers.
_get_local_constants``, re-scanned whenever ``len(sys.modules)`` changes). kvguard is
installed editable, so its own modules are local; which of them are imported depends on
what the process did before (in a pytest process: other test modules import
``kvguard.sidecar.*``, the replay imports its oracle and stall modules lazily during the
first example). So the same seed drew other examples in a used process than in a fresh
one (measured with Hypothesis 6.170.17: importing the rest of kvguard's modules grew the
pool from 80 to 898 constants and changed the generated traces from the 5th example on;
``tests/vllm/test_fuzz.py::test_fuzz_is_deterministic_inside_a_used_process``).

:func:`pinned_constants` removes that input: while it is active the local pool is empty,
so only Hypothesis' global constants (fixed in Hypothesis' own source) can be drawn, and
the generated examples depend only on the seed, the strategies and the Hypothesis
version. It patches one private Hypothesis function; where the installed Hypothesis
lacks it, nothing is patched and the reason is returned, so the report can say so.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

#: What :func:`pinned_constants` yields when the pool is pinned.
PINNED = "pinned: no local constants (only Hypothesis' global constants)"


@contextmanager
def pinned_constants() -> Iterator[str]:
    """Run Hypothesis generation with an empty local-constants pool (module docstring).

    Yields :data:`PINNED`, or ``"not pinned: <reason>"`` when the installed Hypothesis
    has no ``providers._get_local_constants`` / ``CONSTANTS_CACHE`` (then generation may
    depend on the process's imports). Restores Hypothesis' own function on exit and
    clears its constants cache on entry and exit (the cache holds the permitted local
    constants per draw kind, so a stale entry would leak the pool either way).
    Raises nothing of its own.
    """
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError as exc:  # pragma: no cover - a Hypothesis without these modules
        yield f"not pinned: {exc}"
        return
    original = getattr(providers, "_get_local_constants", None)
    cache = getattr(providers, "CONSTANTS_CACHE", None)
    if original is None or cache is None or not hasattr(cache, "cache"):
        yield "not pinned: this Hypothesis has no providers._get_local_constants / CONSTANTS_CACHE"
        return
    empty = Constants()

    def no_local_constants() -> Constants:
        return empty

    cache.cache.clear()
    providers._get_local_constants = no_local_constants
    try:
        yield PINNED
    finally:
        providers._get_local_constants = original
        cache.cache.clear()
