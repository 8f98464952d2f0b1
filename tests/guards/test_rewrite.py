"""The assert -> check AST pass (after pytest's testing/test_assertrewrite.py)."""

from __future__ import annotations

import ast
import dis
import sys
import textwrap
import traceback

import pytest

from kvguard.guards.telemetry import events

from kvguard.guards.policy import runtime
from kvguard.guards.hooking.hook import GuardFinder
from kvguard.guards.hooking.instrumentor import OffloadGuardInstrumentor, _injected_globals
from kvguard.guards.hooking.rewrite import (
    GLOBAL_ADMIT_RETURN,
    INJECTED_GLOBALS,
    KIND_ADMISSION_RETURN,
    KIND_ASSERT,
    KIND_STORE_CALL,
    KIND_WINDOW,
    SiteSpec,
    extract_function_code,
    iter_asserts,
    normalize_assert,
    rewrite_function,
)
from kvguard.guards.settings import GuardSettings
from guardtools import SITE_GROUP_SIZES_SUM, SITE_STORE_DROP, SITE_SWA_PENDING_BOUND
from kvguard.guards.hooking.sites import discover

import fakevllm

SRC = textwrap.dedent(
    '''
    def f(x, y):
        assert x >= 0
        assert (
            x
            <= y
        ), "x above y"
        return x
    '''
)


def rewrite(src: str, qualname: str, specs: list[SiteSpec]) -> tuple[ast.Module, set[str]]:
    result = rewrite_function(ast.parse(src), qualname, specs)
    assert result is not None
    return result


def run_rewritten(src: str, qualname: str, specs: list[SiteSpec]):
    """Compile the rewritten function as the instrumentor does; return it."""
    module, _ = rewrite(src, qualname, specs)
    code = compile(module, "<vllm-test>", "exec")
    namespace: dict = dict(_injected_globals())
    exec(code, namespace)
    obj = namespace
    for part in qualname.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


def getmsg(func, *args) -> tuple[str, int]:
    """Call ``func``; return (str(AssertionError), line of the frame that raised it)."""
    with pytest.raises(AssertionError) as info:
        func(*args)
    tb = info.value.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return str(info.value), tb.tb_lineno


def spec(fingerprint: str, site_id: str = SITE_GROUP_SIZES_SUM, kind: str = KIND_ASSERT) -> SiteSpec:
    return SiteSpec(site_id, kind, (fingerprint,))


def test_fingerprint_ignores_layout_and_message():
    tree = ast.parse(SRC)
    assert [fp for _, fp, _ in iter_asserts(tree)] == ["x >= 0", "x <= y"]
    assert [line for _, _, line in iter_asserts(tree)] == [3, 4]


def test_unlisted_asserts_stay_identical():
    original = ast.parse(SRC).body[0]
    module, found = rewrite(SRC, "f", [spec("x <= y")])
    new = module.body[0]
    assert found == {SITE_GROUP_SIZES_SUM}
    assert ast.dump(new.body[0], include_attributes=True) == ast.dump(original.body[0], include_attributes=True)
    assert isinstance(new.body[1], ast.If)  # the listed one became a check
    assert ast.dump(new.body[2], include_attributes=True) == ast.dump(original.body[2], include_attributes=True)


def test_input_tree_is_not_modified():
    tree = ast.parse(SRC)
    before = ast.dump(tree, include_attributes=True)
    rewrite_function(tree, "f", [spec("x <= y")])
    assert ast.dump(tree, include_attributes=True) == before


def test_location_is_set():
    module, _ = rewrite(SRC, "f", [spec("x >= 0"), spec("x <= y")])
    spans = [(3, 3), (4, 7)]
    for stmt, (first, last) in zip(module.body[0].body[:2], spans):
        for node in ast.walk(stmt):
            if "lineno" in node._attributes:
                assert first <= node.lineno <= last, ast.dump(node)
                assert first <= node.end_lineno <= last


def test_positions_are_preserved():
    namespace: dict = {}
    exec(compile(ast.parse(SRC), "<vllm-test>", "exec"), namespace)
    plain = getmsg(namespace["f"], 5, 1)
    guarded = getmsg(run_rewritten(SRC, "f", [spec("x <= y")]), 5, 1)
    assert plain == guarded  # same message, same line as CPython's own assert
    assert plain[0] == "x above y" and plain[1] in (4, 5)
    plain = getmsg(namespace["f"], -1, 1)
    guarded = getmsg(run_rewritten(SRC, "f", [spec("x >= 0")]), -1, 1)
    assert plain == guarded == ("", 3)


