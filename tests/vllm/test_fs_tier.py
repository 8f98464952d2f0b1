"""vLLM's real fs tier in the replay (marker vllm): files on disk, the oracle in the bytes.

``tests/vllm/traces/secondary-tier.jsonl`` with ``{"type": "fs"}`` and an engine restart
after the filler: r1 finds r0's chunks only in the files the first engine's fs tier wrote
(a new engine has an empty GPU prefix cache and CPU tier), so vLLM's own fs code promotes
them from disk. The expectations are computed, not written down: the fs tier must give r1
the same hit as vLLM's in-memory example tier on the same trace (both are vLLM's tiering;
only where the bytes live differs), and every negative control must be seen by the oracle
through the bytes (:mod:`kvguard.lab.replay.fs_tier`).

Run: ``.venvs/vllm-0.34.0/bin/pytest -m vllm tests/vllm/test_fs_tier.py``
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

from kvguard.lab.replay import fs_tier, harness, tiering  # noqa: E402
from kvguard.lab.replay.trace import load_trace  # noqa: E402

WHY = tiering.unsupported_reason()
needs_tiering = pytest.mark.skipif(WHY is not None, reason=f"no vLLM tiering here: {WHY}")
BASE = load_trace(str(Path(__file__).parent / "traces" / "secondary-tier.jsonl"))


def _trace(tier: str, restart: bool = True):
    geometry = dataclasses.replace(BASE.geometry, secondary_tiers=(tier,))
    return dataclasses.replace(BASE, geometry=geometry, restarts=("r1",) if restart else ())


def _fs_threads() -> list[str]:
    return [t.name for t in threading.enumerate()
            if t.name.startswith(("vllm_kv_py_fs", "vllm_offloading_lookup"))]


@pytest.fixture(autouse=True)
def _plain():
    harness.uninstall_guard()
    yield
    harness.uninstall_guard()


def _on_restart(monkeypatch: pytest.MonkeyPatch, act) -> None:
    """Run ``act(root_dir)`` on the fs tier's directory between the two engines."""
    original = harness.restart_engine

    def restart(old):
        act(old.tier_storage.root_dir)
        return original(old)

    monkeypatch.setattr(harness, "restart_engine", restart)


def _chunk_files(root: str) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.endswith(".bin")]


@needs_tiering
def test_a_restarted_engine_promotes_from_the_files_as_from_the_example_tier() -> None:
    example = harness.run_replay(_trace("example"), guard=False)
    fs = harness.run_replay(_trace("fs"), guard=False)
    for r in (example, fs):
        assert r.ok and r.restarts == 1 and r.finished == 3, r.error
    # the same scheduler-side answer: r1's hit comes from the tier in both
    assert fs.hits["r1"] == example.hits["r1"]
    assert fs.secondary_tiers["promoted_chunks"] == example.secondary_tiers["promoted_chunks"]
    if example.secondary_tiers["promoted_chunks"]:
        assert fs.hits["r1"]["external_hit_tokens"] > 0
    # ... read from real files: every promoted slot's bytes held a record the lab wrote
    assert fs.secondary_tiers["promoted_unknown"] == 0 and fs.wrong_kv_blocks == 0
    assert fs.secondary_tiers["files"] > 0
    # the replay removed its directory and vLLM's I/O threads are joined
    assert _fs_threads() == []


@needs_tiering
def test_files_another_writer_filled_are_wrong_kv_not_a_silent_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control through the bytes: between the engines every chunk file is
    overwritten with zeros (same size: vLLM reads it as a valid chunk). The promoted slots
    then hold no record, so r1's loads are wrong KV."""
    clean = harness.run_replay(_trace("fs"), guard=False)
    if not clean.secondary_tiers["promoted_chunks"]:
        pytest.skip(f"vLLM {clean.vllm_version} promotes nothing on this trace")

    def zero(root: str) -> None:
        for path in _chunk_files(root):
            size = os.path.getsize(path)
            with open(path, "r+b") as fh:
                fh.write(b"\0" * size)

    _on_restart(monkeypatch, zero)
    dirty = harness.run_replay(_trace("fs"), guard=False)
    assert dirty.hits["r1"] == clean.hits["r1"]  # vLLM cannot tell
    assert dirty.secondary_tiers["promoted_unknown"] == dirty.secondary_tiers["promoted_chunks"] > 0
    assert dirty.wrong_kv_blocks > 0 and dirty.wrong_kv_requests == {"r1"}


