#!/usr/bin/env bash
# Build the kvstore container image and smoke-test it the way the Helm chart runs it.
#
#   bash scripts/build_image.sh            # build kvstore:<version> and smoke-test it
#   SMOKE=0 bash scripts/build_image.sh    # build only
#
# Needs only Debian packages (installed when missing and running as root): podman, runc
# (crun refuses hybrid cgroup hosts), debootstrap. The base image is made here with
# `debootstrap --variant=minbase` from the Debian mirror apt already uses and
# `podman import`ed, so no registry is needed; it is cached as localhost/kvstore-base:<suite>.
# The host's CA bundle is mounted read-only into the build so pip reaches the index
# through a TLS-inspecting proxy too.
#
# About 4-9 minutes cold (debootstrap and pip), under a minute with the cache.
#
# Smoke test: a master and a worker, each in its own container with a read-only root
# filesystem, uid 10001, no capabilities, tmpfs /tmp and a small /dev/shm for the arena's
# hand-over socket (the chart's securityContext and volumes; the arena is a memfd,
# charged to the container's memory), then `kvstore check` (inside the worker's container
# over shm://, and from a third container over tcp://). Every container this script
# started is removed on exit, whatever happens.
set -euo pipefail
cd "$(dirname "$0")/.."

SUITE=${SUITE:-$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")}
BASE=${BASE:-localhost/kvstore-base:$SUITE}
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
IMAGE=${IMAGE:-localhost/kvstore:$VERSION}
SMOKE=${SMOKE:-1}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}

say() { printf '== %s\n' "$*" >&2; }

need() {
  local missing=()
  for tool in podman runc debootstrap; do
    command -v "$tool" >/dev/null || missing+=("$tool")
  done
  if ((${#missing[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
      echo "missing: ${missing[*]} (apt-get install podman runc debootstrap)" >&2
      exit 1
    fi
    say "installing podman runc debootstrap"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      podman runc debootstrap uidmap containernetworking-plugins iptables
  fi
}

# The first Debian mirror apt uses here (deb822 .sources or one-line sources.list).
mirror() {
  local m=""
  m=$(grep -hsE '^URIs:' /etc/apt/sources.list.d/*.sources | grep -v security |
    awk '{print $2; exit}') || true
  if [[ -z $m ]]; then
    m=$(grep -hsE '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list |
      grep -v security | awk '{for (i=2;i<=NF;i++) if ($i ~ /^https?:/) {print $i; exit}}') || true
  fi
  echo "${m:-http://deb.debian.org/debian}"
}

need
WORK=$(mktemp -d)
STARTED=()
cleanup() {
  local c
  for c in "${STARTED[@]}"; do
    podman rm -f -t 5 "$c" >/dev/null 2>&1 || true
  done
  rm -rf "$WORK"
}
trap cleanup EXIT

# runc, cgroupfs and capped ulimits (the defaults exceed what this kernel allows).
cat >"$WORK/containers.conf" <<'EOF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
export CONTAINERS_CONF="$WORK/containers.conf"

if ! podman image exists "$BASE"; then
  MIRROR=$(mirror)
  say "base image $BASE: debootstrap --variant=minbase $SUITE from $MIRROR"
  debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates,passwd \
    "$SUITE" "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 ||
    { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
  rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
  tar -C "$WORK/rootfs" -c . | podman import - "$BASE" >/dev/null
  rm -rf "$WORK/rootfs"
fi

say "building $IMAGE (base $BASE)"
podman build --network host --build-arg "PYTHON_IMAGE=$BASE" \
  -v "$CA_BUNDLE:/etc/ssl/certs/ca-certificates.crt:ro" \
  -t "$IMAGE" -f Dockerfile .
podman image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' "$IMAGE" >&2
# Untagged images of earlier builds (about 340 MB each): keep a day's worth as cache.
podman image prune -f --filter until=24h >/dev/null || true

[[ $SMOKE == 1 ]] || exit 0

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
MASTER_PORT=$(free_port)
GRPC_PORT=$(free_port)
TCP_PORT=$(free_port)
# As the chart runs it: read-only root, non-root uid, no capabilities, tmpfs volumes.
RUN=(podman run --network host --read-only --read-only-tmpfs=false --user 10001:10001
  --cap-drop ALL --security-opt no-new-privileges --tmpfs /tmp:rw,size=64m,mode=1777)
NAME=kvstore-smoke-$$

say "smoke: master on 127.0.0.1:$MASTER_PORT, worker grpc $GRPC_PORT tcp $TCP_PORT"
STARTED+=("$NAME-master")
"${RUN[@]}" -d --name "$NAME-master" "$IMAGE" master --host 127.0.0.1 --port "$MASTER_PORT" >/dev/null
STARTED+=("$NAME-worker")
"${RUN[@]}" -d --name "$NAME-worker" --shm-size 16m "$IMAGE" worker \
  --master "127.0.0.1:$MASTER_PORT" --host 127.0.0.1 --grpc-port "$GRPC_PORT" \
  --tcp-port "$TCP_PORT" --dram-size 64MiB --max-value-size 1MiB >/dev/null

ok=0
for _ in $(seq 60); do
  if podman exec "$NAME-worker" kvstore check --master "127.0.0.1:$MASTER_PORT" --size 64KiB; then
    ok=1
    break
  fi
  sleep 1
done
if ((ok)); then
  STARTED+=("$NAME-check")
  "${RUN[@]}" --name "$NAME-check" -e KVSTORE_TRANSPORT=tcp "$IMAGE" \
    check --master "127.0.0.1:$MASTER_PORT" --size 1MiB || ok=0
fi
if ((!ok)); then
  for c in master worker; do
    echo "---- $c log" >&2
    podman logs "$NAME-$c" >&2 || true
  done
  echo "image smoke test FAILED" >&2
  exit 1
fi
say "image smoke test passed: $IMAGE"
