"""Structural matching of the degrade classes (issue 9 items 2-3), without vLLM.

Stand-in sources shaped like vLLM's ``OffloadingConnectorScheduler`` (the request loop
of ``_build_store_jobs`` over KV cache groups; ``update_state_after_alloc`` issuing its
load with ``prepare_load``) go through kvguard's own discovery and rewriter, and run
with kvguard's injected globals under each policy.
"""

from __future__ import annotations

import ast
import sys
import textwrap

import pytest

from kvguard.guards.checks import asserts
from kvguard.guards.policy import degrade, runtime

from kvguard.guards import names
from kvguard.guards.hooking.instrumentor import _injected_globals
from kvguard.guards.hooking.rewrite import SiteSpec, extract_function_code, rewrite_function
from kvguard.guards.hooking.sites import SPECIAL_STORE_KEYS, discover

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"

STORE_SRC = textwrap.dedent(
    '''
    class Manager:
        def __init__(self):
            self.prepared, self.released = [], []

        def prepare_store(self, keys, req_context):
            self.prepared.append(list(keys))
            return list(keys)

        def complete_store(self, keys, req_context, success=True):
            self.released.append(sorted(keys))


    class OffloadingConnectorScheduler:
        def __init__(self):
            self.manager = Manager()
            self.cleaned = []

        def _cleanup(self, req_id):
            self.cleaned.append(req_id)

        def _build_store_jobs(self, requests):
            jobs = {}
            for req_id, req_status, groups in requests:
                new_keys = []
                for offload_keys, block_ids in groups:
                    offload_block_ids = block_ids[::1]
                    assert len(offload_keys) == len(offload_block_ids)
                    new_keys.extend(offload_keys)
                if not new_keys:
                    self._cleanup(req_id)
                    continue
                out = self.manager.prepare_store(new_keys, None)
                if out is None:
                    print("cannot store")
                    self._cleanup(req_id)
                    continue
                keys_to_store = set(out)
                jobs[req_id] = sorted(keys_to_store)
            return jobs
    '''
)

LATE_SRC = STORE_SRC.replace(
    "            jobs[req_id] = sorted(keys_to_store)",
    "            assert len(keys_to_store) == len(new_keys)\n            jobs[req_id] = sorted(keys_to_store)",
).replace("                assert len(offload_keys) == len(offload_block_ids)\n", "")

LOAD_SRC = textwrap.dedent(
    '''
    class Manager:
        def prepare_load(self, keys, req_context):
            return list(keys)


    class OffloadingConnectorScheduler:
        def __init__(self):
            self.manager = Manager()
            self.load_jobs = {}

        def update_state_after_alloc(self, request, num_external_tokens):
            """vLLM's docstring stays first."""
            if num_external_tokens == 0:
                return
            num_locally_computed_tokens = request.local
            assert num_locally_computed_tokens <= request.local_blocks * 16
            src = self.manager.prepare_load([request.request_id], None)
            self.load_jobs[request.request_id] = src
            assert src

        def build_connector_meta(self, scheduler_output):
            return "meta"

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            assert num_computed_tokens >= 0
            src = self.manager.prepare_load([], None)
            return 0, False


    class Scheduler:
        """Stands in for vLLM's Scheduler: what degrade binds to."""

        def __init__(self, connector):
            self.connector = connector
            self.requests = {}

        def finish_requests(self, request_ids, finished_status):
            raise NotImplementedError

        def update_from_output(self, scheduler_output, model_runner_output):
            return {}

        def schedule(self, request, num_external_tokens):
            self.connector.update_state_after_alloc(request, num_external_tokens)
    '''
)


class Req:
    def __init__(self, rid, local, local_blocks):
        self.request_id, self.local, self.local_blocks = rid, local, local_blocks