@needs_tiering
def test_a_lookup_follows_the_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """The files are deleted between the engines: vLLM's async lookup probes the disk, so
    r1 gets no hit from the tier and nothing is promoted (and nothing is wrong)."""
    removed: list[str] = []

    def delete(root: str) -> None:
        for path in _chunk_files(root):
            os.remove(path)
            removed.append(path)

    _on_restart(monkeypatch, delete)
    r = harness.run_replay(_trace("fs"), guard=False)
    assert removed and r.ok and r.finished == 3
    assert r.hits["r1"]["external_hit_tokens"] == 0 and r.secondary_tiers["promoted_chunks"] == 0
    assert r.wrong_kv_blocks == 0


@needs_tiering
def test_the_fs_replay_is_the_same_every_run() -> None:
    """The I/O threads and the lookup thread are made deterministic (``fs_tier``): two runs
    take the same steps and hits, without a restart too."""
    runs = [harness.run_replay(_trace("fs", restart=False), guard=False) for _ in range(2)]
    assert runs[0].steps == runs[1].steps and runs[0].hits == runs[1].hits
    assert runs[0].secondary_tiers == runs[1].secondary_tiers


@needs_tiering
def test_an_engine_built_by_hand_owns_its_directory_until_closed() -> None:
    trace = _trace("fs", restart=False)
    engine = harness.build_engine(trace.geometry, trace.worker)
    root = engine.tier_storage.root_dir
    assert engine.owns_tier_storage and os.path.isdir(root) and _fs_threads() != []
    harness.close_engine(engine)
    harness.close_engine(engine)  # idempotent
    assert not os.path.exists(root) and _fs_threads() == []


def test_an_fs_tier_needs_a_directory() -> None:
    if WHY is not None:
        pytest.skip(f"no vLLM tiering here: {WHY}")
    with pytest.raises(ValueError, match="root_dir"):
        tiering.extra_config(("fs",))
    cfg = tiering.extra_config(("example", "fs"), "/r")
    assert cfg["secondary_tiers"][0] == {"type": "example"}
    assert cfg["secondary_tiers"][1]["root_dir"] == os.path.join("/r", "tier1")
    assert cfg["secondary_tiers"][1]["n_read_threads"] == fs_tier.IO_THREADS


@needs_tiering
def test_a_job_the_guard_empties_finishes_without_reaching_vllms_fs_tier() -> None:
    """vLLM's own fs tier (0.25.1's and 0.26.0's enqueue one task per key, so a job of no
    key never finishes there): ``tier_publish`` keeps a job whose every key is partial
    from the tier and reports it finished on the tier's next poll, with the result class
    of the release; the tier writes no file and its ``drain_jobs()`` returns."""
    import dataclasses as dc

    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering import base

    from kvguard.guards import names
    from kvguard.guards.checks import copy_ledger, tier_publish
    from kvguard.guards.policy import runtime

    trace = _trace("fs", restart=False)
    engine = harness.build_engine(trace.geometry, trace.worker)
    previous = runtime.configure(policy=names.POLICY_GUARD)
    try:
        tier = engine.tier_tap.manager.secondary_tiers[0]
        key = b"\x01" * 32
        ledger = copy_ledger.CopyLedger(1)
        ledger.record(0, [key], [0b10], 0b11)  # written partly
        tier_publish._wrap_tier(0, tier, ledger)
        job_cls = getattr(base, "TransferJob", None) or base.JobMetadata
        slots = "chunk_ids" if "chunk_ids" in {f.name for f in dc.fields(job_cls)} else "block_ids"
        job = job_cls(job_id=41, keys=[key], is_promotion=False, req_context=ReqContext(req_id="r"),
                      **{slots: [0]})
        tier.submit_store(job)
        assert engine.tier_storage.files() == 0  # no file written for the partial chunk
        results = list(tier.get_finished_jobs())
        waiter = threading.Thread(target=tier.drain_jobs, daemon=True)
        waiter.start()
        waiter.join(10)
        assert not waiter.is_alive()  # nothing was left in the tier's pool
    finally:
        runtime.configure(policy=previous["policy"])
        harness.close_engine(engine)
    assert [(r.job_id, r.success, type(r)) for r in results] == [(41, True, base.JobResult)]
