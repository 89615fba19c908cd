# syntax=docker/dockerfile:1
#
# kvstore image (kvstore-cache + kvstore-client): `kvstore master|worker|check ...` as uid 10001.
#
#   docker build -t kvstore:0.1.0 .
#   docker build --build-arg EXTRAS=ucx -t kvstore:0.1.0-ucx .   # with the UCX/RDMA transport
#   bash scripts/build_image.sh   # podman, with a debootstrap base; builds and smoke-tests (CI)
#
# PYTHON_IMAGE is any Debian-like image with python3 (>= 3.11), venv and pip; CI passes
# a minbase made by debootstrap. The benchmarks (bench/) are not in the image: `kvstore
# bench` is loaded only when run and says so. The Helm chart (deploy/helm/kvstore) runs
# the image with a read-only root filesystem and mounts /tmp, /dev/shm (the hand-over
# socket of the DRAM arena, which is itself an anonymous memfd) and /data (SSD tier)
# as volumes.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Optional extras of the kvstore package, e.g. "ucx" (comma-separated).
ARG EXTRAS=""
COPY pyproject.toml README.md ./
COPY client ./client
COPY kvstore ./kvstore
RUN python -m venv /opt/kvstore \
 && /opt/kvstore/bin/pip install ./client ".${EXTRAS:+[${EXTRAS}]}" \
 && /opt/kvstore/bin/kvstore version \
 && /opt/kvstore/bin/kvstore --help >/dev/null

FROM ${PYTHON_IMAGE}
ARG KVSTORE_UID=10001
LABEL org.opencontainers.image.title="kvstore" \
      org.opencontainers.image.description="Distributed KV-cache store for LLM inference" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid "${KVSTORE_UID}" kvstore \
 && useradd --system --uid "${KVSTORE_UID}" --gid "${KVSTORE_UID}" \
      --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin kvstore \
 && install -d -o "${KVSTORE_UID}" -g "${KVSTORE_UID}" -m 0750 /data
COPY --from=build /opt/kvstore /opt/kvstore
ENV PATH=/opt/kvstore/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
USER ${KVSTORE_UID}:${KVSTORE_UID}
WORKDIR /tmp
# 7700 master gRPC, 7701 worker gRPC, 7702 worker TCP transfers, 9100 metrics.
EXPOSE 7700 7701 7702 9100
ENTRYPOINT ["kvstore"]
CMD ["--help"]
