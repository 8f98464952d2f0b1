"""A secondary tier in the replay: vLLM's ``TieringOffloadingManager`` over the CPU tier.

A trace's ``geometry.secondary_tiers`` (vLLM's own ``kv_connector_extra_config`` key of
``TieringOffloadingSpec``, ``vllm/v1/kv_offload/tiering/spec.py``) makes the harness
configure the real ``OffloadingConnector`` with ``spec_name="TieringOffloadingSpec"``
and those tiers. vLLM then builds, in the scheduler role, a ``TieringOffloadingManager``
whose primary tier is its CPU manager (``CPUPrimaryTierOffloadingManager``, the same LRU
and ``cpu_bytes_to_use`` as without tiering) and whose secondary tiers come from its
``SecondaryTierFactory``. Every chunk stored to the CPU tier is cascaded to every
secondary tier (``complete_store`` -> ``submit_store``); a lookup that misses the CPU tier
and hits a secondary tier starts a promotion (``submit_load`` into a CPU slot, lookup
answers "retry later"), and the next lookup finds the chunk in the CPU tier and loads it
to the GPU as any other CPU hit.

The harness accepts two tier types:

- ``"example"``: vLLM's ``ExampleSecondaryTierManager`` (``tiering/example/manager.py``),
  an in-memory tier that vLLM ships "for testing the TieringOffloadingManager". It keeps
  only the *presence* of a key (``chunks[key] = True``) and completes every job at
  submit; it copies no bytes.
- ``"fs"``: vLLM's ``FileSystemTierManager``, real files in a temporary directory the
  replay owns, its completions and lookups made deterministic and the oracle following
  the bytes on disk (:mod:`kvguard.lab.replay.fs_tier`).

The other built-in tiers need services the lab does not run: ``obj`` an object store
(S3 API), ``p2p`` peer engines over ZMQ and NIXL, ``kvcr`` (0.33.0 onwards) a KV cache
registry; :func:`validate_tiers` rejects them, and the docs say so.

The hardware boundary is simulated exactly where the example tier skips it: a real tier
copies ``primary_kv_view[chunk_id]`` into its store at ``submit_store`` and back into
``primary_kv_view[chunk_id]`` at ``submit_load``. :class:`TierTap` wraps each tier
instance's ``submit_store`` / ``submit_load`` (instance attributes; vLLM's methods run
unchanged) and does that copy on the KV-content oracle's fingerprints
(:meth:`kvguard.lab.replay.kv_oracle.KVOracle.secondary_store` /
:meth:`~kvguard.lab.replay.kv_oracle.KVOracle.secondary_load`), so a chunk promoted
into a CPU slot that held other KV is checked against what was cascaded for its key.

Feature detection (no version table): the release must have vLLM's tiering spec
registered in ``OffloadingSpecFactory`` and the ``example`` tier in
``SecondaryTierFactory``, and its tier jobs must name their CPU slots (``chunk_ids`` or
``block_ids``). Measured: present on 0.25.1 and 0.33.0 (``block_ids`` / ``chunk_ids``),
absent on 0.21.0 (no ``vllm.v1.kv_offload.tiering`` package); 0.26.0 and 0.29.0 not
measured.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvguard.lab.replay import fs_tier
from kvguard.lab.replay.fs_tier import job_slots as _slots

if TYPE_CHECKING:
    from kvguard.lab.replay.fs_tier import FsTierDriver, TierStorage
    from kvguard.lab.replay.kv_oracle import KVOracle

#: The trace geometry field (vLLM's ``kv_connector_extra_config`` key).
FIELD = "secondary_tiers"
#: ``OffloadingSpecFactory`` name of vLLM's tiering spec.
SPEC_NAME = "TieringOffloadingSpec"
#: Secondary tier types the replay can run (module docstring).
TIER_TYPES = ("example", "fs")


class TieringUnsupported(RuntimeError):
    """The installed vLLM cannot run a trace's ``secondary_tiers`` (message says why)."""


