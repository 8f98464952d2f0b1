"""The install steps the docs give, run word for word in a fresh virtual environment with vLLM.

No container engine runs on these machines, so the quick start's own-image Dockerfile
(``docs/quickstart.md``) is played by hand: its base image's vLLM release (the ``FROM`` tag)
is installed into a fresh virtual environment, its ``COPY`` is a path mapping, and its
``RUN`` line and the wheel command ``docs/deploy.md`` gives are run as the pages write them,
with that environment's ``python3`` first on ``PATH``. The snippet is linted and parsed as
the repository's own Dockerfile is (``tests/deploy/test_dockerfile.py``: hadolint, the
``dockerfile-parse`` instructions). Run in the lane whose vLLM release is the image's (the
fresh environment reuses the shared uv cache that lane was built from); the other lanes skip
it with that reason.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import version as dist_version
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
UV = ROOT / ".venvs" / "tools" / "bin" / "uv"


def _quickstart_dockerfile() -> str:
    text = (ROOT / "docs" / "quickstart.md").read_text()
    (block,) = re.findall(r"```dockerfile\n(.*?)```", text, re.S)
    return block


def _instructions(dockerfile: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, value)`` per instruction line (a Dockerfile comment is a line of its
    own: a ``#`` after an instruction is part of it, which hadolint refuses below)."""
    out = []
    for line in dockerfile.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        instruction, _, value = line.partition(" ")
        out.append((instruction.upper(), value.strip()))
    return out


def _wheel_command() -> str:
    """The command ``docs/deploy.md`` gives to build kvguard's wheel (no index serves it)."""
    (cmd,) = set(re.findall(r"`(python3 -m pip wheel [^`]+)`", (ROOT / "docs" / "deploy.md").read_text()))
    return cmd


def _image_release() -> str:
    (image,) = [v for i, v in _instructions(_quickstart_dockerfile()) if i == "FROM"]
    return re.fullmatch(r"vllm/vllm-openai:v(\d+\.\d+\.\d+)", image).group(1)


@pytest.fixture
def image_release() -> str:
    release = _image_release()
    installed = dist_version("vllm")  # here, not at import: the light suite collects this module
    if installed != release:
        pytest.skip(f"the quick start's image is vLLM {release} (its FROM tag); this lane runs {installed}")
    return release


def test_the_snippet_and_the_deploy_page_give_the_same_wheel_command():
    """The snippet's first comment and deploy.md name one command, so a reader of either
    page builds the same wheel; the snippet is the shape the run below plays."""
    first = _quickstart_dockerfile().splitlines()[0]
    assert _wheel_command() in first
    names = [i for i, _ in _instructions(_quickstart_dockerfile())]
    assert names == ["FROM", "COPY", "RUN", "ENTRYPOINT", "CMD"]


def test_the_quick_start_dockerfile_is_linted_and_parsed_as_the_repositorys_own(tmp_path):
    from dockerfile_parse import DockerfileParser

    path = tmp_path / "Dockerfile"
    path.write_text(_quickstart_dockerfile())
    # the invocation tests/deploy/test_dockerfile.py lints the repository's Dockerfile with
    hadolint = Path(sys.executable).parent / "hadolint"
    lint = subprocess.run([str(hadolint), "--config", str(ROOT / ".hadolint.yaml"), str(path)],
                          capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    parsed = [(i["instruction"], i["value"]) for i in DockerfileParser(path=str(path)).structure
              if i["instruction"] != "COMMENT"]
    assert [p[0] for p in parsed] == ["FROM", "COPY", "RUN", "ENTRYPOINT", "CMD"]
    # the repository's own vllm target runs under the same entry point
    own = [i["value"] for i in DockerfileParser(path=str(ROOT / "Dockerfile")).structure
           if i["instruction"] == "ENTRYPOINT"]
    assert dict(parsed)["ENTRYPOINT"] in own


def test_the_install_steps_run_word_for_word_in_a_fresh_environment_with_vllm(image_release, tmp_path,
                                                                             tracked_copy):
    assert UV.exists(), f"{UV} missing: scripts/env.sh builds it"
    env = {**os.environ, "UV_CACHE_DIR": os.environ.get("UV_CACHE_DIR", str(Path.home() / ".cache" / "uv")),
           "UV_LINK_MODE": "hardlink", "UV_PYTHON_DOWNLOADS": "never"}
    env.pop("VIRTUAL_ENV", None)
    venv = tmp_path / "venv"
    # the image: a Python with pip (--seed) and the FROM tag's vLLM release
    subprocess.run([str(UV), "venv", "-q", "--seed", "-p", "python3.11", str(venv)], check=True, env=env)
    override = ROOT / "scripts" / "overrides" / f"vllm=={image_release}.txt"
    extra = ["--override", str(override)] if override.exists() else []
    subprocess.run([str(UV), "pip", "install", "-q", "-p", str(venv / "bin" / "python"), *extra,
                    f"vllm=={image_release}"], check=True, env=env)
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    # a checkout of this repository (its tracked files), where deploy.md's command builds the wheel
    checkout = tracked_copy("checkout")
    subprocess.run(["bash", "-c", _wheel_command()], cwd=checkout, check=True, env=env, capture_output=True)
    # COPY src dst, as a path mapping; RUN as written
    steps = _instructions(_quickstart_dockerfile())
    (copy,) = [v for i, v in steps if i == "COPY"]
    src, dst = copy.split()
    (run,) = [v for i, v in steps if i == "RUN"]
    run = run.replace(dst, str(checkout / src).rstrip("/") + "/")
    done = subprocess.run(["bash", "-c", run], check=True, env=env, capture_output=True, text=True)
    assert "Successfully installed" in done.stdout and "kvguard-" in done.stdout
    # vLLM finds the plugin through its entry point and kvguard installs in that process
    probe = subprocess.run(
        [str(venv / "bin" / "python3"), "-c",
         "from vllm.plugins import load_general_plugins; load_general_plugins()"],
        env=env, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-2000:]
    events = [json.loads(line) for line in probe.stderr.splitlines() if line.startswith("{")]
    installed = [e for e in events if e.get("event") == "installed" and e.get("logger") == "kvguard"]
    assert installed and installed[0]["vllm_version"] == image_release
    # the ENTRYPOINT: a child that exits 0 without a stop request exits 70 (docs/deploy.md's table)
    entry = json.loads(dict(steps)["ENTRYPOINT"])
    assert entry[:2] == ["kvguard", "run"]
    child = subprocess.run([*entry, "python3", "-c", "print('served')"], env=env, capture_output=True,
                           text=True, timeout=120)
    assert child.stdout.strip() == "served" and child.returncode == 70
