"""The offload-path sources of a vLLM release, without installing it, and what they assert.

- :func:`fetch_sdist`: the sdist ``vllm-<version>.tar.gz`` from the package index (simple
  API, PEP 691 JSON or PEP 503 HTML; ``https://pypi.org/simple`` or ``$PIP_INDEX_URL``),
  sha256-checked against the index, cached in ``~/.cache/kvguard/sdists`` (a cached file
  whose bytes match its ``.sha256`` needs no network). ``pip download --no-binary`` is
  not used: it would build the sdist's metadata, which needs torch.
- :func:`sdist_package_sources` / :func:`installed_package_sources`: ``{module: source}``
  for every module of the offload packages (:func:`kvguard.guards.hooking.sites.in_offload_packages`,
  worker modules included: the scope rule's by-import part reads their imports), read
  from the tarball or from the installed package's files (nothing is imported);
  :func:`sdist_offload_sources` / :func:`installed_offload_sources`: the same, kept to
  the modules kvguard's scope rule accepts (:func:`offload_scope`: the by-name rule plus
  :func:`kvguard.guards.hooking.sites.worker_side_modules` over those sources, the one rule of the
  live install and the release matrix); :func:`installed_module_source`: one installed
  module's source, likewise.
- :func:`asserted_window_bound`: the bound the release's own window assert computes for
  a geometry, by evaluating that assert's bound expression (found by
  :func:`kvguard.guards.hooking.sites.discover`) with the window in chunks from the release's own
  ``get_sliding_window_size_in_*`` function: never a version cutoff.

Stdlib only.
"""

from __future__ import annotations

import ast
import hashlib
import html.parser
import importlib.util
import json
import os
import shutil
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from kvguard.guards.checks.invariants import cdiv
from kvguard.guards.hooking.sites import (
    CONNECTOR_MODULES,
    SCOPE_PACKAGES,
    SPECIAL_WINDOW,
    discover,
    in_offload_packages,
    in_scope,
    worker_side_modules,
)

__all__ = [
    "SourceError",
    "DEFAULT_CACHE",
    "DEFAULT_INDEX",
    "sdist_filename",
    "index_file_entry",
    "find_in_simple_page",
    "fetch_sdist",
    "offload_scope",
    "sdist_package_sources",
    "sdist_offload_sources",
    "installed_package_sources",
    "installed_offload_sources",
    "installed_module_source",
    "asserted_window_bound",
]

DEFAULT_CACHE = Path.home() / ".cache" / "kvguard"
DEFAULT_INDEX = os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple"


class SourceError(Exception):
    """A release's sources could not be had or read (no sdist, bad digest, no window site)."""


def sdist_filename(version: str) -> str:
    """``"0.33.0"`` -> ``"vllm-0.33.0.tar.gz"`` (the sdist name on PyPI)."""
    return f"vllm-{version}.tar.gz"


