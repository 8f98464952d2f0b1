"""A tiny stand-in ``vllm`` package for the light tests (no real vLLM in the ``light`` env).

It mirrors, line for line where it matters, the vLLM 0.25.1 code that kvguard's sites
target: ``GPULoadStoreSpec.__init__`` (with ``super()``, so its code has a ``__class__``
cell), the SWA/Mamba assert of ``update_state_after_alloc`` and the
``src_spec = GPULoadStoreSpec(...)`` statement inside ``_build_store_jobs``'s loop, with
the same normalized text. A ``vllm-<version>.dist-info`` makes ``importlib.metadata``
report the version. The real code is exercised by ``tests/vllm/`` in each vLLM env.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

SCHEDULER = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
BASE = "vllm.v1.kv_offload.base"

BASE_SRC = '''
class BlockIDsLoadStoreSpec:
    def __init__(self, block_ids):
        self.block_ids = list(block_ids)


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    def __init__(
        self,
        block_ids,
        group_sizes,
        block_indices,
    ):
        super().__init__(block_ids)
        assert sum(group_sizes) == len(block_ids)
        assert len(block_indices) == len(group_sizes)
        self.group_sizes = group_sizes
        self.block_indices = block_indices
'''

SCHEDULER_SRC = '''
from dataclasses import dataclass, field
from typing import NamedTuple

from vllm.v1.kv_offload.base import GPULoadStoreSpec


def cdiv(a, b):
    return -(a // -b)


class SlidingWindowSpec:
    def __init__(self, sliding_window, block_size=32):
        self.sliding_window = sliding_window
        self.block_size = block_size


class MambaSpec:
    block_size = 32


class FullAttentionSpec:
    block_size = 32


class GroupOffloadConfig(NamedTuple):
    group_idx: int
    gpu_block_size: int
    offloaded_block_size: int
    sliding_window_size_in_blocks: int | None


class SchedulerOffloadConfig(NamedTuple):
    kv_group_configs: tuple
    block_size_factor: int


class Manager:
    def __init__(self):
        self.released = []
        self.prepared = []

    def prepare_store(self, keys, req_context):
        self.prepared.append(list(keys))
        return list(keys)

    def complete_store(self, keys, req_context, success=True):
        if not success:
            self.released.append(sorted(keys))


@dataclass
class ReqStatus:
    req_context: object = None
    block_ids: list = field(default_factory=list)


class OffloadingConnectorScheduler:
    def __init__(self, spec):
        self.config = SchedulerOffloadConfig(
            kv_group_configs=tuple(
                GroupOffloadConfig(
                    group_idx=i,
                    gpu_block_size=spec.gpu_block_size,
                    offloaded_block_size=spec.gpu_block_size * spec.block_size_factor,
                    sliding_window_size_in_blocks=(
                        cdiv(g.sliding_window, spec.gpu_block_size * spec.block_size_factor)
                        if isinstance(g, SlidingWindowSpec)
                        else (1 if isinstance(g, MambaSpec) else None)
                    ),
                )
                for i, g in enumerate(grp.kv_cache_spec for grp in spec.kv_cache_config.kv_cache_groups)
            ),
            block_size_factor=spec.block_size_factor,
        )
        self.manager = Manager()
        self.loads = []
        self.stores = []

    def update_state_after_alloc(self, request, num_cached_tokens, num_locally_computed_gpu_blocks):
        for group_config in self.config.kv_group_configs:
            gpu_block_size = group_config.gpu_block_size
            num_gpu_blocks = cdiv(num_cached_tokens, gpu_block_size)
            num_pending_gpu_blocks = num_gpu_blocks - num_locally_computed_gpu_blocks
            if group_config.sliding_window_size_in_blocks is not None:
                assert (
                    num_pending_gpu_blocks
                    <= group_config.sliding_window_size_in_blocks
                    * self.config.block_size_factor
                )
            self.loads.append(num_pending_gpu_blocks)
        assert request is not None

    def _build_store_jobs(self, requests):
        store_jobs = {}
        for req_id, req_status, src_block_ids, group_sizes in requests:
            keys_to_store = set(self.manager.prepare_store([f"{req_id}-k{i}" for i in range(2)], None))
            block_indices = [0] * len(group_sizes)
            src_spec = GPULoadStoreSpec(
                src_block_ids, group_sizes=group_sizes, block_indices=block_indices
            )
            store_jobs[req_id] = src_spec
        return store_jobs
'''


@contextlib.contextmanager
def fake_vllm(tmp_path: Path, version: str = "0.25.1", dist: str = "vllm") -> Iterator[Path]:
    """Build the fake package under ``tmp_path`` and put it on ``sys.path``; undo on exit."""
    root = tmp_path / "fakevllm_site"
    files = {
        "vllm/__init__.py": "",
        "vllm/v1/__init__.py": "",
        "vllm/v1/kv_offload/__init__.py": "",
        "vllm/v1/kv_offload/base.py": BASE_SRC,
        "vllm/distributed/__init__.py": "",
        "vllm/distributed/kv_transfer/__init__.py": "",
        "vllm/distributed/kv_transfer/kv_connector/__init__.py": "",
        "vllm/distributed/kv_transfer/kv_connector/v1/__init__.py": "",
        "vllm/distributed/kv_transfer/kv_connector/v1/offloading/__init__.py": "",
        "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py": SCHEDULER_SRC,
        f"{dist.replace('-', '_')}-{version}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
        ),
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    try:
        yield root
    finally:
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[name]
        importlib.invalidate_caches()


class Spec:
    """What the fake scheduler's ``__init__`` reads (as vLLM 0.25.1's OffloadingSpec)."""

    def __init__(self, groups: list, gpu_block_size: int = 32, block_size_factor: int = 8) -> None:
        self.gpu_block_size = gpu_block_size
        self.block_size_factor = block_size_factor
        self.kv_cache_config = type("KVCacheConfig", (), {})()
        self.kv_cache_config.kv_cache_groups = [type("Group", (), {"kv_cache_spec": g})() for g in groups]
