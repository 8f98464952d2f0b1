"""The guard-state rule shared by the modules that replay in the pytest process
(tests/vllm/conftest.py, tests/replay/test_replay_cli.py): ``harness.run_replay(guard=True)``
installs kvguard into vLLM's code for the whole process (as the plugin does inside
EngineCore), and a module may set ``KVGUARD_DISABLE``; whatever a module leaves behind, the
next one starts with vLLM's own code and the environment it had."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator


def restored_guard_state() -> Iterator[None]:
    """The body of a module-scoped fixture: yields once, then uninstalls the guard if one
    is installed and restores ``KVGUARD_DISABLE``."""
    saved = os.environ.get("KVGUARD_DISABLE")
    yield
    if "kvguard.lab.replay.harness" in sys.modules:
        sys.modules["kvguard.lab.replay.harness"].uninstall_guard()
    if saved is None:
        os.environ.pop("KVGUARD_DISABLE", None)
    else:
        os.environ["KVGUARD_DISABLE"] = saved