def index_file_entry(index_url: str, filename: str) -> tuple[str, str]:
    """Look ``filename`` up on the index's ``vllm`` project page; return ``(url, sha256)``.

    Asks for the PEP 691 JSON form of the simple API and accepts the PEP 503 HTML form.
    Raises ``SourceError`` if the index lists no such file or gives no sha256.
    """
    page_url = index_url.rstrip("/") + "/vllm/"
    request = urllib.request.Request(
        page_url,
        headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"},
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        body, content_type = resp.read(), resp.headers.get("Content-Type", "")
    url, digest = find_in_simple_page(body, content_type, filename)
    return urllib.parse.urljoin(page_url, url), digest


class _AnchorParser(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []  # (href, text)
        self._href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href") or ""

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self.links.append((self._href, data.strip()))
            self._href = None


def find_in_simple_page(body: bytes, content_type: str, filename: str) -> tuple[str, str]:
    """``(url, sha256)`` of ``filename`` in a simple-API project page. Pure.

    JSON (PEP 691, ``application/vnd.pypi.simple.v1+json``): ``files[].filename`` /
    ``url`` / ``hashes.sha256``. HTML (PEP 503): the anchor whose text is ``filename``,
    its ``#sha256=`` fragment. The URL may be relative to the page. Raises ``SourceError``
    if the file or its sha256 is missing.
    """
    if "json" in content_type:
        for entry in json.loads(body).get("files", []):
            if entry.get("filename") == filename:
                digest = entry.get("hashes", {}).get("sha256")
                if not digest:
                    raise SourceError(f"no sha256 for {filename} on the index")
                return entry["url"], digest
    else:
        parser = _AnchorParser()
        parser.feed(body.decode("utf-8", errors="replace"))
        for href, text in parser.links:
            if text == filename:
                url, _, fragment = href.partition("#")
                if not fragment.startswith("sha256="):
                    raise SourceError(f"no sha256 for {filename} on the index")
                return url, fragment[len("sha256="):]
    raise SourceError(f"the index's vllm page lists no {filename}")


def fetch_sdist(version: str, cache_dir: Path, index_url: str = DEFAULT_INDEX) -> Path:
    """Return the cached, sha256-verified sdist of vLLM ``version``; download it if needed.

    ``cache_dir/vllm-<ver>.tar.gz`` plus ``.sha256`` (the index's digest, written after a
    verified download). A cached file whose bytes match its ``.sha256`` is used offline.
    Raises ``SourceError`` on a digest mismatch.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    name = sdist_filename(version)
    path = cache_dir / name
    digest_file = cache_dir / (name + ".sha256")
    if path.exists() and digest_file.exists():
        if _sha256(path) == digest_file.read_text().strip():
            return path
    url, digest = index_file_entry(index_url, name)
    if not (path.exists() and _sha256(path) == digest):
        # Per-process part file: concurrent test lanes may fetch the same sdist.
        tmp = path.with_suffix(f".part{os.getpid()}")
        with urllib.request.urlopen(url, timeout=600) as resp, open(tmp, "wb") as out:
            shutil.copyfileobj(resp, out, 1 << 20)
        got = _sha256(tmp)
        if got != digest:
            tmp.unlink()
            raise SourceError(f"{url}: sha256 {got} != index {digest}")
        os.replace(tmp, path)
    digest_file.write_text(digest + "\n")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------- extract


#: Folders (and the connector file) of the offload packages, relative to ``vllm/``.
_PACKAGE_DIRS: tuple[tuple[str, ...], ...] = tuple(
    tuple(name.split(".")[1:]) for name in (*SCOPE_PACKAGES, *CONNECTOR_MODULES)
)


def _module_name(rel: str) -> str | None:
    """``vllm/v1/kv_offload/base.py`` -> ``vllm.v1.kv_offload.base`` (None for non-.py)."""
    if not rel.endswith(".py"):
        return None
    name = rel[:-3].replace("/", ".")
    return name.removesuffix(".__init__")


def offload_scope(package_sources: dict[str, str]) -> tuple[dict[str, str], frozenset[str]]:
    """``(in-scope sources, worker-side modules)`` of one release's offload-package sources
    (:func:`sdist_package_sources` or :func:`installed_package_sources`): the scope rule
    of :mod:`kvguard.guards.hooking.sites`, by name and by import. Pure."""
    worker_side = worker_side_modules(package_sources)
    return {m: src for m, src in package_sources.items() if in_scope(m, worker_side)}, worker_side


def sdist_package_sources(sdist: Path) -> dict[str, str]:
    """``{module: source}`` of every module of the offload packages in a vLLM sdist (read,
    not extracted)."""
    out: dict[str, str] = {}
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            if not member.isfile():
                continue
            rel = member.name.split("/", 1)[1] if "/" in member.name else member.name
            if not rel.startswith("vllm/"):
                continue
            name = _module_name(rel)
            if name and in_offload_packages(name):
                f = tar.extractfile(member)
                if f is not None:
                    out[name] = f.read().decode("utf-8")
    if not out:
        raise SourceError(f"{sdist}: no offload modules in this sdist")
    return out


def sdist_offload_sources(sdist: Path) -> dict[str, str]:
    """``{module: source}`` of every in-scope module in a vLLM sdist (:func:`offload_scope`)."""
    return offload_scope(sdist_package_sources(sdist))[0]


def installed_package_sources() -> dict[str, str]:
    """``{module: source}`` of every module of the offload packages of the installed vLLM
    (files only; ``vllm`` is located, never imported). Raises :class:`SourceError`
    without vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        raise SourceError("vLLM is not installed")
    root = Path(spec.origin).parent
    out: dict[str, str] = {}
    for sub in _PACKAGE_DIRS:
        base = root.joinpath(*sub)
        paths = [base.with_suffix(".py")] if base.with_suffix(".py").is_file() else sorted(base.rglob("*.py"))
        for path in paths:
            name = _module_name("vllm/" + path.relative_to(root).as_posix())
            if name and in_offload_packages(name) and path.is_file():
                out[name] = path.read_text(encoding="utf-8")
    return out


def installed_offload_sources() -> dict[str, str]:
    """``{module: source}`` of every in-scope module of the installed vLLM
    (:func:`offload_scope`). Raises :class:`SourceError` without vLLM."""
    return offload_scope(installed_package_sources())[0]


def installed_module_source(module: str) -> str | None:
    """The source text of one module of the installed vLLM (``"vllm.a.b"`` -> ``vllm/a/b.py``
    or ``vllm/a/b/__init__.py``), or None where the release has no such module (or no vLLM
    is installed). Nothing is imported: safe before the guard's import hook is installed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin or not module.startswith("vllm."):
        return None
    base = Path(spec.origin).parent.joinpath(*module.split(".")[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path.read_text(encoding="utf-8")
    return None


class _Spec:
    """Stand-in KV cache specs for evaluating the release's own window-size function."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def _spec_classes() -> dict[str, type]:
    full = type("FullAttentionSpec", (_Spec,), {})
    swa = type("SlidingWindowSpec", (full,), {})
    return {
        "KVCacheSpec": _Spec, "AttentionSpec": _Spec, "FullAttentionSpec": full, "SlidingWindowSpec": swa,
        "MambaSpec": type("MambaSpec", (_Spec,), {}),
        "ChunkedLocalAttentionSpec": type("ChunkedLocalAttentionSpec", (_Spec,), {}),
    }


def _window_size_function(sources: dict[str, str], classes: dict[str, type]) -> tuple[str, Any]:
    """The release's ``get_sliding_window_size_in_{blocks,chunks}``, compiled alone with
    stand-in spec classes and ``cdiv`` (annotations dropped: they name vLLM types)."""
    for module, source in sorted(sources.items()):
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("get_sliding_window_size_in_"):
                node.returns = None
                for arg in [*node.args.args, *node.args.kwonlyargs]:
                    arg.annotation = None
                namespace: dict[str, Any] = {"cdiv": cdiv, **classes}
                exec(compile(ast.Module(body=[node], type_ignores=[]), module, "exec"), namespace)  # noqa: S102
                return node.name, namespace[node.name]
    raise SourceError("no get_sliding_window_size_in_* function on this release's offload path")


class _Names:
    """Resolves the attribute reads of vLLM's bound expression by what they mean."""

    def __init__(self, window_chunks: int, blocks_per_chunk: int, tokens_per_block: int) -> None:
        self._values = (window_chunks, blocks_per_chunk, tokens_per_block)

    def __getattr__(self, name: str) -> Any:
        window_chunks, bpc, tpb = self._values
        if "sliding_window" in name or "window_size_in" in name:
            return window_chunks
        if name in ("block_size_factor", "blocks_per_chunk"):
            return bpc
        if name in ("gpu_block_size", "tokens_per_block"):
            return tpb
        if name == "config":
            return self
        raise SourceError(f"vLLM's window bound reads {name!r}, which kvguard cannot derive from a geometry")


def asserted_window_bound(
    sources: dict[str, str], sliding_window: int, tokens_per_block: int, tokens_per_chunk: int,
    extra_retained_tokens: int = 0,
) -> tuple[int, str]:
    """``(bound, expression)``: the pending GPU blocks the release's window assert allows
    for one sliding-window group (vLLM #48959), and the assert's bound expression.

    ``sliding_window``, ``tokens_per_block`` (GPU block), ``tokens_per_chunk`` (offloaded
    block), ``extra_retained_tokens``: tokens. Raises :class:`SourceError` when the release
    has no window assert or its expression reads something kvguard cannot derive."""
    window = None
    for module, source in sorted(sources.items()):
        found = discover(module, ast.parse(source)).special.get(SPECIAL_WINDOW)
        if found:
            window = found[0]
            break
    if window is None or not window.bound_expr:
        raise SourceError("no sliding-window pending-block assert on this release's offload path")
    classes = _spec_classes()
    _, window_size = _window_size_function(sources, classes)
    spec = classes["SlidingWindowSpec"](
        sliding_window=sliding_window, extra_retained_tokens=extra_retained_tokens, block_size=tokens_per_block,
    )
    window_chunks = window_size(spec, tokens_per_chunk)
    names = _Names(int(window_chunks), tokens_per_chunk // tokens_per_block, tokens_per_block)
    expr = ast.parse(window.bound_expr, mode="eval")
    free = {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}
    bound = eval(compile(expr, "<vllm bound>", "eval"), {"cdiv": cdiv}, {n: names for n in free})  # noqa: S307
    return int(bound), window.bound_expr
