"""``kvguard replay``: replay a trace on the real vLLM offload scheduler (the main job).

Exit status: 0 when the engine survived, every request finished and the KV-content
oracle found no wrong KV (``wrong_kv_blocks == 0``); 1 otherwise (the engine died, a
request waited forever, a GPU block held wrong KV when vLLM read it, the trace could
not be loaded, or its geometry cannot be expressed on the installed release); 2 when the
lab itself could not drive the installed vLLM (``harness_error`` in the report: a vLLM API
the lab expected is not there; never an engine death, never a finding).
With ``--json`` stdout carries exactly one JSON object (see :mod:`kvguard.lab.replay.report`);
vLLM's and kvguard's logs go to stderr.
"""

from __future__ import annotations

import json
import os
import sys

import click

from kvguard.lab.replay.trace import BUILTIN_TRACES, DEFAULT_TRACE

#: ``--policy`` of ``kvguard replay`` and ``kvguard fuzz``: the guard policy (observe,
#: guard, strict; default ``KVGUARD_POLICY`` or ``guard``), ignored with ``--no-guard``.
policy_option = click.option(
    "--policy",
    type=click.Choice(["observe", "guard", "strict"]),
    default=lambda: os.environ.get("KVGUARD_POLICY", "guard").strip().lower(),
    show_default="guard (or KVGUARD_POLICY)",
    help="guard policy (ignored with --no-guard)",
)


@click.command(name="replay")
@click.option(
    "--trace",
    "trace_ref",
    default=DEFAULT_TRACE,
    show_default=True,
    metavar="NAME|FILE",
    help=f"built-in trace ({', '.join(sorted(BUILTIN_TRACES))}) or a JSONL trace file",
)
@click.option("--no-guard", is_flag=True, help="run vLLM unguarded: its own assertions decide")
@policy_option
@click.option(
    "--async-scheduling",
    is_flag=True,
    help="set the trace's geometry.async_scheduling: vLLM's AsyncScheduler behind a batch queue of 2",
)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object on stdout")
def replay(trace_ref: str, no_guard: bool, policy: str, async_scheduling: bool, as_json: bool) -> None:
    """Replay a trace on vLLM's real Scheduler + OffloadingConnector (simulated GPU worker)."""
    # vLLM reads these when it is first imported: keep stdout for the report.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from kvguard.lab.replay.trace import TraceError, load_trace

    try:
        trace = load_trace(trace_ref)
    except TraceError as exc:
        click.echo(f"kvguard replay: {exc}", err=True)
        sys.exit(1)
    if async_scheduling:
        import dataclasses

        trace = dataclasses.replace(
            trace, geometry=dataclasses.replace(trace.geometry, async_scheduling=True)
        )

    from kvguard.lab.replay import harness, report

    progress = None
    if not as_json:
        total = len(trace.requests)

        shown: list[int] = []

        # Whole lines, one each time a request finishes: kvguard's and vLLM's JSON event
        # lines share stderr, and an open "\r" line glued the next event onto it.
        def progress(finished: int, _total: int, steps: int) -> None:
            if shown and shown[-1] == finished:
                return
            shown.append(finished)
            click.echo(f"  replaying: {finished}/{total} requests, {steps} steps", err=True)

    # stdout is redirected while vLLM runs: anything it prints goes to stderr.
    real_stdout = sys.stdout
    sys.stdout = sys.stderr
    try:
        result = harness.run_replay(trace, guard=not no_guard, policy=policy, progress=progress)
    except RuntimeError as exc:  # a geometry this release cannot express, or no vLLM
        sys.stdout = real_stdout
        click.echo(f"kvguard replay: {exc}", err=True)
        sys.exit(1)
    finally:
        sys.stdout = real_stdout
    out = report.to_json(result, trace.geometry)
    if as_json:
        real_stdout.write(json.dumps(out) + "\n")
        real_stdout.flush()
    else:
        click.echo(report.to_text(out))
    if result.harness_error is not None:
        # the lab, not vLLM or the guard: a finding about nothing (docs/replay.md, "Exit status")
        click.echo(f"kvguard replay: harness error: {result.harness_error['exception']} "
                   f"(expected {result.harness_error['expected']})", err=True)
        sys.exit(2)
    sys.exit(0 if result.ok else 1)