def test_message_is_evaluated_only_on_failure():
    src = textwrap.dedent(
        '''
        def f(x, calls):
            assert x, calls.append("msg") or "m"
            return calls
        '''
    )
    func = run_rewritten(src, "f", [spec("x")])
    assert func(1, []) == []
    calls: list = []
    with pytest.raises(AssertionError, match="m"):
        func(0, calls)
    assert calls == ["msg"]


def executed_opcodes(func, *args) -> list[str]:
    """Opcode names executed in ``func``'s own frame for one call (``sys.settrace`` opcode events)."""
    code = func.__code__
    names_at = {ins.offset: ins.opname for ins in dis.get_instructions(code)}
    ran: list[str] = []

    def tracer(frame, event, arg):
        if frame.f_code is not code:
            return None
        frame.f_trace_opcodes = True
        if event == "opcode":
            ran.append(names_at[frame.f_lasti])
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        func(*args)
    finally:
        sys.settrace(previous)
    return ran


# One passing call per assert shape vLLM uses: compare, and/or, not, call, attribute, chain.
PASSING_SHAPES = [
    ("x >= 0", (1, 2)),
    ("x <= y", (1, 2)),
    ("x and y", (1, 2)),
    ("x or y", (0, 2)),
    ("not x", (0, 2)),
    ("isinstance(x, int)", (1, 2)),
    ("x is not None", (1, 2)),
    ("0 <= x <= y", (1, 2)),
    ("all((v != 0 for v in [x, y]))", (1, 2)),
    ("x.real == x and (y > x or y < 0)", (1, 2)),
]


@pytest.mark.parametrize(("test", "args"), PASSING_SHAPES)
def test_passing_generic_site_runs_exactly_the_asserts_opcodes(test, args):
    """The durable proof of "a passing generic assert costs what vLLM's assert costs"."""
    src = f"def f(x, y):\n    assert {test}, 'never built'\n    return x\n"
    namespace: dict = {}
    exec(compile(src, "<vllm-test>", "exec"), namespace)
    plain = namespace["f"]
    guarded = run_rewritten(src, "f", [spec(normalize_assert(ast.parse(src).body[0].body[0]))])
    assert guarded.__code__ is not plain.__code__
    assert "@kvguard_check" in guarded.__code__.co_names  # it is rewritten...
    original_ops = executed_opcodes(plain, *args)
    assert original_ops and original_ops[-1] == "RETURN_VALUE"
    assert executed_opcodes(guarded, *args) == original_ops  # ...and passes on the same opcodes


def test_passing_generic_site_never_reaches_kvguard(monkeypatch):
    calls: list = []
    func = run_rewritten(SRC, "f", [spec("x <= y")])
    monkeypatch.setitem(func.__globals__, "@kvguard_check", lambda *a: calls.append(a) or AssertionError(a[-1]))
    assert [func(1, 2) for _ in range(5)] == [1] * 5
    assert calls == []
    with pytest.raises(AssertionError, match="x above y"):
        func(3, 2)
    assert [(c[0], c[1], c[2]["x"], c[3]) for c in calls] == [(SITE_GROUP_SIZES_SUM, False, 3, "x above y")]


def test_optimize_strips_the_generic_site_as_it_strips_asserts():
    module, _ = rewrite(SRC, "f", [spec("x >= 0"), spec("x <= y")])
    code = extract_function_code(compile(module, "<vllm-test>", "exec", optimize=1), "f")
    plain = extract_function_code(compile(SRC, "<vllm-test>", "exec", optimize=1), "f")
    # only line-number NOPs of the folded ``if __debug__:`` remain
    listing = [(i.opname, i.argrepr) for i in dis.get_instructions(code) if i.opname != "NOP"]
    assert listing == [(i.opname, i.argrepr) for i in dis.get_instructions(plain)]
    assert not any("kvguard" in argrepr for _, argrepr in listing)


def test_super_keeps_its_class_cell():
    src = textwrap.dedent(
        '''
        class A:
            def __init__(self, v):
                self.v = v

        class B(A):
            def __init__(self, v):
                super().__init__(v)
                assert v > 0
        '''
    )
    namespace: dict = {}
    exec(compile(src, "<vllm-test>", "exec"), namespace)
    old = namespace["B"].__init__
    module, _ = rewrite(src, "B.__init__", [spec("v > 0")])
    code = extract_function_code(compile(module, "<vllm-test>", "exec"), "B.__init__")
    assert code.co_freevars == old.__code__.co_freevars == ("__class__",)
    old.__code__ = code
    namespace.update(_injected_globals())
    assert namespace["B"](3).v == 3
    assert getmsg(namespace["B"], -1)[1] == 9


