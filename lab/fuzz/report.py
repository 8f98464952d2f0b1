"""Progress line and final table of ``kvguard fuzz`` (both on stderr)."""

from __future__ import annotations

import time
from typing import IO, Any


class Progress:
    """Callable for :func:`kvguard.lab.fuzz.runner.fuzz`'s ``progress``.

    On a terminal: one ``\\r`` line rewritten at most 4 times a second. On anything else
    (a CI log, a pipe, a file) a whole line at most every ``log_interval_s`` seconds:
    kvguard's and vLLM's JSON log lines share stderr, and a ``\\r`` line left open would
    glue the next JSON event onto it (no longer one JSON object per line).
    """

    def __init__(self, stream: IO[str], log_interval_s: float = 10.0):
        self.stream = stream
        isatty = getattr(stream, "isatty", None)
        self.tty = bool(isatty()) if callable(isatty) else False
        self.interval_s = 0.25 if self.tty else log_interval_s
        self._last = 0.0
        self._open = False

    def __call__(self, event: dict[str, Any]) -> None:
        if event.get("phase") == "shrink":
            self.done()
            self.stream.write(f"  shrinking: {event['class']}\n")
            self.stream.flush()
            return
        if event.get("phase") == "verify":
            self.done()
            self.stream.write(f"  verifying: {event['class']} on its first {event['epochs']} epochs\n")
            self.stream.flush()
            return
        if event.get("phase") == "differential":
            self.done()
            self.stream.write(f"  differential: replaying {event['examples']} acted examples without the guard\n")
            self.stream.flush()
            return
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        self._last = now
        t = event["totals"]
        found = ", ".join(f"{n} x{c}" for n, c in sorted(event["classes"].items())) or "none"
        line = (
            f"  fuzz: {t['examples']} examples, {t['steps']} steps, "
            f"{event['elapsed_s']:.0f} s; classes: {len(event['classes'])} ({found[:160]})"
        )
        if self.tty:
            self.stream.write(f"\r{line}\x1b[K")
            self._open = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        """End an open terminal line (before other output)."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


def table(result: dict[str, Any]) -> str:
    """The final human table of a :func:`~kvguard.lab.fuzz.runner.fuzz` report."""
    guard = f"guard on (policy {result['policy']})" if result["guard"] else "guard off"
    lines = [
        f"kvguard fuzz: vLLM {result['vllm_version']}, seed {result['seed']}, {guard}, "
        f"{result['examples']} examples ({result['invalid_geometries']} geometries rejected by vLLM), "
        f"{result['steps']} scheduler steps, {result['wall_s']} s",
        f"  engine deaths {result['engine_deaths']} (kvguard code: {result['kvguard_deaths']}), "
        f"stalls {result['stalls']}, requests lost {result['requests_lost']}"
        f", requests failed (ended with an error) {result.get('requests_failed', 0)}, "
        f"wrong-KV blocks {result['wrong_kv_blocks']}, kvguard bugs {result['kvguard_bugs']}",
    ]
    if result["guard"]:
        lines.append(f"  copy-coverage skips that could admit an unread load: "
                     f"{result.get('copy_coverage_unchecked_admits', 0)}")
    lab = result.get("harness_error")
    if lab:
        lines.append(f"  HARNESS ERROR at example {lab['example']} (the lab, not vLLM or the guard): "
                     f"{lab['exception']}; expected {lab['expected']}. The run stopped: no example is a finding.")
        return "\n".join(lines)
    diff = result.get("differential") or {}
    if diff.get("enabled"):
        v = diff["verdicts"]
        price = ", ".join(f"{k} {n}" for k, n in sorted(diff["price"].items())) or "none"
        lines.append(
            f"  kvguard acted in {result.get('acted_examples', 0)} examples; against vLLM alone: "
            f"better {v['better']}, same {v['same']}, no better {v['no_better']}, WORSE {v['worse']}; "
            f"hits cut where vLLM alone served every request (price, by check): {price}"
        )
        for check, paths in sorted((diff.get("price_traces") or {}).items()):
            lines.append(f"  price traces of {check}: " + ", ".join(paths))
    lay = result.get("layouts")
    if lay:
        groups = ", ".join(f"{n}: {c}" for n, c in sorted(lay["kv_cache_groups"].items()))
        lines.append(
            f"  KV cache groups per example ({groups}); mixed block sizes {lay['mixed_block_sizes']}, "
            f"extra_retained_tokens {lay['extra_retained_tokens']}"
        )
    if result.get("settings"):
        lines.append("  operator settings per example: "
                     + ", ".join(f"{k} {n}" for k, n in result["settings"].items()))
    if not result["classes"]:
        lines.append("  no findings")
    for c in result["classes"]:
        flag = " KVGUARD BUG: " + "; ".join(c["kvguard_bug_reasons"]) if c["kvguard_bug"] else ""
        did = f" kvguard: {', '.join(c['kvguard_did'])}." if c.get("kvguard_did") else ""
        issue = f" ({c['known_issue']})" if c.get("known_issue") else ""
        rep = ("not verified: the long-life verification budget was spent" if c["reproduces"] is None
               else "replays" if c["reproduces"] else "DOES NOT REPLAY")
        v = c.get("verification")
        if v and v.get("shown_at_epochs"):
            rep += f" on its first {v['shown_at_epochs']} of {v['epochs']} epochs"
        s = c["size"]
        lines.append(f"  {c['kind']:8} x{c['count']:<4} {c['class']}{issue}")
        lines.append(
            f"           minimal: {s['requests']} requests, {s['prompt_tokens']} prompt tokens -> "
            f"{c['trace']} ({rep}).{did}{flag}"
        )
    for ng in result.get("not_generated", []):
        lines.append(f"  not generated: {ng['field']}: {ng['reason']}")
    return "\n".join(lines)
