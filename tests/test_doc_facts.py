"""Facts the docs state, checked against the code (issue 45, part 1).

Every alert name, metric name (or other ``kvguard_*`` name of the code: a report field, a
log key), ``KVGUARD_*`` environment variable, ``make`` target,
``kvguard`` subcommand and Dockerfile stage that the README or a page under ``docs/`` names
must exist where the code declares it (``dashboards/alerts.yaml``, ``guards/names.py``'s
``METRIC_*`` and the sidecar's ``SIDECAR_METRICS``, the source tree, the Makefile, the CLI's
command table, the Dockerfile); and every alert and every metric the code declares must
appear in its reference page (``docs/deploy.md``'s alert table, ``docs/settings.md``'s
metric table). A failure names the page, the line and the fact.

Pages not checked, each for a reason: ``docs/benchmark.md`` is the dated record of earlier
sessions and names commands as they were then (it says so in its first paragraph).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
#: dated history pages: they quote what existed then (module doc)
HISTORY = {"docs/benchmark.md"}


def _pages() -> list[Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in pages if str(p.relative_to(ROOT)) not in HISTORY]


def _alerts() -> set[str]:
    doc = yaml.safe_load((ROOT / "dashboards" / "alerts.yaml").read_text())
    return {r["alert"] for g in doc["groups"] for r in g["rules"] if "alert" in r}


def _metrics() -> set[str]:
    from kvguard.guards import names
    from kvguard.sidecar.collector import SIDECAR_METRICS

    declared = {v for k, v in vars(names).items() if k.startswith("METRIC_") and isinstance(v, str)}
    return declared | set(SIDECAR_METRICS)


def _source_text() -> str:
    parts = [p.read_text() for d in ("guards", "sidecar", "lab", "tests", "scripts", "bench")
             for p in (ROOT / d).rglob("*")
             if p.suffix in (".py", ".sh") and p.is_file() and p.resolve() != Path(__file__).resolve()]
    parts += [(ROOT / f).read_text() for f in ("Makefile", "Dockerfile")]
    return "\n".join(parts)


def _make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w.%-]*)\s*:", (ROOT / "Makefile").read_text(), re.M))


def _dockerfile_stages() -> set[str]:
    return set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.M | re.I))


def _cli_commands() -> set[str]:
    from kvguard.sidecar import cli

    return set(cli._COMMANDS)


def _lines(every_page: bool = False):
    """``(page:line, text)`` of the pages checked (``every_page``: the history pages too)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))] if every_page else _pages()
    for page in pages:
        rel = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
        for number, line in enumerate(page.read_text().splitlines(), 1):
            yield f"{rel}:{number}", line


def _metric_known(name: str, declared: set[str]) -> bool:
    base = re.sub(r"_(bucket|sum|count|created)$", "", name)
    return any(n in declared or n + "_total" in declared for n in (name, base, name.removesuffix("_total")))


def test_every_fact_a_page_names_exists_in_the_code():
    alerts, metrics, source = _alerts(), _metrics(), _source_text()
    targets, stages, commands = _make_targets(), _dockerfile_stages(), _cli_commands()
    wrong = []
    for where, line in _lines():
        for a in re.findall(r"\b(?:KVGuard|VLLMEngine)[A-Z]\w+", line):
            if a not in alerts:
                wrong.append(f"{where}: alert {a} is not in dashboards/alerts.yaml")
        for m in re.findall(r"\bkvguard_[a-z_]+", line):
            # a metric, or another name of the code's (a report field, a log key, a label)
            if not _metric_known(m, metrics) and not re.search(rf"\b{m}\b", source):
                wrong.append(f"{where}: metric or field {m} is declared nowhere")
        for e in re.findall(r"\bKVGUARD_[A-Z0-9_]+", line):
            if e not in source:
                wrong.append(f"{where}: environment variable {e} is read nowhere")
        for t in re.findall(r"`make ([a-z][\w-]*)", line):
            if t not in targets:
                wrong.append(f"{where}: make target {t} is not in the Makefile")
        for s in re.findall(r"(?:--target[ =]|COPY --from=)([\w-]+)", line):
            if s not in stages:
                wrong.append(f"{where}: Dockerfile stage {s} does not exist")
        for c in re.findall(r"`kvguard ([a-z][a-z-]*)(?!\w)", line):
            if c not in commands:
                wrong.append(f"{where}: CLI command kvguard {c} does not exist")
    assert not wrong, "\n".join(wrong)


def test_every_declared_alert_and_metric_has_its_reference_row():
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    settings = (ROOT / "docs" / "settings.md").read_text()
    missing = [f"docs/deploy.md: alert {a} has no row" for a in sorted(_alerts()) if f"| `{a}` |" not in deploy]
    missing += [f"docs/settings.md: metric {m} has no row" for m in sorted(_metrics())
                if f"| `{m}` |" not in settings and f"| `{m.removesuffix('_total')}" not in settings]
    readme = (ROOT / "README.md").read_text()
    missing += [f"README.md: metric {m} is not in the metric table" for m in sorted(_metrics()) if f"`{m}`" not in readme]
    assert not missing, "\n".join(missing)


