"""The settings a release's offload code reads, and which of them the lab draws.

An operator turns vLLM's offloading through ``--kv-transfer-config``'s
``kv_connector_extra_config``; a guarantee the lab proves is only as wide as the settings
its engines are built with. This module reads, from a release's own offload sources (the
packages kvguard's scope rule reads: :data:`kvguard.guards.hooking.vllm_source._PACKAGE_DIRS`,
worker side included, since a worker-side key can still change what the scheduler sees),
every key the code reads out of that dictionary, with where it reads it; and names the
keys the lab's engines set (:data:`LAB_KEYS`). No vLLM import: the census runs on an sdist
(:mod:`kvguard.lab.release_matrix`) as on the installed package.

What counts as a read (by the AST, never by a release number):

- ``<x>.get("key", ...)``, ``<x>["key"]`` and ``"key" in <x>`` where ``<x>``'s source text
  ends with ``extra_config`` (``self.extra_config``, ``config.extra_config``,
  ``vllm_config.kv_transfer_config.kv_connector_extra_config``, a parameter named
  ``extra_config``);
- one level down: ``<y>.get("inner")`` where ``<y>`` is a local bound (once) from a read of
  ``"outer"``: reported as ``outer.inner`` (0.34.0's ``backpressure`` object).

Keys read through another name (a dictionary passed on under a new name, ``**`` unpacking)
are not seen; the census is a lower bound, and :func:`extra_config_keys`' test plants one
of each kind it does see.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

__all__ = ["LAB_KEYS", "OPERATOR_SETTINGS", "NOT_DRAWN", "LAB_SPEC_KINDS", "extra_config_keys", "census",
           "installed_reads", "kv_cache_spec_kinds", "speculative_reads"]

#: The ``kv_connector_extra_config`` keys the lab's engines set, and from what
#: (:func:`kvguard.lab.replay.vllm_api.build_scheduler`). Every other key the release reads
#: keeps vLLM's default in every replay and fuzz example.
LAB_KEYS: dict[str, str] = {
    "cpu_bytes_to_use": "geometry.cpu_chunks (the CPU tier's size, drawn)",
    "block_size": "geometry.tokens_per_chunk, one GPU block size (drawn)",
    "blocks_per_chunk": "geometry.tokens_per_chunk, mixed GPU block sizes (drawn)",
    "secondary_tiers": "geometry.secondary_tiers: example and fs tiers (drawn)",
    "spec_name": "with geometry.secondary_tiers, vLLM's TieringOffloadingSpec (else vLLM's default spec)",
}


#: The operator settings the fuzzer draws into ``geometry.extra_config``
#: (:func:`kvguard.lab.fuzz.strategies.operator_settings`): key -> (the connector that reads
#: it, what is drawn). Each is drawn only where the installed release's offload code reads
#: the key (:func:`installed_reads`); every value is one vLLM documents for it.
OPERATOR_SETTINGS: dict[str, tuple[str, str]] = {
    "eviction_policy": ("OffloadingConnector",
                        "every built-in CPU-tier cache policy name the release registers (lru, arc)"),
    "store_threshold": ("OffloadingConnector",
                        "0 (vLLM's default: store every chunk), 2 or 3 (store a chunk on its 2nd or "
                        "3rd offer); with secondary tiers only where the tiering spec does not read "
                        "the key (every release so far reads it there to refuse it)"),
    "max_tracker_size": ("OffloadingConnector",
                         "with store_threshold >= 2: 64,000 (vLLM's default) or 2, 8 or 32 entries "
                         "(the offer counter's LRU table evicts)"),
    "offload_prompt_only": ("OffloadingConnector", "true (vLLM's default) or false (decode blocks stored too)"),
    "sync_load_budget_bytes": ("OffloadingConnector",
                               "0 (vLLM's default: every load asynchronous), 1 MiB or 1 TiB per step "
                               "(hits within the step's budget load synchronously, in the step)"),
    "lazy_offload": ("SimpleCPUOffloadConnector",
                     "false (vLLM's default: store as blocks are computed) or true (store blocks "
                     "about to be evicted from the GPU free queue)"),
}


#: Keys a release reads that the lab never sets, each with the line of vLLM's code it rests
#: on (``module``, a fragment of that module's installed source, checked present by
#: ``tests/vllm/test_operator_settings.py`` wherever the release reads the key) and why:
#: ``cannot`` (it cannot change what the scheduler side decides for the engines the lab
#: builds) or ``not yet`` (it can; what the lab lacks to draw it).
NOT_DRAWN: dict[str, tuple[str, str, str, str]] = {
    "spec_module_path": (
        "vllm.v1.kv_offload.factory", 'spec_module_path = extra_config.get("spec_module_path")', "cannot",
        "read only when spec_name names no registered spec: it imports an out-of-tree "
        "OffloadingSpec, code that is not vLLM's"),
    "cache_policy_module_path": (
        "vllm.v1.kv_offload.cpu.spec", '"cache_policy_module_path"', "cannot",
        "imports an out-of-tree CachePolicy when eviction_policy names no built-in one; the "
        "built-in policies are drawn (eviction_policy)"),
    "self_describing_kv_events": (
        "vllm.v1.kv_offload.base", "OffloadingKVEventsConfig(", "cannot",
        "what the KV events published to a router carry; read by the event builders and the "
        "KV cache registry tier (kvcr, not run by the lab), never by a lookup or a store decision"),
    "enable_telemetry": (
        "vllm.v1.kv_offload.tiering.kvcr.manager", 'if not extra_config.get("enable_telemetry", False):',
        "cannot", "metric definitions of the KV cache registry tier (kvcr), which the lab does not run"),
    "tier_poll_interval_s": (
        "vllm.v1.kv_offload.tiering.manager", "tier.tolerates_off_thread_polling", "cannot",
        "the pause of the off-thread poll of tiers that set tolerates_off_thread_polling (p2p); "
        "the example and fs tiers the lab runs are polled per step whatever its value"),
    "backpressure": (
        "vllm.v1.kv_offload.tiering.factory", 'bp_config = config.pop("backpressure", None)', "not yet",
        "a secondary tier skips stores while a detector's wall-clock latency EMA is high "
        "(EMABackpressureDetector, seconds); the lab's worker counts latency in steps, so a drawn "
        "detector would make replays depend on the machine's clock"),
    "canonical_layout": (
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.config",
        'canonical_layout = bool(extra_config.get("canonical_layout", False))', "not yet",
        "a parallelism-agnostic page layout: file_mapper then names fs-tier files without the "
        "rank layout, so engines of different tensor-parallel sizes share chunks; the lab runs "
        "one rank"),
    "cpu_bytes_to_use_per_rank": (
        "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector",
        "cpu_capacity_per_rank = explicit", "cannot",
        "replaces cpu_bytes_to_use // world_size; with the lab's one rank that is the CPU pool "
        "size the lab already draws (geometry.cpu_chunks through cpu_bytes_to_use)"),
    "num_cpu_blocks": (
        "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector",
        'num_cpu_blocks = extra_config.get("num_cpu_blocks")', "cannot",
        "sets the CPU pool's size in blocks instead of deriving it from the byte budget; the "
        "pool size is drawn (geometry.cpu_chunks)"),
    "cpu_hugepage_block_size": (
        "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector",
        'extra_config.get("cpu_hugepage_block_size")', "cannot",
        "how the host buffer is allocated (huge pages), below the copy engine the lab simulates"),
    "kv_offload_backend": (
        "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector",
        'disk_mode = kv_offload_backend == "disk"', "not yet",
        "the simple connector's disk backend (and with it disk_path, disk_capacity_bytes, "
        "disk_buffer_slots, use_page_cache): another pool and copy engine; the lab simulates "
        "the CPU backend's copy engine only"),
    "disk_path": (
        "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector",
        'disk_path = extra_config.get("disk_path", None) or None', "not yet", "with kv_offload_backend"),
    "disk_capacity_bytes": (
        "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector",
        '"disk_capacity_bytes"', "not yet", "with kv_offload_backend"),
    "disk_buffer_slots": (
        "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector",
        '"disk_buffer_slots"', "not yet", "with kv_offload_backend"),
    "use_page_cache": (
        "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector",
        '"use_page_cache"', "not yet", "with kv_offload_backend"),
}


def _is_extra_config(node: ast.AST) -> bool:
    text = ast.unparse(node)
    return text.endswith("extra_config")


def _key(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _reads(tree: ast.AST) -> Iterable[tuple[str, ast.AST, int]]:
    """``(key, node read from, line)`` for every constant-key read of any mapping."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args and _key(node.args[0]) is not None:
            yield _key(node.args[0]), node.func.value, node.lineno  # type: ignore[misc]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _key(node.slice) is not None:
            yield _key(node.slice), node.value, node.lineno  # type: ignore[misc]
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
                and _key(node.left) is not None:
            yield _key(node.left), node.comparators[0], node.lineno  # type: ignore[misc]


