"""kvguard.guards.telemetry.events: one sanitized JSON line per event, on a private structlog chain."""

from __future__ import annotations

import json

import structlog

from kvguard.guards.telemetry import events


class Request:
    request_id = "r-1"
    prompt_token_ids = [101, 102, 103]


def test_context_never_carries_tokens_or_objects():
    context = {
        "prompt_token_ids": [1, 2, 3],
        "request": Request(),
        "num_cached_tokens": 98012,
        "block_ids": list(range(40)),
        "group_sizes": [0, 16],
        "label": "x" * 1000,
        "@kvguard_ok": False,
        "__class__": object,
        "self": object(),
    }
    with events.capture() as logged:
        events.check_failed(site="s", check="group_sizes_consistency", context=context, prompt="secret text")
    (event,) = logged
    assert "prompt" not in event
    assert event["context"] == {
        "request": "<Request>",
        "num_cached_tokens": 98012,
        "block_ids": "<list len=40>",
        "group_sizes": [0, 16],
        "label": "x" * 200 + "...",
    }
    assert "101" not in json.dumps(event, default=str)


def test_one_json_line_on_stderr(capfd):
    events.check_tolerated(site="s", check="swa_pending_bound", pending_blocks=129, exact_bound=129)
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1
    line = json.loads(err[0])
    assert line["event"] == "check_tolerated" and line["outcome"] == "tolerated"
    assert line["pending_blocks"] == 129 and line["level"] == "warning" and "timestamp" in line


def test_global_structlog_configuration_is_left_alone(capsys):
    before = structlog.get_config()
    events.installed(policy="guard")
    assert structlog.get_config() == before
    assert not structlog.is_configured()
