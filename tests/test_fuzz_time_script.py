"""Light tests of scripts/fuzz_time.py: which JUnit test cases count as fuzz tests and
what the printed sum is (synthetic JUnit XML, no vLLM)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("fuzz_time", ROOT / "scripts" / "fuzz_time.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.vllm.test_fuzz" name="test_unhinted_search" time="61.5"/>
<testcase classname="tests.vllm.test_fuzz_layouts.TestLayouts" name="test_three_groups" time="20.0"/>
<testcase classname="tests.vllm.test_async_scheduling" name="test_fuzz_draws_async_scheduling_deterministically" time="8.5"/>
<testcase classname="tests.vllm.test_degrade" name="test_load_class" time="100.0"/>
</testsuite></testsuites>
"""


def test_fuzz_modules_and_fuzz_named_tests_are_summed_and_nothing_else(tmp_path, capsys):
    ft = _load()
    report = tmp_path / "vllm-0.33.0.xml"
    report.write_text(JUNIT)
    assert ft.fuzz_seconds(report) == (90.0, 190.0, 3)
    assert ft.main([str(report), str(report)]) == 0
    out = capsys.readouterr().out
    assert "fuzz tests in all: 180 s (3.0 min" in out


def test_no_report_is_exit_2():
    assert _load().main(["/nonexistent/report.xml"]) == 2