# -- admission_return (issue 21): vLLM's answer through the check, in the lookup's own code --
LOOKUP_SRC = textwrap.dedent(
    '''
    class Sched:
        def get_num_new_matched_tokens(self, request, num_computed_tokens, max_new=None):
            def helper():
                return "nested"  # a nested scope's return is not the method's answer
            if request == "defer":
                return None, False
            hits = [n for n in range(num_computed_tokens)]
            assert len(hits) >= 0
            return len(hits) * 2, helper() == "nested"
    '''
)
ADMIT = SiteSpec("admission:load_coverage", KIND_ADMISSION_RETURN, ())


def _lookup_with(src: str, specs: list[SiteSpec], admit):
    module, found = rewrite(src, "Sched.get_num_new_matched_tokens", specs)
    namespace: dict = dict(_injected_globals())
    namespace[GLOBAL_ADMIT_RETURN] = admit
    exec(compile(module, "<vllm-test>", "exec"), namespace)
    return namespace["Sched"], found


def test_admission_return_passes_every_answer_of_the_method_through_the_check():
    """Each ``return`` of the method's own scope hands (self, request, num_computed_tokens,
    answer) to the check and returns what the check returns; the nested helper's return
    does not; the method's other sites are rewritten alongside."""
    calls = []

    def admit(cs, request, num_computed_tokens, answer):
        calls.append((cs, request, num_computed_tokens, answer))
        return ("checked", answer)

    sched_cls, found = _lookup_with(LOOKUP_SRC, [ADMIT, spec("len(hits) >= 0")], admit)
    assert found == {"admission:load_coverage", SITE_GROUP_SIZES_SUM}
    sched = sched_cls()
    assert sched.get_num_new_matched_tokens("req", 3) == ("checked", (6, True))
    assert sched.get_num_new_matched_tokens("defer", 5) == ("checked", (None, False))
    assert calls == [(sched, "req", 3, (6, True)), (sched, "defer", 5, (None, False))]
    assert GLOBAL_ADMIT_RETURN in INJECTED_GLOBALS
    assert GLOBAL_ADMIT_RETURN in sched_cls.get_num_new_matched_tokens.__code__.co_names


@pytest.mark.parametrize("statement", [
    "request = request.inner",
    "num_computed_tokens += 1",
    "for request in ():\n            pass",
    "self = None",
    "del request",
    "import os as request",
    "(num_computed_tokens := 0)",
])
def test_admission_return_refuses_a_method_that_rebinds_what_it_would_pass(statement):
    """A method that rebinds ``self``, ``request`` or ``num_computed_tokens`` anywhere would
    hand the check another value than the call's: it is left as it is (not matched; the
    instrumentor then wraps it instead)."""
    src = LOOKUP_SRC.replace("        hits = [", f"        {statement}\n        hits = [")
    assert src != LOOKUP_SRC
    sched_cls, found = _lookup_with(src, [ADMIT], lambda *a: pytest.fail("called"))
    assert found == set()
    assert GLOBAL_ADMIT_RETURN not in sched_cls.get_num_new_matched_tokens.__code__.co_names


@pytest.mark.parametrize("block", ["with lock:", "try:"])
def test_admission_return_refuses_a_return_inside_try_or_with(block):
    """A ``return`` inside ``with`` / ``try``: vLLM's ``__exit__`` / ``finally`` would run
    after the check, or its handler could catch a strict raise. Not rewritten."""
    body = "            return len(hits) * 2, helper() == \"nested\"\n"
    tail = "        finally:\n            pass\n" if block == "try:" else ""
    src = LOOKUP_SRC.replace("        return len(hits) * 2, helper() == \"nested\"\n",
                             f"        lock = None\n        {block}\n{body}{tail}")
    assert src != LOOKUP_SRC
    _, found = _lookup_with(src, [ADMIT], lambda *a: pytest.fail("called"))
    assert found == set()


def test_admission_return_needs_the_parameters_by_name():
    src = LOOKUP_SRC.replace("num_computed_tokens", "num_tokens")
    _, found = _lookup_with(src, [ADMIT], lambda *a: pytest.fail("called"))
    assert found == set()


def test_store_call_needs_an_enclosing_loop():
    src = textwrap.dedent(
        '''
        def outside(src_block_ids, group_sizes, block_indices):
            src_spec = GPULoadStoreSpec(src_block_ids, group_sizes=group_sizes, block_indices=block_indices)
            return src_spec

        def inside(items):
            out = []
            for src_block_ids, group_sizes, block_indices in items:
                src_spec = GPULoadStoreSpec(
                    src_block_ids, group_sizes=group_sizes, block_indices=block_indices
                )
                out.append(src_spec)
            return out
        '''
    )
    fp = "src_spec = GPULoadStoreSpec(src_block_ids, group_sizes=group_sizes, block_indices=block_indices)"
    store = SiteSpec(SITE_STORE_DROP, KIND_STORE_CALL, (fp,))
    assert rewrite(src, "outside", [store])[1] == set()
    module, found = rewrite(src, "inside", [store])
    assert found == {SITE_STORE_DROP}
    loop = module.body[0].body[1]
    assert isinstance(loop.body[0], ast.Try) and loop.body[0].lineno == 9