def unsupported_reason() -> str | None:
    """Why the installed vLLM cannot run ``secondary_tiers``; ``None`` when it can.

    Detected from the release's code: ``TieringOffloadingSpec`` registered in
    ``OffloadingSpecFactory``, ``"example"`` registered in ``SecondaryTierFactory``, and
    the tier job dataclass (``TransferJob`` 0.33 / ``JobMetadata`` 0.25) has a
    ``chunk_ids`` or ``block_ids`` field. Without vLLM: "vLLM is not installed".
    """
    import dataclasses
    import importlib.util

    from kvguard.guards.hooking.instrumentor import installed_vllm_version

    if installed_vllm_version() is None:  # distribution metadata, not an importable "vllm"
        return "vLLM is not installed"
    try:
        if importlib.util.find_spec("vllm.v1.kv_offload.tiering") is None:
            return "this release has no vllm.v1.kv_offload.tiering package"
    except (ImportError, ValueError) as exc:
        return f"vllm.v1.kv_offload.tiering cannot be imported ({exc})"
    try:
        from vllm.v1.kv_offload import factory as spec_factory
        from vllm.v1.kv_offload.tiering import base
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    except ImportError as exc:
        return f"vLLM's tiering modules cannot be imported ({exc})"
    registry = getattr(spec_factory.OffloadingSpecFactory, "_registry", {})
    if SPEC_NAME not in registry:
        return f"OffloadingSpecFactory has no {SPEC_NAME!r}"
    tiers = getattr(SecondaryTierFactory, "_registry", {})
    missing = [t for t in TIER_TYPES if t not in tiers]
    if missing:
        return f"SecondaryTierFactory has no tier type {missing}"
    job_cls = getattr(base, "TransferJob", None) or getattr(base, "JobMetadata", None)
    if job_cls is None or not dataclasses.is_dataclass(job_cls):
        return "the tiering base module has no TransferJob / JobMetadata dataclass"
    names = {f.name for f in dataclasses.fields(job_cls)}
    if not names & {"chunk_ids", "block_ids"}:
        return f"{job_cls.__name__} names no CPU slots (no chunk_ids / block_ids field)"
    return None


def validate_tiers(tiers: Any, where: str = f"geometry.{FIELD}") -> tuple[str, ...]:
    """Parse a trace's ``secondary_tiers``: a list of tier configs ``{"type": "example"}``.

    Returns the tier types, in order (one tier per entry; :func:`extra_config` turns them
    back into vLLM's tier configs).

    Raises:
        ValueError: not a non-empty list of objects, a ``type`` other than
            :data:`TIER_TYPES`, or a key other than ``type`` (the example tier's
            ``custom_param`` changes nothing the replay sees, so it is not accepted; the
            fs tier's ``root_dir`` is the replay's own temporary directory).
    """
    if not isinstance(tiers, (list, tuple)) or not tiers:
        raise ValueError(f"{where} must be a non-empty list of tier configs")
    out = []
    for i, tier in enumerate(tiers):
        if not isinstance(tier, dict):
            raise ValueError(f"{where}[{i}] must be an object")
        if tier.get("type") not in TIER_TYPES:
            raise ValueError(
                f"{where}[{i}].type must be one of {TIER_TYPES} (the replay runs vLLM's "
                f"in-memory example tier and its fs tier), got {tier.get('type')!r}"
            )
        unknown = set(tier) - {"type"}
        if unknown:
            raise ValueError(f"{where}[{i}]: unknown fields {sorted(unknown)}")
        out.append(tier["type"])
    return tuple(out)


def extra_config(tiers: tuple[str, ...] | None, root_dir: str | None = None) -> dict[str, Any]:
    """The ``kv_connector_extra_config`` keys for tier types ``tiers`` (empty for ``None``):
    ``spec_name`` and ``secondary_tiers`` (one config per tier: ``{"type": "example"}``, or
    :func:`kvguard.lab.replay.fs_tier.tier_config` at ``root_dir`` for ``"fs"``; each fs
    tier of one engine gets its own subdirectory ``tier<i>``).

    Raises:
        ValueError: an ``"fs"`` tier without ``root_dir``.
        TieringUnsupported: ``tiers`` on a release :func:`unsupported_reason` refuses;
            the message names the field, the release and the reason.
    """
    if not tiers:
        return {}
    why = unsupported_reason()
    if why is not None:
        from kvguard.guards.hooking.instrumentor import installed_vllm_version

        raise TieringUnsupported(
            f"vLLM {installed_vllm_version() or '(none)'}: a trace cannot set geometry.{FIELD} on this "
            f"release: {why}"
        )
    configs: list[dict[str, Any]] = []
    for i, t in enumerate(tiers):
        if t == "fs":
            if root_dir is None:
                raise ValueError("an fs secondary tier needs the replay's root_dir")
            configs.append(fs_tier.tier_config(os.path.join(root_dir, f"tier{i}")))
        else:
            configs.append({"type": t})
    return {"spec_name": SPEC_NAME, FIELD: configs}


