"""The scope rule by role (issue 20 item 6): crafted source trees, no vLLM.

A module is worker-side by import when at least one module of the offload packages
imports it and every such importer is worker-side; nobody importing it keeps it in scope
(vLLM's spec factory loads spec modules by dotted-name strings). The same two functions
(:func:`kvguard.guards.hooking.sites.worker_side_modules`, :func:`kvguard.guards.hooking.sites.in_scope`)
decide for the live install (the import hook) and the source-only release matrix.
"""

from __future__ import annotations

import ast

import pytest

from kvguard.guards.hooking import sites
from kvguard.guards.hooking.instrumentor import OffloadGuardInstrumentor, _Scope
from kvguard.lab.release_matrix import release_row
from kvguard.guards.settings import GuardSettings
from kvguard.guards.hooking.sites import (
    CONNECTOR_MODULE,
    imported_modules,
    in_scope,
    worker_by_name,
    worker_side_modules,
)

import fakevllm

KV = "vllm.v1.kv_offload"
OFF = "vllm.distributed.kv_transfer.kv_connector.v1.offloading"
SCHEDULER = f"{OFF}.scheduler"

#: A crafted release: the scheduler, three workers (by name) and helpers of every role.
TREE = {
    f"{KV}.base": "class GPULoadStoreSpec:\n    pass\n",
    # imported by the three workers only (as 0.34.0's pointer_utils): out
    f"{KV}.pointer_utils": (
        f"from {KV}.base import GPULoadStoreSpec\n"
        f"from {KV}.deep_helper import shift\n\n"
        "def resolve(spec, n):\n    assert n >= 0\n    return shift(n)\n"
    ),
    # imported only by pointer_utils, itself worker-side: out (transitively)
    f"{KV}.deep_helper": "def shift(n):\n    assert n < 10**9\n    return n\n",
    # imported by a worker and by the scheduler: in
    f"{KV}.shared": "def both(n):\n    assert n != 3\n    return n\n",
    # imported by nobody (loaded by a dotted-name string, as the spec factory does): in
    f"{KV}.cpu.spec": "class CPUOffloadingSpec:\n    def get_manager(self, n):\n        assert n\n        return n\n",
    # imported by a worker and, inside a function, by the connector module: in
    f"{KV}.connector_helper": "def h(n):\n    assert n\n    return n\n",
    # a cycle between two helpers that only a worker otherwise imports: in (least fixed point)
    f"{KV}.cycle_a": f"from {KV} import cycle_b\n\ndef a(n):\n    assert n\n",
    f"{KV}.cycle_b": f"from {KV} import cycle_a\n\ndef b(n):\n    assert n\n",
    f"{KV}.cpu": "",
    f"{KV}": "",
    f"{KV}.fs": "",
    f"{OFF}": "",
    SCHEDULER: (
        f"from {KV}.base import GPULoadStoreSpec\n"
        f"from {KV}.shared import both\n\n"
        "def get_sliding_window_size_in_chunks(spec, offloaded_block_size):\n"
        "    return cdiv(spec.sliding_window, offloaded_block_size)\n\n"
        "class OffloadingConnectorScheduler:\n"
        "    def update_state_after_alloc(self, pending_blocks, group_config):\n"
        "        assert pending_blocks <= group_config.sliding_window_size_in_chunks * self.config.blocks_per_chunk + 1\n"
        "        return both(pending_blocks)\n"
    ),
    f"{OFF}.worker": (
        f"from {KV}.pointer_utils import resolve\n"
        f"from {KV}.shared import both\n"
        f"import {KV}.connector_helper\n"
        f"from {KV} import cycle_a\n\n"
        "def w(n):\n    assert n\n"
    ),
    f"{KV}.cpu.gpu_worker": f"from {KV}.pointer_utils import resolve\n\ndef copy(n):\n    assert n\n",
    # a relative import: `from ..pointer_utils import resolve` inside vllm.v1.kv_offload.fs.worker
    f"{KV}.fs.worker": "from ..pointer_utils import resolve\n\ndef io(n):\n    assert n\n",
    CONNECTOR_MODULE: (
        "class OffloadingConnector:\n"
        f"    def h(self):\n        from {KV}.connector_helper import h\n        return h(1)\n"
    ),
    # outside the offload packages: its imports are not counted
    "vllm.v1.hisparse.runtime": f"from {KV}.deep_helper import shift\n",
}


