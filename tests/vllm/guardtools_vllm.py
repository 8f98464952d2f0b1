"""Site ids of the special sites as discovery names them where vLLM keeps them (tests/vllm)."""

from kvguard.guards.rewrite import fingerprint_id

SITE_SWA_PENDING_BOUND = "offloading.scheduler:OffloadingConnectorScheduler.update_state_after_alloc:swa_pending_bound"
SITE_GROUP_SIZES_SUM = f"kv_offload.base:GPULoadStoreSpec.__init__:{fingerprint_id('sum(group_sizes) == len(block_ids)')}"
