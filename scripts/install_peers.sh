#!/usr/bin/env bash
# Install the peers the benchmarks and their tests compare against: Debian's redis-server,
# the RDMA user-space libraries Mooncake's wheel links to, and Mooncake Store into .venv.
# Idempotent and quiet: it installs only what is missing. Run from anywhere; VENV
# overrides the virtual environment (default: .venv at the repository root).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
MOONCAKE="mooncake-transfer-engine-non-cuda==0.3.13.post1"
APT_PKGS=(redis-server libibverbs1 librdmacm1)

missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "install_peers: need root or sudo for apt-get" >&2; exit 1; }
    sudo=(sudo)
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -qq >/dev/null
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # The package may start a system-wide redis; the benchmarks start their own.
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "install_peers: no virtual environment at $VENV (run make venv first)" >&2
  exit 1
fi
installed="$("$VENV/bin/python" -m pip show "${MOONCAKE%%==*}" 2>/dev/null || true)"
if [[ "$installed" != *"Version: ${MOONCAKE##*==}"* ]]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$MOONCAKE"
fi
