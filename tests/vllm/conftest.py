"""Shared fixtures of the vLLM tests (tests/vllm).

One guard-state rule for every module here: ``harness.run_replay(guard=True)`` and
``runner.fuzz(guard=True)`` install kvguard into vLLM's code for the whole process (as the
plugin does inside EngineCore), and a module may set ``KVGUARD_DISABLE``. Whatever a module
leaves behind, the next module starts with vLLM's own code and the environment it had.
"""

from __future__ import annotations

import pytest
from guardstate import restored_guard_state


@pytest.fixture(scope="module", autouse=True)
def _restore_guard_state():
    """After each module: uninstall the guard if one is installed, restore ``KVGUARD_DISABLE``."""
    yield from restored_guard_state()
