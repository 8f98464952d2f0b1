"""The distribution owns one import namespace: ``kvguard`` (issue 11).

PyPI already has distributions named ``guards`` and ``sidecar`` that install top-level
modules of those names; kvguard's wheel must install nothing but ``kvguard/`` (plus its
dist-info), with the entry point and the console script pointing into it. The wheel is
built for real from this checkout with uv (the pinned one of ``scripts/env.sh``).
"""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UV = ROOT / ".venvs" / "tools" / "bin" / "uv"


def test_wheel_installs_only_the_kvguard_namespace(tmp_path):
    assert UV.exists(), f"{UV} missing: run scripts/env.sh light first (it installs uv)"
    subprocess.run([str(UV), "build", "-q", "--wheel", "-o", str(tmp_path), str(ROOT)], check=True)
    (wheel,) = tmp_path.glob("kvguard-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = zf.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"kvguard", next(t for t in tops if t.endswith(".dist-info"))}
    assert "kvguard/__init__.py" not in names  # a PEP 420 namespace: nothing to collide with
    assert {"kvguard/guards/plugin.py", "kvguard/sidecar/cli.py",
            "kvguard/lab/replay/traces/seed-48959.jsonl",
            "kvguard/lab/fuzz/strategies.py", "kvguard/lab/fuzz/runner.py"} <= set(names)
    assert "kvguard = kvguard.guards.plugin:register" in entry_points
    assert "kvguard = kvguard.sidecar.entry:main" in entry_points  # fast path for kvguard run (issue 12 row 6)
