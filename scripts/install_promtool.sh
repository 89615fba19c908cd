#!/usr/bin/env bash
# Installs promtool, which `make test` uses to check and unit-test the Prometheus alert
# rules (deploy/prometheus/): Debian's `prometheus` package, without starting its
# server. Does nothing when promtool is present; needs root (or sudo) otherwise.
# Usage: scripts/install_promtool.sh      (CI calls it before `make test`)
set -euo pipefail

have() { command -v "$1" >/dev/null 2>&1; }

if have promtool; then
  echo "install_promtool: $(promtool --version 2>&1 | head -1)"
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if have sudo; then SUDO="sudo -n"; else
    echo "install_promtool: need root to apt-get install prometheus" >&2
    exit 1
  fi
fi
if ! have apt-get; then
  echo "install_promtool: no apt-get; put promtool (from a Prometheus release) on PATH" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# policy-rc.d 101: the package must not start a Prometheus server.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
  $SUDO chmod +x "$policy"
  created_policy=1
fi
trap 'if [ "$created_policy" = 1 ]; then $SUDO rm -f "$policy"; fi' EXIT
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
echo "install_promtool: installed $(promtool --version 2>&1 | head -1)"
