"""The lab's binding rules without vLLM (lab/replay/vllm_api.py; issue 20 items 2, 3).

``build_struct`` on stand-in dataclasses shaped like vLLM's structs across releases,
``gpu_side`` on both GPU-side layouts, and what counts as the lab's own failure. The same
rules on vLLM's real classes: tests/vllm/test_lab_binding.py.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest

from kvguard.lab.replay import harness, vllm_api
from kvguard.lab.replay.vllm_api import GPUSide, HarnessError, build_struct, gpu_side


@dataclasses.dataclass
class Output033:
    """Shaped like vLLM 0.33.0's ModelRunnerOutput (the fields the lab meets)."""

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]] = dataclasses.field(default_factory=list)
    logprobs: Any = None
    pooler_output: Any = None


@dataclasses.dataclass
class Output034:
    """0.34.0: ``req_id_to_index`` removed; an optional field added."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]] = dataclasses.field(default_factory=list)
    logprobs: Any = None
    pooler_output: Any = None
    new_optional: int | None = 7


@dataclasses.dataclass
class OutputRequired:
    req_ids: list[str]
    pooler_output: list[Any]
    brand_new: int


VALUES = {"req_ids": ["a", "b"], "req_id_to_index": {"a": 0, "b": 1}, "sampled_token_ids": [[1], []]}
NEUTRAL = {"logprobs": None, "pooler_output": []}


def test_a_declared_field_takes_the_labs_value():
    out = build_struct(Output033, VALUES, NEUTRAL)
    assert (out.req_ids, out.req_id_to_index, out.sampled_token_ids) == (["a", "b"], {"a": 0, "b": 1}, [[1], []])


def test_a_removed_field_is_dropped_and_an_added_optional_field_keeps_its_default():
    out = build_struct(Output034, VALUES, NEUTRAL)
    assert out.req_ids == ["a", "b"] and out.sampled_token_ids == [[1], []]
    assert not hasattr(out, "req_id_to_index")
    assert out.new_optional == 7


def test_a_neutral_value_fills_only_a_required_field():
    # pooler_output has a default in Output033: the neutral [] is not passed
    assert build_struct(Output033, VALUES, NEUTRAL).pooler_output is None
    with pytest.raises(HarnessError) as info:
        build_struct(OutputRequired, VALUES, NEUTRAL)
    assert "'brand_new'" in str(info.value) and "OutputRequired" in str(info.value)
    assert info.value.expected == "OutputRequired.brand_new with a default, or a value the lab knows"


def test_a_plain_class_is_read_by_its_signature():
    class Plain:
        def __init__(self, job_id: int, success: bool, transfer_size: int | None = None):
            self.job_id, self.success, self.transfer_size = job_id, success, transfer_size

    assert vllm_api.declared_fields(Plain) == {"job_id": False, "success": False, "transfer_size": True}
    r = build_struct(Plain, {"job_id": 3, "success": False, "unknown": 1})
    assert (r.job_id, r.success, r.transfer_size) == (3, False, None)


@dataclasses.dataclass
class BlockSpec:
    block_ids: list[int]
    group_sizes: list[int]
    block_indices: list[int]


class _Tensor:
    """A registered tensor as vLLM's CanonicalKVCacheTensor holds it (rows of one GPU block)."""

    def __init__(self, base: int, row_bytes: int, rows: int):
        self.base, self.row_bytes, self.rows = base, row_bytes, rows
        self.shape = (rows, row_bytes)

    def data_ptr(self) -> int:
        return self.base

    def stride(self, dim: int) -> int:
        return self.row_bytes

    def element_size(self) -> int:
        return 1


@dataclasses.dataclass
class _Ref:
    tensor: _Tensor


@dataclasses.dataclass
class _Caches:
    tensors: list[_Ref]


@dataclasses.dataclass
class Pointers:
    """Shaped like vLLM 0.34.0's DevicePointers: per group, per data ref, per block."""

    ptrs: list[int]
    sizes: list[int]
    group_block_counts: tuple[int, ...]
    group_data_ref_counts: tuple[int, ...]
    block_indices: tuple[int, ...]


def test_a_block_id_spec_is_read_as_is():
    side = gpu_side(BlockSpec([5, 6, 9], [2, 1], [0, 4]))
    assert side == GPUSide((2, 1), (0, 4), (5, 6, 9))


