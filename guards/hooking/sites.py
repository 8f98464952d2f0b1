"""Which vLLM code kvguard rewrites: a scope rule, discovery of every assert, and the few
special sites matched by what their code does (never by a table fitted to releases).

pytest keeps no list of the asserts it rewrites: it is told which modules are in scope
and rewrites every assert in them. kvguard does the same (vLLM changes every release; a
table read from three releases missed asserts and raised false alarms on the others).

**The scope rule** (:func:`in_scope`, the only place that decides it): the scheduler-side
offload path of vLLM's two native CPU offload connectors, i.e.

- every module under ``vllm.distributed.kv_transfer.kv_connector.v1.offloading`` and
  under ``vllm.v1.kv_offload`` (the OffloadingConnector's), and under
  ``vllm.v1.simple_kv_offload`` (the SimpleCPUOffloadConnector's, selected by
  ``VLLM_USE_SIMPLE_KV_OFFLOAD=1``): the *offload packages*, :func:`in_offload_packages`,
- plus the two connector modules ``...kv_connector.v1.offloading_connector`` and
  ``...kv_connector.v1.simple_cpu_offload_connector``, where only the scheduler-role
  functions count (:func:`worker_role`: a function that reads the attribute the connector's
  constructor binds to its worker-side object, :func:`worker_attributes`:
  ``connector_worker`` / ``worker_handler``, read off the ``KVConnectorRole.WORKER`` branch),
- minus the worker side, by role (that code runs in the GPU worker processes, where
  kvguard changes nothing):

  - by name (:func:`worker_by_name`): a module with a dotted component ``worker`` or
    ``*_worker`` (the GPU worker and its transfer handlers) or ``*_triton`` (Triton copy
    kernels);
  - by import (:func:`worker_side_modules`): a module that at least one
    module of the offload packages imports, and that only worker-side modules import.
    vLLM 0.34.0's ``vllm.v1.kv_offload.pointer_utils`` is the case that asked for it:
    ``offloading/worker.py``, ``cpu/gpu_worker.py`` and ``fs/worker.py`` import it, no
    scheduler-side module does. The rule is applied transitively (a helper that only such
    a helper imports is worker-side too) as a least fixed point: a module stays in scope
    unless every importer is *proven* worker-side, so an import cycle between two
    helpers keeps both in. A module that no module of the offload packages imports
    statically stays **in** scope: vLLM's spec factory loads its spec modules by
    dotted-name strings (``OffloadingSpecFactory.register_spec("CPUOffloadingSpec",
    "vllm.v1.kv_offload.cpu.spec", ...)`` in ``vllm/v1/kv_offload/factory.py``), and
    ``kv_connector_extra_config`` may name any ``spec_module_path``, so "nobody imports
    it" proves nothing about its role. Importers outside the offload packages are not
    counted (their roles are not the offload path's). The connector module counts as a
    scheduler-side importer (it holds both roles in one file).

  The by-import part needs the release's sources, so :func:`in_scope` takes the
  ``worker_side`` set that :func:`worker_side_modules` computed once from them (the live
  install reads the installed files, the source-only release matrix the sdist: the same
  two functions); the check itself stays pure string and set work, cheap enough for
  the import hook's bail-out.

**Generic sites** (:func:`discover`): every ``assert`` inside a function or method of an
in-scope module becomes a failure-only check site (a passing assert still runs exactly
vLLM's bytecode). Its id is ``<module short>:<qualname>:<8 hex of sha1(normalized test)>``
with the module short name relative to ``vllm.distributed.kv_transfer.kv_connector.v1.``
or ``vllm.v1.`` (e.g. ``offloading.scheduler:OffloadingConnectorScheduler._lookup:f0d60ee9``):
stable across releases while the assert's text and place stay, and one series per
assert of the installed release (identical asserts in one function share an id).

**Special sites**, matched by structure in every spelling of every release:

- ``swa_pending_bound`` (vLLM #48959): an assert whose test is ``<pending> <= <bound>``
  where ``<pending>`` names pending GPU blocks and ``<bound>`` reads a sliding-window
  size (``sliding_window_size_in_blocks`` before #48150, ``..._in_chunks`` after).
  vLLM's own bound is ``<bound>`` itself: :attr:`Site.bound_expr` keeps its source
  text, so the runtime and ``check-geometry`` evaluate exactly what the installed
  release asserts (no version cutoff). Expected in a module whose scheduler class has
  ``update_state_after_alloc`` and reads an offload window size in blocks or chunks
  (``sliding_window_size_in_*``).
- ``group_sizes_consistency`` (vLLM #42945): the asserts of ``GPULoadStoreSpec.__init__``
  that read ``group_sizes``. Expected where ``GPULoadStoreSpec.__init__`` takes ``group_sizes``.
- the store drop (vLLM #42945): ``<name> = GPULoadStoreSpec(...)`` inside a loop of a
  scheduler method whose name contains ``store`` and which binds the locals the drop
  needs (:data:`STORE_DROP_LOCALS`). Expected wherever such a construction exists in a
  store builder.

- ``store_keys`` (vLLM #49118, #52170, #55503): in the same store builder, an assert
  ``len(<a>) == len(<b>)`` inside the builder's request loop (the outermost loop of the
  method's own scope) that runs before the loop's ``prepare_store`` call (so nothing is
  prepared yet and nothing needs releasing). Its check is ``store_keys_consistency``;
  a second site (``...:store_skip:<hash>``, kind ``store_call``) wraps the statement of
  the request loop's body that holds the assert, so a drop skips to the next request.
  Such an assert after ``prepare_store`` is not matched (it stays generic and is
  re-raised: which keys to release would not be provable); it is then reported as
  ``special_missing``.
- the request scope (e.g. #43884's ``num_locally_computed_tokens``
  assert, #39702's hit-length assert of the SimpleCPUOffloadConnector): a method of an
  offload ``*Scheduler`` class that takes ``request``, returns nothing (only bare
  ``return``) and takes hold of blocks for a load (:data:`LOAD_HOLD_CALLS`:
  ``prepare_load``, ``touch``): its generic asserts that run while failing the request
  leaves nothing held, or while the method's own code shows how to give back what it holds
  (:class:`~kvguard.guards.hooking.discovery.RequestScope`: a pin it popped off the
  scheduler's state and releases itself, e.g. 0.34.0's ``self._free_pending_cpu_hit(pending)``;
  a ``BlockPool.touch`` undone by ``free_blocks``), are marked :attr:`Site.request_scoped`
  with those release calls (:attr:`Site.releases`, run before the request fails), and a
  site ``...:request_scope`` (kind ``request_scope``) wraps the method's body so that
  under ``guard`` such a failure fails that request alone
  (:mod:`kvguard.guards.policy.degrade`): no load was issued for it yet, so it can never be
  computed on KV that was not loaded.

A special site that its module should have (by the structural expectation above) and
that is not matched is reported as ``special_missing``: an event and
``kvguard_site_installed{site} 0``. Nothing else is ever "missing".

**Declared support** (after OpenTelemetry's instrumentors, whose
``_instruments`` name the versions measured and whose gate warns rather than refuses):
:data:`MEASURED_VLLM_RELEASES` lists every release measured, :data:`SUPPORTED_VLLM` is its
span, and :func:`vllm_support` / :func:`vllm_relation` classify a version string. Nothing
above depends on them: an unmeasured release is instrumented by the same rules, and the
instrumentor and the sidecar only say so (event ``vllm_unmeasured``,
``kvguard_build_info{vllm_support}``).

Stdlib only (``ast``, ``hashlib``; ``packaging`` inside :func:`vllm_support` only, when
called): the source-only release matrix runs it without vLLM, the sidecar calls
:func:`vllm_support`.
"""