def instrument(src: str, policy: str) -> dict:
    """Discover, rewrite and exec ``src`` as the offload scheduler module; returns its namespace."""
    tree = ast.parse(src)
    found = discover(MODULE, tree)
    runtime.reset()
    asserts.register(found.sites)
    runtime.configure(policy=policy)
    namespace: dict = {"__name__": "fake_offload_scheduler"}
    exec(compile(tree, "<vllm-test>", "exec"), namespace)
    namespace.update(_injected_globals())
    by_qualname: dict[str, list] = {}
    for site in found.sites:
        by_qualname.setdefault(site.qualname, []).append(site)
    for qualname, sites in by_qualname.items():
        module, matched = rewrite_function(tree, qualname, [SiteSpec(s.site_id, s.kind, (s.fingerprint,)) for s in sites])
        code = extract_function_code(compile(module, "<vllm-test>", "exec"), qualname)
        owner, name = qualname.split(".")
        getattr(namespace[owner], name).__code__ = code
        if any(s.kind == "store_call" for s in sites):
            asserts.STORE_BUILDER_CODES.add(code)
    namespace["discovery"] = found
    return namespace


@pytest.fixture(autouse=True)
def _restore():
    previous = runtime.configure()
    yield
    runtime.configure(policy=previous["policy"])
    asserts.STORE_BUILDER_CODES.clear()
    runtime.reset()


def test_len_compare_in_the_request_loop_is_the_store_keys_site():
    found = discover(MODULE, ast.parse(STORE_SRC))
    (assert_site, skip) = sorted(found.special[SPECIAL_STORE_KEYS], key=lambda s: s.kind)
    assert (assert_site.kind, assert_site.check, assert_site.issue) == ("assert", "store_keys_consistency", "vllm#49118")
    assert skip.kind == "store_call" and skip.release_keys is False
    assert skip.fingerprint.startswith("for offload_keys, block_ids in groups:")  # the group loop
    assert found.special_missing == []


def test_len_compare_after_prepare_store_is_not_matched_and_reported_missing():
    assert LATE_SRC != STORE_SRC and "len(offload_block_ids)" not in LATE_SRC
    found = discover(MODULE, ast.parse(LATE_SRC))
    assert SPECIAL_STORE_KEYS in found.special_missing
    late = [s for s in found.sites if "len(keys_to_store)" in s.fingerprint]
    assert [s.check for s in late] == ["scheduler_assert"]  # generic: re-raised as today


REQUESTS = [
    ("a", None, [(["a0", "a1"], [5, 6])]),
    ("bad", None, [(["b0"], [7]), (["b1", "b2"], [])]),  # a key without a block id (#49118)
    ("c", None, [(["c0"], [9])]),
]


def test_guard_drops_that_requests_store_and_runs_vllms_skip_epilogue():
    ns = instrument(STORE_SRC, names.POLICY_GUARD)
    sched = ns["OffloadingConnectorScheduler"]()
    jobs = sched._build_store_jobs(REQUESTS)
    assert jobs == {"a": ["a0", "a1"], "c": ["c0"]}  # skipped to the next request
    assert sched.manager.prepared == [["a0", "a1"], ["c0"]]  # nothing prepared for "bad"
    assert sched.manager.released == []  # so nothing released (not a's keys_to_store!)
    assert sched.cleaned == ["bad"]  # the statement every vLLM skip branch runs
    assert runtime.snapshot()["store_keys_consistency"]["violations"] == 1


@pytest.mark.parametrize("policy", [names.POLICY_OBSERVE, names.POLICY_STRICT])
def test_observe_and_strict_raise_vllms_assertion(policy):
    ns = instrument(STORE_SRC, policy)
    with pytest.raises(AssertionError) as info:
        ns["OffloadingConnectorScheduler"]()._build_store_jobs(REQUESTS)
    assert type(info.value) is AssertionError  # exactly vLLM's exception, not StoreDropped
    assert runtime.snapshot()["store_keys_consistency"]["violations"] == 1