@dataclass
class TierTap:
    """The copy a real secondary tier does, on the oracle, around vLLM's tier methods.

    ``manager``: the scheduler-role connector's ``TieringOffloadingManager`` (its
    ``secondary_tiers``). ``oracle``: the worker's KV-content oracle, or ``None`` (then
    only the counters run). ``storage``: the replay's fs tier storage (needed when a tier
    is vLLM's fs tier: :class:`kvguard.lab.replay.fs_tier.FsTierDriver` drives it, the
    oracle following its bytes). Counts are in offloaded chunks (one per ``OffloadKey``).

    The copy is done *before* vLLM's method runs: at ``submit_store`` the CPU slots are
    pinned and complete (``complete_store`` cascades after the GPU->CPU store
    completed); at ``submit_load`` the slots are freshly allocated and not readable
    until the promotion completes. A promotion of a key the tap never saw cascaded (a
    chunk the tier holds without the oracle knowing its KV) clears the slot's
    fingerprint, so a GPU load from it is a wrong-KV finding, never a silent pass.
    """

    manager: Any
    oracle: KVOracle | None = None
    storage: TierStorage | None = None
    #: chunks cascaded CPU -> secondary (``submit_store`` keys), all tiers
    cascaded_chunks: int = 0
    #: chunks promoted secondary -> CPU (``submit_load`` keys), all tiers
    promoted_chunks: int = 0
    #: promoted chunks whose key this tap never saw cascaded (their slot reads as unwritten)
    promoted_unknown: int = 0
    #: fs tier: chunks whose file was already on disk at ``submit_store`` (vLLM keeps it)
    kept_chunks: int = 0
    _restore: list[tuple[Any, str]] = field(default_factory=list, repr=False)
    _drivers: list[FsTierDriver] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        for index, tier in enumerate(getattr(self.manager, "secondary_tiers", None) or ()):
            if fs_tier.persists(tier):
                if self.storage is None:
                    raise TieringUnsupported("an fs tier in the replay needs the replay's TierStorage")
                self._drivers.append(fs_tier.FsTierDriver(tier, self.oracle, self.storage, self))
            else:
                self._wrap(index, tier)

    @property
    def tiers(self) -> int:
        """Secondary tiers tapped."""
        return len({id(t) for t, _ in self._restore}) + len(self._drivers)

    def _wrap(self, index: int, tier: Any) -> None:
        store, load = tier.submit_store, tier.submit_load

        def submit_store(job: Any) -> Any:
            keys = list(job.keys)
            self.cascaded_chunks += len(keys)
            if self.oracle is not None:
                for key, slot in zip(keys, _slots(job), strict=True):
                    self.oracle.secondary_store(index, key, slot)
            return store(job)

        def submit_load(job: Any) -> Any:
            keys = list(job.keys)
            self.promoted_chunks += len(keys)
            if self.oracle is not None:
                for key, slot in zip(keys, _slots(job), strict=True):
                    if not self.oracle.secondary_load(index, key, slot):
                        self.promoted_unknown += 1
            return load(job)

        tier.submit_store = submit_store
        tier.submit_load = submit_load
        self._restore += [(tier, "submit_store"), (tier, "submit_load")]

    def restore(self) -> None:
        """Drop the wrappers (the tiers' own methods are used again)."""
        for tier, name in self._restore:
            tier.__dict__.pop(name, None)
        for driver in self._drivers:
            driver.restore()

    def close(self) -> None:
        """Shut the tiers down as vLLM does at engine shutdown (``shutdown()`` of each
        secondary tier: the fs tier joins its I/O threads). The tap is restored first."""
        self.restore()
        for tier in getattr(self.manager, "secondary_tiers", None) or ():
            tier.shutdown()

    def summary(self) -> dict[str, int]:
        """The report's ``secondary_tiers`` object (counts in offloaded chunks;
        ``kept_chunks`` only with an fs tier)."""
        out = {
            "tiers": self.tiers,
            "cascaded_chunks": self.cascaded_chunks,
            "promoted_chunks": self.promoted_chunks,
            "promoted_unknown": self.promoted_unknown,
        }
        if self._drivers:
            out["kept_chunks"] = self.kept_chunks
        return out


