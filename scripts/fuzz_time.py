#!/usr/bin/env python3
"""Sum the run time of the fuzz tests in the JUnit XML reports `make test` writes.

    python3 scripts/fuzz_time.py build/test-reports/*.xml

Issue 10 asks that the fuzz tests in CI take at most 10 minutes in all; `.ci/run` prints
this figure after `make test` so every CI run measures it (a measurement, not a timed
test: the exit status is 0 whatever the figure, 2 only when no report could be read).

A fuzz test is a test case of a ``test_fuzz*`` module (tests/fuzz/, tests/vllm/), or one
whose name contains ``fuzz`` elsewhere (the fuzzer runs of tests/vllm/test_async_scheduling.py
and test_tiering.py). Times are pytest's per-test call + setup + teardown seconds, as
JUnit ``time`` attributes give them; module fixtures count toward their first test.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def is_fuzz_test(classname: str, name: str) -> bool:
    """True for a test of a ``test_fuzz*`` module or a test named ``*fuzz*``."""
    # pytest's junit classname is "tests.vllm.test_fuzz" or "tests.vllm.test_fuzz.TestClass"
    return any(p.startswith("test_fuzz") for p in classname.split(".")) or "fuzz" in name


def fuzz_seconds(report: Path) -> tuple[float, float, int]:
    """``(fuzz seconds, all seconds, fuzz test count)`` of one JUnit XML report."""
    root = ET.parse(report).getroot()
    fuzz = total = 0.0
    count = 0
    for case in root.iter("testcase"):
        t = float(case.get("time", 0) or 0)
        total += t
        if is_fuzz_test(case.get("classname", ""), case.get("name", "")):
            fuzz += t
            count += 1
    return fuzz, total, count


def main(argv: list[str]) -> int:
    reports = [Path(a) for a in argv if Path(a).is_file()]
    if not reports:
        print("fuzz_time: no JUnit report found", file=sys.stderr)
        return 2
    grand = 0.0
    for r in sorted(reports):
        fuzz, total, count = fuzz_seconds(r)
        grand += fuzz
        print(f"fuzz tests in {r.stem}: {count} tests, {fuzz:.0f} s of {total:.0f} s")
    print(f"fuzz tests in all: {grand:.0f} s ({grand / 60:.1f} min; issue 10 goal: at most 10 min)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
