"""The settings census (lab/knobs.py): which ``kv_connector_extra_config`` keys a release's
offload code reads, read from sources (light: synthetic sources, no vLLM)."""

from __future__ import annotations

from kvguard.lab.knobs import (
    LAB_KEYS,
    OPERATOR_SETTINGS,
    census,
    extra_config_keys,
    kv_cache_spec_kinds,
    speculative_reads,
)

SOURCES = {
    "vllm.v1.kv_offload.cpu.spec": (
        "class CPUOffloadingSpec:\n"
        "    def __init__(self, config):\n"
        "        self.extra_config = config.extra_config\n"
        "        self.policy = self.extra_config.get('eviction_policy', 'lru')\n"
        "        size = self.extra_config['cpu_bytes_to_use']\n"
        "        if 'lazy_offload' in self.extra_config:\n"
        "            pass\n"
        "        bp = self.extra_config.get('backpressure')\n"
        "        limit = bp.get('max_inflight')\n"
        "        other = {'x': 1}\n"
        "        other.get('not_a_setting')\n"
    ),
    "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector": (
        "def build(vllm_config):\n"
        "    extra_config = vllm_config.kv_transfer_config.kv_connector_extra_config\n"
        "    return extra_config.get('lazy_offload', False)\n"
    ),
    "vllm.broken": "def (:\n",
}


def test_every_kind_of_read_is_found_with_its_place_and_nothing_else():
    keys = extra_config_keys(SOURCES)
    cpu = "vllm.v1.kv_offload.cpu.spec"
    simple = "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector"
    assert keys == {
        "backpressure": [f"{cpu}:8"],
        "backpressure.max_inflight": [f"{cpu}:9"],
        "cpu_bytes_to_use": [f"{cpu}:5"],
        "eviction_policy": [f"{cpu}:4"],
        "lazy_offload": sorted([f"{cpu}:6", f"{simple}:3"]),
    }


def test_the_census_marks_what_the_lab_sets():
    rows = {r["key"]: r for r in census(SOURCES)}
    assert rows["cpu_bytes_to_use"]["drawn"] and rows["cpu_bytes_to_use"]["how"] == LAB_KEYS["cpu_bytes_to_use"]
    assert rows["eviction_policy"]["drawn"] and rows["eviction_policy"]["how"].startswith("drawn (OffloadingConnector)")
    assert not rows["backpressure"]["drawn"] and rows["backpressure"]["how"] is None


def test_the_census_marks_what_the_fuzzer_draws_as_drawn_with_its_connector():
    rows = {r["key"]: r for r in census(SOURCES)}
    assert rows["lazy_offload"]["drawn"]
    assert rows["lazy_offload"]["how"].startswith("drawn (SimpleCPUOffloadConnector): ")
    assert not set(OPERATOR_SETTINGS) & set(LAB_KEYS)  # a key is the geometry's or the operator's


def test_every_drawn_setting_names_a_connector_the_lab_runs():
    from kvguard.lab.replay.trace import CONNECTORS

    assert {connector for connector, _ in OPERATOR_SETTINGS.values()} <= set(CONNECTORS)


SPEC_SOURCES = {
    "vllm.x.scheduler": (
        "from vllm.v1.kv_cache_interface import KVCacheSpec, MambaSpec, SlidingWindowSpec, KVCacheGroupSpec\n"
        "from vllm.other import FakeSpec\n"
        "def f(vllm_config):\n"
        "    spec_config = vllm_config.speculative_config\n"
        "    a = spec_config is not None and spec_config.use_eagle()\n"
        "    return vllm_config.speculative_config.num_speculative_tokens\n"
    ),
}


def test_the_spec_kinds_are_the_imported_layer_kinds_and_the_speculative_reads_their_attributes():
    assert kv_cache_spec_kinds(SPEC_SOURCES) == ["MambaSpec", "SlidingWindowSpec"]
    assert speculative_reads(SPEC_SOURCES) == {
        "num_speculative_tokens": ["vllm.x.scheduler:6"],
        "use_eagle": ["vllm.x.scheduler:5"],
    }