def test_request_scope_is_the_asserts_before_prepare_load():
    found = discover(MODULE, ast.parse(LOAD_SRC))
    scoped = {s.fingerprint for s in found.sites if s.request_scoped}
    assert scoped == {"num_locally_computed_tokens <= request.local_blocks * 16"}
    kinds = {s.site_id.rsplit(":", 1)[1]: s.kind for s in found.sites if s.kind == "request_scope"}
    # get_num_new_matched_tokens returns a value: not request-scoped
    assert list(kinds) == ["request_scope"] and all(
        s.qualname.endswith("update_state_after_alloc") for s in found.sites if s.kind == "request_scope"
    )


def test_request_scope_excludes_a_load_issued_in_a_loop():
    src = LOAD_SRC.replace(
        "        src = self.manager.prepare_load([request.request_id], None)\n",
        "        for _ in range(2):\n            src = self.manager.prepare_load([request.request_id], None)\n",
    )
    assert src != LOAD_SRC
    found = discover(MODULE, ast.parse(src))
    assert not any(s.request_scoped for s in found.sites)
    assert not any(s.kind == "request_scope" for s in found.sites)


def test_guard_fails_one_request_before_its_load_is_issued():
    ns = instrument(LOAD_SRC, names.POLICY_GUARD)
    cs = ns["OffloadingConnectorScheduler"]()
    sched = ns["Scheduler"](cs)
    bad, good = Req("bad", 64, 2), Req("good", 32, 2)
    sched.requests = {"bad": bad, "good": good}
    assert sched.schedule(bad, 16) is None  # returned early: no exception reached schedule()
    sched.schedule(good, 16)
    assert list(cs.load_jobs) == ["good"]  # no load job for the failed request
    assert list(degrade.failed_requests()) == ["bad"]
    assert "update_state_after_alloc" in degrade.failed_requests()["bad"]
    assert cs.update_state_after_alloc.__doc__ == "vLLM's docstring stays first."
    # the binding wrapped vLLM's own hooks on these instances
    assert getattr(sched, "_kvguard_uo_wrapped", False) and getattr(cs, "_kvguard_meta_wrapped", False)


def test_failure_not_tied_to_a_scheduler_is_reraised():
    ns = instrument(LOAD_SRC, names.POLICY_GUARD)
    cs = ns["OffloadingConnectorScheduler"]()
    with pytest.raises(AssertionError) as info:  # no Scheduler holds this request
        cs.update_state_after_alloc(Req("orphan", 64, 2), 16)
    assert type(info.value) is AssertionError
    assert degrade.failed_requests() == {}


def test_safety_net_refuses_to_compute_a_failed_request():
    ns = instrument(LOAD_SRC, names.POLICY_GUARD)
    cs = ns["OffloadingConnectorScheduler"]()
    sched = ns["Scheduler"](cs)
    bad = Req("bad", 64, 2)
    sched.requests = {"bad": bad}
    sched.schedule(bad, 16)

    class Out:
        num_scheduled_tokens = {"bad": 16}

    with pytest.raises(AssertionError, match="scheduled for compute before it was failed"):
        cs.build_connector_meta(Out())
    Out.num_scheduled_tokens = {}
    assert cs.build_connector_meta(Out()) == "meta"


@pytest.mark.parametrize("policy", [names.POLICY_OBSERVE, names.POLICY_STRICT])
def test_observe_and_strict_do_not_fail_requests(policy):
    ns = instrument(LOAD_SRC, policy)
    cs = ns["OffloadingConnectorScheduler"]()
    sched = ns["Scheduler"](cs)
    bad = Req("bad", 64, 2)
    sched.requests = {"bad": bad}
    with pytest.raises(AssertionError):
        sched.schedule(bad, 16)
    assert degrade.failed_requests() == {}


def test_new_labels_are_in_the_closed_sets():
    assert "store_keys_consistency" in names.CHECKS and "request_failed" in names.ACTIONS
    assert names.STAGE_REQUEST_FAIL in names.STAGES
    assert sys.modules["kvguard.guards.policy.degrade"] is degrade
