"""kvguard.guards.checks.load_coverage against a brute-force block model (no vLLM).

The brute-force model walks every GPU block of the hit, as ``update_state_after_alloc``
does: a block is a local prefix-cache block when all its tokens are locally computed,
a null block when all its tokens are skipped (the tokens the group's vLLM manager skips
at the hit's end: ``SlidingWindowManager.get_num_skipped_tokens`` for a window,
``MambaManager.get_num_skipped_tokens``, ``n - 1``, for a Mamba group, none for full
attention), and otherwise pending; the load reads the chunk of every block from the
first pending one to the hit's end.
The comparison with vLLM's real KV cache manager is tests/vllm/test_load_coverage_vllm.py.
"""

from __future__ import annotations

import ast

import itertools
import random

import pytest

from kvguard.guards.checks.invariants import cdiv, swa_pending_blocks
from kvguard.guards.checks.load_coverage import GroupGeometry, load_chunks, load_set, longest_loadable_hit


def brute_chunks(
    tpb: int, bpc: int, sw: int | None, extra: int, local: int, end: int, recurrent: bool = False
) -> list[int]:
    first_pending = None
    for b in range(cdiv(end, tpb)):
        block_tokens = range(b * tpb, min((b + 1) * tpb, end))
        is_local = (b + 1) * tpb <= local
        if recurrent:  # MambaManager keeps the state of the last computed token only
            skipped = end - 1
        else:
            skipped = max(0, end - sw + 1 - extra) if sw is not None else 0
        is_null = all(t < skipped for t in range(b * tpb, (b + 1) * tpb))
        if not is_local and not is_null and len(block_tokens):
            first_pending = b
            break
    if first_pending is None:
        return []
    return sorted({b // bpc for b in range(first_pending, cdiv(end, tpb))})


GRID = [
    (tpb, bpc, sw, extra)
    for tpb, bpc, sw, extra in itertools.product(
        (1, 2, 4, 16),  # tokens_per_block
        (1, 2, 4),  # blocks_per_chunk
        (None, 1, 3, 8, 17, 32),  # sliding window (None: full attention)
        (0, 2),  # extra_retained_tokens
    )
    if sw is not None or not extra  # extra_retained_tokens belongs to a sliding-window group
]


@pytest.mark.parametrize("tpb,bpc,sw,extra", GRID)
def test_load_chunks_equals_the_block_walk(tpb, bpc, sw, extra):
    group = GroupGeometry(tpb, bpc, sw, extra)
    for local_blocks in range(0, 6):
        local = local_blocks * tpb
        for end in range(local, local + 5 * group.tokens_per_chunk + 3):
            got = list(load_chunks(group, local, end))
            assert got == brute_chunks(tpb, bpc, sw, extra, local, end), (local, end)


MAMBA_GRID = list(itertools.product((1, 2, 4, 16), (1, 2, 4)))  # tokens_per_block, blocks_per_chunk


@pytest.mark.parametrize("tpb,bpc", MAMBA_GRID)
def test_mamba_load_chunks_equal_the_block_walk(tpb, bpc):
    """A Mamba group's load set is one chunk, the one holding token ``end - 1`` (the state at
    the hit's end), whatever the local hit: exactly the block walk with vLLM's Mamba skip."""
    group = GroupGeometry(tpb, bpc, recurrent_state=True)
    assert group.kept_tokens == 1
    for local_blocks in range(0, 6):
        local = local_blocks * tpb
        for end in range(local + 1, local + 5 * group.tokens_per_chunk + 3):
            got = list(load_chunks(group, local, end))
            assert got == brute_chunks(tpb, bpc, None, 0, local, end, recurrent=True), (local, end)
            assert got == [(end - 1) // group.tokens_per_chunk], (local, end)
        assert list(load_chunks(group, local, local)) == []  # no hit: nothing pending


def test_mamba_load_set_examples():
    # 16-token GPU blocks, 64-token chunks; a hybrid of full attention and Mamba
    full, mamba = GroupGeometry(16, 4), GroupGeometry(16, 4, recurrent_state=True)
    assert load_set([full, mamba], 0, 1279) == [range(0, 20), range(19, 20)]
    assert load_set([full, mamba], 320, 512) == [range(5, 8), range(7, 8)]
    assert load_set([full, mamba], 320, 513) == [range(5, 9), range(8, 9)]  # one token into chunk 8
    # the Mamba chunk is read although the full-attention group starts later: 1 chunk each
    assert load_set([full, mamba], 448, 449) == [range(7, 8), range(7, 8)]


def test_seed_48959_load_set():
    # num_cached_tokens 98012, window 4096, GPU block 32, chunk 256: the sliding-window
    # group fills GPU blocks 2934..3062 (129 blocks), i.e. chunks 366..382.
    full = GroupGeometry(32, 8)
    swa = GroupGeometry(32, 8, 4096)
    sets = load_set([full, swa], 0, 98012)
    assert sets[0] == range(0, 383)
    assert sets[1] == range(366, 383)
    assert cdiv(98012, 32) - 2934 == swa_pending_blocks(98012, 4096, 32) == 129


def test_local_prefix_is_never_loaded():
    assert load_chunks(GroupGeometry(16, 4), 128, 320) == range(2, 5)
    # local prefix ends inside a chunk: that chunk is read again (vLLM reads whole chunks)
    assert load_chunks(GroupGeometry(16, 4), 80, 320) == range(1, 5)
    assert load_chunks(GroupGeometry(16, 4), 320, 320) == range(0)


def test_invalid_arguments_raise():
    with pytest.raises(ValueError):
        GroupGeometry(0, 1)
    with pytest.raises(ValueError):
        GroupGeometry(16, 1, 0)
    with pytest.raises(ValueError):
        GroupGeometry(16, 1, 32, recurrent_state=True)  # a window and a recurrent state
    with pytest.raises(ValueError):
        GroupGeometry(16, 1, None, 2, recurrent_state=True)
    with pytest.raises(ValueError):
        load_chunks(GroupGeometry(16, 1), 32, 16)


def _brute_longest(groups, local, end, missing):
    """Exhaustive: every hit length the admission may answer, longest first."""
    def ok(e):
        return all((g, c) not in missing for g, cs in enumerate(load_set(groups, local, e)) for c in cs)

    if ok(end):
        return end - local
    step = max(g.tokens_per_chunk for g in groups)
    best = 0
    for e in range(local + 1, end):
        if e % step == 0 and e - local >= step and ok(e):
            best = e - local
    return best


def test_longest_loadable_hit_matches_exhaustive_search():
    rng = random.Random(9)
    for _ in range(400):
        tpb = rng.choice((1, 4, 16))
        bpc = rng.choice((1, 2, 4))
        groups = [GroupGeometry(tpb, bpc), GroupGeometry(tpb, bpc, rng.choice((3, tpb * bpc, 2 * tpb * bpc + 1)))]
        if rng.random() < 0.5:
            groups.append(GroupGeometry(tpb, bpc, recurrent_state=True))  # a Mamba group
        tpc = tpb * bpc
        local = rng.randrange(0, 4) * tpb
        end = local + rng.randrange(1, 12 * tpc)
        missing = {(rng.randrange(len(groups)), rng.randrange(0, cdiv(end, tpc))) for _ in range(rng.randrange(0, 4))}
        got = longest_loadable_hit(groups, local, end, lambda g, c: (g, c) not in missing)
        assert got == _brute_longest(groups, local, end, missing), (tpb, bpc, local, end, missing)


def test_longest_loadable_hit_examples():
    # the built-in trace load-evicted-window on 0.25.1: window chunks 14 and 15 evicted
    groups = [GroupGeometry(16, 4), GroupGeometry(16, 4, 256)]
    missing = {(1, 14), (1, 15)}
    assert longest_loadable_hit(groups, 0, 1024, lambda g, c: (g, c) not in missing) == 896
    # everything loadable: the hit itself (may end inside a GPU block)
    assert longest_loadable_hit(groups, 0, 1001, lambda g, c: True) == 1001
    # a full-attention chunk missing at the start: nothing is loadable
    assert longest_loadable_hit(groups, 0, 1024, lambda g, c: (g, c) != (0, 0)) == 0


# -- how the admission wrapper binds vLLM's arguments (kvguard.guards.checks.admission.lookup._Binder) --
class _Lookup:
    """Stand-ins for the shapes a ``get_num_new_matched_tokens`` may have across releases."""

    def plain(self, request, num_computed_tokens):
        return None

    def reordered(self, num_computed_tokens, request, extra=0):
        return None

    def keyword_only(self, request, *, num_computed_tokens):
        return None


@pytest.mark.parametrize(
    ("method", "args", "kwargs"),
    [
        ("plain", ("req", 64), {}),
        ("plain", ("req",), {"num_computed_tokens": 64}),
        ("plain", (), {"request": "req", "num_computed_tokens": 64}),
        ("reordered", (64, "req"), {}),
        ("reordered", (64,), {"request": "req", "extra": 1}),
        ("keyword_only", ("req",), {"num_computed_tokens": 64}),
    ],
)
def test_binder_reads_request_and_computed_tokens_by_signature(method, args, kwargs):
    from kvguard.guards.checks.admission.lookup import _Binder

    bound_method = getattr(_Lookup(), method)
    assert _Binder(bound_method).bind(args, kwargs) == ("req", 64)


def test_binder_rejects_a_call_that_does_not_bind():
    from kvguard.guards.checks.admission.lookup import _Binder

    with pytest.raises(TypeError):
        _Binder(_Lookup().plain).bind(("req",), {})


# -- readiness of an offload entry (kvguard.guards.checks.offload_plan.span_loadable) ---------------
class _RefCntEntry:
    """The shape of vLLM's BlockStatus / ChunkStatus: ready when ref_cnt >= 0."""

    def __init__(self, ref_cnt: int):
        self.ref_cnt = ref_cnt

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


class _FlagEntry:
    """Another readiness rule: the field alone does not decide (ref_cnt must not be read)."""

    def __init__(self, ready: bool):
        self.ready = ready
        self.ref_cnt = 0  # a decoy: reading it instead of is_ready would call this ready

    @property
    def is_ready(self) -> bool:
        return self.ready


def test_ready_rule_is_read_from_the_property_source():
    from kvguard.guards.checks.offload_plan import _is_ref_cnt_ready

    assert _is_ref_cnt_ready(_RefCntEntry) is True
    assert _is_ref_cnt_ready(_FlagEntry) is False


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        ({}, True),
        ({"a": _RefCntEntry(0), "b": _RefCntEntry(2)}, True),
        ({"a": _RefCntEntry(0), "b": _RefCntEntry(-1)}, False),
        ({"a": _RefCntEntry(0)}, False),  # "b" missing
        ({"a": _FlagEntry(True), "b": _FlagEntry(True)}, True),
        ({"a": _FlagEntry(True), "b": _FlagEntry(False)}, False),
        ({"a": _FlagEntry(False), "b": _FlagEntry(True)}, False),
    ],
)
def test_span_loadable(entries, expected):
    from kvguard.guards.checks.offload_plan import span_loadable as _span_loadable

    span = ["a", "b"] if entries else []
    assert _span_loadable(entries.get, span) is expected


# -- the check's hot path (kvguard.guards.checks.admission.admit) on a stand-in scheduler ------
class FullAttentionSpec:
    """Named as vLLM's spec class (the plan matches a group's kind by class name)."""


class SlidingWindowSpec:
    def __init__(self, sliding_window: int, extra_retained_tokens: int = 0):
        self.sliding_window = sliding_window
        self.extra_retained_tokens = extra_retained_tokens


class MambaSpec:
    """Named as vLLM's recurrent-state spec (a Mamba group)."""


class ChunkedLocalAttentionSpec:
    """A kind load_coverage does not model (vLLM's chunked local attention)."""

    attention_chunk_size = 8


class _SpyDict(dict):
    """A policy's dict that records every key the check reads."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.read: list = []

    def get(self, key, default=None):
        self.read.append(key)
        return super().get(key, default)


class _Policy:
    """The structure the plan accepts: ``get`` is one plain dict read, plus insert/remove."""

    def __init__(self, entries: dict):
        self.chunks = _SpyDict(entries)

    def get(self, key):
        return self.chunks.get(key)

    def insert(self, key, entry):
        self.chunks[key] = entry

    def remove(self, key):
        del self.chunks[key]


class _Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _stand_in_scheduler(tpb: int, bpc: int, sw: int, extra: int, chunks: int, missing=(), specs=None):
    specs = specs if specs is not None else [FullAttentionSpec(), SlidingWindowSpec(sw, extra)]
    keys = [[(g, c) for c in range(chunks)] for g in range(len(specs))]
    entries = {k: _RefCntEntry(0) for group in keys for k in group if k not in missing}
    config = _Obj(
        blocks_per_chunk=bpc,
        kv_group_configs=[_Obj(kv_cache_spec=s, tokens_per_block=tpb, group_idx=g) for g, s in enumerate(specs)],
    )
    status = _Obj(group_states=tuple(_Obj(offload_keys=k) for k in keys))
    return _Obj(config=config, manager=_Obj(_policy=_Policy(entries)), _req_status={"r": status})


@pytest.mark.parametrize("tpb,bpc,sw,extra", [g for g in GRID if g[2] in (1, 3, 17)])
def test_admit_reads_the_load_set(tpb, bpc, sw, extra):
    """The inline bounds of ``admit`` equal :func:`load_chunks` for every hit of a grid:
    every chunk of the sliding-window group's load set is read, and of the
    full-attention group's, the first and the last (the interior is what vLLM's lookup
    confirmed); the answer passes through as the same object."""
    from kvguard.guards.checks import admission

    groups = [GroupGeometry(tpb, bpc), GroupGeometry(tpb, bpc, sw, extra)]
    tpc = tpb * bpc
    chunks = 5
    cs = _stand_in_scheduler(tpb, bpc, sw, extra, chunks)
    spy = cs.manager._policy.chunks
    request = _Obj(request_id="r")
    checked = 0
    for local in range(0, chunks * tpc, tpb):
        for end in range(local + 1, chunks * tpc + 1):
            spy.read.clear()
            answer = (end - local, True)
            assert admission.admit(cs, request, local, answer) is answer
            want = set()
            for g, rng in enumerate(load_set(groups, local, end)):
                if g == 0 and len(rng) > 2:
                    rng = (rng[0], rng[-1])
                want |= {(g, c) for c in rng}
            assert set(spy.read) == want, (local, end)
            checked += 1
    assert checked >= chunks * (chunks + 1) // 2


@pytest.mark.parametrize("tpb,bpc", [(1, 1), (1, 4), (4, 2), (16, 1), (16, 4)])
def test_admit_reads_the_chunk_of_a_mamba_group(tpb, bpc):
    """A hybrid of full attention, a sliding window and a Mamba group: for every hit of a
    grid ``admit`` reads, of the Mamba group, exactly the chunk :func:`load_chunks` gives
    (the one holding the hit's last token), beside the other groups' keys; the answer
    passes through as the same object and every lookup is evaluated (none skipped)."""
    from kvguard.guards.checks import admission

    sw = 3 * tpb + 1
    specs = [FullAttentionSpec(), SlidingWindowSpec(sw), MambaSpec()]
    groups = [GroupGeometry(tpb, bpc), GroupGeometry(tpb, bpc, sw), GroupGeometry(tpb, bpc, recurrent_state=True)]
    tpc = tpb * bpc
    chunks = 5
    cs = _stand_in_scheduler(tpb, bpc, sw, 0, chunks, specs=specs)
    spy = cs.manager._policy.chunks
    request = _Obj(request_id="r")
    admission.reset()
    checked = 0
    for local in range(0, chunks * tpc, tpb):
        for end in range(local + 1, chunks * tpc + 1):
            spy.read.clear()
            answer = (end - local, True)
            assert admission.admit(cs, request, local, answer) is answer
            assert {c for g, c in spy.read if g == 2} == {(end - 1) // tpc}, (local, end)
            want = set()
            for g, rng in enumerate(load_set(groups, local, end)):
                if g == 0 and len(rng) > 2:
                    rng = (rng[0], rng[-1])
                want |= {(g, c) for c in rng}
            assert set(spy.read) == want, (local, end)
            checked += 1
    snap = admission.snapshot()
    assert snap["evaluated"] == checked and snap["unchecked"] == 0 and snap["violations"] == 0
    admission.reset()


def test_admit_reduces_a_hit_whose_mamba_chunk_is_missing():
    """The chunk holding the Mamba state at the hit's end is missing: the hit is cut to the
    longest one whose load set is loadable, here the previous chunk boundary (its Mamba
    chunk, the one before, is present)."""
    from kvguard.guards.checks import admission

    tpb, bpc = 4, 2  # 8-token chunks
    specs = [FullAttentionSpec(), MambaSpec()]
    groups = [GroupGeometry(tpb, bpc), GroupGeometry(tpb, bpc, recurrent_state=True)]
    cs = _stand_in_scheduler(tpb, bpc, 0, 0, 8, missing={(1, 4)}, specs=specs)
    admission.reset()
    out = admission.admit(cs, _Obj(request_id="r"), 0, (37, True))  # ends in chunk 4
    want = longest_loadable_hit(groups, 0, 37, lambda g, c: (g, c) != (1, 4))
    assert want == 32 and out == (32, True)
    snap = admission.snapshot()
    assert snap["hit_reduced"] == 1 and snap["recomputed_tokens"] == 5
    answer = (32, True)  # ends in chunk 3: its Mamba chunk is there
    assert admission.admit(cs, _Obj(request_id="r"), 0, answer) is answer
    admission.reset()


class _MetricsSpy:
    """The metrics sink's skipped/guard-error calls, recorded."""

    def __init__(self):
        self.skipped: list[tuple[str, str]] = []

    def check_skipped(self, check, reason):
        from kvguard.guards import names

        assert check in names.SKIPPABLE_CHECKS and reason in names.SKIP_REASONS
        self.skipped.append((check, reason))


def _skip_case(kind: str):
    """A stand-in scheduler the check cannot evaluate, for ``kind``'s reason."""
    if kind == "group_kind":
        return _stand_in_scheduler(4, 2, 0, 0, 4, specs=[FullAttentionSpec(), ChunkedLocalAttentionSpec()])
    cs = _stand_in_scheduler(4, 2, 9, 0, 4)
    if kind == "offload_manager":
        cs.manager = _Obj(lookup=lambda key, ctx: None)  # a manager with no readable cache policy
    elif kind == "connector_config":
        del cs.config.blocks_per_chunk
    elif kind == "partial_tail":
        cs._req_status["r"].partial_tail_boundary = 13
    return cs


@pytest.mark.parametrize("reason", ["group_kind", "offload_manager", "connector_config", "partial_tail"])
def test_what_cannot_be_modelled_is_skipped_not_a_guard_error(reason):
    """Every lookup with a hit that the check cannot evaluate passes vLLM's answer through
    (the same object), counts ``kvguard_check_skipped_total{check="load_coverage", reason}``
    and no guard error; the ``check_skipped`` event comes once per scheduler and reason."""
    from kvguard.guards.checks import admission
    from kvguard.guards.telemetry import events
    from kvguard.guards.policy import runtime

    cs = _skip_case(reason)
    spy = _MetricsSpy()
    admission.reset()
    runtime.reset()
    admission.configure(metrics=spy, events=events)
    try:
        with events.capture() as logged:
            for _ in range(3):
                answer = (13, True)
                assert admission.admit(cs, _Obj(request_id="r"), 0, answer) is answer
    finally:
        admission.unconfigure()
    assert spy.skipped == [("load_coverage", reason)] * 3
    assert admission.snapshot_skipped() == {("load_coverage", reason): 3}
    assert admission.snapshot()["unchecked"] == 3 and admission.snapshot()["evaluated"] == 0
    assert runtime.guard_errors() == {}
    skipped = [e for e in logged if e["event"] == "check_skipped"]
    assert len(skipped) == 1 and skipped[0]["check"] == "load_coverage" and skipped[0]["reason"] == reason
    if reason == "group_kind":
        assert "ChunkedLocalAttentionSpec" in skipped[0]["detail"]
    admission.reset()


def test_an_exception_inside_the_check_is_still_a_guard_error():
    """Only kvguard's own failures are guard errors: a group state without offload keys
    (an exception inside the check) counts ``stage="admission"`` and passes the answer on."""
    from kvguard.guards.checks import admission
    from kvguard.guards.policy import runtime

    cs = _stand_in_scheduler(4, 2, 9, 0, 4)
    cs._req_status["r"].group_states = (_Obj(), _Obj())
    runtime.reset()
    admission.reset()
    answer = (13, True)
    assert admission.admit(cs, _Obj(request_id="r"), 0, answer) is answer
    assert runtime.guard_errors() == {"admission": 1}
    assert admission.snapshot_skipped() == {}
    runtime.reset()
    admission.reset()


def test_admit_reduces_a_hit_whose_window_chunk_is_missing():
    """A window chunk missing inside the sliding-window load set: the hit is reduced to
    :func:`longest_loadable_hit` (guard, the default policy) and counted."""
    from kvguard.guards.checks import admission

    tpb, bpc, sw = 4, 2, 20  # chunk 8 tokens; the window's load set is 3-4 chunks
    cs = _stand_in_scheduler(tpb, bpc, sw, 0, 8, missing={(1, 3)})
    groups = [GroupGeometry(tpb, bpc), GroupGeometry(tpb, bpc, sw)]
    admission.reset()
    answer = (40, True)  # chunks 0..4: the window reads chunks 2..4 (3 is missing)
    assert 3 in load_set(groups, 0, 40)[1]
    out = admission.admit(cs, _Obj(request_id="r"), 0, answer)
    want = longest_loadable_hit(groups, 0, 40, lambda g, c: (g, c) != (1, 3))
    assert out == (want, want > 0) and want < 40
    snap = admission.snapshot()
    assert snap["evaluated"] == 1 and snap["hit_reduced"] == 1 and snap["recomputed_tokens"] == 40 - want
    admission.reset()


def test_reset_zeroes_both_checks_counts():
    """reset() zeroes the copy-coverage counts too (they share the in-process table with
    the load-coverage counts, whose keys the hot path increments in place)."""
    from kvguard.guards.checks import admission

    admission.counters.bump(admission.counters.CC + "hit_reduced", 3)
    admission.counters.bump("hit_reduced", 2)
    assert admission.snapshot_copy_coverage()["hit_reduced"] == 3 and admission.snapshot()["hit_reduced"] == 2
    admission.reset()
    assert admission.snapshot_copy_coverage()["violations"] == 0 and admission.snapshot()["violations"] == 0
    admission.counters.stats["evaluated"] += 1  # the hot path's in-place increment needs the key present
    assert admission.snapshot()["evaluated"] == 1
    admission.reset()


# -- the pre-bound wrapper of each scheduler (kvguard.guards.checks.admission.attach) ----------
def _wrapped_scheduler_class():
    """A stand-in scheduler class whose lookup carries kvguard's class-level wrap, as the
    instrumentor installs it; its lookup answers a 40-token hit whose window chunk 3 is
    missing (the stand-in of ``test_admit_reduces_a_hit_whose_window_chunk_is_missing``)."""
    import wrapt

    from kvguard.guards.checks import admission

    class Scheduler:
        def __init__(self):
            self.__dict__.update(vars(_stand_in_scheduler(4, 2, 20, 0, 8, missing={(1, 3)})))

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return (40, True)

    Scheduler.get_num_new_matched_tokens = wrapt.FunctionWrapper(
        vars(Scheduler)["get_num_new_matched_tokens"], admission.admission_wrapper
    )
    return Scheduler


def test_attach_gives_a_scheduler_the_same_check_pre_bound():
    """``attach`` sets an instance attribute that wraps vLLM's method bound to that
    scheduler; a call through it is checked exactly as through the class wrap (the hit is
    reduced the same way); ``detach_all`` removes it and the class wrap still checks."""
    from kvguard.guards.checks import admission

    Scheduler = _wrapped_scheduler_class()
    cs = Scheduler()
    request = _Obj(request_id="r")
    via_class = cs.get_num_new_matched_tokens(request, 0)
    assert via_class[0] < 40  # the class wrap reduced the hit
    assert admission.attach(cs) is True
    own = cs.__dict__["get_num_new_matched_tokens"]
    assert own._self_wrapper is admission.admission_wrapper and own.__wrapped__.__self__ is cs
    admission.reset()
    assert cs.get_num_new_matched_tokens(request, 0) == via_class
    assert admission.snapshot()["evaluated"] == 1 and admission.snapshot()["hit_reduced"] == 1
    admission.detach_all()
    assert "get_num_new_matched_tokens" not in cs.__dict__
    assert cs.get_num_new_matched_tokens(request, 0) == via_class
    admission.reset()


def _inline_scheduler_class():
    """The stand-in scheduler of :func:`_wrapped_scheduler_class` with the admission check
    written into its lookup's code, as the instrumentor does (the ``admission_return``
    rewrite, compiled from the source below, ``admit_return`` injected)."""
    import textwrap

    from kvguard.guards.checks import admission
    from kvguard.guards.hooking.rewrite import GLOBAL_ADMIT_RETURN, KIND_ADMISSION_RETURN, SiteSpec, rewrite_function

    src = textwrap.dedent('''
        class Scheduler:
            def get_num_new_matched_tokens(self, request, num_computed_tokens):
                return (40, True)
    ''')
    module, found = rewrite_function(
        ast.parse(src), "Scheduler.get_num_new_matched_tokens",
        [SiteSpec("admission:load_coverage", KIND_ADMISSION_RETURN, ())],
    )
    assert found == {"admission:load_coverage"}
    namespace: dict = {GLOBAL_ADMIT_RETURN: admission.admit_return}
    exec(compile(module, "<vllm-test>", "exec"), namespace)
    Scheduler = namespace["Scheduler"]
    stand_in = vars(_stand_in_scheduler(4, 2, 20, 0, 8, missing={(1, 3)}))

    def init(self):
        self.__dict__.update(stand_in)

    Scheduler.__init__ = init
    return Scheduler


def test_the_check_in_the_lookups_code_acts_as_the_wrapper_does():
    """The ``admission_return`` path (issue 21): the same request and missing chunk give
    the same reduced answer as through the wrapt wrapper; no wrapper is attached to a
    scheduler without tiering; ``unwrapped_lookup`` runs the same code with the check
    passing vLLM's answer through (the replay harness admits after its own cap)."""
    from kvguard.guards.checks import admission

    request = _Obj(request_id="r")
    via_wrapper = _wrapped_scheduler_class()().get_num_new_matched_tokens(request, 0)
    Scheduler = _inline_scheduler_class()
    cs = Scheduler()
    assert admission.admits_inline(vars(Scheduler)["get_num_new_matched_tokens"])
    admission.reset()
    assert cs.get_num_new_matched_tokens(request, 0) == via_wrapper and via_wrapper[0] < 40
    assert admission.snapshot()["evaluated"] == 1 and admission.snapshot()["hit_reduced"] == 1
    assert admission.attach(cs) is False and "get_num_new_matched_tokens" not in cs.__dict__
    plain, admitted = admission.unwrapped_lookup(cs)
    assert admitted is True and plain(request, 0) == (40, True)  # vLLM's answer, unchecked
    assert admission.snapshot()["evaluated"] == 1 and admission.lookup._suspended == 0
    assert cs.get_num_new_matched_tokens(request, 0) == via_wrapper  # checked again after it
    admission.reset()


def test_attach_never_replaces_an_instance_attribute_or_a_subclass_override():
    from kvguard.guards.checks import admission

    Scheduler = _wrapped_scheduler_class()
    cs = Scheduler()
    mine = lambda request, num_computed_tokens: (0, False)  # noqa: E731 - someone else's wrapper
    cs.get_num_new_matched_tokens = mine
    assert admission.attach(cs) is False and cs.get_num_new_matched_tokens is mine

    class Override(Scheduler):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return super().get_num_new_matched_tokens(request, num_computed_tokens)

    sub = Override()
    assert admission.attach(sub) is False and "get_num_new_matched_tokens" not in sub.__dict__
    assert sub.get_num_new_matched_tokens(_Obj(request_id="r"), 0)[0] < 40  # super(): the class wrap checks
    admission.reset()


def test_binder_fast_path_reads_positions_from_the_signature():
    """vLLM's positional call shape takes the two-read fast path, in the signature's order."""
    from kvguard.guards.checks.admission.lookup import _Binder

    plain = _Binder(_Lookup().plain)
    assert plain.positions == (0, 1) and plain.min_args == 2
    reordered = _Binder(_Lookup().reordered)
    assert reordered.positions == (1, 0) and reordered.bind((64, "req"), {}) == ("req", 64)
    assert _Binder(_Lookup().keyword_only).positions is None