def _direct_read(value: ast.AST) -> str | None:
    """The key of ``value`` when it is itself a read of an extra-config key, else None."""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "get" \
            and value.args and _is_extra_config(value.func.value):
        return _key(value.args[0])
    if isinstance(value, ast.Subscript) and _is_extra_config(value.value):
        return _key(value.slice)
    return None


def _outer_locals(tree: ast.AST) -> dict[str, str]:
    """``{local: outer key}`` for locals assigned once, from a read of an extra-config key."""
    bound: dict[str, list[str | None]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            bound.setdefault(node.targets[0].id, []).append(_direct_read(node.value))
    return {name: keys[0] for name, keys in bound.items() if len(keys) == 1 and keys[0] is not None}


def extra_config_keys(package_sources: dict[str, str]) -> dict[str, list[str]]:
    """``{key: ["module:line", ...]}``: every ``kv_connector_extra_config`` key the given
    sources read (``{module: source}``, e.g.
    :func:`kvguard.guards.hooking.vllm_source.installed_package_sources`), nested keys as
    ``outer.inner``. Sources that do not parse are skipped. Never raises for valid input."""
    out: dict[str, set[str]] = {}
    for module, source in package_sources.items():
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        nested = _outer_locals(tree)
        for key, source_node, line in _reads(tree):
            if _is_extra_config(source_node):
                name = key
            elif isinstance(source_node, ast.Name) and source_node.id in nested:
                name = f"{nested[source_node.id]}.{key}"
            else:
                continue
            out.setdefault(name, set()).add(f"{module}:{line}")
    return {k: sorted(v) for k, v in sorted(out.items())}


def _how(key: str) -> str | None:
    if key in LAB_KEYS:
        return LAB_KEYS[key]
    if key in OPERATOR_SETTINGS:
        connector, what = OPERATOR_SETTINGS[key]
        return f"drawn ({connector}): {what}"
    return None


def census(package_sources: dict[str, str]) -> list[dict[str, object]]:
    """One row per key the sources read: ``key``, ``read_at`` (module:line list), ``drawn``
    (the lab sets it: :data:`LAB_KEYS`, or the fuzzer draws it: :data:`OPERATOR_SETTINGS`),
    ``how`` (what sets it, or None) and ``not_drawn`` (``"cannot: why"`` or
    ``"not yet: why"`` from :data:`NOT_DRAWN`, or None)."""
    return [
        {"key": key, "read_at": where, "drawn": _how(key) is not None, "how": _how(key),
         "not_drawn": None if key not in NOT_DRAWN else f"{NOT_DRAWN[key][2]}: {NOT_DRAWN[key][3]}"}
        for key, where in extra_config_keys(package_sources).items()
    ]


_INSTALLED: dict[str, list[str]] | None = None


def installed_reads() -> dict[str, list[str]]:
    """:func:`extra_config_keys` of the installed vLLM's offload sources (cached per
    process; ``{}`` without vLLM)."""
    global _INSTALLED
    if _INSTALLED is None:
        from kvguard.guards.hooking.vllm_source import SourceError, installed_package_sources

        try:
            _INSTALLED = extra_config_keys(installed_package_sources())
        except SourceError:  # no vLLM: it reads nothing
            _INSTALLED = {}
    return _INSTALLED


#: The KV cache spec kinds the lab's engines are built with
#: (:func:`kvguard.lab.replay.vllm_api.make_kv_cache_config`: one group per spec; the MLA
#: kinds for a trace's ``mla`` groups, drawn by the fuzzer with ``groups``).
LAB_SPEC_KINDS: frozenset[str] = frozenset(
    {"FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec", "SlidingWindowMLASpec"})

#: Names ``vllm.v1.kv_cache_interface`` exports that end in ``Spec`` and are not a kind of
#: layer: the base classes and the group wrapper.
_NOT_KINDS = frozenset({"KVCacheSpec", "AttentionSpec", "KVCacheGroupSpec"})


def kv_cache_spec_kinds(package_sources: dict[str, str]) -> list[str]:
    """The KV cache spec kinds the offload code handles: every ``...Spec`` class it imports
    from ``vllm.v1.kv_cache_interface`` (``from vllm.v1.kv_cache_interface import
    MambaSpec``), base classes left out; sorted. Compare :data:`LAB_SPEC_KINDS`."""
    kinds: set[str] = set()
    for source in package_sources.values():
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "vllm.v1.kv_cache_interface":
                kinds |= {a.name for a in node.names if a.name.endswith("Spec") and a.name not in _NOT_KINDS}
    return sorted(kinds)


def speculative_reads(package_sources: dict[str, str]) -> dict[str, list[str]]:
    """``{attribute: ["module:line", ...]}``: what the offload code reads off vLLM's
    ``speculative_config`` (an expression ending in ``speculative_config``, or a local bound
    once from one), the switches by which speculative decoding reaches the offload path
    (0.34.0: ``use_eagle_block_drop``)."""
    out: dict[str, set[str]] = {}
    for module, source in package_sources.items():
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        bound: dict[str, int] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                    and ast.unparse(node.value).endswith("speculative_config"):
                bound[node.targets[0].id] = bound.get(node.targets[0].id, 0) + 1
        names = {n for n, count in bound.items() if count == 1}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and (
                ast.unparse(node.value).endswith("speculative_config")
                or (isinstance(node.value, ast.Name) and node.value.id in names)
            ):
                out.setdefault(node.attr, set()).add(f"{module}:{node.lineno}")
    return {k: sorted(v) for k, v in sorted(out.items())}
