"""``kvguard fuzz``: search the installed vLLM's offload scheduler for crash / stall / wrong-KV classes.

Exit status: 0 when no class is a kvguard bug (with ``--no-guard``: always 0 once the run
completed, findings are vLLM's); 1 when a class is flagged ``kvguard_bug``; 2 for a usage
error or a harness error (the lab could not drive the installed vLLM: the run stops at the
first example that shows it, and reports ``harness_error`` instead of findings). With ``--json`` stdout carries exactly one JSON object (docs/fuzz.md); progress,
the final table and vLLM's logs go to stderr.
"""

from __future__ import annotations

import json
import os
import sys

import click

from kvguard.lab.replay.command import policy_option


@click.command(name="fuzz")
@click.option("--budget-s", type=click.FloatRange(min=1), default=None, help="explore for this many seconds (not deterministic)")
@click.option("--examples", type=click.IntRange(min=1), default=None, help="explore exactly N generated examples [default: 200]")
@click.option("--seed", type=int, default=0, show_default=True, help="Hypothesis seed")
@click.option("--guard/--no-guard", default=True, show_default=True, help="run with kvguard installed or vLLM alone")
@policy_option
@click.option("--out", "out_dir", default="fuzz-findings", show_default=True, help="directory for <class-slug>.jsonl")
@click.option(
    "--shrink-replays",
    type=click.IntRange(min=0),
    default=None,
    help="replays each class may spend shrinking (0: keep the first trace) [default: 120]",
)
@click.option(
    "--worker-model/--immediate-worker",
    default=True,
    show_default=True,
    help="draw the simulated worker's latency and failed transfers (where the trace format has them)",
)
@click.option(
    "--async-scheduling/--sync-scheduling",
    "async_scheduling",
    default=True,
    show_default=True,
    help="draw geometry.async_scheduling (vLLM's AsyncScheduler, batch queue of 2) where the release supports it",
)
@click.option(
    "--kv-layouts/--default-layout",
    default=True,
    show_default=True,
    help="draw KV cache groups (1..4, mixed block sizes) and one extra_retained_tokens per "
    "example where the release expresses them; --default-layout keeps full attention + one "
    "sliding window",
)
@click.option(
    "--settings/--default-settings",
    "draw_settings",
    default=True,
    show_default=True,
    help="draw the operator settings each installed connector reads (kv_connector_extra_config: "
    "eviction_policy, store_threshold, offload_prompt_only, ...; docs/fuzz.md); "
    "--default-settings leaves every one at vLLM's default",
)
@click.option(
    "--connector",
    type=click.Choice(["OffloadingConnector", "SimpleCPUOffloadConnector", "both"]),
    default="OffloadingConnector",
    show_default=True,
    help="the kv_connector of every example (SimpleCPUOffloadConnector: what "
    "VLLM_USE_SIMPLE_KV_OFFLOAD=1 runs); both: drawn per example",
)
@click.option(
    "--differential/--no-differential",
    default=True,
    show_default=True,
    help="guard on: replay every example where kvguard acted without the guard too and "
    "compare request by request; an example kvguard made worse is a kvguard bug",
)
@click.option(
    "--epochs",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="long life: serve each example's traffic this many times on one engine (new content "
    "per epoch, shared prefixes kept: many evictions over 100,000+ steps at a few thousand); "
    "shrinking is off unless --shrink-replays is given",
)
@click.option(
    "--verify-budget-s",
    type=click.FloatRange(min=0),
    default=None,
    help="with --epochs above 1 and no shrinking: seconds all classes together may spend "
    "verifying each class on its life's first 1, 2, 4, ... epochs [default: "
    "900]; a class not shown by then is reported unverified",
)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object on stdout")
def fuzz(
    budget_s: float | None,
    examples: int | None,
    seed: int,
    guard: bool,
    policy: str,
    out_dir: str,
    shrink_replays: int | None,
    worker_model: bool,
    async_scheduling: bool,
    kv_layouts: bool,
    draw_settings: bool,
    connector: str,
    differential: bool,
    epochs: int,
    verify_budget_s: float | None,
    as_json: bool,
) -> None:
    """Generate geometries and traffic (Hypothesis) and replay each on vLLM's real scheduler."""
    if budget_s is not None and examples is not None:
        raise click.UsageError("give --budget-s or --examples, not both")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from kvguard.lab.fuzz import plant, report, runner
    from kvguard.guards.hooking.instrumentor import installed_vllm_version

    if installed_vllm_version() is None:
        click.echo("kvguard fuzz: vLLM is not installed: run it in a .venvs/vllm-* environment", err=True)
        sys.exit(2)

    try:
        planted = plant.requested()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    show = report.Progress(sys.stderr)
    result = runner.fuzz(
        seed=seed,
        examples=examples,
        budget_s=budget_s,
        guard=guard,
        policy=policy,
        out_dir=out_dir,
        # a long life's trace takes minutes per replay: shrinking it is asked for, not assumed
        shrink_replays=(runner.SHRINK_REPLAYS if epochs == 1 else 0) if shrink_replays is None else shrink_replays,
        plant=planted,
        worker_model=worker_model,
        async_scheduling=async_scheduling,
        kv_layouts=kv_layouts,
        draw_settings=draw_settings,
        connector=connector,
        differential=differential,
        epochs=epochs,
        verify_budget_s=verify_budget_s,
        progress=show,
    )
    show.done()
    click.echo(report.table(result), err=True)
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    if result.get("harness_error"):
        lab = result["harness_error"]
        click.echo(f"kvguard fuzz: harness error at example {lab['example']}: {lab['exception']} "
                   f"(expected {lab['expected']}); the lab cannot drive this vLLM release, so no "
                   "example is a finding (lab/replay/vllm_api.py)", err=True)
        sys.exit(2)
    sys.exit(1 if result["kvguard_bugs"] else 0)