def test_every_check_and_action_label_value_is_in_its_reference_page():
    """The ``check`` and ``action`` label values an operator filters on
    (``kvguard_invariant_violations_total{check,action}``): every check the code declares is
    named in ``docs/settings.md``'s check list, every action in ``docs/policies.md``."""
    from kvguard.guards import names

    settings = (ROOT / "docs" / "settings.md").read_text()
    policies = (ROOT / "docs" / "policies.md").read_text()
    missing = [f"docs/settings.md: check {c} is not named" for c in names.CHECKS if f"`{c}`" not in settings]
    missing += [f"docs/policies.md: action {a} is not named" for a in names.ACTIONS if f"`{a}`" not in policies]
    missing += [f"docs/settings.md: action {a} is not named" for a in names.ACTIONS if f"`{a}`" not in settings]
    # the runbook of the alert that fires on them (the wait bound's checks and actions have
    # their own alert and runbook, KVGuardRequestWaitStalled)
    runbook = (ROOT / "docs" / "runbooks" / "KVGuardInvariantViolation.md").read_text()
    wait_only = {names.CHECK_WAIT_BOUND, names.ACTION_STORES_WITHHELD}
    missing += [f"docs/runbooks/KVGuardInvariantViolation.md: {kind} {v} has no row"
                for kind, values in (("check", names.CHECKS), ("action", names.ACTIONS))
                for v in values if v not in wait_only and f"`{v}`" not in runbook]
    assert not missing, "\n".join(missing)


def test_the_check_catches_a_planted_drift(tmp_path, monkeypatch):
    """The checks are not vacuous: a page that names an alert, a metric, a variable, a target,
    a stage and a command that do not exist fails with each one named."""
    page = tmp_path / "README.md"
    page.write_text("`KVGuardNoSuchAlert`, `kvguard_no_such_metric_total`, `KVGUARD_NO_SUCH_SETTING`,\n"
                    "`make no-such-target`, `docker build --target nostage`, `kvguard nocommand`\n")
    monkeypatch.setattr(sys.modules[__name__], "_pages", lambda: [page])
    try:
        test_every_fact_a_page_names_exists_in_the_code()
    except AssertionError as error:
        text = str(error)
    else:
        raise AssertionError("a planted drift passed")
    for fact in ("KVGuardNoSuchAlert", "kvguard_no_such_metric_total", "KVGUARD_NO_SUCH_SETTING",
                 "no-such-target", "nostage", "kvguard nocommand"):
        assert fact in text


#: project history in a reference page: an issue number, a dated "since" / "until"
HISTORY_MARK = re.compile(r"\bissue \d+\b|\b(?:since|until) \d{1,2} (?:Nov|Dec)\b|when issue", re.I)


def _operate_pages() -> list[str]:
    """The pages of the site's "Operate" section (mkdocs.yml's nav), read as text: the file
    carries a ``!!python/name`` tag that ``yaml.safe_load`` refuses."""
    pages, inside = [], False
    for line in (ROOT / "mkdocs.yml").read_text().splitlines():
        if re.match(r"^  - \S", line):
            inside = line.strip() == "- Operate:"
            continue
        if inside:
            pages += re.findall(r":\s*(\S+\.md)\s*$", line)
    return pages


def test_the_operators_pages_carry_no_project_history():
    """An operator reads what is true now; the project's history (issue numbers, "since"
    dates) belongs in the lab notebook (measurements.md, ci-times.md, fuzz.md)."""
    pages = _operate_pages()
    assert "deploy.md" in pages and "runbooks/VLLMEngineDown.md" in pages  # the section was read
    found = [f"docs/{p}:{n}: {m.group(0)}" for p in pages
             for n, line in enumerate((ROOT / "docs" / p).read_text().splitlines(), 1)
             for m in [HISTORY_MARK.search(line)] if m]
    assert not found, "\n".join(found)


#: the project's own issue numbers ("issue 31", "issues 2, 3"; vLLM's are "vLLM #N" / "vllm#N")
PROJECT_ISSUE = re.compile(r"\b[Ii]ssues? \d+\b")
#: a path outside the repository (the project's design notes, a machine's work dir)
OUTSIDE_PATH = re.compile(r"\.\./shared\b|(?<![\w.])/work/")


def test_no_page_names_a_project_issue_or_a_file_outside_the_repository():
    """Every page, the lab notebook included, reads on its own: the project's issue numbers
    mean nothing to a reader of the site, and a file outside the repository is not there."""
    found = [f"{where}: {m.group(0)}" for where, line in _lines(every_page=True)
             for rx in (PROJECT_ISSUE, OUTSIDE_PATH) for m in rx.finditer(line)]
    assert not found, "\n".join(found)
    # not vacuous: both patterns catch what they are for, and leave vLLM's issues alone
    assert PROJECT_ISSUE.search("(issue 31)") and OUTSIDE_PATH.search("`../shared/DESIGN.md`")
    assert not PROJECT_ISSUE.search("vLLM #48959") and not OUTSIDE_PATH.search("docs/replay.md")


def test_make_docs_fails_on_a_planted_wrong_metric_a_missing_alert_row_and_an_unknown_target(tracked_copy):
    """``make docs`` (in ``make test``, so in CI) runs these checks before it builds the site:
    in a copy of the repository whose README names a metric and a make target that do not
    exist and whose alert table lost a row, it fails and names each of the three."""
    import subprocess

    copy = tracked_copy("repo")
    (copy / ".venvs").symlink_to(ROOT / ".venvs")  # the light environment, already built
    readme = copy / "README.md"
    readme.write_text(readme.read_text() + "\n`kvguard_planted_metric_total` and `make planted-target`\n")
    deploy = copy / "docs" / "deploy.md"
    text = deploy.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `KVGuardSidecarBlind` |"))
    deploy.write_text(text.replace(row + "\n", ""))
    out = subprocess.run(["make", "--no-print-directory", "docs"], cwd=copy, capture_output=True, text=True)
    assert out.returncode != 0
    for fact in ("metric or field kvguard_planted_metric_total is declared nowhere",
                 "make target planted-target is not in the Makefile",
                 "docs/deploy.md: alert KVGuardSidecarBlind has no row"):
        assert fact in out.stdout + out.stderr, fact