def worker_side() -> frozenset[str]:
    return worker_side_modules(TREE)


def test_a_helper_only_workers_import_goes_out():
    assert f"{KV}.pointer_utils" in worker_side()
    assert not in_scope(f"{KV}.pointer_utils", worker_side())
    assert in_scope(f"{KV}.pointer_utils")  # the by-name part alone keeps it (the old rule)


def test_transitively():
    assert f"{KV}.deep_helper" in worker_side()  # its only offload importer is pointer_utils


def test_a_helper_a_worker_and_the_scheduler_import_stays_in():
    assert f"{KV}.shared" not in worker_side() and in_scope(f"{KV}.shared", worker_side())


def test_a_module_nobody_imports_stays_in():
    assert in_scope(f"{KV}.cpu.spec", worker_side())
    assert in_scope(SCHEDULER, worker_side())


def test_an_import_by_the_connector_module_keeps_a_helper_in():
    assert in_scope(f"{KV}.connector_helper", worker_side())
    assert in_scope(CONNECTOR_MODULE, worker_side())


def test_a_cycle_stays_in():
    ws = worker_side()
    assert f"{KV}.cycle_a" not in ws and f"{KV}.cycle_b" not in ws


def test_the_by_name_workers_are_in_the_set_and_out_of_scope():
    ws = worker_side()
    for name in (f"{OFF}.worker", f"{KV}.cpu.gpu_worker", f"{KV}.fs.worker"):
        assert name in ws and worker_by_name(name) and not in_scope(name, ws)


def test_the_whole_set():
    """Exactly the three named workers and the two helpers only they reach."""
    assert worker_side() == {
        f"{OFF}.worker", f"{KV}.cpu.gpu_worker", f"{KV}.fs.worker",
        f"{KV}.pointer_utils", f"{KV}.deep_helper",
    }


def test_without_the_workers_sources_nothing_goes_out_by_import():
    """The importers decide: a helper whose worker importers are not in the sources has no
    importer, and a module nobody imports stays in."""
    partial = {k: v for k, v in TREE.items() if not worker_by_name(k)}
    assert worker_side_modules(partial) == frozenset()


def test_imported_modules_resolves_relative_and_submodule_imports():
    known = set(TREE)
    tree = ast.parse(TREE[f"{KV}.fs.worker"])
    assert imported_modules(f"{KV}.fs.worker", tree, known) == {f"{KV}.pointer_utils"}
    # `from vllm.v1.kv_offload import cycle_b` names the submodule, not the package
    assert imported_modules(f"{KV}.cycle_a", ast.parse(TREE[f"{KV}.cycle_a"]), known) == {f"{KV}.cycle_b"}
    # inside a package's __init__, `.` is the package itself
    init = ast.parse("from .pointer_utils import resolve\nfrom . import shared\n")
    assert imported_modules(KV, init, known, is_package=True) == {f"{KV}.pointer_utils", f"{KV}.shared"}
    # `from pkg import name` where name is not a module: the package
    assert imported_modules(SCHEDULER, ast.parse(f"from {KV} import SOMETHING\n"), known) == {KV}


def test_an_unparsable_source_contributes_no_imports():
    tree = dict(TREE)
    tree[f"{KV}.cpu.gpu_worker"] = "def copy(:\n"
    tree[f"{KV}.fs.worker"] = "def io(:\n"
    # offloading.worker still imports pointer_utils, and only workers do
    assert f"{KV}.pointer_utils" in worker_side_modules(tree)
    tree[f"{OFF}.worker"] = "def w(:\n"
    assert f"{KV}.pointer_utils" not in worker_side_modules(tree)


