"""Small helpers shared by the light guards tests (a unique module name: no conftest imports)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvguard.guards.hooking.rewrite import fingerprint_id

# The ids the special sites get where vLLM (and the stand-in of fakevllm.py) keeps them:
# ``<module short>:<qualname>:<tag>`` (kvguard.guards.hooking.sites). Discovered, never listed.
SITE_SWA_PENDING_BOUND = "offloading.scheduler:OffloadingConnectorScheduler.update_state_after_alloc:swa_pending_bound"
SITE_STORE_DROP = "offloading.scheduler:OffloadingConnectorScheduler._build_store_jobs:store_drop"
SITE_GROUP_SIZES_SUM = f"kv_offload.base:GPULoadStoreSpec.__init__:{fingerprint_id('sum(group_sizes) == len(block_ids)')}"
SITE_GROUP_SIZES_INDICES = (
    f"kv_offload.base:GPULoadStoreSpec.__init__:{fingerprint_id('len(block_indices) == len(group_sizes)')}"
)
#: the generic assert of the stand-in's update_state_after_alloc
SITE_REQUEST_NOT_NONE = (
    f"offloading.scheduler:OffloadingConnectorScheduler.update_state_after_alloc:{fingerprint_id('request is not None')}"
)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """A sample's value, 0.0 when absent."""
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value
