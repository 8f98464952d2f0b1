"""Import boundaries: the sidecar world never imports vLLM (its image has none)."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

from pathlib import Path

import kvguard.sidecar.app


def test_no_sidecar_module_imports_vllm():
    modules = sorted(f"kvguard.sidecar.{m.name}" for m in pkgutil.iter_modules([str(Path(kvguard.sidecar.app.__file__).parent)]))
    assert {"kvguard.sidecar.app", "kvguard.sidecar.supervisor", "kvguard.sidecar.commands", "kvguard.sidecar.collector"} <= set(modules)
    code = (
        "import importlib, json, sys\n"
        f"mods = {modules + ['kvguard.guards.telemetry.statefile', 'kvguard.guards.checks.invariants']!r}\n"
        "for m in mods: importlib.import_module(m)\n"
        "from kvguard.sidecar.cli import main\n"
        "for name in ('sidecar', 'run'): main.get_command(None, name)\n"
        "print(json.dumps(sorted(k for k in sys.modules if k == 'vllm' or k.startswith(('vllm.', 'torch')))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
