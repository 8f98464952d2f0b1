"""The documentation site (mkdocs.yml, docs/): `make docs` builds it with `mkdocs build
--strict`, so a warning fails it. Proven here both ways: the repository's docs build with
no warning, and a copy with a dead link, an unknown anchor and a page outside the
navigation does not, naming each."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MKDOCS = Path(sys.executable).with_name("mkdocs")


def _build(root: Path) -> subprocess.CompletedProcess:
    if not MKDOCS.exists():
        pytest.fail(f"mkdocs is not installed beside {sys.executable}: the light environment installs the "
                    "`docs` extra (scripts/env.sh light)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(root / "site")],
                          cwd=root, capture_output=True, text=True, timeout=300, env=env)


def _copy(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    return tmp_path


def test_the_docs_build_with_no_warning(tmp_path):
    res = _build(_copy(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "WARNING" not in res.stdout + res.stderr
    assert (tmp_path / "site" / "runbooks" / "KVGuardRequestWaitStalled" / "index.html").exists()


def test_a_dead_link_an_unknown_anchor_or_an_orphan_page_fails_the_build(tmp_path):
    root = _copy(tmp_path)
    with (root / "docs" / "index.md").open("a") as f:
        f.write("\n[gone](no-such-page.md) and [anchor](replay.md#no-such-anchor)\n")
    (root / "docs" / "orphan.md").write_text("# A page outside the navigation\n")
    res = _build(root)
    out = res.stdout + res.stderr
    assert res.returncode != 0
    assert "no-such-page.md" in out and "no-such-anchor" in out and "orphan.md" in out
    assert "Aborted with 3 warnings in strict mode" in out
