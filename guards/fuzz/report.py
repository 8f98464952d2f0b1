"""Progress line and final table of ``kvguard fuzz`` (both on stderr)."""

from __future__ import annotations

import time
from typing import IO, Any


class Progress:
    """Callable for :func:`kvguard.guards.fuzz.runner.fuzz`'s ``progress``: one ``\\r`` line, at most 4 a second."""

    def __init__(self, stream: IO[str]):
        self.stream = stream
        self._last = 0.0
        self._open = False

    def __call__(self, event: dict[str, Any]) -> None:
        if event.get("phase") == "shrink":
            self.done()
            self.stream.write(f"  shrinking: {event['class']}\n")
            self.stream.flush()
            return
        now = time.monotonic()
        if now - self._last < 0.25:
            return
        self._last = now
        t = event["totals"]
        found = ", ".join(f"{n} x{c}" for n, c in sorted(event["classes"].items())) or "none"
        self.stream.write(
            f"\r  fuzz: {t['examples']} examples, {t['steps']} steps, "
            f"{event['elapsed_s']:.0f} s; classes: {len(event['classes'])} ({found[:160]})\x1b[K"
        )
        self.stream.flush()
        self._open = True

    def done(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


def table(result: dict[str, Any]) -> str:
    """The final human table of a :func:`~kvguard.guards.fuzz.runner.fuzz` report."""
    guard = f"guard on (policy {result['policy']})" if result["guard"] else "guard off"
    lines = [
        f"kvguard fuzz: vLLM {result['vllm_version']}, seed {result['seed']}, {guard}, "
        f"{result['examples']} examples ({result['invalid_geometries']} geometries rejected by vLLM), "
        f"{result['steps']} scheduler steps, {result['wall_s']} s",
        f"  engine deaths {result['engine_deaths']} (kvguard code: {result['kvguard_deaths']}), "
        f"stalls {result['stalls']}, requests lost {result['requests_lost']}, "
        f"wrong-KV blocks {result['wrong_kv_blocks']}, kvguard bugs {result['kvguard_bugs']}",
    ]
    lay = result.get("layouts")
    if lay:
        groups = ", ".join(f"{n}: {c}" for n, c in sorted(lay["kv_cache_groups"].items()))
        lines.append(
            f"  KV cache groups per example ({groups}); mixed block sizes {lay['mixed_block_sizes']}, "
            f"extra_retained_tokens {lay['extra_retained_tokens']}"
        )
    if not result["classes"]:
        lines.append("  no findings")
    for c in result["classes"]:
        flag = " KVGUARD BUG: " + "; ".join(c["kvguard_bug_reasons"]) if c["kvguard_bug"] else ""
        did = f" kvguard: {', '.join(c['kvguard_did'])}." if c.get("kvguard_did") else ""
        issue = f" ({c['known_issue']})" if c.get("known_issue") else ""
        rep = "replays" if c["reproduces"] else "DOES NOT REPLAY"
        s = c["size"]
        lines.append(f"  {c['kind']:8} x{c['count']:<4} {c['class']}{issue}")
        lines.append(
            f"           minimal: {s['requests']} requests, {s['prompt_tokens']} prompt tokens -> "
            f"{c['trace']} ({rep}).{did}{flag}"
        )
    for ng in result.get("not_generated", []):
        lines.append(f"  not generated: {ng['field']}: {ng['reason']}")
    return "\n".join(lines)
