"""vLLM's file-system tier in the replay: real files, deterministic completions, and a KV
oracle that follows the bytes.

A trace's ``geometry.secondary_tiers: [{"type": "fs"}]`` makes vLLM build its own
``FileSystemTierManager`` (``vllm/v1/kv_offload/tiering/fs/manager.py``, in every release
with tiering: 0.25.1 onwards, listed from the installed code) over a temporary directory the
lab owns (:class:`TierStorage`). vLLM's code runs unchanged: its file mapper names the
files, its I/O functions write them (temp file, ``os.replace``) and read them back, its
store rule keeps a file that is already on disk (``_store_block``/``store_block`` returns
when ``os.path.exists(dest_path)``), its async lookup probes the disk. Three things are the
lab's, each at the boundary where the real system has hardware or time:

- **Bytes.** The simulated worker copies no KV into the CPU tier's memory; the KV oracle
  keeps fingerprints per CPU slot. Right before vLLM's ``submit_store`` reads a CPU slot,
  :class:`FsTierDriver` writes into that slot's bytes a *record*: :data:`RECORD_MAGIC` and
  a 16-byte digest of the slot's fingerprints (the digest's content is kept in
  :attr:`TierStorage.contents`). vLLM's fs tier then copies those bytes to disk, or does
  not (its no-overwrite rule), and copies the file back into a CPU slot on a promotion.
  When vLLM reports the promotion finished, the driver reads the record from the slot's
  bytes and gives the oracle the fingerprints it names: the oracle holds what the file on
  disk held, whatever rule decided what was written. A slot whose bytes hold no record
  (a file the lab never saw written) reads as never written: a GPU load from it is a
  wrong-KV finding, never a silent pass.
- **Completions.** vLLM's ``DualQueueThreadPool`` runs the I/O on its threads; the driver
  waits for them (``drain_jobs``, the tier's own method) right after each submit, so every
  job is finished by the next ``get_finished_jobs`` poll, as the example tier's jobs are.
- **Lookups.** vLLM's ``AsyncLookupManager`` probes the disk on a background thread that
  the scheduler never waits for. The driver stops that thread when the tier is built and,
  after each ``flush`` (``on_schedule_end``), runs the manager's own ``_worker`` body on
  the scheduler's thread until a stop sentinel: a key looked up in step k is answered
  "retry" in step k and from the disk in step k + 1 (the fastest the real thread can
  answer), the same in every run.

Restarts: the files outlive the engine; a restarted engine's fs tier is built over the
same directory and finds them (:func:`persists`), so nothing is carried by hand.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from kvguard.lab.replay.kv_oracle import KVOracle

#: first bytes of a record the lab writes into a CPU slot (8 bytes)
RECORD_MAGIC = b"kvguard\x01"
#: bytes of the digest after the magic
DIGEST_BYTES = 16
#: bytes of a whole record (a chunk's bytes are 4096 or more: ``vllm_api.chunk_alignment``)
RECORD_BYTES = len(RECORD_MAGIC) + DIGEST_BYTES
#: I/O threads per direction of each lab fs tier (vLLM's default is 16; the driver waits
#: for every job anyway, and a fuzz run builds thousands of engines)
IO_THREADS = 1


@dataclass
class TierStorage:
    """What outlives an engine in the lab's fs tier: the root directory its files live in
    and the content each record's digest names. One per replay: every engine of the replay
    (each restart) uses the same. :meth:`close` removes the directory.
    """

    root_dir: str
    #: record digest -> per slot group, the fingerprints it names (``None``: never written)
    contents: dict[bytes, list[np.ndarray | None]] = field(default_factory=dict, repr=False)

    @classmethod
    def create(cls) -> TierStorage:
        """A new, empty directory under the system's temporary directory (``TMPDIR``)."""
        return cls(root_dir=tempfile.mkdtemp(prefix="kvguard-fs-tier-"))

    def files(self) -> int:
        """Chunk files on disk (``*.bin``; vLLM's config file and temp files not counted)."""
        return sum(1 for _, _, names in os.walk(self.root_dir) for n in names if n.endswith(".bin"))

    def close(self) -> None:
        """Remove the directory and everything in it."""
        shutil.rmtree(self.root_dir, ignore_errors=True)


def tier_config(root_dir: str) -> dict[str, Any]:
    """vLLM's tier config for an fs tier at ``root_dir`` (``FileSystemTierManager`` keyword
    arguments: ``root_dir``, ``n_read_threads``, ``n_write_threads``)."""
    return {"type": "fs", "root_dir": root_dir, "n_read_threads": IO_THREADS, "n_write_threads": IO_THREADS}


def persists(tier: Any) -> bool:
    """Whether ``tier`` keeps its chunks outside the engine (vLLM's fs tier: files named by
    its ``file_mapper``), so a restarted engine over the same root finds them by itself."""
    return getattr(tier, "file_mapper", None) is not None and hasattr(tier, "drain_jobs")


def job_slots(job: Any) -> list[int]:
    """CPU slot ids of a tier job, in key order (``chunk_ids`` 0.33 onwards, ``block_ids``
    0.25 and 0.29: the tier job dataclass's declared field)."""
    ids = getattr(job, "chunk_ids", None)
    if ids is None:
        ids = job.block_ids
    return [int(x) for x in ids]


def _digest(snap: list[np.ndarray | None]) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for arr in snap:
        if arr is None:
            h.update(b"\x00")
        else:
            h.update(b"\x01" + repr(arr.shape).encode() + arr.tobytes())
    return h.digest()


def _lookup_manager(tier: Any) -> Any:
    """The tier's ``AsyncLookupManager`` (found by class among its attributes), or None."""
    from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager

    return next((v for v in vars(tier).values() if isinstance(v, AsyncLookupManager)), None)


