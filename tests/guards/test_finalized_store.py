"""The store_after_finalize check's source reading and its wrapper, on stand-in managers
shaped like vLLM's ``TieringOffloadingManager`` (the real one runs in
tests/vllm/test_store_after_finalize.py)."""

from __future__ import annotations

import sys
import types

import pytest
import wrapt

from kvguard.guards import names
from kvguard.guards.checks import finalized_store
from kvguard.guards.checks.admission import counters
from kvguard.guards.policy import runtime


class Ctx:
    def __init__(self, req_id: str) -> None:
        self.req_id = req_id


class Tracking:
    """Reads its per-request state by id, unguarded (vLLM 0.25.1-0.34.0's shape)."""

    def __init__(self) -> None:
        self._req_state: dict[str, int] = {}
        self.stored: list[str] = []

    def on_new_request(self, req_context: Ctx) -> None:
        self._req_state[req_context.req_id] = 0

    def on_request_finished(self, req_context: Ctx) -> None:
        del self._req_state[req_context.req_id]

    def prepare_store(self, keys: list[int], req_context: Ctx) -> list[int] | None:
        self._req_state[req_context.req_id] += 1
        self.stored.append(req_context.req_id)
        return keys


class Aliased:
    def __init__(self) -> None:
        self._state: dict[str, int] = {}

    def prepare_store(self, keys, req_context) -> "list[int] | None":
        req_id = req_context.req_id
        return [self._state[req_id]]


class Guarded:
    """Tests membership first: a missing id cannot raise."""

    def __init__(self) -> None:
        self._req_state: dict[str, int] = {}

    def prepare_store(self, keys, req_context) -> list[int] | None:
        if req_context.req_id not in self._req_state:
            return None
        return [self._req_state[req_context.req_id]]


class NoNone:
    """Not declared to answer None: no refusal its callers expect."""

    def __init__(self) -> None:
        self._req_state: dict[str, int] = {}

    def prepare_store(self, keys, req_context) -> list[int]:
        return [self._req_state[req_context.req_id]]


def test_the_unguarded_read_by_request_id_is_found():
    assert finalized_store.tracked_reads(Tracking.prepare_store) == (("_req_state",), "req_context")
    assert finalized_store.tracked_reads(Aliased.prepare_store) == (("_state",), "req_context")


def test_a_guarded_read_a_method_without_none_and_a_non_function_bind_nothing():
    assert finalized_store.tracked_reads(Guarded.prepare_store) is None
    assert finalized_store.tracked_reads(NoNone.prepare_store) is None
    assert finalized_store.tracked_reads(len) is None
    assert finalized_store.tracked_reads(None) is None


@pytest.fixture
def manager_module():
    """A module holding the four stand-ins, as the instrumentor meets vLLM's."""
    module = types.ModuleType("kvguard_test_managers")
    for cls in (Tracking, Aliased, Guarded, NoNone):
        module.__dict__[cls.__name__] = type(cls.__name__, (cls,), {"__module__": module.__name__,
                                                                   "prepare_store": cls.prepare_store})
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def test_only_the_classes_whose_store_can_raise_are_wrapped(manager_module):
    assert sorted(finalized_store.manager_classes(manager_module)) == ["Aliased", "Tracking"]


@pytest.fixture
def wrapped_manager(manager_module):
    finalized_store.manager_classes(manager_module)
    cls = manager_module.Tracking
    original = cls.prepare_store
    cls.prepare_store = wrapt.FunctionWrapper(original, finalized_store.prepare_store_wrapper)
    previous = runtime.policy()
    counters.reset()
    yield cls()
    cls.prepare_store = original
    runtime.configure(policy=previous)
    counters.reset()


def test_a_tracked_request_is_stored_as_vllm_does(wrapped_manager):
    runtime.configure(policy=names.POLICY_GUARD)
    wrapped_manager.on_new_request(Ctx("a"))
    assert wrapped_manager.prepare_store([1, 2], Ctx("a")) == [1, 2]
    assert wrapped_manager.prepare_store([3], req_context=Ctx("a")) == [3]
    assert wrapped_manager.stored == ["a", "a"]
    snap = finalized_store.snapshot()
    assert snap["evaluated"] == 2 and snap["violations"] == 0


def test_a_store_after_finalization_is_refused_under_guard(wrapped_manager):
    runtime.configure(policy=names.POLICY_GUARD)
    wrapped_manager.on_new_request(Ctx("a"))
    wrapped_manager.on_request_finished(Ctx("a"))
    assert wrapped_manager.prepare_store([1], Ctx("a")) is None  # vLLM's "store cannot proceed"
    assert wrapped_manager.stored == []  # vLLM's method never ran: nothing allocated
    snap = finalized_store.snapshot()
    assert snap["store_dropped"] == 1 and snap["violations"] == 1


def test_observe_passes_the_call_to_vllm_and_strict_raises(wrapped_manager):
    runtime.configure(policy=names.POLICY_OBSERVE)
    with pytest.raises(KeyError):  # vLLM's own failure, as without kvguard
        wrapped_manager.prepare_store([1], Ctx("gone"))
    runtime.configure(policy=names.POLICY_STRICT)
    with pytest.raises(counters.StrictFailure, match="already finalized"):
        wrapped_manager.prepare_store([1], Ctx("gone"))
    snap = finalized_store.snapshot()
    assert snap["continued"] == 1 and snap["raised"] == 1 and snap["store_dropped"] == 0


def test_a_subclass_of_a_bound_class_is_checked_once_its_type_is_known(wrapped_manager):
    """A manager whose class only inherits the bound ``prepare_store`` (a deployment's own
    subclass) is checked by its base's reads; the MRO walk is cached per type."""
    runtime.configure(policy=names.POLICY_GUARD)
    sub = type("Sub", (type(wrapped_manager),), {})()
    sub.on_new_request(Ctx("b"))
    sub.on_request_finished(Ctx("b"))
    assert sub.prepare_store([1], Ctx("b")) is None and sub.stored == []
    assert finalized_store._BY_TYPE[type(sub)] == finalized_store._READS[type(wrapped_manager)]
    assert sub.prepare_store([2], Ctx("b")) is None  # the cached entry answers the same
    assert finalized_store.snapshot()["store_dropped"] == 2
