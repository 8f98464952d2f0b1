"""Shared fixtures of the vLLM tests (tests/vllm).

One guard-state rule for every module here: ``harness.run_replay(guard=True)`` and
``runner.fuzz(guard=True)`` install kvguard into vLLM's code for the whole process (as the
plugin does inside EngineCore), and a module may set ``KVGUARD_DISABLE``. Whatever a module
leaves behind, the next module starts with vLLM's own code and the environment it had.
"""

from __future__ import annotations

import os
import sys

import pytest


@pytest.fixture(scope="module", autouse=True)
def _restore_guard_state():
    """After each module: uninstall the guard if one is installed, restore ``KVGUARD_DISABLE``."""
    saved = os.environ.get("KVGUARD_DISABLE")
    yield
    if "kvguard.guards.replay.harness" in sys.modules:
        sys.modules["kvguard.guards.replay.harness"].uninstall_guard()
    if saved is None:
        os.environ.pop("KVGUARD_DISABLE", None)
    else:
        os.environ["KVGUARD_DISABLE"] = saved
