"""The replay's CPU tier holds exactly the trace's ``cpu_chunks`` offloaded blocks (marker vllm).

vLLM's offloading spec pads every chunk to its class's ``BLOCK_SIZE_ALIGNMENT`` before it
divides ``cpu_bytes_to_use`` into chunks; the harness sizes the bytes from the padded
chunk (``vllm_api.cpu_bytes_to_use``). The geometries below have chunks of 2048 bytes
and more (4-token GPU blocks, one or two blocks per chunk): on vLLM 0.33.0 the CPU spec's
alignment is the page size (4096 bytes), so before the padding was applied to the CPU
spec too a 2048-byte chunk got half of ``cpu_chunks`` (8 -> 4, 1 -> 0; measured on 0.33.0,
while 0.25.1, alignment 1, got 8 and 1).

Run: ``.venvs/vllm-0.33.0/bin/pytest -m vllm tests/vllm/test_cpu_capacity.py``
"""

from __future__ import annotations

import pytest

from kvguard.lab.replay import harness, vllm_api, tiering
from kvguard.lab.replay.trace import Geometry

pytestmark = pytest.mark.vllm


def _geometry(tokens_per_chunk: int, cpu_chunks: int, tiers=None) -> Geometry:
    return Geometry(tokens_per_block=4, tokens_per_chunk=tokens_per_chunk, sliding_window=64,
                    num_gpu_blocks=400, cpu_chunks=cpu_chunks, max_num_batched_tokens=128,
                    max_num_seqs=4, max_model_len=512, secondary_tiers=tiers)


@pytest.mark.parametrize("tokens_per_chunk", [4, 8])
@pytest.mark.parametrize("cpu_chunks", [1, 8])
def test_the_cpu_tier_holds_cpu_chunks(tokens_per_chunk: int, cpu_chunks: int) -> None:
    geometry = _geometry(tokens_per_chunk, cpu_chunks)
    engine = harness.build_engine(geometry)
    assert vllm_api.cpu_capacity(engine.connector_scheduler) == cpu_chunks


@pytest.mark.skipif(
    tiering.unsupported_reason() is not None, reason=f"no vLLM tiering here: {tiering.unsupported_reason()}"
)
def test_the_tiering_cpu_tier_holds_cpu_chunks() -> None:
    engine = harness.build_engine(_geometry(4, 8, ("example",)))
    assert vllm_api.cpu_capacity(engine.connector_scheduler) == 8


def test_the_alignment_is_the_spec_class_attribute() -> None:
    """Read from vLLM's class, 1 where it has none (0.21.0's CPU spec)."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    spec_cls = OffloadingSpecFactory._registry[vllm_api.CPU_SPEC_NAME]()
    assert vllm_api.chunk_alignment(vllm_api.CPU_SPEC_NAME) == getattr(spec_cls, "BLOCK_SIZE_ALIGNMENT", 1)