def carry_contents(old_manager: Any, new_manager: Any) -> int:
    """Give ``new_manager``'s secondary tiers what ``old_manager``'s tiers hold, tier by tier
    (the lab's engine restart over tiers that outlive the engine: vLLM's fs, obj and p2p
    tiers keep their chunks on disk, in a bucket or at peers; the example tier keeps them in
    the instance, so a restart carries them over by hand; an fs tier of the lab is skipped:
    its files are in the replay's directory, where the new engine's tier looks). Returns the
    chunks carried.

    Bound by the example tier's declared state, the presence dict its ``lookup`` reads
    (``chunks: dict[OffloadKey, bool]`` in ``ExampleSecondaryTierManager.__init__`` of
    0.33.0 and 0.34.0, ``blocks`` in 0.25.1 and 0.29.0). Raises
    :class:`TieringUnsupported` for a tier without one or a tier count that differs.
    """
    persists = fs_tier.persists
    old = list(getattr(old_manager, "secondary_tiers", None) or ())
    new = list(getattr(new_manager, "secondary_tiers", None) or ())
    if len(old) != len(new):
        raise TieringUnsupported(f"a restart must keep the tiers: {len(old)} before, {len(new)} after")
    carried = 0
    for before, after in zip(old, new):
        if persists(before):
            continue  # its files are on disk: the new engine's tier finds them by itself
        name = next((n for n in PRESENCE_FIELDS if isinstance(vars(before).get(n), dict)), None)
        if name is None or not isinstance(vars(after).get(name), dict):
            raise TieringUnsupported(f"{type(before).__qualname__} keeps no presence dict the lab can carry over")
        held = vars(before)[name]
        vars(after)[name].update(held)
        carried += len(held)
    return carried


#: the example tier's presence dict, by release (:func:`carry_contents`)
PRESENCE_FIELDS = ("chunks", "blocks")


def unlink_shared_region(manager: Any) -> list[str]:
    """Unlink the ``/dev/shm`` files of the CPU tier's scheduler-side shared region.

    vLLM's tiering spec maps the CPU tier through a ``SharedOffloadRegion``
    (``/dev/shm/vllm_offload_{engine_id}.mmap``) that its workers would join; vLLM unlinks
    it once every worker has mapped it, or at shutdown. The replay has no worker that
    joins, and a fuzz run builds thousands of engines, so the files are unlinked right
    after the engine is built (the mapping stays valid, as after vLLM's own unlink).
    The region is found by structure: an attribute of ``manager.primary_tier`` with a
    ``mmap_path`` (its ``_segments`` paths too). Returns the paths unlinked.
    """
    import os

    done = []
    primary = getattr(manager, "primary_tier", None)
    for region in list(vars(primary).values()) if primary is not None else ():
        path = getattr(region, "mmap_path", None)
        if not isinstance(path, str):
            continue
        paths = [path] + [seg[0] for seg in getattr(region, "_segments", ())[1:]]
        for p in paths:
            try:
                os.unlink(p)
                done.append(p)
            except FileNotFoundError:
                pass
    return done


def tiering_manager(connector_scheduler: Any) -> Any | None:
    """The connector scheduler's ``TieringOffloadingManager`` (``None`` without tiering)."""
    manager = getattr(connector_scheduler, "manager", None)
    if manager is not None and hasattr(manager, "secondary_tiers") and hasattr(manager, "primary_tier"):
        return manager
    return None