def test_generated_names_cannot_clash():
    for name in INJECTED_GLOBALS:
        assert not name.isidentifier()


class TestEarlyRewriteBailout:
    def test_other_modules_cost_one_lookup(self):
        seen = []
        finder = GuardFinder({"vllm.v1.kv_offload.base"}, seen.append, seen.append)
        assert finder.find_spec("json") is None
        assert finder.find_spec("vllm.v1.kv_offload") is None
        assert finder.lookups == 0 and seen == []

    def test_target_module_is_hooked_and_instrumented_at_import(self, tmp_path, metrics):
        with fakevllm.fake_vllm(tmp_path):
            assert OffloadGuardInstrumentor().install(GuardSettings(), metrics=metrics)
            assert fakevllm.BASE not in sys.modules
            import vllm.v1.kv_offload.base as base

            assert type(base.__spec__.loader).__name__ == "_PostImportLoader"
            assert OffloadGuardInstrumentor().site_status()[SITE_GROUP_SIZES_SUM] == "installed"
            assert base.GPULoadStoreSpec.__init__.__code__.co_filename == base.__file__


def test_already_imported_is_reported(tmp_path, metrics):
    with fakevllm.fake_vllm(tmp_path):
        import vllm.v1.kv_offload.base  # noqa: F401  imported before install

        with events.capture() as logged:
            OffloadGuardInstrumentor().install(GuardSettings(), metrics=metrics)
        already = [e["module"] for e in logged if e["event"] == "already_imported"]
        # the module and its in-scope parent package, each once; nothing imported later
        assert sorted(already) == ["vllm.v1.kv_offload", fakevllm.BASE]
        assert OffloadGuardInstrumentor().site_status()[SITE_GROUP_SIZES_SUM] == "installed"


class TestIssue48959:
    FP_0_25 = "num_pending_gpu_blocks <= group_config.sliding_window_size_in_blocks * self.config.block_size_factor"
    FP_0_33 = (
        "num_pending_gpu_blocks <= group_config.sliding_window_size_in_chunks * self.config.blocks_per_chunk + 1"
    )

    @pytest.mark.parametrize("fp", [FP_0_25, FP_0_33])
    def test_discovery_matches_both_spellings_by_structure(self, fp):
        """The window site is found by what it does (pending blocks <= a sliding-window
        bound), in the spelling before and after #48150; vLLM's bound is its right side."""
        src = textwrap.dedent(
            f'''
            class OffloadingConnectorScheduler:
                def update_state_after_alloc(self, group_config, num_pending_gpu_blocks):
                    if group_config.sliding_window_size_in_blocks is not None:
                        assert {fp}
                    assert num_pending_gpu_blocks >= 0
            '''
        )
        found = discover("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler", ast.parse(src))
        (window,) = found.special["swa_pending_bound"]
        assert window.site_id == SITE_SWA_PENDING_BOUND and window.kind == KIND_WINDOW
        assert window.bound_expr == fp.split(" <= ")[1] and window.pending_expr == "num_pending_gpu_blocks"
        assert found.special_missing == [] and found.in_scope_asserts == 2
        (other,) = [s for s in found.sites if s is not window]
        assert other.kind == KIND_ASSERT and other.check == "scheduler_assert"

    def test_window_site_calls_check_on_every_evaluation(self):
        src = textwrap.dedent(
            f'''
            def load(num_pending_gpu_blocks, group_config, self):
                assert (
                    {self.FP_0_25}
                )
                return num_pending_gpu_blocks
            '''
        )
        module, found = rewrite(src, "load", [SiteSpec(SITE_SWA_PENDING_BOUND, KIND_WINDOW, (self.FP_0_25,))])
        assert found == {SITE_SWA_PENDING_BOUND}
        calls = [n for n in ast.walk(module) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "@kvguard_check"]
        assert len(calls) == 1 and isinstance(calls[0].args[1], ast.Name)  # the test's value, not False

    def test_normalization_of_the_real_multiline_assert(self):
        node = ast.parse(
            "assert (\n    num_pending_gpu_blocks\n    <= group_config.sliding_window_size_in_blocks\n"
            "    * self.config.block_size_factor\n)"
        ).body[0]
        assert normalize_assert(node) == self.FP_0_25