class FsTierDriver:
    """Makes one of vLLM's fs tier instances deterministic and keeps the oracle in its bytes
    (module docstring). Every wrapper is an instance attribute: vLLM's methods run
    unchanged inside them, and :meth:`restore` drops them.

    ``tap`` is the :class:`kvguard.lab.replay.tiering.TierTap` whose counters the driver
    shares with the example tiers' (in offloaded chunks);
    ``kept_chunks`` counts chunks whose file was already on disk when vLLM's fs tier was
    asked to store them (its no-overwrite rule keeps the older copy).

    Raises:
        RuntimeError: the tier has no primary view, no lookup manager with the
            ``_worker``/``_lookup_queue``/``_thread`` fields its async lookup declares, or
            a chunk smaller than a record.
    """

    def __init__(self, tier: Any, oracle: KVOracle | None, storage: TierStorage, tap: Any):
        self.tier = tier
        self.oracle = oracle
        self.storage = storage
        self.tap = tap
        view = getattr(tier, "_primary_kv_view", None)
        if view is None or view.strides is None:
            raise RuntimeError(f"{type(tier).__qualname__} has no _primary_kv_view the lab can write records into")
        self._bytes = view.cast("B")
        self._chunk_bytes = int(view.strides[0])
        if self._chunk_bytes < RECORD_BYTES:
            raise RuntimeError(f"a chunk of {self._chunk_bytes} bytes cannot hold a {RECORD_BYTES}-byte record")
        self._loads: dict[Any, tuple[list[Any], list[int]]] = {}
        self._lookups = _lookup_manager(tier)
        if self._lookups is None or not all(hasattr(self._lookups, n) for n in ("_worker", "_lookup_queue", "_thread")):
            raise RuntimeError(f"{type(tier).__qualname__}: no AsyncLookupManager the lab can run in step")
        self._names: list[tuple[Any, str]] = []
        self._stop_lookup_thread()
        self._wrap()

    # -- determinism -------------------------------------------------------------------

    def _stop_lookup_thread(self) -> None:
        lm = self._lookups
        lm._lookup_queue.put(None)  # vLLM's own stop sentinel (its shutdown() sends it too)
        lm._thread.join(timeout=10)
        if lm._thread.is_alive():
            raise RuntimeError("the fs tier's lookup thread did not stop")

    def _lookup_flush(self, flush: Any) -> Any:
        lm = self._lookups

        def run_flush(*args: Any, **kwargs: Any) -> Any:
            out = flush(*args, **kwargs)
            lm._lookup_queue.put(None)
            lm._worker()  # vLLM's worker body, here, until the sentinel
            return out

        return run_flush

    # -- bytes -------------------------------------------------------------------------

    def _write_record(self, slot: int) -> None:
        if self.oracle is None:
            return
        snap = self.oracle.cpu_slot(slot)
        digest = _digest(snap)
        self.storage.contents.setdefault(digest, snap)
        at = slot * self._chunk_bytes
        self._bytes[at : at + RECORD_BYTES] = RECORD_MAGIC + digest

    def read_record(self, slot: int) -> list[np.ndarray | None] | None:
        """The fingerprints the record in CPU slot ``slot``'s bytes names; ``None`` when the
        bytes hold no record the lab wrote."""
        at = slot * self._chunk_bytes
        raw = bytes(self._bytes[at : at + RECORD_BYTES])
        if not raw.startswith(RECORD_MAGIC):
            return None
        return self.storage.contents.get(raw[len(RECORD_MAGIC) :])

    # -- wrappers ----------------------------------------------------------------------

    def _wrap(self) -> None:
        tier, tap = self.tier, self.tap
        store, load, finished = tier.submit_store, tier.submit_load, tier.get_finished_jobs

        def submit_store(job: Any) -> Any:
            keys, slots = list(job.keys), job_slots(job)
            tap.cascaded_chunks += len(keys)
            for key, slot in zip(keys, slots, strict=True):
                if os.path.exists(tier.file_mapper.get_file_name(key)):
                    tap.kept_chunks += 1
                self._write_record(slot)
            out = store(job)
            tier.drain_jobs()
            return out

        def submit_load(job: Any) -> Any:
            keys, slots = list(job.keys), job_slots(job)
            tap.promoted_chunks += len(keys)
            self._loads[job.job_id] = (keys, slots)
            out = load(job)
            tier.drain_jobs()
            return out

        def get_finished_jobs(*args: Any, **kwargs: Any) -> Any:
            results = list(finished(*args, **kwargs))
            for r in results:
                job = self._loads.pop(r.job_id, None)
                if job is None or self.oracle is None:
                    continue
                ok = None if r.success else set(getattr(r, "successful_keys", None) or ())
                for key, slot in zip(*job):
                    if ok is not None and key not in ok:
                        continue  # vLLM frees the slot of a failed key
                    snap = self.read_record(slot)
                    if snap is None:
                        tap.promoted_unknown += 1
                    self.oracle.fill_cpu_slot(slot, snap)
            return results

        tier.submit_store = submit_store
        tier.submit_load = submit_load
        tier.get_finished_jobs = get_finished_jobs
        self._lookups.flush = self._lookup_flush(self._lookups.flush)
        self._names = [(tier, "submit_store"), (tier, "submit_load"), (tier, "get_finished_jobs"),
                       (self._lookups, "flush")]

    def restore(self) -> None:
        """Drop the wrappers."""
        for obj, name in self._names:
            obj.__dict__.pop(name, None)
        self._names = []

    def shutdown(self) -> None:
        """vLLM's own ``shutdown`` of the tier (its I/O threads are joined; the lookup
        thread was stopped when the driver was built)."""
        self.restore()
        self.tier.shutdown()
