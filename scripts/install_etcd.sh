#!/usr/bin/env bash
# Installs what the HA and network-namespace tests need, idempotently:
#   etcd (Debian's etcd-server, 3.4+) and iproute2 (`ip netns`, veth, bridges).
# Does nothing when both are present; needs root (or sudo) otherwise.
# Usage: scripts/install_etcd.sh            (CI calls it before `make test`)
set -euo pipefail

have() { command -v "$1" >/dev/null 2>&1; }

missing=()
have etcd || missing+=(etcd-server)
have ip || missing+=(iproute2)
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_etcd: etcd $(etcd --version 2>/dev/null | awk 'NR==1{print $3}') and iproute2 present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if have sudo; then SUDO="sudo -n"; else
    echo "install_etcd: need root to apt-get install ${missing[*]}" >&2
    exit 1
  fi
fi
if ! have apt-get; then
  echo "install_etcd: no apt-get; install ${missing[*]} by hand" >&2
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# policy-rc.d 101: the package must not start a system etcd; the tests start their own.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
  $SUDO chmod +x "$policy"
  created_policy=1
fi
trap 'if [ "$created_policy" = 1 ]; then $SUDO rm -f "$policy"; fi' EXIT
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install_etcd: installed ${missing[*]}: $(etcd --version | awk 'NR==1{print $3}')"