def test_device_pointers_turn_back_into_block_ids_over_the_registered_tensors():
    caches = _Caches([_Ref(_Tensor(0x10000, 4096, 100)), _Ref(_Tensor(0x90000, 4096, 100))])
    # group 0: blocks 5, 6 with two data refs (tensor 0 then tensor 1); group 1: block 9, one ref
    ptrs = [0x10000 + 5 * 4096, 0x10000 + 6 * 4096, 0x90000 + 5 * 4096, 0x90000 + 6 * 4096, 0x90000 + 9 * 4096]
    side = gpu_side(Pointers(ptrs, [4096] * 5, (2, 1), (2, 1), (0, 4)), caches)
    assert side == GPUSide((2, 1), (0, 4), (5, 6, 9))


def test_a_pointer_outside_every_registered_block_is_a_harness_error():
    caches = _Caches([_Ref(_Tensor(0x10000, 4096, 10))])
    with pytest.raises(HarnessError, match="not the start of a GPU block"):
        gpu_side(Pointers([0x10000 + 3 * 4096 + 8], [4096], (1,), (1,), (0,)), caches)
    with pytest.raises(HarnessError, match="not the start of a GPU block"):
        gpu_side(Pointers([0x10000 + 10 * 4096], [4096], (1,), (1,), (0,)), caches)
    with pytest.raises(HarnessError, match="neither block ids nor device pointers"):
        gpu_side(object(), caches)
    with pytest.raises(HarnessError, match="before any KV cache was registered"):
        gpu_side(Pointers([0x10000], [4096], (1,), (1,), (0,)), None)


def _raised(fn) -> BaseException:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError("did not raise")


def test_what_the_lab_calls_its_own_failure():
    # a HarnessError names the API it expected
    lab = harness.harness_error_of(_raised(lambda: build_struct(OutputRequired, {}, {})))
    assert lab is not None and lab["exception"].startswith("HarnessError: ")
    assert lab["expected"].startswith("OutputRequired.")
    # a call the callee's signature refuses fails in the lab's frame (vllm_api.call_bound)
    lab = harness.harness_error_of(_raised(lambda: vllm_api.call_bound(lambda *, x: x)))
    assert lab is not None and "call_bound" in lab["expected"] and "TypeError" in lab["exception"]
    # an exception raised in code outside the lab (vLLM's, the guard's, here this test's) is not
    assert harness.harness_error_of(_raised(lambda: 1 / 0)) is None
    assert all(d.endswith(os.sep) and os.path.basename(d[:-1]) == "lab" for d in harness.LAB_DIRS)


def test_the_planted_fault_is_guard_code_not_the_lab():
    # the planted fault stands in for a bug in asserts.check: its frame is kvguard's guard
    # code (a kvguard bug, exit 1), never the lab's own failure (exit 2). Measured in CI on
    # 0.33.0 (stop 24): with plant.py counted as lab the planted run exited 2.
    from kvguard.lab.fuzz import classes, plant

    assert classes.in_lab(harness.__file__) and classes.in_lab(classes.__file__)
    assert not classes.in_lab(plant.__file__)
    assert classes.Frame(plant.__file__, "planted_check", 1).in_kvguard
    assert not classes.Frame(harness.__file__, "run_replay", 1).in_kvguard
    with pytest.raises(plant.PlantedFault) as raised:
        plant.planted_check("site", True)
    assert harness.harness_error_of(raised.value) is None


def test_a_store_may_copy_the_null_block_a_load_may_not():
    # vLLM 0.34.0's store builder keeps null pages inside a chunk as placeholders (measured:
    # kvguard fuzz --guard seed 0 on 0.34.0 flagged such a store as an inconsistent spec, a
    # false kvguard bug); a load into the null block stays inconsistent
    from kvguard.lab.replay.worker import SpecRecord

    store = SpecRecord(1, "r", True, group_sizes=[2, 2], block_indices=[0, 0], block_ids=[0, 5, 6, 7])
    load = dataclasses.replace(store, is_store=False)
    assert store.problems() == []
    assert load.problems() == ["null block id 0 in a load's block_ids"]
    short = dataclasses.replace(store, block_ids=[5, 6, 7])
    assert short.problems() == ["sum(group_sizes)=4 != len(block_ids)=3"]