from __future__ import annotations

# The four concerns live in their own modules; this module is the one place that names the
# whole site API (the instrumentor, the lab and the tests import it from here).
from kvguard.guards.hooking.discovery import LOAD_HOLD_CALLS, Discovery, discover
from kvguard.guards.hooking.releases import MEASURED_VLLM_RELEASES, SUPPORTED_VLLM, vllm_relation, vllm_support
from kvguard.guards.hooking.scope import *  # noqa: F403
from kvguard.guards.hooking.scope import __all__ as _scope_all
from kvguard.guards.names import KIND_ASSERT, KIND_REQUEST_SCOPE, KIND_STORE_CALL, KIND_WINDOW
from kvguard.guards.site_registry import Site, known_site_ids, register, register_missing, registered

__all__ = [
    "Site",
    "Discovery",
    "SCOPE_PACKAGES",
    "CONNECTOR_MODULE",
    "STORE_DROP_LOCALS",
    "SUPPORTED_VLLM",
    "MEASURED_VLLM_RELEASES",
    "vllm_support",
    "vllm_relation",
    "in_scope",
    "in_offload_packages",
    "worker_by_name",
    "imported_modules",
    "worker_side_modules",
    "worker_role",
    "short_module",
    "discover",
    "register",
    "register_missing",
    "known_site_ids",
    "registered",
    "SPECIAL_WINDOW",
    "SPECIAL_GROUP_SIZES",
    "SPECIAL_STORE_DROP",
    "SPECIAL_STORE_KEYS",
    "KIND_ASSERT",
    "KIND_REQUEST_SCOPE",
    "KIND_WINDOW",
    "KIND_STORE_CALL",
]
__all__ += [n for n in _scope_all if n not in __all__] + ["LOAD_HOLD_CALLS"]