def test_the_release_matrix_applies_the_same_rule():
    """The source-only matrix counts the asserts of the in-scope modules only: the
    worker-side helpers' asserts leave it, the rest are all rewritten."""
    row = release_row("crafted", dict(TREE))
    assert row.worker_side_by_import == [f"{KV}.deep_helper", f"{KV}.pointer_utils"]
    in_scope_modules = {m for m in TREE if in_scope(m, worker_side())}
    expected = sum(
        sites.discover(m, ast.parse(TREE[m]), worker_side()).in_scope_asserts for m in in_scope_modules
    )
    # shared, cpu.spec, connector_helper, cycle_a, cycle_b, scheduler: one assert each
    assert expected == 6
    assert (row.in_scope, row.rewritten) == (expected, expected)
    assert (row.window_bound, row.special_missing) == (4096 // 256 * 8 + 1, [])
    assert set(row.modules) == {
        f"{KV}.shared", f"{KV}.cpu.spec", f"{KV}.connector_helper", f"{KV}.cycle_a", f"{KV}.cycle_b", SCHEDULER,
    }


def test_discover_returns_nothing_for_a_worker_side_module():
    tree = ast.parse(TREE[f"{KV}.pointer_utils"])
    assert sites.discover(f"{KV}.pointer_utils", tree).in_scope_asserts == 1
    assert sites.discover(f"{KV}.pointer_utils", tree, worker_side()).in_scope_asserts == 0


class TestLiveInstall:
    """The import hook asks the same rule, with the role set read from the installed files."""

    def plant(self, root):
        kv = root / "vllm/v1/kv_offload"
        (kv / "cpu").mkdir()
        (kv / "cpu/__init__.py").write_text("")
        (kv / "pointer_utils.py").write_text("def resolve(n):\n    assert n >= 0\n    return n\n")
        (kv / "cpu/gpu_worker.py").write_text(
            "from vllm.v1.kv_offload.pointer_utils import resolve\n\ndef copy(n):\n    assert n > 0\n    return resolve(n)\n"
        )
        (kv / "spec_by_string.py").write_text("def make(n):\n    assert n\n    return n\n")

    def test_a_worker_only_helper_is_not_instrumented(self, tmp_path, metrics):
        with fakevllm.fake_vllm(tmp_path) as root:
            self.plant(root)
            inst = OffloadGuardInstrumentor()
            inst.install(GuardSettings(), metrics=metrics)
            from vllm.v1.kv_offload import pointer_utils, spec_by_string
            from vllm.v1.kv_offload.cpu import gpu_worker

            assert "@kvguard_check" not in vars(pointer_utils) and "@kvguard_check" not in vars(gpu_worker)
            assert "@kvguard_check" in vars(spec_by_string)  # nobody imports it: in scope
            status = inst.site_status()
            assert not [s for s in status if s.startswith(("kv_offload.pointer_utils:", "kv_offload.cpu.gpu_worker:"))]
            assert [s for s in status if s.startswith("kv_offload.spec_by_string:make:")]
            assert inst.report()["worker_side_by_import"] == ["vllm.v1.kv_offload.pointer_utils"]
            with pytest.raises(AssertionError):
                pointer_utils.resolve(-1)  # vLLM's own assert, untouched

    def test_the_role_set_is_read_once_and_only_for_a_candidate(self):
        calls = []

        def read():
            calls.append(1)
            return dict(TREE)

        scope = _Scope(read)
        assert not scope("vllm.v1.core.sched.scheduler") and not scope(f"{KV}.cpu.gpu_worker")
        assert calls == []  # string work only: not a candidate by name
        assert not scope(f"{KV}.pointer_utils") and scope(f"{KV}.shared") and scope(f"{KV}.cpu.spec")
        assert calls == [1]

    def test_unreadable_sources_fall_back_to_the_by_name_rule(self):
        from kvguard.guards.policy import runtime

        def read():
            raise OSError("no files")

        scope = _Scope(read)
        assert scope(f"{KV}.pointer_utils")  # in: the pre-issue-20 scope, never less
        assert not scope(f"{KV}.cpu.gpu_worker")
        assert runtime.guard_errors() == {"install": 1}


def test_imports_are_found_at_any_depth():
    """Inside functions, classes, if/try/except/finally/with/for/while/match: every one."""
    src = (
        "import vllm.v1.kv_offload.m0\n"
        "if TYPE_CHECKING:\n    from vllm.v1.kv_offload import m1\nelse:\n    import vllm.v1.kv_offload.m2\n"
        "try:\n    import vllm.v1.kv_offload.m3\nexcept ImportError:\n    import vllm.v1.kv_offload.m4\n"
        "finally:\n    import vllm.v1.kv_offload.m5\n"
        "class C:\n    def f(self):\n        with x:\n            for i in y:\n                while z:\n"
        "                    import vllm.v1.kv_offload.m6\n"
        "match q:\n    case 1:\n        import vllm.v1.kv_offload.m7\n"
        "x = [__import__('vllm.v1.kv_offload.m8')]\n"  # a call, not a static import
    )
    known = {f"{KV}.m{i}" for i in range(9)}
    assert imported_modules(f"{KV}.other", ast.parse(src), known) == {f"{KV}.m{i}" for i in range(8)}


# -- the SimpleCPUOffloadConnector (VLLM_USE_SIMPLE_KV_OFFLOAD=1): the same rule ----------
SIMPLE = "vllm.v1.simple_kv_offload"

#: a crafted simple connector: both roles in one class (the worker object bound in the
#: ``KVConnectorRole.WORKER`` branch), its manager, its worker and a copy helper only the worker imports
SIMPLE_TREE = {
    SIMPLE: "",
    sites.SIMPLE_CONNECTOR_MODULE: (
        f"from {SIMPLE}.manager import SimpleCPUOffloadScheduler\n"
        f"from {SIMPLE}.worker import SimpleCPUOffloadWorker\n\n"
        "class SimpleCPUOffloadConnector:\n"
        "    def __init__(self, role, config):\n"
        "        self.scheduler_manager = None\n"
        "        self.worker_handler = None\n"
        "        if role == KVConnectorRole.SCHEDULER:\n"
        "            assert config is not None\n"
        "            self.scheduler_manager = SimpleCPUOffloadScheduler(config)\n"
        "        elif role == KVConnectorRole.WORKER:\n"
        "            self.worker_handler = SimpleCPUOffloadWorker(config)\n"
        "    def bind_connector_metadata(self, meta):\n"
        "        if self.worker_handler is not None:\n"
        "            assert meta is not None\n"
        "            self.worker_handler.bind(meta)\n"
        "    def update_state_after_alloc(self, request, blocks, n):\n"
        "        if self.scheduler_manager is not None:\n"
        "            self.scheduler_manager.update_state_after_alloc(request, blocks, n)\n"
    ),
    f"{SIMPLE}.manager": (
        "class SimpleCPUOffloadScheduler:\n"
        "    def update_state_after_alloc(self, request, blocks, num_external_tokens):\n"
        "        self._reqs_to_store[request.request_id] = object()\n"
        "        hit = self.coordinator.find_longest_cache_hit(request.block_hashes, num_external_tokens)\n"
        "        assert hit == num_external_tokens, 'Expected hit tokens'\n"
        "        self.cpu_block_pool.touch(blocks)\n"
        "        assert self._reqs_to_load.get(request.request_id) is None\n"
        "        self._reqs_to_load[request.request_id] = blocks\n"
    ),
    f"{SIMPLE}.worker": f"from {SIMPLE}.copy_backend import copy\n\ndef w(n):\n    assert n\n",
    f"{SIMPLE}.copy_backend": "def copy(n):\n    assert n > 0\n",
}


def test_the_simple_connectors_scheduler_side_is_in_scope_and_its_worker_side_out():
    ws = worker_side_modules(SIMPLE_TREE)
    assert ws == {f"{SIMPLE}.worker", f"{SIMPLE}.copy_backend"}  # by name, then by import
    assert in_scope(sites.SIMPLE_CONNECTOR_MODULE, ws) and in_scope(f"{SIMPLE}.manager", ws)
    assert sites.connector_of(f"{SIMPLE}.manager") == sites.CONNECTOR_SIMPLE
    assert sites.connector_of(sites.SIMPLE_CONNECTOR_MODULE) == sites.CONNECTOR_SIMPLE
    assert sites.connector_of(SCHEDULER) == sites.connector_of(CONNECTOR_MODULE) == sites.CONNECTOR_OFFLOADING


def test_the_simple_connectors_worker_role_is_read_off_its_constructor():
    tree = ast.parse(SIMPLE_TREE[sites.SIMPLE_CONNECTOR_MODULE])
    assert sites.worker_attributes(tree) == {"worker_handler"}
    found = sites.discover(sites.SIMPLE_CONNECTOR_MODULE, tree, worker_side_modules(SIMPLE_TREE))
    # the constructor's assert (scheduler branch) is a site; bind_connector_metadata's is not
    assert [s.qualname for s in found.sites] == ["SimpleCPUOffloadConnector.__init__"]


def _scoped(source: str) -> dict[str, tuple[str, ...] | None]:
    """assert text -> its release calls when request-scoped, None when not."""
    found = sites.discover(f"{SIMPLE}.manager", ast.parse(source))
    return {s.fingerprint: (s.releases if s.request_scoped else None) for s in found.sites if s.kind == "assert"}


def test_a_touch_the_method_can_give_back_keeps_the_scope_with_its_release():
    """The hit-length assert (vllm#39702) runs before ``touch``: request-scoped, nothing to
    give back; the assert after the touch is request-scoped with ``free_blocks`` of the
    touched blocks (``BlockPool.touch``'s inverse, on the same pool and argument)."""
    found = sites.discover(f"{SIMPLE}.manager", ast.parse(SIMPLE_TREE[f"{SIMPLE}.manager"]))
    assert _scoped(SIMPLE_TREE[f"{SIMPLE}.manager"]) == {
        "hit == num_external_tokens": (),
        "self._reqs_to_load.get(request.request_id) is None": ("self.cpu_block_pool.free_blocks(blocks)",),
    }
    assert [s.site_id.rsplit(":", 1)[-1] for s in found.sites if s.kind == sites.KIND_REQUEST_SCOPE] == ["request_scope"]


def test_a_hold_with_no_inverse_or_inside_a_branch_ends_the_scope():
    base = SIMPLE_TREE[f"{SIMPLE}.manager"]
    no_inverse = base.replace("self.cpu_block_pool.touch(blocks)", "self.manager.prepare_load(blocks)")
    assert _scoped(no_inverse)["self._reqs_to_load.get(request.request_id) is None"] is None
    branch = base.replace("        self.cpu_block_pool.touch(blocks)\n",
                          "        if blocks:\n            self.cpu_block_pool.touch(blocks)\n")
    assert _scoped(branch)["self._reqs_to_load.get(request.request_id) is None"] is None
    given_back = base.replace("        self.cpu_block_pool.touch(blocks)\n",
                              "        self.cpu_block_pool.touch(blocks)\n"
                              "        self.cpu_block_pool.free_blocks(reversed(blocks))\n"
                              "        self.gpu_pool.touch(blocks)\n")
    # vLLM 0.34.0's LRU refresh (touch then free_blocks) holds nothing; the next touch does
    assert _scoped(given_back)["self._reqs_to_load.get(request.request_id) is None"] == (
        "self.gpu_pool.free_blocks(blocks)",)


def _with_pop(release: str = "", read_after: bool = True) -> str:
    source = SIMPLE_TREE[f"{SIMPLE}.manager"].replace(
        "        hit = self.coordinator",
        "        pending = self._pending_cpu_hits.pop(request.request_id, None)\n"
        "        if num_external_tokens == 0:\n"
        "            if pending is not None:\n"
        "                self._free_pending_cpu_hit(pending)\n"
        "            return\n"
        "        hit = self.coordinator",
    )
    tail = ("        self._free_pending_cpu_hit(pending)\n" if release else "") + \
           ("        self.use(pending)\n" if read_after else "")
    return source.replace("        self.cpu_block_pool.touch(blocks)\n", "        self.cpu_block_pool.touch(blocks)\n" + tail)


def test_a_pin_popped_off_the_schedulers_state_is_given_back_by_the_methods_own_release():
    """Since vllm#42289 the lookup pins the hit and this method pops the pin before its
    asserts: an assert after the pop is request-scoped with the method's own release of the
    pin (``self._free_pending_cpu_hit(pending)``) until the method calls it itself; its call
    in the branch that returns early is that branch's own."""
    got = _scoped(_with_pop(release="yes"))
    assert got == {
        "hit == num_external_tokens": ("self._free_pending_cpu_hit(pending)",),
        "self._reqs_to_load.get(request.request_id) is None": ("self.cpu_block_pool.free_blocks(blocks)",),
    }


def test_a_popped_entry_with_no_release_is_the_methods_until_its_last_read():
    """No release call: an assert before the popped local's last read is not request-scoped
    (the entry would be dropped); after it, the entry is consumed and the assert is."""
    source = _with_pop(read_after=True).replace("                self._free_pending_cpu_hit(pending)\n",
                                                "                pass\n")
    # read after the touch: the hit-length assert would drop it, the last assert runs after
    assert _scoped(source) == {"hit == num_external_tokens": None,
                               "self._reqs_to_load.get(request.request_id) is None":
                                   ("self.cpu_block_pool.free_blocks(blocks)",)}
    consumed = source.replace("        self.use(pending)\n", "").replace(
        "        hit = self.coordinator", "        self.use(pending)\n        hit = self.coordinator")
    assert _scoped(consumed)["hit == num_external_tokens"] == ()
    unbound = SIMPLE_TREE[f"{SIMPLE}.manager"].replace(
        "        hit = self.coordinator", "        self._pending_cpu_hits.pop(request.request_id, None)\n        hit = self.coordinator")
    assert set(_scoped(unbound).values()) == {None}
    assert not [s for s in sites.discover(f"{SIMPLE}.manager", ast.parse(unbound)).sites
                if s.kind == sites.KIND_REQUEST_SCOPE]


def _refusals(source: str, module: str = f"{SIMPLE}.manager") -> dict[str, str | None]:
    """assert text -> why it cannot fail one request (None: request-scoped)."""
    found = sites.discover(module, ast.parse(source))
    return {s.fingerprint: s.unscoped_reason for s in found.sites if s.kind == "assert"}


def test_every_unscoped_assert_says_why_no_request_can_be_blamed():
    from kvguard.guards.hooking import discovery as d

    base = SIMPLE_TREE[f"{SIMPLE}.manager"]
    assert set(_refusals(base).values()) == {None}  # both asserts are request-scoped
    no_hold = base.replace("        self.cpu_block_pool.touch(blocks)\n", "")
    assert set(_refusals(no_hold).values()) == {d.REFUSE_NO_HOLD}
    no_request = base.replace("request,", "req,").replace("request.request_id", "req.request_id")
    assert set(_refusals(no_request).values()) == {d.REFUSE_NO_REQUEST}
    branch = base.replace("        self.cpu_block_pool.touch(blocks)\n",
                          "        if blocks:\n            self.cpu_block_pool.touch(blocks)\n")
    assert _refusals(branch) == {"hit == num_external_tokens": None,
                                 "self._reqs_to_load.get(request.request_id) is None": d.REFUSE_AFTER_HOLD}
    not_scheduler = base.replace("Scheduler", "Pool")
    assert set(_refusals(not_scheduler).values()) == {d.REFUSE_NOT_SCHEDULER}
